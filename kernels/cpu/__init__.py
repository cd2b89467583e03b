"""CPU kernels: table-batched embedding forward and fused backward + sparse optimizer."""

from ..tbe_inputs import OPTIMIZERS, optimizer_state_shapes
from .tbe import (
    POOLINGS,
    gather_rows,
    linearize_indices,
    max_pool,
    tbe_backward_update,
    tbe_backward_update_native,
    tbe_backward_update_reference,
    tbe_forward,
    tbe_forward_native,
    tbe_forward_reference,
    validate_inputs,
)
from .native import backend as cpu_backend
from .interaction import (dot_interaction_backward, dot_interaction_forward, dot_interaction_kernel_runs,
                          pairwise_dot_backward, pairwise_dot_forward, pairwise_dot_kernel_runs)
from .linear import linear_backward, linear_forward
from .memory import huge_page_empty, release_memory
from .sparse import pack_bags

__all__ = [
    "dot_interaction_backward",
    "dot_interaction_forward",
    "dot_interaction_kernel_runs",
    "gather_rows",
    "huge_page_empty",
    "release_memory",
    "pack_bags",
    "linear_backward",
    "linear_forward",
    "pairwise_dot_backward",
    "pairwise_dot_forward",
    "pairwise_dot_kernel_runs",
    "OPTIMIZERS",
    "POOLINGS",
    "cpu_backend",
    "linearize_indices",
    "max_pool",
    "optimizer_state_shapes",
    "tbe_backward_update",
    "tbe_backward_update_native",
    "tbe_backward_update_reference",
    "tbe_forward",
    "tbe_forward_native",
    "tbe_forward_reference",
    "validate_inputs",
]
