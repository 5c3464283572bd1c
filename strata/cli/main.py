"""The `strata` command line: `generate`, `chat`, and the `serve` and `worker` subcommands."""
from __future__ import annotations

import argparse
import os
import sys

from strata.cli.argv import Parser, parse_args
from strata.cli.chat_input import parse_chat_line
from strata.cli.engine_flags import (EXIT_ERROR, EXIT_USAGE, CliError, add_engine_args, add_sampling_args,
                                     engine_config, sampling_params)


def load_engine(args, **overrides):
    """Build the Engine from parsed engine options, with `overrides` of its keyword arguments (a progress bar on
    stderr while a large model loads).

    Engine logs (STRATA_TRACE=1, STRATA_STATE_HASH=1) go to stderr so stdout carries only the answer."""
    import structlog
    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    cfg = engine_config(args, **overrides)
    from strata.engine import Engine
    return Engine(cfg, progress=None)


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
    d, a = int(t.get("draft_n", 0) or 0), int(t.get("draft_n_accepted", 0) or 0)
    spec = f" | drafted: {d}, accepted: {a} ({a / d:.0%})" if d else ""
    return (f"[prompt: {t['prompt_n']} tokens in {t['prompt_ms']:.0f} ms, {t['prompt_per_second']:.1f} tokens/s"
            f" (reused {t['cache_n']}) | generation: {t['predicted_n']} tokens, "
            f"{t['predicted_per_second']:.1f} tokens/s{spec} | finish: {final.finish_reason}]")


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
    # one request and done: no turn checkpoint to save (the one-shot opt-out), so the prompt is one part
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
    parser = Parser(prog="strata", description="Strata: LLM inference with conversation checkpoints")
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

    from strata.cli import serve, worker
    serve.add_parser(sub)
    worker.add_parser(sub)
    return parser


def _known_errors() -> tuple[type[BaseException], ...]:
    from strata.errors import Unavailable
    from strata.gguf.config import ConfigError
    from strata.gguf.file import ModelLoadError
    return (CliError, OSError, ValueError, ModelLoadError, ConfigError, Unavailable)


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    if isinstance(e, OSError) and e.filename and e.strerror:
        msg = f"{e.strerror}: {e.filename}"
    return msg or type(e).__name__


def one_blas_thread() -> None:
    """OpenBLAS (numpy's few products on the CPU: the small per-chunk ones of the recurrent layers' chunked scans) on
    one thread unless OPENBLAS_NUM_THREADS says otherwise: the C core's pool runs the model's products, and
    OpenBLAS's own threads, spinning after each call, stall it and themselves on a busy machine (docs/hybrid.md).
    Takes effect only before numpy is first imported."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `strata`: returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted).

    Errors are printed as one line `strata: error: ...` without a traceback (STRATA_DEBUG=1 shows it)."""
    one_blas_thread()
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
