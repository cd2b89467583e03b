"""CUDA implementations of recc's dense ops that fuse: ``recc.dot_interaction`` and ``recc.linear``.

``recc.dot_interaction[cuda]`` runs ``recc.kernels.cuda.interaction``: one launch forward, one
backward, which writes the gradient of ``dense`` and of each block whole (no stacked copy, no F x
F matrix, no index gather and its scatter-add, no adds of the two paths into ``dense``: the torch
reference's 4 launches forward and 6 backward). Inputs the kernels do not take
(``dot_interaction_kernel_runs``: other dtypes, more blocks than a launch holds, a sample too large
for a block's shared memory) run the op's torch reference, under autograd, as every op without a
CUDA kernel does (``recc.runtime.cuda_backend``).

``recc.linear[cuda]`` with a ReLU and a bias is one GEMM whose epilogue adds the bias and applies
the ReLU (``torch._addmm_activation``, cuBLASLt's epilogue on a GPU): one launch forward where the
reference makes two (the GEMM, then the ReLU). Its backward is the reference's, op for op (the
ReLU's mask from the saved output, the two GEMMs, the bias sum). Torch has no autograd formula for
the fused op, hence the Function.

Importing this module needs neither CuPy nor a GPU: the kernels load on their first launch.
"""
from __future__ import annotations

import torch

from recc.kernels.cuda import dot_interaction_backward, dot_interaction_forward, dot_interaction_kernel_runs
from recc.ops import get_op, register_impl
from recc.runtime.dense_functions import interaction_function, linear_function


DotInteraction = interaction_function(dot_interaction_forward, dot_interaction_backward)


@register_impl("dot_interaction", "cuda")
def dot_interaction_cuda(dense, blocks, li, lj, features, pad=0):
    """The CUDA kernels; what they cannot run runs the op's torch reference, under autograd."""
    if not dot_interaction_kernel_runs(dense, blocks, features, li, lj):
        return get_op("dot_interaction").reference(dense, blocks, li, lj, features, pad)
    return DotInteraction.apply(dense, li, lj, features, pad, *blocks)


def _linear_forward(x, weight, bias, activation):
    return torch._addmm_activation(bias, x, weight.t())


def _linear_backward(grad, x, weight, y, activation, needs):
    """What autograd runs for the reference's ``relu(addmm(bias, x, weight.t()))``, in its order."""
    g = torch.ops.aten.threshold_backward(grad, y, 0)
    dx = g.mm(weight) if needs[0] else None
    dw = g.t().mm(x) if needs[1] else None   # (autograd's product for a transposed mat2: contiguous)
    db = g.sum(0) if needs[2] else None
    return dx, dw, db


Linear = linear_function(_linear_forward, _linear_backward)


@register_impl("linear", "cuda")
def linear_cuda(x, weight, bias, activation="none"):
    """A ReLU layer with a bias, 2-D and of one dtype: the fused GEMM; anything else the op's
    torch reference (one GEMM already, when there is no activation)."""
    if activation != "relu" or bias is None or x.dim() != 2 or not (x.dtype == weight.dtype == bias.dtype):
        return get_op("linear").reference(x, weight, bias, activation)
    return Linear.apply(x, weight, bias, activation)
