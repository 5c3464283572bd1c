"""What tells a user which model file a process runs: its summary (file name, size, architecture, blocks, width,
quantization, fingerprint), the one-line text a worker gives for it when it refuses another model, and the line that
names what differs between two summaries."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

from strata.errors import printable

__all__ = ["ModelSummary", "summary", "quant_name", "refusal", "parse_refusal", "mismatch"]

FP_CHARS = 16            # the fingerprint's first hex digits shown to a user


def quant_name(f) -> str:
    """The file's quantization as llama.cpp names it (``general.file_type``: Q4_1, Q8_0, F16, ...), '' when absent
    or unknown."""
    ft = f.metadata.get("general.file_type")
    if ft is None:
        return ""
    try:
        import gguf
        return gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
    except (ValueError, TypeError):
        return ""


@dataclass(frozen=True)
class ModelSummary:
    """A model file as a user tells it apart: the file's name and size in bytes, its architecture, its main blocks
    and hidden width, its quantization and its fingerprint (the first FP_CHARS hex digits)."""
    file: str
    bytes: int
    arch: str
    blocks: int
    width: int
    quant: str
    fingerprint: str

    def text(self) -> str:
        """`name.gguf, 98302016 bytes, llama, 30 blocks of width 576, Q4_1, fingerprint 1a2b...` (parse_refusal
        reads it back)."""
        return (f"{self.file}, {self.bytes} bytes, {self.arch}, {self.blocks} blocks of width {self.width}, "
                f"{self.quant or 'unknown quant'}, fingerprint {self.fingerprint}")


def summary(f, path, n_blocks: int) -> ModelSummary:
    """The summary of the open GGUF file `f` read from `path`, whose model has `n_blocks` main blocks."""
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return ModelSummary(file=os.path.basename(os.fspath(path)), bytes=int(size), arch=str(f.arch),
                        blocks=int(n_blocks), width=int(f.config.n_embd), quant=quant_name(f),
                        fingerprint=f.fingerprint()[:FP_CHARS])


_LEAD = "this worker has another model: "
_TEXT = re.compile(r"(?P<file>.+), (?P<bytes>\d+) bytes, (?P<arch>[^,]*), (?P<blocks>\d+) blocks of width "
                   r"(?P<width>\d+), (?P<quant>[^,]*), fingerprint (?P<fingerprint>[0-9a-f]+)")


def refusal(worker: ModelSummary, main_fingerprint: str, main_blocks: int, main_width: int) -> str:
    """The worker's one-line refusal of a main's Hello for another model: its own summary (parse_refusal reads it
    back) and what the Hello told of the main's (its fingerprint, blocks and width; the main's text quoted as a peer's
    is, strata.errors.printable)."""
    return (f"{_LEAD}{worker.text()}; the main's has fingerprint {printable(main_fingerprint[:FP_CHARS])}, "
            f"{main_blocks} blocks of width {main_width}")


def parse_refusal(message: str) -> ModelSummary | None:
    """The worker's summary in a `refusal` line (None for any other text: an older worker's, or one with a control
    character)."""
    at = message.find(_LEAD)
    if at < 0:
        return None
    body = message[at + len(_LEAD):].rsplit("; the main's has ", 1)[0]
    m = _TEXT.fullmatch(body)
    if m is None or not body.isprintable():        # a peer's text: no control characters reach a user's terminal
        return None
    d = m.groupdict()
    quant = "" if d["quant"] == "unknown quant" else d["quant"]
    return ModelSummary(file=d["file"], bytes=int(d["bytes"]), arch=d["arch"], blocks=int(d["blocks"]),
                        width=int(d["width"]), quant=quant, fingerprint=d["fingerprint"])


_SAID = {"file": "file", "bytes": "size", "arch": "architecture", "blocks": "blocks", "width": "width",
         "quant": "quantization"}


def mismatch(worker: ModelSummary, main: ModelSummary) -> str:
    """One line naming what differs between a worker's model and its main's (each field as `the worker's, not the
    main's`), ending with what to do; it follows the worker's name."""
    diffs = []
    for f in fields(ModelSummary):
        a, b = getattr(worker, f.name), getattr(main, f.name)
        if f.name == "fingerprint" or a == b:
            continue
        if f.name == "bytes":
            a, b = f"{a:,} bytes", f"{b:,} bytes"
        diffs.append(f"{_SAID[f.name]} {'?' if a == '' else a}, not {'?' if b == '' else b}")
    what = "; ".join(diffs) if diffs else (f"the same file name, size, architecture, blocks and quantization "
                                           f"({main.file}) but other weights")
    return (f"has another model: {what} (fingerprints {worker.fingerprint}, not {main.fingerprint}); start it "
            f"with its main's model file ({main.file}, --model)")
