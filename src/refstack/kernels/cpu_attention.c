/* GQA decode attention: one query token per sequence against its slot of the KV cache
 * [slots, Hkv, max_len, D].  First k_new / v_new are written at position pos[b]; then
 * each query head of the group attends over positions 0..pos[b] with an online softmax,
 * a block of KEY_BLOCK keys at a time (one rescale of the accumulator per block).
 * Sequences attend only to their own length: no padding, no mask.
 *
 * The cache may hold fp32, bf16, fp8 e4m3 (e4m3fn: no infinities, 448 the largest
 * finite value) or int8 (kv_type KV_F32 .. KV_I8, see refstack.model.cache).  The new
 * rows are encoded as torch's path encodes them (x / scale, rounded to nearest even,
 * saturated), so both paths store the same bytes; a block of stored keys / values is
 * widened to fp32 before the block's dot products, and the per-(layer, head) scales
 * are folded in: K's into the score scale, V's into the output.
 *
 * Scores: a key's dot product with a query is 16-lane partial sums (D/16 FMAs), and the
 * block's 16 partial vectors are folded into one vector of 16 scores by 15 two-vector
 * shuffle-adds, instead of a horizontal reduction per key.  The per-key reduction was
 * most of this kernel's time.  Head dims of 16, 32, 64 and 128 are compiled as constants
 * (query and accumulator in registers); other head dims take a scalar path. */
#include "cpu_common.h"

#define KEY_BLOCK 16

/* Two vectors of 2h-lane segments (one key each) into one of h-lane segments: segment s
 * of x goes to lanes h*s.., of y to 8 + h*s..; each new lane sums two old ones.
 * GCC's shuffle takes an index vector, clang's a list of constants. */
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define LO2 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define HI2 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define LO1 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define HI1 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#if defined(__clang__)
#define SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
typedef int32_t i16v __attribute__((vector_size(64)));
#define SHUFFLE(x, y, ...) __builtin_shuffle(x, y, (i16v){__VA_ARGS__})
#endif
#define FOLD(x, y, lo, hi) (SHUFFLE(x, y, lo) + SHUFFLE(x, y, hi))

/* out[i] = sum of part[i]'s 16 lanes, i < 16. */
static inline v16 lane_sums(const v16 *part) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = FOLD(part[2 * i], part[2 * i + 1], LO8, HI8);
    for (int i = 0; i < 4; i++) b[i] = FOLD(a[2 * i], a[2 * i + 1], LO4, HI4);
    for (int i = 0; i < 2; i++) c[i] = FOLD(b[2 * i], b[2 * i + 1], LO2, HI2);
    return FOLD(c[0], c[1], LO1, HI1);
}

enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2, KV_I8 = 3 };

static const int64_t kv_elem_bytes[4] = {4, 2, 1, 1};
/* An e4m3fn byte as a float, branch-free so the widening loop vectorises (a table lookup
 * made fp8 attention 6x slower than fp32): a normal's exponent and mantissa bits go under
 * a float's, rebiased from 7 to 127 by an integer add; a subnormal is m * 2^-9.  (No
 * float subnormal is ever formed: their arithmetic is slow on x86.)  The NaN codes
 * (0x7f, 0xff) read as +-480: the writer saturates, so they are never stored. */
static inline float f32_of_e4m3(uint8_t c) {
    const uint32_t em = c & 0x7fu, sign = (uint32_t)(c & 0x80u) << 24;
    const uint32_t normal = sign | ((em << 20) + (120u << 23));
    const float sub = (float)em * 0x1p-9f;
    uint32_t subnormal;
    memcpy(&subnormal, &sub, sizeof subnormal);
    const uint32_t is_normal = 0u - (uint32_t)(em >= 8); /* all ones or zero: a select without a branch */
    const uint32_t u = (normal & is_normal) | ((subnormal | sign) & ~is_normal);
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline uint16_t bf16_of(float x) { /* round to nearest even (torch's cast) */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_of_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline uint8_t e4m3_of(float x) { /* to nearest even, saturated at +-448 */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const float a = fabsf(x);
    if (a != a) return sign | 0x7f;
    if (!(a <= 448.0f)) return sign | 0x7e;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f); /* subnormals, steps of 2^-9; 8 is 2^-6's code */
    uint32_t b;
    memcpy(&b, &a, sizeof b);
    b += 0x7ffffu + ((b >> 20) & 1u); /* 23 mantissa bits to 3 */
    const int e = (int)(b >> 23) - 127; /* -6 .. 8 */
    return sign | (uint8_t)(((e + 7) << 3) | ((b >> 20) & 7u));
}

static inline int8_t i8_of(float x) {
    const float r = nearbyintf(x); /* to nearest even, as torch.round */
    return (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
}

/* n floats of src into a cache row of type kvt at element offset off (x / s for the
 * scaled types; bf16 is a plain cast). */
static void kv_encode(int kvt, const float *src, int64_t n, float s, void *dst, int64_t off) {
    int64_t i;
    switch (kvt) {
        case KV_BF16: for (i = 0; i < n; i++) ((uint16_t *)dst)[off + i] = bf16_of(src[i]); break;
        case KV_FP8: for (i = 0; i < n; i++) ((uint8_t *)dst)[off + i] = e4m3_of(src[i] / s); break;
        case KV_I8: for (i = 0; i < n; i++) ((int8_t *)dst)[off + i] = i8_of(src[i] / s); break;
        default: memcpy((float *)dst + off, src, (size_t)n * sizeof(float)); break;
    }
}

/* n stored elements from element offset off as floats (unscaled). */
static inline void kv_widen(int kvt, const void *src, int64_t off, int64_t n, float *dst) {
    int64_t i;
    switch (kvt) {
        case KV_BF16: for (i = 0; i < n; i++) dst[i] = f32_of_bf16(((const uint16_t *)src)[off + i]); break;
        case KV_FP8: for (i = 0; i < n; i++) dst[i] = f32_of_e4m3(((const uint8_t *)src)[off + i]); break;
        case KV_I8: for (i = 0; i < n; i++) dst[i] = (float)((const int8_t *)src)[off + i]; break;
        default: memcpy(dst, (const float *)src + off, (size_t)n * sizeof(float)); break;
    }
}

static inline float kv_at(int kvt, const void *src, int64_t i) {
    switch (kvt) {
        case KV_BF16: return f32_of_bf16(((const uint16_t *)src)[i]);
        case KV_FP8: return f32_of_e4m3(((const uint8_t *)src)[i]);
        case KV_I8: return (float)((const int8_t *)src)[i];
        default: return ((const float *)src)[i];
    }
}

/* One query head over n_keys fp32 keys / values [n_keys, D], continuing an online softmax
 * (running max *m, denominator *denom, accumulator acc), KEY_BLOCK keys at a time.  D is
 * a compile-time constant here (see attend_any), so the query, the accumulator and a
 * block's partial scores live in registers. */
static inline __attribute__((always_inline)) void attend_rows(const int D, const float *qh, const float *kc,
                                                              const float *vc, int64_t n_keys, float scale, v16 *acc,
                                                              float *m_io, float *denom_io) {
    v16 qv[D / HALF];
    for (int c = 0; c < D / HALF; c++) qv[c] = load16(qh + c * HALF);
    float m = *m_io, denom = *denom_io;
    for (int64_t l0 = 0; l0 < n_keys; l0 += KEY_BLOCK) {
        const int64_t n = n_keys - l0 < KEY_BLOCK ? n_keys - l0 : KEY_BLOCK;
        v16 part[KEY_BLOCK];
        for (int64_t i = 0; i < KEY_BLOCK; i++) {
            part[i] = (v16){0};
            if (i < n)
                for (int c = 0; c < D / HALF; c++) part[i] += qv[c] * load16(kc + (l0 + i) * D + c * HALF);
        }
        float s[KEY_BLOCK];
        store16(s, lane_sums(part) * scale);
        float bm = -INFINITY;
        for (int64_t i = 0; i < n; i++) bm = s[i] > bm ? s[i] : bm;
        const float m_new = bm > m ? bm : m;
        const float rescale = exp_approx(m - m_new); /* ~0 on the first block: m = -inf */
        for (int64_t i = 0; i < KEY_BLOCK; i++) s[i] = exp_approx(s[i] - m_new); /* lanes >= n unused */
        denom *= rescale;
        for (int c = 0; c < D / HALF; c++) acc[c] *= rescale;
        for (int64_t i = 0; i < n; i++) {
            denom += s[i];
            for (int c = 0; c < D / HALF; c++) acc[c] += s[i] * load16(vc + (l0 + i) * D + c * HALF);
        }
        m = m_new;
    }
    *m_io = m;
    *denom_io = denom;
}

/* One query head over an fp32 cache's keys / values [L, D]. */
static inline __attribute__((always_inline)) void attend(const int D, const float *qh, const float *kc, const float *vc,
                                                         int64_t L, float scale, float *oh) {
    v16 acc[D / HALF];
    for (int c = 0; c < D / HALF; c++) acc[c] = (v16){0};
    float m = -INFINITY, denom = 0.0f;
    attend_rows(D, qh, kc, vc, L, scale, acc, &m, &denom);
    for (int c = 0; c < D / HALF; c++) store16(oh + c * HALF, acc[c] / denom);
}

/* Any other head dim: the same online softmax, one dot product per key, stored elements
 * read one at a time (kv_at); `scale` includes K's dequantization scale, vscale is V's. */
static void attend_scalar(int64_t D, const float *qh, const void *kc, const void *vc, int kvt, int64_t L, float scale,
                          float vscale, float *oh) {
    float acc[D], s[KEY_BLOCK];
    float m = -INFINITY, denom = 0.0f;
    for (int64_t j = 0; j < D; j++) acc[j] = 0.0f;
    for (int64_t l0 = 0; l0 < L; l0 += KEY_BLOCK) {
        const int64_t n = L - l0 < KEY_BLOCK ? L - l0 : KEY_BLOCK;
        float bm = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            float dotp = 0.0f;
            for (int64_t d = 0; d < D; d++) dotp += qh[d] * kv_at(kvt, kc, (l0 + i) * D + d);
            s[i] = dotp * scale;
            bm = s[i] > bm ? s[i] : bm;
        }
        const float m_new = bm > m ? bm : m;
        const float rescale = exp_approx(m - m_new);
        denom *= rescale;
        for (int64_t j = 0; j < D; j++) acc[j] *= rescale;
        for (int64_t i = 0; i < n; i++) {
            const float p = exp_approx(s[i] - m_new);
            denom += p;
            for (int64_t j = 0; j < D; j++) acc[j] += p * kv_at(kvt, vc, (l0 + i) * D + j);
        }
        m = m_new;
    }
    for (int64_t j = 0; j < D; j++) oh[j] = kvt == KV_F32 ? acc[j] / denom : acc[j] / denom * vscale;
}

static void attend_any(int64_t D, const float *qh, const float *kc, const float *vc, int64_t L, float scale, float *oh) {
    switch (D) {
        case 16: attend(16, qh, kc, vc, L, scale, oh); break;
        case 32: attend(32, qh, kc, vc, L, scale, oh); break;
        case 64: attend(64, qh, kc, vc, L, scale, oh); break;
        case 128: attend(128, qh, kc, vc, L, scale, oh); break;
        default: attend_scalar(D, qh, kc, vc, KV_F32, L, scale, 1.0f, oh); break;
    }
}

/* The `group` query heads of one KV head over keys / values [L, D] stored as kvt (not
 * fp32): WIDEN_KEYS keys and values at a time are widened to fp32 once, into buffers that
 * stay in L1 / L2, and every query head of the group continues its online softmax over
 * them (attend_rows, the fp32 path's arithmetic on the widened values).  `scale` includes
 * K's dequantization scale; V's multiplies the outputs. */
#define WIDEN_KEYS 64 /* a multiple of KEY_BLOCK: the blocks fall where the fp32 path's do */
static inline __attribute__((always_inline)) void attend_group_widened(const int D, const float *q, int64_t group,
                                                                       const void *kc, const void *vc, int kvt,
                                                                       int64_t L, float scale, float vscale,
                                                                       float *out) {
    float kb[WIDEN_KEYS * D], vb[WIDEN_KEYS * D];
    v16 acc[group][D / HALF];
    float m[group], denom[group];
    for (int64_t g = 0; g < group; g++) {
        for (int c = 0; c < D / HALF; c++) acc[g][c] = (v16){0};
        m[g] = -INFINITY;
        denom[g] = 0.0f;
    }
    for (int64_t l0 = 0; l0 < L; l0 += WIDEN_KEYS) {
        const int64_t n = L - l0 < WIDEN_KEYS ? L - l0 : WIDEN_KEYS;
        kv_widen(kvt, kc, l0 * D, n * D, kb);
        kv_widen(kvt, vc, l0 * D, n * D, vb);
        for (int64_t g = 0; g < group; g++) attend_rows(D, q + g * D, kb, vb, n, scale, acc[g], &m[g], &denom[g]);
    }
    for (int64_t g = 0; g < group; g++)
        for (int c = 0; c < D / HALF; c++) store16(out + g * D + c * HALF, acc[g][c] / denom[g] * vscale);
}

static void attend_group_any(int64_t D, const float *q, int64_t group, const void *kc, const void *vc, int kvt,
                             int64_t L, float scale, float vscale, float *out) {
    switch (D) {
        case 16: attend_group_widened(16, q, group, kc, vc, kvt, L, scale, vscale, out); break;
        case 32: attend_group_widened(32, q, group, kc, vc, kvt, L, scale, vscale, out); break;
        case 64: attend_group_widened(64, q, group, kc, vc, kvt, L, scale, vscale, out); break;
        case 128: attend_group_widened(128, q, group, kc, vc, kvt, L, scale, vscale, out); break;
        default:
            for (int64_t g = 0; g < group; g++) attend_scalar(D, q + g * D, kc, vc, kvt, L, scale, vscale, out + g * D);
            break;
    }
}

/* refstack_gqa_decode over a cache stored as kv_type; k_scale / v_scale [Hkv] (stored
 * value * scale = the value) for KV_FP8 and KV_I8, ignored (may be null) otherwise. */
int refstack_gqa_decode_kv(const float *q, const float *k_new, const float *v_new, void *keys, void *values, int kv_type,
                           const float *k_scale, const float *v_scale, const int64_t *slots, const int64_t *pos, int64_t B,
                           int64_t n_slots, int64_t Hkv, int64_t group, int64_t max_len, int64_t D, float scale, float *out,
                           int nthreads) {
    if (B < 0 || n_slots <= 0 || Hkv <= 0 || group <= 0 || max_len <= 0 || D <= 0 || D > 1024 || nthreads < 1) return 1;
    if (kv_type < KV_F32 || kv_type > KV_I8 || ((kv_type == KV_FP8 || kv_type == KV_I8) && (!k_scale || !v_scale)))
        return 1;
    if (B == 0) return 0; /* (pos may then be a null pointer) */
    for (int64_t b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= max_len || slots[b] < 0 || slots[b] >= n_slots) return 2;
    const int scaled = kv_type == KV_FP8 || kv_type == KV_I8;
    const int64_t esz = kv_elem_bytes[kv_type];
#pragma omp parallel for schedule(static) num_threads(nthreads) if (B * Hkv * group * (pos[0] + 1) * D >= PAR_MIN_FLOATS)
    for (int64_t bh = 0; bh < B * Hkv; bh++) {
        const int64_t b = bh / Hkv, h = bh % Hkv;
        const int64_t row0 = (slots[b] * Hkv + h) * max_len * D; /* this (slot, head)'s first element */
        char *kc = (char *)keys + row0 * esz, *vc = (char *)values + row0 * esz;
        const float ks = scaled ? k_scale[h] : 1.0f, vs = scaled ? v_scale[h] : 1.0f;
        kv_encode(kv_type, k_new + bh * D, D, ks, kc, pos[b] * D);
        kv_encode(kv_type, v_new + bh * D, D, vs, vc, pos[b] * D);
        if (kv_type == KV_F32)
            for (int64_t g = 0; g < group; g++)
                attend_any(D, q + (bh * group + g) * D, (const float *)kc, (const float *)vc, pos[b] + 1, scale,
                           out + (bh * group + g) * D);
        else
            attend_group_any(D, q + bh * group * D, group, kc, vc, kv_type, pos[b] + 1, scale * ks, vs,
                             out + bh * group * D);
    }
    return 0;
}

int refstack_gqa_decode(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                        const int64_t *slots, const int64_t *pos, int64_t B, int64_t n_slots, int64_t Hkv, int64_t group,
                        int64_t max_len, int64_t D, float scale, float *out, int nthreads) {
    return refstack_gqa_decode_kv(q, k_new, v_new, keys, values, KV_F32, NULL, NULL, slots, pos, B, n_slots, Hkv, group,
                                  max_len, D, scale, out, nthreads);
}

/* ---------------------------------------------------------------- RoPE
 * y[t, h] = x[t, h] rotated to position pos[t] (rotate-half convention: x = [x1, x2] ->
 * [x1 cos - x2 sin, x2 cos + x1 sin]) for `heads` heads of hd floats at the start of
 * each row of x (rows ldx floats apart); y is [T, heads, hd].  cos / sin tables are
 * [rope_len][hd / 2].  One function for the module path and the decode block, so both
 * round alike. */
int refstack_rope(const float *x, int64_t T, int64_t ldx, int64_t heads, int64_t hd, const float *cos_t,
                  const float *sin_t, int64_t rope_len, const int64_t *pos, float *y) {
    if (T < 0 || heads <= 0 || hd <= 0 || hd % 2 || ldx < heads * hd) return 1;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= rope_len) return 2;
    const int64_t half = hd / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + pos[t] * half, *s = sin_t + pos[t] * half;
        for (int64_t head = 0; head < heads; head++) {
            const float *xh = x + t * ldx + head * hd;
            float *yh = y + (t * heads + head) * hd;
            for (int64_t i = 0; i < half; i++) {
                yh[i] = xh[i] * c[i] - xh[half + i] * s[i];
                yh[half + i] = xh[half + i] * c[i] + xh[i] * s[i];
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- attention decode block
 * A full-attention layer's decode step for B tokens in one call (AttentionLayer with one
 * token per sequence):  qkv = h @ qkv_w;  q, k = RoPE(q, k) at pos[b] (rotate-half, cos /
 * sin tables [rope_len][hd/2]);  o = gqa_decode(q, k, v);  out = o @ o_w.
 * qkv_w / o_w are packed fp32, or bf16 when `bf16` is set; the cache is stored as
 * kv_type with its scales (see refstack_gqa_decode_kv).
 * `scratch` holds B * (2 * (Hq + 2 Hkv) * hd + Hq * hd) floats. */
int refstack_attn_decode_block_kv(const float *h, int64_t B, int64_t Dm, const void *qkv_w, const void *o_w, int bf16,
                                  int64_t Hq, int64_t Hkv, int64_t hd, const float *cos_t, const float *sin_t,
                                  int64_t rope_len, void *keys, void *values, int kv_type, const float *k_scale,
                                  const float *v_scale, const int64_t *slots, const int64_t *pos, int64_t n_slots,
                                  int64_t max_len, float scale, float *out, float *scratch, int nthreads) {
    MARK_SPAN();
    if (B <= 0 || Dm <= 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || hd <= 0 || hd % 2 || nthreads < 1) return 1;
    for (int64_t b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= max_len || pos[b] >= rope_len || slots[b] < 0 || slots[b] >= n_slots) return 2;
    const int64_t n_qkv = (Hq + 2 * Hkv) * hd;
    float *qkv = scratch, *qk = qkv + B * n_qkv, *v = qk + B * (Hq + Hkv) * hd, *o = v + B * Hkv * hd;
    int rc = gemm_any(bf16, h, B, Dm, Dm, qkv_w, n_qkv, qkv, n_qkv, nthreads);
    /* q heads, then k heads: adjacent in qkv, rotated in one pass */
    rc = rc ? rc : refstack_rope(qkv, B, n_qkv, Hq + Hkv, hd, cos_t, sin_t, rope_len, pos, qk);
    if (rc) return rc;
    for (int64_t b = 0; b < B; b++)
        memcpy(v + b * Hkv * hd, qkv + b * n_qkv + (Hq + Hkv) * hd, (size_t)(Hkv * hd) * sizeof(float));
    /* q [B, Hq, hd] and k [B, Hkv, hd] are interleaved per token in qk: split them out. */
    float *q = o, *k = qkv; /* (qkv is free again: reuse it for k) */
    for (int64_t b = 0; b < B; b++) {
        memcpy(q + b * Hq * hd, qk + b * (Hq + Hkv) * hd, (size_t)(Hq * hd) * sizeof(float));
        memcpy(k + b * Hkv * hd, qk + (b * (Hq + Hkv) + Hq) * hd, (size_t)(Hkv * hd) * sizeof(float));
    }
    float *att = qk; /* [B, Hq, hd]: qk is free after the split */
    rc = refstack_gqa_decode_kv(q, k, v, keys, values, kv_type, k_scale, v_scale, slots, pos, B, n_slots, Hkv, Hq / Hkv,
                                max_len, hd, scale, att, nthreads);
    return rc ? rc : gemm_any(bf16, att, B, Hq * hd, Hq * hd, o_w, Dm, out, Dm, nthreads);
}

int refstack_attn_decode_block(const float *h, int64_t B, int64_t Dm, const void *qkv_w, const void *o_w, int bf16,
                               int64_t Hq, int64_t Hkv, int64_t hd, const float *cos_t, const float *sin_t,
                               int64_t rope_len, float *keys, float *values, const int64_t *slots, const int64_t *pos,
                               int64_t n_slots, int64_t max_len, float scale, float *out, float *scratch, int nthreads) {
    return refstack_attn_decode_block_kv(h, B, Dm, qkv_w, o_w, bf16, Hq, Hkv, hd, cos_t, sin_t, rope_len, keys, values,
                                         KV_F32, NULL, NULL, slots, pos, n_slots, max_len, scale, out, scratch, nthreads);
}
