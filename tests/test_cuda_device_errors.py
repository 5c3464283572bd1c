"""`--device` errors of the engine without a usable GPU (or with a bad device string): one-line ValueErrors."""
import pytest

from strata.backend import cuda as C


def _default_model():
    from strata.default_model import DefaultModelMissing, default_model_path
    try:
        default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))


def test_bad_device_index_is_a_clear_error():
    _default_model()
    from strata.engine import Engine
    with pytest.raises(ValueError, match="unknown device 'cuda:x'"):
        Engine("default", device="cuda:x")


@pytest.mark.skipif(C.unavailable_reason() is None, reason="a GPU is present: the unavailable path cannot run")
def test_cuda_without_gpu_is_a_one_line_error():
    _default_model()
    from strata.engine import Engine
    with pytest.raises(ValueError) as ei:
        Engine("default", device="cuda")
    msg = str(ei.value)
    assert "CUDA backend unavailable" in msg and "\n" not in msg


@pytest.mark.skipif(C.unavailable_reason() is not None, reason=f"CUDA backend unavailable: {C.unavailable_reason()}")
def test_missing_device_ordinal_is_a_clear_error():
    _default_model()
    from strata.engine import Engine
    with pytest.raises(ValueError, match="no CUDA device 99"):
        Engine("default", device="cuda:99")
