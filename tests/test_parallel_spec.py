"""Speculative decoding with several request slots (--spec N --parallel M): each slot drafts with its own MTP drafter
(its own K/V over the one MTP block) and verifies in the engine step beside the others' batched decodes; greedy
answers equal the same requests alone without drafts, and what each slot drafts and keeps is its own.

The synthetic model's random weights make the real MTP head's drafts almost never right, so where acceptance matters
the drafts are an oracle's (tests.parallel_checks.SlotOracle: each request's greedy continuation recorded alone,
kept at a chosen rate); the MTP head still runs on every draft, so each drafter's K/V is real."""
import numpy as np
import pytest

from strata.engine import Engine, FinalEvent, GenerationRequest, TokenEvent
from strata.sampling.sampler import SamplingParams

from tests.parallel_checks import SlotOracle, drive, key

N_CTX = 256


@pytest.fixture(scope="module")
def model(synthetic):
    return synthetic("qwen35", seed=3, n_mtp=1)


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, n)]


def _req(prompt, **kw):
    kw.setdefault("max_tokens", 16)
    return GenerationRequest(list(prompt), ignore_eos=True, cache_prompt=False, **kw)


def _tokens(events):
    return [ev.token_id for ev in events if isinstance(ev, TokenEvent)]


def _final(events) -> FinalEvent:
    return next(ev for ev in events if isinstance(ev, FinalEvent))


def _oracles(engine, known):
    for s in engine.slots:
        s.decoder.drafter.oracle = SlotOracle(s.seq, known, engine.n_vocab)


#: (prompt length, seed, max_tokens, strata_spec, oracle rate, engine steps before it arrives); the 80-token prompt
#: is read in parts (ubatch 32) while the others verify; max_tokens 7 ends inside a verify
MIX = [(23, 1, 16, None, 1.0, 0), (40, 2, 14, False, 0.0, 0), (9, 3, 7, None, 0.6, 2),
       (80, 4, 12, None, 0.3, 3), (17, 5, 10, False, 0.0, 4), (30, 6, 12, None, 0.8, 6)]


@pytest.mark.parametrize("n_slots", [2, 3])
def test_greedy_with_drafts_in_slots_equals_spec0_alone(model, n_slots):
    """Mixed arrivals over 2-3 slots, drafts at full, partial and no acceptance, two requests with strata_spec
    false (they join the batched decode step): every answer equals the request alone with --spec 0, and each
    request's timings count its own drafts."""
    alone = Engine(model, n_ctx=N_CTX, ubatch=32)
    want = [key(alone.generate(_req(_prompt(n, s), max_tokens=m))) for n, s, m, *_ in MIX]
    refs = [[t for kind, _, t, *_ in w if kind == "tok"] for w in want]
    alone.close()
    e = Engine(model, n_ctx=N_CTX, ubatch=32, parallel=n_slots, spec=3)
    try:
        assert len({id(s.decoder.drafter) for s in e.slots}) == n_slots
        assert all(s.reader.drafter is s.decoder.drafter and s.decoder.drafter.seq is s.seq for s in e.slots)
        known = [(_prompt(n, s), ref, rate, np.random.default_rng(s)) for (n, s, _, _, rate, _), ref in zip(MIX, refs)]
        _oracles(e, known)
        reqs = [_req(_prompt(n, s), max_tokens=m, spec=sp) for n, s, m, sp, _, _ in MIX]
        got, done = drive(e, reqs, [a for *_, a in MIX])
        assert all(err is None for err in done.values()), done
        for i, (g, w) in enumerate(zip(got, want)):
            assert key(g) == w, f"request {i}: its answer with drafts beside others differs from --spec 0 alone"
        for g, (_, _, _, sp, rate, _) in zip(got, MIX):
            t = _final(g).timings
            if sp is False:
                assert t["draft_n"] == 0
            else:
                assert t["draft_n"] > 0
                if rate == 1.0:
                    assert t["draft_n_accepted"] == t["draft_n"]
                if rate == 0.0:
                    assert t["draft_n_accepted"] == 0
        st = e.scheduler.stats
        assert st["verifies"] > 0 and st["verify_tokens"] > st["verifies"]
        assert st["batched_steps"] > 0 or n_slots == 2, st       # two spec-false requests decoded together
    finally:
        e.close()


def test_each_slots_acceptance_is_its_own(model):
    """One slot's drafts always kept, another's rarely: each request's acceptance is its own (1.0, and exactly what
    the same request gets alone with the same drafts), neither averaged with the other's nor zeroed."""
    pa, pb = _prompt(20, 11), _prompt(26, 12)
    base = Engine(model, n_ctx=N_CTX)
    ra = _tokens(base.generate(_req(pa, max_tokens=24)))
    rb = _tokens(base.generate(_req(pb, max_tokens=24)))
    base.close()

    def known():
        return [(pa, ra, 1.0, np.random.default_rng(1)), (pb, rb, 0.35, np.random.default_rng(2))]

    solo = Engine(model, n_ctx=N_CTX, spec=3)
    _oracles(solo, known())
    b_alone = _final(list(solo.generate(_req(pb, max_tokens=24)))).timings
    solo.close()
    e = Engine(model, n_ctx=N_CTX, parallel=2, spec=3)
    try:
        _oracles(e, known())
        (ga, gb), done = drive(e, [_req(pa, max_tokens=24), _req(pb, max_tokens=24)], [0, 0])
        assert all(err is None for err in done.values())
        assert _tokens(ga) == ra and _tokens(gb) == rb
        ta, tb = _final(ga).timings, _final(gb).timings
        assert ta["draft_n"] > 0 and ta["draft_acceptance_rate"] == 1.0
        assert 0.0 < tb["draft_acceptance_rate"] < 0.8
        assert {k: tb[k] for k in ("draft_n", "draft_n_accepted", "draft_verifies")} == \
            {k: b_alone[k] for k in ("draft_n", "draft_n_accepted", "draft_verifies")}
        # /slots: each slot's own totals (A took slot 0, B slot 1)
        views = {v["id"]: v["spec"] for v in e.scheduler.status()}
        for sid, t in ((0, ta), (1, tb)):
            assert (views[sid]["drafted"], views[sid]["accepted"], views[sid]["verifies"]) == \
                (t["draft_n"], t["draft_n_accepted"], t["draft_verifies"])
        assert views[0]["acceptance_rate"] == 1.0 and views[1]["acceptance_rate"] == tb["draft_acceptance_rate"]
    finally:
        e.close()


class Recorder:
    """An oracle that drafts what the MTP head drafts and records it, per request (the one of `prompts` the slot's
    sequence starts with): {request: [(position, token)]}."""

    def __init__(self, seq, prompts, log):
        self.seq, self.prompts, self.log = seq, prompts, log

    def __call__(self, pos, token):
        ids = list(self.seq.ids)
        i = next(i for i, p in enumerate(self.prompts) if ids[:len(p)] == list(p))
        self.log.setdefault(i, []).append((pos, int(token)))
        return token


def test_real_head_drafts_in_slots_are_the_drafts_alone(model):
    """The real MTP head (no oracle), greedy and seeded sampling: with three slots each request drafts, token for
    token, what it drafts alone with the same --spec, and answers the same (a drafter state shared between slots
    would change the drafts)."""
    specs = [dict(max_tokens=14), dict(max_tokens=12, sampling=SamplingParams(temperature=0.9, seed=4)),
             dict(max_tokens=10, sampling=SamplingParams(temperature=1.2, top_k=50, seed=9)), dict(max_tokens=9)]
    prompts = [_prompt(n, 30 + n) for n in (15, 33, 8, 21)]
    alone = Engine(model, n_ctx=N_CTX, ubatch=32, spec=2)
    drafts_alone: dict = {}
    alone.drafter.oracle = Recorder(alone.seq, prompts, drafts_alone)
    want = [key(alone.generate(_req(p, **kw))) for p, kw in zip(prompts, specs)]
    alone.close()
    e = Engine(model, n_ctx=N_CTX, ubatch=32, parallel=3, spec=2)
    try:
        drafts: dict = {}
        for s in e.slots:
            s.decoder.drafter.oracle = Recorder(s.seq, prompts, drafts)
        got, done = drive(e, [_req(p, **kw) for p, kw in zip(prompts, specs)], [0, 0, 1, 2])
        assert all(err is None for err in done.values())
        assert e.scheduler.stats["verifies"] > 0
        for i, (g, w) in enumerate(zip(got, want)):
            assert key(g) == w, i
        assert set(drafts) == set(range(len(prompts))) and all(len(drafts[i]) > 5 for i in drafts)
        assert drafts == drafts_alone
    finally:
        e.close()


def test_slots_with_drafts_over_a_remote_stage(model, workers):
    """The last layers on a real worker process (loopback, one sequence per slot there): each slot's verify is a
    Forward of its own, the spec-false slots' decodes one BatchForward carrying their hidden rows back for their
    drafters, the Commits per sequence, applied late by the link's test hook (the settle before the next Forward
    keeps them in order): every greedy answer equals --spec 0 alone."""
    w = workers("--model", str(model), env={"STRATA_TEST_COMMIT_DELAY_MS": "40"})
    mix = [(23, 1, 16, None, 0.7), (40, 2, 14, False, 0.0), (9, 3, 12, False, 0.0), (30, 6, 12, None, 1.0)]
    alone = Engine(model, n_ctx=N_CTX, ubatch=32)
    want = [key(alone.generate(_req(_prompt(n, s), max_tokens=m))) for n, s, m, *_ in mix]
    refs = [[t for kind, _, t, *_ in x if kind == "tok"] for x in want]
    alone.close()
    e = Engine(model, n_ctx=N_CTX, ubatch=32, parallel=3, spec=3, remote_stage=w.address, layer_split="2")
    try:
        _oracles(e, [(_prompt(n, s), ref, rate, np.random.default_rng(s))
                     for (n, s, _, _, rate), ref in zip(mix, refs)])
        got, done = drive(e, [_req(_prompt(n, s), max_tokens=m, spec=sp) for n, s, m, sp, _ in mix], [0, 0, 0, 3])
        assert all(err is None for err in done.values()), done
        for i, (g, x) in enumerate(zip(got, want)):
            assert key(g) == x, i
        assert e.scheduler.stats["verifies"] > 0 and e.stages[-1].status()["link"]["batched_steps"] > 0
        assert _final(got[3]).timings["draft_acceptance_rate"] == 1.0
    finally:
        e.close()


@pytest.mark.parametrize("row_ids", [True, False])
def test_a_verify_answered_with_another_slots_rows(model, monkeypatch, row_ids):
    """A worker that answers one slot's verify with another slot's rows at the same position (its own state mixed
    the two sequences, and it names the rows for the sequence they are of): with +rowids its SeqResult names the
    other sequence and the main refuses it (502 worker_bad_result naming the worker and both sequences, for the
    requests of that step), so no request answers with another's rows; from a worker without +rowids (the check
    off) the rows are used and that slot answers wrong. Two prompts of one length, drafts always right: both slots
    verify at the same positions."""
    import dataclasses

    import link
    from strata.stages import carrier as cmod
    from tests.daemon import InProcessWorker
    seen, swapped = {}, []             # (position after, rows) -> (sequence, hidden rows) of a verify answered
    forward = cmod.Carrier.forward

    def mixing_forward(self, m):
        res = forward(self, m)
        if not (m.want_all and 1 < m.tokens.shape[0] <= 4):          # verifies of up to 3 drafts only
            return res
        other = seen.setdefault((res.pos, res.hidden.shape[0]), (m.seq, res.hidden.copy()))
        if other[0] == m.seq:
            return res
        swapped.append(m.seq)
        named = {"seq": other[0]} if isinstance(res, link.SeqResult) else {}
        return dataclasses.replace(res, hidden=other[1].copy(), **named)
    monkeypatch.setattr(cmod.Carrier, "forward", mixing_forward)
    mix = [(20, 11, 12), (20, 12, 12)]
    alone = Engine(model, n_ctx=N_CTX, ubatch=32)
    want = [key(alone.generate(_req(_prompt(n, s), max_tokens=m))) for n, s, m in mix]
    refs = [[t for kind, _, t, *_ in x if kind == "tok"] for x in want]
    alone.close()
    caps = None if row_ids else [link.CAP_SPEC, link.CAP_PARK, link.CAP_DROPS, link.CAP_SLOTS]
    w = InProcessWorker(caps=caps, model=str(model))
    e = Engine(model, n_ctx=N_CTX, ubatch=32, parallel=2, spec=3, remote_stage=w.address, layer_split="2")
    try:
        assert e.stages[-1].client.row_ids is row_ids
        _oracles(e, [(_prompt(n, s), ref, 1.0, np.random.default_rng(s)) for (n, s, _), ref in zip(mix, refs)])
        got, done = drive(e, [_req(_prompt(n, s), max_tokens=m) for n, s, m in mix], [0, 0])
        assert swapped, "no two verifies met at one position"
        right = [key(g) == x for g, x in zip(got, want)]
        if row_ids:
            bad = [err for err in done.values() if err is not None]
            assert bad and all(getattr(err, "code", None) in ("worker_bad_result", "stage_unavailable")
                               for err in bad), done
            named = [str(err) for err in bad if getattr(err, "code", None) == "worker_bad_result"]
            assert named and all(w.address in x and "\n" not in x for x in named), named   # the step's requests
            assert f"the rows of sequence {1 - swapped[0]} where sequence {swapped[0]}'s were asked" in named[0]
            assert all(ok for ok, err in zip(right, [done[i] for i in range(2)]) if err is None), (right, done)
        else:
            assert all(err is None for err in done.values()), done
            assert not all(right), "the other slot's rows gave the same answer"
    finally:
        e.close()
        w.close()


def test_daemon_with_slots_and_drafts(model, tmp_path):
    """`strata serve --parallel 2 --spec 3` (a real daemon, concurrent clients; three requests for two slots, so one
    waits): every greedy answer equals its answer without drafts ("strata_spec": false), each reports its own draft
    counts, /metrics counts every verify and /slots each slot's drafts."""
    import threading
    from tests.daemon import Daemon
    d = Daemon(tmp_path, "--model", str(model), "--device", "cpu", "--parallel", "2", "--spec", "3").start()
    try:
        prompts = ["the quick brown fox", "seven wizards quietly judge", "a lazy dog while the boxing match"]

        def complete(p, **extra):
            st, out = d.json("POST", "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0,
                                                          "cache_prompt": False, **extra})
            assert st == 200, out
            return out

        off = [complete(p, strata_spec=False) for p in prompts]
        got, errors = {}, []

        def run(i):
            try:
                got[i] = complete(prompts[i])
            except Exception as e:  # noqa: BLE001
                errors.append((i, e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        for i in range(3):
            assert got[i]["choices"][0]["text"] == off[i]["choices"][0]["text"], i
            assert got[i]["timings"]["draft_n"] > 0 and off[i]["timings"]["draft_n"] == 0
        assert d.metric("strata_spec_verifies_total") >= sum(got[i]["timings"]["draft_verifies"] for i in range(3))
        st, slots = d.json("GET", "/slots")
        assert st == 200 and sum(s["spec"]["drafted"] for s in slots) >= sum(got[i]["timings"]["draft_n"]
                                                                             for i in range(3))
    finally:
        assert d.stop() == 0, d.log_tail()


def test_drafters_find_room_in_a_pool_held_by_checkpoints(synthetic):
    """Chats with checkpoints (the conversation store holds the drafter's K/V with the model's) over three slots of
    --spec 2 fill the drafter's pool: its writes make room as the model's own do (checkpoints dropped, parked
    conversations moved to RAM) instead of failing the request with KVCacheFull, and every greedy answer equals the
    request's answer alone with --spec 0."""
    from tests.templates import QWEN_TEMPLATE
    path = synthetic("qwen35", name="qwen-mtp", seed=3, n_mtp=1, overrides={"tokenizer.chat_template": QWEN_TEMPLATE})
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "tau"]
    rng = np.random.default_rng(0)
    chats, lengths, arrive = [], [], []
    for _ in range(12):
        chats.append([{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": " ".join(rng.choice(words, int(rng.integers(3, 160))))}])
        lengths.append(int(rng.integers(10, 40)))
        arrive.append(int(rng.integers(0, 30)))

    def reqs(e):
        out = []
        for msgs, m in zip(chats, lengths):
            r = e.render_chat(msgs)
            out.append(GenerationRequest(r.tokens, cut_points=r.cut_points, max_tokens=m, ignore_eos=True))
        return out
    alone = Engine(path, n_ctx=512, ubatch=16)
    try:
        want = [key(alone.generate(r)) for r in reqs(alone)]
    finally:
        alone.close()
    e = Engine(path, n_ctx=512, ubatch=16, parallel=3, spec=2)
    try:
        got, done = drive(e, reqs(e), arrive)
        assert all(err is None for err in done.values()), {i: repr(err) for i, err in done.items() if err}
        assert [key(g) for g in got] == want
        assert e.scheduler.stats["verifies"] > 0
    finally:
        e.close()


def test_the_warm_up_drafts_count_in_the_engine_total_not_in_a_slot(model):
    """A slot's draft counts (/slots' spec) are its requests' only: the warm-up drafts in slot 0 and leaves its
    counts as they were (slot 0 showed the warm-up's drafts), while the engine's totals (/status' spec) count them."""
    e = Engine(model, n_ctx=N_CTX, parallel=2, spec=3)
    try:
        e.warm_up()
        assert e.status()["spec"]["drafted"] > 0
        assert [(s["spec"]["drafted"], s["spec"]["verifies"]) for s in e.scheduler.status()] == [(0, 0), (0, 0)]
    finally:
        e.close()
