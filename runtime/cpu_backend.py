"""CPU implementations of the recc ops: the fused table-batched embedding and the rest.

``recc.tbe_lookup`` and ``recc.gather_rows`` run the table-update path
(``recc.runtime.table_update``) on ``recc.kernels``' table-batched kernels: the forward and, in
backward, the kernel that sums duplicate ids and applies the sparse optimizer to each touched
row once, in place. No gradient for the table weights ever exists, which is what makes the
fused path fast: the weights are never read twice and no sparse gradient tensor is built.
"""
from __future__ import annotations

import itertools

import torch

from recc.ops import (SparseBatch, bag_counts, check_id_dtypes, get_op, pad_table_bags, pooled_dtype, register_impl,
                      stacked_names, use_references)
from recc.runtime import table_update
from recc.runtime.dense_functions import interaction_function, linear_function
from recc.runtime.table_update import Bags, TableKernels
from recc.kernels import (dot_interaction_backward, dot_interaction_forward, dot_interaction_kernel_runs, gather_rows,
                          linear_backward, linear_forward, linearize_indices, max_pool, pack_bags, pairwise_dot_backward,
                          pairwise_dot_forward, pairwise_dot_kernel_runs, tbe_backward_update, tbe_forward)
from recc.kernels.cpu.linear import linear_torch_runs, torch_linear


@register_impl("pack_sparse", "cpu")
def pack_sparse_cpu(indices, offsets, per_sample_weights, *, tables, rows, pad=False, stack=None):
    """1-D ids with start offsets (or [B, L] ids) and no per-sample weights: packed and checked
    in one C pass. Everything else, and a batch the C checks reject, goes through the reference,
    which packs it or raises naming the table and the bag or id at fault. A stacked group
    (``stack=``) is the same pass over its lookups: each lookup's bags written after the previous
    one's is exactly a stacked feature's layout."""
    check_id_dtypes(stacked_names(tables, stack), indices, offsets)   # eager's rule, before padding adds offsets
    if pad:
        indices, offsets = pad_table_bags(indices, offsets)
    packed = None
    if per_sample_weights is None:
        if stack is None:
            packed = pack_bags(indices, offsets, rows)
        elif len(indices) == sum(stack) and len(stack) == len(tables):
            bags = bag_counts(indices, offsets)
            totals = {sum(bags[i - n:i]) for i, n in zip(itertools.accumulate(stack), stack)}
            if len(totals) == 1:   # else the reference names the feature whose total differs
                packed = pack_bags(indices, offsets, [r for r, n in zip(rows, stack) for _ in range(n)],
                                   same_count=False)
    if packed is None:
        return get_op("pack_sparse").reference(indices, offsets, per_sample_weights, tables=tables, rows=rows,
                                               stack=stack)
    ids, combined = packed
    return SparseBatch(tuple(tables), ids, combined, None, (combined.numel() - 1) // len(tables))


class CPUTableKernels(TableKernels):
    """``recc.kernels``' C table-batched kernels: they read every id as a row of the weights."""

    def bags(self, group, tables, ids, offsets, psw, b, *, linear=False, checked=True):
        t = len(tables)
        lin = ids if linear else linearize_indices(ids, offsets, group.feature_hash_size_cumsum, t, b)
        return Bags(lin, offsets, psw, t, b, checked=checked)

    def forward(self, weights, bags, pooling, out_dtype):
        return tbe_forward(weights, bags.ids, bags.offsets, T=bags.t, B=bags.b, pooling=pooling,
                           per_sample_weights=bags.psw, out_dtype=out_dtype)

    def max_pool(self, weights, bags):
        return max_pool(weights, bags.ids, bags.offsets, T=bags.t, B=bags.b)

    def gather(self, weights, group, indices, tables, rows):
        return gather_rows(weights, indices, rows, group.feature_row_starts, tables)

    def key_rows(self, group, sparse):
        cache = getattr(group, "cache", None)
        return None if cache is None else cache.index.slot_row

    def update(self, group, bags, grad, *, pooling, scale, optim, winners=None, key_rows=None, segments=None):
        tbe_backward_update(group.weights.detach(), group.optimizer_state(), bags.ids, bags.offsets, grad,
                            T=bags.t, B=bags.b, pooling=pooling, per_sample_weights=bags.psw, grad_scale=scale,
                            winners=winners, segments=segments, key_rows=key_rows, **optim)


KERNELS = CPUTableKernels()


@register_impl("gather_rows", "cpu")
def gather_rows_cpu(group, indices, *, tables, rows):
    check_id_dtypes(tables, indices, None)   # nn.Embedding's rule (the kernel would take any integer)
    return table_update.gather(KERNELS, group, indices, tables, rows)


@register_impl("tbe_lookup", "cpu")
def tbe_lookup_cpu(group, sparse, *, dtype="fp32"):
    return table_update.lookup(KERNELS, group, sparse, pooled_dtype(dtype))


class PairwiseDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, li, lj):
        ctx.save_for_backward(x, li, lj)
        return pairwise_dot_forward(x, li, lj)

    @staticmethod
    def backward(ctx, grad):
        x, li, lj = ctx.saved_tensors
        return pairwise_dot_backward(x, li, lj, grad), None, None


@register_impl("pairwise_dot", "cpu")
def pairwise_dot_cpu(x, li, lj):
    """The C kernel; what it cannot run (``RECC_CPU_KERNELS=reference``, no compiler, fp64, more
    vectors or pairs than it indexes) runs the op's torch reference, under autograd."""
    if not pairwise_dot_kernel_runs(x, li, lj):
        return get_op("pairwise_dot").reference(x, li, lj)
    return PairwiseDot.apply(x, li, lj)


DotInteraction = interaction_function(dot_interaction_forward, dot_interaction_backward)


@register_impl("dot_interaction", "cpu")
def dot_interaction_cpu(dense, blocks, li, lj, features, pad=0):
    """The C kernel; what it cannot run (as ``pairwise_dot_cpu``) runs the op's torch reference,
    under autograd."""
    if not dot_interaction_kernel_runs(dense, blocks, features, li, lj):
        return get_op("dot_interaction").reference(dense, blocks, li, lj, features, pad)
    return DotInteraction.apply(dense, li, lj, features, pad, *blocks)


Linear = linear_function(linear_forward, linear_backward)


@register_impl("linear", "cpu")
def linear_cpu(x, weight, bias, activation="none"):
    """``Linear``; a small fp32 layer whose kernels would be torch's own ops either way runs as
    those ops under torch's autograd (``linear_torch_runs``), without a Python autograd.Function."""
    if linear_torch_runs(x, weight, bias, activation):
        return torch_linear(x, weight, bias, activation)
    return Linear.apply(x, weight, bias, activation)


use_references("cpu")
