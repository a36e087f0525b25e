"""Flight recorder: each group's last calls, written to a file per rank when a call fails.

A hang or a ``PeerError`` says which call failed on this rank, not what the ranks were doing before, nor
which call each one was in. Like torch's NCCL flight recorder (``TORCH_NCCL_DUMP_ON_TIMEOUT``), every
communicator (``Comm``) notes its call in a ring buffer of its group: the op, the metadata row it sent (call
number, op code, sizes: the fingerprint the ranks compare), the phase it reached, the bytes it moved, when it
started and ended, and how it ended. When a call raises (``PeerError``, a timeout, the ``ValueError`` of a
mismatch), the rank writes every group's ring to ``<dir>/rank<R>.json`` and the error's message gives that
path, with the dead or stuck peer it could identify (``collectives/peers.py``).

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from sparsync.collectives.comm import Traffic

T = TypeVar("T")

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
    fingerprint: tuple[int, ...] = ()  # the metadata row this rank sent (collectives/meta.py's columns)
    status: str = "running"  # running, done or failed
    ended: float = 0.0
    error: str = ""  # the first line of the error, when failed

    def close(self, status: str, error: BaseException | None, now: float | None = None) -> None:
        """End the call: ``status`` (done or failed), its end time and the first line of ``error``."""
        self.status, self.ended = status, time.time() if now is None else now
        if error is not None:
            self.error = f"{type(error).__name__}: {_first_line(error)}"[:300]


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

    def guard(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` that closes the entries its thread began while it ran: done, or failed with the error, which
        then (a ``RuntimeError``, ``ValueError`` or ``TypeError``) gets the dump's path and the blamed peer
        appended to its message (``on_failure``; with the recorder off, the blamed peer only)."""
        recording = bool(self.calls)

        def run() -> T:
            first = self.begun
            try:
                out = fn()
            except (RuntimeError, ValueError, TypeError) as e:
                if recording:
                    self._close(first, "failed", e)
                on_failure(e, dump_calls=recording)
                raise
            if recording:
                self._close(first, "done", None)
            return out

        return run

    def _close(self, first: int, status: str, error: BaseException | None) -> None:
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
        "fingerprint": _labelled(e.fingerprint),
        "thread": e.thread,
        "error": e.error,
    }


def _labelled(row: tuple[int, ...]) -> dict[str, int] | list[int]:
    """The metadata row with meta.py's column names when it is a sparse collective's (every op shares the call
    number and op code columns; the layers above lay out the rest their own way)."""
    from sparsync.collectives import meta  # here: meta imports the communicator, which imports this module

    if len(row) > 1 and row[1] in (meta.SPARSE_ALLREDUCE, meta.SPARSE_ALLGATHER):
        return dict(zip(meta.field_names(), row, strict=False))
    return list(row)


def dump(groups: dict[str, list[int]], recorders: Iterable[FlightRecorder], rank: int, reason: str) -> Path:
    """Write the rings to ``flight_dir()/rank<rank>.json`` with ``groups`` (each group's name and global ranks;
    a later dump of this rank replaces the file: the ring holds the earlier calls) and return the path."""
    from sparsync.collectives.ops import op_name

    calls = []
    for rec in recorders:
        calls += rec.snapshot()
    calls.sort(key=lambda c: float(c["started"]))  # type: ignore[arg-type]  # a float, set in _as_dict
    for c in calls:
        fp = c["fingerprint"]
        row = list(fp.values()) if isinstance(fp, dict) else fp
        if isinstance(row, list) and len(row) > 1:
            c["op_code_name"] = op_name(int(row[1]))
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


def on_failure(error: BaseException, *, dump_calls: bool = True) -> None:
    """A sparsync call raised ``error``: dump every group's ring, name the peers found dead or stuck
    (``peers.blame``), and append both to the error's message. Never raises: a failed dump must not hide the
    error."""
    from sparsync.collectives import peers  # here: peers reads the group table, which imports this module

    if getattr(error, "_sparsync_flight", False):  # already annotated (an inner call's guard)
        return
    error._sparsync_flight = True  # type: ignore[attr-defined]
    notes = []
    try:
        # A transport error: give a killed peer's process a moment to show as dead. A mismatch names its ranks.
        blamed = peers.blame(str(error), settle=0.5 if isinstance(error, RuntimeError) else 0.0)
        if blamed:
            notes.append(blamed)
        rank = peers.report_failure(f"{type(error).__name__}: {_first_line(error)}")
        if dump_calls:
            path = dump(*peers.recorders(), rank, f"{type(error).__name__}: {str(error)[:2000]}")
            notes.append(f"flight recorder: the last calls of rank {rank} are in {path}")
    except Exception as e:  # the user's error matters more than our diagnostics
        notes.append(f"flight recorder: no dump ({type(e).__name__}: {e})")
    if notes:
        _append(error, "\n".join(notes))


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else ""


def _append(error: BaseException, text: str) -> None:
    """Append ``text`` to ``error``'s message (its single string argument), or as a note where it has none."""
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{text}",)
    else:
        error.add_note(text)
