"""``launch``: run ``fn(rank, *args)`` on a torch.distributed group of local processes, or join torchrun's.

Local mode spawns ``nprocs`` processes; the parent hosts the rendezvous ``TCPStore`` on a port the OS picks
(no probing race). A rank that raises makes ``launch`` raise ``LaunchError`` with that rank's traceback after
the other ranks are terminated (then killed): no orphans. Under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
in the environment) this process joins torchrun's group instead and runs ``fn`` once, so the same script scales
from one machine to many.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported from C++

if TYPE_CHECKING:
    from sparsync.netem import NetNamespaces

_NETNS_PORT = 29517  # inside freshly made namespaces nothing else listens


class LaunchError(RuntimeError):
    """A rank failed; ``rank`` and the rank's ``traceback`` text are attached."""

    def __init__(self, rank: int, message: str, tb: str = "") -> None:
        super().__init__(f"rank {rank} {message}" + (f"\n--- traceback of rank {rank} ---\n{tb}" if tb else ""))
        self.rank = rank
        self.traceback = tb


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
    namespace: str | None,
    env: dict[str, str],
) -> None:
    try:
        if namespace is not None:
            from sparsync.netem import enter_namespace

            enter_namespace(namespace)  # before torch starts its threads: setns moves the calling thread only
        os.environ.update(env)
        # P processes share the host's cores: one intra-op thread pool each, not P oversubscribed ones.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
        store = TCPStore(
            host,
            port,
            nprocs,
            is_master=(namespace is not None and rank == 0),
            timeout=timedelta(seconds=timeout),
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=nprocs, timeout=timedelta(seconds=timeout)
        )
        try:
            out = fn(rank, *args)
        except BaseException as e:
            # Report first, flushed into the pipe, then tear the group down: destroying it makes the peers fail
            # at once, and their PeerErrors must not reach the parent ahead of this root cause.
            results.put(("err", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            results.close()
            results.join_thread()
            dist.destroy_process_group()
            return
        gc.collect()  # as under torchrun: fn's leftover gloo work objects go before their group
        dist.destroy_process_group()
        # Plain pickle bytes: torch's queue pickler would share tensors by file descriptor, which dies with
        # this process.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException as e:  # reported to the parent, which raises it as LaunchError
        results.put(("err", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def launch(
    fn: Callable[..., Any],
    *,
    nprocs: int,
    backend: str = "gloo",
    args: tuple[Any, ...] = (),
    timeout: float = 120.0,
    netns: NetNamespaces | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks joined in a process group; return their results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function). ``timeout`` (seconds) bounds every
    collective: a dead or stuck peer makes the others fail with a message instead of hanging. ``netns`` runs
    each rank inside its network namespace (see ``sparsync.netem``). Under torchrun, joins that group and
    returns ``[fn(rank, *args)]`` for this process only.

    Example::

        >>> def work(rank, n):
        ...     return rank * n
        >>> launch(work, nprocs=3, args=(10,))
        [0, 10, 20]
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if under_torchrun():
        owned = not dist.is_initialized()
        if owned:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        try:
            return [fn(dist.get_rank(), *args)]
        finally:
            if owned:  # a group we made is ours to tear down; one the caller made stays theirs
                # Objects of fn's left in reference cycles (autograd graphs holding gloo work) go before
                # their group: freed at interpreter exit after it, they aborted ~1 in 3 torchrun runs of
                # tests/_replicator_torchrun.py ("terminate called without an active exception").
                gc.collect()
                dist.destroy_process_group()
    # Children inherit the environment at spawn: keep c10d's per-socket warnings (hostname lookups that fail
    # inside network namespaces) out of the user's terminal unless asked for.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store: TCPStore | None = None
    if netns is None:
        host = "127.0.0.1"
        store = TCPStore(
            host, 0, nprocs + 1, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
        port = store.port
    else:
        host, port = netns.master_addr, _NETNS_PORT
    procs = []
    for rank in range(nprocs):
        ns = netns.namespace(rank) if netns is not None else None
        env = netns.env(rank) if netns is not None else {}
        p = ctx.Process(
            target=_child,
            args=(rank, nprocs, host, port, backend, timeout, fn, args, results, ns, env),
            daemon=False,
        )
        p.start()
        procs.append(p)
    try:
        out = _collect(procs, results, nprocs)
    except BaseException:
        _reap(procs, grace=0.5)  # the others may be blocked on the failed rank: don't wait for them
        raise
    finally:
        del store
    _reap(procs, grace=30.0)
    return out


def _collect(procs: list[Any], results: Any, nprocs: int) -> list[Any]:
    out: dict[int, Any] = {}
    while len(out) < nprocs:
        try:
            status, rank, payload = results.get(timeout=0.2)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in out and not p.is_alive() and p.exitcode not in (0, None):
                    time.sleep(0.5)  # its error report may still be in flight
                    try:
                        status, r2, payload = results.get(timeout=0.5)
                    except queue.Empty:
                        raise LaunchError(rank, f"exited with code {p.exitcode} without reporting") from None
                    if status == "err":
                        raise LaunchError(r2, "failed", payload) from None
                    out[r2] = pickle.loads(payload)
            continue
        if status == "err":
            raise LaunchError(rank, "failed", payload)
        out[rank] = pickle.loads(payload)
    return [out[r] for r in range(nprocs)]


def _reap(procs: list[Any], grace: float) -> None:
    """Join, then terminate, then kill whatever is left: no orphans."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join()
