"""Cost of the stage link's row ids (+rowids) on a batched decode step, on the CPU: each BatchForward answered with
BatchRows (each row's sequence and position, checked by the main: strata.stages.link_client.rows_fault) against the
plain BatchResult, in the same run.

Two arms, each with and without ids:
- codec: in process, the worker's encode + send of the answer and the main's receive + decode + check of it, for
  N rows of n_embd (min of repeats), plain frames and the keyed link's default protection (mac);
- worker: a real keyed `strata worker` (default model, layers n/3..n, --threads 1) on loopback, the main's
  BatchForward of N rows a step, a fresh connection per interleaved round and arm (Hello slots N, row_ids on or off),
  link time per step = the round trip less the compute the answer reports.
The ratio "ids / no ids" of each is printed and written.

    python bench/link_row_ids.py [--rows 2,4,8] [--steps 120] [--rounds 4]

Writes bench/results/link_row_ids_<cpu>_<commit>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from cpu_throughput import cpu_name  # noqa: E402  -- the CPU's name in the result's file name
from bench.common import commit  # noqa: E402
from link_mac import _Source, _start_worker, best  # noqa: E402

import link  # noqa: E402
from link import FRAMES_MAC, BatchForward, BatchResult, BatchRows  # noqa: E402
from strata.stages.link_client import rows_fault  # noqa: E402


def answers(n: int, n_embd: int):
    """(seqs, positions, the BatchResult, the BatchRows) of a step of n rows."""
    seqs, pos = list(range(n)), [100 + 7 * i for i in range(n)]
    h = np.random.default_rng(n).standard_normal((n, n_embd)).astype(np.float32)
    return seqs, pos, BatchResult(1234, h), BatchRows(1234, h, [], seqs, pos)


def _step(msg, frames, seqs, pos, flag):
    """One answer's trip through the codec: the worker's send (encode, and seal for mac) into memory, the main's
    receive (open, decode) and check (rows_fault), in sequence so that the two channels' counts stay in step."""
    from link_mac import KEY, NONCES, _Sink
    tx, rx = (link.channel_for("worker", KEY, *NONCES, frames), link.channel_for("main", KEY, *NONCES, frames)) \
        if frames else (None, None)
    sink = _Sink()

    def step():
        link.send_frame(sink, msg, 2, channel=tx)
        got = link.recv_frame(_Source(b"".join(sink.parts)), 1 << 30, rx)[1]
        if rows_fault(got, seqs, pos, flag) is not None:
            raise RuntimeError("the answer's rows do not check")
    return step


def _parts(msg, seqs, pos, flag) -> dict:
    """The answer's trip in parts, plain frames: the worker's send, the main's receive + decode, its check."""
    from link_mac import _Sink
    sink = _Sink()
    link.send_frame(sink, msg, 2)
    data = b"".join(sink.parts)
    got = link.recv_frame(_Source(data), 1 << 30)[1]
    return {"send": lambda: link.send_frame(sink, msg, 2), "recv": lambda: link.recv_frame(_Source(data), 1 << 30),
            "check": lambda: rows_fault(got, seqs, pos, flag)}


def codec_arm(rows: list[int], n_embd: int, n: int, trials: int) -> dict:
    """Microseconds per answer of each arm: the min over `trials` interleaved timings of n steps each (and, plain
    frames, of each part of the step)."""
    out = {}
    for frames in (None, FRAMES_MAC):
        for k in rows:
            seqs, pos, plain, ids = answers(k, n_embd)
            steps = {"no_ids": _step(plain, frames, seqs, pos, False), "ids": _step(ids, frames, seqs, pos, True)}
            parts = {"no_ids": _parts(plain, seqs, pos, False), "ids": _parts(ids, seqs, pos, True)}
            got = {name: float("inf") for name in steps}
            part = {(name, p): float("inf") for name in parts for p in parts[name]}
            for t in range(trials):
                for name in (("no_ids", "ids") if t % 2 == 0 else ("ids", "no_ids")):
                    got[name] = min(got[name], best(steps[name], n, repeat=1))
                    if frames is None:
                        for p, fn in parts[name].items():
                            part[name, p] = min(part[name, p], best(fn, n, repeat=1))
            arm = {name: {"us": round(v * 1e6, 3), "frame_bytes": len(link.frame_bytes(m, 2))}
                   for (name, v), m in zip(got.items(), (plain, ids))}
            if frames is None:
                for (name, p), v in part.items():
                    arm[name][f"{p}_us"] = round(v * 1e6, 3)
            arm["added_us"] = round(arm["ids"]["us"] - arm["no_ids"]["us"], 3)
            arm["ratio"] = round(arm["ids"]["us"] / arm["no_ids"]["us"], 4)
            out[f"{frames or 'plain'}_rows{k}"] = arm
    return out


def worker_round(address: str, key: bytes, n_rows: int, row_ids: bool, steps: int, f, n_embd: int, n_blocks: int):
    """Link seconds of each BatchForward step of one fresh connection (round trip less the reported compute), and
    whether ids were agreed."""
    from strata.stages.link_client import LinkClient
    c = LinkClient(address, key)
    c.connect(link.Hello(protocol=5, fingerprint=f.fingerprint(), lo=n_blocks // 3, hi=n_blocks, n_blocks=n_blocks,
                         n_embd=n_embd, act_dtype="f32", n_ctx=max(256, steps + 16), max_batch=8, ckpt_max=0,
                         next_hops=[], nonce=b"", mac=b"", slots=n_rows, row_ids=row_ids))
    rng = np.random.default_rng(0)
    seqs, out = list(range(n_rows)), []
    try:
        for step in range(steps):
            pos = [step] * n_rows
            bf = BatchForward(seqs=seqs, positions=pos, tokens=rng.integers(0, 1000, n_rows).astype(np.int32),
                              hidden=(rng.standard_normal((n_rows, n_embd)) * 0.1).astype(np.float32))
            t0 = time.perf_counter()
            r = c.call(bf)
            fault = rows_fault(r, seqs, pos, c.row_ids)
            dt = time.perf_counter() - t0
            if fault is not None:
                raise RuntimeError(f"the worker's answer: {fault}")
            if step >= 10:
                out.append(dt - r.compute_us * 1e-6)
    finally:
        agreed = c.row_ids
        c.close()
    return out, agreed


def worker_arm(n_rows: int, steps: int, rounds: int) -> dict:
    from strata.gguf.default_model import resolve_model
    from strata.gguf.file import open_gguf
    from strata.models.registry import model_class, supported_archs
    from strata.stages import n_main_blocks
    f = open_gguf(resolve_model("default"), archs=supported_archs())
    n_embd, n_blocks = int(f.config.n_embd), n_main_blocks(f, model_class(f.arch))
    with tempfile.TemporaryDirectory() as d:
        key_file = Path(d) / "link.key"
        key = link.write_key_file(key_file)
        proc, address = _start_worker("--link-key-file", str(key_file))
        try:
            times: dict = {"no_ids": [], "ids": []}
            medians: dict = {"no_ids": [], "ids": []}
            for r in range(rounds):
                for name in (("no_ids", "ids") if r % 2 == 0 else ("ids", "no_ids")):
                    got, agreed = worker_round(address, key, n_rows, name == "ids", steps, f, n_embd, n_blocks)
                    assert agreed == (name == "ids")
                    times[name] += got
                    medians[name].append(round(statistics.median(got) * 1e6, 1))
                    time.sleep(0.3)              # the worker notices the closed link before the next hello
        finally:
            proc.terminate()
            proc.wait(10)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rows": n_rows, "n_embd": n_embd, "steps": {k: len(v) for k, v in times.items()},
            "link_us_median": {k: round(v * 1e6, 1) for k, v in med.items()}, "round_medians_us": medians,
            "ratio": round(med["ids"] / med["no_ids"], 4),
            "added_us": round((med["ids"] - med["no_ids"]) * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-embd", type=int, default=576, help="hidden width of the codec arm (576: SmolLM2-135M)")
    ap.add_argument("--rows", default="2,4,8,16", help="rows per step of the codec arm")
    ap.add_argument("--repeat", type=int, default=2000, help="answers per timing of the codec arm")
    ap.add_argument("--trials", type=int, default=15, help="interleaved timings per codec arm (the min is kept)")
    ap.add_argument("--worker-rows", type=int, default=4, help="rows per step against the real worker (0: skip)")
    ap.add_argument("--steps", type=int, default=120, help="steps per round against the real worker")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds per arm against the real worker")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",") if x]
    codec = codec_arm(rows, args.n_embd, args.repeat, args.trials)
    for name, arm in codec.items():
        print(f"codec {name}: no ids {arm['no_ids']['us']:.2f} us, ids {arm['ids']['us']:.2f} us "
              f"(x{arm['ratio']:.4f}, {arm['added_us']:+.2f} us; frame {arm['no_ids']['frame_bytes']} -> "
              f"{arm['ids']['frame_bytes']} bytes)")
    worker = worker_arm(args.worker_rows, args.steps, args.rounds) if args.worker_rows else None
    if worker:
        print(f"worker, {worker['rows']} rows a step: link time per step, median, no ids "
              f"{worker['link_us_median']['no_ids']} us, ids {worker['link_us_median']['ids']} us "
              f"(x{worker['ratio']:.4f}, {worker['added_us']:+.1f} us); round medians {worker['round_medians_us']}")
    result = {
        "what": "stage-link row ids (+rowids: BatchRows answers, checked by the main) against plain BatchResult "
                "answers, on the CPU",
        "commit": commit(), "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
        "codec": codec, "worker": worker,
        "notes": "codec: in process, per answer, the worker's send (encode + frame, sealed for mac) and the "
                 "main's receive (read + open + decode) and rows_fault, the min over interleaved timings, for each "
                 "row count and protection; ratio = ids / no ids. worker: a real keyed strata worker (default "
                 "model, layers n/3..n, --threads 1) on loopback, one BatchForward of `rows` rows a step, a fresh "
                 "connection per round and arm (interleaved), link time = round trip (including the main's "
                 "check) less the compute the answer reports; ratio of the medians (a ratio within the spread of "
                 "round_medians_us is no measurable cost).",
    }
    tag = "".join(ch if ch.isalnum() else "_" for ch in cpu_name())[:40].strip("_")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"link_row_ids_{tag}_{result['commit']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
