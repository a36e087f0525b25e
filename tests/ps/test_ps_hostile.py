"""Hostile and careless inputs against a live parameter server: every finding of the probe, frames
that declare gigabytes, unauthenticated clients, random frames (hypothesis), corrupt checkpoints. The server must
stay alive, refuse with an error that names the bad field or value, and keep its memory bounded.

The figures in docs/reliability.md come from ``pytest -q tests/ps/test_ps_hostile.py -s`` (it prints them)."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _ps_workers import RawClient, rss_kib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsync.ps import OptimizerConfig, PSClient, PSError, PSTable, PSTimeoutError, server_stats, wire
from sparsync.ps.process import ServerProcess
from sparsync.ps.server import Server, ServerConfig
from sparsync.ps.shard import CheckpointError, Shard, ShardConfig
from sparsync.ps.wire import CurveKeys, Header, Op

pytestmark = [pytest.mark.timeout(120)]

MiB = 2**20
LIMITS = dict(
    max_message_bytes=MiB, wait_timeout=1.0, max_shard_bytes=16 * MiB, max_total_bytes=48 * MiB,
    max_pending_bytes=3 * MiB, max_parked=8, max_steps_ahead=2,
)  # fmt: skip
RSS_LIMIT_KIB = 256 * 1024  # the target: RSS growth < 256 MB


def tid(name: str) -> int:
    return zlib.crc32(name.encode())  # PSTable's table id


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    sp = ServerProcess(ServerConfig(**LIMITS))
    sp.start()
    with PSClient([sp.address], timeout=5) as c:
        PSTable(c, "r", 10, 2, partitions=2, split="range", pushers=2).create().wait()  # partition 1: lo = 5
        PSTable(c, "big", 4096, 64, partitions=1, pushers=2).create().wait()
        PSTable(c, "parkme", 4, 1, partitions=1, pushers=2).create().wait()
    yield sp
    sp.kill()


@pytest.fixture(scope="module")
def raw(server: ServerProcess) -> Iterator[RawClient]:
    assert server.address is not None
    with RawClient(server.address) as r:
        yield r


# --- one hostile message each, against the live server -------------------------------------------------------
def _create(rid: int, cfg: Any, table: int = 777) -> bytes:
    body = cfg if isinstance(cfg, bytes) else json.dumps(cfg).encode()
    return wire.encode(Header(op=Op.CREATE, rid=rid, table=table), body)


def _rows(op: Op, rid: int, rows: list[int], *, table: str = "r", part: int = 1, dim: int = 2, **kw: int) -> bytes:
    r = np.array(rows, dtype=np.int64)
    vals = np.ones((len(rows), dim), np.float32) if op in (Op.PUSH, Op.SET) else None
    h = Header(op=op, rid=rid, table=tid(table), partition=part, n=len(rows), dim=dim, **kw)
    return wire.encode(h, *wire.rows_body(r, vals))


def _cfg(**kw: Any) -> dict[str, Any]:
    return {"name": "x", "rows": 10, "lo": 0, "hi": 10, "dim": 2, **kw}


# (case, frame from the request id, what the error reply must name)
CASES: list[tuple[str, Callable[[int], bytes], str]] = [
    ("json nested 100,000 levels", lambda r: _create(r, b"[" * 100_000 + b"]" * 100_000), "exceeds the limit"),
    ("json nested 30,000 levels", lambda r: _create(r, b"[" * 30_000 + b"]" * 30_000), "nests 30000 levels"),
    ("json nested inside a field", lambda r: _create(r, _cfg(name=[[[[[[[[[["x"]]]]]]]]]])), "nests 11 levels"),
    ("json invalid utf-8", lambda r: _create(r, b'{"name": "\xff\xfe"}'), "UTF-8"),
    ("json not an object", lambda r: _create(r, [1, 2]), "must be a JSON object"),
    ("row -2^63, partition lo=5: PULL", lambda r: _rows(Op.PULL, r, [-(2**63)]), "row -9223372036854775808"),
    ("row -2^63, partition lo=5: PUSH", lambda r: _rows(Op.PUSH, r, [-(2**63)]), "row -9223372036854775808"),
    ("row -2^63, partition lo=5: SET", lambda r: _rows(Op.SET, r, [-(2**63)]), "row -9223372036854775808"),
    ("row 2^63-1: PULL", lambda r: _rows(Op.PULL, r, [2**63 - 1]), "row 9223372036854775807 is outside"),
    ("row of another partition", lambda r: _rows(Op.PULL, r, [2]), "row 2 is outside partition [5, 10)"),
    ("rows = 2^63", lambda r: _create(r, _cfg(rows=2**63, hi=2**63)), "rows must be in"),
    ("lo = 2^63", lambda r: _create(r, _cfg(lo=2**63)), "lo must be in"),
    ("hi = 2^64", lambda r: _create(r, _cfg(hi=2**64)), "hi must be in"),
    ("stride = 2^64", lambda r: _create(r, _cfg(stride=2**64)), "stride must be in"),
    ("PULL of a refused table", lambda r: _rows(Op.PULL, r, [1], table="nope", part=0), "does not exist"),
    ("rows = true", lambda r: _create(r, _cfg(rows=True)), "rows must be an integer, got True"),
    ("rows = 1.5", lambda r: _create(r, _cfg(rows=1.5)), "rows must be an integer, got 1.5"),
    ("dim = 0", lambda r: _create(r, _cfg(dim=0)), "dim must be in"),
    ("lo > hi", lambda r: _create(r, _cfg(lo=8, hi=4)), "bad shard"),
    ("pushers = 0", lambda r: _create(r, _cfg(pushers=0)), "pushers must be in"),
    ("divisor = -1", lambda r: _create(r, _cfg(divisor=-1)), "divisor must be a finite number > 0"),
    ("divisor = NaN", lambda r: _create(r, _cfg(divisor=float("nan"))), "divisor must be a finite number"),
    ("mode = 'semi'", lambda r: _create(r, _cfg(mode="semi")), "unknown mode 'semi'"),
    ("name of 10,000 characters", lambda r: _create(r, _cfg(name="n" * 10_000)), "table name must be"),
    ("unknown config key", lambda r: _create(r, _cfg(evil=1)), "unknown table config keys ['evil']"),
    ("lr_decay = 'fast'", lambda r: _create(r, _cfg(optimizer={"name": "adagrad", "lr_decay": "fast"})),
     "lr_decay must be a number, got 'fast'"),
    ("eps = 'tiny'", lambda r: _create(r, _cfg(optimizer={"name": "adam", "eps": "tiny"})),
     "eps must be a number, got 'tiny'"),
    ("lr = Infinity", lambda r: _create(r, _cfg(optimizer={"lr": float("inf")})),
     "lr must be a finite number > 0, got inf"),
    ("lr = 1e39 (float32: inf)", lambda r: _create(r, _cfg(optimizer={"lr": 1e39})), "lr must be a finite number"),
    ("lr = 10^400 (an integer past float's range)", lambda r: _create(r, _cfg(optimizer={"lr": 10**400})),
     "lr must be a finite number > 0, got 1000000000"),
    ("beta1 = 2", lambda r: _create(r, _cfg(optimizer={"name": "adam", "beta1": 2})), "beta1 must lie in [0, 1)"),
    ("optimizer 'rmsprop'", lambda r: _create(r, _cfg(optimizer={"name": "rmsprop"})), "unknown server optimizer"),
    ("optimizer name = 5", lambda r: _create(r, _cfg(optimizer={"name": 5})), "unknown server optimizer 5"),
    ("optimizer is a list", lambda r: _create(r, _cfg(optimizer=[1])), "optimizer must be a JSON object"),
    ("unknown optimizer key", lambda r: _create(r, _cfg(optimizer={"momentum": 0.9})), "unknown optimizer keys"),
    ("partition > max_shard_bytes", lambda r: _create(r, _cfg(rows=2**40, hi=2**40, dim=64)), "max_shard_bytes"),
    ("table config changed", lambda r: _create(r, _cfg(name="r"), table=tid("r")), "another config"),
    ("push 100 steps ahead", lambda r: _rows(Op.PUSH, r, [5], step=100), "more than max_steps_ahead=2 ahead"),
    ("pull waiting for step 2^64-1", lambda r: _rows(Op.PULL, r, [5], step=2**64 - 1), "max_steps_ahead"),
    ("apply for step 2^63", lambda r: wire.encode(Header(op=Op.APPLY, rid=r, table=tid("r"), dim=2, step=2**63)),
     "max_steps_ahead"),
    ("apply with a body", lambda r: wire.encode(Header(op=Op.APPLY, rid=r, table=tid("r"), dim=2), b"xx"),
     "APPLY carries no body"),
    ("dim of another table", lambda r: _rows(Op.PULL, r, [5], dim=3), "dim 3 does not match"),
    ("n larger than the partition", lambda r: _rows(Op.PULL, r, list(range(5, 10)) * 2), "exceeds partition size"),
    ("NaN gradient", lambda r: wire.encode(Header(op=Op.PUSH, rid=r, table=tid("r"), partition=1, n=1, dim=2),
                                           *wire.rows_body(np.array([5]), np.full((1, 2), np.nan))), "non-finite"),
    ("body_len lies", lambda r: wire.encode(Header(op=Op.PING, rid=r), b"abc")[:-1], "body_len=3"),
    ("body shorter than n rows",
     lambda r: wire.encode(Header(op=Op.PULL, rid=r, table=tid("r"), n=3, dim=2), bytes(8)), "expected 24"),
    ("unknown op 200", lambda r: wire.encode(Header(op=200, rid=r)), "unknown op 200"),
    ("wire version 1", lambda r: wire.encode(Header(op=Op.PING, rid=r))[:4] + b"\x01"
     + wire.encode(Header(op=Op.PING, rid=r))[5:], "wire version 1"),
    ("bad magic", lambda r: b"EVIL" + wire.encode(Header(op=Op.PING, rid=r))[4:], "bad magic"),
    ("empty frame", lambda r: b"", "shorter than"),
    ("SAVE without checkpoint_dir", lambda r: wire.encode(Header(op=Op.SAVE, rid=r)), "nowhere to save"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_message_is_refused_naming_the_bad_value(
    server: ServerProcess, raw: RawClient, case: tuple[str, Callable[[int], bytes], str]
) -> None:
    name, frame, expect = case
    rid = 1000 + CASES.index(case)
    got = raw.ask(frame(rid), rid=rid if frame(rid)[:4] == wire.MAGIC else 0)
    assert got is not None, f"{name}: no reply"
    h, msg = got
    assert h.status == 1 and expect in msg, f"{name}: {msg}"
    assert server.alive() and raw.ping(rid + 10_000)


def test_sync_pushes_are_bounded_per_step_and_in_bytes(server: ServerProcess, raw: RawClient) -> None:
    push = lambda rid, sender, step, n=1: raw.ask(  # noqa: E731
        _rows(Op.PUSH, rid, list(range(n)), table="big", part=0, dim=64, sender=sender, step=step), rid=rid
    )
    assert push(1, 0, 0) == (Header(op=Op.PUSH | wire.REPLY_BIT, rid=1, table=tid("big"), sender=0), "")
    h, msg = push(2, 0, 0)
    assert h.status == 1 and "worker 0 already pushed step 0" in msg
    assert push(3, 1, 0)[0].status == 0
    h, msg = push(4, 2, 0)
    assert h.status == 1 and "already has all 2 pushes" in msg
    # 3000 rows x 64 floats = 0.8 MB a push: the fourth held push passes max_pending_bytes = 3 MiB
    answers = [
        push(10 + i, sender, step, 3000) for i, (step, sender) in enumerate([(1, 0), (1, 1), (2, 0), (2, 1)])
    ]
    assert [a[0].status for a in answers] == [0, 0, 0, 1], answers
    assert "max_pending_bytes" in answers[-1][1]


def test_parked_requests_are_bounded(server: ServerProcess, raw: RawClient) -> None:
    apply = Header(op=Op.APPLY, table=tid("parkme"), dim=1, step=0)  # waits: no pushes come
    for rid in range(20, 28):
        raw.sock.send(wire.encode(Header(**{**apply.__dict__, "rid": rid})))
    h, msg = raw.ask(wire.encode(Header(**{**apply.__dict__, "rid": 28})), rid=28)
    assert h.status == 1 and "8 requests already wait on this server (max_parked)" in msg
    h, msg = raw.ask(None, timeout=5, rid=27)  # the parked ones time out (1 s), with why
    assert h.status == 1 and "0 of 2 pushes arrived" in msg


def test_a_number_past_floats_range_is_bad_input_not_an_internal_error() -> None:
    """JSON integers have no bound: lr = 10^400 made float() raise OverflowError, which the server took for a bug
    (logged with its traceback) though it is the client's bad value."""
    s = Server(ServerConfig(auth=False))
    for field in ("lr", "eps", "lr_decay"):
        opt = {"name": "adagrad", field: 10**400}
        h, body = wire.decode(s.receive(b"id", _create(7, _cfg(optimizer=opt))) or b"")
        msg = bytes(body).decode()
        assert h.status == 1 and msg.startswith(f"ValueError: {field} must be a finite number"), msg
        assert "(401 digits)" in msg and len(msg) < 200, msg  # names the value without 401 digits of it
    assert s.internal_errors == 0 and not s.shards


def _mem_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes, read here independently of the library."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no MemAvailable in /proc/meminfo")


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="needs /proc/meminfo (Linux)")
def test_default_table_bound_follows_the_machines_memory() -> None:
    """A fixed 32 GiB default let 15 of 19 CREATEs of 2 GiB tables through on a 24 GiB machine (30 GiB declared,
    tables are zeros that only take memory once written). Now the default fits what the machine has."""
    available = _mem_available()
    cfg = ServerConfig(auth=False)
    assert 0 < cfg.max_total_bytes <= available // 2 + 2**28  # half of MemAvailable (which moves a little)
    s = Server(cfg)
    rows = 2**29  # 2 GiB of float32 weights (SGD: no state)
    answers = [
        wire.decode(s.receive(b"id", _create(i, _cfg(name=f"m{i}", rows=rows, hi=rows, dim=1), table=i)) or b"")
        for i in range(19)
    ]
    accepted = sum(h.status == 0 for h, _ in answers)
    assert accepted * 2 * 2**30 <= available, f"{accepted} tables of 2 GiB accepted, {available} bytes available"
    assert "max_total_bytes" in bytes(answers[-1][1]).decode()
    s.shards.clear()  # the tables were never written: they gave back nothing but address space
    assert ServerConfig(auth=False, max_total_bytes=2**50).max_total_bytes == 2**50  # still overridable


def test_machine_memory_is_read_from_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    from sparsync.ps.machine import available_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:  1 kB\nMemAvailable:   20971520 kB\n")
    assert available_memory(meminfo=meminfo, cgroups=()) == 20 * 2**30
    group = tmp_path / "container"  # cgroup v2: a container limited to 8 GiB, 3 GiB used, 2 GiB of it cache
    group.mkdir()
    (group / "memory.max").write_text(f"{8 * 2**30}\n")
    (group / "memory.current").write_text(f"{3 * 2**30}\n")
    (group / "memory.stat").write_text(f"anon {2**30}\ninactive_file {2 * 2**30}\n")
    assert available_memory(meminfo=meminfo, cgroups=[group, tmp_path]) == 7 * 2**30
    (group / "memory.max").write_text("max\n")  # no limit: the machine's figure
    assert available_memory(meminfo=meminfo, cgroups=[group]) == 20 * 2**30
    old = tmp_path / "v1"  # cgroup v1, no limit set (the largest page-aligned int64)
    old.mkdir()
    (old / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (old / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    assert available_memory(meminfo=meminfo, cgroups=[old]) == 20 * 2**30


def test_tables_are_bounded_per_server(server: ServerProcess, raw: RawClient) -> None:
    # 12 MiB partitions fit max_shard_bytes (16 MiB) but not four of them in max_total_bytes (48 MiB)
    rows = 3 * 2**20
    answers = [
        raw.ask(_create(40 + i, _cfg(name=f"t{i}", rows=rows, hi=rows, dim=1), 40 + i), rid=40 + i)
        for i in range(4)
    ]
    assert [a[0].status for a in answers] == [0, 0, 0, 1]
    assert "max_total_bytes" in answers[-1][1]


def test_multipart_message_is_dropped_unanswered(server: ServerProcess) -> None:
    assert server.address is not None
    with RawClient(server.address) as raw:  # its own connection: no late reply to an earlier test's request
        raw.sock.send_multipart([wire.encode(Header(op=Op.PING, rid=50)), b"second part"])
        got = raw.replies(1.0)
        assert got == [], f"a multipart message was answered: {got}"
        raw.ping_next(51)  # and not later either
        assert raw.replies(0.3) == []


# --- memory: frames declaring more than the limit ------------------------------------------------------------
def _declare(endpoint: str, mechanism: bytes, declared: int, stream: int) -> int:
    """Speak raw ZMTP 3.0: greet with ``mechanism`` (NULL: then READY), declare one frame of ``declared`` bytes
    (for CURVE, a HELLO command) and stream up to ``stream`` bytes of it; the bytes the server took."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=3)
    sent = 0
    try:
        s.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\0") + bytes(32))
        if mechanism == b"NULL":
            ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
            s.sendall(bytes([0x04, len(ready)]) + ready)
        s.sendall(bytes([0x02 if mechanism == b"NULL" else 0x06]) + struct.pack(">Q", declared))
        chunk = bytes(MiB)
        while sent < stream:
            s.sendall(chunk)
            sent += len(chunk)
        # Wait until the server has read it all and closes: closing first, with the server's greeting unread,
        # would reset the connection and discard what is still in the server's socket buffer.
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass
    except OSError:
        pass  # dropped by the server: what we want
    finally:
        s.close()
    return sent


@pytest.mark.parametrize("auth", [True, False], ids=["curve-unauthenticated", "no-auth"])
def test_frame_declaring_8_gib_is_dropped_unbuffered(auth: bool) -> None:
    sp = ServerProcess(ServerConfig(**{**LIMITS, "auth": auth}))
    address = sp.start()
    try:
        assert sp.pid is not None
        before = rss_kib(sp.pid)
        endpoint = wire.split_address(address)[0]
        took = _declare(endpoint, b"CURVE" if auth else b"NULL", 8 * 2**30, 512 * MiB)
        if auth:  # a peer that speaks NULL to a CURVE server: refused at the greeting
            took += _declare(endpoint, b"NULL", 8 * 2**30, 512 * MiB)
        time.sleep(0.3)
        grew = rss_kib(sp.pid, "VmHWM") - before
        print(f"\n[figure] 8 GiB declared, auth={auth}: server took {took / MiB:.0f} MiB, peak RSS +{grew} KiB")
        assert grew < RSS_LIMIT_KIB and took < 512 * MiB
        with RawClient(address) as r:
            assert r.ping(1)
    finally:
        sp.kill()


def _peak_growth_kib(pid: int, attack: Callable[[], object]) -> int:
    """Peak resident memory the process ``pid`` gained during ``attack()``, KiB: its peak (VmHWM) is reset to
    its current RSS first (``/proc/<pid>/clear_refs``), so neither an earlier peak hides growth nor counts."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = rss_kib(pid)
    attack()
    time.sleep(0.3)
    return rss_kib(pid, "VmHWM") - before


def _peers_declaring(endpoint: str, peers: int, declared: int, stream: int) -> list[int]:
    """``peers`` raw TCP connections at once, each greeting with CURVE and declaring a handshake command of
    ``declared`` bytes, then streaming up to ``stream`` bytes of it; the bytes each got through."""
    took = [0] * peers

    def one(i: int) -> None:
        took[i] = _declare(endpoint, b"CURVE", declared, stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return took


@pytest.mark.parametrize(("peers", "stream"), [(4, 48 * MiB), (64, 4 * MiB)])
def test_unauthenticated_peers_cannot_grow_a_default_server(peers: int, stream: int) -> None:
    """The server's defaults (CURVE, max_message_bytes 256 MiB): peers without a key declare a 200 MiB HELLO
    and stream into it. Each may cost the server one fragment (64 KiB) and libzmq's per-connection buffers,
    whatever the message limit: peak RSS grows at most 16 MiB, and the server answers its clients after."""
    sp = ServerProcess(ServerConfig())
    address = sp.start()
    try:
        assert sp.pid is not None and sp.cfg.max_message_bytes == wire.DEFAULT_MAX_MESSAGE
        endpoint = wire.split_address(address)[0]
        took: list[int] = []
        grew = _peak_growth_kib(sp.pid, lambda: took.extend(_peers_declaring(endpoint, peers, 200 * MiB, stream)))
        print(
            f"\n[figure] {peers} unauthenticated peers, 200 MiB HELLO declared, up to {stream // MiB} MiB "
            f"streamed each, default server: server took {sum(took) / MiB:.0f} MiB, peak RSS +{grew} KiB"
        )
        assert grew <= 16 * 1024, f"{peers} peers grew the server's peak RSS by {grew} KiB"
        with PSClient([address], timeout=10) as c:  # an authenticated client still gets its answers
            t = PSTable(c, "after", 10, 2, partitions=1)
            t.create().wait()
            t.set(np.arange(10), np.full((10, 2), 3.0, np.float32)).wait()
            assert (t.pull(np.arange(10)).wait().numpy() == 3.0).all()
        assert sp.alive()
    finally:
        sp.kill()


def test_authenticated_oversized_frame_is_dropped(server: ServerProcess) -> None:
    assert server.address is not None and server.pid is not None
    message = wire.encode(Header(op=Op.PUSH, rid=60), bytes(64 * MiB))
    with RawClient(server.address) as r:

        def attack() -> None:
            r.sock.send(message)  # one ZeroMQ frame over a fragment: libzmq drops the connection (MAXMSGSIZE)
            assert r.replies(1.0) == []
            r.ping_next(61)  # the socket reconnects
            # in fragments: refused at the first, whose header declares more than max_message_bytes; the next
            # reply of any request id is that refusal, and the one after it the PING's: the rest of the
            # message's fragments are read and dropped unanswered
            h, msg = r.ask(message) or (None, "")
            assert h is not None and (h.rid, h.status) == (60, 1), (h, msg)
            assert "exceeds the limit of 1048576 bytes" in msg, msg
            r.ping_next(62)
            assert r.replies(0.3) == []

        grew = _peak_growth_kib(server.pid, attack)
    print(f"\n[figure] 64 MiB message over a 1 MiB limit (authenticated), one frame and in fragments: "
          f"peak RSS +{grew} KiB")  # fmt: skip
    # nothing reserved for the message; libzmq may queue up to its receive high-water mark of fragments
    # (1000, 64 MiB) while the server reads and drops them
    assert grew < 64 * 1024


# --- authentication --------------------------------------------------------------------------------------------
def test_unauthenticated_clients_are_refused_in_the_handshake(server: ServerProcess) -> None:
    address = server.address
    assert address is not None and server.pid is not None and server.keys is not None
    with RawClient(address, curve=False) as r:  # plain ZeroMQ, no CURVE
        assert r.ask(wire.encode(Header(op=Op.SHUTDOWN, rid=70)), timeout=1.0) is None
    with RawClient(address, keys=CurveKeys.generate()) as r:  # CURVE with a key of another run
        assert r.ask(wire.encode(Header(op=Op.SHUTDOWN, rid=71)), timeout=1.0) is None
    t0 = time.monotonic()
    with (
        PSClient([address], keys=CurveKeys.generate(), timeout=20) as c,
        pytest.raises(PSError, match="refused our CURVE handshake"),
    ):
        PSTable(c, "r", 10, 2, partitions=2, split="range").create().wait()
    assert time.monotonic() - t0 < 5  # at once, not after the timeout
    other = wire.curve_address(wire.split_address(address)[0], CurveKeys.generate().public)
    with PSClient([other], timeout=1.0) as c, pytest.raises(PSTimeoutError):  # an impostor's key: no server
        PSTable(c, "r", 10, 2, partitions=2, split="range").create().wait()
    with PSClient([address], timeout=5) as c:  # the run's key still works
        stats = server_stats(c)[0]
    assert server.alive() and stats["auth_refused"] >= 2
    # the server's secret is on neither its command line nor its environment (other users can read ps)
    for f in ("cmdline", "environ"):
        assert server.keys.secret.encode() not in Path(f"/proc/{server.pid}/{f}").read_bytes()


def test_a_client_whose_secret_is_not_its_public_keys_fails_at_once(server: ServerProcess) -> None:
    """The admitted public key with another keypair's secret: the server cannot open the client's vouch in CURVE's
    INITIATE and drops the connection before asking ZAP, without the ERROR command a refused key gets, so the
    client sees only a dropped connection (as from a server that died mid-handshake) and used to wait for the
    timeout. The pair is checked in the client instead."""
    assert server.address is not None and server.client_keys is not None
    mixed = CurveKeys(server.client_keys.public, CurveKeys.generate().secret)
    t0 = time.monotonic()
    with (
        PSClient([server.address], keys=mixed, timeout=10) as c,
        pytest.raises(PSError, match=re.escape(f"secret key does not belong to our public key {mixed.public}")),
    ):
        PSTable(c, "r", 10, 2, partitions=2, split="range").create().wait()
    assert time.monotonic() - t0 < 3  # at once, not after the timeout
    assert server.alive()


@pytest.mark.timeout(120)
def test_a_refused_client_never_blocks_in_send(server: ServerProcess) -> None:
    """After a failed CURVE handshake a DEALER has no connection until it reconnects, and a blocking send there
    waits for ever: the client's I/O thread hung in one run of six of the node-servers test (its impostor
    client). Back-to-back requests of a client with another run's key all fail, and the client closes."""
    address = server.address
    assert address is not None
    t0 = time.monotonic()
    with PSClient([address], keys=CurveKeys.generate(), timeout=2.0) as c:
        for rnd in range(5):  # rounds of requests that meet the socket in its reconnect window
            works = [PSTable(c, f"imp{rnd}.{i}", 10, 2, mode="async").create() for i in range(40)]
            for w in works:
                with pytest.raises((PSError, PSTimeoutError)):
                    w.wait()
    assert time.monotonic() - t0 < 60


def test_client_without_keys_gets_a_clear_error(server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(wire.CLIENT_KEY_ENV)
    assert server.address is not None
    with pytest.raises(ValueError, match=r"authenticate clients .* SPARSYNC_PS_CLIENT_KEY"):
        PSClient([server.address])


def test_any_exception_becomes_an_error_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Server(ServerConfig(auth=False))

    def boom(*a: object) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(s, "handle", boom)
    h, body = wire.decode(s.receive(b"id", wire.encode(Header(op=Op.PING, rid=5))) or b"")
    assert (h.status, h.rid, bytes(body)) == (1, 5, b"RecursionError: maximum recursion depth exceeded")
    assert s.internal_errors == 1 and s.running


# --- random frames -------------------------------------------------------------------------------------------
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
_FIELDS = st.sampled_from(sorted(ShardConfig.__dataclass_fields__))
_CONFIGS = st.dictionaries(_FIELDS, _JSON | st.integers(-(2**70), 2**70), max_size=10)


@st.composite
def _frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "header", "create", "rows"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    op = draw(st.sampled_from([o for o in Op if o != Op.SHUTDOWN]) | st.integers(0, 255).filter(lambda o: o != 9))
    head = dict(
        rid=draw(st.integers(0, 2**64 - 1)),
        table=draw(st.sampled_from([tid("h"), tid("ha")]) | st.integers(0, 2**32 - 1)),
        partition=draw(st.integers(0, 2)),
        sender=draw(st.integers(0, 2**32 - 1)),
        step=draw(st.sampled_from([0, 1, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)),
        dim=draw(st.sampled_from([2, 0, 2**32 - 1])),
    )
    if kind == "create":
        body = json.dumps(draw(_CONFIGS | _JSON)).encode()
        return wire.encode(Header(op=Op.CREATE, **head), body)
    if kind == "rows":
        rows = draw(st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-2, 12), max_size=6))
        vals = draw(st.lists(st.floats(width=32), min_size=2 * len(rows), max_size=2 * len(rows)))
        op = draw(st.sampled_from([Op.PULL, Op.PUSH, Op.SET, Op.APPLY]))
        r, v = np.array(rows, np.int64), np.array(vals, np.float32).reshape(len(rows), 2)
        body = wire.rows_body(r, None if op == Op.PULL else v)
        return wire.encode(Header(op=op, n=len(rows), **head), *body)
    n = draw(st.sampled_from([0, 1, 2**64 - 1]) | st.integers(0, 2**64 - 1))
    return wire.encode(Header(op=op, n=n, **head), draw(st.binary(max_size=64)))


def test_random_frames_never_stop_the_server() -> None:
    sp = ServerProcess(ServerConfig(**LIMITS))
    address = sp.start()
    try:
        with PSClient([address], timeout=5) as c:
            PSTable(c, "h", 10, 2, partitions=3, pushers=2).create().wait()
            PSTable(c, "ha", 10, 2, partitions=3, mode="async", optimizer=OptimizerConfig("adam")).create().wait()
        assert sp.pid is not None
        before = rss_kib(sp.pid)
        seen = {"examples": 0}
        with RawClient(address) as raw:

            @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
            @given(frame=_frames())
            def run(frame: bytes) -> None:
                raw.sock.send(frame)
                seen["examples"] += 1
                assert raw.ping(2**63 + seen["examples"]), f"server stopped answering after {frame[:100]!r}"

            run()
        grew = rss_kib(sp.pid) - before
        print(f"\n[figure] {seen['examples']} random frames: server alive, RSS +{grew} KiB")
        assert sp.alive() and grew < RSS_LIMIT_KIB
    finally:
        sp.kill()


# --- checkpoints ---------------------------------------------------------------------------------------------
def _checkpoint(tmp_path: Path) -> Path:
    s = Server(ServerConfig(auth=False, checkpoint_dir=str(tmp_path)))
    shard = Shard(ShardConfig("t", 6, 0, 6, 3, OptimizerConfig("adam")))
    shard.weights[...] = np.arange(18, dtype=np.float32).reshape(6, 3)
    s.shards[(1, 0)] = shard
    return Path(s.save())


def _rewrite(path: Path, change: Callable[[dict[str, np.ndarray]], None]) -> None:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _meta(a: dict[str, np.ndarray], **kw: Any) -> None:
    meta = {**json.loads(bytes(a["t1p0/meta"])), **kw}
    a["t1p0/meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)


def _huge_header(path: Path) -> None:
    """A weights array whose header declares 2^40 rows (and holds none)."""
    import zipfile

    with zipfile.ZipFile(path, "a") as zf:
        data = {n: zf.read(n) for n in zf.namelist() if n != "t1p0/weights.npy"}
    with zipfile.ZipFile(path, "w") as zf:
        for n, b in data.items():
            zf.writestr(n, b)
        head = np.lib.format.header_data_from_array_1_0(np.zeros((1, 3), np.float32))
        head["shape"] = (2**40, 3)
        with zf.open("t1p0/weights.npy", "w") as f:
            np.lib.format.write_array_header_1_0(f, head)


CHECKPOINT_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("weights of 1 row", lambda p: _rewrite(p, lambda a: a.update({"t1p0/weights": a["t1p0/weights"][:1]})),
     r"t1p0/weights is float32\[1, 3\], the table needs float32\[6, 3\]"),
    ("weights as float64", lambda p: _rewrite(p, lambda a: a.update({"t1p0/weights": np.ones((6, 3))})),
     r"t1p0/weights is float64\[6, 3\]"),
    ("NaN weights", lambda p: _rewrite(p, lambda a: a["t1p0/weights"].__setitem__((2, 1), np.nan)),
     "t1p0/weights holds NaN or Inf"),
    ("Inf in adam's state", lambda p: _rewrite(p, lambda a: a["t1p0/state/exp_avg"].__setitem__((0, 0), np.inf)),
     "t1p0/exp_avg holds NaN or Inf"),
    ("negative version", lambda p: _rewrite(p, lambda a: _meta(a, version=-5)), r"t1p0 version must be in \[0, "),
    ("version 2^64", lambda p: _rewrite(p, lambda a: _meta(a, version=2**64)), "t1p0 version must be in"),
    ("meta not JSON", lambda p: _rewrite(p, lambda a: a.update({"t1p0/meta": np.frombuffer(b"{", np.uint8)})),
     "truncated or corrupt: JSONDecodeError"),
    ("config of 2^40 rows", lambda p: _rewrite(p, lambda a: _meta(a, config={**json.loads(
        bytes(a["t1p0/meta"]))["config"], "rows": 2**40, "hi": 2**40})), "max_shard_bytes"),
    ("state array missing", lambda p: _rewrite(p, lambda a: a.pop("t1p0/state/exp_avg_sq")),
     "t1p0/state/exp_avg_sq is missing"),
    ("extra array", lambda p: _rewrite(p, lambda a: a.update({"t1p0/state/sum": np.zeros((6, 3), np.float32)})),
     "arrays its config does not use"),
    ("unknown entry", lambda p: _rewrite(p, lambda a: a.update({"evil/x": np.zeros(1)})), "unexpected entry"),
    ("header declaring 2^40 rows", _huge_header, r"float32\[1099511627776, 3\], the table needs"),
    ("truncated file", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "truncated or corrupt"),
    ("not a zip file", lambda p: p.write_bytes(b"garbage" * 100), "truncated or corrupt"),
]  # fmt: skip


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_bad_checkpoint_is_refused_with_a_clear_error(
    tmp_path: Path, case: tuple[str, Callable[[Path], None], str]
) -> None:
    _, corrupt, expect = case
    path = _checkpoint(tmp_path)
    assert Server(ServerConfig(auth=False, checkpoint_dir=str(tmp_path))).shards[(1, 0)].weights[5, 2] == 17.0
    corrupt(path)
    with pytest.raises(CheckpointError, match=expect):
        Server(ServerConfig(auth=False, checkpoint_dir=str(tmp_path)))


def test_nonfinite_checkpoint_loads_when_asked(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    _rewrite(path, lambda a: a["t1p0/weights"].__setitem__((2, 1), np.nan))
    s = Server(ServerConfig(auth=False, checkpoint_dir=str(tmp_path), load_nonfinite=True))
    assert np.isnan(s.shards[(1, 0)].weights[2, 1])


def test_server_process_with_a_crafted_checkpoint_fails_to_start_saying_why(tmp_path: Path) -> None:
    """It exits at once; the error says so, with its exit code and its last stderr line (it said "did not start
    within 30.0 s", as if it had hung)."""
    _rewrite(_checkpoint(tmp_path), lambda a: _meta(a, version=-5))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        ServerProcess(ServerConfig(checkpoint_dir=str(tmp_path))).start()
    msg = str(e.value)
    assert msg.startswith("parameter server 0 exited with code 1 before it started: "), msg
    assert msg.rstrip().endswith("t1p0 version must be in [0, 4611686018427387904], got -5"), msg
    assert "within" not in msg and time.monotonic() - t0 < 20


def test_checkpoint_is_fsynced_before_and_after_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append("replace") or real_replace(a, b))
    _checkpoint(tmp_path)
    assert calls == ["fsync", "replace", "fsync"]  # the file, the rename, its directory
    assert not list(tmp_path.glob("*.tmp"))
