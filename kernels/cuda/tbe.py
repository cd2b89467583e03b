"""Table-batched embedding on CUDA: ``tbe.cu`` behind the CPU kernels' semantics.

Same layout and math as ``recc.kernels.cpu.tbe`` (read its docstring), with two differences
in the calling convention, both so that no host sync is needed on the fast path:

- the kernels take LOCAL ids plus ``hash_size_cumsum`` (a device tensor) and linearize
  inside, checking each id against its own table;
- weights may be fp32, fp16 or bf16 (half rows are pooled in fp32 and updated in fp32, then
  written back with stochastic rounding); optimizer state is fp32.

Bounds: ``tbe_forward`` reads back one 16-byte error record after its kernel (the one sync it
makes) and raises IndexError naming the table, bag and position of the first bad id (ValueError
for malformed offsets) — the kernel itself never touches a row outside the id's table.
``tbe_backward_update`` skips that read when ``checked=True`` (its ids are the ones the forward
just validated); its update kernels still refuse to write anything if linearization found a
bad id or a malformed bag, and with ``checked=False`` the error is raised after the (empty)
update.  Ids are also checked against the weight's rows, so a ``hash_size_cumsum`` that
claims more rows than the weight has cannot make a kernel leave it.

``err=`` (both functions): the caller's error record (``new_error_record``) instead of a fresh
one, never read here (no sync): the kernels report into it, the update kernels write nothing
while it is set (by any earlier launch), and the caller reads it once, where it costs nothing
(``recc.runtime.cuda_backend.DeferredChecks``: one record per training step), re-validating the
batch on the host with ``validate_on_host`` to word the error.

Limits (ValueError, never a silent fallback): the backward keeps a row's gradient in
registers, so D <= 1024 when D % 4 == 0 (else D <= 256); rows, ids and bags < 2^31.
"""
from __future__ import annotations

import collections
import struct

import torch

from recc.kernels.cpu.tbe import validate_inputs
from recc.kernels.tbe_inputs import OPTIMIZERS, check_lookup, check_update

KERNEL_POOLINGS = ("sum", "mean")

from . import loader

SOURCE = "tbe.cu"
ERR_NONE = -1  # all ones, read back as int64
MAX_CHUNKS = 8  # matches tbe.cu
# A row with more ids than long_run_segment(D) has its sum split into chunks of that many ids,
# counted from the row's own first id in the sorted order (so the sum depends only on the row's
# ids), each summed by its own group of threads (tbe.cu: tbe_long_run_partials); a group sums at
# most that many ids one after another.
MIN_SEGMENT = 64
# The chunks' partial rows of a long run are added up by a tree of tbe_long_run_combine
# launches, this many rows into one per level: a thread adds at most 2 * COMBINE_FANIN rows per
# launch, and log_COMBINE_FANIN(N / chunk) levels cover any run (3 at a million ids, chunk 64).
COMBINE_FANIN = 32


def long_run_segment(D: int) -> int:
    """Both the long-run threshold and the chunk length (one value: a long run must not fit
    inside a chunk, so the chunk is at most the threshold): 64 ids, or D for wider rows, so the
    partial sums ([segments, 2, D] fp32, segments = N / chunk: 8 * N * D / chunk bytes) never
    outgrow the sort's own int64 permutation (8 * N bytes)."""
    return max(MIN_SEGMENT, D)


THREADS = 256
_OPT_CODE = {name: code for code, name in enumerate(OPTIMIZERS)}
_INT32_MAX = 2**31 - 1


def _np():
    import numpy as np
    return np


def _lanes(D: int, V: int) -> int:
    need = -(-D // V)
    lanes = 1
    while lanes < need and lanes < 32:
        lanes *= 2
    return lanes


def _vector_width(D: int, *tensors: torch.Tensor) -> int:
    if D % 4:
        return 1
    for t in tensors:
        if t is not None and t.data_ptr() % (4 * t.element_size()):
            return 1
    return 4


_WEIGHT_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _suffix(weights: torch.Tensor, V: int) -> str:
    return f"{_WEIGHT_SUFFIX[weights.dtype]}_v{V}"


def _check(weights, indices, offsets, hash_size_cumsum, T, B, pooling, per_sample_weights):
    if not loader.kernel_device(weights.device):
        raise ValueError(f"the CUDA TBE kernels need CUDA tensors, got weights on {weights.device}")
    check_lookup(weights, indices, offsets, T, B, pooling, per_sample_weights)
    if not weights.is_contiguous():
        raise ValueError("weights must be contiguous (the kernels address rows as row * D)")
    if pooling not in KERNEL_POOLINGS:
        raise ValueError(f"pooling {pooling!r} has no CUDA kernel (they pool with {KERNEL_POOLINGS}); "
                         f"max pooling runs recc.kernels.tbe_forward_reference on the device")
    for name, x in (("indices", indices), ("offsets", offsets), ("hash_size_cumsum", hash_size_cumsum)):
        if x.device != weights.device:
            raise ValueError(f"{name} is on {x.device}, weights on {weights.device}")
    if hash_size_cumsum.dim() != 1:
        raise ValueError(f"hash_size_cumsum must be 1-D, got shape {tuple(hash_size_cumsum.shape)}")
    if T * B == 0 and indices.numel():
        # no bag to check on the device: offsets = [0] cannot end at len(indices)
        raise ValueError(f"offsets[-1] must equal len(indices) = {indices.numel()}, but there are "
                         f"no bags (T={T}, B={B})")
    if hash_size_cumsum.numel() != T + 1:
        raise ValueError(f"hash_size_cumsum has {hash_size_cumsum.numel()} entries, expected "
                         f"T+1 = {T + 1}")
    if weights.shape[0] >= _INT32_MAX or indices.numel() > _INT32_MAX or T * B > _INT32_MAX:
        raise ValueError(f"the CUDA TBE kernels index rows, ids and bags with int32: got "
                         f"{weights.shape[0]} rows, {indices.numel()} ids, {T * B} bags")


def _i64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int64).contiguous()


def _f32(x):
    return None if x is None else x.detach().to(torch.float32).contiguous()


def new_error_record(device) -> torch.Tensor:
    """[first bad id position, first bad bag], all ones (ERR_NONE) until a kernel sets them."""
    return torch.full((2,), ERR_NONE, dtype=torch.int64, device=device)


_CONSTANTS: "collections.OrderedDict[tuple, tuple[torch.Tensor, bool]]" = collections.OrderedDict()
CONSTANTS_KEPT = 1024   # the latest kept: more than one step of any model makes (a warm-up's must
                        # survive to its capture), few enough to churn as jagged batches make new ones


def device_constant(values: tuple, device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device``, shared and read-only: values a step derives
    from its shapes alone (each table's id count and rows) are copied to the device once, not in
    every step, and never inside a captured CUDA graph (where a host copy is not allowed: the
    capture finds the one its warm-up made). The latest ``CONSTANTS_KEPT`` are kept, and every
    one a capture read for the life of the process: the graph reads it at each replay."""
    key = (values, str(device))
    hit = _CONSTANTS.get(key)
    captured = _capturing(device)
    if hit is None:
        hit = (torch.tensor(values, dtype=torch.int64, device=device), captured)
    elif captured and not hit[1]:
        hit = (hit[0], True)
    _CONSTANTS[key] = hit
    _CONSTANTS.move_to_end(key)
    unpinned = [k for k, (_, pinned) in _CONSTANTS.items() if not pinned]
    for k in unpinned[:max(0, len(unpinned) - CONSTANTS_KEPT)]:
        del _CONSTANTS[k]
    return hit[0]


def _capturing(device) -> bool:
    """Whether a CUDA graph is being captured on ``device`` (the emulator's graph on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_current_stream_capturing()
    from .emulator import graph
    return graph.recording()


def pack_offsets(ids: torch.Tensor, offsets: torch.Tensor, sizes: list, rows, err: torch.Tensor) -> torch.Tensor:
    """``recc.pack_sparse``'s device half in one launch: each table's start offsets ``offsets``
    ``[T, B]`` (int64, into its own ``sizes[t]`` ids) as the packed ``[T*B+1]`` offsets into
    ``ids`` (int64, the tables' ids back to back), the offsets and ids checked against each
    table's ``rows[t]`` into ``err`` (not read here: no sync). ``sizes`` and ``rows`` are host
    values; they go to the device in one copy."""
    T, B = offsets.shape
    N = ids.numel()
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    if starts[-1] != N or len(rows) != T or len(sizes) != T:
        raise ValueError(f"pack_offsets: {T} tables of {list(sizes)} ids and rows {list(rows)} for {N} ids")
    dev = ids.device
    meta = device_constant(tuple(starts) + tuple(int(r) for r in rows), dev)
    out = torch.empty(T * B + 1, dtype=torch.int64, device=dev)
    np = _np()
    loader.launch(SOURCE, "tbe_pack", dev, -(-max(N, T * B + 1) // THREADS), THREADS,
                  (ids.contiguous(), offsets.contiguous(), meta, np.int32(T), np.int64(B), np.int64(N), out, err))
    return out


def validate_on_host(indices, offsets, hash_size_cumsum, T: int, B: int, table_names=None) -> None:
    """The slow path of a flagged batch: the CPU validator finds the first fault and raises
    naming its table, bag and position (host copies: syncs, on the error path only)."""
    names = list(table_names) if table_names is not None else [f"#{t}" for t in range(T)]
    why = "re-validate a flagged TBE batch"
    validate_inputs(loader.host_copy(indices, why), loader.host_copy(offsets, why),
                    loader.host_copy(hash_size_cumsum, why), T, B, names)


def raise_for_error(err: torch.Tensor, indices, offsets, hash_size_cumsum, T: int, B: int,
                    table_names=None) -> None:
    """Reads the error record (a sync) and raises with the table, bag and position at fault."""
    bad_id, bad_bag = loader.host_read(err, "TBE error record")
    if bad_id == ERR_NONE and bad_bag == ERR_NONE:
        return
    validate_on_host(indices, offsets, hash_size_cumsum, T, B, table_names)
    raise IndexError(f"the CUDA TBE kernel found a bad id at position {bad_id} / bag {bad_bag} "
                     f"that the CPU validator does not reproduce (does hash_size_cumsum claim "
                     f"more rows than the weight has, or were the inputs modified concurrently?)")


def tbe_forward(weights: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                hash_size_cumsum: torch.Tensor, *, T: int, B: int, pooling: str = "sum",
                per_sample_weights: torch.Tensor | None = None, table_names=None,
                err: torch.Tensor | None = None) -> torch.Tensor:
    """Pooled embeddings ``[B, T*D]`` (fp32) of local ``indices``; see the module docstring.

    ``err``: the caller's error record, which the kernel reports into and this function does not
    read (no sync; the output of a bad id's bag is not to be trusted until the caller has read it).
    """
    _check(weights, indices, offsets, hash_size_cumsum, T, B, pooling, per_sample_weights)
    np = _np()
    R, D = weights.shape
    out = torch.empty(B, T * D, dtype=torch.float32, device=weights.device)
    deferred = err is not None
    if not deferred:
        err = new_error_record(weights.device)
    ids, off, hsc = _i64(indices), _i64(offsets), _i64(hash_size_cumsum)
    psw = _f32(per_sample_weights)
    if T * B:
        V = _vector_width(D, weights)
        lanes = _lanes(D, V)
        grid = -(-(T * B * lanes) // THREADS)
        loader.launch(SOURCE, f"tbe_forward_{_suffix(weights, V)}", weights.device, grid, THREADS,
                      (weights.detach(), np.int32(D), ids, off, hsc, np.int32(T), np.int64(B),
                       np.int64(R), psw, np.int32(pooling == "mean"), np.int64(ids.numel()), out,
                       err, np.int32(lanes)))
    if deferred:
        return out
    raise_for_error(err, indices, offsets, hash_size_cumsum, T, B, table_names)
    return out


def _sm_count(device) -> int:
    return loader.multiprocessor_count(device)


STEP_ARGS = 3   # int64 words: (lr, eps) and (1 - beta1^step, 1 - beta2^step) as float32 pairs, the seed


def new_step_args(device) -> torch.Tensor:
    """A device buffer for one update's step arguments (``write_step_args``)."""
    return torch.zeros(STEP_ARGS, dtype=torch.int64, device=device)


def step_args(*, lr: float, eps: float, beta1: float, beta2: float, step: int, seed: int | None = None) -> torch.Tensor:
    """The update kernel's per-step arguments as it reads them (``step_args_of`` in tbe.cu), on
    the host: the bias corrections are the CPU kernels' (Python floats, rounded to fp32 once),
    ``seed`` (default ``step``) keys the stochastic rounding."""
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    seed = int(step if seed is None else seed) & 0xFFFFFFFFFFFFFFFF
    # packed on the host as the kernel reads them (no torch op: one copy to the device, no more)
    return torch.frombuffer(bytearray(struct.pack("<4fQ", lr, eps, bc1, bc2, seed)), dtype=torch.int64)


def write_step_args(dst: torch.Tensor, **kw) -> None:
    """Writes ``step_args(**kw)`` into the device buffer ``dst``, ordered on the current stream
    (from pinned memory on a GPU: an asynchronous copy, no sync)."""
    host = step_args(**kw)
    if dst.is_cuda:
        host = host.pin_memory()
    dst.copy_(host, non_blocking=True)


def tbe_backward_update(weights: torch.Tensor, state: dict[str, torch.Tensor],
                        indices: torch.Tensor, offsets: torch.Tensor,
                        hash_size_cumsum: torch.Tensor, grad_output: torch.Tensor, *, T: int,
                        B: int, pooling: str = "sum",
                        per_sample_weights: torch.Tensor | None = None, optimizer: str = "sgd",
                        lr: float, eps: float = 1e-8, beta1: float = 0.9, beta2: float = 0.999,
                        weight_decay: float = 0.0, step: int = 1, seed: int | None = None,
                        table_names=None, checked: bool = False, weight_decay_mode: str = "l2",
                        key_rows: torch.Tensor | None = None, err: torch.Tensor | None = None,
                        step_args: torch.Tensor | None = None) -> None:
    """Backward of ``tbe_forward`` fused with the sparse optimizer, in place; the math of
    ``recc.kernels.cpu.tbe.tbe_backward_update``.  ``seed`` keys the stochastic rounding of
    fp16/bf16 weights (default: ``step``); ``key_rows`` (int64 [R] on the weights' device, or
    None) keys weight row r's rounding on row ``key_rows[r]`` instead of r (a cached group's
    slot -> group row map: each slot rounds as the row it holds would when resident; only the
    touched rows' entries are read). ``err``: the caller's error record (see the module
    docstring): nothing is written while it is set, and it is not read here. ``step_args``: the
    step's arguments on the device as ``write_step_args`` wrote them, which the kernel then reads
    instead of ``lr``, ``eps``, ``step`` and ``seed`` (a CUDA graph's replay rewrites them before
    each replay; the captured launch reads them from there); None: written here from those."""
    _check(weights, indices, offsets, hash_size_cumsum, T, B, pooling, per_sample_weights)
    check_update(weights, state, optimizer, grad_output, T, B, weight_decay_mode, key_rows, in_place=True)
    R, D = weights.shape
    if key_rows is not None:
        # fp32 rows are stored as they are: no rounding to key
        key_rows = key_rows.contiguous() if weights.dtype != torch.float32 else None
    N = indices.numel()
    if N == 0 or T * B == 0:
        return
    go = _f32(grad_output)
    if D % 4 == 0 and go.data_ptr() % 16:
        # A contiguous view that starts off a 16-byte boundary would force 1-wide loads, and
        # with them the 256-column limit on a D that is supported: it is only read, so an
        # aligned copy keeps 4-wide loads.
        go = go.clone()
    V = _vector_width(D, weights, go)
    lanes = _lanes(D, V)
    if -(-D // (lanes * V)) > MAX_CHUNKS:
        if D % 4 == 0 and D <= 32 * 4 * MAX_CHUNKS:
            raise ValueError(f"the CUDA TBE backward needs 16-byte aligned weight rows for D={D} > "
                             f"{32 * MAX_CHUNKS} (the weight is a view at a byte offset of "
                             f"{weights.data_ptr() % 16} mod 16); pass a tensor that owns its storage")
        raise ValueError(f"the CUDA TBE backward keeps a row in registers: D={D} is above its "
                         f"limit of {32 * 4 * MAX_CHUNKS} (D % 4 == 0) or {32 * MAX_CHUNKS}")
    np = _np()
    dev = weights.device
    ids, off, hsc = _i64(indices), _i64(offsets), _i64(hash_size_cumsum)
    psw = _f32(per_sample_weights)
    deferred = err is not None
    if not deferred:
        err = new_error_record(dev)
    rows = torch.empty(N, dtype=torch.int32, device=dev)
    bag_of = torch.empty(N, dtype=torch.int32, device=dev)
    grid_n = -(-N // THREADS)
    # max(N, T*B) threads: thread j < T*B also checks bag j's offsets
    loader.launch(SOURCE, "tbe_linearize", dev, -(-max(N, T * B) // THREADS), THREADS,
                  (ids, off, hsc, np.int32(T), np.int64(B), np.int64(R), np.int64(N), rows, bag_of,
                   err))
    # Stable: a row's ids keep their index order, so its gradient sums like the CPU kernels'.
    sorted_rows, perm = torch.sort(rows, stable=True)
    is_start = torch.empty(N, dtype=torch.int32, device=dev)
    loader.launch(SOURCE, "tbe_run_flags", dev, grid_n, THREADS, (sorted_rows, np.int64(N), is_start))
    run_idx = torch.cumsum(is_start, 0, dtype=torch.int32)
    run_start = torch.empty(N + 1, dtype=torch.int32, device=dev)
    loader.launch(SOURCE, "tbe_run_bounds", dev, grid_n, THREADS,
                  (sorted_rows, run_idx, np.int64(N), run_start))
    num_runs_at = run_idx[N - 1:]  # on the device: the number of runs is never read back
    m1 = state.get("momentum1") if optimizer != "sgd" else None
    m2 = state.get("momentum2") if optimizer == "adam" else None
    if step_args is None:
        step_args = new_step_args(dev)
        write_step_args(step_args, lr=lr, eps=eps, beta1=beta1, beta2=beta2, step=step, seed=seed)
    segment = long_run_segment(D)
    args = (weights.detach(), np.int32(D), m1, m2, sorted_rows, perm, bag_of, run_start,
            num_runs_at, off, np.int32(T), np.int64(B), go, psw, np.int32(pooling == "mean"),
            np.int32(_OPT_CODE[optimizer]), np.float32(beta1), np.float32(beta2), np.float32(weight_decay),
            np.int32(weight_decay_mode == "decoupled"), step_args, key_rows, np.int32(lanes), np.int32(segment))
    sms = _sm_count(dev)
    groups_per_block = THREADS // lanes
    partials = None
    if N > segment:  # only then can a run be long
        # [segment][slot][D]: chunk k of a long run starting at sorted position q goes to
        # [q // segment][k == 0]; only those are written, and only those are read (the combine
        # levels add them up in place, into the run's first chunk's row)
        segments = -(-N // segment)
        partials = torch.empty(segments * 2 * D, dtype=torch.float32, device=dev)
        loader.launch(SOURCE, f"tbe_long_run_partials_v{V}", dev, min(-(-segments // groups_per_block), sms * 16),
                      THREADS, (sorted_rows, run_idx, run_start, perm, bag_of, off, np.int32(T), np.int64(B), go,
                                psw, np.int32(pooling == "mean"), np.int64(N), np.int32(D), np.int32(lanes),
                                np.int32(segment), partials, err))
        # Level l adds up nodes of COMBINE_FANIN children of span = segment * fanin^(l-1) ids
        # each; a run with more than span ids has such a node, and no run has more than N.
        span = segment
        while span < N:
            level_segments = -(-N // span)
            loader.launch(SOURCE, f"tbe_long_run_combine_v{V}", dev,
                          min(-(-level_segments // groups_per_block), sms * 16), THREADS,
                          (run_idx, run_start, np.int64(N), np.int32(D), np.int32(lanes), np.int32(segment),
                           np.int64(span), np.int32(COMBINE_FANIN), partials, err))
            span *= COMBINE_FANIN
    loader.launch(SOURCE, f"tbe_update_{_suffix(weights, V)}", dev, min(-(-N // groups_per_block), sms * 16),
                  THREADS, args + (partials, err))
    _bump_version(weights)
    for s in (m1, m2):
        if s is not None:
            _bump_version(s)
    if not (checked or deferred):
        raise_for_error(err, indices, offsets, hash_size_cumsum, T, B, table_names)


def _bump_version(t: torch.Tensor) -> None:
    # Kernel writes bypass autograd's version counter; a zero-size in-place op bumps it, as
    # the CPU kernels do, so stale saved tensors are detected.
    with torch.no_grad():
        t.narrow(0, 0, 0).zero_()
