"""Shared by the test files: one request sent to an engine and its answer collected (answer, ask), the chats the
tests play (chat, long_chat) turn by turn (play), the state-hash keys two runs differ in (differing), and bytes that
are not UTF-8 alone (invalid_alone), random GGUF blocks and their reference dequantization for the kernel
tests (random_blocks, put_iq_scales, ref_dequant), a tools/ script loaded as a module (load_tool), and whether the
exhaustive sweeps run (full_sweeps: `make test-sweeps`; CI runs a representative case of each)."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from strata.engine import FinalEvent, GenerationRequest, TokenEvent


def full_sweeps() -> bool:
    """Whether STRATA_FULL_SWEEPS=1 asks for the exhaustive form of the sweeps that CI runs a representative case of
    (`make test-sweeps` runs those tests so)."""
    return os.environ.get("STRATA_FULL_SWEEPS", "") not in ("", "0")


@dataclass
class Answer:
    """One request's answer: its token events in order, its final event and the prompt sent (the RenderedPrompt
    when it was a message list)."""
    tokens: list[TokenEvent]
    final: FinalEvent
    prompt: Any

    @property
    def ids(self) -> list[int]:
        return [e.token_id for e in self.tokens]

    @property
    def text(self) -> str:
        """The streamed pieces and the final event's tail, as a client reads them."""
        return "".join(e.text for e in self.tokens) + self.final.text

    @property
    def logprobs(self) -> list[tuple[int, float | None]]:
        """(token id, its logprob) per token."""
        return [(e.token_id, e.logprob) for e in self.tokens]

    @property
    def top(self) -> list[dict[int, float]]:
        """Each token's top logprobs as {id: logprob} ({} when the request asked for none)."""
        return [{i: lp for i, _, lp in (e.top_logprobs or [])} for e in self.tokens]


def answer(engine, prompt, n: int | None = 8, *, ignore_eos: bool = True, **request) -> Answer:
    """Send one request of one choice and collect its answer. prompt: a message list (rendered with the engine's chat
    template) or anything with .tokens and .cut_points (a RenderedPrompt); n: max_tokens; ignore_eos: generate all n
    tokens (the default: the state tests compare answers of one length); request: other GenerationRequest fields."""
    r = engine.render_chat(prompt) if isinstance(prompt, list) else prompt
    evs = list(engine.generate(GenerationRequest(prompt_tokens=r.tokens, cut_points=r.cut_points, max_tokens=n,
                                                 ignore_eos=ignore_eos, **request)))
    assert isinstance(evs[-1], FinalEvent) and all(isinstance(e, TokenEvent) for e in evs[:-1])
    return Answer(evs[:-1], evs[-1], r)


def generate_all(engine, prompt_tokens, **request) -> tuple[list[TokenEvent], list[FinalEvent]]:
    """One request on token ids (max_tokens 30 and ignore_eos unless given): its token events in order and its final
    events (one per choice)."""
    request.setdefault("max_tokens", 30)
    request.setdefault("ignore_eos", True)
    toks, finals = [], []
    for ev in engine.generate(GenerationRequest(prompt_tokens=list(prompt_tokens), **request)):
        (finals if isinstance(ev, FinalEvent) else toks).append(ev)
    return toks, finals


def ask(engine, prompt, n: int | None = 8, **kw) -> tuple[list[int], FinalEvent]:
    """answer() as (token ids, final event)."""
    a = answer(engine, prompt, n, **kw)
    return a.ids, a.final


def chat(topic: str, turn: int, answers: list[str]) -> list[dict]:
    """A chat about `topic` at its turn `turn` (0 = the first user message), answers[i] being turn i's answer."""
    msgs = [{"role": "system", "content": f"You talk about {topic} only."}]
    for i in range(turn + 1):
        msgs.append({"role": "user", "content": f"Tell me fact {i + 1} about {topic}."})
        if i < turn:
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs


def long_chat(topic: str, turn: int, answers: list[str]) -> list[dict]:
    """chat() with its system message 55 times over (~300 tokens on the tiny synthetic hybrid)."""
    return [dict(m, content=m["content"] * 55) if i == 0 else m for i, m in enumerate(chat(topic, turn, answers))]


def play(engine, topic, turns, answers, render=chat):
    """Turn by turn, each turn's messages rendered by render(topic, turn, answers) and asked (ask's defaults), its
    answer appended to `answers`; returns [(tokens, hashes, resume_from)]."""
    out = []
    for t in range(turns):
        toks, final = ask(engine, render(topic, t, answers))
        answers.append(engine.detokenize(toks))
        out.append((toks, engine.state_hashes(), final.strata["resume_from"]))
    return out


def differing(h: dict, ref: dict) -> list[str]:
    """The state-hash keys of `ref` whose hash `h` does not share, per-layer keys ('kv.L3') ordered by layer."""
    return sorted((k for k in ref if h.get(k) != ref[k]), key=lambda k: (k.split(".L")[0], int(k.split(".L")[1]))
                  if ".L" in k else (k, -1))


def invalid_alone(b: bytes) -> bool:
    """True when `b` is not valid UTF-8 on its own (a piece of a multi-byte character)."""
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# ---- GGUF blocks for the kernel tests ----
# offsets of the f16 scale fields inside one block, per type (ggml-common.h)
SCALE_OFFS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(t, n_out, n_in, rng):
    """Random packed blocks of type t: every quant bit pattern, finite f16 scales (±[1e-3, 1e-1])."""
    qk, bs = GGML_QUANT_SIZES[t]
    nb = n_in // qk
    raw = rng.integers(0, 256, size=(n_out, nb, bs), dtype=np.uint8)
    if t in IQ_TYPES:
        put_iq_scales(raw, t, rng.uniform(1e-3, 1e-1, size=(n_out, nb)) * rng.choice([-1, 1], size=(n_out, nb)))
    for off in SCALE_OFFS.get(t, []):
        sc = (rng.uniform(1e-3, 1e-1, size=(n_out, nb)) * rng.choice([-1, 1], size=(n_out, nb))).astype(np.float16)
        raw[:, :, off:off + 2] = sc.view(np.uint8).reshape(n_out, nb, 2)
    return raw.reshape(n_out, nb * bs)


IQ_TYPES = [Q.IQ4_XS, Q.IQ4_NL, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ2_S, Q.IQ1_S, Q.IQ1_M]


def put_iq_scales(raw: np.ndarray, t, d: np.ndarray) -> None:
    """Write the f16 block scales d (n_out, nb) into packed IQ blocks raw (n_out, nb, bytes) in place: the first two
    bytes of a block, except IQ1_M, whose scale's four nibbles top its four 16-bit scale words (bytes 48..55)."""
    bits = np.asarray(d, dtype=np.float16).view(np.uint16)
    if t == Q.IQ1_M:
        sc = raw[..., 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for k in range(4):
            sc[..., k] |= ((bits >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12)
        raw[..., 48:56] = sc.view(np.uint8)
    else:
        raw[..., 0:2] = bits[..., None].view(np.uint8)


def ref_dequant(raw, t, n_out, n_in):
    return np.asarray(gq.dequantize(raw, t), dtype=np.float64).reshape(n_out, n_in)


def default_fingerprint() -> str:
    """The default model's fingerprint (what a worker's hello must name)."""
    from strata.gguf.default_model import resolve_model
    from strata.gguf.file import open_gguf
    return open_gguf(resolve_model("default")).fingerprint()


def load_tool(name: str):
    """tools/<name>.py imported as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
