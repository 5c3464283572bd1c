/* Strata C core: the AVX-512 kernel set: avxvnni.c's kernels plus column kernels for short reads (2 or more
 * tokens) of the 32-element types, where a 2-core machine is compute-bound. Selected at run time only when the
 * CPU reports avx2, fma, avxvnni and AVX-512 F/BW/VL/DQ/VNNI (Sapphire Rapids, Zen 4 and later).
 *
 * A column kernel takes ST_COLS_ROWS weight rows against up to ST_COLS_PAIRS token pairs (st_cols): each weight
 * block is unpacked once, its 32 bytes duplicated per 4-byte group into 64, and one 512-bit vpdpbusd gives two
 * tokens' 8 lane sums. Every (row, token) then takes exactly the operations of the type's one-token dot
 * (avx2_dot32.inc with vpdpbusd): the same int32 lane sums (integer, exact however computed), their float
 * conversion, the FMA of the scale product dw * d into 8 lanes in block order, the minimum term
 * fmaf(mw, s, summ) in block order, hsum_float_8 and the final add. So a token's row of a short read is bit for
 * bit its row of a decode step (the short read's exactness contract), at any token count and thread count. */
#include "common.h"

#if (defined(__x86_64__) || defined(_M_X64)) && ST_HAVE_AVX512
#define ST_AVXVNNI 1

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,avxvnni,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#endif

#include <immintrin.h>

#include "avx2_dot32.inc"

#include "kernels.inc"

#include "avx2_kquants.inc"

#include "avx2_iq.inc"

#include "avx2_float.inc"

/* Lanes 2j and 2j + 1 <- 32-bit group j of a 256-bit block: the weight bytes facing a pair's interleaved groups. */
static ST_ALWAYS_INLINE __m512i dup_groups(const __m256i qx) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_permutexvar_epi32(idx, _mm512_castsi256_si512(qx));
}

/* The two tokens' 8-lane accumulators of a pair (interleaved) -> token 0's lanes in the low half, token 1's in
 * the high half, each in lane order. */
static ST_ALWAYS_INLINE __m512 split_pair(const __m512 v) {
    const __m512i idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm512_permutexvar_ps(idx, v);
}

/* Two floats (a pair's scale products) in every 64-bit lane: one broadcast load. */
static ST_ALWAYS_INLINE __m512 bcast_pair(const float *p) {
    double v;
    memcpy(&v, p, sizeof v);
    return _mm512_castpd_ps(_mm512_set1_pd(v));
}

/* NR rows x NP pairs. UNPACK sets qx, dw, mw for block b of row x (avx2_dot32.inc's); SIGNED: Q8_0's weights are
 * shifted to unsigned (x ^ 0x80) and each pair's -128 * group sums start the integer sum; it has no minimum. */
#define COLS_KERNEL(NAME, BLOCK, UNPACK, SIGNED)                                                        \
    static ST_ALWAYS_INLINE void NAME##_k(const char *w, size_t w_stride, const st_cols *c, int p0, int nt,  \
                                          float *out, size_t out_stride, const int NR, const int NP) {  \
        __m512 acc[ST_COLS_ROWS][ST_COLS_PAIRS];                                                        \
        __m256 summ[ST_COLS_ROWS][2];                                                                   \
        for (int r = 0; r < NR; r++) {                                                                  \
            summ[r][0] = summ[r][1] = _mm256_setzero_ps();                                              \
            for (int p = 0; p < NP; p++) acc[r][p] = _mm512_setzero_ps();                               \
        }                                                                                               \
        const int nb = c->nb, P = c->n_pairs, ds = c->d_stride;                                         \
        for (int b = 0; b < nb; b++) {                                                                  \
            __m512i wq[ST_COLS_ROWS];                                                                   \
            float sc[ST_COLS_ROWS][2 * ST_COLS_PAIRS] __attribute__((aligned(64)));                     \
            const float *db = c->d + (size_t)b * ds + 2 * p0, *sb = c->s + (size_t)b * ds + 2 * p0;     \
            for (int r = 0; r < NR; r++) {                                                              \
                const BLOCK *x = (const BLOCK *)(w + (size_t)r * w_stride);                             \
                __m256i qx; float dw, mw;                                                               \
                UNPACK                                                                                  \
                (void)mw;                                                                               \
                if (SIGNED) qx = _mm256_xor_si256(qx, _mm256_set1_epi8((char)0x80));                    \
                wq[r] = dup_groups(qx);                                                                 \
                const __m256 vdw = _mm256_set1_ps(dw);                                                  \
                _mm256_store_ps(sc[r], _mm256_mul_ps(vdw, _mm256_loadu_ps(db)));                        \
                if (NP > 4) _mm256_store_ps(sc[r] + 8, _mm256_mul_ps(vdw, _mm256_loadu_ps(db + 8)));    \
                if (!SIGNED) {                                                                          \
                    const __m256 vmw = _mm256_set1_ps(mw);                                              \
                    summ[r][0] = _mm256_fmadd_ps(vmw, _mm256_loadu_ps(sb), summ[r][0]);                 \
                    if (NP > 4) summ[r][1] = _mm256_fmadd_ps(vmw, _mm256_loadu_ps(sb + 8), summ[r][1]); \
                }                                                                                       \
            }                                                                                           \
            const int8_t *qa = c->qs + ((size_t)b * P + p0) * 64;                                       \
            const int32_t *na = SIGNED ? c->neg + ((size_t)b * P + p0) * 16 : NULL;                     \
            for (int p = 0; p < NP; p++) {                                                              \
                const __m512i a = _mm512_loadu_si512((const void *)(qa + 64 * p));                      \
                const __m512i i0 = SIGNED ? _mm512_loadu_si512((const void *)(na + 16 * p))             \
                                          : _mm512_setzero_si512();                                     \
                for (int r = 0; r < NR; r++)                                                            \
                    acc[r][p] = _mm512_fmadd_ps(bcast_pair(sc[r] + 2 * p),                              \
                                                _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(i0, wq[r], a)),  \
                                                acc[r][p]);                                             \
            }                                                                                           \
        }                                                                                               \
        for (int r = 0; r < NR; r++) {                                                                  \
            float sm[2 * ST_COLS_PAIRS];                                                                \
            _mm256_storeu_ps(sm, summ[r][0]);                                                           \
            _mm256_storeu_ps(sm + 8, summ[r][1]);                                                       \
            for (int p = 0; p < NP; p++) {                                                              \
                const __m512 v = split_pair(acc[r][p]);                                                 \
                const float h0 = hsum_float_8(_mm512_castps512_ps256(v));                               \
                const float h1 = hsum_float_8(_mm512_extractf32x8_ps(v, 1));                            \
                const int t = 2 * p;                                                                    \
                if (t < nt) out[(size_t)t * out_stride + r] = SIGNED ? h0 : h0 + sm[t];                 \
                if (t + 1 < nt) out[(size_t)(t + 1) * out_stride + r] = SIGNED ? h1 : h1 + sm[t + 1];   \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    static void NAME(const void *w, size_t w_stride, int nr, const st_cols *c, int p0, int np, int nt,  \
                     float *out, size_t out_stride) {                                                   \
        const char *wc = (const char *)w;                                                               \
        if (nr >= 2) {                                                                                  \
            switch (np) {                                                                               \
            case 1: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 2, 1); break;                    \
            case 2: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 2, 2); break;                    \
            case 3: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 2, 3); break;                    \
            case 4: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 2, 4); break;                    \
            case 5: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 2, 5); break;                    \
            case 6: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 2, 6); break;                    \
            case 7: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 2, 7); break;                    \
            default: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 2, 8); break;                   \
            }                                                                                           \
        } else {                                                                                        \
            switch (np) {                                                                               \
            case 1: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 1, 1); break;                    \
            case 2: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 1, 2); break;                    \
            case 3: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 1, 3); break;                    \
            case 4: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 1, 4); break;                    \
            case 5: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 1, 5); break;                    \
            case 6: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 1, 6); break;                    \
            case 7: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 1, 7); break;                    \
            default: NAME##_k(wc, w_stride, c, p0, nt, out, out_stride, 1, 8); break;                   \
            }                                                                                           \
        }                                                                                               \
    }

/* Q8_0's unpack: the signed bytes as they are (shifted by COLS_KERNEL's SIGNED). */
#define UNPACK_Q8_0 dw = st_h2f(x[b].d); mw = 0.0f; qx = _mm256_loadu_si256((const __m256i *)x[b].qs);

COLS_KERNEL(cols_q4_0, block_q4_0, UNPACK_Q4_0, 0)
COLS_KERNEL(cols_q4_1, block_q4_1, UNPACK_Q4_1, 0)
COLS_KERNEL(cols_q5_0, block_q5_0, UNPACK_Q5_0, 0)
COLS_KERNEL(cols_q5_1, block_q5_1, UNPACK_Q5_1, 0)
COLS_KERNEL(cols_q8_0, block_q8_0, UNPACK_Q8_0, 1)

const st_kernels *st_kernels_avx512(void) {
    static st_kernels k;
    static int done = 0;
    if (!done) {
        memset(&k, 0, sizeof k);
        fill_table(&k);
        k.dot2[ST_Q4_0] = dot_q4_0_2; k.dot2[ST_Q4_1] = dot_q4_1_2;
        k.dot2[ST_Q5_0] = dot_q5_0_2; k.dot2[ST_Q5_1] = dot_q5_1_2;
        k.dot[ST_Q4_K] = dot_q4_K_simd; k.dot[ST_Q5_K] = dot_q5_K_simd; k.dot[ST_Q6_K] = dot_q6_K_simd;
        k.nt[ST_Q4_K] = k.nt[ST_Q5_K] = k.nt[ST_Q6_K] = ST_NT_MAX;
        fill_table_iq_simd(&k);
        fill_table_float_simd(&k);
        k.dot_cols[ST_Q4_0] = cols_q4_0; k.dot_cols[ST_Q4_1] = cols_q4_1;
        k.dot_cols[ST_Q5_0] = cols_q5_0; k.dot_cols[ST_Q5_1] = cols_q5_1;
        k.dot_cols[ST_Q8_0] = cols_q8_0;
        k.name = "avx512";
        done = 1;
    }
    return &k;
}

#include "target_end.inc"

#endif /* x86-64 */
