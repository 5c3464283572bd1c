/* Strata C core: public C API (native/build_cpu.py reads its declarations as the cffi cdef). */
#ifndef STRATA_CPU_H
#define STRATA_CPU_H
#include <stdint.h>

/* Error codes returned by the functions below (0 = success). */
#define ST_OK 0
#define ST_ERR_TYPE (-1)   /* unsupported GGML type for this operation */
#define ST_ERR_SHAPE (-2)  /* n_in not a multiple of the block size, or non-positive sizes */
#define ST_ERR_INDEX (-3)  /* a row id out of range */
#define ST_ERR_NOMEM (-4)

const char *strata_cpu_path(void);                 /* "avx512", "avxvnni", "avx2" or "portable" */
int strata_cpu_set_path(const char *name);         /* "auto" | "avx512" | "avxvnni" | "avx2" | "portable"; -1 if unsupported */
int strata_cpu_has_avx2(void);
int strata_cpu_has_avxvnni(void);
int strata_cpu_has_avx512(void);                   /* AVX-512 F/BW/VL/DQ/VNNI and AVX-VNNI */
int strata_block_size(int type);                   /* elements per block, 0 if unsupported */
int strata_type_size(int type);                    /* bytes per block, 0 if unsupported */
int strata_can_matmul(int type);                   /* 1 if strata_matmul supports the type */
void strata_park_workers(void);                    /* idle workers stop spinning and sleep now */
int strata_dequantize(int type, const void *src, int64_t src_row_bytes, int64_t n_rows, int64_t n_in,
                      float *dst, int n_threads);
int strata_get_rows(int type, const void *src, int64_t src_row_bytes, int64_t n_rows, int64_t n_in,
                    const int64_t *ids, int64_t n_ids, float *dst);
/* y (n_tokens, n_out) = x (n_tokens, n_in) @ W^T. Quantized types: x quantized to Q8 blocks, integer dots; F32, F16
 * and BF16: float32 products of x as it is. Row i of y is bit-identical to the product of x[i] alone, at any
 * n_tokens and n_threads. */
int strata_matmul(int type, const void *w, int64_t w_row_bytes, int64_t n_out, int64_t n_in,
                  const float *x, int64_t n_tokens, float *y, int n_threads);
/* Causal GQA attention over paged float32 K/V (attention.c; AVX2+FMA only: ST_ERR_TYPE without it).
 * q (n, n_head, hd) at positions start.., K (n_kv, pool_pages, page_size, hd), V likewise with hv, pages: the
 * sequence's page table (n_seq_pages entries); out (n, n_head, hv). hd and hv multiples of 8. When k_new and
 * v_new are not NULL, the new tokens' K/V ((n, n_kv, hd|hv), tokens k_stride/v_stride floats apart) are stored at
 * positions [start, start + n) first. */
int strata_attention(const float *q, int64_t n, int n_head, int n_kv, int hd, int hv,
                     const float *K, const float *V, int64_t pool_pages, int page_size,
                     const int32_t *pages, int64_t n_seq_pages, int64_t start, float scale,
                     const float *k_new, int64_t k_stride, const float *v_new, int64_t v_stride,
                     float *out, int n_threads);
/* Per-token ops (ops.c; AVX2+FMA only: ST_ERR_TYPE without it). */
int strata_rms_norm(const float *x, const float *r, const float *w, int64_t n, int64_t dim, float eps,
                    float *out, float *sum_out);
int strata_rope(const float *x, int64_t x_stride, int64_t n, int n_head, int hd, int n_rot, const int64_t *pos,
                const float *cos_t, const float *sin_t, int64_t n_table, int neox, float *out);
int strata_swiglu(const float *gate, const float *up, int64_t n, int64_t ff, int64_t stride, float *out);
#endif
