// attn_decode.cu: decode attention over the paged KV cache: the first split-K kernels and the GQA-shared one (v2).
// strata_attn_decode(_ex): per query head and split, merged by a second launch or by the last split block;
// strata_attn_decode_gqa: one block per KV head and split serving its whole GQA group, self-merging.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "strata_cuda.h"
#include "q8.cuh"
#include "launch.cuh"
#include "kv_cache.cuh"

// ---------------------------------------------------------------- decode attention (split-K)
// Merge head h's n_split split-K partials (M, L, O[hd] each, as k_attn_decode writes them) into out[h * hd ..] and,
// with out_q8, its q8_1 blocks (int8 [n_head * hd] then float2 per 32). Partials are read through L2 (__ldcg): other
// blocks of the calling grid may have written them. Every thread of the block calls it; hd % 32 == 0, so the loop
// over d keeps warps whole (q8_store's shuffles) with any multiple of 32 threads.
__device__ static void attn_merge_head(const float *partial, int h, int n_split, int hd, int n_head, float *out,
                                       int8_t *out_q8) {
  const float *p = partial + (long long)h * n_split * (hd + 2);
  float M = -INFINITY;
  for (int s = 0; s < n_split; s++) M = fmaxf(M, __ldcg(p + s * (hd + 2)));
  float L = 0.f;
  for (int s = 0; s < n_split; s++) {
    const float ms = __ldcg(p + s * (hd + 2));
    if (ms > -INFINITY) L += __ldcg(p + s * (hd + 2) + 1) * __expf(ms - M);
  }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < n_split; s++) {
      const float ms = __ldcg(p + s * (hd + 2));
      if (ms > -INFINITY) acc += __ldcg(p + s * (hd + 2) + 2 + d) * __expf(ms - M);
    }
    out[h * hd + d] = acc / L;
    if (out_q8) q8_store(acc / L, h * hd + d, out_q8, reinterpret_cast<float2 *>(out_q8 + n_head * hd));
  }
}

// The split-K kernels' tail with a fused merge (counters != NULL): the last block of head h to store its partial
// (a count per head, arrive_acq_rel, reset by that block) merges the head's splits, so no k_attn_combine launch
// follows. Every thread of the block calls it after its stores.
__device__ static void attn_split_tail(const float *partial, unsigned *counters, int h, int n_split, int hd,
                                       int n_head, float *out, int8_t *out_q8) {
  if (!counters) return;
  __shared__ int last;
  if (n_split > 1) {
    __syncthreads();
    if (threadIdx.x == 0) last = arrive_acq_rel(&counters[h], 1u) == (unsigned)(n_split - 1);
    __syncthreads();
    if (!last) return;   // block-uniform
  } else {
    __syncthreads();
  }
  attn_merge_head(partial, h, n_split, hd, n_head, out, out_q8);
  if (n_split > 1 && threadIdx.x == 0) counters[h] = 0;
}

// The end of a split-K decode block (after __syncthreads; every thread calls it): its NG groups' online-softmax states
// (sm, sl, so in shared memory) merged into the split's partial (M, L, O[HD]) and then attn_split_tail; with counters
// and one split the block is the whole head, so the output is written directly and no partial is read back (merging
// one split multiplies by __expf(0) = 1: the same bits as attn_merge_head).
template <int NG, int HD>
__device__ static void attn_block_finish(const float (&sm)[NG], const float (&sl)[NG], const float (&so)[NG][HD],
                                         float *partial, unsigned *counters, int h, int sp, int n_split, int n_head,
                                         float *out, int8_t *out_q8) {
  float M = -INFINITY;
  for (int w = 0; w < NG; w++) M = fmaxf(M, sm[w]);
  float L = 0.f;
  for (int w = 0; w < NG; w++)
    if (sm[w] > -INFINITY) L += sl[w] * __expf(sm[w] - M);
  const bool direct = counters && n_split == 1;   // block-uniform
  float *dst = partial + ((long long)h * n_split + sp) * (HD + 2);
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {   // warp-uniform (HD % 32 == 0): q8_store's shuffles
    float acc = 0.f;
    for (int w = 0; w < NG; w++)
      if (sm[w] > -INFINITY) acc += so[w][d] * __expf(sm[w] - M);
    if (!direct) {
      dst[2 + d] = acc;
    } else {
      out[h * HD + d] = acc / L;
      if (out_q8) q8_store(acc / L, h * HD + d, out_q8, reinterpret_cast<float2 *>(out_q8 + n_head * HD));
    }
  }
  if (direct) return;
  if (threadIdx.x == 0) {
    dst[0] = M;
    dst[1] = L;
  }
  attn_split_tail(partial, counters, h, n_split, HD, n_head, out, out_q8);
}

#define ATT_WARPS 4
template <int EPL>  // elements per lane: hd = 32 * EPL
__global__ void k_attn_decode(const float *__restrict__ q, const __half *__restrict__ kc, const __half *__restrict__ vc,
                              const int *__restrict__ pt, const int *d_len, int len_arg, float *__restrict__ partial,
                              int n_head, int n_kv, int ps, int n_split, float scale, unsigned *counters, float *out,
                              int8_t *out_q8, int /* pre_wait: reads everything after the wait */) {
  griddep_launch();
  KT(KT_ATTN, KT_START);
  griddep_wait();
  KT(KT_ATTN, KT_WAITED);
  constexpr int hd = 32 * EPL;
  const int h = blockIdx.x, sp = blockIdx.y;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int kvh = h / (n_head / n_kv);
  const int len = d_len ? *d_len : len_arg;
  const int chunk = (len + n_split - 1) / n_split;
  const int beg = sp * chunk, end = min(len, beg + chunk);
  float qv[EPL], o[EPL];
#pragma unroll
  for (int k = 0; k < EPL; k++) { qv[k] = q[h * hd + lane + 32 * k] * scale; o[k] = 0.f; }
  float m = -INFINITY, l = 0.f;
  for (int p = beg + wid; p < end; p += ATT_WARPS) {
    const long long base = (((long long)pt[p / ps] * ps + (p % ps)) * n_kv + kvh) * hd;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < EPL; k++) s += qv[k] * __half2float(kc[base + lane + 32 * k]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    const float mn = fmaxf(m, s);
    const float corr = __expf(m - mn), pe = __expf(s - mn);
    l = l * corr + pe;
#pragma unroll
    for (int k = 0; k < EPL; k++) o[k] = o[k] * corr + pe * __half2float(vc[base + lane + 32 * k]);
    m = mn;
  }
  __shared__ float sm[ATT_WARPS], sl[ATT_WARPS], so[ATT_WARPS][hd];
  if (lane == 0) { sm[wid] = m; sl[wid] = l; }
#pragma unroll
  for (int k = 0; k < EPL; k++) so[wid][lane + 32 * k] = o[k];
  __syncthreads();
  attn_block_finish(sm, sl, so, partial, counters, h, sp, n_split, n_head, out, out_q8);
  KT(KT_ATTN, KT_END);
}

__global__ void k_attn_combine(const float *partial, float *out, int8_t *out_q8, int n_split, int hd) {
  griddep_launch();
  KT(KT_ATTN_MERGE, KT_START);
  griddep_wait();
  KT(KT_ATTN_MERGE, KT_WAITED);
  attn_merge_head(partial, blockIdx.x, n_split, hd, gridDim.x, out, out_q8);
  KT(KT_ATTN_MERGE, KT_END);
}

// Decode attention with several positions per warp in flight: a group of LP = hd / 8 lanes owns one position
// (each lane one 16-byte load of 8 f16 K values and 8 V values), so a warp reads 32 / LP positions per step and
// each group unrolls 2 positions (loads issued before the dot products). Each group keeps its own online softmax
// (m, l, o); groups and warps are merged in shared memory into the same (M, L, O) partial as k_attn_decode (or,
// with counters and one split, straight into the output).
// The body of k_attn_decode_v (and of its rows form, k_attn_rows_v) for head h and split sp, from the PDL wait on.
template <int LP>
__device__ __forceinline__ void attn_v_block(int h, int sp, const float *__restrict__ q, const __half *__restrict__ kc,
                                             const __half *__restrict__ vc, const int *__restrict__ pt,
                                             const int *d_len, int len_arg, float *__restrict__ partial, int n_head,
                                             int n_kv, int ps, int n_split, float scale, unsigned *counters,
                                             float *out, int8_t *out_q8, int pre_wait) {
  constexpr int hd = 8 * LP, PPW = 32 / LP, NG = ATT_WARPS * PPW, STEP = 2 * NG;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, grp = lane / LP, gl = lane % LP;
  const int kvh = h / (n_head / n_kv);
  const int g_id = wid * PPW + grp;
  // the length, the split's range and the pages of the first step's two positions (pga, pgb): before the PDL wait
  // when the caller allows it (pre_wait: no earlier kernel of the PDL chain writes the length or page table), so
  // that after it only q and the K / V rows are loaded (the first step's K / V include the position the previous
  // kernel wrote)
  int len = 0, beg = 0, end = 0, pga = 0, pgb = 0;
  auto bounds = [&]() {
    len = d_len ? *d_len : len_arg;
    const int chunk = (len + n_split - 1) / n_split;
    beg = sp * chunk;
    end = min(len, beg + chunk);
    if (beg < end) {
      pga = pt[min(beg + g_id, end - 1) / ps];
      pgb = pt[min(beg + NG + g_id, end - 1) / ps];
    }
  };
  if (pre_wait) bounds();
  griddep_wait();
  KT(KT_ATTN, KT_WAITED);
  if (!pre_wait) bounds();
  float qv[8], o[8];
  {
    const float4 *qp = reinterpret_cast<const float4 *>(q + h * hd + 8 * gl);
    const float4 a = qp[0], b = qp[1];
    qv[0] = a.x * scale; qv[1] = a.y * scale; qv[2] = a.z * scale; qv[3] = a.w * scale;
    qv[4] = b.x * scale; qv[5] = b.y * scale; qv[6] = b.z * scale; qv[7] = b.w * scale;
  }
#pragma unroll
  for (int i = 0; i < 8; i++) o[i] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int p0 = beg; p0 < end; p0 += STEP) {
    const int pa = p0 + g_id, pb = p0 + NG + g_id;
    const bool va = pa < end, vb = pb < end;
    // positions past the end load the range's last one (valid; its score is not used): unconditional loads are
    // all in flight together, a load behind a branch waits for the previous one's use
    const int qa = min(pa, end - 1), qb = min(pb, end - 1);
    if (p0 != beg) {
      pga = pt[qa / ps];
      pgb = pt[qb / ps];
    }
    const long long ba = (((long long)pga * ps + (qa % ps)) * n_kv + kvh) * hd + 8 * gl;
    const long long bb = (((long long)pgb * ps + (qb % ps)) * n_kv + kvh) * hd + 8 * gl;
    const uint4 ka = *reinterpret_cast<const uint4 *>(kc + ba), xa = *reinterpret_cast<const uint4 *>(vc + ba);
    const uint4 kb = *reinterpret_cast<const uint4 *>(kc + bb), xb = *reinterpret_cast<const uint4 *>(vc + bb);
    const __half2 *k2a = reinterpret_cast<const __half2 *>(&ka), *k2b = reinterpret_cast<const __half2 *>(&kb);
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 fa = __half22float2(k2a[i]), fb = __half22float2(k2b[i]);
      sa += qv[2 * i] * fa.x + qv[2 * i + 1] * fa.y;
      sb += qv[2 * i] * fb.x + qv[2 * i + 1] * fb.y;
    }
#pragma unroll
    for (int off = LP / 2; off > 0; off >>= 1) {
      sa += __shfl_xor_sync(0xffffffffu, sa, off);
      sb += __shfl_xor_sync(0xffffffffu, sb, off);
    }
    if (va) {
      const float mn = fmaxf(m, vb ? fmaxf(sa, sb) : sa);
      const float corr = __expf(m - mn), ea = __expf(sa - mn), eb = vb ? __expf(sb - mn) : 0.f;
      l = l * corr + ea + eb;
      const __half2 *v2a = reinterpret_cast<const __half2 *>(&xa), *v2b = reinterpret_cast<const __half2 *>(&xb);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float2 fa = __half22float2(v2a[i]), fb = __half22float2(v2b[i]);
        o[2 * i] = o[2 * i] * corr + ea * fa.x + eb * fb.x;
        o[2 * i + 1] = o[2 * i + 1] * corr + ea * fa.y + eb * fb.y;
      }
      m = mn;
    }
  }
  __shared__ float sm[NG], sl[NG], so[NG][hd];
  if (gl == 0) { sm[g_id] = m; sl[g_id] = l; }
#pragma unroll
  for (int i = 0; i < 8; i++) so[g_id][8 * gl + i] = o[i];
  __syncthreads();
  attn_block_finish(sm, sl, so, partial, counters, h, sp, n_split, n_head, out, out_q8);
}

template <int LP>
__global__ void k_attn_decode_v(const float *__restrict__ q, const __half *__restrict__ kc,
                                const __half *__restrict__ vc, const int *__restrict__ pt, const int *d_len,
                                int len_arg, float *__restrict__ partial, int n_head, int n_kv, int ps, int n_split,
                                float scale, unsigned *counters, float *out, int8_t *out_q8, int pre_wait) {
  griddep_launch();
  KT(KT_ATTN, KT_START);
  attn_v_block<LP>(blockIdx.x, blockIdx.y, q, kc, vc, pt, d_len, len_arg, partial, n_head, n_kv, ps, n_split, scale,
                   counters, out, out_q8, pre_wait);
  KT(KT_ATTN, KT_END);
}

// Per-row strides of the rows forms (the short read: one query token per row, each with its own length, output,
// partials, merge counters and page table, over one layer's K/V cache): q and out in floats, out_q8 in bytes, the
// split partials in floats, the page tables in ints, the counters in counters.
struct AttnRows {
  long long q, out, q8, ws, pt;   // pt: page-table stride in ints (0: the rows share one sequence's table)
  int cnt;
};

// k_attn_decode_v over rows: grid (n_head, n_split, rows), row blockIdx.z attends over d_len[row] positions; every
// row's blocks compute exactly what k_attn_decode_v computes for that row alone.
template <int LP>
__global__ void k_attn_rows_v(const float *__restrict__ q, const __half *__restrict__ kc,
                              const __half *__restrict__ vc, const int *__restrict__ pt, const int *d_len,
                              float *__restrict__ partial, int n_head, int n_kv, int ps, int n_split, float scale,
                              unsigned *counters, float *out, int8_t *out_q8, AttnRows rs) {
  griddep_launch();
  const int r = blockIdx.z;
  attn_v_block<LP>(blockIdx.x, blockIdx.y, q + r * rs.q, kc, vc, pt + r * rs.pt, d_len + r, 0, partial + r * rs.ws,
                   n_head, n_kv, ps, n_split, scale, counters + (long long)r * rs.cnt, out + r * rs.out,
                   out_q8 ? out_q8 + r * rs.q8 : nullptr, 1);
}

extern "C" int strata_attn_decode(void *stream, const float *q, const void *kc, const void *vc, const int *pt,
                                  const int *d_len, int len, float *partial, float *out, int n_head, int n_kv, int hd,
                                  int ps, int n_split, float scale) {
  return strata_attn_decode_ex(stream, q, kc, vc, pt, d_len, len, partial, out, nullptr, nullptr, 0, n_head, n_kv,
                               hd, ps, n_split, scale);
}

extern "C" int strata_attn_decode_ex(void *stream, const float *q, const void *kc, const void *vc, const int *pt,
                                     const int *d_len, int len, float *partial, float *out, void *out_q8,
                                     unsigned *counters, int pre_wait, int n_head, int n_kv, int hd, int ps,
                                     int n_split, float scale) {
  if (hd % 32 || hd > 256 || hd <= 0 || n_kv <= 0 || n_head % n_kv || n_split < 1) return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  dim3 grid(n_head, n_split);
  const __half *K = (const __half *)kc, *V = (const __half *)vc;
  int8_t *oq = (int8_t *)out_q8;
#define AD(E) st_launch(k_attn_decode<E>, grid, 32 * ATT_WARPS, 0, s, q, K, V, pt, d_len, len, partial, n_head, n_kv, ps, n_split, scale, counters, out, oq, pre_wait)
#define AV(LP) st_launch(k_attn_decode_v<LP>, grid, 32 * ATT_WARPS, 0, s, q, K, V, pt, d_len, len, partial, n_head, n_kv, ps, n_split, scale, counters, out, oq, pre_wait)
  // 32 / 64 / 128 / 256: 16-byte lane groups; the other multiples of 32: one position per warp step
  switch (hd) {
    case 32: AV(4); break; case 64: AV(8); break; case 128: AV(16); break; case 256: AV(32); break;
    default:
      switch (hd / 32) {
        case 3: AD(3); break; case 5: AD(5); break; case 6: AD(6); break; case 7: AD(7); break;
      }
  }
#undef AV
#undef AD
  // without counters the merge is a second launch (one block of hd threads per head)
  if (!counters) st_launch(k_attn_combine, n_head, hd, 0, s, partial, out, oq, n_split, hd);
  return (int)cudaGetLastError();
}

// The short read's rows (one query token each; see AttnRows): k_attn_rows_v, self-merging (counters required).
extern "C" int strata_attn_rows(void *stream, const float *q, long long q_stride, const void *kc, const void *vc,
                                const int *pt, long long pt_stride, const int *d_len, float *partial,
                                long long ws_stride, float *out, long long out_stride, void *out_q8,
                                long long q8_stride, unsigned *counters, int cnt_stride, int n_rows, int n_head,
                                int n_kv, int hd, int ps, int n_split, float scale) {
  if (n_kv <= 0 || n_head % n_kv || n_split < 1 || n_rows < 1 || !d_len || !counters || cnt_stride < n_head ||
      pt_stride < 0 ||
      ws_stride < (long long)n_head * n_split * (hd + 2))
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  dim3 grid(n_head, n_split, n_rows);
  const __half *K = (const __half *)kc, *V = (const __half *)vc;
  int8_t *oq = (int8_t *)out_q8;
  const AttnRows rs{q_stride, out_stride, q8_stride, ws_stride, pt_stride, cnt_stride};
#define AR(LP) st_launch(k_attn_rows_v<LP>, grid, 32 * ATT_WARPS, 0, s, q, K, V, pt, d_len, partial, n_head, n_kv, ps, \
                         n_split, scale, counters, out, oq, rs)
  switch (hd) {
    case 32: AR(4); break; case 64: AR(8); break; case 128: AR(16); break; case 256: AR(32); break;
    default: return (int)cudaErrorInvalidValue;
  }
#undef AR
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- decode attention, GQA-shared, self-merging
// One block of DA_WARPS warps (k_attn_decode_gqa, grid (n_kv, n_split)) takes KV head kvh, all
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

// Raw K and V words of B positions p0, p0 + stride, ... (clamped to end - 1: the loads are unconditional) of KV
// head kvh, element offset d0 within the head.
template <bool Q8, int B>
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
    load_kv8_raw<Q8>(kc, ks, e[b], kr[b], kd[b]);
    load_kv8_raw<Q8>(vc, vs, e[b], vr[b], vd[b]);
  }
}

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

template <int LP, int G, bool Q8, bool DB>
__device__ __forceinline__ void attn_gqa_block(
    int kvh, int sp, const float *q, const void *kc, const void *vc, const __half *__restrict__ ks,
    const __half *__restrict__ vs, const int *__restrict__ pt, int len, float *ws, unsigned *counters, float *out,
    int8_t *out_q8, int n_head, int n_kv, int ps, int n_split, float scale) {
  constexpr int hd = 8 * LP, PPW = 32 / LP, NG = DA_WARPS * PPW, B = G >= 8 ? 2 : 4;
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
      const float4 a = qp[0], b = qp[1];
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
  if (beg < end) issue_kv8<Q8, B>(kc, vc, ks, vs, pt, beg + gid, NG, end, kvh, n_kv, hd, ps, 8 * gl, kr, vr, kd, vd);
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
      issue_kv8<Q8, B>(kc, vc, ks, vs, pt, P + STEP + gid, NG, end, kvh, n_kv, hd, ps, 8 * gl, kr, vr, kd, vd);
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
      issue_kv8<Q8, B>(kc, vc, ks, vs, pt, P + STEP + gid, NG, end, kvh, n_kv, hd, ps, 8 * gl, kr, vr, kd, vd);
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
    __syncthreads();
    if (gl == 0) { sm[gid] = m[j]; sl[gid] = l[j]; }
#pragma unroll
    for (int i = 0; i < 8; i++) so[gid][8 * gl + i] = o[j][i];
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < NG; w++) M = fmaxf(M, sm[w]);
    const long long hsp = (long long)(kvh * g + j) * n_split + sp;
    for (int d = threadIdx.x; d < hd; d += 32 * DA_WARPS) {
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
  __syncthreads();
  if (n_split > 1) {
    if (threadIdx.x == 0) last = arrive_acq_rel(&counters[kvh], 1u) == (unsigned)(n_split - 1);
    __syncthreads();
    if (!last) return;   // block-uniform
  }
  // merge the splits of the g heads of this KV head (partials read through L2: __ldcg). Weights: one warp per head,
  // lanes over the splits; outputs: P block-parts over the splits per group of four outputs, summed in shared memory.
  const long long h0 = (long long)kvh * g * n_split;
  for (int j = wid; j < g; j += DA_WARPS) {   // warp-uniform: whole warps reach the shuffles
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
  __syncthreads();
  constexpr int T = 32 * DA_WARPS;
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
    __syncthreads();
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
    __syncthreads();
  }
  if (n_split > 1 && threadIdx.x == 0) counters[kvh] = 0;
}

template <int LP, int G, bool Q8, bool DB>
__global__ void __launch_bounds__(32 * DA_WARPS) k_attn_decode_gqa(
    const float *__restrict__ q, const void *__restrict__ kc, const void *__restrict__ vc,
    const __half *__restrict__ ks, const __half *__restrict__ vs,
    const int *__restrict__ pt, const int *__restrict__ d_len, int len_arg, float *__restrict__ ws,
    unsigned *__restrict__ counters, float *__restrict__ out, int8_t *__restrict__ out_q8, int n_head, int n_kv,
    int ps, int n_split, float scale) {
  griddep_launch();
  griddep_wait();
  attn_gqa_block<LP, G, Q8, DB>(blockIdx.x, blockIdx.y, q, kc, vc, ks, vs, pt, d_len ? *d_len : len_arg, ws,
                                       counters, out, out_q8, n_head, n_kv, ps, n_split, scale);
}

// k_attn_decode_gqa over rows: grid (n_kv, n_split, rows), row blockIdx.z attends over d_len[row] positions with its
// own partials, counters and output (AttnRows); every row computes exactly what k_attn_decode_gqa computes for it.
template <int LP, int G, bool Q8, bool DB>
__global__ void __launch_bounds__(32 * DA_WARPS) k_attn_rows_gqa(
    const float *__restrict__ q, const void *__restrict__ kc, const void *__restrict__ vc,
    const __half *__restrict__ ks, const __half *__restrict__ vs, const int *__restrict__ pt,
    const int *__restrict__ d_len, float *__restrict__ ws, unsigned *__restrict__ counters, float *__restrict__ out,
    int8_t *__restrict__ out_q8, int n_head, int n_kv, int ps, int n_split, float scale, AttnRows rs) {
  griddep_launch();
  griddep_wait();
  const int r = blockIdx.z;
  attn_gqa_block<LP, G, Q8, DB>(blockIdx.x, blockIdx.y, q + r * rs.q, kc, vc, ks, vs, pt + r * rs.pt, d_len[r],
                                ws + r * rs.ws,
                                counters + (long long)r * rs.cnt, out + r * rs.out,
                                out_q8 ? out_q8 + r * rs.q8 : nullptr, n_head, n_kv, ps, n_split, scale);
}

// Whether the GQA decode kernel issues the next iteration's K/V loads before this one's arithmetic (double
// buffering): yes unless STRATA_CUDA_ATTN_DB=0/false/no/off (read per launch). The two variants hold different
// registers (hd 128, 2 query heads per KV head: 157 vs 150; 1 head: 128 vs 71), so the occupancy query below asks
// about the same one.
static bool attn_db() {
  const char *e = getenv("STRATA_CUDA_ATTN_DB");
  return !(e && (!strcmp(e, "0") || !strcmp(e, "false") || !strcmp(e, "no") || !strcmp(e, "off")));
}

extern "C" int strata_attn_decode_gqa(void *stream, const float *q, const void *kc, const void *vc, const int *pt,
                                      const int *d_len, int len, float *ws, unsigned *counters, float *out,
                                      void *out_q8, int n_head, int n_kv, int hd, int ps, int n_split, float scale,
                                      const void *k_scales, const void *v_scales) {
  if (n_kv <= 0 || n_head % n_kv || n_split < 1 || n_split > DA_MAX_SPLIT || (n_split > 1 && !counters))
    return (int)cudaErrorInvalidValue;
  const int g = n_head / n_kv;
  if (g > 8 || (!k_scales) != (!v_scales)) return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  dim3 grid(n_kv, n_split);
  const __half *KS = (const __half *)k_scales, *VS = (const __half *)v_scales;
  int8_t *oq = (int8_t *)out_q8;
  const bool db = attn_db();
#define DG(LP, GG, Q) { if (db) DGD(LP, GG, Q, true); else DGD(LP, GG, Q, false); }
#define DGD(LP, GG, Q, D) st_launch(k_attn_decode_gqa<LP, GG, Q, D>, grid, 32 * DA_WARPS, 0, s, q, kc, vc, KS, VS, pt, d_len, len, ws, counters, out, oq, n_head, n_kv, ps, n_split, scale)
#define DGQ(LP, GG) { if (KS) DG(LP, GG, true) else DG(LP, GG, false) }
#define DGG(LP) \
  if (g == 1) { DGQ(LP, 1) } else if (g == 2) { DGQ(LP, 2) } else if (g <= 4) { DGQ(LP, 4) } else { DGQ(LP, 8) }
  switch (hd) {
    case 32: DGG(4); break;
    case 64: DGG(8); break;
    case 128: DGG(16); break;
    case 256: DGG(32); break;
    default: return (int)cudaErrorInvalidValue;
  }
#undef DGG
#undef DGQ
#undef DG
#undef DGD
  return (int)cudaGetLastError();
}

// The short read's rows (AttnRows) through k_attn_rows_gqa; the checks of strata_attn_decode_gqa, d_len and counters
// required.
extern "C" int strata_attn_rows_gqa(void *stream, const float *q, long long q_stride, const void *kc, const void *vc,
                                    const int *pt, long long pt_stride, const int *d_len, float *ws,
                                    long long ws_stride, unsigned *counters, int cnt_stride, float *out,
                                    long long out_stride, void *out_q8, long long q8_stride, int n_rows, int n_head,
                                    int n_kv, int hd, int ps, int n_split, float scale, const void *k_scales,
                                    const void *v_scales) {
  if (n_kv <= 0 || n_head % n_kv || n_split < 1 || n_split > DA_MAX_SPLIT || n_rows < 1 || !d_len || !counters ||
      cnt_stride < n_kv || pt_stride < 0 || ws_stride < (long long)n_head * n_split * (hd + 2))
    return (int)cudaErrorInvalidValue;
  const int g = n_head / n_kv;
  if (g > 8 || (!k_scales) != (!v_scales)) return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  dim3 grid(n_kv, n_split, n_rows);
  const __half *KS = (const __half *)k_scales, *VS = (const __half *)v_scales;
  int8_t *oq = (int8_t *)out_q8;
  const bool db = attn_db();
  const AttnRows rs{q_stride, out_stride, q8_stride, ws_stride, pt_stride, cnt_stride};
#define RG(LP, GG, Q) { if (db) RGD(LP, GG, Q, true); else RGD(LP, GG, Q, false); }
#define RGD(LP, GG, Q, D) st_launch(k_attn_rows_gqa<LP, GG, Q, D>, grid, 32 * DA_WARPS, 0, s, q, kc, vc, KS, VS, pt, \
                                    d_len, ws, counters, out, oq, n_head, n_kv, ps, n_split, scale, rs)
#define RGQ(LP, GG) { if (KS) RG(LP, GG, true) else RG(LP, GG, false) }
#define RGG(LP) \
  if (g == 1) { RGQ(LP, 1) } else if (g == 2) { RGQ(LP, 2) } else if (g <= 4) { RGQ(LP, 4) } else { RGQ(LP, 8) }
  switch (hd) {
    case 32: RGG(4); break;
    case 64: RGG(8); break;
    case 128: RGG(16); break;
    case 256: RGG(32); break;
    default: return (int)cudaErrorInvalidValue;
  }
#undef RGG
#undef RGQ
#undef RG
#undef RGD
  return (int)cudaGetLastError();
}

// Blocks of k_attn_decode_gqa resident per multiprocessor for this head size / group / cache type and the current
// STRATA_CUDA_ATTN_DB (the kernel the launcher picks; its registers decide: 157 per thread for hd 128 with 2 query
// heads per KV head, 2-3 blocks on the H200), or a negative cudaError_t. The decode plans cap n_split so that the
// grid (n_kv x n_split) fits in one wave.
extern "C" int strata_attn_decode_gqa_occupancy(int hd, int g, int q8) {
  int n = 0;
  cudaError_t e = cudaErrorInvalidValue;
  const bool db = attn_db();
#define OCD(LP, GG, Q, D) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_attn_decode_gqa<LP, GG, Q, D>, 32 * DA_WARPS, 0)
#define OC(LP, GG, Q) { if (db) OCD(LP, GG, Q, true); else OCD(LP, GG, Q, false); }
#define OCQ(LP, GG) { if (q8) OC(LP, GG, true) else OC(LP, GG, false) }
#define OCG(LP) \
  if (g == 1) OCQ(LP, 1) else if (g == 2) OCQ(LP, 2) else if (g <= 4) OCQ(LP, 4) else if (g <= 8) OCQ(LP, 8)
  switch (hd) {
    case 32: OCG(4); break;
    case 64: OCG(8); break;
    case 128: OCG(16); break;
    case 256: OCG(32); break;
  }
#undef OCG
#undef OCQ
#undef OC
#undef OCD
  return e == cudaSuccess ? n : -(int)e;
}

