"""Mamba2 ops on numpy arrays: the selective state-space scan (step by step and chunked) and the grouped gated RMSNorm.

Source of the formulas: Dao & Gu, "Transformers are SSMs" (arXiv:2405.21060), as NVIDIA Nemotron-H uses them
(llama.cpp ``ggml_ssm_scan`` and ``build_mamba2_layer``; transformers ``modeling_nemotron_h.py``). The causal
conv in front of the scan is ``strata.backend.gdn.causal_conv1d`` (with its bias).

Conventions (per SSM head h, group g(h) = h // (n_head / n_group), all fp32):
    state S      (head_dim, d_state)        the running state of the layer
    dt_t  > 0    (softplus(dt + dt_bias))    the step
    A_h   < 0    (-exp(A_log))               the decay rate: S <- exp(dt_t A_h) S before the write
    S   <- exp(dt_t A_h) S + dt_t x_t B_t^T  (x_t (head_dim,), B_t (d_state,) of group g(h))
    y_t  = S C_t                             (C_t (d_state,) of group g(h)); the D skip is added by the caller

The chunked form (chunk length ``CHUNK``) is the same recurrence unrolled over a chunk with cumulative log decay
s_t = sum_{i<=t} dt_i A: y_t = e^(s_t) S0 C_t + sum_{j<=t} e^(s_t - s_j) (C_t . B_j) dt_j x_j, and the state after
the chunk e^(s_L) S0 + sum_j e^(s_L - s_j) dt_j x_j B_j^T (the state-space dual form, section 6 of the paper).
"""
from __future__ import annotations

import numpy as np

CHUNK = 64


def _group_map(n_head: int, n_group: int) -> np.ndarray:
    """Head h reads group h // (n_head / n_group) (repeat_interleave of the groups)."""
    return np.arange(n_head) // (n_head // n_group)


def ssm_scan_recurrent(x, dt, A, B, C, state, keep=None):
    """The Mamba2 scan one token at a time (decode, short reads).

    x: float32 (n_tokens, n_head, head_dim); dt: (n_tokens, n_head), already softplus'd; A: (n_head,) (negative);
    B, C: (n_tokens, n_group, d_state); state: (n_head, head_dim, d_state), updated in place; keep: None, or an
    array (>= n_tokens, n_head, head_dim, d_state) receiving the state after each token. Returns y (n_tokens,
    n_head, head_dim) (without the D skip).
    """
    n, nh, hd = x.shape
    hmap = _group_map(nh, B.shape[1])
    y = np.empty((n, nh, hd), dtype=np.float32)
    for t in range(n):
        state *= np.exp(dt[t] * A)[:, None, None]
        state += (x[t] * dt[t][:, None])[:, :, None] * B[t][hmap][:, None, :]
        y[t] = np.einsum("hds,hs->hd", state, C[t][hmap])
        if keep is not None:
            keep[t] = state
    return y


def ssm_scan_chunked(x, dt, A, B, C, state, chunk: int = CHUNK):
    """The Mamba2 scan over a prompt in chunks of ``chunk`` tokens (prefill): the arguments and results of
    ``ssm_scan_recurrent`` (no keep), equal to it within float rounding. Cost per chunk: (n_head, L, L) and
    (n_head, L, head_dim | d_state) matrix products."""
    n, nh, hd = x.shape
    hmap = _group_map(nh, B.shape[1])
    y = np.empty((n, nh, hd), dtype=np.float32)
    xh = np.ascontiguousarray((x * dt[:, :, None]).transpose(1, 0, 2))     # (h, n, hd): dt_j x_j
    ah = np.ascontiguousarray((dt * A).T).astype(np.float32)               # (h, n): log decay per token
    Bg = np.ascontiguousarray(B.transpose(1, 0, 2))                         # (g, n, ds)
    Cg = np.ascontiguousarray(C.transpose(1, 0, 2))
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        L = e - s
        S = np.cumsum(ah[:, s:e], axis=1)                                   # (h, L) s_t
        lower = np.tril(np.ones((L, L), dtype=bool))
        diff = S[:, :, None] - S[:, None, :]                                # s_t - s_j
        Dm = np.where(lower, np.exp(np.where(lower, diff, 0.0)), 0.0).astype(np.float32)
        CB = (Cg[:, s:e] @ Bg[:, s:e].transpose(0, 2, 1))[hmap]             # (h, L, L) C_t . B_j
        Ch = Cg[hmap, s:e]                                                   # (h, L, ds)
        eS = np.exp(S)                                                       # (h, L)
        yc = (CB * Dm) @ xh[:, s:e] + eS[:, :, None] * (Ch @ state.transpose(0, 2, 1))
        y[s:e] = yc.transpose(1, 0, 2)
        w = np.exp(S[:, -1:] - S)                                            # (h, L) e^(s_L - s_j)
        state *= eS[:, -1][:, None, None]
        state += (xh[:, s:e] * w[:, :, None]).transpose(0, 2, 1) @ Bg[hmap, s:e]
    return y


def grouped_gated_rms_norm(y, z, weight, eps: float):
    """Mamba2's output norm: (y * silu(z)) RMS-normalised within each of the n_group groups of its last axis, times
    weight. y, z: float32 (n, d_inner); weight: (n_group, d_inner / n_group) (GGUF ``ssm_norm``). Returns (n,
    d_inner)."""
    n, d = y.shape
    ng = weight.shape[0]
    g = (y * (z / (np.float32(1.0) + np.exp(-z)))).reshape(n, ng, d // ng)
    ms = np.einsum("ngi,ngi->ng", g, g, dtype=np.float32) / np.float32(d // ng)
    return ((g / np.sqrt(ms + np.float32(eps))[:, :, None]) * weight).reshape(n, d).astype(np.float32)
