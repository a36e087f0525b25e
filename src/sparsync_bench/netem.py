"""A bandwidth-limited "cluster" of local ranks built from Linux network namespaces.

Each of ``P`` ranks gets its own network namespace with one veth link onto a shared
bridge.  Both directions of every link are shaped with ``tc tbf`` (egress on the veth
inside the namespace, and egress of the bridge port, which is the rank's ingress), and
optionally delayed with ``netem``.  Processes join their rank's namespace with
:func:`enter_namespace` and must set ``GLOO_SOCKET_IFNAME`` (see :meth:`NetNamespaces.env`),
otherwise gloo resolves the hostname to 127.0.0.1 inside the namespace and cannot connect.

Everything made here is named with a per-instance prefix and removed again on every exit
path: normal exit, exceptions, SIGINT/SIGTERM inside the ``with`` block, and ``atexit``.
Needs root (see :func:`require_root`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "NetNamespaces",
    "NetSpec",
    "enter_namespace",
    "parse_latency",
    "parse_rate",
    "require_root",
]

CLONE_NEWNET = 0x40000000
_IFNAMSIZ = 15  # Linux interface names are at most 15 characters
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_SUBNETS = range(200, 251)  # second octet of the 10.x.0.0/24 subnet
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def parse_rate(rate: str) -> int:
    """Parse a tc-style rate such as ``"1gbit"`` or ``"1.5gbit"`` into bits per second.

    Only bit units are accepted (``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``; decimal
    multiples, case-insensitive): tc reads ``bps`` and bare numbers as *bytes* per second,
    a classic source of 8x mistakes, so those are rejected.
    """
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", rate.strip().lower())
    if m is None or m.group(2) not in _RATE_UNITS:
        raise ValueError(f"bad rate {rate!r}: expected e.g. '1gbit', '100mbit', '500kbit'")
    bits = round(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if bits <= 0:
        raise ValueError(f"bad rate {rate!r}: must be positive")
    return bits


def parse_latency(latency: str | None) -> float | None:
    """Parse a delay such as ``"1ms"``, ``"200us"`` or ``"0.5ms"`` into seconds (``None`` passes)."""
    if latency is None:
        return None
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", latency.strip().lower())
    if m is None or m.group(2) not in _TIME_UNITS:
        raise ValueError(f"bad latency {latency!r}: expected e.g. '1ms', '200us', '0.5ms'")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


@dataclass(frozen=True)
class NetSpec:
    """Shape of every rank's link.

    Attributes:
        rate: tc rate per direction of each link, e.g. ``"1gbit"``.
        latency: optional one-way delay added per link with netem, e.g. ``"0.5ms"``;
            a message from rank a to rank b is delayed once (on a's egress), so the
            round trip grows by twice this.
    """

    rate: str
    latency: str | None = None

    def __post_init__(self) -> None:
        parse_rate(self.rate)
        parse_latency(self.latency)

    def describe(self) -> str:
        """How a benchmark titles a run on these links."""
        return f"{self.rate} links{f' + {self.latency}' if self.latency else ''} (tc tbf, one netns per rank)"


def net_spec(net: str | None, latency: str | None = None) -> NetSpec | None:
    """The ``--net`` / ``--latency`` options of a command as a NetSpec (None: loopback), checked up front:
    a bad rate, ``--latency`` without ``--net``, or a missing root/iproute2 fails before any work starts."""
    if not net:
        if latency:
            raise ValueError("--latency needs --net")
        return None
    spec = NetSpec(net, latency)
    require_root()
    return spec


def describe(spec: NetSpec | None) -> str:
    return spec.describe() if spec is not None else "loopback"


@contextlib.contextmanager
def shaped(nprocs: int, spec: NetSpec | None) -> Iterator[NetNamespaces | None]:
    """``NetNamespaces(nprocs, spec)`` for a shaped run, nothing (None) for loopback: pass the result on as
    ``launch(..., setup=ns.rank_setup())``."""
    if spec is None:
        yield None
        return
    with NetNamespaces(nprocs, spec) as ns:
        yield ns


def require_root() -> None:
    """Raise unless namespaces can be made here: root, and ``ip`` and ``tc`` on PATH."""
    if os.geteuid() != 0:
        raise PermissionError(
            "--net needs root to create network namespaces (ip netns, tc); run as root or drop --net"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"--net needs the {tool!r} tool (iproute2), not found on PATH")


def enter_namespace(name: str) -> None:
    """Move the calling process into the network namespace ``/var/run/netns/<name>``.

    Call it first thing in a fresh child process, before torch.distributed is
    initialised: setns moves only the calling thread, and threads started later
    inherit its namespace, so earlier threads (and sockets) stay outside.
    """
    path = os.path.join("/var/run/netns", name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(e.errno, f"cannot open network namespace {path}: {e.strerror}") from e
    try:
        # Python 3.11 has no os.setns, so call libc directly.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def _run(*cmd: str) -> str:
    """Run a command; raise RuntimeError with the command and its stderr on failure."""
    try:
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"command failed: {' '.join(cmd)}: {e.stderr.strip()}") from e
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"command failed: {' '.join(cmd)}: {e}") from e
    return proc.stdout


@dataclass(frozen=True)
class NamespaceSetup:
    """A ``launch`` per-rank set-up (``sparsync.launch.RankSetup``) for namespaces made by ``NetNamespaces``:
    picklable, sent to each rank, which calls it first thing."""

    namespaces: tuple[str, ...]
    envs: tuple[dict[str, str], ...]
    store_host: str  # rank 0's address: it serves the rendezvous store inside the namespaces

    @property
    def hosts(self) -> int:
        return len(self.namespaces)

    def __call__(self, host: int) -> dict[str, str]:
        enter_namespace(self.namespaces[host])
        return dict(self.envs[host])


class NetNamespaces:
    """Context manager that builds (and always removes) one namespace per rank.

    Example::

        with NetNamespaces(4, NetSpec("1gbit")) as net:
            # start rank i, which calls enter_namespace(net.namespace(i)) and
            # uses net.env(i) plus init_method=f"tcp://{net.master_addr}:PORT"
            ...
    """

    def __init__(self, nprocs: int, spec: NetSpec, *, prefix: str | None = None) -> None:
        """Name things; nothing is created before ``__enter__``.

        Args:
            nprocs: number of ranks, 1..254 (one /24 subnet).
            spec: link shape.
            prefix: lower-case alphanumeric name prefix, unique per instance so that
                concurrent runs do not clash; default ``"ss"`` plus random hex.
        """
        if not 1 <= nprocs <= 254:
            raise ValueError(f"nprocs must be in 1..254, got {nprocs}")
        prefix = "ss" + secrets.token_hex(3) if prefix is None else prefix
        longest = max(len(f"{prefix}v{nprocs - 1}"), len(f"{prefix}br"))
        if not re.fullmatch(r"[a-z][a-z0-9]*", prefix) or longest > _IFNAMSIZ:
            raise ValueError(
                f"bad prefix {prefix!r}: need [a-z][a-z0-9]* short enough for "
                f"{_IFNAMSIZ}-character interface names with {nprocs} ranks"
            )
        self.nprocs = nprocs
        self.spec = spec
        self.prefix = prefix
        self.bridge = f"{prefix}br"
        self._subnet: int | None = None
        # (kind, name) of everything created, in creation order, so teardown removes
        # exactly what we made and nothing that already existed.
        self._made: list[tuple[str, str]] = []
        self._old_handlers: dict[int, _Handler] = {}
        self._closing = False
        self._pending_signal: int | None = None
        # A forked child inherits this object (and its handlers); only the creating
        # process may tear down.
        self._owner_pid = os.getpid()

    # -- names -----------------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.nprocs:
            raise IndexError(f"rank {rank} out of range for {self.nprocs} ranks")

    def namespace(self, rank: int) -> str:
        """Name of rank's network namespace (under /var/run/netns)."""
        self._check_rank(rank)
        return f"{self.prefix}ns{rank}"

    def ifname(self, rank: int) -> str:
        """Name of the veth interface inside rank's namespace."""
        self._check_rank(rank)
        return f"{self.prefix}v{rank}"

    def _port(self, rank: int) -> str:
        """Name of the bridge-side peer of rank's veth (in the host namespace)."""
        return f"{self.prefix}p{rank}"

    def address(self, rank: int) -> str:
        """IPv4 address of rank (``10.<x>.0.<rank+1>``); known once entered."""
        self._check_rank(rank)
        if self._subnet is None:
            raise RuntimeError("NetNamespaces has not been entered yet: no subnet chosen")
        return f"10.{self._subnet}.0.{rank + 1}"

    @property
    def master_addr(self) -> str:
        """Address of rank 0, to use as MASTER_ADDR / in the tcp:// init method."""
        return self.address(0)

    def env(self, rank: int) -> dict[str, str]:
        """Environment variables rank's process needs for gloo over its veth."""
        return {"GLOO_SOCKET_IFNAME": self.ifname(rank), "MASTER_ADDR": self.master_addr}

    def rank_setup(self) -> NamespaceSetup:
        """What ``launch(..., setup=...)`` runs in each rank: enter its namespace, set its environment."""
        return NamespaceSetup(
            tuple(self.namespace(i) for i in range(self.nprocs)),
            tuple(self.env(i) for i in range(self.nprocs)),
            self.master_addr,
        )

    def _pick_subnet(self) -> int:
        """A 10.x.0.0/24 with x in 200..250 seeded by the prefix and unused on the host."""
        used = set(re.findall(r"inet 10\.(\d+)\.", _run("ip", "-o", "addr")))
        start = zlib.crc32(self.prefix.encode()) % len(_SUBNETS)
        for k in range(len(_SUBNETS)):
            x = _SUBNETS[(start + k) % len(_SUBNETS)]
            if str(x) not in used:
                return x
        raise RuntimeError("no free 10.x.0.0/24 subnet with x in 200..250 on this host")

    # -- setup / teardown -------------------------------------------------------------

    def __enter__(self) -> NetNamespaces:
        """Create bridge, namespaces and shaped links; on failure undo and re-raise."""
        if self._made:
            raise RuntimeError("NetNamespaces is already entered")
        require_root()
        self._owner_pid = os.getpid()
        self._closing = False
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._subnet = self._pick_subnet()
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def _setup(self) -> None:
        rate = parse_rate(self.spec.rate)
        delay = parse_latency(self.spec.latency)
        # tbf needs a bucket of at least rate/HZ; 512 KiB (checked at 1 gbit) or ~4 ms
        # of traffic at faster rates, so the shaper is never the timer's bottleneck.
        burst = max(512 * 1024, rate // 8 // 250)
        tbf = ("tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "100ms")
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.nprocs):
            ns, veth, port = self.namespace(i), self.ifname(i), self._port(i)
            _run("ip", "netns", "add", ns)
            self._made.append(("netns", ns))
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", port)
            # Deleting the host-side port deletes the pair, wherever the veth went.
            self._made.append(("link", port))
            _run("ip", "link", "set", veth, "netns", ns)
            _run("ip", "link", "set", port, "master", self.bridge)
            _run("ip", "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", veth)
            _run("ip", "-n", ns, "link", "set", veth, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Egress of rank i (what it sends), optionally delayed once per message.
            in_ns = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth)
            _run(*in_ns, "root", "handle", "1:", *tbf)
            if delay:
                usec = f"{round(delay * 1e6)}us"
                _run(*in_ns, "parent", "1:1", "handle", "10:", "netem", "delay", usec)
            # Egress of the bridge port is the ingress of rank i (what it receives).
            _run("tc", "qdisc", "add", "dev", port, "root", *tbf)

    def close(self) -> None:
        """Remove everything this instance made; idempotent and never raises."""
        if os.getpid() != self._owner_pid:
            return
        self._closing = True  # signals arriving now are deferred, not raised mid-teardown
        try:
            for kind, name in reversed(self._made):
                cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
                # Best effort: one failed or stuck removal must not keep the rest.
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run(cmd, capture_output=True, timeout=60, check=False)
            self._made.clear()
        finally:
            atexit.unregister(self.close)
            self._restore_signal_handlers()
            self._closing = False
            pending, self._pending_signal = self._pending_signal, None
            if pending is not None:
                signal.raise_signal(pending)  # deliver the deferred signal to the old handler

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Tear down (see :meth:`close`); exceptions from the block propagate."""
        self.close()

    # -- signals ----------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Turn SIGINT/SIGTERM into exceptions so the with-block unwinds and cleans up."""
        if self._closing:
            self._pending_signal = signum
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _install_signal_handlers(self) -> None:
        # Handlers can only be set from the main thread; elsewhere rely on atexit.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # cannot touch handlers here; the main thread's close() will
        for sig, old in self._old_handlers.items():
            # None means a handler set from C that Python cannot reinstall; use default.
            signal.signal(sig, signal.SIG_DFL if old is None else old)
        self._old_handlers.clear()
