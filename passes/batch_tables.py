"""batch_tables: replace per-table lookups by one table-batched lookup (TBE) per group.

Contract: requires ``shard_tables`` (a ShardSpec on every lookup). Groups lookups by (shard
width, pooling, weighted, optimizer, data-parallel, two-level, stored dtype, memory tier) — one group per distinct key
(two-level: table-row-wise tables on a multi-node cluster, whose output dist differs), tables in
discovery order except that a table held whole by one rank sorts by that rank (so the output
dist needs no column permutation); a group holds every shard of its tables on every rank (the graph is SPMD) —
and for each group inserts a ``TableGroup`` submodule ``tbe_gN``, one ``recc.pack_sparse`` and
one ``recc.tbe_lookup``; the batched output is split per table by one ``recc.split_cols`` and
each original lookup becomes a ``getitem`` of it keeping its name, table and shard annotations. The
user's embedding modules leave the graph. Must not change what the graph computes.

Before:
    emb_l_0 : f32[8,4] = recc.embedding_bag(emb_l_0_weight, l_s_i_1, l_s_o_1, None, mode='sum', table='emb_l.0')
    emb_l_1 : f32[8,4] = recc.embedding_bag(emb_l_1_weight, l_s_i_2, l_s_o_2, None, mode='sum', table='emb_l.1')
After:
    tbe_g0    : module      = get_attr tbe_g0  # tbe_g0=[t0,t1] dim=4 sum sgd(lr=0.01)
    sparse_g0 : kjt[t=2,b=8] = recc.pack_sparse([l_s_i_1, l_s_i_2], [l_s_o_1, l_s_o_2], None, tables=(...), rows=(10, 20))
    pooled_g0 : f32[8,8]    = recc.tbe_lookup(tbe_g0, sparse_g0)
    tables_g0 : tuple[2x f32[8,4]] = recc.split_cols(pooled_g0, (4, 4))
    emb_l_0   : f32[8,4]    = getitem(tables_g0, 0)  # table t0=emb_l.0[10x4,sum]; ...
    emb_l_1   : f32[8,4]    = getitem(tables_g0, 1)  # table t1=emb_l.1[20x4,sum]; ...
"""
from __future__ import annotations

import operator

import torch.fx as fx

from recc.graph_utils import rename, stable_toposort
from recc.ops import OPS, op_of
from recc.passmanager import PassContext, register_pass
from recc.specs import TierSpec
from recc.tables import TableGroup


@register_pass(after=("shard_tables",))
def batch_tables(gm: fx.GraphModule, ctx: PassContext, *, max_tables_per_group: int = 0) -> fx.GraphModule:
    """Fuse lookups into one table-batched kernel call per (width, pooling, weighted, optimizer,
    data-parallel) group. ``max_tables_per_group`` (0 = unlimited) splits large groups."""
    opt = ctx.config.sparse_optimizer
    graph = gm.graph
    lookups = [n for n in graph.nodes if n.op == "call_function" and op_of(n.target) is OPS["embedding_bag"]]
    groups: dict[tuple, list[list[fx.Node]]] = {}
    for n in lookups:
        t = n.meta["recc.table"]
        if "recc.shard" not in n.meta:
            raise ValueError(f"batch_tables: table {t.name} has no placement; batch_tables runs after "
                             f"shard_tables (add it to the pipeline before batch_tables)")
        shard = n.meta["recc.shard"]
        widths = {c1 - c0 for _, _, _, c0, c1 in shard.shards}
        if len(widths) != 1:
            raise ValueError(f"batch_tables: table {t.name} has shards of widths {sorted(widths)}; "
                             f"column blocks of one table must be equally wide")
        two_level = shard.kind == "table_row_wise" and ctx.cluster.nodes > 1
        # Bags per batch: B for pooled tables and one-id gathers of [B] ids, B*L for gathers of
        # [B, L] ids; one group's tables share it (one offsets layout, one output dist split).
        bags = int(n.meta["val"].shape[0]) if "val" in n.meta else 0
        if t.jagged:
            # Its id count varies from batch to batch and from feature to feature: jagged tables
            # group together, each padded to the group's largest count (pack_sparse pad=True).
            bags = "jagged"
        # Gathers (pooling "none") run as sum-pooled bags of one id.
        pooling = "sum" if t.pooling == "none" else t.pooling
        tier = n.meta.get("recc.tier")
        cached = tier is not None and tier.cached
        if cached and shard.kind == "data_parallel":
            raise ValueError(f"batch_tables: table {t.name} is placed cached and data_parallel: a replicated table "
                             f"is whole on every rank, so there is nothing to cache it for; shard it "
                             f"(table_wise, row_wise, column_wise, table_row_wise) or keep it resident")
        key = (widths.pop(), pooling, t.weighted, opt, shard.kind == "data_parallel", two_level, bags, t.dtype,
               cached)
        bucket = groups.setdefault(key, [[]])
        if max_tables_per_group and len(bucket[-1]) >= max_tables_per_group:
            bucket.append([])
        bucket[-1].append(n)
    index, last = 0, None
    for (width, pooling, weighted, _, dp, two_level, _, _, _), chunks in groups.items():
        node_size = ctx.cluster.devices_per_node if two_level else 0
        for members in chunks:
            members.sort(key=_owner_order)
            last = _emit_group(gm, ctx, f"tbe_g{index}", members, width, pooling, weighted, opt, dp, node_size, last)
            index += 1
    stable_toposort(graph)
    for n in list(graph.nodes):
        if n.op == "get_attr" and not n.users:
            graph.erase_node(n)
    gm.delete_all_unused_submodules()
    ctx.stats["groups"] = index
    return gm


def _owner_order(n: fx.Node) -> int:
    """Tables held whole by one rank sort by that rank (stable, so discovery order otherwise):
    the output dist then receives each owner's columns already in the group's order, and the
    reassembly is a no-op instead of a column permutation. Tables spread over several ranks
    (row/column blocks, replicas) keep their place in front."""
    ranks = {r for r, *_ in n.meta["recc.shard"].shards}
    return ranks.pop() if len(ranks) == 1 else -1


def _emit_group(gm, ctx, name, members, width, pooling, weighted, opt, dp, node_size, after):
    """Insert one group's nodes (after ``after``, the previous group's last node, if later than
    the group's inputs, so groups read in order) and return its last node."""
    graph = gm.graph
    specs = [n.meta["recc.table"] for n in members]
    placements, sources = [], []
    for k, (n, t) in enumerate(zip(members, specs)):
        for rank, r0, r1, c0, c1 in n.meta["recc.shard"].shards:
            placements.append((k, rank, r0, r1, c0, c1))
        sources.append(gm.get_parameter(t.weight_key))
    tiers = [n.meta.get("recc.tier") or TierSpec(t.name) for n, t in zip(members, specs)]
    gm.add_submodule(name, TableGroup(name, specs, placements, width, pooling, weighted, opt, sources,
                                      data_parallel=dp, world_size=ctx.cluster.world_size, node_size=node_size,
                                      tiers=tiers))
    ids = [n.args[1] for n in members]
    offsets = [n.args[2] for n in members]
    psw = [n.args[3] for n in members] if weighted else None
    # Insert where every member's inputs exist: after the latest-defined input node, and never
    # among the placeholders (they stay first, in the user's argument order).
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = [a for n in members for a in n.args[1:] if isinstance(a, fx.Node)]
    inputs += [n for n in graph.nodes if n.op == "placeholder"]
    if after is not None:
        inputs.append(after)
    anchor = max(inputs, key=order.__getitem__) if inputs else members[0].prev
    with graph.inserting_after(anchor):
        g = graph.get_attr(name)
    with graph.inserting_after(g):
        kwargs = {"tables": tuple(t.name for t in specs), "rows": tuple(t.rows for t in specs)}
        if all(t.jagged for t in specs):
            kwargs["pad"] = True
        sparse = graph.call_function(OPS["pack_sparse"], (ids, offsets, psw), kwargs)
    with graph.inserting_after(sparse):
        out = graph.call_function(OPS["tbe_lookup"], (g, sparse))
    rename(sparse, f"sparse_{name[4:]}")
    rename(out, f"pooled_{name[4:]}")
    with graph.inserting_after(out):
        split = graph.call_function(OPS["split_cols"], (out, tuple(t.dim for t in specs)))
    rename(split, f"tables_{name[4:]}")
    prev = split
    for k, (n, t) in enumerate(zip(members, specs)):
        with graph.inserting_after(prev):
            piece = graph.call_function(operator.getitem, (split, k))
        piece.meta["recc.table"] = t
        piece.meta["recc.shard"] = n.meta["recc.shard"]
        if "recc.tier" in n.meta:
            piece.meta["recc.tier"] = n.meta["recc.tier"]
        old = n.name
        n.replace_all_uses_with(piece)
        graph.erase_node(n)
        rename(piece, old)
        prev = piece
    return prev
