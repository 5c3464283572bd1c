"""Tokenizer built from a GGUF's `tokenizer.ggml.*` metadata (BPE "gpt2" and SentencePiece "llama"), plus StreamDecoder."""
from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _models
from tokenizers import pre_tokenizers as _pre

from strata.text.fragment_cache import FragmentCache

# GGUF token types (gguf.TokenType / llama.cpp llama_token_type)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Pre-tokenizer regexes, copied from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe constructor).
# Each expression splits the pieces left by the previous one; matched and unmatched text are both kept.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT_RES = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"]
# qwen2's expression with combining marks (\p{M}) joined to letter runs and kept out of punctuation runs.
_QWEN35_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken and OpenAI's o200k (gpt-4o, llama4): an upper-case run may open a lower-case word; llama.cpp
# writes the case classes as "a letter that is not a-z" / "not A-Z", so other scripts' letters fit both.
_TEKKEN_RE = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
              r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O_RE = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTION
             + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTION
             + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3_RES = [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                  r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                  r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]

# tokenizer.ggml.pre -> (regex list, ignore_merges), as llama.cpp maps them.
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "default": (_DEFAULT_RES, False),
    "": (_DEFAULT_RES, False),
    "gpt-2": ([_GPT2_RE], False), "gpt2": ([_GPT2_RE], False), "phi-2": ([_GPT2_RE], False),
    "mpt": ([_GPT2_RE], False), "olmo": ([_GPT2_RE], False), "jais": ([_GPT2_RE], False),
    "roberta-bpe": ([_GPT2_RE], False), "exaone4": ([_GPT2_RE], False),
    "smollm": ([r"\p{N}", _GPT2_RE], False), "starcoder": ([r"\p{N}", _GPT2_RE], False),
    "refact": ([r"\p{N}", _GPT2_RE], False), "command-r": ([r"\p{N}", _GPT2_RE], False),
    "codeshell": ([r"\p{N}", _GPT2_RE], False), "exaone": ([r"\p{N}", _GPT2_RE], False),
    "minerva-7b": ([r"\p{N}", _GPT2_RE], False),
    "llama3": ([_LLAMA3_RE], True), "llama-v3": ([_LLAMA3_RE], True), "llama-bpe": ([_LLAMA3_RE], True),
    "falcon3": ([_LLAMA3_RE], True), "pixtral": ([_LLAMA3_RE], True), "dbrx": ([_LLAMA3_RE], False),
    "smaug-bpe": ([_LLAMA3_RE], False), "chatglm-bpe": ([_LLAMA3_RE], False),
    "qwen2": ([_QWEN2_RE], False), "deepseek-r1-qwen": ([_QWEN2_RE], False), "stablelm2": ([_QWEN2_RE], False),
    "megrez": ([_QWEN2_RE], False), "qwen35": ([_QWEN35_RE], False),
    "tekken": ([_TEKKEN_RE], True), "deepseek-v3": (_DEEPSEEK3_RES, False),
    "gpt-4o": ([_GPT4O_RE], False), "llama4": ([_GPT4O_RE], False),
}

# Pre-tokenizers for which llama.cpp adds BOS when the file has no tokenizer.ggml.add_bos_token (SPM always does).
_ADD_BOS_PRES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken"})
# Special token ids llama.cpp assumes when the file leaves the key out, by tokenizer.ggml.model (an id past the
# vocabulary means none); "chatglm-bpe" has no default BOS.
_DEFAULT_IDS = {"gpt2": {"bos": 11, "eos": 11}, "llama": {"bos": 1, "eos": 2, "unk": 0}}

# Token texts llama.cpp treats as end-of-generation (llama-vocab.cpp, special_eog_ids).
_EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
}
_EOT_TEXTS = ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "<end_of_utterance>"]

_SPM_SPACE = "\u2581"
_BATCH_CHARS = 16384      # above this many characters of new raw text, tokenize it as one batch (threads)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table (openai/gpt-2 encoder.py; llama.cpp unicode.cpp)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _byte_level_decode(text: str) -> bytes:
    out = bytearray()
    for ch in text:
        b = _CHAR_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


@dataclass(frozen=True)
class Fragment:
    """One piece of split text: `text[start:end]` is raw text (token_id None) or the special token token_id."""
    start: int
    end: int
    token_id: int | None


class Tokenizer:
    """Token ids <-> text for one GGUF vocabulary, matching llama.cpp's tokenizer (src/llama-vocab.cpp).

    Built with `Tokenizer.from_gguf(metadata)`. BPE ("gpt2") models use the `tokenizers` library's BPE with a
    byte-level alphabet and the pre-tokenizer regexes llama.cpp uses for `tokenizer.ggml.pre`; SentencePiece
    ("llama") models use `tokenizers` BPE with merges ranked by the merged piece's score and byte fallback
    (<0xNN>), which is llama.cpp's SPM algorithm (merge the adjacent pair whose concatenation has the highest
    score). Special tokens (CONTROL, USER_DEFINED, UNKNOWN types) are split out before the model runs, longest
    text first, exactly as llama.cpp's tokenizer_st_partition: CONTROL/UNKNOWN ones only with parse_special,
    USER_DEFINED ones always.
    """

    def __init__(self, *, model: str, tokens: list[str], token_types: list[int], scores: list[float] | None,
                 merges: list[str] | None, pre: str, bos_id: int | None, eos_id: int | None,
                 eot_id: int | None, eom_id: int | None, unk_id: int | None, add_bos: bool, add_eos: bool,
                 add_space_prefix: bool, extra_eog: Iterable[int] = ()):
        self.model = model
        self.pre = pre
        self.tokens = tokens
        self.n_vocab = len(tokens)
        types = list(token_types) if token_types else [TOKEN_NORMAL] * self.n_vocab
        if len(types) != self.n_vocab:
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {self.n_vocab} tokens")
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self._token_to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):
            self._token_to_id[t] = i

        # End-of-generation tokens: those detected by text become CONTROL (as in llama.cpp); ids given by key
        # (eos, eot, eom, fim) end generation but keep their type.
        if eot_id is None:
            for t in _EOT_TEXTS:
                if t in self._token_to_id:
                    eot_id = self._token_to_id[t]
                    break
        self.eot_id = eot_id
        by_text = {i for t, i in self._token_to_id.items() if t in _EOG_TEXTS}
        for i in by_text:
            types[i] = TOKEN_CONTROL
        eog = set(by_text)
        for i in (eos_id, eot_id, eom_id, *extra_eog):
            if i is not None and 0 <= i < self.n_vocab:
                eog.add(i)
        self.eog_ids: frozenset[int] = frozenset(eog)
        self.token_types = types

        # Special-token partition list: longest text first (llama.cpp cache_special_tokens).
        specials = [i for i, ty in enumerate(types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)
                    and tokens[i]]
        specials.sort(key=lambda i: (-len(tokens[i].encode("utf-8")), i))
        self._specials = [(tokens[i], i, types[i] == TOKEN_USER_DEFINED) for i in specials]

        if model == "gpt2":
            if pre not in PRE_TOKENIZERS:
                raise ValueError(f"unknown tokenizer.ggml.pre {pre!r} (supported: "
                                 f"{', '.join(sorted(p for p in PRE_TOKENIZERS if p))})")
            if merges is None:
                raise ValueError("tokenizer.ggml.merges is missing for a gpt2 (BPE) tokenizer")
            regexes, ignore_merges = PRE_TOKENIZERS[pre]
            seps = [m.find(" ", 1) for m in merges]
            if seps and min(seps) < 0:
                raise ValueError(f"malformed tokenizer.ggml.merges entry {merges[seps.index(min(seps))]!r}")
            pairs = [(m[:p], m[p + 1:]) for m, p in zip(merges, seps)]
            bpe = _models.BPE(vocab=dict(self._token_to_id), merges=pairs, ignore_merges=ignore_merges,
                              fuse_unk=False, byte_fallback=False)
            tk = _HFTokenizer(bpe)
            tk.pre_tokenizer = _pre.Sequence(
                [_pre.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
                + [_pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
            self._tk = tk
        elif model == "llama":
            if scores is None or len(scores) != self.n_vocab:
                raise ValueError("tokenizer.ggml.scores is missing or has the wrong length for an SPM tokenizer")
            # Merges: every (a, b) with a, b and a+b in the vocabulary, ranked by score(a+b) descending.
            ranked = []
            for t, i in self._token_to_id.items():
                if types[i] == TOKEN_BYTE or len(t) < 2:
                    continue
                for k in range(1, len(t)):
                    a, b = t[:k], t[k:]
                    if a in self._token_to_id and b in self._token_to_id:
                        ranked.append((-scores[i], i, k, a, b))
            ranked.sort()
            unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < self.n_vocab else None
            bpe = _models.BPE(vocab=dict(self._token_to_id), merges=[(a, b) for *_, a, b in ranked],
                              unk_token=unk, fuse_unk=False, byte_fallback=True)
            tk = _HFTokenizer(bpe)
            self._tk = tk
        else:
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r} (supported: gpt2, llama)")
        self._bytes: list[bytes | None] = [None] * self.n_vocab    # token_bytes, filled in as tokens are decoded
        self.fragments = FragmentCache()       # ids of raw fragments already tokenized (encode_fragments)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata (key -> Python value, e.g. `GGUFReader.fields[k].contents()`).

        Raises ValueError (one line) for a missing vocabulary, an unknown model type or pre-tokenizer.
        """
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF has no tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF has no tokenizer.ggml.tokens")

        pre = str(metadata.get("tokenizer.ggml.pre", "default") or "default")
        default_ids = dict(_DEFAULT_IDS.get(str(model), {}))
        if pre == "chatglm-bpe":
            default_ids.pop("bos", None)

        def opt_id(key, default=None):
            """The key's id; llama.cpp's default when it is absent or past the vocabulary; None for neither."""
            v = metadata.get(key)
            if v is not None and 0 <= int(v) < len(tokens):
                return int(v)
            return default if default is not None and 0 <= default < len(tokens) else None

        if model == "gpt2":
            add_bos_default, add_space_default = pre in _ADD_BOS_PRES, False
        else:
            add_bos_default, add_space_default = True, True
        return cls(
            model=str(model), tokens=[str(t) for t in tokens],
            token_types=[int(t) for t in metadata.get("tokenizer.ggml.token_type", [])],
            scores=[float(s) for s in metadata["tokenizer.ggml.scores"]] if "tokenizer.ggml.scores" in metadata else None,
            merges=list(metadata["tokenizer.ggml.merges"]) if "tokenizer.ggml.merges" in metadata else None,
            pre=pre, bos_id=opt_id("tokenizer.ggml.bos_token_id", default_ids.get("bos")),
            eos_id=opt_id("tokenizer.ggml.eos_token_id", default_ids.get("eos")),
            eot_id=opt_id("tokenizer.ggml.eot_token_id"), eom_id=opt_id("tokenizer.ggml.eom_token_id"),
            unk_id=opt_id("tokenizer.ggml.unknown_token_id", default_ids.get("unk")),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", add_space_default)),
            extra_eog=[i for i in (opt_id("tokenizer.ggml.fim_pad_token_id"), opt_id("tokenizer.ggml.fim_rep_token_id"),
                                   opt_id("tokenizer.ggml.fim_sep_token_id")) if i is not None],
        )

    # ----------------------------------------------------------------- queries
    def is_special(self, token_id: int) -> bool:
        """True for CONTROL / USER_DEFINED / UNKNOWN tokens (and the end-of-generation tokens)."""
        return self.token_types[token_id] in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)

    @property
    def special_texts(self) -> list[tuple[str, bool]]:
        """(text, is USER_DEFINED) of each special token split out before the model runs (CONTROL / UNKNOWN ones
        only in text parsed for special tokens, USER_DEFINED ones in all text)."""
        return [(t, u) for t, _, u in self._specials]

    def is_control(self, token_id: int) -> bool:
        """True for CONTROL tokens: the ones client text must never produce."""
        return self.token_types[token_id] == TOKEN_CONTROL

    def token_to_id(self, text: str) -> int | None:
        """The id of a token given its exact vocabulary text, or None."""
        return self._token_to_id.get(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for (a special token: its text in UTF-8; a byte token: that byte).

        Raises ValueError for an id outside [0, n_vocab).
        """
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} out of range [0, {self.n_vocab})")
        b = self._bytes[token_id]
        if b is None:
            b = self._bytes[token_id] = self._bytes_of(self.tokens[token_id], self.token_types[token_id])
        return b

    def _bytes_of(self, t: str, ty: int) -> bytes:
        if ty == TOKEN_UNUSED:
            return b""
        if self.model == "gpt2":
            return t.encode("utf-8") if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN) \
                else _byte_level_decode(t)
        if ty == TOKEN_BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            return bytes([int(t[3:5], 16)])
        if ty == TOKEN_NORMAL:
            return t.replace(_SPM_SPACE, " ").encode("utf-8")
        return t.encode("utf-8")

    def token_piece(self, token_id: int, special: bool = False) -> bytes:
        """Bytes llama.cpp's token_to_piece gives: CONTROL/UNKNOWN tokens are empty unless `special`."""
        b = self.token_bytes(token_id)
        if not special and self.token_types[token_id] in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            return b""
        return b

    # ----------------------------------------------------------------- encoding
    def split_special(self, pieces: Sequence[tuple[str, bool]]) -> tuple[str, list[Fragment]]:
        """Join `pieces` (text, parse_special) and split the text into raw-text and special-token fragments.

        Special-token text is only recognised inside one piece (never across a piece boundary); CONTROL and
        UNKNOWN tokens only in pieces with parse_special=True, USER_DEFINED tokens in every piece (llama.cpp's
        rule). Adjacent raw fragments are merged. Returns (joined text, fragments covering it in order).
        Raises ValueError for text that is not valid Unicode (a lone surrogate, e.g. from JSON "\\ud800" or
        undecodable command-line bytes): it has no UTF-8 encoding, so no token ids.
        """
        frags: list[Fragment] = []
        off = 0
        for text, parse_special in pieces:
            if not text:
                continue
            check_text(text)
            # (start, end, id) within this piece; llama.cpp order: each special in turn over remaining raw text
            parts: list[tuple[int, int, int | None]] = [(0, len(text), None)]
            for stext, sid, user_defined in self._specials:
                if not parse_special and not user_defined:
                    continue
                new: list[tuple[int, int, int | None]] = []
                for s, e, tid in parts:
                    if tid is not None:
                        new.append((s, e, tid))
                        continue
                    cur = s
                    while True:
                        j = text.find(stext, cur, e)
                        if j < 0:
                            break
                        if j > cur:
                            new.append((cur, j, None))
                        new.append((j, j + len(stext), sid))
                        cur = j + len(stext)
                    if cur < e:
                        new.append((cur, e, None))
                parts = new
            for s, e, tid in parts:
                if tid is None and frags and frags[-1].token_id is None and frags[-1].end == off + s:
                    frags[-1] = Fragment(frags[-1].start, off + e, None)
                else:
                    frags.append(Fragment(off + s, off + e, tid))
            off += len(text)
        return "".join(t for t, _ in pieces), frags

    def encode_raw(self, text: str, after_special: bool = True) -> list[int]:
        """Token ids of plain text with no special-token parsing (one raw fragment).

        For SPM models a space is prepended when add_space_prefix is set and the text follows a special token
        or starts the input (`after_special`), as llama.cpp does.
        """
        if not text:
            return []
        if self.model == "llama":
            if self.add_space_prefix and after_special:
                text = " " + text
            text = text.replace(" ", _SPM_SPACE)
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_fragments(self, text: str, frags: Sequence[Fragment]) -> list[list[int]]:
        """Token ids of each fragment from split_special (a special fragment gives [its id]).

        A raw fragment is tokenized on its own (llama.cpp's rule: nothing merges across a special token), so its
        ids depend only on its text (and, for SPM models, whether a special token or the start precedes it): the
        ids of fragments seen before come from ``self.fragments`` (strata.text.fragment_cache), and only new text is
        tokenized. The result is the same either way."""
        out: list[list[int]] = []
        prev_special = True
        spm = self.model == "llama"
        todo: list[tuple[int, str, Any]] = []     # (fragment index, text, cache key or None): BPE, in one batch
        cache = self.fragments
        for k, f in enumerate(frags):
            if f.token_id is not None:
                out.append([f.token_id])
                prev_special = True
                continue
            t = text[f.start:f.end]
            key = ((t, prev_special) if spm else t) if cache.wants(t) else None
            ids = cache.get(key) if key is not None else None
            if ids is None:
                if spm:
                    ids = self.encode_raw(t, after_special=prev_special)
                    if key is not None:
                        cache.put(key, ids)
                else:
                    ids = []
                    todo.append((k, t, key))
            out.append(ids)
            prev_special = False
        if todo:
            texts = [t for _, t, _ in todo]
            # a few short texts (a later turn's new ones) one by one: the batch call wakes the library's thread pool,
            # which on a busy machine costs more than the tokenizing (the same ids either way)
            encs = self._tk.encode_batch(texts, add_special_tokens=False) if sum(map(len, texts)) > _BATCH_CHARS \
                else [self._tk.encode(t, add_special_tokens=False) for t in texts]
            for (k, _, key), enc in zip(todo, encs):
                out[k] = enc.ids
                if key is not None:
                    cache.put(key, enc.ids)
        return out

    def pre_tokenize(self, text: str) -> list[str]:
        """The words a BPE vocabulary's merges run on for raw `text` (tokenizer.ggml.pre's split, no special-token
        split); `"".join` of them is `text`. An SPM vocabulary has no pre-tokenizer: one word."""
        pre = self._tk.pre_tokenizer
        if pre is None:
            return [text] if text else []
        return [_byte_level_decode(w).decode("utf-8") for w, _ in pre.pre_tokenize_str(text)]

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]], add_bos: bool | None = None,
                      add_eos: bool | None = None) -> list[int]:
        """Token ids of the joined pieces, each piece with its own parse_special flag (see split_special)."""
        text, frags = self.split_special(pieces)
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.append(self.bos_id)
        for part in self.encode_fragments(text, frags):
            ids.extend(part)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode(self, text: str, parse_special: bool = False, add_bos: bool | None = None,
               add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize(text, add_special, parse_special).

        parse_special=False: text such as "<|im_start|>" is tokenized as ordinary characters (USER_DEFINED
        tokens are still recognised, as in llama.cpp). add_bos/add_eos None: the metadata's add_bos/add_eos.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode expects str, got {type(text).__name__}")
        return self.encode_pieces([(text, parse_special)], add_bos=add_bos, add_eos=add_eos)

    # ----------------------------------------------------------------- decoding
    def decode_bytes(self, ids: Iterable[int], special: bool = False) -> bytes:
        """Concatenated token pieces (see token_piece)."""
        return b"".join(self.token_piece(int(i), special) for i in ids)

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD). CONTROL tokens render as "" unless `special`,
        like llama.cpp's token_to_piece; the SPM space prefix is kept (no stripping)."""
        return self.decode_bytes(ids, special).decode("utf-8", errors="replace")


def check_text(text: str) -> None:
    """Raise ValueError (one line, naming the character and its index) if `text` has no UTF-8 encoding."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        # U+DC80..U+DCFF is also how Python passes on a byte of argv / stdin / a file that is not UTF-8
        raw = f" (or the byte 0x{c - 0xDC00:02X}, not UTF-8, of command-line or file input)" if 0xDC80 <= c <= 0xDCFF \
            else ""
        raise ValueError(f"text is not valid Unicode: lone surrogate U+{c:04X}{raw} at character {e.start}") from None


class StreamDecoder:
    """Incremental detokenization: feed token ids, get back only complete UTF-8 text.

    Bytes of a character split over several tokens are held until the character is complete; invalid byte
    sequences become U+FFFD (never a broken sequence). Call flush() at the end for any held bytes.
    special: control tokens give their text; show: ids of the control tokens that give it even without special.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False, show: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.special = special
        self.show = frozenset(int(i) for i in show)
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: int | Iterable[int]) -> str:
        """Append token id(s); returns the newly completed text (possibly "")."""
        if isinstance(ids, int):
            ids = [ids]
        if self.show:
            raw = b"".join(self.tokenizer.token_piece(int(i), self.special or int(i) in self.show) for i in ids)
        else:
            raw = self.tokenizer.decode_bytes(ids, self.special)
        return self._dec.decode(raw)

    def pending(self) -> bytes:
        """Bytes held back (an incomplete UTF-8 sequence)."""
        return self._dec.getstate()[0]

    def flush(self, drop_incomplete: bool = False) -> str:
        """Text of any held bytes (U+FFFD for an incomplete sequence, or "" for it with drop_incomplete: a
        generation cut by max_tokens mid-character ends at the last whole character); resets the decoder."""
        out = "" if drop_incomplete else self._dec.decode(b"", final=True)
        self._dec.reset()
        return out
