// Strata CUDA kernels for Gated DeltaNet layers (qwen3next / qwen35 / qwen35moe): the recurrent gated delta rule
// (decode) and the causal depthwise conv with its window as state.
// Formulas: strata/backend/gdn.py (delta_rule_recurrent, causal_conv1d), from Yang, Kautz, Hatamizadeh,
// "Gated Delta Networks" (arXiv:2412.06464) as in transformers modeling_qwen3_next.py
// (torch_recurrent_gated_delta_rule, causal_conv1d_update). Launchers: plain C, stream first, return cudaError_t.
#include <cuda_runtime.h>
#include <math.h>

#include "launch.cuh"

namespace {

constexpr int GDN_COLS = 32;   // value columns per block (one warp wide)
constexpr int GDN_ROWS = 8;    // row groups per block: thread (tx, ty) owns rows ty, ty + 8, ... of column tx

constexpr int GDN_STAGES = 4;  // prefill pipeline depth: tokens t + 1 .. t + 3 in flight while token t computes

__device__ __forceinline__ void cp_async4(float *dst, const float *src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// One block per (value head h, tile of 32 value columns). For each token t (in order):
//   S <- exp(g_t) S;  kv_mem = S^T k_t;  u = (v_t - kv_mem) * beta_t;  S <- S + k_t u^T;  o_t = S^T (q_t * scale)
// with S = state[h] (d_k, d_v) kept in registers (M rows per thread) across the tokens, written back at the end.
// q, k: (n, n_qk, d_k); value head h reads key head (tiled ? h % n_qk : h / (n_v / n_qk)).
// Pipelined for prefill (n in the hundreds): a token's q, k, v (this tile), g and beta are copied by cp.async into
// a ring of GDN_STAGES shared-memory stages, GDN_STAGES - 1 tokens ahead of the one computing, so a token costs two
// block barriers and no exposed global-load latency; every thread sums the 8 partial columns of kv_mem itself.
template <int M>
__global__ void __launch_bounds__(GDN_COLS * GDN_ROWS) k_gdn_recurrent(
    const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
    const float *__restrict__ g, const float *__restrict__ beta, float *__restrict__ state, float *__restrict__ out,
    int n, int n_v, int n_qk, int dk, int dv, int tiled, float scale) {
  griddep_launch();
  griddep_wait();
  extern __shared__ float sh[];               // GDN_STAGES x [q (dk) | k (dk) | v (32) | g | beta]
  __shared__ float red1[GDN_ROWS][GDN_COLS + 1], red2[GDN_ROWS][GDN_COLS + 1];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * GDN_COLS + tx;   // dk <= 256 = threads per block
  const int h = blockIdx.y;
  const int j = blockIdx.x * GDN_COLS + tx;
  const bool col = j < dv;
  const int hk = tiled ? h % n_qk : h / (n_v / n_qk);
  const int SS = 2 * dk + GDN_COLS + 2;       // floats per stage
  // copies of token t into stage t % GDN_STAGES (nothing past n); every thread commits one group per call
  auto issue = [&](int t) {
    if (t < n) {
      float *st = sh + (t % GDN_STAGES) * SS;
      if (tid < dk) {
        cp_async4(st + tid, q + ((long long)t * n_qk + hk) * dk + tid);
        cp_async4(st + dk + tid, k + ((long long)t * n_qk + hk) * dk + tid);
      }
      if (ty == 0 && col) cp_async4(st + 2 * dk + tx, v + ((long long)t * n_v + h) * dv + j);
      if (tid == 0) {
        cp_async4(st + 2 * dk + GDN_COLS, g + (long long)t * n_v + h);
        cp_async4(st + 2 * dk + GDN_COLS + 1, beta + (long long)t * n_v + h);
      }
    }
    cp_async_commit();
  };
  float *S = state + (long long)h * dk * dv;
  float s[M];
#pragma unroll
  for (int m = 0; m < M; m++) {
    const int i = ty + GDN_ROWS * m;
    s[m] = (col && i < dk) ? S[(long long)i * dv + j] : 0.0f;
  }
#pragma unroll
  for (int t = 0; t < GDN_STAGES - 1; t++) issue(t);
  cp_async_wait<GDN_STAGES - 2>();            // token 0 landed (this thread's copies)
  __syncthreads();                            // ... and everyone's
  for (int t = 0; t < n; t++) {
    issue(t + GDN_STAGES - 1);                // into stage (t - 1) % GDN_STAGES, last read before barrier (2) of t - 1
    const float *st = sh + (t % GDN_STAGES) * SS;
    const float *q_s = st, *k_s = st + dk;
    const float eg = expf(st[2 * dk + GDN_COLS]), b = st[2 * dk + GDN_COLS + 1];
    const float v_c = st[2 * dk + tx];        // unused (u = 0) when !col
    float kv = 0.0f;
#pragma unroll
    for (int m = 0; m < M; m++) {
      const int i = ty + GDN_ROWS * m;
      if (i < dk) {
        s[m] *= eg;
        kv += k_s[i] * s[m];
      }
    }
    red1[ty][tx] = kv;
    __syncthreads();                          // (1) kv partials of token t
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < GDN_ROWS; r++) sum += red1[r][tx];
    const float u = col ? (v_c - sum) * b : 0.0f;
    float o = 0.0f;
#pragma unroll
    for (int m = 0; m < M; m++) {
      const int i = ty + GDN_ROWS * m;
      if (i < dk) {
        s[m] += k_s[i] * u;
        o += q_s[i] * s[m];
      }
    }
    red2[ty][tx] = o;
    cp_async_wait<GDN_STAGES - 2>();          // token t + 1 landed (this thread's copies)
    __syncthreads();                          // (2) o partials of token t; token t + 1 visible to all
    if (ty == 0 && col) {
      float acc = 0.0f;
#pragma unroll
      for (int r = 0; r < GDN_ROWS; r++) acc += red2[r][tx];
      out[((long long)t * n_v + h) * dv + j] = acc * scale;
    }
  }
#pragma unroll
  for (int m = 0; m < M; m++) {
    const int i = ty + GDN_ROWS * m;
    if (col && i < dk) S[(long long)i * dv + j] = s[m];
  }
}

// One thread per channel c: xx = window[:, c] ++ x[:, c]; y[t, c] = silu(sum_j w[c, j] * xx[t + j]);
// window[:, c] <- the last K - 1 inputs. K is the kernel width (2..8).
template <int K>
__global__ void k_gdn_conv(const float *__restrict__ x, const float *__restrict__ w, float *__restrict__ window,
                           float *__restrict__ y, int n, int channels) {
  griddep_launch();
  griddep_wait();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  float buf[K];
  float wc[K];
#pragma unroll
  for (int j = 0; j < K; j++) wc[j] = w[(long long)c * K + j];
#pragma unroll
  for (int j = 0; j < K - 1; j++) buf[j] = window[(long long)j * channels + c];
  constexpr int U = 8;                        // tokens whose inputs are loaded together (latency-bound loop)
  int t0 = 0;
  for (; t0 + U <= n; t0 += U) {
    float xv[U];
#pragma unroll
    for (int u = 0; u < U; u++) xv[u] = x[(long long)(t0 + u) * channels + c];
#pragma unroll
    for (int u = 0; u < U; u++) {
      buf[K - 1] = xv[u];
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < K; j++) acc += buf[j] * wc[j];
      y[(long long)(t0 + u) * channels + c] = acc / (1.0f + expf(-acc));
#pragma unroll
      for (int j = 0; j < K - 1; j++) buf[j] = buf[j + 1];
    }
  }
  for (int t = t0; t < n; t++) {
    buf[K - 1] = x[(long long)t * channels + c];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < K; j++) acc += buf[j] * wc[j];
    y[(long long)t * channels + c] = acc / (1.0f + expf(-acc));
#pragma unroll
    for (int j = 0; j < K - 1; j++) buf[j] = buf[j + 1];
  }
#pragma unroll
  for (int j = 0; j < K - 1; j++) window[(long long)j * channels + c] = buf[j];
}

template <int M>
int launch_recurrent(cudaStream_t st, const float *q, const float *k, const float *v, const float *g,
                     const float *beta, float *state, float *out, int n, int n_v, int n_qk, int dk, int dv, int tiled,
                     float scale) {
  dim3 grid((dv + GDN_COLS - 1) / GDN_COLS, n_v), block(GDN_COLS, GDN_ROWS);
  st_launch(k_gdn_recurrent<M>, grid, block, GDN_STAGES * (2 * dk + GDN_COLS + 2) * sizeof(float), st, q, k, v, g, beta,
            state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  return (int)cudaGetLastError();
}

}  // namespace

// Gated delta rule over n tokens one at a time (decode: n = 1), state updated in place.
// q, k f32 (n, n_qk, d_k) L2-normalised (q is multiplied by `scale` here, = 1/sqrt(d_k) in the models); v f32
// (n, n_v, d_v); g (log decay, <= 0) and beta f32 (n, n_v); state f32 (n_v, d_k, d_v); out f32 (n, n_v, d_v).
// n_v a multiple of n_qk; tiled = 1: value head h reads key head h % n_qk (qwen35*), 0: h / (n_v / n_qk)
// (qwen3next). d_k <= 256. Returns cudaErrorInvalidValue (1) for bad sizes.
extern "C" int strata_gdn_recurrent(void *stream, const float *q, const float *k, const float *v, const float *g,
                                    const float *beta, float *state, float *out, int n, int n_v, int n_qk, int dk,
                                    int dv, int tiled, float scale) {
  if (n < 0 || n_v <= 0 || n_qk <= 0 || n_v % n_qk || dk <= 0 || dk > 256 || dv <= 0) return 1;
  if (n == 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
  const int m = (dk + GDN_ROWS - 1) / GDN_ROWS;
  if (m <= 1) return launch_recurrent<1>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  if (m <= 2) return launch_recurrent<2>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  if (m <= 4) return launch_recurrent<4>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  if (m <= 8) return launch_recurrent<8>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  if (m <= 16) return launch_recurrent<16>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  return launch_recurrent<32>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
}

// Causal depthwise conv + SiLU over n tokens with the window as state (gdn.causal_conv1d): x f32 (n, channels),
// w f32 (channels, kernel), window f32 (kernel - 1, channels) updated in place, y f32 (n, channels).
// kernel 2..8. Returns cudaErrorInvalidValue (1) for bad sizes.
extern "C" int strata_gdn_conv(void *stream, const float *x, const float *w, float *window, float *y, int n,
                               int channels, int kernel) {
  if (n < 0 || channels <= 0 || kernel < 2 || kernel > 8) return 1;
  if (n == 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
  const int bs = 128, nb = (channels + bs - 1) / bs;
  switch (kernel) {
    case 2: st_launch(k_gdn_conv<2>, nb, bs, 0, st, x, w, window, y, n, channels); break;
    case 3: st_launch(k_gdn_conv<3>, nb, bs, 0, st, x, w, window, y, n, channels); break;
    case 4: st_launch(k_gdn_conv<4>, nb, bs, 0, st, x, w, window, y, n, channels); break;
    case 5: st_launch(k_gdn_conv<5>, nb, bs, 0, st, x, w, window, y, n, channels); break;
    case 6: st_launch(k_gdn_conv<6>, nb, bs, 0, st, x, w, window, y, n, channels); break;
    case 7: st_launch(k_gdn_conv<7>, nb, bs, 0, st, x, w, window, y, n, channels); break;
    default: st_launch(k_gdn_conv<8>, nb, bs, 0, st, x, w, window, y, n, channels); break;
  }
  return (int)cudaGetLastError();
}
