"""cache_tables: put the embedding cache of every cached table group in the graph.

Contract: requires ``batch_tables`` and ``insert_comm`` (the ids a rank looks up are its own
shards' only after the input dist). For every ``recc.tbe_lookup`` whose group the plan places
``cached`` (``TierSpec``, ``shard_tables``), the lookup's ids go through
``recc.cache_map`` (ids -> cache slots, choosing the slots of missing rows),
``recc.cache_io_start`` (the evicted dirty rows written back and the missing rows read: the
only nodes that touch the slow tier) and ``recc.cache_io_wait``, and the lookup reads the slots.
Resident groups are left as they are; a graph with none cached is unchanged. Must not change
what the graph computes (the cache is transparent: its reference ops are the identity).
``pipeline_comm`` later puts the map and the I/O start in the ``sparse_dist`` stage, so
``train_pipeline`` maps and fetches the next batch's rows while this batch computes.

Before:
    sparse_g0 : kjt[t=2,b=8] = recc.pack_sparse([l_s_i_1, l_s_i_2], [l_s_o_1, l_s_o_2], None, tables=(...), rows=(1000, 20))
    pooled_g0 : f32[8,8]    = recc.tbe_lookup(tbe_g0, sparse_g0)
After:
    slots_g0  : kjt[t=2,b=8] = recc.cache_map(tbe_g0, sparse_g0)
    fetch_g0_h : handle      = recc.cache_io_start(tbe_g0, slots_g0)
    fetch_g0  : kjt[t=2,b=8] = recc.cache_io_wait(fetch_g0_h)
    pooled_g0 : f32[8,8]    = recc.tbe_lookup(tbe_g0, fetch_g0)
"""
from __future__ import annotations

import torch.fx as fx

from recc.graph_utils import rename, resolve_attr
from recc.ops import OPS, op_of
from recc.passmanager import PassContext, register_pass
from recc.tables import TableGroup


@register_pass(after=("batch_tables", "insert_comm"))
def cache_tables(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Route each cached group's ids through its cache: map to slots, write back and fetch, wait."""
    graph = gm.graph
    for lookup in list(graph.nodes):
        if lookup.op != "call_function" or op_of(lookup.target) is not OPS["tbe_lookup"]:
            continue
        g_node, ids = lookup.args[0], lookup.args[1]
        group = resolve_attr(gm, g_node.target) if isinstance(g_node, fx.Node) and g_node.op == "get_attr" else None
        if not isinstance(group, TableGroup) or not group.cached:
            continue
        if group.data_parallel:
            raise ValueError(f"cache_tables: group {group.group_name} is data-parallel and cached; a replicated "
                             f"table cannot be cached (shard it, or keep it resident)")
        suffix = group.group_name[len("tbe_"):] if group.group_name.startswith("tbe_") else group.group_name
        with graph.inserting_before(lookup):
            mapped = graph.call_function(OPS["cache_map"], (g_node, ids))
            start = graph.call_function(OPS["cache_io_start"], (g_node, mapped))
            wait = graph.call_function(OPS["cache_io_wait"], (start,))
        rename(mapped, f"slots_{suffix}")
        rename(start, f"fetch_{suffix}_h")
        rename(wait, f"fetch_{suffix}")
        for n in (mapped, start, wait):
            n.meta["recc.notes"] = [f"cached {group.group_name}: {group.describe_slots()}"] if n is mapped else []
        lookup.args = (g_node, wait) + tuple(lookup.args[2:])
    graph.lint()
    return gm
