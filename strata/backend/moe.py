"""Mixture-of-experts helpers on the backend ops: softmax top-k routing and the routed + shared-expert SwiGLU FFN.

Routing follows Qwen2-MoE / Qwen3-Next (transformers ``Qwen3NextTopKRouter``; llama.cpp ``build_moe_ffn`` with
LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX): probabilities = softmax(router logits) over all experts, keep the top k,
optionally renormalise the kept k to sum to 1. The shared expert's output is scaled by sigmoid(x . w_gate).
Arrays may be numpy or CuPy (the array module follows the activations): on the CUDA backend the routing runs on
the device and only the small (n_tokens, k) expert-id array comes to the host to drive the per-expert loop.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from strata.backend.gdn import array_module
from strata.backend.quant import WeightTensor


def expert_slices(w: WeightTensor) -> list[WeightTensor]:
    """Split a stacked expert tensor (n_expert, rows, cols) into n_expert 2-D WeightTensors (views, no copy)."""
    if len(w.shape) != 3:
        raise ValueError(f"{w.name}: expected a 3-D expert tensor, got shape {w.shape}")
    n = w.shape[0]
    data = np.asarray(w.data)
    data = data.reshape(n, w.shape[1], -1) if data.ndim != 3 else data
    return [WeightTensor(f"{w.name}[{e}]", w.ggml_type, tuple(w.shape[1:]), data[e]) for e in range(n)]


def route(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax top-k routing. logits float32 (n_tokens, n_expert) -> (ids int64 (n, k), weights float32 (n, k)),
    ids in descending probability (ties: lower id first). numpy in, numpy out; CuPy in, CuPy out."""
    xp = array_module(logits)
    z = logits - logits.max(axis=-1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    # CuPy's argsort is a stable radix sort and takes no `kind`
    ids = (np.argsort(-p, axis=-1, kind="stable") if xp is np else xp.argsort(-p, axis=-1))[:, :k]
    w = xp.take_along_axis(p, ids, axis=-1).astype(np.float32)
    if renormalize:
        w /= w.sum(axis=-1, keepdims=True)
    return ids, w


def moe_ffn(be, x: np.ndarray, router: Any, gate: Sequence[Any], up: Sequence[Any], down: Sequence[Any], k: int,
            renormalize: bool, shared: tuple[Any, Any, Any] | None = None, shared_gate: np.ndarray | None = None
            ) -> np.ndarray:
    """Routed SwiGLU experts plus an optional gated shared expert.

    x float32 (n_tokens, n_embd); router: (n_expert, n_embd) weight; gate/up: per-expert (n_ff_exp, n_embd),
    down: per-expert (n_embd, n_ff_exp); shared = (gate, up, down) of the shared expert; shared_gate float32
    (n_embd,), on the same device as x. Returns float32 (n_tokens, n_embd), numpy or CuPy like x.
    """
    n = x.shape[0]
    xp = array_module(x)
    if xp is np:
        ids, w = route(be.to_host(be.matmul(x, router)), k, renormalize)
        ids_h = ids
    else:                                   # routing on the device; the (n, k) ids drive the expert loop
        ids, w = route(be.matmul(x, router), k, renormalize)
        ids_h = xp.asnumpy(ids)
    out = xp.zeros_like(x, dtype=np.float32)
    for e in np.unique(ids_h):
        rows, slot = np.nonzero(ids_h == e)
        if xp is not np:
            rows, slot = xp.asarray(rows), xp.asarray(slot)
        xe = xp.ascontiguousarray(x[rows])
        h = be.swiglu(be.matmul(xe, gate[e]), be.matmul(xe, up[e]))
        y = be.matmul(h, down[e])
        if xp is np:
            np.add.at(out, rows, y * w[rows, slot][:, None])
        else:                               # a token picks an expert at most once: rows are distinct
            out[rows] += y * w[rows, slot][:, None]
    if shared is not None:
        sg, su, sd = shared
        y = be.matmul(be.swiglu(be.matmul(x, sg), be.matmul(x, su)), sd)
        if shared_gate is not None:
            s = x @ shared_gate
            y = y * (1.0 / (1.0 + xp.exp(-s)))[:, None]
        out += y
    assert out.shape[0] == n
    return out
