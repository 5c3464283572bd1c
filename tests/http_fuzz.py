"""Test support: the HTTP fuzz of the daemon. Body strategies shaped by each route's schema (the OpenAI, Anthropic,
llama-server and Ollama routes), whole requests built for every route and method the application's router registers
(path parameters, query strings, headers with odd encodings and huge values, valid-looking and broken bodies), sent
as raw bytes over the Unix socket, and the properties every answer must have (FuzzRun.check). Used by
tests/test_serve_fuzz.py (a few thousand cases) and tools/fuzz_http.py (100,000+)."""
from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import re
import socket
import time
import urllib.parse
import zlib
from dataclasses import dataclass, field

from hypothesis import strategies as st

# text, and text with lone surrogates among its characters (JSON's "\ud800" decodes to one; st.text never draws them)
anytext = st.text(max_size=20) | st.lists(st.characters(codec="utf-8") | st.characters(categories=["Cs"]),
                                          max_size=20).map("".join)
junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False) | anytext,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(anytext.filter(lambda k: len(k) <= 8), kids,
                                                              max_size=4),
    max_leaves=12)
# JSON schemas: small ones of any content, and ones whose grammar is past the 1 MiB limit
schemas = st.fixed_dictionaries(
    {"type": st.sampled_from(["string", "object", "integer", "array"]) | junk},
    optional={"enum": st.lists(anytext | junk, max_size=3), "properties": st.dictionaries(anytext, junk, max_size=3),
              "items": junk, "required": st.lists(anytext, max_size=2)}) \
    | st.integers(80_000, 120_000).map(lambda n: {"type": "string", "enum": [f"v{i}" for i in range(n)]}) | junk
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"),
                                        "function": st.fixed_dictionaries(
                                            {"name": st.sampled_from(["f", "g"]) | anytext},
                                            optional={"description": anytext, "parameters": schemas})}),
                 max_size=2) | junk

message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]) | junk,
     "content": st.text(max_size=40) | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                         "text": st.text(max_size=10)}), max_size=2)
     | junk})

FIELDS = {
    "messages": st.lists(message, min_size=0, max_size=4) | junk,
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 60000), max_size=8) | junk,
    "temperature": st.floats(-1, 3, allow_nan=False) | junk,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False) | junk,
    "top_k": st.integers(-3, 100) | junk,
    "min_p": st.floats(-0.5, 1.5, allow_nan=False) | junk,
    "seed": st.integers(-3, 2 ** 65) | junk,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | junk,
    "presence_penalty": st.floats(-3, 3, allow_nan=False) | junk,
    "frequency_penalty": st.floats(-3, 3, allow_nan=False) | junk,
    "repeat_last_n": st.integers(-3, 100) | junk,
    "logprobs": st.booleans() | st.integers(-2, 25) | junk,
    "top_logprobs": st.integers(-2, 25) | junk,
    "n": st.integers(0, 3) | junk,
    "stream": st.booleans() | junk,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | junk,
    "model": st.sampled_from(["SmolLM2-135M-Instruct.Q4_1", "default", "gpt-4"]) | junk,
    "cache_prompt": st.booleans() | junk,
    "strata_checkpoint": st.booleans() | junk,
    "strata_pin": st.integers(-2, 6) | junk,
    "id_slot": st.integers(-2, 3) | junk,
    "response_format": st.fixed_dictionaries({"type": st.just("json_schema"),
                                              "json_schema": st.fixed_dictionaries({"name": st.just("x"),
                                                                                    "schema": schemas})})
    | st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text"]) | junk}, optional={"schema": schemas})
    | junk,
    "json_schema": schemas,
    "grammar": st.sampled_from(['root ::= "yes" | "no"', "root ::= [0-9]+"]) | anytext | junk,
    "tools": tools,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | junk,
}

not_null = junk.filter(lambda v: v is not None)                  # max_tokens: null would mean "no limit"
text = st.text(st.characters(codec="utf-8"), max_size=40)
VALID = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 100),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2 ** 32), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "stop": text.filter(bool) | st.lists(text.filter(bool), max_size=3),
    "stream": st.booleans(), "cache_prompt": st.booleans(), "strata_checkpoint": st.booleans(),
    "model": st.sampled_from(["SmolLM2-135M-Instruct.Q4_1", "default"]), "n": st.just(1),
}
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": text}), min_size=1, max_size=3),
     "max_tokens": st.integers(1, 3)},
    optional=dict(VALID, logprobs=st.booleans()))
valid_completion = st.fixed_dictionaries(
    {"prompt": text.filter(bool) | st.lists(st.integers(0, 49151), min_size=1, max_size=8),
     "max_tokens": st.integers(0, 3)},
    optional=dict(VALID, logprobs=st.integers(0, 5)))


@st.composite
def mutated(draw, base, fields=FIELDS, limit="max_tokens"):
    """A valid body with up to two fields replaced by anything (or removed); `limit` (the length field) is only
    replaced, never removed or null."""
    body = dict(draw(base))
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(sorted(set(fields) | set(body))))
        if key == limit or draw(st.booleans()):
            body[key] = draw(fields.get(key, junk) if key != limit else st.integers(-2, 3) | not_null)
        else:
            body.pop(key, None)
    return body


bodies = st.fixed_dictionaries(
    {"max_tokens": st.integers(-2, 3) | not_null},               # always present: generations stay short
    optional=FIELDS)


# ---- the Responses and Messages routes: every body answers 200 or an error in the route's API's shape -------------
input_item = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | junk,
     "content": text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                                                 "input_image"]),
                                                        "text": text}), max_size=2) | junk},
    optional={"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | junk,
              "call_id": text | junk, "name": text | junk, "arguments": text | junk, "output": text | junk})
RESPONSES_FIELDS = {
    "input": text | st.lists(input_item, max_size=3) | junk, "instructions": text | junk,
    "previous_response_id": text | junk, "store": st.booleans() | junk, "stream": st.booleans() | junk,
    "temperature": st.floats(-1, 3, allow_nan=False) | junk, "top_p": st.floats(-0.5, 1.5, allow_nan=False) | junk,
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | junk,
                                             "name": st.sampled_from(["f", "bad name"]) | junk}), max_size=2) | junk,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | junk, "truncation": junk,
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": st.just("json_schema"),
                                                                    "name": st.just("x"), "schema": schemas})})
    | junk,
    "metadata": st.dictionaries(anytext, anytext, max_size=3) | junk,
}
block = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"]) | junk},
                              optional={"text": text | junk, "id": text | junk, "name": text | junk,
                                        "input": junk, "tool_use_id": text | junk, "content": text | junk})
MESSAGES_FIELDS = {
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | junk,
                                                "content": text | st.lists(block, max_size=3) | junk}),
                         max_size=3) | junk,
    "system": text | st.lists(block, max_size=2) | junk, "stop_sequences": st.lists(text, max_size=3) | junk,
    "stream": st.booleans() | junk, "temperature": st.floats(-1, 3, allow_nan=False) | junk,
    "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "bad name"]) | junk,
                                             "input_schema": schemas}), max_size=2) | junk,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"]) | junk},
                                         optional={"name": text | junk}) | junk,
    "output_config": st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": st.just("json_schema"),
                                                                             "schema": schemas})}) | junk,
}



valid_responses = st.fixed_dictionaries(
    {"input": text.filter(str.strip) | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "developer"]),
                                                                       "content": text}), min_size=1, max_size=2),
     "max_output_tokens": st.integers(1, 3)},
    optional={"instructions": text, "stream": st.booleans(), "store": st.booleans(), "temperature": st.floats(0, 2)})
valid_messages = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": text}), min_size=1, max_size=2),
     "max_tokens": st.integers(1, 3)},
    optional={"system": text, "stream": st.booleans(), "stop_sequences": st.lists(text.filter(bool), max_size=2),
              "temperature": st.floats(0, 1)})


# ---- the other routes' bodies: llama-server's, Ollama's, the slot actions -----------------------------------------
LLAMA_FIELDS = {
    "prompt": text | st.lists(st.integers(-5, 60000) | text, max_size=4) | junk, "stream": st.booleans() | junk,
    "temperature": st.floats(-1, 3, allow_nan=False) | junk, "top_k": st.integers(-3, 100) | junk,
    "cache_prompt": st.booleans() | junk, "stop": st.lists(text, max_size=3) | junk, "n_probs": st.integers(-1, 5) | junk,
    "seed": st.integers(-3, 2 ** 65) | junk, "id_slot": st.integers(-2, 3) | junk, "return_tokens": st.booleans() | junk,
    "grammar": FIELDS["grammar"], "json_schema": schemas, "samplers": st.lists(anytext, max_size=3) | junk,
    "input_prefix": text | junk, "input_suffix": text | junk,
    "input_extra": st.lists(st.fixed_dictionaries({"filename": text | junk, "text": text | junk}), max_size=2) | junk,
}
valid_llama = st.fixed_dictionaries({"prompt": text.filter(bool), "n_predict": st.integers(0, 3)},
                                    optional={"stream": st.booleans(), "temperature": st.floats(0, 2),
                                              "cache_prompt": st.booleans(), "n_probs": st.integers(0, 3)})
valid_infill = st.fixed_dictionaries({"input_prefix": text, "input_suffix": text, "n_predict": st.integers(0, 3)},
                                     optional={"prompt": text, "stream": st.booleans(),
                                               "input_extra": st.lists(st.fixed_dictionaries(
                                                   {"filename": text, "text": text}), max_size=2)})
TOKENIZE_FIELDS = {"content": text | st.lists(text | st.integers(-3, 60000), max_size=4) | junk,
                   "add_special": st.booleans() | junk, "parse_special": st.booleans() | junk,
                   "with_pieces": st.booleans() | junk, "tokens": st.lists(st.integers(-3, 60000), max_size=8) | junk}
valid_tokenize = st.fixed_dictionaries({"content": text}, optional={"add_special": st.booleans(),
                                                                    "with_pieces": st.booleans()})
valid_detokenize = st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 49151), max_size=8)})
valid_template = st.fixed_dictionaries({"messages": valid_chat.map(lambda b: b["messages"])})
options = st.fixed_dictionaries({"num_predict": st.integers(1, 3)},
                                optional={"temperature": st.floats(0, 2), "top_k": st.integers(0, 50),
                                          "seed": st.integers(0, 2 ** 31), "stop": st.lists(text, max_size=2)})
OLLAMA_FIELDS = {
    "model": st.sampled_from(["smollm2", "default", "llama3:8b", ""]) | junk, "stream": st.booleans() | junk,
    "options": options | st.dictionaries(anytext, junk, max_size=3) | junk, "format": st.just("json") | schemas | junk,
    "messages": st.lists(message, max_size=3) | junk, "prompt": text | junk, "system": text | junk,
    "raw": st.booleans() | junk, "tools": tools, "keep_alive": junk, "think": st.booleans() | junk,
}
valid_ollama_chat = st.fixed_dictionaries(
    {"model": st.just("smollm2"), "options": options,
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": text}), min_size=1, max_size=3)},
    optional={"stream": st.booleans()})
valid_ollama_generate = st.fixed_dictionaries({"model": st.just("smollm2"), "options": options, "prompt": text},
                                              optional={"stream": st.booleans(), "system": text,
                                                        "raw": st.booleans()})

EMBED_FIELDS = {
    "input": text | st.lists(text, max_size=3) | st.lists(st.integers(-3, 60000), max_size=8)
    | st.lists(st.lists(st.integers(-3, 60000), max_size=4), max_size=3) | st.integers(0, 3000).map(lambda n: "a " * n) | junk,
    "content": text | junk, "encoding_format": st.sampled_from(["float", "base64", "int8"]) | junk,
    "dimensions": st.integers(-1, 1000) | junk, "pooling": st.sampled_from(["none", "mean", "cls", "last", "max"]) | junk,
    "embd_normalize": st.integers(-3, 70) | junk, "model": st.sampled_from(["text-embedding-3-small", ""]) | junk,
    "user": text | junk, "truncate": st.booleans() | junk, "prompt": text | junk, "options": junk, "keep_alive": junk,
}
valid_embed = st.fixed_dictionaries({"input": text.filter(str.strip) | st.lists(text.filter(str.strip), min_size=1,
                                                                               max_size=3)},
                                    optional={"encoding_format": st.sampled_from(["float", "base64"]),
                                              "model": st.just("m")})
valid_llama_embed = st.fixed_dictionaries({"content": text.filter(str.strip)},
                                          optional={"pooling": st.sampled_from(["none", "mean", "last"]),
                                                    "embd_normalize": st.integers(-1, 4)})
valid_ollama_embed = st.fixed_dictionaries({"model": st.just("m"), "input": text.filter(str.strip)},
                                           optional={"truncate": st.booleans()})
valid_ollama_embeddings = st.fixed_dictionaries({"model": st.just("m"), "prompt": text.filter(str.strip)})


# route template -> (a valid-looking body, the fields a mutation may replace, the length field kept in every body);
# a route not named here gets bodies of junk (its schema unknown to the fuzz, the route still fuzzed)
SHAPES = {
    "/v1/chat/completions": (valid_chat, FIELDS, "max_tokens"),
    "/chat/completions": (valid_chat, FIELDS, "max_tokens"),
    "/v1/completions": (valid_completion, FIELDS, "max_tokens"),
    "/completions": (valid_completion, FIELDS, "max_tokens"),
    "/completion": (valid_llama, LLAMA_FIELDS, "n_predict"),
    "/infill": (valid_infill, LLAMA_FIELDS, "n_predict"),
    "/tokenize": (valid_tokenize, TOKENIZE_FIELDS, None),
    "/detokenize": (valid_detokenize, TOKENIZE_FIELDS, None),
    "/apply-template": (valid_template, FIELDS, None),
    "/v1/responses": (valid_responses, RESPONSES_FIELDS, "max_output_tokens"),
    "/v1/messages": (valid_messages, MESSAGES_FIELDS, "max_tokens"),
    "/v1/messages/count_tokens": (valid_messages, MESSAGES_FIELDS, None),
    "/api/chat": (valid_ollama_chat, OLLAMA_FIELDS, "options"),
    "/api/generate": (valid_ollama_generate, OLLAMA_FIELDS, "options"),
    "/v1/embeddings": (valid_embed, EMBED_FIELDS, None),
    "/embedding": (valid_llama_embed, EMBED_FIELDS, None),
    "/embeddings": (valid_llama_embed, EMBED_FIELDS, None),
    "/api/embed": (valid_ollama_embed, EMBED_FIELDS, None),
    "/api/embeddings": (valid_ollama_embeddings, EMBED_FIELDS, None),
    "/api/show": (st.fixed_dictionaries({"model": st.just("smollm2")}), OLLAMA_FIELDS, None),
    "/slots/{slot}": (st.fixed_dictionaries({}, optional={"filename": st.sampled_from(["fuzz.bin", "nope.bin"])}),
                      {"filename": anytext | junk}, None),
}
# path parameter -> plausible values (besides any text)
PARAMS = {"model": ["default", "SmolLM2-135M-Instruct.Q4_1", "gpt-4"], "slot": ["0", "1", "00", "-1"],
          "name": ["chat.js", "chat.css", "../README.md", "%2e%2e/x"], "id": ["resp_0", ""], "digest": ["sha256:00"]}
# the query strings the routes read
QUERY = {"/slots/{slot}": {"action": ["save", "restore", "erase", "nope", ""]}}


@st.composite
def mutated_body(draw, template: str):
    """A body for the route: valid-looking, with up to two fields replaced by anything or removed (the length field
    is only ever replaced by another small count, so that generations stay short)."""
    if template not in SHAPES:
        return draw(st.dictionaries(anytext, junk, max_size=4) | junk)
    base, fields, limit = SHAPES[template]
    body = dict(draw(base))
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(sorted(set(fields) | set(body))))
        if key == limit:
            continue
        if draw(st.booleans()):
            body[key] = draw(fields.get(key, junk))
        else:
            body.pop(key, None)
    return body


def _broken(raw: bytes, how: str) -> bytes:
    return {"truncated": lambda: raw[:max(0, len(raw) // 2)],
            "bom": lambda: b"\xef\xbb\xbf" + raw,
            "latin1": lambda: raw.decode("utf-8", "surrogatepass").encode("latin-1", "replace") + b"\xe9\xff",
            "trailing": lambda: raw + b" }garbage",
            "nan": lambda: b'{"max_tokens": NaN, "temperature": Infinity, "x": -Infinity}',
            "huge_number": lambda: b'{"max_tokens": 1e999, "n": 1' + b"0" * 5000 + b"}",
            "deep": lambda: b"[" * 100_000 + b"]" * 100_000,
            "deep_object": lambda: b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
            "duplicate_keys": lambda: raw[:-1] + b', "max_tokens": 1, "max_tokens": -1}' if raw.endswith(b"}")
            else raw,
            "not_object": lambda: b'["just", "a", "list"]',
            "string": lambda: b'"a string"',
            "empty": lambda: b"",
            "null": lambda: b"null",
            "utf16": lambda: raw.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass"),
            "control": lambda: raw.replace(b'"', b'"\x00', 1),
            }[how]()


@st.composite
def body_bytes(draw, template: str) -> bytes:
    raw = json.dumps(draw(mutated_body(template)), ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["valid"] * 6 + ["truncated", "bom", "latin1", "trailing", "nan", "huge_number",
                                                "deep", "deep_object", "duplicate_keys", "not_object", "string",
                                                "empty", "null", "utf16", "control", "binary"]))
    if how == "valid":
        return raw
    if how == "binary":
        return draw(st.binary(max_size=200))
    return _broken(raw, how)


TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
header_value = (st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass"))          # UTF-8
                | st.binary(max_size=40).filter(lambda b: not set(b) & {0, 10, 13})             # any bytes
                | st.text(st.characters(max_codepoint=255), max_size=40).map(lambda s: s.encode("latin-1"))
                | st.integers(1_000, 120_000).map(lambda n: b"x" * n))                         # huge values
HEADERS = {
    b"Content-Type": st.sampled_from([b"application/json", b"application/json; charset=utf-8",
                                      b"application/json; charset=latin-1", b"APPLICATION/JSON", b"text/plain",
                                      b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x",
                                      b"application/x-ndjson", b"", b"*/*", b";;;", b"application/json; charset=\xff",
                                      b"text/html; charset=utf-8"]) | header_value,
    b"Accept": st.sampled_from([b"text/html", b"text/event-stream", b"application/json", b"*/*"]) | header_value,
    b"Accept-Encoding": st.sampled_from([b"gzip", b"br", b"identity;q=0", b"*"]) | header_value,
    b"Transfer-Encoding": st.sampled_from([b"gzip, chunked", b"chunked, chunked", b"identity", b"x-junk"]),
    b"Accept-Charset": header_value, b"Accept-Language": header_value,
    b"X-Request-Id": st.sampled_from([b"abc", b"a" * 65]) | header_value,
    b"Authorization": st.sampled_from([b"Bearer x", b"Bearer ", b"Basic Zm9vOmJhcg=="]) | header_value,
    b"x-api-key": header_value, b"Origin": st.sampled_from([b"http://evil.example", b"null"]) | header_value,
    b"Host": st.sampled_from([b"evil.example", b"localhost:1", b""]) | header_value,
    b"Cookie": header_value, b"User-Agent": header_value, b"Range": st.sampled_from([b"bytes=0-1", b"bytes=9-2",
                                                                                        b"bytes=-"]) | header_value,
    b"If-None-Match": header_value, b"If-Modified-Since": header_value, b"Expect": st.just(b"100-continue"),
    b"anthropic-version": header_value, b"OpenAI-Beta": header_value,
    b"Access-Control-Request-Method": st.sampled_from([b"POST", b"DELETE"]) | header_value,
}
header_name = st.text(TOKEN_CHARS, min_size=1, max_size=20).map(str.encode) | st.sampled_from(sorted(HEADERS))
ENCODINGS = [b"gzip", b"deflate", b"br", b"zstd", b"identity", b"gzip, gzip", b"x-junk", b""]


@dataclass
class Case:
    """One HTTP request, as the bytes sent, and the route it was drawn for."""
    method: str
    target: str
    template: str | None                  # the route it was drawn for (None: a path no route registers)
    headers: list[tuple[bytes, bytes]]
    body: bytes
    framing: str = "length"               # length | chunked | none (no Content-Length: a body aiohttp ignores)
    split: float = 0.0                    # 0: sent in one write; else two, the first this fraction of the bytes

    @property
    def path(self) -> str:
        return urllib.parse.unquote(self.target.partition("#")[0].partition("?")[0], errors="surrogateescape")

    def wire(self) -> bytes:
        head = [f"{self.method} {self.target} HTTP/1.1".encode("utf-8", "surrogateescape"), b"Host: localhost"]
        head += [n + b": " + v for n, v in self.headers]
        body = self.body
        if self.framing == "length":
            head.append(b"Content-Length: " + str(len(body)).encode())
        elif self.framing == "chunked":
            head.append(b"Transfer-Encoding: chunked")
            body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[i:i + 97] for i in range(0, len(body), 97))
                            if p) + b"0\r\n\r\n"
        else:
            body = b""
        head.append(b"Connection: close")
        return b"\r\n".join(head) + b"\r\n\r\n" + body

    def short(self) -> str:
        return (f"{self.method} {self.target[:120]!r} headers={[(n, v[:60]) for n, v in self.headers]!r} "
                f"body={self.body[:200]!r}{'...' if len(self.body) > 200 else ''} framing={self.framing}"
                f"{f' split={self.split:.2f}' if self.split else ''}")


def route_table() -> list[tuple[str, str]]:
    """(method, route template) of every route the daemon's application registers: make_app on a worker that is
    never started (so routes added later are fuzzed too). '*' routes take any method."""
    from strata.serve.app import make_app
    from strata.serve.config import ServeConfig
    from strata.serve.metrics import Metrics
    from strata.serve.worker import EngineWorker
    loop = asyncio.new_event_loop()
    try:
        app = make_app(ServeConfig(), EngineWorker(lambda: None, queue_max=1, metrics=Metrics(), loop=loop), Metrics())
        return sorted({(r.method, r.resource.canonical) for r in app.router.routes()})
    finally:
        loop.close()


_PARAM = re.compile(r"\{(\w+)(?::[^}]*)?\}")
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "get", "FOO", "CONNECT"]


def _quote(s: str) -> str:
    return urllib.parse.quote(s.encode("utf-8", "surrogatepass"), safe="")


@st.composite
def cases(draw, table: list[tuple[str, str]]) -> Case:
    """A request for one of the registered routes (its method or another), or for a path no route has."""
    if draw(st.integers(0, 19)) == 0:          # an unregistered path, under the prefixes the APIs use
        template = None
        method = draw(st.sampled_from(METHODS))
        path = draw(st.sampled_from(["/v1/", "/api/", "/", "/web/", "/slots/", "/v1/messages/", "/v1/responses/x/",
                                     "/completion/", "/v2/"])) + _quote(draw(anytext))
    else:
        method, template = draw(st.sampled_from(table))
        if method == "*" or draw(st.integers(0, 9)) == 0:
            method = draw(st.sampled_from(METHODS))
        path = _PARAM.sub(lambda m: _quote(draw(st.sampled_from(PARAMS.get(m.group(1), ["x"])) | anytext)),
                          template)
        if draw(st.integers(0, 29)) == 0:      # raw bytes in the path: not percent-encoded
            path += draw(st.binary(min_size=1, max_size=8).filter(lambda b: not set(b) & {0, 10, 13, 32, 35, 63})
                         ).decode("latin-1").encode("latin-1").decode("utf-8", "surrogateescape")
    query = list(draw(st.lists(st.tuples(st.sampled_from(["action", "stream", "model"]) | anytext,
                                         anytext), max_size=3)))
    for k, vals in QUERY.get(template, {}).items():
        if draw(st.integers(0, 4)):
            query.append((k, draw(st.sampled_from(vals))))
    target = path + ("?" + "&".join(f"{_quote(k)}={_quote(v)}" for k, v in query) if query else "")
    if draw(st.integers(0, 19)) == 0:
        target += draw(st.sampled_from(["?", "?&&=", "?a=%zz", "?%ff=%fe", "#frag", "?a=" + "b" * 9000]))
    headers = [(b"Content-Type", b"application/json")] if draw(st.integers(0, 3)) else []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(header_name)
        headers.append((name, draw(HEADERS.get(name, header_value))))
    body = draw(body_bytes(template)) if method == "POST" or draw(st.integers(0, 9)) == 0 else b""
    if body and draw(st.integers(0, 9)) == 0:
        enc = draw(st.sampled_from(ENCODINGS))
        if draw(st.booleans()):                 # the body really encoded so
            body = {b"gzip": gzip.compress, b"deflate": zlib.compress}.get(enc, lambda b: b)(body)
        headers.append((b"Content-Encoding", enc))
    framing = draw(st.sampled_from(["length"] * 8 + ["chunked", "none"]))
    # now and then the request comes in two packets, the daemon already handling it when the second arrives (a body
    # that breaks in its second packet takes other paths through the HTTP parser than one that arrives whole)
    split = draw(st.floats(0.05, 0.99)) if draw(st.integers(0, 9)) == 0 else 0.0
    return Case(method, target, template, headers, body, framing, split)


# ---- talking to the daemon ----------------------------------------------------------------------------------------
@dataclass
class Reply:
    status: int
    headers: dict
    body: bytes


#: how long a case may go unanswered: past the daemon's own deadlines (--body-timeout and --idle-timeout, 60 s by
#: default), so that a request the daemon gives up on is answered (408) before the fuzz calls it a hang
ANSWER_TIMEOUT = 120.0


#: the pause between the two writes of a split request
SPLIT_PAUSE = 0.02


def exchange(sock_path: str, raw: bytes, method: str, timeout: float = ANSWER_TIMEOUT,
             split: float = 0.0) -> Reply | None:
    """Send raw request bytes over the Unix socket (in two writes SPLIT_PAUSE apart when split: the first that
    fraction of them) and read the answer (None: the connection closed unanswered)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock_path)
        try:
            cut = int(len(raw) * split)
            if 0 < cut < len(raw):
                s.sendall(raw[:cut])
                time.sleep(SPLIT_PAUSE)
                raw = raw[cut:]
            s.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):  # answered (and closed) before the whole request was read
            pass
        r = http.client.HTTPResponse(s, method=method.upper())
        try:
            r.begin()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return None
        try:
            body = r.read()
        except http.client.IncompleteRead as e:
            body = e.partial
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, body)
    finally:
        s.close()


def family(path: str) -> str:
    """The API whose error shape a path's errors take: ollama (/api/...), anthropic (/v1/messages...), llama
    (llama-server's own routes), else openai."""
    if path.startswith("/api/"):
        return "ollama"
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path in LLAMA_PATHS:
        return "llama"
    return "openai"


LLAMA_PATHS = {"/completion", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props", "/embedding",
               "/embeddings"}
EMBED_PATHS = {"/v1/embeddings", "/embedding", "/embeddings", "/api/embed", "/api/embeddings"}
# documented 5xx: Ollama's model management is not served, nor /infill on a model without FIM tokens
NOT_IMPLEMENTED = re.compile(r"^(/api/(pull|push|create|copy|delete|blobs/.*)|/infill)$", re.DOTALL)   # a digest may hold a newline


def error_shape_problem(fam: str, d) -> str | None:
    """Why the parsed error body d is not in the family's shape (None when it is)."""
    if fam == "ollama":
        ok = isinstance(d, dict) and set(d) == {"error"} and isinstance(d["error"], str) and d["error"]
    elif fam == "anthropic":
        ok = isinstance(d, dict) and d.get("type") == "error" and isinstance(d.get("error"), dict) \
            and set(d["error"]) == {"type", "message"} and d["error"]["message"]
    elif fam == "llama":
        ok = isinstance(d, dict) and isinstance(d.get("error"), dict) \
            and set(d["error"]) == {"code", "message", "type"} and d["error"]["message"]
    else:
        ok = isinstance(d, dict) and isinstance(d.get("error"), dict) \
            and set(d["error"]) == {"message", "type", "param", "code"} and d["error"]["message"]
    return None if ok else f"not {fam}'s error shape: {json.dumps(d)[:300]}"


def answer_problem(case: Case, r: Reply | None) -> str | None:
    """What is wrong with the daemon's answer to the case (None: nothing)."""
    if r is None:
        return "the connection closed without an answer"
    fam = family(case.path) if case.method.upper() != "CONNECT" else "openai"   # CONNECT's target is no path
    ctype = r.headers.get("content-type", "")
    if r.status >= 500 and not (r.status == 501 and NOT_IMPLEMENTED.match(case.path)):
        return f"{r.status}: {r.body[:300]!r}"
    if r.status == 408:              # the fuzz sends each request whole at once: the daemon stalled on it
        return f"408 for a request sent whole: {r.body[:300]!r}"
    if case.method.upper() == "HEAD" and r.status < 400:
        return None
    if r.status >= 400:
        if case.method.upper() == "HEAD" and not r.body:
            return None
        try:
            d = json.loads(r.body)
        except ValueError:
            return f"{r.status} with a body that is not JSON ({ctype}): {r.body[:200]!r}"
        err = d.get("error") if isinstance(d, dict) else None
        if r.status == 400 and isinstance(err, dict) and err.get("code") == "bad_http":
            fam = "openai"                   # malformed HTTP: no route was read, OpenAI's shape
        return error_shape_problem(fam, d)
    try:
        if ctype.startswith("application/json"):
            json.loads(r.body)
        elif ctype.startswith("text/event-stream"):        # lines end at CR / LF only (not str.splitlines's U+0085)
            for line in re.split(r"\r\n|\r|\n", r.body.decode()):
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])
        elif ctype.startswith("application/x-ndjson"):
            for line in r.body.decode().split("\n"):
                if line:
                    json.loads(line)
    except ValueError as e:
        return f"{r.status} {ctype} body that does not parse: {e}: {r.body[:200]!r}"
    return None


REFERENCE = [{"role": "system", "content": "You are a concise assistant."},
             {"role": "user", "content": "Name one color."}]


@dataclass
class FuzzRun:
    """A fuzz against one daemon: the reference conversation, the engine state between cases, the counts and the
    problems found. check(case) sends one case and records what is wrong with its answer."""
    daemon: object                               # tests.daemon.Daemon
    counts: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    state: dict | None = None
    reference: list | None = None
    slowest: list = field(default_factory=list)  # the 5 slowest answers: {"ms", "status", "case"}
    last_case: str = ""

    def _chat(self, messages) -> str:
        st_, d = self.daemon.json("POST", "/v1/chat/completions",
                                  {"messages": messages, "max_tokens": 6, "temperature": 0, "strata_checkpoint": True})
        assert st_ == 200, d
        return d["choices"][0]["message"]["content"]

    def conversation(self) -> list[str]:
        """The reference conversation's two answers (greedy), the second turn left live in the engine."""
        a1 = self._chat(REFERENCE)
        a2 = self._chat(REFERENCE + [{"role": "assistant", "content": a1},
                                     {"role": "user", "content": "And another one?"}])
        return [a1, a2]

    def engine_state(self) -> dict:
        """/cache once the engine has nothing running or waiting (a job keeps its checkpoints after its answer is
        sent: a snapshot taken before that would differ from the next one)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st_, h = self.daemon.json("GET", "/health")
            if st_ == 200 and h["queue"]["running"] == 0 and h["queue"]["waiting"] == 0:
                break
            time.sleep(0.005)
        st_, d = self.daemon.json("GET", "/cache")
        assert st_ == 200, d
        return d

    def start(self) -> "FuzzRun":
        self.reference = self.conversation()
        self.state = self.engine_state()
        return self

    def check(self, case: Case, timeout: float = ANSWER_TIMEOUT) -> str | None:
        """Send the case; its problem (also recorded), or None. A refused request (4xx), a GET or a HEAD must leave
        the engine's state (/cache: position, checkpoints, parked conversations) as it was."""
        t0 = time.perf_counter()
        try:
            r = exchange(self.daemon.sock, case.wire(), case.method, timeout, case.split)
        except socket.timeout:
            r, problem = None, (f"no answer within {timeout} s; the case before: {self.last_case}; the daemon's "
                                f"log ends: {self.daemon.log_tail(8)}")
        else:
            problem = answer_problem(case, r)
        ms = round((time.perf_counter() - t0) * 1e3, 1)
        if len(self.slowest) < 5 or ms > self.slowest[-1]["ms"]:
            self.slowest = sorted(self.slowest + [{"ms": ms, "status": None if r is None else r.status,
                                                   "case": case.short()}], key=lambda e: -e["ms"])[:5]
        if self.daemon.proc.poll() is not None:
            problem = f"the daemon exited with {self.daemon.proc.returncode}"
        key = "none" if r is None else str(r.status)
        self.counts[key] = self.counts.get(key, 0) + 1
        if problem is None:
            state = self.engine_state()
            may_change = r.status < 300 and case.method.upper() not in ("GET", "HEAD", "OPTIONS") \
                and case.path not in EMBED_PATHS            # an embedding is read beside the live conversation
            if state != self.state and not may_change:
                problem = f"{r.status} changed the engine state: {self.state} -> {state}"
            self.state = state
        if problem is not None:
            self.problems.append({"problem": problem, "case": case.short(), "ms": ms})
        self.last_case = case.short()[:400]
        return problem

    def reference_problem(self) -> str | None:
        """Whether the reference conversation still answers as it did before the fuzz."""
        again = self.conversation()
        self.state = self.engine_state()
        return None if again == self.reference else f"reference conversation {self.reference} -> {again}"
