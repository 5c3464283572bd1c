"""ParkedConversations: the parked conversations as nodes of the checkpoint tree (its "parked" slot), each in a tier
(on the stages' devices, in host RAM, on disk) under that tier's budget, moved down the tiers least recently used
first (the tree's retention, strata.cache.retention); the host memory set aside for them."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import structlog

from strata.cache.conversation import Conversation, SavedCheckpoint
from strata.cache.disk import DiskNode, DiskTier
from strata.cache.retention import Item, evict
from strata.cache.tree import CheckpointTree, Node
from strata.memory import PartMismatch
from strata.memory.hostram import available_ram

log = structlog.get_logger("strata.engine")
PREPIN_MAX = 4 << 30             # the most host memory set aside at start for parking, per kind (pinned / ordinary)
TIERS = ("device", "ram", "disk")  # nearest first: of two conversations that skip as much, the nearer comes back
SLOT = "parked"                  # the tree slot the parked conversations are kept in


@dataclass(eq=False)
class Parked:
    """One parked conversation at its node of the tree: ``conv`` (its parts held on the stages' devices in tier
    "device", host copies in "ram"; in "disk" a stub of its tokens and checkpoint positions, its parts in ``file``),
    ``tier``, ``node`` (None once it left the tree), ``saved`` (the order it entered its tier in)."""

    conv: Conversation
    tier: str
    node: Node | None = None
    file: DiskNode | None = None
    saved: int = 0

    def nbytes(self) -> int:
        """What it takes in its tier: a file's size, host copies' bytes, a resident one's held K/V too; in memory
        also its share of the checkpoints it pins (``pinned_share``)."""
        if self.tier == "disk":
            return self.file.size
        return self.conv.nbytes() + self.pinned_share() + \
            (self.conv.held_bytes() if self.tier == "device" else 0)

    def pinned_share(self) -> int:
        """Its share of the host RAM the tree's checkpoints it pins keep of their own (those in tier "ram"; each
        checkpoint's bytes split evenly among the conversations pinning it, rounded up): shared checkpoints are
        counted once over all; one on the device or on disk takes no host RAM."""
        return sum(-(-n.value.bytes // n.pins) for n in self.conv.pins
                   if n.value is not None and n.pins > 0 and n.value.tier == "ram")

    def entry(self) -> dict:
        return {"tokens": self.conv.pos, "bytes": self.nbytes(), "tier": self.tier,
                "checkpoints": len(self.conv.checkpoint_positions()), "last_use_time": self.conv.last_use}


class Tier:
    """One tier's budget and counters (``budget``: a count of conversations on the devices, bytes in host RAM;
    ``stats``: parked / restored / evicted / refused), and a view of the conversations parked in it (``len``,
    ``nbytes``, ``conversations``, ``clear``)."""

    def __init__(self, owner: "ParkedConversations", name: str, budget: int):
        self.owner, self.name, self.budget = owner, name, int(budget)
        self.stats = {"parked": 0, "restored": 0, "evicted": 0, "refused": 0}

    def cost(self, p: Parked) -> int:
        return 1 if self.name == "device" else p.conv.nbytes() + p.pinned_share()

    def conversations(self) -> list[Conversation]:
        return [p.conv for p in self.owner.in_tier(self.name)]

    def __len__(self) -> int:
        return len(self.owner.in_tier(self.name))

    def nbytes(self) -> int:
        return sum(p.conv.nbytes() + p.pinned_share() for p in self.owner.in_tier(self.name))

    def clear(self) -> None:
        self.owner.clear(self.name)


class ParkedConversations:
    """The parked conversations of one conversation store, kept in the "parked" slot of the checkpoint tree at their
    tokens (one per token sequence: parking another at the same tokens replaces it), under the tree's lock. Each
    is in one tier:

    - ``device`` (a Tier of up to `resident` conversations; None: none): their K/V pages held in the stages' pools
      (pages shared with other holders are not copied; a remote stage's parts are ids the worker keeps, within the
      part budget its hello granted), their running state copied there;
    - ``ram`` (a Tier of `park_bytes`; None: no parking at all): host copies (a remote stage's part streamed from
      its worker);
    - ``disk`` (the DiskTier `disk`, or None): a file each, under the disk tier's own budget.

    Over a tier's budget the least recently used move down one tier in place (the device's to host RAM when a pool
    is short too, ``make_room``); what RAM evicts is written to disk, or dropped; a file the disk tier removes is
    forgotten. The one that skips most of a prompt is found by the tree's one walk along it (strata.cache.lookup);
    ``take`` removes it (it becomes live). `leaving(conv)` is called before a conversation's host copy leaves host
    RAM.
    ValueError (one line) for a negative count or budget."""

    #: the budgets the parked conversations take part in the tiers' eviction passes with (strata.cache.retention)
    BUDGETS = {"device": "park-resident", "ram": "conversation-cache-mib"}

    def __init__(self, tree: CheckpointTree, stages: list, *, park_bytes: int | None, resident: int,
                 disk: DiskTier | None, leaving: Callable[[Conversation], None] | None = None,
                 checkpoints=None, spill=None):
        if resident < 0:
            raise ValueError(f"--park-resident must be >= 0, got {resident}")
        if park_bytes is not None and park_bytes < 0:
            raise ValueError(f"--conversation-cache-mib must be >= 0, got {park_bytes}")
        self.tree, self._lock, self.stages = tree, tree.lock, stages
        # attention-only stages (no running state): a conversation's K/V can be cut back to any prefix
        self.cut_anywhere = all(st.memory.cuts_anywhere for st in stages)
        self.ram = Tier(self, "ram", park_bytes) if park_bytes is not None else None
        self.device = None
        if self.ram is not None and resident > 0 and all(st.memory.holds_pages for st in stages):
            self.device = Tier(self, "device", resident)
        self.disk = disk
        # called (under the lock) before a conversation's host copy leaves host RAM (moved to disk, dropped, taken):
        # the tree's checkpoints that read their K/V from it take what they need (strata.cache.held)
        self._leaving = leaving or (lambda conv: None)
        # the keeper of the tree's other slot (a strata.cache.checkpoints.CheckpointCache, or None): its checkpoints
        # take part in each tier's eviction pass (their victims handed back to it, the byte budget's to `spill`)
        self.checkpoints, self._spill = checkpoints, spill
        self._clock = 0
        tree.add_view("parked", self._entries_now)     # entries, for readers on other threads

    # ---- views ---------------------------------------------------------------------------------------
    def _all(self) -> list[Parked]:
        """(under the lock) Every parked conversation, a file the disk tier removed forgotten first."""
        out = []
        for n in self.tree.nodes(SLOT):
            p = n.parked
            if p.tier == "disk" and p.file.gone:
                self._drop(p, give_back=False)
            else:
                out.append(p)
        return out

    def in_tier(self, tier: str) -> list[Parked]:
        with self._lock:
            return [p for p in self._all() if p.tier == tier]

    def entries(self) -> list[dict]:
        """The parked conversations for `stratactl cache` (tokens, bytes, tier, checkpoints, last use), the nearest
        tier first, each tier's most recent first. A view (CheckpointTree.view): never held up by a conversation
        moving down a tier (a device-to-host copy, a file write), it then shows the tree just before the move."""
        return [dict(e) for e in self.tree.view("parked")]

    def _entries_now(self) -> tuple[dict, ...]:
        """(under the lock) entries' view; pure: a file the disk tier removed is left out, forgotten by a verb."""
        kept = [n.parked for n in self.tree.nodes(SLOT) if not (n.parked.tier == "disk" and n.parked.file.gone)]
        return tuple(p.entry() for p in sorted(kept, key=lambda p: (TIERS.index(p.tier), -p.conv.last_use)))

    def tier(self, name: str) -> Tier | None:
        return {"device": self.device, "ram": self.ram}.get(name)

    def host_parts_refusal(self) -> str | None:
        """Why some stage's parts cannot be copied to the host and written (a worker without ``+park``), or None."""
        for st in self.stages:
            if not st.memory.host_parts:
                return (f"stage {st.index} ({st.device}) cannot copy its state to the main (its worker does not "
                        f"announce +park: an older strata worker, upgrade it)")
        return None

    # ---- parking and taking back ---------------------------------------------------------------------
    def park(self, conv: Conversation, touch: bool = True) -> list[Parked]:
        """Keep `conv` (held on the devices when ``conv.resident``, else host copies) at its tokens, replacing one
        parked there; touch: dated now, else it keeps its last use. -> the conversations moved down a tier or
        dropped to stay under the budgets. A resident one's holds are given back when it could not be kept."""
        tier = self.device if conv.resident and self.device is not None else self.ram
        p = Parked(conv, tier.name)
        try:
            with self._lock:
                return self._enter(p, tier, touch)
        except BaseException:
            if p.node is None:
                if conv.resident:
                    self.release(conv)
                self.unpin(p.conv)
            raise

    def _enter(self, p: Parked, tier: Tier, touch: bool) -> list[Parked]:
        """(under the lock) `p` into `tier` at its tokens, then that tier's least recently used moved down."""
        if touch:
            p.conv.last_use = time.time()
        if tier.cost(p) > tier.budget:          # alone over the budget: not kept here, straight to the next tier
            tier.stats["refused"] += 1
            return [p] if self._move_down(p, place=True) is not None else []
        self._clock += 1
        p.tier, p.saved = tier.name, self._clock
        self._place(p)
        tier.stats["parked"] += 1
        moved = []
        for victim in self._victims(tier):
            tier.stats["evicted"] += 1
            moved.append(victim)
            self._move_down(victim)
        return moved

    def _place(self, p: Parked) -> None:
        """(under the lock) Keep `p` at its tokens; one parked there before is dropped."""
        p.node, old = self.tree.put(p.conv.tokens, p, SLOT)
        if old is not None and old is not p:
            self._drop(old)

    def _victims(self, tier: Tier | str) -> list[Parked]:
        """(under the lock) The one eviction pass over `tier` (strata.cache.retention.evict), both slots of the tree
        in it, by last use alone: the conversations parked in it (each costing 1 of --park-resident on the device,
        its bytes with its share of the checkpoints it holds of --conversation-cache-mib in host RAM) and, with the
        checkpoint keeper, the checkpoints (their count on the device pass, their bytes in memory on the RAM one),
        each against its own budget. The checkpoints that go are handed to their keeper (dropped, or spilled);
        -> the conversations that go, to be moved down a tier, least recently used first. `tier`: a Tier, or the
        name of one that is off (the checkpoints' part of its pass alone)."""
        tname = tier if isinstance(tier, str) else tier.name
        name = self.BUDGETS[tname]
        kept = {("parked", id(p)): p for p in self._all() if p.tier == tname} if not isinstance(tier, str) else {}
        items = [Item(k, (p.conv.last_use, p.saved), {name: tier.cost(p)}) for k, p in kept.items()]
        budgets: dict[str, int | None] = {name: None if isinstance(tier, str) else tier.budget}
        cp = self.checkpoints
        if cp is not None and len(cp):
            which = cp.COUNT if tname == "device" else cp.BYTES
            items += cp.items(which)
            budgets.update(cp.budgets())
        victims = evict(items, budgets)
        gone = [k[1] for k, _ in victims if k[0] == "checkpoint"]
        if gone:
            cp.evicted(gone, which, self._spill)
        return [kept[k] for k, _ in victims if k[0] == "parked"]

    def retain(self) -> None:
        """Each tier's eviction pass now (the device's, then host RAM's: ``_victims``; a tier that is off: the
        checkpoints' part of it), what goes moved down."""
        with self._lock:
            for name in ("device", "ram"):
                tier = self.tier(name)
                for victim in self._victims(tier if tier is not None else name):
                    if victim.node is not None:
                        tier.stats["evicted"] += 1
                        self._move_down(victim)

    def _move_down(self, p: Parked, place: bool = False) -> Parked | None:
        """(under the lock) `p` one tier down (the device's to host RAM, RAM's to a disk file), in place at its node
        (place: put there first, it is not in the tree yet); dropped when the next tier cannot take it -> `p`, or
        None when dropped."""
        self.tree.publish()                     # readers see the tree as it is before the copy or the write
        if p.tier == "device":
            host = self._host_copy(p.conv)
            self.release(p.conv)                # its pages given back either way
            if host is None:
                self._drop(p, give_back=False)
                return None
            host.pins, p.conv.pins = p.conv.pins, []     # the host copy holds its pins now
            p.conv = host
            self._enter_below(p, self.ram, place)
            return p if p.node is not None else None
        self._leaving(p.conv)                   # in RAM until now: what reads from its host copy takes its part
        node = None
        if self.disk is not None:
            node = self.disk.add(p.conv, "park", p.conv.last_use)
        if node is None:
            self._drop(p, give_back=False)
            return None
        c = p.conv
        # the file's stub: no common-prefix cut from it (reading a whole file to cut it back is rarely worth it)
        p.conv = Conversation(tokens=c.tokens, parts=[], live_ok=c.live_ok, last_use=c.last_use,
                              checkpoints=[SavedCheckpoint(s.pos, s.kind, []) for s in c.checkpoints], pins=c.pins)
        c.pins = []                             # the stub holds them: the tree's checkpoints stay where they are
        p.file, p.tier = node, "disk"
        if place or p.node is None:
            self._place(p)
        self._all()                             # the files the disk tier removed to take this one, forgotten
        return p

    def _enter_below(self, p: Parked, tier: Tier, place: bool) -> None:
        """(under the lock) `p`, moved down from the tier above, into `tier`: in place at its node (place: put there
        first), keeping its last use; then that tier's least recently used moved down."""
        p.tier = tier.name
        if tier.cost(p) > tier.budget:          # alone over the budget: on to the next tier
            tier.stats["refused"] += 1
            self._move_down(p, place=place or p.node is None)
            return
        self._clock += 1
        p.saved = self._clock
        if place or p.node is None:
            self._place(p)
        tier.stats["parked"] += 1
        for victim in self._victims(tier):
            tier.stats["evicted"] += 1
            self._move_down(victim)

    def _drop(self, p: Parked, give_back: bool = True, unpin: bool = True) -> None:
        """(under the lock) `p` out of the tree (unless another took its node's place); give_back: what it holds
        given back (a resident one's pages, a disk one's file); unpin: its pins on the tree's checkpoints given
        back (not when it is taken: its taker holds them)."""
        if p.tier == "ram":
            self._leaving(p.conv)
        if p.node is not None and p.node.parked is p:
            self.tree.remove(p.node, SLOT)
        p.node = None
        if unpin:
            self.unpin(p.conv)
        if give_back and p.tier == "device":
            self.release(p.conv)
        elif give_back and p.tier == "disk":
            p.file.release()

    def _host_copy(self, conv: Conversation) -> Conversation | None:
        """A resident conversation as host copies of its pages, running state and checkpoints, or None when host
        RAM is short or the copy failed (then it is dropped)."""
        try:
            if self.ram_short(conv.nbytes() + conv.held_bytes(), "dropping a resident conversation"):
                return None
            t0 = time.perf_counter()
            parts = [st.memory.materialize(p) for st, p in zip(self.stages, conv.parts)]
            cps = []
            for c in conv.checkpoints:
                try:
                    cps.append(SavedCheckpoint(c.pos, c.kind, [st.memory.detach(p)
                                                               for st, p in zip(self.stages, c.parts)]))
                except PartMismatch:          # a worker dropped that part (its pool ran short): the others move
                    pass
            log.debug("resident conversation moved to host RAM", tokens=conv.pos,
                      ms=round((time.perf_counter() - t0) * 1e3, 2))
            return Conversation(tokens=conv.tokens, parts=parts, checkpoints=cps, live_ok=conv.live_ok,
                                last_use=conv.last_use, cut_anywhere=conv.cut_anywhere)
        except Exception as e:  # noqa: BLE001 -- moving an unrelated conversation down must not fail a request
            self.ram.stats["refused"] += 1
            log.warning("dropping a resident conversation: it could not be moved to host RAM", error=str(e))
            return None

    def make_room(self) -> bool:
        """Move the least recently used resident conversation to host RAM (its pages given back); False when none
        is resident. Called when a pool is short of pages (ConversationStore.make_room)."""
        if self.device is None:
            return False
        with self._lock:
            res = [p for p in self._all() if p.tier == "device"]
            if not res:
                return False
            self.device.stats["evicted"] += 1
            self._move_down(min(res, key=lambda p: (p.conv.last_use, p.saved)))
            return True

    def take(self, p: Parked) -> Conversation:
        """Take `p` out of the tree -> its conversation (a file's read back: its errors propagate, its pins then
        given back), still pinning the tree's checkpoints on its path: the taker parks it again or gives them
        back (``unpin``)."""
        with self._lock:
            self._drop(p, give_back=False, unpin=False)
            if p.tier != "disk":
                self.tier(p.tier).stats["restored"] += 1
                return p.conv
        try:
            conv = self.disk.read(p.file)
        except BaseException:
            with self._lock:
                self.unpin(p.conv)
            raise
        conv.pins, p.conv.pins = p.conv.pins, []
        return conv

    def unpin(self, conv: Conversation) -> None:
        """Give back `conv`'s pins on the tree's checkpoints (CheckpointTree.unpin); again: nothing."""
        with self._lock:
            for n in conv.pins:
                self.tree.unpin(n)
            conv.pins = []

    def discard(self, tokens) -> None:
        """Drop the conversation parked on the device or in RAM at exactly these tokens (now live by another way)."""
        with self._lock:
            node = self.tree.find(tokens)
            if node is not None and node.parked is not None and node.parked.tier != "disk":
                self._drop(node.parked)

    def clear(self, tier: str) -> None:
        """Drop every conversation parked in `tier`, what they hold given back."""
        with self._lock:
            for p in self._all():
                if p.tier == tier:
                    self._drop(p)

    def drop_gone(self) -> int:
        """Drop the resident conversations whose parts a stage no longer holds (a remote stage's worker after its
        link reconnected, or one that dropped a part to make room), and the checkpoints of the others that lost a
        part; those in RAM and on disk stay (their bytes are the main's) -> how many conversations were dropped."""
        n = 0
        with self._lock:
            for p in self._all():
                if p.tier != "device":
                    continue
                conv = p.conv
                try:
                    for st, part in zip(self.stages, conv.parts):
                        st.memory.validate(part)
                except PartMismatch:
                    self._drop(p)
                    n += 1
                    continue
                lost = [c for c in conv.checkpoints if any(getattr(x, "gone", False) for x in c.parts)]
                for c in lost:
                    for x in c.parts:
                        x.release()
                conv.checkpoints = [c for c in conv.checkpoints if all(c is not x for x in lost)]
        return n

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
        self.ram.stats["refused"] += 1
        log.warning(f"{what}: host RAM unknown or short", bytes=need, available=avail)
        return True

    def prepin(self, n_ctx: int) -> int:
        """Host memory ahead for parking (strata.memory.pinned: pinned for the GPU stages, paged in for the CPU
        ones): two full conversations of the local stages (a switch parks the live one while the other is still
        parked), each a full context's K/V plus its running state (its checkpoints are the tree's: pinned, not
        copied); capped by the
        park budget and PREPIN_MAX and kept up to the park budget, so a park copies at the bus's (or memcpy's)
        bandwidth instead of getting fresh memory first (docs/checkpoints.md). Returns the bytes asked for."""
        if self.ram is None:
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
            full[kind] = full.get(kind, 0) + int(kv_bytes) + running
        from strata.memory.pinned import arena
        asked = 0
        for kind, n in full.items():
            want = min(2 * n, self.ram.budget, PREPIN_MAX)
            a = arena(kind)
            a.keep_bytes = max(a.keep_bytes, self.ram.budget)
            a.reserve(want)
            asked += want
        return asked
