"""Stage: a carve of the model's layers on one device, with its memory and its runner; ModelRunner, the runner
that executes a carve through the model's own forward (the CPU's, and any carve no faster plan runs)."""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from strata.memory import Carve, Memory, StatePart


class ModelRunner:
    """Runs blocks [lo, hi) of `model` through ``model.forward_carve`` (backend ops: numpy + C core on the CPU,
    CuPy on a GPU). The CUDA plans (strata/backend/cuda*.py) offer the same two calls."""

    def __init__(self, model, lo: int, hi: int):
        self.model, self.lo, self.hi = model, lo, hi
        self.device_logits = getattr(model.backend, "xp", np) is not np    # forward_device's logits stay on a GPU

    def forward(self, tokens, state, all_logits: bool = False, x_in=None):
        return self.model.forward_carve(tokens, state, self.lo, self.hi, x_in=x_in, all_logits=all_logits)

    def forward_device(self, tokens, state, x_in=None):
        out = self.forward(tokens, state, x_in=x_in)
        return self.model.backend.asarray(out) if self.model.ends_with_head(self.hi) else out

    @property
    def moe_path(self):
        """The model's own MoE path (its forward runs the layers), or None for a model without MoE layers."""
        return getattr(self.model, "moe_path", None)


class Stage:
    """Layers ``carve`` of the model on ``device``: stage 0 embeds the tokens, the last stage ends
    with the output head; the others take and return hidden states.

    The stage owns its ``memory`` (every sequence's KV pages / running state / drafter K/V for its layers) and
    its ``runner`` (ModelRunner, or the backend's CUDA plan of the carve). Everything the engine does to a
    stage goes through the methods below; state is read (capture, hashes, write) or written (restore) only after
    the stage's own device drained (``backend.drain``).
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

    def on_device(self):
        """This stage's device made current (a context manager): the copies its memory makes (a page copied for a
        parked conversation, running state restored) run on its own card and stream; nothing on the
        CPU."""
        return getattr(self.backend, "device", None) or contextlib.nullcontext()

    # ---- compute ---------------------------------------------------------------------------------
    def reserve(self, sid: int, n: int) -> None:
        """Pages for n more tokens of sequence `sid` (KVCacheFull changes nothing; extra pages are harmless)."""
        st = self.memory.seq(sid)
        if st.kv is not None:
            with self.on_device():
                st.kv.reserve(n)

    def forward(self, tokens: np.ndarray, sid: int, x_in=None, all_logits: bool = False, on_device: bool = False):
        """Read `tokens` of sequence `sid` through this stage. x_in: the previous stage's hidden states (moved to
        this stage's device here). Returns the hidden states for the next stage, or, on the last stage, the logits
        (host float32; with on_device, the last token's logits as a device array)."""
        if x_in is not None and not isinstance(x_in, np.ndarray) and self.backend.xp is np:
            x_in = self.backend.to_host(x_in)
        elif x_in is not None and self.backend.xp is not np:
            with self.backend.device:
                x_in = self.backend.xp.asarray(x_in)         # a peer copy when it is on another GPU
        st = self.memory.seq(sid)
        if on_device and self.last:
            return self.runner.forward_device(tokens, st, x_in=x_in)
        return self.runner.forward(tokens, st, all_logits=all_logits, x_in=x_in)

    # ---- state -----------------------------------------------------------------------------------
    def settle(self) -> None:
        """Nothing is ever in flight on a local stage (a remote one waits for its Commits here)."""

    def lost(self) -> bool:
        """Whether this stage lost the live sequence's state behind the engine's back (never, locally)."""
        return False

    def unavailable(self) -> str | None:
        """Why the stage cannot run requests now (a remote stage's link is down), or None."""
        return None

    def new_seq(self) -> int:
        return self.memory.new_seq()

    def drop_seq(self, sid: int) -> None:
        """Give sequence `sid`'s pages back and forget it (drained first)."""
        self.backend.drain()
        self.memory.drop_seq(sid)

    def pos(self, sid: int) -> int:
        return self.memory.seq(sid).pos

    def capture(self, sid: int) -> StatePart:
        self.backend.drain()
        with self.on_device():
            return self.memory.capture(sid)

    def validate(self, part: StatePart, sid: int | None = None) -> None:
        self.memory.validate(part, sid)

    def restore(self, sid: int, part: StatePart) -> None:
        self.backend.drain()
        with self.on_device():
            self.memory.restore(sid, part)

    def check_truncate(self, sid: int, p: int) -> None:
        self.memory.check_truncate(sid, p)

    def truncate(self, sid: int, p: int) -> None:
        with self.on_device():
            self.memory.truncate(sid, p)

    def reset(self, sid: int) -> None:
        self.backend.drain()
        with self.on_device():
            self.memory.reset(sid)

    def trim(self, sid: int) -> None:
        self.memory.trim(sid)

    def hashes(self, sid: int) -> dict[str, str]:
        self.backend.drain()
        with self.on_device():
            return self.memory.hashes(sid)

    def nbytes(self, sid: int) -> int:
        return self.memory.nbytes(sid)

    def materialize(self, part: StatePart) -> StatePart:
        self.backend.drain()
        with self.on_device():
            return self.memory.materialize(part)

    def detach(self, part: StatePart, to_host: bool = True) -> StatePart:
        self.backend.drain()
        with self.on_device():
            return self.memory.detach(part, to_host)

    def hold(self, part: StatePart) -> StatePart:
        return self.memory.hold(part)

    def release(self, part: StatePart) -> None:
        self.backend.drain()                 # nothing may still read the pages when another sequence takes them
        with self.on_device():
            self.memory.release(part)

    def attach_prefix(self, sid: int, part: StatePart) -> StatePart:
        with self.on_device():
            return self.memory.attach_prefix(sid, part)

    def write(self, part: StatePart, io) -> int:
        self.backend.drain()
        with self.on_device():
            return self.memory.write(part, io)

    def read(self, io) -> StatePart:
        return self.memory.read(io)

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
