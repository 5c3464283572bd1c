// The paged KV cache's addressing and raw K/V loads (f16 or q8_0), shared by the kernels that write or read it:
// kv_cache.cu, rope_act.cu, matvec_fused.cu (the QKV matvec's RoPE + K/V epilogue), attn_decode.cu, attn_prefill.cu.
//
// Cache layout: per layer K and V arrays (n_pages, page_size, n_kv, hd), f16 or q8_0 (int8 values and one f16 scale
// per 32); position p of a sequence lives in page pt[p / page_size], slot p % page_size.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Element offset of the hd values of (position p, KV head kvh) in a paged cache (n_pages, ps, n_kv, hd) by page table pt.
__device__ static inline long long kv_off(const int *__restrict__ pt, int p, int kvh, int n_kv, int hd, int ps) {
  return (((long long)pt[p / ps] * ps + (p % ps)) * n_kv + kvh) * hd;
}

// Element offset of (position pos, KV head h, dim d) in a paged cache (n_pages, ps, n_kv, hd) by page table pt.
__device__ static inline long long kv_index(const int *pt, int pos, int h, int d, int n_kv, int hd, int ps) {
  const int page = pt[pos / ps], slot = pos % ps;
  return (((long long)page * ps + slot) * n_kv + h) * hd + d;
}

// The raw cache words of 8 consecutive values at element offset e (f16: one 16-byte word; q8_0: 8 bytes in .x/.y
// and the block's scale), loaded without converting so that a thread can issue all its loads before using one.
template <bool Q8>
__device__ static inline void load_kv8_raw(const void *__restrict__ c, const __half *__restrict__ sc, long long e,
                                           uint4 &r, __half &d) {
  if (Q8) {
    const uint2 *p = reinterpret_cast<const uint2 *>(reinterpret_cast<const int8_t *>(c) + e);
    const uint2 t = *p;
    r = make_uint4(t.x, t.y, 0u, 0u);
    d = sc[e >> 5];
  } else {
    const uint4 *p = reinterpret_cast<const uint4 *>(reinterpret_cast<const __half *>(c) + e);
    r = *p;
  }
}

// The f32 values of the raw words of load_kv8_raw (q8_0: d * q).
template <bool Q8>
__device__ static inline void cvt_kv8(const uint4 &r, __half dh, float f[8]) {
  if (Q8) {
    const float d = __half2float(dh);
    const int8_t *q = reinterpret_cast<const int8_t *>(&r);
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = d * (float)q[i];
  } else {
    const __half2 *h = reinterpret_cast<const __half2 *>(&r);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 x = __half22float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
}

// 8 consecutive cache values at element offset e as f32: f16 (one 16-byte load) or q8_0 (8 bytes + the scale).
template <bool Q8>
__device__ static inline void load_kv8(const void *__restrict__ c, const __half *__restrict__ sc, long long e,
                                       float f[8]) {
  uint4 r;
  __half d = __float2half(0.f);
  load_kv8_raw<Q8>(c, sc, e, r, d);
  cvt_kv8<Q8>(r, d, f);
}

