"""The parameter server's wire format: a fixed binary header and a typed body, no pickle; and its authentication.

A message is a 56-byte little-endian header, then ``body_len`` bytes, sent as ZeroMQ frames of at most
``FRAGMENT_BYTES`` (64 KiB): every frame but the last exactly that long, the first starting with the header.
The sockets' ``MAXMSGSIZE`` is one such frame (plus CURVE's overhead), and libzmq applies it to the CURVE
handshake's commands too, so a peer without the key can make a server hold at most one 64 KiB command, whatever
the message limit. ``Reassembler`` puts messages back together per peer, reserving memory only for a message
whose header's ``body_len`` fits the message limit, and only while every peer's unfinished messages together
fit a second limit. The receiver checks magic, version, the header's ``body_len`` against the message's real
length, and the body's length against what the op implies (``n`` int64 row ids, then ``n * dim`` float32
values) before it reads anything. JSON (table configuration, stats, errors) is the only structured body, parsed
with ``json`` (data only) once its size and nesting depth were checked.

Header fields (``<4sBBBBQIIIQQIQ``): magic ``SPS1``, version, op, status (0 ok, 1 error; replies only), flags,
request id, table id, partition, sender (worker id), step (sync step, or the minimum table version a pull waits
for), n (rows), dim (row width), body_len.

Authentication is ZeroMQ CURVE, below this format (version 1's token was a static digest sent in the
clear). A server started with ``auth=True`` (the default) has its own keypair and admits only clients holding
the run's client key; anyone else is dropped in the handshake, before a message of theirs is read. A server's
address carries its public key (``tcp://127.0.0.1:5555#curve=<64 hex digits>``); the client keypair comes from
``PSClient(keys=...)`` or the environment (``SPARSYNC_PS_CLIENT_KEY``), which ``start_servers`` sets so that the
workers it starts afterwards inherit it.
"""

from __future__ import annotations

import enum
import json
import os
import re
import struct
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zmq
from zmq.utils import z85

MAGIC = b"SPS1"
VERSION = 2  # 2: no token field (CURVE authenticates the connection instead)
HEADER = struct.Struct("<4sBBBBQIIIQQIQ")
DEFAULT_MAX_MESSAGE = 256 * 2**20  # bytes; a push of 1M rows x 64 floats fits
# The most one ZeroMQ frame carries. It bounds what a peer can make us buffer before its CURVE handshake is done
# (libzmq reads a handshake command whole); 64 peers at once cost 4 MiB. Larger frames were not faster: the
# Python-side cost per frame is small next to encrypting 64 KiB.
FRAGMENT_BYTES = 64 * 2**10
FRAME_SLACK = 1024  # bytes libzmq's frame may exceed a fragment by: CURVE's box, nonce and command name
MAX_JSON_BYTES = 64 * 2**10  # a table config is < 1 KiB
MAX_JSON_DEPTH = 8  # a table config nests 2 levels; 100,000 levels overflowed json's recursion
REPLY_BIT = 0x80
CLIENT_KEY_ENV = "SPARSYNC_PS_CLIENT_KEY"
_CURVE = "#curve="


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
    """A message that is malformed, oversized or from another version."""


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
    body_len: int = 0

    def reply(self, status: int = 0, *, n: int = 0, dim: int = 0) -> Header:
        return replace(self, op=self.op | REPLY_BIT, status=status, n=n, dim=dim, body_len=0)


def encode(h: Header, *body: bytes | memoryview) -> bytes:
    """Header (with ``body_len`` set from the body) followed by the body parts, as one frame."""
    blen = sum(memoryview(b).nbytes for b in body)
    head = HEADER.pack(
        MAGIC, VERSION, h.op, h.status, h.flags, h.rid, h.table, h.partition, h.sender, h.step, h.n, h.dim, blen
    )
    return b"".join([head, *body])


def decode(frame: bytes | memoryview, *, max_bytes: int = DEFAULT_MAX_MESSAGE) -> tuple[Header, memoryview]:
    """Parse and check one frame; raise ``WireError`` saying what is wrong."""
    if len(frame) > max_bytes:
        raise WireError(f"message of {len(frame)} bytes exceeds the limit of {max_bytes} bytes")
    if len(frame) < HEADER.size:
        raise WireError(f"message of {len(frame)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, op, status, flags, rid, table, part, sender, step, n, dim, blen = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a sparsync parameter-server message")
    if version != VERSION:
        raise WireError(f"wire version {version} not supported (this side speaks {VERSION})")
    if blen != len(frame) - HEADER.size:
        raise WireError(f"header says body_len={blen} but the frame carries {len(frame) - HEADER.size} bytes")
    h = Header(op, rid, table, part, sender, step, n, dim, status, flags, blen)
    return h, memoryview(frame)[HEADER.size :]


def fragments(message: bytes | memoryview) -> list[memoryview]:
    """``message`` cut into the ZeroMQ frames that carry it: each ``FRAGMENT_BYTES`` long but the last."""
    mv = memoryview(message)
    return [mv[i : i + FRAGMENT_BYTES] for i in range(0, max(len(mv), 1), FRAGMENT_BYTES)]


class FragmentError(WireError):
    """A message refused while its fragments arrive; ``head`` names the request, for the error reply."""

    def __init__(self, msg: str, head: Header) -> None:
        super().__init__(msg)
        self.head = head


@dataclass
class _Partial:
    head: Header
    buf: np.ndarray | None  # None: a refused message, whose remaining fragments are read and dropped
    filled: int
    seen: float  # time.monotonic() of its last fragment


class Reassembler:
    """Whole messages from the fragments each peer sends, in order (one ZeroMQ connection keeps a peer's frames
    in order, and a sender writes a message's fragments back to back).

    A frame shorter than its header's ``body_len`` promises starts a message only when it is exactly
    ``FRAGMENT_BYTES`` long; any other frame is a message by itself, and ``decode`` judges it. A started message
    gets its buffer only when it fits ``max_message`` and every peer's unfinished messages together fit
    ``max_total``; otherwise ``feed`` raises ``FragmentError`` at once and drops the message's remaining
    fragments as they come. The buffer is reserved, not written, so resident memory grows with the bytes that
    arrive. ``expire`` forgets messages whose peer went quiet (a peer that reconnects gets a new identity)."""

    def __init__(self, *, max_message: int, max_total: int) -> None:
        self.max_message = max_message
        self.max_total = max_total
        self.held = 0  # bytes reserved by unfinished messages
        self._partial: dict[bytes, _Partial] = {}

    def __len__(self) -> int:
        return len(self._partial)

    def feed(self, peer: bytes, frame: bytes) -> bytes | memoryview | None:
        """The whole message once ``frame`` ends one, else None; ``FragmentError`` for a refused message."""
        p = self._partial.get(peer)
        if p is None:
            return self._first(peer, frame)
        due = self._due(p)
        if p.buf is not None and len(frame) == due:
            p.buf[p.filled : p.filled + due] = np.frombuffer(frame, dtype=np.uint8)
        return self._advance(peer, p, len(frame), due)

    def space(self, peer: bytes) -> memoryview | None:
        """Where ``peer``'s next fragment belongs, when a message of theirs is under way and kept: receive it
        there (``recv_into``, saving a copy), then call ``received``. None: receive it and ``feed`` it."""
        p = self._partial.get(peer)
        if p is None or p.buf is None:
            return None
        return p.buf.data[p.filled : p.filled + self._due(p)]

    def received(self, peer: bytes, nbytes: int) -> memoryview | None:
        """``peer``'s next fragment, ``nbytes`` long, was received into ``space(peer)`` (truncated when longer):
        as ``feed``."""
        p = self._partial[peer]
        return self._advance(peer, p, nbytes, self._due(p))

    @staticmethod
    def _due(p: _Partial) -> int:
        """The length the next fragment must have: a whole fragment, or what is left."""
        return min(FRAGMENT_BYTES, HEADER.size + p.head.body_len - p.filled)

    def _advance(self, peer: bytes, p: _Partial, nbytes: int, due: int) -> memoryview | None:
        p.seen = time.monotonic()
        if nbytes != due:
            self.forget(peer)
            raise FragmentError(
                f"fragment of {nbytes} bytes where {due} were due "
                f"({p.filled} of {HEADER.size + p.head.body_len} bytes received)",
                p.head,
            )
        p.filled += nbytes
        if p.filled < HEADER.size + p.head.body_len:
            return None
        self.forget(peer)
        return None if p.buf is None else p.buf.data

    def _first(self, peer: bytes, frame: bytes) -> bytes | None:
        if len(frame) != FRAGMENT_BYTES or frame[:4] != MAGIC:
            return frame
        total = HEADER.size + HEADER.unpack_from(frame)[-1]
        if total <= len(frame):
            return frame
        head = replace(salvage(frame), body_len=total - HEADER.size)
        refusal = None
        if total > self.max_message:
            refusal = f"message of {total} bytes exceeds the limit of {self.max_message} bytes"
        elif self.held + total > self.max_total:
            refusal = (
                f"message of {total} bytes would take the messages being received past the limit of "
                f"{self.max_total} bytes ({self.held} in use)"
            )
        buf = None
        if refusal is None:
            buf = np.empty(total, dtype=np.uint8)
            buf[: len(frame)] = np.frombuffer(frame, dtype=np.uint8)
            self.held += total
        self._partial[peer] = _Partial(head, buf, len(frame), time.monotonic())
        if refusal is not None:
            raise FragmentError(refusal, head)
        return None

    def forget(self, peer: bytes) -> None:
        p = self._partial.pop(peer, None)
        if p is not None and p.buf is not None:
            self.held -= len(p.buf)

    def expire(self, idle: float) -> int:
        """Forget messages with no fragment for ``idle`` seconds; how many."""
        old = [k for k, p in self._partial.items() if time.monotonic() - p.seen > idle]
        for k in old:
            self.forget(k)
        return len(old)


def salvage(frame: bytes | memoryview) -> Header:
    """Best effort: the op and ids of a message we refuse, so the client can match the error reply."""
    if len(frame) >= HEADER.size and frame[:4] == MAGIC:
        f = HEADER.unpack_from(frame)
        return Header(op=f[2] & 0x7F, rid=f[5], table=f[6], partition=f[7])
    return Header(op=0)


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


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


def json_depth(raw: bytes) -> int:
    """How deep ``[`` and ``{`` nest in ``raw`` (brackets inside strings do not count)."""
    b = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    step = np.isin(b, (ord("["), ord("{"))).astype(np.int64) - np.isin(b, (ord("]"), ord("}")))
    return int(np.cumsum(step).max(initial=0))


def parse_json(body: memoryview, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON data from ``body``; ``WireError`` for a body over ``max_bytes``, nested deeper than ``max_depth``,
    or not UTF-8 JSON. The depth is checked before ``json.loads``, whose recursion a deep body overflows."""
    if len(body) > max_bytes:
        raise WireError(f"JSON body of {len(body)} bytes exceeds the limit of {max_bytes} bytes")
    raw = bytes(body)
    depth = json_depth(raw)
    if depth > max_depth:
        raise WireError(f"JSON body nests {depth} levels deep, more than the limit of {max_depth}")
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WireError(f"body is not valid UTF-8 JSON: {e}") from None


# --- authentication (CURVE) ----------------------------------------------------------------------------------
def require_curve() -> None:
    """Raise a clear error when this libzmq cannot do CURVE (pyzmq's wheels always can)."""
    if not zmq.has("curve"):
        raise RuntimeError(
            f"libzmq {zmq.zmq_version()} was built without CURVE, which parameter-server authentication needs; "
            "install pyzmq's wheel (it bundles libsodium) or start servers with auth=False on a trusted host"
        )


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE keypair, Z85 text (40 characters each). ``repr`` hides the secret."""

    public: str
    secret: str = field(repr=False)

    def __post_init__(self) -> None:
        for name in ("public", "secret"):
            v = getattr(self, name)
            if not isinstance(v, str) or len(v) != 40:
                raise ValueError(f"CURVE {name} key must be 40 characters of Z85 text, got {len(str(v))}")

    @classmethod
    def generate(cls) -> CurveKeys:
        require_curve()
        public, secret = zmq.curve_keypair()
        return cls(public.decode(), secret.decode())

    @classmethod
    def from_secret(cls, secret: str) -> CurveKeys:
        require_curve()
        try:
            return cls(zmq.curve_public(secret.encode()).decode(), secret)
        except (zmq.ZMQError, ValueError) as e:
            raise ValueError(f"not a CURVE secret key (40 characters of Z85 text): {e}") from None


def client_keys_from_env() -> CurveKeys | None:
    """The run's client keypair from ``SPARSYNC_PS_CLIENT_KEY`` (its secret), or None when unset."""
    secret = os.environ.get(CLIENT_KEY_ENV)
    return CurveKeys.from_secret(secret) if secret else None


def run_client_keys() -> CurveKeys:
    """The run's client keypair: from the environment, else generated now and put there, so that the workers
    this process starts afterwards (``sparsync.launch``, ``multiprocessing``) inherit it. Every server started
    from this process admits it."""
    keys = client_keys_from_env()
    if keys is None:
        keys = CurveKeys.generate()
        os.environ[CLIENT_KEY_ENV] = keys.secret
    return keys


def curve_address(endpoint: str, server_public: str) -> str:
    """``endpoint`` tagged with the server's public key (public: it may be logged and passed on)."""
    return f"{endpoint}{_CURVE}{z85.decode(server_public.encode()).hex()}"


def split_address(address: str) -> tuple[str, str | None]:
    """(ZeroMQ endpoint, server public key in Z85 or None for a server without authentication)."""
    endpoint, sep, key = address.partition(_CURVE)
    if not sep:
        return address, None
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"address {address!r}: the key after {_CURVE!r} must be 64 hex digits")
    return endpoint, z85.encode(raw).decode()
