"""The expert tier on the GPU (strata/backend/cuda/moe_tier.py over strata/moe/store.py): greedy tokens identical with
the tier on and with every expert resident, at budgets from none to half of the experts, with rounds firing every
other token, prefills long enough to borrow slots while swaps are in flight, live continuations, and a copy rate
capped near zero; the engine with the flags on one and two stages; "auto" with nothing that fits; the numbers the
tier reports. Skipped with the reason without CuPy, a GPU or the kernel library.

Exactness here is bit-for-bit: a resident expert's slot and its pinned home copy hold the same GGUF bytes, the
kernels read either through the table, and nothing else in the computation changes."""
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.gguf import synth
from strata.backend import cuda as C
from strata.backend.cuda import moe_tier as T
from strata.backend.cuda import qwen35 as Q
from strata.models.registry import load_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cuda_marks import CUDA_WHY as _why  # noqa: E402
from tests.cuda_marks import default_model_missing, gpu  # noqa: E402

_no_model = default_model_missing()


def _spec(**kw):
    base = {"n_embd": 128, "n_layer": 8, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 256, "head_k_dim": 64,
            "head_v_dim": 64, "n_k_heads": 2, "n_v_heads": 4, "n_mtp": 0, "qtype": "Q8_0", "embd_qtype": "Q8_0",
            "n_expert": 32, "n_expert_used": 4, "n_ff_exp": 64, "n_ff_shexp": 96, "seed": 11}
    base.update(kw)
    return synth.preset("qwen35moe", "tiny", **base)


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    if _why is not None:
        pytest.skip(f"CUDA backend unavailable: {_why}")
    if _no_model is not None:
        pytest.skip(_no_model)
    return synth.write_synthetic(tmp_path_factory.mktemp("tier") / "qwen35moe.gguf", _spec())


def _run(path, settings, prompt, more, n_gen=40):
    """Prefill `prompt`, decode n_gen greedy tokens one forward at a time, read `more` as a live continuation, decode
    n_gen more; returns (tokens, the tier's status or None)."""
    be = C.CudaBackend()
    be.moe_tier = settings
    m = load_model(path, be)
    g = Q.Qwen35GraphModel(m)
    pool = m.new_page_pool(1024, n_seq=2)
    st = m.new_state(pool)
    out = []
    for part in (prompt, more):
        lg = g.forward(part, st)
        t = int(np.argmax(lg))
        for _ in range(n_gen):
            out.append(t)
            t = int(np.argmax(g.forward(np.array([t], np.int32), st)))
    tier = T.tier_of(m)
    status = tier.status() if tier is not None else None
    st.release()
    return out, status


@gpu
def test_tier_tokens_identical_to_all_resident(moe_file):
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 49152, 90).astype(np.int32)
    more = rng.integers(0, 49152, 70).astype(np.int32)
    ref, none = _run(moe_file, None, prompt, more)
    assert none is None
    for mib, frac in (("0", 1.0), ("1", 1.0), ("2", 1.0), ("4", 1.0), ("2", 1e-6)):
        s = T.TierSettings(vram_mib=mib, every=2, swaps=8, pcie_frac=frac, lend_rows=16)
        got, status = _run(moe_file, s, prompt, more)
        layers = status["layers"]
        print(f"--moe-vram-mib {mib} --pcie-frac {frac}: slots {status['slots']} resident {status['resident']} "
              f"hit rate {status['hit_rate']} swaps {status['swaps']} staged "
              f"{sum(L['staged'] for L in layers)} bytes moved {status['bytes_moved']}")
        assert got == ref, (mib, frac, got[:12], ref[:12])
        seen = sum(L["hits"] + L["misses"] for L in layers)
        assert seen > 0 and len(layers) == 8
        if mib == "0":
            assert status["slots"] == 0 and status["hit_rate"] == 0.0
        elif frac == 1.0:
            assert status["swaps"] > 0 and status["hit_rate"] > 0
            assert sum(L["staged"] for L in layers) > 0        # the prefills borrowed slots


@gpu
def test_static_placement_same_tokens(moe_file):
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 49152, 40).astype(np.int32)
    more = rng.integers(0, 49152, 20).astype(np.int32)
    ref, _ = _run(moe_file, None, prompt, more, 16)
    got, status = _run(moe_file, T.TierSettings(vram_mib="1", static=True, every=1), prompt, more, 16)
    assert got == ref and status["swaps"] == 0 and status["static"]


@gpu
def test_auto_with_nothing_that_fits_is_one_line(moe_file, monkeypatch):
    monkeypatch.setattr(T, "AUTO_RESERVE", 1 << 50)
    be = C.CudaBackend()
    be.moe_tier = T.TierSettings(vram_mib="auto")
    m = load_model(moe_file, be)
    with pytest.raises(ValueError, match=r"--moe-vram-mib auto: .* not one expert .* fits"):
        Q.Qwen35GraphModel(m).plan(m.new_page_pool(256, n_seq=1))


@gpu
def test_engine_with_the_tier_on_one_and_two_stages(moe_file):
    from strata.engine import Engine, GenerationRequest, TokenEvent
    toks = [int(t) for t in np.random.default_rng(6).integers(0, 49152, 80)]
    got = {}
    for name, kw in (("resident", {}), ("tier", {"moe_vram_mib": "1", "adapt_every": 2, "adapt_swaps": 8}),
                     ("tier 2 stages", {"moe_vram_mib": "1", "adapt_every": 2, "device": "cuda:0,cuda:0",
                                        "layer_split": "4"})):
        e = Engine(moe_file, n_ctx=1024, ubatch=128, **{"device": "cuda:0", **kw})
        out = []
        for turn in range(2):
            evs = list(e.generate(GenerationRequest(prompt_tokens=toks + out, max_tokens=24, ignore_eos=True)))
            out += [ev.token_id for ev in evs if isinstance(ev, TokenEvent)]
        got[name] = out
        moe = e.stages[0].status()["moe"]
        if name != "resident":
            t = moe["tier"]
            assert t["slots"] > 0 and t["swaps"] > 0 and 0 < t["hit_rate"] <= 1 and t["pinned_bytes"] > 0
            assert t["h2d_bytes_per_s"] > 0 and len(t["layers"]) == 8   # one model per device: every layer
        else:
            assert "tier" not in moe
    print({k: v[:8] for k, v in got.items()})
    assert got["tier"] == got["resident"] == got["tier 2 stages"]


@gpu
def test_daemon_reports_the_tier_in_status_metrics_and_stratactl(moe_file, tmp_path):
    """`strata serve --moe-vram-mib 1` on the GPU: after a chat, /status shows per stage and layer the resident
    experts, hit rate, swaps and bytes moved, /metrics the same counters, `stratactl status` a line per layer; a bad
    flag value is a one-line usage error."""
    import subprocess
    from tests.daemon import Daemon, env_for_daemon
    bad = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--model", str(moe_file), "--device",
                          "cuda:0", "--moe-vram-mib", "lots"], capture_output=True, text=True, env=env_for_daemon(),
                         cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--moe-vram-mib must be 'auto' or a whole number" in bad.stderr
    d = Daemon(tmp_path, "--model", str(moe_file), "--device", "cuda:0", "--moe-vram-mib", "1", "--adapt-every", "2",
               "--adapt-swaps", "8").start()
    try:
        st, body = d.json("POST", "/v1/completions", {"prompt": "the expert tier " * 30, "max_tokens": 32,
                                                      "temperature": 0})
        assert st == 200, body
        st, s = d.json("GET", "/status")
        tier = s["stages"][0]["moe"]["tier"]
        assert tier["slots"] > 0 and tier["swaps"] > 0 and len(tier["layers"]) == 8
        assert all({"resident", "hit_rate", "swaps", "bytes_moved"} <= set(L) for L in tier["layers"])
        assert d.metric("strata_moe_expert_swaps_total") >= tier["swaps"] > 0
        assert d.metric("strata_moe_expert_hits_total") + d.metric("strata_moe_expert_misses_total") > 0
        assert d.metric("strata_moe_resident_experts") > 0
        out = subprocess.run([sys.executable, "-m", "strata.cli.ctl", "--socket", d.sock, "status"],
                             capture_output=True, text=True, env=env_for_daemon(), cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "expert tier:" in out.stdout and "stage 0 layer 7" in out.stdout, out.stdout
    finally:
        d.stop()
