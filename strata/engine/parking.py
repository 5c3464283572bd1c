"""The conversations the engine holds apart from the live one: parked resident on the stages' devices, moved to
host RAM when their pages are needed and spilled to disk from there, and session files (--slot-save-path); the
switch of the live sequence to the parked conversation a prompt continues best."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from strata.cache import session
from strata.cache.checkpoints import CheckpointCache
from strata.cache.conversation import CUT_MIN, Conversation, DiskTier, ParkStore, SavedCheckpoint
from strata.memory.hostram import available_ram
from strata.memory import KVCacheFull, PartMismatch
from strata.stages.sequence import Checkpoint, Sequence

log = structlog.get_logger("strata.engine")
PREPIN_MAX = 4 << 30             # the most host memory set aside at start for parking, per kind (pinned / ordinary)


class Conversations:
    """Parking and session files of one engine: the live sequence `seq` with its checkpoint cache `cache` captured as
    a Conversation and restored from one. Three tiers hold the conversations set aside:
    - `resident` (a ParkStore of up to `resident` conversations; None: none, or a remote stage): parked on the
      stages' own devices, their K/V pages held in the pools (memory.kv.Hold: pages a new conversation shares with
      a parked one are not copied, and the one it switches back to is not copied either) and their running state
      copied there; when a pool runs short (``make_room``), or more are parked, the least recently used moves to
    - `park` (a ParkStore of park_bytes; None: no parking at all): host copies in RAM, spilling to
    - `disk` (a DiskTier in disk_dir under disk_bytes, None: none).
    Session files live in `slot_save_path` (None: refused). `file` (its fingerprint), `stages`, `n_ctx` and
    `n_vocab` are what a session file must match. Raises ValueError for a disk tier without parking or a
    slot_save_path that is not a directory. The engine calls these under its lock."""

    def __init__(self, seq: Sequence, cache: CheckpointCache, stages: list, file, n_ctx: int, *, park_bytes: int | None,
                 disk_dir: str | os.PathLike | None, disk_bytes: int, slot_save_path: str | os.PathLike | None,
                 resident: int = 0, n_vocab: int | None = None):
        self.seq, self.cache, self.stages, self.file, self.n_ctx = seq, cache, stages, file, n_ctx
        # whether every stage's parts can be copied to the host and written (not over a remote stage's link)
        self.host_parts = all(st.memory.host_parts for st in stages)
        self.n_vocab = n_vocab
        if resident < 0:
            raise ValueError(f"--park-resident must be >= 0, got {resident}")
        self.park = ParkStore(park_bytes) if park_bytes is not None else None
        # attention-only stages (no running state): a conversation's K/V can be cut back to any prefix
        self.cut_anywhere = all(st.memory.cuts_anywhere for st in stages)
        self.resident = None
        if self.park is not None and resident > 0 and seq.can_hold():
            self.resident = ParkStore(resident, spill=self._demote, cost=lambda c: 1, tier="device",
                                      drop=self._release)
        self.disk = None
        if disk_dir:
            if self.park is None:
                raise ValueError("--conversation-cache-dir needs parking (--conversation-cache-mib > 0)")
            self.disk = DiskTier(disk_dir, disk_bytes, write=self.write_session, read=self.read_session)
            self.park.spill = self.disk.add
        self.slot_save_path = Path(slot_save_path) if slot_save_path else None
        if self.slot_save_path is not None and not self.slot_save_path.is_dir():
            raise ValueError(f"--slot-save-path {self.slot_save_path}: not a directory")
        self.from_session = False           # the live conversation came from a session file, not yet resumed

    def prepin(self) -> int:
        """Host memory ahead for parking (strata.memory.pinned: pinned for the GPU stages, paged in for the CPU
        ones): two full conversations of the local stages (a switch parks the live one while the other is still
        parked), each a full context's K/V plus its running state and the checkpoints' copies of it; capped by the
        park budget and PREPIN_MAX and kept up to the park budget, so a park copies at the bus's (or memcpy's)
        bandwidth instead of getting fresh memory first (docs/checkpoints.md). Returns the bytes asked for."""
        if self.park is None:
            return 0
        full: dict[str, int] = {}
        for st in self.stages:
            kind = str(st.device).split(":")[0]
            if kind not in ("cuda", "cpu"):
                continue                          # a remote stage keeps its own
            mem = st.memory.stats()
            running = int(mem.get("running", {}).get("bytes_per_sequence", 0))
            kv = mem.get("kv", {})
            tokens = int(kv.get("pages_total", 0)) * int(kv.get("page_size", 0))
            kv_bytes = int(kv.get("bytes", 0)) * min(1.0, self.n_ctx / tokens) if tokens else 0   # one context's
            full[kind] = full.get(kind, 0) + int(kv_bytes) + running * (1 + self.cache.cap)
        from strata.memory.pinned import arena
        asked = 0
        for kind, n in full.items():
            want = min(2 * n, self.park.budget, PREPIN_MAX)
            a = arena(kind)
            a.keep_bytes = max(a.keep_bytes, self.park.budget)
            a.reserve(want)
            asked += want
        return asked

    # ---- the live conversation as a Conversation ---------------------------------------------------
    def capture(self) -> Conversation:
        """The live conversation as host copies: every stage's used K/V and running state, its checkpoints
        (running state only; their K/V is the conversation's prefix)."""
        here = self.seq.capture()
        try:
            parts = self.seq.materialize(here)
        finally:
            here.release()
        cps = [SavedCheckpoint(pos, kind, self.seq.detach(snap)) for pos, kind, snap in self.cache.export(self.seq.ids)]
        return Conversation(tokens=self.seq.ids, parts=parts, checkpoints=cps, live_ok=self.cache.live_ok,
                            cut_anywhere=self.cut_anywhere)

    def capture_resident(self) -> Conversation:
        """The live conversation parked where it is: every stage's pages held (nothing copied), its running state
        and its checkpoints' copied on the device."""
        here = self.seq.capture()                # its pages held: nothing is copied
        try:
            cps = [SavedCheckpoint(pos, kind, self.seq.detach(snap, to_host=False))
                   for pos, kind, snap in self.cache.export(self.seq.ids)]
        except BaseException:
            here.release()
            raise
        parts = here.parts
        return Conversation(tokens=self.seq.ids, parts=parts, checkpoints=cps, live_ok=self.cache.live_ok,
                            resident=True, cut_anywhere=self.cut_anywhere)

    def restore(self, conv: Conversation) -> None:
        """Make `conv` the live conversation with its checkpoints (a resident one's pages become the live
        sequence's too: nothing is copied but the running state, on the device; `conv` keeps its own hold until
        released). Every part is validated against its own stage first (PartMismatch / KVCacheFull, one line,
        change nothing); a pool short of pages for a host conversation first moves resident ones to RAM
        (make_room)."""
        whole = Checkpoint(pos=conv.pos, tokens=conv.tokens, parts=conv.parts)
        self.seq.with_room(lambda: self.seq.validate(whole))
        for c in conv.checkpoints:
            if not 0 < c.pos <= conv.pos:
                raise PartMismatch(f"a checkpoint at {c.pos} lies outside the conversation's {conv.pos} tokens")
            self.seq.validate_detached(c.pos, c.parts)
        self.seq.restore(whole)
        self.cache.adopt([(c.pos, c.kind, self.seq.attach(c.pos, c.parts)) for c in conv.checkpoints], conv.live_ok)

    # ---- the resident tier ---------------------------------------------------------------------------
    def make_room(self) -> bool:
        """Move the least recently used resident conversation to host RAM (its pages given back); False when none
        is resident. The engine calls this when a pool is short of pages (Sequence.make_room)."""
        conv = self.resident.pop_lru() if self.resident is not None else None
        if conv is None:
            return False
        self._demote(conv)
        return True

    def _demote(self, conv: Conversation) -> None:
        """A resident conversation to host RAM (host copies of its pages and running state), its pages given back;
        dropped when host RAM is short."""
        try:
            if self._ram_short(conv.nbytes() + conv.held_bytes(), "dropping a resident conversation"):
                return
            t0 = time.perf_counter()
            parts = [st.memory.materialize(p) for st, p in zip(self.stages, conv.parts)]
            cps = [SavedCheckpoint(c.pos, c.kind, [st.memory.detach(p) for st, p in zip(self.stages, c.parts)])
                   for c in conv.checkpoints]
            self.park.park(Conversation(tokens=conv.tokens, parts=parts, checkpoints=cps, live_ok=conv.live_ok,
                                        last_use=conv.last_use, cut_anywhere=conv.cut_anywhere), touch=False)
            log.debug("resident conversation moved to host RAM", tokens=conv.pos,
                      ms=round((time.perf_counter() - t0) * 1e3, 2))
        except Exception as e:  # noqa: BLE001 -- moving an unrelated conversation down must not fail a request
            self.park.stats["refused"] += 1
            log.warning("dropping a resident conversation: it could not be moved to host RAM", error=str(e))
        finally:
            self._release(conv)

    def _release(self, conv: Conversation) -> None:
        self.seq.release(conv.parts)

    def _ram_short(self, need: int, what: str) -> bool:
        """Whether host RAM cannot take `need` more bytes (unknown, or less than twice that is available): then
        logged as `what` and counted as refused."""
        avail = available_ram()
        if avail is not None and need <= avail // 2:
            return False
        self.park.stats["refused"] += 1
        log.warning(f"{what}: host RAM unknown or short", bytes=need, available=avail)
        return True

    # ---- parking -------------------------------------------------------------------------------------
    def park_live(self, trace: bool) -> None:
        """Park the live conversation (when it has one worth keeping and host RAM can take it). A failure to park
        (out of memory on the device and then on the host, say) is logged and the conversation left unparked: it
        never fails the request that leaves it."""
        if self.park is None or self.seq.pos == 0 or not self.cache.live_ok:
            return                   # nothing live, or a "strata_checkpoint": false request's
        try:
            self._park_live(trace)
        except Exception as e:  # noqa: BLE001
            self.park.stats["refused"] += 1
            log.warning("not parking the live conversation: it could not be copied", error=str(e))

    def _park_live(self, trace: bool) -> None:
        if self.resident is not None:
            t0 = time.perf_counter()
            try:
                conv = self.capture_resident()
            except MemoryError as e:     # the device cannot copy the running state (CuPy's OutOfMemoryError is one)
                log.warning("parking in host RAM: the device is out of memory for a resident copy", error=str(e))
                while self.make_room():  # their running-state copies leave the device too
                    pass
            else:
                try:
                    gone = self.resident.park(conv)
                except BaseException:
                    if conv in self.resident:
                        raise            # parked: its holds are the tier's
                    self._release(conv)
                    raise
                if trace:
                    log.info("parked", tier="device", tokens=self.seq.pos,
                             ms=round((time.perf_counter() - t0) * 1e3, 2), moved_to_ram=len(gone))
                return
        need = self.seq.nbytes()
        if self._ram_short(need, "not parking the live conversation"):
            return
        t0 = time.perf_counter()
        gone = self.park.park(self.capture())
        if trace:
            log.info("parked", tokens=self.seq.pos, bytes=need, ms=round((time.perf_counter() - t0) * 1e3, 2),
                     evicted=len(gone))

    def switch(self, prompt: np.ndarray, cache_prompt: bool, trace: bool) -> str | None:
        """Before a request is planned: when a parked conversation (resident, in RAM or on disk) skips more of
        `prompt` than the live one and its checkpoints do, park the live one and restore that one -> its tier
        ("resident" / "park" / "disk"); it stays parked, whole, when the prompt leaves it before its last
        checkpoint. When the request leaves the live conversation (it resumes before the live one's deepest
        checkpoint), park the live one (None)."""
        if self.park is None or not cache_prompt:
            return None
        here = self.cache.peek(self.seq, prompt)
        # the deepest resume of the three tiers; a tie goes to the nearest (device, then RAM, then disk)
        found = [(tier, *store.best(prompt)) for tier, store in (("resident", self.resident), ("park", self.park),
                                                                ("disk", self.disk)) if store is not None]
        source, conv, depth = max(found, key=lambda f: f[2])
        if conv is not None and source != "disk" and depth != conv.pos and \
                all(c.pos != depth for c in conv.checkpoints) and depth < here + CUT_MIN:
            conv = None      # a cut at the common prefix that skips too few tokens more than the live one does
        if conv is not None and depth > here:
            store = {"resident": self.resident, "park": self.park, "disk": self.disk}[source]
            t0 = time.perf_counter()
            try:                              # out of its tier first: parking the live one cannot evict it
                conv = self.disk.take(conv) if source == "disk" else conv
            except (session.SessionError, OSError, ValueError) as e:
                log.warning("a parked conversation could not be read", tier=source, error=str(e))
                return None
            if source != "disk":
                store.take(conv)
            self.park_live(trace)
            try:
                self.restore(conv)
            except BaseException as e:
                # put back intact (restoring only adds references to a resident one's pages); the caller
                # starts the live sequence over when the error is not one that changed nothing
                if source != "disk":
                    store.park(conv)
                if not isinstance(e, (PartMismatch, KVCacheFull)):
                    raise
                log.warning("a parked conversation could not be restored", tier=source, error=str(e))
                return None
            if depth < max((c.pos for c in conv.checkpoints), default=0):
                # the prompt leaves it before its last checkpoint (a new chat on its system prompt, an earlier
                # message edited): it stays parked, whole (in RAM, a file's); a next turn, which rewrites only
                # what follows that checkpoint, takes it over, as the prompt does with one that has none
                (self.park if source == "disk" else store).park(conv)
            elif conv.resident:
                self._release(conv)           # the live sequence holds its pages now
            if trace:
                log.info("unparked", tier=source, tokens=conv.pos, resume=depth,
                         ms=round((time.perf_counter() - t0) * 1e3, 2))
            return source
        deepest = self.cache.deepest(self.seq.ids)
        if self.seq.pos > 0 and (here < deepest or (deepest == 0 and here == 0)):
            self.park_live(trace)
        return None

    def parked(self) -> list[dict]:
        """The parked conversations for `stratactl cache` (tokens, bytes, tier, checkpoints, last use)."""
        return [e for store in (self.resident, self.park, self.disk) if store is not None for e in store.entries()]

    # ---- session files -----------------------------------------------------------------------------
    def write_session(self, path: Path, conv: Conversation) -> int:
        return session.save_atomic(path, lambda f: session.write(f, conv, self.file.fingerprint(), self.stages))

    def read_session(self, path: Path) -> Conversation:
        with session.open_session(path) as f:
            conv = session.read(f, self.file.fingerprint(), self.stages, self.n_ctx, self.n_vocab)
        conv.cut_anywhere = self.cut_anywhere
        return conv

    def session_path(self, filename, *, exists: bool = False) -> Path:
        """The path of session file `filename` (strata.cache.session.check_filename); exists: it must be a file
        there. SessionError (one line) otherwise."""
        if not self.host_parts:
            raise session.SessionError("session files are not supported with a remote stage (--remote-stage) yet")
        if self.slot_save_path is None:
            raise session.SessionError("session files need --slot-save-path DIR (the directory they are kept in)")
        path = session.check_filename(self.slot_save_path, filename, new=not exists)
        try:
            there = path.exists() or path.is_symlink()               # what it is, open_session checks
        except OSError:                                              # swapped while looked at: open_session decides
            there = True
        if exists and not there:
            raise session.SessionError(f"session file {filename!r} does not exist in the session directory "
                                       "(--slot-save-path)")
        return path

    def save(self, path: Path, filename) -> dict[str, Any]:
        """Save the live conversation (with its checkpoints) to `path`, atomically -> llama-server's answer of a
        slot save. SessionError (one line), nothing written."""
        if self.seq.pos == 0:
            raise session.SessionError("slot 0 holds no conversation (0 tokens): nothing to save")
        t0 = time.perf_counter()
        conv = self.capture()
        n = self.write_session(path, conv)
        return {"id_slot": 0, "filename": filename, "n_saved": conv.pos, "n_written": n,
                "timings": {"save_ms": round((time.perf_counter() - t0) * 1e3, 3)}}

    def load(self, path: Path, filename) -> dict[str, Any]:
        """Make the session file at `path` the live conversation -> llama-server's answer of a slot restore. The
        file is read under the live engine's limits and every part validated before anything is written; on any
        error the live conversation is exactly as it was; the one it replaces is parked."""
        t0 = time.perf_counter()
        with session.open_session(path) as f:
            conv = session.read(f, self.file.fingerprint(), self.stages, self.n_ctx, self.n_vocab)
            n_read = f.tell()
        self.park_live(False)               # the conversation the restore replaces is parked, not lost
        try:
            self.restore(conv)
        except (PartMismatch, KVCacheFull) as e:
            raise session.SessionError(f"session file {filename!r}: {e}") from None
        self.from_session = True
        for store in (self.resident, self.park):
            if store is not None:
                store.discard(conv.tokens)   # now live: a parked copy of the same conversation is dropped
        return {"id_slot": 0, "filename": filename, "n_restored": conv.pos, "n_read": n_read,
                "timings": {"restore_ms": round((time.perf_counter() - t0) * 1e3, 3)}}
