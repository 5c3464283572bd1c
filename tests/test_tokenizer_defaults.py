"""Tokenizer defaults for GGUFs that leave keys out, against llama.cpp's (tests/data/tokenizer_defaults_llamacpp.json).

The reference was written by tools/llamacpp_defaults_reference.py: small vocab-only GGUFs (gguf.GGUFWriter) whose
metadata leaves out add_bos_token / add_eos_token / the special token ids, loaded by llama.cpp itself.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from strata.text.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"
REF = json.loads((DATA / "tokenizer_defaults_llamacpp.json").read_text(encoding="utf-8"))
SPM = json.loads((DATA / "tokenizer_spm_llamacpp.json").read_text(encoding="utf-8"))["vocab"]


def _metadata(case: dict) -> dict:
    md = dict(case["metadata"])
    if md["tokenizer.ggml.model"] == "gpt2":
        v = REF["bpe_vocab"]
        md.update({"tokenizer.ggml.tokens": v["tokens"], "tokenizer.ggml.token_type": v["token_type"],
                   "tokenizer.ggml.merges": v["merges"]})
    else:
        md.update({"tokenizer.ggml.tokens": SPM["tokens"], "tokenizer.ggml.token_type": SPM["token_type"],
                   "tokenizer.ggml.scores": SPM["scores"]})
    return md


def _opt(i: int) -> int | None:
    return None if i < 0 else i


@pytest.mark.parametrize("case", REF["cases"], ids=[c["name"] for c in REF["cases"]])
def test_defaults_match_llamacpp(case):
    tk = Tokenizer.from_gguf(_metadata(case))
    ref = case["llamacpp"]
    assert (tk.bos_id, tk.eos_id) == (_opt(ref["bos"]), _opt(ref["eos"]))
    assert (tk.add_bos, tk.add_eos) == (bool(ref["add_bos"]), bool(ref["add_eos"]))
    assert sorted(tk.eog_ids) == ref["eog"]
    for r in ref["ids"]:
        assert tk.encode(r["text"], parse_special=r["parse_special"]) == r["ids"], (r["text"], r["parse_special"])


def test_reference_covers_each_default():
    """The stored cases exercise each default that differs between model and pre types (else the file is stale)."""
    by = {c["name"]: c["llamacpp"] for c in REF["cases"]}
    assert by["llama-bpe-no-add-bos"]["add_bos"] and not by["qwen2-no-ids"]["add_bos"]
    assert not by["llama-bpe-add-bos-false"]["add_bos"]
    assert by["llama-bpe-no-ids"]["bos"] == 11 and by["spm-no-keys"]["bos"] == 1
    # ignore_merges: llama3 keeps " world" whole (absent from the merges); stablelm2 builds it from merges.
    world = REF["corpus"].index("hello world") * 2
    assert len(by["llama-bpe-add-bos-false"]["ids"][world]["ids"]) == 2
    assert len(by["stablelm2"]["ids"][world]["ids"]) > 2
