"""What both interaction kernel wrappers accept (CPU: ``cpu/interaction.py``, CUDA:
``cuda/interaction.py``): the shapes of ``recc.dot_interaction``'s inputs, checked before a
kernel reads them, so the two devices refuse the same calls with the same words.

The pair indices' range stays device-specific: the CPU wrapper reads them on the host, the CUDA
kernels check them on the device (a host read would be a sync every step)."""
from __future__ import annotations

import torch


def check_pair_shapes(li: torch.Tensor, lj: torch.Tensor, what: str) -> None:
    if li.shape != lj.shape or li.dim() != 1:
        raise ValueError(f"{what}: li and lj must be 1-D of one length, got {tuple(li.shape)} and {tuple(lj.shape)}")


def check_interaction_shapes(dense, blocks, features, li, lj, pad, what: str = "dot_interaction") -> None:
    """``dense`` [B, D], each block [B, W_k], each feature ``(k, col)`` D columns inside block k,
    ``pad`` >= 0, ``li``/``lj`` 1-D of one length."""
    if dense.dim() != 2:
        raise ValueError(f"{what}: dense must be [B, D], got shape {tuple(dense.shape)}")
    b, d = dense.shape
    for k, t in enumerate(blocks):
        if t.dim() != 2 or t.shape[0] != b:
            raise ValueError(f"{what}: block {k} must be [{b}, W], got shape {tuple(t.shape)}")
    for f, (k, c) in enumerate(features, start=1):
        if not 0 <= k < len(blocks):
            raise IndexError(f"{what}: vector {f} reads block {k} of {len(blocks)}")
        if c < 0 or c + d > blocks[k].shape[1]:
            raise IndexError(f"{what}: vector {f} reads columns [{c}, {c + d}) of block {k}, "
                             f"which has {blocks[k].shape[1]}")
    if pad < 0:
        raise ValueError(f"{what}: pad must be >= 0, got {pad}")
    check_pair_shapes(li, lj, what)
