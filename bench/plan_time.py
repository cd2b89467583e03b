"""How long the sharding planner takes, and how good its plans are by its own cost model.

    python bench/plan_time.py                       # 1,000 tables on zionex-16x8 (128 ranks), then
                                                    # terabyte and dlrmv2 on zionex-16x8
    python bench/plan_time.py --tables 2000 --optimizer rowwise_adagrad --cluster clusters/dgx-h100-4x8.yaml

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
    ap.add_argument("--tables", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=65536, help="global batch of part 1")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "rowwise_adagrad", "adagrad", "adam"))
    ap.add_argument("--presets", nargs="*", default=["terabyte", "dlrmv2"])
    ap.add_argument("--show-plan", action="store_true", help="print auto's full plan for each preset")
    args = ap.parse_args(argv)
    from recc.cluster import Cluster
    cluster = Cluster.from_yaml(args.cluster)
    if args.tables:
        part1(args, cluster)
    part2(args, cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
