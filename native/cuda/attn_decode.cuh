// Decode attention over the paged KV cache for attention.cu: the cache addressing, raw K/V word loads, and the
// GQA-shared, self-merging block body (whose COH / SUB / NW options served the persistent decode step, removed in
// issue #20; attention.cu's kernel takes the defaults).
//
// Cache layout: per layer K and V arrays (n_pages, page_size, n_kv, hd), f16 or q8_0 (int8 values and one f16 scale
// per 32); position p of a sequence lives in page pt[p / page_size], slot p % page_size.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "q8.cuh"
#include "launch.cuh"

__device__ static inline long long kv_off(const int *__restrict__ pt, int p, int kvh, int n_kv, int hd, int ps) {
  return (((long long)pt[p / ps] * ps + (p % ps)) * n_kv + kvh) * hd;
}

// A float4 load: through L2 only (ld.global.cg) when COH (data another block of the same kernel wrote: the
// persistent decode step), else an ordinary load.
template <bool COH>
__device__ static inline float4 ld_f4(const float4 *p) {
  return COH ? __ldcg(p) : *p;
}

// The raw cache words of 8 consecutive values at element offset e (f16: one 16-byte word; q8_0: 8 bytes in .x/.y
// and the block's scale), loaded without converting so that a thread can issue all its loads before using one.
template <bool Q8, bool COH = false>
__device__ static inline void load_kv8_raw(const void *__restrict__ c, const __half *__restrict__ sc, long long e,
                                           uint4 &r, __half &d) {
  if (Q8) {
    const uint2 *p = reinterpret_cast<const uint2 *>(reinterpret_cast<const int8_t *>(c) + e);
    const uint2 t = COH ? __ldcg(p) : *p;
    r = make_uint4(t.x, t.y, 0u, 0u);
    d = COH ? __ldcg(sc + (e >> 5)) : sc[e >> 5];
  } else {
    const uint4 *p = reinterpret_cast<const uint4 *>(reinterpret_cast<const __half *>(c) + e);
    r = COH ? __ldcg(p) : *p;
  }
}

// The f32 values of the raw words of load_kv8_raw (q8_0: d * q).
template <bool Q8>
__device__ static inline void cvt_kv8(const uint4 &r, __half dh, float f[8]) {
  if (Q8) {
    const float d = __half2float(dh);
    const int8_t *q = reinterpret_cast<const int8_t *>(&r);
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = d * (float)q[i];
  } else {
    const __half2 *h = reinterpret_cast<const __half2 *>(&r);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 x = __half22float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
}

// 8 consecutive cache values at element offset e as f32: f16 (one 16-byte load) or q8_0 (8 bytes + the scale).
template <bool Q8>
__device__ static inline void load_kv8(const void *__restrict__ c, const __half *__restrict__ sc, long long e,
                                       float f[8]) {
  uint4 r;
  __half d = __float2half(0.f);
  load_kv8_raw<Q8>(c, sc, e, r, d);
  cvt_kv8<Q8>(r, d, f);
}

// Raw K and V words of B positions p0, p0 + stride, ... (clamped to end - 1: the loads are unconditional) of KV
// head kvh, element offset d0 within the head.
template <bool Q8, int B, bool COH = false>
__device__ static inline void issue_kv8(const void *__restrict__ kc, const void *__restrict__ vc,
                                        const __half *__restrict__ ks, const __half *__restrict__ vs,
                                        const int *__restrict__ pt, int p0, int stride, int end, int kvh, int n_kv,
                                        int hd, int ps, int d0, uint4 (&kr)[B], uint4 (&vr)[B], __half (&kd)[B],
                                        __half (&vd)[B]) {
  long long e[B];
#pragma unroll
  for (int b = 0; b < B; b++) e[b] = kv_off(pt, min(p0 + b * stride, end - 1), kvh, n_kv, hd, ps) + d0;
#pragma unroll
  for (int b = 0; b < B; b++) {
    load_kv8_raw<Q8, COH>(kc, ks, e[b], kr[b], kd[b]);
    load_kv8_raw<Q8, COH>(vc, vs, e[b], vr[b], vd[b]);
  }
}

// ---------------------------------------------------------------- decode attention, GQA-shared, self-merging
// One block of NW warps (k_attn_decode_gqa: DA_WARPS, its grid (n_kv, n_split)) takes KV head kvh, all
// g = n_head / n_kv query heads of its group (G >= g registers per lane), and position range sp of n_split over len
// positions. A group of LP = hd / 8 lanes owns one position at a time (one
// 16-byte load of K and of V per lane); each iteration a group scores B positions and folds them into an online
// softmax (m, l, o) per query head; with DB the next B positions' loads are issued before that arithmetic (B * 32
// bytes in flight per lane while it computes), without DB after it. Groups are merged in
// shared memory into one partial per head and split: O (hd floats) at ws[(head * n_split + split) * hd], (m, l) at
// ws[n_head * n_split * hd + 2 * (head * n_split + split)]. The last block of a KV head to finish (atomic counter,
// reset by that block) merges the splits: out = sum_s O_s e^(m_s - M) / sum_s l_s e^(m_s - M) (Flash-Decoding),
// the split weights by one warp per head (all (m, l) pairs loaded at once), the outputs in 16-byte loads by parts
// of the block over the splits,
// written as f32 and, if out_q8 is given, as q8_1 blocks.
#define DA_WARPS 4
#define DA_MAX_SPLIT 256

// q8_1 store of four consecutive values per lane: the 8 lanes of an aligned lane group hold one block of 32.
__device__ static inline void q8_store4(float4 v, int i, int8_t *__restrict__ xq, float2 *__restrict__ ds) {
  const unsigned mask = __activemask();   // whole 8-lane groups are active
  float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
  const float d = __fdiv_rn(amax, 127.0f);
  int q[4] = {0, 0, 0, 0};
  if (amax != 0.f) {
    q[0] = __float2int_rn(__fdiv_rn(v.x, d)); q[1] = __float2int_rn(__fdiv_rn(v.y, d));
    q[2] = __float2int_rn(__fdiv_rn(v.z, d)); q[3] = __float2int_rn(__fdiv_rn(v.w, d));
  }
  int sum = q[0] + q[1] + q[2] + q[3];
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(mask, sum, o);
  *reinterpret_cast<char4 *>(xq + i) = make_char4((signed char)q[0], (signed char)q[1], (signed char)q[2],
                                                  (signed char)q[3]);
  if ((i & 31) == 0) ds[i >> 5] = make_float2(d, d * (float)sum);
}

// The body's block-wide barrier: __syncthreads, or (SUB) named barrier 1 over its NW warps when the body runs on
// the first NW warps of a larger block (the persistent decode step).
template <bool SUB, int NW>
__device__ __forceinline__ void da_sync() {
  if (SUB)
    asm volatile("bar.sync 1, %0;" ::"n"(32 * NW) : "memory");
  else
    __syncthreads();
}

// NW: the warps running the body (the block's first NW; DA_WARPS in k_attn_decode_gqa, whose block is exactly
// that), SUB: the block has more threads than those (named barrier instead of __syncthreads).
template <int LP, int G, bool Q8, bool DB, bool COH, bool SUB = false, int NW = DA_WARPS>
__device__ __forceinline__ void attn_gqa_block(
    int kvh, int sp, const float *q, const void *kc, const void *vc, const __half *__restrict__ ks,
    const __half *__restrict__ vs, const int *__restrict__ pt, int len, float *ws, unsigned *counters, float *out,
    int8_t *out_q8, int n_head, int n_kv, int ps, int n_split, float scale) {
  constexpr int hd = 8 * LP, PPW = 32 / LP, NG = NW * PPW, B = G >= 8 ? 2 : 4;
  const int g = n_head / n_kv;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, grp = lane / LP, gl = lane % LP;
  const int gid = wid * PPW + grp;
  const int chunk = (len + n_split - 1) / n_split;
  const int beg = sp * chunk, end = min(len, beg + chunk);
  float qv[G][8], o[G][8], m[G], l[G];
#pragma unroll
  for (int j = 0; j < G; j++) {
    m[j] = -INFINITY;
    l[j] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) { qv[j][i] = 0.f; o[j][i] = 0.f; }
    if (j < g) {
      const float4 *qp = reinterpret_cast<const float4 *>(q + (kvh * g + j) * hd + 8 * gl);
      const float4 a = ld_f4<COH>(qp), b = ld_f4<COH>(qp + 1);
      qv[j][0] = a.x * scale; qv[j][1] = a.y * scale; qv[j][2] = a.z * scale; qv[j][3] = a.w * scale;
      qv[j][4] = b.x * scale; qv[j][5] = b.y * scale; qv[j][6] = b.z * scale; qv[j][7] = b.w * scale;
    }
  }
  // the loop is block-uniform (every lane runs every iteration: the shuffles need whole warps); a group whose
  // position is past the end loads the last position of the range (a valid address: the loads stay unconditional,
  // so all 2B of an iteration are in flight at once; behind a branch each waited for the previous one's use) and
  // scores nothing. The next iteration's loads are issued before this one's arithmetic (double buffering).
  constexpr int STEP = B * NG;
  uint4 kr[B], vr[B];
  __half kd[B], vd[B];   // q8_0 block scales (unused with an f16 cache)
#pragma unroll
  for (int b = 0; b < B; b++) kd[b] = vd[b] = __float2half(0.f);
  if (beg < end) issue_kv8<Q8, B, COH>(kc, vc, ks, vs, pt, beg + gid, NG, end, kvh, n_kv, hd, ps, 8 * gl, kr, vr, kd, vd);
  for (int P = beg; P < end; P += STEP) {
    float kf[B][8], vf[B][8];
    bool ok[B];
#pragma unroll
    for (int b = 0; b < B; b++) {
      ok[b] = P + b * NG + gid < end;
      cvt_kv8<Q8>(kr[b], kd[b], kf[b]);
      cvt_kv8<Q8>(vr[b], vd[b], vf[b]);
    }
    if (DB && P + STEP < end)   // block-uniform
      issue_kv8<Q8, B, COH>(kc, vc, ks, vs, pt, P + STEP + gid, NG, end, kvh, n_kv, hd, ps, 8 * gl, kr, vr, kd, vd);
#pragma unroll
    for (int j = 0; j < G; j++) {
      if (j >= g) break;
      float sc[B];
#pragma unroll
      for (int b = 0; b < B; b++) {
        float t = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) t += qv[j][i] * kf[b][i];
        sc[b] = t;
      }
#pragma unroll
      for (int off = LP / 2; off > 0; off >>= 1)
#pragma unroll
        for (int b = 0; b < B; b++) sc[b] += __shfl_xor_sync(0xffffffffu, sc[b], off);
      float mx = m[j];
#pragma unroll
      for (int b = 0; b < B; b++)
        if (ok[b]) mx = fmaxf(mx, sc[b]);
      if (mx == -INFINITY) continue;   // nothing valid yet for this group
      const float corr = __expf(m[j] - mx);
      l[j] *= corr;
#pragma unroll
      for (int i = 0; i < 8; i++) o[j][i] *= corr;
#pragma unroll
      for (int b = 0; b < B; b++) {
        if (!ok[b]) continue;
        const float e = __expf(sc[b] - mx);
        l[j] += e;
#pragma unroll
        for (int i = 0; i < 8; i++) o[j][i] += e * vf[b][i];
      }
      m[j] = mx;
    }
    if (!DB && P + STEP < end)   // issued after the arithmetic: the loads are not in flight while it runs
      issue_kv8<Q8, B, COH>(kc, vc, ks, vs, pt, P + STEP + gid, NG, end, kvh, n_kv, hd, ps, 8 * gl, kr, vr, kd, vd);
  }
  // merge the NG groups of this block, per query head
  __shared__ float sm[NG], sl[NG], so[NG][hd];
  __shared__ float mw[G][DA_MAX_SPLIT];
  __shared__ float Lsh[G];
  __shared__ bool last;
  float *wo = ws, *wml = ws + (long long)n_head * n_split * hd;
#pragma unroll
  for (int j = 0; j < G; j++) {
    if (j >= g) break;   // g is uniform over the block: every thread takes the same barriers
    da_sync<SUB, NW>();
    if (gl == 0) { sm[gid] = m[j]; sl[gid] = l[j]; }
#pragma unroll
    for (int i = 0; i < 8; i++) so[gid][8 * gl + i] = o[j][i];
    da_sync<SUB, NW>();
    float M = -INFINITY;
    for (int w = 0; w < NG; w++) M = fmaxf(M, sm[w]);
    const long long hsp = (long long)(kvh * g + j) * n_split + sp;
    for (int d = threadIdx.x; d < hd; d += 32 * NW) {
      float acc = 0.f;
      for (int w = 0; w < NG; w++)
        if (sm[w] > -INFINITY) acc += so[w][d] * __expf(sm[w] - M);
      wo[hsp * hd + d] = acc;
    }
    if (threadIdx.x == 0) {
      float L = 0.f;
      for (int w = 0; w < NG; w++)
        if (sm[w] > -INFINITY) L += sl[w] * __expf(sm[w] - M);
      wml[2 * hsp] = M;
      wml[2 * hsp + 1] = L;
    }
  }
  da_sync<SUB, NW>();
  if (n_split > 1) {
    if (threadIdx.x == 0) last = arrive_acq_rel(&counters[kvh], 1u) == (unsigned)(n_split - 1);
    da_sync<SUB, NW>();
    if (!last) return;   // block-uniform
  }
  // merge the splits of the g heads of this KV head (partials read through L2: __ldcg). Weights: one warp per head,
  // lanes over the splits; outputs: P block-parts over the splits per group of four outputs, summed in shared memory.
  const long long h0 = (long long)kvh * g * n_split;
  for (int j = wid; j < g; j += NW) {   // warp-uniform: whole warps reach the shuffles
    // every (m, l) of the head's splits loaded at once (DA_MAX_SPLIT / 32 per lane, clamped: unconditional loads)
    const float2 *mlj = reinterpret_cast<const float2 *>(wml) + (h0 + (long long)j * n_split);
    constexpr int PER = DA_MAX_SPLIT / 32;
    float2 ml[PER];
#pragma unroll
    for (int k = 0; k < PER; k++) ml[k] = __ldcg(mlj + min(lane + 32 * k, n_split - 1));
    float M = -INFINITY;
#pragma unroll
    for (int k = 0; k < PER; k++)
      if (lane + 32 * k < n_split) M = fmaxf(M, ml[k].x);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float L = 0.f;
#pragma unroll
    for (int k = 0; k < PER; k++) {
      const int s = lane + 32 * k;
      if (s < n_split) {
        const float w = ml[k].x > -INFINITY ? __expf(ml[k].x - M) : 0.f;
        L += w * ml[k].y;
        mw[j][s] = w;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    if (lane == 0) Lsh[j] = L;
  }
  da_sync<SUB, NW>();
  constexpr int T = 32 * NW;
  const int n_out4 = g * hd / 4;   // a multiple of 8: lane groups of 8 stay whole for the q8 store
  int P = 1;                       // a power of two with P * n_out4 <= T (so W >= n_out4 or P == 1)
  while (2 * P * n_out4 <= T) P *= 2;
  const int W = T / P, part = threadIdx.x / W, o4 = threadIdx.x % W;
  __shared__ float4 pr[T];
  for (int idx0 = 0; idx0 < n_out4; idx0 += W) {   // block-uniform trip count
    const int idx = idx0 + o4;
    const int j = (4 * idx) / hd, d = (4 * idx) % hd;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (idx < n_out4) {
      const float4 *src = reinterpret_cast<const float4 *>(wo + (h0 + (long long)j * n_split) * hd + d);
#pragma unroll 16
      for (int s = part; s < n_split; s += P) {   // 16 loads in flight per thread: the merge is latency-bound
        const float w = mw[j][s];
        const float4 v = __ldcg(src + (long long)s * (hd / 4));
        acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
      }
    }
    pr[threadIdx.x] = acc;
    da_sync<SUB, NW>();
    if (part == 0 && idx < n_out4) {
      for (int p2 = 1; p2 < P; p2++) {
        const float4 t = pr[p2 * W + o4];
        acc.x += t.x; acc.y += t.y; acc.z += t.z; acc.w += t.w;
      }
      const float inv = 1.f / Lsh[j];
      acc.x *= inv; acc.y *= inv; acc.z *= inv; acc.w *= inv;
      const int oi = kvh * g * hd + 4 * idx;
      *reinterpret_cast<float4 *>(out + oi) = acc;
      if (out_q8) q8_store4(acc, oi, out_q8, reinterpret_cast<float2 *>(out_q8 + n_head * hd));
    }
    da_sync<SUB, NW>();
  }
  if (n_split > 1 && threadIdx.x == 0) counters[kvh] = 0;
}
