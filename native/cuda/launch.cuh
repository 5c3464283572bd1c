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
