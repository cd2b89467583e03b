"""Dense layers of a DLRM preset, forward + backward, as torch runs them vs as recc runs them.

For every ``nn.Linear`` of the preset's bottom and top MLPs (with the ReLU after it, where the
model has one), at the per-rank batch of a world of ``--world-size`` ranks, one thread:

- ``torch``: ``F.linear`` + ``torch.relu`` and autograd's backward (MKL sgemm), what eager
  PyTorch and TorchRec run for the user's MLP;
- ``recc``: what the compiled program runs after ``align_linear`` (K zero-padded to a multiple of
  8 where misaligned) and ``fuse_linear_act`` (``recc.kernels.linear``: oneDNN forward with the
  ReLU fused, oneDNN input gradient, MKL weight gradient).

Prints per layer the median milliseconds of forward and backward over ``--reps`` runs, the two
side by side with the ratio, and the totals; and next to recc's the layer's share of the
machine's limit (``machine_limit.py``: its three GEMMs, two for the first layer, each at the
fastest path measured in this run, best of 5, operands hot) and recc's fraction of it — what the
layer alone would cost ``train_throughput.py``'s ``of limit`` column if nothing else ran. Then the dot interaction at the same batch, fp32
and bf16: ``torch`` is the reference DLRM's ``stack`` + ``bmm`` + lower-triangle gather +
``cat`` under autograd (under ``torch.autocast(bf16)`` for the bf16 row, as a TorchRec user
with autocast runs it), ``recc`` is ``recc.kernels.dot_interaction_*`` reading the dense
vector and one batched lookup [B, T*D] in place (in the bf16 row: a bf16 dense vector, fp32
lookups and a bf16 output, as ``cast_dense`` compiles it). Example::

    python -m bench.dense_kernels --config kaggle            # ~30 s
    python -m bench.dense_kernels --config small --reps 30
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.lib.machine_limit import gemm_seconds
from recc.heap import keep_step_memory
from recc.kernels import dot_interaction_backward, dot_interaction_forward, linear_backward, linear_forward
from recc.models import build_model, load_preset
from recc.passes.align_linear import k_padding


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


def layers(model: nn.Module):
    """``(name, in, out, relu_after)`` of every Linear in the bottom and top MLPs."""
    out = []
    for seq_name in ("bot_l", "top_l"):
        seq = list(getattr(model, seq_name))
        for i, m in enumerate(seq):
            if isinstance(m, nn.Linear):
                relu = i + 1 < len(seq) and isinstance(seq[i + 1], nn.ReLU)
                out.append((f"{seq_name}.{i}", m.in_features, m.out_features, relu))
    return out


def time_layer(b: int, k: int, n: int, relu: bool, reps: int, needs_dx: bool):
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(b, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g)
    grad = torch.randn(b, n, generator=g)
    act = "relu" if relu else "none"

    # torch: autograd over F.linear (+ relu)
    xr, wr, br = x.clone().requires_grad_(needs_dx), w.clone().requires_grad_(), bias.clone().requires_grad_()

    def torch_fwd():
        y = F.linear(xr, wr, br)
        return torch.relu(y) if relu else y

    def torch_bwd():
        torch.autograd.grad(torch_fwd(), [p for p in (xr, wr, br) if p.requires_grad], grad)

    # recc: K padded to a multiple of 8 when misaligned (align_linear), then recc.linear
    pad = k_padding(k, n)
    xp, wp = F.pad(x, (0, pad)), F.pad(w, (0, pad))

    def recc_fwd():
        return linear_forward(F.pad(x, (0, pad)) if pad else x, F.pad(w, (0, pad)) if pad else w, bias, act)

    y = linear_forward(xp, wp, bias, act)

    def recc_bwd():
        linear_backward(grad, xp, wp, y, act, (needs_dx, True, True))

    t_fwd = _median_ms(torch_fwd, reps)
    t_all = _median_ms(torch_bwd, reps)  # forward + backward
    r_fwd = _median_ms(recc_fwd, reps)
    r_bwd = _median_ms(recc_bwd, reps)
    return t_fwd, t_all - t_fwd, r_fwd, r_bwd, pad


def time_interaction(b: int, tables: int, d: int, pad: int, dtype: torch.dtype, reps: int):
    """(torch fwd, torch bwd, recc fwd, recc bwd) ms of the dot interaction of a dense vector and
    ``tables`` pooled lookups of width ``d``, at ``dtype`` (fp32 or bf16)."""
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(b, d, generator=g)
    lookups = torch.randn(b, tables * d, generator=g)  # one batched lookup: fp32, as the TBE writes it
    li, lj = torch.tril_indices(tables + 1, tables + 1, -1)
    grad = torch.randn(b, d + li.numel() + pad, generator=g)
    bf16 = dtype == torch.bfloat16

    dr, er = dense.clone().requires_grad_(), lookups.clone().requires_grad_()

    def torch_fwd():
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            x = torch.stack([dr] + list(er.split(d, dim=1)), dim=1)
            z = torch.bmm(x, x.transpose(1, 2))[:, li, lj]
            out = torch.cat([dr.to(z.dtype), z], dim=1)
            return F.pad(out, (0, pad)) if pad else out

    def torch_bwd():
        out = torch_fwd()
        torch.autograd.grad(out, [dr, er], grad.to(out.dtype))

    dx = dense.to(dtype)
    feats = [(0, t * d) for t in range(tables)]
    gx = grad.to(dtype)

    def recc_fwd():
        return dot_interaction_forward(dx, [lookups], feats, li, lj, pad)

    def recc_bwd():
        dot_interaction_backward(dx, [lookups], feats, li, lj, pad, gx)

    t_fwd = _median_ms(torch_fwd, reps)
    t_all = _median_ms(torch_bwd, reps)
    return t_fwd, t_all - t_fwd, _median_ms(recc_fwd, reps), _median_ms(recc_bwd, reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="kaggle")
    p.add_argument("--world-size", type=int, default=2, help="per-rank batch = preset batch / world size")
    p.add_argument("--batch-size", type=int, help="per-rank batch (overrides --world-size)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    # The heap a recc CPU model trains with (freed step memory kept, not faulted in again per
    # call), for both columns: without it every fresh multi-MB output costs page faults.
    keep_step_memory()
    b = args.batch_size or load_preset(args.config)["batch_size"] // args.world_size
    model = build_model(args.config, device="meta")
    onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None) is not None and torch.backends.mkldnn.is_available()
    print(f"dense layers of {args.config} at B={b}, {args.threads} thread(s), torch {torch.__version__}, "
          f"oneDNN {'available' if onednn else 'NOT available (recc falls back to F.linear)'}")
    print(f"{'layer':<9} {'K x N':>11} {'relu':>4} | {'torch fwd':>9} {'bwd':>7} | {'recc fwd':>8} {'bwd':>7} "
          f"{'K pad':>5} | {'torch/recc':>10} | {'limit':>6} {'recc of limit':>13}")
    tot_t = tot_r = tot_l = 0.0
    for i, (name, k, n, relu) in enumerate(layers(model)):
        needs_dx = i != 0  # the first layer's input (dense features) needs no gradient
        t_f, t_b, r_f, r_b, pad = time_layer(b, k, n, relu, args.reps, needs_dx)
        products = [(b, k, n), (n, b, k)] + ([(b, n, k)] if needs_dx else [])   # as machine_limit counts them
        lim = 1e3 * sum(gemm_seconds(*shape, "fp32")[0] for shape in products)
        tot_t += t_f + t_b
        tot_r += r_f + r_b
        tot_l += lim
        print(f"{name:<9} {f'{k}x{n}':>11} {'yes' if relu else 'no':>4} | {t_f:>9.2f} {t_b:>7.2f} | {r_f:>8.2f} "
              f"{r_b:>7.2f} {f'+{pad}' if pad else '':>5} | {(t_f + t_b) / (r_f + r_b):>9.2f}x | {lim:>6.2f} "
              f"{lim / (r_f + r_b):>12.0%}")
    print(f"{'total':<9} {'':>11} {'':>4} | {tot_t:>17.2f} | {tot_r:>16.2f} {'':>5} | {tot_t / tot_r:>9.2f}x | "
          f"{tot_l:>6.2f} {tot_l / tot_r:>12.0%}")

    tables, d = len(model.emb_l), model.emb_l[0].embedding_dim
    p_pairs = tables * (tables + 1) // 2
    top0 = next(m for m in model.top_l if isinstance(m, nn.Linear))
    pad = k_padding(d + p_pairs, top0.out_features)
    print(f"\ndot interaction of {tables} tables + the dense vector, D={d} ({p_pairs} pairs, output "
          f"{d + p_pairs} + {pad} pad) at B={b}")
    print(f"{'dtype':<9} | {'torch fwd':>9} {'bwd':>7} | {'recc fwd':>8} {'bwd':>7} | {'torch/recc':>10}")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        t_f, t_b, r_f, r_b = time_interaction(b, tables, d, pad, dtype, args.reps)
        print(f"{name:<9} | {t_f:>9.2f} {t_b:>7.2f} | {r_f:>8.2f} {r_b:>7.2f} | {(t_f + t_b) / (r_f + r_b):>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
