"""The sharding planner: a cost model you can read, and a greedy planner over it.

``plan_tables(tables, cluster, strategy=..., batch_size=..., bag_sizes=..., optimizer=...,
constraints=...)`` returns a ``Plan``: one ``ShardSpec`` per table plus the model's estimates.
It is deterministic (no randomness, ties broken by kind order and then by rank), so every rank
that runs it computes the same plan.

Sharding kinds and their blocks ``(rank, row_start, row_end, col_start, col_end)`` — the
runtime relies on exactly these layouts:

- ``table_wise`` (TW): one block ``(r, 0, rows, 0, dim)``.
- ``row_wise`` (RW): over all ranks ``0..W-1``, contiguous blocks of ``ceil(rows / W)`` rows
  (the last may be smaller; empty blocks, when rows < W, are omitted), full columns.
- ``column_wise`` (CW): ``k`` column blocks of width ``dim / k``, in column order, on distinct
  ranks. ``k`` is the largest divisor of dim that is <= W and leaves blocks at least 4 wide
  (at least 1 wide when dim < 8); one block when no split is possible.
- ``table_row_wise`` (TWRW): row-wise (ceil-sized blocks) over the ranks of one node.
- ``data_parallel`` (DP): a full block on every rank.

Cost model
----------
Notation: ``B`` global batch, ``W`` ranks, ``G`` ranks per node, ``N`` nodes, ``b = B / W`` the
local batch; per table ``L`` ids per bag (its average bag size), ``D`` columns, ``e`` bytes per
weight element; memory bandwidth ``M``; link bandwidths ``bw_intra``/``bw_inter`` and
``inv(q, r)`` = 1/bandwidth of the link between ranks q != r (intra-node if they share a node).
``S = (G-1)/bw_intra + (W-G)/bw_inter`` is the time per byte of talking to every other rank.

- Bytes on the wire: ids ``id(n, L) = n * (8 L + 8)`` for n bags (int64 ids plus one int64 length
  per bag; +4 per id for per-sample weights); pooled outputs ``out(n, D) = n * D * 4``
  (``n * L * D * 4`` for unpooled gathers). Payloads are fp32: ``quantize_comm`` shrinks them later.
- Lookup of ``n`` ids over ``D`` columns, forward + backward + fused optimizer:
  ``(3 * n * D * e + 2 * n * s(D)) / M``, where ``s(D)`` is the optimizer state per row
  (sgd 0, rowwise_adagrad 4 bytes, adagrad 4 D, adam 8 D), read and written once per id.
- TW on rank r: r looks up all ``B L`` ids. Per peer q it receives ids ``id(b, L)``, sends the
  pooled forward output and receives its gradient, ``p = id(b, L) + 2 out(b, D)``; r pays
  ``p * S``, every other rank q pays ``p * inv(q, r)``.
- CW: k blocks, each costed as a TW table of ``D / k`` columns (every block owner gets all ids).
- RW: rank r looks up the ids of its rows (``B L * rows_r / rows``, ids spread uniformly over
  rows); every pair of ranks exchanges ids both ways (``2 id(b, L / W)``) and the reduce-scatter
  of partial sums plus its backward all-gather (``4 out(b, D)``): every rank pays that ``* S``.
- TWRW on node n: as RW inside the node (``L / G``); the node's ranks reduce-scatter partial sums
  inside the node (``4 out(N b, D)`` per node peer) and all-to-all the results with the rank of
  the same local index on every other node (``2 out(b, D)`` per remote peer); each rank outside
  n receives its pooled output from one rank of n over the inter-node link.
- DP: every rank looks up its local ``b L`` ids and updates its whole replica
  (``(3 rows D e + 2 rows s(D)) / M``), then all-reduces the table's gradient,
  ``2 (W-1)/W * rows * D * 4`` bytes over the slowest link the world spans.
- Latency: each kind in the plan runs its own collectives, every one paying the world's link
  latency (inter-node when N > 1): TW, CW, RW 4 (ids in two phases, output forward, gradient
  backward), TWRW 6 (its output dist is two-level), DP ``2 ceil(log2 W)`` (a tree all-reduce).
- Memory per rank: weights ``rows_r * cols * e`` + optimizer state (sgd none, rowwise_adagrad one
  fp32 per row, adagrad one per element, adam two per element) + on CPU ranks one int32 per row
  (the fused backward's row -> slot map) + buffers (the ids a shard
  receives and its output and gradient, or a DP table's dense gradient). The cap is the device
  memory less ``RESERVED_FRACTION`` for the dense model, activations and the runtime.

A rank's estimated time is the sum of its shards' lookup time and its communication; the
objective is the slowest rank's time plus the plan's collective latencies. Links are taken to
serialise (NVLink and NIC traffic add up), a conservative bound.

Planner
-------
``auto``: tables (or ``together`` groups) are placed greedily, largest estimated cost first. Each
goes where it minimises ``max(slowest rank after placing it, average rank once every table is
placed) + the plan's latencies`` — the average is a lower bound on the final objective, so early
tables are not spread over many ranks at a high total cost just because the ranks are still
empty. Ties go to the smaller growth of the sum of squared rank times, then kind order, then the
lowest rank. Candidates: TW on every rank, CW (each block on one of the ranks that would take a
table best), RW, TWRW on every node, and DP for tables under ``DP_MAX_BYTES``. A refinement pass
then moves tables off the slowest rank (to any allowed placement), or swaps a table-wise table
there with a smaller one elsewhere, while that lowers the objective. Finally every uniform
strategy (each kind forced on all tables) is planned as well; if the best of them beats the greedy
plan it is refined with all kinds allowed and kept, so ``auto`` is never estimated worse than a
forced strategy that fits (and may then replicate tables above ``DP_MAX_BYTES``). A forced
``strategy`` uses one kind for every table, TW and CW blocks and TWRW nodes balanced greedily.
Memory caps are hard: a placement that would put any rank over its cap is never taken.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from recc.cluster import Cluster
from recc.specs import (SHARDING_KINDS, Plan, RankEstimate, ShardSpec, StepEstimate, TableSpec,
                        compress_ranks, fmt_ms)

TW, RW, CW, TWRW, DP = SHARDING_KINDS
KIND_INDEX = {k: i for i, k in enumerate(SHARDING_KINDS)}
OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
ID_BYTES = 8          # int64 ids
LENGTH_BYTES = 8      # one int64 length (offset) per bag
PSW_BYTES = 4         # fp32 per-sample weight per id
OUT_BYTES = 4         # fp32 pooled outputs and their gradients
RESERVED_FRACTION = 0.10   # of device memory, for the dense model, activations and the runtime
DP_MAX_BYTES = 1 << 20     # auto considers data-parallel only for tables smaller than this
REFINE_STEPS = 256         # bound on refinement moves (deterministic: a count, never a clock)
REFINE_UNITS = 8           # tables on the slowest rank tried per refinement step
REFINE_SWAPS = 4           # screened swaps evaluated exactly per refinement step
SLOT_MAP_BYTES = 4         # per weight row on CPU ranks: the fused backward's row -> slot map
GIB = 2 ** 30
CONSTRAINT_KEYS = ("kinds", "rank", "node", "together", "plan")


# ----------------------------------------------------------------------------- layouts

def row_blocks(rows: int, parts: int) -> list[tuple[int, int, int]]:
    """``(part, row_start, row_end)`` of ceil-sized contiguous blocks; empty blocks omitted."""
    size = -(-rows // parts)
    out = []
    for i in range(parts):
        r0, r1 = i * size, min((i + 1) * size, rows)
        if r1 > r0:
            out.append((i, r0, r1))
    return out


def column_split(dim: int, world_size: int) -> int:
    """How many column blocks a column-wise table gets on ``world_size`` ranks."""
    min_width = 4 if dim >= 8 else 1
    best = 1
    for k in range(1, min(dim, world_size) + 1):
        if dim % k == 0 and dim // k >= min_width:
            best = k
    return best


def table_wise_spec(t: TableSpec, rank: int) -> ShardSpec:
    return ShardSpec(t.name, TW, ((rank, 0, t.rows, 0, t.dim),))


def row_wise_spec(t: TableSpec, world_size: int) -> ShardSpec:
    return ShardSpec(t.name, RW, tuple((i, r0, r1, 0, t.dim) for i, r0, r1 in row_blocks(t.rows, world_size)))


def column_wise_spec(t: TableSpec, ranks: Iterable[int]) -> ShardSpec:
    ranks = tuple(ranks)
    w = t.dim // len(ranks)
    return ShardSpec(t.name, CW, tuple((r, 0, t.rows, j * w, (j + 1) * w) for j, r in enumerate(ranks)))


def table_row_wise_spec(t: TableSpec, node: int, cluster: Cluster) -> ShardSpec:
    base = node * cluster.devices_per_node
    return ShardSpec(t.name, TWRW, tuple((base + i, r0, r1, 0, t.dim)
                                         for i, r0, r1 in row_blocks(t.rows, cluster.devices_per_node)))


def data_parallel_spec(t: TableSpec, world_size: int) -> ShardSpec:
    return ShardSpec(t.name, DP, tuple((r, 0, t.rows, 0, t.dim) for r in range(world_size)))


def spec_for(t: TableSpec, placement: tuple, cluster: Cluster) -> ShardSpec:
    """The ShardSpec of a placement: ``(TW, r)``, ``(RW,)``, ``(CW, ranks)``, ``(TWRW, node)``, ``(DP,)``."""
    kind = placement[0]
    if kind == TW:
        return table_wise_spec(t, placement[1])
    if kind == RW:
        return row_wise_spec(t, cluster.world_size)
    if kind == CW:
        return column_wise_spec(t, placement[1])
    if kind == TWRW:
        return table_row_wise_spec(t, placement[1], cluster)
    return data_parallel_spec(t, cluster.world_size)


def placement_of(t: TableSpec, spec: ShardSpec, cluster: Cluster) -> tuple:
    """The placement a ShardSpec describes; ValueError unless it is exactly one of the layouts."""
    W = cluster.world_size
    bad = [s for s in spec.shards if not 0 <= s[0] < W]
    if bad:
        raise ValueError(f"table {t.name}: {spec.describe()} uses rank {bad[0][0]}, but the cluster has "
                         f"ranks 0..{W - 1}")
    expected: Optional[ShardSpec] = None
    if spec.kind == TW:
        placement = (TW, spec.shards[0][0]) if len(spec.shards) == 1 else None
        expected = table_wise_spec(t, spec.shards[0][0] if spec.shards else 0)
    elif spec.kind == RW:
        placement, expected = (RW,), row_wise_spec(t, W)
    elif spec.kind == DP:
        placement, expected = (DP,), data_parallel_spec(t, W)
    elif spec.kind == TWRW:
        node = cluster.node_of(spec.shards[0][0]) if spec.shards else 0
        placement, expected = (TWRW, node), table_row_wise_spec(t, node, cluster)
    else:
        ranks = tuple(s[0] for s in spec.shards)
        k = len(ranks)
        placement = (CW, ranks) if k and t.dim % k == 0 and len(set(ranks)) == k else None
        expected = column_wise_spec(t, ranks if placement else tuple(range(column_split(t.dim, W))))
    if placement is None or spec_for(t, placement, cluster).shards != spec.shards:
        raise ValueError(f"table {t.name}: {spec.describe()} is not a {spec.kind} layout recc runs; "
                         f"expected e.g. {expected.describe()}")
    return placement


# ----------------------------------------------------------------------------- cost model

def state_row_bytes(optimizer: str, cols: int) -> int:
    """Optimizer state per table row, bytes."""
    return {"sgd": 0, "rowwise_adagrad": 4, "adagrad": 4 * cols, "adam": 8 * cols}[optimizer]


@dataclass(frozen=True)
class _Profile:
    """What the cost model needs to know about one table."""

    name: str
    rows: int
    dim: int
    bag: float       # ids per bag (per sample)
    pooled: bool
    id_bytes: int    # per id on the wire
    elem: int        # bytes per weight element


class CostModel:
    """The formulas of the module docstring, for one cluster, batch and optimizer.

    ``delta(profile, placement)`` returns per-rank lists ``(lookup_s, comm_s, memory_bytes)``
    that a table adds; ``tw_terms`` the same for a table-wise block in closed form."""

    def __init__(self, cluster: Cluster, batch_size: int, optimizer: str = "sgd"):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"plan_tables: optimizer {optimizer!r} is not one of {OPTIMIZERS}")
        if batch_size < 1:
            raise ValueError(f"plan_tables: batch_size must be >= 1, got {batch_size}")
        self.cluster = cluster
        self.optimizer = optimizer
        self.W, self.G, self.N = cluster.world_size, cluster.devices_per_node, cluster.nodes
        self.B = float(batch_size)
        self.b = self.B / self.W
        self.mem_bw = cluster.device.mem_bw_gbps * 1e9
        self.ii = 1.0 / (cluster.intra_node.bw_gbps * 1e9) if self.G > 1 else 0.0
        self.ie = 1.0 / (cluster.inter_node.bw_gbps * 1e9) if self.N > 1 else 0.0
        self.S = (self.G - 1) * self.ii + (self.W - self.G) * self.ie
        self.cap = cluster.device.memory_gb * GIB * (1 - RESERVED_FRACTION)
        # The CPU backward finds each id's slot among the step's unique rows through a map with
        # one int32 per weight row while a group fits a quarter of the last-level cache, a hash map
        # sized by the step's ids past it (kernels/cpu/tbe.py): counted for every row, an upper
        # bound. The CUDA backward sorts instead.
        self.slot_bytes = SLOT_MAP_BYTES if cluster.device_type == "cpu" else 0
        self.node = [r // self.G for r in range(self.W)]
        if self.W == 1:
            lat = 0.0
        else:
            lat = (cluster.inter_node if self.N > 1 else cluster.intra_node).latency_us * 1e-6
        self.kind_latency = {TW: 4 * lat, CW: 4 * lat, RW: 4 * lat, TWRW: 6 * lat,
                             DP: 2 * math.ceil(math.log2(self.W)) * lat if self.W > 1 else 0.0}
        slow = cluster.inter_node if self.N > 1 else cluster.intra_node
        self.i_slow = 1.0 / (slow.bw_gbps * 1e9) if self.W > 1 else 0.0

    # -- building blocks
    def profile(self, t: TableSpec, bag: float) -> _Profile:
        return _Profile(t.name, t.rows, t.dim, float(bag), t.pooling != "none",
                        ID_BYTES + (PSW_BYTES if t.weighted else 0), ELEM_BYTES.get(t.dtype, 4))

    def ids(self, p: _Profile, bags: float, ids_per_bag: float) -> float:
        return bags * (ids_per_bag * p.id_bytes + LENGTH_BYTES)

    def out(self, p: _Profile, bags: float, cols: int) -> float:
        return bags * cols * OUT_BYTES * (1.0 if p.pooled else p.bag)

    def lookup_s(self, p: _Profile, n_ids: float, cols: int) -> float:
        return (3 * n_ids * cols * p.elem + 2 * n_ids * state_row_bytes(self.optimizer, cols)) / self.mem_bw

    def table_bytes(self, p: _Profile, rows: int, cols: int, optimizer: Optional[str] = None) -> float:
        return rows * (cols * p.elem + state_row_bytes(optimizer or self.optimizer, cols))

    def resident_bytes(self, p: _Profile, rows: int, cols: int, optimizer: Optional[str] = None) -> float:
        """What a shard of ``rows`` x ``cols`` holds on its rank: weights, state, the slot map."""
        return self.table_bytes(p, rows, cols, optimizer) + rows * self.slot_bytes

    def inv(self, q: int, r: int) -> float:
        if q == r:
            return 0.0
        return self.ii if self.node[q] == self.node[r] else self.ie

    def tw_terms(self, p: _Profile, cols: int, optimizer: Optional[str] = None) -> tuple[float, float, float]:
        """``(lookup_s, per-peer bytes, memory)`` of a table-wise block of ``cols`` columns."""
        c = self.lookup_s(p, self.B * p.bag, cols)
        peer = self.ids(p, self.b, p.bag) + 2 * self.out(p, self.b, cols)
        mem = (self.resident_bytes(p, p.rows, cols, optimizer) + self.ids(p, self.B, p.bag)
               + 2 * self.out(p, self.B, cols))
        return c, peer, mem

    # -- per-rank deltas
    def delta(self, p: _Profile, placement: tuple, optimizer: Optional[str] = None):
        W, kind = self.W, placement[0]
        comp, comm, mem = [0.0] * W, [0.0] * W, [0.0] * W
        if kind in (TW, CW):
            owners = (placement[1],) if kind == TW else placement[1]
            cols = p.dim // len(owners)
            c, peer, m = self.tw_terms(p, cols, optimizer)
            per_node = [0] * self.N
            for r in owners:
                comp[r] += c
                mem[r] += m
                comm[r] += peer * self.S
                per_node[self.node[r]] += 1
            k, owned = len(owners), set(owners)
            for q in range(W):
                same = per_node[self.node[q]] - (1 if q in owned else 0)
                comm[q] += peer * (same * self.ii + (k - per_node[self.node[q]]) * self.ie)
        elif kind in (RW, TWRW):
            parts = W if kind == RW else self.G
            base = 0 if kind == RW else placement[1] * self.G
            group = range(base, base + parts)
            idb = self.ids(p, self.b, p.bag / parts)
            for i, r0, r1 in row_blocks(p.rows, parts):
                f = (r1 - r0) / p.rows
                comp[base + i] = self.lookup_s(p, self.B * p.bag * f, p.dim)
                mem[base + i] = (self.resident_bytes(p, r1 - r0, p.dim, optimizer) + self.ids(p, self.B * f, p.bag)
                                 + 2 * self.out(p, self.B, p.dim) * (1.0 if p.pooled else f))
            if kind == RW:
                pair = 2 * idb + (4 * self.out(p, self.b, p.dim) * (1.0 if p.pooled else 1.0 / W))
                for q in range(W):
                    comm[q] = pair * self.S
            else:
                n = placement[1]
                to_node_in, to_node_out = (self.G - 1) * self.ii, self.G * self.ie
                for q in range(W):  # every rank sends its bags' ids to the node's ranks
                    comm[q] += idb * (to_node_in if self.node[q] == n else to_node_out)
                ob = self.out(p, self.b, p.dim)
                for r in group:
                    comm[r] += idb * self.S
                if p.pooled:
                    inside = 4 * self.out(p, self.N * self.b, p.dim) * (self.G - 1) * self.ii
                    across = 2 * ob * (self.N - 1) * self.ie
                    for q in range(W):
                        comm[q] += inside + across if self.node[q] == n else 2 * ob * self.ie
                else:  # gathers: each owner returns its rows' vectors to every batch owner
                    ob /= self.G
                    for q in range(W):
                        comm[q] += 2 * ob * (to_node_in if self.node[q] == n else to_node_out)
                    for r in group:
                        comm[r] += 2 * ob * self.S
        else:  # DP
            upd = (3 * p.rows * p.dim * p.elem + 2 * p.rows * state_row_bytes(optimizer or self.optimizer, p.dim))
            c = self.lookup_s(p, self.b * p.bag, p.dim) + upd / self.mem_bw
            ar = 2 * (W - 1) / W * p.rows * p.dim * OUT_BYTES * self.i_slow
            m = self.resident_bytes(p, p.rows, p.dim, optimizer) + p.rows * p.dim * OUT_BYTES
            comp, comm, mem = [c] * W, [ar] * W, [m] * W
        return comp, comm, mem

    def latency(self, kinds: Iterable[str]) -> float:
        used = set(kinds)  # summed in kind order, so every process adds the same floats
        return sum(self.kind_latency[k] for k in SHARDING_KINDS if k in used)


# ----------------------------------------------------------------------------- constraints

@dataclass
class _Unit:
    """Tables placed as one (a ``together`` group, or one table)."""

    names: list[str]
    profiles: list[_Profile]
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


def _units(tables: dict[str, TableSpec], profiles: dict[str, _Profile], cons: dict, strategy: str,
           model: CostModel, cluster: Cluster) -> list[_Unit]:
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
            u = _Unit(names, [profiles[n] for n in names], (placement[0],), None, fixed=placement, index=idx)
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
        units.append(_Unit(names, [profiles[n] for n in names], tuple(kinds), ranks, node, rank, index=idx))
    return units


# ----------------------------------------------------------------------------- the search

class _NoFit(Exception):
    pass


class _State:
    """Per-rank time and memory of a partial plan, with the caches the fast TW evaluation uses."""

    def __init__(self, model: CostModel):
        self.m = model
        W = model.W
        self.tot = [0.0] * W
        self.mem = [0.0] * W
        self.kinds: dict[str, int] = {}
        self.refresh()

    def refresh(self):
        m, tot = self.m, self.tot
        G, N = m.G, m.N
        self.T = sum(tot)
        self.Tn, self.best1, self.arg1, self.best2 = [], [], [], []
        for n in range(N):
            vals = tot[n * G:(n + 1) * G]
            self.Tn.append(sum(vals))
            i1 = max(range(G), key=lambda i: (vals[i], -i))
            self.best1.append(vals[i1])
            self.arg1.append(n * G + i1)
            rest = [v for i, v in enumerate(vals) if i != i1]
            self.best2.append(max(rest) if rest else -math.inf)
        ordered = sorted(range(N), key=lambda n: (-self.best1[n], n))
        self.nb1 = ordered[0]
        self.nb2 = ordered[1] if N > 1 else None

    @property
    def latency(self) -> float:
        return self.m.latency(k for k, c in self.kinds.items() if c > 0)

    def latency_with(self, kind: str) -> float:
        lat = self.latency
        return lat if self.kinds.get(kind, 0) > 0 else lat + self.m.kind_latency[kind]

    def objective(self) -> float:
        return max(self.tot) + self.latency

    def slowest(self) -> int:
        return max(range(self.m.W), key=lambda r: (self.tot[r], -r))

    def apply(self, kind: str, dt: list, dmem: list, sign: float = 1.0):
        if sign > 0:
            self.tot = list(map(operator.add, self.tot, dt))
            self.mem = list(map(operator.add, self.mem, dmem))
        else:
            self.tot = list(map(operator.sub, self.tot, dt))
            self.mem = list(map(operator.sub, self.mem, dmem))
        self.kinds[kind] = self.kinds.get(kind, 0) + (1 if sign > 0 else -1)
        self.refresh()


class _Search:
    def __init__(self, model: CostModel, tables: dict[str, TableSpec], units: list[_Unit], strategy: str,
                 check_memory: bool):
        self.m = model
        self.tables = tables
        self.units = units
        self.strategy = strategy
        self.cap = model.cap if check_memory else math.inf
        self.state = _State(model)
        self.remaining = 0.0  # total time (summed over ranks) of the units not placed yet, table-wise
        self.overflow = None  # the least-over infeasible candidate seen for the current unit

    # -- deltas of a unit
    def tw_terms(self, u: _Unit, cols_div: int = 1):
        key = cols_div
        if key not in u.tw:
            c = peer = mem = 0.0
            for p in u.profiles:
                ci, pi, mi = self.m.tw_terms(p, p.dim // cols_div)
                c, peer, mem = c + ci, peer + pi, mem + mi
            u.tw[key] = (c, peer, mem)
        return u.tw[key]

    def dense(self, u: _Unit, placement: tuple):
        """Per-rank ``(time, memory)`` the unit adds in ``placement``. Placements that do not
        depend on the plan so far are cached; TWRW on node n is node 0's delta rotated by n nodes."""
        kind = placement[0]
        if kind in (TW, CW):
            return self._dense(u, placement)
        key = (kind,) if kind != TWRW else (TWRW, 0)
        if key not in u.cache:
            u.cache[key] = self._dense(u, key)
        dt, dmem = u.cache[key]
        if kind == TWRW and placement[1]:
            k = placement[1] * self.m.G
            dt, dmem = dt[-k:] + dt[:-k], dmem[-k:] + dmem[:-k]
        return dt, dmem

    def _dense(self, u: _Unit, placement: tuple):
        dt, dmem = [0.0] * self.m.W, [0.0] * self.m.W
        for p in u.profiles:
            comp, comm, mem = self.m.delta(p, placement)
            dt = list(map(lambda a, b, c: a + b + c, dt, comp, comm))
            dmem = list(map(operator.add, dmem, mem))
        return dt, dmem

    def _over(self, u: _Unit, placement: tuple, rank: int, need: float):
        over = need - self.cap
        if self.overflow is None or over < self.overflow[0]:
            self.overflow = (over, rank, placement, need, self.state.mem[rank])

    # -- evaluation
    def eval_dense(self, u: _Unit, placement: tuple, dt, dmem):
        st = self.state
        need = list(map(operator.add, st.mem, dmem))
        worst = max(need)
        if worst > self.cap:
            self._over(u, placement, need.index(worst), worst)
            return None
        mx = max(max(map(operator.add, st.tot, dt)), (st.T + sum(dt) + self.remaining) / self.m.W)
        dss = 2 * sum(map(operator.mul, st.tot, dt)) + sum(map(operator.mul, dt, dt))
        return (mx + st.latency_with(placement[0]), dss, KIND_INDEX[placement[0]], _tiebreak(placement))

    def tw_scores(self, u: _Unit, cols_div: int, kind: str, ranks: Optional[Iterable[int]]):
        """Keys of placing the unit (or one CW block of it) table-wise on each allowed rank."""
        m, st = self.m, self.state
        c, peer, mem = self.tw_terms(u, cols_div)
        a, di, de = c + peer * m.S, peer * m.ii, peer * m.ie
        G, N, W = m.G, m.N, m.W
        lat = st.latency_with(kind)
        kidx = KIND_INDEX[kind]
        tot, memr, cap = st.tot, st.mem, self.cap
        bound = (st.T + c + 2 * peer * m.S + self.remaining) / W  # the average rank after it
        out = []
        for r in (ranks if ranks is not None else range(W)):
            if memr[r] + mem > cap:
                self._over(u, (kind, r if kind == TW else (r,)), r, memr[r] + mem)
                continue
            n = r // G
            t = tot[r]
            x = t + a
            if G > 1:
                y = (st.best2[n] if st.arg1[n] == r else st.best1[n]) + di
                if y > x:
                    x = y
            if N > 1:
                other = st.best1[st.nb1] if st.nb1 != n else st.best1[st.nb2]
                if other + de > x:
                    x = other + de
            dss = (2 * t * a + a * a + 2 * di * (st.Tn[n] - t) + (G - 1) * di * di
                   + 2 * de * (st.T - st.Tn[n]) + (W - G) * de * de)
            out.append(((x if x > bound else bound) + lat, dss, kidx, r))
        return out

    def candidates(self, u: _Unit):
        """The best key and placement for each allowed kind (``[(key, placement, dense or None)]``)."""
        m = self.m
        found = []
        for kind in u.kinds:
            if kind in (RW, TWRW) and TW in u.kinds and (m.W == 1 or (kind == TWRW and m.G == 1)):
                continue  # one block on one rank: the table_wise layout under another name
            if kind == TW:
                scores = self.tw_scores(u, 1, TW, u.ranks)
                if scores:
                    best = min(scores)
                    found.append((best, (TW, best[3]), None))
            elif kind == CW:
                k = column_split(u.profiles[0].dim, m.W)
                if k == 1 and TW in u.kinds:
                    continue  # the same layout as table_wise
                scores = sorted(self.tw_scores(u, k, CW, u.ranks))
                if len(scores) < k:
                    continue
                blocks = tuple(s[3] for s in scores[:k])
                placement = (CW, blocks)
                dt, dmem = self.dense(u, placement)
                key = self.eval_dense(u, placement, dt, dmem)
                if key is not None:
                    found.append((key, placement, (dt, dmem)))
            elif kind == TWRW:
                nodes = [u.node] if u.node is not None else range(m.N)
                best = None
                for n in nodes:
                    placement = (TWRW, n)
                    dt, dmem = self.dense(u, placement)
                    key = self.eval_dense(u, placement, dt, dmem)
                    if key is not None and (best is None or key < best[0]):
                        best = (key, placement, (dt, dmem))
                if best is not None:
                    found.append(best)
            else:  # RW, DP
                placement = (kind,)
                dt, dmem = self.dense(u, placement)
                key = self.eval_dense(u, placement, dt, dmem)
                if key is not None:
                    found.append((key, placement, (dt, dmem)))
        return found

    def place(self, u: _Unit, placement: tuple, dense=None):
        dt, dmem = dense if dense is not None else self.dense(u, placement)
        self.state.apply(placement[0], dt, dmem)
        u.placement, u.cur = placement, (dt, dmem)

    def unplace(self, u: _Unit):
        dt, dmem = u.cur
        self.state.apply(u.placement[0], dt, dmem, -1.0)

    # -- greedy
    def run(self, start: Optional[dict[str, tuple]] = None):
        fixed = [u for u in self.units if u.fixed is not None]
        for u in fixed:
            dt, dmem = self.dense(u, u.fixed)
            st = self.state
            over = [(st.mem[r] + dmem[r], r) for r in range(self.m.W) if st.mem[r] + dmem[r] > self.cap]
            if over:
                need, r = max(over)
                raise ValueError(f"plan_tables: the manual plan for {u.label} needs {need / GIB:.2f} GiB on rank {r}, "
                                 f"{(need - self.cap) / GIB:.2f} GiB over its {self.cap / GIB:.2f} GiB cap")
            self.place(u, u.fixed, (dt, dmem))
        free = [u for u in self.units if u.fixed is None]
        if start is not None:  # refine a given plan instead of building one
            for u in free:
                self.place(u, start[u.names[0]])
            self.refine(free)
            return

        def work(u):  # the unit's time summed over ranks, table-wise: lookup + both ends' traffic
            c, peer, _ = self.tw_terms(u)
            return c + 2 * peer * self.m.S
        free.sort(key=lambda u: (-self.tw_terms(u)[0] - self.tw_terms(u)[1] * self.m.S,
                                 -self.tw_terms(u)[2], u.index))
        self.remaining = sum(work(u) for u in free)
        for u in free:
            self.remaining -= work(u)
            self.overflow = None
            found = self.candidates(u)
            if not found:
                raise _NoFit(u, self.overflow)
            key, placement, dense = min(found, key=lambda f: f[0])
            self.place(u, placement, dense)
        self.remaining = 0.0
        self.refine(free)

    # -- refinement
    def refine(self, free: list[_Unit]):
        if self.m.W == 1 or not free:
            return
        st = self.state
        for _ in range(REFINE_STEPS):
            obj = st.objective()
            tol = 1e-9 * obj + 1e-15
            s = st.slowest()
            on_s = [u for u in free if s in _ranks_of(u.placement, self.m)]
            on_s.sort(key=lambda u: (-u.cur[0][s], u.index))
            best = None  # (objective, action)
            for u in on_s[:REFINE_UNITS]:
                old = (u.placement, u.cur)
                self.unplace(u)
                self.overflow = None
                found = self.candidates(u)
                self.place(u, *old)  # restore exactly
                if found:
                    key, placement, dense = min(found, key=lambda f: f[0])
                    if key[0] < obj - tol and placement != u.placement and (best is None or key[0] < best[0]):
                        best = (key[0], ("move", u, placement))
            if best is None:
                best = self.best_swap(free, s, obj - tol)
            if best is None:
                return
            action = best[1]
            if action[0] == "move":
                _, u, placement = action
                self.unplace(u)
                self.place(u, placement)
            else:
                _, a, b = action
                ra, rb = a.placement[1], b.placement[1]
                self.unplace(a)
                self.unplace(b)
                self.place(a, (TW, rb))
                self.place(b, (TW, ra))

    def best_swap(self, free: list[_Unit], s: int, target: float):
        st, m = self.state, self.m
        mine = [u for u in free if u.placement[0] == TW and u.placement[1] == s
                and (u.ranks is None)]
        if not mine:
            return None
        others = [u for u in free if u.placement[0] == TW and u.placement[1] != s and u.ranks is None]
        screened = []
        for a in mine:
            ca, pa, ma = self.tw_terms(a)
            own_a = ca + pa * m.S
            for b in others:
                cb, pb, mb = self.tw_terms(b)
                own_b = cb + pb * m.S
                if own_b >= own_a:
                    continue
                r = b.placement[1]
                guess = max(st.tot[s] - own_a + own_b, st.tot[r] - own_b + own_a)
                if guess < target:
                    screened.append((guess, a.index, b.index, a, b))
        screened.sort(key=lambda x: x[:3])
        best = None
        for _, _, _, a, b in screened[:REFINE_SWAPS]:
            ra, rb = a.placement[1], b.placement[1]
            olda, oldb = (a.placement, a.cur), (b.placement, b.cur)
            self.unplace(a)
            self.unplace(b)
            da, db = self.dense(a, (TW, rb)), self.dense(b, (TW, ra))
            fits = all(x + y + z <= self.cap for x, y, z in zip(st.mem, da[1], db[1]))
            new = None
            if fits:
                tot = list(map(lambda t, x, y: t + x + y, st.tot, da[0], db[0]))
                new = max(tot) + st.latency_with(TW)
            self.place(b, *oldb)
            self.place(a, *olda)
            if new is not None and new < target and (best is None or new < best[0]):
                best = (new, ("swap", a, b))
        return best


def _tiebreak(placement: tuple):
    if len(placement) == 1:
        return -1
    x = placement[1]
    return x if isinstance(x, int) else x[0]


def _ranks_of(placement: tuple, m: CostModel) -> tuple[int, ...]:
    kind = placement[0]
    if kind == TW:
        return (placement[1],)
    if kind == CW:
        return tuple(placement[1])
    if kind == TWRW:
        return tuple(range(placement[1] * m.G, (placement[1] + 1) * m.G))
    return tuple(range(m.W))


# ----------------------------------------------------------------------------- the API

def plan_tables(tables: dict[str, TableSpec], cluster: Cluster, *, strategy: str = "auto", batch_size: int,
                bag_sizes: Optional[dict[str, float]] = None, optimizer: str = "sgd",
                constraints: Optional[dict] = None, dense_flops_per_sample: Optional[float] = None,
                check_memory: bool = True) -> Plan:
    """Place every table of ``tables`` on ``cluster``; see the module docstring for the model.

    ``strategy``: ``auto`` or one kind forced on every table. ``bag_sizes``: average ids per bag
    per table (default 1). ``constraints``: ``{"kinds": {table: [kinds]}, "rank": {table: r},
    "node": {table: n}, "together": [[t1, t2, ...]], "plan": {table: ShardSpec | kind}}``.
    ``dense_flops_per_sample``: forward FLOPs of the dense part per sample, for the step estimate.
    ``check_memory=False`` plans as if memory were unlimited (the plan still shows what is over).
    Raises ValueError when the tables cannot fit, naming the table, the rank, by how much, and
    what would make it fit.
    """
    if strategy != "auto" and strategy not in SHARDING_KINDS:
        raise ValueError(f"plan_tables: strategy {strategy!r} is not 'auto' or one of {SHARDING_KINDS}")
    model = CostModel(cluster, batch_size, optimizer)
    bag_sizes = bag_sizes or {}
    profiles = {n: model.profile(t, bag_sizes.get(n, 1.0)) for n, t in tables.items()}
    cons = normalize_constraints(constraints, tables, cluster)

    def search(kind: str, start: Optional[dict[str, ShardSpec]] = None) -> dict[str, ShardSpec]:
        units = _units(tables, profiles, cons, kind, model, cluster)
        srch = _Search(model, tables, units, kind, check_memory)
        if start is not None:
            start = {n: placement_of(tables[n], spec, cluster) for n, spec in start.items()}
        try:
            srch.run(start)
        except _NoFit as e:
            raise ValueError(_no_fit_message(e.args[0], e.args[1], model, tables, profiles, units, cons,
                                             check_memory)) from None
        specs = {}
        for u in units:
            for n in u.names:
                specs[n] = spec_for(tables[n], u.placement, cluster)
        return {n: specs[n] for n in tables}

    notes = []
    reasons = {}
    if strategy == "auto":
        shards = search("auto")
        best = estimate_shards(tables, shards, model, bag_sizes)[3]
        notes.append(f"auto: greedy + refinement {fmt_ms(best * 1e3)} ms")
        tried, uniform, alternatives = [], None, {}
        for kind in SHARDING_KINDS:
            try:
                alt = search(kind)
            except ValueError:
                tried.append(f"{kind} -")
                continue
            alternatives[kind] = alt
            obj = estimate_shards(tables, alt, model, bag_sizes)[3]
            tried.append(f"{kind} {fmt_ms(obj * 1e3)}")
            if uniform is None or obj < uniform[0] * (1 - 1e-9):
                uniform = (obj, kind, alt)
        if uniform is not None and uniform[0] < best * (1 - 1e-9):
            # The best uniform plan beats the greedy one: keep it, then let refinement mix in
            # other kinds where that helps.
            obj, kind, alt = uniform
            refined = search("auto", start=alt)
            robj = estimate_shards(tables, refined, model, bag_sizes)[3]
            best, shards = (robj, refined) if robj < obj * (1 - 1e-9) else (obj, alt)
            notes[0] += (f"; uniform {kind} {fmt_ms(obj * 1e3)} ms is better" +
                         (f", refined to {fmt_ms(robj * 1e3)} ms" if robj < obj * (1 - 1e-9) else "") + ", kept")
        if cluster.world_size > 1:
            notes.append("uniform strategies (ms; - does not fit): " + ", ".join(tried))
            reasons = _table_reasons(tables, shards, alternatives, model, bag_sizes, check_memory, cons)
            notes.append("why = the kind that would come next for that table, and how much slower the plan "
                         "would be with only that table moved to it (its placement in that kind's uniform plan)")
    else:
        shards = search(strategy)
    plan = build_plan(tables, shards, cluster, model, bag_sizes, strategy=strategy,
                      dense_flops_per_sample=dense_flops_per_sample, notes=notes)
    plan.table_reasons = reasons
    return plan


def _table_reasons(tables, shards, alternatives, model: CostModel, bag_sizes, check_memory: bool,
                   cons: dict) -> dict[str, str]:
    """Per table: its runner-up kind and what moving only this table there would cost the plan
    (a kind's placement of it taken from that kind's uniform plan; row_wise and data_parallel,
    which have one placement, also where their uniform plan did not fit), or why no kind could
    take it instead."""
    W = model.W
    comp, comm, mem, base, _ = estimate_shards(tables, shards, model, bag_sizes)
    kinds_now = {spec.kind for spec in shards.values()}
    out = {}
    for name, spec in shards.items():
        t = tables[name]
        p = model.profile(t, (bag_sizes or {}).get(name, 1.0))
        c0, m0, me0 = model.delta(p, placement_of(t, spec, model.cluster))
        rest_kinds = {s.kind for n, s in shards.items() if n != name}
        options = []
        allowed = cons["kinds"].get(name, SHARDING_KINDS)
        for kind in SHARDING_KINDS:
            if kind == spec.kind or kind not in allowed:
                continue
            if kind in alternatives:
                placement = placement_of(t, alternatives[kind][name], model.cluster)
            elif kind == DP or (kind == RW and t.splits_rows_ok):
                placement = (kind,)
            else:
                continue
            c1, m1, me1 = model.delta(p, placement)
            memory = [mem[r] - me0[r] + me1[r] for r in range(W)]
            if check_memory and max(memory) > model.cap:
                options.append((math.inf, kind, "over memory"))
                continue
            lat = model.latency(rest_kinds | {kind}) - model.latency(kinds_now)
            obj = max(comp[r] - c0[r] + c1[r] + comm[r] - m0[r] + m1[r] for r in range(W)) + lat
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
    W = model.W
    comp, comm, mem = [0.0] * W, [0.0] * W, [0.0] * W
    cost = {}
    bag_sizes = bag_sizes or {}
    kinds = set()
    for name, spec in shards.items():
        t = tables[name]
        p = model.profile(t, bag_sizes.get(name, 1.0))
        c, m_, me = model.delta(p, placement_of(t, spec, model.cluster))
        comp = list(map(operator.add, comp, c))
        comm = list(map(operator.add, comm, m_))
        mem = list(map(operator.add, mem, me))
        cost[name] = max(map(operator.add, c, m_)) if W else 0.0
        kinds.add(spec.kind)
    lat = model.latency(kinds)
    comm = [x + lat for x in comm]
    objective = max(map(operator.add, comp, comm)) if shards else 0.0
    return comp, comm, mem, objective, cost


def build_plan(tables: dict[str, TableSpec], shards: dict[str, ShardSpec], cluster: Cluster, model: CostModel,
               bag_sizes: Optional[dict[str, float]] = None, *, strategy: str = "auto",
               dense_flops_per_sample: Optional[float] = None, notes: Optional[list[str]] = None) -> Plan:
    """A ``Plan`` for ``shards`` with the cost model's per-table and per-rank estimates."""
    comp, comm, mem, _, cost = estimate_shards(tables, shards, model, bag_sizes)
    weights = [0.0] * model.W
    for name, spec in shards.items():
        e = ELEM_BYTES.get(tables[name].dtype, 4)
        for r, r0, r1, c0, c1 in spec.shards:
            weights[r] += (r1 - r0) * (c1 - c0) * e
    ranks = [RankEstimate(r, weights[r], mem[r], comp[r] * 1e3, comm[r] * 1e3) for r in range(model.W)]
    slowest = max(range(model.W), key=lambda r: (comp[r] + comm[r], -r))
    dense_ms = 0.0
    if dense_flops_per_sample:
        dense_ms = 3 * dense_flops_per_sample * model.b / (cluster.device.tflops * 1e12) * 1e3
    est = StepEstimate(slowest, comp[slowest] * 1e3, comm[slowest] * 1e3, dense_ms)
    notes = list(notes or [])
    notes.insert(0, f"cluster {cluster.name}: {model.W} rank(s), global batch {int(model.B)}, optimizer "
                    f"{model.optimizer}; memory cap {model.cap / GIB:.2f} GiB per rank "
                    f"({cluster.device.memory_gb:g} GiB less {RESERVED_FRACTION:.0%} reserved); est ms = "
                    f"lookup + communication a table adds to its busiest rank")
    return Plan(world_size=model.W, tables=dict(tables), shards=dict(shards), strategy=strategy,
                table_cost_ms={n: c * 1e3 for n, c in cost.items()}, rank_estimates=ranks,
                memory_cap_bytes=model.cap, estimate=est, notes=notes)


def _no_fit_message(u: _Unit, overflow, model: CostModel, tables, profiles, units, cons, check_memory) -> str:
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
             else f"{kind} over ranks {compress_ranks(_ranks_of(placement, model))}")
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
    return msg + " To make it fit: " + "; or ".join(fixes) + "."


# ----------------------------------------------------------------------------- helpers

def dense_flops_per_sample(module) -> float:
    """Forward FLOPs per sample of a module's ``nn.Linear`` layers (2 * in * out each): a simple
    estimate of the dense part (interactions and activations are ignored)."""
    import torch.nn as nn
    return float(sum(2 * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear)))


def tables_from_preset(cfg: dict) -> tuple[dict[str, TableSpec], dict[str, float]]:
    """TableSpecs and bag sizes of a preset dict (``recc.models.load_preset``) without building
    the model: tables ``emb_l.<i>`` as the presets' models name them."""
    dims = cfg["embedding_dim"]
    bags = cfg["bag_size"]
    tables, bag_sizes = {}, {}
    for i, rows in enumerate(cfg["num_embeddings"]):
        name = f"emb_l.{i}"
        dim = dims[i] if isinstance(dims, list) else dims
        tables[name] = TableSpec(name=name, short=f"t{i}", rows=int(rows), dim=int(dim), pooling="sum",
                                 weight_key=f"{name}.weight")
        bag_sizes[name] = float(bags[i] if isinstance(bags, list) else bags)
    return tables, bag_sizes
