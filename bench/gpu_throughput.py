"""GPU throughput of Strata's CUDA llama path against llama.cpp's llama-bench on the same GGUF and GPU.

Prompt tokens/s at 512 / 4096 / 16384 tokens and decode tokens/s at context 0 / 4096 / 16384, plus decode as a
fraction of the memory-bandwidth limit (weight bytes read per token / measured device copy bandwidth).
Usage: python bench/gpu_throughput.py --model PATH [--model PATH2] [--llama-bench BIN] [--synthetic OUT.gguf]
       [--synthetic-hybrid OUT2.gguf] [--synthetic-moe OUT3.gguf[:SIZE] ...] [--moe-size medium|large]
       [--skip-generic] [--strata-from EARLIER.json]
--synthetic-moe (repeatable) writes a hybrid MoE (strata.gguf.synth qwen35moe, random Q4_0, seed 1, SIZE or
--moe-size: medium: 16 layers, n_embd 1536, 64 experts of which 8 per token, 1.78 GiB; large: 36 layers, 2048, 128
experts of which 8, 7.9 GiB) and benches it like the hybrid (bench/gpu_hybrid_model.bench_hybrid: the plan's graph
decode and grouped prefill; its "moe_path" says which ran); the entry's "moe_spec" names the file's shape.
--skip-generic: the hybrid / MoE rows of the plan only (no generic-forward rows: the large MoE decodes a few tokens a
second that way). --strata-from: Strata's rows from an earlier run's JSON on the same machine and files, llama-bench
run now (the two halves of one comparison in two device calls).
Writes bench/results/gpu_<gpu>_<commit>.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import commit, host_load  # noqa: E402

PROMPTS = (512, 4096, 16384)
DEPTHS = (0, 4096, 16384)


def copy_bandwidth(cp) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median of 20 copies of 2 GiB."""
    n = 1 << 31
    a = cp.empty(n, cp.uint8)
    b = cp.empty(n, cp.uint8)
    a.fill(1)
    ts = []
    for i in range(23):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        b[...] = a
        e1.record()
        e1.synchronize()
        if i >= 3:
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    del a, b
    return 2 * n / float(np.median(ts))


def make_synthetic_llama(out: str, tok_src: str, n_embd=2048, n_layer=24, n_head=16, n_kv=8, n_ff=8192,
                         seed=0, d=2e-3, dmin=1e-3) -> str:
    """Write a llama GGUF with random Q4_K weights (every super-block's f16 scales d and dmin; random 6-bit
    sub-block scales and mins and 4-bit values), F32 norms, and the tokenizer of tok_src. The default scales (the
    benchmark's file) give weights with a positive mean, whose activations overflow after a few dozen positions;
    dmin = 7.5 d centres them (tests that run long prompts)."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    r = gguf.GGUFReader(tok_src)
    f = {k: r.fields[k].contents() for k in r.fields if k.startswith("tokenizer.")}
    n_vocab = len(f["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(out, "llama")
    w.add_name("strata-synthetic-llama")
    w.add_context_length(32768)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_file_type(15)  # MOSTLY_Q4_K_M-style label
    w.add_tokenizer_model(f["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in f:
        w.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_types(f["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in f:
        w.add_token_merges(f["tokenizer.ggml.merges"])
    for k, fn in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id)):
        if f"tokenizer.ggml.{k}_token_id" in f:
            fn(int(f[f"tokenizer.ggml.{k}_token_id"]))
    rng = np.random.default_rng(seed)

    def q4k(rows, cols):
        nb = cols // 256
        raw = rng.integers(0, 256, size=(rows, nb, 144), dtype=np.uint8)
        raw[:, :, 0:2] = np.full((rows, nb), d, np.float16).view(np.uint8).reshape(rows, nb, 2)
        raw[:, :, 2:4] = np.full((rows, nb), dmin, np.float16).view(np.uint8).reshape(rows, nb, 2)
        return raw.reshape(rows, nb * 144)

    hd = n_embd // n_head
    w.add_tensor("token_embd.weight", q4k(n_vocab, n_embd), raw_dtype=Q.Q4_K)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", q4k(n_vocab, n_embd), raw_dtype=Q.Q4_K)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(p + "attn_q.weight", q4k(n_embd, n_embd), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "attn_k.weight", q4k(n_kv * hd, n_embd), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "attn_v.weight", q4k(n_kv * hd, n_embd), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "attn_output.weight", q4k(n_embd, n_embd), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "ffn_gate.weight", q4k(n_ff, n_embd), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "ffn_up.weight", q4k(n_ff, n_embd), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "ffn_down.weight", q4k(n_embd, n_ff), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def bench_strata(path: str, prompts, depths, n_gen: int, ubatch: int, bw: float, f32_act: bool = False,
                 quick: bool = False) -> dict:
    """Strata as the engine runs it on CUDA (CudaBackend.fast_path): the LlamaCuda plan's prefill for ubatch-sized
    forward calls and its CUDA-graph decode step (greedy, argmax on the device; int8 activations, the default: the
    launch-per-op CUDA graph). Decode is timed again with every down projection one warp per row
    (decode_no_mvblock: the plan's mv_block_from = 0) and without programmatic dependent launch (decode_no_pdl;
    strata_set_pdl(0), whose greedy tokens must be the same), with the fused-SwiGLU setting flipped (decode_no_glu:
    the matvec + SwiGLU launch pair when the fused kernel is on, as by default; decode_glu the other way round; same
    tokens), with the GQA decode attention kernel at every context size (decode_attn_v2; plan.attn = "v2") and,
    with f32_act, with f32 activations (plan.dp4a off). quick: the default decode only (A/B runs of two builds; the
    bench also runs a tree from before issue #20's package split)."""
    import cupy as cp
    from strata.backend.cuda import CudaBackend
    try:
        from strata.backend.cuda.library import lib as kernel_lib
        from strata.backend.cuda.llama import LlamaCuda
    except ImportError:                                            # a tree from before the package split
        from strata.backend.cuda import LlamaCuda
        from strata.backend.cuda import lib as kernel_lib
    from strata.models.registry import load_model
    rng = np.random.default_rng(0)
    max_ctx = max(max(prompts), max(depths) + n_gen + 16) + 256
    model = load_model(path, CudaBackend())
    pool = model.new_page_pool(max_ctx)
    st = model.new_state(pool)
    plan = LlamaCuda(model, pool)
    vocab = model.config.n_vocab
    fast = model.backend.fast_path(model)
    res = {"weight_bytes_per_token": plan.weight_bytes, "prompt": {}, "decode": {}, "decode_f32act": {}}

    def prefill(toks):
        st.reset()
        for s in range(0, len(toks), ubatch):
            fast.forward(np.asarray(toks[s:s + ubatch], np.int32), st)

    prefill(rng.integers(0, vocab, 512))                           # warm-up (cuBLAS handles, kernels)
    for n in prompts:
        toks = rng.integers(0, vocab, n)
        ts = []
        for _ in range(5):          # a 512-token prompt is a few ms of host-bound launches: the best of five
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            prefill(toks)
            cp.cuda.Device().synchronize()
            ts.append(time.perf_counter() - t0)
        res["prompt"][str(n)] = n / min(ts)
        res.setdefault("prompt_runs_s", {})[str(n)] = ts
        print(f"  strata pp{n}: {n / min(ts):.1f} tok/s", flush=True)
    c = model.config
    lib = kernel_lib()
    pdl_default = lib.strata_get_pdl()
    # (name, int8 activations, PDL, decode attention kernel choice: LlamaCuda.attn, SwiGLU fused in the matvec,
    # block-per-row down projection from this many sub-blocks)
    glu0, mvb0 = plan.glu, plan.mv_block_from
    glu_kind = "decode_no_glu" if glu0 else "decode_glu"
    modes = [("decode", True, pdl_default, plan.attn, glu0, mvb0)] + \
        ([("decode_no_mvblock", True, pdl_default, plan.attn, glu0, 0)] if mvb0 else []) + \
        [("decode_no_pdl", True, False, plan.attn, glu0, mvb0),
         (glu_kind, True, pdl_default, plan.attn, not glu0, mvb0),
         ("decode_attn_v2", True, pdl_default, "v2", glu0, mvb0)] + \
        ([("decode_f32act", False, pdl_default, plan.attn, glu0, mvb0)] if f32_act else [])
    if quick:
        modes = modes[:1]
    attn0 = plan.attn
    pdl0 = pdl_default
    ctx = {d: rng.integers(0, vocab, d) for d in depths}          # the same contexts in every mode
    for kind, dp4a, pdl, attn, glu, mvb in modes:
        lib.strata_set_pdl(int(pdl))
        plan.dp4a, plan.graphs, plan.attn, plan.glu = dp4a, {}, attn, glu
        plan.mv_block_from = mvb
        res.setdefault(kind, {})
        for d in depths:
            prefill(ctx[d]) if d else st.reset()
            p0 = st.pos
            toks = plan.decode_greedy(1, 8, st)                     # capture the graph for this size class
            res.setdefault("tokens_" + kind, {})[str(d)] = toks     # PDL must not change a single token
            st.truncate(p0)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            plan.decode_greedy(1, n_gen, st)
            dt = time.perf_counter() - t0
            tps = n_gen / dt
            res[kind][str(d)] = tps
            if kind == "decode":
                kv_read = 2 * c.n_layer * c.n_head_kv * c.head_dim * 2 * (d + n_gen / 2)
                res.setdefault("decode_bw_fraction", {})[str(d)] = plan.weight_bytes * tps / bw
                res.setdefault("decode_bw_fraction_incl_kv", {})[str(d)] = (plan.weight_bytes + kv_read) * tps / bw
            print(f"  strata {kind} tg{n_gen}@d{d}: {tps:.1f} tok/s  "
                  f"({100 * plan.weight_bytes * tps / bw:.1f}% of bandwidth limit)", flush=True)
    lib.strata_set_pdl(pdl0)
    plan.attn, plan.glu, plan.mv_block_from = attn0, glu0, mvb0
    base = "tokens_decode"
    if "tokens_decode_no_pdl" in res:
        res["pdl_tokens_equal"] = res["tokens_decode_no_pdl"] == res[base]
        print(f"  PDL tokens equal to plain launches: {res['pdl_tokens_equal']}", flush=True)
    if "tokens_" + glu_kind in res:
        res["glu_tokens_equal"] = res["tokens_" + glu_kind] == res[base]   # the fusion is bit-exact
        print(f"  tokens with the fused SwiGLU {'off' if glu0 else 'on'} equal to the default's: "
              f"{res['glu_tokens_equal']}", flush=True)
    del plan, st, pool, model
    cp.get_default_memory_pool().free_all_blocks()
    return res


def bench_llama(bin_path: str, path: str, prompts, depths, n_gen: int, ubatch: int) -> dict:
    res = {"prompt": {}, "decode": {}, "cmd": []}
    runs = [["-p", ",".join(map(str, prompts)), "-n", "0", "-d", "0"],
            ["-p", "0", "-n", str(n_gen), "-d", ",".join(map(str, depths))]]
    for extra in runs:
        cmd = [bin_path, "-m", path, "-ngl", "99", "-fa", "1", "-ub", str(ubatch), "-b", str(max(ubatch, 2048)),
               "-r", "2", "-o", "json", *extra]
        res["cmd"].append(" ".join(cmd))
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            res["error"] = p.stderr[-2000:]
            print("  llama-bench failed:", p.stderr[-800:], flush=True)
            continue
        for row in json.loads(p.stdout):
            if row["n_gen"] == 0:
                res["prompt"][str(row["n_prompt"])] = row["avg_ts"]
                print(f"  llama.cpp pp{row['n_prompt']}: {row['avg_ts']:.1f} tok/s", flush=True)
            else:
                res["decode"][str(row.get("n_depth", 0))] = row["avg_ts"]
                print(f"  llama.cpp tg{row['n_gen']}@d{row.get('n_depth', 0)}: {row['avg_ts']:.1f} tok/s", flush=True)
    return res


def moe_spec(size: str):
    """strata.gguf.synth's qwen35moe spec of `size` as the bench writes it (random Q4_0 matrices, seed 1)."""
    from strata.gguf import synth
    return synth.preset("qwen35moe", size, qtype="Q4_0", seed=1)


def make_synthetic_moe(out: str, size: str = "medium") -> str:
    """Write moe_spec(size) (the tokenizer of the default model; the tensors computed on half the cores), the file of
    ``tools/synth_gguf.py qwen35moe OUT --size SIZE --qtype Q4_0 --seed 1``."""
    from strata.gguf import synth
    return str(synth.write_synthetic(out, moe_spec(size), progress=False, workers=max(1, (os.cpu_count() or 2) // 2)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=[], help="GGUF path ('default' = the default model)")
    ap.add_argument("--synthetic", default=None, help="write a ~1.5B Q4_K synthetic llama here and bench it too")
    ap.add_argument("--tokenizer-from", default=None, help="GGUF whose tokenizer the synthetic model copies")
    ap.add_argument("--synthetic-hybrid", default=None,
                    help="write a ~1.5B qwen35 hybrid (Gated DeltaNet + attention, random Q8_0; "
                         "bench/gpu_hybrid_model.py) here and bench it too")
    ap.add_argument("--synthetic-moe", action="append", default=[], metavar="PATH[:SIZE]",
                    help="write a synthetic qwen35moe (make_synthetic_moe) of SIZE (else --moe-size) here and bench it "
                         "too (repeatable)")
    ap.add_argument("--moe-size", default="medium", choices=("small", "medium", "large"))
    ap.add_argument("--skip-generic", action="store_true",
                    help="hybrid / MoE models: the plan's rows only (no generic-forward rows)")
    ap.add_argument("--strata-from", default=None,
                    help="take Strata's rows from this earlier results JSON (same machine and files) and run only "
                         "llama-bench now")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary built with CUDA")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)))
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="the default decode mode only (A/B runs of two builds)")
    ap.add_argument("--reference", default=None,
                    help="without --llama-bench: take llama.cpp's numbers from this earlier results JSON (same GPU "
                         "kind, same GGUF files); the summary marks them as stored, not measured in this run")
    a = ap.parse_args(argv)
    import cupy as cp
    from strata.gguf.default_model import resolve_model
    prompts = [int(x) for x in a.prompts.split(",") if x]
    depths = [int(x) for x in a.depths.split(",") if x]
    stored = json.loads(Path(a.strata_from).read_text())["models"] if a.strata_from else None
    moe_sizes = {}
    models = [str(resolve_model(m)) for m in (a.model or ["default"]) if m != "none"]
    tok_src = a.tokenizer_from or (models[0] if models else None)

    def synthetic(path: str, make, what: str) -> None:
        if not os.path.exists(path):
            t0 = time.time()
            make(path, tok_src)
            print(f"synthetic {what} written in {time.time() - t0:.1f}s", flush=True)
        models.append(path)

    if a.synthetic:
        synthetic(a.synthetic, make_synthetic_llama, "model")
    hybrids = []
    if a.synthetic_hybrid:
        from bench.gpu_hybrid_model import make_synthetic_hybrid
        synthetic(a.synthetic_hybrid, make_synthetic_hybrid, "hybrid")
        hybrids.append(a.synthetic_hybrid)
    for arg in a.synthetic_moe:
        path, _, size = arg.partition(":")
        size = size or a.moe_size
        if size not in ("small", "medium", "large"):
            ap.error(f"--synthetic-moe {arg!r}: size {size!r} is not small, medium or large")
        synthetic(path, lambda p, _tok, size=size: make_synthetic_moe(p, size), f"MoE ({size})")
        hybrids.append(path)
        moe_sizes[path] = size
    props = cp.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    bw = copy_bandwidth(cp)
    print(f"GPU {gpu}; device copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    host = host_load()
    if host["n_build_processes"]:
        print(f"WARNING: {host['n_build_processes']} build processes are running ({', '.join(host['build_processes'])}"
              f"; load {host['load_avg_1m']}): host-bound rows (prefill) will read low", flush=True)
    out = {"commit": commit(), "gpu": gpu, "copy_bandwidth_Bps": bw, "n_gen": a.n_gen, "ubatch": a.ubatch,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host_at_start": host, "models": {}}
    for m in models:
        print(f"model {m} ({os.path.getsize(m) / 1e6:.0f} MB)", flush=True)
        entry = {"file_bytes": os.path.getsize(m)}
        if m in moe_sizes:
            sp = moe_spec(moe_sizes[m])
            entry["moe_spec"] = {"size": moe_sizes[m], "qtype": sp.qtype, **{
                f: getattr(sp, f) for f in ("n_layer", "n_embd", "n_expert", "n_expert_used", "n_ff_exp", "n_ff_shexp")}}
        if stored is not None:
            if os.path.basename(m) not in stored:
                ap.error(f"--strata-from {a.strata_from} has no row for {os.path.basename(m)}")
            entry["strata"] = stored[os.path.basename(m)]["strata"]
            entry["strata_from"] = a.strata_from
        elif m in hybrids:
            from bench.gpu_hybrid_model import bench_hybrid
            h = bench_hybrid(m, prompts, depths, a.n_gen, a.ubatch, generic=not a.skip_generic)
            entry["strata"] = {k: ({str(n): v for n, v in h[k].items()} if isinstance(h[k], dict) else h[k])
                               for k in h}
        else:
            entry["strata"] = bench_strata(m, prompts, depths, a.n_gen, a.ubatch, bw, quick=a.quick)
        if a.llama_bench and os.path.exists(a.llama_bench):
            entry["llama.cpp"] = bench_llama(a.llama_bench, m, prompts, depths, a.n_gen, a.ubatch)
        elif a.reference:
            ref = json.loads(Path(a.reference).read_text())["models"].get(os.path.basename(m), {}).get("llama.cpp")
            if ref:
                entry["llama.cpp"] = dict(ref, stored_from=a.reference)
        if "llama.cpp" in entry:
            ratios = {}
            for kind in ("prompt", "decode"):
                for k, v in entry["strata"][kind].items():
                    ref = entry["llama.cpp"][kind].get(k)
                    if ref:
                        ratios[f"{kind}_{k}"] = v / ref
            entry["ratio_strata_over_llamacpp"] = ratios
        out["models"][os.path.basename(m)] = entry
    out["host_at_end"] = host_load()
    dest = Path(a.out) if a.out else ROOT / "bench" / "results" / f"gpu_{gpu.replace(' ', '_')}_{out['commit']}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print("\nsummary (tokens/s; ratio = Strata / llama.cpp)")
    for name, e in out["models"].items():
        for kind in ("prompt", "prompt_generic", "prompt_chunked", "decode", "decode_step", "decode_no_step",
                     "decode_no_mvblock", "decode_no_pdl", "decode_glu", "decode_no_glu", "decode_attn_v2",
                     "decode_generic",
                     "decode_f32act"):
            for k, v in e["strata"].get(kind, {}).items():
                ref = e.get("llama.cpp", {}).get("decode" if kind.startswith("decode") else "prompt", {}).get(k)
                if "stored_from" in e.get("llama.cpp", {}):
                    kind_note = " (llama.cpp stored)"
                else:
                    kind_note = ""
                print(f"{name[:34]:34s} {kind:6s} {k:>6s}: strata {v:9.1f}  llama.cpp {ref or float('nan'):9.1f}  "
                      f"ratio {v / ref if ref else float('nan'):.2f}{kind_note}")
    print("wrote", dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
