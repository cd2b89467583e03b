#!/usr/bin/env python
"""One-command GPU check of recc's CUDA backend: correctness, bandwidth, a full training step.

    python -m bench.gpu_check            # < 8 minutes on one H200; prints one table at the end

1. Correctness: every CUDA kernel (TBE forward and fused backward with each optimizer, fp32
   and fp16 weights, sum / mean / weighted pooling; the wire codecs; row bucketization; the
   dot interaction; the bounds checks) against the CPU reference on fresh random inputs.
   Before each run the allocator's free memory is filled with NaN (``poison``), so a kernel
   that leaves part of its output unwritten shows up as NaN; the relative error
   ``max|gpu - cpu| / max|cpu|`` is printed.  Codecs must match the CPU bytes exactly
   (fp8/int8: up to one code step where the scale division rounds differently is not allowed
   either: the kernels use the same IEEE operations).
2. Bandwidth: each TBE kernel's achieved bytes/s against the device's measured copy
   bandwidth (a device-to-device copy).  Bytes counted: forward, the rows read + ids +
   output; backward, the gradient rows read per id + each unique row's weights and state
   read and written + ids.  Target: TBE fwd+bwd+update >= 50% on ``small`` at batch 16384.
3. A full DLRM training step (forward, loss, backward with the fused table update, dense SGD)
   of recc on CUDA against eager PyTorch CUDA (``nn.EmbeddingBag(sparse=True)`` per table,
   SGD on the sparse gradients): ``small`` at batch 16384 and the MLPerf ``dlrmv2`` shapes with
   rows capped at 1M per table and batch 16384, so they fit one GPU.  Target: >= 2x on small.
4. The CUDA graph (``bench/gpu_graph.py``): ``dmodel.cuda_graph()`` trained 3 steps against the
   eager recc step on the same fixed-shape batches (every table's bags at ``small``'s size), then
   the step times of eager PyTorch, recc and recc graphed on them; and a recc step, eager and
   graphed, under ``torch.cuda.set_sync_debug_mode("error")`` (any host sync fails it).

Exit status: 0 when every correctness check passes, 1 when one fails (the table marks it
FAIL), 2 when there is no GPU or CuPy.  Performance targets are reported, never asserted.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench import gpu_graph
from bench import gpu_precision as mp
from bench.lib.gpu import Report, Row, format_table, rel_err, time_cuda, weight_err

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
PRECISIONS = ("fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2")


def tbe_forward_bytes(n_ids: int, bags: int, dim: int, weight_bytes: int, weighted: bool) -> int:
    """Bytes a TBE forward must move: every id's row, the ids, the offsets, the output."""
    return n_ids * (dim * weight_bytes + 8 + (4 if weighted else 0)) + (bags + 1) * 8 + bags * dim * 4


def tbe_backward_bytes(n_ids: int, unique_rows: int, dim: int, weight_bytes: int, optimizer: str) -> int:
    """Bytes the fused backward must move: each id's gradient row and id, each unique row's
    weights and optimizer state read and written."""
    state = {"sgd": 0, "rowwise_adagrad": 4, "adagrad": 4 * dim, "adam": 8 * dim}[optimizer]
    return n_ids * (dim * 4 + 8) + unique_rows * 2 * (dim * weight_bytes + state)


# ----------------------------------------------------------------------------- GPU helpers


def require_gpu() -> str | None:
    """None when the checks can run, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    from recc.kernels.cuda import loader
    try:
        loader.cupy()
    except RuntimeError as exc:
        return str(exc)
    return None


def poison(device, nbytes: int = 1 << 30) -> None:
    """Fill free allocator blocks with NaN, so outputs a kernel forgets to write read as NaN."""
    # Requests of <= 1 MiB come from the caching allocator's small pool (2 MiB segments),
    # which the large blocks below never reach: fill some of it too.
    blocks = [torch.full(((1 << 20) // 4,), float("nan"), device=device) for _ in range(64)]
    size = 2 << 20
    while size <= nbytes:
        blocks.append(torch.full((size // 4,), float("nan"), device=device))
        size *= 4
    del blocks


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    n = 1 << 29  # 2 GiB of fp32
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), iters=10, warmup=2)
    del src, dst
    return 2 * n * 4 / t


# ----------------------------------------------------------------------------- inputs


def random_bags(T: int, B: int, rows: list[int], mean_len: int, g: torch.Generator, hot: int = 0):
    """Feature-major local ids/offsets with duplicates; ``hot`` extra ids of row 0 of table 0
    in its first bag (a run long enough to be summed in segments)."""
    lengths = torch.randint(0, 2 * mean_len + 1, (T, B), generator=g)
    lengths[0, 0] += hot
    ids = []
    for t in range(T):
        n = int(lengths[t].sum())
        # A small hot set makes duplicate rows common.
        x = torch.where(torch.rand(n, generator=g) < 0.3, torch.randint(0, min(rows[t], 17), (n,), generator=g),
                        torch.randint(0, rows[t], (n,), generator=g))
        if t == 0 and hot:
            start = 0
            x[start:start + hot] = 0
        ids.append(x)
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
    return torch.cat(ids), offsets


def hash_size_cumsum(rows: list[int]) -> torch.Tensor:
    return torch.tensor([0] + rows, dtype=torch.int64).cumsum(0)


# ----------------------------------------------------------------------------- checks


def check_tbe(report: Report, dev, quick: bool) -> None:
    from recc.kernels import linearize_indices, optimizer_state_shapes
    from recc.kernels.cpu import tbe as cpu
    from recc.kernels.cuda import tbe as gpu
    g = torch.Generator().manual_seed(1)
    cases = [(4, 64, "sum", False), (3, 128, "mean", False), (2, 36, "sum", True), (2, 130, "sum", False)]
    for T, D, pooling, weighted in cases[:2] if quick else cases:
        for wdtype in (torch.float32, torch.float16, torch.bfloat16):
            rows = [int(r) for r in torch.randint(50, 3000, (T,), generator=g)]
            B = 257
            ids, offsets = random_bags(T, B, rows, 6, g, hot=gpu.long_run_segment(D) + 300)
            psw = torch.rand(ids.numel(), generator=g) + 0.5 if weighted else None
            hsc = hash_size_cumsum(rows)
            R = int(hsc[-1])
            w = (torch.randn(R, D, generator=g) * 0.1).to(wdtype)
            w_ref = w.float()
            lin = linearize_indices(ids, offsets, hsc, T, B)
            want = cpu.tbe_forward_reference(w_ref, lin, offsets, T=T, B=B, pooling=pooling, per_sample_weights=psw)
            poison(dev)
            got = gpu.tbe_forward(w.to(dev), ids.to(dev), offsets.to(dev), hsc.to(dev), T=T, B=B, pooling=pooling,
                                  per_sample_weights=None if psw is None else psw.to(dev))
            tol = 1e-5
            e = rel_err(got, want)
            name = f"tbe fwd T={T} D={D} {pooling}{' psw' if weighted else ''} {str(wdtype)[6:]}"
            report.add(Row(name, e, tol, e <= tol))
            grad = torch.randn(B, T * D, generator=g)
            for opt in OPTIMIZERS:
                state_ref = {k: torch.rand(s, generator=g) for k, s in optimizer_state_shapes(opt, R, D).items()}
                state_gpu = {k: v.to(dev, copy=True) for k, v in state_ref.items()}
                w_cpu = w_ref.clone()
                cpu.tbe_backward_update_reference(w_cpu, state_ref, lin, offsets, grad, T=T, B=B, pooling=pooling,
                                                  per_sample_weights=psw, optimizer=opt, lr=0.05,
                                                  weight_decay=0.01, step=3)
                w_gpu = w.to(dev, copy=True)
                poison(dev)
                gpu.tbe_backward_update(w_gpu, state_gpu, ids.to(dev), offsets.to(dev), hsc.to(dev), grad.to(dev),
                                        T=T, B=B, pooling=pooling,
                                        per_sample_weights=None if psw is None else psw.to(dev),
                                        optimizer=opt, lr=0.05, weight_decay=0.01, step=3)
                e = max([weight_err(w_gpu, w_cpu)] + [rel_err(state_gpu[k], state_ref[k]) for k in state_ref])
                tol = 2e-5 if wdtype == torch.float32 else 1.0
                report.add(Row(f"tbe bwd {opt} T={T} D={D} {pooling}{' psw' if weighted else ''} {str(wdtype)[6:]}",
                               e, tol, e <= tol))


def long_run_batch(lengths, B: int, R: int, g: torch.Generator):
    """(ids, offsets) of one table of R rows and B bags: rows 0, 1, ... with ``lengths`` ids
    each plus 50 random ones, shuffled and cut into B even bags."""
    ids = torch.cat([torch.full((n,), r) for r, n in enumerate(lengths)] + [torch.randint(0, R, (50,), generator=g)])
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    return ids, torch.linspace(0, ids.numel(), B + 1).round().long()


def check_long_runs(report: Report, dev) -> None:
    """Rows with more ids than a segment, in the sorted order: a short run between two long ones
    inside one segment (the second's partial in slot 1), runs of exactly a segment and one more,
    runs that start or end a segment, runs of more than 32 chunks (two combine levels). Rows 0, 1, ...
    get ``lengths`` ids each, shuffled."""
    from recc.kernels import optimizer_state_shapes
    from recc.kernels.cpu import tbe as cpu
    from recc.kernels.cuda import tbe as gpu
    g = torch.Generator().manual_seed(4)
    B, D, R = 4, 32, 40
    seg = gpu.long_run_segment(D)
    # 40 and 33 chunks: more than one combine level's fan-in (32), so a second level runs
    for lengths in ((600, 3, 530, 700), (seg + 1, 1, 2, seg, 2 * seg + 2), (10 * seg + 3, seg - 1, 5 * seg),
                    (40 * seg + 5, 2, 33 * seg)):
        ids, offsets = long_run_batch(lengths, B, R, g)
        hsc = torch.tensor([0, R])
        w0 = torch.randn(R, D, generator=g)
        grad = torch.randn(B, D, generator=g)
        for opt in ("sgd", "rowwise_adagrad", "adam"):
            state = {k: torch.rand(s, generator=g) for k, s in optimizer_state_shapes(opt, R, D).items()}
            w_ref, s_ref = w0.clone(), {k: v.clone() for k, v in state.items()}
            cpu.tbe_backward_update_reference(w_ref, s_ref, ids, offsets, grad, T=1, B=B, optimizer=opt, lr=0.1,
                                              eps=0.1, step=2)
            w_gpu, s_gpu = w0.to(dev), {k: v.to(dev) for k, v in state.items()}
            poison(dev)
            gpu.tbe_backward_update(w_gpu, s_gpu, ids.to(dev), offsets.to(dev), hsc.to(dev), grad.to(dev), T=1, B=B,
                                    optimizer=opt, lr=0.1, eps=0.1, step=2)
            e = max([rel_err(w_gpu, w_ref)] + [rel_err(s_gpu[k], s_ref[k]) for k in s_ref])
            # The reference adds a row's ids one by one, whose fp32 error grows with the run (n * 2^-24
            # relative at worst); the kernels add chunks and then partials, a shorter chain.
            tol = max(2e-5, max(lengths) * 2.0 ** -24)
            report.add(Row(f"tbe bwd long runs {'/'.join(map(str, lengths))} {opt}", e, tol, e <= tol))


def check_stochastic_rounding(report: Report, dev) -> None:
    """Half-weight updates are unbiased: many sgd steps far below half the spacing at 1.0 move
    64k values by the fp32 amount on average (round-to-nearest would never move them)."""
    from recc.kernels.cuda import tbe as gpu
    R, D, steps, lr = 64, 1024, 400, 1e-4
    ids = torch.arange(R, device=dev)
    offsets = torch.arange(R + 1, device=dev)
    hsc = torch.tensor([0, R], dtype=torch.int64, device=dev)
    grad = torch.ones(R, D, device=dev)
    for dtype in (torch.float16, torch.bfloat16):
        w = torch.full((R, D), 1.0, dtype=dtype, device=dev)
        for s in range(steps):
            gpu.tbe_backward_update(w, {}, ids, offsets, hsc, grad, T=1, B=R, optimizer="sgd", lr=lr, step=s + 1)
        want = 1.0 - steps * lr
        got = float(w.float().mean())
        e = abs(got - want) / abs(1.0 - want)
        report.add(Row(f"{str(dtype)[6:]} stochastic rounding (mean drift)", e, 0.02, e <= 0.02,
                       note=f"moved {1 - got:.5f}, want {1 - want:.5f}"))


def check_bounds(report: Report, dev) -> None:
    from recc.kernels.cuda import tbe as gpu
    w = torch.randn(30, 8, device=dev)
    hsc = torch.tensor([0, 10, 30], dtype=torch.int64, device=dev)
    ids = torch.tensor([1, 2, 15, 3], dtype=torch.int64, device=dev)  # 15 >= table 0's 10 rows
    offsets = torch.tensor([0, 2, 3, 3, 4], dtype=torch.int64, device=dev)
    ok, note = False, ""
    try:
        gpu.tbe_forward(w, ids, offsets, hsc, T=2, B=2, table_names=["user", "item"])
        note = "no error raised"
    except IndexError as exc:
        ok = "'user'" in str(exc) and "15" in str(exc)
        note = "" if ok else f"message lacks the table/id: {exc}"
    before = w.clone()
    try:
        gpu.tbe_backward_update(w, {}, ids, offsets, hsc, torch.ones(2, 16, device=dev), T=2, B=2, lr=1.0,
                                table_names=["user", "item"])
        ok, note = False, "backward raised no error"
    except IndexError:
        if not torch.equal(before, w):
            ok, note = False, "backward wrote rows of a bad batch"
    report.add(Row("bounds: bad id -> IndexError, nothing written", ok=ok, note=note))


def check_codecs(report: Report, dev, quick: bool) -> None:
    from recc.kernels import codecs as ref
    from recc.kernels.cuda import codecs as gpu
    g = torch.Generator().manual_seed(2)
    for precision in PRECISIONS:
        worst_bytes, worst_err = 0, 0.0
        for n in ((1, 63, 64, 1000, 100_003) if quick else (1, 63, 64, 65, 1000, 100_003, 4_000_037)):
            x = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-3, 4, (n,), generator=g).float())
            if n > 100:
                x[5] = float("nan")
                x[70] = float("inf")
            want = ref.encode(x, precision)
            poison(dev)
            got = gpu.encode(x.to(dev), precision).cpu()
            if got.shape != want.shape:
                worst_bytes = max(worst_bytes, n)
                continue
            differ = got != want
            if precision in ("fp16", "bf16"):
                # A NaN's payload is not part of the contract (torch's own CPU bf16 cast writes
                # 0xFFFF from its vectorised loop and 0x7FC0 from its scalar tail); it must
                # only stay a NaN.
                dtype = torch.float16 if precision == "fp16" else torch.bfloat16
                nan = torch.isnan(x).repeat_interleave(2)
                differ = differ & ~nan
                if not bool(torch.isnan(got.view(dtype)[torch.isnan(x)]).all()):
                    differ = differ | nan
            worst_bytes = max(worst_bytes, int(differ.sum()))
            dec = gpu.decode(want.to(dev), n, precision).cpu()
            dref = ref.decode(want, n, precision)
            same_nan = torch.equal(torch.isnan(dec), torch.isnan(dref))
            fin = ~torch.isnan(dref)
            if not same_nan or not torch.equal(dec[fin], dref[fin]):
                worst_err = max(worst_err, rel_err(torch.nan_to_num(dec), torch.nan_to_num(dref)) or 1.0)
        ok = worst_bytes == 0 and worst_err == 0.0
        report.add(Row(f"codec {precision} encode+decode (bytes exact)", worst_err, 0.0, ok,
                       note=f"{worst_bytes} bytes differ" if worst_bytes else ""))


def check_bucketize(report: Report, dev) -> None:
    from recc.kernels.cuda import bucketize
    g = torch.Generator().manual_seed(3)
    ok = True
    for B, K in ((1, 2), (100, 3), (5000, 8), (300, 70)):
        rows = 10_000
        lengths = torch.randint(0, 9, (B,), generator=g)
        offsets = torch.zeros(B + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        ids = torch.randint(0, rows, (int(offsets[-1]),), generator=g)
        bounds = torch.linspace(0, rows, K + 1).round().to(torch.int64)
        want = bucketize.bucketize_rows_reference(ids, offsets, bounds)
        poison(dev)
        got = bucketize.bucketize_rows(ids.to(dev), offsets.to(dev), bounds.to(dev))
        ok = ok and all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    report.add(Row("row bucketization (exact)", 0.0 if ok else 1.0, 0.0, ok))


def check_interaction(report: Report, dev, quick: bool) -> None:
    """recc.dot_interaction's kernels (one launch forward, one backward) against the op's torch
    reference on the CPU under autograd: DLRM's triangle of pairs, vectors spread over blocks with
    a column no vector reads on each side (its gradient must be written as zero), fp32 and bf16."""
    from recc.kernels.cuda import interaction as gpu
    from recc.ops import get_op
    ref = get_op("dot_interaction").reference
    g = torch.Generator().manual_seed(4)
    B, pad, f32, bf16 = (64 if quick else 4096), 3, torch.float32, torch.bfloat16
    for F, D, nblocks, dense_dtype, block_dtype in ((27, 16, 1, f32, f32), (9, 64, 2, f32, f32),
                                                    (27, 16, 1, bf16, f32), (7, 128, 3, f32, bf16)):
        per, features, blocks = -(-(F - 1) // nblocks), [], []
        for k in range(nblocks):
            n = max(0, min(per, F - 1 - k * per))
            blocks.append(torch.randn(B, n * D + 2, generator=g).to(block_dtype))
            features += [(k, 1 + i * D) for i in range(n)]
        dense = torch.randn(B, D, generator=g).to(dense_dtype)
        li, lj = torch.tril_indices(F, F, -1)
        grad = torch.randn(B, D + li.numel() + pad, generator=g).to(dense_dtype)
        leaves = [t.clone().requires_grad_() for t in (dense, *blocks)]
        want = ref(leaves[0], leaves[1:], li, lj, tuple(features), pad)
        want.backward(grad)
        poison(dev)
        args = (dense.to(dev), [b.to(dev) for b in blocks], tuple(features), li.to(dev), lj.to(dev), pad)
        out = gpu.dot_interaction_forward(*args)
        gd, gb = gpu.dot_interaction_backward(*args, grad.to(dev))
        e = max(rel_err(a, b) for a, b in zip((out, gd, *gb), (want, *(t.grad for t in leaves))))
        # bf16 outputs and gradients: the kernel's fp32 sums and torch's round to one bf16 step apart at most
        tol = 2.0 ** -7 if bf16 in (dense_dtype, block_dtype) else 1e-5
        report.add(Row(f"interaction fwd+bwd F={F} D={D} {str(dense_dtype)[6:]}/{str(block_dtype)[6:]}", e, tol,
                       e <= tol))


# ----------------------------------------------------------------------------- performance


def bench_tbe(report: Report, dev, bw: float, batch: int, preset: str = "small") -> None:
    from recc.kernels import optimizer_state_shapes
    from recc.kernels.cuda import tbe as gpu
    from recc.models import SyntheticData
    from recc.models.presets import resolve_preset
    cfg = resolve_preset(preset)
    rows, D = list(cfg["num_embeddings"]), cfg["embedding_dim"]
    T = len(rows)
    dense_x, lS_o, lS_i, _ = SyntheticData(preset, batch_size=batch).batch(0)
    ids = torch.cat(lS_i).to(dev)
    counts = torch.tensor([i.numel() for i in lS_i])
    starts = counts.cumsum(0) - counts
    offsets = torch.cat([(torch.stack(lS_o) + starts[:, None]).reshape(-1), counts.sum().reshape(1)]).to(dev)
    hsc = hash_size_cumsum(rows).to(dev)
    N = ids.numel()
    lin = (ids.cpu() + torch.repeat_interleave(hash_size_cumsum(rows)[:-1], counts))
    unique = int(torch.unique(lin).numel())
    for wdtype in (torch.float32, torch.float16, torch.bfloat16):
        wb = 4 if wdtype == torch.float32 else 2
        w = (torch.randn(int(hsc[-1]), D, device=dev) * 0.01).to(wdtype)
        tag = f"{preset} B={batch} {str(wdtype)[6:]}"
        t_fwd = time_cuda(lambda: gpu.tbe_forward(w, ids, offsets, hsc, T=T, B=batch))
        fb = tbe_forward_bytes(N, T * batch, D, wb, False)
        report.add(Row(f"tbe fwd {tag}", ms=t_fwd * 1e3, gbps=fb / t_fwd / 1e9, pct_bw=100 * fb / t_fwd / bw))
        grad = torch.randn(batch, T * D, device=dev)
        for opt in ("sgd", "rowwise_adagrad"):
            state = {k: torch.zeros(s, device=dev) for k, s in optimizer_state_shapes(opt, int(hsc[-1]), D).items()}
            step = [0]

            def bwd():
                step[0] += 1
                gpu.tbe_backward_update(w, state, ids, offsets, hsc, grad, T=T, B=batch, optimizer=opt, lr=1e-3,
                                        step=step[0], checked=True)
            t_bwd = time_cuda(bwd)
            bb = tbe_backward_bytes(N, unique, D, wb, opt)
            report.add(Row(f"tbe bwd+update {opt} {tag}", ms=t_bwd * 1e3, gbps=bb / t_bwd / 1e9,
                           pct_bw=100 * bb / t_bwd / bw))
            t = t_fwd + t_bwd
            pct = 100 * (fb + bb) / t / bw
            target = wdtype == torch.float32 and opt == "sgd"
            report.add(Row(f"tbe fwd+bwd+update {opt} {tag}", ms=t * 1e3, gbps=(fb + bb) / t / 1e9, pct_bw=pct,
                           note=("target >= 50%: " + ("met" if pct >= 50 else "NOT met")) if target else ""))
        del w


def bench_step(report: Report, dev, preset: str, batch: int, row_cap: int | None, steps: int) -> None:
    """recc against eager PyTorch CUDA (``gpu_precision``'s systems, fp32, SGD everywhere)."""
    from recc.models import build_model
    from recc.models.presets import resolve_preset
    cfg = dict(resolve_preset(preset))
    label = f"{preset} B={batch}"
    if row_cap is not None:
        cfg["num_embeddings"] = [min(n, row_cap) for n in cfg["num_embeddings"]]
        label += f" rows<={row_cap // 1000}k"
    torch.manual_seed(0)
    model = build_model(cfg)
    batches = mp.device_batches(cfg, dev, 3, batch)
    eager = mp.Eager(model, dev, 0.01, "fp32")
    mine = mp.Recc(model, dev, None, 0.01)
    # Same start, same batch: the two systems' first outputs agree.
    with torch.no_grad():
        e = rel_err(mine.forward(*batches[0][:3]), eager.forward(*batches[0][:3]))
    report.add(Row(f"step {label}: recc fwd == eager fwd", e, 1e-4, e <= 1e-4))
    t_recc = time_cuda(mp.cycling(mine, batches), iters=steps, warmup=3)
    t_eager = time_cuda(mp.cycling(eager, batches), iters=steps, warmup=3)
    speedup = t_eager / t_recc
    report.add(Row(f"step {label}: eager PyTorch CUDA", ms=t_eager * 1e3))
    target = " (target >= 2x: " + ("met)" if speedup >= 2 else "NOT met)") if preset == "small" else ""
    report.add(Row(f"step {label}: recc", ms=t_recc * 1e3, note=f"{speedup:.2f}x eager{target}"))
    del mine, eager, batches
    torch.cuda.empty_cache()


def torchrec_on_this_gpu(report: Report) -> None:
    """TorchRec + FBGEMM GPU as a third system of the step comparison: reported as missing where
    the machine has no CUDA build of them (the device image has neither, and fbgemm-gpu's CUDA
    wheels are several hundred MB, past the 64 MiB a device call can carry)."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec
    except ImportError as e:
        report.add(Row("step small: TorchRec+FBGEMM GPU", note=f"not installed on this machine ({e}); not compared"))
        return
    report.add(Row("step small: TorchRec+FBGEMM GPU", note=f"torchrec {torchrec.__version__} is installed, but this "
                                                            f"script times it only on the CPU (bench.train_throughput)"))


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run, about a minute)")
    p.add_argument("--batch", type=int, default=16384, help="batch for the bandwidth and step timings")
    p.add_argument("--steps", type=int, default=20, help="timed training steps per system")
    p.add_argument("--skip-step", action="store_true", help="skip the full-model step timings")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--sections", default="", help="comma-separated section names to run (default: all)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    why = require_gpu()
    if why is not None:
        print(f"gpu_check: cannot run: {why}", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    report = Report()
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(dev)
    bw = copy_bandwidth(dev)
    report.add(Row("device copy bandwidth", gbps=bw / 1e9, pct_bw=100.0, note=name))
    sections = [
        ("tbe correctness", lambda: check_tbe(report, dev, args.quick)),
        ("long runs", lambda: check_long_runs(report, dev)),
        ("fp16 stochastic rounding", lambda: check_stochastic_rounding(report, dev)),
        ("bounds checks", lambda: check_bounds(report, dev)),
        ("codecs", lambda: check_codecs(report, dev, args.quick)),
        ("bucketization", lambda: check_bucketize(report, dev)),
        ("interaction", lambda: check_interaction(report, dev, args.quick)),
        ("tbe bandwidth", lambda: bench_tbe(report, dev, bw, args.batch)),
    ]
    sections += [
        ("bf16 dense", lambda: mp.check_dense_bf16(report, dev)),
        ("fp16 dense", lambda: mp.check_dense_fp16(report, dev)),
        ("half tables", lambda: mp.check_half_tables(report, dev)),
        ("optimizer semantics", lambda: mp.check_optimizer_semantics(report, dev)),
    ]
    sections.append(("host syncs", lambda: gpu_graph.check_step_syncs(report, dev)))
    if not args.skip_step:
        sections.append(("step small", lambda: bench_step(report, dev, "small", args.batch, None, args.steps)))
        sections.append(("torchrec", lambda: torchrec_on_this_gpu(report)))
        sections.append(("cuda graph", lambda: gpu_graph.bench_cuda_graph(report, dev, "small", args.batch,
                                                                            args.steps)))
        sections.append(("precision steps", lambda: mp.bench_precision_steps(report, dev, bw, args.batch, args.steps)))
        sections.append(("profile", lambda: mp.profile_recc_step(dev, args.batch)))
        if not args.quick:
            sections.append(("step dlrmv2", lambda: bench_step(report, dev, "dlrmv2", args.batch, 1_000_000,
                                                               max(5, args.steps // 2))))
    if args.sections:
        wanted = {w.strip() for w in args.sections.split(",")}
        unknown = wanted - {title for title, _ in sections}
        if unknown:
            print(f"gpu_check: unknown section(s) {sorted(unknown)}; choose from "
                  f"{[title for title, _ in sections]}", file=sys.stderr)
            return 2
        sections = [(title, run) for title, run in sections if title in wanted]
    for title, run in sections:
        print(f"== {title}", flush=True)
        try:
            run()
        except Exception as exc:  # one broken section must not hide the others' results
            import traceback
            traceback.print_exc()
            report.add(Row(f"{title}: crashed", ok=False, note=f"{type(exc).__name__}: {exc}"[:160]))
    print(f"\nrecc gpu_check on {name} ({time.perf_counter() - t0:.0f} s)")
    print(format_table(report.rows))
    if report.failed:
        print(f"\n{len(report.failed)} correctness check(s) FAILED: "
              + ", ".join(r.check for r in report.failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
