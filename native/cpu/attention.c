/* Strata C core: causal GQA attention over the paged float32 KV cache (AVX2+FMA), for decode and prefill.
 *
 * Method (FlashAttention's online softmax, Dao et al. 2022, "FlashAttention", arXiv:2205.14135; split-K
 * decode as in "Flash-Decoding"): keys are taken one KV page at a time (a "segment"). For each query row a
 * segment gives a partial (m = max score, l = sum exp(s - m), a = sum exp(s - m) v); partials are merged in
 * page order, starting from page 0: M' = max(M, m), A = A exp(M - M') + a exp(m - M'), L likewise. The
 * output is A / L.
 *
 * Determinism: a row's arithmetic depends only on its query, its position and the K/V it sees. Row blocks,
 * the number of tokens in the call, the thread count and whether segments are computed in parallel (split,
 * for decode) or in a loop (prefill) never change a bit: every row has its own FMA chains in a fixed order,
 * masked keys contribute exact zeros, and partials are always merged sequentially in page order.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "common.h"
#include "strata_cpu.h"

#if defined(__x86_64__) || defined(_M_X64)

#include "target_avx2_begin.inc"

#include <immintrin.h>

#define KT_W 16   /* keys per QK tile (two vectors) */
#define QK_RB 6   /* query rows per QK micro-kernel */
#define PV_RB 3   /* query rows per PV micro-kernel */
#define ROWS_MAX 64

typedef struct {
    const float *q;         /* (n, n_head, hd) */
    int64_t n;
    int n_head, n_kv, hd, hv, g;
    const float *K, *V;     /* (n_kv, pool_pages, ps, hd|hv) */
    int64_t pool_pages;
    int ps;
    const int32_t *pages;
    int64_t start;
    float scale;
    float *out;             /* (n, n_head, hv) */
    int qb;                 /* tokens per row block */
    int64_t n_blocks, n_segs;
    int split;
    int wide;               /* the 512-bit QK / PV kernels (same bits) */
    float *scratch;         /* split: per (h, blk, seg) item: R*(2 + hv) floats */
    int64_t item_floats;
    int64_t n_items;
    _Atomic int64_t next;
} at_task;

/* exp(x) for x <= 0 (scores minus their max), 8 lanes: Cephes-style range reduction x = n ln2 + r and a
 * degree-6 polynomial for exp(r); lanes below -87 (incl. -inf for masked keys) give exactly 0. */
static inline __m256 exp_le0(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, c1, x);
    r = _mm256_fnmadd_ps(fx, c2, r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    const __m256 r2 = _mm256_mul_ps(r, r);
    p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(zero_mask, p);
}

static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

/* kt[d * 16 + j] = K[j][d] for keys j < jn (0 for jn <= j < 16): 8x8 register transposes (hd % 8 == 0). */
static inline void build_kt(const float *K, int hd, int jn, float *kt) {
    for (int j0 = 0; j0 < KT_W; j0 += 8) {
        for (int d = 0; d < hd; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = j0 + i < jn ? _mm256_loadu_ps(K + (size_t)(j0 + i) * hd + d) : _mm256_setzero_ps();
            const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
            const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
            const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
            const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *o = kt + (size_t)d * KT_W + j0;
            _mm256_store_ps(o + 0 * KT_W, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_store_ps(o + 1 * KT_W, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_store_ps(o + 2 * KT_W, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_store_ps(o + 3 * KT_W, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_store_ps(o + 4 * KT_W, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_store_ps(o + 5 * KT_W, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_store_ps(o + 6 * KT_W, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_store_ps(o + 7 * KT_W, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    }
}

/* S[r][j0 .. j0+16) = qs[r] . KT[:, 0..16) for rows r0 .. r0+RB. */
#define QK_KERNEL(RB)                                                                                     \
    static inline void qk_rows_##RB(const float *qs, int hd, const float *kt, float *S, int sw) {         \
        __m256 a0[RB], a1[RB];                                                                            \
        for (int r = 0; r < RB; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }       \
        for (int d = 0; d < hd; d++) {                                                                    \
            const __m256 k0 = _mm256_load_ps(kt + d * KT_W), k1 = _mm256_load_ps(kt + d * KT_W + 8);     \
            for (int r = 0; r < RB; r++) {                                                                \
                const __m256 qv = _mm256_broadcast_ss(qs + (size_t)r * hd + d);                           \
                a0[r] = _mm256_fmadd_ps(qv, k0, a0[r]);                                                   \
                a1[r] = _mm256_fmadd_ps(qv, k1, a1[r]);                                                   \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < RB; r++) {                                                                    \
            _mm256_storeu_ps(S + (size_t)r * sw, a0[r]);                                                  \
            _mm256_storeu_ps(S + (size_t)r * sw + 8, a1[r]);                                              \
        }                                                                                                 \
    }
QK_KERNEL(1)
QK_KERNEL(2)
QK_KERNEL(3)
QK_KERNEL(4)
QK_KERNEL(5)
QK_KERNEL(6)

/* a[r][c0 .. c0 + 8*NV) += sum_{j < jn} P[r][j] V[j][c0 ..) for RB rows. */
#define PV_KERNEL(RB)                                                                                     \
    static inline void pv_rows_##RB(const float *P, int sw, const float *Vp, int hv, int jn, float *a,   \
                                    int c0, int nv) {                                                     \
        __m256 acc[RB][4];                                                                                \
        for (int r = 0; r < RB; r++)                                                                      \
            for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();                                  \
        if (nv == 4) {                                                                                    \
            for (int j = 0; j < jn; j++) {                                                                \
                const float *vr = Vp + (size_t)j * hv + c0;                                               \
                const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);                      \
                const __m256 v2 = _mm256_loadu_ps(vr + 16), v3 = _mm256_loadu_ps(vr + 24);                \
                for (int r = 0; r < RB; r++) {                                                            \
                    const __m256 p = _mm256_broadcast_ss(P + (size_t)r * sw + j);                         \
                    acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);                                        \
                    acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);                                        \
                    acc[r][2] = _mm256_fmadd_ps(p, v2, acc[r][2]);                                        \
                    acc[r][3] = _mm256_fmadd_ps(p, v3, acc[r][3]);                                        \
                }                                                                                         \
            }                                                                                             \
        } else {                                                                                          \
            for (int j = 0; j < jn; j++) {                                                                \
                const float *vr = Vp + (size_t)j * hv + c0;                                               \
                for (int r = 0; r < RB; r++) {                                                            \
                    const __m256 p = _mm256_broadcast_ss(P + (size_t)r * sw + j);                         \
                    for (int c = 0; c < nv; c++)                                                          \
                        acc[r][c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), acc[r][c]);          \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < RB; r++)                                                                      \
            for (int c = 0; c < nv; c++) _mm256_storeu_ps(a + (size_t)r * hv + c0 + 8 * c, acc[r][c]);  \
    }
PV_KERNEL(1)
PV_KERNEL(2)
PV_KERNEL(3)

/* The same two products with 512-bit vectors on CPUs with AVX-512F (the "avx512" kernel set's CPUs): 16 keys (QK)
 * or 16 value columns (PV) per vector. Each output lane runs the 256-bit kernels' FMA chain (zero, then one FMA
 * per d, or per key, in the same order), so the scores and partials are bit for bit those of QK_KERNEL / PV_KERNEL
 * and a row's result still depends only on its own query, position and K/V. */
#if ST_HAVE_AVX512
#if defined(__clang__)  /* leave the file's avx2 region (target_avx2_begin.inc) while these are compiled */
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")
#endif
#define QK_RB_W 12  /* query rows per 512-bit QK micro-kernel */
#define PV_RB_W 6   /* query rows per 512-bit PV micro-kernel (hv <= 64 at a time) */

static inline __attribute__((always_inline)) void qk_rows_w(const float *qs, int hd, const float *kt, float *S, int sw,
                                                            const int RB) {
    __m512 a[QK_RB_W];
    for (int r = 0; r < RB; r++) a[r] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d++) {
        const __m512 k = _mm512_load_ps(kt + d * KT_W);
        for (int r = 0; r < RB; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[(size_t)r * hd + d]), k, a[r]);
    }
    for (int r = 0; r < RB; r++) _mm512_storeu_ps(S + (size_t)r * sw, a[r]);
}

#define QK_W(RB)                                                                                          \
    static void qk_rows_w##RB(const float *qs, int hd, const float *kt, float *S, int sw) {                \
        qk_rows_w(qs, hd, kt, S, sw, RB);                                                                 \
    }
QK_W(1) QK_W(2) QK_W(3) QK_W(4) QK_W(5) QK_W(6) QK_W(7) QK_W(8) QK_W(9) QK_W(10) QK_W(11) QK_W(12)
typedef void (*qk_w_fn)(const float *, int, const float *, float *, int);
static const qk_w_fn QK_W_FNS[QK_RB_W + 1] = {NULL, qk_rows_w1, qk_rows_w2, qk_rows_w3, qk_rows_w4, qk_rows_w5,
                                              qk_rows_w6, qk_rows_w7, qk_rows_w8, qk_rows_w9, qk_rows_w10,
                                              qk_rows_w11, qk_rows_w12};

/* a[r][c0 .. c0 + 16*nv) = sum_{j < jn} P[r][j] V[j][c0 ..) for RB rows, nv <= 4. */
static inline __attribute__((always_inline)) void pv_rows_w(const float *P, int sw, const float *Vp, int hv,
                                                            int jn, float *a, int c0, const int nv, const int RB) {
    __m512 acc[PV_RB_W][4];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = _mm512_setzero_ps();
    for (int j = 0; j < jn; j++) {
        const float *vr = Vp + (size_t)j * hv + c0;
        __m512 v[4];
        for (int c = 0; c < nv; c++) v[c] = _mm512_loadu_ps(vr + 16 * c);
        for (int r = 0; r < RB; r++) {
            const __m512 p = _mm512_set1_ps(P[(size_t)r * sw + j]);
            for (int c = 0; c < nv; c++) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(a + (size_t)r * hv + c0 + 16 * c, acc[r][c]);
}

static void pv_rows_wide(const float *P, int sw, const float *Vp, int hv, int jn, float *a, int c0, int nv, int rb) {
#define PV_W_CASE(RB)                                                                                     \
    case RB:                                                                                              \
        if (nv == 4) pv_rows_w(P, sw, Vp, hv, jn, a, c0, 4, RB);                                          \
        else if (nv == 3) pv_rows_w(P, sw, Vp, hv, jn, a, c0, 3, RB);                                     \
        else if (nv == 2) pv_rows_w(P, sw, Vp, hv, jn, a, c0, 2, RB);                                     \
        else pv_rows_w(P, sw, Vp, hv, jn, a, c0, 1, RB);                                                  \
        break;
    switch (rb) { PV_W_CASE(1) PV_W_CASE(2) PV_W_CASE(3) PV_W_CASE(4) PV_W_CASE(5) default: PV_W_CASE(6) }
#undef PV_W_CASE
}

#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
#endif /* ST_HAVE_AVX512 */

typedef struct {
    float *qs;   /* R x hd, scaled queries */
    float *S;    /* R x sw scores / probabilities */
    float *kt;   /* hd x KT_W, 32-byte aligned */
    float *pm, *pl, *pa;  /* partial: m[R], l[R], a[R x hv] */
    float *M, *L, *A;     /* running merge */
    int sw;
} at_buf;

static int buf_alloc(at_buf *b, const at_task *t) {
    const int R = t->qb * t->g;
    b->sw = (t->ps + KT_W - 1) / KT_W * KT_W;
    const size_t n = (size_t)R * t->hd + (size_t)R * b->sw + (size_t)t->hd * KT_W + 2 * ((size_t)R * (2 + t->hv)) + 64;
    float *m = (float *)aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);   /* kt: 64-byte rows */
    if (!m) return 0;
    b->kt = m;
    b->qs = b->kt + (size_t)t->hd * KT_W;
    b->S = b->qs + (size_t)R * t->hd;
    b->pm = b->S + (size_t)R * b->sw;
    b->pl = b->pm + R;
    b->pa = b->pl + R;
    b->M = b->pa + (size_t)R * t->hv;
    b->L = b->M + R;
    b->A = b->L + R;
    return 1;
}

/* Rows of block blk: token i0 + r / g, query head h*g + r % g. Fills b->qs (scaled); returns R. */
static int load_queries(const at_task *t, at_buf *b, int h, int64_t blk, int64_t *i0_out) {
    const int64_t i0 = blk * t->qb;
    const int64_t i1 = i0 + t->qb < t->n ? i0 + t->qb : t->n;
    const int R = (int)(i1 - i0) * t->g;
    const __m256 sc = _mm256_set1_ps(t->scale);
    for (int r = 0; r < R; r++) {
        const float *src = t->q + ((i0 + r / t->g) * t->n_head + (int64_t)h * t->g + r % t->g) * t->hd;
        float *dst = b->qs + (size_t)r * t->hd;
        for (int d = 0; d < t->hd; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), sc));
    }
    *i0_out = i0;
    return R;
}

/* Partial of segment s for the R rows in b->qs (tokens from i0): b->pm, b->pl, b->pa. pl[r] = 0 marks a row
 * that sees no key of the segment. */
static void seg_partial(const at_task *t, at_buf *b, int h, int64_t i0, int R, int64_t s) {
    const int hd = t->hd, hv = t->hv, g = t->g, sw = b->sw;
    const int64_t k0 = s * t->ps;
    const int64_t last_q = t->start + i0 + (R - 1) / g;   /* position of the block's last query */
    int64_t kend = k0 + t->ps;
    if (kend > last_q + 1) kend = last_q + 1;
    const int nk = (int)(kend - k0);
    const int64_t page = t->pages[s];
    const float *Kp = t->K + ((int64_t)h * t->pool_pages + page) * t->ps * hd;
    const float *Vp = t->V + ((int64_t)h * t->pool_pages + page) * t->ps * hv;
    /* scores */
    for (int j0 = 0; j0 < nk; j0 += KT_W) {
        const int jn = nk - j0 < KT_W ? nk - j0 : KT_W;
        build_kt(Kp + (size_t)j0 * hd, hd, jn, b->kt);
#if ST_HAVE_AVX512
        if (t->wide) {
            for (int r = 0; r < R; r += QK_RB_W) {
                const int rb = R - r < QK_RB_W ? R - r : QK_RB_W;
                QK_W_FNS[rb](b->qs + (size_t)r * hd, hd, b->kt, b->S + (size_t)r * sw + j0, sw);
            }
            continue;
        }
#endif
        int r = 0;
        for (; r + QK_RB <= R; r += QK_RB) qk_rows_6(b->qs + (size_t)r * hd, hd, b->kt, b->S + (size_t)r * sw + j0, sw);
        switch (R - r) {
        case 5: qk_rows_5(b->qs + (size_t)r * hd, hd, b->kt, b->S + (size_t)r * sw + j0, sw); break;
        case 4: qk_rows_4(b->qs + (size_t)r * hd, hd, b->kt, b->S + (size_t)r * sw + j0, sw); break;
        case 3: qk_rows_3(b->qs + (size_t)r * hd, hd, b->kt, b->S + (size_t)r * sw + j0, sw); break;
        case 2: qk_rows_2(b->qs + (size_t)r * hd, hd, b->kt, b->S + (size_t)r * sw + j0, sw); break;
        case 1: qk_rows_1(b->qs + (size_t)r * hd, hd, b->kt, b->S + (size_t)r * sw + j0, sw); break;
        default: break;
        }
    }
    /* softmax pieces per row; vis = keys of the segment the row's query sees */
    const int nk8 = (nk + 7) / 8 * 8;
    int vis[ROWS_MAX];
    for (int r = 0; r < R; r++) {
        const int64_t qpos = t->start + i0 + r / g;
        int64_t v = qpos - k0 + 1;
        if (v > nk) v = nk;
        vis[r] = v > 0 ? (int)v : 0;
        float *Sr = b->S + (size_t)r * sw;
        if (vis[r] == 0) { b->pm[r] = -INFINITY; b->pl[r] = 0.0f; continue; }
        float m = Sr[0];
        for (int j = 1; j < vis[r]; j++) m = Sr[j] > m ? Sr[j] : m;
        for (int j = vis[r]; j < nk8; j++) Sr[j] = -INFINITY;
        const __m256 mv = _mm256_set1_ps(m);
        __m256 acc = _mm256_setzero_ps();
        for (int j = 0; j < nk8; j += 8) {
            const __m256 p = exp_le0(_mm256_sub_ps(_mm256_loadu_ps(Sr + j), mv));
            _mm256_storeu_ps(Sr + j, p);
            acc = _mm256_add_ps(acc, p);
        }
        b->pm[r] = m;
        b->pl[r] = hsum8(acc);
    }
    /* P V */
#if ST_HAVE_AVX512
    if (t->wide) {
        for (int r = 0; r < R;) {
            const int rb = R - r >= PV_RB_W ? PV_RB_W : R - r;
            int jn = 0;
            for (int i = 0; i < rb; i++) jn = vis[r + i] > jn ? vis[r + i] : jn;
            for (int c0 = 0; c0 < hv; c0 += 64) {
                const int nv = (hv - c0) / 16 < 4 ? (hv - c0) / 16 : 4;
                pv_rows_wide(b->S + (size_t)r * sw, sw, Vp, hv, jn, b->pa + (size_t)r * hv, c0, nv, rb);
            }
            r += rb;
        }
        return;
    }
#endif
    for (int r = 0; r < R;) {
        const int rb = R - r >= PV_RB ? PV_RB : R - r;
        int jn = 0;
        for (int i = 0; i < rb; i++) jn = vis[r + i] > jn ? vis[r + i] : jn;
        for (int c0 = 0; c0 < hv; c0 += 32) {
            const int nv = (hv - c0) / 8 < 4 ? (hv - c0) / 8 : 4;
            float *a = b->pa + (size_t)r * hv;
            const float *P = b->S + (size_t)r * sw;
            if (rb == 3) pv_rows_3(P, sw, Vp, hv, jn, a, c0, nv);
            else if (rb == 2) pv_rows_2(P, sw, Vp, hv, jn, a, c0, nv);
            else pv_rows_1(P, sw, Vp, hv, jn, a, c0, nv);
        }
        r += rb;
    }
}

/* Merge partial row r (m, l, a) into the running row (M, L, A); first says the running row is empty. */
static inline void merge_row(float *M, float *L, float *A, float m, float l, const float *a, int hv, int first) {
    if (l == 0.0f) return;
    if (first || *L == 0.0f) {
        *M = m; *L = l;
        memcpy(A, a, (size_t)hv * sizeof(float));
        return;
    }
    const float mx = m > *M ? m : *M;
    const float c1 = expf(*M - mx), c2 = expf(m - mx);
    const __m256 v1 = _mm256_set1_ps(c1), v2 = _mm256_set1_ps(c2);
    for (int i = 0; i < hv; i += 8)
        _mm256_storeu_ps(A + i, _mm256_fmadd_ps(_mm256_loadu_ps(A + i), v1, _mm256_mul_ps(_mm256_loadu_ps(a + i), v2)));
    *L = *L * c1 + l * c2;
    *M = mx;
}

static void write_out(const at_task *t, int h, int64_t i0, int R, const float *L, const float *A) {
    for (int r = 0; r < R; r++) {
        float *o = t->out + ((i0 + r / t->g) * t->n_head + (int64_t)h * t->g + r % t->g) * t->hv;
        const __m256 inv = _mm256_set1_ps(1.0f / L[r]);
        for (int i = 0; i < t->hv; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(A + (size_t)r * t->hv + i), inv));
    }
}

static inline int64_t block_segs(const at_task *t, int64_t blk) {
    int64_t i1 = (blk + 1) * t->qb;
    if (i1 > t->n) i1 = t->n;
    return (t->start + i1 - 1) / t->ps + 1;
}

/* prefill: one item = (KV head, row block); segments in a loop, merged as they come */
static void at_worker_seq(void *arg, int ith, int nth) {
    (void)ith; (void)nth;
    at_task *t = (at_task *)arg;
    at_buf b;
    if (!buf_alloc(&b, t)) return; /* another thread finishes the items */
    for (;;) {
        const int64_t it = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed);
        if (it >= t->n_items) break;
        /* latest (most expensive) blocks first */
        const int64_t blk = t->n_blocks - 1 - it / t->n_kv;
        const int h = (int)(it % t->n_kv);
        int64_t i0;
        const int R = load_queries(t, &b, h, blk, &i0);
        const int64_t ns = block_segs(t, blk);
        for (int r = 0; r < R; r++) b.L[r] = 0.0f;
        for (int64_t s = 0; s < ns; s++) {
            seg_partial(t, &b, h, i0, R, s);
            for (int r = 0; r < R; r++)
                merge_row(b.M + r, b.L + r, b.A + (size_t)r * t->hv, b.pm[r], b.pl[r], b.pa + (size_t)r * t->hv, t->hv, s == 0);
        }
        write_out(t, h, i0, R, b.L, b.A);
    }
    free(b.kt);
}

/* decode: one item = (KV head, row block, segment) into scratch; merged afterwards */
static void at_worker_split(void *arg, int ith, int nth) {
    (void)ith; (void)nth;
    at_task *t = (at_task *)arg;
    at_buf b;
    if (!buf_alloc(&b, t)) return;
    for (;;) {
        const int64_t it = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed);
        if (it >= t->n_items) break;
        const int64_t s = it % t->n_segs;
        const int64_t hb = it / t->n_segs;
        const int h = (int)(hb % t->n_kv);
        const int64_t blk = hb / t->n_kv;
        float *dst = t->scratch + it * t->item_floats;
        int64_t i0;
        const int R = load_queries(t, &b, h, blk, &i0);
        if (s >= block_segs(t, blk)) {
            for (int r = 0; r < R; r++) dst[R + r] = 0.0f;
            continue;
        }
        b.pm = dst; b.pl = dst + R; b.pa = dst + 2 * R;
        seg_partial(t, &b, h, i0, R, s);
    }
    free(b.kt);
}

int strata_attention(const float *q, int64_t n, int n_head, int n_kv, int hd, int hv,
                     const float *K, const float *V, int64_t pool_pages, int page_size,
                     const int32_t *pages, int64_t n_seq_pages, int64_t start, float scale,
                     const float *k_new, int64_t k_stride, const float *v_new, int64_t v_stride,
                     float *out, int n_threads) {
    if (!strata_cpu_has_avx2()) return ST_ERR_TYPE;
    if (n <= 0 || n_head <= 0 || n_kv <= 0 || n_head % n_kv || hd <= 0 || hv <= 0 || hd % 8 || hv % 8 ||
        page_size <= 0 || start < 0 || (start + n + page_size - 1) / page_size > n_seq_pages)
        return ST_ERR_SHAPE;
    for (int64_t i = 0; i < (start + n + page_size - 1) / page_size; i++)
        if (pages[i] < 0 || pages[i] >= pool_pages) return ST_ERR_INDEX;
    /* store the new tokens' K/V (when given) at positions [start, start + n) */
    if (k_new && v_new) {
        for (int64_t i = 0; i < n; i++) {
            const int64_t p = start + i, page = pages[p / page_size], off = p % page_size;
            for (int h = 0; h < n_kv; h++) {
                memcpy((float *)K + ((h * pool_pages + page) * page_size + off) * hd, k_new + i * k_stride + (int64_t)h * hd,
                       (size_t)hd * sizeof(float));
                memcpy((float *)V + ((h * pool_pages + page) * page_size + off) * hv, v_new + i * v_stride + (int64_t)h * hv,
                       (size_t)hv * sizeof(float));
            }
        }
    }
    at_task t;
    memset(&t, 0, sizeof t);
    t.q = q; t.n = n; t.n_head = n_head; t.n_kv = n_kv; t.hd = hd; t.hv = hv; t.g = n_head / n_kv;
    t.K = K; t.V = V; t.pool_pages = pool_pages; t.ps = page_size; t.pages = pages; t.start = start;
    t.scale = scale; t.out = out;
#if ST_HAVE_AVX512
    t.wide = hv % 16 == 0 && strata_cpu_has_avx512() && !strcmp(strata_cpu_path(), "avx512");
#endif
    t.qb = 48 / t.g;
    if (t.qb < 1) t.qb = 1;
    if (t.qb * t.g > ROWS_MAX) return ST_ERR_SHAPE;
    if (t.qb > n) t.qb = (int)n;
    t.n_blocks = (n + t.qb - 1) / t.qb;
    t.n_segs = (start + n - 1) / page_size + 1;
    int nth = n_threads < 1 ? 1 : n_threads;
    /* small work: one thread (waking workers costs more) */
    const double work = (double)n * (double)(start + n) * n_head * (hd + hv);
    if (work < 2e5) nth = 1;
    atomic_init(&t.next, 0);
    if (t.n_blocks * n_kv < 2 * nth && t.n_segs > 1) {
        const int R = t.qb * t.g;
        t.split = 1;
        t.item_floats = (int64_t)R * (2 + hv);
        t.n_items = t.n_blocks * n_kv * t.n_segs;
        t.scratch = (float *)malloc((size_t)(t.n_items * t.item_floats) * sizeof(float));
        if (!t.scratch) return ST_ERR_NOMEM;
        st_run_task(at_worker_split, &t, nth);
        if (atomic_load(&t.next) < t.n_items) at_worker_split(&t, 0, 1); /* a failed allocation left items */
        float *M = (float *)malloc((size_t)R * (2 + hv) * sizeof(float));
        if (!M) { free(t.scratch); return ST_ERR_NOMEM; }
        float *L = M + R, *A = L + R;
        for (int64_t blk = 0; blk < t.n_blocks; blk++) {
            const int64_t i0 = blk * t.qb;
            const int Rb = (int)((i0 + t.qb < n ? t.qb : n - i0) * t.g);
            for (int h = 0; h < n_kv; h++) {
                for (int r = 0; r < Rb; r++) L[r] = 0.0f;
                const int64_t ns = block_segs(&t, blk);
                for (int64_t s = 0; s < ns; s++) {
                    const float *p = t.scratch + ((blk * n_kv + h) * t.n_segs + s) * t.item_floats;
                    for (int r = 0; r < Rb; r++)
                        merge_row(M + r, L + r, A + (size_t)r * hv, p[r], p[Rb + r], p + 2 * Rb + (size_t)r * hv, hv, s == 0);
                }
                write_out(&t, h, i0, Rb, L, A);
            }
        }
        free(M);
        free(t.scratch);
    } else {
        t.n_items = t.n_blocks * n_kv;
        st_run_task(at_worker_seq, &t, nth);
        if (atomic_load(&t.next) < t.n_items) at_worker_seq(&t, 0, 1);
    }
    return ST_OK;
}

#include "target_end.inc"

#else /* not x86-64 */

int strata_attention(const float *q, int64_t n, int n_head, int n_kv, int hd, int hv,
                     const float *K, const float *V, int64_t pool_pages, int page_size,
                     const int32_t *pages, int64_t n_seq_pages, int64_t start, float scale,
                     const float *k_new, int64_t k_stride, const float *v_new, int64_t v_stride,
                     float *out, int n_threads) {
    (void)q; (void)n; (void)n_head; (void)n_kv; (void)hd; (void)hv; (void)K; (void)V; (void)pool_pages;
    (void)page_size; (void)pages; (void)n_seq_pages; (void)start; (void)scale; (void)out; (void)n_threads;
    (void)k_new; (void)k_stride; (void)v_new; (void)v_stride;
    return ST_ERR_TYPE;
}

#endif
