/*
 * recc.dot_interaction on CUDA: forward and backward, one launch each (interaction.py wraps them).
 *
 * Sample b has F interacting vectors of D values: v_0 is row b of `dense`, and vector f >= 1 is
 * the D columns of a block starting at a column, read in place (no stack, no split).  The
 * sources are the pointers s0 .. s4 (s0 = dense, s1.. = the blocks), each with its row stride
 * ld (elements) and dtype (bit s of bf16_mask: bf16, else fp32).  `layout` (int32, built and
 * cached by interaction.py from the op's static `features`) holds:
 *   [0, 2F)               (source, first column) of every vector;
 *   [2F, 2F + W + 1)      colptr: for column e of the sources laid side by side (W = sum of
 *                         their widths), its entries are colsrc[colptr[e] .. colptr[e + 1]);
 *   [2F + W + 1, ...)     colsrc: those entries, f * S + d (where the vector element that
 *                         reads column e sits in the shared-memory copy below), f ascending;
 *                         a column no vector reads has none, one read twice has two.
 *
 * Forward: out row b = [v_0 | <v_li[p], v_lj[p]> for p < P | pad zeros], in dense's dtype.
 * Backward: for the output gradient g, dv_f = [f == 0] g[:D] + sum over the pairs p that hold f
 * of g[D + p] * (the pair's other vector) (twice for a pair (f, f)), and every source's gradient
 * row: each column the sum of the dv elements that read it (zero where none does), in the
 * source's dtype.
 *
 * One block owns a sample (blocks stride over the batch): it copies the sample's F vectors into
 * shared memory as fp32, each thread computes whole dot products / whole gradient elements in a
 * fixed order, so there are no atomics and the results do not depend on the grid or on thread
 * order (deterministic).  Shared rows are S = D | 1 floats apart: threads of a warp read one
 * element of different vectors (the pairs of DLRM's triangle hold consecutive lj), and an odd
 * stride puts them in different banks.  All products and sums are fp32; a bf16 output or
 * gradient is rounded once, to nearest even (as torch's .to(torch.bfloat16), NaN 0x7FC0).
 *
 * The backward needs, for each vector, the pairs that hold it.  li/lj live on the device and
 * reading them on the host would sync, so each block builds the lists once in shared memory
 * (one thread per vector scans the pairs in order: deterministic) and reuses them for all its
 * samples.  A pair index outside [0, F) stops the kernel with __trap() (a sticky CUDA error,
 * like torch's device-side assert on a bad index): it is never a read outside the vectors.
 *
 * Shared memory (bytes; interaction.py sizes the launch with the same formulas and refuses
 * what exceeds the device's 48 KiB):
 *   forward:  8F pointers, 8F strides, 4F dtypes, 8P pair indices, 4 F S vectors;
 *   backward: 8F, 8F, 4F, 4(F + 1) list starts, 16P list entries, 4P pair gradients,
 *             8 F S (vectors and their gradients).
 */
typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ float bf16_to_f32(unsigned short h) { return __uint_as_float((unsigned int)h << 16); }

__device__ __forceinline__ unsigned short f32_to_bf16(float x) {
    const unsigned int u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  /* NaN, as torch writes it */
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float load_value(const char* p, int bf, i64 i) {
    return bf ? bf16_to_f32(reinterpret_cast<const unsigned short*>(p)[i]) : reinterpret_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_value(void* p, int bf, i64 i, float x) {
    if (bf) reinterpret_cast<unsigned short*>(p)[i] = f32_to_bf16(x);
    else reinterpret_cast<float*>(p)[i] = x;
}

/* argument s of five (a launch takes up to five blocks' pointers and strides by value) */
template <typename T>
__device__ __forceinline__ T pick(int s, T a0, T a1, T a2, T a3, T a4) {
    switch (s) {
    case 0: return a0;
    case 1: return a1;
    case 2: return a2;
    case 3: return a3;
    default: return a4;
    }
}

/* 8-byte words: the pointers and strides at its start are 8-byte aligned */
extern __shared__ u64 smem[];

/* Per block: where each vector's row 0 starts (bytes), its row stride (bytes) and dtype. */
__device__ __forceinline__ void vector_sources(const int* __restrict__ layout, int F, const void* s0, const void* s1,
                                               const void* s2, const void* s3, const void* s4, i64 ld0, i64 ld1,
                                               i64 ld2, i64 ld3, i64 ld4, int bf16_mask, u64* vbase, i64* vld,
                                               int* vbf) {
    for (int f = threadIdx.x; f < F; f += blockDim.x) {
        const int s = layout[2 * f], col = layout[2 * f + 1];
        const int bf = (bf16_mask >> s) & 1;
        const i64 es = bf ? 2 : 4;
        vbase[f] = (u64)(reinterpret_cast<const char*>(pick(s, s0, s1, s2, s3, s4)) + col * es);
        vld[f] = pick(s, ld0, ld1, ld2, ld3, ld4) * es;
        vbf[f] = bf;
    }
}

/* Sample b's vectors into v (F rows of S floats). */
__device__ __forceinline__ void stage_vectors(i64 b, int F, int D, int S, const u64* vbase, const i64* vld,
                                              const int* vbf, float* v) {
    for (int e = threadIdx.x; e < F * D; e += blockDim.x) {
        const int f = e / D, d = e - f * D;
        v[f * S + d] = load_value(reinterpret_cast<const char*>(vbase[f]) + b * vld[f], vbf[f], d);
    }
}

extern "C" __global__ void interaction_forward(const void* s0, const void* s1, const void* s2, const void* s3,
                                               const void* s4, i64 ld0, i64 ld1, i64 ld2, i64 ld3, i64 ld4,
                                               int bf16_mask, const int* __restrict__ layout,
                                               const i64* __restrict__ li, const i64* __restrict__ lj, i64 B, int F,
                                               int D, int P, int pad, void* out, i64 ldo) {
    const int S = D | 1;
    u64* vbase = smem;
    i64* vld = reinterpret_cast<i64*>(vbase + F);
    int* vbf = reinterpret_cast<int*>(vld + F);
    int* pi = vbf + F;
    int* pj = pi + P;
    float* v = reinterpret_cast<float*>(pj + P);
    const int out_bf = bf16_mask & 1;  /* the output has dense's dtype */
    vector_sources(layout, F, s0, s1, s2, s3, s4, ld0, ld1, ld2, ld3, ld4, bf16_mask, vbase, vld, vbf);
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const i64 i = li[p], j = lj[p];
        if (i < 0 || i >= F || j < 0 || j >= F) __trap();
        pi[p] = (int)i;
        pj[p] = (int)j;
    }
    for (i64 b = blockIdx.x; b < B; b += gridDim.x) {
        __syncthreads();  /* the setup, or the previous sample's dot products, are done with v */
        stage_vectors(b, F, D, S, vbase, vld, vbf, v);
        for (int c = threadIdx.x; c < pad; c += blockDim.x) store_value(out, out_bf, b * ldo + D + P + c, 0.0f);
        __syncthreads();
        /* dense passes through: its values as read (widened and rounded back: exact) */
        for (int d = threadIdx.x; d < D; d += blockDim.x) store_value(out, out_bf, b * ldo + d, v[d]);
        for (int p = threadIdx.x; p < P; p += blockDim.x) {
            const float* x = v + pi[p] * S;
            const float* y = v + pj[p] * S;
            float acc = 0.0f;
            for (int d = 0; d < D; ++d) acc += x[d] * y[d];
            store_value(out, out_bf, b * ldo + D + p, acc);
        }
    }
}

extern "C" __global__ void interaction_backward(const void* s0, const void* s1, const void* s2, const void* s3,
                                                const void* s4, i64 ld0, i64 ld1, i64 ld2, i64 ld3, i64 ld4,
                                                int bf16_mask, const int* __restrict__ layout,
                                                const i64* __restrict__ li, const i64* __restrict__ lj, i64 B,
                                                int F, int D, int P, const void* g, i64 ldg, int g_bf16, void* d0,
                                                void* d1, void* d2, void* d3, void* d4, i64 w0, i64 w1, i64 w2,
                                                i64 w3, i64 w4) {
    const int S = D | 1;
    u64* vbase = smem;
    i64* vld = reinterpret_cast<i64*>(vbase + F);
    int* vbf = reinterpret_cast<int*>(vld + F);
    int* start = vbf + F;         /* vector f's list: entries start[f] .. start[f + 1] */
    int* inc_p = start + F + 1;   /* an entry: the pair ... */
    int* inc_j = inc_p + 2 * P;   /* ... and the pair's other vector */
    float* gp = reinterpret_cast<float*>(inc_j + 2 * P);
    float* v = gp + P;
    float* dv = v + F * S;
    const i64 W = w0 + w1 + w2 + w3 + w4;
    const int* colptr = layout + 2 * F;
    const int* colsrc = colptr + W + 1;
    const char* gb = reinterpret_cast<const char*>(g);
    const i64 ges = g_bf16 ? 2 : 4;

    vector_sources(layout, F, s0, s1, s2, s3, s4, ld0, ld1, ld2, ld3, ld4, bf16_mask, vbase, vld, vbf);
    /* The pair lists: count, then starts (one thread: F is small), then fill in pair order. */
    for (int f = threadIdx.x; f < F; f += blockDim.x) {
        int n = 0;
        for (int p = 0; p < P; ++p) {
            const i64 i = li[p], j = lj[p];
            if (i < 0 || i >= F || j < 0 || j >= F) __trap();
            n += (i == f) + (j == f);
        }
        start[f + 1] = n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        start[0] = 0;
        for (int f = 0; f < F; ++f) start[f + 1] += start[f];
    }
    __syncthreads();
    for (int f = threadIdx.x; f < F; f += blockDim.x) {
        int k = start[f];
        for (int p = 0; p < P; ++p) {
            const int i = (int)li[p], j = (int)lj[p];
            if (i == f) { inc_p[k] = p; inc_j[k] = j; ++k; }
            if (j == f) { inc_p[k] = p; inc_j[k] = i; ++k; }
        }
    }

    /* No barrier at a sample's start: the count's barriers ordered the setup's writes, and the
     * previous sample's last phase reads only dv, which this one writes after its next barrier. */
    for (i64 b = blockIdx.x; b < B; b += gridDim.x) {
        stage_vectors(b, F, D, S, vbase, vld, vbf, v);
        const char* grow = gb + b * ldg * ges;
        for (int p = threadIdx.x; p < P; p += blockDim.x) gp[p] = load_value(grow, g_bf16, D + p);
        __syncthreads();
        for (int e = threadIdx.x; e < F * D; e += blockDim.x) {
            const int f = e / D, d = e - f * D;
            float acc = f == 0 ? load_value(grow, g_bf16, d) : 0.0f;  /* dense's own columns of the output */
            for (int k = start[f]; k < start[f + 1]; ++k) acc += gp[inc_p[k]] * v[inc_j[k] * S + d];
            dv[f * S + d] = acc;
        }
        __syncthreads();
        for (i64 e = threadIdx.x; e < W; e += blockDim.x) {
            /* column c of source s */
            int s = 0;
            i64 c = e;
            if (c >= w0) { c -= w0; s = 1;
                if (c >= w1) { c -= w1; s = 2;
                    if (c >= w2) { c -= w2; s = 3;
                        if (c >= w3) { c -= w3; s = 4; } } } }
            float acc = 0.0f;
            for (int k = colptr[e]; k < colptr[e + 1]; ++k) acc += dv[colsrc[k]];
            store_value(const_cast<void*>(pick(s, d0, d1, d2, d3, d4)), (bf16_mask >> s) & 1,
                        b * pick(s, w0, w1, w2, w3, w4) + c, acc);
        }
    }
}
