"""TurnClock (strata/engine/turn_clock.py): phases charged on the thread a clock is active on, nested phases counted
once, the engine's charges ended by its first event, and a report whose phases and `other` add up to its total."""
from __future__ import annotations

import threading
import time

import pytest

from strata.engine import turn_clock as T


def test_nested_phases_count_once_and_the_report_adds_up():
    clock = T.TurnClock()
    with T.active(clock):
        with T.phase("render"):
            time.sleep(0.002)
            with T.phase("tokenize"):
                time.sleep(0.002)
            T.charge("tokenize", 0.0005)          # measured by the caller: taken out of render as well
        with T.phase("model"):
            time.sleep(0.001)
    assert T.current() is None                    # the block's end leaves no clock active
    clock.first_token()
    r = clock.report()
    ph = r["phases_ms"]
    assert set(ph) == set(T.PHASES)
    assert ph["tokenize"] > 0.5 and ph["render"] > 0 and ph["model"] > 0
    wall = r["ms"]
    assert ph["render"] + ph["tokenize"] + ph["model"] <= wall + 0.01      # nothing counted twice
    assert abs(sum(ph.values()) + r["other_ms"] - wall) < 0.01
    assert abs(r["outside_model_ms"] - (wall - ph["model"])) < 0.01


def test_engine_charges_end_at_its_first_event_and_the_clock_at_the_first_token():
    clock = T.TurnClock()
    clock.add("plan", 0.001)
    clock.engine_done()
    clock.add("model", 5.0)                       # the next token's forward: not this turn's
    time.sleep(0.001)
    clock.first_token()
    clock.add("write", 5.0)                       # after the first token: ignored
    r = clock.report()
    assert r["phases_ms"]["model"] == 0 and r["phases_ms"]["plan"] == 1.0
    assert 0 < r["phases_ms"]["write"] <= r["ms"]
    assert clock.report() == r                    # stopped


def test_no_active_clock_charges_nothing_and_bad_phases_are_refused():
    with T.phase("render"):                       # no clock: a no-op
        T.charge("model", 1.0)
    clock = T.TurnClock()
    with pytest.raises(KeyError, match="unknown phase 'bogus'"):
        clock.add("bogus", 1.0)
    assert clock.report() is None                 # no first token yet

    seen = []

    def other_thread():                           # a clock is active on its own thread only
        seen.append(T.current())

    with T.active(clock):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert T.current() is clock
    assert seen == [None]


def test_a_prompt_read_beside_another_slot_charges_their_reads_to_slots(default_model_path):
    """With two request slots reading prompts in the same engine steps, each request's clock holds the other's reads
    as `slots` (the model's time, so not in outside_model_ms), not as `other`."""
    from strata.engine import Engine, FinalEvent, GenerationRequest
    e = Engine(default_model_path, n_ctx=256, device="cpu", parallel=2)
    try:
        clocks, done = [T.TurnClock(), T.TurnClock()], []
        for i, text in enumerate(("The capital of France is", "Once upon a time, in a land far away,")):
            def on_event(ev, c=clocks[i]):
                c.engine_done()
                c.first_token()
            req = GenerationRequest(e.tokenize_prompt(text), max_tokens=2, clock=clocks[i])
            assert e.admit(req, on_event, done.append) == i
        while e.step():
            pass
        assert done == [None, None]
        for c in clocks:
            r = c.report()
            assert r["phases_ms"]["slots"] > 0 and r["phases_ms"]["model"] > 0
            assert abs(r["outside_model_ms"] - (r["ms"] - r["phases_ms"]["model"] - r["phases_ms"]["slots"])) < 0.01
    finally:
        e.close()
