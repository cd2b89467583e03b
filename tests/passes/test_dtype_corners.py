"""Dtype corners of the precision passes that outcome tests within bf16 tolerance let through:

- cast_dense: a bf16 model whose head is an unfused product (``sigmoid(h @ w)``) after a bf16
  layer. The head's result is only read by the sigmoid, so it runs fp32 — on an fp32 cast of the
  bf16 activation and the fp32 parameter as it is. Only ``recc.linear`` may take its bf16 input
  as it is (it widens x itself); a plain product given a bf16 and an fp32 operand fails or
  computes in the wrong dtype, and a bf16 head rounds the logits (bf16 logits tie predictions).
- fold_column_cat: a cat whose pieces have different dtypes (a bf16 table next to fp32 ones, or
  a user's cast of one piece) must fold only runs of one dtype: one cast of the whole lookup
  would round an fp32 table's rows to bf16 (and change the cat's dtype).
The tests read the IR line of the node in question (the mechanism), and the values bit for bit
where the pass promises bit for bit."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import recc

BF16 = recc.CompileConfig(dense_dtype="bf16")


def _line(program, stage: str, name: str) -> str:
    (line,) = [ln for ln in program.stages[stage].text.splitlines() if ln.split(":")[0].strip() == name]
    return line


def _dtype(line: str) -> str:
    """The dtype an IR line's node computes: ``relu : bf16[6,8] = ...`` -> ``bf16``."""
    return line.split("=")[0].split(":")[1].strip().split("[")[0]


# --- cast_dense: an unfused product as the model's head ------------------------------------------

HEADS = {
    "sigmoid(h @ w)": lambda h, w: torch.sigmoid(h @ w),
    "sigmoid(torch.matmul(h, w))": lambda h, w: torch.sigmoid(torch.matmul(h, w)),
    "(h.matmul(w)).squeeze(1).sigmoid()": lambda h, w: h.matmul(w).squeeze(1).sigmoid(),
}


class UnfusedHead(nn.Module):
    """A pooled lookup, a bf16 layer (nn.Linear + relu, fused to recc.linear), then a head that is
    a plain product on a raw parameter, read only by a sigmoid."""

    def __init__(self, head: str):
        super().__init__()
        self.head = head
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.proj = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 1) * 0.3)

    def forward(self, ids, offsets):
        h = torch.relu(self.proj(self.emb(ids, offsets)))
        return HEADS[self.head](h, self.w)


def _ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 20, (12,), generator=g), torch.arange(0, 12, 2)


@pytest.mark.parametrize("head", HEADS)
def test_an_unfused_product_head_after_a_bf16_layer_runs_fp32_on_a_cast_of_its_input(head):
    torch.manual_seed(0)
    model = UnfusedHead(head)
    program = recc.compile(copy.deepcopy(model), recc.Cluster.local(1), example_inputs=_ids(), config=BF16)
    relu = _line(program, "cast_dense", "relu")
    assert _dtype(relu) == "bf16", relu                        # the layer before it is bf16 ...
    matmul = next(ln for ln in program.stages["cast_dense"].text.splitlines() if ln.startswith("matmul "))
    # ... the head is fp32, on an fp32 cast of that bf16 activation and the fp32 weight itself
    # (no bf16 copy of it: the head's logit is only read in fp32).
    assert _dtype(matmul) == "f32", matmul
    assert "relu_f32" in matmul and "w_bf16" not in matmul and "(relu," not in matmul, matmul
    assert _dtype(_line(program, "cast_dense", "relu_f32")) == "f32"
    # The values: the head as eager computes it in fp32 on the program's own bf16 activation.
    # The program's output must be exactly sigmoid(float(h_bf16) @ w): a bf16 head (w or the
    # result rounded to bf16) differs from it in the low bits.
    dmodel = program.instantiate()
    got = dmodel(*_ids())
    assert got.dtype == torch.float32
    # Recompute the bf16 activation as the compiled layer does (bf16 lookup rows, bf16 weights)
    # and check the head against it, within fp32 rounding and far tighter than bf16's 2**-8.
    with torch.no_grad():
        ids, offsets = _ids()
        pooled = model.emb(ids, offsets).to(torch.bfloat16)
        h = torch.relu(torch.nn.functional.linear(pooled, model.proj.weight.to(torch.bfloat16),
                                                  model.proj.bias.to(torch.bfloat16)))
        want = HEADS[head](h.float(), model.w)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # And it trains: the fp32 master weight of the head gets an fp32 gradient.
    got.sum().backward()
    (w,) = [p for n, p in dmodel.named_parameters() if n.split(".")[-1] == "w"]
    assert w.dtype == torch.float32 and w.grad is not None and w.grad.dtype == torch.float32


# --- fold_column_cat: a cat of pieces of different dtypes ----------------------------------------


class Fields(nn.Module):
    """Three pooled fields side by side (``cast`` casts the first field's rows to bf16 in the
    user's code before the cat)."""

    def __init__(self, cast: bool = False):
        super().__init__()
        self.cast = cast
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, 4, mode="sum") for n in (30, 20, 40))

    def forward(self, lS_o, lS_i):
        ly = [emb(lS_i[k], lS_o[k]) for k, emb in enumerate(self.emb_l)]
        if self.cast:
            ly[0] = ly[0].to(torch.bfloat16)
        return torch.cat(ly, dim=1)


def _batch(b: int = 6, rows=(30, 20, 40)):
    g = torch.Generator().manual_seed(1)
    offsets, ids = [], []
    for n in rows:
        lengths = torch.randint(1, 4, (b,), generator=g)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]))
        ids.append(torch.randint(0, n, (int(lengths.sum()),), generator=g))
    return offsets, ids


def _both(model):
    """The model compiled with and without fold_column_cat, and their outputs on one batch."""
    programs = [recc.compile(copy.deepcopy(model), recc.Cluster.local(1), example_inputs=_batch(), disable=d)
                for d in ((), ("fold_column_cat",))]
    with torch.no_grad():
        outs = [p.instantiate()(*_batch()) for p in programs]
    return programs[0], outs


def _assert_fp32_columns_not_rounded(out: torch.Tensor, cols: slice):
    """An fp32 table's pooled columns hold values bf16 cannot: a cast of the whole lookup to bf16
    would have rounded them (the seeded N(0, 1) rows make this certain, not likely)."""
    part = out[:, cols]
    assert part.dtype == torch.float32
    assert not torch.equal(part, part.to(torch.bfloat16).float())


def test_a_cat_of_a_bf16_table_and_fp32_tables_casts_only_the_bf16_lookup():
    """t0 in bf16, t1 and t2 fp32: batch_tables groups them apart; the cat folds into the bf16
    group's one cast and the fp32 group as it is — never one cast across both — and computes bit
    for bit what the unfolded graph does."""
    torch.manual_seed(0)
    model = Fields()
    model.emb_l[0].to(torch.bfloat16)
    program, (folded, unfolded) = _both(model)
    text = program.stages["fold_column_cat"].text
    groups = [ln for ln in text.splitlines() if ln.startswith("tbe_g")]
    assert len(groups) == 2 and "[t0] dim=4 bf16" in groups[0] and "[t1,t2] dim=4 sum" in groups[1], groups
    cat = _line(program, "fold_column_cat", "cat")
    assert "torch.cat([pooled_g0_bf16, pooled_g1], dim=1)" in cat and _dtype(cat) == "f32", cat
    assert "pooled_g0.to(bf16)" in _line(program, "fold_column_cat", "pooled_g0_bf16")
    assert folded.dtype == torch.float32 and torch.equal(folded, unfolded)
    _assert_fp32_columns_not_rounded(folded, slice(4, 12))


def test_a_bf16_table_between_fp32_ones_folds_only_its_own_lookup():
    """t1 in bf16 between fp32 t0 and t2: t0 and t2 share a group whose pieces the cat does not
    read consecutively, so they stay; t1's own (one-table) group becomes one cast."""
    torch.manual_seed(0)
    model = Fields()
    model.emb_l[1].to(torch.bfloat16)
    program, (folded, unfolded) = _both(model)
    cat = _line(program, "fold_column_cat", "cat")
    assert "torch.cat([emb_l_0, pooled_g1_bf16, emb_l_2], dim=1)" in cat and _dtype(cat) == "f32", cat
    assert torch.equal(folded, unfolded)
    _assert_fp32_columns_not_rounded(folded, slice(0, 4))
    _assert_fp32_columns_not_rounded(folded, slice(8, 12))


def test_a_cat_of_one_lookup_s_pieces_in_two_dtypes_is_not_folded():
    """Three fp32 tables in one group, the user's code casting only the first field to bf16: the
    run of pieces has two dtypes, so it is no "run of casts to one dtype" and stays as written
    (the cat reads the cast piece and the two plain ones)."""
    torch.manual_seed(0)
    program, (folded, unfolded) = _both(Fields(cast=True))
    assert program.stats["folded_cats"] == 0
    cat = _line(program, "fold_column_cat", "cat")
    assert "torch.cat([to, emb_l_1, emb_l_2], dim=1)" in cat and _dtype(cat) == "f32", cat
    assert torch.equal(folded, unfolded)
    _assert_fp32_columns_not_rounded(folded, slice(4, 12))
