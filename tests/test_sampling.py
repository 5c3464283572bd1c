"""Sampling tests: validation, greedy, seeds, top-k/top-p/min-p supports and distributions (fixed seeds), llama.cpp's
penalty formula, OpenAI-style logprobs, and StopMatcher across piece boundaries (hypothesis)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.sampling.sampler import NonFiniteLogits, Sampler, SamplingParams, StopMatcher


def _draw(params, logits, n, history=()):
    s = Sampler(params, logits.shape[0])
    for t in history:
        s.accept(t)
    return np.array([s.sample(logits).token_id for _ in range(n)])


def _freq(tokens, n_vocab):
    return np.bincount(tokens, minlength=n_vocab) / len(tokens)


def _softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


LOGITS = np.log(np.array([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02], dtype=np.float64)).astype(np.float32)
OFF = dict(top_k=0, top_p=1.0, min_p=0.0)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", float("nan")), ("top_k", -1),
                                         ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1),
                                         ("repeat_penalty", 0.0), ("presence_penalty", 3.0),
                                         ("frequency_penalty", -2.5), ("repeat_last_n", -2), ("seed", 1.5),
                                         ("logprobs", 21), ("logprobs", -1), ("temperature", True)])
def test_validation(field, value):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**{field: value})
    assert "\n" not in str(e.value)


def test_bad_logits_shape():
    s = Sampler(SamplingParams(), 7)
    with pytest.raises(ValueError, match=r"shape \(7,\)"):
        s.sample(np.zeros(8, np.float32))
    with pytest.raises(NonFiniteLogits, match="NaN") as e:      # the model's fault: an engine error, not a 400
        s.sample(np.full(7, np.nan, np.float32))
    assert not isinstance(e.value, ValueError) and e.value.status == 500


def test_nan_logits_answer_an_engine_error_not_a_client_error():
    """NaN logits are the model's fault: the daemon answers 500 (engine_error) naming it, never a 400."""
    from strata.serve.handling import as_api_error
    from strata.serve.worker import EngineError
    with pytest.raises(NonFiniteLogits) as e:
        Sampler(SamplingParams(temperature=0.7, seed=3), 5).sample(np.array([0, np.nan, 1, 2, 3], np.float32))
    err = as_api_error(EngineError(e.value))
    assert err.status == 500 and err.code == "engine_error" and err.body()["error"]["type"] == "server_error"
    assert "the model's logits contain NaN" in err.message and "not of the request" in err.message


# ----------------------------------------------------------------------------- greedy & seeds
def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.standard_normal(1000).astype(np.float32)
        r = Sampler(SamplingParams(temperature=0), 1000).sample(x)
        assert r.token_id == int(np.argmax(x))
    x = np.zeros(10, np.float32)
    x[[3, 7]] = 5
    assert Sampler(SamplingParams(temperature=0), 10).sample(x).token_id == 3


def test_plain_greedy_one_pass_matches_the_chain():
    """The plain greedy pick (no bias, no penalty in effect: one argmax over the logits as they are) is the chain's
    candidate (Sampler.candidates over its penalized copy), NaN anywhere still refused, and the logprob NaN unless
    logprobs is asked (the full softmax only then)."""
    rng = np.random.default_rng(5)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=1.3), 500)
    assert s.plain_greedy                       # a penalty with no history yet changes nothing
    s.accept(2)
    assert not s.plain_greedy
    for _ in range(20):
        x = rng.integers(-3, 3, 500).astype(np.float32)       # many ties
        plain = Sampler(SamplingParams(temperature=0), 500)
        r = plain.sample(x)
        assert r.token_id == int(plain.candidates(x)[0][0]) == int(np.flatnonzero(x == x.max())[0])
        assert np.isnan(r.logprob) and r.top_logprobs is None
    for at in (0, 250, 499):
        x = rng.standard_normal(500).astype(np.float32)
        x[at] = np.nan
        with pytest.raises(NonFiniteLogits):
            Sampler(SamplingParams(temperature=0), 500).sample(x)
    x = rng.standard_normal(500).astype(np.float32)
    lp = Sampler(SamplingParams(temperature=0, logprobs=0), 500).sample(x).logprob
    x64 = x.astype(np.float64)
    assert math.isclose(lp, float(x64.max() - np.log(np.exp(x64).sum())), rel_tol=1e-9, abs_tol=1e-9)


def test_seed_reproducible():
    rng = np.random.default_rng(1)
    seq = [rng.standard_normal(500).astype(np.float32) for _ in range(40)]
    p = SamplingParams(temperature=1.0, seed=1234, **OFF)
    s1, s2 = Sampler(p, 500), Sampler(p, 500)
    a = [s1.sample(x).token_id for x in seq]
    assert a == [s2.sample(x).token_id for x in seq]
    other = Sampler(SamplingParams(temperature=1.0, seed=99, **OFF), 500)
    assert [other.sample(x).token_id for x in seq] != a


# ----------------------------------------------------------------------------- truncation samplers
def test_temperature_only_distribution():
    for t in (0.5, 1.0, 2.0):
        f = _freq(_draw(SamplingParams(temperature=t, seed=7, **OFF), LOGITS, 20000), 7)
        ref = _softmax(LOGITS / t)
        assert np.abs(f - ref).sum() / 2 < 0.02, (t, f, ref)


def test_top_k_support_and_distribution():
    f = _freq(_draw(SamplingParams(temperature=1.0, seed=3, top_k=3, top_p=1.0, min_p=0.0), LOGITS, 20000), 7)
    assert set(np.nonzero(f)[0]) == {0, 1, 2}
    ref = np.array([0.40, 0.25, 0.15]) / 0.80
    assert np.abs(f[:3] - ref).max() < 0.02


@pytest.mark.parametrize("p,support", [(0.39, {0}), (0.6, {0, 1}), (0.7, {0, 1, 2}), (0.79, {0, 1, 2}),
                                       (0.85, {0, 1, 2, 3})])
def test_top_p_support(p, support):
    """llama.cpp keeps the smallest best-first set whose probability reaches p."""
    f = _freq(_draw(SamplingParams(temperature=1.0, seed=5, top_k=0, top_p=p, min_p=0.0), LOGITS, 5000), 7)
    assert set(np.nonzero(f)[0]) == support


@pytest.mark.parametrize("m,support", [(0.3, {0, 1, 2}), (0.2, {0, 1, 2, 3}), (0.1, {0, 1, 2, 3, 4}), (0.7, {0})])
def test_min_p_support(m, support):
    """llama.cpp keeps tokens with p >= min_p * p_max (logit >= max + log(min_p))."""
    f = _freq(_draw(SamplingParams(temperature=1.0, seed=5, top_k=0, top_p=1.0, min_p=m), LOGITS, 5000), 7)
    assert set(np.nonzero(f)[0]) == support


def test_chain_order_truncation_before_temperature():
    """top-p is computed on the untempered distribution (llama.cpp: top-k, top-p, min-p, then temperature)."""
    f = _freq(_draw(SamplingParams(temperature=5.0, seed=11, top_k=0, top_p=0.6, min_p=0.0), LOGITS, 20000), 7)
    assert set(np.nonzero(f)[0]) == {0, 1}
    ref = _softmax(LOGITS[:2] / 5.0)
    assert np.abs(f[:2] - ref).max() < 0.02


# ----------------------------------------------------------------------------- penalties
def test_penalties_formula():
    """llama.cpp llama_sampler_penalties_apply: divide positive / multiply non-positive logits by
    repeat_penalty, then subtract count * frequency + presence."""
    x = np.array([2.0, -1.0, 0.5, 3.0, 0.0, 1.0], np.float32)
    p = SamplingParams(repeat_penalty=1.5, frequency_penalty=0.1, presence_penalty=0.2, repeat_last_n=64)
    s = Sampler(p, 6)
    for t in [0, 1, 1, 3, 3, 3, 4]:
        s.accept(t)
    got = s.apply_penalties(x)
    want = np.array([2.0 / 1.5 - 0.1 - 0.2, -1.0 * 1.5 - 0.2 - 0.2, 0.5, 3.0 / 1.5 - 0.3 - 0.2,
                     0.0 * 1.5 - 0.1 - 0.2, 1.0], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(x, [2.0, -1.0, 0.5, 3.0, 0.0, 1.0])  # input untouched


def test_penalty_window_and_effect():
    x = np.array([3.0, 2.9, 0.0], np.float32)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=1.1, repeat_last_n=2), 3)
    s.accept(0)
    assert s.sample(x).token_id == 1  # 3.0/1.1 < 2.9
    s.accept(2)
    s.accept(2)  # token 0 left the 2-token window
    assert s.sample(x).token_id == 0
    off = Sampler(SamplingParams(temperature=0, repeat_penalty=1.1, repeat_last_n=0), 3)
    off.accept(0)
    assert off.sample(x).token_id == 0


# ----------------------------------------------------------------------------- logprobs
def test_logprobs_from_unmodified_softmax():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(300).astype(np.float32) * 3
    s = Sampler(SamplingParams(temperature=0.3, top_k=5, repeat_penalty=1.3, seed=1, logprobs=4), 300)
    s.accept(int(np.argmax(x)))
    r = s.sample(x)
    ref = np.log(_softmax(x.astype(np.float64)))
    assert math.isclose(r.logprob, ref[r.token_id], rel_tol=1e-9, abs_tol=1e-9)
    best = np.argsort(-ref)[:4]
    assert [i for i, _ in r.top_logprobs] == list(best)
    np.testing.assert_allclose([lp for _, lp in r.top_logprobs], ref[best], atol=1e-9)
    assert Sampler(SamplingParams(seed=1), 300).sample(x).top_logprobs is None
    assert Sampler(SamplingParams(seed=1, logprobs=0), 300).sample(x).top_logprobs == []


# ----------------------------------------------------------------------------- StopMatcher
def _run_stop(stops, pieces):
    m = StopMatcher(stops)
    out, stopped = [], False
    for p in pieces:
        t, stopped = m.feed(p)
        out.append(t)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
        stopped = m.stopped
    return "".join(out), stopped


def test_stop_across_pieces():
    assert _run_stop(["</end>"], ["Hello </", "en", "d> more"]) == ("Hello ", True)
    assert _run_stop(["\n\n"], ["a\n", "\nb"]) == ("a", True)
    assert _run_stop(["STOP"], ["ST", "OP"]) == ("", True)
    assert _run_stop(["xyz"], ["abc", "xy"]) == ("abcxy", False)  # held text is released at the end
    # a match is not taken while a stop that starts earlier is unfinished (hypothesis found this one)
    assert _run_stop(["<", "><<"], ["><", "<"]) == ("", True)
    assert _run_stop(["<", "><<"], ["><"]) == (">", True)          # ... and flush cuts at the held "<"
    m = StopMatcher(["<", "><<"])
    assert m.feed("><") == ("", False) and m.flush() == ">" and m.stopped and m.matched == "<"
    m = StopMatcher(["abc"])
    assert m.feed("xxa") == ("xx", False)   # "a" could start the stop: held
    assert m.feed("bd") == ("abd", False)   # resolved: released
    with pytest.raises(ValueError, match="stop strings must be str"):
        StopMatcher([1])


_TXT = st.text(alphabet="ab\n<>/\u00e9\U0001f600", max_size=40)


@settings(max_examples=400, deadline=None)
@given(text=_TXT, stops=st.lists(st.text(alphabet="ab\n<>/\u00e9\U0001f600", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_stop_matcher_property(text, stops, cuts):
    bounds = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    got, stopped = _run_stop(stops, pieces)
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        first = min(hits)
        assert stopped and got == text[:first]
    else:
        assert not stopped and got == text
    for s in stops:  # a stop string is never emitted
        assert s not in got


def _reference_support(x, top_k, top_p, min_p):
    """Naive llama.cpp chain on a full sort (independent of Sampler's partition shortcuts)."""
    order = sorted(range(len(x)), key=lambda i: (-float(x[i]), i))
    if 0 < top_k < len(x):
        order = order[:top_k]
    if top_p < 1:
        pr = _softmax(x[order])
        cum, keep = 0.0, []
        for i, q in zip(order, pr):
            keep.append(i)
            cum += q
            if cum >= top_p:
                break
        order = keep
    if min_p > 0:
        mx = float(x[order[0]])
        order = [i for i in order if float(x[i]) >= mx + math.log(min_p)]
    return order


@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])
@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.95, 0.05), (0, 0.9, 0.0), (0, 1.0, 0.1), (50, 0.8, 0.0),
                                               (3000, 0.95, 0.02)])
def test_candidates_match_naive_chain(scale, top_k, top_p, min_p):
    x = (np.random.default_rng(int(scale * 10)).standard_normal(6000) * scale).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, seed=0), 6000)
    ids, _ = s.candidates(x)
    assert list(ids) == _reference_support(x, top_k, top_p, min_p)


@pytest.mark.parametrize("t", [2.2025518251195869e-293, 5e-324, 1e-40, 1e-31])
def test_a_temperature_too_small_for_float32_is_greedy(t):
    """A temperature whose logit / T overflows float32 (the HTTP fuzz sent 2.2e-293: divide-by-zero and NaN warnings
    in the daemon's log) samples as its limit, greedy: the argmax, with no floating-point warning."""
    import warnings
    rng = np.random.default_rng(3)
    x = rng.normal(0, 5, 4096).astype(np.float32)
    p = SamplingParams(temperature=t, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    assert p.greedy and p.temperature == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            assert Sampler(p, 4096).sample(x).token_id == int(np.argmax(x))
    assert not SamplingParams(temperature=1e-30).greedy         # the smallest sampling temperature stays one
