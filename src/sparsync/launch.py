"""``launch``: run ``fn(rank, *args)`` on a torch.distributed group of local processes, or join torchrun's.

Local mode starts ``nprocs`` processes, forked from a forkserver that imported torch once (a rank starts in
milliseconds instead of the second a fresh interpreter takes to import torch; ``start_method="spawn"`` for
that instead). The parent hosts the rendezvous ``TCPStore`` on 127.0.0.1 at a port the OS picks (no probing
race, nothing reachable from other hosts). A rank that raises makes ``launch`` raise ``LaunchError`` with that
rank's traceback after the other ranks are terminated (then killed); a rank that dies or is stopped is named
with its exit status, whichever rank's error arrives first. No orphans: SIGTERM to the launcher terminates the
ranks first, and a rank exits when the launcher dies, even by SIGKILL.
Under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment) this process joins
torchrun's group instead and runs ``fn`` once, so the same script scales from one machine to many.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]  # re-exported from C++
from torch.distributed.rendezvous import rendezvous

from sparsync.collectives.background import background_group
from sparsync.collectives.fifo import stop_queues
from sparsync.collectives.timeline import write_trace
from sparsync.rank_start import START_METHODS, LauncherStd, adopt, context, watch_launcher


class RankSetup(Protocol):
    """Per-host set-up that ``launch`` runs in each rank before torch.distributed starts (a network namespace to
    enter, environment variables): picklable, since it travels to the spawned ranks. ``hosts``: the hosts it
    sets up (ranks are spread over them, ``procs_per_host`` each); ``store_host``: the address at which rank 0
    serves the rendezvous store, or None for the launcher's own store on 127.0.0.1. Called as
    ``setup(host)`` first thing in each rank of that host; returns the environment variables to set there.
    The benchmarks' network namespaces (``NetNamespaces.rank_setup()``, outside the library) are one."""

    @property
    def hosts(self) -> int: ...

    @property
    def store_host(self) -> str | None: ...

    def __call__(self, host: int) -> Mapping[str, str]: ...


_NETNS_PORT = 29517  # inside freshly made namespaces nothing else listens
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_TERMINATING = (signal.SIGTERM, signal.SIGHUP)  # what the launcher passes on to its ranks before it exits
# Errors a rank raises because a peer failed: another rank's error, if any, is the root cause to report.
_CONSEQUENCES = ("PeerError", "DistBackendError", "DistNetworkError")


class LaunchError(RuntimeError):
    """A rank failed; ``rank``, the ``traceback`` text of the error report and, for a rank that died without
    reporting, its ``exitcode`` (negative: the signal that killed it, as ``multiprocessing`` reports) are
    attached. ``tb_rank``: whose traceback it is, when the failed rank left none and a survivor's is shown."""

    def __init__(
        self, rank: int, message: str, tb: str = "", *, exitcode: int | None = None, tb_rank: int | None = None
    ) -> None:
        who = rank if tb_rank is None else tb_rank
        super().__init__(f"rank {rank} {message}" + (f"\n--- traceback of rank {who} ---\n{tb}" if tb else ""))
        self.rank = rank
        self.traceback = tb
        self.exitcode = exitcode


def group_backend(backend: str) -> str:
    """The backend string ``launch`` initialises with: ``nccl`` becomes ``"cpu:gloo,cuda:nccl"`` (torch's
    convention), so that CUDA payload travels on NCCL and sparsync's metadata rows (host tensors) on gloo over the
    same group (collectives/transport.py); anything else as given."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def use_device(backend: str, rank: int) -> None:
    """One GPU per rank for NCCL (it refuses two ranks on one GPU): the local rank's, as torchrun's
    ``LOCAL_RANK`` says (else ``rank``), modulo the GPUs present. Before ``init_process_group``."""
    if "nccl" not in backend:
        return
    if not torch.cuda.is_available():
        raise ValueError(f"backend={backend!r} needs CUDA, and torch.cuda.is_available() is False here")
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local % torch.cuda.device_count())


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _child(
    rank: int,
    nprocs: int,
    host: str,
    port: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    setup: RankSetup | None,
    host_index: int,
    env: dict[str, str],
    parent: int,
    forked: tuple[dict[str, str], tuple[int, int]] | None,
    fault: str,
) -> None:
    # A fatal signal (SIGSEGV, SIGABRT, ...) writes every thread's Python stack here; the launcher adds it to the
    # LaunchError of a rank that died without reporting.
    fault_file = open(fault, "w")  # noqa: SIM115 (held open for the life of the rank: faulthandler writes to it)
    faulthandler.enable(file=fault_file, all_threads=True)
    if forked is None:
        _die_with(parent)
    else:  # our parent is the forkserver, which outlives the launcher while a forked rank holds its pipe
        watch_launcher(parent)
        _die_with(os.getppid())
    try:
        if forked is not None:
            adopt(*forked)
        if setup is not None:  # first: before torch starts threads (setns moves the calling thread only)
            os.environ.update(setup(host_index))
        os.environ.update(env)
        # P processes share the host's cores: one intra-op thread pool each, not P oversubscribed ones.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
        if setup is not None and setup.store_host is not None and rank == 0:
            store = _host_store(host, port, nprocs, timeout)
        else:
            store = TCPStore(host, port, nprocs, is_master=False, timeout=timedelta(seconds=timeout))
        use_device(backend, rank)
        dist.init_process_group(
            group_backend(backend), store=store, rank=rank, world_size=nprocs, timeout=timedelta(seconds=timeout)
        )
        _background()
        try:
            out = fn(rank, *args)
        except BaseException as e:
            # Report first, flushed into the pipe, then tear the group down: destroying it makes the peers fail
            # at once, and their PeerErrors must not reach the parent ahead of this root cause.
            results.put(("err", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            results.close()
            results.join_thread()
            _teardown(wait=False)
            return
        _teardown(wait=True)
        # Plain pickle bytes: torch's queue pickler would share tensors by file descriptor, which dies with
        # this process.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException as e:  # reported to the parent, which raises it as LaunchError
        results.put(("err", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _teardown(*, wait: bool) -> None:
    """Orderly end of a rank: fn's leftover objects in reference cycles (autograd graphs holding gloo work)
    are freed, sparsync's queue threads joined (``wait``) or dropped, then every group is destroyed. Left to
    interpreter exit, in whatever order, they aborted 4 of 24 torchrun runs of a ``wrap_optimizer`` training
    ("terminate called without an active exception")."""
    gc.collect()
    stop_queues(wait=wait)
    write_trace()  # SPARSYNC_TRACE's timeline, while the world group that holds it lives (no atexit here)
    dist.destroy_process_group()


def _die_with(parent: int) -> None:
    """Make this rank exit when the launcher (pid ``parent``) dies, even by SIGKILL: a launcher killed while its
    ranks ran left every rank running (3 of 3 runs). On Linux the kernel sends SIGKILL
    (PR_SET_PDEATHSIG) when the *thread* that spawned us exits; ``launch`` blocks in that thread until its ranks
    are reaped, so that is the launcher's death. Elsewhere, or if prctl fails, a daemon thread polls the
    parent pid. A forked rank dies with its forkserver this way, and waits on the launcher itself
    (``rank_start.watch_launcher``)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            ok = False
        if ok:
            if os.getppid() != parent:  # died before the signal was armed: we were already re-parented
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="sparsync-parent-watchdog", daemon=True).start()


def _host_store(host: str, port: int, world_size: int, timeout: float) -> TCPStore:
    """The rendezvous store's server, listening on ``host`` only. torch's TCPStore server listens on every
    interface (``*:port``, measured with ``ss -ltn`` on torch 2.13) and has no authentication; given a socket
    bound by us (``master_listen_fd``) it serves on that one. ``port`` 0: the OS picks a free port."""
    sock = socket.create_server((host, port), backlog=128)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here: it closes it when destroyed
    try:
        return TCPStore(
            host,
            bound,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def launch(
    fn: Callable[..., Any],
    *,
    nprocs: int,
    backend: str = "gloo",
    args: tuple[Any, ...] = (),
    timeout: float = 120.0,
    procs_per_host: int | None = None,
    setup: RankSetup | None = None,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks joined in a process group; return their results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function). ``backend``: ``"gloo"`` (CPU tensors, and
    CUDA tensors through host memory) or ``"nccl"`` (one GPU per rank, ``torch.cuda.set_device`` done; the group
    is ``"cpu:gloo,cuda:nccl"``, so host tensors still work). ``timeout`` (seconds) bounds every
    collective: a dead or stuck peer makes the others fail with a message instead of hanging. ``setup`` runs
    in each rank first (``RankSetup``: e.g. an environment per emulated host, or a network namespace to enter).
    Under torchrun, joins that group and returns ``[fn(rank, *args)]`` for this process only; ``nprocs`` must
    then equal torchrun's ``WORLD_SIZE`` (ValueError naming both otherwise).
    ``procs_per_host``: emulate hosts of that many ranks (ranks [h·k, (h+1)·k) on host h): each rank gets
    torchrun's ``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
    (``collectives.hierarchical.detect_topology`` reads them), and with ``setup`` (one host each) the ranks of
    a host share its set-up (a namespace and its link). ``start_method``: ``"forkserver"`` (ranks forked from a
    server process that imported torch and sparsync once; each rank gets the environment, stdout and stderr this
    process has at the call, as a spawned one would) or ``"spawn"`` (a fresh interpreter per rank).

    Failures raise ``LaunchError``: a rank that died without reporting, or is stopped, is named with its exit
    status ahead of the errors the others raise because of it. The ranks exit if this process dies (even by
    SIGKILL); SIGTERM or SIGHUP here while they run terminates them, then ends this process as the signal asks.

    Example::

        >>> def work(rank, n):
        ...     return rank * n
        >>> launch(work, nprocs=3, args=(10,))
        [0, 10, 20]
    """
    _check_launch(nprocs, procs_per_host, setup, start_method)
    if under_torchrun():
        return _join_torchrun(fn, args, backend, timeout)
    try:
        with _signals_raise(_TERMINATING):
            return _spawn(fn, nprocs, backend, args, timeout, setup, procs_per_host, start_method)
    except _Terminated as t:
        # The ranks are gone (_spawn reaped them); now end as the signal asked, by the caller's own handler.
        signal.raise_signal(t.signum)
        raise SystemExit(128 + t.signum) from None  # the caller's handler returned: there is nothing to return


def _check_launch(nprocs: int, procs_per_host: int | None, setup: RankSetup | None, start_method: str) -> None:
    """``launch``'s checks of its arguments, before anything starts (ValueError naming the bad value)."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != nprocs:
        # torchrun decides the world; a differing nprocs would run fn on another number of ranks than the
        # script says, silently.
        world = int(os.environ["WORLD_SIZE"])
        raise ValueError(
            f"launch(nprocs={nprocs}) under torchrun, whose world has WORLD_SIZE={world} processes: pass "
            f"nprocs={world}, or start torchrun with {nprocs} processes in all (--nnodes x --nproc-per-node)"
        )
    hosts = nprocs if procs_per_host is None else nprocs // max(procs_per_host, 1)
    if procs_per_host is not None and (procs_per_host < 1 or nprocs % procs_per_host):
        raise ValueError(f"procs_per_host={procs_per_host} does not divide nprocs={nprocs}")
    if setup is not None and setup.hosts != hosts:
        raise ValueError(f"setup has {setup.hosts} hosts for {hosts} hosts of {nprocs // hosts} ranks")


def _join_torchrun(fn: Callable[..., Any], args: tuple[Any, ...], backend: str, timeout: float) -> list[Any]:
    """``launch`` under torchrun: ``[fn(rank, *args)]`` in this process, on torchrun's group (joined here
    unless the caller already made a group)."""
    owned = not dist.is_initialized()
    if owned:
        use_device(backend, int(os.environ["RANK"]))
        _init_torchrun_group(group_backend(backend), timedelta(seconds=timeout))
        _background()
    finished = False
    try:
        out = [fn(dist.get_rank(), *args)]
        finished = True
        return out
    finally:
        if owned:  # a group we made is ours to tear down; one the caller made stays theirs
            _teardown(wait=finished)
        else:  # the caller's group lives on, but fn's leftovers and sparsync's threads go now
            gc.collect()
            stop_queues(wait=finished)
            write_trace()


def _init_torchrun_group(backend: str, timeout: timedelta) -> None:
    """Join torchrun's world as the default group, under store keys of this call's own.

    torchrun's agent store outlives a group, and a default group made again after ``destroy_process_group``
    writes the same keys (torch restarts its group count; pytorch/pytorch#55967). So a second ``launch`` in
    one torchrun script could read a peer's address from the first group's keys: gloo's connectFullMesh was
    refused, or the ranks hung (2 of 3 runs of four ``launch`` calls here). Each call's keys sit under
    ``sparsync/launch/<n>/``, ``n`` counted in the store itself: every rank adds 1 per call, and no rank can add
    for call ``n + 1`` before every rank has added for call ``n`` (its group needs them all), so
    ``(count - 1) // world`` is ``n`` on every rank."""
    store, rank, world = next(rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    call = (store.add("sparsync/launch/calls", 1) - 1) // world
    prefixed = PrefixStore(f"sparsync/launch/{call}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)


def _spawn(
    fn: Callable[..., Any],
    nprocs: int,
    backend: str,
    args: tuple[Any, ...],
    timeout: float,
    setup: RankSetup | None,
    procs_per_host: int | None = None,
    start_method: str = "forkserver",
) -> list[Any]:
    # Children inherit the environment at spawn: keep c10d's per-socket warnings (hostname lookups that fail
    # inside network namespaces) out of the user's terminal unless asked for.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = context(start_method)
    forked = ctx.get_start_method() == "forkserver"
    results = ctx.Queue()
    host, port, store = _rendezvous(setup, nprocs, timeout)
    envs = _rank_envs(nprocs, setup, procs_per_host)
    procs = []
    faults = tempfile.TemporaryDirectory(prefix="sparsync-launch-")
    try:
        k = procs_per_host or 1
        for rank in range(nprocs):
            p = ctx.Process(
                target=_child,
                args=(
                    rank,
                    nprocs,
                    host,
                    port,
                    backend,
                    timeout,
                    fn,
                    args,
                    results,
                    setup,
                    rank // k,
                    envs[rank],
                    os.getpid(),
                    (dict(os.environ), LauncherStd()) if forked else None,
                    _fault_path(faults.name, rank),
                ),
                daemon=False,
            )
            p.start()
            procs.append(p)
        out = _collect(procs, results, nprocs, faults.name)
    except BaseException:
        _reap(procs, grace=0.5)  # the others may be blocked on the failed rank: don't wait for them
        raise
    finally:
        del store
        faults.cleanup()
    _reap(procs, grace=30.0)
    return out


def _rendezvous(setup: RankSetup | None, nprocs: int, timeout: float) -> tuple[str, int, TCPStore | None]:
    """(host, port) of the rendezvous store and the store itself when this process serves it (keep it alive
    until the ranks are done); None when rank 0 serves it at ``setup.store_host``."""
    if setup is None or setup.store_host is None:
        host = "127.0.0.1"  # every rank is on this host: nothing needs the store from outside
        store = _host_store(host, 0, nprocs + 1, timeout)
        return host, store.port, store
    return setup.store_host, _NETNS_PORT, None  # rank 0 hosts it (e.g. inside the namespaces)


def _rank_envs(nprocs: int, setup: RankSetup | None, procs_per_host: int | None) -> list[dict[str, str]]:
    """The environment variables each rank sets on top of the launcher's: the run id, the emulated host's
    torchrun variables with ``procs_per_host``, and without ``setup`` gloo on loopback."""
    # gloo listens on the address the host name resolves to, which may face the network; every rank is on this
    # host, so loopback serves (unless the caller chose an interface).
    local = {"GLOO_SOCKET_IFNAME": "lo"} if sys.platform.startswith("linux") else {}
    local = {} if "GLOO_SOCKET_IFNAME" in os.environ else local
    # One flight-recorder directory per launch (collectives/flight.py), named alike by every rank.
    run = os.environ.get("SPARSYNC_RUN_ID") or f"launch{os.getpid()}-{time.time_ns() // 1000}"
    k = procs_per_host or 1
    envs = []
    for rank in range(nprocs):
        env = {} if setup is not None else dict(local)
        env["SPARSYNC_RUN_ID"] = run
        if procs_per_host is not None:
            env.update(GROUP_RANK=str(rank // k), LOCAL_RANK=str(rank % k), LOCAL_WORLD_SIZE=str(k))
        envs.append(env)
    return envs


def _background() -> None:
    """sparsync's own group beside the world group, made now while every rank is at the same point: made
    later, at the first async call, its connection setup could meet a rank busy in a collective of the
    caller's and wait for it (``collectives.allreduce.comm_group``)."""
    if dist.get_world_size() > 1:
        background_group()


class _Terminated(BaseException):
    """The launcher got a terminating signal (raised in its main thread by ``_signals_raise``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


@contextmanager
def _signals_raise(signums: tuple[signal.Signals, ...]) -> Iterator[None]:
    """While inside, ``signums`` raise ``_Terminated`` in the main thread (once: a second signal while the
    ranks are being reaped is dropped), so ``launch`` terminates its ranks before the process ends; the
    previous handlers are restored on the way out. Signals the caller ignores stay ignored, and off the main
    thread (where Python cannot set handlers) nothing changes: the ranks' parent-death signal still holds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if not fired:
            fired.append(signum)
            raise _Terminated(signum)

    previous = {}
    for sig in signums:
        old = signal.getsignal(sig)
        if old in (signal.SIG_IGN, None):  # ignored, or a handler installed from C: leave it
            continue
        previous[sig] = old
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _collect(procs: list[Any], results: Any, nprocs: int, faults: str) -> list[Any]:
    """Every rank's result, in rank order; the first failure raises ``LaunchError`` (see ``_failure``; a rank
    killed by a signal has its stacks in the folder ``faults``)."""
    out: dict[int, Any] = {}
    seen: set[int] = set()  # ranks that reported, a result or an error
    errors: list[tuple[int, str]] = []
    while len(out) < nprocs:
        _read(results, out, seen, errors, wait=0.2)
        gone = [r for r, p in enumerate(procs) if r not in seen and p.exitcode is not None]
        if errors or gone:
            _read(results, out, seen, errors, wait=0.3, until_quiet=True)  # reports still in the pipe
            failure = _failure(procs, seen, errors, faults)
            if failure is not None:
                raise failure
    return [out[r] for r in range(nprocs)]


def _read(
    results: Any, out: dict[int, Any], seen: set[int], errors: list[tuple[int, str]], *, wait: float,
    until_quiet: bool = False,
) -> None:  # fmt: skip
    """One report (waiting up to ``wait`` s for it), or with ``until_quiet`` every report until none comes for
    ``wait`` s."""
    while True:
        try:
            status, rank, payload = results.get(timeout=wait)
        except queue.Empty:
            return
        seen.add(rank)
        if status == "err":
            errors.append((rank, payload))
        else:
            out[rank] = pickle.loads(payload)
        if not until_quiet:
            return


def _failure(procs: list[Any], seen: set[int], errors: list[tuple[int, str]], faults: str) -> LaunchError | None:
    """The error to raise, naming the root cause whichever report came first: a rank that died without
    reporting (its exit code or signal) or one that is stopped goes before the errors its peers then raised,
    which name it only sometimes (12 of 32 PeerErrors after a kill -9); else the first error that
    is not a peer's failure, else the first error. The stacks of a rank a signal killed (faulthandler's, from
    ``faults``) come with its error."""
    culprits: list[tuple[int, str, int | None]] = []
    for r, p in enumerate(procs):
        if r in seen:
            continue
        if p.exitcode is not None:
            culprits.append((r, _describe_exit(p.exitcode), p.exitcode))
        elif _stopped(p.pid):
            culprits.append((r, "is stopped (SIGSTOP, or held by a debugger) and never answered", None))
    if culprits:
        rank, what, code = culprits[0]
        message = what + "".join(f"; rank {r} {w}" for r, w, _ in culprits[1:])
        stacks = _fault_stacks(faults, rank)
        if not errors:
            return LaunchError(rank, message + stacks, exitcode=code)
        first, tb = errors[0]
        message += f"; then rank {first} failed: {tb.splitlines()[0] if tb else ''}" + stacks
        return LaunchError(rank, message, tb, exitcode=code, tb_rank=first)
    if errors:
        rank, tb = next((e for e in errors if not e[1].startswith(_CONSEQUENCES)), errors[0])
        return LaunchError(rank, "failed", tb)
    return None


def _fault_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.fault")


def _fault_stacks(folder: str, rank: int) -> str:
    """What faulthandler wrote for ``rank`` when a fatal signal hit it (every thread's Python stack), as a
    paragraph of the error message; empty when it wrote nothing."""
    try:
        with open(_fault_path(folder, rank)) as f:
            text = f.read().strip()
    except OSError:
        return ""
    return f"\n--- rank {rank}'s Python stacks at the signal (faulthandler) ---\n{text}" if text else ""


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"died with signal {-code} ({name}) without reporting"
    return f"exited with code {code} without reporting"


def _stopped(pid: int | None) -> bool:
    """Linux: the process is in the stopped or traced state (``/proc/<pid>/stat``); False where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _reap(procs: list[Any], grace: float) -> None:
    """Join, then terminate, then kill whatever is left: no orphans."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            if hasattr(signal, "SIGCONT"):  # a stopped rank acts on SIGTERM only once continued
                with suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join()
