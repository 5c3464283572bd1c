"""Session files (--slot-save-path; strata/cache/session.py): save / restore round trips on one and two stages (a
hybrid conversation resumes from its saved checkpoints afterwards), golden files of format versions 1 and 3, and
every bad file or name refused with one line, the live conversation untouched, nothing written outside the
directory; the reader fuzzed (hypothesis)."""
from __future__ import annotations

import functools
import io
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as hs

from strata.gguf import synth
from strata.cache import session
from strata.engine import Engine
from tests import helpers
from tests.mutation import mutate

DATA = Path(__file__).resolve().parent / "data"
GOLDEN_SPEC = dict(arch="qwen35", size="tiny", n_layer=4, seed=31)
ask = functools.partial(helpers.ask, n=6)

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me about rivers."}]
BRANCH = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "Tell me about deserts instead."}]


def golden_model(tmp) -> Path:
    spec = dict(GOLDEN_SPEC)
    arch, size = spec.pop("arch"), spec.pop("size")
    return synth.write_synthetic(Path(tmp) / "golden.gguf", synth.preset(arch, size, **spec))


@pytest.fixture(scope="module")
def model_path(synthetic):
    return synthetic(name="golden", **GOLDEN_SPEC)          # the file golden_model writes


def _engine(path, slot_dir, split=None, n_ctx=512):
    return Engine(path, n_ctx=n_ctx, ubatch=32, layer_split=split, slot_save_path=slot_dir, conversation_cache_mib=0)


@pytest.mark.parametrize("split", [None, "2"])
def test_save_restart_restore_continue(model_path, tmp_path, split):
    e = _engine(model_path, tmp_path, split)
    t1, _ = ask(e, CHAT)
    follow = CHAT + [{"role": "assistant", "content": e.detokenize(t1)}, {"role": "user", "content": "More?"}]
    h = e.state_hashes()
    r = e.slot_save(0, filename="chat.bin")
    assert r["n_saved"] == e.status()["pos"] and r["n_written"] == os.path.getsize(tmp_path / "chat.bin")
    t2_uninterrupted, _ = ask(e, follow)
    e2 = _engine(model_path, tmp_path, split)                       # a restart
    r = e2.slot_restore(0, filename="chat.bin")
    assert r["n_restored"] == len(e2.seq.tokens) and e2.state_hashes() == h
    t2, f2 = ask(e2, follow)
    assert t2 == t2_uninterrupted and f2.strata["resume_pos"] > 0 and f2.strata["resume_from"] == "session"
    e3 = _engine(model_path, tmp_path, split)                       # the saved checkpoints resume a branch
    e3.slot_restore(0, filename="chat.bin")
    _, fb = ask(e3, BRANCH)                                          # from a saved checkpoint, not the end
    assert fb.strata["resume_from"] == "session" and 0 < fb.strata["resume_pos"] < len(e3.seq.tokens) - 6


def test_golden_files_of_both_versions_read(model_path, tmp_path):
    expect = json.loads((DATA / "session_golden.json").read_text())
    for name, split in (("session_v1.bin", None), ("session_v3.bin", "2")):
        raw = (DATA / name).read_bytes()
        assert int.from_bytes(raw[8:12], "little") == (1 if split is None else 3)
        shutil.copy(DATA / name, tmp_path / name)
        e = _engine(model_path, tmp_path, split)
        e.slot_restore(0, filename=name)
        assert e.state_hashes()["kv"] == expect["kv"] and e.state_hashes()["running"] == expect["running"]
        follow = CHAT + [{"role": "assistant", "content": expect["answer"]}, {"role": "user", "content": "More?"}]
        assert ask(e, follow)[0] == expect["next_tokens"]


@pytest.fixture(scope="module")
def saved(model_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    e = _engine(model_path, d, "2")
    ask(e, CHAT)
    e.slot_save(0, filename="s.bin")
    return d, (d / "s.bin").read_bytes()


_ENGINES: dict = {}


def _refused(model_path, tmp_path, data: bytes, match: str, split="2", n_ctx=512):
    (tmp_path / "bad.bin").write_bytes(data)
    key = (str(model_path), str(tmp_path), split, n_ctx)
    if key not in _ENGINES:
        _ENGINES[key] = _engine(model_path, tmp_path, split, n_ctx=n_ctx)
        ask(_ENGINES[key], BRANCH)
    e = _ENGINES[key]
    before = e.state_hashes(), list(e.seq.tokens)
    with pytest.raises(ValueError, match=match) as exc:
        e.slot_restore(0, filename="bad.bin")
    assert "\n" not in str(exc.value)
    assert (e.state_hashes(), list(e.seq.tokens)) == before
    return e


def test_bad_files_are_refused_and_change_nothing(model_path, tmp_path, saved):
    _, data = saved
    hlen = int.from_bytes(data[12:16], "little")
    n = json.loads(data[20:20 + hlen])["n_tokens"]
    tok_end = 20 + hlen + 4 * n + 4
    for cut in (0, 7, 20, 20 + hlen, tok_end - 4, tok_end, tok_end + 4, tok_end + 40, len(data) - 1):
        _refused(model_path, tmp_path, data[:cut], "ends inside|not a Strata session")
    _refused(model_path, tmp_path, b"GGUFxxxx" + data[8:], "not a Strata session file")
    v2 = bytearray(data)
    v2[8] = 2
    _refused(model_path, tmp_path, bytes(v2), "version 2 is reserved")
    flipped = bytearray(data)
    flipped[-100] ^= 0x40
    _refused(model_path, tmp_path, bytes(flipped), "checksum mismatch")
    _refused(model_path, tmp_path, data, "another --layer-split", split="1")
    _refused(model_path, tmp_path, data, "another --layer-split", split=None)
    _refused(model_path, tmp_path, data, f"holds {n} tokens, more than this engine's context", n_ctx=n)
    _refused(model_path, tmp_path, data + b"\0", "bytes after its last stage block")
    other = synth.write_synthetic(tmp_path / "other.gguf", synth.preset("qwen35", "tiny", n_layer=4, seed=32))
    _refused(other, tmp_path, data, "from another model")
    _ENGINES.clear()


def test_bad_names_and_empty_slot(model_path, tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    (d / "link.bin").symlink_to(outside)
    (d / "inside.bin").symlink_to(d / "adir")
    (d / "adir").mkdir()
    e = _engine(model_path, d)
    with pytest.raises(ValueError, match="holds no conversation"):
        e.slot_save(0, filename="empty.bin")
    ask(e, CHAT)
    for bad in ("../x.bin", "a/b", "/etc/passwd", "..", "x\0y", "a" * 300, "b" * 201, "", ".hidden", "link.bin",
                "inside.bin", "adir", "nl\nx", "\ud800x", None, 7):
        with pytest.raises(ValueError) as exc:
            e.slot_save(0, filename=bad)
        assert "\n" not in str(exc.value)
        with pytest.raises(ValueError):
            e.slot_restore(0, filename=bad)
    assert sorted(os.listdir(d)) == ["adir", "inside.bin", "link.bin"] and outside.read_bytes() == b"x"
    assert e.slot_save(0, filename="c" * 200)["n_saved"] > 0          # the longest name allowed
    with pytest.raises(ValueError, match="does not exist"):
        e.slot_restore(0, filename="missing.bin")
    with pytest.raises(ValueError, match="slot 1 does not exist"):
        e.slot_save(1, filename="x.bin")
    no_dir = Engine(model_path, n_ctx=256, conversation_cache_mib=0)
    with pytest.raises(ValueError, match="need --slot-save-path"):
        no_dir.slot_save(0, filename="x.bin")
    assert e.slot_erase(0, filename="ignored.bin")["n_erased"] > 0 and e.seq.pos == 0
    assert e.status()["kv_pages"]["used"] == 0                     # erase gives the pages back


def test_restore_parks_the_conversation_it_replaces(model_path, tmp_path):
    e = Engine(model_path, n_ctx=512, ubatch=32, slot_save_path=tmp_path, conversation_cache_mib=256,
               prompt_cache=2)
    ask(e, CHAT)
    e.slot_save(0, filename="a.bin")
    b, _ = ask(e, BRANCH)                                          # CHAT is parked; BRANCH live
    e.slot_restore(0, filename="a.bin")                            # BRANCH parked, the parked CHAT dropped
    assert [p["tokens"] for p in e.parked()] == [len(e.render_chat(BRANCH).tokens) + len(b) - 1]   # the last token is not read yet
    assert len(e.checkpoints()) <= 2                               # this engine's --prompt-cache applies
    follow = BRANCH + [{"role": "assistant", "content": e.detokenize(b)}, {"role": "user", "content": "And?"}]
    _, f = ask(e, follow)
    assert f.strata["resume_from"] == "resident"                   # parked on the device (--park-resident)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(mut=hs.lists(hs.tuples(hs.integers(0, 10 ** 7), hs.integers(0, 255)), min_size=1, max_size=4),
       trunc=hs.one_of(hs.none(), hs.integers(0, 10 ** 7)))
def test_reader_fuzz(fuzz_engine, saved, mut, trunc):
    _, data = saved
    try:
        conv = session.read(io.BytesIO(mutate(data, mut, trunc)), fuzz_engine.file.fingerprint(), fuzz_engine.stages,
                            fuzz_engine.n_ctx)
    except ValueError as e:
        assert "\n" not in str(e)
        return
    assert conv.pos > 0


@pytest.fixture(scope="module")
def fuzz_engine(model_path, tmp_path_factory):
    return _engine(model_path, tmp_path_factory.mktemp("fz"), "2")


def make_golden(out_dir: Path, tmp: Path) -> None:
    """Write tests/data/session_v1.bin, session_v3.bin and session_golden.json (tools/make_session_golden.py)."""
    path = golden_model(tmp)
    expect = {}
    for name, split in (("session_v1.bin", None), ("session_v3.bin", "2")):
        e = _engine(path, out_dir, split)
        t1, _ = ask(e, CHAT)
        e.slot_save(0, filename=name)
        h = e.state_hashes()
        expect.update(kv=h["kv"], running=h["running"], answer=e.detokenize(t1))
        follow = CHAT + [{"role": "assistant", "content": expect["answer"]}, {"role": "user", "content": "More?"}]
        expect["next_tokens"] = ask(e, follow)[0]
    (out_dir / "session_golden.json").write_text(json.dumps(expect, indent=1))


@pytest.mark.slow
def test_daemon_save_restart_restore_with_stratactl(tmp_path):
    """The real daemon and stratactl: chat, `stratactl save`, stop, start again, `stratactl restore`, the next turn
    resumes (cache_n > 0) with the answer an uninterrupted daemon gives; `stratactl cache` lists what is parked."""
    import subprocess
    import sys
    from tests.daemon import ROOT, Daemon, env_for_daemon
    slots = tmp_path / "slots"
    slots.mkdir()

    def ctl(d, *a):
        return subprocess.run([sys.executable, "-m", "strata.cli.ctl", "--socket", d.sock, *a], capture_output=True,
                              text=True, env=env_for_daemon(), cwd=ROOT, timeout=120)
    turn1 = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}],
             "max_tokens": 6, "temperature": 0}
    (tmp_path / "a").mkdir()
    d = Daemon(tmp_path / "a", "--slot-save-path", str(slots)).start()
    try:
        st, a = d.json("POST", "/v1/chat/completions", turn1)
        turn2 = dict(turn1, messages=turn1["messages"] + [a["choices"][0]["message"],
                                                          {"role": "user", "content": "Another one?"}])
        r = ctl(d, "save", "0", "--filename", "chat.bin")
        assert r.returncode == 0 and "save done" in r.stdout, r.stderr
        st, other = d.json("POST", "/v1/chat/completions", dict(turn1, messages=[{"role": "user", "content": "Hi"}]))
        c = json.loads(ctl(d, "cache", "--json").stdout)
        assert c["parked"] and c["parked"][0]["tier"] == "device"      # parked resident (--park-resident)
        assert "parked conversations" in ctl(d, "cache").stdout
        st, b_direct = d.json("POST", "/v1/chat/completions", turn2)
        assert b_direct["strata"]["resume_from"] == "resident"
    finally:
        assert d.stop() == 0, d.log_tail()
    (tmp_path / "b").mkdir()
    d = Daemon(tmp_path / "b", "--slot-save-path", str(slots)).start()
    try:
        r = ctl(d, "restore", "0", "--filename", "chat.bin")
        assert r.returncode == 0 and "restore done" in r.stdout, r.stderr
        st, b = d.json("POST", "/v1/chat/completions", turn2)
        assert st == 200 and b["timings"]["cache_n"] > 0
        assert b["choices"][0]["message"]["content"] == b_direct["choices"][0]["message"]["content"]
        st, e = d.json("POST", "/slots/0?action=restore", {"filename": "../etc/passwd"})
        assert st == 400 and "invalid session file name" in e["error"]["message"]
    finally:
        assert d.stop() == 0, d.log_tail()
