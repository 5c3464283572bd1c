"""Writes llama.cpp's tokenizer defaults for GGUFs that leave keys out into tests/data/tokenizer_defaults_llamacpp.json.

Run once, with a built llama.cpp (libllama.so and include/llama.h; no Python bindings needed):
    PYTHONPATH=. python tools/llamacpp_defaults_reference.py LLAMA_CPP_SRC LIBDIR
e.g. LLAMA_CPP_SRC=/path/llama.cpp (for include/ and ggml/include/), LIBDIR=/path/llama.cpp/build/bin.
For each case it writes a small vocab-only GGUF with gguf.GGUFWriter whose metadata leaves out some of
tokenizer.ggml.add_bos_token / add_eos_token / bos_token_id / eos_token_id / unknown_token_id, loads it with
llama.cpp (vocab_only) through a small C driver, and records what llama.cpp reports: BOS/EOS ids, add_bos/add_eos,
the end-of-generation ids, and token ids for CORPUS with add_special on (parse_special off and on). The tiny BPE
vocabulary has whole words that its merges cannot build, so llama.cpp's ignore_merges shows in the ids.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "tokenizer_defaults_llamacpp.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_tokenizer_reference import _tiny_hparams  # noqa: E402

CORPUS = ["hello world", " hello world", "hello", "world", "helloworld", "hello, world! 123",
          "<|begin_of_text|>hello", "\x0bhi\x0b"]

DRIVER = r"""
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static void quiet(enum ggml_log_level l, const char * t, void * u) { (void) l; (void) t; (void) u; }
static int unhex(const char * h, char * out) {
    int n = 0; for (; h[0] && h[1]; h += 2) { unsigned v; sscanf(h, "%2x", &v); out[n++] = (char) v; } return n;
}
int main(int argc, char ** argv) {
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    struct llama_model * m = llama_model_load_from_file(argv[1], mp);
    if (!m) { fprintf(stderr, "load failed\n"); return 1; }
    const struct llama_vocab * v = llama_model_get_vocab(m);
    int n = llama_vocab_n_tokens(v);
    printf("{\"bos\": %d, \"eos\": %d, \"add_bos\": %d, \"add_eos\": %d, \"eog\": [", llama_vocab_bos(v),
           llama_vocab_eos(v), llama_vocab_get_add_bos(v), llama_vocab_get_add_eos(v));
    int first = 1;
    for (int i = 0; i < n; i++) if (llama_vocab_is_eog(v, i)) { printf(first ? "%d" : ", %d", i); first = 0; }
    printf("], \"ids\": [");
    for (int a = 2; a < argc; a++) {
        for (int ps = 0; ps < 2; ps++) {
            char buf[4096]; int len = unhex(argv[a], buf);
            llama_token toks[1024];
            int k = llama_tokenize(v, buf, len, toks, 1024, true, ps);
            printf("%s[", (a == 2 && ps == 0) ? "" : ", ");
            for (int j = 0; j < k; j++) printf(j ? ", %d" : "%d", toks[j]);
            printf("]");
        }
    }
    printf("]}\n");
    llama_model_free(m);
    return 0;
}
"""


def bpe_vocab() -> dict:
    """256 byte-level tokens (GPT-2 alphabet, byte order), merges for "hello"/"Ġhello", whole words without merges."""
    from strata.text.tokenizer import _BYTE_TO_CHAR

    tokens = [_BYTE_TO_CHAR[b] for b in range(256)]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ h", "Ġh e", "Ġhe ll", "Ġhell o", "w o", "r l"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    # Found whole by ignore_merges only: no merge chain reaches them.
    tokens += ["world", "Ġworld", "helloworld", "<|begin_of_text|>", "<|end_of_text|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return {"tokens": tokens, "token_type": types, "merges": merges, "bos": len(tokens) - 2,
            "eos": len(tokens) - 1}


# (name, model, pre, keys written): a key's value None leaves it out of the file.
CASES = [
    *[(f"{p}-no-add-bos", "gpt2", p, {"bos": True, "eos": True}) for p in
      ["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken"]],
    ("llama-bpe-add-bos-false", "gpt2", "llama-bpe", {"bos": True, "eos": True, "add_bos": False}),
    ("llama-bpe-no-ids", "gpt2", "llama-bpe", {}),
    ("qwen2-no-ids", "gpt2", "qwen2", {}),
    ("qwen2-add-bos-true", "gpt2", "qwen2", {"bos": True, "add_bos": True}),
    ("stablelm2", "gpt2", "stablelm2", {"bos": True, "eos": True}),
    ("dbrx", "gpt2", "dbrx", {"bos": True, "eos": True}),
    ("gpt-4o", "gpt2", "gpt-4o", {"bos": True, "eos": True}),
    ("spm-no-keys", "llama", None, {}),
    ("spm-add-eos-true", "llama", None, {"add_eos": True}),
]


def write_gguf(path: Path, model: str, pre: str | None, keys: dict) -> dict:
    """Writes the case's GGUF; returns its tokenizer.ggml.* metadata as Tokenizer.from_gguf reads it."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    _tiny_hparams(w)
    md: dict = {"tokenizer.ggml.model": model}
    if model == "gpt2":
        v = bpe_vocab()
        md.update({"tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": v["tokens"],
                   "tokenizer.ggml.token_type": v["token_type"], "tokenizer.ggml.merges": v["merges"]})
    else:
        v = json.loads((ROOT / "tests" / "data" / "tokenizer_spm_llamacpp.json").read_text())["vocab"]
        md.update({"tokenizer.ggml.tokens": v["tokens"], "tokenizer.ggml.token_type": v["token_type"],
                   "tokenizer.ggml.scores": v["scores"]})
    if keys.get("bos"):
        md["tokenizer.ggml.bos_token_id"] = v["bos"]
    if keys.get("eos"):
        md["tokenizer.ggml.eos_token_id"] = v["eos"]
    if "add_bos" in keys:
        md["tokenizer.ggml.add_bos_token"] = keys["add_bos"]
    if "add_eos" in keys:
        md["tokenizer.ggml.add_eos_token"] = keys["add_eos"]
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in md:
        w.add_token_merges(md["tokenizer.ggml.merges"])
    if "tokenizer.ggml.scores" in md:
        w.add_token_scores(md["tokenizer.ggml.scores"])
    if "tokenizer.ggml.bos_token_id" in md:
        w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    if "tokenizer.ggml.eos_token_id" in md:
        w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.add_bos_token" in md:
        w.add_add_bos_token(md["tokenizer.ggml.add_bos_token"])
    if "tokenizer.ggml.add_eos_token" in md:
        w.add_add_eos_token(md["tokenizer.ggml.add_eos_token"])
    w.add_tensor("token_embd.weight", np.zeros((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return md


def main() -> None:
    src, libdir = Path(sys.argv[1]), Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as td:
        tdp = Path(td)
        (tdp / "drv.c").write_text(DRIVER)
        subprocess.run(["gcc", "-O1", "-o", str(tdp / "drv"), str(tdp / "drv.c"), f"-I{src / 'include'}",
                        f"-I{src / 'ggml' / 'include'}", f"-L{libdir}", "-lllama", f"-Wl,-rpath,{libdir}"],
                       check=True)
        out = {"corpus": CORPUS, "cases": []}
        for name, model, pre, keys in CASES:
            path = tdp / f"{name}.gguf"
            md = write_gguf(path, model, pre, keys)
            r = subprocess.run([str(tdp / "drv"), str(path)] + [t.encode("utf-8").hex() for t in CORPUS],
                               check=True, capture_output=True, text=True)
            ref = json.loads(r.stdout)
            ids = ref.pop("ids")
            ref["ids"] = [{"text": t, "parse_special": bool(ps), "ids": ids[2 * i + ps]}
                          for i, t in enumerate(CORPUS) for ps in (0, 1)]
            keep = {k: val for k, val in md.items() if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                                  "tokenizer.ggml.merges", "tokenizer.ggml.scores")}
            out["cases"].append({"name": name, "metadata": keep, "llamacpp": ref})
    out["bpe_vocab"] = bpe_vocab()
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({len(out['cases'])} cases)")


if __name__ == "__main__":
    main()
