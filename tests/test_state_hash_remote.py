"""STRATA_STATE_HASH=1 over a loopback worker: the main's state_hash line names the layers it hashed, the worker logs
its carve's at the request's end, and together they equal an unsplit run's hashes layer by layer (the CLI, as a user
runs it)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.daemon import ROOT, WorkerProc, env_for_daemon

PROMPT = "Name three rivers."
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _generate(*flags: str) -> dict[str, str]:
    """The state_hash line of `strata generate` (console log format) as {field: value}."""
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "-p", PROMPT, "-n", "3", "--n-ctx", "512",
                        "--threads", "1", "--device", "cpu", *flags], capture_output=True, text=True, cwd=ROOT,
                       env=env_for_daemon({"STRATA_STATE_HASH": "1"}), timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [_ANSI.sub("", ln) for ln in r.stderr.splitlines() if "state_hash" in ln]
    assert len(lines) == 1, r.stderr
    return dict(re.findall(r"(\S+?)=('[^']*'|\S+)", lines[0]))


def _layers(fields: dict[str, str], field: str = "kv") -> dict[int, str]:
    return {int(k.split(".L")[1]): v for k, v in fields.items() if k.startswith(field + ".L")}


def test_split_over_a_worker_shows_the_unsplit_hashes_layer_by_layer():
    whole = _generate()
    n_layer = len(_layers(whole))
    assert n_layer == 30 and whole["layers"].strip("'") == "[0, 30)"
    w = WorkerProc(env={"STRATA_STATE_HASH": "1"}).start()
    try:
        main = _generate("--remote-stage", w.address, "--layer-split", "20")
    finally:
        w.stop()
    worker = [json.loads(ln) for ln in w.lines if ln.startswith("{") and '"state_hash"' in ln]
    assert worker, "\n".join(w.lines[-20:])
    last = worker[-1]
    assert main["layers"].strip("'") == "[0, 20)" and last["layers"] == "[20, 30)"
    assert int(last["pos"]) == int(main["pos"]) == int(whole["pos"])
    assert main["tokens"] == whole["tokens"]
    assert sorted(_layers(main)) == list(range(20)) and sorted(_layers(last)) == list(range(20, n_layer))
    assert {**_layers(main), **_layers(last)} == _layers(whole)
