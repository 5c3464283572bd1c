"""Per-stage memory: page ids (pages.py), K/V page storage and page tables (kv.py), the Memory interface for
attention, recurrent and hybrid stages (memory.py), state parts (part.py) and their byte format (codec.py)."""
from strata.memory.codec import FormatError
from strata.memory.kv import DEFAULT_PAGE_SIZE, KVCacheFull, PagedKV, PagePool
from strata.memory.memory import HybridMemory, KVMemory, Memory, RecurrentMemory, SequenceState
from strata.memory.part import Carve, KVPages, PartMismatch, StatePart

__all__ = ["Carve", "DEFAULT_PAGE_SIZE", "FormatError", "HybridMemory", "KVCacheFull", "KVMemory", "KVPages",
           "Memory", "PagePool", "PagedKV", "PartMismatch", "RecurrentMemory", "SequenceState", "StatePart"]
