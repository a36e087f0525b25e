"""The one async handle type: ``wait()`` returns the result, ``then()`` chains a function."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class Work(Generic[T]):
    """Result of a non-blocking collective. Collectives of one group run in issue order on one background
    worker per group, so per-layer reductions overlap with computation on the caller's thread."""

    def __init__(self, future: Future[T], waited: Callable[[float, float], None] | None = None) -> None:
        self._future = future
        self._waited = waited  # told (start, end) of every wait(): the caller's time on a timeline

    def on_wait(self, waited: Callable[[float, float], None]) -> Work[T]:
        """This handle, telling ``waited(t0, t1)`` (``time.perf_counter()``) how long each ``wait()`` blocked;
        handles chained by ``then()`` tell it too."""
        return Work(self._future, waited)

    @classmethod
    def done(cls, value: T) -> Work[T]:
        f: Future[T] = Future()
        f.set_result(value)
        return cls(f)

    def wait(self, timeout: float | None = None) -> T:
        """Block until the collective finished; re-raises its error on this thread."""
        if self._waited is None:
            return self._future.result(timeout)
        t0 = time.perf_counter()
        try:
            return self._future.result(timeout)
        finally:
            self._waited(t0, time.perf_counter())

    def is_completed(self) -> bool:
        return self._future.done()

    def when_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the work finished, succeeded or failed (``then`` runs only on success)."""
        self._future.add_done_callback(lambda _: fn())

    def then(self, fn: Callable[[T], U]) -> Work[U]:
        out: Future[U] = Future()

        def _chain(f: Future[T]) -> None:
            try:
                out.set_result(fn(f.result()))
            except BaseException as e:  # forwarded to whoever waits on the chained handle
                out.set_exception(e)

        self._future.add_done_callback(_chain)
        return Work(out, self._waited)
