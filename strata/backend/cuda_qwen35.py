"""The CUDA decode plan of the hybrid qwen35 / qwen3next models (dense FFN): ``Qwen35Cuda`` and ``Qwen35GraphModel``.

Like ``LlamaCuda`` / ``GraphDecodeModel`` (strata/backend/cuda.py) for llama: the one-token decode step of
strata/models/qwen3next.py's Qwen3NextModel as fused kernel launches on preallocated device buffers (token,
position and length read from a device int32 buffer ``inp``), captured once per context-size class as a CUDA graph
and replayed with one graph launch per token. ``Qwen35Cuda.prefill`` runs n > 1 tokens (a ubatch) with cuBLAS GEMMs
on f16 copies of the fused weights (written into column ranges of one f32 output), kernels on preallocated buffers
and the warp-per-columns delta-rule kernel (native/cuda/gdn.cu); see its docstring.

Per layer (native/cuda/qwen35.cu for the ``strata_q35_*`` kernels, the rest shared with LlamaCuda):

* GDN layer: one matvec over the fused [attn_qkv | attn_gate | ssm_beta | ssm_alpha] (or ``ssm_ba``) rows on the
  q8_1 activations of the RMSNorm -> ``strata_q35_conv`` (causal conv + SiLU, window in place) ->
  ``strata_q35_gdn_step`` (L2-normalised q/k, beta = sigmoid(b), g = ssm_a * softplus(alpha + dt), the gated delta
  rule on the ssm state in place) -> ``strata_q35_gated_norm`` (RMSNorm(o) * ssm_norm * silu(z), q8_1 out) ->
  ``ssm_out`` matvec.
* Attention layer: fused [attn_q | attn_k | attn_v] matvec -> ``strata_q35_attn_prep`` (per-head q/k RMSNorm, gate
  split off) -> ``strata_rope_kv_decode`` (partial-rotary NeoX RoPE + K/V write into the sequence's CudaPagePool
  pages) -> ``strata_attn_decode_gqa`` -> ``strata_q35_out_gate`` (att * sigmoid(gate), q8_1 out) -> attn_output
  matvec.
* Residual adds fused into the next ``strata_rms_norm_ex`` (which also writes the q8_1 blocks the next matvec
  reads); FFN: fused gate|up matvec -> ``strata_swiglu_gu`` (q8_1 out) -> down matvec (with STRATA_CUDA_GLU=1 one
  ``strata_matvec_q8w_glu`` launch does both).
* Final RMSNorm, output matvec, device argmax into ``inp[0]``, position / length + 1 (``strata_add_scalar``).

Running state: a captured graph has fixed addresses, so the plan owns one conv / ssm buffer per GDN layer and
makes the sequence it decodes *resident* (``ResidentState``): its ``state.running[layer]`` entries become the
plan's buffers (their contents copied in), and the previously resident sequence gets copies of the buffers back.
Everything that updates a running state in place (the model's generic prefill, ``SequenceState.restore`` /
``reset``) then works on the buffers unchanged.
"""
from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from strata.backend import cuda as C
from strata.backend import cuda_gdn
from strata.memory import Carve

L2_EPS = 1e-6            # gdn.l2_norm's default eps (the model's q/k normalisation)
ATTN_HEAD_DIMS = (32, 64, 128, 256)

_ffi = None
_lib = None


def lib():
    """The cffi handle of the kernel library (this plan's FFI, loaded once)."""
    global _ffi, _lib
    if _lib is None:
        _ffi, _lib = C.open_kernel_library()
    return _lib


def _vp(ptr: int) -> Any:
    """An integer device address as a cffi void*."""
    return _ffi.cast("void *", ptr)


def _a(a, off: int = 0) -> Any:
    """Device address of a CuPy array (or DeviceWeight's storage) plus off 4-byte elements, as void*."""
    if a is None:
        return _ffi.NULL
    if isinstance(a, C.DeviceWeight):
        a = a.data
    return _vp(a.data.ptr + 4 * off)


def _stream() -> Any:
    import cupy
    return _vp(cupy.cuda.get_current_stream().ptr)


def graphs_enabled() -> bool:
    """STRATA_CUDA_GRAPHS (default 1): 0 / false / no runs the plan's kernels eagerly instead of graph replay."""
    return os.environ.get("STRATA_CUDA_GRAPHS", "1") not in ("0", "false", "no")


def prefill_enabled() -> bool:
    """STRATA_CUDA_HYBRID_PREFILL (default 1): 0 / false / no / off sends n > 1 tokens through the model's generic
    forward instead of ``Qwen35Cuda.prefill`` (the feature's reference in benchmarks)."""
    return os.environ.get("STRATA_CUDA_HYBRID_PREFILL", "1").lower() not in ("0", "false", "no", "off")


# ------------------------------------------------------------------------------------------------ pure logic
def fuse_groups(name: str, parts: list, concat: Callable | None = None) -> list[tuple[Any, int, int]]:
    """One matvec per run of consecutive weights of one GGML type and width: [(weight, row offset, n_out)].

    parts: DeviceWeight-like objects (ggml_type, shape (n_out, n_in)) whose outputs lie back to back in one buffer;
    runs of two or more are stacked along n_out by ``concat(name, run)`` (default ``cuda.concat_weights``, a new
    device copy: the model's tensors are left untouched), single weights are used as they are."""
    concat = concat or C.concat_weights
    out: list[tuple[Any, int, int]] = []
    off, i = 0, 0
    while i < len(parts):
        j = i + 1
        while j < len(parts) and parts[j].ggml_type == parts[i].ggml_type and parts[j].shape[1] == parts[i].shape[1]:
            j += 1
        w = parts[i] if j == i + 1 else concat(f"{name}[{i}:{j}]", parts[i:j])
        out.append((w, off, int(w.shape[0])))
        off += int(w.shape[0])
        i = j
    return out


def unsupported(model, lo: int = 0, hi: int | None = None) -> str | None:
    """Why Qwen35Cuda cannot run the carve [lo, hi) of `model` (hi None: to the last block; one line), or None if it
    can."""
    if getattr(model, "arch", None) != "qwen3next" or not hasattr(model, "recurrent"):
        return f"architecture {getattr(model, 'arch', None)!r} is not a qwen3next / qwen35 hybrid"
    if getattr(model, "moe", False):
        return (f"MoE FFN layers ({getattr(model, 'variant', '?')}, {model.n_expert} experts): the plan runs dense "
                f"FFNs only")
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
    if c.n_ff % 32:
        return f"n_ff {c.n_ff} is not a multiple of 32 (q8_1 activation blocks)"
    # the embeddings only in the first stage, the output head only in the last
    if not getattr(model, "on_device", False) or lo == 0 and not isinstance(model.tok_embd, C.DeviceWeight) \
            or hi == model.n_layer and not isinstance(model.output, C.DeviceWeight):
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


# ------------------------------------------------------------------------------------------------ the plan
class Qwen35Cuda:
    """The CUDA decode plan of Qwen3NextModel (qwen35 dense FFN; see the module docstring for the launches).

    It reads the model's uploaded tensors (matrices of one GGML type fused at init: GDN [attn_qkv | attn_gate |
    ssm_beta | ssm_alpha] or [.. | ssm_ba], attention [attn_q | attn_k | attn_v], FFN [gate | up]; a fused copy
    costs the device memory of its parts once more) and config, and the sequence's CudaPagePool pages (f16 or
    q8_0). Numerics: matvecs on int8 q8_1 activations for the types strata_matvec_q8w supports (STRATA_CUDA_DP4A=0,
    or F16/F32 weights: f32 activations through strata_matvec), everything else f32 (the same as the generic path
    on the CUDA backend, whose one-token matmuls also take q8_1 activations).

    ``decode(token, state)`` = model.forward([token], state) -> host f32 logits (n_vocab,) (same errors: ValueError
    for a bad token / foreign pool / KV length mismatch / running-state layout, KVCacheFull from kv.reserve, each
    changing nothing); ``decode_device`` leaves them on the device; ``decode_greedy(first, n, state)`` feeds the
    device argmax back n times (benchmarks, tests). ``use_graphs`` (default: STRATA_CUDA_GRAPHS != 0) captures one
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

    def __init__(self, model, pool, use_graphs: bool | None = None, lo: int = 0, hi: int | None = None):
        why = unsupported(model, lo, hi)
        if why:
            raise ValueError(f"the qwen35 CUDA decode plan cannot run this model: {why}")
        lo, hi = C.carve_bounds(lo, hi, model.n_layer)
        if not isinstance(pool, C.CudaPagePool):
            raise TypeError("Qwen35Cuda needs the CudaPagePool made by CudaBackend.new_page_pool")
        cp = self.cp = __import__("cupy")
        lib()
        self.model, self.pool = model, pool
        c = model.config
        self.n_embd, self.n_head, self.n_kv, self.hd = c.n_embd, c.n_head, c.n_head_kv, c.head_dim
        self.n_ff, self.n_vocab, self.n_layer = c.n_ff, c.n_vocab, model.n_layer
        self.lo, self.hi = lo, hi                  # the carve: layers [lo, hi) (the MTP block is never in one)
        self.first, self.last = lo == 0, model.ends_with_head(hi)   # the embeddings / the final norm and head
        recurrent = model.recurrent[lo:hi]
        self.n_rot, self.theta, self.eps = int(model.n_rot), float(c.rope_theta), float(model.eps)
        self.scale = float(model.scale)
        self.use_graphs = graphs_enabled() if use_graphs is None else bool(use_graphs)
        self.dp4a = C.DP4A
        self.n_sm = int(model.backend.n_sm)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graphs: dict[int, Any] = {}
        E, H, KV, hd, F = self.n_embd, self.n_head, self.n_kv, self.hd, self.n_ff
        nq, kvd = H * hd, KV * hd
        conv_dim, vdim, nv = model.conv_dim, model.value_dim, model.nv
        q8 = lambda n: cp.zeros(n + n // 4, cp.uint8)   # int8 values + float2 (d, d * sum) per 32
        self.d = {  # fixed addresses (graph capture); inp = [token, pos, len]
            "inp": cp.zeros(3, cp.int32), "x": cp.zeros((1, E), cp.float32), "hn": cp.zeros((1, E), cp.float32),
            "hq": q8(E), "o": cp.zeros((1, E), cp.float32),
            "gu": cp.zeros((1, 2 * F), cp.float32), "act": cp.zeros((1, F), cp.float32), "fq": q8(F),
            "logits": cp.zeros((1, self.n_vocab), cp.float32),
        }
        if any(recurrent):
            self.d.update({
                "proj": cp.zeros(conv_dim + vdim + 2 * nv, cp.float32), "y": cp.zeros(conv_dim, cp.float32),
                "ov": cp.zeros(vdim, cp.float32), "vn": cp.zeros(vdim, cp.float32), "vq": q8(vdim)})
        if not all(recurrent):
            self.d.update({
                "qg": cp.zeros(2 * nq + 2 * kvd, cp.float32), "qkv": cp.zeros(nq + 2 * kvd, cp.float32),
                "gate": cp.zeros(nq, cp.float32), "att": cp.zeros(nq, cp.float32), "an": cp.zeros(nq, cp.float32),
                "aq": q8(nq), "partial": cp.zeros(H * C.GQA_MAX_SPLIT * (hd + 2), cp.float32),
                "counters": cp.zeros(max(64, KV), cp.uint32)})
        # fused weights per layer: lists of (weight, row offset, n_out) into the layer's output buffer
        self.w_in: dict[int, list] = {}
        self.w_gu: dict[int, list] = {}
        for li in range(lo, hi):
            L = model.layers[li]
            if L.recurrent:
                tail = [L.w_ba] if L.w_ba is not None else [L.w_beta, L.w_alpha]
                self.w_in[li] = fuse_groups(f"blk.{li}.gdn_in", [L.wqkv, L.wz] + tail)
            else:
                self.w_in[li] = fuse_groups(f"blk.{li}.attn_qkv", [L.wq, L.wk, L.wv])
            g, u, _ = L.ffn.dense
            self.w_gu[li] = fuse_groups(f"blk.{li}.ffn_gate_up", [g, u])
        # the running state of the carve's GDN layers (a stage's state.running holds those only)
        self.resident = ResidentState(model.new_running_state(Carve(lo, hi)))
        self.pf = C.PrefillScratch()                          # prefill buffers and f16 weights for cuBLAS

    @staticmethod
    def unsupported(model, lo: int = 0, hi: int | None = None) -> str | None:
        """Why the plan cannot run the carve [lo, hi) of `model` (one line), or None (module function
        ``unsupported``)."""
        return unsupported(model, lo, hi)

    # ---- the decode step
    def _mv(self, s, groups, y, x, xq, n_in: int) -> None:
        """y[off:off + n_out] = W x for each (W, off, n_out) of groups: q8_1 activations xq (written by the kernel
        that produced x) when the plan runs on int8 activations and W's type has the dp4a kernel, else f32 x."""
        lb = _lib
        for w, off, n_out in groups:
            if self.dp4a and lb.strata_matvec_q8_supported(w.ggml_type):
                C._check(lb.strata_matvec_q8w(s, w.ggml_type, _a(w), _a(xq), _a(y, off), n_out, n_in,
                                              C.rows_per_warp(n_out)), "strata_matvec_q8w")
            else:
                C._check(lb.strata_matvec(s, w.ggml_type, _a(w), _a(x), _a(y, off), n_out, n_in, 1), "strata_matvec")

    def _enqueue_step(self, n_split: int) -> None:
        """Enqueue one decode step on the current stream: only preallocated buffers, token / pos / len read from
        d['inp'], n_split partitions of the decode attention. A carve [lo, hi): the first stage starts from the
        embedding row, a later one from d['x'] (written by the caller before the step); the last ends with the final
        norm, the output matvec and the argmax, an earlier one with the residual stream in d['x']. Every stage
        advances the position and length."""
        lb, d, m = _lib, self.d, self.model
        ck = C._check
        s = _stream()
        E, F = self.n_embd, self.n_ff
        NULL = _ffi.NULL
        inp = d["inp"].data.ptr
        tok_p, pos_p, len_p = (_ffi.cast("int *", inp + 4 * i) for i in range(3))
        q8 = self.dp4a
        qp = lambda k: _a(d[k]) if q8 else NULL
        x, hn, o = d["x"], d["hn"], d["o"]
        if self.first:
            ck(lb.strata_get_rows(s, m.tok_embd.ggml_type, _a(m.tok_embd), tok_p, _a(x), 1, E), "get_rows")
        ck(lb.strata_rms_norm_ex(s, _a(x), NULL, _a(m.layers[self.lo].attn_norm), _a(hn), NULL, NULL, qp("hq"), 1, E,
                                 self.eps), "rms_norm")
        for li in range(self.lo, self.hi):
            L = m.layers[li]
            if L.recurrent:
                self._gdn(s, li, L, qp)
            else:
                self._attn(s, li, L, qp, pos_p, len_p, n_split)
            ck(lb.strata_rms_norm_ex(s, _a(o), _a(x), _a(L.post_norm), _a(hn), _a(x), NULL, qp("hq"), 1, E, self.eps),
               "rms_norm")
            glu = C.glu_pointers([w for w, _, _ in self.w_gu[li]], F, E) if (q8 and C.GLU_HYBRID) else None
            if glu is not None:   # SwiGLU in the gate/up matvec (act and its q8_1 blocks from one launch)
                ck(lb.strata_matvec_q8w_glu(s, glu[0], _vp(glu[1]), _vp(glu[2]), qp("hq"), _a(d["act"]), qp("fq"), F, E,
                                            C.glu_pairs_per_warp(F, self.n_sm)), "matvec_glu")
            else:
                self._mv(s, self.w_gu[li], d["gu"], hn, d["hq"], E)
                ck(lb.strata_swiglu_gu(s, _a(d["gu"]), 1, F, _a(d["act"]), NULL, qp("fq")), "swiglu_gu")
            self._mv(s, [(L.ffn.dense[2], 0, E)], o, d["act"], d["fq"], F)
            end = li + 1 == self.hi        # the carve's last layer
            if not end or self.last:   # x += o and the next layer's (or the final) norm
                nxt = m.out_norm if end else m.layers[li + 1].attn_norm
                ck(lb.strata_rms_norm_ex(s, _a(o), _a(x), _a(nxt), _a(hn), _a(x), NULL, qp("hq"), 1, E, self.eps),
                   "rms_norm")
            else:   # a middle stage's end: x += o alone (the kernel reads a weight, writes no norm)
                ck(lb.strata_rms_norm_ex(s, _a(o), _a(x), _a(L.post_norm), NULL, _a(x), NULL, NULL, 1, E, self.eps),
                   "residual")
        if self.last:
            self._mv(s, [(m.output, 0, self.n_vocab)], d["logits"], hn, d["hq"], E)
            ck(lb.strata_argmax(s, _a(d["logits"]), tok_p, 1, self.n_vocab), "argmax")
        ck(lb.strata_add_scalar(s, pos_p, 1, 2), "add_scalar")

    def _gdn(self, s, li: int, L, qp) -> None:
        """GDN layer li: fused in-projection, conv, delta-rule step, gated norm, ssm_out into d['o']."""
        lb, d, m = _lib, self.d, self.model
        E = self.n_embd
        conv_dim, vdim, nv, nk, dk, dv = m.conv_dim, m.value_dim, m.nv, m.nk, m.dk, m.dv
        buf = self.resident.buf[li]
        proj = d["proj"]
        self._mv(s, self.w_in[li], proj, d["hn"], d["hq"], E)
        C._check(lb.strata_q35_conv(s, _a(proj), _a(L.conv), _a(buf["conv"]), _a(d["y"]), conv_dim, m.d_conv),
                 "strata_q35_conv")
        b_off = conv_dim + vdim
        C._check(lb.strata_q35_gdn_step(s, _a(d["y"]), _a(proj), _a(L.a), _a(L.dt), _a(buf["ssm"]), _a(d["ov"]), nv,
                                        nk, dk, dv, int(bool(m.tiled)), b_off, b_off + nv, int(L.w_ba is not None),
                                        float(1.0 / dk ** 0.5), L2_EPS), "strata_q35_gdn_step")
        C._check(lb.strata_q35_gated_norm(s, _a(d["ov"]), _a(proj, conv_dim), _a(L.ssm_norm), _a(d["vn"]), qp("vq"),
                                          nv, dv, self.eps), "strata_q35_gated_norm")
        self._mv(s, [(L.ssm_out, 0, E)], d["o"], d["vn"], d["vq"], vdim)

    def _attn(self, s, li: int, L, qp, pos_p, len_p, n_split: int) -> None:
        """Gated attention layer li: fused q|gate/k/v matvec, q/k norm, RoPE + K/V write, GQA decode attention,
        output gate, attn_output into d['o']."""
        lb, d, pool = _lib, self.d, self.pool
        E, H, KV, hd = self.n_embd, self.n_head, self.n_kv, self.hd
        nq, kvd = H * hd, KV * hd
        NULL = _ffi.NULL
        slot = pool.slot(li)
        kc, vc = pool.k[slot], pool.v[slot]
        ks, vs = pool.scales(slot)
        pt = pool._pt
        qkv = d["qkv"]
        self._mv(s, self.w_in[li], d["qg"], d["hn"], d["hq"], E)
        C._check(lb.strata_q35_attn_prep(s, _a(d["qg"]), _a(L.q_norm), _a(L.k_norm), _a(qkv), _a(d["gate"]), 1, H,
                                         KV, hd, self.eps), "strata_q35_attn_prep")
        if ks is None:
            C._check(lb.strata_rope_kv_decode(s, _a(qkv), pos_p, _a(kc), _a(vc), _a(pt), H, KV, hd, self.n_rot,
                                              self.theta, 1, pool.page_size), "strata_rope_kv_decode")
        else:   # q8_0 cache: RoPE in place, then the K/V rows quantized into the cache
            C._check(lb.strata_rope_kv_decode(s, _a(qkv), pos_p, NULL, NULL, _a(pt), H, KV, hd, self.n_rot,
                                              self.theta, 1, pool.page_size), "strata_rope_kv_decode")
            C._check(lb.strata_kv_write_q8(s, _a(qkv, nq), nq + 2 * kvd, _a(qkv, nq + kvd), nq + 2 * kvd, _a(kc),
                                           _a(vc), _a(ks), _a(vs), _a(pt), pos_p, 0, 1, KV, hd, pool.page_size),
                     "strata_kv_write_q8")
        ctr = _ffi.cast("unsigned *", d["counters"].data.ptr)
        C._check(lb.strata_attn_decode_gqa(s, _a(qkv), _a(kc), _a(vc), _a(pt), len_p, 0, _a(d["partial"]), ctr,
                                           _a(d["att"]), NULL, H, KV, hd, pool.page_size, n_split, self.scale,
                                           _a(ks), _a(vs)), "strata_attn_decode_gqa")
        C._check(lb.strata_q35_out_gate(s, _a(d["att"]), _a(d["gate"]), _a(d["an"]), NULL, qp("aq"), nq),
                 "strata_q35_out_gate")
        self._mv(s, [(L.wo, 0, E)], d["o"], d["an"], d["aq"], nq)

    # ---- prefill (n > 1 tokens)
    def prefill(self, tokens, state, all_logits: bool = False, x_in=None):
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
        states, a CuPy f32 (n, n_embd) array of its own (all_logits unused)."""
        cp, m, pool = self.cp, self.model, self.pool
        toks = m._check_tokens(tokens)
        n = int(toks.shape[0])
        x_in = C.hidden_input(x_in, n, self.n_embd, self.first, m.backend.device_id)
        C.check_sequence(pool, state)
        kv = state.kv
        self.resident.check(state)
        kv.reserve(n)                                         # KVCacheFull here changes nothing
        lb, pf = _lib, self.pf
        s = _stream()
        E, F = self.n_embd, self.n_ff
        NULL = _ffi.NULL
        pos0 = int(state.pos)
        x = pf.buf("x", (n, E), cp.float32)
        hE = pf.buf("hE", (n, E), cp.float16)
        if self.first:
            ids = pf.buf("ids", (n,), cp.int32)
            ids.set(toks)
            C._check(lb.strata_get_rows(s, m.tok_embd.ggml_type, _a(m.tok_embd), _a(ids), _a(x), n, E), "get_rows")
        else:
            x[...] = x_in
        pt = self.pool.table(kv.pages) if not all(m.recurrent[self.lo:self.hi]) else None
        for li in range(self.lo, self.hi):
            L = m.layers[li]
            C._check(lb.strata_rms_norm_ex(s, _a(x), NULL, _a(L.attn_norm), NULL, NULL, _a(hE), NULL, n, E,
                                           self.eps), "rms_norm")
            if L.recurrent:
                self._gdn_prefill(s, li, L, hE, x, n, state.running[li])
            else:
                self._attn_prefill(s, li, L, hE, x, n, pos0, pt)
            C._check(lb.strata_rms_norm_ex(s, _a(x), NULL, _a(L.post_norm), NULL, NULL, _a(hE), NULL, n, E,
                                           self.eps), "rms_norm")
            gu = pf.buf("gu", (n, 2 * F), cp.float32)
            act16 = pf.buf("act16", (n, F), cp.float16)
            for w, off, _ in self.w_gu[li]:
                pf.gemm(hE, w, gu, False, off)
            C._check(lb.strata_swiglu_gu(s, _a(gu), n, F, NULL, _a(act16), NULL), "swiglu_gu")
            pf.gemm(act16, L.ffn.dense[2], x, True)
        out = C.prefill_logits(m, x, all_logits, self.eps) if self.last else x.copy()   # x: the scratch buffer
        kv.commit(n)
        state.advance(toks)
        return out

    def _gdn_prefill(self, s, li: int, L, hE, x, n: int, run) -> None:
        """GDN layer li over n rows: x += ssm_out(gated_norm(delta_rule(prep(conv(W_in hE))), z))."""
        cp, lb, pf, m = self.cp, _lib, self.pf, self.model
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
        C._check(lb.strata_gdn_conv(s, _a(proj), wp, _a(L.conv), _a(run["conv"]), _a(y), n, conv_dim, m.d_conv),
                 "strata_gdn_conv")
        b_off = conv_dim + vdim
        grouped = L.w_ba is not None
        C._check(lb.strata_gdn_prep(s, _a(y), conv_dim, _a(proj), _a(proj), wp, b_off, b_off if grouped else b_off + nv,
                                    int(grouped), _a(L.a), _a(L.dt), _a(q), _a(k), _a(v), _a(g), _a(beta), n, nk, nv,
                                    dk, dv, L2_EPS), "strata_gdn_prep")
        C._check(lb.strata_gdn_recurrent_ex(s, _a(q), _a(k), _a(v), _a(g), _a(beta), _a(run["ssm"]), _a(o), n, nv, nk,
                                            dk, dv, int(bool(m.tiled)), float(1.0 / dk ** 0.5),
                                            cuda_gdn.VARIANTS["auto"]), "strata_gdn_recurrent")
        C._check(lb.strata_gdn_gated_norm_rows(s, _a(o), _a(proj, conv_dim), wp, nv, _a(L.ssm_norm), _ffi.NULL,
                                               _a(on16), n * nv, dv, self.eps), "strata_gdn_gated_norm_rows")
        pf.gemm(on16, L.ssm_out, x, True)

    def _attn_prefill(self, s, li: int, L, hE, x, n: int, pos0: int, pt) -> None:
        """Gated attention layer li over n rows at positions pos0.. (K/V written into the pages of table pt):
        x += attn_output(attention(rope(norm(q)), rope(norm(k)), v) * sigmoid(gate))."""
        cp, lb, pf, pool = self.cp, _lib, self.pf, self.pool
        H, KV, hd = self.n_head, self.n_kv, self.hd
        nq, kvd = H * hd, KV * hd
        W = nq + 2 * kvd
        NULL = _ffi.NULL
        slot = pool.slot(li)
        kc, vc = pool.k[slot], pool.v[slot]
        ks, vs = pool.scales(slot)
        qg = pf.buf("qg", (n, 2 * nq + 2 * kvd), cp.float32)
        for w, off, _ in self.w_in[li]:
            pf.gemm(hE, w, qg, False, off)
        qkv, gate = pf.buf("qkv", (n, W), cp.float32), pf.buf("gate", (n, nq), cp.float32)
        att = pf.buf("att", (n, nq), cp.float32)
        an16 = pf.buf("an16", (n, nq), cp.float16)
        C._check(lb.strata_q35_attn_prep(s, _a(qg), _a(L.q_norm), _a(L.k_norm), _a(qkv), _a(gate), n, H, KV, hd,
                                         self.eps), "strata_q35_attn_prep")
        C._check(lb.strata_rope_kv_prefill(s, _a(qkv), W, pos0, NULL if ks is not None else _a(kc),
                                           NULL if ks is not None else _a(vc), _a(pt), n, H, KV, hd, self.n_rot,
                                           self.theta, 1, pool.page_size), "strata_rope_kv_prefill")
        if ks is not None:   # q8_0 cache: the rotated K and V rows quantized into the cache
            C._check(lb.strata_kv_write_q8(s, _a(qkv, nq), W, _a(qkv, nq + kvd), W, _a(kc), _a(vc), _a(ks), _a(vs),
                                           _a(pt), NULL, pos0, n, KV, hd, pool.page_size), "strata_kv_write_q8")
        if C.FLASH and hd in C.FLASH_HEAD_DIMS:
            n_split = C.fa2_splits(n, H, pos0 + n, self.n_sm)
            ws = pf.buf("ws", (n_split * H * n * (hd + 2),), cp.float32) if n_split > 1 else None
            C._check(lb.strata_fa2_prefill(s, _a(qkv), W, _a(kc), _a(vc), _a(pt), _a(att), NULL, _a(ws), n, H, KV, hd,
                                           pool.page_size, pos0, n_split, self.scale, _a(ks), _a(vs)),
                     "strata_fa2_prefill")
        else:
            q = cp.ascontiguousarray(qkv[:, :nq]).reshape(n, H, hd)
            att[...] = C.prefill_attention(self.model.backend, q, kc, vc, pt, pos0, KV, pool.page_size, self.scale,
                                           ks, vs).reshape(n, nq)
        C._check(lb.strata_q35_out_gate(s, _a(att), _a(gate), NULL, _a(an16), NULL, n * nq), "strata_q35_out_gate")
        pf.gemm(an16, L.wo, x, True)

    @staticmethod
    def size_class(length: int) -> int:
        """Context-size class of a step attending over `length` positions: the power of two >= max(256, length)."""
        return C.LlamaCuda.size_class(length)

    def _launch(self, length: int) -> None:
        """One step attending over `length` positions, on self.stream (graph replay or eager launches)."""
        cls = self.size_class(length)
        n_split = C.n_split_class(cls, self.n_kv, self.n_sm,
                                  C.gqa_resident(self.hd, self.n_head // max(1, self.n_kv), self.pool.kv == "q8_0"))
        if not self.use_graphs:
            self._enqueue_step(n_split)
            return
        g = self.graphs.get(cls)
        if g is None:
            self.stream.begin_capture()
            try:
                self._enqueue_step(n_split)
            finally:
                g = self.stream.end_capture()
            self.graphs[cls] = g
        g.launch(self.stream)

    def _begin(self, state, first: int, n: int) -> None:
        """Checks (changing nothing on error), kv.reserve(n), residency, page table and inp = [first, pos, pos+1]."""
        C.check_sequence(self.pool, state)
        kv = state.kv
        if not 0 <= first < self.n_vocab:
            raise ValueError(f"token id out of range [0, {self.n_vocab})")
        self.resident.check(state)
        kv.reserve(n)                                         # KVCacheFull here changes nothing
        cp = self.cp
        self.resident.attach(state)                           # copies on the current stream
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        with self.stream:
            self.pool.table(kv.pages)
            self.d["inp"].set(np.asarray([first, state.pos, state.pos + 1], dtype=np.int32), stream=self.stream)

    def decode_device(self, token: int, state, x_in=None):
        """model.forward([token], state) through the plan, logits left on the device: a CuPy f32 (n_vocab,) view of
        the plan's logits buffer (valid until the next step), ordered on the current stream. A carve: x_in, the
        hidden state a stage after the first starts from (CuPy f32, n_embd elements, on the plan's device), is
        copied in before the step; a stage before the last returns its hidden state instead of logits, a CuPy f32
        (1, n_embd) view of the plan's residual-stream buffer (valid until the next step)."""
        token = int(token)
        x = C.hidden_input(x_in, 1, self.n_embd, self.first, self.model.backend.device_id)
        self._begin(state, token, 1)
        with self.stream:
            if x is not None:
                self.d["x"][...] = x         # outside the graph, which reads d['x']
            self._launch(state.pos + 1)
        self.cp.cuda.get_current_stream().wait_event(self.stream.record())
        state.kv.commit(1)
        state.advance([token])
        return self.d["logits"][0] if self.last else self.d["x"][:1]

    def decode(self, token: int, state, x_in=None):
        """model.forward([token], state) through the plan -> f32 logits (n_vocab,) on the host; a stage before the
        last: its hidden state, a CuPy f32 (1, n_embd) copy (decode_device)."""
        out = self.decode_device(token, state, x_in)
        return self.cp.asnumpy(out) if self.last else out.copy()

    def decode_greedy(self, first_token: int, n: int, state) -> list[int]:
        """Feed first_token at state.pos, then n - 1 device-argmax tokens; returns the n argmax tokens chosen.
        The sequence advances by n (first_token and the first n - 1 chosen). The whole model only (no carve)."""
        if not (self.first and self.last):
            raise ValueError(f"decode_greedy runs the whole model, not the carve [{self.lo}, {self.hi})")
        if n < 1:
            return []
        first_token = int(first_token)
        self._begin(state, first_token, n)
        cp = self.cp
        p0 = state.pos
        with self.stream:
            out = cp.zeros(n, cp.int32)
            for i in range(n):
                self._launch(p0 + i + 1)
                out[i:i + 1] = self.d["inp"][0:1]
            got = [int(t) for t in cp.asnumpy(out, stream=self.stream)]
        self.cp.cuda.get_current_stream().wait_event(self.stream.record())
        state.kv.commit(n)
        state.advance([first_token] + got[:-1])
        return got

    def logits(self) -> np.ndarray:
        """Logits of the last step (host f32 (n_vocab,))."""
        return self.cp.asnumpy(self.d["logits"][0], stream=self.stream)


class Qwen35GraphModel:
    """What the engine runs on CUDA for a qwen35 (dense) model: the Qwen3NextModel itself (all_logits of a few tokens,
    MTP, every attribute), except that on a CudaPagePool sequence a one-token forward() goes through the Qwen35Cuda
    decode plan and more than 8 tokens through its prefill (one plan per pool). Same interface as
    cuda.GraphDecodeModel. STRATA_CUDA_GRAPHS=0: the plan launches its decode kernels eagerly (same numerics, no
    graph); STRATA_CUDA_HYBRID_PREFILL=0: prefill through the model's forward. The plan's prefill does not read the
    model's ``gdn_mode`` or STRATA_GDN_FUSED (it always runs the fused kernels and the recurrent delta rule).

    lo, hi: the carve, layers [lo, hi) (hi None: to the last block, the MTP block excluded) that this stage runs
    (its plans are made with it); a stage after the first takes the previous stage's hidden states (x_in), a stage
    before the last returns its own (CuPy f32 (n, n_embd)) instead of logits; everything the plans do not take goes
    to the model's forward_carve."""

    device_logits = True        # forward_device leaves the last token's logits on the device

    def __init__(self, model, lo: int = 0, hi: int | None = None):
        self.model = model
        self.lo, self.hi = C.carve_bounds(lo, hi, model.n_layer)
        self.plans: dict[int, Qwen35Cuda] = {}
        self.prefill = prefill_enabled()                      # n > 8 tokens through Qwen35Cuda.prefill

    def __getattr__(self, name):
        return getattr(self.model, name)

    def new_page_pool(self, *args, **kwargs):
        """The model's page pool, with this pool's plan made at once: its fused weight copies (about 2/3 of the layer
        weights again) are allocated when the engine loads the model, so a device that cannot hold them fails then,
        not at the first decode token."""
        pool = self.model.new_page_pool(*args, **kwargs)
        if isinstance(pool, C.CudaPagePool):
            with self.model.backend.device:
                self.plan(pool)
        return pool

    def plan(self, pool) -> Qwen35Cuda:
        """The plan of `pool` (made on first use)."""
        p = self.plans.get(id(pool))
        if p is None or p.pool is not pool:
            p = self.plans[id(pool)] = Qwen35Cuda(self.model, pool, lo=self.lo, hi=self.hi)
        return p

    def generic_forward(self, tokens, state, all_logits: bool = False, x_in=None):
        """The model's own forward of this carve (host logits for the last stage, the hidden states on the device
        before it)."""
        return self.model.forward_carve(tokens, state, self.lo, self.hi, x_in=x_in, all_logits=all_logits)

    def forward(self, tokens, state, all_logits: bool = False, x_in=None):
        """Qwen3NextModel.forward (same arguments, result and errors), on the backend's device in any thread: on a
        CudaPagePool one token (without all_logits) through the plan's decode step, more tokens than the backend's
        GEMM threshold (8) through its prefill (``self.prefill``, STRATA_CUDA_HYBRID_PREFILL: the same f16 GEMMs as
        the model's forward there, bit-identical logits measured on the H200); everything else (a few tokens: the
        model's f32-activation matvecs) the model's forward (generic_forward). A carve: x_in the hidden states a
        stage after the first starts from; a stage before the last returns its hidden states (CuPy f32 (n,
        n_embd))."""
        toks = np.asarray(tokens).reshape(-1)
        with self.model.backend.device:
            if state.kv is not None and isinstance(state.kv.pool, C.CudaPagePool):
                if toks.shape[0] == 1 and not all_logits:
                    return self.plan(state.kv.pool).decode(_token(toks[0], self.model.config.n_vocab), state, x_in)
                if self.prefill and toks.shape[0] > self.model.backend.gemm_threshold:
                    return self.plan(state.kv.pool).prefill(tokens, state, all_logits, x_in)
            return self.generic_forward(tokens, state, all_logits, x_in)

    def forward_device(self, tokens, state, x_in=None):
        """forward(tokens, state, x_in=x_in) with the last token's logits left on the device: CuPy f32 (n_vocab,),
        ordered on the current stream (valid until the next call); a stage before the last: its hidden states, CuPy
        f32 (n, n_embd)."""
        toks = np.asarray(tokens).reshape(-1)
        with self.model.backend.device:
            if toks.shape[0] == 1 and state.kv is not None and isinstance(state.kv.pool, C.CudaPagePool):
                return self.plan(state.kv.pool).decode_device(_token(toks[0], self.model.config.n_vocab), state,
                                                              x_in)
            return self.model.backend.cp.asarray(self.forward(tokens, state, x_in=x_in))   # hidden: as it is


def _token(t, n_vocab: int) -> int:
    """t as a Python int; ValueError (the model's message) when it is not an integer id in [0, n_vocab)."""
    v = int(t)
    if v != t or not 0 <= v < n_vocab:
        raise ValueError(f"token id out of range [0, {n_vocab})")
    return v
