"""Speculative decoding with lookup drafts (--spec N --spec-draft lookup, the default for a model without an MTP
head): greedy output equals --spec 0 token for token and leaves the same state, on models without an MTP head
(llama: attention only; qwen35 without its MTP block and nemotron_h: Gated DeltaNet / Mamba2 running states rolled
back at each Commit), on 1 and 2 CPU stages, over turns that continue, restore a checkpoint and switch conversations, over a remote stage on
loopback and with two request slots.

The synthetic models' random weights make their greedy answers fall into repeats, which the lookup drafts almost
always right; to reach partial and no acceptance the drafts are spoiled at a chosen rate (each drafted token
replaced by the next id with probability 1 - rate) after the real lookup made them. Every draft also checks that
the drafter's index holds exactly the sequence's tokens and the token about to be read.
"""
import numpy as np
import pytest

from strata.engine.engine import Engine
from strata.engine.lookup import LookupDrafter
from strata.engine.types import FinalEvent, GenerationRequest
from tests.helpers import full_sweeps, generate_all
from tests.spec_checks import spoil
from strata.sampling.sampler import SamplingParams


@pytest.fixture(scope="module")
def models(synthetic):
    return {"llama": synthetic("llama", seed=3), "qwen35": synthetic("qwen35", seed=3, n_mtp=0),
            "nemotron_h": synthetic("nemotron_h", seed=3)}


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, n)]


def _run(engine, prompt, **kw):
    toks, finals = generate_all(engine, prompt, **kw)
    return [e.token_id for e in toks], finals


def _state(engine):
    h = engine.seq.hashes()
    return engine.seq.pos, {k: v for k, v in h.items() if k == "tokens" or k.startswith(("kv", "running"))}


def _turns(engine):
    """Three turns: a prompt with a repeated block, the same conversation continued (live), another conversation,
    then the first again (its checkpoint restored) -> each answer's token ids."""
    block = _prompt(10, 2)
    a = _prompt(9, 1) + block + _prompt(4, 3) + block[:5]
    ra, _ = _run(engine, a, cut_points=[(len(a), "turn")], max_tokens=24)
    a2 = a + ra + _prompt(5, 4)
    r2, _ = _run(engine, a2, max_tokens=20)
    rb, _ = _run(engine, _prompt(14, 5) + block, max_tokens=16)
    r3, _ = _run(engine, a + _prompt(3, 6), max_tokens=16)
    return [ra, r2, rb, r3]


ROUNDS = ((2, 1.0), (4, 0.5), (3, 0.0))         # (--spec N, the rate drafts are kept at)
# CI: one round per model and stage count, every round on some model (make test-sweeps: each of them on each)
CI_ROUND = {("llama", None): 0, ("qwen35", None): 2, ("llama", "2"): 1, ("qwen35", "2"): 0, ("nemotron_h", "3"): 1}


@pytest.mark.parametrize("arch,split", [("llama", None), ("llama", "2"), ("qwen35", None), ("qwen35", "2"),
                                        ("nemotron_h", "3")], ids=["llama-1stage", "llama-2stages", "qwen35-1stage",
                                                                   "qwen35-2stages", "nemotron_h-2stages"])
def test_greedy_equals_spec0(models, arch, split):
    """--spec 2, 4 and 3 with lookup drafts kept at rates 1, 0.5 and 0: every turn's answer is --spec 0's and the
    state after the last is the same; the drafts were made and (rate 1) mostly kept."""
    base = Engine(models[arch], n_ctx=256, prompt_cache=4, layer_split=split)
    want, want_state = _turns(base), _state(base)
    base.close()
    rounds = ROUNDS if full_sweeps() else [ROUNDS[CI_ROUND[arch, split]]]
    for n, rate in rounds:                    # a fresh engine each: the same turns from the same start
        e = Engine(models[arch], n_ctx=256, prompt_cache=4, layer_split=split, spec=n)
        assert e.spec_draft == "lookup"
        spoil(e, rate, seed=n)
        assert _turns(e) == want, (n, rate)
        assert _state(e) == want_state, (n, rate)
        drafted, accepted = e.spec_totals.drafted, e.spec_totals.accepted
        assert drafted > 0, (n, rate)
        if rate == 1.0:
            assert accepted > drafted // 2, (n, accepted, drafted)
        if rate == 0.0:
            assert accepted == 0
        e.close()


def test_sampling_seeded_n_choices_and_opt_out(models):
    """A seeded sampled answer with lookup drafts is the same from run to run; n = 3 greedy choices are --spec 0's;
    "strata_spec": false drafts nothing and answers the same."""
    m = models["llama"]
    prompt = _prompt(12, 7) * 2
    base = Engine(m, n_ctx=256)
    ref, _ = _run(base, prompt, n=3, max_tokens=16)
    base.close()
    e = Engine(m, n_ctx=256, spec=3)
    got, fins = _run(e, prompt, n=3, max_tokens=16, cache_prompt=False)
    assert got == ref and len(fins) == 3 and fins[0].timings["draft_n"] > 0
    off, fin = _run(e, prompt, n=3, max_tokens=16, cache_prompt=False, spec=False)
    assert off == ref and fin[0].timings["draft_n"] == 0
    samp = SamplingParams(temperature=1.5, top_k=0, seed=11)
    runs = [_run(e, prompt, sampling=samp, max_tokens=24, cache_prompt=False) for _ in range(2)]
    assert runs[0][0] == runs[1][0] and runs[0][1][0].timings["draft_n"] > 0
    e.close()


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_nothing_found_is_plain_steps(models, adaptive):
    """Lookups that find nothing (n-grams of 64 tokens in a shorter conversation) draft nothing: no verify runs,
    with or without the adaptive policy, and the answer is --spec 0's; the adaptive policy still drafts where the
    lookup finds something (a repeating answer)."""
    m = models["qwen35"]
    prompt = _prompt(20, 9)
    base = Engine(m, n_ctx=256)
    want, _ = _run(base, prompt, max_tokens=24)
    base.close()
    e = Engine(m, n_ctx=256, spec=4, spec_ngram_min=64, spec_ngram_max=64, spec_adaptive=adaptive)
    got, fin = _run(e, prompt, max_tokens=24)
    assert got == want and fin[0].timings["draft_verifies"] == 0 and fin[0].timings["draft_n"] == 0
    e.close()
    e = Engine(m, n_ctx=256, spec=4, spec_adaptive=adaptive)
    got, fin = _run(e, prompt, max_tokens=48)
    want, _ = _run(Engine(m, n_ctx=256), prompt, max_tokens=48)
    assert got == want and fin[0].timings["draft_n_accepted"] > 0
    e.close()


@pytest.mark.parametrize("arch,split", [("llama", "1"), ("qwen35", "2")])
def test_remote_stage_over_loopback(models, workers, arch, split):
    """The last layers on a real worker process (loopback), lookup drafts at rate 0.5: the verify is a Forward with
    want_all, the worker rolls its K/V (and running state) back at each Commit; every turn equals --spec 0."""
    m = models[arch]
    w = workers("--model", str(m), env={"STRATA_TEST_COMMIT_DELAY_MS": "20"})
    base = Engine(m, n_ctx=256, prompt_cache=4)
    want = _turns(base)
    base.close()
    e = Engine(m, n_ctx=256, ubatch=32, prompt_cache=4, remote_stage=w.address, layer_split=split, spec=3)
    try:
        spoil(e, 0.5, seed=1)
        assert _turns(e) == want
        assert e.spec_totals.accepted > 0 and e.spec_totals.drafted > e.spec_totals.accepted
    finally:
        e.close()


def test_two_slots_together_equal_alone(models):
    """Two request slots, each with its own lookup drafter, decoding together: each answer is its request's alone
    with --spec 0, and both slots drafted."""
    from tests.parallel_checks import drive
    m = models["qwen35"]
    prompts = [_prompt(9, 1) + _prompt(10, 2) * 2, _prompt(15, 8) * 2]
    base = Engine(m, n_ctx=256)
    want = [_run(base, p, max_tokens=24)[0] for p in prompts]
    base.close()
    e = Engine(m, n_ctx=256, parallel=2, spec=3)
    try:
        spoil(e, 0.7, seed=2)
        got, done = drive(e, [GenerationRequest(prompt_tokens=p, max_tokens=24, ignore_eos=True) for p in prompts],
                          [0, 2])
        assert all(err is None for err in done.values())
        assert [[ev.token_id for ev in g if not isinstance(ev, FinalEvent)] for g in got] == want
        assert all(s.decoder.drafter.drafted > 0 for s in e.slots)
        assert e.status()["spec"]["draft"] == "lookup"
    finally:
        e.close()


def test_lookup_chosen_on_a_model_with_an_mtp_head(synthetic):
    """--spec-draft lookup on a model with an MTP head drafts by lookup (auto would take the head): the answer is
    --spec 0's and the drafts were made."""
    m = synthetic("qwen35", seed=3, n_mtp=1)
    prompt = _prompt(12, 7) * 2
    base = Engine(m, n_ctx=256)
    want, _ = _run(base, prompt, max_tokens=24)
    base.close()
    auto = Engine(m, n_ctx=64, spec=2)
    assert auto.spec_draft == "mtp"
    auto.close()
    e = Engine(m, n_ctx=256, spec=3, spec_draft="lookup")
    got, fin = _run(e, prompt, max_tokens=24)
    assert e.spec_draft == "lookup" and isinstance(e.drafter, LookupDrafter)
    assert got == want and fin[0].timings["draft_n"] > 0
    e.close()
