"""sd_notify: tell systemd (Type=notify) READY=1 / STOPPING=1 / STATUS=... over $NOTIFY_SOCKET, no dependency; and the
watchdog: WATCHDOG=1 every half of $WATCHDOG_USEC (the unit's WatchdogSec=) while the process counts as healthy.

Protocol: one datagram per message on the AF_UNIX socket named by $NOTIFY_SOCKET; a leading "@" means
the Linux abstract namespace (sd_notify(3)). The watchdog's variables are sd_watchdog_enabled(3)'s.
"""
from __future__ import annotations

import asyncio
import os
import socket
from typing import Callable

import structlog

log = structlog.get_logger("strata.serve")


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


def watchdog_interval(env: dict[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises; None when systemd
    asks for none (unset, not a positive integer, or $WATCHDOG_PID names another process)."""
    env = env if env is not None else os.environ
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None


async def watchdog(interval: float, stuck: Callable[[], str | None] = lambda: None,
                   env: dict[str, str] | None = None) -> None:
    """Send WATCHDOG=1 every `interval` seconds from the event loop while stuck() gives None. While it gives a reason,
    send none (systemd then stops the service WatchdogSec= after the last ping, and Restart= starts it again), and
    say why once in STATUS= and the log. Runs until cancelled."""
    was = None
    while True:
        why = stuck()
        if why is None:
            sd_notify("WATCHDOG=1" + ("\nSTATUS=serving" if was is not None else ""), env)
            if was is not None:
                log.info("watchdog pings resumed")
        elif was is None:
            log.warning("watchdog pings stopped", reason=why)
            sd_notify(f"STATUS={why}", env)
        was = why
        await asyncio.sleep(interval)
