"""Ollama's API (strata/serve/ollama_api.py) with the official `ollama` Python client against the real daemon: chat and
generate, streamed and not, raw prompts, JSON output, options, the model list, show and ps, and the refusals."""
from __future__ import annotations

import json

import pytest

from tests.daemon import Daemon, free_port

ollama = pytest.importorskip("ollama")

HI = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("ollama"), "--alias", "smollm2:135m", "--embeddings", port=free_port()).start()
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=f"http://127.0.0.1:{daemon.port}", timeout=120)


def test_chat_streamed_equals_whole_and_reports_counts(client):
    whole = client.chat(model="llama3.2", messages=HI, options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.model == "llama3.2"
    assert "Paris" in whole.message.content and whole.message.role == "assistant"
    assert 0 < whole.eval_count <= 12 and whole.prompt_eval_count > 0 and whole.total_duration > 0
    parts = list(client.chat(model="llama3.2", messages=HI, options=GREEDY, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_prompt_eval_count_is_the_whole_prompt_cached_tokens_apart(client, daemon, hf_tokenizer):
    """prompt_eval_count counts the whole prompt as Ollama's does (cached tokens included; clients track the context
    by it), prompt_eval_cached_count the tokens the cache gave (it was the tokens read: 1 or 2 on a later turn)."""
    tok = hf_tokenizer
    msgs = [{"role": "system", "content": "You answer in one word."}, *HI]
    first = client.chat(model="x", messages=msgs, options=GREEDY, stream=False)
    msgs += [{"role": "assistant", "content": first.message.content}, {"role": "user", "content": "And Spain?"}]
    later = client.chat(model="x", messages=msgs, options=GREEDY, stream=False)
    want = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    assert later.prompt_eval_count == want, (later.prompt_eval_count, want)
    # the client (0.6) keeps no prompt_eval_cached_count: the same turn again, over HTTP
    st, again = daemon.json("POST", "/api/chat", {"model": "x", "messages": msgs, "options": GREEDY, "stream": False})
    assert st == 200 and again["prompt_eval_count"] == want and want // 2 < again["prompt_eval_cached_count"] < want


def test_num_predict_bounds_the_answer(client):
    r = client.chat(model="x", messages=[{"role": "user", "content": "Count from 1 to 100."}],
                    options={"temperature": 0, "num_predict": 5})
    assert r.eval_count == 5 and r.done_reason == "length"


def test_generate_templated_and_raw(client):
    r = client.generate(model="smollm2:135m", prompt=HI[0]["content"], options=GREEDY)
    assert "Paris" in r.response and r.done
    chat = client.chat(model="smollm2:135m", messages=HI, options=GREEDY)
    assert r.response == chat.message.content               # the same prompt through the chat template
    raw = client.generate(model="m", prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "num_predict": 6})
    assert raw.response.strip().startswith("5") and raw.eval_count == 6
    parts = list(client.generate(model="m", prompt="1, 2, 3, 4,", raw=True, stream=True,
                                 options={"temperature": 0, "num_predict": 6}))
    assert "".join(p.response for p in parts) == raw.response
    loaded = client.generate(model="m", prompt="")          # Ollama's way to load a model: nothing generated
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    loaded = client.chat(model="m", messages=[])             # the same through /api/chat
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""


def test_json_format(client):
    r = client.chat(model="m", messages=[{"role": "user", "content": "Give a JSON object with a key 'city'."}],
                    format={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                    options={"temperature": 0, "num_predict": 40})
    assert isinstance(json.loads(r.message.content)["city"], str)


def test_models_show_ps_version(client, daemon):
    names = [m.model for m in client.list().models]
    assert names == ["SmolLM2-135M-Instruct.Q4_1", "smollm2:135m"]
    m = client.list().models[0]
    assert m.details.format == "gguf" and m.details.family == "llama" and m.details.quantization_level == "Q4_1"
    assert m.size > 50_000_000 and m.details.parameter_size.endswith("M")
    s = client.show("whatever")
    assert "im_start" in s.template and s.modelinfo["general.architecture"] == "llama"
    assert [p.model for p in client.ps().models] == ["SmolLM2-135M-Instruct.Q4_1"]
    st, v = daemon.json("GET", "/api/version")
    assert st == 200 and v["version"]


def test_refusals_are_one_line_ollama_errors(client, daemon):
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3")
    assert e.value.status_code == 501 and "--model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="m", input="")                   # embeddings are served (tests/test_embeddings.py)
    assert e.value.status_code == 400 and "'input'" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="m", messages=HI, options={"warp_speed": 9})
    assert e.value.status_code == 400 and "options.warp_speed" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="m", messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])
    assert e.value.status_code == 400 and "messages[0].images" in e.value.error
    for body, needle in (({"model": "m", "messages": "hi"}, "'messages'"),
                         ({"model": "m", "messages": HI, "options": {"num_predict": "lots"}}, "options.num_predict"),
                         ({"model": "m", "messages": HI, "options": {"temperature": -1}}, "'options.temperature'"),
                         ({"model": "m", "messages": HI, "options": {"top_p": 3}}, "'options.top_p'"),
                         ({"model": "m", "messages": HI, "options": {"num_predict": 10 ** 23}}, "options.num_predict is"),
                         ({"model": "m", "messages": HI, "format": {"type": "nope"}}, "'format"),
                         ({"model": "m", "messages": HI, "format": 7}, "'format'"),
                         ({"model": "m", "messages": HI, "stream": "yes"}, "'stream'")):
        st, d = daemon.json("POST", "/api/chat", body)
        assert st == 400 and set(d) == {"error"} and needle in d["error"], (body, d)
    st, d = daemon.json("DELETE", "/api/delete", {"model": "m"})
    assert st == 501 and set(d) == {"error"}


def test_a_message_without_content_is_an_empty_turn_as_in_ollama(daemon):
    """Ollama decodes a message without `content` to Go's zero value, an empty string, and answers; so does Strata:
    the answer equals the one to the same message with "content": "". A null content is a 400 naming it."""
    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    body = {"model": "m", "stream": False, "options": GREEDY}
    st, missing = daemon.json("POST", "/api/chat", {**body, "messages": turns + [{"role": "user"}]})
    st2, empty = daemon.json("POST", "/api/chat", {**body, "messages": turns + [{"role": "user", "content": ""}]})
    assert st == st2 == 200 and missing["message"] == empty["message"]
    assert missing["prompt_eval_count"] + missing["eval_count"] > 0
    st, d = daemon.json("POST", "/api/chat", {**body, "messages": turns + [{"role": "user", "content": None}]})
    assert st == 400 and "messages[2].content" in d["error"], d
