"""align_linear: zero-pad the reduction dimension of misaligned ``nn.Linear`` layers.

Contract: requires nothing but a traced graph. Every ``nn.Linear`` called as a module whose
``in_features`` K is not a multiple of 4 and whose weight has at least ``min_weight`` elements
is computed as ``F.linear(F.pad(x, (0, P)), F.pad(weight, (0, P)), bias)`` with ``K + P`` the
next multiple of ``multiple``. The user's ``weight`` stays the parameter (the optimizer, DDP and
``state_dict`` see it unchanged); autograd slices the padded gradients back. Must not change
what the graph computes: the extra products are 0 * 0, so only the GEMM's summation blocking can
differ (fp32 rounding).

Why: GEMM libraries block K by the vector width. On this project's CPU (MKL, one core per rank)
a 2048 x 367 x 512 layer's forward + backward takes 31 ms and the same at K = 368 takes 24 ms
(the backward's ``grad @ W`` runs at 60% speed with a ragged K); the first layer's K = 13 -> 16
halves its weight-gradient GEMM. DLRM's top MLP input (dense features + F(F-1)/2 pairs: 367 on
Criteo Kaggle, 479 for 27 features of 16 + 128) is rarely aligned; GPU tensor cores likewise
want K in multiples of 16 bytes. Small layers (tiny test models) are left alone: the pad would
cost more than it saves. When the layer's input is a ``recc.dot_interaction`` used only there,
the interaction writes the zero columns itself (its ``pad``) instead of a padded copy being made.

Before (an input that is not a fused interaction; see above for that case):
    cat      : f32[2048,367] = torch.cat([bot_l_3, getitem], dim=1)
    top_l_0  : f32[2048,512] = top_l.0(cat)
After:
    top_l_0_weight : f32[512,367] = get_attr top_l.0.weight
    top_l_0_bias   : f32[512]     = get_attr top_l.0.bias
    cat_k8         : f32[2048,368] = torch.nn.functional.pad(cat, (0, 1))
    top_l_0_w_k8   : f32[512,368]  = torch.nn.functional.pad(top_l_0_weight, (0, 1))
    top_l_0        : f32[2048,512] = torch._C._nn.linear(cat_k8, top_l_0_w_k8, top_l_0_bias)
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from recc.graph_utils import rename
from recc.ops import OPS, op_of
from recc.passmanager import PassContext, register_pass


def k_padding(in_features: int, out_features: int, multiple: int = 8, min_weight: int = 4096) -> int:
    """Zero columns ``align_linear`` adds to a layer's K: up to the next multiple of ``multiple``
    when K is not a multiple of 4 and the weight has at least ``min_weight`` elements, else 0."""
    if in_features % 4 == 0 or in_features * out_features < min_weight:
        return 0
    return -in_features % multiple


@register_pass
def align_linear(gm: fx.GraphModule, ctx: PassContext, *, multiple: int = 8, min_weight: int = 4096) -> fx.GraphModule:
    """Pad misaligned Linear layers' K to a multiple of ``multiple`` (weights of at least
    ``min_weight`` elements; ``multiple=1`` turns the pass off)."""
    if multiple < 1:
        raise ValueError(f"align_linear: multiple must be >= 1, got {multiple}")
    graph = gm.graph
    padded = []
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        if type(mod) is not nn.Linear or len(node.args) != 1 or node.kwargs:
            continue
        k = mod.in_features
        pad = k_padding(k, mod.out_features, multiple, min_weight)
        if not pad:
            continue
        (x,) = node.args
        base = node.name
        pads_itself = (isinstance(x, fx.Node) and op_of(x.target) is OPS["dot_interaction"]
                       and len(x.users) == 1 and not x.kwargs.get("pad"))
        with graph.inserting_before(node):
            w = graph.get_attr(f"{node.target}.weight")
            b = graph.get_attr(f"{node.target}.bias") if mod.bias is not None else None
            if pads_itself:
                x.update_kwarg("pad", pad)
                x_pad = x
            else:
                x_pad = graph.call_function(F.pad, (x, (0, pad)))
            w_pad = graph.call_function(F.pad, (w, (0, pad)))
            out = graph.call_function(F.linear, (x_pad, w_pad, b))
        rename(w, f"{base}_weight")
        if b is not None:
            rename(b, f"{base}_bias")
        if not pads_itself:
            rename(x_pad, f"{x.name if isinstance(x, fx.Node) else base + '_in'}_k{multiple}")
        rename(w_pad, f"{base}_w_k{multiple}")
        padded.append(f"{node.target}:{k}->{k + pad}")
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rename(out, base)
    ctx.stats["aligned_linears"] = padded
    return gm
