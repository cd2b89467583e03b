"""Launches and kernel work per training step of the CUDA backend, counted on the CPU emulator.

    python -m bench.cuda_step_counts [--preset small] [--batch 256] [--steps 3]
                                     [--optimizer rowwise_adagrad] [--table-dtype fp32]

A ``small``-like DLRM (its tables cut to 2,000 rows each, so a small batch has hot rows) is
compiled for one CPU rank, and its ``recc.tbe_lookup[cpu]`` and ``recc.pack_sparse[cpu]`` are
pointed at the CUDA implementations (``runtime/cuda_backend.py``) while it trains: every recc
kernel of the step runs on the emulator's counting build (``recc.kernels.cuda.emulator.counting``).
Per step it prints

- recc kernel launches (the ``.cu`` kernels), the aten ops the step ran and how many of them
  would launch a kernel on a GPU (the rest are views, allocations, empty ops), and the aten
  device-to-host reads (``item``/``bool``; reads that bypass aten, as ``tolist``, are not seen);
- per TBE kernel: launches, global bytes read and written, and the most global loads one thread
  made over the launch (an upper bound on its longest chain of dependent loads; a grid-stride
  kernel's threads take more turns on fewer SMs, hence ``--sm-count``, default an H100's 132).

No timing: the counts are the same on any machine.  The dense optimizer's step is part of the
counted step (on a GPU its foreach kernels are launches too).
"""
from __future__ import annotations

import argparse
import collections
import contextlib

import torch
import torch.nn.functional as F

import recc
from recc.kernels.cuda import emulator
from recc.models import SyntheticData, build_model
from recc.models.presets import resolve_preset
from recc.ops import _bound
from recc.runtime import cuda_backend


@contextlib.contextmanager
def cuda_ops(seed: int = 11, sm_count: int = 2):
    """The CPU rank's lookup and packing run the CUDA implementations, on the emulator."""
    lookup, pack = _bound("tbe_lookup", "cpu"), _bound("pack_sparse", "cpu")
    saved = lookup._fn, pack._fn
    lookup._fn, pack._fn = cuda_backend.tbe_lookup_cuda, cuda_backend.pack_sparse_cuda
    try:
        with emulator.emulated(seed=seed, sm_count=sm_count):
            yield
    finally:
        lookup._fn, pack._fn = saved


def count_steps(preset: str, batch: int, steps: int, optimizer: str, table_dtype: str, rows: int,
                sm_count: int):
    """One ``emulator.Counts`` per training step."""
    cfg = dict(resolve_preset(preset))
    cfg["num_embeddings"] = [rows] * len(cfg["num_embeddings"])
    torch.manual_seed(0)
    model = build_model(cfg)
    config = recc.CompileConfig(optimizer=optimizer, lr=0.05, table_dtype=table_dtype)
    dmodel = recc.compile(model, recc.Cluster.local(1), config=config).instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.05)
    per_step = []
    for dense_x, lS_o, lS_i, y in SyntheticData(cfg, batch_size=batch).batches(steps):
        with cuda_ops(sm_count=sm_count), emulator.counting() as counts:
            loss = F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        per_step.append(counts)
    return cfg, per_step


def tbe_rows(counts) -> list[tuple]:
    """(kernel, launches, bytes read, bytes written, max loads per thread) per TBE kernel."""
    by = collections.defaultdict(list)
    for r in counts.launches:
        if r.source == "tbe.cu":
            by[r.kernel].append(r)
    return [(k, len(rs), sum(r.bytes_read for r in rs), sum(r.bytes_written for r in rs),
             max(r.max_loads_per_thread for r in rs)) for k, rs in by.items()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--table-dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--rows", type=int, default=2000, help="rows per table (hot rows at a small batch)")
    ap.add_argument("--sm-count", type=int, default=132,
                    help="the emulated device's SMs (grid-stride kernels size their grids by it; 132: an H100)")
    args = ap.parse_args(argv)
    if emulator.compiler() is None:
        raise SystemExit("the CUDA emulator needs g++ with AddressSanitizer")
    cfg, per_step = count_steps(args.preset, args.batch, args.steps, args.optimizer, args.table_dtype, args.rows,
                                args.sm_count)
    print(f"{args.preset}-like DLRM ({len(cfg['num_embeddings'])} tables x {args.rows} rows, D "
          f"{cfg.get('embedding_dim', '?')}), batch {args.batch}, {args.optimizer}, {args.table_dtype} tables; "
          f"CUDA backend on the emulator (counting build, {args.sm_count} SMs)")
    print(f"{'step':>4} {'recc launches':>13} {'aten ops':>9} {'aten launches':>13} {'aten host reads':>15}")
    for i, c in enumerate(per_step):
        s = c.summary()
        print(f"{i:>4} {s['recc_launches']:>13} {s['aten_ops']:>9} {s['aten_launches']:>13} {s['host_reads']:>15}")
    last = per_step[-1]
    print(f"\nTBE kernels, step {len(per_step) - 1}:")
    print(f"{'kernel':<28} {'launches':>8} {'bytes read':>12} {'bytes written':>13} {'max loads/thread':>16}")
    for k, n, rd, wr, ml in tbe_rows(last):
        print(f"{k:<28} {n:>8} {rd:>12,} {wr:>13,} {ml:>16}")
    top = last.aten.most_common(12)
    print("\nmost frequent aten ops, step {}: {}".format(len(per_step) - 1, ", ".join(f"{k} {v}" for k, v in top)))


if __name__ == "__main__":
    main()
