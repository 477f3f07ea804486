/* W8A8 GEMMs for refstack's `quantization=w8a8` (SmoothQuant-style, see refstack.model.quant and
 * docs/quantization.md): int8 weights with one fp32 scale per output column, activations quantised
 * to int8 per row (per token) inside the call, int32 accumulation, then fp32 out:
 *
 *     y[m, n] = (float)(sum_k xq[m, k] * wq[k, n]) * (sx[m] * sw[n])
 *
 * with xq = rint((x * inv_s) * (1 / sx)) clamped to [-127, 127], sx = max_k |x * inv_s| / 127 per row,
 * and inv_s the SmoothQuant factors 1/s when they are not folded into a preceding norm.
 *
 * Why: a decode step streams every weight once and at batch 32 is also bound by the
 * multiply rate.  int8 halves the bf16 weight bytes again, and one `vpdpbusd` does 64
 * multiply-adds (16 lanes x 4 byte pairs) where `vdpbf16ps` does 32.
 *
 * The instruction multiplies UNSIGNED bytes by SIGNED bytes.  Activations are signed, so the
 * kernel feeds xq + 128 (in 1..255) as the unsigned operand and removes the offset exactly:
 *     sum_k (xq + 128) * wq = sum_k xq * wq + 128 * sum_k wq[k, n]
 * where 128 * sum_k wq[k, n] is a per-column constant computed when the weight is packed
 * (`corr`).  Everything is integer arithmetic, so the result is exact; the portable path
 * sums xq * wq directly, in int32, and gives the same integers, hence the same floats
 * (the dequantising epilogue is one shared function).  `vpdpbssd` (AVX-VNNI-INT8, signed x
 * signed) would need no offset, but this build targets AVX512-VNNI, which lacks it.
 * Exactness needs |sum| < 2^31: K <= 65536 is checked (255 * 128 * 65536 = 2^31 - 2^23).
 *
 * Packed weights are self-describing ("tagged"): a 64-byte header, then the sections
 *     int8  [ceil(N/NB)][K4][NB][4]   K4 = ceil(K/4): column j of k-quad p holds wq[4p..4p+3][j]
 *     fp32  [ceil(N/NB) * NB]         per-column weight scales sw (zero past N)
 *     int32 [ceil(N/NB) * NB]         corr = 128 * column sums
 *     fp32  [K]                       inv_s (absent, offset 0, when folded into a norm)
 * A tagged pack may also hold an fp32 or bf16 pack (`format` 0 / 1): the W8A8 KDA layer keeps
 * its low-rank up-projection in higher precision, and its decode block (one `kind` for all
 * three of its weights, see gemm_any in cpu_common.h) reaches it through the same header.
 *
 * Like the fp32 and bf16 kernels, every output element is one sum in a fixed order inside one
 * tile, and a row's quantisation depends on that row only: a row's result never depends on
 * the other rows of the call (batch invariance). */
#include <stdlib.h>

#include "cpu_common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

#define PACK_MAGIC 0x38575352 /* "RSW8" little-endian */
#define FORMAT_FP32 0
#define FORMAT_BF16 1
#define FORMAT_W8A8 2
#define MAX_K 65536

typedef struct {
    int32_t magic, format;
    int64_t K, N;
    int64_t off_w, off_scale, off_corr, off_inv_s; /* byte offsets from the header; inv_s 0: none */
    int64_t total;                                 /* bytes of the whole pack (header included) */
} pack_header;

_Static_assert(sizeof(pack_header) <= 64, "the header fits its 64 bytes");

/* 1 when this build runs the int8 tiles on AVX512-VNNI's vpdpbusd (else the portable path). */
int refstack_int8_dot_native(void) { return HAVE_VNNI; }

/* Force the portable path (tests compare the two paths bit for bit; benchmarks may time
 * it).  Returns the previous setting.  Not for use while another thread runs a kernel. */
static int force_portable = 0;
int refstack_int8_force_portable(int on) {
    const int was = force_portable;
    force_portable = on != 0;
    return was;
}

int refstack_pack_header_bytes(void) { return 64; }

static int header_ok(const pack_header *h, int64_t K, int64_t N) {
    return h->magic == PACK_MAGIC && h->K == K && h->N == N && h->total > 0;
}

/* ---------------------------------------------------------------- activations
 * Row r of x (times inv_s when given) -> xq (+128, as unsigned bytes) and its scale:
 *     sx = max |x * inv_s| / 127,  xq = clamp(rint((x * inv_s) * (1 / sx)), -127, 127)
 * (a multiply by the fp32 reciprocal, not a divide per element: quantize_rows in
 * refstack.model.quant computes the same, bit for bit).  K4 * 4 - K padding bytes are 128
 * (a zero activation); the weights are zero there. */
static inline float row_amax(const float *x, int64_t K, const float *inv_s) {
    /* The max of |v| as the max of v's bits with the sign cleared: non-negative floats
     * order as their bits do, and an integer max reduction vectorises without -ffast-math
     * (a float one does not).  A NaN's bits exceed every number's: the row's scale is NaN
     * and its codes zero, as torch's amax makes it in quantize_rows. */
    uint32_t m = 0;
    if (inv_s) {
        for (int64_t k = 0; k < K; k++) {
            const float v = x[k] * inv_s[k];
            uint32_t b;
            memcpy(&b, &v, sizeof b);
            b &= 0x7fffffffu;
            m = b > m ? b : m;
        }
    } else {
        for (int64_t k = 0; k < K; k++) {
            uint32_t b;
            memcpy(&b, x + k, sizeof b);
            b &= 0x7fffffffu;
            m = b > m ? b : m;
        }
    }
    float amax;
    memcpy(&amax, &m, sizeof amax);
    return amax;
}

static inline uint8_t code(float v) {
    float t = __builtin_rintf(v); /* round half to even, as torch.round */
    t = t < -127.0f ? -127.0f : (t > 127.0f ? 127.0f : t);
    return (uint8_t)((int)t + 128);
}

#if HAVE_VNNI
/* The same two passes, 16 floats per instruction: the max as an unsigned max of the bits with the
 * sign cleared (as row_amax), and the codes by the same multiplies in the same order, rounded to
 * nearest even (vrndscaleps, as rintf in the default rounding mode) and clamped.  Same bits as the
 * scalar loops; a batch-32 decode step runs ~30 of these row passes, each ~10% of its GEMM's time
 * on the scalar loops (which GCC does not vectorise: the uint32 max through memcpy, rintf). */
static inline void quantize_row_avx512(const float *x, int64_t K, const float *inv_s, uint8_t *q, int64_t K4,
                                       float *scale) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    __m512i mv = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 v = _mm512_loadu_ps(x + k);
        if (inv_s) v = _mm512_mul_ps(v, _mm512_loadu_ps(inv_s + k));
        mv = _mm512_max_epu32(mv, _mm512_and_si512(_mm512_castps_si512(v), abs_mask));
    }
    uint32_t m = (uint32_t)_mm512_reduce_max_epu32(mv);
    for (; k < K; k++) {
        const float v = inv_s ? x[k] * inv_s[k] : x[k];
        uint32_t b;
        memcpy(&b, &v, sizeof b);
        b &= 0x7fffffffu;
        m = b > m ? b : m;
    }
    float amax;
    memcpy(&amax, &m, sizeof amax);
    const float s = amax / 127.0f;
    *scale = s;
    if (!(s > 0.0f)) {
        memset(q, 128, (size_t)(K4 * 4));
        return;
    }
    const float r = 1.0f / s;
    const __m512 rv = _mm512_set1_ps(r), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i off = _mm512_set1_epi32(128);
    for (k = 0; k + 16 <= K; k += 16) {
        __m512 v = _mm512_loadu_ps(x + k);
        if (inv_s) v = _mm512_mul_ps(v, _mm512_loadu_ps(inv_s + k));
        v = _mm512_roundscale_ps(_mm512_mul_ps(v, rv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        const __m512i c = _mm512_add_epi32(_mm512_cvtps_epi32(v), off);
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(c));
    }
    if (inv_s)
        for (; k < K; k++) q[k] = code((x[k] * inv_s[k]) * r);
    else
        for (; k < K; k++) q[k] = code(x[k] * r);
    for (; k < K4 * 4; k++) q[k] = 128;
}
#endif

static void quantize_row(const float *x, int64_t K, const float *inv_s, uint8_t *q, int64_t K4, float *scale) {
#if HAVE_VNNI
    if (!force_portable) {
        quantize_row_avx512(x, K, inv_s, q, K4, scale);
        return;
    }
#endif
    const float s = row_amax(x, K, inv_s) / 127.0f;
    *scale = s;
    if (!(s > 0.0f)) { /* an all-zero row (or NaN): all-zero codes */
        memset(q, 128, (size_t)(K4 * 4));
        return;
    }
    const float r = 1.0f / s;
    int64_t k = 0;
    if (inv_s)
        for (; k < K; k++) q[k] = code((x[k] * inv_s[k]) * r);
    else
        for (; k < K; k++) q[k] = code(x[k] * r);
    for (; k < K4 * 4; k++) q[k] = 128;
}

/* ---------------------------------------------------------------- tiles
 * One MR x NB tile of int32 sums: acc[r][j] = sum_k (q[r][k] - 128) * w[k][j]. */
static inline __attribute__((always_inline)) void tile_i8_portable(const int mr, const uint8_t *q, int64_t ldq,
                                                                   const int8_t *w, int64_t K4, int32_t acc[][NB]) {
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = 0;
    for (int64_t p = 0; p < K4; p++) {
        const int8_t *wp = w + p * 4 * NB;
        for (int r = 0; r < mr; r++) {
            const uint8_t *xr = q + r * ldq + 4 * p;
            const int32_t x0 = (int32_t)xr[0] - 128, x1 = (int32_t)xr[1] - 128;
            const int32_t x2 = (int32_t)xr[2] - 128, x3 = (int32_t)xr[3] - 128;
            for (int j = 0; j < NB; j++)
                acc[r][j] += x0 * wp[4 * j] + x1 * wp[4 * j + 1] + x2 * wp[4 * j + 2] + x3 * wp[4 * j + 3];
        }
    }
}

#if HAVE_VNNI
/* Accumulators, weights and the broadcast are int32 x 16 vectors of GCC's vector extension,
 * cast for the intrinsic: held as __m512i (8 x int64) arrays, GCC copied every accumulator
 * twice per k-quad (34 extra moves per 16 vpdpbusd: 4.3 of the instruction's 8 per ns on
 * this box, against 8.0 this way, hot, one thread). */
typedef int32_t v16i __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) void tile_i8_vnni(const int mr, const uint8_t *q, int64_t ldq,
                                                               const int8_t *w, int64_t K4, const int32_t *corr,
                                                               int32_t acc[][NB]) {
    v16i c0[MR_MAX], c1[MR_MAX];
    for (int r = 0; r < mr; r++) c0[r] = c1[r] = (v16i){0};
    for (int64_t p = 0; p < K4; p++) {
        v16i w0, w1;
        memcpy(&w0, w + p * 4 * NB, sizeof w0);
        memcpy(&w1, w + p * 4 * NB + 4 * HALF, sizeof w1);
        for (int r = 0; r < mr; r++) {
            int32_t quad;
            memcpy(&quad, q + r * ldq + 4 * p, sizeof quad);
            const v16i xv = (v16i){0} + quad; /* a broadcast */
            /* unsigned activation bytes x signed weight bytes, 4 per lane, into int32 */
            c0[r] = (v16i)_mm512_dpbusd_epi32((__m512i)c0[r], (__m512i)xv, (__m512i)w0);
            c1[r] = (v16i)_mm512_dpbusd_epi32((__m512i)c1[r], (__m512i)xv, (__m512i)w1);
        }
    }
    /* Remove the +128 offset: wrapping int32 arithmetic (vector ops wrap), exact whenever
     * the true sum fits. */
    v16i k0, k1;
    memcpy(&k0, corr, sizeof k0);
    memcpy(&k1, corr + HALF, sizeof k1);
    for (int r = 0; r < mr; r++) {
        const v16i a0 = c0[r] - k0, a1 = c1[r] - k1;
        memcpy(acc[r], &a0, sizeof a0);
        memcpy(acc[r] + HALF, &a1, sizeof a1);
    }
}
#endif

static inline __attribute__((always_inline)) void tile_i8(const int mr, const uint8_t *q, int64_t ldq,
                                                          const int8_t *w, int64_t K4, const int32_t *corr,
                                                          int32_t acc[][NB]) {
#if HAVE_VNNI
    if (!force_portable) {
        tile_i8_vnni(mr, q, ldq, w, K4, corr, acc);
        return;
    }
#endif
    (void)corr;
    tile_i8_portable(mr, q, ldq, w, K4, acc);
}

/* Dequantise a tile and hand it to the shared epilogue (STORE or SILU_MUL). */
static inline __attribute__((always_inline)) void tile_w8a8(const int mr, const uint8_t *q, int64_t ldq, const float *sx,
                                                            const int8_t *w, int64_t K4, const float *sw,
                                                            const int32_t *corr, float *y, int64_t ldy, int n_valid,
                                                            int epi) {
    int32_t acc[MR_MAX][NB];
    tile_i8(mr, q, ldq, w, K4, corr, acc);
    v16 a0[MR_MAX], a1[MR_MAX];
    for (int r = 0; r < mr; r++) {
        float f[NB];
        for (int j = 0; j < NB; j++) f[j] = (float)acc[r][j] * (sx[r] * sw[j]);
        a0[r] = load16(f);
        a1[r] = load16(f + HALF);
    }
    tile_out(mr, a0, a1, y, ldy, n_valid, epi);
}

static void tile_rows_w8a8(int mr, const uint8_t *q, int64_t ldq, const float *sx, const int8_t *w, int64_t K4,
                           const float *sw, const int32_t *corr, float *y, int64_t ldy, int n_valid, int epi) {
    switch (mr) {
        case 1: tile_w8a8(1, q, ldq, sx, w, K4, sw, corr, y, ldy, n_valid, epi); break;
        case 2: tile_w8a8(2, q, ldq, sx, w, K4, sw, corr, y, ldy, n_valid, epi); break;
        case 3: tile_w8a8(3, q, ldq, sx, w, K4, sw, corr, y, ldy, n_valid, epi); break;
        case 4: tile_w8a8(4, q, ldq, sx, w, K4, sw, corr, y, ldy, n_valid, epi); break;
        case 5: tile_w8a8(5, q, ldq, sx, w, K4, sw, corr, y, ldy, n_valid, epi); break;
        case 6: tile_w8a8(6, q, ldq, sx, w, K4, sw, corr, y, ldy, n_valid, epi); break;
        case 7: tile_w8a8(7, q, ldq, sx, w, K4, sw, corr, y, ldy, n_valid, epi); break;
        default: tile_w8a8(8, q, ldq, sx, w, K4, sw, corr, y, ldy, n_valid, epi); break;
    }
}

/* The sections of a W8A8 pack. */
typedef struct {
    const int8_t *w;
    const float *sw, *inv_s;
    const int32_t *corr;
    int64_t K4;
} w8a8_view;

/* A W8A8 pack's sections, its header already checked (view_of). */
static w8a8_view view_at(const void *pack) {
    const pack_header *h = (const pack_header *)pack;
    const char *base = (const char *)pack;
    w8a8_view v;
    v.w = (const int8_t *)(base + h->off_w);
    v.sw = (const float *)(base + h->off_scale);
    v.corr = (const int32_t *)(base + h->off_corr);
    v.inv_s = h->off_inv_s ? (const float *)(base + h->off_inv_s) : NULL;
    v.K4 = (h->K + 3) / 4;
    return v;
}

static int view_of(const void *pack, int64_t K, int64_t N, w8a8_view *v) {
    const pack_header *h = (const pack_header *)pack;
    if (!header_ok(h, K, N) || h->format != FORMAT_W8A8 || K > MAX_K) return 1;
    *v = view_at(pack);
    return 0;
}

/* ---------------------------------------------------------------- GEMM
 * y[M, N] = W8A8(x[M, K]) for a tagged W8A8 pack; rows ldx / ldy floats apart.
 * Returns 1 on a bad argument or header, 3 when the activation scratch cannot be allocated. */
int refstack_gemm_w8a8(const float *x, int64_t M, int64_t K, int64_t ldx, const void *pack, int64_t N, float *y,
                       int64_t ldy, int nthreads) {
    if (M < 0 || K <= 0 || N <= 0 || ldx < K || ldy < N || nthreads < 1) return 1;
    w8a8_view v;
    if (view_of(pack, K, N, &v)) return 1;
    if (M == 0) return 0;
    const int64_t K4 = v.K4, ldq = 4 * K4, nb = (N + NB - 1) / NB, mt = (M + MR_MAX - 1) / MR_MAX;
    uint8_t *q = malloc((size_t)(M * ldq) + (size_t)M * sizeof(float));
    if (!q) return 3;
    float *sx = (float *)(q + M * ldq); /* M * ldq is a multiple of 4: aligned for floats */
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) quantize_row(x + r * ldx, K, v.inv_s, q + r * ldq, K4, sx + r);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < nb * mt; t++) {
            const int64_t b = t / mt, m0 = (t % mt) * MR_MAX;
            const int mr = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
            const int n_valid = (int)(N - b * NB < NB ? N - b * NB : NB);
            tile_rows_w8a8(mr, q + m0 * ldq, ldq, sx + m0, v.w + b * K4 * 4 * NB, K4, v.sw + b * NB, v.corr + b * NB,
                           y + m0 * ldy + b * NB, ldy, n_valid, STORE);
        }
    }
    free(q);
    return 0;
}

/* Any tagged pack: W8A8, or an fp32 / bf16 pack behind a header (gemm_any's kind 2). */
int refstack_gemm_tagged(const float *x, int64_t M, int64_t K, int64_t ldx, const void *pack, int64_t N, float *y,
                         int64_t ldy, int nthreads) {
    const pack_header *h = (const pack_header *)pack;
    if (!pack || !header_ok(h, K, N)) return 1;
    const void *payload = (const char *)pack + h->off_w;
    switch (h->format) {
        case FORMAT_W8A8: return refstack_gemm_w8a8(x, M, K, ldx, pack, N, y, ldy, nthreads);
        case FORMAT_BF16: return refstack_gemm_bf16(x, M, K, ldx, (const uint16_t *)payload, N, y, ldy, nthreads);
        case FORMAT_FP32: return refstack_gemm(x, M, K, ldx, (const float *)payload, N, y, ldy, nthreads);
        default: return 1;
    }
}

/* The int32 products alone, for tests: c[M, N] = a[M, K] @ W (a int8, any of -128..127; W the
 * pack's int8 weights), through the same tiles as the GEMM. */
int refstack_int8_mm(const int8_t *a, int64_t M, int64_t K, const void *pack, int64_t N, int32_t *c, int nthreads) {
    if (M < 0 || K <= 0 || N <= 0 || nthreads < 1) return 1;
    w8a8_view v;
    if (view_of(pack, K, N, &v)) return 1;
    if (M == 0) return 0;
    const int64_t K4 = v.K4, ldq = 4 * K4, nb = (N + NB - 1) / NB, mt = (M + MR_MAX - 1) / MR_MAX;
    uint8_t *q = malloc((size_t)(M * ldq));
    if (!q) return 3;
    for (int64_t r = 0; r < M; r++) {
        for (int64_t k = 0; k < K; k++) q[r * ldq + k] = (uint8_t)((int)a[r * K + k] + 128);
        for (int64_t k = K; k < ldq; k++) q[r * ldq + k] = 128;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < nb * mt; t++) {
        const int64_t b = t / mt, m0 = (t % mt) * MR_MAX;
        const int mr = (int)(M - m0 < MR_MAX ? M - m0 : MR_MAX);
        const int n_valid = (int)(N - b * NB < NB ? N - b * NB : NB);
        int32_t acc[MR_MAX][NB];
        tile_i8(mr, q + m0 * ldq, ldq, v.w + b * K4 * 4 * NB, K4, v.corr + b * NB, acc);
        for (int r = 0; r < mr; r++) memcpy(c + (m0 + r) * N + b * NB, acc[r], (size_t)n_valid * sizeof(int32_t));
    }
    free(q);
    return 0;
}

/* Row quantisation alone, for tests: codes (signed, -127..127) and scales of x[M, K]. */
int refstack_int8_quantize(const float *x, int64_t M, int64_t K, const float *inv_s, int8_t *codes, float *scales) {
    if (M < 0 || K <= 0) return 1;
    const int64_t K4 = (K + 3) / 4;
    uint8_t *q = malloc((size_t)(4 * K4));
    if (!q) return 3;
    for (int64_t r = 0; r < M; r++) {
        quantize_row(x + r * K, K, inv_s, q, K4, scales + r);
        for (int64_t k = 0; k < K; k++) codes[r * K + k] = (int8_t)((int)q[k] - 128);
    }
    free(q);
    return 0;
}

/* ---------------------------------------------------------------- experts
 * refstack_moe_experts with W8A8 experts: `gate_up` is E tagged packs back to back (each
 * K = D, N = 2I, columns in pack_gate_up's order: block j = gate cols 16j.. | up cols 16j..),
 * `down` E tagged packs (K = I, N = D).  Each expert's rows are quantised with that expert's
 * inv_s (when its pack has one); silu(gate) * up (fp32, in h) is quantised per row again
 * before the down projection. */
int refstack_moe_experts_w8a8(const float *x, const int64_t *offsets, int64_t E, int64_t D, int64_t I,
                              const void *gate_up, const void *down, float *h, float *y, int nthreads) {
    MARK_SPAN();
    if (E <= 0 || E > 4096 || D <= 0 || I <= 0 || I % HALF != 0 || nthreads < 1) return 1;
    const pack_header *h1 = (const pack_header *)gate_up, *h2 = (const pack_header *)down;
    if (!header_ok(h1, D, 2 * I) || !header_ok(h2, I, D)) return 1;
    const int64_t stride1 = h1->total, stride2 = h2->total;
    int64_t task_start[E + 1], task_start2[E + 1];
    const int64_t nb1 = I / HALF, nb2 = (D + NB - 1) / NB;
    if (expert_tasks(offsets, E, nb1, nb2, task_start, task_start2)) return 1;
    /* Every expert's headers, checked once (the views are rebuilt per task from these). */
    for (int64_t e = 0; e < E; e++) {
        w8a8_view v;
        if (view_of((const char *)gate_up + e * stride1, D, 2 * I, &v) || view_of((const char *)down + e * stride2, I, D, &v))
            return 1;
    }
    const int64_t M = offsets[E];
    if (M == 0) return 0;
    const int64_t D4 = (D + 3) / 4, I4 = (I + 3) / 4, ldq = 4 * (D4 > I4 ? D4 : I4);
    uint8_t *q = malloc((size_t)(M * ldq) + (size_t)M * sizeof(float));
    if (!q) return 3;
    float *sx = (float *)(q + M * ldq);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            int64_t e = 0;
            while (e + 1 < E && offsets[e + 1] <= r) e++;
            const w8a8_view v = view_at((const char *)gate_up + e * stride1);
            quantize_row(x + r * D, D, v.inv_s, q + r * ldq, D4, sx + r);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < task_start[E]; t++) {
            int64_t e, m0, b;
            const int mr = locate(t, task_start, E, offsets, &e, &m0, &b);
            const w8a8_view v = view_at((const char *)gate_up + e * stride1);
            tile_rows_w8a8(mr, q + m0 * ldq, ldq, sx + m0, v.w + b * D4 * 4 * NB, D4, v.sw + b * NB, v.corr + b * NB,
                           h + m0 * I + b * HALF, I, HALF, SILU_MUL);
        }
        /* implicit barrier: h is complete; q is reused for its codes */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            int64_t e = 0;
            while (e + 1 < E && offsets[e + 1] <= r) e++;
            const w8a8_view v = view_at((const char *)down + e * stride2);
            quantize_row(h + r * I, I, v.inv_s, q + r * ldq, I4, sx + r);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < task_start2[E]; t++) {
            int64_t e, m0, b;
            const int mr = locate(t, task_start2, E, offsets, &e, &m0, &b);
            const int n_valid = (int)(D - b * NB < NB ? D - b * NB : NB);
            const w8a8_view v = view_at((const char *)down + e * stride2);
            tile_rows_w8a8(mr, q + m0 * ldq, ldq, sx + m0, v.w + b * I4 * 4 * NB, I4, v.sw + b * NB, v.corr + b * NB,
                           y + m0 * D + b * NB, D, n_valid, STORE);
        }
    }
    free(q);
    return 0;
}
