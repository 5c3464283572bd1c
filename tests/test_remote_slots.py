"""Request slots over the stage link (--parallel N with --remote-stage, the worker's +slots): real `strata worker`
processes on loopback hold one sequence per slot; mixed requests (a long prompt arriving mid-decode, seeded sampling,
two choices, a grammar) answer exactly as each request alone on one local process, over one worker (a hybrid: its
running state only resumes from checkpoints) and over a relay of two; every batched decode step is one BatchForward
round trip; a daemon's concurrent streams keep each conversation's secret to itself, a slot's conversation saves and
restores into another slot over the link; a worker killed mid-batch ends
every slot's stream with an error, 503 while it is gone, the same answers once it is back; a worker without +slots is
refused at start naming --parallel, and still serves one slot; the worker refuses bad batched rows."""
import signal
import threading
import time

import numpy as np
import openai
import pytest

import link
from link import BatchForward, BatchResult, ErrorCode, Forward, Hello, Reset, Result
from strata.engine import Engine
from strata.stages.link_client import LinkClient, WorkerError, WorkerRefused
from tests.daemon import Daemon, InProcessWorker, WorkerProc, free_port
from tests.parallel_checks import N_CTX, alone as _alone, key, req, requests, together as _together

SECRETS = ["PLUM", "OSLO", "KIWI"]


@pytest.fixture(scope="module")
def hybrid(synthetic):
    """A tiny synthetic Qwen3.5-style hybrid with a chat template, and its block count."""
    from tests.templates import QWEN_TEMPLATE
    path = synthetic("qwen35", name="qwen-style", overrides={"tokenizer.chat_template": QWEN_TEMPLATE})
    return str(path), 4


@pytest.fixture(scope="module")
def llama(synthetic):
    return str(synthetic("llama")), 4


def _same(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}: its answer over the link beside others differs from its answer alone"
    assert len(got) == len(want)


def test_hybrid_slots_over_a_worker_answer_as_alone(workers, hybrid):
    path, n_blocks = hybrid
    want = _alone(path)
    w = workers("--model", path)
    got, stats = _together(path, 4, remote_stage=w.address, layer_split=str(n_blocks // 2), prompt_cache=4)
    _same(got, want)
    assert stats["max_rows"] == 4 and stats["batched_steps"] > 0, stats
    # every batched decode step of the engine was one BatchForward round trip carrying all its rows
    assert (stats["link"]["batched_steps"], stats["link"]["batched_rows"]) == \
        (stats["batched_steps"], stats["batched_rows"]), stats
    assert stats["prefill_parts"] >= 3 + 5                 # the long prompt in ubatch parts, among the decodes
    assert stats["link"]["row_ids"] is True                 # every BatchResult named its rows, each checked


def test_llama_slots_over_a_relay_of_two_workers_answer_as_alone(workers, llama):
    path, _ = llama
    want = _alone(path)
    a, b = workers("--model", path), workers("--model", path)
    got, stats = _together(path, 3, remote_stage=f"{a.address},{b.address}", layer_split="1,3", prompt_cache=4)
    _same(got, want)
    assert stats["link"]["batched_steps"] == stats["batched_steps"] > 0 and stats["max_rows"] == 3, stats
    assert stats["link"]["row_ids"] is True                 # the last worker's ids, through the relay


def test_a_worker_without_slots_is_refused_for_several_and_serves_one(llama):
    path, _ = llama
    old = InProcessWorker(caps=[link.CAP_SPEC, link.CAP_PARK, link.CAP_DROPS], model=path)
    try:
        with pytest.raises(WorkerRefused) as e:
            Engine(path, n_ctx=256, device="cpu", parallel=2, remote_stage=old.address, layer_split="2")
        msg = str(e.value)
        assert "--parallel 2" in msg and "+slots" in msg and "\n" not in msg
        one = lambda s: s.get("n", 1) == 1          # noqa: E731 -- n > 1 over a link needs checkpoints
        want = _alone(path, pick=one)
        e = Engine(path, n_ctx=N_CTX, ubatch=128, device="cpu", remote_stage=old.address, layer_split="2")
        try:
            _same([key(e.generate(req(e, spec))) for spec in requests(e) if one(spec)], want)
            assert set(old.worker.carrier.seqs) == {0}    # one slot: only sequence 0, the frames it always had
        finally:
            e.close()
    finally:
        old.close()


def test_a_worker_without_row_ids_is_refused_when_required_and_serves_unchecked_otherwise(llama):
    path, _ = llama
    old = InProcessWorker(caps=[link.CAP_SPEC, link.CAP_PARK, link.CAP_DROPS, link.CAP_SLOTS], model=path)
    try:
        with pytest.raises(WorkerRefused) as e:
            Engine(path, n_ctx=256, device="cpu", parallel=2, remote_stage=old.address, layer_split="2",
                   require_row_ids=True)
        msg = str(e.value)
        assert "+rowids" in msg and "--require-row-ids" in msg and old.address in msg and "\n" not in msg, msg
        want = _alone(path)
        got, stats = _together(path, 2, remote_stage=old.address, layer_split="2", prompt_cache=4)
        _same(got, want)
        assert stats["link"]["batched_steps"] > 0 and stats["link"]["row_ids"] is False, stats["link"]
    finally:
        old.close()


def test_the_worker_refuses_bad_batched_rows(llama):
    path, _ = llama
    w = InProcessWorker(model=path)
    e = Engine(path, n_ctx=64, device="cpu")
    try:
        c = LinkClient(w.address)
        c.connect(Hello(protocol=link.VERSION, fingerprint=e.file.fingerprint(), lo=2, hi=4, n_blocks=4,
                        n_embd=int(e.config.n_embd), act_dtype="f32", n_ctx=512, max_batch=16, ckpt_max=0,
                        next_hops=[], nonce=b"", slots=2))
        d = int(e.config.n_embd)
        h1, h2 = np.ones((1, d), np.float32), np.ones((2, d), np.float32)
        t1, t2 = np.array([5], np.int32), np.array([5, 6], np.int32)
        for msg, code, needle in [
            (Forward(pos=0, want_all=False, tokens=t1, hidden=h1, seq=2), ErrorCode.LIMIT, "outside the 2 slot"),
            (BatchForward(seqs=[0, 1], positions=[0, 3], tokens=t2, hidden=h2), ErrorCode.DESYNC, "sequence 1"),
            (BatchForward(seqs=[0, 5], positions=[0, 0], tokens=t2, hidden=h2), ErrorCode.LIMIT, "sequence 5"),
        ]:
            with pytest.raises(WorkerError) as err:
                c.call(msg)
            assert err.value.link_code == code and needle in str(err.value), str(err.value)
        # nothing was read by the refused rows: both sequences still at 0, a batched step reads them there
        res = c.call(BatchForward(seqs=[1, 0], positions=[0, 0], tokens=t2, hidden=h2))
        assert type(res) is BatchResult and res.hidden.shape == (2, d)      # no row ids asked: the answer of old
        # row 1 (sequence 0, token 6) is that sequence's lone one-token Forward, bit for bit
        assert c.call(Reset(keep=[], seq=0)).pos == 0
        lone = c.call(Forward(pos=0, want_all=False, tokens=t2[1:], hidden=h2[1:], seq=0))
        assert lone.pos == 1 and lone.hidden.tobytes() == res.hidden[1:].tobytes()
        assert type(lone) is link.Result                  # no row ids asked: a Forward's answer of old too
        assert c.call(Forward(pos=1, want_all=False, tokens=t1, hidden=h1, seq=1)).pos == 2   # sequence 1 read on
        c.close()
        time.sleep(0.3)
        # asked for row ids, the same step is answered with each row's sequence and the position its token took
        c = LinkClient(w.address)
        c.connect(Hello(protocol=link.VERSION, fingerprint=e.file.fingerprint(), lo=2, hi=4, n_blocks=4,
                        n_embd=d, act_dtype="f32", n_ctx=512, max_batch=16, ckpt_max=0, next_hops=[], nonce=b"",
                        slots=2, row_ids=True))
        one = c.call(Forward(pos=0, want_all=False, tokens=t1, hidden=h1, seq=1))
        assert type(one) is link.SeqResult and (one.seq, one.pos) == (1, 1)     # a Forward's answer names its sequence
        rows = c.call(BatchForward(seqs=[1, 0], positions=[1, 0], tokens=t2, hidden=h2))
        assert type(rows) is link.BatchRows and (rows.seqs, rows.positions) == ([1, 0], [1, 0])
        assert rows.hidden[1:].tobytes() == res.hidden[1:].tobytes()     # sequence 0's row: the same bits
        zero = c.call(Forward(pos=1, want_all=False, tokens=t1, hidden=h1, seq=0))
        assert type(zero) is link.SeqResult and (zero.seq, zero.pos) == (0, 2)
        c.close()
    finally:
        e.close()
        w.close()


def test_a_relay_refuses_its_next_workers_answer_without_the_agreed_ids(llama, monkeypatch):
    """A relay asked for row ids asks its next worker too; an answer from it without them (or with them where none
    were agreed) is the relay's ERROR NEXT_HOP naming that worker, never rows passed on unnamed."""
    from strata.stages import carrier as cmod
    path, _ = llama
    batch_forward = cmod.Carrier.batch_forward
    strip = {"on": True}

    def last_strips_ids(self, m):
        res = batch_forward(self, m)
        if self.next is None and strip["on"]:
            return BatchResult(res.compute_us, res.hidden, res.dropped)
        return res
    monkeypatch.setattr(cmod.Carrier, "batch_forward", last_strips_ids)
    a, b = InProcessWorker(model=path), InProcessWorker(model=path)
    e = Engine(path, n_ctx=64, device="cpu")
    try:
        d = int(e.config.n_embd)
        h2, t2 = np.ones((2, d), np.float32), np.array([5, 6], np.int32)
        for row_ids in (True, False):
            c = LinkClient(a.address)
            c.connect(Hello(protocol=link.VERSION, fingerprint=e.file.fingerprint(), lo=1, hi=3, n_blocks=4,
                            n_embd=d, act_dtype="f32", n_ctx=512, max_batch=16, ckpt_max=0, nonce=b"", slots=2,
                            next_hops=[link.Hop("127.0.0.1", int(b.address.rpartition(":")[2]), 3, 4)],
                            row_ids=row_ids))
            assert c.row_ids is row_ids and a.worker.carrier.next.row_ids is row_ids
            strip["on"] = row_ids
            if not row_ids:      # no ids agreed: the last worker names its rows anyway
                monkeypatch.setattr(cmod.Carrier, "batch_forward", lambda self, m: (
                    lambda r: link.BatchRows(r.compute_us, r.hidden, r.dropped, list(m.seqs), list(m.positions))
                    if self.next is None else r)(batch_forward(self, m)))
            with pytest.raises(WorkerError) as err:
                c.call(BatchForward(seqs=[0, 1], positions=[0, 0], tokens=t2, hidden=h2))
            msg = str(err.value)
            assert err.value.link_code == ErrorCode.NEXT_HOP and b.address in msg, msg
            assert ("a BatchResult" if row_ids else "a BatchRows") in msg and "\n" not in msg, msg
            c.close()
            time.sleep(0.3)
    finally:
        e.close()
        a.close()
        b.close()


def test_a_relay_passes_its_next_workers_sequence_id_and_refuses_an_answer_without_the_agreed_one(llama, monkeypatch):
    """A relay asked for row ids passes its next worker's SeqResult's sequence through unchanged (the main checks the
    whole chain: here the last worker names another sequence); a plain Result from it where ids were agreed, or a
    SeqResult where none were, is the relay's ERROR NEXT_HOP naming that worker."""
    import dataclasses

    from strata.stages import carrier as cmod
    path, _ = llama
    forward = cmod.Carrier.forward
    fault = {"now": None}
    monkeypatch.setattr(cmod.Carrier, "forward", lambda self, m: (
        lambda r: fault["now"](r) if self.next is None and fault["now"] else r)(forward(self, m)))
    a, b = InProcessWorker(model=path), InProcessWorker(model=path)
    e = Engine(path, n_ctx=64, device="cpu")
    try:
        d = int(e.config.n_embd)
        h1, t1 = np.ones((1, d), np.float32), np.array([5], np.int32)
        cases = [(True, lambda r: dataclasses.replace(r, seq=0), None),
                 (True, lambda r: Result(r.pos, r.compute_us, r.hidden, r.dropped), "a Result"),
                 (False, lambda r: link.SeqResult(r.pos, r.compute_us, r.hidden, r.dropped, 1), "a SeqResult")]
        for row_ids, corrupt, says in cases:
            c = LinkClient(a.address)
            c.connect(Hello(protocol=link.VERSION, fingerprint=e.file.fingerprint(), lo=1, hi=3, n_blocks=4,
                            n_embd=d, act_dtype="f32", n_ctx=512, max_batch=16, ckpt_max=0, nonce=b"", slots=2,
                            next_hops=[link.Hop("127.0.0.1", int(b.address.rpartition(":")[2]), 3, 4)],
                            row_ids=row_ids))
            fault["now"] = corrupt
            if says is None:     # passed through: sequence 1's rows named as sequence 0's, as the last worker said
                got = c.call(Forward(pos=0, want_all=False, tokens=t1, hidden=h1, seq=1))
                assert type(got) is link.SeqResult and (got.seq, got.pos) == (0, 1)
            else:
                with pytest.raises(WorkerError) as err:
                    c.call(Forward(pos=0, want_all=False, tokens=t1, hidden=h1, seq=1))
                msg = str(err.value)
                assert err.value.link_code == ErrorCode.NEXT_HOP and b.address in msg, msg
                assert f"answered a Forward with {says} " in msg and "\n" not in msg, msg
            fault["now"] = None
            c.close()
            time.sleep(0.3)
    finally:
        e.close()
        a.close()
        b.close()


def _client(d):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key="unused", max_retries=0, timeout=120)


def _messages(i):
    return [{"role": "user", "content": f"The secret word is {SECRETS[i]}. Story {i}: once upon a time"}]


def _stream(client, i, max_tokens, kill_at=None):
    """Stream request i -> (its text, the exception that ended it or None); kill_at(k) after each chunk k."""
    out = []
    try:
        with client.chat.completions.create(model="default", messages=_messages(i), max_tokens=max_tokens,
                                            temperature=0, stream=True) as s:
            for k, chunk in enumerate(s):
                if chunk.choices and chunk.choices[0].delta.content:
                    out.append(chunk.choices[0].delta.content)
                if kill_at is not None:
                    kill_at(k)
    except Exception as e:  # noqa: BLE001 -- the SSE error event surfaces as an APIError
        return "".join(out), e
    return "".join(out), None


def _concurrently(fn, n):
    got = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return [got[i] for i in range(n)]


def test_daemon_slots_over_a_worker_secrets_and_a_worker_killed_mid_batch(workers, hybrid, tmp_path):
    path, n_blocks = hybrid
    w = workers("--model", path)
    wport = w.port
    save = tmp_path / "slots"
    save.mkdir()
    d = Daemon(tmp_path, "--model", path, "--parallel", "3", "--remote-stage", w.address, "--layer-split",
               str(n_blocks // 2), "--slot-save-path", str(save), port=free_port(), n_ctx=512).start()
    back = None
    try:
        alone = [_stream(_client(d), i, 20)[0] for i in range(3)]      # one at a time: each request alone
        rows = d.metric("strata_batched_rows_total")
        together = _concurrently(lambda i: _stream(_client(d), i, 20), 3)
        for i, (text, err) in enumerate(together):
            assert err is None and text == alone[i], (i, err)
            for j in range(3):
                if j != i:
                    assert SECRETS[j] not in text
        assert d.metric("strata_batched_rows_total") > rows
        # a slot's conversation saved (its worker part streamed from that slot's sequence) and restored into another
        st, slots = d.json("GET", "/slots")
        pos = {s["id"]: s["pos"] for s in slots}
        busy = max(pos, key=pos.get)
        other = next(i for i in pos if i != busy)
        st, saved = d.json("POST", f"/slots/{busy}?action=save", {"filename": "a.bin"})
        assert st == 200 and saved["n_saved"] == pos[busy] > 0, saved
        st, back = d.json("POST", f"/slots/{other}?action=restore", {"filename": "a.bin"})
        assert st == 200 and back["n_restored"] == pos[busy], back
        st, slots = d.json("GET", "/slots")
        assert {s["id"]: s["pos"] for s in slots}[other] == pos[busy]
        # the worker is killed while all three slots decode: every stream ends with an error, soon
        started = threading.Barrier(3)
        killed = threading.Event()

        def run(i):
            def kill_at(k):
                if k == 3:
                    started.wait(60)
                    if i == 0 and not killed.is_set():
                        w.stop(signal.SIGKILL)
                        killed.set()
            return _stream(_client(d), i, 400, kill_at)

        t0 = time.monotonic()
        ends = _concurrently(run, 3)
        assert killed.is_set() and all(err is not None for _, err in ends), ends
        assert time.monotonic() - t0 < 60
        st, body = d.json("POST", "/v1/chat/completions", {"messages": _messages(0), "max_tokens": 4})
        assert st == 503 and body["error"]["code"] == "worker_unavailable"
        # the worker comes back on its port: the daemon reconnects, every slot reads from 0 and answers as before
        back = WorkerProc("--model", path, port=wport).start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and d.request("GET", "/health")[0] != 200:
            time.sleep(0.1)
        again = _concurrently(lambda i: _stream(_client(d), i, 20), 3)
        assert [t for t, _ in again] == alone and all(err is None for _, err in again)
    finally:
        assert d.stop() == 0, d.log_tail()
        if back is not None:
            back.stop()


def _rows(res, order):
    """The BatchRows `res` with its rows (hidden rows and their ids together) in `order`: a worker whose batched step
    put rows elsewhere, left one out or gave one twice, and names them as they are."""
    return link.BatchRows(res.compute_us, res.hidden[order], res.dropped, [res.seqs[i] for i in order],
                          [res.positions[i] for i in order])


BAD_IDS = [    # (what a worker does to its BatchRows of two rows, what the 502 says)
    ("swapped", lambda r: _rows(r, [1, 0]), "row 0 named as sequence"),
    ("dropped", lambda r: _rows(r, [1]), "ids of 1 rows for a batched step of 2"),
    ("repeated", lambda r: _rows(r, [0, 0]), "row 1 named as sequence"),
    ("position", lambda r: link.BatchRows(r.compute_us, r.hidden, r.dropped, r.seqs, [r.positions[0] + 1,
                                                                                   r.positions[1]]), "at position"),
    ("no ids", lambda r: link.BatchResult(r.compute_us, r.hidden, r.dropped), "a BatchResult without row ids"),
]

BAD_BATCHES = [   # (what a worker does to its BatchResult of two rows, what the 502 says)
    ("nan", lambda r: _hidden(r, lambda h: _put(h, (1, 2), np.nan)), "non-finite hidden states (1 NaN, 0 infinite"),
    ("extra row", lambda r: _hidden(r, lambda h: np.concatenate([h, h[:1]])), "shape (3, "),
    ("one row", lambda r: _hidden(r, lambda h: h[:1]), "shape (1, "),
    ("narrow", lambda r: _hidden(r, lambda h: h[:, :-1]), "where (2, "),
    ("f16", lambda r: _hidden(r, lambda h: h.astype(np.float16)), "dtype float16"),
    ("a Result", lambda r: link.Result(pos=0, compute_us=1, hidden=r.hidden), "a Result to a BatchForward"),
]


def _hidden(res, fn):
    import dataclasses
    return dataclasses.replace(res, hidden=fn(res.hidden.copy()))


def _put(h, at, v):
    h[at] = v
    return h


def test_a_workers_bad_batched_result_is_a_502_for_every_slot_and_the_link_recovers(llama, tmp_path, monkeypatch):
    """A worker whose BatchResult breaks what the BatchForward asked (NaN, a row too many or too few, a wrong width or
    dtype, another message; rows swapped, left out, repeated or at another position, as its row ids say, or no ids
    where they were agreed) fails every slot of that step with 502 worker_bad_result naming the fault, never a 400
    and never an answer; the link comes back and both requests answer as before."""
    _bad_batches(llama, tmp_path, monkeypatch, BAD_IDS + BAD_BATCHES, relay=False)


def test_a_relay_passes_its_last_workers_row_ids_through(llama, tmp_path, monkeypatch):
    """Over a relay of two workers the last worker's row ids reach the main unchanged: its swapped, left-out,
    repeated or misplaced rows are the same 502s, naming the chain."""
    _bad_batches(llama, tmp_path, monkeypatch, BAD_IDS[:4], relay=True)


def _bad_batches(llama, tmp_path, monkeypatch, cases, relay):
    from strata.stages import carrier as cmod
    path, n_blocks = llama
    fault = {"now": None}
    batch_forward = cmod.Carrier.batch_forward

    def bad_batch_forward(self, m):
        res = batch_forward(self, m)
        return res if fault["now"] is None or self.next is not None else fault["now"](res)   # the last worker's
    monkeypatch.setattr(cmod.Carrier, "batch_forward", bad_batch_forward)
    ws = [InProcessWorker(model=path) for _ in range(2 if relay else 1)]
    w = ws[-1]
    d = Daemon(tmp_path, "--model", path, "--parallel", "2", "--remote-stage", ",".join(x.address for x in ws),
               "--layer-split", "1,3" if relay else str(n_blocks // 2), "--require-row-ids", n_ctx=256).start()

    def both(max_tokens=8):    # a long answer with a fault on: the two surely meet in a batched step
        bodies = [{"prompt": f"{i} {i} {i} story", "max_tokens": max_tokens, "temperature": 0,
                   "cache_prompt": False} for i in range(2)]
        return _concurrently(lambda i: d.json("POST", "/v1/completions", bodies[i]), 2)
    try:
        ok = both()
        assert all(st == 200 for st, _ in ok), ok
        # n > 1 over a worker without --prompt-cache: a 400 naming n
        st, body = d.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2})
        assert st == 400 and body["error"]["param"] == "n" and "--prompt-cache" in body["error"]["message"], body
        rows = d.metric("strata_batched_rows_total")
        assert rows > 0
        for name, corrupt, says in cases:
            fault["now"] = corrupt
            got = both(200)
            fault["now"] = None
            for st, body in got:
                err = body.get("error") or {}
                assert (st, err.get("code"), err.get("type")) == (502, "worker_bad_result", "server_error"), \
                    (name, st, body)
                assert says in err["message"] and w.address in err["message"], (name, err["message"])
            deadline = time.monotonic() + 30
            while d.request("GET", "/health")[0] != 200:
                assert time.monotonic() < deadline, d.log_tail()
                time.sleep(0.1)
            again = both()
            assert [b["choices"][0]["text"] for _, b in again] == [b["choices"][0]["text"] for _, b in ok], name
        assert d.metric("strata_batched_rows_total") > rows
    finally:
        d.stop()
        for x in ws:
            x.close()

