// matvec_cols.cu: the short read's matvecs over n columns (n new tokens of one sequence; the same kernels serve one
// token of each of several sequences): each weight row is read from memory once for all columns, and each column is
// reduced exactly as the decode matvec it mirrors (matvec_fused.cu) reduces its one vector, so column c is
// bit-identical to that decode launch on column c alone.
//
// What "exactly" means, kernel by kernel (the decode kernel's own structure, with its rows-per-warp R = 1, which
// changes nothing per row: R only shares an x block between rows):
// * k_mvc_q8w mirrors k_matvec_q8w: one warp per row, lane l sums dot_q8x over sub-blocks u = l, l + 32, ... in that
//   order into one float, then the xor butterfly (16, 8, 4, 2, 1); a handed-off input norm scales the sum after the
//   butterfly; the RoPE + K/V epilogue is rope_pair_prepare / rope_pair_store on the pair's two sums; the residual
//   form stores x + v and hands off the next norm (handoff_store) from the block completing a 32-row group.
// * k_mvc_q8b mirrors k_matvec_q8b: one block of 4 warps per row, thread t sums u = t, t + 128, ..., each warp's
//   butterfly, then (w0 + w1) + (w2 + w3).
// * k_mvc_glu mirrors k_matvec_q8w_glu: one warp per (gate, up) pair, the handed-off scale on each lane's partial
//   sums before the butterfly, silu(a) * b as a / (1 + expf(-a)) * b, the q8_1 block of 32 activations by q8_store.
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
#define COLS_CHUNK 8    // columns summed per pass over a row's sub-blocks (registers); later passes hit L1

static inline long long q8_col_bytes(int n) { return ((long long)n + n / 4 + 15) / 16 * 16; }

extern "C" int strata_q8_col_bytes(int n) { return n > 0 && n % 32 == 0 ? (int)q8_col_bytes(n) : -1; }

// Column c's q8_1 blocks: its int8 values and (d, d * sum) pairs.
__device__ static inline const int *col_x(const int8_t *xq, long long stride, int c) {
  return reinterpret_cast<const int *>(xq + c * stride);
}
__device__ static inline const float2 *col_ds(const int8_t *xq, long long stride, int c, int n) {
  return reinterpret_cast<const float2 *>(xq + c * stride + n);
}

// The handed-off input norm's scale of each column (handoff_load / handoff_scale of that column's sums, the decode
// consumers' arithmetic) into sc[c]; warp 0 computes, then the block's barrier (every thread calls it).
__device__ static inline void cols_input_scales(const NormIn &fn, int n_cols, float *sc) {
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

// Warp per row over n_cols columns (4 warps per block); ROPE: y is qkv and the epilogue writes RoPE'd q / k and k / v
// into the cache at position rope.pos[c] for column c, through page table rope.pt + c * pts; ro.x: the residual
// form (ro.w: with the norm handoff).
template <int T, bool ROPE>
__global__ void __launch_bounds__(128) k_mvc_q8w(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
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
  cols_input_scales(fn, n_cols, isc);
  for (int c0 = 0; c0 < n_cols; c0 += COLS_CHUNK) {
    float acc[COLS_CHUNK];
#pragma unroll
    for (int k = 0; k < COLS_CHUNK; k++) acc[k] = 0.f;
    for (int u = lane; u < n_units; u += 32) {
#pragma unroll
      for (int k = 0; k < COLS_CHUNK; k++) {
        if (c0 + k < n_cols) {
          int xv[8];
          float2 ds;
          load_x<false>(col_x(xq, xs, c0 + k), col_ds(xq, xs, c0 + k, 32 * n_units), u, xv, ds);
          acc[k] += dot_q8x<T>(wrow, u, xv, ds);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < COLS_CHUNK; k++) {
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
__global__ void __launch_bounds__(128) k_mvc_q8b(const uint8_t *__restrict__ w, const int8_t *__restrict__ xq,
                                                 long long xs, float *__restrict__ y, long long ys, int n_out,
                                                 int n_units, long long row_bytes, int n_cols, ResidOut ro,
                                                 long long ro_q8s) {
  griddep_launch();
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const int row = blockIdx.x;
  const uint8_t *wrow = w + (long long)row * row_bytes;
  for (long long o = 128LL * tid; o < row_bytes; o += 128 * 128) prefetch_l2(wrow + o);
  griddep_wait();
  __shared__ float part[4][COLS_CHUNK];
  for (int c0 = 0; c0 < n_cols; c0 += COLS_CHUNK) {
    float acc[COLS_CHUNK];
#pragma unroll
    for (int k = 0; k < COLS_CHUNK; k++) acc[k] = 0.f;
    for (int u = tid; u < n_units; u += 128) {
#pragma unroll
      for (int k = 0; k < COLS_CHUNK; k++) {
        if (c0 + k < n_cols) {
          int xv[8];
          float2 ds;
          load_x<false>(col_x(xq, xs, c0 + k), col_ds(xq, xs, c0 + k, 32 * n_units), u, xv, ds);
          acc[k] += dot_q8x<T>(wrow, u, xv, ds);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < COLS_CHUNK; k++) {
      float v = acc[k];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) part[wid][k] = v;
    }
    __syncthreads();
    if (tid < COLS_CHUNK && c0 + tid < n_cols) {
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
__global__ void __launch_bounds__(256) k_mvc_glu(const uint8_t *__restrict__ wg, const uint8_t *__restrict__ wu,
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
  cols_input_scales(fn, n_cols, isc);
  for (int r = 0; r < 4; r++) {
    const int i = i0 + r;
    const uint8_t *g = wg + (long long)i * row_bytes, *up = wu + (long long)i * row_bytes;
    for (int c0 = 0; c0 < n_cols; c0 += COLS_CHUNK) {
      float ag[COLS_CHUNK], au[COLS_CHUNK];
#pragma unroll
      for (int k = 0; k < COLS_CHUNK; k++) ag[k] = au[k] = 0.f;
      for (int u = lane; u < n_units; u += 32) {
#pragma unroll
        for (int k = 0; k < COLS_CHUNK; k++) {
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
      for (int k = 0; k < COLS_CHUNK; k++) {
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

template <bool ROPE>
static int launch_cols_q8w(cudaStream_t s, int t, const uint8_t *W, const int8_t *q, float *y, long long ys, int n_out,
                           int n_in, int n_cols, const RopeKV &rk, int pts, const NormIn &fn,
                           const ResidOut &ro) {
  const long long rb = row_bytes_of(t, n_in), xs = q8_col_bytes(n_in), oq = ro.w ? q8_col_bytes(ro.n) : 0;
  const unsigned blocks = (unsigned)((n_out + 3) / 4);
#define CW(TT) st_launch(k_mvc_q8w<TT, ROPE>, blocks, 128, 0, s, W, q, xs, y, ys, n_out, n_in / 32, rb, n_cols, rk, \
                         pts, fn, ro, oq)
  DISPATCH_Q8_TYPE(t, CW)
#undef CW
  return (int)cudaGetLastError();
}

extern "C" int strata_mvc_q8w(void *stream, int t, const void *w, const void *xq, float *y, int y_stride, int n_out,
                              int n_in, int n_cols) {
  if (const int e = cols_check(t, w, xq, n_out, n_in, n_cols)) return e;
  if (!y || y_stride < n_out) return (int)cudaErrorInvalidValue;
  return launch_cols_q8w<false>((cudaStream_t)stream, t, (const uint8_t *)w, (const int8_t *)xq, y, y_stride, n_out,
                                n_in, n_cols, RopeKV{}, 0, NormIn{}, ResidOut{});
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
    return launch_cols_q8w<false>(s, t, W, q, nullptr, 0, n_out, n_in, n_cols, RopeKV{}, 0, NormIn{}, ro);
  const long long rb = row_bytes_of(t, n_in), xs = q8_col_bytes(n_in), oq = norm_w ? q8_col_bytes(n_out) : 0;
#define CB(TT) st_launch(k_mvc_q8b<TT>, (unsigned)n_out, 128, 0, s, W, q, xs, (float *)nullptr, 0LL, n_out, n_in / 32, \
                         rb, n_cols, ro, oq)
  DISPATCH_Q8_TYPE(t, CB)
#undef CB
  return (int)cudaGetLastError();
}

extern "C" int strata_mvc_q8b(void *stream, int t, const void *w, const void *xq, float *y, int y_stride, int n_out,
                              int n_in, int n_cols) {
  if (const int e = cols_check(t, w, xq, n_out, n_in, n_cols)) return e;
  if (!y || y_stride < n_out) return (int)cudaErrorInvalidValue;
  const long long rb = row_bytes_of(t, n_in), xs = q8_col_bytes(n_in);
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *W = (const uint8_t *)w;
  const int8_t *q = (const int8_t *)xq;
#define CB(TT) st_launch(k_mvc_q8b<TT>, (unsigned)n_out, 128, 0, s, W, q, xs, y, (long long)y_stride, n_out, \
                         n_in / 32, rb, n_cols, ResidOut{}, 0LL)
  DISPATCH_Q8_TYPE(t, CB)
#undef CB
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
  return launch_cols_q8w<true>((cudaStream_t)stream, t, (const uint8_t *)w, (const int8_t *)xq, qkv, n_out, n_out, n_in,
                               n_cols, rk, pt_stride, fn, ResidOut{});
}

extern "C" int strata_mvc_q8w_glu(void *stream, int t, const void *w_gate, const void *w_up, const void *xq,
                                  float *act, void *act_q8, int F, int n_in, int n_cols, float eps,
                                  const float *norm_ss) {
  if (const int e = cols_check(t, w_gate, xq, F, n_in, n_cols)) return e;
  if (F % 32 || !w_up || (!act && !act_q8)) return (int)cudaErrorInvalidValue;
  if (((uintptr_t)w_up & 15) || ((uintptr_t)act_q8 & 15)) return (int)cudaErrorMisalignedAddress;
  NormIn fn;
  if (const int e = cols_norm(norm_ss, eps, n_in, &fn)) return e;
  const long long rb = row_bytes_of(t, n_in), xs = q8_col_bytes(n_in), aqs = q8_col_bytes(F);
  cudaStream_t s = (cudaStream_t)stream;
  const uint8_t *G = (const uint8_t *)w_gate, *U = (const uint8_t *)w_up;
  const int8_t *q = (const int8_t *)xq;
  int8_t *aq = (int8_t *)act_q8;
#define CG(TT) st_launch(k_mvc_glu<TT>, (unsigned)(F / 32), 256, 0, s, G, U, q, xs, act, aq, aqs, F, n_in / 32, rb, \
                         n_cols, fn)
  DISPATCH_Q8_TYPE(t, CG)
#undef CG
  return (int)cudaGetLastError();
}
