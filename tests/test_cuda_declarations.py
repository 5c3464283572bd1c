"""The kernel library's C declarations: native/cuda/strata_cuda.h is the one source (the .cu files compile against
it, cffi reads it), so these CPU tests check that cffi takes it, that it declares exactly the launchers the .cu
files export, and which header a library is opened with."""

import re
from pathlib import Path

import cffi
import pytest

from strata.backend import cuda as C
from strata.backend.cuda import library as K

ROOT = Path(__file__).resolve().parent.parent
CUDA_SRC = ROOT / "native" / "cuda"


def _declared(text: str) -> set[str]:
    return set(re.findall(r"^\s*(?:int|void)\s+(strata_\w+)\s*\(", text, flags=re.MULTILINE))


def test_header_parses_in_cffi_and_declares_every_exported_launcher():
    """cffi parses the header's declarations, and the launchers it declares are exactly the extern "C" functions
    defined in native/cuda/*.cu."""
    decl = K.kernel_declarations(K.SOURCE_HEADER)
    assert "#" not in decl and "extern" not in decl and "/*" not in decl
    ffi = cffi.FFI()
    ffi.cdef(decl)
    declared = _declared(decl)
    defined = set()
    for cu in CUDA_SRC.glob("*.cu"):
        defined |= set(re.findall(r'extern "C" (?:int|void) (strata_\w+)\(', cu.read_text()))
    assert declared == defined, (declared - defined, defined - declared)
    assert {"strata_matvec_q8w_rope", "strata_sample", "strata_q35_conv", "strata_gdn_prep"} <= declared


def test_header_beside_the_library_wins_else_the_source_tree(tmp_path, monkeypatch):
    """A library's own header (<library>.h, copied there by its build) is the one read; a library without one (built
    by hand) gets the source tree's; neither: CudaUnavailable naming both paths."""
    lib = tmp_path / "k.so"
    assert K.header_path(lib) == K.SOURCE_HEADER
    own = tmp_path / "k.h"
    own.write_text("int strata_only_here(void *stream);\n")
    assert K.header_path(lib) == own
    assert _declared(K.kernel_declarations(own)) == {"strata_only_here"}
    own.unlink()
    monkeypatch.setattr(K, "SOURCE_HEADER", tmp_path / "absent.h")
    with pytest.raises(C.CudaUnavailable, match="k.h") as e:
        K.header_path(lib)
    assert "absent.h" in str(e.value)


def test_build_copies_the_header_beside_the_library(tmp_path, monkeypatch):
    """native/build_cuda.py writes <out>.h, the source header, next to the library it builds (a stand-in nvcc that
    only creates its -o file), and setup.py installs it with the library."""
    import os
    import stat
    monkeypatch.syspath_prepend(str(ROOT / "native"))
    from build_cuda import build_cuda_kernels
    fake = tmp_path / "nvcc"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do if [ "$1" = -o ]; then : > "$2"; fi; shift; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("NVCC", str(fake))
    out = tmp_path / "lib" / "k.so"
    out.parent.mkdir()
    assert build_cuda_kernels(out, ["90"], verbose=False) == str(out)
    assert out.exists() and os.access(fake, os.X_OK)
    assert (tmp_path / "lib" / "k.h").read_text() == K.SOURCE_HEADER.read_text()
    assert K.header_path(out) == tmp_path / "lib" / "k.h"
    assert '"_cuda_kernels.h"' in (ROOT / "setup.py").read_text()


def test_a_header_that_is_not_ours_is_cuda_unavailable(tmp_path, monkeypatch):
    """A library whose neighbouring header cffi cannot parse: CudaUnavailable naming the header (what the engine
    turns into "device 'cuda': ..."), not a cffi exception."""
    lib = tmp_path / "k.so"
    lib.write_bytes(b"")
    (tmp_path / "k.h").write_text("int strata_x(struct never_declared *p)\n")   # no ';': not C declarations
    monkeypatch.setenv("STRATA_CUDA_LIB", str(lib))
    with pytest.raises(C.CudaUnavailable, match="k.h"):
        K.open_kernel_library()
