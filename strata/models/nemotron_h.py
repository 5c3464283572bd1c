"""Hybrid Mamba2 + attention models: `nemotron_h` (NVIDIA Nemotron-H, Nemotron Nano 2), on the CPU backend.

References: llama.cpp ``src/models/nemotron-h.cpp`` / ``mamba-base.cpp`` (build_mamba2_layer) / ``ggml_ssm_scan`` and
its converter (``conversion/nemotron.py``, ``mamba.py``), whose file layout is what this reads; transformers
``modeling_nemotron_h.py``.

* Every block is x + mixer(RMSNorm(x)) with one mixer, chosen per block from the per-layer metadata arrays as
  llama.cpp does: ``attention.head_count_kv`` and ``feed_forward_length`` both 0 -> Mamba2; only
  ``feed_forward_length`` 0 -> attention; else the MLP. Then the final RMSNorm and the output head (token_embd when
  output.weight is absent).
* Mamba2 mixer: ``ssm_in`` rows [z (d_inner) | x B C (d_inner + 2 n_group d_state) | dt (n_head)]; causal depthwise
  conv (``ssm_conv1d`` (channels, d_conv) + optional bias) + SiLU over x B C; dt = softplus(dt + ``ssm_dt.bias``);
  the scan with A = ``ssm_a`` (stored -exp(A_log)) (strata/backend/mamba2.py); y + x * ``ssm_d``; y * silu(z)
  RMS-normalised per group times ``ssm_norm`` (n_group, d_inner / n_group); ``ssm_out``.
* Attention: ``attn_q`` / ``attn_k`` / ``attn_v`` (optional biases), no positional encoding, causal GQA over the
  paged K/V with scale ``attention.scale`` (default 1/sqrt(head_dim)), ``attn_output`` (optional bias).
* MLP: ``ffn_down``(relu(``ffn_up`` x)^2) (optional biases), no gate.

Running state per Mamba2 layer (``SequenceState.running[layer]``, float32, a stage's RecurrentMemory): ``conv``
(d_conv - 1, d_inner + 2 n_group d_state) -- the conv's last inputs -- and ``ssm`` (n_head, head_dim, d_state).

The expert variant (``nemotron_h_moe``) and the MTP head are not read. On a GPU backend the load is refused: the
family has no CUDA plan and its ops here are numpy (run it with --device cpu).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.backend import gdn, mamba2
from strata.backend.quant import ROWWISE_MAX_TOKENS
from strata.gguf.file import GGUFModelFile, ModelLoadError
from strata.memory import Carve, SequenceState
from strata.memory.sequence_state import marked_rows
from strata.models.base import Model

MAMBA, ATTENTION, MLP = "M", "*", "-"


@dataclass
class _Block:
    kind: str
    norm: np.ndarray
    # Mamba2
    w_in: Any = None
    conv: np.ndarray | None = None
    conv_b: np.ndarray | None = None
    dt_b: np.ndarray | None = None
    a: np.ndarray | None = None
    d: np.ndarray | None = None
    ssm_norm: np.ndarray | None = None
    w_out: Any = None
    # attention
    wq: Any = None
    wk: Any = None
    wv: Any = None
    wo: Any = None
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None
    # MLP
    up: Any = None
    down: Any = None
    up_b: np.ndarray | None = None
    down_b: np.ndarray | None = None


def block_kinds(f: GGUFModelFile) -> list[str]:
    """Each block's mixer (MAMBA, ATTENTION or MLP) from the per-layer head_count_kv / feed_forward_length (a
    scalar stands for every block), as llama.cpp's nemotron_h loader decides it."""
    c = f.config
    kv = c.extra.get("n_head_kv_per_layer") or [c.n_head_kv] * c.n_layer
    ff = c.extra.get("n_ff_per_layer") or [c.n_ff] * c.n_layer
    if len(kv) < c.n_layer or len(ff) < c.n_layer:
        raise ModelLoadError(f"{f.path}: per-layer head_count_kv / feed_forward_length arrays are shorter than "
                             f"block_count {c.n_layer}")
    return [MAMBA if kv[i] == 0 and ff[i] == 0 else ATTENTION if ff[i] == 0 else MLP for i in range(c.n_layer)]


class NemotronHModel(Model):
    """Nemotron-H hybrid decoder (see the module docstring for layouts).

    ``scan_mode``: "auto" (the step-by-step scan up to ROWWISE_MAX_TOKENS (16) tokens, so that a short read's row i
    is bit-identical to decoding token i alone, the chunked scan above), "chunked" or "recurrent" (forces one path,
    for tests and benchmarks).
    """

    arch = "nemotron_h"

    def __init__(self, f: GGUFModelFile, backend, progress=None, layers: range | None = None):
        super().__init__(f, backend, progress, layers)
        if getattr(backend, "xp", np) is not np:
            raise ModelLoadError(f"{f.path}: {f.arch} runs on the CPU backend only (no GPU plan yet): use --device cpu")
        c = self.config
        meta = f.metadata
        p = f.arch + "."
        if int(c.extra.get("expert_count", 0) or 0) > 0:
            raise ModelLoadError(f"{f.path}: {f.arch} with experts (nemotron_h_moe) is not supported")
        if int(c.extra.get("nextn_predict_layers", 0) or 0) > 0:
            raise ModelLoadError(f"{f.path}: {f.arch} with an MTP head (nextn_predict_layers) is not supported")
        if p + "attention.layer_norm_rms_epsilon" not in meta and p + "attention.layer_norm_epsilon" in meta:
            self.config = c = dataclasses.replace(c, rms_eps=float(meta[p + "attention.layer_norm_epsilon"]))
        self.eps = c.rms_eps
        self.kinds = block_kinds(f)
        self.recurrent = [k == MAMBA for k in self.kinds]
        self.attn_layers = [i for i, k in enumerate(self.kinds) if k == ATTENTION]
        E = c.n_embd
        # attention geometry: one page pool, so every attention block has the same heads
        heads = c.extra.get("n_head_per_layer") or [c.n_head] * c.n_layer
        kvs = c.extra.get("n_head_kv_per_layer") or [c.n_head_kv] * c.n_layer
        if len({(heads[i], kvs[i]) for i in self.attn_layers}) > 1:
            raise ModelLoadError(f"{f.path}: attention blocks with different head counts are not supported")
        if self.attn_layers:
            nh, nkv = heads[self.attn_layers[0]], kvs[self.attn_layers[0]]
            if nkv != c.n_head_kv or nh != c.n_head or nh % nkv:
                raise ModelLoadError(f"{f.path}: head_count {nh} is not a multiple of head_count_kv {nkv}")
            if int(c.extra.get("head_dim_v", c.head_dim)) != c.head_dim:
                raise ModelLoadError(f"{f.path}: attention.value_length {c.extra['head_dim_v']} != key_length "
                                     f"{c.head_dim}")
        scale = float(c.extra.get("attention.scale", 0.0) or 0.0)
        self.scale = scale if scale else 1.0 / math.sqrt(c.head_dim)
        # Mamba2 hyper-parameters (gguf Keys.SSM)
        if any(self.recurrent):
            def req(key):
                v = c.extra.get(key)
                if v is None:
                    raise ModelLoadError(f"{f.path}: metadata key {p}{key} is missing (needed by {f.arch})")
                return int(v)
            self.d_conv = req("ssm.conv_kernel")
            self.d_inner = req("ssm.inner_size")
            self.d_state = req("ssm.state_size")
            self.n_ssm_head = req("ssm.time_step_rank")
            self.n_group = req("ssm.group_count")
            nh, ng = self.n_ssm_head, self.n_group
            if (self.d_conv < 1 or nh <= 0 or ng <= 0 or self.d_inner % nh or nh % ng or self.d_state <= 0):
                raise ModelLoadError(f"{f.path}: ssm.inner_size {self.d_inner}, ssm.time_step_rank {nh} and "
                                     f"ssm.group_count {ng} are inconsistent")
            self.head_dim_ssm = self.d_inner // nh
            self.conv_dim = self.d_inner + 2 * ng * self.d_state
        self.scan_mode = "auto"

        self.tok_embd = self.weight("token_embd.weight", (c.n_vocab, E))
        self.layers: list[_Block | None] = [self._load_block(i) if self.loads(i) else None for i in range(c.n_layer)]
        self.out_norm = self.weight("output_norm.weight", (E,))
        self.output = self.tok_embd if c.tie_embeddings else self.weight("output.weight", (c.n_vocab, E))
        self._done_loading()

    # --- loading -----------------------------------------------------------------------------------
    def _vec(self, name: str, shape: tuple, optional: bool = False, flat: bool = False) -> np.ndarray | None:
        """A small tensor as a float32 array of `shape` (checked; flat: 1-D), or None when optional and absent."""
        if optional and not self.file.has(name):
            return None
        a = np.ascontiguousarray(self.file.tensor(name, shape).dequantize(), dtype=np.float32)
        return a.reshape(-1) if flat else a.reshape(shape)

    def _load_block(self, i: int) -> _Block:
        c = self.config
        E = c.n_embd
        p = f"blk.{i}."
        kind = self.kinds[i]
        B = _Block(kind=kind, norm=self.weight(p + "attn_norm.weight", (E,)))
        if kind == MAMBA:
            nh, ng, ds, di = self.n_ssm_head, self.n_group, self.d_state, self.d_inner
            B.w_in = self.weight(p + "ssm_in.weight", (2 * di + 2 * ng * ds + nh, E))
            B.conv = self._vec(p + "ssm_conv1d.weight", (self.conv_dim, self.d_conv))
            B.conv_b = self._vec(p + "ssm_conv1d.bias", (self.conv_dim,), optional=True)
            B.dt_b = self._vec(p + "ssm_dt.bias", (nh,))
            B.a = self._vec(p + "ssm_a", (nh, 1), flat=True)
            B.d = self._vec(p + "ssm_d", (nh, 1), flat=True)
            B.ssm_norm = self._vec(p + "ssm_norm.weight", (ng, di // ng))
            B.w_out = self.weight(p + "ssm_out.weight", (E, di))
        elif kind == ATTENTION:
            nq, nkv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
            B.wq = self.weight(p + "attn_q.weight", (nq, E))
            B.wk = self.weight(p + "attn_k.weight", (nkv, E))
            B.wv = self.weight(p + "attn_v.weight", (nkv, E))
            B.wo = self.weight(p + "attn_output.weight", (E, nq))
            B.bq = self.weight(p + "attn_q.bias", (nq,), optional=True)
            B.bk = self.weight(p + "attn_k.bias", (nkv,), optional=True)
            B.bv = self.weight(p + "attn_v.bias", (nkv,), optional=True)
            B.bo = self.weight(p + "attn_output.bias", (E,), optional=True)
        else:
            ff = (c.extra.get("n_ff_per_layer") or [c.n_ff] * c.n_layer)[i]
            B.up = self.weight(p + "ffn_up.weight", (ff, E))
            B.down = self.weight(p + "ffn_down.weight", (E, ff))
            B.up_b = self.weight(p + "ffn_up.bias", (ff,), optional=True)
            B.down_b = self.weight(p + "ffn_down.bias", (E,), optional=True)
        return B

    # --- state -------------------------------------------------------------------------------------
    def new_running_state(self, carve: Carve | None = None) -> dict[int, dict[str, Any]]:
        """Zeroed running state of the carve's Mamba2 layers (all by default): {"conv": (d_conv - 1, conv
        channels), "ssm": (n_head, head_dim, d_state)} float32 each."""
        carve = self._carve(carve)
        return {i: {"conv": np.zeros((self.d_conv - 1, self.conv_dim), dtype=np.float32),
                    "ssm": np.zeros((self.n_ssm_head, self.head_dim_ssm, self.d_state), dtype=np.float32)}
                for i in carve if self.recurrent[i]}

    def running_state_nbytes(self) -> int:
        """Bytes of one sequence's running state (every Mamba2 layer)."""
        if not any(self.recurrent):
            return 0
        per = 4 * ((self.d_conv - 1) * self.conv_dim + self.d_inner * self.d_state)
        return per * sum(self.recurrent)

    # --- layers ------------------------------------------------------------------------------------
    def _mamba(self, L: _Block, h: np.ndarray, run: dict, keep: dict | None = None) -> np.ndarray:
        """One Mamba2 mixer over the rows of h (n, n_embd), its running state `run` updated in place. keep: None, or
        {"conv": (>= n, ...), "ssm": (>= n, ...)} receiving the running state after each row (a verify's)."""
        be = self.backend
        n = h.shape[0]
        di, nh, hd, ng, ds = self.d_inner, self.n_ssm_head, self.head_dim_ssm, self.n_group, self.d_state
        zxbcdt = be.to_host(be.matmul(h, L.w_in))
        z, xbc, dt = zxbcdt[:, :di], zxbcdt[:, di:di + self.conv_dim], zxbcdt[:, di + self.conv_dim:]
        if keep is not None:           # the window after row t: the last d_conv - 1 inputs up to t
            xx = np.concatenate([run["conv"], xbc], axis=0)
            w = self.d_conv - 1
            for t in range(n):
                keep["conv"][t] = xx[t + 1:t + 1 + w]
        y, window = gdn.causal_conv1d(np.ascontiguousarray(xbc), L.conv, run["conv"], L.conv_b)
        run["conv"][...] = window
        x = y[:, :di].reshape(n, nh, hd)
        Bm = y[:, di:di + ng * ds].reshape(n, ng, ds)
        Cm = y[:, di + ng * ds:].reshape(n, ng, ds)
        dt = gdn.softplus(dt + L.dt_b)
        mode = self.scan_mode
        if keep is not None or mode == "recurrent" or (mode == "auto" and n <= ROWWISE_MAX_TOKENS):
            o = mamba2.ssm_scan_recurrent(x, dt, L.a, Bm, Cm, run["ssm"], None if keep is None else keep["ssm"])
        else:
            o = mamba2.ssm_scan_chunked(x, dt, L.a, Bm, Cm, run["ssm"])
        o = o + x * L.d[:, None]
        o = mamba2.grouped_gated_rms_norm(o.reshape(n, di), np.ascontiguousarray(z), L.ssm_norm, self.eps)
        return be.matmul(o, L.w_out)

    def _mamba_cut(self, L: _Block, h, run: dict, cuts: list) -> np.ndarray:
        """_mamba over the rows of h in segments ending at each cut (r, {"conv", "ssm"}): each segment as a forward
        call of its own rows would run the layer, the running state after row r - 1 copied into the cut's arrays
        (Memory.mark: a checkpoint inside one read)."""
        outs, a = [], 0
        for r, at in cuts:
            outs.append(self._mamba(L, h[a:r], run))
            for k, arr in at.items():
                arr[...] = run[k]
            a = r
        outs.append(self._mamba(L, h[a:], run))
        return np.concatenate(outs, axis=0)

    def _attn(self, L: _Block, h: np.ndarray, kv, il: int) -> np.ndarray:
        be, c = self.backend, self.config
        n = h.shape[0]
        q, k, v = be.matmul(h, L.wq), be.matmul(h, L.wk), be.matmul(h, L.wv)
        if L.bq is not None:
            q = q + L.bq
        if L.bk is not None:
            k = k + L.bk
        if L.bv is not None:
            v = v + L.bv
        o = be.attention(q.reshape(n, c.n_head, c.head_dim), k.reshape(n, c.n_head_kv, c.head_dim),
                         v.reshape(n, c.n_head_kv, c.head_dim), kv, il, self.scale)
        o = be.matmul(o.reshape(n, c.n_head * c.head_dim), L.wo)
        return o if L.bo is None else o + L.bo

    def _mlp(self, L: _Block, h: np.ndarray) -> np.ndarray:
        be = self.backend
        u = be.matmul(h, L.up)
        if L.up_b is not None:
            u = u + L.up_b
        u = np.maximum(u, np.float32(0.0))
        o = be.matmul(u * u, L.down)
        return o if L.down_b is None else o + L.down_b

    # --- forward -----------------------------------------------------------------------------------
    def forward_carve(self, tokens, state: SequenceState, lo: int, hi: int, x_in=None, all_logits: bool = False,
                      hidden: bool = False):
        """See Model.forward_carve. hidden (a carve ending with the head): return (logits, the final-normed hidden
        states of every row). Raises ValueError (changing nothing) for an empty batch, an out-of-vocab id or a bad
        carve, and KVCacheFull when the page pool cannot hold the new tokens."""
        be = self.backend
        tokens = self._check_carve(tokens, state, lo, hi, x_in)
        n = int(tokens.shape[0])
        if state.steps is not None and (state.steps.base != state.pos or state.steps.n < n):
            raise ValueError(f"the kept states are armed for {state.steps.n} tokens at {state.steps.base}, "
                             f"the forward reads {n} at {state.pos}")
        kv = state.kv
        if kv is not None:
            kv.reserve(n)
        steps = state.steps.layers if state.steps is not None else {}
        cuts = marked_rows(state, n)
        x = be.embed(self.tok_embd, tokens) if lo == 0 else x_in
        for il in range(lo, hi):
            L = self.layers[il]
            h = be.rms_norm(x, L.norm, self.eps)
            if L.kind == MAMBA:
                run = state.running[il]
                x = x + (self._mamba_cut(L, h, run, [(r, at[il]) for r, at in cuts]) if cuts
                         else self._mamba(L, h, run, steps.get(il)))
            elif L.kind == ATTENTION:
                x = x + self._attn(L, h, kv, il)
            else:
                x = x + self._mlp(L, h)
        if kv is not None:
            kv.commit(n)
        state.advance(tokens)
        if not self.ends_with_head(hi):
            return x
        if hidden:
            return self.head_hidden(x, all_logits)
        return self.head(x, all_logits)
