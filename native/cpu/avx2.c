/* Strata C core: the AVX2+FMA kernel set (hand-written maddubs/madd dot products for the 32-element
 * types after ggml's ggml_vec_dot_q*_q8_* AVX2 kernels; the other kernels are the plain-C ones compiled
 * for AVX2 so gcc vectorizes them). Selected at run time only when the CPU reports avx2 and fma. */
#include "common.h"

#if defined(__x86_64__) || defined(_M_X64)

#include "target_avx2_begin.inc"

#include <immintrin.h>

#include "avx2_dot32.inc"

#include "kernels.inc"

#include "avx2_kquants.inc"

#include "avx2_iq.inc"

#include "avx2_float.inc"

ST_DEFINE_AVX2_CLASS_TABLE(st_kernels_avx2, "avx2")

#include "target_end.inc"

#endif /* x86-64 */
