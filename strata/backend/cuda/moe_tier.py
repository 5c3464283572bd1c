"""The CUDA side of the expert tier: the experts' home copies in pinned host RAM (their GGUF blocks, read by the
kernels over PCIe through the expert tables when not resident), the VRAM slots, the copy stream and its events, the
device usage counts, the host->device bandwidth measured at start, and ``tier_of(model)``: the stage's ExpertStore
(strata/moe/store.py) over them.

Home layout: per MoE layer one pinned buffer of n_expert experts, each [gate rows | up rows | down rows] with every
part 256-byte aligned; a slot has the same layout, so one copy moves one expert. On a 64-bit process with unified
addressing a pinned host buffer's address is valid on the device: the table entry of a non-resident expert is
its home address, and a miss reads the same bits the slot copy holds.
"""
from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.backend.cuda.weights import BLOCK, DeviceWeight, row_bytes
from strata.memory.hostram import available_ram
from strata.moe.policy import Policy
from strata.moe.store import RESIDENT, ExpertStore

ALIGN = 256
AUTO_RESERVE = 1 << 30          # bytes of free VRAM "auto" leaves for the prefill's scratch and the graphs


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TierSettings:
    """The tier's flags as the CUDA backend takes them. vram_mib: 'auto' or a number of MiB of slots; every, swaps:
    --adapt-every / --adapt-swaps; pcie_frac: the share of the measured host->device bandwidth swaps may use;
    static: fill the slots once (from the usage seen when ``place_hottest`` is called) and never swap;
    lend_rows: a prefill of at least that many tokens borrows slots (0: never); prefill_weight: Policy's."""

    vram_mib: str = "auto"
    every: int = 32
    swaps: int = 4
    pcie_frac: float = 1.0
    static: bool = False
    lend_rows: int = 64
    prefill_weight: float = Policy.prefill_weight


class HomeLayer:
    """One MoE layer's experts in one pinned host buffer (see the module docstring) and the DeviceWeights over it."""

    def __init__(self, name: str, gate, up, down, device_id: int):
        import cupy
        ne = gate.shape[0]
        tg, td = int(gate.ggml_type), int(down.ggml_type)
        F, E = int(gate.shape[1]), int(gate.shape[2])
        gb, db = F * row_bytes(tg, E), E * row_bytes(td, F)
        self.offsets = (0, _up(gb), 2 * _up(gb))                    # gate, up, down within an expert
        self.stride = 2 * _up(gb) + _up(db)
        self.n_expert = ne
        self.mem = cupy.cuda.alloc_pinned_memory(ne * self.stride)
        self.base = int(self.mem.ptr)
        host = np.frombuffer(self.mem, dtype=np.uint8, count=ne * self.stride).reshape(ne, self.stride)
        for t, off, nb in ((gate, 0, gb), (up, self.offsets[1], gb), (down, self.offsets[2], db)):
            raw = np.ascontiguousarray(np.asarray(t.data)).view(np.uint8).reshape(ne, nb)
            host[:, off:off + nb] = raw                             # the GGUF's bytes, never re-quantized
        self.nbytes = ne * self.stride

        def weights(part: int, t, shape, nb):
            out = []
            for e in range(ne):
                addr = self.base + e * self.stride + self.offsets[part]
                um = cupy.cuda.UnownedMemory(addr, nb, self.mem, device_id)
                arr = cupy.ndarray((shape[0], nb // shape[0]), cupy.uint8, cupy.cuda.MemoryPointer(um, 0))
                out.append(DeviceWeight(f"{t.name}[{e}]", int(t.ggml_type), shape, arr))
            return out
        self.gate = weights(0, gate, (F, E), gb)
        self.up = weights(1, up, (F, E), gb)
        self.down = weights(2, down, (E, F), db)

    def address(self, e: int) -> int:
        return self.base + e * self.stride


def home_experts(name: str, gate, up, down, device_id: int) -> HomeLayer:
    """The stacked GGUF expert tensors gate / up (n_expert, F, E) and down (n_expert, E, F) of one layer copied into
    pinned host RAM (HomeLayer); ValueError (one line) when the host cannot hold them."""
    for t in (gate, up, down):
        if int(t.ggml_type) not in BLOCK:
            raise ValueError(f"{t.name}: GGML type {getattr(t.ggml_type, 'name', t.ggml_type)} is not one the CUDA "
                             "kernels read from host RAM (an IQ type is converted to F16 only on the device: run "
                             "without the expert tier, or --device cpu)")
    need = int(gate.nbytes + up.nbytes + down.nbytes)
    avail = available_ram()
    if avail is not None and need > avail:
        raise ValueError(f"{name}: the experts need {need >> 20} MiB of pinned host RAM but {avail >> 20} MiB are "
                         f"available")
    try:
        return HomeLayer(name, gate, up, down, device_id)
    except Exception as e:                      # cudaErrorMemoryAllocation from cudaHostAlloc
        raise ValueError(f"{name}: cannot pin {need >> 20} MiB of host RAM for the experts: "
                         f"{str(e).splitlines()[0]}") from None


def host_limits() -> dict[str, Any]:
    """The host numbers the tier reports: RLIMIT_MEMLOCK (None: unlimited) and MemAvailable, in bytes."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {"memlock_bytes": None if soft == resource.RLIM_INFINITY else int(soft), "available_bytes": available_ram()}


def measure_h2d(cp, nbytes: int = 64 << 20, reps: int = 3) -> float:
    """Pinned host -> device copy bandwidth in bytes per second (the best of `reps` copies of nbytes)."""
    src = cp.cuda.alloc_pinned_memory(nbytes)
    dst = cp.empty(nbytes, cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    best = 0.0
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        cp.cuda.runtime.memcpyAsync(int(dst.data.ptr), int(src.ptr), nbytes, 1, s.ptr)
        b.record(s)
        b.synchronize()
        ms = cp.cuda.get_elapsed_time(a, b)
        if ms > 0:
            best = max(best, nbytes / (ms / 1000.0))
    return best


class CudaSlots:
    """The SlotDevice of strata/moe/store.py on one GPU: the home layers (rows in order), n_slots VRAM slots of one
    expert stride, a non-blocking copy stream, the device counts uint32 (rows, n_expert), and the expert tables of
    every plan that reads these layers (``register``)."""

    def __init__(self, cp, homes: list[HomeLayer], n_slots: int):
        self.cp, self.homes = cp, homes
        self.ne = homes[0].n_expert
        self.stride = homes[0].stride
        self.offsets = homes[0].offsets
        self.slots = cp.empty(max(1, n_slots) * self.stride, cp.uint8)
        self.slot_base = int(self.slots.data.ptr)
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self.counts = cp.zeros((len(homes), self.ne), cp.uint32)
        self.tables: list[list[tuple[Any, np.ndarray, int]]] = [[] for _ in homes]    # (ExpertTable, mirror, part)

    def register(self, row: int, gate, up, down) -> None:
        """Add a plan's ExpertTables of layer `row` (entries 0..n_expert-1 are this layer's experts)."""
        for part, t in enumerate((gate, up, down)):
            self.tables[row].append((t, self.cp.asnumpy(t.table), part))

    def address(self, key: int, slot: int | None, part: int) -> int:
        row, e = divmod(int(key), self.ne)
        base = self.homes[row].address(e) if slot is None else self.slot_base + int(slot) * self.stride
        return base + self.offsets[part]

    # SlotDevice
    def compute_mark(self):
        return self.cp.cuda.get_current_stream().record()

    def copy_in(self, slot: int, key: int, after):
        cs = self.copy_stream
        if after is not None:
            cs.wait_event(after)
        row, e = divmod(int(key), self.ne)
        self.cp.cuda.runtime.memcpyAsync(self.slot_base + int(slot) * self.stride, self.homes[row].address(e),
                                         self.stride, 1, cs.ptr)
        return cs.record()

    def done(self, ev) -> bool:
        return bool(ev.done)

    def wait(self, ev) -> None:
        ev.synchronize()

    def compute_after(self, ev) -> None:
        self.cp.cuda.get_current_stream().wait_event(ev)

    def point(self, keys: list[int], slots: list[int | None]) -> None:
        rows: set[int] = set()
        for k, s in zip(keys, slots):
            row, e = divmod(int(k), self.ne)
            for _, mirror, part in self.tables[row]:
                mirror[e] = self.address(k, s, part)
            rows.add(row)
        stream = self.cp.cuda.get_current_stream()
        for row in rows:
            for t, mirror, _ in self.tables[row]:
                t.table.set(mirror, stream=stream)      # stream-ordered; a pageable source is staged at once

    def read_counts(self) -> np.ndarray:
        c = self.cp.asnumpy(self.counts).astype(np.int64).reshape(-1)
        self.counts.fill(0)
        return c


class Tier:
    """One model's expert tier on its GPU: the ExpertStore over CudaSlots, and what it reports."""

    def __init__(self, model, settings: TierSettings):
        cp = model.backend.cp
        layers = [i for i, L in enumerate(model.layers) if L is not None and getattr(L.ffn, "home", None) is not None]
        if not layers:
            raise ValueError("the expert tier needs a model with MoE layers")
        homes = [model.layers[i].ffn.home for i in layers]
        stride = homes[0].stride
        n_all = len(layers) * homes[0].n_expert
        if str(settings.vram_mib).strip() == "auto":
            free, _ = cp.cuda.runtime.memGetInfo()
            mp = cp.get_default_memory_pool()
            free += int(mp.total_bytes() - mp.used_bytes())
            room = free - AUTO_RESERVE
            if room < stride:
                raise ValueError(f"--moe-vram-mib auto: {free >> 20} MiB of VRAM free after the model and its KV "
                                 f"cache, {AUTO_RESERVE >> 20} MiB kept for prefill: not one expert "
                                 f"({stride >> 10} KiB) fits; give --moe-vram-mib 0 to read every expert from host "
                                 f"RAM, or a smaller --n-ctx")
            n_slots = min(n_all, room // stride)
        else:
            n_slots = min(n_all, (int(settings.vram_mib) << 20) // stride)
        self.settings = settings
        self.bandwidth = measure_h2d(cp)
        rate = settings.pcie_frac * self.bandwidth if self.bandwidth > 0 else None
        self.dev = CudaSlots(cp, homes, n_slots)
        self.store = ExpertStore(layers, homes[0].n_expert, n_slots, stride, self.dev,
                                 Policy(every=settings.every, swaps=settings.swaps,
                                        prefill_weight=settings.prefill_weight), rate=rate,
                                 lend_rows=settings.lend_rows)
        self.store.static = settings.static
        self.pinned_bytes = sum(h.nbytes for h in homes)
        self.host = host_limits()

    def attach(self, layer: int, gate, up, down) -> None:
        """A plan's ExpertTables of `layer` read through the tier: registered, and its resident experts pointed at
        their slots (on the current stream)."""
        st = self.store
        row = st.row_of(layer)
        self.dev.register(row, gate, up, down)
        keys = [int(k) for k in st.owner[st.state == RESIDENT] if k // st.n_expert == row]
        if keys:
            self.dev.point(keys, [int(st.slot_of[k]) for k in keys])

    def before_prefill_layer(self, m, n_rows: int) -> None:
        """Before a prefill's MoE layer m (n_rows tokens): at the carve's first one, the settle and the loan."""
        if m.first:
            self.store.begin_prefill(n_rows)
        self.store.before_layer(m.li)

    def after_prefill_layer(self, m) -> None:
        """After a prefill's MoE layer m: its staged experts pointed home; at the carve's last one the loan ends."""
        self.store.after_layer(m.li)
        if m.last:
            self.store.end_prefill()

    def counts_ptr(self, layer: int) -> int:
        row = self.store.row_of(layer)
        return int(self.dev.counts.data.ptr) + row * self.dev.ne * 4

    def status(self) -> dict[str, Any]:
        """The store's numbers (ExpertStore.status) with the VRAM and pinned bytes, the measured bandwidth, the
        flags, RLIMIT_MEMLOCK and MemAvailable."""
        out = self.store.status()
        out.update({"vram_bytes": self.store.n_slots * self.store.expert_bytes, "pinned_bytes": self.pinned_bytes,
                    "h2d_bytes_per_s": round(self.bandwidth), "pcie_frac": self.settings.pcie_frac,
                    "adapt_every": self.settings.every, "adapt_swaps": self.settings.swaps, **self.host})
        return out


def tier_of(model) -> Tier | None:
    """The model's expert tier (made on first use from the backend's ``moe_tier`` settings), or None when the tier is
    off (every expert uploaded to the device)."""
    t = getattr(model, "_expert_tier", None)
    if t is None:
        settings = getattr(model.backend, "moe_tier", None)
        if settings is None or not getattr(model, "moe", False):
            return None
        with model.backend.device:
            t = model._expert_tier = Tier(model, settings)
    return t
