/*
 * The sparse inputs' bookkeeping before a table-batched lookup, one pass each (plain C, no
 * torch headers; sparse.py loads it with ctypes):
 *  - recc_pack_bags: T tables' ids (each int64 or int32) and per-table start offsets
 *    (nn.EmbeddingBag's [B] convention) -> one int64 id array, tables back to back, and the
 *    feature-major offsets [T*B+1], checking each table's offsets and ids on the way.
 *  - recc_linearize: local ids (int64 or int32) -> rows of the group's concatenated weight,
 *    id + hash_size_cumsum[t] for the ids of table t.
 */
#include <stdint.h>

/* Returns 0, or 1 + t for the first table whose offsets (not starting at 0, decreasing, past
 * the table's ids) or ids (outside [0, rows[t])) are bad; the output is then incomplete and
 * the caller diagnoses the table. */
int recc_pack_bags(int64_t T, int64_t B, const void* const* ids, const int32_t* ids_is32,
                   const int64_t* n_ids, const int64_t* const* offsets, const int64_t* rows,
                   int64_t* ids_out, int64_t* off_out) {
    int64_t base = 0;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t n = n_ids[t];
        const int64_t* restrict o = offsets[t];
        if (B > 0 && o[0] != 0) return (int)(1 + t);
        int bad = 0;
        for (int64_t b = 0; b < B; ++b) {
            const int64_t next = b + 1 < B ? o[b + 1] : n;
            bad |= o[b] > next;
            off_out[t * B + b] = base + o[b];
        }
        if (bad) return (int)(1 + t);
        const uint64_t limit = (uint64_t)rows[t];
        int64_t* restrict dst = ids_out + base;
        uint64_t out_of_range = 0;
        if (ids_is32[t]) {
            const int32_t* restrict src = (const int32_t*)ids[t];
            for (int64_t i = 0; i < n; ++i) {
                const int64_t v = src[i];
                dst[i] = v;
                out_of_range |= (uint64_t)v >= limit;
            }
        } else {
            const int64_t* restrict src = (const int64_t*)ids[t];
            for (int64_t i = 0; i < n; ++i) {
                const int64_t v = src[i];
                dst[i] = v;
                out_of_range |= (uint64_t)v >= limit;
            }
        }
        if (out_of_range) return (int)(1 + t);
        base += n;
    }
    off_out[T * B] = base;
    return 0;
}

/* lin[i] = ids[i] + hsc[t] for offsets[t*B] <= i < offsets[(t+1)*B]. */
void recc_linearize(const void* ids, int ids_is32, const int64_t* offsets, int64_t T, int64_t B,
                    const int64_t* hsc, int64_t* lin) {
    for (int64_t t = 0; t < T; ++t) {
        const int64_t lo = offsets[t * B], hi = offsets[(t + 1) * B], base = hsc[t];
        if (ids_is32) {
            const int32_t* restrict src = (const int32_t*)ids;
            for (int64_t i = lo; i < hi; ++i) lin[i] = src[i] + base;
        } else {
            const int64_t* restrict src = (const int64_t*)ids;
            for (int64_t i = lo; i < hi; ++i) lin[i] = src[i] + base;
        }
    }
}
