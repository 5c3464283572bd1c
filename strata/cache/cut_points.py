"""Cut points: where a prompt's read ends a part and keeps a checkpoint (the chat template's points, checked; the
periodic and near-tail points the cache adds; those too near the previous checkpoint left out) and where its final
turn begins."""
from __future__ import annotations

__all__ = ["KINDS", "MIN_PART", "TEMPLATE_KINDS", "kept_points", "template_cuts", "turn_start"]

#: cut point kinds, in the order that names a checkpoint when several fall on one position
KINDS = ("root", "pin", "turn", "message", "tail", "periodic")
#: tokens from the previous checkpoint (one kept before the read, or one this read keeps) within which a message end,
#: periodic or near-tail cut point ends no part (a forward call costs more than the tokens it would save; numbers in
#: docs/checkpoints.md); the root, a client's pin and the turn point stay cut points wherever they fall
MIN_PART = 16
#: the kinds a chat template's rendering gives (the others the cache adds)
TEMPLATE_KINDS = ("root", "message", "turn", "pin")
_RANK = {k: i for i, k in enumerate(KINDS)}


def _cut(cp) -> tuple[int, str]:
    """(pos, kind) of a CutPoint (strata.text.chat_template.CutPoint, a (pos, kind[, index]) tuple or a dict)."""
    if isinstance(cp, dict):
        return int(cp["pos"]), str(cp["kind"])
    if hasattr(cp, "pos") and hasattr(cp, "kind"):
        return int(cp.pos), str(cp.kind)
    return int(cp[0]), str(cp[1])


def turn_start(cut_points, n: int) -> int:
    """Where a prompt of n tokens begins its final turn: its last "turn" or "message" cut point (the generation
    prompt's start, the last message's end), else n (a raw prompt: the answer follows it)."""
    ends = [p for p, kind in map(_cut, cut_points or ()) if kind in ("turn", "message") and 0 < p <= n]
    return max(ends, default=n)


def template_cuts(cut_points, n: int) -> list[tuple[int, str]]:
    """A chat template's cut points (CutPoint objects, (pos, kind[, index]) tuples or dicts) of a prompt of n tokens as
    (pos, kind), in their order. ValueError (one line) for a kind outside TEMPLATE_KINDS or a position outside
    [0, n]."""
    cuts = []
    for cp in cut_points or ():
        p, kind = _cut(cp)
        if kind not in TEMPLATE_KINDS:
            raise ValueError(f"unknown cut point kind {kind!r} (expected one of {', '.join(TEMPLATE_KINDS)})")
        if not 0 <= p <= n:
            raise ValueError(f"cut point {kind} at {p} is outside the prompt [0, {n}]")
        cuts.append((p, kind))
    return cuts


def kept_points(cuts: list[tuple[int, str]], n: int, resume: int, prev: int, *, checkpoint: bool, every: int,
                tail: int, root_min: int, min_part: int) -> dict[int, str]:
    """The cut points of a prompt of n tokens read from `resume` at which a part ends and a checkpoint is kept ->
    {pos: kind}, by position. cuts: template_cuts' points. checkpoint: the template's points, periodic points every
    `every` tokens (absolute positions k * every; 0: none) and the near-tail point n - `tail` (0: none); else only a
    client's pin and the root (when it is at least `root_min` long). Points at or before `resume`, before the root or
    past n are dropped; one position of several kinds is named by the first in KINDS. A message end, periodic or
    near-tail point within `min_part` tokens of the previous checkpoint (`prev`, the deepest one kept on the prompt's
    path at or before `resume`, then each point kept) ends no part; the root, a pin and the turn point always do."""
    roots = [p for p, k in cuts if k == "root"]
    root = max(roots) if roots else 0
    cand: list[tuple[int, str]] = []
    if checkpoint:
        cand += cuts
        if every:
            cand += [(p, "periodic") for p in range(every, n, every)]
        if tail and n - tail > 0:
            cand.append((n - tail, "tail"))
    else:
        cand += [(p, k) for p, k in cuts if k == "pin"]
        if roots and root >= root_min:
            cand.append((root, "root"))
    out: dict[int, str] = {}
    held: set[int] = set()          # points kept however near the previous checkpoint (see MIN_PART)
    for p, k in cand:
        if p <= resume or p <= 0 or p < root or p > n:
            continue
        if k in ("root", "pin", "turn"):
            held.add(p)
        if p not in out or _RANK[k] < _RANK[out[p]]:
            out[p] = k
    # a checkpoint saves the tokens since the previous one (kept before this read on the prompt's path, or kept by it)
    kept: dict[int, str] = {}
    for p in sorted(out):
        if p in held or p - prev >= min_part:
            kept[p], prev = out[p], p
    return kept
