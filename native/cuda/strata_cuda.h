/* Strata CUDA kernels: plain C launchers (the cffi ABI-mode interface of strata/_cuda_kernels.so).
 *
 * Every launcher takes the CUDA stream first (a cudaStream_t passed as void*; 0 = legacy default stream),
 * then device pointers, then sizes, and returns the cudaError_t of the launch (0 = success).
 * Layouts are row-major. GGML block formats follow ggml/src/ggml-common.h (llama.cpp) and gguf-py's
 * quants.py. ggml_type uses GGML's numbering: F32 0, F16 1, Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14.
 */
#ifndef STRATA_CUDA_H
#define STRATA_CUDA_H
#ifdef __cplusplus
extern "C" {
#endif

/* ---------------- launch.cu: programmatic dependent launch on / off */
/* Programmatic dependent launch (st_launch, launch.cuh) for every launcher but strata_sample and strata_apply_mask: 1
 * on, 0 off (default: on for compute capability >= 9.0; STRATA_CUDA_PDL=0 / 1 in the environment turns it off / on).
 * Set it before capturing a CUDA graph. */
void strata_set_pdl(int on);
int strata_get_pdl(void);

/* ---------------- matvec.cu: f32-activation matvecs, dequantize, get_rows, q8_1 quantize, plain q8 matvec */
/* 1 if ggml_type is supported by the quantized kernels, else 0. */
int strata_supports_type(int ggml_type);

/* y[t, r] = sum_k W[r, k] * x[t, k]: W (n_out rows of packed GGML blocks), x f32 (n_tokens, n_in),
 * y f32 (n_tokens, n_out). n_tokens 1..8 (decode); n_in a multiple of the type's block size. */
int strata_matvec(void *stream, int ggml_type, const void *w, const float *x, float *y,
                  int n_out, int n_in, int n_tokens);

/* Decode matvec on int8 activations: strata_quantize_q8_1 writes x f32 (n_in) as int8 [n_in] followed by float2
 * (d, d * sum q) per block of 32 into xq (n_in + n_in / 4 bytes, 16-byte aligned; llama.cpp quantize_q8_1 with
 * d = max|x| / 127, q = round-to-nearest-even(x / d)). strata_matvec_q8 then computes y f32 (n_out) = W x with
 * __dp4a integer dot products per 32-element sub-block (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; see
 * strata_matvec_q8_supported); W 16-byte aligned. */
int strata_quantize_q8_1(void *stream, const float *x, void *xq, int n_in);
int strata_matvec_q8_supported(int ggml_type);
int strata_matvec_q8(void *stream, int ggml_type, const void *w, const void *xq, float *y, int n_out, int n_in);

/* Dequantize n_rows rows of W to f16 (out_f16 != 0) or f32: out (n_rows, n_in). */
int strata_dequant(void *stream, int ggml_type, const void *w, void *out, int n_rows, int n_in, int out_f16);

/* Embedding lookup: out f32 (n_ids, n_in) = dequantized rows ids[i] of W. ids int32 on the device. */
int strata_get_rows(void *stream, int ggml_type, const void *w, const int *ids, float *out, int n_ids, int n_in);

/* ---------------- matvec_fused.cu: the q8_1 decode matvecs and what they fuse (norms, RoPE + K/V, residual, SwiGLU) */
/* strata_matvec_q8's product with one warp per rows_per_warp (1, 2 or 4) rows: the decode step's matvec. */
int strata_matvec_q8w(void *stream, int ggml_type, const void *w, const void *xq, float *y, int n_out, int n_in,
                      int rows_per_warp);

/* The same product with one block of 4 warps per rows_per_block (1, 2 or 4) rows, its 128 threads splitting each
 * row's sub-blocks: for long rows (n_in >= 4096: the down projection). */
int strata_matvec_q8b(void *stream, int ggml_type, const void *w, const void *xq, float *y, int n_out, int n_in,
                      int rows_per_block);

/* The norm handoff (the decode graph's alternative to the fused norms): x f32 (n_out) += W xq, with strata_matvec_q8w
 * (block 0, rows_per_warp = rows) or strata_matvec_q8b (block != 0, rows_per_block = rows). norm_w != NULL (f32,
 * n_out): the matvec also writes the next RMSNorm's input for its consumer, per 32-row group of x once the group is
 * complete: x_q8 = q8_1 blocks of x * norm_w (n_out int8, then n_out / 32 float2 (d, d * sum q)) and x_ss f32
 * (n_out / 32) the group's sum of x^2; counters (n_out / 32 uint32) must be zero and are left zero. The consumer
 * (strata_matvec_q8w_rope / strata_matvec_q8w_glu_norm with norm_ss = x_ss, xq = x_q8) scales its dot products by
 * 1 / sqrt(sum(x_ss) / n + eps): RMSNorm (Zhang & Sennrich 2019) with the norm's scale moved past the product;
 * a consumer takes n <= 4096. x, x_q8 and x_ss must not alias xq (other blocks still read it while the handoff
 * writes). cudaErrorInvalidValue for a NULL x, or with norm_w a NULL x_q8 / x_ss / counters or n_out % 32 != 0, or
 * what strata_matvec_q8w / _q8b refuse; cudaErrorMisalignedAddress for x_q8 not 8-byte aligned. */
int strata_matvec_q8_resid(void *stream, int ggml_type, const void *w, const void *xq, int n_out, int n_in, int rows,
                           int block, float *x, const float *norm_w, void *x_q8, float *x_ss, unsigned *counters);

/* The norm handoff of a whole vector x f32 (n, % 32 == 0): x_q8 / x_ss as strata_matvec_q8_resid writes them.
 * cudaErrorInvalidValue for a NULL pointer or n % 32 != 0; cudaErrorMisalignedAddress for x_q8 not 8-byte aligned. */
int strata_norm_q8(void *stream, const float *x, const float *w, void *x_q8, float *x_ss, int n);

/* SwiGLU fused into the gate/up product: act f32 (F) = silu(Wg x) * (Wu x) and its q8_1 blocks act_q8 (F + F / 4
 * bytes, as strata_swiglu_gu; act may be NULL); F % 32 == 0; pairs_per_warp 1, 2 or 4 (block = 32 / it warps). */
int strata_matvec_q8w_glu(void *stream, int ggml_type, const void *w_gate, const void *w_up, const void *xq, float *act,
                          void *act_q8, int F, int n_in, int pairs_per_warp);

/* strata_matvec_q8w_glu with the RMSNorm that produces x fused into its prologue (norm_w != NULL; xq unused): the
 * inputs, bounds (n_in <= 8 * 4 * the block's 32 * (32 / pairs_per_warp) threads) and errors of
 * strata_matvec_q8w_rope's fused norm; or handed off (norm_ss != NULL, the four norm pointers NULL, xq the handoff's
 * x_q8, n_in <= 4096: see strata_matvec_q8_resid), the gate and up products scaled by 1 / rms before SwiGLU (each
 * lane's partial products, before the warp's sum: measured against transformers in that form). */
int strata_matvec_q8w_glu_norm(void *stream, int ggml_type, const void *w_gate, const void *w_up, const void *xq,
                               float *act, void *act_q8, int F, int n_in, int pairs_per_warp, const float *norm_x,
                               const float *norm_delta, const float *norm_w, float *norm_x_out, float eps,
                               const float *norm_ss);

/* 1 when the two fused-norm decode matvecs can run a layer with these shapes on the current device: QKV weights of
 * type t_qkv (rows_per_warp 1 / 2 / 4) and gate / up weights of type t_gate_up (pairs_per_warp) over n_in columns
 * (% 32 == 0, <= 4096, whole blocks of both types), their staged rows and x's q8_1 blocks fitting the shared memory
 * a block may take (48 KB for QKV; the device's opt-in limit for gate / up); else 0 (the plan keeps separate norms). */
int strata_fused_norm_supported(int t_qkv, int t_gate_up, int n_in, int rows_per_warp, int pairs_per_warp);

/* The decode step's QKV matvec with strata_rope_kv_decode fused into its epilogue (adjacent RoPE pairs only, i.e.
 * neox = 0; f16 cache): qkv f32 [q (n_head*hd) | k | v] = W (fused Q|K|V rows, ggml type t, n_in columns) . x (q8_1
 * blocks of strata_quantize_q8_1), q and k rotated at position *pos, k and v written to the paged cache at *pos.
 * Same values, bit for bit, as strata_matvec_q8w followed by strata_rope_kv_decode. pre_wait != 0: no kernel earlier
 * in the stream's chain of programmatic dependent launches writes *pos or the page table (in a decode graph only the
 * last launch advances them), so the epilogue's angles and cache slots are computed before the PDL wait, off the
 * dependent chain.
 * Fused RMSNorm (norm_w != NULL; xq is then unused): every block computes x = RMSNorm(norm_x + norm_delta) * norm_w
 * (norm_delta may be NULL) itself, as q8_1 in shared memory, and block 0 stores norm_x + norm_delta to norm_x_out
 * (may be NULL; must not alias norm_x or norm_delta); n_in % 32 == 0, n_in <= 4096, the four f32 vectors 16-byte
 * aligned. Same per-element arithmetic as strata_rms_norm_ex's q8_1 output (the sum of squares in another order).
 * cudaErrorInvalidValue for odd hd / n_rot, n_rot > hd, a NULL cache or position, a fused norm out of those bounds
 * or whose staged rows exceed the device's shared memory (strata_fused_norm_supported), or what strata_matvec_q8w
 * refuses; cudaErrorMisalignedAddress for a misaligned vector.
 * Handed-off norm (norm_ss != NULL, the norm_x / delta / w / x_out pointers NULL, n_in <= 4096): xq holds q8_1(x *
 * w) and norm_ss its groups' sums of x^2 (strata_matvec_q8_resid); every dot product is scaled by
 * 1 / sqrt(sum(norm_ss) / n_in + eps) before RoPE. */
int strata_matvec_q8w_rope(void *stream, int ggml_type, const void *w, const void *xq, float *qkv, int n_head, int n_kv,
                           int hd, int n_in, int rows_per_warp, const int *pos, void *k_cache, void *v_cache,
                           const int *page_table, int n_rot, float base, int page_size, const float *norm_x,
                           const float *norm_delta, const float *norm_w, float *norm_x_out, float eps, int pre_wait,
                           const float *norm_ss);

/* ---------------- matvec_cols.cu: the short read's matvecs over n_cols columns (1..16), each column bit-identical to
 * the decode matvec named on the same vector. Column c of a q8_1 vector of n values (input xq, or an output: x_q8,
 * act_q8) starts at byte c * strata_q8_col_bytes(n), 16-byte aligned (n int8, then n / 32 float2 (d, d * sum q));
 * of an f32 vector of n values (y, x, qkv, act) at element c * n; of the sums of squares (x_ss, norm_ss) at c * (n /
 * 32). Errors: those of the decode launcher mirrored, and cudaErrorInvalidValue for n_cols outside 1..16. */
/* Bytes of one column of a q8_1 vector of n values (n % 32 == 0), else -1. */
int strata_q8_col_bytes(int n);

/* strata_norm_q8 per column: x (n_cols, n) f32 -> x_q8[c], x_ss[c]. */
int strata_mvc_norm_q8(void *stream, const float *x, const float *w, void *x_q8, float *x_ss, int n, int n_cols);

/* strata_matvec_q8w per column: y[c] = W xq[c], column c of y at element c * y_stride (>= n_out). */
int strata_mvc_q8w(void *stream, int ggml_type, const void *w, const void *xq, float *y, int y_stride, int n_out,
                   int n_in, int n_cols);

/* strata_matvec_q8b per column: y[c] = W xq[c], one block per row, column c of y at element c * y_stride. */
int strata_mvc_q8b(void *stream, int ggml_type, const void *w, const void *xq, float *y, int y_stride, int n_out,
                   int n_in, int n_cols);

/* strata_matvec_q8_resid per column (block: the q8b form): x[c] += W xq[c] and, with norm_w, each column's handoff
 * (x_q8[c], x_ss[c]); counters (n_out / 32 uint32, zero, left zero) are shared by the columns. */
int strata_mvc_q8_resid(void *stream, int ggml_type, const void *w, const void *xq, int n_out, int n_in, int n_cols,
                        int block, float *x, const float *norm_w, void *x_q8, float *x_ss, unsigned *counters);

/* strata_matvec_q8w_rope per column without a fused norm: column c at position pos[c] (n_cols positions on the
 * device), its K / V into the paged cache through page_table + c * pt_stride (0: one sequence's columns); norm_ss
 * (may be NULL): the handed-off input norm of each column. */
int strata_mvc_q8w_rope(void *stream, int ggml_type, const void *w, const void *xq, float *qkv, int n_head, int n_kv,
                        int hd, int n_in, int n_cols, const int *pos, void *k_cache, void *v_cache,
                        const int *page_table, int pt_stride, int n_rot, float base, int page_size, float eps,
                        const float *norm_ss);

/* strata_matvec_q8w_glu_norm per column without a fused norm: act[c] (may be NULL) and act_q8[c] (may be NULL, not
 * both) from xq[c]; norm_ss (may be NULL): the handed-off input norm of each column. */
int strata_mvc_q8w_glu(void *stream, int ggml_type, const void *w_gate, const void *w_up, const void *xq, float *act,
                       void *act_q8, int F, int n_in, int n_cols, float eps, const float *norm_ss);

/* ---------------- norm.cu: RMSNorm with the residual add */
/* RMSNorm fused with the residual add: s = x + residual (residual may be NULL: s = x);
 * sum_out (may be NULL) = s; out = s / sqrt(mean(s^2) + eps) * weight. All f32, (n_rows, dim). */
int strata_rms_norm(void *stream, const float *x, const float *residual, const float *weight,
                    float *out, float *sum_out, int n_rows, int dim, float eps);

/* strata_rms_norm with more outputs, each optional: out f32, sum_out f32 (x + residual), out16 f16 (n_rows, dim),
 * out_q8 q8_1 blocks (n_rows == 1, dim % 32 == 0; layout of strata_quantize_q8_1). Both launchers read `weight`
 * before the programmatic-dependent-launch wait (it overlaps the previous kernel): weight must not be written by
 * the kernel launched just before on the stream (model norm weights are constants). */
int strata_rms_norm_ex(void *stream, const float *x, const float *residual, const float *weight, float *out,
                       float *sum_out, void *out16, void *out_q8, int n_rows, int dim, float eps);

/* strata_rms_norm_ex over n_rows rows with q8_1 blocks per row (the short read's columns): row r's at out_q8 + r *
 * q8_stride bytes (>= dim + dim / 4; dim % 32 == 0, <= 8192); every row bit-identical to strata_rms_norm_ex on it
 * alone. */
int strata_rms_norm_rows(void *stream, const float *x, const float *residual, const float *weight, float *out,
                         float *sum_out, void *out_q8, long long q8_stride, int n_rows, int dim, float eps);

/* ---------------- rope_act.cu: RoPE (alone and with the K/V cache write), SwiGLU */
/* RoPE in place on x f32 (n_tokens, n_heads, head_dim): position positions[t] (int32, device);
 * rotates the first n_rot dims; neox != 0 pairs (i, i + n_rot/2), else (2i, 2i+1). theta_i = pos * base^(-2i/n_rot). */
int strata_rope(void *stream, float *x, const int *positions, int n_tokens, int n_heads, int head_dim,
                int n_rot, float base, int neox);

/* out = silu(gate) * up, f32, n elements. */
int strata_swiglu(void *stream, const float *gate, const float *up, float *out, long long n);

/* SwiGLU of a fused gate|up buffer gu f32 (n, 2F): silu(gu[t, :F]) * gu[t, F:] into any of out f32 (n, F),
 * out16 f16 (n, F), out_q8 q8_1 blocks (n == 1, F % 32 == 0). */
int strata_swiglu_gu(void *stream, const float *gu, int n, int F, float *out, void *out16, void *out_q8);

/* strata_swiglu_gu over n rows with q8_1 blocks per row: row t's at out_q8 + t * q8_stride bytes (>= F + F / 4;
 * F % 32 == 0); every row bit-identical to strata_swiglu_gu on it alone. */
int strata_swiglu_gu_rows(void *stream, const float *gu, int n, int F, float *out, void *out_q8, long long q8_stride);

/* Decode step, fused: RoPE on q and k of qkv f32 [q (n_head*hd) | k (n_kv*hd) | v (n_kv*hd)] of one token at
 * position *pos (in place), then k (rotated) and v written to the paged f16 cache at *pos. */
int strata_rope_kv_decode(void *stream, float *qkv, const int *pos, void *k_cache, void *v_cache, const int *page_table,
                          int n_head, int n_kv, int hd, int n_rot, float base, int neox, int page_size);

/* strata_rope_kv_decode over n rows (the short read): row r's qkv at qkv + r * q_stride, its position pos[r]; every
 * row bit-identical to strata_rope_kv_decode on it. n <= 65535. */
int strata_rope_kv_rows(void *stream, float *qkv, long long q_stride, const int *pos, void *k_cache, void *v_cache,
                        const int *page_table, int n, int n_head, int n_kv, int hd, int n_rot, float base, int neox,
                        int page_size);

/* Prefill, fused: RoPE in place on q and k of n tokens' rows of qkv f32 (row stride `stride` floats, layout of
 * strata_rope_kv_decode), token t at position pos0 + t, and k (rotated) / v written to the f16 cache (k_cache
 * NULL: RoPE only, for a q8_0 cache written by strata_kv_write_q8; the same holds for strata_rope_kv_decode). */
int strata_rope_kv_prefill(void *stream, float *qkv, int stride, int pos0, void *k_cache, void *v_cache,
                           const int *page_table, int n, int n_head, int n_kv, int hd, int n_rot, float base, int neox,
                           int page_size);

/* ---------------- copy.cu: batched device copies */
/* n device-to-device copies in one launch: table (device, uint64) holds per copy (dst, src, bytes); max_bytes is
 * the largest bytes (sizes the grid). The copies must not overlap. n <= 65535. */
int strata_copy_many(void *stream, const void *table, int n, long long max_bytes);

/* ---------------- kv_cache.cu: paged KV cache writes and gathers (f16, q8_0) */
/* Write K/V rows of n new tokens into the paged f16 cache.
 * k, v f32 (n, n_kv, hd); cache (n_pages, page_size, n_kv, hd) f16; page_table int32; start at *d_start + start_off
 * (d_start may be NULL: start = start_off). */
int strata_kv_write(void *stream, const float *k, const float *v, void *k_cache, void *v_cache,
                    const int *page_table, const int *d_start, int start_off, int n, int n_kv, int hd, int page_size);

/* Gather the first len positions of the paged f16 cache into contiguous f32 (n_kv, len, hd) for K and V. */
int strata_kv_gather(void *stream, const void *k_cache, const void *v_cache, const int *page_table,
                     float *k_out, float *v_out, int len, int n_kv, int hd, int page_size);

/* q8_0 KV cache (--kv q8_0): per layer int8 K and V (n_pages, page_size, n_kv, hd) and f16 scales
 * (n_pages, page_size, n_kv, hd / 32), element = d * q per 32 values of one (position, head) row (ggml's q8_0
 * block: d = max|x| / 127; q rounded to nearest even). strata_kv_write_q8 quantizes f32 rows of n tokens (k / v row
 * strides in floats, head h at h * hd) into positions (*d_start or 0) + start + t; strata_kv_gather_q8 reads the
 * first len positions back as f32 (n_kv, len, hd). */
int strata_kv_write_q8(void *stream, const float *k, int k_stride, const float *v, int v_stride, void *k_cache,
                       void *v_cache, void *k_scales, void *v_scales, const int *page_table, const int *d_start,
                       int start, int n, int n_kv, int hd, int page_size);
int strata_kv_gather_q8(void *stream, const void *k_cache, const void *v_cache, const void *k_scales,
                        const void *v_scales, const int *page_table, float *k_out, float *v_out, int len, int n_kv,
                        int hd, int page_size);

/* ---------------- attn_decode.cu: decode attention (split-K; GQA-shared) */
/* Decode attention over the paged f16 cache, split-K. q f32 (n_q_tokens=1, n_head, hd); kv length *d_len
 * (device int32) or len if d_len is NULL. partial: f32 scratch of n_head * n_split * (hd + 2).
 * out f32 (n_head, hd). GQA: head h reads kv head h / (n_head / n_kv). hd <= 256, multiple of 32. */
int strata_attn_decode(void *stream, const float *q, const void *k_cache, const void *v_cache,
                       const int *page_table, const int *d_len, int len, float *partial, float *out,
                       int n_head, int n_kv, int hd, int page_size, int n_split, float scale);

/* strata_attn_decode that also writes the output as q8_1 blocks (out_q8: int8 [n_head * hd] then float2 (d, d * sum)
 * per 32, the layout of strata_quantize_q8_1) for the next matvec; out_q8 NULL = strata_attn_decode. counters: NULL
 * (a second launch merges the splits) or n_head uint32, all 0, left 0: the last split block of each head merges it
 * (one launch; the same arithmetic). pre_wait != 0: no kernel earlier in the stream's chain of programmatic
 * dependent launches writes *d_len or the page table (every kernel may pass its launch point before its predecessors
 * end; in a decode graph only the last launch advances them), so they may be read before the PDL wait. */
int strata_attn_decode_ex(void *stream, const float *q, const void *k_cache, const void *v_cache,
                          const int *page_table, const int *d_len, int len, float *partial, float *out, void *out_q8,
                          unsigned *counters, int pre_wait, int n_head, int n_kv, int hd, int page_size, int n_split,
                          float scale);

/* Decode attention (one query token), GQA-shared and self-merging: grid (n_kv, n_split); q f32
 * (n_head * hd); length *d_len (device) or len; ws f32 (n_head * n_split * (hd + 2)); counters uint32 (n_kv),
 * zero before the first call and left zero; out f32 (n_head * hd) and, if out_q8, q8_1 blocks of out. hd 32, 64,
 * 128 or 256; n_head / n_kv <= 8; n_split <= 256. k_scales / v_scales NULL: f16 cache; given: q8_0 cache. */
int strata_attn_decode_gqa(void *stream, const float *q, const void *k_cache, const void *v_cache,
                           const int *page_table, const int *d_len, int len, float *ws, unsigned *counters, float *out,
                           void *out_q8, int n_head, int n_kv, int hd, int page_size, int n_split, float scale,
                           const void *k_scales, const void *v_scales);

/* The short read's rows: n_rows query tokens of one sequence (or of sequences sharing the page table), row r with q at
 * q + r * q_stride, its page table at page_table + r * pt_stride (0: one sequence's rows), its length d_len[r]
 * (device), its split partials at ws / partial + r * ws_stride (>= n_head *
 * n_split * (hd + 2) floats), its merge counters at counters + r * cnt_stride (zero, left zero; >= n_head for
 * strata_attn_rows, >= n_kv for _gqa), its output at out + r * out_stride and q8_1 blocks at out_q8 + r * q8_stride
 * bytes (out_q8 may be NULL): every row bit-identical to strata_attn_decode_ex (with counters) / strata_attn_decode_gqa
 * on that row alone with the same n_split. strata_attn_rows: hd 32, 64, 128 or 256, f16 cache. */
int strata_attn_rows(void *stream, const float *q, long long q_stride, const void *k_cache, const void *v_cache,
                     const int *page_table, long long pt_stride, const int *d_len, float *partial,
                     long long ws_stride, float *out, long long out_stride, void *out_q8, long long q8_stride,
                     unsigned *counters, int cnt_stride, int n_rows, int n_head, int n_kv, int hd, int page_size,
                     int n_split, float scale);
int strata_attn_rows_gqa(void *stream, const float *q, long long q_stride, const void *k_cache, const void *v_cache,
                         const int *page_table, long long pt_stride, const int *d_len, float *ws, long long ws_stride,
                         unsigned *counters, int cnt_stride, float *out, long long out_stride, void *out_q8,
                         long long q8_stride, int n_rows, int n_head, int n_kv, int hd, int page_size, int n_split,
                         float scale, const void *k_scales, const void *v_scales);

/* Blocks of strata_attn_decode_gqa's kernel resident per multiprocessor for head size hd, g query heads per KV head,
 * an f16 (q8 = 0) or q8_0 cache and the current STRATA_CUDA_ATTN_DB variant; a negative cudaError_t for an
 * unsupported shape. */
int strata_attn_decode_gqa_occupancy(int hd, int g, int q8);

/* ---------------- attn_prefill.cu: prefill attention (causal softmax, FlashAttention-2) */
/* Causal softmax in place over rows of s f32 (n_rows_total, len): row r belongs to query i = r % n_q at
 * absolute position pos0 + i; keys j > pos0 + i are masked. s is scaled by scale first. */
int strata_causal_softmax(void *stream, float *s, int n_rows_total, int n_q, int len, int pos0, float scale);

/* Prefill attention, FlashAttention-2 on mma.sync: q f32 rows of n tokens with row stride q_stride
 * floats (head h at h * hd), causal over positions [0, length + n) of the paged cache (f16, or q8_0 when
 * k_scales / v_scales are given); out f32 or out16 f16 (n, n_head, hd); ws f32 (n_split * n_head * n * (hd + 2))
 * when n_split > 1. hd 64 or 128. */
int strata_fa2_prefill(void *stream, const float *q, int q_stride, const void *k_cache, const void *v_cache,
                       const int *page_table, float *out, void *out16, float *ws, int n, int n_head, int n_kv, int hd,
                       int page_size, int length, int n_split, float scale, const void *k_scales,
                       const void *v_scales);

/* ---------------- sampling.cu: argmax, the graph's position counters, sampling, the grammar mask */
/* argmax over each row of x f32 (n_rows, n): out int32 (n_rows). Ties go to the lowest index. */
int strata_argmax(void *stream, const float *x, int *out, int n_rows, int n);

/* Add integer delta to a device int32 scalar (position counters inside CUDA graphs). */
int strata_add_scalar(void *stream, int *p, int delta, int count);

/* Sampling on the device in one block: penalties, top-k, top-p, min-p, temperature, the draw u in
 * [0, 1); out int32[2] <- {token, status} (status 0 ok, 1 NaN in the logits, 2 the candidates overflow the kernel's
 * buffer). counts: token occurrences in the penalty window, or NULL. */
int strata_sample(void *stream, const float *logits, const float *counts, int n, float repeat_penalty,
                  float frequency_penalty, float presence_penalty, float temperature, int top_k, double top_p,
                  float min_p, float log_min_p, double u, int *out);

/* Constrained decoding's token mask: out[i] = logits[i] where bit i of the packed words is set, else
 * -inf (n tokens; out may be logits). */
int strata_apply_mask(void *stream, const float *logits, const unsigned int *words, int n, float *out);

/* ---------------- qwen35.cu: the qwen35 / qwen3next decode plan's one-token kernels */
/* One-token causal depthwise conv + SiLU (gdn.causal_conv1d, n = 1): x f32 (channels) (the first channels of the fused
 * GDN projection), w f32 (channels, kernel), window f32 (kernel - 1, channels) updated in place, y f32 (channels).
 * kernel 2..8. */
int strata_q35_conv(void *stream, const float *x, const float *w, float *window, float *y, int channels, int kernel);

/* strata_q35_conv for n tokens one after the other (the short read's rows): token t's x at x + t * x_stride, its y
 * at y + t * y_stride; every token bit-identical to strata_q35_conv on it after the tokens before. */
int strata_q35_conv_rows(void *stream, const float *x, long long x_stride, const float *w, float *window, float *y,
                         long long y_stride, int n, int channels, int kernel);

/* strata_q35_conv_rows keeping the window after every token (a speculative verify's per-position running state):
 * when keep is not NULL and *keep (a device pointer read by the kernel, so a captured graph serves any buffer) is
 * not NULL, the window after token t is written to *keep + t * keep_stride (kernel - 1, channels). The tokens' y and
 * the final window are those of strata_q35_conv_rows. keep_stride >= (kernel - 1) * channels. */
int strata_q35_conv_rows_keep(void *stream, const float *x, long long x_stride, const float *w, float *window,
                              float *y, long long y_stride, int n, int channels, int kernel, float *const *keep,
                              long long keep_stride);

/* One-token gated delta rule with its prologue: y = conv output [q (n_k*dk) | k (n_k*dk) | v (n_v*dv)]; q, k
 * L2-normalised (l2_eps; q times scale); beta = sigmoid(b), g = A * softplus(a + dt) with b, a read from proj
 * (ba_grouped: qwen3next ssm_ba per key head [b x r, a x r] at b_off; else b at b_off + h, a at a_off + h);
 * state f32 (n_v, dk, dv) in place; out f32 (n_v, dv). tiled: value head h reads key head h % n_k, else h / (n_v/n_k).
 * dk <= 256. */
int strata_q35_gdn_step(void *stream, const float *y, const float *proj, const float *A, const float *dt, float *state,
                        float *out, int n_v, int n_k, int dk, int dv, int tiled, int b_off, int a_off, int ba_grouped,
                        float scale, float l2_eps);

/* strata_q35_gdn_step for n tokens one after the other, the state held in registers between them: token t's y at
 * y + t * y_stride, its proj at proj + t * proj_stride, its out at out + t * out_stride; every token bit-identical to
 * strata_q35_gdn_step on it after the tokens before. */
int strata_q35_gdn_steps(void *stream, const float *y, long long y_stride, const float *proj, long long proj_stride,
                         const float *A, const float *dt, float *state, float *out, long long out_stride, int n,
                         int n_v, int n_k, int dk, int dv, int tiled, int b_off, int a_off, int ba_grouped,
                         float scale, float l2_eps);

/* strata_q35_gdn_steps keeping the state after every token: when keep is not NULL and *keep (a device pointer read
 * by the kernel) is not NULL, the state after token t is written to *keep + t * keep_stride (n_v, dk, dv). Outputs
 * and the final state are those of strata_q35_gdn_steps. keep_stride >= n_v * dk * dv. */
int strata_q35_gdn_steps_keep(void *stream, const float *y, long long y_stride, const float *proj,
                              long long proj_stride, const float *A, const float *dt, float *state, float *out,
                              long long out_stride, int n, int n_v, int n_k, int dk, int dv, int tiled, int b_off,
                              int a_off, int ba_grouped, float scale, float l2_eps, float *const *keep,
                              long long keep_stride);

/* Gated RMSNorm per value head (gdn.gated_rms_norm): o, z f32 (n_v, dv), w f32 (dv) -> out f32 (may be NULL) and
 * q8_1 blocks out_q8 (may be NULL; dv % 32 == 0) of the (n_v * dv) row. */
int strata_q35_gated_norm(void *stream, const float *o, const float *z, const float *w, float *out, void *out_q8,
                          int n_v, int dv, float eps);

/* strata_q35_gated_norm over n <= 65535 rows: row t's o, z, out at t * o_stride / z_stride / out_stride floats, its
 * q8_1 blocks at out_q8 + t * q8_stride bytes; every row bit-identical to strata_q35_gated_norm on it. */
int strata_q35_gated_norm_rows(void *stream, const float *o, long long o_stride, const float *z, long long z_stride,
                               const float *w, float *out, long long out_stride, void *out_q8, long long q8_stride,
                               int n, int n_v, int dv, float eps);

/* Gated attention prologue for n tokens (rows back to back): qg f32 [per head (q hd | gate hd)] ++ k (n_kv*hd) ++ v
 * (n_kv*hd) -> qkv f32 [q | k | v] (strata_rope_kv_decode's layout) with per-head RMSNorm of q (q_norm) and k
 * (k_norm), and gate f32 (n_head*hd). hd a multiple of 32 up to 256. */
int strata_q35_attn_prep(void *stream, const float *qg, const float *q_norm, const float *k_norm, float *qkv,
                         float *gate, int n, int n_head, int n_kv, int hd, float eps);

/* att * sigmoid(gate) over n elements -> out f32, out16 f16 and q8_1 blocks out_q8 (each may be NULL; out_q8 needs
 * n % 32 == 0). */
int strata_q35_out_gate(void *stream, const float *att, const float *gate, float *out, void *out16, void *out_q8,
                        int n);

/* strata_q35_out_gate over n rows of width values (att, gate, out rows back to back), row t's q8_1 blocks at
 * out_q8 + t * q8_stride bytes (width % 32 == 0); every row bit-identical to strata_q35_out_gate on it. */
int strata_q35_out_gate_rows(void *stream, const float *att, const float *gate, float *out, void *out_q8,
                             long long q8_stride, int n, int width);

/* ---------------- gdn.cu: Gated DeltaNet: the delta rule over n tokens and the causal conv */
/* Gated delta rule over n tokens (S <- exp(g) S; u = (v - S^T k) beta; S <- S + k u^T; o = S^T q scale): q, k f32
 * (n, n_qk, dk), v f32 (n, n_v, dv), g, beta f32 (n, n_v), state f32 (n_v, dk, dv) in place, out f32 (n, n_v, dv).
 * tiled: value head h reads key head h % n_qk, else h / (n_v / n_qk). dk <= 256. variant 0 = choose, 1 = the
 * block kernel, 2 / 3 / 4 = the warp kernel with 4 / 2 / 1 value columns per warp (dk 32/64/128/256, dv a multiple
 * of the columns, 16-byte aligned arrays). */
int strata_gdn_recurrent(void *stream, const float *q, const float *k, const float *v, const float *g,
                         const float *beta, float *state, float *out, int n, int n_v, int n_qk, int dk, int dv,
                         int tiled, float scale);
int strata_gdn_recurrent_ex(void *stream, const float *q, const float *k, const float *v, const float *g,
                            const float *beta, float *state, float *out, int n, int n_v, int n_qk, int dk, int dv,
                            int tiled, float scale, int variant);

/* Causal depthwise conv + SiLU of n tokens: x f32 (n, channels) rows x_stride floats apart, w f32 (channels, kernel),
 * window f32 (kernel - 1, channels) in place, y f32 (n, channels). kernel 2..8. */
int strata_gdn_conv(void *stream, const float *x, int x_stride, const float *w, float *window, float *y, int n,
                    int channels, int kernel);

/* ---------------- gdn_prefill.cu: GDN prefill: the prologue and the gated norm for n tokens */
/* Gated DeltaNet prologue for n tokens (one launch): y f32 rows [q (n_k*dk) | k (n_k*dk) | v (n_v*dv)] y_stride floats
 * apart (the causal conv output) -> q_out, k_out f32 (n, n_k, dk) L2-normalised per key head (x / sqrt(|x|^2 +
 * l2_eps), unscaled), v_out f32 (n, n_v, dv) (may be NULL), beta_out = sigmoid(b) and g_out = A * softplus(a + dt)
 * (threshold 20) f32 (n, n_v). b and a rows are ba_stride floats apart; ba_grouped (qwen3next ssm_ba, per key head
 * [b x r, a x r], r = n_v / n_k): value head h reads b[b_off + (h/r)*2r + h%r], a[a_off + (h/r)*2r + r + h%r];
 * else (ssm_beta / ssm_alpha) b[b_off + h], a[a_off + h]. A, dt f32 (n_v). n_v a multiple of n_k. */
int strata_gdn_prep(void *stream, const float *y, int y_stride, const float *b, const float *a, int ba_stride,
                    int b_off, int a_off, int ba_grouped, const float *A, const float *dt, float *q_out, float *k_out,
                    float *v_out, float *g_out, float *beta_out, int n, int n_k, int n_v, int dk, int dv,
                    float l2_eps);

/* Gated RMSNorm of n_rows rows of d (gdn.gated_rms_norm), one launch: out[r] = o[r] / sqrt(mean(o[r]^2) + eps) * w *
 * silu(z_r); o f32 (n_rows, d) contiguous, w f32 (d); written to out f32 and / or out16 f16 (n_rows, d) (either
 * may be NULL, not both); z_r = the d floats at z + (r / z_group) * z_stride + (r % z_group) * d (z_group rows per
 * token back to back, tokens z_stride floats apart; z_stride >= z_group * d). */
int strata_gdn_gated_norm_rows(void *stream, const float *o, const float *z, int z_stride, int z_group,
                               const float *w, float *out, void *out16, int n_rows, int d, float eps);
/* ---------------- moe.cu: mixture-of-experts FFN (routing, routed experts through a device expert table, grouping) */
/* Limits: slots per token (the k routed experts plus the shared one), experts per layer, tokens per grouped tile. */
enum { STRATA_MOE_MAX_SLOTS = 32, STRATA_MOE_MAX_EXPERTS = 2048, STRATA_MOE_TILE = 8 };

/* Softmax top-k routing of n_tok tokens (strata/backend/moe.py route): logits f32 (n_tok, n_expert) -> ids int32 and
 * wts f32 (n_tok, ks), ks = k + (shared != 0): the k largest softmax probabilities in descending order (ties: lower
 * id), divided by their sum when renorm; with shared, slot k holds id n_expert and the shared expert's gate
 * sigmoid(x[t] . shared_gate) (x f32 (n_tok, n_embd); 1 when shared_gate is NULL). n_expert <= STRATA_MOE_MAX_EXPERTS,
 * ks <= STRATA_MOE_MAX_SLOTS. */
int strata_moe_route(void *stream, const float *logits, int n_tok, int n_expert, int k, int renorm, const float *x,
                     const float *shared_gate, int n_embd, int shared, int *ids, float *wts);

/* Decode gate/up of one token's n_slots experts in one launch: slot j reads expert e = ids[j] (clamped to [0,
 * n_table)) through the device tables gate_tab / up_tab (n_table addresses of (F_j, n_embd) matrices of ggml_type,
 * 16-byte aligned; F_j = n_ff, the last slot's n_ff_last: a shared expert of another width as the last slot) on
 * the q8_1 activations xq (strata_matvec_q8w's layout) -> act f32 (slot j at j * n_ff) = silu(gate x) * (up x)
 * and its q8_1 rows act_q8 (slot j at j * q8 row bytes of n_ff: F_j int8, F_j / 32 float2; a q8 row padded to 16
 * bytes; 16-byte aligned). n_ff, n_ff_last % 32 == 0. */
int strata_moe_gate_up(void *stream, int ggml_type, const void *const *gate_tab, const void *const *up_tab,
                       int n_table, const int *ids, int n_slots, const void *xq, float *act, void *act_q8, int n_ff,
                       int n_ff_last, int n_embd);

/* Decode down projection with the weighted sum in one launch: y f32 (n_embd) = sum_j wts[j] * down_{ids[j]} act_j
 * (act_q8: strata_moe_gate_up's rows; down_tab: n_table addresses of (n_embd, F_j) matrices) + shared_w[0] *
 * shared_y (when shared_y is not NULL; shared_w NULL: weight 1). */
int strata_moe_down(void *stream, int ggml_type, const void *const *down_tab, int n_table, const int *ids,
                    const float *wts, int n_slots, const void *act_q8, int n_ff, int n_ff_last, float *y,
                    int n_embd, const float *shared_y, const float *shared_w);

/* The tiles strata_moe_group may write for n_tok tokens of k experts each: n_tok * k / STRATA_MOE_TILE + n_expert. */
int strata_moe_max_tiles(int n_tok, int k, int n_expert);

/* Group the n_tok * k assignments a = t * k + j (expert ids[t * ks + j]) by expert, one launch: sorted int32 (n_tok *
 * k) holds each expert's assignments back to back in expert order (arbitrary order within one), tiles int32
 * (max_tiles, 3) the runs of up to STRATA_MOE_TILE of them (expert, first position in sorted, count), the rest of
 * the rows count 0. max_tiles >= strata_moe_max_tiles(n_tok, k, n_expert). */
int strata_moe_group(void *stream, const int *ids, int n_tok, int k, int ks, int n_expert, int *sorted, int *tiles,
                     int max_tiles);

/* Grouped matvecs of the tiles (strata_moe_group) in one launch: for each tile position p of expert e, y[orow, r] =
 * W_e[r] . x[irow] for r < n_out, W_e row r from tab0[e] (r < n_split) else tab1[e] row r - n_split (two matrices
 * stacked: gate | up); irow = sorted[p] / k with in_by_token (the assignment's token) else p; orow = sorted[p] with
 * out_by_assign else p. xq: q8_1 rows of n_in values (strata_moe_q8_rows' layout); y f32 (rows, n_out). */
int strata_moe_mm(void *stream, int ggml_type, const void *const *tab0, const void *const *tab1, int n_split,
                  int n_table, const int *tiles, int max_tiles, const int *sorted, int k, int in_by_token,
                  const void *xq, int n_in, float *y, int n_out, int out_by_assign);

/* q8_1 rows of x f32 (n_rows, n_cols; rows x_stride floats apart), or with glu of silu(x[r, c]) * x[r, n_cols + c]
 * (a gate | up row): row r at r * q8 row bytes of out (16-byte aligned). n_cols % 32 == 0. */
int strata_moe_q8_rows(void *stream, const float *x, long long x_stride, int glu, int n_rows, int n_cols, void *out);

/* x[t] += sum_{j < k} wts[t, j] * yd[t * k + j] (+ wts[t, k] * shared_y[t] when shared_y): x, shared_y f32 (n_tok,
 * n_embd), yd f32 (n_tok * k, n_embd), wts f32 (n_tok, ks). */
int strata_moe_combine(void *stream, const float *yd, const float *wts, int n_tok, int k, int ks, int n_embd,
                       const float *shared_y, float *x);

/* The expert tier's usage counts: counts[ids[t * ks + j]] += 1 for t < n_tok, j < k (the routed experts only; an id
 * outside [0, n_expert) is not counted). counts uint32 (n_expert), accumulated until the host reads and clears it. */
int strata_moe_count(void *stream, const int *ids, int n_tok, int k, int ks, int n_expert, unsigned *counts);
#ifdef __cplusplus
}
#endif
#endif
