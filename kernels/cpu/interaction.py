"""The DLRM dot interaction (``recc.pairwise_dot``) on CPU: a C kernel and a torch reference.

``pairwise_dot_forward(x, li, lj)`` returns ``out[b, p] = <x[b, li[p]], x[b, lj[p]]>`` and
``pairwise_dot_backward(x, li, lj, grad)`` the gradient for ``x``. The C kernel
(``interaction.c``) is built and cached like the TBE kernels (see ``native.py``) and honours
``RECC_CPU_KERNELS``; without it the reference (``bmm`` + gather, autograd for backward) runs.
"""
from __future__ import annotations

import ctypes
import threading
import warnings
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).with_name("interaction.c")
_lock = threading.Lock()
_state: dict = {"tried": False, "lib": None, "error": None}


def _library():
    if native.mode() == "reference":
        return None
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                try:
                    lib, _ = native.build_and_load(SOURCE)
                    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
                    lib.recc_pairwise_dot_forward.restype = i32
                    lib.recc_pairwise_dot_forward.argtypes = [p, i64, i64, i64, p, p, i64, p, i32]
                    lib.recc_pairwise_dot_backward.restype = i32
                    lib.recc_pairwise_dot_backward.argtypes = [p, p, i64, i64, i64, p, p, i64, p, i32]
                    _state["lib"] = lib
                except Exception as exc:
                    _state["error"] = f"{type(exc).__name__}: {exc}"
                    if native.mode() == "native":
                        raise
                    warnings.warn(f"recc: interaction C kernel unavailable, using the torch reference "
                                  f"({_state['error']})", RuntimeWarning, stacklevel=3)
                _state["tried"] = True
    return _state["lib"]


def _check(x: torch.Tensor, li: torch.Tensor, lj: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"pairwise_dot: x must be [B, F, D], got shape {tuple(x.shape)}")
    if li.shape != lj.shape or li.dim() != 1:
        raise ValueError(f"pairwise_dot: li and lj must be 1-D of one length, got {tuple(li.shape)} and {tuple(lj.shape)}")
    f = x.shape[1]
    for name, idx in (("li", li), ("lj", lj)):
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= f):
            raise IndexError(f"pairwise_dot: {name} holds an index outside the {f} interacting vectors")


def _native_ok(x, li, lj) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and li.dtype == torch.int64
            and lj.dtype == torch.int64 and _library() is not None)


def pairwise_dot_reference(x: torch.Tensor, li: torch.Tensor, lj: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x, x.transpose(1, 2))[:, li, lj]


def pairwise_dot_forward(x: torch.Tensor, li: torch.Tensor, lj: torch.Tensor) -> torch.Tensor:
    _check(x, li, lj)
    if not _native_ok(x, li, lj):
        return pairwise_dot_reference(x, li, lj)
    x, li, lj = x.contiguous(), li.contiguous(), lj.contiguous()
    b, f, d = x.shape
    out = torch.empty(b, li.numel(), dtype=x.dtype)
    rc = _library().recc_pairwise_dot_forward(x.data_ptr(), b, f, d, li.data_ptr(), lj.data_ptr(), li.numel(),
                                              out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("pairwise_dot: the C kernel could not allocate its per-thread buffers")
    return out


def pairwise_dot_backward(x: torch.Tensor, li: torch.Tensor, lj: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    # The C kernel scatters grad into an F x F buffer at li/lj and reads B*P floats of grad:
    # check both as the forward does (a bad index would write past the kernel's buffer).
    _check(x, li, lj)
    if tuple(grad.shape) != (x.shape[0], li.numel()):
        raise ValueError(f"pairwise_dot: grad must be [B, P] = {(x.shape[0], li.numel())}, got {tuple(grad.shape)}")
    if not _native_ok(x, li, lj):
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            (gx,) = torch.autograd.grad(pairwise_dot_reference(xr, li, lj), xr, grad)
        return gx
    x, li, lj, grad = x.contiguous(), li.contiguous(), lj.contiguous(), grad.to(torch.float32).contiguous()
    b, f, d = x.shape
    dx = torch.empty_like(x)
    rc = _library().recc_pairwise_dot_backward(x.data_ptr(), grad.data_ptr(), b, f, d, li.data_ptr(), lj.data_ptr(),
                                               li.numel(), dx.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("pairwise_dot: the C kernel could not allocate its per-thread buffers")
    return dx
