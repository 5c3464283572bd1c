"""What the engine reports of itself: its status for `stratactl status` / GET /status (model, stages, KV pages,
the live sequence, checkpoints, parking, memory) and the "device" object of /status."""
from __future__ import annotations

import os
from typing import Any

from strata.memory.pinned import host_bytes, pinned_bytes


def engine_status(engine, busy: bool) -> dict[str, Any]:
    """Engine status for `stratactl status` (JSON-ready): model, arch, n_ctx, the stages (carve, device, runner,
    memory), KV pages used/total over all stages (and held by checkpoints and conversations parked resident), the live sequence's
    position and state bytes, checkpoints, cache counters, memory in bytes; busy: whether a request runs now."""
    cps = engine.checkpoints()
    stages = [st.status() for st in engine.stages]
    kvs = [m for s in stages for k, m in s["memory"].items() if k in ("kv", "draft")]
    main_kv = [s["memory"]["kv"] for s in stages if "kv" in s["memory"]]
    res = engine.store.resident
    return {
        "model": engine.model_name, "path": engine.model_path, "arch": engine.arch, "device": engine.device,
        "kv": engine.kv, "n_ctx": engine.n_ctx, "ubatch": engine.ubatch, "threads": engine.threads,
        "n_vocab": engine.n_vocab,
        "n_layer": engine.config.n_layer,
        "warmup": engine.warmup,
        "stages": stages,
        "pos": engine.seq.pos,
        "kv_pages": {"used": sum(m["pages_used"] for m in main_kv), "total": sum(m["pages_total"] for m in main_kv),
                     "held": sum(m.get("pages_held", 0) for m in main_kv),
                     "page_size": main_kv[0]["page_size"] if main_kv else 0},
        "state_bytes": int(engine.seq.nbytes()),
        "prompt_cache": engine.prompt_cache,
        "checkpoints": cps,
        "checkpoint_bytes": int(sum(int(c.get("bytes", 0) or 0) for c in cps)),
        "cache_stats": engine.cache.stats(),
        "parked": engine.parked(),
        "park_stats": dict(engine.park.stats) if engine.park is not None else None,
        "resident_stats": dict(res.stats) if res is not None else None,
        "disk_stats": engine.disk.status() if engine.disk is not None else None,
        "conversation_cache_bytes": engine.park.budget if engine.park is not None else 0,
        "session_files": engine.store.files.usage(),
        "memory": {"weights_bytes": int(engine.file.nbytes), "kv_pool_bytes": int(sum(m["bytes"] for m in kvs)),
                   "rss_bytes": _rss_bytes(), "pinned_host_bytes": pinned_bytes(),
                   "park_host_bytes": host_bytes()},
        "requests": engine.requests,
        "spec": dict(n=engine.spec, draft=engine.spec_draft, **spec_totals(engine.spec_totals)),
        "busy": busy,
        "parallel": engine.parallel,
        "step_stats": dict(engine.scheduler.stats),
        "load_ms": round(engine.load_ms, 1),
    }


def spec_totals(c) -> dict[str, Any]:
    """Speculative decoding since the start (a SpecCounts): drafted, accepted, verifies, acceptance rate, mean
    tokens per verify."""
    return {"drafted": c.drafted, "accepted": c.accepted, "verifies": c.verifies,
            "acceptance_rate": round(c.acceptance, 4), "mean_accepted": round(c.mean_accepted, 4)}


def device_info(engine) -> dict[str, Any]:
    """The "device" object of /status: name (the devices, comma-joined), kind ("cpu", "cuda", or "cuda+cpu" for GPU
    stages beside CPU ones), the model's weight bytes (GGUF
    tensor bytes), the KV cache type ("f32" on the CPU, "f16" / "q8_0" on CUDA), the KV page pools' bytes
    (allocated; in pages held) and the live sequence's state bytes (its valid K/V positions and, for hybrid
    models, its running state: kv_valid_bytes), over all stages; on CUDA also each
    device's total / free / used bytes (cudaMemGetInfo) and CuPy's memory pool used / total bytes, summed over
    the distinct devices; for an MoE model ``moe``: the paths its stages' MoE layers take ({"decode": "graph" |
    "generic", "prefill": "grouped" | "generic"}, comma-joined where stages differ)."""
    names = list(dict.fromkeys(st.device for st in engine.stages))
    kinds = sorted({"cuda" if n.startswith("cuda") else "cpu" for n in names if n == "cpu" or n.startswith("cuda")},
                   reverse=True) or [names[0]]
    d: dict[str, Any] = {"name": ",".join(names), "kind": "+".join(kinds),
                         "weights_bytes": int(engine.file.nbytes), "kv": engine.kv}
    sts = [st.status() for st in engine.stages]
    moes = [s["moe"] for s in sts if "moe" in s]
    if moes:
        d["moe"] = {k: ",".join(dict.fromkeys(m[k] for m in moes)) for k in ("decode", "prefill")}
    mems = [s["memory"] for s in sts]
    kvs = [m[k] for m in mems for k in ("kv", "draft") if k in m]
    d["kv_pool_bytes"] = int(sum(k["bytes"] for k in kvs))
    d["kv_used_bytes"] = int(sum(k["bytes"] * k["pages_used"] // max(1, k["pages_total"]) for k in kvs))
    d["kv_valid_bytes"] = int(engine.seq.nbytes() - 4 * engine.seq.pos)
    seen: set[str] = set()
    for st in engine.stages:
        if st.device in seen:
            continue
        seen.add(st.device)
        try:
            info = st.memory_info()
        except Exception as e:  # noqa: BLE001 -- a status read must not fail the route
            d["error"] = f"{type(e).__name__}: {e}"
            continue
        for k, v in info.items():
            d[k] = int(d.get(k, 0)) + int(v)
    if "device_total_bytes" in d and "device_free_bytes" in d:
        d["device_used_bytes"] = int(d["device_total_bytes"]) - int(d["device_free_bytes"])
    return d


def _rss_bytes() -> int | None:
    """This process's resident set size in bytes (/proc/self/statm), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
