// q8_1 activation blocks shared by the kernels that feed the int8 (dp4a) decode matvec.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

// Warp-cooperative q8_1 store (llama.cpp quantize_q8_1; same arithmetic as k_quantize_q8_1): the 32 lanes of a
// warp hold the 32 consecutive elements i0 + lane of one block. xq int8 [n], ds float2 [n / 32] (d, d * sum q).
__device__ static inline void q8_store(float v, int i, int8_t *__restrict__ xq, float2 *__restrict__ ds) {
  float amax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float d = __fdiv_rn(amax, 127.0f);
  const int q = amax == 0.f ? 0 : __float2int_rn(__fdiv_rn(v, d));
  int sum = q;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  xq[i] = (int8_t)q;
  if ((i & 31) == 0) ds[i >> 5] = make_float2(d, d * (float)sum);
}

// q8_1 quantization of EPT consecutive values y per lane, G = 32 / EPT neighbouring lanes holding one 32-value
// block (all of them call it: full-mask shuffles): q the int8 values, d = absmax / 127 and sum (the block's sum of
// q) for its (d, d * sum) pair. Per element the arithmetic of q8_store (llama.cpp quantize_q8_1).
template <int EPT>
__device__ static inline void q8_chunk(const float (&y)[EPT], int (&q)[EPT], float &d, int &sum) {
  constexpr int G = EPT >= 32 ? 1 : 32 / EPT;
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < EPT; k++) amax = fmaxf(amax, fabsf(y[k]));
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  d = __fdiv_rn(amax, 127.0f);
  sum = 0;
#pragma unroll
  for (int k = 0; k < EPT; k++) {
    q[k] = amax == 0.f ? 0 : __float2int_rn(__fdiv_rn(y[k], d));
    sum += q[k];
  }
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
}
