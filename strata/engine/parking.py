"""The conversations the engine holds apart from the live one: parked in host RAM and spilled to disk, and session
files (--slot-save-path); the switch of the live sequence to the parked conversation a prompt continues best."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from strata.cache import session
from strata.cache.checkpoints import CheckpointCache
from strata.cache.conversation import Conversation, DiskTier, ParkStore, SavedCheckpoint
from strata.hostmem import available_ram
from strata.memory import KVCacheFull, PartMismatch
from strata.stages.sequence import Checkpoint, Sequence

log = structlog.get_logger("strata.engine")
PREPIN_MAX = 4 << 30             # the most host memory set aside at start for parking, per kind (pinned / ordinary)


class Conversations:
    """Parking and session files of one engine: the live sequence `seq` with its checkpoint cache `cache` captured as
    a Conversation (host copies) and restored from one; `park` (a ParkStore of park_bytes; None: no parking) and
    `disk` (a DiskTier in disk_dir under disk_bytes, None: none) hold the conversations set aside; session files
    live in `slot_save_path` (None: refused). `file` (its fingerprint), `stages` and `n_ctx` are what a session file
    must match. Raises ValueError for a disk tier without parking or a slot_save_path that is not a directory.
    The engine calls these under its lock."""

    def __init__(self, seq: Sequence, cache: CheckpointCache, stages: list, file, n_ctx: int, *, park_bytes: int | None,
                 disk_dir: str | os.PathLike | None, disk_bytes: int, slot_save_path: str | os.PathLike | None,
                 remote: bool):
        self.seq, self.cache, self.stages, self.file, self.n_ctx, self.remote = seq, cache, stages, file, n_ctx, remote
        self.park = ParkStore(park_bytes) if park_bytes is not None else None
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
        bandwidth instead of getting fresh memory first (cudaHostAlloc: 0.3 s for 846 MiB on the H200 host against
        16 ms for the copy; fresh CPU memory pages in at ~0.6-1.3 GB/s). Returns the bytes asked for."""
        if self.park is None:
            return 0
        full: dict[str, int] = {}
        for st in self.stages:
            kind = str(st.device).split(":")[0]
            if kind not in ("cuda", "cpu"):
                continue                          # a remote stage keeps its own
            mem = st.memory.stats()
            running = int(mem.get("running", {}).get("bytes_per_sequence", 0))
            full[kind] = full.get(kind, 0) + int(mem.get("kv", {}).get("bytes", 0)) + running * (1 + self.cache.cap)
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
        parts = self.seq.materialize(self.seq.capture())
        cps = [SavedCheckpoint(pos, kind, self.seq.detach(snap)) for pos, kind, snap in self.cache.export()]
        return Conversation(tokens=self.seq.ids, parts=parts, checkpoints=cps, live_ok=self.cache.live_ok)

    def restore(self, conv: Conversation) -> None:
        """Make `conv` the live conversation with its checkpoints. Every part is validated against its own stage
        first (PartMismatch / KVCacheFull, one line, change nothing)."""
        whole = Checkpoint(pos=conv.pos, tokens=conv.tokens, parts=conv.parts)
        self.seq.validate(whole)
        for c in conv.checkpoints:
            if not 0 < c.pos <= conv.pos:
                raise PartMismatch(f"a checkpoint at {c.pos} lies outside the conversation's {conv.pos} tokens")
            self.seq.validate_detached(c.pos, c.parts)
        self.seq.restore(whole)
        self.cache.adopt([(c.pos, c.kind, self.seq.attach(c.pos, c.parts)) for c in conv.checkpoints], conv.live_ok)

    # ---- parking -------------------------------------------------------------------------------------
    def park_live(self, trace: bool) -> None:
        """Park the live conversation (when it has one worth keeping and host RAM can take it)."""
        if self.park is None or self.seq.pos == 0 or not self.cache.live_ok:
            return                   # nothing live, or a "strata_checkpoint": false request's (seed #861)
        need = self.seq.nbytes()
        avail = available_ram()
        if avail is None or need > avail // 2:
            self.park.stats["refused"] += 1
            log.warning("not parking the live conversation: host RAM unknown or short", bytes=need, available=avail)
            return
        t0 = time.perf_counter()
        gone = self.park.park(self.capture())
        if trace:
            log.info("parked", tokens=self.seq.pos, bytes=need, ms=round((time.perf_counter() - t0) * 1e3, 2),
                     evicted=len(gone))

    def switch(self, prompt: np.ndarray, cache_prompt: bool, trace: bool) -> str | None:
        """Before a request is planned: when a parked conversation (RAM, else disk) skips more of `prompt` than
        the live one and its checkpoints do, park the live one and restore that one ("park" / "disk"); when the
        request leaves the live conversation (it resumes before the live one's deepest checkpoint), park the live
        one (None)."""
        if self.park is None or not cache_prompt:
            return None
        here = self.cache.peek(self.seq, prompt)
        conv, depth = self.park.best(prompt)
        path, ddepth = self.disk.best(prompt) if self.disk is not None else (None, 0)
        if (conv is not None and depth > here) or (path is not None and ddepth > here):
            source = "park" if conv is not None and depth >= ddepth else "disk"
            self.park_live(trace)
            t0 = time.perf_counter()
            try:
                if source == "disk":
                    conv = self.disk.take(path)
                self.restore(conv)
            except (PartMismatch, KVCacheFull, session.SessionError, OSError) as e:
                # nothing written: the request reads as it would have
                log.warning("a parked conversation could not be restored", tier=source, error=str(e))
                if source == "park":
                    self.park.take(conv)
                return None
            if source == "park":
                self.park.take(conv)
            if trace:
                log.info("unparked", tier=source, tokens=conv.pos, resume=max(depth, ddepth),
                         ms=round((time.perf_counter() - t0) * 1e3, 2))
            return source
        deepest = self.cache.deepest()
        if self.seq.pos > 0 and (here < deepest or (deepest == 0 and here == 0)):
            self.park_live(trace)
        return None

    def parked(self) -> list[dict]:
        """The parked conversations for `stratactl cache` (tokens, bytes, tier, checkpoints, last use)."""
        return (self.park.entries() if self.park is not None else []) + \
            (self.disk.entries() if self.disk is not None else [])

    # ---- session files -----------------------------------------------------------------------------
    def write_session(self, path: Path, conv: Conversation) -> int:
        return session.save_atomic(path, lambda f: session.write(f, conv, self.file.fingerprint(), self.stages))

    def read_session(self, path: Path) -> Conversation:
        with open(path, "rb") as f:
            return session.read(f, self.file.fingerprint(), self.stages, self.n_ctx)

    def session_path(self, filename, *, exists: bool = False) -> Path:
        """The path of session file `filename` (strata.cache.session.check_filename); exists: it must be a file
        there. SessionError (one line) otherwise."""
        if self.remote:
            raise session.SessionError("session files are not supported with a remote stage (--remote-stage) yet")
        if self.slot_save_path is None:
            raise session.SessionError("session files need --slot-save-path DIR (the directory they are kept in)")
        path = session.check_filename(self.slot_save_path, filename)
        if exists and not path.is_file():
            raise session.SessionError(f"session file {filename!r} does not exist in {self.slot_save_path}")
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
        with open(path, "rb") as f:
            conv = session.read(f, self.file.fingerprint(), self.stages, self.n_ctx)
            n_read = f.tell()
        self.park_live(False)               # the conversation the restore replaces is parked, not lost
        try:
            self.restore(conv)
        except (PartMismatch, KVCacheFull) as e:
            raise session.SessionError(f"session file {filename!r}: {e}") from None
        self.from_session = True
        if self.park is not None:
            self.park.discard(conv.tokens)   # now live: a parked copy of the same conversation is dropped
        return {"id_slot": 0, "filename": filename, "n_restored": conv.pos, "n_read": n_read,
                "timings": {"restore_ms": round((time.perf_counter() - t0) * 1e3, 3)}}
