"""tools/conversation_cache_parity.py takes the server's engine flags: its A/B/A check runs once on a 2-stage CPU
layer split with parking, both runs' records showing the split engine's parts and the parked resumes."""
from __future__ import annotations

import json

import pytest

from tests.helpers import load_tool


def test_abab_parity_over_a_two_stage_split(tmp_path, capsys, default_model_path):
    out = tmp_path / "parity.json"
    rc = load_tool("conversation_cache_parity").main(["--scenario", "reuse", "--model", str(default_model_path), "--device", "cpu",
                       "--layer-split", "15", "--park-resident", "1", "--n-ctx", "512", "--threads", "2",
                       "--max-tokens", "2", "--system-repeat", "1", "--exact", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and text.rstrip().endswith("PASS"), text
    runs = json.loads(out.read_text())["reuse"]
    cached, plain = runs["cached"], runs["uncached"]
    assert [r["tokens"] for r in cached] == [r["tokens"] for r in plain]
    # the switch back to A (request #2) resumes A's parked conversation; the cached run cut at the turn point
    assert cached[2]["resume_from"] == "resident" and cached[2]["resume_pos"] > 0
    assert len(cached[0]["parts"]) > len(plain[0]["parts"]) == 1
    # the state hashes cover both stages' layers (30: the split engine hashes every local stage)
    assert sum(1 for k in cached[-1]["hashes"] if k.startswith("kv.L")) == 30


def test_engine_flags_are_checked_as_the_server_checks_them(capsys):
    with pytest.raises(SystemExit) as e:
        load_tool("conversation_cache_parity").main(["--device", "cpu", "--layer-split", "10,20", "--remote-stage", "127.0.0.1:9",
                      "--link-encrypt"])
    assert e.value.code == 2
    assert "--link-encrypt needs --link-key-file" in capsys.readouterr().err
