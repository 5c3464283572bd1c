"""sd_notify: tell systemd (Type=notify) READY=1 / STOPPING=1 / STATUS=... over $NOTIFY_SOCKET, no dependency.

Protocol: one datagram per message on the AF_UNIX socket named by $NOTIFY_SOCKET; a leading "@" means
the Linux abstract namespace (sd_notify(3)).
"""
from __future__ import annotations

import os
import socket


def sd_notify(message: str, env: dict[str, str] | None = None) -> bool:
    """Send `message` (e.g. "READY=1\\nSTATUS=serving") to $NOTIFY_SOCKET; False when unset or unreachable."""
    path = (env if env is not None else os.environ).get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(path)
            s.sendall(message.encode())
        return True
    except OSError:
        return False
