#!/usr/bin/env python3
"""Run `strata serve` with every Sequence.forward and prompt read (Engine._prefill) timed into $STRATA_BENCH_CLOCK.

bench/prompt_cache.py --e2e starts the daemon through this file, so the time to first token a client sees can be
split into the model's forward calls while the prompt is read (the forward lines inside a prefill window that
started after the request was sent) and everything else (HTTP, JSON, rendering and tokenizing, planning,
checkpoints, parking, sampling). Forward calls of the decode that follows the first token are not counted even
when they start before the client has read that token. Lines: "F start seconds tokens" per forward call, "P start
seconds" per prefill; time.monotonic() is one clock for every process of the machine (CLOCK_MONOTONIC), so the
bench compares it with its own. On the CPU a forward call is synchronous; on a GPU it returns once its work is
queued, so there the forward lines undercount.

Usage: STRATA_BENCH_CLOCK=/tmp/clock PYTHONPATH=. python bench/model_clock.py [strata serve flags]
"""
from __future__ import annotations

import os
import sys
import time

_out = []          # the file the timed calls write to (installed once per process, the file may change)


def install(path: str) -> None:
    """Time every Sequence.forward and Engine._prefill of this process into `path` (appended) from now on."""
    from strata.engine import engine
    from strata.stages import sequence
    if _out:
        _out[0].close()
        _out[0] = open(path, "a", buffering=1)
        return
    _out.append(open(path, "a", buffering=1))
    forward, prefill = sequence.Sequence.forward, engine.Engine._prefill

    def timed_forward(self, tokens, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return forward(self, tokens, *args, **kwargs)
        finally:
            _out[0].write(f"F {t0:.6f} {time.monotonic() - t0:.6f} {len(tokens)}\n")

    def timed_prefill(self, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return prefill(self, *args, **kwargs)
        finally:
            _out[0].write(f"P {t0:.6f} {time.monotonic() - t0:.6f}\n")

    sequence.Sequence.forward = timed_forward
    engine.Engine._prefill = timed_prefill


def model_seconds(path: str, start: float, end: float) -> tuple[float, int]:
    """(seconds, tokens) of the forward calls in `path` made while reading a prompt whose read started in
    [start, end] (time.monotonic())."""
    forwards, windows = [], []
    try:
        with open(path) as f:
            for line in f:
                kind, t0, dt, *rest = line.split()
                if kind == "F":
                    forwards.append((float(t0), float(dt), int(rest[0])))
                elif start <= float(t0) <= end:
                    windows.append((float(t0), float(t0) + float(dt)))
    except FileNotFoundError:
        pass
    s, n = 0.0, 0
    for t0, dt, k in forwards:
        if any(a <= t0 <= b for a, b in windows):
            s += dt
            n += k
    return s, n


if __name__ == "__main__":
    install(os.environ["STRATA_BENCH_CLOCK"])
    from strata.cli.serve import main
    sys.exit(main(sys.argv[1:]))
