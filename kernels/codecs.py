"""Wire codecs for the quantized collectives: fp32 payloads <-> bytes on the wire.

A payload is a flat fp32 tensor of ``n`` elements (one destination's split of a collective);
its encoding is a flat ``uint8`` tensor of ``wire_nbytes(n, precision)`` bytes, so every
backend (gloo, NCCL) carries every codec as plain bytes and byte counts are exact.

==============  ======================================================  ====================
precision       wire layout                                             bytes for n elements
==============  ======================================================  ====================
``fp32``        the raw values                                          ``4n``
``fp16``        IEEE half, round to nearest even                        ``2n``
``bf16``        bfloat16, round to nearest even                         ``2n``
``int8``        blocks of 64 (last one zero-padded): ``nb*64`` codes,   ``72 * ceil(n/64)``
                then per block fp32 ``(scale, bias)``
``fp8_e4m3``    blocks of 64: ``nb*64`` e4m3fn codes, then per block    ``68 * ceil(n/64)``
``fp8_e5m2``    fp32 ``scale``; same layout with e5m2 codes             ``68 * ceil(n/64)``
==============  ======================================================  ====================

Block-wise (row-wise over 64-element rows of the payload) scaling: int8 is asymmetric,
``bias = min``, ``scale = (max - min) / 255``, ``code = clamp(rint((x - bias) / scale), 0, 255)``,
``x' = code * scale + bias``; fp8 is symmetric, ``scale = amax / fmax`` (448 for e4m3fn, 57344
for e5m2), ``code = fp8(clamp(x / scale, -fmax, fmax))``, ``x' = code * scale``. An all-zero block
decodes exactly (both use scale 1); so does an int8 block whose values are all equal, while an
fp8 one decodes to within an ulp (``fmax * (amax / fmax)``). Blocks are 64 elements
rather than one embedding row so the scales cost at most 8/256 of the fp32 bytes whatever the
embedding width (int8: 0.281 of fp32; fp8: 0.266).

Non-finite values: fp32/fp16/bf16 carry NaN and +-Inf as themselves (fp16 also turns finite
values beyond 65504 into +-Inf, as a cast does). int8 and fp8 have no code for them, so a block
holding any NaN or Inf is sent with a NaN scale and decodes to all-NaN: the damage stays visible
(a NaN loss, a NaN in the report) instead of being clamped into plausible numbers. The same
holds for an int8 block whose range ``max - min`` itself overflows fp32 (values of both signs
beyond ~1.7e38): its scale cannot be represented, so it is sent as NaN too.

CPU and CUDA tensors both work (plain torch ops); the CUDA kernels in ``recc.kernels.cuda``
produce the same bytes up to rounding of the scale division.
"""
from __future__ import annotations

import math

import torch

BLOCK = 64
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2")
# The plain casts, the codecs recc.specs.CAST_PRECISIONS names (kernels import nothing of recc's
# core: tests/kernels/test_codecs.py holds the two to the same names).
_CASTS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_FP8 = {"fp8_e4m3": (getattr(torch, "float8_e4m3fn", None), 448.0),
        "fp8_e5m2": (getattr(torch, "float8_e5m2", None), 57344.0)}


def check_precision(precision: str) -> None:
    """Raises ValueError for a codec this build cannot carry (never falls back silently)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown wire precision {precision!r}; expected one of {PRECISIONS}")
    if precision in _FP8 and _FP8[precision][0] is None:
        raise ValueError(f"wire precision {precision!r} needs torch.float8 dtypes, which this "
                         f"torch ({torch.__version__}) lacks")


def is_cast(precision: str) -> bool:
    """Whether ``precision`` is a plain cast (fp32/fp16/bf16): its wire is the values as that
    dtype, so strided copies can encode and decode it in place."""
    return precision in _CASTS


def cast_dtype(precision: str) -> torch.dtype:
    """The dtype a cast precision's wire holds (``is_cast`` must be true)."""
    return _CASTS[precision]


def wire_nbytes(n: int, precision: str) -> int:
    """Bytes on the wire for a payload of ``n`` fp32 elements."""
    check_precision(precision)
    if precision == "fp32":
        return 4 * n
    if precision in ("fp16", "bf16"):
        return 2 * n
    blocks = math.ceil(n / BLOCK)
    return blocks * (BLOCK + (8 if precision == "int8" else 4))


def _blocks(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    nb = math.ceil(n / BLOCK)
    if nb * BLOCK == n:
        return x.reshape(nb, BLOCK)
    padded = x.new_zeros(nb * BLOCK)
    padded[:n] = x
    return padded.view(nb, BLOCK)


def _cuda_kernels(t: torch.Tensor):
    """recc.kernels.cuda when ``t`` lives on a GPU and CuPy is there, else None (torch ops)."""
    if t.device.type != "cuda":
        return None
    from recc.kernels import cuda
    return cuda if cuda.available() else None


def encode(x: torch.Tensor, precision: str) -> torch.Tensor:
    """Flat fp32 payload -> flat uint8 wire bytes (layout in the module docstring)."""
    check_precision(precision)
    kernels = _cuda_kernels(x)
    if kernels is not None and precision != "fp32" and x.dtype == torch.float32:
        return kernels.encode(x, precision)  # one kernel instead of a dozen torch ops
    if precision in _CASTS:
        # One conversion (none when ``x`` already has the wire's dtype: a bf16 lookup's rows).
        return x.detach().reshape(-1).to(_CASTS[precision]).view(torch.uint8)
    x = x.detach().reshape(-1).to(torch.float32)
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    b = _blocks(x)
    bad = ~torch.isfinite(b).all(dim=1)
    if precision == "int8":
        lo = b.amin(dim=1)
        hi = b.amax(dim=1)
        bad = bad | ~torch.isfinite(hi - lo)
        scale = torch.where(hi > lo, (hi - lo) / 255.0, torch.ones_like(lo))
        codes = torch.clamp(torch.round((b - lo[:, None]) / scale[:, None]), 0, 255)
        codes = torch.nan_to_num(codes, nan=0.0).to(torch.uint8)
        nan = torch.full_like(lo, float("nan"))
        meta = torch.stack([torch.where(bad, nan, scale), torch.where(bad, nan, lo)], dim=1)
    else:
        dtype, fmax = _FP8[precision]
        amax = b.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        q = torch.clamp(b / scale[:, None], -fmax, fmax)
        codes = torch.nan_to_num(q, nan=0.0).to(dtype).view(torch.uint8)
        meta = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    return torch.cat([codes.reshape(-1), meta.reshape(-1).view(torch.uint8)])


def check_wire(wire: torch.Tensor, n: int, precision: str) -> None:
    """ValueError unless ``wire`` is the flat uint8 encoding of ``n`` values in ``precision``."""
    check_precision(precision)
    if wire.dtype != torch.uint8 or wire.dim() != 1:
        raise ValueError(f"decode expects flat uint8 wire bytes, got {wire.dtype} {tuple(wire.shape)}")
    if wire.numel() != wire_nbytes(n, precision):
        raise ValueError(f"{precision} payload of {n} elements must be {wire_nbytes(n, precision)} "
                         f"bytes on the wire, got {wire.numel()}")


def decode(wire: torch.Tensor, n: int, precision: str) -> torch.Tensor:
    """Flat uint8 wire bytes of an ``n``-element payload -> flat fp32 values."""
    check_wire(wire, n, precision)
    kernels = _cuda_kernels(wire)
    if kernels is not None and precision != "fp32":
        return kernels.decode(wire, n, precision)
    if precision in _CASTS:
        return wire.view(_CASTS[precision]).to(torch.float32)
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=wire.device)
    nb = math.ceil(n / BLOCK)
    codes = wire[:nb * BLOCK].view(nb, BLOCK)
    meta = wire[nb * BLOCK:].view(torch.float32)
    if precision == "int8":
        meta = meta.view(nb, 2)
        out = codes.to(torch.float32) * meta[:, :1] + meta[:, 1:]
    else:
        dtype, _ = _FP8[precision]
        out = codes.view(dtype).to(torch.float32) * meta[:, None]
    return out.reshape(-1)[:n]


def roundtrip(x: torch.Tensor, precision: str) -> torch.Tensor:
    """What the receiver sees for payload ``x``: ``decode(encode(x))`` in ``x``'s shape."""
    return decode(encode(x, precision), x.numel(), precision).view(x.shape)


def relative_error(x: torch.Tensor, decoded: torch.Tensor) -> float:
    """``||x - decoded|| / ||x||`` over the finite entries of ``x`` (0 for an all-zero payload)."""
    x = x.detach().reshape(-1).to(torch.float32)
    decoded = decoded.detach().reshape(-1).to(torch.float32)
    finite = torch.isfinite(x)
    x, decoded = x[finite], decoded[finite]
    norm = float(torch.linalg.vector_norm(x))
    diff = float(torch.linalg.vector_norm(x - decoded))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def encode_parts(x: torch.Tensor, counts, precision: str) -> tuple[torch.Tensor, list[int]]:
    """Encode consecutive pieces of flat ``x`` (``counts`` elements each, one per destination)
    separately, so no scale block straddles two destinations. Returns the wire bytes of all
    pieces back to back and each piece's byte count. Casts encode in one pass."""
    check_precision(precision)
    x = x.detach().reshape(-1)
    nbytes = [wire_nbytes(n, precision) for n in counts]
    if precision == "fp32":
        return x.to(torch.float32).view(torch.uint8), nbytes
    if precision in _CASTS:
        return encode(x, precision), nbytes
    pieces = x.split(list(counts))
    return torch.cat([encode(p, precision) for p in pieces]) if pieces else x.new_empty(0, dtype=torch.uint8), nbytes


def decode_parts(wire: torch.Tensor, counts, precision: str) -> torch.Tensor:
    """Inverse of ``encode_parts``: the flat fp32 values of pieces of ``counts`` elements."""
    check_precision(precision)
    total = sum(counts)
    if precision in _CASTS:
        return decode(wire, total, precision)
    pieces = wire.split([wire_nbytes(n, precision) for n in counts])
    if not pieces:
        return torch.empty(0, dtype=torch.float32, device=wire.device)
    return torch.cat([decode(p, n, precision) for p, n in zip(pieces, counts)])
