"""Chat templates the tests write into synthetic models (a Qwen-style one that knows tools, one that opens a reasoning
block) and the real templates of Qwen models (tests/data/templates, each as its model's tokenizer_config.json
chat_template gives it, copied from llama.cpp's models/templates)."""
import re
from pathlib import Path

import pytest

_REAL = Path(__file__).resolve().parent / "data" / "templates"
#: Qwen/Qwen3-0.6B (the Qwen3 family's): tools, the look-back for the last user query, reasoning, enable_thinking
QWEN3_TEMPLATE = (_REAL / "Qwen-Qwen3-0.6B.jinja").read_text()
#: Qwen/QwQ-32B (Qwen2.5's tool format): tool results grouped with their neighbours, reasoning cut from past turns
QWQ_TEMPLATE = (_REAL / "Qwen-QwQ-32B.jinja").read_text()
#: Qwen/Qwen3.5-4B: a content macro counting images in namespaces, the look-back, loop.previtem / nextitem
QWEN35_TEMPLATE = (_REAL / "Qwen3.5-4B.jinja").read_text()

# A Qwen-style chat template written from the documented prompt format of Qwen2.5 / Qwen3-Next-Instruct (ChatML;
# tools in the system turn inside <tools></tools>; calls as <tool_call> JSON; results as <tool_response> in a user
# turn).
QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for tc in (m.tool_calls or []) %}{% set f = tc.function %}{% if m.content or not loop.first %}
{% endif %}<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{{ '\n' }}{% endif %}
<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# A reasoning template in the manner of Qwen3.5's: the generation prompt opens a <think> block, or (enable_thinking
# false) writes an empty one.
THINK_TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


def same_render(kept, whole, msgs, **args) -> bool:
    """Asserts the kept-output render equals the whole render of `msgs` (text, tokens, cut points, content safety);
    where the whole render refuses, the kept one must refuse with the same message. True when it rendered."""
    try:
        ref = whole.render(msgs, **args)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e)[:40])):
            kept.render(msgs, **args)
        return False
    got = kept.render(msgs, **args)
    assert got.text == ref.text
    assert got.tokens == ref.tokens
    assert got.cut_points == ref.cut_points
    assert got.content_safe == ref.content_safe
    return True
