"""Warm-up: the shapes a request will use (prompt reads of each length class, decode steps, greedy and sampled
choices) run once before the engine serves, and forgotten, so the first request costs what a later one does; on a
GPU it also measures each plan's crossover between the short read and the prefill (the plans keep it). The CPU has
no shapes to prepare: one short read touches every weight, and a whole ubatch is read on a GPU only."""
from __future__ import annotations

import dataclasses
import time

import structlog

from strata.engine.types import GenerationRequest
from strata.sampling.sampler import SamplingParams

log = structlog.get_logger("strata.engine")

#: prompt lengths a warm-up reads, besides a whole ubatch: the short reads a later turn, a verify or a decode
#: step of several slots are made of (each a graph bucket or a launch shape of its own on a GPU)
GPU_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CPU_LENGTHS = (8,)
DECODE_TOKENS = 4


def _device_bytes(engine) -> int | None:
    """Bytes the CUDA memory pools of the engine's devices hold now, or None without a GPU stage."""
    devices = sorted({int(str(st.device).split(":")[1]) for st in engine.stages if str(st.device).startswith("cuda:")})
    if not devices:
        return None
    import cupy
    total = 0
    for d in devices:
        with cupy.cuda.Device(d):
            total += int(cupy.get_default_memory_pool().total_bytes())
    return total


def _short_read_crossovers(engine) -> dict:
    """{stage index: n}: the crossover each stage's runner measured on the live sequence (at position 0, left
    there), the largest prompt read that takes its short read rather than its prefill; stages whose runner has no
    such choice are left out."""
    out = {}
    with engine._lock:
        for i, (st, sid) in enumerate(zip(engine.stages, engine.seq.sids)):
            measure = getattr(getattr(st, "runner", None), "measure_short_read", None)
            if measure is None:          # the CPU's runner, a remote stage
                continue
            n = measure(st.memory.seq(sid))   # on the plan's own device (PlanModel.measure_short_read)
            if n is not None:
                out[i] = n
    return out


def warm_up(engine) -> dict:
    """Run the warm-up on `engine` (under its lock, as a request would) and leave nothing of it behind: the live
    sequence at position 0, no checkpoint, nothing parked, the request count, the task ids and each slot's last use and
    draft counts as they were (the first request takes the slot it would have taken without a warm-up; the engine's
    own draft totals, /status' spec, do count the warm-up's). Returns what /status
    reports: {"ms", "reads" (the prompt lengths read), "device_bytes" (what the GPU memory pools grew by, None on
    the CPU), "short_read" ({stage index: the crossover its plan measured}, empty on the CPU)}."""
    t0 = time.perf_counter()
    on_gpu = any(str(st.device).startswith("cuda") for st in engine.stages)
    cap = engine.n_ctx - DECODE_TOKENS - 1
    whole = (min(engine.ubatch, cap),) if on_gpu else ()
    lengths = sorted({n for n in (*(GPU_LENGTHS if on_gpu else CPU_LENGTHS), *whole) if 0 < n <= cap})
    ids = list(engine.tokenizer.encode("Strata reads this text once before it serves, so that no request pays "
                                       "for the first use of a shape. " * 8))
    if not ids or not lengths:
        return {"ms": 0.0, "reads": [], "device_bytes": None, "short_read": {}}
    before = _device_bytes(engine)
    requests, last_final, steps = engine.requests, engine.last_final, dict(engine.scheduler.stats)
    tasks = engine.scheduler.tasks
    slots = [(s.last_used, s.task, dataclasses.replace(s.spec)) for s in engine.scheduler.slots]
    greedy = SamplingParams()
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=0)
    try:
        for k, n in enumerate(lengths):
            prompt = (ids * (n // len(ids) + 1))[:n]
            req = GenerationRequest(prompt_tokens=prompt, cut_points=[], max_tokens=DECODE_TOKENS,
                                    sampling=sampled if k == len(lengths) - 1 else greedy, cache_prompt=False,
                                    checkpoint=False, ignore_eos=True, id_slot=0)
            for _ in engine.generate(req):
                pass
            with engine._lock:
                engine.state_reset()
        crossovers = _short_read_crossovers(engine) if on_gpu else {}
    finally:
        with engine._lock:
            engine.state_reset()
            engine.clear_checkpoints()
            engine.seq.trim()
        engine.requests, engine.last_final = requests, last_final
        engine.scheduler.stats.update(steps)
        engine.scheduler.tasks = tasks
        for s, (last_used, task, spec) in zip(engine.scheduler.slots, slots):
            s.last_used, s.task, s.spec = last_used, task, spec
    after = _device_bytes(engine)
    out = {"ms": round((time.perf_counter() - t0) * 1000.0, 1), "reads": lengths,
           "device_bytes": None if before is None else max(0, after - before), "short_read": crossovers}
    log.info("warm-up done", **out)
    return out
