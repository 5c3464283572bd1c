"""Carrier: what a worker holds for its connected main (the stages of its carve, the live sequence, the checkpoint
store under the main's ids, the link to the next worker) and executes each link request on, whole or refused
(Refuse)."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import structlog

from link import Ack, CkptRestore, CkptSave, Commit, ErrorCode, Forward, Hello, Reset, Result
from strata.backend.quant import ROWWISE_MAX_TOKENS
from strata.memory import KVCacheFull, PartMismatch
from strata.stages.link_client import LinkClient, LinkDown, WorkerError
from strata.stages.sequence import Checkpoint, Sequence

log = structlog.get_logger("strata.worker")


class Refuse(Exception):
    """An operation the worker refuses: answered with Error(code, message); `fatal` also closes the link."""

    def __init__(self, code: int, message: str, fatal: bool = False):
        super().__init__(message)
        self.code, self.fatal = int(code), fatal




class Carrier:
    """What the worker holds for the connected main (used from the worker's one compute thread): the stages of
    its carve, the live sequence, the checkpoint store (id -> Checkpoint, each holding its pages in the worker's
    pools until the main's keep list leaves it out; the oldest is dropped when a pool runs short, and the main
    reads from 0 when it asks for it) and the link to the next worker."""

    def __init__(self, stages, hello: Hello, ckpt_max: int, next_hop: LinkClient | None):
        self.stages, self.seq = stages, Sequence(stages, make_room=self._make_room)
        self.n_embd, self.n_ctx, self.max_batch = int(hello.n_embd), int(hello.n_ctx), int(hello.max_batch)
        self.ckpt_max = ckpt_max
        self.store: dict[int, Checkpoint] = {}
        self.next = next_hop

    # ---- operations (each either succeeds whole or raises Refuse) ------------------------------------------
    def handle(self, msg) -> Any:
        try:
            if isinstance(msg, Forward):
                return self.forward(msg)
            if isinstance(msg, CkptSave):
                return self.ckpt_save(msg)
            if isinstance(msg, CkptRestore):
                return self.ckpt_restore(msg)
            if isinstance(msg, Reset):
                return self.reset(msg)
            if isinstance(msg, Commit):
                return self.commit(msg)
        except WorkerError as e:            # the next worker's refusal, passed back with its code
            raise Refuse(e.link_code, str(e)) from None
        except LinkDown as e:
            raise Refuse(ErrorCode.NEXT_HOP, str(e), fatal=True) from None
        except KVCacheFull as e:
            raise Refuse(ErrorCode.LIMIT, str(e)) from None
        except (PartMismatch, ValueError) as e:
            raise Refuse(ErrorCode.DESYNC, str(e)) from None
        raise Refuse(ErrorCode.BAD_FRAME, f"a {type(msg).__name__} is not a request a worker serves", fatal=True)

    def _at(self, pos: int, what: str) -> None:
        if pos != self.seq.pos:
            raise Refuse(ErrorCode.DESYNC, f"{what} at position {pos}, but this worker's sequence is at {self.seq.pos}")

    def forward(self, m: Forward) -> Result:
        self._at(m.pos, "Forward")
        n = int(m.tokens.shape[0])
        if n < 1 or n > self.max_batch or m.pos + n > self.n_ctx:
            raise Refuse(ErrorCode.LIMIT, f"a Forward of {n} tokens at {m.pos} exceeds the hello's limits "
                                          f"(max_batch {self.max_batch}, n_ctx {self.n_ctx})")
        if tuple(m.hidden.shape) != (n, self.n_embd):
            raise Refuse(ErrorCode.BAD_FRAME, f"hidden states {tuple(m.hidden.shape)} for {n} tokens of width "
                                              f"{self.n_embd}", fatal=True)
        t0 = time.perf_counter()
        verify = m.want_all and n <= ROWWISE_MAX_TOKENS
        if verify:                                     # a verify (+spec): each token's state kept for the Commit
            self.seq.keep(n)
        # every row wanted: a GPU plan reads a verify as decode steps over columns (never its prefill), on a carve of
        # attention layers only too, so that its rows are the decode steps' (the worker's carve has no head: hidden
        # states come back either way)
        x = self.seq.forward(m.tokens, x_in=np.asarray(m.hidden, dtype=np.float32), all_logits=verify)
        be = self.stages[-1].backend
        if self.next is not None:
            h = np.ascontiguousarray(be.to_host(x), dtype=np.float32)
            res = self.next.call(Forward(pos=m.pos, want_all=m.want_all, tokens=m.tokens, hidden=h))
            hidden = res.hidden
        else:
            hidden = np.ascontiguousarray(be.to_host(x if m.want_all else x[-1:]), dtype=np.float32)
        return Result(pos=self.seq.pos, compute_us=int((time.perf_counter() - t0) * 1e6), hidden=hidden)

    def _prune(self, keep) -> None:
        for k in [k for k in self.store if k not in set(keep)]:
            self.store.pop(k).release()

    def _make_room(self) -> bool:
        """Drop the oldest checkpoint part (its pages given back) -> False when none is kept."""
        if not self.store:
            return False
        self.store.pop(min(self.store)).release()
        return True

    def _ack(self) -> Ack:
        return Ack(pos=self.seq.pos, held=len(self.store), store_bytes=sum(c.nbytes() for c in self.store.values()))

    def ckpt_save(self, m: CkptSave) -> Ack:
        self._at(m.pos, "CkptSave")
        kept = set(m.keep) & (set(self.store) | {m.ckpt_id})
        if len(kept | {m.ckpt_id}) > self.ckpt_max:
            raise Refuse(ErrorCode.LIMIT, f"keeping {len(kept | {m.ckpt_id})} checkpoint parts exceeds the "
                                          f"{self.ckpt_max} granted at the hello")
        cp = self.seq.capture()
        try:
            if self.next is not None:
                self.next.call(CkptSave(ckpt_id=m.ckpt_id, pos=m.pos, keep=list(m.keep)))
        except BaseException:
            cp.release()
            raise
        old = self.store.pop(m.ckpt_id, None)
        if old is not None:
            old.release()
        self.store[m.ckpt_id] = cp
        self._prune(list(m.keep) + [m.ckpt_id])
        return self._ack()

    def ckpt_restore(self, m: CkptRestore) -> Ack:
        cp = self.store.get(m.ckpt_id)
        if cp is None:
            raise Refuse(ErrorCode.CKPT_MISSING, f"checkpoint {m.ckpt_id} is not held here "
                                                 f"({len(self.store)} held)")
        if cp.pos != m.pos:
            raise Refuse(ErrorCode.DESYNC, f"checkpoint {m.ckpt_id} is at {cp.pos}, not {m.pos}")
        self.seq.restore(cp)
        if self.next is not None:
            self.next.call(CkptRestore(ckpt_id=m.ckpt_id, pos=m.pos, keep=list(m.keep)))
        self._prune(list(m.keep) + [m.ckpt_id])
        return self._ack()

    def reset(self, m: Reset) -> Ack:
        self.seq.reset()
        if self.next is not None:
            self.next.call(Reset(keep=list(m.keep)))
        self._prune(m.keep)
        return self._ack()

    def commit(self, m: Commit) -> Ack:
        """Keep positions [0, pos): after a verify (a Forward with want_all) any position it read, the running state
        taken from the state kept there; otherwise a cut-back (attention K/V only)."""
        self.seq.commit(int(m.pos))
        if self.next is not None:
            self.next.call(Commit(pos=m.pos))
        return self._ack()

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
        """Disconnect: the store is cleared, the sequence's pages given back, the next worker's link closed."""
        for cp in self.store.values():
            cp.release()
        self.store.clear()
        try:
            self.seq.drop()
        finally:
            if self.next is not None:
                self.next.close()
                self.next = None
