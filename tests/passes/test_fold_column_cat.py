"""fold_column_cat: a torch.cat of every column block of a batched lookup, in order, reads the
lookup itself — no forward copy, no backward concatenation — and trains as before, bit for bit."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import recc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity_support import assert_trains_like_eager  # noqa: E402


class PooledFeatures(nn.Module):
    """The embeddings part of a CTR model as feature-extraction code writes it: one EmbeddingBag
    per sparse field in a ModuleList, the reference DLRM's list-of-offsets input, and the pooled
    fields side by side (``order`` picks the order the user's code concatenates them in)."""

    def __init__(self, rows=(30, 20, 40), dim=4, order=None, dense=0):
        super().__init__()
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in rows)
        self.order = list(order) if order is not None else list(range(len(rows)))
        self.dense = nn.Linear(3, dim) if dense else None

    def forward(self, x, lS_o, lS_i):
        ly = [emb(lS_i[k], lS_o[k]) for k, emb in enumerate(self.emb_l)]
        parts = [ly[k] for k in self.order]
        if self.dense is not None:
            parts = [self.dense(x)] + parts
        return torch.cat(parts, dim=1)


class FieldsAsRows(PooledFeatures):
    """Every field's vector as its own sample row (a set encoder's input): a cat along dim 0."""

    def forward(self, x, lS_o, lS_i):
        ly = [emb(lS_i[k], lS_o[k]) for k, emb in enumerate(self.emb_l)]
        return torch.cat(ly, dim=0)


class TwoHeads(PooledFeatures):
    """The same, and the first field read once more on its own (a wide part's input)."""

    def forward(self, x, lS_o, lS_i):
        ly = [emb(lS_i[k], lS_o[k]) for k, emb in enumerate(self.emb_l)]
        return torch.cat(ly, dim=1) + torch.cat([ly[0]] * len(ly), dim=1)


def _bf16_tables(model: nn.Module) -> nn.Module:
    """The same model with its tables in bf16 (the lookups hand the cat bf16 rows)."""
    for emb in model.emb_l:
        emb.to(torch.bfloat16)
    return model


def _batch(seed: int, b: int = 6, rows=(30, 20, 40)):
    g = torch.Generator().manual_seed(seed)
    offsets, ids = [], []
    for n in rows:
        lengths = torch.randint(0, 4, (b,), generator=g)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]))
        ids.append(torch.randint(0, n, (int(lengths.sum()),), generator=g))
    return torch.randn(b, 3, generator=g), offsets, ids


def _compile(model, **kw):
    return recc.compile(copy.deepcopy(model), recc.Cluster.local(1), example_inputs=_batch(0), **kw)


def _last(program) -> str:
    return program.stages["lower"].text


def test_a_cat_of_every_field_is_the_lookup():
    program = _compile(PooledFeatures())
    assert program.stats["folded_cats"] == 1
    text = _last(program)
    assert "torch.cat" not in text and "split_cols" not in text
    assert text.rstrip().endswith("return [pooled_g0]")


def test_other_inputs_stay_and_the_note_names_the_tables():
    program = _compile(PooledFeatures(dense=1))
    cat = next(line for line in _last(program).splitlines() if line.startswith("cat "))
    assert "torch.cat([dense, pooled_g0], dim=1)" in cat
    assert "# pooled_g0 = emb_l.0 | emb_l.1 | emb_l.2" in cat
    assert "split_cols" not in _last(program)


def test_a_cat_of_a_half_table_s_rows_is_one_cast_of_the_lookup():
    program = _compile(_bf16_tables(PooledFeatures(dense=1)))
    assert program.stats["folded_cats"] == 1
    lines = _last(program).splitlines()
    assert any(line.startswith("pooled_g0_bf16 ") and "pooled_g0.to(bf16)" in line for line in lines)
    cat = next(line for line in lines if line.startswith("cat "))
    assert "torch.cat([dense, pooled_g0_bf16], dim=1)" in cat and "split_cols" not in _last(program)


@pytest.mark.parametrize("order", [(2, 1, 0), (0, 1), (0, 2, 1), (1, 2)])
def test_another_order_or_a_part_is_left_alone(order):
    model = PooledFeatures(order=order)
    program = _compile(model)
    assert program.stats["folded_cats"] == 0
    assert program.stages["fold_column_cat"].diff == ""
    assert "split_cols" in _last(program)


def test_a_cat_along_the_rows_is_left_alone():
    program = _compile(FieldsAsRows())
    assert program.stats["folded_cats"] == 0
    assert "torch.cat([emb_l_0, emb_l_1, emb_l_2], dim=0)" in _last(program)


def test_a_piece_read_elsewhere_keeps_its_split():
    program = _compile(TwoHeads())
    assert program.stats["folded_cats"] == 1
    text = _last(program)
    assert "torch.cat([pooled_g0], dim=1)" not in text
    assert "split_cols" in text  # emb_l_0 is still read by the second cat


@pytest.mark.parametrize("make", [PooledFeatures, lambda: PooledFeatures(dense=1), TwoHeads, FieldsAsRows,
                                  lambda: _bf16_tables(PooledFeatures(dense=1))],
                         ids=["fields", "dense+fields", "piece-twice", "rows", "bf16-tables"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_trains_bit_for_bit_as_without_the_fold(make, optimizer):
    torch.manual_seed(0)
    model = make()
    config = recc.CompileConfig(optimizer=optimizer, lr=0.1)
    folded = _compile(model, config=config).instantiate()
    plain = _compile(model, config=config, disable=("fold_column_cat",)).instantiate()
    opts = [torch.optim.SGD(m.dense_parameters(), lr=0.1) for m in (folded, plain) if list(m.dense_parameters())]
    for step in range(3):
        args = _batch(step + 1)
        a, b = folded(*args), plain(*args)
        assert torch.equal(a, b), f"step {step}: forward"
        a.square().mean().backward()
        b.square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for k, v in plain.state_dict().items():
        assert torch.equal(folded.state_dict()[k], v), k


def test_trains_like_eager():
    torch.manual_seed(0)
    model = PooledFeatures(dense=1)
    eager = copy.deepcopy(model)
    for m in eager.emb_l:
        m.sparse = True
    dmodel = _compile(model, config=recc.CompileConfig(optimizer="sgd", lr=0.05)).instantiate()
    assert_trains_like_eager(eager, dmodel, [_batch(s + 1) for s in range(3)], lr=0.05)
