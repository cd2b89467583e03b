"""lower: bind every recc op to its implementation on the cluster's device.

Contract: requires nothing but a graph of recc ops. Ensures every ``call_function`` node whose
target is a recc ``Op`` targets a ``BoundOp`` for ``device`` (the cluster's device type unless
given), which calls the implementation the runtime registered for that device. Must not change
the graph's structure.

Before:
    pooled_g0 : f32[8,12] = recc.tbe_lookup(tbe_g0, sparse_g0)
After:
    pooled_g0 : f32[8,12] = recc.tbe_lookup[cpu](tbe_g0, sparse_g0)
"""
from __future__ import annotations

import torch.fx as fx

from recc.ops import Op, bind
from recc.passmanager import PassContext, register_pass


@register_pass
def lower(gm: fx.GraphModule, ctx: PassContext, *, device: str = "auto") -> fx.GraphModule:
    """Bind recc ops to the backend for ``device`` (default: the cluster's device type)."""
    device = ctx.cluster.device_type if device == "auto" else device
    if device not in ("cpu", "cuda"):
        raise ValueError(f"lower: device {device!r} is not 'cpu' or 'cuda'")
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, Op):
            n.target = bind(n.target, device)
    return gm
