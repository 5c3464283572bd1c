// The decode matvecs' shared device pieces (matvec_fused.cu and the short read's matvec_cols.cu): the q8_1 x block
// load, the staged weights' shared memory limits (host), the fused / handed-off RMSNorm inputs and the residual
// handoff, and the QKV epilogue's RoPE + K/V pair.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include "q8.cuh"
#include "launch.cuh"
#include "matvec.cuh"
#include "rope.cuh"
#include "kv_cache.cuh"

// q8_1 activation block u (8 ints of int8 values, its (d, d * sum)): XSHARED, x / xds in shared memory (generic
// loads), else in global memory (load_xq's __ldg).
template <bool XSHARED>
__device__ static inline void load_x(const int *x, const float2 *xds, int u, int xv[8], float2 &ds) {
  if (XSHARED) {
    const int4 a = reinterpret_cast<const int4 *>(x)[2 * u], b = reinterpret_cast<const int4 *>(x)[2 * u + 1];
    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w; xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
    ds = xds[u];
  } else {
    load_xq(x, u, xv);
    ds = __ldg(xds + u);
  }
}

// ---------------------------------------------------------------- staged weights: shared memory per block (host)
// Dynamic shared memory a staged decode matvec takes without the opt-in attribute: 48 KB less 1 KB for the kernels'
// static shared memory (at most 256 bytes: sv / red arrays).
static const long long SMEM_PLAIN = 47 * 1024;

// The most dynamic shared memory kernel k may take on the current device (the opt-in limit less k's static shared
// memory), with the attribute set on k for that device; cached per kernel (cache) and device (up to 16; a benign
// race: every thread stores the same value); 0 if refused.
template <typename K>
static int smem_optin(K k, int (&cache)[16]) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 16) {
    cudaGetLastError();
    return 0;
  }
  if (cache[dev] == 0) {   // 0: not asked yet; else the limit + 1
    int v = 0;
    cudaFuncAttributes fa;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
        cudaFuncGetAttributes(&fa, k) == cudaSuccess && (v -= (int)fa.sharedSizeBytes) > 0 &&
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, v) == cudaSuccess)
      cache[dev] = v + 1;
    else
      cache[dev] = 1;
    cudaGetLastError();
  }
  return cache[dev] - 1;
}

// ---------------------------------------------------------------- RMSNorm fused into a decode matvec's prologue
// The decode graph's RMSNorm before the QKV and gate/up matvecs, done by every block of the matvec itself after
// its PDL wait (its weights already staged): s = x + delta, y = s / sqrt(mean(s^2) + eps) * w, y as q8_1 blocks in
// the block's shared memory; block 0 also stores s (the residual stream) to x_out. One launch and one dependent
// global round trip per norm fewer than strata_rms_norm_ex + matvec. Each thread holds 8-element chunks (chunk c =
// tid + k * blockDim), so a q8_1 block is 4 neighbouring lanes; same per-element arithmetic as k_rms_norm_c.
#define FUSED_NORM_MAX_DIM 4096   // widest fused-norm row: 4 chunks of 8 per thread of a 128-thread QKV block

struct NormIn {
  const float *x, *delta, *w;   // residual stream, the output to add to it (may be NULL), norm weight: f32 (dim)
  float *x_out;                 // x + delta (may be NULL); must not alias x or delta (other blocks read them)
  float eps;
  int dim;                      // % 32 == 0, <= 8 * MAXC * blockDim.x
  const float *ss;              // handed-off norm (w NULL): xq = q8_1(x * w) and ss its groups' sums of x^2 (dim / 32)
};

// ---------------------------------------------------------------- RMSNorm handed off by the producing matvec
// The decode graph's alternative to the fused norm (norm handoff): the matvec that adds its output to the residual
// stream x (the output and down projections) also writes what the next RMSNorm's consumer needs, per 32-row group of
// x: q8_1(x * w) (w the norm weight; the norm's scale 1 / rms is a common factor of the whole vector, so it is left
// out of the quantized values) and the group's sum of x^2. The consumer (QKV, gate/up) reads those q8_1 blocks as
// any int8 activation and multiplies its dot products by r = 1 / sqrt(sum(ss) / dim + eps): no norm, no reduction
// and 2.5 instead of 16 bytes per element on its dependent chain. RMSNorm: Zhang & Sennrich 2019, y = x / rms(x) * w.
struct ResidOut {
  float *x;             // residual stream f32 (n): x[row] += the row's product (NULL: plain y store)
  const float *w;       // next norm's weight f32 (n); NULL: no handoff (the residual add only)
  int8_t *xq;           // q8_1 of x * w: n int8, then n / 32 float2 (d, d * sum q)
  float *ss;            // n / 32 sums of x^2
  unsigned *cnt;        // n / 32 row counters, zero (the block completing a group resets its counter)
  int n;                // rows (% 32 == 0)
};

// Warp-cooperative: lane holds v = x[i] (i = group * 32 + lane) of a finished group: its q8_1 block of v * w and its
// sum of v^2 (xor butterfly: the same bits in every lane and every run).
__device__ static inline void handoff_store(float v, int i, const float *__restrict__ w, int8_t *__restrict__ xq,
                                            float *__restrict__ ss, int n) {
  q8_store(v * __ldg(w + i), i, xq, reinterpret_cast<float2 *>(xq + n));
  float s = v * v;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((i & 31) == 0) ss[i >> 5] = s;
}

// The consumer's scale r = 1 / sqrt(sum(ss) / dim + eps), warp-cooperative (every lane gets the same bits), in two
// halves so the loads are in flight during the dot products: handoff_load (this lane's groups lane + 32 k, dim <=
// 4096) after the PDL wait, handoff_scale after the dots.
struct HandoffSS {
  float v[4];
};
static_assert(FUSED_NORM_MAX_DIM <= 4 * 32 * 32, "HandoffSS holds 4 group sums per lane");
__device__ static inline HandoffSS handoff_load(const NormIn &n) {
  HandoffSS h;
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int g = (threadIdx.x & 31) + 32 * k;
    h.v[k] = n.ss && g < n.dim / 32 ? __ldcg(n.ss + g) : 0.f;
  }
  return h;
}
__device__ static inline float handoff_scale(const NormIn &n, const HandoffSS &h) {
  float s = (h.v[0] + h.v[1]) + (h.v[2] + h.v[3]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return rsqrtf(s / (float)n.dim + n.eps);
}

// After this block stored rows [r0, r0 + nr) of ro.x (nr divides 32: the rows lie in one group): count them into
// their group (arrive_acq_rel); the block that completes the group writes its handoff (handoff_store) and resets the
// counter (the next producer runs after this grid completes). Every thread of the block calls it.
__device__ static inline void resid_handoff(const ResidOut &ro, int r0, int nr) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned g = (unsigned)r0 >> 5;
    last = arrive_acq_rel(ro.cnt + g, (unsigned)nr) + nr == 32;
    if (last) ro.cnt[g] = 0;
  }
  __syncthreads();
  if (last && threadIdx.x < 32) {
    const int i = (r0 & ~31) + threadIdx.x;
    handoff_store(__ldcg(ro.x + i), i, ro.w, ro.xq, ro.ss, ro.n);
  }
}

// What the QKV decode matvec's epilogue needs to do strata_rope_kv_decode's work (k_matvec_q8w with ROPE).
struct RopeKV {
  const int *pos, *pt;    // position (device), page table
  __half *kc, *vc;        // f16 cache of this layer
  int H, KV, hd, n_rot, ps;
  float base;
  int pre_wait;           // no earlier kernel of the PDL chain writes pos or pt: read them before the PDL wait
};

// The input-independent half of one pair's epilogue: the pair's (cos, sin) and its cache element (or -1: a q row).
struct RopePair {
  float2 cs;
  long long o;
};

// RoPE (adjacent pairs, neox = 0) of the pair of rows (a, a + 1) of qkv [q (H*hd) | k (KV*hd) | v (KV*hd)] and the
// k / v cache writes, in two halves: rope_pair_prepare (position, angle, page lookup: before the PDL wait when
// RopeKV::pre_wait) and rope_pair_store (from the rows' dot products y0, y1). k_rope_kv_decode's arithmetic
// (rope_angle / rope_apply), so the fused and separate paths agree bit for bit.
__device__ static inline RopePair rope_pair_prepare(const RopeKV &r, int a) {
  const int p = r.pos[0], qk = (r.H + r.KV) * r.hd;
  RopePair rp{make_float2(1.f, 0.f), -1};
  if (a < qk) {
    const int h = a / r.hd, d = a % r.hd;
    if (d < r.n_rot) rp.cs = rope_angle(p, d / 2, r.n_rot, r.base);
    if (h >= r.H) rp.o = kv_index(r.pt, p, h - r.H, d, r.KV, r.hd, r.ps);
  } else {
    const int j = a - qk;
    rp.o = kv_index(r.pt, p, j / r.hd, j % r.hd, r.KV, r.hd, r.ps);
  }
  return rp;
}

__device__ static inline void rope_pair_store(const RopeKV &r, const RopePair &rp, float *qkv, int a, float y0,
                                              float y1) {
  const int qk = (r.H + r.KV) * r.hd;
  if (a < qk) {
    if (a % r.hd < r.n_rot) rope_apply(rp.cs, y0, y1);
    if (rp.o >= 0) {
      r.kc[rp.o] = __float2half(y0);
      r.kc[rp.o + 1] = __float2half(y1);
    }
  } else {
    r.vc[rp.o] = __float2half(y0);
    r.vc[rp.o + 1] = __float2half(y1);
  }
  qkv[a] = y0;
  qkv[a + 1] = y1;
}
