/* Strata C core: the portable kernel set (plain C, baseline ISA of the target). */
#include "common.h"

#include "kernels.inc"

const st_kernels *st_kernels_portable(void) {
    static st_kernels k;
    static int done = 0;
    if (!done) { memset(&k, 0, sizeof k); fill_table(&k); k.name = "portable"; done = 1; }
    return &k;
}
