"""Launchers of the fused GDN prefill prologue / epilogue kernels (native/cuda/gdn_prefill.cu) on CuPy arrays.

``prep`` turns the causal conv output and the beta / alpha projections of n tokens into what
``cuda.gdn.recurrent`` reads (L2-normalised q, k per key head, contiguous v, g, beta); ``gated_norm`` is the output
norm RMSNorm(o) * ssm_norm * silu(z). One kernel launch each, in place of ~25 small CuPy operations per layer.
Formulas (and the reference the kernels are tested against): strata/backend/gdn.py (l2_norm, sigmoid, softplus,
gated_rms_norm) as strata/models/qwen3next.py ``_gdn`` applies them. On numpy arrays both functions run that
numpy code with the same contract (the CPU tests of the model's device control flow use it).

Kernels run on CuPy's current stream.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from strata.backend import gdn
from strata.backend.cuda.library import check, ffi, lib, ptr, stream_ptr

L2_EPS = 1e-6            # gdn.l2_norm's default eps: the model's q / k normalisation


# ------------------------------------------------------------------------------------------------ pure logic
def ba_index(n_k: int, n_v: int, grouped: bool) -> tuple[np.ndarray, np.ndarray]:
    """Columns of the beta and alpha projections that value head h reads: (b_idx, a_idx), int64 (n_v,) each.

    grouped (qwen3next ``ssm_ba``, rows per key head [beta x r, alpha x r], r = n_v / n_k): b_idx[h] =
    (h // r) * 2r + h % r, a_idx = b_idx + r (the columns of ``ba.reshape(n, n_k, 2r)[:, :, :r]`` / ``[:, :, r:]``);
    else (qwen35 ``ssm_beta`` / ``ssm_alpha``, separate arrays) both are h. The kernel computes the same indices.
    Raises ValueError unless n_v is a positive multiple of n_k.
    """
    if n_k <= 0 or n_v <= 0 or n_v % n_k:
        raise ValueError(f"gdn prep: {n_v} value heads over {n_k} key heads (needs a positive multiple)")
    h = np.arange(n_v, dtype=np.int64)
    if not grouped:
        return h, h.copy()
    r = n_v // n_k
    b = (h // r) * 2 * r + h % r
    return b, b + r


def row_stride(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int | None:
    """Elements between consecutive rows (first axis) of an array whose rows are each contiguous, or None.

    shape, strides (bytes) and itemsize as numpy / CuPy report them; each row (the trailing axes) must be
    C-contiguous and rows must not overlap (stride >= row size; any stride for a single row, which then reports the
    row size). None means the array must be copied to a contiguous one for the kernels.
    """
    if len(shape) < 2 or len(strides) != len(shape) or itemsize <= 0:
        return None
    width, expect = 1, itemsize
    for s, st in zip(reversed(shape[1:]), reversed(strides[1:])):
        if s > 1 and st != expect:
            return None
        expect *= s
        width *= s
    if shape[0] <= 1:
        return width
    s0 = strides[0]
    if s0 % itemsize or s0 < width * itemsize:
        return None
    return s0 // itemsize


def _shape(a, name: str, shape: tuple[int, ...]) -> None:
    if a is None or tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {None if a is None else tuple(a.shape)}, expected {tuple(shape)}")


def _rows(xp, a) -> tuple[Any, int]:
    """(a as float32 with contiguous rows, row stride in elements): a itself when it fits, else a contiguous copy."""
    if a.dtype == np.float32:
        s = row_stride(tuple(a.shape), tuple(a.strides), 4)
        if s is not None:
            return a, s
    a = xp.ascontiguousarray(a, dtype=np.float32)
    return a, row_stride(tuple(a.shape), tuple(a.strides), 4)


# ------------------------------------------------------------------------------------------------ launchers
def prep(y, b, a, A, dt, n_k: int, dk: int, dv: int, l2_eps: float = L2_EPS):
    """GDN prologue of n tokens: (q, k, v, g, beta) for ``cuda.gdn.recurrent``, one kernel launch.

    y: float32 (n, 2*n_k*dk + n_v*dv), the causal conv output [q | k | v] (rows may lie apart, e.g. a view of a
    wider buffer). b, a: with a None, b is the qwen3next ``ssm_ba`` projection (n, 2*n_v) (per key head
    [beta x r, alpha x r]); else b = ``ssm_beta`` and a = ``ssm_alpha`` projections, (n, n_v) each. A (``ssm_a``)
    and dt (``ssm_dt.bias``): float32 (n_v,). Returns q, k float32 (n, n_k, dk) = gdn.l2_norm(key heads, l2_eps)
    (unscaled), v float32 (n, n_v, dv) C-contiguous, g = A * gdn.softplus(alpha + dt) and beta = gdn.sigmoid(b)
    float32 (n, n_v). Raises ValueError for shapes that disagree (nothing launched), RuntimeError for a CUDA error.
    """
    if getattr(A, "ndim", 0) != 1:
        raise ValueError(f"gdn prep: A has shape {tuple(getattr(A, 'shape', ()))}, expected (n_v,)")
    n_v = int(A.shape[0])
    grouped = a is None
    b_idx, a_idx = ba_index(int(n_k), n_v, grouped)          # validates n_k, n_v
    if dk <= 0 or dv <= 0:
        raise ValueError(f"gdn prep: d_k {dk}, d_v {dv} (need positive)")
    n = int(y.shape[0]) if getattr(y, "ndim", 0) == 2 else -1
    _shape(y, "y", (n, 2 * n_k * dk + n_v * dv))
    _shape(dt, "dt", (n_v,))
    if grouped:
        _shape(b, "ba", (n, 2 * n_v))
    else:
        _shape(b, "beta projection", (n, n_v))
        _shape(a, "alpha projection", (n, n_v))
    xp = gdn.array_module(y)
    if xp is np:                                 # the array formulas, as qwen3next._gdn applies them
        kd = n_k * dk
        q = gdn.l2_norm(y[:, :kd].reshape(n, n_k, dk), l2_eps)
        k = gdn.l2_norm(y[:, kd:2 * kd].reshape(n, n_k, dk), l2_eps)
        v = xp.ascontiguousarray(y[:, 2 * kd:].reshape(n, n_v, dv), dtype=np.float32)
        beta = gdn.sigmoid(b[:, b_idx]).astype(np.float32)
        g = (A * gdn.softplus((b if grouped else a)[:, a_idx] + dt)).astype(np.float32)
        return q, k, v, g, beta
    y, ys = _rows(xp, y)
    b, bs = _rows(xp, b)
    if grouped:
        a, as_ = b, bs
    else:
        a, as_ = _rows(xp, a)
        if as_ != bs:                                         # one row stride for both: make both contiguous
            b, bs = _rows(xp, xp.ascontiguousarray(b))
            a, as_ = _rows(xp, xp.ascontiguousarray(a))
    A = xp.ascontiguousarray(A, dtype=np.float32)
    dt = xp.ascontiguousarray(dt, dtype=np.float32)
    q = xp.empty((n, n_k, dk), np.float32)
    k = xp.empty((n, n_k, dk), np.float32)
    v = xp.empty((n, n_v, dv), np.float32)
    g = xp.empty((n, n_v), np.float32)
    beta = xp.empty((n, n_v), np.float32)
    lb = lib()
    check(lb.strata_gdn_prep(stream_ptr(), ptr(y), int(ys), ptr(b), ptr(a), int(bs), 0, 0, int(grouped), ptr(A),
                             ptr(dt), ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta), n, int(n_k), n_v, int(dk), int(dv),
                             float(l2_eps)),
           "strata_gdn_prep")
    return q, k, v, g, beta


def gated_norm(o, z, w, eps: float):
    """RMSNorm(o) * w * silu(z) per head (``gdn.gated_rms_norm``), one kernel launch.

    o: float32 (n, n_h, d) (the delta-rule output); z: the gate, (n, n_h, d) or (n, n_h * d) (token rows may lie
    apart, e.g. a view of a fused projection); w: float32 (d,) (``ssm_norm``). Returns float32 (n, n_h, d),
    C-contiguous. Raises ValueError for shapes that disagree, RuntimeError for a CUDA error.
    """
    if getattr(o, "ndim", 0) != 3:
        raise ValueError(f"gated_norm: o has shape {tuple(getattr(o, 'shape', ()))}, expected (n, n_heads, d)")
    n, nh, d = (int(s) for s in o.shape)
    if z is None or tuple(z.shape) not in ((n, nh, d), (n, nh * d)):
        raise ValueError(f"gated_norm: z has shape {None if z is None else tuple(z.shape)}, expected "
                         f"{(n, nh, d)} or {(n, nh * d)}")
    _shape(w, "gated_norm weight", (d,))
    xp = gdn.array_module(o)
    if xp is np:
        return gdn.gated_rms_norm(o, w, z.reshape(n, nh, d), eps)
    o = xp.ascontiguousarray(o, dtype=np.float32)
    z, zs = _rows(xp, z)
    w = xp.ascontiguousarray(w, dtype=np.float32)
    out = xp.empty((n, nh, d), np.float32)
    lb = lib()
    check(lb.strata_gdn_gated_norm_rows(stream_ptr(), ptr(o), ptr(z), int(zs), nh, ptr(w), ptr(out), ffi().NULL,
                                        n * nh, d, float(eps)),
           "strata_gdn_gated_norm_rows")
    return out


