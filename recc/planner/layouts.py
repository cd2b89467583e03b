"""Where a sharding kind puts a table's blocks, and the ShardSpec of a placement.

Sharding kinds and their blocks ``(rank, row_start, row_end, col_start, col_end)`` — the
runtime relies on exactly these layouts:

- ``table_wise`` (TW): one block ``(r, 0, rows, 0, dim)``.
- ``row_wise`` (RW): over all ranks ``0..W-1``, contiguous blocks of ``ceil(rows / W)`` rows
  (the last may be smaller; empty blocks, when rows < W, are omitted), full columns.
- ``column_wise`` (CW): ``k`` column blocks of width ``dim / k``, in column order, on distinct
  ranks. ``k`` is any divisor of dim that is <= W and leaves blocks at least 4 wide (at least 1
  wide when dim < 8): the planner picks it by cost (``column_splits``); one block when no split
  is possible.
- ``table_row_wise`` (TWRW): row-wise (ceil-sized blocks) over the ranks of one node.
- ``data_parallel`` (DP): a full block on every rank.
"""
from __future__ import annotations

from typing import Iterable, Optional

from recc.cluster import Cluster
from recc.specs import SHARDING_KINDS, ShardSpec, TableSpec

TW, RW, CW, TWRW, DP = SHARDING_KINDS



def row_blocks(rows: int, parts: int) -> list[tuple[int, int, int]]:
    """``(part, row_start, row_end)`` of ceil-sized contiguous blocks; empty blocks omitted."""
    size = -(-rows // parts)
    out = []
    for i in range(parts):
        r0, r1 = i * size, min((i + 1) * size, rows)
        if r1 > r0:
            out.append((i, r0, r1))
    return out


def column_splits(dim: int, world_size: int) -> list[int]:
    """Every block count a column-wise table may have on ``world_size`` ranks, ascending."""
    min_width = 4 if dim >= 8 else 1
    return [k for k in range(1, min(dim, world_size) + 1) if dim % k == 0 and dim // k >= min_width]


def column_split(dim: int, world_size: int) -> int:
    """The most column blocks a column-wise table can have on ``world_size`` ranks."""
    return column_splits(dim, world_size)[-1]


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
