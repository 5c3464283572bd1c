"""Weights on the device: GGUF blocks (or f32 vectors) in CuPy memory, their upload, and the fused row stacks the
plans launch over (fused Q|K|V, gate|up, and the pointers of the fused SwiGLU matvec)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from strata.backend.cuda.library import lib
from strata.backend.quant import IQ_TYPES, WeightTensor

# GGML type ids handled by the quantized kernels (ggml.h numbering) and their (values, bytes) per block.
SUPPORTED_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}


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


def row_bytes(t: int, n_in: int) -> int:
    """Bytes of one row of n_in values of GGML type t; ValueError unless n_in is whole blocks."""
    qk, bs = BLOCK[t]
    if n_in % qk:
        raise ValueError(f"row length {n_in} is not a multiple of the block size {qk} of GGML type {t}")
    return n_in // qk * bs


def host_storage(name: str, ggml_type: int, shape: tuple[int, ...], data: np.ndarray) -> tuple[int, np.ndarray]:
    """(GGML type, storage) a tensor takes on the device: the GGUF's own blocks, except the IQ types (no CUDA kernel
    reads their grids), which are dequantized on the host by the C core (gguf-py's values) and rounded to F16, the
    type the F16 matvec and GEMM paths read (2 bytes a value: 3.8x an IQ4_XS tensor, 7.8x an IQ2_XXS one).
    ValueError (one line) when a value is past f16's range."""
    t = int(ggml_type)
    if t not in {int(q) for q in IQ_TYPES}:
        return t, data
    q = GGMLQuantizationType(t)
    h = WeightTensor(name, q, tuple(shape), data).dequantize().astype(np.float16)
    if not np.isfinite(h).all():
        raise ValueError(f"{name}: {q.name} values exceed f16's range, so the CUDA backend cannot hold them as F16 "
                         "(use --device cpu)")
    return int(GGMLQuantizationType.F16), h


def upload_raw(name: str, ggml_type: int, shape: tuple[int, ...], data: np.ndarray) -> DeviceWeight:
    """Copy a GGUF tensor's storage to the device (an IQ type as F16: host_storage). 1-D tensors (norm weights)
    become f32 vectors."""
    import cupy
    t = int(ggml_type)
    if len(shape) > 1:
        t, data = host_storage(name, t, shape, data)
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
    rb = row_bytes(t, int(shape[-1]))
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


def fuse_groups(name: str, parts: list, concat: Callable | None = None) -> list[tuple[Any, int, int]]:
    """One matvec per run of consecutive weights of one GGML type and width: [(weight, row offset, n_out)].

    parts: DeviceWeight-like objects (ggml_type, shape (n_out, n_in)) whose outputs lie back to back in one buffer;
    runs of two or more are stacked along n_out by ``concat(name, run)`` (default ``concat_weights``, a new
    device copy: the model's tensors are left untouched), single weights are used as they are."""
    concat = concat or concat_weights
    out: list[tuple[Any, int, int]] = []
    off, i = 0, 0
    while i < len(parts):
        j = i + 1
        while j < len(parts) and parts[j].ggml_type == parts[i].ggml_type and parts[j].shape[1] == parts[i].shape[1]:
            j += 1
        w = parts[i] if j == i + 1 else concat(f"{name}[{i}:{j}]", parts[i:j])
        out.append((w, off, int(w.shape[0])))
        off += int(w.shape[0])
        i = j
    return out


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
        up = base + n_ff * row_bytes(w.ggml_type, n_embd)
        return (w.ggml_type, base, up) if up % 16 == 0 else None   # the kernel reads 16-byte words
    if len(parts) == 2 and parts[0].ggml_type == parts[1].ggml_type and \
            all(w.shape[0] == n_ff for w in parts) and lb.strata_matvec_q8_supported(parts[0].ggml_type):
        return parts[0].ggml_type, int(parts[0].data.data.ptr), int(parts[1].data.data.ptr)
    return None
