// launch.cu: programmatic dependent launch on / off for every st_launch (strata_get_pdl / strata_set_pdl; launch.cuh).
// A -DST_KTRACE build also defines the kernel timeline trace's strata_ktrace_set / strata_ktrace_count here.
#include <cuda_runtime.h>
#include <stdlib.h>
#include "strata_cuda.h"
#include "launch.cuh"

KT_DEFINE_SETTER   // strata_ktrace_set / strata_ktrace_count in a -DST_KTRACE build (launch.cuh)

// Programmatic dependent launch for st_launch (launch.cuh): on by default on compute capability 9.0 and newer
// (H200: decode 1.05-1.35x, the same tokens; bench/gpu_throughput.py decode_no_pdl), STRATA_CUDA_PDL=0 (or
// false / no / off) turns it off, any other value forces it on; strata_set_pdl overrides both.
static int g_pdl = -1;
extern "C" int strata_get_pdl(void) {
  if (g_pdl < 0) {
    const char *e = getenv("STRATA_CUDA_PDL");
    if (e && e[0]) {   // "0", "false", "no", "off" (any case of the first letter): off; anything else: on
      const char c = e[0];
      g_pdl = !(c == '0' || c == 'f' || c == 'F' || c == 'n' || c == 'N' ||
                ((c == 'o' || c == 'O') && (e[1] == 'f' || e[1] == 'F')));
    } else {
      int dev = 0, major = 0;
      g_pdl = cudaGetDevice(&dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
    }
  }
  return g_pdl;
}
extern "C" void strata_set_pdl(int on) { g_pdl = on ? 1 : 0; }

