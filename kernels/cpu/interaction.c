/* DLRM dot interaction, pair by pair (recc.pairwise_dot).
 *
 * out[b, p] = <x[b, li[p], :], x[b, lj[p], :]> for x of shape [B, F, D].
 * torch computes this as bmm(x, x^T) followed by an index gather: for the small F x F matrices
 * of a DLRM, batched GEMM runs far below the machine's speed, and the gather's backward is a
 * scatter-add into a zero-filled F x F gradient.  Here every sample is independent, so the
 * batch is split across threads with no synchronisation.
 *
 * Forward builds each sample's Gram matrix Z = x x^T with a register-blocked micro-kernel:
 * 4 rows of x against 16 columns of a zero-padded transposed copy, accumulators kept in
 * registers across the whole D loop (a plain dot product of D floats is too short to vectorise:
 * the horizontal sum dominates), for the tiles that hold a requested pair.  The requested pairs
 * are then read out of Z.  Backward builds
 * the symmetric pair gradient G (F x F) and computes dx = G x, 16 columns of D at a time.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define RB 4  /* rows of x per micro-tile */
#define CB 16 /* columns (of x^T) per micro-tile: one AVX-512 vector, two AVX2 vectors */

static inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

int recc_pairwise_dot_forward(const float *x, int64_t B, int64_t F, int64_t D, const int64_t *li,
                              const int64_t *lj, int64_t P, float *out, int nthreads) {
    const int64_t Fc = round_up(F, CB), Fr = round_up(F, RB);
    /* Only the micro-tiles holding a requested pair are computed: DLRM asks for the strictly
     * lower triangle, so at F = 27 that is 10 of the 7 x 2 tiles. */
    const int64_t ntr = Fr / RB, ntc = Fc / CB;
    unsigned char *need = (unsigned char *)calloc((size_t)(ntr * ntc), 1);
    if (!need) return -1;
    for (int64_t p = 0; p < P; ++p) need[(li[p] / RB) * ntc + lj[p] / CB] = 1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* xt: x^T padded to Fc columns; xr: x padded to Fr rows; z: Fr x Fc Gram matrix. */
        float *xt = (float *)calloc((size_t)(D * Fc), sizeof(float));
        float *xr = (float *)calloc((size_t)(Fr * D), sizeof(float));
        float *z = (float *)malloc(sizeof(float) * (size_t)(Fr * Fc));
        if (!xt || !xr || !z) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            if (!xt || !xr || !z) continue;
            const float *xb = x + b * F * D;
            memcpy(xr, xb, sizeof(float) * (size_t)(F * D));
            for (int64_t f = 0; f < F; ++f)
                for (int64_t d = 0; d < D; ++d) xt[d * Fc + f] = xb[f * D + d];
            for (int64_t i0 = 0; i0 < Fr; i0 += RB) {
                for (int64_t j0 = 0; j0 < Fc; j0 += CB) {
                    if (!need[(i0 / RB) * ntc + j0 / CB]) continue;
                    float acc[RB][CB];
                    for (int r = 0; r < RB; ++r)
                        for (int c = 0; c < CB; ++c) acc[r][c] = 0.f;
                    for (int64_t d = 0; d < D; ++d) {
                        const float *col = xt + d * Fc + j0;
                        for (int r = 0; r < RB; ++r) {
                            const float a = xr[(i0 + r) * D + d];
#pragma omp simd
                            for (int c = 0; c < CB; ++c) acc[r][c] += a * col[c];
                        }
                    }
                    for (int r = 0; r < RB; ++r)
                        for (int c = 0; c < CB; ++c) z[(i0 + r) * Fc + j0 + c] = acc[r][c];
                }
            }
            float *ob = out + b * P;
            for (int64_t p = 0; p < P; ++p) ob[p] = z[li[p] * Fc + lj[p]];
        }
        free(xt);
        free(xr);
        free(z);
    }
    free(need);
    return failed ? -1 : 0;
}

int recc_pairwise_dot_backward(const float *x, const float *g, int64_t B, int64_t F, int64_t D,
                               const int64_t *li, const int64_t *lj, int64_t P, float *dx,
                               int nthreads) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *gm = (float *)malloc(sizeof(float) * (size_t)(F * F));
        if (!gm) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            if (!gm) continue;
            const float *xb = x + b * F * D;
            const float *gb = g + b * P;
            float *db = dx + b * F * D;
            memset(gm, 0, sizeof(float) * (size_t)(F * F));
            /* d<x_i, x_j> = x_j dx_i + x_i dx_j: both orientations (twice on the diagonal). */
            for (int64_t p = 0; p < P; ++p) {
                gm[li[p] * F + lj[p]] += gb[p];
                gm[lj[p] * F + li[p]] += gb[p];
            }
            for (int64_t i = 0; i < F; ++i) {
                const float *gi = gm + i * F;
                int64_t d0 = 0;
                for (; d0 + CB <= D; d0 += CB) {
                    float acc[CB];
                    for (int c = 0; c < CB; ++c) acc[c] = 0.f;
                    for (int64_t j = 0; j < F; ++j) {
                        const float a = gi[j];
                        const float *xj = xb + j * D + d0;
#pragma omp simd
                        for (int c = 0; c < CB; ++c) acc[c] += a * xj[c];
                    }
                    for (int c = 0; c < CB; ++c) db[i * D + d0 + c] = acc[c];
                }
                for (int64_t d = d0; d < D; ++d) {
                    float s = 0.f;
                    for (int64_t j = 0; j < F; ++j) s += gi[j] * xb[j * D + d];
                    db[i * D + d] = s;
                }
            }
        }
        free(gm);
    }
    return failed ? -1 : 0;
}
