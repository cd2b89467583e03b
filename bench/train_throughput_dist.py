"""``python -m bench.train_throughput --world-size N`` (N >= 2): eager + DDP vs TorchRec DMP vs recc, N processes.

One ``recc.launch`` per optimizer spawns N processes with a gloo world already initialised; every
rank builds every system, checks first-batch predictions, warms each system up, then runs
interleaved timing rounds. Each rank trains on its contiguous slice of every global batch
(``recc.models.slice_batch``) with a per-rank mean loss. Rank results go back to the parent,
which prints the table. See bench/README.md ("--world-size N") for what each row runs.

Failure isolation: each system talks over its own process group (eager DDP and TorchRec get a
``new_group`` each; recc uses the default group for its DDP and its own embedding group), and
the bench's own barriers and "did this work on every rank?" votes use a separate control
group with a longer timeout. So a system that fails on some rank is dropped on all ranks (its
traceback reported in its row) and the others go on.

``recc.launch`` pickles ``rank_main`` by reference: the spawned ranks import this module by its
name, ``bench.train_throughput_dist`` (they inherit the parent's ``sys.path``, which holds the
repository root under ``python -m bench.train_throughput``).
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.lib import machine_limit
from bench.lib.systems import (OPTIMIZERS, ReccSystem, System, TorchRecSystem, autocast, dense_named_parameters,
                               eager_table_optimizer, embedding_bags, make_kjts, recc_available, torchrec_available)
from bench.lib.timing import embedding_bytes, fmt_ratio, limit_range, median_round, memory_bandwidth
from recc.heap import keep_step_memory
from recc.models import SyntheticData, build_model, load_preset, slice_batch

CTL_TIMEOUT_S = 300  # the bench's own votes/barriers: longer than a system's collectives (120 s)
SYSTEM_TIMEOUT_S = 120  # eager DDP's and TorchRec's own groups, as RECC_TIMEOUT_S's default


# --------------------------------------------------------------------------------------------
# The systems, as one rank sees them
# --------------------------------------------------------------------------------------------


def _one_sparse_allreduce_at_a_time(pg):
    """A DDP communication hook: DDP's own all-reduce (sum / world size), except that a sparse
    bucket's all-reduce is waited for before the next one starts.

    Why: torch 2.13's gloo runs DDP's sparse all-reduces (one bucket per table) two at a time on
    the process group's worker threads, and that corrupts the heap now and then: 2 of 8 full
    kaggle launches of this bench lost a rank to ``malloc(): unaligned tcache chunk detected``
    or SIGSEGV, and eager + DDP alone (no TorchRec or recc in the process) crashed in every
    150-step launch; the core dump has the abort in ``AsyncSparseAllreduceWork::allreduce``
    (``coalesce`` -> ``malloc``) on one worker thread while the other runs another sparse
    all-reduce's ``allgatherv``. Dense buckets stay asynchronous, as DDP's default."""
    world = pg.size()

    def hook(_state, bucket):
        tensor = bucket.buffer().div_(world)
        fut = dist.all_reduce(tensor, group=pg, async_op=True).get_future()
        if tensor.is_sparse:
            fut.wait()
        return fut.then(lambda f: f.value()[0])

    return hook


class EagerDDPSystem(System):
    """All tables replicated (``nn.EmbeddingBag(sparse=True)``), whole model in DDP (gloo)."""

    def __init__(self, model, batches, optimizer, lr, eps, pg, dtype: str = "fp32"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        local = copy.deepcopy(model)
        tables = embedding_bags(local)
        for _, emb in tables:
            emb.sparse = True
        # DDP averages every gradient over the ranks (sparse ones too, by all-gathering them).
        self.model = DDP(local, process_group=pg)
        self.model.register_comm_hook(None, _one_sparse_allreduce_at_a_time(pg))
        self.batches = batches
        self.dense_opt = torch.optim.SGD([p for _, p in dense_named_parameters(local)], lr=lr)
        self.table_opt, name = eager_table_optimizer([e.weight for _, e in tables], optimizer, lr, eps)
        self.name = name.replace("eager", "eager+DDP") + ("+autocast(bf16)" if dtype == "bf16" else "")
        self.dtype = dtype

    def step(self, i):
        dense_x, lS_o, lS_i, y = self.batches[i]
        with autocast(self.dtype):
            out = self.model(dense_x, lS_o, lS_i)
        loss = F.binary_cross_entropy(out.float(), y)
        loss.backward()  # DDP all-reduces dense and (sparse) table gradients here
        self.dense_opt.step()
        self.table_opt.step()
        self.dense_opt.zero_grad()
        self.table_opt.zero_grad()
        return loss.detach()

    @torch.no_grad()
    def predict(self, i):
        dense_x, lS_o, lS_i, _ = self.batches[i]
        return self.model.module(dense_x, lS_o, lS_i)


class TorchRecDMPSystem(TorchRecSystem):
    """``EmbeddingBagCollection`` sharded table-wise by DMP over ``pg``, fused FBGEMM CPU kernel;
    the one-process TorchRec system's step."""

    name = "torchrec DMP (tw)"

    def __init__(self, model, batches, kjts, optimizer, lr, eps, pg, dtype: str = "fp32"):
        super().__init__(model, batches, kjts, optimizer, lr, eps, "dmp", dtype, pg=pg)


class ReccDistSystem(ReccSystem):
    """The one-process recc system's step, on a program instantiated for this rank."""

    def __init__(self, program, batches, lr, name):
        self.name = name
        self.dmodel = program.instantiate()  # this rank's shards; comms bound to the world
        self.dense_opt = torch.optim.SGD(self.dmodel.dense_parameters(), lr=lr)
        self.batches = batches


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------


def _quiet():
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # is_fx_tracing deprecation note
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Sparse invariant checks are implicitly disabled")
    warnings.filterwarnings("ignore", message=r"Converting a tensor with requires_grad=True")
    torchrec_available()  # also quiets TorchRec's logger when it imports


class _Entry:
    """One system on this rank: the system (None once dropped), and what it measured."""

    def __init__(self, key: str, name: str):
        self.key, self.name = key, name
        self.system = None
        self.error: str | None = None  # this rank's traceback, if it failed here
        self.failed_at: str | None = None  # phase in which it was dropped (on every rank)
        self.times: list[float] = []  # seconds per step, one per round (this rank's clock)
        self.faults: list[float] = []  # minor page faults per step, one per round (this process)
        self.rss_growth_mb = 0.0  # this process's RSS growth over this system's timed blocks
        self.last_loss = float("nan")
        self.parity: float | None = None
        self.next_batch = 0


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return float("nan")


def rank_main(job: dict) -> dict:
    """Runs on every rank of the launched world; returns this rank's measurements."""
    _quiet()
    rank, world = dist.get_rank(), dist.get_world_size()
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    # Every system in this rank's process trains with the heap recc's CPU runtime sets up
    # (recc.heap: freed step memory kept, not faulted in again each step), whichever is built first.
    keep_step_memory()
    ctl = dist.new_group(backend="gloo", timeout=timedelta(seconds=CTL_TIMEOUT_S))

    def all_ok(ok: bool) -> bool:
        """A vote over the world (also a barrier): True only if ``ok`` on every rank."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctl)
        return bool(flag.item())

    model, optimizer, lr, eps = job["model"], job["optimizer"], job["lr"], job["eps"]
    batches = [tuple(x.clone() if torch.is_tensor(x) else [t.clone() for t in x]
                     for x in slice_batch(b, rank, world)) for b in job["batches"]]
    nb = len(batches)
    entries = [_Entry(k, n) for k, n in job["systems"]]

    def attempt(e: _Entry, phase: str, fn) -> None:
        """Run ``fn()`` for ``e`` on this rank; drop ``e`` on all ranks if it failed on any."""
        ok = True
        try:
            fn()
        except Exception:
            ok = False
            e.error = f"rank {rank}, {phase}:\n{traceback.format_exc()}"
        if not all_ok(ok):
            e.system = None
            e.failed_at = e.failed_at or phase

    # Build, each system on its own process group (created in the same order on every rank).
    for e in entries:
        def build(e=e):
            dtype = "bf16" if e.key.endswith("_bf16") else "fp32"
            if e.key.startswith("eager"):
                pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=SYSTEM_TIMEOUT_S))
                e.system = EagerDDPSystem(model, batches, optimizer, lr, eps, pg, dtype)
            elif e.key.startswith("torchrec"):
                pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=SYSTEM_TIMEOUT_S))
                kjts = make_kjts(batches, len(batches[0][1]))
                e.system = TorchRecDMPSystem(model, batches, kjts, optimizer, lr, eps, pg, dtype)
            else:
                e.system = ReccDistSystem(job["programs"][e.key], batches, lr, e.name)
            e.name = e.system.name
        if e.key.startswith("recc") and job["programs"].get(e.key) is None:
            continue  # compile failed in the parent; reported there
        attempt(e, "build", build)
        gc.collect()

    # Parity: same initial weights => same first-batch predictions on this rank's slice.
    dense_x, lS_o, lS_i, _ = batches[0]
    with torch.no_grad():
        want = model(dense_x, lS_o, lS_i)
    for e in entries:
        if e.system is not None:
            def check(e=e):
                e.parity = (e.system.predict(0) - want).abs().max().item()
            attempt(e, "parity check", check)

    round_limits: list[dict] = []   # rank 0's, per round: dtype -> machine_limit.step_limit

    def measure_limit() -> None:
        """The machine's limit for one step of the global batch, measured by rank 0 with every core
        while the other ranks wait in the next vote (a gloo all-reduce blocks in a socket read and
        leaves the cores to rank 0): the world does the global batch's work on this one machine."""
        spec = job.get("limit")
        if rank != 0 or not spec:
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(spec["cores"])
        try:
            machine_limit.forget()
            bw = memory_bandwidth(spec["cores"], repeats=3)
            round_limits.append({d: machine_limit.step_limit(model, spec["batch"], d, spec["emb_bytes"], bw)
                                 for d in spec["dtypes"]})
        finally:
            torch.set_num_threads(threads)

    def run(e: _Entry, steps: int) -> None:
        for _ in range(steps):
            loss = e.system.step(e.next_batch % nb)
            e.next_batch += 1
        e.last_loss = float(loss)

    for e in entries:
        if e.system is not None and job["warmup"] > 0:
            attempt(e, "warm-up", lambda e=e: run(e, job["warmup"]))

    # Interleaved timing rounds; the vote before a block lines the ranks up, the vote after it
    # waits for the slowest rank, so the time between them is the world's.
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(job["rounds"]):
            measure_limit()
            live = [e for e in entries if e.system is not None]
            shift = r % max(1, len(live))
            for e in live[shift:] + live[:shift]:
                all_ok(True)
                rss0, flt0 = _rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                ok = True
                try:
                    run(e, job["steps"])
                except Exception:
                    ok = False
                    e.error = f"rank {rank}, timing round {r}:\n{traceback.format_exc()}"
                went_ok = all_ok(ok)
                t = (time.perf_counter() - t0) / job["steps"]
                if went_ok:
                    e.times.append(t)
                    # Page faults in a warm loop mean memory is handed back and re-touched, or
                    # grows (a leak): each fault costs microseconds on a VM.
                    e.faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0) / job["steps"])
                    e.rss_growth_mb += _rss_mb() - rss0
                else:
                    e.system, e.failed_at = None, e.failed_at or f"timing round {r}"
    finally:
        if gc_was_enabled:
            gc.enable()

    out = {"rank": rank, "threads": torch.get_num_threads(), "systems": {}, "limits": round_limits}
    for e in entries:
        out["systems"][e.key] = dict(name=e.name, error=e.error, failed_at=e.failed_at, times=e.times,
                                     last_loss=e.last_loss, parity=e.parity, faults=e.faults,
                                     rss_growth_mb=e.rss_growth_mb)
    for e in entries:
        e.system = None
    gc.collect()
    return out


# --------------------------------------------------------------------------------------------
# The parent
# --------------------------------------------------------------------------------------------


def _compile_recc(model, world, optimizer, lr, eps, example_inputs, batch_size, sharding, dense_dtype="fp32"):
    import recc

    config = recc.CompileConfig(optimizer=optimizer, lr=lr, eps=eps, sharding=sharding, batch_size=batch_size,
                                dense_dtype=dense_dtype)
    return recc.compile(model, recc.Cluster.local(world), config=config, example_inputs=example_inputs)


def _indent(text: str, prefix: str = "      ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


def run_optimizer(args, cfg, model, batches, optimizer, printed_plans: set) -> None:
    import recc

    W = args.world_size
    eps = 1e-8
    B = batches[0][0].shape[0]
    T = len(batches[0][1])
    print(f"\n=== {cfg['name']} | optimizer={optimizer} | world size {W} (gloo) | global B={B} "
          f"(B/rank={B // W}) | {T} tables | warmup={args.warmup} steps={args.steps} rounds={args.rounds} ===")

    systems = []  # (key, name) in row order; keys ending in _bf16 compute the dense part in bf16
    if "eager" in args.systems:
        systems.append(("eager", "eager+DDP"))
    if "torchrec" in args.systems and args.torchrec_ok:
        systems.append(("torchrec", "torchrec DMP (tw)"))
    programs: dict[str, object] = {}
    compile_errors: dict[str, str] = {}
    recc_rows = [("recc", "auto", "fp32"), ("recc_tw", "table_wise", "fp32")]
    if args.precision == "bf16":
        if "eager" in args.systems:
            systems.append(("eager_bf16", "eager+DDP+autocast(bf16)"))
        if "torchrec" in args.systems and args.torchrec_ok:
            systems.append(("torchrec_bf16", "torchrec DMP (tw)+autocast(bf16)"))
        recc_rows.append(("recc_bf16", "auto", "bf16"))
    if "recc" in args.systems and args.recc_ok:
        example = slice_batch(batches[0], 0, W)[:3]  # rank 0's slice of batch 0
        for key, sharding, dtype in recc_rows:
            name = f"recc ({sharding})" + (" bf16" if dtype == "bf16" else "")
            systems.append((key, name))
            t0 = time.perf_counter()
            try:
                programs[key] = _compile_recc(model, W, optimizer, args.lr, eps, example, B, sharding, dtype)
                print(f"  recc.compile(sharding={sharding!r}): {time.perf_counter() - t0:.1f} s")
            except Exception:
                programs[key] = None
                compile_errors[key] = traceback.format_exc()
                last = compile_errors[key].rstrip().splitlines()[-1]
                print(f"  recc.compile(sharding={sharding!r}) FAILED: {last} (traceback in its row below)")
        auto = programs.get("recc")
        if auto is not None:
            text = str(auto.plan)
            if text not in printed_plans:
                printed_plans.add(text)
                print(f"\n  program.plan (sharding='auto', optimizer={optimizer}):\n{_indent(text, '    ')}\n")
            else:
                print("  program.plan (sharding='auto'): as printed above")

    dtypes = ["fp32", "bf16"] if args.precision == "bf16" else ["fp32"]
    limit = dict(dtypes=dtypes, emb_bytes=embedding_bytes(model, batches, optimizer), batch=B,
                 cores=len(os.sched_getaffinity(0)))
    job = dict(model=model, batches=batches, optimizer=optimizer, lr=args.lr, eps=eps, systems=systems,
               programs=programs, threads=args.threads, warmup=args.warmup, steps=args.steps,
               rounds=args.rounds, limit=limit)
    t0 = time.perf_counter()
    try:
        results = recc.launch(rank_main, recc.Cluster.local(W), job)
    except Exception:
        print(f"  !! recc.launch of the benchmark world failed (no numbers for this optimizer):\n"
              f"{_indent(traceback.format_exc())}")
        return
    print(f"  ({W} ranks, {results[0]['threads']} torch thread(s) each; launch + build + check + timing "
          f"{time.perf_counter() - t0:.0f} s)")

    # Parity (rank 0's slice; the max over ranks beside it).
    rows = {}
    for key, _ in systems:
        per_rank = [res["systems"][key] for res in results]
        rows[key] = per_rank
        name = per_rank[0]["name"]
        if key in compile_errors:
            continue
        diffs = [p["parity"] for p in per_rank if p["parity"] is not None]
        if per_rank[0]["parity"] is None:
            print(f"  parity: {name:<34} no prediction (see its row)")
            continue
        d0 = per_rank[0]["parity"]
        tol = 2e-2 if key.endswith("_bf16") else 1e-4   # bf16 rounds the products' inputs
        flag = "ok" if max(diffs) < tol else "MISMATCH: not the same initial weights/model"
        print(f"  parity: {name:<34} max |p - p_user| on batch 0, rank 0's slice = {d0:.2e} "
              f"(all ranks {max(diffs):.2e})  {flag}")

    # World time per round = the slowest rank's (they are within a vote of each other).
    med, per_round = {}, {}
    for key, per_rank in rows.items():
        if per_rank[0]["failed_at"] is None and key not in compile_errors and per_rank[0]["times"]:
            rounds = [max(ts) for ts in zip(*(p["times"] for p in per_rank))]
            per_round[key] = rounds
            med[key] = (statistics.median(rounds), min(rounds), (max(rounds) - min(rounds)) / statistics.median(rounds))
    def base(name, key):
        """The TorchRec / eager row a row is compared with: the one of its own dense dtype."""
        return name + ("_bf16" if key.endswith("_bf16") else "")

    def paired(key):
        """Median over rounds of TorchRec's time / this system's in the same round: the systems of
        a round run back to back, so a slow spell of the machine mostly cancels out."""
        ref = base("torchrec", key)
        if ref not in per_round or key not in per_round:
            return None
        return statistics.median(a / b for a, b in zip(per_round[ref], per_round[key]))

    round_limits = results[0]["limits"]

    def of_limit(key):
        """Median over rounds of that round's limit / the world's step in it (the row's dtype)."""
        d = "bf16" if key.endswith("_bf16") else "fp32"
        if key not in per_round or len(per_round[key]) != len(round_limits):
            return None
        return statistics.median(lim[d]["seconds"] / t for lim, t in zip(round_limits, per_round[key], strict=True))

    print(f"\n  full training step, world of {W} (median of {args.rounds} rounds; samples/s = global B / step time)")
    if round_limits:
        print(f"  the machine's limit for a step of the global batch, measured by rank 0 with all {limit['cores']} "
              f"cores at the start of every round (the median round's; it ranged {limit_range(round_limits)}):")
        for d in dtypes:
            print(f"    {machine_limit.describe(median_round(round_limits, d), d)}")
    print(f"  {'system':<34} {'samples/s':>11} {'step ms':>9} {'best ms':>9} {'spread':>7} {'of limit':>9} "
          f"{'vs torchrec':>12} {'(paired)':>9} {'vs eager+DDP':>13} {'last loss':>10}")
    for key, per_rank in rows.items():
        name = per_rank[0]["name"]
        if key in med:
            m, best, spread = med[key]
            loss = statistics.mean(p["last_loss"] for p in per_rank)  # equal slices: the global mean
            tr = med.get(base("torchrec", key), (None,))[0]
            ea = med.get(base("eager", key), (None,))[0]
            frac = of_limit(key)
            print(f"  {name:<34} {B / m:>11,.0f} {m * 1e3:>9.2f} {best * 1e3:>9.2f} {spread:>6.0%} "
                  f"{'-' if frac is None else format(frac, '.0%'):>9} "
                  f"{fmt_ratio(tr / m if tr else None):>12} {fmt_ratio(paired(key)):>9} "
                  f"{fmt_ratio(ea / m if ea else None):>13} {loss:>10.4f}")
        elif key in compile_errors:
            print(f"  {name:<34} FAILED in recc.compile (in the parent):")
            print(_indent(compile_errors[key]))
        else:
            errs = [p["error"] for p in per_rank if p["error"]]
            print(f"  {name:<34} FAILED during {per_rank[0]['failed_at']}:")
            for err in errs or ["(no rank reported an exception)"]:
                print(_indent(err))
    # Memory behaviour in the timed loop: a warm training loop should neither fault nor grow.
    print(f"\n  memory in the timed rounds (per rank: median minor page faults per step; RSS growth over "
          f"{args.rounds * args.steps} timed steps)")
    for key, per_rank in rows.items():
        if key not in med:
            continue
        faults = [statistics.median(p["faults"]) if p.get("faults") else float("nan") for p in per_rank]
        growth = [p.get("rss_growth_mb", float("nan")) for p in per_rank]
        flag = "  <- grows: a leak?" if max(growth) > 2 * args.rounds * args.steps else ""
        print(f"  {per_rank[0]['name']:<34} faults/step {' '.join(f'{f:,.0f}' for f in faults):<16} "
              f"RSS growth MB {' '.join(f'{g:+.0f}' for g in growth)}{flag}")


def main_dist(args) -> None:
    W = args.world_size
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    if load > 0.5 * cores:
        print(f"warning: 1-minute load average is {load:.1f} on {cores} cores before starting: other "
              f"processes compete for the CPUs, so timings will be noisy (see the spread column)")
    torch.manual_seed(args.seed)
    cfg = load_preset(args.config)
    if args.batch_size:
        cfg["batch_size"] = args.batch_size
    if cfg["batch_size"] % W:
        sys.exit(f"global batch {cfg['batch_size']} is not divisible by --world-size {W}")
    model = build_model(cfg)
    if not all(hasattr(model, a) for a in ("emb_l", "bot_l", "top_l", "interact")):
        sys.exit(f"preset {args.config!r} is not a DLRM (emb_l/bot_l/top_l/interact); this bench compares DLRMs")
    model.train()
    data = SyntheticData(cfg, batch_size=cfg["batch_size"], seed=args.seed)
    batches = [data.batch(i) for i in range(args.num_batches)]
    rows = sum(e.num_embeddings for _, e in embedding_bags(model))
    weight_mb = sum(e.weight.numel() for _, e in embedding_bags(model)) * 4 / 1e6
    ids = statistics.mean(sum(i.numel() for i in b[2]) for b in batches)
    threads = args.threads or max(1, (os.cpu_count() or 1) // W)
    print(f"recc train_throughput | preset {args.config}: {len(model.emb_l)} tables, {rows:,} rows, "
          f"{weight_mb:,.0f} MB of tables, {ids:,.0f} ids/global batch | torch {torch.__version__} | "
          f"world size {W} on {cores} cores, {threads} torch thread(s) per rank")

    args.torchrec_ok = False
    if "torchrec" in args.systems:
        why = torchrec_available()
        if why:
            print(f"note: TorchRec skipped, not importable ({why}); run `bash bench/setup_torchrec.sh`")
        else:
            import torchrec

            args.torchrec_ok = True
            # TorchRec divides the table gradients coming back through its all-to-all by the
            # world size (comm_ops' gradient division, on by default), so its updates follow the
            # global-mean loss like DDP's and recc's: the last-loss column should agree.
            print(f"TorchRec {getattr(torchrec, '__version__', '?')} DMP, table-wise, fused FBGEMM CPU TBE")
    args.recc_ok = False
    if "recc" in args.systems:
        why = recc_available()
        if why:
            print(f"note: recc skipped: recc.compile/Cluster/CompileConfig not importable yet ({why})")
        else:
            args.recc_ok = True

    # Data travels to the ranks through shared memory; keep it out of the launched world's way.
    model.share_memory()
    optimizers = OPTIMIZERS if args.optimizer == "both" else (args.optimizer,)
    printed_plans: set = set()
    t0 = time.perf_counter()
    for opt in optimizers:
        run_optimizer(args, cfg, model, batches, opt, printed_plans)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
