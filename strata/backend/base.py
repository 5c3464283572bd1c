"""The Backend interface: the ops a model file calls, so one model file runs on the CPU (numpy) or CUDA (CuPy)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

from strata.memory.kv import DEFAULT_PAGE_SIZE, PagedKV, PagePool
from strata.backend.quant import WeightTensor

Array = Any  # numpy.ndarray on CPU, cupy.ndarray on GPU


class Backend(ABC):
    """Ops on the backend's arrays; activations are float32 (n_tokens, dim). See docs/internals.md.

    Besides the ops, model files may use the array methods numpy and CuPy share (reshape, transpose, slicing,
    ``+``, ``*``).
    """

    name: str = "?"
    xp: Any = np  # the array module: numpy on CPU, cupy on GPU

    @abstractmethod
    def upload(self, w: WeightTensor) -> Any:
        """A weight in the backend's layout. Matrices go to ``matmul``/``embed``; 1-D tensors (norm weights,
        biases) come back as float32 arrays usable in arithmetic."""

    @abstractmethod
    def embed(self, w: Any, ids: np.ndarray) -> Array:
        """Rows `ids` (int, (n_tokens,)) of an uploaded embedding matrix: float32 (n_tokens, n_embd)."""

    @abstractmethod
    def matmul(self, x: Array, w: Any) -> Array:
        """x (n_tokens, n_in) float32 @ W.T -> (n_tokens, n_out) float32."""

    @abstractmethod
    def rms_norm(self, x: Array, weight: Array, eps: float, residual: Array | None = None) -> Array:
        """RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2, -1) + eps) * weight, over the last axis.
        With `residual`, the normalised input is x + residual."""

    @abstractmethod
    def rope(self, x: Array, positions: np.ndarray, n_rot: int, theta: float, neox: bool,
             freq_factors: Array | None = None, freq_scale: float = 1.0) -> Array:
        """Rotary position embedding (Su et al. 2021, RoFormer) on x (n_tokens, n_heads, head_dim), first n_rot
        dims; angle of pair i at position p: p * freq_scale * theta^(-2i/n_rot) / freq_factors[i].
        neox=True pairs (i, i + n_rot/2), neox=False pairs (2i, 2i+1) (llama.cpp ROPE_TYPE_NEOX / NORM)."""

    @abstractmethod
    def attention(self, q: Array, k: Array, v: Array, kv: PagedKV, layer: int, scale: float) -> Array:
        """Write k/v (n, n_kv_head, hd) of the new tokens at kv.length.. into the pages of model layer `layer`,
        then causal GQA attention of q (n, n_head, hd) over [0, kv.length + n); returns (n, n_head, hd_v).
        Query head h uses KV head h // (n_head // n_kv_head). The caller reserves pages before and commits after."""

    @abstractmethod
    def swiglu(self, gate: Array, up: Array) -> Array:
        """silu(gate) * up (Shazeer 2020, GLU variants)."""

    @abstractmethod
    def to_host(self, x: Array) -> np.ndarray:
        """x as a numpy array."""

    @abstractmethod
    def new_page_pool(self, layers: Sequence[int], n_pages: int, n_kv_head: int, head_dim: int,
                      page_size: int = DEFAULT_PAGE_SIZE, head_dim_v: int | None = None) -> PagePool:
        """A PagePool with zeroed float32 K/V storage for the attention layers `layers`."""

    @staticmethod
    def attention_geometry(q: Array, k: Array, kv: PagedKV, layer: int) -> tuple[int, int, int, int, int, int]:
        """Checks shared by every backend's attention: -> (n, n_head, hd, group, slot, start).

        group = n_head // n_kv_head (GQA), slot = the pool's storage index of model layer `layer`, start = kv.length.
        Raises ValueError when n_head is not a multiple of n_kv_head or the new tokens pass the reserved pages."""
        n, n_head, hd = q.shape
        n_kv = k.shape[1]
        if n_head % n_kv:
            raise ValueError(f"n_head {n_head} is not a multiple of n_kv_head {n_kv}")
        start = kv.length
        if start + n > kv.capacity:
            raise ValueError(f"attention at [{start}, {start + n}) past the reserved pages ({kv.capacity})")
        return n, n_head, hd, n_head // n_kv, kv.pool.slot(layer), start

    def drain(self) -> None:
        """Wait until every operation queued on this backend's own device is done (a stage's state is read or
        written only after its own device drained). Nothing to wait for on the CPU."""

    def total_memory(self) -> int:
        """Total memory of this backend's device in bytes (not free memory: a carve chosen from it must be the same
        after a restart). The CPU: physical RAM."""
        import os
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def free_memory(self) -> int | None:
        """Bytes this backend's device could still allocate (None: unknown). The CPU: MemAvailable."""
        from strata.memory.hostram import available_ram
        return available_ram()

    def softmax(self, x: Array) -> Array:
        """Softmax over the last axis (float32), with the backend's array module ``self.xp``."""
        e = self.xp.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
