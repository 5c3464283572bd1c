"""`stratactl` in a subprocess against the real daemon: every subcommand, --json, exit codes 0/1/2/3."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.daemon import ROOT, Daemon, env_for_daemon, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("ctl"), port=free_port()).start()
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
    assert st["pos"] == 0 and st["checkpoints"] == []


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
