"""A mixture-of-experts FFN layer on the GPU (native/cuda/moe.cu): its device expert tables, the decode launches a
plan's CUDA graph captures (router, top-k, the k routed experts in one gate/up and one down launch, the gated shared
expert) and the grouped prefill (assignments sorted by expert on the device, one grouped launch per matrix).

The routed experts are read through ``ExpertTable``s: per matrix stack a device array of row-block addresses, one
per expert, which the kernels index by the ids the router chose on the device (no host round trip inside a step).
An entry can be repointed (``ExpertTable.set``) to a copy of that expert anywhere on the device: a captured graph
reads the table at every replay. With the expert tier on, the entries point at the experts' pinned host copies or
their VRAM slots (strata/backend/cuda/moe_tier.py), the routings are counted on the device (strata_moe_count), and
a prefill settles and borrows slots around each layer's launches (``Tier.before_prefill_layer`` /
``after_prefill_layer``: the one call site). Formulas: strata/backend/moe.py (route, moe_ffn), the CPU reference.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from strata.backend.cuda.library import check, ffi, lib, ptr
from strata.backend.cuda.weights import BLOCK, DeviceWeight, fuse_groups

MAX_SLOTS = 32          # strata_cuda.h STRATA_MOE_MAX_SLOTS: k routed experts + the shared one
MAX_EXPERTS = 2048      # STRATA_MOE_MAX_EXPERTS
Q8_TYPES = (2, 3, 8, 12, 13, 14)    # the types with a dp4a dot (strata_matvec_q8_supported)


def q8_row_bytes(n: int) -> int:
    """Bytes of one q8_1 row of n values in moe.cu's row layout (n int8, n / 32 float2, padded to 16 bytes)."""
    return (n + n // 4 + 15) & ~15


def unsupported(model, dp4a: bool = True) -> str | None:
    """Why the MoE FFN of `model` (Qwen3NextModel with ``moe``) cannot run on these kernels (one line), or None.
    dp4a: whether the plan runs on int8 activations (settings.DP4A)."""
    ne, k, F = model.n_expert, model.n_expert_used, model.n_ff_exp
    shared = any(L is not None and L.ffn.shared is not None for L in model.layers)
    if not dp4a:
        return "MoE layers need int8 (q8_1) activations (STRATA_CUDA_DP4A=0 turns them off)"
    if ne > MAX_EXPERTS:
        return f"{ne} experts (the MoE kernels take at most {MAX_EXPERTS})"
    if k + int(shared) > MAX_SLOTS:
        return f"{k} experts per token (at most {MAX_SLOTS - int(shared)} with a shared expert)"
    if F % 32 or model.config.n_embd % 32:
        return f"expert_feed_forward_length {F} or n_embd {model.config.n_embd} is not a multiple of 32"
    if shared and model.n_ff_shexp % 32:
        return f"expert_shared_feed_forward_length {model.n_ff_shexp} is not a multiple of 32"
    for L in model.layers:
        if L is None:
            continue
        f = L.ffn
        for name, ws in (("ffn_gate_exps", f.gate), ("ffn_up_exps", f.up), ("ffn_down_exps", f.down)):
            if not all(isinstance(w, DeviceWeight) for w in ws):
                return "weights are not on the CUDA backend"
            t = ws[0].ggml_type
            if t not in Q8_TYPES:
                return f"{name} of GGML type {t} has no int8-activation kernel"
        if f.gate[0].ggml_type != f.up[0].ggml_type:
            return "ffn_gate_exps and ffn_up_exps differ in type (the gate/up launch reads one type)"
        if model.config.n_embd % BLOCK[f.gate[0].ggml_type][0] or F % BLOCK[f.down[0].ggml_type][0]:
            return f"n_embd / expert_feed_forward_length {model.config.n_embd} / {F} are not whole blocks of the " \
                   f"experts' types"
    return None


class ExpertTable:
    """One stack of expert matrices as the kernels read it: GGML type, per-expert shape (n_out, n_in), and ``table``,
    a device uint64 array of n_table row-block addresses (entry e: expert e; with ``extra``, the shared expert's
    matrix of the same type as entry n_expert, which the decode launches take as their last slot). ``weights`` keeps
    the matrices the entries point at alive."""

    def __init__(self, name: str, weights: list[DeviceWeight], extra: DeviceWeight | None = None):
        import cupy
        w0 = weights[0]
        if any(w.ggml_type != w0.ggml_type or tuple(w.shape) != tuple(w0.shape) for w in weights):
            raise ValueError(f"{name}: experts of one stack must share type and shape")
        if extra is not None and extra.ggml_type != w0.ggml_type:
            raise ValueError(f"{name}: the shared expert's matrix has another type than the experts'")
        addrs = [int(w.data.data.ptr) for w in weights + ([extra] if extra is not None else [])]
        if any(a % 16 for a in addrs):
            raise ValueError(f"{name}: expert storage is not 16-byte aligned")
        self.name, self.ggml_type, self.shape = name, int(w0.ggml_type), tuple(w0.shape)
        self.weights = list(weights) + ([extra] if extra is not None else [])
        self.table = cupy.asarray(np.asarray(addrs, dtype=np.uint64))

    @property
    def n_table(self) -> int:
        return int(self.table.shape[0])

    def set(self, e: int, address: int) -> None:
        """Point entry e at another copy of expert e's rows (16-byte aligned; the caller keeps it alive), on the
        current stream; a graph that reads the table sees it at its next replay."""
        if not 0 <= e < self.n_table or int(address) % 16:
            raise ValueError(f"{self.name}: entry {e} / address {address:#x} (needs 0 <= e < {self.n_table}, 16-byte "
                             f"aligned)")
        import cupy
        self.table[e:e + 1] = cupy.asarray(np.asarray([address], dtype=np.uint64))


def shared_rides_along(ffn) -> bool:
    """Whether the shared expert can be the decode launches' last slot: its gate, up and down matrices on the device
    with the routed experts' types, its width whole blocks of the down type and a multiple of 32."""
    if ffn.shared is None:
        return False
    g, u, d = ffn.shared
    if not all(isinstance(w, DeviceWeight) for w in (g, u, d)):
        return False
    tg, td, fs = ffn.gate[0].ggml_type, ffn.down[0].ggml_type, int(g.shape[0])
    return g.ggml_type == u.ggml_type == tg and d.ggml_type == td and fs % 32 == 0 and fs % BLOCK[td][0] == 0


class MoeLayer:
    """A MoE FFN layer's device data: the router (n_expert, n_embd), ExpertTables of the routed gate / up (n_ff_exp,
    n_embd) and down (n_embd, n_ff_exp) matrices, and the shared expert (its fused [gate | up] groups, down, gate
    vector) or None. ``ride``: the shared expert is also entry n_expert of the tables (shared_rides_along), so the
    decode step runs it as the last slot of the routed launches."""

    def __init__(self, li: int, ffn, model):
        self.router = ffn.router
        self.ride = shared_rides_along(ffn)
        sh = ffn.shared if self.ride else (None, None, None)
        self.gate = ExpertTable(f"blk.{li}.ffn_gate_exps", ffn.gate, sh[0])
        self.up = ExpertTable(f"blk.{li}.ffn_up_exps", ffn.up, sh[1])
        self.down = ExpertTable(f"blk.{li}.ffn_down_exps", ffn.down, sh[2])
        self.n_expert, self.k, self.n_ff = model.n_expert, model.n_expert_used, model.n_ff_exp
        self.renorm = bool(model.norm_topk)
        self.shared = ffn.shared is not None
        self.slots = self.k + int(self.shared)      # ids / wts per token: k routed, then the shared expert's gate
        self.n_ff_sh = 0
        # the expert tier (strata/backend/cuda/moe_tier.py): these tables read through it, routings counted
        self.tier, self.counts = None, None
        self.first = self.last = True       # the first / last MoE layer of the plan's carve (set by the plan)
        if ffn.home is not None:
            from strata.backend.cuda.moe_tier import tier_of
            self.tier = tier_of(model)
            self.tier.attach(li, self.gate, self.up, self.down)
            self.counts = ffi().cast("unsigned *", self.tier.counts_ptr(li))
        self.li = li
        if self.shared:
            g, u, d = ffn.shared
            self.sh_gu = fuse_groups(f"blk.{li}.ffn_gate_up_shexp", [g, u])
            self.sh_down = d
            self.sh_gate = ffn.shared_gate          # f32 (n_embd,) or None
            self.n_ff_sh = int(g.shape[0])


def decode_buffers(cp, model, q8_buffer) -> dict[str, Any]:
    """A decode plan's fixed buffers for one MoE layer's launches (shared by every layer)."""
    E, ne, k, F = model.config.n_embd, model.n_expert, model.n_expert_used, model.n_ff_exp
    Fs = max(32, int(model.n_ff_shexp or 0))
    return {"rl": cp.zeros(ne, cp.float32), "ids": cp.zeros(MAX_SLOTS, cp.int32), "wts": cp.zeros(MAX_SLOTS, cp.float32),
            "eact": cp.zeros(k * F + max(F, Fs), cp.float32),             # slot j at j * F, the last one longer
            "eq": cp.zeros(k * q8_row_bytes(F) + q8_row_bytes(max(F, Fs)), cp.uint8),
            "sgu": cp.zeros((1, 2 * Fs), cp.float32), "sact": cp.zeros((1, Fs), cp.float32),
            "sfq": q8_buffer(cp, Fs), "sy": cp.zeros((1, E), cp.float32)}


def decode(plan, s, m: MoeLayer) -> None:
    """Enqueue the MoE FFN of the normed row plan.d['hn'] / ['hq'] into plan.d['o'] (one token, fixed buffers, no
    host sync): router matvec, strata_moe_route (top-k ids and weights, the shared gate), strata_moe_gate_up (the k
    experts and the shared one riding along as slot k: gate / up, SwiGLU, q8_1 rows), strata_moe_down (their down
    rows, the weighted sum with the shared expert's gate as slot k's weight); a shared expert that cannot ride
    along runs its own gate|up matvec, SwiGLU and down matvec, added by strata_moe_down."""
    lb, d, E = lib(), plan.d, plan.n_embd
    NULL = ffi().NULL
    ne, k, F = m.n_expert, m.k, m.n_ff
    plan._mv(s, [(m.router, 0, ne)], d["rl"], d["hn"], d["hq"], E)
    sg = m.sh_gate if m.shared else None
    check(lb.strata_moe_route(s, ptr(d["rl"]), 1, ne, k, int(m.renorm), ptr(d["hn"]), ptr(sg), E, int(m.shared),
                              ptr(d["ids"]), ptr(d["wts"])), "strata_moe_route")
    if m.counts is not None:
        check(lb.strata_moe_count(s, ptr(d["ids"]), 1, k, m.slots, ne, m.counts), "strata_moe_count")
    sy = shw = NULL
    n_slots, F_last = (k + 1, m.n_ff_sh) if m.ride else (k, F)
    if m.shared and not m.ride:
        Fs = m.n_ff_sh
        plan._mv(s, m.sh_gu, d["sgu"], d["hn"], d["hq"], E)
        check(lb.strata_swiglu_gu(s, ptr(d["sgu"]), 1, Fs, ptr(d["sact"]), NULL, ptr(d["sfq"])), "swiglu_gu")
        plan._mv(s, [(m.sh_down, 0, E)], d["sy"], d["sact"], d["sfq"], Fs)
        sy, shw = ptr(d["sy"]), ptr(d["wts"], k)
    check(lb.strata_moe_gate_up(s, m.gate.ggml_type, ptr(m.gate.table), ptr(m.up.table), m.gate.n_table,
                                ptr(d["ids"]), n_slots, ptr(d["hq"]), ptr(d["eact"]), ptr(d["eq"]), F, F_last, E),
          "strata_moe_gate_up")
    check(lb.strata_moe_down(s, m.down.ggml_type, ptr(m.down.table), m.down.n_table, ptr(d["ids"]), ptr(d["wts"]),
                             n_slots, ptr(d["eq"]), F, F_last, ptr(d["o"]), E, sy, shw), "strata_moe_down")


def prefill(plan, s, m: MoeLayer, x, norm, h16) -> None:
    """x += MoE(RMSNorm(x) * norm) over the n rows of x (CuPy f32 (n, n_embd)), on the plan's prefill scratch (h16:
    its f16 (n, n_embd) buffer), no host sync: the norm (f32 and f16 rows), the router GEMM, strata_moe_route,
    q8_1 rows of the normed x, strata_moe_group (assignments sorted by expert, tiles), one strata_moe_mm for the
    stacked gate | up of every expert, SwiGLU into q8_1 rows, one strata_moe_mm for down, the shared expert's GEMMs,
    strata_moe_combine (weighted sum into x)."""
    cp, lb, pf = plan.cp, lib(), plan.pf
    NULL = ffi().NULL
    n, E = int(x.shape[0]), plan.n_embd
    ne, k, F, ks = m.n_expert, m.k, m.n_ff, m.slots
    if m.tier is not None:
        m.tier.before_prefill_layer(m, n)
    hn = pf.buf("moe_hn", (n, E), cp.float32)
    check(lb.strata_rms_norm_ex(s, ptr(x), NULL, ptr(norm), ptr(hn), NULL, ptr(h16), NULL, n, E, plan.eps), "rms_norm")
    rl = pf.buf("moe_rl", (n, ne), cp.float32)
    pf.gemm(h16, m.router, rl, False, 0)
    ids, wts = pf.buf("moe_ids", (n, ks), cp.int32), pf.buf("moe_wts", (n, ks), cp.float32)
    sg = m.sh_gate if m.shared else None
    check(lb.strata_moe_route(s, ptr(rl), n, ne, k, int(m.renorm), ptr(hn), ptr(sg), E, int(m.shared), ptr(ids),
                              ptr(wts)), "strata_moe_route")
    if m.counts is not None:
        check(lb.strata_moe_count(s, ptr(ids), n, k, ks, ne, m.counts), "strata_moe_count")
    xq = pf.buf("moe_xq", (n * q8_row_bytes(E),), cp.uint8)
    check(lb.strata_moe_q8_rows(s, ptr(hn), E, 0, n, E, ptr(xq)), "strata_moe_q8_rows")
    mt = int(lb.strata_moe_max_tiles(n, k, ne))
    order, tiles = pf.buf("moe_sorted", (n * k,), cp.int32), pf.buf("moe_tiles", (mt, 3), cp.int32)
    check(lb.strata_moe_group(s, ptr(ids), n, k, ks, ne, ptr(order), ptr(tiles), mt), "strata_moe_group")
    gu = pf.buf("moe_gu", (n * k, 2 * F), cp.float32)           # rows in sorted order
    check(lb.strata_moe_mm(s, m.gate.ggml_type, ptr(m.gate.table), ptr(m.up.table), F, m.gate.n_table, ptr(tiles),
                           mt, ptr(order), k, 1, ptr(xq), E, ptr(gu), 2 * F, 0), "strata_moe_mm")
    aq = pf.buf("moe_aq", (n * k * q8_row_bytes(F),), cp.uint8)
    check(lb.strata_moe_q8_rows(s, ptr(gu), 2 * F, 1, n * k, F, ptr(aq)), "strata_moe_q8_rows")
    yd = pf.buf("moe_yd", (n * k, E), cp.float32)               # rows by assignment t * k + j
    check(lb.strata_moe_mm(s, m.down.ggml_type, ptr(m.down.table), NULL, E, m.down.n_table, ptr(tiles), mt,
                           ptr(order), k, 0, ptr(aq), F, ptr(yd), E, 1), "strata_moe_mm")
    sy = None
    if m.shared:
        Fs = m.n_ff_sh
        sgu = pf.buf("moe_sgu", (n, 2 * Fs), cp.float32)
        for w, off, _ in m.sh_gu:
            pf.gemm(h16, w, sgu, False, off)
        s16 = pf.buf("moe_s16", (n, Fs), cp.float16)
        check(lb.strata_swiglu_gu(s, ptr(sgu), n, Fs, NULL, ptr(s16), NULL), "swiglu_gu")
        sy = pf.buf("moe_sy", (n, E), cp.float32)
        pf.gemm(s16, m.sh_down, sy, False)
    check(lb.strata_moe_combine(s, ptr(yd), ptr(wts), n, k, ks, E, ptr(sy), ptr(x)), "strata_moe_combine")
    if m.tier is not None:
        m.tier.after_prefill_layer(m)
