"""The CPU backend: numpy + the C core (through WeightTensor) for RMSNorm, RoPE, paged GQA attention, SwiGLU, matmul."""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from strata.backend.base import Array, Backend
from strata.kv_cache import DEFAULT_PAGE_SIZE, PagedKV, PagePool
from strata import quant
from strata.quant import WeightTensor

# Bytes of attention scores one query chunk may hold; bounds prefill memory at long contexts.
ATTN_SCORE_BYTES = 32 * 1024 * 1024
# Decode attention uses BLAS up to this many keys, einsum beyond (see CPUBackend.attention).
DECODE_BLAS_MAX_KEYS = 4096


_MASKS: dict[int, np.ndarray] = {}

#: Attention through the C core (native/cpu/attention.c) when it is built and the CPU has AVX2+FMA;
#: the numpy path below otherwise (STRATA_NUMPY_ATTENTION=1 forces numpy).
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


class CPUBackend(Backend):
    """numpy arrays on the host; quantized matmul and embedding rows run on packed blocks in the C core."""

    name = "cpu"
    xp = np

    def __init__(self, threads: int | None = None):
        if threads is not None:
            from strata import quant
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
        if residual is not None:
            x = x + residual
        ms = np.einsum("...i,...i->...", x, x, dtype=np.float32) / np.float32(x.shape[-1])
        scale = 1.0 / np.sqrt(ms + np.float32(eps), dtype=np.float32)
        return (x * scale[..., None]) * weight

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def to_host(self, x: Array) -> np.ndarray:
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
        """Causal GQA attention over the paged KV (see Backend.attention). Scores and softmax in float32;
        queries are processed in chunks so a chunk's scores stay under ATTN_SCORE_BYTES."""
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
        Kp, Vp = pool.k[slot], pool.v[slot]
        lib = quant._lib
        if (lib is not None and _NATIVE_ATTENTION and hd % 8 == 0 and Vp.shape[-1] % 8 == 0 and g <= 48
                and isinstance(Kp, np.ndarray) and Kp.dtype == np.float32 and Vp.dtype == np.float32
                and Kp.flags.c_contiguous and Vp.flags.c_contiguous):
            return self._attention_native(lib, q, n, n_head, n_kv, hd, Kp, Vp, pool, kv, start, scale)
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

    def _attention_native(self, lib, q, n, n_head, n_kv, hd, Kp, Vp, pool, kv, start, scale) -> np.ndarray:
        """C core attention (one pass per KV head over the sequence's pages, FlashAttention-style online
        softmax merged in page order; deterministic for any thread count). Returns (n, n_head, hv) float32."""
        ffi = quant._ffi
        hv = Vp.shape[-1]
        q = np.ascontiguousarray(q, dtype=np.float32)
        pages = np.asarray(kv.pages, dtype=np.int32)
        out = np.empty((n, n_head, hv), dtype=np.float32)
        rc = lib.strata_attention(ffi.from_buffer("float[]", q), n, n_head, n_kv, hd, hv,
                                  ffi.from_buffer("float[]", Kp), ffi.from_buffer("float[]", Vp), pool.n_pages,
                                  pool.page_size, ffi.from_buffer("int32_t[]", pages), len(pages), start,
                                  float(scale), ffi.from_buffer("float[]", out), quant.get_threads())
        if rc != 0:
            raise ValueError(f"attention: C core error {rc} (n={n}, heads={n_head}/{n_kv}, head_dim={hd}/{hv})")
        return out
