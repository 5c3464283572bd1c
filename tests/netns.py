"""Test support (no tests here): hosts made of Linux network namespaces joined by veth pairs, with tc netem delay
and loss on the links (root and iproute2 needed; `available()` says why not otherwise)."""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when namespaces can be made here, else the reason (for a skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    name = "strata-probe-" + uuid.uuid4().hex[:6]
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class Hosts:
    """Namespaces ``hosts`` (names) and links between them: link(a, b, subnet) gives a .1 and b .2 of a /30 in
    10.<subnet>.0.0 (addresses that exist only inside these namespaces), optionally with netem delay / loss on
    both ends (where the kernel has sch_netem; else ``netem_error`` says why and the links have none). Everything is
    removed by close()."""

    def __init__(self, *hosts: str):
        tag = uuid.uuid4().hex[:5]
        self.ns = {h: f"st{tag}-{h}" for h in hosts}
        self.addr: dict[tuple[str, str], str] = {}
        self.netem_error: str | None = None   # why netem delay / loss could not be set (then links have none)
        for n in self.ns.values():
            _ip("netns", "add", n)
            _ip("-n", n, "link", "set", "lo", "up")
        self._links = 0

    def link(self, a: str, b: str, subnet: int, delay_ms: float = 0.0, loss_pct: float = 0.0) -> tuple[str, str]:
        """Join hosts a and b -> (a's address, b's address)."""
        self._links += 1
        va, vb = f"v{self._links}a{os.getpid() % 1000}", f"v{self._links}b{os.getpid() % 1000}"
        _ip("link", "add", va, "netns", self.ns[a], "type", "veth", "peer", "name", vb, "netns", self.ns[b])
        ips = (f"10.{subnet}.0.1", f"10.{subnet}.0.2")
        for host, dev, ip in ((a, va, ips[0]), (b, vb, ips[1])):
            _ip("-n", self.ns[host], "addr", "add", f"{ip}/30", "dev", dev)
            _ip("-n", self.ns[host], "link", "set", dev, "up")
            if delay_ms or loss_pct:
                netem = ["tc", "-n", self.ns[host], "qdisc", "add", "dev", dev, "root", "netem"]
                if delay_ms:
                    netem += ["delay", f"{delay_ms}ms"]
                if loss_pct:
                    netem += ["loss", f"{loss_pct}%"]
                r = subprocess.run(netem, capture_output=True, text=True)
                if r.returncode != 0:        # a kernel without sch_netem: the link stays, without delay or loss
                    self.netem_error = r.stderr.strip() or f"tc exited {r.returncode}"
        self.addr[(a, b)], self.addr[(b, a)] = ips[1], ips[0]     # how a reaches b, how b reaches a
        return ips

    def cmd(self, host: str, argv: list[str]) -> list[str]:
        """argv run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def close(self) -> None:
        for n in self.ns.values():
            _ip("netns", "del", n, check=False)
