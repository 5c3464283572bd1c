"""A request's tools, reasoning and structured output around the engine: the chat template's inputs, the grammar the answer follows, and the answer split into content, reasoning_content and tool_calls (whole and streamed alike)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from strata.structured import reasoning, tool_calls
from strata.sampling.grammar import Constraint, GrammarError, gbnf_grammar, lark_grammar, lark_json
from strata.errors import Refused

_TOOL_ROLE: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


@dataclass
class ChatPlan:
    """What a chat request needs besides its sampling: the messages, tools and keyword variables for the template;
    the tool-call format whose calls the answer may hold (None: no parsing); whether reasoning is split off; the
    Lark rule of a forced answer (start rule `body`, or None); the control tokens the answer must show."""
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict
    pin: int | None
    fmt: tool_calls.ToolFormat | None = None
    tool_defs: list[dict] = field(default_factory=list)
    reasoning: bool = False
    thinks: bool = False                     # the template knows <think> blocks
    think_open: bool = False                 # the rendered prompt left one open
    think_closed: bool = False               # the rendered prompt ends with a closed one (thinking switched off)
    body: str | None = None
    gbnf: str | None = None                  # the request's own grammar (llama-server's `grammar`): the whole answer
    show_tokens: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()              # the request's stop strings: one can end the answer inside a call block

    def answer(self) -> "Answer":
        return Answer(self)


def plan_chat(engine, p) -> ChatPlan:
    """The plan of a parsed chat request (strata.serve.schema.parse_chat) on this engine's template."""
    template = getattr(engine, "template", None)
    source = getattr(template, "source", "") or ""
    plan = ChatPlan(messages=p.messages, tools=None, template_kwargs=dict(p.template_kwargs), pin=p.pin,
                    stop=tuple(getattr(p, "stop", ()) or ()))
    plan.thinks = reasoning.template_thinks(source)
    plan.reasoning = p.reasoning and plan.thinks
    fmt = tool_calls.detect(source)
    if any(m.get("tool_calls") or m.get("role") == "tool" for m in p.messages):
        # earlier calls and their results as this family's template wants them, whether or not tools come now
        plan.messages = tool_calls.template_messages(
            p.messages, fmt, renders_tool_role=fmt.native or _renders_tool_role(template))
    if not p.tools or p.tool_choice == "none":
        if p.output is not None and p.output["type"] == "grammar":
            plan.gbnf = p.output["grammar"]
        elif p.output is not None:
            plan.body = _output_body(p.output)
        return plan
    plan.fmt, plan.tool_defs = fmt, p.tools
    if fmt.native:
        plan.tools = p.tools
    else:
        msgs = list(plan.messages)
        prompt = tool_calls.generic_system_prompt(p.tools)
        if msgs and msgs[0].get("role") == "system":
            msgs[0] = dict(msgs[0], content=(msgs[0].get("content") or "") + "\n\n" + prompt)
        else:
            msgs.insert(0, {"role": "system", "content": prompt})
            if plan.pin is not None:
                plan.pin += 1
        plan.messages = msgs
    if p.tool_choice == "required" or isinstance(p.tool_choice, dict):
        plan.body = fmt.grammar(p.tools, p.tool_choice, p.parallel_tool_calls, _special_ref(engine)).replace(
            "calls:", "body:", 1)
    elif p.output is not None:
        plan.body = _output_body(p.output)
    elif not fmt.native:
        # the generic format is a JSON answer: held to its shape, calls or a response (llama.cpp does the same)
        schema = tool_calls.generic_schema(p.tools, p.tool_choice, p.parallel_tool_calls, allow_response=True)
        plan.body = f"body: {lark_json(schema)}\n"
    plan.show_tokens = _control_ids(engine, fmt.marker_tokens)
    return plan


def after_render(plan: ChatPlan, prompt_text: str) -> None:
    """What the rendered prompt tells: whether it left a reasoning block open for the answer."""
    plan.think_open = plan.thinks and reasoning.prompt_opens(prompt_text)
    plan.think_closed = plan.thinks and reasoning.prompt_closes(prompt_text)


def chat_constraint(engine, plan: ChatPlan, param: str) -> Constraint | None:
    """The compiled grammar of a chat answer (a reasoning block first when the template has one), or None. Runs the
    compile (call it off the event loop); Refused naming `param` for a schema llguidance refuses. The request's own
    grammar holds the whole answer, a reasoning block included, as llama-server applies one."""
    if plan.gbnf is not None:
        return _compile(engine, lambda: gbnf_grammar(plan.gbnf), param)
    if plan.body is None:
        return None
    if plan.think_open:             # the answer starts inside the block: any text up to </think>, then the body
        start = "start: think WS? body\nthink[lazy]: /(?s:.*)<\\/think>/\nWS: /[ \\t\\r\\n]+/\n"
    elif plan.thinks and plan.reasoning and not plan.think_closed:   # the model may open one itself
        start = "start: (think WS?)? body\nthink[lazy]: /<think>(?s:.*)<\\/think>/\nWS: /[ \\t\\r\\n]+/\n"
    else:
        start = "start: body\n"
    return _compile(engine, lambda: lark_grammar(start + plan.body), param)


def completion_constraint(engine, p) -> Constraint | None:
    """The compiled grammar of a raw completion's json_schema / grammar field (or its response_format), or None."""
    if p.output is None:
        return None
    o = p.output
    if o["type"] == "grammar":
        return _compile(engine, lambda: gbnf_grammar(o["grammar"]), o["param"])
    return _compile(engine, lambda: lark_grammar("start: body\n" + _output_body(o)), o["param"])


def param_of(p) -> str:
    """The request field a chat grammar comes from (for error messages)."""
    if p.output is not None:
        return p.output.get("param", "response_format")
    return "tools"


def _output_body(o: dict) -> str:
    """The Lark rule `body` of a json_schema output (strict: keywords llguidance does not implement are errors)."""
    schema = dict(o["schema"])
    if o.get("strict"):
        schema["x-guidance"] = dict(schema.get("x-guidance") or {}, lenient=False)
    return f"body: {lark_json(schema)}\n"


def _compile(engine, make_grammar, param: str) -> Constraint:
    """The Constraint of the grammar make_grammar() writes; Refused naming `param` when llguidance refuses it or it
    is over the size limit (strata.sampling.grammar.MAX_GRAMMAR_CHARS)."""
    try:
        return Constraint(make_grammar(), engine.tokenizer, getattr(engine, "n_vocab", None))
    except GrammarError as e:
        raise Refused(f"'{param}': {e}", param=param) from None


def _special_ref(engine):
    """special(text) -> '<[id]>' (a Lark token reference) when text is one control token of the vocabulary."""
    tk = engine.tokenizer

    def special(text: str) -> str | None:
        i = tk.token_to_id(text)
        return f"<[{i}]>" if i is not None and tk.is_control(i) else None
    return special


def _control_ids(engine, texts) -> frozenset[int]:
    tk = engine.tokenizer
    ids = (tk.token_to_id(t) for t in texts)
    return frozenset(i for i in ids if i is not None and tk.is_control(i))


def _renders_tool_role(template) -> bool:
    """Whether the chat template writes a tool message's content (else the generic format sends tool results as user
    messages). Probed once per template."""
    if template is None:
        return True
    if template not in _TOOL_ROLE:
        probe = "zq7tool-probe-result"
        try:
            text = template.render_text([{"role": "user", "content": "hi"}, {"role": "tool", "content": probe}],
                                        add_generation_prompt=False)
            _TOOL_ROLE[template] = probe in text
        except ValueError:
            _TOOL_ROLE[template] = False
    return _TOOL_ROLE[template]


# ------------------------------------------------------------------------------------------------- the answer

class _Trim:
    """Whitespace off both ends of a streamed text: leading whitespace dropped, trailing whitespace held until
    more text follows it."""

    def __init__(self):
        self.started = False
        self.held = ""

    def feed(self, t: str) -> str:
        if not self.started:
            t = t.lstrip()
            if not t:
                return ""
            self.started = True
        t = self.held + t
        s = t.rstrip()
        self.held = t[len(s):]
        return s


class Answer:
    """One chat answer taken apart as it streams: feed(text) and finish() return the OpenAI deltas ({"content"},
    {"reasoning_content"}, {"tool_calls": [...]}); message() is the non-streamed message those deltas assemble to.
    With neither tools nor reasoning the text passes through untouched; with either, content and reasoning_content
    come without the whitespace around them."""

    def __init__(self, plan: ChatPlan):
        self.stop = frozenset(plan.stop)
        self.split = reasoning.ReasoningSplit(plan.think_open) if plan.reasoning else None
        self.calls = plan.fmt.parser(plan.tool_defs) if plan.fmt is not None else None
        self.plain = self.split is None and self.calls is None
        self.c_trim, self.r_trim = _Trim(), _Trim()
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[dict] = []

    def feed(self, text: str) -> list[dict]:
        if self.plain:
            if text:
                self.content.append(text)
            return [{"content": text}] if text else []
        pieces = self.split.feed(text) if self.split is not None else [("content", text)]
        return self._pieces(pieces)

    def cut_by(self, final) -> bool:
        """Whether the answer its FinalEvent `final` ends was cut off: by max_tokens or the context's end
        (finish_reason "length"), or by one of the request's stop strings (which can match inside a call block, e.g.
        a stop of "_call>" after "<tool")."""
        return final.finish_reason == "length" or (final.strata or {}).get("stopped_by") in self.stop

    def finish(self, cut: bool = False) -> list[dict]:
        """The last deltas; cut: the answer was cut off (cut_by: CallParser.finish)."""
        if self.plain:
            return []
        out = self._pieces(self.split.finish()) if self.split is not None else []
        if self.calls is not None:
            out += self._events(self.calls.finish(cut))
        return out

    def _pieces(self, pieces) -> list[dict]:
        out: list[dict] = []
        for channel, text in pieces:
            if channel == "reasoning":
                t = self.r_trim.feed(text)
                if t:
                    self.reasoning.append(t)
                    out.append({"reasoning_content": t})
            elif self.calls is not None:
                out += self._events(self.calls.feed(text))
            else:
                out += self._content(text)
        return out

    def _content(self, text: str) -> list[dict]:
        t = self.c_trim.feed(text)
        if t:
            self.content.append(t)
            return [{"content": t}]
        return []

    def _events(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if e.kind == "content":
                out += self._content(e.text)
            elif e.kind == "call":
                self.tool_calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
                out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
            else:
                self.tool_calls[e.index]["function"]["arguments"] += e.text
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return out

    def message(self) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
            if not msg["content"]:
                msg["content"] = None
        return msg

    def finish_reason(self, engine_reason: str) -> str:
        """"tool_calls" for an answer with calls that ended on its own; else the engine's reason."""
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason

