/* The TBE forward (recc_tbe_forward): each bag sums its rows in index order straight into the
 * batch-major [B, T*D] output, weights of any storage type widened in registers, the output fp32
 * or (a bf16 consumer's input) bf16. And recc_offsets_ok, the check that makes offsets safe to
 * index with, for the forward and the backward alike. Layout and codes: tbe.h.
 */
#include <stdint.h>
#include <omp.h>

#include "tbe.h"

/* offsets[0] == 0, offsets[NB] == N and never decreasing: what makes offsets safe to index
 * N ids with (1), else 0. One pass over NB + 1 values, no allocation. */
int recc_offsets_ok(const int64_t* offsets, int64_t NB, int64_t N) {
    if (NB < 0 || offsets[0] != 0 || offsets[NB] != N) return 0;
    for (int64_t j = 0; j < NB; ++j)
        if (offsets[j + 1] < offsets[j]) return 0;
    return 1;
}

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
            for (int64_t v = 0; v < NV; ++v) a[v] = splat16(0.f);
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
                    for (int64_t v = 0; v < NV; ++v) a[v] = add16(a[v], mul16(splat16(sc), load16_row(weights, wt, (int64_t)row, D, v)));
                } else {
                    for (int64_t v = 0; v < NV; ++v) a[v] = add16(a[v], load16_row(weights, wt, (int64_t)row, D, v));
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
                for (int64_t v = 0; v < NV; ++v) a[v] = div16(a[v], splat16(len));
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
