// matvec_fused.cu: the decode matvecs on q8_1 activations (warp / block per row) and what they fuse around the product.
// strata_matvec_q8w (warp per row; with a RoPE + K/V cache epilogue and an RMSNorm prologue: strata_matvec_q8w_rope),
// strata_matvec_q8b (block per row), the residual add and norm handoff (strata_matvec_q8_resid, strata_norm_q8),
// SwiGLU fused into gate / up (strata_matvec_q8w_glu, _glu_norm), and strata_fused_norm_supported.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"
#include "q8.cuh"
#include "launch.cuh"
#include "quant.cuh"
#include "matvec.cuh"
#include "rope.cuh"
#include "kv_cache.cuh"
#include "matvec_fused.cuh"

// Prefetch one read-only weight row into L2, its 128-byte lines spread over STRIDE threads (this one: `first`):
// with PDL the rows stream in while the previous kernel finishes.
template <int STRIDE>
__device__ static inline void prefetch_row_l2(const uint8_t *row, long long row_bytes, int first) {
  for (long long o = 128LL * first; o < row_bytes; o += STRIDE * 128) prefetch_l2(row + o);
}

// The norm handoff of a whole vector (the first layer's, after the embedding row): a block of one warp per group.
__global__ void k_norm_q8(const float *__restrict__ x, const float *__restrict__ w, int8_t *__restrict__ xq,
                          float *__restrict__ ss, int n) {
  griddep_launch();
  griddep_wait();
  const int i = blockIdx.x * 32 + threadIdx.x;
  handoff_store(x[i], i, w, xq, ss, n);
}

extern "C" int strata_norm_q8(void *stream, const float *x, const float *w, void *x_q8, float *x_ss, int n) {
  if (!x || !w || !x_q8 || !x_ss || n <= 0 || n % 32) return (int)cudaErrorInvalidValue;
  if ((uintptr_t)x_q8 & 7) return (int)cudaErrorMisalignedAddress;
  st_launch(k_norm_q8, n / 32, 32, 0, (cudaStream_t)stream, x, w, (int8_t *)x_q8, x_ss, n);
  return (int)cudaGetLastError();
}

// Before the PDL wait: this thread's chunks of the norm weight (constants) into registers.
template <int MAXC>
__device__ static inline void fn_load_w(const NormIn &n, float (&w)[MAXC][8]) {
#pragma unroll
  for (int k = 0; k < MAXC; k++) {
    const int c = threadIdx.x + k * blockDim.x;
    const bool live = 8 * c < n.dim;
    const float4 a = live ? __ldg(reinterpret_cast<const float4 *>(n.w) + 2 * c) : make_float4(0, 0, 0, 0);
    const float4 b = live ? __ldg(reinterpret_cast<const float4 *>(n.w) + 2 * c + 1) : make_float4(0, 0, 0, 0);
    w[k][0] = a.x; w[k][1] = a.y; w[k][2] = a.z; w[k][3] = a.w; w[k][4] = b.x; w[k][5] = b.y; w[k][6] = b.z;
    w[k][7] = b.w;
  }
}

// After the PDL wait: the norm into xs (int8, dim) and xds (float2 (d, d * sum q), dim / 32), shared memory; ends
// with __syncthreads (every thread of the block must call it).
template <int MAXC>
__device__ static inline void fn_norm_q8(const NormIn &n, const float (&w)[MAXC][8], int8_t *xs, float2 *xds,
                                         float *red) {
  float v[MAXC][8];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < MAXC; k++) {
    const int c = threadIdx.x + k * blockDim.x;
    const bool live = 8 * c < n.dim;
#pragma unroll
    for (int h = 0; h < 2; h++) {
      float4 a = live ? reinterpret_cast<const float4 *>(n.x)[2 * c + h] : make_float4(0, 0, 0, 0);
      if (n.delta && live) {
        const float4 d = reinterpret_cast<const float4 *>(n.delta)[2 * c + h];
        a.x += d.x; a.y += d.y; a.z += d.z; a.w += d.w;
      }
      v[k][4 * h] = a.x; v[k][4 * h + 1] = a.y; v[k][4 * h + 2] = a.z; v[k][4 * h + 3] = a.w;
      if (n.x_out && blockIdx.x == 0 && live) reinterpret_cast<float4 *>(n.x_out)[2 * c + h] = a;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) ss += v[k][e] * v[k][e];
  }
  const float r = rsqrtf(block_sum(ss, red) / (float)n.dim + n.eps);
#pragma unroll
  for (int k = 0; k < MAXC; k++) {
    const int c = threadIdx.x + k * blockDim.x;
    float y[8], d;
    int q[8], sum;
#pragma unroll
    for (int e = 0; e < 8; e++) y[e] = v[k][e] * r * w[k][e];
    q8_chunk(y, q, d, sum);
    if (8 * c < n.dim) {
      uint2 pk;   // the 8 int8 values, little-endian
      pk.x = (uint32_t)(q[0] & 255) | (uint32_t)(q[1] & 255) << 8 | (uint32_t)(q[2] & 255) << 16 |
             (uint32_t)(q[3] & 255) << 24;
      pk.y = (uint32_t)(q[4] & 255) | (uint32_t)(q[5] & 255) << 8 | (uint32_t)(q[6] & 255) << 16 |
             (uint32_t)(q[7] & 255) << 24;
      reinterpret_cast<uint2 *>(xs)[c] = pk;
      if ((c & 3) == 0) xds[c >> 2] = make_float2(d, d * (float)sum);
    }
  }
  __syncthreads();
}

// One thread's share of the dot products of NR weight rows with the q8_1 vector (x int8 blocks, xds their (d, d *
// sum)): STRIDE threads stride over the rows' 32-element sub-blocks (u = first, first + STRIDE, ...), each x block
// loaded once into registers for all NR rows, 2 sub-blocks unrolled; summing acc[r] over the STRIDE threads gives
// row r's product. STRIDE 32 is a warp's share (k_matvec_q8w_glu), 128 a block's (k_matvec_q8b). The loop of
// k_matvec_q8w, which keeps its own copy: the decode plan's hottest kernel was measured with that code (through this
// helper its register allocation changes).
template <int T, int NR, int STRIDE, bool XSHARED = false>
__device__ static inline void strided_rows_dot(const uint8_t *const (&rows)[NR], const int *__restrict__ x,
                                               const float2 *__restrict__ xds, int n_units, int first,
                                               float (&acc)[NR]) {
#pragma unroll
  for (int r = 0; r < NR; r++) acc[r] = 0.f;
#pragma unroll 2
  for (int u = first; u < n_units; u += STRIDE) {
    int xv[8];
    float2 ds;
    load_x<XSHARED>(x, xds, u, xv, ds);
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] += dot_q8x<T>(rows[r], u, xv, ds);
  }
}

// Warp-per-row variant for decode: a warp takes R consecutive rows and its 32 lanes stride over the row's 32-element
// sub-blocks, so one x block (loaded once into registers) serves R rows and every lane keeps R weight loads in
// flight; the whole grid covers a 2-16 MB matrix in one wave. Same arithmetic as k_matvec_q8.
// ROPE: y is the decode step's qkv row and the epilogue also does strata_rope_kv_decode's work (RoPE with adjacent
// pairs, k / v into the f16 cache; rope_pair_prepare / rope_pair_store): a block's 4 * R rows are whole pairs, which
// meet in shared memory.
// STAGE: each warp copies its R rows into shared memory (`slot` bytes per warp, dynamic) before the PDL wait and
// reads them there (launch.cuh, "weight staging"); else it prefetches them into L2.
// FNC > 0: the RMSNorm of fn is fused into the prologue (fn_norm_q8, FNC chunks per thread; xq / xds unused): the
// block's q8_1 x lives in shared memory after the staged rows (STAGE required).
template <int T, int R, bool ROPE, bool STAGE, int FNC>
__global__ void __launch_bounds__(128) k_matvec_q8w(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
                                                    const float2 *__restrict__ xds, float *__restrict__ y, int n_out,
                                                    int n_units, long long row_bytes, RopeKV rope, int slot,
                                                    NormIn fn, ResidOut ro) {
  griddep_launch();
  KT(KT_MATVEC, KT_START);
  extern __shared__ __align__(16) uint8_t staged[];
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = warp * R;
  // whole warps only (with ROPE, a fused norm or a norm handoff every warp reaches the block's barriers)
  if (!ROPE && !FNC && !ro.w && row0 >= n_out) return;
  float nw[FNC > 0 ? FNC : 1][8];
  if (FNC) fn_load_w(fn, nw);
  // rows past the end re-read the last row (not stored): no branch around loads
  const int first = min(row0, n_out - 1), last = min(row0 + R, n_out);   // rows [first, max(last, first + 1))
  const uint8_t *base = w + (long long)first * row_bytes;
  if (STAGE) {
    base = stage_bytes(base, (long long)max(last - first, 1) * row_bytes, staged + (threadIdx.x >> 5) * slot, lane,
                       32);
  } else {
    // the weights are read-only: with PDL this warp's rows stream into L2 while the previous kernel finishes
    // (prefetch_row_l2's loop, kept inline like the dot loop below: the measured code of the hottest kernel)
#pragma unroll
    for (int r = 0; r < R; r++)
      if (row0 + r < n_out)
        for (long long o = 128LL * lane; o < row_bytes; o += 32 * 128) prefetch_l2(w + (long long)(row0 + r) * row_bytes + o);
  }
  // the RoPE epilogue's pair (thread t < 2R: the block's pair t): its angle and cache slot before the wait if allowed
  const int pair_a = blockIdx.x * 4 * R + 2 * threadIdx.x;
  const bool pair_live = ROPE && threadIdx.x < 2 * R && pair_a < n_out;
  RopePair pair{};
  if (pair_live && rope.pre_wait) pair = rope_pair_prepare(rope, pair_a);
  griddep_wait();
  KT(KT_MATVEC, KT_WAITED);
  if (pair_live && !rope.pre_wait) pair = rope_pair_prepare(rope, pair_a);
  // residual add: lane r < R holds x[row0 + r]; handed-off norm: the input's scale
  const float xres = !ROPE && ro.x && lane < R && row0 + lane < n_out ? ro.x[row0 + lane] : 0.f;
  const HandoffSS hss = handoff_load(fn);
  if (STAGE) {
    stage_wait();
    __syncwarp();
    KT(KT_MATVEC, KT_STAGED);
  }
  const int *x = reinterpret_cast<const int *>(xq);
  if (FNC) {   // the block's normalized x as q8_1 in shared memory, after the 4 warps' staged rows
    __shared__ float red[32];
    int8_t *xs = reinterpret_cast<int8_t *>(staged + 4 * slot);
    fn_norm_q8(fn, nw, xs, reinterpret_cast<float2 *>(xs + fn.dim), red);
    KT(KT_MATVEC, KT_NORMED);
    x = reinterpret_cast<const int *>(xs);
    xds = reinterpret_cast<const float2 *>(xs + fn.dim);
  }
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = 0.f;
#pragma unroll 2
  for (int u = lane; u < n_units; u += 32) {
    int xv[8];
    float2 ds;
    load_x<(FNC > 0)>(x, xds, u, xv, ds);
#pragma unroll
    for (int r = 0; r < R; r++)
      acc[r] += dot_q8x<T>(base + (long long)(min(row0 + r, n_out - 1) - first) * row_bytes, u, xv, ds);
  }
  KT(KT_MATVEC, KT_DOTTED);
  const float in_scale = !FNC && fn.ss ? handoff_scale(fn, hss) : 1.f;
  __shared__ float sv[ROPE ? 4 * R : 1];
#pragma unroll
  for (int r = 0; r < R; r++) {
    float v = acc[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (!FNC && fn.ss) v *= in_scale;
    if (ROPE) {
      if (lane == r) sv[(threadIdx.x >> 5) * R + r] = v;
    } else if (lane == r && row0 + r < n_out) {
      if (ro.x) {
        ro.x[row0 + r] = xres + v;
      } else {
        y[row0 + r] = v;
      }
    }
  }
  if (ROPE) {
    __syncthreads();
    if (pair_live) rope_pair_store(rope, pair, y, pair_a, sv[2 * threadIdx.x], sv[2 * threadIdx.x + 1]);
  } else if (ro.w) {
    resid_handoff(ro, blockIdx.x * 4 * R, 4 * R);
  }
  KT(KT_MATVEC, KT_END);
}

// Dynamic shared memory of the fused-norm decode matvecs: the staged rows (4 warps x R rows; 32 / RP warps x RP gate
// and RP up rows) and then x's q8_1 blocks (n_in int8 + n_in / 32 float2). One formula for the launchers and for
// strata_fused_norm_supported.
static long long fused_qkv_smem(long long rb, int R, int n_in) { return 4 * staged_size(R * rb) + n_in + n_in / 4; }
static long long fused_glu_smem(long long rb, int RP, int n_in) {
  return 2 * (32 / RP) * staged_size(RP * rb) + n_in + n_in / 4;
}

// Launch k_matvec_q8w (4 warps of R rows per block), staged when the block's rows fit in SMEM_PLAIN (else its warps
// prefetch them into L2). With a fused norm (fn.w != NULL): always staged (x's q8_1 blocks after the rows), FNC =
// dim / (8 * 128) rounded up to 1, 2 or 4 (dim <= 4096, checked by the launcher), up to the device's opt-in shared
// memory, else cudaErrorInvalidValue (strata_fused_norm_supported says so beforehand).
template <int T, int R, bool ROPE>
static int launch_q8w(cudaStream_t s, const uint8_t *W, const int8_t *q, const float2 *ds, float *y, int n_out,
                      int n_units, long long rb, const RopeKV &rk, const NormIn &fn, const ResidOut &ro = ResidOut{}) {
  const unsigned blocks = (unsigned)((n_out + 4 * R - 1) / (4 * R));
  const long long slot = staged_size((long long)R * rb);
  if constexpr (ROPE) {   // only the QKV matvec takes a fused norm (fewer instantiations)
    if (fn.w) {
      const size_t smem = (size_t)fused_qkv_smem(rb, R, fn.dim);   // = 4 * slot + x's q8_1 blocks
      const int c = (fn.dim + 1023) / 1024;
#define FQ(C) do { static int oi[16]; \
    if ((long long)smem > SMEM_PLAIN && (long long)smem > smem_optin(k_matvec_q8w<T, R, ROPE, true, C>, oi)) \
      return (int)cudaErrorInvalidValue; \
    st_launch(k_matvec_q8w<T, R, ROPE, true, C>, blocks, 128, smem, s, W, q, ds, y, n_out, n_units, rb, rk, (int)slot, \
              fn, ro); } while (0)
      if (c <= 1) FQ(1); else if (c <= 2) FQ(2); else FQ(4);
#undef FQ
      return 0;
    }
  }
  if (4 * slot <= SMEM_PLAIN) {
    st_launch(k_matvec_q8w<T, R, ROPE, true, 0>, blocks, 128, (size_t)(4 * slot), s, W, q, ds, y, n_out, n_units, rb,
              rk, (int)slot, fn, ro);
  } else {
    st_launch(k_matvec_q8w<T, R, ROPE, false, 0>, blocks, 128, 0, s, W, q, ds, y, n_out, n_units, rb, rk, 0, fn, ro);
  }
  return 0;
}

// strata_matvec_q8w, or (ro.x) its residual-add / norm-handoff form (strata_matvec_q8_resid).
static int matvec_q8w(void *stream, int t, const void *w, const void *xq, float *y, int n_out, int n_in,
                      int rows_per_warp, const ResidOut &ro) {
  if (const int e = q8_matvec_check(t, w, xq, n_out, n_in)) return e;
  const long long rb = row_bytes_of(t, n_in);
  const int R = rows_1_2_4(rows_per_warp);
  const int8_t *q = (const int8_t *)xq;
  const float2 *ds = (const float2 *)(q + n_in);
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
#define MW(TT, RR) launch_q8w<TT, RR, false>(s, W, q, ds, y, n_out, n_in / 32, rb, RopeKV{}, NormIn{}, ro)
#define MWR(TT) if (R == 1) MW(TT, 1); else if (R == 2) MW(TT, 2); else MW(TT, 4);
  DISPATCH_Q8_TYPE(t, MWR)
#undef MWR
#undef MW
  return (int)cudaGetLastError();
}

extern "C" int strata_matvec_q8w(void *stream, int t, const void *w, const void *xq, float *y, int n_out, int n_in,
                                 int rows_per_warp) {
  return matvec_q8w(stream, t, w, xq, y, n_out, n_in, rows_per_warp, ResidOut{});
}

// The host checks of a fused RMSNorm's inputs (NormIn) for a matvec of n_in columns run by `threads` threads per
// block: dim = n_in % 32 == 0, <= 4096 and <= 32 * threads (4 chunks of 8 per thread), x / delta / w / x_out
// 16-byte aligned, x_out distinct from x and delta; or a handed-off norm (ss != NULL): the other four pointers NULL,
// n_in % 32 == 0 and <= 4096. Fills *fn; 0 or cudaErrorInvalidValue / cudaErrorMisalignedAddress.
static int fused_norm_in(const float *x, const float *delta, const float *w, float *x_out, float eps, int n_in,
                         int threads, const float *ss, NormIn *fn) {
  *fn = NormIn{};
  if (ss) {   // handed-off norm (strata_matvec_q8_resid wrote xq and ss): nothing else
    if (w || x || delta || x_out || n_in <= 0 || n_in % 32 || n_in > FUSED_NORM_MAX_DIM)
      return (int)cudaErrorInvalidValue;
    fn->ss = ss;
    fn->eps = eps;
    fn->dim = n_in;
    return 0;
  }
  if (!w) return 0;
  if (!x || n_in <= 0 || n_in % 32 || n_in > FUSED_NORM_MAX_DIM || n_in > 32 * threads ||
      (x_out && (x_out == x || x_out == delta)))
    return (int)cudaErrorInvalidValue;
  if (((uintptr_t)x | (uintptr_t)delta | (uintptr_t)w | (uintptr_t)x_out) & 15) return (int)cudaErrorMisalignedAddress;
  *fn = NormIn{x, delta, w, x_out, eps, n_in, nullptr};
  return 0;
}

extern "C" int strata_matvec_q8w_rope(void *stream, int t, const void *w, const void *xq, float *qkv, int n_head,
                                      int n_kv, int hd, int n_in, int rows_per_warp, const int *pos, void *k_cache,
                                      void *v_cache, const int *page_table, int n_rot, float base, int page_size,
                                      const float *norm_x, const float *norm_delta, const float *norm_w,
                                      float *norm_x_out, float eps, int pre_wait, const float *norm_ss) {
  const int n_out = (n_head + 2 * n_kv) * hd;
  if (n_head <= 0 || n_kv <= 0 || hd <= 0 || hd % 2 || n_rot > hd || n_rot % 2 || n_rot < 0 || page_size <= 0 ||
      !pos || !k_cache || !v_cache || !page_table)
    return (int)cudaErrorInvalidValue;
  NormIn fn;
  if (const int e = fused_norm_in(norm_x, norm_delta, norm_w, norm_x_out, eps, n_in, 128, norm_ss, &fn)) return e;
  if (const int e = q8_matvec_check(t, w, norm_w ? w : xq, n_out, n_in)) return e;   // xq unused with a norm
  const long long rb = row_bytes_of(t, n_in);
  const int R = rows_1_2_4(rows_per_warp);
  const int8_t *q = (const int8_t *)xq;
  const float2 *ds = (const float2 *)(q + n_in);
  const RopeKV rk{pos,  page_table, (__half *)k_cache, (__half *)v_cache, n_head, n_kv, hd, n_rot, page_size, base,
                  pre_wait != 0};
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
  int rc = 0;
#define MW(TT, RR) rc = launch_q8w<TT, RR, true>(s, W, q, ds, qkv, n_out, n_in / 32, rb, rk, fn)
#define MWR(TT) if (R == 1) MW(TT, 1); else if (R == 2) MW(TT, 2); else MW(TT, 4);
  DISPATCH_Q8_TYPE(t, MWR)
#undef MWR
#undef MW
  return rc ? rc : (int)cudaGetLastError();
}

// Block-per-rows variant for long rows (the down projection: n_in = n_ff): a block of 4 warps takes RB consecutive
// rows and its 128 threads stride over the rows' 32-element sub-blocks (u = tid, tid + 128, ...), each x block
// loaded once for the RB rows; the four warps' partial sums meet in shared memory. One warp per row gives such a row
// 8+ dependent load rounds per lane and few warps per SM; here every load of a row is in flight at once. Same
// per-sub-block arithmetic as k_matvec_q8w; the sum runs in another order.
// STAGE: the block copies its rows into shared memory before the PDL wait (launch.cuh, "weight staging").
template <int T, int RB, bool STAGE>
__global__ void __launch_bounds__(128) k_matvec_q8b(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
                                                    const float2 *__restrict__ xds, float *__restrict__ y, int n_out,
                                                    int n_units, long long row_bytes, ResidOut ro) {
  griddep_launch();
  KT(KT_MATVEC_BLOCK, KT_START);
  extern __shared__ __align__(16) uint8_t staged[];
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const int row0 = blockIdx.x * RB;
  const int last = min(row0 + RB, n_out);   // rows [row0, last); a row past the end re-reads the last row
  const uint8_t *rows[RB];
  if (STAGE) {
    const uint8_t *b = stage_bytes(w + (long long)row0 * row_bytes, (long long)(last - row0) * row_bytes, staged,
                                   tid, 128);
#pragma unroll
    for (int r = 0; r < RB; r++) rows[r] = b + (long long)(min(row0 + r, n_out - 1) - row0) * row_bytes;
  } else {
#pragma unroll
    for (int r = 0; r < RB; r++) {
      rows[r] = w + (long long)min(row0 + r, n_out - 1) * row_bytes;
      if (row0 + r < n_out) prefetch_row_l2<128>(rows[r], row_bytes, tid);
    }
  }
  griddep_wait();
  KT(KT_MATVEC_BLOCK, KT_WAITED);
  const float xres = ro.x && tid < RB && row0 + tid < n_out ? ro.x[row0 + tid] : 0.f;   // residual add
  if (STAGE) {
    stage_wait();
    __syncthreads();
    KT(KT_MATVEC_BLOCK, KT_STAGED);
  }
  float acc[RB];
  strided_rows_dot<T, RB, 128>(rows, reinterpret_cast<const int *>(xq), xds, n_units, tid, acc);
  KT(KT_MATVEC_BLOCK, KT_DOTTED);
  __shared__ float part[4][RB];
#pragma unroll
  for (int r = 0; r < RB; r++) {
    float v = acc[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[wid][r] = v;
  }
  __syncthreads();
  if (tid < RB && row0 + tid < n_out) {
    const float v = (part[0][tid] + part[1][tid]) + (part[2][tid] + part[3][tid]);
    if (ro.x) {
      ro.x[row0 + tid] = xres + v;
    } else {
      y[row0 + tid] = v;
    }
  }
  if (ro.w) resid_handoff(ro, row0, RB);
  KT(KT_MATVEC_BLOCK, KT_END);
}

static int launch_q8b(void *stream, int t, const void *w, const void *xq, float *y, int n_out, int n_in,
                      int rows_per_block, const ResidOut &ro) {
  if (const int e = q8_matvec_check(t, w, xq, n_out, n_in)) return e;
  const long long rb = row_bytes_of(t, n_in);
  const int RB = rows_1_2_4(rows_per_block);
  const unsigned blocks = (unsigned)((n_out + RB - 1) / RB);
  const int8_t *q = (const int8_t *)xq;
  const float2 *ds = (const float2 *)(q + n_in);
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
  const long long slot = staged_size(RB * rb);
  const bool stage = slot <= SMEM_PLAIN;
#define MB(TT, RR) (stage ? st_launch(k_matvec_q8b<TT, RR, true>, blocks, 128, (size_t)slot, s, W, q, ds, y, n_out, \
                                      n_in / 32, rb, ro) \
                          : st_launch(k_matvec_q8b<TT, RR, false>, blocks, 128, 0, s, W, q, ds, y, n_out, n_in / 32, \
                                      rb, ro))
#define MBR(TT) if (RB == 1) MB(TT, 1); else if (RB == 2) MB(TT, 2); else MB(TT, 4);
  DISPATCH_Q8_TYPE(t, MBR)
#undef MBR
#undef MB
  return (int)cudaGetLastError();
}

extern "C" int strata_matvec_q8b(void *stream, int t, const void *w, const void *xq, float *y, int n_out, int n_in,
                                 int rows_per_block) {
  return launch_q8b(stream, t, w, xq, y, n_out, n_in, rows_per_block, ResidOut{});
}

extern "C" int strata_matvec_q8_resid(void *stream, int t, const void *w, const void *xq, int n_out, int n_in,
                                      int rows, int block, float *x, const float *norm_w, void *x_q8, float *x_ss,
                                      unsigned *counters) {
  if (!x || (norm_w && (!x_q8 || !x_ss || !counters || n_out % 32))) return (int)cudaErrorInvalidValue;
  if ((uintptr_t)x_q8 & 7) return (int)cudaErrorMisalignedAddress;
  const ResidOut ro{x, norm_w, (int8_t *)x_q8, x_ss, counters, n_out};
  return block ? launch_q8b(stream, t, w, xq, nullptr, n_out, n_in, rows, ro)
               : matvec_q8w(stream, t, w, xq, nullptr, n_out, n_in, rows, ro);
}

// SwiGLU fused into the gate/up decode matvec: act[i] = silu(gate_i . x) * (up_i . x), i < F, gate row i at
// wg + i * row_bytes and up row i at wu + i * row_bytes (for a fused [gate; up] weight wu = wg + F * row_bytes). A
// block of 32 / RP warps takes 32 consecutive i, RP per warp (2 RP rows; the x block in registers serves them all, as
// in k_matvec_q8w), so it holds a whole q8_1 block of act and writes it itself: the separate SwiGLU launch is gone.
// Same arithmetic, bit for bit, as k_matvec_q8w (R = 1) over both halves followed by k_swiglu_gu. F % 32 == 0.
// STAGE: each warp copies its RP gate and RP up rows into shared memory (2 slots of `slot` bytes per warp) before the
// PDL wait (launch.cuh, "weight staging").
// FNC > 0: the RMSNorm of fn fused into the prologue as in k_matvec_q8w (x's q8_1 blocks after the staged rows).
template <int T, int RP, bool STAGE, int FNC>
__global__ void __launch_bounds__(32 * (32 / RP)) k_matvec_q8w_glu(
    const uint8_t *__restrict__ wg, const uint8_t *__restrict__ wu, const int8_t *__restrict__ xq,
    const float2 *__restrict__ xds, float *__restrict__ act, int8_t *__restrict__ act_q8, int F, int n_units,
    long long row_bytes, int slot, NormIn fn) {
  griddep_launch();
  KT(KT_GLU, KT_START);
  extern __shared__ __align__(16) uint8_t staged[];
  float nw[FNC > 0 ? FNC : 1][8];
  if (FNC) fn_load_w(fn, nw);
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = blockIdx.x * 32 + wid * RP;
  const uint8_t *g = wg + (long long)i0 * row_bytes, *u = wu + (long long)i0 * row_bytes;
  if (STAGE) {
    g = stage_bytes(g, RP * row_bytes, staged + 2 * wid * slot, lane, 32);
    u = stage_bytes(u, RP * row_bytes, staged + (2 * wid + 1) * slot, lane, 32);
  } else {
#pragma unroll
    for (int r = 0; r < RP; r++) {
      prefetch_row_l2<32>(g + r * row_bytes, row_bytes, lane);
      prefetch_row_l2<32>(u + r * row_bytes, row_bytes, lane);
    }
  }
  griddep_wait();
  KT(KT_GLU, KT_WAITED);
  if (STAGE) {
    stage_wait();
    __syncwarp();
    KT(KT_GLU, KT_STAGED);
  }
  const uint8_t *rows[2 * RP];   // gate rows, then up rows
#pragma unroll
  for (int r = 0; r < RP; r++) {
    rows[r] = g + r * row_bytes;
    rows[RP + r] = u + r * row_bytes;
  }
  float acc[2 * RP];
  if (FNC) {
    __shared__ float red[32];
    int8_t *xs = reinterpret_cast<int8_t *>(staged + 2 * (32 / RP) * slot);
    fn_norm_q8(fn, nw, xs, reinterpret_cast<float2 *>(xs + fn.dim), red);
    KT(KT_GLU, KT_NORMED);
    strided_rows_dot<T, 2 * RP, 32, true>(rows, reinterpret_cast<const int *>(xs),
                                          reinterpret_cast<const float2 *>(xs + fn.dim), n_units, lane, acc);
  } else {
    const HandoffSS hss = handoff_load(fn);
    strided_rows_dot<T, 2 * RP, 32>(rows, reinterpret_cast<const int *>(xq), xds, n_units, lane, acc);
    if (fn.ss) {   // handed-off norm: the input's scale, on each lane's partial products (see the header)
      const float r = handoff_scale(fn, hss);
#pragma unroll
      for (int k = 0; k < 2 * RP; k++) acc[k] *= r;
    }
  }
  KT(KT_GLU, KT_DOTTED);
  __shared__ float sv[32];
#pragma unroll
  for (int r = 0; r < RP; r++) {
    float a = acc[r], b = acc[RP + r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    if (lane == 0) sv[wid * RP + r] = a / (1.f + expf(-a)) * b;
  }
  __syncthreads();
  if (wid == 0) {
    const float v = sv[lane];
    const int i = blockIdx.x * 32 + lane;
    if (act) act[i] = v;
    if (act_q8) q8_store(v, i, act_q8, reinterpret_cast<float2 *>(act_q8 + F));
  }
  KT(KT_GLU, KT_END);
}

// Launch k_matvec_q8w_glu (32 / RP warps per block), staged when the block's rows fit in the device's shared memory
// per block (the opt-in limit, smem_optin); with a fused norm always staged (dim <= 4096: FNC 1, or 2 with RP = 4),
// else cudaErrorInvalidValue (strata_fused_norm_supported says so beforehand).
template <int T, int RP>
static int launch_glu(cudaStream_t s, const uint8_t *G, const uint8_t *U, const int8_t *q, const float2 *ds,
                      float *act, int8_t *aq, int F, int n_units, long long rb, const NormIn &fn) {
  const unsigned blocks = (unsigned)(F / 32), threads = 32 * (32 / RP);
  const long long slot = staged_size((long long)RP * rb), smem = 2 * (32 / RP) * slot;
  if (fn.w) {   // fused norm: staged, x's q8_1 blocks after the rows
    const long long total = fused_glu_smem(rb, RP, fn.dim);   // = smem + x's q8_1 blocks
    const int c = (fn.dim + 8 * (int)threads - 1) / (8 * (int)threads);
#define FG(C) do { static int oi[16]; \
    if (total > smem_optin(k_matvec_q8w_glu<T, RP, true, C>, oi)) return (int)cudaErrorInvalidValue; \
    st_launch(k_matvec_q8w_glu<T, RP, true, C>, blocks, threads, (size_t)total, s, G, U, q, ds, act, aq, F, n_units, \
              rb, (int)slot, fn); } while (0)
    if (c <= 1) {
      FG(1);
    } else if constexpr (RP == 4) {   // 256 threads: 2 chunks of 8 up to 4096 (fused_norm_in's bound)
      FG(2);
    } else {
      return (int)cudaErrorInvalidValue;
    }
#undef FG
    return 0;
  }
  static int optin[16];
  if (smem <= smem_optin(k_matvec_q8w_glu<T, RP, true, 0>, optin))
    st_launch(k_matvec_q8w_glu<T, RP, true, 0>, blocks, threads, (size_t)smem, s, G, U, q, ds, act, aq, F, n_units,
              rb, (int)slot, fn);
  else
    st_launch(k_matvec_q8w_glu<T, RP, false, 0>, blocks, threads, 0, s, G, U, q, ds, act, aq, F, n_units, rb, 0, fn);
  return 0;
}

extern "C" int strata_matvec_q8w_glu(void *stream, int t, const void *w_gate, const void *w_up, const void *xq,
                                     float *act, void *act_q8, int F, int n_in, int pairs_per_warp) {
  return strata_matvec_q8w_glu_norm(stream, t, w_gate, w_up, xq, act, act_q8, F, n_in, pairs_per_warp, nullptr,
                                    nullptr, nullptr, nullptr, 0.f, nullptr);
}

extern "C" int strata_matvec_q8w_glu_norm(void *stream, int t, const void *w_gate, const void *w_up, const void *xq,
                                          float *act, void *act_q8, int F, int n_in, int pairs_per_warp,
                                          const float *norm_x, const float *norm_delta, const float *norm_w,
                                          float *norm_x_out, float eps, const float *norm_ss) {
  if (!strata_matvec_q8_supported(t) || n_in % block_elems(t) || n_in % 32 || F <= 0 || F % 32)
    return (int)cudaErrorInvalidValue;
  const int RP = rows_1_2_4(pairs_per_warp);
  NormIn fn;
  if (const int e = fused_norm_in(norm_x, norm_delta, norm_w, norm_x_out, eps, n_in, 32 * (32 / RP), norm_ss, &fn))
    return e;
  if (norm_w) xq = w_gate;   // unused with a fused norm: pass the alignment check
  if (((uintptr_t)xq & 15) || ((uintptr_t)w_gate & 15) || ((uintptr_t)w_up & 15) || ((uintptr_t)act_q8 & 7))
    return (int)cudaErrorMisalignedAddress;
  const long long rb = row_bytes_of(t, n_in);
  const int8_t *q = (const int8_t *)xq;
  const float2 *ds = (const float2 *)(q + n_in);
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *G = (const uint8_t *)w_gate, *U = (const uint8_t *)w_up;
  int8_t *aq = (int8_t *)act_q8;
  int rc = 0;
#define MG(TT, RR) rc = launch_glu<TT, RR>(s, G, U, q, ds, act, aq, F, n_in / 32, rb, fn)
#define MGR(TT) if (RP == 1) MG(TT, 1); else if (RP == 2) MG(TT, 2); else MG(TT, 4);
  DISPATCH_Q8_TYPE(t, MGR)
#undef MGR
#undef MG
  return rc ? rc : (int)cudaGetLastError();
}

extern "C" int strata_fused_norm_supported(int t_qkv, int t_gate_up, int n_in, int rows_per_warp, int pairs_per_warp) {
  if (!strata_matvec_q8_supported(t_qkv) || !strata_matvec_q8_supported(t_gate_up) || n_in <= 0 || n_in % 32 ||
      n_in > FUSED_NORM_MAX_DIM || n_in % block_elems(t_qkv) || n_in % block_elems(t_gate_up))
    return 0;
  const int R = rows_1_2_4(rows_per_warp);
  const int RP = rows_1_2_4(pairs_per_warp);
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  // both kernels may take the opt-in limit less their static shared memory (<= 256 bytes; 1 KB kept)
  const long long limit = optin - 1024 > SMEM_PLAIN ? optin - 1024 : SMEM_PLAIN;
  return fused_qkv_smem(row_bytes_of(t_qkv, n_in), R, n_in) <= limit &&
         fused_glu_smem(row_bytes_of(t_gate_up, n_in), RP, n_in) <= limit;
}

