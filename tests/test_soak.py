"""tools/soak.py's short run: mixed clients against a real daemon for half a minute (a minute with
STRATA_FULL_SWEEPS=1, make test-sweeps), every answer equal to its reference, no 5xx, RSS and descriptors flat (the
long run is the script's, its numbers in the closing notes)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import full_sweeps

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_a_short_soak_passes(tmp_path, default_model_path):
    out = tmp_path / "soak.json"
    seconds = 60 if full_sweeps() else 30
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "soak.py"), "--model", str(default_model_path),
                        "--duration", str(seconds), "--clients", "3", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.exists(), r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert r.returncode == 0 and d["ok"], d["problems"]
    # at least 20 compared answers a minute
    assert d["compared"] >= seconds // 3 and d["mismatches"] == 0 and set(d["statuses"]) <= {"200", "503"}
    assert set(d["rss_curve_mib"]) == set(d["fds_curve"]) == {"start", "after_warmup", "end"}
    assert d["rss_curve_mib"]["end"] == d["rss_mib"][1] and set(d["trend"]) == {"rss_mib_per_hour", "fds_per_hour"}
    assert d["curve"][0][0] == 0 and all(len(p) == 3 and p[1] > 0 and p[2] > 0 for p in d["curve"])
