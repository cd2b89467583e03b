"""fp16/bf16 embedding tables on the CPU kernels: fp32 pooling and updates, stochastic rounding
on write-back (unbiased, seeded, the C kernels' bits equal the torch reference's)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recc.kernels.cpu import native
from recc.kernels.tbe_inputs import OPTIMIZERS, optimizer_state_shapes
from recc.kernels.cpu.tbe import (round_stochastically,
                                  tbe_backward_update_native, tbe_backward_update_reference, tbe_forward,
                                  tbe_forward_native, tbe_forward_reference)

HALF = [torch.float16, torch.bfloat16]
needs_c = pytest.mark.skipif(native.library() is None, reason="the C kernels cannot be built here")


def _neighbours(dtype, n, seed, scale=4.0):
    """n fp32 values strictly between two adjacent representable values of ``dtype``, with the
    pair: x = lo + f * (hi - lo), f uniform in (0.05, 0.95)."""
    g = torch.Generator().manual_seed(seed)
    lo = (torch.randn(n, generator=g) * scale).to(dtype)
    bits = lo.view(torch.int16)
    hi = (bits + torch.where(lo.float() >= 0, 1, -1).to(torch.int16)).view(dtype)
    frac = torch.rand(n, generator=g) * 0.9 + 0.05
    x = lo.float() + frac * (hi.float() - lo.float())
    return x, lo.float(), hi.float()


@pytest.mark.parametrize("scale", [4.0, 1e-6], ids=["normal", "fp16_subnormal"])
@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_unbiased(dtype, scale):
    """Each value rounded under 2,000 seeds: always one of its two neighbours, and the mean of the
    roundings is the value (z < 5 for every one of 64 values; nearest rounding has z ~ 100s)."""
    x, lo, hi = _neighbours(dtype, 64, seed=1, scale=scale)
    seeds = 2000
    draws = torch.stack([round_stochastically(x[None, :], dtype, s, torch.tensor([0]))[0].float()
                         for s in range(seeds)])
    assert bool(((draws == lo) | (draws == hi)).all())
    p = (x - lo) / (hi - lo)
    sigma = (hi - lo).abs() * (p * (1 - p)).sqrt() / seeds ** 0.5
    z = (draws.mean(0) - x).abs() / sigma
    assert float(z.max()) < 5.0, float(z.max())


@needs_c
@pytest.mark.parametrize("dtype", HALF)
def test_c_rounding_equals_the_reference_bit_for_bit(dtype):
    import ctypes  # noqa: F401  (the library is loaded through ctypes)
    lib = native.library()
    # bf16's largest finite values may round up to inf (kept finite), fp16's past 65504 convert plainly
    x = torch.cat([torch.randn(4000) * 5, torch.randn(100) * 1e-6,
                   torch.tensor([0.0, -0.0, 65504.0, 7e4, -7e4, float("inf"), float("-inf"), float("nan"), 1e-40,
                                 3.3895e38, -3.3895e38, 3.4028e38])])
    out = torch.empty(x.numel(), dtype=torch.int16)
    assert lib.recc_round_half_sr(x.data_ptr(), x.numel(), 1 if dtype == torch.float16 else 2, 99, out.data_ptr()) == 0
    ref = round_stochastically(x[None, :], dtype, 99, torch.tensor([0]))[0]
    assert torch.equal(out, ref.view(torch.int16))


def _case(dtype, rows=40, D=16, B=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    w32 = torch.randn(rows, D, generator=g)
    lengths = torch.randint(0, 4, (B,), generator=g)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    lin = torch.randint(0, rows, (int(off[-1]),), generator=g)
    return w32.to(dtype), lin, off, torch.randn(B, D, generator=g)


@needs_c
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("D", [16, 64, 7])
@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
def test_forward_pools_half_rows_in_fp32(dtype, D, mode):
    """D 16 and 64 pool the half rows widened in registers, D 7 through an fp32 copy of each row."""
    w, lin, off, _ = _case(dtype, D=D)
    psw = torch.rand(lin.numel(), generator=torch.Generator().manual_seed(5)) if mode == "weighted" else None
    pooling = "mean" if mode == "mean" else "sum"
    want = F.embedding_bag(lin, w.float(), off, mode=pooling, per_sample_weights=psw, include_last_offset=True)
    for fn in (tbe_forward_native, tbe_forward_reference):
        got = fn(w, lin, off, T=1, B=off.numel() - 1, pooling=pooling, per_sample_weights=psw)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_c
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", HALF)
def test_every_optimizer_updates_half_rows_like_the_reference_and_near_fp32(optimizer, dtype):
    """One update of fp16/bf16 rows: the C kernel's result equals the torch reference's bit for
    bit (same stochastic rounding) and is the fp32 update rounded to a neighbour; the fp32 state
    equals the fp32 kernel's."""
    w, lin, off, grad = _case(dtype, seed=3)
    R, D = w.shape
    B = off.numel() - 1
    kw = dict(T=1, B=B, optimizer=optimizer, lr=0.1, eps=0.1, weight_decay=0.01, step=3)
    states = []
    results = []
    for fn in (tbe_backward_update_native, tbe_backward_update_reference):
        ww = w.clone()
        st = {k: torch.full(s, 0.25) for k, s in optimizer_state_shapes(optimizer, R, D).items()}
        fn(ww, st, lin, off, grad, **kw)
        results.append(ww)
        states.append(st)
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))
    w32 = w.float()
    st32 = {k: torch.full(s, 0.25) for k, s in optimizer_state_shapes(optimizer, R, D).items()}
    tbe_backward_update_native(w32, st32, lin, off, grad, **kw)
    spacing = (w32.abs() * (2 ** -10 if dtype == torch.float16 else 2 ** -7)).clamp(min=1e-6)
    assert bool(((results[0].float() - w32).abs() <= 2 * spacing).all())
    for k in st32:
        torch.testing.assert_close(states[0][k], st32[k], rtol=1e-5, atol=1e-6)
    untouched = torch.ones(R, dtype=torch.bool)
    untouched[lin] = False
    assert torch.equal(results[0][untouched].view(torch.int16), w[untouched].view(torch.int16))


@pytest.mark.parametrize("dtype", HALF)
def test_updates_smaller_than_half_a_spacing_are_not_lost(dtype):
    """An sgd step far below half the spacing of the stored value: nearest rounding would drop it
    every time; stochastic rounding moves the row by one spacing with the right probability, so
    over 1,000 seeds the mean weight is the fp32 update (within 4 standard errors)."""
    w = torch.full((1, 8), 1.0).to(dtype)
    lin, off = torch.tensor([0]), torch.tensor([0, 1])
    grad = torch.full((1, 8), 1.0)
    spacing = 2 ** -10 if dtype == torch.float16 else 2 ** -7          # below 1.0: half that
    lr = spacing / 2 / 10                                              # a tenth of the lower spacing
    got = []
    for seed in range(1000):
        ww = w.clone()
        tbe_backward_update_reference(ww, {}, lin, off, grad, T=1, B=1, optimizer="sgd", lr=lr, seed=seed)
        got.append(ww.float())
    mean = torch.stack(got).mean()
    want = 1.0 - lr
    p = lr / (spacing / 2)
    se = spacing / 2 * (p * (1 - p) / (1000 * 8)) ** 0.5
    assert abs(float(mean) - want) < 4 * se, (float(mean), want, se)
    assert float(mean) < 1.0


def _slots_of(rows: int, lin: torch.Tensor, spare: int = 3, seed: int = 4):
    """A cache's view of ``rows`` rows: slot s holds row ``slot_row[s]`` (the batch's rows and a
    few others, in a shuffled order, plus ``spare`` empty slots, -1), and the batch's ids as slots."""
    g = torch.Generator().manual_seed(seed)
    held = torch.unique(torch.cat([lin, torch.randint(0, rows, (5,), generator=g)]))
    slot_row = torch.cat([held, torch.full((spare,), -1, dtype=torch.int64)])
    slot_row = slot_row[torch.randperm(slot_row.numel(), generator=g)]
    where = torch.full((rows,), -1, dtype=torch.int64)
    where[slot_row[slot_row >= 0]] = (slot_row >= 0).nonzero().flatten()
    return slot_row, where[lin]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", HALF)
def test_slots_keyed_on_their_rows_update_like_the_rows(optimizer, dtype):
    """A cached group's update runs on slots: with ``key_rows`` (slot -> the row it holds), each
    slot's stochastic rounding is its row's, so the slots end bit for bit as the rows they hold
    do when the whole table is updated (the C kernel and the reference alike); keyed on the slot
    (no ``key_rows``) they do not."""
    w, lin, off, grad = _case(dtype, seed=3)
    R, D = w.shape
    B = off.numel() - 1
    kw = dict(T=1, B=B, optimizer=optimizer, lr=0.1, eps=0.1, weight_decay=0.01, step=3)
    shapes = optimizer_state_shapes(optimizer, R, D)
    st = {k: torch.rand(s, generator=torch.Generator().manual_seed(6)) for k, s in shapes.items()}
    slot_row, slot_ids = _slots_of(R, lin)
    held = slot_row.clamp(min=0)
    fns = [tbe_backward_update_reference] + ([tbe_backward_update_native] if native.library() else [])
    for fn in fns:
        want, want_st = w.clone(), {k: v.clone() for k, v in st.items()}
        fn(want, want_st, lin, off, grad, **kw)   # the whole table, resident
        for keyed in (True, False):
            ws = w[held].clone()
            sts = {k: v[held].clone() for k, v in st.items()}
            fn(ws, sts, slot_ids, off, grad, key_rows=slot_row if keyed else None, **kw)
            full = slot_row >= 0
            same = torch.equal(ws[full].view(torch.int16), want[slot_row[full]].view(torch.int16))
            assert same == keyed, (fn.__name__, keyed)
            for k in sts:
                assert torch.equal(sts[k][full], want_st[k][slot_row[full]]), (fn.__name__, k)
