// kv_cache.cu: the paged KV cache's writes and gathers, f16 (strata_kv_write / _gather) and q8_0 (_write_q8 / _gather_q8).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"
#include "launch.cuh"
#include "kv_cache.cuh"

// ---------------------------------------------------------------- paged KV cache (f16)
// (kv_index, the element offset of (position, KV head, dim) in a paged cache: kv_cache.cuh)

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

// ---------------------------------------------------------------- q8_0 KV cache
// The q8_0 cache (--kv q8_0): per layer int8 K and V (n_pages, page_size, n_kv, hd) and f16 scales (n_pages,
// page_size, n_kv, hd / 32): element = d * q per 32 consecutive elements of one (position, head) row, d = max|x| /
// 127 stored as f16, q = round-to-nearest-even(x / d) (ggml's q8_0 block layout, split into two arrays so that a
// lane's 8 values stay one 8-byte load; ggml rounds ties away from zero, so a value exactly half-way between two
// steps can land one step apart). The scale of element offset e (in the int8 array) is at e / 32.

// One warp per (token, KV head, 32-block, K or V). k / v: f32 rows of n tokens (row strides in floats), head h at
// h * hd; token t goes to position (*d_start or 0) + start + t.
__global__ void k_kv_write_q8(const float *__restrict__ k, int k_stride, const float *__restrict__ v, int v_stride,
                              int8_t *__restrict__ kq, int8_t *__restrict__ vq, __half *__restrict__ ks,
                              __half *__restrict__ vs, const int *__restrict__ pt, const int *__restrict__ d_start,
                              int start, int n, int n_kv, int hd, int ps) {
  griddep_launch();
  griddep_wait();
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31, nb = hd / 32;
  if (gw >= (long long)n * n_kv * nb * 2) return;   // whole warps
  const int which = (int)(gw & 1);
  const long long rest = gw >> 1;
  const int b = (int)(rest % nb), h = (int)((rest / nb) % n_kv), t = (int)(rest / ((long long)nb * n_kv));
  const float x = which ? v[(long long)t * v_stride + h * hd + 32 * b + lane]
                        : k[(long long)t * k_stride + h * hd + 32 * b + lane];
  float amax = fabsf(x);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float d = __fdiv_rn(amax, 127.0f);
  const int q = amax == 0.f ? 0 : __float2int_rn(__fdiv_rn(x, d));
  const int pos = (d_start ? *d_start : 0) + start + t;
  const long long e = kv_off(pt, pos, h, n_kv, hd, ps) + 32 * b;
  (which ? vq : kq)[e + lane] = (int8_t)q;
  if (lane == 0) (which ? vs : ks)[e >> 5] = __float2half(d);
}

extern "C" int strata_kv_write_q8(void *stream, const float *k, int k_stride, const float *v, int v_stride, void *kq,
                                  void *vq, void *ks, void *vs, const int *pt, const int *d_start, int start, int n,
                                  int n_kv, int hd, int ps) {
  if (hd % 32 || n < 0) return (int)cudaErrorInvalidValue;
  const long long warps = (long long)n * n_kv * (hd / 32) * 2;
  if (warps == 0) return 0;
  st_launch(k_kv_write_q8, (unsigned)((warps * 32 + 255) / 256), 256, 0, (cudaStream_t)stream, 
      k, k_stride, v, v_stride, (int8_t *)kq, (int8_t *)vq, (__half *)ks, (__half *)vs, pt, d_start, start, n, n_kv,
      hd, ps);
  return (int)cudaGetLastError();
}

// The first len positions of a q8_0 cache as f32 (n_kv, len, hd) for K and V (checkpoints, state reads).
__global__ void k_kv_gather_q8(const int8_t *__restrict__ kq, const int8_t *__restrict__ vq,
                               const __half *__restrict__ ks, const __half *__restrict__ vs, const int *__restrict__ pt,
                               float *__restrict__ ko, float *__restrict__ vo, int len, int n_kv, int hd, int ps) {
  griddep_launch();
  griddep_wait();
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)n_kv * len * hd) return;
  const int d = (int)(idx % hd), p = (int)((idx / hd) % len), h = (int)(idx / ((long long)hd * len));
  const long long e = kv_off(pt, p, h, n_kv, hd, ps) + d;
  ko[idx] = __half2float(ks[e >> 5]) * (float)kq[e];
  vo[idx] = __half2float(vs[e >> 5]) * (float)vq[e];
}

extern "C" int strata_kv_gather_q8(void *stream, const void *kq, const void *vq, const void *ks, const void *vs,
                                   const int *pt, float *ko, float *vo, int len, int n_kv, int hd, int ps) {
  if (hd % 32 || len < 0) return (int)cudaErrorInvalidValue;
  const long long total = (long long)n_kv * len * hd;
  if (total == 0) return 0;
  st_launch(k_kv_gather_q8, (unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream, 
      (const int8_t *)kq, (const int8_t *)vq, (const __half *)ks, (const __half *)vs, pt, ko, vo, len, n_kv, hd, ps);
  return (int)cudaGetLastError();
}

