"""What the speculative-decoding tests share: a lookup drafter whose drafts are spoiled at a chosen rate (the
synthetic models' greedy answers fall into repeats the lookup almost always gets right)."""
import numpy as np

from strata.engine.lookup import LookupDrafter
from strata.sampling.speculative import Draft


class Spoiled:
    """Wraps a slot's LookupDrafter: checks its index against the sequence at every draft, then keeps each drafted
    token with probability `rate` (else the next id)."""

    def __init__(self, inner: LookupDrafter, rate: float, n_vocab: int, seed: int = 0):
        self.inner, self.rate, self.n_vocab = inner, rate, n_vocab
        self.rng = np.random.default_rng(seed)
        self.wants_hidden, self.graph, self.kind = False, None, "lookup"
        self.drafted = 0

    def observe(self, start, hidden):
        self.inner.observe(start, hidden)

    def flush(self):
        self.inner.flush()

    def draft(self, token, n, min_p=0.0):
        out = self.inner.draft(token, n, min_p)
        idx, seq = self.inner.index, self.inner.seq
        assert idx.tokens[:-1].tolist() == seq.ids.tolist() and int(idx.tokens[-1]) == token
        self.drafted += len(out)
        return [d if self.rng.random() < self.rate else Draft((d.token + 1) % self.n_vocab) for d in out]


def spoil(engine, rate, seed=0):
    """Every slot's lookup drafter of `engine` wrapped in a Spoiled one keeping drafts at `rate`."""
    for s in engine.slots:
        d = s.decoder.drafter
        s.decoder.drafter = Spoiled(d.inner if isinstance(d, Spoiled) else d, rate, engine.n_vocab, seed)
