"""ConversationStore: the one owner of the conversation state the engine keeps beside its live sequences: one prefix
tree holding the checkpoints (CheckpointCache) and the parked conversations (ParkedConversations: resident on the
stages' devices, host RAM, disk) and session files (ConversationFiles); its verbs take the Sequence they act on
(resume, note, forget, erase, park, save, load, make_room)."""
from __future__ import annotations

import os
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from strata.cache import capture, session
from strata.cache.checkpoints import CheckpointCache, PrefillPlan
from strata.cache.conversation import CUT_MIN, Conversation
from strata.cache.cut_points import turn_start
from strata.cache.disk import DiskNode, DiskTier
from strata.cache.files import ConversationFiles
from strata.cache.held import HeldCheckpoints, is_prefix_form
from strata.cache.lookup import Found, lookup
from strata.cache.parked import ParkedConversations, Tier
from strata.errors import Refused
from strata.memory import KVCacheFull, PartMismatch
from strata.stages.remote import CheckpointGone
from strata.stages.sequence import Checkpoint, Sequence
from strata.text.token_ids import common_prefix, is_prefix

log = structlog.get_logger("strata.engine")


class ConversationStore:
    """What the engine keeps of conversations beside the sequences it runs, shared by all of them:

    - ``checkpoints`` (a CheckpointCache): the prefix tree of checkpoints, each holding its pages by reference, in
      host RAM when a short pool moved it there (parking off), or a file of the disk tier when the tree's byte
      budget spilled it there (read back into RAM on a hit);
    - ``parking`` (strata.cache.parked.ParkedConversations): the parked conversations, nodes of the same tree (its
      "parked" slot), each in a tier: ``resident`` on the stages' devices (their pages held: a count,
      ``--park-resident``), ``park_store`` in host RAM (bytes, ``--conversation-cache-mib``), ``disk`` (files,
      ``--conversation-cache-dir``, the tree's spilled checkpoints too), the least recently used moving down;
    - ``files`` (strata.cache.files.ConversationFiles): conversation files in the session format, the disk tier's
      and the session files in ``slot_save_path``, the regular files there bounded by ``slot_quota_bytes`` (None:
      no quota).

    Every verb takes the Sequence it acts on (nothing about one live sequence is kept here but a weak mark of a
    sequence loaded from a session file): ``resume`` (plan a prompt, then the one step that restores a parked
    conversation or a checkpoint, or cuts the sequence back, and settles), ``note`` (a checkpoint at the
    sequence's position), ``forget`` / ``erase``, ``park``, ``save`` / ``load`` (session files), ``make_room`` (what
    a Sequence calls when a pool is short for it). `file` (its fingerprint), `stages`, `n_ctx` and `n_vocab` are what
    a session file must match. Raises ValueError for a slot_save_path or disk directory that is not a directory. The
    engine calls the verbs under its lock; the views (``parked``, the checkpoints' ``entries`` and ``stats``) from any
    thread: they never wait on a verb in progress (a device-to-host copy, a file write), showing the state before it."""

    def __init__(self, stages: list, file, n_ctx: int, *, checkpoints: CheckpointCache, park_bytes: int | None,
                 disk_dir: str | os.PathLike | None, disk_bytes: int, slot_save_path: str | os.PathLike | None,
                 resident: int = 0, n_vocab: int | None = None, slot_quota_bytes: int | None = None):
        self.stages, self.file, self.n_ctx, self.n_vocab = stages, file, n_ctx, n_vocab
        self.checkpoints = checkpoints
        # the disk tier's files and session files: the session format, against this engine's model and stages
        self.files = ConversationFiles(stages, file, n_ctx, n_vocab, directory=slot_save_path,
                                       quota_bytes=slot_quota_bytes,
                                       refusal=lambda: self.parking.host_parts_refusal())
        # with parking off the tree's checkpoints alone spill to the disk tier
        disk = DiskTier(disk_dir, disk_bytes, write=self.files.write, read=self.files.read) if disk_dir else None
        if disk is not None and disk.cleared:
            log.info("conversation cache: files of an earlier run removed (parked conversations do not outlive the "
                     "process; a session file does)", directory=str(disk.dir), files=disk.cleared)
        self.parking = ParkedConversations(checkpoints.tree, stages, park_bytes=park_bytes, resident=resident,
                                          disk=disk, leaving=lambda conv: self.held.leaving(conv),
                                          checkpoints=checkpoints, spill=self._spill)
        self.held = HeldCheckpoints(checkpoints, self.parking, stages)
        self._from_session: weakref.WeakSet = weakref.WeakSet()   # loaded from a file, not yet resumed
        # where the final turn of the prompt each sequence last read began (resume; turn_start)
        self._turn_start: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._live: weakref.WeakSet = weakref.WeakSet()   # the sequences the verbs acted on (held.settle keeps
        #                                                   the checkpoints they extend on the device)
        self._restoring = None      # the checkpoint a restore is mounting (make_room does not drop it meanwhile)
        self._drops_seen = 0        # the stages' drop counts (Memory.drops) already acted on

    def close(self) -> None:
        """Give up the disk tier's directory (another process may use it from now on)."""
        if self.disk is not None:
            self.disk.close()

    def forget_dropped(self) -> None:
        """Forget what a worker dropped on its own to make room for a Forward (its Result named the ids,
        ``+drops``): the checkpoints and resident conversations holding such a part leave the tree and the tiers
        (their other parts given back). Cheap when nothing was dropped; every verb calls it first."""
        n = sum(int(st.memory.drops) for st in self.stages) + (self.disk.node_drops if self.disk else 0)
        if n == self._drops_seen:
            return
        self._drops_seen = n
        gone = self.checkpoints.drop_gone()
        log.info("parts dropped by their keeper (a worker short of pages, the disk tier over its budget): "
                 "forgotten", checkpoints=gone, resident=self.parking.drop_gone())

    # ---- the tiers, for the engine's views -------------------------------------------------------------
    @property
    def resident(self) -> Tier | None:
        """The parked conversations' device tier (its budget, counters, conversations), or None."""
        return self.parking.device

    @property
    def park_store(self) -> Tier | None:
        """The parked conversations' host RAM tier, or None (no parking)."""
        return self.parking.ram

    @property
    def disk(self) -> DiskTier | None:
        return self.parking.disk

    def prepin(self) -> int:
        """Host memory set aside for parking now (ParkedConversations.prepin) -> the bytes asked for."""
        return self.parking.prepin(self.n_ctx)

    # ---- a sequence as a Conversation (strata.cache.capture) ---------------------------------------------
    def capture(self, seq: Sequence, on_disk: bool = False, pin: bool = False) -> Conversation:
        """`seq`'s conversation as host copies, with its checkpoints (capture.as_host_copies; on_disk: those the
        tree keeps on disk too; pin: the tree's checkpoints on its path pinned instead), what a worker dropped
        forgotten first."""
        self.forget_dropped()
        return capture.as_host_copies(seq, self.checkpoints, self.stages, self.disk, self.parking.cut_anywhere,
                                      on_disk=on_disk, pin=pin)

    def capture_resident(self, seq: Sequence) -> Conversation:
        """`seq`'s conversation parked where it is (capture.in_place)."""
        return capture.in_place(seq, self.checkpoints, self.parking.cut_anywhere)

    def restore(self, seq: Sequence, conv: Conversation) -> None:
        """Make `conv` `seq`'s conversation, its checkpoints kept in the tree (capture.restore)."""
        capture.restore(seq, conv, self.checkpoints, self._spill)

    # ---- the verbs ---------------------------------------------------------------------------------------
    def resume(self, seq: Sequence, prompt: np.ndarray, cut_points=(), *, checkpoint: bool = True,
               cache_prompt: bool = True, trace: bool = False, peers=()) -> PrefillPlan:
        """Put `seq` where `prompt` is read from: a parked conversation switched in when it skips more of the prompt
        than `seq` and the tree do (the one `seq` held parked when the prompt leaves it), else the longest prefix of
        the prompt another live sequence holds (`peers`: the other request slots'; see ``share_prefix``), then the
        tree's plan
        (CheckpointCache.plan, pure) and the one step that applies it: its checkpoint restored, or the sequence cut
        back or reset, and settled (a remote stage's Commits landed); the tree then told (begin). A checkpoint gone
        from a worker (its link reconnected): the tree cleared, the prompt planned again from 0. -> the plan
        applied (resume_from "resident" / "park" / "disk" / "session" / "slot" when it came from there). Any failure
        forgets `seq` (it starts over) and propagates."""
        self.forget_dropped()
        try:
            self._drop_lost(seq, "reading from 0")
            found = lookup(self.checkpoints.tree, prompt)      # one walk along the prompt, both slots
            unparked = self.switch(seq, prompt, cache_prompt, trace, found)
            if unparked is None and self.share_prefix(seq, prompt, peers, cache_prompt, found):
                unparked = "slot"
            plan = self._apply(seq, prompt, cut_points, checkpoint, cache_prompt, found)
        except BaseException:
            self.forget(seq)       # a restore that failed part-way: the sequence starts over
            raise
        if plan.resume_pos > 0 and (unparked or seq in self._from_session):
            plan.resume_from = unparked or "session"
        self._from_session.discard(seq)
        self._turn_start[seq] = turn_start(cut_points, len(prompt))
        n, resume = len(prompt), plan.resume_pos
        if seq.pos != resume or not 0 <= resume < n or not is_prefix(seq.ids, prompt):
            self.forget(seq)
            raise RuntimeError(f"internal: plan resumes at {resume} ({plan.resume_from}) but the sequence holds "
                               f"{seq.pos} tokens that are not that prefix of the {n}-token prompt")
        self._settle(seq)
        return plan

    def share_prefix(self, seq: Sequence, prompt: np.ndarray, peers, cache_prompt: bool = True,
                     found: Found | None = None) -> int:
        """When a peer (another live sequence over the same stages) holds a prefix of `prompt` at least CUT_MIN
        tokens longer than what `seq` would resume from (its own tokens or the tree's checkpoints), `seq` takes it:
        the peer's pages shared up to there (reference-counted, copied on the next write into a shared page),
        nothing read. Only where the sequences can be cut back (attention-only stages) and hold their pages here
        (no remote stage) -> the position taken, 0 when none. found: the tree's lookup of `prompt`, if made."""
        if not cache_prompt or not peers or not seq.can_hold():
            return 0
        n = len(prompt)
        best, k = None, self.checkpoints.peek(seq, prompt, found=found) + CUT_MIN
        for peer in peers:
            c = min(common_prefix(peer.ids, prompt), n - 1) if peer.pos else 0
            if c >= k and peer.can_truncate(c):
                best, k = peer, c
        if best is None:
            return 0
        snap = best.capture()
        try:
            seq.restore(snap)
        finally:
            snap.release()
        seq.truncate(k)
        seq.live_ok = True
        return k

    def _apply(self, seq: Sequence, prompt, cut_points, checkpoint: bool, cache_prompt: bool,
               found: Found | None = None) -> PrefillPlan:
        def plan():
            return self.checkpoints.plan(seq, prompt, list(cut_points or ()), checkpoint=checkpoint,
                                         cache_prompt=cache_prompt, found=found)
        p = plan()
        while isinstance(p.snapshot, DiskNode) or is_prefix_form(p.snapshot):
            if is_prefix_form(p.snapshot):              # its K/V a prefix of a conversation parked in RAM
                joined = self.held.join(p.snapshot)
                if joined is None:
                    self.checkpoints.discard(p.snapshot)
                    p = plan()
                    continue
                p.snapshot = joined
                break
            node = p.snapshot                           # a checkpoint on disk: read back into host RAM first
            try:
                conv = self.disk.read(node)
            except (session.SessionError, OSError, ValueError) as e:
                log.warning("a checkpoint on disk could not be read: dropped", error=str(e))
                self.checkpoints.discard(node)
                p = plan()
                continue
            p.snapshot = Checkpoint(pos=conv.pos, tokens=conv.tokens, parts=conv.parts)
            self.checkpoints.promote(node, p.snapshot)
        if p.snapshot is not None:
            self._restoring = p.snapshot
            try:
                seq.with_room(lambda: seq.restore(p.snapshot))
            except CheckpointGone as e:      # the worker restarted or reconnected: read from token 0
                log.warning("a checkpoint is gone from the worker: reading from 0", error=str(e))
                self.forget(seq)
                self.checkpoints.clear()
                p = plan()
            finally:
                self._restoring = None
        if p.snapshot is None:
            if p.resume_from == "none" or p.resume_pos == 0:
                seq.reset()
            elif p.resume_pos < seq.pos:
                seq.truncate(p.resume_pos)
        seq.settle()                # the worker's Commits land before the prompt is read
        self.checkpoints.begin(p, seq)
        return p

    def note(self, seq: Sequence, kind: str) -> list[int]:
        """Keep a checkpoint of `seq` at its position, of cut point kind `kind` (a pool or a worker store short of
        room first frees some, make_room) -> the positions retention evicted."""
        self.forget_dropped()
        return self.checkpoints.save(seq.pos, kind, seq.with_room(seq.capture), spill=self._spill)

    def note_at(self, seq: Sequence, kind: str, p: int) -> list[int]:
        """``note`` at position p, which the marked forward just read (Sequence.capture_at: the state it kept there)."""
        self.forget_dropped()
        return self.checkpoints.save(p, kind, seq.with_room(lambda: seq.capture_at(p)), spill=self._spill)

    def _drop_lost(self, seq: Sequence, then: str) -> bool:
        """When a remote stage reconnected since `seq` was read (the worker holds none of it, nor its checkpoints):
        forget `seq`, clear the tree and the resident conversations whose parts went with the link -> whether it
        did (logged, `then` saying what follows)."""
        if not seq.lost():
            return False
        log.warning(f"a remote stage lost the live sequence and its checkpoints: {then}")
        self.forget(seq)
        self.checkpoints.clear()
        self.parking.drop_gone()
        return True

    def forget(self, seq: Sequence) -> None:
        """`seq` back to position 0, not to be continued live: the next prompt resumes from a checkpoint or from 0
        (the tree and the parked conversations stay)."""
        seq.reset()
        seq.live_ok = False

    def erase(self, seq: Sequence) -> int:
        """Forget `seq` and every checkpoint no parked conversation holds, its pages given back (parked conversations
        stay, with the checkpoints they hold) -> the tokens it held."""
        n = int(seq.pos)
        self.forget(seq)
        self.checkpoints.clear(held=False)          # those parked conversations hold are theirs
        seq.trim()
        self._settle(seq)
        return n

    def make_room(self, seq: Sequence) -> bool:
        """Free pages for `seq` (what a Sequence calls when a pool is short for it): a checkpoint off its path that no
        parked conversation holds dropped (its pages are its own; with parking off moved to host RAM), else one
        held only by conversations parked below the device moved to host RAM (it follows them), else the least
        recently used resident conversation moved to host RAM, else a held checkpoint off its path moved to host
        RAM, else a checkpoint on its path (unheld first) -> False when nothing more can be freed. A held
        checkpoint is dropped only when it cannot be copied to host RAM (its conversations then skip it)."""
        self.forget_dropped()
        ids, spare = seq.ids, self._restoring
        # a checkpoint a parked conversation holds moves to host RAM; with parking off the tree is the only keeper
        # of other branches: theirs move too (parking keeps the conversations they belong to, with their K/V)
        held = self._demote if self.parking.host_parts_refusal() is None else None
        demote = held if self.parking.ram is None else None
        cp = self.checkpoints
        resident = {id(n) for p in self.parking.in_tier("device") for n in p.conv.pins}
        return cp.make_room(ids, off_path=True, spare=spare, demote=demote, spill=self._spill, held=False) or \
            cp.make_room(ids, off_path=True, spare=spare, demote=held, spill=self._spill, held=True,
                         skip=resident) or \
            self.parking.make_room() or \
            cp.make_room(ids, off_path=True, spare=spare, demote=held, spill=self._spill, held=True) or \
            cp.make_room(ids, spare=spare, demote=demote, spill=self._spill, held=False) or \
            cp.make_room(ids, spare=spare, demote=held, spill=self._spill, held=True)

    def _spill(self, snap: Checkpoint, last_use: float) -> DiskNode | None:
        """A checkpoint the tree's byte budget evicts, written to the disk tier as a file of the session format
        (its parts as host copies; a remote stage's streamed from its worker) -> the DiskNode the tree keeps in
        its place, or None (no disk tier, a stage that cannot copy its state to the host, the write failed):
        then it is dropped."""
        disk = self.disk
        if disk is None or isinstance(snap, DiskNode) or self.parking.host_parts_refusal() is not None:
            return None
        if is_prefix_form(snap):                # its K/V rows from the conversation it reads them from
            snap = self.held.join(snap)
            if snap is None:
                return None
        self.checkpoints.tree.publish()         # readers see the tree as it is before the copy and the write
        parts = [st.memory.materialize(p) for st, p in zip(self.stages, snap.parts)]
        return disk.add(Conversation(tokens=snap.tokens, parts=parts, live_ok=False), "node", last_use)

    def _demote(self, snap: Checkpoint) -> Checkpoint | None:
        """A checkpoint moved down a tier: its parts as host copies (a remote stage's streamed from its worker), its
        K/V a prefix of a conversation parked in RAM where one extends it (HeldCheckpoints.to_host), or None when
        host RAM is short (then it is dropped)."""
        return self.held.to_host(snap)

    def _settle(self, *seqs: Sequence) -> None:
        """After a verb: the checkpoints parked conversations hold that neither a live sequence nor a conversation
        parked on the device extends leave the device (HeldCheckpoints.settle), then each tier's one eviction pass
        over checkpoints and parked conversations (ParkedConversations.retain)."""
        self._live.update(seqs)
        self.held.settle([q.ids for q in list(self._live)])
        self.parking.retain()

    # ---- parking ----------------------------------------------------------------------------------------
    def park(self, seq: Sequence, trace: bool = False) -> None:
        """Park `seq`'s conversation (when it has one worth keeping and the tiers can take it): resident when that
        tier is on, else host copies in RAM. A failure to park is logged and counted (park_stats.refused); it
        never fails the request that leaves the conversation."""
        self.forget_dropped()
        t = self.parking
        if t.ram is None or seq.pos == 0 or not seq.live_ok or self._drop_lost(seq, "nothing parked"):
            return                   # nothing live, or a "strata_checkpoint": false request's, or gone
        try:
            t0 = time.perf_counter()
            if t.device is not None:
                try:
                    conv = self.capture_resident(seq)
                except (MemoryError, KVCacheFull) as e:  # the device (or a worker's store) has no room for it
                    log.warning("parking in host RAM: no room for a resident copy", error=str(e))
                    while t.make_room():                 # their running-state copies leave the device too
                        pass
                else:
                    gone = t.park(conv)
                    if trace:
                        log.info("parked", tier="device", tokens=seq.pos,
                                 ms=round((time.perf_counter() - t0) * 1e3, 2), moved_to_ram=len(gone))
                    return
            need = seq.nbytes()
            if t.ram_short(need, "not parking the live conversation"):
                return
            gone = t.park(self.capture(seq, pin=True))
            if trace:
                log.info("parked", tokens=seq.pos, bytes=need, ms=round((time.perf_counter() - t0) * 1e3, 2),
                         evicted=len(gone))
        except Exception as e:  # noqa: BLE001
            t.ram.stats["refused"] += 1
            log.warning("not parking the live conversation: it could not be copied", error=str(e))

    def switch(self, seq: Sequence, prompt: np.ndarray, cache_prompt: bool, trace: bool,
               found: Found | None = None) -> str | None:
        """Before a prompt is planned: when a parked conversation (resident, in RAM or on disk) skips more of
        `prompt` than `seq` and the tree do, park `seq`'s and restore that one -> its tier ("resident" / "park" /
        "disk"); it stays parked, whole, when the prompt leaves it before its last checkpoint. When the prompt
        leaves `seq` (it resumes before the deepest checkpoint on `seq`'s path), park `seq`'s (None). found: the
        tree's lookup of `prompt` (one walk: the deepest checkpoint and the best parked conversation), if made."""
        t = self.parking
        if t.ram is None or not cache_prompt:
            return None
        if found is None or not found.current(prompt):
            found = lookup(self.checkpoints.tree, prompt)
        here = self.checkpoints.peek(seq, prompt, found=found)
        hit, depth = found.parked, found.depth
        conv = hit.conv if hit is not None else None
        source = {"device": "resident", "ram": "park", "disk": "disk"}[hit.tier] if hit is not None else None
        if conv is not None and source != "disk" and depth != conv.pos and \
                depth not in conv.checkpoint_positions() and depth < here + CUT_MIN:
            conv = None      # a cut at the common prefix that skips too few tokens more than the sequence does
        # a checkpoint the conversation pins is its own resume point: at equal depth the conversation comes back
        own = conv is not None and found.checkpoint is not None and depth == here == found.checkpoint.pos and \
            any(n is found.checkpoint for n in conv.pins)
        if conv is not None and (depth > here or own):
            t0 = time.perf_counter()
            try:                              # out of the tree first: parking `seq`'s cannot evict it
                conv = t.take(hit)
            except (session.SessionError, OSError, ValueError) as e:
                log.warning("a parked conversation could not be read", tier=source, error=str(e))
                return None
            self.park(seq, trace)
            epoch = seq.epoch
            try:
                self.restore(seq, conv)
            except BaseException as e:
                if seq.epoch != epoch:
                    self.forget(seq)          # a worker refused its part after a local stage was written
                if isinstance(e, CheckpointGone):
                    t.release(conv)           # its worker parts are gone with the link: nothing to put back
                    t.unpin(conv)
                    log.warning("a parked conversation is gone from the worker", tier=source, error=str(e))
                    return None
                # put back intact (restoring only adds references to a resident one's pages); the caller
                # starts the sequence over when the error is not one that changed nothing
                t.park(conv)
                if not isinstance(e, (PartMismatch, KVCacheFull)):
                    raise
                log.warning("a parked conversation could not be restored", tier=source, error=str(e))
                return None
            if depth < max(conv.checkpoint_positions(), default=0):
                # the prompt leaves it before its last checkpoint (a new chat on its system prompt, an earlier
                # message edited): it stays parked, whole (in RAM, a file's); a next turn, which rewrites only
                # what follows that checkpoint, takes it over, as the prompt does with one that has none
                t.park(conv)
            else:
                if conv.resident:
                    t.release(conv)           # the sequence holds its pages now
                t.unpin(conv)                 # live again: its checkpoints are the tree's alone
            if trace:
                log.info("unparked", tier=source, tokens=conv.pos, resume=depth,
                         ms=round((time.perf_counter() - t0) * 1e3, 2))
            return source
        if seq.pos > 0 and self._leaves(seq, prompt, here):
            self.park(seq, trace)
        return None

    def _leaves(self, seq: Sequence, prompt: np.ndarray, here: int) -> bool:
        """Whether `prompt` leaves `seq`'s conversation (then it is parked before the plan cuts it back): it resumes
        before the deepest checkpoint on `seq`'s path, or it differs from `seq`'s tokens before the final turn of
        the prompt `seq` last read began (turn_start: another conversation, an earlier message edited), whether or
        not the tree still keeps that conversation's checkpoints (another slot's may have evicted them). A
        regenerated answer, a next turn that re-renders the last answer differently, or a template whose
        generation prompt differs from a past turn's header (Qwen3's empty think block) leaves nothing."""
        deepest = self.checkpoints.deepest(seq.ids)
        if here < deepest or (deepest == 0 and here == 0):
            return True
        if common_prefix(seq.ids, prompt) < here:  # a checkpoint of another branch (a held one can be as deep)
            return True
        start = min(self._turn_start.get(seq, 0), int(seq.pos))
        return common_prefix(seq.ids, prompt) < min(start, len(prompt))

    def parked(self) -> list[dict]:
        """The parked conversations for `stratactl cache` (tokens, bytes, tier, checkpoints, last use)."""
        return self.parking.entries()

    # ---- session files -----------------------------------------------------------------------------------
    def save(self, seq: Sequence, path: Path, filename, slot_id: int = 0) -> dict[str, Any]:
        """Save `seq`'s conversation (with its checkpoints) to `path`, atomically -> llama-server's answer of a
        save of slot `slot_id`. SessionError / Refused (one line, naming the slot), nothing written."""
        if self._drop_lost(seq, "nothing saved"):
            raise Refused(f"slot {slot_id}'s conversation is gone: a remote stage's worker restarted (or its link "
                          "reconnected) since it was read; nothing saved (send the conversation again, then save)",
                          code="empty_slot")
        if seq.pos == 0:
            raise Refused(f"slot {slot_id} holds no conversation (0 tokens): nothing to save", code="empty_slot")
        t0 = time.perf_counter()
        conv = self.capture(seq, on_disk=True)
        n = self.files.write(path, conv, self.files.quota_bytes)
        return {"id_slot": slot_id, "filename": filename, "n_saved": conv.pos, "n_written": n,
                "timings": {"save_ms": round((time.perf_counter() - t0) * 1e3, 3)}}

    def load(self, seq: Sequence, path: Path, filename) -> dict[str, Any]:
        """Make the session file at `path` `seq`'s conversation -> llama-server's answer of a slot restore. The
        file is read under the live engine's limits and every part validated before anything is written; on any
        error `seq` is exactly as it was; the conversation it replaces is parked."""
        t0 = time.perf_counter()
        conv, n_read = self.files.read_counted(path)
        self.park(seq)                      # the conversation the restore replaces is parked, not lost
        epoch = seq.epoch
        try:
            self.restore(seq, conv)
        except (PartMismatch, KVCacheFull) as e:
            if seq.epoch != epoch:
                self.forget(seq)            # a worker refused its part after a local stage was written
            raise session.SessionError(f"session file {filename!r}: {e}") from None
        self._from_session.add(seq)
        self._turn_start.pop(seq, None)      # its turns are not known: the deepest checkpoint rule alone
        self.parking.discard(conv.tokens)     # now live: a parked copy of the same conversation is dropped
        self._settle(seq)
        return {"id_slot": 0, "filename": filename, "n_restored": conv.pos, "n_read": n_read,
                "timings": {"restore_ms": round((time.perf_counter() - t0) * 1e3, 3)}}

