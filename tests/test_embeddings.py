"""Embeddings (strata/engine/embed.py, strata/serve/embeddings_api.py): vectors against transformers' final-normed
hidden states on the default model, the live conversation untouched by a read (state hashes and checkpoints before
and after, one and two stages, a pool too full for the read), the routes of OpenAI (the `openai` SDK), llama-server
and Ollama (the `ollama` client), their refusals, and a remote stage's clear 501."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from strata.engine.embed import EmbedRefused, NotServed, normalize
from strata.engine.engine import Engine
from tests.daemon import Daemon, WorkerProc, free_port
from tests.helpers import ask

TEXTS = ["The cat sat on the mat.",
         "Paris is the capital of France; the Eiffel Tower stands on the Champ de Mars. " * 5,
         "def add(a, b):\n    return a + b\n"]
# Strata's matmuls quantize activations to 8 bits (Q8 blocks, as llama.cpp does; tests/test_llama_parity.py), so its
# hidden states are not transformers' fp32 ones bit for bit. Measured on the default model: pooled and normalised
# vectors cosine >= 0.9989 to the reference, per-token vectors >= 0.9906. The vectors of two different texts of
# TEXTS are at most ~0.9 apart (the test checks that the bound separates them).
POOLED_COS = 0.995
TOKEN_COS = 0.98

SYSTEM = "You are a helpful assistant who answers briefly."


def cos(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def engine():
    return Engine("default", n_ctx=512, prompt_cache=4)


@pytest.fixture(scope="module")
def hf_hidden(hf_default_model):
    """text -> transformers' last_hidden_state (the final norm applied) for the same token ids, fp32."""
    torch = pytest.importorskip("torch")
    m = hf_default_model
    cache = {}

    def hidden(ids):
        key = tuple(ids)
        if key not in cache:
            with torch.no_grad():
                cache[key] = m.model(torch.tensor([list(ids)])).last_hidden_state[0].float().numpy()
        return cache[key]
    return hidden


def test_normalize_is_llama_cpps():
    v = np.array([[3.0, -4.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    assert np.allclose(normalize(v, 2)[0], [0.6, -0.8, 0.0]) and not normalize(v, 2)[1].any()
    assert np.allclose(normalize(v, 1)[0], [3 / 7, -4 / 7, 0.0])                  # taxicab
    assert np.allclose(normalize(v, 0)[0], np.array([3.0, -4.0, 0.0]) * 32760.0 / 4.0)   # int16 range
    assert np.allclose(normalize(v, -1), v)
    assert np.allclose(normalize(v, 3)[0], np.array([3.0, -4.0, 0.0]) / (27 + 64) ** (1 / 3))


@pytest.mark.parametrize("pooling", ["last", "mean", "cls", "none"])
def test_vectors_match_transformers(engine, hf_hidden, pooling):
    ids = [engine.tokenize_prompt(t) for t in TEXTS]
    out = engine.embed(ids, pooling=pooling)
    refs = []
    for got, toks in zip(out, ids):
        ref = hf_hidden(toks)
        assert got.n_tokens == len(toks)
        if pooling == "none":
            assert got.vectors.shape == ref.shape
            assert cos(got.vectors, ref).min() > TOKEN_COS
            continue
        want = {"last": ref[-1], "mean": ref.mean(0), "cls": ref[0]}[pooling]
        want = want / np.linalg.norm(want)
        assert got.vectors.shape == (1, ref.shape[1])
        assert abs(np.linalg.norm(got.vectors[0]) - 1.0) < 1e-5
        assert cos(got.vectors[0], want) > POOLED_COS, (pooling, len(toks), cos(got.vectors[0], want))
        refs.append(want)
    if pooling in ("last", "mean"):         # the bound tells different texts apart
        assert max(cos(refs[i], refs[j]) for i in range(3) for j in range(3) if i != j) < POOLED_COS


def chat_state(engine, turns=2):
    """A chat of `turns` user turns with checkpoints -> (messages so far, the last answer's ids)."""
    msgs = [{"role": "system", "content": SYSTEM}]
    for q in ("Name three primes.", "And three even numbers?")[:turns]:
        msgs.append({"role": "user", "content": q})
        toks, _ = ask(engine, engine.render_chat(msgs), 8)
        msgs.append({"role": "assistant", "content": engine.detokenize(toks)})
    return msgs


def snapshot(engine):
    return engine.state_hashes(), [(c["pos"], c["kind"]) for c in engine.checkpoints()], engine.seq.pos


@pytest.mark.parametrize("split", [None, "12"])
def test_an_embedding_read_leaves_the_live_conversation_as_it_was(split):
    """One and two stages: the live sequence's state hashes (tokens, every layer's K/V), its position and its
    checkpoints are the same after embeddings as before, the next turn continues it live, and its answer is the one
    an engine that embedded nothing gives."""
    plain = Engine("default", n_ctx=512, prompt_cache=4)
    e = Engine("default", n_ctx=512, prompt_cache=4, layer_split=split)
    assert len(e.stages) == (2 if split else 1)
    msgs = chat_state(e)
    assert chat_state(plain) == msgs
    before = snapshot(e)
    assert before[1], "the chat left no checkpoint to check"
    out = e.embed([e.tokenize_prompt(t) for t in TEXTS], pooling="mean")
    assert snapshot(e) == before
    # the same vectors as one stage's (the split reads the same numbers: bit-identical on the CPU)
    ref = plain.embed([plain.tokenize_prompt(t) for t in TEXTS], pooling="mean")
    assert all(np.array_equal(a.vectors, b.vectors) for a, b in zip(out, ref))
    nxt = msgs + [{"role": "user", "content": "Thanks!"}]
    toks, final = ask(e, e.render_chat(nxt), 8)
    want, _ = ask(plain, plain.render_chat(nxt), 8)
    assert final.strata["resume_from"] == "live" and toks == want
    for st in e.stages:
        assert st.memory.stats()["sequences"] == 1               # the scratch sequences are gone


def test_a_pool_too_full_for_the_read_reads_in_a_memory_of_its_own(hf_hidden, monkeypatch):
    """A live conversation holding every page of the pool: the read still runs (in a memory made for it), gives the
    same vectors, and frees no page the live sequence or its checkpoints hold."""
    e = Engine("default", n_ctx=256, prompt_cache=4)              # one 256-token page
    chat_state(e, turns=1)
    kv = e.stages[0].memory.stats()["kv"]
    assert kv["pages_used"] == kv["pages_total"] == 1
    before = snapshot(e)
    ids = e.tokenize_prompt(TEXTS[1])
    got = e.embed([ids])[0].vectors[0]
    assert snapshot(e) == before and e.stages[0].memory.stats()["kv"] == kv
    ref = hf_hidden(ids)[-1]
    assert cos(got, ref) > POOLED_COS
    # and where no memory can be had for it either: a 503 (NoRoom), the live conversation as it was
    from strata.engine.embed import NoRoom

    def no_memory(*a, **kw):
        raise MemoryError("Unable to allocate 9.0 GiB for an array")
    monkeypatch.setattr(e.stages[0].model, "new_memory", no_memory)
    with pytest.raises(NoRoom, match="no memory for a read of") as exc:
        e.embed([ids])
    assert exc.value.status == 503 and snapshot(e) == before
    assert e.stages[0].memory.stats()["sequences"] == 1


def test_engine_refusals_name_the_field(engine):
    before = snapshot(engine)
    for inputs, needle in (([], "'input' must not be empty"), ([[]], "'input' is empty"),
                           ([[1], [2] * 600], "'input[1]' has 600 tokens, more than the context of 512"),
                           ([[1, 49152]], "outside the vocabulary")):
        with pytest.raises(EmbedRefused, match=needle.replace("[", r"\[").replace("]", r"\]")):
            engine.embed(inputs)
    with pytest.raises(EmbedRefused, match="'pooling' must be one of"):
        engine.embed([[1, 2]], pooling="max")
    assert snapshot(engine) == before


# ---- over HTTP ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("embed"), "--embeddings", "--pooling", "mean", port=free_port()).start()  # flags plumbed
    yield d
    assert d.stop() == 0, d.log_tail()


def test_openai_sdk_float_and_base64(daemon, engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key="x")
    r = client.embeddings.create(model="text-embedding-3-small", input=TEXTS[:2], encoding_format="float")
    assert r.model == "text-embedding-3-small" and [d.index for d in r.data] == [0, 1]
    n = [len(engine.tokenize_prompt(t)) for t in TEXTS[:2]]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(n)
    want = [e.vectors[0] for e in engine.embed([engine.tokenize_prompt(t) for t in TEXTS[:2]], pooling="mean")]
    for d, w in zip(r.data, want):
        assert len(d.embedding) == 576 and np.allclose(d.embedding, w, atol=1e-6)
    b = client.embeddings.create(model="gpt-4", input=TEXTS[0])       # the SDK asks for base64 and decodes it
    assert np.allclose(b.data[0].embedding, want[0], atol=1e-6)
    st, raw = daemon.json("POST", "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    v = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert st == 200 and np.array_equal(v, np.asarray(want[0], np.float32))
    ids = engine.tokenize_prompt(TEXTS[0])                          # token ids, one input and a list of them
    one = client.embeddings.create(model="m", input=ids, encoding_format="float")
    two = client.embeddings.create(model="m", input=[ids, ids[:3]], encoding_format="float")
    assert np.allclose(one.data[0].embedding, want[0], atol=1e-6) and len(two.data) == 2
    assert two.usage.prompt_tokens == len(ids) + 3
    same = client.embeddings.create(model="m", input="x", dimensions=576, encoding_format="float")
    assert len(same.data[0].embedding) == 576


@pytest.mark.parametrize("body, status, needle", [
    ({}, 400, "'input' is required"),
    ({"input": ""}, 400, "'input' is an empty string"),
    ({"input": []}, 400, "'input' must not be empty"),
    ({"input": ["a", ""]}, 400, "'input[1]' is an empty string"),
    ({"input": 7}, 400, "'input' must be a string"),
    ({"input": ["a", {"x": 1}]}, 400, "'input[1]' must be a string or an array of token ids"),
    ({"input": [[1, 2], [3, True]]}, 400, "'input[1]' must be a string or an array of token ids"),
    ({"input": [1, -2]}, 400, "'input' holds a token id outside the vocabulary"),
    ({"input": "word " * 600}, 400, "more than the context of 512"),
    ({"input": "x" * 300_000}, 400, "'input' is too long: at least"),
    ({"input": [[5] * 513]}, 400, "'input' has 513 tokens, more than the context of 512"),
    ({"input": "a", "encoding_format": "int8"}, 400, "'encoding_format' must be"),
    ({"input": "a", "dimensions": 256}, 400, "'dimensions' is 256, but this model's embeddings have 576"),
    ({"input": "a", "dimensions": "x"}, 400, "'dimensions' must be a positive integer"),
    ({"input": "a", "pooling": "none"}, 400, "'pooling' is none"),
    ({"input": "a", "pooling": "max"}, 400, "'pooling' must be one of"),
    ({"input": "a", "embd_normalize": "l2"}, 400, "'embd_normalize' must be an integer"),
    ({"input": "a", "model": 5}, 400, "'model' must be a string"),
])
def test_openai_refusals_are_one_line_and_change_nothing(daemon, body, status, needle):
    before = daemon.json("GET", "/cache")[1]
    st, d = daemon.json("POST", "/v1/embeddings", body)
    assert st == status and needle in d["error"]["message"] and "\n" not in d["error"]["message"], d
    assert set(d["error"]) == {"message", "type", "param", "code"}
    assert daemon.json("GET", "/cache")[1] == before


def test_llama_server_routes(daemon, engine):
    ids = engine.tokenize_prompt(TEXTS[0])
    st, d = daemon.json("POST", "/embedding", {"content": TEXTS[0]})
    assert st == 200 and d[0]["index"] == 0 and len(d[0]["embedding"]) == 1
    want = engine.embed([ids], pooling="mean")[0].vectors[0]
    assert np.allclose(d[0]["embedding"][0], want, atol=1e-6)
    st, d = daemon.json("POST", "/embeddings", {"input": [TEXTS[0], ids], "pooling": "none"})
    assert st == 200 and [len(x["embedding"]) for x in d] == [len(ids), len(ids)]
    per_token = engine.embed([ids], pooling="none")[0].vectors
    assert np.allclose(d[1]["embedding"], per_token, atol=1e-5)          # every token's, not normalised
    st, d = daemon.json("POST", "/embedding", {"content": TEXTS[0], "embd_normalize": -1})
    assert st == 200 and np.linalg.norm(d[0]["embedding"][0]) > 2.0
    st, d = daemon.json("POST", "/embedding", {"content": ""})
    assert st == 400 and set(d["error"]) == {"code", "message", "type"} and "'content'" in d["error"]["message"]
    st, d = daemon.json("POST", "/embeddings", {})
    assert st == 400 and "'input' or 'content' is required" in d["error"]["message"]


def test_ollama_client_embed_and_embeddings(daemon, engine):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=f"http://127.0.0.1:{daemon.port}", timeout=120)
    r = client.embed(model="nomic-embed-text", input=TEXTS[:2])
    want = [e.vectors[0] for e in engine.embed([engine.tokenize_prompt(t) for t in TEXTS[:2]], pooling="mean")]
    assert r.model == "nomic-embed-text" and len(r.embeddings) == 2
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(r.embeddings, want))
    assert r.prompt_eval_count == sum(len(engine.tokenize_prompt(t)) for t in TEXTS[:2])
    old = client.embeddings(model="m", prompt=TEXTS[0])                  # not normalised, as Ollama's
    raw = engine.embed([engine.tokenize_prompt(TEXTS[0])], pooling="mean", normalize=-1)[0].vectors[0]
    assert np.allclose(old.embedding, raw, atol=1e-5)
    long = client.embed(model="m", input="word " * 2000)                 # truncate (default): the first n_ctx
    assert long.prompt_eval_count == 512
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="m", input="word " * 2000, truncate=False)
    assert e.value.status_code == 400 and "more than the context of 512" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="m", input=[])
    assert e.value.status_code == 400 and "'input' must not be empty" in e.value.error


def test_ollama_routes_take_pooling_and_check_options(daemon, engine):
    """/api/embed and /api/embeddings read Strata's `pooling` as the other embedding routes do, and check `options`
    as /api/chat does: a misspelt option or one of the wrong type is a 400 naming options.KEY, an option Ollama has
    that does not change an embedding is accepted, num_ctx cuts (or, with truncate false, refuses) a longer input."""
    ids = engine.tokenize_prompt(TEXTS[1])
    cls = engine.embed([ids], pooling="cls")[0].vectors[0]
    mean = engine.embed([ids], pooling="mean")[0].vectors[0]
    assert cos(cls, mean) < 0.99                                         # the test can tell them apart
    st, d = daemon.json("POST", "/api/embed", {"model": "m", "input": TEXTS[1], "pooling": "cls"})
    assert st == 200 and np.allclose(d["embeddings"][0], cls, atol=1e-6), st
    st, d = daemon.json("POST", "/api/embeddings", {"model": "m", "prompt": TEXTS[1], "pooling": "cls"})
    raw = engine.embed([ids], pooling="cls", normalize=-1)[0].vectors[0]
    assert st == 200 and np.allclose(d["embedding"], raw, atol=1e-5)
    st, d = daemon.json("POST", "/api/embed", {"model": "m", "input": "a", "options": {"temperature": 0.5,
                                                                                       "num_thread": 4, "seed": 3}})
    plain = daemon.json("POST", "/api/embed", {"model": "m", "input": "a"})[1]
    assert st == 200 and d["embeddings"] == plain["embeddings"]
    for path, body in (("/api/embed", {"input": "a"}), ("/api/embeddings", {"prompt": "a"})):
        for extra, needle in (({"options": {"temprature": 1}}, "'options.temprature' is not an option"),
                              ({"options": {"seed": "x"}}, "'options.seed' must be an integer"),
                              ({"options": {"use_mmap": 1}}, "'options.use_mmap' must be a boolean"),
                              ({"options": {"num_ctx": 0}}, "'options.num_ctx' must be a positive integer"),
                              ({"options": {"num_ctx": 2.5}}, "'options.num_ctx' must be a positive integer"),
                              ({"options": []}, "'options' must be an object"),
                              ({"pooling": "none"}, "'pooling' is none"),
                              ({"pooling": "max"}, "'pooling' must be one of")):
            st, d = daemon.json("POST", path, dict(body, model="m", **extra))
            assert st == 400 and needle in d["error"] and "\n" not in d["error"], (path, extra, d)
    st, _, raw = daemon.request("POST", "/api/embed", raw=b'{"input": "a", "options": {"num_ctx": 1e400}}')
    assert st == 400 and "'options.num_ctx' must be a positive integer" in raw.decode()     # inf, not a 500
    st, d = daemon.json("POST", "/api/embed", {"model": "m", "input": TEXTS[1], "options": {"num_ctx": 16}})
    cut = engine.embed([engine.tokenizer.encode(TEXTS[1], parse_special=True)[:16]], pooling="mean")[0].vectors[0]
    assert st == 200 and d["prompt_eval_count"] == 16 and np.allclose(d["embeddings"][0], cut, atol=1e-6)
    st, d = daemon.json("POST", "/api/embed", {"model": "m", "input": TEXTS[1], "truncate": False,
                                               "options": {"num_ctx": 16}})
    assert st == 400 and "more than the context of 16 (options.num_ctx)" in d["error"], d


def test_embeddings_beside_a_chat_leave_it_live(daemon):
    """Over HTTP: a chat turn, embeddings, the next turn: it continues the live sequence (nothing re-read)."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three primes."}]
    st, a = daemon.json("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0})
    assert st == 200
    msgs += [a["choices"][0]["message"], {"role": "user", "content": "And three even numbers?"}]
    before = daemon.json("GET", "/cache")[1]
    assert daemon.json("POST", "/v1/embeddings", {"input": TEXTS})[0] == 200
    assert daemon.json("POST", "/api/embed", {"model": "m", "input": TEXTS[1]})[0] == 200
    assert daemon.json("GET", "/cache")[1] == before
    st, b = daemon.json("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0})
    assert st == 200 and b["strata"]["resume_from"] == "live", b["strata"]


def test_a_remote_stage_refuses_embeddings_with_a_clear_501(tmp_path):
    """A real `strata worker` runs the upper layers: its link carries one sequence, so the read has no scratch
    sequence there; every embedding route answers 501 saying so, and the chat goes on."""
    w = WorkerProc().start()
    d = Daemon(tmp_path, "--embeddings", "--remote-stage", w.address, "--layer-split", "10").start()
    try:
        for path, body in (("/v1/embeddings", {"input": "hi"}), ("/embedding", {"content": "hi"}),
                           ("/api/embed", {"model": "m", "input": "hi"})):
            st, r = d.json("POST", path, body)
            msg = r["error"] if isinstance(r["error"], str) else r["error"]["message"]
            assert st == 501 and "remote stage" in msg and "worker" in msg, (path, r)
        st, r = d.json("POST", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3})
        assert st == 200
    finally:
        d.stop()
        w.stop()


def test_pooling_flag_is_checked():
    import subprocess
    import sys
    from tests.daemon import ROOT, env_for_daemon
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--pooling", "max"], capture_output=True,
                       text=True, env=env_for_daemon(), cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "--pooling" in r.stderr and "Traceback" not in r.stderr


def test_remote_refusal_in_the_engine():
    from strata.engine.embed import scratch_refusal

    class Remote:
        index, device, memory = 1, "remote:127.0.0.1:1", object()
    assert "remote stage" in scratch_refusal([Remote()])
    assert NotServed.status == 501


def test_a_cancelled_read_stops_after_one_forward_call_and_keeps_nothing(engine):
    """cancel set: EmbedCancelled after the first forward call (of many inputs), every scratch sequence dropped,
    the live conversation as it was; the same engine embeds again after."""
    import threading
    from strata.engine.embed import EmbedCancelled
    chat_state(engine)
    before, seqs = snapshot(engine), [list(st.memory.sequences) for st in engine.stages]
    calls = []
    real = engine._embed_progress
    engine._embed_progress = lambda cancel: (calls.append(1), real(cancel))
    try:
        stop = threading.Event()
        stop.set()
        with pytest.raises(EmbedCancelled, match="cancelled"):
            engine.embed([[1, 2, 3]] * 50, cancel=stop)
    finally:
        del engine._embed_progress
    assert len(calls) == 1
    assert snapshot(engine) == before and [list(st.memory.sequences) for st in engine.stages] == seqs
    assert len(engine.embed([[1, 2, 3]], cancel=threading.Event())) == 1


def test_the_engine_worker_sets_a_calls_stop_event_when_it_is_dropped():
    """A call job dropped (its handler cancelled: the client went away) sets the stop event fn watches."""
    import threading
    from strata.serve.worker import Job
    stop = threading.Event()
    job = Job(request=None, events=None, fn=lambda e: None, stop=stop)
    job.cancel()
    assert stop.is_set()


def test_more_inputs_than_one_request_may_embed_is_a_400_naming_input(daemon):
    from strata.engine.embed import MAX_INPUTS
    for path, body in (("/v1/embeddings", {"input": ["a"] * (MAX_INPUTS + 1)}),
                       ("/embedding", {"content": ["a"] * (MAX_INPUTS + 1)}),
                       ("/api/embed", {"model": "m", "input": ["a"] * (MAX_INPUTS + 1)})):
        st, r = daemon.json("POST", path, body)
        msg = r["error"] if isinstance(r["error"], str) else r["error"]["message"]
        assert st == 400 and "input" in msg and str(MAX_INPUTS) in msg, (path, r)
