"""quantize_comm: send embedding payloads in a narrower wire format, forward and backward.

Contract: requires ``insert_comm``. For every output dist (the pooled all-to-all; row-wise
sharding's reduce-scatter is the same exchange) it wraps the payload in a ``recc.quantize`` /
``recc.dequantize`` pair: the forward rows travel in ``fwd``, their gradients in ``bwd``. The
ids all-to-all is left alone (ids are exact integers). Data-parallel groups' backward gradient
all-gather travels in ``bwd``, their gradient all-reduce in ``allreduce``. The dense gradient
all-reduce gets ``allreduce`` through a DDP communication hook (fp16/bf16 only: an all-reduce
sums on the wire, which block-scaled int8/fp8 codes cannot do). Precisions: ``fp32 | fp16 | bf16 | int8 | fp8`` (``fp8`` is e4m3 forward, e5m2
backward; byte layouts in ``recc.kernels.codecs``). A collective whose two directions are both
``fp32`` is left as it is. Ensures every ``recc.quantize`` reaches exactly one
``recc.dequantize`` through the collective and that the collective's ``CommSpec`` names both
codecs. Must not change what the graph computes beyond the codecs' rounding (with ``fp32``
everywhere it changes nothing).

Defaults follow Neo (ISCA 2022): FP16 forward, BF16 backward; set them with
``CompileConfig(comm_fwd=, comm_bwd=, comm_allreduce=)`` or ``quantize_comm{fwd=int8,bwd=bf16}``,
and per collective (by name, or by table group) with ``per_collective``, e.g.
``CompileConfig(pass_options={"quantize_comm": {"per_collective": {"g1": {"fwd": "int8"}}}})``.

Before:
    pooled_g0  : f32[16,8]    = recc.tbe_lookup(tbe_g0, ids_g0)
    emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0, comm=output_dist)  # comm output_dist over [0, 1] ...
    emb_g0     : f32[8,12]    = recc.all_to_all_wait(emb_g0_h)
After:
    pooled_g0  : f32[16,8]    = recc.tbe_lookup(tbe_g0, ids_g0)
    pooled_g0_q : f16[16,8]   = recc.quantize(pooled_g0, precision='fp16', grad_precision='bf16', parts=2)
    emb_g0_h   : handle       = recc.all_to_all_start(pooled_g0_q, comm=output_dist)  # comm output_dist over [0, 1] splits=[8, 8] fp16/bf16: ...
    emb_g0_q   : f16[8,12]    = recc.all_to_all_wait(emb_g0_h)
    emb_g0     : f32[8,12]    = recc.dequantize(emb_g0_q, dtype='fp32')
"""
from __future__ import annotations

import dataclasses
import json
from typing import Union

import torch
import torch.fx as fx

from recc.graph_utils import rename
from recc.ops import OPS, WIRE_DTYPES, op_of
from recc.passmanager import PassContext, register_pass

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
ALLREDUCE_PRECISIONS = ("fp32", "fp16", "bf16")


def wire_codec(precision: str, direction: str) -> str:
    """The codec name of a user-facing precision for one direction (fp8: e4m3 fwd, e5m2 bwd)."""
    if precision not in PRECISIONS:
        raise ValueError(f"quantize_comm: {direction} precision {precision!r} is not one of {PRECISIONS}")
    if precision == "fp8":
        codec = "fp8_e4m3" if direction == "fwd" else "fp8_e5m2"
        if WIRE_DTYPES[codec] is torch.uint8:
            raise ValueError(f"quantize_comm: {direction}=fp8 needs torch's float8 dtypes, which torch "
                             f"{torch.__version__} lacks; choose fp16, bf16 or int8")
        return codec
    return precision


def _overrides(per_collective, names: list[str]) -> dict[str, tuple[str, str]]:
    """``{"output_dist g1": {"fwd": "int8"}}`` (or keyed by group, ``{"g1": ...}``) -> codecs."""
    if per_collective is None:
        return {}
    if isinstance(per_collective, str):  # from a pipeline spec string: JSON
        try:
            per_collective = json.loads(per_collective)
        except json.JSONDecodeError as e:
            raise ValueError(f"quantize_comm: per_collective={per_collective!r} is not JSON: {e}") from None
    if not isinstance(per_collective, dict):
        raise ValueError(f"quantize_comm: per_collective must be a dict, got {per_collective!r}")
    out = {}
    for key, value in per_collective.items():
        hits = [n for n in names if n == key or n.split(" ")[-1] == key]
        if not hits:
            raise ValueError(f"quantize_comm: per_collective names {key!r}, which is no embedding collective "
                             f"of this graph; collectives: {', '.join(names) or 'none'} (or their groups)")
        if not isinstance(value, dict) or set(value) - {"fwd", "bwd"}:
            raise ValueError(f"quantize_comm: per_collective[{key!r}] must be a dict with 'fwd' and/or 'bwd', "
                             f"got {value!r}")
        for name in hits:
            out[name] = value
    return out


@register_pass(after=("insert_comm",), from_config={"fwd": "comm_fwd", "bwd": "comm_bwd",
                                                     "allreduce": "comm_allreduce"})
def quantize_comm(gm: fx.GraphModule, ctx: PassContext, *, fwd: str = "fp16", bwd: str = "bf16",
                  allreduce: str = "fp32", per_collective: Union[dict, str, None] = None) -> fx.GraphModule:
    """Wrap each embedding collective's payload in quantize/dequantize (fwd and bwd codecs;
    ``per_collective`` overrides them for some, e.g. ``{"g1": {"fwd": "int8"}}``)."""
    wire_codec(fwd, "fwd"), wire_codec(bwd, "bwd")
    if allreduce not in ALLREDUCE_PRECISIONS:
        raise ValueError(f"quantize_comm: allreduce={allreduce!r} cannot be carried: an all-reduce sums "
                         f"the payload on the wire and int8/fp8 codes with per-block scales cannot be "
                         f"summed; choose one of {ALLREDUCE_PRECISIONS}")
    gm.meta["recc.allreduce_precision"] = allreduce
    graph = gm.graph
    starts = [n for n in graph.nodes if op_of(n.target) is OPS["all_to_all_start"]
              and n.kwargs["comm"].op == "output_dist"]
    dp = [(n, gm.get_submodule(n.args[0].target)) for n in graph.nodes if op_of(n.target) is OPS["tbe_lookup"]]
    dp = [(n, g) for n, g in dp if g.data_parallel and g.dp_comm is not None]
    names = [n.kwargs["comm"].name for n in starts] + [g.dp_comm.name for _, g in dp]
    override = _overrides(per_collective, names)

    def codecs_of(name: str) -> tuple[str, str]:
        o = override.get(name, {})
        return wire_codec(o.get("fwd", fwd), "fwd"), wire_codec(o.get("bwd", bwd), "bwd")

    for start in starts:
        comm = start.kwargs["comm"]
        fwd_codec, bwd_codec = codecs_of(comm.name)
        if (fwd_codec, bwd_codec) == ("fp32", "fp32"):
            continue
        comm = dataclasses.replace(comm, precision=fwd_codec, grad_precision=bwd_codec)
        payload = start.args[0]
        (wait,) = start.users
        with graph.inserting_before(start):
            q = graph.call_function(OPS["quantize"], (payload,), {
                "precision": fwd_codec, "grad_precision": bwd_codec, "parts": len(comm.group)})
        start.args = (q,)
        start.kwargs = {**start.kwargs, "comm": comm}
        start.meta["recc.comm"] = comm
        with graph.inserting_after(wait):
            dq = graph.call_function(OPS["dequantize"], (wait,), {"dtype": "fp32"})
        wait.replace_all_uses_with(dq, delete_user_cb=lambda user: user is not dq)
        name = wait.name
        rename(wait, f"{name}_q")
        rename(dq, name)
        rename(q, f"{payload.name}_q")
    for lookup, group in dp:
        # A gathered batch's gradients take the backward codec; an all-reduce sums on the wire,
        # so it takes the all-reduce's precision, as the dense gradients do.
        grad = allreduce if group.dp_comm.op == "dp_grad_allreduce" else codecs_of(group.dp_comm.name)[1]
        group.dp_comm = dataclasses.replace(group.dp_comm, grad_precision=grad)
        lookup.meta["recc.comm"] = group.dp_comm
    return gm
