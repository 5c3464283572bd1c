"""Carrier: what a worker holds for its connected main (the stages of its carve, one live sequence per request slot
under the main's sequence ids, the part store under the main's ids: checkpoints and parked conversations, the link to
the next worker) and executes each link request on, whole or refused (Refuse); a kept part's bytes streamed to the
main and back (+park); one batched decode step over several sequences (+slots)."""
from __future__ import annotations

import io
import time
from typing import Any

import numpy as np
import structlog

from link import (Ack, BatchForward, BatchResult, BatchRows, CkptRestore, CkptSave, Commit, ErrorCode, Forward, Hello,
                  PartData, PartGet, PartPut, Reset, Result, SeqResult)
from strata.backend.quant import ROWWISE_MAX_TOKENS
from strata.memory import FormatError, KVCacheFull, PartMismatch
from strata.stages.link_client import PART_CHUNK, LinkClient, LinkDown, WorkerError, get_part, put_part
from strata.stages.batch import decode_batch
from strata.stages.sequence import Checkpoint, Sequence

log = structlog.get_logger("strata.worker")


class Refuse(Exception):
    """An operation the worker refuses: answered with Error(code, message); `fatal` also closes the link."""

    def __init__(self, code: int, message: str, fatal: bool = False):
        super().__init__(message)
        self.code, self.fatal = int(code), fatal




class Carrier:
    """What the worker holds for the connected main (used from the worker's one compute thread): the stages of
    its carve, the live sequences (one per slot the hello asked for, made at the first request that names its id;
    every state verb addresses one by its ``seq`` field), the checkpoint store shared by them (id -> Checkpoint,
    each holding its pages in the worker's pools until the main's keep list leaves it out; the oldest is dropped
    when a pool runs short, and the Result of the Forward that dropped it names it, so the main forgets it at once)
    and the link to the next worker."""

    def __init__(self, stages, hello: Hello, ckpt_max: int, next_hop: LinkClient | None):
        self.stages = stages
        self.slots = max(1, int(getattr(hello, "slots", 1)))
        # (+rowids) answer a BatchForward with BatchRows and a Forward with SeqResult
        self.row_ids = bool(getattr(hello, "row_ids", False))
        self.seqs: dict[int, Sequence] = {}
        self.n_embd, self.n_ctx, self.max_batch = int(hello.n_embd), int(hello.n_ctx), int(hello.max_batch)
        self.ckpt_max = ckpt_max
        self.store: dict[int, Checkpoint] = {}
        self.dropped: list[int] = []       # ids _make_room dropped during the operation under way
        self.next = next_hop
        self._out: tuple[tuple, bytes] | None = None               # the part PartGet streams ((id, prefix), bytes)
        self._in: tuple[int, int, int, bytearray] | None = None    # the part PartPut is receiving (id, pos, total)
        # the most bytes a part sent back may take: this worker's K/V pools and running state, twice over for
        # every worker of the chain after it
        own = sum(int(st.memory.stats().get("kv", {}).get("bytes", 0)) + int(st.memory.stats().get(
            "running", {}).get("bytes_per_sequence", 0)) + (1 << 20) for st in stages)
        self.part_limit = own * 2 * (1 + len(hello.next_hops))

    def seq_of(self, sid: int) -> Sequence:
        """The live sequence `sid` (made, empty, at its first use); Refuse (LIMIT) for an id outside the hello's
        slots."""
        s = self.seqs.get(sid)
        if s is None:
            if not 0 <= sid < self.slots:
                raise Refuse(ErrorCode.LIMIT, f"sequence {sid} is outside the {self.slots} slot(s) the hello asked for")
            s = self.seqs[sid] = Sequence(self.stages, make_room=self._make_room)
        return s

    @property
    def seq(self) -> Sequence:
        """Sequence 0 (the only one a main of one slot uses)."""
        return self.seq_of(0)

    # ---- operations (each either succeeds whole or raises Refuse) ------------------------------------------
    def handle(self, msg) -> Any:
        try:
            if isinstance(msg, Forward):
                return self.forward(msg)
            if isinstance(msg, BatchForward):
                return self.batch_forward(msg)
            if isinstance(msg, CkptSave):
                return self.ckpt_save(msg)
            if isinstance(msg, CkptRestore):
                return self.ckpt_restore(msg)
            if isinstance(msg, Reset):
                return self.reset(msg)
            if isinstance(msg, Commit):
                return self.commit(msg)
            if isinstance(msg, PartGet):
                return self.part_get(msg)
            if isinstance(msg, PartPut):
                return self.part_put(msg)
        except WorkerError as e:            # the next worker's refusal, passed back with its code
            raise Refuse(e.link_code, str(e)) from None
        except LinkDown as e:
            raise Refuse(ErrorCode.NEXT_HOP, str(e), fatal=True) from None
        except KVCacheFull as e:
            raise Refuse(ErrorCode.LIMIT, str(e)) from None
        except (PartMismatch, FormatError) as e:
            raise Refuse(ErrorCode.DESYNC, str(e)) from None
        except ValueError as e:
            raise Refuse(ErrorCode.DESYNC, str(e)) from None
        raise Refuse(ErrorCode.BAD_FRAME, f"a {type(msg).__name__} is not a request a worker serves", fatal=True)

    def _at(self, seq: Sequence, pos: int, what: str) -> None:
        if pos != seq.pos:
            raise Refuse(ErrorCode.DESYNC, f"{what} at position {pos}, but this worker's sequence is at {seq.pos}")

    def _sid(self, seq: Sequence) -> int:
        """The id under which this worker holds `seq` (what a SeqResult names: the worker's own state, not the
        request's field)."""
        return next(k for k, s in self.seqs.items() if s is seq)

    def forward(self, m: Forward) -> Result:
        """One sequence's Forward (a prefill chunk, a lone decode, a verify), and the next worker's (relay) with the
        same rows. Asked at the hello (+rowids), the answer is a SeqResult naming the sequence the rows were read
        for: the next worker's passed through unchanged, this worker's own where the next one does not give one."""
        seq = self.seq_of(m.seq)
        self._at(seq, m.pos, "Forward")
        n = int(m.tokens.shape[0])
        if n < 1 or n > self.max_batch or m.pos + n > self.n_ctx:
            raise Refuse(ErrorCode.LIMIT, f"a Forward of {n} tokens at {m.pos} exceeds the hello's limits "
                                          f"(max_batch {self.max_batch}, n_ctx {self.n_ctx})")
        if tuple(m.hidden.shape) != (n, self.n_embd):
            raise Refuse(ErrorCode.BAD_FRAME, f"hidden states {tuple(m.hidden.shape)} for {n} tokens of width "
                                              f"{self.n_embd}", fatal=True)
        t0 = time.perf_counter()
        self.dropped = []
        verify = m.want_all and n <= ROWWISE_MAX_TOKENS
        if verify:                                     # a verify (+spec): each token's state kept for the Commit
            seq.keep(n)
        # every row wanted: a GPU plan reads a verify as decode steps over columns (never its prefill), on a carve of
        # attention layers only too, so that its rows are the decode steps' (the worker's carve has no head: hidden
        # states come back either way)
        x = seq.forward(m.tokens, x_in=np.asarray(m.hidden, dtype=np.float32), all_logits=verify)
        be = self.stages[-1].backend
        if self.next is not None:
            h = np.ascontiguousarray(be.to_host(x), dtype=np.float32)
            res = self.next.call(Forward(pos=m.pos, want_all=m.want_all, tokens=m.tokens, hidden=h, seq=m.seq))
            if not isinstance(res, Result) or isinstance(res, SeqResult) != self.next.row_ids:
                raise Refuse(ErrorCode.NEXT_HOP, f"the next worker {self.next.address} answered a Forward with a "
                                                 f"{type(res).__name__} (row ids agreed at its hello: "
                                                 f"{'yes' if self.next.row_ids else 'no'})")
            hidden = res.hidden
            self.dropped += [i for i in res.dropped if i not in self.dropped]   # the chain's drops, one list
        else:
            hidden = np.ascontiguousarray(be.to_host(x if m.want_all else x[-1:]), dtype=np.float32)
        us, dropped = int((time.perf_counter() - t0) * 1e6), sorted(self.dropped)
        if self.row_ids:        # the next worker's id, passed through unchanged (the main checks), else this one's
            sid = res.seq if self.next is not None and self.next.row_ids else self._sid(seq)
            return SeqResult(pos=seq.pos, compute_us=us, hidden=hidden, dropped=dropped, seq=sid)
        return Result(pos=seq.pos, compute_us=us, hidden=hidden, dropped=dropped)

    def batch_forward(self, m: BatchForward) -> BatchResult:
        """One decode step of several sequences (+slots): every row checked (its sequence at its position, the hidden
        rows' shape) before anything is read, then the stages' batched step (decode_batch: row i bit-identical to
        that sequence's lone one-token Forward), and the next worker's (relay) with the same rows. Asked at the hello
        (+rowids), the answer is a BatchRows naming each row's sequence and the position its token took: the next
        worker's ids passed through unchanged, this worker's own where the next one does not give any."""
        n = len(m.seqs)
        if n > self.slots:
            raise Refuse(ErrorCode.LIMIT, f"a BatchForward of {n} rows exceeds the hello's {self.slots} slot(s)")
        if tuple(m.hidden.shape) != (n, self.n_embd):
            raise Refuse(ErrorCode.BAD_FRAME, f"hidden states {tuple(m.hidden.shape)} for {n} rows of width "
                                              f"{self.n_embd}", fatal=True)
        seqs = [self.seq_of(q) for q in m.seqs]
        for q, s, p in zip(m.seqs, seqs, m.positions):
            self._at(s, p, f"BatchForward row of sequence {q}")
            if p + 1 > self.n_ctx:
                raise Refuse(ErrorCode.LIMIT, f"a BatchForward row at {p} exceeds the hello's n_ctx {self.n_ctx}")
        t0 = time.perf_counter()
        self.dropped = []
        x = decode_batch(seqs, m.tokens, x_in=np.asarray(m.hidden, dtype=np.float32))
        h = np.ascontiguousarray(self.stages[-1].backend.to_host(x), dtype=np.float32)
        # each row's ids as this worker's step left them: the sequence it read, the position its token took
        ids = (list(m.seqs), [s.pos - 1 for s in seqs])
        if self.next is not None:
            res = self.next.call(BatchForward(seqs=list(m.seqs), positions=list(m.positions), tokens=m.tokens,
                                              hidden=h))
            if not isinstance(res, BatchResult) or isinstance(res, BatchRows) != self.next.row_ids:
                raise Refuse(ErrorCode.NEXT_HOP, f"the next worker {self.next.address} answered a BatchForward with "
                                                 f"a {type(res).__name__} (row ids agreed at its hello: "
                                                 f"{'yes' if self.next.row_ids else 'no'})")
            h = res.hidden
            self.dropped += [i for i in res.dropped if i not in self.dropped]
            if self.next.row_ids:               # the next worker's ids, passed through unchanged (the main checks)
                ids = (list(res.seqs), list(res.positions))
        us, dropped = int((time.perf_counter() - t0) * 1e6), sorted(self.dropped)
        if self.row_ids:
            return BatchRows(compute_us=us, hidden=h, dropped=dropped, seqs=ids[0], positions=ids[1])
        return BatchResult(compute_us=us, hidden=h, dropped=dropped)

    def _prune(self, keep) -> None:
        for k in [k for k in self.store if k not in set(keep)]:
            self.store.pop(k).release()

    def _make_room(self, seq: Sequence) -> bool:
        """Drop the oldest checkpoint part (its pages given back; its id noted in ``dropped``) -> False when none
        is kept."""
        if not self.store:
            return False
        oldest = min(self.store)
        self.store.pop(oldest).release()
        self.dropped.append(oldest)
        return True

    def _ack(self, seq: Sequence) -> Ack:
        return Ack(pos=seq.pos, held=len(self.store), store_bytes=sum(c.nbytes() for c in self.store.values()))

    def ckpt_save(self, m: CkptSave) -> Ack:
        seq = self.seq_of(m.seq)
        self._at(seq, m.pos, "CkptSave")
        kept = set(m.keep) & (set(self.store) | {m.ckpt_id})
        if len(kept | {m.ckpt_id}) > self.ckpt_max:
            raise Refuse(ErrorCode.LIMIT, f"keeping {len(kept | {m.ckpt_id})} checkpoint parts exceeds the "
                                          f"{self.ckpt_max} granted at the hello")
        self._prune(list(m.keep) + [m.ckpt_id])      # what the main no longer holds gives its pages back first
        cp = seq.capture()
        try:
            if self.next is not None:
                self.next.call(CkptSave(ckpt_id=m.ckpt_id, pos=m.pos, keep=list(m.keep), seq=m.seq))
        except BaseException:
            cp.release()
            raise
        return self._keep(m.ckpt_id, cp, m.keep, seq)

    def _keep(self, ckpt_id: int, cp: Checkpoint, keep, seq: Sequence) -> Ack:
        """Store cp under ckpt_id (a part kept there before gives its pages back), then drop what the keep list
        leaves out."""
        old = self.store.pop(ckpt_id, None)
        if old is not None:
            old.release()
        self.store[ckpt_id] = cp
        self._prune(list(keep) + [ckpt_id])
        return self._ack(seq)

    def ckpt_restore(self, m: CkptRestore) -> Ack:
        seq = self.seq_of(m.seq)
        cp = self.store.get(m.ckpt_id)
        if cp is None:
            raise Refuse(ErrorCode.CKPT_MISSING, f"checkpoint {m.ckpt_id} is not held here "
                                                 f"({len(self.store)} held)")
        if cp.pos != m.pos:
            raise Refuse(ErrorCode.DESYNC, f"checkpoint {m.ckpt_id} is at {cp.pos}, not {m.pos}")
        self._prune(list(m.keep) + [m.ckpt_id])      # what the main no longer holds gives its pages back first
        seq.restore(cp)
        if self.next is not None:
            self.next.call(CkptRestore(ckpt_id=m.ckpt_id, pos=m.pos, keep=list(m.keep), seq=m.seq))
        self._prune(list(m.keep) + [m.ckpt_id])
        return self._ack(seq)

    def part_get(self, m: PartGet) -> PartData:
        """A chunk of kept part `ckpt_id`'s bytes: this worker's stages' parts in the state-part format, then the
        next worker's (fetched whole from it); the bytes are made at offset 0 and kept until the last chunk."""
        key = (m.ckpt_id, bool(m.prefix))
        if m.offset == 0 or self._out is None or self._out[0] != key:
            cp = self.store.get(m.ckpt_id)
            if cp is None:
                raise Refuse(ErrorCode.CKPT_MISSING, f"part {m.ckpt_id} is not held here ({len(self.store)} held)")
            if m.offset != 0:
                raise Refuse(ErrorCode.DESYNC, f"PartGet({m.ckpt_id}) at {m.offset} before its start")
            buf = io.BytesIO()
            for st, part in zip(self.stages, cp.parts):
                st.memory.write(st.memory.detach(part) if m.prefix else part, buf)
            if self.next is not None:
                buf.write(get_part(self.next.call, m.ckpt_id, self.part_limit, m.prefix))
            self._out = (key, buf.getvalue())
        blob = self._out[1]
        if not 0 <= m.offset <= len(blob):
            raise Refuse(ErrorCode.DESYNC, f"PartGet({m.ckpt_id}) at {m.offset} past its {len(blob)} bytes")
        chunk = blob[m.offset:m.offset + PART_CHUNK]
        if m.offset + len(chunk) >= len(blob):
            self._out = None
        return PartData(total=len(blob), offset=m.offset, data=np.frombuffer(chunk, np.uint8))

    def part_put(self, m: PartPut) -> Ack:
        """A chunk of a part's bytes for `ckpt_id`; the last one reads this worker's stages' parts (each header and
        its arrays checked against the stage before anything is allocated), sends the rest to the next worker,
        keeps the part under the id and prunes the store to the keep list."""
        n = int(m.data.shape[0])
        seq = self.seq_of(m.seq)
        if m.offset == 0:
            if not 0 < m.total <= self.part_limit:
                raise Refuse(ErrorCode.LIMIT, f"a part of {m.total} bytes exceeds this worker's {self.part_limit}")
            self._in = (m.ckpt_id, m.pos, m.total, bytearray())
        got = self._in
        if got is None or got[:3] != (m.ckpt_id, m.pos, m.total) or len(got[3]) != m.offset or \
                m.offset + n > m.total or (n == 0 and m.offset < m.total):
            self._in = None
            raise Refuse(ErrorCode.DESYNC, f"PartPut({m.ckpt_id}) chunk at {m.offset} of {m.total} out of order")
        got[3].extend(m.data.tobytes())
        if len(got[3]) < m.total:
            return self._ack(seq)
        self._in = None
        kept = set(m.keep) & (set(self.store) | {m.ckpt_id})
        if len(kept | {m.ckpt_id}) > self.ckpt_max:
            raise Refuse(ErrorCode.LIMIT, f"keeping {len(kept | {m.ckpt_id})} parts exceeds the {self.ckpt_max} "
                                          f"granted at the hello")
        self._prune(list(m.keep) + [m.ckpt_id])
        src = io.BytesIO(bytes(got[3]))
        parts = []
        for st in self.stages:
            part = st.memory.read(src)
            if part.pos != m.pos:
                raise Refuse(ErrorCode.DESYNC, f"a part block at position {part.pos}, not {m.pos}")
            parts.append(part)
        rest = src.read()
        if not self.next and rest:
            raise Refuse(ErrorCode.DESYNC, f"{len(rest)} bytes after the last part block of this worker's layers")
        if any(p.is_prefix for p in parts):     # a checkpoint of the conversation the sequence holds: its first pages
            if m.pos > seq.pos:
                raise Refuse(ErrorCode.DESYNC, f"a prefix part at {m.pos} past the sequence's {seq.pos} tokens")
            held: list = []
            try:
                for st, sid, p in zip(self.stages, seq.sids, parts):
                    held.append(st.memory.attach_prefix(sid, p))
            except BaseException:
                for h in held:
                    h.release()
                raise
            cp = Checkpoint(pos=m.pos, tokens=seq.ids[:m.pos], parts=held)
        else:
            cp = Checkpoint(pos=m.pos, tokens=np.zeros(m.pos, np.int32), parts=parts)
        if self.next is not None:
            try:
                put_part(self.next.call, m.ckpt_id, m.pos, rest, list(m.keep), seq=m.seq)
            except BaseException:
                cp.release()
                raise
        return self._keep(m.ckpt_id, cp, m.keep, seq)

    def reset(self, m: Reset) -> Ack:
        seq = self.seq_of(m.seq)
        self._prune(m.keep)
        seq.reset()
        if self.next is not None:
            self.next.call(Reset(keep=list(m.keep), seq=m.seq))
        self._prune(m.keep)
        return self._ack(seq)

    def commit(self, m: Commit) -> Ack:
        """Keep positions [0, pos): after a verify (a Forward with want_all) any position it read, the running state
        taken from the state kept there; otherwise a cut-back (attention K/V only)."""
        seq = self.seq_of(m.seq)
        seq.commit(int(m.pos))
        if self.next is not None:
            self.next.call(Commit(pos=m.pos, seq=m.seq))
        return self._ack(seq)

    def ping_next(self) -> bool:
        """Ping the next worker when its link has been quiet for a second -> False when it is gone."""
        if self.next is None or time.monotonic() - self.next.heard < 1.0:
            return True
        try:
            self.next.ping()
        except (LinkDown, WorkerError) as e:
            log.warning("the next worker is gone", error=str(e))
            return False
        return True

    def close(self) -> None:
        """Disconnect: the store is cleared, every sequence's pages given back, the next worker's link closed."""
        for cp in self.store.values():
            cp.release()
        self.store.clear()
        try:
            for s in self.seqs.values():
                s.drop()
            self.seqs.clear()
        finally:
            if self.next is not None:
                self.next.close()
                self.next = None
