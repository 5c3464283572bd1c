// GGUF block formats shared by the kernel files: type ids, block sizes, and the int8-activation (dp4a) dot of one
// 32-element weight sub-block with one q8_1 activation block. Formats follow llama.cpp's ggml-common.h /
// ggml-quants.c (dequantize_row_*, vec_dot_*_q8_1) and gguf-py quants.py.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

__host__ __device__ static inline int block_elems(int t) {
  return (t == T_Q4_K || t == T_Q5_K || t == T_Q6_K) ? 256 : (t == T_F32 || t == T_F16) ? 8 : 32;
}
__host__ __device__ static inline int block_bytes(int t) {
  switch (t) {
    case T_F32: return 32; case T_F16: return 16; case T_Q4_0: return 18; case T_Q4_1: return 20;
    case T_Q8_0: return 34; case T_Q4_K: return 144; case T_Q5_K: return 176; case T_Q6_K: return 210;
  }
  return 0;
}

__device__ static inline float ldh(const uint8_t *p) {
  return __half2float(*reinterpret_cast<const __half *>(p));
}

// get_scale_min_k4 from ggml-quants.c
__device__ static inline void scale_min_k4(int j, const uint8_t *q, float &d, float &m) {
  if (j < 4) {
    d = (float)(q[j] & 63);
    m = (float)(q[j + 4] & 63);
  } else {
    d = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

__device__ static inline int ld32a2(const uint8_t *p) {  // 4 bytes at a 2-byte aligned address
  const uint16_t *h = reinterpret_cast<const uint16_t *>(p);
  return (int)((uint32_t)h[0] | ((uint32_t)h[1] << 16));
}

// Dot of weight sub-block u (32 elements) of one row with the int8 x block u already in registers (x[8], xds).
template <int T>
__device__ static inline float dot_q8x(const uint8_t *__restrict__ row, int u, const int x[8], float2 xds) {
  if (T == T_Q4_0 || T == T_Q4_1) {
    const uint8_t *b = row + u * (T == T_Q4_0 ? 18 : 20);
    int q[4];
    if (T == T_Q4_1) {
      const int *p = reinterpret_cast<const int *>(b + 4);
#pragma unroll
      for (int i = 0; i < 4; i++) q[i] = p[i];
    } else {
#pragma unroll
      for (int i = 0; i < 4; i++) q[i] = ld32a2(b + 2 + 4 * i);
    }
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      s = __dp4a(q[i] & 0x0F0F0F0F, x[i], s);
      s = __dp4a((q[i] >> 4) & 0x0F0F0F0F, x[4 + i], s);
    }
    const float d = ldh(b);
    if (T == T_Q4_0) return d * (xds.x * (float)s - 8.0f * xds.y);
    return d * xds.x * (float)s + ldh(b + 2) * xds.y;
  } else if (T == T_Q8_0) {
    const uint8_t *b = row + u * 34;
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) s = __dp4a(ld32a2(b + 2 + 4 * i), x[i], s);
    return ldh(b) * xds.x * (float)s;
  } else if (T == T_Q4_K || T == T_Q5_K) {
    const int bs = T == T_Q4_K ? 144 : 176;
    const uint8_t *b = row + (u >> 3) * bs;
    const int j = u & 7, p = j >> 1, sh = 4 * (j & 1);
    const int4 *qp = reinterpret_cast<const int4 *>(b + (T == T_Q4_K ? 16 : 48) + 32 * p);
    const int4 q0 = qp[0], q1 = qp[1];
    int q[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = (q[i] >> sh) & 0x0F0F0F0F;
    if (T == T_Q5_K) {
      const int4 *hp = reinterpret_cast<const int4 *>(b + 16);
      const int4 h0 = hp[0], h1 = hp[1];
      const int h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
      for (int i = 0; i < 8; i++) q[i] |= ((h[i] >> j) & 0x01010101) << 4;
    }
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) s = __dp4a(q[i], x[i], s);
    float sc, mn;
    scale_min_k4(j, b + 4, sc, mn);
    return ldh(b) * sc * xds.x * (float)s - ldh(b + 2) * mn * xds.y;
  } else {  // T_Q6_K: sub-block u covers elements 32u..32u+31 of the row: half n, group g
    const uint8_t *b = row + (u >> 3) * 210;
    const int j = u & 7, n = j >> 2, g = j & 3;
    const uint8_t *ql = b + 64 * n + 32 * (g & 1);
    const uint8_t *qh = b + 128 + 32 * n;
    const int sl = g >= 2 ? 4 : 0, shh = 2 * g;
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const int lo = (ld32a2(ql + 4 * i) >> sl) & 0x0F0F0F0F;
      const int hi = ((ld32a2(qh + 4 * i) >> shh) & 0x03030303) << 4;
      const int v = __vsubss4(lo | hi, 0x20202020);      // q - 32 in [-32, 31]
      if (i < 4) s0 = __dp4a(v, x[i], s0); else s1 = __dp4a(v, x[i], s1);
    }
    const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192) + 8 * n + 2 * g;
    return ldh(b + 208) * xds.x * ((float)sc[0] * (float)s0 + (float)sc[1] * (float)s1);
  }
}

