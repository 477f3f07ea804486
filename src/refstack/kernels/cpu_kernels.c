/* fp32 kernels for refstack's CPU decode path (built on first use, see cpu_build.py):
 * a GEMM over packed weights, the MoE expert pair, RMSNorm, and the KDA decode step.
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
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NB 32      /* output columns per packed block */
#define HALF 16    /* floats per vector */
#define MR_MAX 8   /* rows per register tile */

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

enum epilogue { STORE = 0, SILU_MUL = 1 };

/* One MR x NB tile: y[r, :] = x[r, :K] @ block, block [K][NB].
 * STORE writes n_valid (<= NB) columns.  SILU_MUL treats the block's first 16 columns as
 * gate and the last 16 as up and writes silu(gate) * up, 16 columns. */
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
    for (int r = 0; r < mr; r++) {
        float *out = y + r * ldy;
        if (epi == SILU_MUL) {
            float g[HALF], u[HALF];
            store16(g, a0[r]);
            store16(u, a1[r]);
            for (int j = 0; j < HALF; j++) out[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
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

/* Which (expert, row tile, column block) task t is, for experts whose rows start at
 * offsets[e] (offsets[E] = all rows); tasks are block-major within an expert. */
static void locate(int64_t t, const int64_t *task_start, int64_t E, const int64_t *offsets, int64_t *e_out,
                   int64_t *m0_out, int64_t *b_out) {
    int64_t e = 0;
    while (e + 1 < E && task_start[e + 1] <= t) e++;
    const int64_t local = t - task_start[e];
    const int64_t mt = (offsets[e + 1] - offsets[e] + MR_MAX - 1) / MR_MAX;
    *e_out = e;
    *b_out = local / mt;
    *m0_out = offsets[e] + (local % mt) * MR_MAX;
}

/* SwiGLU experts over rows grouped by expert (expert e owns rows offsets[e]..offsets[e+1]):
 *   h[rows] = silu(x @ gate_e) * (x @ up_e)      gate|up packed [E][I/16][D][32]:
 *                                                 block j = gate cols 16j.. | up cols 16j..
 *   y[rows] = h @ down_e                          down packed [E][ceil(D/NB)][I][NB]
 * h is caller scratch [rows, I].  Idle experts cost nothing. */
int refstack_moe_experts(const float *x, const int64_t *offsets, int64_t E, int64_t D, int64_t I,
                         const float *gate_up, const float *down, float *h, float *y, int nthreads) {
    if (E <= 0 || E > 4096 || D <= 0 || I <= 0 || I % HALF != 0 || nthreads < 1) return 1;
    int64_t task_start[E + 1], task_start2[E + 1];
    const int64_t nb1 = I / HALF, nb2 = (D + NB - 1) / NB;
    task_start[0] = task_start2[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = offsets[e + 1] - offsets[e];
        if (rows < 0) return 1;
        const int64_t mt = (rows + MR_MAX - 1) / MR_MAX;
        task_start[e + 1] = task_start[e] + mt * nb1;
        task_start2[e + 1] = task_start2[e] + mt * nb2;
    }
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < task_start[E]; t++) {
            int64_t e, m0, b;
            locate(t, task_start, E, offsets, &e, &m0, &b);
            const int mr = (int)(offsets[e + 1] - m0 < MR_MAX ? offsets[e + 1] - m0 : MR_MAX);
            const float *w = gate_up + ((e * nb1 + b) * D) * NB;
            tile_rows(mr, x + m0 * D, D, w, D, h + m0 * I + b * HALF, I, HALF, SILU_MUL);
        }
        /* the implicit barrier: every h row is complete before the down projection */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < task_start2[E]; t++) {
            int64_t e, m0, b;
            locate(t, task_start2, E, offsets, &e, &m0, &b);
            const int mr = (int)(offsets[e + 1] - m0 < MR_MAX ? offsets[e + 1] - m0 : MR_MAX);
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

#define PAR_MIN_FLOATS (1 << 16)

static inline float sum_squares(const float *x, int64_t D) {
    float acc[HALF] = {0};
    int64_t d = 0;
    for (; d + HALF <= D; d += HALF)
        for (int j = 0; j < HALF; j++) acc[j] += x[d + j] * x[d + j];
    float s = 0.0f;
    for (int j = 0; j < HALF; j++) s += acc[j];
    for (; d < D; d++) s += x[d] * x[d];
    return s;
}

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
            for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * inv * w[d] / (1.0f + expf(-gr[d]));
        } else {
            for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * inv * w[d];
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- KDA decode step
 * One token per sequence, state S [B, H, K, V] updated in place.  With d = exp(g):
 *   u = beta (v - (k * d)^T S),  o = ((q * d)^T S + (q . k) u) * scale,  S = d * S + k u^T
 * Two passes over each head's state (16 KB at K = V = 64: it stays in L1/L2 between
 * them) instead of the five tensor ops torch needs. */
int refstack_kda_decode(const float *q, const float *k, const float *v, const float *g, const float *beta,
                        float *S, int64_t B, int64_t H, int64_t K, int64_t V, float scale, float *o, int nthreads) {
    if (B < 0 || H <= 0 || K <= 0 || V <= 0 || V > 1024 || nthreads < 1) return 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (B * H * K * V >= PAR_MIN_FLOATS)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const float *qh = q + bh * K, *kh = k + bh * K, *gh = g + bh * K, *vh = v + bh * V;
        float *Sh = S + bh * K * V, *oh = o + bh * V;
        float qS[V], kS[V], u[V];
        float qk = 0.0f;
        for (int64_t j = 0; j < V; j++) qS[j] = kS[j] = 0.0f;
        for (int64_t i = 0; i < K; i++) {
            const float d = expf(gh[i]), qd = qh[i] * d, kd = kh[i] * d;
            const float *row = Sh + i * V;
            for (int64_t j = 0; j < V; j++) {
                qS[j] += qd * row[j];
                kS[j] += kd * row[j];
            }
            qk += qh[i] * kh[i];
        }
        const float b = beta[bh];
        for (int64_t j = 0; j < V; j++) {
            u[j] = b * (vh[j] - kS[j]);
            oh[j] = (qS[j] + qk * u[j]) * scale;
        }
        for (int64_t i = 0; i < K; i++) {
            const float d = expf(gh[i]), ki = kh[i];
            float *row = Sh + i * V;
            for (int64_t j = 0; j < V; j++) row[j] = d * row[j] + ki * u[j];
        }
    }
    return 0;
}
