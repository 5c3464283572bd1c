"""Write the golden stage-link frames of tests/test_link_codec.py (one per message type, fixed field values) into
tests/data/link_golden.json. Run again only when the protocol changes on purpose (and bump link.VERSION then).

Usage: python tools/make_link_golden.py
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.link_cases import GOLDEN_PATH, golden_cases, make_golden  # noqa: E402

if __name__ == "__main__":
    make_golden(GOLDEN_PATH)
    print("wrote", GOLDEN_PATH.relative_to(ROOT), "with", len(golden_cases()), "frames")
