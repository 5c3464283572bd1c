#!/usr/bin/env python3
"""Run `strata serve` with every Sequence.forward timed: one line "monotonic_start seconds tokens" per call, to $STRATA_BENCH_CLOCK.

bench/prompt_cache.py --e2e starts the daemon through this file, so the time to first token a client sees can be
split into the model's forward calls (the lines whose start falls between the request and its first token) and
everything else (HTTP, JSON, rendering and tokenizing, planning, checkpoints, sampling). time.monotonic() is one
clock for every process of the machine (CLOCK_MONOTONIC), so the bench compares it with its own. On the CPU a
forward call is synchronous; on a GPU it returns once its work is queued, so there the lines undercount.

Usage: STRATA_BENCH_CLOCK=/tmp/clock PYTHONPATH=. python bench/model_clock.py [strata serve flags]
"""
from __future__ import annotations

import os
import sys
import time


_out = []          # the file the timed forward writes to (installed once per process, the file may change)


def install(path: str) -> None:
    """Time every Sequence.forward of this process into `path` (appended, a line per call) from now on."""
    from strata.stages import sequence
    if _out:
        _out[0].close()
        _out[0] = open(path, "a", buffering=1)
        return
    _out.append(open(path, "a", buffering=1))
    forward = sequence.Sequence.forward

    def timed(self, tokens, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return forward(self, tokens, *args, **kwargs)
        finally:
            _out[0].write(f"{t0:.6f} {time.monotonic() - t0:.6f} {len(tokens)}\n")

    sequence.Sequence.forward = timed


def model_seconds(path: str, start: float, end: float) -> tuple[float, int]:
    """(seconds, tokens) of the forward calls in `path` that started in [start, end] (time.monotonic())."""
    s, n = 0.0, 0
    try:
        with open(path) as f:
            for line in f:
                t0, dt, k = line.split()
                if start <= float(t0) <= end:
                    s += float(dt)
                    n += int(k)
    except FileNotFoundError:
        pass
    return s, n


if __name__ == "__main__":
    install(os.environ["STRATA_BENCH_CLOCK"])
    from strata.serve.cli import main
    sys.exit(main(sys.argv[1:]))
