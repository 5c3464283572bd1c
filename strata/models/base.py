"""The Model base class, the architecture registry (MODEL_CLASSES) and load_model."""
from __future__ import annotations

import importlib
import importlib.util
import os
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar

import numpy as np

from strata.config import ModelConfig
from strata.gguf_file import GGUFModelFile, ModelLoadError, open_gguf, progress_bar
from strata.kv_cache import DEFAULT_PAGE_SIZE, PagedKV, PagePool
from strata.state import SequenceState

# arch -> class, filled by @register in each architecture's module
MODEL_CLASSES: dict[str, type["Model"]] = {}

# GGUF architecture name -> the module that defines it (imported on first use; one file per family)
ARCH_MODULES: dict[str, str] = {
    "llama": "strata.models.llama",
    "qwen3next": "strata.models.qwen3next",
    "qwen35": "strata.models.qwen3next",
    "qwen35moe": "strata.models.qwen3next",
}


def register(cls: type["Model"]) -> type["Model"]:
    """Class decorator: MODEL_CLASSES[cls.arch] = cls (and every name in cls.arch_aliases)."""
    MODEL_CLASSES[cls.arch] = cls
    for a in getattr(cls, "arch_aliases", ()):
        MODEL_CLASSES[a] = cls
    return cls


def supported_archs() -> list[str]:
    """Architecture names whose module is present in this installation."""
    out = set(MODEL_CLASSES)
    for arch, mod in ARCH_MODULES.items():
        if arch not in out and importlib.util.find_spec(mod) is not None:
            out.add(arch)
    return sorted(out)


def model_class(arch: str) -> type["Model"]:
    """The Model class for `arch`; ModelLoadError listing the supported ones otherwise."""
    if arch not in MODEL_CLASSES and arch in ARCH_MODULES and importlib.util.find_spec(ARCH_MODULES[arch]):
        importlib.import_module(ARCH_MODULES[arch])
    cls = MODEL_CLASSES.get(arch)
    if cls is None:
        raise ModelLoadError(f"unsupported architecture {arch!r} (supported: {', '.join(supported_archs())})")
    return cls


class Model(ABC):
    """One architecture's forward pass, written against Backend ops only (runs on CPU or CUDA).

    Subclasses set ``arch``, load and upload their weights in __init__ (through ``self.weight``), and implement
    ``forward``. ``attn_layers`` lists the layer indices with attention K/V (the PagePool's layers).
    """

    arch: ClassVar[str] = ""
    arch_aliases: ClassVar[tuple[str, ...]] = ()

    def __init__(self, f: GGUFModelFile, backend, progress: Callable[[int, int], None] | bool | None = None):
        self.file = f
        self.config: ModelConfig = f.config
        self.backend = backend
        self.attn_layers: list[int] = list(range(self.config.n_layer))
        self._progress = progress
        self._bar = None
        self._loaded = 0

    # --- loading -----------------------------------------------------------------------------------
    def weight(self, name: str, shape: tuple | None = None, optional: bool = False) -> Any:
        """Check tensor `name` against `shape` (numpy order) and upload it to the backend.

        Returns None for a missing optional tensor; raises ModelLoadError naming the tensor and the expected
        shape otherwise.
        """
        if optional and not self.file.has(name):
            return None
        return self.upload_tensor(self.file.tensor(name, shape))

    def upload_tensor(self, t) -> Any:
        """Upload a WeightTensor (from the file, or built from file tensors) and advance the progress bar."""
        if self._bar is None:
            self._bar = progress_bar(self.file.nbytes, f"loading {os.path.basename(self.file.path)} "
                                     f"to {self.backend.name}", self._progress)
        out = self.backend.upload(t)
        n = min(t.nbytes, self.file.nbytes - self._loaded)
        self._loaded += n
        self._bar[0](n)
        return out

    def _done_loading(self) -> None:
        if self._bar is not None:
            self._bar[0](self.file.nbytes - self._loaded)  # tensors this architecture does not use
            self._loaded = self.file.nbytes
            self._bar[1]()
            self._bar = None

    # --- sequences ---------------------------------------------------------------------------------
    def new_page_pool(self, n_ctx: int, n_seq: int = 1, page_size: int = DEFAULT_PAGE_SIZE) -> PagePool:
        """A PagePool with room for n_seq sequences of n_ctx tokens each (rounded up to whole pages)."""
        c = self.config
        n_pages = n_seq * max(1, -(-int(n_ctx) // page_size))
        return self.backend.new_page_pool(self.attn_layers, n_pages, c.n_head_kv, c.head_dim, page_size=page_size,
                                          head_dim_v=c.extra.get("head_dim_v"))

    def new_running_state(self) -> dict[int, dict[str, Any]]:
        """Zeroed running state of the recurrent layers (none for attention-only models)."""
        return {}

    def new_state(self, pool: PagePool) -> SequenceState:
        """An empty sequence with its own page table over `pool`."""
        return SequenceState(PagedKV(pool), self.new_running_state())

    @abstractmethod
    def forward(self, tokens: np.ndarray, state: SequenceState, all_logits: bool = False) -> np.ndarray:
        """Read `tokens` (int32 (n_tokens,)) at state.pos. Returns float32 logits (n_vocab,) of the last token,
        or (n_tokens, n_vocab) with all_logits. Advances state.pos, state.tokens and the KV length."""


def load_model(path_or_file: str | os.PathLike | GGUFModelFile, backend=None,
               progress: Callable[[int, int], None] | bool | None = None) -> Model:
    """Open a GGUF (or take an opened one) and build its architecture's Model on `backend` (default: CPU).

    Raises ModelLoadError (one line) for any unusable file.
    """
    f = path_or_file if isinstance(path_or_file, GGUFModelFile) else open_gguf(path_or_file)
    if backend is None:
        from strata.backend.cpu import CPUBackend
        backend = CPUBackend()
    cls = model_class(f.arch)
    return cls(f, backend, progress=progress)
