"""Running a pipelined graph: the sparse-dist stage one batch ahead of the rest.

``pipeline_comm`` tags the nodes that only feed the input dists (``pack_sparse`` and the ids
``all_to_all_start``) with ``stage=sparse_dist``. ``split_sparse_stage`` cuts the final graph
there into two graph modules over the same submodules and parameters:

- ``stage(*flat_inputs) -> boundary values``: packs the batch and starts its ids all-to-all;
- ``main(*flat_inputs, *boundary values) -> flat outputs``: everything else (waits included).

``DistributedModel.forward`` runs them back to back; ``DistributedModel.train_pipeline`` runs
``stage`` for batch i+1 before handing batch i's output to the caller's backward, so the next
batch's ids are on the wire while this one trains.
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx
from torch.utils import _pytree as pytree

from recc.graph_utils import SPARSE_DIST, STAGE
from recc.trace import fx_flatten_inputs


class SplitGraph:
    """The two halves of ``whole`` (flat inputs in, flat outputs out) and the way back to the
    user's calling convention."""

    def __init__(self, whole: fx.GraphModule, stage: fx.GraphModule, main: fx.GraphModule):
        self.whole, self.stage, self.main = whole, stage, main

    def flatten(self, args) -> list:
        return fx_flatten_inputs(self.whole, args)

    def unflatten(self, flat_out):
        info = getattr(self.whole.graph._codegen, "pytree_info", None)
        if info is not None and info.out_spec is not None:
            return pytree.tree_unflatten(flat_out, info.out_spec)
        return flat_out


def split_sparse_stage(gm: fx.GraphModule) -> Optional[SplitGraph]:
    """Cut ``gm`` after its ``stage=sparse_dist`` nodes; None if it has none."""
    tagged = [n for n in gm.graph.nodes if n.meta.get(STAGE) == SPARSE_DIST]
    if not tagged:
        return None
    in_stage = set(tagged)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # What the rest of the graph needs from the stage: tagged nodes with an untagged user.
    boundary = [n for n in tagged if any(u not in in_stage for u in n.users)]

    stage_graph = fx.Graph()
    env: dict = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = stage_graph.placeholder(n.name)
        elif n in in_stage or (n.op == "get_attr" and any(u in in_stage for u in n.users)):
            env[n] = stage_graph.node_copy(n, lambda x: env[x])
    stage_graph.output(tuple(env[n] for n in boundary))

    main_graph = fx.Graph()
    env = {}
    for n in placeholders:
        env[n] = main_graph.placeholder(n.name)
    for n in boundary:
        env[n] = main_graph.placeholder(f"{n.name}_in")
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in in_stage:
            continue
        if n.op == "get_attr" and n.users and all(u in in_stage for u in n.users):
            continue
        env[n] = main_graph.node_copy(n, lambda x: env[x])
    return SplitGraph(gm, fx.GraphModule(gm, stage_graph, "SparseDistStage"),
                      fx.GraphModule(gm, main_graph, "MainStage"))
