// The persistent decode step of the llama architecture: one cooperative kernel takes a token through every layer,
// its phases separated by grid-wide barriers instead of kernel launches, its weights streamed into shared memory by
// bulk copies that run ahead of the phases.
//
// The weight stream. Every block (one per SM on the H200) owns a fixed share of every matrix's rows (contiguous, the same every
// token) and reads them, in the order the phases use them, as tiles of whole rows (<= ST_TILE_ROWS rows, <=
// slot_bytes) copied by the Tensor Memory Accelerator (cp.async.bulk, global -> shared, completion counted on the
// slot's `full` mbarrier) into a ring of n_slot slots. A producer warp issues tile k into slot k % n_slot as soon as
// the ST_WARPS consumer warps have released that slot's tile k - n_slot (its `free` mbarrier), so the ring always
// holds the next n_slot tiles, across grid barriers, norms and attention: the weights do not wait for the
// activations, and the matvecs read them from shared memory. (The pattern of "megakernel" decoders, e.g. Hazy
// Research's "Look Ma, No Bubbles", 2025; PTX ISA: cp.async.bulk, mbarrier; CUTLASS's TMA pipelines.) The producer
// has its own warp because a bulk copy's issue waits while earlier copies are still being requested (~3.5 us per
// tile on the critical path when the consumers' thread 0 issued them).
//
// Per layer, each phase spread over all blocks (the consumer warps of each; block-wide syncs are named barrier 2):
//   A  RMSNorm (every block normalizes the residual row itself into shared memory as q8_1 blocks), the Q / K / V
//      matvec over the block's rows of [q; k; v] (whole RoPE pairs: rows 2j, 2j + 1, the GGUF llama layout), RoPE
//      (angles once per step), q written to q, k and v written to the layer's f16 cache at position pos;
//   B  GQA decode attention over len positions (attn_decode.cuh's body on the consumer warps: (KV head, split)
//      items over the blocks, the last split of a head merging them), output f32 and q8_1;
//   C  output projection from the q8_1 attention output, residual added;
//   D  RMSNorm, gate / up matvec and SwiGLU over the block's 32-row units of the FFN, each unit's q8_1 block stored;
//   E  down projection from those q8_1 blocks, residual added.
// Then the final RMSNorm, the output head (logits f32) and the argmax (packed (value, index) atomicMax, lowest index
// on ties, as strata_argmax), written to inp[0] with pos and len advanced, as LlamaCuda's captured step does.
// The arithmetic is that of the launch-per-op plan (strata_kernels.cu's dp4a matvec on q8_1 activations, the same
// RoPE angles, the same attention body); sums run in another order.
// Barrier: Cooperative Groups' grid sync scheme (CUDA C++ Programming Guide, "Grid Synchronization") on a 64-bit
// arrival counter that is never reset (each barrier waits for the next multiple of the grid size).
//
// Needs compute capability >= 9.0 (bulk copies); opt-in (STRATA_CUDA_STEP=1): on the H200 it is slower than the
// launch-per-op graph (1.7B Q4_K llama: ~700 vs ~1060 tok/s at depth 0). The stream keeps up (a tile waits
// ~0.06 us for its data); the consumers are latency-bound: 2 warps per scheduler issue every ~11 cycles, a 28-row
// tile's dots take 1.4-2.8 us from shared memory, and each layer's dependent chain (two RMSNorms ~4-5 us each,
// attention ~7-9 us, five grid barriers ~1.2 us each) is serial. See docs/cuda.md.
//
// Built with -DST_TILE_TRACE (diagnostics, bench/decode_step_trace.py): block 0 also records, after the barrier
// trace (10 * n_layer + 3 entries), per tile t < 4096 when it started waiting for its slot, when its data was
// there and when its dots were done (3 entries each), then clock64 at the start and end and %globaltimer at the
// end (3, then one unused), then 10 points of layer 1 (around its norms and phases: ST_MARK below).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include "strata_cuda.h"
#include "quant.cuh"
#include "q8.cuh"
#include "attn_decode.cuh"

#define ST_WARPS 7                   // consumer warps (+ 1 producer: 2 warps per SM partition, 255 registers)
#define ST_THREADS (32 * ST_WARPS)
#define ST_TILE_ROWS (4 * ST_WARPS)  // rows per tile at most: a group of 4 per consumer warp (<= 32: one per lane
                                     // of the epilogue warp)
#define ST_SLOT 32288                // preferred slot: 28 rows of 2048 Q4_K values (1152 bytes) + alignment slack
#define ST_MAX_SLOTS 8
#define ST_MAX_BLOCKS 1024           // blocks of one grid at most (the shares are computed in int32)
#define ST_BLOCK (ST_THREADS + 32)   // the consumer warps, then the producer warp

// Barrier of the ST_WARPS consumer warps (named barrier 2; 1 is the attention body's, 0 is never used once the
// producer warp has gone its own way).
__device__ __forceinline__ void csync() { asm volatile("bar.sync 2, %0;" ::"n"(ST_THREADS) : "memory"); }

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
  csync();
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
  csync();
}

// ---- shared-memory pipeline primitives (sm_90: PTX ISA "mbarrier", "cp.async.bulk")
__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(unsigned long long *bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
#endif
}

// One arrival that also expects `bytes` of bulk-copy transactions on the barrier's current phase.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long *bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
#endif
}

// Wait until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned long long *bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
#endif
}

// bytes (a multiple of 16) from global src to shared dst (both 16-byte aligned), completion counted on bar.
__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, unsigned bytes, unsigned long long *bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
#endif
}

// One plain arrival (release: the arriving thread's and, after a barrier, its block's reads of the slot are done).
__device__ __forceinline__ void mbar_arrive(unsigned long long *bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
#endif
}

__device__ __forceinline__ void fence_mbar_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Order this thread's view of shared memory (the consumers' generic reads of a slot, ordered by the empty barrier)
// before the async proxy's writes of the next bulk copy into it.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// ---- the tiles of the weight stream
enum { PH_A = 0, PH_C = 1, PH_D = 2, PH_E = 3, PH_HEAD = 4, PH_END = 5 };

// One tile: `rows` rows of one matrix from src0 (bytes0 bytes) and, in phase D, the same rows of up from src1. A
// part's copy starts at the 16-byte boundary below its source and is a multiple of 16 bytes, so the rows sit in
// the slot at their source's offset modulo 16 (every alignment the dot relies on holds in the slot as in global
// memory); the second part starts at the first copy's end. A copy may read up to 15 bytes past its last row: still
// inside the weight's device allocation (CuPy rounds allocations up to 512 bytes; fused weights hold more rows).
struct Tile {
  const uint8_t *src0, *src1;
  int bytes0, bytes1, rows, rb, type;
  int row0;   // A: first row within q / k / v; C, E, head: first output row; D: first FFN row
  int mat;    // A: 0 q, 1 k, 2 v; D: 1 if the tile ends its 32-row unit
};

__device__ __forceinline__ unsigned copy_bytes(const uint8_t *src, int bytes) {
  return (unsigned)((((uintptr_t)src & 15) + bytes + 15) & ~15);
}
__device__ __forceinline__ const uint8_t *part0(const Tile &t, uint8_t *slot) { return slot + ((uintptr_t)t.src0 & 15); }
__device__ __forceinline__ const uint8_t *part1(const Tile &t, uint8_t *slot) {
  return slot + copy_bytes(t.src0, t.bytes0) + ((uintptr_t)t.src1 & 15);
}

// Rows of rb bytes a slot holds as one tile (<= ST_TILE_ROWS): with even = true, an even count (whole RoPE pairs).
__host__ __device__ __forceinline__ int tile_rows(int slot, int rb, bool even) {
  int r = (slot - 32) / rb;
  r = r < ST_TILE_ROWS ? r : ST_TILE_ROWS;
  return even ? r & ~1 : r;
}
// Rows of gate and of up per phase D tile: a power of two <= 16 (a 32-row unit is 32 / k tiles) such that both
// parts fit one slot.
__host__ __device__ __forceinline__ int glu_tile_rows(int slot, int rb) {
  int k = 16;
  while (k > 1 && 2 * (k * rb + 32) > slot) k >>= 1;
  return k;
}

// Block b's share [lo, hi) of n items over nb blocks (n * nb < 2^31: the host checks n < 2^21, nb <= 1024).
__device__ __forceinline__ void share(int n, int b, int nb, int &lo, int &hi) {
  lo = n * b / nb;
  hi = n * (b + 1) / nb;
}

// A matrix's fields a tile needs, copied so that tiles are computed from registers.
struct MatRef {
  const uint8_t *w;
  int rb, type;
};

__device__ __forceinline__ MatRef mat_ref(const strata_step_mat &m) {
  return {reinterpret_cast<const uint8_t *>(m.w), (int)m.row_bytes, m.type};
}

template <typename T>
__device__ __forceinline__ T sel3(int s, T a, T b, T c) { return s == 0 ? a : s == 1 ? b : c; }

// Block b's tiles in one phase of one layer, computed once per phase (the divisions), then any tile in O(1) from
// registers: up to three segments (phase A: the block's rows of q, k, v), segment s rows [lo_s, hi_s) (phase D:
// 32-row units, m1 = up) in tiles of tr_s rows, tiles [end_{s-1}, end_s).
struct Phase {
  MatRef m0, m1, m2;
  int lo0, lo1, lo2, hi0, hi1, hi2, tr0, tr1, tr2, end0, end1;
  int ph, n;   // the phase, its tile count
};

__device__ void phase_plan(const strata_step_args &a, const strata_step_layer &L, int ph, int b, int nb, Phase &p) {
  const int S = a.slot_bytes;
  p.ph = ph;
  if (ph == PH_A) {
    const int nq = a.n_head * a.head_dim, kvd = a.n_kv * a.head_dim;
    int p0, p1;
    share((nq + 2 * kvd) / 2, b, nb, p0, p1);   // whole RoPE pairs of [q; k; v]
    p.m0 = mat_ref(L.q);
    p.m1 = mat_ref(L.k);
    p.m2 = mat_ref(L.v);
    p.lo0 = min(2 * p0, nq);
    p.hi0 = min(2 * p1, nq);
    p.lo1 = min(max(2 * p0, nq), nq + kvd) - nq;
    p.hi1 = min(max(2 * p1, nq), nq + kvd) - nq;
    p.lo2 = max(2 * p0, nq + kvd) - nq - kvd;
    p.hi2 = max(2 * p1, nq + kvd) - nq - kvd;
    p.tr0 = tile_rows(S, p.m0.rb, true);
    p.tr1 = tile_rows(S, p.m1.rb, true);
    p.tr2 = tile_rows(S, p.m2.rb, true);
    p.end0 = (p.hi0 - p.lo0 + p.tr0 - 1) / p.tr0;
    p.end1 = p.end0 + (p.hi1 - p.lo1 + p.tr1 - 1) / p.tr1;
    p.n = p.end1 + (p.hi2 - p.lo2 + p.tr2 - 1) / p.tr2;
    return;
  }
  p.m0 = mat_ref(ph == PH_C ? L.o : ph == PH_D ? L.gate : ph == PH_E ? L.down : a.head);
  p.m1 = mat_ref(L.up);
  if (ph == PH_D) {
    share(a.n_ff / 32, b, nb, p.lo0, p.hi0);
    p.tr0 = glu_tile_rows(S, p.m0.rb);
    p.n = (p.hi0 - p.lo0) * (32 / p.tr0);
  } else {
    share(ph == PH_HEAD ? a.n_vocab : a.n_embd, b, nb, p.lo0, p.hi0);
    p.tr0 = tile_rows(S, p.m0.rb, false);
    p.n = (p.hi0 - p.lo0 + p.tr0 - 1) / p.tr0;
  }
  p.end0 = p.end1 = p.n;
}

// Tile i (< p.n) of the phase.
__device__ __forceinline__ Tile phase_tile(const Phase &p, int i) {
  Tile t;
  t.src1 = nullptr;
  t.bytes1 = 0;
  if (p.ph == PH_D) {
    const int k = p.tr0, per = 32 / k, c = i % per;
    const int r0 = 32 * (p.lo0 + i / per) + k * c;
    t.src0 = p.m0.w + (long long)r0 * p.m0.rb;
    t.src1 = p.m1.w + (long long)r0 * p.m1.rb;
    t.bytes0 = k * p.m0.rb;
    t.bytes1 = k * p.m1.rb;
    t.rows = k;
    t.rb = p.m0.rb;
    t.type = p.m0.type;
    t.row0 = r0;
    t.mat = c == per - 1;
    return t;
  }
  const int s = i < p.end0 ? 0 : i < p.end1 ? 1 : 2;
  const MatRef m = sel3(s, p.m0, p.m1, p.m2);
  const int tr = sel3(s, p.tr0, p.tr1, p.tr2);
  const int r0 = sel3(s, p.lo0, p.lo1, p.lo2) + (i - sel3(s, 0, p.end0, p.end1)) * tr;
  t.rows = min(tr, sel3(s, p.hi0, p.hi1, p.hi2) - r0);
  t.src0 = m.w + (long long)r0 * m.rb;
  t.bytes0 = t.rows * m.rb;
  t.rb = m.rb;
  t.type = m.type;
  t.row0 = r0;
  t.mat = s;
  return t;
}

// The producer: thread 0's position in the stream (the next tile to issue).
struct Stream {
  int li, i;   // layer, tile index in phase p
  Phase p;
};

// From (li, p.ph) on, the first phase with a tile left (i < p.n); p.ph = PH_END when the stream is done. lt: the
// layer table (shared memory).
__device__ void stream_seek(const strata_step_args &a, const strata_step_layer *lt, Stream &s, int b, int nb) {
  while (s.p.ph != PH_END && s.i >= s.p.n) {
    int ph = s.p.ph;
    s.i = 0;
    if (ph == PH_HEAD) {
      s.p.ph = PH_END;
      return;
    }
    if (ph == PH_E) {
      ph = ++s.li < a.n_layer ? PH_A : PH_HEAD;
    } else {
      ph++;
    }
    phase_plan(a, lt[s.li < a.n_layer ? s.li : 0], ph, b, nb, s.p);
  }
}

// Issue the stream's next tile (if any) into slot `slot` (its mbarrier bar) and advance.
__device__ void stream_issue(const strata_step_args &a, const strata_step_layer *lt, Stream &s, uint8_t *slot,
                             unsigned long long *bar, int b, int nb) {
  if (s.p.ph == PH_END) return;
  const Tile t = phase_tile(s.p, s.i);
  const unsigned c0 = copy_bytes(t.src0, t.bytes0), c1 = t.bytes1 ? copy_bytes(t.src1, t.bytes1) : 0u;
  fence_proxy_async();
  mbar_expect_tx(bar, c0 + c1);
  bulk_g2s(slot, reinterpret_cast<const void *>((uintptr_t)t.src0 & ~(uintptr_t)15), c0, bar);
  if (c1) bulk_g2s(slot + c0, reinterpret_cast<const void *>((uintptr_t)t.src1 & ~(uintptr_t)15), c1, bar);
  s.i++;
  stream_seek(a, lt, s, b, nb);
}

// Four row dots with the q8_1 vector in shared memory (xs int8 [32 * n_units], then float2 (d, d * sum) per 32)
// over the 32-element sub-blocks [ub, ue): the lanes stride over them, each x block loaded once for the four rows
// (k_matvec_q8w's loop).
template <int T>
__device__ __forceinline__ void dot4_t(const uint8_t *r0, const uint8_t *r1, const uint8_t *r2, const uint8_t *r3,
                                       const int8_t *xs, int n_units, int ub, int ue, int lane, float (&acc)[4]) {
  const int4 *x4 = reinterpret_cast<const int4 *>(xs);
  const float2 *xds = reinterpret_cast<const float2 *>(xs + 32 * n_units);
#pragma unroll 2
  for (int u = ub + lane; u < ue; u += 32) {
    const int4 a = x4[2 * u], b = x4[2 * u + 1];
    const int xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    const float2 ds = xds[u];
    acc[0] += dot_q8x<T>(r0, u, xv, ds);
    acc[1] += dot_q8x<T>(r1, u, xv, ds);
    acc[2] += dot_q8x<T>(r2, u, xv, ds);
    acc[3] += dot_q8x<T>(r3, u, xv, ds);
  }
}

// The four dots over sub-blocks [ub, ue) (every lane gets them). One copy per weight type, shared by every phase.
__device__ __noinline__ float4 dot4(int type, const uint8_t *r0, const uint8_t *r1, const uint8_t *r2,
                                    const uint8_t *r3, const int8_t *xs, int n_units, int ub, int ue) {
  const int lane = threadIdx.x & 31;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  switch (type) {
    case T_Q4_0: dot4_t<T_Q4_0>(r0, r1, r2, r3, xs, n_units, ub, ue, lane, acc); break;
    case T_Q4_1: dot4_t<T_Q4_1>(r0, r1, r2, r3, xs, n_units, ub, ue, lane, acc); break;
    case T_Q8_0: dot4_t<T_Q8_0>(r0, r1, r2, r3, xs, n_units, ub, ue, lane, acc); break;
    case T_Q4_K: dot4_t<T_Q4_K>(r0, r1, r2, r3, xs, n_units, ub, ue, lane, acc); break;
    case T_Q5_K: dot4_t<T_Q5_K>(r0, r1, r2, r3, xs, n_units, ub, ue, lane, acc); break;
    case T_Q6_K: dot4_t<T_Q6_K>(r0, r1, r2, r3, xs, n_units, ub, ue, lane, acc); break;
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

// The dots of one tile from its slot into part (float4 per item): an item is a group of four rows (glu: gate and
// up of two FFN rows) and one of ks parts of the sub-blocks, ks the largest power of two that keeps <= ST_WARPS
// items and >= 32 sub-blocks per part. Returns ks. Ends with csync (the slot is free, part complete).
__device__ int tile_dots(const Tile &t, bool glu, const uint8_t *slot0, const uint8_t *slot1, const int8_t *xs,
                         int n_units, float4 *part, int lane, int wid) {
  const int ng = glu ? t.rows / 2 : (t.rows + 3) / 4;
  int ks = 1;   // >= 32 sub-blocks per part: every lane has one
  while (ks < ST_WARPS && 2 * ng * ks <= ST_WARPS && n_units >= 64 * ks) ks *= 2;
  const long long rb = t.rb;
  for (int it = wid; it < ng * ks; it += ST_WARPS) {
    const int g = it / ks, s = it % ks;
    const uint8_t *r[4];
    if (glu) {
      r[0] = slot0 + 2 * g * rb; r[1] = slot1 + 2 * g * rb; r[2] = r[0] + rb; r[3] = r[1] + rb;
    } else {
#pragma unroll
      for (int c = 0; c < 4; c++) r[c] = slot0 + min(4 * g + c, t.rows - 1) * rb;
    }
    const float4 d = dot4(t.type, r[0], r[1], r[2], r[3], xs, n_units, s * n_units / ks, (s + 1) * n_units / ks);
    if (lane == 0) part[it] = d;
  }
  csync();
  return ks;
}

// Row c (0..3) of group g of the tile: the sum of its ks parts.
__device__ __forceinline__ float tile_value(const float4 *part, int g, int ks, int c) {
  float v = 0.f;
  for (int s = 0; s < ks; s++) v += f4_at(part[g * ks + s], c);
  return v;
}

// RMSNorm of the residual row x (n f32, read through L2) with weight w into shared memory as q8_1 blocks (xs int8
// [n], then float2 [n / 32]); k_rms_norm_r's arithmetic. Up to NPT * ST_THREADS values and their weights are loaded
// at once (one round trip) and kept in registers.
__device__ void norm_to_smem(const float *x, const float *__restrict__ w, int n, float eps, int8_t *xs,
                             float *red) {
  constexpr int NPT = 10;
  float2 *xds = reinterpret_cast<float2 *>(xs + n);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const bool regs = n <= NPT * ST_THREADS;
  float v[NPT], wv[NPT];
  float ss = 0.f;
  if (regs) {   // element threadIdx.x + k * ST_THREADS: warp wid holds whole q8_1 blocks (n % 32 == 0)
#pragma unroll
    for (int k = 0; k < NPT; k++) {
      const int i = threadIdx.x + k * ST_THREADS;
      v[k] = i < n ? __ldcg(x + i) : 0.f;
      wv[k] = i < n ? __ldg(w + i) : 0.f;
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
  csync();
  float tot = 0.f;
#pragma unroll
  for (int k = 0; k < ST_WARPS; k++) tot += red[k];
  const float r = rsqrtf(tot / (float)n + eps);
  if (regs) {
#pragma unroll
    for (int k = 0; k < NPT; k++) {
      const int i0 = k * ST_THREADS + 32 * wid;
      if (i0 < n) q8_store(v[k] * r * wv[k], i0 + lane, xs, xds);
    }
  } else {
    for (int i0 = 32 * wid; i0 < n; i0 += ST_THREADS) {
      const int i = i0 + lane;
      q8_store(__ldcg(x + i) * r * __ldg(w + i), i, xs, xds);
    }
  }
  csync();
}

// bytes (a multiple of 8; 8-byte aligned) from global src (through L2: another block may have written them) to
// shared dst: rounds of 8 loads per thread issued before their stores. No barrier.
__device__ void copy_to_smem(const void *src, int bytes, void *dst) {
  constexpr int R = 8;
  const int words = bytes / 8;
  const uint2 *s = reinterpret_cast<const uint2 *>(src);
  uint2 *d = reinterpret_cast<uint2 *>(dst);
  for (int i0 = threadIdx.x; i0 < words; i0 += R * ST_THREADS) {
    uint2 r[R];
#pragma unroll
    for (int k = 0; k < R; k++) {
      const int i = i0 + k * ST_THREADS;
      r[k] = i < words ? __ldcg(s + i) : make_uint2(0u, 0u);
    }
#pragma unroll
    for (int k = 0; k < R; k++) {
      const int i = i0 + k * ST_THREADS;
      if (i < words) d[i] = r[k];
    }
  }
}

// A q8_1 vector of n values another block wrote (int8 [n], float2 [n / 32]) into shared memory.
__device__ void q8_to_smem(const int8_t *src, int n, int8_t *xs) {
  copy_to_smem(src, n + n / 4, xs);
  csync();
}

// Total order key of a logit for the argmax: larger value, then lower index, gives a larger key; NaN never wins.
__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
  if (v != v) return 0ull;
  if (v == 0.f) v = 0.f;   // -0 ties with +0, as in strata_argmax
  const unsigned b = __float_as_uint(v);
  const unsigned ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return ((unsigned long long)ord << 32) | (unsigned long long)(0xffffffffu - (unsigned)i);
}

#ifdef ST_TILE_TRACE   // diagnostics: the layout of the header's ST_TILE_TRACE paragraph
#define ST_TRACE_TILES 4096
#define ST_TRACE_CLOCKS (3 * ST_TRACE_TILES)       // clock64 at the start, at the end, %globaltimer at the end
#define ST_TRACE_MARKS (ST_TRACE_CLOCKS + 4)       // layer 1's points
// Block 0's tile trace: after the grid barriers' trace.
__device__ __forceinline__ unsigned long long *tile_trace(const strata_step_args &a) {
  return a.trace + 10 * a.n_layer + 3;
}
// Block 0 thread 0's time at point k of layer 1.
#define ST_MARK(k) \
  if (a.trace && b == 0 && threadIdx.x == 0 && li == 1) tile_trace(a)[ST_TRACE_MARKS + (k)] = global_ns()
#else
#define ST_MARK(k)
#endif

template <int LP, int G>
__global__ void __launch_bounds__(ST_BLOCK, 1) k_decode_step(const strata_step_args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int hd = 8 * LP, half = hd / 2;
  extern __shared__ __align__(128) uint8_t smem[];   // the ring (n_slot x slot_bytes), then xs
  __shared__ unsigned long long bars[ST_MAX_SLOTS];  // per slot: its tile has landed (bulk-copy transactions)
  __shared__ unsigned long long free_[ST_MAX_SLOTS]; // per slot: the consumers are done with its tile
  __shared__ float4 part[2][8];                      // a tile's dot items (<= 8: 8 glu groups), by parity
  __shared__ float red[ST_WARPS];
  __shared__ float sv[32];
  __shared__ float2 rope_cs[half];                   // (cos, sin) of RoPE pair j at this position
  int8_t *xs = reinterpret_cast<int8_t *>(smem + (size_t)a.n_slot * a.slot_bytes);   // activations as q8_1
  strata_step_layer *lt = reinterpret_cast<strata_step_layer *>(xs + a.xs_bytes);      // the layer table
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, b = blockIdx.x, nb = gridDim.x;
  const int E = a.n_embd, H = a.n_head, KV = a.n_kv, F = a.n_ff, nq = H * hd, NS = a.n_slot, SB = a.slot_bytes;
  const int pos = a.inp[1], len = a.inp[2];
  const long long kv_slot = (long long)a.page_table[pos / a.page_size] * a.page_size + pos % a.page_size;
  int tk = 0;   // trace index (thread 0 of block 0)
  if (a.trace && b == 0 && threadIdx.x == 0) a.trace[0] = global_ns();
#ifdef ST_TILE_TRACE
  if (a.trace && b == 0 && threadIdx.x == 0) tile_trace(a)[ST_TRACE_CLOCKS] = clock64();
#endif
  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; s++) {
      mbar_init(&bars[s], 1);
      mbar_init(&free_[s], 1);
    }
    fence_mbar_init();
  }
  if (wid < ST_WARPS) copy_to_smem(a.layers, a.n_layer * (int)sizeof(strata_step_layer), lt);
  __syncthreads();   // the only block-wide barrier: then the producer warp goes its own way
  if (wid == ST_WARPS) {   // the producer: tile k into slot k % NS once the consumers freed that slot's tile k - NS
    if (lane == 0) {
      Stream st;
      st.li = st.i = 0;
      phase_plan(a, lt[0], PH_A, b, nb, st.p);
      stream_seek(a, lt, st, b, nb);
      for (int k = 0; st.p.ph != PH_END; k++) {
        const int s = k % NS;
        if (k >= NS) mbar_wait(&free_[s], (unsigned)(k / NS - 1) & 1u);
        stream_issue(a, lt, st, smem + (size_t)s * SB, &bars[s], b, nb);
      }
    }
    return;
  }
  int n_split = min(min(max(1, nb / KV), (len + 63) / 64), a.max_split);
  n_split = max(n_split, 1);
  if (threadIdx.x < half) {   // RoPE angles as k_rope_kv_decode computes them (float64), once per step
    const int rl = a.n_rot, j = threadIdx.x;
    if (j < rl / 2) {
      const double ang = (double)pos * pow((double)a.rope_base, -2.0 * (double)j / (double)rl);
      rope_cs[j] = make_float2((float)cos(ang), (float)sin(ang));
    }
  }
  int t = 0;   // tiles consumed: tile t is in slot t % NS, that slot's use t / NS
  // Wait for the next tile, compute its dots, hand its slot back to the producer; returns ks (tile_dots).
  auto consume = [&](const Tile &tl, bool glu, int n_units) {
    const int s = t % NS;
    uint8_t *slot = smem + (size_t)s * SB;
#ifdef ST_TILE_TRACE   // diagnostics: block 0's tile t waited from tt[3t] to tt[3t + 1], its dots done at tt[3t + 2]
    unsigned long long *tt = a.trace && b == 0 && threadIdx.x == 0 && t < ST_TRACE_TILES ? tile_trace(a) + 3 * t
                                                                                          : nullptr;
    if (tt) tt[0] = global_ns();
#endif
    mbar_wait(&bars[s], (unsigned)(t / NS) & 1u);
#ifdef ST_TILE_TRACE
    if (tt) tt[1] = global_ns();
#endif
    const int ks = tile_dots(tl, glu, part0(tl, slot), glu ? part1(tl, slot) : nullptr, xs, n_units, part[t & 1],
                             lane, wid);
#ifdef ST_TILE_TRACE
    if (tt) tt[2] = global_ns();
#endif
    if (threadIdx.x == 0) mbar_arrive(&free_[s]);
    t++;
    return ks;
  };
  // x[r] += row r . (the q8_1 vector src of n_in values) over the block's rows of phase C (o) or E (down).
  auto residual_phase = [&](const strata_step_layer &L, int ph, const int8_t *src, int n_in) {
    q8_to_smem(src, n_in, xs);
    Phase P;
    phase_plan(a, L, ph, b, nb, P);
    for (int i = 0; i < P.n; i++) {
      const Tile tl = phase_tile(P, i);
      const bool mine = wid == 0 && lane < tl.rows;
      const float xr = mine ? __ldcg(a.x + tl.row0 + lane) : 0.f;   // loaded while the dots run
      const int ks = consume(tl, false, n_in / 32);
      if (mine) a.x[tl.row0 + lane] = xr + tile_value(part[(t - 1) & 1], lane / 4, ks, lane & 3);
    }
  };
  for (int li = 0; li < a.n_layer; li++) {
    const strata_step_layer &L = lt[li];
    __half *kc = reinterpret_cast<__half *>(L.k_cache), *vc = reinterpret_cast<__half *>(L.v_cache);
    // ---- A: RMSNorm, Q / K / V, RoPE, K / V write (rope_cs is visible after the norm's csync)
    ST_MARK(0);
    norm_to_smem(a.x, L.attn_norm, E, a.eps, xs, red);
    ST_MARK(1);
    Phase PA;
    phase_plan(a, L, PH_A, b, nb, PA);
    for (int i = 0; i < PA.n; i++) {
      const Tile tl = phase_tile(PA, i);
      const int ks = consume(tl, false, E / 32);
      if (wid == 0 && lane < tl.rows / 2) {   // lane: the pair of rows 2 lane, 2 lane + 1
        const float4 *p = part[(t - 1) & 1];
        float y0 = tile_value(p, lane / 2, ks, 2 * (lane & 1)), y1 = tile_value(p, lane / 2, ks, 2 * (lane & 1) + 1);
        const int r = tl.row0 + 2 * lane, hr = r / hd, dim = r % hd, j = dim / 2;
        if (tl.mat < 2 && j < a.n_rot / 2) {
          const float2 cs = rope_cs[j];
          const float t0 = y0 * cs.x - y1 * cs.y, t1 = y0 * cs.y + y1 * cs.x;
          y0 = t0;
          y1 = t1;
        }
        if (tl.mat == 0) {
          a.q[r] = y0;
          a.q[r + 1] = y1;
        } else {
          __half *c = tl.mat == 1 ? kc : vc;
          const long long o = (kv_slot * KV + hr) * hd + dim;   // kv_off's layout
          c[o] = __float2half(y0);
          c[o + 1] = __float2half(y1);
        }
      }
    }
    ST_MARK(2);
    grid_barrier(a.barrier, a.trace, tk);
    ST_MARK(3);
    // ---- B: attention
    for (int it = b; it < KV * n_split; it += nb) {
      attn_gqa_block<LP, G, false, true, true, true, ST_WARPS>(it % KV, it / KV, a.q, kc, vc, nullptr, nullptr,
                                                               a.page_table, len, a.ws, a.counters, a.att,
                                                               reinterpret_cast<int8_t *>(a.att_q8), H, KV,
                                                               a.page_size, n_split, a.scale);
      csync();
    }
    grid_barrier(a.barrier, a.trace, tk);
    ST_MARK(4);
    // ---- C: output projection + residual
    residual_phase(L, PH_C, reinterpret_cast<const int8_t *>(a.att_q8), nq);
    ST_MARK(5);
    grid_barrier(a.barrier, a.trace, tk);
    // ---- D: RMSNorm, gate / up, SwiGLU -> q8_1 blocks
    ST_MARK(6);
    norm_to_smem(a.x, L.ffn_norm, E, a.eps, xs, red);
    ST_MARK(7);
    int8_t *act = reinterpret_cast<int8_t *>(a.act_q8);
    Phase PD;
    phase_plan(a, L, PH_D, b, nb, PD);
    for (int i = 0; i < PD.n; i++) {
      const Tile tl = phase_tile(PD, i);
      const int ks = consume(tl, true, E / 32);
      if (wid == 0) {
        if (lane < tl.rows) {   // FFN row row0 + lane: component lane & 1 of (gate, up) pair lane / 2
          const float4 *p = part[(t - 1) & 1];
          const float g = tile_value(p, lane / 2, ks, 2 * (lane & 1));
          const float u = tile_value(p, lane / 2, ks, 2 * (lane & 1) + 1);
          sv[(tl.row0 & 31) + lane] = g / (1.f + expf(-g)) * u;
        }
        if (tl.mat) {   // the unit's 32 values are in sv
          __syncwarp();
          q8_store(sv[lane], (tl.row0 & ~31) + lane, act, reinterpret_cast<float2 *>(act + F));
        }
      }
    }
    grid_barrier(a.barrier, a.trace, tk);
    ST_MARK(8);
    // ---- E: down projection + residual
    residual_phase(L, PH_E, act, F);
    ST_MARK(9);
    grid_barrier(a.barrier, a.trace, tk);
  }
  // ---- final RMSNorm, output head, argmax
  norm_to_smem(a.x, a.out_norm, E, a.eps, xs, red);
  unsigned long long best = 0ull;
  Phase P;
  phase_plan(a, lt[0], PH_HEAD, b, nb, P);
  for (int i = 0; i < P.n; i++) {
    const Tile tl = phase_tile(P, i);
    const int ks = consume(tl, false, E / 32);
    if (wid == 0 && lane < tl.rows) {
      const float v = tile_value(part[(t - 1) & 1], lane / 4, ks, lane & 3);
      a.logits[tl.row0 + lane] = v;
      const unsigned long long k = argmax_key(v, tl.row0 + lane);
      best = k > best ? k : best;
    }
  }
  if (wid == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long u = __shfl_xor_sync(0xffffffffu, best, o);
      best = u > best ? u : best;
    }
    if (lane == 0 && best) atomicMax(a.argmax, best);
  }
  grid_barrier(a.barrier, a.trace, tk);
#ifdef ST_TILE_TRACE
  if (a.trace && b == 0 && threadIdx.x == 0) {
    tile_trace(a)[ST_TRACE_CLOCKS + 1] = clock64();
    tile_trace(a)[ST_TRACE_CLOCKS + 2] = global_ns();
  }
#endif
  if (b == 0 && threadIdx.x == 0) {
    const unsigned long long k = ld_acquire_u64(a.argmax);
    a.inp[0] = k ? (int)(0xffffffffu - (unsigned)(k & 0xffffffffull)) : 0;
    a.inp[1] = pos + 1;
    a.inp[2] = len + 1;
    *a.argmax = 0ull;
  }
#else
  __trap();   // strata_decode_step_grid refuses devices below compute capability 9.0
#endif
}

static bool mat_ok(const strata_step_mat &m, int rows, int n_in) {
  const int t = m.type;
  const bool q8 = t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
  return q8 && m.w && m.rows == rows && n_in % block_elems(t) == 0 &&
         m.row_bytes == (long long)(n_in / block_elems(t)) * block_bytes(t) && ((uintptr_t)m.w & 15) == 0 &&
         (m.row_bytes & 3) == 0;
}

static int scalars_ok(const strata_step_args *a) {
  if (!a || a->n_layer < 1 || a->n_layer > 256 || a->n_embd <= 0 || a->n_embd % 32 || a->n_ff <= 0 || a->n_ff % 32 || a->n_kv <= 0 ||
      a->n_head < a->n_kv || a->n_head % a->n_kv || a->n_head / a->n_kv > 4 ||
      (a->head_dim != 64 && a->head_dim != 128) || a->n_rot < 0 || a->n_rot > a->head_dim || a->n_rot % 2 ||
      a->neox || a->page_size <= 0 || a->max_split < 1 || a->max_split > DA_MAX_SPLIT || a->n_vocab <= 0 ||
      a->n_vocab >= (1 << 21) || a->n_ff >= (1 << 21) || a->n_embd >= (1 << 21) ||
      (long long)a->n_head * a->head_dim >= (1 << 20))   // shares computed in int32 over <= ST_MAX_BLOCKS blocks
    return 0;
  return 1;
}

// Dynamic shared memory of the step after its ring: the largest activation vector (n_embd, n_head * hd, n_ff) as
// q8_1 blocks.
static int expected_xs(const strata_step_args *a) {
  int n = a->n_embd > a->n_head * a->head_dim ? a->n_embd : a->n_head * a->head_dim;
  n = a->n_ff > n ? a->n_ff : n;
  return (n + n / 4 + 15) / 16 * 16;
}

// Arguments strata_decode_step_check accepted and nobody changed since (the scalars and the shared memory agree).
static int checked(const strata_step_args *a) {
  return scalars_ok(a) && a->xs_bytes == expected_xs(a) && a->min_slot > 0 && a->min_slot % 16 == 0;
}

// ... and a ring strata_decode_step_grid sized.
static int launchable(const strata_step_args *a) {
  return checked(a) && a->n_slot >= 2 && a->n_slot <= ST_MAX_SLOTS && a->slot_bytes >= a->min_slot &&
         a->slot_bytes % 16 == 0;
}

extern "C" int strata_decode_step_check(strata_step_args *a, const strata_step_layer *layers) {
  if (!scalars_ok(a) || !layers) return (int)cudaErrorInvalidValue;
  const int E = a->n_embd, nq = a->n_head * a->head_dim, kvd = a->n_kv * a->head_dim, F = a->n_ff;
  // The smallest slot every tile fits (rows + 32 bytes of alignment slack per part): one row of o / down / the head,
  // two of q / k / v (a RoPE pair), two each of gate and up (phase D).
  long long one = a->head.row_bytes, two = 0, glu = 0;
  for (int i = 0; i < a->n_layer; i++) {
    const strata_step_layer &L = layers[i];
    if (!mat_ok(L.q, nq, E) || !mat_ok(L.k, kvd, E) || !mat_ok(L.v, kvd, E) || !mat_ok(L.o, E, nq) ||
        !mat_ok(L.gate, F, E) || !mat_ok(L.up, F, E) || !mat_ok(L.down, E, F) || L.gate.type != L.up.type ||
        !L.attn_norm || !L.ffn_norm || !L.k_cache || !L.v_cache)
      return (int)cudaErrorInvalidValue;
    for (const strata_step_mat *m : {&L.o, &L.down}) one = m->row_bytes > one ? m->row_bytes : one;
    for (const strata_step_mat *m : {&L.q, &L.k, &L.v}) two = m->row_bytes > two ? m->row_bytes : two;
    glu = L.gate.row_bytes > glu ? L.gate.row_bytes : glu;
  }
  if (!mat_ok(a->head, a->n_vocab, E) || !a->out_norm) return (int)cudaErrorInvalidValue;
  a->xs_bytes = expected_xs(a);
  long long need = one + 32;
  need = 2 * two + 32 > need ? 2 * two + 32 : need;
  need = 2 * (2 * glu + 32) > need ? 2 * (2 * glu + 32) : need;
  a->min_slot = (int)((need + 15) / 16 * 16);
  a->slot_bytes = a->n_slot = 0;
  return 0;
}

// The layer table's copy in shared memory.
static int table_bytes(const strata_step_args *a) { return a->n_layer * (int)sizeof(strata_step_layer); }

// Dynamic shared memory: the ring, the activation vector, the layer table.
static size_t step_smem(const strata_step_args *a) {
  return (size_t)a->n_slot * a->slot_bytes + a->xs_bytes + table_bytes(a);
}

typedef void (*step_kernel_t)(const strata_step_args);

static step_kernel_t step_kernel(const strata_step_args *a) {
  const int g = a->n_head / a->n_kv;
#define SK(LP) (g == 1 ? k_decode_step<LP, 1> : g == 2 ? k_decode_step<LP, 2> : k_decode_step<LP, 4>)
  return a->head_dim == 64 ? SK(8) : SK(16);
#undef SK
}

extern "C" int strata_decode_step_grid(strata_step_args *a, int blocks_per_sm) {
  if (!checked(a) || blocks_per_sm < 1 || blocks_per_sm > 4) return -(int)cudaErrorInvalidValue;
  int dev = 0, n_sm = 0, cc = 0, optin = 0, per_sm = 0, reserved = 0, occ = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
  if (e != cudaSuccess) return -(int)e;
  if (cc < 9) return -(int)cudaErrorNotSupported;   // bulk copies and mbarrier transactions: sm_90
  const step_kernel_t k = step_kernel(a);
  cudaFuncAttributes fa;
  e = cudaFuncGetAttributes(&fa, k);
  // Any ring up to the device's limit may be launched (the ring differs by model: one process may hold several).
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, optin - (int)fa.sharedSizeBytes);
  if (e == cudaSuccess)   // what the registers allow: the ring is sized for that many blocks per SM at most
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, ST_BLOCK, 0);
  if (e != cudaSuccess) return -(int)e;
  if (occ < 1) return -(int)cudaErrorInvalidConfiguration;
  blocks_per_sm = blocks_per_sm < occ ? blocks_per_sm : occ;
  // The ring: slots of ST_SLOT bytes (or the matrices' minimum, if larger) in what the blocks of one SM leave.
  long long avail = (long long)per_sm / blocks_per_sm - reserved;
  avail = (avail < optin ? avail : optin) - (long long)fa.sharedSizeBytes - a->xs_bytes - table_bytes(a);
  long long slot = a->min_slot > ST_SLOT ? a->min_slot : ST_SLOT;
  long long n_slot = avail > 0 ? avail / slot : 0;
  if (n_slot < 2) {   // two smaller slots, if the largest rows still fit
    n_slot = 2;
    slot = avail / 2 / 16 * 16;
  }
  if (slot < a->min_slot) return -(int)cudaErrorInvalidConfiguration;
  a->slot_bytes = (int)slot;
  a->n_slot = (int)(n_slot < ST_MAX_SLOTS ? n_slot : ST_MAX_SLOTS);
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, ST_BLOCK, step_smem(a));
  if (e != cudaSuccess) return -(int)e;
  if (occ < 1) return -(int)cudaErrorInvalidConfiguration;
  const int nb = n_sm * (blocks_per_sm < occ ? blocks_per_sm : occ);
  return nb < ST_MAX_BLOCKS ? nb : ST_MAX_BLOCKS;
}

extern "C" int strata_decode_step(void *stream, const strata_step_args *a, int n_blocks) {
  if (!launchable(a) || n_blocks < 1 || n_blocks > ST_MAX_BLOCKS) return (int)cudaErrorInvalidValue;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)n_blocks);
  cfg.blockDim = dim3(ST_BLOCK);
  cfg.dynamicSmemBytes = step_smem(a);
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];   // cooperative: the driver refuses a grid whose blocks cannot all be resident
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, step_kernel(a), *a);
}
