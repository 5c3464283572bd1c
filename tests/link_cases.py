"""The stage link's canonical frames for the tests: one golden frame per message type (golden_cases, GOLDEN_FRAMES
from tests/data/link_golden.json, make_golden to write it), the keys and nonces they are made with, and a socket
stand-in that sends and receives a few bytes at a time (TrickleSocket)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import link
from link import (FLAG_ASYNC, Ack, BatchForward, BatchResult, BatchRows, Bye, Challenge, CkptRestore, CkptSave, Commit,
                  Error, ErrorCode, Forward, Hello, HelloAck, Hop, PartData, PartGet, PartPut, Ping, Pong, Reset,
                  Result, SeqResult, frame_bytes)

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_PATH = ROOT / "tests" / "data" / "link_golden.json"
KEY = bytes(range(100, 132))
CHALLENGE_NONCE = bytes(range(32, 64))
HELLO_NONCE = bytes(range(0, 32))


def golden_cases() -> dict:
    """name -> (message, request_id, flags): one canonical frame per message type, fixed field values."""
    hello = Hello(5, "smollm2-135m-instruct:q4_1:3f2a", 0, 15, 30, 576, "float32", 4096, 8, 6,
                  [Hop("10.0.0.3", 7411, 15, 24), Hop("relay-β", 7412, 24, 30)], HELLO_NONCE)
    hello.mac = link.hello_mac(KEY, CHALLENGE_NONCE, hello)
    ack = HelloAck(5, "smollm2-135m-instruct:q4_1:3f2a", 0, 15, 6, 1_234_567, "wörker-a", "NVIDIA H200")
    ack.mac = link.ack_mac(KEY, HELLO_NONCE, ack)
    tokens = np.array([1, 2, 3], dtype=np.int32)
    hidden = (np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5) / 4
    return {
        "challenge": (Challenge(CHALLENGE_NONCE, True, "wörker-a"), 0, 0),
        "hello": (hello, 1, 0),
        "hello_ack": (ack, 1, 0),
        "forward": (Forward(17, True, tokens, hidden), 2, 0),
        "result": (Result(20, 1500, hidden.astype(np.float16)), 2, 0),
        "commit": (Commit(19), 3, FLAG_ASYNC),
        "ack": (Ack(19, 2, 8192), 3, 0),
        "reset": (Reset([1, 3]), 4, 0),
        "ckpt_save": (CkptSave(9, 17, [1, 3, 9]), 5, 0),
        "ckpt_restore": (CkptRestore(3, 12, [1, 3]), 6, 0),
        "part_get": (PartGet(3, 4096, True), 8, 0),
        "part_data": (PartData(10, 4, np.frombuffer(b"STRP\x01\x00", np.uint8)), 8, 0),
        "part_put": (PartPut(11, 12, 10, 4, np.frombuffer(b"STRP\x01\x00", np.uint8), [1, 3, 11]), 9, 0),
        "error": (Error(ErrorCode.CKPT_MISSING, "checkpoint 3 is not held"), 6, 0),
        "ping": (Ping(0x0123456789ABCDEF), 7, 0),
        "pong": (Pong(0x0123456789ABCDEF), 7, 0),
        "bye": (Bye("main process shutting down"), 0, 0),
        "commit_seq": (Commit(19, seq=2), 10, FLAG_ASYNC),
        "batch_forward": (BatchForward([2, 0, 1], [17, 5, 9], tokens, hidden), 11, 0),
        "batch_result": (BatchResult(1500, hidden, [4]), 11, 0),
        "batch_rows": (BatchRows(1500, hidden, [4], [2, 0, 1], [17, 5, 9]), 11, 0),
        "hello_row_ids": (Hello(5, "smollm2-135m-instruct:q4_1:3f2a", 1, 30, 30, 576, "f32", 4096, 8, 0, [],
                                HELLO_NONCE, b"", 4, True), 1, 0),
        "seq_result": (SeqResult(20, 1500, hidden, [4], seq=2), 12, 0),
    }


def make_golden(path: Path) -> None:
    """Write tests/data/link_golden.json: name -> hex of the frame (tools/make_link_golden.py)."""
    data = {name: frame_bytes(m, rid, fl).hex() for name, (m, rid, fl) in golden_cases().items()}
    path.write_text(json.dumps(data, indent=1) + "\n")


GOLDEN = json.loads(GOLDEN_PATH.read_text()) if GOLDEN_PATH.exists() else {}
GOLDEN_FRAMES = {name: bytes.fromhex(h) for name, h in GOLDEN.items()}


class TrickleSocket:
    """A socket stand-in that sends and receives at most `step` bytes per call (partial sends and short reads)."""

    def __init__(self, data: bytes = b"", step: int = 7):
        self.data, self.at, self.step, self.sent = data, 0, step, bytearray()

    def sendmsg(self, buffers):
        out = b"".join(bytes(b) for b in buffers)[:self.step]
        self.sent += out
        return len(out)

    def recv_into(self, buf, n=0):
        k = min(len(buf), n or len(buf), self.step, len(self.data) - self.at)
        buf[:k] = self.data[self.at:self.at + k]
        self.at += k
        return k
