"""RecurrentMemory: the running state of a stage's recurrent layers (it only moves forward), behind the Memory
interface."""
from __future__ import annotations

from typing import Any

import numpy as np

from strata.memory.host import sha_arrays
from strata.memory.memory import Field, Memory
from strata.memory.part import Carve, PartMismatch


class RecurrentMemory(Memory, Field):
    """Running state of the carve's recurrent layers: `init` is layer -> {name: zeroed array} (float32, numpy or
    CuPy), the state every sequence starts from. A running state only moves forward: truncate refuses any
    position but its own and 0 (restore a checkpoint instead). backend: see Memory."""

    def __init__(self, carve: Carve, init: dict[int, dict[str, Any]], xp: Any = np, identity: dict | None = None,
                 backend: Any = None):
        super().__init__(carve, identity, backend)
        bad = [li for li in init if li not in carve]
        if bad:
            raise ValueError(f"recurrent layers {bad} are outside the carve {carve}")
        self.init = init
        self._kept: dict[int, dict] = {}     # sid -> the buffers of its last keep (reused by the next verify)
        self.xp = xp            # the arrays' module (numpy, or CuPy on a GPU stage)

    def _cuts_anywhere(self):
        return not self.init

    def _open(self, st):
        st.running = {li: {k: a.copy() for k, a in d.items()} for li, d in self.init.items()}

    def _close(self, st):
        st.running = {}
        st.steps = None
        st.marks = None
        self._kept.pop(st.sid, None)

    def _check_truncate(self, st, p):
        if self.init:
            raise ValueError(f"cannot cut a recurrent running state back from {st.pos} to {p}; "
                             "restore a checkpoint instead")

    def _truncate(self, st, p):
        pass

    def _keep(self, st, n):
        from strata.memory.sequence_state import Steps
        if not self.init:
            return
        bufs = self._kept.get(st.sid)
        if bufs is None or next(iter(next(iter(bufs.values())).values())).shape[0] < n:
            bufs = {li: {k: self.xp.empty((n,) + tuple(a.shape), a.dtype) for k, a in d.items()}
                    for li, d in self.init.items()}
            self._kept[st.sid] = bufs
        st.steps = Steps(st.pos, n, bufs)

    def _unkeep(self, st):
        st.steps = None

    def _commit(self, st, p):
        i = p - st.steps.base - 1                   # the state after token p - 1
        pairs = [(a, st.steps.layers[li][k][i]) for li, d in st.running.items() for k, a in d.items()]
        many = getattr(self.backend, "copy_many", None) if self.xp is not np else None
        if many is not None:
            many(pairs)                             # one launch on a GPU
            return
        for a, b in pairs:
            a[...] = b

    def _mark(self, st):
        for bufs in st.marks.at.values():        # fresh arrays each (a checkpoint takes them over), carved from one
            bufs.update(self._carve_like(self.init))    # allocation per mark

    def _carve_like(self, like: dict) -> dict:
        """Arrays shaped as `like`'s (layer -> {name: array}), carved from one allocation (256-byte aligned)."""
        layout, total = [], 0
        for li, d in like.items():
            for k, a in d.items():
                layout.append((li, k, a, total))
                total += -(-int(a.nbytes) // 256) * 256
        flat = self.xp.empty(total, self.xp.uint8)
        out: dict = {li: {} for li in like}
        for li, k, a, off in layout:
            out[li][k] = flat[off:off + int(a.nbytes)].view(a.dtype).reshape(a.shape)
        return out

    def _capture_at(self, st, part, p):
        if self.init and p not in st.marks.read:
            raise ValueError(f"capture_at({p}): the forward did not keep the running state there (its runner "
                             "takes no marks)")
        part.running = st.marks.at[p]

    def _reset(self, st):
        st.steps = None
        st.marks = None
        for li, d in self.init.items():
            for k, a in d.items():
                st.running[li][k][...] = a

    def _geometry(self, g):
        g["running"] = {str(li): {k: [list(a.shape), np.dtype(a.dtype).str] for k, a in sorted(d.items())}
                        for li, d in sorted(self.init.items())}

    def _capture(self, st, part):
        many = getattr(self.backend, "copy_many", None) if self.xp is not np else None
        if many is None or not st.running or not all(a.flags.c_contiguous for d in st.running.values()
                                                      for a in d.values()):
            part.running = {li: {k: a.copy() for k, a in d.items()} for li, d in st.running.items()}
            return
        # on a GPU: one allocation carved into the part's arrays and one copy launch on the current stream, ordered
        # after the forward that wrote the state and before the next one (no drain, no host wait)
        part.running = self._carve_like(st.running)
        many([(part.running[li][k], a) for li, d in st.running.items() for k, a in d.items()])

    def _check(self, part, st):
        if set(part.running) != set(self.init):
            raise PartMismatch(f"the part's running-state layers {sorted(part.running)} differ from stage "
                               f"{self.carve}'s {sorted(self.init)}")
        for li, d in self.init.items():
            if set(part.running[li]) != set(d):
                raise PartMismatch(f"the part's running state of layer {li} has {sorted(part.running[li])}, "
                                   f"expected {sorted(d)}")
            for k, a in d.items():
                b = part.running[li][k]
                if tuple(b.shape) != tuple(a.shape) or np.dtype(b.dtype) != np.dtype(a.dtype):
                    raise PartMismatch(f"running state {li}/{k} is {tuple(b.shape)} {np.dtype(b.dtype)}, "
                                       f"expected {tuple(a.shape)} {np.dtype(a.dtype)}")

    def _restore(self, st, part):
        st.steps = None
        st.marks = None
        for li, d in part.running.items():
            for k, a in d.items():
                dst = st.running[li][k]
                dst[...] = self.xp.asarray(a)

    def _materialize(self, part, out):
        pass                                        # Memory.materialize copies the running state

    def _attach(self, st, part, out):
        out.running = {li: {k: self.xp.array(a) for k, a in d.items()} for li, d in part.running.items()}

    def _expect(self, pos, lengths, out, prefix=(), rows=None):
        for li, d in sorted(self.init.items()):
            for k, a in sorted(d.items()):
                out.append((f"running.L{li}.{k}", tuple(a.shape), np.dtype(a.dtype)))

    def _hashes(self, st, out):
        for li in sorted(st.running):
            d = st.running[li]
            out[f"running.L{li}"] = sha_arrays(*(d[k] for k in sorted(d)))

    def _nbytes(self, st):
        return sum(int(a.nbytes) for d in st.running.values() for a in d.values())

    def _stats(self, out):
        out["running"] = {"layers": len(self.init),
                          "bytes_per_sequence": sum(int(a.nbytes) for d in self.init.values() for a in d.values())}

