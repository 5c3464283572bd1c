"""Stages: the layer split (split.py), Stage and ModelRunner (stage.py), and build_stages, which loads a model
onto the stages' devices."""
from __future__ import annotations

from typing import Any, Callable, Union

from strata.memory import Carve
from strata.stages.split import parse_devices, parse_split, plan_stages
from strata.stages.stage import ModelRunner, Stage

#: a KV pool's tokens, or the function of the loaded stages ((carve, model, backend) each) that gives them
PoolCtx = Union[int, Callable[[list], int]]

__all__ = ["ModelRunner", "Stage", "build_stages", "load_stages", "make_backend", "n_main_blocks", "parse_devices",
           "parse_split", "plan_stages", "resolve_device"]


def resolve_device(spec: str) -> str:
    """`spec` itself, or for 'auto': 'cuda:0' where the CUDA backend can run (CuPy, a GPU, the kernel library),
    else 'cpu'."""
    if str(spec).strip() != "auto":
        return spec
    try:
        from strata.backend.cuda.library import unavailable_reason
    except ImportError:
        return "cpu"
    return "cpu" if unavailable_reason() else "cuda:0"


def make_backend(device: str, kv: str = "f16", moe_tier=None):
    """The backend of one device name ('cpu' or 'cuda:N'); ValueError (one line) when it cannot be made. moe_tier:
    the expert tier's TierSettings (a CUDA backend keeps MoE experts in host RAM and VRAM slots), or None."""
    if device == "cpu":
        from strata.backend.cpu import CPUBackend
        return CPUBackend()
    try:
        from strata.backend.cuda import CUDABackend, CudaUnavailable
    except ImportError as e:
        raise ValueError(f"device {device!r} needs the CUDA backend, which is not available: {e}") from None
    try:
        be = CUDABackend(int(device.split(":")[1]), kv_dtype=kv)
        be.moe_tier = moe_tier
        return be
    except CudaUnavailable as e:
        raise ValueError(f"device {device!r}: {e}") from None


def _runner(backend, model, carve: Carve):
    """The fastest runner of `carve` on `backend`: the backend's plan (CUDA graphs) where it has one, else
    ModelRunner."""
    fast = getattr(backend, "fast_path", None)
    if fast is not None:
        r = fast(model, carve.lo, carve.hi)
        if r is not model:
            return r
    return ModelRunner(model, carve.lo, carve.hi)


def pool_ctx_error(pool_ctx: int | None, n_ctx: int) -> str | None:
    """Why a KV pool of pool_ctx tokens (--kv-pool-ctx; None: n_ctx) cannot serve a context of n_ctx, or None."""
    if pool_ctx is not None and pool_ctx < n_ctx:
        return f"--kv-pool-ctx {pool_ctx} is smaller than --n-ctx {n_ctx}: the pool holds at least one context"
    return None


def build_stages(gguf_file, devices: list[str], split, n_ctx: int, kv: str = "f16", progress=None,
                 load=None, remote: list[str] = (), make_remote=None, pool_ctx: PoolCtx | None = None,
                 moe_tier=None, ctx_flag: str | None = None) -> list[Stage]:
    """Load the model in `gguf_file` (an opened GGUFModelFile) onto the stages that --device / --layer-split
    describe: one backend and one model per distinct device (holding the blocks of that device's carves), one
    memory per stage, its KV pool sized for pool_ctx tokens (default n_ctx: one context; more keeps conversations
    parked resident beside the live one, --kv-pool-ctx), or for what pool_ctx(loaded) says once the weights are in
    place (load_stages). `load(file, backend, progress, layers)` builds a model
    (default strata.models.base.load_model). `remote`: the --remote-stage chain's addresses, which run the last
    carves; `make_remote(index, hops, model)` makes the one stage standing for them (hops: [(address, carve)],
    model: the last local stage's, which runs the output head); moe_tier: make_backend's; ctx_flag: the options
    that sized the pool, named when it cannot be allocated (default: --kv-pool-ctx with pool_ctx, else --n-ctx).
    ValueError (one line) for a bad split or device."""
    from strata.models.registry import model_class
    n_blocks = n_main_blocks(gguf_file, model_class(gguf_file.arch))
    backends: dict[str, Any] = {}
    for d in devices:
        if d not in backends:
            backends[d] = make_backend(d, kv, moe_tier)
    plan = plan_stages(devices, split, n_blocks, lambda d: backends[d].total_memory(), remote=remote)
    hops = [(d, c) for c, d in plan[len(plan) - len(remote):]] if remote else []
    stages = load_stages(gguf_file, plan[:len(plan) - len(remote)], backends, pool_ctx or n_ctx, progress, load,
                         ctx_flag=ctx_flag or ("--kv-pool-ctx" if pool_ctx else "--n-ctx"))
    if hops:
        stages.append(make_remote(len(stages), hops, stages[-1].model))
    return stages


def load_stages(gguf_file, plan: list[tuple[Carve, str]], backends: dict[str, Any], n_ctx: PoolCtx,
                progress=None, load=None, head_here: bool = True, ctx_flag: str = "--n-ctx") -> list[Stage]:
    """The stages of `plan` ((carve, device) in layer order, devices in `backends`): one model per device holding
    the blocks of its carves, one memory per stage of n_ctx tokens, or of n_ctx(loaded) tokens where n_ctx is a
    function of the loaded stages ((carve, model, backend) each, weights in place: strata.stages.fit sizes
    --parallel auto's pools by the memory left). head_here=False: a carve ending at the last block returns hidden
    states (a worker's: the main keeps the output head). ctx_flag: the option that set n_ctx (named when the KV
    cache cannot be allocated)."""
    from strata.models.registry import load_model, model_class
    load = load or load_model
    n_blocks = n_main_blocks(gguf_file, model_class(gguf_file.arch))
    models: dict[str, Any] = {}
    for d in dict.fromkeys(d for _, d in plan):
        layers = frozenset(i for c, dd in plan if dd == d for i in c)
        models[d] = load(gguf_file, backends[d], progress, None if len(layers) == n_blocks else layers)
        models[d].head_here = head_here
    if callable(n_ctx):
        n_ctx = int(n_ctx([(c, models[d], backends[d]) for c, d in plan]))
    stages = []
    for i, (carve, d) in enumerate(plan):
        model, be = models[d], backends[d]
        try:
            memory = model.new_memory(n_ctx, carve)
        except MemoryError as e:         # numpy's ArrayMemoryError too; CuPy's OutOfMemoryError is a MemoryError
            which = f" of stage {i} (layers {carve} on {d})" if len(plan) > 1 else ""
            raise ValueError(f"cannot allocate the KV cache{which} for {n_ctx} tokens: "
                             f"{str(e).splitlines()[0]} (choose a smaller {ctx_flag})") from None
        stages.append(Stage(i, carve, d, be, model, memory, _runner(be, model, carve)))
    return stages


def n_main_blocks(f, cls) -> int:
    """The model's main blocks from its metadata alone (before loading): block_count less the MTP layers."""
    n = int(f.config.n_layer)
    n_mtp = int(f.metadata.get(f"{f.arch}.nextn_predict_layers", 0) or 0)
    return n - n_mtp
