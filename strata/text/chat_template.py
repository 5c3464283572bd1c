"""Chat template: `tokenizer.chat_template` rendered in a jinja2 sandbox the Hugging Face way, giving token ids and cut points."""
from __future__ import annotations

import bisect
import copy
import functools
import json
import secrets
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.text.chat_chunks import MessageChunks, _split_sentinels, split_template
from strata.text.chat_prefixes import PrefixEnds, is_plain, prefix_digests
from strata.text.chat_window import WindowChunks
from strata.text.content_shape import SENTINELS, SentinelRendering, content_shape, string_markers
from strata.text.window_proof import split_window
from strata.text.token_ids import frozen_ids
from strata.text.tokenizer import Tokenizer
from strata.text.turn_tokens import TurnTokens

CutKind = Literal["root", "message", "turn", "pin"]
_KIND_ORDER = {"root": 0, "message": 1, "pin": 2, "turn": 3}
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_IMMUTABLE = (str, int, float, bool)     # values a copy may share (nothing can change them)
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})   # render's own variables
MESSAGE_CUTS = 64   # messages at the end of a chat that get a "message" cut point (each costs a prefix render)


@dataclass(frozen=True)
class CutPoint:
    """A token position where the prompt may be split and a checkpoint saved.

    pos: number of prompt tokens before the cut. kind: "root" (end of the leading system message(s)),
    "message" (end of message `index`), "turn" (start of the final generation prompt, index None),
    "pin" (end of the client-pinned message `index`).
    """
    pos: int
    kind: CutKind
    index: int | None = None


class RenderedPrompt:
    """Prompt token ids (``ids``: a read-only int32 array; ``tokens``: the same as a list, made on first use), cut
    points sorted by pos (several kinds may share a pos), and the rendered text.

    content_safe: True when message contents were tokenized as plain text by the sentinel method (always
    the case unless the template transforms contents; see ChatTemplate.render). tokenize_s: the seconds spent
    splitting and tokenizing the text (the rest of a render is the template's). reused: leading ids taken from an
    earlier render (strata.text.turn_tokens).
    """

    def __init__(self, tokens, cut_points: list[CutPoint], text: str, content_safe: bool = True,
                 tokenize_s: float = 0.0, reused: int = 0):
        self.ids = frozen_ids(tokens)
        self.cut_points = cut_points
        self.text = text
        self.content_safe = content_safe
        self.tokenize_s = tokenize_s
        self.reused = reused
        self._tokens: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._tokens = self.ids.tolist()
        return self._tokens

    def __repr__(self) -> str:
        return f"RenderedPrompt({len(self.ids)} tokens, {len(self.cut_points)} cut points)"


class _GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker): renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


@jinja2.pass_context
def _tojson(ctx, x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: no HTML escaping, json.dumps options exposed; in a sentinel rendering the sentinels
    # it escapes are marked (strata.text.content_shape.SentinelRendering)
    out = json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    sr = ctx.get(SENTINELS)
    return sr.escaped(out, bool(ensure_ascii)) if type(sr) is SentinelRendering else out


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, its attribute verdicts remembered per (type, attribute) for the plain types a chat
    template reads (the loop's context, strings, dicts, lists, numbers): jinja2 decides them from the object's type
    and the attribute's name alone (is_internal_attribute, modifies_known_mutable: isinstance checks, some against
    ABCs, a few microseconds each), so the verdict is the same; a long chat reads `loop.first` and friends per
    message."""

    _PLAIN = frozenset({jinja2.runtime.LoopContext, str, dict, list, tuple, int, float, bool, type(None)})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj, attr, value) -> bool:
        t = type(obj)
        if t not in self._PLAIN:
            return super().is_safe_attribute(obj, attr, value)
        key = (t, attr)
        v = self._verdicts.get(key)
        if v is None:
            v = self._verdicts[key] = super().is_safe_attribute(obj, attr, value)
        return v


def _environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment of transformers' _compile_jinja_template (utils/chat_template_utils.py)."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


#: the deepest nesting of lists and objects a tool call's arguments may have (deeper ones would exhaust the
#: interpreter's recursion in copying, rendering and tojson)
MAX_ARGUMENT_DEPTH = 64


class TemplateRefusal(ValueError):
    """The chat template failed or refused to render (its raise_exception, a type error in its code, tool-call
    arguments nested past MAX_ARGUMENT_DEPTH); `param` names the request field it could not read where that is known
    (else None)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _prepare_messages(messages, object_arguments: bool = False) -> list[dict]:
    """A fresh copy: None-valued keys dropped, reasoning fields aliased (as transformers does), tool-call arguments
    as objects where the template needs them (see _prepare_message)."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    return [_prepare_message(m, i, object_arguments) for i, m in enumerate(messages)]


def _prepare_message(m, i: int, object_arguments: bool = False) -> dict:
    """Message `i` of a chat as the template reads it (see _prepare_messages); ValueError for one that is not an
    object with a role. With object_arguments, each tool call's arguments given as a string holding a JSON object
    become that object (its keys in the client's order; a blank string an empty object); any other string stays as
    the client sent it. TemplateRefusal for arguments nested past MAX_ARGUMENT_DEPTH."""
    if not isinstance(m, dict):
        raise ValueError(f"message {i} must be an object, got {type(m).__name__}")
    if "role" not in m:
        raise ValueError(f"message {i} has no role")
    calls = m.get("tool_calls")
    for j, tc in enumerate(calls if isinstance(calls, list) else ()):       # checked before anything copies them
        fn = tc.get("function") if isinstance(tc, dict) else None
        if isinstance(fn, dict) and nesting(fn.get("arguments")) > MAX_ARGUMENT_DEPTH:
            field = f"messages[{i}].tool_calls[{j}].function.arguments"
            raise TemplateRefusal(f"{field}: nested deeper than {MAX_ARGUMENT_DEPTH} levels", field)
    m = {k: v if type(v) in _IMMUTABLE else copy.deepcopy(v) for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    if object_arguments and isinstance(m.get("tool_calls"), list):
        for tc in m["tool_calls"]:
            fn = tc.get("function") if isinstance(tc, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                parsed = json_object(fn["arguments"])
                if parsed is not None:
                    fn["arguments"] = parsed
    return m


def nesting(v) -> int:
    """How deeply lists and objects nest in `v` (0 for a scalar), counted up to one past MAX_ARGUMENT_DEPTH."""
    depth, level = 0, [v]
    while depth <= MAX_ARGUMENT_DEPTH:
        level = [x for x in level if isinstance(x, (dict, list))]
        if not level:
            return depth
        depth += 1
        level = [y for x in level for y in (x.values() if isinstance(x, dict) else x)]
    return depth


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def json_object(s: str) -> dict | None:
    """The JSON object `s` holds (strict JSON: no NaN / Infinity; nested at most MAX_ARGUMENT_DEPTH deep), {} for a
    blank string, None for anything else."""
    if not s.strip():
        return {}
    try:
        v = json.loads(s, parse_constant=_no_constant)
    except (ValueError, RecursionError):      # JSONDecodeError, NaN; nesting past the interpreter's depth
        return None
    return v if type(v) is dict and nesting(v) <= MAX_ARGUMENT_DEPTH else None


def _string_arguments(messages) -> list[str]:
    """The fields `messages[i].tool_calls[j].function.arguments` that hold a string that is no JSON object."""
    out = []
    for i, m in enumerate(messages if isinstance(messages, (list, tuple)) else ()):
        tcs = m.get("tool_calls") if isinstance(m, dict) else None
        for j, tc in enumerate(tcs if isinstance(tcs, list) else ()):
            fn = tc.get("function") if isinstance(tc, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str) and json_object(fn["arguments"]) is None:
                out.append(f"messages[{i}].tool_calls[{j}].function.arguments")
    return out


#: a tool call's arguments whose key the argument probe looks for in the rendering (see ChatTemplate._probe_arguments)
_PROBE_KEY = "zqxprobe_argument_key"
_PROBE_ARGS = {_PROBE_KEY: "zqxprobe argument value"}


def _cut_pieces(pieces: list[tuple[str, bool]], n: int) -> list[tuple[str, bool]]:
    """The [(text, parse_special)] pieces covering the first n characters of what they covered."""
    out, pos = [], 0
    for t, special in pieces:
        if pos >= n:
            break
        out.append((t[:n - pos], special))
        pos += len(t)
    return [(t, special) for t, special in out if t]


def _wanted(msgs, pin_message: int | None, continue_final_message: bool) -> tuple[set[int], int]:
    """(the messages that get a "message" cut point, the number of leading system messages). Each cut costs a render
    of its prefix where it is not kept: only the last MESSAGE_CUTS messages, the leading system messages' end (root)
    and the pinned message get one, so a long conversation renders in linear time."""
    n_sys = 0
    while n_sys < len(msgs) and msgs[n_sys].get("role") in ("system", "developer"):
        n_sys += 1
    wanted = set(range(max(0, len(msgs) - MESSAGE_CUTS), len(msgs) - int(continue_final_message)))
    if n_sys:
        wanted.add(n_sys - 1)
    if pin_message is not None:
        wanted.add(pin_message)
    return wanted, n_sys


class ChatTemplate:
    """Renders chats with a model's Jinja chat template and tokenizes them safely.

    Rendering follows Hugging Face transformers' apply_chat_template (ImmutableSandboxedEnvironment with
    trim_blocks/lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, transformers' `tojson`,
    variables messages/tools/documents/add_generation_prompt/bos_token/eos_token plus any extra keyword such
    as enable_thinking). Tool-call arguments reach the template as it reads them (object_arguments, probed once at
    load as llama.cpp probes requires_object_arguments): a template that cannot read a JSON string gets the object the
    string holds; others get the string as sent.

    Client text never becomes control tokens: the chat is also rendered with unique sentinel strings in place
    of every client string (message contents and text parts, tool-call arguments, reasoning); when putting
    the real strings back in gives exactly the real rendering, the template's own text is tokenized with
    special-token parsing and the client strings without it (llama.cpp's fragment rules, so the ids equal
    llama.cpp's tokenization of the same text wherever the contents hold no special-token text).
    A template that strips, trims, splits or tests contents (Qwen's) gets them shaped: their edge whitespace and
    the markers it looks for stay literal around sentinels of the rest, where the tokenizer's special tokens prove
    that tokenizes as plain text (strata.text.content_shape); a client string its tojson escapes is put back
    escaped. Fallback when a template transforms contents otherwise: each client string found
    verbatim in the rendering, in order, is marked plain text; then if the result still holds more control
    tokens than the template alone produces, render raises ValueError rather than let client text
    become control tokens.
    """

    def __init__(self, template_str: str, tokenizer: Tokenizer, bos_token: str | None = None,
                 eos_token: str | None = None, special_tokens: dict[str, str] | None = None):
        if not isinstance(template_str, str) or not template_str.strip():
            raise ValueError("chat template is empty")
        self.source = template_str
        self.tokenizer = tokenizer
        self.bos_token = bos_token if bos_token is not None else (
            tokenizer.tokens[tokenizer.bos_id] if tokenizer.bos_id is not None else "")
        self.eos_token = eos_token if eos_token is not None else (
            tokenizer.tokens[tokenizer.eos_id] if tokenizer.eos_id is not None else "")
        self.special_tokens = dict(special_tokens or {})
        self.prefix_ends = PrefixEnds()        # message ends rendered by earlier requests (strata.text.chat_prefixes)
        self.turns = TurnTokens(tokenizer)     # earlier renders' ids, reused up to what changed (strata.text.turn_tokens)
        env = _environment()
        try:
            self._template = env.from_string(template_str)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {_one_line(e)}") from None
        # client strings shaped for the sentinel method where the template reads them (strata.text.content_shape)
        self._shape = content_shape(string_markers(env, template_str), tokenizer.special_texts)
        self.object_arguments = self._probe_arguments()
        prepare = functools.partial(_prepare_message, object_arguments=self.object_arguments)
        # each message's output kept across requests where the template provably renders messages one by one
        # (strata.text.chat_chunks); checked once against the whole render on the first chat it renders
        split = split_template(env, template_str)
        if split is not None:
            self.chunks = MessageChunks(split, prepare, self._substitute)
        else:          # messages that read their neighbours or the state set before the loop (strata.text.chat_window)
            wsplit = split_window(env, template_str)
            self.chunks = None if wsplit is None else WindowChunks(wsplit, prepare, self._substitute)
        self._chunks_checked = False

    @classmethod
    def from_gguf(cls, metadata: dict, tokenizer: Tokenizer) -> "ChatTemplate":
        """From `tokenizer.chat_template`; ValueError if the GGUF has none."""
        t = metadata.get("tokenizer.chat_template")
        if not t:
            raise ValueError("GGUF has no tokenizer.chat_template")
        return cls(str(t), tokenizer)

    # ----------------------------------------------------------------- text
    def render_text(self, messages, add_generation_prompt: bool = True, tools=None, documents=None,
                    **kw) -> str:
        """The rendered prompt text. Raises ValueError (one line) for bad messages, TemplateRefusal for template
        errors / raise_exception."""
        try:
            return self._render(_prepare_messages(messages, self.object_arguments), add_generation_prompt, tools,
                                documents, kw)
        except TemplateRefusal as e:
            raise self._refusal(messages, e) from None

    def _render(self, messages, add_generation_prompt, tools, documents, kw) -> str:
        variables = dict(self.special_tokens)
        variables.update(bos_token=self.bos_token, eos_token=self.eos_token)
        variables.update(kw)
        try:
            return self._template.render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise TemplateRefusal(f"chat template error: {_one_line(e)}") from None
        except Exception as e:  # template code errors (TypeError, KeyError, ...) are the template's problem
            raise TemplateRefusal(f"chat template error: {type(e).__name__}: {_one_line(e)}") from None

    def _probe_arguments(self) -> bool:
        """Whether the template needs tool-call arguments as an object (llama.cpp's requires_object_arguments): a
        past call whose arguments are a JSON string does not render its key as the template's own syntax (an error,
        the key dropped, or the whole string escaped by tojson), while the same arguments as an object do. Rendered
        once, at load."""
        def renders(args) -> bool:
            msgs = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call1abcd", "type": "function",     # 9 letters and digits, as Mistral's require
                         "function": {"name": "probe_tool", "arguments": args}}]}]
            try:
                text = self._render(_prepare_messages(msgs), False, None, None, {})
            except ValueError:
                return False
            return _PROBE_KEY in text and f'\\"{_PROBE_KEY}' not in text
        return not renders(json.dumps(_PROBE_ARGS)) and renders(_PROBE_ARGS)

    def _refusal(self, messages, e: TemplateRefusal) -> TemplateRefusal:
        """`e` naming the tool call whose arguments a template that reads them as an object could not read (a
        string that is no JSON object), where there is one."""
        if self.object_arguments and e.param is None:
            fields = _string_arguments(messages)
            if fields:
                return TemplateRefusal(f"{fields[0]}: must be a JSON object for this model's chat template, which "
                                       f"reads tool-call arguments as an object ({e})", fields[0])
        return e

    # ----------------------------------------------------------------- tokens + cut points
    def render(self, messages, add_generation_prompt: bool = True, tools=None, documents=None,
               pin_message: int | None = None, text_check=None, continue_final_message: bool = False,
               **kw) -> RenderedPrompt:
        """Render and tokenize a chat, finding its cut points.

        Cut points are found by rendering prefixes of the conversation (for the last MESSAGE_CUTS messages, the
        root and the pin only, so that the work stays linear in the conversation): message_at(i) is the length of
        render(messages[:i+1], add_generation_prompt=False) when that text is a prefix of the full text and
        its tokens are a prefix of the full tokens (otherwise that cut point is skipped); root_at is
        message_at of the last leading system message; turn_at is the length of the chat rendered without the
        generation prompt (only with add_generation_prompt: the last message's prefix); pin_at is
        message_at(pin_message). A template that renders each message on its own (self.chunks,
        strata.text.chat_chunks) renders only the messages no kept conversation holds exactly, and finds the message
        ends from the kept outputs (one whose messages read their neighbours and the state set before the loop,
        strata.text.chat_window, likewise the messages whose output can have changed); other templates reuse prefix lengths rendered by earlier requests
        (self.prefix_ends, keyed by the messages, checked against the new text), so a later turn renders only its new
        prefixes. Either way the result is that of rendering everything.
        text_check, if given, is called with the rendered text before anything is tokenized (the engine refuses
        text that cannot fit its context there). continue_final_message (with add_generation_prompt false) leaves
        the last message open, its text the end of the prompt, as transformers' apply_chat_template does (an
        answer continues it: Anthropic's prefill). Raises ValueError for bad messages or a bad pin_message,
        TemplateRefusal for template errors (naming the tool call's arguments a template that reads them as an
        object could not read), and whatever text_check raises.
        """
        try:
            return self._render_prompt(messages, add_generation_prompt, tools, documents, pin_message, text_check,
                                       continue_final_message, kw)
        except TemplateRefusal as e:
            raise self._refusal(messages, e) from None

    def _render_prompt(self, messages, add_generation_prompt, tools, documents, pin_message, text_check,
                       continue_final_message, kw) -> RenderedPrompt:
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"messages must be a list, got {type(messages).__name__}")
        n = len(messages)
        if pin_message is not None:
            if pin_message is not None and not (isinstance(pin_message, int) and not isinstance(pin_message, bool)
                                                and -n <= pin_message < n):
                _prepare_messages(messages, self.object_arguments)           # a bad message is reported first
            if isinstance(pin_message, bool) or not isinstance(pin_message, int):
                raise ValueError(f"pin_message must be a message index, got {pin_message!r}")
            if pin_message < 0:
                pin_message += n
            if not 0 <= pin_message < n:
                raise ValueError(f"pin_message {pin_message} is out of range for {n} messages")
        chunked = None if continue_final_message else self._render_chunks(
            messages, add_generation_prompt, tools, documents, kw, pin_message)
        if chunked is not None:
            msgs, text, pieces, safe, wanted, n_sys, ends = None, *chunked
            if text_check is not None:
                text_check(text)
        else:
            msgs = _prepare_messages(messages, self.object_arguments)
            text = self._render(msgs, add_generation_prompt, tools, documents, kw)
            if text_check is not None:
                text_check(text)
            pieces, safe = self._pieces(msgs, text, add_generation_prompt, tools, documents, kw)
            wanted, n_sys = _wanted(msgs, pin_message, continue_final_message)
            ends = None
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message needs add_generation_prompt false")
            text = self._open_final(msgs, text, tools, documents, kw)
            pieces = _cut_pieces(pieces, len(text))
        tk = self.tokenizer
        t_tok = time.perf_counter()
        if safe is False:
            joined, frags = tk.split_special(pieces)
            # fallback guard: client text must not add control tokens beyond the template's own
            tmpl_ctrl = self._template_control_count(msgs, add_generation_prompt, tools, documents, kw)
            n_ctrl = sum(1 for f in frags if f.token_id is not None and tk.is_control(f.token_id))
            if tmpl_ctrl is None or n_ctrl > tmpl_ctrl:
                raise ValueError("message content would become control tokens (the template transforms "
                                 "contents, so they cannot be isolated)")
        t_tok_more = time.perf_counter()
        # the pieces tokenized, reusing an earlier render's ids up to what changed (strata.text.turn_tokens)
        tok = self.turns.tokenize(pieces)
        joined, frags, parts, starts, bos = tok.text, tok.frags, tok.parts, tok.starts, tok.bos
        if joined != text:  # pieces always cover the text; guard against a logic error
            raise ValueError("internal error: prompt pieces do not cover the rendered text")
        n_tokens = len(tok.ids)
        char_starts = tok.char_starts
        tokenize_s = time.perf_counter() - t_tok_more + (t_tok_more - t_tok if safe is False else 0.0)

        def char_to_pos(c: int) -> int | None:
            """Token position of a cut at character c, if the tokens of text[:c] are a prefix of tokens."""
            if c == len(text):
                return n_tokens
            if c == 0:
                return bos
            k = bisect.bisect_right(char_starts, c) - 1      # the fragment holding character c
            if k < 0 or c >= frags[k].end:
                return None
            f = frags[k]
            if f.start == c:
                return starts[k]
            if f.token_id is not None:
                return None
            head = text[f.start:c]
            prev_special = k == 0 or frags[k - 1].token_id is not None
            ids = tk.encode_raw(head, after_special=prev_special)
            if parts[k][:len(ids)] == ids:
                return starts[k] + len(ids)
            return None

        cuts: list[CutPoint] = []
        msg_pos: dict[int, int] = {}
        if ends is None:
            ends = self._message_ends(msgs, wanted, text, add_generation_prompt, tools, documents, kw)
        for i in sorted(wanted):
            c = ends.get(i)
            if c is None:
                continue
            p = char_to_pos(c)
            if p is None:
                continue
            msg_pos[i] = p
            cuts.append(CutPoint(p, "message", i))
        if n_sys and (n_sys - 1) in msg_pos:
            cuts.append(CutPoint(msg_pos[n_sys - 1], "root", n_sys - 1))
        if pin_message is not None and pin_message in msg_pos:
            cuts.append(CutPoint(msg_pos[pin_message], "pin", pin_message))
        if add_generation_prompt and n:
            c = ends.get(n - 1)      # the chat without the generation prompt: the last message's prefix
            p = char_to_pos(c) if c is not None else None
            if p is not None:
                cuts.append(CutPoint(p, "turn", None))
        cuts.sort(key=lambda cp: (cp.pos, _KIND_ORDER[cp.kind], -1 if cp.index is None else cp.index))
        return RenderedPrompt(tok.ids, text=text, cut_points=cuts, content_safe=safe, tokenize_s=tokenize_s,
                              reused=tok.reused)

    def renders_quickly(self, messages) -> bool:
        """Whether rendering `messages` will likely take about a millisecond: most of them kept from an earlier
        render (strata.text.chat_chunks.MessageChunks.quick); a guess, never a promise."""
        return self.chunks is not None and isinstance(messages, list) and bool(messages) and \
            self.chunks.quick(messages)

    def _render_chunks(self, messages, add_generation_prompt, tools, documents, kw, pin_message):
        """(text, pieces, safe, wanted, n_sys, ends) of the chat through self.chunks, or None where it does not
        answer (no split, inputs that are not plain data, a message that renders only within the whole chat). The
        first answer is compared with the whole render's; a difference turns the chunks off for good."""
        if self.chunks is None or not messages or _RESERVED & kw.keys() or set(map(type, messages)) != {dict}:
            return None
        context = [tools, documents, sorted(kw.items())]
        if not is_plain([tools, documents, dict(kw)]):
            return None
        variables = dict(self.special_tokens)
        variables.update(bos_token=self.bos_token, eos_token=self.eos_token)
        variables.update(kw)
        variables.update(tools=tools, documents=documents)
        wanted, n_sys = _wanted(messages, pin_message, False)
        got = self.chunks.render(messages, add_generation_prompt, variables, repr(context), wanted)
        if got is None:
            return None
        ends = dict(got.ends)
        if not add_generation_prompt:
            ends[len(messages) - 1] = len(got.text)
        out = (got.text, got.pieces, True, wanted, n_sys, ends)
        if not self._chunks_checked:
            self._chunks_checked = True
            msgs = _prepare_messages(messages, self.object_arguments)
            text = self._render(msgs, add_generation_prompt, tools, documents, kw)
            pieces, safe = self._pieces(msgs, text, add_generation_prompt, tools, documents, kw)
            whole = self._message_ends(msgs, wanted, text, add_generation_prompt, tools, documents, kw)
            if (text, [(t, bool(f)) for t, f in pieces if t], safe, whole) != (got.text, got.pieces, True, ends):
                self.chunks = None
                return None
        return out

    def _open_final(self, msgs, text, tools, documents, kw) -> str:
        """`text` (msgs rendered without a generation prompt) cut right after the last message's text, as
        transformers' continue_final_message cuts it: a tag appended to that text (the last text block of a
        list), the render cut before the tag (and its trailing space trimmed where the template trimmed the
        tag's). ValueError when the template does not keep that text or the cut text does not begin `text`."""
        if not msgs:
            raise ValueError("continue_final_message needs a message to continue")
        tag = f"zqx{secrets.token_hex(4)}cont "
        tagged = [dict(m) for m in msgs]
        last = tagged[-1]
        c = last.get("content")
        if isinstance(c, str):
            last["content"] = c + tag
        elif isinstance(c, list) and any(isinstance(b, dict) and isinstance(b.get("text"), str) for b in c):
            c = last["content"] = [dict(b) if isinstance(b, dict) else b for b in c]
            i = max(j for j, b in enumerate(c) if isinstance(b, dict) and isinstance(b.get("text"), str))
            c[i]["text"] += tag
        else:
            raise ValueError("continue_final_message needs text in the last message to continue")
        r = self._render(tagged, False, tools, documents, kw)
        loc = r.rfind(tag.strip())
        if loc < 0:
            raise ValueError("the chat template drops the last message's text: it cannot be continued")
        cut = r[:loc] if r[loc:loc + len(tag)] == tag else r[:loc].rstrip()
        if not text.startswith(cut):
            raise ValueError("the chat template renders the last message's text differently when it is continued")
        return cut

    def _message_ends(self, msgs, wanted, text, add_generation_prompt, tools, documents, kw) -> dict[int, int]:
        """{i: len(render(msgs[:i+1], add_generation_prompt=False))} for each i in `wanted` whose prefix renders
        and is a prefix of `text` (the last message's is the whole text without a generation prompt). Ends kept
        from earlier requests (self.prefix_ends) are used when `text` starts with the text they were rendered as;
        the rest are rendered and kept."""
        n = len(msgs)
        keys = self.prefix_ends.chain([tools, documents, dict(sorted(kw.items()))], msgs)

        def render_end(i: int) -> int | None:
            try:
                prefix = self._render(msgs[:i + 1], False, tools, documents, kw)
            except ValueError:
                return None
            return len(prefix) if text.startswith(prefix) else None

        ends: dict[int, int] = {}
        kept: dict[int, tuple[int, bytes]] = {}
        fresh: dict[int, int] = {}
        for i in wanted:
            if i == n - 1 and not add_generation_prompt:
                ends[i] = len(text)
                continue
            hit = self.prefix_ends.get(keys[i]) if keys is not None else None
            if hit is not None and hit[0] <= len(text):
                kept[i] = hit
                continue
            c = render_end(i)
            if c is not None:
                fresh[i] = c
        digests = prefix_digests(text, [c for c, _ in kept.values()] + list(fresh.values()))
        for i, (c, d) in kept.items():
            if digests[c] == d:
                ends[i] = c
                continue
            self.prefix_ends.stale()         # the template rendered these messages differently before: again
            c = render_end(i)
            if c is not None:
                fresh[i] = c
                digests.update(prefix_digests(text, [c]))
        for i, c in fresh.items():
            ends[i] = c
            if keys is not None:
                self.prefix_ends.put(keys[i], c, digests[c])
        return ends

    # ----------------------------------------------------------------- sentinels
    def _substitute(self, msgs: list[dict], nonce: str) -> tuple[list[dict], dict[str, str]]:
        """Copy of msgs with every client string replaced by a sentinel; returns (copy, sentinel -> string). Where
        the template reads strings (self._shape), each keeps its edge whitespace and the template's markers literal
        around sentinels of the rest."""
        table: dict[str, str] = {}

        def plain(s: str) -> str:
            key = f"zqx{nonce}s{len(table)}qzx"
            table[key] = s
            return key

        shape = self._shape
        sent = plain if shape is None else (lambda s: shape.shape(s, plain))

        def walk_args(v):
            if isinstance(v, str):
                return sent(v) if v else v
            if isinstance(v, dict):        # keys are client strings too (a template may print them)
                return {sent(k) if isinstance(k, str) and k else k: walk_args(x) for k, x in v.items()}
            if isinstance(v, list):
                return [walk_args(x) for x in v]
            return v

        out = []
        for m in msgs:
            m = {k: v if type(v) in _IMMUTABLE else copy.deepcopy(v) for k, v in m.items()}
            c = m.get("content")
            if isinstance(c, str) and c:
                m["content"] = sent(c)
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict) and isinstance(part.get("text"), str) and part["text"]:
                        part["text"] = sent(part["text"])
            shared: dict[str, str] = {}  # reasoning aliases hold one string: give them one sentinel
            for k in _REASONING_FIELDS:
                v = m.get(k)
                if isinstance(v, str) and v:
                    if v not in shared:
                        shared[v] = sent(v)
                    m[k] = shared[v]
            tcs = m.get("tool_calls")
            if isinstance(tcs, list):
                for tc in tcs:
                    fn = tc.get("function") if isinstance(tc, dict) else None
                    if isinstance(fn, dict) and "arguments" in fn:
                        fn["arguments"] = walk_args(fn["arguments"])
            out.append(m)
        return out, table

    def _pieces(self, msgs, text, add_generation_prompt, tools, documents, kw):
        """[(text, parse_special)] covering `text`, and whether the sentinel method succeeded."""
        nonce = secrets.token_hex(4)
        while nonce in text:
            nonce = secrets.token_hex(4)
        smsgs, table = self._substitute(msgs, nonce)
        if not table:
            return [(text, True)], True
        try:
            stext = self._render(smsgs, add_generation_prompt, tools, documents,
                                 dict(kw, **{SENTINELS: SentinelRendering(nonce)}))
        except ValueError:
            stext = None
        if stext is not None:
            pieces = _split_sentinels(stext, table, nonce)
            if "".join(t for t, _ in pieces) == text:
                return pieces, True
        # fallback: mark client strings found verbatim (in order of appearance) as plain text
        strings = sorted(set(table.values()), key=len, reverse=True)
        spans = []
        for s in strings:
            start = 0
            while True:
                j = text.find(s, start)
                if j < 0:
                    break
                if not any(a < j + len(s) and j < b for a, b in spans):
                    spans.append((j, j + len(s)))
                start = j + 1
        spans.sort()
        pieces, pos = [], 0
        for a, b in spans:
            if a > pos:
                pieces.append((text[pos:a], True))
            pieces.append((text[a:b], False))
            pos = b
        if pos < len(text):
            pieces.append((text[pos:], True))
        return pieces, False

    def _template_control_count(self, msgs, add_generation_prompt, tools, documents, kw) -> int | None:
        """Control tokens the template itself emits: the sentinel rendering tokenized with special parsing."""
        nonce = secrets.token_hex(4)
        smsgs, _ = self._substitute(msgs, nonce)
        try:
            stext = self._render(smsgs, add_generation_prompt, tools, documents,
                                 dict(kw, **{SENTINELS: SentinelRendering(nonce)}))
        except ValueError:
            return None
        _, frags = self.tokenizer.split_special([(stext, True)])
        return sum(1 for f in frags if f.token_id is not None and self.tokenizer.is_control(f.token_id))
