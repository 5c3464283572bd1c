// attn_prefill.cu: prefill attention: causal softmax (the cuBLAS-scores path) and FlashAttention-2.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"
#include "launch.cuh"
#include "kv_cache.cuh"

// ---------------------------------------------------------------- causal softmax (prefill attention)
__global__ void k_causal_softmax(float *s, int n_q, int len, int pos0, float scale) {
  griddep_launch();
  griddep_wait();
  __shared__ float sh[32];
  const int r = blockIdx.x;
  float *row = s + (long long)r * len;
  const int lim = min(len, pos0 + (r % n_q) + 1);
  float m = -INFINITY;
  for (int j = threadIdx.x; j < lim; j += blockDim.x) m = fmaxf(m, row[j] * scale);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sh[wid] = m;
  __syncthreads();
  m = -INFINITY;
  for (int i = 0; i < nw; i++) m = fmaxf(m, sh[i]);
  float sum = 0.f;
  for (int j = threadIdx.x; j < lim; j += blockDim.x) {
    const float e = __expf(row[j] * scale - m);
    row[j] = e;
    sum += e;
  }
  const float tot = block_sum(sum, sh);
  const float inv = 1.f / tot;
  for (int j = threadIdx.x; j < len; j += blockDim.x) row[j] = j < lim ? row[j] * inv : 0.f;
}

extern "C" int strata_causal_softmax(void *stream, float *s, int n_rows, int n_q, int len, int pos0, float scale) {
  if (n_rows <= 0) return 0;
  st_launch(k_causal_softmax, n_rows, 256, 0, (cudaStream_t)stream, s, n_q, len, pos0, scale);
  return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- prefill attention: FlashAttention-2 on mma.sync
// Causal GQA attention of n new queries (positions length .. length + n - 1) over the paged f16 cache (their K/V
// already written). Block = 4 warps = 64 queries of one head and one split of the key range; each warp owns 16
// query rows with Q (scaled by scale * log2 e, f16) in registers as mma A fragments. Per 64-key tile (cp.async
// double-buffered in shared memory): S = Q K^T with mma.sync.m16n8k16 (f16 in, f32 accumulate), causal mask, online
// softmax in registers (exp2, running max m and sum l per row), P rounded to f16 and reused as the A fragment of
// O += P V (V's B fragments by ldmatrix.trans), O in registers. FlashAttention-2: Dao 2023, arXiv:2307.08691.
// n_split == 1: out (f32, or f16 out16) = O / l directly; else each split writes (m, l, O) (m in log2 units) to
// ws and k_fa2_combine merges them.
#define FA2_BQ 64
#define FA2_BK 64

__device__ static inline void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ static inline uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&h);
}

__device__ static inline void cp_async16(uint32_t dst, const void *src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ static inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ static inline void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int HD>
struct Fa2Smem {
  static constexpr int LDH = HD + 8;                               // halves per smem row (conflict-free, 16B rows)
  static constexpr size_t tile = (size_t)FA2_BK * LDH;             // halves per K or V tile
  static constexpr size_t bytes = 2 * 2 * tile * sizeof(__half);   // K and V, double-buffered
};

template <int HD, bool Q8>
__global__ void __launch_bounds__(128) k_fa2_prefill(const float *__restrict__ q, int q_stride,
                                                     const void *__restrict__ kc, const void *__restrict__ vc,
                                                     const __half *__restrict__ ks, const __half *__restrict__ vs,
                                                     const int *__restrict__ pt, float *__restrict__ ws,
                                                     float *__restrict__ out, __half *__restrict__ out16, int n,
                                                     int n_head, int n_kv, int ps, int length, int tiles_per_split,
                                                     int n_split, float qscale) {
  griddep_launch();
  griddep_wait();
  using SM = Fa2Smem<HD>;
  constexpr int LDH = SM::LDH, KC = HD / 16, DT = HD / 8, CH = HD / 8;
  extern __shared__ __align__(16) unsigned char fa2_smem[];
  __half *Kb = reinterpret_cast<__half *>(fa2_smem);    // [2][BK][LDH]
  __half *Vb = Kb + 2 * SM::tile;                         // [2][BK][LDH]
  const int i0 = (gridDim.x - 1 - blockIdx.x) * FA2_BQ;   // longest (latest) query blocks first
  const int h = blockIdx.y, split = blockIdx.z;
  const int kvh = h / (n_head / n_kv);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int total = length + n;
  const int r0 = i0 + warp * 16 + gq, r1 = r0 + 8;       // the two query rows of this thread (block-relative + i0)
  const int qp0 = length + r0, qp1 = length + r1;         // their positions

  // Q fragments (A operand), scaled by qscale = softmax scale * log2(e)
  uint32_t qa[KC][4];
#pragma unroll
  for (int kc = 0; kc < KC; kc++) {
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {   // hf 0: cols 2tq, 2tq+1; hf 1: cols 2tq+8, 2tq+9
      const int col = kc * 16 + hf * 8 + 2 * tq;
      float2 a = make_float2(0.f, 0.f), b = a;
      if (r0 < n) a = *reinterpret_cast<const float2 *>(q + (long long)r0 * q_stride + h * HD + col);
      if (r1 < n) b = *reinterpret_cast<const float2 *>(q + (long long)r1 * q_stride + h * HD + col);
      qa[kc][2 * hf] = pack_half2(a.x * qscale, a.y * qscale);
      qa[kc][2 * hf + 1] = pack_half2(b.x * qscale, b.y * qscale);
    }
  }
  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  const int q_last = length + min(n, i0 + FA2_BQ) - 1;
  const int t_beg = split * tiles_per_split * FA2_BK;
  const int t_end = min(q_last + 1, t_beg + tiles_per_split * FA2_BK);
  const int n_tiles = t_end > t_beg ? (t_end - t_beg + FA2_BK - 1) / FA2_BK : 0;

  auto load_tile = [&](int t, int buf) {
    const int t0 = t_beg + t * FA2_BK;
    __half *Ks = Kb + buf * SM::tile, *Vs = Vb + buf * SM::tile;
    for (int idx = tid; idx < FA2_BK * CH; idx += 128) {
      const int r = idx / CH, c = idx % CH, p = t0 + r;
      const bool ok = p < total;
      const long long off = ok ? kv_off(pt, p, kvh, n_kv, HD, ps) + 8 * c : 0;
      if (Q8) {   // dequantize through registers (8 values per 8-byte load) into the f16 tile
        uint4 kh = make_uint4(0, 0, 0, 0), vh = kh;
        if (ok) {
          float f[8];
          __half2 *h2 = reinterpret_cast<__half2 *>(&kh);
          load_kv8<true>(kc, ks, off, f);
#pragma unroll
          for (int i = 0; i < 4; i++) h2[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
          h2 = reinterpret_cast<__half2 *>(&vh);
          load_kv8<true>(vc, vs, off, f);
#pragma unroll
          for (int i = 0; i < 4; i++) h2[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
        }
        *reinterpret_cast<uint4 *>(Ks + r * LDH + 8 * c) = kh;
        *reinterpret_cast<uint4 *>(Vs + r * LDH + 8 * c) = vh;
      } else {
        const __half *K = reinterpret_cast<const __half *>(kc), *V = reinterpret_cast<const __half *>(vc);
        cp_async16((uint32_t)__cvta_generic_to_shared(Ks + r * LDH + 8 * c), K + off, ok ? 16 : 0);
        cp_async16((uint32_t)__cvta_generic_to_shared(Vs + r * LDH + 8 * c), V + off, ok ? 16 : 0);
      }
    }
    cp_async_commit();
  };

  if (n_tiles > 0) load_tile(0, 0);
  for (int t = 0; t < n_tiles; t++) {
    if (t + 1 < n_tiles) {
      load_tile(t + 1, (t + 1) & 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const __half *Ks = Kb + (t & 1) * SM::tile, *Vs = Vb + (t & 1) * SM::tile;
    const int t0 = t_beg + t * FA2_BK;
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      const __half *kr = Ks + (nt * 8 + gq) * LDH + 2 * tq;
#pragma unroll
      for (int kc = 0; kc < KC; kc++) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t *>(kr + kc * 16);
        const uint32_t b1 = *reinterpret_cast<const uint32_t *>(kr + kc * 16 + 8);
        mma16816(s[nt], qa[kc], b0, b1);
      }
    }
    // causal mask where this tile reaches past the warp's first query position
    if (t0 + FA2_BK - 1 > length + i0 + warp * 16) {
#pragma unroll
      for (int nt = 0; nt < 8; nt++) {
        const int key = t0 + nt * 8 + 2 * tq;
        if (key > qp0) s[nt][0] = -INFINITY;
        if (key + 1 > qp0) s[nt][1] = -INFINITY;
        if (key > qp1) s[nt][2] = -INFINITY;
        if (key + 1 > qp1) s[nt][3] = -INFINITY;
      }
    }
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
      mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
      mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
    const float c0 = exp2f(m0 - mu0), c1 = exp2f(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    float ps0 = 0.f, ps1 = 0.f;
    uint32_t pa[4][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
      const float e0 = exp2f(s[nt][0] - mu0), e1 = exp2f(s[nt][1] - mu0);
      const float e2 = exp2f(s[nt][2] - mu1), e3 = exp2f(s[nt][3] - mu1);
      const uint32_t lo = pack_half2(e0, e1), hi = pack_half2(e2, e3);
      // the row sums count P as rounded to f16, as the P V product sees it
      const float2 flo = __half22float2(*reinterpret_cast<const __half2 *>(&lo));
      const float2 fhi = __half22float2(*reinterpret_cast<const __half2 *>(&hi));
      ps0 += flo.x + flo.y;
      ps1 += fhi.x + fhi.y;
      pa[nt >> 1][(nt & 1) * 2] = lo;
      pa[nt >> 1][(nt & 1) * 2 + 1] = hi;
    }
    l0 = l0 * c0 + ps0;
    l1 = l1 * c1 + ps1;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
      o[dt][0] *= c0; o[dt][1] *= c0;
      o[dt][2] *= c1; o[dt][3] *= c1;
    }
    // O += P V: for each 16-key chunk, V's B fragments of two 8-wide d tiles per ldmatrix.x4.trans
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
#pragma unroll
      for (int dt = 0; dt < DT; dt += 2) {
        const int key = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
        const int col = (dt + (lane >> 4)) * 8;
        const uint32_t addr = (uint32_t)__cvta_generic_to_shared(Vs + key * LDH + col);
        uint32_t b0, b1, b2, b3;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                     : "r"(addr));
        mma16816(o[dt], pa[kk], b0, b1);
        mma16816(o[dt + 1], pa[kk], b2, b3);
      }
    }
    __syncthreads();   // everyone is done with this buffer before it is refilled
  }
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  if (n_split == 1) {
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
      const int col = dt * 8 + 2 * tq;
      if (r0 < n) {
        const long long off = ((long long)r0 * n_head + h) * HD + col;
        if (out16) *reinterpret_cast<__half2 *>(out16 + off) = __floats2half2_rn(o[dt][0] * inv0, o[dt][1] * inv0);
        else *reinterpret_cast<float2 *>(out + off) = make_float2(o[dt][0] * inv0, o[dt][1] * inv0);
      }
      if (r1 < n) {
        const long long off = ((long long)r1 * n_head + h) * HD + col;
        if (out16) *reinterpret_cast<__half2 *>(out16 + off) = __floats2half2_rn(o[dt][2] * inv1, o[dt][3] * inv1);
        else *reinterpret_cast<float2 *>(out + off) = make_float2(o[dt][2] * inv1, o[dt][3] * inv1);
      }
    }
    return;
  }
  const long long hs = HD + 2;
#pragma unroll
  for (int hf = 0; hf < 2; hf++) {
    const int r = hf ? r1 : r0;
    if (r >= n) continue;
    float *dst = ws + (((long long)split * n_head + h) * n + r) * hs;
    if (tq == 0) {
      dst[0] = hf ? m1 : m0;
      dst[1] = hf ? l1 : l0;
    }
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
      dst[2 + dt * 8 + 2 * tq] = o[dt][2 * hf];
      dst[3 + dt * 8 + 2 * tq] = o[dt][2 * hf + 1];
    }
  }
}

// Merge of the FA2 splits (m in log2 units): one block per (query, head), hd threads.
__global__ void k_fa2_combine(const float *__restrict__ ws, float *__restrict__ out, __half *__restrict__ out16,
                              int n, int n_head, int hd, int n_split) {
  griddep_launch();
  griddep_wait();
  const int i = blockIdx.x, h = blockIdx.y;
  const long long stride = (long long)n_head * n * (hd + 2);
  const float *p = ws + ((long long)h * n + i) * (hd + 2);
  float M = -INFINITY;
  for (int s = 0; s < n_split; s++) M = fmaxf(M, p[s * stride]);
  float L = 0.f;
  for (int s = 0; s < n_split; s++) {
    const float ms = p[s * stride];
    if (ms > -INFINITY) L += p[s * stride + 1] * exp2f(ms - M);
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < n_split; s++) {
      const float ms = p[s * stride];
      if (ms > -INFINITY) acc += p[s * stride + 2 + d] * exp2f(ms - M);
    }
    const long long off = ((long long)i * n_head + h) * hd + d;
    if (out16) out16[off] = __float2half(acc * inv);
    else out[off] = acc * inv;
  }
}

template <int HD, bool Q8>
static int fa2_launch(cudaStream_t s, const float *q, int q_stride, const void *K, const void *V, const __half *KS,
                      const __half *VS, const int *pt, float *out, __half *out16, float *ws, int n, int n_head,
                      int n_kv, int ps, int length, int n_split, float scale) {
  const size_t smem = Fa2Smem<HD>::bytes;
  cudaError_t e = cudaFuncSetAttribute(k_fa2_prefill<HD, Q8>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return (int)e;
  const int n_tiles = (length + n + FA2_BK - 1) / FA2_BK;
  const int tps = (n_tiles + n_split - 1) / n_split;
  dim3 grid((n + FA2_BQ - 1) / FA2_BQ, n_head, n_split);
  const float qscale = scale * 1.4426950408889634f;
  st_launch(k_fa2_prefill<HD, Q8>, grid, 128, smem, s, q, q_stride, K, V, KS, VS, pt, ws, out, out16, n, n_head, n_kv, ps,
                                                length, tps, n_split, qscale);
  if (n_split > 1) st_launch(k_fa2_combine, dim3(n, n_head), HD, 0, s, ws, out, out16, n, n_head, HD, n_split);
  return (int)cudaGetLastError();
}

extern "C" int strata_fa2_prefill(void *stream, const float *q, int q_stride, const void *kc, const void *vc,
                                  const int *pt, float *out, void *out16, float *ws, int n, int n_head, int n_kv,
                                  int hd, int ps, int length, int n_split, float scale, const void *k_scales,
                                  const void *v_scales) {
  if (n <= 0 || n_kv <= 0 || n_head % n_kv || n_split < 1 || q_stride < n_head * hd || (!out && !out16) ||
      (!k_scales) != (!v_scales))
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  const __half *KS = (const __half *)k_scales, *VS = (const __half *)v_scales;
  __half *o16 = (__half *)out16;
#define FL(H, Q) fa2_launch<H, Q>(s, q, q_stride, kc, vc, KS, VS, pt, out, o16, ws, n, n_head, n_kv, ps, length, n_split, scale)
  switch (hd) {
    case 64: return KS ? FL(64, true) : FL(64, false);
    case 128: return KS ? FL(128, true) : FL(128, false);
  }
#undef FL
  return (int)cudaErrorInvalidValue;
}
