"""Engine: loads a model over its stages and runs requests on its live sequences, one per request slot (a request
alone with one slot; with several, in engine steps that batch their decodes, scheduler.py): prompts rendered and
tokenized, requests checked (validation.py), prompts read in parts with checkpoints (prefill.py) through the
conversation store (strata.cache.store: checkpoints, parking, session files), choices decoded (decode.py), status
reported."""
from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import structlog

import link

from strata.backend import quant

from strata.cache.checkpoints import CheckpointCache
from strata.cache.store import ConversationStore
from strata.gguf import identity
from strata.gguf.default_model import resolve_model
from strata.engine import embed as embeddings, report
from strata.engine.config import EngineConfig
from strata.engine.decode import Decoder, env_flag
from strata.engine.prefill import PromptReader
from strata.engine.scheduler import Scheduler, Slot
from strata.engine.slots import slot_error
from strata.engine.spec_policy import AdaptiveN
from strata.engine.lookup import LookupDrafter
from strata.engine.speculate import MTPDrafter, SpecCounts, drafter_kind, spec_refusal
from strata.engine.types import ContextOverflow, FinalEvent, GenerationRequest, TokenEvent, spec_timings
from strata.engine.validation import check_request, prompt_ids
from strata.errors import Refused
from strata.gguf.file import ModelLoadError, open_gguf
from strata.models.registry import supported_archs
from strata.sampling.sampler import SamplingParams
from strata.stages import build_stages, parse_devices, parse_split
from strata.stages.fit import contexts_that_fit
from strata.stages.remote import RemoteStage, parse_remote
from strata.stages.sequence import Sequence
from strata.text.tokenizer import Tokenizer

log = structlog.get_logger("strata.engine")


class Engine:
    """One model over a list of stages, a live sequence per request slot (``parallel``; one by default), one
    conversation store; generate() runs a request (alone with one slot), admit() / step() run several together.

    Engine(config) takes an EngineConfig (strata.engine.config: every option and its default); Engine(model,
    **options) builds one from the model and the flat option names (n_ctx=..., device=..., prompt_cache=...).
    progress: the loader's progress bar (None: a tqdm bar on stderr for models over 500 MiB; True/False; or a
    callable(done_bytes, total_bytes)).

    Raises ModelLoadError / DefaultModelMissing (one-line messages) when loading fails, ValueError for options
    that cannot run together (EngineConfig.problem).
    """

    def __init__(self, model: str | os.PathLike | EngineConfig = "default", *, progress=None, **options):
        if isinstance(model, EngineConfig):
            if options:
                raise TypeError(f"Engine(config) takes no other options, got {', '.join(options)}")
            cfg = model
        else:
            cfg = EngineConfig.build(model=model, **options)
        cfg = cfg.resolved()
        why = cfg.problem()
        if why:
            raise ValueError(why)
        st, ck, pk = cfg.stages, cfg.checkpoints, cfg.parking
        remote = parse_remote(cfg.link.remote_stage)
        devices = parse_devices(st.device)
        split = parse_split(st.layer_split)
        if cfg.threads is not None:
            quant.set_threads(int(cfg.threads))
        self.threads = quant.get_threads()
        self.n_ctx = int(cfg.n_ctx)
        self.ubatch = int(cfg.ubatch)
        self.device = st.device
        kv = st.kv
        # what the KV cache holds on the GPU stages (the CPU backend: float32)
        self.kv = kv if any(d != "cpu" for d in devices) else "f32"
        self._max_token_chars: int | None = None
        self.prompt_cache = cfg.prompt_cache()

        path = resolve_model(cfg.model)
        self.model_path = str(path)
        self.model_name = path.stem
        t0 = time.perf_counter()
        self.file = open_gguf(path, archs=supported_archs())
        self.config = self.file.config
        self.arch = self.file.arch
        self.n_vocab = int(self.config.n_vocab)
        n_train = int(getattr(self.config, "n_ctx_train", 0) or 0)
        if n_train and self.n_ctx > n_train:    # llama.cpp warns the same way (n_ctx_per_seq > n_ctx_train)
            log.warning("n_ctx exceeds the model's training context: quality degrades past it", n_ctx=self.n_ctx,
                        n_ctx_train=n_train, model=self.model_name)
        key = link.read_key_file(cfg.link.key_file) if cfg.link.key_file else None

        def make_remote(index, hops, model):
            # the worker may hold, besides the cache's N, the one being saved before an eviction, the one a plan
            # restores and the prompt's state of n > 1 choices: room for 2N + 2 (at most the worker's 64). A read's
            # mid-prompt checkpoints (periodic, tail) are among the N: they are saved one at a time and each save's
            # retention lets go of the ids it evicts, which the next CkptSave's keep list leaves out
            # and, parking, the conversations parked resident and the checkpoints they hold beyond the N (each
            # holds those on its path: at most N of its own), plus those held by conversations below the device
            # that a live sequence extends (at most N per request slot); the others leave the worker with their
            # holders (strata.cache.held)
            parts = 2 * self.prompt_cache + 2 if self.prompt_cache else 0
            if pk.ram_mib != 0:
                parts += int(pk.resident) * (1 + self.prompt_cache) + 1 + int(cfg.parallel) * self.prompt_cache
            parts = min(64, parts)
            # no forward call reads more than the context holds, whatever --ubatch says (the worker refuses more)
            return RemoteStage(index, hops, model, fingerprint=self.file.fingerprint(), n_ctx=self.n_ctx,
                               max_batch=min(self.ubatch, self.n_ctx), ckpt_max=parts, key=key,
                               encrypt=cfg.link.encrypt,
                               insecure=cfg.link.insecure, slots=int(cfg.parallel),
                               require_row_ids=cfg.link.require_row_ids,
                               summary=identity.summary(self.file, self.model_path, int(model.n_blocks)))

        self.remote = remote
        fit = 0           # --parallel auto: slots whose pages the devices hold beside the weights (pool_ctx)
        auto = cfg.parallel == "auto"
        if auto:
            cfg = cfg.replace(parallel=cfg.auto_parallel())
            fit = cfg.parallel if cfg.parallel > 1 and st.kv_pool_ctx is None else 0

        def pool_ctx(loaded):
            nonlocal cfg
            n = contexts_that_fit(loaded, self.n_ctx, fit)
            if n < fit:
                log.info(f"--parallel auto: one request slot (the devices cannot hold {fit} contexts' KV pages "
                         f"beside the weights)", n_ctx=self.n_ctx)
                cfg = cfg.replace(parallel=n)
            return cfg.pool_ctx() or self.n_ctx

        self.stages = build_stages(self.file, devices, split, self.n_ctx, kv, progress, remote=remote,
                                   make_remote=make_remote, pool_ctx=pool_ctx if fit else cfg.pool_ctx(),
                                   moe_tier=cfg.moe.settings(),
                                   ctx_flag=f"--parallel (auto: {fit}) or --n-ctx ({self.n_ctx})" if fit
                                   else cfg.pool_flags())
        self.parallel = int(cfg.parallel)
        if auto:
            log.info("request slots (--parallel auto)", parallel=self.parallel, n_ctx=self.n_ctx)
        try:
            self.tokenizer = Tokenizer.from_gguf(self.file.metadata)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        self.template, self._template_error = _make_template(self.file, self.tokenizer)
        self.load_ms = (time.perf_counter() - t0) * 1000.0
        ram_mib = pk.ram_mib
        if ram_mib is None:
            ram_mib = default_conversation_cache_mib()
        no_host = next((x for x in self.stages if not x.memory.host_parts), None)
        if ram_mib and no_host is not None:      # a worker that cannot stream its parts (no +park)
            if pk.ram_mib is not None or pk.disk_dir:
                self.close()
                raise ValueError(f"parking (--conversation-cache-mib) needs every worker to announce +park; stage "
                                 f"{no_host.index}'s ({no_host.device}) does not (an older strata worker): upgrade it")
            ram_mib = 0
        # the conversation store: the checkpoint tree, parked conversations, session files; ValueError for a
        # --slot-save-path or --conversation-cache-dir that is not a directory
        self.store = ConversationStore(
            self.stages, self.file, self.n_ctx,
            checkpoints=CheckpointCache(cap=self.prompt_cache, every=int(ck.every), root_min=int(ck.root),
                                        budget_bytes=int(ck.mib) * 1024 * 1024, tail=int(ck.tail)),
            park_bytes=int(ram_mib) * 1024 * 1024 if ram_mib else None,
            disk_dir=pk.disk_dir, disk_bytes=int(pk.disk_mib) * 1024 * 1024,
            slot_save_path=pk.slot_save_path, resident=int(pk.resident), n_vocab=self.n_vocab,
            slot_quota_bytes=int(pk.slot_quota_mib) << 20 if pk.slot_quota_mib else None)
        self.cache = self.store.checkpoints
        # the live sequences, one per request slot; a KV pool short of pages for one drops checkpoints and moves
        # resident conversations to RAM (ConversationStore.make_room), then (several slots) forgets an idle slot's
        seqs = [Sequence(self.stages, make_room=self.store.make_room if self.parallel == 1 else self._make_room)
                for _ in range(self.parallel)]
        self.seq = seqs[0]
        self.store.prepin()                       # host memory for parking, set aside now (/status reports it)
        if st.kv_pool_ctx is not None and st.kv_pool_ctx > self.n_ctx and self.store.resident is None \
                and self.prompt_cache == 0:
            log.warning("--kv-pool-ctx is larger than --n-ctx but nothing holds pages beside the live sequence (no "
                        "checkpoints: --prompt-cache 0, and nothing parked resident): the extra pool is unused",
                        kv_pool_ctx=st.kv_pool_ctx, n_ctx=self.n_ctx)
        self.eog_ids = set(int(t) for t in self.tokenizer.eog_ids)
        self.spec = int(cfg.spec.n)
        # one drafter per request slot, each drafting from its own slot's conversation: the MTP head's (its K/V that
        # slot's sequence's "draft" field on the last stage, or a table of its own, the last stage remote) or the
        # lookup's (an n-gram index of the slot's tokens); each slot's decoder has its own adaptive policy
        drafters: list = [None] * len(seqs)
        self.spec_draft: str | None = None       # 'mtp' or 'lookup' while --spec > 0
        if self.spec > 0:
            last = self.stages[-1]
            model = getattr(last, "model", None)
            if cfg.spec.draft != "lookup" and model is not None and hasattr(model, "load_mtp"):
                model.load_mtp()            # the main runs the drafter beside the head when a worker runs the tail
            kind = drafter_kind(cfg.spec.draft, model)
            why = spec_refusal(self.stages, model, kind)
            if why:
                self.close()
                raise ValueError(why)
            self.spec_draft = kind
            if kind == "lookup":
                drafters = [LookupDrafter(seq, cfg.spec.ngram_min, cfg.spec.ngram_max) for seq in seqs]
            else:
                drafters = [MTPDrafter(seqs[0], last, model, self.n_ctx)]
                drafters += [MTPDrafter(seq, last, model, self.n_ctx, graph=drafters[0].graph) for seq in seqs[1:]]
        self.drafter = drafters[0]              # slot 0's (a one-slot engine's only one)
        self.spec_totals = SpecCounts()          # every choice's, since the start (/metrics)
        slots = []
        for i, seq in enumerate(seqs):
            hidden = drafters[i] if drafters[i] is not None and drafters[i].wants_hidden else None
            reader = PromptReader(seq, self.store, self.ubatch, drafter=hidden,
                                  peers=(lambda seq=seq: [s for s in seqs if s is not seq]) if len(seqs) > 1 else None)
            decoder = Decoder(seq, self.tokenizer, self.eog_ids, self.n_vocab, self.n_ctx, self.stages[-1],
                              lambda seq=seq: self.store.forget(seq), drafter=drafters[i], spec=self.spec,
                              spec_min_p=float(cfg.spec.min_p), spec_max_ctx=int(cfg.spec.max_ctx),
                              adaptive=AdaptiveN(self.spec) if drafters[i] is not None and cfg.spec.adaptive
                              else None)
            slots.append(Slot(i, seq, reader, decoder))
        self.reader, self.decoder = slots[0].reader, slots[0].decoder
        # the request slots and continuous batching over them (--parallel); one slot runs a request alone (generate)
        self.scheduler = Scheduler(slots, lambda slot, req, prompt: self._request(slot, req, prompt, alone=False),
                                   budget=self.ubatch)
        self.slots = slots
        self._lock = threading.Lock()
        self.requests = 0
        self.last_final: FinalEvent | None = None
        self.warmup: dict | None = None           # what warm_up() ran and took (None: not run)

    def warm_up(self) -> dict:
        """Run the shapes a request will use once, leaving no state behind (strata.engine.warmup); kept for
        /status."""
        from strata.engine.warmup import warm_up
        self.warmup = warm_up(self)
        return self.warmup

    @property
    def park(self):
        """The parked conversations in host RAM (a strata.cache.parked.Tier: budget, counters, conversations), or None (no parking)."""
        return self.store.park_store

    @property
    def disk(self):
        """The disk tier of parking (strata.cache.disk.DiskTier), or None."""
        return self.store.disk

    @property
    def slot_save_path(self):
        """The directory of session files (a Path), or None."""
        return self.store.files.directory

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

    def renders_quickly(self, messages: list) -> bool:
        """Whether render_chat(messages) will likely take about a millisecond (a later turn of a chat rendered
        before: ChatTemplate.renders_quickly), so a caller may run it where it is instead of handing it to a
        thread."""
        return self.template is not None and self.template.renders_quickly(messages)

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
        subclasses) and ValueError for a token id outside the vocabulary or bad numbers. With one slot only one
        request runs at a time: the iterator takes the engine's lock on its first step and releases it when it ends
        or is closed (closing it early counts as a cancel; the live sequence stays consistent either way). With
        several slots the request is admitted to one (req.id_slot, else choose_slot's) and engine steps run, the
        lock taken per step, until it ends: requests admitted meanwhile (``admit``) run along.

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
        return self._run(req, self._checked_prompt(req))

    def validate(self, req: GenerationRequest) -> None:
        """What generate() checks before it starts (nothing is touched; safe from any thread): raises EmptyPrompt,
        ContextOverflow, MaxTokensTooLarge or ValueError (one line). The server calls it before queueing."""
        self._checked_prompt(req)

    def _checked_prompt(self, req: GenerationRequest) -> np.ndarray:
        """The request's prompt as int32 token ids, the request checked against this engine (validation.py)."""
        if req.id_slot is not None and (isinstance(req.id_slot, bool) or not isinstance(req.id_slot, int)
                                        or not 0 <= req.id_slot < self.parallel):
            raise Refused(slot_error(req.id_slot, self.parallel), param="id_slot")
        prompt = prompt_ids(req.prompt_tokens, self.n_vocab)
        check_request(req, prompt, n_ctx=self.n_ctx, n_vocab=self.n_vocab,
                      n_ctx_train=int(getattr(self.config, "n_ctx_train", 0) or 0), remote=bool(self.remote),
                      prompt_cache=self.prompt_cache)
        return prompt

    def state_reset(self) -> None:
        """Forget the live sequence (ConversationStore.forget: back to position 0, not to be continued live; the
        checkpoints and parked conversations stay)."""
        self.store.forget(self.seq)

    def state_hashes(self, slot: int = 0) -> dict[str, str]:
        """A slot's live sequence's state hashes (Sequence.hashes: tokens, per-layer K/V and running state)."""
        with self._lock:
            return self.slots[slot].seq.hashes()

    def _prefill(self, req: GenerationRequest, prompt: np.ndarray, trace: bool):
        """Read the prompt alone (slot 0's PromptReader.prefill) -> (plan, parts, logits); bench/model_clock.py times
        it here."""
        return self.reader.prefill(req, prompt, trace)

    def _run(self, req: GenerationRequest, prompt: np.ndarray) -> Iterator[TokenEvent | FinalEvent]:
        if self.parallel > 1:
            yield from self._run_in_slot(req, prompt)
            return
        with self._lock:
            self.scheduler.new_task(self.slots[0])
            yield from self._request(self.slots[0], req, prompt, alone=True)

    def _run_in_slot(self, req: GenerationRequest, prompt: np.ndarray) -> Iterator[TokenEvent | FinalEvent]:
        """generate() with several slots: the request admitted to a slot and engine steps run until it ends (the
        other slots' requests, admitted through ``admit``, step along)."""
        events: collections.deque = collections.deque()
        done: list = []
        with self._lock:
            slot = self.scheduler.admit(req, prompt, events.append, done.append)
        if slot is None:
            raise Refused(f"id_slot {req.id_slot}: that slot is processing a request", param="id_slot")
        try:
            while True:
                while events:
                    yield events.popleft()
                if done:
                    break
                with self._lock:
                    self.scheduler.step()
        finally:
            if not done:                       # closed early: a cancel, seen at the request's next read
                req.cancel.set()
                with self._lock:
                    while not done:
                        self.scheduler.step()
        if done[0] is not None:
            raise done[0]

    def admit(self, req: GenerationRequest, on_event, on_done) -> int | None:
        """Put `req` in a request slot (Scheduler.admit: its id_slot, else the longest shared prefix, else the least
        recently used) to run through ``step``: its events go to on_event(event), then on_done(None | exception)
        -> the slot's id, or None when no slot can take it now (it waits). Raises what ``validate`` raises."""
        prompt = self._checked_prompt(req)
        with self._lock:
            slot = self.scheduler.admit(req, prompt, on_event, on_done)
        return None if slot is None else slot.id

    def step(self) -> int:
        """One engine step over the busy slots (Scheduler.step) -> the tokens it read (0: every slot idle)."""
        with self._lock:
            return self.scheduler.step()

    def _request(self, slot: Slot, req: GenerationRequest, prompt: np.ndarray, alone: bool):
        """One request in `slot`: its prompt read, then its choices decoded -> a generator of TokenEvents and
        FinalEvents; alone, every read runs at once (the one-slot engine's generate), else it also yields each read
        (ReadPart / ReadToken) for the scheduler to serve in an engine step."""
        seq = slot.seq
        n = len(prompt)
        trace = env_flag("STRATA_TRACE")
        t_start = time.perf_counter()
        if alone:
            plan, parts, logits = self._prefill(req, prompt, trace)
        else:
            plan, parts, logits = yield from slot.reader.steps(req, prompt, trace)
        prompt_n = seq.pos - plan.resume_pos          # tokens read (all of them unless cancelled)
        prompt_ms = (time.perf_counter() - t_start) * 1000.0

        params = req.sampling if req.sampling is not None else SamplingParams(temperature=0.0)
        if req.logprobs is not None and params.logprobs != req.logprobs:
            params = dataclasses.replace(params, logprobs=req.logprobs)
        n_choices = max(1, int(req.n))
        # the prompt is read once: every later choice restarts from its state (restored) and its last logits (kept)
        at_prompt = seq.capture() if n_choices > 1 and logits is not None else None
        first_logits = logits.copy() if at_prompt is not None else logits
        greedy = params.temperature <= 0
        replay = None                 # greedy: (choice 0's events, its outcome), which every other choice repeats
        try:
            for i in range(n_choices):
                t0 = time.perf_counter()
                counts = SpecCounts()
                if i > 0 and (req.cancel.is_set() or first_logits is None):     # cancelled before this choice started
                    finish, toks, trailing, stopped_by, n_run = "cancelled", [], "", None, 0
                elif i > 0 and replay is not None:
                    events, (finish, toks, trailing, stopped_by) = replay
                    for ev in events:
                        yield dataclasses.replace(ev, index=i)
                    n_run = 0
                else:
                    if i > 0:
                        seq.restore(at_prompt)
                    events = []
                    out = (slot.decoder.choice if alone else slot.decoder.steps)(
                        req, prompt, first_logits if i == 0 else first_logits.copy(), params, i, counts,
                        events if greedy and n_choices > 1 else None)
                    try:
                        finish, toks, trailing, stopped_by = yield from out
                    finally:
                        out.close()           # the consumer went away mid-choice: the decode's own cleanup runs now
                        self.requests += i == 0
                        self.spec_totals.add(counts)
                        slot.spec.add(counts)
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
                             "cache_n": plan.resume_pos if first else n,
                             **spec_timings(counts.drafted, counts.accepted, counts.verifies)},
                    strata={"resume_pos": plan.resume_pos if first else n,
                            "resume_from": plan.resume_from if first else "choice", "parts": parts if first else [],
                            "checkpoints": len(self.cache), "stopped_by": stopped_by, "id_slot": slot.id},
                    text=trailing, index=i)
                if trace:
                    log.info("request_done", choice=i, finish=finish, prompt_n=final.timings["prompt_n"],
                             cache_n=final.timings["cache_n"], predicted_n=n_run, prompt_ms=round(prompt_ms, 2),
                             predicted_ms=round(predicted_ms, 2), checkpoints=len(self.cache))
                self.last_final = final
                yield final
        finally:
            if at_prompt is not None:
                at_prompt.release()          # its pages go back to the pool

    # ---- embeddings (strata.engine.embed) -------------------------------------------------------------
    def embed(self, inputs: list, *, pooling: str | None = None, normalize: int = 2, cancel=None) -> list:
        """Embeddings of each input (token ids), read in scratch sequences beside the live conversation (its tokens,
        state and checkpoints untouched) -> [embed.Embedding]. pooling: none / mean / cls / last (None: the
        model's, embed.default_pooling); normalize: llama.cpp's embd_normalize (pooled vectors only). Raises
        embed.EmbedRefused (one line naming the field; NotServed with a remote stage) before reading anything;
        embed.EmbedCancelled after the forward call during which cancel (a threading.Event) was set."""
        embeddings.check_inputs(inputs, self.n_ctx, self.n_vocab)
        pooling = pooling or embeddings.default_pooling(self.file.metadata, self.arch)
        with self._lock:
            return embeddings.embed(self.stages, inputs, pooling=pooling, norm=int(normalize), ubatch=self.ubatch,
                                    progress=lambda: self._embed_progress(cancel))

    def _embed_progress(self, cancel) -> None:
        self.seq.forward_returned = time.monotonic()     # the stall clock /health reads: a forward call returned
        if cancel is not None and cancel.is_set():
            raise embeddings.EmbedCancelled("the embedding request was cancelled (its client went away)")

    # ---- conversations held apart: parking and session files (strata.cache.store) --------------------
    def slot_save(self, slot_id: int = 0, filename=None, **_ignored) -> dict[str, Any]:
        """Save the slot's conversation (with its checkpoints) to --slot-save-path/filename, atomically
        (llama-server's POST /slots/{id}?action=save). SessionError / ValueError (one line), nothing written."""
        slot = self._idle_slot(slot_id)
        path = self.store.files.path(filename)
        with self._lock:
            return self.store.save(slot.seq, path, filename, slot_id=slot.id)

    def slot_restore(self, slot_id: int = 0, filename=None, **_ignored) -> dict[str, Any]:
        """Restore the slot's conversation from --slot-save-path/filename (llama-server's POST
        /slots/{id}?action=restore): the file is read under the live engine's limits and every part validated
        before anything is written; on any error the live conversation is exactly as it was."""
        slot = self._idle_slot(slot_id)
        path = self.store.files.path(filename, exists=True)
        with self._lock:
            return {**self.store.load(slot.seq, path, filename), "id_slot": slot.id}

    def check_slot_file(self, action: str, filename) -> None:
        """What a slot save (action "save") or restore ("restore") refuses whatever its slot is doing: session files
        off (no --slot-save-path, a stage whose state cannot reach the main), a bad file name, a file to restore
        that is not there (Refused / SessionError, one line). Reads the configuration and the directory only, so it
        is safe from any thread: the server answers these before the call waits for a busy slot. The engine thread
        checks again (slot_save / slot_restore)."""
        self.store.files.path(filename, exists=action == "restore")

    def _idle_slot(self, slot_id) -> Slot:
        """Request slot `slot_id`, idle: Refused (naming id_slot) for one that does not exist or is processing a
        request (the engine thread calls this between steps, so it stays idle through the call)."""
        n = self.parallel
        if str(slot_id) not in {str(i) for i in range(n)}:
            raise Refused(f"slot {slot_id} does not exist: this engine has {n} slot{'s' if n > 1 else ''} "
                          f"({', '.join(str(i) for i in range(n))})", param="id_slot")
        slot = self.slots[int(slot_id)]
        if slot.busy:
            raise Refused(f"slot {slot.id} is processing a request: try again when it is idle (GET /slots)",
                          param="id_slot", code="slot_busy")
        return slot

    def _make_room(self, seq: Sequence) -> bool:
        """What a slot's sequence calls when a pool is short for it: the conversation store frees what it can
        (ConversationStore.make_room), else the least recently used idle slot's conversation is forgotten, its pages
        given back (its checkpoints stay in the tree) -> False when nothing more can be freed."""
        if self.store.make_room(seq):
            return True
        idle = [s for s in self.slots if not s.busy and s.seq is not seq and s.seq.pos > 0]
        if not idle:
            return False
        victim = min(idle, key=lambda s: (s.last_used, s.id))
        log.info("freeing an idle slot's conversation: the KV pool is short", slot=victim.id, tokens=victim.seq.pos)
        self.store.forget(victim.seq)
        victim.seq.trim()
        return True

    def parked(self) -> list[dict]:
        """The parked conversations for `stratactl cache` (tokens, bytes, tier, checkpoints, last use)."""
        return self.store.parked()

    # ---- visibility ------------------------------------------------------------------------------
    def forward_returned_at(self) -> float:
        """time.monotonic() when a live sequence's last forward call returned (or raised)."""
        return max(s.seq.forward_returned for s in self.slots)

    def unavailable(self) -> str | None:
        """Why no request can run now (a remote stage's link is down and reconnecting), or None."""
        return self.seq.unavailable()

    def close(self) -> None:
        """Stop the stage links' threads and close their connections; give up the disk tier's directory."""
        for st in self.stages:
            st.close()
        store = getattr(self, "store", None)
        if store is not None:
            store.close()

    def checkpoints(self) -> list[dict]:
        """The kept checkpoints, for `stratactl cache`: dicts with pos, kind, bytes, last_use (see strata.cache)."""
        return list(self.cache.entries()) if self.prompt_cache > 0 else []

    def slot_checkpoints(self) -> list[int]:
        """For each request slot, the kept checkpoints on its live conversation's path (those whose tokens are a
        prefix of what the slot holds; 0 for an empty slot or with --prompt-cache 0), as /slots shows them. Safe
        from any thread: the ids are copied, the tree walked under its lock."""
        if self.prompt_cache <= 0:
            return [0] * len(self.slots)
        tree = self.cache.tree
        out = []
        for s in self.slots:
            ids = np.array(s.seq.ids, dtype=np.int32)
            with tree.lock:
                out.append(len(tree.path(ids)) if ids.shape[0] else 0)
        return out

    def clear_checkpoints(self) -> None:
        self.cache.clear()

    def slot_erase(self, slot_id: int = 0, **_ignored) -> dict[str, int]:
        """Forget the slot's conversation (llama.cpp's POST /slots/{id}?action=erase; a request body is ignored):
        the live sequence back to position 0, its KV pages given back and every checkpoint dropped, so the next
        request reads its whole prompt (parked conversations stay). Returns {"id_slot": 0, "n_erased": tokens the live sequence held}.
        ValueError for a slot other than 0."""
        slot = self._idle_slot(slot_id)
        with self._lock:
            n = self.store.erase(slot.seq)       # its KV pages go back to the pool, every checkpoint dropped
        return {"id_slot": slot.id, "n_erased": n}

    def status(self) -> dict[str, Any]:
        """Engine status for `stratactl status` (JSON-ready; strata.engine.report.engine_status)."""
        return report.engine_status(self, busy=self._lock.locked() or self.scheduler.busy > 0)

    def device_info(self) -> dict[str, Any]:
        """The "device" object of /status (strata.engine.report.device_info)."""
        return report.device_info(self)


# ---- helpers -------------------------------------------------------------------------------------

def default_conversation_cache_mib() -> int:
    """--conversation-cache-mib's default: 25 % of host RAM (0 when it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4 // (1024 * 1024))
    except (ValueError, OSError):
        return 0


def _make_template(f, tokenizer):
    """(ChatTemplate, None), or (None, reason) when the GGUF has no usable template (raw text still works)."""
    from strata.text.chat_template import ChatTemplate
    try:
        return ChatTemplate.from_gguf(f.metadata, tokenizer), None
    except ValueError as e:
        return None, str(e)

