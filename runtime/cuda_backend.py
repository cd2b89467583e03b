"""CUDA implementations of the recc ops: the table-batched embedding on ``recc.kernels.cuda``.

``recc.tbe_lookup[cuda]`` runs the table-update path (``recc.runtime.table_update``) on the
CuPy TBE forward and, in backward, the fused sort / run-length / per-row optimizer kernels, in
place, like the CPU backend (no weight gradient is ever built); the path's collectives go
through ``recc.runtime.comm`` (NCCL on GPUs). ``recc.pack_sparse[cuda]`` packs and validates on
the device with a single host sync. Every other op uses its torch reference, which runs on
CUDA tensors as it is.

Importing this module needs neither CuPy nor a GPU: kernels load on their first launch.
"""
from __future__ import annotations

import torch

from recc.kernels import cuda as cuda_kernels
from recc.kernels import linearize_indices, max_pool, tbe_backward_update_reference
from recc.ops import (OPS, SlotBatch, check_id_dtypes, flatten_bags, packed_batch, pad_table_bags, pooled_dtype, register_impl,
                      stack_table_bags, stacked_names, use_references)
from recc.runtime import table_update
from recc.runtime.table_update import Bags, TableKernels


class CUDATableKernels(TableKernels):
    """``recc.kernels.cuda``'s TBE kernels: local ids with each table's first row
    (``hash_size_cumsum``), bounds-checked against it and reported by table name."""

    def check(self, group):
        if not cuda_kernels.loader.kernel_device(group.weights.device):
            raise RuntimeError(f"table group {group.group_name} is lowered for CUDA but its weights are on "
                               f"{group.weights.device}; instantiate the program on a GPU")

    def bags(self, group, tables, ids, offsets, psw, b, *, linear=False, checked=True):
        t = len(tables)
        if not (linear or group.shares_rows):
            return Bags(ids, offsets, psw, t, b, group.hash_size_cumsum, tuple(tables), checked)
        # Ids that are rows already (a cached group's slots, the all-reduced rows), or a group
        # with a table that several features read, linearized here (the kernels bound table t's
        # ids by hash_size_cumsum[t + 1], which features sharing rows cannot say; pack_sparse and
        # the input dist checked the ids against their tables): the kernels see one table of
        # every row whose bags are all the tables' bags.
        if not linear:
            ids = linearize_indices(ids, offsets, group.feature_hash_size_cumsum, t, b)
        weights = group.weights
        hsc = torch.tensor([0, weights.shape[0]], dtype=torch.int64, device=weights.device)
        return Bags(ids, offsets, psw, 1, t * b, hsc, (group.group_name,), checked, fold=t)

    def forward(self, weights, bags, pooling, out_dtype):
        out = cuda_kernels.tbe_forward(weights, bags.ids, bags.offsets, bags.hsc, T=bags.t, B=bags.b,
                                       pooling=pooling, per_sample_weights=bags.psw, table_names=bags.names)
        return _unfold(out, bags).to(out_dtype)

    def max_pool(self, weights, bags):  # no CUDA kernel: the torch reference, on the device
        out, winners = max_pool(weights, bags.linear(), bags.offsets, T=bags.t, B=bags.b)
        return _unfold(out, bags), winners

    def key_rows(self, group, sparse):
        """A cached half group's key map for the fused update, on the device: entry s the group
        row that slot s holds (``cache.index.slot_row[s]``, on the host). Only this batch's
        slots are read by the kernel, so only theirs are filled: the rows of its ids' slots
        (gathered on the host, where ``cache_map`` left the slots, and sent over like the slots
        themselves: N values, not the cache's S). The batch's slots are pinned until its
        backward has run, so ``slot_row`` still holds their rows. None for a resident group and
        for fp32 weights (nothing is rounded)."""
        cache = getattr(group, "cache", None)
        weights = group.weights
        if cache is None or not isinstance(sparse, SlotBatch) or weights.dtype == torch.float32:
            return None
        keys = torch.empty(weights.shape[0], dtype=torch.int64, device=weights.device)
        rows = cache.index.slot_row[sparse.assignment.slots]
        keys[sparse.indices] = rows.to(weights.device)
        return keys

    def update(self, group, bags, grad, *, pooling, scale, optim, winners=None, key_rows=None, segments=None):
        grad = _fold(grad, bags)
        if scale != 1.0:
            grad = grad * scale
        grad = grad.contiguous()
        if pooling == "max":  # no CUDA kernel: the torch reference, on the device
            tbe_backward_update_reference(group.weights.detach(), group.optimizer_state(), bags.linear(),
                                          bags.offsets, grad, T=bags.t, B=bags.b, pooling="max", winners=winners,
                                          **optim)
        else:
            cuda_kernels.tbe_backward_update(group.weights.detach(), group.optimizer_state(), bags.ids, bags.offsets,
                                             bags.hsc, grad, T=bags.t, B=bags.b, pooling=pooling,
                                             per_sample_weights=bags.psw, table_names=bags.names,
                                             checked=bags.checked, key_rows=key_rows, **optim)


def _unfold(out: torch.Tensor, bags: Bags) -> torch.Tensor:
    """Folded tables' pooled ``[T*B, D]`` (bags in table-major order) as ``[B, T*D]``."""
    t = bags.fold
    if not t:
        return out
    tb, d = out.shape
    return out.view(t, tb // max(1, t), d).transpose(0, 1).reshape(tb // max(1, t), t * d)


def _fold(grad: torch.Tensor, bags: Bags) -> torch.Tensor:
    """``[B, T*D]`` as folded tables' ``[T*B, D]``."""
    t = bags.fold
    if not t:
        return grad
    b, td = grad.shape
    return grad.reshape(b, t, td // max(1, t)).transpose(0, 1).reshape(t * b, td // max(1, t))


KERNELS = CUDATableKernels()


@register_impl("tbe_lookup", "cuda")
def tbe_lookup_cuda(group, sparse, *, dtype="fp32"):
    # The CUDA kernels write fp32: a bf16 consumer's rows are a cast after the lookup (its
    # backward widens the gradient back to fp32 for the fused update).
    pooled = table_update.lookup(KERNELS, group, sparse, torch.float32)
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
