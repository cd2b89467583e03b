/* DLRM dot interaction, pair by pair (recc.pairwise_dot and recc.dot_interaction).
 *
 * Sample b has F interacting vectors of D floats, v_0 .. v_{F-1}; vector f is read from
 * blk[fblk[f]] + b * bld[fblk[f]] + fcol[f], so the vectors can be columns of the tensors that
 * hold them (the dense MLP output, a table group's batched lookup) and nothing is stacked.
 * Output row b (out + b * ldo) is [v_head (D floats, when head >= 0) | <v_li[p], v_lj[p]> for
 * p < P | pad zeros]: recc.dot_interaction writes the top MLP's whole (K-padded) input, and
 * recc.pairwise_dot is the case of one [B, F*D] block, no head and no padding.
 *
 * torch computes this as bmm(x, x^T) followed by an index gather: for the small F x F matrices
 * of a DLRM, batched GEMM runs far below the machine's speed, and the gather's backward is a
 * scatter-add into a zero-filled F x F gradient.  Here every sample is independent, so the
 * batch is split across threads with no synchronisation.
 *
 * Forward, for vectors of 32+ floats (a multiple of 16): each requested pair's dot product
 * directly, 16 lanes of partial sums added in a fixed order. Otherwise it builds each sample's
 * Gram matrix Z = x x^T with a register-blocked micro-kernel: 4 rows of x against 16 columns of a
 * zero-padded transposed copy, accumulators kept in registers across the whole D loop (a plain
 * dot product of D floats is too short to vectorise: the horizontal sum dominates), for the
 * tiles that hold a requested pair.  For DLRM's triangle of pairs each tile row's pairs are
 * consecutive in the output and are stored there directly; other pair lists are read out of Z.
 * The next samples' vectors are prefetched.  DLRM's own case, D = 16 and the triangle, has an
 * AVX-512 kernel (tri16): 16 columns of x^T at a time held in registers (transposed there), up
 * to 8 rows of x against them at once, and each row's pairs stored, rounded to bf16 when the
 * output is, straight into the output row: no x^T, Z or fp32 row in memory.  Backward computes
 * dx = G x for the pair gradient G (see recc_interaction_backward; DLRM's case: tri16_backward).
 *
 * With AVX-512 the micro-kernels are intrinsics: zmm registers and fused multiply-adds (one
 * rounding instead of two; a product of two bf16 values is exact in fp32, so for bf16 inputs
 * the results are the same bits as with a multiply and an add), and bf16 is widened and rounded
 * 16 values at a time.  Without AVX-512 they are GNU C vectors of 8 floats and scalar code.
 * gcc prefers 256-bit vectors on these Xeons, and a 64-byte GNU vector loaded with memcpy was
 * moved through the stack as two 32-byte stores and a 64-byte load, which waits for both stores
 * to complete (no store forwarding): small's direct path (D = 64) ran at a tenth of its speed.
 * Measured on a 2-vCPU Intel Xeon with AMX (gcc 12), the kernel alone, 2 threads (1 thread):
 * kaggle's shape (B = 4096, F = 27, D = 16, bf16) forward 1.05 -> 0.49 ms (2.2 -> 1.0 ms),
 * backward 1.1 -> 0.55 ms (2.3 -> 1.15 ms); small's (B = 2048, F = 9, D = 64) forward
 * 2.0 -> 0.17 ms, backward 0.40 -> 0.29 ms; fp32 alike.
 *
 * Mixed precision: each block is fp32 or bf16 (bdt[k]: 0 or 1), and so are the output (and in
 * backward the output's gradient). A bf16 vector is widened into a per-thread fp32 copy when the
 * sample is read, every product and sum is fp32, and a bf16 output or gradient is rounded (to
 * nearest even, as torch's .to(torch.bfloat16), bit for bit as f32_to_bf16: vcvtneps2bf16 would
 * flush denormals) once, when it is stored. So a bf16 bottom MLP's output, fp32 pooled
 * embeddings and a bf16 top MLP meet with no cast kernel and no fp32 copy of the [B, D + P] row
 * in memory.
 *
 * Pair cells and pair indices are int32: the callers keep F <= 32768 and P < 2^31 (the torch
 * reference runs beyond).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* v16f (a zmm register with AVX-512, else two GNU C vectors of 8), widen16/narrow16 (bf16 lanes)
 * and RECC_AVX512: the AVX-512 paths also use masked byte/word loads and stores (BW, VL), which
 * vec.h requires for its AVX-512 form. Without them the same loops are GNU C vectors and scalar
 * code. */
#include "vec.h"

#define RB 4  /* rows of x per micro-tile */
#define CB 16 /* columns (of x^T, or of D) per micro-tile: one AVX-512 vector, two AVX2 vectors */

static inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static void widen(const uint16_t *src, float *dst, int64_t n) {
#ifdef RECC_AVX512
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store16(dst + i, load16_bf16(src + i));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(dst + i, m, widen16(_mm256_maskz_loadu_epi16(m, src + i)));
    }
#else
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
#endif
}

static void narrow(const float *src, uint16_t *dst, int64_t n) {
#ifdef RECC_AVX512
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store16_bf16(dst + i, load16(src + i));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_cvtepi32_storeu_epi16(dst + i, m, narrow16(_mm512_maskz_loadu_ps(m, src + i)));
    }
#else
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
#endif
}

/* <a, c> over D floats, D a multiple of 16: 16 lanes of partial sums, then halves added
 * (16 -> 8 -> 4 -> 2 -> 1 lanes, a fixed order). */
static inline float dot16(const float *a, const float *c, int64_t D) {
    v16f acc = splat16(0.f);
    for (int64_t d = 0; d < D; d += 16) acc = fma16(load16(a + d), load16(c + d), acc);
#ifdef RECC_AVX512
    return _mm512_reduce_add_ps(acc);
#else
    typedef float v4f __attribute__((vector_size(16), aligned(4)));
    const v8f s8 = acc.lo + acc.hi;
    v4f lo4, hi4;
    memcpy(&lo4, &s8, sizeof lo4);
    memcpy(&hi4, (const char *)&s8 + sizeof lo4, sizeof hi4);
    const v4f s4 = lo4 + hi4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

/* 1 when the pairs are the strict lower triangle in row-major order (DLRM's
 * tril_indices(F, F, -1): (1,0), (2,0), (2,1), ...), 2 with the diagonal (offset 0: (0,0), (1,0),
 * (1,1), ...), else 0. Row i's pairs then sit together in the output, from tri_start(i) on. */
static int triangle(const int64_t *li, const int64_t *lj, int64_t P, int64_t F) {
    for (int diag = 0; diag <= 1; ++diag) {
        int64_t p = 0;
        int ok = 1;
        for (int64_t i = 0; i < F && ok; ++i)
            for (int64_t j = 0; j < i + diag && ok; ++j, ++p) ok = p < P && li[p] == i && lj[p] == j;
        if (ok && p == P) return 1 + diag;
    }
    return 0;
}

static inline int64_t tri_start(int64_t i, int tri) { return tri == 2 ? i * (i + 1) / 2 : i * (i - 1) / 2; }

/* The first n (1..16) floats of x to dst: one masked store with AVX-512, else two overlapping
 * copies of a fixed size (a copy of n floats is a loop whose trip count changes every row). */
static inline void store_prefix(float *dst, v16f x, int64_t n) {
#ifdef RECC_AVX512
    _mm512_mask_storeu_ps(dst, (__mmask16)((1u << n) - 1u), x);
#else
    float f[16];
    store16(f, x);
    if (n >= 8) {
        memcpy(dst, f, 8 * sizeof(float));
        memcpy(dst + n - 8, f + n - 8, 8 * sizeof(float));
    } else if (n >= 4) {
        memcpy(dst, f, 4 * sizeof(float));
        memcpy(dst + n - 4, f + n - 4, 4 * sizeof(float));
    } else {
        for (int64_t k = 0; k < n; ++k) dst[k] = f[k];
    }
#endif
}

/* acc[r] = row i0 + r of the Gram matrix, columns j0 .. j0 + 15: the sum over d of
 * v[i0 + r][d] * xt[d][j0 ..], accumulators in registers across the whole D loop. Inlined with
 * D = 16 a constant for kaggle's shape without AVX-512 (the forward ~15% faster with AVX2). */
static inline __attribute__((always_inline)) void gram_tile(const float *const *v, const float *xt, int64_t Fc,
                                                            int64_t D, int64_t i0, int64_t j0, v16f acc[RB]) {
    for (int r = 0; r < RB; ++r) acc[r] = splat16(0.f);
    for (int64_t d = 0; d < D; ++d) {
        const v16f col = load16(xt + d * Fc + j0);
        for (int r = 0; r < RB; ++r) acc[r] = fma16(splat16(v[i0 + r][d]), col, acc[r]);
    }
}

#ifdef RECC_AVX512
/* r[0..15] (rows of a 16 x 16 block) transposed in registers: unpack, then 64- and 128-bit
 * shuffles, 64 instructions. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int k = 0; k < 8; ++k) {
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; ++k) {
        r[4 * k + 0] = _mm512_shuffle_ps(t[4 * k + 0], t[4 * k + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * k + 1] = _mm512_shuffle_ps(t[4 * k + 0], t[4 * k + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; ++k) {
        t[k] = _mm512_shuffle_f32x4(r[k], r[k + 4], 0x88);
        t[k + 4] = _mm512_shuffle_f32x4(r[k], r[k + 4], 0xdd);
        t[k + 8] = _mm512_shuffle_f32x4(r[k + 8], r[k + 12], 0x88);
        t[k + 12] = _mm512_shuffle_f32x4(r[k + 8], r[k + 12], 0xdd);
    }
    for (int k = 0; k < 8; ++k) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
    }
}
#endif

/* xt (D x Fc) = the sample's vectors transposed (the columns past F stay as they are: zero).
 * D = 16 vectors are transposed in registers with AVX-512, 16 at a time (unpack, then 64- and
 * 128-bit shuffles): the scalar loop took ~40% of the forward's time under perf at kaggle's
 * shape (432 loads and stores a sample at F = 27). */
static void transpose(const float *const *v, int64_t F, int64_t D, int64_t Fc, float *xt) {
#ifdef RECC_AVX512
    if (D == 16) {
        for (int64_t f0 = 0; f0 < F; f0 += 16) {
            __m512 r[16];
            for (int k = 0; k < 16; ++k) r[k] = f0 + k < F ? _mm512_loadu_ps(v[f0 + k]) : _mm512_setzero_ps();
            transpose16(r);
            for (int k = 0; k < 16; ++k) _mm512_storeu_ps(xt + k * Fc + f0, r[k]);
        }
        return;
    }
#endif
    for (int64_t f = 0; f < F; ++f)
        for (int64_t d = 0; d < D; ++d) xt[d * Fc + f] = v[f][d];
}

/* Where vector f of every sample is: sample b's at p + b * ld bytes, bf16 when bf, else fp32. */
struct vsrc {
    const char *p;
    int64_t ld;
    int bf;
};

/* The vsrc of each of the F vectors (block fblk[f], column fcol[f]). */
static void sources(const void *const *blk, const int32_t *bdt, const int64_t *bld, const int64_t *fblk,
                    const int64_t *fcol, int64_t F, struct vsrc *vs) {
    for (int64_t f = 0; f < F; ++f) {
        const int64_t k = fblk[f], es = bdt[k] ? 2 : 4;
        vs[f] = (struct vsrc){(const char *)blk[k] + fcol[f] * es, bld[k] * es, bdt[k] != 0};
    }
}

/* Sample b's vectors into cache ahead of use, two samples ahead: the Gram path reads 27 short
 * vectors per sample from as many places, which the hardware prefetcher does not keep up with
 * (5-13% of the forward at kaggle's shape; the direct and backward paths did not gain). */
static inline void prefetch_sample(const struct vsrc *vs, int64_t F, int64_t b) {
    for (int64_t f = 0; f < F; ++f) __builtin_prefetch(vs[f].p + b * vs[f].ld, 0, 3);
}

/* Sample b's vectors as fp32: in place for fp32 blocks, widened into wide + f * D for bf16. */
static inline void read_vectors(const struct vsrc *vs, int64_t F, int64_t D, int64_t b, float *wide,
                                const float **v) {
    for (int64_t f = 0; f < F; ++f) {
        const char *x = vs[f].p + b * vs[f].ld;
        if (vs[f].bf) {
            widen((const uint16_t *)x, wide + f * D, D);
            v[f] = wide + f * D;
        } else {
            v[f] = (const float *)x;
        }
    }
}

#ifdef RECC_AVX512
/* Rows per block when `left` rows remain: at most 8 (8 chains of FMAs, 4 cycles each, fill the
 * two FMA units), as even as possible (27 rows: 7 7 7 6), as a block of 1 or 2 rows would wait on
 * its FMAs' latency. WITH_ROWS(n, CALL) runs CALL(k) for the constant k == n. */
static inline int block_rows(int64_t left) {
    const int64_t blocks = (left + 7) / 8;
    return (int)((left + blocks - 1) / blocks);
}
#define WITH_ROWS(n, CALL)                                                                                    \
    switch (n) {                                                                                              \
    case 8: CALL(8); break;                                                                                   \
    case 7: CALL(7); break;                                                                                   \
    case 6: CALL(6); break;                                                                                   \
    case 5: CALL(5); break;                                                                                   \
    case 4: CALL(4); break;                                                                                   \
    case 3: CALL(3); break;                                                                                   \
    case 2: CALL(2); break;                                                                                   \
    default: CALL(1); break;                                                                                  \
    }

/* Sample b's D = 16 vectors as fp32 rows of w (fp32 ones copied: the kernels then address one
 * buffer). */
static inline void read16(const struct vsrc *vs, int64_t F, int64_t b, float *w) {
    for (int64_t f = 0; f < F; ++f) {
        const char *x = vs[f].p + b * vs[f].ld;
        store16(w + f * 16, vs[f].bf ? load16_bf16((const uint16_t *)x) : load16((const float *)x));
    }
}

/* The first n (1..16) lanes of x into an output row at element at: fp32 (of), or rounded to
 * bf16 (oh). */
static inline void put16(float *of, uint16_t *oh, int64_t at, __m512 x, int64_t n) {
    const __mmask16 m = (__mmask16)((1u << n) - 1u);
    if (oh)
        _mm512_mask_cvtepi32_storeu_epi16(oh + at, m, narrow16(x));
    else
        _mm512_mask_storeu_ps(of + at, m, x);
}

/* Rows i .. i + n - 1 of the Gram matrix of w (rows of 16 floats) against the 16 columns f0 ..
 * (c[0..15]: rows of x^T, in registers), summed over d in gram_tile's order, n (a constant once
 * inlined) independent chains to keep the FMA units busy; then each row's pairs among these
 * columns into the output (row i's pair f0 at element at), accumulators still in registers. */
static inline __attribute__((always_inline)) void tri_rows16(const float *w, int64_t i, int n, const __m512 c[16],
                                                             int64_t f0, int tri, int64_t at, float *of,
                                                             uint16_t *oh) {
    __m512 acc[8];
    for (int r = 0; r < n; ++r) acc[r] = _mm512_setzero_ps();
    for (int d = 0; d < 16; ++d)
        for (int r = 0; r < n; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(w[(i + r) * 16 + d]), c[d], acc[r]);
    for (int r = 0; r < n; ++r) {
        const int64_t e = i + r + (tri == 2); /* row i + r's pairs */
        put16(of, oh, at, acc[r], e - f0 < 16 ? e - f0 : 16);
        at += e;
    }
}

/* One sample's output row (of or oh) for D = 16 vectors and the triangle of pairs (tri 1 or 2):
 * w holds the sample's F vectors (fp32 rows). 16 columns of the Gram matrix at a time, x^T's 16
 * rows for them held in registers (no copy of x^T in memory), against every row with a pair in
 * them, up to 8 rows at a time; each row's pairs in them are stored (rounded) straight into the
 * output, and so are the head and the pad: no fp32 row in between. */
static void tri16(const float *w, int64_t F, int tri, int64_t head, int64_t P, int64_t pad, float *of,
                  uint16_t *oh) {
    const int64_t hd = head >= 0 ? 16 : 0;
    if (hd) put16(of, oh, 0, _mm512_loadu_ps(w + head * 16), 16);
    for (int64_t f0 = 0; f0 < F; f0 += 16) {
        __m512 c[16];
        for (int k = 0; k < 16; ++k) c[k] = f0 + k < F ? _mm512_loadu_ps(w + (f0 + k) * 16) : _mm512_setzero_ps();
        transpose16(c);
        for (int64_t i = f0 + (tri == 1); i < F;) {
            const int n = block_rows(F - i);
#define ROWS(k) tri_rows16(w, i, k, c, f0, tri, hd + tri_start(i, tri) + f0, of, oh)
            WITH_ROWS(n, ROWS);
#undef ROWS
            i += n;
        }
    }
    for (int64_t k = 0; k < pad; k += 16) put16(of, oh, hd + P + k, _mm512_setzero_ps(), pad - k < 16 ? pad - k : 16);
}
#endif

int recc_interaction_forward(const void *const *blk, const int32_t *bdt, const int64_t *bld, int64_t B,
                             int64_t F, int64_t D, const int64_t *fblk, const int64_t *fcol, const int64_t *li,
                             const int64_t *lj, int64_t P, int64_t head, void *out, int32_t out_bf16,
                             int64_t ldo, int64_t pad, int nthreads) {
    const int64_t Fc = round_up(F, CB), Fr = round_up(F, RB);
    const int64_t hd = head >= 0 ? D : 0;
    /* Only the micro-tiles holding a requested pair are computed: DLRM asks for the strictly
     * lower triangle, so at F = 27 that is 10 of the 7 x 2 tiles. */
    const int64_t ntr = Fr / RB, ntc = Fc / CB;
    unsigned char *need = (unsigned char *)calloc((size_t)(ntr * ntc), 1);
    int32_t *zi = (int32_t *)malloc(sizeof(int32_t) * (size_t)(P + 1)); /* pair p's cell of z */
    struct vsrc *vs = (struct vsrc *)malloc(sizeof(struct vsrc) * (size_t)(F > 0 ? F : 1));
    if (!need || !zi || !vs) {
        free(need);
        free(zi);
        free(vs);
        return -1;
    }
    sources(blk, bdt, bld, fblk, fcol, F, vs);
    const int tri = triangle(li, lj, P, F);
    for (int64_t p = 0; p < P; ++p) {
        need[(li[p] / RB) * ntc + lj[p] / CB] = 1;
        if (!tri) zi[p] = (int32_t)(li[p] * Fc + lj[p]);
    }
    /* Vectors of 32 floats or more, in whole 16-float vectors: one dot product per pair beats
     * the Gram tiles (small's D = 64, F = 9, B = 1024 on one core: 0.55 -> 0.24 ms). */
    const int direct = D % 16 == 0 && D >= 32;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* xt: x^T padded to Fc columns; zero: the rows of x past F; v: sample b's vectors (then
         * zero rows up to Fr); z: Fr x Fc Gram matrix. */
        float *xt = (float *)calloc((size_t)(D * Fc), sizeof(float));
        float *zero = (float *)calloc((size_t)D, sizeof(float));
        const float **v = (const float **)malloc(sizeof(float *) * (size_t)Fr);
        float *z = (float *)malloc(sizeof(float) * (size_t)(Fr * Fc));
        /* wide: the sample's bf16 vectors widened; row: a bf16 output row before rounding. */
        float *wide = (float *)malloc(sizeof(float) * (size_t)(F * D));
        const int64_t width = hd + P + pad;
        float *row = out_bf16 ? (float *)malloc(sizeof(float) * (size_t)(width > 0 ? width : 1)) : NULL;
        const int ok = xt && zero && v && z && wide && (row || !out_bf16);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t f = F; ok && f < Fr; ++f) v[f] = zero;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            if (!ok) continue;
            if (!direct && b + 2 < B) prefetch_sample(vs, F, b + 2);
#ifdef RECC_AVX512
            if (tri && D == 16) {
                read16(vs, F, b, wide);
                tri16(wide, F, tri, head, P, pad, out_bf16 ? NULL : (float *)out + b * ldo,
                      out_bf16 ? (uint16_t *)out + b * ldo : NULL);
                continue;
            }
#endif
            read_vectors(vs, F, D, b, wide, v);
            float *ob = out_bf16 ? row : (float *)out + b * ldo;
            if (direct) {
                /* Wide vectors: each pair's dot product straight from the two vectors (the
                 * Gram tiles would transpose D x F floats and compute the padded tile). */
                for (int64_t p = 0; p < P; ++p) ob[hd + p] = dot16(v[li[p]], v[lj[p]], D);
            } else {
                transpose(v, F, D, Fc, xt);
                for (int64_t i0 = 0; i0 < Fr; i0 += RB) {
                    for (int64_t j0 = 0; j0 < Fc; j0 += CB) {
                        if (!need[(i0 / RB) * ntc + j0 / CB]) continue;
                        v16f acc[RB];
                        if (D == 16)
                            gram_tile(v, xt, Fc, 16, i0, j0, acc);
                        else
                            gram_tile(v, xt, Fc, D, i0, j0, acc);
                        if (tri) {
                            /* Row i's pairs in this tile are columns j0 .. i - 1 (or i), which
                             * are consecutive in the output: stored straight there. */
                            for (int r = 0; r < RB && i0 + r < F; ++r) {
                                const int64_t i = i0 + r, n = i + (tri == 2) - j0;
                                if (n > 0) store_prefix(ob + hd + tri_start(i, tri) + j0, acc[r], n < CB ? n : CB);
                            }
                        } else {
                            for (int r = 0; r < RB; ++r) store16(z + (i0 + r) * Fc + j0, acc[r]);
                        }
                    }
                }
                if (!tri)
                    for (int64_t p = 0; p < P; ++p) ob[hd + p] = z[zi[p]];
            }
            if (hd)
                for (int64_t d = 0; d < D; ++d) ob[d] = v[head][d];
            for (int64_t k = 0; k < pad; ++k) ob[hd + P + k] = 0.f;
            if (out_bf16) narrow(row, (uint16_t *)out + b * ldo, width);
        }
        free(wide);
        free(row);
        free(xt);
        free(zero);
        free((void *)v);
        free(z);
    }
    free(zi);
    free(need);
    free(vs);
    return failed ? -1 : 0;
}

#ifdef RECC_AVX512
/* 1 when every column of every block is read by exactly one vector: each vector's gradient is
 * then its columns' whole gradient, and is stored straight into place. (The blocks are as wide
 * as the vectors together, and no two vectors overlap.) */
static int exact_cover(int64_t nblk, const int64_t *dwidth, const int64_t *fblk, const int64_t *fcol, int64_t F,
                       int64_t D) {
    int64_t total = 0;
    for (int64_t k = 0; k < nblk; ++k) total += dwidth[k];
    if (total != F * D) return 0;
    int64_t *off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(nblk > 0 ? nblk : 1));
    unsigned char *seen = (unsigned char *)calloc((size_t)(total > 0 ? total : 1), 1);
    int ok = off && seen;
    for (int64_t k = 0, at = 0; ok && k < nblk; at += dwidth[k++]) off[k] = at;
    for (int64_t f = 0; ok && f < F; ++f)
        ok = fcol[f] >= 0 && fcol[f] + D <= dwidth[fblk[f]]; /* inside its own block */
    for (int64_t f = 0; ok && f < F; ++f)
        for (int64_t d = 0; ok && d < D; ++d) {
            unsigned char *c = seen + off[fblk[f]] + fcol[f] + d;
            ok = !*c;
            *c = 1;
        }
    free(off);
    free(seen);
    return ok;
}

/* acc[r] = dx_{i0 + r} = sum over j of G(i0 + r, j) x_j, in order of j (as the table path), for
 * the strict triangle. L: the pair gradients as G's lower triangle in a square of row stride 32
 * (G(i, j) = L[i][j] below the diagonal, L[j][i] above it, 0 on it), so that every broadcast is
 * a pointer plus a constant: no index table, and no indexed address (which the core splits into
 * two micro-ops). n (a constant once inlined) rows at a time. */
static inline __attribute__((always_inline)) void tri_dx16(const float *w, const float *L, int64_t F, int64_t i0,
                                                           int n, int64_t head, __m512 hg, const struct vsrc *ds,
                                                           int64_t b) {
    const float *rows = L + i0 * 32; /* row i0 of L */
    __m512 acc[8];
    for (int r = 0; r < n; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < i0; ++j) {
        const __m512 xj = _mm512_loadu_ps(w + j * 16);
        for (int r = 0; r < n; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(rows[r * 32 + j]), xj, acc[r]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < n; ++c) { /* the diagonal block: column j = i0 + c */
        const __m512 xj = _mm512_loadu_ps(w + (i0 + c) * 16);
#pragma GCC unroll 8
        for (int r = 0; r < n; ++r) {
            const float gij = r > c ? rows[r * 32 + i0 + c] : r < c ? rows[c * 32 + i0 + r] : 0.f;
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(gij), xj, acc[r]);
        }
    }
    for (int64_t j = i0 + n; j < F; ++j) {
        const __m512 xj = _mm512_loadu_ps(w + j * 16);
        const float *gj = L + j * 32 + i0; /* G(i0 .., j) */
        for (int r = 0; r < n; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(gj[r]), xj, acc[r]);
    }
    for (int r = 0; r < n; ++r) {
        const __m512 dx = i0 + r == head ? _mm512_add_ps(hg, acc[r]) : acc[r];
        char *to = (char *)ds[i0 + r].p + b * ds[i0 + r].ld;
        if (ds[i0 + r].bf)
            store16_bf16((uint16_t *)to, dx);
        else
            _mm512_storeu_ps((float *)to, dx);
    }
}

/* The backward of sample b for D = 16 vectors (F <= 32), the strict triangle and vectors that
 * tile their blocks (exact_cover): g's row gr (fp32, or bf16 widened here) goes into L (see
 * tri_dx16) 16 pairs at a time (a row's last piece may run into the next row's pairs: L's
 * cells right of the diagonal are never read), the vectors into w (fp32 rows), and each dx_i,
 * with the head's gradient, is stored (rounded) straight into place. */
static void tri16_backward(const struct vsrc *vs, const struct vsrc *ds, int64_t F, int64_t P, int64_t head,
                           const void *gr, int g_bf16, int64_t b, float *L, float *w) {
    const int64_t hd = head >= 0 ? 16 : 0;
    for (int64_t i = 1, t = 0; i < F; t += i++) /* t: tri_start(i) */
        for (int64_t k = 0; k < i; k += 16) {
            const int64_t left = P - t - k; /* pairs from here to the end of all P (cells past
                                             * the row's end are loaded, never read) */
            const __mmask16 m = (__mmask16)(left >= 16 ? 0xffffu : (1u << left) - 1u);
            const int64_t at = hd + t + k;
            _mm512_storeu_ps(L + i * 32 + k, g_bf16 ? widen16(_mm256_maskz_loadu_epi16(m, (const uint16_t *)gr + at))
                                                    : _mm512_maskz_loadu_ps(m, (const float *)gr + at));
        }
    read16(vs, F, b, w);
    const __m512 hg = !hd       ? _mm512_setzero_ps()
                      : g_bf16 ? load16_bf16((const uint16_t *)gr)
                               : _mm512_loadu_ps((const float *)gr);
    for (int64_t i = 0; i < F;) {
        const int n = block_rows(F - i);
#define DX(k) tri_dx16(w, L, F, i, k, head, hg, ds, b)
        WITH_ROWS(n, DX);
#undef DX
        i += n;
    }
}
#endif

/* g: the output's gradient, row b at g + b * ldg (head, pairs, pad as in the forward).
 * dblk[k]: the gradient of blk[k], row b at dblk[k] + b * dld[k], dwidth[k] floats wide; every
 * row is written (zeros where no vector was read), vector f's part accumulated, so a tensor
 * whose columns are several vectors (or the head and a vector) gets their sum.
 *
 * d<x_i, x_j> = x_j dx_i + x_i dx_j, i.e. dx = G x for the symmetric pair gradient G (F x F).
 * DLRM's case (D = 16, F <= 32, the strict triangle, vectors that tile their blocks) with
 * AVX-512 is tri16_backward. Otherwise, when every requested pair is off the diagonal and
 * requested once, G is never built: cell (i, j) is read straight from the sample's pair
 * gradients through a table of pair indices made once per call (cells of no pair point at a
 * zero), so the loads overlap with the products. Otherwise (diagonal or repeated pairs, whose
 * values add up) G is accumulated per sample and read through the identity table: a scatter of
 * read-modify-writes that costs ~1.5x. dx = G x is computed 4 rows of G by 16 columns of D at a
 * time (four independent accumulator chains) and added into the gradient of the tensor vector f
 * came from. */
int recc_interaction_backward(const void *const *blk, const int32_t *bdt, const int64_t *bld, int64_t nblk,
                              int64_t B, int64_t F, int64_t D, const int64_t *fblk, const int64_t *fcol,
                              const int64_t *li, const int64_t *lj, int64_t P, int64_t head,
                              const void *g, int32_t g_bf16, int64_t ldg, void *const *dblk,
                              const int64_t *dld, const int64_t *dwidth, int nthreads) {
    const int64_t Fr = round_up(F, RB);
    const int64_t hd = head >= 0 ? D : 0;
    /* tab: for each cell of G (Fr x F), where its value is: a pair index into the sample's
     * copy of its pair gradients (P: the zero after them), or the cell itself. */
    int32_t *tab = (int32_t *)malloc(sizeof(int32_t) * (size_t)(Fr * F));
    /* doff[k]: where a bf16 block's gradient row is summed in fp32 in the thread's scratch. */
    int64_t *doff = (int64_t *)malloc(sizeof(int64_t) * (size_t)(nblk > 0 ? nblk : 1));
    /* vs, ds: where each vector is read, and (fast path) where its gradient goes. */
    struct vsrc *vs = (struct vsrc *)malloc(sizeof(struct vsrc) * (size_t)(F > 0 ? F : 1));
    struct vsrc *ds = (struct vsrc *)malloc(sizeof(struct vsrc) * (size_t)(F > 0 ? F : 1));
    if (!tab || !doff || !vs || !ds) {
        free(tab);
        free(doff);
        free(vs);
        free(ds);
        return -1;
    }
    sources(blk, bdt, bld, fblk, fcol, F, vs);
    int64_t nscr = 0;
    for (int64_t k = 0; k < nblk; ++k) {
        doff[k] = nscr;
        if (bdt[k]) nscr += dwidth[k];
    }
    int direct = 1;
    for (int64_t k = 0; k < Fr * F; ++k) tab[k] = (int32_t)P;
    for (int64_t p = 0; p < P; ++p) {
        const int64_t a = li[p] * F + lj[p], c = lj[p] * F + li[p];
        if (a == c || tab[a] != (int32_t)P) direct = 0;
        tab[a] = tab[c] = (int32_t)p;
    }
    if (!direct)
        for (int64_t k = 0; k < Fr * F; ++k) tab[k] = (int32_t)k;
#ifdef RECC_AVX512
    const int fast = D == 16 && F <= 32 && triangle(li, lj, P, F) == 1 && exact_cover(nblk, dwidth, fblk, fcol, F, D);
#else
    const int fast = 0;
#endif
    if (fast) sources((const void *const *)dblk, bdt, dld, fblk, fcol, F, ds);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* src: what tab indexes — the sample's P pair gradients and a zero, or G (Fr x F, rows
         * past F zero); v/dv: sample b's vectors and where their gradients go. */
        float *src = (float *)calloc((size_t)(direct ? P + 1 : Fr * F), sizeof(float));
        const float **v = (const float **)malloc(sizeof(float *) * (size_t)F);
        float **dv = (float **)malloc(sizeof(float *) * (size_t)F);
        /* wide: the sample's bf16 vectors widened; grow: a bf16 gradient row widened; dscr: the
         * bf16 blocks' gradient rows, summed in fp32 and rounded when the sample is done. */
        float *wide = (float *)malloc(sizeof(float) * (size_t)(F * D));
        float *grow = g_bf16 ? (float *)malloc(sizeof(float) * (size_t)(hd + P + 1)) : NULL;
        float *dscr = (float *)malloc(sizeof(float) * (size_t)(nscr + 1));
        /* drow[k]: where block k's gradient row for this sample is summed (in place, or dscr). */
        float **drow = (float **)malloc(sizeof(float *) * (size_t)(nblk > 0 ? nblk : 1));
        /* L: the fast path's pair gradients (see tri_dx16). */
        float *L = fast ? (float *)calloc(32 * 32, sizeof(float)) : NULL;
        const int ok = src && v && dv && wide && dscr && drow && (grow || !g_bf16) && (L || !fast);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            if (!ok) continue;
#ifdef RECC_AVX512
            if (fast) {
                tri16_backward(vs, ds, F, P, head, (const char *)g + b * ldg * (g_bf16 ? 2 : 4), g_bf16, b, L, wide);
                continue;
            }
#endif
            const float *gb;
            if (g_bf16) {
                widen((const uint16_t *)g + b * ldg, grow, hd + P);
                gb = grow + hd;
            } else {
                gb = (const float *)g + b * ldg + hd;
            }
            read_vectors(vs, F, D, b, wide, v);
            for (int64_t k = 0; k < nblk; ++k) {
                drow[k] = bdt[k] ? dscr + doff[k] : (float *)dblk[k] + b * dld[k];
                memset(drow[k], 0, sizeof(float) * (size_t)dwidth[k]);
            }
            for (int64_t f = 0; f < F; ++f) dv[f] = drow[fblk[f]] + fcol[f];
            if (hd)
                for (int64_t d = 0; d < D; ++d) dv[head][d] += gb[d - hd];
            if (direct) {
                memcpy(src, gb, sizeof(float) * (size_t)P);
            } else {
                memset(src, 0, sizeof(float) * (size_t)(F * F));
                for (int64_t p = 0; p < P; ++p) {
                    src[li[p] * F + lj[p]] += gb[p];
                    src[lj[p] * F + li[p]] += gb[p];
                }
            }
            for (int64_t i0 = 0; i0 < F; i0 += RB) {
                const int32_t *t0 = tab + i0 * F;
                int64_t d0 = 0;
                for (; d0 + CB <= D; d0 += CB) {
                    v16f acc[RB];
                    for (int r = 0; r < RB; ++r) acc[r] = splat16(0.f);
                    for (int64_t j = 0; j < F; ++j) {
                        const v16f xj = load16(v[j] + d0);
                        for (int r = 0; r < RB; ++r) acc[r] = fma16(splat16(src[t0[r * F + j]]), xj, acc[r]);
                    }
                    for (int r = 0; r < RB && i0 + r < F; ++r) {
                        float *di = dv[i0 + r] + d0;
                        store16(di, add16(load16(di), acc[r]));
                    }
                }
                for (int64_t i = i0; i < i0 + RB && i < F; ++i)
                    for (int64_t d = d0; d < D; ++d) {
                        float s = 0.f;
                        for (int64_t j = 0; j < F; ++j) s += src[tab[i * F + j]] * v[j][d];
                        dv[i][d] += s;
                    }
            }
            for (int64_t k = 0; k < nblk; ++k)
                if (bdt[k]) narrow(drow[k], (uint16_t *)dblk[k] + b * dld[k], dwidth[k]);
        }
        free(L);
        free(drow);
        free(wide);
        free(grow);
        free(dscr);
        free(src);
        free((void *)v);
        free(dv);
    }
    free(tab);
    free(doff);
    free(vs);
    free(ds);
    return failed ? -1 : 0;
}
