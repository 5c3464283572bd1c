"""HybridMemory: several fields of one stage together (KV pages, running state, the drafter's K/V), each Memory verb
run over its fields in order."""
from __future__ import annotations

from strata.memory.memory import Field, Memory
from strata.memory.part import Carve


class HybridMemory(Memory):
    """Several fields of one stage together (llama-memory-hybrid): e.g. KV pages of the attention layers, the
    running state of the recurrent ones, the drafter's K/V. Every verb runs each field's hook in order, and every
    check of every field before any field writes (Memory). backend: see Memory."""

    def __init__(self, carve: Carve, children: list[Field], identity: dict | None = None, backend=None):
        names = [type(c).__name__ + ":" + getattr(c, "name", "running") for c in children]
        if len(set(names)) != len(names):
            raise ValueError(f"a hybrid memory holds each field once, got {names}")
        super().__init__(carve, identity, backend, fields=children)
        self.children = children
