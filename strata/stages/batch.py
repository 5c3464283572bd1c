"""The batched decode step over live sequences: one token of each of N sequences through every stage in one forward
per stage (StageBase.forward_batch), each row bit-identical to that sequence's lone decode step."""
from __future__ import annotations

import time
from typing import Sequence as Seq

import numpy as np

from strata.stages.sequence import Sequence


def decode_batch(seqs: Seq[Sequence], tokens, x_in=None, hidden: bool = False):
    """Read tokens[i] as the next token of seqs[i] (distinct live sequences over the same stages) -> the last
    stage's logits, host float32 (N, n_vocab), row i bit-identical to ``seqs[i].forward([tokens[i]])`` (a worker's
    stages: the hidden states (N, n_embd) of its last carve; x_in: the rows its first stage starts from). hidden:
    (those logits, the last stage's final-normed rows (N, n_embd)), row i as ``seqs[i].forward([tokens[i]],
    hidden=True)`` gives it (the MTP drafters').

    Pages for one more token are reserved for every sequence on every stage first (each sequence's ``make_room``
    when a pool is short; KVCacheFull, changing nothing but the extra pages reserved, when nothing more can be
    freed). ValueError, changing nothing, for a count mismatch, a repeated sequence or sequences over other stages.
    """
    seqs = list(seqs)
    toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
    if not seqs or toks.shape[0] != len(seqs):
        raise ValueError(f"a batched step takes one token per sequence (got {toks.shape[0]} tokens for "
                         f"{len(seqs)} sequences)")
    if len({id(s) for s in seqs}) != len(seqs):
        raise ValueError("a batched step reads each sequence at most once")
    stages = seqs[0].stages
    if any(s.stages is not stages and list(s.stages) != list(stages) for s in seqs):
        raise ValueError("the sequences of a batched step run over the same stages")
    for s in seqs:
        s.reserve(1)
    x = x_in
    try:
        for k, st in enumerate(stages):
            if hidden and st.last:
                x = st.forward_batch(toks, [s.sids[k] for s in seqs], x_in=x, hidden=True)
            else:
                x = st.forward_batch(toks, [s.sids[k] for s in seqs], x_in=x)
    finally:
        now = time.monotonic()
        for s in seqs:
            s.forward_returned = now
    for i, s in enumerate(seqs):
        s.record(toks[i:i + 1])
    return x
