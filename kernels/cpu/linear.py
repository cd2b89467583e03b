"""Dense layers on CPU: ``y = act(x W^T + b)`` and its backward, each product on the faster of
oneDNN and MKL for its shape on this CPU.

torch's ``F.linear`` on CPU calls MKL's sgemm, which on non-Intel x86 CPUs (this project's AMD
EPYC with AVX-512) runs a slower code path; oneDNN dispatches on the CPU's instruction set
instead. On the EPYC (one core, B=2048, ``python -m bench.dense_kernels``) forward and input
gradient ran ~10% faster through oneDNN and the weight gradient 1.6-1.75x; on an Intel Xeon MKL's
weight gradient was 1.2-2.4x oneDNN's, and its forward + ReLU 0.55-1.1x oneDNN's fused one,
layer by layer and from one day to the next. So each large product (forward, input gradient,
weight gradient) is timed both ways on its first call for a shape (``_fastest``, like cuDNN's
benchmark mode; ``RECC_CPU_GEMM_TUNING=0`` keeps the defaults: oneDNN for the forward and input
gradient, ``_weight_grad_onednn``'s rule for the weight gradient). oneDNN's forward fuses the
ReLU into the GEMM's epilogue; MKL's applies it in place after.

oneDNN is reached through ``torch.ops.mkldnn._linear_pointwise``, the op torch's own compiler
(Inductor) lowers CPU linear + pointwise to. Small products (under ``MIN_MACS``), other dtypes,
torch builds without oneDNN and ``RECC_CPU_KERNELS=reference`` use ``F.linear``. The math is the
same products in a different blocking order: results agree to fp32 rounding.

In backward the ReLU's mask and the bias gradient are one pass of a C kernel (``linear.c``)
instead of ``threshold_backward`` and a column sum (two passes over a [B, N] gradient that does
not stay in cache), from ``RELU_KERNEL_MIN_N`` outputs on (or bf16).

A small fp32 layer whose kernels here would be torch's own ops (``linear_torch_runs``) is run by
the runtime as those ops under torch's autograd: at the zoo's sizes a Python autograd.Function and
this module's dispatch cost as much as the layer's products.

Layers of one output (a model's head, fp32 from ``NARROW_MIN_K`` inputs on; a bf16 input: up to
4 outputs) run as ``linear.c``'s narrow kernel, forward and backward, with x fp32 or bf16 next to fp32 weights: cast_dense's bf16 head
reads its bf16 input as it is instead of through an fp32 copy (kaggle's head in the bf16 step,
casts included: ~1.4 -> ~0.4 ms; in fp32 no slower than MKL's).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from . import native


def _declare(lib) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.recc_relu_backward.restype = ctypes.c_int
    lib.recc_relu_backward.argtypes = [p, i64, p, i64, i64, i64, p, p, ctypes.c_int]
    lib.recc_relu_backward_bf16.restype = ctypes.c_int
    lib.recc_relu_backward_bf16.argtypes = [p, i64, p, i64, i64, i64, p, p, ctypes.c_int]
    lib.recc_relu_backward_bf16_f32.restype = ctypes.c_int
    lib.recc_relu_backward_bf16_f32.argtypes = [p, i64, p, i64, i64, i64, p, p, ctypes.c_int]
    lib.recc_round_bf16_keep_f32.restype = None
    lib.recc_round_bf16_keep_f32.argtypes = [p, p, i64, ctypes.c_int]
    for suffix in ("f32", "bf16"):
        fwd, bwd = getattr(lib, f"recc_narrow_forward_{suffix}"), getattr(lib, f"recc_narrow_backward_{suffix}")
        fwd.restype = None
        fwd.argtypes = [p, i64, p, p, i64, i64, i64, ctypes.c_int, p, ctypes.c_int]
        bwd.restype = ctypes.c_int
        bwd.argtypes = [p, i64, p, i64, p, p, i64, i64, i64, p, p, p, ctypes.c_int]


_KERNELS = native.KernelLibrary(Path(__file__).with_name("linear.c"), _declare, "ReLU backward and narrow layers")

ACTIVATIONS = ("none", "relu")
MIN_MACS = 1 << 20  # below ~1M multiply-adds the primitive's set-up outweighs the gain


def _pointwise():
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    return op


def _onednn_eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x @ w.T`` is a product recc hands to oneDNN (or, in bf16, to its fp32 GEMMs on
    widened operands): large enough, on the CPU, fp32 or bf16 operands of one dtype."""
    return (native.mode() != "reference" and x.device.type == "cpu" and x.dtype == w.dtype
            and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
            and x.shape[0] * w.shape[0] * w.shape[1] >= MIN_MACS and _pointwise() is not None)


@functools.lru_cache(maxsize=None)   # asked per bf16 layer call; the CPU does not change
def onednn_has_bf16() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU. Without AVX512 (an AVX2-only EPYC VM) it has no
    bf16 kernel and its bf16 primitives fail to build ("could not create a primitive
    descriptor"), so bf16 products go to its fp32 GEMMs on widened operands instead."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


def _use_onednn(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether oneDNN runs ``x @ w.T`` in x's own dtype."""
    return _onednn_eligible(x, w) and (x.dtype == torch.float32 or onednn_has_bf16())


BF16_PRODUCTS = ("bf16", "fp32")
_BF16_CHOICE: dict = {}     # RECC_BF16_PRODUCTS value -> the units it resolved to in this process
_FP32_MARGIN = 0.9          # fp32 units only for a clear win: they move twice the operand bytes
_clock = time.perf_counter


def _best_times(candidates: dict, rounds: int) -> dict:
    """Best time of each of ``candidates`` (name -> function of no arguments) over ``rounds``,
    run alternately after one untimed call each (a busy machine slows them alike; oneDNN builds
    and caches its primitive on that first call)."""
    for fn in candidates.values():
        fn()
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = _clock()
            fn()
            best[name] = min(best[name], _clock() - t0)
    return best


def _measure_bf16_products() -> str:
    x = torch.randn(2048, 512).to(torch.bfloat16)
    w = torch.randn(512, 512).to(torch.bfloat16)
    op = _pointwise()
    best = _best_times({"bf16": lambda: op(x, w, None, "none", [], ""),
                        "fp32": lambda: op(x.float(), w.float(), None, "none", [], "").to(torch.bfloat16)}, rounds=5)
    return "fp32" if best["fp32"] < _FP32_MARGIN * best["bf16"] else "bf16"


def bf16_products() -> str:
    """Which units run ``recc.linear``'s bf16 products on this CPU: ``"bf16"`` (oneDNN's bf16
    GEMMs) or ``"fp32"`` (the operands widened to fp32 — exactly: every bf16 value is an fp32 value
    — through the fp32 GEMMs, the result rounded to bf16). Both compute the same thing: a product
    of two bf16 numbers is exact in fp32, both sum in fp32 and round the sum to bf16 once, so only
    the summation order differs (as between any two GEMM blockings). What differs is speed: on the
    AMD EPYC (Zen 5) bf16 GEMMs run ~2x fp32's; on an Intel Xeon with AVX512-BF16 but no AMX,
    0.6x (kaggle's layers at B=4096: 108 ms of bf16 products per step against 68 in fp32, 77 with
    the widening). XLA's CPU backend widens bf16 dots to fp32 for the same reason.

    ``RECC_BF16_PRODUCTS=bf16|fp32`` forces one; otherwise (``auto``) the first call times one
    2048x512x512 product both ways, alternately, best of 5 (~70 ms, once per process), and takes
    fp32 only when it is clearly faster (under 0.9x the bf16 time, widening included; on the Xeon
    0.67-0.88x at this shape, busy VM, 0.6x at kaggle's); where oneDNN has no bf16 GEMMs
    (``onednn_has_bf16``: an AVX2-only CPU), fp32 without timing. Activations, saved tensors and
    the dist's payloads stay bf16 either way; the GEMMs read fp32 widenings of their operands,
    each made once and kept next to its bf16 tensor until that is freed (``_WIDE``)."""
    raw = os.environ.get("RECC_BF16_PRODUCTS", "auto").strip().lower()
    if raw not in _BF16_CHOICE:
        if raw in BF16_PRODUCTS:
            _BF16_CHOICE[raw] = raw
        elif raw == "auto":
            if _pointwise() is None:
                _BF16_CHOICE[raw] = "bf16"      # no oneDNN: torch's own bf16 products
            elif not onednn_has_bf16():
                _BF16_CHOICE[raw] = "fp32"      # no bf16 GEMMs on this CPU: nothing to time
            else:
                _BF16_CHOICE[raw] = _measure_bf16_products()
        else:
            raise ValueError(f"RECC_BF16_PRODUCTS={raw!r}: expected auto, bf16 or fp32")
    return _BF16_CHOICE[raw]


def _widen_bf16(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether this bf16 product runs on fp32 units (``bf16_products``)."""
    return x.dtype == torch.bfloat16 and _onednn_eligible(x, w) and bf16_products() == "fp32"


# A bf16 tensor -> (its fp32 widening, the bf16 tensor's version when widened). A bf16 layer on
# fp32 units reads each bf16 operand as fp32 in its forward, its input again in its backward (the
# weight gradient), and an MLP's next layer reads this layer's output: the widening is made once,
# when the output is rounded (``_round_keep_wide``) or on the first read (``_widened``), and lives
# as long as the bf16 tensor (a saved activation: until its backward has run; ~33 MB at kaggle's
# B=4096). kaggle at B=4096: 10 copies of a [4096, 512] activation per step became 3.
#
# Only tensors made in this step are kept: a layer's rounded output, and bf16 tensors with a
# grad_fn (made by an op of this step's graph, e.g. a weight's per-step cast). A leaf (a bf16
# parameter, a user's input buffer) can be rewritten in ways its version counter does not see
# (``.data``, numpy, ``data_ptr``), so it is widened afresh at every read; inference tensors
# (``torch.inference_mode``) have no version counter and are not kept either.
_WIDE = WeakTensorKeyDictionary()


def _keepable(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and not t.is_inference()


def _widened(t: torch.Tensor) -> torch.Tensor:
    """``t.float()``, made once per bf16 tensor of this step (again if ``t`` was written in place)."""
    if not _keepable(t):
        return t.float()
    hit = _WIDE.get(t)
    if hit is not None and hit[1] == t._version:
        return hit[0]
    wide = t.float()
    if t.grad_fn is not None:
        _WIDE[t] = (wide, t._version)
    return wide


def _round_keep_wide(y: torch.Tensor) -> torch.Tensor:
    """An fp32 GEMM result as bf16, its rounded fp32 values kept as the bf16 tensor's widening."""
    lib = _KERNELS.get() if y.is_contiguous() else None
    if lib is None:
        return y.to(torch.bfloat16)
    out = torch.empty(y.shape, dtype=torch.bfloat16)
    lib.recc_round_bf16_keep_f32(y.data_ptr(), out.data_ptr(), y.numel(), torch.get_num_threads())
    if _keepable(out):
        _WIDE[out] = (y, out._version)
    return out


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation {activation!r} not in {ACTIVATIONS}")


def torch_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], activation: str):
    """``act(x @ w.T + b)`` as torch's ops (differentiable: torch's autograd runs their backward)."""
    y = F.linear(x, w, b)
    return torch.relu(y) if activation == "relu" else y


NARROW_MAX = 8   # the most output columns linear.c's narrow kernel takes (its per-row buffer)
NARROW_MIN_K = 128   # an fp32 head with fewer inputs runs faster on the libraries (``_narrow_wins``)


def _narrow_wins(x: torch.Tensor, n: int) -> bool:
    """Whether the narrow kernel beats the libraries for ``n`` outputs: for one with an fp32 input
    from K = 128 inputs on (the head: 0.31 vs 0.41 ms at K = 256, B = 4096, equal at K = 1024; on
    one EPYC core, B = 2048, forward + backward: K = 256 122 vs 152 us, 128 87 vs 89, 64 68 vs 48,
    4 54 vs 20: below 128 its per-row loop costs more than the libraries' fixed set-up); with a
    bf16 input, whatever K, up to 4 outputs (bf16 0.23 vs 0.84 ms for one, the libraries' path
    casting x to fp32 first; 0.79 vs 0.96 ms at 4, 1.60 vs 0.94 at 8); with fp32 inputs MKL/oneDNN
    win from 4 outputs on (0.74 vs 0.53 ms, 8: 1.8 vs 0.5). B = 4096, K = 256, 2-vCPU Intel Xeon
    unless said."""
    if x.dtype == torch.bfloat16:
        return n <= 4
    return n == 1 and x.shape[1] >= NARROW_MIN_K


def _narrow_lib(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]):
    """linear.c, when ``x @ w.T + b`` runs as its narrow-output kernel: few output columns (a
    model's head; ``_narrow_wins``), fp32 weights and bias, x fp32 or bf16 rows on the CPU."""
    if not (x.device.type == w.device.type == "cpu" and x.dim() == 2 and 1 <= w.shape[0] <= NARROW_MAX
            and w.dtype == torch.float32 and x.dtype in (torch.float32, torch.bfloat16)
            and (b is None or b.dtype == torch.float32) and _narrow_wins(x, w.shape[0])):
        return None
    return _KERNELS.get()   # None under RECC_CPU_KERNELS=reference


def _profiled(name: str):
    """A named range under torch.profiler (the narrow kernels are products: step_profile counts
    them with the GEMMs); nothing otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def _narrow_forward(lib, x, w, b, activation):
    x = x if x.stride(1) == 1 else x.contiguous()
    w, y = w.contiguous(), torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    b = None if b is None else b.contiguous()
    fn = lib.recc_narrow_forward_bf16 if x.dtype == torch.bfloat16 else lib.recc_narrow_forward_f32
    with _profiled("recc.narrow_linear"):
        fn(x.data_ptr(), x.stride(0), w.data_ptr(), None if b is None else b.data_ptr(), x.shape[0], x.shape[1],
           w.shape[0], int(activation == "relu"), y.data_ptr(), torch.get_num_threads())
    return y


def _narrow_backward(lib, grad, x, w, y, activation, needs):
    grad = grad if grad.stride(1) == 1 else grad.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w.contiguous()
    (bsz, k), n = x.shape, w.shape[0]
    dx = torch.empty(bsz, k, dtype=x.dtype) if needs[0] else None
    dw = torch.empty(n, k, dtype=torch.float32) if needs[1] else None
    db = torch.empty(n, dtype=torch.float32) if needs[2] else None
    fn = lib.recc_narrow_backward_bf16 if x.dtype == torch.bfloat16 else lib.recc_narrow_backward_f32
    y = y.contiguous() if activation == "relu" else None
    with _profiled("recc.narrow_linear_backward"):
        rc = fn(grad.data_ptr(), grad.stride(0), x.data_ptr(), x.stride(0), w.data_ptr(),
                None if y is None else y.data_ptr(), bsz, k, n,
                *(None if t is None else t.data_ptr() for t in (dx, dw, db)), torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"linear: the narrow kernel takes at most {NARROW_MAX} outputs, not {n}")
    if rc != 0:
        raise MemoryError("linear: the narrow layer's backward could not allocate its per-thread sums")
    return dx, dw, db


def linear_torch_runs(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], activation: str) -> bool:
    """Whether this layer's forward and backward are torch's own ops in ``linear_forward`` /
    ``linear_backward`` anyway, so the runtime may run it as ``torch_linear`` under torch's
    autograd: fp32 on the CPU, under ``MIN_MACS`` (``F.linear``), not a narrow-kernel head, a ReLU
    mask narrower than ``RELU_KERNEL_MIN_N`` (``threshold_backward``) and a weight gradient
    ``g^T x`` (not ``_weight_grad_transposed``). The products and their order are the same; what
    goes is a Python ``autograd.Function`` and these wrappers' dispatch: ~10 us a layer forward
    and ~20 us backward (one EPYC core), against 30-90 us for the whole of a zoo model's layer at
    B = 2048 (mmoe has 9)."""
    check_activation(activation)
    return (x.dtype == w.dtype == torch.float32 and x.device.type == w.device.type == "cpu" and x.dim() == 2
            and w.dim() == 2 and x.shape[1] == w.shape[1] and (b is None or b.dtype == torch.float32)
            and x.shape[0] * w.shape[0] * w.shape[1] < MIN_MACS and w.shape[0] < RELU_KERNEL_MIN_N
            and not _weight_grad_transposed(w.shape[1], w.shape[0]) and _narrow_lib(x, w, b) is None)


def linear_forward(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], activation: str = "none"):
    """``act(x @ w.T + b)`` for x [B, K], w [N, K], b [N] or None. x and w of two dtypes (cast_dense's
    bf16 head: bf16 activations, fp32 weights) compute in the wider one, x widened exactly."""
    check_activation(activation)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(w.shape)} do not multiply (x must be "
                         f"[B, K] and weight [N, K])")
    lib = _narrow_lib(x, w, b)
    if lib is not None:
        return _narrow_forward(lib, x, w, b, activation)
    if x.dtype != w.dtype:
        wide = torch.promote_types(x.dtype, w.dtype)
        return linear_forward(x.to(wide), w.to(wide), None if b is None else b.to(wide), activation)
    if _widen_bf16(x, w):
        return _round_keep_wide(_forward(_widened(x), _widened(w), None if b is None else b.float(), activation))
    if not _use_onednn(x, w):
        return torch_linear(x, w, b, activation)
    return _forward(x.contiguous(), w.contiguous(), b, activation)


_TUNED: dict = {}          # (product, dtype, shape, threads, ...) -> the candidate that runs it
_TUNING_ROUNDS = 3
_TUNING_MARGIN = 0.95      # another candidate replaces the default only when clearly faster


def gemm_tuning() -> bool:
    """Whether large products pick their backend by timing (``RECC_CPU_GEMM_TUNING=0``: never)."""
    return os.environ.get("RECC_CPU_GEMM_TUNING", "1").strip() != "0"


def _fastest(key: tuple, candidates: dict) -> str:
    """The name of the fastest of ``candidates`` (name -> function of no arguments, all computing
    the same product), the first one being the default. Each shape is timed once per process, on
    its first call, like cuDNN's benchmark mode: the candidates run alternately, best of
    ``_TUNING_ROUNDS``, and another replaces the default only under 0.95x its time. Why time rather
    than rule: which of MKL and oneDNN is faster depends on the CPU and the shape, and rules
    measured on one machine were wrong on the next (an Intel Xeon: MKL's forward+ReLU 0.55-1.1x
    oneDNN's fused one depending on the layer; oneDNN's weight gradient 1.2-2.4x slower than MKL's,
    the other way round on the AMD EPYC). Ties are within fp32 rounding of each other."""
    names = list(candidates)
    if len(names) == 1 or not gemm_tuning():
        return names[0]
    key = key + (torch.get_num_threads(),)
    if key not in _TUNED:
        best = _best_times(candidates, _TUNING_ROUNDS)
        pick = min(names, key=best.get)
        _TUNED[key] = pick if best[pick] < _TUNING_MARGIN * best[names[0]] else names[0]
    return _TUNED[key]


def _mkl_linear(x, w, b, activation):
    y = torch.addmm(b, x, w.t()) if b is not None else x.mm(w.t())
    return y.relu_() if activation == "relu" else y


def _forward(x, w, b, activation):
    candidates = {"onednn": lambda: _pointwise()(x, w, b, activation, [], ""),
                  "mkl": lambda: _mkl_linear(x, w, b, activation)}
    key = ("forward", x.dtype, x.shape[0], x.shape[1], w.shape[0], activation, b is not None)
    return candidates[_fastest(key, candidates)]()


def input_grad(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``g w`` ([B, K]) for a [B, N] output gradient and [N, K] weight, as the faster product."""
    if not _use_onednn(g, w):
        return g.mm(w)
    # The transposed weight as a view: oneDNN packs it for the GEMM either way (a contiguous
    # copy first cost ~0.3 ms per layer at B=2048).
    candidates = {"onednn": lambda: _pointwise()(g, w.t(), None, "none", [], ""), "mkl": lambda: g.mm(w)}
    return candidates[_fastest(("input_grad", g.dtype, *g.shape, w.shape[1]), candidates)]()


# An fp32 gradient narrower than this is masked and summed by torch: the C pass's per-row loop
# and its set-up cost more than a second pass over a [B, N] that stays in cache (one EPYC core,
# B=2048, C vs threshold_backward + sum: N=3 21 vs 6 us, 8 18 vs 7, 64 33 vs 30, 128 49 vs 53).
# bf16 keeps the C pass at every width (it also widens the gradient for fp32 units).
RELU_KERNEL_MIN_N = 128


def relu_backward(grad: torch.Tensor, y: torch.Tensor, bias_grad: bool, widen: bool = False):
    """``(grad * (y > 0), its column sum or None)`` for a [B, N] gradient and ReLU output; with
    ``widen``, a bf16 gradient comes back as fp32 (both results), for GEMMs on fp32 units."""
    if grad.shape != y.shape or grad.dim() != 2:
        raise ValueError(f"relu_backward: grad {tuple(grad.shape)} and output {tuple(y.shape)} must be one [B, N] shape")
    dtype = grad.dtype
    lib = _KERNELS.get() if dtype == y.dtype and grad.device.type == "cpu" and \
        (dtype == torch.bfloat16 or (dtype == torch.float32 and grad.shape[1] >= RELU_KERNEL_MIN_N)) else None
    if lib is None:
        g = torch.ops.aten.threshold_backward(grad, y, 0)
        g = g.float() if widen else g
        return g, (g.sum(0) if bias_grad else None)
    grad = grad if grad.stride(1) == 1 else grad.contiguous()
    y = y if y.stride(1) == 1 else y.contiguous()
    b, n = grad.shape
    widen = widen and dtype == torch.bfloat16
    g = torch.empty(b, n, dtype=torch.float32 if widen else dtype)
    db = torch.empty(n, dtype=torch.float32) if bias_grad else None   # summed in fp32 either way
    fn = (lib.recc_relu_backward if dtype == torch.float32 else
          lib.recc_relu_backward_bf16_f32 if widen else lib.recc_relu_backward_bf16)
    rc = fn(grad.data_ptr(), grad.stride(0), y.data_ptr(), y.stride(0), b, n, g.data_ptr(),
            None if db is None else db.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("relu_backward: the C kernel could not allocate its per-thread sums")
    return g, (db.to(g.dtype) if db is not None else None)


def _weight_grad_transposed(k: int, n: int) -> bool:
    """Whether ``(x^T g)^T`` beats ``g^T x`` for a layer with K = ``k`` inputs and N = ``n``
    outputs. MKL's sgemm runs the weight gradient of a layer with few or odd-sized inputs much
    slower as ``g^T x`` (its K x B operand is read across short rows). Measured on one core, 1024
    rows, median of 9 timings: K=13 0.70 -> 0.24 ms, K=16 0.44 -> 0.25, K=104 1.37 -> 1.16, K=479
    19.3 -> 12.3 (N=512/1024); for K=64/128/256/512 it is within +-7% either way, so those keep
    ``g^T x``. Under 16 outputs the transposed product is the slow one: its [K, N] result is
    written in N-wide rows (one EPYC core, B=2048, 20th percentile: K=18 N=3 14 vs 51 us, K=66 N=3
    38 vs 171 — an MMoE gate —, K=13 N=8 19 vs 39; from N=16 on it wins or ties: K=18 N=16 27 vs
    26, K=66 N=64 230 vs 204)."""
    return n >= 16 and (k <= 32 or k % 16 != 0)


def _weight_grad_onednn(g: torch.Tensor, x: torch.Tensor) -> bool:
    """oneDNN's matmul for an fp32 weight gradient with K, N >= 64 on a CPU that is not Intel's:
    1.6-1.75x MKL's ``g^T x`` on an AMD EPYC (Zen 5, 2 threads, B=4096: K x N = 369x512 302 vs
    182 GFLOP/s, 512x256 314 vs 191, 256x64 266 vs 176, 1024x1024 356 vs 201), where MKL runs
    its slower path. On an Intel Xeon (AVX-512) MKL runs its own and is the faster, 1.2-2.4x
    (B=2048/4096, min of 25: 512x256 2.38 vs 3.26 ms, 368x512 3.32 vs 4.85, 64x512 0.84 vs 2.00,
    256x64 0.36 vs 0.61 at B=2048): oneDNN reads the transposed [N, B] operand through a copy.
    Below 64, and in bf16 (MKL faster: 827 vs 560 GFLOP/s at 369x512 on the EPYC), MKL too."""
    return _weight_grad_onednn_applies(g, x) and native.cpu_vendor() != "GenuineIntel"


def _weight_grad_onednn_applies(g: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether oneDNN is a candidate for this weight gradient at all (fp32, K and N >= 64)."""
    return g.dtype == x.dtype == torch.float32 and min(x.shape[1], g.shape[1]) >= 64 and _use_onednn(g.t(), x.t())


def weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g^T x`` ([N, K]) for a [B, N] output gradient and [B, K] input, as the faster product:
    oneDNN's or MKL's (``_mkl_weight_grad``), the rule's choice first (``_weight_grad_onednn``),
    timed where both apply."""
    mkl = lambda: _mkl_weight_grad(g, x)  # noqa: E731
    if not _weight_grad_onednn_applies(g, x):
        return mkl()
    onednn = lambda: _pointwise()(g.t(), x.t(), None, "none", [], "")  # noqa: E731
    candidates = {"onednn": onednn, "mkl": mkl} if _weight_grad_onednn(g, x) else {"mkl": mkl, "onednn": onednn}
    return candidates[_fastest(("weight_grad", g.dtype, *g.shape, x.shape[1]), candidates)]()


def _mkl_weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if native.mode() != "reference" and x.device.type == "cpu" and _weight_grad_transposed(x.shape[1], g.shape[1]):
        dw_t = x.t().mm(g)
        # A fresh row-major [N, K] (``contiguous()`` of a one-row or one-column transpose keeps
        # its odd strides, which DDP's bucket views would then copy each step).
        return torch.empty(dw_t.shape[1], dw_t.shape[0], dtype=dw_t.dtype).copy_(dw_t.t())
    return g.t().mm(x)


def linear_backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, y: Optional[torch.Tensor],
                    activation: str, needs=(True, True, True)):
    """Gradients ``(dx, dw, db)`` of ``linear_forward`` given its output ``y`` (needed for relu);
    entries whose ``needs`` flag is False come back as None; dx in x's dtype, dw and db in the
    weight's (autograd casts db to the bias's dtype should it differ)."""
    lib = _narrow_lib(x, w, None)
    if lib is not None and grad.dtype == torch.float32:
        return _narrow_backward(lib, grad, x, w, y, activation, needs)
    if x.dtype != w.dtype:
        wide = torch.promote_types(x.dtype, w.dtype)
        grads = linear_backward(grad.to(wide), x.to(wide), w.to(wide), y, activation, needs)
        return tuple(None if t is None else t.to(dtype) for t, dtype in zip(grads, (x.dtype, w.dtype, w.dtype)))
    g, db = grad.contiguous(), None
    wide = grad.dtype == torch.bfloat16 and _widen_bf16(x, w)
    if activation == "relu":
        g, db = relu_backward(g, y, bool(needs[2]), widen=wide)
    if wide:
        # bf16 products on fp32 units: widen each operand once; round each result to bf16 once.
        g, w, x = g.float(), _widened(w), (_widened(x) if needs[1] else x)
    dx = dw = None
    if needs[0]:
        dx = input_grad(g, w)
    if needs[1]:
        dw = weight_grad(g, x)
    if needs[2] and db is None:
        db = g.sum(0)
    if wide:
        dx, dw, db = (None if t is None else t.to(torch.bfloat16) for t in (dx, dw, db))
    return dx, dw, db
