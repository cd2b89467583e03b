"""fuse_gathers: a group of ``nn.Embedding`` gathers whose tables are all here becomes one
``recc.gather_rows`` that returns each table's rows as its own tensor.

Contract: requires ``batch_tables`` (and runs after ``insert_comm``, so a group whose ids or rows
travel keeps its collectives). For every ``recc.tbe_lookup`` whose ids come straight from its
``recc.pack_sparse`` on a one-rank cluster (no input dist, no gradient all-gather), whose tables are
whole on that rank and all gathers (``pooling='none'``: bags of one id, ``[N, 1]`` ids, no offsets, no per-sample
weights), and whose every output column block is read only by ``recc.rows_like``, the chain
``pack_sparse -> tbe_lookup -> split_cols -> getitem`` becomes ``recc.gather_rows`` and a
``getitem`` per table; a ``rows_like`` of 1-D ids (a jagged table's values) goes too, the
piece is its result, and the others stay (on a piece of exactly the ids' count they only
reshape). CPU clusters only (the CUDA backend keeps the chain). Must not change what the
graph computes; the update in backward is the same fused optimizer step.

Why: the generic chain pads every jagged table to the group's largest id count, builds offsets,
writes the rows batch-major and then copies each table's column block out contiguous; one-id
lookups need none of it. On ``torchrec_seq`` (two ``EmbeddingCollection`` sequences) this is
most of what made recc's forward slower than eager's two ``index_select`` calls.

Before:
    sparse_g0 : kjt[t=2,b=32] = recc.pack_sparse([hist_ids, cat_ids], [None, None], None, tables=(...), rows=(50, 20), pad=True)
    pooled_g0 : f32[32,16]   = recc.tbe_lookup(tbe_g0, sparse_g0)
    tables_g0 : tuple[2x f32[32,8]] = recc.split_cols(pooled_g0, (8, 8))
    hist_rows : f32[32,8]    = getitem(tables_g0, 0)
    hist      : f32[32,8]    = recc.rows_like(hist_rows, hist_values)
After:
    rows_g0   : tuple[2x f32[32,8]] = recc.gather_rows(tbe_g0, [hist_ids, cat_ids], tables=(...), rows=(50, 20))
    hist      : f32[32,8]    = getitem(rows_g0, 0)
"""
from __future__ import annotations

import operator
from typing import Optional

import torch.fx as fx

from recc.graph_utils import rename, split_cols_piece
from recc.ops import OPS, op_of
from recc.passmanager import PassContext, register_pass


def _is(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and op_of(node.target) is OPS[name]


def _pieces(lookup: fx.Node) -> Optional[list[fx.Node]]:
    """The ``getitem`` nodes of ``lookup``'s only user, a ``split_cols``, in table order — if
    each is read by ``rows_like`` alone (as its rows); else None."""
    if len(lookup.users) != 1:
        return None
    split = next(iter(lookup.users))
    if not _is(split, "split_cols"):
        return None
    pieces = {}
    for g in split.users:
        if split_cols_piece(g) is None:
            return None
        if not g.users or any(not _is(u, "rows_like") or u.args[0] is not g or g in u.args[1:] for u in g.users):
            return None
        pieces[g.args[1]] = g
    return [pieces[k] for k in sorted(pieces)]


def _fusable(gm: fx.GraphModule, lookup: fx.Node) -> bool:
    group_node, sparse = lookup.args
    if not _is(sparse, "pack_sparse") or len(sparse.users) != 1 or group_node.op != "get_attr":
        return False
    ids, offsets, psw = sparse.args
    group = gm.get_submodule(group_node.target)
    if group.world_size != 1:
        # Sharded: the ids travel. Data-parallel: every replica applies the global batch's
        # update, the ids are gathered in backward.
        return False
    whole = [(k, 0, t.rows, 0, t.dim) for k, t in enumerate(group.tables)]
    if [(p[0], p[2], p[3], p[4], p[5]) for p in group.local] != whole or any(t.dim != group.dim for t in group.tables):
        return False  # a table split into blocks on this rank keeps the generic lookup
    if psw is not None or any(o is not None for o in offsets) or group.pooling != "sum" or group.weighted:
        return False
    if sparse.kwargs.get("stack"):
        return False  # a stacked feature's rows are split per lookup by recc.split_bags, not gathered apart
    if any(t.pooling != "none" for t in group.tables) or tuple(sparse.kwargs["tables"]) != group.feature_names:
        return False
    shapes = [i.meta.get("val") for i in ids]
    return all(s is not None and s.dim() == 2 and s.shape[1] == 1 for s in shapes)


def _flat_source(ids: fx.Node) -> Optional[fx.Node]:
    """``v`` when ``ids`` is ``v.reshape(-1, 1)`` of a 1-D ``v`` (a jagged table's values, as
    ``discover_tables`` writes the ids of a gather), else None."""
    if ids.op == "call_method" and ids.target == "reshape" and tuple(ids.args[1:]) == (-1, 1) and not ids.kwargs:
        v = ids.args[0]
        val = v.meta.get("val") if isinstance(v, fx.Node) else None
        return v if val is not None and val.dim() == 1 else None
    return None


@register_pass(after=("batch_tables", "insert_comm"))
def fuse_gathers(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite groups of whole-table gathers as ``recc.gather_rows``."""
    if ctx.cluster.device_type != "cpu":
        return gm
    graph = gm.graph
    for lookup in [n for n in graph.nodes if _is(n, "tbe_lookup")]:
        pieces = _pieces(lookup)
        if pieces is None or not _fusable(gm, lookup) or len(pieces) != len(lookup.args[1].args[0]):
            continue
        group_node, sparse = lookup.args
        split = next(iter(lookup.users))
        with graph.inserting_before(sparse):
            rows = graph.call_function(OPS["gather_rows"], (group_node, list(sparse.args[0])),
                                       {"tables": sparse.kwargs["tables"], "rows": sparse.kwargs["rows"]})
        for k, piece in enumerate(pieces):
            with graph.inserting_before(piece):
                new = graph.call_function(operator.getitem, (rows, k))
            new.meta.update({k: v for k, v in piece.meta.items() if k != "recc.pass"})  # new here, and says so
            name = piece.name
            piece.replace_all_uses_with(new)
            graph.erase_node(piece)
            rename(new, name)
            for like in list(new.users):
                if _flat_source(sparse.args[0][k]) is like.args[1]:
                    # The piece already is the gather's result: [numel(ids), D] for 1-D ids.
                    like_name = like.name
                    like.replace_all_uses_with(new)
                    graph.erase_node(like)
                    rename(new, like_name)
        name = f"rows_{group_node.target[4:]}" if group_node.target.startswith("tbe_") else None
        for n in (split, lookup, sparse):
            graph.erase_node(n)
        if name:
            rename(rows, name)
    graph.lint()
    return gm
