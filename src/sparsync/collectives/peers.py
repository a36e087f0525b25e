"""Which peer died or is stuck: rank, pid and TCP endpoints of every rank, published in the rendezvous store.

gloo's error names the address of the pair that broke (``Read error [127.0.0.1]:23789``), not a rank, and
a torch collective's error names neither; under ``launch`` the launcher names the dead rank, under torchrun
nobody did (0 of 3 survivors). So each rank publishes, at the first call on each of its groups, its pid, host
and the local endpoints of its TCP sockets (gloo's pairs among them) under ``sparsync/peer/<rank>`` in the
default group's store (which the launcher or torchrun's agent hosts: it outlives a killed rank). A failing
rank then reads the others' entries and names (``blame``):

- a rank on this host whose process is gone or a zombie ("died") or stopped (SIGSTOP, a debugger), unless it
  reported a failure of its own first (``report_failure``): that one failed because of another;
- the rank whose endpoint the transport's error names.

A rank on another host can only be named by its endpoint. Everything here runs once per group at its first
call, or after a failure; nothing on the call path.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from contextlib import suppress

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from sparsync.collectives import group as _group
from sparsync.collectives.flight import FlightRecorder

_PEER = "sparsync/peer/"
_FAILED = "sparsync/failed/"
# gloo writes "[ip]:port" (IPv6 inside the brackets too); torch's own messages "ip:port".
_ENDPOINT = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)|\b(\d{1,3}(?:\.\d{1,3}){3}):(\d+)")


def _store() -> c10d.Store | None:
    try:
        return c10d._get_default_store()  # private in torch 2.13; the store the world group rendezvoused on
    except (AttributeError, RuntimeError, ValueError):
        return None


def publish() -> None:
    """Publish this rank's pid, host and TCP endpoints (again at each group's first call: that group's pairs
    exist by then). Errors are swallowed: naming peers is a diagnostic, never a reason to fail a call."""
    store = _store()
    if store is None:
        return
    try:
        entry = {"pid": os.getpid(), "host": socket.gethostname(), "endpoints": sorted(_endpoints())}
        store.set(_PEER + str(dist.get_rank()), json.dumps(entry))
    except (OSError, RuntimeError, ValueError):
        pass


def _endpoints() -> set[str]:
    """``ip:port`` of every TCP socket this process holds (Linux /proc for the descriptors; empty elsewhere).
    Asked of each socket (getsockname), not read from /proc/net/tcp, which lists the whole host's sockets
    (slow on a busy host)."""
    out: set[str] = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=int(fd))
        except (OSError, ValueError):
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                ip, port = sock.getsockname()[:2]
                out.add(f"{ip[7:] if ip.startswith('::ffff:') else ip}:{port}")
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays its owner's
    return out


def report_failure(first_line: str) -> int:
    """Tell the other ranks this rank failed (so it is not blamed as the cause when it exits); this rank's
    global rank (-1 outside a group)."""
    if not dist.is_initialized():
        return -1
    rank = dist.get_rank()
    store = _store()
    if store is not None:
        with suppress(OSError, RuntimeError, ValueError):
            store.set(_FAILED + str(rank), first_line[:300])
    return rank


def blame(error: str, *, settle: float = 0.0) -> str:
    """The peers to blame for ``error`` (a transport error's text) as a sentence, or "" when none is found.
    ``settle``: seconds to keep looking for a dead or stopped rank (a killed peer's sockets close before its
    process is marked as exiting, so the first look may come too early)."""
    store = _store()
    if store is None or not dist.is_initialized():
        return ""
    me, host = dist.get_rank(), socket.gethostname()
    table: dict[int, dict[str, object]] = {}
    try:
        for r in range(dist.get_world_size()):
            if r != me and store.check([_PEER + str(r)]):
                table[r] = json.loads(store.get(_PEER + str(r)))
    except (OSError, RuntimeError, ValueError):
        return ""
    deadline = time.monotonic() + settle
    while True:
        found = []
        for r, entry in table.items():
            state = _process_state(entry, host)
            if state and not _reported(store, r):
                found.append(f"rank {r} (pid {entry['pid']}) {state}")
        if found or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    named = _endpoint_owners(error, table)
    if named:
        found.append("the lost connection was to " + ", ".join(f"rank {r} ({ep})" for r, ep in named))
    return "; ".join(found)


_PF_EXITING = 0x4  # <linux/sched.h>: the task is exiting (set before its sockets close)


def _process_state(entry: dict[str, object], host: str) -> str:
    """How a rank's process is, when it runs on this host and is not running: "died ..." or "is stopped"."""
    if entry.get("host") != host:
        return ""
    pid = entry.get("pid")
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        state, flags = fields[0], int(fields[6])
    except FileNotFoundError:
        return "died (its process is gone) without reporting an error"
    except (OSError, IndexError, ValueError):
        return ""
    if state in ("Z", "X") or flags & _PF_EXITING:
        return "died without reporting an error"
    if state in ("T", "t"):
        return "is stopped (SIGSTOP, or held by a debugger)"
    return ""


def _reported(store: c10d.Store, rank: int) -> bool:
    try:
        return bool(store.check([_FAILED + str(rank)]))
    except (OSError, RuntimeError, ValueError):
        return False


def _endpoint_owners(error: str, table: dict[int, dict[str, object]]) -> list[tuple[int, str]]:
    owners = []
    for m in _ENDPOINT.finditer(error):
        ip, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        # gloo 2.13's pair errors print the port in network byte order (23789 for the socket's 60764): try both
        p = int(port)
        for ep in (f"{ip}:{p}", f"{ip}:{((p & 0xFF) << 8) | (p >> 8)}"):
            for r, entry in table.items():
                endpoints = entry.get("endpoints")
                if isinstance(endpoints, list) and ep in endpoints and (r, ep) not in owners:
                    owners.append((r, ep))
    return owners


def recorders() -> tuple[dict[str, list[int]], list[FlightRecorder]]:
    """Every live group's name and global ranks, and every recorder once (a group and its background group
    share one)."""
    groups: dict[str, list[int]] = {}
    found: dict[int, FlightRecorder] = {}
    for g, state in _group.states():
        found.setdefault(id(state.flight), state.flight)
        try:
            groups[g.group_name] = dist.get_process_group_ranks(g)
        except (RuntimeError, ValueError):  # a group already destroyed
            continue
    return groups, list(found.values())
