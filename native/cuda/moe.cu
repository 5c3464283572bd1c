// moe.cu: the mixture-of-experts FFN kernels: softmax top-k routing with the shared-expert gate, the routed experts'
// decode matvecs through a device expert table, and the grouped prefill path (assignments sorted by expert, grouped
// matvec tiles, the weighted combine).
// Routing follows strata/backend/moe.py (route, moe_ffn): p = softmax(router logits), the k largest p (ties: lower
// id), optionally renormalised to sum 1; the shared expert's output is scaled by sigmoid(x . w_gate) (transformers
// Qwen3NextSparseMoeBlock, llama.cpp build_moe_ffn with softmax gating). The experts' matrices are read through
// tables of n_table row-block addresses (one per expert, uint64 on the device): the kernels index them by the
// routed ids, so a table entry can point anywhere (the model's tensors today, a VRAM slot of an expert cache later).
// Activations are q8_1 (llama.cpp quantize_q8_1) and the dot products the dp4a ones of quant.cuh, as in the dense
// decode matvecs. Every kernel is launched by st_launch and waits (griddep_wait) before it reads anything.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <limits.h>
#include <math.h>
#include "strata_cuda.h"
#include "q8.cuh"
#include "launch.cuh"
#include "quant.cuh"
#include "matvec.cuh"

namespace {

constexpr int MOE_ROUTE_THREADS = 256;
constexpr int MOE_GU_WARPS = 8;              // decode gate/up: 8 warps x 4 activations = one q8_1 block per block
constexpr int MOE_GU_ROWS = 32 / MOE_GU_WARPS;
constexpr int MOE_MM_R = 4;                  // grouped matvec: rows per warp
constexpr int MOE_MM_T = STRATA_MOE_TILE;    // grouped matvec: tokens per tile
constexpr int MOE_GROUP_THREADS = 1024;

// Bytes of one q8_1 row of n values in the MoE kernels' row layout: n int8, then n / 32 float2 (d, d * sum), the
// row padded to 16 bytes (load_xq's 16-byte loads). Same formula in strata/backend/cuda/moe.py (q8_row_bytes).
__host__ __device__ inline long long q8_row_stride(int n) { return ((long long)n + n / 4 + 15) & ~15LL; }

__device__ inline bool moe_better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__device__ inline int clamp_id(int e, int n) { return e < 0 ? 0 : e >= n ? n - 1 : e; }

// The maximum of v over the block (blockDim a multiple of 32; sh: 32 floats; every thread calls it).
__device__ inline float moe_block_max(float v, float *sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  float t = sh[0];
  for (int i = 1; i < nw; i++) t = fmaxf(t, sh[i]);
  return t;
}

// Routing of token blockIdx.x: logits f32 (n_expert) -> p = softmax in dynamic shared memory (block reductions),
// then warp 0 alone takes k rounds of a warp argmax (largest p, lower id on ties; lane e % 32 owns the p[e] it scans
// and sets the chosen one to -1), lane j keeping slot j; the chosen weights renormalised (their sum in round order)
// when asked; with `shared`, slot k gets id n_expert and the shared expert's gate sigmoid(x . sg) (1 without sg).
__global__ void __launch_bounds__(MOE_ROUTE_THREADS) k_moe_route(const float *__restrict__ logits, int n_expert, int k,
                                                                 int renorm, const float *__restrict__ x,
                                                                 const float *__restrict__ sg, int E, int shared,
                                                                 int *__restrict__ ids, float *__restrict__ wts) {
  griddep_launch();
  griddep_wait();
  extern __shared__ float p[];
  __shared__ float red[32];
  const int t = blockIdx.x, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int ks = k + (shared ? 1 : 0);
  const float *l = logits + (long long)t * n_expert;
  float dot = 0.f;
  if (shared && sg)
    for (int c = threadIdx.x; c < E; c += blockDim.x) dot += x[(long long)t * E + c] * sg[c];
  if (shared && sg) dot = block_sum(dot, red);      // a uniform branch: every thread takes it or none
  float mx = -INFINITY;
  for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
    const float v = l[e];
    p[e] = v;
    mx = fmaxf(mx, v);
  }
  mx = moe_block_max(mx, red);
  float s = 0.f;
  for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
    const float v = expf(p[e] - mx);
    p[e] = v;
    s += v;
  }
  s = block_sum(s, red);
  for (int e = threadIdx.x; e < n_expert; e += blockDim.x) p[e] = __fdiv_rn(p[e], s);
  __syncthreads();
  if (wid != 0) return;
  int my_id = 0;
  float my_w = 0.f, sum = 0.f;
  for (int j = 0; j < k; j++) {
    float bv = -1.f;
    int bi = INT_MAX;
    for (int e = lane; e < n_expert; e += 32)    // ascending: the first of equal values is the lower id
      if (p[e] > bv) { bv = p[e]; bi = e; }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (moe_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (bi < 0 || bi >= n_expert) {   // NaN logits: nothing compared larger; keep the id inside the table
      bi = 0;
      bv = 0.f;
    } else if (lane == (bi & 31)) {
      p[bi] = -1.f;                   // read again only by this lane
    }
    if (lane == j) { my_id = bi; my_w = bv; }
    sum += bv;
  }
  if (lane < k) {
    ids[(long long)t * ks + lane] = my_id;
    wts[(long long)t * ks + lane] = renorm ? __fdiv_rn(my_w, sum) : my_w;
  }
  if (shared && lane == 0) {
    ids[(long long)t * ks + k] = n_expert;
    wts[(long long)t * ks + k] = sg ? 1.f / (1.f + expf(-dot)) : 1.f;
  }
}

// Decode gate/up of the routed slots: block (blockIdx.x, slot) makes the 32 activations 32 bx .. 32 bx + 31 of slot
// `slot` (expert ids[slot] through the tables; the last slot has F_last activations, the others F: a shared expert
// of another width rides along as the last slot): each warp MOE_GU_ROWS gate and up rows over the q8_1 x, lanes
// striding over the 32-element sub-blocks; silu(g) * u (k_swiglu_gu's arithmetic) into act f32 (slot j at j * F)
// and its q8_1 row (slot j at j * q8_row_stride(F) bytes of act_q8, F_j values).
template <int T>
__global__ void __launch_bounds__(32 * MOE_GU_WARPS) k_moe_gate_up(const uint8_t *const *__restrict__ gate_tab,
                                                                  const uint8_t *const *__restrict__ up_tab,
                                                                  int n_table, const int *__restrict__ ids,
                                                                  int n_slots, const int8_t *__restrict__ xq,
                                                                  const float2 *__restrict__ xds, float *__restrict__ act,
                                                                  int8_t *__restrict__ act_q8, int F, int F_last,
                                                                  int n_units, long long rb) {
  griddep_launch();
  const int slot = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int Fj = slot == n_slots - 1 ? F_last : F;
  if (blockIdx.x * 32 >= Fj) return;             // the whole block: past this slot's activations
  griddep_wait();
  __shared__ float sv[32];
  const int e = clamp_id(ids[slot], n_table);
  const int i0 = blockIdx.x * 32 + warp * MOE_GU_ROWS;
  const uint8_t *g = gate_tab[e] + (long long)i0 * rb;
  const uint8_t *u = up_tab[e] + (long long)i0 * rb;
  float acc[2 * MOE_GU_ROWS];
#pragma unroll
  for (int r = 0; r < 2 * MOE_GU_ROWS; r++) acc[r] = 0.f;
#pragma unroll 2
  for (int b = lane; b < n_units; b += 32) {
    int xv[8];
    load_xq(reinterpret_cast<const int *>(xq), b, xv);
    const float2 ds = __ldg(xds + b);
#pragma unroll
    for (int r = 0; r < MOE_GU_ROWS; r++) {
      acc[r] += dot_q8x<T>(g + r * rb, b, xv, ds);
      acc[MOE_GU_ROWS + r] += dot_q8x<T>(u + r * rb, b, xv, ds);
    }
  }
#pragma unroll
  for (int r = 0; r < 2 * MOE_GU_ROWS; r++) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
  }
  if (lane < MOE_GU_ROWS) {
    float a = acc[0], up = acc[MOE_GU_ROWS];
#pragma unroll
    for (int r = 1; r < MOE_GU_ROWS; r++)
      if (lane == r) { a = acc[r]; up = acc[MOE_GU_ROWS + r]; }
    sv[warp * MOE_GU_ROWS + lane] = a / (1.f + expf(-a)) * up;
  }
  __syncthreads();
  if (warp == 0) {
    const int i = blockIdx.x * 32 + lane;
    const float v = sv[lane];
    act[(long long)slot * F + i] = v;
    int8_t *q = act_q8 + (long long)slot * q8_row_stride(F);
    q8_store(v, i, q, reinterpret_cast<float2 *>(q + Fj));
  }
}

// Decode down projection of the slots with their weighted sum: warp `row` computes y[row] = sum_j wts[j] *
// (down_{ids[j]} row . act_j) + shared_w * shared_y[row] (when shared_y), its lanes striding over all the slots'
// sub-blocks ((n_slots - 1) * F / 32 + F_last / 32 of them; slot j's q8_1 row at j * q8_row_stride(F) of act_q8,
// its down rows rb bytes, the last slot's rb_last).
template <int T>
__global__ void __launch_bounds__(128) k_moe_down(const uint8_t *const *__restrict__ tab, int n_table,
                                                  const int *__restrict__ ids, const float *__restrict__ wts,
                                                  int n_slots, const int8_t *__restrict__ act_q8, int F, int F_last,
                                                  long long rb, long long rb_last, float *__restrict__ y, int E,
                                                  const float *__restrict__ shared_y,
                                                  const float *__restrict__ shared_w) {
  griddep_launch();
  griddep_wait();
  __shared__ const uint8_t *base[STRATA_MOE_MAX_SLOTS];
  __shared__ float w[STRATA_MOE_MAX_SLOTS];
  if (threadIdx.x < n_slots) {
    base[threadIdx.x] = tab[clamp_id(ids[threadIdx.x], n_table)];
    w[threadIdx.x] = wts[threadIdx.x];
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * 4 + warp;
  if (row >= E) return;
  const long long qs = q8_row_stride(F);
  const int nu = F / 32, last = n_slots - 1, n_routed = last * nu;
  const int total = n_routed + F_last / 32;
  float acc = 0.f;
  for (int t = lane; t < total; t += 32) {
    const int j = t < n_routed ? t / nu : last, b = t - j * nu;
    const int8_t *q = act_q8 + j * qs;
    int xv[8];
    load_xq(reinterpret_cast<const int *>(q), b, xv);
    const float2 ds = __ldg(reinterpret_cast<const float2 *>(q + (j == last ? F_last : F)) + b);
    acc += w[j] * dot_q8x<T>(base[j] + (long long)row * (j == last ? rb_last : rb), b, xv, ds);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) y[row] = acc + (shared_y ? (shared_w ? shared_w[0] : 1.f) * shared_y[row] : 0.f);
}

// The prefill's grouping, one block: per expert the count of assignments a = t * k + j (expert ids[t * ks + j]),
// their exclusive prefix (thread 0), the tiles (expert, first sorted position, count <= tile) in expert order
// (unused tiles up to max_tiles: count 0), and sorted[off[e] + i] = the assignments of expert e (shared-memory
// atomics: their order within an expert is arbitrary, which changes no output: each is computed on its own).
__global__ void __launch_bounds__(MOE_GROUP_THREADS) k_moe_group(const int *__restrict__ ids, int n_tok, int k, int ks,
                                                                 int n_expert, int tile, int *__restrict__ sorted,
                                                                 int *__restrict__ tiles, int max_tiles) {
  griddep_launch();
  griddep_wait();
  extern __shared__ int gsh[];
  int *cnt = gsh, *off = gsh + n_expert, *toff = gsh + 2 * n_expert;
  __shared__ int n_tiles;
  for (int e = threadIdx.x; e < n_expert; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  const int na = n_tok * k;
  for (int a = threadIdx.x; a < na; a += blockDim.x)
    atomicAdd(&cnt[clamp_id(ids[(long long)(a / k) * ks + a % k], n_expert)], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int o = 0, to = 0;
    for (int e = 0; e < n_expert; e++) {
      off[e] = o;
      toff[e] = to;
      o += cnt[e];
      to += (cnt[e] + tile - 1) / tile;
    }
    n_tiles = to;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n_expert; e += blockDim.x)
    for (int i = 0; i * tile < cnt[e]; i++) {
      const int ti = toff[e] + i;
      tiles[3 * ti] = e;
      tiles[3 * ti + 1] = off[e] + i * tile;
      tiles[3 * ti + 2] = min(tile, cnt[e] - i * tile);
    }
  for (int ti = n_tiles + threadIdx.x; ti < max_tiles; ti += blockDim.x) {
    tiles[3 * ti] = 0;
    tiles[3 * ti + 1] = 0;
    tiles[3 * ti + 2] = 0;
  }
  __syncthreads();   // off[] becomes each expert's cursor
  for (int a = threadIdx.x; a < na; a += blockDim.x) {
    const int e = clamp_id(ids[(long long)(a / k) * ks + a % k], n_expert);
    sorted[atomicAdd(&off[e], 1)] = a;
  }
}

// One 32-element weight sub-block u of a row unpacked for several activation blocks (the grouped matvec reuses it
// for every token of a tile): q the 8 ints of 4 packed int8 weight values each, such that dot_q8x<T>(row, u, x,
// xds) == xds.x * (a0 * dp4a(q[0..3], x[0..3]) + a1 * dp4a(q[4..7], x[4..7])) + b * xds.y (unpacked_dot), the same
// terms as quant.cuh's dot_q8x (llama.cpp vec_dot_*_q8_1) grouped per half.
struct Unpacked {
  int q[8];
  float a0, a1, b;
};

template <int T>
__device__ static inline void unpack_q8x(const uint8_t *__restrict__ row, int u, Unpacked &w) {
  if (T == T_Q4_0 || T == T_Q4_1) {
    const uint8_t *bl = row + u * (T == T_Q4_0 ? 18 : 20);
    int q[4];
    if (T == T_Q4_1) {
      const int *p = reinterpret_cast<const int *>(bl + 4);
#pragma unroll
      for (int i = 0; i < 4; i++) q[i] = p[i];
    } else {
#pragma unroll
      for (int i = 0; i < 4; i++) q[i] = ld32a2(bl + 2 + 4 * i);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
      w.q[i] = q[i] & 0x0F0F0F0F;
      w.q[4 + i] = (q[i] >> 4) & 0x0F0F0F0F;
    }
    const float d = ldh(bl);
    w.a0 = w.a1 = d;
    w.b = T == T_Q4_0 ? -8.0f * d : ldh(bl + 2);
  } else if (T == T_Q8_0) {
    const uint8_t *bl = row + u * 34;
#pragma unroll
    for (int i = 0; i < 8; i++) w.q[i] = ld32a2(bl + 2 + 4 * i);
    w.a0 = w.a1 = ldh(bl);
    w.b = 0.f;
  } else if (T == T_Q4_K || T == T_Q5_K) {
    const int bs = T == T_Q4_K ? 144 : 176;
    const uint8_t *bl = row + (u >> 3) * bs;
    const int j = u & 7, p = j >> 1, sh = 4 * (j & 1);
    const int4 *qp = reinterpret_cast<const int4 *>(bl + (T == T_Q4_K ? 16 : 48) + 32 * p);
    const int4 q0 = qp[0], q1 = qp[1];
    w.q[0] = q0.x; w.q[1] = q0.y; w.q[2] = q0.z; w.q[3] = q0.w;
    w.q[4] = q1.x; w.q[5] = q1.y; w.q[6] = q1.z; w.q[7] = q1.w;
#pragma unroll
    for (int i = 0; i < 8; i++) w.q[i] = (w.q[i] >> sh) & 0x0F0F0F0F;
    if (T == T_Q5_K) {
      const int4 *hp = reinterpret_cast<const int4 *>(bl + 16);
      const int4 h0 = hp[0], h1 = hp[1];
      const int h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
      for (int i = 0; i < 8; i++) w.q[i] |= ((h[i] >> j) & 0x01010101) << 4;
    }
    float sc, mn;
    scale_min_k4(j, bl + 4, sc, mn);
    w.a0 = w.a1 = ldh(bl) * sc;
    w.b = -ldh(bl + 2) * mn;
  } else {  // T_Q6_K
    const uint8_t *bl = row + (u >> 3) * 210;
    const int j = u & 7, n = j >> 2, g = j & 3;
    const uint8_t *ql = bl + 64 * n + 32 * (g & 1);
    const uint8_t *qh = bl + 128 + 32 * n;
    const int sl = g >= 2 ? 4 : 0, shh = 2 * g;
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const int lo = (ld32a2(ql + 4 * i) >> sl) & 0x0F0F0F0F;
      const int hi = ((ld32a2(qh + 4 * i) >> shh) & 0x03030303) << 4;
      w.q[i] = __vsubss4(lo | hi, 0x20202020);
    }
    const int8_t *sc = reinterpret_cast<const int8_t *>(bl + 192) + 8 * n + 2 * g;
    const float d = ldh(bl + 208);
    w.a0 = d * (float)sc[0];
    w.a1 = d * (float)sc[1];
    w.b = 0.f;
  }
}

__device__ static inline float unpacked_dot(const Unpacked &w, const int x[8], float2 xds) {
  int s0 = 0, s1 = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    s0 = __dp4a(w.q[i], x[i], s0);
    s1 = __dp4a(w.q[4 + i], x[4 + i], s1);
  }
  return xds.x * (w.a0 * (float)s0 + w.a1 * (float)s1) + w.b * xds.y;
}

// Grouped matvec tile: block (tile, row block) computes y[orow(p), r] = W_e[r] . x[irow(p)] for the <= MOE_MM_T
// sorted positions p of the tile (expert e) and the block's 4 * (32 / L) * MOE_MM_R rows r: W_e[r] = tab0[e] row r for
// r < n_split, else tab1[e] row r - n_split; irow(p) = sorted[p] / k (in_by_token: the token of the assignment)
// else p; orow(p) = sorted[p] (out_by_assign) else p. x: q8_1 rows (q8_row_stride(n_in) bytes each). A warp is
// 32 / L groups of L lanes, group g owning MOE_MM_R rows; a group's lanes stride over the 32-element sub-blocks and
// sum their partial dots in log2(L) shuffles (L = 32: one group, five shuffles per output; rows of n_in = 512 have
// 16 sub-blocks, which leave half of a 32-lane warp idle). The tile's x blocks are loaded once for the group's rows,
// each weight sub-block unpacked once for the tile's tokens.
template <int T, int L>
__global__ void __launch_bounds__(128) k_moe_mm(const uint8_t *const *__restrict__ tab0,
                                                const uint8_t *const *__restrict__ tab1, int n_split, int n_table,
                                                const int *__restrict__ tiles, const int *__restrict__ sorted, int k,
                                                int in_by_token, const int8_t *__restrict__ xq, int n_in,
                                                float *__restrict__ y, int n_out, int out_by_assign, long long rb) {
  static_assert(L == 8 || L == 16 || L == 32, "lanes per row group");
  constexpr int G = 32 / L;
  griddep_launch();
  griddep_wait();
  const int ti = blockIdx.x;
  const int cnt = tiles[3 * ti + 2];
  if (cnt <= 0) return;
  const int e = clamp_id(tiles[3 * ti], n_table), p0 = tiles[3 * ti + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sl = lane % L;
  const int w0 = (blockIdx.y * 4 + warp) * G * MOE_MM_R;     // the warp's first row (whole warps leave together)
  if (w0 >= n_out) return;
  const int r0 = w0 + (lane / L) * MOE_MM_R;
  const uint8_t *rows[MOE_MM_R];
#pragma unroll
  for (int r = 0; r < MOE_MM_R; r++) {
    const int rr = min(r0 + r, n_out - 1);   // rows past the end re-read the last one (not stored)
    rows[r] = rr < n_split ? tab0[e] + (long long)rr * rb : tab1[e] + (long long)(rr - n_split) * rb;
  }
  const long long xs = q8_row_stride(n_in);
  const int8_t *xr[MOE_MM_T];
  long long orow[MOE_MM_T];
#pragma unroll
  for (int i = 0; i < MOE_MM_T; i++) {
    const int p = p0 + min(i, cnt - 1);      // positions past the tile's count re-read its last (not stored)
    const int a = sorted[p];
    xr[i] = xq + (long long)(in_by_token ? a / k : p) * xs;
    orow[i] = out_by_assign ? a : p;
  }
  float acc[MOE_MM_R][MOE_MM_T];
#pragma unroll
  for (int r = 0; r < MOE_MM_R; r++)
#pragma unroll
    for (int i = 0; i < MOE_MM_T; i++) acc[r][i] = 0.f;
  const int n_units = n_in / 32;
  for (int b = sl; b < n_units; b += L) {
    Unpacked w[MOE_MM_R];
#pragma unroll
    for (int r = 0; r < MOE_MM_R; r++) unpack_q8x<T>(rows[r], b, w[r]);
#pragma unroll
    for (int i = 0; i < MOE_MM_T; i++) {
      int xv[8];
      load_xq(reinterpret_cast<const int *>(xr[i]), b, xv);
      const float2 ds = __ldg(reinterpret_cast<const float2 *>(xr[i] + n_in) + b);
#pragma unroll
      for (int r = 0; r < MOE_MM_R; r++) acc[r][i] += unpacked_dot(w[r], xv, ds);
    }
  }
#pragma unroll
  for (int r = 0; r < MOE_MM_R; r++)
#pragma unroll
    for (int i = 0; i < MOE_MM_T; i++) {
      float v = acc[r][i];
#pragma unroll
      for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (sl == 0 && i < cnt && r0 + r < n_out) y[orow[i] * n_out + r0 + r] = v;
    }
}

// q8_1 rows (q8_row_stride(n_cols) bytes each) of x f32 (n_rows, stride xs), or with glu of silu(x[r, c]) * x[r,
// n_cols + c] (k_swiglu_gu's arithmetic); one thread per value, a warp per 32-value block (n_cols % 32 == 0).
__global__ void k_moe_q8_rows(const float *__restrict__ x, long long xs, int glu, long long total, int n_cols,
                              int8_t *__restrict__ out) {
  griddep_launch();
  griddep_wait();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i - (threadIdx.x & 31) >= total) return;      // whole warps (total % 32 == 0)
  const long long r = i / n_cols;
  const int c = (int)(i - r * n_cols);
  float v = x[r * xs + c];
  if (glu) v = v / (1.f + expf(-v)) * x[r * xs + n_cols + c];
  int8_t *q = out + r * q8_row_stride(n_cols);
  q8_store(v, c, q, reinterpret_cast<float2 *>(q + n_cols));
}

// x[t, c] += sum_j wts[t, j] * yd[t * k + j, c] (+ wts[t, k] * shared_y[t, c] when shared_y).
__global__ void k_moe_combine(const float *__restrict__ yd, const float *__restrict__ wts, long long total, int k,
                              int ks, int E, const float *__restrict__ shared_y, float *__restrict__ x) {
  griddep_launch();
  griddep_wait();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long t = i / E;
  const int c = (int)(i - t * E);
  const float *w = wts + t * ks;
  float s = 0.f;
  for (int j = 0; j < k; j++) s += w[j] * yd[(t * k + j) * E + c];
  if (shared_y) s += w[k] * shared_y[i];
  x[i] += s;
}

__global__ void k_moe_count(const int *__restrict__ ids, int total, int k, int ks, int n_expert,
                            unsigned *__restrict__ counts) {
  griddep_launch();
  griddep_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int e = ids[(i / k) * ks + i % k];
  if (e >= 0 && e < n_expert) atomicAdd(counts + e, 1u);
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

}  // namespace

extern "C" int strata_moe_route(void *stream, const float *logits, int n_tok, int n_expert, int k, int renorm,
                                const float *x, const float *shared_gate, int n_embd, int shared, int *ids,
                                float *wts) {
  if (!logits || !ids || !wts || n_tok <= 0 || n_expert <= 0 || n_expert > STRATA_MOE_MAX_EXPERTS || k <= 0 ||
      k > n_expert || k + (shared ? 1 : 0) > STRATA_MOE_MAX_SLOTS || (shared_gate && (!x || n_embd <= 0)))
    return (int)cudaErrorInvalidValue;
  st_launch(k_moe_route, n_tok, MOE_ROUTE_THREADS, (size_t)n_expert * sizeof(float), (cudaStream_t)stream, logits,
            n_expert, k, renorm, x, shared_gate, n_embd, shared ? 1 : 0, ids, wts);
  return (int)cudaGetLastError();
}

extern "C" int strata_moe_gate_up(void *stream, int t, const void *const *gate_tab, const void *const *up_tab,
                                  int n_table, const int *ids, int n_slots, const void *xq, float *act, void *act_q8,
                                  int n_ff, int n_ff_last, int n_embd) {
  if (const int e = q8_matvec_check(t, gate_tab, xq, n_ff, n_embd)) return e;
  if (!up_tab || !ids || !act || !act_q8 || n_table <= 0 || n_slots <= 0 || n_slots > STRATA_MOE_MAX_SLOTS ||
      n_ff % 32 || n_ff_last <= 0 || n_ff_last % 32)
    return (int)cudaErrorInvalidValue;
  if (!aligned16(act_q8)) return (int)cudaErrorMisalignedAddress;
  const long long rb = row_bytes_of(t, n_embd);
  const int8_t *q = (const int8_t *)xq;
  const dim3 grid((unsigned)((n_ff > n_ff_last ? n_ff : n_ff_last) / 32), (unsigned)n_slots);
  cudaStream_t s = (cudaStream_t)stream;
#define GU(TT) st_launch(k_moe_gate_up<TT>, grid, 32 * MOE_GU_WARPS, 0, s, (const uint8_t *const *)gate_tab, \
                         (const uint8_t *const *)up_tab, n_table, ids, n_slots, q, (const float2 *)(q + n_embd), act, \
                         (int8_t *)act_q8, n_ff, n_ff_last, n_embd / 32, rb)
  DISPATCH_Q8_TYPE(t, GU)
#undef GU
  return (int)cudaGetLastError();
}

extern "C" int strata_moe_down(void *stream, int t, const void *const *down_tab, int n_table, const int *ids,
                               const float *wts, int n_slots, const void *act_q8, int n_ff, int n_ff_last, float *y,
                               int n_embd, const float *shared_y, const float *shared_w) {
  if (const int e = q8_matvec_check(t, down_tab, act_q8, n_embd, n_ff)) return e;
  if (const int e = q8_matvec_check(t, down_tab, act_q8, n_embd, n_ff_last)) return e;
  if (!ids || !wts || !y || n_table <= 0 || n_slots <= 0 || n_slots > STRATA_MOE_MAX_SLOTS)
    return (int)cudaErrorInvalidValue;
  const long long rb = row_bytes_of(t, n_ff), rb_last = row_bytes_of(t, n_ff_last);
  cudaStream_t s = (cudaStream_t)stream;
  const unsigned blocks = (unsigned)((n_embd + 3) / 4);
#define DN(TT) st_launch(k_moe_down<TT>, blocks, 128, 0, s, (const uint8_t *const *)down_tab, n_table, ids, wts, \
                         n_slots, (const int8_t *)act_q8, n_ff, n_ff_last, rb, rb_last, y, n_embd, shared_y, shared_w)
  DISPATCH_Q8_TYPE(t, DN)
#undef DN
  return (int)cudaGetLastError();
}

extern "C" int strata_moe_max_tiles(int n_tok, int k, int n_expert) {
  return (int)(((long long)n_tok * k) / MOE_MM_T + n_expert);
}

extern "C" int strata_moe_group(void *stream, const int *ids, int n_tok, int k, int ks, int n_expert, int *sorted,
                                int *tiles, int max_tiles) {
  if (!ids || !sorted || !tiles || n_tok <= 0 || k <= 0 || ks < k || n_expert <= 0 ||
      n_expert > STRATA_MOE_MAX_EXPERTS || (long long)n_tok * k > INT_MAX / 2 ||
      max_tiles < strata_moe_max_tiles(n_tok, k, n_expert))
    return (int)cudaErrorInvalidValue;
  st_launch(k_moe_group, 1, MOE_GROUP_THREADS, (size_t)3 * n_expert * sizeof(int), (cudaStream_t)stream, ids, n_tok,
            k, ks, n_expert, MOE_MM_T, sorted, tiles, max_tiles);
  return (int)cudaGetLastError();
}

// Lanes per row group of k_moe_mm for rows of n_units 32-element sub-blocks: STRATA_CUDA_MOE_LANES (8, 16 or 32;
// read per launch, a diagnostic) else 8 (every lane busy down to 8 sub-blocks, three shuffles per output).
static int moe_mm_lanes(int n_units) {
  const char *e = getenv("STRATA_CUDA_MOE_LANES");
  const int v = e && e[0] ? atoi(e) : 0;
  if (v == 8 || v == 16 || v == 32) return v;
  return n_units >= 8 ? 8 : 32;
}

extern "C" int strata_moe_mm(void *stream, int t, const void *const *tab0, const void *const *tab1, int n_split,
                             int n_table, const int *tiles, int max_tiles, const int *sorted, int k, int in_by_token,
                             const void *xq, int n_in, float *y, int n_out, int out_by_assign) {
  if (const int e = q8_matvec_check(t, tab0, xq, n_out, n_in)) return e;
  if (!tiles || !sorted || !y || n_table <= 0 || max_tiles <= 0 || k <= 0 || n_split <= 0 || n_split > n_out ||
      (n_split < n_out && !tab1))
    return (int)cudaErrorInvalidValue;
  const long long rb = row_bytes_of(t, n_in);
  const int lanes = moe_mm_lanes(n_in / 32);
  const int rows_per_block = 4 * (32 / lanes) * MOE_MM_R;
  const long long row_blocks = (n_out + rows_per_block - 1) / rows_per_block;
  if (row_blocks > 65535) return (int)cudaErrorInvalidValue;
  const dim3 grid((unsigned)max_tiles, (unsigned)row_blocks);
  cudaStream_t s = (cudaStream_t)stream;
#define MM(TT) (lanes == 8 ? MML(TT, 8) : lanes == 16 ? MML(TT, 16) : MML(TT, 32))
#define MML(TT, LL) st_launch(k_moe_mm<TT, LL>, grid, 128, 0, s, (const uint8_t *const *)tab0, \
                              (const uint8_t *const *)tab1, n_split, n_table, tiles, sorted, k, in_by_token, \
                              (const int8_t *)xq, n_in, y, n_out, out_by_assign, rb)
  DISPATCH_Q8_TYPE(t, MM)
#undef MML
#undef MM
  return (int)cudaGetLastError();
}

extern "C" int strata_moe_q8_rows(void *stream, const float *x, long long x_stride, int glu, int n_rows, int n_cols,
                                  void *out) {
  if (!x || !out || n_rows <= 0 || n_cols <= 0 || n_cols % 32 || x_stride < (glu ? 2LL : 1LL) * n_cols)
    return (int)cudaErrorInvalidValue;
  if (!aligned16(out)) return (int)cudaErrorMisalignedAddress;
  const long long total = (long long)n_rows * n_cols;
  st_launch(k_moe_q8_rows, (unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream, x, x_stride, glu ? 1 : 0,
            total, n_cols, (int8_t *)out);
  return (int)cudaGetLastError();
}

extern "C" int strata_moe_combine(void *stream, const float *yd, const float *wts, int n_tok, int k, int ks,
                                  int n_embd, const float *shared_y, float *x) {
  if (!yd || !wts || !x || n_tok <= 0 || k <= 0 || n_embd <= 0 || ks < k + (shared_y ? 1 : 0))
    return (int)cudaErrorInvalidValue;
  const long long total = (long long)n_tok * n_embd;
  st_launch(k_moe_combine, (unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream, yd, wts, total, k, ks,
            n_embd, shared_y, x);
  return (int)cudaGetLastError();
}

extern "C" int strata_moe_count(void *stream, const int *ids, int n_tok, int k, int ks, int n_expert,
                                unsigned *counts) {
  if (!ids || !counts || n_tok <= 0 || k <= 0 || ks < k || n_expert <= 0) return (int)cudaErrorInvalidValue;
  const int total = n_tok * k;
  st_launch(k_moe_count, (unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream, ids, total, k, ks, n_expert,
            counts);
  return (int)cudaGetLastError();
}
