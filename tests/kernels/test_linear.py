"""recc.kernels.linear: act(x W^T + b) and its gradients on oneDNN (large products) or F.linear
(small ones), against torch autograd on F.linear."""
import pytest
import torch
import torch.nn.functional as F

from recc.kernels import linear_backward, linear_forward
from recc.kernels.cpu import linear as linear_mod

SHAPES = [(4, 13, 8), (512, 368, 256), (300, 130, 70)]  # (B, K, N): F.linear path, then oneDNN


def _case(b, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5,
            torch.randn(n, generator=g), torch.randn(b, n, generator=g))


@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("b, k, n", SHAPES)
def test_forward_and_backward_match_torch(b, k, n, bias, activation):
    x, w, bvec, grad = _case(b, k, n)
    bvec = bvec if bias else None
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = bvec.clone().requires_grad_() if bias else None
    ref = F.linear(xr, wr, br)
    ref = torch.relu(ref) if activation == "relu" else ref
    y = linear_forward(x, w, bvec, activation)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    if activation == "relu":
        assert (y == 0).any() and (y > 0).any()
    ref.backward(grad)
    dx, dw, db = linear_backward(grad, x, w, y, activation, (True, True, bias))
    torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dw, wr.grad, rtol=1e-5, atol=1e-4)
    if bias:
        torch.testing.assert_close(db, br.grad, rtol=1e-5, atol=1e-4)
    else:
        assert db is None


def test_large_products_take_onednn_small_ones_do_not(monkeypatch):
    if linear_mod._pointwise() is None:
        pytest.skip("this torch has no oneDNN")
    big, small = _case(512, 368, 256), _case(4, 13, 8)
    assert linear_mod._use_onednn(big[0], big[1]) and not linear_mod._use_onednn(small[0], small[1])
    monkeypatch.setenv("RECC_CPU_KERNELS", "reference")
    assert not linear_mod._use_onednn(big[0], big[1])
    x, w, b, _ = big
    torch.testing.assert_close(linear_forward(x, w, b, "relu"), torch.relu(F.linear(x, w, b)))


def test_unneeded_gradients_are_not_computed():
    x, w, b, grad = _case(300, 130, 70)
    y = linear_forward(x, w, b)
    dx, dw, db = linear_backward(grad, x, w, y, "none", (False, True, False))
    assert dx is None and db is None and dw.shape == w.shape


def test_non_contiguous_input_and_grad():
    x, w, b, grad = _case(300, 131, 70)
    xs = x[:, :130]  # a strided view, as a padded layer's narrowed input would be
    y = linear_forward(xs, w[:, :130], b, "relu")
    torch.testing.assert_close(y, torch.relu(F.linear(xs, w[:, :130], b)), rtol=1e-5, atol=1e-5)
    dx, dw, _ = linear_backward(grad.t().contiguous().t(), xs, w[:, :130], y, "relu", (True, True, False))
    assert dx.shape == xs.shape and dw.shape == (70, 130)


def test_bad_arguments_are_named():
    x, w, b, _ = _case(4, 13, 8)
    with pytest.raises(ValueError, match=r"activation 'gelu' not in \('none', 'relu'\)"):
        linear_forward(x, w, b, "gelu")
    with pytest.raises(ValueError, match=r"x \(4, 13\) and weight \(8, 12\) do not multiply"):
        linear_forward(x, w[:, :12], b)


@pytest.mark.parametrize("kernels", ["native", "reference"])
@pytest.mark.parametrize("threads", [1, 2])
def test_relu_backward_is_threshold_backward_and_column_sum(monkeypatch, kernels, threads):
    """The fused mask + bias-gradient pass: rows past several 64-row blocks, a strided grad,
    and torch's NaN rule (a NaN output passes the gradient through, as y <= 0 is false)."""
    monkeypatch.setenv("RECC_CPU_KERNELS", kernels)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(1)
        n = linear_mod.RELU_KERNEL_MIN_N + 2
        grad = torch.randn(333, 2 * n, generator=g)[:, ::2]
        y = torch.relu(torch.randn(333, n, generator=g))
        y[5, 3], y[7, 0] = float("nan"), 0.0
        want = torch.ops.aten.threshold_backward(grad, y, 0)
        got, db = linear_mod.relu_backward(grad, y, True)
        assert torch.equal(got, want)
        assert got[5, 3] == grad[5, 3] and got[7, 0] == 0
        torch.testing.assert_close(db, want.sum(0), rtol=1e-5, atol=1e-5)
        got, db = linear_mod.relu_backward(grad, y, False)
        assert torch.equal(got, want) and db is None
    finally:
        torch.set_num_threads(prev)
    with pytest.raises(ValueError, match=r"grad \(3, 4\) and output \(3, 5\)"):
        linear_mod.relu_backward(torch.randn(3, 4), torch.randn(3, 5), True)


@pytest.mark.parametrize("n", [3, 96])
@pytest.mark.parametrize("k", [13, 16, 64, 104, 256])
def test_weight_grad_equals_gT_x(k, n):
    """Both product orders give g^T x (to fp32 rounding); the transposed one only for few or
    odd-sized inputs and 16+ outputs (an MMoE gate's [66, 3] keeps g^T x)."""
    from recc.kernels.cpu.linear import _weight_grad_transposed, weight_grad
    g, x = torch.randn(300, n), torch.randn(300, k)
    got = weight_grad(g, x)
    assert got.shape == (n, k) and got.is_contiguous()
    torch.testing.assert_close(got, g.t().mm(x), rtol=1e-5, atol=1e-4)
    assert _weight_grad_transposed(k, n) == (n >= 16 and k in (13, 16, 104))


def test_small_relu_layers_mask_with_torch(monkeypatch):
    """An fp32 ReLU layer under RELU_KERNEL_MIN_N outputs masks with threshold_backward and sums
    with torch (the C pass costs more there); from it on, the C pass runs."""
    calls = []
    real = linear_mod._KERNELS.get
    monkeypatch.setattr(linear_mod._KERNELS, "get", lambda: calls.append(1) or real())
    for n, kernel in ((8, False), (linear_mod.RELU_KERNEL_MIN_N, True)):
        calls.clear()
        grad, y = torch.randn(64, n), torch.relu(torch.randn(64, n))
        got, db = linear_mod.relu_backward(grad, y, True)
        assert bool(calls) == kernel
        want = torch.ops.aten.threshold_backward(grad, y, 0)
        assert torch.equal(got, want)
        torch.testing.assert_close(db, want.sum(0), rtol=1e-5, atol=1e-5)


def test_weight_grad_goes_to_mkl_on_intel_cpus(monkeypatch):
    """oneDNN's weight gradient only where MKL runs its slower path (not Intel's CPUs): on an
    Intel Xeon MKL's g^T x was 1.2-2.4x faster; the result is g^T x either way."""
    from recc.kernels.cpu import linear as linear_mod
    from recc.kernels.cpu import native
    g, x = torch.randn(300, 96), torch.randn(300, 64)
    monkeypatch.setattr(native, "cpu_vendor", lambda: "GenuineIntel")
    assert not linear_mod._weight_grad_onednn(g, x)
    torch.testing.assert_close(linear_mod.weight_grad(g, x), g.t().mm(x), rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(native, "cpu_vendor", lambda: "AuthenticAMD")
    assert linear_mod._weight_grad_onednn(g, x) == linear_mod._use_onednn(g.t(), x.t())
    torch.testing.assert_close(linear_mod.weight_grad(g, x), g.t().mm(x), rtol=1e-5, atol=1e-4)


def test_cpu_vendor_reads_proc_cpuinfo():
    from recc.kernels.cpu import native
    lines = [ln for ln in native._cpuinfo_lines() if ln.startswith("vendor_id")]
    assert native.cpu_vendor() == (lines[0].split(":", 1)[1].strip() if lines else "")


@pytest.mark.parametrize("n,k", [(1, 8), (3, 1), (1, 1)])
def test_weight_grad_has_row_major_strides(n, k):
    """A one-row or one-column gradient still comes back [N, K] row-major (DDP's bucket views
    copy a gradient whose strides differ)."""
    from recc.kernels.cpu.linear import weight_grad
    g, x = torch.randn(50, n), torch.randn(50, k)
    got = weight_grad(g, x)
    assert got.shape == (n, k) and got.stride() == (k, 1)
    torch.testing.assert_close(got, g.t().mm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("units", linear_mod.BF16_PRODUCTS)
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("b, k, n", SHAPES)
def test_bf16_forward_and_backward_match_torch_in_bf16(monkeypatch, b, k, n, activation, units):
    """cast_dense's bf16 layers: oneDNN's bf16 GEMM (or the fp32 one on widened operands) and the
    bf16 ReLU/bias kernel against torch autograd on F.linear in bf16 (the bias gradient is summed
    in fp32, then rounded once)."""
    monkeypatch.setenv("RECC_BF16_PRODUCTS", units)
    x, w, bvec, grad = (t.bfloat16() for t in _case(b, k, n, seed=3))
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, bvec))
    ref = F.linear(xr, wr, br)
    ref = torch.relu(ref) if activation == "relu" else ref
    y = linear_forward(x, w, bvec, activation)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    ref.backward(grad)
    dx, dw, db = linear_backward(grad, x, w, y, activation)
    assert dx.dtype == dw.dtype == db.dtype == torch.bfloat16
    for got, want, name in ((dx, xr.grad, "dx"), (dw, wr.grad, "dw"), (db, br.grad, "db")):
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale, msg=name)


def _bf16_case(b=512, k=368, n=256, seed=5):
    x, w, bvec, grad = _case(b, k, n, seed=seed)
    return x.bfloat16(), w.bfloat16(), bvec.bfloat16(), grad.bfloat16()


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_bf16_products_on_fp32_units_equal_bf16_gemms(monkeypatch, activation):
    """The two ways to run a bf16 product compute one thing (exact products, fp32 sums, one
    rounding to bf16): results agree but for a rare last-bit tie from the summation order, and the
    fp32-unit results are the fp32 product of the same operands, rounded once."""
    if linear_mod._pointwise() is None or not linear_mod.onednn_has_bf16():
        pytest.skip("oneDNN has no bf16 GEMMs here")
    x, w, bvec, grad = _bf16_case()
    out = {}
    for units in linear_mod.BF16_PRODUCTS:
        monkeypatch.setenv("RECC_BF16_PRODUCTS", units)
        y = linear_forward(x, w, bvec, activation)
        out[units] = (y, *linear_backward(grad, x, w, y, activation))
    for name, a, b in zip(("y", "dx", "dw", "db"), out["bf16"], out["fp32"]):
        assert a.dtype == b.dtype == torch.bfloat16, name
        ulp = torch.finfo(torch.bfloat16).eps * a.float().abs().clamp_min(1e-2)
        assert ((a.float() - b.float()).abs() <= ulp).all(), name
        assert (a == b).float().mean() > 0.99, name
    want = F.linear(x.float(), w.float(), bvec.float())
    want = torch.relu(want) if activation == "relu" else want
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-2)
    assert ((out["fp32"][0].float() - want).abs() <= ulp).all()


def test_bf16_products_run_where_bf16_products_says(monkeypatch):
    """Forward and both gradient products see fp32 operands when the units are fp32 and bf16
    ones otherwise (a dispatch that ignored the choice would leave the bf16 GEMMs running)."""
    if linear_mod._pointwise() is None:
        pytest.skip("this torch has no oneDNN")
    real_op = linear_mod._pointwise()
    seen = []

    def spy_op(a, b, *rest):
        seen.append(("onednn", a.dtype, b.dtype))
        return real_op(a, b, *rest)

    def spy_wg(g, x):
        # its own product (weight_grad may itself call oneDNN, by CPU vendor)
        seen.append(("weight_grad", g.dtype, x.dtype))
        return g.t().mm(x)

    monkeypatch.setattr(linear_mod, "_pointwise", lambda: spy_op)
    monkeypatch.setattr(linear_mod, "weight_grad", spy_wg)
    monkeypatch.setenv("RECC_CPU_GEMM_TUNING", "0")     # the default backends: one call each
    x, w, bvec, grad = _bf16_case()
    bf16_gemms = linear_mod.onednn_has_bf16()
    for units, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        monkeypatch.setenv("RECC_BF16_PRODUCTS", units)
        seen.clear()
        y = linear_forward(x, w, bvec, "relu")
        linear_backward(grad, x, w, y, "relu")
        if dtype == torch.bfloat16 and not bf16_gemms:
            # oneDNN has no bf16 kernels on this CPU: never asked for one (it would fail to build)
            assert [s[0] for s in seen] == ["weight_grad"] and seen[0][1] == dtype, seen
            continue
        assert [s[0] for s in seen] == ["onednn", "onednn", "weight_grad"]
        assert all(s[1] == s[2] == dtype for s in seen), (units, seen)


def test_bf16_products_go_to_fp32_units_where_onednn_has_no_bf16(monkeypatch):
    """On a CPU whose oneDNN builds no bf16 primitive (AVX2 only), auto picks the fp32 units
    without timing, and a bf16 layer then runs: no oneDNN call sees a bf16 operand."""
    if linear_mod._pointwise() is None:
        pytest.skip("this torch has no oneDNN")
    real_op = linear_mod._pointwise()
    seen = []

    def spy_op(a, b, *rest):
        seen.append((a.dtype, b.dtype))
        return real_op(a, b, *rest)

    monkeypatch.setattr(linear_mod, "onednn_has_bf16", lambda: False)
    monkeypatch.setattr(linear_mod, "_pointwise", lambda: spy_op)
    monkeypatch.setattr(linear_mod, "_BF16_CHOICE", {})
    monkeypatch.setattr(linear_mod, "_best_times", lambda c, rounds: pytest.fail("timed bf16 GEMMs"))
    monkeypatch.setenv("RECC_BF16_PRODUCTS", "auto")
    assert linear_mod.bf16_products() == "fp32"
    x, w, bvec, grad = _bf16_case()
    monkeypatch.setenv("RECC_CPU_GEMM_TUNING", "0")
    y = linear_forward(x, w, bvec, "relu")
    dx, dw, db = linear_backward(grad, x, w, y, "relu")
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == torch.bfloat16
    assert seen and all(a == b == torch.float32 for a, b in seen), seen
    want = torch.relu(F.linear(x.float(), w.float(), bvec.float()))
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-2)
    assert ((y.float() - want).abs() <= ulp).all()


def test_bf16_products_auto_takes_fp32_only_when_clearly_faster(monkeypatch):
    if linear_mod._pointwise() is None:
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv("RECC_BF16_PRODUCTS", "auto")
    monkeypatch.setattr(linear_mod, "onednn_has_bf16", lambda: True)
    for bf16_s, fp32_s, want in ((1.0, 0.85, "fp32"), (1.0, 0.95, "bf16"), (0.5, 1.0, "bf16")):
        calls = []
        monkeypatch.setattr(linear_mod, "_best_times",
                            lambda c, rounds, t={"bf16": bf16_s, "fp32": fp32_s}: calls.append(1) or t)
        monkeypatch.setattr(linear_mod, "_BF16_CHOICE", {})
        assert linear_mod.bf16_products() == want
        assert linear_mod.bf16_products() == want and len(calls) == 1     # measured once, then kept
    monkeypatch.setenv("RECC_BF16_PRODUCTS", "fp16")
    with pytest.raises(ValueError, match=r"RECC_BF16_PRODUCTS='fp16': expected auto, bf16 or fp32"):
        linear_mod.bf16_products()


def test_relu_backward_widens_bf16_to_fp32_exactly():
    g = torch.Generator().manual_seed(2)
    grad = torch.randn(200, 96, generator=g).bfloat16()
    y = torch.relu(torch.randn(200, 96, generator=g)).bfloat16()
    narrow, db_narrow = linear_mod.relu_backward(grad, y, True)
    wide, db_wide = linear_mod.relu_backward(grad, y, True, widen=True)
    assert narrow.dtype == torch.bfloat16 and wide.dtype == db_wide.dtype == torch.float32
    assert torch.equal(wide, narrow.float())
    assert torch.equal(db_wide.to(torch.bfloat16), db_narrow)


def test_rounding_to_bf16_keeps_the_rounded_fp32_values():
    """The fp32-unit forward's output pass: its bf16 bits are torch's round-to-nearest-even (ties,
    subnormals, infinities; a NaN stays a NaN — torch writes 0xFFFF, the kernel a quiet NaN of the
    same sign), and the fp32 it keeps is exactly those bf16 values widened."""
    g = torch.Generator().manual_seed(4)
    special = torch.tensor([0.0, -0.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1e-40, -1e-40, 3.4e38,
                            float("inf"), float("-inf"), float("nan")])
    y = torch.cat([torch.randn(4099, generator=g) * 100, special])
    if linear_mod._KERNELS.get() is None:
        pytest.skip("no C kernels here (RECC_CPU_KERNELS=reference or no compiler)")
    want = y.to(torch.bfloat16)
    kept = y.clone()
    got = linear_mod._round_keep_wide(kept)
    assert torch.equal(got.view(torch.int16)[:-1], want.view(torch.int16)[:-1])
    assert got[-1].isnan() and kept[-1].isnan()
    assert torch.equal(kept[:-1], want.float()[:-1])
    assert linear_mod._widened(got) is kept


def test_bf16_layers_on_fp32_units_widen_each_activation_once(monkeypatch):
    """Two bf16 layers on fp32 units: the second reads the first's output through the fp32 values
    kept when it was rounded, its backward reads the same widening, and a tensor written in place
    after it was widened is widened again (a stale widening would silently use the old values)."""
    if linear_mod._pointwise() is None:
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv("RECC_BF16_PRODUCTS", "fp32")
    x, w1, b1, _ = _bf16_case(k=368, n=256)
    w2 = (torch.randn(128, 256) / 16).bfloat16()
    widened = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: widened.append(tuple(t.shape)) or real_float(t))
    h = linear_forward(x, w1, b1, "relu")
    y = linear_forward(h, w2, None, "none")
    dh, dw2, _ = linear_backward(torch.ones_like(y), h, w2, None, "none", (True, True, False))
    assert widened.count((512, 368)) == 1 and (512, 256) not in widened, widened
    monkeypatch.undo()
    assert torch.equal(linear_mod._widened(h), h.float())
    torch.testing.assert_close(dw2.float(), torch.ones(512, 128).t().mm(h.float()), rtol=1e-2, atol=1e-1)
    h.mul_(2)
    assert torch.equal(linear_mod._widened(h), h.float())


def test_bf16_widening_is_not_kept_for_tensors_from_outside_the_step(monkeypatch):
    """A leaf bf16 tensor (a parameter, a user's buffer) rewritten where its version counter does
    not see it (``.data``) is read afresh by the next forward; a tensor made by this step's graph
    keeps its widening; inference tensors have no version counter and still run."""
    if linear_mod._pointwise() is None:
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv("RECC_BF16_PRODUCTS", "fp32")
    x, w, bvec, _ = _bf16_case()
    first = linear_forward(x, w, None, "none")
    x.data = (x.float() * 2).bfloat16()          # a new storage, x's version unchanged
    second = linear_forward(x, w, None, "none")
    torch.testing.assert_close(second.float(), 2 * first.float(), rtol=2e-2, atol=2e-2)
    made = x.float().requires_grad_().bfloat16()  # has a grad_fn: an op of this step made it
    assert linear_mod._widened(made) is linear_mod._widened(made)
    with torch.inference_mode():
        xi, wi, bi = x.clone(), w.clone(), bvec.clone()
        inf = linear_forward(linear_forward(xi, wi, bi, "relu"), wi[:, :256].contiguous(), None, "none")
    with torch.no_grad():
        ref = linear_forward(linear_forward(x, w, bvec, "relu"), w[:, :256].contiguous(), None, "none")
    assert torch.equal(inf, ref)


def test_fastest_takes_the_faster_candidate_once_per_shape(monkeypatch):
    monkeypatch.setenv("RECC_CPU_GEMM_TUNING", "1")
    clock = [0.0]
    monkeypatch.setattr(linear_mod, "_clock", lambda: clock[0])
    monkeypatch.setattr(linear_mod, "_TUNED", {})
    calls = {}

    def make(name, seconds):        # a candidate that takes `seconds` of the fake clock
        def fn():
            calls[name] = calls.get(name, 0) + 1
            clock[0] += seconds
        return fn

    cands = {"slow": make("slow", 0.004), "fast": make("fast", 0.001)}
    assert linear_mod._fastest(("t", 1), cands) == "fast"
    timed = dict(calls)
    assert timed == {"slow": 1 + linear_mod._TUNING_ROUNDS, "fast": 1 + linear_mod._TUNING_ROUNDS}
    assert linear_mod._fastest(("t", 1), cands) == "fast" and calls == timed     # kept, not retimed
    # within the margin the default (first) stays; past it the other wins
    assert linear_mod._fastest(("t", 2), {"a": make("a", 0.002), "b": make("b", 0.00196)}) == "a"
    assert linear_mod._fastest(("t", 3), {"a": make("a", 0.002), "b": make("b", 0.0018)}) == "b"
    monkeypatch.setenv("RECC_CPU_GEMM_TUNING", "0")
    assert linear_mod._fastest(("t", 4), cands) == "slow"


@pytest.mark.parametrize("pick", ["onednn", "mkl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tuned_candidate_matches_torch(monkeypatch, pick, dtype):
    """Whichever backend the timing picks, forward and gradients are the layer's (ReLU, bias)."""
    if linear_mod._pointwise() is None:
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(linear_mod, "_fastest", lambda key, cands: pick if pick in cands else next(iter(cands)))
    monkeypatch.setenv("RECC_BF16_PRODUCTS", "bf16")
    x, w, bvec, grad = (t.to(dtype) for t in _case(512, 368, 256, seed=7))
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, bvec))
    ref = torch.relu(F.linear(xr, wr, br))
    y = linear_forward(x, w, bvec, "relu")
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(y.float(), ref.float(), **tol)
    ref.backward(grad)
    dx, dw, db = linear_backward(grad, x, w, y, "relu")
    for got, want in ((dx, xr.grad), (dw, wr.grad), (db, br.grad)):
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float() / scale, want.float() / scale, **tol)


NARROW = [(300, 256, 1), (257, 37, 3), (64, 5, 8)]   # (B, K, N): a DLRM head, odd sizes, NARROW_MAX


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, k, n", NARROW)
def test_narrow_layers_match_a_float64_oracle(b, k, n, xdtype, bias, activation, threads, monkeypatch):
    """A layer of at most NARROW_MAX outputs (a model's head) runs as linear.c's narrow kernel, its
    input fp32 or bf16 (cast_dense's bf16 head) next to fp32 weights: y = act(x w^T + b) in fp32 on
    x widened exactly; dx in x's dtype, dw and db fp32, each the float64 result rounded once (up to
    fp32 summation), whatever the thread count. x is a column slice (rows with a stride). The
    kernel is forced for every case (the rule of when it runs is tested apart)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(linear_mod, "_narrow_wins", lambda x, n: True)
    x, w, bvec, grad = _case(b, k + 3, n)
    x, w = x[:, 2:k + 2].to(xdtype), w[:, :k].contiguous()
    bvec = bvec if bias else None
    assert linear_mod._narrow_lib(x, w, bvec) is not None
    y = linear_forward(x, w, bvec, activation)
    pre = x.double() @ w.double().t() + (bvec.double() if bias else 0)
    ref = pre.clamp_min(0) if activation == "relu" else pre
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    dx, dw, db = linear_backward(grad, x, w, y, activation, (True, True, bias))
    g = grad.double() * (ref > 0) if activation == "relu" else grad.double()
    assert dx.dtype == xdtype and dw.dtype == torch.float32
    torch.testing.assert_close(dx.double(), (g @ w.double()).to(xdtype).double(),
                               rtol=1e-5 if xdtype == torch.float32 else 8e-3, atol=1e-5)
    torch.testing.assert_close(dw.double(), g.t() @ x.double(), rtol=1e-5, atol=1e-4)
    if bias:
        torch.testing.assert_close(db.double(), g.sum(0), rtol=1e-5, atol=1e-4)
    else:
        assert db is None


def test_the_narrow_kernel_runs_where_it_beats_the_libraries():
    """fp32: one output from NARROW_MIN_K inputs on (fewer, or 2 outputs on, go to MKL/oneDNN);
    a bf16 input up to 4 outputs at any K; nothing past NARROW_MAX."""
    w = lambda n, k=16: torch.randn(n, k)  # noqa: E731
    x32, x16 = torch.randn(8, 16), torch.randn(8, 16).bfloat16()
    wide32 = torch.randn(8, linear_mod.NARROW_MIN_K)
    assert linear_mod._narrow_lib(wide32, w(1, linear_mod.NARROW_MIN_K), None) is not None
    assert linear_mod._narrow_lib(x32, w(1), None) is None
    assert linear_mod._narrow_lib(wide32, w(2, linear_mod.NARROW_MIN_K), None) is None
    assert all(linear_mod._narrow_lib(x16, w(n), None) is not None for n in (1, 2, 4))
    assert linear_mod._narrow_lib(x16, w(5), None) is None
    assert linear_mod._narrow_lib(x16, w(linear_mod.NARROW_MAX + 1), None) is None


def test_narrow_backward_computes_only_the_needed_gradients():
    x, w, b, grad = _case(100, linear_mod.NARROW_MIN_K, 1)
    assert linear_mod._narrow_lib(x, w, b) is not None
    y = linear_forward(x, w, b)
    dx, dw, db = linear_backward(grad, x, w, y, "none", (False, True, False))
    assert dx is None and db is None
    torch.testing.assert_close(dw, grad.t() @ x, rtol=1e-5, atol=1e-5)
    dx, dw, db = linear_backward(grad, x, w, y, "none", (True, False, True))
    assert dw is None
    torch.testing.assert_close(dx, grad @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, grad.sum(0), rtol=1e-5, atol=1e-5)


def test_a_wide_mixed_layer_computes_in_fp32():
    """A bf16 input meeting fp32 weights with more than NARROW_MAX outputs: the product of x widened,
    in fp32, and dx rounded to bf16 — what a cast node and an fp32 layer computed."""
    x, w, b, grad = _case(64, 24, linear_mod.NARROW_MAX + 8)
    x = x.bfloat16()
    assert linear_mod._narrow_lib(x, w, b) is None
    y = linear_forward(x, w, b, "relu")
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, torch.relu(F.linear(x.float(), w, b)), rtol=1e-5, atol=1e-5)
    dx, dw, db = linear_backward(grad, x, w, y, "relu", (True, True, True))
    g = grad * (y > 0)
    assert dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == torch.float32
    torch.testing.assert_close(dx, (g @ w).bfloat16())
    torch.testing.assert_close(dw, g.t() @ x.float(), rtol=1e-5, atol=1e-4)


def test_small_fp32_layers_run_as_torch_ops():
    """The runtime's recc.linear runs a small fp32 layer as F.linear (+ relu) under torch's autograd
    (no Python autograd.Function), and the rest through recc's Linear: a large product, a weight
    gradient recc transposes (K = 13, 32 outputs), a bf16 layer, a narrow-kernel head. The
    gradients are the same either way."""
    from recc.runtime.cpu_backend import linear_cpu
    cases = {(64, 18, 3, torch.float32): True, (64, 18, 8, torch.float32): True,
             (512, 368, 256, torch.float32): False, (64, 13, 32, torch.float32): False,
             (64, 18, 8, torch.bfloat16): False, (64, linear_mod.NARROW_MIN_K, 1, torch.float32): False}
    for (b, k, n, dtype), torch_runs in cases.items():
        x, w, bvec, grad = (t.to(dtype) for t in _case(b, k, n))
        assert linear_mod.linear_torch_runs(x, w, bvec, "relu") == torch_runs, (b, k, n, dtype)
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, bvec))
        y = linear_cpu(xr, wr, br, "relu")
        assert (type(y.grad_fn).__name__ == "ReluBackward0") == torch_runs, (b, k, n, dtype)
        y.backward(grad)
        want = [t.clone().requires_grad_() for t in (x, w, bvec)]
        torch.relu(F.linear(*want)).backward(grad)
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for got, ref in zip((xr, wr, br), want):
            torch.testing.assert_close(got.grad, ref.grad, **tol)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        linear_cpu(*_case(4, 3, 2)[:3], "gelu")
