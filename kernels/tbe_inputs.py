"""What every TBE kernel wrapper accepts (CPU: ``cpu/tbe.py``, CUDA: ``cuda/tbe.py``): the fused
optimizers and their state, and the input checks both wrappers run before a kernel touches a
row, so the two devices refuse the same calls with the same words.

Device-specific limits (the CUDA kernels' int32 indexing and alignment, the CPU kernels'
fallback to the reference for non-contiguous tensors) stay in the wrappers.
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
WEIGHT_DECAY_MODES = ("l2", "decoupled")
WEIGHT_TYPES = (torch.float32, torch.float16, torch.bfloat16)  # what a table's weights may be stored in


def optimizer_state_shapes(optimizer: str, rows: int, dim: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the state tensors ``tbe_backward_update`` expects (all fp32, zero-initialised)."""
    if optimizer == "sgd":
        return {}
    if optimizer == "rowwise_adagrad":
        return {"momentum1": (rows,)}
    if optimizer == "adagrad":
        return {"momentum1": (rows, dim)}
    if optimizer == "adam":
        return {"momentum1": (rows, dim), "momentum2": (rows, dim)}
    raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")


def check_lookup(weights: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, T: int, B: int,
                 pooling: str, per_sample_weights: torch.Tensor | None) -> None:
    """The weights' shape and type, T*B bags of 1-D ``indices``, and per-sample weights (one per
    id, sum pooling only, like nn.EmbeddingBag)."""
    if weights.dim() != 2 or weights.dtype not in WEIGHT_TYPES:
        raise ValueError(f"weights must be a 2-D float32, float16 or bfloat16 tensor, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if indices.dim() != 1 or offsets.dim() != 1:
        raise ValueError(f"indices and offsets must be 1-D, got shapes {tuple(indices.shape)} and "
                         f"{tuple(offsets.shape)}")
    if offsets.numel() != T * B + 1:
        raise ValueError(f"offsets has {offsets.numel()} entries, expected T*B+1 = {T * B + 1} "
                         f"(T={T} tables, B={B} bags per table)")
    if per_sample_weights is not None:
        if pooling != "sum":
            raise ValueError("per_sample_weights are only supported with pooling='sum' "
                             f"(got pooling={pooling!r}), like nn.EmbeddingBag")
        if per_sample_weights.shape != indices.shape:
            raise ValueError(f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
                             f"expected {tuple(indices.shape)} (one per index)")


def check_update(weights: torch.Tensor, state: dict[str, torch.Tensor], optimizer: str,
                 grad_output: torch.Tensor, T: int, B: int, weight_decay_mode: str,
                 key_rows: torch.Tensor | None, *, in_place: bool = False) -> None:
    """The optimizer, its state (fp32, one row or one value per weight row), the pooled
    gradient ``[B, T*D]`` and ``key_rows`` (int64, one per weight row, on the weights' device).
    ``in_place``: a kernel writes the state through its pointer, so it must also be contiguous
    and on the weights' device."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    if weight_decay_mode not in WEIGHT_DECAY_MODES:
        raise ValueError(f"unknown weight_decay_mode {weight_decay_mode!r}; expected one of {WEIGHT_DECAY_MODES}")
    R, D = weights.shape
    for name, shape in optimizer_state_shapes(optimizer, R, D).items():
        s = state.get(name)
        if s is None or s.dtype != torch.float32 or s.numel() != R * (D if len(shape) == 2 else 1) or \
                (in_place and (not s.is_contiguous() or s.device != weights.device)):
            got = "nothing" if s is None else f"{s.dtype} {tuple(s.shape)} on {s.device}"
            where = f"contiguous float32 state[{name!r}] of shape {shape} on {weights.device}" if in_place else \
                f"float32 state[{name!r}] of shape {shape}"
            raise ValueError(f"optimizer {optimizer!r} needs {where}, got {got}")
    if tuple(grad_output.shape) != (B, T * D):
        raise ValueError(f"grad_output has shape {tuple(grad_output.shape)}, expected "
                         f"(B, T*D) = ({B}, {T * D})")
    if key_rows is not None:
        if key_rows.dtype != torch.int64 or key_rows.dim() != 1 or key_rows.numel() != R:
            raise ValueError(f"key_rows must be a 1-D int64 tensor of one entry per weight row ({R}), got "
                             f"{key_rows.dtype} {tuple(key_rows.shape)}")
        if key_rows.device != weights.device:
            raise ValueError(f"key_rows is on {key_rows.device}, weights on {weights.device}")
