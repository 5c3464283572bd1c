// gdn_prefill.cu: a GDN layer's prologue (strata_gdn_prep) and gated RMSNorm (strata_gdn_gated_norm_rows) for n tokens.
// Strata CUDA kernels around the Gated DeltaNet delta rule for n tokens (prefill; strata/backend/cuda/gdn_prefill.py):
// the prologue after the causal conv (L2-normalised q / k, contiguous v, beta = sigmoid(b), g = A * softplus(a + dt))
// and the epilogue before ssm_out (RMSNorm(o) * ssm_norm * silu(z)), one launch each for all tokens and heads.
// Formulas: strata/models/qwen3next.py (_gdn) and strata/backend/gdn.py (l2_norm, sigmoid, softplus, gated_rms_norm),
// from transformers modeling_qwen3_next.py and llama.cpp src/models/qwen3next.cpp; the one-token versions are
// qwen35.cu's k_q35_gdn_step prologue and k_q35_gated_norm. Launchers: plain C, stream first, return cudaError_t;
// every kernel is launched by st_launch and runs griddep_launch(); griddep_wait() before it reads anything
// (launch.cuh). Only warp shuffles reduce (no block barriers): every shuffle runs in warp-uniform control flow.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "launch.cuh"
#include "strata_cuda.h"

namespace {

constexpr int GP_THREADS = 256;               // threads per block of both kernels
constexpr int GP_WARPS = GP_THREADS / 32;

// Sum of v over the 32 lanes of the warp (all 32 lanes must call it).
__device__ __forceinline__ float gp_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// GDN prologue, grid n (one block per token t), block GP_THREADS.
//   y row t: [q (n_k*dk) | k (n_k*dk) | v (n_v*dv)] at y + t*y_stride. Norm task j in [0, 2 n_k) is the dk
//   elements at y_t + j*dk (q heads, then k heads); warp w takes tasks w, w + 8, ...:
//     x / sqrt(sum(x^2) + l2_eps) -> q_out (j < n_k) or k_out (j >= n_k), both (n, n_k, dk).
//   Value head h (threads h = tid, tid + 256, ...), r = n_v / n_k, i = ba_grouped ? (h/r)*2r + h%r : h:
//     b_h = b[t*ba_stride + b_off + i], a_h = a[t*ba_stride + a_off + i + (ba_grouped ? r : 0)];
//     beta_out[t, h] = 1 / (1 + e^-b_h); g_out[t, h] = A[h] * softplus(a_h + dt[h]) (softplus(x) = x for x > 20).
//   v_out (n, n_v, dv) (may be NULL): the v part of y row t copied.
__global__ void __launch_bounds__(GP_THREADS)
    k_gdn_prep(const float *__restrict__ y, int y_stride, const float *__restrict__ b, const float *__restrict__ a,
               int ba_stride, int b_off, int a_off, int ba_grouped, const float *__restrict__ A,
               const float *__restrict__ dt, float *__restrict__ q_out, float *__restrict__ k_out,
               float *__restrict__ v_out, float *__restrict__ g_out, float *__restrict__ beta_out, int n_k, int n_v,
               int dk, int dv, float l2_eps) {
  griddep_launch();
  griddep_wait();
  const long long t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float *yt = y + t * y_stride;
  for (int j = warp; j < 2 * n_k; j += GP_WARPS) {           // warp-uniform loop: whole warps shuffle
    const float *src = yt + (long long)j * dk;
    float ss = 0.0f;
    for (int i = lane; i < dk; i += 32) {
      const float x = src[i];
      ss += x * x;
    }
    ss = gp_warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss + l2_eps);
    float *dst = j < n_k ? q_out + (t * n_k + j) * dk : k_out + (t * n_k + (j - n_k)) * dk;
    for (int i = lane; i < dk; i += 32) dst[i] = src[i] * inv;
  }
  const int r = n_v / n_k;
  const float *bt = b + t * ba_stride + b_off;
  const float *at = a + t * ba_stride + a_off + (ba_grouped ? r : 0);
  for (int h = threadIdx.x; h < n_v; h += GP_THREADS) {
    const int i = ba_grouped ? (h / r) * 2 * r + h % r : h;
    beta_out[t * n_v + h] = 1.0f / (1.0f + expf(-bt[i]));
    const float x = at[i] + dt[h];
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    g_out[t * n_v + h] = A[h] * sp;
  }
  if (v_out) {
    const float *vs = yt + 2LL * n_k * dk;
    float *vd = v_out + t * n_v * dv;
    const int nvd = n_v * dv;
    for (int i = threadIdx.x; i < nvd; i += GP_THREADS) vd[i] = vs[i];
  }
}

// Gated RMSNorm of rows (gdn.gated_rms_norm), grid ceil(n_rows / 8), block GP_THREADS: one warp per row
// (row = blockIdx.x * 8 + warp). o, out f32 (n_rows, d) contiguous; row r's gate is the d floats at
// z + (r / z_group) * z_stride + (r % z_group) * d (z_group rows of one token lie back to back, tokens z_stride apart);
// out[r] = o[r] / sqrt(mean(o[r]^2) + eps) * w * silu(z_r), written as f32 (out) and / or f16 (out16).
__global__ void __launch_bounds__(GP_THREADS)
    k_gdn_gated_norm_rows(const float *__restrict__ o, const float *__restrict__ z, long long z_stride, int z_group,
                          const float *__restrict__ w, float *__restrict__ out, __half *__restrict__ out16,
                          int n_rows, int d, float eps) {
  griddep_launch();
  griddep_wait();
  const int lane = threadIdx.x & 31;
  const long long row = (long long)blockIdx.x * GP_WARPS + (threadIdx.x >> 5);
  if (row >= n_rows) return;                                  // warp-uniform: the whole warp leaves
  const float *orow = o + row * d;
  const float *zrow = z + (row / z_group) * z_stride + (row % z_group) * d;
  float ss = 0.0f;
  for (int i = lane; i < d; i += 32) {
    const float x = orow[i];
    ss += x * x;
  }
  ss = gp_warp_sum(ss);
  const float rn = 1.0f / sqrtf(ss / (float)d + eps);
  for (int i = lane; i < d; i += 32) {
    const float zz = zrow[i];
    const float val = orow[i] * rn * w[i] * (zz / (1.0f + expf(-zz)));
    if (out) out[row * d + i] = val;
    if (out16) out16[row * d + i] = __float2half_rn(val);
  }
}

}  // namespace

extern "C" int strata_gdn_prep(void *stream, const float *y, int y_stride, const float *b, const float *a,
                               int ba_stride, int b_off, int a_off, int ba_grouped, const float *A, const float *dt,
                               float *q_out, float *k_out, float *v_out, float *g_out, float *beta_out, int n,
                               int n_k, int n_v, int dk, int dv, float l2_eps) {
  if (n < 0 || n_k <= 0 || n_v <= 0 || n_v % n_k || dk <= 0 || dv <= 0 || b_off < 0 || a_off < 0)
    return (int)cudaErrorInvalidValue;
  const long long width = 2LL * n_k * dk + (long long)n_v * dv;
  const int ba_w = ba_grouped ? 2 * n_v : n_v;
  if (width > 0x7fffffffLL || y_stride < width || b_off + ba_w > ba_stride || a_off + ba_w > ba_stride)
    return (int)cudaErrorInvalidValue;
  if (n == 0) return 0;
  if (!y || !b || !a || !A || !dt || !q_out || !k_out || !g_out || !beta_out) return (int)cudaErrorInvalidValue;
  st_launch(k_gdn_prep, dim3(n), dim3(GP_THREADS), 0, (cudaStream_t)stream, y, y_stride, b, a, ba_stride, b_off,
            a_off, ba_grouped, A, dt, q_out, k_out, v_out, g_out, beta_out, n_k, n_v, dk, dv, l2_eps);
  return (int)cudaGetLastError();
}

extern "C" int strata_gdn_gated_norm_rows(void *stream, const float *o, const float *z, int z_stride, int z_group,
                                          const float *w, float *out, void *out16, int n_rows, int d, float eps) {
  if (n_rows < 0 || d <= 0 || z_group <= 0 || (long long)z_stride < (long long)z_group * d)
    return (int)cudaErrorInvalidValue;
  if (n_rows == 0) return 0;
  if (!o || !z || !w || (!out && !out16)) return (int)cudaErrorInvalidValue;
  const int nb = (int)(((long long)n_rows + GP_WARPS - 1) / GP_WARPS);
  st_launch(k_gdn_gated_norm_rows, dim3(nb), dim3(GP_THREADS), 0, (cudaStream_t)stream, o, z, (long long)z_stride,
            z_group, w, out, (__half *)out16, n_rows, d, eps);
  return (int)cudaGetLastError();
}
