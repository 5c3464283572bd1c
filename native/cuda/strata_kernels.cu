// Strata CUDA kernels: quantized matrix-vector (GGUF blocks read directly), dequantization, RMSNorm, RoPE,
// SwiGLU, paged f16 KV cache writes, split-K decode attention, causal softmax, argmax.
// Block formats follow llama.cpp's ggml-common.h / ggml-quants.c dequantize_row_* (and gguf-py quants.py).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include "strata_cuda.h"
#include "q8.cuh"
#include "launch.cuh"
#include "quant.cuh"

KT_DEFINE_SETTER   // strata_ktrace_set / strata_ktrace_count in a -DST_KTRACE build (launch.cuh)

// Dequantize the 8 consecutive elements [8c, 8c+8) of one row.
template <int T>
__device__ static inline void dequant8(const uint8_t *__restrict__ row, int c, float v[8]) {
  const int e = 8 * c;
  if (T == T_F32) {
    const float4 *p = reinterpret_cast<const float4 *>(row) + 2 * c;
    float4 a = p[0], b = p[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else if (T == T_F16) {
    const __half *p = reinterpret_cast<const __half *>(row) + e;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = __half2float(p[i]);
  } else if (T == T_Q4_0 || T == T_Q4_1) {
    const int bs = T == T_Q4_0 ? 18 : 20;
    const uint8_t *b = row + (e >> 5) * bs;
    const int w = e & 31;
    const float d = ldh(b);
    const float m = T == T_Q4_1 ? ldh(b + 2) : -8.0f * d;
    const uint8_t *qs = b + (T == T_Q4_0 ? 2 : 4) + (w & 15);
    const int sh = w >= 16 ? 4 : 0;
    if (T == T_Q4_1) {  // 20-byte blocks: qs is 4-byte aligned
      const uint32_t lo = reinterpret_cast<const uint32_t *>(qs)[0], hi = reinterpret_cast<const uint32_t *>(qs)[1];
#pragma unroll
      for (int i = 0; i < 4; i++) {
        v[i] = d * (float)((lo >> (8 * i + sh)) & 15) + m;
        v[i + 4] = d * (float)((hi >> (8 * i + sh)) & 15) + m;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; i++) v[i] = d * (float)((qs[i] >> sh) & 15) + m;
    }
  } else if (T == T_Q8_0) {
    const uint8_t *b = row + (e >> 5) * 34;
    const float d = ldh(b);
    const int8_t *qs = reinterpret_cast<const int8_t *>(b + 2) + (e & 31);
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = d * (float)qs[i];
  } else if (T == T_Q4_K || T == T_Q5_K) {
    const int bs = T == T_Q4_K ? 144 : 176;
    const uint8_t *b = row + (e >> 8) * bs;
    const int w = e & 255;
    const int j = w >> 6, l0 = w & 63, hi = l0 >= 32;
    float sc, mn;
    scale_min_k4(2 * j + hi, b + 4, sc, mn);
    const float d = ldh(b) * sc, m = ldh(b + 2) * mn;
    const uint8_t *qs = b + (T == T_Q4_K ? 16 : 48) + 32 * j + (l0 & 31);
    const int sh = hi ? 4 : 0;
    // 144- and 176-byte blocks keep qs/qh 8-byte aligned: one 8-byte load each
    const uint2 q8 = *reinterpret_cast<const uint2 *>(qs);
    if (T == T_Q4_K) {
#pragma unroll
      for (int i = 0; i < 4; i++) {
        v[i] = d * (float)((q8.x >> (8 * i + sh)) & 15) - m;
        v[i + 4] = d * (float)((q8.y >> (8 * i + sh)) & 15) - m;
      }
    } else {
      const uint2 h8 = *reinterpret_cast<const uint2 *>(b + 16 + (l0 & 31));
      const int u = 2 * j + hi;
#pragma unroll
      for (int i = 0; i < 4; i++) {
        v[i] = d * (float)(((q8.x >> (8 * i + sh)) & 15) + (((h8.x >> (8 * i + u)) & 1) << 4)) - m;
        v[i + 4] = d * (float)(((q8.y >> (8 * i + sh)) & 15) + (((h8.y >> (8 * i + u)) & 1) << 4)) - m;
      }
    }
  } else if (T == T_Q6_K) {
    const uint8_t *b = row + (e >> 8) * 210;
    const int w = e & 255;
    const int n = w >> 7, r = w & 127, g = r >> 5, l = r & 31;
    const uint8_t *ql = b + 64 * n + l + (g & 1) * 32;
    const uint8_t *qh = b + 128 + 32 * n + l;
    const int8_t sc = reinterpret_cast<const int8_t *>(b + 192)[8 * n + (l >> 4) + 2 * g];
    const float d = ldh(b + 208) * (float)sc;
    const int sl = g >= 2 ? 4 : 0, shh = 2 * g;
#pragma unroll
    for (int i = 0; i < 8; i++)
      v[i] = d * (float)((int)(((ql[i] >> sl) & 15) | (((qh[i] >> shh) & 3) << 4)) - 32);
  }
}

template <int T, int NT>
__global__ void k_matvec(const uint8_t *__restrict__ w, const float *__restrict__ x, float *__restrict__ y,
                         int n_out, int n_in, long long row_bytes) {
  griddep_launch();
  griddep_wait();
  const int warps = blockDim.x >> 5;
  const int row = blockIdx.x * warps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= n_out) return;
  const uint8_t *r = w + (long long)row * row_bytes;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; t++) acc[t] = 0.f;
  const int nc = n_in >> 3;
  for (int c = lane; c < nc; c += 32) {
    float v[8];
    dequant8<T>(r, c, v);
#pragma unroll
    for (int t = 0; t < NT; t++) {
      const float4 *xp = reinterpret_cast<const float4 *>(x + (long long)t * n_in) + 2 * c;
      const float4 a = __ldg(xp), b = __ldg(xp + 1);
      acc[t] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x + v[5] * b.y + v[6] * b.z + v[7] * b.w;
    }
  }
#pragma unroll
  for (int t = 0; t < NT; t++) {
    float s = acc[t];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) y[(long long)t * n_out + row] = s;
  }
}

template <int T>
__global__ void k_dequant(const uint8_t *__restrict__ w, void *__restrict__ out, const int *__restrict__ ids,
                          int n_rows, int n_in, long long row_bytes, int out_f16) {
  griddep_launch();
  griddep_wait();
  const int nc = n_in >> 3;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)n_rows * nc) return;
  const int rr = (int)(idx / nc), c = (int)(idx % nc);
  const long long src = ids ? (long long)ids[rr] : rr;
  float v[8];
  dequant8<T>(w + src * row_bytes, c, v);
  if (out_f16) {
    __half2 h[4];
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    reinterpret_cast<uint4 *>(out)[idx] = *reinterpret_cast<uint4 *>(h);
  } else {
    float4 *o = reinterpret_cast<float4 *>(out) + 2 * idx;
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

#define DISPATCH_TYPE(t, F) \
  switch (t) { \
    case T_F32: F(T_F32); break; case T_F16: F(T_F16); break; case T_Q4_0: F(T_Q4_0); break; \
    case T_Q4_1: F(T_Q4_1); break; case T_Q8_0: F(T_Q8_0); break; case T_Q4_K: F(T_Q4_K); break; \
    case T_Q5_K: F(T_Q5_K); break; case T_Q6_K: F(T_Q6_K); break; default: return (int)cudaErrorInvalidValue; }

// The same for the types of the int8-activation (dp4a) kernels (strata_matvec_q8_supported).
#define DISPATCH_Q8_TYPE(t, F) \
  switch (t) { \
    case T_Q4_0: F(T_Q4_0); break; case T_Q4_1: F(T_Q4_1); break; case T_Q8_0: F(T_Q8_0); break; \
    case T_Q4_K: F(T_Q4_K); break; case T_Q5_K: F(T_Q5_K); break; case T_Q6_K: F(T_Q6_K); break; \
    default: return (int)cudaErrorInvalidValue; }

static inline long long row_bytes_of(int t, int n_in) {
  return (long long)(n_in / block_elems(t)) * block_bytes(t);
}

extern "C" int strata_supports_type(int t) { return block_bytes(t) != 0; }

// Programmatic dependent launch for st_launch (launch.cuh): on by default on compute capability 9.0 and newer
// (H200: decode 1.05-1.35x, the same tokens; bench/gpu_throughput.py decode_no_pdl), STRATA_CUDA_PDL=0 (or
// false / no / off) turns it off, any other value forces it on; strata_set_pdl overrides both.
static int g_pdl = -1;
extern "C" int strata_get_pdl(void) {
  if (g_pdl < 0) {
    const char *e = getenv("STRATA_CUDA_PDL");
    if (e && e[0]) {   // "0", "false", "no", "off" (any case of the first letter): off; anything else: on
      const char c = e[0];
      g_pdl = !(c == '0' || c == 'f' || c == 'F' || c == 'n' || c == 'N' ||
                ((c == 'o' || c == 'O') && (e[1] == 'f' || e[1] == 'F')));
    } else {
      int dev = 0, major = 0;
      g_pdl = cudaGetDevice(&dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
    }
  }
  return g_pdl;
}
extern "C" void strata_set_pdl(int on) { g_pdl = on ? 1 : 0; }

extern "C" int strata_matvec(void *stream, int t, const void *w, const float *x, float *y, int n_out, int n_in,
                             int n_tokens) {
  if (!block_bytes(t) || n_in % block_elems(t) || n_in % 32 || n_tokens < 1 || n_tokens > 8)
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  const long long rb = row_bytes_of(t, n_in);
  const int threads = 256, rows_per_block = threads / 32;
  const int blocks = (n_out + rows_per_block - 1) / rows_per_block;
  const uint8_t *W = (const uint8_t *)w;
#define MV(NT, TT) st_launch(k_matvec<TT, NT>, blocks, threads, 0, s, W, x, y, n_out, n_in, rb)
#define MVT(TT) \
  switch (n_tokens) { case 1: MV(1, TT); break; case 2: MV(2, TT); break; case 3: MV(3, TT); break; \
    case 4: MV(4, TT); break; case 5: MV(5, TT); break; case 6: MV(6, TT); break; case 7: MV(7, TT); break; \
    default: MV(8, TT); break; }
  DISPATCH_TYPE(t, MVT)
#undef MVT
#undef MV
  return (int)cudaGetLastError();
}

static int dequant_launch(void *stream, int t, const void *w, void *out, const int *ids, int n_rows, int n_in,
                          int out_f16) {
  if (!block_bytes(t) || n_in % block_elems(t) || n_in % 8) return (int)cudaErrorInvalidValue;
  if (n_rows <= 0) return 0;
  cudaStream_t s = (cudaStream_t)stream;
  const long long rb = row_bytes_of(t, n_in);
  const long long total = (long long)n_rows * (n_in / 8);
  const int threads = 256;
  const unsigned blocks = (unsigned)((total + threads - 1) / threads);
  const uint8_t *W = (const uint8_t *)w;
#define DQ(TT) st_launch(k_dequant<TT>, blocks, threads, 0, s, W, out, ids, n_rows, n_in, rb, out_f16)
  DISPATCH_TYPE(t, DQ)
#undef DQ
  return (int)cudaGetLastError();
}

extern "C" int strata_dequant(void *stream, int t, const void *w, void *out, int n_rows, int n_in, int out_f16) {
  return dequant_launch(stream, t, w, out, nullptr, n_rows, n_in, out_f16);
}

extern "C" int strata_get_rows(void *stream, int t, const void *w, const int *ids, float *out, int n_ids, int n_in) {
  return dequant_launch(stream, t, w, out, ids, n_ids, n_in, 0);
}

// ---------------------------------------------------------------- decode matvec on int8 activations (dp4a)
// x is quantized once per matmul to q8_1-style blocks of 32 (llama.cpp quantize_q8_1): d = max|x| / 127,
// q = round-to-nearest-even(x / d) (IEEE division), kept as int8 [n_in] followed by float2 (d, d * sum q) per
// block. Each weight sub-block of 32 elements is then dotted with one x block by 8 __dp4a over 16-byte loads
// (llama.cpp vec_dot_*_q8_1 arithmetic). 8 lanes per output row, 4 rows per warp.
__global__ void k_quantize_q8_1(const float *__restrict__ x, int8_t *__restrict__ xq, float2 *__restrict__ ds,
                                int n_in) {
  griddep_launch();
  griddep_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;   // blockDim multiple of 32; one warp = one block of 32
  const float v = i < n_in ? x[i] : 0.f;
  float amax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float d = __fdiv_rn(amax, 127.0f);   // IEEE division despite --use_fast_math
  const int q = amax == 0.f ? 0 : __float2int_rn(__fdiv_rn(v, d));
  int sum = q;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (i < n_in) {
    xq[i] = (int8_t)q;
    if ((i & 31) == 0) ds[i >> 5] = make_float2(d, d * (float)sum);
  }
}

// Dot of weight sub-block u (32 elements) of one row with x block u: returns the f32 contribution.
__device__ static inline void load_xq(const int *__restrict__ xq, int u, int x[8]) {
  const int4 a = __ldg(reinterpret_cast<const int4 *>(xq) + 2 * u), b = __ldg(reinterpret_cast<const int4 *>(xq) + 2 * u + 1);
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

template <int T>
__device__ static inline float dot_q8(const uint8_t *__restrict__ row, int u, const int *__restrict__ xq, float2 xds) {
  int x[8];
  load_xq(xq, u, x);
  return dot_q8x<T>(row, u, x, xds);
}

#define MVQ_LANES 8
template <int T>
__global__ void k_matvec_q8(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
                            const float2 *__restrict__ xds, float *__restrict__ y, int n_out, int n_units,
                            long long row_bytes) {
  griddep_launch();
  griddep_wait();
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) / MVQ_LANES;
  const int g = threadIdx.x % MVQ_LANES;
  float acc = 0.f;
  if (row < n_out) {
    const uint8_t *r = w + (long long)row * row_bytes;
    const int *x = reinterpret_cast<const int *>(xq);
#pragma unroll 4
    for (int u = g; u < n_units; u += MVQ_LANES) acc += dot_q8<T>(r, u, x, __ldg(xds + u));
  }
#pragma unroll
  for (int o = MVQ_LANES / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (row < n_out && g == 0) y[row] = acc;
}

extern "C" int strata_quantize_q8_1(void *stream, const float *x, void *xq, int n_in) {
  if (n_in <= 0 || n_in % 32) return (int)cudaErrorInvalidValue;
  int8_t *q = (int8_t *)xq;
  st_launch(k_quantize_q8_1, (n_in + 255) / 256, 256, 0, (cudaStream_t)stream, x, q, (float2 *)(q + n_in), n_in);
  return (int)cudaGetLastError();
}

extern "C" int strata_matvec_q8_supported(int t) {
  return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
}

// Rows (or row pairs) per warp / block of the decode matvec kernels for a requested count: 1, 2 or 4 (the
// instantiated ones; more is 4, fewer than 2 is 1).
static inline int rows_1_2_4(int n) { return n >= 4 ? 4 : n >= 2 ? 2 : 1; }

// The arguments every int8-activation matvec launcher checks: a dp4a type, n_in a whole number of blocks and of q8_1
// blocks, rows, 16-byte aligned weights and activations.
static int q8_matvec_check(int t, const void *w, const void *xq, int n_out, int n_in) {
  if (!strata_matvec_q8_supported(t) || n_in <= 0 || n_in % block_elems(t) || n_in % 32 || n_out <= 0 || !w || !xq)
    return (int)cudaErrorInvalidValue;
  if (((uintptr_t)xq & 15) || ((uintptr_t)w & 15)) return (int)cudaErrorMisalignedAddress;
  return 0;
}

extern "C" int strata_matvec_q8(void *stream, int t, const void *w, const void *xq, float *y, int n_out, int n_in) {
  if (const int e = q8_matvec_check(t, w, xq, n_out, n_in)) return e;
  const long long rb = row_bytes_of(t, n_in);
  const int threads = 128, rows = threads / MVQ_LANES;
  const unsigned blocks = (unsigned)((n_out + rows - 1) / rows);
  const int8_t *q = (const int8_t *)xq;
  const float2 *ds = (const float2 *)(q + n_in);
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
#define MQ(TT) st_launch(k_matvec_q8<TT>, blocks, threads, 0, s, W, q, ds, y, n_out, n_in / 32, rb)
  DISPATCH_Q8_TYPE(t, MQ)
#undef MQ
  return (int)cudaGetLastError();
}

// Prefetch one read-only weight row into L2, its 128-byte lines spread over STRIDE threads (this one: `first`):
// with PDL the rows stream in while the previous kernel finishes.
template <int STRIDE>
__device__ static inline void prefetch_row_l2(const uint8_t *row, long long row_bytes, int first) {
  for (long long o = 128LL * first; o < row_bytes; o += STRIDE * 128) prefetch_l2(row + o);
}

// q8_1 activation block u (8 ints of int8 values, its (d, d * sum)): XSHARED, x / xds in shared memory (generic
// loads), else in global memory (load_xq's __ldg).
template <bool XSHARED>
__device__ static inline void load_x(const int *x, const float2 *xds, int u, int xv[8], float2 &ds) {
  if (XSHARED) {
    const int4 a = reinterpret_cast<const int4 *>(x)[2 * u], b = reinterpret_cast<const int4 *>(x)[2 * u + 1];
    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w; xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
    ds = xds[u];
  } else {
    load_xq(x, u, xv);
    ds = __ldg(xds + u);
  }
}

// ---------------------------------------------------------------- RMSNorm fused into a decode matvec's prologue
// The decode graph's RMSNorm before the QKV and gate/up matvecs, done by every block of the matvec itself after
// its PDL wait (its weights already staged): s = x + delta, y = s / sqrt(mean(s^2) + eps) * w, y as q8_1 blocks in
// the block's shared memory; block 0 also stores s (the residual stream) to x_out. One launch and one dependent
// global round trip per norm fewer than strata_rms_norm_ex + matvec. Each thread holds 8-element chunks (chunk c =
// tid + k * blockDim), so a q8_1 block is 4 neighbouring lanes; same per-element arithmetic as k_rms_norm_c.
#define FUSED_NORM_MAX_DIM 4096   // widest fused-norm row: 4 chunks of 8 per thread of a 128-thread QKV block

struct NormIn {
  const float *x, *delta, *w;   // residual stream, the output to add to it (may be NULL), norm weight: f32 (dim)
  float *x_out;                 // x + delta (may be NULL); must not alias x or delta (other blocks read them)
  float eps;
  int dim;                      // % 32 == 0, <= 8 * MAXC * blockDim.x
  const float *ss;              // handed-off norm (w NULL): xq = q8_1(x * w) and ss its groups' sums of x^2 (dim / 32)
};

// ---------------------------------------------------------------- RMSNorm handed off by the producing matvec
// The decode graph's alternative to the fused norm (norm handoff): the matvec that adds its output to the residual
// stream x (the output and down projections) also writes what the next RMSNorm's consumer needs, per 32-row group of
// x: q8_1(x * w) (w the norm weight; the norm's scale 1 / rms is a common factor of the whole vector, so it is left
// out of the quantized values) and the group's sum of x^2. The consumer (QKV, gate/up) reads those q8_1 blocks as
// any int8 activation and multiplies its dot products by r = 1 / sqrt(sum(ss) / dim + eps): no norm, no reduction
// and 2.5 instead of 16 bytes per element on its dependent chain. RMSNorm: Zhang & Sennrich 2019, y = x / rms(x) * w.
struct ResidOut {
  float *x;             // residual stream f32 (n): x[row] += the row's product (NULL: plain y store)
  const float *w;       // next norm's weight f32 (n); NULL: no handoff (the residual add only)
  int8_t *xq;           // q8_1 of x * w: n int8, then n / 32 float2 (d, d * sum q)
  float *ss;            // n / 32 sums of x^2
  unsigned *cnt;        // n / 32 row counters, zero (the block completing a group resets its counter)
  int n;                // rows (% 32 == 0)
};

// Warp-cooperative: lane holds v = x[i] (i = group * 32 + lane) of a finished group: its q8_1 block of v * w and its
// sum of v^2 (xor butterfly: the same bits in every lane and every run).
__device__ static inline void handoff_store(float v, int i, const float *__restrict__ w, int8_t *__restrict__ xq,
                                            float *__restrict__ ss, int n) {
  q8_store(v * __ldg(w + i), i, xq, reinterpret_cast<float2 *>(xq + n));
  float s = v * v;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((i & 31) == 0) ss[i >> 5] = s;
}

// The consumer's scale r = 1 / sqrt(sum(ss) / dim + eps), warp-cooperative (every lane gets the same bits), in two
// halves so the loads are in flight during the dot products: handoff_load (this lane's groups lane + 32 k, dim <=
// 4096) after the PDL wait, handoff_scale after the dots.
struct HandoffSS {
  float v[4];
};
static_assert(FUSED_NORM_MAX_DIM <= 4 * 32 * 32, "HandoffSS holds 4 group sums per lane");
__device__ static inline HandoffSS handoff_load(const NormIn &n) {
  HandoffSS h;
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int g = (threadIdx.x & 31) + 32 * k;
    h.v[k] = n.ss && g < n.dim / 32 ? __ldcg(n.ss + g) : 0.f;
  }
  return h;
}
__device__ static inline float handoff_scale(const NormIn &n, const HandoffSS &h) {
  float s = (h.v[0] + h.v[1]) + (h.v[2] + h.v[3]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return rsqrtf(s / (float)n.dim + n.eps);
}

// After this block stored rows [r0, r0 + nr) of ro.x (nr divides 32: the rows lie in one group): count them into
// their group (arrive_acq_rel); the block that completes the group writes its handoff (handoff_store) and resets the
// counter (the next producer runs after this grid completes). Every thread of the block calls it.
__device__ static inline void resid_handoff(const ResidOut &ro, int r0, int nr) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned g = (unsigned)r0 >> 5;
    last = arrive_acq_rel(ro.cnt + g, (unsigned)nr) + nr == 32;
    if (last) ro.cnt[g] = 0;
  }
  __syncthreads();
  if (last && threadIdx.x < 32) {
    const int i = (r0 & ~31) + threadIdx.x;
    handoff_store(__ldcg(ro.x + i), i, ro.w, ro.xq, ro.ss, ro.n);
  }
}

// The norm handoff of a whole vector (the first layer's, after the embedding row): a block of one warp per group.
__global__ void k_norm_q8(const float *__restrict__ x, const float *__restrict__ w, int8_t *__restrict__ xq,
                          float *__restrict__ ss, int n) {
  griddep_launch();
  griddep_wait();
  const int i = blockIdx.x * 32 + threadIdx.x;
  handoff_store(x[i], i, w, xq, ss, n);
}

extern "C" int strata_norm_q8(void *stream, const float *x, const float *w, void *x_q8, float *x_ss, int n) {
  if (!x || !w || !x_q8 || !x_ss || n <= 0 || n % 32) return (int)cudaErrorInvalidValue;
  if ((uintptr_t)x_q8 & 7) return (int)cudaErrorMisalignedAddress;
  st_launch(k_norm_q8, n / 32, 32, 0, (cudaStream_t)stream, x, w, (int8_t *)x_q8, x_ss, n);
  return (int)cudaGetLastError();
}

// q8_1 quantization of EPT consecutive values y per lane, G = 32 / EPT neighbouring lanes holding one 32-value
// block (all of them call it: full-mask shuffles): q the int8 values, d = absmax / 127 and sum (the block's sum of
// q) for its (d, d * sum) pair. Per element the arithmetic of q8_store (llama.cpp quantize_q8_1).
template <int EPT>
__device__ static inline void q8_chunk(const float (&y)[EPT], int (&q)[EPT], float &d, int &sum) {
  constexpr int G = EPT >= 32 ? 1 : 32 / EPT;
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < EPT; k++) amax = fmaxf(amax, fabsf(y[k]));
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  d = __fdiv_rn(amax, 127.0f);
  sum = 0;
#pragma unroll
  for (int k = 0; k < EPT; k++) {
    q[k] = amax == 0.f ? 0 : __float2int_rn(__fdiv_rn(y[k], d));
    sum += q[k];
  }
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
}

// Before the PDL wait: this thread's chunks of the norm weight (constants) into registers.
template <int MAXC>
__device__ static inline void fn_load_w(const NormIn &n, float (&w)[MAXC][8]) {
#pragma unroll
  for (int k = 0; k < MAXC; k++) {
    const int c = threadIdx.x + k * blockDim.x;
    const bool live = 8 * c < n.dim;
    const float4 a = live ? __ldg(reinterpret_cast<const float4 *>(n.w) + 2 * c) : make_float4(0, 0, 0, 0);
    const float4 b = live ? __ldg(reinterpret_cast<const float4 *>(n.w) + 2 * c + 1) : make_float4(0, 0, 0, 0);
    w[k][0] = a.x; w[k][1] = a.y; w[k][2] = a.z; w[k][3] = a.w; w[k][4] = b.x; w[k][5] = b.y; w[k][6] = b.z;
    w[k][7] = b.w;
  }
}

__device__ static inline float block_sum(float v, float *sh);

// After the PDL wait: the norm into xs (int8, dim) and xds (float2 (d, d * sum q), dim / 32), shared memory; ends
// with __syncthreads (every thread of the block must call it).
template <int MAXC>
__device__ static inline void fn_norm_q8(const NormIn &n, const float (&w)[MAXC][8], int8_t *xs, float2 *xds,
                                         float *red) {
  float v[MAXC][8];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < MAXC; k++) {
    const int c = threadIdx.x + k * blockDim.x;
    const bool live = 8 * c < n.dim;
#pragma unroll
    for (int h = 0; h < 2; h++) {
      float4 a = live ? reinterpret_cast<const float4 *>(n.x)[2 * c + h] : make_float4(0, 0, 0, 0);
      if (n.delta && live) {
        const float4 d = reinterpret_cast<const float4 *>(n.delta)[2 * c + h];
        a.x += d.x; a.y += d.y; a.z += d.z; a.w += d.w;
      }
      v[k][4 * h] = a.x; v[k][4 * h + 1] = a.y; v[k][4 * h + 2] = a.z; v[k][4 * h + 3] = a.w;
      if (n.x_out && blockIdx.x == 0 && live) reinterpret_cast<float4 *>(n.x_out)[2 * c + h] = a;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) ss += v[k][e] * v[k][e];
  }
  const float r = rsqrtf(block_sum(ss, red) / (float)n.dim + n.eps);
#pragma unroll
  for (int k = 0; k < MAXC; k++) {
    const int c = threadIdx.x + k * blockDim.x;
    float y[8], d;
    int q[8], sum;
#pragma unroll
    for (int e = 0; e < 8; e++) y[e] = v[k][e] * r * w[k][e];
    q8_chunk(y, q, d, sum);
    if (8 * c < n.dim) {
      uint2 pk;   // the 8 int8 values, little-endian
      pk.x = (uint32_t)(q[0] & 255) | (uint32_t)(q[1] & 255) << 8 | (uint32_t)(q[2] & 255) << 16 |
             (uint32_t)(q[3] & 255) << 24;
      pk.y = (uint32_t)(q[4] & 255) | (uint32_t)(q[5] & 255) << 8 | (uint32_t)(q[6] & 255) << 16 |
             (uint32_t)(q[7] & 255) << 24;
      reinterpret_cast<uint2 *>(xs)[c] = pk;
      if ((c & 3) == 0) xds[c >> 2] = make_float2(d, d * (float)sum);
    }
  }
  __syncthreads();
}

// One thread's share of the dot products of NR weight rows with the q8_1 vector (x int8 blocks, xds their (d, d *
// sum)): STRIDE threads stride over the rows' 32-element sub-blocks (u = first, first + STRIDE, ...), each x block
// loaded once into registers for all NR rows, 2 sub-blocks unrolled; summing acc[r] over the STRIDE threads gives
// row r's product. STRIDE 32 is a warp's share (k_matvec_q8w_glu), 128 a block's (k_matvec_q8b). The loop of
// k_matvec_q8w, which keeps its own copy: the decode plan's hottest kernel was measured with that code (through this
// helper its register allocation changes).
template <int T, int NR, int STRIDE, bool XSHARED = false>
__device__ static inline void strided_rows_dot(const uint8_t *const (&rows)[NR], const int *__restrict__ x,
                                               const float2 *__restrict__ xds, int n_units, int first,
                                               float (&acc)[NR]) {
#pragma unroll
  for (int r = 0; r < NR; r++) acc[r] = 0.f;
#pragma unroll 2
  for (int u = first; u < n_units; u += STRIDE) {
    int xv[8];
    float2 ds;
    load_x<XSHARED>(x, xds, u, xv, ds);
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] += dot_q8x<T>(rows[r], u, xv, ds);
  }
}

// One decode RoPE pair, in two halves that every decode RoPE (k_rope_kv_decode, the QKV matvec's epilogue) calls,
// so they give the same bits whatever the compiler would contract. rope_angle: (cos, sin) of pair i at position
// pos, angle pos * base^(-2i / n_rot) in double precision (Su et al., RoFormer, eq. 34; llama.cpp's ggml_rope with
// theta_scale = base^(-2 / n_rot)).
__device__ static inline float2 rope_angle(int pos, int i, int n_rot, float base) {
  const double ang = (double)pos * pow((double)base, -2.0 * (double)i / (double)n_rot);
  return make_float2((float)cos(ang), (float)sin(ang));
}

// rope_apply: (x0, x1) rotated by cs = (cos, sin), each output one rounded product and one fused multiply-add.
__device__ static inline void rope_apply(float2 cs, float &x0, float &x1) {
  const float y0 = __fmaf_rn(x0, cs.x, __fmul_rn(-x1, cs.y)), y1 = __fmaf_rn(x0, cs.y, __fmul_rn(x1, cs.x));
  x0 = y0;
  x1 = y1;
}

__device__ static inline void rope_rotate(int pos, int i, int n_rot, float base, float &x0, float &x1) {
  rope_apply(rope_angle(pos, i, n_rot, base), x0, x1);
}

// Element offset of (position pos, KV head h, dim d) in a paged cache (n_pages, ps, n_kv, hd) by page table pt.
__device__ static inline long long kv_index(const int *pt, int pos, int h, int d, int n_kv, int hd, int ps) {
  const int page = pt[pos / ps], slot = pos % ps;
  return (((long long)page * ps + slot) * n_kv + h) * hd + d;
}

// What the QKV decode matvec's epilogue needs to do strata_rope_kv_decode's work (k_matvec_q8w with ROPE).
struct RopeKV {
  const int *pos, *pt;    // position (device), page table
  __half *kc, *vc;        // f16 cache of this layer
  int H, KV, hd, n_rot, ps;
  float base;
  int pre_wait;           // no earlier kernel of the PDL chain writes pos or pt: read them before the PDL wait
};

// The input-independent half of one pair's epilogue: the pair's (cos, sin) and its cache element (or -1: a q row).
struct RopePair {
  float2 cs;
  long long o;
};

// RoPE (adjacent pairs, neox = 0) of the pair of rows (a, a + 1) of qkv [q (H*hd) | k (KV*hd) | v (KV*hd)] and the
// k / v cache writes, in two halves: rope_pair_prepare (position, angle, page lookup: before the PDL wait when
// RopeKV::pre_wait) and rope_pair_store (from the rows' dot products y0, y1). k_rope_kv_decode's arithmetic
// (rope_angle / rope_apply), so the fused and separate paths agree bit for bit.
__device__ static inline RopePair rope_pair_prepare(const RopeKV &r, int a) {
  const int p = r.pos[0], qk = (r.H + r.KV) * r.hd;
  RopePair rp{make_float2(1.f, 0.f), -1};
  if (a < qk) {
    const int h = a / r.hd, d = a % r.hd;
    if (d < r.n_rot) rp.cs = rope_angle(p, d / 2, r.n_rot, r.base);
    if (h >= r.H) rp.o = kv_index(r.pt, p, h - r.H, d, r.KV, r.hd, r.ps);
  } else {
    const int j = a - qk;
    rp.o = kv_index(r.pt, p, j / r.hd, j % r.hd, r.KV, r.hd, r.ps);
  }
  return rp;
}

__device__ static inline void rope_pair_store(const RopeKV &r, const RopePair &rp, float *qkv, int a, float y0,
                                              float y1) {
  const int qk = (r.H + r.KV) * r.hd;
  if (a < qk) {
    if (a % r.hd < r.n_rot) rope_apply(rp.cs, y0, y1);
    if (rp.o >= 0) {
      r.kc[rp.o] = __float2half(y0);
      r.kc[rp.o + 1] = __float2half(y1);
    }
  } else {
    r.vc[rp.o] = __float2half(y0);
    r.vc[rp.o + 1] = __float2half(y1);
  }
  qkv[a] = y0;
  qkv[a + 1] = y1;
}

// Warp-per-row variant for decode: a warp takes R consecutive rows and its 32 lanes stride over the row's 32-element
// sub-blocks, so one x block (loaded once into registers) serves R rows and every lane keeps R weight loads in
// flight; the whole grid covers a 2-16 MB matrix in one wave. Same arithmetic as k_matvec_q8.
// ROPE: y is the decode step's qkv row and the epilogue also does strata_rope_kv_decode's work (RoPE with adjacent
// pairs, k / v into the f16 cache; rope_pair_prepare / rope_pair_store): a block's 4 * R rows are whole pairs, which
// meet in shared memory.
// STAGE: each warp copies its R rows into shared memory (`slot` bytes per warp, dynamic) before the PDL wait and
// reads them there (launch.cuh, "weight staging"); else it prefetches them into L2.
// FNC > 0: the RMSNorm of fn is fused into the prologue (fn_norm_q8, FNC chunks per thread; xq / xds unused): the
// block's q8_1 x lives in shared memory after the staged rows (STAGE required).
template <int T, int R, bool ROPE, bool STAGE, int FNC>
__global__ void __launch_bounds__(128) k_matvec_q8w(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
                                                    const float2 *__restrict__ xds, float *__restrict__ y, int n_out,
                                                    int n_units, long long row_bytes, RopeKV rope, int slot,
                                                    NormIn fn, ResidOut ro) {
  griddep_launch();
  KT(KT_MATVEC, KT_START);
  extern __shared__ __align__(16) uint8_t staged[];
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = warp * R;
  // whole warps only (with ROPE, a fused norm or a norm handoff every warp reaches the block's barriers)
  if (!ROPE && !FNC && !ro.w && row0 >= n_out) return;
  float nw[FNC > 0 ? FNC : 1][8];
  if (FNC) fn_load_w(fn, nw);
  // rows past the end re-read the last row (not stored): no branch around loads
  const int first = min(row0, n_out - 1), last = min(row0 + R, n_out);   // rows [first, max(last, first + 1))
  const uint8_t *base = w + (long long)first * row_bytes;
  if (STAGE) {
    base = stage_bytes(base, (long long)max(last - first, 1) * row_bytes, staged + (threadIdx.x >> 5) * slot, lane,
                       32);
  } else {
    // the weights are read-only: with PDL this warp's rows stream into L2 while the previous kernel finishes
    // (prefetch_row_l2's loop, kept inline like the dot loop below: the measured code of the hottest kernel)
#pragma unroll
    for (int r = 0; r < R; r++)
      if (row0 + r < n_out)
        for (long long o = 128LL * lane; o < row_bytes; o += 32 * 128) prefetch_l2(w + (long long)(row0 + r) * row_bytes + o);
  }
  // the RoPE epilogue's pair (thread t < 2R: the block's pair t): its angle and cache slot before the wait if allowed
  const int pair_a = blockIdx.x * 4 * R + 2 * threadIdx.x;
  const bool pair_live = ROPE && threadIdx.x < 2 * R && pair_a < n_out;
  RopePair pair{};
  if (pair_live && rope.pre_wait) pair = rope_pair_prepare(rope, pair_a);
  griddep_wait();
  KT(KT_MATVEC, KT_WAITED);
  if (pair_live && !rope.pre_wait) pair = rope_pair_prepare(rope, pair_a);
  // residual add: lane r < R holds x[row0 + r]; handed-off norm: the input's scale
  const float xres = !ROPE && ro.x && lane < R && row0 + lane < n_out ? ro.x[row0 + lane] : 0.f;
  const HandoffSS hss = handoff_load(fn);
  if (STAGE) {
    stage_wait();
    __syncwarp();
    KT(KT_MATVEC, KT_STAGED);
  }
  const int *x = reinterpret_cast<const int *>(xq);
  if (FNC) {   // the block's normalized x as q8_1 in shared memory, after the 4 warps' staged rows
    __shared__ float red[32];
    int8_t *xs = reinterpret_cast<int8_t *>(staged + 4 * slot);
    fn_norm_q8(fn, nw, xs, reinterpret_cast<float2 *>(xs + fn.dim), red);
    KT(KT_MATVEC, KT_NORMED);
    x = reinterpret_cast<const int *>(xs);
    xds = reinterpret_cast<const float2 *>(xs + fn.dim);
  }
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = 0.f;
#pragma unroll 2
  for (int u = lane; u < n_units; u += 32) {
    int xv[8];
    float2 ds;
    load_x<(FNC > 0)>(x, xds, u, xv, ds);
#pragma unroll
    for (int r = 0; r < R; r++)
      acc[r] += dot_q8x<T>(base + (long long)(min(row0 + r, n_out - 1) - first) * row_bytes, u, xv, ds);
  }
  KT(KT_MATVEC, KT_DOTTED);
  const float in_scale = !FNC && fn.ss ? handoff_scale(fn, hss) : 1.f;
  __shared__ float sv[ROPE ? 4 * R : 1];
#pragma unroll
  for (int r = 0; r < R; r++) {
    float v = acc[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (!FNC && fn.ss) v *= in_scale;
    if (ROPE) {
      if (lane == r) sv[(threadIdx.x >> 5) * R + r] = v;
    } else if (lane == r && row0 + r < n_out) {
      if (ro.x) {
        ro.x[row0 + r] = xres + v;
      } else {
        y[row0 + r] = v;
      }
    }
  }
  if (ROPE) {
    __syncthreads();
    if (pair_live) rope_pair_store(rope, pair, y, pair_a, sv[2 * threadIdx.x], sv[2 * threadIdx.x + 1]);
  } else if (ro.w) {
    resid_handoff(ro, blockIdx.x * 4 * R, 4 * R);
  }
  KT(KT_MATVEC, KT_END);
}

// Dynamic shared memory a staged decode matvec takes without the opt-in attribute: 48 KB less 1 KB for the kernels'
// static shared memory (at most 256 bytes: sv / red arrays).
static const long long SMEM_PLAIN = 47 * 1024;

// The most dynamic shared memory kernel k may take on the current device (the opt-in limit less k's static shared
// memory), with the attribute set on k for that device; cached per kernel (cache) and device (up to 16; a benign
// race: every thread stores the same value); 0 if refused.
template <typename K>
static int smem_optin(K k, int (&cache)[16]) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 16) {
    cudaGetLastError();
    return 0;
  }
  if (cache[dev] == 0) {   // 0: not asked yet; else the limit + 1
    int v = 0;
    cudaFuncAttributes fa;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
        cudaFuncGetAttributes(&fa, k) == cudaSuccess && (v -= (int)fa.sharedSizeBytes) > 0 &&
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, v) == cudaSuccess)
      cache[dev] = v + 1;
    else
      cache[dev] = 1;
    cudaGetLastError();
  }
  return cache[dev] - 1;
}

// Dynamic shared memory of the fused-norm decode matvecs: the staged rows (4 warps x R rows; 32 / RP warps x RP gate
// and RP up rows) and then x's q8_1 blocks (n_in int8 + n_in / 32 float2). One formula for the launchers and for
// strata_fused_norm_supported.
static long long fused_qkv_smem(long long rb, int R, int n_in) { return 4 * staged_size(R * rb) + n_in + n_in / 4; }
static long long fused_glu_smem(long long rb, int RP, int n_in) {
  return 2 * (32 / RP) * staged_size(RP * rb) + n_in + n_in / 4;
}

// Launch k_matvec_q8w (4 warps of R rows per block), staged when the block's rows fit in SMEM_PLAIN (else its warps
// prefetch them into L2). With a fused norm (fn.w != NULL): always staged (x's q8_1 blocks after the rows), FNC =
// dim / (8 * 128) rounded up to 1, 2 or 4 (dim <= 4096, checked by the launcher), up to the device's opt-in shared
// memory, else cudaErrorInvalidValue (strata_fused_norm_supported says so beforehand).
template <int T, int R, bool ROPE>
static int launch_q8w(cudaStream_t s, const uint8_t *W, const int8_t *q, const float2 *ds, float *y, int n_out,
                      int n_units, long long rb, const RopeKV &rk, const NormIn &fn, const ResidOut &ro = ResidOut{}) {
  const unsigned blocks = (unsigned)((n_out + 4 * R - 1) / (4 * R));
  const long long slot = staged_size((long long)R * rb);
  if constexpr (ROPE) {   // only the QKV matvec takes a fused norm (fewer instantiations)
    if (fn.w) {
      const size_t smem = (size_t)fused_qkv_smem(rb, R, fn.dim);   // = 4 * slot + x's q8_1 blocks
      const int c = (fn.dim + 1023) / 1024;
#define FQ(C) do { static int oi[16]; \
    if ((long long)smem > SMEM_PLAIN && (long long)smem > smem_optin(k_matvec_q8w<T, R, ROPE, true, C>, oi)) \
      return (int)cudaErrorInvalidValue; \
    st_launch(k_matvec_q8w<T, R, ROPE, true, C>, blocks, 128, smem, s, W, q, ds, y, n_out, n_units, rb, rk, (int)slot, \
              fn, ro); } while (0)
      if (c <= 1) FQ(1); else if (c <= 2) FQ(2); else FQ(4);
#undef FQ
      return 0;
    }
  }
  if (4 * slot <= SMEM_PLAIN) {
    st_launch(k_matvec_q8w<T, R, ROPE, true, 0>, blocks, 128, (size_t)(4 * slot), s, W, q, ds, y, n_out, n_units, rb,
              rk, (int)slot, fn, ro);
  } else {
    st_launch(k_matvec_q8w<T, R, ROPE, false, 0>, blocks, 128, 0, s, W, q, ds, y, n_out, n_units, rb, rk, 0, fn, ro);
  }
  return 0;
}

// strata_matvec_q8w, or (ro.x) its residual-add / norm-handoff form (strata_matvec_q8_resid).
static int matvec_q8w(void *stream, int t, const void *w, const void *xq, float *y, int n_out, int n_in,
                      int rows_per_warp, const ResidOut &ro) {
  if (const int e = q8_matvec_check(t, w, xq, n_out, n_in)) return e;
  const long long rb = row_bytes_of(t, n_in);
  const int R = rows_1_2_4(rows_per_warp);
  const int8_t *q = (const int8_t *)xq;
  const float2 *ds = (const float2 *)(q + n_in);
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
#define MW(TT, RR) launch_q8w<TT, RR, false>(s, W, q, ds, y, n_out, n_in / 32, rb, RopeKV{}, NormIn{}, ro)
#define MWR(TT) if (R == 1) MW(TT, 1); else if (R == 2) MW(TT, 2); else MW(TT, 4);
  DISPATCH_Q8_TYPE(t, MWR)
#undef MWR
#undef MW
  return (int)cudaGetLastError();
}

extern "C" int strata_matvec_q8w(void *stream, int t, const void *w, const void *xq, float *y, int n_out, int n_in,
                                 int rows_per_warp) {
  return matvec_q8w(stream, t, w, xq, y, n_out, n_in, rows_per_warp, ResidOut{});
}

// The host checks of a fused RMSNorm's inputs (NormIn) for a matvec of n_in columns run by `threads` threads per
// block: dim = n_in % 32 == 0, <= 4096 and <= 32 * threads (4 chunks of 8 per thread), x / delta / w / x_out
// 16-byte aligned, x_out distinct from x and delta; or a handed-off norm (ss != NULL): the other four pointers NULL,
// n_in % 32 == 0 and <= 4096. Fills *fn; 0 or cudaErrorInvalidValue / cudaErrorMisalignedAddress.
static int fused_norm_in(const float *x, const float *delta, const float *w, float *x_out, float eps, int n_in,
                         int threads, const float *ss, NormIn *fn) {
  *fn = NormIn{};
  if (ss) {   // handed-off norm (strata_matvec_q8_resid wrote xq and ss): nothing else
    if (w || x || delta || x_out || n_in <= 0 || n_in % 32 || n_in > FUSED_NORM_MAX_DIM)
      return (int)cudaErrorInvalidValue;
    fn->ss = ss;
    fn->eps = eps;
    fn->dim = n_in;
    return 0;
  }
  if (!w) return 0;
  if (!x || n_in <= 0 || n_in % 32 || n_in > FUSED_NORM_MAX_DIM || n_in > 32 * threads ||
      (x_out && (x_out == x || x_out == delta)))
    return (int)cudaErrorInvalidValue;
  if (((uintptr_t)x | (uintptr_t)delta | (uintptr_t)w | (uintptr_t)x_out) & 15) return (int)cudaErrorMisalignedAddress;
  *fn = NormIn{x, delta, w, x_out, eps, n_in, nullptr};
  return 0;
}

extern "C" int strata_matvec_q8w_rope(void *stream, int t, const void *w, const void *xq, float *qkv, int n_head,
                                      int n_kv, int hd, int n_in, int rows_per_warp, const int *pos, void *k_cache,
                                      void *v_cache, const int *page_table, int n_rot, float base, int page_size,
                                      const float *norm_x, const float *norm_delta, const float *norm_w,
                                      float *norm_x_out, float eps, int pre_wait, const float *norm_ss) {
  const int n_out = (n_head + 2 * n_kv) * hd;
  if (n_head <= 0 || n_kv <= 0 || hd <= 0 || hd % 2 || n_rot > hd || n_rot % 2 || n_rot < 0 || page_size <= 0 ||
      !pos || !k_cache || !v_cache || !page_table)
    return (int)cudaErrorInvalidValue;
  NormIn fn;
  if (const int e = fused_norm_in(norm_x, norm_delta, norm_w, norm_x_out, eps, n_in, 128, norm_ss, &fn)) return e;
  if (const int e = q8_matvec_check(t, w, norm_w ? w : xq, n_out, n_in)) return e;   // xq unused with a norm
  const long long rb = row_bytes_of(t, n_in);
  const int R = rows_1_2_4(rows_per_warp);
  const int8_t *q = (const int8_t *)xq;
  const float2 *ds = (const float2 *)(q + n_in);
  const RopeKV rk{pos,  page_table, (__half *)k_cache, (__half *)v_cache, n_head, n_kv, hd, n_rot, page_size, base,
                  pre_wait != 0};
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
  int rc = 0;
#define MW(TT, RR) rc = launch_q8w<TT, RR, true>(s, W, q, ds, qkv, n_out, n_in / 32, rb, rk, fn)
#define MWR(TT) if (R == 1) MW(TT, 1); else if (R == 2) MW(TT, 2); else MW(TT, 4);
  DISPATCH_Q8_TYPE(t, MWR)
#undef MWR
#undef MW
  return rc ? rc : (int)cudaGetLastError();
}

// Block-per-rows variant for long rows (the down projection: n_in = n_ff): a block of 4 warps takes RB consecutive
// rows and its 128 threads stride over the rows' 32-element sub-blocks (u = tid, tid + 128, ...), each x block
// loaded once for the RB rows; the four warps' partial sums meet in shared memory. One warp per row gives such a row
// 8+ dependent load rounds per lane and few warps per SM; here every load of a row is in flight at once. Same
// per-sub-block arithmetic as k_matvec_q8w; the sum runs in another order.
// STAGE: the block copies its rows into shared memory before the PDL wait (launch.cuh, "weight staging").
template <int T, int RB, bool STAGE>
__global__ void __launch_bounds__(128) k_matvec_q8b(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
                                                    const float2 *__restrict__ xds, float *__restrict__ y, int n_out,
                                                    int n_units, long long row_bytes, ResidOut ro) {
  griddep_launch();
  KT(KT_MATVEC_BLOCK, KT_START);
  extern __shared__ __align__(16) uint8_t staged[];
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const int row0 = blockIdx.x * RB;
  const int last = min(row0 + RB, n_out);   // rows [row0, last); a row past the end re-reads the last row
  const uint8_t *rows[RB];
  if (STAGE) {
    const uint8_t *b = stage_bytes(w + (long long)row0 * row_bytes, (long long)(last - row0) * row_bytes, staged,
                                   tid, 128);
#pragma unroll
    for (int r = 0; r < RB; r++) rows[r] = b + (long long)(min(row0 + r, n_out - 1) - row0) * row_bytes;
  } else {
#pragma unroll
    for (int r = 0; r < RB; r++) {
      rows[r] = w + (long long)min(row0 + r, n_out - 1) * row_bytes;
      if (row0 + r < n_out) prefetch_row_l2<128>(rows[r], row_bytes, tid);
    }
  }
  griddep_wait();
  KT(KT_MATVEC_BLOCK, KT_WAITED);
  const float xres = ro.x && tid < RB && row0 + tid < n_out ? ro.x[row0 + tid] : 0.f;   // residual add
  if (STAGE) {
    stage_wait();
    __syncthreads();
    KT(KT_MATVEC_BLOCK, KT_STAGED);
  }
  float acc[RB];
  strided_rows_dot<T, RB, 128>(rows, reinterpret_cast<const int *>(xq), xds, n_units, tid, acc);
  KT(KT_MATVEC_BLOCK, KT_DOTTED);
  __shared__ float part[4][RB];
#pragma unroll
  for (int r = 0; r < RB; r++) {
    float v = acc[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[wid][r] = v;
  }
  __syncthreads();
  if (tid < RB && row0 + tid < n_out) {
    const float v = (part[0][tid] + part[1][tid]) + (part[2][tid] + part[3][tid]);
    if (ro.x) {
      ro.x[row0 + tid] = xres + v;
    } else {
      y[row0 + tid] = v;
    }
  }
  if (ro.w) resid_handoff(ro, row0, RB);
  KT(KT_MATVEC_BLOCK, KT_END);
}

static int launch_q8b(void *stream, int t, const void *w, const void *xq, float *y, int n_out, int n_in,
                      int rows_per_block, const ResidOut &ro) {
  if (const int e = q8_matvec_check(t, w, xq, n_out, n_in)) return e;
  const long long rb = row_bytes_of(t, n_in);
  const int RB = rows_1_2_4(rows_per_block);
  const unsigned blocks = (unsigned)((n_out + RB - 1) / RB);
  const int8_t *q = (const int8_t *)xq;
  const float2 *ds = (const float2 *)(q + n_in);
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
  const long long slot = staged_size(RB * rb);
  const bool stage = slot <= SMEM_PLAIN;
#define MB(TT, RR) (stage ? st_launch(k_matvec_q8b<TT, RR, true>, blocks, 128, (size_t)slot, s, W, q, ds, y, n_out, \
                                      n_in / 32, rb, ro) \
                          : st_launch(k_matvec_q8b<TT, RR, false>, blocks, 128, 0, s, W, q, ds, y, n_out, n_in / 32, \
                                      rb, ro))
#define MBR(TT) if (RB == 1) MB(TT, 1); else if (RB == 2) MB(TT, 2); else MB(TT, 4);
  DISPATCH_Q8_TYPE(t, MBR)
#undef MBR
#undef MB
  return (int)cudaGetLastError();
}

extern "C" int strata_matvec_q8b(void *stream, int t, const void *w, const void *xq, float *y, int n_out, int n_in,
                                 int rows_per_block) {
  return launch_q8b(stream, t, w, xq, y, n_out, n_in, rows_per_block, ResidOut{});
}

extern "C" int strata_matvec_q8_resid(void *stream, int t, const void *w, const void *xq, int n_out, int n_in,
                                      int rows, int block, float *x, const float *norm_w, void *x_q8, float *x_ss,
                                      unsigned *counters) {
  if (!x || (norm_w && (!x_q8 || !x_ss || !counters || n_out % 32))) return (int)cudaErrorInvalidValue;
  if ((uintptr_t)x_q8 & 7) return (int)cudaErrorMisalignedAddress;
  const ResidOut ro{x, norm_w, (int8_t *)x_q8, x_ss, counters, n_out};
  return block ? launch_q8b(stream, t, w, xq, nullptr, n_out, n_in, rows, ro)
               : matvec_q8w(stream, t, w, xq, nullptr, n_out, n_in, rows, ro);
}

// SwiGLU fused into the gate/up decode matvec: act[i] = silu(gate_i . x) * (up_i . x), i < F, gate row i at
// wg + i * row_bytes and up row i at wu + i * row_bytes (for a fused [gate; up] weight wu = wg + F * row_bytes). A
// block of 32 / RP warps takes 32 consecutive i, RP per warp (2 RP rows; the x block in registers serves them all, as
// in k_matvec_q8w), so it holds a whole q8_1 block of act and writes it itself: the separate SwiGLU launch is gone.
// Same arithmetic, bit for bit, as k_matvec_q8w (R = 1) over both halves followed by k_swiglu_gu. F % 32 == 0.
// STAGE: each warp copies its RP gate and RP up rows into shared memory (2 slots of `slot` bytes per warp) before the
// PDL wait (launch.cuh, "weight staging").
// FNC > 0: the RMSNorm of fn fused into the prologue as in k_matvec_q8w (x's q8_1 blocks after the staged rows).
template <int T, int RP, bool STAGE, int FNC>
__global__ void __launch_bounds__(32 * (32 / RP)) k_matvec_q8w_glu(
    const uint8_t *__restrict__ wg, const uint8_t *__restrict__ wu, const int8_t *__restrict__ xq,
    const float2 *__restrict__ xds, float *__restrict__ act, int8_t *__restrict__ act_q8, int F, int n_units,
    long long row_bytes, int slot, NormIn fn) {
  griddep_launch();
  KT(KT_GLU, KT_START);
  extern __shared__ __align__(16) uint8_t staged[];
  float nw[FNC > 0 ? FNC : 1][8];
  if (FNC) fn_load_w(fn, nw);
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = blockIdx.x * 32 + wid * RP;
  const uint8_t *g = wg + (long long)i0 * row_bytes, *u = wu + (long long)i0 * row_bytes;
  if (STAGE) {
    g = stage_bytes(g, RP * row_bytes, staged + 2 * wid * slot, lane, 32);
    u = stage_bytes(u, RP * row_bytes, staged + (2 * wid + 1) * slot, lane, 32);
  } else {
#pragma unroll
    for (int r = 0; r < RP; r++) {
      prefetch_row_l2<32>(g + r * row_bytes, row_bytes, lane);
      prefetch_row_l2<32>(u + r * row_bytes, row_bytes, lane);
    }
  }
  griddep_wait();
  KT(KT_GLU, KT_WAITED);
  if (STAGE) {
    stage_wait();
    __syncwarp();
    KT(KT_GLU, KT_STAGED);
  }
  const uint8_t *rows[2 * RP];   // gate rows, then up rows
#pragma unroll
  for (int r = 0; r < RP; r++) {
    rows[r] = g + r * row_bytes;
    rows[RP + r] = u + r * row_bytes;
  }
  float acc[2 * RP];
  if (FNC) {
    __shared__ float red[32];
    int8_t *xs = reinterpret_cast<int8_t *>(staged + 2 * (32 / RP) * slot);
    fn_norm_q8(fn, nw, xs, reinterpret_cast<float2 *>(xs + fn.dim), red);
    KT(KT_GLU, KT_NORMED);
    strided_rows_dot<T, 2 * RP, 32, true>(rows, reinterpret_cast<const int *>(xs),
                                          reinterpret_cast<const float2 *>(xs + fn.dim), n_units, lane, acc);
  } else {
    const HandoffSS hss = handoff_load(fn);
    strided_rows_dot<T, 2 * RP, 32>(rows, reinterpret_cast<const int *>(xq), xds, n_units, lane, acc);
    if (fn.ss) {   // handed-off norm: the input's scale, on each lane's partial products (see the header)
      const float r = handoff_scale(fn, hss);
#pragma unroll
      for (int k = 0; k < 2 * RP; k++) acc[k] *= r;
    }
  }
  KT(KT_GLU, KT_DOTTED);
  __shared__ float sv[32];
#pragma unroll
  for (int r = 0; r < RP; r++) {
    float a = acc[r], b = acc[RP + r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    if (lane == 0) sv[wid * RP + r] = a / (1.f + expf(-a)) * b;
  }
  __syncthreads();
  if (wid == 0) {
    const float v = sv[lane];
    const int i = blockIdx.x * 32 + lane;
    if (act) act[i] = v;
    if (act_q8) q8_store(v, i, act_q8, reinterpret_cast<float2 *>(act_q8 + F));
  }
  KT(KT_GLU, KT_END);
}

// Launch k_matvec_q8w_glu (32 / RP warps per block), staged when the block's rows fit in the device's shared memory
// per block (the opt-in limit, smem_optin); with a fused norm always staged (dim <= 4096: FNC 1, or 2 with RP = 4),
// else cudaErrorInvalidValue (strata_fused_norm_supported says so beforehand).
template <int T, int RP>
static int launch_glu(cudaStream_t s, const uint8_t *G, const uint8_t *U, const int8_t *q, const float2 *ds,
                      float *act, int8_t *aq, int F, int n_units, long long rb, const NormIn &fn) {
  const unsigned blocks = (unsigned)(F / 32), threads = 32 * (32 / RP);
  const long long slot = staged_size((long long)RP * rb), smem = 2 * (32 / RP) * slot;
  if (fn.w) {   // fused norm: staged, x's q8_1 blocks after the rows
    const long long total = fused_glu_smem(rb, RP, fn.dim);   // = smem + x's q8_1 blocks
    const int c = (fn.dim + 8 * (int)threads - 1) / (8 * (int)threads);
#define FG(C) do { static int oi[16]; \
    if (total > smem_optin(k_matvec_q8w_glu<T, RP, true, C>, oi)) return (int)cudaErrorInvalidValue; \
    st_launch(k_matvec_q8w_glu<T, RP, true, C>, blocks, threads, (size_t)total, s, G, U, q, ds, act, aq, F, n_units, \
              rb, (int)slot, fn); } while (0)
    if (c <= 1) {
      FG(1);
    } else if constexpr (RP == 4) {   // 256 threads: 2 chunks of 8 up to 4096 (fused_norm_in's bound)
      FG(2);
    } else {
      return (int)cudaErrorInvalidValue;
    }
#undef FG
    return 0;
  }
  static int optin[16];
  if (smem <= smem_optin(k_matvec_q8w_glu<T, RP, true, 0>, optin))
    st_launch(k_matvec_q8w_glu<T, RP, true, 0>, blocks, threads, (size_t)smem, s, G, U, q, ds, act, aq, F, n_units,
              rb, (int)slot, fn);
  else
    st_launch(k_matvec_q8w_glu<T, RP, false, 0>, blocks, threads, 0, s, G, U, q, ds, act, aq, F, n_units, rb, 0, fn);
  return 0;
}

extern "C" int strata_matvec_q8w_glu(void *stream, int t, const void *w_gate, const void *w_up, const void *xq,
                                     float *act, void *act_q8, int F, int n_in, int pairs_per_warp) {
  return strata_matvec_q8w_glu_norm(stream, t, w_gate, w_up, xq, act, act_q8, F, n_in, pairs_per_warp, nullptr,
                                    nullptr, nullptr, nullptr, 0.f, nullptr);
}

extern "C" int strata_matvec_q8w_glu_norm(void *stream, int t, const void *w_gate, const void *w_up, const void *xq,
                                          float *act, void *act_q8, int F, int n_in, int pairs_per_warp,
                                          const float *norm_x, const float *norm_delta, const float *norm_w,
                                          float *norm_x_out, float eps, const float *norm_ss) {
  if (!strata_matvec_q8_supported(t) || n_in % block_elems(t) || n_in % 32 || F <= 0 || F % 32)
    return (int)cudaErrorInvalidValue;
  const int RP = rows_1_2_4(pairs_per_warp);
  NormIn fn;
  if (const int e = fused_norm_in(norm_x, norm_delta, norm_w, norm_x_out, eps, n_in, 32 * (32 / RP), norm_ss, &fn))
    return e;
  if (norm_w) xq = w_gate;   // unused with a fused norm: pass the alignment check
  if (((uintptr_t)xq & 15) || ((uintptr_t)w_gate & 15) || ((uintptr_t)w_up & 15) || ((uintptr_t)act_q8 & 7))
    return (int)cudaErrorMisalignedAddress;
  const long long rb = row_bytes_of(t, n_in);
  const int8_t *q = (const int8_t *)xq;
  const float2 *ds = (const float2 *)(q + n_in);
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *G = (const uint8_t *)w_gate, *U = (const uint8_t *)w_up;
  int8_t *aq = (int8_t *)act_q8;
  int rc = 0;
#define MG(TT, RR) rc = launch_glu<TT, RR>(s, G, U, q, ds, act, aq, F, n_in / 32, rb, fn)
#define MGR(TT) if (RP == 1) MG(TT, 1); else if (RP == 2) MG(TT, 2); else MG(TT, 4);
  DISPATCH_Q8_TYPE(t, MGR)
#undef MGR
#undef MG
  return rc ? rc : (int)cudaGetLastError();
}

extern "C" int strata_fused_norm_supported(int t_qkv, int t_gate_up, int n_in, int rows_per_warp, int pairs_per_warp) {
  if (!strata_matvec_q8_supported(t_qkv) || !strata_matvec_q8_supported(t_gate_up) || n_in <= 0 || n_in % 32 ||
      n_in > FUSED_NORM_MAX_DIM || n_in % block_elems(t_qkv) || n_in % block_elems(t_gate_up))
    return 0;
  const int R = rows_1_2_4(rows_per_warp);
  const int RP = rows_1_2_4(pairs_per_warp);
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  // both kernels may take the opt-in limit less their static shared memory (<= 256 bytes; 1 KB kept)
  const long long limit = optin - 1024 > SMEM_PLAIN ? optin - 1024 : SMEM_PLAIN;
  return fused_qkv_smem(row_bytes_of(t_qkv, n_in), R, n_in) <= limit &&
         fused_glu_smem(row_bytes_of(t_gate_up, n_in), RP, n_in) <= limit;
}

// ---------------------------------------------------------------- RMSNorm (+ residual)
__device__ static inline float block_sum(float v, float *sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < nw; i++) t += sh[i];
  return t;
}

__global__ void k_rms_norm(const float *__restrict__ x, const float *__restrict__ res, const float *__restrict__ wt,
                           float *__restrict__ out, float *__restrict__ sum_out, __half *__restrict__ out16,
                           int8_t *__restrict__ out_q8, int dim, float eps) {
  griddep_launch();
  griddep_wait();
  __shared__ float sh[32];
  const long long base = (long long)blockIdx.x * dim;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float s = x[base + i] + (res ? res[base + i] : 0.f);
    if (sum_out) sum_out[base + i] = s;
    ss += s * s;
  }
  const float tot = block_sum(ss, sh);
  const float r = rsqrtf(tot / (float)dim + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {   // dim % 32 == 0 when out_q8: warps stay whole
    // sum_out may alias x or residual: re-read the sum this thread stored, not the overwritten inputs
    float s = sum_out ? sum_out[base + i] : x[base + i] + (res ? res[base + i] : 0.f);
    const float v = s * r * wt[i];
    if (out) out[base + i] = v;
    if (out16) out16[base + i] = __float2half(v);
    if (out_q8) q8_store(v, i, out_q8, reinterpret_cast<float2 *>(out_q8 + dim));
  }
}

// The same RMSNorm with the row held in registers (EPT elements per thread, dim <= 256 * EPT): all loads of a
// thread are issued before any store (the loop form above serializes each load behind the previous iteration's
// possibly-aliasing store: ~8 dependent L2 round trips per pass for a 2048-wide row), and the norm weights are read
// before griddep_wait (constants), overlapping the previous kernel under PDL. Aliasing rules are those of k_rms_norm
// (an element is loaded and stored by one thread only).
template <int EPT>
__global__ void __launch_bounds__(256) k_rms_norm_r(const float *x, const float *res, const float *__restrict__ wt,
                                                    float *out, float *sum_out, __half *out16, int8_t *out_q8, int dim,
                                                    float eps) {
  griddep_launch();
  float w[EPT], v[EPT];
#pragma unroll
  for (int k = 0; k < EPT; k++) {
    const int i = threadIdx.x + 256 * k;
    w[k] = i < dim ? __ldg(wt + i) : 0.f;
  }
  griddep_wait();
  __shared__ float sh[32];
  const long long base = (long long)blockIdx.x * dim;
#pragma unroll
  for (int k = 0; k < EPT; k++) {
    const int i = threadIdx.x + 256 * k;
    v[k] = i < dim ? x[base + i] + (res ? res[base + i] : 0.f) : 0.f;
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < EPT; k++) ss += v[k] * v[k];
  if (sum_out) {
#pragma unroll
    for (int k = 0; k < EPT; k++) {
      const int i = threadIdx.x + 256 * k;
      if (i < dim) sum_out[base + i] = v[k];
    }
  }
  const float r = rsqrtf(block_sum(ss, sh) / (float)dim + eps);
#pragma unroll
  for (int k = 0; k < EPT; k++) {
    const int i = threadIdx.x + 256 * k;
    if (i < dim) {                         // warp-uniform when dim % 32 == 0 (required with out_q8)
      const float y = v[k] * r * w[k];
      if (out) out[base + i] = y;
      if (out16) out16[base + i] = __float2half(y);
      if (out_q8) q8_store(y, i, out_q8, reinterpret_cast<float2 *>(out_q8 + dim));
    }
  }
}

// The register RMSNorm with each thread holding EPT consecutive elements [EPT * t, EPT * t + EPT) (dim % EPT == 0,
// dim <= 256 * EPT): a q8_1 block of 32 elements is 32 / EPT neighbouring lanes, so its absmax and integer sum take
// log2(32 / EPT) shuffles after a per-thread pass (k_rms_norm_r's lane-per-element q8_store takes 10 shuffles per
// element group, EPT times over); same q8_1 arithmetic per element as q8_store (llama.cpp quantize_q8_1). The sum
// of squares runs in another order than k_rms_norm_r (f32 rounding differs in the last bits).
template <int EPT>
__global__ void __launch_bounds__(256) k_rms_norm_c(const float *x, const float *res, const float *__restrict__ wt,
                                                    float *out, float *sum_out, __half *out16, int8_t *out_q8, int dim,
                                                    float eps) {
  griddep_launch();
  KT(KT_NORM, KT_START);
  const int e0 = EPT * threadIdx.x;
  const bool live = e0 < dim;
  float w[EPT], v[EPT];
#pragma unroll
  for (int k = 0; k < EPT; k++) w[k] = live ? __ldg(wt + e0 + k) : 0.f;
  griddep_wait();
  KT(KT_NORM, KT_WAITED);
  __shared__ float sh[32];
  const long long base = (long long)blockIdx.x * dim + e0;
#pragma unroll
  for (int k = 0; k < EPT; k++) v[k] = live ? x[base + k] + (res ? res[base + k] : 0.f) : 0.f;
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < EPT; k++) ss += v[k] * v[k];
  if (sum_out && live) {
#pragma unroll
    for (int k = 0; k < EPT; k++) sum_out[base + k] = v[k];
  }
  const float r = rsqrtf(block_sum(ss, sh) / (float)dim + eps);
  float y[EPT];
#pragma unroll
  for (int k = 0; k < EPT; k++) y[k] = v[k] * r * w[k];
  if (live) {
    if (out) {
#pragma unroll
      for (int k = 0; k < EPT; k++) out[base + k] = y[k];
    }
    if (out16) {
#pragma unroll
      for (int k = 0; k < EPT; k++) out16[base + k] = __float2half(y[k]);
    }
  }
  if (out_q8) {   // n_rows == 1, dim % 32 == 0: a group's lanes are all live or all not (warp-uniform shuffles)
    float d;
    int q[EPT], sum;
    q8_chunk(y, q, d, sum);
    if (live) {
#pragma unroll
      for (int k = 0; k < EPT; k++) out_q8[e0 + k] = (int8_t)q[k];
      if ((e0 & 31) == 0) reinterpret_cast<float2 *>(out_q8 + dim)[e0 >> 5] = make_float2(d, d * (float)sum);
    }
  }
  KT(KT_NORM, KT_END);
}

extern "C" int strata_rms_norm(void *stream, const float *x, const float *res, const float *w, float *out,
                               float *sum_out, int n_rows, int dim, float eps) {
  return strata_rms_norm_ex(stream, x, res, w, out, sum_out, nullptr, nullptr, n_rows, dim, eps);
}

extern "C" int strata_rms_norm_ex(void *stream, const float *x, const float *res, const float *w, float *out,
                                  float *sum_out, void *out16, void *out_q8, int n_rows, int dim, float eps) {
  if (n_rows <= 0) return 0;
  if (out_q8 && (n_rows != 1 || dim % 32)) return (int)cudaErrorInvalidValue;
  // out may alias x or sum_out: each element is read (both passes) before it is written only by its own thread.
  cudaStream_t st = (cudaStream_t)stream;
  __half *o16 = (__half *)out16;
  int8_t *oq = (int8_t *)out_q8;
  if (dim % 32 == 0 && dim <= 8192) {   // EPT = dim / 256 rounded up to a power of two, at most 32
    const int ept = dim <= 256 ? 1 : dim <= 512 ? 2 : dim <= 1024 ? 4 : dim <= 2048 ? 8 : dim <= 4096 ? 16 : 32;
#define RC(E) st_launch(k_rms_norm_c<E>, n_rows, 256, 0, st, x, res, w, out, sum_out, o16, oq, dim, eps)
    if (ept == 1) RC(1); else if (ept == 2) RC(2); else if (ept == 4) RC(4);
    else if (ept == 8) RC(8); else if (ept == 16) RC(16); else RC(32);
#undef RC
    return (int)cudaGetLastError();
  }
  // a width not a multiple of 32: the lane-per-element register kernel; wider than 8192: the loop kernel
#define RN(E) st_launch(k_rms_norm_r<E>, n_rows, 256, 0, st, x, res, w, out, sum_out, o16, oq, dim, eps)
  if (dim <= 256) RN(1);
  else if (dim <= 512) RN(2);
  else if (dim <= 1024) RN(4);
  else if (dim <= 2048) RN(8);
  else if (dim <= 4096) RN(16);
  else if (dim <= 8192) RN(32);
  else st_launch(k_rms_norm, n_rows, 256, 0, st, x, res, w, out, sum_out, o16, oq, dim, eps);
#undef RN
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- RoPE
__global__ void k_rope(float *x, const int *pos, int n_tokens, int n_heads, int hd, int n_rot, float base, int neox) {
  griddep_launch();
  griddep_wait();
  const int half = n_rot / 2;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)n_tokens * n_heads * half) return;
  const int i = (int)(idx % half);
  const long long th = idx / half;
  const int t = (int)(th / n_heads);
  float *p = x + th * hd;
  const double inv = pow((double)base, -2.0 * (double)i / (double)n_rot);
  const double ang = (double)pos[t] * inv;
  const float c = (float)cos(ang), s = (float)sin(ang);
  const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
  const float x0 = p[a], x1 = p[b];
  p[a] = x0 * c - x1 * s;
  p[b] = x0 * s + x1 * c;
}

extern "C" int strata_rope(void *stream, float *x, const int *positions, int n_tokens, int n_heads, int hd,
                           int n_rot, float base, int neox) {
  if (n_rot > hd || n_rot % 2) return (int)cudaErrorInvalidValue;
  const long long total = (long long)n_tokens * n_heads * (n_rot / 2);
  if (total == 0) return 0;
  st_launch(k_rope, (unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream, x, positions, n_tokens, n_heads, hd,
                                                                            n_rot, base, neox);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- SwiGLU
__global__ void k_swiglu(const float *g, const float *u, float *o, long long n) {
  griddep_launch();
  griddep_wait();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const float a = g[i];
    o[i] = a / (1.f + expf(-a)) * u[i];
  }
}

extern "C" int strata_swiglu(void *stream, const float *g, const float *u, float *o, long long n) {
  if (n <= 0) return 0;
  st_launch(k_swiglu, (unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)stream, g, u, o, n);
  return (int)cudaGetLastError();
}

// SwiGLU of a fused gate|up buffer gu f32 (n, 2F) (gate = gu[t, :F], up = gu[t, F:]) into any of: f32 out (n, F),
// f16 out16 (n, F), q8_1 blocks out_q8 (n == 1, F % 32 == 0).
__global__ void k_swiglu_gu(const float *__restrict__ gu, int F, long long total, float *__restrict__ out,
                            __half *__restrict__ out16, int8_t *__restrict__ out_q8) {
  griddep_launch();
  griddep_wait();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  float v = 0.f;
  if (i < total) {
    const long long t = i / F, j = i % F;
    const float a = gu[t * 2 * F + j];
    v = a / (1.f + expf(-a)) * gu[t * 2 * F + F + j];
    if (out) out[i] = v;
    if (out16) out16[i] = __float2half(v);
  }
  if (out_q8 && i - (threadIdx.x & 31) < total) q8_store(v, (int)i, out_q8, reinterpret_cast<float2 *>(out_q8 + total));
}

extern "C" int strata_swiglu_gu(void *stream, const float *gu, int n, int F, float *out, void *out16, void *out_q8) {
  const long long total = (long long)n * F;
  if (total <= 0) return 0;
  if (out_q8 && (n != 1 || F % 32)) return (int)cudaErrorInvalidValue;
  st_launch(k_swiglu_gu, (unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream, gu, F, total, out, (__half *)out16,
                                                                                 (int8_t *)out_q8);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- paged KV cache (f16)
// (kv_index, the element offset of (position, KV head, dim) in a paged cache, is defined with the decode matvecs)

__global__ void k_kv_write(const float *k, const float *v, __half *kc, __half *vc, const int *pt, const int *d_start,
                           int start_off, int n, int n_kv, int hd, int ps) {
  griddep_launch();
  griddep_wait();
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)n * n_kv * hd) return;
  const int d = (int)(idx % hd);
  const int h = (int)((idx / hd) % n_kv);
  const int t = (int)(idx / ((long long)hd * n_kv));
  const int pos = (d_start ? *d_start : 0) + start_off + t;
  const long long o = kv_index(pt, pos, h, d, n_kv, hd, ps);
  kc[o] = __float2half(k[idx]);
  vc[o] = __float2half(v[idx]);
}

extern "C" int strata_kv_write(void *stream, const float *k, const float *v, void *kc, void *vc, const int *pt,
                               const int *d_start, int start_off, int n, int n_kv, int hd, int ps) {
  const long long total = (long long)n * n_kv * hd;
  if (total == 0) return 0;
  st_launch(k_kv_write, (unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream, 
      k, v, (__half *)kc, (__half *)vc, pt, d_start, start_off, n, n_kv, hd, ps);
  return (int)cudaGetLastError();
}

__global__ void k_kv_gather(const __half *kc, const __half *vc, const int *pt, float *ko, float *vo, int len, int n_kv,
                            int hd, int ps) {
  griddep_launch();
  griddep_wait();
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)n_kv * len * hd) return;
  const int d = (int)(idx % hd);
  const int p = (int)((idx / hd) % len);
  const int h = (int)(idx / ((long long)hd * len));
  const long long o = kv_index(pt, p, h, d, n_kv, hd, ps);
  ko[idx] = __half2float(kc[o]);
  vo[idx] = __half2float(vc[o]);
}

extern "C" int strata_kv_gather(void *stream, const void *kc, const void *vc, const int *pt, float *ko, float *vo,
                                int len, int n_kv, int hd, int ps) {
  const long long total = (long long)n_kv * len * hd;
  if (total == 0) return 0;
  st_launch(k_kv_gather, (unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream, 
      (const __half *)kc, (const __half *)vc, pt, ko, vo, len, n_kv, hd, ps);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- decode attention (split-K)
// Merge head h's n_split split-K partials (M, L, O[hd] each, as k_attn_decode writes them) into out[h * hd ..] and,
// with out_q8, its q8_1 blocks (int8 [n_head * hd] then float2 per 32). Partials are read through L2 (__ldcg): other
// blocks of the calling grid may have written them. Every thread of the block calls it; hd % 32 == 0, so the loop
// over d keeps warps whole (q8_store's shuffles) with any multiple of 32 threads.
__device__ static void attn_merge_head(const float *partial, int h, int n_split, int hd, int n_head, float *out,
                                       int8_t *out_q8) {
  const float *p = partial + (long long)h * n_split * (hd + 2);
  float M = -INFINITY;
  for (int s = 0; s < n_split; s++) M = fmaxf(M, __ldcg(p + s * (hd + 2)));
  float L = 0.f;
  for (int s = 0; s < n_split; s++) {
    const float ms = __ldcg(p + s * (hd + 2));
    if (ms > -INFINITY) L += __ldcg(p + s * (hd + 2) + 1) * __expf(ms - M);
  }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < n_split; s++) {
      const float ms = __ldcg(p + s * (hd + 2));
      if (ms > -INFINITY) acc += __ldcg(p + s * (hd + 2) + 2 + d) * __expf(ms - M);
    }
    out[h * hd + d] = acc / L;
    if (out_q8) q8_store(acc / L, h * hd + d, out_q8, reinterpret_cast<float2 *>(out_q8 + n_head * hd));
  }
}

// The split-K kernels' tail with a fused merge (counters != NULL): the last block of head h to store its partial
// (a count per head, arrive_acq_rel, reset by that block) merges the head's splits, so no k_attn_combine launch
// follows. Every thread of the block calls it after its stores.
__device__ static void attn_split_tail(const float *partial, unsigned *counters, int h, int n_split, int hd,
                                       int n_head, float *out, int8_t *out_q8) {
  if (!counters) return;
  __shared__ int last;
  if (n_split > 1) {
    __syncthreads();
    if (threadIdx.x == 0) last = arrive_acq_rel(&counters[h], 1u) == (unsigned)(n_split - 1);
    __syncthreads();
    if (!last) return;   // block-uniform
  } else {
    __syncthreads();
  }
  attn_merge_head(partial, h, n_split, hd, n_head, out, out_q8);
  if (n_split > 1 && threadIdx.x == 0) counters[h] = 0;
}

// The end of a split-K decode block (after __syncthreads; every thread calls it): its NG groups' online-softmax states
// (sm, sl, so in shared memory) merged into the split's partial (M, L, O[HD]) and then attn_split_tail; with counters
// and one split the block is the whole head, so the output is written directly and no partial is read back (merging
// one split multiplies by __expf(0) = 1: the same bits as attn_merge_head).
template <int NG, int HD>
__device__ static void attn_block_finish(const float (&sm)[NG], const float (&sl)[NG], const float (&so)[NG][HD],
                                         float *partial, unsigned *counters, int h, int sp, int n_split, int n_head,
                                         float *out, int8_t *out_q8) {
  float M = -INFINITY;
  for (int w = 0; w < NG; w++) M = fmaxf(M, sm[w]);
  float L = 0.f;
  for (int w = 0; w < NG; w++)
    if (sm[w] > -INFINITY) L += sl[w] * __expf(sm[w] - M);
  const bool direct = counters && n_split == 1;   // block-uniform
  float *dst = partial + ((long long)h * n_split + sp) * (HD + 2);
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {   // warp-uniform (HD % 32 == 0): q8_store's shuffles
    float acc = 0.f;
    for (int w = 0; w < NG; w++)
      if (sm[w] > -INFINITY) acc += so[w][d] * __expf(sm[w] - M);
    if (!direct) {
      dst[2 + d] = acc;
    } else {
      out[h * HD + d] = acc / L;
      if (out_q8) q8_store(acc / L, h * HD + d, out_q8, reinterpret_cast<float2 *>(out_q8 + n_head * HD));
    }
  }
  if (direct) return;
  if (threadIdx.x == 0) {
    dst[0] = M;
    dst[1] = L;
  }
  attn_split_tail(partial, counters, h, n_split, HD, n_head, out, out_q8);
}

#define ATT_WARPS 4
template <int EPL>  // elements per lane: hd = 32 * EPL
__global__ void k_attn_decode(const float *__restrict__ q, const __half *__restrict__ kc, const __half *__restrict__ vc,
                              const int *__restrict__ pt, const int *d_len, int len_arg, float *__restrict__ partial,
                              int n_head, int n_kv, int ps, int n_split, float scale, unsigned *counters, float *out,
                              int8_t *out_q8, int /* pre_wait: reads everything after the wait */) {
  griddep_launch();
  KT(KT_ATTN, KT_START);
  griddep_wait();
  KT(KT_ATTN, KT_WAITED);
  constexpr int hd = 32 * EPL;
  const int h = blockIdx.x, sp = blockIdx.y;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int kvh = h / (n_head / n_kv);
  const int len = d_len ? *d_len : len_arg;
  const int chunk = (len + n_split - 1) / n_split;
  const int beg = sp * chunk, end = min(len, beg + chunk);
  float qv[EPL], o[EPL];
#pragma unroll
  for (int k = 0; k < EPL; k++) { qv[k] = q[h * hd + lane + 32 * k] * scale; o[k] = 0.f; }
  float m = -INFINITY, l = 0.f;
  for (int p = beg + wid; p < end; p += ATT_WARPS) {
    const long long base = (((long long)pt[p / ps] * ps + (p % ps)) * n_kv + kvh) * hd;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < EPL; k++) s += qv[k] * __half2float(kc[base + lane + 32 * k]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    const float mn = fmaxf(m, s);
    const float corr = __expf(m - mn), pe = __expf(s - mn);
    l = l * corr + pe;
#pragma unroll
    for (int k = 0; k < EPL; k++) o[k] = o[k] * corr + pe * __half2float(vc[base + lane + 32 * k]);
    m = mn;
  }
  __shared__ float sm[ATT_WARPS], sl[ATT_WARPS], so[ATT_WARPS][hd];
  if (lane == 0) { sm[wid] = m; sl[wid] = l; }
#pragma unroll
  for (int k = 0; k < EPL; k++) so[wid][lane + 32 * k] = o[k];
  __syncthreads();
  attn_block_finish(sm, sl, so, partial, counters, h, sp, n_split, n_head, out, out_q8);
  KT(KT_ATTN, KT_END);
}

__global__ void k_attn_combine(const float *partial, float *out, int8_t *out_q8, int n_split, int hd) {
  griddep_launch();
  KT(KT_ATTN_MERGE, KT_START);
  griddep_wait();
  KT(KT_ATTN_MERGE, KT_WAITED);
  attn_merge_head(partial, blockIdx.x, n_split, hd, gridDim.x, out, out_q8);
  KT(KT_ATTN_MERGE, KT_END);
}

// Decode attention with several positions per warp in flight: a group of LP = hd / 8 lanes owns one position
// (each lane one 16-byte load of 8 f16 K values and 8 V values), so a warp reads 32 / LP positions per step and
// each group unrolls 2 positions (loads issued before the dot products). Each group keeps its own online softmax
// (m, l, o); groups and warps are merged in shared memory into the same (M, L, O) partial as k_attn_decode (or,
// with counters and one split, straight into the output).
template <int LP>
__global__ void k_attn_decode_v(const float *__restrict__ q, const __half *__restrict__ kc,
                                const __half *__restrict__ vc, const int *__restrict__ pt, const int *d_len,
                                int len_arg, float *__restrict__ partial, int n_head, int n_kv, int ps, int n_split,
                                float scale, unsigned *counters, float *out, int8_t *out_q8, int pre_wait) {
  griddep_launch();
  KT(KT_ATTN, KT_START);
  constexpr int hd = 8 * LP, PPW = 32 / LP, NG = ATT_WARPS * PPW, STEP = 2 * NG;
  const int h = blockIdx.x, sp = blockIdx.y;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, grp = lane / LP, gl = lane % LP;
  const int kvh = h / (n_head / n_kv);
  const int g_id = wid * PPW + grp;
  // the length, the split's range and the pages of the first step's two positions (pga, pgb): before the PDL wait
  // when the caller allows it (pre_wait: no earlier kernel of the PDL chain writes the length or page table), so
  // that after it only q and the K / V rows are loaded (the first step's K / V include the position the previous
  // kernel wrote)
  int len = 0, beg = 0, end = 0, pga = 0, pgb = 0;
  auto bounds = [&]() {
    len = d_len ? *d_len : len_arg;
    const int chunk = (len + n_split - 1) / n_split;
    beg = sp * chunk;
    end = min(len, beg + chunk);
    if (beg < end) {
      pga = pt[min(beg + g_id, end - 1) / ps];
      pgb = pt[min(beg + NG + g_id, end - 1) / ps];
    }
  };
  if (pre_wait) bounds();
  griddep_wait();
  KT(KT_ATTN, KT_WAITED);
  if (!pre_wait) bounds();
  float qv[8], o[8];
  {
    const float4 *qp = reinterpret_cast<const float4 *>(q + h * hd + 8 * gl);
    const float4 a = qp[0], b = qp[1];
    qv[0] = a.x * scale; qv[1] = a.y * scale; qv[2] = a.z * scale; qv[3] = a.w * scale;
    qv[4] = b.x * scale; qv[5] = b.y * scale; qv[6] = b.z * scale; qv[7] = b.w * scale;
  }
#pragma unroll
  for (int i = 0; i < 8; i++) o[i] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int p0 = beg; p0 < end; p0 += STEP) {
    const int pa = p0 + g_id, pb = p0 + NG + g_id;
    const bool va = pa < end, vb = pb < end;
    // positions past the end load the range's last one (valid; its score is not used): unconditional loads are
    // all in flight together, a load behind a branch waits for the previous one's use
    const int qa = min(pa, end - 1), qb = min(pb, end - 1);
    if (p0 != beg) {
      pga = pt[qa / ps];
      pgb = pt[qb / ps];
    }
    const long long ba = (((long long)pga * ps + (qa % ps)) * n_kv + kvh) * hd + 8 * gl;
    const long long bb = (((long long)pgb * ps + (qb % ps)) * n_kv + kvh) * hd + 8 * gl;
    const uint4 ka = *reinterpret_cast<const uint4 *>(kc + ba), xa = *reinterpret_cast<const uint4 *>(vc + ba);
    const uint4 kb = *reinterpret_cast<const uint4 *>(kc + bb), xb = *reinterpret_cast<const uint4 *>(vc + bb);
    const __half2 *k2a = reinterpret_cast<const __half2 *>(&ka), *k2b = reinterpret_cast<const __half2 *>(&kb);
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 fa = __half22float2(k2a[i]), fb = __half22float2(k2b[i]);
      sa += qv[2 * i] * fa.x + qv[2 * i + 1] * fa.y;
      sb += qv[2 * i] * fb.x + qv[2 * i + 1] * fb.y;
    }
#pragma unroll
    for (int off = LP / 2; off > 0; off >>= 1) {
      sa += __shfl_xor_sync(0xffffffffu, sa, off);
      sb += __shfl_xor_sync(0xffffffffu, sb, off);
    }
    if (va) {
      const float mn = fmaxf(m, vb ? fmaxf(sa, sb) : sa);
      const float corr = __expf(m - mn), ea = __expf(sa - mn), eb = vb ? __expf(sb - mn) : 0.f;
      l = l * corr + ea + eb;
      const __half2 *v2a = reinterpret_cast<const __half2 *>(&xa), *v2b = reinterpret_cast<const __half2 *>(&xb);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float2 fa = __half22float2(v2a[i]), fb = __half22float2(v2b[i]);
        o[2 * i] = o[2 * i] * corr + ea * fa.x + eb * fb.x;
        o[2 * i + 1] = o[2 * i + 1] * corr + ea * fa.y + eb * fb.y;
      }
      m = mn;
    }
  }
  __shared__ float sm[NG], sl[NG], so[NG][hd];
  if (gl == 0) { sm[g_id] = m; sl[g_id] = l; }
#pragma unroll
  for (int i = 0; i < 8; i++) so[g_id][8 * gl + i] = o[i];
  __syncthreads();
  attn_block_finish(sm, sl, so, partial, counters, h, sp, n_split, n_head, out, out_q8);
  KT(KT_ATTN, KT_END);
}

extern "C" int strata_attn_decode(void *stream, const float *q, const void *kc, const void *vc, const int *pt,
                                  const int *d_len, int len, float *partial, float *out, int n_head, int n_kv, int hd,
                                  int ps, int n_split, float scale) {
  return strata_attn_decode_ex(stream, q, kc, vc, pt, d_len, len, partial, out, nullptr, nullptr, 0, n_head, n_kv,
                               hd, ps, n_split, scale);
}

extern "C" int strata_attn_decode_ex(void *stream, const float *q, const void *kc, const void *vc, const int *pt,
                                     const int *d_len, int len, float *partial, float *out, void *out_q8,
                                     unsigned *counters, int pre_wait, int n_head, int n_kv, int hd, int ps,
                                     int n_split, float scale) {
  if (hd % 32 || hd > 256 || hd <= 0 || n_kv <= 0 || n_head % n_kv || n_split < 1) return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  dim3 grid(n_head, n_split);
  const __half *K = (const __half *)kc, *V = (const __half *)vc;
  int8_t *oq = (int8_t *)out_q8;
#define AD(E) st_launch(k_attn_decode<E>, grid, 32 * ATT_WARPS, 0, s, q, K, V, pt, d_len, len, partial, n_head, n_kv, ps, n_split, scale, counters, out, oq, pre_wait)
#define AV(LP) st_launch(k_attn_decode_v<LP>, grid, 32 * ATT_WARPS, 0, s, q, K, V, pt, d_len, len, partial, n_head, n_kv, ps, n_split, scale, counters, out, oq, pre_wait)
  // 32 / 64 / 128 / 256: 16-byte lane groups; the other multiples of 32: one position per warp step
  switch (hd) {
    case 32: AV(4); break; case 64: AV(8); break; case 128: AV(16); break; case 256: AV(32); break;
    default:
      switch (hd / 32) {
        case 3: AD(3); break; case 5: AD(5); break; case 6: AD(6); break; case 7: AD(7); break;
      }
  }
#undef AV
#undef AD
  // without counters the merge is a second launch (one block of hd threads per head)
  if (!counters) st_launch(k_attn_combine, n_head, hd, 0, s, partial, out, oq, n_split, hd);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- causal softmax (prefill attention)
__global__ void k_causal_softmax(float *s, int n_q, int len, int pos0, float scale) {
  griddep_launch();
  griddep_wait();
  __shared__ float sh[32];
  const int r = blockIdx.x;
  float *row = s + (long long)r * len;
  const int lim = min(len, pos0 + (r % n_q) + 1);
  float m = -INFINITY;
  for (int j = threadIdx.x; j < lim; j += blockDim.x) m = fmaxf(m, row[j] * scale);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sh[wid] = m;
  __syncthreads();
  m = -INFINITY;
  for (int i = 0; i < nw; i++) m = fmaxf(m, sh[i]);
  float sum = 0.f;
  for (int j = threadIdx.x; j < lim; j += blockDim.x) {
    const float e = __expf(row[j] * scale - m);
    row[j] = e;
    sum += e;
  }
  const float tot = block_sum(sum, sh);
  const float inv = 1.f / tot;
  for (int j = threadIdx.x; j < len; j += blockDim.x) row[j] = j < lim ? row[j] * inv : 0.f;
}

extern "C" int strata_causal_softmax(void *stream, float *s, int n_rows, int n_q, int len, int pos0, float scale) {
  if (n_rows <= 0) return 0;
  st_launch(k_causal_softmax, n_rows, 256, 0, (cudaStream_t)stream, s, n_q, len, pos0, scale);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- prefill attention: tiled, flash-style (f16 MMA)
// Causal GQA attention of n new queries (positions length..length+n-1) over the paged f16 cache, without
// materializing the score matrix: a block takes 64 queries of one head (4 warps x 16 rows) and one split of the
// key range; per 64-key tile S = Q K^T (wmma m16n16k16, f16 inputs scaled by `scale`, f32 accumulate), causal
// mask, online softmax (FlashAttention, Dao et al. 2022: running max m and sum l per row; P rounded to f16),
// O += P V (wmma, f32 accumulate, O kept in shared memory). Each split writes (m, l, O) per row; a combine
// kernel merges the splits: out = sum_s O_s e^(m_s - M) / sum_s l_s e^(m_s - M).
#define FA_BQ 64
#define FA_BK 64
template <int HD>
struct FaSmem {
  static constexpr int LDH = HD + 8, LDS = FA_BK + 4, LDP = FA_BK + 8, LDO = HD + 4;
  static constexpr size_t bytes = (size_t)3 * 64 * LDH * 2 + (size_t)64 * LDS * 4 + (size_t)64 * LDP * 2 +
                                  (size_t)64 * LDO * 4 + 2 * 64 * 4;
};

template <int HD>
__global__ void __launch_bounds__(128) k_flash_prefill(const float *__restrict__ q, const __half *__restrict__ kc,
                                                       const __half *__restrict__ vc, const int *__restrict__ pt,
                                                       float *__restrict__ ws, int n, int n_head, int n_kv, int ps,
                                                       int length, int tiles_per_split, float scale) {
  griddep_launch();
  griddep_wait();
  using namespace nvcuda;
  using SM = FaSmem<HD>;
  constexpr int LDH = SM::LDH, LDS = SM::LDS, LDP = SM::LDP, LDO = SM::LDO;
  extern __shared__ __align__(128) unsigned char fa_smem[];
  __half *Qs = reinterpret_cast<__half *>(fa_smem);
  __half *Ks = Qs + 64 * LDH;
  __half *Vs = Ks + 64 * LDH;
  float *Ss = reinterpret_cast<float *>(Vs + 64 * LDH);
  __half *Ps = reinterpret_cast<__half *>(Ss + 64 * LDS);
  float *Os = reinterpret_cast<float *>(Ps + 64 * LDP);
  float *Ms = Os + 64 * LDO;
  float *Ls = Ms + 64;
  const int i0 = blockIdx.x * FA_BQ, h = blockIdx.y, split = blockIdx.z;
  const int kvh = h / (n_head / n_kv);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int total = length + n;
  for (int idx = tid; idx < FA_BQ * HD; idx += 128) {
    const int r = idx / HD, d = idx % HD, i = i0 + r;
    Qs[r * LDH + d] = __float2half(i < n ? q[((long long)i * n_head + h) * HD + d] * scale : 0.f);
  }
  for (int idx = tid; idx < 64 * LDO; idx += 128) Os[idx] = 0.f;
  if (tid < 64) { Ms[tid] = -INFINITY; Ls[tid] = 0.f; }
  const int q_last = length + min(n, i0 + FA_BQ) - 1;
  const int t_beg = split * tiles_per_split * FA_BK;
  const int t_end = min(q_last + 1, t_beg + tiles_per_split * FA_BK);
  for (int t0 = t_beg; t0 < t_end; t0 += FA_BK) {
    __syncthreads();
    constexpr int CH = HD / 8;
    for (int idx = tid; idx < FA_BK * CH; idx += 128) {
      const int r = idx / CH, c = idx % CH, p = t0 + r;
      uint4 kk = make_uint4(0, 0, 0, 0), vv = kk;
      if (p < total) {
        const long long base = (((long long)pt[p / ps] * ps + (p % ps)) * n_kv + kvh) * HD + 8 * c;
        kk = *reinterpret_cast<const uint4 *>(kc + base);
        vv = *reinterpret_cast<const uint4 *>(vc + base);
      }
      *reinterpret_cast<uint4 *>(Ks + r * LDH + 8 * c) = kk;
      *reinterpret_cast<uint4 *>(Vs + r * LDH + 8 * c) = vv;
    }
    __syncthreads();
    float *S = Ss + warp * 16 * LDS;
#pragma unroll
    for (int nt = 0; nt < FA_BK / 16; nt++) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int k = 0; k < HD / 16; k++) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
        wmma::load_matrix_sync(a, Qs + warp * 16 * LDH + k * 16, LDH);
        wmma::load_matrix_sync(b, Ks + nt * 16 * LDH + k * 16, LDH);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(S + nt * 16, acc, LDS, wmma::mem_row_major);
    }
    __syncwarp();
    {
      const int r = lane >> 1, hf = lane & 1, row = warp * 16 + r;
      const int qpos = length + i0 + row;
      float *srow = S + r * LDS + hf * 32;
      float mx = -INFINITY;
#pragma unroll 8
      for (int j = 0; j < 32; j++) {
        const int p = t0 + hf * 32 + j;
        const float v = (p <= qpos && p < total) ? srow[j] : -INFINITY;
        srow[j] = v;
        mx = fmaxf(mx, v);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_old = Ms[row], m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      __half *prow = Ps + row * LDP + hf * 32;
#pragma unroll 8
      for (int j = 0; j < 32; j++) {
        const float e = m_new == -INFINITY ? 0.f : __expf(srow[j] - m_new);
        const __half eh = __float2half(e);
        sum += __half2float(eh);
        prow[j] = eh;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      const float corr = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
      float *orow = Os + row * LDO;
      for (int d = hf; d < HD; d += 2) orow[d] *= corr;
      __syncwarp();
      if (hf == 0) { Ms[row] = m_new; Ls[row] = Ls[row] * corr + sum; }
    }
    __syncwarp();
#pragma unroll
    for (int dt = 0; dt < HD / 16; dt++) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      float *o = Os + warp * 16 * LDO + dt * 16;
      wmma::load_matrix_sync(acc, o, LDO, wmma::mem_row_major);
#pragma unroll
      for (int k = 0; k < FA_BK / 16; k++) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
        wmma::load_matrix_sync(a, Ps + warp * 16 * LDP + k * 16, LDP);
        wmma::load_matrix_sync(b, Vs + k * 16 * LDH + dt * 16, LDH);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(o, acc, LDO, wmma::mem_row_major);
    }
  }
  __syncthreads();
  for (int idx = tid; idx < FA_BQ * (HD + 2); idx += 128) {
    const int r = idx / (HD + 2), c = idx % (HD + 2), i = i0 + r;
    if (i >= n) continue;
    float *dst = ws + (((long long)split * n_head + h) * n + i) * (HD + 2);
    dst[c] = c == 0 ? Ms[r] : c == 1 ? Ls[r] : Os[r * LDO + c - 2];
  }
}

__global__ void k_flash_combine(const float *__restrict__ ws, float *__restrict__ out, int n, int n_head, int hd,
                                int n_split) {
  griddep_launch();
  griddep_wait();
  const int i = blockIdx.x, h = blockIdx.y;
  const long long stride = (long long)n_head * n * (hd + 2);
  const float *p = ws + ((long long)h * n + i) * (hd + 2);
  float M = -INFINITY;
  for (int s = 0; s < n_split; s++) M = fmaxf(M, p[s * stride]);
  float L = 0.f;
  for (int s = 0; s < n_split; s++) {
    const float ms = p[s * stride];
    if (ms > -INFINITY) L += p[s * stride + 1] * __expf(ms - M);
  }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < n_split; s++) {
      const float ms = p[s * stride];
      if (ms > -INFINITY) acc += p[s * stride + 2 + d] * __expf(ms - M);
    }
    out[((long long)i * n_head + h) * hd + d] = acc / L;
  }
}

template <int HD>
static int flash_launch(cudaStream_t s, const float *q, const __half *K, const __half *V, const int *pt, float *out,
                        float *ws, int n, int n_head, int n_kv, int ps, int length, int n_split, float scale) {
  const size_t smem = FaSmem<HD>::bytes;
  cudaError_t e = cudaFuncSetAttribute(k_flash_prefill<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return (int)e;
  const int n_tiles = (length + n + FA_BK - 1) / FA_BK;
  const int tps = (n_tiles + n_split - 1) / n_split;
  dim3 grid((n + FA_BQ - 1) / FA_BQ, n_head, n_split);
  st_launch(k_flash_prefill<HD>, grid, 128, smem, s, q, K, V, pt, ws, n, n_head, n_kv, ps, length, tps, scale);
  st_launch(k_flash_combine, dim3(n, n_head), HD, 0, s, ws, out, n, n_head, HD, n_split);
  return (int)cudaGetLastError();
}

extern "C" int strata_flash_prefill(void *stream, const float *q, const void *kc, const void *vc, const int *pt,
                                    float *out, float *ws, int n, int n_head, int n_kv, int hd, int ps, int length,
                                    int n_split, float scale) {
  if (n <= 0 || n_head % n_kv || n_split < 1) return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  const __half *K = (const __half *)kc, *V = (const __half *)vc;
  switch (hd) {
    case 64: return flash_launch<64>(s, q, K, V, pt, out, ws, n, n_head, n_kv, ps, length, n_split, scale);
    case 128: return flash_launch<128>(s, q, K, V, pt, out, ws, n, n_head, n_kv, ps, length, n_split, scale);
  }
  return (int)cudaErrorInvalidValue;
}

// ---------------------------------------------------------------- argmax
__global__ void k_argmax(const float *x, int *out, int n) {
  griddep_launch();
  KT(KT_ARGMAX, KT_START);
  griddep_wait();
  KT(KT_ARGMAX, KT_WAITED);
  __shared__ float sv[32];
  __shared__ int si[32];
  const float *row = x + (long long)blockIdx.x * n;
  float best = -INFINITY;
  int bi = 0x7fffffff;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float v = row[j];
    if (v > best) { best = v; bi = j; }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
  }
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) { sv[wid] = best; si[wid] = bi; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < nw; i++)
      if (sv[i] > best || (sv[i] == best && si[i] < bi)) { best = sv[i]; bi = si[i]; }
    out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
  }
}

extern "C" int strata_argmax(void *stream, const float *x, int *out, int n_rows, int n) {
  if (n_rows <= 0) return 0;
  st_launch(k_argmax, n_rows, 1024, 0, (cudaStream_t)stream, x, out, n);
  return (int)cudaGetLastError();
}

__global__ void k_add_scalar(int *p, int delta, int count) {
  griddep_launch();
  griddep_wait();
  const int i = threadIdx.x;
  if (i < count) p[i] += delta;
}

extern "C" int strata_add_scalar(void *stream, int *p, int delta, int count) {
  st_launch(k_add_scalar, 1, 32, 0, (cudaStream_t)stream, p, delta, count);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- decode: RoPE on q and k + K/V cache write, fused
// qkv f32 (1, (H + 2*KV) * hd) = [q | k | v] of one token at position *pos.
__global__ void k_rope_kv_decode(float *qkv, const int *pos, __half *kc, __half *vc, const int *pt, int H, int KV,
                                 int hd, int n_rot, float base, int neox, int ps) {
  griddep_launch();
  griddep_wait();
  const int half = n_rot / 2;
  const int n_pairs = (H + KV) * half;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  const int p = pos[0];
  if (idx < n_pairs) {
    const int h = idx / half, i = idx % half;
    float *x = qkv + h * hd;
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    float y0 = x[a], y1 = x[b];
    rope_rotate(p, i, n_rot, base, y0, y1);
    x[a] = y0;
    x[b] = y1;
    if (h >= H && kc) {   // kc NULL: RoPE only (a q8_0 cache is written by strata_kv_write_q8)
      kc[kv_index(pt, p, h - H, a, KV, hd, ps)] = __float2half(y0);
      kc[kv_index(pt, p, h - H, b, KV, hd, ps)] = __float2half(y1);
    }
    return;
  }
  const int j = idx - n_pairs;
  if (kc && j < KV * hd) {
    const int kh = j / hd, d = j % hd;
    vc[kv_index(pt, p, kh, d, KV, hd, ps)] = __float2half(qkv[(H + KV) * hd + j]);
    if (d >= n_rot) kc[kv_index(pt, p, kh, d, KV, hd, ps)] = __float2half(qkv[H * hd + j]);
  }
}

extern "C" int strata_rope_kv_decode(void *stream, float *qkv, const int *pos, void *kc, void *vc, const int *pt,
                                     int n_head, int n_kv, int hd, int n_rot, float base, int neox, int ps) {
  if (n_rot > hd || n_rot % 2) return (int)cudaErrorInvalidValue;
  const int total = (n_head + n_kv) * (n_rot / 2) + n_kv * hd;
  st_launch(k_rope_kv_decode, (total + 127) / 128, 128, 0, (cudaStream_t)stream, qkv, pos, (__half *)kc, (__half *)vc, pt,
                                                                          n_head, n_kv, hd, n_rot, base, neox, ps);
  return (int)cudaGetLastError();
}
