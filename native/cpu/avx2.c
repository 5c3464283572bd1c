/* Strata C core: the AVX2+FMA kernel set (hand-written maddubs/madd dot products for the 32-element
 * types after ggml's ggml_vec_dot_q*_q8_* AVX2 kernels; the other kernels are the plain-C ones compiled
 * for AVX2 so gcc vectorizes them). Selected at run time only when the CPU reports avx2 and fma. */
#include "common.h"

#if defined(__x86_64__) || defined(_M_X64)

#include "target_avx2_begin.inc"

#include <immintrin.h>

#include "avx2_dot32.inc"

#include "kernels.inc"

const st_kernels *st_kernels_avx2(void) {
    static st_kernels k;
    static int done = 0;
    if (!done) {
        memset(&k, 0, sizeof k);
        fill_table(&k);
        k.dot2[ST_Q4_0] = dot_q4_0_2; k.dot2[ST_Q4_1] = dot_q4_1_2;
        k.dot2[ST_Q5_0] = dot_q5_0_2; k.dot2[ST_Q5_1] = dot_q5_1_2;
        k.name = "avx2";
        done = 1;
    }
    return &k;
}

#include "target_end.inc"

#endif /* x86-64 */
