"""How ``launch`` starts its ranks: forked from a forkserver that imported torch and sparsync once, or spawned.

A forked rank is made to look like a spawned one: it adopts the launcher's environment and stdout/stderr as they
are at ``Process.start()`` (it would otherwise have the forkserver's, those of the first launch), numpy's global
generator is reseeded, and it exits when the launcher does: the forkserver, its parent, outlives the launcher
while any forked rank holds the pipe the launcher left it.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.reduction as reduction
import os
import select
import sys
import threading
import time
from typing import Any

# How ranks start: "forkserver" forks each rank from one server process per launcher that imported these modules
# once; "spawn" starts a fresh interpreter per rank, several times slower to start (docs/data/launch_start.md,
# scripts/launch_start.py).
START_METHODS = ("forkserver", "spawn")
_PRELOAD = ("torch", "torch.distributed", "sparsync")
# imported by the forkserver too when the launcher has imported them (``import sparsync`` leaves the sharded
# tables' modules out until their first use: ``sparsync.__getattr__``)
_PRELOAD_IF_USED = ("sparsync.sharding",)


class LauncherStd:
    """The launcher's stdout and stderr as they are at ``Process.start()``, sent to the rank with the process
    (``multiprocessing``'s descriptor passing): a forked rank inherits the forkserver's, which are the
    launcher's when that server started (pytest captures each test's output in its own file, for one)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, Any]]:
        return (_std_fds, (reduction.DupFd(1), reduction.DupFd(2)))


def _std_fds(out: Any, err: Any) -> tuple[int, int]:
    return out.detach(), err.detach()


def adopt(environ: dict[str, str], std: tuple[int, int]) -> None:
    """In a forked rank: the launcher's environment and stdout/stderr as they were at ``Process.start()``, as a
    spawned rank has them; numpy's global generator reseeded when the forkserver had imported it, as a fresh
    import would seed it (else every rank would draw the forkserver's numbers; Python's ``random`` reseeds
    itself after a fork). Then the objects the forkserver made (the imported modules: some 300,000) are frozen
    (``gc.freeze``): the rank's collections, the teardown's ``gc.collect()`` among them, do not walk them."""
    os.environ.clear()
    os.environ.update(environ)
    for fd, target in zip(std, (1, 2), strict=True):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    numpy_random = sys.modules.get("numpy.random")  # imported in the forkserver: its state would be shared
    if numpy_random is not None:
        numpy_random.seed()
    gc.freeze()


def context(start_method: str) -> Any:
    """The ``multiprocessing`` context ranks start from (one of ``START_METHODS``, checked by ``launch``);
    forkserver falls back to spawn where the platform has no forkserver (Windows)."""
    if start_method == "forkserver" and "forkserver" not in mp.get_all_start_methods():
        start_method = "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        used = [m for m in _PRELOAD_IF_USED if m in sys.modules]
        ctx.set_forkserver_preload([*_PRELOAD, *used])  # no effect once this process's forkserver runs
    return ctx


def watch_launcher(pid: int) -> None:
    """Exit when process ``pid`` does: a daemon thread blocked on its pidfd (Linux 5.3+), else polling that the
    pid exists every 0.5 s. Exits at once if it is already gone."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd here: poll
        fd = -1

    def watch() -> None:
        if fd >= 0:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while _exists(pid):
                time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="sparsync-launcher-watchdog", daemon=True).start()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
