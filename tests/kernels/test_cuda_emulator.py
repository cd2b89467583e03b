"""The CUDA emulator itself: CUDA semantics on small kernels of its own (barriers, dynamic shared
memory, shuffles and votes, atomics, the seeded order, fp16 conversions), and that it fails
where a GPU would (launch limits, a lane that left a shuffle, divergent barriers, out-of-bounds
and misaligned accesses, arguments of the wrong C type)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from recc.kernels.cuda import emulator, loader

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(emulator.compiler() is None, reason="the CUDA emulator needs g++")]

SOURCE = r"""
#include <cuda_fp16.h>
extern "C" __global__ void block_reverse(const float* x, float* y, int sync) {
    extern __shared__ float buf[];
    const int i = threadIdx.x, base = blockIdx.x * blockDim.x;
    buf[i] = x[base + i];
    if (sync) __syncthreads();
    y[base + i] = buf[blockDim.x - 1 - i];
}
extern "C" __global__ void warp_sum(const float* x, float* y) {
    float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    y[blockIdx.x * blockDim.x + threadIdx.x] = v;
}
extern "C" __global__ void shuffles(const int* x, int* out, int width) {
    const int i = threadIdx.x, v = x[i];
    out[4 * i + 0] = __shfl_sync(0xFFFFFFFFu, v, 3, width);
    out[4 * i + 1] = __shfl_up_sync(0xFFFFFFFFu, v, 2, width);
    out[4 * i + 2] = __shfl_down_sync(0xFFFFFFFFu, v, 2, width);
    out[4 * i + 3] = __shfl_xor_sync(0xFFFFFFFFu, v, 5, width);
}
extern "C" __global__ void votes(const int* x, unsigned* out) {
    const int i = threadIdx.x;
    out[3 * i + 0] = __all_sync(0xFFFFFFFFu, x[i]);
    out[3 * i + 1] = __any_sync(0xFFFFFFFFu, x[i]);
    out[3 * i + 2] = __ballot_sync(0xFFFFFFFFu, x[i]);
}
extern "C" __global__ void block_count(const int* x, int* out) {
    out[threadIdx.x] = __syncthreads_count(x[threadIdx.x]);
}
extern "C" __global__ void exit_then_shuffle(float* y) {
    if (threadIdx.x == 3) return;
    y[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, 1.0f, 1);
}
extern "C" __global__ void divergent_barrier(int* y) {
    if (threadIdx.x < 32) { __syncthreads(); y[threadIdx.x] = 1; }
    else { __syncthreads(); y[threadIdx.x] = 2; }
}
extern "C" __global__ void write_at(float* y, long long i) { y[i] = 1.0f; }
extern "C" __global__ void vector_load(const float* x, float* y, int at) {
    const float4 v = *reinterpret_cast<const float4*>(x + at);
    y[0] = v.x + v.y + v.z + v.w;
}
extern "C" __global__ void shared_fill(float* y) {
    extern __shared__ float buf[];
    buf[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    y[threadIdx.x] = buf[threadIdx.x];
}
extern "C" __global__ void count(unsigned long long* c, int* min_seen) {
    atomicAdd(c, 1ull);
    atomicMin(min_seen, (int)(blockIdx.x * blockDim.x + threadIdx.x));
}
extern "C" __global__ void last_writer(int* y) { y[0] = blockIdx.x * blockDim.x + threadIdx.x; }
extern "C" __global__ void scalars(int a, long long b, float c, unsigned long long d, double* out) {
    out[0] = a; out[1] = (double)b; out[2] = c; out[3] = (double)d;
}
extern "C" __global__ void dims(int* out) {
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    out[b * blockDim.x * blockDim.y * blockDim.z + t] = b * 1000 + t;
}
extern "C" __global__ void halves(const float* x, unsigned short* rn, unsigned short* rz, float* back, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    rn[i] = __half_as_ushort(__float2half_rn(x[i]));
    rz[i] = __half_as_ushort(__float2half_rz(x[i]));
    back[i] = __half2float(__ushort_as_half((unsigned short)i));
}
"""


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("emu") / "emu_test.cu"
    path.write_text(SOURCE)
    emulator.build(path)
    return path


def run(src, kernel, grid, block, *args, shared=0, seed=None):
    with emulator.emulated(seed=seed):
        emulator.launch(src, kernel, grid, block, args, shared)


def test_the_source_builds_with_nvcc_too(src, tmp_path):
    # The test kernels are CUDA, not an emulator dialect: nvcc accepts them as they are.
    if loader.nvcc_path() is None:
        pytest.skip("nvcc is not installed")
    import subprocess
    proc = subprocess.run([loader.nvcc_path(), "-arch=sm_80", "-cubin", "-o", str(tmp_path / "t.cubin"), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


def test_kernel_table_lists_every_kernel(src):
    names = emulator.kernels_of(src)
    assert {"block_reverse", "warp_sum", "halves", "scalars"} <= set(names)


def test_barrier_and_dynamic_shared_memory(src):
    x = torch.arange(3 * 64, dtype=torch.float32)
    y = torch.zeros_like(x)
    run(src, "block_reverse", 3, 64, x, y, np.int32(1), shared=64 * 4)
    assert torch.equal(y, x.view(3, 64).flip(1).reshape(-1))


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_a_missing_barrier_reads_garbage(src, seed):
    # Threads run to their next synchronisation point one at a time: without the barrier, a
    # thread reads slots no thread has written yet (shared memory starts as NaN bytes).
    x = torch.arange(64, dtype=torch.float32)
    y = torch.zeros_like(x)
    run(src, "block_reverse", 1, 64, x, y, np.int32(0), shared=64 * 4, seed=seed)
    assert not torch.equal(y, x.flip(0))
    assert bool(torch.isnan(y).any())


def test_warp_shuffle_waits_for_all_lanes(src):
    x = torch.randn(4 * 64, generator=torch.Generator().manual_seed(0))
    y = torch.zeros_like(x)
    run(src, "warp_sum", 4, 64, x, y)
    want = x.view(-1, 32).sum(1, keepdim=True).expand(-1, 32).reshape(-1)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("width", [32, 8, 4])
def test_shuffle_variants_follow_cuda(src, width):
    x = torch.arange(100, 132, dtype=torch.int32)
    out = torch.zeros(32 * 4, dtype=torch.int32)
    run(src, "shuffles", 1, 32, x, out, np.int32(width))
    out = out.view(32, 4).tolist()
    for lane in range(32):
        seg = lane // width * width
        assert out[lane][0] == 100 + seg + 3 % width
        assert out[lane][1] == 100 + (lane - 2 if lane - 2 >= seg else lane)
        assert out[lane][2] == 100 + (lane + 2 if lane + 2 < seg + width else lane)
        x_src = lane ^ 5
        assert out[lane][3] == 100 + (x_src if seg <= x_src < seg + width else lane)


def test_votes_and_block_count(src):
    x = torch.zeros(64, dtype=torch.int32)
    x[[1, 5, 40]] = 1
    x[32:] = 1 - x[32:]   # warp 1: all but lane 8
    x[40] = 0
    out = torch.zeros(64 * 3, dtype=torch.int32)
    run(src, "votes", 1, 64, x, out)
    out = out.view(64, 3)
    ballot0 = (1 << 1) | (1 << 5)
    assert out[:32, 0].eq(0).all() and out[:32, 1].eq(1).all() and out[:32, 2].eq(ballot0).all()
    ballot1 = 0xFFFFFFFF & ~(1 << 8)
    assert out[32:, 0].eq(0).all() and out[32:, 1].eq(1).all()
    assert out[32:, 2].view(torch.int32).eq(torch.tensor(ballot1, dtype=torch.int64).to(torch.int32)).all()
    counts = torch.zeros(64, dtype=torch.int32)
    run(src, "block_count", 1, 64, x, counts)
    assert counts.eq(int(x.sum())).all()


def test_a_lane_that_exited_before_a_shuffle_is_an_error(src):
    with pytest.raises(emulator.EmulatorError, match=r"__shfl_xor_sync at emu_test.cu:\d+.*lane 3 of the mask has exited"):
        run(src, "exit_then_shuffle", 1, 32, torch.zeros(32))


def test_divergent_barriers_are_an_error(src):
    with pytest.raises(emulator.EmulatorError, match="different barriers.*divergent"):
        run(src, "divergent_barrier", 1, 64, torch.zeros(64, dtype=torch.int32))


def test_the_server_survives_a_kernel_error(src):
    with pytest.raises(emulator.EmulatorError):
        run(src, "divergent_barrier", 1, 64, torch.zeros(64, dtype=torch.int32))
    test_barrier_and_dynamic_shared_memory(src)


@pytest.mark.parametrize("block,shared,match", [
    ((512, 3, 1), 0, "1536 threads per block, the device allows 1024"),
    (1025, 0, r"blockDim.x = 1025"),
    ((2, 2, 65), 0, r"blockDim.z = 65"),
    (32, 48 * 1024 + 4, "49156 bytes of dynamic shared memory"),
])
def test_launch_limits_are_enforced(src, block, shared, match):
    with pytest.raises(emulator.EmulatorError, match=match):
        run(src, "shared_fill", 1, block, torch.zeros(2048), shared=shared)


def test_grid_limits_are_enforced(src):
    with pytest.raises(emulator.EmulatorError, match=r"gridDim.y = 65536"):
        run(src, "last_writer", (1, 65536), 1, torch.zeros(1, dtype=torch.int32))


def test_three_dimensional_grids_and_blocks(src):
    out = torch.full((2 * 3 * 2 * 4 * 2 * 3,), -1, dtype=torch.int32)
    run(src, "dims", (2, 3, 2), (4, 2, 3), out)
    b, t = torch.meshgrid(torch.arange(12), torch.arange(24), indexing="ij")
    assert torch.equal(out, (b * 1000 + t).reshape(-1).to(torch.int32))


def test_a_write_past_a_tensor_is_caught(src):
    y = torch.zeros(10)
    run(src, "write_at", 1, 1, y, np.int64(9))
    assert y[9] == 1.0
    with pytest.raises(emulator.EmulatorCrash, match="heap-buffer-overflow"):
        run(src, "write_at", 1, 1, y, np.int64(10))
    # a view's buffer ends where the view does, even inside a larger storage
    base = torch.zeros(20)
    with pytest.raises(emulator.EmulatorCrash, match="heap-buffer-overflow"):
        run(src, "write_at", 1, 1, base[:10], np.int64(10))
    assert base[10] == 0.0


def test_a_misaligned_vector_load_is_caught(src):
    x = torch.arange(16, dtype=torch.float32)
    y = torch.zeros(1)
    run(src, "vector_load", 1, 1, x, y, np.int32(4))
    assert y[0] == 4 + 5 + 6 + 7
    with pytest.raises(emulator.EmulatorCrash, match="misaligned"):
        run(src, "vector_load", 1, 1, x, y, np.int32(1))


def test_shared_memory_past_the_launch_size_is_caught(src):
    y = torch.zeros(64)
    run(src, "shared_fill", 1, 64, y, shared=64 * 4)
    assert torch.equal(y, torch.arange(64, dtype=torch.float32))
    with pytest.raises(emulator.EmulatorCrash, match=r"use-after-poison(.|\n)*emu_test.cu:\d+ in shared_fill"):
        run(src, "shared_fill", 1, 64, y, shared=63 * 4)


def test_atomics(src):
    c = torch.zeros(1, dtype=torch.int64)
    m = torch.full((1,), 1 << 30, dtype=torch.int32)
    run(src, "count", 7, 96, c, m, seed=5)
    assert int(c) == 7 * 96 and int(m) == 0


def test_a_seed_changes_the_order_of_threads_and_blocks(src):
    results = set()
    for seed in [None, 1, 2, 3, 4, 5]:
        y = torch.zeros(1, dtype=torch.int32)
        run(src, "last_writer", 4, 64, y, seed=seed)
        results.add(int(y))
    assert 255 in results and len(results) > 2  # in index order the last thread writes last


def test_scalars_take_their_exact_c_types(src):
    out = torch.zeros(4, dtype=torch.float64)
    run(src, "scalars", 1, 1, np.int32(-3), np.int64(1 << 40), np.float32(0.5), np.uint64(7), out)
    assert out.tolist() == [-3.0, float(1 << 40), 0.5, 7.0]
    with pytest.raises(emulator.EmulatorError, match=r"parameter 1 is `long long`, the launch passes int32"):
        run(src, "scalars", 1, 1, np.int32(-3), np.int32(1), np.float32(0.5), np.uint64(7), out)
    with pytest.raises(emulator.EmulatorError, match=r"parameter 4 is `double\*`, the launch passes a float32 tensor"):
        run(src, "scalars", 1, 1, np.int32(-3), np.int64(1), np.float32(0.5), np.uint64(7), out.float())
    with pytest.raises(TypeError, match="numpy scalar"):
        run(src, "scalars", 1, 1, -3, np.int64(1), np.float32(0.5), np.uint64(7), out)
    with pytest.raises(emulator.EmulatorError, match="takes 5 arguments, the launch passes 4"):
        run(src, "scalars", 1, 1, np.int32(-3), np.int64(1), np.float32(0.5), out)
    with pytest.raises(emulator.EmulatorError, match="no kernel nope"):
        run(src, "nope", 1, 1)


def test_launches_need_the_emulated_mode(src):
    with pytest.raises(RuntimeError, match="emulated"):
        emulator.launch(src, "last_writer", 1, 1, (torch.zeros(1, dtype=torch.int32),))


def test_fp16_conversions_are_the_gpus(src):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60000, generator=g) * torch.pow(10.0, torch.randint(-9, 6, (60000,), generator=g).float())
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 65519.99, 65520.0, 1e6,
                            -1e6, 5.96e-8, 2.98e-8, 2.99e-8, 1e-45, 6.1e-5, -6.1e-5])
    x = torch.cat([special, x, torch.zeros(65536 - 16 - 60000)])
    n = x.numel()
    rn = torch.zeros(n, dtype=torch.int16)
    rz = torch.zeros(n, dtype=torch.int16)
    back = torch.zeros(n)
    run(src, "halves", -(-n // 256), 256, x, rn, rz, back, np.int32(n))
    nan = torch.isnan(x)
    assert torch.equal(rn[~nan], x[~nan].half().view(torch.int16))
    assert bool(torch.isnan(rn[nan].view(torch.float16)).all()) and bool(torch.isnan(rz[nan].view(torch.float16)).all())
    # round toward zero: the largest half not above |x| (finite x saturates at 65504)
    h = rz[~nan].view(torch.float16).float()
    xf = x[~nan]
    assert bool((h.abs() <= xf.abs()).all())
    step_up = (rz[~nan].view(torch.int16) + 1).view(torch.float16).float()
    finite_h = torch.isfinite(h) & (h.abs() < 65504)
    assert bool((step_up.abs()[finite_h] > xf.abs()[finite_h]).all())
    assert h[xf == 1e6].item() == 65504.0 and h[xf == float("inf")].item() == float("inf")
    codes = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    assert torch.equal(torch.isnan(back), torch.isnan(codes))
    assert torch.equal(back[~torch.isnan(codes)], codes[~torch.isnan(codes)])


STATIC_SHARED = r"""
extern "C" __global__ void reverse64(const float* x, float* y) {
    __shared__ float buf[64];
    const int i = threadIdx.x, base = blockIdx.x * 64;
    buf[i] = x[base + i];
    __syncthreads();
    y[base + i] = buf[63 - i];
}
"""


def test_static_shared_memory_is_per_block(tmp_path):
    path = tmp_path / "static_shared.cu"
    path.write_text(STATIC_SHARED)
    x = torch.arange(4 * 64, dtype=torch.float32)
    y = torch.zeros_like(x)
    run(path, "reverse64", 4, 64, x, y, seed=3)
    assert torch.equal(y, x.view(4, 64).flip(1).reshape(-1))


def test_a_source_mixing_static_and_dynamic_shared_memory_is_refused(tmp_path):
    path = tmp_path / "mixed_shared.cu"
    path.write_text(STATIC_SHARED + 'extern "C" __global__ void k(float* y) { extern __shared__ float d[]; y[0] = d[0]; }\n')
    with pytest.raises(emulator.EmulatorError, match="both static and extern __shared__"):
        emulator.build(path)


# ----------------------------------------------------------------------------- counting

COUNTED = r"""
extern "C" __global__ void gather(const int* idx, const float* x, float* y, unsigned* hits, int n) {
    extern __shared__ float buf[];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    buf[threadIdx.x] = x[i];
    float acc = buf[threadIdx.x] + x[idx[i]];
    if (blockIdx.x == 1 && threadIdx.x == 5)
        for (int k = 0; k < 10; ++k) acc += x[k];
    y[i] = acc;
    atomicAdd(hits, 1u);
}
extern "C" __global__ void read_at(const float* x, float* y, long long i) { y[0] = x[i]; }
"""


@pytest.fixture(scope="module")
def counted_src(tmp_path_factory):
    path = tmp_path_factory.mktemp("emu") / "counted.cu"
    path.write_text(COUNTED)
    return path


@pytest.mark.parametrize("seed", [None, 4])
def test_counting_counts_each_threads_global_loads_and_stores(counted_src, seed):
    # Per thread: x[i], idx[i], x[idx[i]] and the atomic's read; y[i] and the atomic's write.
    # Thread 5 of block 1 also reads x[0..9].  Shared memory and the stack are not counted.
    n = 100
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    x, y, hits = torch.randn(n), torch.zeros(n), torch.zeros(1, dtype=torch.int32)
    with emulator.emulated(seed=seed), emulator.counting() as c:
        emulator.launch(counted_src, "gather", 4, 32, (idx, x, y, hits, np.int32(n)), 32 * 4)
    torch.testing.assert_close(y, x + x[idx.long()] + torch.where(torch.arange(n) == 37, x[:10].sum(), 0.0))
    assert int(hits) == n
    r, = c.launches
    assert (r.kernel, r.grid, r.block, r.shared_mem) == ("gather", (4, 1, 1), (32, 1, 1), 128)
    assert (r.loads, r.stores) == (4 * n + 10, 2 * n)
    assert (r.bytes_read, r.bytes_written) == (16 * n + 40, 8 * n)
    assert (r.max_loads_per_thread, r.max_load_bytes_per_thread) == (14, 56)
    assert (r.max_stores_per_thread, r.max_store_bytes_per_thread) == (2, 8)
    assert r.max_loads_thread == ((1, 0, 0), (5, 0, 0))
    assert r.by_argument == {0: (4 * n, 0, 4 * n), 1: (8 * n + 40, 0, 4 * n), 2: (0, 4 * n, 4 * n), 3: (4 * n, 4 * n, 4)}
    assert c.kernels() == {"gather": 1}


def test_the_counting_build_still_catches_a_read_past_a_tensor(counted_src):
    x, y = torch.arange(10, dtype=torch.float32), torch.zeros(1)
    with emulator.emulated(), emulator.counting() as c:
        emulator.launch(counted_src, "read_at", 1, 1, (x, y, np.int64(9)))
        assert float(y) == 9.0 and c.launches[0].bytes_read == 4
        with pytest.raises(emulator.EmulatorCrash, match=r"heap-buffer-overflow(.|\n)*in read_at \S*counted.cu:\d+"):
            emulator.launch(counted_src, "read_at", 1, 1, (x, y, np.int64(10)))
    assert len(c.launches) == 1  # a crashed launch has no record


def test_counting_counts_the_aten_ops_a_gpu_would_launch():
    x = torch.arange(6, dtype=torch.float32)
    with emulator.counting() as c:
        torch.empty(3)                 # an allocation: no kernel
        v = x.view(2, 3)               # a view: no kernel
        y = v + 1                      # a kernel
        bool(y.sum() > 0)              # sum and gt: kernels; the bool: a device-to-host read
        x.narrow(0, 0, 0).zero_()      # on no elements: no kernel
    assert c.aten_launches == 3 and c.host_reads == 1
    assert c.aten["aten.view"] == 1 and c.aten["aten.empty"] == 1 and c.aten["aten.zero_"] == 1
    assert c.summary()["recc_launches"] == 0
