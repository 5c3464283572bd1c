"""Per-stage memory: page ids (pages.py), K/V page storage and page tables (kv.py), the Memory interface (memory.py)
and its attention, recurrent and hybrid fields (kv_memory.py, recurrent.py, hybrid.py), the sequence view a runner
reads (sequence_state.py), host copies and state hashes (host.py), state parts (part.py) and their byte format
(codec.py)."""
from strata.memory.codec import FormatError
from strata.memory.kv import DEFAULT_PAGE_SIZE, KVCacheFull, PagedKV, PagePool
from strata.memory.hybrid import HybridMemory
from strata.memory.kv_memory import KVMemory
from strata.memory.memory import Memory
from strata.memory.recurrent import RecurrentMemory
from strata.memory.sequence_state import SequenceState
from strata.memory.part import Carve, KVPages, PartMismatch, StatePart

__all__ = ["Carve", "DEFAULT_PAGE_SIZE", "FormatError", "HybridMemory", "KVCacheFull", "KVMemory", "KVPages",
           "Memory", "PagePool", "PagedKV", "PartMismatch", "RecurrentMemory", "SequenceState", "StatePart"]
