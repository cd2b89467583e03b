/* DLRM dot interaction, pair by pair (recc.pairwise_dot).
 *
 * out[b, p] = <x[b, li[p], :], x[b, lj[p], :]> for x of shape [B, F, D].
 * torch computes this as bmm(x, x^T) followed by an index gather: for the small F x F matrices
 * of a DLRM, batched GEMM runs far below the machine's speed, and the gather's backward is a
 * scatter-add into a zero-filled F x F gradient.  Here every sample is independent, so the
 * batch is split across threads with no synchronisation, and each dot product is a short
 * vectorised loop over D.
 *
 * Backward: dx[b, li[p]] += g[b, p] * x[b, lj[p]] and dx[b, lj[p]] += g[b, p] * x[b, li[p]]
 * (a pair of a row with itself gets both terms: d<u,u>/du = 2u).
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>

int recc_pairwise_dot_forward(const float *x, int64_t B, int64_t F, int64_t D, const int64_t *li,
                              const int64_t *lj, int64_t P, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        const float *xb = x + b * F * D;
        float *ob = out + b * P;
        for (int64_t p = 0; p < P; ++p) {
            const float *u = xb + li[p] * D;
            const float *v = xb + lj[p] * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += u[d] * v[d];
            ob[p] = s;
        }
    }
    return 0;
}

int recc_pairwise_dot_backward(const float *x, const float *g, int64_t B, int64_t F, int64_t D,
                               const int64_t *li, const int64_t *lj, int64_t P, float *dx,
                               int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        const float *xb = x + b * F * D;
        const float *gb = g + b * P;
        float *db = dx + b * F * D;
        memset(db, 0, (size_t)(F * D) * sizeof(float));
        for (int64_t p = 0; p < P; ++p) {
            const float gp = gb[p];
            const int64_t i = li[p] * D, j = lj[p] * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) db[i + d] += gp * xb[j + d];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) db[j + d] += gp * xb[i + d];
        }
    }
    return 0;
}
