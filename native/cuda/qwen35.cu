// qwen35.cu: the qwen35 / qwen3next decode plan's own one-token kernels (GDN step, conv, gated norms, attention gate).
// Strata CUDA kernels of the qwen35 / qwen3next decode plan (strata/backend/cuda/qwen35.py): the one-token Gated
// DeltaNet step (causal conv with its window, L2-normalised q/k, sigmoid beta, decay g, gated delta rule), the GDN
// gated RMSNorm, the gated-attention q/k RMSNorm split, and the attention output gate. Together with the shared
// kernels (matvec_fused.cu: matvec_q8w; norm.cu: rms_norm_ex; rope_act.cu: swiglu_gu, rope_kv_decode; sampling.cu:
// argmax, add_scalar; attn_decode.cu: attn_decode_gqa) they make the whole decode step, captured as one CUDA graph.
// Formulas: strata/models/qwen3next.py (_gdn, _attn) and strata/backend/gdn.py (causal_conv1d, l2_norm,
// delta_rule_recurrent, gated_rms_norm), from transformers modeling_qwen3_next.py / modeling_qwen3_5.py and
// llama.cpp src/models/qwen3next.cpp. Launchers: plain C, stream first, return cudaError_t; every kernel is launched
// by st_launch and runs griddep_launch(); griddep_wait() before it reads anything (launch.cuh).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"
#include "q8.cuh"
#include "launch.cuh"

namespace {

constexpr int Q35_COLS = 32;    // value columns per block of the GDN step (one warp wide)
constexpr int Q35_ROWS = 8;     // row groups (warps) per block: thread (tx, ty) owns state rows ty, ty + 8, ...
constexpr int Q35_MAX_DK = Q35_COLS * Q35_ROWS;   // 256: one q/k element per thread in the prologue

// Sum of v over the block (blockDim a multiple of 32, at most 1024; every thread must call it). sh: 32 floats.
__device__ __forceinline__ float q35_block_sum(float v, float *sh) {
  const int tid = threadIdx.x + threadIdx.y * blockDim.x;
  const int lane = tid & 31, wid = tid >> 5, nw = (blockDim.x * blockDim.y + 31) >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < nw; i++) t += sh[i];
  __syncthreads();                 // sh may be reused by the caller
  return t;
}

// Causal depthwise conv + SiLU of n_tok tokens, one after the other (gdn.causal_conv1d; the decode step: n_tok = 1):
// one thread per channel c, token t's input at x + t * xs and output at y + t * ys; per token
// xx = window[:, c] ++ x[c]; y[c] = silu(sum_j w[c, j] xx[j]); window[:, c] <- xx[1:] (kept in registers between
// tokens, stored after the last).
template <int K>
__global__ void k_q35_conv(const float *__restrict__ x, const float *__restrict__ w, float *__restrict__ window,
                           float *__restrict__ y, int channels, int n_tok, long long xs, long long ys,
                           float *const *keep, long long ks) {
  griddep_launch();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  float xx[K], wc[K];
#pragma unroll
  for (int j = 0; j < K; j++) wc[j] = w[(long long)c * K + j];   // constants: before the PDL wait
  griddep_wait();
#pragma unroll
  for (int j = 0; j < K - 1; j++) xx[j] = window[(long long)j * channels + c];
  float *kp = keep ? *keep : nullptr;          // the kept windows' base (read after the wait: set before the launch)
  // the tokens' inputs CONV_TOKENS at a time into registers first (their loads in flight together), then the
  // tokens in order
  constexpr int CONV_TOKENS = 8;
  for (int t0 = 0; t0 < n_tok; t0 += CONV_TOKENS) {
    float xt[CONV_TOKENS];
#pragma unroll
    for (int i = 0; i < CONV_TOKENS; i++) xt[i] = t0 + i < n_tok ? x[(t0 + i) * xs + c] : 0.f;
#pragma unroll
    for (int i = 0; i < CONV_TOKENS; i++) {
      if (t0 + i >= n_tok) break;
      xx[K - 1] = xt[i];
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < K; j++) acc += xx[j] * wc[j];
      y[(t0 + i) * ys + c] = acc / (1.0f + expf(-acc));
#pragma unroll
      for (int j = 0; j < K - 1; j++) xx[j] = xx[j + 1];
      if (kp) {
#pragma unroll
        for (int j = 0; j < K - 1; j++) kp[(t0 + i) * ks + (long long)j * channels + c] = xx[j];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < K - 1; j++) window[(long long)j * channels + c] = xx[j];
}

// One token's inputs of the gated delta rule as thread (tx, ty) of block (tile, h) reads them: q, k elements tid of
// key head hk (tid < dk), v element j of value head h, the head's b and a (see k_q35_gdn_step).
struct GdnIn {
  float qv, kv, vv, b, a;
};
__device__ __forceinline__ GdnIn q35_gdn_load(const float *__restrict__ y, const float *__restrict__ proj, int h,
                                              int j, int n_v, int n_k, int dk, int dv, int tiled, int b_off,
                                              int a_off, int ba_grouped) {
  const int tid = threadIdx.y * Q35_COLS + threadIdx.x;
  const int r = n_v / n_k;
  const int hk = tiled ? h % n_k : h / r;
  GdnIn in{0.f, 0.f, 0.f, 0.f, 0.f};
  if (tid < dk) {
    in.qv = y[(long long)hk * dk + tid];
    in.kv = y[(long long)n_k * dk + (long long)hk * dk + tid];
  }
  int bi, ai;
  if (ba_grouped) {
    bi = b_off + (h / r) * 2 * r + h % r;
    ai = bi + r;
  } else {
    bi = b_off + h;
    ai = a_off + h;
  }
  in.b = proj[bi];
  in.a = proj[ai];
  if (j < dv) in.vv = y[2LL * n_k * dk + (long long)h * dv + j];
  return in;
}

// One token of the gated delta rule on the block's state slice s (registers: rows ty, ty + 8, ... of column j of
// value head h) from its inputs `in` (q35_gdn_load), output out; the shared arrays of the caller. Every thread of
// the block calls it (barriers).
template <int M>
__device__ __forceinline__ void q35_gdn_token(float (&s)[M], const GdnIn &in, const float *__restrict__ A,
                                              const float *__restrict__ dt,
                                              float *__restrict__ out, int h, int j, int dk, int dv, float scale,
                                              float l2_eps, float *q_s, float *k_s,
                                              float (*red1)[Q35_COLS + 1], float (*red2)[Q35_COLS + 1],
                                              float (*nrm)[Q35_ROWS]) {
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * Q35_COLS + tx;
  const bool col = j < dv;
  // q, k of key head hk and their squared norms (warp ty reduces its 32 elements, then the 8 warps' partials)
  const float qv = in.qv, kv = in.kv;
  float sq = qv * qv, sk = kv * kv;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sq += __shfl_xor_sync(0xffffffffu, sq, o);
    sk += __shfl_xor_sync(0xffffffffu, sk, o);
  }
  if (tx == 0) {
    nrm[0][ty] = sq;
    nrm[1][ty] = sk;
  }
  __syncthreads();
  float tq = 0.f, tk = 0.f;
#pragma unroll
  for (int w = 0; w < Q35_ROWS; w++) {
    tq += nrm[0][w];
    tk += nrm[1][w];
  }
  if (tid < dk) {
    q_s[tid] = qv / sqrtf(tq + l2_eps) * scale;
    k_s[tid] = kv / sqrtf(tk + l2_eps);
  }
  const float b = 1.0f / (1.0f + expf(-in.b));
  const float sp_in = in.a + dt[h];
  const float sp = sp_in > 20.0f ? sp_in : log1pf(expf(sp_in));
  const float eg = expf(A[h] * sp);
  __syncthreads();                            // q_s, k_s complete
  const float vv = in.vv;
  float kvm = 0.0f;
#pragma unroll
  for (int m = 0; m < M; m++) {
    const int i = ty + Q35_ROWS * m;
    if (i < dk) {
      s[m] *= eg;
      kvm += k_s[i] * s[m];
    }
  }
  red1[ty][tx] = kvm;
  __syncthreads();
  float sum = 0.0f;                           // every thread sums its column's 8 partials of S^T k itself
#pragma unroll
  for (int w = 0; w < Q35_ROWS; w++) sum += red1[w][tx];
  const float u = col ? (vv - sum) * b : 0.0f;
  float o = 0.0f;
#pragma unroll
  for (int m = 0; m < M; m++) {
    const int i = ty + Q35_ROWS * m;
    if (i < dk) {
      s[m] += k_s[i] * u;
      o += q_s[i] * s[m];
    }
  }
  red2[ty][tx] = o;                           // a second array: red1 may still be read by other warps
  __syncthreads();
  if (ty == 0 && col) {
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < Q35_ROWS; w++) acc += red2[w][tx];
    out[(long long)h * dv + j] = acc;
  }
}

// The gated delta rule with its prologue (qwen3next._gdn after the conv) for n_tok tokens one after the other (the
// decode step: n_tok = 1), token t's conv output at y + t * ys, its projection (b, a) at proj + t * ps and its output
// at out + t * os; grid (ceil(dv / 32), n_v), block (32, 8). Block (tile, h): value head h reads key head hk = tiled ?
// h % n_k : h / (n_v / n_k);
//   q = y[hk*dk:] / sqrt(|.|^2 + l2_eps) * scale, k = y[n_k*dk + hk*dk:] / sqrt(|.|^2 + l2_eps),
//   v = y[2*n_k*dk + h*dv:], beta = sigmoid(b_h), g = A_h * softplus(a_h + dt_h),
//   S <- exp(g) S; u = (v - S^T k) * beta; S <- S + k u^T; o = S^T q   (S = state[h] (dk, dv), in place; held in
//   registers from the first token to the last).
// b_h, a_h from proj: ba_grouped (qwen3next ssm_ba, per key head [b x r, a x r]): b = proj[b_off + (h/r)*2r + h%r],
// a = b's index + r; else (qwen35 ssm_beta / ssm_alpha) b = proj[b_off + h], a = proj[a_off + h].
template <int M>
__global__ void __launch_bounds__(Q35_COLS *Q35_ROWS)
    k_q35_gdn_step(const float *__restrict__ y, const float *__restrict__ proj, const float *__restrict__ A,
                   const float *__restrict__ dt, float *__restrict__ state, float *__restrict__ out, int n_v, int n_k,
                   int dk, int dv, int tiled, int b_off, int a_off, int ba_grouped, float scale, float l2_eps,
                   int n_tok, long long ys, long long ps, long long os, float *const *keep, long long ks) {
  griddep_launch();
  griddep_wait();
  float *kp = keep ? *keep : nullptr;          // the kept states' base (set before the launch), or none
  __shared__ float q_s[Q35_MAX_DK], k_s[Q35_MAX_DK];
  __shared__ float red1[Q35_ROWS][Q35_COLS + 1], red2[Q35_ROWS][Q35_COLS + 1];
  __shared__ float nrm[2][Q35_ROWS];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int h = blockIdx.y;
  const int j = blockIdx.x * Q35_COLS + tx;
  const bool col = j < dv;
  float *S = state + (long long)h * dk * dv;
  float s[M];
#pragma unroll
  for (int m = 0; m < M; m++) {
    const int i = ty + Q35_ROWS * m;
    s[m] = (col && i < dk) ? S[(long long)i * dv + j] : 0.0f;
  }
  // token t + 1's inputs are loaded while token t runs (its loads in flight during the reductions)
  GdnIn in = q35_gdn_load(y, proj, h, j, n_v, n_k, dk, dv, tiled, b_off, a_off, ba_grouped);
  for (int t = 0; t < n_tok; t++) {
    if (t) __syncthreads();                   // the previous token's shared arrays read by every warp
    const GdnIn next = t + 1 < n_tok ? q35_gdn_load(y + (t + 1) * ys, proj + (t + 1) * ps, h, j, n_v, n_k, dk, dv,
                                                    tiled, b_off, a_off, ba_grouped) : in;
    q35_gdn_token<M>(s, in, A, dt, out + t * os, h, j, dk, dv, scale, l2_eps, q_s, k_s, red1, red2, nrm);
    if (kp) {                                  // the state after token t, at its kept slot
      float *K = kp + t * ks + (long long)h * dk * dv;
#pragma unroll
      for (int m = 0; m < M; m++) {
        const int i = ty + Q35_ROWS * m;
        if (col && i < dk) K[(long long)i * dv + j] = s[m];
      }
    }
    in = next;
  }
#pragma unroll
  for (int m = 0; m < M; m++) {
    const int i = ty + Q35_ROWS * m;
    if (col && i < dk) S[(long long)i * dv + j] = s[m];
  }
}

// Gated RMSNorm per value head (gdn.gated_rms_norm): grid (n_v, tokens), block min(256, dv rounded up to 32).
// v = o / sqrt(mean(o_h^2) + eps) * w * silu(z) -> out f32 (may be NULL) and q8_1 blocks out_q8 (may be NULL;
// dv % 32 == 0) of the whole (n_v * dv) row; token t's rows at o + t * rs.x, z + t * rs.y, out + t * rs.z (floats)
// and out_q8 + t * rs.w (bytes).
struct Q35Rows {
  long long x, y, z, w;
};
__global__ void k_q35_gated_norm(const float *__restrict__ o, const float *__restrict__ z, const float *__restrict__ w,
                                 float *__restrict__ out, int8_t *__restrict__ out_q8, int n_v, int dv, float eps,
                                 Q35Rows rs) {
  griddep_launch();
  griddep_wait();
  const long long t = blockIdx.y;
  o += t * rs.x;
  z += t * rs.y;
  if (out) out += t * rs.z;
  if (out_q8) out_q8 += t * rs.w;
  __shared__ float sh[32];
  const long long base = (long long)blockIdx.x * dv;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dv; i += blockDim.x) {
    const float x = o[base + i];
    ss += x * x;
  }
  const float tot = q35_block_sum(ss, sh);
  const float rn = 1.0f / sqrtf(tot / (float)dv + eps);
  float2 *ds = reinterpret_cast<float2 *>(out_q8 + (long long)n_v * dv);
  for (int i = threadIdx.x; i < dv; i += blockDim.x) {    // dv % 32 == 0 when out_q8: warps stay whole
    const float zz = z[base + i];
    const float v = o[base + i] * rn * w[i] * (zz / (1.0f + expf(-zz)));
    if (out) out[base + i] = v;
    if (out_q8) q8_store(v, (int)(base + i), out_q8, ds);
  }
}

// Gated attention prologue: qg f32 = [per head h: q (hd) | gate (hd)] (n_head heads) ++ k (n_kv*hd) ++ v (n_kv*hd)
// (the fused attn_q / attn_k / attn_v matvec), one row per token. Grid (n_head + 2 n_kv, tokens), block hd (a
// multiple of 32, <= 256); per token row:
// qkv f32 [q (n_head*hd) | k (n_kv*hd) | v (n_kv*hd)] (strata_rope_kv_decode's layout) with per-head RMSNorm
// q = q / sqrt(mean(q^2) + eps) * q_norm, k likewise with k_norm, v copied; gate f32 (n_head*hd).
__global__ void k_q35_attn_prep(const float *__restrict__ qg, const float *__restrict__ qn,
                                const float *__restrict__ kn, float *__restrict__ qkv, float *__restrict__ gate,
                                int n_head, int n_kv, int hd, float eps) {
  griddep_launch();
  griddep_wait();
  __shared__ float sh[32];
  const int b = blockIdx.x, i = threadIdx.x;
  const long long t = blockIdx.y;                     // token: rows of qg, qkv and gate
  qg += t * (2LL * n_head + 2LL * n_kv) * hd;
  qkv += t * ((long long)n_head + 2LL * n_kv) * hd;
  gate += t * (long long)n_head * hd;
  const float *src;
  float *dst;
  const float *w = nullptr;
  if (b < n_head) {                                   // block-uniform branches
    src = qg + (long long)b * 2 * hd;
    dst = qkv + (long long)b * hd;
    w = qn;
    gate[(long long)b * hd + i] = src[hd + i];
  } else if (b < n_head + n_kv) {
    src = qg + 2LL * n_head * hd + (long long)(b - n_head) * hd;
    dst = qkv + (long long)n_head * hd + (long long)(b - n_head) * hd;
    w = kn;
  } else {
    src = qg + 2LL * n_head * hd + (long long)n_kv * hd + (long long)(b - n_head - n_kv) * hd;
    dst = qkv + (long long)(n_head + n_kv) * hd + (long long)(b - n_head - n_kv) * hd;
  }
  const float x = src[i];
  const float tot = q35_block_sum(x * x, sh);         // every thread of every block calls it
  dst[i] = w ? x * rsqrtf(tot / (float)hd + eps) * w[i] : x;
}

// Attention output gate: v = att * sigmoid(gate) over n elements -> out f32, out16 f16 and q8_1 blocks out_q8 (each
// may be NULL; out_q8 needs n % 32 == 0). Grid ceil(n / 256), block 256.
// Rows (the short read): the n elements are rows of `width` (% 32 == 0 with out_q8), row t's q8_1 blocks at
// out_q8 + t * q8s bytes; one row: width = n.
__global__ void k_q35_out_gate(const float *__restrict__ att, const float *__restrict__ gate, float *__restrict__ out,
                               __half *__restrict__ out16, int8_t *__restrict__ out_q8, int n, int width,
                               long long q8s) {
  griddep_launch();
  griddep_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = 0.f;
  if (i < n) {
    v = att[i] * (1.0f / (1.0f + expf(-gate[i])));
    if (out) out[i] = v;
    if (out16) out16[i] = __float2half_rn(v);
  }
  if (out_q8 && i - (int)(threadIdx.x & 31) < n) {
    const int t = i / width, j = i - t * width;
    int8_t *oq = out_q8 + t * q8s;
    q8_store(v, j, oq, reinterpret_cast<float2 *>(oq + width));
  }
}

template <int M>
cudaError_t launch_step(cudaStream_t st, const float *y, const float *proj, const float *A, const float *dt,
                        float *state, float *out, int n_v, int n_k, int dk, int dv, int tiled, int b_off, int a_off,
                        int ba_grouped, float scale, float l2_eps, int n_tok, long long ys, long long ps,
                        long long os, float *const *keep, long long ks) {
  dim3 grid((dv + Q35_COLS - 1) / Q35_COLS, n_v), block(Q35_COLS, Q35_ROWS);
  return st_launch(k_q35_gdn_step<M>, grid, block, 0, st, y, proj, A, dt, state, out, n_v, n_k, dk, dv, tiled, b_off,
                   a_off, ba_grouped, scale, l2_eps, n_tok, ys, ps, os, keep, ks);
}

}  // namespace

extern "C" int strata_q35_conv_rows_keep(void *stream, const float *x, long long x_stride, const float *w,
                                         float *window, float *y, long long y_stride, int n, int channels, int kernel,
                                         float *const *keep, long long keep_stride) {
  if (channels <= 0 || kernel < 2 || kernel > 8 || n <= 0 || (keep && keep_stride < (long long)(kernel - 1) * channels))
    return (int)cudaErrorInvalidValue;
  cudaStream_t st = (cudaStream_t)stream;
  const dim3 nb((channels + 127) / 128), bs(128);
#define CV(K) st_launch(k_q35_conv<K>, nb, bs, 0, st, x, w, window, y, channels, n, x_stride, y_stride, keep, \
                        keep_stride)
  switch (kernel) {
    case 2: CV(2); break; case 3: CV(3); break; case 4: CV(4); break; case 5: CV(5); break;
    case 6: CV(6); break; case 7: CV(7); break; default: CV(8); break;
  }
#undef CV
  return (int)cudaGetLastError();
}

extern "C" int strata_q35_conv_rows(void *stream, const float *x, long long x_stride, const float *w, float *window,
                                    float *y, long long y_stride, int n, int channels, int kernel) {
  return strata_q35_conv_rows_keep(stream, x, x_stride, w, window, y, y_stride, n, channels, kernel, nullptr, 0);
}

extern "C" int strata_q35_conv(void *stream, const float *x, const float *w, float *window, float *y, int channels,
                               int kernel) {
  return strata_q35_conv_rows(stream, x, 0, w, window, y, 0, 1, channels, kernel);
}

extern "C" int strata_q35_gdn_steps_keep(void *stream, const float *y, long long y_stride, const float *proj,
                                         long long proj_stride, const float *A, const float *dt, float *state,
                                         float *out, long long out_stride, int n, int n_v, int n_k, int dk, int dv,
                                         int tiled, int b_off, int a_off, int ba_grouped, float scale, float l2_eps,
                                         float *const *keep, long long keep_stride) {
  if (n <= 0 || n_v <= 0 || n_k <= 0 || n_v % n_k || dk <= 0 || dk > Q35_MAX_DK || dv <= 0 ||
      (keep && keep_stride < (long long)n_v * dk * dv))
    return (int)cudaErrorInvalidValue;
  cudaStream_t st = (cudaStream_t)stream;
  const int m = (dk + Q35_ROWS - 1) / Q35_ROWS;
#define Q35_STEP(MM) \
  launch_step<MM>(st, y, proj, A, dt, state, out, n_v, n_k, dk, dv, tiled, b_off, a_off, ba_grouped, scale, l2_eps, \
                  n, y_stride, proj_stride, out_stride, keep, keep_stride)
  if (m <= 2) Q35_STEP(2);
  else if (m <= 4) Q35_STEP(4);
  else if (m <= 8) Q35_STEP(8);
  else if (m <= 16) Q35_STEP(16);
  else Q35_STEP(32);
#undef Q35_STEP
  return (int)cudaGetLastError();
}

extern "C" int strata_q35_gdn_steps(void *stream, const float *y, long long y_stride, const float *proj,
                                    long long proj_stride, const float *A, const float *dt, float *state, float *out,
                                    long long out_stride, int n, int n_v, int n_k, int dk, int dv, int tiled,
                                    int b_off, int a_off, int ba_grouped, float scale, float l2_eps) {
  return strata_q35_gdn_steps_keep(stream, y, y_stride, proj, proj_stride, A, dt, state, out, out_stride, n, n_v, n_k,
                                   dk, dv, tiled, b_off, a_off, ba_grouped, scale, l2_eps, nullptr, 0);
}

extern "C" int strata_q35_gdn_step(void *stream, const float *y, const float *proj, const float *A, const float *dt,
                                   float *state, float *out, int n_v, int n_k, int dk, int dv, int tiled, int b_off,
                                   int a_off, int ba_grouped, float scale, float l2_eps) {
  return strata_q35_gdn_steps(stream, y, 0, proj, 0, A, dt, state, out, 0, 1, n_v, n_k, dk, dv, tiled, b_off, a_off,
                              ba_grouped, scale, l2_eps);
}

extern "C" int strata_q35_gated_norm(void *stream, const float *o, const float *z, const float *w, float *out,
                                     void *out_q8, int n_v, int dv, float eps) {
  if (n_v <= 0 || dv <= 0 || (out_q8 && dv % 32)) return (int)cudaErrorInvalidValue;
  const int bs = dv >= 256 ? 256 : (dv + 31) / 32 * 32;
  st_launch(k_q35_gated_norm, dim3(n_v), dim3(bs), 0, (cudaStream_t)stream, o, z, w, out, (int8_t *)out_q8, n_v, dv,
            eps, Q35Rows{0, 0, 0, 0});
  return (int)cudaGetLastError();
}

extern "C" int strata_q35_gated_norm_rows(void *stream, const float *o, long long o_stride, const float *z,
                                          long long z_stride, const float *w, float *out, long long out_stride,
                                          void *out_q8, long long q8_stride, int n, int n_v, int dv, float eps) {
  if (n <= 0 || n > 65535 || n_v <= 0 || dv <= 0 || (out_q8 && dv % 32)) return (int)cudaErrorInvalidValue;
  const int bs = dv >= 256 ? 256 : (dv + 31) / 32 * 32;
  st_launch(k_q35_gated_norm, dim3(n_v, n), dim3(bs), 0, (cudaStream_t)stream, o, z, w, out, (int8_t *)out_q8, n_v,
            dv, eps, Q35Rows{o_stride, z_stride, out_stride, q8_stride});
  return (int)cudaGetLastError();
}

extern "C" int strata_q35_attn_prep(void *stream, const float *qg, const float *q_norm, const float *k_norm,
                                    float *qkv, float *gate, int n, int n_head, int n_kv, int hd, float eps) {
  if (n < 0 || n_head <= 0 || n_kv <= 0 || hd <= 0 || hd % 32 || hd > 256) return (int)cudaErrorInvalidValue;
  const long long qg_row = (2LL * n_head + 2LL * n_kv) * hd, qkv_row = ((long long)n_head + 2LL * n_kv) * hd,
                  gate_row = (long long)n_head * hd;
  for (int t0 = 0; t0 < n; t0 += 65535) {             // grid.y holds at most 65535 token rows per launch
    const int rows = n - t0 < 65535 ? n - t0 : 65535;
    st_launch(k_q35_attn_prep, dim3(n_head + 2 * n_kv, rows), dim3(hd), 0, (cudaStream_t)stream, qg + t0 * qg_row,
              q_norm, k_norm, qkv + t0 * qkv_row, gate + t0 * gate_row, n_head, n_kv, hd, eps);
  }
  return (int)cudaGetLastError();
}

extern "C" int strata_q35_out_gate(void *stream, const float *att, const float *gate, float *out, void *out16,
                                   void *out_q8, int n) {
  if (n <= 0 || (out_q8 && n % 32)) return (int)cudaErrorInvalidValue;
  st_launch(k_q35_out_gate, dim3((n + 255) / 256), dim3(256), 0, (cudaStream_t)stream, att, gate, out,
            (__half *)out16, (int8_t *)out_q8, n, n, 0LL);
  return (int)cudaGetLastError();
}

extern "C" int strata_q35_out_gate_rows(void *stream, const float *att, const float *gate, float *out, void *out_q8,
                                        long long q8_stride, int n, int width) {
  if (n <= 0 || width <= 0 || (out_q8 && (width % 32 || q8_stride < width + width / 4)))
    return (int)cudaErrorInvalidValue;
  const int total = n * width;
  st_launch(k_q35_out_gate, dim3((total + 255) / 256), dim3(256), 0, (cudaStream_t)stream, att, gate, out,
            (__half *)nullptr, (int8_t *)out_q8, total, width, q8_stride);
  return (int)cudaGetLastError();
}
