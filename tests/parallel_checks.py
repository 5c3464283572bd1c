"""What the request-slot tests play: mixed requests, each answered alone on a one-slot engine and together on an
engine with several slots (tests/test_parallel_engine.py on the CPU, tests/test_cuda_parallel.py on a GPU)."""
import numpy as np

from strata.engine import Engine, FinalEvent, GenerationRequest, TokenEvent
from strata.sampling.sampler import SamplingParams

N_CTX = 640


def requests(engine):
    """Mixed requests: short and long prompts, greedy and seeded sampling, two choices, a stop string, a grammar."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge the boxing match".split()
    rng = np.random.default_rng(5)
    long_text = " ".join(rng.choice(words, 300))
    return [
        dict(prompt="The capital of France is", max_tokens=24),
        dict(prompt="Once upon a time, in a land far away,", max_tokens=30,
             sampling=SamplingParams(temperature=0.9, top_k=40, seed=7)),
        dict(prompt=long_text, max_tokens=12),                     # several ubatch parts (ubatch 128 below)
        dict(prompt="1, 2, 3, 4, 5,", max_tokens=20, stop=["9"]),
        dict(prompt="def fibonacci(n):", max_tokens=16, n=2, sampling=SamplingParams(temperature=0.7, seed=3)),
        dict(prompt="Secret word: PLUM. Repeat the secret word:", max_tokens=10),
        dict(prompt="Three-digit numbers:", max_tokens=16, grammar='start: NUM ("," NUM)*\nNUM: /[0-9][0-9][0-9]/',
             sampling=SamplingParams(temperature=0.8, seed=5)),     # a grammar's mask per slot
    ]


def req(engine, spec, **kw):
    spec = dict(spec)
    toks = engine.tokenize_prompt(spec.pop("prompt"))
    if "grammar" in spec:
        from strata.sampling import grammar
        spec["constraint"] = grammar.Constraint(grammar.lark_grammar(spec.pop("grammar")), engine.tokenizer,
                                                engine.n_vocab)
    return GenerationRequest(toks, **spec, **kw)


def key(events):
    """What a request answered: every choice's token ids and texts, finish reasons and stop causes."""
    out = []
    for ev in events:
        if isinstance(ev, TokenEvent):
            out.append(("tok", ev.index, ev.token_id, ev.text))
        elif isinstance(ev, FinalEvent):
            out.append(("end", ev.index, ev.finish_reason, ev.text, ev.usage["completion_tokens"],
                        ev.strata.get("stopped_by")))
    return out


def alone(path, pick=None, **kw):
    e = Engine(path, n_ctx=N_CTX, ubatch=128, **{"device": "cpu", **kw})
    try:
        return [key(e.generate(req(e, spec))) for spec in requests(e) if pick is None or pick(spec)]
    finally:
        e.close()


def together(path, n_slots, pick=None, **kw):
    """The requests through an engine with n_slots slots: three admitted at once, the rest one per engine step as
    slots free up (the long prompt arrives while the first ones decode) -> (answers, the scheduler's stats and, with
    a remote stage, its link's status under "link")."""
    e = Engine(path, n_ctx=N_CTX, ubatch=128, parallel=n_slots, **{"device": "cpu", **kw})
    try:
        specs = [spec for spec in requests(e) if pick is None or pick(spec)]
        got = {i: [] for i in range(len(specs))}
        done = {}
        waiting = list(range(len(specs)))

        def admit(i):
            return e.admit(req(e, specs[i]), got[i].append, lambda err, i=i: done.__setitem__(i, err)) is not None

        for i in waiting[:2]:
            assert admit(i)
        waiting = waiting[2:]
        for _ in range(3):               # the first two decode a few tokens before the next one arrives
            e.step()
        while waiting or len(done) < len(specs):
            if waiting and admit(waiting[0]):
                waiting.pop(0)
            if not e.step() and waiting and not admit(waiting[0]):
                raise AssertionError("no slot busy, yet the next request found none")
        assert all(err is None for err in done.values()), done
        stats = dict(e.scheduler.stats)
        if "link" in e.stages[-1].status():
            stats["link"] = e.stages[-1].status()["link"]
        return [key(got[i]) for i in range(len(specs))], stats
    finally:
        e.close()


class SlotOracle:
    """The drafts of one request slot's drafter in the tests (MTPDrafter.oracle): for the request its sequence holds
    (the first of `known` whose prompt starts the sequence), the greedy continuation recorded alone, each drafted
    position kept with that request's probability (its own generator: the draws depend on its drafts alone) and
    otherwise replaced by the next token id; the MTP head's own token elsewhere. known: [(prompt, continuation,
    rate, rng)], shared by every slot's oracle (a request may land in any slot)."""

    def __init__(self, seq, known, n_vocab):
        self.seq, self.known, self.n_vocab = seq, known, n_vocab

    def __call__(self, pos, token):
        ids = self.seq.ids
        for prompt, ref, rate, rng in self.known:
            if len(ids) >= len(prompt) and list(ids[:len(prompt)]) == list(prompt):
                k = pos - len(prompt)
                if not 0 <= k < len(ref):
                    return token
                return ref[k] if rng.random() < rate else (ref[k] + 1) % self.n_vocab
        return token


def drive(engine, reqs, arrive):
    """Admit reqs[i] once `arrive[i]` engine steps have run (or later, when no slot is free) and step until all end
    -> ([each request's events], {request: error or None})."""
    got = {i: [] for i in range(len(reqs))}
    done: dict = {}
    waiting = sorted(range(len(reqs)), key=lambda i: arrive[i])
    clock = 0
    while waiting or len(done) < len(reqs):
        while waiting and arrive[waiting[0]] <= clock:
            i = waiting[0]
            if engine.admit(reqs[i], got[i].append, lambda err, i=i: done.__setitem__(i, err)) is None:
                break
            waiting.pop(0)
        engine.step()
        clock += 1
    return [got[i] for i in range(len(reqs))], done
