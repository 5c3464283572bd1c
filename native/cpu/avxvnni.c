/* Strata C core: the AVX-VNNI kernel set (avx2.c's kernels with vpdpbusd for the 8-bit dot products).
 * Selected at run time only when the CPU reports avx2, fma and avxvnni (Alder Lake, Sapphire Rapids,
 * Zen 5 and later). */
#include "common.h"

#if (defined(__x86_64__) || defined(_M_X64)) && ST_HAVE_AVXVNNI
#define ST_AVXVNNI 1

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,avxvnni"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
#endif

#include <immintrin.h>

#include "avx2_dot32.inc"

#include "kernels.inc"

const st_kernels *st_kernels_avxvnni(void) {
    static st_kernels k;
    static int done = 0;
    if (!done) {
        memset(&k, 0, sizeof k);
        fill_table(&k);
        k.dot2[ST_Q4_0] = dot_q4_0_2; k.dot2[ST_Q4_1] = dot_q4_1_2;
        k.dot2[ST_Q5_0] = dot_q5_0_2; k.dot2[ST_Q5_1] = dot_q5_1_2;
        k.name = "avxvnni";
        done = 1;
    }
    return &k;
}

#include "target_end.inc"

#endif /* x86-64 */
