"""Parity of the llama model with Hugging Face transformers on the real default model (teacher-forced logits)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# transformers dequantizes the GGUF to fp32 with the same block formulas and computes in fp32. Strata's matmul
# (strata.backend.quant) has two paths: from quant.BLAS_MIN_TOKENS tokens on it dequantizes weight tiles to fp32 and calls
# BLAS, so only the summation order differs; below that it quantizes the activations to 8 bits (Q8 blocks) and
# uses integer dot products on the packed blocks, as llama.cpp does.
# fp32 path (BLAS_MIN_TOKENS forced to 1): measured max |diff| 1.3e-2 (mean 5e-4) over 577 positions; the same
# model code with weights dequantized by gguf's numpy dequantizers and plain fp32 matmuls gives 1.3e-4.
MAX_ABS_DIFF_FP32 = 5e-2
TOP1_MARGIN_FP32 = 0.1
# 8-bit activation path (the default for every batch size since BLAS_MIN_TOKENS is off by default): measured
# max |diff| 2.2 / mean 0.15 (512-token batch + 65 decode steps) and 2.16 / 0.17 (all 64-token batches). Simulating Q8_0 activation rounding in numpy on exact fp32 weights gives the same size
# (max 2.87, mean 0.16, top-1 flips up to a reference margin of 0.22), so this is the rounding, not an error.
# Any real error (RoPE pairing, causal mask, KV position, GQA head mapping) moves logits by several units on
# every row.
MAX_ABS_DIFF_Q8 = 4.0
MEAN_ABS_DIFF_Q8 = 0.25
TOP1_MARGIN_Q8 = 1.0

CHAT = [
    {"role": "system", "content": "You are a patient assistant who helps people plan small home projects. "
                                  "Answer with short numbered steps and mention safety where it matters."},
    {"role": "user", "content": "I want to put up a shelf in my living room. The wall is plasterboard. "
                                "What do I need?"},
    {"role": "assistant", "content": "1. A stud finder, to locate the timber or metal studs behind the board.\n"
                                     "2. A spirit level and a pencil.\n3. A drill with a set of wood bits.\n"
                                     "4. Screws long enough to go at least 30 mm into the stud, or heavy-duty "
                                     "plasterboard anchors where there is no stud.\n5. The shelf and its brackets.\n"
                                     "Wear eye protection while drilling, and check for pipes and cables first."},
    {"role": "user", "content": "There's no stud where I want it. Will anchors hold books?"},
    {"role": "assistant", "content": "Spring toggle or metal cavity anchors can hold about 10-20 kg each in "
                                     "12.5 mm plasterboard, but a shelf full of books can weigh 25 kg per metre. "
                                     "Use at least four anchors, spread the load with a long rail, or move the "
                                     "shelf 20 cm so that one bracket lands on a stud."},
    {"role": "user", "content": "OK, I'll move it to hit a stud. How do I make sure it's level when there are "
                                "two brackets?"},
    {"role": "assistant", "content": "1. Fix the first bracket loosely with one screw.\n2. Rest the shelf on it, "
                                     "put the level on top and mark the second bracket's holes.\n3. Drill pilot "
                                     "holes at the marks, fit the second bracket, then tighten both.\n4. Check the "
                                     "level again before loading it."},
    {"role": "user", "content": "Thanks! Last question: my drill has a hammer setting. Should I use it on "
                                "plasterboard? And what about the tiles in my kitchen, for a second shelf there?"},
    {"role": "assistant", "content": "No hammer on plasterboard: it crumbles the board and the hole ends up too "
                                     "big. For ceramic tiles, put masking tape over the spot, start slowly with a "
                                     "tile or glass bit without hammer, and only switch to a masonry bit for the "
                                     "wall behind the tile."},
    {"role": "user", "content": "Which screws and plugs for the tiled wall?"},
    {"role": "assistant", "content": "Behind most kitchen tiles is brick or concrete: use 6 mm wall plugs with "
                                     "5 x 50 mm screws, drill through the tile with the tile bit, then 40 mm deep "
                                     "into the wall with the masonry bit. Push the plug in until it sits behind "
                                     "the tile, so the tile does not crack when you tighten the screw."},
    {"role": "user", "content": "Great, can you summarise everything as a checklist I can print?"},
]


RUNS = {
    # name: (force the fp32 matmul path, ubatch schedule as a function of the sequence length)
    "fp32_mixed_ubatches": (True, lambda t: [256, 64, 100, 7, 1, 1, 1, 1, 1] + [t - 432]),
    "default_ubatch512_decode": (False, lambda t: [512] + [1] * (t - 512)),
    "default_ubatch64": (False, lambda t: [64] * (t // 64) + ([t % 64] if t % 64 else [])),
}


@pytest.fixture(scope="session")
def hf_reference(hf_tokenizer, hf_default_model):
    """(token ids (T,), fp32 logits (T, n_vocab)) from transformers on the same GGUF, computed once per session."""
    ids = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = np.asarray(ids, dtype=np.int32)
    assert len(ids) >= 500, len(ids)
    with torch.no_grad():
        logits = hf_default_model(torch.from_numpy(ids.astype(np.int64))[None]).logits[0].float().numpy()
    return ids, logits


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_teacher_forced_logits_match_transformers(default_model, hf_reference, run, monkeypatch):
    from strata.backend import quant
    ids, ref = hf_reference
    fp32, schedule = RUNS[run]
    batches = schedule(len(ids))
    assert sum(batches) == len(ids) and min(batches) > 0
    if fp32:
        monkeypatch.setattr(quant, "BLAS_MIN_TOKENS", 1)
    pool = default_model.new_page_pool(1024)
    state = default_model.new_state(pool)
    out = []
    p = 0
    for b in batches:
        lg = default_model.forward(ids[p:p + b], state, all_logits=True)
        assert lg.shape == (b, default_model.config.n_vocab)
        out.append(lg)
        p += b
    ours = np.concatenate(out)
    assert state.pos == len(ids) and state.kv.length == len(ids)
    # the sequence crosses page boundaries (page size 256) in both schedules
    assert len(state.kv.pages) == -(-len(ids) // pool.page_size) >= 3

    diff = np.abs(ours - ref)
    top2 = np.sort(ref, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    agree = ours.argmax(1) == ref.argmax(1)
    max_tol, margin_tol = (MAX_ABS_DIFF_FP32, TOP1_MARGIN_FP32) if fp32 else (MAX_ABS_DIFF_Q8, TOP1_MARGIN_Q8)
    bad = np.nonzero((margin > margin_tol) & ~agree)[0]
    print(f"\n{run}: T={len(ids)} max|diff| {float(diff.max()):.3e} mean {float(diff.mean()):.2e}; top-1 agrees at "
          f"{int(agree.sum())}/{len(ids)}; largest reference margin where it differs: "
          f"{float(margin[~agree].max(initial=0)):.3f}")
    assert bad.size == 0, f"{run}: top-1 differs at positions {bad[:10].tolist()} (margins > {margin_tol})"
    assert diff.max() < max_tol, f"{run}: max |logit diff| {float(diff.max()):.3e} >= {max_tol}"
    if not fp32:
        assert diff.mean() < MEAN_ABS_DIFF_Q8, f"{run}: mean |logit diff| {float(diff.mean()):.3e}"


@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope_matches_transformers(n_rot):
    """NeoX pairing against transformers' apply_rotary_pos_emb (rotate_half), with partial rotary dims left
    untouched; the normal pairing (2i, 2i+1) is the NeoX one on de-interleaved dims (the permutation llama.cpp's
    converter applies to Q/K rows)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from strata.backend.cpu import CPUBackend
    rng = np.random.default_rng(3)
    n, H, hd, theta = 40, 3, 64, 100000.0
    pos = np.arange(1000, 1000 + n)
    x = rng.standard_normal((n, H, hd)).astype(np.float32)
    inv = 1.0 / (theta ** (torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot))
    freqs = torch.from_numpy(pos.astype(np.float64))[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    xt = torch.from_numpy(x.astype(np.float64)).transpose(0, 1)[None]  # (1, H, n, hd)
    rot, _ = apply_rotary_pos_emb(xt[..., :n_rot], xt[..., :n_rot], emb.cos()[None], emb.sin()[None])
    ref = np.concatenate([rot[0].transpose(0, 1).numpy(), x[..., n_rot:]], axis=-1)
    be = CPUBackend()
    np.testing.assert_allclose(be.rope(x, pos, n_rot, theta, neox=True), ref, atol=2e-5)
    perm = np.concatenate([np.arange(0, n_rot, 2), np.arange(1, n_rot, 2), np.arange(n_rot, hd)])
    inter = np.empty_like(x)
    inter[..., perm] = x  # dims i and i + n_rot/2 of x become the adjacent pair (2i, 2i+1)
    np.testing.assert_allclose(be.rope(inter, pos, n_rot, theta, neox=False)[..., perm], ref, atol=2e-5)
