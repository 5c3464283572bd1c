// Kernel launches with programmatic dependent launch (PDL, sm_90+), shared by the kernel files, with the device
// helpers they share: the block arrival counter, L2 prefetch, the block sum, weight staging, the kernel timeline trace.
//
// With PDL on (the default on compute capability >= 9.0; STRATA_CUDA_PDL=0 / strata_set_pdl(0) turn it off: launch.cu),
// st_launch gives each launch the cudaLaunchAttributeProgrammaticStreamSerialization attribute: the next kernel on
// the stream may be scheduled once every block of this one has run griddep_launch()
// (griddepcontrol.launch_dependents), and it runs up to its griddep_wait() (griddepcontrol.wait: the previous grid
// has completed and its memory is visible) early, so launch latency and read-only prologues (a matvec's weight
// prefetch) overlap the previous kernel. Every kernel launched through st_launch therefore starts with
// griddep_launch(), then griddep_wait() before it touches memory another kernel writes (or before it where the
// caller says no earlier kernel of the chain writes it: the decode graph's position and page table, pre_wait; any
// earlier kernel may still run then, not just the previous one). With PDL off the launch is an ordinary one. CUDA C++
// Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA, griddepcontrol.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

extern "C" int strata_get_pdl(void);

__device__ __forceinline__ void griddep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A block's arrival at a counter shared by blocks (the "last block" merges: split-K attention, the norm handoff):
// called by one thread after a barrier that orders the block's stores before it. acq_rel at GPU scope: it releases
// those stores (release is cumulative over the barrier) and, for the block that arrives last, acquires every other
// block's, which its threads then read after the next barrier — the pattern of CUTLASS's semaphore, and no
// __threadfence() by every storing thread. PTX ISA, "Memory Consistency Model" and atom. Returns the old value.
__device__ __forceinline__ unsigned arrive_acq_rel(unsigned *counter, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(v) : "memory");
  return old;
}

// Prefetch the 128-byte line holding p into L2 (no registers; used before griddep_wait for read-only weights).
__device__ __forceinline__ void prefetch_l2(const void *p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The sum of v over the block, returned to every thread (blockDim.x a multiple of 32; sh: 32 floats of shared memory).
// Every thread of the block calls it (barriers).
__device__ static inline float block_sum(float v, float *sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < nw; i++) t += sh[i];
  return t;
}

template <typename... Exp, typename... Act>
static inline cudaError_t st_launch(void (*kernel)(Exp...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                    Act &&...args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (strata_get_pdl()) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Act &&>(args)...);
}

// ---------------------------------------------------------------- weight staging before the PDL wait
// A decode matvec's weights are constants, so a block can copy its rows into shared memory *before* griddep_wait,
// while the previous kernel still runs; after the wait only the activation vector is read from L2 and the dot
// products read shared memory: the DRAM round trip of the weights leaves the dependent chain of kernels (a matvec
// that only prefetched into L2 still paid an L2 -> SM round trip after the wait). cp.async (sm_80+): 16-byte
// copies that complete asynchronously; PTX ISA, "cp.async".

// Shared-memory bytes that hold n bytes staged by stage_bytes (the 16-byte chunks that cover them).
__host__ __device__ __forceinline__ long long staged_size(long long n) { return ((n + 15) & ~15LL) + 16; }

// Copy the 16-byte chunks covering [src, src + n) into dst (16-byte aligned, staged_size(n) bytes), lanes
// `lane` of `nl` striding; returns where src[0] landed (dst + (src mod 16)), so every alignment of src holds for
// the copy. The chunks may extend up to 15 bytes before src and after src + n: they lie in the same 16-byte
// aligned chunk as a byte of [src, src + n), hence in the same allocation page. Completes at stage_wait().
__device__ __forceinline__ const uint8_t *stage_bytes(const uint8_t *src, long long n, uint8_t *dst, int lane,
                                                      int nl) {
  const uintptr_t a = (uintptr_t)src, a0 = a & ~(uintptr_t)15;
  const long long len = (long long)(((a + n + 15) & ~(uintptr_t)15) - a0);
  const unsigned d0 = (unsigned)__cvta_generic_to_shared(dst);
  for (long long o = 16LL * lane; o < len; o += 16LL * nl)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d0 + (unsigned)o), "l"(a0 + o) : "memory");
  asm volatile("cp.async.commit_group;" ::: "memory");
  return dst + (a - a0);
}

// Wait for this thread's stage_bytes copies; the caller then syncs the threads that read them (__syncwarp /
// __syncthreads).
__device__ __forceinline__ void stage_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---------------------------------------------------------------- kernel timeline trace (diagnostics)
// Built with -DST_KTRACE (bench/decode_timeline.py, at commit 568baa4, built such a library and read it; no bench on
// main reads it since issue #20, the instrumentation stays for the next profile): thread 0 of every block of the traced
// decode kernels records, per event, three uint64: %gridid (one per launch), %globaltimer (ns) and
// tag | event << 8 | %smid << 16 | blockIdx.x << 32 into the buffer strata_ktrace_set gave (KT_DEFINE_SETTER, in
// launch.cu; one region per SM), up to its capacity. Events: KT_START (after griddep_launch: the block is resident),
// KT_WAITED (griddep_wait returned), KT_STAGED (warp 0's staged weights are in shared memory), KT_END, and in the
// matvecs KT_NORMED (a fused norm's q8_1 x is in shared memory) and KT_DOTTED (warp 0's dots are done).
// Without ST_KTRACE, KT() is nothing and the kernels are unchanged.
enum { KT_START = 0, KT_WAITED = 1, KT_STAGED = 2, KT_END = 3, KT_NORMED = 4, KT_DOTTED = 5 };
enum { KT_MATVEC = 1, KT_MATVEC_BLOCK = 2, KT_GLU = 3, KT_ATTN = 4, KT_ATTN_MERGE = 5, KT_NORM = 6, KT_ARGMAX = 7 };
#ifdef ST_KTRACE
#define KT_SMS 256   // the buffer is cut into one region per SM (%smid), each with its own counter: no global atomic
// The traced kernels live in several translation units, each with its own copy of these variables (the library is
// built without relocatable device code): every unit registers kt_unit_set at load (kt_register, launch.cu), and
// strata_ktrace_set sets them all: the same buffer, and the same per-SM counters (KT_SMS, in device memory).
static __device__ unsigned long long *st_kt_buf;
static __device__ unsigned *st_kt_n, st_kt_cap;
__device__ __forceinline__ void kt_record(int tag, int ev) {
  if (threadIdx.x != 0 || !st_kt_buf) return;
  unsigned long long g, t;
  unsigned sm;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  sm %= KT_SMS;
  const unsigned per = st_kt_cap / KT_SMS, i = atomicAdd(st_kt_n + sm, 1u);
  if (i >= per) return;
  unsigned long long *r = st_kt_buf + 3ull * (sm * per + i);
  r[0] = g;
  r[1] = t;
  r[2] = (unsigned long long)(tag | ev << 8 | sm << 16) | (unsigned long long)blockIdx.x << 32;
}
#define KT(tag, ev) kt_record(tag, ev)
typedef void (*kt_unit_setter)(void *buf, unsigned cap, unsigned *counters);
void kt_register(kt_unit_setter set);
static void kt_unit_set(void *buf, unsigned cap, unsigned *counters) {
  cudaMemcpyToSymbol(st_kt_buf, &buf, sizeof(buf));
  cudaMemcpyToSymbol(st_kt_cap, &cap, sizeof(cap));
  cudaMemcpyToSymbol(st_kt_n, &counters, sizeof(counters));
}
static const int st_kt_registered = (kt_register(kt_unit_set), 1);
// strata_ktrace_set(buf, cap): trace into buf (cap records of 3 uint64, zeroed by the caller: unused records stay 0;
// NULL: off), counters reset; strata_ktrace_count(): records dropped for want of room (0: the trace is whole).
// Exported only by a -DST_KTRACE build (not in strata_cuda.h; a tracing tool finds them by name).
#define KT_DEFINE_SETTER                                                                                   \
  static kt_unit_setter st_kt_units[64];                                                                   \
  static int st_kt_n_units;                                                                                \
  static unsigned *st_kt_counters, st_kt_cap_host;                                                         \
  void kt_register(kt_unit_setter set) {                                                                   \
    if (st_kt_n_units < 64) st_kt_units[st_kt_n_units++] = set;                                            \
  }                                                                                                        \
  extern "C" int strata_ktrace_set(void *buf, unsigned cap) {                                              \
    if (!st_kt_counters && cudaMalloc(&st_kt_counters, KT_SMS * sizeof(unsigned)) != cudaSuccess) {        \
      st_kt_counters = nullptr;                                                                            \
      return (int)cudaGetLastError();                                                                      \
    }                                                                                                      \
    cudaMemset(st_kt_counters, 0, KT_SMS * sizeof(unsigned));                                              \
    for (int u = 0; u < st_kt_n_units; u++) st_kt_units[u](buf, cap, st_kt_counters);                      \
    st_kt_cap_host = cap;                                                                                  \
    return (int)cudaGetLastError();                                                                        \
  }                                                                                                        \
  extern "C" unsigned strata_ktrace_count(void) {                                                          \
    unsigned n[KT_SMS], dropped = 0;                                                                       \
    if (!st_kt_counters) return 0;                                                                         \
    cudaMemcpy(n, st_kt_counters, sizeof(n), cudaMemcpyDeviceToHost);                                      \
    for (int s = 0; s < KT_SMS; s++)                                                                       \
      if (n[s] > st_kt_cap_host / KT_SMS) dropped += n[s] - st_kt_cap_host / KT_SMS;                       \
    return dropped;                                                                                        \
  }
#else
#define KT(tag, ev) ((void)0)
#define KT_DEFINE_SETTER
#endif
