"""The DLRM dot interaction on CPU: the C kernel.

``pairwise_dot_forward(x, li, lj)`` returns ``out[b, p] = <x[b, li[p]], x[b, lj[p]]>`` and
``pairwise_dot_backward(x, li, lj, grad)`` the gradient for ``x`` (``recc.pairwise_dot``).
``dot_interaction_forward(dense, blocks, features, li, lj, pad)`` computes
``recc.dot_interaction``: the vectors are ``dense`` and D-column slices of ``blocks``, read in
place, and the output row is ``[dense | pairs | pad zeros]``; ``dot_interaction_backward``
returns the gradients of ``dense`` and of every block. ``dense`` and each block may be fp32 or
bf16 (each gradient comes back in its tensor's dtype); the products and sums are fp32 and the
output has ``dense``'s dtype, so a bf16 bottom MLP, fp32 pooled embeddings and a bf16 top MLP
meet with no cast. The C kernel (``interaction.c``) is built and cached like the TBE kernels
(see ``native.py``) and honours ``RECC_CPU_KERNELS``. It runs only what
``pairwise_dot_kernel_runs``/``dot_interaction_kernel_runs`` accept; everything else
(``RECC_CPU_KERNELS=reference``, no compiler, fp64, more vectors or pairs than it indexes) is
the op's torch reference's (``recc.ops``), which ``recc.runtime.cpu_backend`` runs instead.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from recc.kernels.interaction_inputs import check_interaction_shapes, check_pair_shapes

from . import native


def _declare(lib) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.recc_interaction_forward.restype = i32
    lib.recc_interaction_forward.argtypes = [p, p, p, i64, i64, i64, p, p, p, p, i64, i64, p, i32, i64, i64, i32]
    lib.recc_interaction_backward.restype = i32
    lib.recc_interaction_backward.argtypes = [p, p, p, i64, i64, i64, i64, p, p, p, p, i64, i64, p, i32, i64, p, p,
                                              p, i32]


_KERNELS = native.KernelLibrary(Path(__file__).with_name("interaction.c"), _declare, "interaction")
_library = _KERNELS.get


def _check_pairs(f: int, li: torch.Tensor, lj: torch.Tensor, what: str) -> None:
    check_pair_shapes(li, lj, what)
    for name, idx in (("li", li), ("lj", lj)):
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= f):
            raise IndexError(f"{what}: {name} holds an index outside the {f} interacting vectors")


def _check(x: torch.Tensor, li: torch.Tensor, lj: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"pairwise_dot: x must be [B, F, D], got shape {tuple(x.shape)}")
    _check_pairs(x.shape[1], li, lj, "pairwise_dot")


def _check_interaction(dense, blocks, features, li, lj, pad) -> None:
    check_interaction_shapes(dense, blocks, features, li, lj, pad)
    _check_pairs(len(features) + 1, li, lj, "dot_interaction")


# The C kernel indexes its F x F tables and the pairs with int32.
_MAX_VECTORS, _MAX_PAIRS = 1 << 15, (1 << 31) - 2


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _native_ok(tensors, li, lj, f: int, dtypes) -> bool:
    return (all(t.device.type == "cpu" and t.dtype in dtypes for t in tensors)
            and li.dtype == torch.int64 and lj.dtype == torch.int64 and f <= _MAX_VECTORS
            and li.numel() <= _MAX_PAIRS and _library() is not None)


def pairwise_dot_kernel_runs(x: torch.Tensor, li: torch.Tensor, lj: torch.Tensor) -> bool:
    """Whether the C kernel runs ``recc.pairwise_dot`` on these inputs (fp32, int64 pairs, at most
    2**15 vectors, the kernel built and not ``RECC_CPU_KERNELS=reference``)."""
    return _native_ok([x], li, lj, x.shape[1] if x.dim() == 3 else 0, (torch.float32,))


def dot_interaction_kernel_runs(dense: torch.Tensor, blocks, features, li: torch.Tensor, lj: torch.Tensor) -> bool:
    """Whether the C kernel runs ``recc.dot_interaction`` on these inputs (fp32/bf16 tensors,
    int64 pairs, at most 2**15 vectors, the kernel built and not ``RECC_CPU_KERNELS=reference``)."""
    return _native_ok([dense, *blocks], li, lj, len(features) + 1, _KERNEL_DTYPES)


def _require_kernel(runs: bool, what: str) -> None:
    if not runs:
        raise RuntimeError(f"{what}: the C kernel cannot run these inputs (see {what}_kernel_runs); the op's "
                           f"torch reference (recc.ops) computes them")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit column stride (the kernel reads rows at any row stride)."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def _i64(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _ptrs(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def _bf16_flags(tensors) -> torch.Tensor:
    return torch.tensor([t.dtype == torch.bfloat16 for t in tensors], dtype=torch.int32)


def _forward(blocks, fblk, fcol, d, li, lj, head, pad, dtype=torch.float32) -> torch.Tensor:
    """Run the C forward over vectors (blocks[fblk[f]], column fcol[f]); [B, hd + P + pad] in ``dtype``."""
    blocks = [_rows(t) for t in blocks]
    li, lj = li.contiguous(), lj.contiguous()
    b, p = blocks[0].shape[0], li.numel()
    width = (d if head >= 0 else 0) + p + pad
    out = torch.empty(b, width, dtype=dtype)
    bld, fb, fc, bdt = _i64(t.stride(0) for t in blocks), _i64(fblk), _i64(fcol), _bf16_flags(blocks)
    rc = _library().recc_interaction_forward(_ptrs(blocks), bdt.data_ptr(), bld.data_ptr(), b, len(fblk), d,
                                             fb.data_ptr(), fc.data_ptr(), li.data_ptr(), lj.data_ptr(), p, head,
                                             out.data_ptr(), int(dtype == torch.bfloat16), width, pad,
                                             torch.get_num_threads())
    if rc != 0:
        raise MemoryError("interaction: the C kernel could not allocate its per-thread buffers")
    return out


def _backward(blocks, fblk, fcol, d, li, lj, head, grad) -> list[torch.Tensor]:
    """The C backward: the gradient of every block (full shape, zero where no vector was read, in
    the block's dtype)."""
    blocks = [_rows(t) for t in blocks]
    if grad.dtype not in _KERNEL_DTYPES:
        grad = grad.to(torch.float32)
    li, lj, grad = li.contiguous(), lj.contiguous(), _rows(grad)
    b = blocks[0].shape[0]
    grads = [torch.empty(t.shape, dtype=t.dtype) for t in blocks]
    bld, fb, fc, bdt = _i64(t.stride(0) for t in blocks), _i64(fblk), _i64(fcol), _bf16_flags(blocks)
    dld, dw = _i64(g.stride(0) for g in grads), _i64(g.shape[1] for g in grads)
    rc = _library().recc_interaction_backward(_ptrs(blocks), bdt.data_ptr(), bld.data_ptr(), len(blocks), b,
                                              len(fblk), d, fb.data_ptr(), fc.data_ptr(), li.data_ptr(),
                                              lj.data_ptr(), li.numel(), head, grad.data_ptr(),
                                              int(grad.dtype == torch.bfloat16), grad.stride(0), _ptrs(grads),
                                              dld.data_ptr(), dw.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("interaction: the C kernel could not allocate its per-thread buffers")
    return grads


def pairwise_dot_forward(x: torch.Tensor, li: torch.Tensor, lj: torch.Tensor) -> torch.Tensor:
    _check(x, li, lj)
    _require_kernel(pairwise_dot_kernel_runs(x, li, lj), "pairwise_dot")
    b, f, d = x.shape
    return _forward([x.contiguous().view(b, f * d)], [0] * f, range(0, f * d, d), d, li, lj, -1, 0)


def pairwise_dot_backward(x: torch.Tensor, li: torch.Tensor, lj: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    # The C kernel scatters grad into an F x F buffer at li/lj and reads B*P floats of grad:
    # check both as the forward does (a bad index would write past the kernel's buffer).
    _check(x, li, lj)
    if tuple(grad.shape) != (x.shape[0], li.numel()):
        raise ValueError(f"pairwise_dot: grad must be [B, P] = {(x.shape[0], li.numel())}, got {tuple(grad.shape)}")
    _require_kernel(pairwise_dot_kernel_runs(x, li, lj), "pairwise_dot")
    b, f, d = x.shape
    (gx,) = _backward([x.contiguous().view(b, f * d)], [0] * f, range(0, f * d, d), d, li, lj, -1, grad)
    return gx.view(b, f, d)


def _vectors(features):
    """(block, column) of every vector for the C kernel, whose block 0 is ``dense`` (vector 0)."""
    return [0] + [k + 1 for k, _ in features], [0] + [c for _, c in features]


def dot_interaction_forward(dense, blocks, features, li, lj, pad: int = 0) -> torch.Tensor:
    _check_interaction(dense, blocks, features, li, lj, pad)
    _require_kernel(dot_interaction_kernel_runs(dense, blocks, features, li, lj), "dot_interaction")
    return _forward([dense, *blocks], *_vectors(features), dense.shape[1], li, lj, 0, pad, dense.dtype)


def dot_interaction_backward(dense, blocks, features, li, lj, pad, grad):
    """(gradient of dense, [gradient of each block]) for the output gradient ``grad``."""
    _check_interaction(dense, blocks, features, li, lj, pad)
    want = (dense.shape[0], dense.shape[1] + li.numel() + pad)
    if tuple(grad.shape) != want:
        raise ValueError(f"dot_interaction: grad must be [B, D + P + pad] = {want}, got {tuple(grad.shape)}")
    _require_kernel(dot_interaction_kernel_runs(dense, blocks, features, li, lj), "dot_interaction")
    grads = _backward([dense, *blocks], *_vectors(features), dense.shape[1], li, lj, 0, grad)
    return grads[0], grads[1:]
