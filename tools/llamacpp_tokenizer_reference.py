"""Writes llama.cpp's token ids for Strata's tokenizer test corpus into tests/data/tokenizer_*.json.

Run once (needs llama-cpp-python):  PYTHONPATH=. python tools/llamacpp_tokenizer_reference.py
- tests/data/tokenizer_llamacpp.json: the default model (SmolLM2, BPE "gpt2"/pre "smollm"), loaded with
  Llama(model_path, vocab_only=True); ids for every corpus string with parse_special False and True.
- tests/data/tokenizer_pre_llamacpp.json: the default model's vocabulary re-written (gguf.GGUFWriter) with
  tokenizer.ggml.pre set to llama-bpe, qwen2, default and gpt-2, and llama.cpp's ids for each.
- tests/data/tokenizer_spm_llamacpp.json: a tiny SentencePiece ("llama") vocabulary written to a GGUF with
  gguf.GGUFWriter (the vocabulary is stored in the JSON too), and llama.cpp's ids on it.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"

# Tricky strings: code, unicode, emoji, CJK, Arabic-Indic digits, whitespace runs, special-token text.
CORPUS: list[str] = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    "\t",
    "Hello world",
    " Hello world",
    "Hello  world  ",
    "What is the capital of France?",
    "I'm sure you've seen it, haven't you? They'll say we'd go.",
    "I'M SURE YOU'VE SEEN IT. 'S 'T 'RE",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }\t// comment",
    "if x == 1:\n\tprint('tab')\n\n\n    \n",
    "SELECT * FROM users WHERE id=42 AND name LIKE '%bob%';",
    "<div class=\"a\">&nbsp;</div>",
    "   leading spaces",
    "trailing spaces   ",
    "multiple     internal      spaces",
    "mixed \t\n \r\n whitespace \u00a0 nbsp \u2003 emspace",
    "\r\n\r\nCRLF lines\r\n",
    "1234567890",
    "3.14159 2,718 1e-10 0x1F -42 +7",
    "Numbers: 1 12 123 1234 12345 123456",
    "Arabic-Indic digits: \u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669 and \u06f1\u06f2\u06f3",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u0661\u0662\u0663",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\u4e2d\u6587\u5b57\u7b26\u3001\u6807\u70b9\u7b26\u53f7\uff01",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe",
    "e\u0301 combining acute, a\u0308",
    "\U0001f600\U0001f602\U0001f923 emoji \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467",
    "\U0001f1eb\U0001f1f7 flag and \u2764\ufe0f heart",
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u0926\u0947\u0935\u0928\u093e\u0917\u0930\u0940 \u0967\u0968\u0969",
    "math: \u2200x\u2208\u211d, x\u00b2 \u2265 0 \u2211 \u221e \u03c0\u22483.14",
    "zero\u200bwidth\u200cjoiners\u200d",
    "!!!???...,,,;;;:::",
    "$$$ +++ <<< >>> ^^^ ~~~ ||| ```",
    "\"quoted\" 'single' `back`",
    "<|im_start|>",
    "<|im_start|>user\nHello<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text before <|im_end|> text after",
    "<|im_start|><|im_end|><|endoftext|>",
    "<|im_start|<|im_start|>>",
    "<|endoftext|>",
    "almost special <|im_star|> <im_start> < |im_start| >",
    "<repo_name>strata<file_sep>main.py",
    "A" * 60,
    "ab" * 40,
    "\u00a0\u00a0\u00a0",
    "tab\tseparated\tvalues\t1\t2",
    "https://example.com/path?q=1&r=two#frag",
    "user@example.com",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    "\u00bd \u2154 \u00b2 \u2460 \u2167",
]

# A tiny SentencePiece vocabulary: built from this text deterministically.
SPM_TRAIN_TEXT = (
    "the quick brown fox jumps over the lazy dog. hello world, hello there! "
    "the theory of the thing is that these then thin threads thread through the theater. "
    "tokenizers are tricky: spaces, tabs and newlines all matter. "
    "\u65e5\u672c\u8a9e \u65e5\u672c caf\u00e9"
)
SPM_CORPUS: list[str] = [
    "",
    "hello world",
    " hello world",
    "hello  world",
    "the theater thread",
    "The Quick Brown Fox",
    "xyzzy qqq",
    "\u65e5\u672c\u8a9e\u3067\u3059",
    "caf\u00e9 \U0001f600",
    "tabs\tand\nnewlines\n",
    "<s>hello</s>",
    "a <tool> b<tool>c",
    "<|im_start|>user\nhello<|im_end|>",
    "   ",
    "thethethe",
]


def spm_vocab() -> dict:
    """The tiny SPM vocabulary: tokens, scores, token types and special ids (GGUF values)."""
    import collections

    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)
        scores.append(0.0)
    tokens += ["<|im_start|>", "<|im_end|>", "<tool>"]
    types += [3, 3, 4]
    scores += [0.0, 0.0, 0.0]
    text = SPM_TRAIN_TEXT.replace(" ", "\u2581")
    text = "\u2581" + text
    counts = collections.Counter()
    for word in text.split("\u2581"):
        w = "\u2581" + word
        for n in range(2, 7):
            for i in range(0, len(w) - n + 1):
                counts[w[i:i + n]] += 1
    chars = sorted(set(text) - {"\u65e5"})  # leave one CJK char out: it must go through byte fallback
    pieces = [p for p, c in counts.items() if c >= 2 and "\u65e5" not in p]
    pieces.sort(key=lambda p: (-counts[p] * len(p), p))
    base = -1.0
    for k, ch in enumerate(chars):
        tokens.append(ch)
        types.append(1)
        scores.append(base - 1000.0 - k)  # single characters: lowest scores
    for k, p in enumerate(pieces[:300]):
        tokens.append(p)
        types.append(1)
        scores.append(base - k * 1.0 - 0.5 * len(p) / 10.0)  # unique scores
    return {"tokens": tokens, "scores": scores, "token_type": types, "bos": 1, "eos": 2, "unk": 0}


def spm_metadata(v: dict) -> dict:
    """GGUF tokenizer metadata (key -> value) for spm_vocab()."""
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": v["tokens"],
        "tokenizer.ggml.scores": v["scores"],
        "tokenizer.ggml.token_type": v["token_type"],
        "tokenizer.ggml.bos_token_id": v["bos"],
        "tokenizer.ggml.eos_token_id": v["eos"],
        "tokenizer.ggml.unknown_token_id": v["unk"],
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }


OTHER_PRES = ["llama-bpe", "qwen2", "default", "gpt-2"]


def default_tokenizer_metadata() -> dict:
    """The default model's tokenizer.* metadata (key -> Python value) read with gguf.GGUFReader."""
    import gguf

    from strata.gguf.default_model import default_model_path

    r = gguf.GGUFReader(str(default_model_path()))
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.ggml.")}


def write_bpe_gguf(path: str | os.PathLike, md: dict, pre: str) -> None:
    """A vocab-only GGUF (arch llama) with the BPE vocabulary `md` and tokenizer.ggml.pre = pre."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    _tiny_hparams(w)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.add_tensor("token_embd.weight", np.zeros((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_hparams(w) -> None:
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)


def write_spm_gguf(path: str | os.PathLike, v: dict) -> None:
    """A vocab-only GGUF (arch llama, one tiny tensor) with the SPM vocabulary, via gguf.GGUFWriter."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    _tiny_hparams(w)
    w.add_tokenizer_model("llama")
    w.add_token_list(v["tokens"])
    w.add_token_scores(v["scores"])
    w.add_token_types(v["token_type"])
    w.add_bos_token_id(v["bos"])
    w.add_eos_token_id(v["eos"])
    w.add_unk_token_id(v["unk"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_tensor("token_embd.weight", np.zeros((len(v["tokens"]), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llamacpp_ids(llm, text: str, parse_special: bool, add_bos: bool = False) -> list[int]:
    return list(llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=parse_special))


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from llama_cpp import Llama

    from strata.gguf.default_model import default_model_path

    DATA.mkdir(parents=True, exist_ok=True)
    llm = Llama(model_path=str(default_model_path()), vocab_only=True, verbose=False)
    cases = []
    for text in CORPUS:
        for ps in (False, True):
            cases.append({"text": text, "parse_special": ps, "ids": llamacpp_ids(llm, text, ps)})
    (DATA / "tokenizer_llamacpp.json").write_text(json.dumps(
        {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "reference": "llama-cpp-python Llama(vocab_only=True).tokenize",
         "cases": cases}, ensure_ascii=False, indent=0))

    md = default_tokenizer_metadata()
    pre_cases = {}
    with tempfile.TemporaryDirectory() as d:
        for pre in OTHER_PRES:
            p = Path(d) / f"bpe-{pre}.gguf"
            write_bpe_gguf(p, md, pre)
            bpe = Llama(model_path=str(p), vocab_only=True, verbose=False)
            pre_cases[pre] = [{"text": t, "ids": llamacpp_ids(bpe, t, False)} for t in CORPUS]
            del bpe
    (DATA / "tokenizer_pre_llamacpp.json").write_text(json.dumps(
        {"vocab": "SmolLM2-135M-Instruct.Q4_1.gguf with tokenizer.ggml.pre replaced",
         "reference": "llama-cpp-python Llama(vocab_only=True).tokenize", "pres": pre_cases},
        ensure_ascii=False, indent=0))

    v = spm_vocab()
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "tiny-spm.gguf"
        write_spm_gguf(p, v)
        spm = Llama(model_path=str(p), vocab_only=True, verbose=False)
        spm_cases = []
        for text in SPM_CORPUS:
            for ps in (False, True):
                for bos in (False, True):
                    spm_cases.append({"text": text, "parse_special": ps, "add_bos": bos,
                                      "ids": llamacpp_ids(spm, text, ps, bos)})
        del spm
    (DATA / "tokenizer_spm_llamacpp.json").write_text(json.dumps(
        {"vocab": v, "reference": "llama-cpp-python Llama(vocab_only=True).tokenize", "cases": spm_cases},
        ensure_ascii=False, indent=0))
    print(f"wrote {len(cases)} + {len(spm_cases)} cases to {DATA}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
