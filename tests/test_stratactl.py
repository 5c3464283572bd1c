"""`stratactl` in a subprocess against the real daemon: every subcommand, --json, exit codes 0/1/2/3."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from tests.daemon import ROOT, Daemon, env_for_daemon, free_port

pytestmark = pytest.mark.slow
TAIL = 8        # the daemon's --prompt-cache-tail


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("ctl"), "--prompt-cache-tail", str(TAIL), port=free_port()).start()
    yield d
    assert d.stop() == 0, d.log_tail()


def ctl(daemon, *args, stdin: str | None = None, socket: str | None = None):
    where = ["--socket", socket or daemon.sock] if daemon is not None or socket else []
    return subprocess.run([sys.executable, "-m", "strata.cli.ctl", *where, *args], capture_output=True, text=True,
                          input=stdin, env=env_for_daemon(), cwd=ROOT, timeout=120)


def test_health_models_slots(daemon):
    r = ctl(daemon, "health")
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr
    r = ctl(daemon, "health", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "ok"
    r = ctl(daemon, "models")
    assert r.returncode == 0 and "SmolLM2-135M-Instruct.Q4_1" in r.stdout and "N_CTX" in r.stdout
    assert json.loads(ctl(daemon, "models", "--json").stdout)["data"][0]["meta"]["n_ctx"] == 512
    r = ctl(daemon, "slots")
    assert r.returncode == 0 and "idle" in r.stdout
    assert json.loads(ctl(daemon, "slots", "--json").stdout)[0]["id"] == 0


def test_chat_one_shot_then_status_cache_metrics(daemon):
    r = ctl(daemon, "chat", "Say hello.", "--system", "You are brief.", "--max-tokens", "6", "--temperature", "0",
            "-v")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "generated" in r.stderr
    j = ctl(daemon, "chat", "Say hello.", "--system", "You are brief.", "--max-tokens", "6", "--temperature", "0",
            "--json")
    d = json.loads(j.stdout)
    assert d["choices"][0]["message"]["content"] == r.stdout.rstrip("\n")   # streamed == non-streamed
    assert d["timings"]["cache_n"] > 0                                       # the second read resumed
    r = ctl(daemon, "status")
    assert r.returncode == 0 and "SmolLM2-135M-Instruct.Q4_1" in r.stdout and "queue" in r.stdout
    assert "speculation    off (--spec 0)" in r.stdout and "kept (--responses-store 256)" in r.stdout
    s = json.loads(ctl(daemon, "--json", "status").stdout)
    assert s["engine"]["n_ctx"] == 512 and s["queue"]["waiting"] == 0
    r = ctl(daemon, "cache")
    assert r.returncode == 0 and "POS" in r.stdout and "checkpoints" in r.stdout
    c = json.loads(ctl(daemon, "cache", "--json").stdout)
    assert len(c["checkpoints"]) >= 1
    assert all({"pos", "kind", "bytes"} <= set(cp) for cp in c["checkpoints"])
    r = ctl(daemon, "metrics")
    assert r.returncode == 0 and "strata_generated_tokens_total" in r.stdout
    m = json.loads(ctl(daemon, "metrics", "--json").stdout)
    assert sum(s["value"] for s in m["strata_generated_tokens"] if s["name"].endswith("_total")) >= 6


def test_near_tail_point_listed_and_skipped_without_checkpoints(daemon):
    assert ctl(daemon, "erase", "0").returncode == 0
    body = {"messages": [{"role": "system", "content": "You are brief."},
                         {"role": "user", "content": "A long note on rivers, hills, forests and the valley's weather "
                                                     "over many seasons; summarise it in one short line."}],
            "max_tokens": 2, "temperature": 0}
    status, r = daemon.json("POST", "/v1/chat/completions", {**body, "strata_checkpoint": False})
    assert status == 200, r
    kinds = [c["kind"] for c in json.loads(ctl(daemon, "cache", "--json").stdout)["checkpoints"]]
    assert kinds and "tail" not in kinds            # the root only
    status, r = daemon.json("POST", "/v1/chat/completions", body)
    assert status == 200, r
    n = r["usage"]["prompt_tokens"]
    cps = json.loads(ctl(daemon, "cache", "--json").stdout)["checkpoints"]
    assert [c["pos"] for c in cps if c["kind"] == "tail"] == [n - TAIL], cps
    out = ctl(daemon, "cache").stdout
    assert any(line.split()[:2] == [str(n - TAIL), "tail"] for line in out.splitlines()), out


def test_chat_interactive(daemon):
    r = ctl(daemon, "chat", "--max-tokens", "4", "--temperature", "0", stdin="Hi there\nAnd again\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert len([ln for ln in r.stdout.splitlines() if ln.strip()]) >= 2


def test_chat_unknown_slash_command_is_not_sent(daemon):
    before = ctl(daemon, "status", "--json")
    n0 = json.loads(before.stdout)["engine"]["requests"]
    r = ctl(daemon, "chat", "--max-tokens", "2", "--temperature", "0", stdin="/frobnicate now\n/exit\n")
    assert r.returncode == 0 and "unknown command '/frobnicate'" in r.stderr
    assert json.loads(ctl(daemon, "status", "--json").stdout)["engine"]["requests"] == n0    # nothing was sent


def test_slot_actions_report_server_error(daemon):
    for action in (["save", "0", "--filename", "a.bin"], ["restore", "0", "--filename", "a.bin"]):
        r = ctl(daemon, *action)
        assert r.returncode == 1 and "400" in r.stderr and "--slot-save-path" in r.stderr
        r = ctl(daemon, "--json", *action)        # --json: the server's error object on stdout as well
        assert r.returncode == 1 and "--slot-save-path" in json.loads(r.stdout)["error"]["message"]


def test_erase_forgets_the_conversation(daemon):
    r = ctl(daemon, "chat", "--max-tokens", "2", "--temperature", "0", "Hello")
    assert r.returncode == 0
    r = ctl(daemon, "erase", "0")
    assert r.returncode == 0 and "slot 0: erase done" in r.stdout
    st = json.loads(ctl(daemon, "status", "--json").stdout)["engine"]
    # what stays is held by conversations the daemon's earlier requests parked (they stay)
    assert st["pos"] == 0 and [c for c in st["checkpoints"] if not c["pins"]] == []
    # the slot id defaults to 0, as its help says (it was a required argument)
    assert ctl(daemon, "chat", "--max-tokens", "2", "--temperature", "0", "Hello").returncode == 0
    r = ctl(daemon, "erase")
    assert r.returncode == 0 and "slot 0: erase done" in r.stdout, r.stderr
    assert json.loads(ctl(daemon, "status", "--json").stdout)["engine"]["pos"] == 0
    r = ctl(daemon, "save", "--filename", "a.bin")
    assert r.returncode == 1 and "--slot-save-path" in r.stderr


def test_url_over_tcp(daemon):
    r = subprocess.run([sys.executable, "-m", "strata.cli.ctl", "--url", f"http://127.0.0.1:{daemon.port}", "health"],
                       capture_output=True, text=True, env=env_for_daemon(), cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("ok")


def test_exit_codes(tmp_path):
    bad = str(tmp_path / "missing.sock")
    for cmd in ("status", "health", "models", "slots", "metrics", "cache"):
        r = ctl(None, cmd, socket=bad)
        assert r.returncode == 3 and bad in r.stderr, (cmd, r.stderr)
    r = ctl(None, "chat", "hi", socket=bad)
    assert r.returncode == 3 and bad in r.stderr
    r = ctl(None, "chat", socket=bad, stdin="")   # interactive / piped with nothing to send: still told at once
    assert r.returncode == 3 and bad in r.stderr
    r = ctl(None, "status", socket=str(tmp_path))  # a directory where the socket should be: said so
    assert r.returncode == 3 and "is a directory, not a socket" in r.stderr
    import socket as socketlib
    stale = str(tmp_path / "stale.sock")           # a socket file nothing listens on (a daemon that exited)
    s = socketlib.socket(socketlib.AF_UNIX)
    s.bind(stale)
    s.close()
    r = ctl(None, "status", socket=stale)
    assert r.returncode == 3 and "nothing listens on it" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = ctl(None, "frobnicate", socket=bad)
    assert r.returncode == 2
    r = ctl(None, "save", socket=bad)          # missing slot id
    assert r.returncode == 2
    for t in ("-1", "0", "nan", "soon"):       # a usage error naming --timeout, not a traceback
        r = ctl(None, "--timeout", t, "status", socket=bad)
        assert r.returncode == 2 and "--timeout" in r.stderr and "Traceback" not in r.stderr, (t, r.stderr)


def test_status_device_memory(daemon):
    """/status's "device" object on the CPU daemon: the weights are the GGUF's tensor bytes (gguf's own reader), the KV
    page pool is pages x page size x (K + V of 30 layers x 3 KV heads x 64 dims, float32); the table prints it."""
    gguf = pytest.importorskip("gguf")
    s = json.loads(ctl(daemon, "--json", "status").stdout)
    dev = s["device"]
    assert dev["name"] == "cpu" and dev["kind"] == "cpu"
    assert dev["weights_bytes"] == sum(int(t.n_bytes) for t in gguf.GGUFReader(s["engine"]["path"]).tensors)
    kv = s["engine"]["kv_pages"]
    assert kv["total"] * kv["page_size"] >= 512
    assert dev["kv_pool_bytes"] == kv["total"] * kv["page_size"] * 30 * 2 * 3 * 64 * 4
    assert 0 <= dev["kv_valid_bytes"] <= dev["kv_used_bytes"] <= dev["kv_pool_bytes"]
    assert dev["kv"] == "f32" and s["engine"]["kv"] == "f32"   # the CPU backend's cache holds float32
    assert "device_total_bytes" not in dev                     # no accelerator memory on the CPU backend
    r = ctl(daemon, "status")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("device"))
    assert "cpu:" in line and "weights" in line and "KV pool f32" in line and "MiB" in line
    assert "in pages used" in line and "in valid positions" in line


def test_chat_goes_on_after_a_server_error(daemon):
    """A message the server refuses (too long for the context) is reported and dropped; the next one is answered."""
    long = "word " * 2000
    r = ctl(daemon, "chat", "--max-tokens", "2", "--temperature", "0", stdin=f"{long}\nHi\n/help\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "server error 400" in r.stderr and "context" in r.stderr
    assert "/reset clears the conversation" in r.stderr          # /help
    assert [ln for ln in r.stdout.splitlines() if ln.strip()]    # "Hi" was answered


def test_chat_is_greedy_by_default_like_strata_chat(daemon):
    """stratactl chat without --temperature sends temperature 0: the same question twice, the same answer."""
    a = ctl(daemon, "chat", "--max-tokens", "12", "Name a colour.")
    b = ctl(daemon, "chat", "--max-tokens", "12", "Name a colour.")
    assert a.returncode == 0 and b.returncode == 0
    assert a.stdout == b.stdout and a.stdout.strip()


def _status_of(tmp_path, status: dict):
    """`stratactl status` against a Unix socket that answers GET /status with `status`."""
    import http.server
    import socketserver

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(status).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

        def get_request(self):
            sock, _ = super().get_request()
            return sock, ("local", 0)

    sock = str(tmp_path / "s.sock")
    srv = UnixServer(sock, Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        return ctl(None, "status", socket=sock)
    finally:
        srv.shutdown()
        srv.server_close()


def _remote_status(link: dict) -> dict:
    return {"model": "m", "engine": {"arch": "llama", "n_ctx": 8, "prompt_cache": 8,
                                     "checkpoints": [{"pos": 4 * i, "kind": "turn"} for i in range(1, 7)],
                                     "parked": [{"tier": "ram", "bytes": 3 << 20, "tokens": 40, "checkpoints": 5}]},
            "stages": [{"stage": 0, "device": "cpu", "layers": [0, 4], "memory": {}},
                       {"stage": 1, "device": "remote", "layers": [4, 8], "memory": {},
                        "link": {"up": True, "checkpoints_held": 12, "store_bytes": 5 << 20, **link}}],
            "queue": {"running": 0, "waiting": 0, "max": 1}}


def test_status_before_the_first_ping_says_so(tmp_path):
    """A remote stage whose link has no round trip measured yet: said in words, not 'None ms'."""
    p = _status_of(tmp_path, _remote_status({"rtt_ms": None}))
    assert p.returncode == 0, p.stderr
    assert "no round trip measured yet" in p.stdout and "None ms" not in p.stdout
    # what each count counts: the tree's checkpoints; the parked conversations' own; the parts the worker keeps
    # (12 = its layers of the 6 checkpoints, the parked conversation and that one's 5 checkpoints)
    assert "6 kept in the prefix tree" in p.stdout and "1 conversation (5 checkpoints of its own)" in p.stdout
    assert "the worker keeps 12 parts for this daemon, 5.0 MiB" in p.stdout and "checkpoint parts held" not in p.stdout


@pytest.mark.parametrize("link,words", [
    ({"rtt_ms": 0.21, "rtt_from": "forward", "last_forward_ms": 3.5, "last_forward_compute_ms": 3.29},
     "link up (round trip 0.21 ms from the last forward: 3.5 ms, 3.29 ms of it the worker's compute;"),
    ({"rtt_ms": 0.12, "rtt_from": "ping", "last_forward_ms": 3.5, "last_forward_compute_ms": 3.29},
     "link up (round trip 0.12 ms by ping, the last forward 3.5 ms;"),
    ({"rtt_ms": 0.12, "rtt_from": "ping", "last_forward_ms": None, "last_forward_compute_ms": None},
     "link up (round trip 0.12 ms by ping;"),
    ({"rtt_ms": 0.9, "rtt_from": "ping", "last_forward_ms": None, "last_forward_compute_ms": None,
      "rtt_median_ms": 0.15, "rtt_samples": 16},
     "link up (round trip 0.15 ms (median of the last 16), 0.9 ms by ping;"),
])
def test_status_says_what_measured_the_links_round_trip(tmp_path, link, words):
    """The round trip measured from the traffic while requests flow (the last forward's wall time less the worker's
    compute) is said as such, with both; a ping's with the last forward's wall time where there was one."""
    p = _status_of(tmp_path, _remote_status(link))
    assert p.returncode == 0 and words in p.stdout, p.stdout + p.stderr


def test_status_lists_parked_conversations_and_the_session_quota(tmp_path):
    """`stratactl status` lists the conversations parked in RAM (not only `stratactl cache`) and the session
    directory's use against --slot-quota-mib; a save past the quota is a 400 naming the quota, nothing written; a
    bad session file name is a 400 whose param is "filename"; /status and /metrics report the directory."""
    slots = tmp_path / "slots"
    slots.mkdir()
    d = Daemon(tmp_path, "--park-resident", "0", "--slot-save-path", str(slots), "--slot-quota-mib", "32").start()
    try:
        chat = {"messages": [{"role": "user", "content": "Name a river."}], "max_tokens": 4, "temperature": 0}
        assert d.json("POST", "/v1/chat/completions", chat)[0] == 200
        st, saved = d.json("POST", "/slots/0?action=save", {"filename": "a.bin"})
        assert st == 200, saved
        size = saved["n_written"]
        assert d.json("POST", "/v1/chat/completions", dict(chat, messages=[{"role": "user", "content": "Hi"}]))[0] \
            == 200                                           # the first conversation is parked, in RAM
        r = ctl(d, "status")
        assert r.returncode == 0, r.stderr
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("parked"))
        assert "1 conversation (" in line and "1 in RAM" in line and "--conversation-cache-mib" in line, r.stdout
        assert "1 files" in r.stdout and "of 32.0 MiB (--slot-quota-mib)" in r.stdout
        (slots / "other.dat").write_bytes(b"o" * ((32 << 20) - size - size // 2))   # room: half a save
        st, e = d.json("POST", "/slots/0?action=save", {"filename": "b.bin"})
        assert st == 400 and e["error"]["code"] == "slot_quota_exceeded" and e["error"]["param"] is None, e
        assert "--slot-quota-mib" in e["error"]["message"] and "\n" not in e["error"]["message"]
        assert sorted(p.name for p in slots.iterdir()) == ["a.bin", "other.dat"]       # no temporary left
        assert d.json("POST", "/slots/0?action=save", {"filename": "a.bin"})[0] == 200   # replacing its own file
        for body in ({"filename": "../x.bin"}, {"filename": 7}, {"filename": "a b.bin"}):
            st, e = d.json("POST", "/slots/0?action=save", body)
            assert st == 400 and e["error"]["param"] == "filename", (body, e)
        st, e = d.json("POST", "/slots/0?action=restore", {"filename": "missing.bin"})
        assert st == 400 and e["error"]["param"] == "filename", e
        sf = d.json("GET", "/status")[1]["engine"]["session_files"]
        used = sum(p.stat().st_size for p in slots.iterdir())
        assert sf == {"bytes": used, "files": 2, "quota_bytes": 32 << 20}
        assert d.metric("strata_session_files_bytes") == used and d.metric("strata_session_files_quota_bytes") == 32 << 20
    finally:
        assert d.stop() == 0, d.log_tail()


# ---- a hostile or broken server: stratactl stays bounded and prints nothing raw -----------------------------------
def _fake_server(path: str, behaviour):
    """A Unix socket at `path` whose every connection reads the request, then runs behaviour(conn, stop)."""
    import socket as socketlib
    import threading
    srv = socketlib.socket(socketlib.AF_UNIX)
    srv.bind(path)
    srv.listen(8)
    stop = threading.Event()

    def one(conn):
        try:
            conn.settimeout(30)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            head, _, body = head.partition(b"\r\n\r\n")
            n = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length:")), 0)
            while len(body) < n:
                body += conn.recv(4096)
            behaviour(conn, stop)
        except OSError:
            pass
        finally:
            conn.close()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=one, args=(c,), daemon=True).start()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return stop


def _answer(status: int, body: bytes, ctype: bytes = b"application/json"):
    def behaviour(conn, stop):
        conn.sendall(b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                     % (status, ctype, len(body)) + body)
    return behaviour


def _silent(conn, stop):
    stop.wait(60)


def _dripping(conn, stop):                  # one byte of a header every 0.2 s, forever: no per-read timeout fires
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Drip: ")
    while not stop.wait(0.2):
        conn.sendall(b"a")


@pytest.mark.parametrize("behaviour", [_silent, _dripping], ids=["silent", "dripping"])
def test_timeout_is_a_deadline_for_the_whole_exchange(tmp_path, behaviour):
    """--timeout bounds the whole exchange: a server that never answers, or drips a byte at a time, gets one line
    and exit 3 after --timeout, for a plain call and for a streamed chat."""
    sock = str(tmp_path / "fake.sock")
    stop = _fake_server(sock, behaviour)
    try:
        for cmd in (["status"], ["health"], ["chat", "hi"]):
            r = ctl(None, "--timeout", "1.5", *cmd, socket=sock)
            assert r.returncode == 3, (cmd, r.stderr)
            assert "no complete answer from socket" in r.stderr and "within --timeout 1.5 s" in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    finally:
        stop.set()


GARBAGE = b"\x1b]0;owned\x07\x1b[2J\x9b31m\xe2\x80\xae\xff\xfe\x00 garbage"


@pytest.mark.parametrize("status,body,cmds,needle", [
    (500, GARBAGE, (["status"], ["health"], ["models"], ["save", "0", "-f", "x"]), "server error 500"),
    (200, GARBAGE, (["status"], ["health"], ["slots"]), "not"),
    (500, json.dumps({"error": {"message": "bad \x1b[2J\u202e\x9b thing"}}).encode(), (["status"], ["chat", "hi"]),
     "bad \\u001b[2J\\u202e\\u009b thing"),
    (200, b"[" * 100000 + b"]" * 100000, (["status"], ["health"], ["cache"]), "not"),
    (500, b"[" * 100000 + b"]" * 100000, (["status"], ["--json", "status"]), "server error 500"),
    (200, b"data: " + b"[" * 100000 + b"\n\n", (["chat", "hi"],), "not a JSON object"),
])
def test_a_garbage_answer_is_one_escaped_line(tmp_path, status, body, cmds, needle):
    """Control bytes, escape sequences, bidirectional overrides, bytes that are not UTF-8, JSON nested 100,000 deep:
    one line on stderr (exit 1) with nothing raw in it, no traceback; stdout gets nothing raw either."""
    sock = str(tmp_path / "fake.sock")
    ctype = b"text/event-stream" if body.startswith(b"data: ") else b"application/json"
    stop = _fake_server(sock, _answer(status, body, ctype))
    try:
        for cmd in cmds:
            r = subprocess.run([sys.executable, "-m", "strata.cli.ctl", "--socket", sock, *cmd], capture_output=True,
                               env=env_for_daemon(), cwd=ROOT, timeout=120)
            err, out = r.stderr.decode("utf-8", "replace"), r.stdout.decode("utf-8", "replace")
            assert r.returncode == 1, (cmd, err)
            assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (cmd, err)
            for raw in (b"\x1b", b"\x07", b"\x9b", b"\xc2\x9b", "\u202e".encode(), b"\x00"):
                assert raw not in r.stderr and raw not in r.stdout, (cmd, raw, err, out)
    finally:
        stop.set()


def test_metrics_text_is_printed_escaped(tmp_path):
    sock = str(tmp_path / "fake.sock")
    stop = _fake_server(sock, _answer(200, b"strata_x 1\n# \x1b[2J\xc2\x9b\x07 help\n", b"text/plain"))
    try:
        r = subprocess.run([sys.executable, "-m", "strata.cli.ctl", "--socket", sock, "metrics"], capture_output=True,
                           env=env_for_daemon(), cwd=ROOT, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith(b"strata_x 1\n")
        assert b"\x1b" not in r.stdout and b"\x07" not in r.stdout and b"\xc2\x9b" not in r.stdout
        assert b"\\u001b[2J\\u009b\\u0007 help" in r.stdout
    finally:
        stop.set()


def test_status_lines_for_speculation_and_the_responses_store():
    """stratactl status's lines for /status's engine.spec and responses_store, from the fields the daemon sends."""
    from strata.cli import ctl as c
    sp = {"n": 3, "draft": "lookup", "drafted": 12, "accepted": 9, "verifies": 5, "acceptance_rate": 0.75}
    assert c._spec_line(sp) == "--spec 3 (lookup drafts): 12 drafted, 9 accepted (75.0 %) in 5 verifies"
    assert c._spec_line({"n": 0, "draft": None}) == c._spec_line(None) == "off (--spec 0)"
    line = c._responses_line({"entries": 4, "bytes": 2048, "budget": 256 << 20, "max_entries": 4})
    assert line.startswith("4 kept (--responses-store 4), 2") and "(--responses-store-mib)" in line
    assert c._responses_line(None) == "-"


def test_slots_table_shows_each_busy_slot_phase(tmp_path):
    """`stratactl slots` shows whether a busy slot reads its prompt or decodes (the /slots `phase`), '-' when idle."""
    sock = str(tmp_path / "fake.sock")
    view = [{"id": 0, "state": "processing", "is_processing": True, "phase": "prompt", "pos": 512, "n_ctx": 4096,
             "id_task": 3, "next_token": {"n_decoded": 0}, "checkpoints": 1},
            {"id": 1, "state": "processing", "is_processing": True, "phase": "decode", "pos": 70, "n_ctx": 4096,
             "id_task": 4, "next_token": {"n_decoded": 9}, "checkpoints": 2},
            {"id": 2, "state": "idle", "is_processing": False, "phase": None, "pos": 0, "n_ctx": 4096,
             "id_task": -1, "next_token": {"n_decoded": 0}, "checkpoints": 0}]
    stop = _fake_server(sock, _answer(200, json.dumps(view).encode()))
    try:
        r = ctl(None, "slots", socket=sock)
    finally:
        stop.set()
    assert r.returncode == 0, r.stderr
    head, _, *rows = r.stdout.strip().splitlines()
    assert head.split()[:3] == ["ID", "STATE", "PHASE"], head
    assert [row.split()[:3] for row in rows] == [["0", "processing", "prompt"], ["1", "processing", "decode"],
                                                 ["2", "idle", "-"]], r.stdout


def test_status_names_no_single_position_with_several_slots(tmp_path):
    """`stratactl status` with one slot shows the live position; with several, each busy slot's position in the
    slots line and no lone 'position' row (which slot's would it be?)."""
    def status(slots):
        return {"model": "m", "engine": {"pos": 1187, "n_ctx": 4096}, "queue": {"running": 1, "waiting": 0, "max": 8},
                "slots": slots}
    busy = {"id": 1, "is_processing": True, "phase": "decode", "pos": 136, "next_token": {"n_decoded": 85}}
    idle = {"id": 0, "is_processing": False, "phase": None, "pos": 1187, "next_token": {"n_decoded": 0}}
    out = {}
    for name, slots in (("one", [dict(idle, pos=1187)]), ("four", [idle, busy, dict(idle, id=2), dict(idle, id=3)])):
        sock = str(tmp_path / f"{name}.sock")
        stop = _fake_server(sock, _answer(200, json.dumps(status(slots)).encode()))
        try:
            out[name] = ctl(None, "status", socket=sock)
        finally:
            stop.set()
        assert out[name].returncode == 0, out[name].stderr
    rows = {n: {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()} for n, r in out.items()}
    assert rows["one"]["position"].split()[1] == "1187" and "0 / 1 busy" in rows["one"]["slots"]
    assert "position" not in rows["four"] and "1 / 4 busy (1: decode at 136 (85 decoded))" in rows["four"]["slots"]
