"""The engine's conversation checkpoints on a synthetic hybrid model (qwen35moe, tiny): a repeated request resumes
from a checkpoint of the GDN running state and gives byte-identical tokens and logprobs; the restored state's
running-state hash equals the one captured."""
import numpy as np
import pytest

from strata import synth
from strata.engine import types as T
from strata.engine.engine import Engine
from strata.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = synth.write_synthetic(tmp_path_factory.mktemp("h") / "h.gguf", synth.preset("qwen35moe", seed=21))
    return Engine(str(path), n_ctx=512, ubatch=64)


def _run(e, rendered, **kw):
    req = T.GenerationRequest(prompt_tokens=rendered.tokens, cut_points=rendered.cut_points,
                              sampling=SamplingParams(temperature=0), max_tokens=8, stop=[], logprobs=1, **kw)
    evs = list(e.generate(req))
    toks = [(ev.token_id, ev.logprob) for ev in evs if hasattr(ev, "token_id")]
    return toks, evs[-1]


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
