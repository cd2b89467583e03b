"""Table-batched embedding (TBE) kernels for CPU: one group of T tables sharing a dim D.

The group's tables live in one concatenated fp32 weight ``weights[R_total, D]``; table t owns
rows ``[hash_size_cumsum[t], hash_size_cumsum[t+1])``.  Inputs are feature-major like FBGEMM:
``indices[N]`` holds LOCAL ids, tables concatenated in order, and ``offsets[T*B+1]`` delimits
bag b of table t as ``indices[offsets[t*B+b]:offsets[t*B+b+1]]``.  Pooled outputs are
batch-major, ``[B, T*D]`` with ``D_offsets[t] = t*D``.

Every kernel comes in a pure-torch reference (``*_reference``: short, obviously correct) and
a C fast path (``tbe_forward.c``, ``tbe_backward.c``, ``gather.c``; see ``native.py``); the public names dispatch to the fast
path when it is available and ``RECC_CPU_KERNELS`` does not say ``reference``.  Both have the
same semantics and sum each row's gradients in index order; results agree to fp32 rounding
(reductions inside a row, and mean's 1/len, are rounded differently).  The C path's results do
not depend on the thread count.

Backward is fused with the sparse optimizer in "exact" mode: gradients of duplicate ids are
summed first, then every touched row (and its optimizer state) is updated exactly once, in
place; rows absent from the batch are not touched at all.  ``rowwise_adagrad`` follows
FBGEMM: ``m[row] += mean(g*g)``, ``w -= lr * g / (sqrt(m[row]) + eps)``.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..tbe_inputs import OPTIMIZERS, check_lookup, check_update, optimizer_state_shapes
from . import native, sparse

# The weights' storage types and the C kernels' codes for them (half.h's W_*).
WEIGHT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
POOLED_DTYPES = (torch.float32, torch.bfloat16)  # what the forward writes
POOLINGS = ("sum", "mean", "max")
_OPTIMIZER_CODE = {name: code for code, name in enumerate(OPTIMIZERS)}  # matches the C enum


# ----------------------------------------------------------------------------- inputs


def _as_cumsum(hash_size_cumsum) -> torch.Tensor:
    return torch.as_tensor(hash_size_cumsum, dtype=torch.int64).reshape(-1)


def _table_counts(offsets: torch.Tensor, T: int, B: int) -> torch.Tensor:
    """Number of ids of each table: offsets[(t+1)*B] - offsets[t*B]."""
    if B == 0:
        return torch.zeros(T, dtype=torch.int64)
    starts = offsets[::B]  # offsets[t*B] for t = 0..T
    return starts[1:] - starts[:-1]


def validate_inputs(indices: torch.Tensor, offsets: torch.Tensor, hash_size_cumsum, T: int,
                    B: int, table_names: Sequence[str]) -> None:
    """Checks a group's sparse inputs; raises before any row is touched.

    ValueError for malformed offsets (wrong length, ``offsets[0] != 0``,
    ``offsets[-1] != len(indices)``, a decrease), IndexError for an id outside its table.
    Messages name the table and the bag / position.  Vectorised: no Python loop over ids.
    """
    if len(table_names) != T:
        raise ValueError(f"got {len(table_names)} table names for T={T} tables")
    hsc = _as_cumsum(hash_size_cumsum)
    if hsc.numel() != T + 1:
        raise ValueError(f"hash_size_cumsum has {hsc.numel()} entries, expected T+1 = {T + 1}")
    if T > 0 and bool((hsc[1:] < hsc[:-1]).any()):
        raise ValueError(f"hash_size_cumsum must be non-decreasing, got {hsc.tolist()}")
    for name, x in (("indices", indices), ("offsets", offsets)):
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
    n_bags = T * B
    if offsets.numel() != n_bags + 1:
        raise ValueError(f"offsets has {offsets.numel()} entries, expected T*B+1 = {n_bags + 1} "
                         f"(T={T} tables, B={B} bags per table)")
    offsets = offsets.to(torch.int64)
    N = indices.numel()
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        where = f" (start of table {table_names[0]!r}, bag 0)" if n_bags else ""
        raise ValueError(f"offsets[0] must be 0, got {first}{where}")
    if last != N:
        where = f" (end of table {table_names[-1]!r}, bag {B - 1})" if n_bags else ""
        raise ValueError(f"offsets[-1] must equal len(indices) = {N}, got {last}{where}")
    if n_bags == 0:
        return
    decreasing = (offsets[1:] < offsets[:-1]).nonzero()
    if decreasing.numel():
        k = int(decreasing[0, 0])
        t, b = divmod(k, B)
        raise ValueError(
            f"offsets must be non-decreasing: table {table_names[t]!r} bag {b} has "
            f"offsets[{k + 1}] = {int(offsets[k + 1])} < offsets[{k}] = {int(offsets[k])}")
    if N == 0:
        return
    rows = hsc[1:] - hsc[:-1]
    counts = _table_counts(offsets, T, B)
    ids = indices.to(torch.int64)
    bad = (ids < 0) | (ids >= torch.repeat_interleave(rows, counts, output_size=N))
    if bool(bad.any()):
        p = int(bad.to(torch.uint8).argmax())
        table_starts = offsets[::B].contiguous()
        t = int(torch.searchsorted(table_starts, torch.tensor([p]), right=True)[0]) - 1
        table_offsets = offsets[t * B:(t + 1) * B + 1]
        b = int(torch.searchsorted(table_offsets, torch.tensor([p]), right=True)[0]) - 1
        start = int(table_offsets[0])
        raise IndexError(
            f"table {table_names[t]!r} (table {t} of the group): id {int(ids[p])} in bag {b} "
            f"(position {p - start} of the table's indices, position {p} overall) is out of "
            f"range [0, {int(rows[t])})")


def linearize_indices(indices: torch.Tensor, offsets: torch.Tensor, hash_size_cumsum, T: int,
                      B: int) -> torch.Tensor:
    """Local ids -> rows of the concatenated weight: ``indices + hash_size_cumsum[t]``."""
    hsc = _as_cumsum(hash_size_cumsum)
    offsets = offsets.to(torch.int64)
    lin = sparse.linearize(indices, offsets, hsc, T, B)
    if lin is not None:
        return lin
    N = indices.numel()
    if B == 0 or N == 0:
        return indices.to(torch.int64)
    # Each id's table: the last whose first id (offsets[t*B]) is at or before it. A search is safe
    # whatever the offsets hold; a repeat by counts taken from them is a fatal device assert on a
    # GPU when a bad batch's counts do not add up to N, and a GPU step checks them only later (its
    # rows then come out wrong, and the kernels' bounds check flags them).
    starts = offsets[:T * B:B].contiguous()
    table = torch.searchsorted(starts, torch.arange(N, device=indices.device), right=True).sub_(1).clamp_(0, T - 1)
    return hsc[:-1][table].add_(indices)  # int32 ids widen inside the add: one pass


def _offsets_ok(offsets: torch.Tensor, n: int, lib) -> bool:
    """offsets start at 0, never decrease and end at n (one C pass when ``lib``, the loaded TBE
    library, is there: the tensor ops and their host reads cost more than the pooling of a small
    batch)."""
    if lib is not None and offsets.dtype == torch.int64 and offsets.device.type == "cpu" and \
            offsets.is_contiguous() and offsets.numel():
        return bool(lib.recc_offsets_ok(offsets.data_ptr(), offsets.numel() - 1, n))
    return int(offsets[0]) == 0 and int(offsets[-1]) == n and not bool((offsets[1:] < offsets[:-1]).any())


def _check_call(weights, lin_indices, offsets, T, B, pooling, per_sample_weights, lib):
    """The checks every TBE entry runs before a kernel reads a row; ``lib``: ``native.library()``,
    which a native entry has in hand already (each look-up reads ``RECC_CPU_KERNELS``)."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {POOLINGS}")
    check_lookup(weights, lin_indices, offsets, T, B, pooling, per_sample_weights)
    # The C kernels trust offsets to index lin_indices: check what makes that safe (cheap,
    # O(T*B)); validate_inputs gives the detailed, per-table diagnosis.
    if not _offsets_ok(offsets, lin_indices.numel(), lib):
        raise ValueError("offsets must start at 0, be non-decreasing and end at "
                         f"len(lin_indices) = {lin_indices.numel()}; run validate_inputs for "
                         "the table and bag at fault")


def _num_threads() -> int:
    return max(1, torch.get_num_threads())


# ----------------------------------------------------------------------------- forward


def tbe_forward_reference(weights: torch.Tensor, lin_indices: torch.Tensor,
                          offsets: torch.Tensor, *, T: int, B: int, pooling: str = "sum",
                          per_sample_weights: torch.Tensor | None = None,
                          out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One F.embedding_bag over the concatenated weight, reordered to batch-major [B, T*D]."""
    _check_call(weights, lin_indices, offsets, T, B, pooling, per_sample_weights, native.library())
    _check_out_dtype(out_dtype)
    D = weights.shape[1]
    with torch.no_grad():
        weights = weights.float()  # half weights pool in fp32, as the C kernels do
        pooled = F.embedding_bag(lin_indices.to(torch.int64), weights, offsets.to(torch.int64),
                                 mode=pooling, per_sample_weights=per_sample_weights,
                                 include_last_offset=True)  # [T*B, D], feature-major
        return pooled.view(T, B, D).transpose(0, 1).reshape(B, T * D).to(out_dtype)


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in POOLED_DTYPES:
        raise ValueError(f"pooled rows are written as float32 or bfloat16, not {out_dtype}")


def _max_bags(weights, lin_indices, offsets) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature-major max-pooled bags ``[T*B, D]`` and their winners: the row whose value each
    bag's column d took (the first of equal maxima, as ``nn.EmbeddingBag(mode='max')`` picks it),
    -1 for an empty bag. Plain torch (runs on any device): max pooling is rare enough that it has
    no C/CUDA kernel."""
    with torch.no_grad():
        pooled, _, bag_size, winners = torch.ops.aten._embedding_bag_forward_only(
            weights.float(), lin_indices.to(torch.int64), offsets.to(torch.int64), False, 2, False, None, True, -1)
        return pooled, winners.masked_fill_((bag_size == 0)[:, None], -1)


def max_pool(weights: torch.Tensor, lin_indices: torch.Tensor, offsets: torch.Tensor, *, T: int,
             B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Max pooling's output ``[B, T*D]`` and its winners (``[T*B, D]``), in one pass: a caller
    that runs backward later hands the winners to ``tbe_backward_update`` (the weights may have
    changed in between, when a model looks a group up twice before one backward)."""
    _check_call(weights, lin_indices, offsets, T, B, "max", None, native.library())
    pooled, winners = _max_bags(weights, lin_indices, offsets)
    return pooled.view(T, B, -1).transpose(0, 1).reshape(B, -1), winners


def tbe_forward_native(weights: torch.Tensor, lin_indices: torch.Tensor,
                       offsets: torch.Tensor, *, T: int, B: int, pooling: str = "sum",
                       per_sample_weights: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """C pooling written straight into [B, T*D]; raises if the C kernels are unavailable."""
    lib = native.library()
    if lib is None:
        raise RuntimeError("the C TBE kernels are unavailable (see recc.kernels.cpu.native)")
    if pooling == "max":
        raise ValueError("the C TBE kernels pool with sum or mean; max runs the reference")
    _check_call(weights, lin_indices, offsets, T, B, pooling, per_sample_weights, lib)
    _check_out_dtype(out_dtype)
    R, D = weights.shape
    w = weights.detach().contiguous()
    lin = lin_indices.to(torch.int64).contiguous()
    off = offsets.to(torch.int64).contiguous()
    psw = None if per_sample_weights is None else \
        per_sample_weights.detach().to(torch.float32).contiguous()
    out = torch.empty(B, T * D, dtype=out_dtype)
    rc = lib.recc_tbe_forward(w.data_ptr(), WEIGHT_DTYPES[w.dtype], R, D, lin.data_ptr(), off.data_ptr(), T, B,
                              None if psw is None else psw.data_ptr(), int(pooling == "mean"),
                              out.data_ptr(), int(out_dtype == torch.bfloat16), _num_threads())
    if rc == 1:
        raise IndexError(f"lin_indices has a row outside [0, {R}); run validate_inputs on the "
                         f"local ids to find the table and bag")
    if rc != 0:
        raise RuntimeError(f"recc_tbe_forward failed with code {rc}")
    return out


def tbe_forward(weights: torch.Tensor, lin_indices: torch.Tensor, offsets: torch.Tensor, *,
                T: int, B: int, pooling: str = "sum",
                per_sample_weights: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pooled embeddings ``[B, T*D]``: row b is [pooled(table 0, b), pooled(table 1, b), ...].

    ``pooling`` is 'sum', 'mean' or 'max' (an empty bag pools to 0; max has no C kernel and
    runs the reference); ``per_sample_weights`` scale each id (sum pooling only).
    ``out_dtype``: float32, or bfloat16 for a bf16 consumer (``cast_embeddings``): each bag is
    summed in fp32 and rounded once, to nearest even — the bits of the fp32 result's
    ``.to(torch.bfloat16)``. No autograd: the caller wraps this in an autograd.Function.
    """
    if pooling != "max" and native.library() is not None and weights.device.type == "cpu" and \
            _native_sizes_ok(lin_indices, T, B):
        return tbe_forward_native(weights, lin_indices, offsets, T=T, B=B, pooling=pooling,
                                  per_sample_weights=per_sample_weights, out_dtype=out_dtype)
    return tbe_forward_reference(weights, lin_indices, offsets, T=T, B=B, pooling=pooling,
                                 per_sample_weights=per_sample_weights, out_dtype=out_dtype)


def gather_rows(weights: torch.Tensor, ids: Sequence[torch.Tensor], rows: Sequence[int],
                hash_size_cumsum: Sequence[int], tables: Sequence[str] | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One-id lookups of a group's tables: ``(lin, [rows_t])`` where ``rows_t`` is table t's
    rows ``[ids[t].numel(), D]`` fp32, contiguous, in its ids' order (what ``F.embedding``
    returns) and ``lin`` the linearized ids of all tables back to back (for
    ``tbe_backward_update`` with one one-id bag per id). ``hash_size_cumsum``: table t's rows
    start at ``hash_size_cumsum[t]`` (ints). An id outside ``[0, rows[t])`` raises
    ``IndexError`` naming the table (``tables[t]``, else its position) and the id, before any
    row is read. No autograd."""
    flat = [i.reshape(-1) for i in ids]
    lib = native.library()
    t = len(flat)
    if lib is None or weights.device.type != "cpu" or not weights.is_contiguous() or \
            any(f.dtype not in _ID_DTYPES or f.device.type != "cpu" for f in flat):
        return gather_rows_reference(weights, flat, rows, hash_size_cumsum, tables)
    flat = [f.contiguous() for f in flat]
    R, D = weights.shape
    counts = [f.numel() for f in flat]
    lin = torch.empty(sum(counts), dtype=torch.int64)
    outs = [torch.empty(n, D, dtype=torch.float32) for n in counts]
    arr64 = ctypes.c_int64 * t
    rc = lib.recc_gather_rows(weights.data_ptr(), WEIGHT_DTYPES[weights.dtype], R, D, t,
                              (ctypes.c_void_p * t)(*[f.data_ptr() for f in flat]),
                              (ctypes.c_int32 * t)(*[f.dtype == torch.int32 for f in flat]),
                              arr64(*counts), arr64(*rows), arr64(*hash_size_cumsum[:t]), lin.data_ptr(),
                              (ctypes.c_void_p * t)(*[o.data_ptr() for o in outs]), _num_threads())
    if rc > 0:
        return gather_rows_reference(weights, flat, rows, hash_size_cumsum, tables)  # raises, naming the id
    if rc != 0:
        raise RuntimeError(f"recc_gather_rows failed with code {rc}")
    return lin, outs


def gather_rows_reference(weights, flat, rows, hsc, tables=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``gather_rows`` in plain torch (any device)."""
    for t, (f, r) in enumerate(zip(flat, rows)):
        if f.numel():
            bad = ((f < 0) | (f >= r)).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                name = tables[t] if tables is not None else f"{t} of the group"
                raise IndexError(f"table {name}: id {int(f[i])} at position {i} is outside the table's rows [0, {r})")
    with torch.no_grad():
        lin = torch.cat([f.to(torch.int64) + h for f, h in zip(flat, hsc)]) if flat else \
            torch.empty(0, dtype=torch.int64, device=weights.device)
        return lin, [weights[f.to(torch.int64) + h].float() for f, h in zip(flat, hsc)]


# ----------------------------------------------------------------------------- backward


def tbe_backward_update_reference(weights: torch.Tensor, state: dict[str, torch.Tensor],
                                  lin_indices: torch.Tensor, offsets: torch.Tensor,
                                  grad_output: torch.Tensor, *, T: int, B: int,
                                  pooling: str = "sum",
                                  per_sample_weights: torch.Tensor | None = None,
                                  optimizer: str = "sgd", lr: float, eps: float = 1e-8,
                                  beta1: float = 0.9, beta2: float = 0.999,
                                  weight_decay: float = 0.0, step: int = 1,
                                  grad_scale: float = 1.0, weight_decay_mode: str = "l2",
                                  seed: int | None = None, winners: torch.Tensor | None = None,
                                  key_rows: torch.Tensor | None = None) -> None:
    """Pure-torch backward + fused optimizer: unique + index_add + one row update. ``winners``:
    max pooling's, from ``max_pool`` at forward (else recomputed from the current weights)."""
    _check_call(weights, lin_indices, offsets, T, B, pooling, per_sample_weights, native.library())
    check_update(weights, state, optimizer, grad_output, T, B, weight_decay_mode, key_rows)
    R, D = weights.shape
    N = lin_indices.numel()
    if N == 0:
        return
    with torch.no_grad():
        lin = lin_indices.to(torch.int64)
        off = offsets.to(torch.int64)
        dev = weights.device
        # grad_output rows in bag order (bag j = t*B + b).
        grad_bags = grad_output.detach().to(torch.float32).reshape(B, T, D).transpose(0, 1) \
            .reshape(T * B, D)
        if grad_scale != 1.0:
            grad_bags = grad_bags * grad_scale
        rows, slot = torch.unique(lin, sorted=True, return_inverse=True)
        if int(rows[0]) < 0 or int(rows[-1]) >= R:
            raise IndexError(f"lin_indices has a row outside [0, {R}); run validate_inputs on "
                             f"the local ids to find the table and bag")
        if pooling == "max":
            # Column d of a bag's gradient goes to the row that won column d in forward; every
            # id present is a touched row.
            if winners is None:
                winners = _max_bags(weights, lin, off)[1]
            elif tuple(winners.shape) != (T * B, D):
                raise ValueError(f"winners has shape {tuple(winners.shape)}, expected (T*B, D) = ({T * B}, {D})")
            won = winners >= 0
            cols = torch.arange(D, device=dev).expand(T * B, D)[won]
            flat = torch.searchsorted(rows, winners[won]) * D + cols
            g = torch.zeros(rows.numel() * D, dtype=torch.float32, device=dev) \
                .index_add_(0, flat, grad_bags[won]).view(-1, D)
        else:
            lengths = off[1:] - off[:-1]
            bag_of = torch.repeat_interleave(torch.arange(T * B, device=dev), lengths, output_size=N)
            grad_ids = grad_bags[bag_of]
            if per_sample_weights is not None:
                grad_ids = grad_ids * per_sample_weights.detach().to(torch.float32)[:, None]
            if pooling == "mean":
                grad_ids = grad_ids / lengths[bag_of].to(torch.float32)[:, None]
            g = torch.zeros(rows.numel(), D, dtype=torch.float32, device=dev).index_add_(0, slot, grad_ids)
        w = weights[rows].float()
        if weight_decay and weight_decay_mode == "l2":
            g += weight_decay * w
        elif weight_decay:
            w *= 1 - lr * weight_decay   # decoupled: the row shrinks apart from g and the state

        if optimizer == "sgd":
            w -= lr * g
        elif optimizer == "rowwise_adagrad":
            m1 = state["momentum1"].view(R)
            m = m1[rows] + (g * g).mean(dim=1)
            m1.index_copy_(0, rows, m)
            w -= (lr / (m.sqrt() + eps))[:, None] * g
        elif optimizer == "adagrad":
            m1 = state["momentum1"].view(R, D)
            s = m1[rows] + g * g
            m1.index_copy_(0, rows, s)
            w -= lr * g / (s.sqrt() + eps)
        elif optimizer == "adam":
            m1 = state["momentum1"].view(R, D)
            m2 = state["momentum2"].view(R, D)
            # 1 - beta in fp32 arithmetic, as the C and CUDA kernels compute it
            c1 = float(torch.tensor(1.0) - torch.tensor(beta1))
            c2 = float(torch.tensor(1.0) - torch.tensor(beta2))
            m = beta1 * m1[rows] + c1 * g
            v = beta2 * m2[rows] + c2 * g * g
            m1.index_copy_(0, rows, m)
            m2.index_copy_(0, rows, v)
            bc1 = 1 - beta1 ** step
            bc2 = 1 - beta2 ** step
            w -= lr * (m / bc1) / ((v / bc2).sqrt() + eps)
        if weights.dtype != torch.float32:
            keys = rows if key_rows is None else key_rows[rows]
            w = round_stochastically(w, weights.dtype, step if seed is None else seed, keys)
        weights.index_copy_(0, rows, w)


_M64 = (1 << 64) - 1


def _seed64(seed: int) -> int:
    return int(seed) & _M64


def _as_i64(v: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch's int64 multiply wraps like uint64)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def sr_row_key(seed: int, rows: torch.Tensor) -> torch.Tensor:
    """half.h's ``sr_row_key``: a 32-bit key (int64 in [0, 2^32)) per (seed, row)."""
    z = (rows.to(torch.int64) + 1) * _as_i64(0x9E3779B97F4A7C15) + _as_i64(_seed64(seed))
    z = (z ^ _srl(z, 30)) * _as_i64(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _as_i64(0x94D049BB133111EB)
    return _srl(z ^ _srl(z, 31), 32)


def sr_bits(key: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """half.h's ``sr_bits``: xorshift-multiply-xorshift of key + col * 0x9E3779B9 (32-bit wrap)."""
    m = 0xFFFFFFFF
    h = (key + cols * 0x9E3779B9) & m
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    return h ^ (h >> 13)


def _as_dtype(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 holding 16-bit patterns -> a float16/bfloat16 tensor with those bits."""
    return (bits - ((bits >= 0x8000).to(torch.int64) << 16)).to(torch.int16).view(dtype)


def _f16_sr_normal(u: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns ``u`` in fp16's normal range to fp16 bits: 13 random bits of ``r`` added
    below fp16's mantissa, then truncation (half.h's ``f32_to_f16_sr_normal``)."""
    v = u + (r & 0x1FFF)
    e = ((v >> 23) & 0xFF) - 112
    return ((v >> 16) & 0x8000) | ((e & 0x1F) << 10) | ((v >> 13) & 0x3FF)


def round_stochastically(w: torch.Tensor, dtype: torch.dtype, seed: int, rows: torch.Tensor) -> torch.Tensor:
    """fp32 rows ``w`` ([U, D], of weight rows ``rows``) rounded to ``dtype`` (fp16/bf16) the way
    the C kernels round them, bit for bit: random bits below the kept mantissa added, then
    truncation (fp16's normal range and bf16) — the upper neighbour with probability equal to the
    distance from the lower over the spacing, so the rounding is unbiased; below fp16's normal
    range the same, moved by 2^-14 into the first normal binade (its spacing is the subnormals')
    and back. Random bits:
    ``sr_bits(sr_row_key(seed, row), col)``. Infinities and NaN stay; bf16 never rounds a finite
    value to infinity; fp16 values past 65504 convert as a plain conversion does."""
    D = w.shape[1]
    r = sr_bits(sr_row_key(seed, rows)[:, None], torch.arange(D, device=w.device))
    w = w.contiguous()
    u = w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if dtype == torch.bfloat16:
        special = (u & 0x7F800000) == 0x7F800000
        v = u + (r & 0xFFFF)
        over = (v & 0x7F800000) == 0x7F800000
        keep = (u >> 16) | torch.where(special & ((u & 0xFFFF) != 0), 0x40, 0)
        return _as_dtype(torch.where(special | over, keep, v >> 16), dtype)
    if dtype != torch.float16:
        raise ValueError(f"stochastic rounding is to float16 or bfloat16, not {dtype}")
    a = u & 0x7FFFFFFF
    normal = _f16_sr_normal(u, r)
    # below the normal range: w + copysign(2^-14, w) (an fp32 add, as the C code) is in the first
    # normal binade, spaced 2^-24 like the subnormals; rounded there, 2^-14 (0x0400) taken off
    shifted = w + torch.copysign(torch.tensor(2.0 ** -14), w)
    tiny = _f16_sr_normal(shifted.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, r) - 0x0400
    bits = torch.where(a < 0x38800000, tiny, normal)
    # past 65504, inf, NaN: the plain conversion
    plain = w.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    return _as_dtype(torch.where(a > 0x477FE000, plain, bits), dtype)


class _SlotMap(threading.local):
    """Per-caller-thread row -> slot map for the fused backward: all -1 between calls (the C
    kernel resets exactly the entries it touched), so one map serves every weight of size <= its
    length, and concurrent callers in different threads never share one.

    It costs 4 bytes per weight row, and is used only while that fits in a quarter of the
    last-level cache (``direct_map_rows``; the rest holds the hot rows and the step's buffers):
    there a lookup is a cache hit, faster than hashing (measured 5-15% on the backward of
    0.8M-1M-row groups). Past it its accesses miss the cache, and the kernel's per-unit hash map
    (sized by the step's ids, not the tables' rows) is as fast or faster (equal at 8M rows, 0.65x
    at 2.8M) and holds no memory per row: 4 x 2M x 16 tables would otherwise carry 32 MiB beside
    their 488 (6.25%)."""

    def __init__(self):
        self.map = torch.empty(0, dtype=torch.int32)

    def get(self, rows: int):
        if rows > direct_map_rows():
            return None
        if self.map.numel() < rows:
            self.map = torch.full((rows,), -1, dtype=torch.int32)
        return self.map


_slot_maps = _SlotMap()
_DEFAULT_LLC_BYTES = 32 << 20


@functools.lru_cache(maxsize=None)
def direct_map_rows() -> int:
    """The most weight rows the direct row -> slot map serves: a quarter of this CPU's last-level
    cache (sysfs; 32 MiB when it cannot be read) over 4 bytes a row."""
    return last_level_cache_bytes() // 4 // 4


def last_level_cache_bytes() -> int:
    """This CPU's largest cache level's size in bytes (sysfs; 32 MiB when it cannot be read)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best = (0, _DEFAULT_LLC_BYTES)
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            level = int(Path(d, "level").read_text())
            text = Path(d, "size").read_text().strip()   # e.g. "32768K"
            size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except (OSError, ValueError):
            continue
        best = max(best, (level, size))
    return best[1]


def _bump_version(t: torch.Tensor) -> None:
    # Raw writes through data_ptr bypass autograd's version counter; a zero-size in-place op
    # bumps it so stale saved tensors are detected as they would be after index_copy_.
    with torch.no_grad():
        t.narrow(0, 0, 0).zero_()


_INT32_MAX = 2**31 - 1
_ID_DTYPES = (torch.int64, torch.int32)


def _native_sizes_ok(lin_indices, T, B) -> bool:
    # The C kernels index ids and bags with int32.
    return lin_indices.numel() <= _INT32_MAX and T * B <= _INT32_MAX


def _native_update_ok(weights, state, optimizer) -> bool:
    return weights.is_contiguous() and all(
        state.get(name) is None or state[name].is_contiguous()
        for name in optimizer_state_shapes(optimizer, 0, 0))


def tbe_backward_update_native(weights: torch.Tensor, state: dict[str, torch.Tensor],
                               lin_indices: torch.Tensor, offsets: torch.Tensor,
                               grad_output: torch.Tensor, *, T: int, B: int,
                               pooling: str = "sum",
                               per_sample_weights: torch.Tensor | None = None,
                               optimizer: str = "sgd", lr: float, eps: float = 1e-8,
                               beta1: float = 0.9, beta2: float = 0.999,
                               weight_decay: float = 0.0, step: int = 1,
                               grad_scale: float = 1.0, weight_decay_mode: str = "l2",
                               seed: int | None = None, segments: Sequence[int] | None = None,
                               key_rows: torch.Tensor | None = None) -> None:
    """The C fast path (same semantics as the reference); raises if it is unavailable.
    ``segments``, ``key_rows``: see ``tbe_backward_update``."""
    lib = native.library()
    if lib is None:
        raise RuntimeError("the C TBE kernels are unavailable (see recc.kernels.cpu.native)")
    if pooling == "max":
        raise ValueError("the C TBE kernels pool with sum or mean; max runs the reference")
    _check_call(weights, lin_indices, offsets, T, B, pooling, per_sample_weights, lib)
    check_update(weights, state, optimizer, grad_output, T, B, weight_decay_mode, key_rows)
    if key_rows is not None:
        key_rows = key_rows.contiguous()
    if not _native_update_ok(weights, state, optimizer):
        raise ValueError("the C kernels update weights and state in place: they must be "
                         "contiguous")
    R, D = weights.shape
    lin = lin_indices.to(torch.int64).contiguous()
    off = offsets.to(torch.int64).contiguous()
    # A bf16 gradient (a bf16 consumer's, ``cast_embeddings``) is read as it is and widened
    # row by row in the kernel; any other dtype is converted to fp32 first.
    go = grad_output.detach()
    go = (go if go.dtype == torch.bfloat16 else go.to(torch.float32)).contiguous()
    psw = None if per_sample_weights is None else \
        per_sample_weights.detach().to(torch.float32).contiguous()
    m1 = state.get("momentum1") if optimizer != "sgd" else None
    m2 = state.get("momentum2") if optimizer == "adam" else None
    slot_map = _slot_maps.get(R)
    segs = None if segments is None else (ctypes.c_int64 * len(segments))(*[int(v) for v in segments])
    if segs is not None and (len(segments) < 1 or segments[0] != 0 or segments[-1] != T * B):
        raise ValueError(f"segments must run from 0 to T*B = {T * B}, got {list(segments)}")
    rc = lib.recc_tbe_backward_update(
        weights.data_ptr(), WEIGHT_DTYPES[weights.dtype], _seed64(step if seed is None else seed), R, D,
        None if m1 is None else m1.data_ptr(), None if m2 is None else m2.data_ptr(),
        lin.data_ptr(), off.data_ptr(), T, B, go.data_ptr(), int(go.dtype == torch.bfloat16),
        None if psw is None else psw.data_ptr(), int(pooling == "mean"), grad_scale,
        _OPTIMIZER_CODE[optimizer], lr, eps, beta1, beta2, weight_decay, int(weight_decay_mode == "decoupled"),
        1.0 - beta1 ** step, 1.0 - beta2 ** step, None if slot_map is None else slot_map.data_ptr(), segs,
        0 if segments is None else len(segments) - 1, _num_threads(),
        None if key_rows is None or weights.dtype == torch.float32 else key_rows.data_ptr())
    if rc == 1:
        raise IndexError(f"lin_indices has a row outside [0, {R}); nothing was updated; run "
                         f"validate_inputs on the local ids to find the table and bag")
    if rc != 0:
        raise RuntimeError(f"recc_tbe_backward_update failed with code {rc}; nothing was "
                           f"updated")
    _bump_version(weights)
    for s in (m1, m2):
        if s is not None:
            _bump_version(s)


def tbe_backward_update(weights: torch.Tensor, state: dict[str, torch.Tensor],
                        lin_indices: torch.Tensor, offsets: torch.Tensor,
                        grad_output: torch.Tensor, *, T: int, B: int, pooling: str = "sum",
                        per_sample_weights: torch.Tensor | None = None,
                        optimizer: str = "sgd", lr: float, eps: float = 1e-8,
                        beta1: float = 0.9, beta2: float = 0.999, weight_decay: float = 0.0,
                        step: int = 1, grad_scale: float = 1.0, weight_decay_mode: str = "l2",
                        seed: int | None = None, winners: torch.Tensor | None = None,
                        segments: Sequence[int] | None = None, key_rows: torch.Tensor | None = None) -> None:
    """Backward of ``tbe_forward`` fused with the sparse optimizer, in place.

    ``grad_scale`` multiplies every id's gradient (a rank's 1/world share of the global-mean
    loss) inside the kernel, instead of a pass over ``grad_output``.

    ``grad_output`` is dLoss/d(tbe_forward output), ``[B, T*D]``.  Each id's gradient is its
    bag's gradient (times its per-sample weight; divided by the bag length for mean; for max,
    column d of it goes only to the id that won column d, every id of the bag is touched); the
    gradients of duplicate ids are summed, and each touched row of ``weights`` and ``state``
    (shapes: ``optimizer_state_shapes``) is updated once. Weight decay: ``weight_decay_mode="l2"``
    adds ``weight_decay * w`` to g (into the state too); ``"decoupled"`` (FBGEMM's DECOUPLE,
    torch's AdamW) first shrinks the row, ``w *= 1 - lr * weight_decay``, and leaves g alone. Then:

    - sgd: ``w -= lr * g``
    - rowwise_adagrad (FBGEMM): ``m[row] += mean(g*g)``; ``w -= lr * g / (sqrt(m[row]) + eps)``
    - adagrad: ``s += g*g``; ``w -= lr * g / (sqrt(s) + eps)``
    - adam (lazy, rows present only): ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``;
      ``w -= lr * (m/(1-b1^step)) / (sqrt(v/(1-b2^step)) + eps)``, ``step`` 1-based and global:
      eps after the bias correction, as torch.optim.Adam/AdamW and FBGEMM. torch.optim.SparseAdam
      adds eps to sqrt(v) before it — this formula with eps / sqrt(1-b2^step); the backends pass
      that for ``OptimizerSpec.adam_eps="before_bias_correction"``.

    fp16/bf16 ``weights`` are read into fp32, updated in fp32 (``state`` is fp32) and written back
    with stochastic rounding (``round_stochastically``, keyed by ``seed``, default ``step``, and
    the row: row ``r``'s random bits are those of row ``key_rows[r]`` when ``key_rows`` (int64,
    one entry per weight row) is given — a cached group's weights hold cache slots, and its
    slot -> group row map makes each slot round as the group row it holds does when resident,
    so cached and all-resident training agree bit for bit. Only touched rows' entries are read;
    fp32 weights ignore it).

    Ids must be valid rows (``validate_inputs`` on the local ids, then ``linearize_indices``);
    a row outside ``[0, R)`` raises IndexError before anything is written.  No gradient flows
    to ``per_sample_weights``.

    ``segments`` (bag boundaries ``[0, ..., T*B]``) tells the C kernel which bag ranges hold
    rows apart from one another (a gather group's tables, called with ``T=1``): it splits its
    work along them instead of hashing every row of the batch. It changes no result.
    """
    if pooling != "max" and native.library() is not None and _native_update_ok(weights, state, optimizer) \
            and weights.device.type == "cpu" and _native_sizes_ok(lin_indices, T, B):
        fn = functools.partial(tbe_backward_update_native, segments=segments)
    else:
        fn = functools.partial(tbe_backward_update_reference, winners=winners)
    fn(weights, state, lin_indices, offsets, grad_output, T=T, B=B, pooling=pooling,
       per_sample_weights=per_sample_weights, optimizer=optimizer, lr=lr, eps=eps, beta1=beta1,
       beta2=beta2, weight_decay=weight_decay, step=step, grad_scale=grad_scale,
       weight_decay_mode=weight_decay_mode, seed=seed, key_rows=key_rows)
