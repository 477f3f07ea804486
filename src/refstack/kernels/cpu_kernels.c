/* fp32 kernels for refstack's CPU decode path (built on first use, see cpu_build.py):
 * a GEMM over packed weights, MoE dispatch / expert pairs / combine, RMSNorm, the KDA
 * recurrence and GQA decode attention.
 *
 * Why not MKL for the GEMMs: a decode step multiplies a few rows (1-32 tokens, or the 2-8 copies an
 * expert gets) by each weight.  MKL's sgemm on this shape runs at 4-10 GB/s of weight
 * traffic and 40-100 GFLOP/s on two AVX-512 cores, far from both limits.  These kernels
 * read a weight packed once at load time into column blocks of NB floats, [N/NB][K][NB],
 * so every block is one contiguous stream, and keep an MR x NB output tile in
 * registers (MR <= 8 rows x two 16-float vectors = 16 accumulators).
 *
 * Every output element is one dot product summed in k order inside one tile: a row's
 * result does not depend on how many other rows share the call (batch invariance).
 *
 * Vectors use GCC's generic vector extension; -march=native picks the instructions.
 * Threads come from the OpenMP runtime torch already loaded (same soname), so the
 * kernels share torch's thread pool instead of starting a second one.
 */
#include <stdlib.h>
#include <time.h>

#include "cpu_common.h"

__thread int64_t *refstack_mark_log = NULL;

/* This thread's span-mark log (cpu_common.h), or NULL to stop marking. */
int refstack_mark_log_set(int64_t *log) {
    refstack_mark_log = log;
    return 0;
}

/* log(1 + y) for y in [0, 1], vectorisable: log(z) = 2 atanh(s) with s = y / (2 + y)
 * in [0, 1/3], summed to s^13 (the next term is below 1e-8 of the result). */
static inline float log1p_unit(float y) {
    const float s = y / (2.0f + y), s2 = s * s;
    float p = 1.0f / 13.0f;
    p = p * s2 + 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    return 2.0f * s * (p * s2 + 1.0f);
}

/* softplus(x) = max(x, 0) + log(1 + e^-|x|), accurate on the whole line. */
static inline float softplus(float x) {
    const float ax = x < 0.0f ? -x : x;
    return (x > 0.0f ? x : 0.0f) + log1p_unit(exp_approx(-ax));
}

static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t ldx, const float *w,
                                                       int64_t K, float *y, int64_t ldy, int n_valid, int epi) {
    v16 a0[MR_MAX], a1[MR_MAX];
    for (int r = 0; r < mr; r++) {
        a0[r] = (v16){0};
        a1[r] = (v16){0};
    }
    for (int64_t k = 0; k < K; k++) {
        const v16 w0 = load16(w + k * NB), w1 = load16(w + k * NB + HALF);
        for (int r = 0; r < mr; r++) {
            const float xv = x[r * ldx + k];
            a0[r] += xv * w0;
            a1[r] += xv * w1;
        }
    }
    tile_out(mr, a0, a1, y, ldy, n_valid, epi);
}

/* Constant row counts, so each case gets a fully unrolled register tile. */
static void tile_rows(int mr, const float *x, int64_t ldx, const float *w, int64_t K, float *y, int64_t ldy,
                      int n_valid, int epi) {
    switch (mr) {
        case 1: tile(1, x, ldx, w, K, y, ldy, n_valid, epi); break;
        case 2: tile(2, x, ldx, w, K, y, ldy, n_valid, epi); break;
        case 3: tile(3, x, ldx, w, K, y, ldy, n_valid, epi); break;
        case 4: tile(4, x, ldx, w, K, y, ldy, n_valid, epi); break;
        case 5: tile(5, x, ldx, w, K, y, ldy, n_valid, epi); break;
        case 6: tile(6, x, ldx, w, K, y, ldy, n_valid, epi); break;
        case 7: tile(7, x, ldx, w, K, y, ldy, n_valid, epi); break;
        default: tile(8, x, ldx, w, K, y, ldy, n_valid, epi); break;
    }
}

int refstack_block_cols(void) { return NB; }

/* y[M, N] = x[M, K] @ W with W packed [ceil(N/NB)][K][NB] (zero-padded past N).
 * Rows of x and y are ldx / ldy floats apart; columns are contiguous. */
int refstack_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const float *wp, int64_t N, float *y,
                  int64_t ldy, int nthreads) {
    if (M < 0 || K <= 0 || N <= 0 || ldx < K || ldy < N || nthreads < 1) return 1;
    const int64_t nb = (N + NB - 1) / NB, mt = (M + MR_MAX - 1) / MR_MAX;
    /* Block-major task order: neighbouring tasks share a weight block while it is hot. */
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < nb * mt; t++) {
        const int64_t b = t / mt, m0 = (t % mt) * MR_MAX;
        const int mr = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
        const int n_valid = (int)(N - b * NB < NB ? N - b * NB : NB);
        tile_rows(mr, x + m0 * ldx, ldx, wp + b * K * NB, K, y + m0 * ldy + b * NB, ldy, n_valid, STORE);
    }
    return 0;
}

/* SwiGLU experts over rows grouped by expert (expert e owns rows offsets[e]..offsets[e+1]):
 *   h[rows] = silu(x @ gate_e) * (x @ up_e)      gate|up packed [E][I/16][D][32]:
 *                                                 block j = gate cols 16j.. | up cols 16j..
 *   y[rows] = h @ down_e                          down packed [E][ceil(D/NB)][I][NB]
 * h is caller scratch [rows, I].  Idle experts cost nothing. */
int refstack_moe_experts(const float *x, const int64_t *offsets, int64_t E, int64_t D, int64_t I,
                         const float *gate_up, const float *down, float *h, float *y, int nthreads) {
    MARK_SPAN();
    if (E <= 0 || E > 4096 || D <= 0 || I <= 0 || I % HALF != 0 || nthreads < 1) return 1;
    int64_t task_start[E + 1], task_start2[E + 1];
    const int64_t nb1 = I / HALF, nb2 = (D + NB - 1) / NB;
    if (expert_tasks(offsets, E, nb1, nb2, task_start, task_start2)) return 1;
    /* Static halves, block-major within an expert: a thread's consecutive tasks reuse a
     * weight block from L2.  (schedule(dynamic) measured 15% slower at 8 tokens.) */
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < task_start[E]; t++) {
            int64_t e, m0, b;
            const int mr = locate(t, task_start, E, offsets, &e, &m0, &b);
            const float *w = gate_up + ((e * nb1 + b) * D) * NB;
            tile_rows(mr, x + m0 * D, D, w, D, h + m0 * I + b * HALF, I, HALF, SILU_MUL);
        }
        /* the implicit barrier: every h row is complete before the down projection */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < task_start2[E]; t++) {
            int64_t e, m0, b;
            const int mr = locate(t, task_start2, E, offsets, &e, &m0, &b);
            const int n_valid = (int)(D - b * NB < NB ? D - b * NB : NB);
            const float *w = down + ((e * nb2 + b) * I) * NB;
            tile_rows(mr, h + m0 * I, I, w, I, y + m0 * D + b * NB, D, n_valid, STORE);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- row-wise ops
 * A decode step's norms are [tokens, 512] or smaller: torch runs each as five or six
 * elementwise ops of a few microseconds each.  One pass per row here, one thread
 * unless the tensor is large (a fork/join costs more than the work). */

/* A dot product with HALF partial sums: without -ffast-math the compiler may not
 * reorder a float reduction, and a single accumulator is one dependent FMA per element
 * (4 cycles each).  The partial sums vectorise. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[HALF] = {0};
    int64_t d = 0;
    for (; d + HALF <= n; d += HALF)
        for (int j = 0; j < HALF; j++) acc[j] += a[d + j] * b[d + j];
    for (int w = HALF / 2; w > 0; w /= 2) /* a tree: 4 dependent adds, not 16 */
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    float s = acc[0];
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

static inline float sum_squares(const float *x, int64_t D) { return dot(x, x, D); }

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, times sigmoid(gate[r]) when gate is given.
 * With delta, x[r] += delta[r] first (written back: the residual stream). */
int refstack_rms_norm(float *x, const float *delta, int64_t rows, int64_t D, const float *w, float eps,
                      const float *gate, float *y, int nthreads) {
    if (rows < 0 || D <= 0 || nthreads < 1) return 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * D >= PAR_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * D;
        float *yr = y + r * D;
        if (delta) {
            const float *dr = delta + r * D;
            for (int64_t d = 0; d < D; d++) xr[d] += dr[d];
        }
        const float inv = 1.0f / sqrtf(sum_squares(xr, D) / (float)D + eps);
        if (gate) {
            const float *gr = gate + r * D;
            for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * inv * w[d] / (1.0f + exp_approx(-gr[d]));
        } else {
            for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * inv * w[d];
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- KDA activations
 * From the fused input projection proj [T, ldp] = q|k (2HK), v (HV), b (H), ... and the
 * low-rank up-projection up [T, ldu] = f (HK), gate (HV), in one pass per token:
 *   q, k = x / sqrt(mean(x^2) + eps) * l2w per head (l2w = K^-1/2: an L2 normalisation)
 *   g = -exp(A_log[h]) * softplus(f + dt_bias),  beta = sigmoid(b),  v copied
 * into contiguous q, k, g [T, H, K], v [T, H, V], beta [T, H] -- the ten or so tensor
 * ops the torch path spends on them, at decode a few microseconds each. */
int refstack_kda_prepare(const float *proj, int64_t ldp, const float *up, int64_t ldu, const float *dt_bias,
                         const float *A_log, float l2w, float eps, int64_t T, int64_t H, int64_t K, int64_t V,
                         float *q, float *k, float *v, float *g, float *beta, int nthreads) {
    if (T < 0 || H <= 0 || K <= 0 || V <= 0 || ldp < 2 * H * K + H * V + H || ldu < H * K || nthreads < 1) return 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * H * (3 * K + V) >= PAR_MIN_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        const float *pr = proj + t * ldp, *ur = up + t * ldu;
        for (int64_t hh = 0; hh < 2 * H; hh++) { /* q heads, then k heads */
            const float *x = pr + hh * K;
            float *y = (hh < H ? q + (t * H + hh) * K : k + (t * H + hh - H) * K);
            const float inv = l2w / sqrtf(sum_squares(x, K) / (float)K + eps);
            for (int64_t i = 0; i < K; i++) y[i] = x[i] * inv;
        }
        memcpy(v + t * H * V, pr + 2 * H * K, (size_t)(H * V) * sizeof(float));
        for (int64_t h = 0; h < H; h++) {
            const float decay = -expf(A_log[h]);
            const float *f = ur + h * K, *bias = dt_bias + h * K;
            float *gh = g + (t * H + h) * K;
            for (int64_t i = 0; i < K; i++) gh[i] = decay * softplus(f[i] + bias[i]);
            beta[t * H + h] = 1.0f / (1.0f + exp_approx(-pr[2 * H * K + H * V + h]));
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- KDA recurrence
 * T tokens of B sequences, token by token, state S [B, H, K, V] updated in place (or,
 * with `slots`, sequence b's state is S[slots[b]]); inputs [B, T, H, *].  Per token, with d = exp(g):
 *   u = beta (v - (k * d)^T S),  o = ((q * d)^T S + (q . k) u) * scale,  S = d * S + k u^T
 * One task per (sequence, head) keeps its state (16 KB at K = V = 64) in L1/L2 for
 * all T tokens: two passes over it per token.  On a few CPU cores this beats the
 * chunkwise-parallel form, whose advantage (matmul-shaped work) needs wide hardware;
 * decode is the T = 1 case. */
/* One (sequence, head) task over its T tokens, any K and V. */
static void scan_task_any(int64_t K, int64_t V, float *Sh, const float *q, const float *k, const float *v, const float *g,
                          const float *beta, int64_t row0, int64_t h, int64_t T, int64_t H, float scale, float *o) {
    float qS[V], kS[V], u[V], d[K];
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = (row0 + t) * H + h;
        const float *qh = q + row * K, *kh = k + row * K, *gh = g + row * K, *vh = v + row * V;
        float *oh = o + row * V;
        const float qk = dot(qh, kh, K);
        for (int64_t j = 0; j < V; j++) qS[j] = kS[j] = 0.0f;
        for (int64_t i = 0; i < K; i++) d[i] = exp_approx(gh[i]);
        for (int64_t i = 0; i < K; i++) {
            const float qd = qh[i] * d[i], kd = kh[i] * d[i];
            const float *srow = Sh + i * V;
            for (int64_t j = 0; j < V; j++) {
                qS[j] += qd * srow[j];
                kS[j] += kd * srow[j];
            }
        }
        const float bt = beta[row];
        for (int64_t j = 0; j < V; j++) {
            u[j] = bt * (vh[j] - kS[j]);
            oh[j] = (qS[j] + qk * u[j]) * scale;
        }
        for (int64_t i = 0; i < K; i++) {
            const float di = d[i], ki = kh[i];
            float *srow = Sh + i * V;
            for (int64_t j = 0; j < V; j++) srow[j] = di * srow[j] + ki * u[j];
        }
    }
}

/* The same task with K and V compile-time constants (V a multiple of 16): the
 * accumulators (q.S, k.S) and u stay in registers instead of stack arrays that every
 * state row reloads and stores (3x faster for a decode step at K = V = 64). */
static inline __attribute__((always_inline)) void scan_task(const int K, const int V, float *Sh, const float *q,
                                                            const float *k, const float *v, const float *g,
                                                            const float *beta, int64_t row0, int64_t h, int64_t T,
                                                            int64_t H, float scale, float *o) {
    float d[K];
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = (row0 + t) * H + h;
        const float *qh = q + row * K, *kh = k + row * K, *gh = g + row * K, *vh = v + row * V;
        float *oh = o + row * V;
        const float qk = dot(qh, kh, K);
        for (int i = 0; i < K; i++) d[i] = exp_approx(gh[i]);
        v16 qS[V / HALF], kS[V / HALF], u[V / HALF];
        for (int c = 0; c < V / HALF; c++) qS[c] = kS[c] = (v16){0};
        for (int i = 0; i < K; i++) {
            const float qd = qh[i] * d[i], kd = kh[i] * d[i];
            const float *srow = Sh + i * V;
            for (int c = 0; c < V / HALF; c++) {
                const v16 sv = load16(srow + c * HALF);
                qS[c] += qd * sv;
                kS[c] += kd * sv;
            }
        }
        const float bt = beta[row];
        for (int c = 0; c < V / HALF; c++) {
            u[c] = bt * (load16(vh + c * HALF) - kS[c]);
            store16(oh + c * HALF, (qS[c] + qk * u[c]) * scale);
        }
        for (int i = 0; i < K; i++) {
            const float di = d[i], ki = kh[i];
            float *srow = Sh + i * V;
            for (int c = 0; c < V / HALF; c++) store16(srow + c * HALF, di * load16(srow + c * HALF) + ki * u[c]);
        }
    }
}

/* One (sequence, head) task: T tokens from row row0, state Sh. */
static void scan_one(int64_t K, int64_t V, float *Sh, const float *q, const float *k, const float *v, const float *g,
                     const float *beta, int64_t row0, int64_t h, int64_t T, int64_t H, float scale, float *o) {
    if (K == 16 && V == 16) scan_task(16, 16, Sh, q, k, v, g, beta, row0, h, T, H, scale, o);
    else if (K == 32 && V == 32) scan_task(32, 32, Sh, q, k, v, g, beta, row0, h, T, H, scale, o);
    else if (K == 64 && V == 64) scan_task(64, 64, Sh, q, k, v, g, beta, row0, h, T, H, scale, o);
    else if (K == 128 && V == 128) scan_task(128, 128, Sh, q, k, v, g, beta, row0, h, T, H, scale, o);
    else scan_task_any(K, V, Sh, q, k, v, g, beta, row0, h, T, H, scale, o);
}

int refstack_kda_scan(const float *q, const float *k, const float *v, const float *g, const float *beta, float *S,
                      const int64_t *slots, int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, float scale, float *o,
                      int nthreads) {
    if (B < 0 || T < 0 || H <= 0 || K <= 0 || K > 1024 || V <= 0 || V > 1024 || nthreads < 1) return 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (B * H * T * K * V >= PAR_MIN_FLOATS)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        scan_one(K, V, S + ((slots ? slots[b] : b) * H + h) * K * V, q, k, v, g, beta, b * T, h, T, H, scale, o);
    }
    return 0;
}

/* Sequences of different lengths in one token stream (a mixed step's decode tokens and
 * prefill chunks): sequence i is rows [begins[i], begins[i] + lengths[i]) of q, k, v, g,
 * beta, o ([N, H, *]) and state S[slots[i]] (of num_slots), zeroed first where fresh[i]
 * (a sequence at position 0).  Each (sequence, head) task owns its state and its output
 * rows, so the slots must be distinct and the row ranges disjoint: both are checked
 * (a repeat would be a silent race).  Tasks are handed out longest first, so a long
 * prefill chunk does not start last and leave the other thread idle.  Returns 1 on a
 * bad shape, 2 on a bad range, slot, repeat or overlap, 3 when out of memory. */
typedef struct { int64_t length, index; } seq_order;

static int longer_first(const void *a, const void *b) {
    const seq_order *x = a, *y = b;
    return (x->length < y->length) - (x->length > y->length);
}

int refstack_kda_scan_varlen(const float *q, const float *k, const float *v, const float *g, const float *beta,
                             float *S, int64_t num_slots, const int64_t *begins, const int64_t *lengths,
                             const int64_t *slots, const uint8_t *fresh, int64_t nseq, int64_t N, int64_t H, int64_t K,
                             int64_t V, float scale, float *o, int nthreads) {
    if (nseq < 0 || N < 0 || num_slots < 0 || H <= 0 || K <= 0 || K > 1024 || V <= 0 || V > 1024 || nthreads < 1)
        return 1;
    uint8_t *used = calloc((size_t)(num_slots + N) + 1, 1); /* slots taken, then rows taken */
    seq_order *order = malloc((size_t)(nseq > 0 ? nseq : 1) * sizeof *order);
    if (!used || !order) {
        free(used);
        free(order);
        return 3;
    }
    int rc = 0;
    int64_t work = 0;
    for (int64_t i = 0; i < nseq && !rc; i++) {
        /* lengths[i] > N - begins[i], not begins + lengths > N: that sum can overflow. */
        if (lengths[i] < 0 || begins[i] < 0 || begins[i] > N || lengths[i] > N - begins[i] || slots[i] < 0 ||
            slots[i] >= num_slots || used[slots[i]]) {
            rc = 2;
            break;
        }
        used[slots[i]] = 1;
        for (int64_t r = begins[i]; r < begins[i] + lengths[i]; r++) {
            if (used[num_slots + r]) rc = 2;
            used[num_slots + r] = 1;
        }
        order[i] = (seq_order){lengths[i], i};
        work += lengths[i];
    }
    free(used);
    if (rc) {
        free(order);
        return rc;
    }
    qsort(order, (size_t)nseq, sizeof *order, longer_first);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (work * H * K * V >= PAR_MIN_FLOATS)
    for (int64_t sh = 0; sh < nseq * H; sh++) {
        const int64_t i = order[sh / H].index, h = sh % H;
        float *Sh = S + (slots[i] * H + h) * K * V;
        if (fresh[i]) memset(Sh, 0, (size_t)(K * V) * sizeof(float));
        scan_one(K, V, Sh, q, k, v, g, beta, begins[i], h, lengths[i], H, scale, o);
    }
    free(order);
    return 0;
}

/* ---------------------------------------------------------------- MoE dispatch / combine
 * dispatch: the T*k routed copies sorted by expert (a counting sort, stable in token
 * order, the same order as a stable argsort of the flat expert ids), their rows
 * gathered into `rows`; copy_slot[t, j] is the row that copy (t, j) went to.
 * combine: y[t] = sum_j w[t, j] * out[copy_slot[t, j]], summed in the token's own
 * top-k order, so a token's sum never depends on the rest of the batch. */
int refstack_moe_dispatch(const float *x, int64_t T, int64_t D, const int64_t *topk_ids, const float *topk_w, int64_t k,
                          int64_t E, int64_t *counts, float *rows, int64_t *copy_slot, int64_t *token_ids,
                          float *weights, int64_t *offsets, int nthreads) {
    if (T < 0 || D <= 0 || k <= 0 || E <= 0 || E > 4096 || nthreads < 1) return 1;
    int64_t next[E];
    for (int64_t e = 0; e < E; e++) counts[e] = 0;
    for (int64_t c = 0; c < T * k; c++) {
        if (topk_ids[c] < 0 || topk_ids[c] >= E) return 2;
        counts[topk_ids[c]]++;
    }
    int64_t start = 0;
    for (int64_t e = 0; e < E; e++) {
        next[e] = start;
        if (offsets) offsets[e] = start;
        start += counts[e];
    }
    if (offsets) offsets[E] = start;
    for (int64_t c = 0; c < T * k; c++) {
        const int64_t pos = next[topk_ids[c]]++;
        copy_slot[c] = pos;
        token_ids[pos] = c / k;
        weights[pos] = topk_w[c];
    }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * k * D >= PAR_MIN_FLOATS)
    for (int64_t c = 0; c < T * k; c++) memcpy(rows + copy_slot[c] * D, x + (c / k) * D, (size_t)D * sizeof(float));
    return 0;
}

#define COMBINE_CHUNK 256

int refstack_moe_combine(const float *out, int64_t n_out, const int64_t *copy_slot, const float *w, int64_t T, int64_t k,
                         int64_t D, float *y, int accumulate, int nthreads) {
    if (T < 0 || k <= 0 || D <= 0 || nthreads < 1) return 1;
    for (int64_t c = 0; c < T * k; c++)
        if (copy_slot[c] < 0 || copy_slot[c] >= n_out) return 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * k * D >= PAR_MIN_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t d0 = 0; d0 < D; d0 += COMBINE_CHUNK) { /* a fixed stack buffer, any D */
            const int64_t n = D - d0 < COMBINE_CHUNK ? D - d0 : COMBINE_CHUNK;
            float sum[COMBINE_CHUNK];
            const float *first = out + copy_slot[t * k] * D + d0;
            const float w0 = w[t * k];
            for (int64_t d = 0; d < n; d++) sum[d] = w0 * first[d];
            for (int64_t j = 1; j < k; j++) {
                const float *src = out + copy_slot[t * k + j] * D + d0;
                const float wj = w[t * k + j];
                for (int64_t d = 0; d < n; d++) sum[d] += wj * src[d];
            }
            float *yt = y + t * D + d0;
            if (accumulate) /* the residual add of the block: y is the residual stream */
                for (int64_t d = 0; d < n; d++) yt[d] += sum[d];
            else
                memcpy(yt, sum, (size_t)n * sizeof(float));
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- expert-parallel exchange
 * An EP library's intranode dispatch / combine (DeepEP's normal mode): each rank copies
 * the token rows bound for the others into their buffers, then spins on a flag until
 * every peer's rows have landed.  All ranks share this process, so the copy is the
 * local gather above; the wait for the peers is modelled: the bytes that cross ranks
 * over a link of `ns_per_byte` (1 / link bandwidth in GB/s), waited out on the calling
 * thread, as the library's barrier waits.  The modelled wait sleeps instead of burning
 * the core: on a real host the polling thread has a core of its own, while here the
 * cores are the ones the measured processes run on.  For Python's GIL the two are the
 * same (the caller is inside a native call either way).  A token's home rank is its contiguous
 * shard, t * ep_ranks / T; a copy crosses when its expert lives on another rank.
 * The spin is bounded (EP_MAX_WAIT_NS): a modelled wait never hangs a step.
 * Whether the caller holds Python's GIL meanwhile is the caller's choice (ctypes'
 * CDLL releases it for the call, PyDLL keeps it): see refstack.kernels.cpu_kernels. */
#define EP_MAX_WAIT_NS 50000000LL

static inline int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t refstack_ep_cross_bytes(const int64_t *topk_ids, int64_t T, int64_t k, int64_t E, int64_t ep_ranks, int64_t D) {
    if (T <= 0 || k <= 0 || E <= 0 || ep_ranks <= 0 || E % ep_ranks) return 0;
    const int64_t per_rank = E / ep_ranks;
    int64_t crossing = 0;
    for (int64_t c = 0; c < T * k; c++) {
        const int64_t home = (c / k) * ep_ranks / T, dest = topk_ids[c] / per_rank;
        crossing += home != dest;
    }
    return crossing * D * (int64_t)sizeof(float);
}

/* Wait (absolute-deadline sleeps, resumed after a signal) for bytes * ns_per_byte;
 * returns the nanoseconds waited. */
int64_t refstack_ep_wait(int64_t bytes, double ns_per_byte) {
    if (bytes <= 0 || !(ns_per_byte > 0.0)) return 0;
    double want = (double)bytes * ns_per_byte;
    const int64_t wait = want > (double)EP_MAX_WAIT_NS ? EP_MAX_WAIT_NS : (int64_t)want;
    const int64_t start = monotonic_ns(), until = start + wait;
    const struct timespec deadline = {(time_t)(until / 1000000000LL), (long)(until % 1000000000LL)};
    int64_t now = start;
    while (now < until) {
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &deadline, NULL);
        now = monotonic_ns();
    }
    return now - start;
}

/* refstack_moe_dispatch, then the wait for the peers' rows (`cross_bytes` from
 * refstack_ep_cross_bytes; ns_per_byte 0: no wait). */
int refstack_ep_dispatch(const float *x, int64_t T, int64_t D, const int64_t *topk_ids, const float *topk_w, int64_t k,
                         int64_t E, int64_t *counts, float *rows, int64_t *copy_slot, int64_t *token_ids,
                         float *weights, int64_t *offsets, int nthreads, int64_t cross_bytes, double ns_per_byte) {
    MARK_SPAN();
    const int rc = refstack_moe_dispatch(x, T, D, topk_ids, topk_w, k, E, counts, rows, copy_slot, token_ids, weights,
                                         offsets, nthreads);
    if (rc) return rc;
    refstack_ep_wait(cross_bytes, ns_per_byte);
    return 0;
}

/* The wait for the expert outputs to come back (`cross_bytes` of them), then
 * refstack_moe_combine. */
int refstack_ep_combine(const float *out, int64_t n_out, const int64_t *copy_slot, const float *w, int64_t T, int64_t k,
                        int64_t D, float *y, int accumulate, int nthreads, int64_t cross_bytes, double ns_per_byte) {
    MARK_SPAN();
    refstack_ep_wait(cross_bytes, ns_per_byte);
    return refstack_moe_combine(out, n_out, copy_slot, w, T, k, D, y, accumulate, nthreads);
}

/* Router: per token the k largest logits (ties to the lower expert id), their softmax
 * as weights (the renormalised top-k of a full softmax: its denominator cancels). */
int refstack_moe_route(const float *logits, int64_t T, int64_t E, int64_t k, int64_t *ids, float *w) {
    if (T < 0 || E <= 0 || k <= 0 || k > E || k > 64) return 1;
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        int64_t *id = ids + t * k;
        for (int64_t j = 0; j < k; j++) { /* k is 1-8: selection beats sorting */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[j] = best;
        }
        float ex[64], sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += ex[j] = expf(l[id[j]] - l[id[0]]);
        for (int64_t j = 0; j < k; j++) w[t * k + j] = ex[j] / sum;
    }
    return 0;
}

/* ---------------------------------------------------------------- KDA decode block
 * A whole KDA layer for B decode tokens in one call, so the step pays one call instead
 * of seven (each a few microseconds of Python, checks and allocations, which at decode
 * cost as much as the small kernels themselves):
 *   proj = h @ in_proj;  up = proj[:, -2V:] @ low_rank;  q, k, v, g, beta = prepare
 *   o = scan(T = 1) on S (updated in place);  o = rms_norm(o) * sigmoid(gate);  out = o @ o_proj
 * The three weights are fp32 packed, or bf16 packed when `bf16` is set (cpu_bf16.c).
 * The state of token b is S[b], or S[slots[b]] when slots is given.
 * `scratch` holds B * (n_in + 4HK + 5HV + H) floats: proj, up, q, k, g, v, beta, o, gate, y. */
int refstack_kda_decode_block(const float *h, int64_t B, int64_t D, const void *in_proj, int64_t n_in,
                              const void *low_rank, const float *dt_bias, const float *A_log, float l2w, float l2_eps,
                              float *S, int64_t H, int64_t K, int64_t V, float scale, const float *o_norm_w, float o_eps,
                              const void *o_proj, int bf16, const int64_t *slots, float *out, float *scratch,
                              int nthreads) {
    MARK_SPAN();
    const int64_t n_up = H * K + H * V, rank2 = n_in - (2 * H * K + H * V + H);
    if (B <= 0 || D <= 0 || rank2 <= 0 || nthreads < 1) return 1;
    float *proj = scratch, *up = proj + B * n_in, *q = up + B * n_up, *k = q + B * H * K, *g = k + B * H * K;
    float *v = g + B * H * K, *beta = v + B * H * V, *o = beta + B * H, *gate = o + B * H * V, *y = gate + B * H * V;
    int rc = gemm_any(bf16, h, B, D, D, in_proj, n_in, proj, n_in, nthreads);
    rc = rc ? rc : gemm_any(bf16, proj + (n_in - rank2), B, rank2, n_in, low_rank, n_up, up, n_up, nthreads);
    rc = rc ? rc : refstack_kda_prepare(proj, n_in, up, n_up, dt_bias, A_log, l2w, l2_eps, B, H, K, V, q, k, v, g, beta,
                                        nthreads);
    rc = rc ? rc : refstack_kda_scan(q, k, v, g, beta, S, slots, B, 1, H, K, V, scale, o, nthreads);
    if (rc) return rc;
    for (int64_t b = 0; b < B; b++) /* the gate's rows are strided inside up */
        memcpy(gate + b * H * V, up + b * n_up + H * K, (size_t)(H * V) * sizeof(float));
    rc = refstack_rms_norm(o, NULL, B * H, V, o_norm_w, o_eps, gate, y, nthreads);
    return rc ? rc : gemm_any(bf16, y, B, H * V, H * V, o_proj, D, out, D, nthreads);
}
