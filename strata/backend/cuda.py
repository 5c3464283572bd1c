"""The CUDA backend: CuPy owns device memory, streams, graphs and cuBLAS; Strata's raw kernels (strata/_cuda_kernels.so,
built from native/cuda/ by native/build_cuda.py) are loaded through cffi in ABI mode and launched on CuPy's stream.

The model is defined once, in ``strata/models/llama.py`` (LlamaModel on Backend ops). This module gives it:

* ``CudaBackend``: the Backend ops of docs/internals.md on CuPy arrays (upload, embed, matmul, rms_norm, rope,
  attention, swiglu, to_host) and ``new_page_pool`` -> ``CudaPagePool`` (f16 or q8_0 KV pages on the device), so
  LlamaModel.forward runs on the GPU unchanged (hybrid models, and every forward the plan below does not take).
* ``LlamaCuda``: the CUDA execution plan of LlamaModel, built from the LlamaModel's own uploaded weights and config
  and the sequence's CudaPagePool pages: the one-token decode step (fused launches, preallocated buffers, captured
  once per context-size class as a CUDA graph: one graph launch per token) and the prefill (cuBLAS + FA2).
* ``GraphDecodeModel`` (``CudaBackend.fast_path(model)``): what the engine runs; forwards go through LlamaCuda where
  it applies, everything else is LlamaModel.

Numerics: weights are dequantized exactly as llama.cpp's dequantize_row_* (f32 arithmetic); decode matvecs take
int8 (q8_1) activations (STRATA_CUDA_DP4A=0: f32); prefill GEMMs take f16 activations and f16 weights with f32
accumulation; the KV cache is f16 or q8_0 (--kv).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strata.backend.base import Backend
from strata.memory.kv import DEFAULT_PAGE_SIZE, PagedKV, PagePool
from strata.memory.memory import host_copy

# The kernel library's C declarations are native/cuda/strata_cuda.h (the header the .cu files compile against),
# read by kernel_declarations(); nothing here repeats them.


# Decode matvec (one token) on int8 activations with __dp4a for Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights, the
# activations rounded to q8_1 blocks by the kernel that produces them (RMSNorm, attention, SwiGLU), as llama.cpp's
# mmvq and Strata's CPU backend do. STRATA_CUDA_DP4A=0 keeps f32 activations (f32 dequantize-and-dot kernel): ~3e-4
# rel. L2 in the logits instead of 5e-3..1.4e-2, at a lower speed on models whose matvecs are not launch-bound.
DP4A = os.environ.get("STRATA_CUDA_DP4A", "1") not in ("0", "false", "no", "")

# Decode attention kernel: "auto" (default) = the first split-K kernel ("v1": per-head splits + a combine launch)
# below AUTO_V2_FROM positions and the GQA-shared self-merging split-K kernel ("v2") from there (and for a q8_0 cache
# always), as measured on the H200 (bench/cuda_kernels.py: 6.7 vs 9.7 us at 512 positions, 18.4 vs 13.8 at 4096;
# decode at depth 0 1277 vs 1023 tok/s on SmolLM2). Prefill attention is FlashAttention-2 (mma.sync) except with
# "v1" (the first wmma flash kernel). STRATA_CUDA_ATTN=v1|v2|auto.
ATTN = os.environ.get("STRATA_CUDA_ATTN", "auto")
AUTO_V2_FROM = 4096

# Prefill attention through the tiled flash-style kernels for head_dim 64 / 128; STRATA_CUDA_FLASH=0 keeps the
# materialized-score path (cuBLAS f32 + strata_causal_softmax).
FLASH = os.environ.get("STRATA_CUDA_FLASH", "1") not in ("0", "false", "no")
FLASH_HEAD_DIMS = (64, 128)


def _env_int(name: str, default: int) -> int:
    """An integer setting from the environment (unset or empty: default); ValueError naming the variable."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None


# Decode matvec rows per warp (strata_matvec_q8w); 0 = by size (1 up to 4096 rows, else 2).
MV_ROWS = _env_int("STRATA_CUDA_MV_ROWS", 0)


_OFF = ("0", "false", "no", "off", "")   # the values that turn an on / off setting off


def _env_on(name: str, default: bool) -> bool:
    """An on / off setting from the environment: off for 0 / false / no / off / empty, on for anything else."""
    v = os.environ.get(name)
    return default if v is None else v not in _OFF


def glu_settings(env: str | None) -> tuple[bool, bool]:
    """(llama graph, hybrid graph) use of the fused SwiGLU matvec for a STRATA_CUDA_GLU value (None: unset)."""
    if env is None:
        return True, False
    return env not in _OFF, env not in _OFF


# SwiGLU fused into the gate/up decode matvec (strata_matvec_q8w_glu: the block that makes 32 activations also
# writes their q8_1 block, one launch fewer per layer; bit-identical). Measured on the H200 (bench/decode_variants.py,
# interleaved rounds, same tokens): in the llama decode graph with the down projection on strata_matvec_q8b it wins
# on both models (1.7B Q4_K: +1.5 / +1.5 / +2.0% at depth 0 / 4096 / 16384; SmolLM2 +4-6% at depth 0 in three
# sessions' same-run rows, even deeper; before q8b it lost 8% on the 1.7B model), so the llama graph uses it; in the
# hybrid decode graph it loses 14% (bench/gpu_hybrid_model.py: 684 -> 588 tok/s at depth 0), so that graph does not.
# STRATA_CUDA_GLU=1 / 0 (or false / no / off / empty) forces it on / off in both. STRATA_CUDA_GLU_RP: gate/up row
# pairs per warp (1, 2 or 4; 0 = by size, glu_pairs_per_warp).
GLU, GLU_HYBRID = glu_settings(os.environ.get("STRATA_CUDA_GLU"))
GLU_RP = _env_int("STRATA_CUDA_GLU_RP", 0)


def glu_pairs_per_warp(n_ff: int, n_sm: int) -> int:
    """Row pairs per warp of strata_matvec_q8w_glu for n_ff activations: STRATA_CUDA_GLU_RP, else the most (4, 2)
    that still gives >= 16 warps per multiprocessor, else 1."""
    if GLU_RP:
        return GLU_RP
    for rp in (4, 2):
        if n_ff // rp >= 16 * n_sm:
            return rp
    return 1


# RoPE and the K / V cache write in the epilogue of the llama decode graph's QKV matvec (strata_matvec_q8w_rope: one
# launch per layer fewer, bit-identical) where it applies: fused Q|K|V weight with a dp4a kernel, adjacent RoPE
# pairs (not NeoX), f16 cache. STRATA_CUDA_QKV_ROPE=0 keeps the separate strata_rope_kv_decode launch.
QKV_ROPE = _env_on("STRATA_CUDA_QKV_ROPE", True)

# The first split-K decode kernel merges its splits itself in the llama decode step (the last block of each head, an
# atomic count per head; strata_attn_decode_ex with counters): one launch per layer fewer, the same arithmetic.
# STRATA_CUDA_ATTN_MERGE=0 keeps the separate combine launch.
ATTN_MERGE = _env_on("STRATA_CUDA_ATTN_MERGE", True)

# In a captured decode graph the position, the length and the page table change only between replays, so the QKV
# matvec's RoPE epilogue (angles, cache slots) and the first split-K attention kernel (length, pages) read them
# before their PDL wait, off the dependent chain. STRATA_CUDA_PRE_WAIT=0 reads them after the wait.
PRE_WAIT = _env_on("STRATA_CUDA_PRE_WAIT", True)


# The llama decode graph's two RMSNorms per layer computed inside the QKV and gate/up matvecs (every block
# normalizes the residual stream itself after its weights are staged, strata_matvec_q8w_rope /
# strata_matvec_q8w_glu_norm: two launches per layer fewer) where the plan fuses RoPE and SwiGLU and the kernels fit
# (LlamaCuda.fused_norm_rows); STRATA_CUDA_FUSED_NORM=0 keeps the separate strata_rms_norm_ex launches. FUSED_NORM_R:
# QKV rows per warp then (4: a quarter of the blocks, each of which reads the residual stream; fewer if the staged
# rows would not fit).
FUSED_NORM = _env_on("STRATA_CUDA_FUSED_NORM", True)
FUSED_NORM_R = _env_int("STRATA_CUDA_FUSED_NORM_R", 4)

# The norm handoff, preferred to the fused norms where it applies (LlamaCuda.handoff_ok): the output and down
# projections add their products to the residual stream in place and, per 32-row group, write q8_1(x * the next
# norm's weight) and the group's sum of x^2 (strata_matvec_q8_resid); the QKV and gate/up matvecs read those as their
# int8 input and scale their dot products by 1 / rms (norm_ss): no norm on the dependent chain of a layer.
# STRATA_CUDA_NORM_HANDOFF=0 keeps the fused norms.
NORM_HANDOFF = _env_on("STRATA_CUDA_NORM_HANDOFF", True)
HANDOFF_R = _env_int("STRATA_CUDA_HANDOFF_R", 4)   # QKV rows per warp then


# Prefill GEMMs read f16 copies of the weights kept on the device (2 bytes per weight, made once) instead of
# dequantizing each weight per ubatch: STRATA_CUDA_F16_WEIGHTS=1. Off by default (it costs ~3.5x the memory of a
# 4-bit model).
F16_WEIGHTS = os.environ.get("STRATA_CUDA_F16_WEIGHTS", "0") not in ("0", "false", "no", "")

KV_DTYPES = ("f16", "q8_0")   # KV cache types of CudaPagePool (--kv)

# The persistent decode step (decode_step.cu: one cooperative launch per token, grid-wide barriers between the
# phases of each layer instead of ~9 launches per layer, every block's weight rows streamed into a shared-memory
# ring by bulk copies that run ahead of the phases) for llama models it can run (compute capability >= 9.0, f16 KV
# cache, head_dim 64 / 128, <= 4 query heads per KV head, RoPE on adjacent pairs, dp4a weight types): opt-in,
# STRATA_CUDA_STEP=1; see docs/cuda.md for its measurements. STRATA_CUDA_STEP_BPS: blocks (of 256 threads: 7
# consumer warps and a producer) per multiprocessor, each with its own ring in the multiprocessor's shared memory
# (capped by the kernel's register occupancy: 1 on the H200).
STEP = _env_on("STRATA_CUDA_STEP", False)
STEP_BPS = _env_int("STRATA_CUDA_STEP_BPS", 1)

MAX_SPLIT = 256          # split-K partitions of the v1 decode attention (about 64 positions each)
GQA_MAX_SPLIT = 256      # split-K partitions of the v2 decode attention (DA_MAX_SPLIT in attention.cu)


# Positions per block of the v1 decode attention's split (n_split_for); STRATA_CUDA_ATTN_V1_CHUNK overrides.
V1_CHUNK = _env_int("STRATA_CUDA_ATTN_V1_CHUNK", 64)


def n_split_for(length: int) -> int:
    """Split-K partitions for the v1 decode attention over length positions: ~V1_CHUNK (64) positions per block."""
    c = max(1, V1_CHUNK)
    return max(1, min(MAX_SPLIT, (length + c - 1) // c))


# The v2 decode attention's split: at least ATTN_CHUNK positions per block, about ATTN_BPS blocks per multiprocessor
# and at most ATTN_MAX_SPLIT splits (the last block's merge reads every split's partial). Measured on the H200
# (session 4's bench/cuda_kernels.py, a sweep of chunk 32..256 x 4..16 blocks per SM with the double-buffered kernel,
# cuda_kernels_NVIDIA_H200.json; decode A/B in
# bench/decode_variants.py): 128 positions per block were best at 4096 positions (SmolLM2's 3 KV heads 15.7 -> 13.4
# us, 8 KV heads hd128 20.1 -> 14.4 us vs 64), and at 16384 positions 64 splits beat 128 (3 KV heads 33.0 -> 20.3 us;
# 8 KV heads equal), so at most 64 splits. A decode plan sizes the split for the shortest length of its context-size
# class (n_split_class). STRATA_CUDA_ATTN_CHUNK / _BPS / _MAX_SPLIT override.
ATTN_CHUNK = _env_int("STRATA_CUDA_ATTN_CHUNK", 128)
ATTN_BPS = _env_int("STRATA_CUDA_ATTN_BPS", 4)
ATTN_MAX_SPLIT = min(GQA_MAX_SPLIT, _env_int("STRATA_CUDA_ATTN_MAX_SPLIT", 64))
# ... and no more splits than fit in one wave: n_kv x n_split <= the kernel's resident blocks per multiprocessor x
# multiprocessors. Its registers (157 per thread for hd 128 with 2 query heads per KV head, 198 for hd 64 with 3)
# leave 2-3 blocks per SM on the H200, not the 4 of ATTN_BPS: 8 KV heads x 64 splits = 512 blocks ran in 1.29 waves
# (Nsight Compute). Measured (bench/cuda_kernels.py --only-attn-decode, attn_split_sweep_NVIDIA_H200.json) at 16K
# positions: 16 / 8 heads of 128 36.6 -> 28.1 us (49 splits: 392 blocks <= 396 resident), 32 / 8 heads 55.3 -> 39.6
# us (33 splits), SmolLM2's 3 KV heads unchanged (64 splits already fit). STRATA_CUDA_ATTN_ONE_WAVE=0 turns it off.
ATTN_ONE_WAVE = _env_on("STRATA_CUDA_ATTN_ONE_WAVE", True)


_RESIDENT: dict[tuple, int] = {}


def gqa_resident(hd: int, g: int, q8: bool) -> int:
    """Blocks of the v2 decode attention kernel (head size hd, g query heads per KV head, q8_0 or f16 cache, and
    the STRATA_CUDA_ATTN_DB variant) resident per multiprocessor of the current GPU; 0 when the shape has no kernel
    or the query fails (then the split is not capped). Cached per shape and variant once known."""
    key = (int(hd), int(g), bool(q8), os.environ.get("STRATA_CUDA_ATTN_DB"))
    n = _RESIDENT.get(key)
    if n is None:
        n = max(0, int(lib().strata_attn_decode_gqa_occupancy(key[0], key[1], int(key[2]))))
        if n > 0:
            _RESIDENT[key] = n
    return n


def n_split_gqa(length: int, n_kv: int, n_sm: int, chunk: int | None = None, bps: int | None = None,
                resident: int = 0) -> int:
    """Split-K partitions for the v2 decode attention (grid n_kv x n_split): at least `chunk` (ATTN_CHUNK) positions
    per block, about `bps` (ATTN_BPS) blocks per multiprocessor, at most ATTN_MAX_SPLIT, and (ATTN_ONE_WAVE, given
    the kernel's `resident` blocks per multiprocessor, gqa_resident) no more blocks than run at once."""
    c = max(1, int(chunk or ATTN_CHUNK))
    b = max(1, int(bps or ATTN_BPS))
    s = max(1, min(ATTN_MAX_SPLIT, -(-length // c), max(1, b * n_sm // max(1, n_kv))))
    if ATTN_ONE_WAVE and resident > 0:
        s = min(s, max(1, resident * n_sm // max(1, n_kv)))
    return s


def n_split_class(size_class: int, n_kv: int, n_sm: int, resident: int = 0) -> int:
    """The v2 split of a decode plan's context-size class (lengths size_class / 2 + 1 .. size_class, or 1 .. 256 for
    the first class; one captured graph): n_split_gqa of the class's shortest length, so every length in it gets
    >= ATTN_CHUNK positions per block (sized for the longest, a step just past the class boundary got half that: 33
    vs 20 us at 16K positions)."""
    return n_split_gqa(max(1, size_class // 2), n_kv, n_sm, resident=resident)


# The llama decode graph's down projection, when its rows hold at least this many 32-element sub-blocks (n_ff >=
# 4096), runs one block of 4 warps per row (strata_matvec_q8b) instead of one warp per row (measured on the H200: syn
# decode +2.3-3.8%; other matrices not measured, so they keep q8w); STRATA_CUDA_MV_BLOCK_FROM=0 turns that off.
MV_BLOCK_FROM = _env_int("STRATA_CUDA_MV_BLOCK_FROM", 128)
# Rows per block of that kernel (1, 2 or 4; STRATA_CUDA_MV_BLOCK_ROWS). Session 11 measured 2 at +1.1 / +1.3 / +0.3%
# (depth 0 / 1000 / 4096, syn, with the norm handoff; decode_variants_syn_session11_sweep_NVIDIA_H200.json) and +1.1 /
# +0.4 / +1.1% (0 / 4096 / 16384) in another run, 0.974 / 1.035 with session 10's fused norms; the default stays 1
# until 2 has been through the GPU parity tests with the final kernels (docs/cuda.md, session 11).
MV_BLOCK_ROWS = _env_int("STRATA_CUDA_MV_BLOCK_ROWS", 1)


def rows_per_warp(n_out: int) -> int:
    """Rows per warp of strata_matvec_q8w for a matrix of n_out rows: STRATA_CUDA_MV_ROWS, else 1 up to 4096 rows
    and 2 above (bench/cuda_kernels.py: 1 is fastest or within 5% on the H200 at every size measured)."""
    return MV_ROWS or (1 if n_out <= 4096 else 2)


# GGML type ids handled by the quantized kernels (ggml.h numbering).
SUPPORTED_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
DEFAULT_LIB = Path(__file__).resolve().parent.parent / "_cuda_kernels.so"

_lib = None
_ffi = None


class CudaUnavailable(RuntimeError):
    """Raised when the CUDA backend cannot start (no CuPy, no GPU, or no kernel library)."""


def unavailable_reason() -> str | None:
    """None if the CUDA backend can run here, else a one-line reason (for pytest skips and --device errors)."""
    try:
        import cupy  # noqa: F401
    except Exception as e:  # ImportError or a broken CUDA install
        return f"cupy is not importable ({type(e).__name__}: {e})"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:
        hint = " (no NVIDIA GPU or driver here, or a driver older than this CuPy's CUDA)" \
            if "InsufficientDriver" in str(e) or "NoDevice" in str(e) else ""
        return f"no usable CUDA device ({e}){hint}"
    try:
        import cffi  # noqa: F401
    except ImportError:
        return "cffi is not installed"
    if not _lib_path().exists():
        return f"kernel library {_lib_path()} missing (run: python native/build_cuda.py)"
    try:
        header_path()
    except CudaUnavailable as e:
        return str(e)
    return None


def _lib_path() -> Path:
    return Path(os.environ.get("STRATA_CUDA_LIB", str(DEFAULT_LIB)))


SOURCE_HEADER = Path(__file__).resolve().parent.parent.parent / "native" / "cuda" / "strata_cuda.h"


def header_path(library: Path | None = None) -> Path:
    """The C header of a kernel library: the one its build copied beside it (``<library>.h``: the declarations of
    that very binary; installed with the package), else the source tree's native/cuda/strata_cuda.h (a library
    built by hand, e.g. $STRATA_CUDA_LIB). Raises CudaUnavailable when neither exists."""
    library = library or _lib_path()
    for p in (library.with_suffix(".h"), SOURCE_HEADER):
        if p.exists():
            return p
    raise CudaUnavailable(f"no C header for {library} (expected {library.with_suffix('.h')} or {SOURCE_HEADER})")


def kernel_declarations(header: Path | None = None) -> str:
    """The header's declarations as cffi's cdef takes them: comments, preprocessor lines and the ``extern "C"``
    wrapper removed (the header is plain C otherwise: typedef'd structs and launcher prototypes)."""
    import re
    text = (header or header_path()).read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", "", text)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#") and 'extern "C"' not in ln]
    return re.sub(r"^\s*}\s*$", "", "\n".join(lines), flags=re.MULTILINE)   # the extern "C" block's brace


def open_kernel_library() -> tuple[Any, Any]:
    """(ffi, lib): the kernel library (strata/_cuda_kernels.so, or $STRATA_CUDA_LIB) opened through a new cffi FFI
    in ABI mode with its header's declarations (kernel_declarations). Each module that launches kernels keeps its
    own (cdata of one FFI is not passed to another). Raises CudaUnavailable when the library or its header is
    missing."""
    import cffi
    p = _lib_path()
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
    """The cffi handle of the kernel library (loaded once)."""
    global _lib, _ffi
    if _lib is None:
        _ffi, _lib = open_kernel_library()
    return _lib


def _check(rc: int, what: str) -> None:
    """RuntimeError naming the launcher and the CUDA error when a launcher returned rc != 0 (1 = invalid argument:
    the launchers' size checks)."""
    if rc != 0:
        import cupy
        msg = str(cupy.cuda.runtime.CUDARuntimeError(int(rc)))      # "cudaErrorInvalidValue: invalid argument"
        raise RuntimeError(f"{what} failed: CUDA error {rc} ({msg})")


def _p(a) -> Any:
    """Raw device pointer of a CuPy array (or None -> NULL) as a cffi void*."""
    if a is None:
        return _ffi.NULL
    return _ffi.cast("void *", a.data.ptr)


def _stream_ptr() -> Any:
    import cupy
    return _ffi.cast("void *", cupy.cuda.get_current_stream().ptr)


@dataclass
class DeviceWeight:
    """A weight on the device: raw GGUF blocks (uint8, n_out rows) or f32 values; shape numpy order (n_out, n_in)."""
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: Any                     # cupy uint8 (n_out, row_bytes) for block types; cupy float32 for F32 vectors

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _row_bytes(t: int, n_in: int) -> int:
    qk, bs = BLOCK[t]
    if n_in % qk:
        raise ValueError(f"row length {n_in} is not a multiple of the block size {qk} of GGML type {t}")
    return n_in // qk * bs


def upload_raw(name: str, ggml_type: int, shape: tuple[int, ...], data: np.ndarray) -> DeviceWeight:
    """Copy a GGUF tensor's storage to the device. 1-D tensors (norm weights) become f32 vectors."""
    import cupy
    t = int(ggml_type)
    if len(shape) == 1:
        v = np.asarray(data)
        if t == 1:
            v = v.view(np.float16)
        elif t != 0:
            raise ValueError(f"{name}: 1-D tensor of GGML type {t} is not supported on CUDA")
        return DeviceWeight(name, 0, tuple(shape), cupy.asarray(v.astype(np.float32).reshape(shape)))
    if t not in SUPPORTED_TYPES:
        raise ValueError(f"{name}: GGML type {t} is not supported by the CUDA kernels "
                         f"(supported: {', '.join(SUPPORTED_TYPES.values())})")
    n_out = int(np.prod(shape[:-1]))
    rb = _row_bytes(t, int(shape[-1]))
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(n_out, rb)
    return DeviceWeight(name, t, (n_out, int(shape[-1])), cupy.asarray(raw))


def concat_weights(name: str, ws: list[DeviceWeight]) -> DeviceWeight:
    """Stack weights of one GGML type along n_out (fused QKV / gate-up); rows of block types are independent."""
    import cupy
    t = ws[0].ggml_type
    if any(w.ggml_type != t or w.shape[1] != ws[0].shape[1] for w in ws):
        raise ValueError(f"{name}: cannot fuse weights of different types or widths")
    return DeviceWeight(name, t, (sum(w.shape[0] for w in ws), ws[0].shape[1]),
                        cupy.ascontiguousarray(cupy.concatenate([w.data for w in ws], axis=0)))


class _Gemm:
    """y (n, n_out) f32 = x (n, n_in) @ W.T through cuBLAS GemmEx (f16 inputs, f32 accumulate and output)."""

    def __init__(self):
        import cupy
        from cupy_backends.cuda.libs import cublas
        self.cublas = cublas
        self.cupy = cupy
        self.one = np.ones(1, np.float32)
        self.zero = np.zeros(1, np.float32)
        self.scratch = None

    def w16(self, w: DeviceWeight):
        n = w.shape[0] * w.shape[1]
        if self.scratch is None or self.scratch.size < n:
            self.scratch = self.cupy.empty(n, self.cupy.float16)
        _check(lib().strata_dequant(_stream_ptr(), w.ggml_type, _p(w.data), _p(self.scratch), w.shape[0], w.shape[1], 1),
               "strata_dequant")
        return self.scratch

    def __call__(self, x, w: DeviceWeight, out=None):
        cp = self.cupy
        n, k = x.shape
        m = w.shape[0]
        x16 = x.astype(cp.float16)
        w16 = self.w16(w)
        y = out if out is not None else cp.empty((n, m), cp.float32)
        h = cp.cuda.device.get_cublas_handle()
        self.cublas.setStream(h, cp.cuda.get_current_stream().ptr)
        # column-major: Y^T (m x n) = W16 (stored k x m, transposed) * X^T (k x n)
        self.cublas.gemmEx(h, 1, 0, m, n, k, self.one.ctypes.data, w16.data.ptr, 2, k, x16.data.ptr, 2, k,
                           self.zero.ctypes.data, y.data.ptr, 0, m, 68, -1)
        return y


class CudaBackend(Backend):
    """Backend ops on CuPy arrays (strata/backend/base.py, docs/internals.md "Backend ops").

    device: CUDA ordinal (``--device cuda:N``). kv_dtype: the KV cache of ``new_page_pool``'s CudaPagePool, "f16"
    (2 bytes per value) or "q8_0" (int8 values and an f16 scale per 32: 1.0625 bytes; ValueError otherwise).
    Raises CudaUnavailable when CuPy, a GPU or the kernel library is missing.
    """

    def __init__(self, device: int = 0, kv_dtype: str = "f16", gemm_threshold: int = 8):
        why = unavailable_reason()
        if why:
            raise CudaUnavailable(f"CUDA backend unavailable: {why}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"KV cache type {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        import cupy
        self.cp = self.xp = cupy
        self.device_id = int(device)
        if not 0 <= self.device_id < cupy.cuda.runtime.getDeviceCount():
            raise CudaUnavailable(f"no CUDA device {self.device_id} "
                                  f"({cupy.cuda.runtime.getDeviceCount()} present)")
        self.device = cupy.cuda.Device(self.device_id)
        self.device.use()
        self.name = f"cuda:{self.device_id}"
        self.kv_dtype = kv_dtype
        self.gemm_threshold = gemm_threshold
        self.gemm = _Gemm()
        lib()
        self._kv: dict[int, tuple[Any, Any]] = {}   # layer -> (k pool, v pool) of attention_pages
        self._partial = None
        self._counters = None
        self.n_sm = int(cupy.cuda.runtime.getDeviceProperties(self.device_id)["multiProcessorCount"])
        self._rope_cache: dict[tuple, tuple[Any, Any]] = {}

    # ---- weights and tensors
    def upload(self, w) -> Any:
        """WeightTensor (strata.quant) -> DeviceWeight (raw blocks on the device); 1-D tensors -> f32 CuPy arrays."""
        if isinstance(w, DeviceWeight):
            return w
        if len(w.shape) == 1:
            return self.cp.asarray(np.asarray(w.dequantize(), dtype=np.float32))
        return upload_raw(w.name, int(w.ggml_type), tuple(w.shape), w.data)

    def asarray(self, x):
        return self.cp.ascontiguousarray(self.cp.asarray(x, dtype=self.cp.float32))

    def to_host(self, x) -> np.ndarray:
        return self.cp.asnumpy(x)

    def embed(self, w, ids: np.ndarray):
        """Rows ids of w -> f32 (n_tokens, n_embd)."""
        w = self.upload(w)
        d_ids = self.cp.asarray(np.asarray(ids, dtype=np.int32))
        out = self.cp.empty((len(d_ids), w.shape[1]), self.cp.float32)
        _check(lib().strata_get_rows(_stream_ptr(), w.ggml_type, _p(w.data), _p(d_ids), _p(out), len(d_ids), w.shape[1]),
               "strata_get_rows")
        return out

    def matmul(self, x, w, out=None):
        """x f32 (n_tokens, n_in) @ W.T -> f32 (n_tokens, n_out): matvec on blocks for n_tokens <= 8, else cuBLAS."""
        w = self.upload(w)
        x = self.asarray(x)
        if x.ndim != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"matmul: x shape {tuple(x.shape)} does not match weight {w.name} {w.shape}")
        n = x.shape[0]
        if n > self.gemm_threshold:
            return self.gemm(x, w, out)
        y = out if out is not None else self.cp.empty((n, w.shape[0]), self.cp.float32)
        if n == 1 and DP4A and lib().strata_matvec_q8_supported(w.ggml_type):
            xq = self.quantize_q8(x)
            _check(lib().strata_matvec_q8w(_stream_ptr(), w.ggml_type, _p(w.data), _p(xq), _p(y), w.shape[0],
                                           w.shape[1], rows_per_warp(w.shape[0])), "strata_matvec_q8w")
            return y
        for s in range(0, n, 8):
            e = min(n, s + 8)
            _check(lib().strata_matvec(_stream_ptr(), w.ggml_type, _p(w.data), _p(x[s:e]), _p(y[s:e]), w.shape[0],
                                       w.shape[1], e - s), "strata_matvec")
        return y

    def quantize_q8(self, x, out=None):
        """One f32 activation row x (1, n_in) -> int8 q8_1 blocks for strata_matvec_q8: uint8 (n_in + n_in // 4)
        = int8 values then float2 (d, d * sum q) per 32 (d = max|x| / 127, round to nearest even)."""
        n_in = int(x.shape[-1])
        xq = out if out is not None else self.cp.empty(n_in + n_in // 4, self.cp.uint8)
        _check(lib().strata_quantize_q8_1(_stream_ptr(), _p(x), _p(xq), n_in), "strata_quantize_q8_1")
        return xq

    def rms_norm(self, x, weight, eps: float, residual=None, sum_out=None):
        """RMSNorm over the last dim of f32 (n, dim); with residual, normalizes x + residual (also written to
        sum_out when given; sum_out may alias residual)."""
        x = self.asarray(x)
        if residual is not None:
            residual = self.asarray(residual)
        wt = weight.data if isinstance(weight, DeviceWeight) else self.asarray(weight)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out = self.cp.empty_like(x2)
        _check(lib().strata_rms_norm(_stream_ptr(), _p(x2), _p(residual), _p(wt), _p(out), _p(sum_out),
                                     x2.shape[0], x2.shape[-1], float(eps)), "strata_rms_norm")
        return out.reshape(shape)

    def rope(self, x, positions, n_rot: int, theta: float, neox: bool, freq_factors=None, freq_scale: float = 1.0):
        """RoPE on a copy of x f32 (n_tokens, n_heads, head_dim), first n_rot dims (see Backend.rope).
        The kernel computes angles in float64; freq_factors / freq_scale use a CuPy table instead."""
        cp = self.cp
        x = cp.array(x, dtype=cp.float32, copy=True, order="C")
        pos_h = np.asarray(positions, dtype=np.int64) if not isinstance(positions, cp.ndarray) else None
        if pos_h is not None and pos_h.size and pos_h.min() < 0:
            raise ValueError("RoPE positions must be >= 0")
        n, h, hd = x.shape
        if freq_factors is None and freq_scale == 1.0:
            pos = cp.asarray(pos_h.astype(np.int32)) if pos_h is not None else positions.astype(cp.int32)
            _check(lib().strata_rope(_stream_ptr(), _p(x), _p(pos), n, h, hd, int(n_rot), float(theta),
                                     int(bool(neox))), "strata_rope")
            return x
        pos = pos_h if pos_h is not None else cp.asnumpy(positions).astype(np.int64)
        inv = float(theta) ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        if freq_factors is not None:
            ff = freq_factors if isinstance(freq_factors, np.ndarray) else cp.asnumpy(freq_factors)
            inv = inv / np.asarray(ff, dtype=np.float64)[: n_rot // 2]
        ang = pos[:, None].astype(np.float64) * (freq_scale * inv)[None, :]
        cos = cp.asarray(np.cos(ang).astype(np.float32))[:, None, :]
        sin = cp.asarray(np.sin(ang).astype(np.float32))[:, None, :]
        half = n_rot // 2
        if neox:
            x0, x1 = x[..., :half].copy(), x[..., half:n_rot].copy()
            x[..., :half] = x0 * cos - x1 * sin
            x[..., half:n_rot] = x0 * sin + x1 * cos
        else:
            x0, x1 = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
            x[..., 0:n_rot:2] = x0 * cos - x1 * sin
            x[..., 1:n_rot:2] = x0 * sin + x1 * cos
        return x

    def swiglu(self, gate, up):
        gate, up = self.asarray(gate), self.asarray(up)
        out = self.cp.empty_like(gate)
        _check(lib().strata_swiglu(_stream_ptr(), _p(gate), _p(up), _p(out), gate.size), "strata_swiglu")
        return out

    # ---- the PagePool path used by model files (strata/memory/kv.py)
    def new_page_pool(self, layers, n_pages: int, n_kv_head: int, head_dim: int, page_size: int = DEFAULT_PAGE_SIZE,
                      head_dim_v: int | None = None) -> PagePool:
        """A CudaPagePool (f16 pages in the kernels' layout) when the kernels handle the shape (head_dim_v ==
        head_dim, a multiple of 32 up to 256); else a PagePool with zeroed float32 CuPy storage (n_kv_head,
        n_pages, page_size, head_dim) per attention layer (the generic path, e.g. hybrid models)."""
        cp = self.cp
        hv = head_dim_v or head_dim
        if hv == head_dim and head_dim % 32 == 0 and head_dim <= 256:
            return CudaPagePool(layers, n_pages, page_size, n_kv_head, head_dim, kv=self.kv_dtype)
        if self.kv_dtype != "f16":
            raise ValueError(f"--kv {self.kv_dtype} needs head_dim_v == head_dim, a multiple of 32 up to 256 "
                             f"(this model: {head_dim} / {hv})")
        k = [cp.zeros((n_kv_head, n_pages, page_size, head_dim), cp.float32) for _ in layers]
        v = [cp.zeros((n_kv_head, n_pages, page_size, hv), cp.float32) for _ in layers]
        return PagePool(layers, n_pages, page_size, n_kv_head, head_dim, k, v, to_host=host_copy, head_dim_v=hv)

    def fast_path(self, model, lo: int = 0, hi: int | None = None):
        """The runner of a stage running blocks [lo, hi) of `model` (hi None: all): GraphDecodeModel (one-token
        forward through the LlamaCuda CUDA-graph plan, prefill through its cuBLAS/FA2 plan) for llama models the
        plan supports; Qwen35GraphModel (strata/backend/cuda_qwen35.py: one-token forward through the Qwen35Cuda
        CUDA-graph plan) for the dense hybrid models it supports; else the model itself."""
        if LlamaCuda.unsupported(model, lo, hi) is None:
            return GraphDecodeModel(model, lo, hi)
        from strata.backend import cuda_qwen35
        if cuda_qwen35.unsupported(model, lo, hi) is None:
            return cuda_qwen35.Qwen35GraphModel(model, lo, hi)
        return model

    def drain(self) -> None:
        """Wait for everything queued on this backend's device (cudaDeviceSynchronize on this device, not the
        current one: seed #716)."""
        with self.device:
            self.cp.cuda.Device(self.device_id).synchronize()

    def total_memory(self) -> int:
        """The device's total memory in bytes."""
        with self.device:
            return int(self.cp.cuda.runtime.memGetInfo()[1])

    def memory_info(self) -> dict[str, int]:
        """Device memory in bytes: total, free (cudaMemGetInfo) and held by CuPy's pool (used / total)."""
        free, total = self.cp.cuda.runtime.memGetInfo()
        mp = self.cp.get_default_memory_pool()
        return {"device_total_bytes": int(total), "device_free_bytes": int(free),
                "pool_used_bytes": int(mp.used_bytes()), "pool_total_bytes": int(mp.total_bytes())}

    def attention(self, q, k, v, kv: PagedKV, layer: int, scale: float):
        """See Backend.attention. On a CudaPagePool: k/v written into the sequence's pages (f16: strata_kv_write;
        q8_0: strata_kv_write_q8), then the split-K decode kernel (n == 1) or prefill_attention (n > 1) through the
        pool's device page table. On a float32 PagePool (generic path): PagePool.write, PagePool.read, S = Q K^T per KV head
        (cuBLAS, f32), causal softmax (strata_causal_softmax), O = P V. Queries are chunked so S stays under
        1 GiB."""
        cp = self.cp
        q, k, v = self.asarray(q), self.asarray(k), self.asarray(v)
        n, n_head, hd, g, slot, start = self.attention_geometry(q, k, kv, layer)
        n_kv = n_head // g
        pool = kv.pool
        if isinstance(pool, CudaPagePool):
            ks, vs = pool.scales(slot)
            return paged_attention(self, q, k, v, pool.k[slot], pool.v[slot], pool.table(kv.pages), start,
                                   pool.page_size, scale, ks, vs)
        pool.write(slot, kv.pages, start, k, v)
        K, V = kv.read(slot, start + n)                     # (n_kv, L, hd), (n_kv, L, hv)
        L = start + n
        hv = V.shape[-1]
        Kt = K.transpose(0, 2, 1)
        out = cp.empty((n, n_head, hv), cp.float32)
        chunk = max(1, min(n, (1 << 30) // max(1, n_head * L * 4)))
        s = _stream_ptr()
        for i0 in range(0, n, chunk):
            i1 = min(n, i0 + chunk)
            c = i1 - i0
            qh = cp.ascontiguousarray(q[i0:i1].transpose(1, 0, 2)).reshape(n_kv, g * c, hd)   # row = gi*c + i
            lk = start + i1
            S = cp.ascontiguousarray(cp.matmul(qh, Kt[:, :, :lk]))                            # (n_kv, g*c, lk)
            _check(lib().strata_causal_softmax(s, _p(S), n_kv * g * c, c, lk, start + i0, float(scale)),
                   "strata_causal_softmax")
            O = cp.matmul(S, V[:, :lk])                                                       # (n_kv, g*c, hv)
            out[i0:i1] = O.reshape(n_head, c, hv).transpose(1, 0, 2)
        return out

    # ---- attention over the paged KV cache
    def _pool(self, layer: int, n_pages: int, page_size: int, n_kv: int, hd: int):
        kv = self._kv.get(layer)
        shape = (n_pages, page_size, n_kv, hd)
        if kv is None or kv[0].shape != shape:
            kv = (self.cp.zeros(shape, self.cp.float16), self.cp.zeros(shape, self.cp.float16))
            self._kv[layer] = kv
        return kv

    def attention_pages(self, q, k, v, table, length: int, ps: int, cap: int, layer: int, scale: float):
        """The f16 paged path of LlamaCuda as a backend op: k/v written at `length` into this backend's own f16
        pools (cap pages of ps tokens, page ids from `table`), then split-K decode attention (n == 1) or
        gathered causal attention (n > 1). q f32 (n, n_head, hd) -> f32 (n, n_head, hd)."""
        cp = self.cp
        q, k, v = self.asarray(q), self.asarray(k), self.asarray(v)
        n, n_head, hd = q.shape
        n_kv = k.shape[1]
        if (length + n + ps - 1) // ps > len(table):
            raise ValueError(f"attention: page table covers {len(table) * ps} positions, need {length + n}")
        kc, vc = self._pool(layer, cap, ps, n_kv, hd)
        pt = cp.asarray(np.asarray(table, dtype=np.int32))
        return paged_attention(self, q, k, v, kc, vc, pt, length, ps, scale)


def fa2_splits(n: int, n_head: int, total: int, n_sm: int) -> int:
    """Key-range splits of the FA2 prefill kernel: enough blocks ((n / 64) * n_head * splits) for two waves of
    n_sm multiprocessors, each split at least 8 key tiles of 64, at most 16."""
    blocks = -(-n // 64) * n_head
    return max(1, min(16, -(-2 * n_sm // blocks), (total + 63) // 64 // 8))


def prefill_attention(be, q, kc, vc, pt, length: int, n_kv: int, ps: int, scale: float, ks=None, vs=None):
    """Causal GQA attention of n new queries (positions length..length+n-1) over the paged f16 cache
    (their K/V already written); q f32 (n, n_head, hd) contiguous -> f32 (n, n_head, hd).

    head_dim 64 / 128 (and FLASH): strata_fa2_prefill (FlashAttention-2 on mma.sync, attention.cu; with
    STRATA_CUDA_ATTN=v1 the first wmma kernel strata_flash_prefill), the key range split so that two waves of
    blocks run, the splits merged by a combine kernel. Otherwise: K/V gathered to f32,
    S = Q K^T per KV head (cuBLAS batched, f32), masked softmax (strata_causal_softmax), O = P V, queries in
    chunks so S (n_head * chunk * (length + n) * 4 bytes) stays under 1 GiB.
    """
    cp = be.cp
    n, n_head, hd = q.shape
    g = n_head // n_kv
    total = length + n
    s = _stream_ptr()
    q8 = ks is not None
    if FLASH and hd in FLASH_HEAD_DIMS and (ATTN != "v1" or q8):
        out = cp.empty((n, n_head, hd), cp.float32)
        n_split = fa2_splits(n, n_head, total, be.n_sm)
        ws = cp.empty(n_split * n_head * n * (hd + 2), cp.float32) if n_split > 1 else None
        _check(lib().strata_fa2_prefill(s, _p(q), n_head * hd, _p(kc), _p(vc), _p(pt), _p(out), _ffi.NULL, _p(ws), n,
                                        n_head, n_kv, hd, ps, int(length), n_split, float(scale), _p(ks), _p(vs)),
               "strata_fa2_prefill")
        return out
    if FLASH and hd in FLASH_HEAD_DIMS and not q8:
        n_tiles = (total + 63) // 64
        blocks = ((n + 63) // 64) * n_head
        n_split = max(1, min(32, -(-1024 // blocks), -(-n_tiles // 4)))
        ws = cp.empty(n_split * n_head * n * (hd + 2), cp.float32)
        out = cp.empty((n, n_head, hd), cp.float32)
        _check(lib().strata_flash_prefill(s, _p(q), _p(kc), _p(vc), _p(pt), _p(out), _p(ws), n, n_head, n_kv, hd, ps,
                                          int(length), n_split, float(scale)), "strata_flash_prefill")
        return out
    kf = cp.empty((n_kv, total, hd), cp.float32)
    vf = cp.empty((n_kv, total, hd), cp.float32)
    if q8:
        _check(lib().strata_kv_gather_q8(s, _p(kc), _p(vc), _p(ks), _p(vs), _p(pt), _p(kf), _p(vf), total, n_kv, hd,
                                         ps), "strata_kv_gather_q8")
    else:
        _check(lib().strata_kv_gather(s, _p(kc), _p(vc), _p(pt), _p(kf), _p(vf), total, n_kv, hd, ps),
               "strata_kv_gather")
    out = cp.empty((n, n_head, hd), cp.float32)
    chunk = max(1, min(n, (1 << 30) // max(1, n_head * total * 4)))
    for i0 in range(0, n, chunk):
        i1 = min(n, i0 + chunk)
        c, lk = i1 - i0, length + i1
        qh = cp.ascontiguousarray(q[i0:i1].transpose(1, 0, 2)).reshape(n_kv, g * c, hd)   # row = gi * c + i
        S = cp.ascontiguousarray(cp.matmul(qh, kf[:, :lk].transpose(0, 2, 1)))          # (n_kv, g*c, lk)
        _check(lib().strata_causal_softmax(s, _p(S), n_kv * g * c, c, lk, length + i0, float(scale)),
               "strata_causal_softmax")
        O = cp.matmul(S, vf[:, :lk])                                                      # (n_kv, g*c, hd)
        out[i0:i1] = O.reshape(n_head, c, hd).transpose(1, 0, 2)
    return out


# ------------------------------------------------------------------------------------------------ f16 paged KV pool
class CudaPagePool(PagePool):
    """A PagePool whose pages live on the device in the kernels' layout: per attention layer one K and one V array of
    shape (n_pages, page_size, n_kv_head, head_dim) (token t of page p, head h at [p, t, h]).

    kv "f16": the arrays are f16 (2 bytes per value). kv "q8_0" (``--kv q8_0``): the arrays are int8 and each layer
    also has f16 scale arrays (n_pages, page_size, n_kv_head, head_dim / 32), ``scales(slot)``: value = d * q per 32
    values of one (position, head) row, d = max|x| / 127 (ggml's q8_0 block; 1.0625 bytes per value).
    Same page accounting as PagePool (alloc / free / slot); ``write`` and ``read`` keep PagePool's contract
    (write f32 (n, n_kv_head, head_dim) at [start, start + n); read -> f32 copies (n_kv_head, length, head_dim),
    converted from the stored type), so SequenceState.hashes / nbytes and checkpoints work unchanged.
    ``table(pages)`` is the device page table (int32, one fixed buffer of n_pages entries that CUDA graphs read); it
    is rewritten only when the page list changes. Raises ValueError for another kv type, or q8_0 with a head_dim
    that is not a multiple of 32.
    """

    page_axis = 0

    def __init__(self, layers, n_pages: int, page_size: int, n_kv_head: int, head_dim: int, kv: str = "f16"):
        import cupy as cp
        if kv not in KV_DTYPES:
            raise ValueError(f"KV cache type {kv!r} is not one of {', '.join(KV_DTYPES)}")
        if kv == "q8_0" and head_dim not in (32, 64, 128, 256):
            raise ValueError(f"--kv q8_0 needs head_dim 32, 64, 128 or 256 (this model: {head_dim})")
        shape = (int(n_pages), int(page_size), int(n_kv_head), int(head_dim))
        dt = cp.int8 if kv == "q8_0" else cp.float16
        k = [cp.zeros(shape, dt) for _ in layers]
        v = [cp.zeros(shape, dt) for _ in layers]
        super().__init__(layers, n_pages, page_size, n_kv_head, head_dim, k, v, to_host=host_copy)
        self.kv = kv
        self.cp = cp
        if kv == "q8_0":
            sshape = shape[:3] + (int(head_dim) // 32,)
            self.ks = [cp.zeros(sshape, cp.float16) for _ in layers]
            self.vs = [cp.zeros(sshape, cp.float16) for _ in layers]
        else:
            self.ks = self.vs = None
        self._pt = cp.zeros(max(1, int(n_pages)), cp.int32)
        self._pt_key: tuple[int, ...] | None = None

    def scales(self, slot: int) -> tuple[Any, Any]:
        """The f16 scale arrays of layer slot `slot` (q8_0), or (None, None) for an f16 cache."""
        if self.ks is None:
            return None, None
        return self.ks[slot], self.vs[slot]

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K+V one token takes over all attention layers (f16: 2 per value; q8_0: 1 + 2 / 32)."""
        vals = len(self.layers) * self.n_kv_head * (self.head_dim + self.head_dim_v)
        return vals * 2 if self.kv == "f16" else vals + vals // 16

    def table(self, pages) -> Any:
        """The device page table holding `pages` (int32, fixed address; entries past len(pages) are stale)."""
        key = tuple(int(p) for p in pages)
        if key != self._pt_key:
            if len(key) > self.n_pages:
                raise ValueError(f"page table of {len(key)} pages is longer than the pool ({self.n_pages})")
            if key:
                self._pt[:len(key)] = self.cp.asarray(np.asarray(key, dtype=np.int32))
            self._pt_key = key
        return self._pt

    def write(self, slot: int, pages, start: int, k: Any, v: Any) -> None:
        cp = self.cp
        k = cp.ascontiguousarray(cp.asarray(k, dtype=cp.float32))
        v = cp.ascontiguousarray(cp.asarray(v, dtype=cp.float32))
        n = int(k.shape[0])
        if k.shape != (n, self.n_kv_head, self.head_dim) or v.shape != k.shape:
            raise ValueError(f"KV write: k {tuple(k.shape)} / v {tuple(v.shape)} do not match "
                             f"(n, {self.n_kv_head}, {self.head_dim})")
        if start + n > len(pages) * self.page_size:
            raise ValueError(f"KV write at [{start}, {start + n}) past the pages given ({len(pages) * self.page_size})")
        pt = self.table(pages)
        row = self.n_kv_head * self.head_dim
        if self.kv == "q8_0":
            _check(lib().strata_kv_write_q8(_stream_ptr(), _p(k), row, _p(v), row, _p(self.k[slot]),
                                            _p(self.v[slot]), _p(self.ks[slot]), _p(self.vs[slot]), _p(pt),
                                            _ffi.NULL, int(start), n, self.n_kv_head, self.head_dim, self.page_size),
                   "strata_kv_write_q8")
            return
        _check(lib().strata_kv_write(_stream_ptr(), _p(k), _p(v), _p(self.k[slot]), _p(self.v[slot]), _p(pt),
                                     _ffi.NULL, int(start), n, self.n_kv_head, self.head_dim, self.page_size),
               "strata_kv_write")

    def read(self, slot: int, pages, length: int, contiguous: bool | None = None) -> tuple[Any, Any]:
        cp = self.cp
        ko = cp.empty((self.n_kv_head, int(length), self.head_dim), cp.float32)
        vo = cp.empty((self.n_kv_head, int(length), self.head_dim_v), cp.float32)
        if length > 0:
            if length > len(pages) * self.page_size:
                raise ValueError(f"KV read of {length} positions past the pages given ({len(pages) * self.page_size})")
            pt = self.table(pages)
            if self.kv == "q8_0":
                _check(lib().strata_kv_gather_q8(_stream_ptr(), _p(self.k[slot]), _p(self.v[slot]),
                                                 _p(self.ks[slot]), _p(self.vs[slot]), _p(pt), _p(ko), _p(vo),
                                                 int(length), self.n_kv_head, self.head_dim, self.page_size),
                       "strata_kv_gather_q8")
            else:
                _check(lib().strata_kv_gather(_stream_ptr(), _p(self.k[slot]), _p(self.v[slot]), _p(pt), _p(ko),
                                              _p(vo), int(length), self.n_kv_head, self.head_dim, self.page_size),
                       "strata_kv_gather")
        return ko, vo


def check_sequence(pool, state) -> None:
    """ValueError (one line) unless the sequence's KV pages are in `pool` and its KV length equals its position: what
    every plan checks before a step reads or writes the sequence."""
    kv = state.kv
    if kv.pool is not pool:
        raise ValueError("the sequence's KV pages are not in this plan's pool")
    if kv.length != state.pos:
        raise ValueError(f"KV length {kv.length} != sequence position {state.pos}")


def carve_bounds(lo: int, hi: int | None, n_layer: int) -> tuple[int, int]:
    """(lo, hi) of a plan's carve, the layers [lo, hi) of a model of n_layer blocks (hi None: all of them);
    ValueError unless 0 <= lo < hi <= n_layer."""
    lo, hi = int(lo), n_layer if hi is None else int(hi)
    if not 0 <= lo < hi <= n_layer:
        raise ValueError(f"carve [{lo}, {hi}) is not a non-empty range of the model's {n_layer} blocks")
    return lo, hi


def hidden_input(x_in, n: int, n_embd: int, first: bool, device_id: int):
    """A stage's input x_in checked and viewed as (n, n_embd), or None for the first stage (whose input is the
    embedding rows). ValueError / TypeError (one line) unless a later stage gets a CuPy float32 array of n * n_embd
    elements on device device_id, and the first stage none."""
    if first:
        if x_in is not None:
            raise ValueError("x_in is the input of a stage after the first (the first embeds its tokens)")
        return None
    import cupy
    if not isinstance(x_in, cupy.ndarray):
        raise TypeError(f"a stage after the first needs x_in, a CuPy float32 ({n}, {n_embd}) array "
                        f"(got {type(x_in).__name__})")
    if x_in.dtype != np.float32 or x_in.size != n * n_embd or x_in.device.id != device_id:
        raise ValueError(f"x_in is {x_in.dtype} {tuple(x_in.shape)} on device {x_in.device.id}; the stage needs "
                         f"float32 ({n}, {n_embd}) on device {device_id}")
    return x_in.reshape(n, n_embd)


def paged_attention(be: "CudaBackend", q, k, v, kc, vc, pt, length: int, ps: int, scale: float, ks=None, vs=None):
    """Write k/v f32 (n, n_kv, hd) at positions [length, length + n) of the pages kc/vc (n_pages, ps, n_kv, hd)
    through page table pt (device int32), then attend: split-K decode kernel for n == 1, prefill_attention above.
    The pages are f16, or q8_0 when the scale arrays ks/vs (n_pages, ps, n_kv, hd / 32) f16 are given.
    q f32 (n, n_head, hd) -> f32 (n, n_head, hd)."""
    cp = be.cp
    n, n_head, hd = q.shape
    n_kv = k.shape[1]
    s = _stream_ptr()
    q8 = ks is not None
    if q8 and n_head // n_kv > 8:     # before anything is written: the q8_0 decode kernel takes groups of <= 8
        raise ValueError(f"--kv q8_0 needs at most 8 query heads per KV head (this model: {n_head // n_kv})")
    if q8:
        _check(lib().strata_kv_write_q8(s, _p(k), n_kv * hd, _p(v), n_kv * hd, _p(kc), _p(vc), _p(ks), _p(vs), _p(pt),
                                        _ffi.NULL, int(length), n, n_kv, hd, ps), "strata_kv_write_q8")
    else:
        _check(lib().strata_kv_write(s, _p(k), _p(v), _p(kc), _p(vc), _p(pt), _ffi.NULL, int(length), n, n_kv, hd,
                                     ps), "strata_kv_write")
    total = length + n
    v2_ok = hd in (32, 64, 128, 256) and n_head // n_kv <= 8
    use_v2 = q8 or ATTN == "v2" or (ATTN == "auto" and total >= AUTO_V2_FROM)
    if n == 1 and use_v2 and v2_ok:
        n_split = n_split_gqa(total, n_kv, be.n_sm, resident=gqa_resident(hd, n_head // n_kv, q8))
        need = n_head * n_split * (hd + 2)
        if be._partial is None or be._partial.size < need:
            be._partial = cp.empty(max(need, n_head * MAX_SPLIT * (hd + 2)), cp.float32)
        if be._counters is None or be._counters.size < n_kv:
            be._counters = cp.zeros(max(64, n_kv), cp.uint32)
        out = cp.empty((1, n_head, hd), cp.float32)
        _check(lib().strata_attn_decode_gqa(s, _p(q), _p(kc), _p(vc), _p(pt), _ffi.NULL, total, _p(be._partial),
                                            _ffi.cast("unsigned *", be._counters.data.ptr), _p(out), _ffi.NULL,
                                            n_head, n_kv, hd, ps, n_split, float(scale), _p(ks), _p(vs)),
               "strata_attn_decode_gqa")
        return out
    if n == 1:
        n_split = n_split_for(total)
        need = n_head * n_split * (hd + 2)
        if be._partial is None or be._partial.size < need:
            be._partial = cp.empty(max(need, n_head * MAX_SPLIT * (hd + 2)), cp.float32)
        out = cp.empty((1, n_head, hd), cp.float32)
        _check(lib().strata_attn_decode(s, _p(q), _p(kc), _p(vc), _p(pt), _ffi.NULL, total, _p(be._partial),
                                        _p(out), n_head, n_kv, hd, ps, n_split, float(scale)), "strata_attn_decode")
        return out
    return prefill_attention(be, q, kc, vc, pt, length, n_kv, ps, scale, ks, vs)


# ------------------------------------------------------------------------------------------------ llama decode plan
def glu_pointers(parts: list, n_ff: int, n_embd: int):
    """(ggml type, gate address, up address) (ints: each caller casts with its own FFI) for strata_matvec_q8w_glu,
    or None when the FFN weights cannot use it.

    parts: [fused [gate; up] DeviceWeight of 2 n_ff rows] or [gate, up] DeviceWeights (n_ff rows each, one type);
    the type must have the dp4a kernel and n_ff be a multiple of 32 (whole q8_1 blocks per thread block)."""
    if n_ff % 32 or not all(isinstance(w, DeviceWeight) for w in parts):
        return None
    lb = lib()
    if len(parts) == 1 and parts[0].shape[0] == 2 * n_ff:
        w = parts[0]
        if not lb.strata_matvec_q8_supported(w.ggml_type):
            return None
        base = int(w.data.data.ptr)
        up = base + n_ff * _row_bytes(w.ggml_type, n_embd)
        return (w.ggml_type, base, up) if up % 16 == 0 else None   # the kernel reads 16-byte words
    if len(parts) == 2 and parts[0].ggml_type == parts[1].ggml_type and \
            all(w.shape[0] == n_ff for w in parts) and lb.strata_matvec_q8_supported(parts[0].ggml_type):
        return parts[0].ggml_type, int(parts[0].data.data.ptr), int(parts[1].data.data.ptr)
    return None


def step_matrices(L, n_head: int, n_kv: int, head_dim: int, n_ff: int) -> dict:
    """The seven matrices of a llama layer for the persistent decode step, {name: (DeviceWeight, first row, rows)}
    for q, k, v, o, gate, up, down: row ranges of the fused wqkv ([q; k; v]) and w_gate_up ([gate; up]) when the
    layer has them, else the separate weights (row 0, all rows)."""
    nq, kvd = n_head * head_dim, n_kv * head_dim
    if L.wqkv is not None:
        m = {"q": (L.wqkv, 0, nq), "k": (L.wqkv, nq, kvd), "v": (L.wqkv, nq + kvd, kvd)}
    else:
        m = {"q": (L.wq, 0, nq), "k": (L.wk, 0, kvd), "v": (L.wv, 0, kvd)}
    m["o"] = (L.wo, 0, L.wo.shape[0])
    if L.w_gate_up is not None:
        m["gate"], m["up"] = (L.w_gate_up, 0, n_ff), (L.w_gate_up, n_ff, n_ff)
    else:
        m["gate"], m["up"] = (L.w_gate, 0, n_ff), (L.w_up, 0, n_ff)
    m["down"] = (L.w_down, 0, L.w_down.shape[0])
    return m


def _dptr(w) -> Any:
    """Device pointer of a DeviceWeight's storage or of a CuPy array."""
    return _p(w.data if isinstance(w, DeviceWeight) else w)


def prefill_logits(model, x, all_logits: bool, eps: float) -> np.ndarray:
    """A prefill plan's last step: the final RMSNorm (model.out_norm) of the last row of x, or of every row with
    all_logits, and the output projection (model.output, through the backend's matmul) -> host f32 (n_vocab,) or
    (n, n_vocab). x: CuPy f32 (n, n_embd), the residual stream after the last layer."""
    import cupy as cp
    rows = x if all_logits else x[x.shape[0] - 1:]
    hn = cp.empty(rows.shape, cp.float32)
    _check(lib().strata_rms_norm_ex(_stream_ptr(), _p(rows), _ffi.NULL, _dptr(model.out_norm), _p(hn), _ffi.NULL,
                                    _ffi.NULL, _ffi.NULL, rows.shape[0], rows.shape[1], float(eps)), "rms_norm")
    out = cp.asnumpy(model.backend.matmul(hn, model.output))
    return out if all_logits else out[0]


class PrefillScratch:
    """What a plan's prefill needs besides the model: device buffers grown to the largest ubatch seen (never shrunk),
    f16 copies of quantized weights for cuBLAS (dequantized per call into one shared scratch, or kept per weight with
    STRATA_CUDA_F16_WEIGHTS=1) and the GEMM itself. Everything runs on CuPy's current stream."""

    def __init__(self):
        import cupy
        self.cp = cupy
        self._bufs: dict[str, Any] = {}
        self._w16: dict[int, Any] = {}         # id(DeviceWeight) -> f16 copy (F16_WEIGHTS)
        self._w16_scratch = None

    def buf(self, name: str, shape: tuple[int, ...], dtype) -> Any:
        """The buffer `name` viewed as exactly `shape` (C-contiguous; contents undefined)."""
        n = int(np.prod(shape))
        b = self._bufs.get(name)
        if b is None or b.size < n or b.dtype != np.dtype(dtype):
            b = self._bufs[name] = self.cp.empty(n, dtype)
        return b[:n].reshape(shape)

    def weight16(self, w: DeviceWeight) -> Any:
        """W as f16 (n_out, n_in): the kept copy (F16_WEIGHTS) or the shared scratch dequantized now (valid until
        the next call)."""
        cp = self.cp
        if F16_WEIGHTS:
            c = self._w16.get(id(w))
            if c is None:
                c = self._w16[id(w)] = cp.empty(w.shape, cp.float16)
                _check(lib().strata_dequant(_stream_ptr(), w.ggml_type, _p(w.data), _p(c), w.shape[0], w.shape[1], 1),
                       "strata_dequant")
            return c
        n = w.shape[0] * w.shape[1]
        if self._w16_scratch is None or self._w16_scratch.size < n:
            self._w16_scratch = cp.empty(n, cp.float16)
        _check(lib().strata_dequant(_stream_ptr(), w.ggml_type, _p(w.data), _p(self._w16_scratch), w.shape[0],
                                    w.shape[1], 1), "strata_dequant")
        return self._w16_scratch

    def gemm(self, a16, w: DeviceWeight, y, accumulate: bool, col: int = 0) -> None:
        """y[:, col:col + n_out] f32 (+)= a16 f16 (n, n_in) @ W.T through cuBLAS GemmEx (f32 accumulate; beta = 1
        adds into y: the residual add). y: C-contiguous f32 (n, width >= col + n_out); a16 C-contiguous."""
        from cupy_backends.cuda.libs import cublas
        cp = self.cp
        n, k = a16.shape
        m = w.shape[0]
        width = y.shape[1]
        w16 = self.weight16(w)
        h = cp.cuda.device.get_cublas_handle()
        cublas.setStream(h, cp.cuda.get_current_stream().ptr)
        beta = _ONE if accumulate else _ZERO
        cublas.gemmEx(h, 1, 0, m, n, k, _ONE.ctypes.data, w16.data.ptr, 2, k, a16.data.ptr, 2, k,
                      beta.ctypes.data, y.data.ptr + 4 * col, 0, width, 68, -1)


class LlamaCuda:
    """The CUDA execution plan of ``strata/models/llama.py``'s LlamaModel: its one-token decode step and its prefill.

    It owns no weights and no model definition: it reads the LlamaModel's uploaded tensors (fused wqkv /
    w_gate_up when llama.py fused them) and config, and the sequence's f16 pages in a CudaPagePool. Both compute
    what LlamaModel.forward computes (embedding row, per layer RMSNorm -> QKV -> RoPE -> K/V write -> causal GQA
    attention -> output projection + residual -> RMSNorm -> gate/up -> SwiGLU -> down + residual; final RMSNorm,
    output projection), with fused launches and preallocated buffers:

    * decode (``decode``, ``decode_greedy``): matvecs on int8 q8_1 activations (DP4A; written by the RMSNorm,
      attention and SwiGLU kernels that produce them; by default SwiGLU inside the gate/up matvec,
      STRATA_CUDA_GLU=0 a separate launch) or f32 activations, RoPE fused with the K/V write, GQA-shared split-K
      attention that merges its own splits, the residual add and the next RMSNorm's quantized input done by the
      output / down matvecs (the norm handoff, NORM_HANDOFF; else the residual add fused into the next RMSNorm or
      matvec); token and position read
      from device memory, so the step is captured once per context-size class (256, 512, ... positions; the class
      fixes the split count, n_split_class) as a CUDA graph and replayed with one graph launch per token. With
      STRATA_CUDA_STEP=1 (``step``; ``prepare_step()`` sets it up) the step after the embedding row is instead one
      cooperative launch of the persistent decode step (strata_decode_step), measured slower on the H200, see
      docs/cuda.md.
    * prefill (``prefill``): cuBLAS GEMMs on f16 operands with f32 accumulation and output (weights dequantized to
      f16 per ubatch, or kept as f16 copies with STRATA_CUDA_F16_WEIGHTS=1), the residual add done by the GEMM
      (beta = 1), RMSNorm and SwiGLU writing f16 GEMM inputs, RoPE fused with the K/V write, FlashAttention-2 prefill
      attention; launched eagerly (positions are kernel arguments).

    ``unsupported(model)`` gives why a model cannot use the plan (None if it can): Q/K/V biases, RoPE frequency
    factors or linear scaling, a head_dim that is not 32/64/128/256, more than 8 query heads per KV head.
    ``decode(token, state)`` / ``prefill(tokens, state, all_logits)`` are LlamaModel.forward (same errors, same
    state bookkeeping) returning host f32 logits; ``decode_greedy(first, n, state)`` runs n steps feeding back the
    device argmax (benchmark, parity tests).

    ``lo``, ``hi``: the carve, the layers [lo, hi) a pipeline stage runs (default all; ``first`` / ``last``: it holds
    the embeddings / the final norm and output head). A stage after the first starts from ``x_in``, the previous
    stage's residual stream (before the final norm) instead of the embedding rows; a stage before the last returns
    its own instead of logits. The decode step's norm variant (handoff, fused, plain) is chosen over the carve's
    layers; at its edges the residual stream is plain f32 in d['x'] in every variant.
    """

    def __init__(self, model, pool: CudaPagePool, use_graphs: bool = True, lo: int = 0, hi: int | None = None):
        why = self.unsupported(model, lo, hi)
        if why:
            raise ValueError(f"the CUDA decode plan cannot run this model: {why}")
        lo, hi = carve_bounds(lo, hi, model.config.n_layer)
        if not isinstance(pool, CudaPagePool):
            raise TypeError("LlamaCuda needs the CudaPagePool made by CudaBackend.new_page_pool")
        cp = self.cp = __import__("cupy")
        self.model = model
        self.pool = pool
        c = model.config
        self.n_embd, self.n_layer, self.n_head, self.n_kv = c.n_embd, c.n_layer, c.n_head, c.n_head_kv
        self.hd, self.n_ff, self.n_vocab = c.head_dim, c.n_ff, c.n_vocab
        self.n_rot, self.theta, self.neox, self.eps = model.n_rot, float(c.rope_theta), int(bool(c.rope_neox)), \
            float(c.rms_eps)
        self.scale = float(model.scale)
        self.lo, self.hi = lo, hi                  # the carve: layers [lo, hi)
        self.first, self.last = lo == 0, model.ends_with_head(hi)   # the embeddings / the final norm and head
        self.use_graphs = use_graphs
        self.n_sm = int(model.backend.n_sm)
        self.stream = cp.cuda.Stream(non_blocking=True)
        E, nq, kvd, F = self.n_embd, self.n_head * self.hd, self.n_kv * self.hd, self.n_ff
        q8 = lambda n: cp.zeros(n + n // 4, cp.uint8)   # noqa: E731  int8 values + float2 (d, d * sum) per 32
        self.d = {  # fixed addresses (graph capture); inp = [token, pos, len]
            "inp": cp.zeros(3, cp.int32), "x": cp.zeros((1, E), cp.float32), "x2": cp.zeros((1, E), cp.float32),
            "hn": cp.zeros((1, E), cp.float32),
            "qkv": cp.zeros((1, nq + 2 * kvd), cp.float32), "att": cp.zeros((1, nq), cp.float32),
            "o": cp.zeros((1, E), cp.float32), "gu": cp.zeros((1, 2 * F), cp.float32),
            "act": cp.zeros((1, F), cp.float32), "logits": cp.zeros((1, self.n_vocab), cp.float32),
            "partial": cp.zeros(self.n_head * max(MAX_SPLIT, GQA_MAX_SPLIT) * (self.hd + 2), cp.float32),
            "counters": cp.zeros(max(64, self.n_kv, self.n_head), cp.uint32),   # per KV head (v2) / head (v1)
            "ss": cp.zeros(max(1, E // 32), cp.float32),          # norm handoff: sums of x^2 per 32-row group
            "hcnt": cp.zeros(max(1, E // 32), cp.uint32),         # norm handoff: rows done per group
            "hq": q8(E), "aq": q8(nq), "fq": q8(F),
        }
        self.dp4a = DP4A
        self.glu = GLU                                        # SwiGLU fused into the gate/up matvec
        self.mv_block_from = MV_BLOCK_FROM                    # strata_matvec_q8b for rows this long (0: never)
        self.attn = ATTN                                      # "v1" | "v2" | "auto" (decode attention kernel)
        self.attn_merge = ATTN_MERGE                          # v1: the last split block merges (no combine launch)
        self.pre_wait = PRE_WAIT                              # graph: pos / len / page table read before PDL waits
        self.qkv_rope = QKV_ROPE                              # RoPE + K / V write in the QKV matvec
        self.fused_norm = FUSED_NORM                          # RMSNorms in the QKV and gate/up matvecs
        self.norm_handoff = NORM_HANDOFF                      # or handed off by the output / down matvecs
        self.graphs: dict[int, Any] = {}
        self.pf = PrefillScratch()             # prefill buffers and f16 weights for cuBLAS
        self.step_why: str | None = None       # why the persistent decode step is off or cannot run
        self.step_blocks = 0
        self._step: tuple | None = None
        self.step = STEP and self.prepare_step()
        if not STEP:
            self.step_why = "off (STRATA_CUDA_STEP=1 turns it on)"
        self.weight_bytes = sum(w.nbytes for L in self.layers() for w in
                                (L.wqkv, L.wq, L.wk, L.wv, L.wo, L.w_gate_up, L.w_gate, L.w_up, L.w_down)
                                if isinstance(w, DeviceWeight)) + \
            (model.output.nbytes if self.last else 0) + \
            (model.tok_embd.nbytes // max(1, self.n_vocab) if self.first else 0)   # one embedding row per token

    def layers(self) -> list:
        """The carve's layers (model.layers[lo:hi]; layer li of the model is layers()[li - lo])."""
        return self.model.layers[self.lo:self.hi]

    @staticmethod
    def unsupported(model, lo: int = 0, hi: int | None = None) -> str | None:
        """Why the plan cannot run the carve [lo, hi) of `model` (hi None: to the last block), or None if it can."""
        if getattr(model, "arch", None) != "llama":
            return f"architecture {getattr(model, 'arch', None)!r} is not 'llama'"
        if getattr(model, "rope_freqs", None) is not None or getattr(model, "freq_scale", 1.0) != 1.0:
            return "RoPE frequency factors / linear scaling"
        hi = model.config.n_layer if hi is None else hi
        if any(L.bq is not None or L.bk is not None or L.bv is not None for L in model.layers[lo:hi]):
            return "Q/K/V biases"
        c = model.config
        if c.head_dim not in (32, 64, 128, 256) or model.n_rot > c.head_dim or model.n_rot % 2:
            return f"head_dim {c.head_dim} / n_rot {model.n_rot} (needs 32, 64, 128 or 256)"
        if c.n_head // c.n_head_kv > 8:
            return f"{c.n_head // c.n_head_kv} query heads per KV head (at most 8)"
        # the embeddings only in the first stage, the output head only in the last
        if lo == 0 and not isinstance(model.tok_embd, DeviceWeight) or \
                model.ends_with_head(hi) and not isinstance(model.output, DeviceWeight):
            return "weights are not on the CUDA backend"
        return None

    def prefill_supported(self) -> bool:
        """Whether ``prefill`` can run this carve (fused QKV and gate/up weights, head_dim 64 or 128)."""
        return self.hd in FLASH_HEAD_DIMS and all(L.wqkv is not None and L.w_gate_up is not None
                                                  for L in self.layers())

    # ---- the decode step
    def prepare_step(self) -> bool:
        """Fill the persistent decode step's arguments (strata_step_args, its layer table copied to the device) for
        this model and pool (once; then setting self.step = True routes decode steps to it); False, with
        self.step_why saying why, when strata_decode_step cannot run them."""
        if self._step is not None:
            return True
        if not (self.first and self.last):
            self.step_why = f"a carve of layers [{self.lo}, {self.hi}) (the step runs the whole model)"
            return False
        if not self.dp4a:
            self.step_why = "f32 activations (STRATA_CUDA_DP4A=0)"
            return False
        if self.pool.kv != "f16":
            self.step_why = f"{self.pool.kv} KV cache (the step reads f16)"
            return False
        cp, ffi, lb, m, d, pool = self.cp, _ffi, lib(), self.model, self.d, self.pool
        ptr = lambda ct, a, off=0: ffi.cast(ct, a.data.ptr + off)   # noqa: E731

        def setmat(dst, w, row0: int, rows: int) -> bool:
            if not isinstance(w, DeviceWeight) or w.data.dtype != cp.uint8 or row0 + rows > w.shape[0]:
                return False
            rb = w.nbytes // w.shape[0]
            dst.w, dst.row_bytes, dst.type, dst.rows = ptr("void *", w.data, row0 * rb), rb, w.ggml_type, rows
            return True

        layers = ffi.new("strata_step_layer[]", self.n_layer)
        for li, L in enumerate(m.layers):
            mats = step_matrices(L, self.n_head, self.n_kv, self.hd, self.n_ff)
            if not all(setmat(getattr(layers[li], k), *v) for k, v in mats.items()):
                self.step_why = "a matrix is not in GGUF blocks on the device"
                return False
            layers[li].attn_norm = ffi.cast("const float *", _dptr(L.attn_norm))
            layers[li].ffn_norm = ffi.cast("const float *", _dptr(L.ffn_norm))
            slot = pool.slot(li)
            layers[li].k_cache, layers[li].v_cache = _p(pool.k[slot]), _p(pool.v[slot])
        a = ffi.new("strata_step_args *")
        sync = cp.zeros(2, cp.uint64)                          # grid barrier counter, argmax key
        if not setmat(a.head, m.output, 0, self.n_vocab):
            self.step_why = "the output head is not in GGUF blocks"
            return False
        a.out_norm = ffi.cast("const float *", _dptr(m.out_norm))
        a.inp, a.page_table = ptr("int *", d["inp"]), ptr("const int *", pool._pt)
        a.x, a.q, a.att = ptr("float *", d["x"]), ptr("float *", d["qkv"]), ptr("float *", d["att"])
        a.att_q8, a.act_q8 = _p(d["aq"]), _p(d["fq"])
        a.logits, a.ws = ptr("float *", d["logits"]), ptr("float *", d["partial"])
        a.counters = ptr("unsigned *", d["counters"])
        a.barrier, a.argmax = ptr("unsigned long long *", sync), ptr("unsigned long long *", sync, 8)
        a.n_layer, a.n_embd, a.n_head, a.n_kv, a.head_dim = self.n_layer, self.n_embd, self.n_head, self.n_kv, self.hd
        a.n_ff, a.n_vocab, a.n_rot, a.neox, a.page_size = self.n_ff, self.n_vocab, self.n_rot, self.neox, \
            pool.page_size
        a.max_split = GQA_MAX_SPLIT
        a.rope_base, a.eps, a.scale = self.theta, self.eps, self.scale
        if lb.strata_decode_step_check(a, layers) != 0:
            self.step_why = ("needs head_dim 64 / 128, <= 4 query heads per KV head, RoPE on adjacent pairs (not "
                             "NeoX), n_embd / n_ff multiples of 32 and Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrices "
                             "(gate and up of one type)")
            return False
        table = cp.asarray(np.frombuffer(ffi.buffer(layers), np.uint8).copy())
        a.layers = ptr("const strata_step_layer *", table)
        nb = lb.strata_decode_step_grid(a, STEP_BPS)
        if nb <= 0:
            self.step_why = (f"no grid for the step (CUDA error {-nb}"
                             f"{': needs compute capability 9.0' if -nb == 801 else ''})")
            return False
        self._step, self.step_blocks, self.step_why = (a, layers, table, sync), nb, None
        return True

    def _mv(self, s, ws, x, xq, n_in: int, long_rows: bool = False) -> None:
        """y = W x for each (W, y_ptr, n_out) in ws: from the q8_1 blocks xq (already written by the kernel that
        produced x) when the plan runs on int8 activations and W's type has the dp4a kernel, else from f32 x.
        long_rows (the down projection): a block per row (strata_matvec_q8b) from mv_block_from sub-blocks."""
        lb = lib()
        for w, y_ptr, n_out in ws:
            if self.dp4a and lb.strata_matvec_q8_supported(w.ggml_type):
                if long_rows and self._block_rows(n_in):
                    _check(lb.strata_matvec_q8b(s, w.ggml_type, _p(w.data), _p(xq), y_ptr, n_out, n_in,
                                                MV_BLOCK_ROWS), "strata_matvec_q8b")
                    continue
                _check(lb.strata_matvec_q8w(s, w.ggml_type, _p(w.data), _p(xq), y_ptr, n_out, n_in,
                                            rows_per_warp(n_out)), "strata_matvec_q8w")
            else:
                _check(lb.strata_matvec(s, w.ggml_type, _p(w.data), _p(x), y_ptr, n_out, n_in, 1), "strata_matvec")

    def _block_rows(self, n_in: int) -> bool:
        """Whether a long-row matvec (the down projection, rows of n_in values) runs one block per MV_BLOCK_ROWS rows
        (strata_matvec_q8b) rather than one warp per rows_per_warp rows: from mv_block_from sub-blocks per row."""
        return bool(self.mv_block_from and n_in // 32 >= self.mv_block_from)

    def _fused_glus(self) -> list | None:
        """Every layer's glu_pointers when every layer's QKV matvec takes RoPE and its gate/up matvec SwiGLU (what
        both the fused norms and the norm handoff need), else None."""
        layers = self.layers()
        glus = [self._glu_weights(L) for L in layers]
        return glus if all(self._qkv_rope(L) and g is not None for L, g in zip(layers, glus)) else None

    def fused_norm_rows(self) -> int:
        """QKV rows per warp with which the decode graph fuses the RMSNorms into the matvecs (FUSED_NORM), or 0 when
        it does not: every layer's QKV matvec must take RoPE (f16 cache), its gate/up matvec SwiGLU, and the fused
        kernels must fit the device for the layer's weight types and n_embd (strata_fused_norm_supported: n_embd %
        32 == 0, <= 4096, shared memory), tried with FUSED_NORM_R rows per warp, then fewer (smaller staged rows).
        All layers or none: the residual stream's buffers alternate only in the fused form."""
        if not (self.fused_norm and self.pool.kv == "f16"):
            return 0
        layers, glus = self.layers(), self._fused_glus()
        if glus is None:
            return 0
        lb, rp = lib(), glu_pairs_per_warp(self.n_ff, self.n_sm)
        for r in dict.fromkeys((FUSED_NORM_R, 2, 1)):
            if all(lb.strata_fused_norm_supported(L.wqkv.ggml_type, g[0], self.n_embd, r, rp)
                   for L, g in zip(layers, glus)):
                return r
        return 0

    def handoff_ok(self) -> bool:
        """Whether the decode graph hands the RMSNorms off (NORM_HANDOFF): every layer's QKV matvec takes RoPE (f16
        cache) and its gate/up matvec SwiGLU, the output and down projections have dp4a kernels, n_embd % 32 == 0 and
        <= 4096. All layers or none."""
        if not (self.norm_handoff and self.dp4a and self.pool.kv == "f16" and self.n_embd % 32 == 0
                and self.n_embd <= 4096):
            return False
        lb = lib()
        return self._fused_glus() is not None and all(
            L.wo is not None and lb.strata_matvec_q8_supported(L.wo.ggml_type)
            and lb.strata_matvec_q8_supported(L.w_down.ggml_type) for L in self.layers())

    def _qkv_rope(self, L) -> bool:
        """Whether the decode graph fuses RoPE and the K / V write into layer L's QKV matvec (QKV_ROPE)."""
        return bool(self.qkv_rope and self.dp4a and not self.neox and L.wqkv is not None
                    and lib().strata_matvec_q8_supported(L.wqkv.ggml_type))

    def _glu_weights(self, L):
        """glu_pointers for this layer's FFN when the plan fuses SwiGLU (GLU on, int8 activations), else None."""
        if not (self.glu and self.dp4a):
            return None
        return glu_pointers([L.w_gate_up] if L.w_gate_up is not None else [L.w_gate, L.w_up], self.n_ff, self.n_embd)

    def _enqueue_step(self, n_split: int, v2: bool, graph: bool = False) -> None:
        """Enqueue one decode step on the current stream (only preallocated buffers; token/pos from d['inp']);
        decode attention by strata_attn_decode_gqa (v2) or the first split-K kernel, n_split partitions. graph: the
        step is being captured as a graph, whose launches are ordered behind all earlier work on the stream, and in
        which only the last launch writes the position and length: the kernels may read them and the page table
        before their PDL wait (pre_wait; not so for eager steps, whose launches overlap the previous step's).
        A carve [lo, hi): the first stage starts from the embedding row, a later one from d['x'] (written by the
        caller before the step); the last ends with the final norm, the output matvec and the argmax, an earlier one
        with the residual stream in d['x']. Every stage advances the position and length."""
        lb, d, m, pool = lib(), self.d, self.model, self.pool
        s = _stream_ptr()
        E, H, KV, hd, F = self.n_embd, self.n_head, self.n_kv, self.hd, self.n_ff
        nq, kvd = H * hd, KV * hd
        inp = d["inp"].data.ptr
        tok_p, pos_p, len_p = (_ffi.cast("int *", inp + 4 * i) for i in range(3))
        f32 = lambda a, off=0: _ffi.cast("float *", a.data.ptr + 4 * off)  # noqa: E731
        NULL = _ffi.NULL
        q8 = self.dp4a
        hq, aq, fq = (_p(d[k]) if q8 else NULL for k in ("hq", "aq", "fq"))
        ctr = _ffi.cast("unsigned *", d["counters"].data.ptr)
        pt = pool._pt
        if self.first:
            _check(lb.strata_get_rows(s, m.tok_embd.ggml_type, _p(m.tok_embd.data), tok_p, _p(d["x"]), 1, E), "rows")
        if self.step:    # everything after the embedding row in one cooperative launch
            if self._step is None and not self.prepare_step():
                raise ValueError(f"the persistent decode step cannot run this model: {self.step_why}")
            _check(lb.strata_decode_step(s, self._step[0], self.step_blocks), "strata_decode_step")
            return
        pre = graph and self.pre_wait      # position, length and page table read before the PDL waits
        handoff = self.handoff_ok()        # the RMSNorms handed off by the output / down projections
        fused_r = 0 if handoff else self.fused_norm_rows()   # or inside the QKV and gate/up matvecs
        fused = fused_r > 0
        # the residual stream: fused, it alternates between x and x2 (a fused norm's block 0 writes x + delta to the
        # other buffer while every block reads both), delta = the last matvec's output not yet added (None: none);
        # handed off, the matvecs add to x in place
        xa, xb, delta = d["x"], d["x2"], None
        ss, hcnt = f32(d["ss"]), _ffi.cast("unsigned *", d["hcnt"].data.ptr)
        first_norm = m.layers[self.lo].attn_norm    # the carve's first layer normalizes its input, as layer 0 does
        if handoff:
            _check(lb.strata_norm_q8(s, _p(d["x"]), _dptr(first_norm), hq, ss, E), "norm_q8")
        elif not fused:
            _check(lb.strata_rms_norm_ex(s, _p(d["x"]), NULL, _dptr(first_norm), _p(d["hn"]), NULL, NULL, hq, 1, E,
                                         self.eps), "rms")
        qkv, gu = d["qkv"], d["gu"]
        for li in range(self.lo, self.hi):
            L = m.layers[li]
            end = li + 1 == self.hi        # the carve's last layer
            slot = pool.slot(li)
            kc, vc = pool.k[slot], pool.v[slot]
            ks, vs = pool.scales(slot)
            rope_fused = ks is None and self._qkv_rope(L)
            if rope_fused:   # RoPE and the K / V write in the QKV matvec's epilogue (and the norm in its prologue)
                norm = (_p(xa), _p(delta), _dptr(L.attn_norm), _p(xb)) if fused else (NULL, NULL, NULL, NULL)
                _check(lb.strata_matvec_q8w_rope(s, L.wqkv.ggml_type, _p(L.wqkv.data), hq, f32(qkv), H, KV, hd, E,
                                                 fused_r if fused else HANDOFF_R if handoff else
                                                 rows_per_warp(nq + 2 * kvd), pos_p,
                                                 _p(kc), _p(vc), _p(pt), self.n_rot, self.theta, pool.page_size,
                                                 *norm, self.eps, int(pre), ss if handoff else NULL), "matvec_rope")
                if fused:
                    xa, xb = xb, xa
            elif L.wqkv is not None:
                self._mv(s, [(L.wqkv, f32(qkv), nq + 2 * kvd)], d["hn"], d["hq"], E)
            else:
                self._mv(s, [(L.wq, f32(qkv), nq), (L.wk, f32(qkv, nq), kvd), (L.wv, f32(qkv, nq + kvd), kvd)],
                         d["hn"], d["hq"], E)
            if rope_fused:   # done in the QKV matvec's epilogue
                pass
            elif ks is None:
                _check(lb.strata_rope_kv_decode(s, f32(qkv), pos_p, _p(kc), _p(vc), _p(pt), H, KV, hd, self.n_rot,
                                                self.theta, self.neox, pool.page_size), "rope_kv")
            else:   # q8_0 cache: RoPE in place, then the K/V rows quantized into the cache
                _check(lb.strata_rope_kv_decode(s, f32(qkv), pos_p, NULL, NULL, _p(pt), H, KV, hd, self.n_rot,
                                                self.theta, self.neox, pool.page_size), "rope")
                _check(lb.strata_kv_write_q8(s, f32(qkv, nq), nq + 2 * kvd, f32(qkv, nq + kvd), nq + 2 * kvd, _p(kc),
                                             _p(vc), _p(ks), _p(vs), _p(pt), pos_p, 0, 1, KV, hd, pool.page_size),
                       "kv_write_q8")
            if v2:
                _check(lb.strata_attn_decode_gqa(s, f32(qkv), _p(kc), _p(vc), _p(pt), len_p, 0, _p(d["partial"]), ctr,
                                                 _p(d["att"]), aq, H, KV, hd, pool.page_size, n_split, self.scale,
                                                 _p(ks), _p(vs)), "attn")
            else:
                _check(lb.strata_attn_decode_ex(s, f32(qkv), _p(kc), _p(vc), _p(pt), len_p, 0, _p(d["partial"]),
                                                _p(d["att"]), aq, ctr if self.attn_merge else NULL, int(pre), H,
                                                KV, hd, pool.page_size, n_split, self.scale), "attn")
            glu = self._glu_weights(L)
            vp = lambda a: _ffi.cast("void *", a)   # noqa: E731
            if handoff:      # x += Wo att, handing off the FFN norm; gate/up scaled by its 1 / rms; x += W_down act
                _check(lb.strata_matvec_q8_resid(s, L.wo.ggml_type, _p(L.wo.data), aq, E, nq, rows_per_warp(E), 0,
                                                 _p(xa), _dptr(L.ffn_norm), hq, ss, hcnt), "matvec_resid")
                _check(lb.strata_matvec_q8w_glu_norm(s, glu[0], vp(glu[1]), vp(glu[2]), hq, _p(d["act"]), fq, F, E,
                                                     glu_pairs_per_warp(F, self.n_sm), NULL, NULL, NULL, NULL,
                                                     self.eps, ss), "matvec_glu_norm")
                block = self._block_rows(F)
                # no handoff past the carve: a middle stage ends with x (in place) and the next stage normalizes it
                _check(lb.strata_matvec_q8_resid(s, L.w_down.ggml_type, _p(L.w_down.data), fq, E, F,
                                                 MV_BLOCK_ROWS if block else rows_per_warp(E), int(block), _p(xa),
                                                 NULL if end else _dptr(m.layers[li + 1].attn_norm), hq, ss, hcnt),
                       "matvec_resid")
                if end and self.last:
                    _check(lb.strata_rms_norm_ex(s, _p(xa), NULL, _dptr(m.out_norm), _p(d["hn"]), NULL, NULL, hq, 1,
                                                 E, self.eps), "rms")
                continue
            self._mv(s, [(L.wo, _p(d["o"]), E)], d["att"], d["aq"], nq)
            if fused:        # the norm in the gate/up matvec's prologue: x + o -> the other residual buffer
                _check(lb.strata_matvec_q8w_glu_norm(s, glu[0], vp(glu[1]), vp(glu[2]), NULL, _p(d["act"]), fq, F, E,
                                                     glu_pairs_per_warp(F, self.n_sm), _p(xa), _p(d["o"]),
                                                     _dptr(L.ffn_norm), _p(xb), self.eps, NULL), "matvec_glu_norm")
                xa, xb = xb, xa
            else:
                _check(lb.strata_rms_norm_ex(s, _p(d["o"]), _p(d["x"]), _dptr(L.ffn_norm), _p(d["hn"]), _p(d["x"]),
                                             NULL, hq, 1, E, self.eps), "rms")
                if glu is not None:      # SwiGLU in the gate/up matvec: act and its q8_1 blocks from one launch
                    _check(lb.strata_matvec_q8w_glu(s, glu[0], vp(glu[1]), vp(glu[2]), hq, _p(d["act"]), fq, F, E,
                                                    glu_pairs_per_warp(F, self.n_sm)), "matvec_glu")
                else:
                    if L.w_gate_up is not None:
                        self._mv(s, [(L.w_gate_up, f32(gu), 2 * F)], d["hn"], d["hq"], E)
                    else:
                        self._mv(s, [(L.w_gate, f32(gu), F), (L.w_up, f32(gu, F), F)], d["hn"], d["hq"], E)
                    _check(lb.strata_swiglu_gu(s, f32(gu), 1, F, _p(d["act"]), NULL, fq), "swiglu")
            self._mv(s, [(L.w_down, _p(d["o"]), E)], d["act"], d["fq"], F, long_rows=True)
            if fused:
                delta = d["o"]
                if not end:
                    continue
            if not end or self.last:   # x += o and the next layer's (or the final) norm
                nxt = m.out_norm if end else m.layers[li + 1].attn_norm
                _check(lb.strata_rms_norm_ex(s, _p(d["o"]), _p(xa), _dptr(nxt), _p(d["hn"]), _p(xa), NULL, hq, 1,
                                             E, self.eps), "rms")
            else:   # a middle stage's end: x = xa + o into d['x'] alone (the kernel reads a weight, writes no norm)
                _check(lb.strata_rms_norm_ex(s, _p(d["o"]), _p(xa), _dptr(L.ffn_norm), NULL, _p(d["x"]), NULL, NULL,
                                             1, E, self.eps), "residual")
        if self.last:
            self._mv(s, [(m.output, _p(d["logits"]), self.n_vocab)], d["hn"], d["hq"], E)
            _check(lb.strata_argmax(s, _p(d["logits"]), tok_p, 1, self.n_vocab), "argmax")
        _check(lb.strata_add_scalar(s, pos_p, 1, 2), "add")

    def decode_attn_v2(self, size_class: int) -> bool:
        """Whether the decode step of this size class uses the GQA-shared kernel (strata_attn_decode_gqa) rather
        than the first split-K kernel: always for a q8_0 cache (the first kernel reads f16 only), else by
        self.attn ("v2", "v1", or "auto": from AUTO_V2_FROM positions up)."""
        if self.pool.kv == "q8_0" or self.attn == "v2":
            return True
        return self.attn == "auto" and size_class >= AUTO_V2_FROM

    def attn_resident(self) -> int:
        """Resident blocks per multiprocessor of this plan's v2 decode attention kernel (gqa_resident)."""
        return gqa_resident(self.hd, self.n_head // max(1, self.n_kv), self.pool.kv == "q8_0")

    @staticmethod
    def size_class(length: int) -> int:
        """Context-size class of a step attending over `length` positions: the power of two >= max(256, length)."""
        c = 256
        while c < length:
            c *= 2
        return c

    def _launch(self, length: int) -> None:
        """One step attending over `length` positions, on self.stream (graph replay or eager launches)."""
        if self.step:    # the step sizes its attention split from the length itself: one graph for all
            cls, v2, n_split = -1, True, 0
        else:
            cls = self.size_class(length)
            v2 = self.decode_attn_v2(cls)
            n_split = n_split_class(cls, self.n_kv, self.n_sm, self.attn_resident()) if v2 else \
                n_split_for(cls)
        if not self.use_graphs:
            self._enqueue_step(n_split, v2)
            return
        g = self.graphs.get(cls)
        if g is None:
            self.stream.begin_capture()
            try:
                self._enqueue_step(n_split, v2, graph=True)
            finally:
                g = self.stream.end_capture()
            self.graphs[cls] = g
        g.launch(self.stream)

    def _begin(self, state, tokens: list[int], n: int) -> None:
        check_sequence(self.pool, state)
        kv = state.kv
        for t in tokens:
            if not 0 <= t < self.n_vocab:
                raise ValueError(f"token id out of range [0, {self.n_vocab})")
        kv.reserve(n)                                         # KVCacheFull here changes nothing
        cp = self.cp
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        with self.stream:
            self.pool.table(kv.pages)
            self.d["inp"].set(np.asarray([tokens[0], state.pos, state.pos + 1], dtype=np.int32), stream=self.stream)

    def decode_device(self, token: int, state, x_in=None):
        """LlamaModel.forward([token], state) through the graph, logits left on the device: a CuPy f32 (n_vocab,)
        view of the plan's logits buffer (valid until the next step), ordered on the current stream. A carve: x_in,
        the hidden state a stage after the first starts from (CuPy f32, n_embd elements, on the plan's device), is
        copied in before the step; a stage before the last returns its hidden state instead of logits, a CuPy f32
        (1, n_embd) view of the plan's residual-stream buffer (valid until the next step)."""
        token = int(token)
        x = hidden_input(x_in, 1, self.n_embd, self.first, self.model.backend.device_id)
        self._begin(state, [token], 1)
        with self.stream:
            if x is not None:
                self.d["x"][...] = x         # outside the graph, which reads d['x']
            self._launch(state.pos + 1)
        self.cp.cuda.get_current_stream().wait_event(self.stream.record())
        state.kv.commit(1)
        state.advance([token])
        return self.d["logits"][0] if self.last else self.d["x"][:1]

    def decode(self, token: int, state, x_in=None):
        """LlamaModel.forward([token], state) through the graph -> f32 logits (n_vocab,) on the host; a stage before
        the last: its hidden state, a CuPy f32 (1, n_embd) copy (decode_device)."""
        out = self.decode_device(token, state, x_in)
        return self.cp.asnumpy(out) if self.last else out.copy()

    def decode_greedy(self, first_token: int, n: int, state) -> list[int]:
        """Feed first_token at state.pos, then n - 1 device-argmax tokens; returns the n argmax tokens chosen.
        The sequence advances by n (first_token and the first n - 1 chosen). The whole model only (no carve)."""
        if not (self.first and self.last):
            raise ValueError(f"decode_greedy runs the whole model, not the carve [{self.lo}, {self.hi})")
        if n < 1:
            return []
        self._begin(state, [int(first_token)], n)
        cp = self.cp
        out = cp.zeros(n, cp.int32)
        p0 = state.pos
        with self.stream:
            for i in range(n):
                self._launch(p0 + i + 1)
                out[i:i + 1] = self.d["inp"][0:1]
            got = [int(t) for t in cp.asnumpy(out, stream=self.stream)]
        state.kv.commit(n)
        state.advance([int(first_token)] + got[:-1])
        return got

    def logits(self) -> np.ndarray:
        """Logits of the last step (host f32 (n_vocab,))."""
        return self.cp.asnumpy(self.d["logits"][0], stream=self.stream)

    # ---- prefill
    def prefill(self, tokens, state, all_logits: bool = False, x_in=None):
        """LlamaModel.forward(tokens, state, all_logits) for n >= 1 tokens on the current stream -> host f32 logits
        (n_vocab,) of the last token, or (n, n_vocab) with all_logits. Same errors and bookkeeping. A carve: a stage
        after the first starts from x_in (CuPy f32 (n, n_embd) on the plan's device) instead of the embedding rows
        (the tokens are counted and recorded all the same); a stage before the last returns its hidden states, a
        CuPy f32 (n, n_embd) array of its own (all_logits unused)."""
        cp, lb, m, pool = self.cp, lib(), self.model, self.pool
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = int(toks.shape[0])
        if n == 0:
            raise ValueError("forward() needs at least one token")
        if int(toks.min()) < 0 or int(toks.max()) >= self.n_vocab:
            raise ValueError(f"token id out of range [0, {self.n_vocab})")
        x_in = hidden_input(x_in, n, self.n_embd, self.first, m.backend.device_id)
        check_sequence(pool, state)
        kv = state.kv
        kv.reserve(n)
        s = _stream_ptr()
        E, H, KV, hd, F = self.n_embd, self.n_head, self.n_kv, self.hd, self.n_ff
        nq, kvd = H * hd, KV * hd
        W = nq + 2 * kvd
        NULL = _ffi.NULL
        pos0 = int(state.pos)
        pt = pool.table(kv.pages)
        x = self.pf.buf("x", (n, E), cp.float32)
        h16 = self.pf.buf("h16", (n, max(E, nq)), cp.float16)
        qkv = self.pf.buf("qkv", (n, W), cp.float32)
        gu = self.pf.buf("gu", (n, 2 * F), cp.float32)
        act16 = self.pf.buf("act16", (n, F), cp.float16)
        total = pos0 + n
        n_split = fa2_splits(n, H, total, self.n_sm)
        ws = self.pf.buf("ws", (n_split * H * n * (hd + 2),), cp.float32) if n_split > 1 else None
        if self.first:
            ids = cp.asarray(toks)
            _check(lb.strata_get_rows(s, m.tok_embd.ggml_type, _p(m.tok_embd.data), _p(ids), _p(x), n, E), "rows")
        else:
            x[...] = x_in
        hE = h16[:, :E] if h16.shape[1] == E else self.pf.buf("hE", (n, E), cp.float16)
        att16 = h16[:, :nq] if h16.shape[1] == nq else self.pf.buf("att16", (n, nq), cp.float16)
        for li in range(self.lo, self.hi):
            L = m.layers[li]
            slot = pool.slot(li)
            kc, vc = pool.k[slot], pool.v[slot]
            ks, vs = pool.scales(slot)
            _check(lb.strata_rms_norm_ex(s, _p(x), NULL, _dptr(L.attn_norm), NULL, NULL, _p(hE), NULL, n, E,
                                         self.eps), "rms")
            self.pf.gemm(hE, L.wqkv, qkv, False)
            if ks is None:
                _check(lb.strata_rope_kv_prefill(s, _p(qkv), W, pos0, _p(kc), _p(vc), _p(pt), n, H, KV, hd,
                                                 self.n_rot, self.theta, self.neox, pool.page_size), "rope_kv_prefill")
            else:   # q8_0 cache: RoPE in place, then the K/V rows quantized into the cache
                _check(lb.strata_rope_kv_prefill(s, _p(qkv), W, pos0, NULL, NULL, _p(pt), n, H, KV, hd, self.n_rot,
                                                 self.theta, self.neox, pool.page_size), "rope_prefill")
                kq = _ffi.cast("float *", qkv.data.ptr + 4 * nq)
                vq = _ffi.cast("float *", qkv.data.ptr + 4 * (nq + kvd))
                _check(lb.strata_kv_write_q8(s, kq, W, vq, W, _p(kc), _p(vc), _p(ks), _p(vs), _p(pt), NULL, pos0, n,
                                             KV, hd, pool.page_size), "kv_write_q8")
            _check(lb.strata_fa2_prefill(s, _p(qkv), W, _p(kc), _p(vc), _p(pt), NULL, _p(att16), _p(ws), n, H, KV,
                                         hd, pool.page_size, pos0, n_split, self.scale, _p(ks), _p(vs)),
                   "fa2_prefill")
            self.pf.gemm(att16, L.wo, x, True)
            _check(lb.strata_rms_norm_ex(s, _p(x), NULL, _dptr(L.ffn_norm), NULL, NULL, _p(hE), NULL, n, E,
                                         self.eps), "rms")
            self.pf.gemm(hE, L.w_gate_up, gu, False)
            _check(lb.strata_swiglu_gu(s, _p(gu), n, F, NULL, _p(act16), NULL), "swiglu")
            self.pf.gemm(act16, L.w_down, x, True)
        out = prefill_logits(m, x, all_logits, self.eps) if self.last else x.copy()   # x: the scratch buffer
        kv.commit(n)
        state.advance(toks)
        return out


_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


class GraphDecodeModel:
    """What the engine runs on CUDA: the LlamaModel itself (prefill, all_logits, every attribute), except that a
    one-token forward() on a CudaPagePool sequence goes through the LlamaCuda decode plan (CUDA graph).
    STRATA_CUDA_GRAPHS=0 turns the plan off (every call is LlamaModel.forward, eager).

    lo, hi: the carve, layers [lo, hi) (hi None: to the last block) that this stage runs (its plans are made with
    it); a stage after the first takes the previous stage's hidden states (x_in), a stage before the last returns
    its own (CuPy f32 (n, n_embd)) instead of logits; everything the plans do not take goes to the model's
    forward_carve."""

    device_logits = True        # forward_device leaves the last token's logits on the device

    def __init__(self, model, lo: int = 0, hi: int | None = None):
        self.model = model
        self.lo, self.hi = carve_bounds(lo, hi, model.config.n_layer)
        self.plans: dict[int, LlamaCuda] = {}
        self.use_graphs = os.environ.get("STRATA_CUDA_GRAPHS", "1") not in ("0", "false", "no")

    def __getattr__(self, name):
        return getattr(self.model, name)

    def plan(self, pool: CudaPagePool) -> LlamaCuda:
        p = self.plans.get(id(pool))
        if p is None or p.pool is not pool:
            p = self.plans[id(pool)] = LlamaCuda(self.model, pool, lo=self.lo, hi=self.hi)
        return p

    def generic_forward(self, tokens, state, all_logits: bool = False, x_in=None):
        """The model's own forward of this carve (host logits for the last stage, the hidden states on the device
        before it)."""
        return self.model.forward_carve(tokens, state, self.lo, self.hi, x_in=x_in, all_logits=all_logits)

    def forward(self, tokens, state, all_logits: bool = False, x_in=None):
        """LlamaModel.forward (same arguments, result and errors), on the backend's device in any thread: one token
        through the plan's CUDA graph, several through the plan's prefill. A carve: x_in the hidden states a stage
        after the first starts from; a stage before the last returns its hidden states (CuPy f32 (n, n_embd))."""
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
        with self.model.backend.device:
            if self.use_graphs and isinstance(state.kv.pool, CudaPagePool):
                plan = self.plan(state.kv.pool)
                if toks.shape[0] == 1 and not all_logits:
                    return plan.decode(int(toks[0]), state, x_in)
                if toks.shape[0] > 1 and plan.prefill_supported():
                    return plan.prefill(toks, state, all_logits, x_in)
            return self.generic_forward(tokens, state, all_logits, x_in)

    def forward_device(self, tokens, state, x_in=None):
        """forward(tokens, state, x_in=x_in) with the last token's logits left on the device: CuPy f32 (n_vocab,),
        ordered on the current stream (valid until the next call); a stage before the last: its hidden states, CuPy
        f32 (n, n_embd)."""
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
        with self.model.backend.device:
            if self.use_graphs and toks.shape[0] == 1 and isinstance(state.kv.pool, CudaPagePool):
                return self.plan(state.kv.pool).decode_device(int(toks[0]), state, x_in)
            return self.model.backend.cp.asarray(self.forward(tokens, state, x_in=x_in))   # hidden: as it is


CUDABackend = CudaBackend   # the name strata/engine/engine.py imports
