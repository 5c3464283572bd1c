"""Engine tests on the real default model: answers, stop strings, limits, cancel, seeds, overflow, exactness."""
from __future__ import annotations

import pytest

from strata.engine import ContextOverflow, EmptyPrompt, FinalEvent, GenerationRequest
from strata.sampling.sampler import SamplingParams
from tests.helpers import answer

# SmolLM2-135M answers the bare "What is the capital of France?" with "L'Étoile, ..." under its template's
# default system prompt (llama.cpp on the same GGUF gives the same text); asking for a sentence gives Paris.
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(default_model_path):
    from strata.engine import Engine
    return Engine(default_model_path, n_ctx=2048, ubatch=64)


def run(engine, messages=FRANCE, **kw):
    """(text, token events, final event) of one request on a chat."""
    kw.setdefault("sampling", GREEDY)
    a = answer(engine, messages, kw.pop("max_tokens", 40), ignore_eos=kw.pop("ignore_eos", False), **kw)
    return a.text, a.tokens, a.final


def test_greedy_answers_paris(engine):
    text, toks, final = run(engine)
    assert "Paris" in text
    assert final.finish_reason == "stop"                       # ended on <|im_end|>, which is not emitted
    assert "<|im_end|>" not in text and final.strata["stopped_by"] == "<|im_end|>"
    u = final.usage
    assert u["completion_tokens"] == len(toks) + 1             # the EOG token counts, like llama.cpp
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    t = final.timings
    assert t["prompt_n"] + t["cache_n"] == u["prompt_tokens"] and t["predicted_n"] == u["completion_tokens"]


def test_stop_string_spanning_tokens(engine):
    full, toks, _ = run(engine)
    # a stop string made of the end of one token's text and the start of the next one's
    i = next(k for k in range(len(toks) - 1) if len(toks[k].text) >= 2 and len(toks[k + 1].text) >= 2
             and toks[k + 1].text.strip())
    stop = toks[i].text[-2:] + toks[i + 1].text[:2]
    assert not any(stop in e.text for e in toks)               # no single token holds it
    text, stoks, final = run(engine, stop=["never-appears", stop])
    assert final.finish_reason == "stop" and final.strata["stopped_by"] == stop
    assert stop not in text
    assert text == full[:full.index(stop)]
    assert len(stoks) == i + 2                                 # ended on the token that completed the stop


def test_stop_string_single_token(engine):
    text, _, final = run(engine, stop=["Paris"])
    assert final.finish_reason == "stop" and "Paris" not in text and text.strip()


def test_max_tokens_gives_length(engine):
    text, toks, final = run(engine, max_tokens=3)
    assert final.finish_reason == "length"
    assert len(toks) == 3 and final.usage["completion_tokens"] == 3
    _, toks0, final0 = run(engine, max_tokens=0)
    assert final0.finish_reason == "length" and toks0 == []


def test_cancel_mid_decode_then_next_request_matches_fresh_engine(engine, default_model_path):
    from strata.engine import Engine
    r = engine.render_chat(STORY)
    req = GenerationRequest(prompt_tokens=r.tokens, cut_points=r.cut_points, sampling=GREEDY, max_tokens=200)
    after_cancel = 0
    final = None
    seen = 0
    for ev in engine.generate(req):
        if isinstance(ev, FinalEvent):
            final = ev
            break
        seen += 1
        if req.cancel.is_set():
            after_cancel += 1
        if seen == 5:
            req.cancel.set()
    assert final.finish_reason == "cancelled"
    assert after_cancel <= 1
    assert final.usage["completion_tokens"] == seen
    assert engine.seq.positions() == [engine.seq.pos] * len(engine.stages)   # a consistent sequence is left behind

    text, _, final2 = run(engine)
    fresh = Engine(default_model_path, n_ctx=2048, ubatch=64)
    fresh_text, _, _ = run(fresh)
    assert text == fresh_text and "Paris" in text


def test_seeded_sampling_is_reproducible(engine):
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.0, seed=1234)
    a, _, _ = run(engine, STORY, sampling=p, max_tokens=24)
    b, _, _ = run(engine, STORY, sampling=p, max_tokens=24)
    assert a == b and a


def test_logprobs_are_reported(engine):
    _, toks, _ = run(engine, max_tokens=4, logprobs=3)
    for e in toks:
        assert e.logprob is not None and e.logprob <= 0.0
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0][2] >= e.top_logprobs[1][2] >= e.top_logprobs[2][2]
        assert e.top_logprobs[0][0] == e.token_id              # greedy picks the top token


def test_context_overflow_and_empty_prompt(engine):
    n = engine.n_ctx + 5
    with pytest.raises(ContextOverflow) as ei:
        engine.generate(GenerationRequest(prompt_tokens=[1] * n))
    assert str(n) in str(ei.value) and str(engine.n_ctx) in str(ei.value)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(EmptyPrompt):
        engine.generate(GenerationRequest(prompt_tokens=[]))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate(GenerationRequest(prompt_tokens=[1, engine.n_vocab]))
    text, _, _ = run(engine)                                   # nothing changed: the engine still answers
    assert "Paris" in text


def test_same_request_twice_is_byte_identical(engine):
    engine.clear_checkpoints()
    engine.state_reset()
    msgs = [{"role": "system", "content": "You are a terse geography tutor."}] + FRANCE
    a, _, fa = run(engine, msgs)
    ha = engine.state_hashes()
    b, _, fb = run(engine, msgs)
    hb = engine.state_hashes()
    assert a == b and "Paris" in a
    # the second read cut the K/V back to the common prefix (all but the prompt's last token) and read one token
    n = fa.usage["prompt_tokens"]
    assert (fb.strata["resume_from"], fb.strata["resume_pos"], fb.timings["cache_n"]) == ("live", n - 1, n - 1)
    assert fb.strata["parts"] == [(n - 1, n)]
    assert ha == hb                                            # same tokens, same K/V bits


def test_next_turn_resumes(engine):
    engine.state_reset()
    first, _, _ = run(engine)
    msgs = FRANCE + [{"role": "assistant", "content": first},
                     {"role": "user", "content": "What is the capital of Italy? Answer in one sentence."}]
    text, _, final = run(engine, msgs)
    assert final.strata["resume_from"] in ("live", "checkpoint") and final.timings["cache_n"] > 0
    assert final.timings["prompt_n"] < final.usage["prompt_tokens"]
    assert text.strip()


def test_prompt_cache_off_reads_one_part(default_model_path):
    from strata.engine import Engine
    e = Engine(default_model_path, n_ctx=1024, ubatch=16, prompt_cache=0)
    _, _, f1 = run(e, max_tokens=2)
    n = f1.usage["prompt_tokens"]
    assert f1.strata["parts"] == [(0, n)] and f1.strata["resume_from"] == "none"
    assert e.checkpoints() == []
    _, _, f2 = run(e, max_tokens=2)                            # the same prompt: cut back to all but its last token
    assert f2.strata["parts"] == [(n - 1, n)] and f2.strata["resume_from"] == "live"
    assert e.checkpoints() == []
    st = e.status()
    assert st["arch"] == "llama" and st["n_ctx"] == 1024 and st["kv_pages"]["used"] >= 1


def test_checkpoint_opt_out_reads_one_part_and_reuses_root(engine):
    engine.clear_checkpoints()
    engine.state_reset()
    system = {"role": "system", "content": "You are a terse geography tutor. " * 8}
    _, _, f1 = run(engine, [system] + FRANCE, max_tokens=2)
    root = next(c.pos for c in engine.render_chat([system] + FRANCE).cut_points if c.kind == "root")
    assert len(f1.strata["parts"]) >= 2 and f1.strata["parts"][0] == (0, root)
    other = [system, {"role": "user", "content": "Name a river in Spain."}]
    _, _, f2 = run(engine, other, max_tokens=2, checkpoint=False)
    n2 = f2.usage["prompt_tokens"]
    p2 = f2.strata["resume_pos"]                               # the common prefix with the live sequence
    assert f2.strata["resume_from"] == "live" and root <= p2 < n2
    assert f2.strata["parts"] == [(p2, n2)]                    # one part after the reused prefix
    _, _, f3 = run(engine, other, max_tokens=2)                # no live session was left: resume from the root
    assert f3.strata["resume_from"] == "checkpoint" and f3.strata["resume_pos"] == root


def test_trace_and_state_hash_logs(engine, monkeypatch):
    from structlog.testing import capture_logs
    monkeypatch.setenv("STRATA_TRACE", "1")
    monkeypatch.setenv("STRATA_STATE_HASH", "1")
    engine.state_reset()
    with capture_logs() as logs:
        _, _, final = run(engine, max_tokens=3)
    parts = [(e["start"], e["end"]) for e in logs if e["event"] == "prefill_part"]
    assert parts == final.strata["parts"]
    hashes = [e for e in logs if e["event"] == "state_hash"]
    assert len(hashes) == 1 and hashes[0]["kv"] == engine.state_hashes()["kv"]


def test_cancel_during_prompt_read(engine):
    engine.clear_checkpoints()
    engine.state_reset()
    r = engine.render_chat(STORY)
    req = GenerationRequest(prompt_tokens=r.tokens, cut_points=r.cut_points, sampling=GREEDY, max_tokens=5)
    req.cancel.set()
    events = list(engine.generate(req))
    assert len(events) == 1 and events[0].finish_reason == "cancelled"
    assert events[0].usage["completion_tokens"] == 0
    text, _, final = run(engine)
    assert "Paris" in text and final.strata["resume_from"] != "live"


def test_bad_cut_point_changes_nothing(engine):
    before = engine.state_hashes()
    with pytest.raises(ValueError, match="cut point"):
        engine.generate(GenerationRequest(prompt_tokens=[1, 2, 3], cut_points=[(9, "turn")]))
    with pytest.raises(ValueError, match="kind"):
        engine.generate(GenerationRequest(prompt_tokens=[1, 2, 3], cut_points=[(1, "bogus")]))
    assert engine.state_hashes() == before


def test_huge_text_is_refused_before_tokenizing(engine):
    """A 6 MB prompt: ContextOverflow with a lower bound on its tokens ("at least": the text was never tokenized,
    which takes seconds at this size), for raw text and for chat messages; a prompt that fits is tokenized."""
    from strata.engine import ContextOverflow
    text = "The river flows to the sea. " * 215_000
    with pytest.raises(ContextOverflow, match=r"at least \d+ tokens but the context holds 2048"):
        engine.tokenize_prompt(text)
    with pytest.raises(ContextOverflow, match="at least"):
        engine.render_chat([{"role": "user", "content": text}])
    assert len(engine.tokenize_prompt("The river flows to the sea. " * 50)) > 50


def test_many_small_messages_are_refused_after_one_render(engine):
    """200,000 empty messages (6.6 MB of JSON, under the daemon's default body limit): the rendered text alone shows
    that it cannot fit, so ContextOverflow comes before any tokenizing or prefix rendering."""
    from strata.engine import ContextOverflow
    with pytest.raises(ContextOverflow, match="at least"):
        engine.render_chat([{"role": "user", "content": ""}] * 200_000)


def test_n_ctx_past_the_training_context_warns(default_model_path):
    """--n-ctx above the GGUF's context_length (8192 for SmolLM2) loads, with a warning naming both numbers."""
    from structlog.testing import capture_logs

    from strata.engine import Engine
    with capture_logs() as logs:
        e = Engine(default_model_path, n_ctx=8200, prompt_cache=0)
    w = [r for r in logs if r["log_level"] == "warning" and "training context" in r["event"]]
    assert e.n_ctx == 8200 and len(w) == 1 and w[0]["n_ctx"] == 8200 and w[0]["n_ctx_train"] == 8192
    with capture_logs() as logs:
        Engine(default_model_path, n_ctx=512, prompt_cache=0)
    assert not [r for r in logs if "training context" in r["event"]]


def test_cancel_between_choices_ends_the_rest_with_no_tokens(engine):
    r = engine.render_chat(FRANCE)
    req = GenerationRequest(prompt_tokens=r.tokens, cut_points=r.cut_points, max_tokens=6, n=3,
                            sampling=SamplingParams(temperature=0.8, seed=3))
    finals = []
    for ev in engine.generate(req):
        if isinstance(ev, FinalEvent):
            finals.append(ev)
            req.cancel.set()                       # after choice 0 ends
        else:
            assert ev.index == 0
    assert [f.index for f in finals] == [0, 1, 2]
    assert [f.finish_reason for f in finals][1:] == ["cancelled", "cancelled"]
    assert all(f.usage["completion_tokens"] == 0 for f in finals[1:])
    text, _, _ = run(engine)                       # the engine carries on as usual
    assert "Paris" in text


def test_n_must_be_a_positive_integer(engine):
    r = engine.render_chat(FRANCE)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            engine.generate(GenerationRequest(prompt_tokens=r.tokens, n=bad))


def test_max_tokens_past_the_training_context_is_refused_at_once(engine):
    from strata.engine import MaxTokensTooLarge
    r = engine.render_chat(FRANCE)
    with pytest.raises(MaxTokensTooLarge, match="max_tokens is 8193, more than the model's training context of 8192"):
        engine.generate(GenerationRequest(prompt_tokens=r.tokens, max_tokens=8193))
    engine.validate(GenerationRequest(prompt_tokens=r.tokens, max_tokens=8192))     # within it: accepted
    if engine.n_ctx < 8192:                       # the refusal says what happens within it on this server
        with pytest.raises(MaxTokensTooLarge, match=f"fills this server's context of {engine.n_ctx} tokens"):
            engine.validate(GenerationRequest(prompt_tokens=r.tokens, max_tokens=8193))


def test_warm_up_leaves_nothing_behind_and_changes_no_answer(default_model_path):
    from strata.engine import Engine
    from strata.engine.types import GenerationRequest
    cold = Engine(default_model_path, n_ctx=512, conversation_cache_mib=64)
    warm = Engine(default_model_path, n_ctx=512, conversation_cache_mib=64)
    w = warm.warm_up()
    assert w["reads"] == [8]                      # the CPU: one short read (a whole ubatch only on a GPU)
    assert w["short_read"] == {}                  # the CPU has no short-read / prefill crossover to measure
    assert warm.seq.pos == 0 and warm.checkpoints() == [] and warm.parked() == [] and warm.requests == 0
    assert warm.status()["warmup"] == w
    msgs = [{"role": "user", "content": "Name three colours."}]
    answers = []
    for e in (cold, warm):
        r = e.render_chat(msgs)
        evs = list(e.generate(GenerationRequest(prompt_tokens=r.tokens, cut_points=r.cut_points, max_tokens=12)))
        answers.append(([ev.token_id for ev in evs if hasattr(ev, "token_id")], evs[-1].strata["resume_from"]))
    assert answers[0] == answers[1] and answers[1][1] == "none"
