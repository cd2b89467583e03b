"""Plain-value annotations that passes attach to graph nodes.

Passes communicate through these (``node.meta["recc.table"]``, ``node.meta["recc.shard"]``,
``node.meta["recc.comm"]``) rather than through side tables, so a user reading or writing a
pass sees every decision on the node it concerns. All are frozen dataclasses: a later pass
replaces an annotation, it never mutates one that an earlier stage's graph still shows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

POOLINGS = ("sum", "mean", "none")
SHARDING_KINDS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
_SHORT_KIND = {"table_wise": "tw", "row_wise": "rw", "column_wise": "cw",
               "table_row_wise": "twrw", "data_parallel": "dp"}


@dataclass(frozen=True)
class TableSpec:
    """One logical embedding table of the user's model.

    ``name`` is the module path of the table's weight owner (``emb_l.0``), the key users see in
    ``state_dict`` (``weight_key``). ``short`` is the compact id (``t0``) the IR printer uses.
    ``pooling`` is ``sum``/``mean`` for bags and ``none`` for ``nn.Embedding``-style gathers.
    """

    name: str
    short: str
    rows: int
    dim: int
    pooling: str
    weight_key: str
    weighted: bool = False  # called with per_sample_weights
    dtype: str = "f32"

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name}: pooling {self.pooling!r} not in {POOLINGS}")

    def describe(self) -> str:
        w = ",weighted" if self.weighted else ""
        return f"{self.short}={self.name}[{self.rows}x{self.dim},{self.pooling}{w}]"


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


@dataclass(frozen=True)
class CommSpec:
    """One collective: which op, over which group, with which split sizes and payload dtype.

    ``splits`` are per-rank element counts along the split dimension; the verifier checks they
    add up to the payload's size along ``split_dim``.
    """

    op: str
    group: tuple[int, ...]
    splits: Optional[tuple[int, ...]] = None
    split_dim: int = 0
    precision: str = "fp32"

    def describe(self) -> str:
        s = f"{self.op} over {list(self.group)}"
        if self.splits is not None:
            s += f" splits={list(self.splits)}"
        if self.precision != "fp32":
            s += f" {self.precision}"
        return s


@dataclass(frozen=True)
class OptimizerSpec:
    """The sparse optimizer fused into a table group's backward."""

    name: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    def describe(self) -> str:
        return f"{self.name}(lr={self.lr:g})"


@dataclass
class Plan:
    """The sharding plan: one ShardSpec per table (logical name -> spec), plus notes."""

    world_size: int
    tables: dict[str, TableSpec] = field(default_factory=dict)
    shards: dict[str, ShardSpec] = field(default_factory=dict)
    strategy: str = "auto"

    def __str__(self) -> str:
        rows = [("table", "rows x dim", "kind", "ranks", "shards")]
        for name, spec in self.shards.items():
            t = self.tables[name]
            shapes = ", ".join(f"r{r}:{r1 - r0}x{c1 - c0}" for r, r0, r1, c0, c1 in spec.shards)
            rows.append((name, f"{t.rows}x{t.dim}", spec.kind, ",".join(map(str, spec.ranks)), shapes))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"# sharding plan: {len(self.shards)} tables over {self.world_size} rank(s), strategy={self.strategy}"]
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        per_rank = {}
        for name, spec in self.shards.items():
            t = self.tables[name]
            for r, r0, r1, c0, c1 in spec.shards:
                per_rank[r] = per_rank.get(r, 0) + (r1 - r0) * (c1 - c0) * 4
        for r in range(self.world_size):
            lines.append(f"rank {r}: table weights {per_rank.get(r, 0) / 2**20:.2f} MiB")
        return "\n".join(lines)

    __repr__ = __str__
