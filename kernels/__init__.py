"""Kernels: the math of recc's ops, with the same semantics on every device.

Names follow FBGEMM's metadata (``hash_size_cumsum``, ``D_offsets``, feature-major ``offsets``
of length T*B+1) so its documentation can be read against ours.
"""

from .cpu import (
    OPTIMIZERS,
    POOLINGS,
    cpu_backend,
    linearize_indices,
    optimizer_state_shapes,
    pairwise_dot_backward,
    pairwise_dot_forward,
    pairwise_dot_reference,
    tbe_backward_update,
    tbe_backward_update_native,
    tbe_backward_update_reference,
    tbe_forward,
    tbe_forward_native,
    tbe_forward_reference,
    validate_inputs,
)

__all__ = [
    "pairwise_dot_backward",
    "pairwise_dot_forward",
    "pairwise_dot_reference",
    "OPTIMIZERS",
    "POOLINGS",
    "cpu_backend",
    "linearize_indices",
    "optimizer_state_shapes",
    "tbe_backward_update",
    "tbe_backward_update_native",
    "tbe_backward_update_reference",
    "tbe_forward",
    "tbe_forward_native",
    "tbe_forward_reference",
    "validate_inputs",
]
