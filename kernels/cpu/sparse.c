/*
 * The sparse inputs' bookkeeping before a table-batched lookup, one pass each (plain C, no
 * torch headers; sparse.py loads it with ctypes):
 *  - recc_pack_bags: T tables' ids (each int64 or int32) and per-table start offsets
 *    (nn.EmbeddingBag's [B_t] convention) -> one int64 id array, tables back to back, and the
 *    feature-major offsets [sum B_t + 1] (T*B+1 when every B_t is B), checking each table's
 *    offsets and ids on the way. Tables of different bag counts are what a stacked kernel
 *    feature is made of: one table's lookups, their bags one after another.
 *  - recc_linearize: local ids (int64 or int32) -> rows of the group's concatenated weight,
 *    id + hash_size_cumsum[t] for the ids of table t.
 *  - recc_input_dist_pack / recc_input_dist_unpack: the input dist's int32 payload built from
 *    a packed group, and the received payloads reordered into the owner's batch.
 */
#include <stdint.h>

/* Returns 0, or 1 + t for the first table whose offsets (not starting at 0, decreasing, past
 * the table's ids) or ids (outside [0, rows[t])) are bad; the output is then incomplete and
 * the caller diagnoses the table. */
int recc_pack_bags(int64_t T, const int64_t* B, const void* const* ids, const int32_t* ids_is32,
                   const int64_t* n_ids, const int64_t* const* offsets, const int64_t* rows,
                   int64_t* ids_out, int64_t* off_out) {
    int64_t base = 0, pos = 0;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t n = n_ids[t], bags = B[t];
        const int64_t* restrict o = offsets[t];
        if (bags > 0 && o[0] != 0) return (int)(1 + t);
        int bad = 0;
        for (int64_t b = 0; b < bags; ++b) {
            const int64_t next = b + 1 < bags ? o[b + 1] : n;
            bad |= o[b] > next;
            off_out[pos + b] = base + o[b];
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
        pos += bags;
    }
    off_out[pos] = base;
    return 0;
}

/* lin[i] = ids[i] + hsc[t] for offsets[t*B] <= i < offsets[(t+1)*B]. Returns 1 (nothing
 * written) unless 0 = offsets[0] <= offsets[B] <= ... <= offsets[T*B] = n: the only offsets it
 * reads, so no write can leave lin[0, n). */
int recc_linearize(const void* ids, int ids_is32, const int64_t* offsets, int64_t T, int64_t B,
                   const int64_t* hsc, int64_t n, int64_t* lin) {
    if (offsets[0] != 0 || offsets[T * B] != n) return 1;
    for (int64_t t = 0; t < T; ++t)
        if (offsets[t * B] > offsets[(t + 1) * B]) return 1;
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
    return 0;
}

/* The input dist's send buffer from a packed group (ids int64, feature-major offsets
 * [T*B+1]): for each destination in turn, the bag lengths of its tables (B each, in the
 * listed order), then those tables' ids, all as int32 (the caller checked they fit).
 * tables[] lists the destinations' tables back to back, tables_per_dst[o] of them for o. */
void recc_input_dist_pack(const int64_t* ids, const int64_t* offsets, int64_t B, int64_t n_dst,
                          const int64_t* tables_per_dst, const int64_t* tables, int32_t* out) {
    int64_t pos = 0, first = 0;
    for (int64_t o = 0; o < n_dst; ++o) {
        const int64_t n = tables_per_dst[o];
        for (int64_t q = first; q < first + n; ++q) {
            const int64_t* restrict off = offsets + tables[q] * B;
            for (int64_t b = 0; b < B; ++b) out[pos++] = (int32_t)(off[b + 1] - off[b]);
        }
        for (int64_t q = first; q < first + n; ++q) {
            const int64_t lo = offsets[tables[q] * B], hi = offsets[(tables[q] + 1) * B];
            const int64_t* restrict src = ids + lo;
            int32_t* restrict dst = out + pos;
            for (int64_t i = 0; i < hi - lo; ++i) dst[i] = (int32_t)src[i];
            pos += hi - lo;
        }
        first += n;
    }
}

/* The inverse on the receiving side: recv holds, from each source s in turn, J*B bag lengths
 * (shard-major) then its ids shard by shard (ids_from[s] of them). Writes the feature-major
 * batch of J shards x (world*B) bags: shard j's bags are source 0's B bags, then source 1's...;
 * ids_out (int32, in that order) and offsets_out [J*world*B + 1]. counts: J*world scratch.
 * Returns 0, or 1 + s when source s's lengths are negative or do not add up to its ids (then
 * nothing is read past its part of recv). */
int recc_input_dist_unpack(const int32_t* recv, int64_t world, int64_t J, int64_t B,
                           const int64_t* ids_from, int64_t* counts, int32_t* ids_out,
                           int64_t* offsets_out) {
    int64_t base = 0;
    for (int64_t s = 0; s < world; ++s) {
        const int32_t* len = recv + base;
        int64_t total = 0, negative = 0;
        for (int64_t j = 0; j < J; ++j) {
            int64_t c = 0;
            for (int64_t b = 0; b < B; ++b) {
                c += len[j * B + b];
                negative |= len[j * B + b] < 0;
            }
            counts[s * J + j] = c;
            total += c;
        }
        if (negative || total != ids_from[s]) return (int)(1 + s);
        base += J * B + ids_from[s];
    }
    int64_t acc = 0, out_pos = 0, bag = 0;
    offsets_out[0] = 0;
    for (int64_t j = 0; j < J; ++j) {
        int64_t src_base = 0;
        for (int64_t s = 0; s < world; ++s) {
            const int32_t* len = recv + src_base + j * B;
            for (int64_t b = 0; b < B; ++b) {
                acc += len[b];
                offsets_out[++bag] = acc;
            }
            int64_t before = 0;
            for (int64_t q = 0; q < j; ++q) before += counts[s * J + q];
            const int32_t* restrict src = recv + src_base + J * B + before;
            const int64_t c = counts[s * J + j];
            for (int64_t i = 0; i < c; ++i) ids_out[out_pos + i] = src[i];
            out_pos += c;
            src_base += J * B + ids_from[s];
        }
    }
    return 0;
}
