"""CUDA implementations of the recc ops: the table-batched embedding on ``recc.kernels.cuda``.

``recc.tbe_lookup[cuda]`` runs the CuPy TBE forward and, in backward, the fused sort /
run-length / per-row optimizer kernels, in place, like the CPU backend (no weight gradient is
ever built).  ``recc.pack_sparse[cuda]`` packs and validates on the device with a single host
sync.  Collectives go through ``recc.runtime.comm`` (NCCL on GPUs), and every other op uses its
torch reference, which runs on CUDA tensors as it is.

Importing this module needs neither CuPy nor a GPU: kernels load on their first launch.
"""
from __future__ import annotations

import torch

from recc.kernels import cuda as cuda_kernels
from recc.kernels import linearize_indices, max_pool, tbe_backward_update_reference
from recc.runtime.cpu_backend import check_max_unchanged
from recc.ops import (OPS, SlotBatch, check_id_dtypes, flatten_bags, packed_batch, pad_table_bags, pooled_dtype, register_impl,
                      stack_table_bags, stacked_names, use_references)
from recc.runtime.comm import all_reduce_row_grads, gather_global_batch, same_batches
from recc.runtime.loss_scale import update_scale


class TBELookupCUDA(torch.autograd.Function):
    """Forward: pooled rows for every table of a group. Backward: fused optimizer update."""

    @staticmethod
    def forward(ctx, weights, group, sparse):
        pooling = group.pooling
        ctx.group, ctx.sparse, ctx.psw, ctx.pooling = group, sparse, sparse.per_sample_weights, pooling
        # Max pooling keeps its winners from here; a data-parallel group, which recomputes them for
        # every rank's bags, checks the weights are still those of this forward.
        ctx.winners, ctx.version = None, weights._version
        t, b = sparse.num_tables, sparse.batch_size
        ctx.t, ctx.b = t, b
        if t == 0 or b == 0:
            # A rank may own no shard of a group; it still takes part in the collectives.
            ctx.ids = ctx.offsets = ctx.hsc = None
            return torch.zeros(b, t * group.dim, dtype=torch.float32, device=weights.device)
        ids, offsets, hsc, names = sparse.indices, sparse.offsets, group.hash_size_cumsum, sparse.tables
        if isinstance(sparse, SlotBatch) or group.shares_rows:
            # A cached group's ids are slots of its cache, rows of ``weights`` for every table; a
            # group with a table that several features read is linearized here (the kernels bound
            # table t's ids by hash_size_cumsum[t + 1], which features sharing rows cannot say;
            # pack_sparse and the input dist checked the ids against their tables). Either way
            # the kernels see one table of every row whose bags are all the tables' bags, the
            # output's [T*B, D] turned back into [B, T*D] (and the gradient the other way).
            if not isinstance(sparse, SlotBatch):
                ids = linearize_indices(ids, offsets, group.feature_hash_size_cumsum, t, b)
            t, b = 1, t * b
            hsc = torch.tensor([0, weights.shape[0]], dtype=torch.int64, device=weights.device)
            names = (group.group_name,)
            ctx.t, ctx.b, ctx.slot_tables = t, b, sparse.num_tables
        ctx.ids, ctx.offsets, ctx.hsc, ctx.names = ids, offsets, hsc, names
        if pooling == "max":  # no CUDA kernel: the torch reference, on the device
            out, ctx.winners = max_pool(weights.detach(), linearize_indices(ids, offsets, hsc, t, b), offsets, T=t, B=b)
        else:
            out = cuda_kernels.tbe_forward(weights.detach(), ids, offsets, hsc, T=t, B=b, pooling=pooling,
                                           per_sample_weights=sparse.per_sample_weights, table_names=names)
        return _from_slot_bags(out, ctx)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        group.step += 1
        o = group.optimizer
        ids, offsets, psw, b, checked = ctx.ids, ctx.offsets, ctx.psw, ctx.b, True
        t, hsc, pooling, names = ctx.t, ctx.hsc, ctx.pooling, getattr(ctx, "names", ())
        winners = ctx.winners
        grad = _to_slot_bags(grad, ctx)
        if group.data_parallel and group.world_size > 1 and group.dp_comm.op == "dp_grad_allreduce":
            # Every replica applies the same update for the global batch: its rows' summed
            # gradients, as one-id bags of one table spanning the group's rows.
            lin = (linearize_indices(ids, offsets, hsc, t, b) if ids is not None
                   else torch.zeros(0, dtype=torch.int64, device=grad.device))  # no bags on this rank
            ids, offsets, grad, b = all_reduce_row_grads(lin, offsets, grad, psw, pooling, t, b,
                                                         group.total_rows, group.dp_comm,
                                                         same_batch=same_batches(group))
            t, pooling, psw, checked, names = 1, "sum", None, False, (group.group_name,)
            hsc = torch.tensor([0, group.total_rows], dtype=torch.int64, device=grad.device)
        elif group.data_parallel and group.world_size > 1:
            # Every replica applies the same update for the global batch: gather it.
            shared = getattr(ctx, "slot_tables", None)   # a shared group (data-parallel ones are never cached)
            if shared:
                grad = _from_slot_bags(grad, ctx)        # gathered as [B, T*D], local ids
            ids, offsets, psw, grad, b = gather_global_batch(ctx.sparse, grad, group.dp_comm,
                                                             same_batch=same_batches(group))
            checked = False  # other ranks' ids: the update's own bounds check reports them
            if shared:
                ids = linearize_indices(ids, offsets, group.feature_hash_size_cumsum, shared, b)
                grad, b = _to_slot_bags(grad, ctx), shared * b
            if pooling == "max":
                winners = None
                check_max_unchanged(group, ctx.version)
        scale = update_scale(group, grad) if t and b else group.grad_scale
        if scale is None:  # a loss scaler is in force and the gradient overflowed: skip, step not counted
            group.step -= 1
            return None, None, None
        if scale != 1.0:
            grad = grad * scale
        if t and b and pooling == "max":
            tbe_backward_update_reference(
                group.weights.detach(), group.optimizer_state(), linearize_indices(ids, offsets, hsc, t, b),
                offsets, grad.contiguous(), T=t, B=b, pooling="max", optimizer=o.name, lr=o.lr,
                eps=o.eps_at(group.step), beta1=o.beta1, beta2=o.beta2, weight_decay=o.weight_decay, step=group.step,
                weight_decay_mode=o.weight_decay_mode, winners=winners)
        elif t and b:
            cuda_kernels.tbe_backward_update(
                group.weights.detach(), group.optimizer_state(), ids, offsets, hsc, grad.contiguous(),
                T=t, B=b, pooling=pooling, per_sample_weights=psw, optimizer=o.name, lr=o.lr,
                eps=o.eps_at(group.step), beta1=o.beta1, beta2=o.beta2, weight_decay=o.weight_decay, step=group.step,
                table_names=names, checked=checked, weight_decay_mode=o.weight_decay_mode,
                key_rows=_slot_key_rows(group, ctx.sparse))
        if isinstance(ctx.sparse, SlotBatch):
            ctx.sparse.lease.release()   # its rows are updated: the cache may evict them now
        return None, None, None


def _slot_key_rows(group, sparse):
    """A cached half group's key map for the fused update, on the device: entry s the group row
    that slot s holds (``cache.index.slot_row[s]``, on the host), so each slot's stochastic
    rounding is keyed as its row's is when resident. Only this batch's slots are read by the
    kernel, so only theirs are filled: the rows of its ids' slots (gathered on the host, where
    ``cache_map`` left the slots, and sent over like the slots themselves: N values, not the
    cache's S). The batch's slots are pinned until its backward has run, so ``slot_row`` still
    holds their rows. None for a resident group and for fp32 weights (nothing is rounded)."""
    cache = getattr(group, "cache", None)
    weights = group.weights
    if cache is None or not isinstance(sparse, SlotBatch) or weights.dtype == torch.float32:
        return None
    keys = torch.empty(weights.shape[0], dtype=torch.int64, device=weights.device)
    rows = cache.index.slot_row[sparse.assignment.slots]
    keys[sparse.indices] = rows.to(weights.device)
    return keys


def _from_slot_bags(out: torch.Tensor, ctx) -> torch.Tensor:
    """A cached group's pooled ``[T*B, D]`` (bags in table-major order) as ``[B, T*D]``."""
    t = getattr(ctx, "slot_tables", None)
    if t is None:
        return out
    tb, d = out.shape
    return out.view(t, tb // max(1, t), d).transpose(0, 1).reshape(tb // max(1, t), t * d)


def _to_slot_bags(grad: torch.Tensor, ctx) -> torch.Tensor:
    t = getattr(ctx, "slot_tables", None)
    if t is None:
        return grad
    b, td = grad.shape
    return grad.reshape(b, t, td // max(1, t)).transpose(0, 1).reshape(t * b, td // max(1, t))


@register_impl("tbe_lookup", "cuda")
def tbe_lookup_cuda(group, sparse, *, dtype="fp32"):
    if not group.materialized:
        raise RuntimeError(f"table group {group.group_name} has no weights on this rank yet: "
                           f"run the model from program.instantiate()")
    if not cuda_kernels.loader.kernel_device(group.weights.device):
        raise RuntimeError(f"table group {group.group_name} is lowered for CUDA but its weights are on "
                           f"{group.weights.device}; instantiate the program on a GPU")
    pooled = TBELookupCUDA.apply(group.weights, group, sparse)
    # bf16 rows for a bf16 consumer: the CUDA kernels write fp32, so here it is a cast (its
    # backward widens the gradient back to fp32 for the fused update).
    return pooled if dtype == "fp32" else pooled.to(pooled_dtype(dtype))


@register_impl("pack_sparse", "cuda")
def pack_sparse_cuda(indices, offsets, per_sample_weights, *, tables, rows, pad=False, stack=None):
    """``recc.pack_sparse`` on the device: the reference's packing, validated with one sync.

    A bad batch is re-validated by the CPU reference on host copies, which raises the same
    error (table and position) the CPU backend would. A stacked group (``stack=``) is stacked by
    the reference's ``stack_table_bags`` first (which checks each lookup on its own)."""
    tables = tuple(tables)
    check_id_dtypes(stacked_names(tables, stack), indices, offsets)   # eager's rule, before padding adds offsets
    if pad:
        indices, offsets = pad_table_bags(indices, offsets)
    if stack is not None:
        indices, offsets, per_sample_weights = stack_table_bags(indices, offsets, per_sample_weights, stack, tables,
                                                                rows)
    ids, off, counts, psw, batch = flatten_bags(indices, offsets, per_sample_weights, tables)
    dev, n = ids.device, ids.numel()
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    if batch:
        bad = bad | (off[:, 0] != 0).any() | (off[:, -1] > counts).any()
        if batch > 1:
            bad = bad | (off[:, 1:] < off[:, :-1]).any()
    if n:
        limit = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.int64, device=dev), counts,
                                        output_size=n)
        bad = bad | ((ids < 0) | (ids >= limit)).any()
    if bool(bad):  # the one host sync
        OPS["pack_sparse"].reference([i.cpu() for i in indices], [None if o is None else o.cpu() for o in offsets],
                                     None if per_sample_weights is None else [w.cpu() for w in per_sample_weights],
                                     tables=tables, rows=rows)
        raise RuntimeError("pack_sparse: the device validation flagged this batch but the CPU reference "
                           "accepts it; please report this")
    return packed_batch(tables, ids, off, counts, psw, batch)


use_references("cuda")  # every other op: its torch reference runs on CUDA tensors as it is
