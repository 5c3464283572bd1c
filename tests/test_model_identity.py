"""Model identity (strata/gguf/identity.py): a worker's refusal of another model carries its summary, which the main
reads back (whatever the file is called) to name what differs in one line; any other text reads as nothing."""
import pytest

from strata.gguf import identity
from strata.gguf.identity import ModelSummary

MAIN = ModelSummary("SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432, "llama", 30, 576, "Q4_1", "1f11436a79603159")


def test_a_refusal_reads_back_and_names_what_differs():
    worker = ModelSummary("qwen, the 0.6b; one.gguf", 639_000_001, "qwen3", 28, 1024, "Q8_0", "a0b1c2d3e4f5a6b7")
    line = identity.refusal(worker, "1f11436a79603159" + "0" * 48, 30, 576)
    assert identity.parse_refusal("worker 10.0.0.2:7411 refused the hello: " + line) == worker
    msg = identity.mismatch(worker, MAIN)
    assert "\n" not in msg
    for needle in ["file qwen, the 0.6b; one.gguf, not SmolLM2-135M-Instruct.Q4_1.gguf",
                   "architecture qwen3, not llama",
                   "size 639,000,001 bytes, not 98,362,432 bytes", "blocks 28, not 30", "width 1024, not 576",
                   "quantization Q8_0, not Q4_1", "fingerprints a0b1c2d3e4f5a6b7, not 1f11436a79603159",
                   "(SmolLM2-135M-Instruct.Q4_1.gguf, --model)"]:
        assert needle in msg, (needle, msg)


def test_the_same_file_with_other_weights_says_so():
    worker = ModelSummary(MAIN.file, MAIN.bytes, MAIN.arch, MAIN.blocks, MAIN.width, "", "00aa00aa00aa00aa")
    main = ModelSummary(MAIN.file, MAIN.bytes, MAIN.arch, MAIN.blocks, MAIN.width, "", MAIN.fingerprint)
    back = identity.parse_refusal(identity.refusal(worker, MAIN.fingerprint, 30, 576))
    assert back == worker
    msg = identity.mismatch(back, main)
    assert "the same file name, size, architecture, blocks and quantization" in msg and "other weights" in msg


@pytest.mark.parametrize("text", ["", "the main runs model 1f11, this worker has 2e22 (x.gguf)",
                                  "this worker has another model: x.gguf, 12 bytes, llama",
                                  "this worker has another model: x.gguf, -1 bytes, llama, 3 blocks of width 4, Q4_1, "
                                  "fingerprint 00"])
def test_other_text_reads_as_no_summary(text):
    assert identity.parse_refusal(text) is None


def test_fuzz_the_refusal_reader():
    """Any text (a worker's Error message is the peer's) reads as None or a summary whose refusal reads back the
    same, never an exception; a summary of printable fields reads back from its refusal (a file name with a control
    character reads as None: the main then shows the worker's text as it came)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as hs
    names = hs.text(min_size=1, max_size=30).filter(str.isprintable)
    arch = hs.text(max_size=8).filter(lambda t: "," not in t and t.isprintable())
    summaries = hs.builds(ModelSummary, names, hs.integers(0, 2 ** 40), arch, hs.integers(0, 999),
                          hs.integers(0, 99999), hs.sampled_from(["", "Q4_1", "F16"]),
                          hs.text("0123456789abcdef", min_size=1, max_size=16))

    @settings(max_examples=1500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(hs.one_of(hs.text(max_size=200), summaries.map(lambda m: identity.refusal(m, "ab", 1, 2)),
                     hs.tuples(hs.text(max_size=20), summaries, hs.text(max_size=20)).map(
                         lambda c: c[0] + identity.refusal(c[1], "ab", 1, 2) + c[2])))
    def run(text):
        got = identity.parse_refusal(text)
        if got is not None:
            assert identity.parse_refusal(identity.refusal(got, "ab", 1, 2)) == got
            assert "\n" not in identity.mismatch(got, MAIN)
    run()

    @settings(max_examples=500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(summaries)
    def round_trip(m):
        assert identity.parse_refusal(identity.refusal(m, "ab", 1, 2)) == m
    round_trip()
