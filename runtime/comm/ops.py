"""The communication ops in the runtime, for every device: collectives and codecs.

``recc.all_to_all_start``/``_wait`` dispatch on the ``CommSpec``'s op to ``input_dist`` or
``output_dist`` (torch.distributed: gloo on CPU, NCCL on GPUs; a one-rank group needs no
communication). ``recc.quantize`` encodes a payload into ``output_dist.Encoded`` chunks, one per
destination; ``recc.all_to_all_start``/``_wait`` move the bytes; ``recc.dequantize`` decodes what
arrived (``output_dist.ReceivedRows``) and reassembles the tables. The autograd edges live in the
exchange (``output_dist.Exchange``), which also carries the backward codec.
"""
from __future__ import annotations

import torch

from recc.kernels import codecs
from recc.ops import OPS, batch_of, pooled_dtype, register_impl
from recc.runtime.comm.dp_grads import check_world_batches
from recc.runtime.comm.input_dist import input_dist_start, input_dist_wait, pad_to_world_bags
from recc.runtime.comm.output_dist import (Encoded, ReceivedRows, dequantize_received, output_dist_start,
                                           output_dist_wait)


def all_to_all_start_impl(x, *, comm):
    if len(comm.group) == 1:
        return OPS["all_to_all_start"].reference(x, comm=comm)
    if comm.op == "input_dist":
        return input_dist_start(x, comm)
    if comm.op == "output_dist":
        return output_dist_start(x, comm)
    raise ValueError(f"recc.all_to_all_start: no runtime implementation of {comm.op!r}")


def all_to_all_wait_impl(handle):
    comm = handle.comm
    if comm is None or len(comm.group) == 1:
        return handle.value
    if comm.op == "input_dist":
        return input_dist_wait(handle)
    return output_dist_wait(handle)


def pad_bags_impl(sparse, *, comm):
    if len(comm.group) == 1:
        return sparse
    return pad_to_world_bags(sparse, comm)


def check_batches_impl(sparse, batch, *, comm):
    if len(comm.group) > 1:
        check_world_batches(batch_of(batch), comm, sparse.offsets.device)
    return sparse


def quantize_impl(x, *, precision: str, grad_precision: str = "fp32", parts: int = 1):
    codecs.check_precision(precision)
    codecs.check_precision(grad_precision)
    if x.shape[0] % parts:
        raise ValueError(f"recc.quantize: {x.shape[0]} rows cannot be split into {parts} equal parts "
                         f"(one per destination rank)")
    return Encoded(x, precision, grad_precision, parts)


def dequantize_impl(x, *, dtype: str = "fp32"):
    to = pooled_dtype(dtype)
    if isinstance(x, ReceivedRows):
        return dequantize_received(x, to)
    if isinstance(x, Encoded):
        # No collective in between (e.g. a one-rank group): decode locally; the gradient
        # passes straight through to the source.
        if codecs.is_cast(x.precision) and codecs.cast_dtype(x.precision) == x.source.dtype == to:
            return x.source  # a bf16 lookup on a bf16 wire: nothing to decode
        flat = codecs.decode_parts(x.wire, x.counts, x.precision).view(x.shape)
        source = x.source.to(torch.float32)
        return (source + (flat - source).detach()).to(to)
    if isinstance(x, torch.Tensor):
        return x.to(to)
    raise TypeError(f"recc.dequantize: cannot decode a {type(x).__name__}")


for _device in ("cpu", "cuda"):
    register_impl("all_to_all_start", _device)(all_to_all_start_impl)
    register_impl("all_to_all_wait", _device)(all_to_all_wait_impl)
    register_impl("pad_bags", _device)(pad_bags_impl)
    register_impl("check_batches", _device)(check_batches_impl)
    register_impl("quantize", _device)(quantize_impl)
    register_impl("dequantize", _device)(dequantize_impl)
