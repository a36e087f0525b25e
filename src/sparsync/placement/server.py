"""A parameter-server process: holds table partitions, serves pull/push over a ZeroMQ ROUTER socket.

One server per machine, colocated with that machine's workers (Parallax §4.3). The loop is single-threaded:
requests are handled in arrival order, and the two requests that must wait (a sync APPLY until all pushes of
its step arrived, a PULL until the table reached the version it asks for) are parked and answered later, or
answered with an error after ``wait_timeout`` seconds, so a dead worker yields an error, never a hang.
Every malformed, oversized or unauthenticated message gets an error reply that says why.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from sparsync.placement import wire
from sparsync.placement.shard import Shard, ShardConfig
from sparsync.placement.wire import Header, Op, WireError


@dataclass(frozen=True)
class ServerConfig:
    server_id: int = 0  # names the checkpoint file
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 0  # 0: the OS picks
    token: str | None = None  # shared secret; when set, messages without its digest are refused
    checkpoint_dir: str | None = None  # where SAVE writes and where a (re)started server resumes from
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE
    wait_timeout: float = 60.0  # seconds a parked APPLY/PULL waits before an error reply
    max_shard_bytes: int = 16 * 2**30  # a CREATE asking for more (weights + optimizer state) is refused
    parent_pid: int | None = None  # exit when this process is no longer our parent (no orphaned servers)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_message_bytes < wire.HEADER.size:
            raise ValueError(f"max_message_bytes must be >= {wire.HEADER.size}, got {self.max_message_bytes}")

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


class Server:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.shards: dict[tuple[int, int], Shard] = {}
        self.parked: list[_Parked] = []
        self.digest = wire.token_digest(cfg.token) if cfg.token else None
        self.bytes_in = 0
        self.bytes_out = 0
        self.requests = 0
        self.running = True
        path = cfg.checkpoint_path
        if path is not None and path.exists():
            self.load(path)

    # --- checkpoint -------------------------------------------------------------------------------------
    def save(self) -> str:
        path = self.cfg.checkpoint_path
        if path is None:
            raise ValueError("this server was started without checkpoint_dir: nowhere to save")
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, np.ndarray] = {}
        for (t, p), s in self.shards.items():
            arrays.update(s.arrays(f"t{t}p{p}"))
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)  # type: ignore[arg-type]  # numpy stubs type **kwds as allow_pickle
        os.replace(tmp, path)  # atomic: a crash mid-save leaves the previous checkpoint
        return str(path)

    def load(self, path: Path) -> None:
        with np.load(path, allow_pickle=False) as z:
            keys = {k.split("/")[0] for k in z.files}
            for key in keys:
                t, p = key[1:].split("p")
                self.shards[(int(t), int(p))] = Shard.from_arrays(key, z)

    # --- requests ---------------------------------------------------------------------------------------
    def _shard(self, h: Header) -> Shard:
        s = self.shards.get((h.table, h.partition))
        if s is None:
            raise KeyError(
                f"table {h.table} partition {h.partition} does not exist on server {self.cfg.server_id}"
            )
        return s

    def handle(self, h: Header, body: memoryview) -> tuple[Header, list[bytes | memoryview]] | None:
        """The reply, or None when the request is parked."""
        op = wire.check_op(h)
        if op == Op.PING:
            return h.reply(), []
        if op == Op.CREATE:
            cfg = ShardConfig.from_json(wire.parse_json(body))
            need = cfg.size * cfg.dim * 4 * {"sgd": 1, "adagrad": 2, "adam": 3}[cfg.optimizer.name]
            if need > self.cfg.max_shard_bytes:
                raise ValueError(
                    f"partition of {need} bytes exceeds this server's max_shard_bytes={self.cfg.max_shard_bytes}"
                )
            old = self.shards.get((h.table, h.partition))
            if old is None:
                old = self.shards[(h.table, h.partition)] = Shard(cfg)
            elif old.cfg != cfg:
                raise ValueError(f"table {h.table} partition {h.partition} exists with another config: {old.cfg}")
            return h.reply(n=old.version), []  # a restarted server tells where it resumes
        if op == Op.SAVE:
            return h.reply(), [self.save().encode()]
        if op == Op.STATS:
            stats = {
                "server_id": self.cfg.server_id,
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "requests": self.requests,
                "shards": [
                    {"table": t, "partition": p, "name": s.cfg.name, "version": s.version, "lo": s.cfg.lo}
                    for (t, p), s in self.shards.items()
                ],
            }
            return h.reply(), [wire.json_body(stats)]
        if op == Op.SHUTDOWN:
            self.running = False
            return h.reply(), []
        s = self._shard(h)
        if h.dim != s.cfg.dim:
            raise ValueError(f"dim {h.dim} does not match table {s.cfg.name!r} (dim {s.cfg.dim})")
        if h.n > s.cfg.size and op != Op.PUSH:
            raise ValueError(f"n={h.n} rows exceeds partition size {s.cfg.size}")
        if op == Op.PULL:
            rows, _ = wire.parse_rows(h, body, with_values=False)
            s.local(rows)  # validate now: a parked pull must not fail later for a bad row
            if s.version < h.step:
                self.parked.append(_Parked(b"", h, 0.0))  # ident and rows filled in by the caller
                return None
            return h.reply(n=h.n, dim=h.dim), [s.pull(rows).data]
        rows, vals = wire.parse_rows(h, body, with_values=True)
        assert vals is not None
        if not np.isfinite(vals).all():
            raise ValueError(f"non-finite value in a {op.name} to table {s.cfg.name!r}")
        if op == Op.SET:
            s.set(rows, vals)
            return h.reply(), []
        if op == Op.PUSH:
            s.push(rows, vals, h.step)
            return h.reply(), []
        # APPLY (sync): once, when every pusher's gradient of the step is in and the previous step applied.
        if s.cfg.mode != "sync":
            raise ValueError(f"APPLY on table {s.cfg.name!r} in async mode")
        if h.step < s.version:
            return h.reply(), []  # already applied (e.g. resent after a reconnect)
        self.parked.append(_Parked(b"", h, 0.0))
        return None

    def ready(self, p: _Parked, pull_rows: np.ndarray | None) -> tuple[Header, list[bytes | memoryview]] | None:
        s = self._shard(p.head)
        h = p.head
        if h.op == Op.PULL:
            if s.version < h.step:
                return None
            assert pull_rows is not None
            return h.reply(n=h.n, dim=h.dim), [s.pull(pull_rows).data]
        if s.version == h.step and s.arrived(h.step) >= s.cfg.pushers:
            s.apply_step(h.step)
            return h.reply(), []
        if h.step < s.version:
            return h.reply(), []
        return None

    def why_waiting(self, p: _Parked) -> str:
        s = self._shard(p.head)
        if p.head.op == Op.PULL:
            return f"pull waited for step {p.head.step} of table {s.cfg.name!r}, still at step {s.version}"
        return (
            f"step {p.head.step} of table {s.cfg.name!r} partition {p.head.partition}: "
            f"{s.arrived(p.head.step)} of {s.cfg.pushers} pushes arrived (table at step {s.version})"
        )


def _error(h: Header, msg: str) -> bytes:
    return wire.encode(h.reply(status=1), msg.encode())


def _salvage_header(frame: bytes) -> Header:
    """Best effort: the request id of a message we refuse, so the client can match the error reply."""
    if len(frame) >= wire.HEADER.size and frame[:4] == wire.MAGIC:
        f = wire.HEADER.unpack_from(frame)
        return Header(op=f[2] & 0x7F, rid=f[6], table=f[7], partition=f[8])
    return Header(op=0)


def serve(cfg: ServerConfig, ready: Any = None) -> None:
    """Run a server until SHUTDOWN; ``ready(address)`` is called once bound."""
    server = Server(cfg)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.bind(f"tcp://{cfg.host}:{cfg.port if cfg.port else '*'}")
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if ready is not None:
        ready(address)
    pull_rows: dict[int, np.ndarray] = {}  # id(parked) -> rows of a parked pull
    try:
        while server.running:
            if cfg.parent_pid is not None and os.getppid() != cfg.parent_pid:
                break  # whoever started us died without stopping us
            timeout_ms = 200 if server.parked else 1000
            if sock.poll(timeout_ms):
                ident, frame = _recv(sock)
                if ident is not None:
                    _one(server, sock, ident, frame, pull_rows)
            _retry_parked(server, sock, pull_rows)
    finally:
        sock.close()
        ctx.term()


def _recv(sock: zmq.Socket[bytes]) -> tuple[bytes | None, bytes]:
    parts = sock.recv_multipart(copy=True)
    if len(parts) != 2:
        return None, b""  # not a DEALER/REQ-shaped message: no one to answer
    return parts[0], parts[1]


def _one(server: Server, sock: zmq.Socket[bytes], ident: bytes, frame: bytes, pull_rows: dict[int, Any]) -> None:
    server.requests += 1
    server.bytes_in += len(frame)
    try:
        h, body = wire.decode(frame, max_bytes=server.cfg.max_message_bytes, token=server.digest)
        out = server.handle(h, body)
    except (WireError, ValueError, KeyError, TypeError, MemoryError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        _send(server, sock, ident, _error(_salvage_header(frame), f"{type(e).__name__}: {msg}"))
        return
    if out is None:
        p = server.parked[-1]
        p.ident, p.deadline = ident, time.monotonic() + server.cfg.wait_timeout
        if h.op == Op.PULL:
            pull_rows[id(p)] = np.array(wire.parse_rows(h, body, with_values=False)[0])
        return
    _send(server, sock, ident, wire.encode(*out[:1], *out[1]))


def _retry_parked(server: Server, sock: zmq.Socket[bytes], pull_rows: dict[int, Any]) -> None:
    progress = True
    while progress:  # an APPLY may release pulls, which are parked after it
        progress = False
        for p in list(server.parked):
            out = server.ready(p, pull_rows.get(id(p)))
            if out is None and time.monotonic() < p.deadline:
                continue
            server.parked.remove(p)
            rows = pull_rows.pop(id(p), None)
            del rows
            if out is None:
                msg = (
                    f"TimeoutError: {server.why_waiting(p)} after {server.cfg.wait_timeout:g} s; is a worker dead?"
                )
                _send(server, sock, p.ident, _error(p.head, msg))
            else:
                _send(server, sock, p.ident, wire.encode(out[0], *out[1]))
                progress = True


def _send(server: Server, sock: zmq.Socket[bytes], ident: bytes, frame: bytes) -> None:
    server.bytes_out += len(frame)
    sock.send_multipart([ident, frame])


# --- process wrapper ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """``python -m sparsync.placement.server '<ServerConfig JSON>'``; the token comes from the environment
    (SPARSYNC_PS_TOKEN), not the command line, which other users can read."""
    import json
    import sys

    fields = json.loads((argv or sys.argv[1:])[0])
    fields["token"] = os.environ.get("SPARSYNC_PS_TOKEN") or None
    serve(ServerConfig(**fields), ready=lambda a: print(a, flush=True))


class ServerProcess:
    """A server in its own OS process. ``start()`` returns its address; ``kill()`` simulates a crash (SIGKILL);
    ``restart()`` starts a fresh process on the same port, which resumes from its checkpoint."""

    def __init__(self, cfg: ServerConfig, *, netns: str | None = None) -> None:
        self.cfg = cfg
        self.netns = netns  # run inside this network namespace (sparsync.netem), e.g. colocated with a rank
        self.address: str | None = None
        self._proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 30.0) -> str:
        import json

        fields = {k: v for k, v in asdict(self.cfg).items() if k != "token"}
        if self.netns is None:  # under `ip netns exec` our parent is that command, not this process
            fields["parent_pid"] = os.getpid()
        env = {**os.environ, "SPARSYNC_PS_TOKEN": self.cfg.token or ""}
        src = str(Path(__file__).resolve().parents[2])  # run the same sparsync as this process
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        self._proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "sparsync.placement.server", json.dumps(fields)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline().strip() if ready else ""
        if not line.startswith("tcp://"):
            self.kill()
            err = self._proc.stderr.read() if self._proc.stderr else ""
            raise RuntimeError(
                f"parameter server {self.cfg.server_id} did not start within {timeout} s: {err[-2000:]}"
            )
        self.address = line
        if self.cfg.port == 0:  # keep the port for restart()
            self.cfg = replace(self.cfg, port=int(line.rsplit(":", 1)[1]))
        return line

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(10.0)

    def restart(self) -> str:
        self.kill()
        return self.start()

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def start_servers(n: int, **kw: Any) -> list[ServerProcess]:
    """Start ``n`` servers (one per machine) with the given ServerConfig fields; server ids 0..n-1."""
    if n < 1:
        raise ValueError(f"need at least one server, got {n}")
    procs: list[ServerProcess] = []
    try:
        for i in range(n):
            sp = ServerProcess(ServerConfig(server_id=i, **kw))
            sp.start()
            procs.append(sp)
    except BaseException:
        for sp in procs:
            sp.kill()
        raise
    return procs


if __name__ == "__main__":
    main()
