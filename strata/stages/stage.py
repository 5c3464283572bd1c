"""StageBase (what the engine holds of a stage, local or remote: carve, device, memory, runner, capabilities read
from the memory); Stage, a carve of the model's layers on one device; ModelRunner, the runner that executes a carve
through the model's own forward (the CPU's, and any carve no faster plan runs)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from strata.memory import Carve, Memory


class ModelRunner:
    """Runs blocks [lo, hi) of `model` through ``model.forward_carve`` (backend ops: numpy + C core on the CPU,
    CuPy on a GPU). The CUDA plans (strata/backend/cuda*.py) offer the same two calls."""

    def __init__(self, model, lo: int, hi: int):
        self.model, self.lo, self.hi = model, lo, hi
        self.device_logits = getattr(model.backend, "xp", np) is not np    # forward_device's logits stay on a GPU

    def forward(self, tokens, state, all_logits: bool = False, x_in=None, hidden: bool = False):
        if hidden:
            return self.model.forward_carve(tokens, state, self.lo, self.hi, x_in=x_in, all_logits=all_logits,
                                            hidden=True)
        return self.model.forward_carve(tokens, state, self.lo, self.hi, x_in=x_in, all_logits=all_logits)

    def forward_batch(self, tokens, states, x_in=None, hidden: bool = False, on_device: bool = False):
        """One decode step of several sequences (``model.forward_batch`` of this carve; hidden: with the
        final-normed rows; on_device: the logits as the backend's array)."""
        if hidden:
            out = self.model.forward_batch(tokens, states, self.lo, self.hi, x_in=x_in, hidden=True)
        else:
            out = self.model.forward_batch(tokens, states, self.lo, self.hi, x_in=x_in)
        return self._logits_on_device(out, hidden) if on_device else out

    def verify_batch(self, token_lists, states, x_in=None):
        """Several sequences' speculative verifies (``model.verify_batch`` of this carve)."""
        return self.model.verify_batch(token_lists, states, self.lo, self.hi, x_in=x_in)

    def forward_device(self, tokens, state, x_in=None, hidden: bool = False, all_logits: bool = False):
        """forward() with the last token's logits (all_logits: every row's) as the backend's array (hidden: (those,
        the final-normed rows))."""
        return self._logits_on_device(self.forward(tokens, state, all_logits=all_logits, x_in=x_in, hidden=hidden),
                                      hidden)

    def _logits_on_device(self, out, hidden: bool):
        """A forward's result with its logits as the backend's array (hidden: (logits, rows)); a carve without the
        head: its hidden states as they are."""
        if not self.model.ends_with_head(self.hi):
            return out
        return (self.model.backend.asarray(out[0]), out[1]) if hidden else self.model.backend.asarray(out)

    @property
    def moe_path(self):
        """The model's own MoE path (its forward runs the layers), or None for a model without MoE layers."""
        return getattr(self.model, "moe_path", None)


class StageBase(ABC):
    """What the engine holds of a stage, local or remote: ``index``, ``carve``, ``device``, ``first`` / ``last``,
    its ``memory`` and its runner.

    The state verbs (new_seq, reserve, capture, validate, restore, truncate, reset, hashes, materialize, hold,
    write, read, ...) are the memory's (strata.memory.Memory on a local stage, each verb in the stage's own device
    scope; the link's on a remote one): callers call ``stage.memory.<verb>`` and read its capabilities
    (``holds_pages``, ``host_parts``, ``cuts_anywhere``) instead of probing for methods. A stage itself runs the
    carve (``forward``) and answers for its device or link (settle, lost, unavailable, close, memory_info,
    status).
    """

    index: int
    carve: Carve
    device: str
    memory: Any
    first: bool
    last: bool

    @abstractmethod
    def forward(self, tokens: np.ndarray, sid: int, x_in=None, all_logits: bool = False, on_device: bool = False,
                hidden: bool = False):
        """Read `tokens` of sequence `sid` through this stage -> hidden states for the next stage, or, on the last
        stage, the logits (host float32; with on_device, the last token's logits as a device array, every row's
        with all_logits; with hidden, (logits, the final-normed hidden states of every row), where
        ``speculates``)."""

    def forward_batch(self, tokens: np.ndarray, sids: list[int], x_in=None, hidden: bool = False,
                      on_device: bool = False):
        """One decode step of several sequences: token i read by sequence ``sids[i]`` (distinct) at its own position
        -> the last stage's logits, host float32 (N, n_vocab), else the hidden states (N, n_embd) for the next
        stage (x_in: the previous stage's, one row per sequence). Row i is bit-identical to ``forward([tokens[i]],
        sids[i])`` whatever the other rows are and whichever row it sits in. hidden (the last stage): (those
        logits, the final-normed rows (N, n_embd), each as ``forward(..., hidden=True)`` gives it), for the MTP
        drafters. on_device: the logits may be left on the device (a runner that keeps them there; host rows
        otherwise). This default runs those lone forwards one after the other (host logits); a local stage's runner
        reads each weight once for all rows."""
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if toks.shape[0] != len(sids) or len(set(sids)) != len(sids):
            raise ValueError(f"a batched step takes one token per distinct sequence (got {toks.shape[0]} tokens for "
                             f"sequences {list(sids)})")
        kw = {"hidden": True} if hidden and self.last else {}
        outs = [self.forward(toks[i:i + 1], sid, x_in=None if x_in is None else x_in[i:i + 1], **kw)
                for i, sid in enumerate(sids)]
        if kw:
            hs = [o[1] for o in outs]
            xp = np if isinstance(hs[0], np.ndarray) else __import__("cupy")
            return np.stack([np.asarray(o[0]).reshape(-1) for o in outs]), xp.concatenate(hs, axis=0)
        if self.last:
            return np.stack([np.asarray(o).reshape(-1) for o in outs])
        xp = np if isinstance(outs[0], np.ndarray) else __import__("cupy")
        return xp.concatenate(outs, axis=0)

    def verify_batch(self, token_lists, sids: list[int], x_in=None):
        """Speculative verifies of several sequences (each armed to keep its per-token states): token_lists[i] read
        by sequence ``sids[i]`` (distinct) -> on the last stage (host float32 logits of every row, the final-normed
        rows), else the hidden states for the next stage, rows sequence by sequence (x_in: the previous stage's, in
        that order), each row bit-identical to that sequence's own verify. This default runs those verifies one
        after the other; a local CPU stage reads each weight once for all rows."""
        outs, at = [], 0
        for toks, sid in zip(token_lists, sids):
            n = len(toks)
            xi = None if x_in is None else x_in[at:at + n]
            at += n
            outs.append(self.forward(np.asarray(toks, np.int32), sid, x_in=xi, all_logits=True, hidden=self.last))
        if self.last:
            hs = [o[1] for o in outs]
            xp = np if isinstance(hs[0], np.ndarray) else __import__("cupy")
            return np.concatenate([np.asarray(o[0]) for o in outs], axis=0), xp.concatenate(hs, axis=0)
        xp = np if isinstance(outs[0], np.ndarray) else __import__("cupy")
        return xp.concatenate(outs, axis=0)

    @property
    def speculates(self) -> str | None:
        """Why this stage cannot take part in speculative decoding (a verify keeping per-position states, its
        Commit, and on the last stage the drafter's hidden states), or None when it can."""
        return "this stage does not run speculative decoding"

    @property
    @abstractmethod
    def device_logits(self) -> bool:
        """Whether this stage can leave the logits on its device (the engine then samples there)."""

    def settle(self) -> None:
        """Wait until nothing sent ahead is in flight (a remote stage's Commits); nothing on a local stage."""

    def lost(self, sid: int = 0) -> bool:
        """Whether this stage lost live sequence `sid`'s state behind the engine's back (never, locally)."""
        return False

    def unavailable(self) -> str | None:
        """Why the stage cannot run requests now (a remote stage's link is down), or None."""
        return None

    def close(self) -> None:
        """Let go of what the stage holds outside this process (a remote stage's link); nothing locally."""

    @abstractmethod
    def memory_info(self) -> dict[str, int]:
        """The device's memory numbers (empty where there are none)."""

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """JSON-ready: index, carve, device, runner and the memory's numbers."""


class Stage(StageBase):
    """Layers ``carve`` of the model on ``device``: stage 0 embeds the tokens, the last stage ends
    with the output head; the others take and return hidden states.

    The stage owns its ``memory`` (every sequence's KV pages / running state / drafter K/V for its layers, each
    verb drained and run on this stage's device) and its ``runner`` (ModelRunner, or the backend's CUDA plan of the
    carve).
    """

    def __init__(self, index: int, carve: Carve, device: str, backend, model, memory: Memory, runner):
        self.index, self.carve, self.device = index, carve, device
        self.backend, self.model, self.memory, self.runner = backend, model, memory, runner
        self.first = carve.lo == 0
        self.last = carve.hi == model.n_blocks and getattr(model, "head_here", True)

    @property
    def device_logits(self) -> bool:
        """Whether this stage's runner can leave the logits on its device (the engine then samples there)."""
        return bool(getattr(self.runner, "device_logits", False))

    @property
    def speculates(self) -> str | None:
        """None on a CPU stage run by the model's own forward and on a GPU stage whose plan keeps a verify's
        per-position states on the device (``keeps_states``: the hybrid's CUDA plan); the reason otherwise."""
        if self.backend.xp is np and isinstance(self.runner, ModelRunner):
            return None
        if getattr(self.runner, "keeps_states", False):
            return None
        return (f"stage {self.index} runs on {self.device} through {type(self.runner).__name__}, whose verify "
                "keeps no per-position states")

    def forward(self, tokens: np.ndarray, sid: int, x_in=None, all_logits: bool = False, on_device: bool = False,
                hidden: bool = False):
        """Read `tokens` of sequence `sid` through this stage. x_in: the previous stage's hidden states (moved to
        this stage's device here). Returns the hidden states for the next stage, or, on the last stage, the logits
        (host float32; with on_device, the last token's logits as a device array, every row's with all_logits;
        with hidden, (logits, the final-normed hidden states of every row))."""
        if x_in is not None and not isinstance(x_in, np.ndarray) and self.backend.xp is np:
            x_in = self.backend.to_host(x_in)
        elif x_in is not None and self.backend.xp is not np:
            with self.backend.device:
                x_in = self.backend.xp.asarray(x_in)         # a peer copy when it is on another GPU
        st = self.memory.seq(sid)
        if on_device and self.last:
            kw = {"all_logits": True} if all_logits else {}      # every row's logits left on the device (a verify)
            if hidden:
                return self.runner.forward_device(tokens, st, x_in=x_in, hidden=True, **kw)
            return self.runner.forward_device(tokens, st, x_in=x_in, **kw)
        if hidden and self.last:
            return self.runner.forward(tokens, st, all_logits=all_logits, x_in=x_in, hidden=True)
        return self.runner.forward(tokens, st, all_logits=all_logits, x_in=x_in)

    def forward_batch(self, tokens: np.ndarray, sids: list[int], x_in=None, hidden: bool = False,
                      on_device: bool = False):
        """StageBase.forward_batch through the runner's ``forward_batch`` (every weight read once for the N rows,
        the final-normed rows too where the MTP drafters want them; the CUDA plans: the decode step over N columns,
        the logits left on the device with on_device), the lone forwards where the runner has none or N is 1."""
        run = getattr(self.runner, "forward_batch", None)
        hidden = hidden and self.last
        if run is None or len(sids) == 1:
            return super().forward_batch(tokens, sids, x_in, hidden)   # one row: the lone forward itself
        if len(set(sids)) != len(sids):
            raise ValueError(f"a batched step reads each sequence at most once (got sequences {list(sids)})")
        if x_in is not None and not isinstance(x_in, np.ndarray) and self.backend.xp is np:
            x_in = self.backend.to_host(x_in)
        elif x_in is not None and self.backend.xp is not np:
            with self.backend.device:
                x_in = self.backend.xp.asarray(x_in)
        kw = {"hidden": True} if hidden else {}
        if on_device and self.last and self.device_logits:
            kw["on_device"] = True           # the CUDA runners' forward_batch (device_logits: a GPU keeps them)
        return run(tokens, [self.memory.seq(sid) for sid in sids], x_in=x_in, **kw)

    def verify_batch(self, token_lists, sids: list[int], x_in=None):
        """StageBase.verify_batch through the model's own ``verify_batch`` (ModelRunner: every weight read once for
        all rows on the CPU), the verifies one after the other elsewhere."""
        if not isinstance(self.runner, ModelRunner) or len(sids) < 2:
            return super().verify_batch(token_lists, sids, x_in)
        if x_in is not None and not isinstance(x_in, np.ndarray) and self.backend.xp is np:
            x_in = self.backend.to_host(x_in)
        return self.runner.verify_batch(token_lists, [self.memory.seq(sid) for sid in sids], x_in=x_in)

    def memory_info(self) -> dict[str, int]:
        """The device's memory numbers (CUDA: total / free bytes and CuPy's pool, read on this stage's device);
        empty on the CPU."""
        info = getattr(self.backend, "memory_info", None)
        if info is None:
            return {}
        with self.backend.device:
            return dict(info())

    def status(self) -> dict[str, Any]:
        """JSON-ready: index, carve, device, runner, the memory's numbers and, for an MoE model, the MoE path its
        runner takes (``moe``: {"decode": "graph" | "generic", "prefill": "grouped" | "generic"})."""
        out = {"index": self.index, "layer_lo": self.carve.lo, "layer_hi": self.carve.hi, "device": self.device,
               "runner": type(self.runner).__name__, "memory": self.memory.stats()}
        moe = getattr(self.runner, "moe_path", None)
        if moe is not None:
            out["moe"] = dict(moe)
        return out
