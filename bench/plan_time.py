"""How long ``recc.compile`` and the sharding planner take, and how good the plans are by the
planner's own cost model.

    python -m bench.plan_time                       # compile 100 / 1,000 / 10,000 tables, plan 1,000
                                                    # tables, then terabyte and dlrmv2, on zionex-16x8
    python -m bench.plan_time --compile 1000 --tables 0 --presets   # one compile, nothing else
    python -m bench.plan_time --tables 2000 --optimizer rowwise_adagrad --cluster clusters/dgx-h100-4x8.yaml

Part 0 times ``recc.compile`` of a meta-device model with N plain ``nn.EmbeddingBag`` tables (rows
log-uniform in [100, 10M], dims from {16, 32, 64, 128}, seeded), a small bottom and top MLP and a
cat interaction, for the cluster (planning included), and prints each stage's time: the pass
itself and recc's own work after it (shape propagation, verification, the IR text and its diff,
the stage's snapshot). The targets: 1,000 tables under 10 s, 10,000 under 60 s, growing no faster
than n log n.

Part 1 times ``plan_tables`` (strategy ``auto``) on random tables: rows log-uniform in
[100, 10M], dims from {16, 32, 64, 128, 256}, bag sizes from {1, 2, 5, 10, 20, 50}, seeded, so
every run plans the same tables. The target is under 10 s for 1,000 tables on 128 ranks.

Part 2 plans the ``terabyte`` and ``dlrmv2`` presets (their real cardinalities, capped at 40M rows)
with ``auto`` and with every forced strategy, side by side: the estimated slowest-rank embedding
time (lookup + communication), the step estimate with the dense part, and memory per rank against
the cap. The models are built on the meta device (nothing is allocated) only to count the dense
FLOPs; the tables come from the presets. Estimates are the planner's cost model, not measurements.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def random_tables(n: int, seed: int):
    from recc.specs import TableSpec
    rng = random.Random(seed)
    tables, bags = {}, {}
    for i in range(n):
        name = f"t{i}"
        tables[name] = TableSpec(name=name, short=name, rows=int(10 ** rng.uniform(2, 7)),
                                 dim=rng.choice([16, 32, 64, 128, 256]), pooling="sum", weight_key=f"{name}.weight")
        bags[name] = float(rng.choice([1, 2, 5, 10, 20, 50]))
    return tables, bags


def compile_model(n: int, seed: int):
    """The meta-device model of part 0: ``forward(dense_x, lS_o, lS_i)``, one bag per table."""
    import torch
    import torch.nn as nn

    class CatTables(nn.Module):
        def __init__(self, rows, dims, dense=13):
            super().__init__()
            self.bot = nn.Sequential(nn.Linear(dense, 64, device="meta"), nn.ReLU(),
                                     nn.Linear(64, 16, device="meta"), nn.ReLU())
            self.emb_l = nn.ModuleList(nn.EmbeddingBag(r, d, mode="sum", device="meta") for r, d in zip(rows, dims))
            self.top = nn.Sequential(nn.Linear(16 + sum(dims), 64, device="meta"), nn.ReLU(),
                                     nn.Linear(64, 1, device="meta"))

        def forward(self, dense_x, lS_o, lS_i):
            x = self.bot(dense_x)
            ly = [e(i, o) for e, i, o in zip(self.emb_l, lS_i, lS_o)]
            return self.top(torch.cat([x] + ly, dim=1))

    rng = random.Random(seed)
    rows = [int(10 ** rng.uniform(2, 7)) for _ in range(n)]
    dims = [rng.choice([16, 32, 64, 128]) for _ in range(n)]
    return CatTables(rows, dims)


def part0(args, cluster):
    import recc
    print(f"## recc.compile of a meta-device model with N EmbeddingBag tables (cat interaction) for "
          f"{cluster.name} ({cluster.world_size} ranks); ms per stage: the pass + recc's work after it")
    totals = {}
    for n in args.compile:
        model = compile_model(n, args.seed)
        t0 = time.perf_counter()
        program = recc.compile(model, cluster)
        totals[n] = time.perf_counter() - t0
        stages = program.stages.values()
        staged = sum(st.time_ms + st.check_ms for st in stages) / 1e3
        planner = sum(st.time_ms for st in stages if st.name == "shard_tables") / 1e3
        print(f"{n:>6} tables: {totals[n]:7.2f} s  (stages {staged:.2f} s; the rest: example inputs, "
              f"the input signature, releasing the stages' tables); without shard_tables' pass (the "
              f"planner, {planner:.2f} s): {totals[n] - planner:.2f} s")
        for st in stages:
            print(f"    {st.name:<18} {st.time_ms:9.1f} + {st.check_ms:8.1f} ms   nodes {st.nodes_after}")
        del program, model
    ns = sorted(totals)
    for a, b in zip(ns, ns[1:]):
        print(f"  {a} -> {b} tables: x{totals[b] / totals[a]:.1f} time "
              f"(n log n would be x{b * math.log(b) / (a * math.log(a)):.1f})")
    print()


def part1(args, cluster):
    from recc.planner import plan_tables
    tables, bags = random_tables(args.tables, args.seed)
    gib = sum(t.rows * t.dim * 4 for t in tables.values()) / 2 ** 30
    print(f"## planning {len(tables)} random tables ({gib:.0f} GiB of fp32 weights, seed {args.seed}) for "
          f"{cluster.name} ({cluster.world_size} ranks), batch {args.batch_size}, {args.optimizer}")
    times = []
    plan = None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        plan = plan_tables(tables, cluster, batch_size=args.batch_size, bag_sizes=bags, optimizer=args.optimizer)
        times.append(time.perf_counter() - t0)
    kinds = {}
    for s in plan.shards.values():
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    print(f"plan_tables: {min(times):.2f} s (best of {len(times)}: {', '.join(f'{t:.2f}' for t in times)}) "
          f"-> slowest rank {plan.slowest_rank_ms:.3g} ms; kinds {kinds}")
    for note in plan.notes[1:]:
        print(f"  {note}")
    print()


def part2(args, cluster):
    from recc.models import build_model, load_preset
    from recc.planner import dense_flops_per_sample, plan_tables, tables_from_preset
    from recc.specs import SHARDING_KINDS
    for preset in args.presets:
        cfg = load_preset(preset)
        tables, bags = tables_from_preset(cfg)
        flops = dense_flops_per_sample(build_model(preset, device="meta"))
        batch = cfg["batch_size"]
        print(f"## {preset} on {cluster.name}: {len(tables)} tables, "
              f"{sum(t.rows * t.dim for t in tables.values()) * 4 / 2 ** 30:.1f} GiB fp32, global batch {batch}, "
              f"{args.optimizer}; dense {flops / 1e6:.1f} MFLOP/sample forward")
        header = f"{'strategy':<15} {'slowest ms':>10} {'lookup':>8} {'comm':>8} {'dense':>8} {'step ms':>8}  " \
                 f"{'mem GiB max/mean/min':<22} {'cap GiB':>7}  kinds"
        print(header)
        print("-" * len(header))
        results, auto = {}, None
        for strategy in ("auto",) + SHARDING_KINDS:
            t0 = time.perf_counter()
            try:
                plan = plan_tables(tables, cluster, strategy=strategy, batch_size=batch, bag_sizes=bags,
                                   optimizer=args.optimizer, dense_flops_per_sample=flops)
            except ValueError as e:
                print(f"{strategy:<15} {'-':>10}  does not fit: {str(e).split(': ', 1)[1][:110]}...")
                continue
            dt = time.perf_counter() - t0
            e = plan.estimate
            mem = [r.memory_bytes / 2 ** 30 for r in plan.rank_estimates]
            kinds = {}
            for s in plan.shards.values():
                kinds[s.kind] = kinds.get(s.kind, 0) + 1
            fits = "" if max(mem) <= plan.memory_cap_bytes / 2 ** 30 else " OVER"
            print(f"{strategy:<15} {e.sparse_ms:>10.3f} {e.lookup_ms:>8.3f} {e.comm_ms:>8.3f} {e.dense_ms:>8.3f} "
                  f"{e.total_ms:>8.3f}  {max(mem):>6.2f}/{sum(mem) / len(mem):>5.2f}/{min(mem):>5.2f}{fits:<5}    "
                  f"{plan.memory_cap_bytes / 2 ** 30:>7.2f}  "
                  + ", ".join(f"{k} {v}" for k, v in kinds.items()) + f"  ({dt:.2f} s)")
            results[strategy] = e.sparse_ms
            if strategy == "auto":
                auto = plan
        worse = [k for k, v in results.items() if k != "auto" and results.get("auto", float("inf")) > v * (1 + 1e-9)]
        print(f"auto vs forced: {'auto is no worse than any forced strategy that fits' if not worse else 'WORSE than ' + ', '.join(worse)}")
        if auto is not None:
            g = cluster.devices_per_node
            print(f"auto: memory per rank (GiB; cap {auto.memory_cap_bytes / 2 ** 30:.2f}), one line per node:")
            for n in range(cluster.nodes):
                cells = " ".join(f"{auto.rank_estimates[r].memory_bytes / 2 ** 30:6.2f}" for r in cluster.node_ranks(n))
                print(f"  node {n:>2} (ranks {n * g:>3}-{n * g + g - 1:>3}): {cells}")
            if args.show_plan:
                print(auto)
        print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=str(ROOT / "clusters" / "zionex-16x8.yaml"))
    ap.add_argument("--compile", type=int, nargs="*", default=[100, 1000, 10000],
                    help="table counts of part 0 (recc.compile); none skips it")
    ap.add_argument("--tables", type=int, default=1000, help="random tables of part 1 (the planner); 0 skips it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=65536, help="global batch of part 1")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "rowwise_adagrad", "adagrad", "adam"))
    ap.add_argument("--presets", nargs="*", default=["terabyte", "dlrmv2"])
    ap.add_argument("--show-plan", action="store_true", help="print auto's full plan for each preset")
    args = ap.parse_args(argv)
    from recc.cluster import Cluster
    cluster = Cluster.from_yaml(args.cluster)
    if args.compile:
        part0(args, cluster)
    if args.tables:
        part1(args, cluster)
    part2(args, cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
