"""Conversation checkpoints: where to resume a prompt, which parts to read, which checkpoints to save and keep (a
prefix tree of them, many branches at once)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.cache.cut_points import KINDS, MIN_PART, kept_points, template_cuts
from strata.cache.lookup import Found, lookup
from strata.cache.plan import PrefillPlan
from strata.cache.retention import Item, Kept, checkpoint_items, evict, pinned_root
from strata.cache.snapshot import holds_pages, is_gone, release, snapshot_bytes
from strata.cache.tree import CheckpointTree, Node
from strata.text.token_ids import as_ids, common_prefix, frozen_ids, is_prefix

__all__ = ["CheckpointCache", "PrefillPlan", "KINDS", "common_prefix"]


@dataclass
class _Entry:
    pos: int
    kind: str
    snapshot: Any
    ids: np.ndarray | None      # read-only int32 (strata.text.token_ids): compared with numpy, never token by token;
    #                             None: its node's path in the tree gives them (a snapshot keeping no ids of its own)
    bytes: int
    saved: int
    last_use: int
    last_use_time: float
    key: int = 0
    node: Node | None = None
    mounts: int = 0
    tier: str = "device"        # "device": its pages held in the pools; "ram": host copies (demoted by make_room);
    #                             "disk": a file of the disk tier (a DiskNode: spilled by the byte budget)

    @property
    def tokens(self) -> np.ndarray:
        return self.ids if self.ids is not None else self.node.tokens()


def _state_ids(state) -> np.ndarray:
    """The token ids a sequence holds, as int32 (a strata.stages.sequence.Sequence's ``ids`` view, no copy)."""
    ids = getattr(state, "ids", None)
    return ids if ids is not None else as_ids(state.tokens)


class CheckpointCache:
    """The engine's conversation checkpoints: a prefix tree of them (strata.cache.tree), many branches at once.

    cap: ``--prompt-cache N``, checkpoints kept at most (0: none, reads are "live" or from 0 in one part;
    1: no pin, plain first-in-first-out, the old behaviour; >= 2: the root is pinned, the rest LRU).
    every: ``--prompt-cache-every`` tokens between periodic cut points (0: none). root_min:
    ``--prompt-cache-root``, the minimum root length (tokens) worth pinning. budget_bytes:
    ``--prompt-cache-mib`` in bytes, a hard cap on the checkpoints' own memory (see retention). tail: the
    distance (tokens) of the near-tail cut point from the prompt's end (0: none). min_part: see MIN_PART (0: every
    cut point ends a part).

    Each checkpoint holds its own KV pages (reference-counted in the stages' pools), so it stays valid whatever
    the live sequence does: a checkpoint that is not a prefix of the next prompt is kept for a later one (a
    sub-agent's turn survives its parent's next one). The cache owns every snapshot it keeps and gives its pages
    back (Checkpoint.release) whenever it drops one: retention's victims, one replaced at the same tokens,
    ``clear``, ``adopt`` over it, ``make_room`` when a pool is short. Thread-safe (one lock); the engine calls
    plan/save from its thread, ``entries``/``stats`` may be called from any (views: they never wait on a
    change in progress). Raises ValueError (one line) for
    bad numbers; nothing changes then.
    """

    def __init__(self, cap: int = 6, every: int = 0, root_min: int = 0, budget_bytes: int = 1024 << 20,
                 tail: int = 0, min_part: int = MIN_PART):
        for name, v in (("cap (--prompt-cache)", cap), ("every (--prompt-cache-every)", every),
                        ("root_min (--prompt-cache-root)", root_min), ("budget_bytes (--prompt-cache-mib)",
                                                                        budget_bytes),
                        ("tail", tail), ("min_part", min_part)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        self.cap = cap
        self.every = every
        self.root_min = root_min
        self.budget_bytes = budget_bytes
        self.tail = tail
        self.min_part = min_part
        self._tree = CheckpointTree()
        self._entries: dict[int, _Entry] = {}          # key -> entry (each at its node of the tree)
        self._clock = 0
        self._keys = 0
        self._lock = self._tree.lock        # shared with the tree's other keeper (the parked conversations)
        self._stats = dict(hits=0, hits_live=0, hits_checkpoint=0, misses=0, tokens_saved=0, saves=0,
                           evictions=0, replaced=0, demoted=0, spilled=0)
        self._tree.add_view("checkpoints", self._entries_now)    # for readers on other threads (entries, stats,
        self._tree.add_view("branches", self._tree.branches)      # branches): CheckpointTree.view
        self._tree.add_view("checkpoint_stats", lambda: dict(self._stats))

    @property
    def tree(self) -> CheckpointTree:
        """The prefix tree the checkpoints are kept in (its "value" slot); the parked conversations keep its
        "parked" slot under the same lock."""
        return self._tree

    # ---- the request loop ------------------------------------------------------------------------
    def plan(self, state, prompt_tokens, cut_points, *, checkpoint: bool = True,
             cache_prompt: bool = True, found: Found | None = None) -> PrefillPlan:
        """Decide how to read ``prompt_tokens`` on ``state`` (a strata.stages.sequence.Sequence: its token ids).
        Pure: nothing changes until ``begin(plan)``, which the reader calls once it applied the plan.

        Whether ``state``'s end may be continued is its own ``live_ok`` (a Sequence's; True when it has none).
        Resume rules, first that applies:

        1. cache_prompt=False (llama.cpp's meaning): reuse nothing, read from 0 (the kept checkpoints stay).
        2. live: the previous request left a live session (its checkpoint flag was not False) and
           ``state.tokens`` is a non-empty, strictly shorter prefix of the prompt: read only the new tokens.
           Or, on a sequence that can be cut back (attention-only: ``state.can_truncate``), the longest common
           prefix of the two (at most len(prompt) - 1) when it is deeper than every usable checkpoint: the
           engine cuts the K/V back there and reads the rest (llama.cpp's server does the same), for chat and
           raw prompts alike.
        3. checkpoint: the deepest kept checkpoint, shorter than the prompt, whose tokens are a prefix of the
           prompt, on whichever branch of the tree (its pages are its own). Never the full prompt: one token at
           least is read so there are logits; a checkpoint at len(prompt) steps back to the next shallower one.
           Mounting re-dates it.
        4. none: read from 0 (the engine resets the sequence).

        A resume point that is not a saved cut point splits the read where the first read did not. The CPU
        kernels give the same bits for any split of tokens into calls, so a request sent twice still answers
        the same; on a GPU the same greedy tokens wherever the top-2 margin is not a near tie.

        Parts: the kept cut points after the resume point (a message end, periodic or tail point only at least
        min_part tokens after the previous checkpoint on the prompt's path), de-duplicated, plus len(prompt).
        Kept: the template's root / message / turn / pin points, periodic points every ``every`` tokens
        (absolute positions k*every) and the near-tail point len(prompt) - tail. Points shallower than the root
        are dropped (the root is the shallowest checkpoint a chat saves, so it is the tree's root).
        checkpoint=False: only the root (when it is at least root_min long) and a client pin
        are kept, so the prompt after the reused prefix is read in one part; keep_live is False. cap 0:
        no cut points at all, one part. A checkpoint is saved at every kept cut point.

        prompt_tokens: token ids (a list, or an int32 array: no per-token work then), non-empty. cut_points:
        CutPoint(pos, kind, index) objects (or (pos, kind) tuples) with 0 <= pos <= len(prompt) and kind in
        root/message/turn/pin. Raises ValueError (one line), changing nothing, for an empty prompt or a bad cut
        point. found: the tree's lookup of this prompt (strata.cache.lookup), used while it is current (the tree
        walked once), else the tree is walked again.
        """
        prompt = as_ids(prompt_tokens)
        n = int(prompt.shape[0])
        if n == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        cuts = template_cuts(cut_points, n)
        checkpoint = bool(checkpoint)
        cache_prompt = bool(cache_prompt)
        state_tokens = _state_ids(state)

        with self._lock:
            found = self._found(prompt, found)
            resume, source, best = self._choose(found, state_tokens, state) if cache_prompt else (0, "none", None)
            points = self._kept_points(found, cuts, resume, checkpoint)
        return PrefillPlan(resume_pos=resume, resume_from=source, snapshot=best.snapshot if best else None,
                           part_ends=sorted(p for p in points if p < n) + [n], save_at=dict(sorted(points.items())),
                           keep_live=checkpoint, key=best.key if best else None)

    def begin(self, plan: PrefillPlan, state=None) -> None:
        """The reader applied `plan` to `state` (restored, cut or reset the sequence): the checkpoint it mounted is
        re-dated for retention, the hit or miss counted, and whether the sequence's read may be continued live set
        on it (``state.live_ok = plan.keep_live``)."""
        if state is not None:
            state.live_ok = bool(plan.keep_live)
        with self._lock:
            e = self._entries.get(plan.key) if plan.key is not None else None
            if e is not None:
                self._clock += 1
                e.last_use, e.last_use_time = self._clock, time.time()
                e.mounts += 1
            if plan.resume_from == "none":
                self._stats["misses"] += 1
            else:
                self._stats["hits"] += 1
                self._stats["hits_" + plan.resume_from] += 1
                self._stats["tokens_saved"] += plan.resume_pos

    def _found(self, prompt: np.ndarray, found: Found | None) -> Found:
        """(under the lock) `found` while it is the tree's current lookup of `prompt`, else a new one."""
        return found if found is not None and found.current(prompt) else lookup(self._tree, prompt)

    def _choose(self, found: Found, state_tokens: np.ndarray, state=None) -> tuple[int, str, Any]:
        """Rules 2-4 of ``plan``: (resume position, "live" | "checkpoint" | "none", the checkpoint entry or None).
        found: the tree's lookup of the prompt; state_tokens: an int32 array."""
        prompt = found.ids
        n, L = int(prompt.shape[0]), int(state_tokens.shape[0])
        live_ok = bool(getattr(state, "live_ok", True))
        if live_ok and 0 < L < n and is_prefix(state_tokens, prompt):
            return L, "live", None
        best = found.checkpoint.value if found.checkpoint is not None else None  # shorter than the prompt
        # an attention-only sequence cuts its K/V back to the longest common prefix (at most n - 1: one token is
        # read for the logits) when that skips more than any checkpoint does
        can_cut = getattr(state, "can_truncate", None)
        if live_ok and can_cut is not None and L > 0:
            k = min(common_prefix(prompt, state_tokens), n - 1)
            if k > (best.pos if best is not None else 0) and can_cut(k):
                return k, "live", None
        return (best.pos, "checkpoint", best) if best is not None else (0, "none", None)

    def peek(self, state, prompt_tokens, cache_prompt: bool = True, found: Found | None = None) -> int:
        """The position ``plan`` would resume ``prompt_tokens`` at on ``state`` now (no side effects); found: the
        tree's lookup of the prompt, as ``plan`` takes it."""
        if not cache_prompt:
            return 0
        with self._lock:
            return self._choose(self._found(as_ids(prompt_tokens), found), _state_ids(state), state)[0]

    def deepest(self, tokens) -> int:
        """The deepest kept checkpoint on the path of `tokens` (a conversation's ids; 0 when none is kept)."""
        with self._lock:
            return max((nd.pos for nd in self._tree.path(tokens)), default=0)

    def export(self, tokens, on_disk: bool = False) -> list[tuple[int, str, Any]]:
        """The kept checkpoints in memory (on_disk: and on disk, DiskNodes) on the path of `tokens` (the
        conversation's ids) as (pos, kind, snapshot), by position (to park or save them with their conversation;
        the cache keeps them)."""
        with self._lock:
            return [(nd.pos, nd.value.kind, nd.value.snapshot) for nd in self._tree.path(tokens)
                    if on_disk or nd.value.tier != "disk"]

    def adopt(self, entries: list[tuple[int, str, Any]], spill=None) -> None:
        """Keep `entries` ((pos, kind, snapshot) of a conversation a sequence now holds, as ``export`` gives
        them; the cache owns their snapshots from here, see ``save``) beside the other branches, each replacing
        one kept at the same tokens."""
        with self._lock:
            for pos, kind, snap in sorted(entries, key=lambda x: x[0]):
                self._put(kind, snap, frozen_ids(snap.tokens))
            self._retain(spill)                 # this engine's --prompt-cache / --prompt-cache-mib apply

    def _kept_points(self, found: Found, cuts: list[tuple[int, str]], resume: int,
                     checkpoint: bool) -> dict[int, str]:
        """Cut points after `resume` at which to end a part and save a checkpoint -> {pos: kind} (found: the tree's
        lookup of the prompt; strata.cache.cut_points.kept_points with this cache's numbers)."""
        if self.cap == 0:
            return {}
        return kept_points(cuts, int(found.ids.shape[0]), resume, found.deepest_checkpoint(resume),
                           checkpoint=checkpoint, every=self.every, tail=self.tail, root_min=self.root_min,
                           min_part=self.min_part)

    def save(self, pos: int, kind: str, snapshot, spill=None) -> list[int]:
        """Keep ``snapshot`` (a strata.stages.sequence.Checkpoint taken at ``pos``) as a checkpoint of kind ``kind``.

        One kept at the same tokens is replaced; then retention (strata.cache.retention) evicts: the count's
        victims are dropped, the byte budget's are handed to `spill` (snapshot -> the same checkpoint in a lower
        tier, a DiskNode, or None: dropped) when given. Returns the positions evicted (spilled ones stay kept).
        With cap 0 nothing is kept. Raises ValueError (one line),
        keeping nothing, for an unknown kind, pos <= 0, or a snapshot taken at another position. The cache owns
        the snapshot from here: its pages are given back (Checkpoint.release) when it is dropped (evicted,
        replaced, cleared, make_room) or refused.
        """
        spos = getattr(snapshot, "pos", None)
        tokens = frozen_ids(getattr(snapshot, "tokens", ()))
        why = None
        if kind not in KINDS:
            why = f"unknown checkpoint kind {kind!r} (expected one of {', '.join(KINDS)})"
        elif isinstance(pos, bool) or not isinstance(pos, int) or pos <= 0:
            why = f"a checkpoint position must be an integer > 0, got {pos!r}"
        elif spos != pos or len(tokens) != pos:
            why = f"the snapshot was taken at position {spos} with {len(tokens)} tokens, not at {pos}"
        if why is not None:
            release(snapshot)
            raise ValueError(why)
        with self._lock:
            if self.cap == 0:
                release(snapshot)
                return []
            self._put(kind, snapshot, tokens)
            self._stats["saves"] += 1
            return self._retain(spill)

    def _put(self, kind: str, snapshot, tokens: np.ndarray) -> None:
        """Keep `snapshot` at `tokens` (under the lock), releasing one it replaces there."""
        self._clock += 1
        self._keys += 1
        e = _Entry(pos=len(tokens), kind=kind, snapshot=snapshot, ids=tokens, bytes=snapshot_bytes(snapshot),
                   saved=self._clock, last_use=self._clock, last_use_time=time.time(), key=self._keys)
        e.node, old = self._tree.put(tokens, e)
        self._entries[e.key] = e
        if old is not None:
            del self._entries[old.key]
            release(old.snapshot)
            self._stats["replaced"] += 1

    #: the budgets of the two eviction passes (strata.cache.retention.evict) the checkpoints take part in: the count
    #: (--prompt-cache, the unheld ones, whatever their tier) and host memory (--prompt-cache-mib)
    COUNT, BYTES = "prompt-cache", "prompt-cache-mib"

    def budgets(self) -> dict[str, int | None]:
        return {self.COUNT: self.cap, self.BYTES: self.budget_bytes}

    def items(self, budget: str) -> list[Item]:
        """(under the lock) The checkpoints as items of the eviction pass over `budget` (COUNT: every one, each
        unheld costing 1; BYTES: those in memory, each costing its own bytes), by the checkpoint policy
        (retention.checkpoint_items: the pinned root last, the held ones after it), ordered by last use
        (last_use_time, ties by the logical clock): keys ("checkpoint", key)."""
        kept = [k for k in self._kept() if budget == self.COUNT or self._entries[k.id].tier != "disk"]
        root = pinned_root([k for k in kept if not k.held], self.cap, self.root_min)
        when = {e.key: e.last_use_time for e in self._entries.values()}
        out = checkpoint_items(kept, self.cap, root, count=self.COUNT if budget == self.COUNT else None,
                               nbytes=self.BYTES if budget == self.BYTES else None,
                               clock=lambda k: (when[k.id], k.last_use))
        return [Item(("checkpoint", it.key), it.order, it.costs, it.by, it.stage) for it in out]

    def evicted(self, keys, budget: str, spill=None) -> list[int]:
        """(under the lock) Act on the eviction pass's victims `keys` (their ids without the "checkpoint" tag) over
        `budget` -> the positions dropped. COUNT: dropped, whatever their tier. BYTES: moved to the disk tier through
        `spill` when it takes them, else dropped, except a held one, which then stays."""
        gone = []
        for k in keys:
            e = self._entries.get(k)
            if e is None:
                continue
            node = None
            if budget == self.BYTES and spill is not None:
                try:
                    node = spill(e.snapshot, e.last_use_time)
                except Exception:  # noqa: BLE001 -- a spill that fails leaves the drop
                    node = None
            if node is None and budget == self.BYTES and e.node.pins:
                continue                        # held by a parked conversation: it stays where it is
            if node is None:
                gone.append(e.pos)
                self._drop(k)
                continue
            release(e.snapshot)
            e.snapshot, e.bytes, e.tier, e.ids = node, 0, "disk", e.tokens
            self._stats["spilled"] += 1
        self._stats["evictions"] += len(gone)
        return gone

    def _retain(self, spill=None) -> list[int]:
        """(under the lock) The checkpoints' two eviction passes (the count, then host memory; see ``evicted``) ->
        the positions dropped."""
        gone: list[int] = []
        if not self._entries:
            return gone
        for budget in (self.COUNT, self.BYTES):
            victims = evict(self.items(budget), self.budgets())
            gone += self.evicted([key[1] for key, _ in victims], budget, spill)
        return gone

    def held_snapshots(self, tokens=None) -> list[tuple[Any, np.ndarray, Node]]:
        """(snapshot, tokens, node) of the checkpoints in host RAM (tier "ram"; on the path of `tokens` when
        given)."""
        with self._lock:
            es = [nd.value for nd in self._tree.path(tokens)] if tokens is not None else list(self._entries.values())
            return [(e.snapshot, e.tokens, e.node) for e in es if e.tier == "ram"]

    def device_held(self) -> list[tuple[Any, np.ndarray, Node]]:
        """(snapshot, tokens, node) of the checkpoints a parked conversation holds whose pages are on the devices."""
        with self._lock:
            return [(e.snapshot, e.tokens, e.node) for e in self._entries.values()
                    if e.node.pins and e.tier == "device" and holds_pages(e.snapshot) and not is_gone(e.snapshot)]

    def rehome(self, snapshot, copy, tier: str, own_ids: bool = True) -> None:
        """The checkpoint whose snapshot is `snapshot` keeps `copy` (the same checkpoint in `tier`) in its place,
        the pages `snapshot` held given back; its bytes counted against the byte budget at the next retention.
        own_ids=False: `copy` keeps no token ids (its node's path gives them), the checkpoint none either."""
        with self._lock:
            for e in self._entries.values():
                if e.snapshot is snapshot:
                    self._stats["demoted"] += e.tier == "device" and tier != "device"
                    if own_ids and e.ids is None:
                        e.ids = frozen_ids(copy.tokens)
                    elif not own_ids:
                        e.ids = None
                    e.snapshot, e.bytes, e.tier = copy, snapshot_bytes(copy), tier
                    release(snapshot)

    def promote(self, snapshot, copy) -> None:
        """The checkpoint whose snapshot is `snapshot` (a DiskNode read back) keeps `copy` (its host copies) in its
        place, tier "ram" (its bytes counted against the byte budget again at the next retention)."""
        with self._lock:
            for e in self._entries.values():
                if e.snapshot is snapshot:
                    e.snapshot, e.bytes, e.tier = copy, snapshot_bytes(copy), "ram"

    def make_room(self, live_ids, off_path: bool = False, spare=None, demote=None, spill=None,
                  held: bool | None = None, skip=frozenset()) -> bool:
        """Give back one checkpoint's pages when a pool is short: the least recently used of those holding pages that
        are not a prefix of ``live_ids`` (the live sequence's tokens: their pages are the sequence's too), then
        (unless off_path) of the rest, never the one whose snapshot is `spare` (being restored); held: only those
        a parked conversation holds (True) or none holds (False), None: either; never one at a node in `skip` (ids of
        nodes: those a resident conversation pins, which stay on the device with it). With `demote` (snapshot -> the same
        checkpoint as host copies, or None), it moves to host RAM (its tier "ram": restored from there on a hit, its
        bytes counted against the byte budget) instead of being dropped. -> False when none holds pages any more."""
        live = as_ids(live_ids)
        with self._lock:
            cand = [(is_prefix(e.tokens, live), e.last_use, e.key) for e in self._entries.values()
                    if (spare is None or e.snapshot is not spare) and holds_pages(e.snapshot)
                    and (held is None or bool(e.node.pins) == held) and id(e.node) not in skip]
            cand = [c for c in cand if not (off_path and c[0])]
            if not cand:
                return False
            e = self._entries[min(cand)[2]]
            copy = None
            if demote is not None:
                try:
                    copy = demote(e.snapshot)
                except Exception:  # noqa: BLE001 -- a copy that fails leaves the drop
                    copy = None
            if copy is None:
                self._drop(e.key)
                self._stats["evictions"] += 1
                return True
            release(e.snapshot)
            e.snapshot, e.bytes, e.tier = copy, snapshot_bytes(copy), "ram"
            self._stats["demoted"] += 1
            self._retain(spill)                # host copies count against the byte budget
            return True

    def pin_path(self, tokens) -> list[Node]:
        """Pin the nodes on the path of `tokens` (a conversation being parked) that keep a checkpoint, in any tier
        -> them, shallowest first: the conversation references these checkpoints instead of copying them, and
        retention keeps them while it does (``unpin``)."""
        with self._lock:
            nodes = self._tree.path(tokens)
            for nd in nodes:
                self._tree.pin(nd)
            return nodes

    def unpin(self, nodes) -> None:
        """Give back the pins ``pin_path`` took (a parked conversation dropped or made live again); the checkpoints
        stay, counted by --prompt-cache again from the next retention."""
        with self._lock:
            for nd in nodes:
                self._tree.unpin(nd)

    def drop_gone(self) -> int:
        """Drop the checkpoints a worker dropped a part of (their other parts' pages given back) -> how many."""
        with self._lock:
            gone = [k for k, e in self._entries.items() if is_gone(e.snapshot)]
            for key in gone:
                self._drop(key)
            self._stats["evictions"] += len(gone)
            return len(gone)

    def discard(self, snapshot) -> None:
        """Drop the checkpoint whose snapshot is `snapshot` (one a worker no longer holds), its pages given back."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.snapshot is snapshot]:
                self._drop(key)
                self._stats["evictions"] += 1

    def _drop(self, key: int) -> None:
        """Forget the checkpoint `key` and give back the pages it holds (under the lock)."""
        e = self._entries.pop(key)
        self._tree.remove(e.node)
        release(e.snapshot)

    # ---- visibility ------------------------------------------------------------------------------
    def _kept(self) -> list[Kept]:
        return [Kept(pos=e.pos, kind=e.kind, last_use=e.last_use, bytes=e.bytes, saved=e.saved, key=e.key,
                     held=e.node.pins > 0) for e in self._entries.values()]

    def entries(self) -> list[dict]:
        """The kept checkpoints by position (then save order): dicts with pos (tokens), kind, bytes, last_use
        (logical clock, larger = more recent), last_use_time (Unix seconds), mounts (times restored), tier, pinned
        (bool: the root retention keeps), pins (how many parked conversations hold it: outside --prompt-cache). A view (CheckpointTree.view): never held up by slow work under the lock (then the one just before it)."""
        return [dict(e) for e in self._tree.view("checkpoints")]

    def _entries_now(self) -> tuple[dict, ...]:
        pin = pinned_root([k for k in self._kept() if not k.held], self.cap, self.root_min)
        return tuple(dict(pos=e.pos, kind=e.kind, bytes=e.bytes, last_use=e.last_use,
                          last_use_time=e.last_use_time, mounts=e.mounts, tier=e.tier,
                          pinned=pin is not None and pin.key == e.key, pins=e.node.pins)
                     for e in sorted(self._entries.values(), key=lambda e: (e.pos, e.saved)))

    def branches(self) -> int:
        """How many branches of history the kept checkpoints span (the tree's leaves); a view, as ``entries``."""
        return self._tree.view("branches")

    def stats(self) -> dict:
        """Counters since start: hits (plans that reused a prefix; hits_live + hits_checkpoint), misses,
        tokens_saved (prompt tokens not read thanks to a hit), saves, evictions (retention and make_room),
        replaced (a checkpoint saved again at the same tokens), demoted (moved to host RAM by make_room), spilled
        (moved to the disk tier by the byte budget). A view, as ``entries``."""
        return dict(self._tree.view("checkpoint_stats"))

    def clear(self, held: bool = True) -> None:
        """Drop every checkpoint (held False: every one no parked conversation holds), its pages given back
        (counters stay). A held one dropped stays pinned by its conversations, which then skip it."""
        with self._lock:
            for k, e in list(self._entries.items()):
                if held or not e.node.pins:
                    self._drop(k)

    def __len__(self) -> int:
        return len(self._entries)
