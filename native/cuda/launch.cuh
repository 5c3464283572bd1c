// Kernel launches with programmatic dependent launch (PDL, sm_90+), shared by the kernel files.
//
// With PDL on (the default on compute capability >= 9.0; STRATA_CUDA_PDL=0 / strata_set_pdl(0) turn it off),
// st_launch gives each launch the
// cudaLaunchAttributeProgrammaticStreamSerialization attribute: the next kernel on the stream may be scheduled once
// every block of this one has run griddep_launch() (griddepcontrol.launch_dependents), and it runs up to its
// griddep_wait() (griddepcontrol.wait: the previous grid has completed and its memory is visible) early, so launch
// latency and read-only prologues (a matvec's weight prefetch) overlap the previous kernel. Every kernel launched
// through st_launch therefore starts with griddep_launch(), then griddep_wait() before it touches memory another
// kernel writes. With PDL off the launch is an ordinary one. CUDA C++ Programming Guide, "Programmatic Dependent
// Launch and Synchronization"; PTX ISA, griddepcontrol.
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

// Prefetch the 128-byte line holding p into L2 (no registers; used before griddep_wait for read-only weights).
__device__ __forceinline__ void prefetch_l2(const void *p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
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

// Host: whether the decode matvecs stage their rows (STRATA_CUDA_MV_STAGE=0: they prefetch into L2 only).
static inline int mv_stage_on() {
  const char *e = getenv("STRATA_CUDA_MV_STAGE");
  return e ? atoi(e) != 0 : 1;
}
