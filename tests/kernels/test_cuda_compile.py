"""CPU-side checks of the CUDA kernels (CI has nvcc but no GPU).

Every ``.cu`` source must compile with nvcc for sm_80 and sm_90 with warnings as errors, and
the codecs' rounding functions (``__host__ __device__``) are compiled into a host library
and compared bit for bit with torch's casts and with ``recc.kernels.codecs``.
"""
from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from recc.kernels import codecs
from recc.kernels.cuda import loader

NVCC = loader.nvcc_path()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", loader.SOURCES)
def test_source_compiles_without_warnings(source, arch, tmp_path):
    loader.nvcc_compile(source, arch, tmp_path)
    assert (tmp_path / f"{source[:-3]}-{arch}.cubin").stat().st_size > 0


@needs_nvcc
def test_compile_error_is_reported(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(int* x) { x[0] = undefined_name; }\n')
    monkeypatch.setattr(loader, "source_path", lambda name: bad)
    with pytest.raises(RuntimeError, match="undefined_name"):
        loader.nvcc_compile("bad.cu", "sm_90", tmp_path)


SHIM = r"""
#include "%s"
extern "C" {
void h_f16(const float* x, unsigned short* o, long long n) { for (long long i = 0; i < n; ++i) o[i] = f32_to_f16_bits(x[i]); }
void h_bf16(const float* x, unsigned short* o, long long n) { for (long long i = 0; i < n; ++i) o[i] = f32_to_bf16_bits(x[i]); }
void h_e4m3(const float* x, float s, unsigned char* o, long long n) { for (long long i = 0; i < n; ++i) o[i] = fp8_code<3, 7>(x[i], s, 448.0f); }
void h_e5m2(const float* x, float s, unsigned char* o, long long n) { for (long long i = 0; i < n; ++i) o[i] = fp8_code<2, 15>(x[i], s, 57344.0f); }
void h_e4m3_dec(const unsigned char* c, float* o, long long n) { for (long long i = 0; i < n; ++i) o[i] = e4m3_to_f32(c[i]); }
void h_e5m2_dec(const unsigned char* c, float* o, long long n) { for (long long i = 0; i < n; ++i) o[i] = e5m2_to_f32(c[i]); }
void h_int8(const float* x, float lo, float s, unsigned char* o, long long n) { for (long long i = 0; i < n; ++i) o[i] = int8_code(x[i], lo, s); }
}
"""


@pytest.fixture(scope="module")
def host_codecs(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not installed on this machine")
    d = tmp_path_factory.mktemp("codecs")
    shim = d / "shim.cu"
    shim.write_text(SHIM % loader.source_path("codecs.cu"))
    lib = d / "libshim.so"
    proc = subprocess.run([NVCC, "-shared", "-Xcompiler", "-fPIC", "--std=c++17", "-o", str(lib), str(shim)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(lib))


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def _n(t):
    return ctypes.c_longlong(t.numel())


def _payload(n=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-9, 6, (n,), generator=g).float())
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 65520.0, 65519.99,
                            1e-8, -1e-8, 5.96e-8, 2.98e-8, 2.99e-8, 3.4e38, -3.4e38, 1.0e-45, 1.17549435e-38])
    return torch.cat([special, x])


def test_fp16_bf16_bits_match_torch(host_codecs):
    x = _payload()
    for fn, dtype in ((host_codecs.h_f16, torch.float16), (host_codecs.h_bf16, torch.bfloat16)):
        out = torch.empty(x.numel(), dtype=torch.int16)
        fn(_ptr(x), _ptr(out), _n(x))
        want = x.to(dtype).view(torch.int16)
        finite = ~torch.isnan(x)
        assert torch.equal(out[finite], want[finite]), dtype
        # NaN stays NaN (its payload is not part of the contract)
        assert bool(torch.isnan(out[~finite].view(dtype)).all())


@pytest.mark.parametrize("precision,fmax,mbits", [("fp8_e4m3", 448.0, 3), ("fp8_e5m2", 57344.0, 2)])
def test_fp8_codes_match_torch(host_codecs, precision, fmax, mbits):
    dtype = torch.float8_e4m3fn if precision == "fp8_e4m3" else torch.float8_e5m2
    encode = host_codecs.h_e4m3 if precision == "fp8_e4m3" else host_codecs.h_e5m2
    x = _payload()
    x = x[torch.isfinite(x)]
    for scale in (1.0, 3.7e-3, 2.5e4):
        out = torch.empty(x.numel(), dtype=torch.uint8)
        encode(_ptr(x), ctypes.c_float(scale), _ptr(out), _n(x))
        q = torch.clamp(x / scale, -fmax, fmax)
        want = q.to(dtype).view(torch.uint8)
        mism = (out != want).nonzero()
        assert mism.numel() == 0, (precision, scale, x[mism[:5, 0]].tolist(), out[mism[:5, 0]].tolist(),
                                   want[mism[:5, 0]].tolist())
    # decoding: every code
    codes = torch.arange(256, dtype=torch.uint8)
    dec = torch.empty(256)
    (host_codecs.h_e4m3_dec if precision == "fp8_e4m3" else host_codecs.h_e5m2_dec)(_ptr(codes), _ptr(dec), _n(codes))
    want = codes.view(dtype).to(torch.float32)
    assert torch.equal(torch.isnan(dec), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(dec[ok], want[ok])


def test_int8_codes_match_the_reference(host_codecs):
    x = torch.randn(64 * 300, generator=torch.Generator().manual_seed(3)) * 5
    wire = codecs.encode(x, "int8")
    nb = x.numel() // 64
    meta = wire[nb * 64:].view(torch.float32).view(nb, 2)
    blocks = x.view(nb, 64)
    for k in range(0, nb, 7):
        out = torch.empty(64, dtype=torch.uint8)
        row = blocks[k].contiguous()
        host_codecs.h_int8(_ptr(row), ctypes.c_float(float(meta[k, 1])), ctypes.c_float(float(meta[k, 0])),
                           _ptr(out), _n(row))
        assert torch.equal(out, wire[k * 64:(k + 1) * 64]), k
