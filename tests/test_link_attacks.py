"""The protected stage link between real processes on loopback: a man-in-the-middle proxy between the daemon and a
`strata worker` changes a header or payload byte, replays, drops or swaps in another connection's frame, each way;
the daemon answers 503 worker_unavailable (never a 400), reconnects, and answers as before. Encryption gives the
same greedy answer; --insecure-link talks to peers that speak the plain frames of protocol 5: this repository's own
code from before frame protection (its worker and its main), and peers written here from link/PROTOCOL.md."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
import zlib

import numpy as np
import pytest

import link
from strata.engine.engine import Engine
from strata.stages.link_client import LinkClient, WorkerRefused
from tests.daemon import ROOT, Daemon, env_for_daemon
from tests.helpers import ask, default_fingerprint

N_CTX = 1024


def run(engine, rendered, n: int = 12):
    """At most n tokens, stopping at an end of generation -> (token ids, FinalEvent)."""
    return ask(engine, rendered, n, ignore_eos=False)

_HEAD = struct.Struct("<4sHHHHQQ")


class Proxy:
    """A TCP proxy that parses the link's frames both ways (the handshake's plain frames, then `tag` more bytes a
    frame) and applies armed attacks to the next sealed frame of a type in one direction ('w2m' or 'm2w')."""

    def __init__(self, upstream: tuple[str, int], tag: int = link.TAG_SIZE):
        self.upstream, self.tag = upstream, tag
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(8)
        self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.armed: list = []             # [direction, MsgType, kind]
        self.done: list = []              # (direction, kind) applied
        self.frames: list[dict] = []      # per connection: direction -> [sealed frames (bytes)]
        self.lock = threading.Lock()
        self.captured = {"m2w": bytearray(), "w2m": bytearray()}
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, direction: str, mtype, kind: str) -> None:
        with self.lock:
            self.armed.append([direction, mtype, kind])

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            u = socket.create_connection(self.upstream)
            for s in (c, u):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = {"m2w": [], "w2m": []}
            with self.lock:
                self.frames.append(conn)
                index = len(self.frames) - 1
            threading.Thread(target=self._pump, args=(c, u, "m2w", 1, conn, index), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, "w2m", 2, conn, index), daemon=True).start()

    @staticmethod
    def _read(s, n) -> bytes:
        b = b""
        while len(b) < n:
            k = s.recv(n - len(b))
            if not k:
                raise ConnectionError
            b += k
        return b

    def _pump(self, src, dst, direction, plain_first, conn, index):
        n = 0
        try:
            while True:
                head = self._read(src, 32)
                _, _, mtype, _, _, _, plen = _HEAD.unpack_from(head)
                sealed = n >= plain_first
                frame = head + self._read(src, plen + 4 + (self.tag if sealed else 0))
                n += 1
                self.captured[direction] += frame
                if not sealed:
                    dst.sendall(frame)
                    continue
                conn[direction].append(frame)
                out = self._attack(direction, mtype, frame, conn, index)
                for f in out:
                    dst.sendall(f)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _attack(self, direction, mtype, frame, conn, index) -> list:
        with self.lock:
            hit = next((a for a in self.armed if a[0] == direction and a[1] == mtype), None)
            if hit is None:
                return [frame]
            self.armed.remove(hit)
            self.done.append((direction, hit[2]))
        kind = hit[2]
        b = bytearray(frame)
        if kind == "header":                      # the request id, with the header checksum made good again
            b[12] ^= 0x01
            b[28:32] = struct.pack("<I", zlib.crc32(bytes(b[:28])))
            return [bytes(b)]
        if kind == "payload":                     # a payload byte, with its checksum made good (mac mode)
            end = len(b) - self.tag - 4
            b[end - 1] ^= 0x40
            b[end:end + 4] = struct.pack("<I", zlib.crc32(bytes(b[32:end])))
            return [bytes(b)]
        if kind == "replay":                      # the previous frame of this direction again, then this one
            prev = conn[direction][-2]
            return [prev, frame]
        if kind == "drop":
            return []
        if kind == "foreign":                     # the frame at the same place of an earlier connection
            with self.lock:
                earlier = [c[direction] for c in self.frames[:index]]
            at = len(conn[direction]) - 1
            same = [fs[at] for fs in earlier if len(fs) > at and fs[at][6:8] == frame[6:8]]
            assert same, "no earlier connection has a frame at this place"
            return [same[-1]]
        raise ValueError(kind)

    def close(self):
        self.closed = True
        self.srv.close()


def _chat(d: Daemon, text: str = "Name three primes.", n: int = 6):
    return d.json("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                    "max_tokens": n, "temperature": 0})


def _healthy(d: Daemon, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.request("GET", "/health")[0] == 200:
            return
        time.sleep(0.1)
    raise AssertionError("the daemon did not reconnect:\n" + d.log_tail())


def _worker_refused(line: str) -> bool:
    """A worker's log line saying it refused the main's frame (its event, not a traceback)."""
    import json
    try:
        ev = json.loads(line)
    except ValueError:
        return False
    return ev.get("event") == "bad frame from the main" and "failed authentication" in ev.get("error", "")


def test_attacked_frames_are_refused_and_the_daemon_answers_503_then_recovers(workers, tmp_path):
    key = tmp_path / "link.key"
    link.write_key_file(key)
    w = workers("--link-key-file", str(key))
    proxy = Proxy(("127.0.0.1", w.port))
    d = Daemon(tmp_path, "--remote-stage", proxy.address, "--layer-split", "10", "--link-key-file", str(key),
               n_ctx=N_CTX).start()
    try:
        st, body = _chat(d)
        assert st == 200, body
        want = body["choices"][0]["message"]["content"]
        st, status = d.json("GET", "/status")
        stage = status["engine"]["stages"][-1] if "engine" in status else status["stages"][-1]
        assert stage["link"]["frames"] == "mac"
        attacks = [("w2m", link.MsgType.RESULT, k) for k in ("header", "payload", "replay", "drop", "foreign")]
        attacks += [("m2w", link.MsgType.FORWARD, k) for k in ("header", "payload", "replay", "drop", "foreign")]
        for direction, mtype, kind in attacks:
            refused_before = sum(_worker_refused(line) for line in w.lines)
            proxy.arm(direction, mtype, kind)
            st, body = _chat(d)
            assert st == 503, (direction, kind, st, body)
            assert body["error"]["code"] == "worker_unavailable", (direction, kind, body)
            assert (direction, kind) in proxy.done
            if direction == "w2m":              # the main refused the worker's frame
                downs = [ln.get("error", "") for ln in d.log_lines() if ln.get("event") == "stage link down"]
                assert "failed authentication" in downs[-1], (direction, kind, downs[-1])
            else:                               # the worker refused the main's, and closed the link
                deadline = time.monotonic() + 5
                while sum(_worker_refused(line) for line in w.lines) == refused_before:
                    assert time.monotonic() < deadline, (direction, kind, w.lines[-5:])
                    time.sleep(0.05)
            _healthy(d)
            st, body = _chat(d)                                  # reconnected: the same answer
            assert st == 200 and body["choices"][0]["message"]["content"] == want, (direction, kind, body)
        assert not [ln for ln in w.lines if "Traceback" in ln], w.lines[-20:]
    finally:
        d.stop()
        proxy.close()


def test_encrypted_link_gives_the_same_greedy_answer(workers, tmp_path):
    key = tmp_path / "link.key"
    link.write_key_file(key)
    ref = Engine("default", n_ctx=N_CTX)
    r = ref.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    want, _ = run(ref, r, 10)
    w = workers("--link-key-file", str(key))
    got = {}
    for encrypt in (False, True):
        proxy = Proxy(("127.0.0.1", w.port))
        e = Engine("default", n_ctx=N_CTX, remote_stage=proxy.address, layer_split="10", link_key_file=str(key),
                   link_encrypt=encrypt)
        try:
            got[encrypt] = run(e, r, 10)[0]
            assert e.stages[-1].status()["link"]["frames"] == ("aead" if encrypt else "mac")
        finally:
            e.close()
            proxy.close()
        # the prompt's token ids travel in the first Forward: in the clear with a MAC, not when encrypted
        ids = np.asarray(r.tokens[:16], dtype="<i4").tobytes()
        assert (ids in bytes(proxy.captured["m2w"])) == (not encrypt)
        time.sleep(0.3)
    assert got[False] == got[True] == want
    # a worker that requires encryption makes a main without --link-encrypt encrypt too
    we = workers("--link-key-file", str(key), "--link-encrypt")
    e = Engine("default", n_ctx=N_CTX, remote_stage=we.address, layer_split="10", link_key_file=str(key))
    try:
        assert e.stages[-1].status()["link"]["frames"] == "aead"
        assert run(e, r, 10)[0] == want
    finally:
        e.close()


# ---- peers that speak protocol 5's plain frames (no capabilities, HELLO_LABEL / ACK_LABEL) ---------------------
class PlainWorker:
    """A keyed worker as a strata without frame protection is: a Challenge without capabilities, the Hello checked
    under HELLO_LABEL, the HelloAck under ACK_LABEL, plain frames after; it computes with the worker's own Carrier."""

    def __init__(self, key: bytes):
        from strata.stages.worker import Worker, WorkerConfig
        self.key = key
        self.worker = Worker(WorkerConfig(host="127.0.0.1", port=0, key=key))
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(2)
        self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.refusals: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            with c:
                c.settimeout(30)
                try:
                    self._one(c)
                except (OSError, link.LinkError):
                    pass

    def _one(self, c):
        nonce = link.new_nonce()
        link.send_frame(c, link.Challenge(nonce=nonce, keyed=True, worker="old-worker"), 0)
        hdr, hello = link.recv_frame(c)
        if not link.verify(link.hello_mac(self.key, nonce, hello), hello.mac):     # HELLO_LABEL only
            self.refusals.append("hello mac")
            link.send_frame(c, link.Error(code=link.ErrorCode.AUTH, message="the main's link key does not match"),
                            hdr.request_id)
            return
        carrier, ack = self.worker.setup(hello)
        ack.mac = link.ack_mac(self.key, hello.nonce, ack)
        link.send_frame(c, ack, hdr.request_id)
        try:
            while True:
                hdr, msg = link.recv_frame(c)
                if isinstance(msg, link.Ping):
                    link.send_frame(c, link.Pong(nonce=msg.nonce), hdr.request_id)
                    continue
                link.send_frame(c, carrier.handle(msg), hdr.request_id)
        except ConnectionError:
            pass
        finally:
            carrier.close()

    def close(self):
        self.srv.close()


def test_insecure_link_talks_to_a_plain_worker_and_is_refused_without_it(tmp_path):
    key_path = tmp_path / "link.key"
    key = link.write_key_file(key_path)
    ref = Engine("default", n_ctx=N_CTX)
    r = ref.render_chat([{"role": "user", "content": "Hi"}])
    want, _ = run(ref, r, 6)
    old = PlainWorker(key)
    try:
        with pytest.raises(WorkerRefused, match="does not authenticate frames after the hello .*--insecure-link") as ei:
            Engine("default", n_ctx=N_CTX, remote_stage=old.address, layer_split="10", link_key_file=str(key_path))
        assert "\n" not in str(ei.value) and old.address in str(ei.value)
        with pytest.raises(WorkerRefused, match="cannot encrypt"):
            Engine("default", n_ctx=N_CTX, remote_stage=old.address, layer_split="10", link_key_file=str(key_path),
                   link_encrypt=True)
        e = Engine("default", n_ctx=N_CTX, remote_stage=old.address, layer_split="10", link_key_file=str(key_path),
                   insecure_link=True)
        try:
            assert e.stages[-1].status()["link"]["frames"] == "plain"
            assert run(e, r, 6)[0] == want
        finally:
            e.close()
    finally:
        old.close()


def _plain_main_hello(key: bytes, address: str, label_frames: str = link.FRAMES_PLAIN):
    """Connect as a main without frame protection: -> (socket, Challenge, HelloAck or Error)."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    _, ch = link.recv_frame(s)
    hello = link.Hello(protocol=5, fingerprint=default_fingerprint(), lo=10, hi=30, n_blocks=30, n_embd=576,
                       act_dtype="f32", n_ctx=256, max_batch=16, ckpt_max=0, next_hops=[], nonce=link.new_nonce())
    hello.mac = link.hello_mac(key, ch.nonce, hello, label_frames)
    link.send_frame(s, hello, 1)
    _, reply = link.recv_frame(s)
    return s, ch, hello, reply


def test_a_plain_main_is_refused_unless_the_worker_has_insecure_link(workers, tmp_path):
    key_path = tmp_path / "link.key"
    key = link.write_key_file(key_path)
    w = workers("--link-key-file", str(key_path))
    s, ch, _, reply = _plain_main_hello(key, w.address)
    s.close()
    assert link.split_challenge_name(ch.worker)[1] == {link.CAP_MAC, link.CAP_AEAD, link.CAP_SPEC, link.CAP_PARK,
                                                       link.CAP_DROPS, link.CAP_SLOTS, link.CAP_ROWIDS}
    assert isinstance(reply, link.Error) and reply.code == link.ErrorCode.AUTH
    assert "does not authenticate frames" in reply.message and "--insecure-link" in reply.message
    time.sleep(0.3)
    wi = workers("--link-key-file", str(key_path), "--insecure-link")
    s, ch, hello, ack = _plain_main_hello(key, wi.address)
    with s:
        assert isinstance(ack, link.HelloAck) and link.verify(link.ack_mac(key, hello.nonce, ack), ack.mac)
        x = np.zeros((2, 576), np.float32)
        x[:, 0] = 1.0
        link.send_frame(s, link.Forward(pos=0, want_all=True, tokens=np.array([1, 2], np.int32), hidden=x), 2)
        _, res = link.recv_frame(s)                          # plain frames both ways
        assert isinstance(res, link.Result) and res.hidden.shape == (2, 576) and np.isfinite(res.hidden).all()
    # a worker that requires encryption refuses a main that only authenticates
    time.sleep(0.3)
    we = workers("--link-key-file", str(key_path), "--link-encrypt")
    s, ch, _, reply = _plain_main_hello(key, we.address, link.FRAMES_MAC)
    s.close()
    assert link.CAP_ENCRYPT in link.split_challenge_name(ch.worker)[1]
    assert isinstance(reply, link.Error) and "requires an encrypted link" in reply.message


def test_flag_usage_errors():
    import subprocess
    import sys
    env = env_for_daemon()
    for args, want in ((["worker", "--link-encrypt"], "--link-encrypt needs --link-key-file"),
                       (["worker", "--link-encrypt", "--insecure-link", "--link-key-file", "/nonexistent"],
                        "contradict"),
                       (["generate", "--remote-stage", "127.0.0.1:1", "--link-encrypt", "-p", "x"],
                        "--link-encrypt needs --link-key-file"),
                       (["serve", "--require-row-ids", "--parallel", "2", "--socket", str(ROOT / "never.sock")],
                        "--require-row-ids needs --remote-stage")):
        r = subprocess.run([sys.executable, "-m", "strata.cli.main", *args], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and want in r.stderr, (args, r.returncode, r.stderr[-500:])
    with pytest.raises(ValueError, match="--link-encrypt needs --link-key-file"):
        Engine("default", n_ctx=N_CTX, remote_stage="127.0.0.1:1", link_encrypt=True)
    with pytest.raises(ValueError, match="needs the link key"):
        LinkClient("127.0.0.1:1", None, encrypt=True)


def test_a_keyed_relay_chain_protects_both_hops(workers, tmp_path):
    """main -> A -> B with one key: both hops authenticated, and with --link-encrypt on the main both encrypted
    (the relay encrypts its next hop when its own link is); the answer is one process's."""
    import json
    key = tmp_path / "link.key"
    link.write_key_file(key)
    ref = Engine("default", n_ctx=N_CTX)
    r = ref.render_chat([{"role": "user", "content": "Name a colour."}])
    want, _ = run(ref, r, 6)
    b = workers("--link-key-file", str(key))
    a = workers("--link-key-file", str(key))
    for encrypt, frames in ((False, "mac"), (True, "aead")):
        e = Engine("default", n_ctx=N_CTX, remote_stage=f"{a.address},{b.address}", layer_split="8,19",
                   link_key_file=str(key), link_encrypt=encrypt)
        try:
            assert e.stages[-1].status()["link"]["frames"] == frames
            assert run(e, r, 6)[0] == want
        finally:
            e.close()
        connected = [json.loads(ln) for ln in b.lines if '"main connected"' in ln]
        assert connected and connected[-1]["frames"] == frames, connected[-1:]
        time.sleep(0.5)


# ---- the strata of before frame protection, from this repository's history --------------------------------------
def _old_tree(tmp_path):
    """This repository at the parent of the commit that added link/secure.py, extracted with the C core beside it;
    None (skip) outside a full git checkout."""
    import shutil
    import subprocess
    try:
        added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "link/secure.py"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()
        if not added:
            return None
        old = tmp_path / "old"
        old.mkdir()
        archive = subprocess.run(["git", "archive", f"{added[-1]}^"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    shutil.copy(ROOT / "strata" / "_native.abi3.so", old / "strata" / "_native.abi3.so")
    return old


def test_insecure_link_with_a_strata_from_before_frame_protection(workers, tmp_path):
    """The real older code both ways: its worker with a new main, its main with a new worker; refused with one
    line without --insecure-link, the one-process answer with it."""
    import subprocess
    import sys
    old = _old_tree(tmp_path)
    if old is None:
        pytest.skip("not a git checkout with the history of link/secure.py")
    assert not (old / "link" / "secure.py").exists()
    key_path = tmp_path / "link.key"
    link.write_key_file(key_path)
    ref = Engine("default", n_ctx=N_CTX)
    r = ref.render_chat([{"role": "user", "content": "Hi"}])
    want, _ = run(ref, r, 6)
    in_old = lambda c: ["sh", "-c", f'cd "{old}" && exec "$@"', "sh", *c]          # noqa: E731
    w_old = workers("--link-key-file", str(key_path), wrap=in_old, env={"PYTHONPATH": str(old)})
    with pytest.raises(WorkerRefused, match="does not authenticate frames after the hello") as ei:
        Engine("default", n_ctx=N_CTX, remote_stage=w_old.address, layer_split="10", link_key_file=str(key_path))
    assert "\n" not in str(ei.value)
    e = Engine("default", n_ctx=N_CTX, remote_stage=w_old.address, layer_split="10", link_key_file=str(key_path),
               insecure_link=True)
    try:
        assert e.stages[-1].status()["link"]["frames"] == "plain"
        assert run(e, r, 6)[0] == want
    finally:
        e.close()
    code = ("import sys, threading\n"
            "from strata.engine.engine import Engine\n"
            "from strata.engine.types import GenerationRequest\n"
            "try:\n"
            f"    e = Engine('default', n_ctx={N_CTX}, remote_stage=sys.argv[1], layer_split='10', "
            "link_key_file=sys.argv[2])\n"
            "except Exception as x:\n"
            "    print('REFUSED', str(x)); sys.exit(0)\n"
            f"req = GenerationRequest(prompt_tokens={list(r.tokens)!r}, cut_points=[], max_tokens=6, "
            "cancel=threading.Event())\n"
            "print('TOKENS', [ev.token_id for ev in e.generate(req) if not hasattr(ev, 'finish_reason')])\n"
            "e.close()\n")
    for args, expect in ((("--link-key-file", str(key_path)), "REFUSED"),
                         (("--link-key-file", str(key_path), "--insecure-link"), "TOKENS")):
        w_new = workers(*args)
        out = subprocess.run([sys.executable, "-c", code, w_new.address, str(key_path)], cwd=old,
                             env=env_for_daemon({"PYTHONPATH": str(old)}), capture_output=True, text=True,
                             timeout=300)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith(("REFUSED", "TOKENS"))]
        assert line and line[-1].startswith(expect), (out.stdout[-800:], out.stderr[-1500:])
        if expect == "REFUSED":
            assert "does not authenticate frames" in line[-1] and "--insecure-link" in line[-1]
        else:
            assert line[-1] == f"TOKENS {want}"
        w_new.stop()
        time.sleep(0.3)


def _refusing_peer(message: str, at: str) -> str:
    """A listener that answers the main with an Error carrying `message`: in place of the Challenge (at='challenge')
    or after it, in reply to the Hello (at='hello'), as a MODEL refusal."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve():
        c, _ = srv.accept()
        try:
            if at == "hello":
                link.send_frame(c, link.Challenge(nonce=bytes(32), keyed=False, worker="w"), 0)
                link.recv_frame(c, 1 << 16)
            link.send_frame(c, link.Error(code=link.ErrorCode.MODEL, message=message), 1 if at == "hello" else 0)
        finally:
            c.close()
            srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("at", ["challenge", "hello"])
@pytest.mark.parametrize("message", [
    "\x1b[31mRED\x1b[0m\r\nstrata: fake line \u202etxt.exe",
    # a model refusal whose file name holds a terminal title sequence: not read as a summary, quoted as text
    "this worker has another model: a\x1b]0;owned\x07.gguf, 1 bytes, llama, 2 blocks of width 8, F32, fingerprint ab",
    "\x00" * 4000])
def test_a_peers_refusal_text_reaches_the_user_with_its_control_characters_escaped(at, message):
    """A worker's (or an impostor's) Error text is quoted in the one-line refusal the main prints, logs and serves on
    /health: escape sequences, line breaks and bidirectional controls written as \\uXXXX (they reached the terminal
    raw), its first 500 characters only (the codec bounds it at 4,096 bytes)."""
    from strata.gguf.identity import ModelSummary
    hello = link.Hello(protocol=link.VERSION, fingerprint="ab" * 32, lo=1, hi=2, n_blocks=2, n_embd=8,
                       act_dtype="f32", n_ctx=64, max_batch=8, ckpt_max=0, next_hops=[], nonce=b"")
    me = ModelSummary("m.gguf", 10, "llama", 2, 8, "F32", "ab" * 8)
    addr = _refusing_peer(message, at)
    with pytest.raises(WorkerRefused) as ei:
        LinkClient(addr, model=me, connect_timeout=10).connect(hello)
    text = str(ei.value)
    assert addr in text and "refused the" in text, text
    assert text.isprintable() and ("\\u001b" in text or "\\u0000" in text), text
    assert len(text) < 6 * 500 + 200, len(text)      # the first 500 characters of the peer's text


def test_a_mains_hello_fields_reach_the_workers_refusal_escaped(workers):
    """A main's (or an impostor's) Hello whose strings hold escape sequences, CR/LF, bidirectional controls, NUL and
    C1: the worker's one-line refusal (the Error it answers, the line it logs) quotes them escaped and cut, the other
    direction of the main's quoting of a worker's text. The fingerprint and act_dtype were quoted raw (act_dtype by
    repr, whole), and a next hop's host IDNA cannot encode killed the connection's task with a traceback instead
    of a refusal. The worker serves a good main afterwards."""
    evil = "\x1b[31mRED\x1b[0m\r\nstrata: fake line \u202etxt.exe\x00\x9b"
    w = workers()
    host, port = w.address.rsplit(":", 1)

    def hello(**kw):
        h = dict(protocol=link.VERSION, fingerprint=default_fingerprint(), lo=10, hi=30, n_blocks=30, n_embd=576,
                 act_dtype="f32", n_ctx=256, max_batch=16, ckpt_max=0, next_hops=[], nonce=link.new_nonce())
        return link.Hello(**{**h, **kw})

    def reply_to(h):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            link.recv_frame(s)
            link.send_frame(s, h, 1)
            return link.recv_frame(s)[1]

    model, hop = link.ErrorCode.MODEL, link.ErrorCode.NEXT_HOP
    for h, code in [(hello(fingerprint=evil), model), (hello(act_dtype=evil * 90), model),
                    (hello(hi=20, next_hops=[link.Hop(evil, 1, 20, 30)]), hop),
                    (hello(hi=20, next_hops=[link.Hop("a:b" + evil * 90, 1, 20, 30)]), hop)]:
        r = reply_to(h)
        assert isinstance(r, link.Error) and r.code == code, r
        assert r.message.isprintable() and "\\u001b[31mRED" in r.message and len(r.message) < 1500, r.message
    ack = reply_to(hello())
    assert isinstance(ack, link.HelloAck), ack
    time.sleep(0.2)
    assert not any("Traceback" in line or "Unhandled" in line for line in w.lines), w.lines[-5:]
    refused = [json.loads(line)["error"] for line in w.lines if "refused a main at the hello" in line]
    assert len(refused) == 4 and all(t.isprintable() and "\\u001b" in t for t in refused), refused
