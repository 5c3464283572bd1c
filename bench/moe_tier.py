"""The MoE expert tier's arms on one GPU, one synthetic GGUF with skewed, topic-following routers, one workload.

Arms (the same file, prompts and VRAM for experts: 25 % and 50 % of all experts' bytes):
  * resident: every expert in VRAM (the tier off): the reference every ratio is taken against;
  * adaptive: the tier (--moe-vram-mib B, rounds every --adapt-every tokens), also with --pcie-frac 0.02 (a slow link)
    and with prompt routings counted at --prefill-weight (adaptive_pw, 1 by default: the tier counts them at 0.1,
    bench/moe_policy_sim.py);
  * static: the same slots filled once with the experts most used over the warm-up prompts, never swapped;
  * layers: as many layers' experts wholly in the slots as the budget holds, the other layers' read from host RAM;
  * host: no slots (every expert read from pinned host RAM over PCIe).
Workload: the warm-up reads one 128-token prompt per topic; then per topic in turn (the hot set moves with it) a
512-token prompt (prefill) and 64 greedy tokens decoded one forward at a time (host logits, as the engine does).
Reported per arm over the measured part: prefill and decode tokens/s (and their ratio to resident), the decode steps'
hit rate, bytes copied to the device per token (swaps, prefill staging, loans given back) and bytes the decode steps
read from host RAM per decoded token (misses times an expert's bytes), the same per layer, the distinct decoded
tokens, and whether the greedy tokens equal resident's.
With --llama-bench, llama.cpp on the same file (-fa 1, its own random prompt of 512 and 64 generated tokens): all on
the GPU, every expert on the host (-ot exps=CPU), and at each budget's VRAM as whole layers' experts on the GPU:
--n-cpu-moe N (the first N layers' experts on the host) and -ot with the last layers' experts on the host. The
vendored llama.cpp has no --moe-cache-mib (its adaptive expert cache), so that arm is missing. --strata-from adds
the llama.cpp arms to a JSON written earlier (the build may finish after Strata's arms ran).

Writes bench/results/moe_tier_<gpu>_<commit>.json (or --out).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the workload, fixed so that every arm sees the same one
SPEC = dict(n_embd=1024, n_layer=8, n_head=8, n_head_kv=2, head_dim=128, n_ff=2048, head_k_dim=128,
            head_v_dim=128, n_k_heads=4, n_v_heads=8, n_expert=128, n_expert_used=8, n_ff_exp=256,
            n_ff_shexp=512, n_mtp=0, qtype="Q4_0", embd_qtype="Q4_0", seed=7, router_zipf="1.1,1.3,0.9",
            router_topics=4, router_shift=0.5)
TOPICS = 4
WARM, PROMPT, GEN = 128, 512, 64


def topic_prompt(topic: int, n: int, seed: int) -> np.ndarray:
    """n token ids of one topic (the synthetic routers' topic of a token is its id mod TOPICS)."""
    rng = np.random.default_rng([seed, topic])
    return (rng.integers(0, 49152 // TOPICS, n) * TOPICS + topic).astype(np.int32)


def run_arm(path: str, settings, place: str | None) -> dict:
    import cupy as cp
    from strata.backend import cuda as C
    from strata.backend.cuda import moe_tier as T
    from strata.backend.cuda import qwen35 as Q
    from strata.models.registry import load_model
    be = C.CudaBackend()
    be.moe_tier = settings
    t0 = time.perf_counter()
    m = load_model(path, be)
    g = Q.Qwen35GraphModel(m)
    pool = m.new_page_pool(WARM * TOPICS + (PROMPT + GEN) * TOPICS + 64, n_seq=1)
    load_s = time.perf_counter() - t0
    tier = T.tier_of(m)
    st = m.new_state(pool)
    for topic in range(TOPICS):                                     # warm-up: one prompt per topic, 8 tokens each
        t = int(np.argmax(g.forward(topic_prompt(topic, WARM, 1), st)))
        for _ in range(8):
            t = int(np.argmax(g.forward(np.array([t], np.int32), st)))
    if tier is not None:
        s = tier.store
        if place == "hottest":
            s.place_hottest()
        elif place == "layers":
            n_layers = s.n_slots // s.n_expert
            s.place(list(range(n_layers * s.n_expert)))
        s.settle()
        s.observe(s.dev.read_counts())
        before = tier.status()
    cp.cuda.Device().synchronize()
    pf_s = dec_s = 0.0
    toks = []
    for topic in range(TOPICS):
        p = topic_prompt(topic, PROMPT, 2)
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        t = int(np.argmax(g.forward(p, st)))
        pf_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(GEN):
            toks.append(t)
            t = int(np.argmax(g.forward(np.array([t], np.int32), st)))
        dec_s += time.perf_counter() - t0
    out = {"prefill_tok_s": round(TOPICS * PROMPT / pf_s, 1), "decode_tok_s": round(TOPICS * GEN / dec_s, 2),
           "load_s": round(load_s, 2), "tokens": toks, "distinct_decoded_tokens": len(set(toks))}
    if tier is not None:
        tier.store.settle()
        tier.store.observe(tier.dev.read_counts())
        after = tier.status()
        d = {k: after[k] - before[k] for k in ("hits", "misses", "swaps", "staged", "bytes_moved", "bytes_read_host")}
        seen = d["hits"] + d["misses"]
        layers = []
        for lb, la in zip(before["layers"], after["layers"]):
            dl = {k: la[k] - lb[k] for k in ("hits", "misses", "swaps", "staged", "bytes_moved")}
            seen_l = dl["hits"] + dl["misses"]
            layers.append({"layer": la["layer"], "decode_hit_rate": round(dl["hits"] / seen_l, 4) if seen_l else None,
                           "swaps": dl["swaps"], "staged": dl["staged"],
                           "copied_bytes_per_token": round(dl["bytes_moved"] / (TOPICS * (PROMPT + GEN))),
                           "resident_at_end": len(la["resident"])})
        out["layers"] = layers
        out.update({"slots": after["slots"], "vram_mib": round(after["vram_bytes"] / 2 ** 20, 1),
                    "decode_hit_rate": round(d["hits"] / seen, 4) if seen else None, "swaps": d["swaps"],
                    "staged": d["staged"], "copied_bytes_per_token": round(d["bytes_moved"] / (TOPICS * (PROMPT + GEN))),
                    "host_read_bytes_per_decoded_token": round(d["bytes_read_host"] / (TOPICS * GEN)),
                    "h2d_gb_s": round(after["h2d_bytes_per_s"] / 1e9, 1), "expert_bytes": after["expert_bytes"]})
    st.release()
    del g, m, st, pool, tier
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()
    return out


def llama(bin_path: str, path: str, extra: list[str]) -> dict:
    cmd = [bin_path, "-m", path, "-ngl", "99", "-fa", "1", "-p", str(PROMPT), "-n", str(GEN), "-r", "2", "-o", "json",
           *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"cmd": " ".join(cmd), "error": p.stderr[-1500:]}
    res = {"cmd": " ".join(cmd)}
    for row in json.loads(p.stdout):
        res["decode_tok_s" if row["n_gen"] else "prefill_tok_s"] = round(row["avg_ts"], 2)
    return res


def strata_arms(a, fracs: list[float]) -> dict:
    """Strata's arms (module doc) on a.gguf (written when missing): the result dict without llama.cpp."""
    import cupy as cp
    from bench.common import commit as bench_commit
    from strata.backend.cuda.moe_tier import TierSettings
    from strata.moe.policy import Policy
    from strata.gguf import synth
    if not os.path.exists(a.gguf):
        t0 = time.perf_counter()
        synth.write_synthetic(a.gguf + ".tmp", synth.preset("qwen35moe", "tiny", **SPEC),
                              workers=max(1, (os.cpu_count() or 2) // 2))
        os.replace(a.gguf + ".tmp", a.gguf)
        print(f"wrote {a.gguf} in {time.perf_counter() - t0:.0f} s", flush=True)
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    res = {"gpu": gpu, "commit": bench_commit(), "spec": SPEC, "workload": {"topics": TOPICS, "warm": WARM,
           "prompt": PROMPT, "gen": GEN}, "arms": {}}
    arms = [("resident", None, None)]
    for f in fracs:
        arms += [(f"adaptive@{f:g}", f, ("adaptive", 1.0)), (f"static@{f:g}", f, ("hottest", 1.0)),
                 (f"layers@{f:g}", f, ("layers", 1.0)), (f"adaptive_slow@{f:g}", f, ("adaptive", a.slow_frac)),
                 (f"adaptive_pw@{f:g}", f, ("adaptive_pw", 1.0))]
    arms.append(("host", 0.0, ("adaptive", 1.0)))
    total = None
    for name, frac, how in arms:
        if how is None:
            s, place = None, None
        else:
            if total is None:
                from strata.gguf.file import open_gguf
                fh = open_gguf(a.gguf)
                total = sum(t.nbytes for k, t in fh.tensors.items() if "_exps" in k)
            place = None if how[0].startswith("adaptive") else how[0]
            mib = int(frac * total / 2 ** 20)
            s = TierSettings(vram_mib=str(mib), every=a.every, swaps=a.swaps, pcie_frac=how[1],
                             static=place is not None,
                             prefill_weight=a.prefill_weight if how[0] == "adaptive_pw" else Policy.prefill_weight)
        try:
            r = run_arm(a.gguf, s, place)
        except Exception as e:                          # noqa: BLE001 - the other arms still run
            res["arms"][name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            print(f"{name:18s} failed: {res['arms'][name]['error']}", flush=True)
            continue
        ref = res["arms"].get("resident")
        if ref and "tokens" in ref:
            r["decode_vs_resident"] = round(r["decode_tok_s"] / ref["decode_tok_s"], 3)
            r["prefill_vs_resident"] = round(r["prefill_tok_s"] / ref["prefill_tok_s"], 3)
            r["tokens_equal_resident"] = r["tokens"] == ref["tokens"]
        res["arms"][name] = r
        print(f"{name:18s} prefill {r['prefill_tok_s']:8.1f} tok/s  decode {r['decode_tok_s']:7.2f} tok/s  "
              f"decode hits {r.get('decode_hit_rate')}  copied B/token {r.get('copied_bytes_per_token')}  "
              f"host-read B/decoded token {r.get('host_read_bytes_per_decoded_token')}  "
              f"x resident {r.get('decode_vs_resident')} / {r.get('prefill_vs_resident')}  "
              f"same tokens {r.get('tokens_equal_resident')}", flush=True)
    for r in res["arms"].values():
        r.pop("tokens", None)
    return res


def llama_arms(res: dict, bin_path: str, gguf: str, fracs: list[float]) -> None:
    """llama.cpp on the same file (module doc): res["llama.cpp"], each arm's rates and its ratios to llama.cpp all
    on the GPU and to Strata's resident arm."""
    n_layer = SPEC["n_layer"]
    lc = {"all_gpu": llama(bin_path, gguf, []), "exps_cpu": llama(bin_path, gguf, ["-ot", "exps=CPU"])}
    for f in fracs:
        on_gpu = int(f * n_layer)              # whole layers' experts: the budget's share of the layers
        # --n-cpu-moe N: the experts of the first N layers on the host
        lc[f"n_cpu_moe@{f:g}"] = llama(bin_path, gguf, ["-ncmoe", str(n_layer - on_gpu)])
        # -ot: the same VRAM with the last layers' experts on the host instead
        host = "|".join(str(i) for i in range(on_gpu, n_layer))
        lc[f"ot_last_layers_cpu@{f:g}"] = llama(bin_path, gguf, ["-ot", f"blk\\.({host})\\.ffn_.*_exps=CPU"])
    ref = lc["all_gpu"]
    for v in lc.values():
        for k in ("decode_tok_s", "prefill_tok_s"):
            if k in v and k in ref:
                v[k.replace("_tok_s", "_vs_all_gpu")] = round(v[k] / ref[k], 3)
    res["llama.cpp"] = lc
    strata = res.get("arms", {}).get("resident")
    if strata and "decode_tok_s" in strata and "decode_tok_s" in ref and "prefill_tok_s" in ref:
        res["strata_resident_over_llamacpp_all_gpu"] = {
            "decode": round(strata["decode_tok_s"] / ref["decode_tok_s"], 3),
            "prefill": round(strata["prefill_tok_s"] / ref["prefill_tok_s"], 3)}
    for k, v in lc.items():
        print(f"llama.cpp {k:24s} prefill {v.get('prefill_tok_s')}  decode {v.get('decode_tok_s')}  "
              f"x all_gpu {v.get('decode_vs_all_gpu')} / {v.get('prefill_vs_all_gpu')}  {v.get('error', '')[-300:]}",
              flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default="/tmp/moe_tier.gguf", help="the synthetic file (written when missing)")
    ap.add_argument("--fracs", default="0.25,0.5", help="budgets as fractions of all experts' bytes")
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--swaps", type=int, default=16)
    ap.add_argument("--slow-frac", type=float, default=0.02, help="--pcie-frac of the slow-link arm")
    ap.add_argument("--prefill-weight", type=float, default=1.0,
                    help="the prefill_weight of the adaptive_pw arm (prompt routings counted at this weight; 1: as "
                         "before the tier's default became 0.1)")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--strata-from", default=None, help="a JSON this bench wrote: add the llama.cpp arms to it")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    fracs = [float(x) for x in a.fracs.split(",")]
    if a.strata_from:
        res = json.loads(Path(a.strata_from).read_text())
    else:
        res = strata_arms(a, fracs)
    if a.llama_bench and os.path.exists(a.llama_bench):
        llama_arms(res, a.llama_bench, a.gguf, fracs)
    elif a.llama_bench:
        res["llama.cpp"] = {"error": f"no llama-bench at {a.llama_bench}"}
    out = a.out or str(ROOT / "bench" / "results" / f"moe_tier_{res['gpu'].replace(' ', '_')}_{res['commit']}.json")
    Path(out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
