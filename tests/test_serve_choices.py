"""`n` > 1 choices on the real daemon with the openai SDK: seeded samples (seed, seed+1, ...) from one prompt read, greedy
duplicates, streaming chunks with their `index`, /v1/completions too."""
from __future__ import annotations

import pytest

from tests.daemon import Daemon, free_port

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

Q = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("choices"), port=free_port()).start()
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key="unused", max_retries=0, timeout=120)


def test_seeded_choices_are_the_separate_requests_from_one_prompt_read(client, daemon):
    kw = dict(model="default", messages=Q, max_tokens=12, temperature=1.0, extra_body={"cache_prompt": False})
    read_before = daemon.metric("strata_prompt_tokens_total")
    r = client.chat.completions.create(n=3, seed=11, **kw)
    read = daemon.metric("strata_prompt_tokens_total") - read_before
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert read == r.usage.prompt_tokens == r.model_extra["timings"]["prompt_n"]        # the prompt read once
    alone = [client.chat.completions.create(n=1, seed=11 + i, **kw) for i in range(3)]
    assert [c.message.content for c in r.choices] == [a.choices[0].message.content for a in alone]
    assert [c.finish_reason for c in r.choices] == [a.choices[0].finish_reason for a in alone]
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_greedy_choices_are_duplicates(client):
    one = client.chat.completions.create(model="default", messages=Q, max_tokens=10, temperature=0)
    r = client.chat.completions.create(model="default", messages=Q, max_tokens=10, temperature=0, n=3)
    assert [c.message.content for c in r.choices] == [one.choices[0].message.content] * 3
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert r.model_extra["timings"]["predicted_n"] == one.usage.completion_tokens      # decoded once


def test_stream_chunks_carry_the_choice_index(client):
    kw = dict(model="default", messages=Q, max_tokens=10, temperature=0.9, seed=4, n=2)
    full = client.chat.completions.create(**kw)
    text = {0: "", 1: ""}
    roles, finishes, usage = [], {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.index)
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert roles == [0, 1]
    assert [text[0], text[1]] == [c.message.content for c in full.choices]
    assert finishes == {c.index: c.finish_reason for c in full.choices}
    assert usage.completion_tokens == full.usage.completion_tokens


def test_completions_n(client):
    kw = dict(model="default", prompt="The sea is", max_tokens=8, temperature=1.0, seed=21,
              extra_body={"cache_prompt": False})
    r = client.completions.create(n=2, **kw)
    alone = [client.completions.create(**dict(kw, seed=21 + i)) for i in range(2)]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]


def test_n_out_of_range_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="'n' must be in 1..16"):
        client.chat.completions.create(model="default", messages=Q, max_tokens=1, n=17)
