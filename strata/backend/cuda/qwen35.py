"""How strata/models/qwen3next.py's layers execute on a GPU: Qwen35Cuda, the hybrid qwen35 / qwen3next family's
DecodePlan (dense or MoE FFN): GDN and gated-attention layers as fused launches in one captured graph per context-size class,
and their prefill through cuBLAS, the delta-rule kernels and FlashAttention-2.

Per layer (native/cuda/qwen35.cu for the ``strata_q35_*`` kernels, the rest shared with the llama plan):

* GDN layer: one matvec over the fused [attn_qkv | attn_gate | ssm_beta | ssm_alpha] (or ``ssm_ba``) rows on the
  q8_1 activations of the RMSNorm -> ``strata_q35_conv`` (causal conv + SiLU, window in place) ->
  ``strata_q35_gdn_step`` (L2-normalised q/k, beta = sigmoid(b), g = ssm_a * softplus(alpha + dt), the gated delta
  rule on the ssm state in place) -> ``strata_q35_gated_norm`` (RMSNorm(o) * ssm_norm * silu(z), q8_1 out) ->
  ``ssm_out`` matvec.
* Attention layer: fused [attn_q | attn_k | attn_v] matvec -> ``strata_q35_attn_prep`` (per-head q/k RMSNorm, gate
  split off) -> ``strata_rope_kv_decode`` (partial-rotary NeoX RoPE + K/V write into the sequence's CudaPagePool
  pages) -> ``strata_attn_decode_gqa`` -> ``strata_q35_out_gate`` (att * sigmoid(gate), q8_1 out) -> attn_output
  matvec.
* The residual add fused into the next RMSNorm and the dense SwiGLU FFN: DecodePlan's blocks (``_layer_end``,
  ``_ffn``; SwiGLU inside the gate/up matvec only with STRATA_CUDA_GLU=1: it measured slower in this graph).
* MoE FFN (qwen35moe, qwen3next): strata/backend/cuda/moe.py's launches (router matvec, ``strata_moe_route`` top-k
  and shared gate, ``strata_moe_gate_up`` / ``strata_moe_down`` for the k routed experts through the layer's device
  expert tables, the shared expert riding along as their last slot where it has the experts' types, else its own
  matvecs); prefill grouped by expert on the device (``moe.prefill``).
* Final RMSNorm, output matvec, device argmax into ``inp[0]``, position / length + 1 (``DecodePlan._head``).

Running state: a captured graph has fixed addresses, so the plan owns one conv / ssm buffer per GDN layer and
makes the sequence it decodes *resident* (``ResidentState``): its ``state.running[layer]`` entries become the
plan's buffers (their contents copied in), and the previously resident sequence gets copies of the buffers back.
Everything that updates a running state in place (the model's generic prefill, ``SequenceState.restore`` /
``reset``) then works on the buffers unchanged.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from strata.backend.cuda import moe, settings
from strata.backend.cuda.attention import prefill_attention
from strata.backend.cuda.gdn import VARIANTS
from strata.backend.cuda.library import addr, check, ffi, lib, ptr, stream_ptr
from strata.backend.cuda.runner import DecodePlan, PlanModel, q8_buffer
from strata.memory.sequence_state import marked_rows
from strata.backend.cuda.settings import ATTN_HEAD_DIMS, FLASH_HEAD_DIMS, fa2_splits, gqa_resident, n_split_class
from strata.backend.cuda.weights import DeviceWeight, fuse_groups, glu_pointers
from strata.memory import Carve

L2_EPS = 1e-6            # gdn.l2_norm's default eps (the model's q/k normalisation)


def unsupported(model, lo: int = 0, hi: int | None = None) -> str | None:
    """Why Qwen35Cuda cannot run the carve [lo, hi) of `model` (hi None: to the last block; one line), or None if it
    can."""
    if getattr(model, "arch", None) != "qwen3next" or not hasattr(model, "recurrent"):
        return f"architecture {getattr(model, 'arch', None)!r} is not a qwen3next / qwen35 hybrid"
    moe_layers = bool(getattr(model, "moe", False))
    if moe_layers:
        why = moe.unsupported(model, settings.DP4A)
        if why:
            return f"MoE FFN layers ({getattr(model, 'variant', '?')}, {model.n_expert} experts): {why}"
    c = model.config
    E, H, KV, hd = c.n_embd, c.n_head, c.n_head_kv, c.head_dim
    hi = model.n_layer if hi is None else hi
    recurrent = model.recurrent[lo:hi]                    # the carve's layers
    if E % 32:
        return f"n_embd {E} is not a multiple of 32 (q8_1 activation blocks)"
    if any(not r for r in recurrent):
        if hd not in ATTN_HEAD_DIMS:
            return f"attention head_dim {hd} (needs 32, 64, 128 or 256)"
        if H % KV or H // KV > 8:
            return f"{H} query heads over {KV} KV heads (needs a multiple, at most 8 per KV head)"
        if model.n_rot > hd or model.n_rot % 2:
            return f"rope dimension count {model.n_rot} with head_dim {hd}"
    if any(recurrent):
        if model.dk > 256:
            return f"GDN key head dim d_k {model.dk} (at most 256)"
        if model.dv % 32:
            return f"GDN value head dim d_v {model.dv} is not a multiple of 32 (q8_1 blocks per head)"
        if not 2 <= model.d_conv <= 8:
            return f"GDN conv kernel {model.d_conv} outside [2, 8]"
    if not moe_layers and c.n_ff % 32:
        return f"n_ff {c.n_ff} is not a multiple of 32 (q8_1 activation blocks)"
    # the embeddings only in the first stage, the output head only in the last
    if not getattr(model, "on_device", False) or lo == 0 and not isinstance(model.tok_embd, DeviceWeight) \
            or hi == model.n_layer and not isinstance(model.output, DeviceWeight):
        return "weights are not on the CUDA backend"
    return None


class ResidentState:
    """The plan's fixed-address running-state buffers and which sequence they currently hold.

    buffers: layer -> {"conv": array, "ssm": array} (float32, numpy or CuPy). ``attach(state)`` makes `state`
    resident: the previously resident sequence's entries that are the buffers get copies of them (its state as of
    now), `state`'s arrays are copied into the buffers and its ``state.running[layer][name]`` entries become the
    buffers. Raises ValueError, changing nothing, when `state`'s running-state layout differs. The copies run on
    the array module's current stream (CuPy) in program order."""

    def __init__(self, buffers: dict[int, dict[str, Any]]):
        self.buf = buffers
        self._owner: Any = None               # weakref to the resident SequenceState

    def owner(self):
        """The resident SequenceState, or None."""
        return self._owner() if self._owner is not None else None

    def is_resident(self, state) -> bool:
        """Whether every running-state array of `state` is one of the plan's buffers (identity, not equality)."""
        r = state.running
        return all(r.get(layer, {}).get(k) is b for layer, parts in self.buf.items() for k, b in parts.items())

    def check(self, state) -> None:
        """ValueError unless state.running has the buffers' layers, names, shapes and float32."""
        r = state.running
        for layer, parts in self.buf.items():
            for k, b in parts.items():
                a = r.get(layer, {}).get(k)
                if a is None or tuple(a.shape) != tuple(b.shape) or a.dtype != np.float32:
                    have = "missing" if a is None else f"{a.dtype} {tuple(a.shape)}"
                    raise ValueError(f"running state {layer}/{k} is {have}, the plan needs float32 {tuple(b.shape)}")

    def attach(self, state) -> bool:
        """Make `state` resident (see the class docstring); returns False when it already was."""
        if self.is_resident(state):
            self._owner = weakref.ref(state)
            return False
        self.check(state)
        old = self.owner()
        if old is not None and old is not state:
            for layer, parts in self.buf.items():
                for k, b in parts.items():
                    if old.running.get(layer, {}).get(k) is b:
                        old.running[layer][k] = b.copy()
        for layer, parts in self.buf.items():
            for k, b in parts.items():
                a = state.running[layer][k]
                if a is not b:
                    b[...] = a
                    state.running[layer][k] = b
        self._owner = weakref.ref(state)
        return True

    def detach(self) -> None:
        """Give the resident sequence copies of the buffers (nothing is resident afterwards)."""
        old = self.owner()
        if old is not None:
            for layer, parts in self.buf.items():
                for k, b in parts.items():
                    if old.running.get(layer, {}).get(k) is b:
                        old.running[layer][k] = b.copy()
        self._owner = None


class Qwen35Cuda(DecodePlan):
    """The CUDA decode plan of Qwen3NextModel (dense or MoE FFN; see the module docstring for the launches).

    It reads the model's uploaded tensors (matrices of one GGML type fused at init: GDN [attn_qkv | attn_gate |
    ssm_beta | ssm_alpha] or [.. | ssm_ba], attention [attn_q | attn_k | attn_v], FFN [gate | up]; a fused copy
    costs the device memory of its parts once more) and config, and the sequence's CudaPagePool pages (f16 or
    q8_0). Numerics: matvecs on int8 q8_1 activations for the types strata_matvec_q8w supports (settings.DP4A off,
    or F16/F32 weights: f32 activations through strata_matvec), everything else f32 (the same as the generic path
    on the CUDA backend, whose one-token matmuls also take q8_1 activations).

    ``decode(token, state)`` = model.forward([token], state) -> host f32 logits (n_vocab,) (same errors: ValueError
    for a bad token / foreign pool / KV length mismatch / running-state layout, KVCacheFull from kv.reserve, each
    changing nothing); ``decode_device`` leaves them on the device; ``decode_greedy(first, n, state)`` feeds the
    device argmax back n times (benchmarks, tests). ``use_graphs`` (default: settings.graphs_enabled()) captures one
    graph per context-size class (``size_class``) or launches eagerly.

    Timing (what bench/ should do): build ``Qwen35Cuda(model, pool)`` (or ``Qwen35GraphModel(model).plan(pool)``),
    prefill the prompt with model.forward, call ``decode_greedy(tok, 8, st)`` once as warm-up (graph capture), then
    ``cupy.cuda.Device().synchronize()``, time ``decode_greedy(tok, n, st)`` (it returns after the tokens reached
    the host), and report n / seconds; for the engine-like path time ``Qwen35GraphModel.forward([tok], st)`` calls
    (host logits per token).

    ``lo``, ``hi``: the carve, the layers [lo, hi) a pipeline stage runs (default all but the MTP block; ``first`` /
    ``last``: it holds the embeddings / the final norm and output head), as for cuda.LlamaCuda: ``x_in`` the hidden
    states a stage after the first starts from, hidden states instead of logits from a stage before the last; the
    running-state buffers and fused weights are the carve's layers' only.
    """

    label = "qwen35 CUDA decode plan"

    def __init__(self, model, pool, use_graphs: bool | None = None, lo: int = 0, hi: int | None = None):
        super().__init__(model, pool, use_graphs, lo, hi)
        cp = self.cp
        H, KV, hd = self.n_head, self.n_kv, self.hd
        nq, kvd = H * hd, KV * hd
        recurrent = model.recurrent[self.lo:self.hi]
        if any(recurrent):
            conv_dim, vdim, nv = model.conv_dim, model.value_dim, model.nv
            self.d.update({
                "proj": cp.zeros(conv_dim + vdim + 2 * nv, cp.float32), "y": cp.zeros(conv_dim, cp.float32),
                "ov": cp.zeros(vdim, cp.float32), "vn": cp.zeros(vdim, cp.float32), "vq": q8_buffer(cp, vdim)})
        if not all(recurrent):
            self._attention_buffers()
            self.d.update({"qg": cp.zeros(2 * nq + 2 * kvd, cp.float32), "gate": cp.zeros(nq, cp.float32),
                           "an": cp.zeros(nq, cp.float32)})
        # fused weights per layer: lists of (weight, row offset, n_out) into the layer's output buffer
        self.w_in: dict[int, list] = {}
        self.w_gu: dict[int, list] = {}
        self.moe: dict[int, moe.MoeLayer] = {}            # MoE FFN layers: expert tables, shared expert
        if model.moe:
            self.d.update(moe.decode_buffers(cp, model, q8_buffer))
        for li in range(self.lo, self.hi):
            L = model.layers[li]
            if L.recurrent:
                tail = [L.w_ba] if L.w_ba is not None else [L.w_beta, L.w_alpha]
                self.w_in[li] = fuse_groups(f"blk.{li}.gdn_in", [L.wqkv, L.wz] + tail)
            else:
                self.w_in[li] = fuse_groups(f"blk.{li}.attn_qkv", [L.wq, L.wk, L.wv])
            if L.ffn.dense is None:
                self.moe[li] = moe.MoeLayer(li, L.ffn, model)
                continue
            g, u, _ = L.ffn.dense
            self.w_gu[li] = fuse_groups(f"blk.{li}.ffn_gate_up", [g, u])
        if self.moe:
            lis = sorted(self.moe)
            for li, m in self.moe.items():
                m.first, m.last = li == lis[0], li == lis[-1]
        # the expert tier's rounds tick with the decode steps of the plan holding its first layer
        tier = next((m.tier for m in self.moe.values() if m.tier is not None), None)
        self.tier = tier if tier is not None and tier.store.layers[0] in self.moe else None
        # the running state of the carve's GDN layers (a stage's state.running holds those only)
        self.resident = ResidentState(model.new_running_state(Carve(self.lo, self.hi)))
        # a verify's kept states: per GDN layer two device pointers (conv, ssm) that the short read's keep launches
        # read: the armed sequence's kept slots (state.steps, owned by its memory), or 0 (nothing kept)
        self.keep_index = {li: k for k, li in enumerate(sorted(self.resident.buf))}
        self.d["keep"] = cp.zeros(max(1, 2 * len(self.keep_index)), cp.uint64)
        self._keep_src: Any = None                         # the kept slots d['keep'] points at now (None: none)
        self._kept_ok: tuple = (None, 0)                   # kept slots checked last, and how many rows they hold

    @staticmethod
    def unsupported(model, lo: int = 0, hi: int | None = None) -> str | None:
        """Why the plan cannot run the carve [lo, hi) of `model` (one line), or None (module function
        ``unsupported``)."""
        return unsupported(model, lo, hi)

    def takes_prefill(self, n: int) -> bool:
        """Every forward of more than one token goes through ``prefill`` (f16 GEMMs; for more than the backend's GEMM
        threshold, 8, the same GEMMs as the model's forward, bit-identical logits measured on the H200). Short ones
        too: a chat's later turn is read in parts ending at its cut points, and a part of a few tokens through the
        model's own forward (f32-activation matvecs, dozens of launches per layer) made a live continuation with
        checkpoints 3-4x slower than without on the H200 (docs/checkpoints.md)."""
        return n > 1

    def _launch(self, length: int) -> None:
        """One decode step (DecodePlan._launch), then the expert tier's step (finished swaps take effect; a round
        every --adapt-every tokens), between graph replays."""
        super()._launch(length)
        if self.tier is not None:
            self.tier.store.step(1)

    def _check_state(self, state) -> None:
        self.resident.check(state)

    def _attach(self, state) -> None:
        self.resident.attach(state)                           # copies on the current stream

    def _step_args(self, size_class: int) -> tuple:
        return (n_split_class(size_class, self.n_kv, self.n_sm,
                              gqa_resident(self.hd, self.n_head // max(1, self.n_kv), self.pool.kv == "q8_0")),)

    # ---- the decode step
    def _enqueue_step(self, n_split: int, graph: bool = False) -> None:
        """One decode step (DecodePlan._enqueue_step), n_split partitions of the decode attention."""
        m, d = self.model, self.d
        s = stream_ptr()
        tok_p, pos_p, len_p = self._inp()
        self._embed_row(s, tok_p)
        self._norm(s, d["x"], m.layers[self.lo].attn_norm)
        glu_on = self.dp4a and settings.GLU_HYBRID
        for li in range(self.lo, self.hi):
            L = m.layers[li]
            if L.recurrent:
                self._gdn(s, li, L)
            else:
                self._attn(s, li, L, pos_p, len_p, n_split)
            self._norm(s, d["o"], L.post_norm, residual=d["x"])
            if li in self.moe:
                moe.decode(self, s, self.moe[li])
            else:
                glu = glu_pointers([w for w, _, _ in self.w_gu[li]], self.n_ff, self.n_embd) if glu_on else None
                self._ffn(s, self.w_gu[li], L.ffn.dense[2], glu)
            self._layer_end(s, li, L.post_norm)
        self._head(s, tok_p, pos_p)

    def _gdn(self, s, li: int, L) -> None:
        """GDN layer li: fused in-projection, conv, delta-rule step, gated norm, ssm_out into d['o']."""
        lb, d, m = lib(), self.d, self.model
        E = self.n_embd
        conv_dim, vdim, nv, nk, dk, dv = m.conv_dim, m.value_dim, m.nv, m.nk, m.dk, m.dv
        buf = self.resident.buf[li]
        proj = d["proj"]
        self._mv(s, self.w_in[li], proj, d["hn"], d["hq"], E)
        check(lb.strata_q35_conv(s, ptr(proj), ptr(L.conv), ptr(buf["conv"]), ptr(d["y"]), conv_dim, m.d_conv),
              "strata_q35_conv")
        b_off = conv_dim + vdim
        check(lb.strata_q35_gdn_step(s, ptr(d["y"]), ptr(proj), ptr(L.a), ptr(L.dt), ptr(buf["ssm"]), ptr(d["ov"]), nv,
                                     nk, dk, dv, int(bool(m.tiled)), b_off, b_off + nv, int(L.w_ba is not None),
                                     float(1.0 / dk ** 0.5), L2_EPS), "strata_q35_gdn_step")
        check(lb.strata_q35_gated_norm(s, ptr(d["ov"]), ptr(proj, conv_dim), ptr(L.ssm_norm), ptr(d["vn"]),
                                       self._qp("vq"), nv, dv, self.eps), "strata_q35_gated_norm")
        self._mv(s, [(L.ssm_out, 0, E)], d["o"], d["vn"], d["vq"], vdim)

    def _attn(self, s, li: int, L, pos_p, len_p, n_split: int) -> None:
        """Gated attention layer li: fused q|gate/k/v matvec, q/k norm, RoPE + K/V write, GQA decode attention,
        output gate, attn_output into d['o']."""
        lb, d, pool = lib(), self.d, self.pool
        E, H, KV, hd = self.n_embd, self.n_head, self.n_kv, self.hd
        nq, kvd = H * hd, KV * hd
        NULL = ffi().NULL
        slot = pool.slot(li)
        kc, vc = pool.k[slot], pool.v[slot]
        ks, vs = pool.scales(slot)
        pt = pool._pt
        qkv = d["qkv"]
        self._mv(s, self.w_in[li], d["qg"], d["hn"], d["hq"], E)
        check(lb.strata_q35_attn_prep(s, ptr(d["qg"]), ptr(L.q_norm), ptr(L.k_norm), ptr(qkv), ptr(d["gate"]), 1, H,
                                      KV, hd, self.eps), "strata_q35_attn_prep")
        if ks is None:
            check(lb.strata_rope_kv_decode(s, ptr(qkv), pos_p, ptr(kc), ptr(vc), ptr(pt), H, KV, hd, self.n_rot,
                                           self.theta, 1, pool.page_size), "strata_rope_kv_decode")
        else:   # q8_0 cache: RoPE in place, then the K/V rows quantized into the cache
            check(lb.strata_rope_kv_decode(s, ptr(qkv), pos_p, NULL, NULL, ptr(pt), H, KV, hd, self.n_rot,
                                           self.theta, 1, pool.page_size), "strata_rope_kv_decode")
            check(lb.strata_kv_write_q8(s, ptr(qkv, nq), nq + 2 * kvd, ptr(qkv, nq + kvd), nq + 2 * kvd, ptr(kc),
                                        ptr(vc), ptr(ks), ptr(vs), ptr(pt), pos_p, 0, 1, KV, hd, pool.page_size),
                  "strata_kv_write_q8")
        ctr = ffi().cast("unsigned *", d["counters"].data.ptr)
        check(lb.strata_attn_decode_gqa(s, ptr(qkv), ptr(kc), ptr(vc), ptr(pt), len_p, 0, ptr(d["partial"]), ctr,
                                        ptr(d["att"]), NULL, H, KV, hd, pool.page_size, n_split, self.scale,
                                        ptr(ks), ptr(vs)), "strata_attn_decode_gqa")
        check(lb.strata_q35_out_gate(s, ptr(d["att"]), ptr(d["gate"]), ptr(d["an"]), NULL, self._qp("aq"), nq),
              "strata_q35_out_gate")
        self._mv(s, [(L.wo, 0, E)], d["o"], d["an"], d["aq"], nq)

    # ---- the short read
    def short_form(self) -> str | None:
        """'decode': the hybrid step has one form, mirrored column by column (DecodePlan.short_read); None for a
        model with MoE layers, whose launches have no column form yet (a short read there is decode steps one token
        at a time: the same bits; a prompt read takes the grouped prefill)."""
        return None if self.moe else "decode"

    def _enqueue_short(self, form: str, n: int, rows: tuple, all_logits: bool, graph: bool = False) -> None:
        """The decode step (_enqueue_step) over n columns: the matvecs through the column launchers, the per-token
        kernels (norms, conv, the GDN step, gates, RoPE, attention, SwiGLU) once per row in row order (the conv
        window and the ssm state advance one token at a time)."""
        m = self.model
        s = stream_ptr()
        self._cols_embed(s, n)
        self._cols_norm(s, n, "x", m.layers[self.lo].attn_norm)
        glu_on = self.dp4a and settings.GLU_HYBRID
        for li in range(self.lo, self.hi):
            L = m.layers[li]
            if L.recurrent:
                self._cols_gdn(s, n, li, L)
            else:
                self._cols_attn(s, n, li, L, rows)
            self._cols_norm(s, n, "o", L.post_norm, residual="x")
            glu = glu_pointers([w for w, _, _ in self.w_gu[li]], self.n_ff, self.n_embd) if glu_on else None
            self._cols_ffn(s, n, self.w_gu[li], L.ffn.dense[2], glu)
            self._cols_layer_end(s, n, li, L.post_norm)
        self._cols_head(s, n, all_logits)

    def _cols_gdn(self, s, n: int, li: int, L) -> None:
        """_gdn over n columns: the fused in-projection over the columns, the conv, the GDN step and the gated norm
        of every row (each launch runs the rows in order), ssm_out over the columns."""
        lb, m = lib(), self.model
        E = self.n_embd
        conv_dim, vdim, nv, nk, dk, dv = m.conv_dim, m.value_dim, m.nv, m.nk, m.dk, m.dv
        buf = self.resident.buf[li]
        self._cols_mv(s, self.w_in[li], "proj", "hn", "hq", E, n)
        c = self.c
        P = c["proj"].shape[1]
        b_off = conv_dim + vdim
        # where a verify keeps each row's window and state: the pointers at d['keep'] (0: nothing kept)
        kt = self.d["keep"].data.ptr + 16 * self.keep_index[li]
        keep_conv, keep_ssm = (ffi().cast("float *const *", kt + 8 * i) for i in range(2))
        # the rows one after the other inside each launch (the conv window and the ssm state advance per token)
        check(lb.strata_q35_conv_rows_keep(s, self._col("proj", 0), P, ptr(L.conv), ptr(buf["conv"]),
                                           self._col("y", 0), conv_dim, n, conv_dim, m.d_conv, keep_conv,
                                           int(buf["conv"].size)), "strata_q35_conv_rows_keep")
        check(lb.strata_q35_gdn_steps_keep(s, self._col("y", 0), conv_dim, self._col("proj", 0), P, ptr(L.a),
                                           ptr(L.dt), ptr(buf["ssm"]), self._col("ov", 0), vdim, n, nv, nk, dk, dv,
                                           int(bool(m.tiled)), b_off, b_off + nv, int(L.w_ba is not None),
                                           float(1.0 / dk ** 0.5), L2_EPS, keep_ssm, int(buf["ssm"].size)),
              "strata_q35_gdn_steps_keep")
        check(lb.strata_q35_gated_norm_rows(s, self._col("ov", 0), vdim, addr(c["proj"].data.ptr + 4 * conv_dim), P,
                                            ptr(L.ssm_norm), self._col("vn", 0), vdim, self._col_q("vq", 0),
                                            self.cstride["vq"], n, nv, dv, self.eps), "strata_q35_gated_norm_rows")
        self._cols_mv(s, [(L.ssm_out, 0, E)], "o", "vn", "vq", vdim, n)

    def _kept_slots(self, state) -> dict | None:
        """`state`'s kept slots (state.steps.layers: layer -> {"conv", "ssm"} CuPy f32 (k, ...) of this device),
        checked against the plan's running-state buffers; None when it keeps nothing. ValueError for slots the
        launches cannot write."""
        steps = state.steps
        if steps is None or not self.keep_index:
            return None
        if self._kept_ok[0] is steps.layers and self._kept_ok[1] >= steps.n:
            return steps.layers                           # the memory reuses a sequence's slots: checked before
        cp = self.cp
        dev = self.model.backend.device_id
        for li, parts in self.resident.buf.items():
            for k, b in parts.items():
                a = steps.layers.get(li, {}).get(k)
                if not isinstance(a, cp.ndarray) or a.dtype != np.float32 or tuple(a.shape[1:]) != tuple(b.shape) \
                        or a.shape[0] < steps.n or not a.flags.c_contiguous or a.device.id != dev:
                    have = "missing" if a is None else f"{type(a).__name__} {getattr(a, 'dtype', '?')} " \
                                                       f"{tuple(getattr(a, 'shape', ()))}"
                    raise ValueError(f"kept state {li}/{k} is {have}; the plan writes CuPy float32 "
                                     f"({steps.n},) + {tuple(b.shape)} on device {dev}")
        self._kept_ok = (steps.layers, min(int(a.shape[0]) for parts in steps.layers.values() for a in parts.values()))
        return steps.layers

    def _check_keep(self, state, n: int) -> None:
        super()._check_keep(state, n)
        self._kept_slots(state)

    def _keep_table(self, state) -> None:
        """d['keep'] = the kept slots' addresses of an armed sequence (conv, ssm per GDN layer), else zeros; copied
        only when they change (on the current stream, before the launches read them)."""
        slots = self._kept_slots(state)
        if slots is self._keep_src:
            return
        tab = np.zeros(self.d["keep"].size, np.uint64)
        if slots is not None:
            tab[:] = [slots[li][k].data.ptr for li in sorted(self.keep_index) for k in ("conv", "ssm")]
        self.d["keep"].set(tab, stream=self.cp.cuda.get_current_stream())
        self._keep_src = slots

    def _keep_steps(self, state, i: int) -> None:
        """The running state after a short read's step i into its kept slot (device copies)."""
        slots = self._kept_slots(state)
        if slots is None:
            return
        for li, parts in self.resident.buf.items():
            for k in parts:
                slots[li][k][i] = state.running[li][k]

    def _cols_attn(self, s, n: int, li: int, L, rows: tuple, tables: tuple[int, int] | None = None) -> None:
        """_attn over n columns, row i's attention with the split of its own decode step (rows[i]): the prologue
        (norms, RoPE, K/V write) of every row, the attention of all rows (_cols_attn_rows), the output gates.
        tables: one page table per column (a batched step of n sequences; None: the plan's one sequence)."""
        lb, pool = lib(), self.pool
        E, H, KV, hd = self.n_embd, self.n_head, self.n_kv, self.hd
        nq = H * hd
        slot = pool.slot(li)
        kc, vc = pool.k[slot], pool.v[slot]
        ks, vs = pool.scales(slot)
        self._cols_mv(s, self.w_in[li], "qg", "hn", "hq", E, n)
        # the q / k norms and the gate split of every row (a block per head and row, rows back to back)
        check(lb.strata_q35_attn_prep(s, self._col("qg", 0), ptr(L.q_norm), ptr(L.k_norm), self._col("qkv", 0),
                                      self._col("gate", 0), n, H, KV, hd, self.eps), "strata_q35_attn_prep")
        self._cols_rope_kv(s, n, "qkv", kc, vc, ks, vs, 1, tables)   # every row's K / V before any row attends
        self._cols_attn_rows(s, li, rows, "qkv", "att", None, tables)
        check(lb.strata_q35_out_gate_rows(s, self._col("att", 0), self._col("gate", 0), self._col("an", 0),
                                          self._col_q("aq", 0), self.cstride["aq"], n, nq),
              "strata_q35_out_gate_rows")
        self._cols_mv(s, [(L.wo, 0, E)], "o", "an", "aq", nq, n)

    def prefill(self, tokens, state, all_logits: bool = False, x_in=None, hidden: bool = False):
        """Qwen3NextModel.forward(tokens, state, all_logits) for n >= 1 tokens on the current stream -> host f32
        logits (n_vocab,) of the last token, or (n, n_vocab) with all_logits. Same errors (ValueError for an empty
        batch, a bad token, a foreign pool, a KV length mismatch or a running-state layout the plan cannot use;
        KVCacheFull from kv.reserve; each changing nothing) and bookkeeping (KV pages written, running state updated
        in place, sequence advanced).

        Per layer: RMSNorm writing f16 rows; one cuBLAS GEMM per fused weight group (f16 operands, f32 accumulate)
        into its columns of the layer's f32 projection; GDN: strata_gdn_conv on the projection's conv channels in
        place (window updated), strata_gdn_prep, strata_gdn_recurrent_ex (the warp kernel when the shape allows),
        strata_gdn_gated_norm_rows writing f16, the ssm_out GEMM adding into the residual (beta = 1); attention:
        strata_q35_attn_prep over the n rows, RoPE + K/V write (strata_rope_kv_prefill; q8_0 caches through
        strata_kv_write_q8), FlashAttention-2 (strata_fa2_prefill; head_dim 64 / 128, else cuda.prefill_attention),
        strata_q35_out_gate writing f16, the attn_output GEMM adding into the residual; FFN: gate|up GEMM,
        strata_swiglu_gu writing f16, down GEMM adding into the residual. Final RMSNorm and the output projection on
        the last row (all rows with all_logits).

        A carve: a stage after the first starts from x_in (CuPy f32 (n, n_embd) on the plan's device) instead of the
        embedding rows (the tokens are counted and recorded all the same); a stage before the last returns its hidden
        states, a CuPy f32 (n, n_embd) array of its own (all_logits unused). hidden (the last stage): (logits, the
        final-normed rows, CuPy f32 (n, n_embd)), for the MTP drafter."""
        cp, m, pf = self.cp, self.model, self.pf
        toks, x = self._prefill_begin(tokens, state, x_in)
        n = int(toks.shape[0])
        s = stream_ptr()
        pos0 = int(state.pos)
        hE = pf.buf("hE", (n, self.n_embd), cp.float16)
        pt = self.pool.table(state.kv.pages) if not all(m.recurrent[self.lo:self.hi]) else None
        gu, act16 = self._prefill_ffn_buffers(n) if self.w_gu else (None, None)   # dense FFN layers only
        cuts = marked_rows(state, n)          # checkpoints inside this read (Memory.mark): states kept at rows
        for li in range(self.lo, self.hi):
            L = m.layers[li]
            self._prefill_norm(s, x, L.attn_norm, hE)
            if L.recurrent:
                self._gdn_prefill(s, li, L, hE, x, n, state.running[li], [(r, at[li]) for r, at in cuts])
            else:
                self._attn_prefill(s, li, L, hE, x, n, pos0, pt)
            if li in self.moe:
                moe.prefill(self, s, self.moe[li], x, L.post_norm, hE)
            else:
                self._prefill_ffn(s, x, L.post_norm, self.w_gu[li], L.ffn.dense[2], hE, gu, act16)
        return self._prefill_end(x, toks, state, all_logits, hidden)

    def _gdn_prefill(self, s, li: int, L, hE, x, n: int, run, cuts=()) -> None:
        """GDN layer li over n rows: x += ssm_out(gated_norm(delta_rule(prep(conv(W_in hE))), z)). cuts: [(row r,
        {"conv", "ssm"} arrays)] (Memory.mark): the two launches that carry the running state (the conv with its window,
        the delta rule with its state) run over the rows in segments ending at each r, and after each segment the
        state is copied device to device into the cut's arrays, on the same stream (no host wait); every other launch
        runs over all n rows."""
        cp, lb, pf, m = self.cp, lib(), self.pf, self.model
        conv_dim, vdim, nv, nk, dk, dv = m.conv_dim, m.value_dim, m.nv, m.nk, m.dk, m.dv
        wp = conv_dim + vdim + 2 * nv
        proj = pf.buf("proj", (n, wp), cp.float32)
        for w, off, _ in self.w_in[li]:
            pf.gemm(hE, w, proj, False, off)
        f32 = lambda name, shape: pf.buf(name, shape, cp.float32)   # noqa: E731
        y = f32("y", (n, conv_dim))
        q, k = f32("q", (n, nk, dk)), f32("k", (n, nk, dk))
        v, o = f32("v", (n, nv, dv)), f32("o", (n, nv, dv))
        g, beta = f32("g", (n, nv)), f32("beta", (n, nv))
        on16 = pf.buf("on16", (n, vdim), cp.float16)
        bounds = [0] + [r for r, _ in cuts] + [n]
        segs = [(bounds[i], bounds[i + 1], cuts[i][1] if i < len(cuts) else None) for i in range(len(bounds) - 1)]
        for a, b, keep_at in segs:          # the causal conv, its window the state it carries
            check(lb.strata_gdn_conv(s, ptr(proj[a:b]), wp, ptr(L.conv), ptr(run["conv"]), ptr(y[a:b]), b - a,
                                     conv_dim, m.d_conv), "strata_gdn_conv")
            if keep_at is not None:
                keep_at["conv"][...] = run["conv"]        # CuPy's current stream: the stream `s` launches on
        b_off = conv_dim + vdim
        grouped = L.w_ba is not None
        check(lb.strata_gdn_prep(s, ptr(y), conv_dim, ptr(proj), ptr(proj), wp, b_off, b_off if grouped else b_off + nv,
                                 int(grouped), ptr(L.a), ptr(L.dt), ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta), n, nk,
                                 nv, dk, dv, L2_EPS), "strata_gdn_prep")
        for a, b, keep_at in segs:          # the delta rule, its state matrix
            check(lb.strata_gdn_recurrent_ex(s, ptr(q[a:b]), ptr(k[a:b]), ptr(v[a:b]), ptr(g[a:b]), ptr(beta[a:b]),
                                             ptr(run["ssm"]), ptr(o[a:b]), b - a, nv, nk, dk, dv, int(bool(m.tiled)),
                                             float(1.0 / dk ** 0.5), VARIANTS["auto"]), "strata_gdn_recurrent")
            if keep_at is not None:
                keep_at["ssm"][...] = run["ssm"]
        check(lb.strata_gdn_gated_norm_rows(s, ptr(o), ptr(proj, conv_dim), wp, nv, ptr(L.ssm_norm), ffi().NULL,
                                            ptr(on16), n * nv, dv, self.eps), "strata_gdn_gated_norm_rows")
        pf.gemm(on16, L.ssm_out, x, True)

    def _attn_prefill(self, s, li: int, L, hE, x, n: int, pos0: int, pt) -> None:
        """Gated attention layer li over n rows at positions pos0.. (K/V written into the pages of table pt):
        x += attn_output(attention(rope(norm(q)), rope(norm(k)), v) * sigmoid(gate))."""
        cp, lb, pf, pool = self.cp, lib(), self.pf, self.pool
        H, KV, hd = self.n_head, self.n_kv, self.hd
        nq, kvd = H * hd, KV * hd
        W = nq + 2 * kvd
        NULL = ffi().NULL
        slot = pool.slot(li)
        kc, vc = pool.k[slot], pool.v[slot]
        ks, vs = pool.scales(slot)
        qg = pf.buf("qg", (n, 2 * nq + 2 * kvd), cp.float32)
        for w, off, _ in self.w_in[li]:
            pf.gemm(hE, w, qg, False, off)
        qkv, gate = pf.buf("qkv", (n, W), cp.float32), pf.buf("gate", (n, nq), cp.float32)
        att = pf.buf("att", (n, nq), cp.float32)
        an16 = pf.buf("an16", (n, nq), cp.float16)
        check(lb.strata_q35_attn_prep(s, ptr(qg), ptr(L.q_norm), ptr(L.k_norm), ptr(qkv), ptr(gate), n, H, KV, hd,
                                      self.eps), "strata_q35_attn_prep")
        check(lb.strata_rope_kv_prefill(s, ptr(qkv), W, pos0, NULL if ks is not None else ptr(kc),
                                        NULL if ks is not None else ptr(vc), ptr(pt), n, H, KV, hd, self.n_rot,
                                        self.theta, 1, pool.page_size), "strata_rope_kv_prefill")
        if ks is not None:   # q8_0 cache: the rotated K and V rows quantized into the cache
            check(lb.strata_kv_write_q8(s, ptr(qkv, nq), W, ptr(qkv, nq + kvd), W, ptr(kc), ptr(vc), ptr(ks), ptr(vs),
                                        ptr(pt), NULL, pos0, n, KV, hd, pool.page_size), "strata_kv_write_q8")
        if hd in FLASH_HEAD_DIMS:
            n_split = fa2_splits(n, H, pos0 + n, self.n_sm)
            ws = pf.buf("ws", (n_split * H * n * (hd + 2),), cp.float32) if n_split > 1 else None
            check(lb.strata_fa2_prefill(s, ptr(qkv), W, ptr(kc), ptr(vc), ptr(pt), ptr(att), NULL, ptr(ws), n, H, KV,
                                        hd, pool.page_size, pos0, n_split, self.scale, ptr(ks), ptr(vs)),
                  "strata_fa2_prefill")
        else:
            q = cp.ascontiguousarray(qkv[:, :nq]).reshape(n, H, hd)
            att[...] = prefill_attention(self.model.backend, q, kc, vc, pt, pos0, KV, pool.page_size, self.scale,
                                           ks, vs).reshape(n, nq)
        check(lb.strata_q35_out_gate(s, ptr(att), ptr(gate), NULL, ptr(an16), NULL, n * nq), "strata_q35_out_gate")
        pf.gemm(an16, L.wo, x, True)


class Qwen35GraphModel(PlanModel):
    """The hybrid family's PlanModel (runner.PlanModel with Qwen35Cuda plans): MTP and everything else the plan does
    not take run on the model itself."""

    plan_class = Qwen35Cuda
    keeps_states = True     # a verify (short read) keeps each row's running state on the device (Memory.keep)

    @staticmethod
    def prefill_enabled() -> bool:
        return settings.hybrid_prefill_enabled()

    @property
    def moe_path(self) -> dict[str, str] | None:
        """The MoE layers' path (None for a dense model): the decode graph's launches (strata/backend/cuda/moe.py),
        and the grouped prefill unless the plan's prefill is off (STRATA_CUDA_HYBRID_PREFILL=0: the model's
        per-expert loop)."""
        if not self.model.moe:
            return None
        out = {"decode": "graph", "prefill": "grouped" if self.prefill else "generic"}
        tier = getattr(self.model, "_expert_tier", None)
        if tier is not None:
            out["tier"] = tier.status()
        return out
