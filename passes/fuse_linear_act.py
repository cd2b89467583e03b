"""fuse_linear_act: each dense layer and the ReLU after it become one ``recc.linear``.

Contract: requires nothing but a traced graph (runs after ``align_linear``, whose padded
``F.linear`` calls it takes too). Every ``nn.Linear`` module call and every ``F.linear`` call
on a 2-D input becomes ``recc.linear(x, weight, bias, activation=...)`` with the layer's own
parameters read by ``get_attr`` (the optimizer, DDP and ``state_dict`` see them unchanged);
when the layer's only user is a ReLU (``nn.ReLU``, ``F.relu``, ``torch.relu``, ``.relu()``), the
ReLU folds in (``activation='relu'``). Must not change what the graph computes.

Why: the CPU backend runs ``recc.linear`` on oneDNN with the ReLU in the GEMM's epilogue (one
pass over the output fewer, forward) and routes each backward product to the faster GEMM
library (``recc.kernels.linear``); other backends run the reference (``F.linear`` + ReLU).

Before:
    bot_l_0 : f32[8,8] = bot_l.0(dense_x)
    bot_l_1 : f32[8,8] = bot_l.1(bot_l_0)        # nn.ReLU
After:
    bot_l_0_weight : f32[8,13] = get_attr bot_l.0.weight
    bot_l_0_bias   : f32[8]    = get_attr bot_l.0.bias
    bot_l_1        : f32[8,8]  = recc.linear(dense_x, bot_l_0_weight, bot_l_0_bias, activation='relu')
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from recc.graph_utils import rename, value_dim
from recc.ops import OPS
from recc.passmanager import PassContext, register_pass


def _linear_parts(gm: fx.GraphModule, node: fx.Node):
    """``(x, weight, bias, module path or None)`` if ``node`` is a dense layer we take, else None."""
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        mod = gm.get_submodule(node.target)
        if type(mod) is nn.Linear:
            return node.args[0], None, None, node.target
    if node.op == "call_function" and node.target is F.linear and not node.kwargs and len(node.args) in (2, 3):
        x, w = node.args[:2]
        b = node.args[2] if len(node.args) == 3 else None
        return x, w, b, None
    return None


def _is_relu(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return type(mod) is nn.ReLU
    if node.op == "call_function" and node.target in (F.relu, torch.relu):
        return not node.kwargs.get("inplace", False) and len(node.args) == 1
    return node.op == "call_method" and node.target == "relu" and len(node.args) == 1


@register_pass
def fuse_linear_act(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite dense layers (+ their ReLU) as ``recc.linear``."""
    graph = gm.graph
    fused = {"none": 0, "relu": 0}
    for node in list(graph.nodes):
        parts = _linear_parts(gm, node)
        if parts is None or value_dim(parts[0]) != 2:
            continue
        x, w, b, path = parts
        users = list(node.users)
        act = users[0] if len(users) == 1 and _is_relu(gm, users[0]) else None
        with graph.inserting_before(node):
            if path is not None:
                w = graph.get_attr(f"{path}.weight")
                rename(w, f"{node.name}_weight")
                if gm.get_submodule(path).bias is not None:
                    b = graph.get_attr(f"{path}.bias")
                    rename(b, f"{node.name}_bias")
            activation = "relu" if act is not None else "none"
            new = graph.call_function(OPS["linear"], (x, w, b), {"activation": activation})
        last = act if act is not None else node
        name = last.name
        if "val" in last.meta:  # later layers read their input's shape from it
            new.meta["val"] = last.meta["val"]
        last.replace_all_uses_with(new)
        if act is not None:
            graph.erase_node(act)
        graph.erase_node(node)
        rename(new, name)
        fused[activation] += 1
    ctx.stats["fused_linears"] = fused
    return gm
