"""Conversation: a whole conversation held apart from the engine (tokens, one part per stage, its checkpoints) and how
deep it can resume a prompt."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from strata.memory import StatePart
from strata.text.token_ids import common_prefix, frozen_ids


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
    #: parked: the checkpoint tree's nodes on its path whose checkpoints it references (CheckpointTree.pin) in
    #: place of copies in ``checkpoints``; its keeper pins and unpins them (strata.cache.parked)
    pins: list = field(default_factory=list)

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

    def checkpoint_positions(self) -> list[int]:
        """Where it can resume short of its end: its own checkpoints' and its pinned tree nodes' positions (a node
        whose checkpoint the tree dropped anyway, a worker's part gone, left out)."""
        return [c.pos for c in self.checkpoints] + [n.pos for n in self.pins if n.value is not None]

    def depth(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's tokens this conversation can skip: its whole length when the prompt extends
        it (and its end may be continued), the longest common prefix when its K/V can be cut back anywhere (an
        attention-only model's, as the live sequence's is) and that prefix is at least CUT_MIN tokens and half the
        conversation (as llama.cpp's server picks a slot by prompt similarity: a chat template's first tokens are
        no reason to bring a conversation back), else its deepest checkpoint that is a prefix of the prompt; always
        shorter than the prompt (one token at least is read), 0 when nothing matches."""
        return self.depth_at(common_prefix(self.tokens, prompt), len(prompt))

    def depth_at(self, common: int, n: int) -> int:
        """``depth`` of an n-token prompt that shares its first `common` tokens with this conversation (no more)."""
        if self.live_ok and common == self.pos < n:
            return self.pos
        deepest = max((p for p in self.checkpoint_positions() if p <= common and p < n), default=0)
        if self.live_ok and self.cut_anywhere and common >= max(CUT_MIN, self.pos // 2):
            return max(deepest, min(common, n - 1))
        return deepest
