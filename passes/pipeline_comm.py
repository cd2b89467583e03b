"""pipeline_comm: order the graph so embedding communication overlaps dense compute.

Contract: requires ``insert_comm`` (and ``quantize_comm`` when both run, so codecs move with
their collectives). Reorders nodes only, never changes what they compute:

1. every collective ``*_start`` runs as early as its inputs allow, input dists before output
   dists, and everything a start needs (``pack_sparse``, lookups, codecs) runs first;
2. every output dist's ``*_wait`` — and whatever depends on it (dequantize, the per-table split,
   the interaction, the top MLP) — runs as late as possible, so the bottom MLP (everything that
   does not need the embeddings) runs while the pooled rows are on the wire. In backward the
   same order makes autograd send the embeddings' gradients back (``_OutputDistWait``) before
   it runs the bottom MLP's backward and wait for them only afterwards (``_OutputDistStart``);
3. the nodes that only feed the input dists (``pack_sparse`` and the ids ``all_to_all_start``),
   and a cached group's ``cache_map`` and ``cache_io_start`` with what they need, are tagged
   ``stage=sparse_dist``: ``DistributedModel.train_pipeline`` runs them one batch
   ahead, so the next batch's ids travel while this batch trains, as TorchRec's sparse-dist
   pipeline does.

On one rank (no collectives) it changes nothing but the cache stage's tags. ``enabled=False`` (``CompileConfig.pipelining``)
turns it off.

Before (insert_comm's order):
    ids_g0_h   : handle       = recc.all_to_all_start(sparse_g0, comm=input_dist)
    ids_g0     : kjt[t=2,b=16] = recc.all_to_all_wait(ids_g0_h)
    pooled_g0  : f32[16,8]    = recc.tbe_lookup(tbe_g0, ids_g0)
    emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0, comm=output_dist)
    emb_g0     : f32[8,12]    = recc.all_to_all_wait(emb_g0_h)
    ...
    bot_l_0    : f32[8,8]     = bot_l.0(dense_x)
After:
    ids_g0_h   : handle       = recc.all_to_all_start(sparse_g0, comm=input_dist)  # stage=sparse_dist
    ids_g0     : kjt[t=2,b=16] = recc.all_to_all_wait(ids_g0_h)
    pooled_g0  : f32[16,8]    = recc.tbe_lookup(tbe_g0, ids_g0)
    emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0, comm=output_dist)
    bot_l_0    : f32[8,8]     = bot_l.0(dense_x)
    ...
    emb_g0     : f32[8,12]    = recc.all_to_all_wait(emb_g0_h)
"""
from __future__ import annotations

import heapq

import torch.fx as fx

from recc.graph_utils import SPARSE_DIST, STAGE
from recc.ops import op_of
from recc.passmanager import PassContext, register_pass



def _op_name(n: fx.Node):
    op = op_of(n.target) if n.op == "call_function" else None
    return op.name if op is not None else None


def _comm_op(n: fx.Node):
    comm = n.kwargs.get("comm") if n.op == "call_function" else None
    return getattr(comm, "op", None)


def _closure(nodes, step) -> set:
    """``nodes`` and everything reachable from them through ``step(node)``."""
    seen, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def _ancestors(nodes) -> set:
    return _closure(nodes, lambda n: n.all_input_nodes)


def _descendants(nodes) -> set:
    return _closure(nodes, lambda n: n.users)


@register_pass(after=("insert_comm", "quantize_comm"), from_config={"enabled": "pipelining"})
def pipeline_comm(gm: fx.GraphModule, ctx: PassContext, *, enabled: bool = True) -> fx.GraphModule:
    """Starts early, output-dist waits late; tag the input dist's stage for one-batch-ahead runs."""
    graph = gm.graph
    starts = [n for n in graph.nodes if _op_name(n) == "all_to_all_start"]
    cache_starts = [n for n in graph.nodes if _op_name(n) == "cache_io_start"]
    if not enabled or not (starts or cache_starts):
        return gm
    out_waits = [n for n in graph.nodes if _op_name(n) == "all_to_all_wait"
                 and _comm_op(n.args[0]) == "output_dist"]
    early = _ancestors(starts)
    late = _descendants(out_waits)
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}

    def priority(n: fx.Node):
        if n.op == "placeholder":
            return (0, 0, position[n])
        if n.op == "output":
            return (4, 0, position[n])
        cls = 1 if n in early else 3 if n in late else 2
        # Within the early nodes: input dists start first, then output dists; waits last.
        kind = 0 if _comm_op(n) == "input_dist" else 1 if _op_name(n) == "all_to_all_start" else \
            3 if _op_name(n) == "all_to_all_wait" else 2
        return (cls, kind, position[n])

    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(priority(n), n.name, n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (priority(u), u.name, u))
    if len(order) != len(nodes):
        raise RuntimeError("pipeline_comm: the graph has a cycle")
    anchor = nodes[0]
    for n in order[1:]:
        anchor.append(n)
        anchor = n

    in_starts = [n for n in starts if _comm_op(n) == "input_dist"]
    # A cached group's map and I/O start join the stage: the next batch's missing rows are read
    # while this batch trains (its ids' all-to-all wait comes along, ahead of the map).
    stage = _ancestors(in_starts + cache_starts)
    for n in graph.nodes:
        n.meta.pop(STAGE, None)
        if n in stage and n.op not in ("placeholder", "get_attr"):
            n.meta[STAGE] = SPARSE_DIST
    gm.meta["recc.pipelined"] = True
    graph.lint()
    gm.recompile()
    return gm
