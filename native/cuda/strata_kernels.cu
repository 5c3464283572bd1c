// Strata CUDA kernels: quantized matrix-vector (GGUF blocks read directly), dequantization, RMSNorm, RoPE,
// SwiGLU, paged f16 KV cache writes, split-K decode attention, causal softmax, argmax.
// Block formats follow llama.cpp's ggml-common.h / ggml-quants.c dequantize_row_* (and gguf-py quants.py).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

__host__ __device__ static inline int block_elems(int t) {
  return (t == T_Q4_K || t == T_Q5_K || t == T_Q6_K) ? 256 : (t == T_F32 || t == T_F16) ? 8 : 32;
}
__host__ __device__ static inline int block_bytes(int t) {
  switch (t) {
    case T_F32: return 32; case T_F16: return 16; case T_Q4_0: return 18; case T_Q4_1: return 20;
    case T_Q8_0: return 34; case T_Q4_K: return 144; case T_Q5_K: return 176; case T_Q6_K: return 210;
  }
  return 0;
}

__device__ static inline float ldh(const uint8_t *p) {
  return __half2float(*reinterpret_cast<const __half *>(p));
}

// get_scale_min_k4 from ggml-quants.c
__device__ static inline void scale_min_k4(int j, const uint8_t *q, float &d, float &m) {
  if (j < 4) {
    d = (float)(q[j] & 63);
    m = (float)(q[j + 4] & 63);
  } else {
    d = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

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

static inline long long row_bytes_of(int t, int n_in) {
  return (long long)(n_in / block_elems(t)) * block_bytes(t);
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
#define MV(NT, TT) k_matvec<TT, NT><<<blocks, threads, 0, s>>>(W, x, y, n_out, n_in, rb)
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
#define DQ(TT) k_dequant<TT><<<blocks, threads, 0, s>>>(W, out, ids, n_rows, n_in, rb, out_f16)
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
                           float *__restrict__ out, float *__restrict__ sum_out, int dim, float eps) {
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
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    // sum_out may alias x or residual: re-read the sum this thread stored, not the overwritten inputs
    float s = sum_out ? sum_out[base + i] : x[base + i] + (res ? res[base + i] : 0.f);
    out[base + i] = s * r * wt[i];
  }
}

extern "C" int strata_rms_norm(void *stream, const float *x, const float *res, const float *w, float *out,
                               float *sum_out, int n_rows, int dim, float eps) {
  if (n_rows <= 0) return 0;
  // out may alias x or sum_out: each element is read (both passes) before it is written only by its own thread.
  k_rms_norm<<<n_rows, 256, 0, (cudaStream_t)stream>>>(x, res, w, out, sum_out, dim, eps);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- RoPE
__global__ void k_rope(float *x, const int *pos, int n_tokens, int n_heads, int hd, int n_rot, float base, int neox) {
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
  k_rope<<<(unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream>>>(x, positions, n_tokens, n_heads, hd,
                                                                            n_rot, base, neox);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- SwiGLU
__global__ void k_swiglu(const float *g, const float *u, float *o, long long n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const float a = g[i];
    o[i] = a / (1.f + expf(-a)) * u[i];
  }
}

extern "C" int strata_swiglu(void *stream, const float *g, const float *u, float *o, long long n) {
  if (n <= 0) return 0;
  k_swiglu<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)stream>>>(g, u, o, n);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- paged KV cache (f16)
__device__ static inline long long kv_index(const int *pt, int pos, int h, int d, int n_kv, int hd, int ps) {
  const int page = pt[pos / ps], slot = pos % ps;
  return (((long long)page * ps + slot) * n_kv + h) * hd + d;
}

__global__ void k_kv_write(const float *k, const float *v, __half *kc, __half *vc, const int *pt, const int *d_start,
                           int start_off, int n, int n_kv, int hd, int ps) {
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
  k_kv_write<<<(unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream>>>(
      k, v, (__half *)kc, (__half *)vc, pt, d_start, start_off, n, n_kv, hd, ps);
  return (int)cudaGetLastError();
}

__global__ void k_kv_gather(const __half *kc, const __half *vc, const int *pt, float *ko, float *vo, int len, int n_kv,
                            int hd, int ps) {
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
  k_kv_gather<<<(unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream>>>(
      (const __half *)kc, (const __half *)vc, pt, ko, vo, len, n_kv, hd, ps);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- decode attention (split-K)
#define ATT_WARPS 4
template <int EPL>  // elements per lane: hd = 32 * EPL
__global__ void k_attn_decode(const float *__restrict__ q, const __half *__restrict__ kc, const __half *__restrict__ vc,
                              const int *__restrict__ pt, const int *d_len, int len_arg, float *__restrict__ partial,
                              int n_head, int n_kv, int ps, int n_split, float scale) {
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
  float M = -INFINITY;
  for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm[w]);
  float *dst = partial + ((long long)h * n_split + sp) * (hd + 2);
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.f;
    for (int w = 0; w < ATT_WARPS; w++)
      if (sm[w] > -INFINITY) acc += so[w][d] * __expf(sm[w] - M);
    dst[2 + d] = acc;
  }
  if (threadIdx.x == 0) {
    float L = 0.f;
    for (int w = 0; w < ATT_WARPS; w++)
      if (sm[w] > -INFINITY) L += sl[w] * __expf(sm[w] - M);
    dst[0] = M;
    dst[1] = L;
  }
}

__global__ void k_attn_combine(const float *partial, float *out, int n_split, int hd) {
  const int h = blockIdx.x;
  const float *p = partial + (long long)h * n_split * (hd + 2);
  float M = -INFINITY;
  for (int s = 0; s < n_split; s++) M = fmaxf(M, p[s * (hd + 2)]);
  float L = 0.f;
  for (int s = 0; s < n_split; s++) {
    const float ms = p[s * (hd + 2)];
    if (ms > -INFINITY) L += p[s * (hd + 2) + 1] * __expf(ms - M);
  }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < n_split; s++) {
      const float ms = p[s * (hd + 2)];
      if (ms > -INFINITY) acc += p[s * (hd + 2) + 2 + d] * __expf(ms - M);
    }
    out[h * hd + d] = acc / L;
  }
}

extern "C" int strata_attn_decode(void *stream, const float *q, const void *kc, const void *vc, const int *pt,
                                  const int *d_len, int len, float *partial, float *out, int n_head, int n_kv, int hd,
                                  int ps, int n_split, float scale) {
  if (hd % 32 || hd > 256 || n_head % n_kv || n_split < 1) return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  dim3 grid(n_head, n_split);
  const __half *K = (const __half *)kc, *V = (const __half *)vc;
#define AD(E) k_attn_decode<E><<<grid, 32 * ATT_WARPS, 0, s>>>(q, K, V, pt, d_len, len, partial, n_head, n_kv, ps, n_split, scale)
  switch (hd / 32) {
    case 1: AD(1); break; case 2: AD(2); break; case 3: AD(3); break; case 4: AD(4); break;
    case 5: AD(5); break; case 6: AD(6); break; case 7: AD(7); break; case 8: AD(8); break;
  }
#undef AD
  k_attn_combine<<<n_head, hd, 0, s>>>(partial, out, n_split, hd);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- causal softmax (prefill attention)
__global__ void k_causal_softmax(float *s, int n_q, int len, int pos0, float scale) {
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
  k_causal_softmax<<<n_rows, 256, 0, (cudaStream_t)stream>>>(s, n_q, len, pos0, scale);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- argmax
__global__ void k_argmax(const float *x, int *out, int n) {
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
  k_argmax<<<n_rows, 1024, 0, (cudaStream_t)stream>>>(x, out, n);
  return (int)cudaGetLastError();
}

__global__ void k_add_scalar(int *p, int delta, int count) {
  const int i = threadIdx.x;
  if (i < count) p[i] += delta;
}

extern "C" int strata_add_scalar(void *stream, int *p, int delta, int count) {
  k_add_scalar<<<1, 32, 0, (cudaStream_t)stream>>>(p, delta, count);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- decode: RoPE on q and k + K/V cache write, fused
// qkv f32 (1, (H + 2*KV) * hd) = [q | k | v] of one token at position *pos.
__global__ void k_rope_kv_decode(float *qkv, const int *pos, __half *kc, __half *vc, const int *pt, int H, int KV,
                                 int hd, int n_rot, float base, int neox, int ps) {
  const int half = n_rot / 2;
  const int n_pairs = (H + KV) * half;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  const int p = pos[0];
  if (idx < n_pairs) {
    const int h = idx / half, i = idx % half;
    float *x = qkv + h * hd;
    const double ang = (double)p * pow((double)base, -2.0 * (double)i / (double)n_rot);
    const float c = (float)cos(ang), s = (float)sin(ang);
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float x0 = x[a], x1 = x[b];
    const float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
    x[a] = y0;
    x[b] = y1;
    if (h >= H) {
      kc[kv_index(pt, p, h - H, a, KV, hd, ps)] = __float2half(y0);
      kc[kv_index(pt, p, h - H, b, KV, hd, ps)] = __float2half(y1);
    }
    return;
  }
  const int j = idx - n_pairs;
  if (j < KV * hd) {
    const int kh = j / hd, d = j % hd;
    vc[kv_index(pt, p, kh, d, KV, hd, ps)] = __float2half(qkv[(H + KV) * hd + j]);
    if (d >= n_rot) kc[kv_index(pt, p, kh, d, KV, hd, ps)] = __float2half(qkv[H * hd + j]);
  }
}

extern "C" int strata_rope_kv_decode(void *stream, float *qkv, const int *pos, void *kc, void *vc, const int *pt,
                                     int n_head, int n_kv, int hd, int n_rot, float base, int neox, int ps) {
  if (n_rot > hd || n_rot % 2) return (int)cudaErrorInvalidValue;
  const int total = (n_head + n_kv) * (n_rot / 2) + n_kv * hd;
  k_rope_kv_decode<<<(total + 127) / 128, 128, 0, (cudaStream_t)stream>>>(qkv, pos, (__half *)kc, (__half *)vc, pt,
                                                                          n_head, n_kv, hd, n_rot, base, neox, ps);
  return (int)cudaGetLastError();
}
