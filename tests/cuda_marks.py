"""Shared by the CUDA test files: the skip marks (`gpu`: CuPy, a GPU and the kernel library; the default model),
rel_l2, host(), the near-tie rule for greedy runs against a reference, and the conversation the stage tests compare
(one GPU against a split, one GPU against two)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from strata.backend import cuda as C
from tests.helpers import ask

CUDA_WHY = C.unavailable_reason()
gpu = pytest.mark.skipif(CUDA_WHY is not None, reason=f"CUDA backend unavailable: {CUDA_WHY}")

# Decode matvecs round the activations to int8 blocks (as llama.cpp's q8_1): a greedy run may leave the
# reference's only at a near tie, where the reference's own logits of the two tokens differ by less than this.
NEAR_TIE_LOGIT = 0.25


def default_model_missing() -> str | None:
    """The synthetic models copy the default model's tokenizer: why it cannot be read, or None."""
    from strata.gguf.default_model import default_model_path
    try:
        p = default_model_path()
    except Exception as e:  # noqa: BLE001  (DefaultModelMissing, an unreadable package)
        return str(e)
    return None if p.is_file() else f"default model not at {p}"


def rel_l2(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def host(a):
    """A CuPy array's host copy (numpy arrays and others through np.asarray)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def assert_parts_at_near_tie(got: list[int], ref: list[int], ref_logits_after, near_tie: float) -> None:
    """got == ref (greedy token lists of one length), or at their first difference i the reference backend ranks
    ref[i] above got[i] by less than near_tie logits. ref_logits_after(prefix) -> the reference's logits after the
    prompt followed by the token list prefix (ref[:i])."""
    if got == ref:
        return
    i = next(i for i in range(len(ref)) if got[i] != ref[i])
    lr = ref_logits_after(ref[:i])
    gap = float(lr[ref[i]] - lr[got[i]])
    print(f"greedy runs part at token {i}: {got[i]} vs CPU {ref[i]}, CPU logit gap {gap:.3f}")
    assert gap < near_tie, f"token {i}: {got[i]} vs {ref[i]} is not a near tie (gap {gap:.3f})"


CHAT = [{"role": "system", "content": "You are a terse assistant who answers in one line."},
        {"role": "user", "content": "Name a river in France and say where it flows."}]
greedy = functools.partial(ask, n=24)


def conversation(engine):
    """CHAT read cold, then sent again (resumed: cut back on an attention-only model, else from a checkpoint):
    [(tokens, state hashes)] per request."""
    engine.clear_checkpoints()
    engine.state_reset()
    t1, f1 = greedy(engine, CHAT)
    h1 = engine.state_hashes()
    t2, f2 = greedy(engine, CHAT)
    h2 = engine.state_hashes()
    again = "live" if engine.arch == "llama" else "checkpoint"     # attention-only: cut back to the common prefix
    assert (f1.strata["resume_from"], f2.strata["resume_from"]) == ("none", again)
    return [(t1, h1), (t2, h2)]
