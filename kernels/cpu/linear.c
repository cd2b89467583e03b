/* The backward of a dense layer's ReLU and bias in one pass (recc.linear on CPU).
 *
 * g = grad * (y > 0) and db = sum over rows of g: torch runs these as threshold_backward and a
 * column sum, two passes over a [B, N] gradient that does not fit in cache at DLRM's batch
 * sizes; here each row is masked and added into db while it is in registers. Rows are split
 * across threads, each with its own partial db, summed at the end in thread order (the result
 * does not depend on scheduling, only on the thread count). Rows are summed in blocks of 64
 * before they are added to the partial, which keeps the rounding of a 2048-row sum close to
 * torch's pairwise sum. The mask is torch's: a NaN in y passes the gradient, as y <= 0 is false.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"

/* The row sums of relu_backward and the narrow layers' backward, the same way in both: each
 * thread adds its rows into a block sum, which goes into the thread's total every ROW_BLOCK rows
 * and at the end; the totals are then added in thread order. A thread's slot is 2 * n floats:
 * its total, then its block. */
#define ROW_BLOCK 64

static inline void add_block(float *total, float *blk, int64_t n) {
    for (int64_t i = 0; i < n; ++i) total[i] += blk[i], blk[i] = 0.f;
}

static inline void row_added(float *total, float *blk, int64_t n, int64_t *in_block) {
    if (++*in_block == ROW_BLOCK) {
        add_block(total, blk, n);
        *in_block = 0;
    }
}

/* Thread t's total (part + t * 2 * n) added into thread 0's, in thread order. */
static void add_thread_totals(float *part, int nthreads, int64_t n) {
    for (int t = 1; t < nthreads; ++t)
        for (int64_t i = 0; i < n; ++i) part[i] += part[(size_t)t * 2 * (size_t)n + i];
}

/* The ReLU mask and bias-gradient sum of one [B, N] gradient of element type T, written as TOUT:
 * TO_F reads a T as fp32, STORE turns a T into a TOUT, OUT_F reads a TOUT as fp32, ZERO is TOUT's
 * zero. For T == TOUT the mask copies the element (bf16 bits stay bits); bf16 into fp32 is exact.
 * db is summed in fp32. */
#define RELU_BACKWARD(NAME, T, TOUT, TO_F, STORE, OUT_F, ZERO)                                          \
    int NAME(const T *grad, int64_t ldg, const T *y, int64_t ldy, int64_t B, int64_t N, TOUT *g, float *db, \
             int nthreads) {                                                                       \
        if (nthreads < 1) nthreads = 1;                                                            \
        float *part = NULL;                                                                        \
        if (db) {                                                                                  \
            /* per thread: its partial db (N), then its current block's sum (N) */                \
            part = (float *)calloc((size_t)nthreads * 2 * (size_t)N, sizeof(float));               \
            if (!part) return -1;                                                                  \
        }                                                                                          \
        _Pragma("omp parallel num_threads(nthreads)") {                                           \
            const int t = omp_get_thread_num();                                                    \
            float *total = part ? part + (size_t)t * 2 * (size_t)N : NULL;                         \
            float *blk = total ? total + N : NULL;                                                 \
            int64_t in_block = 0;                                                                  \
            _Pragma("omp for schedule(static)") for (int64_t b = 0; b < B; ++b) {                  \
                const T *gr = grad + b * ldg, *yr = y + b * ldy;                                   \
                TOUT *out = g + b * N;                                                             \
                _Pragma("omp simd") for (int64_t n = 0; n < N; ++n)                                \
                    out[n] = TO_F(yr[n]) <= 0.f ? ZERO : STORE(gr[n]);                             \
                if (blk) {                                                                         \
                    _Pragma("omp simd") for (int64_t n = 0; n < N; ++n) blk[n] += OUT_F(out[n]);   \
                    row_added(total, blk, N, &in_block);                                           \
                }                                                                                  \
            }                                                                                      \
            if (blk) add_block(total, blk, N);                                                     \
        }                                                                                          \
        if (db) {                                                                                  \
            add_thread_totals(part, nthreads, N);                                                  \
            memcpy(db, part, sizeof(float) * (size_t)N);                                           \
            free(part);                                                                            \
        }                                                                                          \
        return 0;                                                                                  \
    }

static inline float f32_as_f32(float x) { return x; }

static inline uint16_t bf16_as_bf16(uint16_t h) { return h; }

RELU_BACKWARD(recc_relu_backward, float, float, f32_as_f32, f32_as_f32, f32_as_f32, 0.f)
RELU_BACKWARD(recc_relu_backward_bf16, uint16_t, uint16_t, bf16_to_f32, bf16_as_bf16, bf16_to_f32, 0)
/* bf16 in, fp32 out: the masked gradient for a bf16 layer whose products run on fp32 units
 * (linear.py's ``bf16_products``), so its GEMMs read it without a separate widening pass. */
RELU_BACKWARD(recc_relu_backward_bf16_f32, uint16_t, float, bf16_to_f32, bf16_to_f32, f32_as_f32, 0.f)

/* A bf16 layer's output on fp32 units (linear.py's ``bf16_products``): the GEMM's fp32 result
 * x [n] rounded to bf16 into out, and the rounded value written back into x (exact), so the next
 * layer's GEMM reads x as its widened input instead of widening out again: one pass where
 * ``.to(bfloat16)`` and the next layer's ``.float()`` were two. */
void recc_round_bf16_keep_f32(float *x, uint16_t *out, int64_t n, int nthreads) {
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for simd num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(x[i]);
        out[i] = h;
        x[i] = bf16_to_f32(h);
    }
}

/* A dense layer with a narrow output — N <= 8 columns: a model's head, one logit per task —
 * y = act(x w^T + b) with x fp32 or bf16 (widened exactly), w and b fp32, y fp32.
 *
 * The BLAS libraries run such a product far below memory speed: MKL's forward of kaggle's head
 * ([4096, 256] x [256, 1]) took 0.15 ms and its input gradient, an outer product g w (K = 1),
 * 0.30 ms, for 4 MB each; a bf16 head also paid a cast of its input to fp32 and of that input's
 * gradient back (0.32 ms each). Here the forward reads each row of x once, and the backward
 * reads each row of x and of the gradient once, writing dx (in x's dtype: a bf16 dx is rounded
 * once, as the cast's backward did) and summing dw and db in fp32. Rows are split across threads;
 * each thread sums its rows into its own partial dw/db in blocks of ROW_BLOCK rows, and the partials
 * are added in thread order (relu_backward's scheme: the result depends on the thread count only).
 * With relu, the mask is relu_backward's (y <= 0 -> 0). Each output column is its own pass over
 * the row, so past a few columns the BLAS libraries win (linear.py's _narrow_wins). */
#define NARROW_LINEAR(SUFFIX, T, TO_F, STORE)                                                          \
    void recc_narrow_forward_##SUFFIX(const T *x, int64_t ldx, const float *w, const float *bias,     \
                                      int64_t B, int64_t K, int64_t N, int relu, float *y, int nthreads) { \
        if (nthreads < 1) nthreads = 1;                                                                \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                            \
        for (int64_t b = 0; b < B; ++b) {                                                              \
            const T *xr = x + b * ldx;                                                                 \
            for (int64_t n = 0; n < N; ++n) {                                                          \
                const float *wr = w + n * K;                                                           \
                float s = 0.f;                                                                         \
                _Pragma("omp simd reduction(+:s)") for (int64_t k = 0; k < K; ++k) s += TO_F(xr[k]) * wr[k]; \
                if (bias) s += bias[n];                                                                \
                y[b * N + n] = relu && s < 0.f ? 0.f : s;                                              \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
                                                                                                       \
    int recc_narrow_backward_##SUFFIX(const float *g, int64_t ldg, const T *x, int64_t ldx, const float *w, \
                                      const float *y, int64_t B, int64_t K, int64_t N, T *dx, float *dw,  \
                                      float *db, int nthreads) {                                       \
        if (N > 8) return -2; /* gb below; linear.py's NARROW_MAX */                                   \
        if (nthreads < 1) nthreads = 1;                                                                \
        const int64_t width = N * K + N; /* a thread's dw then db */                                  \
        float *part = NULL, *rows = NULL;                                                              \
        if (dw || db) {                                                                                \
            /* per thread: its partial dw|db, then its current block's */                              \
            part = (float *)calloc((size_t)nthreads * 2 * (size_t)width, sizeof(float));               \
            if (!part) return -1;                                                                      \
        }                                                                                              \
        if (dx) { /* per thread: a row of dx in fp32 */                                                \
            rows = (float *)malloc(sizeof(float) * (size_t)nthreads * (size_t)K);                      \
            if (!rows) {                                                                               \
                free(part);                                                                            \
                return -1;                                                                             \
            }                                                                                          \
        }                                                                                              \
        _Pragma("omp parallel num_threads(nthreads)") {                                               \
            const int t = omp_get_thread_num();                                                        \
            float *total = part ? part + (size_t)t * 2 * (size_t)width : NULL;                         \
            float *blk = total ? total + width : NULL;                                                 \
            float *acc = rows ? rows + (size_t)t * (size_t)K : NULL;                                   \
            int64_t in_block = 0;                                                                      \
            float gb[8];                                                                               \
            /* gb: row b's gradient, masked; dx and dw read it in separate passes (dx needs no x) */ \
            _Pragma("omp for schedule(static) nowait") for (int64_t b = 0; b < B; ++b) {               \
                if (!dx) continue;                                                                     \
                for (int64_t n = 0; n < N; ++n)                                                        \
                    gb[n] = y && y[b * N + n] <= 0.f ? 0.f : g[b * ldg + n];                           \
                T *dr = dx + b * K;                                                                    \
                if (N == 1) { /* a head: no row to sum */                                             \
                    const float g0 = gb[0];                                                            \
                    _Pragma("omp simd") for (int64_t k = 0; k < K; ++k) dr[k] = STORE(g0 * w[k]);      \
                    continue;                                                                          \
                }                                                                                      \
                _Pragma("omp simd") for (int64_t k = 0; k < K; ++k) acc[k] = gb[0] * w[k];             \
                for (int64_t n = 1; n < N; ++n) {                                                      \
                    const float gn = gb[n], *wr = w + n * K;                                           \
                    _Pragma("omp simd") for (int64_t k = 0; k < K; ++k) acc[k] += gn * wr[k];          \
                }                                                                                      \
                _Pragma("omp simd") for (int64_t k = 0; k < K; ++k) dr[k] = STORE(acc[k]);             \
            }                                                                                          \
            _Pragma("omp for schedule(static)") for (int64_t b = 0; b < B; ++b) {                      \
                if (!blk) continue;                                                                    \
                const T *xr = x + b * ldx;                                                             \
                for (int64_t n = 0; n < N; ++n)                                                        \
                    gb[n] = y && y[b * N + n] <= 0.f ? 0.f : g[b * ldg + n];                           \
                if (dw)                                                                                \
                    for (int64_t n = 0; n < N; ++n) {                                                  \
                        float *pr = blk + n * K;                                                       \
                        const float gn = gb[n];                                                        \
                        _Pragma("omp simd") for (int64_t k = 0; k < K; ++k) pr[k] += gn * TO_F(xr[k]); \
                    }                                                                                  \
                for (int64_t n = 0; n < N; ++n) blk[N * K + n] += gb[n];                               \
                row_added(total, blk, width, &in_block);                                               \
            }                                                                                          \
            if (blk) add_block(total, blk, width);                                                     \
        }                                                                                              \
        if (part) {                                                                                    \
            add_thread_totals(part, nthreads, width);                                                  \
            if (dw) memcpy(dw, part, sizeof(float) * (size_t)(N * K));                                 \
            if (db) memcpy(db, part + N * K, sizeof(float) * (size_t)N);                               \
            free(part);                                                                                \
        }                                                                                              \
        free(rows);                                                                                    \
        return 0;                                                                                      \
    }

NARROW_LINEAR(f32, float, f32_as_f32, f32_as_f32)
NARROW_LINEAR(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
