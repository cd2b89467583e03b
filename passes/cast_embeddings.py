"""cast_embeddings: pooled embeddings that only bf16 reads are written, sent and received in bf16.

Contract: requires ``cast_dense`` (runs after it, before ``lower``; the default pipeline runs it
when ``CompileConfig(dense_dtype="bf16")``; with ``dtype="fp32"`` it changes nothing). For every
``recc.tbe_lookup`` it follows the pooled rows forward — through the output dist's
``recc.quantize`` / all-to-all / ``recc.dequantize``, ``recc.split_cols``, ``getitem``, view and
reshape ops, ``cat``/``stack`` — to the nodes that compute with them. When every one of those
reads bf16 anyway — a cast to bf16 (``cast_dense`` places one before each matrix product), or a
``recc.dot_interaction`` whose dense input, and so its output, is bf16 — it rewrites the path:

- the lookup writes bf16 (``dtype='bf16'``: each bag pooled in fp32 and rounded once, the bits
  of the fp32 result's ``.to(torch.bfloat16)``) and its fused update reads the bf16 gradient;
- the output dist's forward wire becomes bf16 where it was a cast (``fp16`` or ``fp32``): the
  rows go out as the lookup wrote them, with no encode pass, and arrive in the consumer's
  dtype. Nothing is lost: the consumer rounds to bf16 in any case, rounding once at the sender
  gives the same bits as at the receiver, and fp16 on the way would round twice (and overflow
  past 65504). Block-scaled codecs (``int8``, ``fp8``) are kept and decode into bf16;
- ``recc.dequantize`` hands the arrived bf16 rows over as bf16 (``dtype='bf16'``: a copy into
  place where the tables' columns come from several ranks, no conversion); backward, the
  consumer's bf16 gradient goes back on a bf16 wire (the default ``comm_bwd``) as it is;
- the casts to bf16 it reached, whose inputs are now bf16, are removed.

A lookup whose rows reach anything else — an fp32 op, an fp32 interaction, the model's output,
an output dist the user set to fp32 both ways (no ``recc.quantize``) — keeps fp32. Only bf16:
the kernels pool into fp32 or bf16 (an fp16 dense compile on CUDA keeps fp32 rows). On CUDA the
lookup's fp32 kernel output is cast (one pass), the exchange is the same. Must not change what
the graph computes beyond rounding the rows to bf16 before a consumer that rounds them to bf16
(the interaction's products then read bf16 inputs, as ``torch.autocast`` gives ``bmm``).

Before:
    pooled_g0   : f32[16,8]  = recc.tbe_lookup(tbe_g0, ids_g0)
    pooled_g0_q : f16[16,8]  = recc.quantize(pooled_g0, precision='fp16', grad_precision='bf16', parts=2)
    emb_g0_q    : f16[8,12]  = recc.all_to_all_wait(emb_g0_h)
    emb_g0      : f32[8,12]  = recc.dequantize(emb_g0_q, dtype='fp32')
    cat         : bf16[8,10] = recc.dot_interaction(bot_l_3, [emb_g0], li, lj, features=(...))
After:
    pooled_g0   : bf16[16,8] = recc.tbe_lookup(tbe_g0, ids_g0, dtype='bf16')
    pooled_g0_q : bf16[16,8] = recc.quantize(pooled_g0, precision='bf16', grad_precision='bf16', parts=2)
    emb_g0_q    : bf16[8,12] = recc.all_to_all_wait(emb_g0_h)
    emb_g0      : bf16[8,12] = recc.dequantize(emb_g0_q, dtype='bf16')
    cat         : bf16[8,10] = recc.dot_interaction(bot_l_3, [emb_g0], li, lj, features=(...))
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from recc.ops import OPS, op_of
from recc.passmanager import PassContext, register_pass
from recc.specs import CAST_PRECISIONS
from recc.trace import propagate_shapes

# Ops the rows pass through unchanged in dtype (a view, a piece, a concatenation).
_THROUGH_FUNCTIONS = {operator.getitem, torch.split, torch.chunk, torch.flatten, torch.reshape, torch.squeeze,
                      torch.unsqueeze, torch.narrow, torch.transpose, torch.permute, torch.unbind, torch.cat,
                      torch.concat, torch.stack}
_THROUGH_METHODS = {"view", "reshape", "flatten", "squeeze", "unsqueeze", "narrow", "contiguous", "split", "chunk",
                    "transpose", "permute", "unbind", "t"}
_THROUGH_OPS = ("split_cols", "all_to_all_wait")


def _casts_to(node: fx.Node, low: torch.dtype) -> bool:
    """``x.to(low)`` / ``x.to(dtype=low)`` / ``x.bfloat16()``."""
    if node.op != "call_method":
        return False
    if node.target == "bfloat16":
        return low == torch.bfloat16 and len(node.args) == 1
    if node.target != "to":
        return False
    dtypes = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)]
    return dtypes == [low]


def _reads_low(node: fx.Node, low: torch.dtype) -> bool:
    if _casts_to(node, low):
        return True
    if op_of(node.target) is OPS["dot_interaction"]:
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and val.dtype == low
    return False


def _path(lookup: fx.Node, low: torch.dtype):
    """``(quantizes, dequantizes, casts)`` on the way from ``lookup`` to its consumers when every
    consumer reads ``low``; None otherwise."""
    quantizes, dequantizes, casts = [], [], []
    todo, seen = [lookup], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if not node.users:
            return None
        for user in node.users:
            op = op_of(user.target)
            if user.op == "output":
                return None
            if op is OPS["quantize"]:
                quantizes.append(user)
                todo.append(user)
            elif op is OPS["all_to_all_start"]:
                comm = user.kwargs["comm"]
                if comm.op != "output_dist" or op_of(node.target) is not OPS["quantize"]:
                    return None  # an fp32 exchange the user chose (no codec): left as it is
                todo.append(user)
            elif op is OPS["dequantize"]:
                dequantizes.append(user)
                todo.append(user)
            elif op is not None and op.name in _THROUGH_OPS or \
                    user.op == "call_function" and user.target in _THROUGH_FUNCTIONS or \
                    user.op == "call_method" and user.target in _THROUGH_METHODS:
                todo.append(user)
            elif _reads_low(user, low):
                if _casts_to(user, low):
                    casts.append(user)
            else:
                return None
    return quantizes, dequantizes, casts


@register_pass(after=("cast_dense",), from_config={"dtype": "dense_dtype"},
               when=lambda config, cluster, gm: config.dense_dtype != "fp32")
def cast_embeddings(gm: fx.GraphModule, ctx: PassContext, *, dtype: str = "fp32") -> fx.GraphModule:
    """Pooled rows that only bf16 consumers read: looked up, sent and received in bf16."""
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"cast_embeddings: dtype {dtype!r} is not one of ('fp32', 'bf16', 'fp16')")
    if dtype != "bf16":
        return gm  # fp32: nothing to do; fp16 (CUDA): the lookups write fp32 or bf16 only
    low = torch.bfloat16
    graph = gm.graph
    narrowed, casts = 0, {}
    for lookup in [n for n in graph.nodes if op_of(n.target) is OPS["tbe_lookup"]]:
        if lookup.kwargs.get("dtype", "fp32") != "fp32":
            continue
        path = _path(lookup, low)
        if path is None:
            continue
        quantizes, dequantizes, found = path
        lookup.kwargs = {**lookup.kwargs, "dtype": "bf16"}
        for q in quantizes:
            if q.kwargs["precision"] in CAST_PRECISIONS:
                q.kwargs = {**q.kwargs, "precision": "bf16"}
                for start in list(q.users):  # the collective's spec names its codecs
                    comm = dataclasses.replace(start.kwargs["comm"], precision="bf16")
                    start.kwargs = {**start.kwargs, "comm": comm}
                    start.meta["recc.comm"] = comm
        for dq in dequantizes:
            dq.kwargs = {**dq.kwargs, "dtype": "bf16"}
        casts.update(dict.fromkeys(found))
        narrowed += 1
    if not narrowed:
        ctx.stats["bf16_lookups"] = 0
        return gm
    graph.lint()
    gm.recompile()
    propagate_shapes(gm, ctx.example_inputs, ctx.abstract)
    for c in casts:
        if c.args[0].meta.get("val") is not None and c.args[0].meta["val"].dtype == low:
            c.replace_all_uses_with(c.args[0])
            graph.erase_node(c)
    ctx.stats["bf16_lookups"] = narrowed
    return gm
