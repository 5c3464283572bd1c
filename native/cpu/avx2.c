/* Strata C core: the AVX2+FMA kernel set (hand-written maddubs/madd dot products for the 32-element
 * types after ggml's ggml_vec_dot_q*_q8_* AVX2 kernels; the other kernels are the plain-C ones compiled
 * for AVX2 so gcc vectorizes them). Selected at run time only when the CPU reports avx2 and fma. */
#include "common.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#include <immintrin.h>

#define ST_HAVE_DOT32 1
#define ST_HAVE_QUANT_A8 1
#define ST_ALWAYS_INLINE inline __attribute__((always_inline))

static ST_ALWAYS_INLINE float hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

static ST_ALWAYS_INLINE int hsum_i32_8(const __m256i a) {
    const __m128i sum128 = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extractf128_si256(a, 1));
    const __m128i hi64 = _mm_unpackhi_epi64(sum128, sum128);
    const __m128i sum64 = _mm_add_epi32(hi64, sum128);
    const __m128i hi32 = _mm_shuffle_epi32(sum64, _MM_SHUFFLE(2, 3, 0, 1));
    return _mm_cvtsi128_si32(_mm_add_epi32(sum64, hi32));
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles in bytes 0..15, high nibbles in 16..31 (ggml layout). */
static ST_ALWAYS_INLINE __m256i bytes_from_nibbles_32(const uint8_t *rsi) {
    const __m128i tmp = _mm_loadu_si128((const __m128i *)rsi);
    const __m256i bytes = _mm256_insertf128_si256(_mm256_castsi128_si256(tmp), _mm_srli_epi16(tmp, 4), 1);
    return _mm256_and_si256(_mm256_set1_epi8(0x0F), bytes);
}

/* 32 bits -> 32 bytes, 0xFF where the bit is set (ggml bytes_from_bits_32). */
static ST_ALWAYS_INLINE __m256i bytes_from_bits_32(const uint8_t *x) {
    uint32_t x32; memcpy(&x32, x, sizeof(uint32_t));
    const __m256i shuf_mask = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf_mask);
    const __m256i bit_mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    bytes = _mm256_or_si256(bytes, bit_mask);
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* Unsigned weight bytes (0..31) times signed activation bytes, summed in pairs then quads -> 8 floats. */
static ST_ALWAYS_INLINE __m256 mul_sum_us8_pairs_float(const __m256i ax, const __m256i sy) {
    const __m256i dot = _mm256_maddubs_epi16(ax, sy);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, _mm256_set1_epi16(1)));
}

#define ACT_A8(t) ((const block_a8 *)((const char *)act + (t) * act_stride) + b)

/* One weight row against nt activation rows; UNPACK sets qx (unsigned bytes), dw, mw for block b. */
#define DOT32U_AVX2(NAME, BLOCK, UNPACK)                                                           \
    static ST_ALWAYS_INLINE void NAME##_n(int nb, const BLOCK *x, const void *act, size_t act_stride, \
                                          float *out, size_t out_stride, const int nt) {           \
        __m256 acc[ST_NT];                                                                         \
        float summ[ST_NT];                                                                         \
        for (int t = 0; t < nt; t++) { acc[t] = _mm256_setzero_ps(); summ[t] = 0.0f; }            \
        for (int b = 0; b < nb; b++) {                                                             \
            __m256i qx; float dw, mw;                                                              \
            UNPACK                                                                                 \
            for (int t = 0; t < nt; t++) {                                                         \
                const block_a8 *a = ACT_A8(t);                                                     \
                const __m256i qy = _mm256_loadu_si256((const __m256i *)a->qs);                     \
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a->d), mul_sum_us8_pairs_float(qx, qy), acc[t]); \
                summ[t] += mw * a->s;                                                              \
            }                                                                                      \
        }                                                                                          \
        for (int t = 0; t < nt; t++) out[t * out_stride] = hsum_float_8(acc[t]) + summ[t];        \
    }                                                                                              \
    static void NAME(int nb, const void *w, const void *act, size_t act_stride, int nt, float *out, \
                     size_t out_stride) {                                                          \
        const BLOCK *x = (const BLOCK *)w;                                                         \
        switch (nt) {                                                                              \
        case 1: NAME##_n(nb, x, act, act_stride, out, out_stride, 1); break;                       \
        case 2: NAME##_n(nb, x, act, act_stride, out, out_stride, 2); break;                       \
        case 3: NAME##_n(nb, x, act, act_stride, out, out_stride, 3); break;                       \
        default: NAME##_n(nb, x, act, act_stride, out, out_stride, 4); break;                      \
        }                                                                                          \
    }

DOT32U_AVX2(dot_q4_0, block_q4_0,
            dw = st_h2f(x[b].d); mw = -8.0f * dw;
            qx = bytes_from_nibbles_32(x[b].qs);)

DOT32U_AVX2(dot_q4_1, block_q4_1,
            dw = st_h2f(x[b].d); mw = st_h2f(x[b].m);
            qx = bytes_from_nibbles_32(x[b].qs);)

DOT32U_AVX2(dot_q5_0, block_q5_0,
            dw = st_h2f(x[b].d); mw = -16.0f * dw;
            qx = _mm256_or_si256(bytes_from_nibbles_32(x[b].qs),
                                 _mm256_and_si256(bytes_from_bits_32(x[b].qh), _mm256_set1_epi8(0x10)));)

DOT32U_AVX2(dot_q5_1, block_q5_1,
            dw = st_h2f(x[b].d); mw = st_h2f(x[b].m);
            qx = _mm256_or_si256(bytes_from_nibbles_32(x[b].qs),
                                 _mm256_and_si256(bytes_from_bits_32(x[b].qh), _mm256_set1_epi8(0x10)));)

/* Q8_0 weights are signed: |x| * sign(y, x) keeps maddubs' unsigned*signed form (ggml mul_sum_i8_pairs). */
static ST_ALWAYS_INLINE void dot_q8_0_n(int nb, const block_q8_0 *x, const void *act, size_t act_stride,
                                        float *out, size_t out_stride, const int nt) {
    __m256 acc[ST_NT];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256i ax = _mm256_sign_epi8(qx, qx);
        const float dw = st_h2f(x[b].d);
        for (int t = 0; t < nt; t++) {
            const block_a8 *a = ACT_A8(t);
            const __m256i sy = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a->qs), qx);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a->d), mul_sum_us8_pairs_float(ax, sy), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) out[t * out_stride] = hsum_float_8(acc[t]);
}

static void dot_q8_0(int nb, const void *w, const void *act, size_t act_stride, int nt, float *out,
                     size_t out_stride) {
    const block_q8_0 *x = (const block_q8_0 *)w;
    switch (nt) {
    case 1: dot_q8_0_n(nb, x, act, act_stride, out, out_stride, 1); break;
    case 2: dot_q8_0_n(nb, x, act, act_stride, out, out_stride, 2); break;
    case 3: dot_q8_0_n(nb, x, act, act_stride, out, out_stride, 3); break;
    default: dot_q8_0_n(nb, x, act, act_stride, out, out_stride, 4); break;
    }
}

#undef ACT_A8

/* fp32 -> block_a8 (ggml quantize_row_q8_0 AVX2, plus the block sum). Rounds half to even. */
static void quant_a8(const float *x, void *dst, int64_t n) {
    block_a8 *y = (block_a8 *)dst;
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < n / QK32; i++, x += QK32) {
        __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        __m256 max_abs = _mm256_andnot_ps(sign_bit, v0);
        max_abs = _mm256_max_ps(max_abs, _mm256_andnot_ps(sign_bit, v1));
        max_abs = _mm256_max_ps(max_abs, _mm256_andnot_ps(sign_bit, v2));
        max_abs = _mm256_max_ps(max_abs, _mm256_andnot_ps(sign_bit, v3));
        __m128 max4 = _mm_max_ps(_mm256_extractf128_ps(max_abs, 1), _mm256_castps256_ps128(max_abs));
        max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
        max4 = _mm_max_ss(max4, _mm_movehdup_ps(max4));
        const float amax = _mm_cvtss_f32(max4);
        const float d = amax / 127.0f;
        const __m256 mul = _mm256_set1_ps(d ? 1.0f / d : 0.0f);
        v0 = _mm256_round_ps(_mm256_mul_ps(v0, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v1 = _mm256_round_ps(_mm256_mul_ps(v1, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v2 = _mm256_round_ps(_mm256_mul_ps(v2, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v3 = _mm256_round_ps(_mm256_mul_ps(v3, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i i0 = _mm256_cvtps_epi32(v0), i1 = _mm256_cvtps_epi32(v1);
        __m256i i2 = _mm256_cvtps_epi32(v2), i3 = _mm256_cvtps_epi32(v3);
        const int isum = hsum_i32_8(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
        i0 = _mm256_packs_epi32(i0, i1);
        i2 = _mm256_packs_epi32(i2, i3);
        i0 = _mm256_packs_epi16(i0, i2);
        i0 = _mm256_permutevar8x32_epi32(i0, perm);
        _mm256_storeu_si256((__m256i *)y[i].qs, i0);
        y[i].d = d;
        y[i].s = d * (float)isum;
    }
}

#include "kernels.inc"

const st_kernels *st_kernels_avx2(void) {
    static st_kernels k;
    static int done = 0;
    if (!done) { memset(&k, 0, sizeof k); fill_table(&k); k.name = "avx2"; done = 1; }
    return &k;
}

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif /* x86-64 */
