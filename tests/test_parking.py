"""Conversation parking (--conversation-cache-mib): A/B/A switching restores A from the park with the tokens and
per-layer state hashes of A played alone (the default model and synthetic hybrids, 1 and 2 stages); eight
conversations round-robin each resume from their own park; the budget evicts least recently used; a
"strata_checkpoint": false request leaves nothing to park; with parking off a switch reads again."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from strata.engine import Engine
from tests.helpers import ask, chat, long_chat, play


@pytest.fixture(scope="module")
def hybrid_path(synthetic):
    return synthetic("qwen35", n_layer=4, seed=21, n_mtp=1)


@pytest.fixture(scope="module")
def mamba_path(synthetic):
    return synthetic("nemotron_h", seed=21)


@pytest.mark.parametrize("resident", [0, 2])
@pytest.mark.parametrize("which,split", [("default", None), ("default", "15"), ("hybrid", None), ("hybrid", "2"),
                                         ("mamba", "3")])
def test_a_b_a_restores_a_from_the_park_bit_exact(which, split, resident, default_model_path, hybrid_path,
                                                  mamba_path):
    """In host RAM (park_resident=0) and resident on the device (its pages held in the pool, the new conversation
    sharing the system prompt's pages with it)."""
    path = {"default": default_model_path, "hybrid": hybrid_path, "mamba": mamba_path}[which]
    alone = Engine(path, n_ctx=1024, ubatch=32, layer_split=split, conversation_cache_mib=0)
    ref = play(alone, "rivers", 2, [])
    # one checkpoint beside the root (--prompt-cache 2): B's turn evicts A's from the checkpoint tree, so A comes back
    # from its park (with more, the tree resumes A from its own turn: tests/test_checkpoints.py, the state fuzz)
    e = Engine(path, n_ctx=1024, ubatch=32, layer_split=split, conversation_cache_mib=256, park_resident=resident,
               prompt_cache=2)
    answers: list[str] = []
    first = play(e, "rivers", 1, answers)
    play(e, "mountains", 1, [])                                   # B: A is parked
    assert len(e.parked()) == 1 and e.parked()[0]["tokens"] > 0
    assert e.parked()[0]["tier"] == ("device" if resident else "ram")
    toks, final = ask(e, chat("rivers", 1, answers))              # A again
    assert final.strata["resume_from"] == ("resident" if resident else "park") and final.strata["resume_pos"] > 0
    assert first[0][0] == ref[0][0]
    assert toks == ref[1][0]
    assert e.state_hashes() == ref[1][1]                          # moved, never re-read: the same state
    assert [p["tokens"] for p in e.parked()] != []                # B is parked now


def test_eight_conversations_round_robin_each_from_its_own_park(hybrid_path):
    topics = ["rivers", "ships", "bread", "stars", "glass", "maps", "bees", "clocks"]
    e = Engine(hybrid_path, n_ctx=512, ubatch=32, conversation_cache_mib=256)
    answers = {t: [] for t in topics}
    got = {t: [] for t in topics}
    for turn in range(3):
        for t in topics:
            toks, final = ask(e, chat(t, turn, answers[t]), n=4)
            answers[t].append(e.detokenize(toks))
            got[t].append(toks)
            if turn > 0:
                # two resident on the device, the other five in host RAM
                assert final.strata["resume_from"] in ("park", "resident"), (t, turn, final.strata)
                # its own: past its first user message (other conversations share only the first few tokens)
                assert final.strata["resume_pos"] >= len(e.render_chat(chat(t, 0, [])).tokens) - 4
    for t in topics[:3]:                                          # each equals its conversation played alone
        alone = Engine(hybrid_path, n_ctx=512, ubatch=32, conversation_cache_mib=0)
        a: list[str] = []
        for turn in range(3):
            toks, _ = ask(alone, chat(t, turn, a), n=4)
            a.append(alone.detokenize(toks))
            assert toks == got[t][turn], (t, turn)


def test_budget_evicts_least_recently_used_and_opt_out_parks_nothing(hybrid_path):
    e = Engine(hybrid_path, n_ctx=512, ubatch=32, conversation_cache_mib=256, park_resident=0)
    ask(e, chat("rivers", 0, []))
    ask(e, chat("ships", 0, []))                                  # rivers parked
    one = e.parked()[0]["bytes"]
    e.park.budget = int(2.5 * one)                                 # room for two parked conversations
    for t in ("bread", "stars"):
        ask(e, chat(t, 0, []))
    parked = e.parked()
    assert len(parked) == 2 and e.status()["park_stats"]["evicted"] == 1
    _, final = ask(e, chat("rivers", 1, ["x"]))                   # the least recently used one left
    assert final.strata["resume_from"] != "park"
    ask(e, chat("glass", 0, []), checkpoint=False)                 # a one-shot request
    n = e.status()["park_stats"]["parked"]
    ask(e, chat("maps", 0, []))
    assert e.status()["park_stats"]["parked"] == n                 # the one-shot conversation was not parked


def test_parking_off_reads_again(hybrid_path):
    e = Engine(hybrid_path, n_ctx=512, ubatch=32, conversation_cache_mib=0)
    a, _ = ask(e, chat("rivers", 0, []))
    ask(e, chat("ships", 0, []))
    _, final = ask(e, chat("rivers", 1, [e.detokenize(a)]))
    assert final.strata["resume_from"] not in ("park", "resident") and e.parked() == []


@pytest.mark.parametrize("which", ["default", "hybrid"])
def test_disk_tier_takes_what_ram_drops_and_gives_it_back_bit_exact(which, default_model_path, hybrid_path,
                                                                     tmp_path):
    path = default_model_path if which == "default" else hybrid_path
    alone = Engine(path, n_ctx=512, ubatch=32, conversation_cache_mib=0)
    ref = play(alone, "rivers", 2, [])
    e = Engine(path, n_ctx=512, ubatch=32, conversation_cache_mib=256, conversation_cache_dir=tmp_path,
               conversation_cache_disk_mib=64, park_resident=0)
    answers: list[str] = []
    play(e, "rivers", 1, answers)
    play(e, "ships", 1, [])                                         # rivers parked in RAM
    e.park.budget = e.parked()[0]["bytes"] + 1                       # RAM now holds one conversation
    play(e, "bread", 1, [])                                         # ships parked: rivers goes to disk
    tiers = sorted(p["tier"] for p in e.parked())
    assert tiers == ["disk", "ram"] and len(list(tmp_path.glob("park-*.bin"))) == 1
    toks, final = ask(e, chat("rivers", 1, answers))
    assert final.strata["resume_from"] == "disk" and toks == ref[1][0] and e.state_hashes() == ref[1][1]
    # rivers' file is gone (bread, parked now, pushed ships to disk): one file per disk entry
    assert len(list(tmp_path.glob("park-*.bin"))) == sum(p["tier"] == "disk" for p in e.parked()) == 1


def test_host_memory_is_set_aside_for_two_conversations_at_start(hybrid_path):
    """Conversations.prepin: the CPU stages' host arena holds two full conversations (a full context's K/V, the
    running state and the checkpoints' copies of it) free when the engine starts, capped by the park budget, and
    /status reports it; a park then takes its arrays from it."""
    from strata.memory.pinned import arena, host_bytes
    e = Engine(hybrid_path, n_ctx=512, ubatch=32, conversation_cache_mib=300, park_resident=0)
    mem = e.stages[0].memory.stats()
    full = mem["kv"]["bytes"] + mem["running"]["bytes_per_sequence"] * (1 + e.cache.cap)
    a = arena("cpu")
    assert a.pinned_bytes - a.used_bytes >= min(2 * full, 300 << 20)
    assert a.keep_bytes >= 300 << 20                       # kept up to the park budget
    assert e.status()["memory"]["park_host_bytes"] == host_bytes() > 0
    pins = a.pins
    play(e, "rivers", 2, [])
    ask(e, chat("mountains", 0, []))                       # parks the rivers chat into the arena
    assert len(e.park) == 1 and a.pins == pins             # nothing more allocated for it
    e.close()


@pytest.mark.parametrize("which", ["default", "hybrid"])
def test_a_parked_one_liner_holds_its_rows_not_whole_pages(which, default_model_path, hybrid_path, tmp_path):
    """A short conversation parked in host RAM (and written to a session file) keeps the K/V of its own tokens, not
    a whole page per layer: its bytes are its tokens times the pools' bytes per token plus its running state and the
    checkpoints it holds in the tree (prefixes of its K/V: running state only), and it comes back bit-exact."""
    path = default_model_path if which == "default" else hybrid_path
    kw = dict(n_ctx=1024, ubatch=32)
    one = [{"role": "user", "content": "Say hi."}]
    alone = Engine(path, conversation_cache_mib=0, **kw)
    ref = ask(alone, one, n=4)[0]
    r = alone.render_chat(one)           # the answer continued token by token: the parked one-liner is its prefix
    two = SimpleNamespace(tokens=list(r.tokens) + ref + list(alone.render_chat(one).tokens[-6:]),
                          cut_points=r.cut_points)
    ref += ask(alone, two, n=4)[0]
    ref_hashes = alone.state_hashes()
    e = Engine(path, conversation_cache_mib=256, park_resident=0, prompt_cache=2, slot_save_path=str(tmp_path), **kw)
    first = ask(e, one, n=4)[0]
    e.slot_save(0, filename="one.bin")
    ask(e, [{"role": "user", "content": "Something else entirely, please."}], n=4)      # parks the one-liner in RAM
    (parked,) = [p for p in e.parked() if p["tier"] == "ram"]
    per_token, running, page = 0, 0, None
    for st in e.stages:
        mem = st.memory.stats()
        running += int(mem.get("running", {}).get("bytes_per_sequence", 0))
        for f in getattr(st.memory, "fields", [st.memory]):
            if getattr(f, "name", None) == "kv":
                per_token += f.pool.bytes_per_token
                page = f.pool.page_size
    assert parked["tokens"] < page                        # a one-liner: less than a page
    # its checkpoints are the tree's, held by it alone (pins 1), moved to host RAM with it: each a copy of the
    # running state only (its K/V the parked one's prefix, its token ids the tree's path)
    held = [c for c in e.checkpoints() if c["pins"]]
    assert len(held) == parked["checkpoints"] and all(c["pins"] == 1 for c in held)
    assert all(c["bytes"] == running and c["tier"] == "ram" for c in held), (held, running)
    exact = parked["tokens"] * per_token + running + 4 * parked["tokens"] + sum(c["bytes"] for c in held)
    assert parked["bytes"] == exact, (parked, exact)      # whole pages would be page / tokens times the K/V
    assert os.path.getsize(tmp_path / "one.bin") < page * per_token
    again = ask(e, two, n=4)
    assert again[1].strata["resume_from"] == "park"
    assert first + again[0] == ref and e.state_hashes() == ref_hashes


@pytest.mark.parametrize("which", ["default", "hybrid"])
def test_checkpoints_spill_to_the_disk_tier_and_come_back_bit_exact(which, default_model_path, hybrid_path,
                                                                      tmp_path):
    """Parking off, the tree alone keeps the branches: a pool of one context moves the first chat's checkpoints to
    host RAM when the second needs its pages (make_room), and a byte budget of 0 (--prompt-cache-mib) moves them
    on to the disk tier (files of the session format) instead of dropping them; the first chat then resumes from
    its own checkpoint read back from disk, with the tokens and state hashes of the same read plan with the
    checkpoints kept in RAM (the reference: --prompt-cache-mib large)."""
    path = default_model_path if which == "default" else hybrid_path
    kw = dict(n_ctx=512, ubatch=32, conversation_cache_mib=0, prompt_cache=8)

    def run(e):
        a: list[str] = []
        play(e, "rivers", 1, a, render=long_chat)
        play(e, "ships", 1, [], render=long_chat)          # rivers' checkpoints leave the pool
        toks, final = ask(e, long_chat("rivers", 1, a))
        return toks, final.strata, e.state_hashes()

    ref = run(Engine(path, prompt_cache_mib=1024, **kw))
    slots = tmp_path / "slots"
    slots.mkdir()
    e = Engine(path, prompt_cache_mib=0, conversation_cache_dir=tmp_path, conversation_cache_disk_mib=64,
               slot_save_path=slots, **kw)
    got = run(e)
    assert got[1]["resume_from"] == "checkpoint" and got[1]["resume_pos"] == ref[1]["resume_pos"] > 0
    assert got[0] == ref[0] and got[2] == ref[2]
    st = e.disk.status()
    assert st["nodes"] >= 1 and st["restored"] >= 1 and st["bytes"] == sum(
        f.stat().st_size for f in tmp_path.glob("node-*.bin"))
    assert {c["tier"] for c in e.cache.entries()} >= {"disk"}
    assert e.cache.stats()["spilled"] >= 1
    # a session file carries the conversation's checkpoints on disk too (read back, left where they are)
    e.slot_save(0, filename="chat.bin")
    on_path = e.cache.export(e.seq.ids, on_disk=True)
    assert any(type(snap).__name__ == "DiskNode" for _, _, snap in on_path)
    fresh = Engine(path, prompt_cache_mib=1024, slot_save_path=slots, **kw)
    fresh.slot_restore(0, filename="chat.bin")
    assert sorted(c["pos"] for c in fresh.cache.entries()) == [pos for pos, _, _ in on_path]
    assert fresh.state_hashes() == got[2]


def test_the_disk_tier_budget_drops_spilled_checkpoints_and_the_tree_forgets_them(hybrid_path, tmp_path):
    """A disk budget of about one file: each checkpoint spilled pushes the one before out (its file removed), and the
    tree forgets the checkpoints whose files are gone before it plans; a checkpoint bigger than the whole budget is
    not written at all; the answers stay those of a cold read throughout."""
    cold = Engine(hybrid_path, n_ctx=512, ubatch=16, conversation_cache_mib=0, prompt_cache=0)
    e = Engine(hybrid_path, n_ctx=512, ubatch=16, conversation_cache_mib=0, prompt_cache=8, prompt_cache_mib=0,
               conversation_cache_dir=tmp_path, conversation_cache_disk_mib=1)
    answers: list[str] = []
    for turn in range(4):
        if turn == 1:                                     # room for the largest file so far and a half
            e.disk.budget = max(f.stat().st_size for f in tmp_path.glob("node-*.bin")) * 3 // 2
        if turn == 3:                                     # smaller than any file: nothing more is written
            e.disk.budget, written = 1, e.disk.status()["written"]
        toks, final = ask(e, chat("rivers", turn, answers), n=4)
        assert toks == ask(cold, chat("rivers", turn, answers), n=4, cache_prompt=False)[0]
        answers.append(e.detokenize(toks))
        if turn:
            assert sum(f.stat().st_size for f in tmp_path.glob("node-*.bin")) <= e.disk.budget
    st = e.disk.status()
    assert st["nodes_dropped"] >= 1 and st["too_big"] >= 1 and st["written"] == written
    e.store.forget_dropped()
    assert all(c["tier"] != "disk" for c in e.cache.entries())


def test_a_held_checkpoint_off_the_device_reads_its_kv_from_a_parked_copy(hybrid_path):
    """A conversation parked in host RAM that no live sequence extends takes the checkpoints it holds off the device:
    each keeps its running state only (no K/V pages, no K/V or token ids of its own), and joined with the rows of the
    parked conversation's host copy it restores the state a cold read of its tokens gives."""
    kw = dict(n_ctx=1024, ubatch=32)
    e = Engine(hybrid_path, conversation_cache_mib=256, park_resident=0, prompt_cache=6, **kw)
    ask(e, chat("rivers", 0, []), n=4)
    ask(e, [{"role": "user", "content": "Something else entirely."}], n=4)     # rivers parked; nothing extends it
    running = sum(int(st.memory.stats().get("running", {}).get("bytes_per_sequence", 0)) for st in e.stages)
    held = [c for c in e.checkpoints() if c["pins"]]
    assert held and all(c["tier"] == "ram" and c["bytes"] == running for c in held), (held, running)
    root = min(c["pos"] for c in held)
    (snap,) = [x.snapshot for x in e.cache._entries.values() if x.pos == root]
    joined = e.store.held.join(snap)
    assert joined is not None and all(not p.is_prefix and not p.is_held for p in joined.parts)
    e.seq.restore(joined)
    cold = Engine(hybrid_path, conversation_cache_mib=0, prompt_cache=0, **kw)
    cold.seq.forward(list(snap.tokens))
    assert e.state_hashes() == cold.state_hashes()
