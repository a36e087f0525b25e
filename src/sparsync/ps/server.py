"""A parameter-server process: holds table partitions, serves pull/push over a ZeroMQ ROUTER socket.

One server per machine, colocated with that machine's workers (Parallax §4.3). The loop is single-threaded:
requests are handled in arrival order, and the two requests that must wait (a sync APPLY until all pushes of
its step arrived, a PULL until the table reached the version it asks for) are parked and answered later, or
answered with an error after ``wait_timeout`` seconds, so a dead worker yields an error, never a hang.

No message can stop the server: every field is checked before use, and any exception while
handling one message becomes an error reply that says why. Memory is bounded before anything is read: libzmq
drops a peer whose frame declares more than one fragment (``MAXMSGSIZE``: 64 KiB, handshake commands included),
CURVE drops peers without the run's client key in the handshake (``wire.py``), a message put back together from
its fragments must fit ``max_message_bytes`` and all of them together ``max_receiving_bytes``, and tables, held
pushes and parked requests have limits.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from zmq.utils import z85

from sparsync.ps import wire
from sparsync.ps.machine import default_max_total_bytes
from sparsync.ps.shard import Shard, ShardConfig, load_checkpoint, save_checkpoint
from sparsync.ps.wire import CurveKeys, Header, Op

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect (ZeroMQ RFC 27)
MAX_ERROR = 2000  # characters of an error reply
_EXPECTED = (ValueError, KeyError, TypeError)  # a refusal; anything else is a bug, logged with its traceback
_LOG_FIRST = 20  # internal errors logged in full; then one in 1000


@dataclass(frozen=True)
class ServerConfig:
    server_id: int = 0  # names the checkpoint file
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 0  # 0: the OS picks
    auth: bool = True  # CURVE: only clients holding the run's client key get past the handshake
    checkpoint_dir: str | None = None  # where SAVE writes and where a (re)started server resumes from
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE  # a larger message is refused at its first fragment
    max_receiving_bytes: int = 4 * 2**30  # messages still arriving in fragments, every peer together
    wait_timeout: float = 60.0  # seconds a parked APPLY/PULL waits before an error reply
    max_shard_bytes: int = 16 * 2**30  # a CREATE asking for more (weights + optimizer state) is refused
    # every partition of this server together; by default half of the memory available now (machine.py)
    max_total_bytes: int = field(default_factory=default_max_total_bytes)
    max_pending_bytes: int = 2**30  # sync pushes held until their step is applied, plus parked pulls' rows
    max_parked: int = 1024  # requests waiting at once (sync APPLY, PULL of a future version)
    max_steps_ahead: int = 8  # sync: a push, pull or apply further past the table's step is refused
    load_nonfinite: bool = False  # accept NaN/Inf in a checkpoint (refused by default)
    parent_pid: int | None = None  # exit when this process is no longer our parent (no orphaned servers)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_message_bytes < wire.HEADER.size:
            raise ValueError(f"max_message_bytes must be >= {wire.HEADER.size}, got {self.max_message_bytes}")
        limits = ("max_receiving_bytes", "max_shard_bytes", "max_total_bytes", "max_pending_bytes", "max_parked")
        for name in (*limits, "max_steps_ahead"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.wait_timeout > 0:
            raise ValueError(f"wait_timeout must be > 0 seconds, got {self.wait_timeout}")

    @property
    def checkpoint_path(self) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        return Path(self.checkpoint_dir) / f"server{self.server_id}.npz"


@dataclass
class _Parked:
    ident: bytes
    head: Header
    deadline: float
    rows: np.ndarray | None = None  # a parked pull's rows


Reply = tuple[Header, list[bytes | memoryview]]


class Server:
    """A server's tables and its request handling, without sockets (``serve`` runs the loop)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.shards: dict[tuple[int, int], Shard] = {}
        self.parked: list[_Parked] = []
        self.bytes_in = self.bytes_out = self.requests = 0
        self.refused = self.auth_refused = self.internal_errors = 0
        self.running = True
        self.table_bytes = 0  # every partition's ShardConfig.nbytes
        self.incoming = wire.Reassembler(max_message=cfg.max_message_bytes, max_total=cfg.max_receiving_bytes)
        self.pending_bytes = 0  # sync pushes held by the partitions, plus parked pulls' rows
        path = cfg.checkpoint_path
        if path is not None and path.exists():
            self.shards = load_checkpoint(
                path,
                allow_nonfinite=cfg.load_nonfinite,
                max_shard_bytes=cfg.max_shard_bytes,
                max_total_bytes=cfg.max_total_bytes,
            )
            self.table_bytes = sum(s.cfg.nbytes for s in self.shards.values())

    # --- one message ------------------------------------------------------------------------------------
    def receive_fragment(self, ident: bytes, frame: bytes) -> bytes | None:
        """The reply once ``frame`` completes a message (see ``receive``), an error reply for a message refused
        at its first fragment, or None."""
        try:
            whole = self.incoming.feed(ident, frame)
        except wire.FragmentError as e:
            return self.refusal(e.head, e)
        return None if whole is None else self.receive(ident, whole)

    def receive(self, ident: bytes, frame: bytes | memoryview) -> bytes | None:
        """The reply frame to one request, an error reply for any exception, or None when it was parked."""
        self.requests += 1
        self.bytes_in += len(frame)
        try:
            h, body = wire.decode(frame, max_bytes=self.cfg.max_message_bytes)
            out = self.handle(ident, h, body)
        except Exception as e:  # one message must not stop the server (KeyboardInterrupt still does)
            return self.refusal(wire.salvage(frame), e)
        return None if out is None else wire.encode(out[0], *out[1])

    def refusal(self, h: Header, e: Exception) -> bytes:
        self.refused += 1
        if not isinstance(e, _EXPECTED):
            self.internal_errors += 1
            if self.internal_errors <= _LOG_FIRST or self.internal_errors % 1000 == 0:
                n = self.internal_errors
                log.error("server %d: op %d failed (%d so far)", self.cfg.server_id, h.op, n, exc_info=e)
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        return wire.encode(h.reply(status=1), f"{type(e).__name__}: {msg}"[:MAX_ERROR].encode())

    def handle(self, ident: bytes, h: Header, body: memoryview) -> Reply | None:
        """The reply, or None when the request is parked."""
        op = wire.check_op(h)
        if op == Op.PING:
            return h.reply(), []
        if op == Op.CREATE:
            return self._create(h, body)
        if op == Op.SAVE:
            return h.reply(), [self.save().encode()]
        if op == Op.STATS:
            return h.reply(), [wire.json_body(self.stats())]
        if op == Op.SHUTDOWN:
            self.running = False
            return h.reply(), []
        s = self._shard(h)
        if h.dim != s.cfg.dim:
            raise ValueError(f"dim {h.dim} does not match table {s.cfg.name!r} (dim {s.cfg.dim})")
        if h.n > s.cfg.size and op != Op.PUSH:
            raise ValueError(f"n={h.n} rows exceeds partition size {s.cfg.size}")
        if op == Op.APPLY:  # sync: once, when every pusher's gradient of the step is in and the previous applied
            if s.cfg.mode != "sync":
                raise ValueError(f"APPLY on table {s.cfg.name!r} in async mode")
            if len(body):
                raise wire.WireError(f"APPLY carries no body, got {len(body)} bytes")
            if h.step < s.version:
                return h.reply(), []  # already applied (e.g. resent after a reconnect)
            self._check_ahead(s, h, "APPLY")
            return self._park(ident, h, None)
        if op == Op.PULL:
            rows, _ = wire.parse_rows(h, body, with_values=False)
            s.local(rows)  # validate now: a parked pull must not fail later for a bad row
            if s.version < h.step:
                self._check_ahead(s, h, "PULL")
                return self._park(ident, h, np.array(rows))
            return h.reply(n=h.n, dim=h.dim), [s.pull(rows).data]
        rows, vals = wire.parse_rows(h, body, with_values=True)
        assert vals is not None
        if not np.isfinite(vals).all():
            raise ValueError(f"non-finite value in a {op.name} to table {s.cfg.name!r}")
        if op == Op.SET:
            s.set(rows, vals)
            return h.reply(), []
        if s.cfg.mode == "sync":
            self._check_ahead(s, h, "PUSH")
            if self.pending_bytes + len(body) > self.cfg.max_pending_bytes:
                raise ValueError(
                    f"PUSH would hold more than max_pending_bytes={self.cfg.max_pending_bytes} on this server; "
                    "the chief's APPLY is late"
                )
        held = s.pending_bytes
        s.push(rows, vals, h.step, h.sender)
        self.pending_bytes += s.pending_bytes - held
        return h.reply(), []

    def _create(self, h: Header, body: memoryview) -> Reply:
        cfg = ShardConfig.from_json(wire.parse_json(body))
        old = self.shards.get((h.table, h.partition))
        if old is not None:
            if old.cfg != cfg:
                raise ValueError(f"table {h.table} partition {h.partition} exists with another config: {old.cfg}")
            return h.reply(n=old.version), []  # a restarted server tells where it resumes
        if cfg.nbytes > self.cfg.max_shard_bytes:
            raise ValueError(
                f"partition of {cfg.nbytes} bytes exceeds this server's max_shard_bytes={self.cfg.max_shard_bytes}"
            )
        if self.table_bytes + cfg.nbytes > self.cfg.max_total_bytes:
            raise ValueError(
                f"partition of {cfg.nbytes} bytes would take this server's tables past "
                f"max_total_bytes={self.cfg.max_total_bytes} ({self.table_bytes} in use)"
            )
        self.shards[(h.table, h.partition)] = Shard(cfg)
        self.table_bytes += cfg.nbytes
        return h.reply(n=0), []

    def _shard(self, h: Header) -> Shard:
        s = self.shards.get((h.table, h.partition))
        if s is None:
            raise KeyError(
                f"table {h.table} partition {h.partition} does not exist on server {self.cfg.server_id}"
            )
        return s

    def _check_ahead(self, s: Shard, h: Header, what: str) -> None:
        """Sync: refuse a step far past the table's, whose pushes would be held (or pulls parked) for long."""
        if s.cfg.mode == "sync" and h.step > s.version + self.cfg.max_steps_ahead:
            raise ValueError(
                f"{what} for step {h.step} of table {s.cfg.name!r}, which is at step {s.version}: "
                f"more than max_steps_ahead={self.cfg.max_steps_ahead} ahead"
            )

    def _park(self, ident: bytes, h: Header, rows: np.ndarray | None) -> Reply | None:
        """Park the request (None: no reply yet), or refuse it when too many wait."""
        if len(self.parked) >= self.cfg.max_parked:
            raise ValueError(f"{len(self.parked)} requests already wait on this server (max_parked)")
        if rows is not None and self.pending_bytes + rows.nbytes > self.cfg.max_pending_bytes:
            raise ValueError(
                f"parking this PULL would hold more than max_pending_bytes={self.cfg.max_pending_bytes}"
            )
        self.parked.append(_Parked(ident, h, time.monotonic() + self.cfg.wait_timeout, rows))
        self.pending_bytes += 0 if rows is None else rows.nbytes
        return None

    def _unpark(self, p: _Parked) -> None:
        self.parked.remove(p)
        self.pending_bytes -= 0 if p.rows is None else p.rows.nbytes

    # --- parked requests --------------------------------------------------------------------------------
    def retry_parked(self) -> list[tuple[bytes, bytes]]:
        """(client, reply frame) for each parked request that is now ready, failed, or timed out."""
        # a client that stopped halfway through a message (it died, or reconnected under a new identity)
        self.incoming.expire(self.cfg.wait_timeout)
        out: list[tuple[bytes, bytes]] = []
        progress = True
        while progress:  # an APPLY may release pulls, which are parked after it
            progress = False
            for p in list(self.parked):
                try:
                    ready = self._ready(p)
                except Exception as e:
                    self._unpark(p)
                    out.append((p.ident, self.refusal(p.head, e)))
                    continue
                if ready is None and time.monotonic() < p.deadline:
                    continue
                self._unpark(p)
                if ready is None:
                    why = f"{self._why_waiting(p)} after {self.cfg.wait_timeout:g} s"
                    msg = f"TimeoutError: {why}; is a worker dead?"
                    out.append((p.ident, wire.encode(p.head.reply(status=1), msg.encode())))
                else:
                    out.append((p.ident, wire.encode(ready[0], *ready[1])))
                    progress = True
        return out

    def _ready(self, p: _Parked) -> Reply | None:
        s = self._shard(p.head)
        h = p.head
        if h.op == Op.PULL:
            if s.version < h.step:
                return None
            assert p.rows is not None
            return h.reply(n=h.n, dim=h.dim), [s.pull(p.rows).data]
        if s.version == h.step and s.arrived(h.step) >= s.cfg.pushers:
            held = s.pending_bytes
            s.apply_step(h.step)
            self.pending_bytes -= held - s.pending_bytes
            return h.reply(), []
        if h.step < s.version:
            return h.reply(), []
        return None

    def _why_waiting(self, p: _Parked) -> str:
        s = self._shard(p.head)
        if p.head.op == Op.PULL:
            return f"pull waited for step {p.head.step} of table {s.cfg.name!r}, still at step {s.version}"
        return (
            f"step {p.head.step} of table {s.cfg.name!r} partition {p.head.partition}: "
            f"{s.arrived(p.head.step)} of {s.cfg.pushers} pushes arrived (table at step {s.version})"
        )

    # --- checkpoint, stats ------------------------------------------------------------------------------
    def save(self) -> str:
        path = self.cfg.checkpoint_path
        if path is None:
            raise ValueError("this server was started without checkpoint_dir: nowhere to save")
        path.parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(path, self.shards)
        return str(path)

    def stats(self) -> dict[str, Any]:
        return {
            "server_id": self.cfg.server_id,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "requests": self.requests,
            "refused": self.refused,  # error replies, internal errors included
            "auth_refused": self.auth_refused,  # CURVE handshakes with a key not admitted
            "internal_errors": self.internal_errors,  # refusals that were bugs (logged with traceback)
            "table_bytes": self.table_bytes,
            "pending_bytes": self.pending_bytes,
            "receiving_bytes": self.incoming.held,  # reserved by messages whose fragments still arrive
            "parked": len(self.parked),
            "shards": [
                {"table": t, "partition": p, "name": s.cfg.name, "version": s.version, "lo": s.cfg.lo}
                for (t, p), s in self.shards.items()
            ],
        }


# --- the loop -----------------------------------------------------------------------------------------------
def serve(
    cfg: ServerConfig,
    ready: Callable[[str], object] | None = None,
    *,
    keys: CurveKeys | None = None,
    clients: Sequence[str] = (),
) -> None:
    """Run a server until SHUTDOWN; ``ready(address)`` is called once bound. With ``cfg.auth``, ``keys`` is the
    server's CURVE keypair and ``clients`` the public keys (Z85) it admits."""
    if cfg.auth:
        wire.require_curve()
        if keys is None or not clients:
            raise ValueError("auth=True needs the server's CURVE keypair and at least one client public key")
    server = Server(cfg)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    zap = ctx.socket(zmq.REP) if cfg.auth else None
    try:
        sock.setsockopt(zmq.LINGER, 1000)
        # libzmq drops a peer whose frame declares more than this before buffering any of it (a frame
        # declaring 8 GiB grew the server by 2 GB). It holds during the CURVE handshake too, so it must stay
        # small whatever max_message_bytes is: at 256 MiB, every peer without a key could make the server hold
        # most of a 256 MiB HELLO (docs/reliability.md). Messages come in fragments instead.
        sock.setsockopt(zmq.MAXMSGSIZE, wire.FRAGMENT_BYTES + wire.FRAME_SLACK)
        # Never drop a fragment of a reply (a ROUTER drops what exceeds the high-water mark, which counts
        # frames): replies queue as whole messages did before, only for clients past the handshake.
        sock.setsockopt(zmq.SNDHWM, 0)
        if zap is not None and keys is not None:
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind(ZAP_ENDPOINT)  # before the first handshake: with no handler libzmq admits every client
            sock.curve_server = True
            sock.curve_secretkey = keys.secret.encode()
            sock.curve_publickey = keys.public.encode()
            sock.zap_domain = b"sparsync"
        sock.bind(f"tcp://{cfg.host}:{cfg.port if cfg.port else '*'}")
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if ready is not None:
            ready(wire.curve_address(address, keys.public) if keys is not None and cfg.auth else address)
        admitted = {z85.decode(k.encode()) for k in clients}
        _loop(server, sock, zap, admitted)
    finally:
        sock.close()
        if zap is not None:
            zap.close()
        ctx.term()


def _loop(server: Server, sock: zmq.Socket[bytes], zap: zmq.Socket[bytes] | None, admitted: set[bytes]) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if zap is not None:
        poller.register(zap, zmq.POLLIN)
    parent = server.cfg.parent_pid
    while server.running:
        if parent is not None and os.getppid() != parent:
            break  # whoever started us died without stopping us
        events = dict(poller.poll(200 if server.parked else 1000))
        try:
            if zap is not None and zap in events:
                _answer_zap(server, zap, admitted)
            if sock in events:
                for _ in range(512):  # a burst (32 MiB), then handshakes and parked requests get their turn
                    try:
                        ident = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = _receive(server, sock, ident)
                    if reply is not None:
                        _send(server, sock, ident, reply)
            for ident, frame in server.retry_parked():
                _send(server, sock, ident, frame)
        except Exception:  # a bug outside one message's handling: log it, keep serving
            log.exception("server %d: error in the loop", server.cfg.server_id)


def _receive(server: Server, sock: zmq.Socket[bytes], ident: bytes) -> bytes | None:
    """The rest of a message whose routing id was just received: one fragment, received into the buffer of the
    peer's message under way when there is one (no copy); the reply it completes, or None."""
    if not sock.getsockopt(zmq.RCVMORE):
        return None  # an empty message: nothing to answer
    target = server.incoming.space(ident)
    if target is None:
        frame = sock.recv()
    else:
        nbytes = sock.recv_into(target)
    if sock.getsockopt(zmq.RCVMORE):  # not a DEALER-shaped message: no one to answer; what we wrote into
        while sock.getsockopt(zmq.RCVMORE):  # the buffer lies past its filled part, to be overwritten
            sock.recv()
        return None
    if target is None:
        return server.receive_fragment(ident, frame)
    try:
        whole = server.incoming.received(ident, nbytes)
    except wire.FragmentError as e:
        return server.refusal(e.head, e)
    return None if whole is None else server.receive(ident, whole)


def _answer_zap(server: Server, zap: zmq.Socket[bytes], admitted: set[bytes]) -> None:
    """Answer libzmq's question whether a CURVE client may connect (ZeroMQ RFC 27): only the run's clients."""
    req = zap.recv_multipart()
    rid = req[1] if len(req) > 1 else b""
    ok = len(req) >= 7 and req[0] == b"1.0" and req[5] == b"CURVE" and req[6] in admitted
    if not ok:
        server.auth_refused += 1
    status, text = (b"200", b"OK") if ok else (b"400", b"client key not admitted")
    zap.send_multipart([b"1.0", rid, status, text, b"", b""])


def _send(server: Server, sock: zmq.Socket[bytes], ident: bytes, frame: bytes) -> None:
    server.bytes_out += len(frame)
    for part in wire.fragments(frame):
        sock.send_multipart([ident, part])  # a ROUTER drops (never blocks on) a message to a peer that left
