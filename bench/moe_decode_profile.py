"""Where a MoE hybrid's decode step goes on the GPU, per part, at several context depths, beside llama-bench's tg.

For each depth (a random prompt read through the plan's prefill in 512-token calls): the graph decode rate as
bench/gpu_throughput.py times it (decode_greedy, argmax on the device), then one step's kernels by part:
  * graph: the captured step replayed under torch.profiler (CUPTI kernel records), each kernel labelled by its
    place in the launch order of a labelled eager step (the same kernels in the same order; checked by name). Per
    part: busy (the kernels' durations) and timeline (each kernel from its start to the next one's start: the
    parts then add up to the step's span, gaps going to the kernel before them).
  * events (always; the only one without torch): the step's launches run eagerly, each between two CUDA events,
    queued behind a spin kernel so that they run back to back (no graph, no PDL overlap: an upper bound per part).
Parts: gdn (the Gated DeltaNet layers' in/out projections, conv, delta-rule step, gated norm), attn_proj (the
attention layers' q|gate/k/v and output projections, q/k norms, RoPE + K/V write, output gate), attn_kv (the decode
attention over the cached K/V), router (router matvec, top-k, routing counts), experts (the k routed experts' gate/up
and down launches, the shared expert riding along as their last slot when it can), shared (the shared expert's own
launches when it cannot ride along), norms (RMSNorms with the residual adds), head (output matvec, argmax), embed.
Beside each part: the bytes it must read per token (weights from the GGUF's tensor sizes, k of n_expert routed
experts, the K/V cache at that depth) and the time those bytes take at the copy bandwidth measured in the run.
--splits: the decode attention alone (one layer, a graph of 20 back-to-back launches) at each split-K count, per
depth, against the split the plan chose. --llama-bench: llama-bench -p 0 -n N -d DEPTHS -fa 1 -ngl 99 on the same
file in the same run.
--splits runs at depths of 1024 and more, for counts leaving at least 32 positions per split.
Usage: python bench/moe_decode_profile.py MODEL.gguf [--depths 0,4096,16384] [--n-gen 128] [--splits 8,16,32,64,128]
       [--llama-bench PATH] [--strata-from JSON] [--out JSON]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cupti_trace import short_name, trace_events  # noqa: E402

NOT_LAUNCHES = ("strata_get_pdl", "strata_set_pdl")
PARTS = ("gdn", "attn_proj", "attn_kv", "router", "experts", "shared", "norms", "head", "embed")


class Labeller:
    """Wraps the plan's step methods and the kernel library so that every strata_* launch of an eager step is
    recorded as (launcher, part), in launch order; ``around(name, index)``, a context manager factory, runs around
    each launch (timing hooks)."""

    def __init__(self, plan):
        self.plan = plan
        self.stack: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self.moe_seen: set[str] = set()
        self.around = None                  # callable(name) -> context manager, or None

    def part(self, name: str) -> str:
        ctx = self.stack[-1] if self.stack else "embed"
        if ctx == "attn":
            return "attn_kv" if name == "strata_attn_decode_gqa" else "attn_proj"
        if ctx == "moe":
            if name in ("strata_moe_gate_up", "strata_moe_down"):
                self.moe_seen.add("experts")
                return "experts"
            if name in ("strata_moe_route", "strata_moe_count"):
                self.moe_seen.add("route")
                return "router"
            return "router" if "route" not in self.moe_seen else "shared"
        return ctx

    def __enter__(self):
        import contextlib
        from strata.backend.cuda import library as KL
        from strata.backend.cuda import moe
        real = KL.lib()
        lab = self

        class Proxy:
            def __getattr__(self, name):
                fn = getattr(real, name)
                if not name.startswith("strata_") or not callable(fn) or name in NOT_LAUNCHES \
                        or name.endswith(("_supported", "_occupancy", "_max_tiles")):
                    return fn

                def wrapped(*args):
                    lab.calls.append((name, lab.part(name)))
                    with (lab.around(name, len(lab.calls) - 1) if lab.around else contextlib.nullcontext()):
                        return fn(*args)
                return wrapped
        proxy = Proxy()
        self.mods = [m for n, m in sys.modules.items() if n.startswith("strata.backend.cuda") and hasattr(m, "lib")
                     and callable(getattr(m, "lib"))]
        self.saved = {m: m.lib for m in self.mods}
        for m in self.mods:
            m.lib = lambda: proxy
        p = self.plan

        def ctx(label, fn):
            def w(*a, **kw):
                self.stack.append(label)
                if label == "moe":
                    self.moe_seen = set()
                try:
                    return fn(*a, **kw)
                finally:
                    self.stack.pop()
            return w
        for meth, label in (("_gdn", "gdn"), ("_attn", "attn"), ("_norm", "norms"), ("_head", "head"),
                            ("_embed_row", "embed")):
            setattr(p, meth, ctx(label, getattr(p, meth)))
        self.moe_decode = moe.decode
        moe.decode = ctx("moe", moe.decode)
        return self

    def __exit__(self, *exc):
        from strata.backend.cuda import moe
        for m, v in self.saved.items():
            m.lib = v
        for meth in ("_gdn", "_attn", "_norm", "_head", "_embed_row"):
            self.plan.__dict__.pop(meth, None)
        moe.decode = self.moe_decode
        return False


def eager_step(plan, restore, run_step, around=None) -> list[tuple[str, str]]:
    """One decode step with graphs off under a Labeller: the (launcher, part) list; then restore()."""
    use0 = plan.use_graphs
    plan.use_graphs = False
    try:
        with Labeller(plan) as lab:
            lab.around = around
            run_step()
    finally:
        plan.use_graphs = use0
    restore()
    return lab.calls


def events_profile(plan, restore, run_step) -> dict:
    """Per part µs of an eager step, each launch between two CUDA events, behind a spin kernel (module doc)."""
    import contextlib

    import cupy as cp
    recs: list = []

    spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long ns) {
        long long t0 = clock64(); while (clock64() - t0 < ns) {} }''', "spin")

    @contextlib.contextmanager
    def around(name, idx):
        s = plan.stream.ptr
        if idx == 0:          # after the step's set-up copies: every launch queues behind the spin
            with plan.stream:
                spin((1,), (1,), (np.int64(300_000_000),))
        a, b = cp.cuda.Event(), cp.cuda.Event()
        cp.cuda.runtime.eventRecord(a.ptr, s)
        yield
        cp.cuda.runtime.eventRecord(b.ptr, s)
        recs.append((a, b))
    calls = eager_step(plan, restore, run_step, around)
    cp.cuda.Device().synchronize()
    parts: dict[str, float] = {}
    for (name, part), (a, b) in zip(calls, recs):
        parts[part] = parts.get(part, 0.0) + cp.cuda.get_elapsed_time(a, b) * 1e3
    return {"parts_us": {k: round(v, 2) for k, v in parts.items()}, "sum_us": round(sum(parts.values()), 1),
            "launches": len(calls)}


def cupti_kernels(run) -> tuple[list, list] | None:
    """(kernels [(name, start us, dur us, correlation)], runtime launches [(start us, correlation)]) of run(), from
    torch.profiler's CUPTI records; None without torch or kernel records."""
    ev = trace_events(run, cpu=True)
    if ev is None:
        return None
    ks = [(e["name"], float(e["ts"]), float(e.get("dur", 0)), (e.get("args") or {}).get("correlation"))
          for e in ev if e.get("cat") == "kernel" and e.get("ph") == "X"]
    rt = [(float(e["ts"]), (e.get("args") or {}).get("correlation"), e["name"])
          for e in ev if e.get("cat") == "cuda_runtime" and e.get("ph") == "X"]
    ann = [(float(e["ts"]), float(e.get("dur", 0)), e["name"]) for e in ev if e.get("cat") == "user_annotation"]
    if not ks:
        return None
    return sorted(ks, key=lambda k: k[1]), (sorted(rt), sorted(ann))


def graph_profile(plan, restore, run_step) -> dict:
    """Per part µs of the captured step replayed under CUPTI, labelled from an eager step (module doc)."""
    import contextlib

    import torch

    # the eager step under the profiler: each launcher call inside a record_function range, which waits for the
    # launch's kernels, names them (by their runtime launch call's time, else by their own)
    @contextlib.contextmanager
    def around(name, idx):
        with torch.profiler.record_function(f"L{idx}"):
            yield
            plan.stream.synchronize()
    calls_box: list = [[]]

    def eager():
        calls_box[0] = []
        use0 = plan.use_graphs
        plan.use_graphs = False
        try:
            with Labeller(plan) as lab:
                lab.calls = calls_box[0]
                lab.around = around
                run_step()
        finally:
            plan.use_graphs = use0
    got = cupti_kernels(eager)
    restore()
    if got is None:
        return {"error": "no CUPTI kernel records (torch.profiler)"}
    eks, (rt, ann) = got
    calls = calls_box[0]
    # kernel -> launcher index: its runtime launch call's time inside the launcher's annotation range
    spans = sorted((ts, ts + d, int(n[1:])) for ts, d, n in ann if re.fullmatch(r"L\d+", n))
    corr_t = {c: ts for ts, c, nm in rt if c is not None and "aunch" in nm}
    eager_labels: list[str | None] = []
    by_launch = by_kernel = 0
    for name, ts, dur, c in eks:
        idx = None
        t = corr_t.get(c)
        for probe in ((t,) if t is not None else ()) + (ts + dur / 2,):
            idx = next((i for a, b, i in spans if a <= probe <= b), None)
            if idx is not None:
                if probe is t:
                    by_launch += 1
                else:
                    by_kernel += 1
                break
        eager_labels.append(calls[idx][1] if idx is not None and idx < len(calls) else None)
    labelled = sum(x is not None for x in eager_labels)
    how = f"{by_launch} by their launch call, {by_kernel} by their own time"
    # the graph step
    gks = cupti_kernels(run_step)
    restore()
    if gks is None:
        return {"error": "no kernel records of the graph replay"}
    gk = [k for k in gks[0] if not k[0].startswith("spin")]
    names_e = [short_name(k[0]) for k in eks]
    names_g = [short_name(k[0]) for k in gk]
    out = {"labels_by": how, "eager_kernels": len(eks), "eager_labelled": labelled, "graph_kernels": len(gk),
           "launcher_calls": len(calls)}
    # the graph's kernels: the step's own (drop copies of inp etc.: those are not kernels); align by name order
    if names_g != names_e:
        # the replay may hold extra kernels around the step (e.g. a memset); keep the longest run that matches
        j = next((i for i in range(len(names_g) - len(names_e) + 1) if names_g[i:i + len(names_e)] == names_e), None)
        if j is None:
            out["error"] = "the graph's kernels differ from the eager step's"
            out["graph_names_head"] = names_g[:12]
            out["eager_names_head"] = names_e[:12]
            return out
        gk = gk[j:j + len(names_e)]
    busy: dict[str, float] = {}
    line: dict[str, float] = {}
    kern: dict[str, dict[str, float]] = {}
    for i, (name, ts, dur, _) in enumerate(gk):
        p = eager_labels[i] or "unlabelled"
        nxt = gk[i + 1][1] if i + 1 < len(gk) else ts + dur
        busy[p] = busy.get(p, 0.0) + dur
        line[p] = line.get(p, 0.0) + (nxt - ts)
        kk = kern.setdefault(p, {})
        kk[short_name(name)] = kk.get(short_name(name), 0.0) + dur
    span = gk[-1][1] + gk[-1][2] - gk[0][1]
    out.update({"span_us": round(span, 1), "busy_us": round(sum(busy.values()), 1),
                "parts_busy_us": {k: round(v, 2) for k, v in busy.items()},
                "parts_timeline_us": {k: round(v, 2) for k, v in line.items()},
                "kernels_by_part_us": {p: {k: round(v, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}
                                       for p, d in kern.items()}})
    return out


def part_bytes(path: str, plan, depth: int) -> dict[str, float]:
    """Bytes a decode step must read per part (the plan's layers' weights; k / n_expert of the routed experts; K/V at
    `depth`)."""
    from strata.gguf.file import open_gguf
    f = open_gguf(path)
    m = plan.model
    out = {p: 0.0 for p in PARTS}
    k, ne = m.n_expert_used, m.n_expert
    for name, t in f.tensors.items():
        nb = float(t.nbytes)
        blk = re.match(r"blk\.(\d+)\.", name)
        if blk and not plan.lo <= int(blk.group(1)) < plan.hi:       # the MTP block and other carves' layers
            continue
        if name == "token_embd.weight":
            out["embed"] += nb / t.shape[0]
        elif name == "output.weight":
            out["head"] += nb
        elif re.search(r"\.(attn_qkv|attn_gate|ssm_beta|ssm_alpha|ssm_ba|ssm_out|ssm_conv1d)\.", name):
            out["gdn"] += nb
        elif re.search(r"\.(attn_q|attn_k|attn_v|attn_output)\.", name):
            out["attn_proj"] += nb
        elif "ffn_gate_inp.weight" in name:
            out["router"] += nb
        elif "_exps." in name:
            out["experts"] += nb * k / ne
        elif "_shexp" in name:
            out["experts" if any(getattr(L, "ride", False) for L in plan.moe.values()) else "shared"] += nb
        elif "norm" in name:
            out["norms"] += nb
    n_attn = sum(1 for li in range(plan.lo, plan.hi) if not m.layers[li].recurrent)
    out["attn_kv"] = float(n_attn * 2 * plan.n_kv * plan.hd * 2 * max(1, depth))    # f16 K and V
    return out


def attn_sweep(plan, splits: list[int], reps: int = 20) -> dict:
    """µs of one decode attention launch (the plan's first attention layer, its current length) per split-K count: a
    graph of `reps` launches, the best of 5 replays."""
    import cupy as cp
    from strata.backend.cuda.library import check, ffi, lib, ptr, stream_ptr
    li = next(i for i in range(plan.lo, plan.hi) if not plan.model.layers[i].recurrent)
    pool, d = plan.pool, plan.d
    slot = pool.slot(li)
    kc, vc = pool.k[slot], pool.v[slot]
    ks, vs = pool.scales(slot)
    len_p = ffi().cast("int *", d["inp"].data.ptr + 8)
    ctr = ffi().cast("unsigned *", d["counters"].data.ptr)
    out = {}
    s = plan.stream
    for n_split in splits:
        def launch():
            check(lib().strata_attn_decode_gqa(stream_ptr(), ptr(d["qkv"]), ptr(kc), ptr(vc), ptr(pool._pt), len_p, 0,
                                               ptr(d["partial"]), ctr, ptr(d["att"]), ffi().NULL, plan.n_head,
                                               plan.n_kv, plan.hd, pool.page_size, n_split, plan.scale, ptr(ks),
                                               ptr(vs)), "strata_attn_decode_gqa")
        with s:
            launch()
            s.begin_capture()
            for _ in range(reps):
                launch()
            g = s.end_capture()
            best = float("inf")
            for _ in range(5):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(s)
                g.launch(s)
                b.record(s)
                b.synchronize()
                best = min(best, cp.cuda.get_elapsed_time(a, b) * 1e3 / reps)
        out[str(n_split)] = round(best, 2)
    return out


def llama_tg(bin_path: str, path: str, depths: list[int], n_gen: int) -> dict:
    cmd = [bin_path, "-m", path, "-ngl", "99", "-fa", "1", "-ub", "512", "-b", "2048", "-r", "2", "-o", "json",
           "-p", "0", "-n", str(n_gen), "-d", ",".join(map(str, depths))]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"cmd": " ".join(cmd), "error": p.stderr[-1500:]}
    res = {"cmd": " ".join(cmd), "decode": {}}
    for row in json.loads(p.stdout):
        res["decode"][str(row.get("n_depth", 0))] = row["avg_ts"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--depths", default="0,4096,16384")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--splits", default="8,16,32,64,128", help="split-K counts of the attention sweep ('' = none)")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--strata-from", default=None, help="a JSON this script wrote: add llama-bench's rows to it")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    depths = [int(x) for x in a.depths.split(",") if x]
    res = json.loads(Path(a.strata_from).read_text()) if a.strata_from else strata_rows(a, depths)
    if a.llama_bench and os.path.exists(a.llama_bench):
        res["llama.cpp"] = llama_tg(a.llama_bench, a.model, depths, a.n_gen)
        print("llama.cpp:", res["llama.cpp"].get("decode") or res["llama.cpp"].get("error"), flush=True)
        lc = res["llama.cpp"].get("decode", {})
        res["ratio_strata_over_llamacpp"] = {d: round(res["depths"][d]["decode_tok_s"] / lc[d], 3)
                                             for d in res["depths"] if d in lc}
        print("Strata / llama.cpp decode:", res["ratio_strata_over_llamacpp"], flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        print("wrote", a.out)
    return 0


def strata_rows(a, depths: list[int]) -> dict:
    """Strata's rows (module doc) per depth."""
    import cupy as cp
    from bench.common import commit as bench_commit
    from bench.gpu_throughput import copy_bandwidth
    from strata.backend.cuda import CudaBackend
    from strata.models.registry import load_model
    t0 = time.perf_counter()
    model = load_model(a.model, CudaBackend())
    fast = model.backend.fast_path(model)
    pool = model.new_page_pool(max(depths) + a.n_gen + 512)
    st = model.new_state(pool)
    plan = fast.plan(pool)
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"]
    gpu = gpu.decode() if isinstance(gpu, bytes) else str(gpu)
    bw = copy_bandwidth(cp)
    res = {"what": "bench/moe_decode_profile.py", "model": os.path.basename(a.model), "gpu": gpu, "commit": bench_commit(),
           "copy_bandwidth_Bps": bw, "load_s": round(time.perf_counter() - t0, 1), "n_gen": a.n_gen,
           "shared_rides_along": any(m.ride for m in plan.moe.values()),
           "layers": {"gdn": sum(1 for L in model.layers[plan.lo:plan.hi] if L.recurrent),
                      "attention": sum(1 for L in model.layers[plan.lo:plan.hi] if not L.recurrent),
                      "moe": len(plan.moe)}, "depths": {}}
    print(f"loaded in {res['load_s']} s; copy bandwidth {bw / 1e12:.2f} TB/s; layers {res['layers']}", flush=True)
    rng = np.random.default_rng(0)
    vocab = model.config.n_vocab
    sync = cp.cuda.Device().synchronize
    fast.forward(rng.integers(0, vocab, 512).astype(np.int32), st)          # warm-up
    for d in depths:
        st.reset()
        toks = rng.integers(0, vocab, d).astype(np.int32)
        for s0 in range(0, d, 512):
            fast.forward(toks[s0:s0 + 512], st)
        snap = st.capture()
        plan.decode_greedy(1, 8, st)                                         # graphs of this size class
        st.restore(snap)
        sync()
        t1 = time.perf_counter()
        plan.decode_greedy(1, a.n_gen, st)
        dt = time.perf_counter() - t1
        st.restore(snap)
        row = res["depths"][str(d)] = {"decode_tok_s": round(a.n_gen / dt, 1), "step_us": round(1e6 * dt / a.n_gen, 1)}
        # the profiled steps: in the middle of the timed run's context, each put back after it ran
        plan.decode_greedy(1, a.n_gen // 2, st)
        mid = st.capture()

        def run_step():
            plan.decode_greedy(1, 1, st)

        def back():
            st.restore(mid)
        sync()
        try:
            row["events"] = events_profile(plan, back, run_step)
        except Exception as e:                                           # noqa: BLE001 - report, keep going
            row["events"] = {"error": f"{type(e).__name__}: {e}"[:300], "parts_us": {}}
        try:
            row["graph"] = graph_profile(plan, back, run_step)
        except Exception as e:                                           # noqa: BLE001 - report, keep going
            row["graph"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        by = part_bytes(a.model, plan, st.pos)
        row["bytes"] = {k: int(v) for k, v in by.items()}
        row["floor_us"] = {k: round(v / bw * 1e6, 2) for k, v in by.items()}
        row["floor_step_us"] = round(sum(by.values()) / bw * 1e6, 1)
        if a.splits and d >= 1024 and any(not L.recurrent for L in model.layers):
            from strata.backend.cuda import settings
            back()
            with plan.stream:                                                # this sequence's page table
                plan.pool.table(st.kv.pages)
            plan.d["inp"].set(np.asarray([0, st.pos - 1, st.pos], np.int32), stream=plan.stream)   # len: written
            sync()
            row["attn_split_us"] = attn_sweep(plan, [n for n in (int(x) for x in a.splits.split(","))
                                                     if st.pos // n >= 32])
            row["attn_split_plan"] = plan._step_args(settings.size_class(st.pos + 1))[0]
        mid.release()
        snap.release()
        g = row["graph"]
        parts = g.get("parts_timeline_us") or row["events"]["parts_us"]
        print(f"depth {d}: {row['decode_tok_s']} tok/s ({row['step_us']} us/step, bandwidth floor "
              f"{row['floor_step_us']} us); graph span {g.get('span_us')} us: "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
              + f" | events: " + ", ".join(f"{k} {v:.0f}" for k, v in row["events"]["parts_us"].items())
              + (f" | attn split us {row.get('attn_split_us')} (plan {row.get('attn_split_plan')})"
                 if "attn_split_us" in row else "") + (f" | graph error {g['error']}" if "error" in g else ""),
              flush=True)
        if a.out:                                          # what ran so far survives a later failure
            Path(a.out + ".partial").write_text(json.dumps(res, indent=1) + "\n")
    del plan, st, pool, fast, model
    cp.get_default_memory_pool().free_all_blocks()
    return res


if __name__ == "__main__":
    sys.exit(main())
