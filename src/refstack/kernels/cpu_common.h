/* What the fp32 and bf16 kernel files share: block geometry, vectors, exp, the tile
 * epilogue and the expert task map.  See cpu_kernels.c for the design. */
#ifndef REFSTACK_CPU_COMMON_H
#define REFSTACK_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>


/* Span marks (refstack.model.decode_trace).  A thread that hands the library a log with
 * refstack_mark_log_set gets each instrumented kernel's entry and exit time written into
 * it: the native decode step's mixer blocks, expert-parallel dispatch and combine, and
 * experts, which is every per-layer span the step records.  Reading the clock here costs
 * ~20 ns a mark; from Python it cost ten clock reads and a packed record per layer, which
 * made the per-layer trace ~3% of a ~0.3 ms step on `tiny`.  The clock is CLOCK_MONOTONIC,
 * the one Python's time.perf_counter_ns reads on Linux, so the marks sit on the trace's
 * clock.  log[0] counts the marks written at log[2...], log[1] is their capacity; a span
 * is written whole (entry and exit) or not at all.  Thread-local: the kernels run on
 * whichever thread calls them, and each thread's steps have their own log. */
extern __thread int64_t *refstack_mark_log;

static inline int64_t mark_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int mark_open(void) {
    int64_t *log = refstack_mark_log;
    if (!log || log[0] + 2 > log[1]) return 0; /* room for the exit mark too */
    log[2 + log[0]++] = mark_now_ns();
    return 1;
}

static inline void mark_close(const int *opened) {
    if (*opened) {
        int64_t *log = refstack_mark_log;
        log[2 + log[0]++] = mark_now_ns();
    }
}

/* At the top of an instrumented kernel: marks its entry now and its exit when it returns,
 * on every return path (after the return value is computed). */
#define MARK_SPAN() const int mark_span_ __attribute__((cleanup(mark_close), unused)) = mark_open()

#define NB 32      /* output columns per packed block */
#define HALF 16    /* floats per vector */
#define MR_MAX 8   /* rows per register tile */

typedef float v16 __attribute__((vector_size(64)));

/* exp(x) in plain arithmetic, so loops that call it vectorise: glibc's expf has vector
 * variants only under -ffast-math, and a scalar expf per element was a third of the
 * decode step's silu, gate and softmax time.  Round-to-nearest range reduction
 * x = n ln2 + r (ln2 in two parts), a degree-6 polynomial for e^r on |r| <= ln2/2, and
 * 2^n put into the exponent bits: about 2 ulp over the clamped range.  Inputs below
 * -87.3 give ~1e-38 instead of 0 (and -inf does too): every caller multiplies or adds
 * the result, where that is 0 to fp32 precision. */
static inline float exp_approx(float x_in) {
    /* NaN compares false everywhere: map it to 0 for the arithmetic (the integer
     * conversion below is only defined for finite values) and return it at the end. */
    float x = x_in != x_in ? 0.0f : x_in;
    x = x < -87.3f ? -87.3f : (x > 88.5f ? 88.5f : x);
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * r) * r + r + 1.0f;
    /* 2^n into the exponent field, in unsigned arithmetic (a left shift of a negative
     * int is undefined in ISO C); n is in [-126, 128] after the clamp. */
    uint32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (uint32_t)(int32_t)n << 23;
    memcpy(&p, &bits, sizeof p);
    return x_in != x_in ? x_in : p;
}

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

enum epilogue { STORE = 0, SILU_MUL = 1 };

/* One MR x NB tile: y[r, :] = x[r, :K] @ block, block [K][NB].
 * STORE writes n_valid (<= NB) columns.  SILU_MUL treats the block's first 16 columns as
 * gate and the last 16 as up and writes silu(gate) * up, 16 columns. */
static inline __attribute__((always_inline)) void tile_out(const int mr, const v16 *a0, const v16 *a1, float *y,
                                                           int64_t ldy, int n_valid, int epi) {
    for (int r = 0; r < mr; r++) {
        float *out = y + r * ldy;
        if (epi == SILU_MUL) {
            float g[HALF], u[HALF];
            store16(g, a0[r]);
            store16(u, a1[r]);
            for (int j = 0; j < HALF; j++) out[j] = g[j] / (1.0f + exp_approx(-g[j])) * u[j];
        } else if (n_valid == NB) {
            store16(out, a0[r]);
            store16(out + HALF, a1[r]);
        } else { /* the last block of an N that is not a multiple of NB */
            float tmp[NB];
            store16(tmp, a0[r]);
            store16(tmp + HALF, a1[r]);
            memcpy(out, tmp, (size_t)n_valid * sizeof(float));
        }
    }
}

/* The expert kernels' task lists: expert e's tasks are its row tiles (MR_MAX rows) times
 * nb1 column blocks in the first GEMM, times nb2 in the second; task_start[e] is where
 * expert e's begin (task_start[E] = all).  Non-zero when an expert's row count is negative. */
static inline int expert_tasks(const int64_t *offsets, int64_t E, int64_t nb1, int64_t nb2, int64_t *task_start,
                               int64_t *task_start2) {
    task_start[0] = task_start2[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = offsets[e + 1] - offsets[e];
        if (rows < 0) return 1;
        const int64_t mt = (rows + MR_MAX - 1) / MR_MAX;
        task_start[e + 1] = task_start[e] + mt * nb1;
        task_start2[e + 1] = task_start2[e] + mt * nb2;
    }
    return 0;
}

/* Which (expert, row tile, column block) task t is, for experts whose rows start at
 * offsets[e] (offsets[E] = all rows); tasks are block-major within an expert.  Returns
 * the tile's row count. */
static inline int locate(int64_t t, const int64_t *task_start, int64_t E, const int64_t *offsets, int64_t *e_out,
                         int64_t *m0_out, int64_t *b_out) {
    int64_t e = 0;
    while (e + 1 < E && task_start[e + 1] <= t) e++;
    const int64_t local = t - task_start[e];
    const int64_t mt = (offsets[e + 1] - offsets[e] + MR_MAX - 1) / MR_MAX;
    *e_out = e;
    *b_out = local / mt;
    *m0_out = offsets[e] + (local % mt) * MR_MAX;
    return (int)(offsets[e + 1] - *m0_out < MR_MAX ? offsets[e + 1] - *m0_out : MR_MAX);
}

/* Below this many floats a row-wise op runs on one thread: a fork/join costs more than the work. */
#define PAR_MIN_FLOATS (1 << 16)

int refstack_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const float *wp, int64_t N, float *y,
                  int64_t ldy, int nthreads);
int refstack_gemm_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t N, float *y,
                       int64_t ldy, int nthreads);

int refstack_gemm_tagged(const float *x, int64_t M, int64_t K, int64_t ldx, const void *pack, int64_t N, float *y,
                         int64_t ldy, int nthreads);

/* The fp32 or the bf16 GEMM, by the packed weight's type; kind 2: a tagged pack (cpu_int8.c:
 * W8A8, or fp32 / bf16 behind a header), so one block can mix W8A8 and higher-precision weights. */
static inline int gemm_any(int bf16, const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, int64_t N, float *y,
                           int64_t ldy, int nthreads) {
    if (bf16 == 2) return refstack_gemm_tagged(x, M, K, ldx, w, N, y, ldy, nthreads);
    return bf16 ? refstack_gemm_bf16(x, M, K, ldx, (const uint16_t *)w, N, y, ldy, nthreads)
                : refstack_gemm(x, M, K, ldx, (const float *)w, N, y, ldy, nthreads);
}

#endif
