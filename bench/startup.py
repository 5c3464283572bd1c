#!/usr/bin/env python3
"""Start-up time: `strata serve` to healthy and `strata generate` (a one-token answer), wall time, vs before and llama.cpp.

For each model (the default SmolLM2-135M Q4_1 and a ~1 B synthetic llama written once with strata.gguf.synth into
--synth-dir) and each of --repeats runs, in fresh processes as a user starts them:
  serve     `python -m strata.cli.main serve --socket S` until GET /health answers 200 (polled every 10 ms)
  generate  `python -m strata.cli.main generate --raw --prompt Hi --max-tokens 1` until it exits
  open      in this process: strata.gguf.file.open_gguf (header, metadata and tensor table), and the tokenizer build
One untimed `generate` first (bytecode compiled, the file in the page cache: what a user's second start sees);
then the best of the repeats is kept (a shared 2-core machine is noisy; the best is the least disturbed run).
llama.cpp's column: `llama-server` to healthy and `llama-cli -n 1` when those binaries are on the PATH, else
llama-cpp-python (a fresh `--llama-python` process importing llama_cpp, loading the model and answering one token)
when importable;
otherwise skipped with a note. Ratios against "before" come from --before (a JSON written by this script with
--save-before on the commit before the GGUF reader change), when that file exists.

Usage: PYTHONPATH=. python bench/startup.py [--repeats 3] [--models default,synth1b] [--synth-dir DIR]
       [--out bench/results/startup_cpu.json] [--before bench/results/startup_cpu_before.json] [--save-before]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import commit as bench_commit  # noqa: E402
sys.path.insert(0, str(ROOT / "bench"))
from daemons import free_port  # noqa: E402  (bench/daemons.py)

# ~1.1 B parameters: 16 layers of width 2048 (32 heads, 8 KV heads, FFN 8192) and the default model's 49152-token
# vocabulary, Q4_0 weights (a ~0.6 GiB file, about Llama-3.2-1B's shape)
SYNTH_1B = dict(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192, ctx=8192,
                qtype="Q4_0", embd_qtype="Q4_0", tie_embeddings=True, name="strata-synthetic-1b")


def _env() -> dict:
    """The environment of the measured processes: Strata importable from this checkout, bytecode cached as in a
    user's shell (a sandbox's PYTHONDONTWRITEBYTECODE would add ~0.1 s of compiling Strata's own modules)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("NOTIFY_SOCKET", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _healthy(conn_factory) -> bool:
    c = conn_factory()
    try:
        c.request("GET", "/health")
        return c.getresponse().status == 200
    except OSError:
        return False
    finally:
        c.close()


def _wait_healthy(proc: subprocess.Popen, conn_factory, t0: float, timeout: float, what: str) -> float:
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was healthy")
        if _healthy(conn_factory):
            return time.perf_counter() - t0
        time.sleep(0.01)
    raise RuntimeError(f"{what} was not healthy after {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def strata_serve(model: str, threads: int) -> float:
    """Seconds from spawning `strata serve` to its first 200 on /health."""
    from strata.cli.ctl import UnixHTTPConnection
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "s.sock")
        cmd = [sys.executable, "-m", "strata.cli.main", "serve", "--model", model, "--socket", sock, "--n-ctx", "512",
               "--threads", str(threads), "--log-level", "warning"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=ROOT)
        try:
            return _wait_healthy(proc, lambda: UnixHTTPConnection(sock, 5), t0, 600, "strata serve")
        finally:
            _stop(proc)


def strata_generate(model: str, threads: int) -> float:
    """Seconds of `strata generate --raw --prompt Hi --max-tokens 1`, spawn to exit."""
    cmd = [sys.executable, "-m", "strata.cli.main", "generate", "--model", model, "--raw", "--prompt", "Hi",
           "--max-tokens", "1", "--n-ctx", "512", "--threads", str(threads), "--temperature", "0"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(), cwd=ROOT)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"strata generate failed ({r.returncode}): {r.stderr.decode(errors='replace')[-500:]}")
    return dt


def strata_open(model: str) -> dict:
    """In this process: ms to open the GGUF (header, metadata, tensor table) and to build the tokenizer."""
    from strata.gguf.default_model import resolve_model
    from strata.gguf.file import open_gguf
    from strata.text.tokenizer import Tokenizer
    t0 = time.perf_counter()
    f = open_gguf(resolve_model(model))
    t1 = time.perf_counter()
    Tokenizer.from_gguf(f.metadata)
    t2 = time.perf_counter()
    return {"open_gguf_ms": (t1 - t0) * 1e3, "tokenizer_ms": (t2 - t1) * 1e3}


def llama_server(model: str, threads: int) -> float:
    port = free_port()
    cmd = [shutil.which("llama-server"), "-m", model, "--port", str(port), "-c", "512", "-t", str(threads)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return _wait_healthy(proc, lambda: http.client.HTTPConnection("127.0.0.1", port, timeout=5), t0, 600,
                             "llama-server")
    finally:
        _stop(proc)


def llama_cli(model: str, threads: int) -> float:
    cmd = [shutil.which("llama-cli"), "-m", model, "-p", "Hi", "-n", "1", "-c", "512", "-t", str(threads),
           "-no-cnv", "--temp", "0"]
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


LLAMA_CPP_PY = ("import sys, llama_cpp\n"
                "m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), verbose=False)\n"
                "m('Hi', max_tokens=1, temperature=0)\n")


def llama_cpp_python(python: str):
    """fn(model, threads) -> seconds of a fresh `python` process that imports llama_cpp, loads the model and answers
    one token."""
    def run(model: str, threads: int) -> float:
        t0 = time.perf_counter()
        subprocess.run([python, "-c", LLAMA_CPP_PY, model, str(threads)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)
        return time.perf_counter() - t0
    return run


def llama_runners(python: str) -> tuple[dict, str | None]:
    """{name: fn(model, threads) -> s} of the llama.cpp tools found, and a note when none is."""
    runners = {}
    if shutil.which("llama-server"):
        runners["llama-server (healthy)"] = llama_server
    if shutil.which("llama-cli"):
        runners["llama-cli -n 1"] = llama_cli
    if not runners and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        runners["llama-cpp-python (load + 1 token)"] = llama_cpp_python(python)
    note = None if runners else ("llama.cpp skipped: no llama-server / llama-cli on the PATH and llama_cpp "
                                 f"(pip install llama-cpp-python) is not importable by {python}")
    return runners, note


def synth_model(d: Path) -> Path:
    """The ~1 B synthetic llama, written once (a few minutes on 2 cores) and reused."""
    from strata.gguf import synth
    p = d / "synth-llama-1b-q4_0.gguf"
    if not p.exists():
        d.mkdir(parents=True, exist_ok=True)
        print(f"writing {p} (once) ...", flush=True)
        tmp = p.with_suffix(".partial")
        synth.write_synthetic(tmp, synth.preset("llama", "tiny", **SYNTH_1B))
        tmp.rename(p)
    return p


def best(fn, repeats: int, *args) -> tuple[float, list[float]]:
    runs = [fn(*args) for _ in range(repeats)]
    return min(runs), runs




def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="default,synth1b", help="comma list of: default, synth1b, or GGUF paths")
    ap.add_argument("--synth-dir", type=Path, default=Path(tempfile.gettempdir()) / "strata-bench")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/startup_cpu.json")
    ap.add_argument("--before", type=Path, default=ROOT / "bench/results/startup_cpu_before.json")
    ap.add_argument("--save-before", action="store_true", help="write this run to --before instead of --out")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    ap.add_argument("--llama-python", default=sys.executable,
                    help="the Python that imports llama_cpp (default: this one; a separate venv keeps the build apart)")
    a = ap.parse_args(argv)

    runners, note = ({}, "llama.cpp skipped (--no-llama)") if a.no_llama else llama_runners(a.llama_python)
    before = {}
    if not a.save_before and a.before.exists():
        before = {r["model"]: r for r in json.loads(a.before.read_text())["rows"]}
    rows = []
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        if name == "default":
            from strata.gguf.default_model import default_model_path
            path = str(default_model_path())
        elif name == "synth1b":
            path = str(synth_model(a.synth_dir))
        else:
            path = name
        size = os.path.getsize(path)
        row = {"model": name, "path": path, "file_bytes": size}
        strata_generate(path, a.threads)                  # warm-up, untimed
        row["serve_healthy_s"], row["serve_runs"] = best(strata_serve, a.repeats, path, a.threads)
        row["generate_s"], row["generate_runs"] = best(strata_generate, a.repeats, path, a.threads)
        row.update(strata_open(path))
        for k, fn in runners.items():
            row.setdefault("llama_cpp", {})[k] = min(fn(path, a.threads) for _ in range(a.repeats))
        rows.append(row)

        print(f"\n{name}: {path} ({size / 2**20:.0f} MiB)")
        print(f"  open_gguf {row['open_gguf_ms']:.0f} ms, tokenizer {row['tokenizer_ms']:.0f} ms (in process)")
        b = before.get(name)
        for key, label in (("serve_healthy_s", "strata serve -> healthy"), ("generate_s", "strata generate, 1 token")):
            line = f"  {label:26s} {row[key]:6.2f} s"
            if b is not None and b.get(key):
                line += f"   before {b[key]:6.2f} s ({b[key] / row[key]:.1f}x faster)"
            print(line)
        for k, v in row.get("llama_cpp", {}).items():
            ref = row["serve_healthy_s"] if "server" in k else row["generate_s"]
            print(f"  {k:26s} {v:6.2f} s   strata / llama.cpp = {ref / v:.2f}")
    if note:
        print(f"\n{note}")
    out = a.before if a.save_before else a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"bench": "startup", "rev": bench_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
           "cpu_count": os.cpu_count(), "threads": a.threads, "repeats": a.repeats, "python": platform.python_version(),
           "llama_cpp_note": note, "rows": rows}
    if before and not a.save_before:
        doc["before"] = {"file": str(a.before.relative_to(ROOT)) if a.before.is_relative_to(ROOT) else str(a.before),
                         "rev": json.loads(a.before.read_text()).get("rev")}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
