"""cffi builder for strata._native, the CPU C core (native/cpu/*.c); run as a script to build it in place.

setup.py uses ``cffi_modules=["native/build_cpu.py:ffibuilder"]``. API mode (set_source), so calls release
the GIL. Compiled with -O3 and no -march flag: the AVX2+FMA kernels are compiled per function with a
target attribute and chosen at run time (STRATA_CPU_PATH=portable forces the plain-C path).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CPU = HERE / "cpu"

def cdef_from_header(header: Path) -> str:
    """The cffi cdef: the public header's declarations, without comments and preprocessor lines (one source of
    truth for the C API)."""
    text = re.sub(r"/\*.*?\*/", "", header.read_text(), flags=re.S)
    return "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))


CDEF = cdef_from_header(CPU / "strata_cpu.h")

SOURCES = ["core.c", "portable.c", "avx2.c", "avxvnni.c", "avx512.c", "attention.c", "ops.c", "iq_tables.c"]


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
        depends=[path(CPU / f) for f in ("common.h", "strata_cpu.h", "kernels.inc", "iq.inc", "iq_tables.h",
                                           "avx2_dot32.inc", "avx2_kquants.inc", "avx2_iq.inc", "avx2_float.inc",
                                           "target_avx2_begin.inc", "target_end.inc")],
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
