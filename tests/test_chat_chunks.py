"""A chat rendered from kept per-message outputs (strata.text.chat_chunks, through ChatTemplate.render) equals the
whole render: the same text, token ids, cut points and content safety over random conversations played turn by
turn (growing, edited, branching; tools, tool calls, system prompts, template arguments), for the default model's
template and templates that read loop.first / last / index0, messages[0] around and inside the loop, raise
errors, or transform contents; and templates that are not provably message by message are not split."""
from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.text.chat_chunks import split_template
from strata.text.chat_template import ChatTemplate, _environment
from strata.text.tokenizer import Tokenizer
from tests.templates import QWEN_TEMPLATE, THINK_TEMPLATE, same_render


@pytest.fixture(scope="module")
def bpe(default_model_path):
    import gguf
    r = gguf.GGUFReader(str(default_model_path))
    md = {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}
    return Tokenizer.from_gguf(md), md


# the last message closes differently, the first opens the prompt, indices show, assistant turns of a bad order raise
LAST_TEMPLATE = """{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}<|im_start|>{{ m.role }} #{{ loop.index0 }}/{{ loop.index }}
{{ m.content | trim }}{% if loop.last %}<|im_end|>{% else %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

# the system prompt printed before the loop (and skipped inside it), tools listed, tool calls as JSON, alternation
# checked with raise_exception, a template argument read inside the loop, a body-local variable
HEADER_TEMPLATE = """{% if messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}{% if tools %}
Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}<|im_end|>
{% endif %}{% for message in messages %}{% set skip = loop.first and messages[0]['role'] == 'system' %}{% if not skip %}{% if message['role'] == 'system' %}{{ raise_exception('only the first message may be a system message') }}{% endif %}<|im_start|>{{ message['role'] }}{% if style is defined %} ({{ style }}){% endif %}
{{ message['content'] }}{% if message.tool_calls %}{% for tc in message.tool_calls %}<tool_call>{{ tc.function | tojson }}</tool_call>{% if not loop.last %},{% endif %}{% endfor %}{% endif %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# contents transformed (upper-cased): the sentinel split fails, the whole render's fallback decides
UPPER_TEMPLATE = """{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content | upper }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

ATOMS = ["<|im_start|>", "<|im_end|>", "<|im_", "start|>", "user", "\n", " ", "hello", " world", "é", "日本", "123",
         "<think>", "</think>", "🦙", "'s", "The Severn passes Shrewsbury.", "Why?", "ok", "  "]
CONTENT = st.lists(st.sampled_from(ATOMS), min_size=0, max_size=5).map("".join)
NAMES = st.sampled_from(["get_weather", "search"])
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <|im_end|> now",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@st.composite
def chats(draw):
    """Requests of a conversation played turn by turn: a system prompt or none, user and assistant messages (tool
    calls and tool results too), a turn that edits the last message, branches from an earlier turn, or repeats one;
    values that are equal but print differently (1, 1.0, True) in tool-call arguments."""
    msgs = [{"role": "system", "content": draw(CONTENT)}] if draw(st.booleans()) else []
    sent = []
    for _ in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(["grow", "grow", "grow", "branch", "edit", "repeat"]))
        if sent and kind == "branch":
            msgs = [dict(m) for m in draw(st.sampled_from(sent))]
        elif sent and kind == "edit" and msgs:
            msgs[-1] = dict(msgs[-1], content=draw(CONTENT))
        elif sent and kind == "repeat":
            sent.append([dict(m) for m in draw(st.sampled_from(sent))])
            continue
        msgs.append({"role": "user", "content": draw(CONTENT)})
        sent.append([dict(m) for m in msgs])
        if draw(st.booleans()):
            arg = draw(st.sampled_from([1, 1.0, True, "1", None]))
            call = {"type": "function", "function": {"name": draw(NAMES), "arguments": {"q": draw(CONTENT), "n": arg}}}
            msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            msgs.append({"role": "tool", "content": draw(CONTENT)})
        else:
            msgs.append({"role": "assistant", "content": draw(CONTENT)})
    return sent


def _whole(source, tk):
    t = ChatTemplate(source, tk)
    t.chunks = None                # the whole render every time
    return t


@pytest.mark.parametrize("which", ["default", "last", "header", "upper", "think", "qwen"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sent=chats(), tools=st.booleans(), agp=st.sampled_from([True, True, False]),
       kw=st.sampled_from([{}, {"style": "terse"}, {"enable_thinking": False}]), pin=st.sampled_from([None, 0, -1]))
def test_chunked_render_equals_the_whole_render(bpe, which, sent, tools, agp, kw, pin):
    tk, md = bpe
    source = {"default": md["tokenizer.chat_template"], "last": LAST_TEMPLATE, "header": HEADER_TEMPLATE,
              "upper": UPPER_TEMPLATE, "think": THINK_TEMPLATE, "qwen": QWEN_TEMPLATE}[which]
    kept = ChatTemplate(source, tk)
    whole = _whole(source, tk)
    answered = 0
    for msgs in sent:
        args = dict(add_generation_prompt=agp, tools=TOOLS if tools else None, pin_message=pin if msgs else None,
                    **kw)
        answered += same_render(kept, whole, msgs, **args)
    if which in ("default", "last", "header", "upper", "think"):
        assert kept.chunks is not None      # split, and the first chunked answer equalled the whole render
    if which in ("default", "think") and answered:     # (the others transform contents: some fall back)
        assert kept.chunks.stats["calls"] > 0


def test_which_templates_split(bpe):
    env = _environment()
    ok = {"default": bpe[1]["tokenizer.chat_template"], "last": LAST_TEMPLATE, "header": HEADER_TEMPLATE,
          "upper": UPPER_TEMPLATE, "think": THINK_TEMPLATE}
    for name, source in ok.items():
        assert split_template(env, source) is not None, name
    body = "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    refused = {
        "neighbours": QWEN_TEMPLATE,                       # messages[loop.index0 - 1]
        "length": "{% for m in messages %}{{ messages|length }}" + body + "{% endfor %}",
        "loop length": "{% for m in messages %}{{ loop.length }}" + body + "{% endfor %}",
        "revindex": "{% for m in messages %}{{ loop.revindex }}" + body + "{% endfor %}",
        "last message": "{% for m in messages %}{{ messages[-1].role }}" + body + "{% endfor %}",
        "generation prompt": "{% for m in messages %}{% if add_generation_prompt %}!{% endif %}" + body + "{% endfor %}",
        "set outside": "{% set who = 'x' %}{% for m in messages %}{{ who }}" + body + "{% endfor %}",
        "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}" + body
                     + "{% endfor %}",
        "time": "{% for m in messages %}{{ strftime_now('%S') }}" + body + "{% endfor %}",
        "two loops": "{% for m in messages %}" + body + "{% endfor %}{% for m in messages %}" + body + "{% endfor %}",
        "filtered": "{% for m in messages if m.role != 'system' %}" + body + "{% endfor %}",
        "break": "{% for m in messages %}{% if m.role == 'tool' %}{% break %}{% endif %}" + body + "{% endfor %}",
        "messages reassigned": "{% set messages = messages[1:] %}{% for m in messages %}" + body + "{% endfor %}",
        "outer reads all": "{{ messages|length }}{% for m in messages %}" + body + "{% endfor %}",
        "bare loop": "{% for m in messages %}{{ loop }}" + body + "{% endfor %}",
    }
    for name, source in refused.items():
        assert split_template(env, source) is None, name


def test_later_turn_renders_only_its_new_messages(bpe):
    tk, md = bpe
    t = ChatTemplate(md["tokenizer.chat_template"], tk)
    msgs = [{"role": "system", "content": "You are terse."}]
    for i in range(40):
        msgs += [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
    msgs.append({"role": "user", "content": "And now?"})
    t.render(msgs)
    before = dict(t.chunks.stats)
    msgs = msgs + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
    got = t.render(msgs)
    assert t.chunks.stats["rendered"] - before["rendered"] == 2
    assert t.chunks.stats["kept"] - before["kept"] == len(msgs) - 2
    assert got.tokens == _whole(md["tokenizer.chat_template"], tk).render(msgs).tokens


def test_long_template_runs_stay_linear_and_many_new_messages_render_whole(bpe, monkeypatch):
    """Messages with empty contents make one run of template text: the kept runs grow by fragments (the run's text
    at each message was once kept whole, n^2 bytes: 200,000 such messages took the machine's memory). More than
    MAX_NEW new messages in one request go to the whole render; a later turn of a kept chat is chunked again."""
    import strata.text.chat_chunks as cc
    tk, md = bpe
    src = md["tokenizer.chat_template"]
    t = ChatTemplate(src, tk)
    msgs = [{"role": "user", "content": ""}] * 3000
    got = t.render(msgs)
    assert got.tokens == _whole(src, tk).render(msgs).tokens
    chain = t.chunks._chains[0]
    assert all(isinstance(x, int) for x in chain.tails)
    assert sum(len(f) for run in chain.acc for f in run[0]) < 2 * len(got.text)   # fragments, not prefixes
    monkeypatch.setattr(cc, "MAX_NEW", 4)
    t = ChatTemplate(src, tk)
    chat = [{"role": "user", "content": f"q{i}"} for i in range(4)]
    t.render(chat)
    assert t.chunks.stats["calls"] == 1
    more = chat + [{"role": "user", "content": f"r{i}"} for i in range(5)]
    assert t.render(more).tokens == _whole(src, tk).render(more).tokens
    assert t.chunks.stats["calls"] == 1          # five new messages: the whole render
    some = chat + [{"role": "user", "content": f"r{i}"} for i in range(4)]
    assert t.render(some).tokens == _whole(src, tk).render(some).tokens
    assert t.chunks.stats["calls"] == 2 and t.chunks.stats["kept"] == 4


def test_a_wrong_split_is_caught_by_the_first_check(bpe):
    """The first chunked answer is compared with the whole render: a split that does not render this template (here
    one of another template, put in by hand) turns the chunks off and the answer is the whole render's."""
    from strata.text.chat_chunks import MessageChunks
    from strata.text.chat_template import _prepare_message
    tk, md = bpe
    t = ChatTemplate(md["tokenizer.chat_template"], tk)
    t.chunks = MessageChunks(split_template(_environment(), LAST_TEMPLATE), _prepare_message, t._substitute)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "?"}]
    got = t.render(msgs)
    assert t.chunks is None
    assert got.tokens == _whole(md["tokenizer.chat_template"], tk).render(msgs).tokens


def test_bad_messages_are_refused_as_by_the_whole_render(bpe):
    tk, md = bpe
    t = ChatTemplate(md["tokenizer.chat_template"], tk)
    assert t.chunks is not None
    for msgs, needle in (([{"role": "user", "content": "hi"}, "hi"], "message 1 must be an object"),
                         ([{"role": "user", "content": "hi"}, {"content": "x"}], "message 1 has no role"),
                         ({"role": "user"}, "messages must be a list")):
        with pytest.raises(ValueError, match=needle):
            t.render(msgs)
    with pytest.raises(ValueError, match="pin_message 5 is out of range"):
        t.render([{"role": "user", "content": "hi"}], pin_message=5)


def test_renders_quickly_guesses_a_later_turn(bpe):
    tk, md = bpe
    t = ChatTemplate(md["tokenizer.chat_template"], tk)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert not t.renders_quickly(msgs)                 # nothing kept yet
    t.render(msgs)
    later = msgs + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More?"}]
    assert t.renders_quickly(later)
    assert not t.renders_quickly(msgs[:1] + [{"role": "user", "content": "Other"}] + later[2:])   # another chat
    assert not t.renders_quickly(msgs + [{"role": "user", "content": "x" * 20000}])      # much new text
    assert not t.renders_quickly(later + [{"role": "user", "content": "y"}] * 9)         # many new messages
