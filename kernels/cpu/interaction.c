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
 * directly, 16 lanes of partial sums added in a fixed order. Otherwise (kaggle's D = 16 with
 * 27 features) it builds each sample's Gram matrix Z = x x^T with a register-blocked
 * micro-kernel: 4 rows of x against 16 columns of a zero-padded transposed copy, accumulators kept in
 * registers across the whole D loop (a plain dot product of D floats is too short to vectorise:
 * the horizontal sum dominates), for the tiles that hold a requested pair.  For DLRM's triangle
 * of pairs each tile row's pairs are consecutive in the output and are stored there directly;
 * other pair lists are read out of Z.  D = 16 vectors are transposed in registers (AVX-512), and
 * the next samples' vectors are prefetched.  Together, kaggle's shape (B = 4096, F = 27, D = 16,
 * one thread) went 3.1 -> 1.7 ms.  Backward builds the symmetric pair gradient G (F x F) and computes
 * dx = G x, 4 rows of G by 16 columns of D at a time (four independent accumulator chains), and
 * adds dx_f into the gradient of the tensor vector f came from.
 *
 * Mixed precision: each block is fp32 or bf16 (bdt[k]: 0 or 1), and so are the output (and in
 * backward the output's gradient). A bf16 vector is widened into a per-thread fp32 copy when the
 * sample is read, every product and sum is fp32, and a bf16 output row or gradient row is
 * rounded (to nearest even, as torch's .to(torch.bfloat16)) once, when the sample is done. So
 * a bf16 bottom MLP's output, fp32 pooled embeddings and a bf16 top MLP meet with no cast kernel
 * and no fp32 copy of the [B, D + P] row in memory.
 *
 * Pair cells and pair indices are int32: the callers keep F <= 32768 and P < 2^31 (the torch
 * reference runs beyond).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"

#define RB 4  /* rows of x per micro-tile */
#define CB 16 /* columns (of x^T, or of D) per micro-tile: one AVX-512 vector, two AVX2 vectors */

static inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static void widen(const uint16_t *src, float *dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

static void narrow(const float *src, uint16_t *dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

/* 16 floats as one vector (GNU C; one AVX-512 register, two AVX2 ones), loaded unaligned. */
typedef float v16f __attribute__((vector_size(64), aligned(4)));

static inline v16f load16(const float *p) {
    v16f x;
    memcpy(&x, p, sizeof x);
    return x;
}

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef float v4f __attribute__((vector_size(16), aligned(4)));

/* <a, c> over D floats, D a multiple of 16: 16 lanes of partial sums, then halves added
 * (16 -> 8 -> 4 -> 2 -> 1 lanes, a fixed order). */
static inline float dot16(const float *a, const float *c, int64_t D) {
    v16f acc = load16(a) * load16(c);
    for (int64_t d = 16; d < D; d += 16) acc += load16(a + d) * load16(c + d);
    v8f lo8, hi8;
    memcpy(&lo8, &acc, sizeof lo8);
    memcpy(&hi8, (const char *)&acc + sizeof lo8, sizeof hi8);
    const v8f s8 = lo8 + hi8;
    v4f lo4, hi4;
    memcpy(&lo4, &s8, sizeof lo4);
    memcpy(&hi4, (const char *)&s8 + sizeof lo4, sizeof hi4);
    const v4f s4 = lo4 + hi4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
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

/* The first n (<= 16) floats of src to dst: one masked store with AVX-512. */
static inline void store_prefix(float *dst, const float *src, int64_t n) {
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(dst, (__mmask16)((1u << n) - 1u), _mm512_loadu_ps(src));
#else
    memcpy(dst, src, sizeof(float) * (size_t)n);
#endif
}

#if defined(__AVX512F__)
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
#if defined(__AVX512F__)
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

/* Where vector f of sample b starts in its block (elements of 2 or 4 bytes). */
static inline const void *vec(const void *const *blk, const int32_t *bdt, const int64_t *bld,
                              const int64_t *fblk, const int64_t *fcol, int64_t f, int64_t b) {
    const int64_t k = fblk[f], at = b * bld[k] + fcol[f];
    return bdt[k] ? (const void *)((const uint16_t *)blk[k] + at) : (const void *)((const float *)blk[k] + at);
}

/* Sample b's vectors into cache ahead of use, two samples ahead: the Gram path reads 27 short
 * vectors per sample from as many places, which the hardware prefetcher does not keep up with
 * (5-13% of the forward at kaggle's shape; the direct and backward paths did not gain). */
static inline void prefetch_sample(const void *const *blk, const int32_t *bdt, const int64_t *bld,
                                   const int64_t *fblk, const int64_t *fcol, int64_t F, int64_t b) {
    for (int64_t f = 0; f < F; ++f) __builtin_prefetch(vec(blk, bdt, bld, fblk, fcol, f, b), 0, 3);
}

/* Sample b's vectors as fp32: in place for fp32 blocks, widened into wide + f * D for bf16. */
static inline void read_vectors(const void *const *blk, const int32_t *bdt, const int64_t *bld,
                                const int64_t *fblk, const int64_t *fcol, int64_t F, int64_t D, int64_t b,
                                float *wide, const float **v) {
    for (int64_t f = 0; f < F; ++f) {
        const void *x = vec(blk, bdt, bld, fblk, fcol, f, b);
        if (bdt[fblk[f]]) {
            widen((const uint16_t *)x, wide + f * D, D);
            v[f] = wide + f * D;
        } else {
            v[f] = (const float *)x;
        }
    }
}

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
    if (!need || !zi) {
        free(need);
        free(zi);
        return -1;
    }
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
            if (direct) {
                /* Wide vectors: each pair's dot product straight from the two vectors (the
                 * Gram tiles would transpose D x F floats and compute the padded tile). */
                read_vectors(blk, bdt, bld, fblk, fcol, F, D, b, wide, v);
                float *ob = out_bf16 ? row : (float *)out + b * ldo;
                if (hd)
                    for (int64_t d = 0; d < D; ++d) ob[d] = v[head][d];
                for (int64_t p = 0; p < P; ++p) ob[hd + p] = dot16(v[li[p]], v[lj[p]], D);
                for (int64_t k = 0; k < pad; ++k) ob[hd + P + k] = 0.f;
                if (out_bf16) narrow(row, (uint16_t *)out + b * ldo, width);
                continue;
            }
            if (b + 2 < B) prefetch_sample(blk, bdt, bld, fblk, fcol, F, b + 2);
            read_vectors(blk, bdt, bld, fblk, fcol, F, D, b, wide, v);
            transpose(v, F, D, Fc, xt);
            float *ob = out_bf16 ? row : (float *)out + b * ldo;
            for (int64_t i0 = 0; i0 < Fr; i0 += RB) {
                for (int64_t j0 = 0; j0 < Fc; j0 += CB) {
                    if (!need[(i0 / RB) * ntc + j0 / CB]) continue;
                    float acc[RB][CB];
                    for (int r = 0; r < RB; ++r)
                        for (int c = 0; c < CB; ++c) acc[r][c] = 0.f;
                    for (int64_t d = 0; d < D; ++d) {
                        const float *col = xt + d * Fc + j0;
                        for (int r = 0; r < RB; ++r) {
                            const float a = v[i0 + r][d];
#pragma omp simd
                            for (int c = 0; c < CB; ++c) acc[r][c] += a * col[c];
                        }
                    }
                    if (tri) {
                        /* Row i's pairs in this tile are columns j0 .. i - 1 (or i), which
                         * are consecutive in the output: stored straight there. */
                        for (int r = 0; r < RB && i0 + r < F; ++r) {
                            const int64_t i = i0 + r, n = i + (tri == 2) - j0;
                            if (n > 0) store_prefix(ob + hd + tri_start(i, tri) + j0, acc[r], n < CB ? n : CB);
                        }
                    } else {
                        for (int r = 0; r < RB; ++r)
                            for (int c = 0; c < CB; ++c) z[(i0 + r) * Fc + j0 + c] = acc[r][c];
                    }
                }
            }
            if (hd)
                for (int64_t d = 0; d < D; ++d) ob[d] = v[head][d];
            if (!tri)
                for (int64_t p = 0; p < P; ++p) ob[hd + p] = z[zi[p]];
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
    return failed ? -1 : 0;
}

/* g: the output's gradient, row b at g + b * ldg (head, pairs, pad as in the forward).
 * dblk[k]: the gradient of blk[k], row b at dblk[k] + b * dld[k], dwidth[k] floats wide; every
 * row is written (zeros where no vector was read), vector f's part accumulated, so a tensor
 * whose columns are several vectors (or the head and a vector) gets their sum.
 *
 * d<x_i, x_j> = x_j dx_i + x_i dx_j, i.e. dx = G x for the symmetric pair gradient G (F x F).
 * When every requested pair is off the diagonal and requested once (DLRM's triangle), G is
 * never built: cell (i, j) is read straight from the sample's pair gradients through a table
 * of pair indices made once per call (cells of no pair point at a zero), so the loads overlap
 * with the products. Otherwise (diagonal or repeated pairs, whose values add up) G is
 * accumulated per sample and read through the identity table: a scatter of read-modify-writes
 * that costs ~1.5x. */
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
    if (!tab || !doff) {
        free(tab);
        free(doff);
        return -1;
    }
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
        const int ok = src && v && dv && wide && dscr && drow && (grow || !g_bf16);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            if (!ok) continue;
            const float *gb;
            if (g_bf16) {
                widen((const uint16_t *)g + b * ldg, grow, hd + P);
                gb = grow + hd;
            } else {
                gb = (const float *)g + b * ldg + hd;
            }
            read_vectors(blk, bdt, bld, fblk, fcol, F, D, b, wide, v);
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
                    float acc[RB][CB];
                    for (int r = 0; r < RB; ++r)
                        for (int c = 0; c < CB; ++c) acc[r][c] = 0.f;
                    for (int64_t j = 0; j < F; ++j) {
                        const float *xj = v[j] + d0;
                        for (int r = 0; r < RB; ++r) {
                            const float a = src[t0[r * F + j]];
#pragma omp simd
                            for (int c = 0; c < CB; ++c) acc[r][c] += a * xj[c];
                        }
                    }
                    for (int r = 0; r < RB && i0 + r < F; ++r) {
                        float *di = dv[i0 + r] + d0;
#pragma omp simd
                        for (int c = 0; c < CB; ++c) di[c] += acc[r][c];
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
    return failed ? -1 : 0;
}
