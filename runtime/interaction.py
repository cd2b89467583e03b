"""``recc.dot_interaction``'s autograd Function, written once for the backends with kernels (CPU:
``cpu_backend``, CUDA: ``cuda_dense``): each supplies its forward and backward kernels.

Forward saves its inputs (no stacked copy of the vectors); backward writes ``dense``'s gradient
and each block's whole, so a lookup's backward takes its block's gradient without a copy."""
from __future__ import annotations

from typing import Callable

import torch


def interaction_function(forward: Callable, backward: Callable) -> type:
    """The autograd Function over ``forward(dense, blocks, features, li, lj, pad) -> out`` and
    ``backward(dense, blocks, features, li, lj, pad, grad) -> (d dense, [d block])``; applied as
    ``Fn.apply(dense, li, lj, features, pad, *blocks)``."""

    class DotInteraction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, dense, li, lj, features, pad, *blocks):
            ctx.features, ctx.pad = features, pad
            ctx.save_for_backward(dense, li, lj, *blocks)
            return forward(dense, list(blocks), features, li, lj, pad)

        @staticmethod
        def backward(ctx, grad):
            dense, li, lj, *blocks = ctx.saved_tensors
            gd, gb = backward(dense, blocks, ctx.features, li, lj, ctx.pad, grad)
            return (gd, None, None, None, None, *gb)

    return DotInteraction
