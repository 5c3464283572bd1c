// sampling.cu: token selection on the device: the one-block sampler, the grammar mask, argmax; the position counter.
/* Sampling on the device in one block: penalties -> top-k -> top-p -> min-p -> temperature -> draw
 * (strata/sampling_device.py's DeviceSampler chain, llama.cpp src/llama-sampling.cpp order), so a decode step
 * copies 8 bytes to the host instead of the logits.
 *
 * strata_sample(stream, logits, counts, n, rp, fp, pp, temperature, top_k, top_p (double), min_p, log_min_p, u, out):
 *   logits f32 (n); counts f32 (n) token occurrences in the penalty window, or NULL (no penalties);
 *   log_min_p = (float)log(min_p) (ignored when min_p == 0); u in [0, 1) the draw (strata.sampling_device.uniform);
 *   out int32[2] <- {token, status}: status 0 ok, 1 NaN in the logits, 2 the candidate set does not fit the
 *   kernel's 2048-entry buffer (the caller then runs DeviceSampler's array path; token is then -1).
 * Arithmetic: the penalties, the temperature division and the min-p threshold are IEEE float32 (__f*_rn, so
 * --use_fast_math does not change them), softmax sums float64, as the numpy/CuPy path. Ties: lower id first.
 * Returns the launch's cudaError_t.
 */
#include <cuda_runtime.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <math.h>
#include <stdint.h>
#include "strata_cuda.h"
#include "launch.cuh"

namespace {

constexpr int NT = 1024;        // threads in the one block
constexpr int CAP = 2048;       // candidate buffer (2 per thread)

__device__ __forceinline__ float penalized(const float *x, const float *c, int i, float rp, float fp, float pp) {
    float v = x[i];
    if (c != nullptr) {
        float ci = c[i];
        if (ci > 0.f) {
            v = v <= 0.f ? __fmul_rn(v, rp) : __fdiv_rn(v, rp);
            v = __fsub_rn(v, __fadd_rn(__fmul_rn(ci, fp), pp));
        }
    }
    return v == 0.f ? 0.f : v;   // -0 -> +0 (numpy compares them equal; the radix keys would not)
}

__device__ __forceinline__ uint32_t fkey(float f) {   // order-preserving float -> uint32 (no NaN here)
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float kfloat(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// a before b in the chain's order: value descending, id ascending
__device__ __forceinline__ bool before(float va, int ia, float vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}

struct ArgMax {
    float v; int i;
};
struct ArgMaxOp {
    __device__ __forceinline__ ArgMax operator()(const ArgMax &a, const ArgMax &b) const {
        if (isnan(a.v)) return a;            // NaN wins (flags the input)
        if (isnan(b.v)) return b;
        return before(a.v, a.i, b.v, b.i) ? a : b;
    }
};

using ReduceInt = cub::BlockReduce<int, NT>;
using ReduceDbl = cub::BlockReduce<double, NT>;
using ReduceArg = cub::BlockReduce<ArgMax, NT>;
using ScanDbl = cub::BlockScan<double, NT>;

__global__ void __launch_bounds__(NT) sample_kernel(const float *__restrict__ x, const float *__restrict__ cnt, int n,
                                                    float rp, float fp, float pp, float temp, int top_k, double top_p,
                                                    float min_p, float log_min_p, double u, int *out) {
    __shared__ union {
        typename ReduceInt::TempStorage ri;
        typename ReduceDbl::TempStorage rd;
        typename ReduceArg::TempStorage ra;
        typename ScanDbl::TempStorage sd;
    } tmp;
    __shared__ float bv[CAP];
    __shared__ int bi[CAP];
    __shared__ int hist[256];
    __shared__ float s_mx;
    __shared__ int s_i, s_n, s_int;
    __shared__ double s_dbl;
    const int t = threadIdx.x;
    const int K = (top_k > 0 && top_k < n) ? top_k : n;

    // pass A: max / argmax (ties -> lowest id), NaN
    ArgMax best{-INFINITY, 0x7fffffff};
    for (int i = t; i < n; i += NT) {
        ArgMax a{penalized(x, cnt, i, rp, fp, pp), i};
        best = ArgMaxOp()(best, a);
    }
    best = ReduceArg(tmp.ra).Reduce(best, ArgMaxOp());
    if (t == 0) {
        s_mx = best.v;
        s_i = best.i;
    }
    __syncthreads();
    const float mx = s_mx;
    if (isnan(mx)) {
        if (t == 0) { out[0] = -1; out[1] = 1; }
        return;
    }
    if (temp == 0.f) {
        if (t == 0) { out[0] = s_i; out[1] = 0; }
        return;
    }
    const float thr = min_p > 0.f ? __fadd_rn(mx, log_min_p) : -INFINITY;

    // pass B: tokens >= the min-p threshold, and the whole-vocabulary mass when top-k is off
    int c_min = 0;
    double full = 0.0;
    for (int i = t; i < n; i += NT) {
        float v = penalized(x, cnt, i, rp, fp, pp);
        c_min += v >= thr;
        if (K == n && top_p < 1.0) full += exp((double)__fsub_rn(v, mx));
    }
    c_min = ReduceInt(tmp.ri).Sum(c_min);
    __syncthreads();
    if (K == n && top_p < 1.0) full = ReduceDbl(tmp.rd).Sum(full);
    __syncthreads();
    if (t == 0) { s_n = c_min; s_dbl = full; }
    __syncthreads();
    c_min = s_n;
    full = s_dbl;

    // the gather threshold: the min-p threshold when everything it keeps fits and decides top-p's normalization,
    // else the R-th largest value (radix select, 8 bits a pass), R = min(K, CAP)
    const bool by_min_p = min_p > 0.f && c_min <= CAP && (top_p >= 1.0 || K == n || c_min >= K);
    float gate = thr;
    if (!by_min_p) {
        int remaining = K < CAP ? K : CAP;
        uint32_t prefix = 0, mask = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = t; b < 256; b += NT) hist[b] = 0;
            __syncthreads();
            for (int i = t; i < n; i += NT) {
                uint32_t k = fkey(penalized(x, cnt, i, rp, fp, pp));
                if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1);
            }
            __syncthreads();
            if (t == 0) {
                int acc = 0, d = 255;
                for (; d > 0; --d) {
                    if (acc + hist[d] >= remaining) break;
                    acc += hist[d];
                }
                s_int = d;
                s_n = remaining - acc;
            }
            __syncthreads();
            prefix |= (uint32_t)s_int << shift;
            mask |= 255u << shift;
            remaining = s_n;
            __syncthreads();
        }
        gate = kfloat(prefix);
    }

    // gather everything >= gate into the buffer (any order), then sort it by (value desc, id asc)
    __syncthreads();
    if (t == 0) s_n = 0;
    for (int b = t; b < CAP; b += NT) { bv[b] = -INFINITY; bi[b] = 0x7fffffff; }
    __syncthreads();
    for (int i = t; i < n; i += NT) {
        float v = penalized(x, cnt, i, rp, fp, pp);
        if (v >= gate) {
            int slot = atomicAdd(&s_n, 1);
            if (slot < CAP) { bv[slot] = v; bi[slot] = i; }
        }
    }
    __syncthreads();
    const int B = s_n;
    if (B > CAP) {                           // ties at the gate overflow the buffer
        if (t == 0) { out[0] = -1; out[1] = 2; }
        return;
    }
    for (int size = 2; size <= CAP; size <<= 1) {        // bitonic sort, best first
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int a = t; a < CAP; a += NT) {
                int b = a ^ stride;
                if (b > a) {
                    bool up = (a & size) == 0;
                    bool swap = up ? before(bv[b], bi[b], bv[a], bi[a]) : before(bv[a], bi[a], bv[b], bi[b]);
                    if (swap) {
                        float fv = bv[a]; bv[a] = bv[b]; bv[b] = fv;
                        int iv = bi[a]; bi[a] = bi[b]; bi[b] = iv;
                    }
                }
            }
            __syncthreads();
        }
    }

    // the kept prefix length L = min(top-k, top-p, min-p), each only where the buffer decides it
    const int INF = 0x7fffffff;
    const bool all_topk = K <= B;                         // the buffer holds the whole top-k set (sorted)
    const int span = all_topk ? K : B;
    int L = all_topk ? K : INF;
    if (top_p < 1.0) {
        double total;
        bool known = true;
        if (K == n) total = full;
        else if (all_topk) {
            double s = 0.0;
            for (int a = t; a < K; a += NT) s += exp((double)__fsub_rn(bv[a], mx));
            __syncthreads();
            total = ReduceDbl(tmp.rd).Sum(s);
            __syncthreads();
            if (t == 0) s_dbl = total;
            __syncthreads();
            total = s_dbl;
        } else {
            known = false;
            total = 1.0;
        }
        if (!known) {
            if (t == 0) { out[0] = -1; out[1] = 2; }
            return;
        }
        // cum_i = sum_{j <= i} e_j / total over the first span entries; last = #(cum < top_p) + 1
        double e[2];
        for (int j = 0; j < 2; ++j) {
            int a = 2 * t + j;
            e[j] = a < span ? exp((double)__fsub_rn(bv[a], mx)) / total : 0.0;
        }
        __syncthreads();
        ScanDbl(tmp.sd).InclusiveSum(e, e);
        int below = 0;
        for (int j = 0; j < 2; ++j) below += (2 * t + j < span) && e[j] < top_p;
        __syncthreads();
        below = ReduceInt(tmp.ri).Sum(below);
        __syncthreads();
        if (t == 0) s_n = below;
        __syncthreads();
        below = s_n;
        if (below < span) L = min(L, below + 1);          // reached within the buffer
        else if (all_topk) L = min(L, span);              // rounding: the whole top-k set (host: searchsorted end)
    }
    if (min_p > 0.f) {
        int keep = 0;
        for (int a = t; a < B; a += NT) keep += bv[a] >= thr;
        __syncthreads();
        keep = ReduceInt(tmp.ri).Sum(keep);
        __syncthreads();
        if (t == 0) s_n = keep;
        __syncthreads();
        keep = max(s_n, 1);
        if (keep < B || by_min_p) L = min(L, keep);     // the buffer shows where min-p cuts
    }
    if (L == INF || L > B) {
        if (t == 0) { out[0] = -1; out[1] = 2; }
        return;
    }

    // draw: w_i = exp(x_i / T - x_0 / T) (float32 division and difference, float64 exp) over the first L
    const float l0 = __fdiv_rn(bv[0], temp);
    double w[2];
    for (int j = 0; j < 2; ++j) {
        int a = 2 * t + j;
        w[j] = a < L ? exp((double)__fsub_rn(__fdiv_rn(bv[a], temp), l0)) : 0.0;
    }
    __syncthreads();
    ScanDbl(tmp.sd).InclusiveSum(w, w);
    __syncthreads();
    if (2 * t + 1 == L - 1 || (2 * t == L - 1)) s_dbl = (2 * t == L - 1) ? w[0] : w[1];
    __syncthreads();
    const double target = s_dbl * u;
    int j = 0;
    for (int q = 0; q < 2; ++q) j += (2 * t + q < L) && w[q] <= target;
    __syncthreads();
    j = ReduceInt(tmp.ri).Sum(j);
    if (t == 0) {
        j = min(j, L - 1);
        out[0] = bi[j];
        out[1] = 0;
    }
}

}  // namespace

extern "C" int strata_sample(void *stream, const float *logits, const float *counts, int n, float repeat_penalty,
                             float frequency_penalty, float presence_penalty, float temperature, int top_k,
                             double top_p, float min_p, float log_min_p, double u, int *out) {
    if (n <= 0) return (int)cudaErrorInvalidValue;
    sample_kernel<<<1, NT, 0, (cudaStream_t)stream>>>(logits, counts, n, repeat_penalty, frequency_penalty,
                                                      presence_penalty, temperature, top_k, top_p, min_p, log_min_p,
                                                      u, out);
    return (int)cudaGetLastError();
}

/* The token mask of constrained decoding (strata/grammar.py): out[i] = logits[i] where bit (i & 31) of words[i >> 5]
 * is set, else -inf; one thread per token. words: the grammar's packed allow-list (n_vocab bits, little-endian
 * words), copied up from pinned memory on the same stream. out may be logits (in place). */
namespace {
__global__ void apply_mask_kernel(const float *logits, const unsigned int *words, int n, float *out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ((words[i >> 5] >> (i & 31)) & 1u) ? logits[i] : -INFINITY;
}
}  // namespace

extern "C" int strata_apply_mask(void *stream, const float *logits, const unsigned int *words, int n, float *out) {
    if (n <= 0) return (int)cudaErrorInvalidValue;
    apply_mask_kernel<<<(n + 255) / 256, 256, 0, (cudaStream_t)stream>>>(logits, words, n, out);
    return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- argmax
__global__ void k_argmax(const float *x, int *out, int n) {
  griddep_launch();
  KT(KT_ARGMAX, KT_START);
  griddep_wait();
  KT(KT_ARGMAX, KT_WAITED);
  __shared__ float sv[32];
  __shared__ int si[32];
  const float *row = x + (long long)blockIdx.x * n;
  float best = -INFINITY;
  int bi = 0x7fffffff;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float v = row[j];
    if (v > best) { best = v; bi = j; }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
  }
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) { sv[wid] = best; si[wid] = bi; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < nw; i++)
      if (sv[i] > best || (sv[i] == best && si[i] < bi)) { best = sv[i]; bi = si[i]; }
    out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
  }
}

extern "C" int strata_argmax(void *stream, const float *x, int *out, int n_rows, int n) {
  if (n_rows <= 0) return 0;
  st_launch(k_argmax, n_rows, 1024, 0, (cudaStream_t)stream, x, out, n);
  return (int)cudaGetLastError();
}

__global__ void k_add_scalar(int *p, int delta, int count) {
  griddep_launch();
  griddep_wait();
  const int i = threadIdx.x;
  if (i < count) p[i] += delta;
}

extern "C" int strata_add_scalar(void *stream, int *p, int delta, int count) {
  st_launch(k_add_scalar, 1, 32, 0, (cudaStream_t)stream, p, delta, count);
  return (int)cudaGetLastError();
}

