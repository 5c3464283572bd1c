"""A later turn tokenized incrementally (strata.text.turn_tokens, through ChatTemplate.render) gives exactly the ids of
a full tokenization: pieces with special-token text, partial special text and piece boundaries anywhere, a BPE and a
SentencePiece vocabulary, and chats of growing, edited and branching turns with tools, tool calls and reasoning."""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.text.chat_template import ChatTemplate
from strata.text.tokenizer import Tokenizer
from strata.text.turn_tokens import TurnTokens
from tests.helpers import load_tool
from tests.templates import QWEN_TEMPLATE, THINK_TEMPLATE

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _gguf_tokenizer(path) -> Tokenizer:
    import gguf
    r = gguf.GGUFReader(str(path))
    md = {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}
    return Tokenizer.from_gguf(md), md


@pytest.fixture(scope="module")
def bpe(default_model_path):
    return _gguf_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    ref = load_tool("llamacpp_tokenizer_reference")
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    ref.write_spm_gguf(path, ref.spm_vocab())
    return _gguf_tokenizer(path)[0]


# text that makes special tokens, splits them across pieces and sits beside them
ATOMS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<|im_", "start|>", "<", "|>", "user", "\n",
         " ", "  ", "hello", " world", "é", "日本", "123", "4567", "def f(x):", "\t", "<think>", "</think>", "🦙", "'s"]
PIECE = st.tuples(st.lists(st.sampled_from(ATOMS), min_size=0, max_size=6).map("".join), st.booleans())
PIECES = st.lists(PIECE, min_size=1, max_size=8)


def _edit(draw, pieces):
    """A next turn: pieces appended (a reply and a question), the last pieces changed (a regenerate or an edited
    message), cut back (a branch), or a flag flipped (the same text as client text or template text)."""
    kind = draw(st.sampled_from(["append", "append", "replace_tail", "cut", "flip"]))
    if kind == "append":
        return pieces + draw(PIECES)
    if kind == "replace_tail":
        k = draw(st.integers(0, len(pieces)))
        return pieces[:k] + draw(PIECES)
    if kind == "cut":
        return pieces[:draw(st.integers(1, len(pieces)))]
    i = draw(st.integers(0, len(pieces) - 1))
    return pieces[:i] + [(pieces[i][0], not pieces[i][1])] + pieces[i + 1:]


@st.composite
def turns(draw):
    out = [draw(PIECES)]
    for _ in range(draw(st.integers(1, 5))):
        out.append(_edit(draw, draw(st.sampled_from(out))))       # continue any earlier turn: branches too
    return out


@pytest.mark.parametrize("vocab", ["bpe", "spm"])
@SETTINGS
@given(data=turns())
def test_incremental_ids_equal_full_tokenization(request, vocab, data):
    tk = request.getfixturevalue(vocab)
    if vocab == "bpe":
        tk = tk[0]
    tt = TurnTokens(tk, keep=3)
    for pieces in data:
        got = tt.tokenize(pieces)
        text, frags = tk.split_special(pieces)
        # the full path: every piece split and tokenized, a BOS first unless the text begins with it
        bos = [tk.bos_id] if tk.add_bos and not (frags and frags[0].token_id == tk.bos_id) else []
        assert got.ids.tolist() == bos + tk.encode_pieces(pieces, add_bos=False, add_eos=False), pieces
        assert got.text == text and got.frags == frags
        assert got.starts == [sum(len(p) for p in got.parts[:i]) + got.bos for i in range(len(got.parts))]


def test_later_turn_reuses_the_earlier_ids(bpe):
    tk = bpe[0]
    tt = TurnTokens(tk)
    a = [("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n", True), ("Hi there", False),
         ("<|im_end|>\n<|im_start|>assistant\n", True)]
    first = tt.tokenize(a)
    assert first.reused == 0
    b = a[:2] + [("<|im_end|>\n<|im_start|>assistant\n", True), ("Hello!", False),
                 ("<|im_end|>\n<|im_start|>user\n", True), ("And now?", False),
                 ("<|im_end|>\n<|im_start|>assistant\n", True)]
    second = tt.tokenize(b)
    assert second.ids.tolist() == tk.encode_pieces(b)
    assert 0 < second.reused < len(second.ids) and second.ids[:second.reused].tolist() == first.ids[:second.reused].tolist()


NAMES = st.sampled_from(["get_weather", "search"])
CONTENT = st.lists(st.sampled_from(ATOMS + ["The Severn passes Shrewsbury.", "Why?", "ok"]), min_size=0,
                   max_size=5).map("".join)


@st.composite
def chats(draw):
    """A growing conversation (system, user, assistant with or without tool calls, tool results), sent turn by turn;
    a turn may edit the last message or branch from an earlier turn."""
    msgs = [{"role": "system", "content": draw(CONTENT)}]
    sent = []
    for _ in range(draw(st.integers(2, 5))):
        if sent and draw(st.booleans()):
            msgs = [dict(m) for m in draw(st.sampled_from(sent))]      # a branch from an earlier turn
        msgs.append({"role": "user", "content": draw(CONTENT)})
        sent.append([dict(m) for m in msgs])
        if draw(st.booleans()):
            call = {"type": "function", "function": {"name": draw(NAMES), "arguments": {"q": draw(CONTENT)}}}
            msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            msgs.append({"role": "tool", "content": draw(CONTENT)})
        else:
            msgs.append({"role": "assistant", "content": draw(CONTENT)})
    return sent


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <|im_end|> now",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.mark.parametrize("which", ["default", "qwen_tools", "think"])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sent=chats())
def test_chat_turns_tokenize_as_a_fresh_render(bpe, which, sent):
    tk, md = bpe
    source = {"default": md["tokenizer.chat_template"], "qwen_tools": QWEN_TEMPLATE, "think": THINK_TEMPLATE}[which]
    tools = TOOLS if which == "qwen_tools" else None
    kept = ChatTemplate(source, tk)
    for msgs in sent:
        fresh = ChatTemplate(source, tk)
        fresh.turns = TurnTokens(tk, keep=0)        # nothing kept: the full path
        try:
            ref = fresh.render(msgs, tools=tools)
        except ValueError as e:     # refused (e.g. special text in an argument the template escapes): refused alike
            with pytest.raises(ValueError, match=re.escape(str(e)[:40])):
                kept.render(msgs, tools=tools)
            continue
        got = kept.render(msgs, tools=tools)
        assert got.tokens == ref.tokens and got.cut_points == ref.cut_points and got.text == ref.text
