"""PrefillPlan: how the engine reads one prompt (where it resumes, the parts it reads, the checkpoints it saves),
as CheckpointCache.plan decides it and ConversationStore.resume applies it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PrefillPlan:
    """How the engine reads one prompt.

    resume_pos: tokens of the prompt already in place before reading (0 <= resume_pos < len(prompt)).
    resume_from: "live" (the live sequence is a prefix of the prompt: read only the new tokens),
    "checkpoint" (restore ``snapshot`` first, then read from its position) or "none" (reset the sequence,
    read from 0). snapshot: the strata.stages.sequence.Checkpoint to restore when resume_from == "checkpoint", else None.
    part_ends: ascending positions where a part of the read ends (the last is len(prompt)); the engine
    reads [resume_pos, part_ends[0]), [part_ends[0], part_ends[1]), ... each in ubatch-sized forward calls.
    save_at: part end -> cut point kind: after the part ending there, save ``state.capture()`` with
    ``cache.save(pos, kind, snapshot)``. keep_live: False when the request opted out of checkpoints:
    the engine leaves no live session (the next request does not continue it). key: the kept checkpoint's key
    when resume_from == "checkpoint" (``CheckpointCache.begin`` re-dates it). continues: the read goes on from where
    the sequence stood, as a live continuation does (also when a parked conversation, a session or another slot's
    prefix was put in place first and resume_from names that source; set from resume_from "live" when the plan is
    made, kept when resume_from is renamed): read as a live continuation is, so that its
    bits on a GPU do not depend on where the state came from.
    """

    resume_pos: int
    resume_from: str
    snapshot: Any
    part_ends: list[int]
    save_at: dict[int, str]
    keep_live: bool = True
    key: int | None = None
    continues: bool = False

    def __post_init__(self) -> None:
        self.continues = self.continues or self.resume_from == "live"

    @property
    def reset(self) -> bool:
        """True when the sequence must be reset to position 0 before reading."""
        return self.resume_from == "none"

    def describe(self) -> str:
        """One line for logs: where the read starts and its parts."""
        parts, start = [], self.resume_pos
        for e in self.part_ends:
            parts.append(f"[{start},{e})" + (f"+{self.save_at[e]}" if e in self.save_at else ""))
            start = e
        return f"resume {self.resume_pos} ({self.resume_from}) parts {' '.join(parts)}"
