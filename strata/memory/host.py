"""State arrays (numpy or CuPy) on the host: views and pinned copies of them, and the sha256 state hashes taken over
them (per layer, then per field) with their log line's fields (STRATA_STATE_HASH)."""
from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np


def host_view(a: Any) -> np.ndarray:
    """A numpy array of a numpy or CuPy array (a view where it can be)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def host_copy(a: Any) -> np.ndarray:
    """A C-contiguous host copy of a numpy or CuPy array, in the process's host arena (strata.memory.pinned): a CuPy
    array in pinned (page-locked) memory, so parking moves state at the bus's copy bandwidth without pinning fresh
    pages each time and the copy back to the device is a direct DMA; a numpy array in memory already paged in."""
    from strata.memory.pinned import arena
    if isinstance(a, np.ndarray) or not hasattr(a, "get"):
        a = np.asarray(a)
        out = arena("cpu").empty(a.shape, a.dtype)
        out[...] = a
        return out
    import cupy
    a = cupy.ascontiguousarray(a)
    out = arena("cuda").empty(a.shape, a.dtype)
    a.get(out=out)
    return out


def sha_arrays(*arrays) -> str:
    """sha256 over the arrays' bytes (C order, read on the host), in order."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(host_view(a)).tobytes())
    return h.hexdigest()


def state_hash_logging() -> bool:
    """STRATA_STATE_HASH set (not "", "0", "false", "no"): the main logs its sequence's state hashes after each
    request, a worker its carve's at each Commit (the main posts one at the request's end)."""
    return os.environ.get("STRATA_STATE_HASH", "") not in ("", "0", "false", "no")


def hash_log_fields(hashes: dict[str, str]) -> dict[str, str]:
    """A state_hash log line's fields from per-layer hashes (with_field_hashes' form): ``layers`` "[lo, hi)", the
    layers hashed; each field's hash over them ("kv", full); each layer's ("kv.L3", its first 16 hex digits), so a
    run split over stages or workers can be compared layer by layer with an unsplit one."""
    idx = sorted({int(k.split(".L")[1]) for k in hashes if ".L" in k})
    out: dict[str, str] = {"layers": f"[{idx[0]}, {idx[-1] + 1})" if idx else "[]"}
    out.update({k: v for k, v in hashes.items() if ".L" not in k and k != "tokens"})
    for k in sorted((k for k in hashes if ".L" in k), key=lambda k: (int(k.split(".L")[1]), k)):
        out[k] = hashes[k][:16]
    return out


def with_field_hashes(per_layer: dict[str, str]) -> dict[str, str]:
    """Per-layer hashes ("kv.L3", "running.L0", ...) plus one hash per field over its layers in layer order ("kv",
    "running", "draft"): a split and an unsplit model give the same keys and values."""
    out = dict(per_layer)
    for name in ("kv", "running", "draft"):
        keys = sorted((k for k in per_layer if k.startswith(name + ".L")), key=lambda k: int(k.split(".L")[1]))
        if keys:
            out[name] = hashlib.sha256("".join(per_layer[k] for k in keys).encode()).hexdigest()
    return out

