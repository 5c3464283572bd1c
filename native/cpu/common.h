/* Strata C core: GGUF block layouts (per ggml-common.h), activation block formats and the kernel table. */
#ifndef STRATA_COMMON_H
#define STRATA_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* GGML type ids (ggml.h enum ggml_type; gguf.GGMLQuantizationType). */
enum {
    ST_F32 = 0, ST_F16 = 1, ST_Q4_0 = 2, ST_Q4_1 = 3, ST_Q5_0 = 6, ST_Q5_1 = 7, ST_Q8_0 = 8,
    ST_Q2_K = 10, ST_Q3_K = 11, ST_Q4_K = 12, ST_Q5_K = 13, ST_Q6_K = 14, ST_Q8_K = 15,
    ST_IQ2_XXS = 16, ST_IQ2_XS = 17, ST_IQ3_XXS = 18, ST_IQ1_S = 19, ST_IQ4_NL = 20, ST_IQ3_S = 21, ST_IQ2_S = 22,
    ST_IQ4_XS = 23, ST_IQ1_M = 29, ST_BF16 = 30,
    ST_N_TYPES = 31
};

#define QK32 32
#define QK_K 256
#define K_SCALE_SIZE 12

typedef uint16_t st_half;

/* Weight blocks, byte-for-byte as in ggml-common.h. */
typedef struct { st_half d; uint8_t qs[QK32 / 2]; } block_q4_0;                  /* 18 B */
typedef struct { st_half d; st_half m; uint8_t qs[QK32 / 2]; } block_q4_1;       /* 20 B */
typedef struct { st_half d; uint8_t qh[4]; uint8_t qs[QK32 / 2]; } block_q5_0;   /* 22 B */
typedef struct { st_half d; st_half m; uint8_t qh[4]; uint8_t qs[QK32 / 2]; } block_q5_1; /* 24 B */
typedef struct { st_half d; int8_t qs[QK32]; } block_q8_0;                       /* 34 B */
typedef struct { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; st_half d; st_half dmin; } block_q2_K; /* 84 B */
typedef struct { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; st_half d; } block_q3_K; /* 110 B */
typedef struct { st_half d; st_half dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; } block_q4_K; /* 144 B */
typedef struct { st_half d; st_half dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } block_q5_K; /* 176 B */
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; st_half d; } block_q6_K; /* 210 B */
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; } block_q8_K; /* 292 B */
/* The IQ types (grids and value tables in iq_tables.h). */
typedef struct { st_half d; uint16_t qs[QK_K / 8]; } block_iq2_xxs;                                   /* 66 B */
typedef struct { st_half d; uint16_t qs[QK_K / 8]; uint8_t scales[QK_K / 32]; } block_iq2_xs;         /* 74 B */
typedef struct { st_half d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t scales[QK_K / 32]; } block_iq2_s; /* 82 B */
typedef struct { st_half d; uint8_t qs[3 * QK_K / 8]; } block_iq3_xxs;                                /* 98 B */
typedef struct { st_half d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t signs[QK_K / 8];
                 uint8_t scales[QK_K / 64]; } block_iq3_s;                                            /* 110 B */
typedef struct { st_half d; uint8_t qs[QK_K / 8]; uint16_t qh[QK_K / 32]; } block_iq1_s;              /* 50 B */
typedef struct { uint8_t qs[QK_K / 8]; uint8_t qh[QK_K / 16]; uint8_t scales[QK_K / 32]; } block_iq1_m; /* 56 B */
typedef struct { st_half d; uint8_t qs[QK32 / 2]; } block_iq4_nl;                                     /* 18 B */
typedef struct { st_half d; uint16_t scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; } block_iq4_xs; /* 136 B */

/* Activation block for the 32-element weight types: Q8_0 values with an fp32 scale and the
 * pre-scaled block sum s = d * sum(qs) (ggml's Q8_1 idea, used for the Q4_1/Q5_1 minimum and the
 * Q4_0/Q5_0 offset). Internal format, never stored. */
typedef struct { float d; float s; int8_t qs[QK32]; } block_a8;                  /* 40 B */

/* fp16 -> fp32 table (65536 entries), filled once by strata_init(). */
extern float st_fp16_table[65536];
static inline float st_h2f(st_half h) { return st_fp16_table[h]; }
float st_h2f_compute(uint16_t h);

static inline float st_bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f;
}

static inline int st_nearest_int(float fval) {
    /* round half away from zero for |fval| <= 2^22 (ggml's nearest_int rounds half to even; either is
     * a valid Q8 activation rounding). */
    return (int)(fval >= 0.0f ? fval + 0.5f : fval - 0.5f);
}

enum { ACT_A8 = 1, ACT_Q8K = 2 };

/* Tokens processed together per weight row in one kernel call (weights unpacked once per block); a kernel set
 * may take up to ST_NT_MAX for a type (st_kernels.nt). */
#define ST_NT 4
#define ST_NT_MAX 8

/* dot_nt: out[t * out_stride] = dot(weight row w (nb blocks), activation row t) for t < nt (nt <= the type's
 * st_kernels.nt, ST_NT when 0).
 * act points at the first activation row; rows are act_stride bytes apart. */
typedef void (*st_dot_fn)(int nb, const void *w, const void *act, size_t act_stride, int nt,
                          float *out, size_t out_stride);
/* dot2: the same for two weight rows w and w + w_stride: out[t * out_stride + r] for r = 0, 1 (optional). */
typedef void (*st_dot2_fn)(int nb, const void *w, size_t w_stride, const void *act, size_t act_stride, int nt,
                           float *out, size_t out_stride);
typedef void (*st_dequant_fn)(const void *src, float *dst, int64_t n);
typedef void (*st_quant_act_fn)(const float *x, void *dst, int64_t n);

/* A short read's activation rows repacked for the column kernels (AVX-512) of the 32-element types: tokens in
 * pairs, the pair's block b as 64 bytes with the two tokens' 4-byte groups interleaved (t0 g0, t1 g0, t0 g1, ...,
 * t1 g7), so that one 512-bit multiply-add gives both tokens' 8 lane sums; per block the tokens' d and s
 * (block_a8's), 8 floats readable past the last token; for Q8_0, each pair's 16 group sums times -128 (the
 * unsigned shift of the weight bytes taken back). A padding token of an odd count is all zeros. */
typedef struct {
    int nb, n_pairs, d_stride;     /* d_stride: floats per block in d and s (2 * n_pairs rounded up, + 8) */
    const int8_t *qs;              /* [nb][n_pairs][64] */
    const int32_t *neg;            /* [nb][n_pairs][16], or NULL when the type needs none */
    const float *d, *s;            /* [nb][d_stride] */
} st_cols;

/* Column kernel: rows w .. w + (nr - 1) * w_stride (nr <= ST_COLS_ROWS) against the token pairs [p0, p0 + np)
 * (np <= ST_COLS_PAIRS) of c: out[t * out_stride + r] for the tokens t < nt of those pairs (t counted from 2 * p0).
 * Each (row, token) is reduced exactly as the type's dot reduces that token alone. */
#define ST_COLS_ROWS 2
#define ST_COLS_PAIRS 8
typedef void (*st_dot_cols_fn)(const void *w, size_t w_stride, int nr, const st_cols *c, int p0, int np, int nt,
                                float *out, size_t out_stride);

/* unpack: weight row w's nb blocks -> nb blocks of the kernel set's unpacked form (st_kernels.unpacked_bytes each,
 * at dst); dot_unpacked: dot_nt reading such a row, every token's result equal to dot's on the packed row. Optional
 * (the IQ grid types of the AVX2-class sets, F16 and BF16 everywhere): a product of more than one tile of tokens
 * unpacks each row once and runs every tile over it.
 *
 * Float weights (F32, F16, BF16): the block is one element (nb = n_in), the activations are the float32 rows
 * themselves (no Q8 quantization; act_stride = 4 * n_in) and F16/BF16 rows unpack to float32. */
typedef void (*st_unpack_fn)(int nb, const void *w, void *dst);

typedef struct {
    st_dequant_fn dequant[ST_N_TYPES];
    st_dot_fn dot[ST_N_TYPES];
    st_dot2_fn dot2[ST_N_TYPES];
    st_quant_act_fn quant_a8;
    st_quant_act_fn quant_q8k;
    st_dot_cols_fn dot_cols[ST_N_TYPES]; /* optional: short reads of 2 or more tokens (st_cols activations) */
    st_unpack_fn unpack[ST_N_TYPES];     /* optional, with dot_unpacked and unpacked_bytes */
    st_dot_fn dot_unpacked[ST_N_TYPES];
    st_dot2_fn dot2_unpacked[ST_N_TYPES]; /* optional, with unpack: two unpacked rows at a time */
    uint16_t unpacked_bytes[ST_N_TYPES];
    uint8_t nt[ST_N_TYPES];              /* tokens per dot call, at most ST_NT_MAX (0: ST_NT) */
    const char *name;
} st_kernels;

/* Run fn(arg, ith, nth) on up to nth pool threads, the caller being ith 0 (core.c); fn must share out its
 * work through atomic counters so that any subset of the threads completes it. */
void st_run_task(void (*fn)(void *arg, int ith, int nth), void *arg, int nth);

const st_kernels *st_kernels_portable(void);
#if defined(__x86_64__) || defined(_M_X64)
const st_kernels *st_kernels_avx2(void);
#endif
/* AVX-VNNI intrinsics and __builtin_cpu_supports("avxvnni"): gcc >= 11, clang >= 13 */
#if (defined(__x86_64__) || defined(_M_X64)) && \
    ((defined(__clang__) && __clang_major__ >= 13) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define ST_HAVE_AVXVNNI 1
const st_kernels *st_kernels_avxvnni(void);
#else
#define ST_HAVE_AVXVNNI 0
#endif
/* AVX-512 (F, BW, VL, DQ, VNNI) with AVX-VNNI: the same compilers */
#define ST_HAVE_AVX512 ST_HAVE_AVXVNNI
#if ST_HAVE_AVX512
const st_kernels *st_kernels_avx512(void);
#endif

#endif
