"""The remote stage over the stage link, with real `strata worker` processes on loopback: greedy parity with one
process (2 and 3 stages, the relay), checkpoints across the link, the settle, a store emptied under the main, the
handshake's refusals (version, silence, close, key, model, limits, a second main), and the daemon's behaviour when a
worker dies mid-stream and comes back."""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import statistics
import time
from pathlib import Path
import zlib

import numpy as np
import pytest

import link
from strata.engine.engine import Engine
from strata.engine.types import GenerationRequest
from strata.stages.link_client import LinkClient, WorkerRefused
from tests.daemon import ROOT, Daemon, InProcessWorker, NotifyListener, WorkerProc, env_for_daemon, free_port
from tests.helpers import ask, default_fingerprint

N_CTX = 1024
SYSTEM = "You are a helpful assistant who answers briefly. " * 12


def run(engine, rendered, n: int = 12):
    """At most n tokens, stopping at an end of generation -> (token ids, FinalEvent)."""
    return ask(engine, rendered, n, ignore_eos=False)


def conversation(engine) -> list:
    """Two chats on one system prompt, each turn sent twice: (tokens, resume_from, resume_pos) per request."""
    out = []
    for first in ("Name three primes.", "What is the capital of France?"):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
        for turn in range(2):
            r = engine.render_chat(msgs)
            a, f = run(engine, r)
            b, g = run(engine, r)             # the same request again: byte-identical
            out.append((a, f.strata["resume_from"], f.strata["resume_pos"]))
            out.append((b, g.strata["resume_from"], g.strata["resume_pos"]))
            msgs = msgs + [{"role": "assistant", "content": engine.detokenize(a)},
                           {"role": "user", "content": "And then?"}]
    return out


@pytest.fixture(scope="module")
def reference():
    """The same conversation on one process (the default model, checkpoints on)."""
    e = Engine("default", n_ctx=N_CTX, prompt_cache=4)
    return conversation(e)


def test_two_and_three_stages_match_one_process_with_checkpoints(workers, reference):
    a, b = workers(), workers()
    for remote, split in ((a.address, "10"), (f"{a.address},{b.address}", "8,19")):
        e = Engine("default", n_ctx=N_CTX, prompt_cache=4, remote_stage=remote, layer_split=split)
        try:
            got = conversation(e)
            st = e.stages[-1].status()["link"]
        finally:
            e.close()
        assert [g[0] for g in got] == [r[0] for r in reference], remote
        assert [g[1:] for g in got] == [r[1:] for r in reference]         # the same resumes, from the same places
        assert any(src == "live" and pos > 0 for _, src, pos in got)      # attention-only: cut back over the link
        for i in range(0, len(got), 2):
            assert got[i][0] == got[i + 1][0]                             # every request sent twice: the same
        assert st["checkpoints_held"] > 0 and st["up"]


def test_hybrid_checkpoints_across_the_link(workers, synthetic):
    """A synthetic Qwen3.5-style hybrid (Gated DeltaNet + attention): its running state cannot be cut back, so
    every later turn resumes from a checkpoint, here one whose worker part is kept on the worker."""
    path = str(synthetic("qwen35", seed=11, n_mtp=0))
    n_blocks = Engine(path, n_ctx=N_CTX, prompt_cache=4).stages[0].carve.hi
    ref = conversation(Engine(path, n_ctx=N_CTX, prompt_cache=4))
    w = workers("--model", path)
    e = Engine(path, n_ctx=N_CTX, prompt_cache=4, remote_stage=w.address, layer_split=str(n_blocks // 2))
    try:
        got = conversation(e)
    finally:
        e.close()
    assert got == ref
    assert sum(src == "checkpoint" for _, src, _ in got) >= 4


def interleaved(engine) -> list:
    """A parent chat and a sub-agent on its system prompt, turns interleaved (parent, sub-agent, parent, sub-agent):
    (tokens, resume_from, resume_pos) per request."""
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
             for first in ("Name three primes.", "What is the capital of France?")]
    out = []
    for _turn in range(2):
        for msgs in chats:
            a, f = run(engine, engine.render_chat(msgs))
            out.append((a, f.strata["resume_from"], f.strata["resume_pos"]))
            msgs += [{"role": "assistant", "content": engine.detokenize(a)}, {"role": "user", "content": "And then?"}]
    return out


def test_a_sub_agents_checkpoint_survives_its_parents_turn_over_the_link(workers, synthetic):
    """The hybrid (no cut back: only a checkpoint or the parked conversation resumes it): each chat's second turn
    resumes from its own first turn (the conversation parked resident when the other chat took the sequence, or its
    checkpoint) although the other chat ran in between, on the worker's part too (its store holds the pages of both
    branches), as one process does."""
    path = str(synthetic("qwen35", seed=11, n_mtp=0))
    one = Engine(path, n_ctx=N_CTX, prompt_cache=6)
    n_blocks = one.stages[0].carve.hi
    ref = interleaved(one)
    root = len(one.render_chat([{"role": "system", "content": SYSTEM}]).tokens)
    w = workers("--model", path)
    e = Engine(path, n_ctx=N_CTX, prompt_cache=6, remote_stage=w.address, layer_split=str(n_blocks // 2))
    try:
        got = interleaved(e)
    finally:
        e.close()
    assert got == ref
    assert all(src in ("resident", "checkpoint") for _, src, _ in got[2:]), got
    assert all(pos > root for _, _, pos in got[2:]), (got, root)      # past the shared system prompt


def test_small_cache_and_n_choices_over_the_link(workers):
    """--prompt-cache 1 over many turns (every save evicts), and n = 3 seeded choices whose later ones restore the
    prompt's state from a checkpoint part on the worker: all as one process answers."""
    from strata.sampling.sampler import SamplingParams
    w = workers()
    ref = Engine("default", n_ctx=N_CTX, prompt_cache=1)
    e = Engine("default", n_ctx=N_CTX, prompt_cache=1, remote_stage=w.address, layer_split="10")
    try:
        assert conversation(e) == conversation(ref)
        r = ref.render_chat([{"role": "user", "content": "Tell me a word."}])

        def choices(eng):
            req = GenerationRequest(prompt_tokens=list(r.tokens), cut_points=list(r.cut_points), max_tokens=6, n=3,
                                    sampling=SamplingParams(temperature=1.0, seed=7), cancel=threading.Event())
            out: dict[int, list[int]] = {}
            for ev in eng.generate(req):
                if not hasattr(ev, "finish_reason"):
                    out.setdefault(ev.index, []).append(ev.token_id)
            return out
        assert choices(e) == choices(ref)
    finally:
        e.close()


def test_a_context_shorter_than_ubatch_starts_over_a_worker(synthetic):
    """--n-ctx below --ubatch (512 by default) over a worker: the hello asks for batches no longer than the context
    (the worker refuses a max_batch past n_ctx; the daemon exited at start), and the answers are the local ones."""
    path = str(synthetic("llama"))
    w = InProcessWorker(model=path)
    local = Engine(path, n_ctx=128)
    e = Engine(path, n_ctx=128, remote_stage=w.address, layer_split="2")
    try:
        assert e.ubatch > e.n_ctx
        r = e.render_chat([{"role": "user", "content": "Count the numbers: one two three four five"}])
        assert run(e, r)[0] == run(local, r)[0]
    finally:
        e.close()
        local.close()
        w.close()


def test_without_prompt_cache_the_remote_path_sends_no_checkpoint_message(workers):
    w = workers()
    e = Engine("default", n_ctx=N_CTX, remote_stage=w.address, layer_split="15")
    try:
        assert e.prompt_cache == 0
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        r = e.render_chat(msgs)
        a, f = run(e, r)
        b, g = run(e, r)
        assert a == b and e.stages[-1].memory.held == 0 and f.strata["checkpoints"] == 0
    finally:
        e.close()


def test_parking_and_session_files_are_refused_with_a_worker_without_park(tmp_path):
    """A worker that does not announce +park (an older one) cannot stream its parts: parking asked for is refused
    at start, a session file at the save, each in one line naming +park; by default parking is just off."""
    w = InProcessWorker(caps=[link.CAP_SPEC])
    try:
        with pytest.raises(ValueError, match=r"announce \+park"):
            Engine("default", n_ctx=N_CTX, remote_stage=w.address, conversation_cache_mib=64, layer_split="15")
        e = Engine("default", n_ctx=N_CTX, remote_stage=w.address, layer_split="15", slot_save_path=str(tmp_path))
        try:
            assert e.park is None
            r = e.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
            run(e, r)
            with pytest.raises(Exception, match=r"session files: .*\+park"):
                e.slot_save(0, "x.bin")
            assert list(tmp_path.iterdir()) == []
        finally:
            e.close()
    finally:
        w.close()


def test_a_store_emptied_under_the_main_makes_the_request_read_from_zero(synthetic):
    # a hybrid: its running state cannot be cut back, so the same request again resumes from a checkpoint
    path = str(synthetic("qwen35", seed=11, n_mtp=0))
    w = InProcessWorker(model=path)
    e = Engine(path, n_ctx=N_CTX, prompt_cache=4, remote_stage=w.address, layer_split="2")
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three primes."}]
        r = e.render_chat(msgs)
        a, _ = run(e, r)
        assert e.stages[-1].memory.held > 0
        w.worker.carrier.store.clear()             # the worker forgot every checkpoint part
        b, g = run(e, r)
        assert b == a
        assert g.strata["resume_from"] == "none" and g.strata["resume_pos"] == 0
        c, h = run(e, r)                            # and the checkpoints saved since serve again
        assert c == a and h.strata["resume_from"] == "checkpoint"
    finally:
        e.close()
        w.close()


BAD_RESULTS = [   # (what the worker does to its Result's hidden states, what the 502 says)
    ("nan", lambda h: _set(h, (0, 0), np.nan), "non-finite hidden states (1 NaN, 0 infinite values)"),
    ("inf", lambda h: _set(h, (-1, 3), -np.inf), "non-finite hidden states (0 NaN, 1 infinite values)"),
    ("narrow", lambda h: h[:, :-1], "hidden states of shape (1, 575) where (1, 576) were asked for"),
    ("extra rows", lambda h: np.concatenate([h, h]), "hidden states of shape (2, 576) where (1, 576) were asked for"),
    ("f16", lambda h: h.astype(np.float16), "hidden states of dtype float16 (the hello agreed on f32)"),
]


def _set(h, at, v):
    h = h.copy()
    h[at] = v
    return h


def test_a_workers_bad_result_is_a_502_engine_error_and_the_link_recovers(tmp_path, monkeypatch):
    """A worker whose Result breaks what the hello agreed (NaN / Inf rows, a wrong width, extra rows, another dtype)
    fails the request with 502 worker_bad_result naming the worker and the fault, never a 400 or an answer; the
    link is reset and the next request is answered as before."""
    import dataclasses
    from strata.stages import worker as wmod
    fault = {"now": None}
    forward = wmod.Carrier.forward

    def bad_forward(self, m):
        res = forward(self, m)
        return res if fault["now"] is None else dataclasses.replace(res, hidden=fault["now"](res.hidden))
    monkeypatch.setattr(wmod.Carrier, "forward", bad_forward)
    w = InProcessWorker()
    d = Daemon(tmp_path, "--remote-stage", w.address, "--layer-split", "10", n_ctx=N_CTX).start()
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "cache_prompt": False}
    try:
        st, ok = d.json("POST", "/v1/completions", body)
        assert st == 200
        for name, corrupt, says in BAD_RESULTS:
            fault["now"] = corrupt
            for stream in (False, True):
                st, h, b = d.request("POST", "/v1/completions", dict(body, stream=stream))
                if stream and st == 200:                    # the error arrives as the stream's last event
                    err = [json.loads(x[6:]) for x in b.decode().split("\n\n") if x.startswith("data: {")][-1]
                else:
                    err = json.loads(b)
                msg = err["error"]["message"]
                assert (st, err["error"]["code"], err["error"]["type"]) == \
                    (502 if not stream else st, "worker_bad_result", "server_error"), (name, st, err)
                assert says in msg and w.address in msg and "\n" not in msg, (name, msg)
                deadline = time.monotonic() + 30          # the link is reset: it comes back by itself
                while d.request("GET", "/health")[0] != 200:
                    assert time.monotonic() < deadline, d.log_tail()
                    time.sleep(0.1)
            fault["now"] = None
            st, again = d.json("POST", "/v1/completions", body)
            assert st == 200 and again["choices"][0]["text"] == ok["choices"][0]["text"], name
    finally:
        d.stop()
        w.close()


def test_health_reports_an_engine_thread_stuck_on_a_frozen_worker(tmp_path, monkeypatch):
    """A worker whose compute freezes while its event loop still answers Pings holds the main's engine thread in a
    Forward: /health turns 503 (status stuck, the reason in one line) once no forward call has returned for
    --stall-seconds while the request runs and another waits, and 200 again when the worker goes on. systemd's
    watchdog sees the same: WATCHDOG=1 every half of $WATCHDOG_USEC on the notify socket, none while stuck (with the
    reason in STATUS=), again once the worker goes on."""
    import threading as th
    from strata.stages import worker as wmod
    frozen, entered = th.Event(), th.Event()
    forward = wmod.Carrier.forward

    def freezing_forward(self, m):
        if frozen.is_set():
            entered.set()
            while frozen.is_set():
                time.sleep(0.02)
        return forward(self, m)
    monkeypatch.setattr(wmod.Carrier, "forward", freezing_forward)
    w = InProcessWorker()
    notify = NotifyListener(str(tmp_path / "notify.sock"))
    d = Daemon(tmp_path, "--remote-stage", w.address, "--layer-split", "10", "--stall-seconds", "1",
               n_ctx=N_CTX, env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "200000"}).start()
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    answers: list = []
    try:
        st, ok = d.json("POST", "/v1/completions", body)
        assert st == 200 and d.json("GET", "/health")[0] == 200
        t_ready = notify.wait_for("READY=1")
        assert t_ready is not None, notify.got
        time.sleep(1.0)
        assert len(notify.times("WATCHDOG=1", t_ready)) >= 3, notify.got      # every 0.1 s: half of 200 ms
        frozen.set()
        threads = [th.Thread(target=lambda: answers.append(d.json("POST", "/v1/completions", body)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        assert entered.wait(60)
        deadline = time.monotonic() + 60
        while (h := d.json("GET", "/health"))[0] == 200:
            assert time.monotonic() < deadline, "/health never noticed the stuck engine thread"
            time.sleep(0.1)
        st, health = h
        assert st == 503 and health["status"] == "stuck", health
        assert "no forward call has returned for" in health["error"] and "--stall-seconds 1" in health["error"]
        assert health["queue"]["running"] == 1
        t_stuck = notify.wait_for("STATUS=" + health["error"].split(":")[0], t_ready)   # the pings stopped, said why
        assert t_stuck is not None, notify.got[-5:]
        time.sleep(1.0)
        assert notify.times("WATCHDOG=1", t_stuck) == [], notify.got[-5:]
        frozen.clear()
        assert notify.wait_for("WATCHDOG=1", time.monotonic(), timeout=60) is not None   # resumed
        for t in threads:
            t.join(120)
        assert [a[0] for a in answers] == [200, 200] and all(a[1]["choices"][0]["text"] == ok["choices"][0]["text"]
                                                           for a in answers)
        assert d.json("GET", "/health")[0] == 200
    finally:
        frozen.clear()
        d.stop()
        w.close()
        notify.close()


def test_stall_seconds_must_be_a_number_of_seconds(tmp_path):
    for v in ("-1", "nan", "inf"):
        r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--socket", str(tmp_path / "s"),
                            "--stall-seconds", v], env=env_for_daemon(), cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "--stall-seconds must be a number of seconds >= 0" in r.stderr, (v, r.stderr)


def test_settle_a_late_commit_is_waited_for(workers):
    """The worker applies Commits late (the test hook); a live continuation that cuts the sequence back must wait
    for the Commit's Ack before it sends the prompt, or the worker would read it at the wrong position."""
    w = workers(env={"STRATA_TEST_COMMIT_DELAY_MS": "400"})
    ref = Engine("default", n_ctx=N_CTX, prompt_cache=0)
    e = Engine("default", n_ctx=N_CTX, prompt_cache=0, remote_stage=w.address, layer_split="10")
    try:
        p = ref.tokenize_prompt("The capital of France is Paris. The capital of Spain is")
        commits = 0
        for _ in range(3):
            want, _ = run(ref, _Prompt(p), 8)
            got, f = run(e, _Prompt(p), 8)
            assert got == want
            # continue the live sequence from a point inside what it holds: a cut-back (a Commit) then a read
            q = p + want[:3]
            want2, _ = run(ref, _Prompt(q), 8)
            got2, f2 = run(e, _Prompt(q), 8)
            assert got2 == want2
            assert f2.strata["resume_from"] == "live"
            commits += e.stages[-1].commits
        assert commits > 0
    finally:
        e.close()


class _Prompt:
    def __init__(self, tokens):
        self.tokens, self.cut_points = list(tokens), []


def test_the_links_round_trip_is_measured_from_traffic_while_requests_flow(workers, synthetic):
    """While requests flow the link is never idle, so no ping measures it: the remote stage takes the round trip
    from the traffic, each Forward's wall time less the compute the worker reports in its Result, and reports both
    in its status (/status). Over a real worker with the keepalive kept off the link (its lock held, as a request's
    forwards hold it): rtt_from "forward", the round trip the last forward's wall time less the worker's compute;
    once the link is idle a ping measures it again, the last forward's times kept."""
    model = str(synthetic("llama", seed=3))
    w = workers("--model", model)
    e = Engine(model, n_ctx=256, prompt_cache=0, remote_stage=w.address, layer_split="2")
    try:
        st = e.stages[-1]
        with st._io:                     # the keepalive thread skips its ping while the link is in use
            st.rtt = st.last_forward = None
            st.rtts.clear()
            lk0 = st.status()["link"]
            run(e, _Prompt(e.tokenize_prompt("the cat sat on the mat")), 6)
            lk = st.status()["link"]
        assert (lk0["rtt_ms"], lk0["rtt_from"], lk0["last_forward_ms"]) == (None, None, None)
        assert lk["rtt_from"] == "forward" and lk["last_forward_compute_ms"] > 0
        assert 0 <= lk["rtt_ms"] <= lk["last_forward_ms"]
        assert abs(lk["rtt_ms"] - (lk["last_forward_ms"] - lk["last_forward_compute_ms"])) <= 0.002
        # the median of the forwards' round trips so far (one prompt read and the decode steps)
        assert lk0["rtt_samples"] == 0 and lk0["rtt_median_ms"] is None
        assert lk["rtt_samples"] >= 2 and lk["rtt_median_ms"] == round(statistics.median(st.rtts) * 1e3, 3)
        deadline = time.monotonic() + 30
        while st.status()["link"]["rtt_from"] != "ping" and time.monotonic() < deadline:
            time.sleep(0.1)
        idle = st.status()["link"]
        assert idle["rtt_from"] == "ping" and idle["rtt_ms"] is not None
        assert idle["last_forward_ms"] == lk["last_forward_ms"]
        # a new connection (perhaps to another worker) starts its median afresh
        epoch = st.epoch
        st._mark_down("the test resets the link")
        deadline = time.monotonic() + 30
        while (st.epoch == epoch or st.down_reason is not None) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert st.epoch == epoch + 1 and st.status()["link"]["rtt_samples"] <= 1
    finally:
        e.close()


# ---- the handshake -------------------------------------------------------------------------------------------
def _fake_worker(behaviour: str) -> tuple[str, threading.Thread]:
    """A listener that misbehaves at the hello: 'close', 'silent', or 'v4' (a Challenge framed as protocol 4)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve():
        c, _ = srv.accept()
        if behaviour == "v4":
            frame = bytearray(link.frame_bytes(link.Challenge(nonce=b"\0" * 32, keyed=False, worker="old"), 0))
            frame[4:6] = struct.pack("<H", 4)
            frame[28:32] = struct.pack("<I", zlib.crc32(bytes(frame[:28])))
            c.sendall(bytes(frame))
            time.sleep(1)
        elif behaviour == "silent":
            time.sleep(8)
        c.close()
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"127.0.0.1:{srv.getsockname()[1]}", t


@pytest.mark.parametrize("behaviour,message", [("close", "closed the link at the hello"),
                                               ("silent", "stayed silent"),
                                               ("v4", "protocol 4.*5")])
def test_serve_exits_naming_the_worker_and_the_reason(tmp_path, behaviour, message):
    import re
    addr, _ = _fake_worker(behaviour)
    d = Daemon(tmp_path, "--remote-stage", addr, "--layer-split", "10")
    with pytest.raises(RuntimeError) as ei:
        d.start(timeout=60)
    assert d.proc.returncode not in (0, None)
    assert addr in str(ei.value) and re.search(message, str(ei.value)), str(ei.value)


def test_link_key_is_required_and_checked(workers, tmp_path):
    key = tmp_path / "link.key"
    assert subprocess.run([sys.executable, "-m", "strata.cli.main", "worker", "--gen-key", str(key)],
                          env=env_for_daemon(), cwd=ROOT, capture_output=True).returncode == 0
    assert key.stat().st_mode & 0o077 == 0 and key.stat().st_size >= 32
    w = workers("--link-key-file", str(key))
    with pytest.raises(WorkerRefused, match="requires the link key"):
        Engine("default", n_ctx=N_CTX, remote_stage=w.address, layer_split="10")
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    with pytest.raises(WorkerRefused, match="link key does not match"):
        Engine("default", n_ctx=N_CTX, remote_stage=w.address, layer_split="10", link_key_file=str(other))
    e = Engine("default", n_ctx=N_CTX, remote_stage=w.address, layer_split="10", link_key_file=str(key))
    try:
        r = e.render_chat([{"role": "user", "content": "Hi"}])
        assert len(run(e, r, 4)[0]) == 4
    finally:
        e.close()


def test_worker_refuses_a_second_main_another_model_and_too_many_parts(workers, synthetic):
    w = workers()
    e = Engine("default", n_ctx=N_CTX, remote_stage=w.address, layer_split="10")
    try:
        with pytest.raises(WorkerRefused, match="another main is connected"):
            Engine("default", n_ctx=N_CTX, remote_stage=w.address, layer_split="10")
    finally:
        e.close()
    time.sleep(0.5)
    other = synthetic("llama", seed=3)
    with pytest.raises(WorkerRefused) as ei:
        Engine(str(other), n_ctx=256, remote_stage=w.address, layer_split="1")
    # one line naming what differs, each value read here from the two files with gguf-py
    import gguf
    from strata.gguf.default_model import resolve_model
    theirs, ours = Path(resolve_model("default")), Path(other)

    fields = {p: gguf.GGUFReader(str(p)).fields for p in (theirs, ours)}     # each file read once (seconds)

    def meta(path, key):
        f = fields[path]
        arch = str(bytes(f["general.architecture"].parts[-1]), "utf-8")
        return int(f[key.format(arch=arch)].parts[-1][0])
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"worker {w.address} has another model: "), msg
    for needle in [f"file {theirs.name}, not {ours.name}",
                   f"size {theirs.stat().st_size:,} bytes, not {ours.stat().st_size:,} bytes",
                   f"blocks {meta(theirs, '{arch}.block_count')}, not {meta(ours, '{arch}.block_count')}",
                   f"width {meta(theirs, '{arch}.embedding_length')}, not {meta(ours, '{arch}.embedding_length')}",
                   f"quantization {gguf.LlamaFileType(meta(theirs, 'general.file_type')).name.removeprefix('MOSTLY_')}",
                   f"start it with its main's model file ({ours.name}, --model)"]:
        assert needle in msg, (needle, msg)
    c = LinkClient(w.address)
    with pytest.raises(WorkerRefused, match="at most 64"):
        c.connect(link.Hello(protocol=5, fingerprint=default_fingerprint(), lo=10, hi=30, n_blocks=30, n_embd=576,
                             act_dtype="f32", n_ctx=512, max_batch=64, ckpt_max=65, next_hops=[], nonce=b"", mac=b""))


def test_an_idle_chain_stays_up_and_a_silent_connection_locks_no_main_out(workers):
    """The last worker of a chain drops a link that stays silent past --idle-timeout; the relay keeps it alive while
    its main pings, so the first request after an idle spell still works. A connection that sends nothing does not
    take the worker."""
    # an idle main pings after PING_EVERY (1 s) of quiet, looked at once a second: up to 2 s apart, more on a loaded
    # host; a 2 s timeout raced it (CI saw the chain dropped once), 4 s leaves that margin twice
    b = workers("--idle-timeout", "4")
    a = workers("--idle-timeout", "4")
    e = Engine("default", n_ctx=N_CTX, remote_stage=f"{a.address},{b.address}", layer_split="10,20")
    try:
        r = e.render_chat([{"role": "user", "content": "Hi"}])
        first = run(e, r, 4)[0]
        time.sleep(6)                                   # longer than the idle timeout on both workers
        assert run(e, r, 4)[0] == first and e.unavailable() is None
    finally:
        e.close()
    c = workers()
    lurker = socket.create_connection(("127.0.0.1", c.port), timeout=10)   # connects, says nothing
    try:
        e = Engine("default", n_ctx=N_CTX, remote_stage=c.address, layer_split="10")
        e.close()
    finally:
        lurker.close()


def test_raw_client_against_a_worker_bad_frames_are_refused(workers):
    """A frame with a broken checksum gets an Error naming it, and the worker stays up for the next main."""
    w = workers()
    s = socket.create_connection(("127.0.0.1", w.port), timeout=10)
    _, ch = link.recv_frame(s)
    assert isinstance(ch, link.Challenge) and not ch.keyed
    bad = bytearray(link.frame_bytes(link.Ping(nonce=1), 1))
    bad[-1] ^= 0xFF
    s.sendall(bytes(bad))
    _, err = link.recv_frame(s)
    assert isinstance(err, link.Error) and "checksum" in err.message
    s.close()
    time.sleep(0.3)
    c = LinkClient(w.address)
    with pytest.raises(WorkerRefused, match="not a worker's carve"):
        c.connect(link.Hello(protocol=5, fingerprint=default_fingerprint(), lo=0, hi=30, n_blocks=30, n_embd=576,
                             act_dtype="f32", n_ctx=512, max_batch=64, ckpt_max=0, next_hops=[], nonce=b"", mac=b""))


# ---- the daemon: a worker dies mid-stream and comes back -----------------------------------------------------
def test_daemon_worker_killed_mid_stream_then_back(workers, tmp_path):
    from openai import OpenAI
    port = free_port()
    w = workers(port=0)
    wport = w.port
    d = Daemon(tmp_path, "--remote-stage", w.address, "--layer-split", "10", port=port, n_ctx=N_CTX).start()
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        before = client.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0)
        text = before.choices[0].message.content
        stream = client.chat.completions.create(model="default", messages=msgs, max_tokens=400, temperature=0,
                                                stream=True)
        got, t_kill, t_end, error = 0, None, None, None
        try:
            for chunk in stream:
                got += 1
                if got == 5:
                    w.stop(signal.SIGKILL)
                    t_kill = time.monotonic()
        except Exception as e:  # noqa: BLE001 -- the SSE error event surfaces as an APIError
            error = e
        t_end = time.monotonic()
        assert t_kill is not None and error is not None, "the stream should end with an error event"
        assert t_end - t_kill < 10
        # while the worker is gone: 503 at once, and /health says why
        t0 = time.monotonic()
        st, body = d.json("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 4})
        assert st == 503 and body["error"]["code"] == "worker_unavailable"
        assert time.monotonic() - t0 < 1.0
        assert d.request("GET", "/health")[0] == 503
        r = subprocess.run([sys.executable, "-m", "strata.cli.ctl", "--url", f"http://127.0.0.1:{port}", "health"],
                           env=env_for_daemon(), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stdout.startswith("unavailable: ") and w.address in r.stdout, r
        # the worker comes back on its port: the daemon reconnects and answers as before
        back = WorkerProc(port=wport).start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and d.request("GET", "/health")[0] != 200:
            time.sleep(0.2)
        again = client.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0)
        assert again.choices[0].message.content == text
    finally:
        d.stop()
        if "back" in locals():
            back.stop()


def test_usage_errors_for_remote_flags():
    env = env_for_daemon()
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--remote-stage", "nohost",
                        "--no-socket", "--port", "1"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "--remote-stage" in r.stderr
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "worker", "--listen", "0.0.0.0:0"], env=env,
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "--link-key-file" in r.stderr


# ---- hosts made of network namespaces ------------------------------------------------------------------------
def test_three_hosts_over_veth_with_delay_and_loss_and_a_relay(tmp_path):
    """main -- A -- B: three network namespaces, veth links with netem delay (1 ms) and loss (0.5 %); the main
    cannot reach B, so A relays. The daemon (in the main's namespace) answers as one process does, and resumes
    the next turn from a checkpoint across both links."""
    from tests import netns
    why = netns.available()
    if why:
        pytest.skip(why)
    key = tmp_path / "link.key"
    link.write_key_file(key)
    hosts = netns.Hosts("m", "a", "b")
    procs = []
    try:
        _, a_addr = hosts.link("m", "a", 61, delay_ms=1.0, loss_pct=0.5)
        a_next, b_addr = hosts.link("a", "b", 62, delay_ms=1.0)
        wa = WorkerProc("--link-key-file", str(key), host=a_addr, port=7700, wrap=lambda c: hosts.cmd("a", c))
        wb = WorkerProc("--link-key-file", str(key), host=b_addr, port=7700, wrap=lambda c: hosts.cmd("b", c))
        procs += [wb.start(), wa.start()]
        d = Daemon(tmp_path, "--remote-stage", f"{a_addr}:7700,{b_addr}:7700", "--link-key-file", str(key),
                   "--layer-split", "8,19", "--prompt-cache", "4", n_ctx=N_CTX)
        d.cmd = hosts.cmd("m", d.cmd)
        d.start()
        procs.append(d)
        ref = Engine("default", n_ctx=N_CTX, prompt_cache=4)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three primes."}]
        for turn in range(2):
            r = ref.render_chat(msgs)
            req = GenerationRequest(prompt_tokens=list(r.tokens), cut_points=list(r.cut_points), max_tokens=12,
                                    cancel=threading.Event())
            want = "".join(getattr(ev, "text", "") or "" for ev in ref.generate(req))
            st, body = d.json("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 12,
                                                                "temperature": 0})
            assert st == 200, body
            assert body["choices"][0]["message"]["content"] == want
            if turn == 1:
                assert body["strata"]["resume_from"] in ("live", "checkpoint") and body["strata"]["resume_pos"] > 0
            msgs = msgs + [{"role": "assistant", "content": want}, {"role": "user", "content": "And two more?"}]
        if hosts.netem_error:
            print(f"netem unavailable here ({hosts.netem_error}): the veth links ran without delay or loss")
        st, status = d.json("GET", "/status")
        stage = status["engine"]["stages"][-1] if "engine" in status else status["stages"][-1]
        assert stage["link"]["up"] and stage["link"]["checkpoints_held"] > 0
    finally:
        for p in procs:
            p.stop()
        hosts.close()


def test_a_worker_stopped_with_a_main_connected_logs_no_error():
    """SIGTERM while the main holds the link: the worker says Bye, exits 0, and logs no error-level line (before,
    asyncio logged the cancelled connection task with a traceback)."""
    import json
    w = WorkerProc().start()
    e = Engine("default", n_ctx=256, ubatch=128, remote_stage=w.address, layer_split="15", threads=1)
    try:
        r = e.render_chat([{"role": "user", "content": "hi"}])
        list(e.generate(GenerationRequest(prompt_tokens=r.tokens, cut_points=r.cut_points, max_tokens=3)))
        w.stop()
        assert w.proc.returncode == 0
        time.sleep(0.3)
        records = [json.loads(ln) for ln in w.lines if ln.startswith("{")]
        assert records and not [r for r in records if r.get("level") in ("error", "critical")], records
        assert not any("Traceback" in ln for ln in w.lines)
    finally:
        e.close()


def test_worker_pings_systemds_watchdog(tmp_path):
    """`strata worker` under a unit with WatchdogSec=: READY=1, then WATCHDOG=1 every half of $WATCHDOG_USEC from its
    event loop."""
    notify = NotifyListener(str(tmp_path / "notify.sock"))
    w = WorkerProc(env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "200000"}).start()
    try:
        t_ready = notify.wait_for("READY=1")
        assert t_ready is not None, notify.got
        time.sleep(1.0)
        assert len(notify.times("WATCHDOG=1", t_ready)) >= 3, notify.got
    finally:
        w.stop()
        notify.close()
