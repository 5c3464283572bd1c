"""Launchers of the Gated DeltaNet CUDA kernels (native/cuda/gdn.cu) on CuPy arrays, on CuPy's current stream.

Semantics are those of strata/backend/gdn.py: ``recurrent`` = ``gdn.delta_rule_recurrent``, ``conv`` =
``gdn.causal_conv1d`` (state arrays updated in place).
"""
from __future__ import annotations

from strata.backend.cuda.library import check, lib, ptr, stream_ptr

# strata_gdn_recurrent_ex variants: choose (the warp kernel for prefill when the shape allows it), the block kernel,
# the warp kernel with 4 / 2 / 1 value columns per warp
VARIANTS = {"auto": 0, "block": 1, "warp": 2, "warp2": 3, "warp1": 4}


def _f32c(a, name: str, shape: tuple[int, ...]):
    """a as a C-contiguous float32 CuPy array of `shape` (copying only when needed); ValueError otherwise."""
    import cupy
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    return cupy.ascontiguousarray(a, dtype=cupy.float32)


def _state(a, name: str, shape: tuple[int, ...]):
    import cupy
    if not isinstance(a, cupy.ndarray) or a.dtype != cupy.float32 or not a.flags.c_contiguous \
            or tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: needs a C-contiguous float32 CuPy array of shape {tuple(shape)} (updated in "
                         f"place), got {type(a).__name__} {getattr(a, 'dtype', None)} {tuple(a.shape)}")
    return a


def recurrent(q, k, v, g, beta, state, tiled: bool = True, variant: str = "auto"):
    """Gated delta rule token by token on the device (``gdn.delta_rule_recurrent``), state updated in place.

    q, k: float32 CuPy (n, n_qk, d_k), L2-normalised, unscaled (the kernel scales q by 1/sqrt(d_k)); value head h
    reads key head h % n_qk (tiled) or h // (n_v / n_qk); with n_qk == n_v both are the identity. v: (n, n_v, d_v);
    g, beta: (n, n_v); state: C-contiguous float32 (n_v, d_k, d_v). variant (``VARIANTS``): "auto" (for n > 1
    the warp kernel with the columns per warp measured fastest for d_k: 1 for 64, 2 for 32 and 128, 4 for 256, when
    d_v is a multiple of them; else the block kernel), "block", or "warp" / "warp2" / "warp1" (4 / 2 / 1 value
    columns per warp; tests and benchmarks);
    arrays not 16-byte aligned take the block kernel. Returns (out float32 (n, n_v, d_v), state). Raises ValueError
    for shapes that disagree, an unknown variant or a warp variant on misaligned arrays (nothing changed), and
    RuntimeError for a CUDA error (a warp variant the shape does not allow included).
    """
    if variant not in VARIANTS:
        raise ValueError(f"gdn recurrent: variant {variant!r} is not one of {', '.join(VARIANTS)}")
    import cupy
    n, n_qk, dk = (int(s) for s in q.shape)
    n_v, dv = int(v.shape[1]), int(v.shape[2])
    if n_v % n_qk or dk > 256:
        raise ValueError(f"gdn recurrent: {n_v} value heads over {n_qk} key heads, d_k {dk} (needs a multiple, "
                         f"d_k <= 256)")
    q = _f32c(q, "q", (n, n_qk, dk))
    k = _f32c(k, "k", (n, n_qk, dk))
    v = _f32c(v, "v", (n, n_v, dv))
    g = _f32c(g, "g", (n, n_v))
    beta = _f32c(beta, "beta", (n, n_v))
    state = _state(state, "state", (n_v, dk, dv))
    out = cupy.empty((n, n_v, dv), cupy.float32)
    if any(a.data.ptr % 16 for a in (q, k, v, state)):     # the warp kernel's vector loads need 16-byte alignment
        if variant not in ("auto", "block"):
            raise ValueError(f"gdn recurrent: the {variant!r} kernel needs 16-byte aligned q, k, v and state")
        variant = "block"
    lb = lib()
    check(lb.strata_gdn_recurrent_ex(stream_ptr(), ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta), ptr(state), ptr(out), n,
                                     n_v, n_qk, dk, dv, int(bool(tiled)), float(1.0 / dk ** 0.5), VARIANTS[variant]),
           "strata_gdn_recurrent")
    return out, state


def conv(x, weight, window):
    """Causal depthwise conv + SiLU with the window as state (``gdn.causal_conv1d``), window updated in place.

    x float32 CuPy (n, channels) (rows may lie apart: a column slice of a wider projection is read in place);
    weight (channels, kernel), kernel 2..8; window C-contiguous float32 (kernel - 1, channels). Returns (y float32
    (n, channels) C-contiguous, window).
    """
    import cupy
    n, c = (int(s) for s in x.shape)
    kk = int(weight.shape[1])
    if not 2 <= kk <= 8:
        raise ValueError(f"gdn conv: kernel width {kk} outside [2, 8]")
    rows_ok = isinstance(x, cupy.ndarray) and x.dtype == cupy.float32 and x.strides[1] == 4 and \
        x.strides[0] % 4 == 0 and x.strides[0] >= 4 * c
    x = x if rows_ok else _f32c(x, "x", (n, c))
    weight = _f32c(weight, "weight", (c, kk))
    window = _state(window, "window", (kk - 1, c))
    y = cupy.empty((n, c), cupy.float32)
    check(lib().strata_gdn_conv(stream_ptr(), ptr(x), max(c, x.strides[0] // 4), ptr(weight), ptr(window), ptr(y), n, c,
                                kk), "strata_gdn_conv")
    return y, window
