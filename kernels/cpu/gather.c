/* Gathers of a TBE group's rows (recc_gather_rows): one-id lookups (nn.Embedding) copied out
 * row by row, whatever the weights' storage type. Layout and codes: tbe.h.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "tbe.h"

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
