"""fold_column_cat: a concatenation of every column block of one tensor, in order, reads the tensor.

Contract: requires nothing but a traced graph; the default pipeline runs it after
``fuse_interaction`` (which claims the reference DLRM's ``cat`` + ``view`` of the same blocks
first). ``batch_tables`` hands each table its columns of the batched lookup as
``getitem(recc.split_cols(pooled, sizes), k)``; models written as "look every table up, then
``torch.cat(embeddings, dim=1)``" (the reference DLRM's ``cat`` interaction, a tower's input,
an embeddings-only module) glue them straight back together. Where a ``torch.cat`` along the
columns (``dim=1`` or ``-1`` of 2-D pieces) reads all of one ``split_cols``'s pieces, each once,
consecutively and in order, the run is replaced by the split's input; a cat left with that
input alone is the input. A run of the pieces' casts to one dtype (half tables' rows, as
``discover_tables`` hands them over) is replaced by one cast of the input, bit for bit the same. Split pieces other ops also read stay for them; a split nobody reads
any more is removed with its pieces. Ensures no copy of the pooled rows into their pieces'
concatenation in forward, and no concatenation of the pieces' gradients in backward (the
gradient reaches the lookup as one tensor). Must not change what the graph computes: the same
values, bit for bit. Partial runs and other orders are left as they are (a partial run as a
``narrow`` would copy as much, and its gradient would be zero-filled at full width).

Before (an embeddings-only module, 2 tables of dim 4):
    tables_g0  : tuple[2x f32[8,4]] = recc.split_cols(pooled_g0, (4, 4))
    emb_l_0    : f32[8,4]     = getitem(tables_g0, 0)
    emb_l_1    : f32[8,4]     = getitem(tables_g0, 1)
    cat        : f32[8,8]     = torch.cat([emb_l_0, emb_l_1], dim=1)
    return [cat]
After:
    return [pooled_g0]
With other inputs (``torch.cat([x] + ly, dim=1)``) the cat stays and reads the lookup:
    cat        : f32[8,12]    = torch.cat([bot_l_3, pooled_g0], dim=1)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from recc.graph_utils import rename, split_cols_piece
from recc.ir import dtype_short
from recc.passmanager import PassContext, register_pass

_CATS = (torch.cat, torch.concat)


def _pieces(split: fx.Node) -> list[fx.Node]:
    return sorted((u for u in split.users if split_cols_piece(u) is not None), key=lambda u: u.args[1])


def _table_name(piece: fx.Node) -> str:
    t = piece.meta.get("recc.table")
    return t.name if t is not None else piece.name


def _cat_parts(cat: fx.Node) -> Optional[tuple[list, int]]:
    """(tensors, dim) of a ``torch.cat`` call, or None when it is not one."""
    if cat.op != "call_function" or cat.target not in _CATS:
        return None
    tensors = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
        return None
    return list(tensors), dim


def _cast_of(node) -> Optional[tuple[fx.Node, torch.dtype]]:
    """``(x, dtype)`` of ``x.to(dtype)``, or None."""
    if (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "to" and len(node.args) == 2
            and not node.kwargs and isinstance(node.args[1], torch.dtype)):
        return node.args[0], node.args[1]
    return None


def _piece(v) -> tuple[Optional[tuple], Optional[torch.dtype]]:
    """``((split, k), None)`` for a split's piece k, ``((split, k), dtype)`` for its cast (a half
    table's rows, as ``discover_tables`` hands them to the model), ``(None, None)`` otherwise."""
    p = split_cols_piece(v)
    if p is not None:
        return p, None
    cast = _cast_of(v)
    if cast is not None and (p := split_cols_piece(cast[0])) is not None:
        return p, cast[1]
    return None, None


def _folded(graph: fx.Graph, cat: fx.Node, tensors: list) -> tuple[list, bool]:
    """``tensors`` with each complete in-order run of one split's pieces replaced by its input
    (a run of the pieces' casts to one dtype by one cast of the input, added before ``cat``)."""
    out, changed, i = [], False, 0
    while i < len(tensors):
        p, dtype = _piece(tensors[i])
        if p is not None and p[1] == 0:
            split = p[0]
            n = len(split.args[1])
            run = tensors[i:i + n]
            if len(run) == n and all(_piece(v) == ((split, k), dtype) for k, v in enumerate(run)):
                whole = split.args[0]
                if dtype is not None:
                    with graph.inserting_before(cat):
                        whole = graph.call_method("to", (whole, dtype))
                    rename(whole, f"{split.args[0].name}_{dtype_short(dtype)}")
                out.append(whole)
                changed, i = True, i + n
                continue
        out.append(tensors[i])
        i += 1
    return out, changed


def _columns(tensors: list, dim: int) -> bool:
    """Whether the cat joins 2-D pieces along their columns."""
    vals = [v.meta.get("val") for v in tensors if isinstance(v, fx.Node)]
    return len(vals) == len(tensors) and all(isinstance(v, torch.Tensor) and v.dim() == 2 for v in vals) \
        and dim in (1, -1)


@register_pass(after=("batch_tables", "fuse_interaction"))
def fold_column_cat(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Read a split's input where a column cat puts all its pieces back together in order."""
    graph = gm.graph
    folded = 0
    for cat in list(graph.nodes):
        parts = _cat_parts(cat)
        if parts is None or not _columns(*parts):
            continue
        tensors, dim = parts
        new, changed = _folded(graph, cat, tensors)
        if not changed:
            continue
        folded += 1
        splits = {p[0] for p, _ in map(_piece, tensors) if p is not None}
        casts = [v for v in tensors if _cast_of(v) is not None]
        if len(new) == 1:
            cat.replace_all_uses_with(new[0])
            graph.erase_node(cat)
        else:
            if cat.args:
                cat.args = (new,) + tuple(cat.args[1:])
            else:
                cat.kwargs = {**cat.kwargs, "tensors": new}
            # The pieces' lines, which named each table's columns, are gone: say it here.
            by_source = {split.args[0]: split for split in splits}
            # (a folded run of casts reads the split's input through its one cast)
            sources = {v: _cast_of(v)[0] if _cast_of(v) is not None else v for v in new}
            cat.meta["recc.notes"] = tuple(cat.meta.get("recc.notes", ())) + tuple(
                f"{v.name} = {' | '.join(_table_name(p) for p in _pieces(by_source[sources[v]]))}"
                for v in new if sources[v] in by_source)
        for cast in casts:
            if not cast.users:
                graph.erase_node(cast)
        for split in splits:
            for piece in [u for u in split.users if not u.users]:
                graph.erase_node(piece)
            if not split.users:
                graph.erase_node(split)
    ctx.stats["folded_cats"] = folded
    graph.lint()
    return gm
