// Host and device pieces shared by the matvec kernel files (matvec.cu, matvec_fused.cu): the weight-type dispatch,
// row sizes, the int8-activation launchers' argument check and the q8_1 activation block load.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#include "strata_cuda.h"
#include "quant.cuh"

// A switch over the weight types with a kernel: F(type) for each; any other type returns cudaErrorInvalidValue.
#define DISPATCH_TYPE(t, F) \
  switch (t) { \
    case T_F32: F(T_F32); break; case T_F16: F(T_F16); break; case T_Q4_0: F(T_Q4_0); break; \
    case T_Q4_1: F(T_Q4_1); break; case T_Q8_0: F(T_Q8_0); break; case T_Q4_K: F(T_Q4_K); break; \
    case T_Q5_K: F(T_Q5_K); break; case T_Q6_K: F(T_Q6_K); break; default: return (int)cudaErrorInvalidValue; }

// The same for the types of the int8-activation (dp4a) kernels (strata_matvec_q8_supported).
#define DISPATCH_Q8_TYPE(t, F) \
  switch (t) { \
    case T_Q4_0: F(T_Q4_0); break; case T_Q4_1: F(T_Q4_1); break; case T_Q8_0: F(T_Q8_0); break; \
    case T_Q4_K: F(T_Q4_K); break; case T_Q5_K: F(T_Q5_K); break; case T_Q6_K: F(T_Q6_K); break; \
    default: return (int)cudaErrorInvalidValue; }

static inline long long row_bytes_of(int t, int n_in) {
  return (long long)(n_in / block_elems(t)) * block_bytes(t);
}

// Rows (or row pairs) per warp / block of the decode matvec kernels for a requested count: 1, 2 or 4 (the
// instantiated ones; more is 4, fewer than 2 is 1).
static inline int rows_1_2_4(int n) { return n >= 4 ? 4 : n >= 2 ? 2 : 1; }

// The arguments every int8-activation matvec launcher checks: a dp4a type, n_in a whole number of blocks and of q8_1
// blocks, rows, 16-byte aligned weights and activations.
static int q8_matvec_check(int t, const void *w, const void *xq, int n_out, int n_in) {
  if (!strata_matvec_q8_supported(t) || n_in <= 0 || n_in % block_elems(t) || n_in % 32 || n_out <= 0 || !w || !xq)
    return (int)cudaErrorInvalidValue;
  if (((uintptr_t)xq & 15) || ((uintptr_t)w & 15)) return (int)cudaErrorMisalignedAddress;
  return 0;
}

// q8_1 activation block u (8 ints of int8 values) into registers: two 16-byte loads through the read-only cache.
__device__ static inline void load_xq(const int *__restrict__ xq, int u, int x[8]) {
  const int4 a = __ldg(reinterpret_cast<const int4 *>(xq) + 2 * u), b = __ldg(reinterpret_cast<const int4 *>(xq) + 2 * u + 1);
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

