"""llama-server's utility routes on the real daemon, driven with curl over the Unix socket: /tokenize, /detokenize,
/apply-template, /props, and their errors in llama-server's shape."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.daemon import Daemon

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def curl(d: Daemon, path: str, body=None, *, raw: str | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON body) of `curl --unix-socket` to the daemon; POST when a body is given."""
    cmd = ["curl", "-sS", "--unix-socket", d.sock, f"http://strata{path}", "-w", "\n%{http_code}"]
    if body is not None or raw is not None:
        cmd += ["-H", "Content-Type: application/json", "--data-binary", raw if raw is not None else json.dumps(body)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    text, _, status = out.rpartition("\n")
    return int(status), json.loads(text)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("llama_api")).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from strata.gguf.file import open_gguf
    from strata.text.tokenizer import Tokenizer
    return Tokenizer.from_gguf(open_gguf(default_model_path).metadata)


def test_tokenize_ids_and_pieces(daemon, tokenizer):
    text = "Hello 🦙 world, <|im_start|>é"
    st, r = curl(daemon, "/tokenize", {"content": text})
    assert st == 200 and r["tokens"] == tokenizer.encode(text, parse_special=True, add_bos=False)
    assert tokenizer.token_to_id("<|im_start|>") in r["tokens"]          # parse_special defaults to true
    st, p = curl(daemon, "/tokenize", {"content": text, "with_pieces": True})
    assert st == 200 and [t["id"] for t in p["tokens"]] == r["tokens"]
    pieces = [t["piece"] for t in p["tokens"]]
    # the llama is split over byte tokens: those pieces are byte lists, the others strings
    assert any(isinstance(x, list) for x in pieces) and any(x == "<|im_start|>" for x in pieces)
    joined = b"".join(bytes(x) if isinstance(x, list) else x.encode() for x in pieces)
    assert joined == text.encode()
    for x in pieces:
        if isinstance(x, list):
            with pytest.raises(UnicodeDecodeError):
                bytes(x).decode("utf-8")


def test_tokenize_parse_special_false_and_mixed_content(daemon, tokenizer):
    st, r = curl(daemon, "/tokenize", {"content": "<|im_start|>", "parse_special": False})
    assert st == 200 and len(r["tokens"]) > 1 and tokenizer.token_to_id("<|im_start|>") not in r["tokens"]
    st, r = curl(daemon, "/tokenize", {"content": ["Hi", 1, " there"]})
    assert st == 200 and r["tokens"] == tokenizer.encode("Hi", add_bos=False) + [1] + \
        tokenizer.encode(" there", add_bos=False)


def test_detokenize_round_trip(daemon):
    text = "The capital of France is Paris. Ünïcödé ✓ 🦙"
    _, r = curl(daemon, "/tokenize", {"content": text})
    st, d = curl(daemon, "/detokenize", {"tokens": r["tokens"]})
    assert st == 200 and d == {"content": text}
    _, r = curl(daemon, "/tokenize", {"content": "<|im_start|>user"})
    assert curl(daemon, "/detokenize", {"tokens": r["tokens"]})[1]["content"] == "<|im_start|>user"   # as text
    assert curl(daemon, "/detokenize", {"tokens": []}) == (200, {"content": ""})


def test_apply_template(daemon, default_model_path, tokenizer):
    from strata.text.chat_template import ChatTemplate
    from strata.gguf.file import open_gguf
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi <|im_end|>"}]
    st, r = curl(daemon, "/apply-template", {"messages": msgs})
    expect = ChatTemplate.from_gguf(open_gguf(default_model_path).metadata, tokenizer).render_text(msgs)
    assert st == 200 and r == {"prompt": expect}
    assert r["prompt"].startswith("<|im_start|>system\nBe terse.<|im_end|>") and \
        r["prompt"].endswith("<|im_start|>assistant\n")
    # without the generation prompt; and with tools, the prompt the chat route reads: the default model's template
    # knows no tools, so the generic family's system prompt carries them, and /tokenize of it counts the chat
    # route's prompt_tokens
    _, r2 = curl(daemon, "/apply-template", {"messages": msgs, "add_generation_prompt": False})
    assert r2["prompt"] == r["prompt"][:-len("<|im_start|>assistant\n")]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    plain = [{"role": "user", "content": "Weather in Paris?"}]       # (message text never becomes control tokens)
    _, r3 = curl(daemon, "/apply-template", {"messages": plain, "tools": tools})
    assert "get_weather" in r3["prompt"]
    _, toks = curl(daemon, "/tokenize", {"content": r3["prompt"], "parse_special": True})
    st, chat = curl(daemon, "/v1/chat/completions", {"messages": plain, "tools": tools, "max_tokens": 1})
    assert st == 200 and chat["usage"]["prompt_tokens"] == len(toks["tokens"])


def test_props(daemon, default_model_path):
    from strata.gguf.file import open_gguf
    st, r = curl(daemon, "/props")
    assert st == 200
    assert r["total_slots"] == 1 and r["model_path"] == str(default_model_path)
    assert r["chat_template"] == open_gguf(default_model_path).metadata["tokenizer.chat_template"]
    assert r["default_generation_settings"]["n_ctx"] == 512
    assert r["default_generation_settings"]["params"]["temperature"] == 0.8
    assert r["default_generation_settings"]["speculative"] is False       # no --spec
    assert r["default_generation_settings"]["params"]["speculative.n_max"] == 0
    assert r["bos_token"] == "<|im_start|>" and r["eos_token"] == "<|im_end|>"
    assert r["build_info"].startswith("strata-")


@pytest.mark.parametrize("path,body,needle", [
    ("/tokenize", {}, "'content' is required"),
    ("/tokenize", {"content": 5}, "'content' must be a string or an array"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "'with_pieces' must be a boolean"),
    ("/tokenize", {"content": ["x", 10 ** 9]}, "token id 1000000000 outside the vocabulary"),
    ("/tokenize", {"content": "\ud800"}, "lone surrogate U+D800"),
    ("/detokenize", {"tokens": [1, -1]}, "token id -1 outside the vocabulary"),
    ("/detokenize", {"tokens": "hi"}, "'tokens' must be an array of token ids"),
    ("/apply-template", {}, "'messages' is required"),
    ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/completion", {}, "'prompt' is required"),
    ("/completion", {"prompt": "x", "n_predict": "ten"}, "'n_predict' must be an integer >= -1"),
    ("/completion", {"prompt": "x", "n_probs": 3}, "'n_probs' is not supported"),
    ("/completion", {"prompt": "x", "id_slot": 3}, "'id_slot' must be 0 or -1"),
    ("/completion", {"prompt": [1, 10 ** 9]}, "outside the vocabulary"),
])
def test_errors_in_llama_server_shape(daemon, path, body, needle):
    st, r = curl(daemon, path, body)
    assert st == 400 and set(r) == {"error"} and set(r["error"]) == {"code", "message", "type"}
    assert r["error"]["code"] == 400 and r["error"]["type"] == "invalid_request_error"
    assert needle in r["error"]["message"] and "\n" not in r["error"]["message"]


def test_malformed_json_and_wrong_method(daemon):
    st, r = curl(daemon, "/tokenize", raw='{"content": ')
    assert st == 400 and r["error"]["type"] == "invalid_request_error" and "not valid JSON" in r["error"]["message"]
    st, _ = curl(daemon, "/props", {"x": 1})          # POST /props: llama-server needs --props for it; Strata has none
    assert st == 405


def test_add_special_adds_bos_where_the_model_asks_for_it(tmp_path):
    """The default model's metadata says add_bos_token = false; a tiny synthetic llama that says true gets BOS with
    add_special (and only then, and only before the first element of mixed content)."""
    from strata.gguf import synth
    path = synth.write_synthetic(tmp_path / "bos.gguf", synth.preset("llama", "tiny"),
                                 overrides={"tokenizer.ggml.add_bos_token": True})
    d = Daemon(tmp_path, "--model", str(path)).start()
    try:
        _, plain = curl(d, "/tokenize", {"content": "Hi"})
        _, special = curl(d, "/tokenize", {"content": "Hi", "add_special": True})
        assert special["tokens"] == [1] + plain["tokens"]
        _, mixed = curl(d, "/tokenize", {"content": ["Hi", "Hi"], "add_special": True})
        assert mixed["tokens"] == [1] + plain["tokens"] * 2
    finally:
        d.stop()


def test_completion_with_curl_whole_and_streamed(daemon):
    body = {"prompt": "1, 2, 3, 4,", "n_predict": 6, "temperature": 0}
    st, r = curl(daemon, "/completion", body)
    assert st == 200 and r["stop"] is True and r["tokens_predicted"] == 6 and r["stop_type"] == "limit"
    assert r["stopped_limit"] and r["content"].strip().startswith("5") and r["tokens_evaluated"] > 0
    assert r["generation_settings"]["n_predict"] == 6 and r["timings"]["predicted_n"] == 6
    cmd = ["curl", "-sS", "-N", "--unix-socket", daemon.sock, "http://strata/completion", "-H",
           "Content-Type: application/json", "--data-binary", json.dumps({**body, "stream": True})]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    events = [json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == r["content"] and events[-1]["tokens_predicted"] == 6
    st, w = curl(daemon, "/completion", {"prompt": "The capital of France is", "n_predict": 30, "temperature": 0,
                                         "stop": [" Paris"]})
    assert st == 200 and w["stop_type"] == "word" and w["stopping_word"] == " Paris" and w["stopped_word"]


def test_completion_return_tokens_gives_the_generated_ids(daemon, tokenizer):
    """return_tokens: the ids generated (whole, and chunk by chunk when streamed), which decode to the content and,
    read back after the prompt, continue the same greedy answer; without it "tokens" is empty."""
    body = {"prompt": "1, 2, 3, 4,", "n_predict": 6, "temperature": 0, "return_tokens": True}
    st, r = curl(daemon, "/completion", body)
    assert st == 200 and len(r["tokens"]) == 6 and tokenizer.decode(r["tokens"]) == r["content"]
    cmd = ["curl", "-sS", "-N", "--unix-socket", daemon.sock, "http://strata/completion", "-H",
           "Content-Type: application/json", "--data-binary", json.dumps({**body, "stream": True})]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    events = [json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("data: ")]
    assert [t for e in events for t in e["tokens"]] == r["tokens"]
    _, head = curl(daemon, "/tokenize", {"content": body["prompt"], "add_special": True})
    st, tail = curl(daemon, "/completion", {"prompt": head["tokens"] + r["tokens"][:3], "n_predict": 3,
                                            "temperature": 0, "return_tokens": True, "cache_prompt": False})
    assert st == 200 and tail["tokens"] == r["tokens"][3:]
    st, plain = curl(daemon, "/completion", {**body, "return_tokens": False})
    assert plain["tokens"] == [] and plain["content"] == r["content"]
    st, bad = curl(daemon, "/completion", {**body, "return_tokens": "yes"})
    assert st == 400 and "return_tokens" in bad["error"]["message"]
    st, bad = curl(daemon, "/completion", {"prompt": "Hi", "n_predict": 10 ** 23})
    assert st == 400 and "n_predict" in bad["error"]["message"] and "max_tokens" not in bad["error"]["message"]


def test_completion_answers_a_token_id_prompt_with_its_text(daemon, tokenizer):
    """A token-id prompt's answer says what was read as llama-server says it: the ids detokenized, special tokens as
    their text (not an empty string); a text prompt comes back as sent; streamed, the last event says the same."""
    text = "<|im_start|>user\nThe capital of France is"
    ids = tokenizer.encode(text, parse_special=True, add_bos=False)
    for stream in (False, True):
        body = {"prompt": ids, "n_predict": 2, "temperature": 0, "stream": stream}
        if stream:
            cmd = ["curl", "-sS", "-N", "--unix-socket", daemon.sock, "http://strata/completion", "-H",
                   "Content-Type: application/json", "--data-binary", json.dumps(body)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
            r = [json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("data: ")][-1]
        else:
            st, r = curl(daemon, "/completion", body)
            assert st == 200
        assert r["prompt"] == text, r["prompt"]
    st, r = curl(daemon, "/completion", {"prompt": "Hi there", "n_predict": 1})
    assert st == 200 and r["prompt"] == "Hi there"


def test_completion_empty_grammar_is_none_and_null_id_slot_is_any(daemon):
    """llama-server reads an empty `grammar` as no grammar and a null `id_slot` as -1 (any slot): the answer is the
    one without either; a grammar of blanks is still a 400 naming `grammar`."""
    body = {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0}
    st, plain = curl(daemon, "/completion", body)
    assert st == 200
    for extra in ({"grammar": ""}, {"id_slot": None}, {"grammar": "", "id_slot": None}):
        st, r = curl(daemon, "/completion", {**body, **extra})
        assert st == 200 and r["content"] == plain["content"], (extra, r)
    st, r = curl(daemon, "/v1/completions", {"prompt": body["prompt"], "max_tokens": 6, "temperature": 0,
                                             "grammar": ""})
    assert st == 200 and r["choices"][0]["text"] == plain["content"]
    st, r = curl(daemon, "/completion", {**body, "grammar": "  "})
    assert st == 400 and "grammar" in r["error"]["message"]
    # llama-server's logit_bias: [[id, false]] bans the plain answer's first token (tests/test_logit_bias.py checks
    # the answers against transformers); an id past the vocabulary is a 400 naming the field
    first = curl(daemon, "/completion", {**body, "return_tokens": True})[1]["tokens"][0]
    st, r = curl(daemon, "/completion", {**body, "return_tokens": True, "logit_bias": [[first, False]]})
    assert st == 200 and r["tokens"][0] != first
    st, r = curl(daemon, "/completion", {**body, "logit_bias": [[10 ** 6, -100]]})
    assert st == 400 and "logit_bias" in r["error"]["message"]


def test_a_slot_shows_its_last_task_and_what_it_holds(daemon):
    """/slots as llama-server shows a slot that has served requests (both sent to slot 0): id_task counts each
    request of every slot (it stayed -1 with one slot), n_prompt_tokens is what its cache holds (the prompt and the
    answer but its last token; it was 0 once idle)."""
    _, before = curl(daemon, "/slots")
    ids = [curl(daemon, "/tokenize", {"content": "Once upon a time"})[1]["tokens"]]
    for _ in range(2):
        st, r = curl(daemon, "/completion", {"prompt": ids[0], "n_predict": 5, "temperature": 0,
                                             "cache_prompt": False, "id_slot": 0})
        assert st == 200 and r["tokens_predicted"] == 5
    _, after = curl(daemon, "/slots")
    assert after[0]["id_task"] == max(s["id_task"] for s in before) + 2 and not after[0]["is_processing"]
    assert after[0]["n_prompt_tokens"] == len(ids[0]) + 5 - 1


def test_completion_reports_an_end_of_generation_and_the_default_length(daemon):
    st, r = curl(daemon, "/completion", {"prompt": "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n",
                                         "temperature": 0})
    assert st == 200 and r["stop_type"] == "eos" and r["stopped_eos"] and not r["stopped_word"]
    assert r["stopping_word"] == "" and r["generation_settings"]["n_predict"] == 1024
    st, p = curl(daemon, "/props")
    assert p["default_generation_settings"]["params"]["n_predict"] == 1024


# ---- /infill -------------------------------------------------------------------------------------------------------
def test_infill_without_fim_tokens_is_refused(daemon):
    """The default model has no FIM prefix / suffix / middle tokens: 501 in llama-server's shape, naming them."""
    st, r = curl(daemon, "/infill", {"input_prefix": "def f():\n", "input_suffix": "\n", "n_predict": 2})
    assert st == 501 and r["error"]["type"] == "not_supported_error", r
    assert "no FIM prefix, suffix, middle tokens" in r["error"]["message"], r


def _documented_layout(extra: list[tuple[str, str]], prefix: str, suffix: str, prompt: str) -> str:
    """llama.cpp's tools/server/README.md, POST /infill, the repo-level pattern (the model has FIM_REP and FIM_SEP):
    <FIM_REP>myproject / <FIM_SEP>{filename} / {text} ... <FIM_SEP>filename / <FIM_PRE>prefix<FIM_SUF>suffix<FIM_MID>prompt
    with Qwen2.5-Coder's token names (the synthetic writer's FIM tokens)."""
    out = "<|repo_name|>myproject\n"
    for name, text in extra:
        out += f"<|file_sep|>{name}\n{text}"
    return out + f"<|file_sep|>filename\n<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{prompt}"


def test_infill_prompt_follows_llama_servers_documented_layout(tmp_path, synthetic):
    """A synthetic llama with FIM tokens: /infill's prompt is the documented layout's text tokenized with its special
    tokens read as such (checked through /tokenize of the same daemon, and by a greedy /completion of those ids
    answering what /infill answered), and errors name the field."""
    path = synthetic("llama", name="fim", fim=True)
    # n_ctx past a batch (2048) leaves room for the extra context, as llama-server's budget has it
    d = Daemon(tmp_path, "--model", str(path), n_ctx=4096).start()
    try:
        extra = [("util.py", "def add(a, b):\n    return a + b\n"), ("b.txt", "hello\n")]
        prefix, suffix, prompt = "def main():\n    x = ", "\n    print(x)\n", "add("
        body = {"input_prefix": prefix, "input_suffix": suffix, "prompt": prompt, "n_predict": 4,
                "temperature": 0, "cache_prompt": False,
                "input_extra": [{"filename": n, "text": t} for n, t in extra]}
        st, r = curl(d, "/infill", body)
        assert st == 200 and r["stop"] is True and r["tokens_predicted"] <= 4, r
        _, ref = curl(d, "/tokenize", {"content": _documented_layout(extra, prefix, suffix, prompt),
                                       "parse_special": True})
        ids = ref["tokens"]
        assert sum(1 for t in ids if t >= 49152) == 7        # rep, three file separators, pre, suf, mid
        assert r["tokens_evaluated"] == len(ids), (r["tokens_evaluated"], len(ids))
        st, same = curl(d, "/completion", {"prompt": ids, "n_predict": 4, "temperature": 0, "cache_prompt": False})
        assert st == 200 and same["content"] == r["content"]
        cmd = ["curl", "-sS", "-N", "--unix-socket", d.sock, "http://strata/infill", "-H",
               "Content-Type: application/json", "--data-binary", json.dumps({**body, "stream": True})]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
        events = [json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("data: ")]
        assert events[-1]["stop"] is True and "".join(e["content"] for e in events[:-1]) == r["content"]
        for bad, field in (({"input_suffix": ""}, "'input_prefix' is required"),
                           ({"input_prefix": "", "input_suffix": 3}, "'input_suffix' must be a string"),
                           ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "x"}]},
                            "'input_extra[0].text' must be a string"),
                           ({"input_prefix": "", "input_suffix": "", "prompt": ["x"]}, "'prompt' must be a string")):
            st, e = curl(d, "/infill", bad)
            assert st == 400 and field in e["error"]["message"] and e["error"]["code"] == 400, (bad, e)
    finally:
        d.stop()


def test_fim_tokens_found_by_metadata_or_by_their_text(synthetic, default_model_path):
    """The FIM ids the GGUF names, and the same ids found by their token texts where the metadata names none (as
    llama.cpp finds them); the default model has none of prefix, suffix, middle."""
    from types import SimpleNamespace

    from strata.gguf.file import open_gguf
    from strata.serve.infill_api import fim_tokens
    from strata.text.tokenizer import Tokenizer
    meta = dict(open_gguf(synthetic("llama", name="fim", fim=True)).metadata)
    tok = Tokenizer.from_gguf(meta)
    named = fim_tokens(SimpleNamespace(file=SimpleNamespace(metadata=meta), tokenizer=tok))
    assert named == {r: meta[f"tokenizer.ggml.fim_{r}_token_id"] for r in ("pre", "suf", "mid", "rep", "sep")}
    bare = {k: v for k, v in meta.items() if "fim_" not in k}
    assert fim_tokens(SimpleNamespace(file=SimpleNamespace(metadata=bare), tokenizer=tok)) == named
    dmeta = open_gguf(default_model_path).metadata
    got = fim_tokens(SimpleNamespace(file=SimpleNamespace(metadata=dmeta), tokenizer=Tokenizer.from_gguf(dmeta)))
    assert got["pre"] is got["suf"] is got["mid"] is None and got["rep"] == 4 and got["sep"] == 5  # <reponame>, <file_sep>
