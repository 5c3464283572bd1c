"""Command line for strata.gguf.synth: write a synthetic GGUF (random weights, real tokenizer) of a supported architecture.

Examples:
    PYTHONPATH=. python tools/synth_gguf.py qwen3next /tmp/tiny.gguf                       # tiny, < 5 MB
    PYTHONPATH=. python tools/synth_gguf.py qwen35moe /tmp/big.gguf --size large --qtype Q8_0
    PYTHONPATH=. python tools/synth_gguf.py qwen35 /tmp/m.gguf --set n_layer=8 --set n_embd=256 --hf-out /tmp/m_hf
    PYTHONPATH=. python tools/synth_gguf.py nemotron_h /tmp/nh.gguf --set hybrid_pattern=M-M*M-M-    # Mamba2 hybrid
    PYTHONPATH=. python tools/synth_gguf.py qwen35 /tmp/q.gguf --chat-template tests/data/templates/Qwen3.5-4B.jinja
    PYTHONPATH=. python tools/synth_gguf.py qwen35moe /tmp/skew.gguf --set n_expert=128 --set n_expert_used=8 \
        --set router_zipf=1.2 --set router_topics=4          # skewed routers whose hot set follows the topic
--hf-out also writes the same weights for transformers (config.json + model.safetensors-like torch file).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.gguf import synth  # noqa: E402


def _parse_set(items: list[str]) -> dict:
    types = {f.name: f.type for f in dataclasses.fields(synth.SynthSpec)}
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"--set wants FIELD=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        if k not in types:
            raise SystemExit(f"unknown spec field {k!r}; fields: {', '.join(types)}")
        t = types[k]
        try:
            out[k] = (v.lower() in ("1", "true", "yes")) if t in (bool, "bool") else \
                int(v) if t in (int, "int") else float(v) if t in (float, "float") else v
        except ValueError:
            raise SystemExit(f"--set {k}: not a {getattr(t, '__name__', t)}: {v!r}") from None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arch", choices=synth.ARCHS)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small", "medium", "large"))
    ap.add_argument("--qtype", help=f"type of weight matrices: {', '.join(synth.QUANTIZABLE)}")
    ap.add_argument("--embd-qtype", help="type of token_embd / output")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a SynthSpec field")
    ap.add_argument("--hf-out", type=Path, help="directory for the transformers export (config.json, weights.pt)")
    ap.add_argument("--chat-template", type=Path, metavar="FILE",
                    help="a jinja file written as the model's tokenizer.chat_template (default: the default model's), "
                         "e.g. tests/data/templates/Qwen3.5-4B.jinja")
    a = ap.parse_args(argv)
    kw = _parse_set(a.set)
    if a.hf_out and a.arch == "nemotron_h":
        print("error: --hf-out: no transformers export for nemotron_h", file=sys.stderr)
        return 2
    if a.arch == "nemotron_h" and "n_layer" in kw and "hybrid_pattern" not in kw:
        kw["hybrid_pattern"] = ("M-M*" * kw["n_layer"])[:kw["n_layer"]]
    if a.qtype:
        kw["qtype"] = a.qtype
    if a.embd_qtype:
        kw["embd_qtype"] = a.embd_qtype
    overrides = None
    if a.chat_template:
        try:
            overrides = {"tokenizer.chat_template": a.chat_template.read_text()}
        except OSError as e:
            print(f"error: --chat-template: {e.strerror}: {a.chat_template}", file=sys.stderr)
            return 2
    try:
        spec = synth.preset(a.arch, a.size, seed=a.seed, **kw)
        path = synth.write_synthetic(a.out, spec, progress=a.size != "tiny", overrides=overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    if a.hf_out:
        import numpy as np
        import torch
        cfg, sd = synth.export_hf(path)
        a.hf_out.mkdir(parents=True, exist_ok=True)
        (a.hf_out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        torch.save({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, a.hf_out / "weights.pt")
        print(f"wrote {a.hf_out}/config.json and weights.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
