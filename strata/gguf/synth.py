"""Synthetic GGUF models: random weights in llama.cpp's file layout for llama, qwen3next, qwen35, qwen35moe, nemotron_h, and their HF export.

``write_synthetic(path, spec)`` writes a valid GGUF (tensor names, shapes and metadata keys as the ``gguf``
library's constants and llama.cpp's converter ``convert_hf_to_gguf.py`` / ``conversion/qwen.py`` write them),
with the default model's real tokenizer metadata and chat template copied in. Weights are drawn from a
per-tensor seeded generator, so a file is reproducible from (spec, seed) and large files are streamed
tensor by tensor. ``export_hf(path)`` reads a GGUF back (with the ``gguf`` library's own dequantizers) and
inverts the converter's transforms, giving a transformers config dict and a state dict in HF naming.

Converter transforms inverted by ``export_hf`` (qwen3next / qwen35 / qwen35moe):
  * zero-centred RMSNorm weights are stored +1 (every ``*norm.weight`` except the GDN gated norm ``ssm_norm``);
  * ``ssm_a`` = -exp(A_log); ``ssm_dt.bias`` = dt_bias; ``ssm_conv1d`` is (channels, kernel) (HF (C, 1, K) squeezed);
  * qwen3next: ``in_proj_qkvz`` (per key head [q, k, v-group, z-group]) is split into ``attn_qkv``
    ([all q | all k | all v]) and ``attn_gate`` (z); ``ssm_ba`` keeps HF's per-key-head [b-group, a-group];
  * qwen35 / qwen35moe: when n_v_heads > n_k_heads, value heads are reordered from grouped (v head = k*r + j)
    to tiled (v head = j*n_k + k) in attn_qkv's V rows, attn_gate, ssm_beta, ssm_alpha, ssm_a, ssm_dt,
    ssm_conv1d's V channels and ssm_out's columns;
  * MoE experts are stacked (n_expert, rows, cols); ``ffn_gate_inp_shexp`` is 1-D (n_embd,);
  * the MTP block is appended as block ``n_layer`` (``nextn_predict_layers`` = 1): ``nextn.eh_proj`` (HF
    ``mtp.fc``), ``nextn.enorm`` / ``nextn.hnorm`` / ``nextn.shared_head_norm`` (HF ``mtp.pre_fc_norm_embedding`` /
    ``mtp.pre_fc_norm_hidden`` / ``mtp.norm``) plus a full-attention decoder block (HF ``mtp.layers.0.*``).
  * llama: ``attn_q`` / ``attn_k`` rows are permuted for LLAMA_ROPE_TYPE_NORM (pairs (2i, 2i+1)).

nemotron_h (llama.cpp's converter ``conversion/nemotron.py`` / ``mamba.py``): block i is a Mamba2 mixer, an
attention layer or a squared-ReLU MLP as ``hybrid_pattern``'s letter i says (``M``, ``*``, ``-``); the per-layer
``attention.head_count_kv`` / ``feed_forward_length`` arrays are 0 where the block has none (llama.cpp reads a
block with both 0 as Mamba2). Mamba2 tensors: ``ssm_in`` (rows [z | x B C | dt]), ``ssm_conv1d`` (channels,
kernel) + bias, ``ssm_dt.bias``, ``ssm_a`` = -exp(A_log) and ``ssm_d`` as (n_head, 1), ``ssm_norm`` (n_group,
d_inner / n_group), ``ssm_out``. The spec's GDN fields carry the Mamba2 sizes: ``head_k_dim`` = d_state,
``n_k_heads`` = n_group, ``n_v_heads`` = SSM heads, ``head_v_dim`` = SSM head dim (d_inner = n_v_heads *
head_v_dim). No HF export for it.

Quant types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 through ``gguf.quants.quantize``; the nine IQ types
through ``strata.gguf.iq_quant`` (valid blocks, not llama.cpp's quality). The ``gguf`` library (0.19) has no
quantizer for the K-quants (Q2_K..Q6_K, incl. Q4_K): asking for them raises ValueError. A matrix whose row length
is not whole blocks of the type is written F16 (as llama.cpp's quantizer falls back to another type). 1-D tensors,
``ssm_conv1d``, ``ssm_a`` / ``ssm_dt`` stay F32 (as the converter keeps them).
"""
from __future__ import annotations

import dataclasses
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

from strata.gguf import iq_quant

ARCHS = ("llama", "qwen3next", "qwen35", "qwen35moe", "nemotron_h")
HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
QUANTIZABLE = {
    "F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16, "Q8_0": QT.Q8_0,
    "Q4_0": QT.Q4_0, "Q4_1": QT.Q4_1, "Q5_0": QT.Q5_0, "Q5_1": QT.Q5_1,
    **{q.name: q for q in iq_quant.IQ_QUANTIZABLE},
}


@dataclass
class SynthSpec:
    """Hyper-parameters of a synthetic model (HF terms in comments). Defaults: a tiny qwen3next for tests."""

    arch: str = "qwen3next"
    n_layer: int = 4                    # num_hidden_layers (not counting the MTP block)
    n_embd: int = 64                    # hidden_size
    n_head: int = 4                     # num_attention_heads
    n_head_kv: int = 2                  # num_key_value_heads
    head_dim: int = 32                  # head_dim
    n_ff: int = 128                     # intermediate_size (dense FFN)
    rope_theta: float = 10000.0
    partial_rotary: float = 0.25        # rope.dimension_count = head_dim * partial_rotary (hybrids)
    rms_eps: float = 1e-6
    ctx: int = 4096
    # Gated DeltaNet
    conv_kernel: int = 4                # linear_conv_kernel_dim
    head_k_dim: int = 16                # linear_key_head_dim (= ssm.state_size)
    head_v_dim: int = 16                # linear_value_head_dim (llama.cpp requires == head_k_dim)
    n_k_heads: int = 2                  # linear_num_key_heads (= ssm.group_count)
    n_v_heads: int = 4                  # linear_num_value_heads (= ssm.time_step_rank)
    full_attention_interval: int = 4
    # nemotron_h: one letter per block, M (Mamba2), * (attention), - (MLP); "" = the preset's
    hybrid_pattern: str = ""
    # MoE (qwen3next, qwen35moe)
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 32                  # moe_intermediate_size
    n_ff_shexp: int = 64                # shared_expert_intermediate_size
    norm_topk: bool = True              # norm_topk_prob
    # skewed routers (MoE): "" = plain random routers; else the Zipf exponent of the expert popularity, one value
    # or a comma list cycled over the layers. Token ids fall into router_topics topics (id % router_topics); each
    # topic has a direction in the embedding, and in each layer a ranking of the experts (a base ranking with a
    # router_shift fraction of its places shuffled per topic), so the hot set moves with a prompt's topic.
    router_zipf: str = ""
    router_topics: int = 4
    router_shift: float = 0.5
    topic_strength: float = 1.0
    n_mtp: int = 1                      # MTP blocks (0 or 1)
    tie_embeddings: bool = True
    qtype: str = "F16"                  # type of 2-D/3-D weight matrices
    embd_qtype: str = "Q4_0"            # type of token_embd (and output when untied)
    seed: int = 0
    name: str = "strata-synthetic"
    n_vocab: int = 0                    # vocabulary size: 0 = the default model's (49152); more = synthetic_vocab
    fim: bool = False                   # FIM control tokens (FIM_TOKENS) appended to the vocabulary, with their ids

    @property
    def n_rot(self) -> int:
        return self.head_dim if self.arch == "llama" else int(self.head_dim * self.partial_rotary)

    @property
    def is_moe(self) -> bool:
        return self.arch in ("qwen3next", "qwen35moe")

    def is_recurrent(self, il: int) -> bool:
        if self.arch == "nemotron_h":
            return self.block_kind(il) == "M"
        return self.arch in HYBRID_ARCHS and il < self.n_layer and (il + 1) % self.full_attention_interval != 0

    def block_kind(self, il: int) -> str:
        """nemotron_h: block il's letter in ``hybrid_pattern`` (M Mamba2, * attention, - MLP)."""
        return self.hybrid_pattern[il]

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; supported: {', '.join(ARCHS)}")
        for q in (self.qtype, self.embd_qtype):
            if q not in QUANTIZABLE:
                raise ValueError(f"quant type {q!r} cannot be written: synthetic files take only "
                                 f"{', '.join(QUANTIZABLE)} (no K-quants such as Q4_K)")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.arch in HYBRID_ARCHS and self.n_v_heads % self.n_k_heads:
            raise ValueError(f"n_v_heads {self.n_v_heads} is not a multiple of n_k_heads {self.n_k_heads}")
        if self.n_mtp not in (0, 1) or (self.arch in ("llama", "nemotron_h") and self.n_mtp):
            raise ValueError("n_mtp must be 0 or 1 (and 0 for llama and nemotron_h)")
        if self.arch == "nemotron_h":
            if len(self.hybrid_pattern) != self.n_layer or set(self.hybrid_pattern) - set("M*-"):
                raise ValueError(f"hybrid_pattern {self.hybrid_pattern!r} needs one of M, *, - per block "
                                 f"({self.n_layer})")
            if self.n_v_heads % self.n_k_heads:
                raise ValueError(f"n_v_heads {self.n_v_heads} (SSM heads) is not a multiple of n_k_heads "
                                 f"{self.n_k_heads} (groups)")
        if self.n_vocab and self.n_vocab < _vocab_size():
            raise ValueError(f"n_vocab {self.n_vocab} is below the default model's {_vocab_size()} tokens "
                             "(a synthetic vocabulary extends it)")


def preset(arch: str, size: str = "tiny", **kw) -> SynthSpec:
    """A spec by name: 'tiny' (tests, < 5 MB with the 49152-token vocab), 'small' (~100 MB F16),
    'medium' (~1 GB F16), 'large' (~4 GB F16). Keyword arguments override fields."""
    base: dict[str, Any] = dict(arch=arch)
    if arch == "llama":
        base.update(n_mtp=0, head_dim=16)
    if arch == "nemotron_h":     # Mamba2 sizes: d_state 16, 2 groups, 8 heads of 16 (d_inner 128 = 2 n_embd)
        base.update(n_mtp=0, n_layer=6, hybrid_pattern="M-M*M-", head_dim=32, head_k_dim=16, n_k_heads=2,
                    n_v_heads=8, head_v_dim=16)
    if size == "tiny":
        pass
    elif size in ("small", "medium", "large"):
        dims = {"small": (512, 8, 8, 2, 64, 1536, 64, 4, 8, 16, 4, 256, 512),
                "medium": (1536, 16, 12, 4, 128, 4096, 128, 8, 16, 64, 8, 512, 1024),
                "large": (2048, 36, 16, 4, 128, 6144, 128, 8, 16, 128, 8, 512, 1024)}[size]
        (n_embd, n_layer, n_head, n_kv, hd, n_ff, hk, nk, nv, n_exp, n_used, ff_exp, ff_sh) = dims
        base.update(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_kv, head_dim=hd, n_ff=n_ff,
                    head_k_dim=hk, head_v_dim=hk, n_k_heads=nk, n_v_heads=nv, n_expert=n_exp,
                    n_expert_used=n_used, n_ff_exp=ff_exp, n_ff_shexp=ff_sh, qtype="F16", embd_qtype="F16",
                    tie_embeddings=False)
        if arch == "nemotron_h":      # Nemotron-H's Mamba2 shape: d_state 128, 8 groups, heads of 64
            base.update(head_k_dim=128, n_k_heads=8, head_v_dim=64, n_v_heads=2 * n_embd // 64,
                        hybrid_pattern=("M-M*" * n_layer)[:n_layer])
    else:
        raise ValueError(f"unknown size {size!r}; use tiny, small, medium or large")
    base.update(kw)
    spec = SynthSpec(**base)
    spec.validate()
    return spec


# ---------------------------------------------------------------------------------------------- tensor plan

@dataclass
class _T:
    name: str
    shape: tuple[int, ...]      # numpy order
    kind: str                   # "mat", "embd", "norm", "gnorm", "ssm_a", "dt", "conv", "vec"
    fan_in: int = 1


def _plan(s: SynthSpec) -> list[_T]:
    t: list[_T] = [_T("token_embd.weight", (_vocab_size(s), s.n_embd), "embd")]
    t.append(_T("output_norm.weight", (s.n_embd,), "norm"))
    if not s.tie_embeddings:
        t.append(_T("output.weight", (_vocab_size(s), s.n_embd), "embd", s.n_embd))
    key_dim, value_dim = s.head_k_dim * s.n_k_heads, s.head_v_dim * s.n_v_heads
    conv_dim = 2 * key_dim + value_dim
    for il in range(s.n_layer + s.n_mtp):
        p = f"blk.{il}."
        mtp = il >= s.n_layer
        t.append(_T(p + "attn_norm.weight", (s.n_embd,), "norm"))
        if s.arch == "nemotron_h":
            t += _nemotron_h_block(s, p, s.block_kind(il))
            continue
        if s.arch == "llama":
            t += [_T(p + "attn_q.weight", (s.n_head * s.head_dim, s.n_embd), "mat", s.n_embd),
                  _T(p + "attn_k.weight", (s.n_head_kv * s.head_dim, s.n_embd), "mat", s.n_embd),
                  _T(p + "attn_v.weight", (s.n_head_kv * s.head_dim, s.n_embd), "mat", s.n_embd),
                  _T(p + "attn_output.weight", (s.n_embd, s.n_head * s.head_dim), "mat", s.n_head * s.head_dim),
                  _T(p + "ffn_norm.weight", (s.n_embd,), "norm"),
                  _T(p + "ffn_gate.weight", (s.n_ff, s.n_embd), "mat", s.n_embd),
                  _T(p + "ffn_up.weight", (s.n_ff, s.n_embd), "mat", s.n_embd),
                  _T(p + "ffn_down.weight", (s.n_embd, s.n_ff), "mat", s.n_ff)]
            continue
        t.append(_T(p + "post_attention_norm.weight", (s.n_embd,), "norm"))
        if s.is_recurrent(il):
            t += [_T(p + "attn_qkv.weight", (conv_dim, s.n_embd), "mat", s.n_embd),
                  _T(p + "attn_gate.weight", (value_dim, s.n_embd), "mat", s.n_embd),
                  _T(p + "ssm_conv1d.weight", (conv_dim, s.conv_kernel), "conv", s.conv_kernel),
                  _T(p + "ssm_dt.bias", (s.n_v_heads,), "dt"),
                  _T(p + "ssm_a", (s.n_v_heads,), "ssm_a")]
            if s.arch == "qwen3next":
                t.append(_T(p + "ssm_ba.weight", (2 * s.n_v_heads, s.n_embd), "mat", s.n_embd))
            else:
                t += [_T(p + "ssm_beta.weight", (s.n_v_heads, s.n_embd), "mat", s.n_embd),
                      _T(p + "ssm_alpha.weight", (s.n_v_heads, s.n_embd), "mat", s.n_embd)]
            t += [_T(p + "ssm_norm.weight", (s.head_v_dim,), "gnorm"),
                  _T(p + "ssm_out.weight", (s.n_embd, value_dim), "mat", value_dim)]
        else:
            t += [_T(p + "attn_q.weight", (2 * s.n_head * s.head_dim, s.n_embd), "mat", s.n_embd),
                  _T(p + "attn_k.weight", (s.n_head_kv * s.head_dim, s.n_embd), "mat", s.n_embd),
                  _T(p + "attn_v.weight", (s.n_head_kv * s.head_dim, s.n_embd), "mat", s.n_embd),
                  _T(p + "attn_output.weight", (s.n_embd, s.n_head * s.head_dim), "mat", s.n_head * s.head_dim),
                  _T(p + "attn_q_norm.weight", (s.head_dim,), "norm"),
                  _T(p + "attn_k_norm.weight", (s.head_dim,), "norm")]
        if s.is_moe:
            e = s.n_expert
            t += [_T(p + "ffn_gate_inp.weight", (e, s.n_embd), "mat", s.n_embd),
                  _T(p + "ffn_gate_exps.weight", (e, s.n_ff_exp, s.n_embd), "mat", s.n_embd),
                  _T(p + "ffn_up_exps.weight", (e, s.n_ff_exp, s.n_embd), "mat", s.n_embd),
                  _T(p + "ffn_down_exps.weight", (e, s.n_embd, s.n_ff_exp), "mat", s.n_ff_exp),
                  _T(p + "ffn_gate_inp_shexp.weight", (s.n_embd,), "vec", s.n_embd),
                  _T(p + "ffn_gate_shexp.weight", (s.n_ff_shexp, s.n_embd), "mat", s.n_embd),
                  _T(p + "ffn_up_shexp.weight", (s.n_ff_shexp, s.n_embd), "mat", s.n_embd),
                  _T(p + "ffn_down_shexp.weight", (s.n_embd, s.n_ff_shexp), "mat", s.n_ff_shexp)]
        else:
            t += [_T(p + "ffn_gate.weight", (s.n_ff, s.n_embd), "mat", s.n_embd),
                  _T(p + "ffn_up.weight", (s.n_ff, s.n_embd), "mat", s.n_embd),
                  _T(p + "ffn_down.weight", (s.n_embd, s.n_ff), "mat", s.n_ff)]
        if mtp:
            t += [_T(p + "nextn.eh_proj.weight", (s.n_embd, 2 * s.n_embd), "mat", 2 * s.n_embd),
                  _T(p + "nextn.enorm.weight", (s.n_embd,), "norm"),
                  _T(p + "nextn.hnorm.weight", (s.n_embd,), "norm"),
                  _T(p + "nextn.shared_head_norm.weight", (s.n_embd,), "norm")]
    return t


def _nemotron_h_block(s: SynthSpec, p: str, kind: str) -> list[_T]:
    """A nemotron_h block's tensors past its attn_norm: Mamba2 mixer (M), attention (*) or MLP (-)."""
    E = s.n_embd
    if kind == "M":
        nh, ng, ds = s.n_v_heads, s.n_k_heads, s.head_k_dim
        d_inner = nh * s.head_v_dim
        conv_ch = d_inner + 2 * ng * ds
        return [_T(p + "ssm_in.weight", (2 * d_inner + 2 * ng * ds + nh, E), "mat", E),
                _T(p + "ssm_conv1d.weight", (conv_ch, s.conv_kernel), "conv", s.conv_kernel),
                _T(p + "ssm_conv1d.bias", (conv_ch,), "vec", s.conv_kernel),
                _T(p + "ssm_dt.bias", (nh,), "mamba_dt"),
                _T(p + "ssm_a", (nh, 1), "ssm_a"),
                _T(p + "ssm_d", (nh, 1), "gnorm"),
                _T(p + "ssm_norm.weight", (ng, d_inner // ng), "gnorm"),
                _T(p + "ssm_out.weight", (E, d_inner), "mat", d_inner)]
    if kind == "*":
        q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        return [_T(p + "attn_q.weight", (q, E), "mat", E), _T(p + "attn_k.weight", (kv, E), "mat", E),
                _T(p + "attn_v.weight", (kv, E), "mat", E), _T(p + "attn_output.weight", (E, q), "mat", q)]
    return [_T(p + "ffn_up.weight", (s.n_ff, E), "mat", E), _T(p + "ffn_down.weight", (E, s.n_ff), "mat", s.n_ff)]


def _qtype_for(s: SynthSpec, t: _T) -> QT:
    if t.kind == "embd":
        q = QUANTIZABLE[s.embd_qtype]
    elif t.kind == "mat":
        q = QUANTIZABLE[s.qtype]
    else:
        return QT.F32
    bs = gguf.GGML_QUANT_SIZES[q][0]
    return q if t.shape[-1] % bs == 0 else QT.F16 if q not in (QT.F32,) else QT.F32


def zipf_exponents(s: SynthSpec) -> list[float]:
    """The routers' Zipf exponent per layer (empty: plain random routers)."""
    if not s.router_zipf.strip():
        return []
    vals = [float(v) for v in s.router_zipf.split(",")]
    return [vals[i % len(vals)] for i in range(s.n_layer)]


def topic_directions(s: SynthSpec) -> np.ndarray:
    """(router_topics, n_embd) orthonormal directions, one per topic."""
    rng = np.random.default_rng([s.seed, 0x70])
    q, _ = np.linalg.qr(rng.standard_normal((s.n_embd, s.router_topics)))
    return q.T.astype(np.float32)


def topic_rankings(s: SynthSpec, layer: int) -> np.ndarray:
    """int (router_topics, n_expert): per topic, the experts from the most to the least popular in this layer."""
    rng = np.random.default_rng([s.seed, 0x71, layer])
    base = rng.permutation(s.n_expert)
    out = []
    for _ in range(s.router_topics):
        r = base.copy()
        k = int(round(s.router_shift * s.n_expert))
        if k > 1:
            pos = rng.choice(s.n_expert, k, replace=False)
            r[pos] = r[rng.permutation(pos)]
        out.append(r)
    return np.stack(out)


def _skew(s: SynthSpec, t: _T, x: np.ndarray) -> np.ndarray:
    """The topic parts of the embedding rows and of the routers (x: the plain random values, reshaped)."""
    zs = zipf_exponents(s)
    if not zs or s.router_topics < 1:
        return x
    dirs = topic_directions(s)
    scale = np.float32(s.topic_strength * math.sqrt(s.n_embd))
    if t.name == "token_embd.weight":
        ids = np.arange(t.shape[0])
        return x + scale * dirs[ids % s.router_topics]
    if t.name.endswith(".ffn_gate_inp.weight") and t.name.startswith("blk."):
        li = int(t.name.split(".")[1])
        if li >= s.n_layer:
            return x
        logp = np.zeros((s.router_topics, s.n_expert), np.float32)
        rank = np.arange(1, s.n_expert + 1, dtype=np.float64)
        lp = -zs[li] * np.log(rank)
        lp -= lp.mean()
        for ti, order in enumerate(topic_rankings(s, li)):
            logp[ti, order] = lp
        # expert e's logit gains (x . dir_t) / sqrt(n_embd) * logp[t, e]: about logp when a token's topic part
        # survives the layers below at full strength
        return x + (logp.T @ dirs) / np.float32(math.sqrt(s.n_embd))
    return x


def _values(s: SynthSpec, t: _T) -> np.ndarray:
    """The tensor's fp32 values as stored in the GGUF (converter transforms already applied)."""
    x = _plain_values(s, t).reshape(t.shape)
    return _skew(s, t, x).astype(np.float32)


def _plain_values(s: SynthSpec, t: _T) -> np.ndarray:
    rng = np.random.default_rng([s.seed, zlib.crc32(t.name.encode())])
    n = int(np.prod(t.shape))
    if t.kind == "embd":
        x = rng.standard_normal(n, dtype=np.float32)
    elif t.kind == "mat":
        x = rng.standard_normal(n, dtype=np.float32) * np.float32(1.0 / math.sqrt(t.fan_in))
    elif t.kind == "norm":          # stored = 1 + w (zero-centred convention)
        x = 1.0 + 0.2 * rng.standard_normal(n, dtype=np.float32)
    elif t.kind == "gnorm":         # plain weight
        x = 1.0 + 0.2 * rng.standard_normal(n, dtype=np.float32)
    elif t.kind == "ssm_a":         # -exp(A_log), A in [0.5, 4]
        x = -rng.uniform(0.5, 4.0, n).astype(np.float32)
    elif t.kind == "dt":
        x = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    elif t.kind == "mamba_dt":      # dt_bias: softplus(dt_bias) ~ 0.02..0.3, a memory of tens of tokens
        x = rng.uniform(-4.0, -1.0, n).astype(np.float32)
    elif t.kind == "conv":
        x = rng.standard_normal(n, dtype=np.float32) * np.float32(1.0 / math.sqrt(t.fan_in))
    else:                           # vec (shared-expert gate)
        x = rng.standard_normal(n, dtype=np.float32) * np.float32(1.0 / math.sqrt(t.fan_in))
    return x.reshape(t.shape).astype(np.float32)


def _encode(x: np.ndarray, q: QT) -> np.ndarray:
    if q == QT.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if q == QT.F16:
        return x.astype(np.float16)
    if q in iq_quant.IQ_QUANTIZABLE:
        return iq_quant.quantize(x, q)
    return gguf.quants.quantize(x, q)


def _vocab_size(s: SynthSpec | None = None) -> int:
    n = s.n_vocab if s is not None and s.n_vocab else len(_tokenizer_fields()["tokenizer.ggml.tokens"][0])
    return n + (len(FIM_TOKENS) if s is not None and s.fim else 0)


# fill-in-the-middle tokens as Qwen2.5-Coder names them: GGUF key suffix (tokenizer.ggml.fim_<x>_token_id) -> text
FIM_TOKENS = {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>", "pad": "<|fim_pad|>",
              "rep": "<|repo_name|>", "sep": "<|file_sep|>"}


_TOK_CACHE: dict[str, tuple[Any, Any, Any]] | None = None


def _tokenizer_fields() -> dict[str, tuple[Any, Any, Any]]:
    """tokenizer.* keys of the default model: name -> (value, GGUFValueType, sub type or None)."""
    global _TOK_CACHE
    if _TOK_CACHE is None:
        from strata.gguf.default_model import default_model_path
        r = gguf.GGUFReader(default_model_path())
        out = {}
        for name, f in r.fields.items():
            if not name.startswith("tokenizer."):
                continue
            vt = f.types[0]
            sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
            val = f.contents()
            out[name] = (val, vt, sub)
        _TOK_CACHE = out
    return _TOK_CACHE


def _write_metadata(w: gguf.GGUFWriter, s: SynthSpec) -> None:
    a = s.arch
    w.add_name(s.name)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer + s.n_mtp)
    w.add_head_count(s.n_head)
    if a == "nemotron_h":                                  # per-block arrays: 0 where the block has none
        w.add_head_count_kv([s.n_head_kv if s.block_kind(i) == "*" else 0 for i in range(s.n_layer)])
    else:
        w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(s.rms_eps)
    if a != "nemotron_h":                                  # no positional encoding there
        w.add_rope_freq_base(s.rope_theta)
        w.add_rope_dimension_count(s.n_rot)
    if a == "nemotron_h":
        w.add_feed_forward_length([s.n_ff if s.block_kind(i) == "-" else 0 for i in range(s.n_layer)])
        w.add_layer_norm_eps(s.rms_eps)                    # llama.cpp's nemotron_h loader requires it
        w.add_ssm_conv_kernel(s.conv_kernel)
        w.add_ssm_state_size(s.head_k_dim)
        w.add_ssm_group_count(s.n_k_heads)
        w.add_ssm_time_step_rank(s.n_v_heads)
        w.add_ssm_inner_size(s.head_v_dim * s.n_v_heads)
    else:
        w.add_feed_forward_length(s.n_ff)
    w.add_vocab_size(_vocab_size(s))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if s.qtype == "F32" else gguf.LlamaFileType.MOSTLY_F16
                    if s.qtype == "F16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    if a in HYBRID_ARCHS:
        w.add_ssm_conv_kernel(s.conv_kernel)
        w.add_ssm_state_size(s.head_k_dim)
        w.add_ssm_group_count(s.n_k_heads)
        w.add_ssm_time_step_rank(s.n_v_heads)
        w.add_ssm_inner_size(s.head_v_dim * s.n_v_heads)
        w.add_full_attention_interval(s.full_attention_interval)
        if s.n_mtp:
            w.add_nextn_predict_layers(s.n_mtp)
    if a in ("qwen35", "qwen35moe"):
        half = s.n_rot // 2                          # IMROPE sections (t, h, w, e); text uses equal positions
        sec = [half - 2 * (half // 3), half // 3, half // 3, 0]
        w.add_rope_dimension_sections(sec)
    if s.is_moe:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
        w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
        w.add_expert_weights_norm(s.norm_topk)
    fields = _tokenizer_fields()
    if s.n_vocab and s.n_vocab > _vocab_size():
        tokens, types, merges = synthetic_vocab(s.n_vocab, s.seed)
        fields = dict(fields)
        for key, val in (("tokens", tokens), ("token_type", types), ("merges", merges)):
            _, vt, sub = fields[f"tokenizer.ggml.{key}"]
            fields[f"tokenizer.ggml.{key}"] = (val, vt, sub)
    if s.fim:                  # control tokens after the vocabulary, and the keys that name them
        fields = dict(fields)
        base = len(fields["tokenizer.ggml.tokens"][0])
        for key, more in (("tokens", list(FIM_TOKENS.values())), ("token_type", [3] * len(FIM_TOKENS))):
            val, vt, sub = fields[f"tokenizer.ggml.{key}"]
            fields[f"tokenizer.ggml.{key}"] = (list(val) + more, vt, sub)
        for i, role in enumerate(FIM_TOKENS):
            fields[f"tokenizer.ggml.fim_{role}_token_id"] = (base + i, gguf.GGUFValueType.UINT32, None)
    for name, (val, vt, sub) in fields.items():
        w.add_key_value(name, val, vt, sub_type=sub)


def synthetic_vocab(n_vocab: int, seed: int = 0) -> tuple[list[str], list[int], list[str]]:
    """The default model's vocabulary grown to n_vocab tokens (Qwen's 151936 for benchmarks at that size): each new
    token is a new BPE merge of two existing ones (a word-start piece and a lower-case piece, or any two normal
    pieces one time in four), so the file's tokenizer stays a consistent byte-level BPE. Returns (tokens,
    token types, merges), reproducible from (n_vocab, seed)."""
    f = _tokenizer_fields()
    tokens = [str(t) for t in f["tokenizer.ggml.tokens"][0]]
    types = [int(t) for t in f["tokenizer.ggml.token_type"][0]]
    merges = [str(m) for m in f["tokenizer.ggml.merges"][0]]
    if n_vocab <= len(tokens):
        return tokens[:n_vocab], types[:n_vocab], merges
    normal = [t for t, ty in zip(tokens, types) if ty == 1 and len(t) > 0]
    heads = [t for t in normal if re.fullmatch(r"\u0120?[A-Za-z]{2,}", t)]
    tails = [t for t in normal if re.fullmatch(r"[a-z]{2,}", t)]
    seen = set(tokens)
    rng = np.random.default_rng([int(seed), int(n_vocab)])
    while len(tokens) < n_vocab:
        pool_a, pool_b = (normal, normal) if rng.random() < 0.25 else (heads, tails)
        a, b = pool_a[int(rng.integers(len(pool_a)))], pool_b[int(rng.integers(len(pool_b)))]
        if a + b in seen or len(a + b) > 24:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        types.append(1)
        merges.append(f"{a} {b}")
    return tokens, types, merges


def _encoded(args: tuple[SynthSpec, _T, QT]) -> np.ndarray:
    spec, t, q = args
    return _encode(_values(spec, t), q)


def _encode_all(jobs: list, workers: int) -> Iterator[np.ndarray]:
    """The encoded tensors of jobs in order; with workers > 1 from a process pool, at most 2 * workers in flight."""
    if workers <= 1:
        yield from map(_encoded, jobs)
        return
    import multiprocessing
    from collections import deque
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        window: deque = deque()
        it = iter(jobs)
        for job in it:
            window.append(pool.apply_async(_encoded, (job,)))
            if len(window) >= 2 * workers:
                break
        while window:
            arr = window.popleft().get()
            nxt = next(it, None)
            if nxt is not None:
                window.append(pool.apply_async(_encoded, (nxt,)))
            yield arr


def write_synthetic(path: str | Path, spec: SynthSpec, progress: bool = False,
                    overrides: dict[str, Any] | None = None, workers: int = 1) -> Path:
    """Write ``spec`` as a GGUF at ``path`` (streamed: one tensor in memory at a time). Returns the path.

    ``workers`` > 1 computes the tensors in that many processes (in file order, a few ahead of the writer: each
    tensor's values come from its own seeded generator, so the file is the same bytes).

    ``overrides`` replaces metadata values by full key (e.g. {"qwen35.ssm.state_size": 8}), to make files whose
    metadata disagrees with their tensors. Raises ValueError for an unknown arch or a quant type the gguf
    library cannot write.
    """
    spec.validate()
    path = Path(path)
    plan = _plan(spec)
    w = gguf.GGUFWriter(path, spec.arch)
    _write_metadata(w, spec)
    for key, val in (overrides or {}).items():
        kv = w.kv_data[0]
        if key not in kv:
            raise ValueError(f"override of unknown metadata key {key!r}")
        kv[key] = dataclasses.replace(kv[key], value=val)
    types = []
    for t in plan:
        q = _qtype_for(spec, t)
        types.append(q)
        bs, ts = gguf.GGML_QUANT_SIZES[q]
        nbytes = int(np.prod(t.shape[:-1])) * (t.shape[-1] // bs) * ts
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, raw_dtype=q)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    jobs = [(spec, t, q) for t, q in zip(plan, types)]
    for i, arr in enumerate(_encode_all(jobs, workers)):
        w.write_tensor_data(arr)
        if progress:
            _, t, q = jobs[i]
            print(f"[{i + 1}/{len(plan)}] {t.name} {q.name} {t.shape}", flush=True)
    w.close()
    return path


# ------------------------------------------------------------------------------------------------ HF export

def _reader_tensors(src) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    r = src if isinstance(src, gguf.GGUFReader) else gguf.GGUFReader(src)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.") and f.types}
    out = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.tensor_type in (QT.F32, QT.F16):
            a = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        out[t.name] = a
    return meta, out


def _ungroup_v(x: np.ndarray, axis: int, n_k: int, r: int, hd: int) -> np.ndarray:
    """Inverse of the converter's grouped->tiled V-head reorder along ``axis`` (length n_k*r*hd)."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    y = x.reshape(r, n_k, hd, *rest).swapaxes(0, 1).reshape(n_k * r * hd, *rest)
    return np.moveaxis(y, 0, axis)


def export_hf(path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a synthetic (or converter-written) GGUF and return (transformers config kwargs, HF state dict).

    ``path``: a file path or an already opened ``gguf.GGUFReader`` (tensors are dequantized with the gguf
    library's numpy dequantizers).
    The config dict carries ``architectures`` (Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
    LlamaForCausalLM); the state dict holds float32 numpy arrays in HF naming, MTP weights under ``mtp.*``.
    """
    meta, T = _reader_tensors(path)
    a = meta["general.architecture"]
    if a == "nemotron_h":
        raise ValueError("export_hf: no transformers export for nemotron_h (its reference is llama.cpp)")
    g = lambda k, d=None: meta.get(f"{a}.{k}", d)  # noqa: E731
    n_all = int(g("block_count"))
    n_mtp = int(g("nextn_predict_layers", 0) or 0)
    n_layer = n_all - n_mtp
    n_embd, n_head, n_kv = int(g("embedding_length")), int(g("attention.head_count")), int(g("attention.head_count_kv"))
    hd = int(g("attention.key_length", n_embd // n_head))
    vocab = T["token_embd.weight"].shape[0]
    tie = "output.weight" not in T
    sd: dict[str, np.ndarray] = {"model.embed_tokens.weight": T["token_embd.weight"]}
    if not tie:
        sd["lm_head.weight"] = T["output.weight"]
    cfg: dict[str, Any] = dict(vocab_size=vocab, hidden_size=n_embd, num_hidden_layers=n_layer,
                               num_attention_heads=n_head, num_key_value_heads=n_kv, head_dim=hd,
                               rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
                               max_position_embeddings=int(g("context_length")), tie_word_embeddings=tie,
                               intermediate_size=int(g("feed_forward_length")))
    theta = float(g("rope.freq_base", 10000.0))
    if a == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": "default", "rope_theta": theta})
        sd["model.norm.weight"] = T["output_norm.weight"]

        def unpermute(w, nh):   # inverse of convert_hf_to_gguf LlamaModel.permute
            return w.reshape(nh, w.shape[0] // nh // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        for il in range(n_layer):
            p, h = f"blk.{il}.", f"model.layers.{il}."
            sd[h + "input_layernorm.weight"] = T[p + "attn_norm.weight"]
            sd[h + "post_attention_layernorm.weight"] = T[p + "ffn_norm.weight"]
            sd[h + "self_attn.q_proj.weight"] = unpermute(T[p + "attn_q.weight"], n_head)
            sd[h + "self_attn.k_proj.weight"] = unpermute(T[p + "attn_k.weight"], n_kv)
            sd[h + "self_attn.v_proj.weight"] = T[p + "attn_v.weight"]
            sd[h + "self_attn.o_proj.weight"] = T[p + "attn_output.weight"]
            for x in ("gate", "up", "down"):
                sd[h + f"mlp.{x}_proj.weight"] = T[p + f"ffn_{x}.weight"]
        return cfg, sd

    n_rot = int(g("rope.dimension_count"))
    nk, nv = int(g("ssm.group_count")), int(g("ssm.time_step_rank"))
    dk = int(g("ssm.state_size"))
    dv = int(g("ssm.inner_size")) // nv
    r = nv // nk
    interval = int(g("full_attention_interval", 4))
    layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layer)]
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": n_rot / hd}
    if a in ("qwen35", "qwen35moe"):
        sec = [int(x) for x in g("rope.dimension_sections", [0, 0, 0, 0])][:3]
        rope.update(mrope_section=sec, mrope_interleaved=True)
    cfg.update(linear_conv_kernel_dim=int(g("ssm.conv_kernel")), linear_key_head_dim=dk, linear_value_head_dim=dv,
               linear_num_key_heads=nk, linear_num_value_heads=nv, layer_types=layer_types, rope_parameters=rope)
    moe = a in ("qwen3next", "qwen35moe")
    if moe:
        cfg.update(num_experts=int(g("expert_count")), num_experts_per_tok=int(g("expert_used_count")),
                   moe_intermediate_size=int(g("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length")))
    if a == "qwen3next":
        cfg.update(architectures=["Qwen3NextForCausalLM"], decoder_sparse_step=1, mlp_only_layers=[],
                   norm_topk_prob=bool(g("expert_weights_norm", True)))
    elif a == "qwen35":
        cfg.update(architectures=["Qwen3_5ForCausalLM"])
    else:
        cfg.update(architectures=["Qwen3_5MoeForCausalLM"])
    reorder = a in ("qwen35", "qwen35moe") and r > 1
    m1 = lambda x: x - 1.0  # noqa: E731   (stored 1 + w)
    sd["model.norm.weight"] = m1(T["output_norm.weight"])

    def block(il: int, h: str, recurrent: bool) -> None:
        p = f"blk.{il}."
        sd[h + "input_layernorm.weight"] = m1(T[p + "attn_norm.weight"])
        sd[h + "post_attention_layernorm.weight"] = m1(T[p + "post_attention_norm.weight"])
        if recurrent:
            la = h + "linear_attn."
            qkv, z = T[p + "attn_qkv.weight"], T[p + "attn_gate.weight"]
            conv = T[p + "ssm_conv1d.weight"]
            A, dt, out = T[p + "ssm_a"], T[p + "ssm_dt.bias"], T[p + "ssm_out.weight"]
            if a == "qwen3next":
                q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
                parts = [q.reshape(nk, dk, -1), k.reshape(nk, dk, -1), v.reshape(nk, r * dv, -1),
                         z.reshape(nk, r * dv, -1)]
                sd[la + "in_proj_qkvz.weight"] = np.concatenate(parts, axis=1).reshape(-1, n_embd)
                sd[la + "in_proj_ba.weight"] = T[p + "ssm_ba.weight"]
            else:
                b_, a_ = T[p + "ssm_beta.weight"], T[p + "ssm_alpha.weight"]
                if reorder:
                    q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
                    qkv = np.concatenate([q, k, _ungroup_v(v, 0, nk, r, dv)])
                    z = _ungroup_v(z, 0, nk, r, dv)
                    b_, a_ = _ungroup_v(b_, 0, nk, r, 1), _ungroup_v(a_, 0, nk, r, 1)
                    A, dt = _ungroup_v(A, 0, nk, r, 1), _ungroup_v(dt, 0, nk, r, 1)
                    conv = np.concatenate([conv[:2 * nk * dk], _ungroup_v(conv[2 * nk * dk:], 0, nk, r, dv)])
                    out = _ungroup_v(out, 1, nk, r, dv)
                sd[la + "in_proj_qkv.weight"] = qkv
                sd[la + "in_proj_z.weight"] = z
                sd[la + "in_proj_b.weight"] = b_
                sd[la + "in_proj_a.weight"] = a_
            sd[la + "conv1d.weight"] = conv[:, None, :]
            sd[la + "A_log"] = np.log(-A)
            sd[la + "dt_bias"] = dt
            sd[la + "norm.weight"] = T[p + "ssm_norm.weight"]
            sd[la + "out_proj.weight"] = out
        else:
            sa = h + "self_attn."
            sd[sa + "q_proj.weight"] = T[p + "attn_q.weight"]
            sd[sa + "k_proj.weight"] = T[p + "attn_k.weight"]
            sd[sa + "v_proj.weight"] = T[p + "attn_v.weight"]
            sd[sa + "o_proj.weight"] = T[p + "attn_output.weight"]
            sd[sa + "q_norm.weight"] = m1(T[p + "attn_q_norm.weight"])
            sd[sa + "k_norm.weight"] = m1(T[p + "attn_k_norm.weight"])
        if moe:
            mp = h + "mlp."
            sd[mp + "gate.weight"] = T[p + "ffn_gate_inp.weight"]
            sd[mp + "experts.gate_up_proj"] = np.concatenate(
                [T[p + "ffn_gate_exps.weight"], T[p + "ffn_up_exps.weight"]], axis=1)
            sd[mp + "experts.down_proj"] = T[p + "ffn_down_exps.weight"]
            for x in ("gate", "up", "down"):
                sd[mp + f"shared_expert.{x}_proj.weight"] = T[p + f"ffn_{x}_shexp.weight"]
            sd[mp + "shared_expert_gate.weight"] = T[p + "ffn_gate_inp_shexp.weight"].reshape(1, n_embd)
        else:
            for x in ("gate", "up", "down"):
                sd[h + f"mlp.{x}_proj.weight"] = T[p + f"ffn_{x}.weight"]

    for il in range(n_layer):
        block(il, f"model.layers.{il}.", layer_types[il] == "linear_attention")
    for j in range(n_mtp):
        il = n_layer + j
        p = f"blk.{il}."
        block(il, f"mtp.layers.{j}.", False)
        sd["mtp.fc.weight"] = T[p + "nextn.eh_proj.weight"]
        sd["mtp.pre_fc_norm_embedding.weight"] = m1(T[p + "nextn.enorm.weight"])
        sd["mtp.pre_fc_norm_hidden.weight"] = m1(T[p + "nextn.hnorm.weight"])
        sd["mtp.norm.weight"] = m1(T[p + "nextn.shared_head_norm.weight"])
    return cfg, sd


def hf_model(path):
    """Build the transformers model (torch float32, eval) holding the GGUF's weights; returns (model, mtp_state).

    ``mtp_state`` is the ``mtp.*`` part of the state dict (transformers' Qwen3-Next / Qwen3.5 classes ignore MTP).
    Requires torch and transformers.
    """
    import torch
    import transformers
    cfg, sd = export_hf(path)
    arch = cfg.pop("architectures")[0]
    conf_cls = {"Qwen3NextForCausalLM": transformers.Qwen3NextConfig,
                "Qwen3_5ForCausalLM": transformers.Qwen3_5TextConfig,
                "Qwen3_5MoeForCausalLM": transformers.Qwen3_5MoeTextConfig,
                "LlamaForCausalLM": transformers.LlamaConfig}[arch]
    config = conf_cls(**cfg)
    config._attn_implementation = "eager"
    model = getattr(transformers, arch)(config).float().eval()
    mtp = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in sd.items() if k.startswith("mtp.")}
    main = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in sd.items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(main, strict=False)
    missing = [m for m in missing if not (cfg.get("tie_word_embeddings") and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"HF export does not match {arch}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.get("tie_word_embeddings"):
        model.tie_weights()
    return model, mtp


def spec_fields() -> Iterator[dataclasses.Field]:
    return iter(dataclasses.fields(SynthSpec))
