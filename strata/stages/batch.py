"""The batched steps over live sequences: the decode step, one token of each of N sequences through every stage in
one forward per stage (StageBase.forward_batch), and the batched verify, each sequence's speculative verify through
every stage together (StageBase.verify_batch); each row bit-identical to that sequence's own read."""
from __future__ import annotations

import time
from typing import Sequence as Seq

import numpy as np

from strata.stages.sequence import Sequence


def decode_batch(seqs: Seq[Sequence], tokens, x_in=None, hidden: bool = False, on_device: bool = False):
    """Read tokens[i] as the next token of seqs[i] (distinct live sequences over the same stages) -> the last
    stage's logits, host float32 (N, n_vocab), row i bit-identical to ``seqs[i].forward([tokens[i]])`` (a worker's
    stages: the hidden states (N, n_embd) of its last carve; x_in: the rows its first stage starts from). hidden:
    (those logits, the last stage's final-normed rows (N, n_embd)), row i as ``seqs[i].forward([tokens[i]],
    hidden=True)`` gives it (the MTP drafters'). on_device: the logits may stay on the last stage's device (a
    backend array of its own) where its runner keeps them there; host rows elsewhere.

    Pages for one more token are reserved for every sequence on every stage first (each sequence's ``make_room``
    when a pool is short; KVCacheFull, changing nothing but the extra pages reserved, when nothing more can be
    freed). ValueError, changing nothing, for a count mismatch, a repeated sequence or sequences over other stages.
    """
    seqs = list(seqs)
    toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
    if not seqs or toks.shape[0] != len(seqs):
        raise ValueError(f"a batched step takes one token per sequence (got {toks.shape[0]} tokens for "
                         f"{len(seqs)} sequences)")
    stages = _shared_stages(seqs, "step")
    for s in seqs:
        s.reserve(1)
    x = x_in
    try:
        for k, st in enumerate(stages):
            kw = {"hidden": True} if hidden and st.last else {}
            if on_device and st.last:
                kw["on_device"] = True
            x = st.forward_batch(toks, [s.sids[k] for s in seqs], x_in=x, **kw)
    finally:
        now = time.monotonic()
        for s in seqs:
            s.forward_returned = now
    for i, s in enumerate(seqs):
        s.record(toks[i:i + 1])
    return x


def verify_batch(seqs: Seq[Sequence], token_lists) -> list[tuple]:
    """Speculative verifies of several live sequences in one pass per stage: token_lists[i] (the sampled token and
    its drafts) read by seqs[i], every stage keeping each token's state (``Sequence.verify``'s contract for each) ->
    [(logits of seqs[i]'s rows (n_i, n_vocab) host float32, its final-normed rows)], each row bit-identical to
    ``seqs[i].verify(token_lists[i])``'s. Pages for every sequence's tokens are reserved and every sequence armed
    first (KVCacheFull from a reserve: pages reserved for the others stay reserved, which is harmless); each
    sequence's ``commit`` then settles its own accepted count. ValueError for a count mismatch, a repeated sequence
    or sequences over other stages."""
    seqs = list(seqs)
    lists = [np.asarray(t, dtype=np.int32).reshape(-1) for t in token_lists]
    if not seqs or len(lists) != len(seqs) or any(t.shape[0] == 0 for t in lists):
        raise ValueError(f"a batched verify takes some tokens for each sequence (got {len(lists)} token lists for "
                         f"{len(seqs)} sequences)")
    stages = _shared_stages(seqs, "verify")
    for s, t in zip(seqs, lists):
        s.reserve(int(t.shape[0]))
        s.keep(int(t.shape[0]))
    x = None
    try:
        for k, st in enumerate(stages):
            x = st.verify_batch(lists, [s.sids[k] for s in seqs], x_in=x)
    finally:
        now = time.monotonic()
        for s in seqs:
            s.forward_returned = now
    logits, h = x
    out, at = [], 0
    for s, t in zip(seqs, lists):
        n = int(t.shape[0])
        s.record(t)
        out.append((logits[at:at + n], h[at:at + n]))
        at += n
    return out


def _shared_stages(seqs: list, what: str) -> list:
    """The stages every one of `seqs` (distinct sequences) runs over; ValueError naming the batched `what` for a
    repeated sequence or sequences over other stages."""
    if len({id(s) for s in seqs}) != len(seqs):
        raise ValueError(f"a batched {what} reads each sequence at most once")
    stages = seqs[0].stages
    if any(s.stages is not stages and list(s.stages) != list(stages) for s in seqs):
        raise ValueError(f"the sequences of a batched {what} run over the same stages")
    return stages
