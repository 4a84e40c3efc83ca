/* One-token decode steps on a CPU core: a stage's layers and the head in one call each.
 *
 * Why C: a SmolLM2 decode step is ~35 tiny ops a layer; through torch each costs ~5-10 us of dispatch,
 * more than its arithmetic. Here a layer is one loop nest and the products read 4- or 8-bit blocks.
 *
 * Products follow GGUF's legacy blocks: 32 weights w = d * u + m (u unsigned: Q4_1's nibbles; Q4_0 is
 * m = -8d; Q8_0 is stored u = q + 128 with m = -128d). The input row is quantized to 8 bits per 32 (scale
 * dx, as llama.cpp does), so a block's dot product is exact in integers:
 *     sum_i w_i x_i ~= d * dx * sum_i u_i xq_i + m * (dx * sum_i xq_i).
 * Rows are interleaved 16 at a time so one AVX-512 register holds 16 rows' bytes for 4 consecutive weights
 * and VPDPBUSD adds 16 rows' 4-products at once: no horizontal sums, the 16 scales are one load. AVX2 takes
 * each group as two 8-row halves (32 bytes each of a (block, p)'s 64) and has no VPDPBUSD: see matmul_tile.
 *
 * Layout of a matrix (rows padded to G = ceil(rows / 16) groups, J = cols / 32 blocks a row):
 *   4-bit: q[((g * J + j) * 4 + p) * 64 + r * 4 + t], low nibble u[16g + r][32j + 4p + t],
 *          high nibble u[16g + r][32j + 16 + 4p + t]   (GGUF's qs byte 4p + t of that row, as stored)
 *   8-bit: q[((g * J + j) * 8 + p) * 64 + r * 4 + t] = u[16g + r][32j + 4p + t]
 *   d, m:  IEEE half, [(g * J + j) * 16 + r]
 * Three builds, by what -march=native offers: AVX-512 F/BW/VNNI (SIMD 1), AVX2 + FMA + F16C (SIMD 2), else
 * plain C (SIMD 0). Each runs a row's product with the same float operations in the same order (the integer
 * dots are exact whatever their order), so the products are the same bits in all three; attention, SiLU and
 * the norms differ in their last bits (vector sums and exp; libm's expf in the plain build).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SIMD 2
#else
#define SIMD 0
#endif

typedef struct {
    const uint8_t *q;
    const uint16_t *d, *m;
    int32_t bits, rows, cols, pad_;
} mat_t;

typedef struct {
    mat_t wq, wk, wv, wo, wg, wu, wd;
    const float *attn_norm, *mlp_norm;
    const float *bq, *bk, *bv;  /* NULL without q/k/v biases */
    void *k_cache, *v_cache;    /* (n_kv, max_len, hd): float32, bfloat16 or e4m3 (kv_bits 32, 16, 8) */
} layer_t;

typedef struct {
    int32_t dim, n_heads, n_kv, hd, ffn, max_len, n_layers, kv_bits;
    float eps;
    int32_t pad_;
    const layer_t *layers;
    float *work; /* strata_work_floats(model) floats */
} model_t;

int strata_simd(void) { return SIMD; } /* 1 AVX-512 VNNI, 2 AVX2, 0 plain C */

static inline float half_to_float(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, f = h & 0x3FF, u;
    if (e == 0) {
        if (f == 0) {
            u = s;
        } else { /* subnormal: normalize */
            e = 113;
            while (!(f & 0x400)) { f <<= 1; e--; }
            u = s | (e << 23) | ((f & 0x3FF) << 13);
        }
    } else if (e == 31) {
        u = s | 0x7F800000 | (f << 13);
    } else {
        u = s | ((e + 112) << 23) | (f << 13);
    }
    float out;
    memcpy(&out, &u, 4);
    return out;
}

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float out;
    memcpy(&out, &u, 4);
    return out;
}

static inline uint16_t float_to_bf16(float x) { /* round to nearest even, as torch's cast */
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* ---- the input row in 8 bits per 32 ------------------------------------------------------------- */

/* x (n, a multiple of 32) -> xq, and per block dx (its scale) and sx = dx * sum(xq) */
#if SIMD == 2
/* the loop below 8 lanes at a time, to the same bits: the same maximum and division, products rounded to nearest
 * even as lrintf does, exact integer sums (its fmaxf and lrintf are calls at -O2: a tenth of a batched step) */
static void quantize_row(const float *x, int n, int8_t *xq, float *dx, float *sx) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    for (int j = 0; j < n / 32; j++) {
        const float *xb = x + 32 * j;
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xb + 8 * k);
        __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                                  _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(id))), hi), lo);
        __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        int sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
        /* packs work within 128-bit lanes: bytes come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] | q0[4:8] ...; the
         * permute puts the 4-byte pieces back in order */
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + 32 * j), b);
        dx[j] = d;
        sx[j] = d * (float)sum;
    }
}
#else
static void quantize_row(const float *x, int n, int8_t *xq, float *dx, float *sx) {
    for (int j = 0; j < n / 32; j++) {
        const float *xb = x + 32 * j;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int q = (int)lrintf(xb[i] * id);
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            xq[32 * j + i] = (int8_t)q;
            sum += q;
        }
        dx[j] = d;
        sx[j] = d * (float)sum;
    }
}
#endif

/* ---- products --------------------------------------------------------------------------------- */

#if SIMD == 1
static void matvec(const mat_t *W, const int8_t *xq, const float *dx, const float *sx, float *y) {
    const int J = W->cols / 32, G = (W->rows + 15) / 16, bytes = W->bits == 4 ? 256 : 512;
    const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    for (int g = 0; g < G; g++) {
        const uint8_t *q = W->q + (size_t)g * J * bytes;
        const uint16_t *d = W->d + (size_t)g * J * 16, *m = W->m + (size_t)g * J * 16;
        __m512 acc = _mm512_setzero_ps();
        for (int j = 0; j < J; j++, q += bytes) {
            const int32_t *xb = (const int32_t *)(xq + 32 * j);
            __m512i a0, a1, a2, a3;
            if (W->bits == 4) {
                __m512i v0 = _mm512_loadu_si512(q), v1 = _mm512_loadu_si512(q + 64);
                __m512i v2 = _mm512_loadu_si512(q + 128), v3 = _mm512_loadu_si512(q + 192);
                a0 = _mm512_dpbusd_epi32(zero, _mm512_and_si512(v0, low), _mm512_set1_epi32(xb[0]));
                a1 = _mm512_dpbusd_epi32(zero, _mm512_and_si512(v1, low), _mm512_set1_epi32(xb[1]));
                a2 = _mm512_dpbusd_epi32(zero, _mm512_and_si512(v2, low), _mm512_set1_epi32(xb[2]));
                a3 = _mm512_dpbusd_epi32(zero, _mm512_and_si512(v3, low), _mm512_set1_epi32(xb[3]));
                a0 = _mm512_dpbusd_epi32(a0, _mm512_and_si512(_mm512_srli_epi16(v0, 4), low), _mm512_set1_epi32(xb[4]));
                a1 = _mm512_dpbusd_epi32(a1, _mm512_and_si512(_mm512_srli_epi16(v1, 4), low), _mm512_set1_epi32(xb[5]));
                a2 = _mm512_dpbusd_epi32(a2, _mm512_and_si512(_mm512_srli_epi16(v2, 4), low), _mm512_set1_epi32(xb[6]));
                a3 = _mm512_dpbusd_epi32(a3, _mm512_and_si512(_mm512_srli_epi16(v3, 4), low), _mm512_set1_epi32(xb[7]));
            } else {
                a0 = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512(q), _mm512_set1_epi32(xb[0]));
                a1 = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512(q + 64), _mm512_set1_epi32(xb[1]));
                a2 = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512(q + 128), _mm512_set1_epi32(xb[2]));
                a3 = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512(q + 192), _mm512_set1_epi32(xb[3]));
                a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(q + 256), _mm512_set1_epi32(xb[4]));
                a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(q + 320), _mm512_set1_epi32(xb[5]));
                a2 = _mm512_dpbusd_epi32(a2, _mm512_loadu_si512(q + 384), _mm512_set1_epi32(xb[6]));
                a3 = _mm512_dpbusd_epi32(a3, _mm512_loadu_si512(q + 448), _mm512_set1_epi32(xb[7]));
            }
            __m512i s = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
            __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 16 * j)));
            __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + 16 * j)));
            acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[j])), _mm512_cvtepi32_ps(s), acc);
            acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[j]), acc);
        }
        int left = W->rows - 16 * g;
        _mm512_mask_storeu_ps(y + 16 * g, left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1), acc);
    }
}
#elif SIMD == 0
static void matvec(const mat_t *W, const int8_t *xq, const float *dx, const float *sx, float *y) {
    const int J = W->cols / 32, G = (W->rows + 15) / 16, bytes = W->bits == 4 ? 256 : 512;
    for (int g = 0; g < G; g++) {
        for (int r = 0; r < 16 && 16 * g + r < W->rows; r++) {
            const uint8_t *q = W->q + (size_t)g * J * bytes;
            const uint16_t *d = W->d + (size_t)g * J * 16, *m = W->m + (size_t)g * J * 16;
            float acc = 0.f;
            for (int j = 0; j < J; j++, q += bytes) {
                const int8_t *xb = xq + 32 * j;
                int32_t a[4] = {0, 0, 0, 0};
                for (int p = 0; p < 8; p++)
                    for (int t = 0; t < 4; t++) {
                        int u, k;
                        if (W->bits == 4) {
                            uint8_t b = q[(p & 3) * 64 + r * 4 + t];
                            u = p < 4 ? (b & 15) : (b >> 4);
                            k = p < 4 ? 4 * p + t : 16 + 4 * (p - 4) + t;
                        } else {
                            u = q[p * 64 + r * 4 + t];
                            k = 4 * p + t;
                        }
                        a[p & 3] += u * xb[k];
                    }
                int32_t s = (a[0] + a[1]) + (a[2] + a[3]);
                float dw = half_to_float(d[16 * j + r]), mw = half_to_float(m[16 * j + r]);
                acc = fmaf(dw * dx[j], (float)s, acc);
                acc = fmaf(mw, sx[j], acc);
            }
            y[16 * g + r] = acc;
        }
    }
}
#endif

/* Y = W X for m rows of x (several sequences' decode steps at once): row t's input at xq + t * xs (bytes),
 * dx + t * ss, sx + t * ss; its output at y + t * ys. Each row's float operations are matvec's, in its
 * order (the integer dots are exact whatever their order), so a row's result is the same bits whatever
 * else is in the batch. What batching saves: a group's bytes are read from memory once for every row
 * and unpacked once for each tile of rows. */
#if SIMD == 1
static inline __attribute__((always_inline)) void matmul_tile(const mat_t *W, const int bits, const int g,
                                                             const int T, const int8_t *xq, const int xs,
                                                             const float *dx, const float *sx, const int ss,
                                                             float *y, const int ys) {
    const int J = W->cols / 32, bytes = bits == 4 ? 256 : 512;
    const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const uint8_t *q = W->q + (size_t)g * J * bytes;
    const uint16_t *d = W->d + (size_t)g * J * 16, *m = W->m + (size_t)g * J * 16;
    __m512 acc[4];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int j = 0; j < J; j++, q += bytes) {
        __m512i w[8];
        if (bits == 4) {
            for (int p = 0; p < 4; p++) {
                __m512i v = _mm512_loadu_si512(q + 64 * p);
                w[p] = _mm512_and_si512(v, low);
                w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            for (int p = 0; p < 8; p++) w[p] = _mm512_loadu_si512(q + 64 * p);
        }
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 16 * j)));
        __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + 16 * j)));
        for (int t = 0; t < T; t++) {
            const int32_t *xb = (const int32_t *)(xq + (size_t)t * xs + 32 * j);
            __m512i a0 = _mm512_dpbusd_epi32(zero, w[0], _mm512_set1_epi32(xb[0]));
            __m512i a1 = _mm512_dpbusd_epi32(zero, w[1], _mm512_set1_epi32(xb[1]));
            __m512i a2 = _mm512_dpbusd_epi32(zero, w[2], _mm512_set1_epi32(xb[2]));
            __m512i a3 = _mm512_dpbusd_epi32(zero, w[3], _mm512_set1_epi32(xb[3]));
            a0 = _mm512_dpbusd_epi32(a0, w[4], _mm512_set1_epi32(xb[4]));
            a1 = _mm512_dpbusd_epi32(a1, w[5], _mm512_set1_epi32(xb[5]));
            a2 = _mm512_dpbusd_epi32(a2, w[6], _mm512_set1_epi32(xb[6]));
            a3 = _mm512_dpbusd_epi32(a3, w[7], _mm512_set1_epi32(xb[7]));
            __m512i s = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[(size_t)t * ss + j])), _mm512_cvtepi32_ps(s),
                                     acc[t]);
            acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[(size_t)t * ss + j]), acc[t]);
        }
    }
    int left = W->rows - 16 * g;
    __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(y + (size_t)t * ys + 16 * g, k, acc[t]);
}
#elif SIMD == 2
/* AVX2 has no VPDPBUSD. VPMADDUBSW multiplies unsigned by signed bytes and adds adjacent products into int16,
 * saturating; VPMADDWD by ones then adds those pairs into int32. A 4-bit pair is at most 2 * 15 * 127 = 3,810,
 * so each int16 lane adds a block's 8 of them (<= 30,480) before one widening. An 8-bit pair would saturate
 * (2 * 255 * 127): each byte is split into its nibbles, s = sum(lo x) + 16 sum(hi x), each sum exact as a 4-bit
 * block's. The group's two 8-row halves go one after the other (both halves' accumulators would not fit the
 * 16 registers); the second reads the group's bytes from L1. */
#define UNROLL _Pragma("GCC unroll 8") /* constant loops into registers: at -O2 GCC keeps them as loops over stack arrays */
static inline __attribute__((always_inline)) void matmul_tile(const mat_t *W, const int bits, const int g,
                                                             const int T, const int8_t *xq, const int xs,
                                                             const float *dx, const float *sx, const int ss,
                                                             float *y, const int ys) {
    const int J = W->cols / 32, bytes = bits == 4 ? 256 : 512, G = (W->rows + 15) / 16;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        const int left = W->rows - 16 * g - 8 * h;
        if (left <= 0) break; /* a half of padding rows */
        const uint8_t *q = W->q + (size_t)g * J * bytes + 32 * h;
        const uint16_t *d = W->d + (size_t)g * J * 16 + 8 * h, *m = W->m + (size_t)g * J * 16 + 8 * h;
        __m256 acc[4];
        UNROLL for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
        for (int j = 0; j < J; j++, q += bytes) {
            __m256i s[4], a[4], b[4];
            if (h == 0 && g + 1 < G) { /* the next group's block: its bytes stream in while this group computes */
                UNROLL for (int k = 0; k < bytes; k += 64) _mm_prefetch((const char *)(q + (size_t)J * bytes + k), _MM_HINT_T0);
                _mm_prefetch((const char *)(d + (size_t)J * 16 + 16 * j), _MM_HINT_T0);
                _mm_prefetch((const char *)(m + (size_t)J * 16 + 16 * j), _MM_HINT_T0);
            }
            if (bits == 4) { /* the block's 8 nibble vectors unpacked once, then each row's sum as a tree */
                __m256i w[8];
                UNROLL for (int p = 0; p < 4; p++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * p));
                    w[p] = _mm256_and_si256(v, low);
                    w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                UNROLL for (int t = 0; t < T; t++) {
                    const int32_t *xb = (const int32_t *)(xq + (size_t)t * xs + 32 * j);
                    __m256i e0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xb[0])),
                                                  _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(xb[1])));
                    __m256i e1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], _mm256_set1_epi32(xb[2])),
                                                  _mm256_maddubs_epi16(w[3], _mm256_set1_epi32(xb[3])));
                    __m256i e2 = _mm256_add_epi16(_mm256_maddubs_epi16(w[4], _mm256_set1_epi32(xb[4])),
                                                  _mm256_maddubs_epi16(w[5], _mm256_set1_epi32(xb[5])));
                    __m256i e3 = _mm256_add_epi16(_mm256_maddubs_epi16(w[6], _mm256_set1_epi32(xb[6])),
                                                  _mm256_maddubs_epi16(w[7], _mm256_set1_epi32(xb[7])));
                    s[t] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(e0, e1), _mm256_add_epi16(e2, e3)),
                                             _mm256_set1_epi16(1));
                }
            } else {
                UNROLL for (int p = 0; p < 8; p++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * p));
                    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    UNROLL for (int t = 0; t < T; t++) {
                        __m256i x = _mm256_set1_epi32(((const int32_t *)(xq + (size_t)t * xs + 32 * j))[p]);
                        __m256i e = _mm256_maddubs_epi16(lo, x), f = _mm256_maddubs_epi16(hi, x);
                        a[t] = p ? _mm256_add_epi16(a[t], e) : e;
                        b[t] = p ? _mm256_add_epi16(b[t], f) : f;
                    }
                }
                UNROLL for (int t = 0; t < T; t++)
                    s[t] = _mm256_add_epi32(_mm256_madd_epi16(a[t], _mm256_set1_epi16(1)),
                                            _mm256_madd_epi16(b[t], _mm256_set1_epi16(16)));
            }
            __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 16 * j)));
            __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + 16 * j)));
            UNROLL for (int t = 0; t < T; t++) {
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx[(size_t)t * ss + j])),
                                         _mm256_cvtepi32_ps(s[t]), acc[t]);
                acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[(size_t)t * ss + j]), acc[t]);
            }
        }
        float *yh = y + 16 * g + 8 * h;
        if (left >= 8) {
            UNROLL for (int t = 0; t < T; t++) _mm256_storeu_ps(yh + (size_t)t * ys, acc[t]);
        } else {
            __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            UNROLL for (int t = 0; t < T; t++) _mm256_maskstore_ps(yh + (size_t)t * ys, k, acc[t]);
        }
    }
}
#undef UNROLL
#endif

#if SIMD
static inline __attribute__((always_inline)) void matmul_bits(const mat_t *W, const int bits, int m,
                                                             const int8_t *xq, int xs, const float *dx,
                                                             const float *sx, int ss, float *y, int ys) {
    const int G = (W->rows + 15) / 16;
#define AT(n) matmul_tile(W, bits, g, n, xq + (size_t)t * xs, xs, dx + (size_t)t * ss, sx + (size_t)t * ss, ss, \
                          y + (size_t)t * ys, ys)
    for (int g = 0; g < G; g++) {
        int t = 0;
        for (; t + 4 <= m; t += 4) AT(4);
        switch (m - t) { /* the compiler specializes each constant tile */
            case 3: AT(3); break;
            case 2: AT(2); break;
            case 1: AT(1); break;
            default: break;
        }
    }
#undef AT
}

static void matmul(const mat_t *W, int m, const int8_t *xq, int xs, const float *dx, const float *sx, int ss,
                   float *y, int ys) {
    if (W->bits == 4) matmul_bits(W, 4, m, xq, xs, dx, sx, ss, y, ys);
    else matmul_bits(W, 8, m, xq, xs, dx, sx, ss, y, ys);
}
#else
static void matmul(const mat_t *W, int m, const int8_t *xq, int xs, const float *dx, const float *sx, int ss,
                   float *y, int ys) {
    for (int t = 0; t < m; t++)
        matvec(W, xq + (size_t)t * xs, dx + (size_t)t * ss, sx + (size_t)t * ss, y + (size_t)t * ys);
}
#endif

#if SIMD == 2
static void matvec(const mat_t *W, const int8_t *xq, const float *dx, const float *sx, float *y) {
    matmul(W, 1, xq, 0, dx, sx, 0, y, 0);
}
#endif

/* ---- elementwise -------------------------------------------------------------------------------- */

#if SIMD == 1
/* e^x for x <= 0 (softmax) or any x (SiLU, clamped): n = round(x log2 e), r = x - n ln 2 in two parts,
 * e^r by its Taylor series to r^7 (|r| <= 0.35: relative error < 1e-7), times 2^n */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#elif SIMD == 2
/* exp_ps's arithmetic in 8 lanes; 2^n built in the exponent field (n in [-126, 127] after the clamp) */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
#endif

/* y = x / rms(x) * w (n a multiple of 16 in the AVX-512 build, of 32 in AVX2's) */
static void rms_norm(const float *x, const float *w, int n, float eps, float *y) {
    float ss = 0.f;
    int i = 0;
#if SIMD == 1
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        a = _mm512_fmadd_ps(v, v, a);
    }
    ss = _mm512_reduce_add_ps(a);
#elif SIMD == 2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0; /* four sums: an FMA's latency hidden */
    for (int i = 0; i < n; i += 32) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
        a2 = _mm256_fmadd_ps(v2, v2, a2);
        a3 = _mm256_fmadd_ps(v3, v3, a3);
    }
    ss = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
#endif
    float r = 1.f / sqrtf(ss / (float)n + eps);
#if SIMD == 2
    for (; i + 8 <= n; i += 8) /* x * r * w as the loop below: (x * r) * w */
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(r)),
                                              _mm256_loadu_ps(w + i)));
#endif
    for (; i < n; i++) y[i] = x[i] * r * w[i];
}

/* silu(gate) * up in place of gate */
static void silu_mul(float *g, const float *u, int n) {
    int i = 0;
#if SIMD == 1
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(g + i);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v));
        __m512 s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
#elif SIMD == 2
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(g + i);
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), v));
        __m256 s = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* rotate-half RoPE of one head: x * cos + roll(x, hd / 2) * ssin (ssin: sin with its first half negated) */
static void rope(float *x, const float *cos, const float *ssin, int hd) {
    float t[512];
    int half = hd / 2;
    for (int i = 0; i < half; i++) t[i] = x[i] * cos[i] + x[i + half] * ssin[i]; /* (no % in the loop) */
    for (int i = half; i < hd; i++) t[i] = x[i] * cos[i] + x[i - half] * ssin[i];
    memcpy(x, t, sizeof(float) * hd);
}

/* e4m3 (torch.float8_e4m3fn: bias 7, no infinities, S.1111.111 NaN) as floats, by code: the portable path's
 * reads (the vector path goes through float16 bits, e4m3_load16) */
static float E4M3[256];

__attribute__((constructor)) static void e4m3_table(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float a = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
        E4M3[b] = (b & 0x7F) == 0x7F ? NAN : (b & 0x80 ? -a : a);
    }
}

/* float -> e4m3 as strata.kernels.attention.to_cache stores it: clamped to +-448, then rounded to nearest even */
uint8_t strata_to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint8_t s = (uint8_t)((u >> 24) & 0x80);
    float a = fabsf(x);
    if (a != a) return s | 0x7F;
    if (a >= 448.0f) return s | 0x7E;
    if (a < 0.015625f) return s | (uint8_t)nearbyintf(a * 512.0f); /* subnormal: steps of 2^-9 (8 steps: 2^-6) */
    uint32_t ua = u & 0x7FFFFFFF;
    ua += 0x7FFFF + ((ua >> 20) & 1); /* round the 23-bit mantissa to 3 bits, ties to even */
    return s | (uint8_t)((((int)(ua >> 23) - 120) << 3) | ((ua >> 20) & 7));
}

static inline float kv_at(const void *c, int bits, size_t i) {
    if (bits == 8) return E4M3[((const uint8_t *)c)[i]];
    return bits == 32 ? ((const float *)c)[i] : bf16_to_float(((const uint16_t *)c)[i]);
}

static void kv_put(void *c, int bits, size_t i, const float *x, int n) {
    if (bits == 32)
        memcpy((float *)c + i, x, sizeof(float) * n);
    else if (bits == 8)
        for (int k = 0; k < n; k++) ((uint8_t *)c)[i + k] = strata_to_e4m3(x[k]);
    else {
        int k = 0;
#if SIMD == 2
        for (; k + 8 <= n; k += 8) { /* float_to_bf16 8 lanes at a time */
            __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + k)), top = _mm256_srli_epi32(u, 16);
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                                               _mm256_and_si256(top, _mm256_set1_epi32(1)))), 16);
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
            r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
            r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* the two lanes' 4 words together */
            _mm_storeu_si128((__m128i *)((uint16_t *)c + i + k), _mm256_castsi256_si128(r));
        }
#endif
        for (; k < n; k++) ((uint16_t *)c)[i + k] = float_to_bf16(x[k]);
    }
}

#if SIMD == 1
/* 16 e4m3 values as floats: sign, exponent and mantissa moved 7 places left are the float16 of value / 256
 * (exponent bias 15 against 7, subnormals alike), which VCVTPH2PS widens exactly; then times 256 */
static inline __m512 e4m3_load16(const uint8_t *p) {
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

static inline __m512 kv_load16(const void *c, int bits, size_t i) {
    if (bits == 32) return _mm512_loadu_ps((const float *)c + i);
    if (bits == 8) return e4m3_load16((const uint8_t *)c + i);
    __m256i b = _mm256_loadu_si256((const __m256i *)((const uint16_t *)c + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
#endif

#define TILE 32 /* cached positions per pass: a tile of K or V stays in L1 while each query head of the group reads it */

#if SIMD == 1
/* The 16 lanes of a, b, c, d summed: [sum a, sum b, sum c, sum d] (halves, then quarters, then hadd). */
static inline __m128 sum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
#define Q4(v) _mm_add_ps(_mm256_castps256_ps128(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))), \
                         _mm256_extractf128_ps(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)), 1))
    __m128 qa = Q4(a), qb = Q4(b), qc = Q4(c), qd = Q4(d);
#undef Q4
    return _mm_hadd_ps(_mm_hadd_ps(qa, qb), _mm_hadd_ps(qc, qd));
}

/* s[i] = exp(s[i] - mx) for L scores in place; returns their sum (softmax's denominator) */
static float exp_sum(float *s, int L, float mx) {
    __m512 sum = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
    int i = 0;
    for (; i + 16 <= L; i += 16) {
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmx));
        _mm512_storeu_ps(s + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    float total = _mm512_reduce_add_ps(sum);
    for (; i < L; i++) {
        s[i] = expf(s[i] - mx);
        total += s[i];
    }
    return total;
}

#define UNROLL _Pragma("GCC unroll 8")

/* A cached row at element i as C vectors. A bfloat16 row gives each 32 values as their even-indexed then their
 * odd-indexed ones: the 16 words of a lane pair shifted up, and masked (no shuffle, no widening load); q and
 * the output are put in that order too (perm). A float32 row loads as is. */
static inline __attribute__((always_inline)) void row_load(const void *c, const int bits, size_t i, const int C,
                                                          __m512 *r) {
    if (bits == 32) {
        UNROLL for (int k = 0; k < C; k++) r[k] = _mm512_loadu_ps((const float *)c + i + 16 * k);
    } else if (bits == 8) {
        UNROLL for (int k = 0; k < C; k++) r[k] = e4m3_load16((const uint8_t *)c + i + 16 * k);
    } else {
        UNROLL for (int k = 0; k < C / 2; k++) {
            __m512i w = _mm512_loadu_si512((const uint16_t *)c + i + 32 * k);
            r[2 * k] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            r[2 * k + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000)));
        }
    }
}

/* attend() for G query heads, hd = 16 C and the cache's bits, all compile-time after inlining: each cached row
 * is loaded once for the whole group, scores are summed across lanes four positions at a time, the softmax's
 * maximum is kept while scoring and its normalization is applied to the output. */
static inline __attribute__((always_inline)) void attend_gc(const float *q, const int G, const void *kc,
                                                           const void *vc, const int bits, int L, const int C,
                                                           float *sc, float *out) {
    const int hd = 16 * C;
    const __m512 scale = _mm512_set1_ps(1.f / sqrtf((float)hd));
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512 qv[8][8];
    UNROLL for (int h = 0; h < G; h++) {
        UNROLL for (int k = 0; k < C; k++) qv[h][k] = _mm512_mul_ps(_mm512_loadu_ps(q + h * hd + 16 * k), scale);
        if (bits == 16) {
            UNROLL for (int k = 0; k < C; k += 2) {
                __m512 lo = qv[h][k], hi = qv[h][k + 1];
                qv[h][k] = _mm512_permutex2var_ps(lo, even, hi);
                qv[h][k + 1] = _mm512_permutex2var_ps(lo, odd, hi);
            }
        }
    }
    __m128 mx4[8]; /* each head's running maximum score, 4 lanes */
    UNROLL for (int h = 0; h < G; h++) mx4[h] = _mm_set1_ps(-INFINITY);
    int t = 0;
    for (; t + 4 <= L; t += 4) {
        __m512 a[8][4];
        UNROLL for (int h = 0; h < G; h++) UNROLL for (int j = 0; j < 4; j++) a[h][j] = _mm512_setzero_ps();
        UNROLL for (int j = 0; j < 4; j++) {
            __m512 k[8];
            row_load(kc, bits, (size_t)(t + j) * hd, C, k);
            UNROLL for (int c = 0; c < C; c++) UNROLL for (int h = 0; h < G; h++) a[h][j] = _mm512_fmadd_ps(qv[h][c], k[c], a[h][j]);
        }
        UNROLL for (int h = 0; h < G; h++) {
            __m128 s4 = sum4x16(a[h][0], a[h][1], a[h][2], a[h][3]);
            _mm_storeu_ps(sc + h * L + t, s4);
            mx4[h] = _mm_max_ps(mx4[h], s4);
        }
    }
    for (; t < L; t++) {
        __m512 k[8];
        row_load(kc, bits, (size_t)t * hd, C, k);
        UNROLL for (int h = 0; h < G; h++) {
            __m512 a = _mm512_setzero_ps();
            UNROLL for (int c = 0; c < C; c++) a = _mm512_fmadd_ps(qv[h][c], k[c], a);
            sc[h * L + t] = _mm512_reduce_add_ps(a);
        }
    }
    float inv[8]; /* 1 / each head's sum of exp: applied to its output, not to every weight */
    UNROLL for (int h = 0; h < G; h++) {
        float *s = sc + h * L;
        __m128 m2 = _mm_max_ps(mx4[h], _mm_movehl_ps(mx4[h], mx4[h]));
        float mx = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
        for (int i = L & ~3; i < L; i++) mx = fmaxf(mx, s[i]);
        inv[h] = 1.f / exp_sum(s, L, mx);
    }
    __m512 o[8][8];
    UNROLL for (int h = 0; h < G; h++) UNROLL for (int c = 0; c < C; c++) o[h][c] = _mm512_setzero_ps();
    for (t = 0; t < L; t++) {
        __m512 v[8];
        row_load(vc, bits, (size_t)t * hd, C, v);
        UNROLL for (int h = 0; h < G; h++) {
            __m512 p = _mm512_set1_ps(sc[h * L + t]);
            UNROLL for (int c = 0; c < C; c++) o[h][c] = _mm512_fmadd_ps(p, v[c], o[h][c]);
        }
    }
    const __m512i lo16 = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi16 = _mm512_add_epi32(lo16, _mm512_set1_epi32(8));
    UNROLL for (int h = 0; h < G; h++) {
        const __m512 w = _mm512_set1_ps(inv[h]);
        UNROLL for (int c = 0; c < C; c++) o[h][c] = _mm512_mul_ps(o[h][c], w);
        if (bits == 16) {
            UNROLL for (int c = 0; c < C; c += 2) {
                __m512 e = o[h][c], d = o[h][c + 1];
                o[h][c] = _mm512_permutex2var_ps(e, lo16, d);
                o[h][c + 1] = _mm512_permutex2var_ps(e, hi16, d);
            }
        }
        UNROLL for (int c = 0; c < C; c++) _mm512_storeu_ps(out + h * hd + 16 * c, o[h][c]);
    }
}
#undef UNROLL
#elif SIMD == 2
#define UNROLL _Pragma("GCC unroll 16")

/* 16 cached values from element i as two vectors: float32 and e4m3 in order, bfloat16 as its 8 even-indexed then
 * its 8 odd-indexed values (the 16 words shifted up, and masked: no widening shuffle; attend_gc puts q and the
 * output in that order too). e4m3: e4m3_load16's float16 reading, 8 lanes a conversion, left as value / 256
 * (attend_gc scales q and the output by 256 instead: exact, a power of two). */
static inline __attribute__((always_inline)) void load16(const void *c, const int bits, size_t i, __m256 *r) {
    if (bits == 32) {
        r[0] = _mm256_loadu_ps((const float *)c + i);
        r[1] = _mm256_loadu_ps((const float *)c + i + 8);
    } else if (bits == 8) {
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)c + i)));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
        r[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        r[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else {
        __m256i w = _mm256_loadu_si256((const __m256i *)((const uint16_t *)c + i));
        r[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        r[1] = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000)));
    }
}

/* The 8 lanes of a, b, c, d summed: [sum a, sum b, sum c, sum d] */
static inline __m128 sum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* s[i] = exp(s[i] - mx) for L scores in place; returns their sum (softmax's denominator) */
static float exp_sum(float *s, int L, float mx) {
    __m256 sum = _mm256_setzero_ps(), vmx = _mm256_set1_ps(mx);
    int i = 0;
    for (; i + 8 <= L; i += 8) {
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
        _mm256_storeu_ps(s + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum8(sum);
    for (; i < L; i++) {
        s[i] = expf(s[i] - mx);
        total += s[i];
    }
    return total;
}

/* Where element i of a row lands in load16's order (bfloat16: a 16's even values, then its odd ones) */
static inline int lane_of(const int bits, int i) { return bits == 16 ? (i & ~15) + (i & 1) * 8 + (i & 15) / 2 : i; }

/* attend() for G <= 3 query heads, hd = 16 C and the cache's bits (all constants after inlining for hd 64 and 128):
 * each cached row is loaded once for the group, scores are summed across lanes four positions at a time, and the
 * softmax's maximum is kept while scoring. 16 registers hold the 12 sums and a row's vectors but not q, which is
 * read from L1 (qs: scaled, in the rows' order); the output likewise goes 4 vectors at a time through ob. */
static inline __attribute__((always_inline)) void attend_gc(const float *q, const int G, const void *kc,
                                                           const void *vc, const int bits, const int L,
                                                           const int C, float *sc, float *out) {
    const int hd = 16 * C;
    const float scale = 1.f / sqrtf((float)hd), up = bits == 8 ? 256.f : 1.f; /* (e4m3 rows load / 256) */
    float qs[3 * 256] __attribute__((aligned(32))), ob[3 * 256] __attribute__((aligned(32)));
    for (int h = 0; h < G; h++)
        for (int i = 0; i < hd; i++) qs[h * hd + lane_of(bits, i)] = q[h * hd + i] * scale * up;
    __m128 mx4[3]; /* each head's running maximum score, 4 lanes */
    UNROLL for (int h = 0; h < G; h++) mx4[h] = _mm_set1_ps(-INFINITY);
    const int vrow = hd * bits / 8; /* a V row's bytes */
    int t = 0;
    for (; t + 4 <= L; t += 4) {
        __m256 a[3][4];
        /* K 16 rows ahead, and these positions' V rows: V streams in alongside K, and the output pass below, which
         * reads it a part at a time, finds it in cache (bfloat16 at 1,000 positions: 46 -> 21 us for 3 heads) */
        for (int b = 0; b < 4 * vrow; b += 64) {
            _mm_prefetch((const char *)kc + (size_t)(t + 16) * vrow + b, _MM_HINT_T0);
            _mm_prefetch((const char *)vc + (size_t)t * vrow + b, _MM_HINT_T0);
        }
        UNROLL for (int h = 0; h < G; h++) UNROLL for (int j = 0; j < 4; j++) a[h][j] = _mm256_setzero_ps();
        UNROLL for (int c = 0; c < C; c++) UNROLL for (int j = 0; j < 4; j++) {
            __m256 k[2];
            load16(kc, bits, (size_t)(t + j) * hd + 16 * c, k);
            UNROLL for (int h = 0; h < G; h++) {
                a[h][j] = _mm256_fmadd_ps(_mm256_load_ps(qs + h * hd + 16 * c), k[0], a[h][j]);
                a[h][j] = _mm256_fmadd_ps(_mm256_load_ps(qs + h * hd + 16 * c + 8), k[1], a[h][j]);
            }
        }
        UNROLL for (int h = 0; h < G; h++) {
            __m128 s4 = sum4x8(a[h][0], a[h][1], a[h][2], a[h][3]);
            _mm_storeu_ps(sc + h * L + t, s4);
            mx4[h] = _mm_max_ps(mx4[h], s4);
        }
    }
    for (; t < L; t++) {
        __m256 a[3];
        UNROLL for (int h = 0; h < G; h++) a[h] = _mm256_setzero_ps();
        UNROLL for (int c = 0; c < C; c++) {
            __m256 k[2];
            load16(kc, bits, (size_t)t * hd + 16 * c, k);
            UNROLL for (int h = 0; h < G; h++) {
                a[h] = _mm256_fmadd_ps(_mm256_load_ps(qs + h * hd + 16 * c), k[0], a[h]);
                a[h] = _mm256_fmadd_ps(_mm256_load_ps(qs + h * hd + 16 * c + 8), k[1], a[h]);
            }
        }
        UNROLL for (int h = 0; h < G; h++) sc[h * L + t] = hsum8(a[h]);
    }
    float inv[3]; /* 1 / each head's sum of exp: applied to its output, not to every weight */
    UNROLL for (int h = 0; h < G; h++) {
        float *s = sc + h * L;
        __m128 m2 = _mm_max_ps(mx4[h], _mm_movehl_ps(mx4[h], mx4[h]));
        float mx = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
        for (int i = L & ~3; i < L; i++) mx = fmaxf(mx, s[i]);
        inv[h] = 1.f / exp_sum(s, L, mx);
    }
    /* 32 values of each head's output at a time over all positions (12 sums): a bfloat16 row's 64 bytes there are
     * one cache line, so the passes together read V once */
    for (int c = 0; c < C; c += 2) {
        const int P = C - c < 2 ? 1 : 2; /* 16-value parts this pass */
        __m256 o[3][4];
        UNROLL for (int h = 0; h < G; h++) UNROLL for (int k = 0; k < 4; k++) o[h][k] = _mm256_setzero_ps();
        for (int t = 0; t < L; t++) {
            __m256 v[4];
            load16(vc, bits, (size_t)t * hd + 16 * c, v);
            if (P == 2) load16(vc, bits, (size_t)t * hd + 16 * c + 16, v + 2);
            UNROLL for (int h = 0; h < G; h++) {
                __m256 p = _mm256_broadcast_ss(sc + h * L + t);
                o[h][0] = _mm256_fmadd_ps(p, v[0], o[h][0]);
                o[h][1] = _mm256_fmadd_ps(p, v[1], o[h][1]);
                if (P == 2) {
                    o[h][2] = _mm256_fmadd_ps(p, v[2], o[h][2]);
                    o[h][3] = _mm256_fmadd_ps(p, v[3], o[h][3]);
                }
            }
        }
        UNROLL for (int h = 0; h < G; h++) UNROLL for (int k = 0; k < 2 * P; k++)
            _mm256_store_ps(ob + h * hd + 16 * c + 8 * k, o[h][k]);
    }
    for (int h = 0; h < G; h++)
        for (int i = 0; i < hd; i++) out[h * hd + i] = ob[h * hd + lane_of(bits, i)] * (inv[h] * up);
}
#undef UNROLL
#endif

/* The G query heads q (G x hd) of one kv head against its first L cached rows -> out (G x hd); sc: G * L floats.
 * Tiles of positions outside, heads inside: each cached row comes from memory once for the whole group. */
static void attend(const float *q, int G, const void *kc, const void *vc, int bits, int L, int hd, float *sc,
                   float *out) {
    const float scale = 1.f / sqrtf((float)hd);
#if SIMD == 1
    if (hd == 64 || hd == 128) {
        /* the group in parts of up to 4 heads (hd 64) or 2 (hd 128): more would not fit the registers (at 4,000
         * positions, bfloat16: 12 us a head either way at 64; at 128, 21 us a head in pairs, 28 in fours) */
        const int most = hd == 64 ? 4 : 2;
        for (int h0 = 0; h0 < G; h0 += most) {
            const int g = G - h0 < most ? G - h0 : most;
            const float *qg = q + h0 * hd;
            float *og = out + h0 * hd;
#define GC(n, c) else if (g == n && hd == 16 * c) { \
                if (bits == 16) attend_gc(qg, n, kc, vc, 16, L, c, sc, og); \
                else if (bits == 8) attend_gc(qg, n, kc, vc, 8, L, c, sc, og); \
                else attend_gc(qg, n, kc, vc, 32, L, c, sc, og); }
            if (0) {}
            GC(1, 4) GC(2, 4) GC(3, 4) GC(4, 4) GC(1, 8) GC(2, 8)
#undef GC
        }
        return;
    }
    if (hd % 16 == 0) {
        const int C = hd / 16;
        for (int t0 = 0; t0 < L; t0 += TILE) {
            int t1 = t0 + TILE < L ? t0 + TILE : L;
            for (int h = 0; h < G; h++) {
                const float *qh = q + h * hd;
                for (int t = t0; t < t1; t++) {
                    __m512 a = _mm512_setzero_ps();
                    for (int c = 0; c < C; c++)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kv_load16(kc, bits, (size_t)t * hd + 16 * c), a);
                    sc[h * L + t] = _mm512_reduce_add_ps(a) * scale;
                }
            }
        }
        for (int h = 0; h < G; h++) {
            float *s = sc + h * L, mx;
            __m512 vm = _mm512_set1_ps(-INFINITY);
            int t = 0;
            for (; t + 16 <= L; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + t));
            for (mx = _mm512_reduce_max_ps(vm); t < L; t++) mx = fmaxf(mx, s[t]);
            float inv = 1.f / exp_sum(s, L, mx);
            for (t = 0; t + 16 <= L; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(inv)));
            for (; t < L; t++) s[t] *= inv;
        }
        memset(out, 0, sizeof(float) * G * hd);
        for (int t0 = 0; t0 < L; t0 += TILE) {
            int t1 = t0 + TILE < L ? t0 + TILE : L;
            for (int h = 0; h < G; h++) {
                const float *p = sc + h * L;
                float *o = out + h * hd;
                int c = 0;
                for (; c + 4 <= C; c += 4) { /* four independent sums: an FMA's latency hidden behind the others */
                    __m512 a0 = _mm512_loadu_ps(o + 16 * c), a1 = _mm512_loadu_ps(o + 16 * c + 16);
                    __m512 a2 = _mm512_loadu_ps(o + 16 * c + 32), a3 = _mm512_loadu_ps(o + 16 * c + 48);
                    for (int t = t0; t < t1; t++) {
                        __m512 w = _mm512_set1_ps(p[t]);
                        size_t at = (size_t)t * hd + 16 * c;
                        a0 = _mm512_fmadd_ps(w, kv_load16(vc, bits, at), a0);
                        a1 = _mm512_fmadd_ps(w, kv_load16(vc, bits, at + 16), a1);
                        a2 = _mm512_fmadd_ps(w, kv_load16(vc, bits, at + 32), a2);
                        a3 = _mm512_fmadd_ps(w, kv_load16(vc, bits, at + 48), a3);
                    }
                    _mm512_storeu_ps(o + 16 * c, a0);
                    _mm512_storeu_ps(o + 16 * c + 16, a1);
                    _mm512_storeu_ps(o + 16 * c + 32, a2);
                    _mm512_storeu_ps(o + 16 * c + 48, a3);
                }
                for (; c < C; c++) {
                    __m512 a = _mm512_loadu_ps(o + 16 * c);
                    for (int t = t0; t < t1; t++)
                        a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), kv_load16(vc, bits, (size_t)t * hd + 16 * c), a);
                    _mm512_storeu_ps(o + 16 * c, a);
                }
            }
        }
        return;
    }
#elif SIMD == 2
    if (hd % 16 == 0 && hd <= 256) {
        for (int h0 = 0; h0 < G; h0 += 3) { /* the group in parts of up to 3 heads: 12 sums, 4 positions each */
            const int g = G - h0 < 3 ? G - h0 : 3;
            const float *qg = q + h0 * hd;
            float *og = out + h0 * hd;
#define GC(n, c) else if (g == n && hd == 16 * (c)) { \
                if (bits == 16) attend_gc(qg, n, kc, vc, 16, L, c, sc, og); \
                else if (bits == 8) attend_gc(qg, n, kc, vc, 8, L, c, sc, og); \
                else attend_gc(qg, n, kc, vc, 32, L, c, sc, og); }
            if (0) {}
            GC(1, 4) GC(2, 4) GC(3, 4) GC(1, 8) GC(2, 8) GC(3, 8) /* hd 64 and 128 unrolled */
            GC(1, hd / 16) GC(2, hd / 16) GC(3, hd / 16)
#undef GC
        }
        return;
    }
#endif
    for (int h = 0; h < G; h++) {
        const float *qh = q + h * hd;
        float *s = sc + h * L, *o = out + h * hd, mx = -INFINITY, total = 0.f;
        for (int t = 0; t < L; t++) {
            float a = 0.f;
            for (int i = 0; i < hd; i++) a += qh[i] * kv_at(kc, bits, (size_t)t * hd + i);
            s[t] = a * scale;
            mx = fmaxf(mx, s[t]);
        }
        for (int t = 0; t < L; t++) {
            s[t] = expf(s[t] - mx);
            total += s[t];
        }
        for (int t = 0; t < L; t++) s[t] /= total;
        for (int i = 0; i < hd; i++) o[i] = 0.f;
        for (int t = 0; t < L; t++)
            for (int i = 0; i < hd; i++) o[i] += s[t] * kv_at(vc, bits, (size_t)t * hd + i);
    }
}

/* ---- entry points ------------------------------------------------------------------------------- */

static int max3(int a, int b, int c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* the index of the first largest of v[0:n] (NaNs are never larger, nor is anything larger than a NaN v[0]) */
static int first_max(const float *v, int n) {
#if SIMD == 2
    if (v[0] == v[0]) { /* the largest 8 lanes at a time (MAXPS keeps its second operand against a NaN), then where */
        __m256 m8 = _mm256_set1_ps(v[0]);
        int i = 0;
        for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(v + i), m8);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        for (; i < n; i++) mx = v[i] > mx ? v[i] : mx;
        for (i = 0; v[i] != mx; i++) {}
        return i;
    }
#endif
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

/* floats of model->work the calls below use */
long strata_work_floats(const model_t *M) {
    int wide = max3(M->dim, M->ffn, M->n_heads * M->hd);
    /* x, qkv, y, gate, up, then xq (bytes) and the block scales, then the scores */
    return (long)M->dim + (long)(M->n_heads + 2 * M->n_kv) * M->hd + (long)M->n_heads * M->hd + 2L * M->ffn
           + wide / 4 + 2L * (wide / 32) + (long)(M->n_heads / M->n_kv) * M->max_len + 64;
}

static void product(const mat_t *W, const float *x, int n, int8_t *xq, float *dx, float *sx, float *y, int quantize) {
    if (quantize) quantize_row(x, n, xq, dx, sx);
    matvec(W, xq, dx, sx, y);
}

/* One kv head's attention, for tests: G query heads q (G x hd) against the first L rows of caches kc, vc
 * (float32, bfloat16 or e4m3 by bits, hd values a row) -> out (G x hd); sc: G * L floats of scratch. */
void strata_attend(const float *q, int G, const void *kc, const void *vc, int bits, int L, int hd, float *sc,
                   float *out) {
    attend(q, G, kc, vc, bits, L, hd, sc, out);
}

/* y = W x for one row x (cols floats): the kernel on its own, for tests and benchmarks */
void strata_matvec(const mat_t *W, const float *x, float *y, float *work) {
    int8_t *xq = (int8_t *)work;
    float *dx = work + W->cols / 4, *sx = dx + W->cols / 32;
    product(W, x, W->cols, xq, dx, sx, y, 1);
}

/* The stage's layers on one token's residual h (dim) at position pos; cos, ssin: that position's RoPE rows */
void strata_layers(const model_t *M, float *h, int pos, const float *cos, const float *ssin) {
    const int dim = M->dim, nh = M->n_heads, nkv = M->n_kv, hd = M->hd, ffn = M->ffn;
    const int wide = max3(dim, ffn, nh * hd), group = nh / nkv;
    float *x = M->work, *qkv = x + dim, *y = qkv + (nh + 2 * nkv) * hd, *gate = y + nh * hd, *up = gate + ffn;
    int8_t *xq = (int8_t *)(up + ffn);
    float *dx = up + ffn + wide / 4, *sx = dx + wide / 32, *sc = sx + wide / 32;
    float *q = qkv, *k = qkv + nh * hd, *v = k + nkv * hd;
    for (int l = 0; l < M->n_layers; l++) {
        const layer_t *L = M->layers + l;
        rms_norm(h, L->attn_norm, dim, M->eps, x);
        quantize_row(x, dim, xq, dx, sx); /* one quantized row for q, k and v */
        product(&L->wq, x, dim, xq, dx, sx, q, 0);
        product(&L->wk, x, dim, xq, dx, sx, k, 0);
        product(&L->wv, x, dim, xq, dx, sx, v, 0);
        if (L->bq) {
            for (int i = 0; i < nh * hd; i++) q[i] += L->bq[i];
            for (int i = 0; i < nkv * hd; i++) k[i] += L->bk[i];
            for (int i = 0; i < nkv * hd; i++) v[i] += L->bv[i];
        }
        for (int i = 0; i < nh + nkv; i++) rope(qkv + i * hd, cos, ssin, hd);
        for (int i = 0; i < nkv; i++) {
            size_t at = ((size_t)i * M->max_len + pos) * hd;
            kv_put(L->k_cache, M->kv_bits, at, k + i * hd, hd);
            kv_put(L->v_cache, M->kv_bits, at, v + i * hd, hd);
        }
        size_t esz = M->kv_bits / 8;
        for (int i = 0; i < nkv; i++) { /* q heads i*group .. i*group+group-1 read kv head i */
            size_t base = (size_t)i * M->max_len * hd * esz;
            attend(q + i * group * hd, group, (const char *)L->k_cache + base, (const char *)L->v_cache + base,
                   M->kv_bits, pos + 1, hd, sc, y + i * group * hd);
        }
        product(&L->wo, y, nh * hd, xq, dx, sx, x, 1);
        for (int i = 0; i < dim; i++) h[i] += x[i];
        rms_norm(h, L->mlp_norm, dim, M->eps, x);
        quantize_row(x, dim, xq, dx, sx);
        product(&L->wg, x, dim, xq, dx, sx, gate, 0);
        product(&L->wu, x, dim, xq, dx, sx, up, 0);
        silu_mul(gate, up, ffn);
        product(&L->wd, gate, ffn, xq, dx, sx, x, 1);
        for (int i = 0; i < dim; i++) h[i] += x[i];
    }
}

/* float32 logits (head rows) of the final norm of h; returns the first index of the largest logit */
int strata_head(const model_t *M, const float *h, const float *norm_w, const mat_t *head, float *logits) {
    const int wide = max3(M->dim, M->ffn, M->n_heads * M->hd);
    float *x = M->work;
    int8_t *xq = (int8_t *)(x + M->dim);
    float *dx = x + M->dim + wide / 4, *sx = dx + wide / 32;
    rms_norm(h, norm_w, M->dim, M->eps, x);
    product(head, x, M->dim, xq, dx, sx, logits, 1);
    return first_max(logits, head->rows);
}

/* ---- several sequences' steps at once ------------------------------------------------------------ */

/* floats of work strata_layers_rows / strata_head_rows use for m rows */
long strata_work_rows_floats(const model_t *M, int m) {
    int wide = max3(M->dim, M->ffn, M->n_heads * M->hd);
    return (long)m * ((long)M->dim + (long)(M->n_heads + 2 * M->n_kv) * M->hd + (long)M->n_heads * M->hd
                      + 2L * M->ffn + wide / 4 + 2L * (wide / 32))
           + (long)(M->n_heads / M->n_kv) * M->max_len + 64;
}

/* m tokens of m sequences, each a strata_layers step: row t's residual h + t * dim at position pos[t], its
 * RoPE rows cos + t * hd, ssin + t * hd, its cache caches[(t * n_layers + l) * 2] (K) and [... + 1] (V) for
 * layer l (each sequence holds its own). Row t's bits are those strata_layers gives it alone. */
void strata_layers_rows(const model_t *M, int m, float *h, const int32_t *pos, const float *cos, const float *ssin,
                        void *const *caches, float *work) {
    const int dim = M->dim, nh = M->n_heads, nkv = M->n_kv, hd = M->hd, ffn = M->ffn, nl = M->n_layers;
    const int wide = max3(dim, ffn, nh * hd), group = nh / nkv, wq = (nh + 2 * nkv) * hd;
    float *x = work, *qkv = x + (size_t)m * dim, *y = qkv + (size_t)m * wq, *gate = y + (size_t)m * nh * hd;
    float *up = gate + (size_t)m * ffn;
    int8_t *xq = (int8_t *)(up + (size_t)m * ffn);
    float *dx = up + (size_t)m * ffn + (size_t)m * wide / 4, *sx = dx + (size_t)m * (wide / 32);
    float *sc = sx + (size_t)m * (wide / 32);
    const int ss = wide / 32;
    const size_t esz = M->kv_bits / 8;
    for (int l = 0; l < nl; l++) {
        const layer_t *L = M->layers + l;
        for (int t = 0; t < m; t++) {
            rms_norm(h + (size_t)t * dim, L->attn_norm, dim, M->eps, x + (size_t)t * dim);
            quantize_row(x + (size_t)t * dim, dim, xq + (size_t)t * wide, dx + (size_t)t * ss, sx + (size_t)t * ss);
        }
        matmul(&L->wq, m, xq, wide, dx, sx, ss, qkv, wq);
        matmul(&L->wk, m, xq, wide, dx, sx, ss, qkv + nh * hd, wq);
        matmul(&L->wv, m, xq, wide, dx, sx, ss, qkv + (nh + nkv) * hd, wq);
        for (int t = 0; t < m; t++) {
            float *q = qkv + (size_t)t * wq, *k = q + nh * hd, *v = k + nkv * hd;
            void *kc = caches[((size_t)t * nl + l) * 2], *vc = caches[((size_t)t * nl + l) * 2 + 1];
            if (L->bq) {
                for (int i = 0; i < nh * hd; i++) q[i] += L->bq[i];
                for (int i = 0; i < nkv * hd; i++) k[i] += L->bk[i];
                for (int i = 0; i < nkv * hd; i++) v[i] += L->bv[i];
            }
            for (int i = 0; i < nh + nkv; i++) rope(q + i * hd, cos + (size_t)t * hd, ssin + (size_t)t * hd, hd);
            for (int i = 0; i < nkv; i++) {
                size_t at = ((size_t)i * M->max_len + pos[t]) * hd;
                kv_put(kc, M->kv_bits, at, k + i * hd, hd);
                kv_put(vc, M->kv_bits, at, v + i * hd, hd);
            }
            for (int i = 0; i < nkv; i++) {
                size_t base = (size_t)i * M->max_len * hd * esz;
                attend(q + i * group * hd, group, (const char *)kc + base, (const char *)vc + base, M->kv_bits,
                       pos[t] + 1, hd, sc, y + (size_t)t * nh * hd + i * group * hd);
            }
            quantize_row(y + (size_t)t * nh * hd, nh * hd, xq + (size_t)t * wide, dx + (size_t)t * ss,
                         sx + (size_t)t * ss);
        }
        matmul(&L->wo, m, xq, wide, dx, sx, ss, x, dim);
        for (int t = 0; t < m; t++) {
            float *ht = h + (size_t)t * dim, *xt = x + (size_t)t * dim;
            for (int i = 0; i < dim; i++) ht[i] += xt[i];
            rms_norm(ht, L->mlp_norm, dim, M->eps, xt);
            quantize_row(xt, dim, xq + (size_t)t * wide, dx + (size_t)t * ss, sx + (size_t)t * ss);
        }
        matmul(&L->wg, m, xq, wide, dx, sx, ss, gate, ffn);
        matmul(&L->wu, m, xq, wide, dx, sx, ss, up, ffn);
        for (int t = 0; t < m; t++) {
            silu_mul(gate + (size_t)t * ffn, up + (size_t)t * ffn, ffn);
            quantize_row(gate + (size_t)t * ffn, ffn, xq + (size_t)t * wide, dx + (size_t)t * ss, sx + (size_t)t * ss);
        }
        matmul(&L->wd, m, xq, wide, dx, sx, ss, x, dim);
        for (int t = 0; t < m; t++)
            for (int i = 0; i < dim; i++) h[(size_t)t * dim + i] += x[(size_t)t * dim + i];
    }
}

/* strata_head for m rows h (m x dim): logits (m x head rows), best[t] each row's first largest */
void strata_head_rows(const model_t *M, int m, const float *h, const float *norm_w, const mat_t *head, float *logits,
                      int32_t *best, float *work) {
    const int dim = M->dim, wide = max3(M->dim, M->ffn, M->n_heads * M->hd), ss = wide / 32;
    float *x = work;
    int8_t *xq = (int8_t *)(x + (size_t)m * dim);
    float *dx = x + (size_t)m * dim + (size_t)m * wide / 4, *sx = dx + (size_t)m * ss;
    for (int t = 0; t < m; t++) {
        rms_norm(h + (size_t)t * dim, norm_w, dim, M->eps, x + (size_t)t * dim);
        quantize_row(x + (size_t)t * dim, dim, xq + (size_t)t * wide, dx + (size_t)t * ss, sx + (size_t)t * ss);
    }
    matmul(head, m, xq, wide, dx, sx, ss, logits, head->rows);
    for (int t = 0; t < m; t++) {
        best[t] = first_max(logits + (size_t)t * head->rows, head->rows);
    }
}
