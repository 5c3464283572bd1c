"""logit_bias: the samplers add it before the chain (host and device sampler alike), the request fields of every route
that takes it (OpenAI's object, llama-server's [[id, bias]] / [[id, false]]) are validated with 400s naming the field,
and greedy answers of a real daemon (--parallel 2, both slots at once) equal transformers' logits + the bias."""
from __future__ import annotations

import math
import re
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from strata.sampling.device import DeviceSampler
from strata.sampling.sampler import Sampler, SamplingParams
from tests.helpers import full_sweeps

SAMPLERS = [Sampler, DeviceSampler]


def _logits(seed: int, n: int = 3000) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 4).astype(np.float32)


@pytest.mark.parametrize("kind", SAMPLERS)
def test_greedy_pick_is_the_argmax_of_logits_plus_bias(kind):
    x = _logits(0)
    order = np.argsort(-x)
    bias = ((int(order[0]), -math.inf), (int(order[1]), -3.0), (int(order[40]), 25.0))
    p = SamplingParams(temperature=0, logit_bias=bias)
    want = x.copy()
    for t, b in bias:
        want[t] += b
    s = kind(p, x.shape[0])
    assert s.sample(x).token_id == int(np.argmax(want)) == int(order[40])
    # the ban alone: the second best is next in line unless its -3 drops it below the third
    p = SamplingParams(temperature=0, logit_bias=((int(order[0]), -math.inf),))
    assert kind(p, x.shape[0]).sample(x).token_id == int(order[1])
    # the reported log-probability is the unbiased logits' (as without a bias)
    lp = kind(SamplingParams(temperature=0, logit_bias=bias, logprobs=0), x.shape[0]).sample(x).logprob
    assert lp == pytest.approx(float(x[order[40]] - np.log(np.exp(x.astype(np.float64)).sum())), abs=1e-5)


@pytest.mark.parametrize("kind", SAMPLERS)
def test_distribution_is_the_softmax_of_logits_plus_bias(kind):
    x = _logits(1)
    order = np.argsort(-x)
    bias = ((int(order[0]), -100.0), (int(order[7]), 3.5), (int(order[500]), 12.0), (int(order[2]), -2.0))
    p = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, logit_bias=bias, seed=1)
    y = x.astype(np.float64).copy()
    for t, b in bias:
        y[t] += b
    e = np.exp((y - y.max()) / 0.7)
    want = e / e.sum()
    ids, probs = kind(p, x.shape[0]).candidates(x) if kind is DeviceSampler else kind(p, x.shape[0]).distribution(x)
    got = np.zeros_like(want)
    got[ids] = probs
    assert np.abs(got - want).max() < 1e-5
    assert set(ids[:3].tolist()) == set(np.argsort(-want)[:3].tolist())


@pytest.mark.parametrize("kind", SAMPLERS)
def test_bias_comes_before_the_penalties(kind):
    """llama.cpp's chain: the logit-bias sampler first, the penalties after (repeat_penalty divides a positive
    logit, so the order shows)."""
    x = np.zeros(64, dtype=np.float32)
    x[5], x[6] = 2.0, 2.9
    p = SamplingParams(temperature=0, repeat_penalty=2.0, logit_bias=((5, 4.0),))
    s = kind(p, 64)
    s.accept(5)
    # bias then penalty: (2 + 4) / 2 = 3 > 2.9; penalty then bias would give 2 / 2 + 4 = 5: also 5, so tell by 6
    assert s.sample(x).token_id == 5
    x[6] = 3.1
    assert s.sample(x).token_id == 6        # (2 + 4) / 2 = 3 < 3.1; the other order would still pick 5 (5 > 3.1)


def test_device_sampler_with_a_bias_takes_the_array_path_and_judges_verifies_on_the_host():
    """On a GPU the sampling kernel knows no bias: a biased request samples by the array path, and a greedy verify's
    rows are judged on the host (greedy_rows_ok False); without a bias the verify is judged on the device."""
    plain = DeviceSampler(SamplingParams(temperature=0), 100)
    biased = DeviceSampler(SamplingParams(temperature=0, logit_bias=((3, 1.0),)), 100)
    assert plain.greedy_rows_ok and not biased.greedy_rows_ok


@pytest.mark.parametrize("bias, needle", [
    ((("a", 1.0),), "must be an integer"), (((-1, 1.0),), ">= 0"), (((3, 101.0),), "[-100, 100]"),
    (((3, math.nan),), "must be a number"), (((3, math.inf),), "[-100, 100]"), (((3, 1.0), (3, 2.0)), "twice"),
    (tuple((i, 1.0) for i in range(1025)), "at most 1024"), (((3, True),), "must be a number"),
    (((3, 10 ** 400),), "[-100, 100]")])
def test_sampling_params_refuse_a_bad_bias(bias, needle):
    with pytest.raises(ValueError, match="logit_bias") as e:
        SamplingParams(logit_bias=bias)
    assert needle in str(e.value)


# ---- a real daemon against transformers --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(daemon --parallel 2 on a synthetic F32 llama, the transformers model of the same weights, its tokenizer)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from strata.gguf import synth
    from strata.gguf.file import open_gguf
    from tests.daemon import Daemon, free_port
    tmp = tmp_path_factory.mktemp("logit_bias")
    path = synth.write_synthetic(tmp / "l.gguf", synth.preset("llama", qtype="F32", embd_qtype="F32", seed=2))
    d = Daemon(tmp, "--model", str(path), "--device", "cpu", "--parallel", "2", port=free_port()).start()
    hf, _ = synth.hf_model(open_gguf(path).reader)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp), gguf_file=path.name)
    yield d, hf, tok, torch
    assert d.stop() == 0, d.log_tail()


def _reference(hf, torch, ids: list[int], bias: dict[int, float], n: int) -> list[int]:
    """transformers' greedy answer with bias added to its logits, each step's pick clear of the runner-up (the two
    implementations' logits differ by < 5e-3 on this model)."""
    ids, out = list(ids), []
    for _ in range(n):
        with torch.no_grad():
            lg = hf(torch.tensor([ids])).logits[0, -1].numpy().astype(np.float64)
        for t, b in bias.items():
            lg[t] += b
        top = np.argsort(-lg)[:2]
        assert lg[top[0]] - lg[top[1]] > 0.05, "a near tie: pick another prompt"
        out.append(int(top[0]))
        ids.append(int(top[0]))
    return out


def _biases(hf, torch, ids: list[int]) -> list[dict[int, float]]:
    """Biases that change the greedy answer: the plain pick banned and the 30th best raised; the 5th best raised
    over all."""
    with torch.no_grad():
        order = np.argsort(-hf(torch.tensor([ids])).logits[0, -1].numpy())
    return [{int(order[0]): -math.inf, int(order[30]): 4.0, int(order[3]): -100.0},
            {int(order[5]): 100.0, int(order[1]): -1.5}]


def _body_bias(bias: dict[int, float], form: str):
    if form == "openai":
        return {str(t): (-100 if b == -math.inf else b) for t, b in bias.items()}
    return [[t, False if b == -math.inf else b] for t, b in bias.items()]


def test_completions_equal_transformers_with_the_bias_in_both_slots_at_once(llama):
    """Two requests at once (one per slot, decoded in one batched step), each with its own bias, in OpenAI's form
    and llama-server's: each greedy answer is transformers' argmax of logits + that bias."""
    d, hf, tok, torch = llama
    prompt = tok("The quiet river runs past the old mill and")["input_ids"]
    b1, b2 = _biases(hf, torch, prompt)
    n = 6
    want1, want2 = _reference(hf, torch, prompt, b1, n), _reference(hf, torch, prompt, b2, n)
    plain = _reference(hf, torch, prompt, {}, n)
    assert want1 != plain and want2 != plain and want1 != want2
    got = {}

    def run(key, path, body):
        got[key] = d.json("POST", path, body)

    jobs = [threading.Thread(target=run, args=("v1", "/v1/completions", {
                "prompt": prompt, "max_tokens": n, "temperature": 0, "logit_bias": _body_bias(b1, "openai"),
                "cache_prompt": False})),
            threading.Thread(target=run, args=("llama", "/completion", {
                "prompt": prompt, "n_predict": n, "temperature": 0, "logit_bias": _body_bias(b2, "llama"),
                "return_tokens": True, "cache_prompt": False}))]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join()
    st, r = got["v1"]
    assert st == 200, r
    assert r["choices"][0]["text"] == tok.decode(want1), (r["choices"][0]["text"], tok.decode(want1))
    st, r = got["llama"]
    assert st == 200, r
    assert r["tokens"] == want2
    gs = r["generation_settings"]["logit_bias"]
    assert {e["token"]: e["bias"] for e in gs} == {t: (False if b == -math.inf else b) for t, b in b2.items()}


def test_chat_with_the_openai_client_equals_transformers(llama):
    """The openai client's logit_bias on /v1/chat/completions: the answer is transformers' greedy argmax of logits +
    the bias over the chat template's prompt (transformers' own rendering and tokenization)."""
    openai = pytest.importorskip("openai")
    d, hf, tok, torch = llama
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key="x", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Name a colour of the sea."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    bias = _biases(hf, torch, ids)[0]
    want = _reference(hf, torch, ids, bias, 5)
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0,
                                       logit_bias={str(t): (-100 if b == -math.inf else b) for t, b in bias.items()})
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tok.decode(want)


@pytest.mark.parametrize("path, bias, param, needle", [
    ("/v1/chat/completions", {"hello": 1}, "logit_bias", "token ids"),
    ("/v1/chat/completions", {"5": 101}, 'logit_bias["5"]', "[-100, 100]"),
    ("/v1/chat/completions", {"5": "1"}, 'logit_bias["5"]', "must be a number"),
    ("/v1/chat/completions", {"5": True}, 'logit_bias["5"]', "must be a number"),
    ("/v1/chat/completions", {"999999": 1}, "logit_bias", "outside the vocabulary"),
    ("/v1/chat/completions", {str(i): 1 for i in range(1025)}, "logit_bias", "at most 1024"),
    ("/v1/chat/completions", 5, "logit_bias", "must be an object"),
    ("/v1/completions", [[5, 1], [5, 2]], "logit_bias", "twice"),
    ("/v1/completions", [[5]], "logit_bias[0]", "pair"),
    ("/v1/completions", [[-5, 1]], "logit_bias[0][0]", "token id"),
    ("/completion", [[5, -100.5]], "logit_bias[0][1]", "[-100, 100]"),
    ("/completion", [[5, True]], "logit_bias[0][1]", "must be a number"),
    ("/completion", [[60000, False]], "logit_bias", "outside the vocabulary"),
    # an integer past float's range (JSON has no bound): was a 500 (OverflowError formatting it)
    ("/v1/chat/completions", {"5": 10 ** 400}, 'logit_bias["5"]', "[-100, 100]"),
    ("/completion", [[5, -10 ** 400]], "logit_bias[0][1]", "[-100, 100]"),
])
def test_bad_logit_bias_is_a_400_naming_the_field(llama, path, bias, param, needle):
    d = llama[0]
    body = {"max_tokens": 2, "logit_bias": bias}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    st, r = d.json("POST", path, body)
    assert st == 400, r
    msg = r["error"]["message"] if isinstance(r["error"], dict) else r["error"]
    assert needle in msg and "logit_bias" in msg, msg
    if isinstance(r["error"], dict) and "param" in r["error"]:
        assert r["error"]["param"] == param, r


_json = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 40, 2 ** 40) | st.floats(allow_nan=False)
                     | st.integers(10 ** 300, 10 ** 400).map(lambda i: -i) | st.integers(10 ** 300, 10 ** 400)
                     | st.text(max_size=8), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                                               max_size=4), max_leaves=12)
_entry = st.tuples(st.integers(-3, 70000) | st.text("0123456789x", min_size=1, max_size=6),
                   st.floats(-150, 150) | st.booleans() | st.integers(-120, 120) | st.integers(10 ** 300, 10 ** 400))


@settings(max_examples=1500 if full_sweeps() else 500, deadline=None)     # CI 500, make test-sweeps 1,500
@given(st.one_of(_json, st.lists(_entry.map(list), max_size=6),
                 st.dictionaries(st.text("0123456789x-", min_size=1, max_size=6), _entry.map(lambda e: e[1]),
                                 max_size=6)))
def test_the_logit_bias_reader_takes_a_valid_bias_or_names_the_field(value):
    """Any JSON value as logit_bias: pairs SamplingParams takes (ids >= 0 ascending and distinct, biases in
    [-100, 100] or -inf), or a 400 naming logit_bias; nothing else escapes."""
    from strata.serve import schema
    from strata.serve.errors import ApiError
    try:
        r = schema.parse_completion({"prompt": "x", "logit_bias": value})
    except ApiError as e:
        assert e.status == 400 and "logit_bias" in str(e) and "\n" not in str(e)
        return
    pairs = r.sampling.get("logit_bias", ())
    assert SamplingParams(logit_bias=pairs).logit_bias == pairs
    assert all(-100 <= b <= 100 or b == -math.inf for _, b in pairs)


# ---- a bias against a constraint ---------------------------------------------------------------------------------

BAN_LOW = {str(i): False for i in range(1024)}      # OpenAI's object form takes false (llama-server's ban) too


def test_a_bias_banning_every_token_a_grammar_allows_is_a_400_naming_logit_bias(qwen):
    """The grammar `root ::= "7"` allows one token first (the vocabulary's "7", an id below 1024): banning ids
    0..1023 leaves nothing to sample, so the answer is a 400 naming logit_bias (it was a 200 'stop' with no text,
    an output the grammar does not admit); under `root ::= "7"+` with the "7" token spared the answer is sevens."""
    st_, r = qwen.json("POST", "/completion", {"prompt": "hi", "n_predict": 4, "grammar": 'root ::= "7"',
                                               "logit_bias": [[i, False] for i in range(1024)]})
    assert st_ == 400, r
    assert "logit_bias" in r["error"]["message"] and "constraint" in r["error"]["message"], r
    st_, r = qwen.json("POST", "/tokenize", {"content": "7"})
    assert st_ == 200, r
    (seven,) = r["tokens"]
    spare = [[i, False] for i in range(1024) if i != seven]
    st_, r = qwen.json("POST", "/completion", {"prompt": "hi", "n_predict": 4, "grammar": 'root ::= "7"+',
                                               "logit_bias": spare, "temperature": 1.0, "seed": 3})
    assert st_ == 200 and re.fullmatch("7+", r["content"]), r


@pytest.mark.parametrize("tool_choice", ["required", {"type": "allowed_tools", "allowed_tools": {
    "mode": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}}])
def test_a_required_tool_call_under_a_bias_banning_its_tokens_is_a_400_not_an_empty_stop(qwen, tool_choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0, "tools": tools,
            "tool_choice": tool_choice}
    st_, r = qwen.json("POST", "/v1/chat/completions", body)
    assert st_ == 200 and r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f", r
    st_, r = qwen.json("POST", "/v1/chat/completions", {**body, "logit_bias": BAN_LOW})
    assert st_ == 400, r
    assert r["error"]["param"] == "logit_bias", r


def _refusal_or_pairs(pairs):
    """pairs (llama-server's array form, integer ids) -> (what SamplingParams keeps or the words of its refusal after
    the field's name, the same from the request reader)."""
    from strata.serve import schema
    from strata.serve.errors import ApiError
    try:
        want = SamplingParams(logit_bias=[(t, -math.inf if b is False else b) for t, b in pairs]).logit_bias
    except ValueError as e:
        want = str(e).split(" ", 1)[1]
    try:
        got = schema.parse_completion({"prompt": "x", "logit_bias": pairs}).sampling.get("logit_bias", ())
    except ApiError as e:
        got = str(e).split("' ", 1)[1]
    return want, got


@settings(max_examples=300, deadline=None)
@given(st.lists(_entry.filter(lambda e: isinstance(e[0], int)).map(list), max_size=5))
def test_the_reader_and_sampling_params_refuse_by_one_rule(pairs):
    """llama-server's array form [[id, bias], ...] of pairs with integer ids: the request reader and SamplingParams
    (the engine's contract) take the same pairs, or refuse with the same words after the field's name (one copy of
    the id, range and duplicate rules: the reader names the field's path, the sampler's rule the problem)."""
    want, got = _refusal_or_pairs(pairs)
    assert got == want


def test_the_reader_and_sampling_params_count_by_one_rule():
    for n in (1024, 1025):
        want, got = _refusal_or_pairs([[i, 1] for i in range(n)])
        assert got == want and (n == 1024) == isinstance(got, tuple), got
