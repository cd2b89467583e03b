"""CPU implementations of the recc ops: the fused table-batched embedding and the rest.

``recc.tbe_lookup`` runs ``recc.kernels``' table-batched forward and, in backward, the kernel
that sums duplicate ids and applies the sparse optimizer to each touched row once, in place. No
gradient for the table weights ever exists, which is what makes the fused path fast: the
weights are never read twice and no sparse gradient tensor is built.
"""
from __future__ import annotations

import itertools

import torch

from recc.ops import (SlotBatch, SparseBatch, bag_counts, check_id_dtypes, get_op, pad_table_bags, pooled_dtype,
                      register_impl, stacked_names, use_references)
from recc.runtime.comm import all_reduce_row_grads, gather_global_batch, same_batches
from recc.runtime.loss_scale import update_scale
from recc.kernels import (dot_interaction_backward, dot_interaction_forward, gather_rows, linear_backward,
                          linear_forward, linearize_indices, max_pool, pack_bags, pairwise_dot_backward, pairwise_dot_forward,
                          tbe_backward_update, tbe_forward)


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


class TBELookup(torch.autograd.Function):
    """Forward: pooled rows for every table of a group. Backward: fused optimizer update."""

    @staticmethod
    def forward(ctx, weights, group, sparse, out_dtype):
        pooling = group.pooling
        ctx.group, ctx.sparse, ctx.psw, ctx.pooling = group, sparse, sparse.per_sample_weights, pooling
        # Max pooling keeps its winners from here; a data-parallel group, which recomputes them for
        # every rank's bags, checks the weights are still those of this forward.
        ctx.winners, ctx.version = None, weights._version
        t, b = sparse.num_tables, sparse.batch_size
        if t == 0 or b == 0:
            # A rank may own no shard of a group; it still takes part in the collectives.
            ctx.lin, ctx.offsets, ctx.t, ctx.b = None, sparse.offsets, t, b
            return weights.new_zeros(b, t * group.dim, dtype=out_dtype)  # fp32 or bf16 (half tables pool in fp32)
        # A cached group's ids arrive as slots of its cache (recc.cache_map): already rows of
        # ``weights``, which holds the slots.
        lin = sparse.indices if isinstance(sparse, SlotBatch) else \
            linearize_indices(sparse.indices, sparse.offsets, group.feature_hash_size_cumsum, t, b)
        offsets = sparse.offsets
        ctx.lin, ctx.offsets, ctx.t, ctx.b = lin, offsets, t, b
        if pooling == "max":
            out, ctx.winners = max_pool(weights.detach(), lin, offsets, T=t, B=b)
            return out.to(out_dtype)
        return tbe_forward(weights.detach(), lin, offsets, T=t, B=b, pooling=pooling,
                           per_sample_weights=sparse.per_sample_weights, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        group.step += 1
        lin, offsets, psw, b = ctx.lin, ctx.offsets, ctx.psw, ctx.b
        winners = ctx.winners
        if group.data_parallel and group.world_size > 1 or ctx.pooling == "max":
            grad = grad.float()  # (the C update alone reads a bf16 gradient as it is)
        grad = grad.contiguous()
        if group.data_parallel and group.world_size > 1 and group.dp_comm.op == "dp_grad_allreduce":
            # Every replica applies the same update for the global batch: its rows' summed gradients.
            if lin is None:
                lin = linearize_indices(ctx.sparse.indices, offsets, group.feature_hash_size_cumsum, ctx.t, b)
            rows, offsets, grad, n = all_reduce_row_grads(lin, offsets, grad, psw, ctx.pooling, ctx.t, b,
                                                          group.total_rows, group.dp_comm,
                                                          same_batch=same_batches(group))
            if n:
                _apply_update(group, rows, offsets, grad, 1, n, "sum")
            return None, None, None, None
        if group.data_parallel and group.world_size > 1:
            # Every replica applies the same update for the global batch: gather it.
            ids, offsets, psw, grad, b = gather_global_batch(ctx.sparse, grad, group.dp_comm,
                                                             same_batch=same_batches(group))
            lin = linearize_indices(ids, offsets, group.feature_hash_size_cumsum, ctx.t, b)
            if ctx.pooling == "max":
                winners = None  # the other ranks' bags: recomputed from the weights, if unchanged
                check_max_unchanged(group, ctx.version)
        if ctx.t and b:
            _apply_update(group, lin, offsets, grad, ctx.t, b, ctx.pooling, psw, winners)
        if isinstance(ctx.sparse, SlotBatch):
            ctx.sparse.lease.release()   # its rows are updated: the cache may evict them now
        return None, None, None, None


def _apply_update(group, lin, offsets, grad, t, b, pooling, psw=None, winners=None, segments=None) -> None:
    """The group's fused optimizer step for one backward: ``grad`` [b, t*D] of the bags (skipped,
    its step not counted, when a loss scaler is in force and ``grad`` overflowed)."""
    scale = update_scale(group, grad)
    if scale is None:
        group.step -= 1
        return
    o = group.optimizer
    # A cached group's weights hold slots: its slot -> group row map keys each slot's stochastic
    # rounding (half tables) on the row it holds, so it rounds as the resident row would.
    cache = getattr(group, "cache", None)
    tbe_backward_update(group.weights.detach(), group.optimizer_state(), lin, offsets, grad,
                        T=t, B=b, pooling=pooling, per_sample_weights=psw,
                        optimizer=o.name, lr=o.lr, eps=o.eps_at(group.step), beta1=o.beta1, beta2=o.beta2,
                        weight_decay=o.weight_decay, step=group.step, grad_scale=scale,
                        weight_decay_mode=o.weight_decay_mode, winners=winners, segments=segments,
                        key_rows=None if cache is None else cache.index.slot_row)


class GatherRows(torch.autograd.Function):
    """Forward: each table's gathered rows, its own contiguous tensor. Backward: the fused
    optimizer update over every table's ids, as one-id bags of one concatenated batch."""

    @staticmethod
    def forward(ctx, weights, group, indices, tables, rows):
        lin, outs = gather_rows(weights.detach(), indices, rows, group.feature_row_starts, tables)
        ctx.group, ctx.lin = group, lin
        ctx.segments = [0]
        for o in outs:
            ctx.segments.append(ctx.segments[-1] + o.shape[0])  # each table's ids: rows apart
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # Autograd hands zeros for a table whose rows were not used (materialised grads), as
        # split_cols' backward does for tbe_lookup: its ids are touched rows with gradient 0.
        group, lin = ctx.group, ctx.lin
        group.step += 1
        n = lin.numel()
        if n:
            grad = torch.cat(grads).contiguous()
            _apply_update(group, lin, torch.arange(n + 1), grad, 1, n, "sum", segments=ctx.segments)
        return None, None, None, None, None


@register_impl("gather_rows", "cpu")
def gather_rows_cpu(group, indices, *, tables, rows):
    check_id_dtypes(tables, indices, None)   # nn.Embedding's rule (the kernel would take any integer)
    if not group.materialized:
        raise RuntimeError(f"table group {group.group_name} has no weights on this rank yet: "
                           f"run the model from program.instantiate()")
    return GatherRows.apply(group.weights, group, list(indices), tuple(tables), tuple(rows))


def check_max_unchanged(group, version: int) -> None:
    """A data-parallel max-pooled group recomputes the global batch's winners in backward: only
    right if its weights did not change since forward (one lookup per backward)."""
    if group.weights._version != version:
        raise RuntimeError(f"table group {group.group_name}: data-parallel max pooling recomputes the winners of "
                           f"every rank's bags in backward, but the weights changed since this lookup's forward "
                           f"(the group was looked up twice before one backward); call backward after each "
                           f"forward, or shard the table (table_wise/column_wise keep the winners)")


@register_impl("tbe_lookup", "cpu")
def tbe_lookup_cpu(group, sparse, *, dtype="fp32"):
    if not group.materialized:
        raise RuntimeError(f"table group {group.group_name} has no weights on this rank yet: "
                           f"run the model from program.instantiate()")
    return TBELookup.apply(group.weights, group, sparse, pooled_dtype(dtype))


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
    return PairwiseDot.apply(x, li, lj)


class DotInteraction(torch.autograd.Function):
    """Saves its inputs (no stacked copy); backward writes each block's gradient whole."""

    @staticmethod
    def forward(ctx, dense, li, lj, features, pad, *blocks):
        ctx.features, ctx.pad = features, pad
        ctx.save_for_backward(dense, li, lj, *blocks)
        return dot_interaction_forward(dense, list(blocks), features, li, lj, pad)

    @staticmethod
    def backward(ctx, grad):
        dense, li, lj, *blocks = ctx.saved_tensors
        gd, gb = dot_interaction_backward(dense, blocks, ctx.features, li, lj, ctx.pad, grad)
        return (gd, None, None, None, None, *gb)


@register_impl("dot_interaction", "cpu")
def dot_interaction_cpu(dense, blocks, li, lj, features, pad=0):
    return DotInteraction.apply(dense, li, lj, features, pad, *blocks)


class Linear(torch.autograd.Function):
    """A dense layer and its activation; saves the output (not a second copy) for the ReLU mask."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        y = linear_forward(x, weight, bias, activation)
        ctx.activation, ctx.has_bias = activation, bias is not None
        ctx.save_for_backward(x, weight, y if activation == "relu" else None)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, y = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        dx, dw, db = linear_backward(grad, x, weight, y, ctx.activation, needs)
        return dx, dw, db, None


@register_impl("linear", "cpu")
def linear_cpu(x, weight, bias, activation="none"):
    return Linear.apply(x, weight, bias, activation)


use_references("cpu")
