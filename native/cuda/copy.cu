// copy.cu: batched device-to-device copies in one launch (a speculative verify's Commit: every recurrent layer's
// kept window and state into its running state).
#include <cuda_runtime.h>
#include <stdint.h>
#include "strata_cuda.h"
#include "launch.cuh"

// Block (x, i) of grid (chunks, n) copies its share of copy i: table[3 i] = dst, table[3 i + 1] = src,
// table[3 i + 2] = bytes (addresses and sizes multiples of 16 take 16-byte moves, else bytes).
__global__ void k_copy_many(const unsigned long long *__restrict__ table) {
  griddep_launch();
  griddep_wait();
  const int i = blockIdx.y;
  char *dst = reinterpret_cast<char *>(table[3 * i]);
  const char *src = reinterpret_cast<const char *>(table[3 * i + 1]);
  const unsigned long long nb = table[3 * i + 2];
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  const unsigned long long t0 = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | nb) & 15) == 0) {
    int4 *d = reinterpret_cast<int4 *>(dst);
    const int4 *s = reinterpret_cast<const int4 *>(src);
    for (unsigned long long k = t0; k < nb / 16; k += step) d[k] = s[k];
  } else {
    for (unsigned long long k = t0; k < nb; k += step) dst[k] = src[k];
  }
}

extern "C" int strata_copy_many(void *stream, const void *table, int n, long long max_bytes) {
  if (n < 0 || n > 65535 || max_bytes < 0) return (int)cudaErrorInvalidValue;
  if (n == 0 || max_bytes == 0) return 0;
  long long chunks = (max_bytes / 16 + 255) / 256;        // blocks per copy: a 16-byte move per thread
  if (chunks > 128) chunks = 128;
  if (chunks < 1) chunks = 1;
  st_launch(k_copy_many, dim3((unsigned)chunks, (unsigned)n), dim3(256), 0, (cudaStream_t)stream,
            (const unsigned long long *)table);
  return (int)cudaGetLastError();
}
