"""Plain-value annotations that passes attach to graph nodes.

Passes communicate through these (``node.meta["recc.table"]``, ``node.meta["recc.shard"]``,
``node.meta["recc.comm"]``) rather than through side tables, so a user reading or writing a
pass sees every decision on the node it concerns. All are frozen dataclasses: a later pass
replaces an annotation, it never mutates one that an earlier stage's graph still shows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

POOLINGS = ("sum", "mean", "max", "none")
WEIGHT_DECAY_MODES = ("l2", "decoupled")
ADAM_EPS = ("after_bias_correction", "before_bias_correction")
SHARDING_KINDS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
_SHORT_KIND = {"table_wise": "tw", "row_wise": "rw", "column_wise": "cw",
               "table_row_wise": "twrw", "data_parallel": "dp"}
# Wire codecs (CommSpec.precision) that are plain casts: the wire holds the values as that dtype,
# so a pass may swap one for another and strided copies encode and decode them in place; the
# block-scaled int8 and fp8 codecs are not. recc.kernels.codecs implements each (its _CASTS).
CAST_PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class TableSpec:
    """One logical embedding table of the user's model.

    ``name`` is the module path of the table's weight owner (``emb_l.0``), the key users see in
    ``state_dict`` (``weight_key``). ``short`` is the compact id (``t0``) the IR printer uses.
    ``pooling`` is ``sum``/``mean``/``max`` for bags and ``none`` for ``nn.Embedding``-style
    gathers (run as sum-pooled bags of one id; the planner costs their output as one row per id).
    Mean and max bags cannot be assembled from row blocks' partial results: they are never split
    by rows (``splits_rows_ok``).
    """

    name: str
    short: str
    rows: int
    dim: int
    pooling: str
    weight_key: str
    weighted: bool = False  # called with per_sample_weights
    dtype: str = "f32"       # as stored (CompileConfig.table_dtype, else user_dtype)
    user_dtype: str = "f32"  # the user's module's: its lookups' output and state_dict's dtype
    # A gather whose id count is not a fixed multiple of the batch (TorchRec's EmbeddingCollection
    # over variable-length features): each rank looks up a different number of rows.
    jagged: bool = False
    # How the user's module initialises it (for tables built on meta, ``recc.runtime.table_init``):
    # "normal" (nn.Embedding / nn.EmbeddingBag) or "torchrec" (a TorchRec collection's default).
    init: str = "normal"
    padding_idx: Optional[int] = None

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name}: pooling {self.pooling!r} not in {POOLINGS}")

    @property
    def splits_rows_ok(self) -> bool:
        """Whether row blocks' pooled partial results add up to the bag (sum bags and gathers)."""
        return self.pooling in ("sum", "none")

    def describe(self) -> str:
        w = ",weighted" if self.weighted else ""
        j = ",jagged" if self.jagged else ""
        d = f",{self.user_dtype}" if self.user_dtype != "f32" else ""
        return f"{self.short}={self.name}[{self.rows}x{self.dim},{self.pooling}{w}{j}{d}]"


@dataclass(frozen=True)
class ShardSpec:
    """Where (parts of) one table live.

    ``shards`` lists ``(rank, row_start, row_end, col_start, col_end)`` blocks. A table-wise
    placement is a single block covering the table; data-parallel lists one full block per rank.
    """

    table: str
    kind: str
    shards: tuple[tuple[int, int, int, int, int], ...]

    def __post_init__(self):
        if self.kind not in SHARDING_KINDS:
            raise ValueError(f"table {self.table}: sharding kind {self.kind!r} not in {SHARDING_KINDS}")

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({s[0] for s in self.shards}))

    def local_shards(self, rank: int):
        return [s for s in self.shards if s[0] == rank]

    def describe(self) -> str:
        parts = []
        for r, r0, r1, c0, c1 in self.shards:
            parts.append(f"r{r}[{r0}:{r1},{c0}:{c1}]")
        return f"{_SHORT_KIND[self.kind]}@" + "+".join(parts)


PLACEMENTS = ("resident", "cached")


@dataclass(frozen=True)
class TierSpec:
    """Which memory tier one table's shards live in (``shard_tables`` decides; ``cache_tables``
    and the runtime follow it).

    ``resident``: every row of every shard in the rank's memory. ``cached``: each shard keeps a
    fixed budget of slots (rows and their optimizer state) in the rank's memory, in front of a
    backing store in the slower tier (files on local disk under a CPU rank) that holds every row.
    ``cache_rows`` is the table's budget, split over its shards in proportion to their rows
    (``shard_cache_rows``); ``hit_rate`` the expected share of looked-up rows found in the cache;
    ``reason`` why this placement (the plan prints it).
    """

    table: str
    placement: str = "resident"
    cache_rows: int = 0
    hit_rate: float = 1.0
    reason: str = ""

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"table {self.table}: placement {self.placement!r} not in {PLACEMENTS}")
        if self.placement == "cached" and self.cache_rows < 1:
            raise ValueError(f"table {self.table}: a cached placement needs cache_rows >= 1, got {self.cache_rows}")

    @property
    def cached(self) -> bool:
        return self.placement == "cached"

    def shard_cache_rows(self, shard_rows: int, table_rows: int) -> int:
        """Slots of a shard of ``shard_rows`` of the table's ``table_rows``: its share of
        ``cache_rows``, rounded up, never more than the shard's rows."""
        if not self.cached:
            return shard_rows
        return max(1, min(shard_rows, -(-self.cache_rows * shard_rows // max(1, table_rows))))

    def describe(self) -> str:
        if not self.cached:
            return "resident"
        return f"cached({self.cache_rows} rows, hit~{self.hit_rate:.0%})"


@dataclass(frozen=True)
class CommSpec:
    """One collective: which op, over which group, with which split sizes and payload dtype.

    ``splits`` are per-rank element counts along ``split_dim`` as traced on the example batch
    (the runtime recomputes them from the actual batch); the verifier checks they add up to the
    payload's size. Embedding distributions also carry their group's ``layout``: every shard as
    ``(table index, rank, row0, row1, col0, col1)`` (the same on every rank), the logical
    tables' ``dims`` and ``rows``, so each rank can work out what it sends and receives.
    """

    op: str
    group: tuple[int, ...]
    splits: Optional[tuple[int, ...]] = None
    split_dim: int = 0
    precision: str = "fp32"
    layout: tuple[tuple[int, int, int, int, int, int], ...] = ()
    dims: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()
    width: int = 0  # the group's shard width (columns per shard in the pooled payload)
    grad_precision: str = "fp32"  # wire codec of the backward exchange (set by quantize_comm)
    name: str = ""  # the collective's label in reports, e.g. "output_dist g0"
    labels: tuple[str, ...] = ()  # the layout's tables as the IR names them (t0, t2, ...)
    # Output dist of table-row-wise tables on several nodes: ranks form nodes of this many; the
    # partial sums are reduce-scattered inside each node, then all-to-all'd across nodes
    # between ranks of the same local index. 0: one flat exchange.
    node_size: int = 0

    def describe(self) -> str:
        s = f"{self.op} over {list(self.group)}"
        if self.splits is not None:
            s += f" splits={list(self.splits)}"
        if (self.precision, self.grad_precision) != ("fp32", "fp32"):
            s += f" {self.precision}/{self.grad_precision}"
        if self.node_size:
            s += f" two-level(reduce-scatter in nodes of {self.node_size}, then across nodes)"
        if self.layout:
            parts = []
            for k, r, r0, r1, c0, c1 in self.layout:
                whole_rows = (r0, r1) == (0, self.rows[k]) if self.rows else True
                whole_cols = (c0, c1) == (0, self.dims[k]) if self.dims else True
                blk = "" if whole_rows and whole_cols else (
                    f"[{r0}:{r1}]" if whole_cols else f"[:,{c0}:{c1}]" if whole_rows else f"[{r0}:{r1},{c0}:{c1}]")
                parts.append(f"{self.labels[k] if self.labels else f't{k}'}{blk}->r{r}")
            s += ": " + " ".join(parts)
        return s


@dataclass(frozen=True)
class OptimizerSpec:
    """The sparse optimizer fused into a table group's backward.

    ``weight_decay_mode``: ``l2`` adds ``weight_decay * w`` to the gradient (and so to the
    optimizer state); ``decoupled`` (FBGEMM's DECOUPLE, torch's AdamW) shrinks the row by
    ``1 - lr * weight_decay`` apart from the gradient. ``adam_eps``: where adam adds eps —
    ``after_bias_correction`` (the default: ``sqrt(v / (1 - b2^t)) + eps``, torch.optim.Adam/AdamW
    and FBGEMM) or ``before_bias_correction`` (``sqrt(v) + eps`` then the correction,
    torch.optim.SparseAdam)."""

    name: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    weight_decay_mode: str = "l2"
    adam_eps: str = "after_bias_correction"

    def __post_init__(self):
        if self.weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(f"weight_decay_mode {self.weight_decay_mode!r} not in {WEIGHT_DECAY_MODES}")
        if self.adam_eps not in ADAM_EPS:
            raise ValueError(f"adam_eps {self.adam_eps!r} not in {ADAM_EPS}")

    def eps_at(self, step: int) -> float:
        """The eps the kernels' formula (eps after the bias correction) takes at 1-based ``step``:
        SparseAdam's eps before the correction is that formula with ``eps / sqrt(1 - b2^step)``."""
        if self.name == "adam" and self.adam_eps == "before_bias_correction":
            return self.eps / math.sqrt(1.0 - self.beta2 ** step)
        return self.eps

    def describe(self) -> str:
        extra = ""
        if self.weight_decay:
            extra += f", weight_decay={self.weight_decay:g}" + (" decoupled" if self.weight_decay_mode == "decoupled" else "")
        if self.name == "adam" and self.adam_eps != "after_bias_correction":
            extra += ", eps before bias correction"
        return f"{self.name}(lr={self.lr:g}{extra})"


def fmt_ms(ms: float) -> str:
    """Milliseconds with three significant digits (``2.58``, ``0.0123``, ``7.68e-05``)."""
    return f"{ms:.3g}"


def compress_ranks(ranks) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (sorted, ranges of consecutive ranks)."""
    out, run = [], []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def shard_shapes(spec: ShardSpec) -> str:
    """Shard shapes grouped by shape, e.g. ``r0-126:312500x128, r127:312436x128``."""
    groups: dict[str, list[int]] = {}
    for r, r0, r1, c0, c1 in spec.shards:
        groups.setdefault(f"{r1 - r0}x{c1 - c0}", []).append(r)
    return ", ".join(f"r{compress_ranks(ranks)}:{shape}" for shape, ranks in groups.items())


@dataclass(frozen=True)
class RankEstimate:
    """What the cost model expects of one rank: its memory and its share of a training step."""

    rank: int
    weight_bytes: float   # table weights held by the rank
    memory_bytes: float   # weights + optimizer state + lookup/communication buffers
    lookup_ms: float      # forward + backward + optimizer of its shards (memory-bandwidth bound)
    comm_ms: float        # its input/output dists, DP gradient reduction, collective latencies
    io_ms: float = 0.0    # its cached shards' storage-tier I/O and id -> slot mapping
    store_bytes: float = 0.0  # its cached shards' stores in the storage tier (every row and its state)

    @property
    def total_ms(self) -> float:
        return self.lookup_ms + self.comm_ms + self.io_ms


@dataclass(frozen=True)
class StepEstimate:
    """The estimated training step on the slowest rank: lookup + communication + dense compute,
    added up (no overlap assumed; pipelining can hide part of the communication)."""

    slowest_rank: int
    lookup_ms: float
    comm_ms: float
    dense_ms: float = 0.0
    io_ms: float = 0.0    # cached shards' storage-tier I/O (all of it: no overlap with the step assumed)

    @property
    def sparse_ms(self) -> float:
        """The planner's objective: the slowest rank's embedding time (lookup + communication,
        + its cached shards' I/O)."""
        return self.lookup_ms + self.comm_ms + self.io_ms

    @property
    def total_ms(self) -> float:
        return self.lookup_ms + self.comm_ms + self.dense_ms + self.io_ms

    def describe(self) -> str:
        io = f" + tier I/O {fmt_ms(self.io_ms)} ms" if self.io_ms else ""
        return (f"step estimate (slowest rank {self.slowest_rank}): lookup {fmt_ms(self.lookup_ms)} ms + "
                f"communication {fmt_ms(self.comm_ms)} ms + dense {fmt_ms(self.dense_ms)} ms{io} = "
                f"{fmt_ms(self.total_ms)} ms")


@dataclass
class Plan:
    """The sharding plan: one ShardSpec per table (logical name -> spec), plus the cost model's
    estimates when a planner made it (``table_cost_ms``, ``rank_estimates``, ``estimate``)."""

    world_size: int
    tables: dict[str, TableSpec] = field(default_factory=dict)
    shards: dict[str, ShardSpec] = field(default_factory=dict)
    strategy: str = "auto"
    table_cost_ms: dict[str, float] = field(default_factory=dict)  # time each table adds to its busiest rank
    rank_estimates: list[RankEstimate] = field(default_factory=list)
    memory_cap_bytes: Optional[float] = None                      # per rank, after the reserve
    estimate: Optional[StepEstimate] = None
    notes: list[str] = field(default_factory=list)               # how the planner chose, caveats
    # Why each table got its kind: the runner-up kind and how much slower the plan would be
    # with only this table moved to it (or why that kind cannot take it).
    table_reasons: dict[str, str] = field(default_factory=dict)
    # Each table's memory tier (``TierSpec``); a table missing here is resident.
    tiers: dict[str, TierSpec] = field(default_factory=dict)

    def tier(self, table: str) -> TierSpec:
        return self.tiers.get(table) or TierSpec(table)

    @property
    def slowest_rank_ms(self) -> Optional[float]:
        """The estimated embedding time (lookup + communication) of the slowest rank."""
        return None if self.estimate is None else self.estimate.sparse_ms

    def __str__(self) -> str:
        why = bool(self.table_reasons)
        # Tier columns only when some table is cached: an all-resident plan prints as it always has.
        tiered = any(t.cached for t in self.tiers.values())
        rows = [("table", "rows x dim", "kind", "ranks", "shards", "est ms") + (("why (next best kind)",) if why else ())
                + (("tier", "cache rows", "hit", "tier why") if tiered else ())]
        for name, spec in self.shards.items():
            t = self.tables[name]
            cost = self.table_cost_ms.get(name)
            tier = self.tier(name)
            rows.append((name, f"{t.rows}x{t.dim}", spec.kind, compress_ranks(spec.ranks), shard_shapes(spec),
                         "-" if cost is None else fmt_ms(cost)) + ((self.table_reasons.get(name, ""),) if why else ())
                        + ((tier.placement, str(tier.cache_rows) if tier.cached else "-",
                            f"{tier.hit_rate:.1%}" if tier.cached else "-", tier.reason) if tiered else ()))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"# sharding plan: {len(self.shards)} tables over {self.world_size} rank(s), strategy={self.strategy}"]
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(f"# {note}" for note in self.notes)
        if self.rank_estimates:
            gib = 2 ** 30
            cap = self.memory_cap_bytes
            slowest = self.estimate.slowest_rank if self.estimate is not None else None
            runs: list[tuple[list[int], str]] = []  # consecutive ranks that print alike share a line
            for e in self.rank_estimates:
                mem = f"memory {e.memory_bytes / gib:.2f}" + (f" / {cap / gib:.2f} GiB" if cap else " GiB")
                if cap and e.memory_bytes > cap:
                    mem += " OVER"
                disk = f", store {e.store_bytes / gib:.2f} GiB" if e.store_bytes else ""
                io = f", tier I/O {fmt_ms(e.io_ms)}" if e.io_ms else ""
                text = (f"table weights {e.weight_bytes / 2**20:.2f} MiB, {mem}{disk}, "
                        f"est {fmt_ms(e.total_ms)} ms (lookup {fmt_ms(e.lookup_ms)}, comm {fmt_ms(e.comm_ms)}{io})")
                if e.rank == slowest:
                    text += "  <- slowest"
                if runs and runs[-1][1] == text and runs[-1][0][-1] == e.rank - 1 and e.rank != slowest:
                    runs[-1][0].append(e.rank)
                else:
                    runs.append(([e.rank], text))
            for ranks, text in runs:
                lines.append((f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}")
                             + f": {text}")
            if self.estimate is not None:
                lines.append("# " + self.estimate.describe())
        else:
            per_rank = {}
            for name, spec in self.shards.items():
                for r, r0, r1, c0, c1 in spec.shards:
                    per_rank[r] = per_rank.get(r, 0) + (r1 - r0) * (c1 - c0) * 4
            for r in range(self.world_size):
                lines.append(f"rank {r}: table weights {per_rank.get(r, 0) / 2**20:.2f} MiB")
        return "\n".join(lines)

    __repr__ = __str__


def _register_with_fx() -> None:
    """Let graphs carry specs as call arguments: fx writes ``CommSpec(...)`` into the generated
    forward, which then needs the name in its globals."""
    from torch.fx.graph import _register_custom_builtin
    _register_custom_builtin("CommSpec", "from recc.specs import CommSpec", CommSpec)


_register_with_fx()
