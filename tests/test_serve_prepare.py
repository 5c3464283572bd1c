"""A request's preparation off the event loop (strata/serve/prepare.py): /health answers while a large request is
being parsed, a small one is parsed on the loop, the pool's cap answers 503 queue_full, and a large body's bad field
is the same one-line 400 as a small one's. The daemon's application runs in this process (aiohttp's test server), on
one engine shared by the module, so that a test can hold a preparation step on an event."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer

from strata.serve import prepare, schema
from strata.serve.app import make_app
from strata.serve.config import ServeConfig
from strata.serve.metrics import Metrics
from strata.serve.worker import EngineWorker

WAIT = 60.0          # a failsafe only: an event that never comes fails the test after this long instead of hanging


@pytest.fixture(scope="module")
def engine(synthetic):
    from strata.engine.engine import Engine
    from tests.templates import QWEN_TEMPLATE
    path = synthetic("qwen35", name="qwen-style", overrides={"tokenizer.chat_template": QWEN_TEMPLATE})
    e = Engine(path, n_ctx=2048, device="cpu")
    yield e
    e.close()


class App:
    """make_app on a worker running `engine`, served on loopback by aiohttp's test server."""

    def __init__(self, engine, queue_max: int = 4):
        self.engine, self.queue_max = engine, queue_max

    async def __aenter__(self) -> TestClient:
        loop = asyncio.get_running_loop()
        self.worker = EngineWorker(lambda: self.engine, queue_max=self.queue_max, metrics=Metrics(), loop=loop)
        self.worker.start()
        await self.worker.loaded
        self.client = TestClient(TestServer(make_app(ServeConfig(queue_max=self.queue_max), self.worker, Metrics())))
        await self.client.start_server()
        return self.client

    async def __aexit__(self, *exc):
        await self.client.close()
        self.worker.stop(timeout=30)


class Held:
    """schema.parse_chat held on an event: `entered` when a call starts (its thread kept in `threads`), the call
    waits for `release` (set after WAIT seconds at the latest), `finished` once it returned."""

    def __init__(self, monkeypatch):
        self.entered, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()
        self.threads: list[str] = []
        real = schema.parse_chat

        def held(body):
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            self.release.wait(WAIT)
            try:
                return real(body)
            finally:
                self.finished.set()
        monkeypatch.setattr(schema, "parse_chat", held)
        self.timer = threading.Timer(WAIT, self.release.set)     # the failsafe
        self.timer.daemon = True
        self.timer.start()

    async def wait_entered(self) -> None:
        assert await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, WAIT)

    def done(self) -> None:
        self.release.set()
        self.timer.cancel()


def _big_chat(n: int, bad_role_at: int | None = None) -> dict:
    """A chat request whose body is larger than prepare.SMALL_BODY: n short messages (the last a user's) and a field
    the route ignores, long enough to make the body large while the prompt still fits the context."""
    msgs = [{"role": "user" if i % 2 == (n - 1) % 2 else "assistant", "content": f"line {i} about rivers"}
            for i in range(n)]
    if bad_role_at is not None:
        msgs[bad_role_at]["role"] = "narrator"
    body = {"messages": msgs, "max_tokens": 2, "padding": "x" * prepare.SMALL_BODY}
    assert len(json.dumps(body)) >= prepare.SMALL_BODY
    return body


async def test_health_answers_while_a_large_request_is_being_prepared(engine, monkeypatch):
    """The large request's parse is held on an event in its pool thread: /health answers 200 meanwhile (on the
    loop it could not), then the request goes on to its answer."""
    held = Held(monkeypatch)
    async with App(engine) as client:
        big = asyncio.ensure_future(client.post("/v1/chat/completions", json=_big_chat(n=120)))
        try:
            await held.wait_entered()
            r = await client.get("/health")
            assert r.status == 200 and (await r.json())["status"] == "ok"
            assert not held.finished.is_set()        # /health answered while the preparation was still running
            assert held.threads[0].startswith("strata-prep")
        finally:
            held.done()
        resp = await big
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["choices"][0]["finish_reason"] in ("length", "stop")


async def test_a_small_request_is_parsed_on_the_loop(engine, monkeypatch):
    """A body under prepare.SMALL_BODY is parsed where the handler runs (no thread hop)."""
    held = Held(monkeypatch)
    held.release.set()
    async with App(engine) as client:
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 2})
        assert r.status == 200, await r.text()
    held.done()
    assert held.threads == [threading.main_thread().name]


async def test_the_pool_cap_answers_503_queue_full(engine, monkeypatch):
    """--queue-max 0 and one slot: one preparation at a time; a second large request while the first is held is a
    503 queue_full with Retry-After, the first then answers."""
    held = Held(monkeypatch)
    async with App(engine, queue_max=0) as client:
        first = asyncio.ensure_future(client.post("/v1/chat/completions", json=_big_chat(n=120)))
        try:
            await held.wait_entered()
            r = await client.post("/v1/chat/completions", json=_big_chat(n=120))
            body = await r.json()
            assert r.status == 503 and body["error"]["code"] == "queue_full" and r.headers["Retry-After"] == "1"
            assert "being prepared" in body["error"]["message"] and "\n" not in body["error"]["message"]
        finally:
            held.done()
        r = await first
        assert r.status == 200, await r.text()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_a_large_bodys_bad_field_is_the_small_bodys_400(engine, path):
    """The same bad role late in a long list, in a body past SMALL_BODY (validated in the pool) and in a short one
    (on the loop): the same one-line 400 naming the field; and a large body that is not JSON is the small one's
    400."""
    async with App(engine) as client:
        async def ask(n, at):
            msgs = _big_chat(n, bad_role_at=at)["messages"] if n >= 1000 else \
                [{"role": "user", "content": "Hi"}] * (n - 1) + [{"role": "narrator", "content": "x"}]
            body = {"messages": msgs, "max_tokens": 2} if path.endswith("completions") else \
                {"input": msgs, "max_output_tokens": 2}
            r = await client.post(path, json=body)
            return r.status, (await r.json())["error"]
        st_big, big = await ask(3001, 3000)
        st_small, small = await ask(3, 2)
        assert st_big == st_small == 400
        assert big["param"] == small["param"].replace("[2]", "[3000]") and big["param"].endswith("[3000].role")
        assert big["message"] == small["message"].replace("[2]", "[3000]") and "\n" not in big["message"]
        for raw in (b'{"messages": [' + b" " * prepare.SMALL_BODY + b"}", b'{"messages": [}'):
            r = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
