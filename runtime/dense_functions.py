"""The autograd Functions of recc's dense ops with kernels, written once for the backends (CPU:
``cpu_backend``, CUDA: ``cuda_dense``): each supplies its forward and backward kernels.

- ``interaction_function``: ``recc.dot_interaction``. Forward saves its inputs (no stacked copy of
  the vectors); backward writes ``dense``'s gradient and each block's whole, so a lookup's
  backward takes its block's gradient without a copy.
- ``linear_function``: ``recc.linear``, a dense layer and its activation. Forward saves the
  output (not a second copy) for the ReLU mask.
"""
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


def linear_function(forward: Callable, backward: Callable) -> type:
    """The autograd Function over ``forward(x, weight, bias, activation) -> y`` and
    ``backward(grad, x, weight, y, activation, needs) -> (dx, dw, db)`` (``needs``: which of them
    are wanted; ``y`` is None without an activation); applied as ``Fn.apply(x, weight, bias,
    activation)``."""

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, activation):
            y = forward(x, weight, bias, activation)
            ctx.activation, ctx.has_bias = activation, bias is not None
            ctx.save_for_backward(x, weight, y if activation == "relu" else None)
            return y

        @staticmethod
        def backward(ctx, grad):
            x, weight, y = ctx.saved_tensors
            needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
            dx, dw, db = backward(grad, x, weight, y, ctx.activation, needs)
            return dx, dw, db, None

    return Linear
