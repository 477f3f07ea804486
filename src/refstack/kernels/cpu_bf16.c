/* bf16 GEMMs for refstack's `dtype=bfloat16` mode: bf16 weights and bf16-rounded
 * activations in, fp32 accumulation and fp32 results out (what a tensor-core GEMM with
 * fp32 accumulate computes; everything between the GEMMs stays fp32).
 *
 * Why: a decode step streams every weight once, and at batch 32 the experts' GEMMs are
 * bound by both the weight traffic and the FMA rate.  bf16 halves the first, and on
 * CPUs with AVX512_BF16 one `vdpbf16ps` does the work of two fp32 FMAs, halving the
 * second (measured on the 2-core bench box at K = N = 512: 370-410 GFLOP/s hot against
 * 200-220 for the fp32 tile, 1.6x the fp32 tile with cold weights).
 *
 * Packed weights: [ceil(N/NB)][K2][NB][2] with K2 = ceil(K/2): column j of k-pair p
 * holds (w[2p][j], w[2p+1][j]), zero past K and N.  Activations are rounded to bf16
 * (round to nearest even) once per call; a row of bf16 in order is a row of pairs
 * (x[2p], x[2p+1]), so the tile broadcasts one 32-bit word per row and k-pair.
 *
 * Each output element is summed over k in one fixed order inside one tile, as in the
 * fp32 kernels: a row's result never depends on the other rows of the call.  The
 * portable path adds each pair in vdpbf16ps's order (odd element first; the products
 * of bf16 values are exact in fp32), so both paths give the same sums, except that
 * vdpbf16ps flushes denormals (|x| < 1.2e-38) to zero. */
#include <stdlib.h>

#include "cpu_common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif


/* 1 when this build has the bf16 dot-product instruction (vdpbf16ps): the engine's
 * dtype=auto picks bf16 GEMMs only then, since the portable path widens each pair to
 * fp32 and saves bytes but no arithmetic. */
int refstack_bf16_dot_native(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* fp32 bits -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.  Branch-free,
 * so the loops below vectorise (a per-element branch made the conversion of a
 * 64 x 512 input cost a third of its GEMM). */
static inline uint16_t bf16_bits(uint32_t u) {
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/* n floats -> n bf16, in order: read as 32-bit words, bf16 pairs (x[2p], x[2p+1]) with
 * the even element in the low half -- the layout the tiles broadcast. */
static inline void to_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u); /* (not a cast: that would break C's aliasing rules) */
        out[i] = bf16_bits(u);
    }
}

/* The bf16 pair p of a row, as one 32-bit word (memcpy: the buffer holds uint16_t). */
static inline uint32_t pair_at(const uint16_t *row, int64_t p) {
    uint32_t v;
    memcpy(&v, row + 2 * p, sizeof v);
    return v;
}

/* Rows x[M][K] (row stride ldx) as bf16 rows xb[M][2 K2]; an odd K's last pair is (x, 0). */
static void rows_to_pairs(const float *x, int64_t M, int64_t K, int64_t ldx, uint16_t *xb, int nthreads) {
    const int64_t K2 = (K + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= PAR_MIN_FLOATS)
    for (int64_t r = 0; r < M; r++) {
        uint16_t *out = xb + r * 2 * K2;
        to_bf16(x + r * ldx, K, out);
        if (K % 2) out[K] = 0;
    }
}

/* One MR x NB tile over a bf16 block [K2][NB][2]; epilogues as the fp32 tile's. */
static inline __attribute__((always_inline)) void tile_bf16(const int mr, const uint16_t *xb, int64_t ldx2,
                                                            const uint16_t *w, int64_t K2, float *y, int64_t ldy,
                                                            int n_valid, int epi) {
    v16 a0[MR_MAX], a1[MR_MAX];
#if defined(__AVX512BF16__)
    __m512 c0[MR_MAX], c1[MR_MAX];
    for (int r = 0; r < mr; r++) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K2; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 2 * NB);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * 2 * NB + NB);
        for (int r = 0; r < mr; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair_at(xb + r * 2 * ldx2, p));
            c0[r] = _mm512_dpbf16_ps(c0[r], xv, w0);
            c1[r] = _mm512_dpbf16_ps(c1[r], xv, w1);
        }
    }
    for (int r = 0; r < mr; r++) {
        memcpy(&a0[r], &c0[r], sizeof a0[r]);
        memcpy(&a1[r], &c1[r], sizeof a1[r]);
    }
#else
    /* No bf16 dot-product instruction: widen the pairs to fp32 (a bf16 is the top half of
     * an fp32) and use fp32 FMAs.  Same products, exact in fp32; half the weight bytes. */
    typedef uint32_t u16v __attribute__((vector_size(64)));
    for (int r = 0; r < mr; r++) a0[r] = a1[r] = (v16){0};
    for (int64_t p = 0; p < K2; p++) {
        u16v p0, p1;
        memcpy(&p0, w + p * 2 * NB, sizeof p0);
        memcpy(&p1, w + p * 2 * NB + NB, sizeof p1);
        const v16 lo0 = (v16)(p0 << 16), hi0 = (v16)(p0 & 0xffff0000u);
        const v16 lo1 = (v16)(p1 << 16), hi1 = (v16)(p1 & 0xffff0000u);
        for (int r = 0; r < mr; r++) {
            const uint32_t pair = pair_at(xb + r * 2 * ldx2, p), lo_bits = pair << 16, hi_bits = pair & 0xffff0000u;
            float xl, xh;
            memcpy(&xl, &lo_bits, sizeof xl);
            memcpy(&xh, &hi_bits, sizeof xh);
            a0[r] += xh * hi0; /* the odd element first, as vdpbf16ps adds them */
            a0[r] += xl * lo0;
            a1[r] += xh * hi1;
            a1[r] += xl * lo1;
        }
    }
#endif
    tile_out(mr, a0, a1, y, ldy, n_valid, epi);
}

static void tile_rows_bf16(int mr, const uint16_t *xb, int64_t ldx2, const uint16_t *w, int64_t K2, float *y,
                           int64_t ldy, int n_valid, int epi) {
    switch (mr) {
        case 1: tile_bf16(1, xb, ldx2, w, K2, y, ldy, n_valid, epi); break;
        case 2: tile_bf16(2, xb, ldx2, w, K2, y, ldy, n_valid, epi); break;
        case 3: tile_bf16(3, xb, ldx2, w, K2, y, ldy, n_valid, epi); break;
        case 4: tile_bf16(4, xb, ldx2, w, K2, y, ldy, n_valid, epi); break;
        case 5: tile_bf16(5, xb, ldx2, w, K2, y, ldy, n_valid, epi); break;
        case 6: tile_bf16(6, xb, ldx2, w, K2, y, ldy, n_valid, epi); break;
        case 7: tile_bf16(7, xb, ldx2, w, K2, y, ldy, n_valid, epi); break;
        default: tile_bf16(8, xb, ldx2, w, K2, y, ldy, n_valid, epi); break;
    }
}

/* y[M, N] = bf16(x[M, K]) @ W, W packed as above; rows ldx / ldy floats apart.
 * Returns 3 when the activation scratch cannot be allocated. */
int refstack_gemm_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t N, float *y,
                       int64_t ldy, int nthreads) {
    if (M < 0 || K <= 0 || N <= 0 || ldx < K || ldy < N || nthreads < 1) return 1;
    if (M == 0) return 0;
    const int64_t K2 = (K + 1) / 2, nb = (N + NB - 1) / NB, mt = (M + MR_MAX - 1) / MR_MAX;
    uint16_t *xb = malloc((size_t)(M * 2 * K2) * sizeof *xb);
    if (!xb) return 3;
    rows_to_pairs(x, M, K, ldx, xb, nthreads);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < nb * mt; t++) {
        const int64_t b = t / mt, m0 = (t % mt) * MR_MAX;
        const int mr = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
        const int n_valid = (int)(N - b * NB < NB ? N - b * NB : NB);
        tile_rows_bf16(mr, xb + m0 * 2 * K2, K2, wp + b * K2 * 2 * NB, K2, y + m0 * ldy + b * NB, ldy, n_valid, STORE);
    }
    free(xb);
    return 0;
}

/* refstack_moe_experts with bf16 weights: gate|up packed [E][I/16][D2][32][2] (block j =
 * gate cols 16j.. | up cols 16j..), down [E][ceil(D/NB)][I/2][NB][2].  The rows and
 * silu(gate) * up are rounded to bf16 before their GEMMs; h is fp32 scratch [rows, I]. */
int refstack_moe_experts_bf16(const float *x, const int64_t *offsets, int64_t E, int64_t D, int64_t I,
                              const uint16_t *gate_up, const uint16_t *down, float *h, float *y, int nthreads) {
    MARK_SPAN();
    if (E <= 0 || E > 4096 || D <= 0 || I <= 0 || I % HALF != 0 || nthreads < 1) return 1;
    int64_t task_start[E + 1], task_start2[E + 1];
    const int64_t nb1 = I / HALF, nb2 = (D + NB - 1) / NB, D2 = (D + 1) / 2, I2 = I / 2;
    if (expert_tasks(offsets, E, nb1, nb2, task_start, task_start2)) return 1;
    const int64_t M = offsets[E];
    if (M == 0) return 0;
    uint16_t *xb = malloc((size_t)(M * 2 * (D2 > I2 ? D2 : I2)) * sizeof *xb);
    if (!xb) return 3;
    rows_to_pairs(x, M, D, D, xb, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < task_start[E]; t++) {
            int64_t e, m0, b;
            const int mr = locate(t, task_start, E, offsets, &e, &m0, &b);
            const uint16_t *w = gate_up + ((e * nb1 + b) * D2) * 2 * NB;
            tile_rows_bf16(mr, xb + m0 * 2 * D2, D2, w, D2, h + m0 * I + b * HALF, I, HALF, SILU_MUL);
        }
        /* implicit barrier: h is complete; xb is reused for bf16(h) */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) to_bf16(h + r * I, I, xb + r * I);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < task_start2[E]; t++) {
            int64_t e, m0, b;
            const int mr = locate(t, task_start2, E, offsets, &e, &m0, &b);
            const int n_valid = (int)(D - b * NB < NB ? D - b * NB : NB);
            const uint16_t *w = down + ((e * nb2 + b) * I2) * 2 * NB;
            tile_rows_bf16(mr, xb + m0 * I, I2, w, I2, y + m0 * D + b * NB, D, n_valid, STORE);
        }
    }
    free(xb);
    return 0;
}
