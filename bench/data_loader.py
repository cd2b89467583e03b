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

``--from-arrays`` writes the converted log straight from generated arrays (no TSV, no parsing),
so a log of a few hundred MB takes seconds; ``--loader-only`` leaves out the training step. The
last lines compare what trusting the data costs: checking every file's crc32 against the header
(``ClickLog.verify()``, what opening a ``ClickLogData`` does) next to reading one epoch, and
opening the log with and without the check. Each loader time is the best of ``--repeat`` runs
(the machine may be shared). ``--baseline REV`` also times the loader of ``models/click_log.py``
as of git revision ``REV`` on the same log, each run alternating with the current one's, so a
busy machine slows both alike. ``--cpu-time`` times with the process's CPU time instead of the
wall clock (the loader's own work, whatever else the machine runs; page cache warm, the loader
is CPU-bound).

    python -m bench.data_loader
    python -m bench.data_loader --samples 262144 --batch-size 4096 --steps 8
    python -m bench.data_loader --from-arrays --samples 2097152 --loader-only --repeat 3
    python -m bench.data_loader --from-arrays --samples 2097152 --loader-only --repeat 5 --baseline HEAD~1
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


def write_kaggle_arrays(out: Path, n: int, seed: int, rows: list[int]) -> None:
    """A converted log of ``n`` kaggle-shaped samples written from generated arrays (no TSV)."""
    from recc.models.click_log import write_click_log
    from recc.models.criteo import Chunk

    def chunks():
        rng = np.random.default_rng(seed)
        for lo in range(0, n, 1 << 16):
            m = min(1 << 16, n - lo)
            dense = np.log1p(np.floor(np.exp(rng.normal(1.5, 1.5, (m, 13))))).astype(np.float32)
            sparse = [(np.minimum(rng.zipf(1.2, (m, 1)), 1 << 24) * 2654435761 % r).astype(np.int64) for r in rows]
            yield Chunk(dense, sparse, (rng.random(m) < 0.3).astype(np.uint8))

    write_click_log(out, [("generated", chunks())], rows)


clock = time.perf_counter  # --cpu-time: time.process_time


def best(repeat: int, fn) -> float:
    """The smallest of ``repeat`` timings of ``fn()`` (seconds): the least disturbed run."""
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def load_baseline(rev: str):
    """``ClickLogData`` of ``models/click_log.py`` as of git revision ``rev`` (a module of its own)."""
    import importlib.util
    import subprocess
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{rev}:models/click_log.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("recc_click_log_baseline", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"{rev}:models/click_log.py", "exec"), module.__dict__)
    return module.ClickLogData


def time_loader(data: ClickLogData, steps: int, rank: int, world_size: int, threaded: bool) -> float:
    """Samples/s of this rank over ``steps`` batches (each timed once; the page cache is warm)."""
    t0 = clock()
    samples = 0
    if threaded:
        with data.batches(steps, rank=rank, world_size=world_size) as stream:
            for batch in stream:
                samples += len(batch[3])
    else:
        for step in range(steps):
            samples += len(data.rank_batch(step, rank, world_size)[3])
    return samples / (clock() - t0)


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


def time_trust(out: Path, args) -> tuple[float, float, float, float | None]:
    """(MiB, seconds to check every checksum, seconds to open a ClickLogData, the same unchecked)."""
    import inspect

    from recc.models import ClickLog, click_log
    mib = sum(f.stat().st_size for f in out.iterdir()) / 2 ** 20

    def forget():  # a checksum this process verified before is not recomputed: time a first check
        if hasattr(click_log, "_verified"):
            click_log._verified.clear()

    verify = best(args.repeat, lambda: (forget(), ClickLog(out).verify()))
    open_checked = best(args.repeat, lambda: (forget(), ClickLogData(out, batch_size=args.batch_size)))
    open_unchecked = None
    if "verify" in inspect.signature(ClickLogData).parameters:  # (a loader that checks at open)
        open_unchecked = best(args.repeat, lambda: ClickLogData(out, batch_size=args.batch_size, verify=False))
    return mib, verify, open_checked, open_unchecked


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=262_144, help="samples of generated kaggle-shaped data")
    p.add_argument("--batch-size", type=int, default=4096, help="global batch (kaggle's preset: 4096)")
    p.add_argument("--shuffle-buffer", type=int, default=65_536)
    p.add_argument("--world-size", type=int, default=8, help="also time one rank's slice of this world")
    p.add_argument("--steps", type=int, default=8, help="timed recc training steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--from-arrays", action="store_true", help="write the converted log from arrays (no TSV)")
    p.add_argument("--loader-only", action="store_true", help="leave out the recc training step")
    p.add_argument("--repeat", type=int, default=1, help="time each loader run this many times, keep the best")
    p.add_argument("--baseline", metavar="REV", help="also time models/click_log.py of this git revision")
    p.add_argument("--cpu-time", action="store_true", help="time loaders and checks with this process's CPU time")
    args = p.parse_args(argv)
    global clock
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    rows = load_preset("kaggle")["num_embeddings"]
    with tempfile.TemporaryDirectory(prefix="recc-data-loader-") as tmp:
        out = Path(tmp) / "converted"
        if args.from_arrays:
            t0 = time.perf_counter()
            write_kaggle_arrays(out, args.samples, args.seed, rows)
            print(f"# wrote {args.samples:,} kaggle-shaped samples from arrays in {time.perf_counter() - t0:.1f} s")
        else:
            tsv = Path(tmp) / "train.txt"
            t0 = time.perf_counter()
            write_kaggle_tsv(tsv, args.samples, args.seed)
            t1 = time.perf_counter()
            convert([tsv], out, num_embeddings=rows)
            convert_rate = args.samples / (time.perf_counter() - t1)
            mib = tsv.stat().st_size / 2 ** 20
            print(f"# generated {args.samples:,} kaggle-shaped samples ({mib:.0f} MiB TSV) in {t1 - t0:.1f} s; "
                  f"converted at {convert_rate:,.0f} samples/s ({mib * convert_rate / args.samples:.0f} MiB/s), "
                  "one core")
        rows_out, epochs = [], {}
        Baseline = load_baseline(args.baseline) if args.baseline else None
        for shuffle in (0, args.shuffle_buffer):
            data = ClickLogData(out, batch_size=args.batch_size, shuffle_buffer=shuffle, seed=args.seed)
            base = None if Baseline is None else Baseline(out, batch_size=args.batch_size, shuffle_buffer=shuffle,
                                                          seed=args.seed)
            steps = data.steps_per_epoch
            time_loader(data, steps, 0, 1, threaded=False)  # pages in the files once
            for world in (1, args.world_size):
                for threaded in (False, True):
                    rates, base_rates = [], []
                    for _ in range(args.repeat):
                        rates.append(time_loader(data, steps, 0, world, threaded))
                        if base is not None:
                            base_rates.append(time_loader(base, steps, 0, world, threaded))
                    rows_out.append((f"loader, {'background' if threaded else 'calling'} thread", shuffle, world,
                                     args.batch_size // world, max(rates), max(base_rates, default=None)))
                    if world == 1 and threaded:
                        epochs[shuffle] = steps * args.batch_size / max(rates)
        trust = time_trust(out, args)
        train = None
        if not args.loader_only:
            data = ClickLogData(out, batch_size=args.batch_size)
            batches = [data.batch(i) for i in range(min(args.steps, data.steps_per_epoch))]
            train = time_recc_step(batches, args.steps)
    print(f"# torch threads {args.threads}; global batch {args.batch_size}; "
          f"{'CPU time of this process' if args.cpu_time else 'wall clock'}; best of {args.repeat}"
          + ("" if train is None else "; ratio = loader samples/s / one core's recc kaggle training samples/s "
                                      "at the global batch"))
    extra = "" if Baseline is None else f" {args.baseline}: samples/s | this / {args.baseline} |"
    print("| what | shuffle buffer | world | rank batch | samples/s (one core) | ratio to training |" + extra)
    print("|---|---|---|---|---|---|" + ("" if Baseline is None else "---|---|"))
    if train is not None:
        print(f"| recc train step, kaggle, sgd | | 1 | {args.batch_size} | {train:,.0f} | 1.0 |"
              + ("" if Baseline is None else " | |"))
    for name, shuffle, world, b, rate, base_rate in rows_out:
        ratio = "" if train is None else f"{rate / train:.1f}x"
        print(f"| {name} | {shuffle or 'off'} | {world} (rank 0) | {b} | {rate:,.0f} | {ratio} |"
              + ("" if base_rate is None else f" {base_rate:,.0f} | {rate / base_rate:.2f} |"))
    mib, verify, open_checked, open_unchecked = trust
    print(f"# trust: crc32 of all {mib:.0f} MiB (ClickLog.verify, page cache warm): {verify:.3f} s "
          f"({mib / verify:,.0f} MiB/s); one epoch through the background thread, rank 0 of 1: "
          f"{epochs[0]:.3f} s in order, {epochs[args.shuffle_buffer]:.3f} s shuffled; the check is "
          f"{verify / epochs[0]:.2f}x an in-order epoch's reading")
    print(f"# trust: opening ClickLogData: {open_checked:.3f} s" + (
        "" if open_unchecked is None else f" (verify=False: {open_unchecked:.4f} s)"))
    return 0

if __name__ == "__main__":
    sys.exit(main())
