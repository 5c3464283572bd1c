// The persistent decode step of the llama architecture: one cooperative kernel takes a token through every layer,
// its phases separated by grid-wide barriers instead of kernel launches.
//
// Per layer, each phase spread over all blocks (ST_THREADS threads each, one or more per SM):
//   A  RMSNorm (every block normalizes the residual row itself into shared memory as q8_1 blocks), the Q / K / V
//      matvec in groups of two RoPE pairs per warp, RoPE applied by the warp that holds both rows of a pair, q
//      written to q, k and v written to the layer's f16 cache at position pos;
//   B  GQA decode attention over len positions (attn_decode.cuh's body: (KV head, split) items over the blocks,
//      the last split of a head merging them), output f32 and q8_1;
//   C  output projection from the q8_1 attention output, residual added by the warp that owns the row;
//   D  RMSNorm, gate / up matvec and SwiGLU: a block takes 32 consecutive FFN rows and stores their q8_1 block;
//   E  down projection from those q8_1 blocks, residual added.
// Then the final RMSNorm, the output head (logits f32) and the argmax (packed (value, index) atomicMax, lowest index
// on ties, as strata_argmax), written to inp[0] with pos and len advanced, as LlamaCuda's captured step does.
// The arithmetic is that of the launch-per-op plan (strata_kernels.cu's
// dp4a matvec on q8_1 activations, the same RoPE angles, the same attention body); sums run in another order.
// Barrier: Cooperative Groups' grid sync scheme (CUDA C++ Programming Guide, "Grid Synchronization") on a 64-bit
// arrival counter that is never reset (each barrier waits for the next multiple of the grid size).
//
// Opt-in (STRATA_CUDA_STEP=1): on the H200 it is slower than the launch-per-op graph (1.7B Q4_K llama: 716 vs 1018
// tok/s at depth 0, same run). Nsight Compute: its registers per thread leave 2 warps per scheduler (12.5%
// occupancy), each waiting ~12 cycles per instruction, so the dp4a matvec phases run at 12% of DRAM bandwidth
// (gate / up 19 us and the head 36 us, against ~8 and ~19 us as separate kernels at full occupancy). Measured
// and dropped: L2 prefetch of the next phase's weights (720 vs 701 tok/s: noise), cp.async streaming of each
// block's rows into shared memory (slower: 466 tok/s), 4 blocks per SM (register spills, slower), the dot inlined
// (slower).
// See docs/cuda.md.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"
#include "quant.cuh"
#include "q8.cuh"
#include "attn_decode.cuh"

#define ST_THREADS (32 * DA_WARPS)   // the attention body's block size
#define ST_WARPS DA_WARPS
// Blocks per SM the register allocation must allow: 2 (255 registers per thread with CUDA 13, no spills). 4 (<= 128)
// spills ~0.5 KB per thread and was slower on the H200 (490 vs 701 tok/s on the 1.7B model).
#define ST_MIN_BLOCKS 2

__device__ __forceinline__ unsigned long long ld_acquire_u64(const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Every block of the grid arrives before any leaves; writes before it are visible (through L2) after it. With a
// trace buffer, block 0 records when it arrived at barrier k (k = 1, 2, ...) in trace[2k - 1] and when it left it
// in trace[2k]; trace[0]: the kernel's start.
__device__ __forceinline__ void grid_barrier(unsigned long long *bar, unsigned long long *trace, int &k) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long nb = gridDim.x;
    if (trace && blockIdx.x == 0) trace[++k] = global_ns();
    __threadfence();
    const unsigned long long old = atomicAdd(bar, 1ull);
    const unsigned long long target = (old / nb + 1) * nb;
    while (ld_acquire_u64(bar) < target) {
    }
    __threadfence();
    if (trace && blockIdx.x == 0) trace[++k] = global_ns();
  }
  __syncthreads();
}

__device__ __forceinline__ const uint8_t *mat_row(const strata_step_mat &m, int r) {
  return reinterpret_cast<const uint8_t *>(m.w) + (long long)min(r, m.rows - 1) * m.row_bytes;
}

// Four row dots with the q8_1 vector in shared memory (xs int8 [32 * n_units], then float2 (d, d * sum) per 32):
// the lanes stride over the 32-element sub-blocks, each x block loaded once for the four rows (k_matvec_q8w's loop).
template <int T>
__device__ __forceinline__ void dot4_t(const uint8_t *r0, const uint8_t *r1, const uint8_t *r2, const uint8_t *r3,
                                       const int8_t *xs, int n_units, int lane, float (&acc)[4]) {
  const int4 *x4 = reinterpret_cast<const int4 *>(xs);
  const float2 *xds = reinterpret_cast<const float2 *>(xs + 32 * n_units);
#pragma unroll 2
  for (int u = lane; u < n_units; u += 32) {
    const int4 a = x4[2 * u], b = x4[2 * u + 1];
    const int xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    const float2 ds = xds[u];
    acc[0] += dot_q8x<T>(r0, u, xv, ds);
    acc[1] += dot_q8x<T>(r1, u, xv, ds);
    acc[2] += dot_q8x<T>(r2, u, xv, ds);
    acc[3] += dot_q8x<T>(r3, u, xv, ds);
  }
}

// The four full dots (every lane gets them). One copy per weight type, shared by every phase and instantiation.
__device__ __noinline__ float4 dot4(int type, const uint8_t *r0, const uint8_t *r1, const uint8_t *r2,
                                    const uint8_t *r3, const int8_t *xs, int n_units) {
  const int lane = threadIdx.x & 31;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  switch (type) {
    case T_Q4_0: dot4_t<T_Q4_0>(r0, r1, r2, r3, xs, n_units, lane, acc); break;
    case T_Q4_1: dot4_t<T_Q4_1>(r0, r1, r2, r3, xs, n_units, lane, acc); break;
    case T_Q8_0: dot4_t<T_Q8_0>(r0, r1, r2, r3, xs, n_units, lane, acc); break;
    case T_Q4_K: dot4_t<T_Q4_K>(r0, r1, r2, r3, xs, n_units, lane, acc); break;
    case T_Q5_K: dot4_t<T_Q5_K>(r0, r1, r2, r3, xs, n_units, lane, acc); break;
    case T_Q6_K: dot4_t<T_Q6_K>(r0, r1, r2, r3, xs, n_units, lane, acc); break;
    default: break;   // rejected by strata_decode_step_check
  }
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
  return make_float4(acc[0], acc[1], acc[2], acc[3]);
}

__device__ __forceinline__ float f4_at(const float4 &v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// RMSNorm of the residual row x (n f32, read through L2) with weight w into shared memory as q8_1 blocks (xs int8
// [n], then float2 [n / 32]); k_rms_norm_r's arithmetic. Up to 16 * ST_THREADS values are loaded at once and kept in
// registers.
__device__ void norm_to_smem(const float *x, const float *__restrict__ w, int n, float eps, int8_t *xs,
                             float *red) {
  constexpr int NPT = 16;
  float2 *xds = reinterpret_cast<float2 *>(xs + n);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const bool regs = n <= NPT * ST_THREADS;
  float v[NPT];
  float ss = 0.f;
  if (regs) {
#pragma unroll
    for (int k = 0; k < NPT; k++) {
      const int i = threadIdx.x + k * ST_THREADS;
      v[k] = i < n ? __ldcg(x + i) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < NPT; k++) ss += v[k] * v[k];
  } else {
    for (int i = threadIdx.x; i < n; i += ST_THREADS) {
      const float t = __ldcg(x + i);
      ss += t * t;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) red[wid] = ss;
  __syncthreads();
  float tot = 0.f;
#pragma unroll
  for (int k = 0; k < ST_WARPS; k++) tot += red[k];
  const float r = rsqrtf(tot / (float)n + eps);
  if (regs) {   // warp wid holds elements [k * ST_THREADS + 32 wid, + 32): whole q8_1 blocks (n % 32 == 0)
#pragma unroll
    for (int k = 0; k < NPT; k++) {
      const int i0 = k * ST_THREADS + 32 * wid;
      if (i0 < n) q8_store(v[k] * r * __ldg(w + i0 + lane), i0 + lane, xs, xds);
    }
  } else {
    for (int i0 = 32 * wid; i0 < n; i0 += ST_THREADS) {
      const int i = i0 + lane;
      q8_store(__ldcg(x + i) * r * __ldg(w + i), i, xs, xds);
    }
  }
  __syncthreads();
}

// A q8_1 vector of n values another block wrote (int8 [n], float2 [n / 32]) into shared memory.
__device__ void q8_to_smem(const int8_t *src, int n, int8_t *xs) {
  const int words = (n + n / 4) / 8;
  const uint2 *s = reinterpret_cast<const uint2 *>(src);
  uint2 *d = reinterpret_cast<uint2 *>(xs);
  for (int i = threadIdx.x; i < words; i += ST_THREADS) d[i] = __ldcg(s + i);
  __syncthreads();
}

// Rows (a, b) of RoPE pair j of a head whose first rl dims rotate (rl = 0: none): returns whether the pair rotates.
__device__ __forceinline__ bool pair_rows(int j, int rl, int neox, int &a, int &b) {
  if (j < rl / 2) {
    a = neox ? j : 2 * j;
    b = neox ? j + rl / 2 : 2 * j + 1;
    return true;
  }
  a = rl + 2 * (j - rl / 2);
  b = a + 1;
  return false;
}

// x[r] += row r of m . xs for every row, groups of four rows per warp (the residual add of C and E); x[r] is read
// before the dot so that its load overlaps the weights'.
__device__ __forceinline__ void matvec_residual(const strata_step_mat &m, const int8_t *xs, int n_units, float *x,
                                                int n_rows, int gw, int nw, int lane) {
  for (int g = gw; 4 * g < n_rows; g += nw) {
    const int r0 = 4 * g;
    const float xr = lane < 4 && r0 + lane < n_rows ? __ldcg(x + r0 + lane) : 0.f;
    const float4 d = dot4(m.type, mat_row(m, r0), mat_row(m, r0 + 1), mat_row(m, r0 + 2), mat_row(m, r0 + 3), xs,
                          n_units);
    if (lane < 4 && r0 + lane < n_rows) x[r0 + lane] = xr + f4_at(d, lane);
  }
}

// Total order key of a logit for the argmax: larger value, then lower index, gives a larger key; NaN never wins.
__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
  if (v != v) return 0ull;
  if (v == 0.f) v = 0.f;   // -0 ties with +0, as in strata_argmax
  const unsigned b = __float_as_uint(v);
  const unsigned ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return ((unsigned long long)ord << 32) | (unsigned long long)(0xffffffffu - (unsigned)i);
}

template <int LP, int G>
__global__ void __launch_bounds__(ST_THREADS, ST_MIN_BLOCKS) k_decode_step(const strata_step_args a) {
  constexpr int hd = 8 * LP, half = hd / 2;
  extern __shared__ __align__(16) int8_t xs[];      // the activation vector as q8_1 blocks
  __shared__ float red[ST_WARPS];
  __shared__ float sv[32];
  __shared__ float2 rope_cs[half];                   // (cos, sin) of RoPE pair j at this position
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int gw = blockIdx.x * ST_WARPS + wid, nw = gridDim.x * ST_WARPS;
  const int E = a.n_embd, H = a.n_head, KV = a.n_kv, F = a.n_ff, nq = H * hd, V = a.n_vocab;
  const int pos = a.inp[1], len = a.inp[2];
  const int n_groups_qkv = (H + 2 * KV) * half / 2;
  int tk = 0;   // trace index (thread 0 of block 0)
  if (a.trace && blockIdx.x == 0 && threadIdx.x == 0) a.trace[0] = global_ns();
  int n_split = min(min(max(1, (int)gridDim.x / KV), (len + 63) / 64), a.max_split);
  n_split = max(n_split, 1);
  if (threadIdx.x < half) {   // RoPE angles as k_rope_kv_decode computes them (float64), once per step
    const int rl = a.n_rot, j = threadIdx.x;
    if (j < rl / 2) {
      const double ang = (double)pos * pow((double)a.rope_base, -2.0 * (double)j / (double)rl);
      rope_cs[j] = make_float2((float)cos(ang), (float)sin(ang));
    }
  }
  for (int li = 0; li < a.n_layer; li++) {
    const strata_step_layer &L = a.layers[li];
    __half *kc = reinterpret_cast<__half *>(L.k_cache), *vc = reinterpret_cast<__half *>(L.v_cache);
    // ---- A: RMSNorm, Q / K / V, RoPE, K / V write (rope_cs is visible after the norm's barrier)
    norm_to_smem(a.x, L.attn_norm, E, a.eps, xs, red);
    for (int g = gw; g < n_groups_qkv; g += nw) {
      const int p0 = 2 * g, h = p0 / half, j0 = p0 % half;   // pairs j0, j0 + 1 of head h (same head: half even)
      const strata_step_mat &m = h < H ? L.q : h < H + KV ? L.k : L.v;
      const int hr = h < H ? h : h < H + KV ? h - H : h - H - KV;
      const int rl = h < H + KV ? a.n_rot : 0;
      int ra0, rb0, ra1, rb1;
      pair_rows(j0, rl, a.neox, ra0, rb0);
      pair_rows(j0 + 1, rl, a.neox, ra1, rb1);
      const int base = hr * hd;
      const float4 d = dot4(m.type, mat_row(m, base + ra0), mat_row(m, base + rb0), mat_row(m, base + ra1),
                            mat_row(m, base + rb1), xs, E / 32);
      if (lane < 2) {
        const int j = j0 + lane;
        const int ra = lane ? ra1 : ra0, rb = lane ? rb1 : rb0;
        float y0 = lane ? d.z : d.x, y1 = lane ? d.w : d.y;
        if (j < rl / 2) {
          const float2 cs = rope_cs[j];
          const float t0 = y0 * cs.x - y1 * cs.y, t1 = y0 * cs.y + y1 * cs.x;
          y0 = t0;
          y1 = t1;
        }
        if (h < H) {
          a.q[base + ra] = y0;
          a.q[base + rb] = y1;
        } else {
          __half *c = h < H + KV ? kc : vc;
          const long long o = kv_off(a.page_table, pos, hr, KV, hd, a.page_size);
          c[o + ra] = __float2half(y0);
          c[o + rb] = __float2half(y1);
        }
      }
    }
    grid_barrier(a.barrier, a.trace, tk);
    // ---- B: attention
    for (int it = blockIdx.x; it < KV * n_split; it += gridDim.x) {
      attn_gqa_block<LP, G, false, true, true>(it % KV, it / KV, a.q, kc, vc, nullptr, nullptr, a.page_table, len,
                                               a.ws, a.counters, a.att, reinterpret_cast<int8_t *>(a.att_q8), H, KV,
                                               a.page_size, n_split, a.scale);
      __syncthreads();
    }
    grid_barrier(a.barrier, a.trace, tk);
    // ---- C: output projection + residual
    q8_to_smem(reinterpret_cast<const int8_t *>(a.att_q8), nq, xs);
    matvec_residual(L.o, xs, nq / 32, a.x, E, gw, nw, lane);
    grid_barrier(a.barrier, a.trace, tk);
    // ---- D: RMSNorm, gate / up, SwiGLU -> q8_1 blocks
    norm_to_smem(a.x, L.ffn_norm, E, a.eps, xs, red);
    int8_t *act = reinterpret_cast<int8_t *>(a.act_q8);
    for (int ub = blockIdx.x; 32 * ub < F; ub += gridDim.x) {
#pragma unroll 1
      for (int k = 0; k < 4; k++) {
        const int i = 32 * ub + 8 * wid + 2 * k;
        const float4 d = dot4(L.gate.type, mat_row(L.gate, i), mat_row(L.up, i), mat_row(L.gate, i + 1),
                              mat_row(L.up, i + 1), xs, E / 32);
        if (lane == 0) {
          sv[8 * wid + 2 * k] = d.x / (1.f + expf(-d.x)) * d.y;
          sv[8 * wid + 2 * k + 1] = d.z / (1.f + expf(-d.z)) * d.w;
        }
      }
      __syncthreads();
      if (wid == 0) q8_store(sv[lane], 32 * ub + lane, act, reinterpret_cast<float2 *>(act + F));
      __syncthreads();
    }
    grid_barrier(a.barrier, a.trace, tk);
    // ---- E: down projection + residual
    q8_to_smem(act, F, xs);
    matvec_residual(L.down, xs, F / 32, a.x, E, gw, nw, lane);
    grid_barrier(a.barrier, a.trace, tk);
  }
  // ---- final RMSNorm, output head, argmax
  norm_to_smem(a.x, a.out_norm, E, a.eps, xs, red);
  const strata_step_mat head = a.head;
  unsigned long long best = 0ull;
  for (int g = gw; 4 * g < V; g += nw) {
    const int r0 = 4 * g;
    const float4 d = dot4(head.type, mat_row(head, r0), mat_row(head, r0 + 1), mat_row(head, r0 + 2),
                          mat_row(head, r0 + 3), xs, E / 32);
    if (lane < 4 && r0 + lane < V) {
      const float v = f4_at(d, lane);
      a.logits[r0 + lane] = v;
      const unsigned long long k = argmax_key(v, r0 + lane);
      best = k > best ? k : best;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long t = __shfl_xor_sync(0xffffffffu, best, o);
    best = t > best ? t : best;
  }
  if (lane == 0 && best) atomicMax(a.argmax, best);
  grid_barrier(a.barrier, a.trace, tk);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const unsigned long long b = ld_acquire_u64(a.argmax);
    a.inp[0] = b ? (int)(0xffffffffu - (unsigned)(b & 0xffffffffull)) : 0;
    a.inp[1] = pos + 1;
    a.inp[2] = len + 1;
    *a.argmax = 0ull;
  }
}

static bool mat_ok(const strata_step_mat &m, int rows, int n_in) {
  const int t = m.type;
  const bool q8 = t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
  return q8 && m.w && m.rows == rows && n_in % block_elems(t) == 0 &&
         m.row_bytes == (long long)(n_in / block_elems(t)) * block_bytes(t) && ((uintptr_t)m.w & 15) == 0 &&
         (m.row_bytes & 3) == 0;
}


static int scalars_ok(const strata_step_args *a) {
  if (!a || a->n_layer < 1 || a->n_embd <= 0 || a->n_embd % 32 || a->n_ff <= 0 || a->n_ff % 32 || a->n_kv <= 0 ||
      a->n_head < a->n_kv || a->n_head % a->n_kv || a->n_head / a->n_kv > 4 ||
      (a->head_dim != 64 && a->head_dim != 128) || a->n_rot < 0 || a->n_rot > a->head_dim || a->n_rot % 2 ||
      a->page_size <= 0 || a->max_split < 1 || a->max_split > DA_MAX_SPLIT || a->n_vocab <= 0)
    return 0;
  return 1;
}

// Dynamic shared memory of the step: the largest activation vector (n_embd, n_head * hd, n_ff) as q8_1 blocks.
static int expected_xs(const strata_step_args *a) {
  int n = a->n_embd > a->n_head * a->head_dim ? a->n_embd : a->n_head * a->head_dim;
  n = a->n_ff > n ? a->n_ff : n;
  return (n + n / 4 + 15) / 16 * 16;
}

// Arguments strata_decode_step_check accepted and nobody changed since (the scalars and the shared memory agree).
static int checked(const strata_step_args *a) { return scalars_ok(a) && a->xs_bytes == expected_xs(a); }

extern "C" int strata_decode_step_check(strata_step_args *a, const strata_step_layer *layers) {
  if (!scalars_ok(a) || !layers) return (int)cudaErrorInvalidValue;
  const int E = a->n_embd, nq = a->n_head * a->head_dim, kvd = a->n_kv * a->head_dim, F = a->n_ff;
  for (int i = 0; i < a->n_layer; i++) {
    const strata_step_layer &L = layers[i];
    if (!mat_ok(L.q, nq, E) || !mat_ok(L.k, kvd, E) || !mat_ok(L.v, kvd, E) || !mat_ok(L.o, E, nq) ||
        !mat_ok(L.gate, F, E) || !mat_ok(L.up, F, E) || !mat_ok(L.down, E, F) || L.gate.type != L.up.type ||
        !L.attn_norm || !L.ffn_norm || !L.k_cache || !L.v_cache)
      return (int)cudaErrorInvalidValue;
  }
  if (!mat_ok(a->head, a->n_vocab, E) || !a->out_norm) return (int)cudaErrorInvalidValue;
  a->xs_bytes = expected_xs(a);
  return 0;
}

static size_t step_smem(const strata_step_args *a) { return (size_t)a->xs_bytes; }

typedef void (*step_kernel_t)(const strata_step_args);

static step_kernel_t step_kernel(const strata_step_args *a) {
  const int g = a->n_head / a->n_kv;
#define SK(LP) (g == 1 ? k_decode_step<LP, 1> : g == 2 ? k_decode_step<LP, 2> : k_decode_step<LP, 4>)
  return a->head_dim == 64 ? SK(8) : SK(16);
#undef SK
}

extern "C" int strata_decode_step_grid(const strata_step_args *a, int blocks_per_sm) {
  if (!checked(a) || blocks_per_sm < 1) return -(int)cudaErrorInvalidValue;
  int dev = 0, n_sm = 0, occ = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev);
  const step_kernel_t k = step_kernel(a);
  const size_t smem = step_smem(a);
  if (e == cudaSuccess)   // always: the kernel's static shared memory counts against the 48 KB default too
    e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, ST_THREADS, smem);
  if (e != cudaSuccess) return -(int)e;
  if (occ < 1) return -(int)cudaErrorInvalidConfiguration;
  return n_sm * (blocks_per_sm < occ ? blocks_per_sm : occ);
}

extern "C" int strata_decode_step(void *stream, const strata_step_args *a, int n_blocks) {
  if (!checked(a) || n_blocks < 1) return (int)cudaErrorInvalidValue;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)n_blocks);
  cfg.blockDim = dim3(ST_THREADS);
  cfg.dynamicSmemBytes = step_smem(a);
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];   // cooperative: the driver refuses a grid whose blocks cannot all be resident
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, step_kernel(a), *a);
}
