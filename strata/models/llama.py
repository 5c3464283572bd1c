"""The `llama` architecture (SmolLM2, Llama 2/3, Mistral-style dense decoders), written against Backend ops.

Per layer (llama.cpp src/models/llama.cpp; HF transformers LlamaModel): RMSNorm -> Q/K/V projections -> RoPE
-> causal GQA attention over the paged KV -> output projection -> residual; RMSNorm -> SwiGLU FFN -> residual.
Then the final RMSNorm and the output head (token_embd when output.weight is absent). GGUF Q/K rows are already
permuted by the converter for llama.cpp's NORM RoPE pairing (2i, 2i+1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.gguf.file import GGUFModelFile, ModelLoadError
from strata.models.base import Model
from strata.backend.quant import WeightTensor
from strata.memory import SequenceState


def concat_rows(name: str, parts: list[WeightTensor]) -> WeightTensor | None:
    """One WeightTensor stacking the rows (outputs) of matrices of one type and n_in; None if they differ.

    Packed quantized rows are independent, so stacking the storage rows stacks the matrices.
    """
    t0 = parts[0]
    if any(p.ggml_type != t0.ggml_type or p.shape[1:] != t0.shape[1:] or len(p.shape) != 2 for p in parts):
        return None
    data = np.concatenate([np.asarray(p.data).reshape(p.shape[0], -1) for p in parts], axis=0)
    return WeightTensor(name, t0.ggml_type, (sum(p.shape[0] for p in parts),) + tuple(t0.shape[1:]), data)


@dataclass
class _Layer:
    attn_norm: Any
    wqkv: Any            # fused Q|K|V rows, or None
    wq: Any
    wk: Any
    wv: Any
    bq: Any
    bk: Any
    bv: Any
    wo: Any
    ffn_norm: Any
    w_gate_up: Any       # fused gate|up rows, or None
    w_gate: Any
    w_up: Any
    w_down: Any


class LlamaModel(Model):
    """Dense llama-family decoder. Tensors: token_embd, output_norm, output (optional: tied), rope_freqs
    (optional, Llama 3.1 frequency factors), blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm,
    ffn_gate, ffn_up, ffn_down} (+ optional attn_{q,k,v}.bias)."""

    arch = "llama"

    def __init__(self, f: GGUFModelFile, backend, progress=None, layers: range | None = None):
        super().__init__(f, backend, progress, layers)
        c = self.config
        if int(c.extra.get("expert_count", 0) or 0) > 0:
            raise ModelLoadError(f"{f.path}: llama with experts (Mixtral-style MoE) is not supported yet")
        if c.n_head % c.n_head_kv:
            raise ModelLoadError(f"{f.path}: head_count {c.n_head} is not a multiple of head_count_kv {c.n_head_kv}")
        E, hd, nh, nkv, ff = c.n_embd, c.head_dim, c.n_head, c.n_head_kv, c.n_ff
        self.n_rot = c.rope_dim
        self.freq_scale = 1.0
        if c.extra.get("rope.scaling.type") == "linear" and c.extra.get("rope.scaling.factor"):
            self.freq_scale = 1.0 / float(c.extra["rope.scaling.factor"])
        self.scale = 1.0 / math.sqrt(hd)
        self.eps = c.rms_eps

        self.tok_embd = self.weight("token_embd.weight", (c.n_vocab, E))
        self.rope_freqs = self.weight("rope_freqs.weight", (self.n_rot // 2,), optional=True)
        self.layers: list[_Layer | None] = []
        for i in range(c.n_layer):
            if not self.loads(i):
                self.layers.append(None)
                continue
            p = f"blk.{i}."
            q = f.tensor(p + "attn_q.weight", (nh * hd, E))
            k = f.tensor(p + "attn_k.weight", (nkv * hd, E))
            v = f.tensor(p + "attn_v.weight", (nkv * hd, E))
            g = f.tensor(p + "ffn_gate.weight", (ff, E))
            u = f.tensor(p + "ffn_up.weight", (ff, E))
            bq = self.weight(p + "attn_q.bias", (nh * hd,), optional=True)
            bk = self.weight(p + "attn_k.bias", (nkv * hd,), optional=True)
            bv = self.weight(p + "attn_v.bias", (nkv * hd,), optional=True)
            qkv = concat_rows(p + "attn_qkv", [q, k, v])
            gu = concat_rows(p + "ffn_gate_up", [g, u])
            self.layers.append(_Layer(
                attn_norm=self.weight(p + "attn_norm.weight", (E,)),
                wqkv=self.upload_tensor(qkv) if qkv is not None else None,
                wq=None if qkv is not None else self.upload_tensor(q),
                wk=None if qkv is not None else self.upload_tensor(k),
                wv=None if qkv is not None else self.upload_tensor(v),
                bq=bq, bk=bk, bv=bv,
                wo=self.weight(p + "attn_output.weight", (E, nh * hd)),
                ffn_norm=self.weight(p + "ffn_norm.weight", (E,)),
                w_gate_up=self.upload_tensor(gu) if gu is not None else None,
                w_gate=None if gu is not None else self.upload_tensor(g),
                w_up=None if gu is not None else self.upload_tensor(u),
                w_down=self.weight(p + "ffn_down.weight", (E, ff)),
            ))
        self.out_norm = self.weight("output_norm.weight", (E,))
        if c.tie_embeddings:
            self.output = self.tok_embd
        else:
            self.output = self.weight("output.weight", (c.n_vocab, E))
        self._done_loading()

    def forward_carve(self, tokens, state: SequenceState, lo: int, hi: int, x_in=None, all_logits: bool = False,
                      hidden: bool = False):
        """See Model.forward_carve. hidden (a carve ending with the head): return (logits, the final-normed hidden
        states of every row). Raises ValueError (changing nothing) for an empty batch, an out-of-vocab id or a bad
        carve, and KVCacheFull when the page pool cannot hold the new tokens."""
        be = self.backend
        tokens = self._check_carve(tokens, state, lo, hi, x_in)
        n = int(tokens.shape[0])
        kv = state.kv
        kv.reserve(n)
        positions = np.arange(state.pos, state.pos + n, dtype=np.int64)
        x = be.embed(self.tok_embd, tokens) if lo == 0 else x_in
        x = self._layers(x, positions, lo, hi, lambda q, k, v, il: be.attention(q, k, v, kv, il, self.scale))
        if hidden and self.ends_with_head(hi):
            out = self.head_hidden(x, all_logits)
        else:
            out = self.head(x, all_logits) if self.ends_with_head(hi) else x
        kv.commit(n)
        state.advance(tokens)
        return out

    def forward_batch(self, tokens, states: list[SequenceState], lo: int, hi: int, x_in=None, hidden: bool = False):
        """See Model.forward_batch. On the CPU backend every weight product runs over the N rows at once (the C
        core's integer kernels reduce each row as they reduce one; F32 / F16 weights go row by row up to
        quant.ROWWISE_MAX_TOKENS), RMSNorm, RoPE (each row at its own position) and SwiGLU per row, attention per
        row over its own sequence's pages; other backends take the lone steps (Model.forward_batch)."""
        be = self.backend
        if be.xp is not np:
            return super().forward_batch(tokens, states, lo, hi, x_in, hidden=hidden)
        tokens = self._check_batch(tokens, states, lo, hi, x_in)
        for st in states:
            st.kv.reserve(1)
        positions = np.asarray([st.pos for st in states], dtype=np.int64)
        attend = self._attend_rows(states, self.scale)
        x = be.embed(self.tok_embd, tokens) if lo == 0 else x_in
        x = self._layers(x, positions, lo, hi, attend)
        out = self.head_rows(x, hidden) if self.ends_with_head(hi) else x
        for i, st in enumerate(states):
            st.kv.commit(1)
            st.advance(tokens[i:i + 1])
        return out

    def _layers(self, x, positions: np.ndarray, lo: int, hi: int, attend):
        """Blocks [lo, hi) over the rows of x (n, n_embd), row r at positions[r]; attend(q, k, v, layer) writes the
        rows' K/V and returns their attention (n, n_head, head_dim) -> the residual stream after block hi - 1."""
        be, c = self.backend, self.config
        n = int(x.shape[0])
        nh, nkv, hd = c.n_head, c.n_head_kv, c.head_dim
        rope_kw = {}
        if self.rope_freqs is not None:
            rope_kw["freq_factors"] = self.rope_freqs
        if self.freq_scale != 1.0:
            rope_kw["freq_scale"] = self.freq_scale
        nq, nk = nh * hd, nkv * hd
        fuse_rope = be.name == "cpu"
        for il in range(lo, hi):
            L = self.layers[il]
            h = be.rms_norm(x, L.attn_norm, self.eps)
            if fuse_rope and L.wqkv is not None and L.bq is None and L.bk is None:
                # Q and K heads are adjacent in the fused output: one RoPE call for both (the same per-head op;
                # CPU only, where q/k may stay strided views)
                qkv = be.matmul(h, L.wqkv)
                qk = be.rope(qkv[:, :nq + nk].reshape(n, nh + nkv, hd), positions, self.n_rot, c.rope_theta,
                             c.rope_neox, **rope_kw)
                q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nq + nk:]
                if L.bv is not None:
                    v = v + L.bv
            else:
                if L.wqkv is not None:
                    qkv = be.matmul(h, L.wqkv)
                    q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
                else:
                    q, k, v = be.matmul(h, L.wq), be.matmul(h, L.wk), be.matmul(h, L.wv)
                if L.bq is not None:
                    q = q + L.bq
                if L.bk is not None:
                    k = k + L.bk
                if L.bv is not None:
                    v = v + L.bv
                q = be.rope(q.reshape(n, nh, hd), positions, self.n_rot, c.rope_theta, c.rope_neox, **rope_kw)
                k = be.rope(k.reshape(n, nkv, hd), positions, self.n_rot, c.rope_theta, c.rope_neox, **rope_kw)
            a = attend(q, k, v.reshape(n, nkv, hd), il)
            x = x + be.matmul(a.reshape(n, nh * hd), L.wo)
            h = be.rms_norm(x, L.ffn_norm, self.eps)
            if L.w_gate_up is not None:
                gu = be.matmul(h, L.w_gate_up)
                act = be.swiglu(gu[:, :c.n_ff], gu[:, c.n_ff:])
            else:
                act = be.swiglu(be.matmul(h, L.w_gate), be.matmul(h, L.w_up))
            x = x + be.matmul(act, L.w_down)
        return x
