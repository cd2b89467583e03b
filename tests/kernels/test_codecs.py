"""The wire codecs of ``recc.kernels.codecs`` against their documented contract.

- round trip of every precision on random payloads of 0, 1, 63, 64, 65, 1000 and 4097 elements
  (empty, one element, a partial block, exactly one block, one element into a second block, ...);
- exact byte counts: ``4n`` / ``2n`` for the casts, ``72 * ceil(n/64)`` for int8 and
  ``68 * ceil(n/64)`` for fp8, both from ``wire_nbytes`` and from what ``encode`` returns;
- the relative error on ``randn`` payloads stays under each codec's bound;
- blocks of one repeated value, and all-zero payloads, decode exactly;
- non-finite values: fp16/bf16 carry NaN and +-Inf; int8/fp8 turn exactly the 64-element
  block holding one into NaN and leave the other blocks finite and accurate; fp16 overflows
  to +-Inf like a cast; finite payloads never decode to NaN;
- decode refuses a wrong byte count (naming the expected size) and non-uint8 / non-flat wire;
  an unknown precision is a ValueError everywhere;
- ``relative_error``: 0 for all-zero payloads, non-finite entries ignored;
- the plain casts are the ones ``recc.specs.CAST_PRECISIONS`` names for the passes.
"""
from __future__ import annotations

import math

import pytest
import torch

from recc.kernels import codecs

SIZES = (0, 1, 63, 64, 65, 1000, 4097)
BLOCK_CODECS = ("int8", "fp8_e4m3", "fp8_e5m2")
# Relative error bounds on randn payloads (measured: fp16 ~2e-4, bf16 ~1.7e-3, int8 ~5.5e-3,
# e4m3 ~2.5e-2, e5m2 ~5e-2).
BOUNDS = {"fp32": 0.0, "fp16": 1e-3, "bf16": 1e-2, "int8": 2e-2, "fp8_e4m3": 6e-2, "fp8_e5m2": 1.2e-1}


def _expected_nbytes(n: int, precision: str) -> int:
    blocks = math.ceil(n / 64)
    return {"fp32": 4 * n, "fp16": 2 * n, "bf16": 2 * n, "int8": 72 * blocks,
            "fp8_e4m3": 68 * blocks, "fp8_e5m2": 68 * blocks}[precision]


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed + n))


def test_precisions_are_the_documented_ones():
    assert set(codecs.PRECISIONS) == set(BOUNDS)


def test_the_casts_are_the_ones_the_core_names():
    # Passes ask recc.specs which codecs are plain casts (they never import kernels); the codecs
    # implementing them must agree.
    from recc.specs import CAST_PRECISIONS
    assert [p for p in codecs.PRECISIONS if codecs.is_cast(p)] == list(CAST_PRECISIONS)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("precision", codecs.PRECISIONS)
def test_round_trip_sizes_and_byte_counts(precision, n):
    x = _randn(n)
    wire = codecs.encode(x, precision)
    assert wire.dtype == torch.uint8 and wire.dim() == 1
    assert wire.numel() == codecs.wire_nbytes(n, precision) == _expected_nbytes(n, precision)
    out = codecs.decode(wire, n, precision)
    assert out.dtype == torch.float32 and out.shape == (n,)
    assert torch.isfinite(out).all()
    if precision == "fp32":
        assert torch.equal(out, x)
    # roundtrip keeps the payload's shape
    if n == 1000:
        x2 = x.view(40, 25)
        rt = codecs.roundtrip(x2, precision)
        assert rt.shape == (40, 25)
        assert torch.equal(rt.reshape(-1), out)


@pytest.mark.parametrize("precision", codecs.PRECISIONS)
def test_byte_counts_formula(precision):
    for n in list(SIZES) + [127, 128, 129, 8192]:
        assert codecs.wire_nbytes(n, precision) == _expected_nbytes(n, precision), n
    # the fp32 fraction of the block codecs: at most 72/256 (int8), 68/256 (fp8) on full blocks
    if precision in BLOCK_CODECS:
        assert codecs.wire_nbytes(6400, precision) / (4 * 6400) == (72 if precision == "int8" else 68) / 256


@pytest.mark.parametrize("n", [64, 1000, 4097])
@pytest.mark.parametrize("precision", codecs.PRECISIONS)
def test_error_bound_on_randn(precision, n):
    x = _randn(n, seed=7)
    err = codecs.relative_error(x, codecs.roundtrip(x, precision))
    if precision == "fp32":
        assert err == 0.0
    else:
        assert 0.0 < err < BOUNDS[precision], (precision, err)


@pytest.mark.parametrize("precision", BLOCK_CODECS)
def test_block_codec_error_is_per_block(precision):
    """Each 64-block has its own scale: a block of tiny values next to a block of huge ones
    keeps its own relative accuracy."""
    x = torch.cat([_randn(64, 1) * 1e-4, _randn(64, 2) * 1e4])
    rt = codecs.roundtrip(x, precision)
    for b in range(2):
        sl = slice(64 * b, 64 * (b + 1))
        assert codecs.relative_error(x[sl], rt[sl]) < BOUNDS[precision]


# Values chosen so that a block codec cannot be exact by luck of the scale division
# (e.g. 448 * fl(-7.99 / 448) != -7.99 in fp32).
CONSTANTS = (-7.99, 0.1, 3.7, -2.5, 1e-3, 12345.678, 7.94, -0.3)


@pytest.mark.parametrize("precision", BLOCK_CODECS)
def test_constant_blocks_decode_exactly(precision):
    """int8 decodes a block of equal values exactly (scale 1, bias = the value); fp8 scales it
    to fmax and back, which is exact to within one ulp."""
    bad = []
    blocks = torch.repeat_interleave(torch.tensor(CONSTANTS), 64)
    for x in [torch.full((128,), c) for c in CONSTANTS] + [blocks]:
        out = codecs.roundtrip(x, precision)
        if precision == "int8":
            ok = torch.equal(out, x)
        else:
            ulp = torch.finfo(torch.float32).eps * x.abs()
            ok = bool(((out - x).abs() <= ulp).all())
        if not ok:
            bad.append((float(x[0]), float((out - x).abs().max())))
    assert not bad, f"{precision}: constant blocks off by more than allowed (first value, max diff): {bad}"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("precision", codecs.PRECISIONS)
def test_all_zero_decodes_exactly(precision, n):
    x = torch.zeros(n)
    out = codecs.roundtrip(x, precision)
    assert torch.equal(out, x)
    assert not torch.signbit(out).any()
    assert codecs.relative_error(x, out) == 0.0


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_casts_carry_nan_and_inf(precision):
    x = _randn(200)
    x[3], x[70], x[150] = float("nan"), float("inf"), float("-inf")
    out = codecs.roundtrip(x, precision)
    assert math.isnan(out[3]) and out[70] == math.inf and out[150] == -math.inf
    finite = torch.isfinite(x)
    assert torch.isfinite(out[finite]).all()
    assert codecs.relative_error(x, out) <= BOUNDS[precision]


def test_fp16_overflows_to_inf_like_a_cast():
    x = torch.tensor([1e6, -1e6, 65504.0, -65504.0, 70000.0, 1.0])
    out = codecs.roundtrip(x, "fp16")
    assert out.tolist() == [math.inf, -math.inf, 65504.0, -65504.0, math.inf, 1.0]
    assert torch.equal(out, x.to(torch.float16).to(torch.float32))


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("precision", BLOCK_CODECS)
def test_block_codecs_poison_only_the_block_with_a_non_finite_value(precision, bad):
    n = 4 * 64 + 10                       # 5 blocks, the last one partial
    x = _randn(n, seed=3)
    x[64 + 17] = float(bad)               # block 1
    x[4 * 64 + 5] = float(bad)            # block 4 (the partial one)
    out = codecs.roundtrip(x, precision)
    assert out.shape == (n,)
    for b, sl in enumerate([slice(0, 64), slice(64, 128), slice(128, 192), slice(192, 256), slice(256, n)]):
        if b in (1, 4):
            assert torch.isnan(out[sl]).all(), (b, out[sl])
        else:
            assert torch.isfinite(out[sl]).all(), b
            assert codecs.relative_error(x[sl], out[sl]) < BOUNDS[precision], b
    # the byte count does not change
    assert codecs.encode(x, precision).numel() == _expected_nbytes(n, precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_finite_extremes(precision):
    """A finite block whose range is wider than fp32's largest value: the casts and fp8 (whose
    scale is amax-based) keep it finite; int8's scale (max - min) cannot be represented, so, as
    documented, that block is sent as NaN (visible) and its neighbours are untouched."""
    x = torch.full((128,), 1.0)
    x[:64] = 3e38
    x[0], x[1] = -3e38, 0.0
    out = codecs.roundtrip(x, precision)
    if precision == "int8":
        assert torch.isnan(out[:64]).all()
    else:
        assert torch.isfinite(out[:64]).all(), f"{precision}: a finite payload decoded to {out[:4].tolist()}..."
    assert torch.equal(out[64:], x[64:]), f"{precision}: the neighbouring block changed"


@pytest.mark.parametrize("precision", codecs.PRECISIONS)
def test_decode_rejects_wrong_byte_count(precision):
    n = 100
    want = _expected_nbytes(n, precision)
    wire = codecs.encode(_randn(n), precision)
    for got in (want - 1, want + 1, 0):
        w = torch.zeros(got, dtype=torch.uint8)
        with pytest.raises(ValueError, match=rf"must be {want} bytes on the wire, got {got}"):
            codecs.decode(w, n, precision)
    # the right bytes for the wrong n
    with pytest.raises(ValueError, match=rf"must be {_expected_nbytes(n + 64, precision)} bytes"):
        codecs.decode(wire, n + 64, precision)


@pytest.mark.parametrize("precision", codecs.PRECISIONS)
def test_decode_rejects_non_uint8_or_non_flat_wire(precision):
    n = 64
    want = _expected_nbytes(n, precision)
    with pytest.raises(ValueError, match="uint8"):
        codecs.decode(torch.zeros(want, dtype=torch.int8), n, precision)
    with pytest.raises(ValueError, match="uint8"):
        codecs.decode(torch.zeros(want // 4, dtype=torch.float32), n, precision)
    with pytest.raises(ValueError, match="flat"):
        codecs.decode(torch.zeros(2, want // 2, dtype=torch.uint8), n, precision)


@pytest.mark.parametrize("name", ["int4", "fp8", "FP16", "float16", ""])
def test_unknown_precision_raises(name):
    with pytest.raises(ValueError, match="unknown wire precision"):
        codecs.check_precision(name)
    with pytest.raises(ValueError, match="unknown wire precision"):
        codecs.encode(torch.ones(4), name)
    with pytest.raises(ValueError, match="unknown wire precision"):
        codecs.decode(torch.zeros(8, dtype=torch.uint8), 4, name)
    with pytest.raises(ValueError, match="unknown wire precision"):
        codecs.roundtrip(torch.ones(4), name)


@pytest.mark.parametrize("name", ["int4", "fp8", "float16"])
def test_wire_nbytes_rejects_unknown_precision(name):
    """check_precision: 'never falls back silently' — a byte count for a codec that does not
    exist is as wrong as encoding with it."""
    with pytest.raises(ValueError, match="unknown wire precision"):
        codecs.wire_nbytes(64, name)


def test_relative_error():
    z = torch.zeros(10)
    assert codecs.relative_error(z, z) == 0.0
    assert codecs.relative_error(torch.zeros(0), torch.zeros(0)) == 0.0
    assert codecs.relative_error(z, torch.ones(10)) == math.inf
    x = torch.tensor([3.0, 4.0])
    assert codecs.relative_error(x, torch.tensor([3.0, 4.0])) == 0.0
    assert codecs.relative_error(x, torch.tensor([3.0, 3.0])) == pytest.approx(1 / 5)
    # non-finite entries of x are ignored (whatever decoded holds there)
    x = torch.tensor([3.0, float("nan"), 4.0, float("inf")])
    d = torch.tensor([3.0, 0.0, 4.0, float("nan")])
    assert codecs.relative_error(x, d) == 0.0
    # shapes are flattened
    assert codecs.relative_error(torch.ones(2, 3), torch.ones(6)) == 0.0


def test_encode_detaches_and_flattens():
    x = _randn(130).view(10, 13).requires_grad_()
    for precision in codecs.PRECISIONS:
        wire = codecs.encode(x, precision)
        assert not wire.requires_grad and wire.dim() == 1
        assert wire.numel() == _expected_nbytes(130, precision)
