"""GPU throughput of the hybrid qwen35 path (Gated DeltaNet + gated attention): a synthetic ~1.5B model, its timing.

``make_synthetic_hybrid`` writes a qwen35 (dense FFN) GGUF with random quantized blocks written directly (random
int8 / 4-bit quants with valid f16 scales; no float quantization), F32 norms / conv / decay tensors, the tokenizer
of another GGUF, and the layer pattern of Qwen3.5 (3 GDN layers : 1 full-attention layer). ``bench_hybrid`` times
strata/models/qwen3next.py on the CUDA backend: prompt tokens/s (prefill in ubatch-sized forward calls) and decode
tokens/s (one-token forward calls) at several context depths.
Usage: python bench/gpu_hybrid_model.py --out-gguf /tmp/hybrid.gguf [--llama-bench BIN] [--json OUT.json]
With --llama-bench (built with CUDA), the same file is run by llama-bench in the same run and the ratios printed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = (512, 4096, 16384)
DEPTHS = (0, 4096, 16384)

# name -> (n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_k_heads, n_v_heads, head_k_dim)
SIZES = {
    "1.5b": (2048, 24, 16, 4, 128, 6144, 16, 16, 128),   # ~1.57e9 parameters (untied output)
    "tiny": (64, 4, 2, 1, 32, 128, 2, 4, 16),            # tests: ~7 MB with a 49152-token vocabulary
}
QTYPES = ("Q8_0", "Q4_0")


def _tokenizer_fields(tok_src: str) -> dict:
    import gguf
    r = gguf.GGUFReader(tok_src)
    out = {}
    for name, f in r.fields.items():
        if name.startswith("tokenizer."):
            vt = f.types[0]
            out[name] = (f.contents(), vt, f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    if "tokenizer.ggml.tokens" not in out:
        raise ValueError(f"{tok_src}: no tokenizer.ggml.tokens to copy")
    return out


def _quant_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str, fan_in: int) -> np.ndarray:
    """Random GGUF blocks (uint8 (rows, row_bytes)) whose values have std about 1/sqrt(fan_in).

    Q8_0 (ggml-common.h block_q8_0): f16 d, 32 int8 q; value = d q. Q4_0: f16 d, 16 bytes of 4-bit q (low nibbles
    are elements 0..15, high 16..31); value = d (q - 8). Scales vary by +-50 % per block."""
    nb = cols // 32
    if cols % 32:
        raise ValueError(f"row length {cols} is not a multiple of 32 ({qtype})")
    q_std = 128 / math.sqrt(3) if qtype == "Q8_0" else 16 / math.sqrt(12)
    d = (rng.uniform(0.5, 1.5, (rows, nb)) / (q_std * math.sqrt(fan_in))).astype(np.float16)
    nq = 32 if qtype == "Q8_0" else 16
    raw = np.empty((rows, nb, 2 + nq), np.uint8)
    raw[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)
    raw[:, :, 2:] = np.frombuffer(rng.bytes(rows * nb * nq), np.uint8).reshape(rows, nb, nq)
    return raw.reshape(rows, nb * (2 + nq))


def make_synthetic_hybrid(out_path: str | os.PathLike, tok_src_gguf: str | os.PathLike, size: str = "1.5b",
                          qtype: str = "Q8_0", seed: int = 0, full_attention_interval: int = 4,
                          n_mtp: int = 0) -> str:
    """Write a qwen35 (dense) hybrid GGUF with random `qtype` matrices and the tokenizer of tok_src_gguf.

    size: "1.5b" (n_embd 2048, 24 layers = 18 GDN + 6 attention, 16 heads / 4 KV heads of 128, FFN 6144, GDN
    16 key / 16 value heads of 128; ~1.57e9 parameters, ~1.7 GB at Q8_0) or "tiny" (tests). qtype: "Q8_0" or
    "Q4_0" (2-D matrices incl. token_embd and the untied output); norms, ssm_conv1d, ssm_a, ssm_dt are F32.
    n_mtp 1: an MTP block appended as block n_layer (nextn_predict_layers = 1: a full-attention block with its FFN
    and nextn.eh_proj / enorm / hnorm / shared_head_norm, as strata/gguf/synth.py writes it), quantized the same.
    Tensor names, shapes and metadata are those llama.cpp's converter writes for Qwen3.5 (strata/gguf/synth.py
    writes the same layout with real float weights). Returns the path. Raises ValueError for an unknown size or
    type.
    """
    import gguf
    from gguf import GGMLQuantizationType as QT
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; use one of {', '.join(SIZES)}")
    if qtype not in QTYPES:
        raise ValueError(f"qtype {qtype!r} not supported here; use one of {', '.join(QTYPES)}")
    E, n_layer, nh, nkv, hd, F, nk, nv, dk = SIZES[size]
    dv = dk
    n_rot = hd // 4                                   # partial_rotary_factor 0.25
    conv_k = 4
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    tok = _tokenizer_fields(str(tok_src_gguf))
    n_vocab = len(tok["tokenizer.ggml.tokens"][0])
    q = QT.Q8_0 if qtype == "Q8_0" else QT.Q4_0

    plan: list[tuple[str, tuple[int, ...], str, int]] = [   # name, numpy shape, kind, fan_in
        ("token_embd.weight", (n_vocab, E), "mat", E), ("output_norm.weight", (E,), "norm", 0),
        ("output.weight", (n_vocab, E), "mat", E)]
    if n_mtp not in (0, 1):
        raise ValueError(f"n_mtp {n_mtp}: 0 or 1")
    for il in range(n_layer + n_mtp):
        p = f"blk.{il}."
        plan += [(p + "attn_norm.weight", (E,), "norm", 0), (p + "post_attention_norm.weight", (E,), "norm", 0)]
        if il < n_layer and (il + 1) % full_attention_interval != 0:
            plan += [(p + "attn_qkv.weight", (conv_dim, E), "mat", E),
                     (p + "attn_gate.weight", (value_dim, E), "mat", E),
                     (p + "ssm_conv1d.weight", (conv_dim, conv_k), "conv", conv_k), (p + "ssm_dt.bias", (nv,), "dt", 0),
                     (p + "ssm_a", (nv,), "ssm_a", 0), (p + "ssm_beta.weight", (nv, E), "mat", E),
                     (p + "ssm_alpha.weight", (nv, E), "mat", E), (p + "ssm_norm.weight", (dv,), "norm", 0),
                     (p + "ssm_out.weight", (E, value_dim), "mat", value_dim)]
        else:
            plan += [(p + "attn_q.weight", (2 * nh * hd, E), "mat", E), (p + "attn_k.weight", (nkv * hd, E), "mat", E),
                     (p + "attn_v.weight", (nkv * hd, E), "mat", E),
                     (p + "attn_output.weight", (E, nh * hd), "mat", nh * hd),
                     (p + "attn_q_norm.weight", (hd,), "norm", 0), (p + "attn_k_norm.weight", (hd,), "norm", 0)]
        plan += [(p + "ffn_gate.weight", (F, E), "mat", E), (p + "ffn_up.weight", (F, E), "mat", E),
                 (p + "ffn_down.weight", (E, F), "mat", F)]
        if il >= n_layer:                            # the MTP block's own tensors
            plan += [(p + "nextn.eh_proj.weight", (E, 2 * E), "mat", 2 * E), (p + "nextn.enorm.weight", (E,), "norm", 0),
                     (p + "nextn.hnorm.weight", (E,), "norm", 0),
                     (p + "nextn.shared_head_norm.weight", (E,), "norm", 0)]

    w = gguf.GGUFWriter(str(out_path), "qwen35")
    w.add_name(f"strata-synthetic-qwen35-{size}-{qtype}")
    w.add_context_length(131072)
    w.add_embedding_length(E)
    w.add_block_count(n_layer + n_mtp)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000000.0)
    w.add_rope_dimension_count(n_rot)
    half = n_rot // 2                                # IMROPE sections (t, h, w, e); text uses equal positions
    w.add_rope_dimension_sections([half - 2 * (half // 3), half // 3, half // 3, 0])
    w.add_feed_forward_length(F)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_ssm_conv_kernel(conv_k)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(value_dim)
    w.add_full_attention_interval(full_attention_interval)
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    for name, (val, vt, sub) in tok.items():
        w.add_key_value(name, val, vt, sub_type=sub)
    bs, ts = gguf.GGML_QUANT_SIZES[q]
    for name, shape, kind, _ in plan:
        if kind == "mat":
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * (shape[1] // bs) * ts, raw_dtype=q)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)), raw_dtype=QT.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, kind, fan_in in plan:
        n = int(np.prod(shape))
        if kind == "mat":
            data = _quant_blocks(rng, shape[0], shape[1], qtype, fan_in)
        elif kind == "norm":                         # stored = 1 + w (zero-centred convention)
            data = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32).reshape(shape)
        elif kind == "conv":
            data = (rng.standard_normal(n) / math.sqrt(fan_in)).astype(np.float32).reshape(shape)
        elif kind == "dt":
            data = rng.uniform(-1.0, 1.0, n).astype(np.float32)
        else:                                        # ssm_a = -exp(A_log), A in [0.5, 4]
            data = -rng.uniform(0.5, 4.0, n).astype(np.float32)
        w.write_tensor_data(data)
    w.close()
    return str(out_path)


def moe_layer_profile(plan, n: int, reps: int = 5) -> dict:
    """Microseconds of one MoE layer on the plan's kernels (its first MoE layer, random rows, CUDA events, best of
    reps): ``decode`` (strata/backend/cuda/moe.decode's launches for one normed row, eager launches, not the graph)
    and ``prefill_<n>`` (the grouped moe.prefill over n rows, with a 4 n E-byte copy of its input). A diagnostic
    of where the MoE time goes (no reference: the model has no dense FFN to compare with)."""
    import cupy as cp
    from strata.backend.cuda import moe
    from strata.backend.cuda.library import stream_ptr
    li = min(plan.moe)
    m = plan.moe[li]
    E = plan.n_embd
    rng = np.random.default_rng(0)
    norm = plan.model.layers[li].post_norm

    def timed(fn) -> float:
        best = math.inf
        for _ in range(reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(a, b) * 1e3)
        return best
    plan.d["hn"][...] = cp.asarray(rng.standard_normal((1, E)).astype(np.float32))
    plan.model.backend.quantize_q8(plan.d["hn"], out=plan.d["hq"])
    out = {"layer": li, "decode": timed(lambda: moe.decode(plan, stream_ptr(), m))}
    x0 = cp.asarray(rng.standard_normal((n, E)).astype(np.float32))
    x, h16 = cp.empty_like(x0), cp.empty((n, E), cp.float16)

    def run():
        x[...] = x0
        moe.prefill(plan, stream_ptr(), m, x, norm, h16)
    out[f"prefill_{n}"] = timed(run)
    return out


def bench_hybrid(path: str, prompts=PROMPTS, depths=DEPTHS, n_gen: int = 128, ubatch: int = 512,
                 generic: bool = True) -> dict:
    """Time strata.models.base.load_model(path, CudaBackend()) on random tokens, as the engine runs it
    (CudaBackend.fast_path: the CUDA-graph decode plan when it supports the model).

    prompt: for each n in prompts, a fresh sequence reads n tokens in ubatch-sized forward calls (best of 2; with a
    plan, its prefill: Qwen35Cuda.prefill); prompt_generic: the same for the smallest n through the model's own
    forward (the prefill plan's reference: STRATA_CUDA_HYBRID_PREFILL=0); prompt_chunked: the model's own forward
    with the chunked delta rule (gdn_mode "chunked"; the default on the device is the recurrent kernel).
    decode: for each depth d, a sequence holding d tokens reads n_gen tokens
    greedily (the plan's decode_greedy, device argmax, when there is a plan; else one-token forward calls and the
    host argmax); decode_generic: the same at the first depth through the model's own forward (no plan: the
    feature's reference). The device is synchronized before each clock read. Returns {"prompt": {n: tok/s},
    "prompt_chunked": {...}, "decode": {d: tok/s}, "decode_generic": {...}, "plan": bool, "moe_path": the
    MoE layers' path ({"decode": ..., "prefill": ...}) or None} (keys are ints). generic=False: without the
    prompt_generic / prompt_chunked / decode_generic rows (the plan's rows only).
    """
    import cupy as cp
    from strata.backend.cuda import CudaBackend
    from strata.models.registry import load_model
    rng = np.random.default_rng(0)
    model = load_model(path, CudaBackend())
    fast = model.backend.fast_path(model)
    max_ctx = max(max(prompts, default=0), max(depths, default=0) + n_gen + 16) + 256
    pool = model.new_page_pool(max_ctx)
    st = model.new_state(pool)
    plan = fast.plan(pool) if hasattr(fast, "plan") else None
    vocab = model.config.n_vocab
    sync = cp.cuda.Device().synchronize

    def prefill(toks):
        st.reset()
        logits = None
        for s in range(0, len(toks), ubatch):
            logits = fast.forward(np.asarray(toks[s:s + ubatch], np.int32), st)
        return logits

    def timed_prompt(n):
        toks = rng.integers(0, vocab, n)
        ts = []
        for _ in range(2):
            sync()
            t0 = time.perf_counter()
            prefill(toks)
            sync()
            ts.append(time.perf_counter() - t0)
        return n / min(ts)

    prefill(rng.integers(0, vocab, min(ubatch, 128) + 3))           # warm-up: cuBLAS, cuSOLVER, kernels
    for t in range(3):
        fast.forward(np.asarray([t], np.int32), st)                  # the plan (graph capture)
        model.forward(np.asarray([t], np.int32), st)                 # the generic one-token path (decode_generic)
    res: dict = {"prompt": {}, "prompt_generic": {}, "prompt_chunked": {}, "decode": {}, "decode_generic": {},
                 "plan": plan is not None, "moe_path": getattr(fast, "moe_path", None)}
    if res["moe_path"]:
        print(f"  MoE layers: {res['moe_path']}", flush=True)
    for n in prompts:
        res["prompt"][n] = timed_prompt(n)
        print(f"  strata hybrid pp{n}: {res['prompt'][n]:.1f} tok/s", flush=True)
    if prompts and generic:
        n = min(prompts)
        routed = getattr(fast, "prefill", None)
        if routed:                                  # the model's own forward (the prefill plan off)
            fast.prefill = False
            res["prompt_generic"][n] = timed_prompt(n)
            print(f"  strata hybrid pp{n} (generic forward): {res['prompt_generic'][n]:.1f} tok/s", flush=True)
        mode0, model.gdn_mode = model.gdn_mode, "chunked"
        res["prompt_chunked"][n] = timed_prompt(n)
        model.gdn_mode = mode0
        if routed:
            fast.prefill = True
        print(f"  strata hybrid pp{n} (chunked delta rule): {res['prompt_chunked'][n]:.1f} tok/s", flush=True)

    def generic_decode(tok):
        for _ in range(n_gen):
            tok = int(np.argmax(model.forward(np.asarray([tok], np.int32), st)))

    for i, d in enumerate(depths):
        logits = prefill(rng.integers(0, vocab, d)) if d else (st.reset() or None)
        tok = int(np.argmax(logits)) if logits is not None else 1
        snap = st.capture()
        runs = [("decode", (lambda: plan.decode_greedy(tok, n_gen, st)) if plan is not None else
                 (lambda: generic_decode(tok)))]
        if i == 0 and plan is not None and generic:
            runs.append(("decode_generic", lambda: generic_decode(tok)))
        for kind, run in runs:
            st.restore(snap)
            if kind == "decode" and plan is not None:
                plan.decode_greedy(tok, 4, st)                       # graph capture for this size class
                st.restore(snap)
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            res[kind][d] = n_gen / (time.perf_counter() - t0)
            print(f"  strata hybrid {kind} tg{n_gen}@d{d}: {res[kind][d]:.1f} tok/s", flush=True)
        snap.release()                              # a capture holds its KV pages
    if plan is not None and getattr(plan, "moe", None):
        res["moe_layer_us"] = moe_layer_profile(plan, ubatch)
        print(f"  one MoE layer (us): {res['moe_layer_us']}", flush=True)
    del st, pool, model, plan, fast
    cp.get_default_memory_pool().free_all_blocks()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-gguf", required=True, help="synthetic model path (written if missing)")
    ap.add_argument("--tokenizer-from", default=None,
                    help="GGUF whose tokenizer is copied (default: the default model)")
    ap.add_argument("--size", default="1.5b", choices=sorted(SIZES))
    ap.add_argument("--qtype", default="Q8_0", choices=QTYPES)
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary built with CUDA (same run, same file)")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)))
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    prompts = [int(x) for x in a.prompts.split(",") if x]
    depths = [int(x) for x in a.depths.split(",") if x]
    if not os.path.exists(a.out_gguf):
        from strata.gguf.default_model import default_model_path
        t0 = time.time()
        make_synthetic_hybrid(a.out_gguf, a.tokenizer_from or str(default_model_path()), a.size, a.qtype)
        print(f"synthetic hybrid written in {time.time() - t0:.1f}s ({os.path.getsize(a.out_gguf) / 1e9:.2f} GB)")
    out = {"model": a.out_gguf, "file_bytes": os.path.getsize(a.out_gguf), "n_gen": a.n_gen, "ubatch": a.ubatch,
           "strata": bench_hybrid(a.out_gguf, prompts, depths, a.n_gen, a.ubatch)}
    if a.llama_bench:
        from bench.gpu_throughput import bench_llama
        ref = bench_llama(a.llama_bench, a.out_gguf, prompts, depths, a.n_gen, a.ubatch)
        out["llama.cpp"] = ref
        out["ratio_strata_over_llamacpp"] = {
            f"{kind}_{k}": v / ref[kind][str(k)] for kind in ("prompt", "decode")
            for k, v in out["strata"][kind].items() if ref[kind].get(str(k))}
        for k, r in out["ratio_strata_over_llamacpp"].items():
            print(f"  {k}: strata / llama.cpp = {r:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
