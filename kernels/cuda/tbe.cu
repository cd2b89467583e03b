/*
 * CUDA kernels for one table-batched embedding (TBE) group: T tables sharing a dim D, stored
 * as one concatenated weight [R, D] (fp32, fp16 or bf16), with the semantics of recc.kernels.cpu.tbe.
 *
 * Layout (FBGEMM's names): `ids` holds LOCAL ids, tables back to back; `offsets` has T*B+1
 * int64 entries, feature-major (bag j = t*B + b); table t owns weight rows
 * [hsc[t], hsc[t+1]) (hash_size_cumsum); pooled outputs and their gradients are batch-major
 * fp32 [B, T*D].  `err` is an error record of two unsigned long longs, ERR_NONE (all ones)
 * when the batch is valid: a kernel that meets an id outside its table leaves that id out,
 * never reads or writes out of bounds, and atomicMin's the id's position into err[0]; the
 * forward also checks each bag's offsets (a malformed bag is pooled as empty, its index
 * atomicMin'ed into err[1]).  The host reads the record and raises.
 *
 * Forward (tbe_forward_*): a group of `lanes` threads (a power of two <= 32: a sub-warp when D
 * is small) pools one bag, each lane owning V consecutive columns (V = 4: one 16-byte fp32 or
 * 8-byte fp16/bf16 load per row; V = 1 when D % 4 != 0 or rows are not aligned), ids unrolled by 4
 * so four row loads are in flight.  Sum or mean (empty bag -> 0), optional per-sample weights.
 *
 * Backward + fused optimizer, "exact" (duplicate ids summed, each row updated once):
 *  1. tbe_linearize_*: per id, row = hsc[t] + id (SENTINEL for a bad id) and its bag.
 *  2. the host sorts (row, position) pairs stably (torch.sort: a radix sort), so a row's ids
 *     stay in index order: a short run sums in the CPU kernels' order, a long one chunk by
 *     chunk (a fixed order too, but not theirs).
 *  3. tbe_runs: run-length encoding of the sorted rows into run_start[0..num_runs], with
 *     num_runs and run_start read on the device: no host sync.
 *  4. tbe_long_run_partials_*: runs longer than `seg` ids (hot rows: thousands of ids under
 *     a zipf distribution) are cut into chunks of `seg` ids counted from the run's own start
 *     (chunk k: the run's ids [k*seg, (k+1)*seg)), each summed by its own group of threads
 *     into a partial row.
 *  5. tbe_long_run_combine_*, once per level of a tree cut from the run's own start: each
 *     launch adds `fanin` rows of the level below into one, in a fixed order, until a long
 *     run's whole gradient is one row (deterministic, and a group adds at most 2 * fanin rows
 *     for a level-segment it owns, however many ids the row has).
 *  6. tbe_update_*: one group of `lanes` threads per run (grid-stride), gradient summed in
 *     registers (D <= lanes*V*MAX_CHUNKS) — a short run's ids in index order, a long run's
 *     one combined row — and the optimizer applied once.  A row's sum so depends only on
 *     its own ids in index order, never on the rows around it in the batch or on the row
 *     numbering (a cached group's slots sum as the rows they hold).
 *  Kernels 4-6 return at once when `err` is set (a bad id or, checked by tbe_linearize, a
 *  malformed bag), so a bad batch writes nothing.
 *  fp16 and bf16 weights are read and updated in fp32 and written back with stochastic
 *  rounding (an unbiased rounding keyed by (seed, row, column), so small updates are not lost
 *  to round-to-nearest); optimizer state is always fp32.  `key_rows` (NULL, or [R]) names the
 *  row whose number keys a weight row's rounding: a cached group's weights hold slots, and
 *  key_rows[slot] = the group row the slot holds makes it round as that row does when resident.
 */
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
typedef unsigned long long u64;

#define ERR_NONE 0xFFFFFFFFFFFFFFFFull
#define SENTINEL_I32 0x7FFFFFFF
#define MAX_CHUNKS 8

enum { OPT_SGD = 0, OPT_ROWWISE_ADAGRAD = 1, OPT_ADAGRAD = 2, OPT_ADAM = 3 };

/* ------------------------------------------------------------------ row loads and stores */

template <int V> struct Vec { float v[V]; };

__device__ __forceinline__ void load_row(const float* p, Vec<4>& r) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    r.v[0] = x.x; r.v[1] = x.y; r.v[2] = x.z; r.v[3] = x.w;
}
__device__ __forceinline__ void load_row(const __half* p, Vec<4>& r) {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&x.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&x.y));
    r.v[0] = a.x; r.v[1] = a.y; r.v[2] = b.x; r.v[3] = b.y;
}
/* A bf16 is the top half of an fp32: widening is a shift, exact. */
__device__ __forceinline__ float bf16_bits_to_float(unsigned int bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ void load_row(const __nv_bfloat16* p, Vec<4>& r) {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    r.v[0] = bf16_bits_to_float(x.x & 0xFFFFu); r.v[1] = bf16_bits_to_float(x.x >> 16);
    r.v[2] = bf16_bits_to_float(x.y & 0xFFFFu); r.v[3] = bf16_bits_to_float(x.y >> 16);
}
__device__ __forceinline__ void load_row(const float* p, Vec<1>& r) { r.v[0] = *p; }
__device__ __forceinline__ void load_row(const __half* p, Vec<1>& r) { r.v[0] = __half2float(*p); }
__device__ __forceinline__ void load_row(const __nv_bfloat16* p, Vec<1>& r) {
    r.v[0] = bf16_bits_to_float(__bfloat16_as_ushort(*p));
}

/* Partial vector loads at the end of a row never happen: the host picks V = 4 only when
 * D % 4 == 0, so a lane's V columns are all inside the row. */

/* splitmix64: a cheap, well-mixed hash, so stochastic rounding needs no RNG state. */
__device__ __forceinline__ u64 mix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* fp32 -> fp16 rounding up (away from zero) with probability equal to the fraction of the
 * gap between the two neighbouring halves, so E[result] = x (for |x| <= 65504). */
__device__ __forceinline__ __half stochastic_half(float x, u64 key) {
    if (!isfinite(x)) return __float2half_rn(x);
    const __half lo = __float2half_rz(x);
    const unsigned short lo_bits = __half_as_ushort(lo);
    if ((lo_bits & 0x7FFF) == 0x7BFF) return lo;  /* |x| >= max finite half: stay finite */
    const __half hi = __ushort_as_half((unsigned short)(lo_bits + 1));  /* one ulp further out */
    const float flo = fabsf(__half2float(lo)), fhi = fabsf(__half2float(hi));
    const float frac = (fabsf(x) - flo) / (fhi - flo);
    const float u = (float)(mix64(key) >> 40) * (1.0f / 16777216.0f);  /* [0, 1), 24 bits */
    return u < frac ? hi : lo;
}

/* fp32 -> bf16 the same way: the dropped low 16 bits are the fraction of the gap between the
 * two neighbouring bf16 values (same sign, adjacent bit patterns), so rounding away from zero
 * with that probability is unbiased. Inf keeps its top half and a NaN stays a NaN (quiet, also
 * one whose payload was only in the dropped bits); a finite value never rounds to inf. */
__device__ __forceinline__ __nv_bfloat16 stochastic_bf16(float x, u64 key) {
    const unsigned int bits = __float_as_uint(x);
    const unsigned short lo = (unsigned short)(bits >> 16);
    if (isnan(x)) return __ushort_as_bfloat16((unsigned short)(lo | 0x40));
    if (isinf(x) || (lo & 0x7FFF) == 0x7F7F) return __ushort_as_bfloat16(lo);  /* max finite stays */
    const unsigned int u = (unsigned int)(mix64(key) >> 48);  /* [0, 2^16) */
    return __ushort_as_bfloat16((unsigned short)(lo + (u < (bits & 0xFFFFu) ? 1 : 0)));
}

__device__ __forceinline__ void store_row(float* p, const float* v, int n, u64) {
    for (int k = 0; k < n; ++k) p[k] = v[k];
}
__device__ __forceinline__ void store_row(__half* p, const float* v, int n, u64 key) {
    for (int k = 0; k < n; ++k) p[k] = stochastic_half(v[k], mix64(key + (u64)k));
}
__device__ __forceinline__ void store_row(__nv_bfloat16* p, const float* v, int n, u64 key) {
    for (int k = 0; k < n; ++k) p[k] = stochastic_bf16(v[k], mix64(key + (u64)k));
}

/* Rows of table t that are also rows of the weight: hash_size_cumsum is a caller's device
 * tensor, never read on the host, so a table that claims rows past R (or starts below 0) is
 * cut to the weight here and its ids beyond R are reported as bad, not read. */
__device__ __forceinline__ i64 table_rows(const i64* __restrict__ hsc, int t, i64 R) {
    const i64 base = hsc[t];
    i64 end = hsc[t + 1];
    if (end > R) end = R;
    return base < 0 || end < base ? 0 : end - base;
}

/* Offsets of bag j are trusted only after this check (FBGEMM layout: offsets[0] = 0,
 * offsets[T*B] = N, non-decreasing); a malformed bag is reported in err[1]. */
__device__ __forceinline__ bool bag_ok(i64 start, i64 end, i64 j, i64 bags, i64 N) {
    return !(start < 0 || end > N || start > end || (j == 0 && start != 0) ||
             (j == bags - 1 && end != N));
}

/* ------------------------------------------------------------------ packing */

/* recc.pack_sparse's device half (one launch for the whole group): T tables' start offsets
 * `off` [T, B] (table t's into its own ids) become the packed offsets `out` [T*B+1] into the
 * tables' ids back to back, table t's from starts[t] (`meta` = starts[0..T], starts[T] = N,
 * then each table's rows[0..T-1]), and the inputs are checked as the CPU reference checks
 * them: a table's offsets start at 0, never decrease and end within its ids (else err[1] =
 * the first bad bag j = t*B + b, atomicMin), its ids lie in [0, rows[t]) (else err[0] = the
 * first bad position).  Reads nothing out of bounds whatever the values.  The grid covers
 * max(N, T*B + 1) threads. */
extern "C" __global__ void tbe_pack(const i64* __restrict__ ids, const i64* __restrict__ off,
                                    const i64* __restrict__ meta, int T, i64 B, i64 N,
                                    i64* __restrict__ out, u64* err) {
    const i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 bags = (i64)T * B;
    if (j < bags) {
        const int t = (int)(j / B);
        const i64 b = j - (i64)t * B, o = off[j];
        const bool ok = (b == 0 ? o == 0 : o >= off[j - 1]) && (b != B - 1 || o <= meta[t + 1] - meta[t]);
        if (!ok) atomicMin(err + 1, (u64)j);
        out[j] = meta[t] + o;
    } else if (j == bags) {
        out[j] = N;
    }
    if (j >= N) return;
    int lo = 0, hi = T;  /* the table of position j: the largest t with starts[t] <= j */
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (meta[mid] <= j) lo = mid; else hi = mid;
    }
    const i64 id = ids[j];
    if (id < 0 || id >= meta[T + 1 + lo]) atomicMin(err, (u64)j);
}

/* ------------------------------------------------------------------ forward */

template <typename W, int V>
__device__ __forceinline__ void forward_body(
        const W* __restrict__ weights, int D, const i64* __restrict__ ids,
        const i64* __restrict__ offsets, const i64* __restrict__ hsc, int T, i64 B, i64 R,
        const float* __restrict__ psw, int mean, i64 N, float* __restrict__ out, u64* err,
        int lanes) {
    const i64 gid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 bag = gid / lanes;
    const int lane = (int)(gid % lanes);
    if (bag >= (i64)T * B) return;  /* no warp collectives below: an early return is safe */
    const int t = (int)(bag / B);
    const i64 b = bag - (i64)t * B;
    i64 start = offsets[bag], end = offsets[bag + 1];
    const i64 base = hsc[t], rows = table_rows(hsc, t, R);
    float* o = out + b * ((i64)T * D) + (i64)t * D;
    /* offsets are trusted only after this check: a malformed bag is reported and pooled as
     * empty, so a bad offset can never make the kernel read past `ids` */
    if (!bag_ok(start, end, bag, (i64)T * B, N)) {
        if (lane == 0) atomicMin(err + 1, (u64)bag);
        start = end = 0;
    }
    for (int d0 = lane * V; d0 < D; d0 += lanes * V) {
        float acc[V];
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] = 0.0f;
        i64 p = start;
        for (; p + 4 <= end; p += 4) {
            Vec<V> r[4];
            float s[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const i64 id = ids[p + u];
                const bool ok = id >= 0 && id < rows;
                if (!ok && d0 == lane * V) atomicMin(err, (u64)(p + u));
                s[u] = ok ? (psw ? psw[p + u] : 1.0f) : 0.0f;
                if (ok) load_row(weights + (base + id) * D + d0, r[u]);
                else {
#pragma unroll
                    for (int k = 0; k < V; ++k) r[u].v[k] = 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
#pragma unroll
                for (int k = 0; k < V; ++k) acc[k] += psw ? s[u] * r[u].v[k] : r[u].v[k];
            }
        }
        for (; p < end; ++p) {
            const i64 id = ids[p];
            if (id < 0 || id >= rows) {
                if (d0 == lane * V) atomicMin(err, (u64)p);
                continue;
            }
            Vec<V> r;
            load_row(weights + (base + id) * D + d0, r);
            const float s = psw ? psw[p] : 1.0f;
#pragma unroll
            for (int k = 0; k < V; ++k) acc[k] += psw ? s * r.v[k] : r.v[k];
        }
        if (mean && end > start) {
            const float len = (float)(end - start);
#pragma unroll
            for (int k = 0; k < V; ++k) acc[k] = acc[k] / len;
        }
#pragma unroll
        for (int k = 0; k < V; ++k) o[d0 + k] = acc[k];
    }
}

#define FORWARD(NAME, W, V)                                                                     \
    extern "C" __global__ void NAME(const W* weights, int D, const i64* ids, const i64* offsets, \
                                    const i64* hsc, int T, i64 B, i64 R, const float* psw,      \
                                    int mean, i64 N, float* out, u64* err, int lanes) {         \
        forward_body<W, V>(weights, D, ids, offsets, hsc, T, B, R, psw, mean, N, out, err,      \
                           lanes);                                                              \
    }
/* One kernel per weight type and vector width, named PREFIX_{f32,f16,bf16}_v{4,1} (tbe.py picks). */
#define EACH_WEIGHT_TYPE(M, PREFIX)                                                             \
    M(PREFIX##_f32_v4, float, 4) M(PREFIX##_f32_v1, float, 1)                                   \
    M(PREFIX##_f16_v4, __half, 4) M(PREFIX##_f16_v1, __half, 1)                                 \
    M(PREFIX##_bf16_v4, __nv_bfloat16, 4) M(PREFIX##_bf16_v1, __nv_bfloat16, 1)
EACH_WEIGHT_TYPE(FORWARD, tbe_forward)

/* ------------------------------------------------------------------ backward: linearize */

/* One thread per id: its bag by binary search over offsets (balanced whatever the bag
 * lengths), row = hsc[t] + id.  Keys are int32 (half the radix-sort passes of int64); the
 * host routes groups with R >= 2^31 - 1 rows elsewhere.  Bad ids get SENTINEL_I32, which
 * sorts after every row, and are reported in err.  Thread j < T*B also checks bag j's
 * offsets (err[1]), as the forward does: the backward may get offsets no forward has seen
 * (checked=False), and the update kernels then write nothing.  The grid covers
 * max(N, T*B) threads. */
extern "C" __global__ void tbe_linearize(const i64* __restrict__ ids,
                                         const i64* __restrict__ offsets,
                                         const i64* __restrict__ hsc, int T, i64 B, i64 R,
                                         i64 N, int* __restrict__ rows_out,
                                         int* __restrict__ bag_out, u64* err) {
    const i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (p < (i64)T * B && !bag_ok(offsets[p], offsets[p + 1], p, (i64)T * B, N))
        atomicMin(err + 1, (u64)p);
    if (p >= N) return;
    i64 lo = 0, hi = (i64)T * B;  /* largest bag j with offsets[j] <= p */
    while (hi - lo > 1) {
        const i64 mid = (lo + hi) >> 1;
        if (offsets[mid] <= p) lo = mid; else hi = mid;
    }
    const int t = (int)(lo / B);
    const i64 id = ids[p];
    const i64 base = hsc[t], rows = table_rows(hsc, t, R);
    bag_out[p] = (int)lo;
    if (id < 0 || id >= rows) {
        rows_out[p] = SENTINEL_I32;
        atomicMin(err, (u64)p);
    } else {
        rows_out[p] = (int)(base + id);
    }
}

/* ------------------------------------------------------------------ backward: runs */

/* run_idx = inclusive prefix sum of the run-start flags (computed by the host with
 * torch.cumsum over is_start, which tbe_run_flags writes).  tbe_run_bounds scatters each
 * run's first position into run_start[run - 1] and the end of the valid keys into
 * run_start[num_runs]; num_runs = run_idx[N - 1]. */
extern "C" __global__ void tbe_run_flags(const int* __restrict__ sorted, i64 N,
                                         int* __restrict__ is_start) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    const int k = sorted[i];
    is_start[i] = (k != SENTINEL_I32 && (i == 0 || sorted[i - 1] != k)) ? 1 : 0;
}

extern "C" __global__ void tbe_run_bounds(const int* __restrict__ sorted,
                                          const int* __restrict__ run_idx, i64 N,
                                          int* __restrict__ run_start) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    const int k = sorted[i];
    if (k == SENTINEL_I32) return;
    if (i == 0 || sorted[i - 1] != k) run_start[run_idx[i] - 1] = (int)i;
    if (i == N - 1 || sorted[i + 1] == SENTINEL_I32) run_start[run_idx[i]] = (int)(i + 1);
}

/* ------------------------------------------------------------------ backward: update */

struct OptArgs {
    int opt;
    float lr, eps, beta1, beta2, weight_decay, bc1, bc2;
    int decoupled; /* weight decay: 0 L2 (added to g), 1 decoupled (the row shrinks by 1 - lr*wd first) */
};

/* A step's optimizer arguments as the host wrote them (kernels/cuda/tbe.py: step_args): three
 * int64 words, the first two holding the floats lr, eps, 1 - beta1^step, 1 - beta2^step (in
 * that order, little-endian), the third the stochastic rounding's seed. */
__device__ __forceinline__ OptArgs step_args_of(const i64* __restrict__ a, int opt, float beta1, float beta2,
                                                float wd, int decoupled, u64& seed) {
    const float* f = reinterpret_cast<const float*>(a);
    seed = (u64)a[2];
    return OptArgs{opt, f[0], f[1], beta1, beta2, wd, f[2], f[3], decoupled};
}

/* One id's gradient row, already scaled: g*w for weighted sums, g/len for mean (the CPU
 * reference's rounding). */
template <int V>
__device__ __forceinline__ const float* id_row(i64 i, const i64* __restrict__ perm,
                                               const int* __restrict__ bag_of,
                                               const i64* __restrict__ offsets, int T, i64 B, int D,
                                               const float* __restrict__ go,
                                               const float* __restrict__ psw, int mean, float& mul,
                                               float& div) {
    const i64 p = perm[i];
    const int bag = bag_of[p];
    const int t = (int)(bag / B);
    const i64 b = bag - (i64)t * B;
    mul = psw ? psw[p] : 1.0f;
    div = mean ? (float)(offsets[bag + 1] - offsets[bag]) : 1.0f;
    return go + b * ((i64)T * D) + (i64)t * D;
}

/* Sum of ids [s, e) of a run into g (chunk c covers columns d_first + c*lanes*V .. +V).  Four ids are in flight at a time (their rows are independent loads; a run of hundreds
 * of ids one dependent load chain after another is what bounds the update), and they are
 * added in index order, so the sum is the one-at-a-time sum. */
template <int V>
__device__ __forceinline__ void accumulate(float (&g)[MAX_CHUNKS][V], i64 s, i64 e, int d_first, int nchunks, int lanes, int D,
                                           const i64* __restrict__ perm,
                                           const int* __restrict__ bag_of,
                                           const i64* __restrict__ offsets, int T, i64 B,
                                           const float* __restrict__ go,
                                           const float* __restrict__ psw, int mean) {
    constexpr int U = 4;
    for (i64 i = s; i < e; i += U) {
        const float* gr[U];
        float mul[U], div[U];
        int n = 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64 j = i + u;
            if (j < e) {
                gr[u] = id_row<V>(j, perm, bag_of, offsets, T, B, D, go, psw, mean, mul[u], div[u]);
                n = u + 1;
            }
        }
#pragma unroll
        for (int c = 0; c < MAX_CHUNKS; ++c) {
            const int d0 = d_first + c * lanes * V;
            if (c >= nchunks || d0 >= D) continue;
            Vec<V> r[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (u < n) load_row(gr[u] + d0, r[u]);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u >= n) break;
#pragma unroll
                for (int k = 0; k < V; ++k)
                    g[c][k] += mean ? r[u].v[k] / div[u] : (psw ? r[u].v[k] * mul[u] : r[u].v[k]);
            }
        }
    }
}

/* A group's row of D floats as MAX_CHUNKS chunks of V per lane (lane's columns lane*V + cc*lanes*V):
 * cleared, a row of global floats added into it, or stored to one. */
template <int V>
__device__ __forceinline__ void zero_chunks(float (&g)[MAX_CHUNKS][V]) {
#pragma unroll
    for (int cc = 0; cc < MAX_CHUNKS; ++cc)
#pragma unroll
        for (int kk = 0; kk < V; ++kk) g[cc][kk] = 0.0f;
}

template <int V>
__device__ __forceinline__ void add_row_chunks(float (&g)[MAX_CHUNKS][V], const float* row, int lane,
                                               int nchunks, int lanes, int D) {
#pragma unroll
    for (int cc = 0; cc < MAX_CHUNKS; ++cc) {
        const int d0 = lane * V + cc * lanes * V;
        if (cc >= nchunks || d0 >= D) continue;
        Vec<V> r;
        load_row(row + d0, r);
#pragma unroll
        for (int kk = 0; kk < V; ++kk) g[cc][kk] += r.v[kk];
    }
}

template <int V>
__device__ __forceinline__ void store_row_chunks(float* out, const float (&g)[MAX_CHUNKS][V], int lane,
                                                 int nchunks, int lanes, int D) {
#pragma unroll
    for (int cc = 0; cc < MAX_CHUNKS; ++cc) {
        const int d0 = lane * V + cc * lanes * V;
        if (cc < nchunks && d0 < D)
#pragma unroll
            for (int kk = 0; kk < V; ++kk) out[d0 + kk] = g[cc][kk];
    }
}

/* Long runs (more than `seg` ids) are summed in two steps, so a hot row's thousands of ids
 * are spread over many groups instead of one: a long run [s, e) of the sorted ids is cut into
 * chunks of `seg` ids counted from its own start, chunk k = [s + k*seg, min(s + (k+1)*seg, e)),
 * tbe_long_run_partials sums each chunk (its ids one at a time, in index order) into a partial
 * row, and tbe_long_run_combine adds a run's partials up (below).  The cuts are relative to the
 * run, so its sum depends only on its own ids: not on the schedule, nor on where the run lands
 * in the sorted batch (how many ids the rows sorted before it have, how rows are numbered).
 *
 * Where a chunk's partial goes: chunk k of a run starts at q = s + k*seg, in segment q / seg of
 * the sorted positions (segments of `seg` positions, used only to place partials), and is
 * written to partials[q / seg][slot][D] with slot 1 for a run's first chunk (k = 0) and slot 0
 * for a later one.  No two chunks share a place: a segment holds at most one first chunk (a long
 * run that starts in a segment ends past it, so the next run starts in a later segment) and at
 * most one later chunk (a later chunk's run covers the `seg` positions before its start, so a
 * chunk start less than `seg` before it is of the same run, whose chunk starts are `seg` apart).
 * [2 * segments, D] holds them all.  A group sums at most two chunks: up to 2 * seg ids.
 *
 * Who sums a chunk: segment c's group, for each chunk that starts in the segment.  Such a chunk
 * belongs to the run that covers the segment's first position or to the run that covers its
 * last (a run between them lies inside the segment: it is not long; a long run that starts in
 * the segment is longer than it, so it covers the segment's last position). */
template <int V>
__device__ __forceinline__ void long_run_partials_body(
        const int* __restrict__ sorted, const int* __restrict__ run_idx,
        const int* __restrict__ run_start, const i64* __restrict__ perm,
        const int* __restrict__ bag_of, const i64* __restrict__ offsets, int T, i64 B,
        const float* __restrict__ go, const float* __restrict__ psw, int mean, i64 N, int D,
        int lanes, int seg, float* __restrict__ partials, const u64* err) {
    /* A bad id (sorted last as SENTINEL_I32) sets err: past this line every position is valid. */
    if (err[0] != ERR_NONE || err[1] != ERR_NONE) return;
    const int lane = threadIdx.x % lanes;
    const i64 group = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / lanes;
    const i64 groups = ((i64)gridDim.x * blockDim.x) / lanes;
    const int nchunks = (D + lanes * V - 1) / (lanes * V);
    const i64 segments = (N + seg - 1) / seg;
    for (i64 c = group; c < segments; c += groups) {
        const i64 p0 = c * seg, p1 = min(p0 + (i64)seg, N);
        const int first = run_idx[p0] - 1, last = run_idx[p1 - 1] - 1;
        for (int which = 0; which < 2; ++which) {
            const int run = which == 0 ? first : last;
            if (which == 1 && last == first) break;
            const i64 s = run_start[run], e = run_start[run + 1];
            if (e - s <= seg) continue;
            /* the run's first chunk start at or after p0 */
            const i64 k = s >= p0 ? 0 : (p0 - s + seg - 1) / seg;
            const i64 q = s + k * seg;
            if (q >= p1 || q >= e) continue;
            float g[MAX_CHUNKS][V];
            zero_chunks<V>(g);
            accumulate<V>(g, q, min(e, q + (i64)seg), lane * V, nchunks, lanes, D, perm, bag_of,
                          offsets, T, B, go, psw, mean);
            float* out = partials + (c * 2 + (k == 0 ? 1 : 0)) * (i64)D;
            store_row_chunks<V>(out, g, lane, nchunks, lanes, D);
        }
    }
}

#define PARTIALS(NAME, V)                                                                       \
    extern "C" __global__ void NAME(const int* sorted, const int* run_idx, const int* run_start, \
                                    const i64* perm, const int* bag_of, const i64* offsets,     \
                                    int T, i64 B, const float* go, const float* psw, int mean,  \
                                    i64 N, int D, int lanes, int seg, float* partials,          \
                                    const u64* err) {                                          \
        long_run_partials_body<V>(sorted, run_idx, run_start, perm, bag_of, offsets, T, B, go, \
                                  psw, mean, N, D, lanes, seg, partials, err);                  \
    }
PARTIALS(tbe_long_run_partials_v4, 4)
PARTIALS(tbe_long_run_partials_v1, 1)

/* A long run's chunk partials are then added up by a tree of launches, `fanin` children a node:
 * level l (1, 2, ...) sums node m of a run, its level-(l-1) values for chunks
 * [m*fanin^l, (m+1)*fanin^l) (children i = 0..fanin-1, fanin^(l-1) chunks each), one after another
 * in child order, and writes the sum in place of the node's first child (the partial of chunk
 * m*fanin^l).  After the last level a run's whole gradient is its first chunk's partial, and the
 * update reads that one row.  The tree is cut from the run's own start, like its chunks, so the
 * order of additions depends only on the run's ids; a group adds at most 2 * fanin rows for a
 * level-segment, however long the run (the host launches levels while span < N: log_fanin(N / seg)).
 *
 * Who sums a node at level l: with span = seg * fanin^(l-1) (the ids under one child), the
 * group of level-segment c = [c*span, (c+1)*span) of the sorted positions, for each child start
 * in it that starts a node (child index a multiple of fanin) with a sibling after it.  Only runs
 * longer than span have such a node, so, as for chunks, such a child belongs to the run covering
 * the level-segment's first position or the one covering its last, and a run has at most one
 * child start in a level-segment (its child starts are span apart).  Nodes are disjoint, so no
 * group reads a row another group of the same launch writes. */
template <int V>
__device__ __forceinline__ void long_run_combine_body(
        const int* __restrict__ run_idx, const int* __restrict__ run_start, i64 N, int D,
        int lanes, int seg, i64 span, int fanin, float* __restrict__ partials, const u64* err) {
    if (err[0] != ERR_NONE || err[1] != ERR_NONE) return;
    const int lane = threadIdx.x % lanes;
    const i64 group = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / lanes;
    const i64 groups = ((i64)gridDim.x * blockDim.x) / lanes;
    const int nchunks = (D + lanes * V - 1) / (lanes * V);
    const i64 segments = (N + span - 1) / span;
    for (i64 c = group; c < segments; c += groups) {
        const i64 p0 = c * span, p1 = min(p0 + span, N);
        const int first = run_idx[p0] - 1, last = run_idx[p1 - 1] - 1;
        for (int which = 0; which < 2; ++which) {
            const int run = which == 0 ? first : last;
            if (which == 1 && last == first) break;
            const i64 s = run_start[run], e = run_start[run + 1];
            if (e - s <= span) continue;
            /* the run's first child start at or after p0 */
            const i64 k = s >= p0 ? 0 : (p0 - s + span - 1) / span;
            const i64 q = s + k * span;
            if (q >= p1 || k % fanin != 0 || q + span >= e) continue;
            float g[MAX_CHUNKS][V];
            zero_chunks<V>(g);
            for (int i = 0; i < fanin; ++i) {
                const i64 qi = q + i * span;
                if (qi >= e) break;
                const float* row = partials + ((qi / seg) * 2 + (qi == s ? 1 : 0)) * (i64)D;
                add_row_chunks<V>(g, row, lane, nchunks, lanes, D);
            }
            float* out = partials + ((q / seg) * 2 + (k == 0 ? 1 : 0)) * (i64)D;
            store_row_chunks<V>(out, g, lane, nchunks, lanes, D);
        }
    }
}

#define COMBINE(NAME, V)                                                                        \
    extern "C" __global__ void NAME(const int* run_idx, const int* run_start, i64 N, int D,      \
                                    int lanes, int seg, i64 span, int fanin, float* partials,   \
                                    const u64* err) {                                          \
        long_run_combine_body<V>(run_idx, run_start, N, D, lanes, seg, span, fanin, partials,   \
                                 err);                                                          \
    }
COMBINE(tbe_long_run_combine_v4, 4)
COMBINE(tbe_long_run_combine_v1, 1)

/* Applies the optimizer to one row.  All lanes of the warp call it (inactive groups with
 * active = false), because rowwise_adagrad reduces over the group with shuffles. */
template <typename W, int V>
__device__ __forceinline__ void apply_row(float (&g)[MAX_CHUNKS][V], bool active, i64 row,
                                          int d_first, int nchunks, int lanes, int D,
                                          W* __restrict__ weights, float* __restrict__ m1,
                                          float* __restrict__ m2, const OptArgs& o, u64 seed,
                                          const i64* __restrict__ key_rows) {
    float w[MAX_CHUNKS][V];
    float sq = 0.0f;
#pragma unroll
    for (int c = 0; c < MAX_CHUNKS; ++c) {
        const int d0 = d_first + c * lanes * V;
        const bool here = active && c < nchunks && d0 < D;
        Vec<V> r;
        if (here) load_row(weights + row * D + d0, r);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            w[c][k] = here ? r.v[k] : 0.0f;
            if (here && o.weight_decay != 0.0f) {
                if (o.decoupled) w[c][k] *= 1.0f - o.lr * o.weight_decay;
                else g[c][k] += o.weight_decay * w[c][k];
            }
            if (here) sq += g[c][k] * g[c][k];
        }
    }
    float row_scale = 0.0f;
    if (o.opt == OPT_ROWWISE_ADAGRAD) {
        const float m_old = active ? m1[row] : 0.0f;
        for (int off = lanes >> 1; off > 0; off >>= 1) sq += __shfl_xor_sync(0xFFFFFFFFu, sq, off);
        /* every lane of the group has read m1[row] before its column-0 lane overwrites it
         * (lanes of a warp are not lockstep under independent thread scheduling) */
        __syncwarp();
        if (active) {
            const float m = m_old + sq / (float)D;
            row_scale = o.lr / (sqrtf(m) + o.eps);
            if (d_first == 0) m1[row] = m;
        }
    }
    if (!active) return;
    /* the rounding's key: (row or the row it stands for) * D + column */
    const i64 key_row = key_rows ? key_rows[row] : row;
#pragma unroll
    for (int c = 0; c < MAX_CHUNKS; ++c) {
        const int d0 = d_first + c * lanes * V;
        if (c >= nchunks || d0 >= D) continue;
        const i64 at = row * D + d0;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float gk = g[c][k];
            float wk = w[c][k];
            if (o.opt == OPT_SGD) {
                wk -= o.lr * gk;
            } else if (o.opt == OPT_ROWWISE_ADAGRAD) {
                wk -= row_scale * gk;
            } else if (o.opt == OPT_ADAGRAD) {
                const float s = m1[at + k] + gk * gk;
                m1[at + k] = s;
                wk -= o.lr * gk / (sqrtf(s) + o.eps);
            } else {
                const float m = o.beta1 * m1[at + k] + (1.0f - o.beta1) * gk;
                const float v = o.beta2 * m2[at + k] + (1.0f - o.beta2) * gk * gk;
                m1[at + k] = m;
                m2[at + k] = v;
                wk -= o.lr * (m / o.bc1) / (sqrtf(v / o.bc2) + o.eps);
            }
            w[c][k] = wk;
        }
        store_row(weights + at, w[c], V, seed ^ mix64((u64)(key_row * D + d0)));
    }
}

/* One group of `lanes` threads per run (grid-stride over runs): a short run's ids summed in
 * index order, a long run's gradient read from its combined row; the optimizer applied once. */
template <typename W, int V>
__device__ __forceinline__ void update_body(
        W* __restrict__ weights, int D, float* __restrict__ m1, float* __restrict__ m2,
        const int* __restrict__ sorted, const i64* __restrict__ perm,
        const int* __restrict__ bag_of, const int* __restrict__ run_start,
        const int* __restrict__ num_runs_at, const i64* __restrict__ offsets, int T, i64 B,
        const float* __restrict__ go, const float* __restrict__ psw, int mean, OptArgs o,
        u64 seed, const i64* __restrict__ key_rows, int lanes, int seg, const float* __restrict__ partials,
        const u64* err) {
    if (err[0] != ERR_NONE || err[1] != ERR_NONE) return;
    const i64 num_runs = *num_runs_at;
    const int groups_per_warp = 32 / lanes;
    const int lane = threadIdx.x % lanes;
    const int group = (threadIdx.x % 32) / lanes;
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const i64 warps = ((i64)gridDim.x * blockDim.x) / 32;
    const int nchunks = (D + lanes * V - 1) / (lanes * V);
    /* The loop bound is per warp, so every lane of a warp runs the same iterations and the
     * shuffles in apply_row see the whole warp. */
    for (i64 base = warp * groups_per_warp; base < num_runs; base += warps * groups_per_warp) {
        const i64 run = base + group;
        const bool active = run < num_runs;
        i64 s = 0, e = 0;
        if (active) {
            s = run_start[run];
            e = run_start[run + 1];
        }
        float g[MAX_CHUNKS][V];
        zero_chunks<V>(g);
        if (active && e - s > seg) {
            /* a long run: its whole gradient, left by the last combine level in place of its
             * first chunk's partial */
            const float* row = partials + ((s / seg) * 2 + 1) * (i64)D;
            add_row_chunks<V>(g, row, lane, nchunks, lanes, D);
        } else if (active)
            accumulate<V>(g, s, e, lane * V, nchunks, lanes, D, perm, bag_of, offsets, T, B,
                          go, psw, mean);
        apply_row<W, V>(g, active, active ? (i64)sorted[s] : 0, lane * V, nchunks, lanes, D,
                        weights, m1, m2, o, seed, key_rows);
    }
}

/* The step's arguments (lr, eps, the bias corrections, the rounding seed) are read from the
 * device (`step_args`, see step_args_of below), not passed by value: a launch captured in a CUDA
 * graph replays its by-value arguments frozen, and these change every step. */
#define UPDATE(NAME, W, V)                                                                     \
    extern "C" __global__ void NAME(W* weights, int D, float* m1, float* m2, const int* sorted, \
                                    const i64* perm, const int* bag_of, const int* run_start,  \
                                    const int* num_runs_at, const i64* offsets, int T, i64 B,  \
                                    const float* go, const float* psw, int mean, int opt,      \
                                    float beta1, float beta2, float wd, int decoupled,         \
                                    const i64* step_args, const i64* key_rows, int lanes,      \
                                    int seg, const float* partials, const u64* err) {          \
        u64 seed;                                                                              \
        const OptArgs o = step_args_of(step_args, opt, beta1, beta2, wd, decoupled, seed);     \
        update_body<W, V>(weights, D, m1, m2, sorted, perm, bag_of, run_start, num_runs_at,    \
                          offsets, T, B, go, psw, mean, o, seed, key_rows, lanes, seg, partials, \
                          err);                                                                \
    }
EACH_WEIGHT_TYPE(UPDATE, tbe_update)
