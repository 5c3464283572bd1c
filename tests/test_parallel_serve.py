"""`strata serve --parallel 4`: requests from real clients (the `openai` SDK streaming over TCP, HTTP over the Unix
socket) run at once in the daemon's request slots. Each answer equals the same request's answer from a
`--parallel 1` daemon (the default model and a synthetic hybrid); the daemon's own /metrics show the decode rows were
batched; a secret in each conversation never shows in another's; id_slot picks the slot; /slots lists every slot and
acts on each (save, erase, restore); a client that goes away mid-stream leaves the others' answers whole; a bad id_slot
is a 400 naming the field."""
import json
import threading

import openai
import pytest

from tests.daemon import Daemon, free_port

SECRETS = ["PLUM", "OSLO", "KIWI", "JADE"]


def _client(d):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key="unused", max_retries=0, timeout=300)


def _messages(i):
    filler = " ".join(["Remember the word well, it matters later on in this long conversation."] * (12 if i == 3
                                                                                                     else 1))
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"{filler} The secret word is {SECRETS[i]}. Story {i}: once upon a time"}]


def _stream(client, i, max_tokens=24, started=None, stop_after=None, **kw):
    """Stream request i's answer -> its text (stop_after: close the stream after that many chunks)."""
    out = []
    with client.chat.completions.create(model="default", messages=_messages(i), max_tokens=max_tokens,
                                        temperature=0, stream=True, **kw) as s:
        for k, chunk in enumerate(s):
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(chunk.choices[0].delta.content)
                if started is not None:
                    started.set()
            if stop_after is not None and k >= stop_after:
                break
    return "".join(out)


@pytest.fixture(scope="module", params=["default", "hybrid"])
def pair(request, tmp_path_factory, synthetic):
    """(a --parallel 4 daemon, a --parallel 1 daemon) on the same model."""
    from tests.templates import QWEN_TEMPLATE
    model = [] if request.param == "default" else [
        "--model", str(synthetic("qwen35", name="qwen-style", overrides={"tokenizer.chat_template": QWEN_TEMPLATE}))]
    save = tmp_path_factory.mktemp("slots-save")
    four = Daemon(tmp_path_factory.mktemp("par4"), *model, "--parallel", "4", "--slot-save-path", str(save),
                  port=free_port(), n_ctx=1024).start()
    one = Daemon(tmp_path_factory.mktemp("par1"), *model, "--parallel", "1", port=free_port(), n_ctx=1024).start()
    yield four, one
    assert four.stop() == 0, four.log_tail()
    assert one.stop() == 0, one.log_tail()


def test_concurrent_answers_equal_alone_and_rows_batched(pair):
    four, one = pair
    alone = [_stream(_client(one), i) for i in range(4)]
    rows_before = four.metric("strata_batched_rows_total")
    got, errors = {}, []
    started = threading.Event()

    def run(i):
        try:
            if i == 3:                      # the long prompt arrives while the others decode
                started.wait(120)
            got[i] = _stream(_client(four), i, started=started if i == 0 else None)
        except Exception as e:  # noqa: BLE001
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for i in range(4):
        assert got[i] == alone[i], f"request {i}: answer beside others differs from its answer alone"
        for j in range(4):
            if j != i and SECRETS[j] not in _messages(i)[1]["content"]:
                assert SECRETS[j] not in got[i]
    # the engine's own counters: decode steps read several slots' tokens at once
    assert four.metric("strata_batched_rows_total") > rows_before
    assert four.metric("strata_batched_rows_max") >= 2
    st, health = four.json("GET", "/health")
    assert st == 200 and health["slots_idle"] == 4 and health["slots_processing"] == 0


def test_id_slot_and_slot_actions(pair):
    four, _ = pair
    st, r = four.json("POST", "/completion", {"prompt": "Once upon a time", "n_predict": 8, "id_slot": 2})
    assert st == 200 and r["id_slot"] == 2
    st, slots = four.json("GET", "/slots")
    assert st == 200 and [s["id"] for s in slots] == [0, 1, 2, 3]
    assert {"id", "id_task", "n_ctx", "is_processing", "n_prompt_tokens", "next_token"} <= set(slots[2])
    pos2 = slots[2]["pos"]
    assert pos2 > 8 and not any(s["is_processing"] for s in slots)
    st, saved = four.json("POST", "/slots/2?action=save", {"filename": "two.bin"})
    assert st == 200 and saved["id_slot"] == 2 and saved["n_saved"] == pos2
    st, er = four.json("POST", "/slots/2?action=erase")
    assert st == 200 and er == {"id_slot": 2, "n_erased": pos2}
    st, back = four.json("POST", "/slots/1?action=restore", {"filename": "two.bin"})
    assert st == 200 and back["id_slot"] == 1 and back["n_restored"] == pos2
    st, slots = four.json("GET", "/slots")
    assert slots[2]["pos"] == 0 and slots[1]["pos"] == pos2
    # the restored conversation continues in slot 1 from where it was saved
    st, r = four.json("POST", "/completion", {"prompt": "Once upon a time", "n_predict": 4, "id_slot": 1})
    assert st == 200 and r["id_slot"] == 1 and r["tokens_evaluated"] < 5
    st, e = four.json("POST", "/slots/4?action=erase")
    assert st == 404 and "4 slots (0..3)" in e["error"]["message"]
    # each slot counts the checkpoints on its own conversation's path: a chat in slot 3 keeps some, the erased
    # slot 2 holds nothing and counts none (it showed the whole tree's count, the same on every slot)
    chat = {"messages": [{"role": "system", "content": "You count sheep."}, {"role": "user", "content": "Go"}],
            "max_tokens": 2, "id_slot": 3}
    assert four.json("POST", "/v1/chat/completions", chat)[0] == 200
    slots = four.json("GET", "/slots")[1]
    assert slots[3]["checkpoints"] >= 1 and slots[2]["pos"] == 0 and slots[2]["checkpoints"] == 0, slots


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "id_slot": 4}),
    ("/v1/completions", {"prompt": "hi", "id_slot": 7}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "id_slot": "one"}),
    ("/completion", {"prompt": "hi", "id_slot": -2}),
])
def test_bad_id_slot_is_a_400_naming_it(pair, path, body):
    four, _ = pair
    st, r = four.json("POST", path, body)
    assert st == 400 and "id_slot" in r["error"]["message"], r
    if path.startswith("/v1/"):
        assert r["error"]["param"] == "id_slot"


ID_SLOT_ROUTES = {
    "/v1/chat/completions": lambda v: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "id_slot": v},
    "/v1/completions": lambda v: {"prompt": "hi", "max_tokens": 1, "id_slot": v},
    "/completion": lambda v: {"prompt": "hi", "n_predict": 1, "id_slot": v},
    "/v1/responses": lambda v: {"input": "hi", "max_output_tokens": 16, "id_slot": v},
    "/v1/messages": lambda v: {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                               "id_slot": v},
}


def test_id_slot_of_any_json_value_on_every_route_is_run_or_a_400_naming_it(pair):
    """A hypothesis search over id_slot values (integers of any size, floats, strings, booleans, null, arrays,
    objects) on every route that takes it: -1, null and 0..3 run (in that slot where named), anything else is a 400
    naming id_slot; never a 5xx; /health answers throughout and every slot is idle after."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    four, _ = pair
    value = st.one_of(st.integers(-3, 6), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                      st.text(max_size=4),
                      st.booleans(), st.none(), st.lists(st.integers(0, 3), max_size=2),
                      st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=1))
    seen = {"ran": 0, "refused": 0}

    @settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(route=st.sampled_from(sorted(ID_SLOT_ROUTES)), v=value)
    def check(route, v):
        st_, r = four.json("POST", route, ID_SLOT_ROUTES[route](v))
        ok = v is None or (type(v) is int and -1 <= v < 4)
        if ok:
            assert st_ == 200, (route, v, r)
            if route == "/completion" and v not in (None, -1):
                assert r["id_slot"] == v
            seen["ran"] += 1
        else:
            msg = json.dumps(r)
            assert st_ == 400 and "id_slot" in msg, (route, v, st_, r)
            seen["refused"] += 1
    check()
    assert seen["ran"] and seen["refused"], seen
    assert four.request("GET", "/health")[0] == 200
    st_, slots = four.json("GET", "/slots")
    assert not any(s["is_processing"] for s in slots)


def test_a_client_gone_mid_stream_leaves_the_others_whole(pair):
    four, one = pair
    alone = [_stream(_client(one), i, max_tokens=40) for i in (0, 1)]
    cancelled = four.metric("strata_generations_total", {"finish_reason": "cancelled"})
    generated = four.metric("strata_generated_tokens_total")
    got, errors = {}, []

    def run(i):
        try:
            if i < 2:
                got[i] = _stream(_client(four), i, max_tokens=40)
                return
            # counting: no end-of-generation token for hundreds of tokens; the client leaves after 3 chunks
            with _client(four).completions.create(model="default", prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=600,
                                                  temperature=0, stream=True) as s:
                for k, _ in enumerate(s):
                    if k >= 2:
                        break
        except Exception as e:  # noqa: BLE001
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert [got[0], got[1]] == alone
    for _ in range(1200):              # the dropped stream's slot is freed at its next step
        if four.metric("strata_generations_total", {"finish_reason": "cancelled"}) > cancelled:
            break
        threading.Event().wait(0.05)
    assert four.metric("strata_generations_total", {"finish_reason": "cancelled"}) == cancelled + 1
    assert four.metric("strata_generated_tokens_total") - generated < 2 * 40 + 200    # far from its 600 tokens
    st, slots = four.json("GET", "/slots")
    assert not any(s["is_processing"] for s in slots)


def _long_stream(d, started: threading.Event, done: threading.Event, **kw) -> threading.Thread:
    """A started thread streaming a long greedy answer from daemon d (kw: the openai call's extra options): `started`
    set at its first chunk, the stream dropped once `done` is set."""
    def run():
        with _client(d).completions.create(model="default", prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=400,
                                           temperature=0, stream=True, **kw) as s:
            for _ in s:
                started.set()
                if done.is_set():
                    break
    t = threading.Thread(target=run)
    t.start()
    return t


def test_fail_on_no_slot_is_a_503_only_while_every_slot_runs(pair):
    """llama-server's GET /slots?fail_on_no_slot=1: 503 while no slot is idle (the one slot of --parallel 1 streaming a
    long answer), the slot list otherwise."""
    four, one = pair
    assert four.json("GET", "/slots?fail_on_no_slot=1")[0] == 200
    started, done = threading.Event(), threading.Event()
    t = _long_stream(one, started, done)
    try:
        assert started.wait(120)
        st, r = one.json("GET", "/slots?fail_on_no_slot=1")
        assert st == 503 and r["error"]["message"] == "no slot available", r
        st, r = one.json("GET", "/slots")
        assert st == 200 and r[0]["is_processing"]
    finally:
        done.set()
        t.join(120)
    for _ in range(200):
        if one.json("GET", "/slots?fail_on_no_slot=1")[0] == 200:
            break
        threading.Event().wait(0.05)
    assert one.json("GET", "/slots?fail_on_no_slot=1")[0] == 200



def test_a_slot_action_waits_for_the_request_in_its_slot(pair):
    """POST /slots/{id}?action=save on a slot that runs a request waits until that request ends (llama-server defers
    it the same way), and behind a request queued earlier for that slot: it saves what the later one left; the other
    slots keep serving meanwhile, and a refusal that does not depend on the slot (a bad file name, a file to restore
    that is not there) answers at once. The busy request's lines in the log carry its request id, the engine thread's
    'generation finished' with its slot."""
    import time
    four, _ = pair
    started, done, out = threading.Event(), threading.Event(), {}
    t = _long_stream(four, started, done, extra_body={"id_slot": 2}, extra_headers={"X-Request-Id": "busy-slot-2"})
    try:
        assert started.wait(120)
        g = threading.Thread(target=lambda: out.__setitem__("g", four.json(
            "POST", "/completion", {"prompt": "Hello", "n_predict": 3, "temperature": 0, "id_slot": 2})))
        g.start()
        for _ in range(600):                               # the request for slot 2 waits in the queue
            if four.json("GET", "/health")[1]["queue"]["waiting"] >= 1:
                break
            time.sleep(0.05)
        w = threading.Thread(target=lambda: out.__setitem__("save", four.json(
            "POST", "/slots/2?action=save", {"filename": "busy.bin"})))
        w.start()
        st, r = four.json("POST", "/completion", {"prompt": "Hello", "n_predict": 2, "temperature": 0})
        assert st == 200 and r["id_slot"] != 2                   # another slot answers while slot 2 is busy
        assert "save" not in out and four.json("GET", "/slots")[1][2]["is_processing"]
        for body in ({"filename": "../up.bin"}, {"filename": 7}):     # refusals that do not depend on the slot: now
            st, e = four.json("POST", "/slots/2?action=save", body)
            assert st == 400 and e["error"]["param"] == "filename", (body, e)
        st, e = four.json("POST", "/slots/2?action=restore", {"filename": "missing.bin"})
        assert st == 400 and e["error"]["param"] == "filename" and "missing.bin" in e["error"]["message"], e
        assert "save" not in out and four.json("GET", "/slots")[1][2]["is_processing"]
    finally:
        done.set()
        t.join(120)
    g.join(120)
    w.join(120)
    assert out["g"][0] == 200 and out["g"][1]["id_slot"] == 2
    st, r = out["save"]
    held = four.json("GET", "/slots")[1][2]["n_prompt_tokens"]      # what the queued request left in slot 2
    assert st == 200 and r["id_slot"] == 2 and r["n_saved"] == held, (r, held)
    lines = [ln for ln in four.log_lines() if ln.get("request_id") == "busy-slot-2"]
    assert [ln.get("id_slot") for ln in lines if ln["event"] == "generation finished"] == [2], lines


@pytest.mark.parametrize("where", ["local", "worker"])
def test_a_conversation_left_in_a_slot_is_parked_when_its_checkpoints_were_evicted(tmp_path, workers, where):
    """An agent's conversation sits idle in slot 0 while another slot's checkpoints push its own out of the tree
    (--prompt-cache 2: the root and one more; over a worker the default keeps none); a third conversation on the
    same system prompt then takes slot 0. The first must be parked, not cut back to the shared system prompt: its
    next turn, sent to the other slot, resumes from the parked copy and reads only its new message, and answers as
    that prompt read from token 0. (It was lost: the park rule only looked for checkpoints on its path.)"""
    flags = ["--prompt-cache", "2"] if where == "local" else \
        ["--remote-stage", workers().address, "--layer-split", "15"]
    d = Daemon(tmp_path, "--parallel", "2", *flags, n_ctx=1024).start()
    try:
        system = {"role": "system", "content": "You are a careful coding agent in a git repository. " * 8}

        def ask(msgs, slot, **kw):
            st, r = d.json("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                           "id_slot": slot, **kw})
            assert st == 200, r
            return r

        a = [system, {"role": "user", "content": "Agent A: read the Makefile and tell me its build targets."}]
        ra = ask(a, 0)
        ask([system, {"role": "user", "content": "Agent B: list the tests."}], 1)
        ask([system, {"role": "user", "content": "Agent C: check git status."}], 0)
        a2 = a + [{"role": "assistant", "content": ra["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "And the clean target?"}]
        r2 = ask(a2, 1)
        held = ra["usage"]["prompt_tokens"]          # at least A's first prompt comes back, not re-read
        assert r2["strata"]["resume_from"] in ("resident", "park"), r2["strata"]
        assert r2["timings"]["cache_n"] >= held, (r2["timings"], held)
        cold = ask(a2, 0, cache_prompt=False)
        assert r2["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    finally:
        assert d.stop() == 0, d.log_tail()
