"""Session files (--slot-save-path; strata/cache/session.py): save / restore round trips on one and two stages (a
hybrid conversation, Gated DeltaNet or Mamba2, resumes from its saved checkpoints afterwards), golden files of format versions 1 and 3, and
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


@pytest.mark.parametrize("which,split", [("hybrid", None), ("hybrid", "2"), ("mamba", "3")])
def test_save_restart_restore_continue(which, model_path, synthetic, tmp_path, split):
    if which == "mamba":                                             # nemotron_h: Mamba2 running state
        model_path = synthetic("nemotron_h", seed=31)
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
    # the refusal stays one short line whatever the request sent: a long name is cut, a non-string named by its
    # JSON type (both were echoed whole: a 20,000-item array gave a 129 KB message)
    for bad, needle in (("a/" * 50_000, "(100000 characters)"), ("\ud800" * 10_000, "(10000 characters)"),
                        (list(range(20_000)), "got an array"), ({"a": "b" * 10_000}, "got an object"),
                        (None, "got null"), (True, "got a boolean")):
        with pytest.raises(ValueError) as exc:
            e.slot_restore(0, filename=bad)
        assert needle in str(exc.value) and len(str(exc.value)) < 300, str(exc.value)[:300]
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


def _with_header(data: bytes, **changes) -> bytes:
    """A session file with header fields changed and its checksum recomputed."""
    import zlib
    hlen = int.from_bytes(data[12:16], "little")
    h = dict(json.loads(data[20:20 + hlen]), **changes)
    head = json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
    return data[:12] + len(head).to_bytes(4, "little") + zlib.crc32(head).to_bytes(4, "little") + head \
        + data[20 + hlen:]


def _with_token(data: bytes, i: int, value: int) -> bytes:
    """A session file whose i-th token id is `value`, its checksum recomputed."""
    import zlib
    hlen = int.from_bytes(data[12:16], "little")
    n = json.loads(data[20:20 + hlen])["n_tokens"]
    toks = bytearray(data[20 + hlen:20 + hlen + 4 * n])
    toks[4 * i:4 * i + 4] = value.to_bytes(4, "little", signed=True)
    return data[:20 + hlen] + bytes(toks) + zlib.crc32(toks).to_bytes(4, "little") + data[20 + hlen + 4 * n + 4:]


def test_valid_checksums_with_bad_fields_are_refused(model_path, tmp_path, saved):
    """A file whose checksums are right but whose fields are not: each header field of the wrong type, a token id
    outside the vocabulary — refused in one line, the live conversation unchanged."""
    _, data = saved
    n_vocab = _engine(model_path, tmp_path).n_vocab
    hlen = int.from_bytes(data[12:16], "little")
    cps = json.loads(data[20:20 + hlen])["checkpoints"]
    for change, match in [({"live_ok": "no"}, "bad live_ok 'no'"), ({"live_ok": 1}, "bad live_ok 1"),
                          ({"live_ok": None}, "bad live_ok None"), ({"fingerprint": 7}, "from another model"),
                          ({"n_tokens": True}, "bad token count"), ({"n_tokens": 3.0}, "bad token count"),
                          ({"carves": "0..4"}, "bad stage carves"),
                          ({"checkpoints": [[c[0], "bogus"] for c in cps] or [[1, "bogus"]]}, "bad checkpoint list"),
                          ({"checkpoints": [[c[0], 7] for c in cps] or [[1, 7]]}, "bad checkpoint list")]:
        _refused(model_path, tmp_path, _with_header(data, **change), match)
    for at, value in ((0, n_vocab), (3, -1), (-1, 2 ** 31 - 1)):
        n = json.loads(data[20:20 + hlen])["n_tokens"]
        _refused(model_path, tmp_path, _with_token(data, at % n, value),
                 f"holds token id {value}, outside this model's vocabulary \\[0, {n_vocab}\\)")
    _ENGINES.clear()


def test_save_names_keep_to_the_portable_set_and_old_names_still_restore(model_path, tmp_path, saved):
    """New session files are named with ASCII letters, digits, '.', '_', '-' (no leading dot, no device name); a
    file already there under another name restores by its exact name."""
    _, data = saved
    e = _engine(model_path, tmp_path, "2")
    ask(e, CHAT)
    for bad in ("a~b", "$HOME", "CON", "con.bin", "Lpt1", "a b.bin", "caf\u00e9.bin", "x\u202eniB.exe",
                "x\u0085y", "x\u200by", "\uff46\uff0f\uff47", "a\u2215b", "-\u00a0", "x\u2028y", "\u202a"):
        with pytest.raises(ValueError, match="ASCII letters, digits") as exc:
            e.slot_save(0, filename=bad)
        assert "\n" not in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == []
    for good in ("ok-name_1.bin", "A.B.c", "0", "-x"):
        assert e.slot_save(0, filename=good)["n_saved"] > 0
    (tmp_path / "caf\u00e9 \u00bd.bin").write_bytes(data)           # written by an older build, or by hand
    assert e.slot_restore(0, filename="caf\u00e9 \u00bd.bin")["n_restored"] > 0


def test_a_save_writes_through_no_planted_temporary(model_path, tmp_path):
    """The temporary a save writes is named unpredictably and created exclusively without following a link: a
    link planted under the old predictable name writes nothing outside; the file is private (0600), nothing
    is left beside it."""
    d = tmp_path / "slots"
    d.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    (d / f".x.bin.tmp-{os.getpid()}").symlink_to(outside)
    e = _engine(model_path, d)
    ask(e, CHAT)
    assert e.slot_save(0, filename="x.bin")["n_saved"] > 0
    assert outside.read_bytes() == b"keep me"
    assert sorted(os.listdir(d)) == sorted([".x.bin.tmp-%d" % os.getpid(), "x.bin"])
    assert (d / "x.bin").stat().st_mode & 0o777 == 0o600 and not (d / "x.bin").is_symlink()
    (d / "y.bin").symlink_to(outside)                 # a link at the target is replaced by the rename, not followed
    with pytest.raises(ValueError, match="symbolic link"):
        e.slot_save(0, filename="y.bin")               # (refused by the name check before that)
    assert outside.read_bytes() == b"keep me"


def test_a_save_past_the_quota_is_refused_and_writes_nothing(model_path, tmp_path):
    """--slot-quota-mib bounds the regular files in the session directory: a save that would pass it is refused
    (QuotaExceeded: a Refused naming the quota, no field at fault) with no file or temporary left and the files
    there untouched; the file a save replaces does not count against it; a stale temporary of an interrupted save
    is removed when the engine starts; /status reports the directory's use."""
    free = tmp_path / "free"
    free.mkdir()
    e = _engine(model_path, free)
    ask(e, CHAT)
    size = e.slot_save(0, filename="probe.bin")["n_written"]
    assert size == os.path.getsize(free / "probe.bin") and size < (1 << 20)
    d = tmp_path / "slots"
    d.mkdir()
    (d / ".old.bin.tmp-0123456789abcdef").write_bytes(b"torn")       # an interrupted save's temporary
    (d / "notes.txt").write_bytes(b"n" * ((1 << 20) - size + 1))      # one byte too many for a save to fit
    e = Engine(model_path, n_ctx=512, ubatch=32, slot_save_path=d, conversation_cache_mib=0, slot_quota_mib=1)
    assert sorted(os.listdir(d)) == ["notes.txt"]
    ask(e, CHAT)
    before = e.state_hashes()
    with pytest.raises(session.QuotaExceeded, match=r"quota of 1.0 MiB \(--slot-quota-mib\)") as exc:
        e.slot_save(0, filename="x.bin")
    assert "\n" not in str(exc.value) and exc.value.status == 400 and exc.value.param is None
    assert exc.value.code == "slot_quota_exceeded" and "nothing was written" in str(exc.value)
    assert sorted(os.listdir(d)) == ["notes.txt"] and e.state_hashes() == before
    assert e.status()["session_files"] == {"bytes": (1 << 20) - size + 1, "files": 1, "quota_bytes": 1 << 20}
    (d / "notes.txt").write_bytes(b"n" * ((1 << 20) - size))          # now it fits exactly
    assert e.slot_save(0, filename="x.bin")["n_written"] == size
    assert e.slot_save(0, filename="x.bin")["n_written"] == size     # replacing itself: its own bytes are room
    with pytest.raises(session.QuotaExceeded):
        e.slot_save(0, filename="y.bin")
    assert sorted(os.listdir(d)) == ["notes.txt", "x.bin"]
    assert e.status()["session_files"] == {"bytes": 1 << 20, "files": 2, "quota_bytes": 1 << 20}
    e2 = _engine(model_path, d)
    assert e2.slot_restore(0, filename="x.bin")["n_restored"] > 0 and e2.state_hashes() == before
    assert e2.status()["session_files"]["quota_bytes"] is None


def test_session_refusals_name_the_filename_field(model_path, tmp_path):
    """A refusal about the file a request names carries param "filename" (what serve answers as the error's param);
    the quota and a missing --slot-save-path name no field."""
    from strata.errors import Refused
    e = _engine(model_path, tmp_path)
    ask(e, CHAT)
    for call, name in ((e.slot_save, "../x.bin"), (e.slot_save, 7), (e.slot_save, "a b.bin"),
                       (e.slot_restore, "missing.bin"), (e.slot_restore, "")):
        with pytest.raises(Refused) as exc:
            call(0, filename=name)
        assert exc.value.param == "filename" and exc.value.status == 400, (name, exc.value)
    (tmp_path / "junk.bin").write_bytes(b"not a session")
    with pytest.raises(Refused) as exc:
        e.slot_restore(0, filename="junk.bin")
    assert exc.value.param == "filename"
    with pytest.raises(Refused) as exc:
        Engine(model_path, n_ctx=256, conversation_cache_mib=0).slot_save(0, filename="x.bin")
    assert exc.value.param is None and "--slot-save-path" in str(exc.value)


def test_open_session_reads_only_regular_files(tmp_path):
    """open_session opens relative to the directory without following a link and without blocking: a link, a FIFO
    (no writer: an open that blocks would hang the engine thread) and a directory are refused before a byte is
    read."""
    (tmp_path / "real.bin").write_bytes(b"SECRET")
    (tmp_path / "link.bin").symlink_to(tmp_path / "real.bin")
    os.mkfifo(tmp_path / "fifo.bin")
    (tmp_path / "dir.bin").mkdir()
    for name, match in (("link.bin", "is a symbolic link"), ("fifo.bin", "not a regular file"),
                        ("dir.bin", "not a regular file"), ("none.bin", "does not exist")):
        with pytest.raises(session.SessionError, match=match) as exc:
            session.open_session(tmp_path / name)
        assert "SECRET" not in str(exc.value) and str(tmp_path) not in str(exc.value)
    with session.open_session(tmp_path / "real.bin") as f:
        assert f.read() == b"SECRET"


_SWAPPER = """
import os, sys, time
d, secret = sys.argv[1], sys.argv[2]
i = 0
while not os.path.exists(os.path.join(d, "stop")):
    tmp = os.path.join(d, f"swap-{i % 3}")
    if i % 3 == 0:
        os.link(os.path.join(d, "good.bin"), tmp)
    elif i % 3 == 1:
        os.symlink(secret, tmp)
    else:
        os.link(os.path.join(d, "fifo-src"), tmp)
    os.replace(tmp, os.path.join(d, "victim.bin"))
    if i == 0:
        open(os.path.join(d, "started"), "w").close()
    i += 1
"""


def test_a_file_swapped_under_restores_is_never_read_through_a_link_nor_blocks_on_a_fifo(model_path, tmp_path):
    """While restores run, another process swaps the file for a link to a file outside the directory, for a FIFO
    and back: no restore reads the outside file (its bytes never show in an error), none blocks, each one either
    restores the saved conversation or is refused in one line naming no path."""
    import subprocess
    import sys
    import threading
    import time
    d = tmp_path / "slots"
    d.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"SECRETXX" * 64)
    e = _engine(model_path, d)
    ask(e, CHAT)
    n_saved = e.slot_save(0, filename="good.bin")["n_saved"]
    os.mkfifo(d / "fifo-src")
    outcomes: list = []

    def restores():
        for _ in range(3000):
            try:
                outcomes.append(e.slot_restore(0, filename="victim.bin")["n_restored"])
            except ValueError as err:
                outcomes.append(str(err))

    swapper = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(d), str(secret)])
    try:
        deadline = time.monotonic() + 60
        while not (d / "started").exists():
            assert swapper.poll() is None and time.monotonic() < deadline, "the swapper did not start"
            time.sleep(0.01)
        r = threading.Thread(target=restores, daemon=True)
        r.start()
        r.join(120)
        hung = r.is_alive()
    finally:
        (d / "stop").touch()
        swapper.wait(30)
    if hung:                                         # release a reader blocked on the FIFO, then fail
        os.close(os.open(d / "fifo-src", os.O_WRONLY | os.O_NONBLOCK))
    assert not hung, "a restore blocked on a FIFO"
    assert swapper.returncode == 0
    errors = [o for o in outcomes if isinstance(o, str)]
    assert len(outcomes) == 3000
    assert all(o == n_saved for o in outcomes if not isinstance(o, str))
    assert not [m for m in errors if "SECRET" in m or "\n" in m or str(tmp_path) in m], \
        [m for m in errors if "SECRET" in m or "\n" in m or str(tmp_path) in m][:5]
    assert secret.read_bytes() == b"SECRETXX" * 64


def test_the_disk_tier_reads_its_files_under_the_same_rules(model_path, tmp_path):
    """A parked conversation's file on disk (--conversation-cache-dir) swapped for a link or a FIFO: refused in
    one line when it is taken back, nothing of the outside file read."""
    d = tmp_path / "park"
    d.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"SECRETXX" * 64)
    e = Engine(model_path, n_ctx=512, ubatch=32, conversation_cache_mib=64, conversation_cache_dir=d,
               conversation_cache_disk_mib=64)
    ask(e, CHAT)
    disk = e.store.disk
    for swap, match in ((lambda p: p.symlink_to(secret), "symbolic link"), (lambda p: os.mkfifo(p),
                                                                             "not a regular file")):
        node = disk.add(e.store.capture(e.seq), "park")
        path = node.path
        assert path is not None and path.is_file()
        path.unlink()
        swap(path)
        with pytest.raises(session.SessionError, match=match) as exc:
            disk.read(node)
        assert "SECRET" not in str(exc.value)
    assert secret.read_bytes() == b"SECRETXX" * 64


def test_restore_parks_the_conversation_it_replaces(model_path, tmp_path):
    e = Engine(model_path, n_ctx=512, ubatch=32, slot_save_path=tmp_path, conversation_cache_mib=256,
               prompt_cache=2)
    ask(e, CHAT)
    e.slot_save(0, filename="a.bin")
    b, _ = ask(e, BRANCH)                                          # CHAT is parked; BRANCH live
    e.slot_restore(0, filename="a.bin")                            # BRANCH parked, the parked CHAT dropped
    assert [p["tokens"] for p in e.parked()] == [len(e.render_chat(BRANCH).tokens) + len(b) - 1]   # the last token is not read yet
    # this engine's --prompt-cache applies to the checkpoints no parked conversation holds
    assert len([c for c in e.checkpoints() if not c["pins"]]) <= 2
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
                            fuzz_engine.n_ctx, fuzz_engine.n_vocab)
    except ValueError as e:
        assert "\n" not in str(e)
        return
    assert conv.pos > 0 and 0 <= int(conv.tokens.min()) and int(conv.tokens.max()) < fuzz_engine.n_vocab
    assert type(conv.live_ok) is bool


_JUNK = hs.recursive(hs.none() | hs.booleans() | hs.integers(-2 ** 40, 2 ** 40) | hs.floats() | hs.text(max_size=8),
                     lambda kids: hs.lists(kids, max_size=3) | hs.dictionaries(hs.text(max_size=4), kids, max_size=3),
                     max_leaves=8)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(fields=hs.dictionaries(hs.sampled_from(["fingerprint", "n_tokens", "live_ok", "checkpoints", "carves", "x"]),
                              _JUNK, min_size=1, max_size=3),
       tokens=hs.lists(hs.tuples(hs.integers(0, 10 ** 6), hs.integers(-2 ** 31, 2 ** 31 - 1)), max_size=3))
def test_crafted_files_with_valid_checksums(fuzz_engine, saved, fields, tokens):
    """Header fields of any JSON value and token ids of any int32, every checksum recomputed: each file is refused
    with a one-line SessionError, or read with the types and ranges the engine relies on."""
    _, data = saved
    hlen = int.from_bytes(data[12:16], "little")
    n = json.loads(data[20:20 + hlen])["n_tokens"]
    for i, v in tokens:
        data = _with_token(data, i % n, v)
    data = _with_header(data, **fields)
    try:
        conv = session.read(io.BytesIO(data), fuzz_engine.file.fingerprint(), fuzz_engine.stages, fuzz_engine.n_ctx,
                            fuzz_engine.n_vocab)
    except session.SessionError as e:
        assert "\n" not in str(e)
        return
    assert type(conv.live_ok) is bool and 0 < conv.pos < fuzz_engine.n_ctx
    assert 0 <= int(conv.tokens.min()) and int(conv.tokens.max()) < fuzz_engine.n_vocab


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


def test_empty_slot_refusal_names_its_slot(model_path, tmp_path):
    e = Engine(model_path, n_ctx=256, ubatch=32, parallel=2, slot_save_path=tmp_path, conversation_cache_mib=0)
    with pytest.raises(ValueError, match="slot 1 holds no conversation"):
        e.slot_save(1, filename="empty.bin")
    assert not (tmp_path / "empty.bin").exists()
