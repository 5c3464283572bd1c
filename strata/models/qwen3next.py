"""Hybrid Gated DeltaNet + gated attention models: `qwen3next`, `qwen35`, `qwen35moe` (dense or MoE FFN, MTP drafter).

Layer i is a Gated DeltaNet (GDN) layer unless (i + 1) % full_attention_interval == 0 (then gated full
attention). References: transformers ``modeling_qwen3_next.py`` / ``modeling_qwen3_5.py`` /
``modeling_qwen3_5_moe.py``; llama.cpp ``src/models/qwen3next.cpp`` / ``qwen35.cpp`` / ``qwen35moe.cpp`` and its
converter (``conversion/qwen.py``), whose file layout is what this reads:

* RMSNorm weights are stored with the +1 of the zero-centred convention already added, so every norm here is
  a plain RMSNorm (the GDN output norm ``ssm_norm`` was never zero-centred).
* GDN layer: ``attn_qkv`` (rows [q: n_k*d_k | k: n_k*d_k | v: n_v*d_v]), ``attn_gate`` (z, n_v*d_v),
  ``ssm_ba`` (qwen3next: per key head [beta x r, alpha x r], r = n_v/n_k) or ``ssm_beta`` / ``ssm_alpha``
  (qwen35*), ``ssm_conv1d`` (channels, kernel), ``ssm_dt.bias``, ``ssm_a`` (= -exp(A_log)), ``ssm_norm`` (d_v,),
  ``ssm_out``. Value head h reads key head h // r (qwen3next: grouped order) or h % n_k (qwen35*: the
  converter reorders V heads to tiled order). A legacy fused ``ssm_in`` (HF in_proj_qkvz) is accepted too.
  g = ssm_a * softplus(alpha + dt_bias), beta = sigmoid(beta_logit); q, k are L2-normalised after the
  conv + SiLU; the output is RMSNorm(o) * ssm_norm * silu(z), then ``ssm_out``.
* Attention layer: ``attn_q`` rows per head [q (head_dim), gate (head_dim)], per-head q/k RMSNorm, NeoX RoPE on
  the first ``rope.dimension_count`` dims, causal GQA, output * sigmoid(gate), ``attn_output``.
* FFN: dense SwiGLU (qwen35) or softmax top-k MoE with a sigmoid-gated shared expert (qwen3next, qwen35moe).
* MTP: block ``n_layer`` (``nextn_predict_layers`` = 1) — ``nextn.eh_proj`` over [enorm(embed(t+1)), hnorm(h_t)],
  one full-attention block with its own KV, ``nextn.shared_head_norm``, the output head.

Running state per GDN layer (``SequenceState.running[layer]``, float32, a stage's RecurrentMemory): ``conv`` (kernel-1, conv channels) —
the last inputs of the causal conv — and ``ssm`` (n_v, d_k, d_v) — the delta-rule matrix.

On the CUDA backend (``backend.xp`` is CuPy) activations and the running state stay on the device. A GDN layer is
four kernel launches besides its GEMMs, for any number of tokens: the causal conv and the delta rule (recurrent, the
state in registers; strata/backend/cuda/gdn.py, native/cuda/gdn.cu), and the fused q/k L2 norm + gates and gated
RMSNorm (strata/backend/cuda/gdn_prefill.py, native/cuda/gdn_prefill.cu). ``gdn_mode="chunked"`` keeps the chunked
delta rule as CuPy batched matmuls and solves (with CuPy elementwise ops). In this forward MoE routing runs on the device
(only the (n_tokens, k) expert ids come to the host to drive the expert loop). The engine runs these models through
their CUDA plan (strata/backend/cuda/qwen35.py, via CudaBackend.fast_path): one CUDA graph per decode step, MoE layers
included (strata/backend/cuda/moe.py), and a prefill with the tokens grouped by expert on the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.backend import gdn
from strata.backend.moe import expert_slices, moe_ffn
from strata.gguf.file import GGUFModelFile, ModelLoadError
from strata.memory import Carve, KVMemory, Memory, PagedKV, PagePool, SequenceState
from strata.memory.sequence_state import marked_rows
from strata.memory.kv import DEFAULT_PAGE_SIZE
from strata.models.base import Model
from strata.backend.quant import ROWWISE_MAX_TOKENS, WeightTensor


@dataclass
class _FFN:
    dense: tuple[Any, Any, Any] | None = None        # gate, up, down
    router: Any = None
    gate: list | None = None
    up: list | None = None
    down: list | None = None
    shared: tuple[Any, Any, Any] | None = None
    shared_gate: np.ndarray | None = None
    home: Any = None            # the experts' home copies when the backend keeps them in host RAM (expert tier)


@dataclass
class _Layer:
    recurrent: bool
    attn_norm: np.ndarray
    post_norm: np.ndarray
    ffn: _FFN
    # attention
    wq: Any = None
    wk: Any = None
    wv: Any = None
    wo: Any = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    # GDN
    wqkv: Any = None
    wz: Any = None
    w_ba: Any = None
    w_beta: Any = None
    w_alpha: Any = None
    conv: np.ndarray | None = None
    dt: np.ndarray | None = None
    a: np.ndarray | None = None
    ssm_norm: np.ndarray | None = None
    ssm_out: Any = None


def _meta(f: GGUFModelFile, key: str, default: Any = None, required: bool = False) -> Any:
    v = f.config.extra.get(key, f.metadata.get(f"{f.arch}.{key}", default))
    if v is None and required:
        raise ModelLoadError(f"{f.path}: metadata key {f.arch}.{key} is missing (needed by {f.arch})")
    return v


class Qwen3NextModel(Model):
    """Qwen3-Next / Qwen3.5 hybrid decoder (see the module docstring for layouts).

    ``gdn_mode``: "auto" (on the CPU the chunked delta rule for n_tokens > ROWWISE_MAX_TOKENS (16) and the recurrent
    step, token by token, up to that, so that a short read's row i is bit-identical to decoding token i alone; on
    CUDA the recurrent kernel for every n, one launch per layer with the state in registers, which beats the chunked
    form's many small array operations: bench/gpu_throughput.py hybrid prompt vs prompt_chunked), "chunked" or
    "recurrent" (forces one path, for tests and benchmarks).
    """

    arch = "qwen3next"

    def __init__(self, f: GGUFModelFile, backend, progress=None, layers: range | None = None):
        super().__init__(f, backend, progress, layers)
        c = self.config
        a = f.arch
        self.variant = a
        n_mtp = int(_meta(f, "nextn_predict_layers", 0) or 0)
        self.n_layer = c.n_layer - n_mtp
        if self.n_layer <= 0 or n_mtp > 1:
            raise ModelLoadError(f"{f.path}: block_count {c.n_layer} with nextn_predict_layers {n_mtp} is not supported")
        E, nh, nkv, hd = c.n_embd, c.n_head, c.n_head_kv, c.head_dim
        if nh % nkv:
            raise ModelLoadError(f"{f.path}: head_count {nh} is not a multiple of head_count_kv {nkv}")
        self.eps = c.rms_eps
        self.n_rot = c.rope_dim
        self.scale = 1.0 / math.sqrt(hd)
        # GDN hyper-parameters (gguf Keys.SSM)
        self.d_conv = int(_meta(f, "ssm.conv_kernel", required=True))
        self.dk = int(_meta(f, "ssm.state_size", required=True))
        self.nk = int(_meta(f, "ssm.group_count", required=True))
        self.nv = int(_meta(f, "ssm.time_step_rank", required=True))
        d_inner = int(_meta(f, "ssm.inner_size", required=True))
        if self.nv <= 0 or d_inner % self.nv or self.nk <= 0 or self.nv % self.nk:
            raise ModelLoadError(f"{f.path}: ssm.inner_size {d_inner}, ssm.time_step_rank {self.nv} and "
                                 f"ssm.group_count {self.nk} are inconsistent")
        self.dv = d_inner // self.nv
        self.r = self.nv // self.nk
        interval = int(_meta(f, "full_attention_interval", 4) or 4)
        rec_arr = _meta(f, "attention.recurrent_layers")
        if isinstance(rec_arr, (list, tuple)) and len(rec_arr) >= self.n_layer:
            self.recurrent = [bool(x) for x in rec_arr[:self.n_layer]]
        else:
            self.recurrent = [(i + 1) % interval != 0 for i in range(self.n_layer)]
        # value head h reads key head kmap[h]
        if a == "qwen3next":
            self.kmap = np.arange(self.nv) // self.r
        else:
            self.kmap = np.arange(self.nv) % self.nk
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # MoE
        self.n_expert = int(_meta(f, "expert_count", 0) or 0)
        self.n_expert_used = int(_meta(f, "expert_used_count", 0) or 0)
        self.moe = self.n_expert > 0
        if a == "qwen3next" and not self.moe:
            raise ModelLoadError(f"{f.path}: qwen3next needs expert_count > 0")
        if a == "qwen35moe" and not self.moe:
            raise ModelLoadError(f"{f.path}: qwen35moe needs expert_count > 0")
        if self.moe and not 0 < self.n_expert_used <= self.n_expert:
            raise ModelLoadError(f"{f.path}: expert_used_count {self.n_expert_used} outside [1, {self.n_expert}]")
        self.n_ff_exp = int(_meta(f, "expert_feed_forward_length", 0) or 0)
        self.n_ff_shexp = int(_meta(f, "expert_shared_feed_forward_length", 0) or 0)
        self.norm_topk = bool(_meta(f, "expert_weights_norm", True))
        self.gdn_mode = "auto"
        self.xp = getattr(backend, "xp", np)          # numpy (CPU backend) or cupy (CUDA backend)
        self.on_device = self.xp is not np
        self.tiled = a != "qwen3next"                 # value head h reads key head h % n_k (else h // r)
        self.kmap_x = self._dev(self.kmap)

        self.attn_layers = [i for i in range(self.n_layer) if not self.recurrent[i]]
        self.tok_embd = self.weight("token_embd.weight", (c.n_vocab, E))
        self.layers = [self._load_block(i, self.recurrent[i]) if self.loads(i) else None
                       for i in range(self.n_layer)]
        self.out_norm = self.weight("output_norm.weight", (E,))
        self.output = self.tok_embd if c.tie_embeddings else self.weight("output.weight", (c.n_vocab, E))
        self.mtp = None
        self.n_mtp = n_mtp
        if n_mtp and self.loads(self.n_layer - 1):         # the drafter lives on the last stage
            self.load_mtp()
        self._done_loading()

    def load_mtp(self) -> None:
        """Load the MTP block (where the drafter runs: the last stage, or the main beside the head when the last
        layers run on a worker); nothing when loaded or absent."""
        if self.mtp is None and self.n_mtp:
            c, E = self.config, self.config.n_embd
            i = self.n_layer
            p = f"blk.{i}.nextn."
            self.mtp = {
                "block": self._load_block(i, False),
                "eh_proj": self.weight(p + "eh_proj.weight", (E, 2 * E)),
                "enorm": self.weight(p + "enorm.weight", (E,)),
                "hnorm": self.weight(p + "hnorm.weight", (E,)),
                "embed": self.weight(p + "embed_tokens.weight", (c.n_vocab, E), optional=True),
                "head_norm": self.weight(p + "shared_head_norm.weight", (E,), optional=True),
                "head": self.weight(p + "shared_head_head.weight", (c.n_vocab, E), optional=True),
            }

    # --- loading -----------------------------------------------------------------------------------
    def _load_ffn(self, p: str) -> _FFN:
        E = self.config.n_embd
        if self.moe:
            ne, ff, sh = self.n_expert, self.n_ff_exp, self.n_ff_shexp
            f = self.file
            gate = f.tensor(p + "ffn_gate_exps.weight", (ne, ff, E))
            up = f.tensor(p + "ffn_up_exps.weight", (ne, ff, E))
            down = f.tensor(p + "ffn_down_exps.weight", (ne, E, ff))
            home = getattr(self.backend, "expert_home", None)
            h = home(p + "ffn_exps", gate, up, down) if home is not None else None
            if h is not None:           # the expert tier: every expert in pinned host RAM, hot ones in VRAM slots
                out = _FFN(router=self.weight(p + "ffn_gate_inp.weight", (ne, E)), gate=h.gate, up=h.up, down=h.down,
                           home=h)
            else:
                out = _FFN(router=self.weight(p + "ffn_gate_inp.weight", (ne, E)),
                           gate=[self.upload_tensor(t) for t in expert_slices(gate)],
                           up=[self.upload_tensor(t) for t in expert_slices(up)],
                           down=[self.upload_tensor(t) for t in expert_slices(down)])
            if self.file.has(p + "ffn_up_shexp.weight"):
                out.shared = (self.weight(p + "ffn_gate_shexp.weight", (sh, E)),
                              self.weight(p + "ffn_up_shexp.weight", (sh, E)),
                              self.weight(p + "ffn_down_shexp.weight", (E, sh)))
                g = self.file.tensor(p + "ffn_gate_inp_shexp.weight")
                if int(np.prod(g.shape)) != E:
                    raise ModelLoadError(f"{self.file.path}: tensor {p}ffn_gate_inp_shexp.weight has shape {g.shape} "
                                         f"but the metadata expects ({E},)")
                out.shared_gate = self._dev(np.ascontiguousarray(g.dequantize().reshape(E), dtype=np.float32))
            return out
        ff = self.config.n_ff
        return _FFN(dense=(self.weight(p + "ffn_gate.weight", (ff, E)), self.weight(p + "ffn_up.weight", (ff, E)),
                           self.weight(p + "ffn_down.weight", (E, ff))))

    def _load_block(self, i: int, recurrent: bool) -> _Layer:
        c, f = self.config, self.file
        E, nh, nkv, hd = c.n_embd, c.n_head, c.n_head_kv, c.head_dim
        p = f"blk.{i}."
        L = _Layer(recurrent=recurrent, attn_norm=self.weight(p + "attn_norm.weight", (E,)),
                   post_norm=self.weight(p + "post_attention_norm.weight", (E,)), ffn=self._load_ffn(p))
        if not recurrent:
            L.wq = self.weight(p + "attn_q.weight", (2 * nh * hd, E))
            L.wk = self.weight(p + "attn_k.weight", (nkv * hd, E))
            L.wv = self.weight(p + "attn_v.weight", (nkv * hd, E))
            L.wo = self.weight(p + "attn_output.weight", (E, nh * hd))
            L.q_norm = self.weight(p + "attn_q_norm.weight", (hd,))
            L.k_norm = self.weight(p + "attn_k_norm.weight", (hd,))
            return L
        nk, nv, dk, dv, r = self.nk, self.nv, self.dk, self.dv, self.r
        if f.has(p + "attn_qkv.weight"):
            L.wqkv = self.weight(p + "attn_qkv.weight", (self.conv_dim, E))
            L.wz = self.weight(p + "attn_gate.weight", (self.value_dim, E))
        elif self.variant == "qwen3next" and f.has(p + "ssm_in.weight"):
            # legacy layout: HF in_proj_qkvz rows, per key head [q, k, v x r, z x r]; regroup once at load
            w = f.tensor(p + "ssm_in.weight", (2 * self.key_dim + 2 * self.value_dim, E)).dequantize()
            w = w.reshape(nk, 2 * dk + 2 * r * dv, E)
            q, k, v, z = np.split(w, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            qkv = np.concatenate([q.reshape(-1, E), k.reshape(-1, E), v.reshape(-1, E)])
            L.wqkv = self.upload_tensor(_f32(p + "attn_qkv.weight", qkv))
            L.wz = self.upload_tensor(_f32(p + "attn_gate.weight", z.reshape(-1, E)))
        else:
            f.tensor(p + "attn_qkv.weight", (self.conv_dim, E))  # raises naming the tensor
        if self.variant == "qwen3next":
            L.w_ba = self.weight(p + "ssm_ba.weight", (2 * nv, E))
        else:
            L.w_beta = self.weight(p + "ssm_beta.weight", (nv, E))
            L.w_alpha = self.weight(p + "ssm_alpha.weight", (nv, E))
        L.conv = self._dev(np.ascontiguousarray(
            f.tensor(p + "ssm_conv1d.weight", (self.conv_dim, self.d_conv)).dequantize(), dtype=np.float32))
        L.dt = self.weight(p + "ssm_dt.bias", (nv,))
        L.a = self.weight(p + "ssm_a", (nv,))
        L.ssm_norm = self.weight(p + "ssm_norm.weight", (dv,))
        L.ssm_out = self.weight(p + "ssm_out.weight", (E, self.value_dim))
        return L

    def _dev(self, a: np.ndarray) -> Any:
        """A host array as the backend's array (itself on the CPU, a CuPy copy on CUDA)."""
        return self.xp.asarray(a) if self.on_device else a

    # --- state -------------------------------------------------------------------------------------
    @property
    def n_blocks(self) -> int:
        return self.n_layer

    @property
    def moe_path(self) -> dict[str, str] | None:
        """How this model's MoE layers run when the model itself is the runner: the per-expert loop of
        strata/backend/moe.py for decode and prefill (None for a dense model)."""
        return {"decode": "generic", "prefill": "generic"} if self.moe else None

    def new_running_state(self, carve: Carve | None = None) -> dict[int, dict[str, Any]]:
        """Zeroed running state of the carve's GDN layers (all by default): {"conv": (d_conv-1, conv_dim), "ssm":
        (n_v, d_k, d_v)} float32 each, numpy on the CPU backend, CuPy (on the device) on the CUDA backend."""
        xp = self.xp
        carve = self._carve(carve)
        return {i: {"conv": xp.zeros((self.d_conv - 1, self.conv_dim), dtype=np.float32),
                    "ssm": xp.zeros((self.nv, self.dk, self.dv), dtype=np.float32)}
                for i in carve if self.recurrent[i]}

    def running_state_nbytes(self) -> int:
        """Bytes of one sequence's running state."""
        per = 4 * ((self.d_conv - 1) * self.conv_dim + self.nv * self.dk * self.dv)
        return per * sum(self.recurrent)

    def _drafter_memory(self, n_ctx: int, carve: Carve, n_seq: int, page_size: int) -> list[Memory]:
        """The MTP block's K/V ("draft") on the last stage."""
        if self.mtp is None or not self.ends_with_head(carve.hi):
            return []
        return [KVMemory(carve, self.new_mtp_pool(n_ctx, n_seq, page_size), name="draft", identity=self.identity())]

    # --- layers --------------------------------------------------------------------------------------
    def _gdn(self, L: _Layer, x: np.ndarray, run: dict[str, np.ndarray], keep: dict | None = None) -> np.ndarray:
        """One GDN layer over x (n, n_embd), its running state `run` updated in place. keep: None, or
        {"conv": (>= n, d_conv-1, conv_dim), "ssm": (>= n, n_v, d_k, d_v)} receiving the running state after each
        token (a verify's per-position states; the step path, host arrays only)."""
        be = self.backend
        n = x.shape[0]
        nk, nv, dk, dv, r = self.nk, self.nv, self.dk, self.dv, self.r
        dev = self.on_device
        mode = self.gdn_mode
        if keep is not None and dev:
            raise NotImplementedError("keeping per-position running states runs on the CPU backend only")
        # the device: one recurrent kernel launch; the CPU: the step up to ROWWISE_MAX_TOKENS (exact per row)
        step = keep is not None or mode == "recurrent" or (mode == "auto" and (n <= ROWWISE_MAX_TOKENS or dev))
        if dev and step:      # fused: conv, prep (norms, gates), delta rule, gated norm: one kernel launch each
            from strata.backend.cuda import gdn as cuda_gdn, gdn_prefill as cuda_gdn_prefill
            y, _ = cuda_gdn.conv(be.matmul(x, L.wqkv), L.conv, run["conv"])     # window updated in place
            if L.w_ba is not None:
                b, a = be.matmul(x, L.w_ba), None                # (n, 2 n_v): per key head [beta x r, alpha x r]
            else:
                b, a = be.matmul(x, L.w_beta), be.matmul(x, L.w_alpha)
            q, k, v, g, beta = cuda_gdn_prefill.prep(y, b, a, L.a, L.dt, nk, dk, dv)
            o, _ = cuda_gdn.recurrent(q, k, v, g, beta, run["ssm"], tiled=self.tiled)   # maps key heads itself
            o = cuda_gdn_prefill.gated_norm(o, be.matmul(x, L.wz), L.ssm_norm, self.eps)
            return be.matmul(o.reshape(n, nv * dv), L.ssm_out)
        host = (lambda a: a) if dev else be.to_host
        qkv, z, b, a = self._gdn_in(L, x, host)
        o = self._gdn_mix(L, qkv, z, b, a, run, keep, step)
        return be.matmul(o.reshape(n, nv * dv), L.ssm_out)

    def _gdn_cut(self, L: _Layer, x, run: dict, cuts: list) -> Any:
        """_gdn over the rows of x in segments ending at each cut (r, {"conv", "ssm"}): each segment exactly as a
        forward call of its own rows would run the layer, the running state after row r - 1 copied into the cut's
        arrays (Memory.mark: a checkpoint inside one read)."""
        outs, a = [], 0
        for r, keep_at in cuts:
            outs.append(self._gdn(L, x[a:r], run))
            for k, arr in keep_at.items():
                arr[...] = run[k]
            a = r
        outs.append(self._gdn(L, x[a:], run))
        return self.xp.concatenate(outs, axis=0)

    def _gdn_in(self, L: _Layer, x, host) -> tuple:
        """A GDN layer's input products over the rows of x -> (qkv (n, conv_dim), z (n, n_v, d_v), beta logits
        (n, n_v), alpha (n, n_v)), each through `host`."""
        be = self.backend
        n = x.shape[0]
        nk, nv, dv, r = self.nk, self.nv, self.dv, self.r
        qkv = host(be.matmul(x, L.wqkv))
        z = host(be.matmul(x, L.wz)).reshape(n, nv, dv)
        if L.w_ba is not None:
            ba = host(be.matmul(x, L.w_ba)).reshape(n, nk, 2 * r)
            b, a = ba[:, :, :r].reshape(n, nv), ba[:, :, r:].reshape(n, nv)
        else:
            b, a = host(be.matmul(x, L.w_beta)), host(be.matmul(x, L.w_alpha))
        return qkv, z, b, a

    def _gdn_mix(self, L: _Layer, qkv, z, b, a, run: dict, keep: dict | None, step: bool):
        """A GDN layer past its input products, for the rows of one sequence: the causal conv (window in place), the
        q/k L2 norms and gates, the delta rule on run["ssm"] (in place; keep: _gdn's), the gated RMSNorm -> o
        (n, n_v, d_v), the ssm_out product's input."""
        n = qkv.shape[0]
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        if self.on_device:                                               # gdn_mode "chunked" on the device
            from strata.backend.cuda import gdn as cuda_gdn
            y, _ = cuda_gdn.conv(qkv, L.conv, run["conv"])          # window updated in place
        else:
            if keep is not None:       # the window after token t: the last d_conv-1 inputs up to t
                xx = np.concatenate([run["conv"], qkv], axis=0)
                w = self.d_conv - 1
                for t in range(n):
                    keep["conv"][t] = xx[t + 1:t + 1 + w]
            y, window = gdn.causal_conv1d(qkv, L.conv, run["conv"])
            run["conv"][...] = window
        q = gdn.l2_norm(y[:, :self.key_dim].reshape(n, nk, dk))
        k = gdn.l2_norm(y[:, self.key_dim:2 * self.key_dim].reshape(n, nk, dk))
        v = self.xp.ascontiguousarray(y[:, 2 * self.key_dim:].reshape(n, nv, dv))
        beta = gdn.sigmoid(b).astype(np.float32)
        g = (L.a * gdn.softplus(a + L.dt)).astype(np.float32)
        q, k = q[:, self.kmap_x], k[:, self.kmap_x]
        if step:
            o, _ = gdn.delta_rule_recurrent(q, k, v, g, beta, run["ssm"], keep=None if keep is None else keep["ssm"])
        else:
            o, _ = gdn.delta_rule_chunked(q, k, v, g, beta, run["ssm"])
        return gdn.gated_rms_norm(o, L.ssm_norm, z, self.eps)

    def _gdn_batch(self, L: _Layer, x: np.ndarray, runs: list[dict]) -> np.ndarray:
        """One GDN layer for a batched step (CPU): row i is one token of the sequence whose running state is
        runs[i]. The input and output products run over all rows; the rest (_gdn_mix) row by row on each row's own
        state, with the shapes of a lone step, so row i's bits are those of that step."""
        n = x.shape[0]
        step = self.gdn_mode != "chunked"           # what a lone step of one token takes
        qkv, z, b, a = self._gdn_in(L, x, self.backend.to_host)
        o = np.concatenate([self._gdn_mix(L, qkv[i:i + 1], z[i:i + 1], b[i:i + 1], a[i:i + 1], run, None, True)
                            .reshape(1, self.nv * self.dv) for i, run in enumerate(runs)], axis=0)
        return self.backend.matmul(o.reshape(n, self.nv * self.dv), L.ssm_out)

    def _attn(self, L: _Layer, x: np.ndarray, positions: np.ndarray, kv: PagedKV | None, layer: int,
              attend=None) -> np.ndarray:
        """A gated attention layer over the rows of x at `positions`; attend(q, k, v, layer) (default: attention
        over kv) writes the rows' K/V and returns their attention (n, n_head, head_dim)."""
        be, c = self.backend, self.config
        n = x.shape[0]
        nh, nkv, hd = c.n_head, c.n_head_kv, c.head_dim
        qg = be.matmul(x, L.wq).reshape(n, nh, 2 * hd)
        q, gate = qg[:, :, :hd], qg[:, :, hd:]
        k = be.matmul(x, L.wk).reshape(n, nkv, hd)
        v = be.matmul(x, L.wv).reshape(n, nkv, hd)
        q = be.rms_norm(self.xp.ascontiguousarray(q), L.q_norm, self.eps)
        k = be.rms_norm(k, L.k_norm, self.eps)
        q = be.rope(q, positions, self.n_rot, c.rope_theta, True)
        k = be.rope(k, positions, self.n_rot, c.rope_theta, True)
        if attend is None:
            o = be.attention(q, k, v, kv, layer, self.scale).reshape(n, nh * hd)
        else:
            o = attend(q, k, v, layer).reshape(n, nh * hd)
        o = o * gdn.sigmoid(gate.reshape(n, nh * hd))
        return be.matmul(o, L.wo)

    def _ffn(self, F: _FFN, x: np.ndarray) -> np.ndarray:
        be = self.backend
        if F.dense is not None:
            g, u, d = F.dense
            return be.matmul(be.swiglu(be.matmul(x, g), be.matmul(x, u)), d)
        return moe_ffn(be, x, F.router, F.gate, F.up, F.down, self.n_expert_used, self.norm_topk,
                       F.shared, F.shared_gate)

    def _block(self, L: _Layer, il: int, x: np.ndarray, positions, state_kv: PagedKV, run, keep=None,
               cuts=None) -> np.ndarray:
        be = self.backend
        h = be.rms_norm(x, L.attn_norm, self.eps)
        if L.recurrent:
            x = x + (self._gdn_cut(L, h, run, cuts) if cuts else self._gdn(L, h, run, keep))
        else:
            x = x + self._attn(L, h, positions, state_kv, il)
        h = be.rms_norm(x, L.post_norm, self.eps)
        return x + self._ffn(L.ffn, h)

    # --- forward -----------------------------------------------------------------------------------
    def _check_tokens(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if tokens.shape[0] == 0:
            raise ValueError("forward() needs at least one token")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.n_vocab:
            raise ValueError(f"token id out of range [0, {self.config.n_vocab})")
        return tokens

    def _blocks(self, tokens: np.ndarray, state: SequenceState, lo: int, hi: int, x_in) -> Any:
        """Blocks [lo, hi) over `tokens` at state.pos (checked by _check_carve) -> the residual stream; commits
        and advances the sequence."""
        be = self.backend
        n = int(tokens.shape[0])
        kv = state.kv
        if kv is not None:
            kv.reserve(n)
        positions = np.arange(state.pos, state.pos + n, dtype=np.int64)
        x = be.embed(self.tok_embd, tokens) if lo == 0 else x_in
        steps = state.steps.layers if state.steps is not None else {}
        if state.steps is not None and (state.steps.base != state.pos or state.steps.n < n):
            raise ValueError(f"the kept states are armed for {state.steps.n} tokens at {state.steps.base}, "
                             f"the forward reads {n} at {state.pos}")
        cuts = marked_rows(state, n)
        for il in range(lo, hi):
            x = self._block(self.layers[il], il, x, positions, kv, state.running.get(il), steps.get(il),
                            [(r, at[il]) for r, at in cuts] if cuts and il in state.running else None)
        if kv is not None:
            kv.commit(n)
        state.advance(tokens)
        return x

    def forward_batch(self, tokens, states: list[SequenceState], lo: int, hi: int, x_in=None, hidden: bool = False):
        """See Model.forward_batch. On the CPU backend the weight products run over the N rows at once (exact per
        row, see LlamaModel.forward_batch); each row's attention reads its own sequence's pages, and each GDN layer
        runs the conv and the delta rule of each row on its own sequence's running state (_gdn_batch); a MoE FFN
        runs row by row. Other backends take the lone steps (Model.forward_batch)."""
        be = self.backend
        if self.on_device:
            return super().forward_batch(tokens, states, lo, hi, x_in, hidden=hidden)
        tokens = self._check_batch(tokens, states, lo, hi, x_in)
        for st in states:
            if st.kv is not None:
                st.kv.reserve(1)
        positions = np.asarray([st.pos for st in states], dtype=np.int64)
        attend = self._attend_rows(states, self.scale)
        x = be.embed(self.tok_embd, tokens) if lo == 0 else x_in
        for il in range(lo, hi):
            L = self.layers[il]
            h = be.rms_norm(x, L.attn_norm, self.eps)
            if L.recurrent:
                x = x + self._gdn_batch(L, h, [st.running[il] for st in states])
            else:
                x = x + self._attn(L, h, positions, None, il, attend)
            x = self._ffn_segments(L, x, [slice(i, i + 1) for i in range(x.shape[0])])
        out = self.head_rows(x, hidden) if self.ends_with_head(hi) else x
        for i, st in enumerate(states):
            if st.kv is not None:
                st.kv.commit(1)
            st.advance(tokens[i:i + 1])
        return out

    def _ffn_segments(self, L, x, segs: list[slice]):
        """x plus layer L's FFN of its post-normed rows, several sequences' rows in one array (segs: each one's
        rows): a dense FFN over every row at once (exact per row), a MoE FFN sequence by sequence (each routed as its
        own read routes it)."""
        h = self.backend.rms_norm(x, L.post_norm, self.eps)
        if L.ffn.dense is not None:
            return x + self._ffn(L.ffn, h)
        return x + np.concatenate([self._ffn(L.ffn, h[s]) for s in segs], axis=0)

    def verify_batch(self, token_lists, states: list[SequenceState], lo: int, hi: int, x_in=None):
        """See Model.verify_batch. On the CPU backend, up to ROWWISE_MAX_TOKENS rows in all, the weight products run
        over every sequence's rows at once (each row as its own verify's: exact per row), each sequence's attention
        over its own pages, each GDN layer's conv and delta rule on its own running state keeping its per-token
        states, a MoE FFN sequence by sequence. Other backends, more rows: the verifies one after the other."""
        be = self.backend
        lens = [len(t) for t in token_lists]
        total = sum(lens)
        if self.on_device or len(states) < 2 or total > ROWWISE_MAX_TOKENS:
            return super().verify_batch(token_lists, states, lo, hi, x_in)
        if len({id(st) for st in states}) != len(states) or len(token_lists) != len(states):
            raise ValueError("a batched verify reads each sequence at most once, with its own tokens")
        segs, at = [], 0
        for n in lens:
            segs.append(slice(at, at + n))
            at += n
        toks = [self._check_carve(t, st, lo, hi, None if x_in is None else x_in[s])
                for t, st, s in zip(token_lists, states, segs)]
        for t, st in zip(toks, states):
            steps = st.steps
            if steps is None or steps.base != st.pos or steps.n < len(t):
                raise ValueError("a batched verify reads sequences armed to keep their per-token states (keep)")
        for st, n in zip(states, lens):
            if st.kv is not None:
                st.kv.reserve(n)
        positions = np.concatenate([np.arange(st.pos, st.pos + n, dtype=np.int64) for st, n in zip(states, lens)])
        x = be.embed(self.tok_embd, np.concatenate(toks)) if lo == 0 else x_in

        def attend(q, k, v, il):
            return np.concatenate([be.attention(q[s], k[s], v[s], st.kv, il, self.scale)
                                   for s, st in zip(segs, states)], axis=0)

        nvd = self.nv * self.dv
        for il in range(lo, hi):
            L = self.layers[il]
            h = be.rms_norm(x, L.attn_norm, self.eps)
            if L.recurrent:
                qkv, z, b, a = self._gdn_in(L, h, be.to_host)
                o = np.concatenate([self._gdn_mix(L, qkv[s], z[s], b[s], a[s], st.running[il],
                                                  st.steps.layers.get(il), True).reshape(-1, nvd)
                                    for s, st in zip(segs, states)], axis=0)
                x = x + be.matmul(o, L.ssm_out)
            else:
                x = x + self._attn(L, h, positions, None, il, attend)
            x = self._ffn_segments(L, x, segs)
        out = self.head_rows(x, hidden=True) if self.ends_with_head(hi) else x
        for t, st, n in zip(toks, states, lens):
            if st.kv is not None:
                st.kv.commit(n)
            st.advance(t)
        return out

    def forward_hidden(self, tokens: np.ndarray, state: SequenceState) -> np.ndarray:
        """Read tokens at state.pos and return the final-normed hidden states float32 (n_tokens, n_embd) (the
        LM head's input and the MTP head's ``h``). Advances the sequence like ``forward``."""
        tokens = self._check_carve(tokens, state, 0, self.n_layer, None)
        return self.backend.rms_norm(self._blocks(tokens, state, 0, self.n_layer, None), self.out_norm, self.eps)

    def forward_carve(self, tokens, state: SequenceState, lo: int, hi: int, x_in=None, all_logits: bool = False,
                      hidden: bool = False):
        """See Model.forward_carve. hidden (a carve ending with the head): return (logits, the final-normed hidden
        states of every row, the MTP head's ``h``). Raises ValueError (changing nothing) for an empty batch, an
        out-of-vocab id or a bad carve, and KVCacheFull when the page pool cannot hold the new tokens."""
        tokens = self._check_carve(tokens, state, lo, hi, x_in)
        x = self._blocks(tokens, state, lo, hi, x_in)
        if not self.ends_with_head(hi):
            return x
        if hidden:
            return self.head_hidden(x, all_logits)
        return self.head(x, all_logits)

    # --- MTP drafter -------------------------------------------------------------------------------
    def new_mtp_pool(self, n_ctx: int, n_seq: int = 1, page_size: int = DEFAULT_PAGE_SIZE) -> PagePool:
        """A page pool for the MTP block's attention K/V (layer n_layer), room for n_seq x n_ctx positions."""
        if self.mtp is None:
            raise ValueError("this model has no MTP layer (nextn_predict_layers = 0)")
        c = self.config
        n_pages = n_seq * max(1, -(-int(n_ctx) // page_size))
        return self.backend.new_page_pool([self.n_layer], n_pages, c.n_head_kv, c.head_dim, page_size=page_size)

    def new_mtp_kv(self, n_ctx: int, page_size: int = DEFAULT_PAGE_SIZE) -> PagedKV:
        """A page table over its own pool for the MTP block's attention K/V, room for n_ctx positions."""
        return PagedKV(self.new_mtp_pool(n_ctx, 1, page_size))

    def mtp_logits(self, hidden: np.ndarray, next_tokens: np.ndarray, mtp_kv: PagedKV) -> np.ndarray:
        """Draft logits from the MTP head: for each position p (= mtp_kv.length + i) the final-normed hidden
        state h_p (``forward_hidden``) and the token at p + 1 give logits for the token at p + 2.

        hidden float32 (n, n_embd); next_tokens int (n,); the MTP block's K/V for these positions are appended to
        mtp_kv (positions must be fed in order, as the main model read them). Returns float32 (n, n_vocab).
        Formula (llama.cpp graph_mtp; vLLM Qwen3NextMultiTokenPredictor):
        x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)]); x = block(x); logits = head(shared_head_norm(x)).
        """
        x = self.mtp_hidden(hidden, next_tokens, mtp_kv)
        return self.mtp_head(x)

    def _mtp_input(self, hidden, next_tokens, mtp_kv: PagedKV):
        """The MTP block's input rows eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)]) and their positions (from
        mtp_kv.length, pages reserved for them)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP layer (nextn_predict_layers = 0)")
        be, m = self.backend, self.mtp
        toks = self._check_tokens(next_tokens)
        hidden = self.xp.asarray(hidden, dtype=np.float32).reshape(-1, self.config.n_embd)
        if hidden.shape[0] != toks.shape[0]:
            raise ValueError(f"mtp_logits: {hidden.shape[0]} hidden states for {toks.shape[0]} tokens")
        n = toks.shape[0]
        mtp_kv.reserve(n)
        positions = np.arange(mtp_kv.length, mtp_kv.length + n, dtype=np.int64)
        e = be.embed(m["embed"] if m["embed"] is not None else self.tok_embd, toks)
        x = self.xp.concatenate([be.rms_norm(e, m["enorm"], self.eps), be.rms_norm(hidden, m["hnorm"], self.eps)],
                                axis=1)
        return be.matmul(self.xp.ascontiguousarray(x), m["eh_proj"]), positions

    def mtp_hidden(self, hidden: np.ndarray, next_tokens: np.ndarray, mtp_kv: PagedKV) -> np.ndarray:
        """The MTP block's half of ``mtp_logits``: appends the positions' K/V to mtp_kv and returns the block's
        output after ``shared_head_norm`` (n, n_embd), which ``mtp_head`` turns into draft logits (and which a
        drafter feeds back as the next position's ``h`` when it drafts past the main model's hidden states)."""
        m = self.mtp
        x, positions = self._mtp_input(hidden, next_tokens, mtp_kv)
        x = self._block(m["block"], self.n_layer, x, positions, mtp_kv, None)
        x = self.backend.rms_norm(x, m["head_norm"] if m["head_norm"] is not None else self.out_norm, self.eps)
        mtp_kv.commit(x.shape[0])
        return x

    def mtp_kv(self, hidden: np.ndarray, next_tokens: np.ndarray, mtp_kv: PagedKV) -> None:
        """``mtp_hidden``'s K/V alone: the positions' K/V appended to mtp_kv, the same values (the block's K/V at a
        position depends on its own input row only), without the rows' attention output, FFN and head norm, which
        only a row drafted from needs (a drafter catching up the positions before the one it drafts from). The
        attention still runs, with zero queries (the backends write K/V inside their attention op)."""
        be, c, L = self.backend, self.config, self.mtp["block"]
        x, positions = self._mtp_input(hidden, next_tokens, mtp_kv)
        n = x.shape[0]
        h = be.rms_norm(x, L.attn_norm, self.eps)
        k = be.rms_norm(be.matmul(h, L.wk).reshape(n, c.n_head_kv, c.head_dim), L.k_norm, self.eps)
        v = be.matmul(h, L.wv).reshape(n, c.n_head_kv, c.head_dim)
        k = be.rope(k, positions, self.n_rot, c.rope_theta, True)
        be.attention(self.xp.zeros((n, c.n_head, c.head_dim), np.float32), k, v, mtp_kv, self.n_layer, self.scale)
        mtp_kv.commit(n)

    def mtp_head(self, x: np.ndarray, on_device: bool = False) -> np.ndarray:
        """Draft logits (host float32 (n, n_vocab); on_device: in the backend's array module) from ``mtp_hidden``'s
        rows."""
        m = self.mtp
        logits = self.backend.matmul(x, m["head"] if m["head"] is not None else self.output)
        return logits if on_device else self.backend.to_host(logits)


def _f32(name: str, a: np.ndarray) -> WeightTensor:
    from gguf import GGMLQuantizationType
    a = np.ascontiguousarray(a, dtype=np.float32)
    return WeightTensor(name, GGMLQuantizationType.F32, a.shape, a)
