"""Every CUDA kernel, run by the CPU harness (``recc.kernels.cuda.emulator``) through the same
Python launch code a GPU uses, against the CPU reference: TBE forward and the fused backward
with every optimizer, pooling and weight type; fp16/bf16 stochastic rounding; bounds; every codec;
row bucketization.  The harness runs under ASan/UBSan, so a read past a tensor fails here."""
from __future__ import annotations

import pytest
import torch

from bench import gpu_check
from recc.kernels import codecs as ref_codecs
from recc.kernels import linearize_indices, optimizer_state_shapes
from recc.kernels.cpu import tbe as cpu
from recc.kernels.cuda import bucketize, codecs, emulator
from recc.kernels.cuda import tbe as gpu

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(emulator.compiler() is None, reason="the CUDA emulator needs g++")]

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
DIMS = (1, 3, 4, 17, 64, 128, 260, 1024)  # 1024: the backward's largest (D % 4 == 0)


@pytest.fixture(autouse=True, params=[(None, 2), (7, 1)], ids=["in-order", "seeded"])
def _emulated(request):
    """Every test twice: threads in index order on 2 SMs, and in a seeded order on 1 SM (the
    grid-stride kernels then take more turns per thread)."""
    seed, sms = request.param
    with emulator.emulated(seed=seed, sm_count=sms):
        yield


def bags(T, B, rows, mean_len, g, hot=0, empty_every=3):
    """Feature-major local ids/offsets with duplicates, empty bags, and ``hot`` extra ids of row
    0 of table 0 in its first bag (a run long enough to be summed in segments)."""
    lengths = torch.randint(0, 2 * mean_len + 1, (T, B), generator=g)
    lengths.view(-1)[::empty_every] = 0
    lengths[0, 0] += hot
    ids = []
    for t in range(T):
        n = int(lengths[t].sum())
        x = torch.where(torch.rand(n, generator=g) < 0.3, torch.randint(0, min(rows[t], 5), (n,), generator=g),
                        torch.randint(0, rows[t], (n,), generator=g))
        if t == 0 and hot:
            x[:hot] = 0
        ids.append(x)
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
    return torch.cat(ids), offsets


def hsc_of(rows):
    return torch.tensor([0] + list(rows), dtype=torch.int64).cumsum(0)


def rel(got, want):
    assert got.shape == want.shape
    assert not bool(torch.isnan(got).any()), "NaN: a value the kernel never wrote"
    scale = float(want.abs().max()) if want.numel() else 0.0
    return float((got.float() - want.float()).abs().max()) / max(scale, 1e-30) if want.numel() else 0.0


def case(T, D, B, wdtype, seed, hot=0, weighted=False, mean_len=3):
    g = torch.Generator().manual_seed(seed)
    rows = [int(r) for r in torch.randint(8, 60, (T,), generator=g)]
    ids, offsets = bags(T, B, rows, mean_len, g, hot=hot)
    hsc = hsc_of(rows)
    w = (torch.randn(int(hsc[-1]), D, generator=g) * 0.1).to(wdtype)
    psw = torch.rand(ids.numel(), generator=g) + 0.5 if weighted else None
    return g, rows, ids, offsets, hsc, w, psw


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("D", DIMS + (1031,))
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_forward_matches_the_reference(D, pooling, weighted):
    for wdtype in (torch.float32, torch.float16, torch.bfloat16):
        T, B = 3, 7
        g, rows, ids, offsets, hsc, w, psw = case(T, D, B, wdtype, D, weighted=weighted)
        got = gpu.tbe_forward(w, ids, offsets, hsc, T=T, B=B, pooling=pooling, per_sample_weights=psw)
        want = cpu.tbe_forward_reference(w.float(), linearize_indices(ids, offsets, hsc, T, B), offsets, T=T, B=B,
                                         pooling=pooling, per_sample_weights=psw)
        assert rel(got, want) <= 1e-6, (D, wdtype)
        empty = (offsets[1:] == offsets[:-1]).view(T, B).t()  # [B, T]
        assert bool(got.view(B, T, D)[empty].eq(0).all()), "an empty bag pools to 0"


def test_forward_of_a_bag_longer_than_512_ids_and_unaligned_rows():
    T, B, D = 2, 5, 64
    g, rows, ids, offsets, hsc, w, psw = case(T, D, B, torch.float32, 7, hot=700)
    lin = linearize_indices(ids, offsets, hsc, T, B)
    want = cpu.tbe_forward_reference(w, lin, offsets, T=T, B=B)
    assert rel(gpu.tbe_forward(w, ids, offsets, hsc, T=T, B=B), want) <= 1e-6
    # a weight view that starts one float into its storage cannot take 16-byte loads: V = 1
    base = torch.zeros(w.numel() + 1)
    shifted = base[1:].view_as(w)
    shifted.copy_(w)
    assert gpu._vector_width(D, shifted) == 1
    assert rel(gpu.tbe_forward(shifted, ids, offsets, hsc, T=T, B=B), want) <= 1e-6


def test_forward_with_no_ids_or_no_bags():
    w = torch.randn(10, 8)
    hsc = torch.tensor([0, 4, 10])
    out = gpu.tbe_forward(w, torch.zeros(0, dtype=torch.int64), torch.zeros(7, dtype=torch.int64), hsc, T=2, B=3)
    assert torch.equal(out, torch.zeros(3, 16))
    assert gpu.tbe_forward(w, torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), hsc,
                           T=2, B=0).shape == (0, 16)


# ----------------------------------------------------------------------------- backward


def _update_both(T, D, B, wdtype, opt, pooling, weighted, *, hot=0, seed=0, wd=0.01, wd_mode="l2", step=3):
    g, rows, ids, offsets, hsc, w, psw = case(T, D, B, wdtype, seed * 7919 + D, hot=hot, weighted=weighted)
    R = int(hsc[-1])
    grad = torch.randn(B, T * D, generator=g)
    state = {k: torch.rand(s, generator=g) for k, s in optimizer_state_shapes(opt, R, D).items()}
    if opt == "rowwise_adagrad":
        state["momentum1"][::2] = 0.0  # a zero state tells sqrt(m)+eps from sqrt(m+eps)
    w_ref, s_ref = w.float().clone(), {k: v.clone() for k, v in state.items()}
    kw = dict(T=T, B=B, pooling=pooling, per_sample_weights=psw, optimizer=opt, lr=0.05, eps=0.1,
              weight_decay=wd, weight_decay_mode=wd_mode, step=step)
    cpu.tbe_backward_update_reference(w_ref, s_ref, linearize_indices(ids, offsets, hsc, T, B), offsets, grad, **kw)
    w_got = w.clone()
    gpu.tbe_backward_update(w_got, state, ids, offsets, hsc, grad, **kw)
    return w, w_got, w_ref, state, s_ref


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_backward_matches_the_reference(D, opt):
    # sum, mean and weighted sum; a run long enough to be summed in segments
    for pooling, weighted in (("sum", False), ("mean", False), ("sum", True)):
        w, w_got, w_ref, state, s_ref = _update_both(3, D, 9, torch.float32, opt, pooling, weighted,
                                                     hot=gpu.long_run_segment(D) + 40)
        assert rel(w_got, w_ref) <= 2e-5, (pooling, weighted)
        for k in s_ref:
            assert rel(state[k], s_ref[k]) <= 2e-5, k
        untouched = (w_ref == w.float()).all(1)
        assert torch.equal(w_got[untouched], w[untouched]), "rows absent from the batch are not written"


HALF = {torch.float16: (2 ** -10, 2 ** -24), torch.bfloat16: (2 ** -7, 2 ** -133)}  # one step: relative, at 0


@pytest.mark.parametrize("wdtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("D", (3, 64, 260))
def test_backward_half_weights(D, opt, wdtype):
    w, w_got, w_ref, state, s_ref = _update_both(2, D, 9, wdtype, opt, "sum", True, hot=gpu.long_run_segment(D) + 1)
    assert w_got.dtype == wdtype
    # stochastic rounding moves a value by less than one step of its type
    step, tiny = HALF[wdtype]
    assert bool(((w_got.float() - w_ref).abs() <= w_ref.abs() * step + tiny).all())
    for k in s_ref:
        assert rel(state[k], s_ref[k]) <= 2e-5, k


@pytest.mark.parametrize("wdtype", (torch.float32,) + tuple(HALF), ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("D", (17, 64))
def test_slots_keyed_on_their_rows_update_like_the_rows(D, opt, wdtype):
    """A cached group's update on slots: with ``key_rows`` (slot -> the group row it holds, -1
    for an empty slot) each slot rounds as its row does, so the slots end bit for bit as their rows
    in the resident update of the whole table; keyed on the slot, half slots do not (fp32 rows
    have no rounding to key). With a hot row: more than ``long_run_segment(D)`` ids, summed in
    chunks cut from the row's own first id, so the slot's sum is the row's whatever the slot
    numbering puts before it (weighted ids: every contribution differs, so the order shows)."""
    T, B = 2, 9
    g, rows, ids, offsets, hsc, w, psw = case(T, D, B, wdtype, D + 11, hot=gpu.long_run_segment(D) + 6,
                                              weighted=True)
    R = int(hsc[-1])
    lin = linearize_indices(ids, offsets, hsc, T, B)
    assert int((lin == 0).sum()) > gpu.long_run_segment(D)   # row 0: a long run
    grad = torch.randn(B, T * D, generator=g)
    state = {k: torch.rand(s, generator=g) for k, s in optimizer_state_shapes(opt, R, D).items()}
    kw = dict(T=T, B=B, optimizer=opt, lr=0.05, eps=0.1, weight_decay=0.01, step=3, per_sample_weights=psw)
    want, want_st = w.clone(), {k: v.clone() for k, v in state.items()}
    gpu.tbe_backward_update(want, want_st, ids, offsets, hsc, grad, **kw)
    # the cache: the batch's rows and a few more in shuffled slots, two slots empty
    held = torch.unique(torch.cat([lin, torch.randint(0, R, (4,), generator=g)]))
    slot_row = torch.cat([held, torch.full((2,), -1, dtype=torch.int64)])
    slot_row = slot_row[torch.randperm(slot_row.numel(), generator=g)]
    slot_of = torch.full((R,), -1, dtype=torch.int64)
    full = slot_row >= 0
    slot_of[slot_row[full]] = full.nonzero().flatten()
    S = slot_row.numel()
    # the hot row's slot has ids of other slots before it in the sorted order (the resident row 0 has none)
    assert int((slot_of[lin] < slot_of[0]).sum()) > 0
    # as the CUDA backend runs a cached group: slots for ids, one table of every bag
    slot_hsc = torch.tensor([0, S])
    slot_grad = grad.reshape(B, T, D).transpose(0, 1).reshape(T * B, D)
    for keyed in (True, False):
        ws = w[slot_row.clamp(min=0)].clone()
        sts = {k: v[slot_row.clamp(min=0)].clone() for k, v in state.items()}
        gpu.tbe_backward_update(ws, sts, slot_of[lin], offsets, slot_hsc, slot_grad.contiguous(),
                                key_rows=slot_row if keyed else None, **{**kw, "T": 1, "B": T * B})
        bits = torch.int32 if wdtype == torch.float32 else torch.int16
        same = torch.equal(ws[full].view(bits), want[slot_row[full]].view(bits))
        assert same == (keyed or wdtype == torch.float32), keyed
        for k in sts:
            assert torch.equal(sts[k][full], want_st[k][slot_row[full]]), k


def _hot_row_batch(hot, others, B, g):
    """(ids, per-sample weights, offsets) of one table: ``hot`` = (row, n) gives n ids of that
    row spread over B bags, each with its own weight; ``others`` = [(row, n), ...] adds ids of
    other rows at random places in the bags. The hot row's ids keep their bags, weights and
    index order whatever ``others`` is."""
    row, n = hot
    hot_bag = torch.randint(0, B, (n,), generator=g).sort().values
    hot_w = torch.rand(n, generator=g) + 0.5
    extra = [(r, b, float(x)) for r, k in others
             for b, x in zip(torch.randint(0, B, (k,), generator=g).tolist(), (torch.rand(k, generator=g) + 0.5))]
    bags_ = [[] for _ in range(B)]
    for i in range(n):
        bags_[int(hot_bag[i])].append((row, float(hot_w[i])))
    for r, b, x in extra:
        at = int(torch.randint(0, len(bags_[b]) + 1, (1,), generator=g))
        bags_[b].insert(at, (r, x))
    ids = torch.tensor([r for bag in bags_ for r, _ in bag], dtype=torch.int64)
    psw = torch.tensor([x for bag in bags_ for _, x in bag], dtype=torch.float32)
    offsets = torch.tensor([0] + [len(bag) for bag in bags_]).cumsum(0)
    return ids, psw, offsets


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_a_hot_rows_update_does_not_depend_on_the_rows_around_it(opt):
    """A row with more ids than ``long_run_segment(D)`` is summed in chunks cut from its own first
    id in the sorted order, so its update is bit for bit the same whatever other rows the batch
    holds and however rows are numbered: alone; after 1, 13, 63, 64, 65, 100 or 130 ids of rows
    numbered below it (one of them long too); after the same rows renumbered. The hot row's own
    ids keep their bags, weights and order in every batch (sum pooling: no bag length enters)."""
    D, R, B, HOT = 32, 40, 6, 20
    seg = gpu.long_run_segment(D)
    assert seg == 64
    g = torch.Generator().manual_seed(17)
    w0 = torch.randn(R, D, generator=g)
    grad = torch.randn(B, D, generator=g)
    state0 = {k: torch.rand(s, generator=g) for k, s in optimizer_state_shapes(opt, R, D).items()}
    kw = dict(T=1, B=B, optimizer=opt, lr=0.05, eps=0.1, weight_decay=0.01, step=3)
    hsc = torch.tensor([0, R])

    def hot_row_after(others, perm=None, n_hot=2 * seg + 37):
        ids, psw, offsets = _hot_row_batch((HOT, n_hot), others, B, torch.Generator().manual_seed(3))
        perm = torch.arange(R) if perm is None else perm   # row r is numbered perm[r]
        w = torch.empty_like(w0)
        w[perm] = w0
        state = {}
        for k, v in state0.items():
            state[k] = torch.empty_like(v)
            state[k][perm] = v
        gpu.tbe_backward_update(w, state, perm[ids], offsets, hsc, grad, per_sample_weights=psw, **kw)
        return w[perm[HOT]], {k: v[perm[HOT]] for k, v in state.items()}

    want_w, want_s = hot_row_after([])
    # the CPU reference defines the math (its order differs: within rounding)
    ids, psw, offsets = _hot_row_batch((HOT, 2 * seg + 37), [], B, torch.Generator().manual_seed(3))
    w_ref, s_ref = w0.clone(), {k: v.clone() for k, v in state0.items()}
    cpu.tbe_backward_update_reference(w_ref, s_ref, ids, offsets, grad, per_sample_weights=psw, **kw)
    assert rel(want_w, w_ref[HOT]) <= 2e-5
    layouts = [[(3, 1)], [(3, 13)], [(1, 60), (5, 3)], [(2, 64)], [(0, 65)], [(4, 100)], [(1, 70), (7, 60)]]
    for others in layouts:
        for perm in (None, torch.randperm(R, generator=g)):
            got_w, got_s = hot_row_after(others, perm)
            assert torch.equal(got_w, want_w), (others, perm is not None)
            for k in want_s:
                assert torch.equal(got_s[k], want_s[k]), (others, k)


@pytest.mark.parametrize("wd_mode", ["l2", "decoupled"])
def test_weight_decay_modes(wd_mode):
    for opt in OPTIMIZERS:
        _, w_got, w_ref, state, s_ref = _update_both(2, 16, 6, torch.float32, opt, "sum", False, wd=0.1,
                                                     wd_mode=wd_mode)
        assert rel(w_got, w_ref) <= 2e-5, opt


def test_backward_of_a_wide_row_with_a_gradient_view_off_16_bytes():
    # Found by the harness: a contiguous gradient view at a 4-byte offset forced 1-wide loads,
    # and D=260 (supported) was refused as "above its limit"; it is now copied aligned.
    D, R = 260, 10
    g = torch.Generator().manual_seed(0)
    w = torch.randn(R, D, generator=g)
    ids, offsets, hsc = torch.tensor([1, 2, 3, 1]), torch.tensor([0, 2, 4]), torch.tensor([0, R])
    grad = torch.randn(2 * D + 1, generator=g)[1:].view(2, D)
    assert grad.data_ptr() % 16
    want = w.clone()
    cpu.tbe_backward_update_reference(want, {}, ids, offsets, grad, T=1, B=2, lr=0.1)
    got = w.clone()
    gpu.tbe_backward_update(got, {}, ids, offsets, hsc, grad, T=1, B=2, lr=0.1)
    assert rel(got, want) <= 2e-5
    with pytest.raises(ValueError, match="needs 16-byte aligned weight rows for D=260"):
        view = torch.zeros(R * D + 1)[1:].view(R, D)
        gpu.tbe_backward_update(view, {}, ids, offsets, hsc, grad, T=1, B=2, lr=0.1)


def test_backward_dim_limits():
    w = torch.zeros(4, 257)
    ids, offsets, hsc = torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0, 4])
    with pytest.raises(ValueError, match="D=257 is above its limit"):
        gpu.tbe_backward_update(w, {}, ids, offsets, hsc, torch.ones(1, 257), T=1, B=1, lr=0.1)
    with pytest.raises(ValueError, match="D=1028 is above its limit"):
        gpu.tbe_backward_update(torch.zeros(4, 1028), {}, ids, offsets, hsc, torch.ones(1, 1028), T=1, B=1, lr=0.1)


@pytest.mark.parametrize("lengths", [(600, 530, 700), (100, 3, 100), (65, 1, 2, 64, 130)],
                         ids=["hot", "short-between-long", "edges"])
def test_long_runs_sum_their_segments_in_any_thread_order(lengths):
    # Rows 0, 1, 2, ... with `lengths` ids each, shuffled: the sorted ids put a short run
    # between two long ones inside one segment (the second long run's partial goes to slot 1),
    # runs of exactly 64 and 65 ids (64: D=32's segment, the longest run summed directly),
    # segments that start a run and end one.
    assert gpu.long_run_segment(32) == 64  # the lengths above are chosen around it
    g = torch.Generator().manual_seed(5)
    B, D, R = 4, 32, 40
    ids, offsets = gpu_check.long_run_batch(lengths, B, R, g)  # the batches the GPU check runs too
    hsc = torch.tensor([0, R])
    w0 = torch.randn(R, D, generator=g)
    grad = torch.randn(B, D, generator=g)
    for opt in ("sgd", "rowwise_adagrad"):
        state0 = {k: torch.rand(s, generator=g) for k, s in optimizer_state_shapes(opt, R, D).items()}
        w_ref, s_ref = w0.clone(), {k: v.clone() for k, v in state0.items()}
        cpu.tbe_backward_update_reference(w_ref, s_ref, ids, offsets, grad, T=1, B=B, optimizer=opt, lr=0.1, eps=0.1)
        results = []
        for seed in (None, 1, 2, 3):
            w, state = w0.clone(), {k: v.clone() for k, v in state0.items()}
            emulator.launches.clear()
            with emulator.emulated(seed=seed, sm_count=1):
                gpu.tbe_backward_update(w, state, ids, offsets, hsc, grad, T=1, B=B, optimizer=opt, lr=0.1, eps=0.1)
            assert "tbe_long_run_partials_v4" in emulator.launches
            assert rel(w, w_ref) <= 2e-5, (opt, seed)
            for k in s_ref:
                assert rel(state[k], s_ref[k]) <= 2e-5, (opt, seed, k)
            results.append(w)
        # partials are added in segment order: the same bits whatever the schedule
        assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("seed", [1, 2])
def test_results_do_not_depend_on_the_thread_order(seed):
    for opt in OPTIMIZERS:
        with emulator.emulated(seed=None, sm_count=3):
            _, w_a, w_ref, state_a, _ = _update_both(3, 20, 11, torch.float32, opt, "mean", False, hot=600)
        with emulator.emulated(seed=seed, sm_count=3):
            _, w_b, _, state_b, _ = _update_both(3, 20, 11, torch.float32, opt, "mean", False, hot=600)
        assert torch.equal(w_a, w_b), opt
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


# ----------------------------------------------------------------------------- half rounding


# (type, start, lr, neighbour): one sgd step of lr (gradient 1) far below half the spacing
# at the start, so round-to-nearest would never move; ``neighbour`` is the value one step
# toward the fp32 result (below 1.0 for a positive start; past -1.0, away from zero, for -1.0)
ROUNDING = [(torch.float16, 1.0, 1e-4, 1.0 - 2.0 ** -11), (torch.bfloat16, 1.0, 1e-3, 1.0 - 2.0 ** -8),
            (torch.bfloat16, -1.0, 1e-3, -1.0 - 2.0 ** -7)]


@pytest.mark.parametrize("wdtype,start,lr,neighbour", ROUNDING, ids=["fp16", "bf16", "bf16-negative"])
def test_stochastic_rounding_is_unbiased(wdtype, start, lr, neighbour):
    # Stochastic rounding moves each value to the neighbour with probability frac = lr / spacing,
    # so the fraction moved is frac within a few standard deviations of the binomial count.
    R, D = 4096, 64
    w = torch.full((R, D), start, dtype=wdtype)
    ids = torch.arange(R)
    offsets = torch.arange(R + 1)
    hsc = torch.tensor([0, R])
    gpu.tbe_backward_update(w, {}, ids, offsets, hsc, torch.ones(R, D), T=1, B=R, optimizer="sgd", lr=lr, step=1)
    frac = lr / abs(neighbour - start)
    moved = (w != start)
    assert bool((w[moved].float() == neighbour).all()), "only the two neighbouring values"
    n = R * D
    p = float(moved.float().mean())
    sigma = (frac * (1 - frac) / n) ** 0.5
    assert abs(p - frac) < 5 * sigma, (p, frac, sigma)
    # the rounding is keyed by (seed, row, column): another step draws other bits, the same
    # seed the same ones
    w2 = torch.full((R, D), start, dtype=wdtype)
    gpu.tbe_backward_update(w2, {}, ids, offsets, hsc, torch.ones(R, D), T=1, B=R, optimizer="sgd", lr=lr, step=2)
    w3 = torch.full((R, D), start, dtype=wdtype)
    gpu.tbe_backward_update(w3, {}, ids, offsets, hsc, torch.ones(R, D), T=1, B=R, optimizer="sgd", lr=lr, step=1)
    assert not torch.equal(w, w2) and torch.equal(w, w3)


def test_bf16_rounding_keeps_inf_nan_and_the_largest_finite_value():
    big = torch.finfo(torch.bfloat16).max
    w = torch.tensor([[big, -big, float("inf"), float("nan")]], dtype=torch.bfloat16)
    ids, offsets, hsc = torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0, 1])
    # a push past the largest finite value (in fp32 still finite: 3.39e38 + 1e36) stays finite
    gpu.tbe_backward_update(w, {}, ids, offsets, hsc, torch.tensor([[-1e36, 1e36, 0.0, 0.0]]), T=1, B=1,
                            optimizer="sgd", lr=1.0, step=1)
    assert w[0, 0].item() == big and w[0, 1].item() == -big
    assert w[0, 2].item() == float("inf") and bool(torch.isnan(w[0, 3]))


def test_fp16_small_updates_accumulate_over_steps():
    D, steps, lr = 64, 60, 1e-4
    w = torch.ones(8, D, dtype=torch.float16)
    ids, offsets, hsc = torch.arange(8), torch.arange(9), torch.tensor([0, 8])
    for s in range(steps):
        gpu.tbe_backward_update(w, {}, ids, offsets, hsc, torch.ones(8, D), T=1, B=8, optimizer="sgd", lr=lr,
                                step=s + 1)
    moved = 1.0 - float(w.float().mean())
    assert abs(moved - steps * lr) / (steps * lr) < 0.1


# ----------------------------------------------------------------------------- bounds


def _bad_batch():
    w = torch.randn(30, 8)
    hsc = torch.tensor([0, 10, 30])
    ids = torch.tensor([1, 2, 15, 3])  # 15 >= table 0's 10 rows
    offsets = torch.tensor([0, 2, 3, 3, 4])
    return w, hsc, ids, offsets


def test_a_bad_id_is_the_cpu_paths_index_error_and_writes_nothing():
    w, hsc, ids, offsets = _bad_batch()
    with pytest.raises(IndexError) as cuda_err:
        gpu.tbe_forward(w, ids, offsets, hsc, T=2, B=2, table_names=["user", "item"])
    with pytest.raises(IndexError) as cpu_err:
        cpu.validate_inputs(ids, offsets, hsc, 2, 2, ["user", "item"])
    assert str(cuda_err.value) == str(cpu_err.value)
    assert "'user'" in str(cuda_err.value) and "id 15" in str(cuda_err.value)
    for opt in OPTIMIZERS:
        state = {k: torch.rand(s) for k, s in optimizer_state_shapes(opt, 30, 8).items()}
        before = w.clone(), {k: v.clone() for k, v in state.items()}
        with pytest.raises(IndexError, match="'user'"):
            gpu.tbe_backward_update(w, state, ids, offsets, hsc, torch.ones(2, 16), T=2, B=2, lr=1.0, optimizer=opt,
                                    table_names=["user", "item"], checked=False)
        assert torch.equal(before[0], w), "a bad batch writes no row"
        assert all(torch.equal(before[1][k], state[k]) for k in state)
    neg = torch.tensor([1, 2, -1, 3])
    with pytest.raises(IndexError, match="id -1"):
        gpu.tbe_forward(w, neg, offsets, hsc, T=2, B=2)


def test_a_table_that_claims_rows_past_the_weight_is_never_read_past_it():
    # hash_size_cumsum says 40 rows, the weight has 30: the ids past row 30 are reported and
    # neither read (the sanitizer would stop the kernel) nor written.
    w = torch.randn(30, 8)
    hsc = torch.tensor([0, 10, 40])
    ids = torch.tensor([1, 2, 3, 25])  # table 1 row 25 = weight row 35
    offsets = torch.tensor([0, 2, 3, 3, 4])
    with pytest.raises(IndexError, match="does hash_size_cumsum claim more rows"):
        gpu.tbe_forward(w, ids, offsets, hsc, T=2, B=2)
    before = w.clone()
    with pytest.raises(IndexError, match="does hash_size_cumsum claim more rows"):
        gpu.tbe_backward_update(w, {}, ids, offsets, hsc, torch.ones(2, 16), T=2, B=2, lr=1.0)
    assert torch.equal(w, before)


@pytest.mark.parametrize("offsets", [[0, 2, 1, 3, 4], [0, 2, 3, 3, 9], [1, 2, 3, 3, 4]])
def test_malformed_offsets_are_a_value_error(offsets):
    w, hsc, ids, _ = _bad_batch()
    ids = torch.tensor([1, 2, 5, 3])
    with pytest.raises(ValueError, match="offsets"):
        gpu.tbe_forward(w, ids, torch.tensor(offsets), hsc, T=2, B=2)
    before = w.clone()
    with pytest.raises(ValueError, match="offsets"):
        gpu.tbe_backward_update(w, {}, ids, torch.tensor(offsets), hsc, torch.ones(2, 16), T=2, B=2, lr=1.0)
    assert torch.equal(w, before)


# ----------------------------------------------------------------------------- codecs


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_codecs_match_the_cpu_bytes(precision):
    g = torch.Generator().manual_seed(2)
    for n in (1, 63, 64, 65, 1000, 4097):
        x = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-3, 4, (n,), generator=g).float())
        if n > 100:
            x[5], x[70], x[200] = float("nan"), float("inf"), -3.0e38
            x[300:364] = 0.0  # an all-zero block
        want = ref_codecs.encode(x, precision)
        got = codecs.encode(x, precision)
        assert got.shape == want.shape
        if precision in ("fp16", "bf16"):  # a NaN's payload is not part of the contract
            dtype = torch.float16 if precision == "fp16" else torch.bfloat16
            nan = torch.isnan(x)
            assert torch.equal(got.view(dtype).view(torch.int16)[~nan], want.view(dtype).view(torch.int16)[~nan])
            assert bool(torch.isnan(got.view(dtype)[nan]).all())
        else:
            assert torch.equal(got, want), (precision, n)
        for wire in (want, torch.cat([torch.zeros(1, dtype=torch.uint8), want])[1:]):  # aligned, and not
            dec = codecs.decode(wire, n, precision)
            dref = ref_codecs.decode(want, n, precision)
            assert torch.equal(torch.isnan(dec), torch.isnan(dref))
            assert torch.equal(dec[~torch.isnan(dref)], dref[~torch.isnan(dref)])


# ----------------------------------------------------------------------------- bucketization


def _check_bucketize(ids, offsets, bounds):
    got = bucketize.bucketize_rows(ids, offsets, bounds)
    want = bucketize.bucketize_rows_reference(ids, offsets, bounds)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_bucketization_of_uneven_row_blocks_at_their_edges():
    # ids at r0-1, r0, r1-1, r1 of every block, blocks of uneven (and zero) size, empty bags
    bounds = torch.tensor([0, 1, 7, 7, 40, 41, 100])
    edges = sorted({v for r0, r1 in zip(bounds[:-1].tolist(), bounds[1:].tolist())
                    for v in (r0 - 1, r0, r1 - 1, r1) if 0 <= v < 100})
    ids = torch.tensor(edges * 3)
    g = torch.Generator().manual_seed(0)
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    cuts = torch.sort(torch.randint(0, ids.numel() + 1, (9,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([ids.numel()])])
    _check_bucketize(ids, offsets, bounds)


@pytest.mark.parametrize("B,K", [(1, 1), (1, 2), (100, 3), (333, 8), (60, 70)])
def test_bucketization_matches_the_reference(B, K):
    g = torch.Generator().manual_seed(B * 100 + K)
    rows = 5000
    lengths = torch.randint(0, 9, (B,), generator=g)
    lengths[::4] = 0
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    ids = torch.randint(0, rows, (int(offsets[-1]),), generator=g)
    cuts = torch.sort(torch.randint(1, rows, (K - 1,), generator=g)).values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])])
    _check_bucketize(ids, offsets, bounds)


def test_bucketization_errors():
    bounds = torch.tensor([0, 5, 10])
    with pytest.raises(IndexError, match=r"id 12 in bag 1 \(position 2\)"):
        bucketize.bucketize_rows(torch.tensor([1, 2, 12]), torch.tensor([0, 2, 3]), bounds)
    with pytest.raises(ValueError, match="malformed at bag"):
        bucketize.bucketize_rows(torch.tensor([1, 2, 3]), torch.tensor([0, 3, 2]), bounds)
    lengths, out, perm = bucketize.bucketize_rows(torch.zeros(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
                                                  bounds)
    assert lengths.shape == (2, 3) and not bool(lengths.any()) and out.numel() == 0
