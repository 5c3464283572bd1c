// matvec_cols.cu: the short read's matvecs over n columns (n new tokens of one sequence; the same kernels serve one
// token of each of several sequences): each weight row is read from memory once for all columns, and each column is
// reduced exactly as the decode matvec it mirrors (matvec_fused.cu) reduces its one vector, so column c is
// bit-identical to that decode launch on column c alone.
//
// Two kernel families:
// * The plain products (strata_mvc_q8w, strata_mvc_q8b, strata_mvc_q8w_glu without an input norm): register tiles.
//   Each weight sub-block is loaded once, into registers, and dotted there with every column's activation block
//   (wb_load / wb_dot: dot_q8x of quant.cuh split in two, the same integer dot and floating-point expression), a
//   thread holding NR rows x NC columns of partial sums; the NC butterflies are interleaved (independent shuffles in
//   flight together). NC, a compile-time column count in {2, 3, 4, 5, 8, 16}, is the smallest that holds n_cols: columns
//   past n_cols re-read the last column and are not stored. The weights are staged into shared memory before the PDL
//   wait, as the decode matvecs do, where they fit.
// * The fused forms (strata_mvc_q8w_rope, strata_mvc_q8_resid, strata_mvc_q8w_glu with a handed-off norm): one warp
//   (block) per row summing up to COLS1_CHUNK columns per pass, each column's x block and the weight sub-block
//   loaded per column, the handed-off input scales computed first.
//
// What "exactly" means, kernel by kernel (the decode kernel's own structure, with its rows-per-warp R = 1, which
// changes nothing per row: R only shares an x block between rows):
// * k_mvc_q8w / k_mvc1_q8w mirror k_matvec_q8w: per row, lane l sums dot_q8x over sub-blocks u = l, l + 32, ... in
//   that order into one float per column, then the xor butterfly (16, 8, 4, 2, 1); a handed-off input norm scales
//   the sum after the butterfly; the RoPE + K/V epilogue is rope_pair_prepare / rope_pair_store on the pair's two
//   sums; the residual form stores x + v and hands off the next norm (handoff_store) from the block completing a
//   32-row group.
// * k_mvc_q8b / k_mvc1_q8b mirror k_matvec_q8b: one block of 4 warps per row, thread t sums u = t, t + 128, ...,
//   each warp's butterfly, then (w0 + w1) + (w2 + w3).
// * k_mvc_glu / k_mvc1_glu mirror k_matvec_q8w_glu: per (gate, up) pair one warp as above, the handed-off scale on
//   each lane's partial sums before the butterfly, silu(a) * b as a / (1 + expf(-a)) * b, the q8_1 block of 32
//   activations by q8_store.
// Column layout: column c of a q8_1 input or output of n values starts at c * strata_q8_col_bytes(n) (n int8, then
// n / 32 float2 (d, d * sum q), rounded up to 16 bytes), of an f32 vector of n values at c * n, of a sums-of-squares
// vector at c * (n / 32).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"
#include "quant.cuh"
#include "matvec_fused.cuh"

#define COLS_MAX 16     // columns per launch (the short read's n <= 16)

static inline long long q8_col_bytes(int n) { return ((long long)n + n / 4 + 15) / 16 * 16; }

extern "C" int strata_q8_col_bytes(int n) { return n > 0 && n % 32 == 0 ? (int)q8_col_bytes(n) : -1; }

// Column c's q8_1 blocks: its int8 values and (d, d * sum) pairs.
__device__ static inline const int *col_x(const int8_t *xq, long long stride, int c) {
  return reinterpret_cast<const int *>(xq + c * stride);
}
__device__ static inline const float2 *col_ds(const int8_t *xq, long long stride, int c, int n) {
  return reinterpret_cast<const float2 *>(xq + c * stride + n);
}

// ---------------------------------------------------------------- one weight sub-block in registers
// Weight sub-block u (32 elements) of one row as dot_q8x reads it: q the 8 ints its dp4a take (Q4_0 / Q4_1: the low
// nibbles of the 4 loaded ints, then their high nibbles: the same integer sum in another order), a..e the scale
// factors (Q4_0: d; Q4_1: d, m; Q8_0: d; Q4_K / Q5_K: d, sc, dmin, mn; Q6_K: d, sc[0], sc[1]).
struct WB {
  int q[8];
  float a, b, c, e;
};

template <int T>
__device__ static inline void wb_load(const uint8_t *__restrict__ row, int u, WB &w) {
  if (T == T_Q4_0 || T == T_Q4_1) {
    const uint8_t *b = row + u * (T == T_Q4_0 ? 18 : 20);
    int q[4];
    if (T == T_Q4_1) {
      const int *p = reinterpret_cast<const int *>(b + 4);
#pragma unroll
      for (int i = 0; i < 4; i++) q[i] = p[i];
    } else {
#pragma unroll
      for (int i = 0; i < 4; i++) q[i] = ld32a2(b + 2 + 4 * i);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
      w.q[i] = q[i] & 0x0F0F0F0F;
      w.q[4 + i] = (q[i] >> 4) & 0x0F0F0F0F;
    }
    w.a = ldh(b);
    w.b = T == T_Q4_1 ? ldh(b + 2) : 0.f;
  } else if (T == T_Q8_0) {
    const uint8_t *b = row + u * 34;
#pragma unroll
    for (int i = 0; i < 8; i++) w.q[i] = ld32a2(b + 2 + 4 * i);
    w.a = ldh(b);
  } else if (T == T_Q4_K || T == T_Q5_K) {
    const int bs = T == T_Q4_K ? 144 : 176;
    const uint8_t *b = row + (u >> 3) * bs;
    const int j = u & 7, p = j >> 1, sh = 4 * (j & 1);
    const int4 *qp = reinterpret_cast<const int4 *>(b + (T == T_Q4_K ? 16 : 48) + 32 * p);
    const int4 q0 = qp[0], q1 = qp[1];
    int q[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = (q[i] >> sh) & 0x0F0F0F0F;
    if (T == T_Q5_K) {
      const int4 *hp = reinterpret_cast<const int4 *>(b + 16);
      const int4 h0 = hp[0], h1 = hp[1];
      const int h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
      for (int i = 0; i < 8; i++) q[i] |= ((h[i] >> j) & 0x01010101) << 4;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) w.q[i] = q[i];
    scale_min_k4(j, b + 4, w.b, w.e);
    w.a = ldh(b);
    w.c = ldh(b + 2);
  } else {  // T_Q6_K: sub-block u covers elements 32u..32u+31 of the row: half n, group g
    const uint8_t *b = row + (u >> 3) * 210;
    const int j = u & 7, n = j >> 2, g = j & 3;
    const uint8_t *ql = b + 64 * n + 32 * (g & 1);
    const uint8_t *qh = b + 128 + 32 * n;
    const int sl = g >= 2 ? 4 : 0, shh = 2 * g;
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const int lo = (ld32a2(ql + 4 * i) >> sl) & 0x0F0F0F0F;
      const int hi = ((ld32a2(qh + 4 * i) >> shh) & 0x03030303) << 4;
      w.q[i] = __vsubss4(lo | hi, 0x20202020);      // q - 32 in [-32, 31]
    }
    const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192) + 8 * n + 2 * g;
    w.a = ldh(b + 208);
    w.b = (float)sc[0];
    w.c = (float)sc[1];
  }
}

// dot_q8x<T>(row, u, x, xds) from the sub-block wb_load read: the same integer dot and the same floating-point
// expression (operands and order), so the same bits.
template <int T>
__device__ static inline float wb_dot(const WB &w, const int x[8], float2 xds) {
  if (T == T_Q6_K) {
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) s0 = __dp4a(w.q[i], x[i], s0);
#pragma unroll
    for (int i = 4; i < 8; i++) s1 = __dp4a(w.q[i], x[i], s1);
    return w.a * xds.x * (w.b * (float)s0 + w.c * (float)s1);
  }
  int s = 0;
#pragma unroll
  for (int i = 0; i < 8; i++) s = __dp4a(w.q[i], x[i], s);
  if (T == T_Q4_0) return w.a * (xds.x * (float)s - 8.0f * xds.y);
  if (T == T_Q4_1) return w.a * xds.x * (float)s + w.b * xds.y;
  if (T == T_Q8_0) return w.a * xds.x * (float)s;
  return w.a * w.b * xds.x * (float)s - w.c * w.e * xds.y;   // Q4_K / Q5_K
}

// The NR x NC tile of one thread's partial sums: rows[r]'s sub-blocks u = first, first + STRIDE, ... dotted with
// columns min(c, n_cols - 1) of xq (acc[r][c] += in u order, as strided_rows_dot / k_matvec_q8w sum one row).
template <int T, int NR, int NC, int STRIDE>
__device__ static inline void tile_dot(const uint8_t *const (&rows)[NR], const int8_t *__restrict__ xq, long long xs,
                                       int n_units, int n_cols, int first, float (&acc)[NR][NC]) {
#pragma unroll
  for (int r = 0; r < NR; r++)
#pragma unroll
    for (int c = 0; c < NC; c++) acc[r][c] = 0.f;
  const int n_in = 32 * n_units;
  for (int u = first; u < n_units; u += STRIDE) {
    WB wb[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) wb_load<T>(rows[r], u, wb[r]);
#pragma unroll
    for (int c = 0; c < NC; c++) {
      const int cc = min(c, n_cols - 1);
      int xv[8];
      float2 ds;
      load_x<false>(col_x(xq, xs, cc), col_ds(xq, xs, cc, n_in), u, xv, ds);
#pragma unroll
      for (int r = 0; r < NR; r++) acc[r][c] += wb_dot<T>(wb[r], xv, ds);
    }
  }
}

// The xor butterfly (16, 8, 4, 2, 1) of every value of the tile, the levels interleaved across values (each value
// sees the same sequence of adds as a lone butterfly).
template <int NR, int NC>
__device__ static inline void tile_butterfly(float (&acc)[NR][NC]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
      for (int c = 0; c < NC; c++) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], o);
}

// resid_handoff over columns: after this block stored rows [r0, r0 + nr) of every column of ro.x (column c at
// c * ro.n), count them into their group; the block completing it writes each column's handoff (warp w: columns w,
// w + warps, ...) and resets the counter. Every thread of the block calls it.
__device__ static inline void resid_handoff_cols(const ResidOut &ro, int r0, int nr, int n_cols, long long q8s) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned g = (unsigned)r0 >> 5;
    last = arrive_acq_rel(ro.cnt + g, (unsigned)nr) + nr == 32;
    if (last) ro.cnt[g] = 0;
  }
  __syncthreads();
  if (last) {
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int i = (r0 & ~31) + lane;
    for (int c = threadIdx.x >> 5; c < n_cols; c += nw)
      handoff_store(__ldcg(ro.x + (long long)c * ro.n + i), i, ro.w, ro.xq + c * q8s,
                    ro.ss + (long long)c * (ro.n / 32), ro.n);
  }
}

// ---------------------------------------------------------------- the fused forms: one warp (block) per row
// The QKV product with its RoPE + K/V epilogue, the residual form (with or without the norm handoff) and SwiGLU with a
// handed-off input norm run these kernels: a row's warp sums COLS1_CHUNK columns per pass over its sub-blocks, each
// column's q8_1 block and the weight sub-block loaded per column (dot_q8x), the handed-off scales computed first.
// Register-tile versions of them (k_mvc_q8w / k_mvc_glu with these epilogues) matched the decode kernels launch by
// launch in the kernel tests but not in the default model's short read (docs/cuda.md, "The short read").
#define COLS1_CHUNK 8   // columns summed per pass over a row's sub-blocks (registers); later passes hit L1

// The handed-off input norm's scale of each column (handoff_load / handoff_scale of that column's sums, the decode
// consumers' arithmetic) into sc[c]; warp 0 computes, then the block's barrier (every thread calls it).
__device__ static inline void cols1_input_scales(const NormIn &fn, int n_cols, float *sc) {
  if (fn.ss) {
    if (threadIdx.x < 32) {
      for (int c = 0; c < n_cols; c++) {
        NormIn f = fn;
        f.ss = fn.ss + (long long)c * (fn.dim / 32);
        const HandoffSS h = handoff_load(f);
        const float r = handoff_scale(f, h);
        if (threadIdx.x == 0) sc[c] = r;
      }
    }
    __syncthreads();
  }
}

// Warp per row over n_cols columns (4 warps per block); ROPE: y is qkv and the epilogue writes RoPE'd q / k and k / v
// into the cache at position rope.pos[c] for column c, through page table rope.pt + c * pts; ro.x: the residual
// form (ro.w: with the norm handoff).
template <int T, bool ROPE>
__global__ void __launch_bounds__(128) k_mvc1_q8w(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
                                                 long long xs, float *__restrict__ y, long long ys, int n_out,
                                                 int n_units, long long row_bytes, int n_cols, RopeKV rope, int pts,
                                                 NormIn fn, ResidOut ro, long long ro_q8s) {
  griddep_launch();
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * 4 + wid;
  const uint8_t *wrow = w + (long long)min(row, n_out - 1) * row_bytes;   // past the end: re-read the last row
  if (row < n_out)
    for (long long o = 128LL * lane; o < row_bytes; o += 32 * 128) prefetch_l2(wrow + o);
  griddep_wait();
  __shared__ float isc[COLS_MAX];
  __shared__ float sv[ROPE ? 4 : 1][ROPE ? COLS_MAX : 1];
  cols1_input_scales(fn, n_cols, isc);
  for (int c0 = 0; c0 < n_cols; c0 += COLS1_CHUNK) {
    float acc[COLS1_CHUNK];
#pragma unroll
    for (int k = 0; k < COLS1_CHUNK; k++) acc[k] = 0.f;
    for (int u = lane; u < n_units; u += 32) {
#pragma unroll
      for (int k = 0; k < COLS1_CHUNK; k++) {
        if (c0 + k < n_cols) {
          int xv[8];
          float2 ds;
          load_x<false>(col_x(xq, xs, c0 + k), col_ds(xq, xs, c0 + k, 32 * n_units), u, xv, ds);
          acc[k] += dot_q8x<T>(wrow, u, xv, ds);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < COLS1_CHUNK; k++) {
      const int c = c0 + k;
      if (c >= n_cols) break;
      float v = acc[k];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (fn.ss) v *= isc[c];
      if (ROPE) {
        if (lane == 0) sv[wid][c] = v;
      } else if (lane == 0 && row < n_out) {
        if (ro.x) {
          float *xr = ro.x + (long long)c * n_out + row;
          *xr = *xr + v;
        } else {
          y[(long long)c * ys + row] = v;
        }
      }
    }
  }
  if (ROPE) {
    __syncthreads();
    const int t = threadIdx.x;   // (pair p = t & 1 of the block's two, column t >> 1)
    const int p = t & 1, c = t >> 1, a = blockIdx.x * 4 + 2 * p;
    if (c < n_cols && a < n_out) {
      RopeKV rk = rope;
      rk.pos = rope.pos + c;
      rk.pt = rope.pt + (long long)c * pts;
      const RopePair pp = rope_pair_prepare(rk, a);
      rope_pair_store(rk, pp, y + (long long)c * ys, a, sv[2 * p][c], sv[2 * p + 1][c]);
    }
  } else if (ro.w) {
    resid_handoff_cols(ro, blockIdx.x * 4, 4, n_cols, ro_q8s);
  }
}

// Block of 4 warps per row over n_cols columns (the long-row down projection), plain store or the residual form.
template <int T>
__global__ void __launch_bounds__(128) k_mvc1_q8b(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
                                                 long long xs, float *__restrict__ y, long long ys, int n_out,
                                                 int n_units, long long row_bytes, int n_cols, ResidOut ro,
                                                 long long ro_q8s) {
  griddep_launch();
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const int row = blockIdx.x;
  const uint8_t *wrow = w + (long long)row * row_bytes;
  for (long long o = 128LL * tid; o < row_bytes; o += 128 * 128) prefetch_l2(wrow + o);
  griddep_wait();
  __shared__ float part[4][COLS1_CHUNK];
  for (int c0 = 0; c0 < n_cols; c0 += COLS1_CHUNK) {
    float acc[COLS1_CHUNK];
#pragma unroll
    for (int k = 0; k < COLS1_CHUNK; k++) acc[k] = 0.f;
    for (int u = tid; u < n_units; u += 128) {
#pragma unroll
      for (int k = 0; k < COLS1_CHUNK; k++) {
        if (c0 + k < n_cols) {
          int xv[8];
          float2 ds;
          load_x<false>(col_x(xq, xs, c0 + k), col_ds(xq, xs, c0 + k, 32 * n_units), u, xv, ds);
          acc[k] += dot_q8x<T>(wrow, u, xv, ds);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < COLS1_CHUNK; k++) {
      float v = acc[k];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) part[wid][k] = v;
    }
    __syncthreads();
    if (tid < COLS1_CHUNK && c0 + tid < n_cols) {
      const int c = c0 + tid;
      const float v = (part[0][tid] + part[1][tid]) + (part[2][tid] + part[3][tid]);
      if (ro.x) {
        float *xr = ro.x + (long long)c * n_out + row;
        *xr = *xr + v;
      } else {
        y[(long long)c * ys + row] = v;
      }
    }
    __syncthreads();   // part is reused by the next pass
  }
  if (ro.w) resid_handoff_cols(ro, row, 1, n_cols, ro_q8s);
}

// SwiGLU in the gate / up product over n_cols columns: a block of 8 warps makes 32 consecutive activations of every
// column, each warp 4 of them one after the other (gate row i at wg + i * row_bytes, up row i at wu + ...).
template <int T>
__global__ void __launch_bounds__(256) k_mvc1_glu(const uint8_t *__restrict__ wg, const uint8_t *__restrict__ wu,
                                                 const int8_t *__restrict__ xq, long long xs, float *__restrict__ act,
                                                 int8_t *__restrict__ act_q8, long long aqs, int F, int n_units,
                                                 long long row_bytes, int n_cols, NormIn fn) {
  griddep_launch();
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = blockIdx.x * 32 + wid * 4;
#pragma unroll
  for (int r = 0; r < 4; r++)
    for (long long o = 128LL * lane; o < row_bytes; o += 32 * 128) {
      prefetch_l2(wg + (long long)(i0 + r) * row_bytes + o);
      prefetch_l2(wu + (long long)(i0 + r) * row_bytes + o);
    }
  griddep_wait();
  __shared__ float isc[COLS_MAX];
  __shared__ float sv[COLS_MAX][32];
  cols1_input_scales(fn, n_cols, isc);
  for (int r = 0; r < 4; r++) {
    const int i = i0 + r;
    const uint8_t *g = wg + (long long)i * row_bytes, *up = wu + (long long)i * row_bytes;
    for (int c0 = 0; c0 < n_cols; c0 += COLS1_CHUNK) {
      float ag[COLS1_CHUNK], au[COLS1_CHUNK];
#pragma unroll
      for (int k = 0; k < COLS1_CHUNK; k++) ag[k] = au[k] = 0.f;
      for (int u = lane; u < n_units; u += 32) {
#pragma unroll
        for (int k = 0; k < COLS1_CHUNK; k++) {
          if (c0 + k < n_cols) {
            int xv[8];
            float2 ds;
            load_x<false>(col_x(xq, xs, c0 + k), col_ds(xq, xs, c0 + k, 32 * n_units), u, xv, ds);
            ag[k] += dot_q8x<T>(g, u, xv, ds);
            au[k] += dot_q8x<T>(up, u, xv, ds);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < COLS1_CHUNK; k++) {
        const int c = c0 + k;
        if (c >= n_cols) break;
        float a = ag[k], b = au[k];
        if (fn.ss) {   // handed-off norm: on each lane's partial products, as the decode kernel
          a *= isc[c];
          b *= isc[c];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          a += __shfl_xor_sync(0xffffffffu, a, o);
          b += __shfl_xor_sync(0xffffffffu, b, o);
        }
        if (lane == 0) sv[c][wid * 4 + r] = a / (1.f + expf(-a)) * b;
      }
    }
  }
  __syncthreads();
  const int i = blockIdx.x * 32 + lane;
  for (int c = wid; c < n_cols; c += 8) {
    const float v = sv[c][lane];
    if (act) act[(long long)c * F + i] = v;
    if (act_q8) q8_store(v, i, act_q8 + c * aqs, reinterpret_cast<float2 *>(act_q8 + c * aqs + F));
  }
}

// ---------------------------------------------------------------- the plain products: register tiles
// 4 warps per block, R rows per warp over n_cols columns, y[c] = W xq[c] (k_matvec_q8w without an epilogue). STAGE:
// each warp copies its rows into shared memory (`slot` bytes per warp, dynamic) before the PDL wait and reads them
// there (launch.cuh, "weight staging"); else it prefetches them into L2.
template <int T, int NC, int R, bool STAGE>
__global__ void __launch_bounds__(128) k_mvc_q8w(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
                                                 long long xs, float *__restrict__ y, long long ys, int n_out,
                                                 int n_units, long long row_bytes, int n_cols, int slot) {
  griddep_launch();
  extern __shared__ __align__(16) uint8_t staged[];
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * 4 + wid) * R;
  // rows past the end re-read the last row (not stored): rows [first, max(last, first + 1))
  const int first = min(row0, n_out - 1), last = min(row0 + R, n_out);
  const uint8_t *base = w + (long long)first * row_bytes;
  if (STAGE) {
    base = stage_bytes(base, (long long)max(last - first, 1) * row_bytes, staged + wid * slot, lane, 32);
  } else {
#pragma unroll
    for (int r = 0; r < R; r++)
      if (row0 + r < n_out)
        for (long long o = 128LL * lane; o < row_bytes; o += 32 * 128) prefetch_l2(base + r * row_bytes + o);
  }
  const uint8_t *rows[R];
#pragma unroll
  for (int r = 0; r < R; r++) rows[r] = base + (long long)(min(row0 + r, n_out - 1) - first) * row_bytes;
  griddep_wait();
  if (STAGE) {
    stage_wait();
    __syncwarp();
  }
  float acc[R][NC];
  tile_dot<T, R, NC, 32>(rows, xq, xs, n_units, n_cols, lane, acc);
  tile_butterfly(acc);
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int c = 0; c < NC; c++)
      if (lane == c && c < n_cols && row0 + r < n_out) y[(long long)c * ys + row0 + r] = acc[r][c];
}

// Block of 4 warps per row over n_cols columns (the long-row down projection), y[c] = W xq[c] (k_matvec_q8b without
// the residual form); STAGE: the block copies its row into shared memory before the PDL wait.
template <int T, int NC, bool STAGE>
__global__ void __launch_bounds__(128) k_mvc_q8b(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
                                                 long long xs, float *__restrict__ y, long long ys, int n_out,
                                                 int n_units, long long row_bytes, int n_cols) {
  griddep_launch();
  extern __shared__ __align__(16) uint8_t staged[];
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const int row = blockIdx.x;
  const uint8_t *rows[1] = {w + (long long)row * row_bytes};
  if (STAGE)
    rows[0] = stage_bytes(rows[0], row_bytes, staged, tid, 128);
  else
    for (long long o = 128LL * tid; o < row_bytes; o += 128 * 128) prefetch_l2(rows[0] + o);
  griddep_wait();
  if (STAGE) {
    stage_wait();
    __syncthreads();
  }
  float acc[1][NC];
  tile_dot<T, 1, NC, 128>(rows, xq, xs, n_units, n_cols, tid, acc);
  tile_butterfly(acc);
  __shared__ float part[4][NC];
  if (lane == 0) {
#pragma unroll
    for (int c = 0; c < NC; c++) part[wid][c] = acc[0][c];
  }
  __syncthreads();
  if (tid < n_cols) y[(long long)tid * ys + row] = (part[0][tid] + part[1][tid]) + (part[2][tid] + part[3][tid]);
}

// SwiGLU in the gate / up product over n_cols columns without an input norm (k_matvec_q8w_glu): a block of 8 warps
// makes 32 consecutive activations of every column, each warp 4 of them (gate row i at wg + i * row_bytes, up row i
// at wu + ...), P pairs at a time. STAGE: each warp copies its 4 gate and 4 up rows into shared memory (2 slots of
// `slot` bytes per warp) before the PDL wait.
template <int T, int NC, int P, bool STAGE>
__global__ void __launch_bounds__(256) k_mvc_glu(const uint8_t *__restrict__ wg, const uint8_t *__restrict__ wu,
                                                 const int8_t *__restrict__ xq, long long xs, float *__restrict__ act,
                                                 int8_t *__restrict__ act_q8, long long aqs, int F, int n_units,
                                                 long long row_bytes, int n_cols, int slot) {
  griddep_launch();
  extern __shared__ __align__(16) uint8_t staged[];
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = blockIdx.x * 32 + wid * 4;
  const uint8_t *g = wg + (long long)i0 * row_bytes, *u = wu + (long long)i0 * row_bytes;
  if (STAGE) {
    g = stage_bytes(g, 4 * row_bytes, staged + 2 * wid * slot, lane, 32);
    u = stage_bytes(u, 4 * row_bytes, staged + (2 * wid + 1) * slot, lane, 32);
  } else {
    for (long long o = 128LL * lane; o < 4 * row_bytes; o += 32 * 128) {
      prefetch_l2(g + o);
      prefetch_l2(u + o);
    }
  }
  griddep_wait();
  __shared__ float sv[NC][32];
  if (STAGE) {
    stage_wait();
    __syncwarp();
  }
#pragma unroll
  for (int r0 = 0; r0 < 4; r0 += P) {
    const uint8_t *rows[2 * P];   // gate rows, then up rows
#pragma unroll
    for (int p = 0; p < P; p++) {
      rows[p] = g + (long long)(r0 + p) * row_bytes;
      rows[P + p] = u + (long long)(r0 + p) * row_bytes;
    }
    float acc[2 * P][NC];
    tile_dot<T, 2 * P, NC, 32>(rows, xq, xs, n_units, n_cols, lane, acc);
    tile_butterfly(acc);
#pragma unroll
    for (int p = 0; p < P; p++)
#pragma unroll
      for (int c = 0; c < NC; c++) {
        const float a = acc[p][c], b = acc[P + p][c];
        if (lane == c) sv[c][wid * 4 + r0 + p] = a / (1.f + expf(-a)) * b;
      }
  }
  __syncthreads();
  const int i = blockIdx.x * 32 + lane;
  for (int c = wid; c < n_cols; c += 8) {
    const float v = sv[c][lane];
    if (act) act[(long long)c * F + i] = v;
    if (act_q8) q8_store(v, i, act_q8 + c * aqs, reinterpret_cast<float2 *>(act_q8 + c * aqs + F));
  }
}

// strata_norm_q8's handoff over columns: grid (n / 32, n_cols), one warp per 32-row group of one column.
__global__ void k_mvc_norm_q8(const float *__restrict__ x, const float *__restrict__ w, int8_t *__restrict__ xq,
                              long long q8s, float *__restrict__ ss, int n) {
  griddep_launch();
  griddep_wait();
  const long long c = blockIdx.y;
  const int i = blockIdx.x * 32 + threadIdx.x;
  handoff_store(x[c * n + i], i, w, xq + c * q8s, ss + c * (n / 32), n);
}

extern "C" int strata_mvc_norm_q8(void *stream, const float *x, const float *w, void *x_q8, float *x_ss, int n,
                                  int n_cols) {
  if (!x || !w || !x_q8 || !x_ss || n <= 0 || n % 32 || n_cols < 1 || n_cols > COLS_MAX)
    return (int)cudaErrorInvalidValue;
  if ((uintptr_t)x_q8 & 15) return (int)cudaErrorMisalignedAddress;
  st_launch(k_mvc_norm_q8, dim3(n / 32, n_cols), 32, 0, (cudaStream_t)stream, x, w, (int8_t *)x_q8,
            q8_col_bytes(n), x_ss, n);
  return (int)cudaGetLastError();
}

// The checks every column launcher makes: a dp4a type, n_in whole blocks, 1..COLS_MAX columns, 16-byte aligned
// weights and inputs.
static int cols_check(int t, const void *w, const void *xq, int n_out, int n_in, int n_cols) {
  if (n_cols < 1 || n_cols > COLS_MAX) return (int)cudaErrorInvalidValue;
  return q8_matvec_check(t, w, xq, n_out, n_in);
}

static int cols_norm(const float *ss, float eps, int n_in, NormIn *fn) {
  *fn = NormIn{};
  if (!ss) return 0;
  if (n_in % 32 || n_in > FUSED_NORM_MAX_DIM) return (int)cudaErrorInvalidValue;
  fn->ss = ss;
  fn->eps = eps;
  fn->dim = n_in;
  return 0;
}

// A switch over the compiled column counts: F(NC) with NC the smallest of 2, 3, 4, 5, 8, 16 holding n (3 and 5: a
// speculative verify of 2 or 4 drafts computes no column it does not store).
#define DISPATCH_NC(n, F) \
  if ((n) <= 2) F(2); else if ((n) == 3) F(3); else if ((n) == 4) F(4); else if ((n) == 5) F(5); \
  else if ((n) <= 8) F(8); else F(16);

// Launch kernel k (its staged variant ks, or without room for `smem` bytes of staged rows on this device, the
// L2-prefetching kernel kp) with the kernel's arguments.
#define LAUNCH_STAGED(ks, kp, smem, grid, threads, ...) do { \
    static int oi_[16]; \
    if ((long long)(smem) <= SMEM_PLAIN || (long long)(smem) <= smem_optin(ks, oi_)) \
      st_launch(ks, grid, threads, (size_t)(smem), s, __VA_ARGS__); \
    else \
      st_launch(kp, grid, threads, 0, s, __VA_ARGS__); } while (0)

// The plain products (register tiles).
template <int T>
static void launch_cols_q8w_t(cudaStream_t s, const uint8_t *W, const int8_t *q, float *y, long long ys, int n_out,
                              int n_in, int n_cols) {
  const long long rb = row_bytes_of(T, n_in), xs = q8_col_bytes(n_in);
  const unsigned blocks = (unsigned)((n_out + 3) / 4);
  const long long slot = staged_size(rb);
#define CW(NC) LAUNCH_STAGED((k_mvc_q8w<T, NC, 1, true>), (k_mvc_q8w<T, NC, 1, false>), 4 * slot, blocks, 128, W, q, \
                             xs, y, ys, n_out, n_in / 32, rb, n_cols, (int)slot)
  DISPATCH_NC(n_cols, CW)
#undef CW
}

template <int T>
static void launch_cols_q8b_t(cudaStream_t s, const uint8_t *W, const int8_t *q, float *y, long long ys, int n_out,
                              int n_in, int n_cols) {
  const long long rb = row_bytes_of(T, n_in), xs = q8_col_bytes(n_in);
#define CB(NC) LAUNCH_STAGED((k_mvc_q8b<T, NC, true>), (k_mvc_q8b<T, NC, false>), staged_size(rb), (unsigned)n_out, \
                             128, W, q, xs, y, ys, n_out, n_in / 32, rb, n_cols)
  DISPATCH_NC(n_cols, CB)
#undef CB
}

// Pairs per pass of k_mvc_glu for NC columns: 2 * P * NC partial sums in registers.
#define GLU_P(NC) ((NC) <= 4 ? 4 : (NC) <= 8 ? 2 : 1)

template <int T>
static void launch_cols_glu_t(cudaStream_t s, const uint8_t *G, const uint8_t *U, const int8_t *q, float *act,
                              int8_t *aq, int F, int n_in, int n_cols) {
  const long long rb = row_bytes_of(T, n_in), xs = q8_col_bytes(n_in), aqs = q8_col_bytes(F);
  const long long slot = staged_size(4 * rb);
#define CG(NC) LAUNCH_STAGED((k_mvc_glu<T, NC, GLU_P(NC), true>), (k_mvc_glu<T, NC, GLU_P(NC), false>), \
                             16 * slot, (unsigned)(F / 32), 256, G, U, q, xs, act, aq, aqs, F, n_in / 32, rb, n_cols, \
                             (int)slot)
  DISPATCH_NC(n_cols, CG)
#undef CG
}

// The fused forms (one warp / block per row): the QKV product with its RoPE epilogue and the residual form.
template <bool ROPE>
static int launch_cols1_q8w(cudaStream_t s, int t, const uint8_t *W, const int8_t *q, float *y, long long ys,
                            int n_out, int n_in, int n_cols, const RopeKV &rk, int pts, const NormIn &fn,
                            const ResidOut &ro) {
  const long long rb = row_bytes_of(t, n_in), xs = q8_col_bytes(n_in), oq = ro.w ? q8_col_bytes(ro.n) : 0;
  const unsigned blocks = (unsigned)((n_out + 3) / 4);
#define CW(TT) st_launch(k_mvc1_q8w<TT, ROPE>, blocks, 128, 0, s, W, q, xs, y, ys, n_out, n_in / 32, rb, n_cols, rk, \
                         pts, fn, ro, oq)
  DISPATCH_Q8_TYPE(t, CW)
#undef CW
  return (int)cudaGetLastError();
}

extern "C" int strata_mvc_q8w(void *stream, int t, const void *w, const void *xq, float *y, int y_stride, int n_out,
                              int n_in, int n_cols) {
  if (const int e = cols_check(t, w, xq, n_out, n_in, n_cols)) return e;
  if (!y || y_stride < n_out) return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
  const int8_t *q = (const int8_t *)xq;
#define CT(TT) launch_cols_q8w_t<TT>(s, W, q, y, (long long)y_stride, n_out, n_in, n_cols)
  DISPATCH_Q8_TYPE(t, CT)
#undef CT
  return (int)cudaGetLastError();
}

extern "C" int strata_mvc_q8_resid(void *stream, int t, const void *w, const void *xq, int n_out, int n_in, int n_cols,
                                   int block, float *x, const float *norm_w, void *x_q8, float *x_ss,
                                   unsigned *counters) {
  if (const int e = cols_check(t, w, xq, n_out, n_in, n_cols)) return e;
  if (!x || (norm_w && (!x_q8 || !x_ss || !counters || n_out % 32))) return (int)cudaErrorInvalidValue;
  if ((uintptr_t)x_q8 & 15) return (int)cudaErrorMisalignedAddress;
  const ResidOut ro{x, norm_w, (int8_t *)x_q8, x_ss, counters, n_out};
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
  const int8_t *q = (const int8_t *)xq;
  if (!block)
    return launch_cols1_q8w<false>(s, t, W, q, nullptr, 0, n_out, n_in, n_cols, RopeKV{}, 0, NormIn{}, ro);
  const long long rb = row_bytes_of(t, n_in), xs = q8_col_bytes(n_in), oq = norm_w ? q8_col_bytes(n_out) : 0;
#define CB(TT) st_launch(k_mvc1_q8b<TT>, (unsigned)n_out, 128, 0, s, W, q, xs, (float *)nullptr, 0LL, n_out, \
                         n_in / 32, rb, n_cols, ro, oq)
  DISPATCH_Q8_TYPE(t, CB)
#undef CB
  return (int)cudaGetLastError();
}

extern "C" int strata_mvc_q8b(void *stream, int t, const void *w, const void *xq, float *y, int y_stride, int n_out,
                              int n_in, int n_cols) {
  if (const int e = cols_check(t, w, xq, n_out, n_in, n_cols)) return e;
  if (!y || y_stride < n_out) return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
  const int8_t *q = (const int8_t *)xq;
#define CT(TT) launch_cols_q8b_t<TT>(s, W, q, y, (long long)y_stride, n_out, n_in, n_cols)
  DISPATCH_Q8_TYPE(t, CT)
#undef CT
  return (int)cudaGetLastError();
}

extern "C" int strata_mvc_q8w_rope(void *stream, int t, const void *w, const void *xq, float *qkv, int n_head,
                                   int n_kv, int hd, int n_in, int n_cols, const int *pos, void *k_cache,
                                   void *v_cache, const int *page_table, int pt_stride, int n_rot, float base,
                                   int page_size, float eps, const float *norm_ss) {
  const int n_out = (n_head + 2 * n_kv) * hd;
  if (n_head <= 0 || n_kv <= 0 || hd <= 0 || hd % 2 || n_rot > hd || n_rot % 2 || n_rot < 0 || page_size <= 0 ||
      pt_stride < 0 ||
      !pos || !k_cache || !v_cache || !page_table || !qkv)
    return (int)cudaErrorInvalidValue;
  if (const int e = cols_check(t, w, xq, n_out, n_in, n_cols)) return e;
  NormIn fn;
  if (const int e = cols_norm(norm_ss, eps, n_in, &fn)) return e;
  const RopeKV rk{pos, page_table, (__half *)k_cache, (__half *)v_cache, n_head, n_kv, hd, n_rot, page_size, base, 0};
  return launch_cols1_q8w<true>((cudaStream_t)stream, t, (const uint8_t *)w, (const int8_t *)xq, qkv, n_out, n_out,
                                n_in, n_cols, rk, pt_stride, fn, ResidOut{});
}

extern "C" int strata_mvc_q8w_glu(void *stream, int t, const void *w_gate, const void *w_up, const void *xq,
                                  float *act, void *act_q8, int F, int n_in, int n_cols, float eps,
                                  const float *norm_ss) {
  if (const int e = cols_check(t, w_gate, xq, F, n_in, n_cols)) return e;
  if (F % 32 || !w_up || (!act && !act_q8)) return (int)cudaErrorInvalidValue;
  if (((uintptr_t)w_up & 15) || ((uintptr_t)act_q8 & 15)) return (int)cudaErrorMisalignedAddress;
  NormIn fn;
  if (const int e = cols_norm(norm_ss, eps, n_in, &fn)) return e;
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *G = (const uint8_t *)w_gate, *U = (const uint8_t *)w_up;
  const int8_t *q = (const int8_t *)xq;
  int8_t *aq = (int8_t *)act_q8;
  if (!fn.ss) {   // no input norm: the register tiles
#define CT(TT) launch_cols_glu_t<TT>(s, G, U, q, act, aq, F, n_in, n_cols)
    DISPATCH_Q8_TYPE(t, CT)
#undef CT
    return (int)cudaGetLastError();
  }
  const long long rb = row_bytes_of(t, n_in), xs = q8_col_bytes(n_in), aqs = q8_col_bytes(F);
#define CG(TT) st_launch(k_mvc1_glu<TT>, (unsigned)(F / 32), 256, 0, s, G, U, q, xs, act, aq, aqs, F, n_in / 32, rb, \
                         n_cols, fn)
  DISPATCH_Q8_TYPE(t, CG)
#undef CG
  return (int)cudaGetLastError();
}
