"""cffi builder for strata._native, the CPU C core (native/cpu/*.c); run as a script to build it in place.

setup.py uses ``cffi_modules=["native/build_cpu.py:ffibuilder"]``. API mode (set_source), so calls release
the GIL. Compiled with -O3 and no -march flag: the AVX2+FMA kernels are compiled per function with a
target attribute and chosen at run time (STRATA_CPU_PATH=portable forces the plain-C path).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CPU = HERE / "cpu"

CDEF = """
const char *strata_cpu_path(void);
int strata_cpu_set_path(const char *name);
int strata_cpu_has_avx2(void);
int strata_cpu_has_avxvnni(void);
int strata_block_size(int type);
int strata_type_size(int type);
int strata_can_matmul(int type);
void strata_park_workers(void);
int strata_dequantize(int type, const void *src, int64_t src_row_bytes, int64_t n_rows, int64_t n_in,
                      float *dst, int n_threads);
int strata_get_rows(int type, const void *src, int64_t src_row_bytes, int64_t n_rows, int64_t n_in,
                    const int64_t *ids, int64_t n_ids, float *dst);
int strata_matmul(int type, const void *w, int64_t w_row_bytes, int64_t n_out, int64_t n_in,
                  const float *x, int64_t n_tokens, float *y, int n_threads);
int strata_attention(const float *q, int64_t n, int n_head, int n_kv, int hd, int hv,
                     const float *K, const float *V, int64_t pool_pages, int page_size,
                     const int32_t *pages, int64_t n_seq_pages, int64_t start, float scale,
                     const float *k_new, int64_t k_stride, const float *v_new, int64_t v_stride,
                     float *out, int n_threads);
int strata_rms_norm(const float *x, const float *r, const float *w, int64_t n, int64_t dim, float eps,
                    float *out, float *sum_out);
int strata_rope(const float *x, int64_t x_stride, int64_t n, int n_head, int hd, int n_rot, const int64_t *pos,
                const float *cos_t, const float *sin_t, int64_t n_table, int neox, float *out);
int strata_swiglu(const float *gate, const float *up, int64_t n, int64_t ff, int64_t stride, float *out);
"""

SOURCES = ["core.c", "portable.c", "avx2.c", "avxvnni.c", "attention.c", "ops.c"]


def make_builder(absolute: bool = False) -> FFI:
    """The FFI builder; paths relative to the working directory (what setuptools wants from setup.py) or
    absolute (for FFI.compile, which compiles inside its tmpdir)."""

    def path(p: Path) -> str:
        if absolute:
            return str(p)
        try:
            return os.path.relpath(p, os.getcwd())
        except ValueError:
            return str(p)

    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "strata._native",
        '#include "strata_cpu.h"\n',
        sources=[path(CPU / s) for s in SOURCES],
        include_dirs=[path(CPU)],
        extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing", "-Wall", "-Wno-unused-function"],
        libraries=["pthread"] if sys.platform != "win32" else [],
        depends=[path(CPU / f) for f in ("common.h", "strata_cpu.h", "kernels.inc", "avx2_dot32.inc")],
    )
    return ffi


ffibuilder = make_builder()


def build_in_place() -> str:
    """Compile strata/_native*.so next to strata/__init__.py; returns the path of the built module."""
    import shutil

    tmp = ROOT / "build" / "cffi_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    # compile in build/cffi_tmp, then copy the module into strata/
    out = make_builder(absolute=True).compile(tmpdir=str(tmp), verbose=False)
    dest = ROOT / "strata" / Path(out).name
    shutil.copy2(out, dest)
    return str(dest)


if __name__ == "__main__":
    print(build_in_place())
