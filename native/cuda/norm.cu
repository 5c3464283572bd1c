// norm.cu: RMSNorm with the residual add (strata_rms_norm, strata_rms_norm_ex), writing f32, f16 and q8_1 outputs.
// (The RMSNorms fused into the decode matvecs, and the norm handoff, are in matvec_fused.cu.)
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"
#include "q8.cuh"
#include "launch.cuh"

// ---------------------------------------------------------------- RMSNorm (+ residual)
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
// out_q8: row r's q8_1 blocks at out_q8 + r * q8_stride bytes (the short read's columns; one row: any stride).
template <int EPT>
__global__ void __launch_bounds__(256) k_rms_norm_c(const float *x, const float *res, const float *__restrict__ wt,
                                                    float *out, float *sum_out, __half *out16, int8_t *out_q8, int dim,
                                                    float eps, long long q8_stride) {
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
  if (out_q8) {   // dim % 32 == 0: a group's lanes are all live or all not (warp-uniform shuffles)
    float d;
    int q[EPT], sum;
    q8_chunk(y, q, d, sum);
    if (live) {
      int8_t *oq = out_q8 + blockIdx.x * q8_stride;
#pragma unroll
      for (int k = 0; k < EPT; k++) oq[e0 + k] = (int8_t)q[k];
      if ((e0 & 31) == 0) reinterpret_cast<float2 *>(oq + dim)[e0 >> 5] = make_float2(d, d * (float)sum);
    }
  }
  KT(KT_NORM, KT_END);
}

extern "C" int strata_rms_norm(void *stream, const float *x, const float *res, const float *w, float *out,
                               float *sum_out, int n_rows, int dim, float eps) {
  return strata_rms_norm_ex(stream, x, res, w, out, sum_out, nullptr, nullptr, n_rows, dim, eps);
}

// strata_rms_norm_ex, and with rows of q8_1 blocks q8_stride bytes apart (strata_rms_norm_rows).
static int rms_norm(void *stream, const float *x, const float *res, const float *w, float *out, float *sum_out,
                    void *out16, void *out_q8, long long q8_stride, int n_rows, int dim, float eps) {
  if (n_rows <= 0) return 0;
  if (out_q8 && ((n_rows != 1 && (q8_stride < dim + dim / 4 || dim > 8192)) || dim % 32))
    return (int)cudaErrorInvalidValue;   // rows of q8_1 blocks: the register kernel k_rms_norm_c only
  // out may alias x or sum_out: each element is read (both passes) before it is written only by its own thread.
  cudaStream_t st = (cudaStream_t)stream;
  __half *o16 = (__half *)out16;
  int8_t *oq = (int8_t *)out_q8;
  if (dim % 32 == 0 && dim <= 8192) {   // EPT = dim / 256 rounded up to a power of two, at most 32
    const int ept = dim <= 256 ? 1 : dim <= 512 ? 2 : dim <= 1024 ? 4 : dim <= 2048 ? 8 : dim <= 4096 ? 16 : 32;
#define RC(E) st_launch(k_rms_norm_c<E>, n_rows, 256, 0, st, x, res, w, out, sum_out, o16, oq, dim, eps, q8_stride)
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

extern "C" int strata_rms_norm_ex(void *stream, const float *x, const float *res, const float *w, float *out,
                                  float *sum_out, void *out16, void *out_q8, int n_rows, int dim, float eps) {
  return rms_norm(stream, x, res, w, out, sum_out, out16, out_q8, 0, n_rows, dim, eps);
}

extern "C" int strata_rms_norm_rows(void *stream, const float *x, const float *res, const float *w, float *out,
                                    float *sum_out, void *out_q8, long long q8_stride, int n_rows, int dim,
                                    float eps) {
  return rms_norm(stream, x, res, w, out, sum_out, nullptr, out_q8, q8_stride, n_rows, dim, eps);
}
