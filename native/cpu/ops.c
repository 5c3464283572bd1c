/* Strata C core: small per-token ops of the CPU backend (RMSNorm, RoPE, SwiGLU), AVX2+FMA only (ST_ERR_TYPE
 * without it: the backend then uses numpy). They save numpy's per-call overhead in decode; results are
 * deterministic (fixed summation order, no threads). */
#include <math.h>

#include "common.h"
#include "strata_cpu.h"

#if defined(__x86_64__) || defined(_M_X64)

#include "target_avx2_begin.inc"

#include <immintrin.h>

/* RMSNorm (Zhang & Sennrich 2019; llama.cpp ggml_rms_norm): out = x / sqrt(mean(x^2) + eps) * w, per row of
 * dim floats; x (n, dim), optional residual r added first (x + r is also written to sum_out when not NULL). */
int strata_rms_norm(const float *x, const float *r, const float *w, int64_t n, int64_t dim, float eps,
                    float *out, float *sum_out) {
    if (!strata_cpu_has_avx2()) return ST_ERR_TYPE;
    if (n < 0 || dim <= 0) return ST_ERR_SHAPE;
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * dim;
        float *o = out + i * dim;
        if (r) {
            float *s = sum_out ? sum_out + i * dim : o;
            for (int64_t j = 0; j < dim; j++) s[j] = xr[j] + r[i * dim + j];
            xr = s;
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= dim; j += 8) {
            const __m256 v = _mm256_loadu_ps(xr + j);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        a = _mm_add_ps(a, _mm_movehl_ps(a, a));
        a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
        float ss = _mm_cvtss_f32(a);
        for (; j < dim; j++) ss += xr[j] * xr[j];
        const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
        for (j = 0; j < dim; j++) o[j] = (xr[j] * scale) * w[j];
    }
    return ST_OK;
}

/* RoPE (Su et al. 2021, arXiv:2104.09864) on x (n, n_head, hd; tokens x_stride floats apart) -> out (contiguous): the first n_rot dims of each head
 * rotated by angle pos * inv_freq[i] (cos/sin tables (n_table, n_rot/2) indexed by position); NORM pairs
 * (2i, 2i+1), NeoX pairs (i, i + n_rot/2); dims from n_rot on are copied. */
int strata_rope(const float *x, int64_t x_stride, int64_t n, int n_head, int hd, int n_rot, const int64_t *pos,
                const float *cos_t, const float *sin_t, int64_t n_table, int neox, float *out) {
    if (!strata_cpu_has_avx2()) return ST_ERR_TYPE;
    if (n < 0 || n_head <= 0 || hd <= 0 || n_rot <= 0 || n_rot > hd || n_rot % 2) return ST_ERR_SHAPE;
    const int h2 = n_rot / 2;
    for (int64_t i = 0; i < n; i++) {
        if (pos[i] < 0 || pos[i] >= n_table) return ST_ERR_INDEX;
        const float *c = cos_t + pos[i] * h2, *s = sin_t + pos[i] * h2;
        for (int h = 0; h < n_head; h++) {
            const float *xi = x + i * x_stride + (int64_t)h * hd;
            float *o = out + (i * n_head + h) * hd;
            if (neox) {
                for (int k = 0; k < h2; k++) {
                    const float x0 = xi[k], x1 = xi[k + h2];
                    o[k] = x0 * c[k] - x1 * s[k];
                    o[k + h2] = x0 * s[k] + x1 * c[k];
                }
            } else {
                for (int k = 0; k < h2; k++) {
                    const float x0 = xi[2 * k], x1 = xi[2 * k + 1];
                    o[2 * k] = x0 * c[k] - x1 * s[k];
                    o[2 * k + 1] = x0 * s[k] + x1 * c[k];
                }
            }
            for (int k = n_rot; k < hd; k++) o[k] = xi[k];
        }
    }
    return ST_OK;
}

/* exp(x), 8 lanes (Cephes expf: x = n ln2 + r, degree-6 polynomial); x clamped to [-87, 88]. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^fx in two halves so fx = 128 (x near 88) stays finite */
    const __m256i e = _mm256_cvtps_epi32(fx);
    const __m256i e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, _mm256_set1_epi32(127)), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* SwiGLU (Shazeer 2020): out[i, j] = silu(gu[i, j]) * gu[i, ff + j], silu(g) = g / (1 + exp(-g)); gu (n, 2 ff)
 * (gate | up, as the fused projection writes them), or gate/up given separately with row strides. */
int strata_swiglu(const float *gate, const float *up, int64_t n, int64_t ff, int64_t stride, float *out) {
    if (!strata_cpu_has_avx2()) return ST_ERR_TYPE;
    if (n < 0 || ff <= 0 || stride < ff) return ST_ERR_SHAPE;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i++) {
        const float *g = gate + i * stride, *u = up + i * stride;
        float *o = out + i * ff;
        int64_t j = 0;
        for (; j + 8 <= ff; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
        }
        for (; j < ff; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
    return ST_OK;
}

#include "target_end.inc"

#else

int strata_rms_norm(const float *x, const float *r, const float *w, int64_t n, int64_t dim, float eps,
                    float *out, float *sum_out) {
    (void)x; (void)r; (void)w; (void)n; (void)dim; (void)eps; (void)out; (void)sum_out;
    return ST_ERR_TYPE;
}
int strata_rope(const float *x, int64_t x_stride, int64_t n, int n_head, int hd, int n_rot, const int64_t *pos,
                const float *cos_t, const float *sin_t, int64_t n_table, int neox, float *out) {
    (void)x; (void)x_stride; (void)n; (void)n_head; (void)hd; (void)n_rot; (void)pos; (void)cos_t; (void)sin_t; (void)n_table;
    (void)neox; (void)out;
    return ST_ERR_TYPE;
}
int strata_swiglu(const float *gate, const float *up, int64_t n, int64_t ff, int64_t stride, float *out) {
    (void)gate; (void)up; (void)n; (void)ff; (void)stride; (void)out;
    return ST_ERR_TYPE;
}

#endif
