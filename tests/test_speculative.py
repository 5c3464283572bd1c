"""The speculative-decoding acceptance rule (strata/sampling/speculative.py): greedy verdicts equal plain decoding,
sampled verdicts draw from the target distribution (chi-square over fixed seeds), the rule's replacement matters."""
import math

import numpy as np
import pytest

from strata.sampling import speculative
from strata.sampling.sampler import NonFiniteLogits, Sampler, SamplingParams
from strata.sampling.speculative import Draft, judge

V = 16


def _chi2_critical(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at the normal quantile z (4.75: about 1e-6)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    n = counts.sum()
    e = n * p
    keep = e > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    return float(((counts[keep] - e[keep]) ** 2 / e[keep]).sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_verdict_equals_plain_decoding(seed, penalty):
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(5, V)).astype(np.float32)
    params = SamplingParams(temperature=0, repeat_penalty=penalty, repeat_last_n=-1)
    plain = Sampler(params, V)
    ref = []
    for r in rows:
        t = plain.sample(r).token_id
        plain.accept(t)
        ref.append(t)
    for wrong_at in range(5):        # drafts right up to wrong_at, then one wrong (4: all 4 drafts right)
        drafts = [Draft(t) for t in ref[:4]]
        if wrong_at < 4:
            drafts[wrong_at] = Draft((ref[wrong_at] + 1) % V)
        v = judge(Sampler(params, V), rows, drafts)
        assert v.accepted == wrong_at
        assert [r.token_id for r in v.tokens] == ref[:wrong_at + 1]


def _first_tokens(p_logits, q_probs, trials, seed, greedy_draft=False):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    sampler = Sampler(params, V)
    drng = np.random.default_rng(seed + 1000)
    rows = np.stack([p_logits, p_logits])
    ids = np.arange(V)
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(trials):
        if greedy_draft:
            d = Draft(int(np.argmax(q_probs)))
        else:
            d = Draft(int(drng.choice(V, p=q_probs)), ids, q_probs)
        counts[judge(sampler, rows, [d]).tokens[0].token_id] += 1
    return counts


def _target(p_logits):
    e = np.exp(p_logits.astype(np.float64) - p_logits.max())
    return e / e.sum()


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_sampled_verdict_draws_from_the_target(greedy_draft):
    rng = np.random.default_rng(7)
    p_logits = rng.normal(scale=1.5, size=V).astype(np.float32)
    q = _target(rng.normal(scale=1.5, size=V))          # a drafter that disagrees with the target
    counts = _first_tokens(p_logits, q, 6000, seed=11, greedy_draft=greedy_draft)
    assert _chi2(counts, _target(p_logits)) < _chi2_critical(V - 1)


def test_a_wrong_replacement_rule_is_detected(monkeypatch):
    """The chi-square above has the power to see a rule that redraws from p after a rejection."""
    rng = np.random.default_rng(7)
    p_logits = rng.normal(scale=1.5, size=V).astype(np.float32)
    q = _target(rng.normal(scale=1.5, size=V))
    monkeypatch.setattr(speculative, "_residual", lambda ids, p, d: (ids, p))
    counts = _first_tokens(p_logits, q, 6000, seed=11)
    assert _chi2(counts, _target(p_logits)) > _chi2_critical(V - 1)


def test_one_seed_gives_one_sequence():
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(4, V)).astype(np.float32)
    q = _target(rng.normal(size=V))
    drafts = [Draft(int(t), np.arange(V), q) for t in rng.choice(V, size=3, p=q)]
    params = SamplingParams(temperature=0.9, seed=5)
    a = judge(Sampler(params, V), rows, drafts)
    b = judge(Sampler(params, V), rows, drafts)
    assert (a.accepted, [t.token_id for t in a.tokens]) == (b.accepted, [t.token_id for t in b.tokens])
    assert len(a.tokens) == a.accepted + 1


def test_rows_must_match_the_drafts():
    s = Sampler(SamplingParams(temperature=0), V)
    with pytest.raises(ValueError, match="2 drafts has 3 rows"):
        judge(s, np.zeros((2, V), np.float32), [Draft(1), Draft(2)])
    rows = np.zeros((2, V), np.float32)
    rows[1, 3] = np.nan
    with pytest.raises(NonFiniteLogits):
        judge(s, rows, [Draft(1)])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_picks_judged_on_the_device_equal_the_host_verdict(seed):
    """A greedy verify judged from its rows' greedy picks (DeviceSampler.greedy_rows, here on numpy rows, then
    judge_picks) gives the host Sampler's verdict over the same rows: rows rounded to halves (ties, -0.0), every
    place of the first wrong draft."""
    from strata.sampling.device import DeviceSampler
    rng = np.random.default_rng(seed)
    rows = (np.round(rng.normal(size=(5, V)) * 2) / 2).astype(np.float32)
    rows[1, :] = -0.0                                 # a row of ties: the lowest id
    params = SamplingParams(temperature=0)
    ref = [int(np.argmax(r)) for r in rows]
    for wrong_at in range(5):
        drafts = [Draft(t) for t in ref[:4]]
        if wrong_at < 4:
            drafts[wrong_at] = Draft((ref[wrong_at] + 1) % V)
        host = judge(Sampler(params, V), rows, drafts)
        dev = DeviceSampler(params, V)
        got = speculative.judge_picks(dev, dev.greedy_rows(rows), drafts)
        assert got.accepted == host.accepted == wrong_at
        assert [r.token_id for r in got.tokens] == [r.token_id for r in host.tokens]
        assert list(dev._history) == [r.token_id for r in host.tokens]     # the emitted tokens accepted


def test_greedy_rows_only_where_a_row_alone_decides():
    from strata.sampling.device import DeviceSampler
    assert DeviceSampler(SamplingParams(temperature=0), V).greedy_rows_ok
    for p in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, repeat_penalty=1.2),
              SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0, logprobs=2)):
        s = DeviceSampler(p, V)
        assert not s.greedy_rows_ok
        with pytest.raises(ValueError, match="greedy_rows needs"):
            s.greedy_rows(np.zeros((2, V), np.float32))
    s = DeviceSampler(SamplingParams(temperature=0), V)
    with pytest.raises(ValueError, match="rows must have shape"):
        s.greedy_rows(np.zeros((2, V + 1), np.float32))
    rows = np.zeros((3, V), np.float32)
    rows[2, 5] = np.nan
    with pytest.raises(NonFiniteLogits):
        s.greedy_rows(rows)
    with pytest.raises(ValueError, match="2 drafts has 3 rows"):
        speculative.judge_picks(s, [1, 2], [Draft(1), Draft(2)])
