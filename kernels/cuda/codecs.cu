/*
 * Wire codecs for the quantized collectives, byte-for-byte the format of recc.kernels.codecs
 * (read its docstring for the layout).  A payload is n fp32 values; its wire is n*2 bytes
 * (fp16, bf16) or, for the block codecs (64 values a block, the last one zero-padded):
 *   int8:      [nb*64 uint8 codes][nb x (fp32 scale, fp32 bias)]
 *   fp8_e4m3 / fp8_e5m2: [nb*64 fp8 codes][nb x fp32 scale]
 * The metadata region starts at byte nb*64, a multiple of 4, so it is read as fp32 in place.
 *
 * Rounding matches torch's CPU casts exactly: fp16/bf16/fp8 round to nearest even (fp16 NaN
 * is 0x7E00 with the sign kept, bf16 NaN is 0x7FC0, like c10); the int8/fp8 arithmetic uses
 * explicitly rounded intrinsics (__fsub_rn, __fdiv_rn, __fmul_rn, __fadd_rn) so nvcc cannot
 * contract it into FMAs that torch does not use.  min/max/amax propagate NaN like torch's
 * amin/amax, and a block holding any non-finite value gets a NaN scale (and bias), so it
 * decodes to NaN.
 *
 * The conversions are __host__ __device__ so a host-only test can compare them with torch
 * on the CPU.  One warp encodes one block (two values per lane); decoding is one thread per
 * value.
 */
#include <cuda_fp16.h>

typedef long long i64;

#define BLOCK 64

__host__ __device__ inline unsigned int f32_bits(float x) {
    union { float f; unsigned int u; } c; c.f = x; return c.u;
}
__host__ __device__ inline float bits_f32(unsigned int u) {
    union { float f; unsigned int u; } c; c.u = u; return c.f;
}
__host__ __device__ inline bool f32_isnan(float x) { return (f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
__host__ __device__ inline bool f32_isfinite(float x) { return (f32_bits(x) & 0x7F800000u) != 0x7F800000u; }
__host__ __device__ inline float nan_min(float a, float b) { return f32_isnan(a) || a < b ? a : b; }
__host__ __device__ inline float nan_max(float a, float b) { return f32_isnan(a) || a > b ? a : b; }

/* ------------------------------------------------------------------ fp16 / bf16 */

__host__ __device__ inline unsigned short f32_to_f16_bits(float x) {
    if (f32_isnan(x)) return (unsigned short)(((f32_bits(x) >> 16) & 0x8000u) | 0x7E00u);
    return __half_as_ushort(__float2half_rn(x));
}
__host__ __device__ inline float f16_bits_to_f32(unsigned short h) {
    return __half2float(__ushort_as_half(h));
}
__host__ __device__ inline unsigned short f32_to_bf16_bits(float x) {
    if (f32_isnan(x)) return 0x7FC0u;
    const unsigned int u = f32_bits(x);
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__host__ __device__ inline float bf16_bits_to_f32(unsigned short h) {
    return bits_f32((unsigned int)h << 16);
}

/* ------------------------------------------------------------------ fp8 */

/* Round-to-nearest-even of a finite |x| <= the format's max (the callers clamp) into an fp8
 * code with EBITS exponent bits, MBITS mantissa bits and exponent bias BIAS. */
template <int MBITS, int BIAS>
__host__ __device__ inline unsigned char f32_to_fp8(float x) {
    const unsigned int u = f32_bits(x);
    const unsigned char sign = (unsigned char)((u >> 24) & 0x80u);
    const unsigned int a = u & 0x7FFFFFFFu;
    const int e = (int)(a >> 23) - 127;
    const int min_normal = 1 - BIAS;
    if (e < min_normal) {
        /* subnormal in fp8 (or zero): a multiple of 2^(min_normal - MBITS), RNE; a carry to
         * 1 << MBITS is exactly the smallest normal's code */
        if (e < min_normal - MBITS - 2) return sign;  /* below half the smallest subnormal */
        const int shift = min_normal - MBITS;                  /* quantum = 2^shift */
        const unsigned int mant = (a & 0x7FFFFFu) | 0x800000u;  /* value = mant * 2^(e-23) */
        const int drop = shift - (e - 23);                     /* bits below the quantum */
        const unsigned int q = mant >> drop;
        const unsigned int rest = mant & ((1u << drop) - 1u);
        const unsigned int half = 1u << (drop - 1);
        const unsigned int r = q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u);
        return (unsigned char)(sign | r);
    }
    const int drop = 23 - MBITS;
    unsigned int r = a + ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u);
    r >>= drop;
    r -= (unsigned int)(127 - BIAS) << MBITS;
    return (unsigned char)(sign | r);
}

template <int MBITS, int BIAS>
__host__ __device__ inline float fp8_to_f32(unsigned char c) {
    const unsigned int sign = (unsigned int)(c & 0x80u) << 24;
    const int e = (c & 0x7F) >> MBITS;
    const unsigned int m = c & ((1u << MBITS) - 1u);
    float v;
    if (e == 0) {
        v = (float)m * bits_f32((unsigned int)(127 + 1 - BIAS - MBITS) << 23);
    } else {
        v = bits_f32(((unsigned int)(e - BIAS + 127) << 23) | (m << (23 - MBITS)));
    }
    return bits_f32(f32_bits(v) | sign);
}

/* e4m3fn has no infinities; its only NaNs are S.1111.111, which a clamped finite input never
 * produces.  e5m2's Inf/NaN codes (exponent 31) decode as such. */
__host__ __device__ inline float e4m3_to_f32(unsigned char c) {
    if ((c & 0x7F) == 0x7F) return bits_f32(0x7FC00000u);
    return fp8_to_f32<3, 7>(c);
}
__host__ __device__ inline float e5m2_to_f32(unsigned char c) {
    if ((c & 0x7C) == 0x7C) {
        const unsigned int sign = (unsigned int)(c & 0x80u) << 24;
        return bits_f32(sign | ((c & 0x03) ? 0x7FC00000u : 0x7F800000u));
    }
    return fp8_to_f32<2, 15>(c);
}

/* ------------------------------------------------------------------ elementwise codecs */

extern "C" __global__ void encode_fp16(const float* __restrict__ x, i64 n,
                                       unsigned short* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_f16_bits(x[i]);
}
extern "C" __global__ void decode_fp16(const unsigned short* __restrict__ w, i64 n,
                                       float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f16_bits_to_f32(w[i]);
}
extern "C" __global__ void encode_bf16(const float* __restrict__ x, i64 n,
                                       unsigned short* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16_bits(x[i]);
}
extern "C" __global__ void decode_bf16(const unsigned short* __restrict__ w, i64 n,
                                       float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = bf16_bits_to_f32(w[i]);
}

/* ------------------------------------------------------------------ block codecs */

struct BlockStats { float lo, hi, amax; bool finite; };

/* One warp, one block: lane l holds values l and l+32 (padding reads as 0). */
__device__ inline BlockStats block_stats(float a, float b) {
    BlockStats s;
    s.lo = nan_min(a, b);
    s.hi = nan_max(a, b);
    s.amax = nan_max(fabsf(a), fabsf(b));
    int finite = f32_isfinite(a) && f32_isfinite(b);
    for (int off = 16; off > 0; off >>= 1) {
        s.lo = nan_min(s.lo, __shfl_xor_sync(0xFFFFFFFFu, s.lo, off));
        s.hi = nan_max(s.hi, __shfl_xor_sync(0xFFFFFFFFu, s.hi, off));
        s.amax = nan_max(s.amax, __shfl_xor_sync(0xFFFFFFFFu, s.amax, off));
    }
    s.finite = __all_sync(0xFFFFFFFFu, finite) != 0;
    return s;
}

/* torch: codes = clamp(round((x - lo) / scale), 0, 255), NaN -> 0 */
__host__ __device__ inline unsigned char int8_code(float x, float lo, float scale) {
#ifdef __CUDA_ARCH__
    const float v = rintf(__fdiv_rn(__fsub_rn(x, lo), scale));
#else
    const float v = rintf((x - lo) / scale);
#endif
    if (f32_isnan(v)) return 0;
    return (unsigned char)(v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v));
}

extern "C" __global__ void encode_int8(const float* __restrict__ x, i64 n, i64 nb,
                                       unsigned char* __restrict__ wire) {
    const i64 blk = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (blk >= nb) return;  /* whole warps exit together: blockDim is a multiple of 32 */
    const i64 i0 = blk * BLOCK + lane, i1 = i0 + 32;
    const float a = i0 < n ? x[i0] : 0.0f, b = i1 < n ? x[i1] : 0.0f;
    const BlockStats s = block_stats(a, b);
    const float range = __fsub_rn(s.hi, s.lo);
    const float scale = s.hi > s.lo ? __fdiv_rn(range, 255.0f) : 1.0f;
    /* A range that overflows fp32 has no representable scale: sent as NaN, like NaN/Inf. */
    const int ok = s.finite && f32_isfinite(range);
    wire[i0] = int8_code(a, s.lo, scale);
    wire[i1] = int8_code(b, s.lo, scale);
    if (lane == 0) {
        float* meta = reinterpret_cast<float*>(wire + nb * BLOCK);
        const float nan = bits_f32(0x7FC00000u);
        meta[2 * blk] = ok ? scale : nan;
        meta[2 * blk + 1] = ok ? s.lo : nan;
    }
}

extern "C" __global__ void decode_int8(const unsigned char* __restrict__ wire, i64 n, i64 nb,
                                       float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float* meta = reinterpret_cast<const float*>(wire + nb * BLOCK);
    const i64 blk = i / BLOCK;
    out[i] = __fadd_rn(__fmul_rn((float)wire[i], meta[2 * blk]), meta[2 * blk + 1]);
}

/* torch: q = clamp(x / scale, -fmax, fmax), NaN -> 0, then the fp8 cast (RNE) */
template <int MBITS, int BIAS>
__host__ __device__ inline unsigned char fp8_code(float x, float scale, float fmax) {
#ifdef __CUDA_ARCH__
    float q = __fdiv_rn(x, scale);
#else
    float q = x / scale;
#endif
    if (f32_isnan(q)) return 0;
    q = q < -fmax ? -fmax : (q > fmax ? fmax : q);
    return f32_to_fp8<MBITS, BIAS>(q);
}

template <int MBITS, int BIAS>
__device__ inline void encode_fp8_body(const float* __restrict__ x, i64 n, i64 nb,
                                       unsigned char* __restrict__ wire, float fmax) {
    const i64 blk = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (blk >= nb) return;
    const i64 i0 = blk * BLOCK + lane, i1 = i0 + 32;
    const float a = i0 < n ? x[i0] : 0.0f, b = i1 < n ? x[i1] : 0.0f;
    const BlockStats s = block_stats(a, b);
    const float scale = s.amax > 0.0f ? __fdiv_rn(s.amax, fmax) : 1.0f;
    wire[i0] = fp8_code<MBITS, BIAS>(a, scale, fmax);
    wire[i1] = fp8_code<MBITS, BIAS>(b, scale, fmax);
    if (lane == 0) {
        float* meta = reinterpret_cast<float*>(wire + nb * BLOCK);
        meta[blk] = s.finite ? scale : bits_f32(0x7FC00000u);
    }
}

extern "C" __global__ void encode_fp8_e4m3(const float* x, i64 n, i64 nb, unsigned char* wire) {
    encode_fp8_body<3, 7>(x, n, nb, wire, 448.0f);
}
extern "C" __global__ void encode_fp8_e5m2(const float* x, i64 n, i64 nb, unsigned char* wire) {
    encode_fp8_body<2, 15>(x, n, nb, wire, 57344.0f);
}

extern "C" __global__ void decode_fp8_e4m3(const unsigned char* __restrict__ wire, i64 n, i64 nb,
                                           float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float* meta = reinterpret_cast<const float*>(wire + nb * BLOCK);
    out[i] = __fmul_rn(e4m3_to_f32(wire[i]), meta[i / BLOCK]);
}
extern "C" __global__ void decode_fp8_e5m2(const unsigned char* __restrict__ wire, i64 n, i64 nb,
                                           float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float* meta = reinterpret_cast<const float*>(wire + nb * BLOCK);
    out[i] = __fmul_rn(e5m2_to_f32(wire[i]), meta[i / BLOCK]);
}
