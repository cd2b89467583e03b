"""batch_tables: replace per-table lookups by one table-batched lookup (TBE) per group.

Contract: requires ``shard_tables`` (a ShardSpec on every lookup; every lookup of a table the
same). Groups tables by (shard
width, pooling, weighted, optimizer, data-parallel, two-level, stored dtype, memory tier) — one group per distinct key
(two-level: table-row-wise tables on a multi-node cluster, whose output dist differs), tables in
discovery order except that a table held whole by one rank sorts by that rank (so the output
dist needs no column permutation); a group holds every shard of its tables on every rank (the graph is SPMD) —
and for each group inserts a ``TableGroup`` submodule ``tbe_gN``, one ``recc.pack_sparse`` and
one ``recc.tbe_lookup``; the batched output is split per table by one ``recc.split_cols`` and
each original lookup becomes a ``getitem`` of it keeping its name, table and shard annotations. The
user's embedding modules leave the graph. Must not change what the graph computes.

Every lookup of one table lands in that table's group (``TableGroup.features``, FBGEMM's
``feature_table_map``): one set of rows and optimizer state; the fused backward sums every
lookup's gradient per row before the one update. Lookups of one bag count are a *feature* each,
with their own ids and their own column block of the output. A table looked up with different
fixed bag counts (a bag per sample and a ``[B, L]`` gather) is one *stacked* feature: its
lookups' bags one after another (``pack_sparse(stack=)``), ``sum B_f`` bags that key its group,
each lookup's rows given back by ``recc.split_bags`` — no padding, so the kernel reads and
updates only the bags there are. A jagged lookup beside fixed ones (its count varies from rank
to rank), and gathers of different counts on one CPU rank (``fuse_gathers`` then gives each its
own rows), keep a feature each and pad the group like a jagged one (``pack_sparse(pad=True)``,
``TableGroup.padded``); there a pooled lookup's rows are cut back to its bags by
``recc.own_bags`` (a gather's ``recc.rows_like`` takes its own).

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
One item table read as a sum bag ([B] bags), a candidate ([B] ids) and a history ([B, 3] ids):
    tbe_g0     : module       = get_attr tbe_g0  # tbe_g0=[t0] dim=4 sum sgd(lr=0.1)
    sparse_g0  : kjt[t=1,b=40] = recc.pack_sparse([bag_ids, item_ids, item_1_ids], [None, None, None], None, tables=('item',), rows=(30,), stack=(3,))
    pooled_g0  : f32[40,4]    = recc.tbe_lookup(tbe_g0, sparse_g0)
    tables_g0  : tuple[1x f32[40,4]] = recc.split_cols(pooled_g0, (4,))
    item_stacked : f32[40,4]  = getitem(tables_g0, 0)
    item_stacked_bags : tuple[f32[8,4], f32[8,4], f32[24,4]] = recc.split_bags(item_stacked, [bag_ids, item_ids, item_1_ids], [None, None, None])
    bag       : f32[8,4]      = getitem(item_stacked_bags, 0)  # table t0=item[30x4,sum]; ...
    item_1_rows : f32[24,4]   = getitem(item_stacked_bags, 2)  # table t0=item[30x4,none]; ...
"""
from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from recc.graph_utils import flush_uses, rename, replace_uses, stable_toposort
from recc.ops import OPS, op_of
from recc.passmanager import PassContext, register_pass
from recc.specs import TierSpec
from recc.tables import TableGroup


@register_pass(after=("shard_tables",))
def batch_tables(gm: fx.GraphModule, ctx: PassContext, *, max_tables_per_group: int = 0) -> fx.GraphModule:
    """Fuse lookups into one table-batched kernel call per (width, pooling, weighted, optimizer,
    data-parallel, bag count) group; every lookup of one table in its table's group, lookups of
    different bag counts stacked into one feature. ``max_tables_per_group`` (0 = unlimited)
    splits large groups."""
    opt = ctx.config.sparse_optimizer
    graph = gm.graph
    lookups = [n for n in graph.nodes if n.op == "call_function" and op_of(n.target) is OPS["embedding_bag"]]
    per_table: dict[str, list[fx.Node]] = {}
    for n in lookups:
        t = n.meta["recc.table"]
        if "recc.shard" not in n.meta:
            raise ValueError(f"batch_tables: table {t.name} has no placement; batch_tables runs after "
                             f"shard_tables (add it to the pipeline before batch_tables)")
        per_table.setdefault(t.name, []).append(n)
    groups: dict[tuple, list[list[list[fx.Node]]]] = {}
    for sites in per_table.values():
        n = sites[0]
        t = n.meta["recc.table"]
        shard = n.meta["recc.shard"]
        for other in sites[1:]:
            if other.meta["recc.shard"] != shard or other.meta.get("recc.tier") != n.meta.get("recc.tier"):
                raise ValueError(f"batch_tables: table {t.name} is placed differently at its lookups {n.name} and "
                                 f"{other.name}; a table has one placement, whichever lookup reads it")
        widths = {c1 - c0 for _, _, _, c0, c1 in shard.shards}
        if len(widths) != 1:
            raise ValueError(f"batch_tables: table {t.name} has shards of widths {sorted(widths)}; "
                             f"column blocks of one table must be equally wide")
        two_level = shard.kind == "table_row_wise" and ctx.cluster.nodes > 1
        # Bags per batch: B for pooled tables and one-id gathers of [B] ids, B*L for gathers of
        # [B, L] ids; one group's features share it (one offsets layout, one output dist split).
        site_counts = [int(s.meta["val"].shape[0]) if "val" in s.meta else 0 for s in sites]
        counts = set(site_counts)
        jagged = [s.meta["recc.table"].jagged for s in sites]
        stacked = False
        if all(jagged):
            # Its id count varies from batch to batch and from feature to feature: jagged tables
            # group together, each padded to the group's largest count (pack_sparse pad=True).
            bags = "jagged"
        elif len(counts) > 1 and not any(jagged) and 0 not in counts and \
                not _gathers_served_apart(ctx, sites, shard):
            # One table looked up with different fixed bag counts (a bag per sample here, a
            # [B, L] gather there): its lookups are one *stacked* feature, their bags one after
            # another (pack_sparse stack=, recc.split_bags), so the kernel reads and updates
            # sum(B_f) bags. Padding every lookup to the largest count instead read, wrote back
            # and zero-filled the gradient of (lookups x largest) bags: 18k bags for youtube_dnn's
            # 10k, 0.72x eager's step. The feature has sum(B_f) bags, which keys its group.
            stacked = True
            bags = sum(site_counts)
        elif any(jagged) or len(counts) > 1:
            # A jagged lookup beside fixed ones (its count varies from rank to rank), or gathers
            # that fuse_gathers serves each its own rows: padded to the largest count, like
            # jagged ones.
            bags = "mixed"
        else:
            bags = counts.pop()
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
        bucket[-1].append((sites, stacked))
    index, last = 0, None
    pending = {}  # users whose arguments replace_uses rebuilds once, after the groups
    for (width, pooling, weighted, _, dp, two_level, bags, _, _), chunks in groups.items():
        node_size = ctx.cluster.devices_per_node if two_level else 0
        for members in chunks:
            members.sort(key=lambda m: _owner_order(m[0][0]))
            last = _emit_group(gm, ctx, f"tbe_g{index}", members, width, pooling, weighted, opt, dp, node_size,
                               bags in ("jagged", "mixed"), last, pending)
            index += 1
    flush_uses(pending)
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


def _table_spec(sites: list[fx.Node]):
    """The group's spec of the table its lookups ``sites`` read: the first lookup's (rows, dim,
    dtype, init: the table's), jagged if any lookup is."""
    spec = sites[0].meta["recc.table"]
    if not spec.jagged and any(s.meta["recc.table"].jagged for s in sites):
        spec = dataclasses.replace(spec, jagged=True)
    return spec


def _gathers_served_apart(ctx, sites, shard) -> bool:
    """Whether ``fuse_gathers`` will give each of a table's lookups its own rows: every lookup a
    gather (one id per bag, no offsets) on a one-rank CPU cluster. Its lookups then stay one
    feature each, whatever their counts (``recc.gather_rows`` pads nothing and copies nothing)."""
    return (ctx.cluster.world_size == 1 and ctx.cluster.device_type == "cpu" and shard.kind != "data_parallel"
            and all(s.meta["recc.table"].pooling == "none" for s in sites))


def _emit_group(gm, ctx, name, members, width, pooling, weighted, opt, dp, node_size, padded, after, pending):
    """Insert one group's nodes (after ``after``, the previous group's last node, if later than
    the group's inputs, so groups read in order) and return its last node. ``members``: per
    table, its lookups and whether they are one stacked feature (else one feature each)."""
    graph = gm.graph
    # A table is jagged when any of its lookups is (its id count then varies from rank to rank).
    specs = [_table_spec(sites) for sites, _ in members]
    lookups = [n for sites, _ in members for n in sites]
    # Kernel features: a stacked table's lookups are one (their bags one after another), any
    # other lookup is its own. stack[f] = how many lookups feature f reads.
    features, stack = [], []
    for k, (sites, stacked) in enumerate(members):
        for _ in range(1 if stacked else len(sites)):
            features.append(k)
            stack.append(len(sites) if stacked else 1)
    stacking = len(stack) != len(lookups)
    placements, sources = [], []
    for k, ((sites, _), t) in enumerate(zip(members, specs)):
        for rank, r0, r1, c0, c1 in sites[0].meta["recc.shard"].shards:
            placements.append((k, rank, r0, r1, c0, c1))
        sources.append(gm.get_parameter(t.weight_key))
    tiers = [sites[0].meta.get("recc.tier") or TierSpec(t.name) for (sites, _), t in zip(members, specs)]
    gm.add_submodule(name, TableGroup(name, specs, placements, width, pooling, weighted, opt, sources,
                                      data_parallel=dp, world_size=ctx.cluster.world_size, node_size=node_size,
                                      tiers=tiers, features=features, padded=padded))
    ids = [n.args[1] for n in lookups]
    offsets = [n.args[2] for n in lookups]
    psw = [n.args[3] for n in lookups] if weighted else None
    # Insert where every member's inputs exist: after the latest-defined input node, and never
    # among the placeholders (they stay first, in the user's argument order).
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = [a for n in lookups for a in n.args[1:] if isinstance(a, fx.Node)]
    inputs += [n for n in graph.nodes if n.op == "placeholder"]
    if after is not None:
        inputs.append(after)
    anchor = max(inputs, key=order.__getitem__) if inputs else lookups[0].prev
    with graph.inserting_after(anchor):
        g = graph.get_attr(name)
    with graph.inserting_after(g):
        kwargs = {"tables": tuple(specs[k].name for k in features), "rows": tuple(specs[k].rows for k in features)}
        if padded:
            kwargs["pad"] = True
        if stacking:
            kwargs["stack"] = tuple(stack)
        sparse = graph.call_function(OPS["pack_sparse"], (ids, offsets, psw), kwargs)
    with graph.inserting_after(sparse):
        out = graph.call_function(OPS["tbe_lookup"], (g, sparse))
    rename(sparse, f"sparse_{name[4:]}")
    rename(out, f"pooled_{name[4:]}")
    with graph.inserting_after(out):
        split = graph.call_function(OPS["split_cols"], (out, tuple(specs[k].dim for k in features)))
    rename(split, f"tables_{name[4:]}")
    prev = split
    # Each lookup's piece: its feature's column block, or its rows of a stacked feature's block.
    pieces, f, first = [], 0, 0
    for n_lookups in stack:
        with graph.inserting_after(prev):
            block = graph.call_function(operator.getitem, (split, f))
        prev = block
        if n_lookups == 1:
            pieces.append(block)
        else:
            mine = lookups[first:first + n_lookups]
            with graph.inserting_after(prev):
                rows = graph.call_function(OPS["split_bags"], (block, [n.args[1] for n in mine],
                                                               [n.args[2] for n in mine]))
            rename(block, f"{mine[0].meta['recc.table'].name.replace('.', '_')}_stacked")
            rename(rows, f"{block.name}_bags")
            prev = rows
            for j in range(n_lookups):
                with graph.inserting_after(prev):
                    prev = graph.call_function(operator.getitem, (rows, j))
                pieces.append(prev)
        f += 1
        first += n_lookups
    made = list(pieces)
    for piece, n in zip(pieces, lookups):
        t = n.meta["recc.table"]
        piece.meta["recc.table"] = t
        piece.meta["recc.shard"] = n.meta["recc.shard"]
        if "recc.tier" in n.meta:
            piece.meta["recc.tier"] = n.meta["recc.tier"]
        old = n.name
        result = piece
        if padded and t.pooling != "none":
            # A bag per sample in a padded group: its rows are the first B of the padded count
            # (a gather's recc.rows_like takes its own rows already).
            with graph.inserting_after(piece):
                result = graph.call_function(OPS["own_bags"], (piece, n.args[1], n.args[2]))
            made.append(result)
        replace_uses(n, result, pending)
        graph.erase_node(n)
        if result is not piece:
            rename(piece, f"{old}_padded")
        rename(result, old)
    order = {n: i for i, n in enumerate(graph.nodes)}
    return max(made, key=order.__getitem__)
