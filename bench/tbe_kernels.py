"""Micro-benchmark of the CPU TBE kernels on the `small` shapes.

    python -m bench.tbe_kernels [--tables 8 --rows 100000 --dim 64 --batch 2048
                                           --pooling-factor 20 --zipf 1.05 --steps 50
                                           --table-dtype fp32,fp16,bf16]

Runs training steps the way a model does (forward of a batch, then backward+update of the
same batch, cycling over a few different batches so caches see realistic reuse) and prints
each kernel's time, the memory bandwidth measured with a large tensor copy, and the
memory-traffic floor: the bytes a step must move (forward reads N rows; backward reads
grad_output and reads + writes each unique row and its optimizer state once) divided by that
bandwidth.  Times are the minimum over steps by default (the least disturbed by other
processes on a shared machine); --stat median reports medians.  ``--table-dtype`` times the
same kernels with the weights stored in each listed dtype side by side (the fp16/bf16 updates
computed in fp32 and stochastically rounded; optimizer state fp32), each against its own floor
and as a ratio to fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from recc.kernels.cpu import native
from recc.kernels.tbe_inputs import OPTIMIZERS, optimizer_state_shapes
from recc.kernels.cpu.tbe import (
    linearize_indices,
    tbe_backward_update_native,
    tbe_backward_update_reference,
    tbe_forward_native,
    tbe_forward_reference,
    validate_inputs,
)


_TABLE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _summary(times: list[float], stat: str) -> float:
    return statistics.median(times) if stat == "median" else min(times)


def measure_bandwidth(megabytes: int = 512, repeat: int = 30) -> float:
    """Best copy bandwidth in bytes/s, counting bytes read + bytes written."""
    n = megabytes * (1 << 20) // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def make_batch(T: int, rows: int, B: int, pooling_factor: int, zipf: float, seed: int = 0):
    """Feature-major local ids, Zipf-skewed (the same hot ids in every batch, scattered over
    the table), bag lengths uniform in [1, 2*pooling_factor-1] (mean pooling_factor)."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.Generator().manual_seed(1234)  # rank -> row map shared by all batches
    probs = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** zipf
    lengths = torch.randint(1, 2 * pooling_factor, (T * B,), generator=g)
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    counts = lengths.view(T, B).sum(1)
    parts = []
    for t in range(T):
        ranks = torch.multinomial(probs, int(counts[t]), replacement=True, generator=g)
        perm = torch.randperm(rows, generator=hot)
        parts.append(perm[ranks])
    return torch.cat(parts), offsets


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--pooling-factor", type=int, default=20)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--batches", type=int, default=4, help="distinct batches cycled over")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per configuration")
    ap.add_argument("--stat", choices=("min", "median"), default="min")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--table-dtype", default="fp32",
                    help="comma-separated table dtypes timed side by side: fp32,fp16,bf16 "
                         "(half tables: fp32 optimizer state, stochastic rounding)")
    args = ap.parse_args(argv)
    dtype_names = args.table_dtype.split(",")
    unknown = [d for d in dtype_names if d not in _TABLE_DTYPES]
    if unknown:
        ap.error(f"--table-dtype: unknown dtype {unknown[0]!r} (choose from {', '.join(_TABLE_DTYPES)})")
    T, rows, D, B = args.tables, args.rows, args.dim, args.batch
    R = T * rows

    t0 = time.perf_counter()
    lib = native.library()
    load_s = time.perf_counter() - t0
    print(f"threads={torch.get_num_threads()}  backend={'native' if lib else 'reference'}  "
          f"C kernel load {load_s * 1e3:.0f} ms ({native.build_info or 'n/a'})")

    hsc = torch.arange(T + 1, dtype=torch.int64) * rows
    names = [f"t{t}" for t in range(T)]
    batches = []
    for k in range(args.batches):
        indices, offsets = make_batch(T, rows, B, args.pooling_factor, args.zipf, seed=k)
        lin = linearize_indices(indices, offsets, hsc, T, B)
        batches.append((indices, offsets, lin, int(torch.unique(lin).numel())))
    N = statistics.mean(b[0].numel() for b in batches)
    U = statistics.mean(b[3] for b in batches)
    grad_output = torch.randn(B, T * D) * 1e-3
    print(f"T={T} rows/table={rows} D={D} B={B}  N~{N:.0f} ids/batch  unique rows U~{U:.0f} "
          f"({U / N:.1%} of ids)  zipf={args.zipf}  {args.batches} batches cycled")

    bw = measure_bandwidth()
    print(f"memory bandwidth (512 MB copy, read+write, best of 30): {bw / 1e9:.1f} GB/s")

    stat = args.stat
    res: dict[str, float] = {}

    def steps(fwd, bwd, n_steps, name_f, name_b):
        tf, tb = [], []
        for s in range(n_steps + 2):  # 2 warm-up steps
            indices, offsets, lin, _ = batches[s % len(batches)]
            t0 = time.perf_counter()
            fwd(lin, offsets)
            t1 = time.perf_counter()
            if bwd is not None:
                bwd(lin, offsets)
            t2 = time.perf_counter()
            if s >= 2:
                tf.append(t1 - t0)
                tb.append(t2 - t1)
        res[name_f] = _summary(tf, stat) if name_f not in res else min(res[name_f],
                                                                        _summary(tf, stat))
        if bwd is not None:
            res[name_b] = _summary(tb, stat)

    ind0, off0, _, _ = batches[0]
    tv = []
    for _ in range(10):
        t0 = time.perf_counter()
        validate_inputs(ind0, off0, hsc, T, B, names)
        tv.append(time.perf_counter() - t0)
    res["validate_inputs"] = _summary(tv, stat)
    tl = []
    for _ in range(10):
        t0 = time.perf_counter()
        linearize_indices(ind0, off0, hsc, T, B)
        tl.append(time.perf_counter() - t0)
    res["linearize_indices"] = _summary(tl, stat)

    floors = {}
    w32 = torch.rand(R, D) * 0.01
    for name in dtype_names:
        tag = "" if name == "fp32" else f" {name} tables"
        weights = w32.to(_TABLE_DTYPES[name])
        row_bytes = D * weights.element_size()
        for opt in OPTIMIZERS:
            shapes = optimizer_state_shapes(opt, R, D)
            state = {k: torch.zeros(s) for k, s in shapes.items()}
            kw = dict(T=T, B=B, optimizer=opt, lr=0.01)
            if lib:
                steps(lambda lin, off: tbe_forward_native(weights, lin, off, T=T, B=B),
                      lambda lin, off: tbe_backward_update_native(weights, state, lin, off,
                                                                  grad_output, **kw),
                      args.steps, f"forward native{tag}", f"backward+update {opt} native{tag}")
            if not args.skip_reference and not tag and opt in ("sgd", "rowwise_adagrad"):
                steps(lambda lin, off: tbe_forward_reference(weights, lin, off, T=T, B=B),
                      lambda lin, off: tbe_backward_update_reference(weights, state, lin, off,
                                                                     grad_output, **kw),
                      max(3, args.steps // 10), "forward reference",
                      f"backward+update {opt} reference")
            state_row_bytes = sum(4 * (s[1] if len(s) == 2 else 1) for s in shapes.values())
            fwd_bytes = N * row_bytes
            bwd_bytes = B * T * D * 4 + 2 * U * (row_bytes + state_row_bytes)
            floors[(opt, tag)] = fwd_bytes + bwd_bytes
    weights = w32
    if args.skip_reference:  # forward reference alone, for comparison
        steps(lambda lin, off: tbe_forward_reference(weights, lin, off, T=T, B=B), None,
              args.steps, "forward reference", None)

    print(f"\n{'kernel (' + stat + ' over steps)':48s} {'ms':>8s}")
    for k, v in res.items():
        print(f"{k:48s} {v * 1e3:8.2f}")

    if lib:
        print(f"\n{'optimizer':30s} {'floor MB':>9s} {'floor ms':>9s} {'fwd+bwd ms':>11s} "
              f"{'x floor':>8s} {'vs fp32':>8s}")
        for (opt, tag), nbytes in floors.items():
            floor_s = nbytes / bw
            got = res[f"forward native{tag}"] + res[f"backward+update {opt} native{tag}"]
            base = res["forward native"] + res[f"backward+update {opt} native"] \
                if "forward native" in res else float("nan")
            print(f"{opt + tag:30s} {nbytes / 1e6:9.1f} {floor_s * 1e3:9.2f} {got * 1e3:11.2f} "
                  f"{got / floor_s:8.2f} {base / got:7.2f}x")
        print("floor = (N rows read by forward + grad_output read + each unique row and its "
              "optimizer state read and written once) / copy bandwidth")


if __name__ == "__main__":
    main()
