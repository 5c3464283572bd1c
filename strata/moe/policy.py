"""The expert tier's swap policy, one pure function: decayed usage counts per (layer, expert), the resident set and
its dwell times -> the swaps to make (the hottest non-resident experts in, the coldest resident ones out), with
hysteresis (a minimum dwell and a margin) and a cap on swaps per round.

Experts are numbered by their flat index ``layer_row * n_expert + expert`` over the stage's MoE layers, so every
array here is 1-D of the same length (the tier's layers times experts per layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Policy:
    """The tier's adaptation settings. every: decoded tokens between two rounds (--adapt-every); swaps: at most that
    many resident experts replaced per round (--adapt-swaps; filling a free slot replaces none); min_dwell: decoded tokens an expert stays resident after it
    came in before it may leave; margin: an expert comes in in place of a resident one only when its usage exceeds
    the resident one's by this fraction (and by at least one count: decayed counts of rarely used experts are
    noise); half_life: decoded tokens over which a usage count halves; prefill_weight: what a prompt token's routing
    counts in the usage beside a decoded token's 1 (the slots serve the decode steps: a prompt's routings counted
    fully pull them toward what the prompt used; docs/moe.md has the replay and GPU runs behind 0.1)."""

    every: int = 32
    swaps: int = 4
    min_dwell: int = 64
    margin: float = 0.25
    half_life: float = 256.0
    prefill_weight: float = 0.1

    def problem(self) -> str | None:
        """The one-line reason these settings are unusable (naming the flag), or None."""
        if self.every < 1:
            return f"--adapt-every must be >= 1, got {self.every}"
        if self.swaps < 0:
            return f"--adapt-swaps must be >= 0, got {self.swaps}"
        if self.min_dwell < 0:
            return f"min_dwell must be >= 0, got {self.min_dwell}"
        if not self.margin >= 0:
            return f"margin must be >= 0, got {self.margin}"
        if not self.half_life > 0:
            return f"half_life must be > 0, got {self.half_life}"
        if not self.prefill_weight >= 0:
            return f"prefill_weight must be >= 0, got {self.prefill_weight}"
        return None

    def decay(self, tokens: int) -> float:
        """The factor a usage count keeps over `tokens` decoded tokens."""
        return float(0.5 ** (max(0, int(tokens)) / self.half_life))


@dataclass(frozen=True)
class Swap:
    """Bring expert ``into`` (flat index) in; ``out``: the resident expert whose slot it takes, or None (a free
    slot)."""

    into: int
    out: int | None


def decayed(usage: np.ndarray, counts: np.ndarray, factor: float) -> np.ndarray:
    """usage * factor + counts (float64, a new array): the usage after a round in which `counts` routings were
    seen."""
    return np.asarray(usage, dtype=np.float64) * float(factor) + np.asarray(counts, dtype=np.float64)


def plan_swaps(usage: np.ndarray, resident: np.ndarray, dwell: np.ndarray, budget: int, policy: Policy,
               max_swaps: int | None = None) -> list[Swap]:
    """The swaps of one round.

    usage float (n,): decayed routing counts; resident bool (n,): experts in a slot (swaps in flight count as
    resident); dwell int (n,): decoded tokens since each resident expert came in; budget: the slots (resident
    experts never exceed it); max_swaps: the copies this round may make in all (the copy-rate cap), or None.

    Candidates in: non-resident experts with usage > 0, hottest first (ties: lower index). While free slots remain
    they fill them (bounded by max_swaps only: filling evicts nothing); then each takes the coldest resident expert
    that has dwelt at least policy.min_dwell (ties: lower index) as long as usage[in] > usage[out] * (1 + margin) and
    usage[in] >= usage[out] + 1, stopping at the first pair that fails (the later ones are colder in, hotter out), at
    most policy.swaps of these. No expert appears twice; deterministic in its inputs."""
    usage = np.asarray(usage, dtype=np.float64)
    resident = np.asarray(resident, dtype=bool)
    dwell = np.asarray(dwell)
    n = usage.shape[0]
    if resident.shape != (n,) or dwell.shape != (n,):
        raise ValueError(f"usage, resident and dwell must have one shape, got {usage.shape}, {resident.shape}, "
                         f"{dwell.shape}")
    cap = n if max_swaps is None else int(max_swaps)
    n_res = int(resident.sum())
    if cap <= 0 or budget <= 0:
        return []
    idx = np.arange(n)
    ins = idx[~resident & (usage > 0)]
    ins = ins[np.lexsort((ins, -usage[ins]))]                # hottest first, ties to the lower index
    outs = idx[resident & (dwell >= policy.min_dwell)]
    outs = outs[np.lexsort((outs, usage[outs]))]             # coldest first
    free = max(0, int(budget) - n_res)
    swaps: list[Swap] = []
    j = 0
    for e in ins.tolist():
        if len(swaps) >= cap:
            break
        if free > 0:
            swaps.append(Swap(int(e), None))
            free -= 1
            continue
        if j >= len(outs) or j >= policy.swaps:
            break
        o = int(outs[j])
        if not (usage[e] > usage[o] * (1.0 + policy.margin) and usage[e] >= usage[o] + 1.0):
            break
        swaps.append(Swap(int(e), o))
        j += 1
    return swaps


def hottest(usage: np.ndarray, budget: int) -> np.ndarray:
    """The `budget` experts of highest usage (ties: lower index), in that order: a static placement."""
    usage = np.asarray(usage, dtype=np.float64)
    order = np.lexsort((np.arange(usage.shape[0]), -usage))
    return order[:max(0, int(budget))]
