"""Small graph-editing helpers shared by passes."""
from __future__ import annotations

import operator
import weakref
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from recc.ops import OPS, op_of

# node.meta[STAGE] names the pipeline stage a node runs in (set by pipeline_comm, read by the
# IR printer and the runtime); SPARSE_DIST is the stage that runs one batch ahead.
STAGE = "recc.stage"
SPARSE_DIST = "sparse_dist"


def value_dim(node) -> int | None:
    """Dimensions of the tensor ``node`` computes (from its shape annotation), else None."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def split_cols_piece(v) -> Optional[tuple[fx.Node, int]]:
    """``(split, k)`` when ``v`` is piece k of a ``recc.split_cols`` (``getitem(split, k)``), else
    None: how a batched lookup's per-table columns appear to the passes that read them in place."""
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target is operator.getitem):
        return None
    split, k = v.args
    if not (isinstance(split, fx.Node) and split.op == "call_function" and op_of(split.target) is OPS["split_cols"]
            and isinstance(k, int)):
        return None
    return split, k


def resolve_attr(root, path: str):
    """``root.a.b.c`` for ``path="a.b.c"``, or None when any step is missing."""
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def stable_toposort(graph: fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, moving as little as possible.

    Passes that replace several nodes by one batched node insert it where all its inputs exist;
    a user of one of the replaced nodes may then sit earlier than the batched node. This puts
    each node at the earliest position its inputs allow while keeping the original relative
    order of independent nodes (placeholders first, output last).
    """
    order = list(graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    placed: set[fx.Node] = set()
    result: list[fx.Node] = []
    pending = list(order)
    while pending:
        progressed = False
        rest = []
        for n in pending:
            if all(i in placed for i in n.all_input_nodes):
                result.append(n)
                placed.add(n)
                progressed = True
            else:
                rest.append(n)
        if not progressed:
            raise RuntimeError(f"graph has a cycle through {rest[0].name}")
        pending = sorted(rest, key=position.__getitem__)
    if result == order:
        return
    anchor = result[0]
    for n in result[1:]:
        anchor.append(n)
        anchor = n


def rename(node: fx.Node, name: str) -> None:
    """Give ``node`` the name of a node that was just erased, so the IR reads the same.

    fx keeps an erased node's name reserved; it is released here when no live node holds it.
    Whether one does is looked up in an index of the graph's names (``_live_holder``), not by
    scanning the graph: a pass renaming each of N tables' nodes was N^2.
    """
    if node.name == name:
        return
    graph = node.graph
    used = graph._graph_namespace._used_names
    if name in used and _live_holder(graph, name) is None:
        used.discard(name)
    # If a live node (e.g. one of the user's) already has the name, fx picks a unique variant.
    node._rename(name)
    index = _NAME_INDEX.get(graph)
    if index is not None:
        index[0][node.name] = node
        index[1].add(node.name)


# graph -> (name -> the node that had it when indexed or renamed here, the names fx had used by
# then). A name fx had used by then can only be taken again after fx releases it, which only
# ``rename`` does (and records): so the node recorded for it is its live holder if it is still
# live and still called so, and no live node holds it otherwise. A name used since is re-indexed.
_NAME_INDEX: "weakref.WeakKeyDictionary[fx.Graph, tuple[dict[str, fx.Node], set[str]]]" = weakref.WeakKeyDictionary()


def _live_holder(graph: fx.Graph, name: str) -> Optional[fx.Node]:
    index = _NAME_INDEX.get(graph)
    if index is None or name not in index[1]:
        index = ({n.name: n for n in graph.nodes}, set(graph._graph_namespace._used_names))
        _NAME_INDEX[graph] = index
    n = index[0].get(name)
    return n if n is not None and not n._erased and n.graph is graph and n.name == name else None


def replace_uses(node: fx.Node, new: fx.Node, pending: dict) -> None:
    """``node.replace_all_uses_with(new)``, except that a user with many inputs (the ``cat`` of
    every table's output) only has its links moved now; its arguments are rebuilt once, for all
    the nodes replaced in it, by ``flush_uses(pending)``, which must run before anything reads
    them. fx rebuilds all of a user's arguments per replacement: N tables swapped one at a time
    into one N-input node were N^2. The users end as ``replace_all_uses_with`` leaves them (the
    wide user last among each of its inputs' users, its inputs in argument order)."""
    hooks = getattr(node.graph.owning_module, "_replace_hooks", None)
    for user in list(node.users):
        if hooks or len(user._input_nodes) < WIDE_USER:
            user._replace_input_with(node, new)
            continue
        pending.setdefault(user, {})[node] = new
        del node.users[user]
        del user._input_nodes[node]
        user._input_nodes.setdefault(new)
        new.users.setdefault(user)


WIDE_USER = 32  # inputs from which replace_uses defers a user's argument rebuild


def flush_uses(pending: dict) -> None:
    """Rebuild the arguments of the users ``replace_uses`` deferred, once each."""
    for user, swaps in pending.items():
        def swap(n, swaps=swaps):
            while n in swaps:
                n = swaps[n]
            return n
        user._update_args_kwargs(fx.node.map_arg(user._args, swap), fx.node.map_arg(user._kwargs, swap))
    pending.clear()


# Matrix products: autocast's "lower precision" ops, which cast_dense runs in bf16 and whose
# autocast region capture records (``trace.autocast_of``).
MATRIX_FUNCTIONS = {F.linear, torch.mm, torch.bmm, torch.matmul, torch.addmm, torch.baddbmm, operator.matmul,
                    F.conv1d, F.conv2d}
MATRIX_METHODS = {"mm", "bmm", "matmul", "addmm", "baddbmm"}
MATRIX_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d)   # exact classes (a subclass may have its own forward)


def is_matrix_product(root: nn.Module, node: fx.Node) -> bool:
    """Whether ``node`` is a matrix product of the user's graph: one of ``MATRIX_FUNCTIONS`` or
    ``MATRIX_METHODS``, or a call of exactly an ``nn.Linear``/``nn.Conv1d``/``nn.Conv2d``."""
    if node.op == "call_function":
        return node.target in MATRIX_FUNCTIONS
    if node.op == "call_method":
        return node.target in MATRIX_METHODS
    return node.op == "call_module" and type(root.get_submodule(node.target)) in MATRIX_MODULES
