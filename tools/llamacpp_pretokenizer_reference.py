"""Writes llama.cpp's pre-tokenizer splits (words before BPE) into tests/data/pretokenizer_llamacpp.json.

Run once, with a llama.cpp source tree or tarball and a C++ compiler (no Python bindings needed):
    PYTHONPATH=. python tools/llamacpp_pretokenizer_reference.py [.dev/A/llamacpp.tar.gz | path/to/llama.cpp]
It reads each name's regex list out of llama.cpp's src/llama-vocab.cpp (the `tokenizer_pre == "..."` -> pre type
mapping and the pre type's `regex_exprs`), pastes the C string literals verbatim into a small driver, compiles it
with src/unicode.cpp and src/unicode-data.cpp, and runs llama.cpp's own unicode_regex_split (custom splitters
included) over CORPUS. Nothing of Strata's regex transcription is used, so the file is an independent reference.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "pretokenizer_llamacpp.json"

PRES = ["qwen2", "qwen35", "tekken", "deepseek-v3", "gpt-4o"]

# Text where the pre-tokenizers differ: combining marks (Thai, Devanagari, Bengali, Tamil, Vietnamese, Hebrew and
# Arabic points, emoji modifiers and variation selectors), letter case runs, digit runs, CJK and kana, code.
CORPUS: list[str] = [
    "",
    "Hello world",
    "I'm sure you've seen it, haven't you? THEY'LL SAY WE'D GO.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }\t// comment\r\n",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE XMLHttpRequest iPhone McDonald's",
    "1234567890 3.14159 +42 -7e10 0x1F",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22\u0e07\u0e48\u0e32\u0e22\u0e46",
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u0926\u0947\u0935\u0928\u093e\u0917\u0930\u0940 \u0915\u094d\u0937\u0924\u094d\u0930\u093f\u092f \u0967\u0968\u0969",
    "\u09ac\u09be\u0982\u09b2\u09be \u09ad\u09be\u09b7\u09be \u0ba4\u0bae\u0bbf\u0bb4\u0bcd \u0c24\u0c46\u0c32\u0c41\u0c17\u0c41",
    "Ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u: Tie\u0302\u0301ng Vie\u0323\u0302t",
    "e\u0301 combining acute, a\u0308, \u0301 leading mark, x\u0336\u0336\u0336 zalgo z\u0351\u0352\u0353\u0354",
    "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd \u0627\u0644\u0652\u0639\u064e\u0631\u064e\u0628\u0650\u064a\u0651\u064e\u0629",
    "\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \u2764\ufe0f \U0001f1eb\U0001f1f7 #\ufe0f\u20e3",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\u4e2d\u6587\u5b57\u7b26\u3001\u6807\u70b9\u7b26\u53f7\uff01 \ud55c\uad6d\uc5b4",
    "\u00c9COLE \u00e9cole \u00c9cole \u01c5ungla \u0394\u03b5\u03bb\u03c4\u03b1 \u041f\u0420\u0418\u0412\u0415\u0422 \u043f\u0440\u0438\u0432\u0435\u0442",
    "   leading, trailing   \n\n\t mixed \u00a0 nbsp \u2003 emspace \r\n\r\n",
    "!!!???... $$$ +++ <<< ``` \"quoted\" 'single' `back` /path/to/file.py:12",
    "a\u0300\u0301\u0302b \u0300\u0301 ,\u0301 1\u0301 \n\u0301",
    "zero\u200bwidth\u200cjoiners\u200d and \u00ad soft hyphen",
]

_DRIVER = r"""
#include "unicode.h"
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

static std::string unhex(const std::string & h) {
    std::string s;
    for (size_t i = 0; i + 1 < h.size(); i += 2) s += (char) std::stoi(h.substr(i, 2), nullptr, 16);
    return s;
}

int main() {
    std::vector<std::vector<std::string>> pres = {
@PRES@
    };
    std::string line;
    while (std::getline(std::cin, line)) {
        const std::string text = unhex(line);
        for (size_t p = 0; p < pres.size(); ++p) {
            const auto words = unicode_regex_split(text, pres[p], false);
            for (size_t w = 0; w < words.size(); ++w) {
                if (w) std::printf(" ");
                for (unsigned char c : words[w]) std::printf("%02x", c);
            }
            std::printf("\n");
        }
    }
    return 0;
}
"""


def _pre_types(vocab_cpp: str) -> dict[str, str]:
    """tokenizer.ggml.pre name -> LLAMA_VOCAB_PRE_TYPE_* from llama_vocab::impl::load's if/else chain."""
    out: dict[str, str] = {}
    for cond, ptype in re.findall(r"if\s*\(((?:\s*tokenizer_pre\s*==\s*\"[^\"]*\"\s*(?:\|\|)?)+)\)\s*\{\s*"
                                  r"pre_type\s*=\s*(LLAMA_VOCAB_PRE_TYPE_\w+)", vocab_cpp):
        for name in re.findall(r"\"([^\"]*)\"", cond):
            out[name] = ptype
    return out


def _regex_literals(vocab_cpp: str, ptype: str) -> list[str]:
    """The C string literals (as written in the source) of `regex_exprs = {...}` under `case ptype:`."""
    start = vocab_cpp.index("struct llm_tokenizer_bpe")
    m = re.search(r"case\s+" + ptype + r"\s*:(?:\s*case\s+\w+\s*:)*\s*(?://[^\n]*\n\s*)*regex_exprs\s*=\s*\{(.*?)\};",
                  vocab_cpp[start:], re.S)
    if m is None:
        raise SystemExit(f"no regex_exprs for {ptype} in llama-vocab.cpp")
    body = re.sub(r"//[^\n]*", "", m.group(1))
    return re.findall(r"\"(?:[^\"\\]|\\.)*\"", body)


def _source(arg: str, tmp: Path) -> Path:
    p = Path(arg)
    if p.is_dir():
        return p / "src"
    with tarfile.open(p) as tf:
        members = [m for m in tf.getmembers()
                   if re.search(r"(^|/)src/(unicode(-data)?\.(cpp|h)|llama-vocab\.cpp)$", m.name)]
        tf.extractall(tmp, members=members)
    return next(tmp.rglob("llama-vocab.cpp")).parent


def main() -> None:
    arg = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / ".dev" / "A" / "llamacpp.tar.gz")
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        src = _source(arg, tmp)
        vocab = (src / "llama-vocab.cpp").read_text(encoding="utf-8")
        types = _pre_types(vocab)
        rows = []
        for pre in PRES:
            lits = _regex_literals(vocab, types[pre])
            rows.append("        { " + ", ".join(lits) + " },  // " + pre)
        (tmp / "driver.cpp").write_text(_DRIVER.replace("@PRES@", "\n".join(rows)), encoding="utf-8")
        exe = tmp / "driver"
        subprocess.run(["g++", "-O1", "-std=c++17", f"-I{src}", str(tmp / "driver.cpp"), str(src / "unicode.cpp"),
                        str(src / "unicode-data.cpp"), "-o", str(exe)], check=True)
        stdin = "".join(t.encode("utf-8").hex() + "\n" for t in CORPUS)
        lines = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout.split("\n")
    splits: dict[str, list[list[str]]] = {pre: [] for pre in PRES}
    k = 0
    for _ in CORPUS:
        for pre in PRES:
            splits[pre].append([bytes.fromhex(w).decode("utf-8") for w in lines[k].split()])
            k += 1
    OUT.write_text(json.dumps({"corpus": CORPUS, "splits": splits}, ensure_ascii=False, indent=0) + "\n",
                   encoding="utf-8")
    print(f"wrote {OUT} ({len(CORPUS)} texts x {len(PRES)} pre-tokenizers)")


if __name__ == "__main__":
    main()
