"""llama-server's /infill: a fill-in-the-middle prompt built from the model's FIM tokens (input_prefix, input_suffix,
input_extra, prompt), answered as /completion answers (its fields, its JSON and SSE shapes).

The prompt follows llama.cpp's tools/server/README.md, with the repo-level pattern where the model has FIM_REP and
FIM_SEP tokens:

    <FIM_REP>myproject\\n<FIM_SEP>{chunk filename}\\n{chunk text}...<FIM_SEP>filename\\n
    <FIM_PRE>{input_prefix}<FIM_SUF>{input_suffix}<FIM_MID>{prompt}

and the chunks after "\\n\\n--- snippet ---\\n\\n" each where it has not. As llama-server, the prefix keeps its last
3/4 of a batch of tokens, the suffix its first 1/4 (less the prompt and two), the extra context the last tokens that
leave a batch and twice the answer's length free in the context (batch: 2048, llama-server's default, at most n_ctx).
A model without FIM_PRE, FIM_SUF and FIM_MID tokens answers 501, naming the missing ones.
"""
from __future__ import annotations

from aiohttp import web

from strata.serve import schema
from strata.serve.completions_api import generate_completion
from strata.serve.config import CONFIG_KEY, ERROR_SHAPES_KEY
from strata.serve.errors import ApiError
from strata.serve.handling import engine_call, engine_of, read_body
from strata.serve.prepare import prepared
from strata.serve.llama_api import completion_request, completion_respond, llama_error

N_BATCH = 2048
SNIPPET = "\n\n--- snippet ---\n\n"      # the chunk separator of a model without FIM_SEP
# FIM token -> its GGUF metadata keys (current, then older names) and the token texts llama.cpp recognises
FIM = {
    "pre": (("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
            ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
             "<|code_prefix|>", "<|prefix|>")),
    "suf": (("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
            ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
             "<|code_suffix|>", "<|suffix|>")),
    "mid": (("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
            ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
             "<|code_middle|>", "<|middle|>")),
    "rep": (("tokenizer.ggml.fim_rep_token_id",), ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                                                   "<reponame>")),
    "sep": (("tokenizer.ggml.fim_sep_token_id",), ("<|file_sep|>", "<file_sep>", "<fim-file-sep>",
                                                   "<FILE_SEP>")),
}
NAMES = {"pre": "prefix", "suf": "suffix", "mid": "middle"}


def fim_tokens(engine) -> dict[str, int | None]:
    """The model's FIM token ids by role (pre, suf, mid, rep, sep): from the GGUF metadata, else by their text."""
    meta = engine.file.metadata
    tok = engine.tokenizer

    def by_text(t: str) -> int | None:
        i = tok.token_to_id(t)
        return i if i is not None and tok.is_special(i) else None

    out: dict[str, int | None] = {}
    for role, (keys, texts) in FIM.items():
        found = next((int(meta[k]) for k in keys if meta.get(k) is not None and 0 <= int(meta[k]) < tok.n_vocab),
                     None)
        out[role] = found if found is not None else next((i for t in texts if (i := by_text(t)) is not None), None)
    return out


def _text(body: dict, key: str, required: bool) -> str | list:
    v = body.get(key)
    if v is None:
        if required:
            raise ApiError(400, f"'{key}' is required", param=key, code="missing_required_parameter")
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool))
                                   for p in v) and key != "prompt":
        return v
    raise ApiError(400, f"'{key}' must be a string{'' if key == 'prompt' else ' or an array of strings and token ids'}"
                        f", got {schema._tname(v)}", param=key, code="invalid_value")


def _extra(body: dict) -> list[tuple[str, str]]:
    v = body.get("input_extra")
    if v is None:
        return []
    if not isinstance(v, list):
        raise ApiError(400, "'input_extra' must be an array of {\"filename\": string, \"text\": string}",
                       param="input_extra", code="invalid_value")
    out = []
    for i, c in enumerate(v):
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            raise ApiError(400, f"'input_extra[{i}].text' must be a string", param=f"input_extra[{i}].text",
                           code="invalid_value")
        name = c.get("filename", "tmp")
        if not isinstance(name, str):
            raise ApiError(400, f"'input_extra[{i}].filename' must be a string", param=f"input_extra[{i}].filename",
                           code="invalid_value")
        out.append((name, c["text"]))
    return out


def infill_tokens(engine, fim: dict, prefix, suffix, extra: list[tuple[str, str]], prompt: str,
                  n_predict: int) -> list[int]:
    """The FIM prompt's token ids (the layout in the module docstring). Runs on the engine thread."""
    tok = engine.tokenizer
    n_vocab = tok.n_vocab

    def ids(v) -> list[int]:
        parts = [v] if isinstance(v, str) else v
        out: list[int] = []
        for p in parts:
            if isinstance(p, int):
                if not 0 <= p < n_vocab:
                    raise ApiError(400, f"token id {p} is outside the vocabulary [0, {n_vocab})", code="invalid_value")
                out.append(p)
            else:
                out += tok.encode(p, add_bos=False, add_eos=False, parse_special=False)
        return out

    extra_t: list[int] = []
    if fim["rep"] is not None:
        extra_t += [fim["rep"]] + ids("myproject\n")
    for name, text in extra:
        extra_t += [fim["sep"]] + ids(name + "\n") if fim["sep"] is not None else ids(SNIPPET)
        extra_t += ids(text)
    if fim["sep"] is not None:
        extra_t += [fim["sep"]] + ids("filename\n")
    prefix_t, suffix_t, prompt_t = ids(prefix), ids(suffix), ids(prompt)
    batch = min(N_BATCH, engine.n_ctx)
    n_prefix = min(len(prefix_t), 3 * (batch // 4))
    n_suffix = min(len(suffix_t), max(0, batch // 4 - (2 + len(prompt_t))))
    n_extra = min(max(0, engine.n_ctx - batch - 2 * max(0, n_predict)), len(extra_t))
    out = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    out += extra_t[len(extra_t) - n_extra:]
    out += [fim["pre"]] + prefix_t[len(prefix_t) - n_prefix:] + [fim["suf"]] + suffix_t[:n_suffix] + [fim["mid"]]
    return out + prompt_t


async def infill(request: web.Request) -> web.StreamResponse:
    """POST /infill {input_prefix, input_suffix, input_extra?, prompt?, ...every /completion field}."""
    body = await read_body(request)
    engine = engine_of(request)
    fim = fim_tokens(engine)
    missing = [NAMES[r] for r in ("pre", "suf", "mid") if fim[r] is None]
    if missing:
        raise ApiError(501, f"infill is not supported by this model: it has no FIM {', '.join(missing)} token"
                            f"{'s' if len(missing) > 1 else ''} (fill-in-the-middle needs prefix, suffix and middle "
                            "tokens)", code="not_supported")

    def check():
        return (_text(body, "input_prefix", True), _text(body, "input_suffix", True), _text(body, "prompt", False),
                _extra(body), completion_request({**body, "prompt": [0]}, engine))   # /completion's, checked as there
    prefix, suffix, prompt, extra, p = await prepared(request, check)
    n_predict = p.max_tokens if p.max_tokens is not None else request.app[CONFIG_KEY].n_predict
    p.prompt = await engine_call(request, lambda e: infill_tokens(e, fim, prefix, suffix, extra, prompt, n_predict))
    return await generate_completion(request, p, respond=completion_respond)


def add_routes(app: web.Application) -> None:
    """Register /infill and its error shape (llama-server's) on `app` (make_app calls this)."""
    route = app.router.add_post("/infill", infill)
    app[ERROR_SHAPES_KEY][route.resource.canonical] = llama_error
