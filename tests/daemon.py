"""Test support: the real `strata serve` daemon in a subprocess, talked to over HTTP on its Unix socket, and a
`strata worker` process on loopback."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from strata.cli import ctl

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UnixHTTPConnection(ctl.UnixHTTPConnection):
    """stratactl's connection to the daemon's Unix socket, with a test's default timeout."""

    def __init__(self, path: str, timeout: float = 120.0):
        super().__init__(path, timeout)


def env_for_daemon(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("NOTIFY_SOCKET", None)
    env.pop("STRATA_API_KEY", None)
    env.update(extra or {})
    return env


class Daemon:
    """`python -m strata.cli.main serve` on a temporary socket; stderr goes to self.log_path (JSON lines)."""

    def __init__(self, tmp: Path, *args: str, port: int | None = None, env: dict | None = None, n_ctx: int = 512):
        self.sock = str(tmp / "strata.sock")
        self.port = port
        self.log_path = tmp / "daemon.log"
        self.cmd = [sys.executable, "-m", "strata.cli.main", "serve", "--socket", self.sock, "--n-ctx", str(n_ctx),
                    "--threads", "2", "--log-level", "debug", *args]
        if port is not None:
            self.cmd += ["--port", str(port)]
        self.env = env_for_daemon(env)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> "Daemon":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self._log, env=self.env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"strata serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                st, _, _ = self.request("GET", "/health", timeout=2)
                if st == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"strata serve did not become healthy in {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]

    def request(self, method: str, path: str, body=None, *, raw: bytes | None = None, headers: dict | None = None,
                timeout: float = 120.0):
        """-> (status, headers dict (lower-case names), body bytes) over the Unix socket."""
        c = UnixHTTPConnection(self.sock, timeout)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            h = {"Content-Type": "application/json"} if data is not None else {}
            h.update(headers or {})
            c.request(method, path, body=data, headers=h)
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def json(self, method: str, path: str, body=None, **kw):
        st, h, b = self.request(method, path, body, **kw)
        return st, json.loads(b)

    def metric(self, name: str, labels: dict | None = None) -> float:
        from prometheus_client.parser import text_string_to_metric_families
        _, _, b = self.request("GET", "/metrics")
        total = 0.0
        for fam in text_string_to_metric_families(b.decode()):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                    total += s.value
        return total

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class WorkerProc:
    """`python -m strata.cli.main worker` on 127.0.0.1 (port 0: a free one); stderr collected in `lines`."""

    def __init__(self, *args: str, port: int = 0, env: dict | None = None, host: str = "127.0.0.1",
                 wrap=None):
        self.cmd = [sys.executable, "-m", "strata.cli.main", "worker", "--listen", f"{host}:{port}",
                    "--threads", "1", "--log-format", "json", *args]
        self.cmd = wrap(self.cmd) if wrap else self.cmd
        self.host = host
        self.env = env_for_daemon(env)
        self.lines: list[str] = []
        self.port = port
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> "WorkerProc":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=self.env, cwd=ROOT)
        ready = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                if line.startswith("strata worker listening on"):
                    self.port = int(line.strip().rpartition(":")[2])
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError("strata worker did not start:\n" + "\n".join(self.lines[-20:]))
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class NotifyListener:
    """A $NOTIFY_SOCKET as systemd has it (sd_notify(3)): the datagrams a daemon sends, collected by a thread with the
    monotonic time each arrived."""

    def __init__(self, path: str):
        self.path = path
        self.got: list[tuple[float, str]] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                self.got.append((time.monotonic(), self._sock.recv(4096).decode()))
            except socket.timeout:
                continue
            except OSError:
                return

    def times(self, message: str, since: float = 0.0) -> list[float]:
        """When each datagram with a line starting with `message` (such as "WATCHDOG=1") arrived, at or after
        `since`."""
        return [t for t, m in list(self.got) if t >= since and any(ln.startswith(message) for ln in m.split("\n"))]

    def wait_for(self, message: str, since: float = 0.0, timeout: float = 30.0) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ts := self.times(message, since):
                return ts[0]
            time.sleep(0.02)
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


class InProcessWorker:
    """A `strata worker` (strata.stages.worker.Worker) served from a thread of this process, to reach its store;
    caps: the capabilities it announces (None: its own)."""

    def __init__(self, caps=None, **kw):
        from strata.stages.worker import Worker, WorkerConfig
        self.worker = Worker(WorkerConfig(host="127.0.0.1", port=0, **kw))
        if caps is not None:
            self.worker.caps = lambda: list(caps)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def main():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.worker.start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        started.wait(60)
        self.address = f"127.0.0.1:{self.worker.port}"

    def close(self):
        """Stop serving: the listening socket closed, every connection's tasks cancelled and finished, the loop
        stopped."""
        async def stop():
            self.worker.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
