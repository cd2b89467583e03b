"""fuse_interaction: replace the DLRM dot interaction by one recc op.

Contract: requires nothing but a traced graph. Finds ``Z = torch.bmm(X, X.transpose(1, 2))``
(``torch.transpose``, ``.transpose``, ``.permute(0, 2, 1)`` or ``.mT``) whose only use is the
gather of constant index pairs ``Z[:, li, lj]`` (``li``/``lj`` read with ``get_attr``), and
replaces the pair by ``recc.pairwise_dot(X, li, lj)``. Then, with ``concat=True`` (default),
where X is ``torch.stack([x, v1, ...], dim=1)`` — or the reference DLRM's
``torch.cat([x, v1, ...], dim=1).view((batch_size, -1, d))`` — used only there and the pairs' only use is
``torch.cat([x, pairs], dim=1)`` (DLRM's ``interact``), the stack, the pairs and the cat become
one ``recc.dot_interaction(x, blocks, li, lj, features=...)``; a vector that is one table's
column block of a batched lookup (``getitem(recc.split_cols(pooled, sizes), k)``) is named by
its place in ``pooled`` instead, so the kernel reads it in place and its gradient is written
into one tensor per group. Ensures the result is computed pair by pair: no F x F matrix, no
index gather, no scatter-add in backward — on CPU this was the largest non-GEMM cost of a DLRM
step — and, with ``concat``, no per-table split, stacked copy or concatenation either. Must not
change what the graph computes (the same dot products; summation order within one dot product
may differ, which is fp32 rounding). Graphs without the pattern are left unchanged.

Before (tiny):
    tables_g0  : tuple[3x f32[8,4]] = recc.split_cols(pooled_g0, (4, 4, 4))
    emb_l_0    : f32[8,4]     = getitem(tables_g0, 0)
    emb_l_1    : f32[8,4]     = getitem(tables_g0, 1)
    emb_l_2    : f32[8,4]     = getitem(tables_g0, 2)
    stack      : f32[8,4,4]   = torch.stack([bot_l_3, emb_l_0, emb_l_1, emb_l_2], dim=1)
    transpose  : f32[8,4,4]   = torch.transpose(stack, 1, 2)
    bmm        : f32[8,4,4]   = torch.bmm(stack, transpose)
    li         : i64[6]       = get_attr li
    lj         : i64[6]       = get_attr lj
    getitem    : f32[8,6]     = getitem(bmm, (slice(None, None, None), li, lj))
    cat        : f32[8,10]    = torch.cat([bot_l_3, getitem], dim=1)
After:
    li         : i64[6]       = get_attr li
    lj         : i64[6]       = get_attr lj
    cat        : f32[8,10]    = recc.dot_interaction(bot_l_3, [pooled_g0], li, lj, features=((0, 0), (0, 4), (0, 8)))
With concat=false the stack, split and cat stay and the pairs are
    getitem    : f32[8,6]     = recc.pairwise_dot(stack, li, lj)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from recc.graph_utils import rename, split_cols_piece, value_dim
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


def _arg(node: fx.Node, pos: int, name: str, default=None):
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def _is_call(node, fn) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is fn


def _column_block(v: fx.Node, d: int):
    """(tensor, first column) of vector ``v``: its place in a batched lookup when ``v`` is a
    D-wide ``split_cols`` piece used only by the stack, else (v, 0)."""
    piece = split_cols_piece(v)
    if piece is not None and len(v.users) == 1:
        split, k = piece
        source, sizes = _arg(split, 0, "x"), _arg(split, 1, "sizes")
        if sizes is not None and sizes[k] == d:
            return source, sum(sizes[:k])
    return v, 0


_RESHAPES = ("view", "reshape")


def _stacked_vectors(stack: fx.Node):
    """``(vectors, nodes that build X)`` when X = ``stack`` lays [B, D] vectors side by side as
    [B, F, D] — ``torch.stack(vectors, dim=1)``, or the reference DLRM's
    ``torch.cat([x] + ly, dim=1).view((batch_size, -1, d))`` (``.reshape`` too) with every
    vector D wide — each node used only on the way; else None."""
    if _is_call(stack, torch.stack) and len(stack.users) == 1:
        vectors, sdim = _arg(stack, 0, "tensors"), _arg(stack, 1, "dim", 0)
        if sdim in (1, -2) and isinstance(vectors, (list, tuple)):
            return vectors, [stack]
        return None
    reshape = (stack.op == "call_method" and stack.target in _RESHAPES) or _is_call(stack, torch.reshape)
    if not reshape or len(stack.users) != 1 or not _is_call(stack.args[0], torch.cat):
        return None
    flat = stack.args[0]
    vectors, cdim = _arg(flat, 0, "tensors"), _arg(flat, 1, "dim", 0)
    if cdim not in (1, -1) or not isinstance(vectors, (list, tuple)) or len(flat.users) != 1:
        return None
    shape = stack.meta["val"].shape
    if not vectors or not all(value_dim(v) == 2 and v.meta["val"].shape[1] == shape[2] for v in vectors) \
            or shape[1] != len(vectors):
        return None  # a vector wider than D would be several features: not this pattern
    return vectors, [stack, flat]


def _fold_concat(graph: fx.Graph, pd: fx.Node) -> bool:
    """cat([x, pairwise_dot(X, li, lj)], 1) with X the vectors ``[x, ...]`` side by side
    (``_stacked_vectors``) -> recc.dot_interaction; True if done."""
    stack, li, lj = pd.args
    found = _stacked_vectors(stack) if len(pd.users) == 1 else None
    if found is None:
        return False
    vectors, builders = found
    (cat,) = pd.users
    if not (_is_call(cat, torch.cat) and len(vectors) >= 2):
        return False
    parts, cdim = _arg(cat, 0, "tensors"), _arg(cat, 1, "dim", 0)
    if cdim not in (1, -1) or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return False
    x = vectors[0]
    if parts[0] is not x or parts[1] is not pd or not all(value_dim(v) == 2 for v in vectors):
        return False
    d = x.meta["val"].shape[1]
    blocks, features = [], []
    for v in vectors[1:]:
        source, col = _column_block(v, d)
        if source not in blocks:
            blocks.append(source)
        features.append((blocks.index(source), col))
    with graph.inserting_before(cat):
        new = graph.call_function(OPS["dot_interaction"], (x, blocks, li, lj), {"features": tuple(features)})
    name = cat.name
    cat.replace_all_uses_with(new)
    for n in (cat, pd, *builders):
        graph.erase_node(n)
    # A vector may appear several times in the stack: erase each piece (and its split) once.
    for v in dict.fromkeys(vectors[1:]):
        if isinstance(v, fx.Node) and not v.users and _is_call(v, operator.getitem):
            split = v.args[0]
            graph.erase_node(v)
            if not split.users:
                graph.erase_node(split)
    rename(new, name)
    return True


@register_pass
def fuse_interaction(gm: fx.GraphModule, ctx: PassContext, *, concat: bool = True) -> fx.GraphModule:
    """Fuse bmm(X, X^T)[:, li, lj] into recc.pairwise_dot(X, li, lj), and with ``concat`` DLRM's
    stack + pairs + cat around it into recc.dot_interaction."""
    graph = gm.graph
    fused, whole = 0, 0
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
        if concat and _fold_concat(graph, new):
            whole += 1
    ctx.stats["fused_interactions"] = fused
    ctx.stats["fused_interaction_concats"] = whole
    return gm
