"""Flight recorder: each group's last calls, and the file per rank they are written to when a call fails.

A hang or a ``PeerError`` says which call failed on this rank, not what the ranks were doing before, nor
which call each one was in. Like torch's NCCL flight recorder (``TORCH_NCCL_DUMP_ON_TIMEOUT``), every
communicator (``Comm``) notes its call in a ring buffer of its group: the op, the metadata row it sent (call
number, op code, sizes: the fingerprint the ranks compare), the phase it reached, the bytes it moved, when it
started and ended, and how it ended. When a call raises (``PeerError``, a timeout, the ``ValueError`` of a
mismatch), the rank writes every group's ring to ``<dir>/rank<R>.json`` and the error's message gives that
path, with the dead or stuck peer it could identify (``collectives/peers.py``). This module is the ring and its
file; when to write it, and whom to blame, is ``collectives/failure.py``'s.

The ring holds small records only (strings, ints, floats; no tensors): ``SPARSYNC_FLIGHT_CALLS`` of them per
group (default 64, 0 turns the recorder off). The ring lives in the group's state (``group.GroupState``), so it
dies with the group; a group and sparsync's background group over it share one, since a call submitted on the
one runs its transfers on the other. Where the files go: ``SPARSYNC_FLIGHT_DIR``, else
``<tempdir>/sparsync-flight-<run id>`` (``run_id``).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sparsync.collectives import row
from sparsync.collectives.ops import op_name
from sparsync.collectives.traffic import Traffic

DEFAULT_CALLS = 64  # enough for a training step's calls (one per parameter or bucket, and their metadata)


def calls_from_env() -> int:
    """``SPARSYNC_FLIGHT_CALLS``: calls kept per group (0: off); ``DEFAULT_CALLS`` when unset."""
    text = os.environ.get("SPARSYNC_FLIGHT_CALLS", "")
    if not text:
        return DEFAULT_CALLS
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"SPARSYNC_FLIGHT_CALLS must be a whole number >= 0 (0: off), got {text!r}")
    return n


def run_id() -> str:
    """One name per run that every rank of it computes alike: torchrun's ``TORCHELASTIC_RUN_ID``, else
    ``SPARSYNC_RUN_ID`` (``launch`` sets it for its ranks), else the rendezvous port, else this process's id."""
    for key in ("TORCHELASTIC_RUN_ID", "SPARSYNC_RUN_ID"):
        value = os.environ.get(key, "")
        if value and value != "none":
            return value
    port = os.environ.get("MASTER_PORT", "")
    return f"port{port}" if port else f"pid{os.getpid()}"


def flight_dir() -> Path:
    """Where the dumps go: ``SPARSYNC_FLIGHT_DIR``, else ``<tempdir>/sparsync-flight-<run id>``."""
    chosen = os.environ.get("SPARSYNC_FLIGHT_DIR", "")
    return Path(chosen) if chosen else Path(tempfile.gettempdir()) / f"sparsync-flight-{run_id()}"


@dataclass(slots=True)
class FlightEntry:
    """One communicator's call, as the ring keeps it. Fields change while the call runs."""

    id: int  # the ring's count of calls when this one began
    group: str  # torch's name of the group the call communicates on
    op: str  # ``Comm.op``: the operation and its options
    thread: int  # the thread running it (async calls run on the group's queue thread)
    started: float  # time.time(): comparable across the ranks of a host
    traffic: Traffic  # the call's counters (bytes each way, messages; ints only)
    phase: str = ""  # the last named phase entered (``Comm.phase``)
    fingerprint: tuple[int, ...] = ()  # the metadata row this rank sent (its op's layout: collectives/row.py)
    status: str = "running"  # running, done or failed
    ended: float = 0.0
    error: str = ""  # the first line of the error, when failed

    def close(self, status: str, error: BaseException | None, now: float | None = None) -> None:
        """End the call: ``status`` (done or failed), its end time and the first line of ``error``."""
        self.status, self.ended = status, time.time() if now is None else now
        if error is not None:
            self.error = f"{type(error).__name__}: {first_line(error)}"[:300]


class FlightRecorder:
    """A group's last ``calls`` calls (``FlightEntry``), oldest first; ``calls=0`` records nothing."""

    def __init__(self, calls: int | None = None) -> None:
        self.calls = calls_from_env() if calls is None else calls
        self.ring: deque[FlightEntry] = deque(maxlen=max(self.calls, 1))
        self.begun = 0
        # the caller's thread and the queue threads (DistributedOptimizer runs two lanes) record at once
        self.lock = threading.Lock()

    def begin(self, group: str, op: str, traffic: Traffic) -> FlightEntry | None:
        """A new entry for a call starting now (None when the recorder is off)."""
        if not self.calls:
            return None
        with self.lock:
            entry = FlightEntry(self.begun, group, op, threading.get_ident(), time.time(), traffic)
            self.begun += 1
            self.ring.append(entry)
        return entry

    def close_since(self, first: int, status: str, error: BaseException | None) -> None:
        """Close the entries this thread began since the ring's count was ``first`` and are still running."""
        me, now = threading.get_ident(), time.time()
        with self.lock:
            entries = list(self.ring)  # another thread may append while this one closes its own
        for entry in reversed(entries):
            if entry.id < first:
                break
            if entry.thread == me and entry.status == "running":
                entry.close(status, error, now)

    def snapshot(self) -> list[dict[str, object]]:
        """The ring as plain dicts, oldest first (for the dump)."""
        with self.lock:
            entries = list(self.ring)
        return [_as_dict(e) for e in entries]


def _as_dict(e: FlightEntry) -> dict[str, object]:
    tr = e.traffic
    return {
        "id": e.id,
        "group": e.group,
        "op": e.op,
        "phase": e.phase,
        "status": e.status,
        "started": round(e.started, 6),
        "seconds": round((e.ended or time.time()) - e.started, 6),
        "bytes_sent": tr.bytes_sent,
        "bytes_recv": tr.bytes_recv,
        "messages": tr.messages,
        "fingerprint": row.label(e.fingerprint),
        "thread": e.thread,
        "error": e.error,
    }


def dump(groups: dict[str, list[int]], recorders: Iterable[FlightRecorder], rank: int, reason: str) -> Path:
    """Write the rings to ``flight_dir()/rank<rank>.json`` with ``groups`` (each group's name and global ranks;
    a later dump of this rank replaces the file: the ring holds the earlier calls) and return the path."""
    calls = []
    for rec in recorders:
        calls += rec.snapshot()
    calls.sort(key=lambda c: float(c["started"]))  # type: ignore[arg-type]  # a float, set in _as_dict
    for c in calls:
        fp = c["fingerprint"]
        words = list(fp.values()) if isinstance(fp, dict) else fp
        if isinstance(words, list) and len(words) > row.OP:
            c["op_code_name"] = op_name(int(words[row.OP]))
    body = {
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": time.time(),
        "reason": reason,
        "groups": groups,
        "calls": calls,
    }
    path = flight_dir() / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    # One call per line: readable with `less`, parseable with json.
    lines = ",\n  ".join(json.dumps(c) for c in calls)
    head = json.dumps({k: v for k, v in body.items() if k != "calls"})[:-1]
    tmp.write_text(f'{head}, "calls": [\n  {lines}\n]}}\n')
    tmp.replace(path)  # a reader never sees half a file
    return path


def first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else ""
