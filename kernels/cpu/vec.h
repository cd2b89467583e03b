/* 16 floats as one value, for the CPU kernels' register accumulators (the TBE kernels' row sums,
 * interaction.c's micro-tiles), and bf16 16 lanes at a time.
 *
 * With AVX-512 (F, BW, VL: every AVX-512 CPU but Xeon Phi) a v16f is one zmm register and
 * fma16 a fused multiply-add (one rounding instead of two). Without it, a v16f is two GNU C
 * vectors of 8 floats (one AVX2 register each: gcc spills a single 16-float GNU vector to the
 * stack on AVX2) and fma16 a separate multiply and add; add16, mul16 and div16 round as the
 * scalar operators do on every path. Loads and stores are unaligned: a 64-byte GNU vector loaded
 * with memcpy compiled, under gcc's 256-bit preference on Intel CPUs (-march=native on a Xeon),
 * to two 32-byte loads stored to the stack and reloaded as one zmm — a store-forwarding stall per
 * vector (70% of the fp32 TBE forward's time at small's shape; interaction's direct path ran at a
 * tenth of its speed); the intrinsics load one zmm.
 *
 * The bf16 lanes round as bf16.h's f32_to_bf16, bit for bit (to nearest even with integer adds,
 * a NaN kept a quiet NaN): vcvtneps2bf16 would flush denormals.
 *
 * Header-only (static inline); native.py hashes it with every source that includes it. */
#ifndef RECC_VEC_H
#define RECC_VEC_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RECC_AVX512 1
#include <immintrin.h>
#endif

#include "bf16.h"

#ifdef RECC_AVX512
typedef __m512 v16f;
static inline v16f load16(const float *p) { return _mm512_loadu_ps(p); }
static inline void store16(float *p, v16f x) { _mm512_storeu_ps(p, x); }
static inline v16f splat16(float a) { return _mm512_set1_ps(a); }
static inline v16f add16(v16f a, v16f b) { return _mm512_add_ps(a, b); }
static inline v16f mul16(v16f a, v16f b) { return _mm512_mul_ps(a, b); }
static inline v16f div16(v16f a, v16f b) { return _mm512_div_ps(a, b); }
static inline v16f fma16(v16f a, v16f b, v16f c) { return _mm512_fmadd_ps(a, b, c); }

/* 16 bf16 -> fp32: a shift. */
static inline __m512 widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 fp32 -> bf16 (in the low half of each lane) exactly as f32_to_bf16: round to nearest even
 * with integer adds, NaN -> its top half with the quiet bit set. */
static inline __m512i narrow16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x), t = _mm512_srli_epi32(u, 16);
    const __m512i odd = _mm512_and_si512(t, _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), t, _mm512_set1_epi32(0x40));
}

static inline v16f load16_bf16(const uint16_t *p) { return widen16(_mm256_loadu_si256((const __m256i *)p)); }

static inline void store16_bf16(uint16_t *p, v16f x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(narrow16(x)));
}
#else
typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef struct {
    v8f lo, hi;
} v16f;
static inline v16f load16(const float *p) {
    v16f x;
    memcpy(&x.lo, p, sizeof x.lo);
    memcpy(&x.hi, p + 8, sizeof x.hi);
    return x;
}
static inline void store16(float *p, v16f x) {
    memcpy(p, &x.lo, sizeof x.lo);
    memcpy(p + 8, &x.hi, sizeof x.hi);
}
static inline v16f splat16(float a) {
    const v8f s = {a, a, a, a, a, a, a, a};
    return (v16f){s, s};
}
static inline v16f add16(v16f a, v16f b) { return (v16f){a.lo + b.lo, a.hi + b.hi}; }
static inline v16f mul16(v16f a, v16f b) { return (v16f){a.lo * b.lo, a.hi * b.hi}; }
static inline v16f div16(v16f a, v16f b) { return (v16f){a.lo / b.lo, a.hi / b.hi}; }
static inline v16f fma16(v16f a, v16f b, v16f c) { return (v16f){a.lo * b.lo + c.lo, a.hi * b.hi + c.hi}; }

typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* The bf16 lanes as GNU C vector code, 8 at a time (no v8f is passed or returned by value:
 * without AVX that changes the ABI, and gcc warns). */
static inline v16f load16_bf16(const uint16_t *p) {
    v16f x;
    for (int k = 0; k < 2; ++k) {
        v8h h;
        memcpy(&h, p + 8 * k, sizeof h);
        const v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(k ? &x.hi : &x.lo, &u, sizeof u);
    }
    return x;
}

static inline void store16_bf16(uint16_t *p, v16f x) {
    for (int k = 0; k < 2; ++k) {
        v8u u;
        memcpy(&u, k ? &x.hi : &x.lo, sizeof u);
        const v8i nan = (v8i)((u & 0x7fffffffu) > 0x7f800000u);
        const v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const v8u quiet = (u >> 16) | 0x40u;
        const v8h h = __builtin_convertvector((rounded & ~(v8u)nan) | (quiet & (v8u)nan), v8h);
        memcpy(p + 8 * k, &h, sizeof h);
    }
}
#endif

#endif
