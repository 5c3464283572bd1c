"""Opening a GGUF model file: the header, metadata and tensor table read in bulk, tensors memory-mapped, ModelLoadError.

gguf-py's GGUFReader builds a numpy view per metadata item (two per string): ~250K views and 3-5 s for a
49K-token vocabulary, most of a small model's start-up. `read_header` here walks the same bytes with `struct`
(a string array is one tight loop, a numeric array one `np.frombuffer`), giving the values
`ReaderField.contents()` gives, in ~50 ms. The gguf library still supplies the types, block sizes and byte shapes
(`GGMLQuantizationType`, `GGML_QUANT_SIZES`, `quant_shape_to_byte_shape`), the writer and the dequantizers;
`GGUFModelFile.reader` opens its full GGUFReader on demand for tools that want the library's view.
"""
from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from strata.gguf.config import ConfigError, ModelConfig
from strata.backend import quant
from strata.backend.quant import WeightTensor


LARGE_MODEL_BYTES = 500 * 1024 * 1024  # show a progress bar when loading/uploading more than this


class ModelLoadError(Exception):
    """A model file cannot be used; the message is one line naming the file, tensor, type or architecture."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def supported_quant_types() -> frozenset:
    """GGML types that WeightTensor can dequantize and multiply (strata.backend.quant.SUPPORTED_TYPES)."""
    return frozenset(quant.SUPPORTED_TYPES)


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF (truncated, corrupt, or a layout this reader does not take)."""


# GGUF scalar value types -> struct format (little-endian)
_SCALAR = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
           GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
           GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_SCALAR_STRUCT = {int(k): struct.Struct("<" + v) for k, v in _SCALAR.items()}
_NP_DTYPE = {int(k): np.dtype("<" + v) if v != "?" else np.dtype(np.bool_) for k, v in _SCALAR.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# ggml types whose tensor data is viewed as numbers (others as the raw bytes of their blocks), as gguf-py views them
_PLAIN_DTYPE = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class TensorInfo:
    """One row of the tensor table: GGUF-order dims (fastest first), the raw ggml type, the absolute data offset."""
    name: str
    dims: tuple[int, ...]
    raw_type: int
    offset: int


class _Cursor:
    """Reads GGUF's little-endian items from a buffer, raising GGUFFormatError past its end."""

    def __init__(self, buf, off: int = 0):
        self.buf, self.off, self.size = buf, off, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.off + n > self.size:
            raise GGUFFormatError(f"{what} at byte {self.off} runs past the end of the file")

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = _U32.unpack_from(self.buf, self.off)[0]
        self.off += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = _U64.unpack_from(self.buf, self.off)[0]
        self.off += 8
        return v

    def raw_str(self, what: str) -> bytes:
        n = self.u64(what)
        self.need(n, what)
        b = bytes(self.buf[self.off:self.off + n])
        self.off += n
        return b

    def str_array(self, n: int, what: str) -> list[str] | None:
        """n strings (None if one is not UTF-8: gguf-py's contents() raises for the whole field)."""
        buf, off, size, unpack = self.buf, self.off, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        ok = True
        try:
            for _ in range(n):
                ln = unpack(buf, off)[0]
                off += 8
                if off + ln > size:
                    raise struct.error
                if ok:
                    try:
                        append(str(buf[off:off + ln], "utf-8"))
                    except UnicodeDecodeError:
                        ok = False
                off += ln
        except struct.error:
            raise GGUFFormatError(f"{what} at byte {off} runs past the end of the file") from None
        self.off = off
        return out if ok else None

    def value(self, vtype: int, what: str) -> Any:
        """One metadata value of type vtype, as gguf-py's ReaderField.contents() gives it (arrays flattened)."""
        st = _SCALAR_STRUCT.get(vtype)
        if st is not None:
            self.need(st.size, what)
            v = st.unpack_from(self.buf, self.off)[0]
            self.off += st.size
            return v
        if vtype == GGUFValueType.STRING:
            b = self.raw_str(what)
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                return None
        if vtype == GGUFValueType.ARRAY:
            itype, n = self.u32(what), self.u64(what)
            dt = _NP_DTYPE.get(itype)
            if dt is not None:
                self.need(n * dt.itemsize, what)
                v = np.frombuffer(self.buf, dt, n, self.off).tolist()
                self.off += n * dt.itemsize
                return v
            if itype == GGUFValueType.STRING:
                return self.str_array(n, what)
            if itype == GGUFValueType.ARRAY:   # nested arrays: flattened, as gguf-py does
                out: list | None = []
                for _ in range(n):
                    sub = self.value(itype, what)
                    out = None if out is None or sub is None else out + sub
                return out
            raise GGUFFormatError(f"{what} is an array of unknown value type {itype}")
        raise GGUFFormatError(f"{what} has unknown value type {vtype}")


def read_header(buf) -> tuple[dict[str, Any], list[TensorInfo], int]:
    """Parse a GGUF's header from `buf` (bytes, mmap or memoryview of the whole file) ->
    (metadata {key: Python value}, the tensor table, the offset of the tensor data).

    Values are what gguf-py's `ReaderField.contents()` gives (lists for arrays; None for a string that is not
    UTF-8). Raises GGUFFormatError (one line) for a truncated or corrupt header, a big-endian file, a duplicate
    key or tensor, a bad alignment, or tensor data past the end of the file.
    """
    c = _Cursor(buf)
    c.need(4, "the magic")
    if bytes(buf[:4]) != b"GGUF":
        raise GGUFFormatError(f"bad magic {bytes(buf[:4])!r}")
    c.off = 4
    version = c.u32("the version")
    if version & 0xFFFF == 0 and version:
        raise GGUFFormatError("the file is big-endian, which this reader does not take")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = c.u64("the tensor count"), c.u64("the metadata count")
    metadata: dict[str, Any] = {}
    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = c.raw_str(f"metadata key {i}").decode("utf-8", errors="replace")
        if key in metadata:
            raise GGUFFormatError(f"duplicate metadata key {key!r}")
        vtype = c.u32(f"the type of {key}")
        metadata[key] = c.value(vtype, key)
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise GGUFFormatError("general.alignment is not a UINT32")
            alignment = metadata[key]
            if alignment <= 0 or alignment & (alignment - 1):
                raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
    rows = []
    for i in range(n_tensors):
        name = c.raw_str(f"tensor name {i}").decode("utf-8", errors="replace")
        n_dims = c.u32(f"the dimension count of {name}")
        c.need(8 * n_dims, f"the dimensions of {name}")
        dims = tuple(np.frombuffer(buf, "<u8", n_dims, c.off).tolist())
        c.off += 8 * n_dims
        rows.append((name, dims, c.u32(f"the type of {name}"), c.u64(f"the offset of {name}")))
    data_offset = c.off + (-c.off % alignment)
    tensors, seen = [], set()
    for name, dims, raw_type, off in rows:
        if name in seen:
            raise GGUFFormatError(f"duplicate tensor {name!r}")
        seen.add(name)
        tensors.append(TensorInfo(name, dims, raw_type, data_offset + off))
    return metadata, tensors, data_offset


def tensor_view(data: np.ndarray, t: TensorInfo, qtype: GGMLQuantizationType) -> np.ndarray:
    """The tensor's data as a view of the file's memory map `data` (uint8), shaped as gguf-py's reader shapes it:
    numpy order, plain types as numbers, block types as the bytes of their blocks (BF16 as uint16).
    Raises GGUFFormatError when the data runs past the end of the file."""
    n = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
    block, type_size = GGML_QUANT_SIZES[qtype]
    nbytes = n * type_size // block
    if t.offset + nbytes > data.size:
        raise GGUFFormatError(f"tensor {t.name}'s data ({nbytes} bytes at byte {t.offset}) runs past the end of "
                              f"the file")
    shape = tuple(reversed(t.dims))
    raw = data[t.offset:t.offset + nbytes]
    dtype = _PLAIN_DTYPE.get(qtype)
    if dtype is not None:
        return raw.view(dtype).reshape(shape)
    out = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
    return out.view(np.uint16) if qtype == GGMLQuantizationType.BF16 else out


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

    @property
    def reader(self):
        """gguf-py's GGUFReader of this file, opened on first use (seconds for a large vocabulary): for tools and
        tests that want the library's own view (strata.gguf.synth.export_hf)."""
        r = getattr(self, "_reader", None)
        if r is None:
            from gguf import GGUFReader
            r = GGUFReader(self.path, "r")
            object.__setattr__(self, "_reader", r)
        return r

    @functools.cached_property
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


def open_gguf(path: str | os.PathLike, *, archs: Collection[str] | None = None) -> GGUFModelFile:
    """Open a GGUF file memory-mapped and validate it.

    Raises ModelLoadError (one line) for: a missing file, a file that is not a GGUF or is truncated, an
    architecture not in `archs` (listing them; not checked when archs is None), an unsupported quant
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
        data = np.memmap(p, mode="r")
        with memoryview(data) as buf:
            metadata, table, _ = read_header(buf)
    except GGUFFormatError as e:
        raise ModelLoadError(f"{p} is not a valid GGUF file: truncated or corrupt ({p.stat().st_size} bytes; "
                             f"{e})") from None
    except (OSError, ValueError) as e:   # e.g. an empty file cannot be mapped
        raise ModelLoadError(f"{p} is not a valid GGUF file: truncated or corrupt ({p.stat().st_size} bytes; "
                             f"{' '.join((str(e) or type(e).__name__).split())})") from None
    metadata = {k: v for k, v in metadata.items() if not k.startswith("GGUF.")}

    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelLoadError(f"{p}: metadata has no general.architecture")
    if archs is not None:
        sup = sorted(archs)
        if arch not in sup:
            raise ModelLoadError(f"{p}: unsupported architecture {arch!r} (supported: {', '.join(sup)})")

    supported = supported_quant_types()
    tensors: dict[str, WeightTensor] = {}
    for t in table:
        try:
            qtype = GGMLQuantizationType(t.raw_type)
        except ValueError:
            raise ModelLoadError(f"{p}: tensor {t.name} has unknown GGML type {t.raw_type}") from None
        if qtype not in supported:
            raise ModelLoadError(
                f"{p}: tensor {t.name} has unsupported quant type {qtype.name} "
                f"(supported: {', '.join(sorted(q.name for q in supported))})")
        try:
            view = tensor_view(data, t, qtype)
        except (GGUFFormatError, ValueError) as e:
            raise ModelLoadError(f"{p} is not a valid GGUF file: truncated or corrupt ({p.stat().st_size} bytes; "
                                 f"{e})") from None
        tensors[t.name] = WeightTensor(name=t.name, ggml_type=qtype, shape=tuple(reversed(t.dims)), data=view)

    embd = tensors.get("token_embd.weight")
    try:
        config = ModelConfig.from_metadata(metadata, set(tensors), embd.shape[0] if embd is not None else None)
    except ConfigError as e:
        raise ModelLoadError(f"{p}: {e}") from None
    return GGUFModelFile(path=str(p), arch=arch, metadata=metadata, tensors=tensors, config=config)


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
