"""A parameter server in its own OS process: ``ServerProcess`` (start, kill, restart, stop), ``start_servers``
and the process entry point (``python -m sparsync.ps.process``). The server itself is ``server.py``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import IO, Any

from sparsync.ps import wire
from sparsync.ps.machine import default_max_total_bytes
from sparsync.ps.server import ServerConfig, serve
from sparsync.ps.shard import CheckpointError
from sparsync.ps.wire import CurveKeys


def main(argv: list[str] | None = None) -> None:
    """``python -m sparsync.ps.process '<ServerConfig JSON>'``. With auth (the default) the keys come as
    one JSON line on stdin, ``{"secret": <server secret key>, "clients": [<client public keys>]}``: not on the
    command line, which other users can read."""
    logging.basicConfig(format="sparsync parameter server: %(message)s")
    cfg = ServerConfig(**json.loads((argv or sys.argv[1:])[0]))
    keys, clients = None, []
    if cfg.auth:
        given = json.loads(sys.stdin.readline())
        keys, clients = CurveKeys.from_secret(given["secret"]), list(given["clients"])
    try:
        serve(cfg, ready=lambda a: print(a, flush=True), keys=keys, clients=clients)
    except CheckpointError as e:
        raise SystemExit(f"sparsync parameter server {cfg.server_id}: {e}") from None


class ServerProcess:
    """A server in its own OS process. ``start()`` returns its address; ``kill()`` simulates a crash (SIGKILL);
    ``restart()`` starts a fresh process on the same port and keys, which resumes from its checkpoint.

    With ``cfg.auth`` the server gets a keypair of its own (its public key is part of ``address``) and admits
    ``client_keys``, by default the run's (``wire.run_client_keys``: from the environment, else generated and
    put there for the workers started afterwards)."""

    def __init__(
        self,
        cfg: ServerConfig,
        *,
        netns: str | None = None,
        client_keys: CurveKeys | None = None,
        admit: Sequence[str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.netns = netns  # run inside this network namespace (`ip netns exec`), e.g. colocated with a rank
        self.keys = CurveKeys.generate() if cfg.auth else None
        self.client_keys = (client_keys or wire.run_client_keys()) if cfg.auth else None
        # public keys (Z85) admitted: given (every rank of a job, each with its own keypair), else the run's key
        self.admit = (list(admit) if admit is not None else [self.client_keys.public]) if self.client_keys else []
        self.address: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout: float = 30.0) -> str:
        fields = asdict(self.cfg)
        if self.netns is None:  # under `ip netns exec` our parent is that command, not this process
            fields["parent_pid"] = os.getpid()
        env = {k: v for k, v in os.environ.items() if k != wire.CLIENT_KEY_ENV}
        src = str(Path(__file__).resolve().parents[2])  # run the same sparsync as this process
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        if self._log is not None:
            self._log.close()
        # stderr to a file, not a pipe: a pipe no one drains would block a server that logs errors
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  # closed by the next start or kill
        self._proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "sparsync.ps.process", json.dumps(fields)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            if self.keys is not None and self.client_keys is not None:
                self._proc.stdin.write(json.dumps({"secret": self.keys.secret, "clients": self.admit}))
                self._proc.stdin.write("\n")
            self._proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: reported below with its stderr
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline().strip() if ready else ""
        if not line.startswith("tcp://"):
            raise RuntimeError(self._failed_start(timeout, closed=bool(ready)))
        self.address = line
        if self.cfg.port == 0:  # keep the port for restart()
            self.cfg = replace(self.cfg, port=int(wire.split_address(line)[0].rsplit(":", 1)[1]))
        return line

    def _failed_start(self, timeout: float, *, closed: bool) -> str:
        """Why the server gave no address: it exited (its code and last stderr line, e.g. a refused
        checkpoint's reason), or it is still running after ``timeout`` (killed now)."""
        assert self._proc is not None and self._log is not None
        code = None
        if closed:  # its stdout closed: it is exiting, or exited already
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._proc.wait(5.0)
        self.kill()
        self._log.seek(0)
        err = self._log.read()
        name = f"parameter server {self.cfg.server_id}"
        if code is None:
            return f"{name} did not start within {timeout} s: {err[-2000:]}"
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        lines = [ln for ln in err.splitlines() if ln.strip()]
        last = lines[-1] if lines else "(nothing on stderr)"
        return f"{name} {how} before it started: {last[-2000:]}"

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


def start_servers(n: int, *, client_keys: CurveKeys | None = None, **kw: Any) -> list[ServerProcess]:
    """Start ``n`` servers on this machine with the given ServerConfig fields; server ids 0..n-1. With auth
    (the default) they admit ``client_keys``, by default the run's, which this puts in the environment for the
    workers started afterwards (see ``ServerProcess``). Unless ``max_total_bytes`` is given, the default bound
    on tables (half the available memory) is split between the ``n``."""
    if n < 1:
        raise ValueError(f"need at least one server, got {n}")
    kw.setdefault("max_total_bytes", default_max_total_bytes(n))  # they share this machine's memory
    procs: list[ServerProcess] = []
    try:
        for i in range(n):
            sp = ServerProcess(ServerConfig(server_id=i, **kw), client_keys=client_keys)
            sp.start()
            procs.append(sp)
    except BaseException:
        for sp in procs:
            sp.kill()
        raise
    return procs


if __name__ == "__main__":
    main()
