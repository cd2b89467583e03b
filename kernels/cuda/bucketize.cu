/*
 * Row-wise bucketization for row-wise (RW) sharding: the ids of one table's bags are split by
 * row block, so each block's owner receives only its rows, rebased to the block.
 *
 * Inputs: `ids` [N] (int64, local to the table), `offsets` [B+1] (int64, bag b is
 * ids[offsets[b]:offsets[b+1]]), `bounds` [K+1] (int64, non-decreasing, bounds[0] = 0: block
 * k holds rows [bounds[k], bounds[k+1])).  Outputs, bucket-major then bag then index order
 * (what recc.runtime.comm sends each owner):
 *   lengths [K, B]: ids of bag b that fall in block k;
 *   out_ids [N]:    id - bounds[k], grouped by block, bags in order, ids in index order;
 *   perm    [N]:    the input position of each output id (to carry per-sample weights and to
 *                   route gradients back).
 * An id outside [bounds[0], bounds[K]) is left out and reported through err[0] (atomicMin of
 * its position; all ones when none), never written anywhere.  A malformed bag (offsets must
 * start at 0, not decrease and end at N) is reported through err[1] (its index), and then
 * bucketize_scatter writes nothing: overlapping bags could otherwise count more than N ids
 * and write past out_ids.
 *
 * Two passes, one thread per bag (a bag's ids are scanned in order, so no atomics are
 * needed for the order): bucketize_count fills lengths; the host takes an exclusive prefix
 * sum of lengths (flattened [K*B]) as each (block, bag)'s output start; bucketize_scatter
 * writes ids and positions there.
 */
typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ int block_of(i64 id, const i64* __restrict__ bounds, int K) {
    if (id < bounds[0] || id >= bounds[K]) return -1;
    int lo = 0, hi = K;  /* largest k with bounds[k] <= id */
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (bounds[mid] <= id) lo = mid; else hi = mid;
    }
    return lo;
}

extern "C" __global__ void bucketize_count(const i64* __restrict__ ids,
                                           const i64* __restrict__ offsets, i64 B, i64 N,
                                           const i64* __restrict__ bounds, int K,
                                           i64* __restrict__ lengths, unsigned long long* err) {
    const i64 b = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    for (int k = 0; k < K; ++k) lengths[(i64)k * B + b] = 0;
    const i64 start = offsets[b], end = offsets[b + 1];
    if (start < 0 || end > N || start > end || (b == 0 && start != 0) || (b == B - 1 && end != N)) {
        atomicMin(err + 1, (u64)b);
        return;
    }
    for (i64 p = start; p < end; ++p) {
        const int k = block_of(ids[p], bounds, K);
        if (k < 0) atomicMin(err, (u64)p);
        else lengths[(i64)k * B + b] += 1;
    }
}

extern "C" __global__ void bucketize_scatter(const i64* __restrict__ ids,
                                             const i64* __restrict__ offsets, i64 B,
                                             const i64* __restrict__ bounds, int K,
                                             const i64* __restrict__ starts,
                                             i64* __restrict__ out_ids, i64* __restrict__ perm,
                                             const u64* err) {
    const i64 b = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B || err[1] != ~0ull) return;  /* offsets checked by bucketize_count */
    /* K is small (the ranks of one table); the cursors of blocks past 64 are recomputed. */
    i64 cursor[64];
    const int kc = K < 64 ? K : 64;
    for (int k = 0; k < kc; ++k) cursor[k] = starts[(i64)k * B + b];
    for (int k = kc; k < K; ++k) {
        i64 at = starts[(i64)k * B + b];
        for (i64 p = offsets[b]; p < offsets[b + 1]; ++p) {
            if (block_of(ids[p], bounds, K) == k) {
                out_ids[at] = ids[p] - bounds[k];
                perm[at] = p;
                ++at;
            }
        }
    }
    for (i64 p = offsets[b]; p < offsets[b + 1]; ++p) {
        const int k = block_of(ids[p], bounds, K);
        if (k < 0 || k >= kc) continue;
        const i64 at = cursor[k]++;
        out_ids[at] = ids[p] - bounds[k];
        perm[at] = p;
    }
}
