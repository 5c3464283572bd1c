"""The GPU profiles' shared pieces: a call's CUDA trace events from torch.profiler (CUPTI), and kernel names
without their template arguments."""
from __future__ import annotations

import json
import os
import re
import tempfile


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and parameter list (k_mvc_q8w<3, true> -> k_mvc_q8w)."""
    name = re.sub(r"^void ", "", name)
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip() or name


def trace_events(run, cpu: bool = False) -> list[dict] | None:
    """The chrome-trace events of run() under torch.profiler (CUDA activity, and the host's runtime calls and
    annotations with `cpu`), after a device synchronize; None without torch."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception:                                     # noqa: BLE001 - no torch: the callers' fallback
        return None
    torch.cuda.init()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cpu else [ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    try:
        return json.load(open(path)).get("traceEvents", [])
    finally:
        os.unlink(path)
