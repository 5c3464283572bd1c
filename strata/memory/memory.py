"""Memory: what one stage keeps for its sequences (KV pages, running state, the drafter's K/V), one interface for
attention (KVMemory), recurrent (RecurrentMemory) and hybrid (HybridMemory) stages, in the spirit of llama.cpp's
llama-memory.h; SequenceState, the view a stage's runner reads and writes."""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import Any, BinaryIO

import numpy as np

import strata.memory.codec as codec
from strata.memory.kv import KVCacheFull, PagedKV, PagePool
from strata.memory.part import Carve, KVPages, PartMismatch, StatePart


class SequenceState:
    """One sequence as a stage's runner sees it: ``pos`` (tokens read), ``kv`` (the page table of the stage's
    attention layers, or None), ``running`` (recurrent layer -> {"conv", "ssm"} float32 arrays, updated in place),
    ``draft`` (the MTP drafter's page table on the stage that carries it, or None). The runner reserves / commits
    K/V around a forward pass and calls ``advance``; everything else goes through the Memory that owns it
    (``memory``, under id ``sid``; the methods below are that Memory's operations on this sequence)."""

    __slots__ = ("pos", "kv", "running", "draft", "memory", "sid", "__weakref__")

    def __init__(self, memory: "Memory", sid: int):
        self.pos = 0
        self.kv: PagedKV | None = None
        self.running: dict[int, dict[str, Any]] = {}
        self.draft: PagedKV | None = None
        self.memory = memory
        self.sid = sid

    def advance(self, tokens) -> None:
        """Record that a forward pass read `tokens` (after it committed their K/V)."""
        self.pos += len(tokens)

    def capture(self) -> StatePart:
        return self.memory.capture(self.sid)

    def restore(self, part: StatePart) -> None:
        self.memory.restore(self.sid, part)

    def truncate(self, p: int) -> None:
        self.memory.truncate(self.sid, p)

    def reset(self) -> None:
        self.memory.reset(self.sid)

    def hashes(self) -> dict[str, str]:
        return self.memory.hashes(self.sid)

    def nbytes(self) -> int:
        return self.memory.nbytes(self.sid)

    def release(self) -> None:
        """Give the sequence's pages back; the memory forgets it."""
        self.memory.drop_seq(self.sid)


def _host(a: Any) -> np.ndarray:
    """A numpy array of a numpy or CuPy array (a view where it can be)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def host_copy(a: Any) -> np.ndarray:
    """A C-contiguous host copy of a numpy or CuPy array. A CuPy array lands in pinned (page-locked) host memory from
    CuPy's pinned pool, so parking moves state at the bus's copy bandwidth and the copy back to the device is a
    direct DMA."""
    if isinstance(a, np.ndarray) or not hasattr(a, "get"):
        return np.array(a, order="C")
    import cupy
    a = cupy.ascontiguousarray(a)
    out = np.frombuffer(cupy.cuda.alloc_pinned_memory(max(1, a.nbytes)), a.dtype, a.size).reshape(a.shape)
    a.get(out=out)
    return out


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(_host(a)).tobytes())
    return h.hexdigest()


def with_field_hashes(per_layer: dict[str, str]) -> dict[str, str]:
    """Per-layer hashes ("kv.L3", "running.L0", ...) plus one hash per field over its layers in layer order ("kv",
    "running", "draft"): a split and an unsplit model give the same keys and values."""
    out = dict(per_layer)
    for name in ("kv", "running", "draft"):
        keys = sorted((k for k in per_layer if k.startswith(name + ".L")), key=lambda k: int(k.split(".L")[1]))
        if keys:
            out[name] = hashlib.sha256("".join(per_layer[k] for k in keys).encode()).hexdigest()
    return out


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


class Memory(ABC):
    """One stage's per-sequence state (DESIGN.md §2 "memory"): sequences by id, each a SequenceState.

    Operations: ``new_seq`` / ``drop_seq``; ``truncate`` (attention: to any prefix; a recurrent state refuses
    anything but its own position or 0); ``reset``; ``capture`` -> StatePart (running state copied, K/V referenced);
    ``validate`` then ``restore`` (nothing is written unless every check passed); ``materialize`` (a part's K/V as
    host copies); ``write(part, io)`` / ``read(io)`` (the byte codec, memory/codec.py); ``hashes`` (per layer and
    field); ``nbytes``; ``geometry`` (what a part must match). Subclasses implement the ``_`` hooks for their own
    field; HybridMemory runs its children's hooks in order.
    """

    def __init__(self, carve: Carve, identity: dict[str, Any] | None = None):
        self.carve = carve
        self.identity = dict(identity or {})      # e.g. arch, n_embd: part of the geometry a part must match
        self._seqs: dict[int, SequenceState] = {}
        self._next = 0
        self._geometry_cache: dict[str, Any] | None = None

    # ---- sequences -------------------------------------------------------------------------------
    def new_seq(self) -> int:
        """A new empty sequence's id."""
        sid = self._next
        self._next += 1
        st = SequenceState(self, sid)
        self._open(st)
        self._seqs[sid] = st
        return sid

    def seq(self, sid: int) -> SequenceState:
        try:
            return self._seqs[sid]
        except KeyError:
            raise KeyError(f"sequence {sid} does not exist on stage {self.carve}") from None

    def drop_seq(self, sid: int) -> None:
        """Give the sequence's pages back and forget it."""
        self._close(self.seq(sid))
        del self._seqs[sid]

    @property
    def sequences(self) -> list[int]:
        return sorted(self._seqs)

    # ---- position --------------------------------------------------------------------------------
    def check_truncate(self, sid: int, p: int) -> None:
        """ValueError unless ``truncate(sid, p)`` would succeed."""
        st = self.seq(sid)
        if not 0 <= p <= st.pos:
            raise ValueError(f"truncate({p}) outside [0, {st.pos}]")
        if 0 < p < st.pos:
            self._check_truncate(st, p)

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
        self._truncate(st, p)
        st.pos = p

    def reset(self, sid: int) -> None:
        """Back to position 0 (pages kept, running state zeroed)."""
        st = self.seq(sid)
        self._reset(st)
        st.pos = 0

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
            self._geometry(g)
            self._geometry_cache = g
        return self._geometry_cache

    def capture(self, sid: int) -> StatePart:
        """The sequence at its position: running state copied, K/V referenced (KVPages)."""
        st = self.seq(sid)
        part = StatePart(carve=self.carve, geometry=self.geometry(), pos=st.pos)
        self._capture(st, part)
        return part

    def validate(self, part: StatePart, sid: int | None = None) -> None:
        """Raise PartMismatch (one line naming the mismatch) unless `part` can be restored here (into sequence
        `sid` when given: a part that references pages must reference that sequence's)."""
        if not isinstance(part, StatePart):
            raise PartMismatch(f"not a state part: {type(part).__name__}")
        if part.carve != self.carve:
            raise PartMismatch(f"the part is of layers {part.carve}, this stage runs {self.carve}")
        d = _diff(part.geometry, self.geometry())
        if d:
            raise PartMismatch(f"the part's geometry differs from stage {self.carve}: {d}")
        if part.pos < 0:
            raise PartMismatch(f"the part's position {part.pos} is negative")
        self._check(part, self.seq(sid) if sid is not None else None)

    def restore(self, sid: int, part: StatePart) -> None:
        """Validate, then make the sequence what `part` captured. PartMismatch changes nothing."""
        st = self.seq(sid)
        if part.is_prefix:
            raise PartMismatch("a checkpoint part whose K/V is its conversation's prefix cannot be restored alone: "
                               "restore the conversation, then attach_prefix")
        self.validate(part, sid)
        self._restore(st, part)
        st.pos = part.pos

    def detach(self, part: StatePart) -> StatePart:
        """A checkpoint part to keep apart from the engine with its conversation: the running state as host copies
        and the K/V as a prefix of the conversation's own (KVPages.is_prefix), so it costs no K/V bytes."""
        return StatePart(carve=part.carve, geometry=part.geometry, pos=part.pos,
                         running={li: {k: host_copy(a) for k, a in d.items()} for li, d in part.running.items()},
                         kv={name: KVPages(length=kvp.length) for name, kvp in part.kv.items()})

    def attach_prefix(self, sid: int, part: StatePart) -> StatePart:
        """The checkpoint part `part` (its K/V a prefix, see detach) as a part of sequence `sid`: its K/V a reference
        to the sequence's first pages, its running state copied to this stage's arrays. PartMismatch unless the
        part fits this stage and the sequence holds at least its positions."""
        self.validate(part)
        st = self.seq(sid)
        out = StatePart(carve=part.carve, geometry=part.geometry, pos=part.pos)
        self._attach(st, part, out)
        return out

    def materialize(self, part: StatePart) -> StatePart:
        """The same part holding its K/V and running state as host copies (parking, session files). A part that
        references pages must be materialized while its sequence still holds them."""
        out = StatePart(carve=part.carve, geometry=part.geometry, pos=part.pos,
                        running={li: {k: host_copy(a) for k, a in d.items()} for li, d in part.running.items()})
        self._materialize(part, out)
        return out

    def write(self, part: StatePart, io: BinaryIO) -> int:
        """Write `part` (materialized first if it references pages) in the byte format; returns bytes written."""
        self.validate(part)
        if part.is_reference:
            part = self.materialize(part)
        lengths = {name: kvp.length for name, kvp in sorted(part.kv.items())}
        prefix = sorted(name for name, kvp in part.kv.items() if kvp.is_prefix)
        expected: list = []
        self._expect(part.pos, lengths, expected, prefix)

        def array(name: str) -> np.ndarray:
            field_, rest = name.split(".", 1)
            if field_ == "running":
                layer, k = rest.split(".", 1)
                return np.asarray(part.running[int(layer[1:])][k])
            return part.kv[field_].arrays[rest]
        arrays = [(name, array(name)) for name, _, _ in expected]
        header = {"carve": [part.carve.lo, part.carve.hi], "pos": part.pos, "geometry": part.geometry,
                  "kv_lengths": lengths, "kv_prefix": prefix}
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
            if type(pos) is not int or not isinstance(lengths, dict) or \
                    not all(type(v) is int for v in lengths.values()) or not isinstance(prefix, list) or \
                    not all(isinstance(x, str) and x in lengths for x in prefix):
                raise codec.FormatError("bad position, K/V lengths or K/V prefix list in the part header")
            out: list[tuple[str, tuple[int, ...], np.dtype]] = []
            self._expect(pos, lengths, out, prefix)
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
        self.validate(part)
        return part

    # ---- introspection ---------------------------------------------------------------------------
    def hashes(self, sid: int) -> dict[str, str]:
        """sha256 per field and layer: "kv.L{i}" (K then V over [0, pos), independent of which pages hold them),
        "running.L{i}" (the layer's arrays by name), "draft.L{i}"; and per field over its layers (with_field_hashes)."""
        out: dict[str, str] = {}
        self._hashes(self.seq(sid), out)
        return with_field_hashes(out)

    def nbytes(self, sid: int) -> int:
        """Bytes of the sequence's state: valid K/V + running state."""
        return self._nbytes(self.seq(sid))

    def stats(self) -> dict[str, Any]:
        """JSON-ready: carve, sequences, and the fields' own numbers (KV pages used / total)."""
        out: dict[str, Any] = {"carve": [self.carve.lo, self.carve.hi], "sequences": len(self._seqs)}
        self._stats(out)
        return out

    # ---- hooks (one field each; HybridMemory runs its children's) ----------------------------------
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
    def _expect(self, pos: int, lengths: dict, out: list, prefix=()) -> None: ...
    @abstractmethod
    def _attach(self, st: SequenceState, part: StatePart, out: StatePart) -> None: ...
    @abstractmethod
    def _hashes(self, st: SequenceState, out: dict) -> None: ...
    @abstractmethod
    def _nbytes(self, st: SequenceState) -> int: ...
    @abstractmethod
    def _stats(self, out: dict) -> None: ...


class KVMemory(Memory):
    """Attention K/V in pages of `pool` (the carve's attention layers). `name` is the field: "kv" (the sequence's
    page table, length == pos) or "draft" (the MTP drafter's, length <= pos)."""

    def __init__(self, carve: Carve, pool: PagePool, name: str = "kv", identity: dict | None = None):
        super().__init__(carve, identity)
        bad = [li for li in pool.layers if li not in carve and name == "kv"]
        if bad:
            raise ValueError(f"KV layers {bad} are outside the carve {carve}")
        self.pool = pool
        self.name = name

    def table(self, st: SequenceState) -> PagedKV:
        return getattr(st, self.name)

    def _open(self, st):
        setattr(st, self.name, PagedKV(self.pool))

    def _close(self, st):
        self.table(st).release()

    def _check_truncate(self, st, p):
        pass

    def _truncate(self, st, p):
        t = self.table(st)
        t.truncate(min(p, t.length))

    def _reset(self, st):
        self.table(st).truncate(0)

    def _geometry(self, g):
        pool = self.pool
        g[self.name] = {"layers": list(pool.layers), "page_size": pool.page_size,
                        "arrays": {n: [list(s), d.str] for n, (s, d) in pool.page_arrays().items()}}

    def _pages_for(self, length: int) -> int:
        return -(-int(length) // self.pool.page_size)

    def _capture(self, st, part):
        t = self.table(st)
        part.kv[self.name] = KVPages(length=t.length, pages=tuple(t.pages[:self._pages_for(t.length)]))

    def _check(self, part, st):
        kvp = part.kv.get(self.name)
        if kvp is None:
            raise PartMismatch(f"the part has no {self.name!r} K/V, stage {self.carve} keeps it")
        if self.name == "kv" and kvp.length != part.pos:
            raise PartMismatch(f"the part's K/V length {kvp.length} != its position {part.pos}")
        if not 0 <= kvp.length <= part.pos or kvp.length > self.pool.capacity_tokens:
            raise PartMismatch(f"the part's {self.name} K/V length {kvp.length} does not fit "
                               f"(position {part.pos}, pool of {self.pool.capacity_tokens} tokens)")
        m = self._pages_for(kvp.length)
        if kvp.is_prefix:
            return
        if kvp.is_reference:
            if st is None:
                return
            t = self.table(st)
            if tuple(t.pages[:m]) != tuple(kvp.pages or ()) or t.length < kvp.length:
                raise PartMismatch(f"the part references {self.name} pages this sequence no longer holds "
                                   f"(it holds {t.length} positions)")
            return
        want = {n: (tuple(s), d) for n, (s, d) in self.pool.page_arrays().items()}
        if set(kvp.arrays) != set(want):
            raise PartMismatch(f"the part's {self.name} arrays {sorted(kvp.arrays)} differ from the stage's")
        ax = self.pool.page_axis
        for n, (shape, dt) in want.items():
            a = kvp.arrays[n]
            exp = shape[:ax] + (m,) + shape[ax + 1:]
            if tuple(a.shape) != exp or np.dtype(a.dtype) != dt:
                raise PartMismatch(f"the part's {self.name} array {n} is {tuple(a.shape)} {np.dtype(a.dtype)}, "
                                   f"expected {exp} {dt}")
        if st is not None:
            a = self.pool.allocator
            t = self.table(st)
            free = self.pool.n_free + sum(1 for p in t.pages if a.refcount(p) == 1)
            if m > free:
                raise KVCacheFull(f"KV cache full: restoring {kvp.length} {self.name} positions needs {m} pages, "
                                   f"{free} can be freed")

    def _restore(self, st, part):
        kvp = part.kv[self.name]
        t = self.table(st)
        if kvp.is_reference:
            t.truncate(kvp.length)
            return
        t.release()
        m = self._pages_for(kvp.length)
        t.reserve(kvp.length)                    # pages for [0, length); checked free above
        self.pool.import_pages(t.pages[:m], kvp.arrays)
        t.commit(kvp.length)

    def _attach(self, st, part, out):
        kvp, t = part.kv[self.name], self.table(st)
        if t.length < kvp.length:
            raise PartMismatch(f"the checkpoint's {self.name} K/V covers {kvp.length} positions, the sequence holds "
                               f"{t.length}")
        out.kv[self.name] = KVPages(length=kvp.length, pages=tuple(t.pages[:self._pages_for(kvp.length)]))

    def _materialize(self, part, out):
        kvp = part.kv[self.name]
        if kvp.is_prefix:
            out.kv[self.name] = KVPages(length=kvp.length)
        elif kvp.is_reference:
            out.kv[self.name] = KVPages(length=kvp.length, arrays=self.pool.export_pages(kvp.pages))
        else:
            out.kv[self.name] = KVPages(length=kvp.length, arrays={k: np.array(a) for k, a in kvp.arrays.items()})

    def _expect(self, pos, lengths, out, prefix=()):
        length = lengths.get(self.name)
        if length is None:
            raise PartMismatch(f"the part has no {self.name!r} K/V, stage {self.carve} keeps it")
        if not 0 <= length <= pos or (self.name == "kv" and length != pos) or length > self.pool.capacity_tokens:
            raise PartMismatch(f"the part's {self.name} K/V length {length} does not fit (position {pos}, "
                               f"pool of {self.pool.capacity_tokens} tokens)")
        if self.name in prefix:
            return
        m = self._pages_for(length)
        ax = self.pool.page_axis
        for n, (shape, dt) in sorted(self.pool.page_arrays().items()):
            out.append((f"{self.name}.{n}", shape[:ax] + (m,) + shape[ax + 1:], dt))

    def _hashes(self, st, out):
        t = self.table(st)
        for slot, layer in enumerate(self.pool.layers):
            k, v = t.read(slot, t.length)
            out[f"{self.name}.L{layer}"] = _sha(k, v)

    def _nbytes(self, st):
        return self.table(st).nbytes()

    def _stats(self, out):
        pool = self.pool
        out[self.name] = {"pages_used": pool.n_pages - pool.n_free, "pages_total": pool.n_pages,
                          "page_size": pool.page_size, "layers": len(pool.layers),
                          "bytes": pool.capacity_tokens * pool.bytes_per_token}


class RecurrentMemory(Memory):
    """Running state of the carve's recurrent layers: `init` is layer -> {name: zeroed array} (float32, numpy or
    CuPy), the state every sequence starts from. A running state only moves forward: truncate refuses any
    position but its own and 0 (restore a checkpoint instead)."""

    def __init__(self, carve: Carve, init: dict[int, dict[str, Any]], xp: Any = np, identity: dict | None = None):
        super().__init__(carve, identity)
        bad = [li for li in init if li not in carve]
        if bad:
            raise ValueError(f"recurrent layers {bad} are outside the carve {carve}")
        self.init = init
        self.xp = xp            # the arrays' module (numpy, or CuPy on a GPU stage)

    def _open(self, st):
        st.running = {li: {k: a.copy() for k, a in d.items()} for li, d in self.init.items()}

    def _close(self, st):
        st.running = {}

    def _check_truncate(self, st, p):
        if self.init:
            raise ValueError(f"cannot cut a recurrent running state back from {st.pos} to {p}; "
                             "restore a checkpoint instead")

    def _truncate(self, st, p):
        pass

    def _reset(self, st):
        for li, d in self.init.items():
            for k, a in d.items():
                st.running[li][k][...] = a

    def _geometry(self, g):
        g["running"] = {str(li): {k: [list(a.shape), np.dtype(a.dtype).str] for k, a in sorted(d.items())}
                        for li, d in sorted(self.init.items())}

    def _capture(self, st, part):
        part.running = {li: {k: a.copy() for k, a in d.items()} for li, d in st.running.items()}

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
        for li, d in part.running.items():
            for k, a in d.items():
                dst = st.running[li][k]
                dst[...] = self.xp.asarray(a)

    def _materialize(self, part, out):
        pass                                        # Memory.materialize copies the running state

    def _attach(self, st, part, out):
        out.running = {li: {k: self.xp.array(a) for k, a in d.items()} for li, d in part.running.items()}

    def _expect(self, pos, lengths, out, prefix=()):
        for li, d in sorted(self.init.items()):
            for k, a in sorted(d.items()):
                out.append((f"running.L{li}.{k}", tuple(a.shape), np.dtype(a.dtype)))

    def _hashes(self, st, out):
        for li in sorted(st.running):
            d = st.running[li]
            out[f"running.L{li}"] = _sha(*(d[k] for k in sorted(d)))

    def _nbytes(self, st):
        return sum(int(a.nbytes) for d in st.running.values() for a in d.values())

    def _stats(self, out):
        out["running"] = {"layers": len(self.init),
                          "bytes_per_sequence": sum(int(a.nbytes) for d in self.init.values() for a in d.values())}


class HybridMemory(Memory):
    """Several fields of one stage together (llama-memory-hybrid): e.g. KV pages of the attention layers, the
    running state of the recurrent ones, the drafter's K/V. Every operation runs each child's hook in order, and
    every check of every child before any child writes."""

    def __init__(self, carve: Carve, children: list[Memory], identity: dict | None = None):
        super().__init__(carve, identity)
        names = [type(c).__name__ + ":" + getattr(c, "name", "running") for c in children]
        if len(set(names)) != len(names):
            raise ValueError(f"a hybrid memory holds each field once, got {names}")
        self.children = children

    def _each(self, hook: str, *args):
        for c in self.children:
            getattr(c, hook)(*args)

    def _open(self, st):
        self._each("_open", st)

    def _close(self, st):
        self._each("_close", st)

    def _check_truncate(self, st, p):
        self._each("_check_truncate", st, p)

    def _truncate(self, st, p):
        self._each("_truncate", st, p)

    def _reset(self, st):
        self._each("_reset", st)

    def _geometry(self, g):
        self._each("_geometry", g)

    def _capture(self, st, part):
        self._each("_capture", st, part)

    def _check(self, part, st):
        self._each("_check", part, st)

    def _restore(self, st, part):
        self._each("_restore", st, part)

    def _materialize(self, part, out):
        self._each("_materialize", part, out)

    def _expect(self, pos, lengths, out, prefix=()):
        self._each("_expect", pos, lengths, out, prefix)

    def _attach(self, st, part, out):
        self._each("_attach", st, part, out)

    def _hashes(self, st, out):
        self._each("_hashes", st, out)

    def _nbytes(self, st):
        return sum(c._nbytes(st) for c in self.children)

    def _stats(self, out):
        self._each("_stats", out)
