"""CUDA implementations of recc's dense ops that have kernels: ``recc.dot_interaction``.

``recc.dot_interaction[cuda]`` runs ``recc.kernels.cuda.interaction``: one launch forward, one
backward, which writes the gradient of ``dense`` and of each block whole (no stacked copy, no F x
F matrix, no index gather and its scatter-add, no adds of the two paths into ``dense``: the torch
reference's 4 launches forward and 6 backward). Inputs the kernels do not take
(``dot_interaction_kernel_runs``: other dtypes, more blocks than a launch holds, a sample too large
for a block's shared memory) run the op's torch reference, under autograd, as every op without a
CUDA kernel does (``recc.runtime.cuda_backend``).

Importing this module needs neither CuPy nor a GPU: the kernels load on their first launch.
"""
from __future__ import annotations

from recc.kernels.cuda import dot_interaction_backward, dot_interaction_forward, dot_interaction_kernel_runs
from recc.ops import get_op, register_impl
from recc.runtime.interaction import interaction_function


DotInteraction = interaction_function(dot_interaction_forward, dot_interaction_backward)


@register_impl("dot_interaction", "cuda")
def dot_interaction_cuda(dense, blocks, li, lj, features, pad=0):
    """The CUDA kernels; what they cannot run runs the op's torch reference, under autograd."""
    if not dot_interaction_kernel_runs(dense, blocks, features, li, lj):
        return get_op("dot_interaction").reference(dense, blocks, li, lj, features, pad)
    return DotInteraction.apply(dense, li, lj, features, pad, *blocks)
