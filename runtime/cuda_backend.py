"""CUDA implementations of the recc ops: the table-batched embedding on ``recc.kernels.cuda``.

``recc.tbe_lookup[cuda]`` runs the table-update path (``recc.runtime.table_update``) on the
CuPy TBE forward and, in backward, the fused sort / run-length / per-row optimizer kernels, in
place, like the CPU backend (no weight gradient is ever built); the path's collectives go
through ``recc.runtime.comm`` (NCCL on GPUs). ``recc.pack_sparse[cuda]`` packs and validates on
the device. Every other op uses its torch reference, which runs on CUDA tensors as it is.

Bounds checks without a sync (``DeferredChecks``): inside a ``DistributedModel`` step, the
packing's validation flag and the TBE kernels' error records all land in one int64[2] record on
the device, never read mid-step; the update kernels write nothing while it is set, so a bad batch
changes no row. A backward's end copies it (non_blocking) to pinned host memory with an event;
the next step's start reads the copy once its event has passed, and a state read (``state_dict``,
``synchronize()``, an eval forward) reads the record itself. A set flag re-validates the step's
kept batches on the host, which raise the error the CPU backend would (table and position),
naming the step the batch came from. Outside a model's step (an op called on its own) each
check reads its record at once, as before.

Importing this module needs neither CuPy nor a GPU: kernels load on their first launch.
"""
from __future__ import annotations

import collections
import contextlib

import torch

from recc.kernels import cuda as cuda_kernels
from recc.kernels.cuda import loader
from recc.kernels.cuda.tbe import ERR_NONE
from recc.kernels import linearize_indices, max_pool, tbe_backward_update_reference
from recc.ops import (OPS, SlotBatch, SparseBatch, _bound, check_id_dtypes, flatten_bags, pad_table_bags,
                      pooled_dtype, register_deferred_checks, register_impl, stack_table_bags, stacked_names,
                      use_references)
from recc.runtime import cuda_graph, table_update
from recc.runtime.table_update import Bags, TableKernels


class DeferredChecks:
    """One ``DistributedModel``'s bounds checks on the CUDA kernels, read where they cost nothing.

    ``record`` (int64[2] on the device, ``ERR_NONE`` until a check fails) is shared by every
    kernel and the packing's flag of every step, and sticky: once set, every later update kernel
    writes nothing until the error has been raised (then it is cleared). ``kept`` holds, per check
    since the last copy, the step it ran in and a host validator that raises its error."""

    # Copies of the record whose event has not passed after this many later backwards are
    # waited for: the host is that far ahead of the device anyway.
    MAX_PENDING = 2

    def __init__(self):
        self.record = None
        self.step = 0
        self.kept: list = []
        self.pending: collections.deque = collections.deque()  # (host copy, event or None, kept)
        self._copy_queued = False

    def error_record(self, device) -> torch.Tensor:
        if self.record is None or self.record.device != device:
            self.record = cuda_kernels.tbe.new_error_record(device)  # (all ERR_NONE)
        return self.record

    def keep(self, validate) -> None:
        """``validate()`` raises the error of a batch just checked on the device, on the host."""
        self.kept.append((self.step, validate))

    def after_update(self) -> None:
        """Called in a backward's update: the record is copied once that backward has finished."""
        if not self._copy_queued:
            self._copy_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._copy)

    def _copy(self) -> None:
        self._copy_queued = False
        if not self.kept or self.record is None:
            return
        if cuda_graph.capturing() is not None:
            return   # a CUDA graph's replay copies it after the graph (``after_replay``)
        rec, event = self.record, None
        host = torch.empty(rec.shape, dtype=rec.dtype, pin_memory=rec.is_cuda)
        host.copy_(rec, non_blocking=True)
        if rec.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append((host, event, self.kept))
        self.kept = []

    def after_replay(self) -> None:
        """A CUDA graph's backward has been replayed: the record is copied after it, as at the
        end of an eager backward (outside the graph, so a replay's copy is its own)."""
        self._copy()

    def begin_step(self, step: int) -> None:
        """A training step's start: the copies whose event has passed are read (no wait, unless
        the host is more than ``MAX_PENDING`` backwards ahead) and a set flag raised. Checks of a
        step that ran no backward (a forward only) are copied here, so none waits forever."""
        if self.kept:
            self._copy()
        while self.pending:
            host, event, kept = self.pending[0]
            if event is not None and not event.query():
                if len(self.pending) <= self.MAX_PENDING:
                    break
                event.synchronize()
            self.pending.popleft()
            # host memory the event has filled: no sync, so not a counted host read (and
            # tolist, not a comparison whose bool() would look like one to the emulator's count)
            if host.tolist() != [ERR_NONE] * 2:
                # the flagged copy's batches first, then every later one not read yet
                self._raise(kept + [k for _, _, ks in self.pending for k in ks] + self.kept, step)
        self.step = step

    def synchronize(self, step: int, why: str = "deferred bounds check, state read") -> None:
        """Reads the record now (a sync, only when a check ran since the last read) and raises a
        set flag: what a user sees of the tables (``state_dict``, an eval forward's output) must
        not come from a bad batch."""
        kept = [k for _, _, ks in self.pending for k in ks] + self.kept
        self.pending.clear()
        self.kept = []
        if not kept or self.record is None:
            return
        bad = loader.host_read(self.record, why)
        if bad != [ERR_NONE] * 2:
            self._raise(kept, step)

    def check_now(self) -> None:
        """Raises a flag set so far: a torch reference op (max pooling) has no device guard, so
        the ids it indexes with must be known good first (a sync, off the fast path)."""
        self.synchronize(self.step, "deferred bounds check, before a torch reference op")

    def _raise(self, kept, step: int):
        self.record.fill_(ERR_NONE)
        self.pending.clear()
        self.kept = []
        for bad_step, validate in kept:
            try:
                validate()
            except Exception as e:
                where = "this step" if bad_step == step else f"step {bad_step}, found at the start of step {step}"
                raise type(e)(f"{e} (the batch of {where}: no table row was updated by it"
                              f"{'' if bad_step == step else ' or since'})") from None
        raise RuntimeError("recc: the CUDA kernels flagged a batch that the CPU validators accept; please report this")


# The checks of the DistributedModel whose step runs (``use``); None outside one.
current: "DeferredChecks | None" = None


def use(checks: "DeferredChecks | None") -> None:
    global current
    current = checks


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
        hsc = cuda_kernels.tbe.device_constant((0, weights.shape[0]), weights.device)
        return Bags(ids, offsets, psw, 1, t * b, hsc, (group.group_name,), checked, fold=t)

    def forward(self, weights, bags, pooling, out_dtype):
        checks = current
        err = None if checks is None else checks.error_record(weights.device)
        out = cuda_kernels.tbe_forward(weights, bags.ids, bags.offsets, bags.hsc, T=bags.t, B=bags.b,
                                       pooling=pooling, per_sample_weights=bags.psw, table_names=bags.names, err=err)
        if checks is not None:
            checks.keep(_validator(bags))
        return _unfold(out, bags).to(out_dtype)

    def max_pool(self, weights, bags):  # no CUDA kernel: the torch reference, on the device
        if current is not None:  # a reference op indexes with the ids: the packing's flag is read first
            current.check_now()
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
        checks = current
        if pooling == "max":  # no CUDA kernel: the torch reference, on the device
            if checks is not None:  # nothing guards the reference's writes: the record is read first
                checks.check_now()
            tbe_backward_update_reference(group.weights.detach(), group.optimizer_state(), bags.linear(),
                                          bags.offsets, grad, T=bags.t, B=bags.b, pooling="max", winners=winners,
                                          **optim)
        else:
            cuda_kernels.tbe_backward_update(group.weights.detach(), group.optimizer_state(), bags.ids, bags.offsets,
                                             bags.hsc, grad, T=bags.t, B=bags.b, pooling=pooling,
                                             per_sample_weights=bags.psw, table_names=bags.names,
                                             checked=bags.checked, key_rows=key_rows,
                                             err=None if checks is None else checks.error_record(group.weights.device),
                                             step_args=_step_args(group, optim), **optim)
            if checks is not None:
                if not bags.checked:
                    checks.keep(_validator(bags))
                checks.after_update()


class _StepChecks:
    """``recc.ops``' checks of a reference op's ids (``check_bags``, ``check_field_ids``) inside a
    model's step, on the device into the step's error record, read with the rest (no sync); an
    op called on its own (no step) is checked at once, as before."""

    @staticmethod
    def bags(table, flat, offsets, rows, validate) -> bool:
        checks = current
        if checks is None:
            return False
        dev = flat.device
        # one table of one kernel's packing check: its ids against its rows, its offsets as bags
        # (ids alone: one bag of all of them)
        off = (offsets.reshape(1, -1).to(dev) if offsets is not None else   # (offsets may come on the host)
               cuda_kernels.tbe.device_constant((0,), dev).view(1, 1)).to(torch.int64)
        cuda_kernels.tbe.pack_offsets(flat.to(torch.int64), off, [flat.numel()], [rows], checks.error_record(dev))
        checks.keep(validate)
        return True

    @staticmethod
    def flag(bad, validate) -> bool:
        checks = current
        if checks is None:
            return False
        # a set flag marks the record as a kernel's failed check does (an atomicMin of the position,
        # unsigned: 0 is the least, ERR_NONE the most), so the guarded updates write nothing;
        # ``validate`` words the error
        checks.error_record(bad.device).masked_fill_(bad, 0)
        checks.keep(validate)
        return True


register_deferred_checks("cuda", _StepChecks)


def _step_args(group, optim: dict) -> torch.Tensor:
    """The update kernel's per-step arguments on the device, written now; inside a CUDA graph's
    capture, written before each replay instead (for the step it replays), since the captured
    launch reads them from this buffer."""
    buf = torch.empty(cuda_kernels.tbe.STEP_ARGS, dtype=torch.int64, device=group.weights.device)
    capture = cuda_graph.capturing()
    if capture is None:
        _write_step_args(buf, optim)
    else:
        capture.before_replay(lambda: _write_step_args(buf, _replayed_args(group, optim)))
    return buf


# The optimizer arguments a captured launch holds by value (only lr, eps and the step are read
# from the step's buffer).
_BY_VALUE = ("optimizer", "beta1", "beta2", "weight_decay", "weight_decay_mode")


def _replayed_args(group, captured: dict) -> dict:
    """The group's optimizer arguments for the step a replay runs; its by-value ones must be
    those captured."""
    now = table_update.optimizer_args(group)
    changed = [k for k in _BY_VALUE if now[k] != captured[k]]
    if changed:
        raise RuntimeError(f"recc: table group {group.group_name}'s optimizer changed ({', '.join(changed)}) since "
                           f"its CUDA graph was captured, which holds them; call dmodel.cuda_graph() again")
    return now


def _write_step_args(buf: torch.Tensor, optim: dict) -> None:
    cuda_kernels.tbe.write_step_args(buf, lr=optim["lr"], eps=optim["eps"], beta1=optim["beta1"],
                                     beta2=optim["beta2"], step=optim["step"])


def _validator(bags: Bags):
    """The host re-validation of ``bags`` (the slow path of a flagged record)."""
    return lambda: cuda_kernels.tbe.validate_on_host(bags.ids, bags.offsets, bags.hsc, bags.t, bags.b, bags.names)


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
    """``recc.pack_sparse`` on the device: the reference's concatenations, then one kernel
    (``tbe.pack_offsets``) that packs the offsets and checks every table's offsets and ids.

    Inside a model's step it reports into the step's ``DeferredChecks`` record (no sync);
    outside one its own record is read at once (one sync). A bad batch is re-validated by the CPU reference on host
    copies, which raises the same error (table and position) the CPU backend would. A stacked
    group (``stack=``) is stacked by the reference's ``stack_table_bags`` first (which checks
    each lookup on its own)."""
    tables = tuple(tables)
    check_id_dtypes(stacked_names(tables, stack), indices, offsets)   # eager's rule, before padding adds offsets
    if pad:
        indices, offsets = pad_table_bags(indices, offsets)
    if stack is not None:
        indices, offsets, per_sample_weights = stack_table_bags(indices, offsets, per_sample_weights, stack, tables,
                                                                rows)
    ids, off, _, psw, batch = flatten_bags(indices, offsets, per_sample_weights, tables)
    checks = current
    dev = ids.device
    err = checks.error_record(dev) if checks is not None else cuda_kernels.tbe.new_error_record(dev)
    packed = cuda_kernels.tbe.pack_offsets(ids, off, [i.numel() for i in indices], rows, err)

    def validate():
        why = "re-validate a flagged pack_sparse batch"
        OPS["pack_sparse"].reference([loader.host_copy(i, why) for i in indices],
                                     [None if o is None else loader.host_copy(o, why) for o in offsets],
                                     None if per_sample_weights is None else
                                     [loader.host_copy(w, why) for w in per_sample_weights],
                                     tables=tables, rows=rows)

    if checks is not None:
        checks.keep(validate)
    elif loader.host_read(err, "pack_sparse validation flag") != [ERR_NONE] * 2:  # an op on its own: one sync
        validate()
        raise RuntimeError("pack_sparse: the device validation flagged this batch but the CPU reference "
                           "accepts it; please report this")
    return SparseBatch(tables, ids, packed, psw, batch)


use_references("cuda")  # every other op: its torch reference runs on CUDA tensors as it is


@contextlib.contextmanager
def emulated_on_cpu(seed: "int | None" = None, sm_count: int = 2):
    """Runs a program compiled for CPU ranks as a CUDA program runs, without a GPU: every op
    bound to ``cpu`` calls its CUDA implementation (this module's lookup and packing, every other
    op's torch reference), the kernels on the emulator (``recc.kernels.cuda.emulator``). What the
    tests and ``bench/cuda_step_counts.py`` count a CUDA step on."""
    from recc.kernels.cuda import emulator
    global _emulating
    saved = {}
    for name, op in OPS.items():
        bound = _bound(name, "cpu")
        saved[bound], bound._fn = bound._fn, op.impl("cuda")
    before, _emulating = _emulating, True
    register_deferred_checks("cpu", _StepChecks)
    try:
        with emulator.emulated(seed=seed, sm_count=sm_count):
            yield
    finally:
        _emulating = before
        if not before:
            register_deferred_checks("cpu", None)
        for bound, fn in saved.items():
            bound._fn = fn


_emulating = False


def emulating() -> bool:
    """Whether a CPU program runs as a CUDA program now (``emulated_on_cpu``)."""
    return _emulating
