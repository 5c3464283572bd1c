"""A differential fuzz of conversation state (hypothesis state machine): random new chats on a shared system prompt,
continued turns, regenerations, earlier turns edited, branches, switches between chats, session files saved and
loaded, forgets and restarts, on an engine with checkpoints, parking (resident, in host RAM and, with small budgets,
on disk, where the tree's checkpoints spill too) and session files.
The reference is an engine with none of them that reads every prompt cold (the CPU kernels give the same bits for
any split of a prompt into reads): after every request the greedy tokens and the live sequence's state hashes are
equal; after every step every KV page's reference count equals its holders (the live page tables and the holds of
kept checkpoints and resident conversations) and every hold is owned by one of those; after a forget no page is
held but by a parked conversation; a loaded session file's state
hashes are those it was saved with. A third configuration runs the layers after the first stage on a worker (a
remote stage, parking, session files and periodic checkpoints over the link): every layer's hash is compared there too
(the worker runs in this process), and the worker's pages are counted against its part store. STATE_FUZZ_STEPS sets
the steps of one run (tools/state_fuzz.py runs 10,000+)."""
from __future__ import annotations

import collections
import itertools
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from strata.engine import Engine
from tests.daemon import InProcessWorker
from tests.helpers import ask

STEPS = int(os.environ.get("STATE_FUZZ_STEPS", "0") or 0)     # steps per architecture (0: CI's)
REPORT = os.environ.get("STATE_FUZZ_REPORT")                    # a JSON file the counts are added to
N_ANSWER = 3
SYSTEMS = ["You are a careful assistant. " * 6, "You answer in one short line. " * 4]
WORDS = ["rivers", "ships", "stars", "salt", "maps", "clocks", "bees", "glass"]


def _holders(engine) -> set[int]:
    """ids of the holds something still owns: the kept checkpoints' parts and the resident conversations' parts."""
    snaps = [e.snapshot for e in engine.cache._entries.values()]
    res = engine.store.resident
    parts = [p for c in snaps for p in c.parts]
    parts += [p for c in (res.conversations() if res is not None else ()) for p in c.parts]
    return {id(k.hold) for p in parts for k in p.kv.values() if k.is_held}


def _pages_ok(engine, stages=None, owned=None) -> None:
    """Every page's count is its holders' (the live page tables, the holds), and every hold is owned by a kept
    checkpoint or a resident conversation (`owned`: ids of the holds someone owns; a worker's: its store's):
    nothing leaked, nothing freed early."""
    owned = _holders(engine) if owned is None else owned
    for st in (engine.stages if stages is None else stages):
        if not hasattr(st.memory, "fields"):
            continue                     # a remote stage: its worker's pages are counted apart

        for f in st.memory.fields:
            pool = getattr(f, "pool", None)
            if pool is not None:
                stray = [h for h in pool.holds if id(h) not in owned]
                assert not stray, f"stage {st.index} {f.name}: {len(stray)} holds no checkpoint or conversation owns"
    seen = set()
    for st in (engine.stages if stages is None else stages):
        for f in getattr(st.memory, "fields", ()):
            pool = getattr(f, "pool", None)
            if pool is None or id(pool) in seen:
                continue
            seen.add(id(pool))
            want = np.zeros(pool.n_pages, int)
            for table in (getattr(s, f.name) for s in (st.memory.seq(i) for i in st.memory.sequences)):
                for p in table.pages:
                    want[p] += 1
            for h in pool.holds:
                for p in h.pages:
                    want[p] += 1
            got = [pool.allocator.refcount(p) for p in range(pool.n_pages)]
            assert got == want.tolist(), f"stage {st.index} {f.name}: refcounts {got}, holders {want.tolist()}"
            assert pool.n_free == int((want == 0).sum())


def _pins_ok(engine) -> None:
    """Every pin on a node of the checkpoint tree is held by a parked conversation in the tree, and every parked
    conversation's pin is on a node of the tree that keeps a checkpoint (unless a worker or the disk tier dropped
    that checkpoint on its own): nothing leaked after a forget, nothing unpinned early."""
    tree = engine.store.checkpoints.tree

    def attached(n) -> bool:
        while n.parent is not None:
            if n.parent.children.get(int(n.span[0])) is not n:
                return False
            n = n.parent
        return n is tree.root
    holders = collections.Counter()
    for nd in tree.nodes("parked"):
        for n in nd.parked.conv.pins:
            if n.value is not None and attached(n):
                holders[id(n)] += 1
    pinned = {id(n): n.pins for n in tree.nodes("value") if n.pins}
    assert pinned == dict(holders), f"pins on the tree's checkpoints {pinned}, held by parked conversations {dict(holders)}"


def _worker_pages_ok(worker) -> None:
    """A worker's pages: its part store owns every hold, each page's count is its holders', the store within the
    part budget its hello granted."""
    carrier = worker.worker.carrier
    if carrier is None:
        return
    owned = {id(k.hold) for cp in carrier.store.values() for p in cp.parts for k in p.kv.values() if k.is_held}
    _pages_ok(None, carrier.stages, owned)
    assert len(carrier.store) <= carrier.ckpt_max


def _machine(path, tmp_path, counts: collections.Counter, parking: bool = True, worker=None):
    kw = dict(n_ctx=1024, ubatch=16)

    def engine() -> Engine:
        if worker is not None:   # the layers after the first stage on a worker: parking, session files and
            #                      periodic checkpoints over it
            return Engine(path, remote_stage=worker.address, layer_split="2", conversation_cache_mib=64,
                          park_resident=1, slot_save_path=str(tmp_path), prompt_cache=6, prompt_cache_every=24, **kw)
        if not parking:         # the checkpoint tree alone keeps the branches (a larger pool holds their pages)
            return Engine(path, conversation_cache_mib=0, slot_save_path=str(tmp_path), prompt_cache=16,
                          prompt_cache_every=24, kv_pool_ctx=8192, **kw)
        if parking == "disk":   # small budgets: parked conversations and the tree's checkpoints spill to files
            disk = tmp_path / "disk"
            disk.mkdir(exist_ok=True)
            e = Engine(path, conversation_cache_mib=1, park_resident=1, slot_save_path=str(tmp_path),
                       prompt_cache_every=24, prompt_cache_mib=0, conversation_cache_dir=str(disk),
                       conversation_cache_disk_mib=64, **kw)
            e.park.budget = 120_000           # RAM keeps two or three short parked conversations
            return e
        return Engine(path, conversation_cache_mib=64, park_resident=1, slot_save_path=str(tmp_path),
                      prompt_cache_every=24, **kw)

    ref = Engine(path, prompt_cache=0, conversation_cache_mib=0, **kw)

    def kept(k: str) -> bool:      # over a link: per-layer K/V and running state, the tokens (no drafter runs)
        return (".L" in k and not k.startswith("draft.")) or k == "tokens"

    def hashes(e: Engine) -> dict:
        """The live sequence's state hashes: every layer's (a worker's too) and its tokens."""
        h = e.state_hashes()
        if worker is None:
            return h
        h = {k: v for k, v in h.items() if kept(k)}
        h.update({k: v for k, v in worker.worker.carrier.seq.hashes().items() if kept(k) and k != "tokens"})
        return h

    def ref_hashes() -> dict:
        h = ref.state_hashes()
        return h if worker is None else {k: v for k, v in h.items() if kept(k)}

    class StateFuzz(RuleBasedStateMachine):
        """chats: name -> messages (the last a user message, not yet answered, or answered: `answered`)."""

        @initialize()
        def start(self):
            self.e = engine()                             # each run from a fresh engine: its steps decide its state
            # names counted per run: a replayed run names its chats alike, so sorted(self.chats) is the same list
            self.names = itertools.count()
            self.chats: dict[str, list[dict]] = {}
            self.saved: list[tuple[str, dict]] = []       # (file name, state hashes at the save)

        def _ask(self, name: str):
            msgs = self.chats[name]
            disk = self.e.disk.status()["restored"] if self.e.disk is not None else 0
            toks, final = ask(self.e, msgs, N_ANSWER)
            counts["requests"] += 1
            counts["resume_" + str(final.strata["resume_from"])] += 1
            if self.e.disk is not None:     # requests that read a file of the disk tier back (a checkpoint or a chat)
                counts["disk_reads"] += self.e.disk.status()["restored"] > disk
            ref.slot_erase()                              # cold: the reference reads the whole prompt
            want, _ = ask(ref, msgs, N_ANSWER)
            assert toks == want, f"{final.strata} tokens {toks}, cold {want}"
            h, r = hashes(self.e), ref_hashes()
            assert h == r, f"{final.strata}: state differs from the cold read: " \
                           f"{sorted(k for k in r if h.get(k) != r[k])[:6]}"
            msgs.append({"role": "assistant", "content": self.e.detokenize(toks)})
            return final

        def _fits(self, name: str) -> bool:
            return len(self.chats[name]) < 12

        @rule(system=hs.integers(0, len(SYSTEMS) - 1), word=hs.sampled_from(WORDS))
        def new_chat(self, system, word):
            name = f"c{next(self.names)}"
            self.chats[name] = [{"role": "system", "content": SYSTEMS[system]},
                                {"role": "user", "content": f"Tell me about {word}."}]
            self._ask(name)

        @precondition(lambda self: self.chats)
        @rule(data=hs.data(), word=hs.sampled_from(WORDS))
        def continue_chat(self, data, word):          # the live one, or a switch to another
            name = data.draw(hs.sampled_from(sorted(self.chats)))
            if not self._fits(name):
                return
            self.chats[name].append({"role": "user", "content": f"And {word}?"})
            self._ask(name)

        @precondition(lambda self: self.chats)
        @rule(data=hs.data())
        def regenerate(self, data):
            name = data.draw(hs.sampled_from(sorted(self.chats)))
            self.chats[name].pop()                        # its last answer
            self._ask(name)

        @precondition(lambda self: self.chats)
        @rule(data=hs.data(), word=hs.sampled_from(WORDS))
        def edit_turn(self, data, word):
            name = data.draw(hs.sampled_from(sorted(self.chats)))
            users = [i for i, m in enumerate(self.chats[name]) if m["role"] == "user"]
            i = data.draw(hs.sampled_from(users))
            self.chats[name] = self.chats[name][:i] + [{"role": "user", "content": f"Rather, {word}."}]
            self._ask(name)

        @precondition(lambda self: self.chats)
        @rule(data=hs.data(), word=hs.sampled_from(WORDS))
        def branch(self, data, word):
            name = data.draw(hs.sampled_from(sorted(self.chats)))
            if not self._fits(name):
                return
            new = f"c{next(self.names)}"
            self.chats[new] = [dict(m) for m in self.chats[name]] + [{"role": "user", "content": f"Now {word}."}]
            self._ask(new)

        @precondition(lambda self: self.chats)
        @rule(data=hs.data(), word=hs.sampled_from(WORDS))
        def subagent(self, data, word):
            """A sub-agent on its parent's system prompt answers, the parent takes its next turn, the sub-agent its
            next: the sub-agent resumes at least as deep as its own checkpoints reached before the parent's turn
            (unless a checkpoint was evicted in between), then the parent resumes too."""
            parent = data.draw(hs.sampled_from(sorted(self.chats)))
            if not self._fits(parent):
                return
            sub = f"c{next(self.names)}"
            self.chats[sub] = [dict(self.chats[parent][0]), {"role": "user", "content": f"Look up {word}."}]
            self._ask(sub)
            self.chats[sub].append({"role": "user", "content": "Go on."})
            deep = self.e.cache.deepest(self.e.render_chat(self.chats[sub]).tokens)
            evictions = self.e.cache.stats()["evictions"]
            self.chats[parent].append({"role": "user", "content": f"Meanwhile, {word}?"})
            self._ask(parent)
            final = self._ask(sub)
            if self.e.cache.stats()["evictions"] != evictions:
                counts["subagent_evicted"] += 1
            elif not parking:                             # the tree alone kept the sub-agent's branch
                assert final.strata["resume_pos"] >= deep > 0, (final.strata, deep)
                counts["subagent_kept"] += 1

        @precondition(lambda self: self.e.seq.pos > 0)
        @rule()
        def save(self):
            name = f"s{next(self.names)}.bin"
            self.e.slot_save(0, name)
            self.saved.append((name, hashes(self.e)))

        @precondition(lambda self: self.saved)
        @rule(data=hs.data())
        def load(self, data):
            name, want = data.draw(hs.sampled_from(self.saved))
            self.e.slot_restore(0, name)
            assert hashes(self.e) == want

        @rule()
        def forget(self):
            self.e.slot_erase()
            _pages_ok(self.e)
            held = sum(len(h.pages) for st in self.e.stages for f in getattr(st.memory, "fields", ())
                       if getattr(f, "pool", None) is not None for h in f.pool.holds)
            used = sum(f.pool.n_pages - f.pool.n_free for st in self.e.stages for f in getattr(st.memory, "fields", ())
                       if getattr(f, "pool", None) is not None)
            assert used <= held, f"{used} pages in use after a forget, {held} held by parked conversations"

        @precondition(lambda self: self.saved)
        @rule()
        def restart(self):
            self.e.close()
            self.e = engine()                             # parking is gone; the session files stay

        @invariant()
        def pages(self):
            if hasattr(self, "e"):
                counts["steps"] += 1
                _pages_ok(self.e)
                _pins_ok(self.e)
                if worker is not None:
                    _worker_pages_ok(worker)

        def teardown(self):
            if hasattr(self, "e"):
                self.e.close()

    return StateFuzz


@pytest.mark.parametrize("arch,parking", [("llama", True), ("qwen35", True), ("llama", False), ("qwen35", False),
                                         ("llama", "remote"), ("qwen35", "remote"), ("llama", "disk"),
                                         ("qwen35", "disk")])
def test_conversation_state_matches_cold_reads(arch, parking, synthetic, tmp_path):
    # ubatch 16 (in _machine): every read is of at most 16 tokens, so the hybrid's reads split the same way cold.
    # parking False: no parking at all, the checkpoint tree alone keeps the branches (sub-agents checked deep);
    # "remote": layers 2.. on a worker, parking (resident and in RAM) and session files over the link; "disk": RAM
    # and checkpoint byte budgets so small that parked conversations and the tree's checkpoints go to disk files
    path = synthetic(arch, n_layer=4, seed=33)
    counts: collections.Counter = collections.Counter()
    worker = InProcessWorker(model=str(path)) if parking == "remote" else None
    try:
        machine = _machine(path, tmp_path, counts, parking if parking == "disk" else bool(parking), worker)
        want = STEPS or (100 if parking is True else 50)
        while counts["steps"] < want:      # hypothesis chooses each run's length: runs until `want` steps are done
            run_state_machine_as_test(machine, settings=settings(
                max_examples=max(1, (want - counts["steps"]) // 8), stateful_step_count=25, deadline=None,
                suppress_health_check=list(HealthCheck), database=None))
    finally:
        if worker is not None:
            worker.close()
    if REPORT:
        old = json.loads(open(REPORT).read()) if os.path.exists(REPORT) else {}
        old[arch + {True: "", False: "-tree", "remote": "-remote", "disk": "-disk"}[parking]] = dict(counts)
        with open(REPORT, "w") as f:
            json.dump(old, f, indent=1, sort_keys=True)
    assert counts["requests"] > 0 and counts["steps"] >= want
