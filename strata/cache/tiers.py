"""Tiers: where parked conversations are kept, least recently used moving down: resident on the stages' own devices
(their pages held: a count), host copies in RAM (bytes), files on disk (bytes); the host memory set aside for them."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import structlog

from strata.cache.conversation import Conversation, DiskTier, ParkStore, SavedCheckpoint
from strata.memory import PartMismatch
from strata.memory.hostram import available_ram

log = structlog.get_logger("strata.engine")
PREPIN_MAX = 4 << 30             # the most host memory set aside at start for parking, per kind (pinned / ordinary)


class Tiers:
    """The parked conversations of one conversation store, by tier:

    - `resident` (a ParkStore of up to `resident` conversations; None: none): parked on the stages' own devices,
      their K/V pages held in the pools (pages shared with other holders are not copied; a remote stage's parts
      are ids the worker keeps, within the part budget its hello granted) and their running state copied there;
      when a pool runs short (``make_room``) or more are parked, the least recently used moves to
    - `park` (a ParkStore of park_bytes; None: no parking at all): host copies in RAM (a remote stage's part
      streamed from its worker), spilling to
    - `disk` (a DiskTier in disk_dir under disk_bytes, None: none), whose files `write` / `read` (the store's
      session-file functions); it also keeps the checkpoint tree's nodes its byte budget spills (parking on or
      off).
    ValueError for a negative count."""

    def __init__(self, stages: list, *, park_bytes: int | None, disk_dir: str | os.PathLike | None, disk_bytes: int,
                 resident: int, write: Callable[[Path, Conversation], int], read: Callable[[Path], Conversation]):
        self.stages = stages
        if resident < 0:
            raise ValueError(f"--park-resident must be >= 0, got {resident}")
        self.park = ParkStore(park_bytes) if park_bytes is not None else None
        # attention-only stages (no running state): a conversation's K/V can be cut back to any prefix
        self.cut_anywhere = all(st.memory.cuts_anywhere for st in stages)
        self.resident = None
        if self.park is not None and resident > 0 and all(st.memory.holds_pages for st in stages):
            self.resident = ParkStore(resident, spill=self._demote, cost=lambda c: 1, tier="device",
                                      drop=self.release)
        self.disk = None
        if disk_dir:            # with parking off, the tree's checkpoints alone spill there
            self.disk = DiskTier(disk_dir, disk_bytes, write=write, read=read)
            if self.park is not None:
                self.park.spill = self.disk.add

    def host_parts_refusal(self) -> str | None:
        """Why some stage's parts cannot be copied to the host and written (a worker without ``+park``), or None."""
        for st in self.stages:
            if not st.memory.host_parts:
                return (f"stage {st.index} ({st.device}) cannot copy its state to the main (its worker does not "
                        f"announce +park: an older strata worker, upgrade it)")
        return None

    def prepin(self, n_ctx: int, checkpoints_cap: int) -> int:
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
            kv_bytes = int(kv.get("bytes", 0)) * min(1.0, n_ctx / tokens) if tokens else 0   # one context's
            full[kind] = full.get(kind, 0) + int(kv_bytes) + running * (1 + checkpoints_cap)
        from strata.memory.pinned import arena
        asked = 0
        for kind, n in full.items():
            want = min(2 * n, self.park.budget, PREPIN_MAX)
            a = arena(kind)
            a.keep_bytes = max(a.keep_bytes, self.park.budget)
            a.reserve(want)
            asked += want
        return asked

    # ---- moving conversations between tiers ----------------------------------------------------------
    def park_resident(self, conv: Conversation) -> list[Conversation]:
        """Keep `conv` (its parts held) resident -> the conversations moved down to RAM to make room; its holds
        are given back when it could not be kept."""
        try:
            return self.resident.park(conv)
        except BaseException:
            if conv not in self.resident:
                self.release(conv)
            raise

    def make_room(self) -> bool:
        """Move the least recently used resident conversation to host RAM (its pages given back); False when none
        is resident. Called when a pool is short of pages (ConversationStore.make_room)."""
        conv = self.resident.pop_lru() if self.resident is not None else None
        if conv is None:
            return False
        self._demote(conv)
        return True

    def _demote(self, conv: Conversation) -> None:
        """A resident conversation to host RAM (host copies of its pages and running state), its pages given back;
        dropped when host RAM is short."""
        try:
            if self.ram_short(conv.nbytes() + conv.held_bytes(), "dropping a resident conversation"):
                return
            t0 = time.perf_counter()
            parts = [st.memory.materialize(p) for st, p in zip(self.stages, conv.parts)]
            cps = []
            for c in conv.checkpoints:
                try:
                    cps.append(SavedCheckpoint(c.pos, c.kind, [st.memory.detach(p)
                                                               for st, p in zip(self.stages, c.parts)]))
                except PartMismatch:          # a worker dropped that part (its pool ran short): the others move
                    pass
            self.park.park(Conversation(tokens=conv.tokens, parts=parts, checkpoints=cps, live_ok=conv.live_ok,
                                        last_use=conv.last_use, cut_anywhere=conv.cut_anywhere), touch=False)
            log.debug("resident conversation moved to host RAM", tokens=conv.pos,
                      ms=round((time.perf_counter() - t0) * 1e3, 2))
        except Exception as e:  # noqa: BLE001 -- moving an unrelated conversation down must not fail a request
            self.park.stats["refused"] += 1
            log.warning("dropping a resident conversation: it could not be moved to host RAM", error=str(e))
        finally:
            self.release(conv)

    @staticmethod
    def release(conv: Conversation) -> None:
        """Give back the pages (a worker's parts) a conversation and its checkpoints hold."""
        for p in conv.parts:
            p.release()
        for c in conv.checkpoints:
            for p in c.parts:
                p.release()

    def ram_short(self, need: int, what: str) -> bool:
        """Whether host RAM cannot take `need` more bytes (unknown, or less than twice that is available): then
        logged as `what` and counted as refused."""
        avail = available_ram()
        if avail is not None and need <= avail // 2:
            return False
        self.park.stats["refused"] += 1
        log.warning(f"{what}: host RAM unknown or short", bytes=need, available=avail)
        return True

    def best(self, prompt: np.ndarray) -> tuple[str, object, int]:
        """(tier, the parked conversation or disk file that skips most of `prompt`, how many tokens); a tie goes
        to the nearest tier (device, then RAM, then disk); ("park", None, 0) when none matches."""
        found = [(tier, *store.best(prompt)) for tier, store in (("resident", self.resident), ("park", self.park),
                                                                ("disk", self.disk)) if store is not None]
        return max(found, key=lambda f: f[2])

    def _store(self, tier: str):
        return {"resident": self.resident, "park": self.park, "disk": self.disk}[tier]

    def take(self, tier: str, conv) -> Conversation:
        """Take `conv` (a disk tier's file: read) out of its tier -> the conversation. The read's errors propagate."""
        if tier == "disk":
            return self.disk.take(conv)
        self._store(tier).take(conv)
        return conv

    def put_back(self, tier: str, conv: Conversation) -> None:
        """Keep `conv` in `tier` again (a disk tier's conversation, read already: in RAM)."""
        self._store("park" if tier == "disk" else tier).park(conv)

    def discard(self, tokens) -> None:
        """Drop parked conversations holding exactly these tokens (now live by another way)."""
        for store in (self.resident, self.park):
            if store is not None:
                store.discard(tokens)

    def drop_gone(self) -> int:
        """Drop the resident conversations whose parts a stage no longer holds (a remote stage's worker after its
        link reconnected, or one that dropped a part to make room), and the checkpoints of the others that lost a
        part; those in RAM and on disk stay (their bytes are the main's) -> how many conversations were dropped."""
        if self.resident is None:
            return 0
        n = 0
        for conv in list(self.resident._items):
            try:
                for st, p in zip(self.stages, conv.parts):
                    st.memory.validate(p)
            except PartMismatch:
                self.resident.discard(conv.tokens)
                n += 1
                continue
            lost = [c for c in conv.checkpoints if any(getattr(p, "gone", False) for p in c.parts)]
            for c in lost:
                for p in c.parts:
                    p.release()
            conv.checkpoints = [c for c in conv.checkpoints if all(c is not x for x in lost)]
        return n

    def entries(self) -> list[dict]:
        """The parked conversations for `stratactl cache` (tokens, bytes, tier, checkpoints, last use)."""
        return [e for store in (self.resident, self.park, self.disk) if store is not None for e in store.entries()]
