"""Opening a GGUF model file: memory-mapped reading with gguf.GGUFReader, metadata, tensors, ModelLoadError."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from strata.config import ConfigError, ModelConfig
from strata.quant import WeightTensor

# Types the C core dequantizes and multiplies (issue 2, item 1). quant.py may publish its own set.
_DEFAULT_SUPPORTED = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})

LARGE_MODEL_BYTES = 500 * 1024 * 1024  # show a progress bar when loading/uploading more than this


class ModelLoadError(Exception):
    """A model file cannot be used; the message is one line naming the file, tensor, type or architecture."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def supported_quant_types() -> frozenset:
    """GGML types that WeightTensor can dequantize and multiply."""
    from strata import quant
    s = getattr(quant, "SUPPORTED_TYPES", None)
    return frozenset(s) if s else _DEFAULT_SUPPORTED


def _field_value(f) -> Any:
    try:
        return f.contents()
    except Exception:  # a field of a type this gguf version cannot decode
        return None


@dataclass
class GGUFModelFile:
    """An opened GGUF model: metadata (Python values), tensors (WeightTensor, numpy-order shapes), config.

    Tensor data is memory-mapped from the file; nothing is copied at open time.
    """

    path: str
    arch: str
    metadata: dict[str, Any]
    tensors: dict[str, WeightTensor]
    config: ModelConfig
    reader: Any = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data."""
        return sum(t.nbytes for t in self.tensors.values())

    def has(self, name: str) -> bool:
        return name in self.tensors

    def fingerprint(self) -> str:
        """sha256 hex of what makes this model this model: every metadata key and value, the tensor table (name,
        type, shape) and the first 4 KiB of every tensor's data (two fine-tunes of one architecture share the
        table, not the weights). What a session file must match. Computed once."""
        fp = getattr(self, "_fingerprint", None)
        if fp is None:
            import hashlib
            import numpy as np
            h = hashlib.sha256()
            for k in sorted(self.metadata):
                h.update(f"{k}={self.metadata[k]!r}\n".encode())
            for name in sorted(self.tensors):
                t = self.tensors[name]
                h.update(f"{name}:{int(t.ggml_type)}:{tuple(t.shape)}\n".encode())
                h.update(np.asarray(t.data).reshape(-1).view(np.uint8)[:4096].tobytes())
            fp = h.hexdigest()
            object.__setattr__(self, "_fingerprint", fp)
        return fp

    def tensor(self, name: str, shape: tuple | None = None) -> WeightTensor:
        """The tensor `name`; with `shape` (numpy order) it must match.

        Raises ModelLoadError naming the tensor and the expected shape when it is missing or its shape disagrees
        with the metadata.
        """
        t = self.tensors.get(name)
        if t is None:
            exp = f" (expected shape {tuple(shape)})" if shape is not None else ""
            raise ModelLoadError(f"{self.path}: tensor {name} is missing{exp} for architecture {self.arch}")
        if shape is not None and tuple(int(s) for s in shape) != tuple(t.shape):
            raise ModelLoadError(
                f"{self.path}: tensor {name} has shape {tuple(t.shape)} but the metadata expects {tuple(shape)}")
        return t


def open_gguf(path: str | os.PathLike, *, check_arch: bool = True) -> GGUFModelFile:
    """Open a GGUF file memory-mapped and validate it.

    Raises ModelLoadError (one line) for: a missing file, a file that is not a GGUF or is truncated, an
    unknown architecture (listing the supported ones; skipped with check_arch=False), an unsupported quant
    type (naming tensor and type), and metadata that lacks a required key.
    """
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelLoadError(f"model path is not a file: {p}")
    try:
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {p}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{p} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(p, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/KeyError/... on truncated or corrupt data
        reason = " ".join((str(e) or type(e).__name__).split())
        raise ModelLoadError(f"{p} is not a valid GGUF file: truncated or corrupt ({p.stat().st_size} bytes; "
                             f"the gguf reader said: {reason})") from None

    metadata: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        metadata[name] = _field_value(f)

    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelLoadError(f"{p}: metadata has no general.architecture")
    if check_arch:
        from strata.models.base import supported_archs
        sup = supported_archs()
        if arch not in sup:
            raise ModelLoadError(f"{p}: unsupported architecture {arch!r} (supported: {', '.join(sup)})")

    supported = supported_quant_types()
    tensors: dict[str, WeightTensor] = {}
    for t in reader.tensors:
        try:
            qtype = GGMLQuantizationType(int(t.tensor_type))
        except ValueError:
            raise ModelLoadError(f"{p}: tensor {t.name} has unknown GGML type {int(t.tensor_type)}") from None
        if qtype not in supported:
            raise ModelLoadError(
                f"{p}: tensor {t.name} has unsupported quant type {qtype.name} "
                f"(supported: {', '.join(sorted(q.name for q in supported))})")
        shape = tuple(int(x) for x in reversed([int(v) for v in t.shape]))
        data = t.data
        if qtype == GGMLQuantizationType.BF16:
            data = data.view(np.uint16) if data.dtype != np.uint16 else data
        tensors[t.name] = WeightTensor(name=t.name, ggml_type=qtype, shape=shape, data=data)

    embd = tensors.get("token_embd.weight")
    try:
        config = ModelConfig.from_metadata(metadata, set(tensors), embd.shape[0] if embd is not None else None)
    except ConfigError as e:
        raise ModelLoadError(f"{p}: {e}") from None
    return GGUFModelFile(path=str(p), arch=arch, metadata=metadata, tensors=tensors, config=config, reader=reader)


def progress_bar(total_bytes: int, desc: str, progress: Callable[[int, int], None] | bool | None = None):
    """A per-tensor progress reporter: returns update(nbytes) and close().

    progress=None shows a tqdm bar on stderr when total_bytes > LARGE_MODEL_BYTES; True always; False never;
    a callable gets (done_bytes, total_bytes) after each tensor.
    """
    if callable(progress):
        done = [0]

        def update(n: int) -> None:
            done[0] += n
            progress(done[0], total_bytes)
        return update, (lambda: None)
    if progress is True or (progress is None and total_bytes > LARGE_MODEL_BYTES):
        from tqdm import tqdm
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)
        return bar.update, bar.close
    return (lambda n: None), (lambda: None)
