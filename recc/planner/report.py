"""What the planner reports: a complete plan's per-rank estimates, each table's reason, and
the error that says why a table does not fit and what would make it."""
from __future__ import annotations

import math
import operator
from collections import Counter
from typing import Optional

import numpy as np

from recc.cluster import Cluster
from recc.planner.constraints import Unit
from recc.planner.cost_model import GIB, ELEM_BYTES, OPTIMIZERS, RESERVED_FRACTION, CostModel, state_row_bytes
from recc.planner.layouts import CW, DP, RW, TW, placement_of
from recc.planner.search import KIND_INDEX, ranks_of
from recc.planner.tiers import TierPlan, tier_notes
from recc.specs import SHARDING_KINDS, Plan, RankEstimate, ShardSpec, StepEstimate, TableSpec, compress_ranks, fmt_ms


def table_reasons(tables, placements, estimate, alternatives, model: CostModel, bag_sizes, check_memory: bool,
                  cons: dict) -> dict[str, str]:
    """Per table: its runner-up kind and what moving only this table there would cost the plan
    (a kind's placement of it taken from that kind's uniform plan; row_wise and data_parallel,
    which have one placement, also where their uniform plan did not fit), or why no kind could
    take it instead. ``placements`` and ``alternatives`` (kind -> plan) map tables to placements;
    ``estimate`` is the plan's ``estimate_placements``."""
    comp, comm, mem, base, _ = estimate
    comp, comm, mem = np.asarray(comp), np.asarray(comm), np.asarray(mem)
    profiles = {n: model.profile(tables[n], (bag_sizes or {}).get(n, 1.0)) for n in placements}
    groups = {n: model.collective(profiles[n], placements[n]) for n in placements}
    lat_now = model.latency(groups.values())
    # The plan's collective groups with how many tables each holds: the groups of the plan less
    # one table are these less its own when it is alone there (a list of the others per table
    # was n^2 work; the latency is a sum over the distinct groups, whatever their sizes).
    members = Counter(groups.values())
    out = {}
    for name, placement0 in placements.items():
        t, p = tables[name], profiles[name]
        c0, m0, me0 = model.delta_arrays(p, placement0)
        rest = [g for g, k in members.items() if k > 1 or g != groups[name]]
        options = []
        allowed = cons["kinds"].get(name, SHARDING_KINDS)
        for kind in SHARDING_KINDS:
            if kind == placement0[0] or kind not in allowed:
                continue
            if kind in alternatives:
                placement = alternatives[kind][name]
            elif kind == DP or (kind == RW and t.splits_rows_ok):
                placement = (kind,)
            else:
                continue
            c1, m1, me1 = model.delta_arrays(p, placement)
            # per rank, in the order one rank at a time adds them: the same floats
            if check_memory and float((mem - me0 + me1).max()) > model.cap:
                options.append((math.inf, kind, "over memory"))
                continue
            lat = model.latency(rest + [model.collective(p, placement)]) - lat_now
            obj = float((comp - c0 + c1 + comm - m0 + m1).max()) + lat
            options.append((obj - base, kind, f"+{fmt_ms(max(0.0, obj - base) * 1e3)} ms"))
        if not options:
            continue
        options.sort(key=lambda o: (o[0], KIND_INDEX[o[1]]))
        cost, kind, what = options[0]
        out[name] = f"{kind} {what}" if math.isfinite(cost) else "every other kind: over memory"
    return out


def estimate_shards(tables: dict[str, TableSpec], shards: dict[str, ShardSpec], model: CostModel,
                    bag_sizes: Optional[dict[str, float]] = None):
    """``(lookup_s, comm_s, memory_bytes, objective_s, table_cost_s)`` of a complete plan: per-rank
    lists (comm includes the collectives' latency), the objective, and each table's time on
    its busiest rank."""
    return estimate_placements(tables, {n: placement_of(tables[n], spec, model.cluster) for n, spec in shards.items()},
                               model, bag_sizes)


def estimate_placements(tables: dict[str, TableSpec], placements: dict[str, tuple], model: CostModel,
                        bag_sizes: Optional[dict[str, float]] = None):
    """``estimate_shards`` of a plan given as placements (``layouts.placement_of``). Per rank the
    tables' terms are added in table order, as one rank at a time adds them."""
    W = model.W
    comp, comm, mem = np.zeros(W), np.zeros(W), np.zeros(W)
    cost = {}
    bag_sizes = bag_sizes or {}
    groups = []
    for name, placement in placements.items():
        p = model.profile(tables[name], bag_sizes.get(name, 1.0))
        c, m_, me = model.delta_arrays(p, placement)
        comp = comp + c
        comm = comm + m_
        mem = mem + me
        cost[name] = float((c + m_).max()) if W else 0.0
        groups.append(model.collective(p, placement))
    lat = model.latency(groups)
    comm = comm + lat
    objective = float((comp + comm).max()) if placements else 0.0
    return comp.tolist(), comm.tolist(), mem.tolist(), objective, cost


def build_plan(tables: dict[str, TableSpec], shards: dict[str, ShardSpec], cluster: Cluster, model: CostModel,
               bag_sizes: Optional[dict[str, float]] = None, *, strategy: str = "auto",
               dense_flops_per_sample: Optional[float] = None, notes: Optional[list[str]] = None,
               tiers: Optional[TierPlan] = None, estimate: Optional[tuple] = None) -> Plan:
    """A ``Plan`` for ``shards`` with the cost model's per-table and per-rank estimates; ``tiers``
    (``place_tiers``) adds its cached tables' memory, I/O and stores. ``estimate``: the shards'
    ``estimate_shards``, when the caller has it."""
    comp, comm, mem, _, cost = estimate or estimate_shards(tables, shards, model, bag_sizes)
    W = model.W
    io = [0.0] * W
    store = [0.0] * W
    if tiers is not None and tiers.tiers:
        mem = list(map(operator.add, mem, tiers.mem_delta))
        io, store = list(tiers.io_s), list(tiers.store_bytes)
        cost = {n: c + tiers.table_io_s.get(n, 0.0) for n, c in cost.items()}
    weights = [0.0] * W
    for name, spec in shards.items():
        e = ELEM_BYTES.get(tables[name].dtype, 4)
        for r, r0, r1, c0, c1 in spec.shards:
            weights[r] += (r1 - r0) * (c1 - c0) * e
    ranks = [RankEstimate(r, weights[r], mem[r], comp[r] * 1e3, comm[r] * 1e3, io[r] * 1e3, store[r]) for r in range(W)]
    slowest = max(range(W), key=lambda r: (comp[r] + comm[r] + io[r], -r))
    dense_ms = 0.0
    if dense_flops_per_sample:
        dense_ms = 3 * dense_flops_per_sample * model.b / (cluster.device.tflops * 1e12) * 1e3
    est = StepEstimate(slowest, comp[slowest] * 1e3, comm[slowest] * 1e3, dense_ms, io[slowest] * 1e3)
    notes = list(notes or [])
    notes.insert(0, f"cluster {cluster.name}: {model.W} rank(s), global batch {int(model.B)}, optimizer "
                    f"{model.optimizer}; memory cap {model.cap / GIB:.2f} GiB per rank "
                    f"({cluster.device.memory_gb:g} GiB less {RESERVED_FRACTION:.0%} reserved); est ms = "
                    f"lookup + communication a table adds to its busiest rank"
                    + (" (+ tier I/O when cached)" if tiers is not None and any(t.cached for t in tiers.tiers.values())
                       else ""))
    if tiers is not None:
        notes.extend(tier_notes(tiers, model, slowest, len(tables)))
    return Plan(world_size=model.W, tables=dict(tables), shards=dict(shards), strategy=strategy,
                table_cost_ms={n: c * 1e3 for n, c in cost.items()}, rank_estimates=ranks,
                memory_cap_bytes=model.cap, estimate=est, notes=notes,
                tiers=dict(tiers.tiers) if tiers is not None else {})


def no_fit_message(u: Unit, overflow, model: CostModel, tables, profiles, units, cons, check_memory) -> str:
    W, cap = model.W, model.cap
    sizes = ", ".join(f"{p.rows}x{p.dim}" for p in u.profiles)
    alone = sum(model.table_bytes(p, p.rows, p.dim) for p in u.profiles)
    head = (f"plan_tables: {'table' if len(u.names) == 1 else 'tables'} {u.label} ({sizes}, "
            f"{model.optimizer}: {alone / GIB:.2f} GiB of weights and optimizer state) "
            f"{'does' if len(u.names) == 1 else 'do'} not fit in memory")
    if overflow is None:
        return head + " (no allowed placement)"
    over, rank, placement, need, used = overflow
    kind = placement[0]
    where = (f"{kind} on rank {rank}" if kind == TW else f"a {kind} block on rank {rank}" if kind == CW
             else f"{kind} over ranks {compress_ranks(ranks_of(placement, model))}")
    msg = (f"{head}: its least-over placement, {where}, needs {need / GIB:.2f} GiB on rank {rank} "
           f"({used / GIB:.2f} GiB already placed there), {over / GIB:.2f} GiB over the "
           f"{cap / GIB:.2f} GiB cap ({model.cluster.device.memory_gb:g} GiB less {RESERVED_FRACTION:.0%} reserved).")
    fixes = []
    rw_need = max(sum(model.delta(p, (RW,))[2][r] for p in u.profiles) for r in range(W))
    if RW not in u.kinds:
        fixes.append(f"allow row_wise for it (over all {W} ranks it needs {rw_need / GIB:.2f} GiB per rank)")
    total = sum(model.tw_terms(p, p.dim)[2] for p in profiles.values())
    need_ranks = math.ceil(total / cap)
    if need_ranks > W or RW in u.kinds:
        fixes.append(f"more ranks (all {len(tables)} tables need {total / GIB:.2f} GiB with their buffers: "
                     f"at least {need_ranks} ranks of {cap / GIB:.2f} GiB, and more for balance)")
    smaller = [o for o in OPTIMIZERS if state_row_bytes(o, 1) < state_row_bytes(model.optimizer, 1)
               or (o == "rowwise_adagrad" and model.optimizer in ("adagrad", "adam"))]
    if smaller:
        fixes.append("a smaller optimizer state (" + ", ".join(
            f"{o}: {sum(model.table_bytes(p, p.rows, p.dim, o) for p in u.profiles) / GIB:.2f} GiB"
            for o in smaller) + " for this table)")
    if any(n in cons["rank"] or n in cons["node"] or n in cons["plan"] for n in u.names) or len(u.names) > 1:
        fixes.append("loosening its rank/node/together/plan constraints")
    fixes.append("devices with more memory")
    if model.cluster.storage is None:
        fixes.append("a storage tier to cache tables in (the cluster description's storage section)")
    return msg + " To make it fit: " + "; or ".join(fixes) + "."
