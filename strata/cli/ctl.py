"""`stratactl`: the admin command line of a running daemon, over its Unix socket (or --url).

Exit codes: 0 ok, 1 the server answered with an error (or with something that is not a usable answer), 2 usage,
3 cannot connect, or no complete answer within --timeout (the message names the socket path or URL).
Text from the server reaches the terminal with its control characters escaped.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import stat
import sys
import threading
import time
import urllib.parse
from typing import Any

from strata.cli.argv import Parser, parse_args
from strata.cli.chat_input import parse_chat_line
from strata.errors import printable
from strata.serve.paths import client_socket_path

EXIT_OK, EXIT_SERVER, EXIT_USAGE, EXIT_CONNECT = 0, 1, 2, 3


class CtlError(Exception):
    """A one-line error and the exit status; payload: the server's error body, when it answered one."""

    def __init__(self, message: str, code: int, payload: bytes | None = None):
        super().__init__(message)
        self.code, self.payload = code, payload


def loads(payload: bytes | str):
    """json.loads; ValueError also for JSON nested past the parser's depth (RecursionError)."""
    try:
        return json.loads(payload)
    except RecursionError:
        raise ValueError("nested too deeply") from None


class _Deadline:
    """One exchange's overall limit: `seconds` after start the connection's socket is shut down, so a silent or
    dripping server cannot hold stratactl past --timeout (a socket timeout bounds each read only)."""

    def __init__(self, seconds: float):
        self.seconds, self.expired = seconds, False
        self._timer: threading.Timer | None = None

    def watch(self, sock) -> None:
        def fire():
            self.expired = True
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._timer = threading.Timer(self.seconds, fire)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the Unix socket at `path` (the daemon's; bench/ and tests/ use it too)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.unix_path)
        except OSError:
            s.close()
            raise
        self.sock = s


class Client:
    """One HTTP exchange per call, over the Unix socket or a TCP URL."""

    def __init__(self, socket_path: str | None, url: str | None, api_key: str | None, timeout: float):
        self.socket_path, self.url, self.api_key, self.timeout = socket_path, url, api_key, timeout
        if url:
            u = urllib.parse.urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise CtlError(f"--url must look like http://HOST:PORT, got {url!r}", EXIT_USAGE)
            self._u = u
        self.where = url if url else f"socket {socket_path}"
        self._deadline: _Deadline | None = None

    def timed_out(self, e: BaseException | None = None) -> CtlError | None:
        """The error of an exchange that ran past --timeout (its socket was shut down, or `e` is its socket's own
        timeout), or None."""
        if isinstance(e, TimeoutError) or self._deadline is not None and self._deadline.expired:
            return CtlError(f"no complete answer from {self.where} within --timeout {self.timeout:g} s", EXIT_CONNECT)
        return None

    def done(self) -> None:
        """The exchange is over: stop its deadline."""
        if self._deadline is not None:
            self._deadline.cancel()

    def _conn(self):
        if self.url:
            cls = http.client.HTTPSConnection if self._u.scheme == "https" else http.client.HTTPConnection
            return cls(self._u.hostname, self._u.port, timeout=self.timeout)
        return UnixHTTPConnection(self.socket_path, self.timeout)

    def request(self, method: str, path: str, body: Any = None):
        """-> (status, headers, response) with the response still open (read or stream it)."""
        if self.url and self._u.path.rstrip("/"):
            path = self._u.path.rstrip("/") + path
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn = self._conn()
        self.done()
        self._deadline = _Deadline(self.timeout)
        try:
            conn.connect()
            self._deadline.watch(conn.sock)
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            late = self.timed_out(e)
            if late is not None:
                raise late from None
            hint = " (is `strata serve` running?)" if isinstance(e, (FileNotFoundError, ConnectionRefusedError)) else ""
            try:
                mode = None if self.url else os.stat(self.socket_path).st_mode
            except OSError:                    # not there (any more): the hint above stands
                mode = None
            if mode is not None and not stat.S_ISSOCK(mode):
                kind = ("a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode)
                        else "a special file")
                hint = f" ({self.socket_path} is {kind}, not a socket: give --socket the path strata serve listens on)"
            elif mode is not None and isinstance(e, ConnectionRefusedError):
                hint = (" (the socket file is there but nothing listens on it: a daemon that exited left it; is "
                        "`strata serve` running, and on this socket? --socket or $STRATA_SOCKET names another)")
            raise CtlError(f"cannot connect to {self.where}: {e}{hint}", EXIT_CONNECT) from None
        return resp

    def check_reachable(self) -> None:
        """One GET /health: CtlError (exit 3) when nothing answers at the socket or URL; any HTTP answer will do."""
        resp = self.request("GET", "/health")
        try:
            resp.read()
        except (OSError, http.client.HTTPException):
            pass
        finally:
            resp.close()
            self.done()

    @contextlib.contextmanager
    def reading(self, resp):
        """Read `resp`'s body in the block, within the exchange's deadline: a lost connection or a passed deadline
        is one CtlError (exit 3); resp is closed after it."""
        try:
            yield
        except (OSError, http.client.HTTPException) as e:
            raise self.timed_out(e) or CtlError(f"lost the connection to {self.where}: {e}", EXIT_CONNECT) from None
        finally:
            resp.close()
            self.done()
        late = self.timed_out()
        if late is not None:
            raise late

    def read(self, resp) -> bytes:
        """The whole body of `resp`, within the exchange's deadline."""
        with self.reading(resp):
            payload = resp.read()
        return payload

    def call(self, method: str, path: str, body: Any = None, *, raw: bool = False):
        resp = self.request(method, path, body)
        payload = self.read(resp)
        if resp.status >= 400:
            raise CtlError(f"server error {resp.status}: {_error_message(payload)}", EXIT_SERVER, payload)
        if raw:
            return payload.decode("utf-8", "replace")
        try:
            return loads(payload)
        except ValueError:
            raise CtlError(f"the server answered {resp.status} with {_summary(payload)} that is not JSON",
                           EXIT_SERVER) from None


def _summary(payload: bytes) -> str:
    return f"{len(payload)} bytes" if payload else "an empty body"


def _error_message(payload: bytes) -> str:
    """The message of an error body, one line, its control characters escaped."""
    try:
        d = loads(payload)
        msg = d["error"]["message"] if isinstance(d.get("error"), dict) else json.dumps(d)
        if not isinstance(msg, str):
            msg = json.dumps(msg)
    except (ValueError, KeyError, TypeError, AttributeError):
        msg = payload.decode("utf-8", "replace").strip()
    return printable(msg[:500])


# ------------------------------------------------------------------------------------------------ output
def _human_bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _kv(pairs: list[tuple[str, Any]]) -> str:
    w = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(w)}  {'-' if v is None else v}" for k, v in pairs)


def _out(args, data, human: str) -> None:
    print(printable(json.dumps(data, indent=2, ensure_ascii=False) if args.json else human, keep="\n"))


# ------------------------------------------------------------------------------------------------ commands
def _device_line(dev: dict) -> str:
    """One line for /status's "device" object: name, then (CUDA) device memory used / total and CuPy's pool, then
    the weights and the KV page pool."""
    if not dev:
        return "-"
    parts = []
    if dev.get("device_total_bytes") is not None:
        parts.append(f"{_human_bytes(dev.get('device_used_bytes'))} / {_human_bytes(dev.get('device_total_bytes'))} "
                     f"used ({_human_bytes(dev.get('device_free_bytes'))} free), CuPy pool "
                     f"{_human_bytes(dev.get('pool_used_bytes'))} / {_human_bytes(dev.get('pool_total_bytes'))}")
    parts.append(f"weights {_human_bytes(dev.get('weights_bytes'))}")
    held = f"{_human_bytes(dev.get('kv_used_bytes'))} in pages used"
    if dev.get("kv_valid_bytes") is not None:
        held += f", {_human_bytes(dev.get('kv_valid_bytes'))} in valid positions"
    kv = f" {dev['kv']}" if dev.get("kv") else ""
    parts.append(f"KV pool{kv} {_human_bytes(dev.get('kv_pool_bytes'))} ({held})")
    if dev.get("moe"):
        parts.append(f"MoE layers: {dev['moe'].get('decode')} decode, {dev['moe'].get('prefill')} prefill")
    if dev.get("error"):
        parts.append(f"memory info failed: {dev['error']}")
    return f"{dev.get('name', '?')}: " + ", ".join(parts)


def _link_timing(lk: dict) -> str:
    """A remote stage's round trip in words: the median of the recent ones, then the last, measured from the last
    forward while requests flow (its wall time less the worker's compute), else by the idle link's ping, with the
    last forward's wall time."""
    rtt, src, fwd, comp = (lk.get(k) for k in ("rtt_ms", "rtt_from", "last_forward_ms", "last_forward_compute_ms"))
    if rtt is None:
        return "no round trip measured yet"
    med, n = lk.get("rtt_median_ms"), lk.get("rtt_samples") or 0
    head = f"round trip {med} ms (median of the last {n}), " if med is not None and n > 1 else "round trip "
    if src == "forward":
        return head + f"{rtt} ms from the last forward: {fwd} ms, {comp} ms of it the worker's compute"
    return head + f"{rtt} ms" + (" by ping" if src == "ping" else "") + \
        (f", the last forward {fwd} ms" if fwd is not None else "")


def cmd_status(c: Client, args) -> int:
    d = c.call("GET", "/status")
    e = d.get("engine", {})
    kv = e.get("kv_pages") or {}
    mem = e.get("memory") or {}
    q = d.get("queue", {})
    def _layers(r):
        # half-open, as /status gives them ([lo, hi]: layers lo .. hi - 1) and a carve is everywhere
        return f"layers [{r[0]}, {r[1]})" if isinstance(r, list) and len(r) == 2 else f"layers {r}"
    def _stage(s):
        m = s.get("memory") or {}
        kvm = m.get("kv") or {}
        extra = f", KV {kvm.get('pages_used')} / {kvm.get('pages_total')} pages" if kvm else ""
        if m.get("running"):
            extra += f", {m['running'].get('layers')} recurrent layers"
        if s.get("moe"):
            extra += f", MoE {s['moe'].get('decode')} decode / {s['moe'].get('prefill')} prefill"
            t = s["moe"].get("tier")
            if isinstance(t, dict):
                extra += f", expert tier: {_tier_line(t)}"
        lk = s.get("link")
        if lk:
            rtt = _link_timing(lk)
            extra += (f", link up ({rtt}; the worker keeps {lk.get('checkpoints_held')} parts for this daemon, "
                      f"{_human_bytes(lk.get('store_bytes'))}: its layers of each checkpoint and parked conversation)"
                      if lk.get("up") else f", link DOWN: {lk.get('down_reason')}")
        return f"{s.get('stage')}: {s.get('device')} {_layers(s.get('layers'))}{extra}"
    stages = "; ".join(_stage(s) for s in d.get("stages", []))
    tier_rows = [(f"  stage {s.get('stage')} layer {L.get('layer')}", _tier_layer(L))
                 for s in _list(d.get("stages")) if isinstance(s, dict) and isinstance(s.get("moe"), dict)
                 and isinstance(s["moe"].get("tier"), dict)
                 for L in _list(s["moe"]["tier"].get("layers")) if isinstance(L, dict)]
    _out(args, d, _kv([
        ("model", d.get("model")), ("arch", e.get("arch")), ("path", e.get("path")), ("n_ctx", e.get("n_ctx")),
        ("stages", stages),
    ] + ([("position", e.get("pos"))] if len(_list(d.get("slots"))) <= 1 else []) + [   # else each slot's, below
        ("queue", f"{q.get('running', 0)} running, {q.get('waiting', 0)} waiting (max {q.get('max')})"),
        ("slots", _slots_line(_list(d.get("slots")))),
        ("kv pages", f"{kv.get('used')} / {kv.get('total')} used (page size {kv.get('page_size')})" +
                     (f", {kv.get('held')} held by checkpoints and "
                      f"{len([p for p in e.get('parked') or [] if p.get('tier') == 'device'])} parked resident"
                      if kv.get("held") else "")),
        ("checkpoints", f"{len(e.get('checkpoints') or [])} kept in the prefix tree, "
                        f"{_human_bytes(e.get('checkpoint_bytes'))} (--prompt-cache {e.get('prompt_cache')}; parked "
                        "conversations' own are counted below)"),
        ("parked", _parked_line(e)),
        ("session files", _session_line(e.get("session_files"))),
        ("speculation", _spec_line(e.get("spec"))),
        ("responses", _responses_line(d.get("responses_store"))),
        ("device", _device_line(d.get("device") or {})),
        ("memory", f"weights {_human_bytes(mem.get('weights_bytes'))}, KV pool {_human_bytes(mem.get('kv_pool_bytes'))}, "
                   f"RSS {_human_bytes(mem.get('rss_bytes'))}"),
        ("requests", e.get("requests")), ("uptime", f"{d.get('uptime_s')} s"), ("version", d.get("version")),
    ] + ([("expert tier", "per layer: resident experts, decode hit rate, swaps, bytes copied")] + tier_rows
         if tier_rows else [])))
    return EXIT_OK


def _slots_line(slots: list) -> str:
    """One line for the request slots: how many are busy, then each busy one's phase, position and tokens decoded."""
    slots = [s for s in slots if isinstance(s, dict)]
    busy = [s for s in slots if s.get("is_processing")]
    each = ", ".join(f"{s.get('id')}: {s.get('phase') or 'processing'} at {s.get('pos')}"
                     f" ({(s.get('next_token') or {}).get('n_decoded', 0)} decoded)" for s in busy)
    return f"{len(busy)} / {len(slots)} busy" + (f" ({each})" if each else "")


def _parked_line(e: dict) -> str:
    """/status's parked conversations in one line: how many in each tier, RAM's use against its budget."""
    parked = [p for p in _list(e.get("parked")) if isinstance(p, dict)]
    if not parked:
        return "none"
    tiers = {t: [p for p in parked if p.get("tier") == t] for t in ("device", "ram", "disk")}
    used = {t: sum(int(p.get("bytes") or 0) for p in ps) for t, ps in tiers.items()}
    cps = sum(int(p.get("checkpoints") or 0) for p in parked)
    n = len(parked)
    out = [f"{n} conversation{'s' * (n != 1)} "
           f"({cps} checkpoint{'s' * (cps != 1)} of {'its' if n == 1 else 'their'} own)"]
    if tiers["device"]:
        out.append(f"{len(tiers['device'])} resident on the device (--park-resident)")
    if tiers["ram"]:
        out.append(f"{len(tiers['ram'])} in RAM, {_human_bytes(used['ram'])} of "
                   f"{_human_bytes(e.get('conversation_cache_bytes'))} (--conversation-cache-mib)")
    if tiers["disk"]:
        out.append(f"{len(tiers['disk'])} on disk, {_human_bytes(used['disk'])}")
    return ": ".join([out[0], ", ".join(out[1:])]) if len(out) > 1 else out[0]


def _session_line(sf) -> str:
    """/status's session_files: the directory's use against its quota."""
    if not isinstance(sf, dict):
        return "off (no --slot-save-path)"
    if sf.get("error"):
        return f"cannot list the directory: {sf['error']}"
    q = sf.get("quota_bytes")
    return (f"{sf.get('files')} files, {_human_bytes(sf.get('bytes'))}"
            + (f" of {_human_bytes(q)} (--slot-quota-mib)" if q else " (no quota)"))


def _spec_line(sp) -> str:
    """/status's engine.spec: the drafter and its totals since the start (warm-up included)."""
    if not isinstance(sp, dict) or not sp.get("n"):
        return "off (--spec 0)"
    return (f"--spec {sp.get('n')} ({sp.get('draft')} drafts): {sp.get('drafted')} drafted, {sp.get('accepted')} "
            f"accepted ({_rate(sp.get('acceptance_rate'))}) in {sp.get('verifies')} verifies")


def _responses_line(rs) -> str:
    """/status's responses_store: the kept /v1/responses against their two bounds."""
    if not isinstance(rs, dict):
        return "-"
    return (f"{rs.get('entries')} kept (--responses-store {rs.get('max_entries')}), {_human_bytes(rs.get('bytes'))} "
            f"of {_human_bytes(rs.get('budget'))} (--responses-store-mib)")


def _rate(x) -> str:
    return f"{100 * x:.1f} %" if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def _tier_line(t: dict) -> str:
    """One line for a stage's expert tier: slots, decode hit rate, swaps, bytes copied and read from host RAM."""
    return (f"{t.get('resident')} / {t.get('slots')} slots of {_human_bytes(t.get('expert_bytes'))}, decode hits "
            f"{_rate(t.get('hit_rate'))}, {t.get('swaps')} swaps, {_human_bytes(t.get('bytes_moved'))} copied, "
            f"{_human_bytes(t.get('bytes_read_host'))} read from host RAM, pinned "
            f"{_human_bytes(t.get('pinned_bytes'))}")


def _list(x) -> list:
    return x if isinstance(x, list) else []


def _tier_layer(L: dict) -> str:
    res = _list(L.get("resident"))
    shown = ",".join(str(e) for e in res[:16]) + (f",... ({len(res)})" if len(res) > 16 else "")
    return (f"[{shown}] hits {_rate(L.get('hit_rate'))}, {L.get('swaps')} swaps, "
            f"{_human_bytes(L.get('bytes_moved'))} copied")


def cmd_health(c: Client, args) -> int:
    resp = c.request("GET", "/health")
    payload = c.read(resp)
    try:
        d = loads(payload)
        if not isinstance(d, dict):
            raise ValueError("not an object")
    except ValueError:
        raise CtlError(f"server error {resp.status}: {_summary(payload)} that are not a JSON object",
                       EXIT_SERVER) from None
    why = d.get("error") if isinstance(d.get("error"), str) else None        # unavailable / stuck: the reason
    _out(args, d, str(d.get("status", "?")) + (f" ({d['model']})" if d.get("model") else "")
         + (f": {why}" if why else ""))
    return EXIT_OK if resp.status == 200 else EXIT_SERVER


def cmd_models(c: Client, args) -> int:
    d = c.call("GET", "/v1/models")
    rows = [[m.get("id"), (m.get("meta") or {}).get("arch"), (m.get("meta") or {}).get("n_ctx"),
             (m.get("meta") or {}).get("path")] for m in d.get("data", [])]
    _out(args, d, table(rows, ["ID", "ARCH", "N_CTX", "PATH"]))
    return EXIT_OK


def cmd_slots(c: Client, args) -> int:
    d = c.call("GET", "/slots")
    rows = [[s.get("id"), s.get("state"), s.get("phase") or "-", s.get("pos"), s.get("n_ctx"), s.get("id_task"),
             (s.get("next_token") or {}).get("n_decoded", 0), s.get("checkpoints")] for s in d]
    _out(args, d, table(rows, ["ID", "STATE", "PHASE", "POS", "N_CTX", "TASK", "DECODED", "CHECKPOINTS"]))
    return EXIT_OK


def cmd_metrics(c: Client, args) -> int:
    text = c.call("GET", "/metrics", raw=True)
    if not args.json:
        print(printable(text, keep="\n\t"), end="")
        return EXIT_OK
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = [{"name": s.name, "labels": s.labels, "value": s.value} for s in fam.samples]
    print(printable(json.dumps(out, indent=2), keep="\n"))
    return EXIT_OK


def cmd_cache(c: Client, args) -> int:
    d = c.call("GET", "/cache")
    now = time.time()

    def last_use(cp):
        t = cp.get("last_use_time")
        return f"{max(0.0, now - t):.0f}s ago" if isinstance(t, (int, float)) else cp.get("last_use")
    rows = [[cp.get("pos"), cp.get("kind"), _human_bytes(cp.get("bytes")), last_use(cp),
             "yes" if cp.get("pinned") or cp.get("root") else "", cp.get("pins") or ""]
            for cp in d.get("checkpoints", [])]
    human = table(rows, ["POS", "KIND", "BYTES", "LAST USE", "PINNED", "HELD BY"]) + (
        f"\n{len(rows)} checkpoints, {_human_bytes(d.get('checkpoint_bytes'))} (--prompt-cache {d.get('prompt_cache')})")
    parked = d.get("parked") or []
    if parked:
        ram = sum(int(p.get("bytes") or 0) for p in parked if p.get("tier") == "ram")
        disk = sum(int(p.get("bytes") or 0) for p in parked if p.get("tier") == "disk")
        dev = sum(1 for p in parked if p.get("tier") == "device")
        prow = [[p.get("tokens"), _human_bytes(p.get("bytes")), p.get("tier"), p.get("checkpoints"), last_use(p)]
                for p in parked]
        human += "\n\nparked conversations\n" + table(prow, ["TOKENS", "BYTES", "TIER", "CHECKPOINTS", "LAST USE"]) + (
            f"\n{len(prow)} parked; in RAM {_human_bytes(ram)} of {_human_bytes(d.get('conversation_cache_bytes'))} "
            f"(--conversation-cache-mib)" + (f", on disk {_human_bytes(disk)}" if disk else "") +
            (f"; {dev} resident on the device (their KV pages held in the pool, --park-resident)" if dev else ""))
    _out(args, d, human)
    return EXIT_OK


def cmd_slot_action(c: Client, args) -> int:
    body = {"filename": args.filename} if getattr(args, "filename", None) else None
    d = c.call("POST", f"/slots/{args.slot}?action={args.cmd}", body)
    _out(args, d, f"slot {args.slot}: {args.cmd} done" + (f" ({args.filename})" if getattr(args, "filename", None) else ""))
    return EXIT_OK


def _chat_body(args, messages: list[dict], stream: bool) -> dict:
    body: dict[str, Any] = {"messages": messages, "stream": stream}
    for k in ("max_tokens", "temperature", "seed", "top_k", "top_p"):
        v = getattr(args, k)
        if v is not None:
            body[k] = v
    if args.model:
        body["model"] = args.model
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _stream_chat(c: Client, args, messages: list[dict]) -> tuple[str, dict]:
    """Stream one answer to stdout; -> (text, the final chunk's usage/timings/strata)."""
    resp = c.request("POST", "/v1/chat/completions", _chat_body(args, messages, True))
    if resp.status >= 400:
        raise CtlError(f"server error {resp.status}: {_error_message(c.read(resp))}", EXIT_SERVER)
    text, info = [], {}
    done = False
    with c.reading(resp):
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            try:
                d = loads(data)
                if not isinstance(d, dict):
                    raise ValueError("not an object")
            except ValueError:
                raise CtlError(f"the server's answer stream holds an event of {len(data)} bytes that is not a "
                               "JSON object", EXIT_SERVER) from None
            if "error" in d:
                raise CtlError(f"server error: {_error_message(data)}", EXIT_SERVER)
            for ch in d.get("choices", []):
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    text.append(piece)
                    sys.stdout.write(printable(piece, keep="\n\t"))
                    sys.stdout.flush()
            for k in ("usage", "timings", "strata"):
                if d.get(k):
                    info[k] = d[k]
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not done:
        raise CtlError(f"the answer stream from {c.where} ended before it finished (no [DONE]): the server went away?",
                       EXIT_CONNECT)
    return "".join(text), info


CTL_CHAT_HELP = "/reset clears the conversation, /help, /quit (or /exit, Ctrl-D) leaves, Ctrl-C stops an answer, // " \
    "sends a leading '/'"


def cmd_chat(c: Client, args) -> int:
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is not None:
        messages.append({"role": "user", "content": args.message})
        if args.json:
            print(printable(json.dumps(c.call("POST", "/v1/chat/completions", _chat_body(args, messages, False)),
                                       indent=2, ensure_ascii=False), keep="\n"))
            return EXIT_OK
        _text, info = _stream_chat(c, args, messages)
        _print_stats(args, info)
        return EXIT_OK
    interactive = sys.stdin.isatty()
    c.check_reachable()                        # no server: say so now, not after the first message
    if interactive:
        print(f"stratactl chat: type a message. {CTL_CHAT_HELP}",
              file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return EXIT_OK
        except KeyboardInterrupt:              # Ctrl-C at the prompt leaves, as `strata chat` does
            print(file=sys.stderr)
            return 130
        kind, line = parse_chat_line(line)
        if kind == "empty":
            continue
        if kind == "quit":
            return EXIT_OK
        if kind == "reset":
            messages = messages[:1] if args.system else []
            print("(new conversation)", file=sys.stderr)
            continue
        if kind == "help":
            print(CTL_CHAT_HELP, file=sys.stderr)
            continue
        if kind == "unknown":
            print(f"stratactl: unknown command {line!r} (not sent). {CTL_CHAT_HELP}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:
            text, info = _stream_chat(c, args, messages)
        except KeyboardInterrupt:              # Ctrl-C stops this answer; the chat goes on without it
            messages.pop()
            print("\n(interrupted)", file=sys.stderr)
            continue
        except CtlError as e:
            if e.code != EXIT_SERVER:          # the server is gone: nothing more to chat with
                raise
            messages.pop()                     # e.g. the conversation outgrew the context: say so, go on
            print(f"stratactl: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": text})
        _print_stats(args, info)


def _print_stats(args, info: dict) -> None:
    if not args.verbose:
        return
    t, s = info.get("timings", {}), info.get("strata", {})
    print(f"[prompt {t.get('prompt_n')} read, {t.get('cache_n')} reused ({s.get('resume_from')}), "
          f"{t.get('predicted_n')} generated, {t.get('predicted_per_second', 0):.1f} tok/s]", file=sys.stderr)


def _seconds(v: str) -> float:
    """argparse type of --timeout: a finite number of seconds > 0."""
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a number of seconds") from None
    if not (0 < x < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {v!r}")
    return x


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="stratactl", description="Control a running Strata daemon.")
    p.add_argument("--socket", "-s", default=None,
                   help="daemon's Unix socket (default $STRATA_SOCKET, $XDG_RUNTIME_DIR/strata/strata.sock "
                        "or /run/strata/strata.sock)")
    p.add_argument("--url", default=os.environ.get("STRATA_URL") or None,
                   help="talk HTTP to this URL instead of the socket, e.g. http://127.0.0.1:8080")
    p.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY") or None,
                   help="Bearer token for --url (default $STRATA_API_KEY)")
    p.add_argument("--timeout", type=_seconds, default=600.0,
                   help="seconds an exchange with the daemon may take in all, a streamed answer included (> 0)")
    p.add_argument("--json", action="store_true", help="print the server's JSON instead of a table")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print the server's JSON instead of a table")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    p.subcommands = sub            # strata.cli.argv.parse_args: an unknown flag gets its subcommand's usage line
    sub.add_parser("status", parents=[common], help="model, stages, queue, cache and memory use").set_defaults(fn=cmd_status)
    sub.add_parser("health", parents=[common], help="is the daemon up and the model loaded").set_defaults(fn=cmd_health)
    sub.add_parser("models", parents=[common], help="the served model").set_defaults(fn=cmd_models)
    sub.add_parser("slots", parents=[common], help="the engine's slots").set_defaults(fn=cmd_slots)
    sub.add_parser("metrics", parents=[common], help="Prometheus metrics (--json: parsed)").set_defaults(fn=cmd_metrics)
    sub.add_parser("cache", parents=[common], help="list conversation checkpoints").set_defaults(fn=cmd_cache)
    for action, hlp in (("save", "save a slot to a session file"), ("restore", "restore a slot from a session file"),
                        ("erase", "erase a slot")):
        sp = sub.add_parser(action, parents=[common], help=hlp)
        sp.add_argument("slot", type=int, nargs="?", default=0, help="slot id (default 0)")
        if action != "erase":
            sp.add_argument("--filename", "-f", required=True,
                            help="session file name (a plain name inside the daemon's --slot-save-path)")
        sp.set_defaults(fn=cmd_slot_action)
    ch = sub.add_parser("chat", parents=[common], help="chat with the model: one message, or interactive without one")
    ch.add_argument("message", nargs="?", default=None, help="one-shot message (omit for an interactive chat)")
    ch.add_argument("--system", default=None, help="system prompt")
    ch.add_argument("--model", default=None)
    ch.add_argument("--max-tokens", "-n", type=int, default=256, help="tokens per answer at most (default 256, as `strata chat`)")
    ch.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default, as `strata chat`)")
    ch.add_argument("--top-k", type=int, default=None)
    ch.add_argument("--top-p", type=float, default=None)
    ch.add_argument("--seed", type=int, default=None)
    ch.add_argument("--verbose", "-v", action="store_true", help="print tokens read / reused / generated")
    ch.set_defaults(fn=cmd_chat)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)  # exits 2 on usage errors
    try:
        sock = None if args.url else str(args.socket or client_socket_path())
        c = Client(sock, args.url, args.api_key, args.timeout)
        return args.fn(c, args)
    except CtlError as e:
        if getattr(args, "json", False) and e.payload:   # --json: the server's own error object on stdout too
            try:
                print(printable(json.dumps(loads(e.payload), indent=2, ensure_ascii=False), keep="\n"))
            except ValueError:
                pass
        print(f"stratactl: {e}", file=sys.stderr)
        return e.code
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:                  # Ctrl-C outside an interactive answer: leave without a traceback
        print("\n(interrupted)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
