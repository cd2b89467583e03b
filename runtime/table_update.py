"""The one table-update path: ``recc.tbe_lookup``'s and ``recc.gather_rows``' autograd Functions.

Forward pools (or gathers) a group's rows; backward applies the group's sparse optimizer to
every touched row, in place (no weight gradient is ever built). Every backend runs the same
sequence here and supplies only kernels (a ``TableKernels``: ``runtime/cpu_backend.py``,
``runtime/cuda_backend.py``). The backward, in order:

1. **count the step** (``group.step``: the optimizers' bias corrections and eps schedule read it;
   a CUDA graph counts it again before each replay, ``cuda_graph.count_step``);
2. **exchange** — a data-parallel group on several ranks (``group.dp_comm``, chosen by the
   ``insert_comm`` pass and shown on the lookup's line of the IR) applies the global batch's
   update on every replica: ``dp_grad_allreduce`` sums the gradients per row across ranks
   (the update is then one-id bags of those rows), ``dp_grad_allgather`` gathers every rank's
   ids and gradients (max pooling recomputes the other ranks' winners, so the weights must be
   those its forward read: ``check_max_unchanged``);
3. **loss scaling** — the factor each gradient is multiplied by (``update_scale``: 1/world,
   1/S under a ``recc.GradScaler``), or a skip, uncounted, when the gradient overflowed;
4. **the fused update** (``TableKernels.update``), with the optimizer's arguments;
5. **the cache lease** of a cached group's batch released: its rows are updated, the cache
   may evict them now.

Hooks for the tiered tables (``runtime/table_cache.py``): a cached group's batch arrives as a
``SlotBatch`` whose ids are already rows of the weights (``linear=True`` in ``bags``), its
half-precision rows round as the resident rows would through ``TableKernels.key_rows``, and its
lease is released in step 5.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from recc.kernels import linearize_indices
from recc.ops import SlotBatch
from recc.runtime.comm import all_reduce_row_grads, gather_global_batch, same_batches
from recc.runtime.cuda_graph import count_step
from recc.runtime.loss_scale import update_scale


@dataclass
class Bags:
    """A batch as a backend's kernels read it: ``t`` kernel tables of ``b`` bags each,
    table-major (``offsets``: t*b+1). ``hsc`` None: ``ids`` are rows of the group's weights;
    else ids local to each kernel table, whose first row is ``hsc[k]``. ``fold`` > 0: the
    lookup's ``fold`` tables viewed as one kernel table of all their bags (its output
    ``[fold*B, D]`` is the lookup's ``[B, fold*D]`` transposed by table)."""

    ids: torch.Tensor
    offsets: torch.Tensor
    psw: Optional[torch.Tensor]
    t: int
    b: int
    hsc: Optional[torch.Tensor] = None
    names: tuple = ()           # the kernel tables' names, for the kernels' errors
    checked: bool = True        # the ids were checked against their tables (pack_sparse, the input dist)
    fold: int = 0

    def linear(self) -> torch.Tensor:
        """The ids as rows of the group's weights."""
        if self.hsc is None:
            return self.ids
        return linearize_indices(self.ids, self.offsets, self.hsc, self.t, self.b)


class TableKernels(ABC):
    """What a backend supplies to the table-update path: kernels, nothing of the sequence.
    Pooled outputs and gradients are always the lookup's ``[B, T*D]``. A backend implements every
    abstract method (instantiating one that does not is a TypeError at import). A backend with a
    fused ``recc.gather_rows`` (the CPU one; CUDA runs the op's torch reference) also has
    ``gather(weights, group, indices, tables, rows) -> (ids as rows of the weights, each table's
    gathered rows)``, which ``gather()`` below runs with the update in backward."""

    def check(self, group) -> None:
        """Refuse a group whose weights these kernels cannot read."""

    @abstractmethod
    def bags(self, group, tables: tuple, ids: torch.Tensor, offsets: torch.Tensor, psw, b: int, *,
             linear: bool = False, checked: bool = True) -> Bags:
        """``tables``' ``b`` bags each as the kernels read them. ``linear``: ``ids`` are rows of
        the weights already (a cached group's slots, the all-reduced rows); ``checked=False``:
        other ranks' ids, which the update's own bounds check reports."""

    @abstractmethod
    def forward(self, weights: torch.Tensor, bags: Bags, pooling: str, out_dtype: torch.dtype) -> torch.Tensor:
        """The pooled rows of ``bags`` (sum or mean pooling), ``[B, T*D]`` in ``out_dtype``."""

    @abstractmethod
    def max_pool(self, weights: torch.Tensor, bags: Bags) -> tuple[torch.Tensor, torch.Tensor]:
        """Max pooling's output and its winners (what ``update`` reads for the same bags)."""

    def key_rows(self, group, sparse) -> Optional[torch.Tensor]:
        """A cached group's slot -> group row map keying each slot's stochastic rounding (half
        tables) on the row it holds, as the resident row would round; None when not needed."""
        return None

    @abstractmethod
    def update(self, group, bags: Bags, grad: torch.Tensor, *, pooling: str, scale: float, optim: dict,
               winners=None, key_rows=None, segments=None) -> None:
        """The fused optimizer step over ``bags`` for ``grad`` ``[B, T*D]``, each id's gradient
        multiplied by ``scale``; ``optim``: the optimizer's keyword arguments."""


def require_materialized(group) -> None:
    if not group.materialized:
        raise RuntimeError(f"table group {group.group_name} has no weights on this rank yet: "
                           f"run the model from program.instantiate()")


def lookup(kernels: TableKernels, group, sparse, out_dtype: torch.dtype) -> torch.Tensor:
    """``recc.tbe_lookup`` on ``kernels``: the pooled rows ``[B, T*D]``, updated in backward."""
    require_materialized(group)
    kernels.check(group)
    return TBELookup.apply(group.weights, group, sparse, kernels, out_dtype)


def gather(kernels: TableKernels, group, indices, tables, rows) -> tuple[torch.Tensor, ...]:
    """``recc.gather_rows`` on ``kernels``: each table's rows, updated in backward."""
    require_materialized(group)
    kernels.check(group)
    return GatherRows.apply(group.weights, group, list(indices), tuple(tables), tuple(rows), kernels)


class TBELookup(torch.autograd.Function):
    """Forward: pooled rows for every table of a group. Backward: the update sequence."""

    @staticmethod
    def forward(ctx, weights, group, sparse, kernels, out_dtype):
        pooling = group.pooling
        ctx.group, ctx.sparse, ctx.kernels, ctx.pooling = group, sparse, kernels, pooling
        # Max pooling keeps its winners from here; a data-parallel group, which recomputes them for
        # every rank's bags, checks the weights are still those of this forward.
        ctx.winners, ctx.version, ctx.bags = None, weights._version, None
        t, b = sparse.num_tables, sparse.batch_size
        if t == 0 or b == 0:
            # A rank may own no shard of a group; it still takes part in the collectives.
            return weights.new_zeros(b, t * group.dim, dtype=out_dtype)  # (half tables pool in fp32)
        # A cached group's ids arrive as slots of its cache (recc.cache_map): already rows of
        # ``weights``, which holds the slots.
        bags = kernels.bags(group, sparse.tables, sparse.indices, sparse.offsets, sparse.per_sample_weights, b,
                            linear=isinstance(sparse, SlotBatch))
        ctx.bags = bags
        if pooling == "max":
            out, ctx.winners = kernels.max_pool(weights.detach(), bags)
            return out.to(out_dtype)
        return kernels.forward(weights.detach(), bags, pooling, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        group, sparse, kernels, pooling = ctx.group, ctx.sparse, ctx.kernels, ctx.pooling
        count_step(group)
        bags, winners = ctx.bags, ctx.winners
        t, b = sparse.num_tables, sparse.batch_size
        exchange = group.dp_comm.op if group.data_parallel and group.world_size > 1 else None
        if exchange or pooling == "max":
            grad = grad.float()  # (the CPU update alone reads a bf16 gradient as it is)
        grad = grad.contiguous()
        if exchange == "dp_grad_allreduce":
            # Every replica applies the same update for the global batch: its rows' summed
            # gradients, as one-id bags of one table spanning the group's rows.
            lin = bags.linear() if bags is not None else torch.zeros(0, dtype=torch.int64, device=grad.device)
            rows, offsets, grad, n = all_reduce_row_grads(lin, sparse.offsets, grad, sparse.per_sample_weights,
                                                          pooling, t, b, group.total_rows, group.dp_comm,
                                                          same_batch=same_batches(group))
            bags = kernels.bags(group, (group.group_name,), rows, offsets, None, n, linear=True,
                                checked=False) if n else None
            pooling, winners = "sum", None
        elif exchange:
            # Every replica applies the same update for the global batch: gather it.
            ids, offsets, psw, grad, b = gather_global_batch(sparse, grad, group.dp_comm,
                                                             same_batch=same_batches(group))
            bags = kernels.bags(group, sparse.tables, ids, offsets, psw, b, checked=False) if t and b else None
            if pooling == "max":
                winners = None  # the other ranks' bags: recomputed from the weights, if unchanged
                check_max_unchanged(group, ctx.version)
        if bags is not None:
            _update(kernels, group, bags, grad, pooling, winners=winners, key_rows=kernels.key_rows(group, sparse))
        if isinstance(sparse, SlotBatch):
            sparse.lease.release()   # its rows are updated (or skipped): the cache may evict them now
        return None, None, None, None, None


class GatherRows(torch.autograd.Function):
    """Forward: each table's gathered rows, its own contiguous tensor. Backward: the fused
    optimizer update over every table's ids, as one-id bags of one concatenated batch."""

    @staticmethod
    def forward(ctx, weights, group, indices, tables, rows, kernels):
        lin, outs = kernels.gather(weights.detach(), group, indices, tables, rows)
        ctx.group, ctx.lin, ctx.kernels = group, lin, kernels
        ctx.segments = [0]
        for o in outs:
            ctx.segments.append(ctx.segments[-1] + o.shape[0])  # each table's ids: rows apart
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # Autograd hands zeros for a table whose rows were not used (materialised grads), as
        # split_cols' backward does for tbe_lookup: its ids are touched rows with gradient 0.
        group, lin, kernels = ctx.group, ctx.lin, ctx.kernels
        count_step(group)
        n = lin.numel()
        if n:
            grad = (torch.cat(grads) if len(grads) > 1 else grads[0]).contiguous()
            bags = kernels.bags(group, (group.group_name,), lin, _one_id_offsets(n, lin.device), None, n, linear=True)
            _update(kernels, group, bags, grad, "sum", key_rows=kernels.key_rows(group, None),
                    segments=ctx.segments)
        return None, None, None, None, None, None


_CPU_ONE_ID_OFFSETS = [torch.arange(1)]   # the last CPU arange(n + 1) built: a batch's id count repeats step after step


def _one_id_offsets(n: int, device) -> torch.Tensor:
    """``arange(n + 1)``: n one-id bags' offsets; on the CPU the last one is kept and reused for
    the same n (the kernels only read it)."""
    if device.type != "cpu":
        return torch.arange(n + 1, device=device)
    if _CPU_ONE_ID_OFFSETS[0].numel() != n + 1:
        _CPU_ONE_ID_OFFSETS[0] = torch.arange(n + 1)
    return _CPU_ONE_ID_OFFSETS[0]


def _update(kernels: TableKernels, group, bags: Bags, grad: torch.Tensor, pooling: str, *, winners=None,
            key_rows=None, segments=None) -> None:
    """The group's fused optimizer step for one backward (skipped, its step not counted, when a
    loss scaler is in force and ``grad`` overflowed)."""
    scale = update_scale(group, grad)
    if scale is None:
        group.step -= 1
        return
    kernels.update(group, bags, grad, pooling=pooling, scale=scale, optim=optimizer_args(group), winners=winners,
                   key_rows=key_rows, segments=segments)


def optimizer_args(group) -> dict:
    """The fused optimizer's keyword arguments for the group's current step."""
    o = group.optimizer
    return dict(optimizer=o.name, lr=o.lr, eps=o.eps_at(group.step), beta1=o.beta1, beta2=o.beta2,
                weight_decay=o.weight_decay, step=group.step, weight_decay_mode=o.weight_decay_mode)


def check_max_unchanged(group, version: int) -> None:
    """A data-parallel max-pooled group recomputes the global batch's winners in backward: only
    right if its weights did not change since forward (one lookup per backward)."""
    if group.weights._version != version:
        raise RuntimeError(f"table group {group.group_name}: data-parallel max pooling recomputes the winners of "
                           f"every rank's bags in backward, but the weights changed since this lookup's forward "
                           f"(the group was looked up twice before one backward); call backward after each "
                           f"forward, or shard the table (table_wise/column_wise keep the winners)")
