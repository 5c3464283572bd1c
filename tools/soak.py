#!/usr/bin/env python3
"""Soak and fault run against a real `strata serve` (loopback only, bounded in time): a reference pass answers every
scripted request alone on a fresh daemon; the soak pass runs mixed clients at once on another fresh daemon for
--duration seconds (multi-turn chats that switch and park, raw completions, structured output, tool calls, streams
cut at random, session save and restore) and checks that

- every answer equals its reference (greedy: the same request must give the same text however it was resumed);
- no response is a 5xx other than 503 (queue full), and nothing hangs past --request-timeout;
- the daemon's RSS and open descriptors do not trend up: the mean of the last fifth of the samples is within
  --rss-slack (5 % by default, plus 24 MiB) and --fd-slack of the mean of the second fifth.

With --worker-kills N both passes run the daemon with its layers from --layer-split on served by a real `strata
worker` process over TCP loopback (--remote-stage), and the soak pass kills that worker (SIGKILL) N times at even
intervals and starts it again on the same port after --worker-down seconds: requests in flight or sent while it is
down get the documented 503 (worker_unavailable) and are retried, the daemon reconnects, and every answer must still
equal its reference; parking and session files run over the link as well (the worker announces +park: its part of a
parked conversation or a session file is streamed to the main). The summary adds the kills, the restarts and how
long the daemon took to report healthy again, and the RSS and descriptor curves (start, after the warm-up, end, the
trend per hour, per-minute means).

Prints one JSON summary (also --out) and exits 1 when a check fails. Usage:
  python tools/soak.py --duration 120 --clients 4 [--model PATH] [--worker-kills 6] [--out bench/results/soak_<commit>.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import socket
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["rivers", "volcanoes", "bread", "owls", "glaciers", "tea", "chess", "comets", "bees", "lighthouses",
          "maps", "violins"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def scripts(seed: int, n_convs: int, turns: int) -> dict[str, dict]:
    """The scripted requests, by key: chats (a system prompt shared by half of them, `turns` user turns each), raw
    completions, a structured answer and a tool call. Greedy, short answers."""
    rng = random.Random(seed)
    out: dict[str, dict] = {}
    systems = ["You are a concise assistant.", "You answer in one short sentence."]
    for c in range(n_convs):
        topic = TOPICS[c % len(TOPICS)]
        out[f"chat{c}"] = {"kind": "chat", "system": systems[c % 2],
                           "turns": [f"Tell me one fact about {topic}." if t == 0 else
                                     rng.choice(["Another one.", "Why is that?", "Say it shorter.", "And then?"])
                                     for t in range(turns)]}
    for i in range(3):
        out[f"raw{i}"] = {"kind": "raw", "prompt": f"{i + 1}, {i + 2}, {i + 3},"}
    out["json"] = {"kind": "json"}
    out["tool"] = {"kind": "tool"}
    return out


class Daemon:
    def __init__(self, model: str, tmp: Path, extra: list[str]):
        self.sock = str(tmp / "soak.sock")
        self.slots = tmp / "slots"
        self.slots.mkdir(exist_ok=True)
        slots = ["--slot-save-path", str(self.slots)]
        self.log = open(tmp / "daemon.log", "wb")
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("NOTIFY_SOCKET", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli.main", "serve", "--model", model, "--socket", self.sock,
             *slots, "--queue-max", "64", "--log-level", "warning", *extra],
            stdout=subprocess.DEVNULL, stderr=self.log, env=env, cwd=ROOT)

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}")
            try:
                async with session.get("http://strata/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError("the daemon did not become ready")

    def sample(self) -> tuple[int, int]:
        """(RSS bytes, open descriptors) of the daemon."""
        rss = 0
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        return rss, len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


class WorkerProc:
    """`strata worker` on 127.0.0.1:port, a real process (the remote stage the daemon's link reaches)."""

    def __init__(self, model: str, port: int, log: Path):
        self.model, self.port, self.log = model, port, log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> "WorkerProc":
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("NOTIFY_SOCKET", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli.main", "worker", "--listen", f"127.0.0.1:{self.port}", "--model",
             self.model, "--threads", "1", "--device", "cpu", "--log-format", "json", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        ready = threading.Event()

        def drain(proc=self.proc) -> None:
            with open(self.log, "a") as f:
                for line in proc.stderr:
                    f.write(line)
                    if line.startswith("strata worker listening on"):
                        ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError(f"strata worker did not start on port {self.port} (see {self.log})")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One pass: the requests it sent, their answers, and what went wrong."""

    def __init__(self, session: aiohttp.ClientSession, timeout: float):
        self.s, self.timeout = session, timeout
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self.refusals: list[str] = []

    async def post(self, path: str, body: dict) -> dict | None:
        for _attempt in range(200):
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(self.timeout):
                    async with self.s.post(f"http://strata{path}", json=body) as r:
                        data = await r.json(content_type=None)
                        self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
            except TimeoutError:
                self.errors.append(f"{path}: no answer within {self.timeout} s")
                return None
            self.latencies.append(time.monotonic() - t0)
            if r.status == 503:                       # queue full, worker down: documented, retried as Retry-After says
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            if r.status >= 500:
                self.errors.append(f"{path}: {r.status} {json.dumps(data)[:300]}")
            elif r.status != 200 and len(self.refusals) < 20:    # kept for the summary: what a 4xx said
                self.refusals.append(f"{path} {json.dumps(body)[:120]}: {r.status} {json.dumps(data)[:300]}")
            if r.status != 200:
                return None
            return data
        self.errors.append(f"{path}: still 503 after 200 tries")
        return None

    async def chat_turns(self, key: str, spec: dict, check=None) -> list[str]:
        msgs = [{"role": "system", "content": spec["system"]}]
        answers = []
        for t, text in enumerate(spec["turns"]):
            msgs.append({"role": "user", "content": text})
            d = await self.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 24, "temperature": 0})
            if d is None:
                return answers
            a = d["choices"][0]["message"]["content"]
            answers.append(a)
            if check is not None:
                check(f"{key}.{t}", a)
            msgs.append({"role": "assistant", "content": a})
        return answers

    async def one(self, key: str, spec: dict, check=None) -> None:
        if spec["kind"] == "chat":
            await self.chat_turns(key, spec, check)
            return
        if spec["kind"] == "raw":
            d = await self.post("/v1/completions", {"prompt": spec["prompt"], "max_tokens": 12, "temperature": 0})
            a = d and d["choices"][0]["text"]
        elif spec["kind"] == "json":
            d = await self.post("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Name one fruit and how many seeds it has, as JSON."}],
                "max_tokens": 48, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}}})
            a = d and d["choices"][0]["message"]["content"]
            if a is not None:
                try:
                    json.loads(a)
                except ValueError:
                    self.errors.append(f"json: the constrained answer is not JSON: {a[:200]!r}")
        else:
            d = await self.post("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": TOOLS,
                "tool_choice": "required", "max_tokens": 48, "temperature": 0})
            calls = d and d["choices"][0]["message"].get("tool_calls")       # ids are random: names and arguments
            a = d and json.dumps([(c["function"]["name"], c["function"]["arguments"]) for c in calls or []])
        if a is not None and check is not None:
            check(key, a)

    async def cut_stream(self, rng: random.Random) -> None:
        """A streamed answer the client drops after a few chunks."""
        body = {"messages": [{"role": "user", "content": f"Write a long story about {rng.choice(TOPICS)}."}],
                "max_tokens": 64, "temperature": 0.7, "seed": rng.randrange(1 << 30), "stream": True}
        try:
            async with asyncio.timeout(self.timeout):
                async with self.s.post("http://strata/v1/chat/completions", json=body) as r:
                    self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
                    if r.status >= 500 and r.status != 503:
                        self.errors.append(f"stream: {r.status}")
                    n = rng.randrange(1, 6)
                    async for _ in r.content:
                        n -= 1
                        if n <= 0:
                            break
        except TimeoutError:
            self.errors.append("stream: no answer in time")

    async def session_round(self, key: str, spec: dict, check) -> None:
        """A chat's first turn, saved to a session file, another chat in between, restored, then its second turn."""
        msgs = [{"role": "system", "content": spec["system"]}, {"role": "user", "content": spec["turns"][0]}]
        d = await self.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 24, "temperature": 0})
        if d is None:
            return
        a = d["choices"][0]["message"]["content"]
        check(f"{key}.0", a)
        name = f"soak-{key}.bin"
        await self.post("/slots/0?action=save", {"filename": name})
        await self.post("/v1/completions", {"prompt": "Elsewhere:", "max_tokens": 4, "temperature": 0})
        await self.post("/slots/0?action=restore", {"filename": name})
        if len(spec["turns"]) > 1:
            msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": spec["turns"][1]}]
            d = await self.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 24, "temperature": 0})
            if d is not None:
                check(f"{key}.1", d["choices"][0]["message"]["content"])


def curves(samples: list[tuple[float, int, int]], fifth: int) -> dict:
    """The RSS and descriptor curves for the summary: "rss_curve_mib" / "fds_curve" at the start (first sample),
    after the warm-up (the mean of the second fifth, what the leak check compares with) and at the end (the mean of
    the last fifth); "trend": the least-squares slopes after the first fifth (MiB and descriptors per hour); "curve":
    per-minute means [minute, RSS MiB, descriptors] for plotting."""
    if not samples:
        return {}
    t0 = samples[0][0]
    warm, late, rest = samples[fifth:2 * fifth] or samples[:fifth], samples[-fifth:], samples[fifth:] or samples

    def mean(xs, i):
        return sum(x[i] for x in xs) / len(xs)

    def slope(i, scale):
        ts = [(x[0] - t0) / 3600 for x in rest]
        ys = [x[i] / scale for x in rest]
        mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
        var = sum((t - mt) ** 2 for t in ts)
        return round(sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var, 3) if var else 0.0
    minutes: dict[int, list] = {}
    for t, rss, fds in samples:
        minutes.setdefault(int((t - t0) // 60), []).append((t, rss, fds))
    return {"rss_curve_mib": {"start": round(samples[0][1] / 2**20, 1), "after_warmup": round(mean(warm, 1) / 2**20, 1),
                              "end": round(mean(late, 1) / 2**20, 1)},
            "fds_curve": {"start": samples[0][2], "after_warmup": round(mean(warm, 2), 1), "end": round(mean(late, 2), 1)},
            "trend": {"rss_mib_per_hour": slope(1, 2**20), "fds_per_hour": slope(2, 1)},
            "curve": [[m, round(mean(xs, 1) / 2**20, 1), round(mean(xs, 2), 1)] for m, xs in sorted(minutes.items())]}


async def reference(model: str, tmp: Path, extra: list[str], specs: dict, timeout: float) -> dict[str, str]:
    (tmp / "ref").mkdir()
    d = Daemon(model, tmp / "ref", extra)
    answers: dict[str, str] = {}
    conn = aiohttp.UnixConnector(path=d.sock)
    async with aiohttp.ClientSession(connector=conn) as s:
        await d.wait_ready(s)
        run = Run(s, timeout)
        for key, spec in specs.items():
            await run.one(key, spec, check=lambda k, a: answers.__setitem__(k, a))
            await s.post("http://strata/slots/0?action=erase")        # each alone: nothing of the others kept
    d.stop()
    if run.errors:
        raise RuntimeError("the reference pass failed: " + "; ".join(run.errors[:5]))
    return answers


async def soak(model: str, tmp: Path, extra: list[str], specs: dict, ref: dict[str, str], a,
               worker: WorkerProc | None = None) -> dict:
    (tmp / "soak").mkdir()
    d = Daemon(model, tmp / "soak", extra)
    conn = aiohttp.UnixConnector(path=d.sock, limit=0)
    mismatches: list[str] = []
    compared = [0]

    def check(k: str, got: str) -> None:
        compared[0] += 1
        if ref.get(k) != got:
            mismatches.append(f"{k}: {got[:120]!r} != reference {str(ref.get(k))[:120]!r}")

    samples: list[tuple[float, int, int]] = []
    async with aiohttp.ClientSession(connector=conn) as s:
        await d.wait_ready(s)
        run = Run(s, a.request_timeout)
        t_end = time.monotonic() + a.duration
        keys = list(specs)
        chats = [k for k in keys if specs[k]["kind"] == "chat"]

        async def client(i: int) -> None:
            rng = random.Random(a.seed * 1000 + i)
            while time.monotonic() < t_end:
                r = rng.random()
                if r < 0.15:
                    await run.cut_stream(rng)
                elif r < 0.25:
                    k = rng.choice(chats)
                    await run.session_round(k, specs[k], check)
                else:
                    k = rng.choice(keys)
                    await run.one(k, specs[k], check)

        async def sampler() -> None:
            while time.monotonic() < t_end:
                rss, fds = d.sample()
                samples.append((time.monotonic(), rss, fds))
                await asyncio.sleep(a.sample_every)

        kills: list[dict] = []

        async def killer() -> None:
            """Kill the worker at even intervals and start it again on its port; time the daemon's way back."""
            t0 = time.monotonic()
            for i in range(a.worker_kills):
                await asyncio.sleep(max(0.0, t0 + a.duration * (i + 1) / (a.worker_kills + 1) - time.monotonic()))
                worker.kill()
                t_kill = time.monotonic()
                await asyncio.sleep(a.worker_down)
                await asyncio.to_thread(worker.start)
                t_up = time.monotonic()
                healthy = None
                while time.monotonic() < t_up + 120:
                    async with s.get("http://strata/health") as r:
                        if r.status == 200:
                            healthy = time.monotonic()
                            break
                    await asyncio.sleep(0.05)
                kills.append({"at_s": round(t_kill - t0, 1), "down_s": round(t_up - t_kill, 2),
                              "healthy_after_restart_s": None if healthy is None else round(healthy - t_up, 2)})
                if healthy is None:
                    run.errors.append(f"the daemon did not report healthy within 120 s of worker restart {i + 1}")

        tasks = [sampler(), *(client(i) for i in range(a.clients))]
        if worker is not None and a.worker_kills:
            tasks.append(killer())
        await asyncio.gather(*tasks)
        async with s.get("http://strata/status") as r:
            status = await r.json()
    rc = d.stop()
    n = len(samples)
    fifth = max(1, n // 5)
    early, late = samples[fifth:2 * fifth] or samples[:fifth], samples[-fifth:]
    rss0 = sum(x[1] for x in early) / len(early)
    rss1 = sum(x[1] for x in late) / len(late)
    fd0 = sum(x[2] for x in early) / len(early)
    fd1 = sum(x[2] for x in late) / len(late)
    problems = list(run.errors) + mismatches
    if rss1 > rss0 * (1 + a.rss_slack) + (24 << 20):
        problems.append(f"RSS grew from {rss0 / 2**20:.0f} MiB to {rss1 / 2**20:.0f} MiB")
    if fd1 > fd0 + a.fd_slack:
        problems.append(f"open descriptors grew from {fd0:.0f} to {fd1:.0f}")
    if rc != 0:
        problems.append(f"the daemon exited with {rc} on SIGTERM")
    lat = sorted(run.latencies)
    curve = curves(samples, fifth)
    return {**curve, "duration_s": a.duration, "clients": a.clients, "requests": sum(run.statuses.values()),
            "statuses": {str(k): v for k, v in sorted(run.statuses.items())}, "compared": compared[0],
            "mismatches": len(mismatches), "rss_mib": [round(rss0 / 2**20, 1), round(rss1 / 2**20, 1)],
            "fds": [round(fd0, 1), round(fd1, 1)], "samples": len(samples),
            "latency_s": {"p50": lat[len(lat) // 2] if lat else None, "p99": lat[int(len(lat) * .99)] if lat else None},
            "parked": len(status.get("engine", {}).get("parked", [])), "refusals": run.refusals,
            **({"worker_kills": kills} if worker is not None else {}), "problems": problems[:50],
            "ok": not problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--convs", type=int, default=6, help="scripted chats")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--sample-every", type=float, default=1.0)
    ap.add_argument("--rss-slack", type=float, default=0.05)
    ap.add_argument("--fd-slack", type=float, default=8.0)
    ap.add_argument("--park-mib", type=int, default=24, help="the daemon's --conversation-cache-mib (two short chats)")
    ap.add_argument("--daemon-arg", action="append", default=[], help="more `strata serve` flags (repeatable)")
    ap.add_argument("--worker-kills", type=int, default=0, help="serve the layers from --layer-split on with a "
                    "`strata worker` on loopback and kill it this many times in the soak pass (0: no worker)")
    ap.add_argument("--layer-split", type=int, default=10, help="the first layer the worker serves")
    ap.add_argument("--worker-down", type=float, default=1.0, help="seconds the killed worker stays down")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    # parking held to a small budget, so that it is full early and the RSS it holds stops growing (what the leak
    # check then sees is everything else)
    extra = ["--n-ctx", "1024", "--threads", "2", "--device", "cpu", "--no-warmup",
             "--conversation-cache-mib", str(a.park_mib), *a.daemon_arg]
    specs = scripts(a.seed, a.convs, a.turns)
    with tempfile.TemporaryDirectory(prefix="strata-soak-") as tmp:
        worker = None
        if a.worker_kills:
            from strata.gguf.default_model import resolve_model
            worker = WorkerProc(str(resolve_model(a.model)), free_port(), Path(tmp) / "worker.log").start()
            extra += ["--remote-stage", f"127.0.0.1:{worker.port}", "--layer-split", str(a.layer_split)]
        try:
            ref = asyncio.run(reference(a.model, Path(tmp), extra, specs, a.request_timeout))
            out = asyncio.run(soak(a.model, Path(tmp), extra, specs, ref, a, worker))
        finally:
            if worker is not None:
                worker.stop()
    out["references"] = len(ref)
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
