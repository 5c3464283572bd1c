"""Which Model class reads each GGUF architecture, and load_model (a file to a Model on a backend)."""
from __future__ import annotations

import os
from typing import Callable

from strata.gguf.file import GGUFModelFile, ModelLoadError, open_gguf
from strata.models.base import Model

#: GGUF architecture name -> the family that reads it (one module per family, imported on first use)
ARCHS = {"llama": "llama", "qwen3next": "qwen3next", "qwen35": "qwen3next", "qwen35moe": "qwen3next",
         "nemotron_h": "nemotron_h"}


def supported_archs() -> list[str]:
    """The architecture names Strata reads."""
    return sorted(ARCHS)


def model_class(arch: str) -> type[Model]:
    """The Model class for `arch`; ModelLoadError listing the supported ones otherwise."""
    family = ARCHS.get(arch)
    if family == "llama":
        from strata.models.llama import LlamaModel
        return LlamaModel
    if family == "qwen3next":
        from strata.models.qwen3next import Qwen3NextModel
        return Qwen3NextModel
    if family == "nemotron_h":
        from strata.models.nemotron_h import NemotronHModel
        return NemotronHModel
    raise ModelLoadError(f"unsupported architecture {arch!r} (supported: {', '.join(supported_archs())})")


def load_model(path_or_file: str | os.PathLike | GGUFModelFile, backend=None,
               progress: Callable[[int, int], None] | bool | None = None, layers: range | None = None) -> Model:
    """Open a GGUF (or take an opened one) and build its architecture's Model on `backend` (default: CPU), with
    blocks `layers` only (default: all).

    Raises ModelLoadError (one line) for any unusable file.
    """
    f = path_or_file if isinstance(path_or_file, GGUFModelFile) else open_gguf(path_or_file, archs=supported_archs())
    if backend is None:
        from strata.backend.cpu import CPUBackend
        backend = CPUBackend()
    cls = model_class(f.arch)
    return cls(f, backend, progress=progress, layers=layers)
