/*
 * CPU kernels for one table-batched embedding (TBE) group: T tables sharing an embedding
 * dim D, stored as one concatenated fp32 weight [R, D].  Plain C + OpenMP (GNU C vector
 * extensions for the row accumulators), no torch headers; tbe.py compiles this at first use
 * and calls it through ctypes with raw data pointers of contiguous tensors.
 *
 * Layout (FBGEMM's names): `lin` holds linearized row ids (local id + hash_size_cumsum[t]),
 * `offsets` has T*B+1 entries and is feature-major (bag j = t*B + b), `go`/`out` are
 * batch-major [B, T*D] (D_offsets[t] = t*D).
 *
 * Forward (recc_tbe_forward): each bag sums its rows in index order straight into [B, T*D].
 *
 * Backward + fused optimizer (recc_tbe_backward_update; "exact": duplicate ids summed, each
 * row updated once), O(N), no sort:
 *  - One pass checks every id is in [0, R) and finds each table's row interval, before any
 *    write.  When the tables' intervals are disjoint (always, for validated + linearized
 *    ids) each table is a work unit; big tables are split into parts by a hash of row/16, a
 *    part keeping only its rows.  Otherwise (a caller mixing tables' rows) the whole batch is
 *    split by that hash.  Every row therefore belongs to exactly one unit, so units run in
 *    parallel without atomics or races.
 *  - A unit gives each of its rows a compact first-seen slot through a persistent int32 slot
 *    map (all -1 between calls; only touched entries are reset), counting-sorts its ids by
 *    slot (stable: a row's ids stay in index order), then reduces each row's gradient in a
 *    register accumulator and applies the optimizer once.  A row's sum order is the index
 *    order whatever the thread count or unit split: results are deterministic.
 *
 * Weights may be stored in fp16 or bf16 (`wt`, half the bytes per row): rows are read into
 * fp32, pooled and updated in fp32 (the optimizer state is fp32), and written back with
 * stochastic rounding — each element goes to one of its two neighbours with the probability
 * that makes the rounding unbiased, from a counter-based hash of (seed, row, column), so the
 * result does not depend on threads or scheduling. `key_rows` (optional, [R]) names the row
 * whose number keys a weight row's bits: a cached group's weights hold slots, and
 * key_rows[slot] (its cache's slot -> group row map) makes a slot round like the group row it
 * holds, so cached training rounds exactly as all-resident training does.
 *
 * Compiled with -std=c11, so gcc does not contract a*b+c into FMAs: the arithmetic is the
 * same as the pure-torch reference's up to summation order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "bf16.h"

enum { OPT_SGD = 0, OPT_ROWWISE_ADAGRAD = 1, OPT_ADAGRAD = 2, OPT_ADAM = 3 };
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

/* Exported for the tests: fp32 -> half of n values with the kernels' stochastic rounding, as
 * if they were row 0 of a table of n columns updated under `seed`. */
int recc_round_half_sr(const float* in, int64_t n, int wt, uint64_t seed, uint16_t* out) {
    if (wt != W_F16 && wt != W_BF16) return 3;
    store_half_row(out, wt, 0, n, in, seed, 0);
    return 0;
}

enum {
    RC_OK = 0,
    RC_BAD_ID = 1,     /* an id outside [0, R): nothing was written */
    RC_NO_MEMORY = 2,  /* nothing was written */
    RC_BAD_ARGS = 3,
};

#ifndef ROW_PREFETCH
#define ROW_PREFETCH 8   /* rows ahead: weight/state rows, backward apply loop */
#endif
#ifndef GO_PREFETCH
#define GO_PREFETCH 4    /* rows ahead: grad_output rows, backward apply loop */
#endif
#ifndef ID_PREFETCH
/* ids ahead, forward pooling. 48 rather than 24: on the 2-vCPU Xeon (small's shape, 8 x 100k x 64,
 * tables in the L3) the fp16 forward went ~1.15 -> ~1.0 ms and the fp16 embedding-only step ~8%
 * faster; fp32 rows and kaggle's D = 16 (one line per row) were unchanged. */
#define ID_PREFETCH 48
#endif
#define MAX_REG_D 256    /* row accumulators up to this D live on the stack */

static inline void prefetch_span(const void* p, int64_t bytes, int rw) {
    const char* c = (const char*)p;
    for (int64_t o = 0; o < bytes; o += 64) {
        if (rw) __builtin_prefetch(c + o, 1, 3);
        else __builtin_prefetch(c + o, 0, 3);
    }
}

/* Which of `parts` parts a row belongs to: a multiplicative hash of row/16, range-reduced. */
static inline uint32_t row_part(int64_t row, uint32_t parts) {
    const uint32_t h = (uint32_t)(((uint64_t)row >> 4) * 0x9E3779B97F4A7C15ull >> 32);
    return (uint32_t)(((uint64_t)h * parts) >> 32);
}

/* ------------------------------------------------------------------ per-thread workspace */

typedef struct {
    int32_t slot;
    int32_t go_row; /* b * T + t: row of grad_output viewed as [B*T, D] */
    float scale;    /* per-sample weight, divided by the bag length for mean pooling */
} pending_t;

typedef struct {
    int32_t go_row;
    float scale;
} contrib_t;

/* One entry of a unit's row -> slot map; stale entries (an older gen) read as empty, so the
 * map is never cleared between units. */
typedef struct {
    int64_t row;
    int32_t slot;
    uint32_t gen;
} slot_entry_t;

typedef struct {
    pending_t* pend;
    contrib_t* contrib;
    int64_t* urows;
    int32_t* ends;
    float* acc;
    slot_entry_t* hmap; /* open-addressing map row -> slot over one unit's rows */
    uint32_t gen;       /* an entry belongs to the current unit iff its gen is this */
    size_t cap, dcap, hcap;
} workspace_t;

/* Grow-only and per OS thread: OpenMP teams of concurrent callers never share one, and
 * steady-state calls take no page faults. */
static __thread workspace_t tls_ws;

static int ws_reserve(workspace_t* ws, size_t n, size_t D, int hashed) {
    if (n > ws->cap) {
        size_t cap = n + n / 4 + 1024;
        free(ws->pend);
        free(ws->contrib);
        free(ws->urows);
        free(ws->ends);
        ws->pend = malloc(cap * sizeof(pending_t));
        ws->contrib = malloc(cap * sizeof(contrib_t));
        ws->urows = malloc(cap * sizeof(int64_t));
        ws->ends = malloc(cap * sizeof(int32_t));
        if (!ws->pend || !ws->contrib || !ws->urows || !ws->ends) {
            free(ws->pend);
            free(ws->contrib);
            free(ws->urows);
            free(ws->ends);
            ws->pend = NULL;
            ws->contrib = NULL;
            ws->urows = NULL;
            ws->ends = NULL;
            ws->cap = 0;
            return 0;
        }
        ws->cap = cap;
    }
    /* The row -> slot map holds at most n rows at load <= 1/2: memory per unit's ids, not
     * per weight row (a per-row map would cost 4 bytes for every row of every table). */
    size_t h = 16;
    while (h < 2 * n) h <<= 1;
    if (hashed && h > ws->hcap) {
        free(ws->hmap);
        ws->hmap = calloc(h, sizeof(slot_entry_t));  /* gen 0: never a live unit's */
        ws->gen = 0;
        if (!ws->hmap) {
            ws->hcap = 0;
            return 0;
        }
        ws->hcap = h;
    }
    if (D > ws->dcap) {
        free(ws->acc);
        ws->acc = aligned_alloc(64, (D * sizeof(float) + 63) / 64 * 64);
        if (!ws->acc) {
            ws->dcap = 0;  /* acc is NULL: the next call retries */
            return 0;
        }
        ws->dcap = D;
    }
    return 1;
}

/* ------------------------------------------------------------------ backward */

typedef struct {
    void* weights;  /* [R, D] of fp32, fp16 or bf16 (wt) */
    int wt;
    uint64_t seed;  /* keys the stochastic rounding of half weights */
    int64_t R, D;
    float* m1;
    float* m2;
    const int64_t* lin;
    const int64_t* offsets;
    int64_t T, B;
    const void* go;  /* [B, T*D] of fp32, or bf16 (go_bf16: a bf16 consumer's gradient, read as is) */
    int go_bf16;
    const float* psw;
    int mean, optimizer;
    float grad_scale; /* every id's gradient is multiplied by it (the loss's 1/world share) */
    float lr, eps, beta1, beta2, wd, bc1, bc2;
    int decoupled; /* weight decay: 0 L2 (wd * w added to g), 1 decoupled (w *= 1 - lr * wd, AdamW) */
    int32_t* slot_map; /* [R] row -> slot, all -1 between calls; NULL: each unit hashes its rows */
    const int64_t* key_rows; /* [R] the row number keying each row's rounding; NULL: the row itself */
} bwd_t;

typedef struct {
    int64_t bag_lo, bag_hi; /* bags [bag_lo, bag_hi) of the feature-major offsets */
    int64_t ids;            /* ids in those bags, for scheduling big units first */
    uint32_t parts, part;   /* keep rows with row_part(row, parts) == part */
} unit_t;

static inline __attribute__((always_inline)) void apply_row(const bwd_t* c, int64_t row,
                                                            float* restrict w, float* restrict g,
                                                            const int64_t D) {
    const float lr = c->lr, eps = c->eps, wd = c->wd;
    if (wd != 0.0f && !c->decoupled) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) g[d] += wd * w[d];
    } else if (wd != 0.0f) {
        /* Decoupled (FBGEMM's DECOUPLE, torch's AdamW): the decay shrinks the weight apart from
         * the gradient and the optimizer state; the update below then reads the shrunk row. */
        const float keep = 1.0f - lr * wd;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) w[d] *= keep;
    }
    switch (c->optimizer) {
    case OPT_SGD:
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) w[d] -= lr * g[d];
        break;
    case OPT_ROWWISE_ADAGRAD: {
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t d = 0; d < D; ++d) sq += g[d] * g[d];
        const float m = c->m1[row] + sq / (float)D;
        c->m1[row] = m;
        const float mult = lr / (sqrtf(m) + eps);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) w[d] -= mult * g[d];
        break;
    }
    case OPT_ADAGRAD: {
        float* restrict s = c->m1 + row * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
            const float sd = s[d] + g[d] * g[d];
            s[d] = sd;
            w[d] -= lr * g[d] / (sqrtf(sd) + eps);
        }
        break;
    }
    case OPT_ADAM: {
        float* restrict m = c->m1 + row * D;
        float* restrict v = c->m2 + row * D;
        const float b1 = c->beta1, b2 = c->beta2, bc1 = c->bc1, bc2 = c->bc2;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
            const float md = b1 * m[d] + (1.0f - b1) * g[d];
            const float vd = b2 * v[d] + (1.0f - b2) * g[d] * g[d];
            m[d] = md;
            v[d] = vd;
            w[d] -= lr * (md / bc1) / (sqrtf(vd / bc2) + eps);
        }
        break;
    }
    }
}

/* Row accumulator: D/16 vectors of 16 floats kept in registers when D is a multiple of 16
 * and at most 16*MAX_VECS (GNU C vector extensions; plain loops otherwise). */
#define MAX_VECS 16
typedef float v16f __attribute__((vector_size(64), aligned(4)));

/* With AVX-512, one unaligned zmm load or store. The memcpy form compiles, under gcc's 256-bit
 * preference on Intel CPUs (-march=native on a Xeon), to two ymm loads stored to the stack and
 * reloaded as one zmm: a store-forwarding stall per vector, 70% of the fp32 forward's time at
 * small's shape (perf annotate; forward 4.2 -> 1.x ms on a 2-vCPU Xeon, where torch's
 * embedding_bag took 1.7). */
static inline v16f load16(const float* p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_loadu_ps(p);
#else
    v16f v;
    memcpy(&v, p, sizeof(v));
    return v;
#endif
}

static inline void store16(float* p, v16f v) {
#if defined(__AVX512F__)
    _mm512_storeu_ps(p, (__m512)v);
#else
    memcpy(p, &v, sizeof(v));
#endif
}

/* bf16 <-> fp32 for whole vectors: a bf16 is the top half of an fp32; rounding to nearest even,
 * a NaN kept a quiet NaN (element for element as bf16.h's scalar f32_to_bf16). */
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

static inline v16f load16_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
    /* One widening load (vpmovzxwd zmm): the generic form below compiles, under a 256-bit
     * preference, to two halves and an insert per vector, 15% of a D = 64 update. */
    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    v16f v;
    memcpy(&v, &w, sizeof(v));
    return v;
#else
    v16h h;
    memcpy(&h, p, sizeof(h));
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f v;
    memcpy(&v, &u, sizeof(v));
    return v;
#endif
}

/* 16 fp16 (wt W_F16, one vcvtph2ps) or bf16 values as fp32. */
static inline v16f load16_half(const uint16_t* p, int wt) {
    if (wt == W_BF16) return load16_bf16(p);
    v16f v;
#if defined(__AVX512F__)
    const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
    memcpy(&v, &w, sizeof(v));
#else
    float f[16];
    load_half_row(p, W_F16, 0, 16, f);
    memcpy(&v, f, sizeof(v));
#endif
    return v;
}

/* Values 16v..16v+15 of weight row `row` as fp32, whatever the storage type: half rows are
 * widened in registers (no fp32 copy of the row). */
static inline v16f load16_row(const void* weights, int wt, int64_t row, int64_t D, int64_t v) {
    if (wt == W_F32) return load16((const float*)weights + row * D + 16 * v);
    return load16_half((const uint16_t*)weights + row * D + 16 * v, wt);
}

static inline void store16_bf16(uint16_t* p, v16f v) {
    v16u u;
    memcpy(&u, &v, sizeof(u));
    const v16i nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v16u quiet = (u >> 16) | 0x40u;
    const v16h h = __builtin_convertvector((rounded & ~(v16u)nan) | (quiet & (v16u)nan), v16h);
    memcpy(p, &h, sizeof(h));
}

#define SLOT_PREFETCH 32 /* ids ahead: their row -> slot map entries */

/* Fibonacci hashing of a row into a map of 2^(64 - shift) entries. */
static inline uint64_t slot_hash(int64_t row, int shift) {
    return ((uint64_t)row * 0x9E3779B97F4A7C15ull) >> shift;
}

static inline __attribute__((always_inline)) void process_unit(const bwd_t* c,
                                                               const unit_t* u,
                                                               workspace_t* ws,
                                                               const int64_t D) {
    const int64_t T = c->T, B = c->B;
    const int64_t* restrict lin = c->lin;
    const int64_t* restrict offsets = c->offsets;
    const float* restrict psw = c->psw;
    const int mean = c->mean;
    const float gs = c->grad_scale;
    const uint32_t parts = u->parts, part = u->part;
    pending_t* restrict pend = ws->pend;
    contrib_t* restrict contrib = ws->contrib;
    int64_t* restrict urows = ws->urows;
    int32_t* restrict ends = ws->ends;
    const int64_t i_lo = offsets[u->bag_lo], i_hi = offsets[u->bag_hi];
    memset(ends, 0, (size_t)(i_hi - i_lo) * sizeof(int32_t));
    /* The unit's row -> slot map: the smallest power of two >= twice its ids (load <= 1/2). */
    int hbits = 4;
    while (((int64_t)1 << hbits) < 2 * (i_hi - i_lo)) ++hbits;
    const uint64_t hmask = ((uint64_t)1 << hbits) - 1;
    const int hshift = 64 - hbits;
    int32_t* restrict slot_map = c->slot_map;
    slot_entry_t* restrict hmap = ws->hmap;
    if (!slot_map && ++ws->gen == 0) {  /* wrapped: every entry would look live again */
        memset(hmap, 0, ws->hcap * sizeof(slot_entry_t));
        ws->gen = 1;
    }
    const uint32_t gen = ws->gen;

    /* 1. First-seen slots for the unit's rows; count each slot's ids. */
    int64_t n = 0, U = 0;
    /* Bag j = t*B + b, advanced without a 64-bit division per bag (for one-id bags of a small
     * dim that division was a large share of the pass). */
    int64_t t = u->bag_lo / B, b = u->bag_lo - (u->bag_lo / B) * B;
    for (int64_t j = u->bag_lo; j < u->bag_hi; ++j, ++b) {
        if (b == B) {
            b = 0;
            ++t;
        }
        const int32_t go_row = (int32_t)(b * T + t);
        const int64_t lo = offsets[j], hi = offsets[j + 1];
        const float inv_len = (mean && hi > lo) ? gs / (float)(hi - lo) : gs;
        for (int64_t i = lo; i < hi; ++i) {
            if (i + SLOT_PREFETCH < i_hi) {
                const int64_t ahead = lin[i + SLOT_PREFETCH];
                __builtin_prefetch(slot_map ? (const void*)(slot_map + ahead)
                                            : (const void*)(hmap + slot_hash(ahead, hshift)), 1, 3);
            }
            const int64_t row = lin[i];
            if (parts > 1 && row_part(row, parts) != part) continue;
            int is_new;
            int32_t s;
            if (slot_map) {
                s = slot_map[row];
                is_new = s < 0;
                s = is_new ? (int32_t)U : s;
                slot_map[row] = s;
            } else {
                /* Linear probing: the map is at most half full. */
                uint64_t h = slot_hash(row, hshift);
                while (hmap[h].gen == gen && hmap[h].row != row) h = (h + 1) & hmask;
                is_new = hmap[h].gen != gen;
                if (is_new) {
                    hmap[h].row = row;
                    hmap[h].slot = (int32_t)U;
                    hmap[h].gen = gen;
                }
                s = hmap[h].slot;
            }
            urows[U] = row;
            U += is_new;
            ends[s] += 1;
            pend[n].slot = s;
            pend[n].go_row = go_row;
            pend[n].scale = psw ? psw[i] * inv_len : inv_len;
            ++n;
        }
    }
    /* 2. Stable counting sort by slot: each row's ids stay in index order. */
    int32_t run = 0;
    for (int64_t s = 0; s < U; ++s) {
        const int32_t cnt = ends[s];
        ends[s] = run;
        run += cnt;
    }
    for (int64_t k = 0; k < n; ++k) {
        const int32_t pos = ends[pend[k].slot]++;
        contrib[pos].go_row = pend[k].go_row;
        contrib[pos].scale = pend[k].scale;
    }
    /* 3. Reduce each row's gradient, update the row once, reset its slot.  Rows come in
     *    first-seen (random) order: prefetch the weight/state rows and grad_output rows of
     *    the rows a few slots ahead. */
    const int vec = D % 16 == 0 && D / 16 <= MAX_VECS;
    const int64_t NV = D / 16;
    float acc_stack[D <= MAX_REG_D ? D : 1] __attribute__((aligned(64)));
    float* restrict acc = D <= MAX_REG_D ? acc_stack : ws->acc;
    const int64_t w_bytes = D * w_elem_bytes(c->wt);
    float wtmp[c->wt == W_F32 ? 1 : D] __attribute__((aligned(64)));  /* a half row, in fp32 */
    const int64_t m1_bytes = c->optimizer == OPT_ROWWISE_ADAGRAD ? 4
                             : c->optimizer == OPT_SGD             ? 0
                                                                   : D * 4;
    const int64_t m1_stride = c->optimizer == OPT_ROWWISE_ADAGRAD ? 1 : D;
    const int has_m2 = c->optimizer == OPT_ADAM;
    const char* restrict go = (const char*)c->go;
    const int gbf = c->go_bf16;
    const int64_t go_bytes = D * (gbf ? 2 : 4);  /* one bag's gradient row */
    int32_t begin = 0;
    for (int64_t s = 0; s < U; ++s) {
        if (s + ROW_PREFETCH < U) {
            const int64_t prow = urows[s + ROW_PREFETCH];
            prefetch_span((const char*)c->weights + prow * w_bytes, w_bytes, 1);
            if (m1_bytes) prefetch_span(c->m1 + prow * m1_stride, m1_bytes, 1);
            if (has_m2) prefetch_span(c->m2 + prow * D, D * 4, 1);
        }
        if (s + GO_PREFETCH < U) {
            const int32_t p0 = ends[s + GO_PREFETCH - 1], p1 = ends[s + GO_PREFETCH];
            for (int32_t p = p0; p < p1 && p < p0 + 4; ++p)
                prefetch_span(go + (int64_t)contrib[p].go_row * go_bytes, go_bytes, 0);
        }
        const int32_t end = ends[s];
        if (vec && gbf) {
            v16f a[MAX_VECS];
            {
                const contrib_t e = contrib[begin];
                const uint16_t* gr = (const uint16_t*)(go + (int64_t)e.go_row * go_bytes);
                for (int64_t v = 0; v < NV; ++v) a[v] = load16_bf16(gr + 16 * v) * e.scale;
            }
            for (int32_t p = begin + 1; p < end; ++p) {
                const contrib_t e = contrib[p];
                const uint16_t* gr = (const uint16_t*)(go + (int64_t)e.go_row * go_bytes);
                for (int64_t v = 0; v < NV; ++v) a[v] += load16_bf16(gr + 16 * v) * e.scale;
            }
            for (int64_t v = 0; v < NV; ++v) store16(acc + 16 * v, a[v]);
        } else if (vec) {
            v16f a[MAX_VECS];
            {
                const contrib_t e = contrib[begin];
                const float* gr = (const float*)(go + (int64_t)e.go_row * go_bytes);
                for (int64_t v = 0; v < NV; ++v) a[v] = load16(gr + 16 * v) * e.scale;
            }
            for (int32_t p = begin + 1; p < end; ++p) {
                const contrib_t e = contrib[p];
                const float* gr = (const float*)(go + (int64_t)e.go_row * go_bytes);
                for (int64_t v = 0; v < NV; ++v) a[v] += load16(gr + 16 * v) * e.scale;
            }
            for (int64_t v = 0; v < NV; ++v) store16(acc + 16 * v, a[v]);
        } else if (gbf) {
            for (int32_t p = begin; p < end; ++p) {
                const contrib_t e = contrib[p];
                const uint16_t* restrict gr = (const uint16_t*)(go + (int64_t)e.go_row * go_bytes);
                if (p == begin) {
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) acc[d] = bf16_to_f32(gr[d]) * e.scale;
                } else {
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) acc[d] += bf16_to_f32(gr[d]) * e.scale;
                }
            }
        } else {
            {
                const contrib_t e = contrib[begin];
                const float* restrict gr = (const float*)(go + (int64_t)e.go_row * go_bytes);
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) acc[d] = gr[d] * e.scale;
            }
            for (int32_t p = begin + 1; p < end; ++p) {
                const contrib_t e = contrib[p];
                const float* restrict gr = (const float*)(go + (int64_t)e.go_row * go_bytes);
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) acc[d] += gr[d] * e.scale;
            }
        }
        begin = end;
        const int64_t row = urows[s];
        if (c->wt == W_F32) {
            apply_row(c, row, (float*)c->weights + row * D, acc, D);
        } else {
            load_half_row(c->weights, c->wt, row, D, wtmp);
            apply_row(c, row, wtmp, acc, D);
            store_half_row(c->weights, c->wt, row, D, wtmp, c->seed, c->key_rows ? c->key_rows[row] : row);
        }
        if (slot_map) slot_map[row] = -1;
    }
}

#define UNIT_FN(DV)                                                                     \
    static void process_unit_##DV(const bwd_t* c, const unit_t* u, workspace_t* ws) { \
        process_unit(c, u, ws, DV);                                                    \
    }
/* 4 and 8: the zoo's and many small models' dims; a constant D makes each row one vector op. */
UNIT_FN(4)
UNIT_FN(8)
UNIT_FN(16)
UNIT_FN(32)
UNIT_FN(64)
UNIT_FN(128)
static void process_unit_any(const bwd_t* c, const unit_t* u, workspace_t* ws) {
    process_unit(c, u, ws, c->D);
}

typedef struct {
    int64_t lo, hi;
} interval_t;

static int cmp_interval(const void* a, const void* b) {
    const int64_t x = ((const interval_t*)a)->lo, y = ((const interval_t*)b)->lo;
    return (x > y) - (x < y);
}

static int cmp_unit_bigger_first(const void* a, const void* b) {
    const int64_t x = ((const unit_t*)a)->ids, y = ((const unit_t*)b)->ids;
    return (x < y) - (x > y);
}

/*
 * weights [R, D]; m1/m2: optimizer state (NULL when unused; rowwise_adagrad m1 is [R]);
 * lin [N]; offsets [T*B+1]; go [B, T*D] of fp32, or of bf16 when go_bf16 (widened as each
 * row is read: a bf16 consumer's gradient needs no conversion pass); psw [N] or NULL; mean: 1 for mean pooling;
 * grad_scale: multiplies every id's gradient (folded into its per-id scale, no pass over go);
 * bc1/bc2: Adam bias corrections 1 - beta^step; slot_map [R], all -1 on entry and on return, or
 * NULL: each unit then maps its rows to slots through a hash map sized by its ids; key_rows [R]
 * or NULL: the row number keying each half row's stochastic rounding (NULL: the row's own).
 */
int recc_tbe_backward_update(void* weights, int wt, uint64_t seed, int64_t R, int64_t D, float* m1, float* m2,
                             const int64_t* lin, const int64_t* offsets, int64_t T,
                             int64_t B, const void* go, int go_bf16, const float* psw, int mean,
                             float grad_scale, int optimizer, float lr, float eps, float beta1, float beta2,
                             float wd, int decoupled, float bc1, float bc2, int32_t* slot_map,
                             const int64_t* segs, int64_t S, int nthreads, const int64_t* key_rows) {
    if (D <= 0 || T < 0 || B < 0 || optimizer < 0 || optimizer > 3) return RC_BAD_ARGS;
    if (wt != W_F32 && wt != W_F16 && wt != W_BF16) return RC_BAD_ARGS;
    if (optimizer != OPT_SGD && !m1) return RC_BAD_ARGS;
    if (optimizer == OPT_ADAM && !m2) return RC_BAD_ARGS;
    const int64_t NB = T * B;
    const int64_t N = offsets[NB];
    if (N == 0) return RC_OK;
    if (N > INT32_MAX || NB > INT32_MAX) return RC_BAD_ARGS;
    if (nthreads < 1) nthreads = 1;
    /* Segments: bag ranges [segs[s], segs[s+1]) whose rows the caller knows to be apart (its
     * tables); NULL: the T tables of B bags. A gather group passes its tables' id counts with
     * T = 1 (one-id bags of different counts per table). Only the work split reads them. */
    int64_t* own_segs = NULL;
    if (!segs) {
        own_segs = malloc((size_t)(T + 1) * sizeof(int64_t));
        if (!own_segs) return RC_NO_MEMORY;
        for (int64_t t = 0; t <= T; ++t) own_segs[t] = t * B;
        segs = own_segs;
        S = T;
    }
    if (S < 0 || segs[0] != 0 || segs[S] != NB) {
        free(own_segs);
        return RC_BAD_ARGS;
    }
    for (int64_t k = 0; k < S; ++k)
        if (segs[k + 1] < segs[k]) {
            free(own_segs);
            return RC_BAD_ARGS;
        }

    /* 0. Every id in [0, R), and each segment's row interval: before any write. */
    interval_t* iv = malloc((size_t)(S > 0 ? S : 1) * (size_t)nthreads * sizeof(interval_t));
    if (!iv) {
        free(own_segs);
        return RC_NO_MEMORY;
    }
    int team = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        if (tid == 0) team = (int)nth;
        const int64_t i0 = N * tid / nth, i1 = N * (tid + 1) / nth;
        for (int64_t t = 0; t < S; ++t) {
            const int64_t lo = offsets[segs[t]] > i0 ? offsets[segs[t]] : i0;
            const int64_t hi = offsets[segs[t + 1]] < i1 ? offsets[segs[t + 1]] : i1;
            int64_t mn = INT64_MAX, mx = INT64_MIN;
#pragma omp simd reduction(min : mn) reduction(max : mx)
            for (int64_t i = lo; i < hi; ++i) {
                mn = lin[i] < mn ? lin[i] : mn;
                mx = lin[i] > mx ? lin[i] : mx;
            }
            iv[tid * S + t].lo = mn;
            iv[tid * S + t].hi = mx;
        }
    }
    /* Combine the per-thread intervals (team: the threads the region really had). */
    int bad = 0;
    interval_t* sorted = malloc((size_t)(S > 0 ? S : 1) * sizeof(interval_t));
    unit_t* units = NULL;
    interval_t* seg_iv = NULL;
    int rc = RC_OK;
    if (!sorted) {
        rc = RC_NO_MEMORY;
        goto done;
    }
    int64_t n_nonempty = 0;
    /* Each segment's row interval (lo > hi: no ids), and the whole batch's: they bound how many
     * parts a unit can usefully be split into (below). */
    seg_iv = malloc((size_t)(S > 0 ? S : 1) * sizeof(interval_t));
    interval_t all_iv = {INT64_MAX, INT64_MIN};
    if (!seg_iv) {
        rc = RC_NO_MEMORY;
        goto done;
    }
    for (int64_t t = 0; t < S; ++t) {
        int64_t mn = INT64_MAX, mx = INT64_MIN;
        for (int k = 0; k < team; ++k) {
            const int64_t i0 = N * k / team, i1 = N * (k + 1) / team;
            const int64_t lo = offsets[segs[t]] > i0 ? offsets[segs[t]] : i0;
            const int64_t hi = offsets[segs[t + 1]] < i1 ? offsets[segs[t + 1]] : i1;
            if (hi <= lo) continue;
            if (iv[k * S + t].lo < mn) mn = iv[k * S + t].lo;
            if (iv[k * S + t].hi > mx) mx = iv[k * S + t].hi;
        }
        seg_iv[t].lo = mn;
        seg_iv[t].hi = mx;
        if (mn < all_iv.lo) all_iv.lo = mn;
        if (mx > all_iv.hi) all_iv.hi = mx;
        if (mn <= mx) {
            if (mn < 0 || mx >= R) bad = 1;
            sorted[n_nonempty].lo = mn;
            sorted[n_nonempty].hi = mx;
            ++n_nonempty;
        }
    }
    if (bad) {
        rc = RC_BAD_ID;
        goto done;
    }
    qsort(sorted, (size_t)n_nonempty, sizeof(interval_t), cmp_interval);
    int disjoint = 1;
    for (int64_t k = 1; k < n_nonempty; ++k) disjoint &= sorted[k].lo > sorted[k - 1].hi;

    /* 1. Work units: a segment (or the whole batch), split into parts of ~N/(2*threads) ids. */
    const int64_t target = (N + 2 * nthreads - 1) / (2 * nthreads);
    const int64_t max_parts = 4 * (int64_t)nthreads;
    int64_t n_units = 0, max_unit_ids = 0;
    units = malloc((size_t)(disjoint && S > 0 ? S : 1) * (size_t)max_parts * sizeof(unit_t));
    if (!units) {
        rc = RC_NO_MEMORY;
        goto done;
    }
    for (int64_t t = 0; t < (disjoint ? S : 1); ++t) {
        const int64_t bag_lo = disjoint ? segs[t] : 0, bag_hi = disjoint ? segs[t + 1] : NB;
        const int64_t count = offsets[bag_hi] - offsets[bag_lo];
        if (count == 0) continue;
        int64_t parts = (count + target - 1) / target;
        if (parts > max_parts) parts = max_parts;
        /* Every part scans all of the unit's ids and keeps its rows' (row_part hashes blocks of
         * 16 rows), so a part only pays where threads share the work and there are blocks to
         * share: one thread, or a unit over a few blocks (a 50-row table has 4), gets one part —
         * two or four parts there rescanned every id for nothing (youtube_dnn's items group). */
        const interval_t span = disjoint ? seg_iv[t] : all_iv;
        const int64_t blocks = span.hi >= span.lo ? (span.hi >> 4) - (span.lo >> 4) + 1 : 1;
        if (parts > blocks) parts = blocks;
        if (nthreads == 1 || parts < 1) parts = 1;
        if (count > max_unit_ids) max_unit_ids = count;
        for (int64_t p = 0; p < parts; ++p) {
            units[n_units].bag_lo = bag_lo;
            units[n_units].bag_hi = bag_hi;
            units[n_units].ids = count / parts;
            units[n_units].parts = (uint32_t)parts;
            units[n_units].part = (uint32_t)p;
            ++n_units;
        }
    }

    /* Biggest first, so the dynamic schedule ends balanced; the order cannot change any
     * result (each row lives in one unit and is reduced in index order). */
    qsort(units, (size_t)n_units, sizeof(unit_t), cmp_unit_bigger_first);

    /* 2. Units in parallel: each owns its rows, so no two threads write the same row. */
    const bwd_t ctx = {weights, wt, seed, R,  D,    m1,    m2,    lin, offsets, T,   B,   go, go_bf16,
                       psw,     mean, optimizer, grad_scale, lr, eps, beta1, beta2, wd, bc1, bc2, decoupled,
                       slot_map, key_rows};
    void (*fn)(const bwd_t*, const unit_t*, workspace_t*) =
        D == 4 ? process_unit_4
        : D == 8 ? process_unit_8
        : D == 16 ? process_unit_16
        : D == 32 ? process_unit_32
        : D == 64 ? process_unit_64
        : D == 128 ? process_unit_128
                   : process_unit_any;
    int no_mem = 0;
#pragma omp parallel num_threads(nthreads)
    {
        workspace_t* ws = &tls_ws;
        if (!ws_reserve(ws, (size_t)max_unit_ids, (size_t)D, slot_map == NULL)) {
#pragma omp atomic write
            no_mem = 1;
        }
#pragma omp barrier
        int give_up;
#pragma omp atomic read
        give_up = no_mem;
        if (!give_up) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t k = 0; k < n_units; ++k) fn(&ctx, &units[k], ws);
        }
    }
    if (no_mem) rc = RC_NO_MEMORY;

done:
    free(iv);
    free(sorted);
    free(seg_iv);
    free(units);
    free(own_segs);
    return rc;
}

/* offsets[0] == 0, offsets[NB] == N and never decreasing: what makes offsets safe to index
 * N ids with (1), else 0. One pass over NB + 1 values, no allocation. */
int recc_offsets_ok(const int64_t* offsets, int64_t NB, int64_t N) {
    if (NB < 0 || offsets[0] != 0 || offsets[NB] != N) return 0;
    for (int64_t j = 0; j < NB; ++j)
        if (offsets[j + 1] < offsets[j]) return 0;
    return 1;
}

/* ------------------------------------------------------------------ forward */

static inline __attribute__((always_inline)) int pool_range(
    const void* restrict weights, int wt, int64_t R, const int64_t* restrict lin,
    const int64_t* restrict offsets, int64_t T, int64_t B, const float* restrict psw,
    int mean, void* restrict out, int out_bf16, int64_t j0, int64_t j1, const int64_t D) {
    const int vec = D % 16 == 0 && D / 16 <= MAX_VECS;
    const int64_t NV = D / 16;
    int bad = 0;
    const int64_t TD = T * D;
    const int64_t i_end = offsets[j1];
    float wtmp[wt == W_F32 || vec ? 1 : D] __attribute__((aligned(64)));  /* a half row, in fp32 */
    float orow[out_bf16 ? D : 1] __attribute__((aligned(64)));     /* a bf16 bag, summed in fp32 */
    /* Bag j = t*B + b, advanced without a 64-bit division per bag (for one-id bags of a small
     * dim that division was a large share of the forward). */
    int64_t t = j0 / B, b = j0 - (j0 / B) * B;
    for (int64_t j = j0; j < j1; ++j, ++b) {
        if (b == B) {
            b = 0;
            ++t;
        }
        float* restrict o = out_bf16 ? orow : (float*)out + b * TD + t * D;
        uint16_t* restrict oh = out_bf16 ? (uint16_t*)out + b * TD + t * D : NULL;
        const int64_t lo = offsets[j], hi = offsets[j + 1];
        v16f a[MAX_VECS];
        if (vec) {
            for (int64_t v = 0; v < NV; ++v) a[v] = (v16f){0};
        } else {
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
        }
        for (int64_t i = lo; i < hi; ++i) {
            if (i + ID_PREFETCH < i_end) {
                const uint64_t prow = (uint64_t)lin[i + ID_PREFETCH];
                if (prow < (uint64_t)R) prefetch_span((const char*)weights + prow * D * w_elem_bytes(wt), D * w_elem_bytes(wt), 0);
            }
            const uint64_t row = (uint64_t)lin[i];
            if (row >= (uint64_t)R) {
                bad = 1;
                continue;
            }
            const float sc = psw ? psw[i] : 1.0f;
            if (vec) {
                if (psw) {
                    for (int64_t v = 0; v < NV; ++v) a[v] += sc * load16_row(weights, wt, (int64_t)row, D, v);
                } else {
                    for (int64_t v = 0; v < NV; ++v) a[v] += load16_row(weights, wt, (int64_t)row, D, v);
                }
                continue;
            }
            const float* restrict wr;
            if (wt == W_F32) {
                wr = (const float*)weights + row * D;
            } else {
                load_half_row(weights, wt, (int64_t)row, D, wtmp);
                wr = wtmp;
            }
            if (psw) {
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) o[d] += sc * wr[d];
            } else {
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) o[d] += wr[d];
            }
        }
        const float len = (float)(hi - lo);
        if (vec) {
            if (mean && hi > lo) {
                for (int64_t v = 0; v < NV; ++v) a[v] /= len;
            }
            if (out_bf16) {
                for (int64_t v = 0; v < NV; ++v) store16_bf16(oh + 16 * v, a[v]);
            } else {
                for (int64_t v = 0; v < NV; ++v) store16(o + 16 * v, a[v]);
            }
        } else {
            if (mean && hi > lo) {
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) o[d] /= len;
            }
            if (out_bf16) {
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) oh[d] = f32_to_bf16(o[d]);
            }
        }
    }
    return bad;
}

#define POOL_FN(DV)                                                                          \
    static int pool_range_##DV(const void* w, int wt, int64_t R, const int64_t* lin,         \
                               const int64_t* off, int64_t T, int64_t B, const float* psw,   \
                               int mean, void* out, int ob, int64_t j0, int64_t j1, int64_t D) { \
        (void)D;                                                                             \
        return pool_range(w, wt, R, lin, off, T, B, psw, mean, out, ob, j0, j1, DV);         \
    }
POOL_FN(4)
POOL_FN(8)
POOL_FN(16)
POOL_FN(32)
POOL_FN(64)
POOL_FN(128)
static int pool_range_any(const void* w, int wt, int64_t R, const int64_t* lin, const int64_t* off,
                          int64_t T, int64_t B, const float* psw, int mean, void* out, int ob,
                          int64_t j0, int64_t j1, int64_t D) {
    return pool_range(w, wt, R, lin, off, T, B, psw, mean, out, ob, j0, j1, D);
}

/* First bag j in [0, NB] with offsets[j] >= target (offsets non-decreasing). */
static int64_t first_bag_at(const int64_t* offsets, int64_t NB, int64_t target) {
    int64_t lo = 0, hi = NB;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (offsets[mid] < target) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/*
 * Pooling straight into the batch-major [B, T*D] output (no reorder copy).  Bags are cut
 * into runs of ~N/(8*threads) ids handed out dynamically (a thread that gets descheduled
 * does not hold the others up); rows are prefetched ahead across bag boundaries within a
 * run, and a bag sums its rows in index order.  out_bf16: `out` is bf16, each bag summed in
 * fp32 and rounded once to nearest even (a bf16 consumer's input, written in the lookup's
 * own pass instead of a cast after it).
 */
int recc_tbe_forward(const void* weights, int wt, int64_t R, int64_t D, const int64_t* lin,
                     const int64_t* offsets, int64_t T, int64_t B, const float* psw, int mean,
                     void* out, int out_bf16, int nthreads) {
    if (D <= 0 || T < 0 || B < 0 || (wt != W_F32 && wt != W_F16 && wt != W_BF16)) return RC_BAD_ARGS;
    const int64_t NB = T * B;
    if (NB == 0) return RC_OK;
    const int64_t N = offsets[NB];
    if (nthreads < 1) nthreads = 1;
    int (*fn)(const void*, int, int64_t, const int64_t*, const int64_t*, int64_t, int64_t,
              const float*, int, void*, int, int64_t, int64_t, int64_t) =
        D == 4 ? pool_range_4
        : D == 8 ? pool_range_8
        : D == 16 ? pool_range_16
        : D == 32 ? pool_range_32
        : D == 64 ? pool_range_64
        : D == 128 ? pool_range_128
                   : pool_range_any;
    int64_t runs = 8 * (int64_t)nthreads;
    if (runs > NB) runs = NB;
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : bad)
    for (int64_t k = 0; k < runs; ++k) {
        /* Run k: the bags starting in [N*k/runs, N*(k+1)/runs); empty bags go with the
         * first run whose range reaches their offset, the last run takes the tail. */
        const int64_t j0 = k == 0 ? 0 : first_bag_at(offsets, NB, N * k / runs);
        const int64_t j1 = k == runs - 1 ? NB : first_bag_at(offsets, NB, N * (k + 1) / runs);
        if (j1 > j0) bad |= fn(weights, wt, R, lin, offsets, T, B, psw, mean, out, out_bf16, j0, j1, D);
    }
    return bad ? RC_BAD_ID : RC_OK;
}

/* ------------------------------------------------------------------ gathers */

/*
 * One-id lookups (nn.Embedding) of T tables of a group, each table's rows written to its own
 * contiguous [n_ids[t], D] fp32 output in its ids' order: what F.embedding returns, with no
 * padding to a common bag count, no offsets and no column block to copy out.  First a serial
 * pass checks every id against its table's rows and writes lin (id + hsc[t]) for the
 * backward; nothing is gathered unless all ids are good.  Returns 0, or 1 + t for the first
 * table holding an id outside [0, rows[t]) (the caller names the id).
 */
int recc_gather_rows(const void* weights, int wt, int64_t R, int64_t D, int64_t T,
                     const void* const* ids, const int32_t* ids_is32, const int64_t* n_ids,
                     const int64_t* rows, const int64_t* hsc, int64_t* lin, float* const* outs,
                     int nthreads) {
    if (D <= 0 || T < 0 || (wt != W_F32 && wt != W_F16 && wt != W_BF16)) return -1;
    int64_t N = 0;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t n = n_ids[t], base = hsc[t];
        const uint64_t limit = (uint64_t)rows[t];
        uint64_t bad = 0;
        int64_t* restrict dst = lin + N;
        if (ids_is32[t]) {
            const int32_t* restrict src = (const int32_t*)ids[t];
            for (int64_t i = 0; i < n; ++i) {
                bad |= (uint64_t)(int64_t)src[i] >= limit;
                dst[i] = (int64_t)src[i] + base;
            }
        } else {
            const int64_t* restrict src = (const int64_t*)ids[t];
            for (int64_t i = 0; i < n; ++i) {
                bad |= (uint64_t)src[i] >= limit;
                dst[i] = src[i] + base;
            }
        }
        if (bad) return (int)(1 + t);
        if (base < 0 || base + (int64_t)limit > R) return -1;
        N += n;
    }
    if (N == 0) return 0;
    if (nthreads < 1) nthreads = 1;
    int64_t runs = 8 * (int64_t)nthreads;
    if (runs > N) runs = N;
    const int64_t esz = w_elem_bytes(wt);
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t k = 0; k < runs; ++k) {
        const int64_t i0 = N * k / runs, i1 = N * (k + 1) / runs;
        int64_t t = 0, start = 0;  /* table t holds global ids [start, start + n_ids[t]) */
        while (i0 >= start + n_ids[t]) start += n_ids[t++];
        for (int64_t i = i0; i < i1; ++i) {
            while (i >= start + n_ids[t]) start += n_ids[t++];
            if (i + ID_PREFETCH < i1) prefetch_span((const char*)weights + lin[i + ID_PREFETCH] * D * esz, D * esz, 0);
            float* restrict o = outs[t] + (i - start) * D;
            if (wt == W_F32) memcpy(o, (const float*)weights + lin[i] * D, (size_t)D * sizeof(float));
            else load_half_row(weights, wt, lin[i], D, o);
        }
    }
    return 0;
}
