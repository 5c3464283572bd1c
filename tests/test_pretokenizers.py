"""Pre-tokenizer splits (qwen35, tekken, deepseek-v3, gpt-4o, qwen2) against llama.cpp's own splitter (stored by
tools/llamacpp_pretokenizer_reference.py) and, over random text, against the `regex` module running llama.cpp's
expressions."""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.text.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parent / "data"
REF = json.loads((DATA / "pretokenizer_llamacpp.json").read_text(encoding="utf-8"))

# llama.cpp src/llama-vocab.cpp's regex_exprs, written out again here for the `regex` module (not imported from
# strata, so a slip in either copy shows).
_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_UP = r"((?=[\p{L}])([^a-z]))"
_LO = r"((?=[\p{L}])([^A-Z]))"
EXPRESSIONS = {
    "qwen35": [_C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "tekken": [rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*"
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "gpt-4o": [rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+{_C}?|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*{_C}?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "deepseek-v3": [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}


def regex_split(text: str, expressions: list[str]) -> list[str]:
    """llama.cpp's unicode_regex_split semantics: each expression splits every word left by the previous one,
    keeping matched and unmatched text."""
    words = [text] if text else []
    for expr in expressions:
        pat = regex.compile(expr)
        out = []
        for w in words:
            pos = 0
            for m in pat.finditer(w):
                if m.start() > pos:
                    out.append(w[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(w):
                out.append(w[pos:])
        words = out
    return words


@pytest.fixture(scope="module")
def toks() -> dict[str, Tokenizer]:
    """A byte-level BPE vocabulary of the 256 byte symbols and a few merges, under each pre-tokenizer."""
    from strata.text.tokenizer import _BYTE_TO_CHAR
    symbols = [_BYTE_TO_CHAR[b] for b in range(256)]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": symbols + ["\u0120t"],
          "tokenizer.ggml.merges": ["\u0120 t"]}
    return {pre: Tokenizer.from_gguf({**md, "tokenizer.ggml.pre": pre}) for pre in REF["splits"]}


@pytest.mark.parametrize("pre", sorted(REF["splits"]))
def test_splits_match_llamacpp(toks, pre):
    bad = [(t, toks[pre].pre_tokenize(t), ref) for t, ref in zip(REF["corpus"], REF["splits"][pre])
           if toks[pre].pre_tokenize(t) != ref]
    assert not bad, f"{pre}: {len(bad)} of {len(REF['corpus'])} differ, e.g. {bad[:2]}"


@pytest.mark.parametrize("pre", sorted(EXPRESSIONS))
def test_regex_reference_matches_llamacpp(pre):
    """The reference expressions below split the stored corpus as llama.cpp does (so the random test is anchored)."""
    assert [regex_split(t, EXPRESSIONS[pre]) for t in REF["corpus"]] == REF["splits"][pre]


def test_qwen35_joins_combining_marks(toks):
    text = "Tie\u0302\u0301ng Vie\u0323\u0302t \u0939\u093f\u0928\u094d\u0926\u0940 e\u0301"
    assert toks["qwen35"].pre_tokenize(text) == ["Tie\u0302\u0301ng", " Vie\u0323\u0302t",
                                                 " \u0939\u093f\u0928\u094d\u0926\u0940", " e\u0301"]
    assert toks["qwen2"].pre_tokenize(text) != toks["qwen35"].pre_tokenize(text)
    assert toks["qwen35"].decode(toks["qwen35"].encode(text)) == text
    # BPE never merges across words: the ids are those of each llama.cpp word tokenized alone.
    words = REF["splits"]["qwen35"][REF["corpus"].index("a\u0300\u0301\u0302b \u0300\u0301 ,\u0301 1\u0301 \n\u0301")]
    assert sum((toks["qwen35"].encode(w) for w in words), []) == toks["qwen35"].encode("".join(words))


def _assigned(c: str) -> bool:
    # assigned in this Python's Unicode tables (older than both regex's and the tokenizer's), not a surrogate
    return unicodedata.category(c) not in ("Cn", "Cs")


_CHARS = st.one_of(
    st.sampled_from(list("aAzZ'sStT \t\r\n0123456789.,!?/_-\u00a0\u3000")),
    st.sampled_from(["\u0301", "\u0308", "\u0323", "\u093f", "\u094d", "\u0e31", "\u0e48", "\u200d", "\ufe0f",
                     "\U0001f3fd", "\u0939", "\u0e2a", "\u00c9", "\u01c5", "\u4e00", "\u30ab", "\u0661"]),
    st.characters(min_codepoint=0x20, max_codepoint=0x2FFFF).filter(_assigned),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(_CHARS, max_size=40).map("".join), pre=st.sampled_from(sorted(EXPRESSIONS)))
def test_random_text_matches_regex_reference(toks, text, pre):
    assert toks[pre].pre_tokenize(text) == regex_split(text, EXPRESSIONS[pre])
