"""--spec on a real daemon: a request's "strata_spec": false decodes without drafts (the same greedy answer),
a bad value is refused naming the field, /metrics and the status count what was drafted and accepted."""
import pytest

from strata.gguf import synth
from tests.daemon import Daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec_serve")
    path = synth.write_synthetic(tmp / "hybrid.gguf", synth.preset("qwen35", "tiny", seed=3, n_mtp=1))
    d = Daemon(tmp, "--model", str(path), "--device", "cpu", "--spec", "3").start()
    yield d
    d.stop()


def _complete(d, **extra):
    body = {"prompt": "the quick brown fox", "max_tokens": 10, "temperature": 0, **extra}
    st, out = d.json("POST", "/v1/completions", body)
    assert st == 200, out
    return out


def test_opt_out_metrics_and_status(daemon):
    d = daemon
    off = _complete(d, strata_spec=False)
    assert d.metric("strata_spec_drafted_tokens_total") == 0 and d.metric("strata_spec_verifies_total") == 0
    on = _complete(d, cache_prompt=False)
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert off["timings"]["draft_n"] == 0 and on["timings"]["draft_n"] > 0
    assert on["timings"]["draft_mean_accepted"] >= 1.0
    drafted = d.metric("strata_spec_drafted_tokens_total")
    assert drafted > 0 and d.metric("strata_spec_verifies_total") > 0
    assert 0 <= d.metric("strata_spec_accepted_tokens_total") <= drafted
    assert d.metric("strata_spec_mean_accepted_length") >= 1.0
    _, status = d.json("GET", "/status")
    spec = status.get("spec") or status.get("engine", {}).get("spec")
    assert spec["n"] == 3 and spec["drafted"] >= drafted        # the status counts the warm-up's drafts too


def test_props_say_the_server_speculates(daemon):
    """/props says what llama-server's does of a server with a drafter: the slot settings' `speculative` true and
    `params["speculative.n_max"]` the drafts per verify (it said false under --spec 3)."""
    st, props = daemon.json("GET", "/props")
    g = props["default_generation_settings"]
    assert st == 200 and g["speculative"] is True and g["params"]["speculative.n_max"] == 3


def test_bad_field_refused(daemon):
    st, out = daemon.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "strata_spec": "yes"})
    assert st == 400 and "strata_spec" in out["error"]["message"]


def test_llama_server_completion_route_takes_strata_spec(daemon):
    """/completion takes strata_spec as /v1/completions does (it was dropped there: drafts ran whatever it said, a bad
    value answered 200): false decodes without drafts, the same greedy answer; a wrong type is a 400 naming it."""
    d = daemon
    body = {"prompt": "the quick brown fox", "n_predict": 10, "temperature": 0, "cache_prompt": False}
    drafted = d.metric("strata_spec_drafted_tokens_total")
    st, off = d.json("POST", "/completion", {**body, "strata_spec": False})
    assert st == 200 and off["timings"].get("draft_n", 0) == 0
    assert d.metric("strata_spec_drafted_tokens_total") == drafted
    st, on = d.json("POST", "/completion", body)
    assert st == 200 and on["content"] == off["content"]
    assert d.metric("strata_spec_drafted_tokens_total") > drafted
    for v in ("yes", 1, [], {}):
        st, out = d.json("POST", "/completion", {**body, "strata_spec": v})
        assert st == 400 and "strata_spec" in out["error"]["message"], (v, out)


def test_logit_bias_under_drafts_is_the_answer_without_drafts(daemon):
    """The verify judges each row with the request's bias: a greedy answer under --spec 3 with logit_bias is the
    one with drafts off, and the bias changed it (the plain answer's first token banned, another raised)."""
    d = daemon
    plain = _complete(d, strata_spec=False)
    st, r = d.json("POST", "/completion", {"prompt": "the quick brown fox", "n_predict": 1, "temperature": 0,
                                           "strata_spec": False, "return_tokens": True})
    assert st == 200 and r["content"] == plain["choices"][0]["text"][:len(r["content"])]
    bias = {str(r["tokens"][0]): -100, "1000": 6.5}
    drafted = d.metric("strata_spec_drafted_tokens_total")
    off = _complete(d, strata_spec=False, logit_bias=bias)
    on = _complete(d, logit_bias=bias, cache_prompt=False)
    assert on["choices"][0]["text"] == off["choices"][0]["text"] != plain["choices"][0]["text"]
    assert on["timings"]["draft_n"] > 0 and d.metric("strata_spec_drafted_tokens_total") > drafted
