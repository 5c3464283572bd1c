"""The lookup drafter of speculative decoding (--spec-draft lookup): drafts for the live sequence copied from where
its own tokens (the prompt and what was generated) continued its last few tokens before, with no second model.

It keeps an NgramIndex (strata.sampling.lookup) of the sequence's tokens in step with the sequence: at each draft
the tokens read since the last one are appended (O(new tokens)); where the sequence changed other than by reads
(restored, cut back, reset: its epoch moved, or the token sampled last time was never read) the index is cut back
to what the two still share first. The token just sampled (about to be read at the sequence's position) ends the
text looked up. It needs no hidden states and holds no state on any stage, so checkpoints, parked conversations,
session files and remote stages carry nothing for it.
"""
from __future__ import annotations

from strata.sampling.lookup import NgramIndex
from strata.sampling.speculative import Draft

#: n-gram lengths looked up by default (--spec-ngram-min / --spec-ngram-max)
NGRAM_MIN, NGRAM_MAX = 2, 4


class LookupDrafter:
    """Drafts for the live sequence `seq` from its own earlier tokens: the continuation of the latest, longest
    n-gram match (n in n_min..n_max; see NgramIndex). Same verbs as MTPDrafter; ``observe`` and ``flush`` do
    nothing (no hidden states: ``wants_hidden`` is False) and min_p does not apply (a lookup has no
    probabilities)."""

    wants_hidden = False
    graph = None
    kind = "lookup"

    def __init__(self, seq, n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX):
        self.seq = seq
        self.index = NgramIndex(n_min, n_max)
        self._epoch = seq.epoch

    def observe(self, start: int, hidden) -> None:
        """Nothing: the tokens read are taken from the sequence at the next draft."""

    def flush(self) -> None:
        """Nothing: the lookup keeps no state on any stage."""

    def _sync(self) -> None:
        """The index holds exactly the sequence's tokens read so far."""
        seq, idx = self.seq, self.index
        ids, P = seq.ids, seq.pos
        if seq.epoch != self._epoch:
            keep = idx.common_prefix(ids)
            self._epoch = seq.epoch
        else:       # only the token sampled last (the index's last) may not have been read as it was
            keep = min(len(idx), P)
            if keep and int(ids[keep - 1]) != int(idx.tokens[keep - 1]):
                keep = idx.common_prefix(ids)
        idx.truncate(keep)
        idx.extend(ids[keep:P])

    def draft(self, token: int, n: int, min_p: float = 0.0) -> list[Draft]:
        """Up to n drafts following `token` (sampled, about to be read at the sequence's position): the tokens that
        followed the chosen earlier occurrence of the sequence's last tokens with `token`; [] where none occurred."""
        self._sync()
        self.index.extend([int(token)])
        return [Draft(t) for t in self.index.propose(n)] if n > 0 else []
