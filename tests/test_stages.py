"""Stages and the layer split on the CPU: carve planning, split parity (1, 2 and 3 stages give the same greedy
tokens and, layer by layer, the same K/V and running-state hashes as the unsplit engine, read cold and resumed
through checkpoints; the default model and a synthetic hybrid), per-stage checkpoint parts validated before any
write, the per-device drain before every state read and write, and the CLI / stratactl surface."""
from __future__ import annotations

import functools
import json
import subprocess
import sys

import numpy as np
import pytest

from strata.engine import Engine
from strata.memory import Carve, PartMismatch
from strata.stages.split import carves_by_weight, plan_stages
from tests.helpers import ask

GB = 1 << 30


# ---- carve planning ------------------------------------------------------------------------------------------

def test_plan_stages_explicit_auto_and_errors():
    mem = {"cuda:0": 80 * GB, "cuda:1": 40 * GB, "cpu": 64 * GB}.__getitem__
    assert plan_stages(["cpu"], None, 30, mem) == [(Carve(0, 30), "cpu")]
    assert plan_stages(["cpu"], "auto", 30, mem) == [(Carve(0, 30), "cpu")]
    assert plan_stages(["cpu"], [10, 20], 30, mem) == [(Carve(0, 10), "cpu"), (Carve(10, 20), "cpu"),
                                                       (Carve(20, 30), "cpu")]
    assert plan_stages(["cuda:0", "cuda:1"], "auto", 30, mem) == [(Carve(0, 20), "cuda:0"), (Carve(20, 30), "cuda:1")]
    assert plan_stages(["cuda:0", "cuda:1"], None, 30, mem) == plan_stages(["cuda:0", "cuda:1"], "auto", 30, mem)
    assert plan_stages(["cuda:0", "cuda:0"], [7], 30, mem) == [(Carve(0, 7), "cuda:0"), (Carve(7, 30), "cuda:0")]
    with pytest.raises(ValueError, match="makes 3 stages but --device lists 2 devices"):
        plan_stages(["cuda:0", "cuda:1"], [5, 9], 30, mem)
    for bad in ([0], [30], [12, 12], [20, 10]):
        with pytest.raises(ValueError, match="first layer must be above"):
            plan_stages(["cpu"], bad, 30, mem)
    assert [len(c) for c in carves_by_weight([1, 1, 1], 3)] == [1, 1, 1]
    assert [len(c) for c in carves_by_weight([100, 1], 4)] == [3, 1]        # every stage keeps a layer
    with pytest.raises(ValueError, match="cannot split 2 blocks over 3 stages"):
        carves_by_weight([1, 1, 1], 2)


# ---- split parity on the CPU ---------------------------------------------------------------------------------

_greedy = functools.partial(ask, n=12)


CHAT = [{"role": "system", "content": "You are a terse assistant who answers in one line."},
        {"role": "user", "content": "Name a river in France."}]


def _conversation(engine):
    """A cold read, the same request again (resumed through a checkpoint), then a next turn; with hashes."""
    engine.clear_checkpoints()
    engine.state_reset()
    out = []
    t1, f1 = _greedy(engine, CHAT)
    out.append((t1, engine.state_hashes(), f1.strata["resume_from"]))
    t2, f2 = _greedy(engine, CHAT)
    out.append((t2, engine.state_hashes(), f2.strata["resume_from"]))
    turn2 = CHAT + [{"role": "assistant", "content": engine.detokenize(t1)},
                    {"role": "user", "content": "And one in Spain?"}]
    t3, f3 = _greedy(engine, turn2)
    out.append((t3, engine.state_hashes(), f3.strata["resume_from"]))
    return out


@pytest.fixture(scope="module")
def hybrid_path(synthetic):
    return synthetic("qwen35", n_layer=6, seed=11, n_mtp=1)


@pytest.fixture(scope="module")
def mamba_path(synthetic):
    return synthetic("nemotron_h", seed=11)                   # blocks M-M*M-: Mamba2, MLP, attention


@pytest.mark.parametrize("which", ["default", "hybrid", "mamba"])
def test_split_parity_cold_and_resumed(which, default_model_path, hybrid_path, mamba_path):
    path = {"default": default_model_path, "hybrid": hybrid_path, "mamba": mamba_path}[which]
    splits = {"default": [None, "15", "7,22"], "hybrid": [None, "3", "2,4"], "mamba": [None, "3", "2,4"]}[which]
    runs = {}
    for split in splits:
        e = Engine(path, n_ctx=512, ubatch=32, prompt_cache=6, layer_split=split)
        assert len(e.stages) == (1 if split is None else split.count(",") + 2)
        runs[split] = _conversation(e)
    base = runs[None]
    again = "live" if which == "default" else "checkpoint"    # the same request again: cut back, or a checkpoint
    assert [r[2] for r in base][:2] == ["none", again] and base[2][2] in ("live", "checkpoint")
    assert base[0][0] == base[1][0]
    layer_keys = [k for k in base[0][1] if ".L" in k]
    stateful = {"default": set(range(30)), "hybrid": set(range(7)), "mamba": {0, 2, 3, 4}}[which]   # MLP: none
    assert {int(k.split(".L")[1]) for k in layer_keys} == stateful
    for split in splits[1:]:
        for (t, h, how), (tb, hb, howb) in zip(runs[split], base):
            assert (t, how) == (tb, howb), split
            assert h == hb, f"split {split}: " + ", ".join(k for k in hb if h.get(k) != hb[k])


# ---- per-stage checkpoint parts and the per-device drain ----------------------------------------------------

@pytest.fixture(scope="module")
def split_engine(default_model_path):
    return Engine(default_model_path, n_ctx=256, ubatch=32, prompt_cache=6, layer_split="10,20")


def test_checkpoint_has_one_part_per_stage_and_refuses_a_foreign_part(split_engine):
    e = split_engine
    e.state_reset()
    seq = e.seq
    seq.forward(np.arange(1, 41, dtype=np.int32))
    ck = seq.capture()
    assert [(p.carve.lo, p.carve.hi) for p in ck.parts] == [(0, 10), (10, 20), (20, 30)]
    h = seq.hashes()
    swapped = type(ck)(pos=ck.pos, tokens=ck.tokens, parts=[ck.parts[0], ck.parts[2], ck.parts[1]])
    with pytest.raises(PartMismatch, match=r"stage 1 \(10..20 on cpu\): the part is of layers 20..30"):
        seq.restore(swapped)
    short = type(ck)(pos=ck.pos, tokens=ck.tokens, parts=ck.parts[:2])
    with pytest.raises(PartMismatch, match="2 stage parts, this engine runs 3 stages"):
        seq.restore(short)
    assert seq.hashes() == h                     # nothing was written
    seq.forward(np.arange(50, 60, dtype=np.int32))
    seq.restore(ck)
    assert seq.hashes() == h and seq.positions() == [40, 40, 40]
    ck.release()                                 # a capture holds its pages until released


class _Drains:
    """Wraps a stage memory's backend so that its drains are logged under the stage's own name: the stages share one
    CPU backend here, so without the wrapper a drain of stage 0 could not be told from one of stage 2."""

    def __init__(self, backend, name, log):
        self._b, self._name, self._log = backend, name, log

    def __getattr__(self, a):
        return getattr(self._b, a)

    def drain(self):
        self._log.append(("drain", self._name))

    @property
    def device(self):
        """The stage's device scope, its entry logged as ("scope", stage)."""
        import contextlib

        @contextlib.contextmanager
        def scope():
            self._log.append(("scope", self._name))
            inner = getattr(self._b, "device", None)
            with inner if inner is not None else contextlib.nullcontext():
                yield
        return scope()


def test_each_stage_drains_its_own_device_before_its_state_is_read_or_written(split_engine, monkeypatch):
    """Every read or write of a stage's state runs in that stage's own device scope, right after that stage's drain;
    a capture only in its scope (its copies are queued on the stage's stream after the forward that wrote the state:
    no host wait on the request's path)."""
    e = split_engine
    log: list = []
    for st in e.stages:
        monkeypatch.setattr(st.memory, "backend", _Drains(st.memory.backend, st.index, log))
        for f in st.memory.fields:          # the hooks that read or write the state itself, inside each verb
            for op in ("_capture", "_restore", "_hashes", "_reset"):
                real = getattr(f, op)
                monkeypatch.setattr(f, op, (lambda real, i, op: lambda *a, **k: (log.append((op, i)),
                                                                                real(*a, **k))[1])(real, st.index, op))
    e.state_reset()
    e.seq.forward(np.arange(1, 21, dtype=np.int32))
    ck = e.seq.capture()
    e.seq.hashes()
    e.seq.restore(ck)
    ck.release()
    ops = [x for x in log if x[0] not in ("drain", "scope")]
    assert {op for op, _ in ops} == {"_capture", "_restore", "_hashes", "_reset"}
    assert {i for _, i in ops} == {st.index for st in e.stages}
    for k, (op, i) in enumerate(log):
        if op in ("drain", "scope"):
            continue
        scope = max((j for j in range(k) if log[j][0] == "scope"), default=-1)
        assert scope >= 0 and log[scope] == ("scope", i), f"{op} of stage {i} outside its own device scope"
        if op != "_capture":     # stage i's own drain right before its scope, nothing of another stage between
            assert scope >= 1 and log[scope - 1] == ("drain", i) and all(x[1] == i for x in log[scope - 1:k]), \
                f"{op} of stage {i} after {log[max(scope - 1, 0):k]}, not its drain"


# ---- the command line and stratactl ---------------------------------------------------------------------------

def _strata(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_with_a_layer_split_matches_unsplit():
    a = _strata("generate", "--raw", "--prompt", "The capital of France is", "-n", "8", "--n-ctx", "256")
    b = _strata("generate", "--raw", "--prompt", "The capital of France is", "-n", "8", "--n-ctx", "256",
                "--device", "cpu,cpu,cpu", "--layer-split", "10,20")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


@pytest.mark.parametrize("args,msg", [
    (["--layer-split", "ten"], "use 'auto' or the first layer"),
    (["--layer-split", "12,8"], "must be positive and increasing"),
    (["--device", "cpu,cpu", "--layer-split", "5,10"], "makes 3 stages but --device lists 2 devices"),
    (["--device", "cpu,cuda:0"], "puts stages on the CPU and on GPUs: give the first layer of each later stage"),
    (["--device", "cuda:0", "-ngl", "4", "--layer-split", "8"], "--n-gpu-layers and --layer-split both place"),
    (["--device", "cpu", "-ngl", "4", "--layer-split", "8"], "--n-gpu-layers and --layer-split both place"),
])
def test_bad_split_flags_are_usage_errors(args, msg):
    r = _strata("generate", "--prompt", "hi", "-n", "1", *args)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_split_past_the_model_is_a_usage_error_before_the_model_loads(cmd):
    extra = ["--prompt", "hi", "-n", "1"] if cmd == "generate" else ["--no-socket", "--port", "0"]
    r = _strata(cmd, *extra, "--n-ctx", "128", "--layer-split", "40")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "failed to load" not in r.stderr
    assert "--layer-split 40: each stage's first layer must be above the previous one and below the model's 30 " \
           "blocks" in r.stderr


@pytest.mark.slow
def test_stratactl_status_shows_each_stage(tmp_path):
    from tests.daemon import ROOT, Daemon, env_for_daemon
    d = Daemon(tmp_path, "--layer-split", "12").start()
    try:
        run = lambda *a: subprocess.run([sys.executable, "-m", "strata.cli.ctl", "--socket", d.sock, *a],  # noqa: E731
                                        capture_output=True, text=True, env=env_for_daemon(), cwd=ROOT, timeout=120)
        s = json.loads(run("--json", "status").stdout)
        assert [(x["stage"], x["device"], x["layers"]) for x in s["stages"]] == [(0, "cpu", [0, 12]),
                                                                                 (1, "cpu", [12, 30])]
        assert s["stages"][1]["memory"]["kv"]["layers"] == 18
        r = run("status")
        assert r.returncode == 0 and "0: cpu layers [0, 12), KV 0 / 2 pages; 1: cpu layers [12, 30)" in r.stdout
    finally:
        assert d.stop() == 0, d.log_tail()


# ---- shape: the layering has no way back up ---------------------------------------------------------------------

def _imports(path) -> set[str]:
    """Every strata module a file imports, at module level or inside functions."""
    import ast
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("strata"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("strata"))
    return out


def test_memory_and_stages_import_nothing_above_them():
    """strata.memory knows no model, backend, stage or engine; strata.stages knows no engine, cache or serve; the
    daemon's request side (serve/ but its command line) imports no stage, memory, backend or model module: it reads
    the engine's status surface."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "strata"
    for p in (root / "memory").glob("*.py"):
        bad = {m for m in _imports(p) if not m.startswith("strata.memory")}
        assert not bad, f"{p.name} imports {bad}"
    for p in (root / "stages").glob("*.py"):
        bad = {m for m in _imports(p) if m.startswith(("strata.engine", "strata.cache", "strata.serve", "strata.cli"))}
        assert not bad, f"{p.name} imports {bad}"
    for p in (root / "serve").glob("*.py"):
        if p.name == "cli.py":          # the command line checks --device before the daemon starts
            continue
        bad = {m for m in _imports(p) if m.startswith(("strata.stages", "strata.memory", "strata.backend",
                                                          "strata.models"))}
        assert not bad, f"serve/{p.name} imports {bad}"


def test_n_gpu_layers_places_the_first_layers_on_the_gpus_and_the_rest_on_the_cpu():
    """--n-gpu-layers N (llama.cpp's -ngl) as --device / --layer-split, on the default model's 30 blocks (parsed only,
    no backend made): N on one GPU, split evenly over two, all on the GPU at or above 30, all on the CPU at 0,
    nothing changed on a CPU-only --device; refused beside --layer-split (on a CPU-only --device too) or CPU stages in
    --device."""
    from strata.cli.engine_flags import CliError, _gpu_layers
    from strata.engine.config import EngineConfig

    def place(device, n, **kw):
        c = _gpu_layers(EngineConfig.build(model="default", device=device, **kw), n)
        return c.stages.device, c.stages.layer_split

    assert place("cuda:0", 10) == ("cuda:0,cpu", "10")
    assert place("cuda:0,cuda:1", 10) == ("cuda:0,cuda:1,cpu", "5,10")
    assert place("cuda:0", 30) == place("cuda:0", 99) == ("cuda:0", None)
    assert place("cuda:0", 0) == ("cpu", None)
    assert place("cpu", 12) == ("cpu", None)
    for device, kw, msg in (("cuda:0", {"layer_split": "8"}, "both place the layers"),
                            ("cpu", {"layer_split": "8"}, "both place the layers"),
                            ("cuda:0,cpu", {"layer_split": None}, "give only GPUs"),
                            ("cuda:0,cuda:1,cuda:2", {}, "fewer layers than the 3 GPUs")):
        with pytest.raises(CliError, match=msg):
            place(device, 2, **kw)
