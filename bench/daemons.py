"""Server processes a bench starts (strata serve, llama-server): a free port for one, waiting until it answers
/health, stopping it."""
from __future__ import annotations

import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, base: str, cmd: list, what: str, close=None, timeout: float = 600.0,
                 poll: float = 0.5) -> None:
    """Wait until the server `proc` (a subprocess.Popen started with `cmd`) answers GET base/health with 200.
    RuntimeError naming `what` when it exits first, or after `timeout` seconds (close() called first then)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {' '.join(map(str, cmd))}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            if close is not None:
                close()
            raise RuntimeError(f"{what} did not become healthy in {timeout:.0f} s")
        time.sleep(poll)


def stop(proc, timeout: float = 60.0) -> None:
    """Terminate the server `proc` and wait for it; killed when it has not exited after `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
