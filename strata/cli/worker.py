"""The `strata worker` subcommand: its flags, the key generator, and run(args) serving the stage link under uvloop."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from strata.cli.argv import int_at_least, number_above
from strata.cli.engine_flags import ctx_int, kv_type

DEFAULT_PORT = 7700


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `worker` on the `strata` command's subparsers; sets func=run."""
    p = subparsers.add_parser(
        "worker", help="run a remote stage worker (the main's --remote-stage connects to it)",
        description="Serve some of a model's layers to a Strata main over the stage link (protocol 5, TCP). The "
                    "main tells the worker its carve at the hello; the worker runs it on --device.")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help=f"address to listen on (default 127.0.0.1:{DEFAULT_PORT}; port 0 picks a free one)")
    p.add_argument("--model", "-m", default=os.environ.get("STRATA_MODEL", "default"),
                   help="the same GGUF the main runs (checked by fingerprint at the hello), or 'default'")
    p.add_argument("--device", default=os.environ.get("STRATA_DEVICE", "auto"),
                   help="'auto' (default: the GPU where the CUDA backend runs, else the CPU), 'cpu' or 'cuda[:N]'; "
                        "env STRATA_DEVICE")
    p.add_argument("--kv", default="f16", type=kv_type, choices=("f16", "q8_0"),
                   help="KV cache type on CUDA (q8_0 also spelled int8)")
    p.add_argument("--threads", "-t", type=int_at_least(1, "positive integer"), default=None,
                   help="CPU threads (default: all cores)")
    p.add_argument("--max-context", "--n-ctx", "-c", "--ctx-size", "--max-ctx", dest="max_ctx", type=ctx_int,
                   default=None, metavar="N",
                   help="context length in tokens: the largest a main may ask this worker for (default: the model's "
                        "training context)")
    p.add_argument("--kv-pool-ctx", type=int_at_least(0, "non-negative integer"), default=None, metavar="TOKENS",
                   help="tokens each stage's KV page pool holds (default: the main's --n-ctx for each of its request "
                        "slots, --parallel): more keeps the parts a main parks here (checkpoints, conversations "
                        "parked resident) beside its live sequences")
    p.add_argument("--idle-timeout", type=number_above(0.0, "number of seconds"), default=15.0, metavar="S",
                   help="drop a main's link after S seconds without a frame (default 15; mains ping idle links every "
                        "second)")
    p.add_argument("--link-key-file", default=None, metavar="FILE",
                   help="the shared link key (at least 32 bytes, mode 0600): mains must prove they hold it")
    p.add_argument("--link-encrypt", action="store_true",
                   help="require every main to encrypt the link's frames (AES-256-GCM; needs --link-key-file)")
    p.add_argument("--insecure-link", action="store_true",
                   help="accept a keyed main that does not authenticate frames after the hello (an older strata)")
    p.add_argument("--insecure-listen", action="store_true",
                   help="listen on a non-loopback address without a link key (anyone who reaches it can drive it)")
    p.add_argument("--gen-key", default=None, metavar="FILE",
                   help="write a new random link key to FILE (mode 0600) and exit")
    from strata.cli.engine_flags import add_tier_args
    add_tier_args(p)          # the worker's own expert tier for its carve
    p.add_argument("--log-level", default=os.environ.get("STRATA_LOG_LEVEL", "info"))
    p.add_argument("--log-format", default="auto", choices=("auto", "json", "console"))


def run(args) -> int:
    """Start the worker; returns the exit status (2 usage, 1 start-up failure, 0 clean stop)."""
    import link
    from strata.cli.serve import is_loopback
    from strata.stages.link_client import parse_address
    if args.gen_key:
        try:
            link.write_key_file(args.gen_key)
        except (link.LinkError, OSError) as e:
            print(f"strata worker: error: {e}", file=sys.stderr)
            return 1
        print(f"wrote a new link key to {args.gen_key} (mode 0600); give it to the main and every worker with "
              "--link-key-file")
        return 0
    try:
        host, port = parse_address(args.listen) if not args.listen.endswith(":0") else \
            (args.listen.rpartition(":")[0].strip("[]"), 0)
    except ValueError as e:
        print(f"strata worker: error: --listen {e}", file=sys.stderr)
        return 2
    from strata.stages import parse_devices, resolve_device
    try:
        devices = parse_devices(resolve_device(args.device))
    except ValueError as e:
        print(f"strata worker: error: --device {e}", file=sys.stderr)
        return 2
    if len(devices) != 1:
        print(f"strata worker: error: --device {args.device}: a worker runs its carve on one device", file=sys.stderr)
        return 2
    args.device = devices[0]
    from strata.engine.config import MoeTierConfig, kv_device_problem
    tier = MoeTierConfig(vram_mib=args.moe_vram_mib, adapt_every=args.adapt_every, adapt_swaps=args.adapt_swaps,
                         pcie_frac=args.pcie_frac)
    why = tier.problem() or (None if tier.vram_mib is None or args.device != "cpu" else
                             "--moe-vram-mib needs --device cuda (the expert tier keeps hot experts in VRAM slots)")
    why = why or kv_device_problem(args.kv, [args.device])
    if why:
        print(f"strata worker: error: {why}", file=sys.stderr)
        return 2
    key = None
    if args.link_encrypt and not args.link_key_file:
        print("strata worker: error: --link-encrypt needs --link-key-file (the frame keys derive from the shared key)",
              file=sys.stderr)
        return 2
    if args.link_encrypt and args.insecure_link:
        print("strata worker: error: --link-encrypt and --insecure-link contradict each other: give one",
              file=sys.stderr)
        return 2
    if args.link_key_file:
        try:
            key = link.read_key_file(args.link_key_file)
        except link.LinkError as e:
            print(f"strata worker: error: {e}", file=sys.stderr)
            return 2
    elif not is_loopback(host) and not args.insecure_listen:
        print(f"strata worker: error: listening on {host} (not a loopback address) needs --link-key-file "
              "(strata worker --gen-key FILE writes one), or --insecure-listen", file=sys.stderr)
        return 2
    from strata.serve.log import configure_logging
    configure_logging(args.log_level, json={"auto": None, "json": True, "console": False}[args.log_format])
    import structlog
    import uvloop

    from strata.backend import quant
    from strata.gguf.file import ModelLoadError
    from strata.serve.notify import sd_notify, watchdog, watchdog_interval
    from strata.stages.worker import Worker, WorkerConfig, commit_delay_from_env
    log = structlog.get_logger("strata.worker")
    if args.threads:
        quant.set_threads(int(args.threads))
    if key is None:
        log.warning("no link key: any process that reaches this address can drive the worker", listen=args.listen)
    cfg = WorkerConfig(host=host, port=port, model=args.model, device=args.device, kv=args.kv, key=key,
                       max_ctx=args.max_ctx, idle_timeout=args.idle_timeout, commit_delay_s=commit_delay_from_env(),
                       encrypt=args.link_encrypt, insecure_link=args.insecure_link, moe_tier=tier.settings(),
                       kv_pool_ctx=args.kv_pool_ctx)
    try:
        worker = Worker(cfg)
    except (ModelLoadError, ValueError, OSError) as e:
        print(f"strata worker: error: {e}", file=sys.stderr)
        return 1

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await worker.start()
        except OSError as e:
            print(f"strata worker: error: cannot listen on {args.listen}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"strata worker listening on {host}:{worker.port}", file=sys.stderr, flush=True)
        sd_notify(f"READY=1\nSTATUS=listening on {host}:{worker.port}")
        every = watchdog_interval()          # systemd's WatchdogSec=: pings while the event loop runs
        pinger = asyncio.ensure_future(watchdog(every)) if every else None
        await stop.wait()
        if pinger is not None:
            pinger.cancel()
        sd_notify("STOPPING=1")
        log.info("stopping", listen=f"{host}:{worker.port}")
        await worker.bye("the worker is shutting down")
        worker.server.close()
        await worker.server.wait_closed()
        log.info("stopped")
        return 0

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())
