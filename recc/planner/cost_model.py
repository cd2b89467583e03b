"""The planner's cost model: what a placement costs each rank in time and memory.

Notation: ``B`` global batch, ``W`` ranks, ``G`` ranks per node, ``N`` nodes, ``b = B / W`` the
local batch; per table ``L`` ids per bag (its average bag size), ``D`` columns, ``e`` bytes per
weight element; memory bandwidth ``M``; link bandwidths ``bw_intra``/``bw_inter`` and
``inv(q, r)`` = 1/bandwidth of the link between ranks q != r (intra-node if they share a node).
``S = (G-1)/bw_intra + (W-G)/bw_inter`` is the time per byte of talking to every other rank.

- Bytes on the wire: ids ``id(n, L) = n * (8 L + 8)`` for n bags (int64 ids plus one int64 length
  per bag; +4 per id for per-sample weights); pooled outputs ``out(n, D) = n * D * 4``
  (``n * L * D * 4`` for unpooled gathers). Payloads are fp32: ``quantize_comm`` shrinks them later.
- Lookup, forward + backward + fused optimizer, of a shard of ``D`` columns that sees ``n`` ids
  in ``n_b`` bags: ``(n (3 row(D) + 2 s(D)) + 2 n_b (8 + orow(D))) / M``. A row read moves whole
  access granules, ``row(D) = ceil(D e / g) g`` (``g`` = 64 bytes on CPUs, a cache line; 32 on
  GPUs, a DRAM sector), read forward and read + written by the update; ``s(D)`` is the optimizer
  state per row (sgd 0, rowwise_adagrad 4 bytes, adagrad 4 D, adam 8 D), read and written once
  per id. Every bag a shard sees costs its length and its pooled row, written forward and its
  gradient read backward (``orow(D) = ceil(4 D / g) g``; per id for unpooled gathers): the part
  of a shard's cost that does not shrink with its width, so splitting a table is not free.
- TW on rank r: r looks up all ``B L`` ids of ``B`` bags. Per peer q it receives ids
  ``id(b, L)``, sends the pooled forward output and receives its gradient,
  ``p = id(b, L) + 2 out(b, D)``; r pays ``p * S``, every other rank q pays ``p * inv(q, r)``.
- CW: k blocks, each costed as a TW table of ``D / k`` columns (every block owner gets all ids
  and all bags). The planner tries every ``k`` the layout allows (see ``layouts``).
- RW: rank r looks up the ids of its rows (``B L * rows_r / rows``, ids spread uniformly over
  rows) for all ``B`` bags; every pair of ranks exchanges ids both ways (``2 id(b, L / W)``) and
  the reduce-scatter of partial sums plus its backward all-gather (``4 out(b, D)``): every rank
  pays that ``* S``.
- TWRW on node n: as RW inside the node (``L / G``); the node's ranks reduce-scatter partial sums
  inside the node (``4 out(N b, D)`` per node peer) and all-to-all the results with the rank of
  the same local index on every other node (``2 out(b, D)`` per remote peer); each rank outside
  n receives its pooled output from one rank of n over the inter-node link.
- DP, as the runtime does it (``runtime/comm/dp_grads.py``, ``dp_exchange``): no forward communication,
  every rank looks up its local ``b L`` ids. A table with no more rows than the batch has bags
  all-reduces its per-row gradient sums, ``2 (W-1)/W rows (D+1) 4`` bytes over the slowest link
  the world spans, and updates the rows touched (at most ``min(rows, B L)``); a bigger one
  all-gathers every rank's lengths, ids and output gradients (each rank sends ``id(b, L) +
  out(b, D)`` to every peer and receives as much from each: ``2 (id + out) S``) and applies
  the global batch's update (``B L`` ids).
- Latency: each table group runs its own collectives, and ``batch_tables`` groups tables by
  block width, pooling, per-sample weights, dtype and bags per sample, data-parallel and
  two-level ones apart (``collective``): a table adds no latency to a group already in the plan,
  a new width or kind of table adds a group's. A phase over a set of ranks costs the link latency once plus ``message_us`` per
  peer (``Pw = (G-1) msg_intra + (W-G) msg_inter`` over the world): TW, CW and RW 4 world phases
  (ids in two, output forward, gradient backward); TWRW 2 world phases for the ids and, on
  several nodes, its two-level output dist forward and backward (``G-1`` intra-node peers, then
  ``N-1`` inter-node peers); DP a tree all-reduce, ``2 ceil(log2 W)`` steps of one peer each
  (a gathering DP table adds the difference to 6 world phases: lengths, ids and gradients, each
  a size all-gather then the data). At 128 ranks an all-to-all kind's latency is about a
  millisecond, so a plan mixes kinds only where that pays.
- Memory per rank: weights ``rows_r * cols * e`` + optimizer state (sgd none, rowwise_adagrad one
  fp32 per row, adagrad one per element, adam two per element) + on CPU ranks one int32 per row
  (the fused backward's row -> slot map) + buffers (the ids a shard
  receives and its output and gradient; a DP replica's per-row sums, or its gathered ids and
  gradients). The cap is the device
  memory less ``RESERVED_FRACTION`` for the dense model, activations and the runtime.
- Cached shards (``tiers``, only when the tables do not fit or the user forces it): a cache of
  ``S`` slots holds ``S`` rows, their state, slot map and index entries (``cache_bytes``), an
  int32 row -> slot map over the shard's rows and a bounded I/O staging buffer
  (``cache_fixed_bytes``); per step it maps its ids to slots (``cache_map_s``) and reads
  each missing row and writes back the row it evicts at the storage tier's rate (``tier_row_s``).

- BatchNorm with global statistics (``sync_batchnorm``, dense side, the same on every rank): a
  layer of ``C`` channels all-reduces ``2C + 1`` fp32 sums forward and ``2C`` gradient sums
  backward, ``2 (W-1)/W (4C + 1) 4`` bytes sent per rank per step over the slowest link the world
  spans, and pays DP's tree all-reduce latency (``2 ceil(log2 W)`` one-peer steps) twice
  (``batchnorm_sync``). The plan reports it in its notes; it does not move tables.

A rank's estimated time is the sum of its shards' lookup time and its communication; the
objective is the slowest rank's time plus the plan's collective latencies. Links are taken to
serialise (NVLink and NIC traffic add up), a conservative bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from recc.cluster import Cluster
from recc.planner.layouts import CW, DP, RW, TW, TWRW
from recc.specs import SHARDING_KINDS, TableSpec

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
ID_BYTES = 8          # int64 ids
LENGTH_BYTES = 8      # one int64 length (offset) per bag
PSW_BYTES = 4         # fp32 per-sample weight per id
OUT_BYTES = 4         # fp32 pooled outputs and their gradients
RESERVED_FRACTION = 0.10   # of device memory, for the dense model, activations and the runtime
SLOT_MAP_BYTES = 4         # per weight row on CPU ranks: the fused backward's row -> slot map
ACCESS_BYTES = {"cpu": 64, "cuda": 32}   # a memory access moves this much: a cache line, a DRAM sector
PHASES = {TW: 4, CW: 4, RW: 4}          # world-wide collective phases per step
DP_GATHER_PHASES = 6                     # lengths, ids, gradients: each a size all-gather, then the data
GIB = 2 ** 30
# A cached shard's index as runtime/table_cache.py keeps it (kernels/cpu/table_cache.py
# CacheIndex): per slot its row and newest pinning batch (int64 each) and CLOCK's reference and
# dirty bytes; per row of the shard an int32 row -> slot map and, for a disk store (a log,
# RowStore), an int32 row -> position (each record on disk ends with its row's id instead of an
# in-memory position -> row map: STORE_ROW_ID_BYTES). Its store I/O reads and writes the slots in place; filling the store at start stages
# at most CACHE_IO_BUFFER_BYTES (8 MiB) of rows, cleaning one segment (SEGMENT_BYTES, 1 MiB). The
# fill's staging is one buffer per group at a time, counted per shard here: an over-estimate of
# at most 8 MiB per further cached shard on a rank (bench/memory.py: measured 0.93-0.97 of it).
# A disk store's positions beyond its rows, as a share of them (RowStore), and the bytes its
# cleaning then moves (read, and written again) per byte written back. Evictions are spread over
# the cold rows, so the log's segments die slowly and evenly: replaying bench/tiered_tables.py's
# write-back stream (Zipf 1.05, a 1.7% cache) through the log's bookkeeping, cleaning settles at
# ~1.9x the written bytes with 25% spare, ~0.8-1.0x with 50%, ~0.45x with 100% (separating the
# cleaned records from the written-back ones changed nothing: the stream has no hot set left).
STORE_SPARE = 0.5
LOG_CLEANING = 1.0
CACHE_SLOT_BYTES = 18
CACHE_ROW_MAP_BYTES = 4
STORE_ROW_BYTES = 4
STORE_ROW_ID_BYTES = 8
CACHE_IO_BUFFER_BYTES = 8 * 2 ** 20



def dp_exchange(rows: int, dim: int, batch: float, pooling: str) -> str:
    """How a data-parallel table's (or group's) backward reaches every replica (``runtime/comm/dp_grads.py``):
    ``dp_grad_allreduce`` of its per-row gradient sums (``rows x (D + 1)`` fp32) while that is no
    larger than what gathering the batch would move (every bag's fp32 gradient and at least one
    id and length, ``B (4 D + 16)`` bytes); else, and for max pooling (whose winners are per
    bag), ``dp_grad_allgather``."""
    if pooling in ("sum", "mean") and rows * (dim + 1) * 4 <= batch * (4 * dim + 16):
        return "dp_grad_allreduce"
    return "dp_grad_allgather"


def state_row_bytes(optimizer: str, cols: int) -> int:
    """Optimizer state per table row, bytes."""
    return {"sgd": 0, "rowwise_adagrad": 4, "adagrad": 4 * cols, "adam": 8 * cols}[optimizer]


@dataclass(frozen=True)
class Profile:
    """What the cost model needs to know about one table."""

    name: str
    rows: int
    dim: int
    bag: float       # ids per bag (per sample)
    pooling: str     # sum, mean, max, or none (a gather: one output row per id)
    id_bytes: int    # per id on the wire
    elem: int        # bytes per weight element

    @property
    def pooled(self) -> bool:
        return self.pooling != "none"


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
        self.rank_node = np.asarray(self.node, dtype=np.intp)
        self._links: dict[tuple, tuple] = {}   # _block_links of one owner
        self.granule = ACCESS_BYTES[cluster.device_type]
        slow = cluster.inter_node if self.N > 1 else cluster.intra_node
        self.i_slow = 1.0 / (slow.bw_gbps * 1e9) if self.W > 1 else 0.0
        self.kind_latency, self.gather_latency = self._latencies(cluster)

    def _latencies(self, cluster: Cluster) -> tuple[dict[str, float], float]:
        """Each kind's collective latency per step, and a gathering DP table's."""
        W, G, N = self.W, self.G, self.N
        if W == 1:
            return {k: 0.0 for k in SHARDING_KINDS}, 0.0
        us = 1e-6
        intra, inter = cluster.intra_node, cluster.inter_node
        world_lat = (inter if N > 1 else intra).latency_us * us
        world = world_lat + ((G - 1) * intra.message_us + (W - G) * inter.message_us) * us
        out = {k: n * world for k, n in PHASES.items()}
        # DP's all-reduce (NCCL and gloo pick a tree or halving-doubling for small buffers):
        # ceil(log2 W) steps each way, one peer per step.
        step = world_lat + (inter.message_us if N > 1 else intra.message_us) * us
        out[DP] = 2 * math.ceil(math.log2(W)) * step
        if N > 1:  # two-level output dist: inside the node, then across nodes; forward and backward
            inside = intra.latency_us * us + (G - 1) * intra.message_us * us if G > 1 else 0.0
            across = inter.latency_us * us + (N - 1) * inter.message_us * us
            out[TWRW] = 2 * world + 2 * (inside + across)
        else:
            out[TWRW] = 4 * world
        return out, DP_GATHER_PHASES * world

    # -- building blocks
    def profile(self, t: TableSpec, bag: float) -> Profile:
        return Profile(t.name, t.rows, t.dim, float(bag), t.pooling,
                       ID_BYTES + (PSW_BYTES if t.weighted else 0), ELEM_BYTES.get(t.dtype, 4))

    def ids(self, p: Profile, bags: float, ids_per_bag: float) -> float:
        return bags * (ids_per_bag * p.id_bytes + LENGTH_BYTES)

    def out(self, p: Profile, bags: float, cols: int) -> float:
        return bags * cols * OUT_BYTES * (1.0 if p.pooled else p.bag)

    def _granules(self, nbytes: float) -> float:
        return math.ceil(nbytes / self.granule) * self.granule

    def lookup_s(self, p: Profile, n_ids: float, bags: float, cols: int, optimizer: Optional[str] = None,
                 bwd: Optional[tuple[float, float]] = None) -> float:
        """Forward of ``n_ids`` ids in ``bags`` bags, then backward + update of ``bwd = (ids,
        bags)`` (the same unless given) over ``cols`` columns of a shard."""
        row = self._granules(cols * p.elem)
        per_bag = LENGTH_BYTES + self._granules(cols * OUT_BYTES)
        n_b, bags_b = bwd if bwd is not None else (n_ids, bags)
        if not p.pooled:  # a gather writes one output row per id
            bags, bags_b = n_ids, n_b
        state = state_row_bytes(optimizer or self.optimizer, cols)
        fwd = n_ids * row + bags * per_bag
        back = n_b * (2 * row + 2 * state) + bags_b * per_bag
        return (fwd + back) / self.mem_bw

    def table_bytes(self, p: Profile, rows: int, cols: int, optimizer: Optional[str] = None) -> float:
        return rows * (cols * p.elem + state_row_bytes(optimizer or self.optimizer, cols))

    def resident_bytes(self, p: Profile, rows: int, cols: int, optimizer: Optional[str] = None) -> float:
        """What a shard of ``rows`` x ``cols`` holds on its rank: weights, state, the slot map."""
        return self.table_bytes(p, rows, cols, optimizer) + rows * self.slot_bytes

    # -- cached shards (``tiers``): a cache of slots in memory in front of a store in the storage tier
    def cache_bytes(self, p: Profile, slots: int, cols: int) -> float:
        """What ``slots`` cache slots of ``cols`` columns hold: each a row and its optimizer state,
        the backward's slot map (the lookup runs on slots), and the index's per-slot entries."""
        return self.resident_bytes(p, slots, cols) + slots * CACHE_SLOT_BYTES

    def store_bytes(self, p: Profile, rows: int, cols: int) -> float:
        """What a cached shard's store holds in the storage tier: every row, and on disk each
        record's row id and the log's spare positions (``STORE_SPARE``; its four extra
        segments, 4 MiB, not counted)."""
        if self.cluster.storage.kind != "disk":
            return self.table_bytes(p, rows, cols)
        return (self.table_bytes(p, rows, cols) + rows * STORE_ROW_ID_BYTES) * (1 + STORE_SPARE)

    def cache_fixed_bytes(self, p: Profile, shard_rows: int, cols: int) -> float:
        """What a cached shard holds whatever its slots: the index's row -> slot map (one int32
        per row of the shard), a disk store's log index, and the staging of its store I/O
        (bounded, not the table)."""
        per_row = CACHE_ROW_MAP_BYTES + (STORE_ROW_BYTES if self.cluster.storage.kind == "disk" else 0)
        return shard_rows * per_row + min(CACHE_IO_BUFFER_BYTES, self.table_bytes(p, shard_rows, cols))

    def tier_row_s(self, row_bytes: float) -> float:
        """Seconds the storage tier takes to fetch one missing row of ``row_bytes`` (weights and
        state) and write back the dirty row it evicts: a random read, and, on disk, a sequential
        append to the store's log plus the cleaning it brings (``LOG_CLEANING`` of it read and
        written again); host memory writes the row in place."""
        st = self.cluster.storage
        if st.kind != "disk":
            return st.row_read_s(row_bytes) + st.row_write_s(row_bytes)
        return (st.row_read_s(row_bytes) + st.row_append_s(row_bytes) * (1 + LOG_CLEANING)
                + LOG_CLEANING * row_bytes / (st.read_gbps * 1e9))

    def cache_map_s(self, n_ids: float) -> float:
        """Mapping ``n_ids`` ids to slots: a hash probe per id (an access granule read) and its
        slot written."""
        return n_ids * (self.granule + ID_BYTES) / self.mem_bw

    def inv(self, q: int, r: int) -> float:
        if q == r:
            return 0.0
        return self.ii if self.node[q] == self.node[r] else self.ie

    def tw_terms(self, p: Profile, cols: int, optimizer: Optional[str] = None) -> tuple[float, float, float]:
        """``(lookup_s, per-peer bytes, memory)`` of a table-wise block of ``cols`` columns."""
        c = self.lookup_s(p, self.B * p.bag, self.B, cols, optimizer)
        peer = self.ids(p, self.b, p.bag) + 2 * self.out(p, self.b, cols)
        mem = (self.resident_bytes(p, p.rows, cols, optimizer) + self.ids(p, self.B, p.bag)
               + 2 * self.out(p, self.B, cols))
        return c, peer, mem

    # -- per-rank deltas
    def delta(self, p: Profile, placement: tuple, optimizer: Optional[str] = None):
        """Per-rank lists ``(lookup_s, comm_s, memory_bytes)`` that a table adds in ``placement``."""
        return tuple(a.tolist() for a in self.delta_arrays(p, placement, optimizer))

    def delta_arrays(self, p: Profile, placement: tuple, optimizer: Optional[str] = None):
        """``delta`` as arrays over ranks. Each rank's value is the same expression, evaluated in
        the same order, as one rank at a time in Python, so the same floats: the planner's ties
        are exact."""
        W, kind = self.W, placement[0]
        if kind == DP and W == 1:  # one replica: the runtime runs it as the table-wise table it is
            placement, kind = (TW, 0), TW
        node = self.rank_node
        if kind in (TW, CW):
            owners = (placement[1],) if kind == TW else tuple(placement[1])
            c, peer, m = self.tw_terms(p, p.dim // len(owners), optimizer)
            at, links, own_links = self._block_links(owners)
            comm = peer * links
            comm[at] = peer * self.S + peer * own_links
            comp, mem = np.zeros(W), np.zeros(W)
            comp[at] = c
            mem[at] = m
        elif kind in (RW, TWRW):
            parts = W if kind == RW else self.G
            base = 0 if kind == RW else placement[1] * self.G
            idb = self.ids(p, self.b, p.bag / parts)
            comp, comm, mem = np.zeros(W), np.zeros(W), np.zeros(W)
            # row_blocks: ``full`` blocks of ``size`` rows, then one of the rest (if any)
            size = -(-p.rows // parts)
            full = p.rows // size if size else 0
            for lo, hi, rows in ((base, base + full, size), (base + full, base + full + 1, p.rows - full * size)):
                if rows > 0 and hi > lo:
                    f = rows / p.rows
                    comp[lo:hi] = self.lookup_s(p, self.B * p.bag * f, self.B, p.dim, optimizer)
                    mem[lo:hi] = (self.resident_bytes(p, rows, p.dim, optimizer) + self.ids(p, self.B * f, p.bag)
                                  + 2 * self.out(p, self.B, p.dim) * (1.0 if p.pooled else f))
            if kind == RW:
                pair = 2 * idb + (4 * self.out(p, self.b, p.dim) * (1.0 if p.pooled else 1.0 / W))
                comm[:] = pair * self.S
            else:
                n = placement[1]
                home = node == n
                group = slice(base, base + parts)
                to_node_in, to_node_out = (self.G - 1) * self.ii, self.G * self.ie
                # every rank sends its bags' ids to the node's ranks
                comm = comm + np.where(home, idb * to_node_in, idb * to_node_out)
                ob = self.out(p, self.b, p.dim)
                comm[group] += idb * self.S
                if p.pooled:
                    inside = 4 * self.out(p, self.N * self.b, p.dim) * (self.G - 1) * self.ii
                    across = 2 * ob * (self.N - 1) * self.ie
                    comm = comm + np.where(home, inside + across, 2 * ob * self.ie)
                else:  # gathers: each owner returns its rows' vectors to every batch owner
                    ob /= self.G
                    comm = comm + np.where(home, 2 * ob * to_node_in, 2 * ob * to_node_out)
                    comm[group] += 2 * ob * self.S
        else:  # DP: forward on the local bags; backward as ``dp_exchange`` says the runtime does it
            fwd_ids = self.b * p.bag
            if dp_exchange(p.rows, p.dim, self.B, p.pooling) == "dp_grad_allreduce":
                touched = min(p.rows, self.B * p.bag)
                buf = p.rows * (p.dim + 1) * OUT_BYTES
                c = (self.lookup_s(p, fwd_ids, self.b, p.dim, optimizer, bwd=(touched, touched))
                     + 3 * buf / self.mem_bw)  # the per-row sums: zeroed, accumulated, read back
                ex = 2 * (W - 1) / W * buf * self.i_slow
                m = self.resident_bytes(p, p.rows, p.dim, optimizer) + buf
            else:
                c = self.lookup_s(p, fwd_ids, self.b, p.dim, optimizer, bwd=(self.B * p.bag, self.B))
                # and its collectives: 6 world phases where the all-reduce took a tree's
                ex = (2 * (self.ids(p, self.b, p.bag) + self.out(p, self.b, p.dim)) * self.S
                      + max(0.0, self.gather_latency - self.kind_latency[DP]))
                m = (self.resident_bytes(p, p.rows, p.dim, optimizer) + self.ids(p, self.B, p.bag)
                     + self.out(p, self.B, p.dim))
            comp, comm, mem = np.full(W, c, dtype=float), np.full(W, ex, dtype=float), np.full(W, m, dtype=float)
        return comp, comm, mem

    def _block_links(self, owners: tuple[int, ...]):
        """``(owners, links, own_links)`` of k blocks on ``owners``: per rank the seconds per byte
        of its traffic with every owner, ``per_node[n] ii + (k - per_node[n]) ie`` (a rank's
        traffic depends only on its node and whether it owns a block), and for the owners the
        same less themselves, ``(per_node[n] - 1) ii + (k - per_node[n]) ie``. Kept for the
        table-wise owners (W of them), the placements asked for most."""
        hit = self._links.get(owners)
        if hit is not None:
            return hit
        node = self.rank_node
        at = np.asarray(owners, dtype=np.intp)
        k = len(owners)
        per_node = np.bincount(node[at], minlength=self.N)
        links = (per_node * self.ii + (k - per_node) * self.ie)[node]
        pn = per_node[node[at]]
        out = (at, links, (pn - 1) * self.ii + (k - pn) * self.ie)
        if k == 1:
            self._links[owners] = out
        return out

    def batchnorm_sync(self, channels: int) -> tuple[float, float, float]:
        """``(bytes sent per rank per step, seconds per step, latency per collective)`` of one
        BatchNorm layer of ``channels`` channels whose statistics are all-reduced: the forward's
        ``2C+1`` sums and the backward's ``2C`` gradient sums, fp32, as a ring sends them."""
        if self.W == 1:
            return 0.0, 0.0, 0.0
        sent = 2 * (self.W - 1) / self.W * (4 * channels + 1) * OUT_BYTES
        latency = self.kind_latency[DP]
        return sent, sent * self.i_slow + 2 * latency, latency

    def collective(self, p: Profile, placement: tuple) -> tuple:
        """The collectives a table joins in ``placement``: ``batch_tables`` puts tables with the
        same key (block width, pooling, per-sample weights, dtype, bags per sample, and whether
        they are data-parallel or two-level) in one group, whose dists run once per step for all
        of them; each group pays its latency once. ``(kind whose latency it pays, key...)``."""
        kind = placement[0]
        if kind == DP and self.W == 1:
            kind = TW
        pays = DP if kind == DP else TWRW if kind == TWRW and self.N > 1 else TW
        width = p.dim // len(placement[1]) if kind == CW else p.dim
        return (pays, width, "sum" if p.pooling == "none" else p.pooling, p.id_bytes, p.elem,
                1.0 if p.pooled else p.bag)

    def latency(self, collectives: Iterable[tuple]) -> float:
        # summed in sorted order, so every process adds the same floats
        return sum(self.kind_latency[c[0]] for c in sorted(set(collectives)))
