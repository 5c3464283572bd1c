"""Matrix products of many tokens: cuBLAS GemmEx on f16 operands (weights dequantized per call into one scratch)
with f32 accumulation, and the grow-only device buffers a plan's prefill reuses across ubatches."""
from __future__ import annotations

from typing import Any

import numpy as np

from strata.backend.cuda.library import check, lib, ptr, stream_ptr
from strata.backend.cuda.weights import DeviceWeight

_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


class Gemm:
    """y[:, col:col + n_out] f32 (+)= a f16 (n, n_in) @ W.T through cuBLAS GemmEx (f32 accumulate), W a GGUF-block
    DeviceWeight dequantized to f16 into a scratch shared by every call (grown to the largest weight; valid until
    the next call). Runs on CuPy's current stream."""

    def __init__(self):
        import cupy
        self.cp = cupy
        self._w16 = None

    def weight16(self, w: DeviceWeight) -> Any:
        """W as f16 (n_out * n_in values) in the shared scratch, dequantized now."""
        n = w.shape[0] * w.shape[1]
        if self._w16 is None or self._w16.size < n:
            self._w16 = self.cp.empty(n, self.cp.float16)
        check(lib().strata_dequant(stream_ptr(), w.ggml_type, ptr(w.data), ptr(self._w16), w.shape[0], w.shape[1], 1),
              "strata_dequant")
        return self._w16

    def run(self, a16, w: DeviceWeight, y, accumulate: bool = False, col: int = 0) -> None:
        """y[:, col:col + n_out] = (or += with accumulate: beta = 1, the residual add) a16 @ W.T. y: C-contiguous f32
        (n, width >= col + n_out); a16: C-contiguous f16 (n, n_in)."""
        from cupy_backends.cuda.libs import cublas
        cp = self.cp
        n, k = a16.shape
        m = w.shape[0]
        w16 = self.weight16(w)
        h = cp.cuda.device.get_cublas_handle()
        cublas.setStream(h, cp.cuda.get_current_stream().ptr)
        beta = _ONE if accumulate else _ZERO
        # column-major: Y^T (m x n) = W16 (stored k x m, transposed) * A^T (k x n)
        cublas.gemmEx(h, 1, 0, m, n, k, _ONE.ctypes.data, w16.data.ptr, 2, k, a16.data.ptr, 2, k,
                      beta.ctypes.data, y.data.ptr + 4 * col, 0, y.shape[1], 68, -1)

    def __call__(self, x, w: DeviceWeight, out=None):
        """x f32 (n, n_in) @ W.T -> f32 (n, n_out) (into `out` when given)."""
        y = out if out is not None else self.cp.empty((x.shape[0], w.shape[0]), self.cp.float32)
        self.run(x.astype(self.cp.float16), w, y)
        return y


class PrefillScratch:
    """What a plan's prefill needs besides the model: device buffers grown to the largest ubatch seen (never shrunk)
    and its own Gemm (the f16 weight scratch)."""

    def __init__(self):
        import cupy
        self.cp = cupy
        self._bufs: dict[str, Any] = {}
        self.gemm = Gemm().run

    def buf(self, name: str, shape: tuple[int, ...], dtype) -> Any:
        """The buffer `name` viewed as exactly `shape` (C-contiguous; contents undefined)."""
        n = int(np.prod(shape))
        b = self._bufs.get(name)
        if b is None or b.size < n or b.dtype != np.dtype(dtype):
            b = self._bufs[name] = self.cp.empty(n, dtype)
        return b[:n].reshape(shape)
