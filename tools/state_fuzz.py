"""Runs the differential fuzz of conversation state (tests/test_state_fuzz.py) for many steps: python
tools/state_fuzz.py [STEPS per architecture, default 10000]. Prints the steps and requests run per architecture and
the time; exits non-zero on a failure (hypothesis prints the shrunk sequence of steps)."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
    report = Path(tempfile.mkdtemp()) / "counts.json"
    env = dict(os.environ, STATE_FUZZ_STEPS=str(steps), STATE_FUZZ_REPORT=str(report), PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "test_state_fuzz.py")], env=env, cwd=ROOT)
    counts = json.loads(report.read_text()) if report.exists() else {}
    print(f"state fuzz: {'passed' if rc == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f} s; per architecture "
          f"(steps, requests, how each request resumed): {json.dumps(counts, sort_keys=True)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
