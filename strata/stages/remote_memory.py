"""RemoteMemory (a remote stage's memory: the state verbs spoken over its link, each addressing one of the worker's
sequences by its id), its parts (RemotePart: an id in the
worker chain's store, held by the main's references; RemoteBlob: such a part's bytes streamed to the main) and
CheckpointGone."""
from __future__ import annotations

import io as _io
import itertools
import struct
import weakref
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import link
from link import Ack, CkptRestore, CkptSave, Commit, ErrorCode, Reset
from strata.memory import Carve, KVCacheFull, PartMismatch, codec
from strata.stages.link_client import WorkerError, get_part, put_part


class CheckpointGone(PartMismatch):
    """The worker does not hold the checkpoint part (it restarted or the link reconnected since): the request
    reads from token 0."""


@dataclass(eq=False)
class RemotePart:
    """A remote stage's part of a checkpoint or parked conversation: the id the worker chain keeps it under (in that
    link's `epoch`), its position and carve. The main holds no bytes of it (nbytes 0; the worker's store is bounded
    by the part budget its hello granted). Several handles may name one id (a checkpoint and the parked
    conversation it travels with): the worker keeps the id while one handle is alive and not released; the ids
    travel as the keep list of every message that changes the store."""

    carve: Carve
    pos: int
    ckpt_id: int
    epoch: int
    is_prefix: bool = False
    released: bool = False
    gone: bool = False          # the worker dropped its id to make room for a Forward (its Result said so)
    kv: dict = field(default_factory=dict)
    running: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        return 0

    def release(self) -> None:
        self.released = True


@dataclass(eq=False)
class RemoteBlob:
    """A remote stage's part as bytes on the main (parked in host RAM, written to a session file): the worker
    chain's state-part blocks in layer order, each in the state-part byte format (strata.memory.codec); the worker
    checks them against its stages when they are sent back (PartPut)."""

    carve: Carve
    pos: int
    blob: bytes
    is_prefix: bool = False
    kv: dict = field(default_factory=dict)
    running: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        return len(self.blob)

    def release(self) -> None:
        """Nothing held."""


@dataclass
class RemoteSeq:
    """What the main knows of one of the worker's sequences: its position there, where the verify awaiting its
    Commit started (None: no verify), and the link epoch its worker state belongs to."""
    at: int = 0
    kept_from: int | None = None
    epoch: int = 0


class RemoteMemory:
    """A remote stage's memory: the state verbs spoken over the link, each naming a sequence id (``new_seq``: one per
    request slot, ids 0..slots-1, sent as the messages' ``seq`` field; 0 is the bytes a main of one slot always sent;
    the worker chain keeps each sequence's K/V and running state; a checkpoint part is a RemotePart, an id in the
    worker's store kept alive by the main's handles: the ids the main still holds travel as the keep list of every
    checkpoint message, and the worker prunes to them when an operation succeeds).

    Capabilities (strata.memory.Memory's): ``holds_pages`` (a captured part stays valid on the worker whatever the
    sequence does next, until released: conversations can be parked resident, as ids); ``host_parts`` when the
    worker announced ``+park`` (a part's bytes stream to the main: parking in RAM, session files); ``cuts_anywhere``
    unless the carve has recurrent layers (a Commit cuts the worker's K/V back); not ``prefix_rows`` (a part's bytes
    are the worker's format: a checkpoint moved off the worker takes its K/V in full). A capture past the granted
    part budget is a KVCacheFull (the store frees ids first: Sequence.with_room)."""

    holds_pages = True
    prefix_rows = False

    def __init__(self, link_: Any, recurrent: bool, n_embd: int):
        self.link, self.carve, self.recurrent = link_, link_.carve, bool(recurrent)
        self.seqs: dict[int, RemoteSeq] = {}     # sequence id -> its state on the worker
        self._ids = itertools.count(1)
        self._parts: dict[int, weakref.WeakSet] = {}
        self.held, self.store_bytes = 0, 0   # what the worker's store reported at the last Ack
        self.drops = 0                       # parts the worker dropped on its own (Result.dropped), counted
        self.granted = 0                     # the part budget the worker's HelloAck granted
        # the most bytes one part's blocks may declare: a context's K/V in f32 at most n_embd wide per K and V
        # (GQA keeps it narrower) per layer, page slack, running state, headers
        self.part_limit = 2 * (int(link_.n_ctx) + 1024) * len(self.carve) * int(n_embd) * 4 * 2 + (64 << 20)

    @property
    def host_parts(self) -> bool:
        c = self.link.client
        return c is not None and link.CAP_PARK in c.caps

    @property
    def cuts_anywhere(self) -> bool:
        return not self.recurrent

    # ---- the worker's store ---------------------------------------------------------------------------
    def _keep(self, also: int | None = None) -> list[int]:
        """The ids some unreleased handle still names (and `also`): the worker keeps exactly these."""
        for i in [i for i, hs in self._parts.items() if not any(not h.released for h in hs)]:
            del self._parts[i]
        ids = sorted(self._parts)
        return ids + [also] if also is not None and also not in self._parts else ids

    def _room(self) -> None:
        """KVCacheFull when one more id would pass the granted part budget (nothing sent)."""
        if self.granted and len(self._keep()) + 1 > self.granted:
            raise KVCacheFull(f"the worker of stage {self.link.index} keeps at most {self.granted} parts (its "
                              f"hello's budget)")

    def _handle(self, cid: int, pos: int, epoch: int) -> RemotePart:
        part = RemotePart(carve=self.carve, pos=pos, ckpt_id=cid, epoch=epoch)
        self._parts.setdefault(cid, weakref.WeakSet()).add(part)
        return part

    def dropped(self, ids) -> None:
        """The worker dropped these ids to make room for a Forward (``+drops``): every handle on them is gone (it
        validates as CheckpointGone, holds nothing) and ``drops`` counts them, which the conversation store reads
        to forget what held them."""
        for cid in ids:
            for h in self._parts.pop(int(cid), ()):
                h.gone = True
            self.drops += 1

    def _acked(self, ack) -> None:
        if isinstance(ack, Ack):
            self.held, self.store_bytes = int(ack.held), int(ack.store_bytes)

    def _call(self, msg):
        """A store request: CKPT_MISSING -> CheckpointGone; LIMIT (the worker's pool or part budget is short) ->
        KVCacheFull, so the main frees parts (its next keep list gives their pages back there) and retries."""
        try:
            return self.link.call(msg)
        except WorkerError as e:
            if e.link_code == ErrorCode.CKPT_MISSING:
                raise CheckpointGone(str(e)) from None
            if e.link_code == ErrorCode.LIMIT:
                raise KVCacheFull(str(e)) from None
            raise

    # ---- the sequences --------------------------------------------------------------------------------
    def new_seq(self) -> int:
        """The next sequence id (0, 1, ...: at most the slots the hello asked for). ValueError past them."""
        sid = len(self.seqs)
        if sid >= self.link.slots:
            raise ValueError(f"stage {self.link.index}'s worker holds {self.link.slots} sequence(s) for this main")
        self.seqs[sid] = RemoteSeq(epoch=self.link.epoch)
        return sid

    def drop_seq(self, sid: int) -> None:
        """Nothing on the main; the worker drops its state at a Reset or when the link closes."""

    def lost_all(self) -> None:
        """The link reconnected: every sequence is at 0 on the fresh worker state, none armed for a Commit."""
        for s in self.seqs.values():
            s.at, s.kept_from = 0, None

    def pos(self, sid: int) -> int:
        return self.seqs[sid].at

    def reserve(self, sid: int, n: int) -> None:
        """Nothing here: the worker reserves its pages for the tokens a Forward carries (its pool holds n_ctx
        tokens of its carve, as the main's does)."""

    def capture(self, sid: int) -> RemotePart:
        """CkptSave: the worker chain keeps its part of the sequence at the current position under a new id."""
        self._room()
        cid, at = next(self._ids), self.seqs[sid].at
        self._acked(self._call(CkptSave(ckpt_id=cid, pos=at, keep=self._keep(also=cid), seq=sid)))
        return self._handle(cid, at, self.link.epoch)

    def validate(self, part, sid: int | None = None) -> None:
        if isinstance(part, RemoteBlob):
            if part.carve != self.carve:
                raise PartMismatch(f"the part is of layers {part.carve}, this remote stage runs {self.carve}")
            if not 0 <= part.pos <= self.link.n_ctx:
                raise PartMismatch(f"the part's position {part.pos} is outside [0, {self.link.n_ctx}]")
            return
        if not isinstance(part, RemotePart):
            raise PartMismatch(f"a {type(part).__name__} is not a part of a remote stage")
        if part.carve != self.carve:
            raise PartMismatch(f"the part is of layers {part.carve}, this remote stage runs {self.carve}")
        if part.gone:
            raise CheckpointGone(f"the worker dropped checkpoint {part.ckpt_id} (its pool ran short)")
        if part.released or part.epoch != self.link.epoch:
            raise CheckpointGone(f"the worker no longer holds checkpoint {part.ckpt_id} (the link reconnected)")

    def restore(self, sid: int, part) -> None:
        """CkptRestore (settling first); a RemoteBlob is sent to the worker first (PartPut). CheckpointGone when
        the worker does not hold the part."""
        self.validate(part)
        if isinstance(part, RemoteBlob):
            held = self.attach_prefix(sid, part)
            try:
                self.restore(sid, held)
            finally:
                held.release()
            return
        self.link.settle()
        self._acked(self._call(CkptRestore(ckpt_id=part.ckpt_id, pos=part.pos,
                                           keep=self._keep(also=part.ckpt_id), seq=sid)))
        self.seqs[sid].at, self.seqs[sid].kept_from = part.pos, None

    # ---- parts kept apart (parking, session files: +park) ------------------------------------------------
    def detach(self, part, to_host: bool = True):
        """A checkpoint's part to keep with its conversation: its bytes with the K/V as a prefix of the
        conversation's (to_host: running state only, PartGet with prefix), else another handle on the same id."""
        if not to_host:
            return self.attach_prefix(0, part)       # a RemotePart: another handle, no sequence touched
        self.validate(part)
        if isinstance(part, RemoteBlob):
            return part
        return RemoteBlob(carve=self.carve, pos=part.pos, is_prefix=True,
                          blob=get_part(self._call, part.ckpt_id, self.part_limit, prefix=True))

    def attach_prefix(self, sid: int, part):
        """A held part from `part`: another handle on a RemotePart's id, or a RemoteBlob sent to the worker and
        kept under a new id (PartPut: the worker checks it against its stages; a prefix blob takes the first pages
        of the worker's sequence, which holds the conversation). PartMismatch / CheckpointGone."""
        self.validate(part)
        if isinstance(part, RemotePart):
            return self._handle(part.ckpt_id, part.pos, part.epoch)
        self._room()
        cid = next(self._ids)
        try:
            ack = put_part(self._call, cid, part.pos, part.blob, self._keep(also=cid), seq=sid)
        except WorkerError as e:
            if e.link_code == ErrorCode.DESYNC:
                raise PartMismatch(f"the worker refused the part: {e}") from None
            raise
        self._acked(ack)
        return self._handle(cid, part.pos, self.link.epoch)

    def materialize(self, part):
        """The part's bytes streamed from the worker (PartGet) -> a RemoteBlob (a RemoteBlob: itself)."""
        self.validate(part)
        if isinstance(part, RemoteBlob):
            return part
        return RemoteBlob(carve=self.carve, pos=part.pos, blob=get_part(self._call, part.ckpt_id, self.part_limit))

    def write(self, part, io: BinaryIO) -> int:
        """The part's bytes (streamed from the worker first when it is held there) into `io` -> bytes written."""
        blob = self.materialize(part).blob
        io.write(blob)
        return len(blob)

    def read(self, io: BinaryIO) -> RemoteBlob:
        """A part written by ``write``: the state-part blocks whose carves tile this stage's, each header checked
        (carve, position, its declared size under part_limit) before its bytes are read; the worker checks the
        rest when the part is sent back. codec.FormatError / PartMismatch (one line)."""
        out, lo, pos, prefix = bytearray(), self.carve.lo, None, False
        fixed = struct.Struct("<4sHHII")
        while lo < self.carve.hi:
            head = codec.read_exact(io, fixed.size, "fixed header")
            magic, version, flags, hlen, hcrc = fixed.unpack(head)
            if magic != codec.MAGIC or version != codec.VERSION or flags != 0:
                raise codec.FormatError(f"not a state part of format {codec.VERSION} (magic {magic!r}, version "
                                        f"{version}, flags {flags:#06x})")
            if not 0 < hlen <= codec.MAX_HEADER:
                raise codec.FormatError(f"state part header length {hlen} is outside 1..{codec.MAX_HEADER}")
            raw = codec.read_exact(io, hlen, "header")
            header = codec.read_json_header(_io.BytesIO(raw), hlen, hcrc)
            carve, p, size = header.get("carve"), header.get("pos"), header.get("payload_bytes")
            if not (isinstance(carve, list) and len(carve) == 2 and all(type(x) is int for x in carve)) or \
                    carve[0] != lo or not lo < carve[1] <= self.carve.hi:
                raise PartMismatch(f"a part block of layers {carve!r} does not continue this remote stage's "
                                   f"{self.carve} at {lo}")
            if type(p) is not int or not 0 <= p <= self.link.n_ctx or (pos is not None and p != pos):
                raise PartMismatch(f"a part block at position {p!r} (expected {pos if pos is not None else 'any'})")
            if type(size) is not int or not 0 <= size <= self.part_limit - len(out):
                raise codec.FormatError(f"a part block declares {size!r} payload bytes, over the limit")
            prefix = prefix or bool(header.get("kv_prefix"))
            out += head
            out += raw
            out += codec.read_exact(io, size + 4, "payload")
            lo, pos = carve[1], p
        return RemoteBlob(carve=self.carve, pos=int(pos), blob=bytes(out), is_prefix=prefix)

    # ---- cutting back and speculation ------------------------------------------------------------------
    def check_truncate(self, sid: int, p: int) -> None:
        at = self.seqs[sid].at
        if not 0 <= p <= at:
            raise ValueError(f"truncate({p}) outside [0, {at}]")
        if self.recurrent and 0 < p < at:
            raise ValueError(f"cannot cut a recurrent running state back from {at} to {p}; "
                             "restore a checkpoint instead")

    def keep(self, sid: int, n: int) -> None:
        """The next Forward is a verify (want_all): the worker keeps each token's state (+spec) for the Commit."""
        self.seqs[sid].kept_from = self.seqs[sid].at

    def check_commit(self, sid: int, p: int) -> None:
        s = self.seqs[sid]
        if s.kept_from is not None and p != s.at:
            if not s.kept_from < p <= s.at:
                raise ValueError(f"commit({p}) outside the kept positions ({s.kept_from}, {s.at}]")
            return
        if p != s.at:
            self.check_truncate(sid, p)

    def commit(self, sid: int, p: int) -> None:
        """Commit(p) after a verify, sent ahead: the worker keeps [0, p), its running state taken from the state
        it kept after token p - 1 (always sent: it also ends the worker's keep)."""
        self.check_commit(sid, p)
        self.link.post(Commit(pos=int(p), seq=sid))
        self.seqs[sid].at, self.seqs[sid].kept_from = int(p), None

    def truncate(self, sid: int, p: int) -> None:
        """Commit(p), sent ahead: the worker keeps [0, p); the next prompt settles before it is read."""
        self.check_truncate(sid, p)
        self.link.post(Commit(pos=int(p), seq=sid))
        self.seqs[sid].at = int(p)

    def reset(self, sid: int) -> None:
        """Reset (a settle point). With the link down there is nothing to reset: the worker dropped the state."""
        s = self.seqs[sid]
        s.at, s.kept_from = 0, None
        if self.link.client is None:
            return
        self.link.settle()
        self._acked(self.link.call(Reset(keep=self._keep(), seq=sid)))
        s.epoch = self.link.epoch

    def trim(self, sid: int) -> None:
        """Nothing to give back on the main; a Reset gives the worker's pages back."""

    def hashes(self, sid: int) -> dict[str, str]:
        """No per-layer hashes: the worker's state is not read back over the link (hash_point has each worker log
        its own)."""
        return {}

    def hash_point(self, sid: int) -> None:
        """A Commit to the sequence's position (it keeps [0, pos): changes nothing), settled, so each worker of the
        chain run with STRATA_STATE_HASH=1 has logged its carve's state hashes (it does at a Commit) on return.
        Nothing while a verify's keep is open or the link is down."""
        s = self.seqs[sid]
        if self.link.client is None or s.kept_from is not None:
            return
        self.link.post(Commit(pos=int(s.at), seq=sid))
        self.link.settle()

    def nbytes(self, sid: int) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {"carve": [self.carve.lo, self.carve.hi], "checkpoints_held": self.held,
                "store_bytes": self.store_bytes}
