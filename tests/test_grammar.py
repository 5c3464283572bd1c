"""Constrained decoding (strata.sampling.grammar): every walk through a JSON schema's masks gives JSON that jsonschema accepts,
the mask on the logits, the overlapped mask equal to the synchronous one, bad schemas and grammars named in one line,
and GBNF / Lark grammars."""
from __future__ import annotations

import json

import numpy as np
import pytest

from strata.sampling import grammar

from strata.gguf import synth
from strata.text.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf({k: v[0] for k, v in synth._tokenizer_fields().items()})


def _walk(c: grammar.Constraint, tk: Tokenizer, rng, *, overlap=False, limit=400, pick=None):
    """Sample allowed tokens (uniformly, the harshest model) until an end-of-generation token -> the text."""
    g = c.start(overlap=overlap)
    toks = []
    try:
        while len(toks) < limit:
            ok = g.allowed()
            ids = np.nonzero(ok)[0]
            assert ids.size, "the mask allows nothing"
            t = int(pick(ids) if pick else rng.choice(ids))
            if t in tk.eog_ids:
                return tk.decode(toks), True
            toks.append(t)
            g.accept(t)
        return tk.decode(toks), False
    finally:
        g.close()


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -50, "maximum": 50},
                                      "b": {"type": "string", "maxLength": 6},
                                      "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     "required": ["a", "b", "c"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", 1, None, {"k": "v"}]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"n": {"type": "object", "properties": {
        "m": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125}}, "required": ["m"],
        "additionalProperties": False}, "s": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]}},
     "required": ["n", "s"], "additionalProperties": False},
]


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_every_walk_through_the_masks_is_valid_json(tok, k):
    schema = SCHEMAS[k]
    c = grammar.Constraint(grammar.json_schema_grammar(schema), tok)
    rng = np.random.default_rng(k)
    for _ in range(25):
        text, ended = _walk(c, tok, rng)
        assert ended, text
        jsonschema.validate(json.loads(text), schema)
        assert text == json.dumps(json.loads(text), ensure_ascii=False) or k == 2   # json.dumps' layout


def test_mask_on_the_logits(tok):
    c = grammar.Constraint(grammar.json_schema_grammar({"enum": ["yes", "no"]}), tok)
    g = c.start(overlap=False)
    logits = np.random.default_rng(0).standard_normal(tok.n_vocab).astype(np.float32)
    words = g.mask()
    ok = np.unpackbits(words.view(np.uint8), bitorder="little")[:tok.n_vocab].astype(bool)
    g._next = None
    g2 = c.start(overlap=False)
    out = g2.apply(logits)
    assert out.dtype == np.float32 and out.shape == logits.shape
    assert np.all(np.isneginf(out[~ok])) and np.array_equal(out[ok], logits[ok])
    assert 0 < ok.sum() < 100                                         # '"' and its spellings, nothing else
    assert all(tok.decode([int(i)]).startswith('"') for i in np.nonzero(ok)[0])
    # the array-module path (the one CuPy runs on a GPU) gives the same logits
    same = grammar.apply_words(np, logits, words, tok.n_vocab)
    assert np.array_equal(np.isneginf(same), np.isneginf(out)) and np.array_equal(same[ok], out[ok])


def test_mask_on_device_logits_equals_the_host_path(tok):
    """On a GPU the mask is applied to CuPy logits where they are (Constraint.apply's device path): the same
    logits as the numpy path, on the device. Skips without CuPy and a GPU."""
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 -- no driver / no device
        pytest.skip(f"no GPU: {e}")
    c = grammar.Constraint(grammar.json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                                                        "required": ["a"]}), tok)
    logits = np.random.default_rng(1).standard_normal(tok.n_vocab).astype(np.float32)
    host = c.start(overlap=False).apply(logits)
    g = c.start(overlap=False)
    dev = g.apply(cp.asarray(logits))                  # strata_apply_mask where the kernel library has it
    assert isinstance(dev, cp.ndarray)
    assert np.array_equal(cp.asnumpy(dev), host)
    words = c.start(overlap=False).mask()
    arr = grammar.apply_words(cp, cp.asarray(logits), words, tok.n_vocab)   # the array-operations fallback
    assert np.array_equal(cp.asnumpy(arr), host)
    if grammar._mask_kernel() is not None:
        assert "_staging" in g.__dict__              # the kernel ran (its pinned staging buffer exists)


def test_overlapped_masks_equal_synchronous_ones(tok):
    c = grammar.Constraint(grammar.json_schema_grammar(SCHEMAS[0]), tok)
    first = None
    for overlap in (False, True):
        g = c.start(overlap=overlap)
        seq, masks = [], []
        r = np.random.default_rng(7)
        while len(seq) < 200:
            m = g.mask()
            masks.append(m.copy())
            ids = np.nonzero(np.unpackbits(m.view(np.uint8), bitorder="little")[:tok.n_vocab])[0]
            t = int(r.choice(ids)) if first is None else first[0][len(seq)]
            if t in tok.eog_ids:
                break
            seq.append(t)
            g.accept(t)
        g.close()
        if first is None:
            first = (seq + [tok.eos_id], masks)
        else:
            assert all(np.array_equal(a, b) for a, b in zip(first[1], masks)) and len(first[1]) == len(masks)


@pytest.mark.parametrize("schema,needle", [
    ({"type": "nope"}, "invalid JSON schema: Invalid type: nope"),
    ({"properties": {"a": {"$ref": "#/missing"}}}, "invalid JSON schema: Pointer '/missing' does not exist"),
    ({"type": "string", "format": "no-such-format"}, "Unknown format"),
    ([1, 2], "must be an object"),
    ({"$ref": "#"}, "no text matches it"),                  # only itself: it compiles, yet nothing can start it
    ({"anyOf": [{"$ref": "#"}]}, "no text matches it"),
])
def test_bad_schemas_are_named_in_one_line(tok, schema, needle):
    with pytest.raises(grammar.GrammarError, match=needle) as e:
        grammar.Constraint(grammar.json_schema_grammar(schema), tok)
    assert "\n" not in str(e.value) and "%json" not in str(e.value)


def test_gbnf_and_lark_grammars(tok):
    c = grammar.Constraint(grammar.gbnf_grammar('root ::= ("yes" | "no") " sir"'), tok)
    rng = np.random.default_rng(1)
    assert {_walk(c, tok, rng)[0] for _ in range(20)} <= {"yes sir", "no sir"}
    c = grammar.Constraint(grammar.lark_grammar('start: "n=" NUM\nNUM: /[0-9]{1,3}/'), tok)
    for _ in range(10):
        text, ended = _walk(c, tok, rng)
        assert ended and text.startswith("n=") and text[2:].isdigit() and len(text) <= 5
    for bad in ("root ::= nothing", "root ::= (", ""):
        with pytest.raises(grammar.GrammarError):
            grammar.Constraint(grammar.gbnf_grammar(bad), tok)


def test_control_tokens_only_by_reference(tok):
    """Grammar text never matches a control token (<|im_end|> stays out of a JSON string); <[id]> names one."""
    im_end = tok.token_to_id("<|im_end|>")
    c = grammar.Constraint(grammar.json_schema_grammar({"type": "string", "maxLength": 40}), tok)
    g = c.start(overlap=False)
    g.accept(tok.encode('"', add_bos=False)[0])
    assert not g.allowed()[im_end]
    c = grammar.Constraint(grammar.lark_grammar(f'start: "a" <[{im_end}]>'), tok)
    g = c.start(overlap=False)
    g.accept(tok.encode("a", add_bos=False)[0])
    assert g.allowed()[im_end] and g.allowed().sum() == 1


def test_a_152k_vocabulary(tmp_path):
    """The synthetic 152K-token vocabulary (Qwen's size) tokenizes, and masks over it give valid JSON."""
    t, ty, m = synth.synthetic_vocab(151936, 0)
    fields = {k: v[0] for k, v in synth._tokenizer_fields().items()}
    fields.update({"tokenizer.ggml.tokens": t, "tokenizer.ggml.token_type": ty, "tokenizer.ggml.merges": m})
    big = Tokenizer.from_gguf(fields)
    assert big.n_vocab == 151936 and big.decode(big.encode("Hello worldwide")) == "Hello worldwide"
    assert synth.synthetic_vocab(151936, 0)[0][-10:] == t[-10:]                   # reproducible
    c = grammar.Constraint(grammar.json_schema_grammar(SCHEMAS[0]), big)
    rng = np.random.default_rng(3)
    for _ in range(3):
        text, ended = _walk(c, big, rng)
        assert ended
        jsonschema.validate(json.loads(text), SCHEMAS[0])


FAMILY_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                      "additionalProperties": False}}},
]


@pytest.mark.parametrize("family", ["hermes", "qwen_xml", "llama3", "mistral", "mistral_args", "generic"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_calls_parse_back_and_validate(tok, family, choice):
    """Random walks through each family's forced-call grammar are answers its parser reads as calls whose arguments
    validate against the tool's parameters (jsonschema): the grammar and the parser agree."""
    from strata.structured import tool_calls as tc
    fmt = {"hermes": tc.Hermes(), "qwen_xml": tc.QwenXml(), "llama3": tc.Llama3(), "mistral": tc.Mistral(),
           "mistral_args": tc.Mistral(args_form=True), "generic": tc.Generic()}[family]
    body = fmt.grammar(FAMILY_TOOLS, choice, True, lambda t: None).replace("calls:", "start:", 1)
    c = grammar.Constraint(grammar.lark_grammar(body), tok)
    rng = np.random.default_rng(11)
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in FAMILY_TOOLS}
    for _ in range(12):
        text, ended = _walk(c, tok, rng, limit=300)
        assert ended, text
        content, calls = tc.parse(text, fmt, FAMILY_TOOLS)
        assert calls and content.strip() == "", (text, content)
        for call in calls:
            name = call["function"]["name"]
            assert name in params and (isinstance(choice, str) or name == "get_weather")
            jsonschema.validate(json.loads(call["function"]["arguments"]), params[name])
