"""The MTP drafter's one-row step on a GPU: the MTP block of a qwen35 / qwen3next model run as a one-layer carve of
the hybrid's decode plan (MTPPlan, a Qwen35Cuda; one CUDA graph per context-size class) over the drafter's K/V
pages, its input, output head and argmax inside the graph.

One step at MTP position p (the drafter table's length): x = eh_proj([enorm(embed(t)), hnorm(h)]) (t: inp[0]; h: the
plan's ``hn`` row, the previous step's output or the main model's row copied in), then the attention block with its
FFN, shared_head_norm into ``hn`` (the next step's h), the head's logits and their argmax into inp[0]. Only the
argmax (4 bytes) comes to the host. Numerics are the decode plan's (q8_1 activations in the block, f32 into
eh_proj), not the model's own ``mtp_hidden``: drafts may differ at near ties, which changes what is accepted, never
what is emitted.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from strata.backend.cuda.pages import CudaPagePool
from strata.backend.cuda.weights import DeviceWeight


class _MTPView:
    """The model as the plan sees the MTP block: layers ``n_layer`` + 1 (the block appended, attention), the head
    norm and head the MTP block's (shared_head_norm; the model's output head where it has none of its own);
    everything else the model's."""

    def __init__(self, model):
        m = model.mtp
        self._m = model
        self.layers = list(model.layers) + [m["block"]]
        self.recurrent = list(model.recurrent) + [False]
        self.n_layer = model.n_layer + 1
        self.n_blocks = self.n_layer
        self.out_norm = m["head_norm"] if m["head_norm"] is not None else model.out_norm
        self.output = m["head"] if m["head"] is not None else model.output
        self.moe = False

    def __getattr__(self, name):
        return getattr(self._m, name)

    def ends_with_head(self, hi: int) -> bool:
        return hi == self.n_layer

    def new_running_state(self, carve=None) -> dict:
        return {}


class _TableSeq:
    """The drafter's K/V table as the plan's sequence: position = the table's length, no running state."""

    def __init__(self, table):
        self.kv, self.pos = table, table.length
        self.running: dict = {}
        self.steps = None

    def advance(self, tokens) -> None:
        self.pos += len(tokens)


def unsupported(model) -> str | None:
    """Why the MTP block of `model` cannot run as a graph step (one line), or None."""
    from strata.backend.cuda.qwen35 import unsupported as plan_unsupported
    m = getattr(model, "mtp", None)
    if m is None:
        return "the model has no MTP block loaded"
    if m["block"].ffn.dense is None:
        return "the MTP block has an MoE FFN"
    if not isinstance(m["eh_proj"], DeviceWeight):
        return "the MTP weights are not on the CUDA backend"
    view = _MTPView(model)
    return plan_unsupported(view, model.n_layer, model.n_layer + 1)


class MTPStep:
    """The graph step of `model`'s MTP block over the drafter tables of one CudaPagePool (the plan is made on first
    use per pool). ``step(token, table, h=None)``: one MTP position appended to `table`, from `h` (the main
    model's final-normed hidden row there) or, with h None, from the previous step's output (drafting past the main
    model's rows) -> (the argmax draft token, its logits CuPy f32 (n_vocab,)); the logits are the plan's buffer,
    valid until the next step."""

    def __init__(self, model):
        why = unsupported(model)
        if why:
            raise ValueError(f"the MTP graph step cannot run this model: {why}")
        self.model = model
        self.view = _MTPView(model)
        self.plans: dict[int, Any] = {}

    def _plan(self, pool):
        p = self.plans.get(id(pool))
        if p is None or p.pool is not pool:
            p = self.plans[id(pool)] = _plan_class()(self.view, pool, self.model)
        return p

    def step(self, token: int, table, h=None):
        if not isinstance(table.pool, CudaPagePool):
            raise ValueError("the drafter's K/V table is not in a CUDA page pool")
        with self.model.backend.device:
            plan = self._plan(table.pool)
            logits = plan.step(int(token), table, h)
            return int(plan.d["inp"][0]), logits


_PLAN = None


def _plan_class():
    """MTPPlan (made on first use: the hybrid's plan module loads the kernel library)."""
    global _PLAN
    if _PLAN is not None:
        return _PLAN
    from strata.backend.cuda.library import check, ffi, fptr, lib, ptr
    from strata.backend.cuda.qwen35 import Qwen35Cuda

    class MTPPlan(Qwen35Cuda):
        """Qwen35Cuda over the MTP block alone (the carve [n_layer, n_layer + 1) of _MTPView), its input made in
        the graph: the token's embedding row (inp[0]) and the hidden row in d['hn'] (the previous step's
        shared_head_norm output, or the main model's row copied in), each RMSNormed (enorm, hnorm) into the halves
        of d['cat'], eh_proj's matvec into d['x']."""

        label = "MTP graph step"

        def __init__(self, view, pool, model):
            n = model.n_layer
            super().__init__(view, pool, lo=n, hi=n + 1)
            cp, E = self.cp, self.n_embd
            self.d.update({"e": cp.zeros((1, E), cp.float32), "cat": cp.zeros((1, 2 * E), cp.float32)})
            self.mtp = model.mtp
            self.embed_w = self.mtp["embed"] if self.mtp["embed"] is not None else model.tok_embd

        def _embed_row(self, s, tok_p) -> None:
            lb, d, m, E = lib(), self.d, self.mtp, self.n_embd
            NULL = ffi().NULL
            w = self.embed_w
            check(lb.strata_get_rows(s, w.ggml_type, ptr(w), tok_p, ptr(d["e"]), 1, E), "get_rows")
            check(lb.strata_rms_norm_ex(s, ptr(d["e"]), NULL, ptr(m["enorm"]), ptr(d["cat"]), NULL, NULL, NULL, 1, E,
                                        self.eps), "rms_norm")
            check(lb.strata_rms_norm_ex(s, ptr(d["hn"]), NULL, ptr(m["hnorm"]), fptr(d["cat"], E), NULL, NULL, NULL,
                                        1, E, self.eps), "rms_norm")
            eh = m["eh_proj"]
            check(lb.strata_matvec(s, eh.ggml_type, ptr(eh), ptr(d["cat"]), ptr(d["x"]), E, 2 * E, 1), "matvec")

        def step(self, token: int, table, h=None):
            """One MTP position at table.length (see MTPStep.step) -> the logits (the plan's buffer)."""
            seq = _TableSeq(table)
            self._begin(seq, token, 1)
            with self.stream:
                if h is not None:
                    self.d["hn"][...] = self.cp.asarray(h, dtype=self.cp.float32).reshape(1, self.n_embd)
                self._launch(seq.pos + 1)
            self.cp.cuda.get_current_stream().wait_event(self.stream.record())
            table.commit(1)
            return self.d["logits"][0]

    _PLAN = MTPPlan
    return _PLAN
