"""The streaming click-log loader alone (samples/s on one core) next to a recc training step on
``kaggle``, so one can see whether the input pipeline would hold training back.

Kaggle-shaped data (label, 13 integer counts with empty fields, 26 hex ids, Zipf-skewed) is
generated as a Criteo TSV in a temporary directory, converted once with
``recc.models.convert`` (its rate is printed too), and read back with ``ClickLogData``:

- ``loader, calling thread``: ``rank_batch`` in the timing thread -- the whole cost of a batch
  (index arithmetic, memory-map reads, checks, int32 -> int64, tensors) on one core;
- ``loader, background thread``: iterating ``batches()``, as training does (the worker thread
  reads ahead into a bounded queue; the consumer only takes batches);
- each in order (``shuffle 0``) and shuffled within windows (``--shuffle-buffer``), and as one
  rank of ``--world-size`` reading only its slice;
- ``recc train step``: ``recc.compile(kaggle DLRM, Cluster.local(1), CompileConfig(optimizer=sgd))``,
  ``program.instantiate()``, forward + BCE + backward + dense SGD on the loaded batches (the
  ids hashed into kaggle's tables), median over ``--steps`` steps after warm-up.

Torch runs with ``--threads`` threads (default 1: loader and step on one core each). The ratio
is loader samples/s over training samples/s: above 1 the loader keeps up with a core's training.

    python bench/data_loader.py
    python bench/data_loader.py --samples 262144 --batch-size 4096 --steps 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from recc.models import ClickLogData, build_model, convert, load_preset


def write_kaggle_tsv(path: Path, n: int, seed: int) -> None:
    """``n`` kaggle-shaped lines: ~30% clicks, log-normal counts (some empty, some -1), Zipf ids."""
    rng = np.random.default_rng(seed)
    labels = (rng.random(n) < 0.3).astype(int)
    counts = np.floor(np.exp(rng.normal(1.5, 1.5, (n, 13)))).astype(np.int64)
    counts[rng.random((n, 13)) < 0.05] = -1
    empty_dense = rng.random((n, 13)) < 0.2
    # Zipf ranks scattered over 32-bit hashes per feature, as hashed ids are
    ranks = np.minimum(rng.zipf(1.2, (n, 26)), 1 << 24).astype(np.uint64)
    salt = rng.integers(1, 1 << 31, 26, dtype=np.uint64) | np.uint64(1)
    hashes = (ranks * salt) & np.uint64(0xFFFFFFFF)
    empty_cat = rng.random((n, 26)) < 0.05
    with open(path, "w") as f:
        for i in range(n):
            dense = ["" if e else str(c) for c, e in zip(counts[i].tolist(), empty_dense[i].tolist())]
            cats = ["" if e else f"{h:08x}" for h, e in zip(hashes[i].tolist(), empty_cat[i].tolist())]
            f.write("\t".join([str(labels[i]), *dense, *cats]) + "\n")


def time_loader(data: ClickLogData, steps: int, rank: int, world_size: int, threaded: bool) -> float:
    """Samples/s of this rank over ``steps`` batches (each timed once; the page cache is warm)."""
    t0 = time.perf_counter()
    samples = 0
    if threaded:
        with data.batches(steps, rank=rank, world_size=world_size) as stream:
            for batch in stream:
                samples += len(batch[3])
    else:
        for step in range(steps):
            samples += len(data.rank_batch(step, rank, world_size)[3])
    return samples / (time.perf_counter() - t0)


def time_recc_step(batches, steps: int) -> float:
    """Samples/s of a recc training step on ``kaggle`` (median step time over ``steps``)."""
    import recc

    model = build_model("kaggle")
    dense_x, lS_o, lS_i, _ = batches[0]
    program = recc.compile(copy.deepcopy(model), recc.Cluster.local(1),
                           config=recc.CompileConfig(optimizer="sgd", lr=0.01), example_inputs=(dense_x, lS_o, lS_i))
    del model
    dmodel = program.instantiate()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.01)

    def step(i):
        dense_x, lS_o, lS_i, y = batches[i % len(batches)]
        loss = F.binary_cross_entropy(dmodel(dense_x, lS_o, lS_i), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for i in range(3):  # warm-up: kernels compiled, caches and allocator settled
        step(i)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return len(batches[0][3]) / statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=262_144, help="samples of generated kaggle-shaped data")
    p.add_argument("--batch-size", type=int, default=4096, help="global batch (kaggle's preset: 4096)")
    p.add_argument("--shuffle-buffer", type=int, default=65_536)
    p.add_argument("--world-size", type=int, default=8, help="also time one rank's slice of this world")
    p.add_argument("--steps", type=int, default=8, help="timed recc training steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = load_preset("kaggle")["num_embeddings"]
    with tempfile.TemporaryDirectory(prefix="recc-data-loader-") as tmp:
        tsv = Path(tmp) / "train.txt"
        t0 = time.perf_counter()
        write_kaggle_tsv(tsv, args.samples, args.seed)
        t1 = time.perf_counter()
        convert([tsv], Path(tmp) / "converted", num_embeddings=rows)
        convert_rate = args.samples / (time.perf_counter() - t1)
        mib = tsv.stat().st_size / 2 ** 20
        print(f"# generated {args.samples:,} kaggle-shaped samples ({mib:.0f} MiB TSV) in {t1 - t0:.1f} s; "
              f"converted at {convert_rate:,.0f} samples/s ({mib * convert_rate / args.samples:.0f} MiB/s), one core")
        rows_out = []
        for shuffle in (0, args.shuffle_buffer):
            data = ClickLogData(Path(tmp) / "converted", batch_size=args.batch_size, shuffle_buffer=shuffle,
                                seed=args.seed)
            steps = data.steps_per_epoch
            time_loader(data, steps, 0, 1, threaded=False)  # pages in the files once
            for world in (1, args.world_size):
                for threaded in (False, True):
                    rate = time_loader(data, steps, 0, world, threaded)
                    rows_out.append((f"loader, {'background' if threaded else 'calling'} thread", shuffle, world,
                                     args.batch_size // world, rate))
        data = ClickLogData(Path(tmp) / "converted", batch_size=args.batch_size)
        batches = [data.batch(i) for i in range(min(args.steps, data.steps_per_epoch))]
        train = time_recc_step(batches, args.steps)
    print(f"# torch threads {args.threads}; global batch {args.batch_size}; ratio = loader samples/s "
          f"/ one core's recc kaggle training samples/s at the global batch")
    print("| what | shuffle buffer | world | rank batch | samples/s (one core) | ratio to training |")
    print("|---|---|---|---|---|---|")
    print(f"| recc train step, kaggle, sgd | | 1 | {args.batch_size} | {train:,.0f} | 1.0 |")
    for name, shuffle, world, b, rate in rows_out:
        print(f"| {name} | {shuffle or 'off'} | {world} (rank 0) | {b} | {rate:,.0f} | {rate / train:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
