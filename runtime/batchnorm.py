"""BatchNorm statistics over ranks in the runtime: ``recc.batchnorm_stats_start``/``_wait``.

The forward all-reduces one layer's ``[2C+1]`` sums (per channel sum and sum of squares, then
the count) over the embedding process group, started by ``_start`` and completed by ``_wait``.
Every rank's sums enter every rank's statistics, so the gradient of rank r's loss reaches every
rank's input: the backward is the same all-reduce (sum) of the gradient of the sums — for a
BatchNorm these are the two per-channel sums, of ``dy`` and of ``dy * (x - mean)``, that torch's
``SyncBatchNorm`` all-reduces. Both directions count their bytes and wait time in the comm report
(``batchnorm <layer> fwd`` / ``bwd``) and honour link emulation.

The embedding group, not DDP's default one: DDP's bucket all-reduces run asynchronously on the
default group while backward goes on, and a collective of our own there could interleave with
them in a different order on different ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from recc.ops import OPS, Handle, register_impl
from recc.runtime.comm import embedding_group
from recc.runtime.comm import stats as comm_stats
from recc.runtime.comm.stats import Transfer


def _all_reduce(t: torch.Tensor, label: str) -> Transfer:
    """Start a sum all-reduce of ``t`` in place, counting what a ring all-reduce sends per rank
    (``2 (W-1)/W`` of the buffer)."""
    world, me = dist.get_world_size(), dist.get_rank()
    st = comm_stats.current()
    sent = 2 * (world - 1) * t.numel() * t.element_size() // world
    st.add_payload(label, "fp32", sent, sent)
    return Transfer(label, [dist.all_reduce(t, group=embedding_group(), async_op=True)], sent, st,
                    st.cross_node([sent // max(world - 1, 1)] * world, me))


class _SummedOverRanks(torch.autograd.Function):
    """Forward hands over the all-reduced sums; backward all-reduces their gradient, which is
    what every rank's loss sends back to this rank's input."""

    @staticmethod
    def forward(ctx, local, reduced, label):
        ctx.label = label
        return reduced

    @staticmethod
    def backward(ctx, grad):
        # The last entry is the count, which no input changes: only the 2C gradient sums travel.
        sums = grad[:-1].contiguous().clone()
        _all_reduce(sums, f"{ctx.label} bwd").wait()
        return torch.cat([sums, grad[-1:]]), None, None


def batchnorm_stats_start_impl(sums, *, comm):
    if len(comm.group) == 1 or sums.numel() == 0:   # one rank, or eval mode: nothing to add up
        return Handle((sums, None), None, comm)
    reduced = sums.detach().clone()
    return Handle((sums, reduced), _all_reduce(reduced, f"{comm.name or 'batchnorm'} fwd"), comm)


def batchnorm_stats_wait_impl(handle):
    sums, reduced = handle.value
    if reduced is None:
        return sums
    handle.work.wait()
    if not sums.requires_grad:
        return reduced
    return _SummedOverRanks.apply(sums, reduced, handle.comm.name or "batchnorm")


for _device in ("cpu", "cuda"):
    register_impl("batchnorm_stats_start", _device)(batchnorm_stats_start_impl)
    register_impl("batchnorm_stats_wait", _device)(batchnorm_stats_wait_impl)
    register_impl("batchnorm_sums", _device)(OPS["batchnorm_sums"].reference)
    register_impl("sync_batch_norm", _device)(OPS["sync_batch_norm"].reference)
    register_impl("functional_batchnorm_sums", _device)(OPS["functional_batchnorm_sums"].reference)
    register_impl("functional_sync_batch_norm", _device)(OPS["functional_sync_batch_norm"].reference)
