"""DiskTier: the files the conversation state leaves memory to (the parked conversations host RAM evicts, the
checkpoints the tree's byte budget spills), each one a DiskNode, under one byte budget, in a directory one process
holds at a time (``dir_in_use``)."""
from __future__ import annotations

import errno
import fcntl
import itertools
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from strata.cache.conversation import Conversation
from strata.text.token_ids import same_ids

KINDS = ("park", "node")        # a parked conversation's file, a checkpoint's file (its name starts with the kind)
LOCK_NAME = ".strata-cache.lock"   # held (flock) by the process whose disk tier uses the directory


class ForeignFile(ValueError):
    """A disk tier file that does not hold the conversation written to it (replaced behind the tier's back):
    refused, never restored."""


def _open_lock(directory: Path) -> int:
    """The directory's lock file opened (created if missing; never through a link) -> its descriptor. ValueError
    naming --conversation-cache-dir when the directory cannot be written."""
    try:
        return os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                       0o600)
    except OSError as e:
        raise ValueError(f"--conversation-cache-dir {directory}: cannot write there "
                         f"({e.strerror or type(e).__name__}): the disk tier needs a writable directory") from None


def _take_lock(directory: Path, fd: int) -> None:
    """flock `fd` exclusively without waiting. ValueError naming the process that holds it otherwise."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ValueError(f"--conversation-cache-dir {directory}: cannot lock it "
                             f"({e.strerror or type(e).__name__})") from None
        try:
            who = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            who = ""
        pid = f" (pid {who})" if who.isdigit() else ""
        raise ValueError(f"--conversation-cache-dir {directory} is in use by another strata process{pid}: give "
                         "each daemon a directory of its own") from None


def dir_in_use(directory: str | os.PathLike) -> str | None:
    """Why a disk tier cannot use `directory` now (another process holds it, it cannot be written), or None: the
    check the command line makes before the model loads; the DiskTier takes the lock itself."""
    d = Path(directory)
    try:
        fd = _open_lock(d)
    except ValueError as e:
        return str(e)
    try:
        _take_lock(d, fd)
    except ValueError as e:
        return str(e)
    finally:
        os.close(fd)
    return None


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
    ``node_drops``). A file read back must hold the tokens written to it (ForeignFile otherwise). The directory is
    held (an flock on LOCK_NAME, given up by ``close``, at exit or when the process dies) by one DiskTier at a time:
    another's start raises ValueError naming the holder. Files of an earlier run (``park-*.bin``, ``node-*.bin`` and
    the temporaries a write killed part-way left, ``cleared`` of them) are removed at start: this is a cache (a
    session file is what survives a restart). Thread-safe."""

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
        self._lock_fd = _open_lock(self.dir)
        self._unlock = weakref.finalize(self, os.close, self._lock_fd)
        try:
            _take_lock(self.dir, self._lock_fd)
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
            self.cleared = self._clear()
        except BaseException:
            self.close()
            raise

    def _clear(self) -> int:
        """Remove the files of an earlier run (their names, and their temporaries' `.NAME.tmp-*`) -> how many.
        ValueError naming --conversation-cache-dir when one cannot be removed."""
        n = 0
        for kind in KINDS:
            for old in [*self.dir.glob(f"{kind}-*.bin"), *self.dir.glob(f".{kind}-*.bin.tmp-*")]:
                try:
                    old.unlink()
                    n += 1
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise ValueError(f"--conversation-cache-dir {self.dir}: cannot remove {old.name!r} left by an "
                                     f"earlier run ({e.strerror or type(e).__name__})") from None
        return n

    def close(self) -> None:
        """Give the directory up (its lock); its files stay until the next DiskTier there removes them."""
        self._unlock()

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
        """The file's conversation read back (the read's errors propagate; ForeignFile when it holds other tokens
        than `node`'s); the file removed either way."""
        try:
            return self.peek(node)
        finally:
            self.remove(node)
            self.stats["restored"] += 1

    def peek(self, node: DiskNode) -> Conversation:
        """The file's conversation read, the file kept (the read's errors propagate; ForeignFile when it holds
        other tokens than `node`'s)."""
        conv = self._read(node.path)
        if conv.pos != node.pos or not same_ids(conv.tokens, node.tokens):
            raise ForeignFile(f"disk tier file {node.path.name!r} holds another conversation ({conv.pos} tokens) "
                              f"than the one written there ({node.pos} tokens): refused")
        return conv

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
