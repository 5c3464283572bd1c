"""The garbage collector's pauses: counted process-wide (gc.callbacks: seconds and collections per generation), and
the heap built at start (the model, the tokenizer, the template, the libraries) frozen out of later collections."""
from __future__ import annotations

import gc
import time

__all__ = ["freeze_heap", "install", "seconds", "stats"]

_t0 = [0.0]
_seconds = [0.0, 0.0, 0.0]      # per generation
_count = [0, 0, 0]
_longest = [0.0]


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        _t0[0] = time.perf_counter()
        return
    dt = time.perf_counter() - _t0[0]
    g = min(int(info.get("generation", 0)), 2)
    _seconds[g] += dt
    _count[g] += 1
    if dt > _longest[0]:
        _longest[0] = dt


def install() -> None:
    """Count the collector's pauses from now on (once per process; a second call does nothing)."""
    if _callback not in gc.callbacks:
        gc.callbacks.append(_callback)


def seconds() -> float:
    """Seconds the collector has paused the process since install() (every generation); a request's clock takes
    the difference over its turn."""
    return _seconds[0] + _seconds[1] + _seconds[2]


def stats() -> dict:
    """{"seconds": [per generation], "collections": [per generation], "longest_ms": the longest pause,
    "frozen": objects moved out of collection by freeze_heap}."""
    return {"seconds": [round(s, 6) for s in _seconds], "collections": list(_count),
            "longest_ms": round(_longest[0] * 1e3, 3), "frozen": gc.get_freeze_count()}


#: young objects (net allocations of tracked containers) between collections: a request over a long chat holds a
#: few thousand at once (its JSON body, its messages, the render's lists), which at Python's 700 set off two or three
#: collections inside every turn; most of them are freed when the request ends, so at this size a collection comes
#: every few hundred turns and walks what those turns kept
YOUNG_THRESHOLD = 20000


def freeze_heap() -> int:
    """Collect once, then move every object alive now into the permanent generation (gc.freeze): what the start
    built is never traversed again, so a full collection during a request costs what the requests keep, not the
    whole daemon; and collect the young generation every YOUNG_THRESHOLD objects instead of 700. Returns the number
    of objects frozen."""
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, g1, g2)
    return gc.get_freeze_count()
