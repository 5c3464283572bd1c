"""The batched decode step on a GPU: one token of each of N live sequences (each at its own position, over its own
KV pages and running state) as the family's decode step over N columns (the short read's column launchers, each
column bit-identical to the decode step it mirrors), one page table per column, one running-state buffer set per
column of the hybrid; one CUDA graph per batch size and rows' context-size classes (``BatchStep``)."""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import numpy as np

from strata.backend import gdn
from strata.backend.cuda import settings
from strata.backend.cuda.library import addr, check, lib, ptr, stream_ptr
from strata.backend.cuda.pages import check_sequence
from strata.backend.cuda.weights import glu_pointers

#: the q/k L2 norm's eps of the hybrid's GDN step (gdn.l2_norm's, as the decode step passes it)
L2_EPS = float(inspect.signature(gdn.l2_norm).parameters["eps"].default)

#: captured batched-step graphs kept per plan (least recently used dropped): a few batch sizes x the rows' classes
BATCH_GRAPHS = 64


def assign_sets(homes: Sequence[int | None], busy: Sequence[bool]) -> list[int]:
    """Which running-state buffer set each row of a batched step uses: homes[i], the set that row's sequence is
    resident in now (None: none); busy[k], whether set k holds a live sequence. A row keeps its home; the others
    take the sets no row of the batch is resident in, idle ones (busy False) first, then lowest index, then new
    sets (indices from len(busy) up). Distinct rows get distinct sets."""
    taken = {h for h in homes if h is not None}
    free = sorted((k for k in range(len(busy)) if k not in taken), key=lambda k: (bool(busy[k]), k))
    nxt = len(busy)
    out = []
    for h in homes:
        if h is not None:
            out.append(h)
        elif free:
            out.append(free.pop(0))
        else:
            out.append(nxt)
            nxt += 1
    return out


class BatchStep:
    """A plan's batched decode step: the per-column page tables (int32 (SHORT_READ_COLS, n_pages) at a fixed address,
    rewritten when a row's pages change), the hybrid's running-state buffer sets (set 0 is the plan's own resident
    buffers, so a sequence decoded alone and then batched stays where it is; others made on first use) and the
    captured graphs, keyed by (form, N, each row's step arguments, each row's set)."""

    def __init__(self, plan):
        cp = plan.cp
        self.plan = plan
        self.pts = max(1, int(plan.pool.n_pages))
        self.tables = cp.zeros((settings.SHORT_READ_COLS, self.pts), cp.int32)
        self._tables_key: tuple | None = None
        res = getattr(plan, "resident", None)
        self.sets: list[Any] = [res] if res is not None and res.buf else []
        self.graphs: dict[tuple, Any] = {}

    @classmethod
    def of(cls, plan) -> "BatchStep":
        b = plan.__dict__.get("_batch_step")
        if b is None:
            b = plan.__dict__["_batch_step"] = cls(plan)
        return b

    # ---- per-column state
    def _attach(self, states) -> tuple[int, ...]:
        """Each row's running-state set (assign_sets), the sequences made resident there (copies on the current
        stream); () for a plan without running state."""
        if not self.sets:
            return ()
        homes = [next((k for k, r in enumerate(self.sets) if r.is_resident(st)), None) for st in states]
        busy = [r.owner() is not None and r.is_resident(r.owner()) for r in self.sets]
        which = assign_sets(homes, busy)
        from strata.memory import Carve
        plan = self.plan
        while len(self.sets) <= max(which):      # another set like the plan's own (ResidentState)
            self.sets.append(type(plan.resident)(plan.model.new_running_state(Carve(plan.lo, plan.hi))))
        for k, st in zip(which, states):
            self.sets[k].attach(st)
        return tuple(which)

    def _set_tables(self, states) -> None:
        """Row i's page table = states[i]'s pages (on the plan's stream, only when some row's pages changed)."""
        key = tuple(tuple(int(p) for p in st.kv.pages) for st in states)
        if key == self._tables_key:
            return
        t = np.zeros((settings.SHORT_READ_COLS, self.pts), np.int32)
        for i, pages in enumerate(key):
            t[i, :len(pages)] = pages
        self.tables.set(t, stream=self.plan.stream)
        self._tables_key = key

    # ---- the step
    def run(self, toks: np.ndarray, states, x, hidden: bool = False, on_device: bool = False) -> Any:
        """The batched step of len(states) <= SHORT_READ_COLS rows (checked by forward_batch) -> host f32 logits
        (N, n_vocab) on the last stage (on_device: a CuPy f32 (N, n_vocab) copy of its own, ordered on the current
        stream), else the hidden states, a CuPy f32 (N, n_embd) array of its own. hidden (the last stage): (those
        logits, the final-normed rows the head read, CuPy f32 (N, n_embd) of their own)."""
        plan, cp = self.plan, self.plan.cp
        n, C = len(states), settings.SHORT_READ_COLS
        for st in states:
            check_sequence(plan.pool, st)
            plan._check_state(st)
        for st in states:
            st.kv.reserve(1)                      # KVCacheFull here: pages reserved for other rows are harmless
        sets = self._attach(states)
        c = plan._short_buffers()
        pos = np.asarray([st.pos for st in states], np.int32)
        inp = np.zeros(3 * C, np.int32)
        inp[:n], inp[C:C + n], inp[2 * C:2 * C + n] = toks, pos, pos + 1
        rows = tuple(plan._step_args(settings.size_class(int(p) + 1)) for p in pos)
        plan.stream.wait_event(cp.cuda.get_current_stream().record())
        with plan.stream:
            self._set_tables(states)
            c["inp"].set(inp, stream=plan.stream)
            if x is not None:
                c["x"][:n] = x
            self._launch(plan._form(), n, rows, sets)
            if plan.last:
                res = c["logits"][:n].copy() if on_device else cp.asnumpy(c["logits"][:n], stream=plan.stream)
            else:
                res = c["x"][:n].copy()
            if hidden and plan.last:
                res = (res, c["hn"][:n].copy())
        cp.cuda.get_current_stream().wait_event(plan.stream.record())
        for i, st in enumerate(states):
            st.kv.commit(1)
            st.advance(toks[i:i + 1])
        return res

    def _launch(self, form: str, n: int, rows: tuple, sets: tuple) -> None:
        plan = self.plan
        if not plan.use_graphs:
            self._enqueue(form, n, rows, sets)
            return
        key = (form, n, rows, sets)
        g = self.graphs.pop(key, None)
        if g is None:
            plan.stream.begin_capture()
            try:
                self._enqueue(form, n, rows, sets)
            finally:
                g = plan.stream.end_capture()
            for k in list(self.graphs)[:max(0, len(self.graphs) + 1 - BATCH_GRAPHS)]:
                del self.graphs[k]
        self.graphs[key] = g
        g.launch(plan.stream)

    def _enqueue(self, form: str, n: int, rows: tuple, sets: tuple) -> None:
        tables = (self.tables.data.ptr, self.pts)
        if getattr(self.plan, "resident", None) is not None:       # the hybrid (Qwen35Cuda)
            enqueue_hybrid(self.plan, n, rows, tables, [self.sets[k] for k in sets])
        else:
            self.plan._enqueue_short(form, n, rows, True, tables=tables)


def enqueue_hybrid(plan, n: int, rows: tuple, tables: tuple[int, int], sets: list) -> None:
    """Qwen35Cuda's decode step over n columns, column i a sequence of its own: the matvecs, norms, gates, SwiGLU
    and attention through the column / rows launchers as the short read runs them (Qwen35Cuda._enqueue_short), but
    the conv and the delta-rule step of each column launched on its own set's running state with the decode step's
    own kernels, and RoPE, the K/V write and attention through each column's page table."""
    m = plan.model
    s = stream_ptr()
    plan._cols_embed(s, n)
    plan._cols_norm(s, n, "x", m.layers[plan.lo].attn_norm)
    glu_on = plan.dp4a and settings.GLU_HYBRID
    for li in range(plan.lo, plan.hi):
        L = m.layers[li]
        if L.recurrent:
            _cols_gdn(plan, s, n, li, L, sets)
        else:
            plan._cols_attn(s, n, li, L, rows, tables)
        plan._cols_norm(s, n, "o", L.post_norm, residual="x")
        glu = glu_pointers([w for w, _, _ in plan.w_gu[li]], plan.n_ff, plan.n_embd) if glu_on else None
        plan._cols_ffn(s, n, plan.w_gu[li], L.ffn.dense[2], glu)
        plan._cols_layer_end(s, n, li, L.post_norm)
    plan._cols_head(s, n, True)


def _cols_gdn(plan, s, n: int, li: int, L, sets: list) -> None:
    """A GDN layer over n columns of n sequences: the fused in-projection over the columns, strata_q35_conv and
    strata_q35_gdn_step per column on its set's buffers (the decode step's launches), the gated norm over the
    columns, ssm_out over the columns."""
    lb, m, c = lib(), plan.model, plan.c
    E = plan.n_embd
    conv_dim, vdim, nv, nk, dk, dv = m.conv_dim, m.value_dim, m.nv, m.nk, m.dk, m.dv
    plan._cols_mv(s, plan.w_in[li], "proj", "hn", "hq", E, n)
    P = c["proj"].shape[1]
    b_off = conv_dim + vdim
    for i in range(n):
        buf = sets[i].buf[li]
        check(lb.strata_q35_conv(s, plan._col("proj", i), ptr(L.conv), ptr(buf["conv"]), plan._col("y", i), conv_dim,
                                 m.d_conv), "strata_q35_conv")
        check(lb.strata_q35_gdn_step(s, plan._col("y", i), plan._col("proj", i), ptr(L.a), ptr(L.dt), ptr(buf["ssm"]),
                                     plan._col("ov", i), nv, nk, dk, dv, int(bool(m.tiled)), b_off, b_off + nv,
                                     int(L.w_ba is not None), float(1.0 / dk ** 0.5), L2_EPS),
              "strata_q35_gdn_step")
    check(lb.strata_q35_gated_norm_rows(s, plan._col("ov", 0), vdim, addr(c["proj"].data.ptr + 4 * conv_dim), P,
                                        ptr(L.ssm_norm), plan._col("vn", 0), vdim, plan._col_q("vq", 0),
                                        plan.cstride["vq"], n, nv, dv, plan.eps), "strata_q35_gated_norm_rows")
    plan._cols_mv(s, [(L.ssm_out, 0, E)], "o", "vn", "vq", vdim, n)


def forward_batch(pm, tokens, states, x=None, hidden: bool = False, on_device: bool = False):
    """PlanModel.forward_batch: Model.forward_batch's contract (one token per distinct sequence -> host f32 logits
    (N, n_vocab), or a stage's hidden states, CuPy f32 (N, n_embd); hidden on the last stage: (those logits, the
    final-normed rows, CuPy f32 (N, n_embd)), each as the lone step with hidden gives it); x: a later stage's input,
    already checked (runner.hidden_input); on_device: the logits as CuPy f32 (N, n_vocab) of their own, ordered on
    the current stream (no copy to the host). Sequences on the plan's pool whose plan has a column form go through
    BatchStep, SHORT_READ_COLS rows at a time; a lone row, or every row where the plan has no column form, takes its
    lone decode step (PlanModel.forward).
    ValueError, changing nothing, for a count mismatch, a repeated sequence, a bad token or what a lone step
    refuses."""
    m = pm.model
    toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
    n = int(toks.shape[0])
    if n == 0 or n != len(states):
        raise ValueError(f"a batched step takes one token per sequence (got {n} tokens for {len(states)} sequences)")
    if len({id(st) for st in states}) != n:
        raise ValueError("a batched step reads each sequence at most once")
    if int(toks.min()) < 0 or int(toks.max()) >= m.config.n_vocab:
        raise ValueError(f"token id out of range [0, {m.config.n_vocab})")
    if any(getattr(st, "steps", None) is not None for st in states):
        raise ValueError("a batched step cannot read a sequence armed to keep per-token states (a verify)")
    toks = toks.astype(np.int32)
    cp = m.backend.cp
    with m.backend.device:
        pools = {id(st.kv.pool) for st in states if st.kv is not None}
        plan = pm.plan(states[0].kv.pool) if len(pools) == 1 and all(pm._on_plan(st) for st in states) else None
        C = settings.SHORT_READ_COLS if plan is not None and plan._form() is not None else 1
        head = m.ends_with_head(pm.hi)
        hidden = hidden and head
        outs, hs = [], []
        for i in range(0, n, C):
            xi = None if x is None else x[i:i + C]
            if min(C, n - i) > 1:
                o = BatchStep.of(plan).run(toks[i:i + C], states[i:i + C], xi, hidden=hidden,
                                           on_device=on_device)
            elif on_device and head:    # one row: the lone decode step itself (its fused graph is the faster form)
                o = pm.forward_device(toks[i:i + 1], states[i], x_in=xi, hidden=hidden)
                o = (o[0].copy(), o[1]) if hidden else o.copy()     # forward_device's rows live until its next call
            else:
                o = pm.forward(toks[i:i + 1], states[i], x_in=xi, hidden=hidden)
            if hidden:
                o, h = o
                hs.append(cp.asarray(h).reshape(-1, m.config.n_embd))
            outs.append(o if min(C, n - i) > 1 else o.reshape(1, -1))
        if not head:
            return cp.concatenate([cp.asarray(o) for o in outs], axis=0)
        if on_device:
            logits = outs[0] if len(outs) == 1 else cp.concatenate(outs, axis=0)
            return (logits, cp.concatenate(hs, axis=0)) if hidden else logits
        logits = np.concatenate([np.asarray(o) for o in outs], axis=0)
        return (logits, cp.concatenate(hs, axis=0)) if hidden else logits
