"""The systemd units: `systemd-analyze verify` passes (when systemd is installed) and the required settings are there."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "systemd"


def settings(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;[":
            continue
        k, _, v = line.partition("=")
        out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_service_settings():
    s = settings(UNITS / "strata.service")
    assert s["Type"] == ["notify"] and s["RuntimeDirectory"] == ["strata"] and s["StateDirectory"] == ["strata"]
    assert "-/etc/strata/strata.env" in s["EnvironmentFile"]
    # /var/cache/strata: under ProtectSystem=strict the one writable place for --conversation-cache-dir apart from
    # the session files' /var/lib/strata
    assert s["CacheDirectory"] == ["strata"]
    assert s["ExecStart"][0].split()[1] == "serve"
    for key, val in (("ProtectSystem", "strict"), ("NoNewPrivileges", "yes"), ("PrivateTmp", "yes"),
                     ("User", "strata")):
        assert s[key] == [val], key
    assert s["KillSignal"] == ["SIGTERM"]
    w = settings(UNITS / "strata-worker@.service")
    assert w["Type"] == ["notify"] and w["ExecStart"][0].split()[1] == "worker"
    # a worker runs the main's model (the hello refuses another): STRATA_MODEL, which a --model in the args overrides
    assert w["ExecStart"][0].split()[2:4] == ["--model", "${STRATA_MODEL}"], w["ExecStart"]
    env = settings(UNITS / "strata.env")
    assert env["STRATA_MODEL"] == ["default"] and "STRATA_ARGS" in env


def test_env_file_flags_parse(tmp_path):
    """The flags shipped in strata.env are accepted by `strata serve`'s parser."""
    import argparse
    import shlex

    from strata.cli.serve import add_arguments, check_args
    env = {k: v[0] for k, v in settings(UNITS / "strata.env").items()}
    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = env["STRATA_ARGS"].replace("/var/lib/strata", str(tmp_path))   # the unit's StateDirectory, made by systemd
    args = p.parse_args(["--model", env["STRATA_MODEL"], *shlex.split(flags)])
    assert check_args(args) is None and args.prompt_cache == 6 and args.slot_save_path == str(tmp_path)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed "
                                                                   "(apt-get install systemd)")
def test_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart's program exists: point it at a `strata` launcher for this checkout
    launcher = tmp_path / "bin" / "strata"
    launcher.parent.mkdir()
    launcher.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m strata.cli.main \"$@\"\n")
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    out = tmp_path / "units"
    out.mkdir()
    names = ["strata.service", "strata-worker@.service"]
    for n in names:
        text = (UNITS / n).read_text()
        assert "/usr/local/bin/strata " in text
        (out / n).write_text(text.replace("/usr/local/bin/strata ", f"{launcher} "))
    env = dict(os.environ, SYSTEMD_LOG_LEVEL="notice")
    r = subprocess.run(["systemd-analyze", "verify", *[str(out / n) for n in names]], capture_output=True,
                       text=True, env=env, timeout=120)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines()
                if re.search(r"strata", ln) and not re.search(r"Failed to (connect|create)|bus", ln, re.I)]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


def test_units_point_at_no_missing_documentation_and_the_worker_example_has_a_key():
    for name in ("strata.service", "strata-worker@.service"):
        assert "Documentation=" not in (UNITS / name).read_text()     # nothing installs a doc file for them
    env = (UNITS / "strata.env").read_text()
    example = [ln for ln in env.splitlines() if ln.startswith("#STRATA_WORKER_ARGS=")]
    assert example and "--link-key-file" in example[0] and "0.0.0.0" in example[0]
    assert "chown strata:strata" in env


def test_units_set_a_watchdog():
    """Both units ask for systemd's watchdog (the daemons ping it: tests/test_remote_stage.py sees the pings stop for
    a stuck engine), long enough for two pings to be missed before systemd stops the service."""
    from strata.serve.notify import watchdog_interval
    for name in ("strata.service", "strata-worker@.service"):
        s = settings(UNITS / name)
        assert s["WatchdogSec"] == ["60s"] and "on-failure" in s["Restart"], name
    assert watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}) is None     # another process's
    assert watchdog_interval({}) is None and watchdog_interval({"WATCHDOG_USEC": "x"}) is None
