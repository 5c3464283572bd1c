// rope_act.cu: RoPE (alone, and fused with the K/V cache write for one token / for n tokens) and SwiGLU.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"
#include "q8.cuh"
#include "launch.cuh"
#include "rope.cuh"
#include "kv_cache.cuh"

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
// f16 out16 (n, F), q8_1 blocks out_q8 (F % 32 == 0; row t's at out_q8 + t * q8_stride bytes).
__global__ void k_swiglu_gu(const float *__restrict__ gu, int F, long long total, float *__restrict__ out,
                            __half *__restrict__ out16, int8_t *__restrict__ out_q8, long long q8_stride) {
  griddep_launch();
  griddep_wait();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long t = i / F, j = i % F;
  float v = 0.f;
  if (i < total) {
    const float a = gu[t * 2 * F + j];
    v = a / (1.f + expf(-a)) * gu[t * 2 * F + F + j];
    if (out) out[i] = v;
    if (out16) out16[i] = __float2half(v);
  }
  // F % 32 == 0: a warp's 32 elements are one block of one row
  if (out_q8 && i - (threadIdx.x & 31) < total) {
    int8_t *oq = out_q8 + t * q8_stride;
    q8_store(v, (int)j, oq, reinterpret_cast<float2 *>(oq + F));
  }
}

static int swiglu_gu(void *stream, const float *gu, int n, int F, float *out, void *out16, void *out_q8,
                     long long q8_stride) {
  const long long total = (long long)n * F;
  if (total <= 0) return 0;
  if (out_q8 && ((n != 1 && q8_stride < F + F / 4) || F % 32)) return (int)cudaErrorInvalidValue;
  st_launch(k_swiglu_gu, (unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream, gu, F, total, out,
            (__half *)out16, (int8_t *)out_q8, q8_stride);
  return (int)cudaGetLastError();
}

extern "C" int strata_swiglu_gu(void *stream, const float *gu, int n, int F, float *out, void *out16, void *out_q8) {
  return swiglu_gu(stream, gu, n, F, out, out16, out_q8, 0);
}

extern "C" int strata_swiglu_gu_rows(void *stream, const float *gu, int n, int F, float *out, void *out_q8,
                                     long long q8_stride) {
  return swiglu_gu(stream, gu, n, F, out, nullptr, out_q8, q8_stride);
}

// ---------------------------------------------------------------- decode: RoPE on q and k + K/V cache write, fused
// qkv f32 (1, (H + 2*KV) * hd) = [q | k | v] of one token at position *pos; with rows (grid.y, the short read),
// row r's at qkv + r * qs, position pos[r].
__global__ void k_rope_kv_decode(float *qkv, const int *pos, __half *kc, __half *vc, const int *pt, int H, int KV,
                                 int hd, int n_rot, float base, int neox, int ps, long long qs) {
  griddep_launch();
  griddep_wait();
  const int half = n_rot / 2;
  const int n_pairs = (H + KV) * half;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  qkv += blockIdx.y * qs;
  const int p = pos[blockIdx.y];
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
                                                                          n_head, n_kv, hd, n_rot, base, neox, ps, 0LL);
  return (int)cudaGetLastError();
}

extern "C" int strata_rope_kv_rows(void *stream, float *qkv, long long q_stride, const int *pos, void *kc, void *vc,
                                   const int *pt, int n, int n_head, int n_kv, int hd, int n_rot, float base, int neox,
                                   int ps) {
  if (n_rot > hd || n_rot % 2 || n <= 0 || n > 65535) return (int)cudaErrorInvalidValue;
  const int total = (n_head + n_kv) * (n_rot / 2) + n_kv * hd;
  st_launch(k_rope_kv_decode, dim3((total + 127) / 128, n), 128, 0, (cudaStream_t)stream, qkv, pos, (__half *)kc,
            (__half *)vc, pt, n_head, n_kv, hd, n_rot, base, neox, ps, q_stride);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- prefill: RoPE on q and k + K/V cache write
// qkv f32 rows of n tokens with row stride `stride` floats: [q (H*hd) | k (KV*hd) | v (KV*hd)]; token t is at
// position pos0 + t. RoPE (angles in float64, as the decode kernel) is applied in place to q and k; k (rotated) and
// v are written to the cache as f16.
__global__ void k_rope_kv_prefill(float *__restrict__ qkv, int stride, int pos0, __half *__restrict__ kc,
                                  __half *__restrict__ vc, const int *__restrict__ pt, int n, int H, int KV, int hd,
                                  int n_rot, float base, int neox, int ps) {
  griddep_launch();
  griddep_wait();
  const int half = n_rot / 2;
  const int per_tok = (H + KV) * half + KV * hd;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)n * per_tok) return;
  const int t = (int)(idx / per_tok), j0 = (int)(idx % per_tok);
  const int p = pos0 + t;
  float *row = qkv + (long long)t * stride;
  if (j0 < (H + KV) * half) {
    const int h = j0 / half, i = j0 % half;
    float *x = row + h * hd;
    const double ang = (double)p * pow((double)base, -2.0 * (double)i / (double)n_rot);
    const float c = (float)cos(ang), s = (float)sin(ang);
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float x0 = x[a], x1 = x[b];
    const float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
    x[a] = y0;
    x[b] = y1;
    if (h >= H && kc) {   // kc NULL: RoPE only (a q8_0 cache is written by strata_kv_write_q8)
      const long long o = kv_off(pt, p, h - H, KV, hd, ps);
      kc[o + a] = __float2half(y0);
      kc[o + b] = __float2half(y1);
    }
    return;
  }
  if (!kc) return;
  const int j = j0 - (H + KV) * half;
  const int kh = j / hd, d = j % hd;
  const long long o = kv_off(pt, p, kh, KV, hd, ps) + d;
  vc[o] = __float2half(row[(H + KV) * hd + j]);
  if (d >= n_rot) kc[o] = __float2half(row[H * hd + j]);
}

extern "C" int strata_rope_kv_prefill(void *stream, float *qkv, int stride, int pos0, void *kc, void *vc,
                                      const int *pt, int n, int n_head, int n_kv, int hd, int n_rot, float base,
                                      int neox, int ps) {
  if (n_rot > hd || n_rot % 2 || n < 0 || stride < (n_head + 2 * n_kv) * hd) return (int)cudaErrorInvalidValue;
  const long long total = (long long)n * ((n_head + n_kv) * (n_rot / 2) + n_kv * hd);
  if (total == 0) return 0;
  st_launch(k_rope_kv_prefill, (unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream, 
      qkv, stride, pos0, (__half *)kc, (__half *)vc, pt, n, n_head, n_kv, hd, n_rot, base, neox, ps);
  return (int)cudaGetLastError();
}

