"""The expert tier's flags on the command line (CPU): `strata serve`, `strata generate` and `strata worker` refuse a
bad value, or the tier without a GPU device, with one usage line naming the flag (exit 2), before loading anything."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)


@pytest.mark.parametrize("cmd", [["serve", "--socket", "/nonexistent/s.sock"], ["generate", "-p", "hi"],
                                 ["worker", "--listen", "127.0.0.1:0"]])
@pytest.mark.parametrize("flags,says", [
    (["--moe-vram-mib", "lots"], "--moe-vram-mib must be 'auto' or a whole number of MiB, got 'lots'"),
    (["--moe-vram-mib", "64", "--pcie-frac", "1.5"], "--pcie-frac must be in (0, 1], got 1.5"),
    (["--moe-vram-mib", "auto"], "--moe-vram-mib needs --device cuda"),
    (["--adapt-every", "0"], "--adapt-every"),
])
def test_bad_tier_flags_are_one_usage_line(cmd, flags, says):
    r = _run(*cmd, "--device", "cpu", *flags)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert says in lines[-1] and "Traceback" not in r.stderr, r.stderr
