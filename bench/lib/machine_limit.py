"""What this machine allows for one training step: the limit every benchmark row is a fraction of.

limit = the dense part's matrix products at the fastest matrix product this machine offers for
their dtype and shape + the step's embedding bytes at the measured copy bandwidth.

- Dense: every ``nn.Linear`` of the model at the step's batch B runs three GEMMs — forward
  ``[B, K] x [K, N]``, the weight gradient ``[N, B] x [B, K]`` and the input gradient
  ``[B, N] x [N, K]`` (not for the model's first layer, whose input is data). Each shape is timed
  here, in this run, on every path torch offers for the dtype — ``torch.mm`` (MKL on this CPU's
  fp32) and oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``) — and the fastest counts.
  For bf16 that includes the fp32 products of the same (bf16-valued) operands, which compute the
  same thing (a product of bf16 numbers is exact in fp32, the sum is fp32 either way): on a CPU
  whose bf16 GEMMs are slower than its fp32 ones (an Intel Xeon without AMX) those are the
  machine's fastest bf16 products, and ``recc.linear`` runs them (``bf16_products``). The
  widening itself is not counted. Those fp32 products are the fp32 limit's own measurement of
  the shape, not a second one: an fp32 product runs as fast on bf16-valued operands (measured
  within this VM's noise at kaggle's shapes), and timing the same products twice, minutes apart
  on a busy VM, put the two limits up to 1.3x apart (bf16 47.0 ms against fp32 35.7 in one run).
  The interaction's and elementwise ops' time is not in the limit (it is small next to the GEMMs
  for the DLRM presets, and a lower bound only gets lower for leaving it out).
- Embeddings: ``embedding_bytes`` of ``bench.lib.timing`` (rows read, touched rows and state
  read and written, pooled outputs written and their gradients read) over ``memory_bandwidth``.

``fraction = limit / measured step``: 100% would be a step that does nothing but the GEMMs at
their best speed and moves its embedding bytes at copy speed, one after the other.
"""
from __future__ import annotations

import math
import time

import torch
from torch import nn

from recc.kernels.cpu.linear import onednn_has_bf16

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_CACHE: dict = {}


def _best_seconds(fn, repeats: int = 5) -> float:
    fn()
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_seconds(m: int, k: int, n: int, dtype: str) -> tuple[float, str]:
    """Fastest time of an ``[m, k] x [k, n]`` product at ``dtype`` and the path that gave it."""
    key = (m, k, n, dtype)
    if key not in _CACHE:
        dt = DTYPES[dtype]
        a = torch.randn(m, k).to(dt)
        b = torch.randn(k, n).to(dt)
        bt = b.t().contiguous()                       # oneDNN's linear takes the weight as [n, k]
        paths = {"torch.mm": lambda: torch.mm(a, b)}
        pointwise = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
        # oneDNN builds no bf16 primitive where it has no bf16 kernels (an AVX2-only CPU)
        if pointwise is not None and (dt == torch.float32 or onednn_has_bf16()):
            paths["onednn"] = lambda: pointwise(a, bt, None, "none", [], "")
        times = {name: _best_seconds(fn) for name, fn in paths.items()}
        if dt == torch.bfloat16:
            fp32_s, fp32_path = gemm_seconds(m, k, n, "fp32")
            times[f"{fp32_path} fp32"] = fp32_s
        best = min(times, key=times.get)
        _CACHE[key] = (times[best], best)
    return _CACHE[key]


def forget() -> None:
    """Drop every measured product, so the next limit is measured afresh (once per timing round:
    on a busy VM the machine's speed drifts over a run, and a step is only comparable with a
    limit measured next to it)."""
    _CACHE.clear()


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def gemm_shapes(model: nn.Module, batch: int) -> list[tuple[int, int, int]]:
    """``(m, k, n)`` of every GEMM one training step runs for the model's ``nn.Linear`` layers
    (forward, weight gradient, and input gradient except for the first layer's data input)."""
    shapes = []
    for i, layer in enumerate(linear_layers(model)):
        k, n = layer.in_features, layer.out_features
        shapes += [(batch, k, n), (n, batch, k)] + ([(batch, n, k)] if i else [])
    return shapes


def dense_limit(model: nn.Module, batch: int, dtype: str) -> tuple[float, float, dict]:
    """``(seconds, flops, seconds per path)`` of the model's GEMMs for one training step."""
    seconds, flops, by_path = 0.0, 0.0, {}
    for m_, k_, n_ in gemm_shapes(model, batch):
        s, path = gemm_seconds(m_, k_, n_, dtype)
        seconds += s
        flops += 2.0 * m_ * k_ * n_
        by_path[path] = by_path.get(path, 0.0) + s
    return seconds, flops, by_path


def step_limit(model: nn.Module, batch: int, dtype: str, embedding_bytes: float, bandwidth: float) -> dict:
    """The limit of one step at ``dtype`` and its parts (seconds, GEMM FLOP/s it assumes)."""
    dense_s, flops, by_path = dense_limit(model, batch, dtype)
    emb_s = embedding_bytes / bandwidth
    return {"seconds": dense_s + emb_s, "dense_s": dense_s, "embedding_s": emb_s, "flops": flops,
            "gflops": flops / dense_s / 1e9 if dense_s else 0.0, "paths": by_path}


def describe(limit: dict, dtype: str) -> str:
    paths = ", ".join(f"{p} {s * 1e3:.2f} ms" for p, s in sorted(limit["paths"].items()))
    return (f"{dtype} limit {limit['seconds'] * 1e3:.2f} ms = GEMMs {limit['dense_s'] * 1e3:.2f} ms "
            f"({limit['flops'] / 1e9:.2f} GFLOP at {limit['gflops']:.0f} GFLOP/s; {paths}) + embeddings "
            f"{limit['embedding_s'] * 1e3:.2f} ms")
