"""What conversation state survives a crash, a shared directory and a file replaced behind the engine's back: a
write to the disk tier or a session file killed part-way (SIGKILL, a real process) leaves nothing the next start
keeps or reads; one process holds a --conversation-cache-dir at a time (the second is refused in one line, the
first keeps its parked conversations); a save in flight in another daemon's shared --slot-save-path survives this
one's start; a disk tier file that holds another conversation is refused, the prompt read cold, never restored
wrong."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from strata.engine import Engine
from tests.daemon import ROOT, env_for_daemon
from tests.helpers import ask, chat, play

# a process that writes one file the way the engine does (save_atomic: a temporary, then a rename), says "ready"
# once part of it is written, then waits for its stdin to close before it finishes; with `tier`, the write goes
# through a DiskTier holding the directory (its lock), as a daemon's parking does
WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    from strata.cache import session
    from strata.cache.conversation import Conversation
    from strata.cache.disk import DiskTier
    directory, name, tier = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "tier"
    def body(f):
        f.write(b"x" * 4096)
        print("ready", flush=True)
        sys.stdin.read()
        return f.write(b"y" * 4096) + 4096
    if tier:
        t = DiskTier(directory, 1 << 20, write=lambda p, c: session.save_atomic(p, body), read=None)
        t.add(Conversation(tokens=np.arange(3, dtype=np.int32), parts=[]), "park")
    else:
        session.save_atomic(directory / name, body)
    print("done", flush=True)
""")


@pytest.fixture(scope="module")
def model_path(synthetic):
    return synthetic("llama")


def _writer(directory, name: str = "", tier: bool = False) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), name, "tier" if tier else "file"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env_for_daemon(), cwd=ROOT)
    assert p.stdout.readline().strip() == "ready"        # its temporary holds the first bytes now
    return p


def _files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_disk_tier_write_killed_part_way_leaves_nothing_the_next_start_keeps(model_path, tmp_path):
    """SIGKILL while a parked conversation is written to the disk tier: the temporary stays behind the dead process;
    the next engine on the directory (the dead one's lock gone with it) removes it and the earlier run's files."""
    w = _writer(tmp_path, tier=True)
    (tmp_path / "park-1-0.bin").write_bytes(b"an earlier run's file")
    w.send_signal(signal.SIGKILL)
    w.wait()
    assert any(n.startswith(".park-") and ".tmp-" in n for n in _files(tmp_path))
    e = Engine(model_path, n_ctx=256, ubatch=32, conversation_cache_mib=64, conversation_cache_dir=tmp_path,
               conversation_cache_disk_mib=64)
    try:
        assert [n for n in _files(tmp_path) if n.endswith(".bin") or ".tmp-" in n] == []
        assert e.store.disk.cleared == 2
    finally:
        e.close()


@contextlib.contextmanager
def _rivers_parked_on_disk(model, cache_dir):
    """An engine whose disk tier (in `cache_dir`) holds the "rivers" chat's first turn, parked there when "ships"
    took its place -> (engine, rivers' answers so far, rivers played alone for 2 turns: the reference); closed after."""
    ref = play(Engine(model, n_ctx=512, ubatch=32, conversation_cache_mib=0), "rivers", 2, [])
    e = Engine(model, n_ctx=512, ubatch=32, conversation_cache_mib=256, conversation_cache_dir=cache_dir,
               conversation_cache_disk_mib=64, park_resident=0)
    try:
        answers: list[str] = []
        play(e, "rivers", 1, answers)
        e.park.budget = 1                                        # what is parked goes to disk
        play(e, "ships", 1, [])
        yield e, answers, ref
    finally:
        e.close()


def test_one_process_holds_a_conversation_cache_dir(default_model_path, tmp_path):
    """A second engine (in this process or a `strata serve` started beside it) on a directory a live engine's disk
    tier holds is refused in one line naming the holder, before its model loads; the first keeps its parked
    conversation on disk and resumes it bit-exact; once it closes, the directory is free."""
    with _rivers_parked_on_disk(default_model_path, tmp_path) as (e, answers, ref):
        assert [p["tier"] for p in e.parked()] == ["disk"]
        with pytest.raises(ValueError, match=rf"in use by another strata process \(pid {os.getpid()}\)"):
            Engine(default_model_path, n_ctx=512, conversation_cache_dir=tmp_path)
        r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--socket", str(tmp_path / "s.sock"),
                            "--conversation-cache-dir", str(tmp_path)], capture_output=True, text=True,
                           env=env_for_daemon(), cwd=ROOT, timeout=120)
        assert r.returncode != 0 and "in use by another strata process" in r.stderr, r.stderr[-2000:]
        toks, final = ask(e, chat("rivers", 1, answers))
        assert final.strata["resume_from"] == "disk" and toks == ref[1][0] and e.state_hashes() == ref[1][1]
    Engine(default_model_path, n_ctx=512, conversation_cache_dir=tmp_path).close()


def test_the_conversation_cache_dir_is_never_the_session_directory(default_model_path, tmp_path):
    """--conversation-cache-dir and --slot-save-path naming one directory (a link to it too) are refused in one line
    naming both flags, before the model loads, and the session file there stays: the disk tier removes its files
    (park-*.bin, node-*.bin) at start, and a session may be saved under such a name."""
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    (tmp_path / "link").symlink_to(sessions)
    kept = sessions / "park-1-0.bin"
    kept.write_bytes(b"a session the user saved")
    with pytest.raises(ValueError, match="are the same directory"):
        Engine(default_model_path, n_ctx=512, slot_save_path=str(sessions), conversation_cache_dir=str(sessions))
    for cache_dir in (sessions, tmp_path / "link"):
        r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--socket", str(tmp_path / "s.sock"),
                            "--slot-save-path", str(sessions), "--conversation-cache-dir", str(cache_dir)],
                           capture_output=True, text=True, env=env_for_daemon(), cwd=ROOT, timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
        assert "--conversation-cache-dir and --slot-save-path are the same directory" in r.stderr, r.stderr[-2000:]
        assert kept.read_bytes() == b"a session the user saved"
    assert sorted(p.name for p in sessions.iterdir()) == ["park-1-0.bin"]


def test_a_save_in_flight_in_a_shared_slot_dir_survives_another_start(model_path, tmp_path):
    """Two daemons on one --slot-save-path: a start removes the temporaries of saves killed part-way, not the
    one another process is writing (it completes, renamed into place)."""
    w = _writer(tmp_path, "theirs.bin")
    dead = _writer(tmp_path, "dead.bin")
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    temps = [n for n in _files(tmp_path) if ".tmp-" in n]
    assert len(temps) == 2
    e = Engine(model_path, n_ctx=256, ubatch=32, slot_save_path=tmp_path)
    e.close()
    assert [n for n in _files(tmp_path) if ".tmp-" in n] == [n for n in temps if n.startswith(".theirs")]
    out, _ = w.communicate("", timeout=60)
    assert w.returncode == 0 and "done" in out
    assert _files(tmp_path) == ["theirs.bin"] and (tmp_path / "theirs.bin").stat().st_size == 8192


def test_a_disk_tier_file_holding_another_conversation_is_refused_never_restored(default_model_path, tmp_path):
    """A parked conversation's file replaced by another one's (valid, same model): refused when it is taken back,
    with a log line; the prompt is read without it and answers as the conversation played alone does."""
    with _rivers_parked_on_disk(default_model_path, tmp_path) as (e, answers, ref):
        play(e, "bread", 1, [])
        files = sorted(tmp_path.glob("park-*.bin"), key=lambda p: p.stat().st_mtime_ns)
        assert len(files) == 2                                   # rivers', then ships'
        os.replace(files[1], files[0])                           # rivers' file now holds ships
        toks, final = ask(e, chat("rivers", 1, answers))
        assert final.strata["resume_from"] != "disk"
        assert toks == ref[1][0] and e.state_hashes() == ref[1][1]


# a save on a file system that fills up, then turns read-only: run inside its own mount namespace (unshare -rm) on
# a small tmpfs; prints what each save answered
FULL_DISK = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from strata.cache import session
    from strata.engine import Engine
    from tests.helpers import ask
    d, model = Path(sys.argv[1]), sys.argv[2]
    e = Engine(model, n_ctx=256, ubatch=32, slot_save_path=d, conversation_cache_mib=0)
    ask(e, [{"role": "user", "content": "Tell me fact 1 about rivers."}])
    e.slot_save(0, filename="a.bin")
    good = (d / "a.bin").read_bytes()
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)     # the rest of the file system
    try:
        while True:
            os.write(fd, b"f" * 4096)
    except OSError:
        os.close(fd)
    out = {}
    for step in ("full", "read-only"):
        if step == "read-only":
            os.unlink(d / "filler")
            os.system(f"mount -o remount,ro {d}")
        try:
            e.slot_save(0, filename="a.bin")
            out[step] = "saved"
        except session.SessionError as x:
            out[step] = [x.status, x.code, x.param, str(x)]
        out[step + " intact"] = (d / "a.bin").read_bytes() == good and sorted(os.listdir(d)) == \\
            (["a.bin", "filler"] if step == "full" else ["a.bin"])
    print(json.dumps(out))
""")


def test_a_save_the_file_system_refuses_is_a_server_error_and_keeps_the_old_file(model_path, tmp_path):
    """Disk full (a small tmpfs), then read-only: the save answers 507 insufficient_storage, then 500 storage_error
    (the server's fault, no request field named), in one line; the file it would have replaced is intact and no
    temporary is left."""
    d = tmp_path / "slots"
    d.mkdir()
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here (unshare -rm: {probe.stderr.decode(errors='replace').strip()})")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=4m tmpfs "{d}" && exec "$@"', "sh",
                        sys.executable, "-c", FULL_DISK, str(d), str(model_path)], capture_output=True, text=True,
                       env=env_for_daemon(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["full"][:3] == [507, "insufficient_storage", None] and "No space left" in out["full"][3]
    assert out["read-only"][:3] == [500, "storage_error", None] and "Read-only" in out["read-only"][3]
    assert out["full intact"] and out["read-only intact"]
    assert all("\n" not in out[k][3] for k in ("full", "read-only"))


def test_a_worker_killed_with_parked_parts_on_it_is_re_read_never_restored_wrong(default_model_path, tmp_path):
    """A worker (a real process) SIGKILLed while one conversation is parked resident (its part an id in the
    worker's store) and one in host RAM: while it is gone each request is refused naming the reason once; once a
    fresh worker is up on its port, both conversations answer as they do played alone (the resident one read again,
    the one in RAM restored from the main's copy of the worker's part). Killed and replaced again while idle:
    saving the live conversation (its worker part gone with the old worker) is refused and writes no file."""
    from strata.errors import Refused, Unavailable
    from tests.daemon import WorkerProc
    alone = Engine(default_model_path, n_ctx=512, ubatch=32, conversation_cache_mib=0)
    refs = {t: play(alone, t, 2, []) for t in ("rivers", "ships")}
    workers = [WorkerProc("--model", str(default_model_path)).start()]
    e = Engine(default_model_path, n_ctx=512, ubatch=32, layer_split="15", remote_stage=workers[0].address,
               prompt_cache=4, conversation_cache_mib=64, park_resident=1, slot_save_path=tmp_path)
    stage = e.stages[-1]

    def replace_worker():
        workers[-1].stop(signal.SIGKILL)
        workers.append(WorkerProc("--model", str(default_model_path), port=workers[0].port).start())

    def link_back(epoch: int) -> None:
        up = threading.Event()
        for _ in range(600):          # the link's pings notice the dead worker, then it reconnects (backoff)
            if stage.epoch > epoch and stage.unavailable() is None:
                up.set()
                break
            up.wait(0.1)
        assert up.is_set(), stage.unavailable()
    try:
        answers = {t: [] for t in ("rivers", "ships", "bread")}
        for t in answers:
            play(e, t, 1, answers[t])
        assert sorted(p["tier"] for p in e.parked()) == ["device", "ram"]
        epoch = stage.epoch
        workers[-1].stop(signal.SIGKILL)
        for _ in range(2):
            with pytest.raises(Unavailable) as exc:
                ask(e, chat("rivers", 1, answers["rivers"]))
            assert str(exc.value).count("is unreachable") <= 1, str(exc.value)
        workers.append(WorkerProc("--model", str(default_model_path), port=workers[0].port).start())
        link_back(epoch)
        for t in ("rivers", "ships"):
            toks, final = ask(e, chat(t, 1, answers[t]))
            assert toks == refs[t][1][0], t
        epoch = stage.epoch
        replace_worker()
        link_back(epoch)
        with pytest.raises(Refused, match="conversation is gone: a remote stage's worker restarted"):
            e.slot_save(0, "ships.bin")
        assert not (tmp_path / "ships.bin").exists()
    finally:
        e.close()
        for w in workers:
            w.stop()
