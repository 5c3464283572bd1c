"""The CUDA backend: CuPy owns device memory, streams, graphs and cuBLAS; Strata's raw kernels (strata/_cuda_kernels.so,
built from native/cuda/ by native/build_cuda.py) are loaded through cffi in ABI mode and launched on CuPy's stream.

Two entry points:

* ``CudaBackend`` implements the Backend ops of docs/internals.md (upload, embed, matmul, rms_norm, rope,
  attention, swiglu, to_host) on CuPy arrays, so ``strata/models/llama.py`` runs on it unchanged.
* ``LlamaCuda`` is the fast path for the ``llama`` architecture used by the benchmark and the parity test: fused
  QKV and gate/up weights, a preallocated decode step captured once per context-size class as a CUDA graph (one
  graph launch per token, argmax on the device), and a prefill path that dequantizes each weight to f16 and
  calls cuBLAS (GemmEx, f32 accumulate).

Numerics: weights are dequantized exactly as llama.cpp's dequantize_row_* (f32 arithmetic); decode matvec keeps
activations in f32; prefill GEMMs take f16 activations and f16 weights with f32 accumulation; the KV cache is f16.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strata.backend.base import Backend
from strata.kv_cache import DEFAULT_PAGE_SIZE, PagedKV, PagePool

_CDEF = """
int strata_supports_type(int ggml_type);
int strata_matvec(void *stream, int ggml_type, const void *w, const float *x, float *y, int n_out, int n_in, int n_tokens);
int strata_dequant(void *stream, int ggml_type, const void *w, void *out, int n_rows, int n_in, int out_f16);
int strata_get_rows(void *stream, int ggml_type, const void *w, const int *ids, float *out, int n_ids, int n_in);
int strata_rms_norm(void *stream, const float *x, const float *residual, const float *weight, float *out,
                    float *sum_out, int n_rows, int dim, float eps);
int strata_rope(void *stream, float *x, const int *positions, int n_tokens, int n_heads, int head_dim, int n_rot,
                float base, int neox);
int strata_swiglu(void *stream, const float *gate, const float *up, float *out, long long n);
int strata_kv_write(void *stream, const float *k, const float *v, void *k_cache, void *v_cache, const int *page_table,
                    const int *d_start, int start_off, int n, int n_kv, int hd, int page_size);
int strata_attn_decode(void *stream, const float *q, const void *k_cache, const void *v_cache, const int *page_table,
                       const int *d_len, int len, float *partial, float *out, int n_head, int n_kv, int hd,
                       int page_size, int n_split, float scale);
int strata_kv_gather(void *stream, const void *k_cache, const void *v_cache, const int *page_table, float *k_out,
                     float *v_out, int len, int n_kv, int hd, int page_size);
int strata_causal_softmax(void *stream, float *s, int n_rows_total, int n_q, int len, int pos0, float scale);
int strata_argmax(void *stream, const float *x, int *out, int n_rows, int n);
int strata_add_scalar(void *stream, int *p, int delta, int count);
int strata_rope_kv_decode(void *stream, float *qkv, const int *pos, void *k_cache, void *v_cache, const int *page_table,
                          int n_head, int n_kv, int hd, int n_rot, float base, int neox, int page_size);
"""

MAX_SPLIT = 256          # split-K partitions of decode attention (about 64 positions each)


def n_split_for(length: int) -> int:
    """Split-K partitions for decode attention over length positions: ~64 positions per block, at most MAX_SPLIT."""
    return max(1, min(MAX_SPLIT, (length + 63) // 64))

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
        return f"no usable CUDA device ({e})"
    try:
        import cffi  # noqa: F401
    except ImportError:
        return "cffi is not installed"
    if not _lib_path().exists():
        return f"kernel library {_lib_path()} missing (run: python native/build_cuda.py)"
    return None


def _lib_path() -> Path:
    return Path(os.environ.get("STRATA_CUDA_LIB", str(DEFAULT_LIB)))


def lib():
    """The cffi handle of the kernel library (loaded once)."""
    global _lib, _ffi
    if _lib is None:
        import cffi
        ffi = cffi.FFI()
        ffi.cdef(_CDEF)
        p = _lib_path()
        if not p.exists():
            raise CudaUnavailable(f"kernel library {p} missing (run: python native/build_cuda.py)")
        _lib, _ffi = ffi.dlopen(str(p)), ffi
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        import cupy
        msg = cupy.cuda.runtime.getErrorString(rc)
        raise RuntimeError(f"{what} failed: CUDA error {rc} ({msg.decode() if isinstance(msg, bytes) else msg})")


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

    device: CUDA ordinal (``--device cuda:N``). kv_dtype: "f16" only for now (``--kv q8_0`` raises ValueError).
    The PagePool made by ``new_page_pool`` keeps the documented float32 layout (n_kv_head, n_pages, page_size,
    head_dim) as CuPy arrays, so checkpoints and parking read pages as on the CPU. Raises CudaUnavailable when
    CuPy, a GPU or the kernel library is missing.
    """

    def __init__(self, device: int = 0, kv_dtype: str = "f16", gemm_threshold: int = 8):
        why = unavailable_reason()
        if why:
            raise CudaUnavailable(f"CUDA backend unavailable: {why}")
        if kv_dtype != "f16":
            raise ValueError(f"kv_dtype {kv_dtype!r} is not implemented on CUDA (only 'f16')")
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
        for s in range(0, n, 8):
            e = min(n, s + 8)
            _check(lib().strata_matvec(_stream_ptr(), w.ggml_type, _p(w.data), _p(x[s:e]), _p(y[s:e]), w.shape[0],
                                       w.shape[1], e - s), "strata_matvec")
        return y

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

    # ---- the PagePool path used by model files (strata/kv_cache.py)
    def new_page_pool(self, layers, n_pages: int, n_kv_head: int, head_dim: int, page_size: int = DEFAULT_PAGE_SIZE,
                      head_dim_v: int | None = None) -> PagePool:
        """PagePool with zeroed float32 CuPy storage (n_kv_head, n_pages, page_size, head_dim) per attention layer."""
        cp = self.cp
        hv = head_dim_v or head_dim
        k = [cp.zeros((n_kv_head, n_pages, page_size, head_dim), cp.float32) for _ in layers]
        v = [cp.zeros((n_kv_head, n_pages, page_size, hv), cp.float32) for _ in layers]
        return PagePool(layers, n_pages, page_size, n_kv_head, head_dim, k, v, to_host=cp.asnumpy, head_dim_v=hv)

    def attention(self, q, k, v, kv: PagedKV, layer: int, scale: float):
        """See Backend.attention: k/v written into the sequence's pages (PagePool.write), K/V of [0, length + n)
        read back (PagePool.read: a view for one ascending run of pages), then S = Q K^T per KV head (cuBLAS,
        f32), causal softmax (strata_causal_softmax), O = P V. Queries are chunked so S stays under 1 GiB."""
        cp = self.cp
        q, k, v = self.asarray(q), self.asarray(k), self.asarray(v)
        n, n_head, hd = q.shape
        n_kv = k.shape[1]
        if n_head % n_kv:
            raise ValueError(f"n_head {n_head} is not a multiple of n_kv_head {n_kv}")
        g = n_head // n_kv
        pool = kv.pool
        slot = pool.slot(layer)
        start = kv.length
        if start + n > kv.capacity:
            raise ValueError(f"attention at [{start}, {start + n}) past the reserved pages ({kv.capacity})")
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
        s = _stream_ptr()
        _check(lib().strata_kv_write(s, _p(k), _p(v), _p(kc), _p(vc), _p(pt), _ffi.NULL, length, n, n_kv, hd, ps),
               "strata_kv_write")
        total = length + n
        if n == 1:
            n_split = n_split_for(total)
            need = n_head * n_split * (hd + 2)
            if self._partial is None or self._partial.size < need:
                self._partial = cp.empty(need, cp.float32)
            out = cp.empty((1, n_head, hd), cp.float32)
            _check(lib().strata_attn_decode(s, _p(q), _p(kc), _p(vc), _p(pt), _ffi.NULL, total, _p(self._partial),
                                            _p(out), n_head, n_kv, hd, ps, n_split, float(scale)), "strata_attn_decode")
            return out
        return prefill_attention(self, q, kc, vc, pt, length, n_kv, ps, scale)


def prefill_attention(be, q, kc, vc, pt, length: int, n_kv: int, ps: int, scale: float):
    """Causal GQA attention of n new queries (positions length..length+n-1) over the paged f16 cache.

    Gathers K/V to f32, S = Q K^T per KV head (cuBLAS batched), masked softmax (strata_causal_softmax), O = P V.
    Memory: n_head * n * (length + n) * 4 bytes for S.
    """
    cp = be.cp
    n, n_head, hd = q.shape
    g = n_head // n_kv
    total = length + n
    kf = cp.empty((n_kv, total, hd), cp.float32)
    vf = cp.empty((n_kv, total, hd), cp.float32)
    s = _stream_ptr()
    _check(lib().strata_kv_gather(s, _p(kc), _p(vc), _p(pt), _p(kf), _p(vf), total, n_kv, hd, ps), "strata_kv_gather")
    qh = cp.ascontiguousarray(q.transpose(1, 0, 2)).reshape(n_kv, g * n, hd)
    S = cp.matmul(qh, kf.transpose(0, 2, 1))                       # (n_kv, g*n, total)
    _check(lib().strata_causal_softmax(s, _p(S), n_kv * g * n, n, total, length, float(scale)), "strata_causal_softmax")
    O = cp.matmul(S, vf)                                             # (n_kv, g*n, hd)
    return cp.ascontiguousarray(O.reshape(n_head, n, hd).transpose(1, 0, 2))


# ------------------------------------------------------------------------------------------------ llama fast path
def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:
        v = f.parts[f.data[0]]
        return v.tobytes().decode() if v.dtype == np.uint8 else v.item()


class LlamaCuda:
    """The ``llama`` architecture on the GPU with fused weights and CUDA-graph decode.

    path: GGUF file. max_ctx: KV capacity in tokens (rounded up to pages of 256). ubatch: prefill chunk.
    ``prefill(tokens) -> logits f32 (n_vocab,)`` of the last token; ``decode_greedy(first_token, n) -> list[int]``
    runs n graph launches (argmax on the device); ``step_logits(token) -> logits`` is one eager decode step.
    """

    PAGE = 256

    def __init__(self, path: str, backend: CudaBackend | None = None, max_ctx: int = 4096, ubatch: int = 512,
                 use_graphs: bool = True):
        import gguf
        cp = self.cp = __import__("cupy")
        self.be = backend or CudaBackend()
        r = gguf.GGUFReader(path)
        arch = _field(r, "general.architecture")
        if arch != "llama":
            raise ValueError(f"LlamaCuda: architecture {arch!r} is not 'llama'")
        a = arch
        self.n_embd = int(_field(r, f"{a}.embedding_length"))
        self.n_layer = int(_field(r, f"{a}.block_count"))
        self.n_head = int(_field(r, f"{a}.attention.head_count"))
        self.n_kv = int(_field(r, f"{a}.attention.head_count_kv", self.n_head))
        self.hd = self.n_embd // self.n_head
        self.n_rot = int(_field(r, f"{a}.rope.dimension_count", self.hd))
        self.theta = float(_field(r, f"{a}.rope.freq_base", 10000.0))
        self.eps = float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-5))
        self.n_ff = int(_field(r, f"{a}.feed_forward_length"))
        self.scale = 1.0 / math.sqrt(self.hd)
        T = {t.name: t for t in r.tensors}

        def up(name):
            t = T[name]
            shape = tuple(int(s) for s in reversed(list(t.shape)))
            return upload_raw(name, int(t.tensor_type), shape, np.asarray(t.data))

        self.tok = up("token_embd.weight")
        self.n_vocab = self.tok.shape[0]
        self.out_norm = up("output_norm.weight")
        self.output = up("output.weight") if "output.weight" in T else self.tok
        self.layers = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            q, k, v = up(p + "attn_q.weight"), up(p + "attn_k.weight"), up(p + "attn_v.weight")
            g, u = up(p + "ffn_gate.weight"), up(p + "ffn_up.weight")
            L = {"attn_norm": up(p + "attn_norm.weight"), "ffn_norm": up(p + "ffn_norm.weight"),
                 "wo": up(p + "attn_output.weight"), "down": up(p + "ffn_down.weight")}
            try:
                L["qkv"] = concat_weights(p + "qkv", [q, k, v])
            except ValueError:
                L["q"], L["k"], L["v"] = q, k, v
            try:
                L["gu"] = concat_weights(p + "gate_up", [g, u])
            except ValueError:
                L["gate"], L["up"] = g, u
            self.layers.append(L)
        del r
        self.weight_bytes = sum(w.nbytes for L in self.layers for w in L.values()) + self.output.nbytes + \
            self.out_norm.nbytes + self.n_embd * 2   # one embedding row per token
        self.ubatch = ubatch
        self.use_graphs = use_graphs
        self.max_ctx = 0
        self.resize(max_ctx)
        self.stream = cp.cuda.Stream(non_blocking=True)
        E, kvd = self.n_embd, self.n_kv * self.hd
        self.d = {  # decode buffers (fixed addresses for graph capture)
            "tok": cp.zeros(1, cp.int32), "pos": cp.zeros(2, cp.int32), "x": cp.zeros((1, E), cp.float32),
            "hn": cp.zeros((1, E), cp.float32), "qkv": cp.zeros((1, E + 2 * kvd), cp.float32),
            "att": cp.zeros((1, E), cp.float32), "o": cp.zeros((1, E), cp.float32),
            "gu": cp.zeros((1, 2 * self.n_ff), cp.float32), "act": cp.zeros((1, self.n_ff), cp.float32),
            "logits": cp.zeros((1, self.n_vocab), cp.float32),
        }
        self.graphs: dict[int, Any] = {}
        self.pos = 0

    def resize(self, max_ctx: int) -> None:
        """Allocate the KV cache for max_ctx tokens (drops its contents)."""
        cp = self.cp
        n_pages = (max_ctx + self.PAGE - 1) // self.PAGE
        self.max_ctx = n_pages * self.PAGE
        shape = (n_pages, self.PAGE, self.n_kv, self.hd)
        self.kc = [cp.zeros(shape, cp.float16) for _ in range(self.n_layer)]
        self.vc = [cp.zeros(shape, cp.float16) for _ in range(self.n_layer)]
        self.pt = cp.arange(n_pages, dtype=cp.int32)
        self.partial = cp.zeros(self.n_head * MAX_SPLIT * (self.hd + 2), cp.float32)
        self.graphs = {}
        self.pos = 0

    def kv_bytes(self) -> int:
        return 2 * sum(k.nbytes for k in self.kc)

    def reset(self) -> None:
        self.pos = 0

    # ---- eager building blocks (x: (n, E) f32)
    def _mm(self, x, w, out=None):
        return self.be.matmul(x, w, out)

    def _layer_qkv(self, L, hn):
        if "qkv" in L:
            y = self._mm(hn, L["qkv"])
            E, kvd = self.n_embd, self.n_kv * self.hd
            return y[:, :E], y[:, E:E + kvd], y[:, E + kvd:]
        return self._mm(hn, L["q"]), self._mm(hn, L["k"]), self._mm(hn, L["v"])

    def _ffn(self, L, hn):
        if "gu" in L:
            y = self._mm(hn, L["gu"])
            F = self.n_ff
            return self.be.swiglu(y[:, :F], y[:, F:])
        return self.be.swiglu(self._mm(hn, L["gate"]), self._mm(hn, L["up"]))

    def forward(self, tokens, all_logits: bool = False):
        """Eager forward of tokens (int, n) at self.pos; returns f32 logits (n_vocab,) or (n, n_vocab) on the host."""
        cp, be = self.cp, self.be
        tokens = np.asarray(tokens, dtype=np.int32)
        outs = []
        with self.stream:
            for s in range(0, len(tokens), self.ubatch):
                chunk = tokens[s:s + self.ubatch]
                lg = self._forward_chunk(chunk, all_logits or s + self.ubatch >= len(tokens), all_logits)
                if lg is not None:
                    outs.append(lg)
            self.stream.synchronize()
        res = cp.asnumpy(cp.concatenate(outs, axis=0))
        return res if all_logits else res[-1]

    def _forward_chunk(self, chunk, want_logits: bool, all_rows: bool = False):
        cp, be, lb = self.cp, self.be, lib()
        n = len(chunk)
        if self.pos + n > self.max_ctx:
            raise ValueError(f"context overflow: {self.pos + n} > max_ctx {self.max_ctx}")
        E, H, KV, hd = self.n_embd, self.n_head, self.n_kv, self.hd
        s = _stream_ptr()
        x = be.embed(self.tok, chunk)
        positions = cp.arange(self.pos, self.pos + n, dtype=cp.int32)
        hn = cp.empty_like(x)
        _check(lb.strata_rms_norm(s, _p(x), _ffi.NULL, _p(self.layers[0]["attn_norm"].data), _p(hn), _ffi.NULL, n, E,
                                  self.eps), "rms")
        for li, L in enumerate(self.layers):
            q, k, v = self._layer_qkv(L, hn)
            q = cp.ascontiguousarray(q).reshape(n, H, hd)
            k = cp.ascontiguousarray(k).reshape(n, KV, hd)
            v = cp.ascontiguousarray(v).reshape(n, KV, hd)
            _check(lb.strata_rope(s, _p(q), _p(positions), n, H, hd, self.n_rot, self.theta, 0), "rope")
            _check(lb.strata_rope(s, _p(k), _p(positions), n, KV, hd, self.n_rot, self.theta, 0), "rope")
            _check(lb.strata_kv_write(s, _p(k), _p(v), _p(self.kc[li]), _p(self.vc[li]), _p(self.pt), _ffi.NULL,
                                      self.pos, n, KV, hd, self.PAGE), "kv_write")
            if n == 1:
                total = self.pos + 1
                ns = n_split_for(total)
                att = cp.empty((1, H, hd), cp.float32)
                _check(lb.strata_attn_decode(s, _p(q), _p(self.kc[li]), _p(self.vc[li]), _p(self.pt), _ffi.NULL, total,
                                             _p(self.partial), _p(att), H, KV, hd, self.PAGE, ns, self.scale), "attn")
            else:
                att = prefill_attention(be, q, self.kc[li], self.vc[li], self.pt, self.pos, KV, self.PAGE, self.scale)
            o = self._mm(att.reshape(n, E), L["wo"])
            _check(lb.strata_rms_norm(s, _p(o), _p(x), _p(L["ffn_norm"].data), _p(hn), _p(x), n, E, self.eps), "rms")
            d = self._mm(self._ffn(L, hn), L["down"])
            nxt = self.layers[li + 1]["attn_norm"] if li + 1 < self.n_layer else self.out_norm
            _check(lb.strata_rms_norm(s, _p(d), _p(x), _p(nxt.data), _p(hn), _p(x), n, E, self.eps), "rms")
        self.pos += n
        if not want_logits:
            return None
        return self._mm(hn if all_rows else cp.ascontiguousarray(hn[-1:]), self.output)

    # ---- graph decode
    def _decode_step_kernels(self, n_split: int) -> None:
        """Enqueue one decode step on the current stream using only preallocated buffers and device positions."""
        lb, d = lib(), self.d
        s = _stream_ptr()
        E, H, KV, hd, F = self.n_embd, self.n_head, self.n_kv, self.hd, self.n_ff
        kvd = KV * hd
        pos = d["pos"]
        pos_len = _ffi.cast("int *", pos.data.ptr + 4)
        _check(lb.strata_get_rows(s, self.tok.ggml_type, _p(self.tok.data), _p(d["tok"]), _p(d["x"]), 1, E), "rows")
        _check(lb.strata_rms_norm(s, _p(d["x"]), _ffi.NULL, _p(self.layers[0]["attn_norm"].data), _p(d["hn"]),
                                  _ffi.NULL, 1, E, self.eps), "rms")
        qkv = d["qkv"]
        q_ptr = _p(qkv)
        k_ptr = _ffi.cast("float *", qkv.data.ptr + 4 * E)
        v_ptr = _ffi.cast("float *", qkv.data.ptr + 4 * (E + kvd))
        for li, L in enumerate(self.layers):
            if "qkv" in L:
                w = L["qkv"]
                _check(lb.strata_matvec(s, w.ggml_type, _p(w.data), _p(d["hn"]), q_ptr, w.shape[0], E, 1), "mv")
            else:
                for w, off in ((L["q"], 0), (L["k"], E), (L["v"], E + kvd)):
                    _check(lb.strata_matvec(s, w.ggml_type, _p(w.data), _p(d["hn"]),
                                            _ffi.cast("float *", qkv.data.ptr + 4 * off), w.shape[0], E, 1), "mv")
            # q and k are adjacent: one launch rotates both and writes k, v into the cache
            _check(lb.strata_rope_kv_decode(s, q_ptr, _p(pos), _p(self.kc[li]), _p(self.vc[li]), _p(self.pt), H, KV,
                                            hd, self.n_rot, self.theta, 0, self.PAGE), "rope_kv")
            _check(lb.strata_attn_decode(s, q_ptr, _p(self.kc[li]), _p(self.vc[li]), _p(self.pt), pos_len, 0,
                                         _p(self.partial), _p(d["att"]), H, KV, hd, self.PAGE, n_split, self.scale),
                   "attn")
            w = L["wo"]
            _check(lb.strata_matvec(s, w.ggml_type, _p(w.data), _p(d["att"]), _p(d["o"]), E, E, 1), "mv")
            _check(lb.strata_rms_norm(s, _p(d["o"]), _p(d["x"]), _p(L["ffn_norm"].data), _p(d["hn"]), _p(d["x"]), 1, E,
                                      self.eps), "rms")
            gu = d["gu"]
            if "gu" in L:
                w = L["gu"]
                _check(lb.strata_matvec(s, w.ggml_type, _p(w.data), _p(d["hn"]), _p(gu), 2 * F, E, 1), "mv")
            else:
                for w, off in ((L["gate"], 0), (L["up"], F)):
                    _check(lb.strata_matvec(s, w.ggml_type, _p(w.data), _p(d["hn"]),
                                            _ffi.cast("float *", gu.data.ptr + 4 * off), F, E, 1), "mv")
            _check(lb.strata_swiglu(s, _p(gu), _ffi.cast("float *", gu.data.ptr + 4 * F), _p(d["act"]), F), "swiglu")
            w = L["down"]
            _check(lb.strata_matvec(s, w.ggml_type, _p(w.data), _p(d["act"]), _p(d["o"]), E, F, 1), "mv")
            nxt = self.layers[li + 1]["attn_norm"] if li + 1 < self.n_layer else self.out_norm
            _check(lb.strata_rms_norm(s, _p(d["o"]), _p(d["x"]), _p(nxt.data), _p(d["hn"]), _p(d["x"]), 1, E,
                                      self.eps), "rms")
        w = self.output
        _check(lb.strata_matvec(s, w.ggml_type, _p(w.data), _p(d["hn"]), _p(d["logits"]), self.n_vocab, E, 1), "mv")
        _check(lb.strata_argmax(s, _p(d["logits"]), _p(d["tok"]), 1, self.n_vocab), "argmax")
        _check(lb.strata_add_scalar(s, _p(pos), 1, 2), "add")

    def _split_class(self, length: int) -> int:
        c = 256
        while c < length:
            c *= 2
        return c

    def _graph_for(self, cls: int):
        g = self.graphs.get(cls)
        if g is None:
            n_split = n_split_for(cls)
            st = self.stream
            with st:
                if self.use_graphs:
                    st.begin_capture()
                    self._decode_step_kernels(n_split)
                    g = st.end_capture()
                else:
                    g = n_split
            self.graphs[cls] = g
        return g

    def decode_greedy(self, first_token: int, n: int, sync_each: bool = False) -> list[int]:
        """Feed first_token at self.pos, then greedy-decode: returns the n tokens chosen (argmax on the device)."""
        cp = self.cp
        if self.pos + n > self.max_ctx:
            raise ValueError(f"context overflow: {self.pos + n} > max_ctx {self.max_ctx}")
        out = cp.zeros(n, cp.int32)
        with self.stream:
            self.d["tok"][...] = first_token
            self.d["pos"][...] = cp.asarray([self.pos, self.pos + 1], dtype=cp.int32)
            for i in range(n):
                g = self._graph_for(self._split_class(self.pos + 1))
                if self.use_graphs:
                    g.launch(self.stream)
                else:
                    self._decode_step_kernels(g)
                out[i:i + 1] = self.d["tok"]
                self.pos += 1
            self.stream.synchronize()
        return [int(t) for t in cp.asnumpy(out)]

    def decode_logits(self) -> np.ndarray:
        """Logits of the last graph decode step (host copy)."""
        self.stream.synchronize()
        return self.cp.asnumpy(self.d["logits"][0])


CUDABackend = CudaBackend   # the name strata/engine/engine.py imports
