#!/usr/bin/env python3
"""Plots for docs/: bench/results/*.json -> docs/img/*.png (matplotlib, `pip install -e '.[bench]'`), one command.

  ttft_checkpoints.png  time to first token per step of a chat, with conversation checkpoints and with
                        --prompt-cache 0, for each system-prompt size (bench/prompt_cache.py's prompt_cache.json)
  gpu_vs_llamacpp.png   prompt and decode tokens/s, Strata vs llama.cpp, per model: each model's newest run (by its
                        "time") in bench/gpu_throughput.py's gpu_*.json files, or those of --gpu FILE
  startup.png           `strata serve` to healthy and `strata generate` wall time, before the header reader change,
                        now, and llama.cpp where measured (bench/startup.py's startup_cpu.json and its before file)
A plot whose results file is missing is skipped with a note.

Usage: python bench/plot.py [--results bench/results] [--out docs/img] [--gpu FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRATA, OTHER, BEFORE = "#2b6cb0", "#c05621", "#a0aec0"


def _plt():
    import matplotlib
    matplotlib.use("Agg")                     # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _bars(ax, groups: list[str], series: list[tuple[str, list[float | None], str]], *, log: bool = False,
          fmt: str = "{:.2f}") -> None:
    """Grouped bars: one group per label, one bar per (name, values, colour) series; values labelled on top."""
    width = 0.8 / len(series)
    for k, (name, vals, colour) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        hs = [v if v is not None else 0 for v in vals]
        bars = ax.bar(xs, hs, width, label=name, color=colour)
        for b, v in zip(bars, vals):
            if v is not None:
                ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                            va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.margins(y=0.18)                        # room for the value labels and the legend
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, framealpha=0.9)


def plot_ttft(results: Path, out: Path) -> Path | None:
    src = results / "prompt_cache.json"
    if not src.exists():
        print(f"skipped ttft_checkpoints.png: no {src}")
        return None
    d = json.loads(src.read_text())
    plt = _plt()
    sizes = list(d["sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        arms = d["sizes"][size]
        steps = [r["step"] for r in arms["checkpoints"]]
        off = {r["step"]: r["ttft_s"] for r in arms.get("prompt_cache_0", [])}
        _bars(ax, [s.replace(" (", "\n(") for s in steps],
              [("checkpoints (--prompt-cache 6)", [r["ttft_s"] for r in arms["checkpoints"]], STRATA),
               ("--prompt-cache 0", [off.get(s) for s in steps], BEFORE)], log=True)
        n = arms["checkpoints"][0].get("n_prompt")
        ax.set_title(f"system prompt ~{size} tokens (turn 1: {n} prompt tokens)", fontsize=10)
        ax.set_ylabel("time to first token (s, log)")
    fig.suptitle(f"Time to first token per chat step, {d.get('model', 'default')} on {d.get('cpus', '?')} CPU cores "
                 f"(bench/prompt_cache.py)", fontsize=11)
    fig.tight_layout()
    path = out / "ttft_checkpoints.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _gpu_rows(results: Path, only: Path | None) -> dict[str, tuple[str, dict, str]]:
    """{model file name: (results file name, its models entry, gpu)}: for each model, its newest run (by "time")
    among the gpu_*.json files that hold Strata's and llama.cpp's numbers (or only those of `only`)."""
    best: dict[str, tuple[str, str, dict, str]] = {}
    for p in [only] if only is not None else sorted(results.glob("gpu_*.json")):
        try:
            d = json.loads(p.read_text())
        except ValueError:
            continue
        models = d.get("models")
        if not isinstance(models, dict):
            continue
        for name, m in models.items():
            if not (isinstance(m, dict) and m.get("strata", {}).get("prompt") and m.get("llama.cpp", {}).get("prompt")):
                continue
            t = str(d.get("time") or "")
            if name not in best or t > best[name][0]:
                best[name] = (t, p.name, m, str(d.get("gpu", "GPU")))
    return {k: v[1:] for k, v in best.items()}


def plot_gpu(results: Path, out: Path, gpu: Path | None) -> Path | None:
    rows = _gpu_rows(results, gpu)
    if not rows:
        print("skipped gpu_vs_llamacpp.png: no gpu_*.json with Strata and llama.cpp numbers")
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, len(rows), figsize=(5.5 * len(rows), 7.5), squeeze=False)
    for j, (name, (src, m, _gpu)) in enumerate(rows.items()):
        for i, (kind, label) in enumerate((("prompt", "prompt tokens"), ("decode", "decode at depth"))):
            keys = sorted(m["strata"].get(kind, {}), key=int)
            ax = axes[i][j]
            _bars(ax, [f"{label}\n{k}" for k in keys],
                  [("Strata", [m["strata"][kind][k] for k in keys], STRATA),
                   ("llama.cpp", [m["llama.cpp"].get(kind, {}).get(k) for k in keys], OTHER)], fmt="{:.0f}")
            ax.set_ylabel(f"{kind} tokens/s")
            ax.set_title(f"{name}: {kind}\n({src})", fontsize=9)
    gpus = sorted({g for _, _, g in rows.values()})
    fig.suptitle(f"{', '.join(gpus)}: Strata vs llama.cpp on the same GGUF files (each model's newest run)",
                 fontsize=11)
    fig.tight_layout()
    path = out / "gpu_vs_llamacpp.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_startup(results: Path, out: Path) -> Path | None:
    src = results / "startup_cpu.json"
    if not src.exists():
        print(f"skipped startup.png: no {src}")
        return None
    d = json.loads(src.read_text())
    before_file = results / "startup_cpu_before.json"
    before = {r["model"]: r for r in json.loads(before_file.read_text())["rows"]} if before_file.exists() else {}
    plt = _plt()
    rows = d["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 4), squeeze=False)
    for ax, r in zip(axes[0], rows):
        b = before.get(r["model"], {})
        lc = r.get("llama_cpp", {})
        series = [("before (gguf-py's reader)", [b.get("serve_healthy_s"), b.get("generate_s")], BEFORE),
                  ("now", [r["serve_healthy_s"], r["generate_s"]], STRATA)]
        if lc:
            server = next((v for k, v in lc.items() if "server" in k), None)
            one = next((v for k, v in lc.items() if "server" not in k), None)
            series.append(("llama.cpp: " + ", ".join(lc), [server, one], OTHER))
        _bars(ax, ["serve -> healthy", "generate, 1 token"], series)
        ax.set_ylabel("wall time (s)")
        ax.set_title(f"{r['model']} ({r['file_bytes'] / 2 ** 20:.0f} MiB)", fontsize=10)
    fig.suptitle(f"Start-up on {d.get('cpu_count', '?')} CPU cores, best of {d.get('repeats', '?')} "
                 f"(bench/startup.py)", fontsize=11)
    fig.tight_layout()
    path = out / "startup.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ap.add_argument("--gpu", type=Path, default=None, help="the gpu_throughput JSON to plot (default: each model's newest run)")
    a = ap.parse_args(argv)
    try:
        _plt()
    except ImportError:
        print("bench/plot.py needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    for path in (plot_ttft(a.results, a.out), plot_gpu(a.results, a.out, a.gpu), plot_startup(a.results, a.out)):
        if path is not None:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
