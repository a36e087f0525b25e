"""The parameter server's wire format: a fixed binary header and a typed body, no pickle.

Every message is one ZeroMQ frame: a 72-byte little-endian header, then ``body_len`` bytes. The receiver
checks magic, version, token digest, the header's ``body_len`` against the frame's real length, and the body's
length against what the op implies (``n`` int64 row ids, then ``n * dim`` float32 values) before it reads
anything; a frame over the size limit is refused unread. JSON (table configuration, stats, errors) is the only
structured body, parsed with ``json`` (data only).

Header fields (``<4sBBBB16sQIIIQQIQ``): magic ``SPS1``, version, op, status (0 ok, 1 error; replies only),
flags, token digest (first 16 bytes of SHA-256 of the shared token, zero without a token), request id, table
id, partition, sender (worker id), step (sync step, or the minimum table version a pull waits for), n (rows),
dim (row width), body_len.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

MAGIC = b"SPS1"
VERSION = 1
HEADER = struct.Struct("<4sBBBB16sQIIIQQIQ")
DEFAULT_MAX_MESSAGE = 256 * 2**20  # bytes; a push of 1M rows x 64 floats fits
REPLY_BIT = 0x80


class Op(enum.IntEnum):
    PING = 1
    CREATE = 2  # body: JSON table config
    PULL = 3  # body: int64[n] rows; reply: float32[n, dim]
    PUSH = 4  # body: int64[n] rows, float32[n, dim] gradients
    APPLY = 5  # sync mode: the chief asks to apply step ``step`` once all its pushes arrived
    SET = 6  # body like PUSH: overwrite rows (initial values)
    SAVE = 7  # checkpoint every table of this server to its checkpoint directory
    STATS = 8  # reply: JSON
    SHUTDOWN = 9


class WireError(ValueError):
    """A message that is malformed, oversized, from another version, or carries the wrong token."""


def token_digest(token: str | None) -> bytes:
    if not token:
        return bytes(16)
    return hashlib.sha256(token.encode()).digest()[:16]


@dataclass(frozen=True)
class Header:
    op: int
    rid: int = 0
    table: int = 0
    partition: int = 0
    sender: int = 0
    step: int = 0
    n: int = 0
    dim: int = 0
    status: int = 0
    flags: int = 0
    token: bytes = bytes(16)
    body_len: int = 0

    def reply(self, status: int = 0, *, n: int = 0, dim: int = 0) -> Header:
        return replace(self, op=self.op | REPLY_BIT, status=status, n=n, dim=dim, body_len=0)


def encode(h: Header, *body: bytes | memoryview) -> bytes:
    """Header (with ``body_len`` set from the body) followed by the body parts, as one frame."""
    blen = sum(memoryview(b).nbytes for b in body)
    head = HEADER.pack(
        MAGIC, VERSION, h.op, h.status, h.flags, h.token, h.rid, h.table, h.partition, h.sender, h.step, h.n,
        h.dim, blen,
    )  # fmt: skip
    return b"".join([head, *body])


def decode(
    frame: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE, token: bytes | None = None
) -> tuple[Header, memoryview]:
    """Parse and check one frame; raise ``WireError`` saying what is wrong. ``token`` None skips the check."""
    if len(frame) > max_bytes:
        raise WireError(f"message of {len(frame)} bytes exceeds the limit of {max_bytes} bytes")
    if len(frame) < HEADER.size:
        raise WireError(f"message of {len(frame)} bytes is shorter than the {HEADER.size}-byte header")
    f = HEADER.unpack_from(frame)
    magic, version, op, status, flags, tok, rid, table, part, sender, step, n, dim, blen = f
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a sparsync parameter-server message")
    if version != VERSION:
        raise WireError(f"wire version {version} not supported (this side speaks {VERSION})")
    if token is not None and not hmac.compare_digest(tok, token):
        raise WireError("wrong or missing token")
    if blen != len(frame) - HEADER.size:
        raise WireError(f"header says body_len={blen} but the frame carries {len(frame) - HEADER.size} bytes")
    h = Header(op, rid, table, part, sender, step, n, dim, status, flags, tok, blen)
    return h, memoryview(frame)[HEADER.size :]


def check_op(h: Header) -> Op:
    try:
        return Op(h.op)
    except ValueError:
        raise WireError(f"unknown op {h.op}") from None


def rows_body(rows: np.ndarray, values: np.ndarray | None = None) -> list[bytes | memoryview]:
    """Body of PULL (rows) or PUSH/SET (rows then float32 values)."""
    parts: list[bytes | memoryview] = [np.ascontiguousarray(rows, dtype="<i8").data]
    if values is not None:
        parts.append(np.ascontiguousarray(values, dtype="<f4").data)
    return parts


def parse_rows(h: Header, body: memoryview, *, with_values: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(int64 rows [n], float32 values [n, dim] or None), after checking the body length exactly."""
    want = 8 * h.n + (4 * h.n * h.dim if with_values else 0)
    if len(body) != want:
        raise WireError(f"body of {len(body)} bytes, expected {want} for n={h.n}, dim={h.dim}")
    rows = np.frombuffer(body, dtype="<i8", count=h.n)
    if not with_values:
        return rows, None
    vals = np.frombuffer(body, dtype="<f4", count=h.n * h.dim, offset=8 * h.n).reshape(h.n, h.dim)
    return rows, vals


def json_body(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def parse_json(body: memoryview) -> Any:
    try:
        return json.loads(bytes(body).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"body is not valid UTF-8 JSON: {e}") from None
