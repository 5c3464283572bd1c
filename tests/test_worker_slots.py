"""The engine thread with several request slots: every job's events of one engine step reach the event loop in one
hop (one call_soon_threadsafe per step, not per token), each job's in order."""
from __future__ import annotations

import asyncio
import threading

from strata.engine.types import FinalEvent, GenerationRequest, TokenEvent
from strata.serve.metrics import Metrics
from strata.serve.worker import EngineWorker

STEPS = 5


class _Scheduler:
    def __init__(self):
        self.runs: dict[int, list] = {}

    def cancel_all(self, error):
        raise AssertionError(f"a step failed: {error!r}")

    @property
    def busy(self) -> int:
        return len(self.runs)


class _SlotEngine:
    """Two slots; each step emits one token to every running request, its FinalEvent after STEPS tokens."""
    parallel = 2

    def __init__(self):
        self.scheduler = _Scheduler()
        self.steps = 0

    def admit(self, req, on_event, on_done):
        free = [i for i in range(self.parallel) if i not in self.scheduler.runs]
        if not free:
            return None
        self.scheduler.runs[free[0]] = [on_event, on_done, 0]
        return free[0]

    def step(self) -> int:
        runs = self.scheduler.runs
        if not runs:
            return 0
        self.steps += 1
        for i, run in sorted(runs.items()):
            on_event, on_done, n = run
            on_event(TokenEvent(100 * i + n, f"t{n}", None, None))
            run[2] = n + 1
            if run[2] == STEPS:
                del runs[i]
                on_event(FinalEvent(finish_reason="length", usage={}, timings={}, strata={}))
                on_done(None)
        return len(runs) or 1


def test_one_loop_hop_per_step():
    async def main():
        loop = asyncio.get_running_loop()
        hops = []
        real = loop.call_soon_threadsafe

        def counted(cb, *args):
            if threading.current_thread().name == "strata-engine":
                hops.append(cb)
            return real(cb, *args)
        loop.call_soon_threadsafe = counted
        engine = _SlotEngine()
        w = EngineWorker(lambda: engine, queue_max=4, metrics=Metrics(), loop=loop)
        w.start()
        await w.loaded
        hops.clear()
        jobs = [w.submit(GenerationRequest(prompt_tokens=[1], max_tokens=STEPS)) for _ in range(2)]
        got = {0: [], 1: []}
        for k, job in enumerate(jobs):
            while True:
                ev = await asyncio.wait_for(job.events.get(), 10)
                got[k].append(ev)
                if isinstance(ev, FinalEvent):
                    break
        w.stop(5)
        return got, len(hops), engine.steps

    got, hops, steps = asyncio.run(main())
    for k in (0, 1):
        toks = [ev.token_id % 100 for ev in got[k][:-1]]
        assert toks == list(range(STEPS)) and isinstance(got[k][-1], FinalEvent)
    # 2 * STEPS tokens and 2 finals carried in at most one hop per step (STEPS, one more if the second job came a
    # step late)
    assert hops <= steps < 2 * STEPS + 2
