"""The worker process of the stage link (`strata worker`): an asyncio server that takes one main at a time, is
told its carve in the main's hello, runs it on its own device, keeps its layers' part of each checkpoint under the
id the main hands it, and relays to the next worker of a chain."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import structlog

import link
from link import Bye, Challenge, Commit, Error, ErrorCode, Hello, HelloAck, LinkError, Ping, Pong
from strata.errors import quoted
from strata.gguf import identity
from strata.memory.hostram import available_ram
from strata.memory import Carve
from strata.stages import load_stages, make_backend, n_main_blocks
from strata.stages.carrier import Carrier, Refuse
from strata.stages.link_client import HANDSHAKE_MAX, LinkClient, LinkDown

log = structlog.get_logger("strata.worker")

CKPT_MAX = 64               # checkpoint parts a worker keeps at most
HELLO_TIMEOUT = 10.0        # seconds a connected main has to send its Hello
IDLE_TIMEOUT = 15.0         # seconds without a frame from the main (it pings an idle link every second)
MAX_BATCH = 8192            # tokens a Forward may carry at most (bounds the frames a main can make the worker read)
MAX_SLOTS = 64              # sequences (request slots) one main may ask a worker to hold


@dataclass
class WorkerConfig:
    host: str
    port: int
    model: str = "default"
    device: str = "cpu"
    kv: str = "f16"
    key: bytes | None = None
    name: str = field(default_factory=socket.gethostname)
    max_ctx: int | None = None       # the largest n_ctx a main may ask for (None: the model's training context)
    idle_timeout: float = IDLE_TIMEOUT  # seconds without a frame before a main's link is dropped
    commit_delay_s: float = 0.0      # test hook (STRATA_TEST_COMMIT_DELAY_MS): Commits applied late, in the background
    encrypt: bool = False            # require encrypted frames from every main (and encrypt the next hop)
    insecure_link: bool = False      # accept a keyed main that does not protect frames after the hello
    moe_tier: Any = None             # the expert tier's TierSettings for this worker's carve (None: experts in VRAM)
    kv_pool_ctx: int | None = None   # tokens each stage's KV pool holds (None: the main's n_ctx): room for the parts
    #                                  a main keeps here (checkpoints, conversations parked resident) beside its sequence


class Worker:
    """The `strata worker` server. The model file is opened at start; the carve's layers are loaded at the first
    hello that names it (and kept while later hellos name the same carve and context)."""

    def __init__(self, cfg: WorkerConfig):
        from strata.gguf.file import open_gguf
        from strata.gguf.default_model import resolve_model
        self.cfg = cfg
        self.path = resolve_model(cfg.model)
        from strata.models.registry import model_class, supported_archs
        self.file = open_gguf(self.path, archs=supported_archs())
        self.fingerprint = self.file.fingerprint()
        self.n_blocks = n_main_blocks(self.file, model_class(self.file.arch))
        self.summary = identity.summary(self.file, self.path, self.n_blocks)
        self.backend = make_backend(cfg.device, cfg.kv, cfg.moe_tier)
        self.max_ctx = int(cfg.max_ctx or getattr(self.file.config, "n_ctx_train", 0) or 131072)
        self._stages: tuple[tuple[int, int, int], list] | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-worker")
        self.busy = False
        self.carrier: Carrier | None = None       # the connected main's
        self.writer = None                          # and its connection (for a Bye at shutdown)
        self.channel: link.Channel | None = None    # and that connection's frame protection
        self.server: asyncio.base_events.Server | None = None
        self.connections = 0

    # ---- the hello ---------------------------------------------------------------------------------------
    def _check_hello(self, h: Hello) -> None:
        if h.protocol != link.VERSION:
            raise Refuse(ErrorCode.VERSION, f"the main's hello says protocol {h.protocol}, this worker speaks "
                                            f"{link.VERSION}", fatal=True)
        if h.fingerprint != self.fingerprint:
            raise Refuse(ErrorCode.MODEL, identity.refusal(self.summary, h.fingerprint, h.n_blocks, h.n_embd),
                         fatal=True)
        if h.n_blocks != self.n_blocks or h.n_embd != int(self.file.config.n_embd):
            raise Refuse(ErrorCode.MODEL, f"the main's model has {h.n_blocks} blocks of width {h.n_embd}, this "
                                          f"worker's {self.n_blocks} of {self.file.config.n_embd}", fatal=True)
        if not 0 < h.lo < h.hi <= self.n_blocks:
            raise Refuse(ErrorCode.MODEL, f"layers [{h.lo}, {h.hi}) are not a worker's carve of this model's "
                                          f"{self.n_blocks} blocks (the main keeps block 0's embeddings)", fatal=True)
        if h.act_dtype != "f32":
            raise Refuse(ErrorCode.MODEL, f"activations in '{quoted(h.act_dtype, 40)}': this worker takes f32",
                         fatal=True)
        if not 1 <= h.n_ctx <= self.max_ctx:
            raise Refuse(ErrorCode.LIMIT, f"n_ctx {h.n_ctx} outside [1, {self.max_ctx}] (this worker's --max-context)",
                         fatal=True)
        if not 1 <= h.max_batch <= min(h.n_ctx, MAX_BATCH):
            raise Refuse(ErrorCode.LIMIT, f"max_batch {h.max_batch} outside [1, {min(h.n_ctx, MAX_BATCH)}]",
                         fatal=True)
        if not 1 <= h.slots <= MAX_SLOTS:
            raise Refuse(ErrorCode.LIMIT, f"the main asks for {h.slots} sequences (--parallel); a worker holds at "
                                          f"most {MAX_SLOTS}", fatal=True)
        if h.ckpt_max > CKPT_MAX:
            raise Refuse(ErrorCode.LIMIT, f"the main asks for {h.ckpt_max} checkpoint parts; a worker keeps at "
                                          f"most {CKPT_MAX}", fatal=True)

    def _stages_for(self, h: Hello) -> list:
        key = (int(h.lo), int(h.hi), int(h.n_ctx), int(h.slots))
        if self._stages is None or self._stages[0] != key:
            self._stages = None                               # the old carve's memory goes first
            plan = [(Carve(h.lo, h.hi), self.cfg.device)]
            try:
                pool = max(int(h.n_ctx) * int(h.slots), int(self.cfg.kv_pool_ctx or 0))   # a context per slot
                stages = load_stages(self.file, plan, {self.cfg.device: self.backend}, pool, progress=False,
                                     head_here=False)
            except (ValueError, MemoryError) as e:
                raise Refuse(ErrorCode.LIMIT, f"cannot hold layers [{h.lo}, {h.hi}) for n_ctx {h.n_ctx}: "
                                              f"{str(e).splitlines()[0]}", fatal=True) from None
            self._stages = (key, stages)
            log.info("carve loaded", layers=f"[{h.lo}, {h.hi})", n_ctx=h.n_ctx, device=self.cfg.device)
        return self._stages[1]

    def caps(self) -> list[str]:
        """The capabilities this worker announces in its Challenge: frame protection with a key (none without one:
        frames stay plain), ``+spec`` (speculative decoding's verify and Commit, Carrier.forward / commit) and ``+park``
        (a kept part's bytes streamed to the main and back, Carrier.part_get / part_put), ``+drops`` (a Result names
        the kept parts dropped to make room for its Forward, Carrier.forward), ``+slots`` (a sequence per request
        slot, addressed by the seq fields, and the batched decode step, Carrier.batch_forward), ``+rowids`` (that
        step's answer names each row's sequence and position, and a Forward's its sequence, when the hello asks)."""
        own = [link.CAP_SPEC, link.CAP_PARK, link.CAP_DROPS, link.CAP_SLOTS, link.CAP_ROWIDS]
        if self.cfg.key is None:
            return own
        return [link.CAP_MAC, link.CAP_AEAD] + ([link.CAP_ENCRYPT] if self.cfg.encrypt else []) + own

    def setup(self, h: Hello, frames: str = link.FRAMES_PLAIN) -> tuple[Carrier, HelloAck]:
        """Check the hello, load the carve, link the next worker (a relay does it again for every main, so the
        next one checks the real limits; encrypted when its own main's link is) -> the Carrier and the HelloAck
        (mac not yet set)."""
        self._check_hello(h)
        stages = self._stages_for(h)
        part_bytes = sum(int(a.nbytes) for st in stages
                         for parts in st.model.new_running_state(st.carve).values() for a in parts.values())
        next_hop, granted = None, int(h.ckpt_max)
        if h.next_hops:
            nh, rest = h.next_hops[0], h.next_hops[1:]
            if nh.lo != h.hi:
                raise Refuse(ErrorCode.MODEL, f"the next worker's carve starts at {nh.lo}, this one ends at {h.hi}",
                             fatal=True)
            addr = f"[{nh.host}]:{nh.port}" if ":" in nh.host else f"{nh.host}:{nh.port}"
            next_hop = LinkClient(addr, self.cfg.key, encrypt=self.cfg.encrypt or frames == link.FRAMES_AEAD,
                                  insecure=self.cfg.insecure_link, model=self.summary)
            try:
                ack = next_hop.connect(Hello(protocol=link.VERSION, fingerprint=h.fingerprint, lo=nh.lo, hi=nh.hi,
                                             n_blocks=h.n_blocks, n_embd=h.n_embd, act_dtype=h.act_dtype,
                                             n_ctx=h.n_ctx, max_batch=h.max_batch, ckpt_max=h.ckpt_max,
                                             next_hops=list(rest), nonce=b"", mac=b"", slots=h.slots,
                                             row_ids=h.row_ids))
            except LinkDown as e:
                raise Refuse(ErrorCode.NEXT_HOP, f"relay: {e}", fatal=True) from None
            next_hop.max_payload = max(1 << 20, max(int(h.max_batch), int(h.slots)) * (int(h.n_embd) * 4 + 16) + 4096)
            part_bytes += int(ack.part_bytes)
            granted = min(granted, int(ack.ckpt_max))
        try:
            self._check_ram(granted, part_bytes)
        except Refuse:
            if next_hop is not None:
                next_hop.close()
            raise
        carrier = Carrier(stages, h, granted, next_hop)
        ack = HelloAck(protocol=link.VERSION, fingerprint=self.fingerprint, lo=h.lo, hi=h.hi, ckpt_max=granted,
                       part_bytes=part_bytes, worker=self.cfg.name, device=self.cfg.device, mac=b"")
        return carrier, ack

    @staticmethod
    def _check_ram(granted: int, part_bytes: int) -> None:
        """Refuse checkpoint parts this worker cannot hold: any when its available RAM cannot be read, more than
        half of it."""
        if granted <= 0:
            return
        avail = available_ram()
        if avail is None:
            raise Refuse(ErrorCode.LIMIT, "this worker cannot read its available RAM, so it keeps no checkpoint "
                                          "parts: run the main without --prompt-cache", fatal=True)
        if granted * part_bytes > avail // 2:
            raise Refuse(ErrorCode.LIMIT, f"{granted} checkpoint parts of {part_bytes} bytes exceed half of this "
                                          f"worker's available RAM ({avail // 2} bytes)", fatal=True)

    # ---- the server --------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.server = await asyncio.start_server(self._on_main, self.cfg.host, self.cfg.port)
        bound = [s.getsockname() for s in self.server.sockets]
        log.info("worker listening", address=[f"{a[0]}:{a[1]}" for a in bound], model=self.path.name,
                 device=self.cfg.device, keyed=self.cfg.key is not None, caps=self.caps())

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def _on_main(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, served until it closes; the worker stopping (SIGTERM) with a main connected ends it
        without an error."""
        try:
            await self._connection(reader, writer)
        except asyncio.CancelledError:
            log.info("connection closed: the worker is stopping")

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: the Challenge, an authenticated Hello (only then is the worker taken: a connection that
        says nothing or holds no key cannot lock a main out), the carve set up, then _serve until it closes."""
        peer = writer.get_extra_info("peername")
        who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        carrier, taken = None, False
        loop = asyncio.get_running_loop()
        try:
            nonce = link.new_nonce()
            await self._send(writer, Challenge(nonce=nonce, keyed=self.cfg.key is not None,
                                               worker=link.challenge_name(self.cfg.name, self.caps())), 0)
            try:
                hdr, hello = await asyncio.wait_for(link.read_frame(reader, HANDSHAKE_MAX), HELLO_TIMEOUT)
            except LinkError as e:
                await self._send(writer, Error(code=e.code if isinstance(e.code, int) else ErrorCode.BAD_FRAME,
                                               message=str(e)), 1)
                log.warning("refused a main at the hello", peer=who, error=str(e))
                return
            rid = hdr.request_id
            if not isinstance(hello, Hello):
                await self._send(writer, Error(code=ErrorCode.BAD_FRAME,
                                               message=f"expected a Hello, got {type(hello).__name__}"), rid)
                return
            frames = link.FRAMES_PLAIN
            if self.cfg.key is not None:
                frames = link.hello_frames(self.cfg.key, nonce, hello)
                if frames is None:
                    why = "the main sent no link key" if not hello.mac else \
                        "the main's link key does not match this one"
                    await self._send(writer, Error(code=ErrorCode.AUTH, message=f"{why} (--link-key-file)"), rid)
                    log.warning("refused a main: link key", peer=who, error=why)
                    return
                try:
                    link.worker_accepts(frames, encrypt=self.cfg.encrypt, insecure=self.cfg.insecure_link)
                except LinkError as e:
                    await self._send(writer, Error(code=e.code, message=str(e)), rid)
                    log.warning("refused a main: frame protection", peer=who, error=str(e))
                    return
            if self.busy:
                log.warning("refusing a second main", peer=who)
                await self._send(writer, Error(code=ErrorCode.BUSY, message="another main is connected to this "
                                                                            "worker"), rid)
                return
            self.busy, taken = True, True
            self.connections += 1
            try:
                carrier, ack = await loop.run_in_executor(self.pool, self.setup, hello, frames)
            except Refuse as e:
                await self._send(writer, Error(code=e.code, message=str(e)), rid)
                log.warning("refused a main at the hello", peer=who, error=str(e))
                return
            chan = None
            if self.cfg.key is not None:
                ack.mac = link.ack_mac(self.cfg.key, hello.nonce, ack, frames)
                chan = link.channel_for("worker", self.cfg.key, nonce, hello.nonce, frames)
                if frames == link.FRAMES_PLAIN:
                    log.warning("stage link frames are not authenticated (--insecure-link)", peer=who)
            self.carrier, self.writer = carrier, writer
            await self._send(writer, ack, rid)
            self.channel = chan
            log.info("main connected", peer=who, layers=f"[{hello.lo}, {hello.hi})", ckpt_max=ack.ckpt_max,
                     relay=len(hello.next_hops), frames=frames)
            await self._serve(reader, writer, carrier, max(1 << 20, max(int(hello.max_batch), int(hello.slots)) *
                                                         (int(hello.n_embd) * 4 + 16) + 4096), who, chan)
        except asyncio.TimeoutError:
            log.info("main gone", peer=who, error=f"no frame for {self.cfg.idle_timeout:g} s (or no Hello in "
                                                 f"{HELLO_TIMEOUT:g} s)")
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as e:
            log.info("main gone", peer=who, error=str(e) or type(e).__name__)
        finally:
            if carrier is not None:
                self.carrier = self.writer = self.channel = None
                await loop.run_in_executor(self.pool, carrier.close)
            if taken:
                self.busy = False
                log.info("main disconnected: checkpoint store cleared", peer=who)
            writer.close()

    async def bye(self, reason: str) -> None:
        """Tell the connected main this worker is going away (SIGTERM), before the server closes."""
        w = self.writer
        if w is not None:
            try:
                await self._send(w, Bye(reason=reason), 0, self.channel)
            except (ConnectionError, OSError):
                pass

    async def _serve(self, reader, writer, carrier: Carrier, max_payload: int, who: str, chan=None) -> None:
        """Read the main's frames (through `chan`, the connection's link.Channel, when they are protected): Pings
        answered at once (also while a request computes), requests run one after the other on the compute thread
        and answered in order (a Commit late, with the test hook). A refused frame closes the link."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        late: set[asyncio.Task] = set()
        pinging: set[asyncio.Task] = set()

        async def run(hdr, msg) -> bool:
            try:
                reply = await loop.run_in_executor(self.pool, carrier.handle, msg)
            except Refuse as e:
                await self._send(writer, Error(code=e.code, message=str(e)), hdr.request_id, chan)
                log.warning("request refused", peer=who, request=type(msg).__name__, error=str(e))
                return not e.fatal
            except Exception as e:  # noqa: BLE001 -- the main gets the one line; the worker stays up
                log.exception("request failed", peer=who, request=type(msg).__name__)
                await self._send(writer, Error(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}"),
                                 hdr.request_id, chan)
                return True
            await self._send(writer, reply, hdr.request_id, chan)
            return True

        async def keep_next() -> None:
            """A relay's idle next hop hears from it as its main's pings reach the relay (on the compute thread,
            the next link's one user); a next hop gone closes this link, so the main reconnects and re-links."""
            try:
                if not await loop.run_in_executor(self.pool, carrier.ping_next):
                    writer.close()
            finally:
                pinging.clear()

        async def late_commit(hdr, msg) -> None:
            await asyncio.sleep(self.cfg.commit_delay_s)
            await run(hdr, msg)

        async def compute() -> None:
            while True:
                hdr, msg = await queue.get()
                if isinstance(msg, Commit) and self.cfg.commit_delay_s > 0:
                    t = asyncio.ensure_future(late_commit(hdr, msg))
                    late.add(t)
                    t.add_done_callback(late.discard)
                    continue
                if not await run(hdr, msg):
                    writer.close()
                    return

        worker_task = asyncio.ensure_future(compute())
        try:
            while not worker_task.done():
                read = asyncio.ensure_future(asyncio.wait_for(link.read_frame(reader, max_payload, chan),
                                                              self.cfg.idle_timeout))
                done, _ = await asyncio.wait({read, worker_task}, return_when=asyncio.FIRST_COMPLETED)
                if read not in done:
                    read.cancel()
                    break
                try:
                    hdr, msg = read.result()
                except LinkError as e:
                    code = ErrorCode.AUTH if isinstance(e, link.FrameAuthError) else ErrorCode.BAD_FRAME
                    await self._send(writer, Error(code=code, message=str(e)), 0, chan)
                    log.warning("bad frame from the main", peer=who, error=str(e))
                    return
                if isinstance(msg, Ping):
                    await self._send(writer, Pong(nonce=msg.nonce), hdr.request_id, chan)
                    if carrier.next is not None and queue.empty() and not pinging:
                        pinging.add(asyncio.ensure_future(keep_next()))
                elif isinstance(msg, Pong):
                    continue
                elif isinstance(msg, Bye):
                    return
                else:
                    queue.put_nowait((hdr, msg))
        finally:
            worker_task.cancel()
            for t in list(late):
                t.cancel()

    @staticmethod
    async def _send(writer, msg, rid: int, chan=None) -> None:
        link.write_frame(writer, msg, rid, channel=chan)
        await writer.drain()

    async def serve_forever(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            self.server.close()
            await self.server.wait_closed()
            self.pool.shutdown(wait=False, cancel_futures=True)


def commit_delay_from_env() -> float:
    """STRATA_TEST_COMMIT_DELAY_MS: the test hook that applies Commits late (seconds; 0 off)."""
    try:
        return max(0.0, float(os.environ.get("STRATA_TEST_COMMIT_DELAY_MS", "0") or 0) / 1000.0)
    except ValueError:
        return 0.0
