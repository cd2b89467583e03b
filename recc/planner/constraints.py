"""Constraints on a plan (kinds, rank, node, together, a manual plan), checked and turned into
the units the search places: one table, or a ``together`` group placed as one."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from recc.cluster import Cluster
from recc.planner.cost_model import CostModel, Profile
from recc.planner.layouts import CW, DP, RW, TW, TWRW, column_split, placement_of
from recc.specs import SHARDING_KINDS, ShardSpec, TableSpec

DP_MAX_BYTES = 1 << 20     # auto considers data-parallel only for tables smaller than this
CONSTRAINT_KEYS = ("kinds", "rank", "node", "together", "plan")



@dataclass
class Unit:
    """Tables placed as one (a ``together`` group, or one table)."""

    names: list[str]
    profiles: list[Profile]
    kinds: tuple[str, ...]               # allowed kinds, kind order
    ranks: Optional[tuple[int, ...]]     # allowed ranks for TW / CW blocks (None: all)
    node: Optional[int] = None
    rank: Optional[int] = None
    fixed: Optional[tuple] = None        # a manual placement
    index: int = 0
    tw: dict = field(default_factory=dict)  # cols -> (c, peer, mem) summed over the unit
    cache: dict = field(default_factory=dict)  # plan-independent dense deltas
    placement: Optional[tuple] = None
    cur: Optional[tuple] = None          # (dt, dmem) lists of the current placement

    @property
    def label(self) -> str:
        return self.names[0] if len(self.names) == 1 else "[" + ", ".join(self.names) + "]"


def _check_table(name, tables, what):
    if name not in tables:
        raise ValueError(f"constraints: {what} names table {name!r}, which the model does not have; "
                         f"tables: {', '.join(list(tables)[:8])}{', ...' if len(tables) > 8 else ''}")


def _coerce_spec(name: str, value) -> Any:
    if isinstance(value, (ShardSpec, str)):
        return value
    if isinstance(value, dict) and "kind" in value:
        if "shards" not in value:
            return value["kind"]
        return ShardSpec(name, value["kind"], tuple(tuple(int(x) for x in s) for s in value["shards"]))
    raise ValueError(f"constraints: plan for table {name} must be a ShardSpec, a kind name, or "
                     f"{{kind: ..., shards: [[rank, row_start, row_end, col_start, col_end], ...]}}; got {value!r}")


def normalize_constraints(constraints: Optional[dict], tables: dict[str, TableSpec], cluster: Cluster) -> dict:
    """Check a constraints dict against the tables and the cluster; returns a cleaned copy."""
    c = dict(constraints or {})
    unknown = set(c) - set(CONSTRAINT_KEYS)
    if unknown:
        raise ValueError(f"constraints: unknown keys {sorted(unknown)}; known: {list(CONSTRAINT_KEYS)}")
    out = {"kinds": {}, "rank": {}, "node": {}, "together": [], "plan": {}}
    for name, kinds in (c.get("kinds") or {}).items():
        _check_table(name, tables, "kinds")
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        bad = [k for k in kinds if k not in SHARDING_KINDS]
        if bad or not kinds:
            raise ValueError(f"constraints: kinds for table {name}: {bad or kinds} — choose from {SHARDING_KINDS}")
        out["kinds"][name] = tuple(k for k in SHARDING_KINDS if k in kinds)
    for name, r in (c.get("rank") or {}).items():
        _check_table(name, tables, "rank")
        if not isinstance(r, int) or not 0 <= r < cluster.world_size:
            raise ValueError(f"constraints: rank for table {name} is {r!r}; the cluster has ranks "
                             f"0..{cluster.world_size - 1}")
        out["rank"][name] = r
    for name, n in (c.get("node") or {}).items():
        _check_table(name, tables, "node")
        if not isinstance(n, int) or not 0 <= n < cluster.nodes:
            raise ValueError(f"constraints: node for table {name} is {n!r}; the cluster has nodes 0..{cluster.nodes - 1}")
        if name in out["rank"] and cluster.node_of(out["rank"][name]) != n:
            raise ValueError(f"constraints: table {name} is pinned to rank {out['rank'][name]} "
                             f"(node {cluster.node_of(out['rank'][name])}) and to node {n}")
        out["node"][name] = n
    for group in c.get("together") or []:
        group = [group] if isinstance(group, str) else list(group)
        for name in group:
            _check_table(name, tables, "together")
        out["together"].append(group)
    for name, value in (c.get("plan") or {}).items():
        _check_table(name, tables, "plan")
        value = _coerce_spec(name, value)
        if isinstance(value, str):
            if value not in SHARDING_KINDS:
                raise ValueError(f"constraints: plan for table {name}: kind {value!r} not in {SHARDING_KINDS}")
            allowed = out["kinds"].get(name, SHARDING_KINDS)
            if value not in allowed:
                raise ValueError(f"constraints: plan for table {name} says {value} but kinds allows {list(allowed)}")
            out["kinds"][name] = (value,)
        else:
            if value.table != name:
                raise ValueError(f"constraints: plan for table {name} holds a ShardSpec for table {value.table}")
            placement_of(tables[name], value, cluster)  # validates the layout
            out["plan"][name] = value
    return out


def units_of(tables: dict[str, TableSpec], profiles: dict[str, Profile], cons: dict, strategy: str,
           model: CostModel, cluster: Cluster) -> list[Unit]:
    # union the together groups (a table in two groups joins them)
    parent = {n: n for n in tables}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    order = {n: i for i, n in enumerate(tables)}
    for group in cons["together"]:
        for a in group[1:]:
            ra, rb = find(group[0]), find(a)
            if ra != rb:
                if order[ra] > order[rb]:
                    ra, rb = rb, ra
                parent[rb] = ra
    members: dict[str, list[str]] = {}
    for n in tables:
        members.setdefault(find(n), []).append(n)

    W = cluster.world_size
    units = []
    for idx, names in enumerate(members.values()):
        fixed = [n for n in names if n in cons["plan"]]
        if fixed:
            if len(names) > 1:
                placements = {placement_of(tables[n], cons["plan"][n], cluster) for n in fixed}
                if len(fixed) != len(names) or len(placements) > 1:
                    raise ValueError(f"constraints: tables {names} must stay together, but the manual plan "
                                     f"places {fixed} differently or leaves some of them to the planner; "
                                     f"give them all the same placement")
            placement = placement_of(tables[fixed[0]], cons["plan"][fixed[0]], cluster)
            u = Unit(names, [profiles[n] for n in names], (placement[0],), None, fixed=placement, index=idx)
            units.append(u)
            continue
        kinds = list(SHARDING_KINDS)
        explicit = set()
        for n in names:
            if n in cons["kinds"]:
                kinds = [k for k in kinds if k in cons["kinds"][n]]
                explicit |= set(cons["kinds"][n])
        if strategy != "auto":
            if strategy not in kinds:
                raise ValueError(f"plan_tables: strategy {strategy} conflicts with the constraints on "
                                 f"{', '.join(names)}: allowed kinds {kinds}")
            kinds = [strategy]
        else:
            total = sum(model.table_bytes(p, p.rows, p.dim) for p in (profiles[n] for n in names))
            if DP in kinds and DP not in explicit and total >= DP_MAX_BYTES and W > 1:
                kinds.remove(DP)
        whole_rows = [n for n in names if not tables[n].splits_rows_ok]
        if whole_rows and W > 1 and (RW in kinds or TWRW in kinds):
            # A mean or max bag is not the sum of its row blocks' results: never split by rows.
            if strategy in (RW, TWRW) or not set(kinds) - {RW, TWRW}:
                t = tables[whole_rows[0]]
                raise ValueError(f"plan_tables: table {t.name} uses {t.pooling} pooling, which row blocks cannot "
                                 f"assemble (only sum bags and gathers split by rows); place it table_wise, "
                                 f"column_wise or data_parallel")
            kinds = [k for k in kinds if k not in (RW, TWRW)]
        if len(names) > 1 and CW in kinds and len({profiles[n].dim for n in names}) > 1:
            kinds.remove(CW)  # a group shares one placement: its column blocks need one width
        if model.optimizer == "rowwise_adagrad" and W > 1 and CW in kinds:
            # Row-wise Adagrad keeps one accumulator per whole row (the mean of g^2 over all its
            # columns); column blocks on different ranks would each see only their columns.
            if strategy == CW or kinds == [CW]:
                raise ValueError(f"plan_tables: column_wise splits the rows of {', '.join(names)} across ranks, "
                                 f"but rowwise_adagrad keeps one accumulator per whole row; use table_wise, "
                                 f"row_wise or table_row_wise with it, or another optimizer")
            kinds.remove(CW)
        pins_r = {cons["rank"][n] for n in names if n in cons["rank"]}
        pins_n = {cons["node"][n] for n in names if n in cons["node"]}
        pins_n |= {cluster.node_of(r) for r in pins_r}
        if len(pins_r) > 1 or len(pins_n) > 1:
            raise ValueError(f"constraints: tables {names} must stay together but are pinned to different "
                             f"ranks/nodes ({sorted(pins_r)} / {sorted(pins_n)})")
        rank = next(iter(pins_r)) if pins_r else None
        node = next(iter(pins_n)) if pins_n else None
        ranks = None
        if rank is not None:
            ranks = (rank,)
            kinds = [k for k in kinds if k == TW or W == 1 or (k == CW and column_split(profiles[names[0]].dim, W) == 1)]
        elif node is not None:
            ranks = tuple(cluster.node_ranks(node))
            kinds = [k for k in kinds if k not in (RW, DP) or cluster.nodes == 1]
            kinds = [k for k in kinds if k != CW or all(column_split(profiles[n].dim, W) <= len(ranks) for n in names)]
        if not kinds:
            why = []
            if rank is not None:
                why.append(f"pinned to rank {rank} (only table_wise keeps a table on one rank)")
            elif node is not None:
                why.append(f"pinned to node {node} (table_wise, column_wise with at most "
                           f"{cluster.devices_per_node} blocks, or table_row_wise stay inside a node)")
            if len(names) > 1:
                why.append("kept together (column_wise needs one embedding dim for the group)")
            if strategy != "auto":
                why.append(f"under strategy {strategy}")
            raise ValueError(f"constraints: no sharding kind can place {', '.join(names)}: " + "; ".join(why))
        units.append(Unit(names, [profiles[n] for n in names], tuple(kinds), ranks, node, rank, index=idx))
    return units
