"""Parking and session files over a remote stage (+park): the worker keeps a parked conversation's part under an id
(resident) or streams it to the main (host RAM, disk, session files) and takes it back. A/B/A switching bit-exact
against A played alone (tokens, and every layer's state hash: the main's stages and the worker's), a session saved,
both processes restarted and the session loaded, and the part readers fuzzed."""
from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

import link
from strata.engine import Engine
from strata.memory import FormatError, PartMismatch
from strata.stages.carrier import Refuse
from tests.daemon import InProcessWorker
from tests.helpers import ask, chat, play

N_CTX = 1024


@pytest.fixture(scope="module")
def hybrid_path(synthetic):
    return synthetic("qwen35", n_layer=4, seed=21, n_mtp=0)


def layer_hashes(engine, worker=None) -> dict:
    """Every layer's state hash: the main's stages' and, over a link, the in-process worker's."""
    out = {k: v for k, v in engine.state_hashes().items() if ".L" in k}
    if worker is not None:
        out.update({k: v for k, v in worker.worker.carrier.seq.hashes().items() if ".L" in k})
    return out


@pytest.mark.parametrize("resident", [0, 2])
@pytest.mark.parametrize("which,split", [("default", "15"), ("hybrid", "2")])
def test_a_b_a_parked_over_a_remote_stage_bit_exact(which, split, resident, default_model_path, hybrid_path):
    """A parked while B runs (resident: the worker keeps A's part under an id; in RAM: A's worker part streamed to
    the main and sent back), then A again: the tokens and every layer's state hash of A played alone."""
    path = default_model_path if which == "default" else hybrid_path
    alone = Engine(path, n_ctx=N_CTX, ubatch=32, layer_split=split, conversation_cache_mib=0)
    ref = play(alone, "rivers", 2, [])
    ref_layers = {k: v for k, v in ref[1][1].items() if ".L" in k}
    w = InProcessWorker(model=str(path))
    e = Engine(path, n_ctx=N_CTX, ubatch=32, layer_split=split, remote_stage=w.address, prompt_cache=2,
               conversation_cache_mib=256, park_resident=resident)
    try:
        answers: list[str] = []
        first = play(e, "rivers", 1, answers)
        play(e, "mountains", 1, [])                                   # B: A is parked
        assert [p["tier"] for p in e.parked()] == ["device" if resident else "ram"]
        if not resident:
            assert e.parked()[0]["bytes"] > 0                          # the worker's part is on the main now
        toks, final = ask(e, chat("rivers", 1, answers))              # A again
        assert final.strata["resume_from"] == ("resident" if resident else "park")
        assert final.strata["resume_pos"] > 0
        assert first[0][0] == ref[0][0] and toks == ref[1][0]
        got = layer_hashes(e, w)
        assert set(got) == set(ref_layers) and got == ref_layers       # moved, never re-read: the same state
        assert e.state_hashes()["tokens"] == ref[1][1]["tokens"]
    finally:
        e.close()
        w.close()


def test_a_short_part_budget_moves_resident_conversations_to_ram(default_model_path):
    """Four conversations in rotation with room for fewer resident ids on the worker than they need: the least
    recently used move to host RAM (their worker part streamed to the main) and all come back as played alone."""
    topics = ["rivers", "ships", "bread", "stars"]
    w = InProcessWorker(model=str(default_model_path))
    e = Engine(default_model_path, n_ctx=N_CTX, ubatch=32, layer_split="15", remote_stage=w.address,
               prompt_cache=2, conversation_cache_mib=256, park_resident=3)
    try:
        answers = {t: [] for t in topics}
        got = {t: [] for t in topics}
        for turn in range(2):
            for t in topics:
                toks, final = ask(e, chat(t, turn, answers[t]), n=4)
                answers[t].append(e.detokenize(toks))
                got[t].append(toks)
                if turn:
                    assert final.strata["resume_from"] in ("resident", "park"), (t, final.strata)
        assert {p["tier"] for p in e.parked()} <= {"device", "ram"}
        assert e.stages[-1].memory.held <= e.stages[-1].memory.granted
    finally:
        e.close()
        w.close()
    alone = Engine(default_model_path, n_ctx=N_CTX, ubatch=32, conversation_cache_mib=0)
    for t in topics[:2]:
        a: list[str] = []
        for turn in range(2):
            toks, _ = ask(alone, chat(t, turn, a), n=4)
            a.append(alone.detokenize(toks))
            assert toks == got[t][turn], (t, turn)


@pytest.mark.parametrize("which,split", [("default", "15"), ("hybrid", "2")])
def test_save_restart_load_over_a_remote_stage(which, split, workers, tmp_path, default_model_path, hybrid_path):
    """A session saved over the link (the worker's part streamed into the file), the main and the worker both
    restarted, the session loaded (the part sent to the fresh worker): the next turn answers as the conversation
    played alone does, resumed from the session."""
    path = default_model_path if which == "default" else hybrid_path
    alone = Engine(path, n_ctx=N_CTX, ubatch=32, layer_split=split, conversation_cache_mib=0)
    ref = play(alone, "rivers", 2, [])
    answers: list[str] = []
    w = workers("--model", str(path))
    e = Engine(path, n_ctx=N_CTX, ubatch=32, layer_split=split, remote_stage=w.address, prompt_cache=4,
               slot_save_path=str(tmp_path))
    try:
        first = play(e, "rivers", 1, answers)
        saved = e.slot_save(0, "rivers.bin")
        assert saved["n_saved"] > 0 and (tmp_path / "rivers.bin").stat().st_size == saved["n_written"]
    finally:
        e.close()
    w.stop()
    w2 = workers("--model", str(path))
    e2 = Engine(path, n_ctx=N_CTX, ubatch=32, layer_split=split, remote_stage=w2.address, prompt_cache=4,
                slot_save_path=str(tmp_path))
    try:
        got = e2.slot_restore(0, "rivers.bin")
        assert got["n_restored"] == saved["n_saved"]
        toks, final = ask(e2, chat("rivers", 1, answers))
        assert final.strata["resume_from"] == "session" and final.strata["resume_pos"] > 0
        assert first[0][0] == ref[0][0] and toks == ref[1][0]
        assert e2.state_hashes()["tokens"] == ref[1][1]["tokens"]
        # the file is refused whole by an engine of another split, nothing changed
        with pytest.raises(Exception, match="another --layer-split"):
            Engine(path, n_ctx=N_CTX, ubatch=32, layer_split="1", slot_save_path=str(tmp_path)).slot_restore(
                0, "rivers.bin")
    finally:
        e2.close()
    # a worker of one stage writes its part in the state-part format, checkpoints as prefixes: the same file loads
    # into one process of the same split and answers the same
    local = Engine(path, n_ctx=N_CTX, ubatch=32, layer_split=split, prompt_cache=4, slot_save_path=str(tmp_path))
    local.slot_restore(0, "rivers.bin")
    toks, final = ask(local, chat("rivers", 1, answers))
    assert final.strata["resume_from"] == "session" and toks == ref[1][0]
    assert local.state_hashes() == ref[1][1]


# ---- the readers of a remote part's bytes, fuzzed ----------------------------------------------------------
@pytest.fixture(scope="module")
def blob_setup(default_model_path):
    """(engine over an in-process worker, the worker, the bytes of a real part of the worker's stage)."""
    w = InProcessWorker(model=str(default_model_path))
    e = Engine(default_model_path, n_ctx=256, ubatch=32, layer_split="15", remote_stage=w.address, prompt_cache=2,
               conversation_cache_mib=64, park_resident=0)
    ask(e, chat("rivers", 0, []), n=2)
    mem = e.stages[-1].memory
    part = mem.capture(0)
    blob = mem.materialize(part).blob
    part.release()
    yield e, w, blob
    e.close()
    w.close()


def test_a_remote_part_round_trips_through_its_reader(blob_setup):
    e, _, blob = blob_setup
    mem = e.stages[-1].memory
    got = mem.read(io.BytesIO(blob + b"tail"))
    assert got.blob == blob and got.carve == mem.carve
    held = mem.attach_prefix(0, got)             # the worker reads and keeps it
    assert mem.materialize(held).blob == blob
    held.release()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=hs.data())
def test_mutated_part_bytes_are_refused_in_one_line_by_the_main_and_the_worker(blob_setup, data):
    """Any cut or changed byte of a part: the main's reader (a session file's) raises FormatError / PartMismatch,
    or reads a blob the worker then refuses (Refuse) or keeps whole; never another error, never a crash."""
    e, w, blob = blob_setup
    mem = e.stages[-1].memory
    b = bytearray(blob)
    how = data.draw(hs.sampled_from(["cut", "flip", "header"]))
    if how == "cut":
        b = b[:data.draw(hs.integers(0, len(b) - 1))]
    elif how == "flip":
        i = data.draw(hs.integers(0, len(b) - 1))
        b[i] ^= data.draw(hs.integers(1, 255))
    else:
        i = data.draw(hs.integers(0, min(len(b) - 1, 400)))
        b[i] = data.draw(hs.integers(0, 255))
    try:
        part = mem.read(io.BytesIO(bytes(b)))
    except (FormatError, PartMismatch) as err:
        assert "\n" not in str(err)
        return
    carrier = w.worker.carrier
    msg = link.PartPut(ckpt_id=10 ** 6, pos=part.pos, total=len(part.blob), offset=0,
                       data=np.frombuffer(part.blob, np.uint8), keep=sorted(carrier.store) + [10 ** 6])
    try:
        carrier.handle(msg)
    except Refuse as err:
        assert "\n" not in str(err)
    finally:
        old = carrier.store.pop(10 ** 6, None)
        if old is not None:
            old.release()


@pytest.mark.parametrize("chain", [False, True])
def test_a_worker_that_drops_parts_mid_forward_says_so_and_the_main_forgets_them(chain, default_model_path):
    """The worker's pool (n_ctx: 4 pages) is smaller than the main's (--kv-pool-ctx 4 contexts): each of five
    unrelated prompts keeps a page held by its checkpoints, so the fifth makes the worker drop its oldest kept parts
    (the first prompt's checkpoints) inside a Forward. Its Result names them (+drops) and the main's tree forgets them
    at once: the first prompt then reads from 0 without meeting a missing part (which would clear every checkpoint),
    and the third still resumes from its own. Every answer equals the same prompt read alone. chain: two workers,
    the first relaying the second's drops with its own."""
    rng = np.random.default_rng(5)
    prompts = [SimpleNamespace(tokens=[int(x) for x in rng.integers(1000, 5000, 200)],
                               cut_points=[(64, "root"), (128, "message")]) for _ in range(5)]
    split = "10,20" if chain else "15"
    alone = Engine(default_model_path, n_ctx=N_CTX, ubatch=64, layer_split=split, conversation_cache_mib=0,
                   prompt_cache=0)
    ref = [ask(alone, p, n=4, cache_prompt=False)[0] for p in prompts]
    ws = [InProcessWorker(model=str(default_model_path)) for _ in range(2 if chain else 1)]
    e = Engine(default_model_path, n_ctx=N_CTX, ubatch=64, layer_split=split,
               remote_stage=",".join(w.address for w in ws), prompt_cache=16, conversation_cache_mib=0,
               kv_pool_ctx=4 * N_CTX)
    try:
        for p, r in zip(prompts, ref):
            assert ask(e, p, n=4)[0] == r
        drops = lambda: sum(st.memory.drops for st in e.stages)          # noqa: E731
        assert drops() >= 1                               # the worker dropped the first prompt's parts and said so
        toks, final = ask(e, prompts[0], n=4)             # its checkpoints are forgotten: from 0, nothing else lost
        assert toks == ref[0] and final.strata["resume_from"] == "none"
        toks, final = ask(e, prompts[2], n=4)
        assert toks == ref[2] and final.strata["resume_from"] == "checkpoint" and final.strata["resume_pos"] == 128
        assert not any(getattr(p, "gone", False) for c in e.cache._entries.values() for p in c.snapshot.parts)
    finally:
        e.close()
        for w in ws:
            w.close()
