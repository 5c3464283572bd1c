"""Parity of strata/models/llama.py on the CUDA backend (eager prefill, CUDA-graph decode plan LlamaCuda) and of the
engine with device cuda, on the default model, against an independent float32 reference: Hugging Face transformers
loading the same GGUF (weights dequantized by gguf-py); plus the checkpoint checks of tests/checkpoint_checks.py run on
a cuda engine. Skipped without a GPU."""

import numpy as np
import pytest

from strata.backend import cuda as C
from strata.backend.cuda import library as K
from strata.backend.cuda import llama as LL
from strata.backend.cuda import settings as S
from tests.cuda_marks import NEAR_TIE_LOGIT

_why = C.unavailable_reason()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"CUDA backend unavailable: {_why}")

# Tolerance: our prefill uses f16 GEMM operands and an f16 KV cache; the reference is float32 throughout.
LOGITS_REL_L2 = 2e-2          # ||ours - ref|| / ||ref|| over all positions
# The logits of the 64th decode step: every step's matvecs read int8 (q8_1) activations and every step's K/V row is
# written from them, so the error grows along the run. Measured on the H200 (session 3): 2.65e-2 with the first
# decode attention kernel below 4096 positions (the default, STRATA_CUDA_ATTN=auto), < 2e-2 with the GQA kernel, and
# < 2e-2 with f32 activations (STRATA_CUDA_DP4A=0), all with the same 64 tokens as transformers.
DECODE_LOGITS_REL_L2 = 4e-2 if S.DP4A else LOGITS_REL_L2
N_GREEDY = 64


@pytest.fixture(scope="module")
def model_path(default_model_path):
    if not default_model_path.is_file():
        pytest.skip(f"default model not at {default_model_path}")
    return default_model_path


@pytest.fixture(scope="module")
def hf(model_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    torch.backends.cuda.matmul.allow_tf32 = False
    tok = transformers.AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                          torch_dtype=torch.float32)
    m.eval()
    return tok, m


@pytest.fixture(scope="module")
def prompt_ids(hf):
    tok, _ = hf
    msgs = [{"role": "user", "content": "Write a short poem about the sea, then explain what a KV cache is."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def hf_logits(m, ids):
    import torch
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].double().numpy()


def _cuda_model(model_path):
    from strata.models.registry import load_model
    return load_model(model_path, C.CudaBackend())


def _prefill(model, state, ids, ubatch, all_logits=False):
    out = []
    for s in range(0, len(ids), ubatch):
        out.append(model.forward(np.asarray(ids[s:s + ubatch], np.int32), state, all_logits=all_logits))
    return np.concatenate(out, axis=0) if all_logits else out[-1]


def assert_greedy_matches(m, prompt, got, ref, near_tie=None, min_index=8):
    """got == ref token for token (as far as ref goes), or the first difference (at index >= min_index) is a near
    tie in the reference (logit gap < near_tie, default NEAR_TIE_LOGIT)."""
    near_tie = NEAR_TIE_LOGIT if near_tie is None else near_tie
    n = min(len(got), len(ref))
    if got[:n] == ref[:n]:
        return
    i = next(i for i in range(n) if got[i] != ref[i])
    lg = hf_logits(m, list(prompt) + list(ref[:i]))[-1]
    gap = lg[ref[i]] - lg[got[i]]
    print(f"greedy runs part at token {i}: {got[i]} vs reference {ref[i]}, reference logit gap {gap:.3f}")
    assert i >= min_index and gap < near_tie, f"token {i}: {got[i]} vs {ref[i]} is not a near tie (gap {gap:.3f})"


def test_prefill_logits_match_reference(model_path, hf, prompt_ids):
    _, m = hf
    ref = hf_logits(m, prompt_ids)
    model = _cuda_model(model_path)
    pool = model.new_page_pool(1024)
    assert isinstance(pool, C.CudaPagePool)
    st = model.new_state(pool)
    got = _prefill(model, st, prompt_ids, 16, all_logits=True).astype(np.float64)   # several ubatches + pages
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"prefill logits rel L2 {err:.2e}, max abs {np.abs(got - ref).max():.3e}")
    assert np.isfinite(got).all()
    assert err < LOGITS_REL_L2
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.95
    assert st.pos == len(prompt_ids) and st.nbytes() > 0


def test_plan_prefill_matches_reference(model_path, hf, prompt_ids):
    """LlamaCuda.prefill (what the engine's prefill runs on CUDA: fused launches, FA2 attention, f16 GEMMs adding
    the residual through beta = 1) against transformers: all positions in 24-token ubatches, and the last-token
    form the engine uses."""
    _, m = hf
    ref = hf_logits(m, prompt_ids)
    model = _cuda_model(model_path)
    pool = model.new_page_pool(1024)
    fast = model.backend.fast_path(model)
    assert fast.plan(pool).prefill_supported()
    st = model.new_state(pool)
    got = _prefill(fast, st, prompt_ids, 24, all_logits=True).astype(np.float64)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"plan prefill logits rel L2 {err:.2e}")
    assert np.isfinite(got).all() and err < LOGITS_REL_L2
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.95
    assert st.pos == len(prompt_ids) == st.kv.length
    st2 = model.new_state(pool)
    last = _prefill(fast, st2, prompt_ids, 24).astype(np.float64)
    assert np.linalg.norm(last - ref[-1]) / np.linalg.norm(ref[-1]) < LOGITS_REL_L2
    with pytest.raises(ValueError, match="out of range"):
        fast.forward(np.asarray([1, 10 ** 7], np.int32), st2)
    assert st2.pos == len(prompt_ids)                      # the bad call changed nothing


@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_64_tokens_identical(model_path, hf, prompt_ids, graphs):
    import torch
    _, m = hf
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt_ids]), max_new_tokens=N_GREEDY, do_sample=False)
    ref = [int(t) for t in out[0, len(prompt_ids):]]       # may stop early at <|im_end|>
    model = _cuda_model(model_path)
    pool = model.new_page_pool(1024)
    st = model.new_state(pool)
    plan = LL.LlamaCuda(model, pool, use_graphs=graphs)
    first = int(np.argmax(_prefill(model, st, prompt_ids, 512)))
    got = [first] + plan.decode_greedy(first, N_GREEDY - 1, st)
    print("ours:", got[:16], "ref:", ref[:16])
    assert_greedy_matches(m, prompt_ids, got, ref)
    if got[:len(ref)] != ref:
        return                      # parted at a near tie: the last-step logits are of different prefixes
    assert st.pos == len(prompt_ids) + N_GREEDY - 1 and st.tokens == prompt_ids + got[:-1]
    # the last decode step's logits against the reference's at the same position
    full = prompt_ids + got[:-1]
    ref_last = hf_logits(m, full)[-1]
    ours_last = plan.logits().astype(np.float64)
    err = np.linalg.norm(ours_last - ref_last) / np.linalg.norm(ref_last)
    print(f"64th decode step logits rel L2 {err:.2e}")
    assert err < DECODE_LOGITS_REL_L2


def test_graph_decode_step_matches_llama_py_forward(model_path, prompt_ids, monkeypatch):
    """The plan's step is llama.py's one-token forward: same logits (up to split-K summation order), same
    tokens, same state bookkeeping, on two sequences of one pool. f32 activations: with int8 activations
    (STRATA_CUDA_DP4A=1) a 1e-7 difference can flip an int8 rounding, and the runs drift apart by ~1e-2."""
    monkeypatch.setattr(S, "DP4A", False)
    model = _cuda_model(model_path)
    pool = model.new_page_pool(2048)
    fast = model.backend.fast_path(model)
    assert isinstance(fast, LL.LlamaPlanModel)
    sa, sb = model.new_state(pool), model.new_state(pool)
    la = _prefill(model, sa, prompt_ids, 64)
    lb = _prefill(model, sb, prompt_ids, 64)
    assert np.array_equal(la, lb)
    ta = tb = int(np.argmax(la))
    for _ in range(8):
        ga = fast.forward(np.asarray([ta], np.int32), sa)           # graph
        gb = model.forward(np.asarray([tb], np.int32), sb)          # eager llama.py
        err = np.linalg.norm(ga - gb) / np.linalg.norm(gb)
        assert err < 1e-3, err
        ta, tb = int(np.argmax(ga)), int(np.argmax(gb))
        assert ta == tb
    assert sa.pos == sb.pos == sa.kv.length
    assert fast.plans, "the graph plan was not used"
    with pytest.raises(ValueError):
        fast.forward(np.asarray([10 ** 7], np.int32), sa)           # bad id: nothing changes
    assert sa.pos == sb.pos


# ---- the engine with device cuda (what `strata serve --device cuda` runs)
@pytest.fixture(scope="module")
def cuda_engine(model_path):
    from strata.engine import Engine
    e = Engine("default", n_ctx=2048, device="cuda", prompt_cache=6)
    assert isinstance(e.stages[0].runner, LL.LlamaPlanModel) and isinstance(e.stages[0].memory.pool, C.CudaPagePool)
    return e


@pytest.fixture(scope="module")
def cuda_engine_nocache(model_path):
    from strata.engine import Engine
    return Engine("default", n_ctx=2048, device="cuda", prompt_cache=0)


def engine_greedy_vs_reference(e, m, label: str):
    """32 greedy tokens of a fresh chat from engine e and from transformers model m: (prompt tokens, ours, ref)."""
    import torch
    from strata.sampling.sampler import SamplingParams
    from tests.helpers import answer
    e.clear_checkpoints()
    e.state_reset()
    a = answer(e, [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}], 32,
               ignore_eos=False, sampling=SamplingParams(temperature=0.0))
    r, got = a.prompt, a.ids
    with torch.no_grad():
        out = m.generate(torch.tensor([list(r.tokens)]), max_new_tokens=32, do_sample=False)
    ref = [int(t) for t in out[0, len(r.tokens):]]
    print(f"{label}:", got[:16], "ref:", ref[:16], a.final.timings)
    return r.tokens, got, ref


def test_engine_cuda_greedy_matches_reference(cuda_engine, hf):
    _, m = hf
    e = cuda_engine
    prompt, got, ref = engine_greedy_vs_reference(e, m, "engine cuda")
    assert len(got) > 0
    # the engine reads the prompt in parts ending at its cut points (the model tests: one part), so its K/V differ
    # from the plain forward's in the last bits: on the H100 that parted at token 3, a 0.110-logit tie
    assert_greedy_matches(m, prompt, got, ref, min_index=2)
    assert e.stages[0].runner.plans, "the engine's decode did not use the graph plan"
    st = e.status()
    assert st["device"] == "cuda" and st["state_bytes"] > 0


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_engine_cuda_checkpoint_exactness(cuda_engine, sampling):
    """The exactness check of tests/checkpoint_checks.py on the GPU: same request twice, the second resumes from the
    turn checkpoint; same tokens, same text, same state hashes (tokens, f16 K/V of every layer)."""
    from tests import checkpoint_checks as CC
    CC.exactness_same_request_twice(cuda_engine, sampling)


def test_engine_cuda_replay_matches_prompt_cache_0(cuda_engine, cuda_engine_nocache):
    from tests import checkpoint_checks as CC
    CC.replay_two_chats_share_the_root_and_match_prompt_cache_0(cuda_engine, cuda_engine_nocache)


def test_engine_cuda_state_truncate_and_restore(cuda_engine):
    """SequenceState on GPU pages: capture at p, read on, truncate back, hashes equal the capture-time ones."""
    e = cuda_engine
    e.clear_checkpoints()
    e.state_reset()
    st = e.seq
    ids = e.tokenize_prompt("The river flows past the old mill and on towards the sea, " * 40)
    st.forward(np.asarray(ids[:300], np.int32))
    h300, snap = st.hashes(), st.capture()
    st.forward(np.asarray(ids[300:], np.int32))
    for t in (11, 12, 13):
        st.forward(np.asarray([t], np.int32))               # graph steps past a page boundary
    assert st.hashes() != h300
    st.truncate(300)
    assert st.hashes() == h300 and st.nbytes() == 300 * e.stages[0].memory.pool.bytes_per_token + 4 * 300
    st.forward(np.asarray(ids[300:], np.int32))
    st.restore(snap)
    assert st.hashes() == h300 and st.pos == 300


def test_cuda_matches_cpu_backend(model_path, prompt_ids):
    """The CUDA path the engine runs (fast_path: plan prefill + graph decode) against Strata's CPU backend on the same
    GGUF: prompt logits (both round activations to 8-bit blocks, the GPU prefill uses f16 GEMMs: rel. L2 < 2e-2) and
    64 greedy tokens, identical or parting only where the CPU backend's own logits of the two tokens are a near tie."""
    from strata.models.registry import load_model
    cpu = load_model(model_path)
    cst = cpu.new_state(cpu.new_page_pool(1024))
    ref_prompt = _prefill(cpu, cst, prompt_ids, 512)
    model = _cuda_model(model_path)
    fast = model.backend.fast_path(model)
    st = model.new_state(model.new_page_pool(1024))
    got_prompt = _prefill(fast, st, prompt_ids, 512).astype(np.float64)
    err = np.linalg.norm(got_prompt - ref_prompt) / np.linalg.norm(ref_prompt)
    print(f"CUDA vs CPU backend last-prompt logits rel L2 {err:.2e}")
    assert err < LOGITS_REL_L2
    ref, got = [int(np.argmax(ref_prompt))], [int(np.argmax(got_prompt))]
    for _ in range(N_GREEDY - 1):
        ref.append(int(np.argmax(cpu.forward(np.asarray([ref[-1]], np.int32), cst))))
    for _ in range(N_GREEDY - 1):
        got.append(int(np.argmax(fast.forward(np.asarray([got[-1]], np.int32), st))))
    if got == ref:
        return
    i = next(i for i in range(N_GREEDY) if got[i] != ref[i])
    cst2 = cpu.new_state(cpu.new_page_pool(1024))
    lg = _prefill(cpu, cst2, list(prompt_ids) + ref[:i], 512)
    gap = lg[ref[i]] - lg[got[i]]
    print(f"CUDA and CPU greedy runs part at token {i}: {got[i]} vs {ref[i]}, CPU logit gap {gap:.3f}")
    # Both runs round (the CPU backend's int8 activation blocks too, not an f32 reference): either side's rounding
    # moves the gap, so the window is twice the one against transformers (the H200 parts at token 58 with a CPU gap
    # of 0.285, sessions 13-15, the prompt logits within 1e-2).
    assert i >= 8 and gap < 2 * NEAR_TIE_LOGIT


# ---- --kv q8_0 (int8 K/V with an f16 scale per 32 values)
@pytest.fixture(scope="module")
def cuda_engine_q8(model_path):
    from strata.engine import Engine
    e = Engine("default", n_ctx=2048, device="cuda", kv="q8_0", prompt_cache=6)
    assert isinstance(e.stages[0].memory.pool, C.CudaPagePool) and e.stages[0].memory.pool.kv == "q8_0" and e.status()["kv"] == "q8_0"
    return e


def test_engine_cuda_kv_q8_0_greedy_and_memory(cuda_engine_q8, cuda_engine, hf):
    """The engine with a q8_0 KV cache: greedy tokens match transformers' (near ties excepted, as for f16), the plan
    is used, and the cache takes 1.0625 / 2 of the f16 cache's bytes per token."""
    _, m = hf
    e = cuda_engine_q8
    prompt, got, ref = engine_greedy_vs_reference(e, m, "engine cuda kv q8_0")
    # q8_0 K/V carry ~0.4% error on top of the f16 path's: a near tie may part a little earlier / a little wider.
    # Measured on the H200: identical for 16 tokens (session 2's split of the decode attention); parted at token 3 at
    # a 0.110-logit near tie with session 3's (more splits, so another summation order, and int8 roundings on top)
    assert_greedy_matches(m, prompt, got, ref, near_tie=2 * NEAR_TIE_LOGIT, min_index=2)
    assert e.stages[0].runner.plans
    assert e.stages[0].memory.pool.bytes_per_token * 32 == cuda_engine.stages[0].memory.pool.bytes_per_token * 17


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_engine_cuda_kv_q8_0_checkpoint_exactness(cuda_engine_q8, sampling):
    from tests import checkpoint_checks as CC
    CC.exactness_same_request_twice(cuda_engine_q8, sampling)


def test_pdl_changes_no_token(model_path, prompt_ids):
    """Programmatic dependent launch (STRATA_CUDA_PDL) only moves launches earlier: prefill logits and 48 greedy
    graph-decode tokens are bit-identical with it on and off (a missing griddep_wait would show up as a race)."""
    lb = K.lib()
    before = lb.strata_get_pdl()
    runs = []
    try:
        for on in (0, 1):
            lb.strata_set_pdl(on)
            model = _cuda_model(model_path)
            pool = model.new_page_pool(1024)
            fast = model.backend.fast_path(model)
            st = model.new_state(pool)
            logits = _prefill(fast, st, prompt_ids, 24)
            first = int(np.argmax(logits))
            runs.append((logits, [first] + fast.plan(pool).decode_greedy(first, 48, st)))
    finally:
        lb.strata_set_pdl(before)
    assert np.array_equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


def _plan_after_prompt(model_path, prompt_ids, n: int):
    """(model, its LlamaCuda plan, a sequence state after the prompt (prefilled in ubatches of n), the greedy next
    token)."""
    model = _cuda_model(model_path)
    pool = model.new_page_pool(1024)
    fast = model.backend.fast_path(model)
    st = model.new_state(pool)
    first = int(np.argmax(_prefill(fast, st, prompt_ids, n)))
    return model, fast.plan(pool), st, first


def test_fused_swiglu_changes_no_token(model_path, prompt_ids):
    """The fused SwiGLU decode matvec (strata_matvec_q8w_glu, the llama graph's default) is bit-identical to the
    matvec + strata_swiglu_gu pair it replaces: the decode logits after a prompt and 48 greedy graph-decode tokens
    are the same with it on and off (the layers' fused gate/up weights do take the fused path)."""
    model, plan, st, first = _plan_after_prompt(model_path, prompt_ids, 24)
    plan.glu, plan.fused_norm, plan.norm_handoff = True, False, False   # those norms sum in another order (below)
    assert all(plan._glu_weights(L) is not None for L in model.layers)
    p0 = st.pos
    runs = []
    for glu in (False, True):
        plan.glu, plan.graphs = glu, {}
        st.truncate(p0)
        logits = plan.decode(first, st)
        st.truncate(p0)
        runs.append((logits, plan.decode_greedy(first, 48, st)))
    assert np.array_equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


@pytest.mark.parametrize("mode", ["fused", "handoff"])
def test_fused_norm_decode_agrees(model_path, prompt_ids, mode):
    """The decode graph with the RMSNorms inside the QKV and gate/up matvecs (fused) or handed off by the output and
    down projections (handoff, the default where it applies: every layer here) against the one with separate norm
    launches: the same step within int8-activation rounding (the sum of squares runs in another order and the
    handoff quantizes x * w before the 1 / rms scale, so a q8_1 value may move by one: 2e-2 rel. L2 on the logits)
    and the same 48 greedy tokens."""
    model, plan, st, first = _plan_after_prompt(model_path, prompt_ids, 24)
    plan.fused_norm, plan.norm_handoff = True, True
    assert plan.handoff_ok()
    plan.norm_handoff = mode == "handoff"
    assert plan.fused_norm_rows() == 4
    p0 = st.pos
    runs = []
    for on in (False, True):
        plan.fused_norm, plan.norm_handoff, plan.graphs = on and mode == "fused", on and mode == "handoff", {}
        st.truncate(p0)
        logits = plan.decode(first, st).astype(np.float64)
        st.truncate(p0)
        runs.append((logits, plan.decode_greedy(first, 48, st)))
    (a, ta), (b, tb) = runs
    assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(a)
    assert ta == tb


def test_decode_attention_kernels_agree(model_path, prompt_ids):
    """The two decode attention kernels the plan can choose between (STRATA_CUDA_ATTN v1 / v2 / auto) give the same
    step: logits within 1e-4 rel. L2 (f32 activations, so an int8 rounding flip cannot amplify a summation-order
    difference)."""
    _, plan, st, first = _plan_after_prompt(model_path, prompt_ids, 512)
    plan.dp4a = False
    p0 = st.pos
    out = {}
    for attn in ("v2", "v1", "auto"):
        plan.attn, plan.graphs = attn, {}
        st.truncate(p0)
        out[attn] = plan.decode(first, st).astype(np.float64)
    for attn in ("v1", "auto"):
        assert np.linalg.norm(out[attn] - out["v2"]) / np.linalg.norm(out["v2"]) < 1e-4, attn
