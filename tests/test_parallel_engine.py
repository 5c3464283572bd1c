"""Request slots in the engine (--parallel N, strata/engine/scheduler.py): several requests admitted to slots and run
in engine steps together (their decodes in one batched step, prompt parts under the step's budget, a prompt arriving
while others decode) give each request the very tokens it gives run alone on a one-slot engine; the engine's own step
counters show the rows were batched; the options that cannot run with several slots are refused in one line."""
import numpy as np
import pytest

from strata.engine import Engine, GenerationRequest, TokenEvent
from strata.sampling.sampler import SamplingParams

from tests.parallel_checks import alone as _alone, key as _key, together as _together
from tests.helpers import full_sweeps


@pytest.fixture(scope="module")
def hybrid_path(synthetic):
    return synthetic("qwen35", seed=1)


@pytest.fixture(scope="module")
def default_alone(default_model_path):
    """The requests' answers alone on the default model (one-slot engine), for both slot counts below."""
    return _alone(default_model_path)


@pytest.mark.parametrize("n_slots", [2, 4])
def test_default_model_slots_answer_as_alone(default_model_path, default_alone, n_slots):
    want = default_alone
    got, stats = _together(default_model_path, n_slots)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}: its answer beside others differs from its answer alone"
    assert stats["batched_steps"] > 0 and stats["max_rows"] == n_slots, stats      # rows were read together
    assert stats["picked_rows"] > 0, stats                      # greedy rows were picked together
    assert stats["prefill_parts"] >= 3 + 5                      # the long prompt in ubatch parts, one per step


@pytest.mark.parametrize("split", [None, "2"], ids=["1stage", "2stages"])
def test_hybrid_slots_answer_as_alone(hybrid_path, split):
    want = _alone(hybrid_path, layer_split=split)
    got, stats = _together(hybrid_path, 4, layer_split=split)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}: its answer beside others differs from its answer alone"
    assert stats["batched_steps"] > 0 and stats["max_rows"] >= 2, stats


def test_slot_choice_id_slot_prefix_and_lru(default_model_path):
    e = Engine(default_model_path, n_ctx=256, device="cpu", parallel=3)
    try:
        ends = {}

        def run(prompt, **kw):
            events = []
            sid = e.admit(GenerationRequest(e.tokenize_prompt(prompt), max_tokens=4, **kw), events.append,
                          lambda err: ends.__setitem__(len(ends), err))
            while e.step():
                pass
            return sid, events[-1]

        assert run("Alpha beta gamma", id_slot=2)[0] == 2
        first = run("Delta epsilon zeta")[0]
        assert first == 0                                      # least recently used (never used: the lowest id)
        sid, final = run("Alpha beta gamma delta")
        assert sid == 2 and final.strata["resume_from"] == "live"   # the slot sharing the longest prefix
        assert final.strata["id_slot"] == 2
        with pytest.raises(ValueError, match="id_slot"):
            e.validate(GenerationRequest([1, 2], id_slot=3))
        assert all(err is None for err in ends.values())
    finally:
        e.close()


def test_a_fresh_slot_takes_the_prefix_another_slot_holds(default_model_path):
    """Raw prompts (no template cut points, so no checkpoint at their shared start): a request admitted to a fresh
    slot while another slot holds a long common prefix shares that slot's pages instead of reading them, and both
    answers (the one continuing in the other slot too: a write into a shared page copies it) equal a cold read."""
    words = "river stone garden lamp winter orange music paper engine cloud silver forest window market".split()
    base = " ".join(np.random.default_rng(3).choice(words, 160))
    e = Engine(default_model_path, n_ctx=512, device="cpu", parallel=2)
    cold = Engine(default_model_path, n_ctx=512, device="cpu")
    try:
        def first(prompt):
            events, ends = [], []
            assert e.admit(GenerationRequest(e.tokenize_prompt(prompt), max_tokens=6), events.append,
                           ends.append) == 0
            while e.step():
                pass
            return e.detokenize([ev.token_id for ev in events if isinstance(ev, TokenEvent)])

        a = base + " Question one:"
        a2 = a + first(a) + " And then?"
        b = base + " Question two:"
        got = {0: [], 1: []}
        assert e.admit(GenerationRequest(e.tokenize_prompt(a2), max_tokens=8), got[0].append, lambda err: None) == 0
        assert e.admit(GenerationRequest(e.tokenize_prompt(b), max_tokens=8), got[1].append, lambda err: None) == 1
        while e.step():
            pass
        fb = got[1][-1]
        assert fb.strata["resume_from"] == "slot" and fb.strata["resume_pos"] >= len(e.tokenize_prompt(base)) - 2
        assert fb.timings["prompt_n"] < 16
        for prompt, events in ((a2, got[0]), (b, got[1])):
            want = list(cold.generate(GenerationRequest(cold.tokenize_prompt(prompt), max_tokens=8,
                                                        cache_prompt=False)))
            assert [ev.token_id for ev in events if isinstance(ev, TokenEvent)] == \
                [ev.token_id for ev in want if isinstance(ev, TokenEvent)]
    finally:
        e.close()
        cold.close()


def test_options_refused_with_several_slots(default_model_path, tmp_path):
    with pytest.raises(ValueError, match=r"--parallel 4 needs a KV pool of 4 contexts: --kv-pool-ctx 1000"):
        Engine(default_model_path, n_ctx=512, device="cpu", parallel=4, kv_pool_ctx=1000)
    # --spec runs with several slots: a model without an MTP head is refused MTP drafts for that alone
    with pytest.raises(ValueError, match=r"^--spec needs a model with an MTP head"):
        Engine(default_model_path, n_ctx=512, device="cpu", parallel=2, spec=2, spec_draft="mtp")
    with pytest.raises(ValueError, match=r"--parallel must be an integer >= 1"):
        Engine(default_model_path, n_ctx=512, device="cpu", parallel=0)


def test_parallel_auto_takes_four_slots_where_the_memory_holds_them_else_one(default_model_path, monkeypatch):
    """--parallel auto (strata serve's default): four slots and a pool of four contexts where the device holds them
    beside the weights and its margin, whole contexts of a --kv-pool-ctx given, one slot with a remote stage or where
    the memory left is short (MemAvailable made small here)."""
    from strata.engine.config import EngineConfig

    def pages(e):
        return e.stages[0].memory.stats()["kv"]["pages_total"]

    e = Engine(default_model_path, n_ctx=512, device="cpu", parallel="auto")
    one_ctx = -(-512 // e.stages[0].memory.stats()["kv"]["page_size"])
    assert e.parallel == 4 and len(e.slots) == 4 and pages(e) == 4 * one_ctx
    e.close()
    e = Engine(default_model_path, n_ctx=512, device="cpu", parallel="auto", kv_pool_ctx=1100)
    assert e.parallel == 2 and len(e.slots) == 2
    e.close()
    assert EngineConfig.build(parallel="auto", remote_stage="127.0.0.1:9").auto_parallel() == 1
    assert EngineConfig.build(parallel="auto", n_ctx=512, kv_pool_ctx=400).auto_parallel() == 1
    monkeypatch.setattr("strata.memory.hostram.available_ram", lambda: 1 << 30)    # below the 1 GiB margin + pages
    e = Engine(default_model_path, n_ctx=512, device="cpu", parallel="auto")
    assert e.parallel == 1 and len(e.slots) == 1 and pages(e) == one_ctx
    e.close()


@pytest.mark.parametrize("flags,needle", [
    (["--parallel", "4", "--n-ctx", "512", "--kv-pool-ctx", "1000"], "--parallel 4 needs a KV pool of 4 contexts"),
    (["--parallel", "0"], "argument --parallel/-np: must be >= 1, got 0"),
    (["--parallel", "many"], "argument --parallel/-np: invalid slot count (a positive integer or 'auto') value"),
])
def test_serve_refuses_slots_it_cannot_run_before_the_model_loads(flags, needle):
    """A usage error (exit 2) naming the flag, before any model loads (the model path does not exist): one line,
    or argparse's usage line and its error."""
    import subprocess
    import sys
    from tests.daemon import env_for_daemon
    p = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--socket", "/tmp/strata-test-unused.sock",
                        "--model", "/nonexistent.gguf", *flags], capture_output=True, text=True, timeout=300,
                       env=env_for_daemon())
    err = p.stderr.strip()
    assert p.returncode == 2 and "Traceback" not in err and err.splitlines()[-1].startswith("strata serve: error: ")
    assert needle in err.splitlines()[-1], err


@pytest.fixture(scope="module")
def hybrid_pair(hybrid_path):
    """(a one-slot engine, a three-slot engine) on the synthetic hybrid, kept for every example below."""
    alone = Engine(hybrid_path, n_ctx=384, device="cpu", ubatch=64)
    slots = Engine(hybrid_path, n_ctx=384, device="cpu", ubatch=64, parallel=3)
    yield alone, slots
    alone.close()
    slots.close()


def _arrivals():
    from hypothesis import strategies as st
    req = st.fixed_dictionaries({"length": st.integers(1, 200), "max_tokens": st.integers(1, 10),
                                 "seed": st.integers(0, 3), "sampled": st.booleans(),
                                 "id_slot": st.none() | st.integers(0, 2), "wait": st.integers(0, 6)})
    return st.lists(req, min_size=1, max_size=6)


def test_any_arrival_pattern_answers_as_alone(hybrid_pair):
    """Hypothesis: requests of any prompt length, length of answer, sampling and slot arriving after any number of
    engine steps (busy slots in every pattern, named slots that are busy): each answer equals the same request on the
    one-slot engine."""
    from hypothesis import HealthCheck, example, given, settings

    alone, eng = hybrid_pair
    V = eng.n_vocab

    def make(r, i):
        rng = np.random.default_rng(1000 * r["seed"] + r["length"])
        sp = SamplingParams(temperature=0.9, seed=r["seed"]) if r["sampled"] else SamplingParams(temperature=0.0)
        return GenerationRequest(rng.integers(0, V, r["length"]).astype(np.int32).tolist(), sampling=sp,
                                 max_tokens=r["max_tokens"], cache_prompt=False, ignore_eos=True,
                                 id_slot=r["id_slot"])

    # CI: 8 random patterns beside the fixed one (busy slots, a named busy slot, late arrivals); make test-sweeps: 25
    @settings(max_examples=25 if full_sweeps() else 8, deadline=None, suppress_health_check=list(HealthCheck))
    @example([{"length": 150, "max_tokens": 8, "seed": 0, "sampled": False, "id_slot": 1, "wait": 0},
              {"length": 3, "max_tokens": 10, "seed": 1, "sampled": True, "id_slot": 1, "wait": 1},
              {"length": 60, "max_tokens": 2, "seed": 2, "sampled": True, "id_slot": None, "wait": 2},
              {"length": 1, "max_tokens": 5, "seed": 3, "sampled": False, "id_slot": None, "wait": 2},
              {"length": 200, "max_tokens": 1, "seed": 0, "sampled": False, "id_slot": 0, "wait": 6}])
    @given(_arrivals())
    def check(reqs):
        want = [_key(alone.generate(dataclasses_replace(make(r, i), id_slot=None))) for i, r in enumerate(reqs)]
        got = {i: [] for i in range(len(reqs))}
        done = {}
        pending = list(range(len(reqs)))
        clock = 0
        while pending or len(done) < len(reqs):
            while pending and reqs[pending[0]]["wait"] <= clock:
                i = pending[0]
                if eng.admit(make(reqs[i], i), got[i].append, lambda err, i=i: done.__setitem__(i, err)) is None:
                    break                     # its slot (or every slot) is busy: it waits, as a queue would
                pending.pop(0)
            clock += 1
            eng.step()
        assert all(err is None for err in done.values()), done
        for i in range(len(reqs)):
            assert _key(got[i]) == want[i], f"request {i} of {reqs}"

    check()


def dataclasses_replace(req, **kw):
    import dataclasses
    return dataclasses.replace(req, **kw)


def test_a_failed_batched_step_fails_its_requests_and_frees_the_slots(default_model_path, monkeypatch):
    """A batched step that raises ends each request in it with that error (their sequences forgotten: they were half
    written); the slots are free and the next requests answer as alone."""
    import strata.engine.scheduler as scheduler
    e = Engine(default_model_path, n_ctx=256, device="cpu", parallel=2)
    try:
        want = _key(e.generate(GenerationRequest(e.tokenize_prompt("Hello there"), max_tokens=6)))
        real = scheduler.decode_batch
        calls = []

        def broken(seqs, toks, **kw):
            calls.append(len(seqs))
            if len(calls) == 2:
                raise RuntimeError("device lost")
            return real(seqs, toks, **kw)
        monkeypatch.setattr(scheduler, "decode_batch", broken)
        ends, got = {}, {0: [], 1: []}
        for i, text in enumerate(["Hello there", "General Kenobi"]):
            e.admit(GenerationRequest(e.tokenize_prompt(text), max_tokens=6), got[i].append,
                    lambda err, i=i: ends.__setitem__(i, err))
        while e.step():
            pass
        assert calls[:2] == [2, 2] and set(ends) == {0, 1}
        assert all(isinstance(err, RuntimeError) and "device lost" in str(err) for err in ends.values())
        assert not any(s.busy for s in e.slots) and all(s.seq.pos == 0 for s in e.slots)
        monkeypatch.setattr(scheduler, "decode_batch", real)
        assert _key(e.generate(GenerationRequest(e.tokenize_prompt("Hello there"), max_tokens=6))) == want
    finally:
        e.close()


def test_slot_status_while_a_request_runs(default_model_path):
    """/slots reads Scheduler.status while requests run; the daemon hands prompts over as int32 arrays."""
    from strata.text.token_ids import as_ids
    e = Engine(default_model_path, n_ctx=256, device="cpu", parallel=2)
    try:
        toks = as_ids(e.tokenize_prompt("The capital of France is"))
        assert isinstance(toks, np.ndarray)
        ends = []
        sid = e.admit(GenerationRequest(toks, max_tokens=8), lambda ev: None, ends.append)
        e.step()
        busy = [s for s in e.scheduler.status() if s["is_processing"]]
        assert [s["id"] for s in busy] == [sid] and busy[0]["n_prompt_tokens"] == len(toks)
        while e.step():
            pass
        assert ends == [None] and not any(s["is_processing"] for s in e.scheduler.status())
        # idle, the slot shows what its cache holds, as llama-server counts it: the prompt and the answer but its
        # last token (sampled, never read); the slot that served nothing holds nothing
        shown = {s["id"]: s["n_prompt_tokens"] for s in e.scheduler.status()}
        assert shown == {sid: len(toks) + 8 - 1, 1 - sid: 0}
    finally:
        e.close()


def test_a_requests_last_event_comes_with_its_slot_free(default_model_path):
    """A request's last FinalEvent reaches its consumer once its slot is free (what a client does on its answer, a
    slot save or a look at /slots, finds the slot idle: under load it found it still processing), one per choice,
    the earlier choices' while the request runs on."""
    from strata.engine.types import FinalEvent
    e = Engine(default_model_path, n_ctx=256, device="cpu", parallel=2)
    try:
        seen, ends = [], []

        def on_event(ev):
            if isinstance(ev, FinalEvent):
                seen.append((ev.index, [s["is_processing"] for s in e.scheduler.status()]))
        toks = e.tokenize_prompt("The capital of France is")
        sid = e.admit(GenerationRequest(toks, max_tokens=4, n=2), on_event, ends.append)
        while e.step():
            pass
        assert ends == [None] and [i for i, _ in seen] == [0, 1]
        assert seen[0][1][sid] and seen[1][1] == [False, False], seen
    finally:
        e.close()


def test_warm_up_leaves_the_slots_as_it_found_them(default_model_path):
    """The warm-up runs in slot 0 and leaves no trace there: every slot shows no task (id_task -1) and has not been
    used, so the first request without id_slot takes slot 0, as on llama-server (it took slot 1: the warm-up had
    made slot 0 the most recently used), and task ids count from 1."""
    e = Engine(default_model_path, n_ctx=256, device="cpu", parallel=3)
    try:
        e.warm_up()
        assert [(s["id_task"], s["pos"]) for s in e.scheduler.status()] == [(-1, 0)] * 3
        assert all(s.last_used == 0.0 for s in e.slots)
        sid = e.admit(GenerationRequest(e.tokenize_prompt("Hello there"), max_tokens=2), lambda ev: None,
                      lambda err: None)
        while e.step():
            pass
        assert sid == 0 and [s["id_task"] for s in e.scheduler.status()] == [1, -1, -1]
    finally:
        e.close()


def test_each_slot_counts_the_checkpoints_on_its_own_conversation(default_model_path):
    """/slots' `checkpoints` is per slot: the kept checkpoints on the path of that slot's conversation (it was the
    whole tree's count, the same on every slot). Two conversations with different system prompts in slots 0 and 1
    share no checkpoint, so their counts add up to the tree's; the idle slot that served nothing counts none."""
    e = Engine(default_model_path, n_ctx=512, device="cpu", parallel=3)
    try:
        assert e.slot_checkpoints() == [0, 0, 0]
        for sid, system in ((0, "You are a pirate."), (1, "Answer in French, always.")):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
            r = e.render_chat(msgs)
            list(e.generate(GenerationRequest(r.tokens, cut_points=r.cut_points, max_tokens=3, id_slot=sid)))
            msgs += [{"role": "assistant", "content": "Ahoy"}, {"role": "user", "content": "More"}]
            r = e.render_chat(msgs)
            list(e.generate(GenerationRequest(r.tokens, cut_points=r.cut_points, max_tokens=3, id_slot=sid)))
        counts = e.slot_checkpoints()
        assert counts[0] >= 2 and counts[1] >= 2 and counts[2] == 0, counts
        assert counts[0] + counts[1] == len(e.checkpoints()), (counts, e.checkpoints())
    finally:
        e.close()
