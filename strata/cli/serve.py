"""The `strata serve` subcommand: its flags (add_parser), and run(args) that starts the daemon under uvloop."""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from strata.cli.argv import int_at_least, number_above
from strata.cli.engine_flags import CliError, add_engine_args, device_words, engine_config
from strata.serve.log import LEVELS, configure_logging
from strata.serve.notify import sd_notify
from strata.serve.paths import default_socket_path

DEFAULT_PORT = 8080


def _size(text: str) -> int:
    """'1048576', '512K', '8M', '1G' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" and t[-1:] else t
    try:
        v = int(num) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or a number with K, M or G)") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return v


_nonneg = int_at_least(0, "non-negative integer")
_positive = int_at_least(1, "positive integer")
_n_predict = int_at_least(-1, "token count")
_seconds = number_above(0.0, "number of seconds")
_nonneg_float = number_above(0.0, "number of seconds", inclusive=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    n = p.add_argument_group("listening")
    n.add_argument("--socket", default=None,
                   help="Unix socket path (default: $STRATA_SOCKET, else $RUNTIME_DIRECTORY/strata.sock under "
                        "systemd, else $XDG_RUNTIME_DIR/strata/strata.sock, else /run/strata/strata.sock)")
    n.add_argument("--no-socket", action="store_true", help="do not listen on a Unix socket (TCP only)")
    n.add_argument("--host", default=None, help="TCP address for OpenAI clients (default 127.0.0.1 when --port is given)")
    n.add_argument("--port", type=_nonneg, default=None, help=f"TCP port (default {DEFAULT_PORT} when --host is given)")
    n.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY") or None,
                   help="key required on TCP, as 'Authorization: Bearer <key>' or 'x-api-key: <key>' (needed for a "
                        "non-loopback --host); env STRATA_API_KEY")
    n.add_argument("--queue-max", type=_nonneg, default=16,
                   help="requests allowed to wait behind the running ones; beyond it 503 + Retry-After (default %(default)s)")
    n.add_argument("--max-body", type=_size, default=8 * 1024 * 1024, help="largest request body (default 8M)")
    n.add_argument("--responses-store", type=_nonneg, default=256, metavar="N",
                   help="/v1/responses kept for previous_response_id, least recently used dropped first (default "
                        "256; 0 keeps none)")
    n.add_argument("--n-predict", type=_n_predict, default=1024, metavar="N",
                   help="tokens an answer may have when a request sets no max_tokens / max_output_tokens (default "
                        "1024; -1: until the model stops or the context is full)")
    n.add_argument("--embeddings", action="store_true",
                   help="serve the embedding routes (/v1/embeddings, /embedding, /embeddings, /api/embed, "
                        "/api/embeddings; llama-server's flag): without it they answer 501 naming this flag")
    n.add_argument("--pooling", choices=("none", "mean", "cls", "last"), default=None,
                   help="how the embedding routes pool a text's final-normed hidden states: mean over its tokens, "
                        "cls (the first token), last (the last token), none (every token's vector, /embeddings only); "
                        "default: the model file's pooling_type, else last (a causal LM); a request's 'pooling' "
                        "field overrides it")
    n.add_argument("--allowed-hosts", action="append", default=[], metavar="NAMES",
                   help="Host header names the TCP listener answers besides loopback names and its --host address "
                        "(comma-separated or repeated; '*' any): other names are refused (DNS rebinding)")
    n.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="an origin (https://app.example) whose web pages may call the API across origins, with CORS "
                        "headers ('*': any); other origins may read nothing and change nothing")
    lim = p.add_argument_group("limits (what one client may hold)")
    lim.add_argument("--max-connections", type=_positive, default=256, metavar="N",
                     help="open connections per listener (Unix socket, TCP); one more is answered 503 and closed "
                          "(default 256, lowered to what the descriptor limit holds)")
    lim.add_argument("--header-timeout", type=_seconds, default=15.0, metavar="S",
                     help="seconds from a request's first byte until its whole header is in (default 15)")
    lim.add_argument("--body-timeout", type=_seconds, default=60.0, metavar="S",
                     help="seconds for a request's whole body; later: 408 (default 60)")
    lim.add_argument("--idle-timeout", type=_seconds, default=60.0, metavar="S",
                     help="seconds a connection may stay open without a request (default 60)")
    lim.add_argument("--max-request-seconds", type=_nonneg_float, default=0.0, metavar="S",
                     help="wall time a generation may take; at its end it stops with finish_reason 'length' "
                          "(default 0: no limit)")
    lim.add_argument("--max-request-tokens", type=_positive, default=65536, metavar="N",
                     help="tokens a request may ask to generate over all its choices, n x max_tokens (default 65536)")
    n.add_argument("--no-warmup", action="store_true",
                   help="serve at once after the model loads, without first running the shapes a request uses "
                        "(the first request then pays for them)")
    n.add_argument("--alias", action="append", default=[], metavar="NAME",
                   help="another name of the model in /v1/models (repeatable, or comma-separated); requests may "
                        "name any model: the loaded one answers")
    n.add_argument("--responses-store-mib", type=_nonneg, default=256, metavar="MIB",
                   help="bytes the kept /v1/responses may hold (their JSON, a shared conversation counted once; "
                        "default 256); the least recently used go first")
    n.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let the running requests finish before cancelling them (default %(default)s)")
    n.add_argument("--stall-seconds", type=float, default=600.0, metavar="S",
                   help="/health answers 503 (status stuck) when work is running or waiting and no forward call has "
                        "returned for S seconds (default 600; 0: never)")
    lg = p.add_argument_group("logging")
    lg.add_argument("--log-level", default=os.environ.get("STRATA_LOG_LEVEL", "info"), choices=LEVELS)
    lg.add_argument("--log-format", default="auto", choices=("auto", "json", "console"),
                    help="auto: JSON lines unless stderr is a TTY")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on the `strata` command's subparsers; sets func=run."""
    p = subparsers.add_parser("serve", help="run the daemon (Unix socket JSON API + OpenAI-compatible HTTP)",
                              description="Run Strata's daemon.")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def is_loopback(host: str) -> bool:
    """Whether `host` is 'localhost' or a loopback address (IPv4 or IPv6, brackets allowed)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_args(args) -> str | None:
    """The one-line usage error for an inconsistent flag set, or None."""
    why = _serve_args_error(args)
    if why:
        return why
    try:
        engine_config(args)
    except CliError as e:
        return str(e)
    return None


def _serve_args_error(args) -> str | None:
    """check_args for the daemon's own flags (listening, limits), not the engine's."""
    key = args.api_key
    if key is not None and (not key or any(c.isspace() for c in key)):
        return ("--api-key (or STRATA_API_KEY) must be a non-empty token without spaces: clients send it as "
                "'Authorization: Bearer <key>' or 'x-api-key: <key>', so a key with spaces could never match")
    if args.port is not None or args.host is not None:
        args.host = args.host or "127.0.0.1"
        args.port = DEFAULT_PORT if args.port is None else args.port
        if args.port > 65535:
            return f"--port must be <= 65535, got {args.port}"
        if not is_loopback(args.host) and not args.api_key:
            return (f"listening on {args.host} (not a loopback address) requires --api-key "
                    "(or STRATA_API_KEY in the environment)")
    if args.no_socket and args.port is None:
        return "--no-socket needs --port (or --host): the daemon would listen nowhere"
    if args.drain_timeout < 0:
        return f"--drain-timeout must be >= 0, got {args.drain_timeout}"
    if not 0 <= args.stall_seconds < float("inf"):
        return f"--stall-seconds must be a number of seconds >= 0 (0: never), got {args.stall_seconds}"
    return None


def _names(values: list[str]) -> tuple[str, ...]:
    """A repeatable flag's values, each also comma-separated, as one tuple of names."""
    return tuple(n.strip() for v in values for n in v.split(",") if n.strip())


def _cuda_unusable(device: str) -> str | None:
    """Why `device` ('cuda[:N]' or a comma list of devices, already parsed by argparse) cannot run here, or None
    (CPU stages among them need nothing)."""
    from strata.backend.cuda import unavailable_reason
    from strata.stages import parse_devices
    why = unavailable_reason()
    if why:
        return f"CUDA backend unavailable: {why}"
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    for d in parse_devices(device):
        if d == "cpu":
            continue
        idx = int(d.split(":")[1])
        if idx >= n:
            return f"no CUDA device {idx} (this machine has {n})"
    return None


def run(args) -> int:
    """Start the daemon with parsed flags; returns the exit status (2 usage, 1 startup failure, 0 clean stop)."""
    try:
        err = _serve_args_error(args)
        ecfg = None if err else engine_config(args)      # 'auto' made concrete, checked once
    except CliError as e:
        err = str(e)
    if err:
        print(f"strata serve: error: {err}", file=sys.stderr)
        return 2
    if ecfg.spec.n > 0:                 # a model without an MTP head: said before any socket opens
        from strata.engine.speculate import file_refusal
        why = file_refusal(ecfg.model, ecfg.spec.draft)
        if why:
            print(f"strata serve: error: {why}", file=sys.stderr)
            return 2
    device = ecfg.stages.device
    if "cuda" in str(device):   # no GPU / CuPy / kernels / such a GPU: say so before any socket
        why = _cuda_unusable(device)
        if why:
            print(f"strata serve: error: {device_words(args, ecfg)}: {why}", file=sys.stderr)
            return 1
    configure_logging(args.log_level, json={"auto": None, "json": True, "console": False}[args.log_format])
    import asyncio                  # here, not at the top: `strata generate` / `chat` import this module too

    import structlog
    import uvloop

    from strata.serve.config import ServeConfig
    from strata.serve.server import StartupError, serve

    log = structlog.get_logger("strata.serve")
    cfg = ServeConfig(socket_path=None if args.no_socket else str(args.socket or default_socket_path()),
                      host=args.host, port=args.port, api_key=args.api_key, queue_max=args.queue_max,
                      max_body=args.max_body, drain_timeout=args.drain_timeout,
                      responses_store=args.responses_store, responses_store_mib=args.responses_store_mib,
                      n_predict=args.n_predict, embeddings=args.embeddings, pooling=args.pooling, max_connections=args.max_connections,
                      header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                      idle_timeout=args.idle_timeout, max_request_seconds=args.max_request_seconds,
                      max_request_tokens=args.max_request_tokens,
                      allowed_hosts=_names(args.allowed_hosts), cors_origins=tuple(args.cors_origin),
                      aliases=_names(args.alias), stall_seconds=args.stall_seconds)

    def factory():
        from strata.engine.engine import Engine
        engine = Engine(ecfg)
        if not args.no_warmup:
            sd_notify("STATUS=warming up")
            engine.warm_up()           # before the worker reports the engine loaded: READY=1 and /health wait
        return engine

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(cfg, factory))
    except StartupError as e:
        log.error("startup failed", error=str(e))
        print(f"strata serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    from strata.cli.argv import Parser
    p = Parser(prog="strata serve", description="Run Strata's daemon.")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
