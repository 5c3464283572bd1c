"""A live sequence's conversation taken apart (as host copies with its checkpoints, or held where it is) and a
conversation made a sequence's again, its checkpoints kept in the tree: the moves parking and session files make."""
from __future__ import annotations

import structlog

from strata.cache import session
from strata.cache.checkpoints import CheckpointCache
from strata.cache.conversation import Conversation, SavedCheckpoint
from strata.cache.disk import DiskNode, DiskTier
from strata.memory import PartMismatch
from strata.stages.remote import CheckpointGone
from strata.stages.sequence import Checkpoint, Sequence

__all__ = ["as_host_copies", "in_place", "restore"]

log = structlog.get_logger("strata.engine")


def as_host_copies(seq: Sequence, checkpoints: CheckpointCache, stages: list, disk: DiskTier | None,
                   cut_anywhere: bool, *, on_disk: bool = False, pin: bool = False) -> Conversation:
    """`seq`'s conversation as host copies: every stage's used K/V and running state, its checkpoints (running state
    only where the stage can make the K/V a prefix of the conversation's); on_disk: those the tree keeps on disk (in
    `disk`) too, read back (a session file: the tree keeps them where they are, parking leaves them there); pin: the
    tree's checkpoints on its path pinned instead (``Conversation.pins``: to be parked). A checkpoint whose worker
    part is gone is dropped from the tree, one whose file cannot be read left out."""
    here = seq.capture()
    try:
        parts = seq.materialize(here)
    finally:
        here.release()
    if pin:
        return Conversation(tokens=seq.ids, parts=parts, live_ok=seq.live_ok, cut_anywhere=cut_anywhere,
                            pins=checkpoints.pin_path(seq.ids))
    cps = []
    for pos, kind, snap in checkpoints.export(seq.ids, on_disk=on_disk):
        try:
            if isinstance(snap, DiskNode):
                read = disk.peek(snap).parts
                cps.append(SavedCheckpoint(pos, kind, [st.memory.detach(p) for st, p in zip(stages, read)]))
            else:
                cps.append(SavedCheckpoint(pos, kind, seq.detach(snap)))
        except CheckpointGone:              # a worker dropped its part (its pool ran short): not kept either
            checkpoints.discard(snap)
        except (session.SessionError, OSError, ValueError) as e:   # its file unreadable: saved without it
            log.warning("a checkpoint on disk could not be read: not saved", error=str(e))
    return Conversation(tokens=seq.ids, parts=parts, checkpoints=cps, live_ok=seq.live_ok, cut_anywhere=cut_anywhere)


def in_place(seq: Sequence, checkpoints: CheckpointCache, cut_anywhere: bool) -> Conversation:
    """`seq`'s conversation parked where it is: every stage's pages held (nothing copied), its running state copied
    on the device (a remote stage: more references to the worker's parts), the tree's checkpoints on its path pinned
    (``Conversation.pins``), not copied."""
    here = seq.with_room(seq.capture)        # its pages held: nothing is copied
    return Conversation(tokens=seq.ids, parts=here.parts, live_ok=seq.live_ok, resident=True,
                        cut_anywhere=cut_anywhere, pins=checkpoints.pin_path(seq.ids))


def restore(seq: Sequence, conv: Conversation, checkpoints: CheckpointCache, spill=None) -> None:
    """Make `conv` `seq`'s conversation, its checkpoints kept in the tree (CheckpointCache.adopt, `spill` its disk
    tier's) (a resident one's pages become the sequence's too: nothing is copied but the running state, on the
    device; `conv` keeps its own hold until released). Every part is validated against its own stage first
    (PartMismatch / KVCacheFull, one line, change nothing); a pool short of pages first moves resident
    conversations to RAM (the sequence's make_room)."""
    whole = Checkpoint(pos=conv.pos, tokens=conv.tokens, parts=conv.parts)
    seq.with_room(lambda: seq.validate(whole))
    for c in conv.checkpoints:
        if not 0 < c.pos <= conv.pos:
            raise PartMismatch(f"a checkpoint at {c.pos} lies outside the conversation's {conv.pos} tokens")
        seq.validate_detached(c.pos, c.parts)
    seq.with_room(lambda: seq.restore(whole))   # a worker's pool short of pages: parts freed, then again
    seq.live_ok = conv.live_ok
    attached = []
    try:
        for c in conv.checkpoints:
            attached.append((c.pos, c.kind, seq.with_room(lambda c=c: seq.attach(c.pos, c.parts))))
    except BaseException:
        for _, _, snap in attached:
            snap.release()
        raise
    checkpoints.adopt(attached, spill=spill)
