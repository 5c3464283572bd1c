"""GGML quantization types and WeightTensor: a GGUF tensor's packed blocks, dequantized and multiplied by the C core."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

try:  # the cffi C core (native/build_cpu.py); a checkout without the build falls back to numpy
    from strata import _native

    _ffi, _lib = _native.ffi, _native.lib
    _NATIVE_ERROR: str | None = None
except ImportError as _e:  # pragma: no cover - exercised only without the build
    _ffi = _lib = None
    _NATIVE_ERROR = str(_e)

T = GGMLQuantizationType

#: GGML types WeightTensor dequantizes and multiplies (C core; the numpy fallback covers the same set).
#: The IQ types (non-linear grids: native/cpu/iq.inc); the CUDA backend converts them to F16 at upload.
IQ_TYPES = frozenset({
    T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
})
SUPPORTED_TYPES = frozenset({
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
}) | IQ_TYPES

#: From this many tokens on, matmul dequantizes a tile of weight rows to fp32 and calls numpy's BLAS
#: instead of the Q8 integer kernels. Off by default (2^30): on a quiet 2-core Sapphire Rapids VM, 2-thread
#: OpenBLAS (AVX-512) beats the Q8 kernels (AVX-VNNI) by about 1.3x from 128-512 tokens on (bench/matmul.py),
#: but whenever the cores are shared it stalls in bursts (measured 30-400x slower: a 128-token prompt at
#: 22 tok/s instead of 450; also in a process that never loaded Strata, and nothing here limits its threads),
#: while the Q8 kernels degrade gracefully. Set the environment variable STRATA_BLAS_MIN_TOKENS (e.g. 128)
#: to use BLAS for large batches on a dedicated machine.
BLAS_MIN_TOKENS = int(os.environ.get("STRATA_BLAS_MIN_TOKENS", str(1 << 30)))
#: Up to this many tokens a BLAS product (BLAS_MIN_TOKENS on, or no C core) runs one token row at a time, so that row
#: i is bit-identical to the product of that row alone (the short read's exactness contract: BLAS blocks a reduction
#: by the batch's shape; the C core's kernels already reduce each token as they reduce one, at any token count).
ROWWISE_MAX_TOKENS = 16
#: Rows per dequantized tile on the BLAS path: at most about this many fp32 bytes at a time.
_BLAS_TILE_BYTES = 4 << 20

_THREADS = max(1, os.cpu_count() or 1)
_warned = False

_ERRORS = {-1: "unsupported GGML type", -2: "bad sizes", -3: "row id out of range", -4: "out of memory"}


def _fallback_warning() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"strata._native is not built ({_NATIVE_ERROR}); using the slow numpy path. Build it with "
                      "`python native/build_cpu.py` or `pip install -e .`", RuntimeWarning, stacklevel=3)


def native_available() -> bool:
    """True when the C core strata._native is importable."""
    return _lib is not None


def cpu_path() -> str:
    """The active kernel set: "avx512" (AVX-VNNI plus AVX-512 VNNI column kernels for products of 2 or more
    tokens), "avxvnni" (AVX2+FMA+AVX-VNNI), "avx2" (AVX2+FMA), "portable" (plain C) or
    "numpy" (no C core built); the C core picks the best one the CPU supports.

    STRATA_CPU_PATH=portable in the environment forces the plain-C path at import.
    """
    if _lib is None:
        return "numpy"
    return _ffi.string(_lib.strata_cpu_path()).decode()


def set_cpu_path(name: str) -> None:
    """Select the kernel set: "auto", "avx512", "avxvnni", "avx2" or "portable". Raises ValueError if unknown or
    unsupported by this CPU."""
    if _lib is None:
        raise ValueError("the C core strata._native is not built")
    if _lib.strata_cpu_set_path(str(name).encode()) != 0:
        raise ValueError(f"CPU path {name!r} is unknown or not supported by this CPU (use auto, avx512, avxvnni, avx2 or portable)")


def park_workers() -> None:
    """Let the C core's idle worker threads sleep now instead of spinning for the next call (call before
    long numpy/BLAS work so the workers do not compete with BLAS's own threads). No-op without the C core."""
    if _lib is not None:
        _lib.strata_park_workers()


def set_threads(n: int) -> None:
    """Set the number of CPU threads the C core uses for matmul and dequantize (n >= 1)."""
    global _THREADS
    if int(n) < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _THREADS = int(n)


def get_threads() -> int:
    """The number of CPU threads the C core uses."""
    return _THREADS


def block_shape(t: GGMLQuantizationType) -> tuple[int, int]:
    """(elements per block, bytes per block) of GGML type t (from ggml.h / gguf.constants.GGML_QUANT_SIZES)."""
    return GGML_QUANT_SIZES[t]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


@dataclass
class WeightTensor:
    """One model tensor as stored in the GGUF file.

    shape is numpy order: (n_out, n_in) for a matrix (GGUF's ``ne`` reversed). ``data`` is the raw
    storage: a uint8 array of packed blocks with shape (n_out, bytes_per_row) for quantized types, or a
    float array for F32/F16 (BF16 as uint16 bits). Block layouts are ggml's (ggml-common.h).
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    _raw_cache: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _layout_cache: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _ptr_cache: object = field(default=None, init=False, repr=False, compare=False)
    _fast_cache: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    # ---- layout ----

    def _layout(self) -> tuple[int, int, int]:
        """(n_rows, n_in, row_bytes); ValueError when the type is unsupported or the data size is wrong."""
        if self._layout_cache is not None:
            return self._layout_cache
        t = self.ggml_type
        if t not in SUPPORTED_TYPES:
            raise ValueError(f"tensor {self.name}: unsupported GGML type {getattr(t, 'name', t)}")
        if not self.shape:
            raise ValueError(f"tensor {self.name}: empty shape")
        n_in = int(self.shape[-1])
        n_rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        blck, size = GGML_QUANT_SIZES[t]
        if n_in % blck:
            raise ValueError(f"tensor {self.name}: row length {n_in} is not a multiple of the "
                             f"{t.name} block size {blck}")
        row_bytes = n_in // blck * size
        if self.data.nbytes != n_rows * row_bytes:
            raise ValueError(f"tensor {self.name}: {self.data.nbytes} data bytes, expected {n_rows * row_bytes} "
                             f"for {t.name} shape {tuple(self.shape)}")
        self._layout_cache = (n_rows, n_in, row_bytes)
        return self._layout_cache

    def _raw(self) -> np.ndarray:
        """The storage as a C-contiguous uint8 array (n_rows, row_bytes) (a view of a memory map if it is one)."""
        if self._raw_cache is None:
            n_rows, _, row_bytes = self._layout()
            d = self.data if self.data.flags.c_contiguous else np.ascontiguousarray(self.data)
            self._raw_cache = d.reshape(-1).view(np.uint8).reshape(n_rows, row_bytes)
        return self._raw_cache

    def _ptr(self):
        """cffi pointer to the packed storage (kept alive by the cached array)."""
        if self._ptr_cache is None:
            self._ptr_cache = _ffi.from_buffer(self._raw())
        return self._ptr_cache

    # ---- operations ----

    def dequantize(self) -> np.ndarray:
        """Return the tensor as float32 with shape ``self.shape`` (C core: ggml's dequantize_row_* formulas)."""
        t = self.ggml_type
        if t == T.F32:
            self._layout()
            return np.asarray(self.data, dtype=np.float32).reshape(self.shape)
        if _lib is None:
            _fallback_warning()
            return _np_dequantize(self)
        n_rows, n_in, row_bytes = self._layout()
        out = np.empty((n_rows, n_in), dtype=np.float32)
        raw = self._raw()
        _check(_lib.strata_dequantize(int(t), _ffi.from_buffer(raw), row_bytes, n_rows, n_in,
                                      _ffi.from_buffer("float[]", out), _THREADS), f"dequantize {self.name}")
        return out.reshape(self.shape)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantize selected rows (embedding lookup): ids int (n,) -> float32 (n, n_in).

        Raises ValueError when ids is not a 1-D integer array or an id is outside [0, n_rows).
        """
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"rows of {self.name}: ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
        n_rows, n_in, row_bytes = self._layout()
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            bad = ids[(ids < 0) | (ids >= n_rows)][0]
            raise ValueError(f"rows of {self.name}: id {int(bad)} out of range [0, {n_rows})")
        if _lib is None:
            _fallback_warning()
            sub = WeightTensor(self.name, self.ggml_type, (len(ids), n_in), np.ascontiguousarray(self._raw()[ids]))
            return _np_dequantize(sub)
        out = np.empty((len(ids), n_in), dtype=np.float32)
        if len(ids):
            _check(_lib.strata_get_rows(int(self.ggml_type), _ffi.from_buffer(self._raw()), row_bytes, n_rows, n_in,
                                        _ffi.from_buffer("int64_t[]", ids), len(ids),
                                        _ffi.from_buffer("float[]", out)), f"rows of {self.name}")
        return out

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T for x float32 (n_tokens, n_in) (or (n_in,)); returns float32 (n_tokens, n_out) (or (n_out,)).

        For n_tokens < BLAS_MIN_TOKENS the C core multiplies the packed weights. Quantized weights: the
        activations are quantized to Q8 (Q8_0-style blocks of 32 for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL, Q8_K blocks
        of 256 for the K-quants and the other IQ types) and multiplied with integer dot products on the packed
        blocks (llama.cpp's ggml_vec_dot_*_q8_* scheme), so the result carries the Q8 activation rounding (relative
        error ~1e-2 of |x||w|, see tests/test_quant.py). F32, F16 and BF16 weights: float32 products of x as it is
        (fp32 accumulation). Either way row i of the result is bit-identical to the product of x[i] alone, at any
        token count. From BLAS_MIN_TOKENS on (and without the C core), numpy's BLAS multiplies F32 weights as they
        are and tiles of the others' rows dequantized to fp32; there the bit-identity holds up to
        ROWWISE_MAX_TOKENS tokens. Raises ValueError for a wrong dtype, rank or row length.
        """
        fast = self._fast_cache
        if (fast is not None and type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 2
                and x.shape[1] == fast[1] and 0 < x.shape[0] < BLAS_MIN_TOKENS and x.flags.c_contiguous):
            # the integer-kernel path with the checks below already passed once for this tensor (decode)
            y = np.empty((x.shape[0], fast[0]), dtype=np.float32)
            _check(_lib.strata_matmul(fast[3], fast[4], fast[2], fast[0], fast[1], _ffi.from_buffer("float[]", x),
                                      x.shape[0], _ffi.from_buffer("float[]", y), _THREADS), f"matmul with {self.name}")
            return y
        if not isinstance(x, np.ndarray) or x.dtype != np.float32:
            raise ValueError(f"matmul with {self.name}: x must be a float32 numpy array, got "
                             f"{getattr(x, 'dtype', type(x).__name__)}")
        if len(self.shape) != 2:
            raise ValueError(f"matmul with {self.name}: weight must be 2-D, has shape {tuple(self.shape)}")
        n_out, n_in, row_bytes = self._layout()
        if x.ndim not in (1, 2) or x.shape[-1] != n_in:
            raise ValueError(f"matmul with {self.name}: x must have shape (n_tokens, {n_in}), got {x.shape}")
        squeeze = x.ndim == 1
        x2 = np.ascontiguousarray(x.reshape(-1, n_in))
        n_tok = x2.shape[0]
        t = self.ggml_type
        if n_tok == 0:
            y = np.zeros((0, n_out), dtype=np.float32)
        elif _lib is None and t != T.F32:
            _fallback_warning()
            y = x2 @ _np_dequantize(self).reshape(n_out, n_in).T
        elif _lib is None or n_tok >= BLAS_MIN_TOKENS or not _lib.strata_can_matmul(int(t)):
            y = self._matmul_blas(x2, n_out, n_in, row_bytes)
        else:
            self._fast_cache = (n_out, n_in, row_bytes, int(t), self._ptr())
            y = np.empty((n_tok, n_out), dtype=np.float32)
            _check(_lib.strata_matmul(int(t), self._ptr(), row_bytes, n_out, n_in,
                                      _ffi.from_buffer("float[]", x2), n_tok, _ffi.from_buffer("float[]", y),
                                      _THREADS), f"matmul with {self.name}")
        return y[0] if squeeze else y

    def _matmul_blas(self, x2: np.ndarray, n_out: int, n_in: int, row_bytes: int) -> np.ndarray:
        """x2 @ W.T by numpy's BLAS: F32 weights as they are, the others by dequantizing tiles of rows (C core),
        never a whole fp32 copy. Up to ROWWISE_MAX_TOKENS tokens, one token row at a time."""
        rowwise = 1 < x2.shape[0] <= ROWWISE_MAX_TOKENS
        if self.ggml_type == T.F32:
            wt = np.asarray(self.data, dtype=np.float32).reshape(n_out, n_in).T
            if not rowwise:
                return x2 @ wt
            y = np.empty((x2.shape[0], n_out), dtype=np.float32)
            for i in range(x2.shape[0]):
                y[i:i + 1] = x2[i:i + 1] @ wt
            return y
        raw = self._raw()
        y = np.empty((x2.shape[0], n_out), dtype=np.float32)
        tile_rows = max(16, min(n_out, _BLAS_TILE_BYTES // (4 * n_in)))
        buf = np.empty((tile_rows, n_in), dtype=np.float32)
        for r0 in range(0, n_out, tile_rows):
            r1 = min(n_out, r0 + tile_rows)
            tile = buf[: r1 - r0]
            _check(_lib.strata_dequantize(int(self.ggml_type), _ffi.from_buffer(raw[r0:r1]), row_bytes, r1 - r0,
                                          n_in, _ffi.from_buffer("float[]", tile), _THREADS),
                   f"matmul with {self.name}")
            _lib.strata_park_workers()  # idle C-core workers sleep instead of spinning against BLAS's threads
            if rowwise:
                for i in range(x2.shape[0]):
                    np.matmul(x2[i:i + 1], tile.T, out=y[i:i + 1, r0:r1])
            else:
                np.matmul(x2, tile.T, out=y[:, r0:r1])
        return y


def _np_dequantize(w: WeightTensor) -> np.ndarray:
    """numpy reference path (gguf.quants), used only when the C core is not built."""
    t = w.ggml_type
    if t == T.F32:
        return np.asarray(w.data, dtype=np.float32).reshape(w.shape)
    if t == T.F16:
        return np.asarray(w.data).view(np.float16).astype(np.float32).reshape(w.shape)
    if t == T.BF16:
        bits = np.asarray(w.data).reshape(-1).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(w.shape)
    return np.asarray(gguf_quants.dequantize(w._raw(), t), dtype=np.float32).reshape(w.shape)
