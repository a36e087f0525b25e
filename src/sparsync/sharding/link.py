"""The transport under a sharded step's stages: ``dist.all_to_all_single`` with split sizes on the tables' group,
what each round put on the wire counted (``Traffic``: bytes per phase, messages, wait time), each round a
``trace.scope`` (a profiler range and an event on the rank's timeline), and the rows' optional lower precision on
the wire (``WIRE``). The stages (``ids``, ``rows``) call it; it calls nothing of theirs.

The rounds run on the caller's group in the caller's thread, as a model's own collective (DLRM's all-to-all):
sparsync's background work (``DistributedOptimizer``'s reductions during backward) runs on a group of its own
and never interleaves with them.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.timeline import tracer
from sparsync.collectives.trace import scope
from sparsync.collectives.traffic import Traffic
from sparsync.record import CommLog, CommRecord

# ``sparsync.shard(rows=...)``: the lower precisions rows and gradient rows may travel in
WIRE: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Link:
    """The all-to-all rounds of one ``sparsync.shard`` call's tables (module doc). ``wire``: the dtype rows and
    gradient rows travel in (``WIRE``; None: the tables' own), each value rounded once on the way. ``log``
    receives a ``CommRecord`` per exchange and direction."""

    def __init__(
        self, group: dist.ProcessGroup, log: CommLog | None = None, wire: torch.dtype | None = None
    ) -> None:
        self.group = group
        self.wire = wire
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.log = log

    def start(
        self,
        send: torch.Tensor,
        send_sizes: list[int],
        recv_sizes: list[int],
        phase: str,
        tally: Traffic,
        split: dict[str, int] | None = None,
        wait: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """One round (split sizes in elements), started: the tensor it fills and the work to wait for (None once
        waited, with ``wait``, or with no peer). Counts what crossed to other ranks under ``phase`` or, given
        ``split``, under its phases (bytes sent each, adding up to the round's), and with ``wait`` the time under
        ``phase`` (else the waiter counts it). Traced as ``shard:<phase>`` (``shard:<phase> start`` when not
        waited for here)."""
        w = send.element_size()
        sent = w * (sum(send_sizes) - send_sizes[self.rank])
        t0 = time.perf_counter()
        work = None
        with scope(tracer(), "shard", f"shard:{phase}" if wait else f"shard:{phase} start", bytes=sent):
            if self.size == 1:
                out = send
            else:
                out = send.new_empty(sum(recv_sizes))
                work = dist.all_to_all_single(
                    out, send.contiguous(), recv_sizes, send_sizes, group=self.group, async_op=True
                )
                if wait:
                    work.wait()
                    work = None
        tally.add(sent, w * (sum(recv_sizes) - recv_sizes[self.rank]), self.size - 1)
        for name, n in (split or {phase: sent}).items():
            tally.phase_bytes[name] = tally.phase_bytes.get(name, 0) + n
        if wait:
            tally.phases[phase] = tally.phases.get(phase, 0.0) + time.perf_counter() - t0
        return out, work

    def rows(
        self,
        send: torch.Tensor,
        send_sizes: list[int],
        recv_sizes: list[int],
        phase: str,
        tally: Traffic,
        verdicts: bool = False,
    ) -> torch.Tensor:
        """A round of row values, waited for, in ``wire`` precision when set, back in ``send``'s dtype.
        ``verdicts``: each block opens with one word that is no row (``rows.with_verdicts``), counted as
        ``header``."""
        wire = send.dtype if self.wire is None else self.wire
        split = None
        if verdicts:
            header_bytes = wire.itemsize * (self.size - 1)
            rows_bytes = wire.itemsize * (sum(send_sizes) - send_sizes[self.rank]) - header_bytes
            split = {phase: rows_bytes, "header": header_bytes}
        got, _ = self.start(send.to(wire), send_sizes, recv_sizes, phase, tally, split, wait=True)
        return got.to(send.dtype)

    def record(self, op: str, tally: Traffic, t0: float, *, nnz_in: int, nnz_out: int) -> None:
        """One ``CommRecord`` of an exchange's direction in ``log``, when a log is attached."""
        if self.log is None:
            return
        self.log.append(
            CommRecord(
                op, "alltoall", self.rank, self.size, 0, nnz_in, nnz_out, tally.bytes_sent, tally.bytes_recv,
                tally.messages, time.perf_counter() - t0, dict(tally.phases), None, dict(tally.phase_bytes),
            )
        )  # fmt: skip
