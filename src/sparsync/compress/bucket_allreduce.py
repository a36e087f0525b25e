"""The DDP hook's path for a bucket with nothing to compress: DDP's own allreduce, on sparsync's group.

``compression_hook`` sends a dense bucket whose gradients all go by ``Identity`` here once its layout has been
checked (the first time a bucket of that index, size, dtype and device is seen, it goes through
``compressed_allreduce`` and its metadata round). From then on a step costs what DDP's default hook costs
(``default_hooks.allreduce_hook``): one ``dist.all_reduce(bucket.buffer(), async_op=True)`` issued in the hook,
in place, and a future dividing by the world size when it completes. Nothing waits in the hook, so autograd
goes on computing the next buckets while this one is on the wire (DDP's overlap).

Why no metadata round per step: DDP checks its parameters' shapes across ranks when it wraps the model and
rebuilds buckets from rank 0's order, so every rank sees the same sequence of buckets. The per-step round was
one more synchronisation of every rank before the payload could start: on DLRM at P = 4 over loopback it made
the hook's iteration 1.3x DDP's (docs/results_dlrm.md). What it checked per step is kept where it costs no round:
a non-finite average raises the same ValueError on every rank (NaN and ±Inf survive a sum, so every rank sees
the same verdict), and a transport error becomes a ``PeerError`` naming the bucket and the rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives import trace
from sparsync.collectives.comm import PeerError, ring_allreduce_bytes
from sparsync.collectives.failure import on_failure
from sparsync.collectives.fifo import submit
from sparsync.collectives.flight import FlightEntry
from sparsync.collectives.group import group_state, next_call
from sparsync.collectives.meta import first_nonfinite
from sparsync.collectives.timeline import tracer
from sparsync.collectives.traffic import Traffic
from sparsync.compress.hook_future import bucket_future
from sparsync.record import CommLog, CommRecord

BucketKey = tuple[int, int, torch.dtype, str]  # index, numel, dtype, device type


class BucketAllreduce:
    """``bucket -> Future`` for dense buckets sent uncompressed: DDP's own allreduce on ``group``.

    ``group``: sparsync's own group (``background_group(user)``), where sparsync's queues also send. ``user``:
    the group it was made for (async calls on ``user`` queue there and send on ``group``). ``average``: divide
    the sum by the world size when it arrives. ``log``: one CommRecord per bucket.
    """

    def __init__(
        self, group: dist.ProcessGroup, user: dist.ProcessGroup, *, average: bool, log: CommLog | None
    ) -> None:
        self.group = group
        # the queues that send on ``group``: its own, and the user's group's (its async calls)
        self._queues = [(g, group_state(g)) for g in dict.fromkeys((group, user))]
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.average = average
        self.log = log
        self._seen: set[BucketKey] = set()

    def checked(self, bucket: Any) -> bool:
        """Whether a bucket of this layout went through the checked path before; the first call of a layout
        answers False and records it (every rank sees the same sequence of layouts, so every rank takes the
        checked path at the same step)."""
        buffer = bucket.buffer()
        key = (int(bucket.index()), buffer.numel(), buffer.dtype, buffer.device.type)
        if key in self._seen:
            return True
        self._seen.add(key)
        return False

    def __call__(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """Start the allreduce of ``bucket.buffer()`` (written in place) and return its future; never waits.

        While a sparsync queue holds work that sends on the group (a sparse bucket's reduction, another
        compressor's, an async call on the user's group), the allreduce queues behind it, so that every rank
        issues the group's collectives in the same order; otherwise it is issued here, on the autograd thread."""
        buffer = bucket.buffer()
        index = int(bucket.index())
        t0 = time.perf_counter()
        next_call(self.group)  # the group's call count stays in step with the checked path's
        flight = self._queues[0][1].flight
        entry = flight.begin(self.group.group_name, f"DDP hook: allreduce of bucket {index}", Traffic())
        busy = next((g for g, q in self._queues if q.pending > 0), None)  # an int's read: atomic
        with trace.scope(
            tracer(), "hook", "allreduce", bucket=index, numel=buffer.numel(), queued=busy is not None
        ):
            if busy is not None:
                sent = self._queued(busy, buffer)
            else:
                sent = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
        return sent.then(self._finish(index, buffer, t0, entry))

    def _queued(self, queue: dist.ProcessGroup, buffer: torch.Tensor) -> torch.futures.Future[list[torch.Tensor]]:
        fut: torch.futures.Future[list[torch.Tensor]] = bucket_future(buffer)

        def run() -> None:
            try:
                dist.all_reduce(buffer, group=self.group)
            except BaseException as e:  # the hook's future carries it to DDP, which re-raises it in backward()
                fut.set_exception(e)  # type: ignore[arg-type]  # the stub asks for a T
                return
            fut.set_result([buffer])

        submit(queue, run, True, label="hook:allreduce")
        return fut

    def _finish(
        self, index: int, buffer: torch.Tensor, t0: float, entry: FlightEntry | None
    ) -> Callable[[torch.futures.Future[list[torch.Tensor]]], torch.Tensor]:
        def finish(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            try:
                out = done.value()[0]
            except RuntimeError as e:  # gloo reports a dead or timed-out peer as RuntimeError
                err = PeerError(
                    f"DDP hook: allreduce of bucket {index} ({buffer.numel()} values) failed on rank {self.rank} "
                    f"(timed out or a peer died): {e}"
                )
                self._close(entry, "failed", err)
                on_failure(err, dump_calls=entry is not None)
                raise err from e
            if self.average:
                out.div_(self.size)
            if first_nonfinite(out) >= 0:
                bad = ValueError(
                    f"DDP hook: the averaged gradient of bucket {index} holds NaN or ±Inf on every rank (a rank's "
                    "gradient did); check the loss or lower the learning rate"
                )
                self._close(entry, "failed", bad)
                raise bad
            self._close(entry, "done", None)
            if self.log is not None:
                self.log.append(self._record(buffer, t0))
            return out

        return finish

    @staticmethod
    def _close(entry: FlightEntry | None, status: str, error: BaseException | None) -> None:
        if entry is not None:  # None: the recorder is off
            entry.close(status, error)

    def _record(self, buffer: torch.Tensor, t0: float) -> CommRecord:
        P, n = self.size, buffer.numel()
        nbytes = ring_allreduce_bytes(n * buffer.element_size(), P)
        return CommRecord("reduce", "allreduce", self.rank, P, n, n, n, nbytes, nbytes, 2 * (P - 1),
                          time.perf_counter() - t0)  # fmt: skip
