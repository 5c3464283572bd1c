"""Speculative decoding with the MTP head on CPU stages (--spec N): greedy output with drafts equals decoding without
them token for token, and the state the sequence is left in (every layer's K/V and running state) is the same.

The synthetic model's random weights make the real head's drafts almost never right, so the drafts are an oracle's:
the greedy continuation recorded by a first pass without drafts, each drafted position kept with a chosen
probability and otherwise replaced by a wrong token (the MTP head still runs on the drafts, so its K/V is real).
Full, partial and no acceptance; N = 1..4; one and two stages; max_tokens ending inside a verify; stop strings;
checkpoints restored mid-conversation; n > 1; a session file saved and restored with the drafter's K/V.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as hs

from strata.engine.engine import Engine
from strata.engine.types import FinalEvent, GenerationRequest
from tests.helpers import generate_all
from strata.gguf import synth
from strata.sampling.sampler import SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synth.write_synthetic(tmp_path_factory.mktemp("spec") / "hybrid.gguf",
                                 synth.preset("qwen35", "tiny", seed=3, n_mtp=1))


@pytest.fixture(scope="module")
def no_mtp(tmp_path_factory):
    return synth.write_synthetic(tmp_path_factory.mktemp("spec") / "plain.gguf",
                                 synth.preset("qwen35", "tiny", seed=3, n_mtp=0))


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, n)]


class Oracle:
    """Drafts the recorded continuation `ref` of the prompts given (by absolute position), each position kept with
    probability `rate` (drawn independently), otherwise replaced by the next token id."""

    def __init__(self, engine, rate, seed=0):
        self.engine, self.rate = engine, rate
        self.rng = np.random.default_rng(seed)
        self.by_pos: dict[int, int] = {}
        self.offered = 0

    def learn(self, prompt, ref):
        for i, t in enumerate(ref):
            self.by_pos[len(prompt) + i] = t

    def __call__(self, pos, token):
        want = self.by_pos.get(pos)
        if want is None:
            return token
        self.offered += 1
        return want if self.rng.random() < self.rate else (want + 1) % self.engine.n_vocab


def _run(engine, prompt, **kw):
    toks, finals = generate_all(engine, prompt, **kw)
    return [(e.index, e.token_id, e.text) for e in toks], finals


def _state(engine):
    """The sequence's tokens and every layer's K/V and running state (the drafter's own K/V left out)."""
    h = engine.seq.hashes()
    return engine.seq.pos, {k: v for k, v in h.items() if k == "tokens" or k.startswith(("kv", "running"))}


def _ids(toks):
    return [t for _, t, _ in toks]


@pytest.mark.parametrize("split", [None, "2"], ids=["1stage", "2stages"])
def test_greedy_equals_spec0(model, split):
    """--spec N (N = 1..4) at acceptance 1, 0.6 and 0 emits what --spec 0 does and leaves the same state; a
    max_tokens that ends inside a verify commits the position decoding one at a time reaches."""
    prompt = _prompt(23, 1)
    base = Engine(model, n_ctx=256, layer_split=split)
    ref, fin0 = _run(base, prompt)
    ref_state = _state(base)
    short, _ = _run(base, prompt, max_tokens=7)
    short_state = _state(base)
    assert fin0[0].timings["draft_n"] == 0
    for n in (1, 2, 3, 4):
        e = Engine(model, n_ctx=256, layer_split=split, spec=n)
        for rate in (1.0, 0.6, 0.0):
            oracle = Oracle(e, rate, seed=n)
            oracle.learn(prompt, _ids(ref))
            e.drafter.oracle = oracle
            got, fin = _run(e, prompt, cache_prompt=False)
            assert got == ref, (n, rate)
            assert _state(e) == ref_state, (n, rate)
            t = fin[0].timings
            assert t["draft_n"] > 0 and t["draft_n"] >= t["draft_n_accepted"]
            if rate == 1.0:
                assert t["draft_n_accepted"] == t["draft_n"]
                assert t["draft_verifies"] < len(ref) // 2 + 1 or n == 1
            if rate == 0.0:
                assert t["draft_n_accepted"] == 0
            got, _ = _run(e, prompt, cache_prompt=False, max_tokens=7)
            assert got == short and _state(e) == short_state, (n, rate)


def test_stop_string_and_eog_inside_a_verify(model):
    """A stop string and an end-of-generation token met inside a verify's tokens end the choice there, with the
    text and the state that decoding without drafts gives."""
    prompt = _prompt(17, 35)                # a continuation that changes token a few times
    base = Engine(model, n_ctx=256)
    ref, _ = _run(base, prompt, max_tokens=24)
    ids = _ids(ref)
    # the first token that is new after the 4th: its text starts the stop string, its id is made an EOG after
    i = next(j for j in range(4, len(ids)) if ids[j] not in ids[:j])
    stop = ref[i][2][:4]
    assert stop.strip() and stop not in "".join(t for _, _, t in ref[:i])
    want, fin0 = _run(base, prompt, max_tokens=24, stop=[stop], cache_prompt=False)
    want_state = _state(base)
    e = Engine(model, n_ctx=256, spec=4)
    oracle = Oracle(e, 1.0)
    oracle.learn(prompt, ids)
    e.drafter.oracle = oracle
    got, fin = _run(e, prompt, max_tokens=24, stop=[stop], cache_prompt=False)
    assert got == want and fin[0].finish_reason == fin0[0].finish_reason == "stop"
    assert fin[0].text == fin0[0].text and _state(e) == want_state and fin[0].timings["draft_verifies"] >= 1
    for eng in (base, e):
        eng.decoder.eog_ids = set(eng.eog_ids) | {ids[i]}
    want, fin0 = _run(base, prompt, max_tokens=24, ignore_eos=False, cache_prompt=False)
    want_state = _state(base)
    got, fin = _run(e, prompt, max_tokens=24, ignore_eos=False, cache_prompt=False)
    assert got == want and len(got) == i and fin[0].finish_reason == fin0[0].finish_reason == "stop"
    assert fin[0].timings["predicted_n"] == fin0[0].timings["predicted_n"] == i + 1 and _state(e) == want_state


def test_checkpoints_resumed_mid_conversation(model):
    """Two conversations interleaved with checkpoints at their cut points: the second turn of the first restores a
    checkpoint taken at a committed position; every answer and the resume points match --spec 0."""
    a1 = _prompt(30, 3)
    b1 = _prompt(26, 4)

    def script(e, oracle):
        out = []
        ans_a, fa = _run(e, a1, cut_points=[(12, "message"), (30, "turn")], max_tokens=13)
        out.append((_ids(ans_a), fa[0].strata["resume_from"]))
        if oracle is not None:
            oracle.learn(a1, _ids(ans_a))
        ans_b, fb = _run(e, b1, cut_points=[(10, "message")], max_tokens=9)
        out.append((_ids(ans_b), fb[0].strata["resume_from"]))
        a2 = a1 + _ids(ans_a) + _prompt(8, 5)
        ans2, f2 = _run(e, a2, cut_points=[(12, "message"), (30, "message"), (30 + 13, "message"), (len(a2), "turn")],
                        max_tokens=17)
        out.append((_ids(ans2), f2[0].strata["resume_from"], f2[0].strata["resume_pos"]))
        return out, _state(e)

    want, want_state = script(Engine(model, n_ctx=256), None)
    assert want[2][1] in ("checkpoint", "park")         # the second turn restored something
    # the oracle learns each answer of the run without drafts (by position)
    ref_engine = Engine(model, n_ctx=256)
    for n in (2, 4):
        for rate in (1.0, 0.5):
            e = Engine(model, n_ctx=256, spec=n)
            oracle = Oracle(e, rate, seed=7)
            oracle.learn(a1, want[0][0])
            oracle.learn(b1, want[1][0])
            oracle.learn(a1 + want[0][0] + _prompt(8, 5), want[2][0])
            e.drafter.oracle = oracle
            got, got_state = script(e, None)
            assert got == want and got_state == want_state, (n, rate)
    del ref_engine


def test_n_choices_and_sampling_seeded(model):
    """n > 1 greedy choices all equal --spec 0's; a seeded sampled choice with drafts is reproducible."""
    prompt = _prompt(15, 6)
    base = Engine(model, n_ctx=256)
    ref, _ = _run(base, prompt, n=3, max_tokens=12)
    e = Engine(model, n_ctx=256, spec=3)
    oracle = Oracle(e, 0.7)
    oracle.learn(prompt, [t for i, t, _ in ref if i == 0])
    e.drafter.oracle = oracle
    got, fins = _run(e, prompt, n=3, max_tokens=12, cache_prompt=False)
    assert got == ref and len(fins) == 3
    samp = SamplingParams(temperature=0.9, top_k=40, seed=11)
    runs = []
    for _ in range(2):           # the same seed and the same drafts: the same answer
        e.drafter.oracle = Oracle(e, 0.7)
        e.drafter.oracle.learn(prompt, [t for i, t, _ in ref if i == 0])
        runs.append(_run(e, prompt, sampling=samp, max_tokens=12, cache_prompt=False))
    assert runs[0][0] == runs[1][0] and runs[0][1][0].timings["draft_n"] > 0


def test_request_opt_out_and_drafts_under_a_grammar(model):
    """A request's spec=False decodes without drafts; under a grammar the drafts are checked and consumed by the
    grammar, each verified row masked by the state after the drafts before it and the rejected ones rolled back:
    the constrained answer with drafts (acceptance 1, 0.5, 0) is the one without, token for token."""
    from strata.sampling import grammar
    prompt = _prompt(12, 8)
    e = Engine(model, n_ctx=256, spec=2)
    _, fin = _run(e, prompt, spec=False, max_tokens=6)
    assert fin[0].timings["draft_n"] == 0 and fin[0].timings["predicted_n"] == 6
    _, fin = _run(e, prompt, max_tokens=6, cache_prompt=False)
    assert fin[0].timings["draft_n"] > 0
    base = Engine(model, n_ctx=256)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    # three-digit numbers between commas: a wrong digit drafted is consumed by the grammar (it allows any digit)
    # and moves it on, so a verify that rejects it must roll it back or the commas land elsewhere
    lark = 'start: NUM ("," NUM)*\nNUM: /[0-9][0-9][0-9]/'
    for g in (grammar.json_schema_grammar(schema), grammar.lark_grammar(lark)):
        _drafts_under(g, model, base, prompt)


def _drafts_under(g, model, base, prompt):
    """--spec 2 and 4 at acceptance 1, 0.5, 0 and the real head under the grammar g equal `base` (--spec 0)."""
    from strata.sampling import grammar

    def constrained(eng):
        c = grammar.Constraint(g, eng.tokenizer, eng.n_vocab)
        return _run(eng, prompt, constraint=c, max_tokens=24, ignore_eos=False, cache_prompt=False)
    want, fin0 = constrained(base)
    assert fin0[0].timings["predicted_n"] >= 4
    for n in (2, 4):
        e = Engine(model, n_ctx=256, spec=n)
        for rate in (1.0, 0.5, 0.0):
            oracle = Oracle(e, rate, seed=n)
            oracle.learn(prompt, _ids(want))
            e.drafter.oracle = oracle
            got, fin = constrained(e)
            assert got == want, (n, rate)
            t = fin[0].timings
            assert t["draft_n"] > 0, (n, rate)
            if rate == 1.0:
                assert t["draft_n_accepted"] == t["draft_n"] and t["draft_verifies"] < len(want)
    # the real head's drafts (mostly outside the grammar: cut at the first one it does not allow)
    e = Engine(model, n_ctx=256, spec=3)
    got, _ = constrained(e)
    assert got == want


def test_session_file_keeps_the_drafter_kv(model, tmp_path):
    """A conversation decoded with drafts, saved to a session file and restored after another one, continues as
    --spec 0 does; the drafter's K/V travels with it."""
    p1 = _prompt(20, 9)
    p2 = _prompt(18, 10)

    def script(e):
        a, _ = _run(e, p1, max_tokens=10)
        e.slot_save(0, "conv.bin")
        cap = e.seq.capture()              # a capture holds its pages: released once read
        part = cap.parts[-1]
        draft_len = part.kv["draft"].length if "draft" in part.kv else None
        cap.release()
        _run(e, p2, max_tokens=5)
        e.slot_restore(0, "conv.bin")
        cap = e.seq.capture()
        after = cap.parts[-1]
        restored_len = after.kv["draft"].length if "draft" in after.kv else None
        cap.release()
        b, fb = _run(e, p1 + _ids(a) + _prompt(5, 11), max_tokens=10)
        return _ids(a), _ids(b), fb[0].strata["resume_from"], draft_len, restored_len

    d0, d1 = tmp_path / "s0", tmp_path / "s1"
    d0.mkdir()
    d1.mkdir()
    want = script(Engine(model, n_ctx=256, slot_save_path=str(d0)))
    e = Engine(model, n_ctx=256, slot_save_path=str(d1), spec=3)
    oracle = Oracle(e, 0.8)
    oracle.learn(p1, want[0])
    oracle.learn(p1 + want[0] + _prompt(5, 11), want[1])
    e.drafter.oracle = oracle
    got = script(e)
    assert got[:3] == want[:3]
    assert got[3] is not None and got[3] > 0 and got[4] == got[3]     # the drafter's K/V saved and restored


def test_refusals(model, no_mtp):
    with pytest.raises(ValueError, match="MTP head"):
        Engine(no_mtp, n_ctx=64, spec=2, spec_draft="mtp")
    with pytest.raises(ValueError, match="--spec must be in"):
        Engine(model, n_ctx=64, spec=16)
    with pytest.raises(ValueError, match="--spec-min-p"):
        Engine(model, n_ctx=64, spec=1, spec_min_p=1.5)


@pytest.mark.parametrize("delay_ms", [0, 40], ids=["commit_in_order", "commit_late"])
def test_remote_stage_over_loopback(model, workers, delay_ms):
    """The last layers on a real worker process (loopback): the main drafts beside the head, the verify is a
    Forward with want_all, the worker rolls its running state back at the Commit (+spec). A second turn restores
    a checkpoint kept on the worker, then another conversation; a worker that applies Commits late (the link's test
    hook) gives the same answers (the settle before the next Forward and before a prompt)."""
    env = {"STRATA_TEST_COMMIT_DELAY_MS": str(delay_ms)} if delay_ms else None
    w = workers("--model", str(model), env=env)
    a1, b1 = _prompt(24, 14), _prompt(21, 15)

    def script(e):
        ra, _ = _run(e, a1, cut_points=[(10, "message"), (24, "turn")], max_tokens=12)
        a2 = a1 + _prompt(6, 16)           # the answer edited away: the turn's checkpoint at 24 is restored
        r2, f2 = _run(e, a2, cut_points=[(10, "message"), (24, "message"), (len(a2), "turn")], max_tokens=14)
        rb, _ = _run(e, b1, cut_points=[(8, "message")], max_tokens=9)
        return [_ids(ra), _ids(r2), _ids(rb)], f2[0].strata["resume_from"]

    want, _ = script(Engine(model, n_ctx=256, prompt_cache=4))
    for split in ("2", "3"):           # the worker's carve with a GDN layer, and attention only
        e = Engine(model, n_ctx=256, ubatch=32, prompt_cache=4, remote_stage=w.address, layer_split=split, spec=3)
        try:
            oracle = Oracle(e, 0.7, seed=3)
            oracle.learn(a1, want[0])
            oracle.learn(a1 + _prompt(6, 16), want[1])
            oracle.learn(b1, want[2])
            e.drafter.oracle = oracle
            got, got_how = script(e)
            assert got == want, split
            assert got_how == "checkpoint"
            assert e.spec_totals.accepted > 0 and e.spec_totals.drafted > e.spec_totals.accepted
        finally:
            e.close()


def test_min_p_stops_drafting(model):
    """--spec-min-p above any draft probability the random head gives drafts nothing; the output is unchanged."""
    prompt = _prompt(14, 12)
    ref, _ = _run(Engine(model, n_ctx=256), prompt, max_tokens=8)
    e = Engine(model, n_ctx=256, spec=3, spec_min_p=0.99)
    got, fin = _run(e, prompt, max_tokens=8)
    assert got == ref and fin[0].timings["draft_n"] == 0


def test_penalties_logprobs_and_cancel(model):
    """Greedy with repetition penalties and logprobs: the same tokens, logprobs and alternatives as --spec 0; a
    cancel set after the k-th token ends both at the same token and state."""
    prompt = _prompt(19, 13)
    pen = SamplingParams(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.5, repeat_last_n=64)

    def events(e, **kw):
        out = []
        for ev in e.generate(GenerationRequest(prompt_tokens=list(prompt), sampling=pen, max_tokens=20,
                                               ignore_eos=True, logprobs=3, cache_prompt=False, **kw)):
            if not isinstance(ev, FinalEvent):
                out.append((ev.token_id, ev.text, ev.logprob, ev.top_logprobs))
        return out

    base = Engine(model, n_ctx=256)
    want = events(base)
    e = Engine(model, n_ctx=256, spec=3)
    oracle = Oracle(e, 0.8)
    oracle.learn(prompt, [t for t, *_ in want])
    e.drafter.oracle = oracle
    assert events(e) == want

    def cancelled(eng, k):
        import threading
        cancel = threading.Event()
        got = []
        for ev in eng.generate(GenerationRequest(prompt_tokens=list(prompt), sampling=pen, max_tokens=20,
                                                 ignore_eos=True, cache_prompt=False, cancel=cancel)):
            if isinstance(ev, FinalEvent):
                return got, ev.finish_reason, _state(eng)
            got.append(ev.token_id)
            if len(got) == k:
                cancel.set()
    for k in (3, 8):
        e.drafter.oracle = Oracle(e, 1.0)
        e.drafter.oracle.learn(prompt, [t for t, *_ in want])
        assert cancelled(e, k) == cancelled(base, k)


# ---- the verbs themselves: verify + Commit against reading the same tokens one forward at a time (hypothesis) ------

@pytest.fixture(scope="module")
def pair(model):
    """Two engines' live sequences over the same model: one verifies and commits, the other reads plainly."""
    return Engine(model, n_ctx=256, layer_split="2", prompt_cache=0), Engine(model, n_ctx=256, prompt_cache=0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hs.data())
def test_verify_commit_equals_reading(pair, data):
    """Random rounds of (verify k tokens, Commit to a position it read) on two stages leave the sequence in the
    state a plain read of the committed tokens gives on one (every layer's K/V and running state, the token ids);
    a Commit outside the kept positions is refused and changes nothing."""
    spec_e, ref_e = pair
    a, b = spec_e.seq, ref_e.seq
    a.reset()
    b.reset()
    prompt = data.draw(hs.lists(hs.integers(0, 999), min_size=1, max_size=20))
    a.forward(prompt)
    b.forward(prompt)
    for _ in range(data.draw(hs.integers(1, 5))):
        k = data.draw(hs.integers(1, 16))
        toks = data.draw(hs.lists(hs.integers(0, 999), min_size=k, max_size=k))
        base = a.pos
        a.verify(toks)
        keep = data.draw(hs.integers(1, k))
        bad = data.draw(hs.sampled_from([None, base, base + k + 1]))
        if bad is not None:
            with pytest.raises(ValueError):
                a.commit(bad)
            assert a.pos == base + k
        a.commit(base + keep)
        b.forward(toks[:keep])
        assert _state(spec_e) == _state(ref_e)


def test_consumer_closing_inside_a_verify(model):
    """A consumer that goes away inside a verify's tokens (the iterator closed) leaves the sequence committed where
    decoding one at a time leaves it, and the next request runs."""
    prompt = _prompt(16, 21)
    base = Engine(model, n_ctx=256)
    ref, _ = _run(base, prompt, max_tokens=20)
    e = Engine(model, n_ctx=256, spec=4)

    def close_after(eng, k):
        it = eng.generate(GenerationRequest(prompt_tokens=list(prompt), max_tokens=20, ignore_eos=True,
                                            cache_prompt=False))
        for _ in range(k):
            next(it)
        it.close()
        return _state(eng)

    for k in (2, 5):
        e.drafter.oracle = Oracle(e, 1.0)
        e.drafter.oracle.learn(prompt, _ids(ref))
        assert close_after(e, k) == close_after(base, k)
        got, _ = _run(e, prompt, max_tokens=20, cache_prompt=False)
        assert got == ref


@pytest.mark.parametrize("split", [None, "2"], ids=["1stage", "2stages"])
def test_greedy_verify_judged_from_picks(model, split, monkeypatch, greedy_rows_calls):
    """The decoder's device path driven on the CPU (its last stage's runner made to leave logits "on the device",
    numpy here): a greedy request judges each verify from its rows' greedy picks (DeviceSampler.greedy_rows,
    counted) and emits what --spec 0 emits, at acceptance 1, 0.6 and 0; with logprobs it judges host rows (no
    picks) and emits the same tokens as --spec 0."""
    calls = greedy_rows_calls
    prompt = _prompt(21, 7)
    base = Engine(model, n_ctx=256, layer_split=split)
    e = Engine(model, n_ctx=256, spec=3, layer_split=split)
    for eng in (base, e):            # a "device" that is the host: its arrays numpy's
        eng.stages[-1].runner.device_logits = True
        monkeypatch.setattr(type(eng.stages[-1].runner.model.backend), "asarray", staticmethod(np.asarray),
                            raising=False)
    ref, _ = _run(base, prompt, cache_prompt=False)
    ref_host, _ = _run(Engine(model, n_ctx=256, layer_split=split), prompt, cache_prompt=False)
    assert _ids(ref) == _ids(ref_host)                  # the device sampler's greedy picks: the host's
    for rate in (1.0, 0.6, 0.0):
        oracle = Oracle(e, rate, seed=5)
        oracle.learn(prompt, _ids(ref))
        e.drafter.oracle = oracle
        calls.clear()
        got, fin = _run(e, prompt, cache_prompt=False)
        assert _ids(got) == _ids(ref), rate
        assert len(calls) == fin[0].timings["draft_verifies"] > 0, rate
    lp = SamplingParams(temperature=0, logprobs=2)
    ref_lp, _ = _run(base, prompt, cache_prompt=False, sampling=lp)
    calls.clear()
    e.drafter.oracle = Oracle(e, 0.6, seed=5)
    e.drafter.oracle.learn(prompt, _ids(ref))
    got_lp, fin = _run(e, prompt, cache_prompt=False, sampling=lp)
    assert _ids(got_lp) == _ids(ref_lp) and not calls and fin[0].timings["draft_verifies"] > 0


def _drive(policy, ok, step=10.0, rounds=None, tokens=None):
    """Run `policy` over the acceptance sequence ok (ok[p]: the draft of position p would be kept) with fixed
    costs: a plain step `step`, a verify round of k drafts rounds[k] (default 15 + 2k) -> the choices made."""
    rounds = rounds or {k: 15.0 + 2 * k for k in range(1, 9)}
    pos, choices = 0, []
    end = len(ok) if tokens is None else tokens
    while pos < end - 1:
        n = min(policy.choose(), end - pos - 1)
        choices.append(n)
        if n == 0:
            policy.plain_step(step)
            pos += 1
            continue
        k = 0
        while k < n and ok[pos + 1 + k]:
            k += 1
        policy.verified(n, k, 0.2 * rounds[n], 0.7 * rounds[n], 0.1 * rounds[n])
        pos += k + 1
    return choices


def _seq(rates, n, seed=0):
    """Acceptance per position: rates[i] over the i-th equal part of n positions (a fixed RNG)."""
    rng = np.random.default_rng(seed)
    return [bool(rng.random() < rates[min(len(rates) - 1, p * len(rates) // n)]) for p in range(n)]


def test_adaptive_n_policy():
    """AdaptiveN with fixed costs, on deterministic acceptance sequences (no clock): plain steps until a warm one is
    timed; at acceptance 0.95 nearly every step drafts, mostly the most drafts; at 0.1 nearly none, probes spaced
    out (the gap doubling up to probe_max); a change from 0.1 to 0.95 mid-answer found by the probes and one from
    0.95 to 0.1 by the verdicts; the acceptance counted per depth (a draft after a rejection not counted)."""
    from strata.engine.spec_policy import AdaptiveN
    a = AdaptiveN(4)
    assert a.choose() == 0
    a.plain_step(30.0)                              # the first plain step: cold, not priced against
    assert a.choose() == 0
    a.plain_step(10.0)
    assert a.t_step == 10.0 and a.choose() > 0

    high = _drive(AdaptiveN(4), _seq([0.95], 600))
    assert sum(c == 0 for c in high) <= 6 and sum(c == 4 for c in high) >= 0.8 * len(high)

    low_policy = AdaptiveN(4, probe_max=32)
    low = _drive(low_policy, _seq([0.1], 600))
    probes = [i for i, c in enumerate(low) if c > 0]
    assert 4 <= len(probes) <= 30 and low_policy.a < 0.3
    assert max(b - a for a, b in zip(probes, probes[1:])) == 32          # the gap grew to probe_max, not past

    up = _drive(AdaptiveN(4), _seq([0.1, 0.95], 800))
    half = len(up) // 2
    assert sum(c > 0 for c in up[:half]) < 0.2 * half                   # mostly plain steps at 0.1
    assert up[-40:].count(4) >= 30                                      # drafting found again at 0.95
    down = _drive(AdaptiveN(4), _seq([0.95, 0.1], 800))
    tail = down[-150:]
    assert sum(c > 0 for c in tail) < 0.2 * len(tail)

    d = AdaptiveN(3)
    d.plain_step(10.0)
    d.plain_step(10.0)
    d.verified(3, 1, 1.0, 1.0)        # depth 1 kept, depth 2 rejected, depth 3 never tried
    assert d.trials[1:] == [1.0, 1.0, 0.0] and d.succ[1:] == [1.0, 0.0, 0.0]
    acc = d.acceptance()
    assert acc[1] > d.prior > acc[2] and acc[3] == acc[2]              # an untried depth leans on the one before


def test_adaptive_n_prices_what_it_timed():
    """Costs: the median of the warm times of each size (the first of each dropped), an untimed size on the line
    through the timed ones, and drafting stops paying when a round costs too much beside a plain step."""
    from strata.engine.spec_policy import AdaptiveN
    a = AdaptiveN(4)
    for t in (50.0, 10.0, 11.0, 9.0):
        a.plain_step(t)
    assert a.t_step == 10.0
    for k, t in ((2, 99.0), (2, 14.0), (2, 16.0), (4, 99.0), (4, 20.0)):
        a.verified(k, k, 0.0, t)
    assert a.cost(2) == 15.0 and a.cost(4) == 20.0
    assert a.cost(3) == 17.5 and a.cost(1) == 12.5                     # slope (20 - 15) / 2
    for _ in range(40):
        a.verified(4, 4, 0.0, 20.0)
    assert a.best() == 4
    for _ in range(9):                                                  # rounds now cost five plain steps
        a.verified(4, 4, 0.0, 50.0)
        a.verified(2, 2, 0.0, 50.0)
    assert a.best() == 0


def test_adaptive_greedy_equals_spec0(model):
    prompt = _prompt(23, 1)
    ref, _ = _run(Engine(model, n_ctx=256), prompt)
    e = Engine(model, n_ctx=256, spec=4, spec_adaptive=True)
    for rate in (1.0, 0.0):
        oracle = Oracle(e, rate)
        oracle.learn(prompt, _ids(ref))
        e.drafter.oracle = oracle
        got, fin = _run(e, prompt, cache_prompt=False)
        assert got == ref and fin[0].timings["draft_verifies"] > 0


def test_spec_max_ctx_turns_drafting_off_past_a_context_length(model):
    """--spec-max-ctx: no verify starts once the sequence holds that many tokens (plain decode steps from there, the
    same answer); below the prompt's length nothing is drafted; a negative value is refused."""
    prompt = _prompt(23, 1)
    base = Engine(model, n_ctx=256)
    ref, _ = _run(base, prompt)
    e_all = Engine(model, n_ctx=256, spec=2)
    e_cut = Engine(model, n_ctx=256, spec=2, spec_max_ctx=33)
    e_none = Engine(model, n_ctx=256, spec=2, spec_max_ctx=10)
    fins = {}
    for name, e in (("all", e_all), ("cut", e_cut), ("none", e_none)):
        oracle = Oracle(e, 1.0)
        oracle.learn(prompt, _ids(ref))
        e.drafter.oracle = oracle
        got, fin = _run(e, prompt, cache_prompt=False)
        assert got == ref, name
        fins[name] = fin[0].timings
    assert fins["none"]["draft_n"] == 0
    # a verify starts at positions 23, 26, ... while below 33: 4 verifies of 2 drafts, then plain steps
    assert 0 < fins["cut"]["draft_n"] < fins["all"]["draft_n"]
    assert fins["cut"]["draft_verifies"] == 4
    with pytest.raises(ValueError, match="--spec-max-ctx"):
        Engine(model, n_ctx=64, spec=1, spec_max_ctx=-1)


def test_policy_replay_accounts_rounds_and_steps():
    """bench/spec_policy_sim.py's replay, without jitter, against hand arithmetic: N = 0 spends a plain step a
    token; N = 2 with every draft kept over 10 tokens spends three rounds of two drafts and one plain step (the last
    token: no room for drafts), and a round where the first draft is rejected emits one token."""
    from bench.spec_policy_sim import Costs, simulate
    c = Costs(step=1.0, step_drafter_on=1.1, draft={1: 0.1, 2: 0.2}, verify={1: 1.2, 2: 1.4}, commit=0.05, round=0.25)
    rng = np.random.default_rng(0)
    r = simulate(0, c, np.ones(10, bool), rng, 0.0, 0.0)
    assert r["seconds"] == pytest.approx(10.0) and r["verifies"] == 0
    r = simulate(2, c, np.ones(10, bool), rng, 0.0, 0.0)
    assert r["verifies"] == 3 and r["accepted"] == 6 and r["plain"] == 1
    assert r["seconds"] == pytest.approx(3 * (0.2 + 1.4 + 0.05 + 0.25) + 1.1)
    r = simulate(1, c, np.zeros(4, bool), rng, 0.0, 0.0)
    assert r["verifies"] == 3 and r["accepted"] == 0 and r["plain"] == 1
    assert r["seconds"] == pytest.approx(3 * (0.1 + 1.2 + 0.05 + 0.25) + 1.1)
