"""Where the daemon's Unix socket lives by default, shared by `strata serve` and `stratactl`."""
from __future__ import annotations

import os
from pathlib import Path

SOCKET_NAME = "strata.sock"


def default_socket_path(env: dict[str, str] | None = None) -> Path:
    """The socket `strata serve` binds by default.

    Under systemd (RuntimeDirectory=strata sets $RUNTIME_DIRECTORY=/run/strata): $RUNTIME_DIRECTORY/strata.sock;
    else $XDG_RUNTIME_DIR/strata/strata.sock; else /run/strata/strata.sock.
    """
    env = os.environ if env is None else env
    if env.get("STRATA_SOCKET"):
        return Path(env["STRATA_SOCKET"])
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / SOCKET_NAME
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "strata" / SOCKET_NAME
    return Path("/run/strata") / SOCKET_NAME


def client_socket_path(env: dict[str, str] | None = None) -> Path:
    """The socket `stratactl` tries: $STRATA_SOCKET, else the user's own daemon, else the system service's."""
    env = os.environ if env is None else env
    if env.get("STRATA_SOCKET"):
        return Path(env["STRATA_SOCKET"])
    candidates = []
    if env.get("XDG_RUNTIME_DIR"):
        candidates.append(Path(env["XDG_RUNTIME_DIR"]) / "strata" / SOCKET_NAME)
    candidates.append(Path("/run/strata") / SOCKET_NAME)
    for c in candidates:
        if c.exists():
            return c
    return candidates[0]
