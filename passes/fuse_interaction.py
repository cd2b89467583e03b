"""fuse_interaction: replace the DLRM dot interaction by one ``recc.pairwise_dot``.

Contract: requires nothing but a traced graph. Finds ``Z = torch.bmm(X, X.transpose(1, 2))``
(``torch.transpose``, ``.transpose``, ``.permute(0, 2, 1)`` or ``.mT``) whose only use is the
gather of constant index pairs ``Z[:, li, lj]`` (``li``/``lj`` read with ``get_attr``), and
replaces the pair by ``recc.pairwise_dot(X, li, lj)``. Ensures the result is computed pair by
pair: no F x F matrix, no index gather, no scatter-add in backward — on CPU this was the
largest non-GEMM cost of a DLRM step. Must not change what the graph computes (the same dot
products; summation order within one dot product may differ, which is fp32 rounding).
Graphs without the pattern are left unchanged.

Before:
    transpose : f32[8,4,4] = torch.transpose(stack, 1, 2)
    bmm       : f32[8,4,4] = torch.bmm(stack, transpose)
    li        : i64[6]     = get_attr li
    lj        : i64[6]     = get_attr lj
    getitem   : f32[8,6]   = getitem(bmm, (slice(None, None, None), li, lj))
After:
    li        : i64[6]     = get_attr li
    lj        : i64[6]     = get_attr lj
    getitem   : f32[8,6]   = recc.pairwise_dot(stack, li, lj)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from recc.graph_utils import rename
from recc.ops import OPS
from recc.passmanager import PassContext, register_pass


def _transposed_source(n) -> fx.Node | None:
    """X if ``n`` is X with its last two dims swapped (for a 3-D X), else None."""
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_function" and n.target is torch.transpose and tuple(n.args[1:3]) in ((1, 2), (2, 1), (-1, -2), (-2, -1)):
        return n.args[0]
    if n.op == "call_method" and n.target == "transpose" and tuple(n.args[1:3]) in ((1, 2), (2, 1), (-1, -2), (-2, -1)):
        return n.args[0]
    if n.op == "call_method" and n.target == "permute" and tuple(n.args[1:]) in ((0, 2, 1),):
        return n.args[0]
    if n.op == "call_function" and n.target is getattr and n.args[1] == "mT":
        return n.args[0]
    return None


def _is_full_slice(s) -> bool:
    return isinstance(s, slice) and s == slice(None, None, None)


@register_pass
def fuse_interaction(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Fuse bmm(X, X^T)[:, li, lj] into recc.pairwise_dot(X, li, lj)."""
    graph = gm.graph
    fused = 0
    for bmm in list(graph.nodes):
        is_bmm = (bmm.op == "call_function" and bmm.target in (torch.bmm, torch.matmul)) or \
                 (bmm.op == "call_method" and bmm.target in ("bmm", "matmul"))
        if not is_bmm or len(bmm.args) != 2:
            continue
        x, xt = bmm.args
        if _transposed_source(xt) is not x or len(bmm.users) != 1:
            continue
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() != 3:
            continue
        (gather,) = bmm.users
        if not (gather.op == "call_function" and gather.target is operator.getitem and gather.args[0] is bmm):
            continue
        idx = gather.args[1]
        if not (isinstance(idx, tuple) and len(idx) == 3 and _is_full_slice(idx[0])
                and all(isinstance(i, fx.Node) and i.op == "get_attr" for i in idx[1:])):
            continue
        li, lj = idx[1], idx[2]
        with graph.inserting_before(gather):
            new = graph.call_function(OPS["pairwise_dot"], (x, li, lj))
        name = gather.name
        gather.replace_all_uses_with(new)
        graph.erase_node(gather)
        graph.erase_node(bmm)
        if not xt.users:
            graph.erase_node(xt)
        rename(new, name)
        fused += 1
    ctx.stats["fused_interactions"] = fused
    return gm
