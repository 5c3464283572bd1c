"""DiskTier: the files the conversation state leaves memory to (the parked conversations host RAM evicts, the
checkpoints the tree's byte budget spills), each one a DiskNode, under one byte budget."""
from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from strata.cache.conversation import Conversation

KINDS = ("park", "node")        # a parked conversation's file, a checkpoint's file (its name starts with the kind)


@dataclass(eq=False)
class DiskNode:
    """A file of the disk tier that holds one node of the tree: a checkpoint's snapshot (kind "node": the
    CheckpointCache keeps it as the entry's snapshot, tier "disk") or a parked conversation (kind "park": the parked
    conversations keep it, tier "disk"). Its position and tokens, the file and its size; holds no pages and no
    memory (``parts`` empty, nbytes 0); ``gone`` once the disk tier removed the file to stay under its budget (its
    keeper then forgets it); ``release`` (its keeper dropped it) removes the file."""

    pos: int
    tokens: np.ndarray
    path: Path
    size: int
    tier: "DiskTier"
    kind: str = "node"
    last_use: float = 0.0
    gone: bool = False
    parts: tuple = ()

    def nbytes(self) -> int:
        return 0

    def release(self) -> None:
        self.tier.remove(self)


class DiskTier:
    """What leaves memory, one file each (a DiskNode), written and read by the engine's session-file functions
    (``write(path, conv) -> bytes`` and ``read(path) -> Conversation``, under the live engine's limits; atomic,
    checksummed, opened without following links): ``add`` writes one, ``read`` brings it back (its file removed),
    ``peek`` reads it and keeps it. One budget (``--conversation-cache-disk-mib``) over every file: the least
    recently used leave to stay under it (their DiskNode marked ``gone``; a checkpoint's counted in
    ``node_drops``). Files of an earlier run (``park-*.bin``, ``node-*.bin``) are removed at start: this is a cache
    (a session file is what survives a restart). Thread-safe."""

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
        self._files: list[DiskNode] = []
        self._names = itertools.count()
        self._lock = threading.Lock()
        self.stats = {"written": 0, "restored": 0, "evicted": 0, "failed": 0, "too_big": 0}
        self.node_drops = 0
        for kind in KINDS:
            for old in self.dir.glob(f"{kind}-*.bin"):
                old.unlink(missing_ok=True)

    def add(self, conv: Conversation, kind: str = "node", last_use: float | None = None) -> DiskNode | None:
        """Write `conv` (its tokens and parts; a parked conversation's checkpoints too) to a new file of `kind` ->
        its DiskNode, or None when the write failed or its parts alone pass the whole budget (not written: it would
        only push every other file out and then itself). The least recently used files leave over the budget."""
        if kind not in KINDS:
            raise ValueError(f"unknown disk file kind {kind!r}")
        if conv.nbytes() > self.budget:
            self.stats["too_big"] += 1
            return None
        path = self.dir / f"{kind}-{os.getpid()}-{next(self._names)}.bin"
        try:
            size = self._write(path, conv)
        except (OSError, ValueError):
            self.stats["failed"] += 1
            path.unlink(missing_ok=True)
            return None
        node = DiskNode(pos=conv.pos, tokens=conv.tokens, path=path, size=size, tier=self, kind=kind,
                        last_use=time.time() if last_use is None else last_use)
        with self._lock:
            self._files.append(node)
            self.stats["written"] += 1
            while sum(f.size for f in self._files) > self.budget:
                victim = min(self._files, key=lambda f: f.last_use)
                self._files.remove(victim)
                victim.path.unlink(missing_ok=True)
                victim.gone = True
                self.stats["evicted"] += 1
                self.node_drops += victim.kind == "node"
        return node

    def read(self, node: DiskNode) -> Conversation:
        """The file's conversation read back (the read's errors propagate); the file removed either way."""
        try:
            return self._read(node.path)
        finally:
            self.remove(node)
            self.stats["restored"] += 1

    def peek(self, node: DiskNode) -> Conversation:
        """The file's conversation read, the file kept (the read's errors propagate)."""
        return self._read(node.path)

    def remove(self, node: DiskNode) -> None:
        """Forget a file and remove it (its keeper dropped it, or read it back)."""
        with self._lock:
            there = node in self._files
            if there:
                self._files.remove(node)
        if there:
            node.path.unlink(missing_ok=True)

    def nbytes(self) -> int:
        """Bytes of the files kept."""
        with self._lock:
            return sum(f.size for f in self._files)

    def status(self) -> dict:
        """For /status and /metrics: the counters, the files' bytes and the budget, conversations and nodes kept."""
        with self._lock:
            nodes = sum(f.kind == "node" for f in self._files)
            return dict(self.stats, bytes=sum(f.size for f in self._files), budget_bytes=self.budget,
                        conversations=len(self._files) - nodes, nodes=nodes, nodes_dropped=self.node_drops)
