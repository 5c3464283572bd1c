"""What the checkpoint cache asks of a snapshot it keeps, whatever its tier (a strata.stages.sequence.Checkpoint
holding pages, its host copies, a DiskNode of the disk tier): its own bytes, whether it holds pages in a pool,
whether its keeper dropped it, and giving its pages back."""
from __future__ import annotations

__all__ = ["holds_pages", "is_gone", "release", "snapshot_bytes"]


def snapshot_bytes(snap) -> int:
    """The bytes a snapshot keeps of its own (its ``nbytes``, a method or a number; else its running state's)."""
    nb = getattr(snap, "nbytes", None)
    if callable(nb):
        return int(nb())
    if nb is not None:
        return int(nb)
    running = getattr(snap, "running", None) or {}
    return sum(int(a.nbytes) for parts in running.values() for a in parts.values())


def holds_pages(snap) -> bool:
    """Whether a snapshot holds pages in a pool (giving it back frees them): a Checkpoint with held parts."""
    return any(getattr(p, "is_held", False) or (hasattr(p, "ckpt_id") and not p.released and not p.gone)
               for p in getattr(snap, "parts", ()))


def is_gone(snap) -> bool:
    """Whether the snapshot's keeper dropped it on its own: a worker a part of it (a remote stage's RemotePart.gone),
    the disk tier its file (DiskNode.gone)."""
    return getattr(snap, "gone", False) or any(getattr(p, "gone", False) for p in getattr(snap, "parts", ()))


def release(snap) -> None:
    """Give back the pages a snapshot holds (a strata.stages.sequence.Checkpoint; other objects hold none)."""
    give_back = getattr(snap, "release", None)
    if callable(give_back):
        give_back()
