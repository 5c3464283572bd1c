"""Parking resident on the device (--park-resident): a conversation's K/V pages held in the pool (memory.kv.Hold)
instead of copied to host RAM. Page tables, holds and refcounts under random operations (hypothesis: every page's
count is its holders', held K/V never changes, the live table's page ids never change under a write); and on the
engine: a new chat with the same system prompt shares its pages, the switch back copies no K/V, a short pool moves
the least recently used resident conversation to host RAM, and every answer equals the conversation played alone."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as hs

from strata.backend.cpu import CPUBackend
from strata.engine import Engine
from strata.memory import KVCacheFull, PagedKV, PartMismatch
from tests.helpers import ask, chat, long_chat, play

PS, NKV, HD = 4, 1, 2


def _fill(pool, table, n, tag):
    """Reserve and write n positions whose K is (tag, position), then commit."""
    table.reserve(n)
    k = np.zeros((n, NKV, HD), np.float32)
    k[:, 0, 0] = tag
    k[:, 0, 1] = np.arange(table.length, table.length + n)
    pool.write(0, table.pages, table.length, k, k)
    table.commit(n)


def _kv(pool, pages, length):
    return pool.read(0, list(pages), length)[0].copy()


ops = hs.lists(hs.tuples(hs.sampled_from(["write", "truncate", "hold", "release", "adopt", "trim"]),
                         hs.integers(0, 40)), min_size=1, max_size=40)


@settings(max_examples=400, deadline=None)
@given(ops)
def test_holds_keep_their_kv_and_refcounts_stay_exact(steps):
    pool = CPUBackend().new_page_pool([0], 24, NKV, HD, page_size=PS)
    live = PagedKV(pool)
    holds = []                                   # (Hold, K/V it must keep)
    for tag, (op, n) in enumerate(steps, 1):
        if op == "write":
            before = list(live.pages[:live.length // PS + 1])
            free = pool.n_free
            try:
                _fill(pool, live, 1 + n % 9, tag)
            except KVCacheFull:
                assert pool.n_free == free       # nothing taken
                continue
            assert live.pages[:len(before)] == before   # the live table's ids never change under a write
        elif op == "truncate":
            live.truncate(n % (live.length + 1))
        elif op == "hold" and live.length:
            m = -(-live.length // PS)
            holds.append((pool.hold(live.pages[:m], live.length), _kv(pool, live.pages, live.length)))
        elif op == "release" and holds:
            h, _ = holds.pop(n % len(holds))
            h.release()
            h.release()                          # idempotent
        elif op == "adopt" and holds:
            h, kv = holds[n % len(holds)]
            live.adopt(h)
            np.testing.assert_array_equal(_kv(pool, live.pages, live.length), kv)
        elif op == "trim":
            live.trim()
        for h, kv in holds:                      # a held conversation's K/V is what it was
            np.testing.assert_array_equal(_kv(pool, h.pages, h.length), kv)
        want = np.zeros(pool.n_pages, int)
        for p in live.pages:
            want[p] += 1
        for h, _ in holds:
            for p in h.pages:
                want[p] += 1
        assert [pool.allocator.refcount(p) for p in range(pool.n_pages)] == want.tolist()
        assert pool.n_free == int((want == 0).sum())
    live.release()
    for h, _ in holds:
        h.release()
    assert pool.n_free == pool.n_pages


def test_a_write_past_what_a_hold_covers_copies_no_page_and_one_before_it_copies_one():
    pool = CPUBackend().new_page_pool([0], 8, NKV, HD, page_size=PS)
    copies: list = []
    real = pool.copy_page
    pool.copy_page = lambda a, b: copies.append((a, b)) or real(a, b)
    live = PagedKV(pool)
    _fill(pool, live, 6, 1)                          # positions 0..5: page 1 half full
    held = pool.hold(live.pages[:2], 6)
    kept = _kv(pool, held.pages, 6)
    pages = list(live.pages)
    _fill(pool, live, 5, 2)                          # 6..10: page 1 shared, but the hold covers only 4..5 of it
    assert copies == [] and live.pages[:2] == pages
    np.testing.assert_array_equal(_kv(pool, held.pages, 6), kept)
    other = PagedKV(pool)
    other.adopt(held)                                # a sequence resumes the held conversation at 6
    _fill(pool, other, 2, 3)                         # the live table wrote page 1 past 6: the resumed one copies it
    assert len(copies) == 1 and other.pages[0] == pages[0] and other.pages[1] != pages[1]
    live.truncate(5)
    _fill(pool, live, 1, 4)                          # position 5 is the hold's: it gets its own copy first
    assert len(copies) == 2 and live.pages[:2] == pages and held.pages[1] != pages[1]
    np.testing.assert_array_equal(_kv(pool, held.pages, 6), kept)
    for t in (live, other):
        t.release()
    held.release()
    assert pool.n_free == pool.n_pages


def test_a_released_hold_is_refused_and_changes_nothing(default_model_path):
    e = Engine(default_model_path, n_ctx=512, ubatch=32, conversation_cache_mib=64)
    ask(e, chat("rivers", 0, []))
    held = e.seq.capture().parts
    e.seq.release(held)
    e.seq.release(held)                          # twice: nothing more given back
    before = e.state_hashes(), e.seq.pos
    from strata.stages.sequence import Checkpoint
    with pytest.raises(PartMismatch, match="given back"):
        e.seq.restore(Checkpoint(pos=held[0].pos, tokens=e.seq.ids[:held[0].pos], parts=held))
    assert (e.state_hashes(), e.seq.pos) == before


@pytest.fixture(scope="module")
def hybrid_path(synthetic):
    return synthetic("qwen35", n_layer=4, seed=21)


def _long_system(topic: str, turn: int, answers: list[str]) -> list[dict]:
    msgs = chat(topic, turn, answers)
    msgs[0]["content"] = "You are a careful assistant. " * 150 + msgs[0]["content"].replace(topic, "anything")
    return msgs


def _pages_used(e) -> int:
    return sum(st.memory.stats()["kv"]["pages_used"] for st in e.stages if "kv" in st.memory.stats())


@pytest.mark.parametrize("which", ["default", "hybrid"])
def test_a_new_chat_shares_the_system_prompt_and_the_switch_back_copies_no_kv(which, default_model_path,
                                                                             hybrid_path):
    path = default_model_path if which == "default" else hybrid_path
    kw = dict(n_ctx=2048, ubatch=256)
    alone = Engine(path, conversation_cache_mib=0, **kw)
    ref_a = [t for t, _, _ in play(alone, "rivers", 2, [], _long_system)]
    alone.slot_erase()
    ref_b = [t for t, _, _ in play(alone, "ships", 1, [], _long_system)]
    e = Engine(path, conversation_cache_mib=256, park_resident=2, prompt_cache=2, **kw)   # the tree keeps no turn of A
    answers: list[str] = []
    toks, _ = ask(e, _long_system("rivers", 0, answers))
    answers.append(e.detokenize(toks))
    assert toks == ref_a[0]
    toks, final = ask(e, _long_system("ships", 0, []))           # a new chat: rivers stays resident
    assert toks == ref_b[0]
    assert final.strata["resume_pos"] > 0                          # from the system prompt's checkpoint
    assert [p["tier"] for p in e.parked()] == ["device"]
    # the ships chat shares the system prompt's full pages with the parked rivers chat: only its tail is new
    ps = e.stages[0].memory.stats()["kv"]["page_size"]
    a_pos, b_pos, shared = e.parked()[0]["tokens"], e.seq.pos, final.strata["resume_pos"] // ps
    assert shared >= 2
    assert _pages_used(e) == -(-a_pos // ps) + -(-b_pos // ps) - shared
    pool = e.stages[0].memory
    pool = getattr(pool, "pool", None) or pool.children[0].pool
    exported = []
    real_export = pool.export_rows
    pool.export_rows = lambda pages, length: exported.append(len(pages)) or real_export(pages, length)
    toks, final = ask(e, _long_system("rivers", 1, answers))     # back: nothing copied to or from the host
    pool.export_rows = real_export
    assert final.strata["resume_from"] == "resident" and toks == ref_a[1] and exported == []
    assert [p["tier"] for p in e.parked()] == ["device"]          # ships is resident now


def test_a_short_pool_moves_the_least_recently_used_to_host_ram_bit_exact(hybrid_path):
    """n_ctx 512: two conversations of ~300 tokens that share only a few tokens do not fit in the pool together,
    so reading the second moves the first to host RAM (make_room), from where it comes back bit-exact."""
    kw = dict(n_ctx=512, ubatch=64)
    alone = Engine(hybrid_path, conversation_cache_mib=0, **kw)
    ref = play(alone, "rivers", 2, [], long_chat)
    e = Engine(hybrid_path, conversation_cache_mib=256, park_resident=2, **kw)
    answers: list[str] = []
    toks, _ = ask(e, long_chat("rivers", 0, answers))
    answers.append(e.detokenize(toks))
    ask(e, long_chat("ships", 0, []))                              # rivers resident, then moved to host RAM
    assert [p["tier"] for p in e.parked()] == ["ram"]
    assert e.status()["resident_stats"]["evicted"] == 1
    toks, final = ask(e, long_chat("rivers", 1, answers))
    assert final.strata["resume_from"] == "park"
    assert toks == ref[1][0] and e.state_hashes() == ref[1][1]


def test_park_resident_zero_parks_in_host_ram_and_negative_is_refused(hybrid_path):
    e = Engine(hybrid_path, n_ctx=256, ubatch=32, conversation_cache_mib=64, park_resident=0)
    ask(e, chat("rivers", 0, []))
    ask(e, chat("ships", 0, []))
    assert [p["tier"] for p in e.parked()] == ["ram"]
    with pytest.raises(ValueError, match="--park-resident must be >= 0"):
        Engine(hybrid_path, n_ctx=256, conversation_cache_mib=64, park_resident=-1)


def test_a_larger_kv_pool_keeps_both_conversations_resident(hybrid_path):
    """--kv-pool-ctx: with room for two contexts, the conversations of the short-pool test above both stay on the
    device (no move to RAM) and each comes back from there."""
    e = Engine(hybrid_path, n_ctx=512, ubatch=64, conversation_cache_mib=256, park_resident=2, kv_pool_ctx=1024,
               prompt_cache=2)                                  # the checkpoint tree keeps no turn of the other chat
    assert e.status()["kv_pages"]["total"] == 4
    answers = {"rivers": [], "ships": []}
    for turn in range(2):
        for topic in answers:
            toks, final = ask(e, long_chat(topic, turn, answers[topic]))
            answers[topic].append(e.detokenize(toks))
            if turn:
                assert final.strata["resume_from"] == "resident"
    assert e.status()["resident_stats"]["evicted"] == 0 and e.park is not None and len(e.park) == 0
    with pytest.raises(ValueError, match="--kv-pool-ctx 256 is smaller than --n-ctx 512"):
        Engine(hybrid_path, n_ctx=512, kv_pool_ctx=256)


@pytest.mark.parametrize("resident", [0, 2])
def test_a_parked_attention_only_conversation_resumes_at_the_longest_common_prefix(resident, default_model_path):
    """Raw completions on an attention-only model: X, then an unrelated Y (X parked), then X's first k tokens with
    another tail: X comes back and is cut back to exactly k tokens (not to a checkpoint before them), and the
    answer equals a cache_prompt: false answer."""
    from strata.engine import GenerationRequest, TokenEvent
    e = Engine(default_model_path, n_ctx=1024, ubatch=64, conversation_cache_mib=64, park_resident=resident)
    tok = e.tokenizer
    x = tok.encode("The history of the river Loire, told slowly and with many details about its towns. " * 6)
    y = tok.encode("An unrelated list of kitchen tools: knives, pans, whisks, ladles and graters. " * 3)
    k = len(x) - 17
    x2 = x[:k] + tok.encode(" Meanwhile, in a different valley far away,")

    def run(ids, **kw):
        evs = list(e.generate(GenerationRequest(prompt_tokens=ids, max_tokens=6, ignore_eos=True, **kw)))
        return [ev.token_id for ev in evs if isinstance(ev, TokenEvent)], evs[-1]
    run(x)
    run(y)
    toks, final = run(x2)
    assert final.strata["resume_from"] == ("resident" if resident else "park")
    assert final.strata["resume_pos"] == k
    ref, _ = run(x2, cache_prompt=False)
    assert toks == ref


def test_a_new_chat_that_shares_only_the_system_prompt_leaves_the_parked_one_whole(default_model_path):
    """rivers, then an unrelated chat (rivers parked), then ships with rivers' system prompt: ships resumes from
    rivers' prefix but rivers stays parked whole, and its next turn still resumes from all of it."""
    e = Engine(default_model_path, n_ctx=2048, ubatch=128, conversation_cache_mib=256, park_resident=2,
               prompt_cache=2)                                  # the checkpoint tree keeps no turn of the other chat
    a = [e.detokenize(ask(e, _long_system("rivers", 0, []))[0])]
    n_rivers = e.seq.pos
    ask(e, chat("trains", 0, []))
    _, f = ask(e, _long_system("ships", 0, []))
    # from the checkpoint at the system prompt's end, which parked rivers holds (a cut of rivers would skip fewer
    # than CUT_MIN tokens more): rivers is not touched
    assert f.strata["resume_from"] == "checkpoint" and 0 < f.strata["resume_pos"] < n_rivers
    assert n_rivers in [p["tokens"] for p in e.parked()]
    _, f = ask(e, _long_system("rivers", 1, a))
    assert f.strata["resume_from"] == "resident" and f.strata["resume_pos"] == n_rivers


def test_a_restore_failing_midway_puts_the_conversation_back_and_leaks_no_page(default_model_path):
    e = Engine(default_model_path, n_ctx=512, ubatch=64, conversation_cache_mib=64, park_resident=2)
    a = [e.detokenize(ask(e, chat("rivers", 0, []))[0])]
    ask(e, chat("ships", 0, []))                              # rivers parked resident
    real = e.seq.restore

    def boom(ckpt):
        raise MemoryError("simulated: a device allocation failing inside the restore")
    e.seq.restore = boom
    with pytest.raises(MemoryError):
        ask(e, chat("rivers", 1, a))
    e.seq.restore = real
    assert e.seq.pos == 0                                      # the live sequence started over
    assert sorted(p["tier"] for p in e.parked()) == ["device", "device"]     # rivers back, ships parked
    _, f = ask(e, chat("rivers", 1, a))
    assert f.strata["resume_from"] == "resident"
    e.store.resident.clear()                                   # the parked ones, and the checkpoints they held
    e.slot_erase()
    assert e.status()["kv_pages"]["used"] == 0 and e.status()["kv_pages"]["held"] == 0


def test_the_disk_file_a_switch_picked_is_read_before_parking_can_evict_it(hybrid_path, tmp_path):
    """RAM and disk hold one conversation each (resident off): parking the live one pushes the RAM one to disk,
    which evicts the file the switch picked, unless it was read first."""
    e = Engine(hybrid_path, n_ctx=512, ubatch=32, conversation_cache_mib=256, conversation_cache_dir=tmp_path,
               conversation_cache_disk_mib=64, park_resident=0)
    answers = {t: [] for t in ("rivers", "ships", "bread", "stars")}
    for t in answers:
        answers[t].append(e.detokenize(ask(e, chat(t, 0, []))[0]))
        if t == "ships":
            one = e.parked()[0]["bytes"]                          # its own bytes and its share of the tree's
            own = e.store.parking.in_tier("ram")[0].conv.nbytes()  # its file: its own (checkpoints stay in the tree)
            e.park.budget, e.disk.budget = one + one // 2, own + own // 2
    assert [p["tier"] for p in e.parked()] == ["ram", "disk"]    # bread in RAM, ships on disk (rivers' file gone)
    _, f = ask(e, chat("ships", 1, answers["ships"]))           # parking stars pushes bread to disk: ships' file
    assert f.strata["resume_from"] == "disk"                     # would be evicted had it not been read first


def test_a_device_out_of_memory_for_the_resident_copy_parks_in_host_ram(default_model_path):
    e = Engine(default_model_path, n_ctx=512, ubatch=64, conversation_cache_mib=64, park_resident=2)
    a = [e.detokenize(ask(e, chat("rivers", 0, []))[0])]
    ask(e, chat("ships", 0, []))                              # rivers resident
    real = e.store.capture_resident

    def oom(seq):
        raise MemoryError("simulated: out of device memory")
    e.store.capture_resident = oom
    ask(e, chat("trains", 0, []))                             # ships cannot stay on the device: RAM, rivers too
    e.store.capture_resident = real
    assert sorted(p["tier"] for p in e.parked()) == ["ram", "ram"]
    assert len(e.store.resident) == 0                 # no conversation holds pages (checkpoints may)
    _, f = ask(e, chat("rivers", 1, a))
    assert f.strata["resume_from"] == "park"


def test_a_failure_to_park_never_fails_the_request_nor_loses_the_target(default_model_path, monkeypatch):
    """Out of memory on the device for the resident copy and then on the host for the RAM copy: the live
    conversation is left unparked, the request that leaves it still runs, and the conversation it switches to
    comes back (its pages not lost)."""
    e = Engine(default_model_path, n_ctx=1024, ubatch=64, conversation_cache_mib=64, park_resident=2)
    a = [e.detokenize(ask(e, chat("rivers", 0, []))[0])]
    ask(e, chat("ships", 0, []))                              # rivers resident

    def oom(*_a, **_k):
        raise MemoryError("simulated: out of memory")
    monkeypatch.setattr(e.store, "capture_resident", oom)
    monkeypatch.setattr(e.store, "capture", oom)
    _, f = ask(e, chat("rivers", 1, a))                       # ships cannot be parked anywhere
    assert f.strata["resume_from"] in ("resident", "park")    # rivers came back (moved to RAM by the fallback)
    assert e.park.stats["refused"] >= 1
    monkeypatch.undo()
    ask(e, chat("trains", 0, []))
    owned = {id(k.hold) for c in e.store.resident.conversations() for p in c.parts for k in p.kv.values()}
    owned |= {id(k.hold) for x in e.cache._entries.values() for p in x.snapshot.parts for k in p.kv.values()}
    pool = e.stages[0].memory.pool
    assert all(id(h) in owned for h in pool.holds)           # no hold outlives its conversation or checkpoint


def test_without_parking_a_short_pool_moves_checkpoints_to_host_ram_and_a_hit_brings_them_back(hybrid_path):
    """Parking off, n_ctx 512: the second long conversation does not fit beside the first one's checkpoints, so they
    move to host RAM (their tier "ram", no longer holding pages) instead of being dropped, and the first
    conversation's next turn resumes from one of them, bit-exact with the conversation played alone."""
    kw = dict(n_ctx=512, ubatch=64)
    alone = Engine(hybrid_path, conversation_cache_mib=0, **kw)
    ref = play(alone, "rivers", 2, [], long_chat)
    e = Engine(hybrid_path, conversation_cache_mib=0, prompt_cache=8, **kw)
    answers: list[str] = []
    toks, _ = ask(e, long_chat("rivers", 0, answers))
    answers.append(e.detokenize(toks))
    ask(e, long_chat("ships", 0, []))
    demoted = e.cache.stats()["demoted"]
    assert demoted >= 1 and any(c["tier"] == "ram" for c in e.checkpoints())
    toks, final = ask(e, long_chat("rivers", 1, answers))
    assert final.strata["resume_from"] == "checkpoint" and final.strata["resume_pos"] > 300
    assert any(c["tier"] == "ram" and c["mounts"] == 1 and c["pos"] == final.strata["resume_pos"]
               for c in e.checkpoints())                          # the hit was on a checkpoint in host RAM
    assert toks == ref[1][0] and e.state_hashes() == ref[1][1]


def test_status_does_not_wait_on_a_resident_conversation_copied_to_host_ram(hybrid_path):
    """--park-resident 1: parking a third chat moves the first down to host RAM, a device-to-host copy made under
    the tree's lock. With that copy held (a stand-in that waits on an event), /status's engine view and the parked
    and checkpoint views still answer, with the tree just before the move; once the copy goes on, the move lands."""
    import threading

    e = Engine(hybrid_path, n_ctx=512, ubatch=64, conversation_cache_mib=256, park_resident=1)
    ask(e, chat("rivers", 0, []))
    ask(e, chat("ships", 0, []))                                   # rivers parked resident
    before = e.parked()
    assert [p["tier"] for p in before] == ["device"]
    mem = e.stages[0].memory
    copying, go = threading.Event(), threading.Event()
    real = mem.materialize

    def slow_materialize(part):
        copying.set()
        go.wait(120)
        return real(part)

    mem.materialize = slow_materialize
    asked = threading.Thread(target=ask, args=(e, chat("cats", 0, [])))   # ships parked: rivers moves to RAM
    asked.start()
    try:
        assert copying.wait(120)
        seen = {}
        reader = threading.Thread(target=lambda: seen.update(status=e.status(), parked=e.parked(),
                                                              checkpoints=e.checkpoints()))
        reader.start()
        reader.join(60)
        assert not reader.is_alive(), "a view waited on the copy"
        assert seen["checkpoints"] == seen["status"]["checkpoints"]
    finally:
        go.set()
        asked.join(120)
        mem.materialize = real
    assert not asked.is_alive()
    after = e.parked()
    assert [p["tier"] for p in after] == ["device", "ram"] and after[1]["tokens"] == before[0]["tokens"]
    assert e.status()["resident_stats"]["evicted"] == 1
    # what the views showed meanwhile: the tree just before the move (ships parked beside rivers, both resident)
    assert seen["parked"] == [after[0], before[0]] == seen["status"]["parked"]
