"""Bad batches: each is a clear error naming the table or argument at fault, raised before any
table row is touched."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, build_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def trained():
    """A compiled tiny DLRM that has taken one training step, and a good batch."""
    torch.manual_seed(0)
    dmodel = recc.compile(build_model("tiny"), config=recc.CompileConfig(optimizer="rowwise_adagrad")).instantiate()
    data = SyntheticData("tiny", seed=2)
    dense_x, lS_o, lS_i, y = data.batch(0)
    F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
    return dmodel, data.batch(1)


def _state(dmodel):
    state = {k: v.clone() for k, v in dmodel.state_dict().items()}
    for g in dmodel.table_groups():
        for name in g.state_names:
            state[f"{g.group_name}.{name}"] = getattr(g, name).clone()
    return state


def _expect_error_and_no_change(dmodel, args, exc, match, y=None):
    before = _state(dmodel)
    with pytest.raises(exc, match=match):
        out = dmodel(*args)
        # Were the forward to pass, backward must not get the chance to touch rows either.
        F.binary_cross_entropy(out, torch.zeros_like(out) if y is None else y).backward()
    after = _state(dmodel)
    assert list(after) == list(before)
    for k in before:
        assert torch.equal(after[k], before[k]), f"{k} changed"


def _with(lst, k, value):
    out = [t.clone() for t in lst]
    out[k] = value
    return out


def test_id_past_the_end_of_its_table(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    ids = lS_i[1].clone()
    ids[3] = 20  # emb_l.1 has 20 rows
    _expect_error_and_no_change(dmodel, (dense_x, lS_o, _with(lS_i, 1, ids)), IndexError,
                                r"table emb_l\.1: id 20 at position 3 is outside the table's rows \[0, 20\)")


def test_negative_id(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    ids = lS_i[2].clone()
    ids[0] = -1
    _expect_error_and_no_change(dmodel, (dense_x, lS_o, _with(lS_i, 2, ids)), IndexError,
                                r"table emb_l\.2: id -1 at position 0 is outside the table's rows \[0, 30\)")


def test_huge_id(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    ids = lS_i[0].clone()
    ids[-1] = 2 ** 40
    _expect_error_and_no_change(dmodel, (dense_x, lS_o, _with(lS_i, 0, ids)), IndexError, r"table emb_l\.0: id 1099511627776")


def test_offsets_that_decrease(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    offs = lS_o[1].clone()
    offs[3] = offs[2] - 1
    _expect_error_and_no_change(dmodel, (dense_x, _with(lS_o, 1, offs), lS_i), ValueError,
                                r"table emb_l\.1: offsets are not non-decreasing at bag 3")


def test_offsets_that_do_not_start_at_zero(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    offs = lS_o[0].clone()
    offs[0] = 1
    _expect_error_and_no_change(dmodel, (dense_x, _with(lS_o, 0, offs), lS_i), ValueError,
                                r"table emb_l\.0: offsets must start at 0, got 1")


def test_offsets_past_the_ids(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    offs = lS_o[2].clone()
    offs[-1] = lS_i[2].numel() + 5
    _expect_error_and_no_change(dmodel, (dense_x, _with(lS_o, 2, offs), lS_i), ValueError,
                                r"table emb_l\.2: last offset \d+ is past the \d+ indices")


def test_tables_with_different_batch_sizes(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    _expect_error_and_no_change(dmodel, (dense_x, _with(lS_o, 1, lS_o[1][:4]), lS_i), ValueError,
                                r"table emb_l\.1: batch of 4 bags, but table emb_l\.0 has 8")


@pytest.mark.parametrize("arg", ["lS_o", "lS_i"])
def test_wrong_number_of_tables(trained, arg):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    args = (dense_x, lS_o[:2], lS_i) if arg == "lS_o" else (dense_x, lS_o, lS_i + [lS_i[0]])
    got = 2 if arg == "lS_o" else 4
    _expect_error_and_no_change(dmodel, args, ValueError,
                                rf"argument {arg}: expected 3 tensors \(one per table: emb_l\.0, emb_l\.1, "
                                rf"emb_l\.2\), got {got}")


def test_wrong_dense_width(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    _expect_error_and_no_change(dmodel, (dense_x[:, :12], lS_o, lS_i), ValueError,
                                r"argument dense_x: expected shape \[B, 13\], got \[8, 12\]")


def test_dense_of_the_wrong_rank(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    _expect_error_and_no_change(dmodel, (dense_x[0], lS_o, lS_i), ValueError,
                                r"argument dense_x: expected shape \[B, 13\], got \[13\]")


def test_float_ids(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    _expect_error_and_no_change(dmodel, (dense_x, lS_o, _with(lS_i, 1, lS_i[1].float())), TypeError,
                                r"argument lS_i\[1\]: expected dtype torch.int64, got torch.float32")


def test_wrong_number_of_arguments(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    _expect_error_and_no_change(dmodel, (dense_x, lS_o), TypeError,
                                r"the compiled model takes 3 arguments \(dense_x, lS_o, lS_i\), got 2")


def test_a_list_where_a_tensor_belongs(trained):
    dmodel, (dense_x, lS_o, lS_i, _) = trained
    _expect_error_and_no_change(dmodel, ([dense_x], lS_o, lS_i), TypeError,
                                r"argument dense_x: expected a tensor, got list")


def test_good_batch_after_bad_ones_still_trains(trained):
    dmodel, (dense_x, lS_o, lS_i, y) = trained
    ids = lS_i[1].clone()
    ids[0] = 99
    with pytest.raises(IndexError):
        dmodel(dense_x, lS_o, _with(lS_i, 1, ids))
    before = dmodel.state_dict()["emb_l.1.weight"].clone()
    F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y).backward()
    after = dmodel.state_dict()["emb_l.1.weight"]
    touched = torch.unique(lS_i[1])
    assert not torch.equal(after[touched], before[touched])
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(after[untouched], before[untouched])


# ----------------------------------------------------------------------------- several groups

class TwoGroups(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.ModuleDict({"a": nn.EmbeddingBag(10, 4), "b": nn.EmbeddingBag(12, 4)})
        self.wide = nn.EmbeddingBag(15, 6, mode="sum")
        self.history = nn.Embedding(9, 4)
        self.top = nn.Linear(4 + 4 + 6 + 4, 1)

    def forward(self, dense, offs, ids, hist):
        x = torch.cat([self.small["a"](ids[0], offs[0]), self.small["b"](ids[1], offs[1]),
                       self.wide(ids[2], offs[2]), self.history(hist).sum(1)], dim=1)
        return torch.sigmoid(self.top(x) + dense.sum(1, keepdim=True))


def _two_group_batch(seed=0, B=4):
    g = torch.Generator().manual_seed(seed)
    offs = [torch.arange(0, 2 * B, 2)] * 3
    ids = [torch.randint(0, n, (2 * B,), generator=g) for n in (10, 12, 15)]
    return [torch.rand(B, 3, generator=g), offs, ids, torch.randint(0, 9, (B, 2), generator=g)]


@pytest.mark.parametrize("where, table", [(2, "wide"), ("hist", "history"), (1, "small.b")])
def test_bad_id_in_a_later_group_changes_no_group(where, table):
    torch.manual_seed(0)
    model = TwoGroups()
    program = recc.compile(model, example_inputs=_two_group_batch(), config=recc.CompileConfig(optimizer="adam"))
    dmodel = program.instantiate()
    assert len(dmodel.table_groups()) == 3
    dense, offs, ids, hist = _two_group_batch(seed=1)
    if where == "hist":
        hist = hist.clone()
        hist[1, 1] = 9
    else:
        ids = _with(ids, where, ids[where].clone())
        ids[where][5] = 100
    table_re = table.replace(".", r"\.")
    _expect_error_and_no_change(dmodel, (dense, offs, ids, hist), IndexError, rf"table {table_re}: id \d+ ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_instantiating_a_cuda_program_without_a_gpu_is_a_clear_error():
    torch.manual_seed(0)
    program = recc.compile(build_model("tiny"), recc.Cluster.local(1, device="cuda"))
    with pytest.raises(ValueError, match="the program is for CUDA devices but torch sees no GPU here"):
        program.instantiate()
    with pytest.raises(ValueError, match="device xla has no recc backend"):
        program.instantiate(device="xla")
