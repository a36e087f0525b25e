"""The worker side of the parameter server: one background I/O thread per client owns the ZeroMQ DEALER
sockets (one per server; ZeroMQ sockets must stay on one thread). Callers get a ``sparsync.Work`` per request;
a request that gets no reply within ``timeout`` fails with ``PSTimeoutError`` naming the server, and that
server's socket is rebuilt so requests queued for a dead server are dropped, not delivered to its successor.
A server that refuses our CURVE key (``wire.py``) fails the requests at once with ``PSError``, not a timeout, and
so does a keypair whose secret is not its public key's (checked here: the server cannot say so).
Messages travel in fragments of at most ``wire.FRAGMENT_BYTES`` both ways; a reply is put back together only when
it fits ``max_message_bytes``.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from sparsync.collectives.timeline import tracer
from sparsync.ps import wire
from sparsync.ps.wire import CurveKeys, Header, Op

# handshake outcomes that mean the server will not talk to us with these keys
_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


class PSError(RuntimeError):
    """The server answered with an error (its message is attached)."""


class PSTimeoutError(TimeoutError):
    """No reply in time: the server is dead, unreachable, or waiting on a dead worker."""


@dataclass
class _Outgoing:
    rid: int
    parts: list[memoryview]  # the message's fragments
    sent: int = 0  # fragments the socket took; once one did, the rest must follow, or the server loses count


@dataclass
class _Pending:
    server: int
    future: Future[tuple[Header, bytes]]
    deadline: float
    what: str


class PSClient:
    """Connection to the servers ``addresses`` (``ServerProcess.address``: ``tcp://127.0.0.1:5555`` with the
    server's public key when it authenticates), used by one worker. ``keys``: this client's CURVE keypair, by
    default the run's from the environment (``SPARSYNC_PS_CLIENT_KEY``, set by ``start_servers``). ``sender``:
    the worker id sent with each request (sync steps sum pushes in this order).

    ``request`` is thread-safe. Byte counters (``bytes_sent``, ``bytes_recv``) count whole messages.
    ``max_message_bytes`` bounds a request and a reply (``PSTable`` splits pulls and pushes to fit).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        keys: CurveKeys | None = None,
        timeout: float = 30.0,
        sender: int = 0,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE,
    ) -> None:
        if not addresses:
            raise ValueError("PSClient needs at least one server address")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not 0 <= sender < 2**32:
            raise ValueError(f"sender must be in [0, 2^32), got {sender}")
        self.addresses = list(addresses)
        split = [wire.split_address(a) for a in self.addresses]
        self.endpoints = [e for e, _ in split]
        self.server_keys = [k for _, k in split]
        if keys is None and any(self.server_keys):
            keys = wire.client_keys_from_env()
            if keys is None:
                raise ValueError(
                    "these servers authenticate clients (CURVE) and no client key was given: pass "
                    f"keys=CurveKeys(...) or set {wire.CLIENT_KEY_ENV} (start_servers sets it for the processes "
                    "started after it)"
                )
        self.keys = keys
        # Why requests to servers that authenticate fail at once, or None. A secret that is not the public key's
        # cannot be told from the server's side of the handshake: the server cannot open our vouch (CURVE's
        # INITIATE) and drops the connection before it asks ZAP, sending no ERROR, so we would see only a
        # dropped connection, as from a server that died mid-handshake, retry, and time out. Only we can check.
        self._key_problem = None if keys is None or not any(self.server_keys) else _keypair_problem(keys)
        self.timeout = timeout
        self.sender = sender
        if max_message_bytes < wire.HEADER.size:
            raise ValueError(f"max_message_bytes must be >= {wire.HEADER.size}, got {max_message_bytes}")
        self.max_message_bytes = max_message_bytes
        # replies under way, one per server at most (a server answers one request at a time to one client)
        self._incoming = wire.Reassembler(
            max_message=max_message_bytes, max_total=len(addresses) * max_message_bytes
        )
        self.bytes_sent = 0
        self.bytes_recv = 0
        self.bytes_per_server = [0] * len(self.addresses)  # sent + received, per server
        self._rid = itertools.count(1)
        self._queue: queue.SimpleQueue[tuple[int, bytes, int, _Pending] | None] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._wake_addr = f"inproc://sparsync-ps-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="sparsync-ps-client", daemon=True)
        self._thread.start()

    @property
    def num_servers(self) -> int:
        return len(self.addresses)

    def header(self, op: Op, **kw: int) -> Header:
        return Header(op=op, sender=self.sender, **kw)

    def request(self, server: int, head: Header, *body: bytes | memoryview) -> Future[tuple[Header, bytes]]:
        """Send one request to ``server``; the future gives (reply header, reply body) or raises PSError /
        PSTimeoutError."""
        if not 0 <= server < len(self.addresses):
            raise ValueError(f"server {server} out of range [0, {len(self.addresses)})")
        rid = next(self._rid)
        frame = wire.encode(Header(**{**head.__dict__, "rid": rid}), *body)
        if len(frame) > self.max_message_bytes:
            raise ValueError(
                f"{Op(head.op).name} message of {len(frame)} bytes exceeds max_message_bytes="
                f"{self.max_message_bytes}; split it (PSTable does)"
            )
        fut: Future[tuple[Header, bytes]] = Future()
        _trace_request(fut, f"ps:{Op(head.op).name}", server, len(frame))
        what = f"{Op(head.op).name} to server {server} ({self.endpoints[server]})"
        if self._key_problem is not None and self.server_keys[server] is not None:
            fut.set_exception(PSError(f"{what}: {self._key_problem}"))
            return fut
        with self._lock:
            if self._closed:
                raise RuntimeError("PSClient is closed")
            self._queue.put((server, frame, rid, _Pending(server, fut, time.monotonic() + self.timeout, what)))
            self._wake_tx.send(b"")
        return fut

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
            self._wake_tx.send(b"")
        self._thread.join(10.0)
        self._wake_tx.close(0)
        self._ctx.term()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- I/O thread -------------------------------------------------------------------------------------
    def _dealer(self, server: int) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        """A socket to ``server`` and, when it authenticates, a monitor that reports a refused handshake."""
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        # what a peer at this address can make us buffer before its CURVE handshake proves it is the server
        s.setsockopt(zmq.MAXMSGSIZE, wire.FRAGMENT_BYTES + wire.FRAME_SLACK)
        mon = None
        key = self.server_keys[server]
        if key is not None and self._key_problem is not None:
            return s, None  # never connected: every request to it fails in request(), saying why
        if key is not None and self.keys is not None:
            s.curve_serverkey = key.encode()
            s.curve_publickey = self.keys.public.encode()
            s.curve_secretkey = self.keys.secret.encode()
            mon = s.get_monitor_socket(_REFUSED)
        s.connect(self.endpoints[server])
        return s, mon

    def _loop(self) -> None:
        socks = [self._dealer(i) for i in range(len(self.addresses))]
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        for s, mon in socks:
            _register(poller, s, mon)
        pending: dict[int, _Pending] = {}
        # Frames a socket has not taken yet, per server. A DEALER blocks a send while it has no connection to
        # queue into (a server not up yet, or one whose CURVE handshake just failed and is being retried), so
        # sends never block: a frame waits here, and its request times out like any other.
        outbox: dict[int, deque[_Outgoing]] = {}
        running = True
        while running or pending:
            now = time.monotonic()
            wait = min((p.deadline for p in pending.values()), default=now + 1.0) - now
            if any(outbox.values()):
                wait = min(wait, 0.005)  # retry the held frames soon
            events = dict(poller.poll(max(1, min(1000, int(wait * 1000) + 1))))
            if self._wake_rx in events and self._take_requests(pending, outbox):
                running = False
            for server, held in outbox.items():
                self._flush(socks[server][0], held, pending, server)
            refused = self._read_replies(socks, events, pending)
            dead = self._fail_expired(pending, refused, running)
            # drop whatever is still queued for these; a restarted server must not see stale requests
            for i in dead | refused:
                outbox.pop(i, None)
                self._incoming.forget(_peer(i))
                _close(poller, *socks[i])
                socks[i] = self._dealer(i)
                _register(poller, *socks[i])
            if not running:
                for rid, p in list(pending.items()):
                    del pending[rid]
                    p.future.set_exception(RuntimeError(f"{p.what}: client closed"))
        for s, mon in socks:
            _close(poller, s, mon)
        self._wake_rx.close(0)

    def _take_requests(self, pending: dict[int, _Pending], outbox: dict[int, deque[_Outgoing]]) -> bool:
        """Move the requests ``request()`` queued into ``pending`` and their fragments into ``outbox``; True
        when ``close()`` asked the loop to stop."""
        while self._wake_rx.poll(0):
            self._wake_rx.recv()
        stop = False
        while not self._queue.empty():
            item = self._queue.get()
            if item is None:
                stop = True
                continue
            server, frame, rid, p = item
            pending[rid] = p
            outbox.setdefault(server, deque()).append(_Outgoing(rid, wire.fragments(frame)))
        return stop

    def _read_replies(
        self,
        socks: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]],
        events: dict[zmq.Socket[bytes], int],
        pending: dict[int, _Pending],
    ) -> set[int]:
        """Receive what the servers with ``events`` sent; the servers whose monitor reports a refused CURVE
        handshake."""
        refused: set[int] = set()
        for i, (s, mon) in enumerate(socks):
            if s in events:
                while s.poll(0):
                    self._receive(s, pending, i)
            if mon is not None and mon in events:
                while mon.poll(0):
                    if recv_monitor_message(mon)["event"] & _REFUSED:
                        refused.add(i)
        return refused

    def _fail_expired(self, pending: dict[int, _Pending], refused: set[int], running: bool) -> set[int]:
        """Fail the requests to ``refused`` servers (``PSError``) and those past their deadline
        (``PSTimeoutError``; once closing, every request to a server that let one expire); the servers with a
        request past its deadline, whose sockets are rebuilt."""
        now = time.monotonic()
        dead = {p.server for p in pending.values() if p.deadline <= now}
        for rid, p in list(pending.items()):
            if p.server in refused:
                del pending[rid]
                p.future.set_exception(
                    PSError(f"{p.what}: the server refused our CURVE handshake (not this run's client key?)")
                )
            elif p.deadline <= now or (not running and p.server in dead):
                del pending[rid]
                p.future.set_exception(
                    PSTimeoutError(f"{p.what}: no reply within {self.timeout:g} s (server dead or unreachable?)")
                )
        return dead

    def _flush(
        self, sock: zmq.Socket[bytes], held: deque[_Outgoing], pending: dict[int, _Pending], server: int
    ) -> None:
        """Hand ``held`` messages' fragments to ``sock`` in order, without blocking, until it takes no more;
        messages of requests that already failed (timed out) are dropped unless a fragment of theirs went."""
        while held:
            out = held[0]
            if out.sent == 0 and out.rid not in pending:
                held.popleft()
                continue
            while out.sent < len(out.parts):
                part = out.parts[out.sent]
                try:
                    sock.send(part, zmq.DONTWAIT)
                except zmq.Again:
                    return
                out.sent += 1
                self.bytes_sent += len(part)
                self.bytes_per_server[server] += len(part)
            held.popleft()

    def _receive(self, sock: zmq.Socket[bytes], pending: dict[int, _Pending], server: int) -> None:
        """Receive one fragment from ``server``: into its reply's buffer when one is under way (no copy)."""
        key = _peer(server)
        target = self._incoming.space(key)
        try:
            if target is None:
                frame = sock.recv()
                self._count(server, len(frame))
                whole = self._incoming.feed(key, frame)
            else:
                nbytes = sock.recv_into(target)
                self._count(server, nbytes)
                whole = self._incoming.received(key, nbytes)
        except wire.FragmentError as e:  # a reply over max_message_bytes: its request fails, saying why
            p = pending.pop(e.head.rid, None)
            if p is not None:
                p.future.set_exception(PSError(f"{p.what}: reply refused: {e}"))
            return
        if whole is not None:
            self._deliver(whole, pending, server)

    def _count(self, server: int, nbytes: int) -> None:
        self.bytes_recv += nbytes
        self.bytes_per_server[server] += nbytes

    def _deliver(self, whole: bytes | memoryview, pending: dict[int, _Pending], server: int) -> None:
        try:
            h, body = wire.decode(whole, max_bytes=self.max_message_bytes)
        except wire.WireError:
            return  # not from a sparsync server: ignore rather than kill the I/O thread
        p = pending.pop(h.rid, None)
        if p is None:
            return  # a reply after its request timed out
        if h.status:
            p.future.set_exception(PSError(f"server {server} refused {p.what.split()[0]}: {bytes(body).decode()}"))
        else:
            p.future.set_result((h, bytes(body)))


def _trace_request(fut: Future[tuple[Header, bytes]], name: str, server: int, nbytes: int) -> None:
    """Put the request on this process's timeline (if one records), from issue to reply, on the issuing
    thread's row: requests in flight overlap, so an async span (collectives/trace.py)."""
    t = tracer()
    if t is None:
        return
    t0, tid = time.perf_counter(), threading.get_native_id()

    def done(f: Future[tuple[Header, bytes]]) -> None:
        error = f.exception()
        args = {"server": server, "bytes_sent": nbytes, "bytes_recv": 0 if error else len(f.result()[1])}
        t.async_span(
            name, "ps", t0, time.perf_counter(), tid, {**args, "error": type(error).__name__} if error else args
        )

    fut.add_done_callback(done)


def _keypair_problem(keys: CurveKeys) -> str | None:
    """Why ``keys`` cannot pass any server's CURVE handshake, or None when its halves belong together (or this
    libzmq has no CURVE: the socket options say so)."""
    if not zmq.has("curve"):
        return None
    try:
        derived = zmq.curve_public(keys.secret.encode()).decode()
    except (zmq.ZMQError, ValueError):
        return f"our CURVE secret key (for public key {keys.public}) is not 40 characters of Z85 text"
    if derived == keys.public:
        return None
    return (
        f"our CURVE secret key does not belong to our public key {keys.public} (keys=CurveKeys(...) holds halves "
        "of two keypairs; CurveKeys.from_secret(secret) derives the public key): every server drops the handshake"
    )


def _peer(server: int) -> bytes:
    """The reassembler's key for ``server``'s socket."""
    return server.to_bytes(8, "little")


def _register(poller: zmq.Poller, s: zmq.Socket[bytes], mon: zmq.Socket[bytes] | None) -> None:
    """Poll a server's socket ``s`` for replies, and its handshake monitor when it has one."""
    poller.register(s, zmq.POLLIN)
    if mon is not None:
        poller.register(mon, zmq.POLLIN)


def _close(poller: zmq.Poller, s: zmq.Socket[bytes], mon: zmq.Socket[bytes] | None) -> None:
    poller.unregister(s)
    if mon is not None:
        poller.unregister(mon)
        s.disable_monitor()
        mon.close(0)
    s.close(0)
