"""CudaBackend: the Backend ops of docs/internals.md on CuPy arrays (upload, embed, matmul, rms_norm, rope,
attention, swiglu, to_host) and its page pools, so every model's own forward runs on the GPU unchanged; the fused
per-family plans (strata/backend/cuda/plans.py) run on top of it.

Numerics: weights are dequantized exactly as llama.cpp's dequantize_row_* (f32 arithmetic); one-token matmuls take
int8 (q8_1) activations (settings.DP4A), many-token ones f16 activations and weights with f32 accumulation; the KV
cache is f16 or q8_0 (--kv).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from strata.backend.base import Backend
from strata.backend.cuda import settings
from strata.backend.cuda.attention import paged_attention
from strata.backend.cuda.gemm import Gemm
from strata.backend.cuda.library import CudaUnavailable, check, lib, ptr, stream_ptr, unavailable_reason
from strata.backend.cuda.pages import CudaPagePool
from strata.backend.cuda.settings import KV_DTYPES, rows_per_warp
from strata.backend.cuda.weights import DeviceWeight, upload_raw
from strata.memory.kv import DEFAULT_PAGE_SIZE, PagedKV, PagePool
from strata.memory.memory import host_copy


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
        self.gemm = Gemm()
        lib()
        self._kv: dict[int, tuple[Any, Any]] = {}   # layer -> (k pool, v pool) of attention_pages
        self._partial = None
        self._counters = None
        self.n_sm = int(cupy.cuda.runtime.getDeviceProperties(self.device_id)["multiProcessorCount"])
        self._rope_cache: dict[tuple, tuple[Any, Any]] = {}

    # ---- weights and tensors
    moe_tier = None             # TierSettings (strata/backend/cuda/moe_tier.py) when MoE experts live in host RAM

    def expert_home(self, name: str, gate, up, down):
        """With the expert tier on (``moe_tier``): one MoE layer's stacked expert tensors in pinned host RAM
        (moe_tier.home_experts), else None."""
        if self.moe_tier is None:
            return None
        from strata.backend.cuda.moe_tier import home_experts
        with self.device:
            return home_experts(name, gate, up, down, self.device_id)

    def upload(self, w) -> Any:
        """WeightTensor (strata.backend.quant) -> DeviceWeight (raw blocks on the device); 1-D tensors -> f32 CuPy arrays."""
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
        check(lib().strata_get_rows(stream_ptr(), w.ggml_type, ptr(w.data), ptr(d_ids), ptr(out), len(d_ids),
              w.shape[1]), "strata_get_rows")
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
        if n == 1 and settings.DP4A and lib().strata_matvec_q8_supported(w.ggml_type):
            xq = self.quantize_q8(x)
            check(lib().strata_matvec_q8w(stream_ptr(), w.ggml_type, ptr(w.data), ptr(xq), ptr(y), w.shape[0],
                                          w.shape[1], rows_per_warp(w.shape[0])), "strata_matvec_q8w")
            return y
        for s in range(0, n, 8):
            e = min(n, s + 8)
            check(lib().strata_matvec(stream_ptr(), w.ggml_type, ptr(w.data), ptr(x[s:e]), ptr(y[s:e]), w.shape[0],
                                      w.shape[1], e - s), "strata_matvec")
        return y

    def quantize_q8(self, x, out=None):
        """One f32 activation row x (1, n_in) -> int8 q8_1 blocks for strata_matvec_q8: uint8 (n_in + n_in // 4)
        = int8 values then float2 (d, d * sum q) per 32 (d = max|x| / 127, round to nearest even)."""
        n_in = int(x.shape[-1])
        xq = out if out is not None else self.cp.empty(n_in + n_in // 4, self.cp.uint8)
        check(lib().strata_quantize_q8_1(stream_ptr(), ptr(x), ptr(xq), n_in), "strata_quantize_q8_1")
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
        check(lib().strata_rms_norm(stream_ptr(), ptr(x2), ptr(residual), ptr(wt), ptr(out), ptr(sum_out),
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
            check(lib().strata_rope(stream_ptr(), ptr(x), ptr(pos), n, h, hd, int(n_rot), float(theta),
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
        check(lib().strata_swiglu(stream_ptr(), ptr(gate), ptr(up), ptr(out), gate.size), "strata_swiglu")
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
        """The runner of a stage running blocks [lo, hi) of `model` (hi None: all): the first family plan
        (strata/backend/cuda/plans.py: llama, qwen35) that can run the carve, wrapped in its PlanModel (one-token
        forward through the plan's captured CUDA graph, prefill through its cuBLAS / FA2 path); else the model
        itself (its forward on these ops)."""
        from strata.backend.cuda.plans import plan_model
        return plan_model(model, lo, hi) or model

    def copy_many(self, pairs) -> None:
        """dst[...] = src for each (dst, src) of `pairs` (C-contiguous CuPy arrays of equal byte sizes on this
        device, not overlapping) in one launch (strata_copy_many) on the current stream; ValueError for a pair
        that is not."""
        if not pairs:
            return
        tab = np.empty((len(pairs), 3), np.uint64)
        for i, (d, s) in enumerate(pairs):
            if d.nbytes != s.nbytes or not (d.flags.c_contiguous and s.flags.c_contiguous):
                raise ValueError(f"copy_many: pair {i} is {d.nbytes} <- {s.nbytes} bytes (equal C-contiguous "
                                 "arrays needed)")
            tab[i] = (d.data.ptr, s.data.ptr, d.nbytes)
        buf = getattr(self, "_copy_table", None)
        if buf is None or buf.size < tab.size:
            buf = self._copy_table = self.cp.empty(max(3 * 64, tab.size), self.cp.uint64)
        stream = self.cp.cuda.get_current_stream()
        buf[:tab.size].set(tab.reshape(-1), stream=stream)
        check(lib().strata_copy_many(stream_ptr(), ptr(buf), len(pairs), int(tab[:, 2].max())), "copy_many")

    def drain(self) -> None:
        """Wait for everything queued on this backend's device (cudaDeviceSynchronize on this device, not the
        current one)."""
        with self.device:
            self.cp.cuda.Device(self.device_id).synchronize()

    def total_memory(self) -> int:
        """The device's total memory in bytes."""
        with self.device:
            return int(self.cp.cuda.runtime.memGetInfo()[1])

    def free_memory(self) -> int:
        """Bytes still free on the device: cudaMemGetInfo's free plus what CuPy's pool holds unused."""
        with self.device:
            mp = self.cp.get_default_memory_pool()
            return int(self.cp.cuda.runtime.memGetInfo()[0]) + int(mp.total_bytes() - mp.used_bytes())

    def memory_info(self) -> dict[str, int]:
        """Device memory in bytes: total, free (cudaMemGetInfo) and held by CuPy's pool (used / total)."""
        free, total = self.cp.cuda.runtime.memGetInfo()
        mp = self.cp.get_default_memory_pool()
        return {"device_total_bytes": int(total), "device_free_bytes": int(free),
                "pool_used_bytes": int(mp.used_bytes()), "pool_total_bytes": int(mp.total_bytes())}

    def attention(self, q, k, v, kv: PagedKV, layer: int, scale: float):
        """See Backend.attention. On a CudaPagePool: k/v written into the sequence's pages (f16: strata_kv_write;
        q8_0: strata_kv_write_q8), then the split-K decode kernel (n == 1) or prefill_attention (n > 1) through the
        pool's device page table. On a float32 PagePool (generic path): PagePool.write, PagePool.read, S = Q K^T
        per KV head (cuBLAS, f32), causal softmax (strata_causal_softmax), O = P V. Queries are chunked so S stays under
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
        s = stream_ptr()
        for i0 in range(0, n, chunk):
            i1 = min(n, i0 + chunk)
            c = i1 - i0
            qh = cp.ascontiguousarray(q[i0:i1].transpose(1, 0, 2)).reshape(n_kv, g * c, hd)   # row = gi*c + i
            lk = start + i1
            S = cp.ascontiguousarray(cp.matmul(qh, Kt[:, :, :lk]))                            # (n_kv, g*c, lk)
            check(lib().strata_causal_softmax(s, ptr(S), n_kv * g * c, c, lk, start + i0, float(scale)),
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
