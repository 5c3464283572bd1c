"""Sequence (one conversation across the engine's stages: its token ids and its id in each stage's memory) and
Checkpoint (the sequence at a position: one state part per stage)."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from strata.memory import KVCacheFull, Memory, PartMismatch, StatePart
from strata.memory.host import with_field_hashes
from strata.text.token_ids import as_ids, frozen_ids


@dataclass(eq=False)      # its tokens are an array: equality is identity
class Checkpoint:
    """The sequence at ``pos``: its token ids and one StatePart per stage, in stage order (each naming its
    carve). What the checkpoint cache keeps; restoring it lets a prompt that shares those tokens start at pos,
    whatever the sequence did since (its parts hold their pages until ``release``).
    tokens: any sequence of ids, kept as a read-only int32 array (strata.text.token_ids)."""

    pos: int
    tokens: np.ndarray
    parts: list[StatePart]

    def __post_init__(self):
        self.tokens = frozen_ids(self.tokens)

    def nbytes(self) -> int:
        """Bytes held: every part's own bytes + token ids (int32)."""
        return sum(p.nbytes() for p in self.parts) + 4 * len(self.tokens)

    def release(self) -> None:
        """Give back the pages every part holds (idempotent); the checkpoint cannot be restored after."""
        for p in self.parts:
            p.release()


class Sequence:
    """One live conversation on the engine: the token ids read so far (the main process decides
    positions) and, per stage, its sequence id there. Every operation runs over all stages; restore validates
    every stage's part before any stage is written. The ids live in one int32 buffer (``ids``, a read-only view),
    so reading n tokens costs O(n) and comparing the sequence with a prompt is one numpy comparison."""

    def __init__(self, stages: list, make_room: Callable[["Sequence"], bool] | None = None):
        self.stages = stages
        self.sids = [st.memory.new_seq() for st in stages]
        self._buf = np.zeros(256, np.int32)
        self._n = 0
        # make_room(sequence), called when a stage's KV pool is short for this sequence: frees pages (the
        # conversation store moves a conversation parked on the device to host RAM or drops a checkpoint) and returns
        # True, or False when nothing more can be freed (KVCacheFull then stands)
        self.make_room = make_room
        # whether the next prompt may continue this sequence live (False after a "strata_checkpoint": false
        # request, a cancelled read or a forget: it then resumes from a checkpoint or from 0)
        self.live_ok = True
        self.forward_returned = time.monotonic()       # when the last forward call returned (or raised)
        self.epoch = 0          # counts the changes that are not reads (restore, cut back, reset): what the
        #                         hidden states a drafter holds for this sequence's positions are checked against

    @property
    def pos(self) -> int:
        return self._n

    @property
    def ids(self) -> np.ndarray:
        """The token ids read so far: a read-only int32 view (valid until the sequence changes)."""
        v = self._buf[:self._n]
        v.flags.writeable = False
        return v

    @property
    def tokens(self) -> list[int]:
        """The token ids read so far, as a new list (``ids`` is the view without a copy)."""
        return self._buf[:self._n].tolist()

    def _set(self, ids) -> None:
        """Make ``ids`` the sequence's token ids (the buffer grows to hold them)."""
        ids = as_ids(ids)
        self._reserve_ids(ids.shape[0])
        self._buf[:ids.shape[0]] = ids
        self._n = int(ids.shape[0])

    def _reserve_ids(self, n: int) -> None:
        if n > self._buf.shape[0]:
            buf = np.zeros(max(n, 2 * self._buf.shape[0]), np.int32)
            buf[:self._n] = self._buf[:self._n]
            self._buf = buf

    # ---- reading ---------------------------------------------------------------------------------
    def forward(self, tokens, all_logits: bool = False, on_device: bool = False, x_in=None, hidden: bool = False):
        """Read `tokens` through every stage, hidden states handed from one to the next -> the last stage's logits
        (a worker's stages: its last carve's hidden states; with hidden, (logits, the last stage's final-normed
        hidden states of every row), for the drafter). x_in: the hidden states the first stage starts from
        when it is not stage 0 of the model (a worker's). Pages for the new tokens are reserved on every stage
        first, so KVCacheFull changes nothing."""
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
        self.reserve(int(toks.shape[0]))
        x = x_in
        try:
            for st, sid in zip(self.stages, self.sids):
                if hidden and st.last:
                    x = st.forward(toks, sid, x_in=x, all_logits=all_logits, on_device=on_device, hidden=True)
                else:
                    x = st.forward(toks, sid, x_in=x, all_logits=all_logits, on_device=on_device)
        finally:
            self.forward_returned = time.monotonic()     # what /health's stall check reads
        k = int(toks.shape[0])
        self._reserve_ids(self._n + k)
        self._buf[self._n:self._n + k] = toks
        self._n += k
        return x

    def verify(self, tokens, on_device: bool = False) -> tuple[np.ndarray, object]:
        """A speculative verify: read `tokens` (the pending token and the drafts) through every stage in one
        forward, each stage keeping the state after every token (Memory.keep) -> (logits of every row, the last
        stage's final-normed hidden states of every row). ``commit`` then settles the accepted count. on_device
        (a last stage with ``device_logits``): the rows stay on the last stage's device, (n, n_vocab) in its
        array module, ordered on the current stream, valid until the next read."""
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = int(toks.shape[0])
        self.reserve(n)
        self.keep(n)
        x = None
        try:
            for st, sid in zip(self.stages, self.sids):
                x = st.forward(toks, sid, x_in=x, all_logits=True, hidden=st.last, on_device=on_device and st.last)
        finally:
            self.forward_returned = time.monotonic()
        self._reserve_ids(self._n + n)
        self._buf[self._n:self._n + n] = toks
        self._n += n
        return x

    def keep(self, n: int) -> None:
        """Arm every stage to keep each token's state through the next forward of at most n tokens (Memory.keep)."""
        for st, sid in zip(self.stages, self.sids):
            st.memory.keep(sid, n)

    def commit(self, p: int) -> None:
        """The Commit after a verify: every stage at position p (one the verify read; its K/V cut back, its running
        state taken from the state kept after token p - 1), the token ids too. Every stage's check runs before any
        stage changes (ValueError)."""
        if not 0 <= p <= self.pos:
            raise ValueError(f"commit({p}) outside [0, {self.pos}]")
        for st, sid in zip(self.stages, self.sids):
            st.memory.check_commit(sid, p)
        for st, sid in zip(self.stages, self.sids):
            st.memory.commit(sid, p)
        self._n = p

    def reserve(self, n: int) -> None:
        """Pages for n more tokens on every stage; when a pool is short, ``make_room`` frees pages until it fits
        or nothing more can be freed (KVCacheFull, changing nothing but the extra pages reserved)."""
        def each():
            for st, sid in zip(self.stages, self.sids):
                st.memory.reserve(sid, n)
        self.with_room(each)

    def with_room(self, fn: Callable[[], Any]) -> Any:
        """fn(), again after ``make_room`` freed pages each time it raises KVCacheFull (fn must change nothing
        when it does), until it succeeds or nothing more can be freed (the KVCacheFull stands)."""
        while True:
            try:
                return fn()
            except KVCacheFull:
                if self.make_room is None or not self.make_room(self):
                    raise

    def record(self, tokens) -> None:
        """Add `tokens` to the ids read, after a forward that read them on every stage outside ``forward`` (a
        batched decode step, strata/stages/batch.py)."""
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
        k = int(toks.shape[0])
        self._reserve_ids(self._n + k)
        self._buf[self._n:self._n + k] = toks
        self._n += k

    # ---- state -----------------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait until nothing sent ahead is in flight on any stage (a remote stage's Commits): before a prompt
        is read, as a restore and a reset do."""
        for st in self.stages:
            st.settle()

    def lost(self) -> bool:
        """Whether some stage lost its part of this sequence (a remote stage's link reconnected since)."""
        return any(st.lost(sid) for st, sid in zip(self.stages, self.sids))

    def unavailable(self) -> str | None:
        """Why the stages cannot run requests now, or None."""
        return next((r for r in (st.unavailable() for st in self.stages) if r), None)

    def capture(self) -> Checkpoint:
        """A checkpoint at the current position (each stage drained on its own device first), its pages held on
        every stage until ``Checkpoint.release``. All or nothing."""
        parts: list = []
        try:
            for st, sid in zip(self.stages, self.sids):
                parts.append(st.memory.capture(sid))
        except BaseException:
            self.release(parts)
            raise
        return Checkpoint(pos=self.pos, tokens=frozen_ids(self.ids), parts=parts)

    # ---- checkpoints inside one read ------------------------------------------------------------------
    @property
    def can_mark(self) -> bool:
        """Whether every stage's memory keeps running states at marked positions inside a read (Memory.mark; a
        remote stage's does not: its read is split at the checkpoints instead)."""
        return all(isinstance(st.memory, Memory) for st in self.stages)

    def mark(self, positions) -> None:
        """Arm the next forward on every stage to keep the state at each of `positions` (Memory.mark; none: disarm),
        for ``capture_at``."""
        for st, sid in zip(self.stages, self.sids):
            st.memory.mark(sid, positions)

    def capture_at(self, p: int) -> Checkpoint:
        """A checkpoint at position p, which the marked forward just read (p == pos: ``capture``): each stage's
        state kept there (Memory.capture_at), pages of [0, p) held. All or nothing; ValueError for a position not
        kept."""
        if p == self.pos:
            return self.capture()
        parts: list = []
        try:
            for st, sid in zip(self.stages, self.sids):
                parts.append(st.memory.capture_at(sid, p))
        except BaseException:
            self.release(parts)
            raise
        return Checkpoint(pos=p, tokens=frozen_ids(self.ids[:p]), parts=parts)

    def validate(self, ckpt: Checkpoint) -> None:
        """PartMismatch (one line, naming the stage) unless every part fits its own stage and this sequence."""
        if len(ckpt.parts) != len(self.stages):
            raise PartMismatch(f"the checkpoint has {len(ckpt.parts)} stage parts, this engine runs "
                               f"{len(self.stages)} stages")
        if len(ckpt.tokens) != ckpt.pos:
            raise PartMismatch(f"the checkpoint at {ckpt.pos} holds {len(ckpt.tokens)} tokens")
        for st, sid, part in zip(self.stages, self.sids, ckpt.parts):
            if part.pos != ckpt.pos:
                raise PartMismatch(f"stage {st.index}'s part is at position {part.pos}, the checkpoint at {ckpt.pos}")
            try:
                st.memory.validate(part, sid)
            except PartMismatch as e:
                raise PartMismatch(f"stage {st.index} ({st.carve} on {st.device}): {e}") from None

    def restore(self, ckpt: Checkpoint) -> None:
        """Validate every part, then restore each stage (drained on its own device) and the tokens."""
        self.validate(ckpt)
        self.epoch += 1
        for st, sid, part in zip(self.stages, self.sids, ckpt.parts):
            st.memory.restore(sid, part)
        self._set(ckpt.tokens)

    # ---- conversations held apart (parking, session files) -----------------------------------------
    def materialize(self, ckpt: Checkpoint) -> list[StatePart]:
        """Host copies of every stage's part of `ckpt` (its K/V pages and running state)."""
        return [st.memory.materialize(p) for st, p in zip(self.stages, ckpt.parts)]

    def detach(self, ckpt: Checkpoint, to_host: bool = True) -> list[StatePart]:
        """`ckpt`'s parts to keep with their conversation: running state as host copies (to_host=False: left on
        the device, for a conversation parked there), K/V as a prefix."""
        return [st.memory.detach(p, to_host) for st, p in zip(self.stages, ckpt.parts)]

    def can_hold(self) -> bool:
        """Whether every stage's captured parts hold their pages on its device (local stages; not a remote one)."""
        return all(st.memory.holds_pages for st in self.stages)

    def release(self, parts: list[StatePart]) -> None:
        """Give back the pages of held parts (see hold)."""
        for p in parts:
            p.release()             # references only: nothing on a device is read or written

    def validate_detached(self, pos: int, parts: list[StatePart]) -> None:
        """PartMismatch unless `parts` (detached, see detach) fit the stages at position `pos`."""
        if len(parts) != len(self.stages):
            raise PartMismatch(f"a checkpoint at {pos} has {len(parts)} stage parts, this engine runs "
                               f"{len(self.stages)} stages")
        for st, part in zip(self.stages, parts):
            if part.pos != pos:
                raise PartMismatch(f"stage {st.index}'s checkpoint part is at {part.pos}, expected {pos}")
            try:
                st.memory.validate(part)
            except PartMismatch as e:
                raise PartMismatch(f"stage {st.index} ({st.carve} on {st.device}): {e}") from None

    def attach(self, pos: int, parts: list[StatePart]) -> Checkpoint:
        """A checkpoint of this sequence at `pos` from detached parts: its first pages held, running state copied to
        each stage. All or nothing."""
        out: list = []
        try:
            for st, sid, p in zip(self.stages, self.sids, parts):
                out.append(st.memory.attach_prefix(sid, p))
        except BaseException:
            self.release(out)
            raise
        return Checkpoint(pos=pos, tokens=frozen_ids(self.ids[:pos]), parts=out)

    def truncate(self, p: int) -> None:
        """Cut back to p tokens on every stage (ValueError, changing nothing, where a running state refuses)."""
        if not 0 <= p <= self.pos:
            raise ValueError(f"truncate({p}) outside [0, {self.pos}]")
        if p == self.pos:
            return
        if p == 0:
            self.reset()
            return
        for st, sid in zip(self.stages, self.sids):          # every stage's check before any cut
            st.memory.check_truncate(sid, p)
        self.epoch += 1
        for st, sid in zip(self.stages, self.sids):
            st.memory.truncate(sid, p)
        self._n = p

    def drop(self) -> None:
        """Give every stage's pages of this sequence back and forget it there (the sequence is unusable after)."""
        for st, sid in zip(self.stages, self.sids):
            st.memory.drop_seq(sid)
        self.epoch += 1
        self.sids, self._n = [], 0

    def can_truncate(self, p: int) -> bool:
        """Whether ``truncate(p)`` would succeed on every stage (attention K/V can be cut back; a running state
        cannot)."""
        if not 0 <= p <= self.pos:
            return False
        try:
            for st, sid in zip(self.stages, self.sids):
                st.memory.check_truncate(sid, p)
        except ValueError:
            return False
        return True

    def reset(self) -> None:
        """Back to position 0 on every stage (pages kept, running state zeroed)."""
        self.epoch += 1
        for st, sid in zip(self.stages, self.sids):
            st.memory.reset(sid)
        self._n = 0

    def trim(self) -> None:
        """Give back every stage's pages past the valid positions."""
        for st, sid in zip(self.stages, self.sids):
            st.memory.trim(sid)

    def hashes(self) -> dict[str, str]:
        """sha256 per field: "tokens", and every stage's per-layer hashes (layer indices are global, so a split
        and an unsplit engine give the same keys), plus "kv" / "running" over all layers in order."""
        per: dict[str, str] = {}
        for st, sid in zip(self.stages, self.sids):
            per.update({k: v for k, v in st.memory.hashes(sid).items() if ".L" in k})
        out = with_field_hashes(per)
        out["tokens"] = hashlib.sha256(self.ids.tobytes()).hexdigest()
        return out

    def hash_point(self) -> None:
        """Have every remote stage's workers log their layers' state hashes at this position (a worker run with
        STRATA_STATE_HASH=1 logs them at each Commit: one to the current position is posted, changing nothing)."""
        for st, sid in zip(self.stages, self.sids):
            st.memory.hash_point(sid)

    def nbytes(self) -> int:
        """Bytes of the sequence's state on every stage + token ids (int32)."""
        return sum(st.memory.nbytes(sid) for st, sid in zip(self.stages, self.sids)) + 4 * self._n

    def positions(self) -> list[int]:
        """Each stage's position (all equal to pos between forward calls)."""
        return [st.memory.pos(sid) for st, sid in zip(self.stages, self.sids)]
