/*
 * The TBE backward + fused optimizer (recc_tbe_backward_update; "exact": duplicate ids summed,
 * each row updated once), O(N), no sort. Layout and codes: tbe.h.
 *
 *  - One pass checks every id is in [0, R) and finds each table's row interval, before any
 *    write.  When the tables' intervals are disjoint (always, for validated + linearized
 *    ids) each table is a work unit; big tables are split into parts by a hash of row/16, a
 *    part keeping only its rows.  Otherwise (a caller mixing tables' rows) the whole batch is
 *    split by that hash.  Every row therefore belongs to exactly one unit, so units run in
 *    parallel without atomics or races.
 *  - A unit gives each of its rows a compact first-seen slot through a persistent int32 slot
 *    map (all -1 between calls; only touched entries are reset), counting-sorts its ids by
 *    slot (stable: a row's ids stay in index order), then reduces each row's gradient in a
 *    register accumulator and applies the optimizer once.  A row's sum order is the index
 *    order whatever the thread count or unit split: results are deterministic.
 *
 * Half weights (fp16/bf16) are read into fp32, updated in fp32 (the optimizer state is fp32)
 * and written back with half.h's stochastic rounding. `key_rows` (optional, [R]) names the row
 * whose number keys a weight row's bits: a cached group's weights hold slots, and
 * key_rows[slot] (its cache's slot -> group row map) makes a slot round like the group row it
 * holds, so cached training rounds exactly as all-resident training does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "tbe.h"

enum { OPT_SGD = 0, OPT_ROWWISE_ADAGRAD = 1, OPT_ADAGRAD = 2, OPT_ADAM = 3 };

#ifndef ROW_PREFETCH
#define ROW_PREFETCH 8   /* rows ahead: weight/state rows, backward apply loop */
#endif
#ifndef GO_PREFETCH
#define GO_PREFETCH 4    /* rows ahead: grad_output rows, backward apply loop */
#endif
#define MAX_REG_D 256    /* row accumulators up to this D live on the stack */

/* Which of `parts` parts a row belongs to: a multiplicative hash of row/16, range-reduced. */
static inline uint32_t row_part(int64_t row, uint32_t parts) {
    const uint32_t h = (uint32_t)(((uint64_t)row >> 4) * 0x9E3779B97F4A7C15ull >> 32);
    return (uint32_t)(((uint64_t)h * parts) >> 32);
}

/* ------------------------------------------------------------------ per-thread workspace */

typedef struct {
    int32_t slot;
    int32_t go_row; /* b * T + t: row of grad_output viewed as [B*T, D] */
    float scale;    /* per-sample weight, divided by the bag length for mean pooling */
} pending_t;

typedef struct {
    int32_t go_row;
    float scale;
} contrib_t;

/* One entry of a unit's row -> slot map; stale entries (an older gen) read as empty, so the
 * map is never cleared between units. */
typedef struct {
    int64_t row;
    int32_t slot;
    uint32_t gen;
} slot_entry_t;

typedef struct {
    pending_t* pend;
    contrib_t* contrib;
    int64_t* urows;
    int32_t* ends;
    float* acc;
    slot_entry_t* hmap; /* open-addressing map row -> slot over one unit's rows */
    uint32_t gen;       /* an entry belongs to the current unit iff its gen is this */
    size_t cap, dcap, hcap;
} workspace_t;

/* Grow-only and per OS thread: OpenMP teams of concurrent callers never share one, and
 * steady-state calls take no page faults. */
static __thread workspace_t tls_ws;

static int ws_reserve(workspace_t* ws, size_t n, size_t D, int hashed) {
    if (n > ws->cap) {
        size_t cap = n + n / 4 + 1024;
        free(ws->pend);
        free(ws->contrib);
        free(ws->urows);
        free(ws->ends);
        ws->pend = malloc(cap * sizeof(pending_t));
        ws->contrib = malloc(cap * sizeof(contrib_t));
        ws->urows = malloc(cap * sizeof(int64_t));
        ws->ends = malloc(cap * sizeof(int32_t));
        if (!ws->pend || !ws->contrib || !ws->urows || !ws->ends) {
            free(ws->pend);
            free(ws->contrib);
            free(ws->urows);
            free(ws->ends);
            ws->pend = NULL;
            ws->contrib = NULL;
            ws->urows = NULL;
            ws->ends = NULL;
            ws->cap = 0;
            return 0;
        }
        ws->cap = cap;
    }
    /* The row -> slot map holds at most n rows at load <= 1/2: memory per unit's ids, not
     * per weight row (a per-row map would cost 4 bytes for every row of every table). */
    size_t h = 16;
    while (h < 2 * n) h <<= 1;
    if (hashed && h > ws->hcap) {
        free(ws->hmap);
        ws->hmap = calloc(h, sizeof(slot_entry_t));  /* gen 0: never a live unit's */
        ws->gen = 0;
        if (!ws->hmap) {
            ws->hcap = 0;
            return 0;
        }
        ws->hcap = h;
    }
    if (D > ws->dcap) {
        free(ws->acc);
        ws->acc = aligned_alloc(64, (D * sizeof(float) + 63) / 64 * 64);
        if (!ws->acc) {
            ws->dcap = 0;  /* acc is NULL: the next call retries */
            return 0;
        }
        ws->dcap = D;
    }
    return 1;
}

/* ------------------------------------------------------------------ backward */

typedef struct {
    void* weights;  /* [R, D] of fp32, fp16 or bf16 (wt) */
    int wt;
    uint64_t seed;  /* keys the stochastic rounding of half weights */
    int64_t R, D;
    float* m1;
    float* m2;
    const int64_t* lin;
    const int64_t* offsets;
    int64_t T, B;
    const void* go;  /* [B, T*D] of fp32, or bf16 (go_bf16: a bf16 consumer's gradient, read as is) */
    int go_bf16;
    const float* psw;
    int mean, optimizer;
    float grad_scale; /* every id's gradient is multiplied by it (the loss's 1/world share) */
    float lr, eps, beta1, beta2, wd, bc1, bc2;
    int decoupled; /* weight decay: 0 L2 (wd * w added to g), 1 decoupled (w *= 1 - lr * wd, AdamW) */
    int32_t* slot_map; /* [R] row -> slot, all -1 between calls; NULL: each unit hashes its rows */
    const int64_t* key_rows; /* [R] the row number keying each row's rounding; NULL: the row itself */
} bwd_t;

typedef struct {
    int64_t bag_lo, bag_hi; /* bags [bag_lo, bag_hi) of the feature-major offsets */
    int64_t ids;            /* ids in those bags, for scheduling big units first */
    uint32_t parts, part;   /* keep rows with row_part(row, parts) == part */
} unit_t;

static inline __attribute__((always_inline)) void apply_row(const bwd_t* c, int64_t row,
                                                            float* restrict w, float* restrict g,
                                                            const int64_t D) {
    const float lr = c->lr, eps = c->eps, wd = c->wd;
    if (wd != 0.0f && !c->decoupled) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) g[d] += wd * w[d];
    } else if (wd != 0.0f) {
        /* Decoupled (FBGEMM's DECOUPLE, torch's AdamW): the decay shrinks the weight apart from
         * the gradient and the optimizer state; the update below then reads the shrunk row. */
        const float keep = 1.0f - lr * wd;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) w[d] *= keep;
    }
    switch (c->optimizer) {
    case OPT_SGD:
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) w[d] -= lr * g[d];
        break;
    case OPT_ROWWISE_ADAGRAD: {
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t d = 0; d < D; ++d) sq += g[d] * g[d];
        const float m = c->m1[row] + sq / (float)D;
        c->m1[row] = m;
        const float mult = lr / (sqrtf(m) + eps);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) w[d] -= mult * g[d];
        break;
    }
    case OPT_ADAGRAD: {
        float* restrict s = c->m1 + row * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
            const float sd = s[d] + g[d] * g[d];
            s[d] = sd;
            w[d] -= lr * g[d] / (sqrtf(sd) + eps);
        }
        break;
    }
    case OPT_ADAM: {
        float* restrict m = c->m1 + row * D;
        float* restrict v = c->m2 + row * D;
        const float b1 = c->beta1, b2 = c->beta2, bc1 = c->bc1, bc2 = c->bc2;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
            const float md = b1 * m[d] + (1.0f - b1) * g[d];
            const float vd = b2 * v[d] + (1.0f - b2) * g[d] * g[d];
            m[d] = md;
            v[d] = vd;
            w[d] -= lr * (md / bc1) / (sqrtf(vd / bc2) + eps);
        }
        break;
    }
    }
}

#define SLOT_PREFETCH 32 /* ids ahead: their row -> slot map entries */

/* Fibonacci hashing of a row into a map of 2^(64 - shift) entries. */
static inline uint64_t slot_hash(int64_t row, int shift) {
    return ((uint64_t)row * 0x9E3779B97F4A7C15ull) >> shift;
}

static inline __attribute__((always_inline)) void process_unit(const bwd_t* c,
                                                               const unit_t* u,
                                                               workspace_t* ws,
                                                               const int64_t D) {
    const int64_t T = c->T, B = c->B;
    const int64_t* restrict lin = c->lin;
    const int64_t* restrict offsets = c->offsets;
    const float* restrict psw = c->psw;
    const int mean = c->mean;
    const float gs = c->grad_scale;
    const uint32_t parts = u->parts, part = u->part;
    pending_t* restrict pend = ws->pend;
    contrib_t* restrict contrib = ws->contrib;
    int64_t* restrict urows = ws->urows;
    int32_t* restrict ends = ws->ends;
    const int64_t i_lo = offsets[u->bag_lo], i_hi = offsets[u->bag_hi];
    memset(ends, 0, (size_t)(i_hi - i_lo) * sizeof(int32_t));
    /* The unit's row -> slot map: the smallest power of two >= twice its ids (load <= 1/2). */
    int hbits = 4;
    while (((int64_t)1 << hbits) < 2 * (i_hi - i_lo)) ++hbits;
    const uint64_t hmask = ((uint64_t)1 << hbits) - 1;
    const int hshift = 64 - hbits;
    int32_t* restrict slot_map = c->slot_map;
    slot_entry_t* restrict hmap = ws->hmap;
    if (!slot_map && ++ws->gen == 0) {  /* wrapped: every entry would look live again */
        memset(hmap, 0, ws->hcap * sizeof(slot_entry_t));
        ws->gen = 1;
    }
    const uint32_t gen = ws->gen;

    /* 1. First-seen slots for the unit's rows; count each slot's ids. */
    int64_t n = 0, U = 0;
    /* Bag j = t*B + b, advanced without a 64-bit division per bag (for one-id bags of a small
     * dim that division was a large share of the pass). */
    int64_t t = u->bag_lo / B, b = u->bag_lo - (u->bag_lo / B) * B;
    for (int64_t j = u->bag_lo; j < u->bag_hi; ++j, ++b) {
        if (b == B) {
            b = 0;
            ++t;
        }
        const int32_t go_row = (int32_t)(b * T + t);
        const int64_t lo = offsets[j], hi = offsets[j + 1];
        const float inv_len = (mean && hi > lo) ? gs / (float)(hi - lo) : gs;
        for (int64_t i = lo; i < hi; ++i) {
            if (i + SLOT_PREFETCH < i_hi) {
                const int64_t ahead = lin[i + SLOT_PREFETCH];
                __builtin_prefetch(slot_map ? (const void*)(slot_map + ahead)
                                            : (const void*)(hmap + slot_hash(ahead, hshift)), 1, 3);
            }
            const int64_t row = lin[i];
            if (parts > 1 && row_part(row, parts) != part) continue;
            int is_new;
            int32_t s;
            if (slot_map) {
                s = slot_map[row];
                is_new = s < 0;
                s = is_new ? (int32_t)U : s;
                slot_map[row] = s;
            } else {
                /* Linear probing: the map is at most half full. */
                uint64_t h = slot_hash(row, hshift);
                while (hmap[h].gen == gen && hmap[h].row != row) h = (h + 1) & hmask;
                is_new = hmap[h].gen != gen;
                if (is_new) {
                    hmap[h].row = row;
                    hmap[h].slot = (int32_t)U;
                    hmap[h].gen = gen;
                }
                s = hmap[h].slot;
            }
            urows[U] = row;
            U += is_new;
            ends[s] += 1;
            pend[n].slot = s;
            pend[n].go_row = go_row;
            pend[n].scale = psw ? psw[i] * inv_len : inv_len;
            ++n;
        }
    }
    /* 2. Stable counting sort by slot: each row's ids stay in index order. */
    int32_t run = 0;
    for (int64_t s = 0; s < U; ++s) {
        const int32_t cnt = ends[s];
        ends[s] = run;
        run += cnt;
    }
    for (int64_t k = 0; k < n; ++k) {
        const int32_t pos = ends[pend[k].slot]++;
        contrib[pos].go_row = pend[k].go_row;
        contrib[pos].scale = pend[k].scale;
    }
    /* 3. Reduce each row's gradient, update the row once, reset its slot.  Rows come in
     *    first-seen (random) order: prefetch the weight/state rows and grad_output rows of
     *    the rows a few slots ahead. */
    const int vec = D % 16 == 0 && D / 16 <= MAX_VECS;
    const int64_t NV = D / 16;
    float acc_stack[D <= MAX_REG_D ? D : 1] __attribute__((aligned(64)));
    float* restrict acc = D <= MAX_REG_D ? acc_stack : ws->acc;
    const int64_t w_bytes = D * w_elem_bytes(c->wt);
    float wtmp[c->wt == W_F32 ? 1 : D] __attribute__((aligned(64)));  /* a half row, in fp32 */
    const int64_t m1_bytes = c->optimizer == OPT_ROWWISE_ADAGRAD ? 4
                             : c->optimizer == OPT_SGD             ? 0
                                                                   : D * 4;
    const int64_t m1_stride = c->optimizer == OPT_ROWWISE_ADAGRAD ? 1 : D;
    const int has_m2 = c->optimizer == OPT_ADAM;
    const char* restrict go = (const char*)c->go;
    const int gbf = c->go_bf16;
    const int64_t go_bytes = D * (gbf ? 2 : 4);  /* one bag's gradient row */
    int32_t begin = 0;
    for (int64_t s = 0; s < U; ++s) {
        if (s + ROW_PREFETCH < U) {
            const int64_t prow = urows[s + ROW_PREFETCH];
            prefetch_span((const char*)c->weights + prow * w_bytes, w_bytes, 1);
            if (m1_bytes) prefetch_span(c->m1 + prow * m1_stride, m1_bytes, 1);
            if (has_m2) prefetch_span(c->m2 + prow * D, D * 4, 1);
        }
        if (s + GO_PREFETCH < U) {
            const int32_t p0 = ends[s + GO_PREFETCH - 1], p1 = ends[s + GO_PREFETCH];
            for (int32_t p = p0; p < p1 && p < p0 + 4; ++p)
                prefetch_span(go + (int64_t)contrib[p].go_row * go_bytes, go_bytes, 0);
        }
        const int32_t end = ends[s];
        if (vec && gbf) {
            v16f a[MAX_VECS];
            {
                const contrib_t e = contrib[begin];
                const uint16_t* gr = (const uint16_t*)(go + (int64_t)e.go_row * go_bytes);
                for (int64_t v = 0; v < NV; ++v) a[v] = mul16(load16_bf16(gr + 16 * v), splat16(e.scale));
            }
            for (int32_t p = begin + 1; p < end; ++p) {
                const contrib_t e = contrib[p];
                const uint16_t* gr = (const uint16_t*)(go + (int64_t)e.go_row * go_bytes);
                for (int64_t v = 0; v < NV; ++v) a[v] = add16(a[v], mul16(load16_bf16(gr + 16 * v), splat16(e.scale)));
            }
            for (int64_t v = 0; v < NV; ++v) store16(acc + 16 * v, a[v]);
        } else if (vec) {
            v16f a[MAX_VECS];
            {
                const contrib_t e = contrib[begin];
                const float* gr = (const float*)(go + (int64_t)e.go_row * go_bytes);
                for (int64_t v = 0; v < NV; ++v) a[v] = mul16(load16(gr + 16 * v), splat16(e.scale));
            }
            for (int32_t p = begin + 1; p < end; ++p) {
                const contrib_t e = contrib[p];
                const float* gr = (const float*)(go + (int64_t)e.go_row * go_bytes);
                for (int64_t v = 0; v < NV; ++v) a[v] = add16(a[v], mul16(load16(gr + 16 * v), splat16(e.scale)));
            }
            for (int64_t v = 0; v < NV; ++v) store16(acc + 16 * v, a[v]);
        } else if (gbf) {
            for (int32_t p = begin; p < end; ++p) {
                const contrib_t e = contrib[p];
                const uint16_t* restrict gr = (const uint16_t*)(go + (int64_t)e.go_row * go_bytes);
                if (p == begin) {
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) acc[d] = bf16_to_f32(gr[d]) * e.scale;
                } else {
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) acc[d] += bf16_to_f32(gr[d]) * e.scale;
                }
            }
        } else {
            {
                const contrib_t e = contrib[begin];
                const float* restrict gr = (const float*)(go + (int64_t)e.go_row * go_bytes);
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) acc[d] = gr[d] * e.scale;
            }
            for (int32_t p = begin + 1; p < end; ++p) {
                const contrib_t e = contrib[p];
                const float* restrict gr = (const float*)(go + (int64_t)e.go_row * go_bytes);
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) acc[d] += gr[d] * e.scale;
            }
        }
        begin = end;
        const int64_t row = urows[s];
        if (c->wt == W_F32) {
            apply_row(c, row, (float*)c->weights + row * D, acc, D);
        } else {
            load_half_row(c->weights, c->wt, row, D, wtmp);
            apply_row(c, row, wtmp, acc, D);
            store_half_row(c->weights, c->wt, row, D, wtmp, c->seed, c->key_rows ? c->key_rows[row] : row);
        }
        if (slot_map) slot_map[row] = -1;
    }
}

#define UNIT_FN(DV)                                                                     \
    static void process_unit_##DV(const bwd_t* c, const unit_t* u, workspace_t* ws) { \
        process_unit(c, u, ws, DV);                                                    \
    }
/* 4 and 8: the zoo's and many small models' dims; a constant D makes each row one vector op. */
UNIT_FN(4)
UNIT_FN(8)
UNIT_FN(16)
UNIT_FN(32)
UNIT_FN(64)
UNIT_FN(128)
static void process_unit_any(const bwd_t* c, const unit_t* u, workspace_t* ws) {
    process_unit(c, u, ws, c->D);
}

typedef struct {
    int64_t lo, hi;
} interval_t;

static int cmp_interval(const void* a, const void* b) {
    const int64_t x = ((const interval_t*)a)->lo, y = ((const interval_t*)b)->lo;
    return (x > y) - (x < y);
}

static int cmp_unit_bigger_first(const void* a, const void* b) {
    const int64_t x = ((const unit_t*)a)->ids, y = ((const unit_t*)b)->ids;
    return (x < y) - (x > y);
}

/*
 * weights [R, D]; m1/m2: optimizer state (NULL when unused; rowwise_adagrad m1 is [R]);
 * lin [N]; offsets [T*B+1]; go [B, T*D] of fp32, or of bf16 when go_bf16 (widened as each
 * row is read: a bf16 consumer's gradient needs no conversion pass); psw [N] or NULL; mean: 1 for mean pooling;
 * grad_scale: multiplies every id's gradient (folded into its per-id scale, no pass over go);
 * bc1/bc2: Adam bias corrections 1 - beta^step; slot_map [R], all -1 on entry and on return, or
 * NULL: each unit then maps its rows to slots through a hash map sized by its ids; key_rows [R]
 * or NULL: the row number keying each half row's stochastic rounding (NULL: the row's own).
 */
int recc_tbe_backward_update(void* weights, int wt, uint64_t seed, int64_t R, int64_t D, float* m1, float* m2,
                             const int64_t* lin, const int64_t* offsets, int64_t T,
                             int64_t B, const void* go, int go_bf16, const float* psw, int mean,
                             float grad_scale, int optimizer, float lr, float eps, float beta1, float beta2,
                             float wd, int decoupled, float bc1, float bc2, int32_t* slot_map,
                             const int64_t* segs, int64_t S, int nthreads, const int64_t* key_rows) {
    if (D <= 0 || T < 0 || B < 0 || optimizer < 0 || optimizer > 3) return RC_BAD_ARGS;
    if (wt != W_F32 && wt != W_F16 && wt != W_BF16) return RC_BAD_ARGS;
    if (optimizer != OPT_SGD && !m1) return RC_BAD_ARGS;
    if (optimizer == OPT_ADAM && !m2) return RC_BAD_ARGS;
    const int64_t NB = T * B;
    const int64_t N = offsets[NB];
    if (N == 0) return RC_OK;
    if (N > INT32_MAX || NB > INT32_MAX) return RC_BAD_ARGS;
    if (nthreads < 1) nthreads = 1;
    /* Segments: bag ranges [segs[s], segs[s+1]) whose rows the caller knows to be apart (its
     * tables); NULL: the T tables of B bags. A gather group passes its tables' id counts with
     * T = 1 (one-id bags of different counts per table). Only the work split reads them. */
    int64_t* own_segs = NULL;
    if (!segs) {
        own_segs = malloc((size_t)(T + 1) * sizeof(int64_t));
        if (!own_segs) return RC_NO_MEMORY;
        for (int64_t t = 0; t <= T; ++t) own_segs[t] = t * B;
        segs = own_segs;
        S = T;
    }
    if (S < 0 || segs[0] != 0 || segs[S] != NB) {
        free(own_segs);
        return RC_BAD_ARGS;
    }
    for (int64_t k = 0; k < S; ++k)
        if (segs[k + 1] < segs[k]) {
            free(own_segs);
            return RC_BAD_ARGS;
        }

    /* 0. Every id in [0, R), and each segment's row interval: before any write. */
    interval_t* iv = malloc((size_t)(S > 0 ? S : 1) * (size_t)nthreads * sizeof(interval_t));
    if (!iv) {
        free(own_segs);
        return RC_NO_MEMORY;
    }
    int team = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        if (tid == 0) team = (int)nth;
        const int64_t i0 = N * tid / nth, i1 = N * (tid + 1) / nth;
        for (int64_t t = 0; t < S; ++t) {
            const int64_t lo = offsets[segs[t]] > i0 ? offsets[segs[t]] : i0;
            const int64_t hi = offsets[segs[t + 1]] < i1 ? offsets[segs[t + 1]] : i1;
            int64_t mn = INT64_MAX, mx = INT64_MIN;
#pragma omp simd reduction(min : mn) reduction(max : mx)
            for (int64_t i = lo; i < hi; ++i) {
                mn = lin[i] < mn ? lin[i] : mn;
                mx = lin[i] > mx ? lin[i] : mx;
            }
            iv[tid * S + t].lo = mn;
            iv[tid * S + t].hi = mx;
        }
    }
    /* Combine the per-thread intervals (team: the threads the region really had). */
    int bad = 0;
    interval_t* sorted = malloc((size_t)(S > 0 ? S : 1) * sizeof(interval_t));
    unit_t* units = NULL;
    interval_t* seg_iv = NULL;
    int rc = RC_OK;
    if (!sorted) {
        rc = RC_NO_MEMORY;
        goto done;
    }
    int64_t n_nonempty = 0;
    /* Each segment's row interval (lo > hi: no ids), and the whole batch's: they bound how many
     * parts a unit can usefully be split into (below). */
    seg_iv = malloc((size_t)(S > 0 ? S : 1) * sizeof(interval_t));
    interval_t all_iv = {INT64_MAX, INT64_MIN};
    if (!seg_iv) {
        rc = RC_NO_MEMORY;
        goto done;
    }
    for (int64_t t = 0; t < S; ++t) {
        int64_t mn = INT64_MAX, mx = INT64_MIN;
        for (int k = 0; k < team; ++k) {
            const int64_t i0 = N * k / team, i1 = N * (k + 1) / team;
            const int64_t lo = offsets[segs[t]] > i0 ? offsets[segs[t]] : i0;
            const int64_t hi = offsets[segs[t + 1]] < i1 ? offsets[segs[t + 1]] : i1;
            if (hi <= lo) continue;
            if (iv[k * S + t].lo < mn) mn = iv[k * S + t].lo;
            if (iv[k * S + t].hi > mx) mx = iv[k * S + t].hi;
        }
        seg_iv[t].lo = mn;
        seg_iv[t].hi = mx;
        if (mn < all_iv.lo) all_iv.lo = mn;
        if (mx > all_iv.hi) all_iv.hi = mx;
        if (mn <= mx) {
            if (mn < 0 || mx >= R) bad = 1;
            sorted[n_nonempty].lo = mn;
            sorted[n_nonempty].hi = mx;
            ++n_nonempty;
        }
    }
    if (bad) {
        rc = RC_BAD_ID;
        goto done;
    }
    qsort(sorted, (size_t)n_nonempty, sizeof(interval_t), cmp_interval);
    int disjoint = 1;
    for (int64_t k = 1; k < n_nonempty; ++k) disjoint &= sorted[k].lo > sorted[k - 1].hi;

    /* 1. Work units: a segment (or the whole batch), split into parts of ~N/(2*threads) ids. */
    const int64_t target = (N + 2 * nthreads - 1) / (2 * nthreads);
    const int64_t max_parts = 4 * (int64_t)nthreads;
    int64_t n_units = 0, max_unit_ids = 0;
    units = malloc((size_t)(disjoint && S > 0 ? S : 1) * (size_t)max_parts * sizeof(unit_t));
    if (!units) {
        rc = RC_NO_MEMORY;
        goto done;
    }
    for (int64_t t = 0; t < (disjoint ? S : 1); ++t) {
        const int64_t bag_lo = disjoint ? segs[t] : 0, bag_hi = disjoint ? segs[t + 1] : NB;
        const int64_t count = offsets[bag_hi] - offsets[bag_lo];
        if (count == 0) continue;
        int64_t parts = (count + target - 1) / target;
        if (parts > max_parts) parts = max_parts;
        /* Every part scans all of the unit's ids and keeps its rows' (row_part hashes blocks of
         * 16 rows), so a part only pays where threads share the work and there are blocks to
         * share: one thread, or a unit over a few blocks (a 50-row table has 4), gets one part —
         * two or four parts there rescanned every id for nothing (youtube_dnn's items group). */
        const interval_t span = disjoint ? seg_iv[t] : all_iv;
        const int64_t blocks = span.hi >= span.lo ? (span.hi >> 4) - (span.lo >> 4) + 1 : 1;
        if (parts > blocks) parts = blocks;
        if (nthreads == 1 || parts < 1) parts = 1;
        if (count > max_unit_ids) max_unit_ids = count;
        for (int64_t p = 0; p < parts; ++p) {
            units[n_units].bag_lo = bag_lo;
            units[n_units].bag_hi = bag_hi;
            units[n_units].ids = count / parts;
            units[n_units].parts = (uint32_t)parts;
            units[n_units].part = (uint32_t)p;
            ++n_units;
        }
    }

    /* Biggest first, so the dynamic schedule ends balanced; the order cannot change any
     * result (each row lives in one unit and is reduced in index order). */
    qsort(units, (size_t)n_units, sizeof(unit_t), cmp_unit_bigger_first);

    /* 2. Units in parallel: each owns its rows, so no two threads write the same row. */
    const bwd_t ctx = {weights, wt, seed, R,  D,    m1,    m2,    lin, offsets, T,   B,   go, go_bf16,
                       psw,     mean, optimizer, grad_scale, lr, eps, beta1, beta2, wd, bc1, bc2, decoupled,
                       slot_map, key_rows};
    void (*fn)(const bwd_t*, const unit_t*, workspace_t*) =
        D == 4 ? process_unit_4
        : D == 8 ? process_unit_8
        : D == 16 ? process_unit_16
        : D == 32 ? process_unit_32
        : D == 64 ? process_unit_64
        : D == 128 ? process_unit_128
                   : process_unit_any;
    int no_mem = 0;
#pragma omp parallel num_threads(nthreads)
    {
        workspace_t* ws = &tls_ws;
        if (!ws_reserve(ws, (size_t)max_unit_ids, (size_t)D, slot_map == NULL)) {
#pragma omp atomic write
            no_mem = 1;
        }
#pragma omp barrier
        int give_up;
#pragma omp atomic read
        give_up = no_mem;
        if (!give_up) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t k = 0; k < n_units; ++k) fn(&ctx, &units[k], ws);
        }
    }
    if (no_mem) rc = RC_NO_MEMORY;

done:
    free(iv);
    free(sorted);
    free(seg_iv);
    free(units);
    free(own_segs);
    return rc;
}

/* Exported for the tests: fp32 -> half of n values with the backward's stochastic rounding, as
 * if they were row 0 of a table of n columns updated under `seed`. */
int recc_round_half_sr(const float* in, int64_t n, int wt, uint64_t seed, uint16_t* out) {
    if (wt != W_F16 && wt != W_BF16) return RC_BAD_ARGS;
    store_half_row(out, wt, 0, n, in, seed, 0);
    return 0;
}
