"""DeviceSampler (strata.sampling.device): the chain's distribution against an independent float64 reference of
llama.cpp's sampler chain, empirical draws (chi-square), penalties against Hugging Face's RepetitionPenaltyLogitsProcessor
and OpenAI's frequency/presence definition, seeds, the engine's forward_device hook on the real default model, and
(on a GPU) CuPy runs giving the numpy run's tokens."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from strata.sampling.sampler import NonFiniteLogits, Sampler, SamplingParams
from strata.sampling.device import DeviceSampler, greedy_picks, uniform

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)


# ----------------------------------------------------------------------------- independent reference (float64)
def ref_penalize(x, history, rp=1.0, fp=0.0, pp=0.0):
    """llama.cpp llama_sampler_penalties_apply / OpenAI: for a token seen c > 0 times, logit * rp if logit <= 0 else
    logit / rp, then - (c * fp + pp)."""
    x = np.asarray(x, np.float64).copy()
    for t, c in Counter(history).items():
        x[t] = x[t] * rp if x[t] <= 0 else x[t] / rp
        x[t] -= c * fp + pp
    return x


def ref_chain(x, temperature, top_k, top_p, min_p):
    """{token: probability} after llama.cpp's chain top-k -> top-p -> min-p -> temperature -> softmax, written from
    the definitions (src/llama-sampling.cpp) on a plain Python sort, float64."""
    x = np.asarray(x, np.float64)
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if 0 < top_k < len(x):
        order = order[:top_k]
    if top_p < 1:
        z = np.array([math.exp(x[i] - x[order[0]]) for i in order])
        z /= z.sum()
        keep, cum = [], 0.0
        for i, q in zip(order, z):
            keep.append(i)
            cum += q
            if cum >= top_p:
                break
        order = keep
    if min_p > 0:                      # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        order = [i for i in order if x[i] >= x[order[0]] + math.log(min_p)]
    z = np.array([math.exp((x[i] - x[order[0]]) / temperature) for i in order])
    return dict(zip(order, z / z.sum()))


def chi_square_ok(draws, probs: dict, n_vocab: int) -> tuple[bool, float, float]:
    """Pearson's chi-square of the draws against probs; cells with expected count < 5 are pooled. Passes below
    df + 5 sqrt(2 df) (about 5 sigma of the chi-square distribution)."""
    n = len(draws)
    obs = np.bincount(draws, minlength=n_vocab).astype(np.float64)
    exp = np.zeros(n_vocab)
    for i, q in probs.items():
        exp[i] = q * n
    big = exp >= 5
    o = list(obs[big]) + [obs[~big].sum()]
    e = list(exp[big]) + [exp[~big].sum()]
    stat = sum((a - b) ** 2 / b for a, b in zip(o, e) if b > 0)
    df = max(1, sum(1 for b in e if b > 0) - 1)
    bound = df + 5 * math.sqrt(2 * df)
    return stat < bound, stat, bound


def draws(params, x, n, history=()):
    s = DeviceSampler(params, x.shape[0])
    for t in history:
        s.accept(t)
    return np.array([s.sample(x).token_id for _ in range(n)])


X64 = (np.random.default_rng(10).standard_normal(64) * 2.0).astype(np.float32)

CONFIGS = [
    dict(temperature=1.0, **OFF),
    dict(temperature=0.7, top_k=10, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=2.0, top_k=0, top_p=0.95, min_p=0.02),
]


# ----------------------------------------------------------------------------- distribution
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_distribution_matches_reference(cfg):
    ref = ref_chain(X64, cfg["temperature"], cfg["top_k"], cfg["top_p"], cfg["min_p"])
    s = DeviceSampler(SamplingParams(seed=1, **cfg), 64)
    ids, probs = s.candidates(X64)
    assert set(ids.tolist()) == set(ref)
    np.testing.assert_allclose(probs, [ref[i] for i in ids], rtol=1e-5, atol=1e-9)
    d = draws(SamplingParams(seed=2, **cfg), X64, 6000)
    assert set(d.tolist()) <= set(ref)
    ok, stat, bound = chi_square_ok(d, ref, 64)
    assert ok, (stat, bound)


def test_distribution_with_penalties():
    hist = [0, 3, 3, 7, 7, 7, int(np.argmax(X64))]
    p = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, repeat_penalty=1.4,
                       frequency_penalty=0.3, presence_penalty=0.2, repeat_last_n=64, seed=4)
    xr = ref_penalize(X64, hist, 1.4, 0.3, 0.2)
    ref = ref_chain(xr, 0.8, 30, 0.9, 0.02)
    d = draws(p, X64, 6000, hist)
    assert set(d.tolist()) <= set(ref)
    ok, stat, bound = chi_square_ok(d, ref, 64)
    assert ok, (stat, bound)


@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])
@pytest.mark.parametrize("top_k,top_p,min_p", [(40, 0.95, 0.05), (0, 0.9, 0.0), (0, 1.0, 0.1), (50, 0.8, 0.0),
                                               (3, 1.0, 0.01), (0, 0.9, 0.02), (3000, 0.95, 0.02)])
def test_candidates_large_vocab(scale, top_k, top_p, min_p):
    """Every selection path (min-p prefilter with and without top-k, full sort) on 6000 logits: the reference's
    support and probabilities, and the host Sampler's candidate set."""
    x = (np.random.default_rng(int(scale * 10)).standard_normal(6000) * scale).astype(np.float32)
    p = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p, seed=0)
    ids, probs = DeviceSampler(p, 6000).candidates(x)
    ref = ref_chain(x, 0.8, top_k, top_p, min_p)
    assert ids.tolist() == list(ref)
    np.testing.assert_allclose(probs, list(ref.values()), rtol=1e-5, atol=1e-12)
    assert ids.tolist() == Sampler(p, 6000).candidates(x)[0].tolist()


# ----------------------------------------------------------------------------- greedy, seeds
def test_greedy_and_top_k_1_are_argmax():
    rng = np.random.default_rng(0)
    for _ in range(30):
        x = rng.standard_normal(1000).astype(np.float32)
        assert DeviceSampler(SamplingParams(temperature=0), 1000).sample(x).token_id == int(np.argmax(x))
        s = DeviceSampler(SamplingParams(temperature=1.5, top_k=1, top_p=1.0, min_p=0.0), 1000)
        assert s.sample(x).token_id == int(np.argmax(x))
    x = np.zeros(10, np.float32)
    x[[3, 7]] = 5
    assert DeviceSampler(SamplingParams(temperature=0), 10).sample(x).token_id == 3


def test_seed_reproducible_and_seeds_differ():
    rng = np.random.default_rng(1)
    seq = [rng.standard_normal(500).astype(np.float32) for _ in range(40)]
    p = SamplingParams(temperature=1.0, seed=1234, **OFF)
    s1, s2 = DeviceSampler(p, 500), DeviceSampler(p, 500)
    a = [s1.sample(x).token_id for x in seq]
    assert a == [s2.sample(x).token_id for x in seq]
    other = DeviceSampler(SamplingParams(temperature=1.0, seed=99, **OFF), 500)
    assert [other.sample(x).token_id for x in seq] != a
    fresh = [DeviceSampler(SamplingParams(temperature=1.0, seed=-1, **OFF), 500) for _ in range(2)]
    assert [fresh[0].sample(x).token_id for x in seq] != [fresh[1].sample(x).token_id for x in seq]


def test_counter_rng_uniform():
    """uniform(seed, step) depends only on its arguments and is uniform on [0, 1) (Kolmogorov-Smirnov, 1e-3 level)."""
    u = np.array([uniform(7, i) for i in range(20000)])
    assert uniform(7, 123) == u[123] and uniform(8, 123) != u[123]
    assert 0 <= u.min() and u.max() < 1
    u.sort()
    ks = np.max(np.maximum(np.arange(1, u.size + 1) / u.size - u, u - np.arange(u.size) / u.size))
    assert ks < 1.95 / math.sqrt(u.size)


def test_bad_input():
    s = DeviceSampler(SamplingParams(), 7)
    with pytest.raises(ValueError, match=r"shape \(7,\)"):
        s.sample(np.zeros(8, np.float32))
    for t in (0, 0.8):
        s = DeviceSampler(SamplingParams(temperature=t, seed=1), 7)
        with pytest.raises(NonFiniteLogits, match="NaN"):
            s.sample(np.array([0, 1, np.nan, 2, 0, 0, 0], np.float32))
        assert s.step == 0
    with pytest.raises(ValueError, match="n_vocab"):
        DeviceSampler(SamplingParams(), 0)
    with pytest.raises(ValueError, match="SamplingParams"):
        DeviceSampler({"temperature": 1}, 7)


# ----------------------------------------------------------------------------- penalties
def test_repetition_penalty_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers import RepetitionPenaltyLogitsProcessor
    x = (np.random.default_rng(5).standard_normal(300) * 3).astype(np.float32)
    hist = [5, 9, 9, 17, 250, 5, 100]
    s = DeviceSampler(SamplingParams(repeat_penalty=1.3, repeat_last_n=-1), 300)
    for t in hist:
        s.accept(t)
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([hist]), torch.tensor(x[None].copy()))[0].numpy()
    np.testing.assert_allclose(s.apply_penalties(x), want, rtol=1e-6, atol=1e-6)


def test_frequency_presence_penalties_and_window():
    """OpenAI: mu[j] - c[j] * frequency - [c[j] > 0] * presence, over the last repeat_last_n accepted tokens."""
    x = (np.random.default_rng(6).standard_normal(50) * 2).astype(np.float32)
    hist = [1, 2, 2, 3, 3, 3, 4, 1, 1, 40, 40, 2]
    for n_last in (-1, 0, 5):
        p = SamplingParams(repeat_penalty=1.2, frequency_penalty=0.4, presence_penalty=-0.3, repeat_last_n=n_last)
        s = DeviceSampler(p, 50)
        s.sample(x)                           # counts built before the history (then updated per token)
        for t in hist:
            s.accept(t)
        window = hist if n_last == -1 else hist[len(hist) - n_last:] if n_last else []
        np.testing.assert_allclose(s.apply_penalties(x), ref_penalize(x, window, 1.2, 0.4, -0.3), rtol=1e-6,
                                   atol=1e-6)
        h = Sampler(p, 50)
        for t in hist:
            h.accept(t)
        np.testing.assert_array_equal(s.apply_penalties(x), h.apply_penalties(x))


def test_logprobs_from_unmodified_softmax():
    x = (np.random.default_rng(2).standard_normal(300) * 3).astype(np.float32)
    s = DeviceSampler(SamplingParams(temperature=0.3, top_k=5, repeat_penalty=1.3, seed=1, logprobs=4), 300)
    s.accept(int(np.argmax(x)))
    r = s.sample(x)
    xx = x.astype(np.float64)
    ref = xx - xx.max() - math.log(np.exp(xx - xx.max()).sum())
    assert math.isclose(r.logprob, ref[r.token_id], rel_tol=1e-9, abs_tol=1e-9)
    best = np.argsort(-ref)[:4]
    assert [i for i, _ in r.top_logprobs] == list(best)
    np.testing.assert_allclose([lp for _, lp in r.top_logprobs], ref[best], atol=1e-9)
    r = DeviceSampler(SamplingParams(seed=1), 300).sample(x)
    assert r.top_logprobs is None and math.isnan(r.logprob)
    assert DeviceSampler(SamplingParams(seed=1, logprobs=0), 300).sample(x).top_logprobs == []


# ----------------------------------------------------------------------------- engine hook (real model, CPU)
class DeviceForward:
    """A stage runner with the forward_device contract: forward_device(tokens, state) -> float32 (n_vocab,)
    logits of the last token, same bookkeeping as forward; here numpy, so DeviceSampler runs with numpy."""

    device_logits = True

    def __init__(self, runner):
        self.runner = runner
        self.calls = 0

    def forward(self, tokens, state, all_logits=False, x_in=None):
        return self.runner.forward(tokens, state, all_logits=all_logits, x_in=x_in)

    def forward_device(self, tokens, state, x_in=None):
        self.calls += 1
        return self.runner.forward(tokens, state, x_in=x_in)


@pytest.fixture(scope="module")
def engine(default_model_path):
    from strata.engine import Engine
    return Engine(default_model_path, n_ctx=512, ubatch=64, prompt_cache=0)


def _tokens(engine, sampling, n=12, logprobs=2):
    """The answer to one fixed prompt, read from 0 every time (cache_prompt False: the same logits for every
    sampling path, whatever the previous request left)."""
    from tests.helpers import answer
    return answer(engine, [{"role": "user", "content": "Name three colours."}], n, ignore_eos=False,
                  sampling=sampling, logprobs=logprobs, cache_prompt=False).logprobs


def test_engine_forward_device_hook(engine):
    assert not engine.stages[-1].device_logits                   # the CPU path keeps forward + Sampler
    greedy_pen = SamplingParams(temperature=0, repeat_penalty=1.5, frequency_penalty=0.2, repeat_last_n=8)
    seeded = SamplingParams(temperature=0.9, seed=42)
    host = _tokens(engine, greedy_pen)
    plain = engine.stages[-1].runner
    engine.stages[-1].runner = dev = DeviceForward(plain)
    try:
        got = _tokens(engine, greedy_pen)
        assert dev.calls == len(got) - 1 > 0
        assert [t for t, _ in got] == [t for t, _ in host]
        np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in host], atol=1e-9)
        a, b = _tokens(engine, seeded), _tokens(engine, seeded)
        assert a == b
    finally:
        engine.stages[-1].runner = plain


# ----------------------------------------------------------------------------- GPU: CuPy run == numpy run
def _cuda_why():
    try:
        from strata.backend import cuda as C
    except Exception as e:  # noqa: BLE001
        return f"strata.backend.cuda not importable: {e}"
    return C.unavailable_reason()


@pytest.mark.skipif(_cuda_why() is not None, reason=f"CUDA backend unavailable: {_cuda_why()}")
@pytest.mark.parametrize("cfg", CONFIGS + [dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.3,
                                                frequency_penalty=0.5, presence_penalty=0.5, repeat_last_n=16,
                                                logprobs=3)])
@pytest.mark.parametrize("kernel", ["1", "0"], ids=["kernel", "array-path"])
def test_cupy_matches_numpy(cfg, kernel, monkeypatch):
    """The CuPy run (the one-block kernel where it applies, as the engine samples by default, or the array path) draws
    the numpy run's tokens for the same seed and logits."""
    import cupy as cp
    monkeypatch.setenv("STRATA_SAMPLE_KERNEL", kernel)
    rng = np.random.default_rng(3)
    n = 49152
    sn = DeviceSampler(SamplingParams(seed=77, **cfg), n)
    sc = DeviceSampler(SamplingParams(seed=77, **cfg), n)
    for step in range(60):
        x = (rng.standard_normal(n) * (0.5 + step % 4)).astype(np.float32)
        a, b = sn.sample(x), sc.sample(cp.asarray(x))
        if a.token_id != b.token_id:
            xs = cp.asnumpy(x)
            raise AssertionError(f"step {step} cfg {cfg}: kernel {a.token_id} (logit {xs[a.token_id]!r}) vs array "
                                 f"path {b.token_id} (logit {xs[b.token_id]!r}); max {xs.max()!r}, "
                                 f"ties at max {int((xs == xs.max()).sum())}")
        if a.top_logprobs is not None:
            assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]
            assert math.isclose(a.logprob, b.logprob, rel_tol=1e-9, abs_tol=1e-9)
        sn.accept(a.token_id)
        sc.accept(b.token_id)
    if kernel == "0":
        assert sc.kernel_calls == 0
    elif cfg.get("logprobs") is None and (cfg["top_k"] or cfg["top_p"] < 1 or cfg["min_p"] > 0):
        assert sc.kernel_calls > 0                    # the strata_sample kernel drew (not only the array path)


def _tricky_logits(rng, n, step):
    x = rng.standard_normal(n) * (0.3 + step % 5)
    if step % 3 == 0:
        x = np.round(x * 2) / 2                     # many exact ties
    if step % 4 == 1:
        x[rng.choice(n, n // 3, replace=False)] = -np.inf
    return x.astype(np.float32)


def _top_p_cut_ambiguous(pen: np.ndarray, p: SamplingParams) -> float | None:
    """Where the top-p prefix of these penalized logits is decided by float64 rounding: some prefix of the sorted
    (top-k) candidates has softmax mass within 1e-9 of top_p (exact ties make masses like 90 x 0.01 = 0.9), so two
    correct summation orders (the kernel's block scan, CuPy's cumsum) may keep that prefix or one more candidate.
    Returns the lowest logit either may keep (the candidate after the last such prefix), or None when the cut is
    not ambiguous."""
    if p.temperature == 0 or p.top_p >= 1.0:
        return None
    v = np.sort(pen[np.isfinite(pen)].astype(np.float64))[::-1]
    if p.top_k and 0 < p.top_k < v.size:
        v = v[:p.top_k]
    w = np.exp(v - v[0])
    close = np.flatnonzero(np.abs(np.cumsum(w) / w.sum() - p.top_p) < 1e-9)
    if close.size == 0:
        return None
    return float(v[min(int(close[-1]) + 1, v.size - 1)])


@pytest.mark.skipif(_cuda_why() is not None, reason=f"CUDA backend unavailable: {_cuda_why()}")
@pytest.mark.parametrize("n", [1000, 49152])
@pytest.mark.parametrize("cfg", [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.2, top_k=3),
                                 dict(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0),
                                 dict(temperature=1.0, top_k=0, top_p=0.99, min_p=0.01),
                                 dict(temperature=0.7, top_k=3000, top_p=1.0, min_p=0.2),
                                 dict(temperature=0.9, top_k=100, top_p=0.9, min_p=0.0, repeat_penalty=1.2,
                                      frequency_penalty=0.3, presence_penalty=-0.2, repeat_last_n=32)])
def test_kernel_matches_array_path(monkeypatch, n, cfg):
    """strata_sample (one block) against DeviceSampler's CuPy array path on the same logits and seed: ties, -inf,
    vocabularies below and above the kernel's 2048-entry buffer. The same token at every step, except where the
    top-p cut is decided by float64 summation order (exact-tie masses equal to top_p: _top_p_cut_ambiguous; at most
    a few of the 80 steps), where both tokens must still be among the candidates either order keeps; both samplers
    then accept the array path's token so their histories agree."""
    import cupy as cp
    rng = np.random.default_rng(n)
    p = SamplingParams(seed=5, **cfg)
    ker, arr = DeviceSampler(p, n), DeviceSampler(p, n)
    ambiguous = 0
    for step in range(80):
        x = cp.asarray(_tricky_logits(rng, n, step))
        monkeypatch.setenv("STRATA_SAMPLE_KERNEL", "1")
        a = ker.sample(x)
        monkeypatch.setenv("STRATA_SAMPLE_KERNEL", "0")
        b = arr.sample(x)
        if a.token_id != b.token_id:
            xs = cp.asnumpy(x)
            pen = cp.asnumpy(arr.apply_penalties(x))
            low = _top_p_cut_ambiguous(pen, p)
            if low is None or pen[a.token_id] < low or pen[b.token_id] < low:
                raise AssertionError(f"step {step} cfg {cfg}: kernel {a.token_id} (logit {xs[a.token_id]!r}) vs "
                                     f"array path {b.token_id} (logit {xs[b.token_id]!r}); max {xs.max()!r}, ties "
                                     f"at max {int((xs == xs.max()).sum())}")
            ambiguous += 1
        ker.accept(b.token_id)
        arr.accept(b.token_id)
    assert ambiguous <= 4, f"{ambiguous} of 80 steps had an ambiguous top-p cut"
    assert ker.kernel_calls > 0 and arr.kernel_calls == 0


@pytest.mark.skipif(_cuda_why() is not None, reason=f"CUDA backend unavailable: {_cuda_why()}")
def test_cuda_engine_samples_on_device(monkeypatch, default_model_path):
    """The engine on CUDA with forward_device: greedy tokens equal the host path's (forward + Sampler); a seed
    repeats."""
    from strata.engine import Engine
    e = Engine(default_model_path, n_ctx=512, device="cuda", prompt_cache=0)
    assert e.stages[-1].device_logits            # the CUDA plan leaves the logits on the device
    greedy = SamplingParams(temperature=0, repeat_penalty=1.3, repeat_last_n=16)
    dev = _tokens(e, greedy, 32)
    monkeypatch.setenv("STRATA_DEVICE_SAMPLING", "0")
    host = _tokens(e, greedy, 32)
    monkeypatch.delenv("STRATA_DEVICE_SAMPLING")
    assert [t for t, _ in dev] == [t for t, _ in host]
    np.testing.assert_allclose([lp for _, lp in dev], [lp for _, lp in host], atol=1e-4)
    assert [t for t, _ in _tokens(e, greedy, 32, logprobs=None)] == [t for t, _ in host]     # the kernel's argmax
    seeded = SamplingParams(temperature=0.9, seed=42)
    a = _tokens(e, seeded, 32, logprobs=None)
    assert a == _tokens(e, seeded, 32, logprobs=None) and len(a) > 1


def test_greedy_picks_are_each_rows_own_greedy_sample():
    """A batched step's greedy picks (one argmax over the rows, NaN flags per row): each row's pick is what a greedy
    sampler takes from that row alone (ties -> the lowest id), None where the row holds a NaN (its sampler refuses
    it); the greedy rows of a DeviceSampler refuse the lot."""
    rows = np.array([[0, 3, 3, 1], [np.nan, 9, 0, 0], [-1, -2, -0.5, -0.5], [0, 0, 0, 7], [1, 9, np.nan, 0]],
                    np.float32)
    picks = greedy_picks(rows)
    assert picks == [1, None, 2, 3, None]
    alone = Sampler(SamplingParams(temperature=0), 4)
    assert alone.greedy_rows_ok
    for row, want in zip(rows, picks):
        if want is None:
            with pytest.raises(NonFiniteLogits):
                alone.sample(row)
        else:
            assert alone.sample(row).token_id == want
    assert greedy_picks(rows[[0, 2, 3]]) == [1, 2, 3]
    with pytest.raises(NonFiniteLogits):
        DeviceSampler(SamplingParams(temperature=0), 4).greedy_rows(rows)
    assert not Sampler(SamplingParams(temperature=0, logprobs=2), 4).greedy_rows_ok
    assert not Sampler(SamplingParams(temperature=0.7), 4).greedy_rows_ok

