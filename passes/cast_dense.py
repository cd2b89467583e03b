"""cast_dense: run the dense part in bf16 — matrix products in bf16, fp32 master weights.

Contract: requires nothing but a traced graph (runs after ``fuse_linear_act``, so dense layers
are ``recc.linear``). The default pipeline runs it when ``CompileConfig(dense_dtype=)`` is not
``fp32``; with ``dtype="fp32"`` it changes nothing. With ``dtype="bf16"`` it decides per op as ``torch.autocast("cpu",
torch.bfloat16)`` does, but once, at compile time, and as graph nodes:

- matrix products (``recc.linear``, ``nn.Linear``/``nn.Conv1d`` modules left unfused, ``F.linear``,
  ``torch.mm``/``bmm``/``matmul``/``addmm``/``baddbmm``, ``@``) take bf16 inputs: every fp32 input —
  activations, and the parameters, read by ``get_attr`` — gets one ``.to(torch.bfloat16)``, shared by
  all its consumers. A parameter is therefore cast once per step,
  and its gradient flows back through the cast into the fp32 master weight (the optimizer, DDP and
  ``state_dict`` see fp32). Products accumulate in fp32 inside the GEMM (oneDNN/MKL bf16 kernels).
- ops that lose accuracy in bf16 — ``sigmoid``, losses (``binary_cross_entropy[_with_logits]``),
  ``softmax``/``log_softmax``, BatchNorm and LayerNorm, and ``recc.pairwise_dot`` (an fp32 kernel)
  — take fp32 inputs (a ``.to(torch.float32)`` on each bf16 one);
- ``recc.dot_interaction`` takes its inputs as they are — a bf16 bottom MLP output and the fp32
  pooled embeddings (which ``cast_embeddings``, next, turns bf16 at the lookup) — computes its dot
  products in fp32 and returns ``dense``'s dtype, so between a bf16 bottom and top MLP it reads and
  writes bf16 with no cast on either side;
- everything else runs in whatever dtype its inputs have (torch's type promotion: ``relu``, ``cat``,
  elementwise ops stay bf16 between products; a bf16 value meeting an fp32 one is fp32);
- a product whose result only those fp32 ops read, or the output (the model's head, whose logit
  the sigmoid or loss reads) stays fp32: its bf16 result would be cast straight back, and bf16
  logits (8 mantissa bits) tie predictions, which costs AUC. A ``recc.linear`` head takes its
  bf16 input as it is, next to its fp32 weight: the op computes in the wider dtype and widens x
  itself (exactly), so no fp32 copy of the activation is written, nor a bf16 one of its gradient
  (kaggle's [4096, 256]: the two casts took 0.6 ms a step);
- the model's floating outputs are returned in fp32, as the user's loss expects them (tensors
  returned directly or in a list/tuple/dict of the output; a tuple-valued node such as
  ``h.chunk(2)`` returned whole keeps its dtype);
- any other module with floating parameters of its own (``nn.MultiheadAttention``, RNNs,
  ``nn.PReLU``, a user's leaf) runs in fp32: its parameters are fp32.

Casts are inserted wherever a rule asks for one — right before the first node that needs it, so
an in-place op on the value before that is included — the graph's dtypes are propagated, and every
cast whose input already has its dtype is removed: a cast appears only where the dtype changes,
once per value. Embedding lookups are left to ``cast_embeddings`` (their tables and fused optimizers
stay fp32; the rows they pool go bf16 where only bf16 reads them). ``fp16`` is for
CUDA with dynamic loss scaling and is refused here on CPU. Must not change what the graph computes
beyond bf16 rounding of the products' inputs and outputs.

Before:
    bot_l_0_weight : f32[8,13] = get_attr bot_l.0.weight
    bot_l_1        : f32[8,8]  = recc.linear(dense_x, bot_l_0_weight, bot_l_0_bias, activation='relu')
    ...
    top_l_2        : f32[8,1]  = recc.linear(top_l_1, top_l_2_weight, top_l_2_bias, activation='none')
    top_l_3        : f32[8,1]  = top_l.3(top_l_2)      # nn.Sigmoid
After:
    bot_l_0_weight      : f32[8,13]  = get_attr bot_l.0.weight
    dense_x_bf16        : bf16[8,13] = dense_x.to(torch.bfloat16)
    bot_l_0_weight_bf16 : bf16[8,13] = bot_l_0_weight.to(torch.bfloat16)
    bot_l_1             : bf16[8,8]  = recc.linear(dense_x_bf16, bot_l_0_weight_bf16, bot_l_0_bias_bf16, activation='relu')
    ...
    top_l_2             : f32[8,1]   = recc.linear(top_l_1, top_l_2_weight, top_l_2_bias, activation='none')  # bf16 x, f32 weight
    top_l_3             : f32[8,1]   = top_l.3(top_l_2)
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from recc.config import DENSE_TORCH_DTYPES
from recc.graph_utils import MATRIX_FUNCTIONS, MATRIX_METHODS, MATRIX_MODULES, rename
from recc.ir import dtype_short
from recc.ops import OPS, op_of
from recc.passmanager import PassContext, register_pass
from recc.trace import propagate_shapes


# Matrix products (autocast's "lower precision" ops) are graph_utils.MATRIX_*.
# Ops kept in fp32 (autocast's fp32 list, plus sigmoid for the model's probabilities).
_FP32_FUNCTIONS = {torch.sigmoid, F.sigmoid, F.binary_cross_entropy, F.binary_cross_entropy_with_logits,
                   F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, F.batch_norm, F.layer_norm,
                   F.mse_loss, F.cross_entropy, F.nll_loss}
_FP32_METHODS = {"sigmoid", "softmax", "log_softmax"}
_FP32_MODULES = (nn.Sigmoid, nn.Softmax, nn.LogSoftmax, nn.modules.batchnorm._BatchNorm, nn.LayerNorm,
                 nn.BCELoss, nn.BCEWithLogitsLoss, nn.MSELoss, nn.CrossEntropyLoss)
_FP32_RECC_OPS = ("pairwise_dot",)


def _wants(gm: fx.GraphModule, node: fx.Node, low: torch.dtype):
    """The dtype ``node`` computes in (``low`` for products, fp32 for the fp32 list), or None
    when it follows its inputs."""
    if node.op == "call_function":
        op = op_of(node.target)
        if op is not None:
            return low if op is OPS["linear"] else torch.float32 if op.name in _FP32_RECC_OPS else None
        return low if node.target in MATRIX_FUNCTIONS else torch.float32 if node.target in _FP32_FUNCTIONS else None
    if node.op == "call_method":
        return low if node.target in MATRIX_METHODS else torch.float32 if node.target in _FP32_METHODS else None
    if node.op == "call_module":
        # (Linear/Conv calls were rewritten as functions before this; the ones left — a circular
        # padded conv, a keyword call — keep their module and so their fp32 parameters.)
        mod = gm.get_submodule(node.target)
        if isinstance(mod, _FP32_MODULES) or any(p.is_floating_point() for p in mod.parameters()):
            # Any other module with weights of its own (MultiheadAttention, LSTM/GRU, PReLU, a
            # circular-padded Conv, a user's leaf): its parameters are fp32, so its inputs are too.
            return torch.float32
    return None


def _is_float(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _as_function(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is an unfused ``nn.Linear``/``nn.Conv1d``/``nn.Conv2d`` call (exactly those
    classes, zero padding) that ``_module_as_function`` rewrites."""
    if node.op != "call_module":
        return False
    mod = gm.get_submodule(node.target)
    if type(mod) not in MATRIX_MODULES or len(node.args) + len(node.kwargs) != 1:
        return False
    return type(mod) is nn.Linear or mod.padding_mode == "zeros"


def _module_as_function(gm: fx.GraphModule, node: fx.Node) -> None:
    """An unfused ``nn.Linear``/``nn.Conv*`` call as ``F.linear``/``F.conv*`` on its parameters read
    by ``get_attr`` (a module call would meet its fp32 parameters with a bf16 input)."""
    mod = gm.get_submodule(node.target)
    graph = gm.graph
    x = node.args[0] if node.args else next(iter(node.kwargs.values()))
    with graph.inserting_before(node):
        w = graph.get_attr(f"{node.target}.weight")
        b = graph.get_attr(f"{node.target}.bias") if mod.bias is not None else None
        if type(mod) is nn.Linear:
            new = graph.call_function(F.linear, (x, w, b))
        else:
            fn = F.conv1d if type(mod) is nn.Conv1d else F.conv2d
            new = graph.call_function(fn, (x, w, b, mod.stride, mod.padding, mod.dilation, mod.groups))
    new.meta.update(node.meta)
    name = node.name
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    rename(new, name)


@register_pass(after=("fuse_linear_act",), from_config={"dtype": "dense_dtype"},
               when=lambda config, cluster, gm: config.dense_dtype != "fp32", required=True, tolerance=3e-2)
def cast_dense(gm: fx.GraphModule, ctx: PassContext, *, dtype: str = "fp32") -> fx.GraphModule:
    """Place the casts that run the dense products in ``dtype`` with fp32 master weights."""
    if dtype not in DENSE_TORCH_DTYPES:
        raise ValueError(f"cast_dense: dtype {dtype!r} is not one of {tuple(DENSE_TORCH_DTYPES)}")
    if dtype == "fp32":
        return gm
    if dtype == "fp16" and ctx.cluster.device_type != "cuda":
        raise ValueError("cast_dense: dtype='fp16' needs dynamic loss scaling and fp16 GEMMs (CUDA); on CPU use "
                         "dense_dtype='bf16'")
    low = DENSE_TORCH_DTYPES[dtype]
    graph = gm.graph
    modules = [n for n in graph.nodes if _as_function(gm, n)]
    for node in modules:
        _module_as_function(gm, node)
    if modules:  # the parameters' new get_attr nodes need their dtypes
        gm.recompile()
        propagate_shapes(gm, ctx.example_inputs, ctx.abstract)
    casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}

    mine: set[fx.Node] = set()

    def cast(value: fx.Node, to: torch.dtype, consumer: fx.Node) -> fx.Node:
        # Right before the first consumer that needs it (graph order): an in-place op on the value
        # between its producer and that consumer (h.clamp_(...)) is in the cast.
        if (value, to) not in casts:
            with graph.inserting_before(consumer):
                c = graph.call_method("to", (value, to))
            rename(c, f"{value.name}_{dtype_short(to)}")
            casts[value, to] = c
            mine.add(c)
        return casts[value, to]

    for node in list(graph.nodes):
        want, as_is = _wants(gm, node, low), None
        if want == low and _feeds_fp32_only(gm, node, low):
            want = torch.float32  # the model's head: its result is only read in fp32
            if node.op == "call_function" and op_of(node.target) is OPS["linear"]:
                as_is = node.args[0]  # recc.linear widens its input itself
        if want is None:
            continue
        for arg in node.all_input_nodes:
            if _is_float(arg) and arg not in mine and arg is not as_is:
                node.replace_input_with(arg, cast(arg, want, node))
    out = next(n for n in graph.nodes if n.op == "output")
    for arg in out.all_input_nodes:
        if _is_float(arg):
            out.replace_input_with(arg, cast(arg, torch.float32, out))
    graph.lint()
    gm.recompile()
    propagate_shapes(gm, ctx.example_inputs, ctx.abstract)
    removed = 0
    for c in casts.values():
        src, to = c.args
        if src.meta.get("val") is not None and src.meta["val"].dtype == to:
            c.replace_all_uses_with(src)
            graph.erase_node(c)
            removed += 1
    ctx.stats["dense_casts"] = len(casts) - removed
    return gm


_SHAPE_METHODS = {"squeeze", "unsqueeze", "view", "reshape", "flatten", "contiguous", "float"}


def _feeds_fp32_only(gm: fx.GraphModule, node: fx.Node, low: torch.dtype) -> bool:
    """Whether every use of ``node``'s result, through shape ops, is an fp32-list op or the
    model's output. Such a product stays fp32: a bf16 result would only be cast back, and bf16
    logits — 8 mantissa bits — tie many predictions, which costs AUC (bench/precision_quality.py)."""
    users = list(node.users)
    if not users:
        return False
    for u in users:
        if u.op == "output":
            continue
        if u.op == "call_method" and u.target in _SHAPE_METHODS or \
                u.op == "call_function" and u.target in (torch.squeeze, torch.flatten, torch.reshape):
            if not _feeds_fp32_only(gm, u, low):
                return False
            continue
        if _wants(gm, u, low) != torch.float32:
            return False
    return True


