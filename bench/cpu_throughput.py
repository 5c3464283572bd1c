"""CPU throughput: prompt tokens/s (128, 512, 2048 tokens) and decode tokens/s, Strata vs llama.cpp, same run.

Both engines read the same token ids from the same GGUF with the same thread count and ubatch. llama.cpp runs
through llama-cpp-python (optional: `pip install llama-cpp-python`; its column is skipped with a note when it
is not importable). Each figure is the best of --repeats runs, the two engines alternating, so a noisy
neighbour on a shared machine hurts both alike. Writes JSON (default bench/results/cpu_throughput.json).

Decode is measured after prompts of --decode-context tokens (default 128, 2048 and 8064, so that 64 new tokens
stay inside SmolLM2's 8K training context; long-context decode is bound by reading the KV cache). Each repeat
re-reads the prompt (untimed), so contexts over 1024 tokens use --long-repeats.

Usage: python bench/cpu_throughput.py [--model default|PATH] [--threads N] [--sizes 128,512,2048]
       [--decode-tokens 64] [--decode-context 128,2048,8064] [--ubatch 512] [--repeats 3] [--no-llama]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# llama.cpp's OpenMP workers: OMP_WAIT_POLICY decides how they wait between calls. ACTIVE spins forever (its idle
# threads then steal the cores from Strata's turn in the alternation, and starve each other on a busy machine);
# PASSIVE sleeps at once (slow wake-ups per decode token); libgomp's default spins a while, then sleeps. --omp-policy
# picks one (default: libgomp's default, llama.cpp as shipped); an OMP_WAIT_POLICY already set in the environment
# wins. The JSON records the policy.
TEXT = ("The history of the printing press begins in the fifteenth century, when movable metal type made books "
        "cheaper to produce. Within fifty years presses were running in more than two hundred European cities, and "
        "the number of books in circulation grew from thousands to millions. Scholars argue about how much this "
        "changed the way people thought, but nobody doubts that it changed what they could read. ")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def prompt_ids(engine, n: int) -> list[int]:
    """n token ids of plain English text (the same ids go to both engines)."""
    ids: list[int] = []
    k = 0
    while len(ids) < n:
        ids = engine.tokenize_prompt(TEXT * (2 ** k))
        k += 1
    return ids[:n]


# ---- Strata ---------------------------------------------------------------------------------------

def strata_prompt(engine, ids: list[int]) -> float:
    """Seconds to read `ids` from position 0 (one part, ubatch-sized calls; no reuse)."""
    from strata.engine import GenerationRequest
    engine.state_reset()
    evs = list(engine.generate(GenerationRequest(prompt_tokens=ids, max_tokens=0, cache_prompt=False)))
    final = evs[-1]
    assert final.timings["prompt_n"] == len(ids)
    return final.timings["prompt_ms"] / 1000.0


def strata_decode(engine, ids: list[int], n_new: int) -> float:
    """Seconds to generate n_new tokens greedily after `ids` (EOG ignored): n_new samples, n_new-1 forwards."""
    from strata.engine import GenerationRequest
    from strata.sampling.sampler import SamplingParams
    engine.state_reset()
    req = GenerationRequest(prompt_tokens=ids, max_tokens=n_new, cache_prompt=False, ignore_eos=True,
                            sampling=SamplingParams(temperature=0.0))
    final = list(engine.generate(req))[-1]
    assert final.timings["predicted_n"] == n_new, final.timings
    return final.timings["predicted_ms"] / 1000.0


# ---- llama.cpp ------------------------------------------------------------------------------------

def load_llama(path: str, n_ctx: int, threads: int, ubatch: int, extra_bufts: bool):
    import llama_cpp
    import llama_cpp.llama as LL
    if not extra_bufts:
        # llama.cpp's extra CPU buffer types (AMX / repacked weights) crash with a general protection fault in
        # some sandboxes (seen here: llama-cpp-python 0.3.36 on a Sapphire-Rapids-class CPU, AMX present).
        orig = LL.llama_cpp.llama_model_default_params

        def params():
            p = orig()
            p.use_extra_bufts = False
            return p
        LL.llama_cpp.llama_model_default_params = params
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=ubatch,
                          n_ubatch=ubatch, logits_all=False, verbose=False)
    return llm


def _llama_clear(llm) -> None:
    import llama_cpp
    llm.reset()
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    llama_cpp.llama_memory_clear(mem, True)


def llama_prompt(llm, ids: list[int]) -> float:
    _llama_clear(llm)
    t0 = time.perf_counter()
    llm.eval(ids)
    return time.perf_counter() - t0


def llama_decode(llm, ids: list[int], n_new: int) -> float:
    import llama_cpp
    _llama_clear(llm)
    llm.eval(ids)
    n_vocab = llm.n_vocab()
    t0 = time.perf_counter()
    for i in range(n_new):
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
        tok = int(np.argmax(logits))
        if i + 1 < n_new:
            llm.eval([tok])
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--sizes", default="128,512,2048")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-context", default="128,2048,8064",
                    help="prompt tokens before a decode run; a comma list gives one decode row per context")
    ap.add_argument("--long-repeats", type=int, default=1,
                    help="repeats for decode rows whose context exceeds 1024 tokens (each repeat re-reads the prompt)")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--omp-policy", choices=["default", "passive", "active"], default="default",
                    help="OMP_WAIT_POLICY for llama.cpp's OpenMP threads (see the note at the top)")
    ap.add_argument("--no-llama", action="store_true", help="skip the llama.cpp column")
    ap.add_argument("--llama-extra-bufts", action="store_true",
                    help="let llama.cpp use its AMX/repacked CPU buffers (crashes in some sandboxes)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_throughput.json"))
    args = ap.parse_args(argv)
    if "OMP_WAIT_POLICY" in os.environ:
        omp_policy = os.environ["OMP_WAIT_POLICY"] + " (from the environment)"
    elif args.omp_policy != "default":
        os.environ["OMP_WAIT_POLICY"] = args.omp_policy.upper()
        omp_policy = args.omp_policy.upper()
    else:
        omp_policy = "libgomp default (unset)"
    sizes = [int(s) for s in args.sizes.split(",") if s]
    dctx = [int(s) for s in str(args.decode_context).split(",") if s]
    load_start = os.getloadavg()

    from strata.engine import Engine
    n_ctx = max(sizes + [c + args.decode_tokens for c in dctx]) + 16
    engine = Engine(args.model, n_ctx=n_ctx, ubatch=args.ubatch, threads=args.threads, prompt_cache=0)
    ids_all = prompt_ids(engine, max(sizes + dctx))

    llm, llama_note = None, None
    if args.no_llama:
        llama_note = "skipped (--no-llama)"
    else:
        try:
            import llama_cpp  # noqa: F401
            llm = load_llama(engine.model_path, n_ctx, args.threads, args.ubatch, args.llama_extra_bufts)
        except ImportError as e:
            llama_note = f"llama-cpp-python not importable ({e}); llama.cpp column skipped"
    if llama_note:
        print(f"note: {llama_note}", file=sys.stderr)

    # warm-up (page in weights, build caches) on both
    strata_prompt(engine, ids_all[:64])
    if llm is not None:
        llama_prompt(llm, ids_all[:64])

    res = {"strata": {"prompt_tps": {}, "decode_tps": None}, "llama_cpp": {"prompt_tps": {}, "decode_tps": None}}
    for n in sizes:
        ids = ids_all[:n]
        best_s, best_l = float("inf"), float("inf")
        for _ in range(args.repeats):
            best_s = min(best_s, strata_prompt(engine, ids))
            if llm is not None:
                best_l = min(best_l, llama_prompt(llm, ids))
        res["strata"]["prompt_tps"][n] = n / best_s
        if llm is not None:
            res["llama_cpp"]["prompt_tps"][n] = n / best_l
    res["strata"]["decode_tps_by_context"] = {}
    res["llama_cpp"]["decode_tps_by_context"] = {}
    for c in dctx:
        ids = ids_all[:c]
        best_s, best_l = float("inf"), float("inf")
        for _ in range(args.repeats if c <= 1024 else args.long_repeats):
            best_s = min(best_s, strata_decode(engine, ids, args.decode_tokens))
            if llm is not None:
                best_l = min(best_l, llama_decode(llm, ids, args.decode_tokens))
        res["strata"]["decode_tps_by_context"][c] = args.decode_tokens / best_s
        if llm is not None:
            res["llama_cpp"]["decode_tps_by_context"][c] = args.decode_tokens / best_l
    # the headline decode figure is the first (shortest) context
    res["strata"]["decode_tps"] = res["strata"]["decode_tps_by_context"][dctx[0]]
    if llm is not None:
        res["llama_cpp"]["decode_tps"] = res["llama_cpp"]["decode_tps_by_context"][dctx[0]]

    ratios = None
    if llm is not None:
        ratios = {"prompt": {n: res["strata"]["prompt_tps"][n] / res["llama_cpp"]["prompt_tps"][n] for n in sizes},
                  "decode": res["strata"]["decode_tps"] / res["llama_cpp"]["decode_tps"],
                  "decode_by_context": {c: res["strata"]["decode_tps_by_context"][c]
                                        / res["llama_cpp"]["decode_tps_by_context"][c] for c in dctx}}

    print(f"model {engine.model_name} ({engine.arch}), {args.threads} threads, ubatch {args.ubatch}, "
          f"best of {args.repeats}, CPU {cpu_name()}, load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'':>16} {'Strata tok/s':>14} {'llama.cpp tok/s':>16} {'ratio':>8}")
    for n in sizes:
        s = res["strata"]["prompt_tps"][n]
        line = f"{'prompt ' + str(n):>16} {s:14.1f}"
        if llm is not None:
            line += f" {res['llama_cpp']['prompt_tps'][n]:16.1f} {ratios['prompt'][n]:8.2f}"
        print(line)
    for c in dctx:
        line = f"{f'decode @{c}':>16} {res['strata']['decode_tps_by_context'][c]:14.1f}"
        if llm is not None:
            line += f" {res['llama_cpp']['decode_tps_by_context'][c]:16.1f} {ratios['decode_by_context'][c]:8.2f}"
        print(line)
    if llama_note:
        print(f"note: {llama_note}")

    out = {
        "model": engine.model_name, "model_path": engine.model_path, "arch": engine.arch,
        "threads": args.threads, "ubatch": args.ubatch, "repeats": args.repeats,
        "decode_tokens": args.decode_tokens, "decode_contexts": dctx, "long_repeats": args.long_repeats,
        "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "omp_wait_policy": omp_policy,
        "strata": res["strata"],
        "llama_cpp": res["llama_cpp"] if llm is not None else None,
        "llama_cpp_note": llama_note or ("llama.cpp extra CPU buffer types (AMX/repack) "
                                         + ("on" if args.llama_extra_bufts else "off")),
        "ratio_strata_over_llama_cpp": ratios,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
