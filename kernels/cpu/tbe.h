/* What the TBE library's sources share (tbe_forward.c, tbe_backward.c, gather.c: one shared
 * object, see native.py): the layout, the return codes, row reads in any storage type.
 *
 * One table-batched embedding (TBE) group: T tables sharing an embedding dim D, stored as one
 * concatenated weight [R, D] of fp32, fp16 or bf16 (`wt`, half.h's W_*). Plain C + OpenMP, no
 * torch headers; tbe.py calls the kernels through ctypes with raw data pointers of contiguous
 * tensors. Layout (FBGEMM's names): `lin` holds linearized row ids (local id +
 * hash_size_cumsum[t]), `offsets` has T*B+1 entries and is feature-major (bag j = t*B + b),
 * `go`/`out` are batch-major [B, T*D] (D_offsets[t] = t*D).
 *
 * Compiled with -std=c11, so gcc does not contract a*b+c into FMAs: the arithmetic is the same
 * as the pure-torch reference's up to summation order. */
#ifndef RECC_TBE_H
#define RECC_TBE_H

#include <stdint.h>
#include <string.h>

#include "half.h"
#include "vec.h"

enum {
    RC_OK = 0,
    RC_BAD_ID = 1,     /* an id outside [0, R): nothing was written */
    RC_NO_MEMORY = 2,  /* nothing was written */
    RC_BAD_ARGS = 3,
};

#ifndef ID_PREFETCH
/* ids ahead, forward pooling and gathers. 48 rather than 24: on the 2-vCPU Xeon (small's shape,
 * 8 x 100k x 64, tables in the L3) the fp16 forward went ~1.15 -> ~1.0 ms and the fp16
 * embedding-only step ~8% faster; fp32 rows and kaggle's D = 16 (one line per row) were
 * unchanged. */
#define ID_PREFETCH 48
#endif

/* Row accumulators: D/16 vectors of 16 floats kept in registers when D is a multiple of 16 and
 * at most 16*MAX_VECS (plain loops otherwise). */
#define MAX_VECS 16

static inline void prefetch_span(const void* p, int64_t bytes, int rw) {
    const char* c = (const char*)p;
    for (int64_t o = 0; o < bytes; o += 64) {
        if (rw) __builtin_prefetch(c + o, 1, 3);
        else __builtin_prefetch(c + o, 0, 3);
    }
}

/* 16 fp16 (wt W_F16, one vcvtph2ps) or bf16 values as fp32. */
static inline v16f load16_half(const uint16_t* p, int wt) {
    if (wt == W_BF16) return load16_bf16(p);
#ifdef RECC_AVX512
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
    float f[16];
    load_half_row(p, W_F16, 0, 16, f);
    return load16(f);
#endif
}

/* Values 16v..16v+15 of weight row `row` as fp32, whatever the storage type: half rows are
 * widened in registers (no fp32 copy of the row). */
static inline v16f load16_row(const void* weights, int wt, int64_t row, int64_t D, int64_t v) {
    if (wt == W_F32) return load16((const float*)weights + row * D + 16 * v);
    return load16_half((const uint16_t*)weights + row * D + 16 * v, wt);
}

#endif
