"""The layer split over two GPUs of one host (issue 26): `--device cuda:0,cuda:1` with `--layer-split auto` and an
explicit split gives the same greedy tokens and per-layer state hashes as one GPU, cold and resumed; A/B/A parking is
bit-exact; a session saved on two GPUs restores there and is refused on one GPU or another split; capture and
restore drain each stage on its own device. Skips without two GPUs."""
from __future__ import annotations

import pytest

from tests.cuda_marks import CHAT, conversation, default_model_missing, gpu, greedy
from tests.helpers import ask, chat, differing, play


def _n_gpus() -> int:
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001  (no CuPy, no driver)
        return 0


pytestmark = [gpu, pytest.mark.skipif(_n_gpus() < 2, reason="needs two GPUs (cuda:0 and cuda:1)"),
              pytest.mark.skipif(default_model_missing() is not None, reason=f"{default_model_missing()}")]

TWO = "cuda:0,cuda:1"


def _engine(path, device="cuda:0", split=None, **kw):
    from strata.engine import Engine
    kw.setdefault("prompt_cache", 6)
    return Engine(path, n_ctx=1024, ubatch=128, device=device, layer_split=split, **kw)


@pytest.fixture(scope="module")
def hybrid_path(synthetic):
    return synthetic("qwen35", n_layer=8, seed=3)


@pytest.mark.parametrize("which,split", [("default", "auto"), ("default", "11"), ("hybrid", "auto"), ("hybrid", "3")])
def test_two_gpus_give_one_gpus_tokens_and_hashes(which, split, default_model_path, hybrid_path):
    path = default_model_path if which == "default" else hybrid_path
    one = _engine(path)
    two = _engine(path, TWO, split)
    assert [st.device for st in two.stages] == ["cuda:0", "cuda:1"]
    base, runs = conversation(one), conversation(two)       # cold, then the same request again (resumed)
    for (t, h), (tb, hb) in zip(runs, base):
        assert t == tb, f"{which} split {split}: {t[:12]} vs {tb[:12]}"
        assert h == hb, f"{which} split {split}: {differing(h, hb)}"
    one.close()
    two.close()


def test_checkpoints_resume_on_two_gpus(hybrid_path):
    """A sibling of the last turn on the hybrid resumes from per-stage checkpoints on both cards, with the tokens and
    state one GPU gives for the same requests (the same parts read: the GDN's chunked scan splits with the parts)."""
    runs = []
    for device, split in (("cuda:0", None), (TWO, "auto")):
        e = _engine(hybrid_path, device, split)
        t1, _ = greedy(e, CHAT)
        turn = CHAT + [{"role": "assistant", "content": e.detokenize(t1)}]
        greedy(e, turn + [{"role": "user", "content": "Why?"}])
        t2, f2 = greedy(e, turn + [{"role": "user", "content": "And another?"}])      # from a checkpoint
        assert f2.strata["resume_from"] == "checkpoint" and f2.strata["resume_pos"] > 0
        runs.append((t1, t2, f2.strata["parts"], e.state_hashes()))
        e.close()
    (a1, a2, ap, ah), (b1, b2, bp, bh) = runs
    assert (b1, b2, bp) == (a1, a2, ap)
    assert bh == ah, differing(bh, ah)


@pytest.mark.parametrize("resident", [0, 2])
@pytest.mark.parametrize("which", ["default", "hybrid"])
def test_a_b_a_parking_on_two_gpus_is_bit_exact(which, resident, default_model_path, hybrid_path):
    """In pinned host RAM (park_resident=0) and resident (each card keeps its stage's pages held in its pool)."""
    path = default_model_path if which == "default" else hybrid_path
    alone = _engine(path, TWO, "auto", conversation_cache_mib=0)
    ref = play(alone, "rivers", 2, [])
    e = _engine(path, TWO, "auto", conversation_cache_mib=512, park_resident=resident)
    answers: list[str] = []
    play(e, "rivers", 1, answers)
    play(e, "mountains", 1, [])                                  # B: A is parked, both stages' parts
    toks, final = ask(e, chat("rivers", 1, answers))             # A again
    assert final.strata["resume_from"] == ("resident" if resident else "park")
    assert toks == ref[1][0] and e.state_hashes() == ref[1][1], differing(e.state_hashes(), ref[1][1])
    alone.close()
    e.close()


def test_a_session_saved_on_two_gpus_restores_there_and_is_refused_elsewhere(default_model_path, tmp_path):
    e = _engine(default_model_path, TWO, "11", slot_save_path=tmp_path, conversation_cache_mib=0)
    t1, _ = greedy(e, CHAT)
    follow = CHAT + [{"role": "assistant", "content": e.detokenize(t1)}, {"role": "user", "content": "More?"}]
    h = e.state_hashes()
    e.slot_save(0, filename="two.bin")
    t2, _ = greedy(e, follow)
    e.close()
    back = _engine(default_model_path, TWO, "11", slot_save_path=tmp_path, conversation_cache_mib=0)
    back.slot_restore(0, filename="two.bin")
    assert back.state_hashes() == h
    t2b, f2b = greedy(back, follow)
    assert t2b == t2 and f2b.strata["resume_from"] == "session"
    back.close()
    for device, split in (("cuda:0", None), (TWO, "7")):         # one GPU, or another split: refused, nothing changed
        other = _engine(default_model_path, device, split, slot_save_path=tmp_path, conversation_cache_mib=0)
        before = other.state_hashes()
        with pytest.raises(ValueError, match="another --layer-split") as exc:
            other.slot_restore(0, filename="two.bin")
        assert "\n" not in str(exc.value) and other.state_hashes() == before
        other.close()


class _RecordingCupy:
    """Stands in for a backend's CuPy module: every `cuda.Device(i).synchronize()` is logged with the device id it
    synchronizes (the current device's when i is None); everything else is CuPy's own."""

    def __init__(self, log):
        import cupy
        self._cp, self._log = cupy, log
        outer = self

        class _Cuda:
            def __getattr__(self, name):
                return getattr(cupy.cuda, name)

            def Device(self, i=None):                           # noqa: N802  (CuPy's name)
                dev = cupy.cuda.Device(i)

                class _Dev:
                    id = dev.id

                    def synchronize(self):
                        outer._log.append(dev.id)
                        dev.synchronize()

                    def __enter__(self):
                        return dev.__enter__()

                    def __exit__(self, *a):
                        return dev.__exit__(*a)
                return _Dev()
        self.cuda = _Cuda()

    def __getattr__(self, name):
        return getattr(self._cp, name)


def test_capture_and_restore_drain_each_stage_on_its_own_device(default_model_path, monkeypatch):
    """Seed #716: a stage's state is read or written only after its own card drained. Every synchronize a stage's
    backend does is logged with the device it waits for: reading the state (hashes, a capture for parking) and
    restoring it wait for cuda:0 and for cuda:1, never only for the current device."""
    e = _engine(default_model_path, TWO, "auto", conversation_cache_mib=0)
    greedy(e, CHAT)
    log: list[int] = []
    for st in e.stages:
        monkeypatch.setattr(st.backend, "cp", _RecordingCupy(log))
    h = e.state_hashes()
    assert set(log) == {0, 1}, log
    log.clear()
    snap = e.seq.capture()
    assert set(log) == {0, 1}, log
    log.clear()
    e.seq.restore(snap)
    assert set(log) == {0, 1}, log
    assert e.state_hashes() == h
    e.close()
