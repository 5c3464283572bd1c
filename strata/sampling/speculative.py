"""The acceptance rule of speculative decoding: which drafted tokens a verify keeps, and the token that follows.

A verify of n drafted tokens yields n + 1 rows of logits: row i is the target model's prediction after the accepted
prefix and drafts 0..i-1. `judge` walks them in order with the request's own Sampler (its penalties see the accepted
tokens, its RNG stream gives the draws), so that:

* greedy (temperature 0): a draft is kept iff it is the token the target's argmax picks there; the emitted tokens are
  exactly those of decoding without drafts;
* sampling: a draft x drawn with probability q(x) is kept with probability min(1, p(x) / q(x)), where p is the
  distribution the sampler would draw from at that row; at the first rejection the replacement is drawn from
  norm(max(0, p - q)); when every draft is kept one more token is drawn from the last row. Each emitted token then
  follows p exactly (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023), and one
  seed gives one sequence. A greedy drafter's q is one-hot at its token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.sampling.sampler import NonFiniteLogits, Sampler, SampleResult


@dataclass(frozen=True)
class Draft:
    """One drafted token and the drafter's distribution it was taken from (ids, float64 probabilities); no
    distribution means a greedy draft (q one-hot at `token`)."""
    token: int
    ids: np.ndarray | None = None
    probs: np.ndarray | None = None

    def q(self, token: int) -> float:
        """The drafter's probability of `token`."""
        if self.ids is None:
            return 1.0 if token == self.token else 0.0
        hit = np.nonzero(self.ids == token)[0]
        return float(self.probs[hit[0]]) if hit.size else 0.0


@dataclass
class Verdict:
    """What one verify decided: `accepted` drafts kept, then `tokens` = the kept drafts and one more token (the
    replacement of the first rejected draft, or the token after the last kept one), each with its SampleResult."""
    accepted: int = 0
    tokens: list[SampleResult] = field(default_factory=list)


def _residual(p_ids: np.ndarray, p: np.ndarray, draft: Draft) -> tuple[np.ndarray, np.ndarray]:
    """norm(max(0, p - q)) over p's support (q outside it only lowers nothing)."""
    if draft.ids is None:
        r = np.where(p_ids == draft.token, 0.0, p)
    else:
        q = np.zeros_like(p)
        pos = {int(t): i for i, t in enumerate(p_ids)}
        for t, v in zip(draft.ids, draft.probs):
            i = pos.get(int(t))
            if i is not None:
                q[i] = v
        r = np.maximum(p - q, 0.0)
    return p_ids, r


def judge(sampler: Sampler, rows: np.ndarray, drafts: list[Draft]) -> Verdict:
    """The verdict over a verify's logits `rows` (len(drafts) + 1, n_vocab) for `drafts`, in order.

    Calls sampler.accept() for every emitted token (the penalty history follows the emitted sequence). Raises
    ValueError when the rows do not match the drafts.
    """
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[0] != len(drafts) + 1 or rows.shape[1] != sampler.n_vocab:
        raise ValueError(f"a verify of {len(drafts)} drafts has {len(drafts) + 1} rows of {sampler.n_vocab} logits, "
                         f"got shape {rows.shape}")
    if np.isnan(rows).any():
        raise NonFiniteLogits()
    out = Verdict()
    greedy = sampler.params.greedy
    for i, d in enumerate(drafts):
        logits = rows[i]
        if greedy:
            r = sampler.sample(logits)
            keep = r.token_id == d.token
        else:
            ids, p = sampler.distribution(logits)
            hit = np.nonzero(ids == d.token)[0]
            px = float(p[hit[0]]) if hit.size else 0.0
            qx = d.q(d.token)
            keep = qx > 0 and sampler.uniform() * qx < px
            if keep:
                r = sampler.result(logits, d.token)
            else:
                rid, w = _residual(ids, p, d)
                tok = sampler.draw(rid, w) if w.sum() > 0 else sampler.draw(ids, p)
                r = sampler.result(logits, tok)
        sampler.accept(r.token_id)
        out.tokens.append(r)
        if not keep:
            return out
        out.accepted += 1
    r = sampler.sample(rows[len(drafts)])
    sampler.accept(r.token_id)
    out.tokens.append(r)
    return out


def judge_picks(sampler, picks: list[int], drafts: list[Draft]) -> Verdict:
    """``judge`` of a greedy verify whose rows were already reduced to their greedy picks (``picks``: the token
    each of the len(drafts) + 1 rows gives, e.g. DeviceSampler.greedy_rows on the device): a draft is kept iff it
    is its row's pick; the same Verdict as judge() over those rows for a greedy sampler without penalties (logprob
    NaN, as the device's greedy samples give it). Calls sampler.accept() for every emitted token. Raises
    ValueError when the picks do not match the drafts."""
    if len(picks) != len(drafts) + 1:
        raise ValueError(f"a verify of {len(drafts)} drafts has {len(drafts) + 1} rows, got {len(picks)} picks")
    out = Verdict()
    for i in range(len(picks)):
        tok = int(picks[i])
        sampler.accept(tok)
        out.tokens.append(SampleResult(tok, float("nan"), None))
        if i == len(drafts) or tok != drafts[i].token:
            return out
        out.accepted += 1
    return out
