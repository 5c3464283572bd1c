"""Mid-prompt checkpoints (--prompt-cache-every, --prompt-cache-tail) over a remote stage, with a real `strata worker`
process on loopback: a tiny synthetic hybrid (its running state cannot be cut back, so a prompt that leaves the live
one resumes only from a checkpoint) whose later layers run on the worker. A request that branches after a periodic
or the near-tail cut point resumes from that checkpoint (the worker restores its own part of it, kept under the
main's id) and only the tail crosses the link; its greedy tokens are a cold read's in one process, and every layer's
state hash (the main's, and the worker's STRATA_STATE_HASH line) is that of one process reading the prompt cold in
the same parts."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from strata.engine import Engine
from tests.daemon import WorkerProc
from tests.helpers import generate_all

N_CTX = 1024
EVERY = 32
SPLIT = "2"                   # the main runs blocks [0, 2) and the head, the worker [2, 4)


@pytest.fixture(scope="module")
def hybrid(synthetic):
    return synthetic("qwen35", seed=11, n_mtp=0)


@pytest.fixture(scope="module")
def worker(hybrid):
    """One worker process for the module (it serves one main at a time: each test closes its engine)."""
    w = WorkerProc("--model", str(hybrid), env={"STRATA_STATE_HASH": "1"}).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def prompts(hybrid):
    """A raw prompt of 150 token ids and a branch of it after token 100 (a new 40-token tail)."""
    n_vocab = Engine(hybrid, n_ctx=64, prompt_cache=0, conversation_cache_mib=0).n_vocab
    rng = np.random.default_rng(5)
    a = [int(t) for t in rng.integers(10, n_vocab, 150)]
    return a, a[:100] + [int(t) for t in rng.integers(10, n_vocab, 40)]


def ask(engine, prompt, n: int = 6):
    """Greedy, n tokens -> (token ids, the final event's strata object)."""
    toks, finals = generate_all(engine, prompt, max_tokens=n)
    return [t.token_id for t in toks], finals[0].strata


def forwards(engine) -> list[tuple[int, int]]:
    """(position, tokens) of every Forward the main sends its worker from now on (the list fills as it runs)."""
    stage, sent = engine.stages[-1], []
    call = stage.call

    def spy(msg):
        if type(msg).__name__ == "Forward":
            sent.append((int(msg.pos), int(msg.tokens.shape[0])))
        return call(msg)
    stage.call = spy
    return sent


def layer_hashes(engine) -> dict[int, str]:
    """Each layer's state hash (K/V, running state) of the live sequence, first 16 hex digits as a log line has."""
    return {k: v[:16] for k, v in engine.state_hashes().items() if ".L" in k}


def worker_hashes(w: WorkerProc, pos: int) -> dict[str, str]:
    """The layer hashes of the worker's last state_hash line at `pos` (it logs one at each Commit; the main posts one
    at a request's end with STRATA_STATE_HASH set). The line is written before the Commit's Ack, so it is in the
    worker's stderr already; its reader thread may take a moment to collect it."""
    end = time.monotonic() + 30
    while True:
        lines = [json.loads(ln) for ln in list(w.lines) if ln.startswith("{") and '"state_hash"' in ln]
        lines = [ln for ln in lines if int(ln["pos"]) == pos]
        if lines or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert lines, "\n".join(w.lines[-20:])
    return {k: v for k, v in lines[-1].items() if ".L" in k}


def test_a_branch_after_a_periodic_cut_point_resumes_there_over_the_link(worker, hybrid, prompts, monkeypatch):
    """--prompt-cache-every 32 (--prompt-cache at its default: the flag asks for checkpoints over a worker too): the
    first read saves a checkpoint at 32, 64, 96, 128, each with the worker's part; the branch after token 100 resumes
    at 96 and sends the worker only [96, 140)."""
    monkeypatch.setenv("STRATA_STATE_HASH", "1")
    a, b = prompts
    e = Engine(hybrid, n_ctx=N_CTX, prompt_cache_every=EVERY, conversation_cache_mib=0, remote_stage=worker.address,
               layer_split=SPLIT)
    try:
        got_a, fa = ask(e, a)
        assert fa["resume_from"] == "none"
        assert [(c["pos"], c["kind"]) for c in e.cache.entries()] == [(p, "periodic") for p in (32, 64, 96, 128)]
        sent = forwards(e)
        got_b, fb = ask(e, b)
        main = layer_hashes(e)
        pos = e.seq.pos
        link = e.stages[-1].status()["link"]
        held = len(e.cache.entries())
    finally:
        e.close()
    assert (fb["resume_from"], fb["resume_pos"]) == ("checkpoint", 96)
    assert fb["parts"] == [(96, 128), (128, 140)]
    assert sent[:2] == [(96, 32), (128, 12)] and all(n == 1 for _, n in sent[2:])   # the tail, then decode steps
    assert link["up"] and link["checkpoints_held"] == held == 5                     # b's own at 128 beside a's four

    cold = Engine(hybrid, n_ctx=N_CTX, prompt_cache=0, conversation_cache_mib=0)
    assert ask(cold, a)[0] == got_a
    assert ask(cold, b)[0] == got_b
    # one process reading b cold with the same cut points reads it in the same parts: the same bits, layer by layer
    ref = Engine(hybrid, n_ctx=N_CTX, prompt_cache_every=EVERY, conversation_cache_mib=0)
    toks, fr = ask(ref, b)
    assert toks == got_b and fr["parts"] == [(0, 32), (32, 64), (64, 96), (96, 128), (128, 140)]
    want = layer_hashes(ref)
    theirs = worker_hashes(worker, pos)
    assert sorted(int(k.split(".L")[1]) for k in main) == [0, 1]
    assert sorted({int(k.split(".L")[1]) for k in theirs}) == [2, 3]
    assert {**main, **theirs} == want


def test_a_changed_end_resumes_at_the_near_tail_point_over_the_link(worker, hybrid, prompts):
    """--prompt-cache-tail 12: a prompt that differs from the last one only in its last tokens resumes at the
    near-tail checkpoint (len - 12 of the first), whose worker part the worker restores; the tokens are a cold
    read's."""
    a, _ = prompts
    a2 = a[:-4] + [t + 1 for t in a[-4:]]
    e = Engine(hybrid, n_ctx=N_CTX, prompt_cache_tail=12, conversation_cache_mib=0, remote_stage=worker.address,
               layer_split=SPLIT)
    try:
        ask(e, a)
        assert [(c["pos"], c["kind"]) for c in e.cache.entries()] == [(len(a) - 12, "tail")]
        sent = forwards(e)
        got, f = ask(e, a2)
    finally:
        e.close()
    assert (f["resume_from"], f["resume_pos"]) == ("checkpoint", len(a) - 12)
    assert sent[0] == (len(a) - 12, 12)
    cold = Engine(hybrid, n_ctx=N_CTX, prompt_cache=0, conversation_cache_mib=0)
    assert ask(cold, a2)[0] == got
