"""Reference logits from llama.cpp (llama-cpp-python, CPU) for Strata's synthetic hybrid GGUFs, stored in tests/data/.

Run once (needs llama-cpp-python, not needed by the tests themselves):
    PYTHONPATH=. python tools/hybrid_llamacpp_reference.py [--out tests/data]

For each architecture (qwen3next, qwen35, qwen35moe, nemotron_h) it writes the synthetic model of ``spec_for``
(deterministic from its seed) to a temporary file, reads a fixed 300-token prompt with llama.cpp (``logits_all``), and stores ``hybrid_<arch>_llamacpp.json``: the spec, the
file's sha256, the prompt, and at positions 0, 62, 63, 64, 299 the full-vocabulary argmax plus the logits of a
fixed sample of vocabulary ids (the sample keeps the data small), and ``greedy``: the N_GREEDY tokens llama.cpp
picks greedily after the prompt, one decode step each, with ``greedy_logits``, the sampled logits after the last.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from strata.gguf import synth  # noqa: E402

ARCHS = ("qwen3next", "qwen35", "qwen35moe", "nemotron_h")
POSITIONS = (0, 62, 63, 64, 299)
N_PROMPT = 300
N_SAMPLE = 256
N_GREEDY = 16


def spec_for(arch: str) -> synth.SynthSpec:
    """The synthetic model the llama.cpp data is made from (F32 weights: llama.cpp then does fp32 matmuls)."""
    return synth.preset(arch, "tiny", qtype="F32", embd_qtype="F32", seed=1234)


def prompt_and_sample(n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(77)
    return rng.integers(0, n_vocab, N_PROMPT).astype(np.int32), np.sort(rng.choice(n_vocab, N_SAMPLE, replace=False))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "data"))
    ap.add_argument("--arch", action="append", choices=ARCHS)
    args = ap.parse_args()
    import llama_cpp
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for arch in args.arch or ARCHS:
        spec = spec_for(arch)
        with tempfile.TemporaryDirectory() as td:
            path = synth.write_synthetic(Path(td) / f"{arch}.gguf", spec)
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True,
                                  n_threads=2, n_gpu_layers=0, verbose=False)
            n_vocab = llm.n_vocab()
            toks, sample = prompt_and_sample(n_vocab)
            llm.eval(toks.tolist())
            scores = np.asarray(llm.scores[:N_PROMPT], dtype=np.float32)
            greedy = [int(scores[-1].argmax())]
            while len(greedy) < N_GREEDY:
                llm.eval([greedy[-1]])
                greedy.append(int(np.asarray(llm.scores[N_PROMPT + len(greedy) - 1]).argmax()))
            rec = {
                "arch": arch, "spec": dataclasses.asdict(spec), "gguf_sha256": sha256(path),
                "llama_cpp_python": llama_cpp.__version__, "prompt": toks.tolist(), "sample_ids": sample.tolist(),
                "positions": list(POSITIONS),
                "argmax": [int(scores[p].argmax()) for p in POSITIONS],
                "logits": [[round(float(v), 5) for v in scores[p, sample]] for p in POSITIONS],
                "greedy": greedy,
                "greedy_logits": [round(float(v), 5) for v in np.asarray(llm.scores[N_PROMPT + N_GREEDY - 2])[sample]],
            }
            del llm
        (out / f"hybrid_{arch}_llamacpp.json").write_text(json.dumps(rec) + "\n")
        print(f"{arch}: wrote {out / f'hybrid_{arch}_llamacpp.json'} (argmax {rec['argmax']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
