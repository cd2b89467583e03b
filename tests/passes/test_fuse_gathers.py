"""fuse_gathers: on one CPU rank, groups of nn.Embedding gathers become recc.gather_rows, which
trains exactly as the generic pack/lookup/split chain does (and as eager)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import recc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity_support import assert_trains_like_eager  # noqa: E402


class ClickSequence(nn.Module):
    """A sequence recommender written the way session-based code bases write it: the user and
    the city per sample ([B] each, columns of one context tensor), the session's items as one
    flat jagged tensor with per-sample lengths (mean-pooled with index_add_), and a fixed window
    of the last 3 categories ([B, 3])."""

    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(20, 4)
        self.city = nn.Embedding(7, 4)
        self.item = nn.Embedding(30, 4)
        self.cat = nn.Embedding(12, 4)
        self.out = nn.Linear(16, 1)

    def forward(self, context, items, lengths, last_cats):
        b = context.shape[0]
        seg = torch.repeat_interleave(torch.arange(b), lengths)
        hist = torch.zeros(b, 4).index_add_(0, seg, self.item(items))
        hist = hist / lengths.clamp(min=1).unsqueeze(1).float()
        cats = self.cat(last_cats).sum(dim=1)
        user, city = self.user(context[:, 0]), self.city(context[:, 1])
        return self.out(torch.cat([user, city, hist, cats], dim=1)).squeeze(-1)


def _batch(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (b,), generator=g)
    context = torch.stack([torch.randint(0, 20, (b,), generator=g), torch.randint(0, 7, (b,), generator=g)], dim=1)
    return context, torch.randint(0, 30, (int(lengths.sum()),), generator=g), lengths, \
        torch.randint(0, 12, (b, 3), generator=g)


def _example():
    """Lengths [1, 3, 0, 2]: 6 items for 4 samples (an example with one item per sample would
    not tell a sequence from a per-sample id)."""
    lengths = torch.tensor([1, 3, 0, 2])
    return torch.tensor([[1, 0], [5, 6], [7, 6], [2, 1]]), torch.tensor([4, 9, 9, 0, 29, 3]), lengths, \
        torch.tensor([[1, 2, 3]] * 4)


def _changed(program, stage="fuse_gathers"):
    return [line for line in program.stages[stage].diff.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_each_gather_group_becomes_one_gather_rows():
    """Three gather groups (the jagged items, the [B, 3] window, user and city): each chain
    becomes one gather_rows; the rows_like of 1-D ids goes (the piece is the result), the
    [B, 3] one stays (it shapes the rows [B, 3, 4])."""
    torch.manual_seed(0)
    program = recc.compile(ClickSequence(), example_inputs=_example())
    assert _changed(program) == [
        "-sparse_g0  : kjt[t=1,b=6] = recc.pack_sparse([item_ids], [None], None, tables=('item',), rows=(30,), "
        "pad=True)  # @batch_tables",
        "-pooled_g0  : f32[6,4]     = recc.tbe_lookup(tbe_g0, sparse_g0)  # @batch_tables",
        "-tables_g0  : tuple[1x f32[6,4]] = recc.split_cols(pooled_g0, (4,))  # @batch_tables",
        "-item_rows  : f32[6,4]     = getitem(tables_g0, 0)  # table t0=item[30x4,none,jagged]; shard=tw@r0[0:30,0:4]; "
        "@batch_tables",
        "-item       : f32[6,4]     = recc.rows_like(item_rows, items)  # @discover_tables",
        "+rows_g0    : tuple[1x f32[6,4]] = recc.gather_rows(tbe_g0, [item_ids], tables=('item',), rows=(30,))  "
        "# @fuse_gathers",
        "+item       : f32[6,4]     = getitem(rows_g0, 0)  # table t0=item[30x4,none,jagged]; shard=tw@r0[0:30,0:4]; "
        "@fuse_gathers",
        "-sparse_g1  : kjt[t=1,b=12] = recc.pack_sparse([cat_ids], [None], None, tables=('cat',), rows=(12,))  "
        "# @batch_tables",
        "-pooled_g1  : f32[12,4]    = recc.tbe_lookup(tbe_g1, sparse_g1)  # @batch_tables",
        "-tables_g1  : tuple[1x f32[12,4]] = recc.split_cols(pooled_g1, (4,))  # @batch_tables",
        "-cat_rows   : f32[12,4]    = getitem(tables_g1, 0)  # table t1=cat[12x4,none]; shard=tw@r0[0:12,0:4]; "
        "@batch_tables",
        "+rows_g1    : tuple[1x f32[12,4]] = recc.gather_rows(tbe_g1, [cat_ids], tables=('cat',), rows=(12,))  "
        "# @fuse_gathers",
        "+cat_rows   : f32[12,4]    = getitem(rows_g1, 0)  # table t1=cat[12x4,none]; shard=tw@r0[0:12,0:4]; "
        "@fuse_gathers",
        "-sparse_g2  : kjt[t=2,b=4] = recc.pack_sparse([user_ids, city_ids], [None, None], None, tables=('user', "
        "'city'), rows=(20, 7))  # @batch_tables",
        "-pooled_g2  : f32[4,8]     = recc.tbe_lookup(tbe_g2, sparse_g2)  # @batch_tables",
        "-tables_g2  : tuple[2x f32[4,4]] = recc.split_cols(pooled_g2, (4, 4))  # @batch_tables",
        "-user_rows  : f32[4,4]     = getitem(tables_g2, 0)  # table t2=user[20x4,none]; shard=tw@r0[0:20,0:4]; "
        "@batch_tables",
        "-city_rows  : f32[4,4]     = getitem(tables_g2, 1)  # table t3=city[7x4,none]; shard=tw@r0[0:7,0:4]; "
        "@batch_tables",
        "-city       : f32[4,4]     = recc.rows_like(city_rows, getitem_2)  # @discover_tables",
        "-user       : f32[4,4]     = recc.rows_like(user_rows, getitem_1)  # @discover_tables",
        "+rows_g2    : tuple[2x f32[4,4]] = recc.gather_rows(tbe_g2, [user_ids, city_ids], tables=('user', 'city'), "
        "rows=(20, 7))  # @fuse_gathers",
        "+user       : f32[4,4]     = getitem(rows_g2, 0)  # table t2=user[20x4,none]; shard=tw@r0[0:20,0:4]; "
        "@fuse_gathers",
        "+city       : f32[4,4]     = getitem(rows_g2, 1)  # table t3=city[7x4,none]; shard=tw@r0[0:7,0:4]; "
        "@fuse_gathers",
    ]
    text = program.stages["lower"].text
    assert "recc.pack_sparse" not in text and "recc.tbe_lookup" not in text and "recc.split_cols" not in text
    assert "cat        : f32[4,3,4]   = recc.rows_like[cpu](cat_rows, last_cats)  # @discover_tables" in text.splitlines()
    assert text.count("recc.gather_rows[cpu]") == 3


def _train(program, batches, optimizer):
    dmodel = program.instantiate()
    dopt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
    outs = []
    for args in batches:
        out = dmodel(*args)
        outs.append(out.detach().clone())
        out.square().mean().backward()
        dopt.step()
        dopt.zero_grad()
    return outs, dmodel.state_dict()


@pytest.mark.parametrize("optimizer,table_dtype", [("sgd", "fp32"), ("rowwise_adagrad", "fp32"), ("adam", "fp32"),
                                                   ("sgd", "bf16"), ("rowwise_adagrad", "fp16")])
def test_gather_rows_trains_bit_identically_to_the_generic_chain(optimizer, table_dtype):
    """Same rows, same per-row sum order, same optimizer kernel: outputs and every weight and
    state equal bit for bit over steps with repeated ids, an empty history and a batch of 1."""
    torch.manual_seed(1)
    model = ClickSequence()
    batches = [_batch(4, 1), _batch(4, 2), _batch(1, 3), (torch.tensor([[3, 6], [3, 6]]), torch.zeros(0, dtype=torch.int64),
                                                         torch.tensor([0, 0]), torch.tensor([[1, 1, 1], [1, 2, 1]]))]
    config = recc.CompileConfig(optimizer=optimizer, lr=0.1, table_dtype=table_dtype)
    fused = recc.compile(model, example_inputs=_example(), config=config)
    generic = recc.compile(model, example_inputs=_example(), config=config, disable=("fuse_gathers",))
    assert "recc.gather_rows" in fused.ir and "recc.gather_rows" not in generic.ir
    got_outs, got_state = _train(fused, batches, optimizer)
    want_outs, want_state = _train(generic, batches, optimizer)
    for step, (g, w) in enumerate(zip(got_outs, want_outs)):
        assert torch.equal(g, w), f"step {step}"
    assert got_state.keys() == want_state.keys()
    for k in want_state:
        assert torch.equal(got_state[k], want_state[k]), k


def test_gather_rows_trains_like_eager():
    torch.manual_seed(2)
    model = ClickSequence()
    program = recc.compile(model, example_inputs=_example(), config=recc.CompileConfig(optimizer="sgd", lr=0.1))
    assert "recc.gather_rows" in program.ir
    eager = ClickSequence()
    eager.load_state_dict(model.state_dict())
    for m in eager.modules():
        if isinstance(m, nn.Embedding):
            m.sparse = True
    assert_trains_like_eager(eager, program.instantiate(), [_batch(5 - step, 10 + step) for step in range(4)], 0.1)


def test_a_bad_id_names_its_table_and_changes_no_row():
    torch.manual_seed(3)
    program = recc.compile(ClickSequence(), example_inputs=_example())
    dmodel = program.instantiate()
    before = {k: v.clone() for k, v in dmodel.state_dict().items()}
    user, items, lengths, cats = _batch(4, 4)
    items = items.clone()
    items[-1] = 30
    with pytest.raises(IndexError, match=r"table item: id 30 at position \d+ is outside the table's rows \[0, 30\)"):
        dmodel(user, items, lengths, cats)
    for k, v in dmodel.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("kind", ["auto", "table_wise", "row_wise", "data_parallel"])
def test_groups_whose_ids_travel_keep_the_generic_chain(kind):
    """Two ranks: sharded ids go through the input dist; a data-parallel group gathers the
    global batch's ids in backward. Neither becomes gather_rows."""
    program = recc.compile(ClickSequence(), recc.Cluster.local(2), example_inputs=_example(),
                           config=recc.CompileConfig(sharding=kind))
    assert _changed(program) == []
    assert "recc.gather_rows" not in program.ir and "recc.tbe_lookup" in program.ir
