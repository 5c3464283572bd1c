"""Skip marks shared by the CUDA test files: `gpu` (CuPy, a GPU and the kernel library) and the default model."""
from __future__ import annotations

import pytest

from strata.backend import cuda as C

CUDA_WHY = C.unavailable_reason()
gpu = pytest.mark.skipif(CUDA_WHY is not None, reason=f"CUDA backend unavailable: {CUDA_WHY}")


def default_model_missing() -> str | None:
    """The synthetic models copy the default model's tokenizer: why it cannot be read, or None."""
    from strata.default_model import default_model_path
    try:
        p = default_model_path()
    except Exception as e:  # noqa: BLE001  (DefaultModelMissing, an unreadable package)
        return str(e)
    return None if p.is_file() else f"default model not at {p}"
