// gdn.cu: Gated DeltaNet's recurrent delta rule over n tokens and its causal depthwise conv (strata_gdn_*).
// Strata CUDA kernels for Gated DeltaNet layers (qwen3next / qwen35 / qwen35moe): the recurrent gated delta rule
// (decode) and the causal depthwise conv with its window as state.
// Formulas: strata/backend/gdn.py (delta_rule_recurrent, causal_conv1d), from Yang, Kautz, Hatamizadeh,
// "Gated Delta Networks" (arXiv:2412.06464) as in transformers modeling_qwen3_next.py
// (torch_recurrent_gated_delta_rule, causal_conv1d_update). Launchers: plain C, stream first, return cudaError_t.
#include <cuda_runtime.h>
#include <math.h>

#include "launch.cuh"
#include "strata_cuda.h"

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
// Pipelined (written for prefill; since k_gdn_recurrent_warp it runs for n = 1 and the shapes the warp kernel does
// not take): a token's q, k, v (this tile), g and beta are copied by cp.async into a ring of GDN_STAGES
// shared-memory stages, GDN_STAGES - 1 tokens ahead of the one computing, so a token costs two block barriers and no
// exposed global-load latency; every thread sums the 8 partial columns of kv_mem itself.
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

// Causal conv + SiLU, one thread per (channel c, tile of GDN_CONV_T tokens): y[t, c] = silu(sum_j w[c, j] * xx[t + j])
// with xx = window[:, c] ++ x[:, c] (x rows x_stride floats apart). Only the tile-0 thread of a channel reads the old
// window (tiles >= 1 start at t >= GDN_CONV_T >= K - 1 and read x only), and it writes the new window (the last
// K - 1 entries of xx) after its reads, so no other thread sees a half-updated window. K is the kernel width (2..8).
constexpr int GDN_CONV_T = 16;
template <int K>
__global__ void k_gdn_conv(const float *__restrict__ x, long long x_stride, const float *__restrict__ w,
                           float *__restrict__ window, float *__restrict__ y, int n, int channels) {
  griddep_launch();
  griddep_wait();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int t0 = blockIdx.y * GDN_CONV_T, t1 = min(n, t0 + GDN_CONV_T);
  float buf[K], wc[K], old[K - 1];
#pragma unroll
  for (int j = 0; j < K; j++) wc[j] = w[(long long)c * K + j];
#pragma unroll
  for (int j = 0; j < K - 1; j++) {           // inputs t0 - (K - 1) + j
    const int t = t0 - (K - 1) + j;
    if (t < 0) {
      old[j] = window[(long long)(t + K - 1) * channels + c];   // only tile 0 gets here
      buf[j] = old[j];
    } else {
      buf[j] = x[(long long)t * x_stride + c];
    }
  }
  float xv[GDN_CONV_T];
#pragma unroll
  for (int u = 0; u < GDN_CONV_T; u++) xv[u] = x[(long long)min(t0 + u, n - 1) * x_stride + c];
#pragma unroll
  for (int u = 0; u < GDN_CONV_T; u++) {
    buf[K - 1] = xv[u];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < K; j++) acc += buf[j] * wc[j];
    if (t0 + u < t1) y[(long long)(t0 + u) * channels + c] = acc / (1.0f + expf(-acc));
#pragma unroll
    for (int j = 0; j < K - 1; j++) buf[j] = buf[j + 1];
  }
  if (blockIdx.y == 0) {                      // new window: xx positions n .. n + K - 2, i.e. inputs n - (K - 1) + j
#pragma unroll
    for (int j = 0; j < K - 1; j++) {
      const int t = n - (K - 1) + j;
      float v = 0.0f;
      if (t < 0) {                            // n < K - 1: part of the old window stays (old[t + K - 1])
#pragma unroll
        for (int i = 0; i < K - 1; i++) v = (i == t + K - 1) ? old[i] : v;
      } else {
        v = x[(long long)t * x_stride + c];
      }
      window[(long long)j * channels + c] = v;
    }
  }
}

// ---- prefill: one warp per (value head, GW_C value columns), no block barriers
constexpr int GW_WARPS = 4;    // warps per block
// The warp kernel variant 0 (choose) takes for d_k: the columns per warp measured fastest on the H200 for one 512-token
// ubatch (bench/cuda_kernels.py --only-gdn, us for 4 / 2 / 1 columns): d_k 64 -> 1 (170 / 119 / 95), 128 -> 2
// (203 / 136 / 183), 256 -> 4 (177 / 177 / 285); d_k 32 (not measured) -> 2.
__host__ __forceinline__ int warp_auto_variant(int dk) { return dk == 64 ? 4 : dk == 256 ? 2 : 3; }
constexpr unsigned FULL = 0xffffffffu;

// R consecutive floats at p (16-byte aligned when R % 4 == 0, 8 when R == 2) into registers.
template <int R>
__device__ __forceinline__ void load_rows(float (&d)[R], const float *__restrict__ p) {
  if constexpr (R % 4 == 0) {
#pragma unroll
    for (int i = 0; i < R; i += 4) {
      const float4 f = *reinterpret_cast<const float4 *>(p + i);
      d[i] = f.x; d[i + 1] = f.y; d[i + 2] = f.z; d[i + 3] = f.w;
    }
  } else if constexpr (R == 2) {
    const float2 f = *reinterpret_cast<const float2 *>(p);
    d[0] = f.x; d[1] = f.y;
  } else {
#pragma unroll
    for (int i = 0; i < R; i++) d[i] = p[i];
  }
}

// Warp sums of N values (N = 2, 4, 8, 16 or 32) with N - 1 + (5 - log2 N) shuffles instead of 5 N (reduce-scatter:
// at each of the first log2 N levels a lane sends the half of its values its partner keeps). Returns the sum of
// p[lane >> (5 - log2 N)] over the warp; p is overwritten.
template <int N>
__device__ __forceinline__ float warp_reduce_scatter(float (&p)[N], int lane) {
  constexpr int LOG = N == 2 ? 1 : N == 4 ? 2 : N == 8 ? 3 : N == 16 ? 4 : 5;
#pragma unroll
  for (int lv = 0; lv < LOG; lv++) {
    const int half = N >> (lv + 1), m = 16 >> lv;
    const bool hi = lane & m;
#pragma unroll
    for (int i = 0; i < half; i++) {
      const float send = hi ? p[i] : p[i + half];
      const float keep = hi ? p[i + half] : p[i];
      p[i] = keep + __shfl_xor_sync(FULL, send, m);
    }
  }
#pragma unroll
  for (int m = 16 >> LOG; m >= 1; m >>= 1) p[0] += __shfl_xor_sync(FULL, p[0], m);
  return p[0];
}

// Same recurrence as k_gdn_recurrent, for prefill. Warp (h, c0) holds S[h][:, c0 .. c0 + GW_C) in registers, lane l
// rows [R l, R l + R) (d_k = 32 R): per token, kv = S^T k is a warp sum (butterfly: every lane gets all GW_C
// columns), u = (v - exp(g) kv) beta, S <- exp(g) S + k u^T, and the output partials S^T q of U tokens are summed
// together by one reduce-scatter per group. The loads of the next U tokens (q, k rows, v columns, g, beta; indices
// clamped to n - 1, not used past it) are issued before the current group computes.
template <int R, int U, int GW_C>
__global__ void __launch_bounds__(GW_WARPS * 32) k_gdn_recurrent_warp(
    const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
    const float *__restrict__ g, const float *__restrict__ beta, float *__restrict__ state, float *__restrict__ out,
    int n, int n_v, int n_qk, int dk, int dv, int tiled, float scale) {
  griddep_launch();
  griddep_wait();
  const int lane = threadIdx.x & 31;
  const int tiles = dv / GW_C;
  const int gw = blockIdx.x * GW_WARPS + (threadIdx.x >> 5);
  if (gw >= n_v * tiles) return;              // warp-uniform
  const int h = gw / tiles, c0 = (gw % tiles) * GW_C;
  const int hk = tiled ? h % n_qk : h / (n_v / n_qk);
  const int r0 = R * lane;
  float s[R][GW_C];
  float *S = state + ((long long)h * dk + r0) * dv + c0;
#pragma unroll
  for (int r = 0; r < R; r++) load_rows<GW_C>(s[r], S + (long long)r * dv);
  const long long qk_stride = (long long)n_qk * dk, v_stride = (long long)n_v * dv;
  const float *qp = q + (long long)hk * dk + r0, *kp = k + (long long)hk * dk + r0;
  const float *vp = v + (long long)h * dv + c0, *gp = g + h, *bp = beta + h;
  float cq[U][R], ck[U][R], cv[U][GW_C], cg[U], cb[U];     // the group computing
  float nq[U][R], nk[U][R], nv[U][GW_C], ng[U], nb[U];     // the next group, in flight
  auto load = [&](float (&lq)[U][R], float (&lk)[U][R], float (&lv)[U][GW_C], float (&lg)[U], float (&lb)[U],
                  int t0) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const long long t = min(t0 + u, n - 1);
      load_rows<R>(lq[u], qp + t * qk_stride);
      load_rows<R>(lk[u], kp + t * qk_stride);
      load_rows<GW_C>(lv[u], vp + t * v_stride);
      lg[u] = gp[t * n_v];
      lb[u] = bp[t * n_v];
    }
  };
  load(cq, ck, cv, cg, cb, 0);
  for (int t0 = 0; t0 < n; t0 += U) {
    load(nq, nk, nv, ng, nb, t0 + U);
    float op[U * GW_C];
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (t0 + u < n) {                       // warp-uniform
        const float eg = __expf(cg[u]);
        float kv[GW_C];
#pragma unroll
        for (int c = 0; c < GW_C; c++) {
          float a = 0.0f;
#pragma unroll
          for (int r = 0; r < R; r++) a = fmaf(s[r][c], ck[u][r], a);
          kv[c] = a;
        }
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) {
#pragma unroll
          for (int c = 0; c < GW_C; c++) kv[c] += __shfl_xor_sync(FULL, kv[c], m);
        }
#pragma unroll
        for (int c = 0; c < GW_C; c++) {
          const float uu = (cv[u][c] - eg * kv[c]) * cb[u];
          float a = 0.0f;
#pragma unroll
          for (int r = 0; r < R; r++) {
            s[r][c] = fmaf(ck[u][r], uu, eg * s[r][c]);
            a = fmaf(s[r][c], cq[u][r], a);
          }
          op[u * GW_C + c] = a;
        }
      } else {
#pragma unroll
        for (int c = 0; c < GW_C; c++) op[u * GW_C + c] = 0.0f;
      }
    }
    constexpr int SH = 32 / (U * GW_C);         // lanes holding each output value
    const float o = warp_reduce_scatter<U * GW_C>(op, lane);
    const int idx = lane / SH, u = idx / GW_C, c = idx % GW_C;
    if (lane % SH == 0 && t0 + u < n) out[((long long)(t0 + u) * n_v + h) * dv + c0 + c] = o * scale;
#pragma unroll
    for (int u2 = 0; u2 < U; u2++) {
#pragma unroll
      for (int r = 0; r < R; r++) { cq[u2][r] = nq[u2][r]; ck[u2][r] = nk[u2][r]; }
#pragma unroll
      for (int c2 = 0; c2 < GW_C; c2++) cv[u2][c2] = nv[u2][c2];
      cg[u2] = ng[u2];
      cb[u2] = nb[u2];
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int c = 0; c < GW_C; c++) S[(long long)r * dv + c] = s[r][c];
  }
}

template <int R, int U, int GW_C>
int launch_recurrent_warp(cudaStream_t st, const float *q, const float *k, const float *v, const float *g,
                          const float *beta, float *state, float *out, int n, int n_v, int n_qk, int dk, int dv,
                          int tiled, float scale) {
  const long long warps = (long long)n_v * (dv / GW_C);
  st_launch(k_gdn_recurrent_warp<R, U, GW_C>, dim3((unsigned)((warps + GW_WARPS - 1) / GW_WARPS)), dim3(GW_WARPS * 32), 0,
            st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  return (int)cudaGetLastError();
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
// (qwen3next). d_k <= 256. variant: 0 = choose (the warp kernel variant of warp_auto_variant(d_k) when n > 1, d_k
// is 32, 64, 128 or 256 and d_v a multiple of its columns per warp, else the block kernel), 1 = the block kernel
// (k_gdn_recurrent), 2 / 3 / 4 = the warp kernel (k_gdn_recurrent_warp) with 4 / 2 / 1 value columns per warp
// (cudaErrorInvalidValue when the shape does not allow it). All arrays contiguous, 16-byte aligned for the warp
// kernel. Returns cudaErrorInvalidValue (1) for bad sizes.
extern "C" int strata_gdn_recurrent_ex(void *stream, const float *q, const float *k, const float *v, const float *g,
                                       const float *beta, float *state, float *out, int n, int n_v, int n_qk, int dk,
                                       int dv, int tiled, float scale, int variant) {
  if (n < 0 || n_v <= 0 || n_qk <= 0 || n_v % n_qk || dk <= 0 || dk > 256 || dv <= 0 || variant < 0 || variant > 4)
    return 1;
  // warp kernel columns per warp by variant (2: 4, 3: 2, 4: 1); variant 0 takes warp_auto_variant(dk)
  const int wv = variant == 0 ? warp_auto_variant(dk) : variant;
  const int cols = wv == 2 ? 4 : wv == 3 ? 2 : 1;
  const bool warp_ok = (dk == 32 || dk == 64 || dk == 128 || dk == 256) && dv % cols == 0;
  if (variant >= 2 && !warp_ok) return 1;
  if (n == 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
  if (variant >= 2 || (variant == 0 && warp_ok && n > 1)) {
    using Launch = int (*)(cudaStream_t, const float *, const float *, const float *, const float *, const float *,
                           float *, float *, int, int, int, int, int, int, float);
    // [dk 32, 64, 128, 256][4, 2, 1 columns]: U tokens per group so that U * columns <= 16 and registers fit
    static const Launch table[4][3] = {
        {launch_recurrent_warp<1, 4, 4>, launch_recurrent_warp<1, 8, 2>, launch_recurrent_warp<1, 8, 1>},
        {launch_recurrent_warp<2, 4, 4>, launch_recurrent_warp<2, 8, 2>, launch_recurrent_warp<2, 8, 1>},
        {launch_recurrent_warp<4, 4, 4>, launch_recurrent_warp<4, 4, 2>, launch_recurrent_warp<4, 8, 1>},
        {launch_recurrent_warp<8, 2, 4>, launch_recurrent_warp<8, 4, 2>, launch_recurrent_warp<8, 4, 1>}};
    const int di = dk == 32 ? 0 : dk == 64 ? 1 : dk == 128 ? 2 : 3;
    return table[di][wv - 2](st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  }
  const int m = (dk + GDN_ROWS - 1) / GDN_ROWS;
  if (m <= 1) return launch_recurrent<1>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  if (m <= 2) return launch_recurrent<2>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  if (m <= 4) return launch_recurrent<4>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  if (m <= 8) return launch_recurrent<8>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  if (m <= 16) return launch_recurrent<16>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
  return launch_recurrent<32>(st, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale);
}

extern "C" int strata_gdn_recurrent(void *stream, const float *q, const float *k, const float *v, const float *g,
                                    const float *beta, float *state, float *out, int n, int n_v, int n_qk, int dk,
                                    int dv, int tiled, float scale) {
  return strata_gdn_recurrent_ex(stream, q, k, v, g, beta, state, out, n, n_v, n_qk, dk, dv, tiled, scale, 0);
}

// Causal depthwise conv + SiLU over n tokens with the window as state (gdn.causal_conv1d): x f32 (n, channels)
// with rows x_stride floats apart (x_stride >= channels: the conv channels of a wider projection), w f32
// (channels, kernel), window f32 (kernel - 1, channels) updated in place, y f32 (n, channels) contiguous.
// kernel 2..8. Returns cudaErrorInvalidValue (1) for bad sizes.
extern "C" int strata_gdn_conv(void *stream, const float *x, int x_stride, const float *w, float *window, float *y,
                               int n, int channels, int kernel) {
  if (n < 0 || channels <= 0 || x_stride < channels || kernel < 2 || kernel > 8) return 1;
  if (n == 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
  const int bs = 128;
  const dim3 nb((channels + bs - 1) / bs, (n + GDN_CONV_T - 1) / GDN_CONV_T);
  const long long xs = x_stride;
  switch (kernel) {
    case 2: st_launch(k_gdn_conv<2>, nb, bs, 0, st, x, xs, w, window, y, n, channels); break;
    case 3: st_launch(k_gdn_conv<3>, nb, bs, 0, st, x, xs, w, window, y, n, channels); break;
    case 4: st_launch(k_gdn_conv<4>, nb, bs, 0, st, x, xs, w, window, y, n, channels); break;
    case 5: st_launch(k_gdn_conv<5>, nb, bs, 0, st, x, xs, w, window, y, n, channels); break;
    case 6: st_launch(k_gdn_conv<6>, nb, bs, 0, st, x, xs, w, window, y, n, channels); break;
    case 7: st_launch(k_gdn_conv<7>, nb, bs, 0, st, x, xs, w, window, y, n, channels); break;
    default: st_launch(k_gdn_conv<8>, nb, bs, 0, st, x, xs, w, window, y, n, channels); break;
  }
  return (int)cudaGetLastError();
}
