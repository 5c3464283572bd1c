"""The CPU backend: numpy + the C core (through WeightTensor) for RMSNorm, RoPE, paged GQA attention, SwiGLU, matmul."""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from strata.backend.base import Array, Backend
from strata.memory.kv import DEFAULT_PAGE_SIZE, PagedKV, PagePool
from strata.backend import quant
from strata.backend.quant import WeightTensor

# numpy attention path (no C core / no AVX2): bytes of attention scores one query chunk may hold; bounds
# prefill memory at long contexts.
ATTN_SCORE_BYTES = 32 * 1024 * 1024
# Decode attention uses BLAS up to this many keys, einsum beyond (see CPUBackend.attention).
DECODE_BLAS_MAX_KEYS = 4096


_MASKS: dict[int, np.ndarray] = {}

#: Attention through the C core (native/cpu/attention.c) when it is built and the CPU has AVX2+FMA;
#: the numpy path below otherwise (STRATA_NUMPY_ATTENTION=1 forces numpy).
_NATIVE_OPS = quant._lib is not None and bool(quant._lib.strata_cpu_has_avx2())
_NATIVE_ATTENTION = (quant._lib is not None and bool(quant._lib.strata_cpu_has_avx2())
                     and os.environ.get("STRATA_NUMPY_ATTENTION", "") in ("", "0"))


def _causal_mask(c: int) -> np.ndarray:
    """(c, c) float32: 0 where key <= query, -inf above the diagonal."""
    m = _MASKS.get(c)
    if m is None:
        m = np.triu(np.full((c, c), -np.inf, dtype=np.float32), k=1)
        if len(_MASKS) < 64:
            _MASKS[c] = m
    return m


_NULL = quant._ffi.NULL if quant._ffi is not None else None


def _fp(a: np.ndarray):
    """cffi float* to the first element of a (any strides; the caller keeps a alive)."""
    if a.flags.c_contiguous:
        return quant._ffi.from_buffer("float[]", a)
    return quant._ffi.cast("float *", a.ctypes.data)


class CPUBackend(Backend):
    """numpy arrays on the host; quantized matmul and embedding rows run on packed blocks in the C core."""

    name = "cpu"
    xp = np

    def __init__(self, threads: int | None = None):
        if threads is not None:
            from strata.backend import quant
            quant.set_threads(threads)
        self._rope_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    # --- weights ----------------------------------------------------------------------------------
    def upload(self, w: WeightTensor) -> Any:
        """Matrices stay the (memory-mapped) WeightTensor; 1-D tensors become float32 arrays."""
        if len(w.shape) == 1:
            return np.ascontiguousarray(w.dequantize(), dtype=np.float32)
        return w

    def embed(self, w: WeightTensor, ids: np.ndarray) -> np.ndarray:
        return w.rows(np.asarray(ids, dtype=np.int64))

    def matmul(self, x: np.ndarray, w: WeightTensor) -> np.ndarray:
        return w.matmul(np.ascontiguousarray(x, dtype=np.float32))

    # --- elementwise --------------------------------------------------------------------------------
    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float, residual: np.ndarray | None = None) -> np.ndarray:
        if (_NATIVE_OPS and x.dtype == np.float32 and x.ndim >= 1 and x.flags.c_contiguous
                and isinstance(weight, np.ndarray) and weight.dtype == np.float32 and weight.shape == x.shape[-1:]
                and weight.flags.c_contiguous
                and (residual is None or (residual.dtype == np.float32 and residual.shape == x.shape
                                          and residual.flags.c_contiguous))):
            out = np.empty_like(x)
            dim = x.shape[-1]
            rc = quant._lib.strata_rms_norm(_fp(x), _fp(residual) if residual is not None else _NULL, _fp(weight),
                                            x.size // dim, dim, float(eps), _fp(out), _NULL)
            if rc == 0:
                return out
        if residual is not None:
            x = x + residual
        ms = np.einsum("...i,...i->...", x, x, dtype=np.float32) / np.float32(x.shape[-1])
        scale = 1.0 / np.sqrt(ms + np.float32(eps), dtype=np.float32)
        return (x * scale[..., None]) * weight

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if (_NATIVE_OPS and gate.ndim == 2 and gate.shape == up.shape and gate.dtype == np.float32
                and up.dtype == np.float32 and gate.strides == up.strides and gate.strides[1] == 4
                and gate.strides[0] % 4 == 0 and gate.shape[0] > 0):
            n, ff = gate.shape
            out = np.empty((n, ff), dtype=np.float32)
            if quant._lib.strata_swiglu(_fp(gate), _fp(up), n, ff, gate.strides[0] // 4, _fp(out)) == 0:
                return out
        with np.errstate(over="ignore"):
            return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def to_host(self, x: Array) -> np.ndarray:
        """x as a numpy array; a device array (a GPU stage's hidden states before a CPU stage) copied to the host."""
        if not isinstance(x, np.ndarray) and hasattr(x, "get"):
            return x.get()
        return np.asarray(x)

    # --- RoPE --------------------------------------------------------------------------------------
    def _rope_table(self, n_pos: int, n_rot: int, theta: float, freq_factors, freq_scale: float):
        key = (n_rot, float(theta), float(freq_scale), None if freq_factors is None else id(freq_factors))
        cached = self._rope_cache.get(key)
        if cached is not None and cached[0].shape[0] >= n_pos:
            return cached
        n = max(n_pos, 2 * cached[0].shape[0] if cached is not None else 4096)
        inv = float(theta) ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        if freq_factors is not None:
            inv = inv / np.asarray(freq_factors, dtype=np.float64)[: n_rot // 2]
        ang = np.arange(n, dtype=np.float64)[:, None] * (freq_scale * inv)[None, :]
        table = (np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32))
        self._rope_cache[key] = table
        return table

    def rope(self, x: np.ndarray, positions: np.ndarray, n_rot: int, theta: float, neox: bool,
             freq_factors: Any | None = None, freq_scale: float = 1.0) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and positions.min() < 0:
            raise ValueError("RoPE positions must be >= 0")
        cos_t, sin_t = self._rope_table(int(positions.max()) + 1 if positions.size else 1, n_rot, theta,
                                        freq_factors, freq_scale)
        if (_NATIVE_OPS and x.ndim == 3 and x.dtype == np.float32 and x.strides[2] == 4
                and x.strides[1] == 4 * x.shape[2] and x.strides[0] % 4 == 0 and x.shape[0] == positions.shape[0]
                and n_rot % 2 == 0 and 0 < n_rot <= x.shape[2]):
            n, nh, hd = x.shape
            out = np.empty((n, nh, hd), dtype=np.float32)
            positions = np.ascontiguousarray(positions)
            rc = quant._lib.strata_rope(_fp(x), x.strides[0] // 4, n, nh, hd, n_rot,
                                        quant._ffi.cast("int64_t *", positions.ctypes.data), _fp(cos_t),
                                        _fp(sin_t), cos_t.shape[0], int(bool(neox)), _fp(out))
            if rc == 0:
                return out
        cos = cos_t[positions][:, None, :]  # (n, 1, n_rot/2)
        sin = sin_t[positions][:, None, :]
        out = np.array(x, dtype=np.float32, copy=True)
        if neox:
            h = n_rot // 2
            x0 = x[..., :h]
            x1 = x[..., h:n_rot]
            out[..., :h] = x0 * cos - x1 * sin
            out[..., h:n_rot] = x0 * sin + x1 * cos
        else:
            x0 = x[..., 0:n_rot:2]
            x1 = x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = x0 * cos - x1 * sin
            out[..., 1:n_rot:2] = x0 * sin + x1 * cos
        return out

    # --- attention ---------------------------------------------------------------------------------
    def new_page_pool(self, layers: Sequence[int], n_pages: int, n_kv_head: int, head_dim: int,
                      page_size: int = DEFAULT_PAGE_SIZE, head_dim_v: int | None = None) -> PagePool:
        hv = head_dim_v or head_dim
        k = [np.zeros((n_kv_head, n_pages, page_size, head_dim), dtype=np.float32) for _ in layers]
        v = [np.zeros((n_kv_head, n_pages, page_size, hv), dtype=np.float32) for _ in layers]
        return PagePool(layers, n_pages, page_size, n_kv_head, head_dim, k, v, to_host=np.asarray, head_dim_v=hv)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, kv: PagedKV, layer: int,
                  scale: float) -> np.ndarray:
        """Causal GQA attention over the paged KV (see Backend.attention), float32. With the C core and AVX2:
        native/cpu/attention.c (FlashAttention-style online softmax per KV page, the GQA group's queries together;
        decode splits pages over threads, prefill splits KV heads x query blocks; bit-identical for any thread
        count and any way the tokens are split into calls). Otherwise numpy: queries in chunks so a chunk's
        scores stay under ATTN_SCORE_BYTES."""
        n, n_head, hd, g, slot, start = self.attention_geometry(q, k, kv, layer)
        n_kv = n_head // g
        pool = kv.pool
        Kp, Vp = pool.k[slot], pool.v[slot]
        lib = quant._lib
        if (_NATIVE_ATTENTION and hd % 8 == 0 and Vp.shape[-1] % 8 == 0 and g <= 48
                and isinstance(Kp, np.ndarray) and Kp.dtype == np.float32 and Vp.dtype == np.float32
                and Kp.flags.c_contiguous and Vp.flags.c_contiguous):
            return self._attention_native(lib, q, k, v, n, n_head, n_kv, hd, Kp, Vp, pool, kv, start, scale)
        pool.write(slot, kv.pages, start, k, v)
        K, V = kv.read(slot, start + n)  # (n_kv, L, hd)
        hv = V.shape[-1]
        # (n, n_kv, g, hd) -> (n_kv, n*g, hd): row r is token r // g, group r % g
        qg = (q.reshape(n, n_kv, g, hd).transpose(1, 0, 2, 3) * np.float32(scale)).reshape(n_kv, n * g, hd)
        out = np.empty((n_kv, n * g, hv), dtype=np.float32)
        L = start + n
        chunk = max(1, min(n, ATTN_SCORE_BYTES // max(1, n_head * L * 4)))
        for i0 in range(0, n, chunk):
            i1 = min(n, i0 + chunk)
            c = i1 - i0
            lk = start + i1  # keys visible to the last query of the chunk
            # per KV head, 2-D products so numpy hands each to BLAS gemm (stacked matmul over strided page
            # views falls back to a slow loop)
            # decode (few query rows): BLAS in the K @ q.T shape while OpenBLAS keeps it on one thread; past
            # that, einsum's single-threaded loops (OpenBLAS's threads stall on oversubscribed cores: measured
            # 30-400 ms instead of 2 ms per call at 8K keys). Prefill: one gemm per KV head.
            few = c * g <= 32
            if few and lk <= DECODE_BLAS_MAX_KEYS:
                s = np.empty((n_kv, c * g, lk), dtype=np.float32)
                for h in range(n_kv):
                    s[h] = (K[h, :lk] @ np.ascontiguousarray(qg[h, i0 * g:i1 * g].T)).T
            elif few:
                s = np.einsum("hrd,hld->hrl", qg[:, i0 * g:i1 * g], K[:, :lk])
            else:
                s = np.empty((n_kv, c * g, lk), dtype=np.float32)
                for h in range(n_kv):
                    np.matmul(qg[h, i0 * g:i1 * g], K[h, :lk].T, out=s[h])
            if c > 1:
                # causal mask on the block of the chunk's own keys: query i sees keys <= start + i
                blk = s[:, :, start + i0:lk].reshape(n_kv, c, g, c)
                blk += _causal_mask(c)[:, None, :]
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            denom = s.sum(axis=-1, keepdims=True)
            if few and lk > DECODE_BLAS_MAX_KEYS:
                out[:, i0 * g:i1 * g] = np.einsum("hrl,hld->hrd", s, V[:, :lk])
            else:
                for h in range(n_kv):
                    np.matmul(s[h], V[h, :lk], out=out[h, i0 * g:i1 * g])
            out[:, i0 * g:i1 * g] /= denom
        return out.reshape(n_kv, n, g, hv).transpose(1, 0, 2, 3).reshape(n, n_head, hv)

    def _attention_native(self, lib, q, k, v, n, n_head, n_kv, hd, Kp, Vp, pool, kv, start, scale) -> np.ndarray:
        """C core attention (stores k/v in the pages, then one pass per KV head over the sequence's pages,
        FlashAttention-style online softmax merged in page order; deterministic for any thread count).
        Returns (n, n_head, hv) float32."""
        ffi = quant._ffi
        hv = Vp.shape[-1]
        q = np.ascontiguousarray(q, dtype=np.float32)
        k, v = _rows(k, n_kv, hd), _rows(v, n_kv, hv)
        pages = np.asarray(kv.pages, dtype=np.int32)
        out = np.empty((n, n_head, hv), dtype=np.float32)
        rc = lib.strata_attention(ffi.from_buffer("float[]", q), n, n_head, n_kv, hd, hv,
                                  ffi.from_buffer("float[]", Kp), ffi.from_buffer("float[]", Vp), pool.n_pages,
                                  pool.page_size, ffi.from_buffer("int32_t[]", pages), len(pages), start,
                                  float(scale), _fp(k), k.strides[0] // 4, _fp(v), v.strides[0] // 4,
                                  ffi.from_buffer("float[]", out), quant.get_threads())
        if rc != 0:
            raise ValueError(f"attention: C core error {rc} (n={n}, heads={n_head}/{n_kv}, head_dim={hd}/{hv})")
        return out


def _rows(a: np.ndarray, heads: int, d: int) -> np.ndarray:
    """a (n, heads, d) float32 whose heads are contiguous within a token (tokens any whole-float stride); a
    contiguous copy otherwise."""
    if (a.dtype == np.float32 and a.ndim == 3 and a.strides[2] == 4 and a.strides[1] == 4 * d
            and a.strides[0] % 4 == 0 and a.strides[0] >= 4 * heads * d):
        return a
    return np.ascontiguousarray(a, dtype=np.float32).reshape(a.shape[0], heads, d)
