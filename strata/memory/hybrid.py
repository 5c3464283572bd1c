"""HybridMemory: several fields of one stage together (KV pages, running state, the drafter's K/V), each Memory hook
run on its children in order."""
from __future__ import annotations

from strata.memory.memory import Memory
from strata.memory.part import Carve


def _each(hook: str):
    """The hook `hook` of a HybridMemory: the same hook of each child, in order."""
    def run(self, *args) -> None:
        for c in self.children:
            getattr(c, hook)(*args)
    run.__name__ = run.__qualname__ = hook
    return run


class HybridMemory(Memory):
    """Several fields of one stage together (llama-memory-hybrid): e.g. KV pages of the attention layers, the
    running state of the recurrent ones, the drafter's K/V. Every operation runs each child's hook in order, and
    every check of every child before any child writes."""

    def __init__(self, carve: Carve, children: list[Memory], identity: dict | None = None):
        super().__init__(carve, identity)
        names = [type(c).__name__ + ":" + getattr(c, "name", "running") for c in children]
        if len(set(names)) != len(names):
            raise ValueError(f"a hybrid memory holds each field once, got {names}")
        self.children = children

    _open = _each("_open")
    _close = _each("_close")
    _check_truncate = _each("_check_truncate")
    _truncate = _each("_truncate")
    _reset = _each("_reset")
    _geometry = _each("_geometry")
    _capture = _each("_capture")
    _check = _each("_check")
    _restore = _each("_restore")
    _materialize = _each("_materialize")
    _expect = _each("_expect")
    _attach = _each("_attach")
    _hold = _each("_hold")
    _hashes = _each("_hashes")
    _stats = _each("_stats")

    def _nbytes(self, st):
        return sum(c._nbytes(st) for c in self.children)
