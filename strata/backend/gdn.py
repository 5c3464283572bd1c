"""Gated DeltaNet ops on numpy or CuPy arrays: causal conv with its window as state, L2 norm, delta rule.

Source of the formulas: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(arXiv:2412.06464), as used by Qwen3-Next / Qwen3.5 (reference implementation: Hugging Face transformers
``modeling_qwen3_next.py``, llama.cpp ``src/models/qwen3next.cpp``).

Conventions (per value head h, all fp32):
    state S       (d_k, d_v)                 the delta-rule memory
    decay g_t     <= 0 (log space)           S <- exp(g_t) * S before the update
    beta_t        in (0, 1)                  write strength
    u_t = beta_t * (v_t - S^T k_t)           (S already decayed)
    S   <- S + k_t u_t^T
    o_t = S^T q_t                            q_t already scaled by 1/sqrt(d_k)

The chunked form (chunk length ``CHUNK`` = 64) is derived from the same recurrence: inside a chunk with
cumulative log decay G_t, the writes U solve the unit lower-triangular system (I + A) U = beta*V - diag(beta e^G) K S0
with A_ts = beta_t e^(G_t - G_s) k_t.k_s for s < t (the UT/WY form of the paper, section 3).
"""
from __future__ import annotations

from typing import Any

import numpy as np

CHUNK = 64

_cupy: Any = None            # the cupy module once imported; False when it is not importable


def array_module(x) -> Any:
    """numpy or cupy: the array module of x (``cupy.get_array_module``; numpy when CuPy is not importable)."""
    global _cupy
    if _cupy is None:
        try:
            import cupy
            _cupy = cupy
        except Exception:  # ImportError or a broken CUDA install
            _cupy = False
    if _cupy is False or isinstance(x, np.ndarray):
        return np
    return _cupy.get_array_module(x)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), float32."""
    xp = array_module(x)
    return x / (1.0 + xp.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x), elementwise."""
    xp = array_module(x)
    return 1.0 / (1.0 + xp.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), computed stably (torch.nn.functional.softplus with threshold 20 gives the same in fp32)."""
    xp = array_module(x)
    return xp.where(x > 20.0, x, xp.log1p(xp.exp(xp.minimum(x, 20.0)))).astype(np.float32)


def l2_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x * rsqrt(sum(x^2, last axis) + eps) (the FLA / transformers ``l2norm``); float32, shape kept."""
    xp = array_module(x)
    x = xp.asarray(x, dtype=np.float32)
    return x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def causal_conv1d(x: np.ndarray, weight: np.ndarray, window: np.ndarray,
                  bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise 1-D convolution with the previous inputs as state, followed by SiLU (also Mamba2's conv).

    x: float32 (n_tokens, channels); weight: float32 (channels, kernel) (GGUF ``ssm_conv1d``, HF
    ``conv1d.weight`` squeezed); window: float32 (kernel - 1, channels), the last kernel-1 inputs before x
    (zeros at the start of a sequence); bias: None or float32 (channels,) added before the SiLU. Returns (silu(y)
    of shape (n_tokens, channels), new window of shape (kernel - 1, channels)).
    y[t, c] = sum_j weight[c, j] * xx[t + j, c] (+ bias[c]) with xx = window ++ x.
    """
    xp = array_module(x)
    n, c = x.shape
    k = weight.shape[1]
    if weight.shape[0] != c or tuple(window.shape) != (k - 1, c):
        raise ValueError(f"causal_conv1d: x {x.shape}, weight {weight.shape}, window {window.shape} disagree")
    xx = xp.concatenate([window, x], axis=0)
    y = xp.zeros((n, c), dtype=np.float32)
    for j in range(k):
        y += xx[j:j + n] * weight[:, j]
    if bias is not None:
        y += bias
    return silu(y), xp.ascontiguousarray(xx[n:n + k - 1] if k > 1 else xx[:0])


def delta_rule_recurrent(q, k, v, g, beta, state, keep=None):
    """Gated delta rule, one token at a time (the decode path).

    q, k: float32 (n_tokens, n_heads, d_k) (L2-normalised; q scaled by 1/sqrt(d_k) here); v: (n_tokens, n_heads, d_v);
    g, beta: (n_tokens, n_heads); state: (n_heads, d_k, d_v), updated in place and returned; keep: None, or an
    array (>= n_tokens, n_heads, d_k, d_v) that receives the state after each token (keep[t]: after token t).
    Returns (o of shape (n_tokens, n_heads, d_v), state).
    """
    xp = array_module(state)
    n, _, dk = q.shape
    scale = np.float32(1.0 / np.sqrt(dk))
    out = xp.empty(v.shape, dtype=np.float32)
    for t in range(n):
        state *= xp.exp(g[t])[:, None, None]
        kt = k[t]
        kv_mem = xp.einsum("hk,hkv->hv", kt, state)
        u = (v[t] - kv_mem) * beta[t][:, None]
        state += kt[:, :, None] * u[:, None, :]
        out[t] = xp.einsum("hk,hkv->hv", q[t] * scale, state)
        if keep is not None:
            keep[t] = state
    return out, state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Gated delta rule over a prompt in chunks of ``chunk`` tokens (the prefill path).

    Same arguments and results as ``delta_rule_recurrent`` (state updated in place); exact within float
    rounding of the step-by-step recurrence. Cost per chunk: one batched (n_heads, L, L) triangular solve and
    matmuls of size L x d.
    """
    xp = array_module(state)
    n, h, dk = q.shape
    dv = v.shape[2]
    scale = np.float32(1.0 / np.sqrt(dk))
    out = xp.empty((n, h, dv), dtype=np.float32)
    # head-major views: (h, n, d)
    qh = xp.ascontiguousarray(q.transpose(1, 0, 2)) * scale
    kh = xp.ascontiguousarray(k.transpose(1, 0, 2))
    vh = xp.ascontiguousarray(v.transpose(1, 0, 2))
    gh = xp.ascontiguousarray(g.T).astype(np.float32)
    bh = xp.ascontiguousarray(beta.T).astype(np.float32)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        L = e - s
        qc, kc, vc, bc = qh[:, s:e], kh[:, s:e], vh[:, s:e], bh[:, s:e]
        G = xp.cumsum(gh[:, s:e], axis=1)                         # (h, L)
        diff = G[:, :, None] - G[:, None, :]                      # G_t - G_s
        lower = xp.tril(xp.ones((L, L), dtype=bool))
        D = xp.where(lower, xp.exp(xp.where(lower, diff, 0.0)), 0.0).astype(np.float32)  # e^(G_t-G_s), s<=t
        kk = kc @ kc.transpose(0, 2, 1)                           # (h, L, L) k_t . k_s
        A = xp.tril(bc[:, :, None] * D * kk, -1)
        M = A + xp.eye(L, dtype=np.float32)
        eG = xp.exp(G)                                            # (h, L)
        rhs = xp.concatenate([bc[:, :, None] * vc, (bc * eG)[:, :, None] * kc], axis=2)
        sol = xp.linalg.solve(M, rhs).astype(np.float32)          # unit lower-triangular system
        U = sol[:, :, :dv] - sol[:, :, dv:] @ state               # (h, L, dv)
        qk = (qc @ kc.transpose(0, 2, 1)) * D                     # (h, L, L), s <= t
        o = eG[:, :, None] * (qc @ state) + qk @ U
        out[s:e] = o.transpose(1, 0, 2)
        w = xp.exp(G[:, -1:] - G)                                 # (h, L) e^(G_L - G_s)
        state *= xp.exp(G[:, -1])[:, None, None]
        state += (kc * w[:, :, None]).transpose(0, 2, 1) @ U
    return out, state


def gated_rms_norm(x: np.ndarray, weight: np.ndarray, gate: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of x over its last axis times weight, times silu(gate) (Qwen3-Next ``RMSNormGated``).

    x, gate: float32 (..., d); weight: float32 (d,) (plain weight, no +1 offset).
    """
    xp = array_module(x)
    xn = x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (xn * weight * silu(gate)).astype(np.float32)
