"""Stages on a GPU: 1 vs 2 (and 3) stages on cuda:0 through the CUDA plans (each stage a carve of the graph decode
and prefill plans): the same greedy tokens and the same per-layer K/V and running-state hashes, cold and resumed
through per-stage checkpoints; a stage's part through the byte format on device pages; parking resident on the
device, and moved to pinned host RAM when the pool is short, bit-exact; a held checkpoint joined with its donor's
host rows. Skips without a GPU."""
from __future__ import annotations

import io

import numpy as np
import pytest

from tests.cuda_marks import (CHAT, NEAR_TIE_LOGIT, assert_parts_at_near_tie, conversation, default_model_missing, gpu,
                              greedy)
from tests.helpers import ask, differing, long_chat, play

pytestmark = [gpu, pytest.mark.skipif(default_model_missing() is not None, reason=f"{default_model_missing()}")]

def _engines(path, splits, **kw):
    from strata.engine import Engine
    out = {}
    for s in splits:
        dev = "cuda:0" if s is None else ",".join(["cuda:0"] * (s.count(",") + 2))
        out[s] = Engine(path, n_ctx=1024, ubatch=128, device=dev, layer_split=s, prompt_cache=6, **kw)
    return out


@pytest.fixture(scope="module")
def default_runs():
    from strata.gguf.default_model import default_model_path
    engines = _engines(default_model_path(), [None, "15", "8,20"])
    runs = {s: conversation(e) for s, e in engines.items()}
    return engines, runs


def test_default_model_split_on_one_gpu_same_tokens_and_hashes(default_runs):
    engines, runs = default_runs
    from strata.backend.cuda import llama as LL
    for s, e in engines.items():
        assert all(isinstance(st.runner, LL.LlamaPlanModel) for st in e.stages), s   # every carve on the plans
        assert all(st.runner.plans for st in e.stages), s
    base = runs[None]
    # (the resend reads one token through the decode kernels: its answer equals the first one unless a near tie
    # parts them, which test_cuda_parity's exactness test checks with logprobs; here every split must match one
    # stage on both requests)
    for s in ("15", "8,20"):
        for (t, h), (tb, hb) in zip(runs[s], base):
            print(f"split {s}: tokens {t[:10]} differing hashes {differing(h, hb)[:8]}")
            assert t == tb, s
            assert h == hb, f"split {s}: {differing(h, hb)}"


def test_split_checkpoint_part_round_trip_on_device_pages(default_runs):
    from strata.memory import StatePart
    engines, _ = default_runs
    e = engines["15"]
    seq = e.seq
    e.state_reset()
    seq.forward(np.arange(1, 301, dtype=np.int32))
    h = seq.hashes()
    blobs = []
    here = seq.capture()
    for st, part in zip(e.stages, here.parts):
        buf = io.BytesIO()
        st.memory.write(part, buf)
        blobs.append(buf.getvalue())
    here.release()                               # a capture holds its pages until released
    seq.forward(np.arange(5, 40, dtype=np.int32))
    parts = [st.memory.read(io.BytesIO(b)) for st, b in zip(e.stages, blobs)]
    assert all(isinstance(p, StatePart) and not p.is_held for p in parts)
    from strata.stages.sequence import Checkpoint
    seq.restore(Checkpoint(pos=300, tokens=tuple(range(1, 301)), parts=parts))
    assert seq.hashes() == h


@pytest.fixture(scope="module")
def hybrid_path(synthetic):
    return synthetic("qwen35", n_layer=8, seed=3)


def test_hybrid_split_on_one_gpu_same_tokens_and_hashes(hybrid_path):
    engines = _engines(hybrid_path, [None, "4", "2,5"])
    runs = {s: conversation(e) for s, e in engines.items()}
    base = runs[None]
    for s in ("4", "2,5"):
        for (t, h), (tb, hb) in zip(runs[s], base):
            print(f"hybrid split {s}: tokens {t[:10]} differing hashes {differing(h, hb)[:8]}")
            assert t == tb, s
            assert h == hb, f"split {s}: {differing(h, hb)}"


def test_remote_stage_worker_on_the_same_gpu(default_runs):
    """Main (layers 0-14, the head) and a `strata worker` process (layers 15-29) on cuda:0 over loopback: the same
    greedy tokens as one process wherever the one-process run's top-2 margin is not a near tie (the main's head
    runs as backend ops, not the plan's fused head); the resend cut back across the link (a Commit), checkpoints
    saved on the worker."""
    from strata.gguf.default_model import default_model_path
    from strata.engine import Engine
    from tests.daemon import WorkerProc
    from tests.cuda_marks import NEAR_TIE_LOGIT as NEAR_TIE
    engines, runs = default_runs
    w = WorkerProc("--device", "cuda:0").start()
    e = Engine(default_model_path(), n_ctx=1024, ubatch=128, device="cuda:0", layer_split="15", prompt_cache=6,
               remote_stage=w.address)
    try:
        e.clear_checkpoints()
        t1, f1 = greedy(e, CHAT)
        t2, f2 = greedy(e, CHAT)
        # attention-only: the resend cuts the K/V back (a Commit over the link) and reads the last prompt token
        assert (f1.strata["resume_from"], f2.strata["resume_from"]) == ("none", "live")
        ref = runs[None][0][0]
        one = engines[None]
        r = one.render_chat(CHAT)

        def logits_after(prefix):
            one.clear_checkpoints()
            one.state_reset()
            return np.asarray(one.seq.forward(np.asarray(list(r.tokens) + list(prefix), np.int32)))
        from tests.cuda_marks import assert_parts_at_near_tie
        for t in (t1, t2):              # each equals one process's, or parts from it at a near tie
            assert_parts_at_near_tie(t, ref, logits_after, NEAR_TIE)
        assert e.stages[-1].status()["link"]["checkpoints_held"] > 0
    finally:
        e.close()
        w.stop()


@pytest.mark.parametrize("split", [None, "2"])
def test_resident_parking_on_one_gpu_bit_exact_and_short_pool_moves_to_ram(hybrid_path, split):
    """Parking resident on the device (--park-resident): the switch back adopts the held device pages and copies the
    running state device to device, bit-exact against the conversation played alone; with a pool of one context
    two long conversations do not fit, so the first moves to pinned host RAM (make_room) and comes back bit-exact
    from there; the hold's copy of a shared page (PagePool.rehome) runs on the device."""
    from strata.engine import Engine
    dev = "cuda:0" if split is None else "cuda:0,cuda:0"
    for n_ctx, tier in ((2048, "resident"), (512, "park")):
        kw = dict(n_ctx=n_ctx, ubatch=64, device=dev, layer_split=split)
        alone = Engine(hybrid_path, conversation_cache_mib=0, **kw)
        ref = play(alone, "rivers", 2, [], long_chat)
        e = Engine(hybrid_path, conversation_cache_mib=256, park_resident=2, **kw)
        answers: list[str] = []
        toks, _ = ask(e, long_chat("rivers", 0, answers))
        answers.append(e.detokenize(toks))
        ask(e, long_chat("ships", 0, []))
        toks, final = ask(e, long_chat("rivers", 1, answers))
        assert final.strata["resume_from"] == tier, (n_ctx, final.strata)
        assert toks == ref[1][0]
        assert e.state_hashes() == ref[1][1], differing(e.state_hashes(), ref[1][1])
        alone.close()
        e.close()


@pytest.mark.parametrize("split", [None, "2"])
def test_held_checkpoint_off_the_device_joins_its_donor_rows_bit_exact(hybrid_path, split):
    """A conversation parked in host RAM that no live sequence extends takes the checkpoints it holds off the device
    (running state only) and, at a restore, reads their K/V as the first rows of its host copy (the donor): on CUDA
    stages the joined checkpoint restores the per-layer state of the same checkpoint taken by an engine that read the
    same prompt in the same parts and kept its checkpoints whole (the donor's rows are the rows the checkpoint was
    taken beside)."""
    from strata.engine import Engine
    from tests.helpers import chat
    dev = "cuda:0" if split is None else "cuda:0,cuda:0"
    kw = dict(n_ctx=1024, ubatch=32, device=dev, layer_split=split, prompt_cache=6)
    e = Engine(hybrid_path, conversation_cache_mib=256, park_resident=0, **kw)
    ask(e, chat("rivers", 0, []), n=4)
    ask(e, [{"role": "user", "content": "Something else entirely."}], n=4)     # rivers parked; nothing extends it
    held = [c for c in e.checkpoints() if c["pins"]]
    assert held and all(c["tier"] == "ram" for c in held), held
    root = min(c["pos"] for c in held)
    (snap,) = [x.snapshot for x in e.cache._entries.values() if x.pos == root]
    joined = e.store.held.join(snap)
    assert joined is not None and all(not p.is_prefix and not p.is_held for p in joined.parts)
    e.seq.restore(joined)
    whole = Engine(hybrid_path, conversation_cache_mib=0, **kw)
    ask(whole, chat("rivers", 0, []), n=4)
    (ref,) = [x.snapshot for x in whole.cache._entries.values() if x.pos == root]
    whole.seq.restore(ref)
    assert e.state_hashes() == whole.state_hashes(), differing(e.state_hashes(), whole.state_hashes())
    e.close()
    whole.close()


@pytest.mark.parametrize("which", ["default", "hybrid"])
def test_gpu_and_cpu_stages_in_one_process(which, hybrid_path):
    """--device cuda:0,cpu (and cpu,cuda:0) with a --layer-split: the hidden states cross from the GPU to the CPU
    stage (and back), the answer is the CPU's up to a near tie at its first difference, a resumed request repeats the
    cold one's tokens and per-layer state bit for bit, and /status names both kinds."""
    from strata.engine import Engine
    from strata.gguf.default_model import default_model_path
    from strata.engine.report import device_info
    path, cut = (default_model_path(), "15") if which == "default" else (hybrid_path, "4")
    cpu = Engine(path, n_ctx=1024, ubatch=128, device="cpu", prompt_cache=6)
    (ref, _), _ = conversation(cpu)
    prompt = list(cpu.render_chat(CHAT).tokens)

    def cpu_logits_after(prefix):
        from strata.gguf.file import open_gguf
        from strata.models.registry import load_model
        m = load_model(open_gguf(str(path)))
        st = m.new_state(m.new_page_pool(1024))
        lg = m.forward(np.asarray(prompt + list(prefix), np.int32), st)
        st.release()
        return np.asarray(lg)
    for dev in ("cuda:0,cpu", "cpu,cuda:0"):
        e = Engine(path, n_ctx=1024, ubatch=128, device=dev, layer_split=cut, prompt_cache=6)
        assert [st.device for st in e.stages] == dev.split(",")
        (t1, h1), (t2, h2) = conversation(e)
        assert (t1, h1) == (t2, h2), dev
        assert device_info(e)["kind"] == "cuda+cpu"
        assert_parts_at_near_tie(t1, ref, cpu_logits_after, NEAR_TIE_LOGIT)
        e.close()
    cpu.close()
