"""Write the golden session files of tests/test_session.py (format versions 1 and 3, a synthetic tiny qwen35 model
made from a fixed seed) into tests/data. Run again only when the format changes on purpose.

Usage: python tools/make_session_golden.py
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_session import make_golden  # noqa: E402

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        make_golden(ROOT / "tests" / "data", Path(tmp))
    print("wrote", *(p.name for p in sorted((ROOT / "tests" / "data").glob("session_*"))))
