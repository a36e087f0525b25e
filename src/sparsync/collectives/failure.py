"""What happens when a sparsync call fails: its flight entries close as failed, every group's ring is dumped
(``flight.dump``), the peers found dead or stuck are named (``peers.blame``), and both go into the error's
message. ``guard`` wraps every call the group's queue runs (``fifo.submit``); ``on_failure`` serves callers that
catch an error themselves (a bucket's reduction that fails on the queue thread).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sparsync.collectives import peers
from sparsync.collectives.flight import FlightRecorder, dump, first_line

T = TypeVar("T")


def guard(recorder: FlightRecorder, fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` that closes the entries of ``recorder`` its thread began while it ran: done, or failed with the
    error, which then (a ``RuntimeError``, ``ValueError`` or ``TypeError``) gets the dump's path and the blamed
    peer appended to its message (``on_failure``; with the recorder off, the blamed peer only)."""
    recording = bool(recorder.calls)

    def run() -> T:
        first = recorder.begun
        try:
            out = fn()
        except (RuntimeError, ValueError, TypeError) as e:
            if recording:
                recorder.close_since(first, "failed", e)
            on_failure(e, dump_calls=recording)
            raise
        if recording:
            recorder.close_since(first, "done", None)
        return out

    return run


class RefusalError(ValueError):
    """Input refused alike on every rank, in a metadata round, before any payload moved (``meta.NonFiniteError``:
    a NaN or ±Inf the caller asked to refuse). The group is sound, so ``on_failure`` neither dumps the rings nor
    reports this rank failed: under a GradScaler such a refusal is a routine overflow step, which must not leave
    the rank marked as failed for a later error's blame."""


def on_failure(error: BaseException, *, dump_calls: bool = True) -> None:
    """A sparsync call raised ``error``: dump every group's ring, name the peers found dead or stuck
    (``peers.blame``), and append both to the error's message. Never raises: a failed dump must not hide the
    error. A ``RefusalError`` is left as it is."""
    if isinstance(error, RefusalError) or getattr(error, "_sparsync_flight", False):  # or annotated already
        return
    error._sparsync_flight = True  # type: ignore[attr-defined]
    notes = []
    try:
        # A transport error: give a killed peer's process a moment to show as dead. A mismatch names its ranks.
        blamed = peers.blame(str(error), settle=0.5 if isinstance(error, RuntimeError) else 0.0)
        if blamed:
            notes.append(blamed)
        rank = peers.report_failure(f"{type(error).__name__}: {first_line(error)}")
        if dump_calls:
            path = dump(*peers.recorders(), rank, f"{type(error).__name__}: {str(error)[:2000]}")
            notes.append(f"flight recorder: the last calls of rank {rank} are in {path}")
    except Exception as e:  # the user's error matters more than our diagnostics
        notes.append(f"flight recorder: no dump ({type(e).__name__}: {e})")
    if notes:
        _append(error, "\n".join(notes))


def _append(error: BaseException, text: str) -> None:
    """Append ``text`` to ``error``'s message (its single string argument), or as a note where it has none."""
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{text}",)
    else:
        error.add_note(text)
