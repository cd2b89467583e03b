"""Wire codecs on CUDA: ``codecs.cu`` behind the API of ``recc.kernels.codecs``.

``encode(x, precision)`` / ``decode(wire, n, precision)`` take and return CUDA tensors and
produce the same bytes as the CPU reference (see ``codecs.cu`` for how rounding is kept
identical); ``fp32`` is a byte view, no kernel.  ``wire_nbytes`` and ``check_precision`` are
the reference's own.
"""
from __future__ import annotations

import torch

from recc.kernels.codecs import BLOCK, check_precision, check_wire, wire_nbytes

from . import loader

SOURCE = "codecs.cu"
THREADS = 256


def encode(x: torch.Tensor, precision: str) -> torch.Tensor:
    """Flat fp32 CUDA payload -> flat uint8 wire bytes (the layout of recc.kernels.codecs)."""
    import numpy as np
    check_precision(precision)
    if not loader.kernel_device(x.device):
        raise ValueError(f"recc.kernels.cuda.codecs.encode needs a CUDA tensor, got {x.device}")
    x = x.detach().reshape(-1).to(torch.float32).contiguous()
    n = x.numel()
    if precision == "fp32":
        return x.view(torch.uint8)
    out = torch.empty(wire_nbytes(n, precision), dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    if precision in ("fp16", "bf16"):
        loader.launch(SOURCE, f"encode_{precision}", x.device, -(-n // THREADS), THREADS,
                      (x, np.int64(n), out))
        return out
    nb = -(-n // BLOCK)
    # One warp per block of 64 values.
    loader.launch(SOURCE, f"encode_{precision}", x.device, -(-nb * 32 // THREADS), THREADS,
                  (x, np.int64(n), np.int64(nb), out))
    return out


def decode(wire: torch.Tensor, n: int, precision: str) -> torch.Tensor:
    """Flat uint8 wire bytes of an ``n``-element payload -> flat fp32 values, on the GPU."""
    import numpy as np
    check_wire(wire, n, precision)
    if not loader.kernel_device(wire.device):
        raise ValueError(f"recc.kernels.cuda.codecs.decode needs a CUDA tensor, got {wire.device}")
    wire = wire.contiguous()
    if wire.data_ptr() % 4:
        # A slice of a larger byte buffer may start anywhere; the kernels read fp16/bf16 codes
        # as 2-byte words and the block scales as fp32 in place (a misaligned load is a
        # sticky CUDA error), so such a view is copied to a fresh, aligned buffer first.
        wire = wire.clone()
    if precision == "fp32":
        return wire.view(torch.float32)
    out = torch.empty(n, dtype=torch.float32, device=wire.device)
    if n == 0:
        return out
    grid = -(-n // THREADS)
    if precision in ("fp16", "bf16"):
        loader.launch(SOURCE, f"decode_{precision}", wire.device, grid, THREADS, (wire, np.int64(n), out))
    else:
        loader.launch(SOURCE, f"decode_{precision}", wire.device, grid, THREADS,
                      (wire, np.int64(n), np.int64(-(-n // BLOCK)), out))
    return out
