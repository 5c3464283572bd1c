"""The kernel library: strata/_cuda_kernels.so (built from native/cuda/ by native/build_cuda.py) opened once through
cffi in ABI mode with its header's declarations, and the pointer / stream / error helpers every launcher uses."""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

DEFAULT_LIB = Path(__file__).resolve().parents[2] / "_cuda_kernels.so"
SOURCE_HEADER = Path(__file__).resolve().parents[3] / "native" / "cuda" / "strata_cuda.h"

_lib = None
_ffi = None


class CudaUnavailable(RuntimeError):
    """Raised when the CUDA backend cannot start (no CuPy, no GPU, or no kernel library)."""


def unavailable_reason() -> str | None:
    """None if the CUDA backend can run here, else a one-line reason (for pytest skips and --device errors)."""
    try:
        import cupy
    except Exception as e:  # ImportError or a broken CUDA install
        return f"cupy is not importable ({type(e).__name__}: {e})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:
        hint = " (no NVIDIA GPU or driver here, or a driver older than this CuPy's CUDA)" \
            if "InsufficientDriver" in str(e) or "NoDevice" in str(e) else ""
        return f"no usable CUDA device ({e}){hint}"
    if importlib.util.find_spec("cffi") is None:
        return "cffi is not installed"
    if not lib_path().exists():
        return f"kernel library {lib_path()} missing (run: python native/build_cuda.py)"
    try:
        header_path()
    except CudaUnavailable as e:
        return str(e)
    return None


def lib_path() -> Path:
    """The kernel library this process loads: $STRATA_CUDA_LIB, else strata/_cuda_kernels.so."""
    return Path(os.environ.get("STRATA_CUDA_LIB", str(DEFAULT_LIB)))


def header_path(library: Path | None = None) -> Path:
    """The C header of a kernel library: the one its build copied beside it (``<library>.h``: the declarations of
    that very binary; installed with the package), else the source tree's native/cuda/strata_cuda.h (a library
    built by hand, e.g. $STRATA_CUDA_LIB). Raises CudaUnavailable when neither exists."""
    library = library or lib_path()
    for p in (library.with_suffix(".h"), SOURCE_HEADER):
        if p.exists():
            return p
    raise CudaUnavailable(f"no C header for {library} (expected {library.with_suffix('.h')} or {SOURCE_HEADER})")


def kernel_declarations(header: Path | None = None) -> str:
    """The header's declarations as cffi's cdef takes them: comments, preprocessor lines and the ``extern "C"``
    wrapper removed (the header is plain C otherwise: typedef'd structs and launcher prototypes)."""
    text = (header or header_path()).read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", "", text)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#") and 'extern "C"' not in ln]
    return re.sub(r"^\s*}\s*$", "", "\n".join(lines), flags=re.MULTILINE)   # the extern "C" block's brace


def open_kernel_library() -> tuple[Any, Any]:
    """(ffi, lib): the kernel library (strata/_cuda_kernels.so, or $STRATA_CUDA_LIB) opened through a new cffi FFI
    in ABI mode with its header's declarations (kernel_declarations). Raises CudaUnavailable when the library or its
    header is missing. The backend opens it once (``lib``); this is for tools that check a library by hand."""
    import cffi
    p = lib_path()
    if not p.exists():
        raise CudaUnavailable(f"kernel library {p} missing (run: python native/build_cuda.py)")
    ffi = cffi.FFI()
    h = header_path(p)
    try:
        ffi.cdef(kernel_declarations(h))
    except cffi.CDefError as e:
        raise CudaUnavailable(f"the kernel library's header {h} is not Strata's declarations: {e}") from None
    return ffi, ffi.dlopen(str(p))


def lib():
    """The cffi handle of the kernel library (loaded once per process)."""
    global _lib, _ffi
    if _lib is None:
        _ffi, _lib = open_kernel_library()
    return _lib


def ffi():
    """The cffi FFI the kernel library was opened with (every cdata passed to ``lib()`` comes from it)."""
    lib()
    return _ffi


def check(rc: int, what: str) -> None:
    """RuntimeError naming the launcher and the CUDA error when a launcher returned rc != 0 (1 = invalid argument:
    the launchers' size checks)."""
    if rc != 0:
        import cupy
        msg = str(cupy.cuda.runtime.CUDARuntimeError(int(rc)))      # "cudaErrorInvalidValue: invalid argument"
        raise RuntimeError(f"{what} failed: CUDA error {rc} ({msg})")


def ptr(a, off: int = 0) -> Any:
    """The device address of a CuPy array, or of a DeviceWeight's storage (anything with ``.data`` that is not a
    CuPy memory pointer), plus `off` 4-byte elements, as a cffi void*; None -> NULL."""
    if a is None:
        return _ffi.NULL
    d = a.data
    if not hasattr(d, "ptr"):          # a DeviceWeight: its storage array
        d = d.data
    return _ffi.cast("void *", d.ptr + 4 * off)


def fptr(a, off: int = 0) -> Any:
    """ptr(a, off) as float*."""
    return _ffi.cast("float *", a.data.ptr + 4 * off)


def addr(p: int) -> Any:
    """An integer device address as a cffi void*."""
    return _ffi.cast("void *", p)


def stream_ptr() -> Any:
    """CuPy's current stream as a cffi void* (every launcher's first argument)."""
    import cupy
    return _ffi.cast("void *", cupy.cuda.get_current_stream().ptr)
