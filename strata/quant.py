"""GGML quantization types and WeightTensor: a GGUF tensor's packed blocks, dequantized and multiplied by the C core."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

_THREADS = max(1, os.cpu_count() or 1)


def set_threads(n: int) -> None:
    """Set the number of CPU threads the C core uses for matmul (n >= 1)."""
    global _THREADS
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _THREADS = int(n)


def get_threads() -> int:
    return _THREADS


def block_shape(t: GGMLQuantizationType) -> tuple[int, int]:
    """(elements per block, bytes per block) of GGML type t (from ggml.h / gguf.constants.GGML_QUANT_SIZES)."""
    return GGML_QUANT_SIZES[t]


@dataclass
class WeightTensor:
    """One model tensor as stored in the GGUF file.

    shape is numpy order: (n_out, n_in) for a matrix (GGUF's ``ne`` reversed). ``data`` is the raw
    storage: a uint8 array of packed blocks with shape (n_out, bytes_per_row) for quantized types, or a
    float array for F32/F16/BF16 (BF16 is stored as uint16 bits by the gguf reader).
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self) -> np.ndarray:
        """Return the tensor as float32 with shape ``self.shape``."""
        t = self.ggml_type
        if t == GGMLQuantizationType.F32:
            return np.asarray(self.data, dtype=np.float32).reshape(self.shape)
        if t == GGMLQuantizationType.F16:
            return np.asarray(self.data, dtype=np.float16).astype(np.float32).reshape(self.shape)
        return np.asarray(gguf_quants.dequantize(self.data, t), dtype=np.float32).reshape(self.shape)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantize selected rows (embedding lookup): ids int (n,) -> float32 (n, n_in)."""
        ids = np.asarray(ids, dtype=np.int64)
        sub = WeightTensor(self.name, self.ggml_type, (len(ids),) + tuple(self.shape[1:]),
                           np.ascontiguousarray(self.data.reshape(self.shape[0], -1)[ids]))
        return sub.dequantize()

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T for x float32 (n_tokens, n_in); returns float32 (n_tokens, n_out)."""
        return np.asarray(x, dtype=np.float32) @ self.dequantize().T
