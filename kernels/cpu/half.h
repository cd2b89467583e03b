/* Half-precision weight rows for the TBE kernels: fp16/bf16 <-> fp32 and stochastic rounding.
 *
 * A table's weights may be stored in fp16 or bf16 (`wt`, W_*; half the bytes per row): rows are
 * read into fp32 (load_half_row), pooled and updated in fp32, and written back with stochastic
 * rounding (store_half_row): each element goes to one of its two neighbours with the probability
 * that makes the rounding unbiased, from a counter-based hash of (seed, row, column), so the
 * result does not depend on threads or scheduling. tbe.py's sr_* functions mirror these bits in
 * torch. bf16 to nearest (activations) is bf16.h's; fp16 here needs gcc's _Float16 (gcc 12+ on
 * x86), which is why it is apart from bf16.h: the kernels that only need bf16 build without it.
 *
 * Header-only (static inline); native.py hashes it with every source that includes it. */
#ifndef RECC_HALF_H
#define RECC_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "bf16.h"

enum { W_F32 = 0, W_F16 = 1, W_BF16 = 2 };  /* the weights' storage type */

static inline int64_t w_elem_bytes(int wt) { return wt == W_F32 ? 4 : 2; }

static inline float f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}

/* Row `row` of half weights as fp32 into out[D]. fp16 converts with the CPU's vcvtph2ps when
 * the build targets it (gcc does not vectorise _Float16 -> float on its own). */
static inline void load_half_row(const void* weights, int wt, int64_t row, int64_t D, float* restrict out) {
    const uint16_t* restrict h = (const uint16_t*)weights + row * D;
    if (wt == W_F16) {
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= D; d += 16)
            _mm512_storeu_ps(out + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + d))));
#elif defined(__F16C__)
        for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + d))));
#endif
        for (; d < D; ++d) out[d] = f16_to_f32(h[d]);
    } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) out[d] = bf16_to_f32(h[d]);
    }
}

/* The rounding's random bits: a 32-bit key per (seed, row) from splitmix64's finaliser, then per
 * element one xorshift-multiply-xorshift round of key + column * 0x9E3779B9. For a fixed column
 * that is a bijection of the key, so over steps (keys) each element's bits are as uniform as the
 * keys, which is all unbiased rounding needs. One multiply instead of fmix32's two, the
 * column's product a running sum per vector lane and the tiny values' shift below made the fp16
 * write-back 1.7x cheaper (0.41 -> 0.24 ns a value, L1-resident, on an Intel Xeon). */
static inline uint32_t sr_row_key(uint64_t seed, uint64_t row) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (row + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (uint32_t)((z ^ (z >> 31)) >> 32);
}

static inline uint32_t sr_bits(uint32_t key, uint32_t col) {
    uint32_t h = key + col * 0x9E3779B9u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    return h;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SR_VEC16 1
/* sr_bits for 16 consecutive columns: the Weyl term key + column * 0x9E3779B9 of columns
 * d0..d0+15 is carried from one vector to the next as a running sum (sr_weyl16_first, then
 * + sr_weyl16_step), so only the mix multiplies. */
static inline __m512i sr_weyl16_first(uint32_t key) {
    const uint32_t C = 0x9E3779B9u;
    return _mm512_add_epi32(_mm512_set1_epi32((int32_t)key),
                            _mm512_setr_epi32(0, (int32_t)C, (int32_t)(2 * C), (int32_t)(3 * C), (int32_t)(4 * C),
                                              (int32_t)(5 * C), (int32_t)(6 * C), (int32_t)(7 * C),
                                              (int32_t)(8 * C), (int32_t)(9 * C), (int32_t)(10 * C),
                                              (int32_t)(11 * C), (int32_t)(12 * C), (int32_t)(13 * C),
                                              (int32_t)(14 * C), (int32_t)(15 * C)));
}

static inline __m512i sr_weyl16_step(void) { return _mm512_set1_epi32((int32_t)(16u * 0x9E3779B9u)); }

static inline __m512i sr_mix16(__m512i h) {
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int32_t)0x85EBCA6Bu));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
}
#endif

/* fp32 -> bf16, stochastically: adding 16 random bits below the kept ones before truncating
 * rounds up with probability (dropped bits) / 2^16. Inf and NaN are kept as they are; a finite
 * value is never rounded to inf. */
static inline uint16_t f32_to_bf16_sr(float f, uint32_t r) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t v = u + (r & 0xFFFFu);
    const int special = (u & 0x7F800000u) == 0x7F800000u;
    const int over = (v & 0x7F800000u) == 0x7F800000u;
    const uint32_t keep = (u >> 16) | ((special && (u & 0xFFFFu)) ? 0x40u : 0u);
    return (uint16_t)(special || over ? keep : v >> 16);
}

/* fp32 -> fp16 for a value in fp16's normal range (2^-14 <= |f| <= 65504): 13 random bits added
 * below fp16's mantissa, then truncation — the same unbiased rounding as bf16's (computed for
 * every value, used for those). */
static inline uint16_t f32_to_f16_sr_normal(uint32_t u, uint32_t r) {
    const uint32_t v = u + (r & 0x1FFFu);
    const uint32_t e = ((v >> 23) & 0xFFu) - 112u;  /* rebias 127 -> 15 */
    return (uint16_t)(((v >> 16) & 0x8000u) | (e << 10) | ((v >> 13) & 0x3FFu));
}

/* |f| below fp16's normal range (zero and fp16 subnormals, spacing 2^-24): f + copysign(2^-14, f)
 * lies in [2^-14, 2^-13], the first normal binade, whose spacing is the subnormals' 2^-24; it is
 * rounded there as a normal value and 2^-14 (bits 0x0400) taken off again — the same rounding on
 * the same grid, no second formula (an fp32 add rounds below 2^-37: 2^-13 of a unit). */
static inline uint16_t f32_to_f16_sr_tiny(float f, uint32_t r) {
    const float x = f + copysignf(0x1p-14f, f);
    uint32_t ux;
    memcpy(&ux, &x, sizeof ux);
    return (uint16_t)(f32_to_f16_sr_normal(ux, r) - 0x0400u);
}

#ifdef SR_VEC16
/* 16 floats as two 32-byte loads: w was just written by the optimizer's `omp simd` loops, which
 * gcc compiles to 32-byte stores on Intel CPUs (its 256-bit preference), and one 64-byte load of
 * two such stores cannot take their data from the store buffer: it waits for both to reach the
 * cache (15% of the fp16 sgd backward's samples sat on that load). Two halves forward either way. */
static inline __m512 load16_halves(const float* p) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(p))),
                                               _mm256_castps_pd(_mm256_loadu_ps(p + 8)), 1));
}
#endif

/* Row `row` of half weights from fp32 w[D], stochastically rounded (seed, key_row, column):
 * key_row is `row` itself, or the row it stands for (a cache slot's group row). */
static inline void store_half_row(void* weights, int wt, int64_t row, int64_t D, const float* restrict w,
                                  uint64_t seed, int64_t key_row) {
    uint16_t* restrict h16 = (uint16_t*)weights + row * D;
    const uint32_t key = sr_row_key(seed, (uint64_t)key_row);
    int64_t d0 = 0;
    if (wt == W_BF16) {
#ifdef SR_VEC16
        /* 16 at a time: the random bits added, the top halves kept; a lane that is or rounds to
         * inf/NaN (never, in practice) is redone by the scalar rule. */
        const __m512i exp = _mm512_set1_epi32(0x7F800000);
        __m512i weyl = sr_weyl16_first(key);
        for (; d0 + 16 <= D; d0 += 16, weyl = _mm512_add_epi32(weyl, sr_weyl16_step())) {
            const __m512i u = _mm512_castps_si512(load16_halves(w + d0));
            const __m512i v = _mm512_add_epi32(u, _mm512_and_si512(sr_mix16(weyl), _mm512_set1_epi32(0xFFFF)));
            const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, exp), exp) |
                                      _mm512_cmpeq_epi32_mask(_mm512_and_si512(v, exp), exp);
            _mm256_storeu_si256((__m256i*)(h16 + d0), _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
            if (special)
                for (int64_t d = d0; d < d0 + 16; ++d) h16[d] = f32_to_bf16_sr(w[d], sr_bits(key, (uint32_t)d));
        }
#endif
#pragma omp simd
        for (int64_t d = d0; d < D; ++d) h16[d] = f32_to_bf16_sr(w[d], sr_bits(key, (uint32_t)d));
        return;
    }
    int big = 0;
#ifdef SR_VEC16
    /* 16 at a time: a tiny value shifted into the first normal binade (as f32_to_f16_sr_tiny),
     * then every lane as a truncating vcvtps2ph of its bits plus 13 random bits (the scalar
     * code's integer formula), and 0x0400 taken off the tiny lanes. */
    __m512i weyl = sr_weyl16_first(key);
    for (; d0 + 16 <= D; d0 += 16, weyl = _mm512_add_epi32(weyl, sr_weyl16_step())) {
        const __m512 f = load16_halves(w + d0);
        const __m512i u = _mm512_castps_si512(f);
        const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
        const __m512i r = sr_mix16(weyl);
        const __mmask16 is_tiny = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x38800000));
        const __m512 shift = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi32((int32_t)0x80000000u)),
                                                                 _mm512_set1_epi32(0x38800000)));
        const __m512i x = _mm512_castps_si512(_mm512_mask_add_ps(f, is_tiny, f, shift));
        const __m512i v = _mm512_add_epi32(x, _mm512_and_si512(r, _mm512_set1_epi32(0x1FFF)));
        __m256i h = _mm512_cvtps_ph(_mm512_castsi512_ps(v), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        h = _mm256_mask_sub_epi16(h, is_tiny, h, _mm256_set1_epi16(0x0400));
        _mm256_storeu_si256((__m256i*)(h16 + d0), h);
        big |= _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x477FE000)) != 0;
    }
#endif
#pragma omp simd reduction(| : big)
    for (int64_t d = d0; d < D; ++d) {
        uint32_t u;
        memcpy(&u, &w[d], sizeof u);
        const uint32_t a = u & 0x7FFFFFFFu, r = sr_bits(key, (uint32_t)d);
        h16[d] = a < 0x38800000u ? f32_to_f16_sr_tiny(w[d], r) : f32_to_f16_sr_normal(u, r);
        big |= a > 0x477FE000u;
    }
    if (big) {
        /* past 65504, inf, NaN: as a plain conversion (nearest; inf beyond fp16's range) */
        for (int64_t d = 0; d < D; ++d) {
            uint32_t u;
            memcpy(&u, &w[d], sizeof u);
            if ((u & 0x7FFFFFFFu) > 0x477FE000u) {
                const _Float16 x = (_Float16)w[d];
                memcpy(&h16[d], &x, sizeof x);
            }
        }
    }
}

#endif
