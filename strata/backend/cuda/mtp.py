"""The MTP drafter's one-row step on a GPU: the MTP block of a qwen35 / qwen3next model run as a one-layer carve of
the hybrid's decode plan (Qwen35Cuda, one CUDA graph per context-size class), its output head and device argmax
included, over the drafter's K/V pages.

One step at MTP position p (the drafter table's length): x = eh_proj([enorm(embed(t)), hnorm(h)]) (the backend's
ops: a handful of launches), then the plan's step on x as the input of "layer" n_layer: the attention block with its
FFN, shared_head_norm into the plan's ``hn`` (the next step's h), the head's logits and their argmax on the device.
Only the argmax (4 bytes) comes to the host. Numerics are the decode plan's (q8_1 activations), not the model's own
``mtp_hidden``: drafts may differ at near ties, which changes what is accepted, never what is emitted.
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
    use per pool). ``step(h, token, table)``: one MTP position appended to `table` -> (the argmax draft token, its
    logits CuPy f32 (n_vocab,), the block's head-normed output CuPy f32 (1, n_embd)); the two arrays are the plan's
    buffers, valid until the next step."""

    def __init__(self, model):
        why = unsupported(model)
        if why:
            raise ValueError(f"the MTP graph step cannot run this model: {why}")
        self.model = model
        self.view = _MTPView(model)
        self.plans: dict[int, Any] = {}

    def _plan(self, pool):
        from strata.backend.cuda.qwen35 import Qwen35Cuda
        p = self.plans.get(id(pool))
        if p is None or p.pool is not pool:
            n = self.model.n_layer
            p = self.plans[id(pool)] = Qwen35Cuda(self.view, pool, lo=n, hi=n + 1)
        return p

    def _input(self, h, token: int):
        """x = eh_proj([enorm(embed(token)), hnorm(h)]) as CuPy f32 (1, n_embd)."""
        md = self.model
        be, m, xp = md.backend, md.mtp, md.xp
        e = be.embed(m["embed"] if m["embed"] is not None else md.tok_embd, np.asarray([token], np.int32))
        h = xp.asarray(h, dtype=np.float32).reshape(1, -1)
        x = xp.concatenate([be.rms_norm(e, m["enorm"], md.eps), be.rms_norm(h, m["hnorm"], md.eps)], axis=1)
        return xp.ascontiguousarray(be.matmul(xp.ascontiguousarray(x), m["eh_proj"]), dtype=np.float32)

    def step(self, h, token: int, table):
        if not isinstance(table.pool, CudaPagePool):
            raise ValueError("the drafter's K/V table is not in a CUDA page pool")
        with self.model.backend.device:
            plan = self._plan(table.pool)
            x = self._input(h, int(token))
            logits = plan.decode_device(int(token), _TableSeq(table), x)
            return int(plan.d["inp"][0]), logits, plan.d["hn"][:1]
