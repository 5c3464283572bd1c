"""Memory: the interface of what one stage keeps for its sequences (KV pages, running state, the drafter's K/V), in
the spirit of llama.cpp's llama-memory.h, every verb run in the stage's own device scope; Field, the hooks one kind
of state implements (KVMemory, RecurrentMemory; HybridMemory holds several)."""
from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from typing import Any, BinaryIO

import numpy as np

import strata.memory.codec as codec
from strata.memory.host import host_copy, with_field_hashes   # host_copy: strata.backend.cuda imports it from here
from strata.memory.part import Carve, KVPages, PartMismatch, StatePart
from strata.memory.sequence_state import SequenceState


def _diff(a: Any, b: Any, path: str = "") -> str | None:
    """Where two geometry trees first differ: 'path: part X, stage Y', or None when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        nested = lambda k: isinstance(a.get(k), (dict, list)) or isinstance(b.get(k), (dict, list))  # noqa: E731
        first = ("identity", "carve")          # which model, which layers: then plain fields, then nested ones
        for k in sorted(set(a) | set(b), key=lambda k: (k not in first, nested(k), str(k))):
            if k not in a or k not in b:
                side = "stage" if k not in a else "part"
                return f"{path + '.' if path else ''}{k}: only the {side} has it"
            d = _diff(a[k], b[k], f"{path + '.' if path else ''}{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: part {a!r}, stage {b!r}"


def on_device(drain: bool = True):
    """A Memory verb run in the memory's device scope (Memory.scope): the device drained first (drain=True: nothing
    in flight still reads or writes the state) and made current, so the copies the verb makes run on the stage's
    own card and stream."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(self, *args, **kw):
            with self.scope(drain):
                return fn(self, *args, **kw)
        return run
    return wrap


class Memory:
    """One stage's per-sequence state: sequences by id, each a SequenceState.

    Operations: ``new_seq`` / ``drop_seq``; ``truncate`` (attention: to any prefix; a recurrent state refuses
    anything but its own position or 0); ``reset``; ``capture`` -> StatePart (running state copied, K/V pages held: valid whatever the sequence does next, until
    ``release``);
    ``validate`` then ``restore`` (nothing is written unless every check passed); ``materialize`` (a part's K/V as
    host copies); ``write(part, io)`` / ``read(io)`` (the byte codec, memory/codec.py); ``hashes`` (per layer and
    field); ``nbytes``; ``geometry`` (what a part must match). Subclasses implement the ``_`` hooks for their own
    field (Field); a verb runs the hooks of every field in ``fields`` in order (one: the memory itself; several: a
    HybridMemory's), every check of every field before any field writes.

    backend: the stage's backend (None: the host's numpy arrays); every verb that reads or writes the state runs in
    its device scope (``scope``). Capabilities, which callers read instead of probing for methods: ``holds_pages``
    (a captured part holds its pages on the device: a conversation can be parked resident), ``host_parts`` (parts can be
    copied to the host and written as bytes: parking in RAM, session files), ``prefix_rows`` (a checkpoint part whose
    K/V is a prefix takes it from the host copy of a conversation that extends it: ``join_prefix``),
    ``cuts_anywhere`` (no running state: a sequence can be cut back to any prefix); ``drops``, a count of parts the
    keeper dropped on its own (0 here: a local stage drops only what its owner releases).
    """

    holds_pages = True
    host_parts = True
    prefix_rows = True
    drops = 0        # parts dropped by the keeper on its own (a remote stage's worker short of pages): none here

    def __init__(self, carve: Carve, identity: dict[str, Any] | None = None, backend: Any = None,
                 fields: "list[Field] | None" = None):
        self.carve = carve
        self.identity = dict(identity or {})      # e.g. arch, n_embd: part of the geometry a part must match
        self.backend = backend
        self.fields: list[Field] = list(fields) if fields is not None else [self]   # type: ignore[list-item]
        self._seqs: dict[int, SequenceState] = {}
        self._next = 0
        self._geometry_cache: dict[str, Any] | None = None

    def scope(self, drain: bool = True) -> contextlib.AbstractContextManager:
        """This memory's device drained (drain=True) and made current, for as long as the context lasts (the
        host's: nothing to do)."""
        be = self.backend
        if be is None:
            return contextlib.nullcontext()
        if drain:
            be.drain()
        return getattr(be, "device", None) or contextlib.nullcontext()

    def _each(self, hook: str, *args) -> None:
        for f in self.fields:
            getattr(f, hook)(*args)

    @property
    def cuts_anywhere(self) -> bool:
        """True when no field keeps a running state (a sequence can be cut back to any prefix)."""
        return all(f._cuts_anywhere() for f in self.fields)

    # ---- sequences -------------------------------------------------------------------------------
    @on_device(drain=False)
    def new_seq(self) -> int:
        """A new empty sequence's id."""
        sid = self._next
        self._next += 1
        st = SequenceState(self, sid)
        self._each("_open", st)
        self._seqs[sid] = st
        return sid

    def seq(self, sid: int) -> SequenceState:
        try:
            return self._seqs[sid]
        except KeyError:
            raise KeyError(f"sequence {sid} does not exist on stage {self.carve}") from None

    @on_device(drain=True)
    def drop_seq(self, sid: int) -> None:
        """Give the sequence's pages back and forget it."""
        self._each("_close", self.seq(sid))
        del self._seqs[sid]

    @property
    def sequences(self) -> list[int]:
        return sorted(self._seqs)

    def pos(self, sid: int) -> int:
        """Tokens sequence `sid` has read."""
        return self.seq(sid).pos

    @on_device(drain=False)
    def reserve(self, sid: int, n: int) -> None:
        """Pages for n more tokens of sequence `sid` (KVCacheFull changes nothing; extra pages are harmless)."""
        st = self.seq(sid)
        if st.kv is not None:
            st.kv.reserve(n)

    # ---- position --------------------------------------------------------------------------------
    def check_truncate(self, sid: int, p: int) -> None:
        """ValueError unless ``truncate(sid, p)`` would succeed."""
        st = self.seq(sid)
        if not 0 <= p <= st.pos:
            raise ValueError(f"truncate({p}) outside [0, {st.pos}]")
        if 0 < p < st.pos:
            self._each("_check_truncate", st, p)

    @on_device(drain=False)
    def truncate(self, sid: int, p: int) -> None:
        """Cut the sequence back to p tokens (pages kept). ValueError, changing nothing, for p outside [0, pos] or
        a cut a running state cannot make (restore a checkpoint instead). p == 0 is reset."""
        self.check_truncate(sid, p)
        st = self.seq(sid)
        if p == st.pos:
            return
        if p == 0:
            self.reset(sid)
            return
        self._each("_truncate", st, p)
        st.pos = p

    @on_device(drain=True)
    def reset(self, sid: int) -> None:
        """Back to position 0 (pages kept, running state zeroed)."""
        st = self.seq(sid)
        self._each("_reset", st)
        st.pos = 0

    # ---- a verify's Commit ------------------------------------------------------------------------
    @on_device(drain=False)
    def keep(self, sid: int, n: int) -> None:
        """Arm the sequence's next forward (of at most n tokens, at its current position) to keep the state after
        each token it reads, so that ``commit`` can cut back to any of those positions (a running state too)."""
        if n < 1:
            raise ValueError(f"keep({n}): a verify reads at least one token")
        st = self.seq(sid)
        self._each("_keep", st, n)

    def check_commit(self, sid: int, p: int) -> None:
        """ValueError unless ``commit(sid, p)`` would succeed."""
        st = self.seq(sid)
        steps = st.steps
        if p == st.pos:
            return
        if steps is None:
            self.check_truncate(sid, p)
        elif not steps.base < p <= st.pos:
            raise ValueError(f"commit({p}) outside the kept positions ({steps.base}, {st.pos}]")

    @on_device(drain=False)         # its device copies are ordered on the current stream, after the verify
    def commit(self, sid: int, p: int) -> None:
        """After a forward armed by ``keep``: the sequence at position p (a position that forward read): attention
        K/V cut back, the running state taken from the state kept after token p - 1. Disarms the keep. Without a
        keep it is ``truncate``. ValueError, changing nothing, for a position outside those kept."""
        self.check_commit(sid, p)
        st = self.seq(sid)
        if st.steps is None:
            self.truncate(sid, p)
            return
        if p < st.pos:
            self._each("_commit", st, p)
            st.pos = p
        self._each("_unkeep", st)

    # ---- states kept inside one read: a read's checkpoints without a forward call each ------------------
    @on_device(drain=False)
    def mark(self, sid: int, positions) -> None:
        """Arm the sequence's next forward (read at its current position) to keep the running state at each of
        `positions` (each past the current position and inside that forward: the state after its token p - 1), for
        ``capture_at``; an earlier mark is dropped. No positions: disarm. ValueError for a position not past the
        current one."""
        from strata.memory.sequence_state import Marks
        st = self.seq(sid)
        ps = sorted({int(p) for p in positions})
        if ps and ps[0] <= st.pos:
            raise ValueError(f"mark({ps[0]}): a mark must lie past the sequence's position {st.pos}")
        st.marks = None
        if ps:
            st.marks = Marks(st.pos, {p: {} for p in ps})
            self._each("_mark", st)

    @on_device(drain=False)         # its device copies were queued on the current stream by the marked forward
    def capture_at(self, sid: int, p: int) -> StatePart:
        """The sequence at position p, which the marked forward read (p == its position: ``capture``): the running
        state the forward kept there (handed over, no copy), K/V pages of [0, p) held. The mark at p is used up.
        ValueError for a position not marked or not read yet."""
        st = self.seq(sid)
        if p == st.pos:
            return self.capture(sid)
        marks = st.marks
        if marks is None or p not in marks.at or not marks.base < p < st.pos:
            raise ValueError(f"capture_at({p}): no state kept there (position {st.pos}, marks "
                             f"{sorted(marks.at) if marks else []})")
        part = StatePart(carve=self.carve, geometry=self.geometry(), pos=p)
        try:
            self._each("_capture_at", st, part, p)
        except BaseException:
            part.release()
            raise
        del marks.at[p]
        return part

    def trim(self, sid: int) -> None:
        """Give back the pages past the sequence's valid positions (its page tables keep only what they hold)."""
        st = self.seq(sid)
        for table in (st.kv, st.draft):
            if table is not None:
                table.trim()

    # ---- parts -----------------------------------------------------------------------------------
    def geometry(self) -> dict[str, Any]:
        """Everything a part must match to be restored here (JSON-ready; built once: it never changes; callers
        do not modify it)."""
        if self._geometry_cache is None:
            g: dict[str, Any] = {"carve": [self.carve.lo, self.carve.hi], "identity": self.identity}
            self._each("_geometry", g)
            self._geometry_cache = g
        return self._geometry_cache

    @on_device(drain=False)     # its device copies are ordered on the current stream, after the forward that wrote
    def capture(self, sid: int) -> StatePart:  # the state and before the next one: no host wait on the request's path
        """The sequence at its position: running state copied (on a GPU device to device, queued on the current
        stream: the copies are done before any later work on that stream reads or writes the state), K/V pages
        held (KVPages.hold: one more reference each, so the part stays valid whatever the sequence does next;
        ``release`` gives them back)."""
        st = self.seq(sid)
        part = StatePart(carve=self.carve, geometry=self.geometry(), pos=st.pos)
        try:
            self._each("_capture", st, part)
        except BaseException:
            part.release()                  # a field held its pages before another failed: nothing stays held
            raise
        return part

    def validate(self, part: StatePart, sid: int | None = None) -> None:
        """Raise PartMismatch (one line naming the mismatch) unless `part` can be restored here (into sequence
        `sid` when given: host copies must find free pages there)."""
        if not isinstance(part, StatePart):
            raise PartMismatch(f"not a state part: {type(part).__name__}")
        if part.carve != self.carve:
            raise PartMismatch(f"the part is of layers {part.carve}, this stage runs {self.carve}")
        d = _diff(part.geometry, self.geometry())
        if d:
            raise PartMismatch(f"the part's geometry differs from stage {self.carve}: {d}")
        if part.pos < 0:
            raise PartMismatch(f"the part's position {part.pos} is negative")
        self._each("_check", part, self.seq(sid) if sid is not None else None)

    @on_device(drain=True)
    def restore(self, sid: int, part: StatePart) -> None:
        """Validate, then make the sequence what `part` captured. PartMismatch changes nothing."""
        st = self.seq(sid)
        if part.is_prefix:
            raise PartMismatch("a checkpoint part whose K/V is its conversation's prefix cannot be restored alone: "
                               "restore the conversation, then attach_prefix")
        self.validate(part, sid)
        self._each("_restore", st, part)
        st.pos = part.pos

    @on_device(drain=True)
    def detach(self, part: StatePart, to_host: bool = True) -> StatePart:
        """A checkpoint part to keep apart from the engine with its conversation: the running state as host copies
        (to_host=False: the part's own arrays, left where they are, for a conversation parked on the device) and
        the K/V as a prefix of the conversation's own (KVPages.is_prefix), so it costs no K/V bytes."""
        copy = host_copy if to_host else (lambda a: a)
        return StatePart(carve=part.carve, geometry=part.geometry, pos=part.pos,
                         running={li: {k: copy(a) for k, a in d.items()} for li, d in part.running.items()},
                         kv={name: KVPages(length=kvp.length) for name, kvp in part.kv.items()})

    @on_device(drain=False)
    def attach_prefix(self, sid: int, part: StatePart) -> StatePart:
        """The checkpoint part `part` (its K/V a prefix, see detach) as a part of sequence `sid`: its K/V the
        sequence's first pages, held (``release`` gives them back), its running state copied to this stage's arrays. PartMismatch unless the
        part fits this stage and the sequence holds at least its positions."""
        self.validate(part)
        st = self.seq(sid)
        out = StatePart(carve=part.carve, geometry=part.geometry, pos=part.pos)
        try:
            self._each("_attach", st, part, out)
        except BaseException:
            out.release()
            raise
        return out

    def join_prefix(self, part: StatePart, whole: StatePart, copy: bool = False) -> StatePart:
        """`part` (a checkpoint's, its K/V a prefix: ``detach``) with its K/V taken from the first rows of `whole` (the
        host copies of a conversation whose tokens extend the checkpoint's, ``materialize``): views of whole's arrays
        (copy: arrays of its own), its running state `part`'s -> a part ``restore`` takes. Host memory only.
        PartMismatch (one line) when `whole` is not host copies of this stage or holds fewer positions."""
        self.validate(part)
        self.validate(whole)
        out = StatePart(carve=part.carve, geometry=part.geometry, pos=part.pos,
                        running={li: dict(d) for li, d in part.running.items()})
        self._each("_join", part, whole, out, copy)
        return out

    @on_device(drain=True)
    def materialize(self, part: StatePart) -> StatePart:
        """The same part holding its K/V and running state as host copies (parking, session files); a held part
        keeps its pages (release it apart)."""
        out = StatePart(carve=part.carve, geometry=part.geometry, pos=part.pos,
                        running={li: {k: host_copy(a) for k, a in d.items()} for li, d in part.running.items()})
        self._each("_materialize", part, out)
        return out

    @on_device(drain=True)
    def write(self, part: StatePart, io: BinaryIO) -> int:
        """Write `part` (materialized first if it holds pages) in the byte format; returns bytes written."""
        self.validate(part)
        if part.is_held:
            part = self.materialize(part)
        lengths = {name: kvp.length for name, kvp in sorted(part.kv.items())}
        prefix = sorted(name for name, kvp in part.kv.items() if kvp.is_prefix)
        rows = sorted(name for name in part.kv if name not in prefix)
        expected: list = []
        self._each("_expect", part.pos, lengths, expected, prefix, rows)

        def array(name: str) -> np.ndarray:
            field_, rest = name.split(".", 1)
            if field_ == "running":
                layer, k = rest.split(".", 1)
                return np.asarray(part.running[int(layer[1:])][k])
            return part.kv[field_].arrays[rest]
        arrays = [(name, array(name)) for name, _, _ in expected]
        header = {"carve": [part.carve.lo, part.carve.hi], "pos": part.pos, "geometry": part.geometry,
                  "kv_lengths": lengths, "kv_prefix": prefix, "kv_rows": rows}
        return codec.write(io, header, arrays)

    def read(self, io: BinaryIO) -> StatePart:
        """Read a part written by ``write``: header checks (carve, geometry, position, the exact arrays expected)
        before any allocation, then the arrays and their checksum. codec.FormatError / PartMismatch (one line)."""
        def expect(header: dict) -> list[tuple[str, tuple[int, ...], np.dtype]]:
            carve = header.get("carve")
            if not (isinstance(carve, list) and len(carve) == 2 and all(type(x) is int for x in carve)):
                raise codec.FormatError(f"bad carve in the part header: {carve!r}")
            if tuple(carve) != (self.carve.lo, self.carve.hi):
                raise PartMismatch(f"the part is of layers {carve[0]}..{carve[1]}, this stage runs {self.carve}")
            d = _diff(header.get("geometry"), self.geometry())
            if d:
                raise PartMismatch(f"the part's geometry differs from stage {self.carve}: {d}")
            pos, lengths, prefix = header.get("pos"), header.get("kv_lengths"), header.get("kv_prefix", [])
            rows = header.get("kv_rows", [])     # absent in an older writer's parts: whole pages
            if type(pos) is not int or not isinstance(lengths, dict) or \
                    not all(type(v) is int for v in lengths.values()) or \
                    not all(isinstance(x, list) and all(isinstance(n, str) and n in lengths for n in x)
                            for x in (prefix, rows)):
                raise codec.FormatError("bad position, K/V lengths or K/V prefix / rows list in the part header")
            out: list[tuple[str, tuple[int, ...], np.dtype]] = []
            self._each("_expect", pos, lengths, out, prefix, rows)
            return out

        header, arrays = codec.read(io, expect)
        part = StatePart(carve=self.carve, geometry=header["geometry"], pos=header["pos"])
        for name, a in arrays.items():
            field_, rest = name.split(".", 1)
            if field_ == "running":
                layer, k = rest.split(".", 1)
                part.running.setdefault(int(layer[1:]), {})[k] = a
            else:
                kvp = part.kv.setdefault(field_, KVPages(length=header["kv_lengths"][field_], arrays={}))
                kvp.arrays[rest] = a
        for name, length in header["kv_lengths"].items():
            if name in header.get("kv_prefix", []):
                part.kv[name] = KVPages(length=length)
            else:
                part.kv.setdefault(name, KVPages(length=length, arrays={}))
        self._each("_upgrade", part, header.get("kv_rows", []))
        self.validate(part)
        return part

    # ---- introspection ---------------------------------------------------------------------------
    @on_device(drain=True)
    def hashes(self, sid: int) -> dict[str, str]:
        """sha256 per field and layer: "kv.L{i}" (K then V over [0, pos), independent of which pages hold them),
        "running.L{i}" (the layer's arrays by name), "draft.L{i}"; and per field over its layers (with_field_hashes)."""
        out: dict[str, str] = {}
        self._each("_hashes", self.seq(sid), out)
        return with_field_hashes(out)

    def hash_point(self, sid: int) -> None:
        """Nothing to do: a local stage's state is in the caller's hashes (see RemoteMemory.hash_point)."""

    def nbytes(self, sid: int) -> int:
        """Bytes of the sequence's state: valid K/V + running state."""
        st = self.seq(sid)
        return sum(f._nbytes(st) for f in self.fields)

    def stats(self) -> dict[str, Any]:
        """JSON-ready: carve, sequences, and the fields' own numbers (KV pages used / total)."""
        out: dict[str, Any] = {"carve": [self.carve.lo, self.carve.hi], "sequences": len(self._seqs)}
        self._each("_stats", out)
        return out



class Field(ABC):
    """The hooks of one kind of state a Memory keeps (KVMemory: K/V pages; RecurrentMemory: running state): the
    Memory verbs call them on each of their fields in order."""

    @abstractmethod
    def _cuts_anywhere(self) -> bool: ...
    @abstractmethod
    def _open(self, st: SequenceState) -> None: ...
    @abstractmethod
    def _close(self, st: SequenceState) -> None: ...
    @abstractmethod
    def _check_truncate(self, st: SequenceState, p: int) -> None: ...
    @abstractmethod
    def _truncate(self, st: SequenceState, p: int) -> None: ...
    @abstractmethod
    def _reset(self, st: SequenceState) -> None: ...
    @abstractmethod
    def _geometry(self, g: dict) -> None: ...
    @abstractmethod
    def _capture(self, st: SequenceState, part: StatePart) -> None: ...
    @abstractmethod
    def _check(self, part: StatePart, st: SequenceState | None) -> None: ...
    @abstractmethod
    def _restore(self, st: SequenceState, part: StatePart) -> None: ...
    @abstractmethod
    def _materialize(self, part: StatePart, out: StatePart) -> None: ...
    @abstractmethod
    def _expect(self, pos: int, lengths: dict, out: list, prefix=(), rows=None) -> None: ...
    # rows: the K/V names whose arrays are the used rows (KVPages), None: all of them; an older writer's whole
    # pages otherwise, which _upgrade turns into rows once read
    @abstractmethod
    def _attach(self, st: SequenceState, part: StatePart, out: StatePart) -> None: ...
    @abstractmethod
    def _hashes(self, st: SequenceState, out: dict) -> None: ...
    @abstractmethod
    def _nbytes(self, st: SequenceState) -> int: ...
    @abstractmethod
    def _stats(self, out: dict) -> None: ...

    def _join(self, part: StatePart, whole: StatePart, out: StatePart, copy: bool) -> None:
        """Memory.join_prefix: a field with no K/V takes nothing from `whole`."""

    def _upgrade(self, part: StatePart, rows) -> None:
        """A part read from bytes: K/V arrays of whole pages (an older writer's, names not in `rows`) as rows."""

    # a verify's Commit (Memory.keep / commit); a field with no running state keeps nothing and cuts back
    def _keep(self, st: SequenceState, n: int) -> None:
        pass

    def _unkeep(self, st: SequenceState) -> None:
        pass

    def _commit(self, st: SequenceState, p: int) -> None:
        self._truncate(st, p)

    # states kept inside one read (Memory.mark / capture_at); a field with no running state keeps nothing
    def _mark(self, st: SequenceState) -> None:
        pass

    def _capture_at(self, st: SequenceState, part: StatePart, p: int) -> None:
        self._capture(st, part)
