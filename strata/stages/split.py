"""The layer split: parsing --device / --layer-split and choosing each stage's carve and device."""
from __future__ import annotations

from typing import Callable, Sequence

from strata.memory import Carve


def parse_devices(spec: str) -> list[str]:
    """'cpu', 'cuda', 'cuda:N' or a comma list of them -> device names ('cuda' is 'cuda:0'). ValueError naming
    the accepted forms otherwise. CPU and CUDA stages may be mixed (layers the GPUs cannot hold run on the CPU)."""
    out = []
    for d in str(spec).split(","):
        d = d.strip()
        if d == "cuda":
            d = "cuda:0"
        if d != "cpu" and not (d.startswith("cuda:") and d[5:].isascii() and d[5:].isdigit()):
            raise ValueError(f"unknown device {d!r}: use 'cpu', 'cuda[:N]' or a comma list of them")
        out.append(d)
    return out


def mixed(devices: Sequence[str]) -> bool:
    """Whether the devices put some stages on the CPU and others on a GPU."""
    return len({d == "cpu" for d in devices}) > 1


def mixed_split_error(devices: Sequence[str]) -> str:
    """The one line refusing an automatic split over the CPU and GPUs (host RAM says nothing of how many layers the
    slower CPU should run)."""
    return (f"--device {','.join(devices)} puts stages on the CPU and on GPUs: give the first layer of each later "
            f"stage with --layer-split (--device cuda:0,cpu --layer-split 20: layers 0-19 on the GPU, the rest on "
            f"the CPU), or --n-gpu-layers N")


def parse_split(spec: str | None) -> str | list[int] | None:
    """None / '' (no split), 'auto', or 'L1,L2,...' (the first layer of each later stage) -> None, 'auto' or the
    list of ints. ValueError (one line) for anything else."""
    if spec is None or str(spec).strip() in ("", "none"):
        return None
    s = str(spec).strip()
    if s == "auto":
        return "auto"
    try:
        firsts = [int(x) for x in s.split(",")]
    except ValueError:
        raise ValueError(f"{spec!r}: use 'auto' or the first layer of each later stage, e.g. '12' or '8,16'") from None
    return firsts


def carves_from_firsts(firsts: Sequence[int], n_blocks: int) -> list[Carve]:
    """[0, L1), [L1, L2), ..., [Lk, n_blocks); ValueError unless 0 < L1 < L2 < ... < n_blocks."""
    bounds = [0, *firsts, n_blocks]
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"--layer-split {','.join(map(str, firsts))}: each stage's first layer must be above the "
                         f"previous one and below the model's {n_blocks} blocks")
    return [Carve(a, b) for a, b in zip(bounds, bounds[1:])]


def carves_by_weight(weights: Sequence[float], n_blocks: int) -> list[Carve]:
    """Split n_blocks into len(weights) carves in proportion to `weights` (each stage at least one block)."""
    k = len(weights)
    if k > n_blocks:
        raise ValueError(f"cannot split {n_blocks} blocks over {k} stages")
    total = float(sum(weights))
    firsts, acc = [], 0.0
    for i, w in enumerate(weights[:-1]):
        acc += w
        f = int(round(acc / total * n_blocks))
        lo = (firsts[-1] if firsts else 0) + 1
        hi = n_blocks - (k - 1 - i)
        firsts.append(min(max(f, lo), hi))
    return carves_from_firsts(firsts, n_blocks)


def plan_stages(devices: Sequence[str], split: str | list[int] | None, n_blocks: int,
                total_memory: Callable[[str], int], remote: Sequence[str] = ()) -> list[tuple[Carve, str]]:
    """The stages: (carve, device) in layer order; the `remote` workers' addresses (--remote-stage, a chain) run
    the last carves, one each, after the local devices' stages.

    No split: one stage per listed device when several are listed (auto), else one stage. 'auto': one stage per
    device, layers in proportion to each device's total memory (total, not free, so the carve is the same after a
    restart and saved sessions stay valid; refused for the CPU beside GPUs: host RAM says nothing of how many
    layers the slower CPU should run); a single device gets one stage; with remote workers, whose memory the
    main cannot see, every stage gets an equal share. 'L1,...': len + 1 stages, the last len(remote) on the
    workers and the rest on one local device per stage or all on the one device listed; any other device count
    is a usage error.
    """
    devices, remote = list(devices), list(remote)
    if split is None and len(devices) + len(remote) > 1:
        split = "auto"
    if split is None:
        return [(Carve(0, n_blocks), devices[0])]
    if split == "auto":
        if mixed(devices):
            raise ValueError(mixed_split_error(devices))
        if remote:
            carves = carves_by_weight([1.0] * (len(devices) + len(remote)), n_blocks)
            return list(zip(carves, devices + remote))
        if len(devices) == 1:
            return [(Carve(0, n_blocks), devices[0])]
        carves = carves_by_weight([float(total_memory(d)) for d in devices], n_blocks)
        return list(zip(carves, devices))
    carves = carves_from_firsts(split, n_blocks)
    n_local = len(carves) - len(remote)
    if n_local < 1:
        raise ValueError(f"--layer-split {','.join(map(str, split))} makes {len(carves)} stages, too few for "
                         f"{len(remote)} remote stages and at least one local stage")
    if len(devices) == 1:
        return list(zip(carves, [devices[0]] * n_local + remote))
    if len(devices) != n_local:
        raise ValueError(f"--layer-split {','.join(map(str, split))} makes {n_local} {'local ' if remote else ''}"
                         f"stages but --device lists {len(devices)} devices: give one device per stage, or one for all")
    return list(zip(carves, devices + remote))
