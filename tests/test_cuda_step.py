"""The persistent decode step (native/cuda/decode_step.cu, LlamaCuda with STRATA_CUDA_STEP=1): its logits against
llama.py's eager forward (f32 activations, a different code path: one kernel per op) and against the launch-per-op
graph, at short and long contexts (one split to dozens of self-merged splits, many pages), on the default model
(Q4_1, head_dim 64, 3 query heads per KV head) and on synthetic llama models (Q4_K head_dim 128 / 2 per KV head;
Q8_0 head_dim 64 / 4 per KV head); its fused argmax against the host argmax of its own logits; the fallbacks. The
launch-per-op graph and llama.py's forward are checked against transformers in tests/test_cuda_parity.py. The
CPU-only tests check the fused-weight row ranges and the host check (tests/test_cuda_declarations.py: the cffi
declarations)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from strata.backend import cuda as C

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.cuda_marks import default_model_missing, gpu, rel_l2  # noqa: E402

# The step's logits vs the launch-per-op graph and vs llama.py's eager forward, at the first decode step after a
# shared prefill. All three round activations to int8 (q8_1) blocks before each matvec, so a 1e-7 difference in
# summation order can flip a rounding, and on the 30-layer default model that moves the logits by up to a few
# percent (measured on the H200, 5-token prompt: step vs eager 1.9e-7 with the same attention kernel, while the
# graph's first attention kernel vs the GQA kernel alone gives 1.2e-2 .. 3.2e-2); the synthetic models agree to
# ~1e-7. Later steps are compared by their greedy token: equal, or a near tie in the eager logits.
FIRST_STEP_REL_L2 = 4e-2
NEAR_TIE_LOGIT = 0.25
# The strata.synth models (weights quantized from a normal distribution): no rounding flip was seen on the H200
# (step vs graph and vs eager 5e-8 .. 1.6e-7 at 5 / 700 / 3000 positions, every step), so every step is held tight.
TIGHT_REL_L2 = {"q4": 1e-4, "q8": 1e-4}


# ------------------------------------------------------------------ CPU: declarations and weight row ranges
def _w(rows, cols):
    return SimpleNamespace(shape=(rows, cols))


def test_step_matrices_fused_and_separate():
    """Fused [q; k; v] and [gate; up] weights become row ranges of one weight; separate ones are used whole."""
    H, KV, hd, E, F = 4, 2, 64, 256, 512
    wqkv, wo, wgu, wd = _w(H * hd + 2 * KV * hd, E), _w(E, H * hd), _w(2 * F, E), _w(E, F)
    fused = SimpleNamespace(wqkv=wqkv, wo=wo, w_gate_up=wgu, w_down=wd, wq=None, wk=None, wv=None, w_gate=None,
                            w_up=None)
    m = C.step_matrices(fused, H, KV, hd, F)
    assert m["q"] == (wqkv, 0, H * hd) and m["k"] == (wqkv, H * hd, KV * hd)
    assert m["v"] == (wqkv, H * hd + KV * hd, KV * hd)
    assert m["gate"] == (wgu, 0, F) and m["up"] == (wgu, F, F)
    assert m["o"] == (wo, 0, E) and m["down"] == (wd, 0, E)
    wq, wk, wv, wg, wu = _w(H * hd, E), _w(KV * hd, E), _w(KV * hd, E), _w(F, E), _w(F, E)
    sep = SimpleNamespace(wqkv=None, wo=wo, w_gate_up=None, w_down=wd, wq=wq, wk=wk, wv=wv, w_gate=wg, w_up=wu)
    m = C.step_matrices(sep, H, KV, hd, F)
    assert m["q"] == (wq, 0, H * hd) and m["k"] == (wk, 0, KV * hd) and m["v"] == (wv, 0, KV * hd)
    assert m["gate"] == (wg, 0, F) and m["up"] == (wu, 0, F)


def _host_library():
    """The kernel library through cffi without CuPy or a GPU (strata_decode_step_check is host code), or skip."""
    if not C._lib_path().exists():
        pytest.skip(f"no kernel library at {C._lib_path()} (built by setup.py when nvcc is present)")
    try:
        return C.open_kernel_library()
    except OSError as e:
        pytest.skip(f"kernel library cannot be loaded here: {e}")


def _valid_step_args(ffi, E=256, H=4, KV=2, hd=64, F=512, V=1000, n_layer=2, t=12):
    """Host-side strata_step_args / layers of a consistent Q4_K llama shape (fake 16-byte aligned addresses)."""
    rb = lambda n_in: n_in // 256 * 144   # noqa: E731  Q4_K row bytes
    addr = iter(range(1 << 20, 1 << 40, 1 << 20))
    layers = ffi.new("strata_step_layer[]", n_layer)
    for L in layers:
        for name, rows, n_in in (("q", H * hd, E), ("k", KV * hd, E), ("v", KV * hd, E), ("o", E, H * hd),
                                 ("gate", F, E), ("up", F, E), ("down", E, F)):
            m = getattr(L, name)
            m.w, m.row_bytes, m.type, m.rows = ffi.cast("void *", next(addr)), rb(n_in), t, rows
        L.attn_norm = L.ffn_norm = ffi.cast("const float *", next(addr))
        L.k_cache = L.v_cache = ffi.cast("void *", next(addr))
    a = ffi.new("strata_step_args *")
    a.head.w, a.head.row_bytes, a.head.type, a.head.rows = ffi.cast("void *", next(addr)), rb(E), t, V
    a.out_norm = ffi.cast("const float *", next(addr))
    a.n_layer, a.n_embd, a.n_head, a.n_kv, a.head_dim, a.n_ff, a.n_vocab = n_layer, E, H, KV, hd, F, V
    a.n_rot, a.page_size, a.max_split = hd, 256, 256
    return a, layers


def test_step_check_accepts_a_valid_shape_and_sizes_its_shared_memory():
    ffi, lib = _host_library()
    a, layers = _valid_step_args(ffi)
    assert lib.strata_decode_step_check(a, layers) == 0
    n = 512                                               # max(n_embd, n_head * hd, n_ff)
    assert a.xs_bytes == (n + n // 4 + 15) // 16 * 16     # int8 values + a float2 per 32
    rb, rb_down = 256 // 256 * 144, 512 // 256 * 144      # Q4_K rows of n_embd and of n_ff (down) values
    # the largest tile of one row: down's rb_down + 32; of a RoPE pair: 2 rb + 32; of phase D, 2 rows each of gate
    # and up (+ 32 of slack each part), which wins here
    assert a.min_slot == max(rb_down + 32, 2 * rb + 32, 2 * (2 * rb + 32)) == 2 * (2 * rb + 32)
    a, layers = _valid_step_args(ffi, F=2048)             # down rows of 2048 values (1152 bytes): one row wins
    assert lib.strata_decode_step_check(a, layers) == 0 and a.min_slot == 1152 + 32
    assert a.n_slot == 0 and lib.strata_decode_step(ffi.NULL, a, 1) != 0   # no ring sized yet: not launched


def test_step_launch_refuses_arguments_changed_after_the_check():
    """A larger n_ff after the check would overrun the shared memory the check sized: launch and grid refuse."""
    ffi, lib = _host_library()
    a, layers = _valid_step_args(ffi)
    assert lib.strata_decode_step_check(a, layers) == 0
    a.n_ff = 4096
    assert lib.strata_decode_step(ffi.NULL, a, 1) != 0
    assert lib.strata_decode_step_grid(a, 2) < 0


@pytest.mark.parametrize("bad", ["head_dim", "gqa", "gate_type", "row_bytes", "misaligned", "rows", "type",
                                 "n_embd", "max_split", "no_cache", "no_heads", "n_rot", "neox"])
def test_step_check_refuses_what_it_cannot_run(bad):
    """Each shape the kernel cannot take is refused by the host check (an error code, nothing launched)."""
    ffi, lib = _host_library()
    a, layers = _valid_step_args(ffi)
    L = layers[1]
    if bad == "head_dim":
        a.head_dim = 96
    elif bad == "gqa":
        a.n_head, a.n_kv = 10, 2                          # 5 query heads per KV head (at most 4)
    elif bad == "gate_type":
        L.up.type, L.up.row_bytes = 13, 176               # Q5_K up (valid on its own) with a Q4_K gate
    elif bad == "row_bytes":
        L.down.row_bytes += 4
    elif bad == "misaligned":
        L.o.w = ffi.cast("void *", int(ffi.cast("intptr_t", L.o.w)) + 8)
    elif bad == "rows":
        L.k.rows -= 1
    elif bad == "type":
        a.head.type = 1                                   # F16: no dp4a dot
    elif bad == "n_embd":
        a.n_embd = 250
    elif bad == "max_split":
        a.max_split = 257
    elif bad == "no_cache":
        L.v_cache = ffi.NULL
    elif bad == "no_heads":
        a.n_head = 0
    elif bad == "n_rot":
        a.n_rot = -2
    elif bad == "neox":
        a.neox = 1                                        # RoPE pairs half a head apart: not one tile's rows
    assert lib.strata_decode_step_check(a, layers) != 0
    assert lib.strata_decode_step(ffi.NULL, ffi.new("strata_step_args *"), 1) != 0   # unchecked args: refused


# ------------------------------------------------------------------ GPU
def _default_path():
    why = default_model_missing()
    if why:
        pytest.skip(why)
    from strata.default_model import default_model_path
    return default_model_path()


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """name -> GGUF path: the default model (Q4_1, head_dim 64, 3 query heads per KV head); a Q4_K llama with
    head_dim 128 and 2 query heads per KV head (the benchmark's generator, small, centred weights); a Q4_0 llama
    with head_dim 128 (strata.synth: weights quantized from a real distribution, finite over long prompts); a Q8_0
    llama with head_dim 64 and 4 query heads per KV head."""
    from bench.gpu_throughput import make_synthetic_llama
    from strata import synth
    d = tmp_path_factory.mktemp("step")
    base = _default_path()
    q4k = make_synthetic_llama(str(d / "q4k.gguf"), str(base), n_embd=512, n_layer=3, n_head=4, n_kv=2, n_ff=1024,
                               seed=1, d=1e-4, dmin=7.5e-4)
    q4 = synth.write_synthetic(d / "q4.gguf", synth.preset("llama", "tiny", n_embd=512, n_layer=2, n_head=4,
                                                          n_head_kv=2, head_dim=128, n_ff=1024, qtype="Q4_0",
                                                          embd_qtype="Q8_0", tie_embeddings=False, seed=2))
    q8 = synth.write_synthetic(d / "q8.gguf", synth.preset("llama", "tiny", n_embd=256, n_layer=2, n_head=4,
                                                          n_head_kv=1, head_dim=64, n_ff=512, qtype="Q8_0",
                                                          embd_qtype="Q8_0", tie_embeddings=False, seed=3))
    return {"default": base, "q4k": Path(q4k), "q4": Path(q4), "q8": Path(q8)}


@pytest.fixture
def step_on(monkeypatch):
    monkeypatch.setattr(C, "STEP", True)


def _setup(path, n_ctx=16384):
    from strata.models.base import load_model
    model = load_model(path, C.CudaBackend())
    pool = model.new_page_pool(n_ctx)
    return model, pool


@gpu
@pytest.mark.parametrize("name,n_prompt", [("default", 5), ("default", 700), ("default", 3000), ("q4k", 5),
                                           ("q4k", 700), ("q4", 700), ("q4", 3000), ("q8", 5), ("q8", 700)])
def test_step_logits_match_eager_and_graph(model_files, name, n_prompt, step_on):
    """After a random prompt, 4 decode steps through the step, the launch-per-op graph and llama.py's forward on
    three copies of one sequence: finite logits, the first step's within FIRST_STEP_REL_L2 of both (every step's
    within TIGHT_REL_L2 on the strata.synth models), every step's greedy token the eager one's (or a near tie), the
    same state bookkeeping (700 and 3000 positions: 11 and 47 attention splits merged by the last block of each KV
    head, pages of 256; another prompt fills the first pages, so the step's page table matters)."""
    model, pool = _setup(model_files[name])
    plan = C.LlamaCuda(model, pool)
    assert plan.step, plan.step_why
    ref_plan = C.LlamaCuda(model, pool)
    ref_plan.step = False
    rng = np.random.default_rng(n_prompt)
    prompt = rng.integers(0, model.config.n_vocab, n_prompt).astype(np.int32)
    decoy = model.new_state(pool)   # another prompt in the first pages: a step that ignored its page table
    decoy_prompt = rng.integers(0, model.config.n_vocab, n_prompt).astype(np.int32)   # would read these
    states = [model.new_state(pool) for _ in range(3)]
    for st, p in [(decoy, decoy_prompt)] + [(st, prompt) for st in states]:
        for s in range(0, n_prompt, 512):
            model.forward(p[s:s + 512], st)
    tok = int(prompt[-1])
    for i in range(4):
        a = plan.decode(tok, states[0])
        b = ref_plan.decode(tok, states[1])
        c = model.forward(np.asarray([tok], np.int32), states[2])
        assert np.isfinite(a).all() and np.isfinite(c).all()
        if i == 0 or name in TIGHT_REL_L2:
            bound = TIGHT_REL_L2.get(name, FIRST_STEP_REL_L2)
            assert rel_l2(a, b) < bound, (i, rel_l2(a, b), name, n_prompt)
            assert rel_l2(a, c) < bound, (i, rel_l2(a, c), name, n_prompt)
        ta, tc = int(np.argmax(a)), int(np.argmax(c))
        assert ta == tc or c[tc] - c[ta] < NEAR_TIE_LOGIT, (i, ta, tc, c[tc] - c[ta])
        tok = tc
    assert states[0].pos == states[1].pos == states[2].pos == n_prompt + 4
    assert states[0].pos == states[2].pos


@gpu
def test_step_fused_argmax_is_argmax_of_its_logits(model_files, step_on):
    """decode_greedy (the argmax inside the step, the token fed back on the device) chooses, step after step, the
    host argmax of the logits decode() returns for the same sequence: 24 tokens, and the same final position."""
    model, pool = _setup(model_files["default"])
    plan = C.LlamaCuda(model, pool)
    assert plan.step
    sa, sb = model.new_state(pool), model.new_state(pool)
    prompt = np.arange(100, 140, dtype=np.int32)
    for st in (sa, sb):
        model.forward(prompt, st)
    greedy = plan.decode_greedy(7, 24, sa)
    host, tok = [], 7
    for _ in range(24):
        tok = int(np.argmax(plan.decode(tok, sb)))
        host.append(tok)
    assert greedy == host
    assert sa.pos == sb.pos


@gpu
def test_step_falls_back_where_it_cannot_run(model_files, monkeypatch, step_on):
    """A q8_0 KV cache and f32 activations keep the launch-per-op graph (step_why says why); without
    STRATA_CUDA_STEP=1 the step is off."""
    from strata.models.base import load_model
    q8 = load_model(model_files["default"], C.CudaBackend(kv_dtype="q8_0"))
    plan = C.LlamaCuda(q8, q8.new_page_pool(512))
    assert not plan.step and "q8_0" in plan.step_why
    del plan, q8
    model = load_model(model_files["default"], C.CudaBackend())
    monkeypatch.setattr(C, "DP4A", False)
    plan = C.LlamaCuda(model, model.new_page_pool(512))
    assert not plan.step and "f32" in plan.step_why
    monkeypatch.setattr(C, "DP4A", True)
    monkeypatch.setattr(C, "STEP", False)
    plan = C.LlamaCuda(model, model.new_page_pool(512))
    assert not plan.step and "STRATA_CUDA_STEP=1" in plan.step_why
