"""The stage link (protocol 5, hand-framed over TCP) between the main process and remote stage workers: the codec."""
from .auth import (ACK_LABEL, CAP_AEAD, CAP_DROPS, CAP_ENCRYPT, CAP_MAC, CAP_PARK, CAP_ROWIDS, CAP_SLOTS,
                   CAP_SPEC, HELLO_LABEL, KEY_SIZE, ack_label, ack_mac, challenge_name, hello_frames, hello_label,
                   hello_mac, main_frames, new_nonce, read_key_file, split_challenge_name, verify, worker_accepts,
                   write_key_file)
from .errors import ErrorCode, FrameError, LinkError, VersionMismatch
from .frame import (DEFAULT_MAX_PAYLOAD, FLAG_ASYNC, HEADER_SIZE, KNOWN_FLAGS, MAGIC, MAX_CONTROL_PAYLOAD,
                    TRAILER_SIZE, VERSION, Header, decode_frame, decode_payload, encode_frame, frame_bytes,
                    parse_header, payload_limit, read_frame, recv_frame, send_frame, write_frame)
from .secure import (FRAMES, FRAMES_AEAD, FRAMES_MAC, FRAMES_PLAIN, TAG_SIZE, Channel, FrameAuthError,
                     channel_for, derive_keys)
from .messages import (MAX_ROWS, MAX_STR, NONCE_SIZE, REPLY, Ack, BatchForward, BatchResult, BatchRows, Bye,
                       Challenge, CkptRestore, CkptSave, Commit, Error, Forward, Hello, HelloAck, Hop, Message,
                       MsgType, PartData, PartGet, PartPut, Ping, Pong, Reset, Result, SeqResult, decode_message,
                       encode_payload, msg_type)

__all__ = [
    "ACK_LABEL", "CAP_AEAD", "CAP_ENCRYPT", "CAP_DROPS", "CAP_MAC", "CAP_PARK", "CAP_ROWIDS", "CAP_SLOTS", "CAP_SPEC",
    "HELLO_LABEL", "KEY_SIZE", "ack_label", "ack_mac",
    "challenge_name", "hello_frames", "hello_label", "hello_mac", "main_frames", "new_nonce", "read_key_file",
    "split_challenge_name", "verify", "worker_accepts", "write_key_file",
    "FRAMES", "FRAMES_AEAD", "FRAMES_MAC", "FRAMES_PLAIN", "TAG_SIZE", "Channel", "FrameAuthError", "channel_for",
    "derive_keys",
    "ErrorCode", "FrameError", "LinkError", "VersionMismatch",
    "DEFAULT_MAX_PAYLOAD", "FLAG_ASYNC", "HEADER_SIZE", "KNOWN_FLAGS", "MAGIC", "MAX_CONTROL_PAYLOAD", "TRAILER_SIZE",
    "VERSION", "Header", "decode_frame", "decode_payload", "encode_frame", "frame_bytes", "parse_header",
    "payload_limit", "read_frame", "recv_frame", "send_frame", "write_frame",
    "MAX_ROWS", "MAX_STR", "NONCE_SIZE", "REPLY", "Ack", "BatchForward", "BatchResult", "BatchRows", "Bye",
    "Challenge",    "CkptRestore", "CkptSave", "Commit", "Error",
    "Forward", "Hello", "HelloAck", "Hop", "Message", "MsgType", "PartData", "PartGet", "PartPut", "Ping", "Pong",
    "Reset", "Result", "SeqResult",
    "decode_message", "encode_payload", "msg_type",
]
