"""`--device` errors of the engine without a usable GPU (or with a bad device string): one-line ValueErrors."""
import pytest

from strata.backend import cuda as C


def _default_model():
    from strata.gguf.default_model import DefaultModelMissing, default_model_path
    try:
        default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))


def test_bad_device_index_is_a_clear_error():
    _default_model()
    from strata.engine import Engine
    for bad in ("cuda:x", "cudafoo", "cuda:-1", "gpu", "cuda:"):
        with pytest.raises(ValueError, match=f"unknown device '{bad}'"):
            Engine("default", device=bad)


def test_parse_devices():
    from strata.stages.split import parse_devices
    assert parse_devices("cpu") == ["cpu"] and parse_devices("cuda") == ["cuda:0"]
    assert parse_devices("cuda:3") == ["cuda:3"] and parse_devices("cuda:0,cuda:1") == ["cuda:0", "cuda:1"]
    for bad in ("cuda1", "cuda:\u00b2", "cuda:\u0663"):       # unicode digits are not device ordinals
        with pytest.raises(ValueError, match="use 'cpu', 'cuda\\[:N\\]' or a comma list of them"):
            parse_devices(bad)


def _serve_fails(tmp_path, device: str):
    """`strata serve --device DEVICE` on a socket in tmp_path: (exit status, stderr), after checking that nothing
    listened and no socket file is left."""
    import subprocess
    import sys
    sock = tmp_path / "s.sock"
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--device", device, "--socket", str(sock)],
                       capture_output=True, text=True, timeout=60)
    assert "listening" not in r.stderr + r.stdout and not sock.exists()
    return r.returncode, r.stderr


def test_cli_bad_device_is_refused_before_the_daemon_starts(tmp_path):
    """`strata serve --device foo`: argparse's one-line error (exit 2)."""
    rc, err = _serve_fails(tmp_path, "foo")
    assert rc == 2 and "unknown device 'foo'" in err


@pytest.mark.skipif(C.unavailable_reason() is None, reason="a GPU is present: the unavailable path cannot run")
def test_cli_serve_without_gpu_fails_before_listening(tmp_path):
    """`strata serve --device cuda` without a usable GPU: one error line, exit 1."""
    rc, err = _serve_fails(tmp_path, "cuda")
    assert rc == 1 and "CUDA backend unavailable" in err


def test_cli_rejects_a_context_of_one_token():
    """--n-ctx 1 is a usage error (exit 2) like other bad numbers, named in words, not by a function name."""
    import subprocess
    import sys
    for bad, msg in (("1", "must be >= 2"), ("abc", "invalid context length value")):
        r = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--n-ctx", bad, "--prompt", "hi"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


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


def test_kv_q8_0_on_cpu_and_unknown_kv_are_clear_errors():
    _default_model()
    from strata.engine import Engine
    with pytest.raises(ValueError, match=r"--kv q8_0 needs --device cuda"):
        Engine("default", device="cpu", kv="q8_0")
    with pytest.raises(ValueError, match="unknown KV cache type 'q4'"):
        Engine("default", device="cpu", kv="q4")


def test_cli_kv_option():
    """`strata generate --kv` takes f16 / q8_0 only (argparse error, exit 2) and q8_0 on the CPU is refused before
    the model loads."""
    import subprocess
    import sys
    _default_model()
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--kv", "q4", "--prompt", "hi"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'q4'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--kv", "q8_0", "-n", "1", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--kv q8_0 needs --device cuda" in r.stderr
    assert "Traceback" not in r.stderr
