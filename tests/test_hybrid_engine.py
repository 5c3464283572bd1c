"""The engine's conversation checkpoints on a synthetic hybrid model (qwen35moe, tiny): a repeated request resumes
from a checkpoint of the GDN running state and gives byte-identical tokens and logprobs; the restored state's
running-state hash equals the one captured."""
import numpy as np
import pytest

from strata.engine import types as T
from strata.engine.engine import Engine
from strata.sampling.sampler import SamplingParams
from tests.helpers import answer


@pytest.fixture(scope="module")
def engine(synthetic):
    return Engine(str(synthetic("qwen35moe", seed=21)), n_ctx=512, ubatch=64)


def _run(e, rendered, **kw):
    """Greedy, 8 tokens at most -> ([(token id, logprob)], FinalEvent)."""
    a = answer(e, rendered, 8, ignore_eos=False, sampling=SamplingParams(temperature=0), stop=[], logprobs=1, **kw)
    return a.logprobs, a.final


def test_repeat_resumes_from_checkpoint_exactly(engine):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
    r = engine.render_chat(msgs)
    a, fa = _run(engine, r)
    b, fb = _run(engine, r)
    assert fa.strata["resume_from"] == "none"
    assert fb.strata["resume_from"] == "checkpoint" and fb.strata["resume_pos"] > 0
    assert a == b                                    # same ids, bit-identical logprobs
    assert engine.status()["stages"][0]["memory"]["running"]["layers"] > 0


def test_running_state_hash_survives_capture_restore(engine):
    m = engine.stages[0].model
    st = m.new_state(m.new_page_pool(256))
    toks = np.random.default_rng(1).integers(0, m.config.n_vocab, 50).astype(np.int32)
    m.forward(toks[:30], st)
    snap, h = st.capture(), st.hashes()
    m.forward(toks[30:], st)
    st.restore(snap)
    assert st.hashes() == h
    st.release()


def _choices(e, rendered, n, sampling, **kw):
    req = T.GenerationRequest(prompt_tokens=rendered.tokens, cut_points=rendered.cut_points, sampling=sampling,
                              max_tokens=8, logprobs=1, n=n, **kw)
    evs = list(e.generate(req))
    toks: dict[int, list] = {}
    for ev in evs:
        if hasattr(ev, "token_id"):
            toks.setdefault(ev.index, []).append((ev.token_id, ev.logprob))
    finals = [ev for ev in evs if hasattr(ev, "finish_reason")]
    assert [f.index for f in finals] == list(range(n)) and evs[-1] is finals[-1]
    return toks, finals


def test_n_choices_read_the_prompt_once_and_restore_the_running_state(engine):
    """n = 3 seeded samples equal three separate requests with seeds s, s+1, s+2 (ids and bit-identical logprobs):
    choices 1 and 2 restore the GDN running state captured at the prompt's end and read nothing."""
    r = engine.render_chat([{"role": "user", "content": "Tell me about rivers."}])
    p = SamplingParams(temperature=20.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)   # the random model is peaked
    toks, finals = _choices(engine, r, 3, p, cache_prompt=False)
    for i in range(3):
        alone, _ = _choices(engine, r, 1, SamplingParams(temperature=20.0, top_k=0, top_p=1.0, min_p=0.0, seed=5 + i),
                            cache_prompt=False)
        assert toks.get(i, []) == alone.get(0, []), i
    assert len({tuple(t) for t in toks.values()}) > 1          # different seeds, different samples
    assert finals[0].timings["prompt_n"] == len(r.tokens)
    assert all(f.timings["prompt_n"] == 0 and f.timings["cache_n"] == len(r.tokens) and
               f.strata["resume_from"] == "choice" for f in finals[1:])


def test_n_greedy_choices_are_one_decode_repeated(engine):
    r = engine.render_chat([{"role": "user", "content": "Name three colours."}])
    toks, finals = _choices(engine, r, 3, SamplingParams(temperature=0))
    alone, _ = _choices(engine, r, 1, SamplingParams(temperature=0))
    assert toks[0] == toks[1] == toks[2] == alone[0]
    assert finals[0].timings["predicted_n"] == len(toks[0])
    assert all(f.timings["predicted_n"] == 0 and f.usage["completion_tokens"] == len(toks[0]) for f in finals[1:])
