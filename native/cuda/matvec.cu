// matvec.cu: matvecs on GGUF blocks with f32 activations, dequantize / get_rows, q8_1 quantize and the plain q8 matvec.
// Block formats follow llama.cpp's ggml-common.h / ggml-quants.c dequantize_row_* (and gguf-py quants.py).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"
#include "launch.cuh"
#include "quant.cuh"
#include "matvec.cuh"

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

extern "C" int strata_supports_type(int t) { return block_bytes(t) != 0; }

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

