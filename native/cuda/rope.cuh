// RoPE's arithmetic for one pair of a decode row, shared by k_rope_kv_decode (rope_act.cu) and the QKV matvec's
// epilogue (matvec_fused.cu) so that both give the same bits.
#pragma once
#include <cuda_runtime.h>
#include <math.h>

// One decode RoPE pair, in two halves that every decode RoPE (k_rope_kv_decode, the QKV matvec's epilogue) calls,
// so they give the same bits whatever the compiler would contract. rope_angle: (cos, sin) of pair i at position
// pos, angle pos * base^(-2i / n_rot) in double precision (Su et al., RoFormer, eq. 34; llama.cpp's ggml_rope with
// theta_scale = base^(-2 / n_rot)).
__device__ static inline float2 rope_angle(int pos, int i, int n_rot, float base) {
  const double ang = (double)pos * pow((double)base, -2.0 * (double)i / (double)n_rot);
  return make_float2((float)cos(ang), (float)sin(ang));
}

// rope_apply: (x0, x1) rotated by cs = (cos, sin), each output one rounded product and one fused multiply-add.
__device__ static inline void rope_apply(float2 cs, float &x0, float &x1) {
  const float y0 = __fmaf_rn(x0, cs.x, __fmul_rn(-x1, cs.y)), y1 = __fmaf_rn(x0, cs.y, __fmul_rn(x1, cs.x));
  x0 = y0;
  x1 = y1;
}

__device__ static inline void rope_rotate(int pos, int i, int n_rot, float base, float &x0, float &x1) {
  rope_apply(rope_angle(pos, i, n_rot, base), x0, x1);
}

