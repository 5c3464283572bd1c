"""Conversation checkpoints: CheckpointCache.plan/save on the engine's real Sequence (one real Stage and Memory
over a 1-layer pool, a toy runner), and end to end on the default model."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from strata.backend.cpu import CPUBackend
from strata.cache import CheckpointCache
from strata.stages.sequence import Sequence
from strata.memory import Carve, HybridMemory, KVMemory, PagePool, RecurrentMemory
from strata.stages import Stage
from tests import checkpoint_checks as CC
from tests.checkpoint_checks import SYSTEM, fresh, request

# ---- a tiny sequence: the real Sequence / Stage / Memory over a 1-layer pool, with a toy runner ------------------
# Reading a token writes K/V that depend on the whole prefix (a rolling hash, as attention output would) and,
# for the hybrid variant, advances an exact integer recurrence in the running state. Both are exact in float32,
# so a read resumed from a checkpoint must give the same state hashes as a read from 0.

PAGE = 8


class ToyRunner:
    """forward(tokens, state): K/V = (rolling hash of the prefix, token), running state an integer recurrence."""

    def forward(self, tokens, state, all_logits=False, x_in=None):
        toks = [int(t) for t in tokens]
        kv = state.kv
        h = int(kv.read(0, kv.length)[0][0, -1, 0]) if kv.length else 0
        kk = np.zeros((len(toks), 1, 2), np.float32)
        for i, t in enumerate(toks):
            h = (h * 31 + t) % 997
            kk[i, 0] = (h, t)
            for parts in state.running.values():
                parts["ssm"][...] = (parts["ssm"] * 3 + t) % 1009
                parts["conv"][...] = np.roll(parts["conv"], -1)
                parts["conv"][-1] = t
        kv.reserve(len(toks))
        kv.pool.write(0, kv.pages, kv.length, kk, kk + 1)
        kv.commit(len(toks))
        state.advance(toks)
        return np.zeros(4, np.float32)


def new_state(hybrid: bool = False, n_pages: int = 64) -> Sequence:
    k = [np.zeros((1, n_pages, PAGE, 2), np.float32)]
    v = [np.zeros((1, n_pages, PAGE, 2), np.float32)]
    carve = Carve(0, 2)
    mem = KVMemory(carve, PagePool([0], n_pages, PAGE, 1, 2, k, v))
    if hybrid:
        mem = HybridMemory(carve, [mem, RecurrentMemory(carve, {1: {"conv": np.zeros(3, np.float32),
                                                                     "ssm": np.zeros((2, 2), np.float32)}})])
    stage = Stage(0, carve, "cpu", CPUBackend(), SimpleNamespace(n_blocks=2), mem, ToyRunner())
    return Sequence([stage])


def read(state: Sequence, toks) -> None:
    """Read tokens one forward call (a part) at a time, like the engine."""
    if len(toks):
        state.forward(np.asarray(toks, dtype=np.int32))


def run(cache: CheckpointCache, state: Sequence, prompt, cuts, answer=(), **kw):
    """Apply a plan the way the engine does: restore / reset, read the parts, save at save_at; then read
    `answer` (the generated tokens fed back). Returns (plan, parts read)."""
    plan = cache.plan(state, prompt, cuts, **kw)
    if plan.snapshot is not None:
        state.restore(plan.snapshot)
    elif plan.resume_from == "none":
        state.reset()
    elif state.pos > plan.resume_pos:      # live at a common prefix: the engine cuts the K/V back there
        state.truncate(plan.resume_pos)
    cache.begin(plan, state)               # applied: the mount re-dated, the hit counted
    assert state.pos == plan.resume_pos and state.tokens == list(prompt[:plan.resume_pos])
    parts, start = [], plan.resume_pos
    for end in plan.part_ends:
        read(state, prompt[start:end])
        parts.append((start, end))
        if end in plan.save_at:
            cache.save(end, plan.save_at[end], state.capture())
        start = end
    read(state, answer)
    return plan, parts


# a ChatML-shaped conversation: system S, then (user, answer) turns; header H = the generation prompt
S = list(range(1000, 1040))           # 40-token system message
H = [7, 8, 9]                         # "<|im_start|>assistant\n"


def chat(*users, answers=()):
    """Prompt tokens and cut points for a chat: S, user_1, answer_1, ..., user_k, H."""
    toks = list(S)
    cuts = [(len(S), "root", 0), (len(S), "message", 0)]
    for i, u in enumerate(users):
        toks += list(u)
        cuts.append((len(toks), "message", 1 + 2 * i))
        if i < len(answers):
            toks += list(H) + list(answers[i])
            cuts.append((len(toks), "message", 2 + 2 * i))
    cuts.append((len(toks), "turn", len(users) + len(answers)))
    toks += H
    return toks, cuts


U1, U2, U3 = list(range(2000, 2012)), list(range(3000, 3009)), list(range(4000, 4015))
A1, A2 = [50, 51, 52, 53], [60, 61, 62]


def test_first_read_parts_and_saves():
    cache, st = CheckpointCache(cap=6), new_state()
    p, cuts = chat(U1)
    plan, parts = run(cache, st, p, cuts)
    assert plan.resume_from == "none" and plan.resume_pos == 0 and plan.snapshot is None
    assert plan.part_ends == [40, 52, 55]
    assert plan.save_at == {40: "root", 52: "turn"}
    assert parts == [(0, 40), (40, 52), (52, 55)]
    assert [(e["pos"], e["kind"], e["pinned"]) for e in cache.entries()] == [(40, "root", True), (52, "turn", False)]


def test_a_cut_point_near_the_previous_checkpoint_ends_no_part():
    """MIN_PART: a message end a few tokens past the previous checkpoint is no part of its own; one far from it is a
    checkpoint even right after a live resume point (an edited next message resumes there), and the turn point
    always is."""
    p1, c1 = chat(U1)                                   # S (40) U1 (12): the turn checkpoint at 52, H to 55
    cache, st = CheckpointCache(cap=6), new_state(hybrid=True)
    run(cache, st, p1, c1, answer=A1[:-1])              # live at 58; the rendered answer ends at 59
    p2, c2 = chat(U1, U2, answers=[A1])
    plan, parts = run(cache, st, p2, c2)
    assert plan.resume_from == "live" and plan.resume_pos == 58
    assert 59 not in plan.save_at and parts == [(58, 68), (68, 71)] and plan.save_at[68] == "turn"
    long = list(range(700, 740))
    cache, st = CheckpointCache(cap=6), new_state(hybrid=True)
    run(cache, st, p1, c1, answer=long[:-1])           # live at 94, the answer ends at 95: 43 past the checkpoint
    p2, c2 = chat(U1, U2, answers=[long])
    plan, parts = run(cache, st, p2, c2)
    assert plan.save_at[95] == "message" and parts[0] == (94, 95)
    p3, c3 = chat(U1, U3, answers=[long])               # the next message edited: resumes at the answer's end
    plan, parts = run(cache, st, p3, c3)
    assert (plan.resume_from, plan.resume_pos) == ("checkpoint", 95)
    ref = new_state(hybrid=True)
    read(ref, p3)
    assert st.hashes() == ref.hashes()


def test_same_request_twice_resumes_at_turn_and_matches():
    cache, st = CheckpointCache(cap=6), new_state(hybrid=True)
    p, cuts = chat(U1)
    run(cache, st, p, cuts, answer=[70, 71])
    h1 = st.hashes()
    plan, parts = run(cache, st, p, cuts, answer=[70, 71])
    assert (plan.resume_from, plan.resume_pos, parts) == ("checkpoint", 52, [(52, 55)])
    assert st.hashes() == h1
    assert cache.stats()["hits"] == 1 and cache.stats()["tokens_saved"] == 52


def test_live_continuation_reads_only_new_tokens():
    cache, st = CheckpointCache(cap=6), new_state(hybrid=True)
    p1, c1 = chat(U1)
    run(cache, st, p1, c1, answer=A1)           # the last answer token is sampled, fed back here for simplicity
    p2, c2 = chat(U1, U2, answers=[A1])
    assert p2[:st.pos] == st.tokens
    plan, parts = run(cache, st, p2, c2)
    assert plan.resume_from == "live" and plan.resume_pos == len(p1) + len(A1)
    assert parts[0][0] == len(p1) + len(A1) and plan.part_ends[-1] == len(p2)
    # the new user message ends and the turn start are cut points: a checkpoint there
    assert len(p2) - 3 in plan.save_at
    # equal to a read from 0
    ref = new_state(hybrid=True)
    read(ref, p2)
    assert st.hashes() == ref.hashes()


def test_new_chat_resumes_from_the_root_and_keeps_the_other_branch():
    cache, st = CheckpointCache(cap=6), new_state(hybrid=True)
    pa, ca = chat(U1)
    run(cache, st, pa, ca, answer=A1)
    pb, cb = chat(U3)
    plan, parts = run(cache, st, pb, cb)
    assert (plan.resume_from, plan.resume_pos) == ("checkpoint", 40)
    assert parts == [(40, 55), (55, 58)]
    assert [e["pos"] for e in cache.entries()] == [40, 52, 55]   # chat A's turn stays: it holds its own pages
    assert cache.branches() == 2
    ref = new_state(hybrid=True)
    read(ref, pb)
    assert st.hashes() == ref.hashes()
    plan, parts = run(cache, st, pa, ca)                  # back to chat A: its turn, though chat B is live
    assert (plan.resume_from, plan.resume_pos, parts) == ("checkpoint", 52, [(52, 55)])
    ref = new_state(hybrid=True)
    read(ref, pa)
    assert st.hashes() == ref.hashes()


def test_plan_is_pure_and_begin_dates_and_counts():
    cache, st = CheckpointCache(cap=6), new_state(hybrid=True)
    pa, ca = chat(U1)
    run(cache, st, pa, ca, answer=A1)
    before = cache.entries(), cache.stats(), st.live_ok
    plans = [cache.plan(st, pa, ca, checkpoint=False) for _ in range(2)]
    assert (cache.entries(), cache.stats(), st.live_ok) == before          # planning changed nothing
    assert plans[0].resume_pos == plans[1].resume_pos == 52 and plans[0].key is not None
    cache.begin(plans[0], st)
    mounted = [e for e in cache.entries() if e["pos"] == 52]
    assert mounted[0]["mounts"] == 1 and mounted[0]["last_use"] > max(e["last_use"] for e in before[0])
    assert cache.stats()["hits_checkpoint"] == before[1]["hits_checkpoint"] + 1 and not st.live_ok


def test_never_resumes_at_the_full_prompt():
    # a cut point at len(prompt) (no generation prompt): the next identical prompt steps back to an earlier one
    cache, st = CheckpointCache(cap=6, min_part=0), new_state(hybrid=True)   # 52 is 12 past the root
    p = S + U1
    cuts = [(40, "root", 0), (40, "message", 0), (52, "message", 1)]
    plan, _ = run(cache, st, p, cuts)
    assert plan.save_at == {40: "root", 52: "message"}
    plan, parts = run(cache, st, p, cuts)
    assert (plan.resume_from, plan.resume_pos, parts) == ("checkpoint", 40, [(40, 52)])
    # the same state as before: the read stays in the same parts
    ref = new_state(hybrid=True)
    read(ref, p[:40])
    read(ref, p[40:])
    assert st.hashes() == ref.hashes()


def test_checkpoint_false_reads_one_part_keeps_root_and_leaves_no_live_session():
    cache, st = CheckpointCache(cap=6, root_min=16), new_state(hybrid=True)
    p1, c1 = chat(U1)
    plan, parts = run(cache, st, p1, c1, checkpoint=False)
    assert plan.keep_live is False
    assert parts == [(0, 40), (40, 55)] and plan.save_at == {40: "root"}   # builds the root
    plan, parts = run(cache, st, chat(U2)[0], chat(U2)[1], checkpoint=False)
    assert (plan.resume_from, plan.resume_pos) == ("checkpoint", 40)
    assert parts == [(40, 52)] and plan.save_at == {}                      # one part, no turn checkpoint
    assert [e["pos"] for e in cache.entries()] == [40]
    # no live session: a continuation of that prompt resumes from the root, not live
    p3 = chat(U2)[0] + [5, 6]
    plan, _ = run(cache, st, p3, chat(U2)[1])
    assert (plan.resume_from, plan.resume_pos) == ("checkpoint", 40)


def test_checkpoint_false_root_below_root_min_is_not_saved():
    cache, st = CheckpointCache(cap=6, root_min=64), new_state()
    p, c = chat(U1)
    plan, parts = run(cache, st, p, c, checkpoint=False)
    assert parts == [(0, 55)] and cache.entries() == []
    # the default arm still saves it (unpinned: shorter than root_min)
    plan, _ = run(cache, st, p, c)
    assert plan.save_at == {40: "root", 52: "turn"}
    assert [e["pinned"] for e in cache.entries()] == [False, False]


def test_cache_prompt_false_reuses_nothing():
    cache, st = CheckpointCache(cap=6), new_state()
    p, c = chat(U1)
    run(cache, st, p, c)
    plan, parts = run(cache, st, p, c, cache_prompt=False)
    assert (plan.resume_from, plan.resume_pos) == ("none", 0)
    assert parts == [(0, 40), (40, 52), (52, 55)]          # still saves fresh checkpoints
    assert [e["pos"] for e in cache.entries()] == [40, 52] and cache.stats()["replaced"] == 2


def test_prompt_cache_0_one_part_live_or_zero():
    cache, st = CheckpointCache(cap=0), new_state()
    p1, c1 = chat(U1)
    plan, parts = run(cache, st, p1, c1, answer=A1)
    assert parts == [(0, 55)] and plan.save_at == {} and cache.entries() == []
    p2, c2 = chat(U1, U2, answers=[A1])
    plan, parts = run(cache, st, p2, c2)
    assert plan.resume_from == "live" and parts == [(59, len(p2))]
    plan, parts = run(cache, st, p1, c1)        # attention-only: cut back to the common prefix (one token read)
    assert plan.resume_from == "live" and parts == [(54, 55)]
    hy = new_state(hybrid=True)                 # a running state cannot be cut back: from 0 without checkpoints
    run(cache, hy, p2, c2)
    plan, parts = run(cache, hy, p1, c1)
    assert plan.resume_from == "none" and parts == [(0, 55)]


def test_periodic_and_tail_points():
    # min_part 0: every cut point ends a part here (the points lie 2-8 tokens apart; MIN_PART has its own test)
    cache, st = CheckpointCache(cap=12, every=16, tail=5, min_part=0), new_state()
    p, c = chat(U1, U2, answers=[A1])                        # 40 + 12 + 3 + 4 + 9 + 3 = 71 tokens
    plan, _ = run(cache, st, p, c)
    assert len(p) == 71
    # periodic multiples of 16 at or after the root (40): 48, 64; tail at 66; root, messages, turn
    assert plan.save_at == {40: "root", 48: "periodic", 52: "message", 59: "message", 64: "periodic",
                            66: "tail", 68: "turn"}
    assert plan.part_ends == [40, 48, 52, 59, 64, 66, 68, 71]
    # checkpoint=False: no periodic, no tail, no turn
    cache2, st2 = CheckpointCache(cap=12, every=16, tail=5, min_part=0), new_state()
    plan, _ = run(cache2, st2, p, c, checkpoint=False)
    assert plan.part_ends == [40, 71] and plan.save_at == {40: "root"}


def test_pin_kept_with_checkpoint_false():
    cache, st = CheckpointCache(cap=6), new_state()
    p, c = chat(U1, U2, answers=[A1])
    c = c + [(59, "pin", 2)]
    plan, _ = run(cache, st, p, c, checkpoint=False)
    assert plan.save_at == {40: "root", 59: "pin"}


def test_retention_in_the_cache_pins_root_rotates_and_mount_re_dates():
    cache, st = CheckpointCache(cap=3), new_state(hybrid=True)   # hybrid: resumes at checkpoints, never cuts back
    # chat A: three turns live; each saves message/turn checkpoints; the root must survive
    pa, ca = chat(U1)
    run(cache, st, pa, ca, answer=A1)
    pa2, ca2 = chat(U1, U2, answers=[A1])
    run(cache, st, pa2, ca2, answer=A2)
    pa3, ca3 = chat(U1, U2, U3, answers=[A1, A2])
    run(cache, st, pa3, ca3)
    ents = cache.entries()
    assert len(ents) == 3 and ents[0]["pos"] == 40 and ents[0]["pinned"]
    assert cache.stats()["evictions"] > 0
    # re-dating: resuming the same prompt mounts the deepest (turn) one
    before = {e["pos"]: e["last_use"] for e in cache.entries()}
    plan, _ = run(cache, st, pa3, ca3)
    after = {e["pos"]: e["last_use"] for e in cache.entries()}
    assert plan.resume_from == "checkpoint" and after[plan.resume_pos] > before[plan.resume_pos]
    assert [e["mounts"] for e in cache.entries() if e["pos"] == plan.resume_pos] == [1]


def test_cap_1_is_fifo_root_not_kept():
    cache, st = CheckpointCache(cap=1), new_state(hybrid=True)
    pa, ca = chat(U1)
    run(cache, st, pa, ca, answer=A1)
    assert [e["pos"] for e in cache.entries()] == [52]          # the root went first (FIFO)
    plan, _ = run(cache, st, chat(U3)[0], chat(U3)[1])
    assert plan.resume_from == "none"                            # a new chat reads from 0: the old behaviour


def test_byte_budget():
    # hybrid snapshots: 3 + 4 floats (28 bytes) + 4 bytes per token
    cache, st = CheckpointCache(cap=6, budget_bytes=28 + 4 * 40 + 28 + 4 * 52 - 1), new_state(hybrid=True)
    p, c = chat(U1)
    run(cache, st, p, c)
    assert [e["pos"] for e in cache.entries()] == [40]          # 52 evicted (root pinned, LRU otherwise)
    assert cache.entries()[0]["bytes"] == 28 + 4 * 40


def test_bad_input_changes_nothing():
    cache, st = CheckpointCache(cap=6), new_state()
    p, c = chat(U1)
    run(cache, st, p, c)
    before = cache.entries()
    with pytest.raises(ValueError, match="empty"):
        cache.plan(st, [], c)
    with pytest.raises(ValueError, match="outside the prompt"):
        cache.plan(st, p, [(99, "turn", 0)])
    with pytest.raises(ValueError, match="kind"):
        cache.plan(st, p, [(3, "bogus", 0)])
    with pytest.raises(ValueError, match="position"):
        cache.save(10, "turn", st.capture())
    with pytest.raises(ValueError, match="kind"):
        cache.save(st.pos, "bogus", st.capture())
    with pytest.raises(ValueError, match="cap"):
        CheckpointCache(cap=-1)
    assert cache.entries() == before


def test_checkpoints_survive_what_the_live_sequence_does():
    # the sequence was reset and read other tokens behind the cache's back: the checkpoints hold their own pages
    cache, st = CheckpointCache(cap=6), new_state()
    p, c = chat(U1)
    run(cache, st, p, c)
    st.reset()
    read(st, list(range(2000, 2100)))                   # overwrites the pages the checkpoints share with it
    plan, parts = run(cache, st, p, c)
    assert (plan.resume_from, plan.resume_pos, parts) == ("checkpoint", 52, [(52, 55)])
    ref = new_state()
    read(ref, p)
    assert st.hashes() == ref.hashes()
    cache.clear()
    st.reset()
    st.trim()
    assert all(f.pool.n_free == f.pool.n_pages for s in st.stages for f in s.memory.fields
               if getattr(f, "pool", None) is not None)        # every checkpoint gave its pages back


def test_token_ids_are_arrays_of_their_own():
    """The sequence keeps its ids in one buffer; a checkpoint's ids are a read-only copy that later reads (after a
    cut back, over the same buffer positions) never change, and restoring it gives those ids back."""
    st = new_state()
    read(st, list(range(100, 140)))
    ck = st.capture()
    assert ck.tokens.dtype == np.int32 and not ck.tokens.flags.writeable and ck.tokens.tolist() == list(range(100, 140))
    st.truncate(20)
    read(st, list(range(500, 800)))         # past the buffer's first size: it grows
    assert ck.tokens.tolist() == list(range(100, 140))
    assert st.tokens == list(range(100, 120)) + list(range(500, 800)) and st.ids.tolist() == st.tokens
    with pytest.raises(ValueError):
        st.ids[0] = 1                       # the view is read-only
    st.reset()
    read(st, list(range(100, 140)))
    st.restore(ck)
    assert st.tokens == list(range(100, 140))


@pytest.mark.parametrize("as_array", [False, True])
def test_plan_and_save_take_lists_or_int32_arrays(as_array):
    """The same requests, prompts given as lists or int32 arrays: the same plans, parts and checkpoints."""
    cache, st = CheckpointCache(cap=6), new_state()
    seen = []
    for users in ((U1,), (U1, U2), (U3,), (U1, U2, U3)):
        p, c = chat(*users, answers=(A1, A2)[:len(users) - 1])
        plan, parts = run(cache, st, np.asarray(p, np.int32) if as_array else p, c, answer=[77])
        seen.append((plan.resume_pos, plan.resume_from, plan.part_ends, plan.save_at, parts,
                     [(e["pos"], e["kind"]) for e in cache.entries()]))
    ref_cache, ref_st = CheckpointCache(cap=6), new_state()
    for users, got in zip(((U1,), (U1, U2), (U3,), (U1, U2, U3)), seen):
        p, c = chat(*users, answers=(A1, A2)[:len(users) - 1])
        plan, parts = run(ref_cache, ref_st, p, c, answer=[77])
        assert got == (plan.resume_pos, plan.resume_from, plan.part_ends, plan.save_at, parts,
                       [(e["pos"], e["kind"]) for e in ref_cache.entries()])


@settings(max_examples=40, deadline=None)
@given(cap=hst.integers(0, 5), every=hst.sampled_from([0, 16]), steps=hst.lists(
    hst.tuples(hst.integers(0, 2), hst.integers(0, 3), hst.booleans()), min_size=1, max_size=10))
def test_property_chain_cap_root_and_exact_resume(cap, every, steps):
    """Random requests (which chat, how many turns, checkpoint flag): the kept checkpoints stay a prefix chain
    of at most cap, the root stays once saved (cap >= 2), and every resumed read ends in the same state as a
    read from 0 (the hybrid sequence's integer recurrence is exact)."""
    cache, st = CheckpointCache(cap=cap, every=every), new_state(hybrid=True)
    answers = [[50, 51], [60, 61, 62], [70]]
    root_seen = False
    for which, turns, ckpt in steps:
        users = [[u + 100 * which for u in base] for base in (U1, U2, U3, U1)[:turns + 1]]
        p, c = chat(*users, answers=answers[:turns])
        plan, _ = run(cache, st, p, c, answer=[90 + which], checkpoint=ckpt)
        if root_seen and cap >= 2:
            assert plan.resume_pos >= 40 or plan.resume_from == "live"
        ents = cache.entries()
        assert len(ents) <= cap
        for a, b in zip(ents, ents[1:]):
            assert a["pos"] <= b["pos"]
        if cap >= 2 and any(e["pos"] == 40 for e in ents):
            root_seen = True
        if root_seen and cap >= 2:
            assert ents[0]["pos"] == 40 and ents[0]["pinned"]
        ref = new_state(hybrid=True)
        read(ref, p + [90 + which])
        assert st.hashes() == ref.hashes()


# ---- end to end on the real default model (SmolLM2-135M-Instruct Q4_1) through strata.engine.Engine ------------
# (the checks tests/test_cuda_parity.py runs on GPU engines are in tests/checkpoint_checks.py)

# The same end-to-end checks run on the real default model and on synthetic hybrid models (qwen35: Gated
# DeltaNet running state + gated attention; nemotron_h: Mamba2 running state + attention + MLP blocks), whose
# running state cannot be cut back and is in the state hash.
MODELS = ["default", "hybrid", "mamba"]


@pytest.fixture(scope="module", params=MODELS)
def model_path(request, synthetic):
    if request.param == "hybrid":
        return str(synthetic("qwen35", seed=7))
    if request.param == "mamba":
        return str(synthetic("nemotron_h", seed=7))
    return str(request.getfixturevalue("default_model_path"))


def _engine(path: str, prompt_cache: int):
    from strata.engine import Engine
    return Engine(path, n_ctx=2048, prompt_cache=prompt_cache, conversation_cache_mib=0)   # checkpoints alone


@pytest.fixture(scope="module")
def engine(model_path):
    return _engine(model_path, 6)


@pytest.fixture(scope="module")
def engine_nocache(model_path):
    return _engine(model_path, 0)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_exactness_same_request_twice(engine, sampling):
    CC.exactness_same_request_twice(engine, sampling)


def test_replay_two_chats_share_the_root_and_match_prompt_cache_0(engine, engine_nocache):
    CC.replay_two_chats_share_the_root_and_match_prompt_cache_0(engine, engine_nocache)


def test_strata_checkpoint_false_reads_one_part_and_reuses_the_root(engine):
    fresh(engine)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Classify: sunny day."}]
    _, _, f0, r0 = request(engine, first, checkpoint=False)
    root = [c.pos for c in r0.cut_points if c.kind == "root"][0]
    assert f0.strata["parts"] == [(0, root), (root, len(r0.tokens))]      # builds the root only
    assert [(e["pos"], e["kind"]) for e in engine.checkpoints()] == [(root, "root")]
    probe = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Classify: heavy rain."}]
    _, _, f1, r1 = request(engine, probe, checkpoint=False)
    assert (f1.strata["resume_from"], f1.strata["resume_pos"]) == ("checkpoint", root)
    assert f1.strata["parts"] == [(root, len(r1.tokens))]                 # one part
    assert [e["pos"] for e in engine.checkpoints()] == [root]
    # the default arm reads the same prompt in two parts (up to turn_at, then the generation prompt)
    fresh(engine)
    request(engine, first)
    _, _, f2, r2 = request(engine, probe)
    turn = [c.pos for c in r2.cut_points if c.kind == "turn"][0]
    start = f2.strata["resume_pos"]       # the root, or on an attention-only model the common prefix past it
    assert root <= start < turn and (start == root or engine.arch == "llama")
    assert f2.strata["parts"] == [(start, turn), (turn, len(r2.tokens))]


def test_live_continuation_reads_in_one_call_with_its_checkpoints_inside(engine, model_path, monkeypatch):
    """A live continuation of several parts is read in one forward call, each checkpoint's running state kept inside
    it at its cut point (Sequence.mark); each checkpoint holds the state of a read split there (the parts path, one
    call per part) and answers the same. Short enough (<= 16 new tokens) that the CPU kernels give every row the
    same bits in either split, so the comparison is exact."""
    from strata.engine import prefill
    from strata.stages import sequence
    from tests.helpers import answer
    calls = []
    forward = sequence.Sequence.forward

    def counted(self, tokens, *a, **kw):
        calls.append(len(tokens))
        return forward(self, tokens, *a, **kw)

    monkeypatch.setattr(sequence.Sequence, "forward", counted)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is 9 prime?"}]
    later = first + [{"role": "assistant", "content": "No."}, {"role": "user", "content": "Why?"}]

    def play(e):
        fresh(e)
        answer(e, first, 1)        # one token: the live sequence holds the prompt, so the next turn continues it
        calls.clear()
        t, _, f, r = request(e, later)
        read = calls[:1] if f.strata["resume_from"] == "live" else []
        snaps = {c.pos: c.snapshot for c in e.cache._entries.values()}
        hashes = {}
        for pos in sorted(p for p in snaps if p > f.strata["resume_pos"]):
            e.seq.restore(snaps[pos])
            hashes[pos] = e.seq.hashes()
        return t, f, r, read, calls[:len(f.strata["parts"])], hashes

    t1, f1, r1, _, calls1, h1 = play(engine)
    assert f1.strata["resume_from"] == "live" and len(f1.strata["parts"]) >= 2
    n_new = len(r1.tokens) - f1.strata["resume_pos"]
    assert n_new <= 16 and calls1[0] == n_new          # the prompt's new tokens in one forward call
    assert any(p < len(r1.tokens) for p in h1)        # checkpoints kept inside that call (the turn point, ...)
    monkeypatch.setattr(prefill.PromptReader, "one_call", lambda *a: False)
    t2, f2, r2, _, calls2, h2 = play(engine)
    assert f2.strata["parts"] == f1.strata["parts"]
    assert calls2 == [b - a for a, b in f2.strata["parts"]]       # the parts path: a call per part
    assert h1 == h2 and t1 == t2
