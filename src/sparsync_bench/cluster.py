"""Emulated hosts: N network namespaces on one shaped bridge, each running k ranks under torchrun.

Each host is one namespace of ``sparsync_bench.netem`` (one veth onto a bridge, both directions shaped by tc tbf).
Its k ranks share the namespace: traffic between them stays on the host's loopback, and traffic between hosts
crosses the host's shaped link, which its k ranks share as a real node's ranks share its NIC. On host i the
command runs exactly as an operator would start it on node i of a cluster::

    torchrun --nnodes N --nproc-per-node k --rdzv-backend c10d --rdzv-endpoint <host 0>:29400 \\
             --rdzv-id <id> --local-addr <host i> [--max-restarts R] script.py args...

with ``GLOO_SOCKET_IFNAME`` naming the host's link (netem-recipe: without it gloo binds loopback and peers on
other hosts cannot connect). Every host's output comes back prefixed ``[host i]``. When one host's torchrun
fails, the others get ``grace`` seconds to fail on their own, then are terminated. Everything is removed on
every exit path, Ctrl-C included: each host's torchrun (its whole session), then every process still inside
a host's namespace (``ip netns pids``: workers that outlived their agent), then the namespaces and links.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sparsync_bench.netem import NetNamespaces, NetSpec

__all__ = ["ClusterResult", "run_cluster", "torchrun_argv"]

RDZV_PORT = 29400  # torchrun's default rendezvous port; inside fresh namespaces nothing else listens


@dataclass
class ClusterResult:
    """Exit status of each host's torchrun (0: every rank of that host succeeded) and each host's output."""

    returncodes: list[int]
    output: list[list[str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    def text(self, host: int) -> str:
        return "\n".join(self.output[host])


def torchrun_argv(
    argv: Sequence[str],
    *,
    host: int,
    hosts: int,
    procs_per_host: int,
    endpoint: str,
    run_id: str,
    address: str,
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line of one host (``argv``: the training script and its arguments)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(hosts),
        "--nproc-per-node", str(procs_per_host),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", run_id,
        # torchrun decides whether this node hosts the rendezvous store by matching the endpoint against the
        # machine's host names, which every namespace shares: say it outright.
        "--rdzv-conf", f"is_host={int(host == 0)}",
        "--local-addr", address,
        "--max-restarts", str(max_restarts),
        *argv,
    ]  # fmt: skip


def rank_threads(ranks: int, cores: int | None = None) -> int:
    """Intra-op threads per rank when ``ranks`` ranks share this machine's ``cores``: the emulated hosts share
    the cores a real host would have to itself. torchrun sets ``OMP_NUM_THREADS=1`` only for more than one
    process per node, so with one rank per host every rank would take every core: on 2 cores, 4 ranks of
    DLRM's script then ran DDP's own allreduce 5-10x slower than on loopback (CPU oversubscription, not the
    link; docs/results_dlrm.md)."""
    total = (os.cpu_count() or 1) if cores is None else cores
    return max(1, total // ranks)


@dataclass(frozen=True)
class _Hosts:
    """How every host's torchrun starts (``run_cluster``'s arguments, checked)."""

    argv: Sequence[str]
    hosts: int
    procs_per_host: int
    max_restarts: int
    env: dict[str, str] | None
    cwd: str | os.PathLike[str] | None
    run_id: str = field(default_factory=lambda: "sparsync" + secrets.token_hex(4))

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.procs_per_host < 1:
            raise ValueError(f"hosts and procs_per_host must be >= 1, got {self.hosts} and {self.procs_per_host}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.argv:
            raise ValueError("nothing to run: give a script (and its arguments)")

    def environment(self, ifname: str) -> dict[str, str]:
        """The environment of the host whose link is ``ifname``."""
        return {
            "OMP_NUM_THREADS": str(rank_threads(self.hosts * self.procs_per_host)),  # unless the user set it
            **os.environ,
            "TORCH_CPP_LOG_LEVEL": "ERROR",
            **(self.env or {}),
            "GLOO_SOCKET_IFNAME": ifname,
            # pytorch/pytorch#135712: with the rendezvous store shared with the workers (torch's default
            # for c10d), a restart keyed by each node's own restart count can read the previous attempt's
            # addresses (gloo: "connectFullMesh failed ... Connection refused"); a fresh store per round.
            **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if self.max_restarts else {}),
            "PYTHONUNBUFFERED": "1",
        }

    def start(self, ns: NetNamespaces, i: int) -> subprocess.Popen[str]:
        """Host ``i``'s torchrun, started in its namespace of ``ns``, stdout and stderr on one pipe."""
        cmd = torchrun_argv(
            self.argv, host=i, hosts=self.hosts, procs_per_host=self.procs_per_host,
            endpoint=f"{ns.address(0)}:{RDZV_PORT}", run_id=self.run_id, address=ns.address(i),
            max_restarts=self.max_restarts,
        )  # fmt: skip
        return subprocess.Popen(
            ["ip", "netns", "exec", ns.namespace(i), *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self.environment(ns.ifname(i)),
            cwd=self.cwd,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the hosts in order
        )


def run_cluster(
    argv: Sequence[str],
    *,
    hosts: int,
    procs_per_host: int,
    net: NetSpec,
    max_restarts: int = 0,
    timeout: float | None = None,
    grace: float = 30.0,
    env: dict[str, str] | None = None,
    echo: Callable[[str], None] | None = print,
    cwd: str | os.PathLike[str] | None = None,
) -> ClusterResult:
    """Run ``argv`` (a script and its arguments, as given to torchrun) on ``hosts`` emulated hosts of
    ``procs_per_host`` ranks each, linked by ``net``; return every host's exit status and output.

    ``timeout`` (seconds, None: none) ends the whole run: every host still running is terminated and reports
    exit status 124. ``echo`` receives every output line as it arrives, prefixed ``[host i]`` (None: quiet).
    ``env``: extra environment for every host; ``cwd``: the directory torchrun starts in. Each rank gets
    ``OMP_NUM_THREADS`` = cores / ranks (``rank_threads``) unless the environment sets it.
    """
    spec = _Hosts(argv, hosts, procs_per_host, max_restarts, env, cwd)
    output: list[list[str]] = [[] for _ in range(hosts)]
    with NetNamespaces(hosts, net) as ns:
        procs: list[subprocess.Popen[str]] = []
        readers: list[threading.Thread] = []
        try:
            for i in range(hosts):
                procs.append(spec.start(ns, i))
                t = threading.Thread(target=_pump, args=(procs[-1], i, output[i], echo), daemon=True)
                t.start()
                readers.append(t)
            codes = _wait(procs, timeout, grace)
        finally:
            _stop(procs, [ns.namespace(i) for i in range(hosts)])
            for t in readers:
                t.join(timeout=5)
    return ClusterResult(codes, output)


def _pump(proc: subprocess.Popen[str], host: int, lines: list[str], echo: Callable[[str], None] | None) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        if echo is not None:
            echo(f"[host {host}] {line}")


def _wait(procs: list[subprocess.Popen[str]], timeout: float | None, grace: float) -> list[int]:
    """Wait for every host; after the first failure the rest get ``grace`` seconds, then 124 (timed out)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        if failed:
            end = time.monotonic() + grace
            deadline = end if deadline is None else min(deadline, end)
        if deadline is not None and time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return [124 if p.poll() is None else int(p.returncode) for p in procs]


def _stop(procs: list[subprocess.Popen[str]], namespaces: list[str]) -> None:
    """Terminate each host's torchrun session (torchrun stops its workers on SIGTERM), kill what is left after
    5 s, then kill any process still inside the namespaces. Never raises."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + 5.0
    for p in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
    for name in namespaces:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10)
            for pid in out.stdout.split():
                with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
