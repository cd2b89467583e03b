/*
 * cuda_emu.h: the CUDA built-ins recc's kernels use, for compiling a .cu source unmodified as
 * C++ and running it on the CPU (a test tool; see README.md in this folder).
 *
 * The source is compiled with `g++ -x c++ -include cuda_emu.h` (the build includes it first in
 * a generated shim); `#include <cuda_fp16.h>` finds the empty stand-in in include/.  Kernels
 * then run on the fibers of runtime.cpp: one fiber per CUDA thread, a block at a time, so
 * __syncthreads, the warp shuffles and the votes wait for the threads they name, as on a GPU.
 *
 * Device code is compiled as device code: __CUDA_ARCH__ is defined, so `#ifdef __CUDA_ARCH__`
 * branches take their device path.  Floating point is IEEE single precision with round to
 * nearest and no FMA contraction (nvcc contracts a*b+c by default, so plain arithmetic may
 * differ from a GPU in the last bit; the explicitly rounded __f*_rn intrinsics do not).
 */
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmath>
#include <type_traits>

#define __CUDA_ARCH__ 800
#define RECC_CUDA_EMULATOR 1

#define __global__ __attribute__((used))
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
/* __noinline__ is left alone: libstdc++ spells its attribute __attribute__((__noinline__)) */
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__ static

/* Shared memory.  `extern __shared__ T name[];` (dynamic, sized at launch) names a global
 * the build aliases to the launch's shared buffer, so __shared__ expands to nothing; a source
 * with `__shared__ T x[N];` (static) is built with CUDA_EMU_STATIC_SHARED and gets function
 * statics: one copy, which is each block's own because blocks run one after another.  (One
 * macro cannot serve both in one source: see README.md.) */
#ifdef CUDA_EMU_STATIC_SHARED
#define __shared__ static
#else
#define __shared__
#endif

/* ------------------------------------------------------------------ vector types */

struct alignas(8) float2 { float x, y; };
struct float3 { float x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct int3 { int x, y, z; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct uint3 { unsigned int x, y, z; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) double2 { double x, y; };
struct alignas(16) longlong2 { long long x, y; };
struct alignas(16) ulonglong2 { unsigned long long x, y; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline float2 make_float2(float x, float y) { return {x, y}; }
inline float3 make_float3(float x, float y, float z) { return {x, y, z}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

/* ------------------------------------------------------------------ the runtime's side */

namespace cuda_emu {

struct ThreadState {
    uint3 thread_idx;
};

extern ThreadState* current;     /* the running fiber's thread */
extern uint3 block_idx;
extern dim3 block_dim, grid_dim;

enum WarpOp : int {
    WARP_SYNC = 0, SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, VOTE_ALL, VOTE_ANY, VOTE_BALLOT,
};
enum BarrierOp : int { BAR_SYNC = 0, BAR_COUNT, BAR_AND, BAR_OR };

/* Waits for the lanes of `mask` to reach a warp collective, then returns this lane's result
 * (a shuffle: the source lane's value bits; a vote: the vote). */
unsigned long long warp_collective(int op, unsigned mask, unsigned long long value, int arg,
                                   int width, const char* file, int line);
/* Waits for every thread of the block; returns the count/and/or of `pred` for those ops. */
int barrier(int op, int pred, const char* file, int line);
/* Where a seeded schedule may switch threads: atomics and fences. */
void interleave_point();
unsigned activemask();
[[noreturn]] void trap(const char* what, const char* file, int line);

}  // namespace cuda_emu

#define threadIdx (static_cast<const uint3&>(::cuda_emu::current->thread_idx))
#define blockIdx (static_cast<const uint3&>(::cuda_emu::block_idx))
#define blockDim (static_cast<const dim3&>(::cuda_emu::block_dim))
#define gridDim (static_cast<const dim3&>(::cuda_emu::grid_dim))
#define warpSize 32

/* ------------------------------------------------------------------ barriers, warps */

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::cuda_emu::barrier(::cuda_emu::BAR_SYNC, 0, file, line);
}
inline int __syncthreads_count(int p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::cuda_emu::barrier(::cuda_emu::BAR_COUNT, p != 0, file, line);
}
inline int __syncthreads_and(int p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::cuda_emu::barrier(::cuda_emu::BAR_AND, p != 0, file, line);
}
inline int __syncthreads_or(int p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::cuda_emu::barrier(::cuda_emu::BAR_OR, p != 0, file, line);
}
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
    ::cuda_emu::warp_collective(::cuda_emu::WARP_SYNC, mask, 0, 0, 32, file, line);
}
inline unsigned __activemask() { return ::cuda_emu::activemask(); }

namespace cuda_emu {
template <typename T>
inline T shuffle(int op, unsigned mask, T var, int arg, int width, const char* file, int line) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                  "warp shuffles move values of at most 8 bytes");
    unsigned long long bits = 0;
    memcpy(&bits, &var, sizeof(T));
    bits = warp_collective(op, mask, bits, arg, width, file, line);
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}
}  // namespace cuda_emu

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src, int width = 32,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::cuda_emu::shuffle(::cuda_emu::SHFL_IDX, mask, var, src, width, file, line);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,
                        const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::cuda_emu::shuffle(::cuda_emu::SHFL_UP, mask, var, (int)delta, width, file, line);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,
                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::cuda_emu::shuffle(::cuda_emu::SHFL_DOWN, mask, var, (int)delta, width, file, line);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::cuda_emu::shuffle(::cuda_emu::SHFL_XOR, mask, var, lane_mask, width, file, line);
}
inline int __all_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
    return (int)::cuda_emu::warp_collective(::cuda_emu::VOTE_ALL, mask, pred != 0, 0, 32, file, line);
}
inline int __any_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
    return (int)::cuda_emu::warp_collective(::cuda_emu::VOTE_ANY, mask, pred != 0, 0, 32, file, line);
}
inline unsigned __ballot_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
    return (unsigned)::cuda_emu::warp_collective(::cuda_emu::VOTE_BALLOT, mask, pred != 0, 0, 32, file, line);
}

inline void __threadfence() { ::cuda_emu::interleave_point(); }
inline void __threadfence_block() { ::cuda_emu::interleave_point(); }
inline void __threadfence_system() { ::cuda_emu::interleave_point(); }
inline void __trap(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::cuda_emu::trap("__trap()", file, line);
}

/* ------------------------------------------------------------------ atomics */
/* One fiber runs at a time, so a read-modify-write is atomic; the overloads are CUDA's own, so
 * an atomic on a type CUDA has none for fails to compile here as with nvcc. */

/* The counting build: g++'s ASan checks an address once per basic block, so the store after the
 * load below would not reach the counters (runtime.cpp); it is counted here. */
#ifdef CUDA_EMU_COUNTING
namespace cuda_emu { void count_store(const void* address, unsigned long long bytes); }
#define CUDA_EMU_COUNT_STORE(address) ::cuda_emu::count_store(address, sizeof(*(address)))
#else
#define CUDA_EMU_COUNT_STORE(address) ((void)0)
#endif

#define CUDA_EMU_ATOMIC(NAME, T, EXPR)                     \
    inline T NAME(T* address, T val) {                     \
        ::cuda_emu::interleave_point();                    \
        const T old = *address;                            \
        *address = (EXPR);                                 \
        CUDA_EMU_COUNT_STORE(address);                     \
        return old;                                        \
    }
CUDA_EMU_ATOMIC(atomicAdd, int, old + val)
CUDA_EMU_ATOMIC(atomicAdd, unsigned int, old + val)
CUDA_EMU_ATOMIC(atomicAdd, unsigned long long, old + val)
CUDA_EMU_ATOMIC(atomicAdd, float, old + val)
CUDA_EMU_ATOMIC(atomicAdd, double, old + val)
CUDA_EMU_ATOMIC(atomicSub, int, old - val)
CUDA_EMU_ATOMIC(atomicSub, unsigned int, old - val)
CUDA_EMU_ATOMIC(atomicExch, int, val)
CUDA_EMU_ATOMIC(atomicExch, unsigned int, val)
CUDA_EMU_ATOMIC(atomicExch, unsigned long long, val)
CUDA_EMU_ATOMIC(atomicExch, float, val)
CUDA_EMU_ATOMIC(atomicMin, int, val < old ? val : old)
CUDA_EMU_ATOMIC(atomicMin, unsigned int, val < old ? val : old)
CUDA_EMU_ATOMIC(atomicMin, unsigned long long, val < old ? val : old)
CUDA_EMU_ATOMIC(atomicMin, long long, val < old ? val : old)
CUDA_EMU_ATOMIC(atomicMax, int, val > old ? val : old)
CUDA_EMU_ATOMIC(atomicMax, unsigned int, val > old ? val : old)
CUDA_EMU_ATOMIC(atomicMax, unsigned long long, val > old ? val : old)
CUDA_EMU_ATOMIC(atomicMax, long long, val > old ? val : old)
CUDA_EMU_ATOMIC(atomicAnd, int, old & val)
CUDA_EMU_ATOMIC(atomicAnd, unsigned int, old & val)
CUDA_EMU_ATOMIC(atomicAnd, unsigned long long, old & val)
CUDA_EMU_ATOMIC(atomicOr, int, old | val)
CUDA_EMU_ATOMIC(atomicOr, unsigned int, old | val)
CUDA_EMU_ATOMIC(atomicOr, unsigned long long, old | val)
CUDA_EMU_ATOMIC(atomicXor, int, old ^ val)
CUDA_EMU_ATOMIC(atomicXor, unsigned int, old ^ val)
CUDA_EMU_ATOMIC(atomicXor, unsigned long long, old ^ val)
CUDA_EMU_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
CUDA_EMU_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#undef CUDA_EMU_ATOMIC

#define CUDA_EMU_CAS(T)                                    \
    inline T atomicCAS(T* address, T compare, T val) {     \
        ::cuda_emu::interleave_point();                    \
        const T old = *address;                            \
        if (old == compare) *address = val;                \
        return old;                                        \
    }
CUDA_EMU_CAS(int)
CUDA_EMU_CAS(unsigned int)
CUDA_EMU_CAS(unsigned long long)
CUDA_EMU_CAS(unsigned short)
#undef CUDA_EMU_CAS

/* ------------------------------------------------------------------ bit casts, math */

namespace cuda_emu {
template <typename To, typename From>
inline To bit_cast(const From& f) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast of different sizes");
    To t;
    memcpy(&t, &f, sizeof(To));
    return t;
}
}  // namespace cuda_emu

inline float __int_as_float(int x) { return ::cuda_emu::bit_cast<float>(x); }
inline int __float_as_int(float x) { return ::cuda_emu::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return ::cuda_emu::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return ::cuda_emu::bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return ::cuda_emu::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return ::cuda_emu::bit_cast<long long>(x); }

/* Explicitly rounded arithmetic: the emulator runs with round-to-nearest and no contraction. */
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float a, float b) { return a / b; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
    return (x >> 16) | (x << 16);
}
/* CUDA's global min/max overloads for integers (float ones come from fminf/fmaxf). */
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
using std::isfinite;
using std::isinf;
using std::isnan;

template <typename T>
inline T __ldg(const T* p) { return *p; }

/* ------------------------------------------------------------------ fp16 and bf16 */
/* Bit-exact software conversions with the GPU's rounding: _rn ties to even, _rz truncates
 * (and saturates at the largest finite value, as IEEE round-toward-zero does); a NaN converts
 * to the canonical NaN (0x7FFF), as cvt does. */

namespace cuda_emu {
/* fp32 -> a float format with 8-bit exponent range cut to (ebits, mbits); used for fp16. */
inline unsigned short f32_to_f16(float f, bool rz) {
    const unsigned int u = bit_cast<unsigned int>(f);
    const unsigned short sign = (unsigned short)((u >> 16) & 0x8000u);
    const unsigned int a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0x7FFF;
    if (a == 0x7F800000u) return (unsigned short)(sign | 0x7C00u);
    const int e = (int)(a >> 23) - 127 + 15;
    if (e >= 31) return (unsigned short)(sign | (rz ? 0x7BFFu : 0x7C00u));
    if (e <= 0) {
        /* fp16 subnormals are multiples of 2^-24: scale (exactly) and round to an integer */
        const float q = bit_cast<float>(a) * 16777216.0f;
        const float r = rz ? truncf(q) : nearbyintf(q);
        return (unsigned short)(sign | (unsigned int)r);
    }
    const unsigned int m = a & 0x7FFFFFu;
    unsigned int h = ((unsigned int)e << 10) | (m >> 13);
    const unsigned int rest = m & 0x1FFFu;
    if (!rz && (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))) ++h;  /* a carry is right */
    return (unsigned short)(sign | h);
}
inline float f16_to_f32(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const unsigned int e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {
        const float v = (float)m * (1.0f / 16777216.0f);
        return bit_cast<float>(bit_cast<unsigned int>(v) | sign);
    }
    if (e == 31) return bit_cast<float>(sign | 0x7F800000u | (m << 13));
    return bit_cast<float>(sign | ((e - 15 + 127) << 23) | (m << 13));
}
inline unsigned short f32_to_bf16(float f, bool rz) {
    const unsigned int u = bit_cast<unsigned int>(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
    if (rz) return (unsigned short)(u >> 16);
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
}  // namespace cuda_emu

struct alignas(2) __half {
    unsigned short __x;
    __half() = default;
};
struct alignas(4) __half2 {
    __half x, y;
};
struct alignas(2) __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
};
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
typedef __half half;
typedef __half2 half2;

inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return (short)h.__x; }
inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
inline __half __short_as_half(short s) { __half h; h.__x = (unsigned short)s; return h; }
inline __half __float2half_rn(float f) { return __ushort_as_half(::cuda_emu::f32_to_f16(f, false)); }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __float2half_rz(float f) { return __ushort_as_half(::cuda_emu::f32_to_f16(f, true)); }
inline float __half2float(__half h) { return ::cuda_emu::f16_to_f32(h.__x); }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
inline __half2 __float22half2_rn(float2 f) { return __floats2half2_rn(f.x, f.y); }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
inline bool __hisnan(__half h) { return (h.__x & 0x7FFFu) > 0x7C00u; }
inline int __hisinf(__half h) { return (h.__x & 0x7FFFu) == 0x7C00u ? ((h.__x & 0x8000u) ? -1 : 1) : 0; }

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 h; h.__x = u; return h; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __ushort_as_bfloat16(::cuda_emu::f32_to_bf16(f, false)); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) { return __ushort_as_bfloat16(::cuda_emu::f32_to_bf16(f, true)); }
inline float __bfloat162float(__nv_bfloat16 h) { return ::cuda_emu::bit_cast<float>((unsigned int)h.__x << 16); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }
