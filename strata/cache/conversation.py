"""Conversation (a whole conversation held apart from the engine: tokens, one part per stage, its checkpoints) and
how deep it can resume a prompt; ParkStore, parked conversations under a budget, LRU (on the devices, a count; in
host RAM, bytes); DiskTier, what leaves memory (the conversations RAM drops, the checkpoint tree's nodes its byte
budget spills: DiskNode), kept as files under a budget of their own."""
from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from strata.memory import StatePart
from strata.text.token_ids import common_prefix, frozen_ids, same_ids


CUT_MIN = 32          # the shortest common prefix a parked conversation is cut back to (Conversation.depth)


@dataclass
class SavedCheckpoint:
    """One checkpoint of a conversation held apart: position, kind and one part per stage whose K/V is a prefix
    of the conversation's own (StatePart.is_prefix): only its running state takes bytes."""

    pos: int
    kind: str
    parts: list[StatePart]


@dataclass(eq=False)      # its tokens are an array: equality is identity
class Conversation:
    """A conversation off the engine (parked, or read from a session file): its token ids, one part per stage, its
    checkpoints and whether its end may be continued live (False after a "strata_checkpoint": false request, seed
    #861). In host RAM and files the parts are materialized (K/V of its used pages and running state, host
    copies); parked resident on the devices they are held (pages kept in each stage's pool, running-state copies
    on the device: ``resident``). tokens: any sequence of ids, kept as a read-only int32 array (strata.text.token_ids)."""

    tokens: np.ndarray
    parts: list[StatePart]
    checkpoints: list[SavedCheckpoint] = field(default_factory=list)
    live_ok: bool = True
    last_use: float = field(default_factory=time.time)
    resident: bool = False
    cut_anywhere: bool = False          # attention-only: its K/V can be cut back to any prefix

    def __post_init__(self):
        self.tokens = frozen_ids(self.tokens)

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def held_bytes(self) -> int:
        """Bytes of K/V its held pages keep in the stages' pools (resident; shared pages counted in full)."""
        return sum(k.length * k.hold.pool.bytes_per_token for p in self.parts
                   for k in getattr(p, "kv", {}).values() if getattr(k, "is_held", False))

    def nbytes(self) -> int:
        return (sum(p.nbytes() for p in self.parts) + 4 * len(self.tokens) +
                sum(p.nbytes() for c in self.checkpoints for p in c.parts))

    def depth(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's tokens this conversation can skip: its whole length when the prompt extends
        it (and its end may be continued), the longest common prefix when its K/V can be cut back anywhere (an
        attention-only model's, as the live sequence's is) and that prefix is at least CUT_MIN tokens and half the
        conversation (as llama.cpp's server picks a slot by prompt similarity: a chat template's first tokens are
        no reason to bring a conversation back), else its deepest checkpoint that is a prefix of the prompt; always
        shorter than the prompt (one token at least is read), 0 when nothing matches."""
        n = len(prompt)
        common = common_prefix(self.tokens, prompt)
        if self.live_ok and common == self.pos < n:
            return self.pos
        deepest = max((c.pos for c in self.checkpoints if c.pos <= common and c.pos < n), default=0)
        if self.live_ok and self.cut_anywhere and common >= max(CUT_MIN, self.pos // 2):
            return max(deepest, min(common, n - 1))
        return deepest


class ParkStore:
    """Parked conversations under a budget, least recently used first out: in host RAM (``--conversation-cache-mib``,
    the budget in bytes), or resident on their stages' devices (``--park-resident``, the budget a count; ``cost``
    what one conversation takes of it, ``tier`` the name ``entries`` reports). ``park`` adds one and evicts the
    least recently used to stay under the budget (one that alone is over it is not kept), handing them to ``spill``
    (the next tier) when there is one, else to ``drop``; ``best(prompt)`` is the one that skips most of a prompt
    (deepest match, ties to the most recent), never one that shares no prefix with it; ``take`` removes it (it
    becomes the live conversation); ``pop_lru`` removes the least recently used. A conversation removed without
    being taken or spilled (``discard``, ``clear``, replaced by one of the same tokens) goes to ``drop`` (a
    resident one gives its pages back there). Thread-safe (status reads from the event loop)."""

    def __init__(self, budget: int, spill: Callable[[Conversation], None] | None = None, *,
                 cost: Callable[[Conversation], int] = Conversation.nbytes, tier: str = "ram",
                 drop: Callable[[Conversation], None] | None = None):
        if budget < 0:
            raise ValueError(f"--conversation-cache-mib must be >= 0, got {budget}")
        self.budget = int(budget)
        self.spill = spill             # where evicted conversations go (the next tier), if anywhere
        self.cost, self.tier, self.drop = cost, tier, drop
        self._items: list[Conversation] = []
        self._lock = threading.Lock()
        self.stats = {"parked": 0, "restored": 0, "evicted": 0, "refused": 0}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, conv: Conversation) -> bool:
        with self._lock:
            return any(c is conv for c in self._items)

    def nbytes(self) -> int:
        with self._lock:
            return sum(c.nbytes() for c in self._items)

    def park(self, conv: Conversation, touch: bool = True) -> list[Conversation]:
        """Keep `conv` (replacing a parked one with the same tokens; touch: dated now, else it keeps its last use, as
        a conversation moved here from the tier above does); returns the conversations evicted (handed to
        ``spill``, else ``drop``)."""
        gone, replaced = self._park(conv, touch)
        self._dropped(replaced)
        for c in gone:
            if self.spill is not None:
                self.spill(c)
            else:
                self._dropped([c])
        return gone

    def _dropped(self, convs: list[Conversation]) -> None:
        if self.drop is not None:
            for c in convs:
                self.drop(c)

    def _park(self, conv: Conversation, touch: bool = True) -> tuple[list[Conversation], list[Conversation]]:
        size = self.cost(conv)
        with self._lock:
            if size > self.budget:
                self.stats["refused"] += 1
                return [conv], []
            replaced = [c for c in self._items if same_ids(c.tokens, conv.tokens)]
            self._items = [c for c in self._items if c not in replaced]
            if touch:
                conv.last_use = time.time()
            self._items.append(conv)
            self.stats["parked"] += 1
            gone = []
            while sum(self.cost(c) for c in self._items) > self.budget:
                gone.append(self._remove_lru())
            self.stats["evicted"] += len(gone)
            return gone, replaced

    def best(self, prompt: Sequence[int]) -> tuple[Conversation | None, int]:
        """(the parked conversation that skips most of `prompt`, how many tokens), or (None, 0)."""
        with self._lock:
            best, depth = None, 0
            for c in self._items:
                d = c.depth(prompt)
                if d > depth or (d == depth and d > 0 and best is not None and c.last_use > best.last_use):
                    best, depth = c, d
            return best, depth

    def take(self, conv: Conversation) -> None:
        with self._lock:
            self._items.remove(conv)
            self.stats["restored"] += 1

    def pop_lru(self) -> Conversation | None:
        """Remove and return the least recently used conversation (None when empty); the caller moves it on."""
        with self._lock:
            if not self._items:
                return None
            self.stats["evicted"] += 1
            return self._remove_lru()

    def _remove_lru(self) -> Conversation:
        """(under the lock) Remove the least recently used conversation and return it."""
        victim = min(self._items, key=lambda c: c.last_use)
        self._items.remove(victim)
        return victim

    def discard(self, tokens) -> None:
        """Drop parked conversations holding exactly these tokens (one that became live by another way)."""
        with self._lock:
            gone = [c for c in self._items if same_ids(c.tokens, tokens)]
            self._items = [c for c in self._items if c not in gone]
        self._dropped(gone)

    def clear(self) -> None:
        with self._lock:
            gone, self._items = self._items, []
        self._dropped(gone)

    def entries(self) -> list[dict]:
        """For `stratactl cache`: tokens, bytes (resident: with the K/V its held pages keep, shared ones too), tier,
        checkpoints, last use (Unix seconds), most recent first."""
        with self._lock:
            return [{"tokens": c.pos, "bytes": c.nbytes() + c.held_bytes(), "tier": self.tier,
                     "checkpoints": len(c.checkpoints), "last_use_time": c.last_use}
                    for c in sorted(self._items, key=lambda c: -c.last_use)]


@dataclass(eq=False)
class DiskNode:
    """A checkpoint of the tree kept as a file of the disk tier (its snapshot there: CheckpointCache's tier "disk"):
    its position and tokens, the file and its size. Holds no pages and no memory (``parts`` empty, nbytes 0);
    ``gone`` once the disk tier removed the file to stay under its budget (the tree then forgets it);
    ``release`` (the tree dropped it) removes the file."""

    pos: int
    tokens: np.ndarray
    path: Path
    size: int
    tier: "DiskTier"
    last_use: float = 0.0
    gone: bool = False
    parts: tuple = ()

    def nbytes(self) -> int:
        return 0

    def release(self) -> None:
        self.tier.remove(self)


class DiskTier:
    """What leaves memory, one file each, written and read by the engine's session-file functions (``write(path,
    conv) -> bytes`` and ``read(path) -> Conversation``, under the live engine's limits; atomic, checksummed,
    opened without following links): the conversations RAM drops (``add``: an index in memory of their tokens and
    checkpoint positions answers ``best(prompt)`` without reading files) and the checkpoint tree's nodes its byte
    budget spills (``add_node`` -> a DiskNode the tree keeps; ``read_node`` brings one back). One budget
    (``--conversation-cache-disk-mib``) over both: the least recently used files leave to stay under it (a node's
    DiskNode marked ``gone``, counted in ``node_drops``). Files of an earlier run (``park-*.bin``, ``node-*.bin``)
    are removed at start: this is a cache (a session file is what survives a restart)."""

    def __init__(self, directory: str | os.PathLike, budget_bytes: int,
                 write: Callable[[Path, Conversation], int], read: Callable[[Path], Conversation]):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ValueError(f"--conversation-cache-dir {self.dir}: not a directory")
        if budget_bytes <= 0:
            raise ValueError(f"--conversation-cache-disk-mib must be > 0 with --conversation-cache-dir, got "
                             f"{budget_bytes // (1 << 20)}")
        self.budget = int(budget_bytes)
        self._write, self._read = write, read
        # (stub: tokens + checkpoint positions, or the DiskNode of a tree node; file; bytes)
        self._index: list[tuple[Conversation | DiskNode, Path, int]] = []
        self._names = itertools.count()
        self._lock = threading.Lock()
        self.stats = {"written": 0, "restored": 0, "evicted": 0, "failed": 0, "too_big": 0}
        self.node_drops = 0
        for pattern in ("park-*.bin", "node-*.bin"):
            for old in self.dir.glob(pattern):
                old.unlink(missing_ok=True)

    def _file(self, kind: str, conv: Conversation) -> tuple[Path, int] | None:
        """Write `conv` to a new file -> (path, bytes); None when it failed or its parts alone pass the whole budget
        (not written: it would only push every other file out and then itself)."""
        if conv.nbytes() > self.budget:
            self.stats["too_big"] += 1
            return None
        path = self.dir / f"{kind}-{os.getpid()}-{next(self._names)}.bin"
        try:
            return path, self._write(path, conv)
        except (OSError, ValueError):
            self.stats["failed"] += 1
            path.unlink(missing_ok=True)
            return None

    def _keep(self, entry: tuple) -> None:
        """(under the lock) Index `entry`, then remove the least recently used files over the budget."""
        self._index.append(entry)
        self.stats["written"] += 1
        while sum(e[2] for e in self._index) > self.budget:
            victim = min(self._index, key=lambda e: _last_use(e[0]))
            self._index.remove(victim)
            victim[1].unlink(missing_ok=True)
            self.stats["evicted"] += 1
            if isinstance(victim[0], DiskNode):
                victim[0].gone = True
                self.node_drops += 1

    def add(self, conv: Conversation) -> None:
        """Write `conv` to a file of its own and index it; the least recently used files leave over the budget."""
        made = self._file("park", conv)
        if made is None:
            return
        path, size = made
        stub = Conversation(tokens=conv.tokens, parts=[], live_ok=conv.live_ok, last_use=conv.last_use,
                            checkpoints=[SavedCheckpoint(c.pos, c.kind, []) for c in conv.checkpoints])
        # (no common-prefix cut from the index: reading a whole file to cut it back is rarely worth it)
        with self._lock:
            for old in [e for e in self._index if isinstance(e[0], Conversation) and
                        same_ids(e[0].tokens, conv.tokens)]:
                self._index.remove(old)
                old[1].unlink(missing_ok=True)
            self._keep((stub, path, size))

    def add_node(self, conv: Conversation, last_use: float | None = None) -> DiskNode | None:
        """Write a tree node (`conv`: its tokens and parts) to a file -> the DiskNode the tree keeps in its place,
        or None when it could not be written (then the tree drops it)."""
        made = self._file("node", conv)
        if made is None:
            return None
        path, size = made
        node = DiskNode(pos=conv.pos, tokens=conv.tokens, path=path, size=size, tier=self,
                        last_use=time.time() if last_use is None else last_use)
        with self._lock:
            self._keep((node, path, size))
        return node

    def read_node(self, node: DiskNode) -> Conversation:
        """The tree node's conversation read back (the read's errors propagate); its file removed either way."""
        try:
            return self._read(node.path)
        finally:
            self.remove(node)
            self.stats["restored"] += 1

    def peek_node(self, node: DiskNode) -> Conversation:
        """The tree node's conversation read, its file kept (the read's errors propagate)."""
        return self._read(node.path)

    def remove(self, node: DiskNode) -> None:
        """Forget a tree node's file (the tree dropped the node, or read it back)."""
        with self._lock:
            entry = next((e for e in self._index if e[0] is node), None)
            if entry is not None:
                self._index.remove(entry)
        if entry is not None:
            node.path.unlink(missing_ok=True)

    def nbytes(self) -> int:
        """Bytes of the files kept."""
        with self._lock:
            return sum(e[2] for e in self._index)

    def best(self, prompt: Sequence[int]) -> tuple[Path | None, int]:
        """(the conversation file that skips most of `prompt`, how many tokens), or (None, 0)."""
        with self._lock:
            best, depth, when = None, 0, -1.0
            for stub, path, _ in self._index:
                if isinstance(stub, DiskNode):
                    continue                    # a tree node: the tree finds it
                d = stub.depth(prompt)
                if d > depth or (d == depth and d > 0 and stub.last_use > when):
                    best, depth, when = path, d, stub.last_use
            return best, depth

    def take(self, path: Path) -> Conversation:
        """Read the conversation in `path` (the read's errors propagate) and forget the file."""
        with self._lock:
            entry = next(e for e in self._index if e[1] == path)
            self._index.remove(entry)
        try:
            conv = self._read(path)
        finally:
            path.unlink(missing_ok=True)
        self.stats["restored"] += 1
        return conv

    def entries(self) -> list[dict]:
        """The conversation files for `stratactl cache` (tree nodes are listed with the checkpoints)."""
        with self._lock:
            return [{"tokens": stub.pos, "bytes": size, "tier": "disk", "checkpoints": len(stub.checkpoints),
                     "last_use_time": stub.last_use} for stub, _, size in sorted(self._index,
                                                                                 key=lambda e: -_last_use(e[0]))
                    if isinstance(stub, Conversation)]

    def status(self) -> dict:
        """For /status and /metrics: the counters, the files' bytes and the budget, conversations and nodes kept."""
        with self._lock:
            nodes = sum(isinstance(e[0], DiskNode) for e in self._index)
            return dict(self.stats, bytes=sum(e[2] for e in self._index), budget_bytes=self.budget,
                        conversations=len(self._index) - nodes, nodes=nodes, nodes_dropped=self.node_drops)


def _last_use(stub) -> float:
    return float(getattr(stub, "last_use", 0.0))
