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

#include "avx2_kquants.inc"

#include "avx2_iq.inc"

#include "avx2_float.inc"

ST_DEFINE_AVX2_CLASS_TABLE(st_kernels_avxvnni, "avxvnni")

#include "target_end.inc"

#endif /* x86-64 */
