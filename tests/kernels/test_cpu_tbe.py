"""CPU TBE kernels against independent references built from nn.EmbeddingBag + torch.optim.

Both implementations are exercised: the C fast path (RECC_CPU_KERNELS=native) and the
pure-torch reference (RECC_CPU_KERNELS=reference).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from recc.kernels.cpu import native
from recc.kernels.tbe_inputs import OPTIMIZERS, optimizer_state_shapes
from recc.kernels.cpu.tbe import (
    linearize_indices,
    tbe_backward_update,
    tbe_backward_update_native,
    tbe_backward_update_reference,
    tbe_forward,
    tbe_forward_native,
    tbe_forward_reference,
    validate_inputs,
)

HAVE_GCC = shutil.which("gcc") is not None

# torch's sparse Adagrad warns about sparse invariant checks; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


@pytest.fixture(params=["native", "reference"])
def impl(request, monkeypatch):
    """Forces one implementation through the public dispatching functions."""
    if request.param == "native" and not HAVE_GCC:
        pytest.skip("gcc not available: the C kernels cannot be built")
    monkeypatch.setenv("RECC_CPU_KERNELS", request.param)
    assert native.backend() == request.param
    return request.param


class Case:
    """A random group: T tables of `rows[t]` rows, dim D, B bags per table."""

    def __init__(self, T=3, B=5, D=8, rows=(7, 11, 5), max_len=6, seed=0, dup_pool=None,
                 empty_bags=True):
        g = torch.Generator().manual_seed(seed)
        self.T, self.B, self.D = T, B, D
        self.rows = list(rows)[:T]
        self.names = [f"table_{chr(ord('a') + t)}" for t in range(T)]
        self.hsc = torch.tensor([0] + self.rows).cumsum(0)
        lo = 0 if empty_bags else 1
        lengths = torch.randint(lo, max_len + 1, (T * B,), generator=g)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        parts = []
        for t in range(T):
            n = int(self.offsets[(t + 1) * B] - self.offsets[t * B])
            hi = self.rows[t] if dup_pool is None else min(self.rows[t], dup_pool)
            parts.append(torch.randint(0, hi, (n,), generator=g))
        self.indices = torch.cat(parts)
        self.N = self.indices.numel()
        self.lin = linearize_indices(self.indices, self.offsets, self.hsc, T, B)
        self.weights = torch.randn(sum(self.rows), D, generator=g)
        self.psw = torch.rand(self.N, generator=g) + 0.5
        self.grad = torch.randn(B, T * D, generator=g)

    def table_slice(self, t):
        a, b = int(self.offsets[t * self.B]), int(self.offsets[(t + 1) * self.B])
        return a, b

    def modules(self, mode, sparse):
        mods = []
        for t in range(self.T):
            m = nn.EmbeddingBag(self.rows[t], self.D, mode=mode, sparse=sparse)
            with torch.no_grad():
                m.weight.copy_(self.weights[self.hsc[t]:self.hsc[t + 1]])
            mods.append(m)
        return mods

    def eager_forward(self, mods, psw=None):
        outs = []
        for t, m in enumerate(mods):
            a, b = self.table_slice(t)
            off = self.offsets[t * self.B:(t + 1) * self.B] - a
            outs.append(m(self.indices[a:b], off,
                          per_sample_weights=None if psw is None else psw[a:b]))
        return torch.cat(outs, dim=1)


def new_state(opt, weights):
    R, D = weights.shape
    return {k: torch.zeros(s) for k, s in optimizer_state_shapes(opt, R, D).items()}


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("D", [1, 3, 4, 8, 17, 64, 300])   # 4 and 8: the C kernels' small-dim paths
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_forward_matches_embedding_bag(impl, D, mode):
    c = Case(D=D, seed=D)
    expected = c.eager_forward(c.modules(mode, sparse=False)).detach()
    got = tbe_forward(c.weights, c.lin, c.offsets, T=c.T, B=c.B, pooling=mode)
    assert got.shape == (c.B, c.T * c.D)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("D", [1, 16, 17])
def test_forward_per_sample_weights(impl, D):
    c = Case(D=D, seed=3)
    expected = c.eager_forward(c.modules("sum", sparse=False), psw=c.psw).detach()
    got = tbe_forward(c.weights, c.lin, c.offsets, T=c.T, B=c.B, per_sample_weights=c.psw)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_forward_single_table_and_empty_bags(impl):
    c = Case(T=1, B=6, D=5, rows=(9,), max_len=3, seed=4)
    c.offsets[:4] = 0  # bags 0, 1 and 2 empty (bag 3 takes their ids)
    for mode in ("sum", "mean"):
        expected = c.eager_forward(c.modules(mode, sparse=False)).detach()
        got = tbe_forward(c.weights, c.lin, c.offsets, T=1, B=6, pooling=mode)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert not got[:3].any()  # empty bags pool to 0, mean included


def test_forward_int32_inputs_and_empty_batch(impl):
    c = Case(seed=5)
    got = tbe_forward(c.weights, c.lin.int(), c.offsets.int(), T=c.T, B=c.B)
    ref = tbe_forward_reference(c.weights, c.lin, c.offsets, T=c.T, B=c.B)
    torch.testing.assert_close(got, ref)
    empty = tbe_forward(c.weights, torch.zeros(0, dtype=torch.int64),
                        torch.zeros(c.T * c.B + 1, dtype=torch.int64), T=c.T, B=c.B)
    assert empty.shape == (c.B, c.T * c.D) and not empty.any()


def test_mean_with_per_sample_weights_is_rejected(impl):
    c = Case(seed=6)
    with pytest.raises(ValueError, match="per_sample_weights"):
        tbe_forward(c.weights, c.lin, c.offsets, T=c.T, B=c.B, pooling="mean",
                    per_sample_weights=c.psw)
    with pytest.raises(ValueError, match="per_sample_weights"):
        tbe_backward_update(c.weights, {}, c.lin, c.offsets, c.grad, T=c.T, B=c.B,
                            pooling="mean", per_sample_weights=c.psw, lr=0.1)


# ----------------------------------------------------------------------------- backward


def explicit_update(c, optimizer, grads, touched, *, lr, eps, wd, beta1=0.9, beta2=0.999,
                    step=1, state=None):
    """The documented per-row math, written out on the touched rows of a dense gradient."""
    w = c.weights.clone()
    st = {k: v.clone() for k, v in (state or new_state(optimizer, w)).items()}
    rows = touched.nonzero().flatten()
    g = grads[rows] + wd * w[rows]
    if optimizer == "sgd":
        w[rows] -= lr * g
    elif optimizer == "rowwise_adagrad":
        st["momentum1"][rows] += (g * g).mean(1)
        w[rows] -= lr * g / (st["momentum1"][rows].sqrt() + eps)[:, None]
    elif optimizer == "adagrad":
        st["momentum1"][rows] += g * g
        w[rows] -= lr * g / (st["momentum1"][rows].sqrt() + eps)
    elif optimizer == "adam":
        m = st["momentum1"][rows] * beta1 + (1 - beta1) * g
        v = st["momentum2"][rows] * beta2 + (1 - beta2) * g * g
        st["momentum1"][rows], st["momentum2"][rows] = m, v
        w[rows] -= lr * (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps)
    return w, st


def dense_grads(c, mode, psw=None):
    mods = c.modules(mode, sparse=False)
    (c.eager_forward(mods, psw) * c.grad).sum().backward()
    return torch.cat([m.weight.grad for m in mods])


def touched_rows(c):
    mask = torch.zeros(c.weights.shape[0], dtype=torch.bool)
    mask[c.lin] = True
    return mask


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_sgd_matches_torch_sgd(impl, mode):
    c = Case(T=3, B=8, D=6, rows=(40, 3, 25), max_len=8, seed=10, dup_pool=4)
    mods = c.modules(mode, sparse=mode != "max")  # max pooling has no sparse gradient
    opt = torch.optim.SGD([m.weight for m in mods], lr=0.3)
    (c.eager_forward(mods) * c.grad).sum().backward()
    opt.step()
    expected = torch.cat([m.weight.detach() for m in mods])
    w = c.weights.clone()
    tbe_backward_update(w, {}, c.lin, c.offsets, c.grad, T=c.T, B=c.B, pooling=mode,
                        optimizer="sgd", lr=0.3)
    torch.testing.assert_close(w, expected, rtol=1e-5, atol=1e-6)


def test_sgd_per_sample_weights(impl):
    c = Case(T=2, B=6, D=4, rows=(10, 30), seed=11, dup_pool=3)
    mods = c.modules("sum", sparse=True)
    opt = torch.optim.SGD([m.weight for m in mods], lr=0.1)
    (c.eager_forward(mods, c.psw) * c.grad).sum().backward()
    opt.step()
    w = c.weights.clone()
    tbe_backward_update(w, {}, c.lin, c.offsets, c.grad, T=c.T, B=c.B,
                        per_sample_weights=c.psw, optimizer="sgd", lr=0.1)
    torch.testing.assert_close(w, torch.cat([m.weight.detach() for m in mods]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_adagrad_matches_torch_adagrad(impl, mode):
    c = Case(T=3, B=8, D=5, rows=(20, 6, 9), max_len=7, seed=12, dup_pool=5)
    mods = c.modules(mode, sparse=mode != "max")  # a dense gradient's zero rows change nothing
    opt = torch.optim.Adagrad([m.weight for m in mods], lr=0.2, eps=1e-8,
                              initial_accumulator_value=0.0, lr_decay=0.0)
    (c.eager_forward(mods) * c.grad).sum().backward()
    opt.step()
    w = c.weights.clone()
    state = new_state("adagrad", w)
    tbe_backward_update(w, state, c.lin, c.offsets, c.grad, T=c.T, B=c.B, pooling=mode,
                        optimizer="adagrad", lr=0.2, eps=1e-8)
    torch.testing.assert_close(w, torch.cat([m.weight.detach() for m in mods]),
                               rtol=1e-5, atol=1e-6)
    torch_sum = torch.cat([opt.state[m.weight]["sum"] for m in mods])
    torch.testing.assert_close(state["momentum1"], torch_sum, rtol=1e-5, atol=1e-6)


def test_adam_matches_sparse_adam_over_steps(impl):
    T, B, D, rows = 2, 6, 4, (15, 8)
    base = Case(T=T, B=B, D=D, rows=rows, seed=13)
    mods = base.modules("sum", sparse=True)
    opt = torch.optim.SparseAdam([m.weight for m in mods], lr=0.05, betas=(0.9, 0.99),
                                 eps=1e-8)
    w = base.weights.clone()
    state = new_state("adam", w)
    for step in range(1, 5):
        c = Case(T=T, B=B, D=D, rows=rows, seed=100 + step, dup_pool=4 + step)
        opt.zero_grad()
        (c.eager_forward(mods) * c.grad).sum().backward()
        opt.step()
        tbe_backward_update(w, state, c.lin, c.offsets, c.grad, T=T, B=B, optimizer="adam",
                            lr=0.05, beta1=0.9, beta2=0.99, eps=1e-8, step=step)
    # SparseAdam puts eps outside the bias correction of v (eps*sqrt(1-b2^t) here): the
    # difference is far below these tolerances for O(1) gradients.
    torch.testing.assert_close(w, torch.cat([m.weight.detach() for m in mods]),
                               rtol=1e-4, atol=1e-5)
    m1 = torch.cat([opt.state[m.weight]["exp_avg"] for m in mods])
    m2 = torch.cat([opt.state[m.weight]["exp_avg_sq"] for m in mods])
    torch.testing.assert_close(state["momentum1"], m1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["momentum2"], m2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_rowwise_adagrad_matches_fbgemm_math(impl, mode):
    c = Case(T=3, B=7, D=9, rows=(12, 30, 4), max_len=9, seed=14, dup_pool=3)
    state = new_state("rowwise_adagrad", c.weights)
    state["momentum1"].uniform_(0.0, 0.5)
    expected_w, expected_state = explicit_update(
        c, "rowwise_adagrad", dense_grads(c, mode), touched_rows(c), lr=0.1, eps=1e-8,
        wd=0.0, state=state)
    w = c.weights.clone()
    tbe_backward_update(w, state, c.lin, c.offsets, c.grad, T=c.T, B=c.B, pooling=mode,
                        optimizer="rowwise_adagrad", lr=0.1)
    torch.testing.assert_close(w, expected_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["momentum1"], expected_state["momentum1"],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_weight_decay(impl, optimizer):
    c = Case(T=2, B=6, D=5, rows=(9, 14), seed=15, dup_pool=4)
    expected_w, expected_state = explicit_update(
        c, optimizer, dense_grads(c, "sum", c.psw), touched_rows(c), lr=0.05, eps=1e-6,
        wd=0.1, step=3)
    w = c.weights.clone()
    state = new_state(optimizer, w)
    tbe_backward_update(w, state, c.lin, c.offsets, c.grad, T=c.T, B=c.B,
                        per_sample_weights=c.psw, optimizer=optimizer, lr=0.05, eps=1e-6,
                        weight_decay=0.1, step=3)
    torch.testing.assert_close(w, expected_w, rtol=1e-5, atol=1e-6)
    for k in state:
        torch.testing.assert_close(state[k], expected_state[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_untouched_rows_are_bit_identical(impl, optimizer):
    c = Case(T=3, B=4, D=7, rows=(50, 60, 40), max_len=4, seed=16)
    w = c.weights.clone()
    state = new_state(optimizer, w)
    for v in state.values():
        v.uniform_(0.1, 1.0)
    before_state = {k: v.clone() for k, v in state.items()}
    tbe_backward_update(w, state, c.lin, c.offsets, c.grad, T=c.T, B=c.B,
                        optimizer=optimizer, lr=0.1, weight_decay=0.01)
    untouched = ~touched_rows(c)
    assert untouched.sum() > 50
    assert torch.equal(w[untouched], c.weights[untouched])
    assert not torch.equal(w[~untouched], c.weights[~untouched])
    for k, v in state.items():
        assert torch.equal(v[untouched], before_state[k][untouched])


# ------------------------------------------------------------------ fast path vs reference


def _both(c, optimizer, *, pooling="sum", psw=None, lin=None, **kw):
    lin = c.lin if lin is None else lin
    out = []
    for fn in (tbe_backward_update_native, tbe_backward_update_reference):
        w = c.weights.clone()
        state = new_state(optimizer, w)
        for v in state.values():
            v.fill_(0.25)
        fn(w, state, lin, c.offsets, c.grad, T=c.T, B=c.B, pooling=pooling,
           per_sample_weights=psw, optimizer=optimizer, lr=0.1, step=2, **kw)
        out.append((w, state))
    return out


needs_gcc = pytest.mark.skipif(not HAVE_GCC, reason="gcc not available")


@pytest.fixture(params=["direct", "hashed"])
def row_map(request, monkeypatch):
    """The backward's row -> slot map: the direct per-row map (weights that fit half the
    last-level cache), or the per-unit hash map bigger weights get."""
    import recc.kernels.cpu.tbe as tbe_mod
    if request.param == "hashed":
        monkeypatch.setattr(tbe_mod, "direct_map_rows", lambda: 0)
    return request.param


@needs_gcc
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_hashed_row_map_is_bit_identical_to_the_direct_one(optimizer, monkeypatch):
    import recc.kernels.cpu.tbe as tbe_mod
    c = Case(T=4, B=64, D=16, rows=(1000, 7, 3000, 64), max_len=12, seed=5, dup_pool=40)
    out = []
    for rows_limit in (1 << 40, 0):
        monkeypatch.setattr(tbe_mod, "direct_map_rows", lambda n=rows_limit: n)
        for step in (1, 2):   # the second call reuses the thread's map (stale entries must read as empty)
            w = c.weights.clone() if step == 1 else w
            state = new_state(optimizer, w) if step == 1 else state
            tbe_backward_update_native(w, state, c.lin, c.offsets, c.grad, T=4, B=c.B, optimizer=optimizer,
                                       lr=0.1, step=step)
        out.append((w, state))
    assert torch.equal(out[0][0], out[1][0])
    for k in out[0][1]:
        assert torch.equal(out[0][1][k], out[1][1][k]), k


@needs_gcc
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("D", [1, 4, 8, 16, 32, 64, 128, 13])
def test_native_matches_reference(optimizer, D, row_map):
    c = Case(T=4, B=16, D=D, rows=(100, 7, 300, 64), max_len=12, seed=20 + D, dup_pool=9)
    for pooling, psw in (("sum", None), ("mean", None), ("sum", c.psw)):
        (wn, sn), (wr, sr) = _both(c, optimizer, pooling=pooling, psw=psw, weight_decay=0.01)
        torch.testing.assert_close(wn, wr, rtol=1e-5, atol=1e-6)
        for k in sn:
            torch.testing.assert_close(sn[k], sr[k], rtol=1e-5, atol=1e-6)


@needs_gcc
def test_native_rows_shared_across_tables(row_map):
    # Linearized ids of different tables hitting the same rows (not what linearize_indices
    # produces, but the kernel must still sum them and update each row once).
    c = Case(T=3, B=8, D=8, rows=(20, 20, 20), max_len=6, seed=30)
    lin = c.indices.clone()  # every table's ids land in rows [0, 20)
    for optimizer in OPTIMIZERS:
        (wn, sn), (wr, sr) = _both(c, optimizer, lin=lin)
        torch.testing.assert_close(wn, wr, rtol=1e-5, atol=1e-6)
        for k in sn:
            torch.testing.assert_close(sn[k], sr[k], rtol=1e-5, atol=1e-6)


@needs_gcc
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_small_tables_split_into_few_parts(threads, row_map):
    """Tables of a few 16-row blocks (50 and 7 rows, one-id bags as gathers stack them, plus bags)
    get at most one work part per block and one part on one thread: every row still updated
    once with its summed gradient, as the reference does, whatever the thread count."""
    c = Case(T=2, B=600, D=8, rows=(50, 7), max_len=3, seed=33, dup_pool=40)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for optimizer in ("sgd", "rowwise_adagrad"):
            (wn, sn), (wr, sr) = _both(c, optimizer)
            torch.testing.assert_close(wn, wr, rtol=1e-5, atol=1e-6)
            for k in sn:
                torch.testing.assert_close(sn[k], sr[k], rtol=1e-5, atol=1e-6)
    finally:
        torch.set_num_threads(old)


@needs_gcc
@pytest.mark.parametrize("T", [1, 5])
def test_native_is_deterministic_across_thread_counts(T, row_map):
    c = Case(T=T, B=64, D=32, rows=(500,) * T, max_len=20, seed=31, dup_pool=50)
    results = []
    old = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            w = c.weights.clone()
            state = new_state("adam", w)
            tbe_backward_update_native(w, state, c.lin, c.offsets, c.grad, T=T, B=c.B,
                                       optimizer="adam", lr=0.1)
            fwd = tbe_forward_native(w, c.lin, c.offsets, T=T, B=c.B)
            results.append((w, state["momentum1"], fwd))
    finally:
        torch.set_num_threads(old)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


@needs_gcc
def test_native_forward_matches_reference_large_dims():
    c = Case(T=2, B=9, D=256 + 8, rows=(30, 40), seed=32)
    for mode in ("sum", "mean"):
        torch.testing.assert_close(
            tbe_forward_native(c.weights, c.lin, c.offsets, T=c.T, B=c.B, pooling=mode),
            tbe_forward_reference(c.weights, c.lin, c.offsets, T=c.T, B=c.B, pooling=mode),
            rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [tbe_backward_update_native, tbe_backward_update_reference])
def test_out_of_range_rows_touch_nothing(fn):
    if fn is tbe_backward_update_native and not HAVE_GCC:
        pytest.skip("gcc not available")
    c = Case(seed=33)
    for bad in (-1, c.weights.shape[0]):
        lin = c.lin.clone()
        lin[-1] = bad
        w = c.weights.clone()
        state = new_state("adagrad", w)
        with pytest.raises(IndexError):
            fn(w, state, lin, c.offsets, c.grad, T=c.T, B=c.B, optimizer="adagrad", lr=0.1)
        assert torch.equal(w, c.weights) and not state["momentum1"].any()
    if fn is tbe_backward_update_native:
        with pytest.raises(IndexError):
            tbe_forward_native(c.weights, lin, c.offsets, T=c.T, B=c.B)


def test_malformed_offsets_are_rejected_before_any_write(impl):
    c = Case(T=2, B=4, rows=(9, 9), seed=34, empty_bags=False)
    short = c.offsets[:-1].clone()
    decreasing = c.offsets.clone()
    decreasing[2] = decreasing[3] + 1
    past_end = c.offsets.clone()
    past_end[-1] += 1
    for off in (short, decreasing, past_end):
        w = c.weights.clone()
        with pytest.raises(ValueError, match="offsets"):
            tbe_backward_update(w, {}, c.lin, off, c.grad, T=c.T, B=c.B, lr=0.1)
        with pytest.raises(ValueError, match="offsets"):
            tbe_forward(w, c.lin, off, T=c.T, B=c.B)
        assert torch.equal(w, c.weights)


def test_update_of_a_parameter_bumps_its_version(impl):
    c = Case(seed=35)
    w = nn.Parameter(c.weights.clone())
    state = new_state("rowwise_adagrad", w)
    v = w._version
    tbe_backward_update(w, state, c.lin, c.offsets, c.grad, T=c.T, B=c.B,
                        optimizer="rowwise_adagrad", lr=0.1)
    assert w._version > v and not torch.equal(w.detach(), c.weights)


# ----------------------------------------------------------------------------- inputs


def test_linearize_indices():
    c = Case(seed=40)
    expected = c.indices.clone()
    for t in range(c.T):
        a, b = c.table_slice(t)
        expected[a:b] += int(c.hsc[t])
    assert torch.equal(c.lin, expected)


def test_validate_accepts_good_inputs():
    c = Case(seed=41)
    validate_inputs(c.indices, c.offsets, c.hsc, c.T, c.B, c.names)


def _bag_with_ids(c, t):
    """(bag b, global position p) of the second id of some non-empty bag of table t."""
    for b in range(c.B):
        lo, hi = int(c.offsets[t * c.B + b]), int(c.offsets[t * c.B + b + 1])
        if hi - lo >= 2:
            return b, lo + 1
    raise AssertionError("no bag with 2 ids")


@pytest.mark.parametrize("bad_value", ["too_big", "negative"])
def test_validate_bad_id_names_table_and_position(bad_value):
    c = Case(T=3, B=5, rows=(7, 11, 5), max_len=6, seed=42, empty_bags=False)
    t = 1
    b, p = _bag_with_ids(c, t)
    c.indices[p] = c.rows[t] if bad_value == "too_big" else -3
    start = int(c.offsets[t * c.B])
    with pytest.raises(IndexError) as e:
        validate_inputs(c.indices, c.offsets, c.hsc, c.T, c.B, c.names)
    msg = str(e.value)
    assert "'table_b'" in msg and f"bag {b}" in msg
    assert f"position {p - start} of the table's indices" in msg
    assert f"[0, {c.rows[t]})" in msg


def test_validate_bad_id_after_an_empty_table():
    c = Case(T=3, B=4, rows=(7, 11, 5), max_len=3, seed=44, empty_bags=False)
    # Give table_a's ids to nobody: table_b's bags all empty.
    n_b = int(c.offsets[2 * c.B] - c.offsets[c.B])
    keep = torch.ones(c.N, dtype=torch.bool)
    keep[int(c.offsets[c.B]):int(c.offsets[2 * c.B])] = False
    indices = c.indices[keep]
    offsets = c.offsets.clone()
    offsets[c.B:2 * c.B + 1] = offsets[c.B]
    offsets[2 * c.B + 1:] -= n_b
    indices[-1] = 99  # last id of table_c's last bag
    with pytest.raises(IndexError, match=r"'table_c'.*bag 3 "):
        validate_inputs(indices, offsets, c.hsc, c.T, c.B, c.names)


def test_validate_bad_offsets():
    c = Case(T=3, B=5, seed=43, empty_bags=False)
    args = (c.hsc, c.T, c.B, c.names)
    with pytest.raises(ValueError, match=r"T\*B\+1 = 16"):
        validate_inputs(c.indices, c.offsets[:-1], *args)
    off = c.offsets.clone()
    off[0] = 1
    with pytest.raises(ValueError, match=r"offsets\[0\] must be 0.*'table_a'"):
        validate_inputs(c.indices, off, *args)
    off = c.offsets.clone()
    off[-1] -= 1
    with pytest.raises(ValueError, match=r"len\(indices\).*'table_c', bag 4"):
        validate_inputs(c.indices, off, *args)
    off = c.offsets.clone()
    k = 2 * c.B + 3  # bag 3 of table_c ends before it starts
    off[k + 1] = off[k] - 1
    with pytest.raises(ValueError, match="non-decreasing: table 'table_c' bag 3"):
        validate_inputs(c.indices, off, *args)
    with pytest.raises(ValueError, match="table names"):
        validate_inputs(c.indices, c.offsets, c.hsc, c.T, c.B, c.names[:2])
    with pytest.raises(ValueError, match="hash_size_cumsum"):
        validate_inputs(c.indices, c.offsets, c.hsc[:-1], c.T, c.B, c.names)


def test_optimizer_state_shapes():
    assert optimizer_state_shapes("sgd", 10, 4) == {}
    assert optimizer_state_shapes("rowwise_adagrad", 10, 4) == {"momentum1": (10,)}
    assert optimizer_state_shapes("adagrad", 10, 4) == {"momentum1": (10, 4)}
    assert optimizer_state_shapes("adam", 10, 4) == {"momentum1": (10, 4),
                                                     "momentum2": (10, 4)}
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_state_shapes("lamb", 10, 4)


# ----------------------------------------------------------------------------- build


@needs_gcc
def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("RECC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "build_info", {})
    native._load()
    assert native.build_info["compiled"] is True
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].startswith("tbe-") and files[0].endswith(".so")
    native._load()
    assert native.build_info["compiled"] is False  # reused, not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == files



@needs_gcc
def test_a_changed_header_rebuilds(tmp_path, monkeypatch):
    """Every header a library's sources include, directly or through another header, is part of
    its cache key (the TBE library's tbe.h includes half.h, vec.h and bf16.h): editing one must
    not load the library built from the old one. Several sources build into one library."""
    monkeypatch.setenv("RECC_CACHE_DIR", str(tmp_path / "cache"))
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    inner, outer = src_dir / "inner.h", src_dir / "outer.h"
    inner.write_text("static inline int inner(void) { return 1; }\n")
    outer.write_text('#include "inner.h"\nstatic inline int value(void) { return 10 * inner(); }\n')
    a, b = src_dir / "a.c", src_dir / "b.c"
    a.write_text('#include "outer.h"\nint probe(void) { return value(); }\n')
    b.write_text("int probe_b(void) { return 7; }\n")
    assert native.included_headers([a, b]) == [inner, outer]
    lib, info = native.build_and_load(a, b, name="probe")
    assert (lib.probe(), lib.probe_b()) == (10, 7) and info["compiled"] is True
    assert Path(info["path"]).name.startswith("probe-")
    assert native.build_and_load(a, b, name="probe")[1]["compiled"] is False
    inner.write_text("static inline int inner(void) { return 2; }\n")  # only reached through outer.h
    lib, info = native.build_and_load(a, b, name="probe")
    assert info["compiled"] is True and lib.probe() == 20
    b.write_text("int probe_b(void) { return 8; }\n")  # the second source
    lib, info = native.build_and_load(a, b, name="probe")
    assert info["compiled"] is True and lib.probe_b() == 8


def test_the_tbe_library_hashes_all_its_headers():
    assert [p.name for p in native.included_headers(native.SOURCES)] == ["bf16.h", "half.h", "tbe.h", "vec.h"]


def test_missing_gcc_falls_back_to_reference_with_one_warning(monkeypatch):
    monkeypatch.setenv("RECC_CPU_KERNELS", "auto")
    monkeypatch.setattr(native, "_TBE", native.KernelLibrary(native.SOURCES, native._declare, "CPU TBE", name="tbe"))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    c = Case(seed=50)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.backend() == "reference"
        w = c.weights.clone()
        tbe_backward_update(w, {}, c.lin, c.offsets, c.grad, T=c.T, B=c.B, lr=0.1)
        tbe_forward(c.weights, c.lin, c.offsets, T=c.T, B=c.B)
    assert len([x for x in caught if "C kernels unavailable" in str(x.message)]) == 1
    monkeypatch.setenv("RECC_CPU_KERNELS", "native")
    with pytest.raises(RuntimeError, match="unavailable"):
        native.library()


def test_reference_mode_is_forced(monkeypatch):
    monkeypatch.setenv("RECC_CPU_KERNELS", "reference")
    assert native.backend() == "reference"
    with pytest.raises(RuntimeError):
        tbe_backward_update_native(torch.zeros(1, 1), {}, torch.zeros(0, dtype=torch.long),
                                   torch.zeros(2, dtype=torch.long), torch.zeros(1, 1), T=1,
                                   B=1, lr=0.1)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad", "adam"])
@pytest.mark.parametrize("pooling, weighted", [("sum", False), ("mean", False), ("max", False), ("sum", True)])
def test_grad_scale_is_the_scaled_gradient(impl, optimizer, pooling, weighted):
    """grad_scale multiplies every id's gradient inside the kernel: the same update as passing
    grad_output * scale (exactly, for a power-of-two scale such as a 1/world share)."""
    c = Case(seed=41, D=20, dup_pool=3)
    psw = c.psw if weighted else None
    for scale, exact in ((0.25, True), (1 / 3, False)):
        got_w, want_w = c.weights.clone(), c.weights.clone()
        got_s, want_s = new_state(optimizer, got_w), new_state(optimizer, want_w)
        kw = dict(T=c.T, B=c.B, pooling=pooling, per_sample_weights=psw, optimizer=optimizer, lr=0.1, step=2)
        tbe_backward_update(got_w, got_s, c.lin, c.offsets, c.grad, grad_scale=scale, **kw)
        tbe_backward_update(want_w, want_s, c.lin, c.offsets, c.grad * scale, **kw)
        assert not torch.equal(got_w, c.weights)
        if exact:
            assert torch.equal(got_w, want_w)
        else:
            torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)


def test_max_pooling_gives_each_column_to_its_winner_only(impl):
    """Max pooling's gradient: column d of a bag's gradient goes to the id that won column d (the
    first of equal maxima, as nn.EmbeddingBag picks it); a losing id in the bag gets nothing."""
    w = torch.tensor([[1.0, 5.0], [3.0, 2.0], [3.0, 0.0], [0.0, 0.0]])
    lin = torch.tensor([0, 1, 2, 2, 3])      # bag 0: rows 0, 1, 2 (rows 1 and 2 tie in col 0); bag 1: 2, 3
    off = torch.tensor([0, 3, 5])
    out = tbe_forward(w, lin, off, T=1, B=2, pooling="max")
    assert out.tolist() == [[3.0, 5.0], [3.0, 0.0]]
    got = w.clone()
    tbe_backward_update(got, {}, lin, off, torch.tensor([[1.0, 10.0], [100.0, 1000.0]]), T=1, B=2,
                        pooling="max", optimizer="sgd", lr=1.0)
    # bag 0: col 0 -> row 1 (first of the tie), col 1 -> row 0; bag 1: col 0 -> row 2, col 1 -> row 2
    # (rows 2 and 3 tie at 0 in col 1: row 2 comes first).
    want = w - torch.tensor([[0.0, 10.0], [1.0, 0.0], [100.0, 1000.0], [0.0, 0.0]])
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- optimizer semantics


def _every_row_each_step(rows=9, D=6, steps=5, seed=50):
    """Batches whose ids touch every row each step (so a lazy sparse update equals torch's dense
    one): bag b holds row b and a random other row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.stack([torch.arange(rows), torch.randint(0, rows, (rows,), generator=g)], 1).reshape(-1)
        out.append((ids, torch.arange(0, 2 * rows + 1, 2), torch.randn(rows, D, generator=g)))
    return out


@pytest.mark.parametrize("mode", ["l2", "decoupled"])
@pytest.mark.parametrize("eps", [1e-8, 1e-2])
def test_adam_matches_torch_adam_and_adamw_over_steps(impl, mode, eps):
    """adam, eps after the bias correction (the default): torch.optim.Adam with L2 weight decay,
    torch.optim.AdamW with decoupled; over 5 steps, every row touched each step."""
    from recc.specs import OptimizerSpec
    rows, D, wd, lr = 9, 6, 0.1, 0.05
    w0 = torch.randn(rows, D, generator=torch.Generator().manual_seed(1))
    param = torch.nn.Parameter(w0.clone())
    cls = torch.optim.AdamW if mode == "decoupled" else torch.optim.Adam
    opt = cls([param], lr=lr, betas=(0.9, 0.99), eps=eps, weight_decay=wd)
    w, state = w0.clone(), new_state("adam", w0)
    spec = OptimizerSpec("adam", lr, eps, 0.9, 0.99, wd, mode)
    for step, (ids, off, grad) in enumerate(_every_row_each_step(rows, D), start=1):
        opt.zero_grad()
        (F.embedding_bag(ids, param, off, mode="sum", include_last_offset=True) * grad).sum().backward()
        opt.step()
        tbe_backward_update(w, state, ids, off, grad, T=1, B=rows, optimizer="adam", lr=lr, beta1=0.9,
                            beta2=0.99, eps=spec.eps_at(step), weight_decay=wd, step=step, weight_decay_mode=mode)
    torch.testing.assert_close(w, param.detach(), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("eps", [1e-8, 1e-4, 1e-2])
def test_adam_eps_before_bias_correction_is_sparse_adams(impl, eps):
    """``adam_eps="before_bias_correction"`` gives torch.optim.SparseAdam's update (eps added to
    sqrt(v) before the correction); the default differs from it measurably at a large eps."""
    from recc.specs import OptimizerSpec
    rows, D, lr = 9, 6, 0.05
    w0 = torch.randn(rows, D, generator=torch.Generator().manual_seed(2))
    param = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SparseAdam([param], lr=lr, betas=(0.9, 0.99), eps=eps)
    results = {}
    for convention in ("before_bias_correction", "after_bias_correction"):
        spec = OptimizerSpec("adam", lr, eps, 0.9, 0.99, adam_eps=convention)
        w, state = w0.clone(), new_state("adam", w0)
        for step, (ids, off, grad) in enumerate(_every_row_each_step(rows, D, seed=51), start=1):
            tbe_backward_update(w, state, ids, off, grad, T=1, B=rows, optimizer="adam", lr=lr, beta1=0.9,
                                beta2=0.99, eps=spec.eps_at(step), step=step)
        results[convention] = w
    for ids, off, grad in _every_row_each_step(rows, D, seed=51):
        opt.zero_grad()
        (F.embedding_bag(ids, param, off, mode="sum", include_last_offset=True, sparse=True) * grad).sum().backward()
        opt.step()
    torch.testing.assert_close(results["before_bias_correction"], param.detach(), rtol=1e-5, atol=2e-6)
    if eps >= 1e-2:
        assert (results["after_bias_correction"] - param.detach()).abs().max() > 1e-3


def _oracle_update(optimizer, w, state, g, lr, eps, wd, mode):
    """One documented row update in float64 (the touched rows of a dense gradient)."""
    w, g = w.double(), g.double()
    st = {k: v.double() for k, v in state.items()}
    if wd and mode == "l2":
        g = g + wd * w
    elif wd:
        w = w * (1 - lr * wd)
    if optimizer == "sgd":
        w = w - lr * g
    elif optimizer == "rowwise_adagrad":
        st["momentum1"] = st["momentum1"] + (g * g).mean(1)
        w = w - lr * g / (st["momentum1"].sqrt() + eps)[:, None]
    elif optimizer == "adagrad":
        st["momentum1"] = st["momentum1"] + g * g
        w = w - lr * g / (st["momentum1"].sqrt() + eps)
    return w, st


@pytest.mark.parametrize("mode", ["l2", "decoupled"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_weight_decay_modes_match_a_float64_oracle_over_steps(impl, optimizer, mode):
    """L2 and decoupled weight decay for sgd, rowwise_adagrad and adagrad: 10 steps against the
    documented update in float64 (eps 0.1 so sqrt(m)+eps and sqrt(m+eps) differ)."""
    rows, D, lr, eps, wd = 9, 6, 0.05, 0.1, 0.2
    w = torch.randn(rows, D, generator=torch.Generator().manual_seed(3))
    state = new_state(optimizer, w)
    w64, st64 = w.double(), {k: v.double() for k, v in state.items()}
    for step, (ids, off, grad) in enumerate(_every_row_each_step(rows, D, steps=10, seed=52), start=1):
        dense = torch.zeros(rows, D, dtype=torch.float64).index_add_(0, ids, grad.double().repeat_interleave(2, 0))
        w64, st64 = _oracle_update(optimizer, w64, st64, dense, lr, eps, wd, mode)
        tbe_backward_update(w, state, ids, off, grad, T=1, B=rows, optimizer=optimizer, lr=lr, eps=eps,
                            weight_decay=wd, step=step, weight_decay_mode=mode)
    torch.testing.assert_close(w.double(), w64, rtol=1e-5, atol=1e-6)
    for k in state:
        torch.testing.assert_close(state[k].double(), st64[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [1, 5, 16, 33])
def test_gather_rows_are_each_tables_rows_in_id_order(impl, dtype, D):
    """One-id lookups of a group's tables: each table's rows (fp32), back to back linearized
    ids; int32 and int64 ids, an empty table, repeated ids, [N, 1] and 1-D ids."""
    from recc.kernels import gather_rows
    rows = [9, 4, 6]
    hsc = [0, 9, 13, 19]
    w = torch.randn(19, D).to(dtype)
    ids = [torch.tensor([[8], [0], [8], [3]]), torch.zeros(0, dtype=torch.int32), torch.tensor([5, 0, 5], dtype=torch.int32)]
    lin, outs = gather_rows(w, ids, rows, hsc, ["a", "b", "c"])
    assert lin.tolist() == [8, 0, 8, 3, 13 + 5, 13, 13 + 5]
    assert [tuple(o.shape) for o in outs] == [(4, D), (0, D), (3, D)]
    for o, i, h in zip(outs, ids, hsc):
        assert o.dtype == torch.float32 and o.is_contiguous()
        assert torch.equal(o, w[i.reshape(-1).long() + h].float())


@pytest.mark.parametrize("bad", [-1, 6])
def test_gather_rows_bad_id_names_the_table(impl, bad):
    from recc.kernels import gather_rows
    ids = [torch.tensor([1, 2]), torch.tensor([0, bad, 1])]
    with pytest.raises(IndexError, match=rf"table item: id {bad} at position 1 is outside the table's rows \[0, 6\)"):
        gather_rows(torch.zeros(10, 3), ids, [4, 6], [0, 4, 10], ["user", "item"])


@needs_gcc
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_segments_split_the_work_and_change_no_result(optimizer):
    """Tables of different id counts as one T=1 batch of one-id bags: with the tables' bounds
    as segments (the gather backward's call) the update equals the T=1 call without them;
    segments whose rows overlap (the kernel then splits the whole batch) too."""
    g = torch.Generator().manual_seed(5)
    counts, rows = [7, 0, 12], [40, 3, 90]
    hsc = [0, 40, 43, 133]
    lin = torch.cat([torch.randint(0, r, (n,), generator=g) + h for n, r, h in zip(counts, rows, hsc)]) \
        if sum(counts) else torch.zeros(0, dtype=torch.int64)
    lin[3] = lin[0]   # a repeated id
    n, D = lin.numel(), 16
    w0 = torch.randn(133, D, generator=g)
    grad = torch.randn(n, D, generator=g)
    offsets = torch.arange(n + 1)
    results = []
    for segments in (None, [0, 7, 7, 19], [0, 10, 19]):
        w = w0.clone()
        state = new_state(optimizer, w)
        tbe_backward_update_native(w, state, lin, offsets, grad, T=1, B=n, optimizer=optimizer, lr=0.1,
                                   weight_decay=0.01, segments=segments)
        results.append((w, state))
    for w, state in results[1:]:
        assert torch.equal(w, results[0][0])
        for k in state:
            assert torch.equal(state[k], results[0][1][k])
    with pytest.raises(ValueError, match="segments must run from 0 to T\\*B = 19"):
        tbe_backward_update_native(w0.clone(), new_state(optimizer, w0), lin, offsets, grad, T=1, B=n,
                                   optimizer=optimizer, lr=0.1, segments=[0, 7])


# ----------------------------------------------------------------------------- bf16 pooled rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 values as bits, every NaN one pattern (torch's vectorised and scalar casts differ there)."""
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int16)


@pytest.mark.parametrize("D", [1, 13, 16, 64, 128])
@pytest.mark.parametrize("pooling", ["sum", "mean", "max"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bf16_output_is_the_fp32_result_rounded_once(impl, D, pooling, wdtype):
    """out_dtype=bf16 (a bf16 consumer's lookup): each bag pooled in fp32 and rounded to nearest
    even as it is written — the bits of the fp32 output's .to(bfloat16), specials included."""
    c = Case(T=3, B=9, D=D, rows=(40, 7, 60), max_len=7, seed=D)
    w = c.weights.clone()
    w[3, 0], w[5, -1], w[8, 0] = float("inf"), float("nan"), 1e-40   # an inf, a NaN, a subnormal
    w[9] = 1.0 + 2.0 ** -8   # exactly halfway between two bf16 values: rounds to the even one
    w = w.to(wdtype)
    psw = c.psw if pooling == "sum" else None
    want = tbe_forward(w, c.lin, c.offsets, T=c.T, B=c.B, pooling=pooling, per_sample_weights=psw)
    got = tbe_forward(w, c.lin, c.offsets, T=c.T, B=c.B, pooling=pooling, per_sample_weights=psw,
                      out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want.to(torch.bfloat16)))


def test_pooled_dtype_other_than_fp32_or_bf16_is_refused(impl):
    c = Case()
    with pytest.raises(ValueError, match="float32 or bfloat16, not torch.float16"):
        tbe_forward(c.weights, c.lin, c.offsets, T=c.T, B=c.B, out_dtype=torch.float16)


@needs_gcc
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("D", [1, 13, 16, 64, 128])
def test_bf16_gradient_updates_as_its_fp32_widening(optimizer, D, row_map):
    """The C update reads a bf16 gradient as it is (no conversion pass): the same rows and state,
    bit for bit, as the same gradient widened to fp32 first."""
    c = Case(T=4, B=16, D=D, rows=(100, 7, 300, 64), max_len=12, seed=40 + D, dup_pool=9)
    grad = c.grad.to(torch.bfloat16)
    for pooling, psw in (("sum", None), ("mean", None), ("sum", c.psw)):
        out = []
        for g in (grad, grad.float()):
            w, s = c.weights.clone(), new_state(optimizer, c.weights)
            tbe_backward_update_native(w, s, c.lin, c.offsets, g, T=c.T, B=c.B, pooling=pooling,
                                       per_sample_weights=psw, optimizer=optimizer, lr=0.1, weight_decay=0.01)
            out.append((w, s))
        assert torch.equal(out[0][0], out[1][0]), pooling
        for k in out[0][1]:
            assert torch.equal(out[0][1][k], out[1][1][k]), (pooling, k)
