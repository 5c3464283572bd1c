"""What the benchmarks share: the commit a result file is named by (git HEAD and a digest of the code that ran),
where a result is written, the best time of a call, what else the host is doing, this process's resident memory, and
the environment a child process of some checkout runs in."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def source_digest() -> str:
    """sha256 (first 16 hex digits) of the code that ran: every .py / .cu / .cuh / .h / .c / .inc file under strata/,
    native/ and bench/ (path and bytes, sorted). A copy of the working tree whose git HEAD is stale (the device
    machine's) still names its code: compare with `python -c "from bench.common import source_digest as d;
    print(d())"` at a checkout."""
    import hashlib
    h = hashlib.sha256()
    files = sorted(p for d in ("strata", "native", "bench") for p in (ROOT / d).rglob("*")
                   if p.suffix in (".py", ".cu", ".cuh", ".h", ".c", ".inc") and p.is_file())
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def commit() -> str:
    """The git commit (STRATA_COMMIT overrides) and, after a '+', source_digest(): the device machine's copy of the
    tree can carry a stale git HEAD, the digest names the code itself."""
    if os.environ.get("STRATA_COMMIT"):
        return os.environ["STRATA_COMMIT"] + "+" + source_digest()
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        head = "unknown"
    return head + "+" + source_digest()


def write_result(data: dict, name: str, out: str | None = None) -> Path:
    """Write a bench's result as indented JSON to `out`, else bench/results/<name>.json (name: what it measures
    and the commit); print and return the path."""
    dest = Path(out) if out else ROOT / "bench" / "results" / f"{name}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {dest}")
    return dest


def best_time(fn, min_time: float = 0.5, min_reps: int = 3) -> float:
    """The shortest of fn()'s wall times (s) over at least min_reps calls and min_time seconds, after one warm-up
    call."""
    fn()
    times, end = [], time.perf_counter() + min_time
    while len(times) < min_reps or time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(min(times))


BUILD_TOOLS = ("cc1plus", "cc1", "nvcc", "cicc", "ptxas", "ld", "make", "gmake", "cmake", "ninja")


def host_load(proc: str = "/proc") -> dict:
    """What else the host is doing: the 1-minute load average, the CPU count and the names of running compiler /
    build processes (BUILD_TOOLS, read from proc/*/comm). Host-bound rows (Python launches) drop while a build runs
    beside the bench: a result records this and a bench warns."""
    names = []
    for d in Path(proc).glob("[0-9]*"):
        try:
            comm = (d / "comm").read_text().strip()
        except OSError:
            continue
        if comm in BUILD_TOOLS:
            names.append(comm)
    try:
        load = float(Path(proc, "loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        load = None
    return {"load_avg_1m": load, "n_cpu": os.cpu_count(), "build_processes": sorted(set(names)),
            "n_build_processes": len(names)}


def rss() -> int:
    """This process's resident set size in bytes (VmRSS; 0 where /proc has none)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def tree_env(tree: str | Path = ROOT, **extra: str) -> dict[str, str]:
    """os.environ for a child process that imports Strata from `tree`: the tree first on PYTHONPATH, the other entries
    kept (site folders such as a --target install) except this checkout's root, so that a baseline tree's child never
    imports this tree's code; `extra` set on top."""
    keep = [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q and Path(q).resolve() != ROOT]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + keep), **extra)
