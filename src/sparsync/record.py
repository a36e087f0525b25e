"""What a collective reports about itself: bytes per rank, time, algorithm, and the auto decision."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from sparsync.costmodel import Decision

# The op of the records of DistributedOptimizer's agreement rounds (which parameters have a gradient and in which
# layout, the bucket layout, a bucket's header): metadata the ranks agree on, no gradient; their phases say which.
AGREE = "agree"
# The phase of "auto"'s link measurement, in the record of the call that ran it (the first "auto" call on a
# group): one-time traffic, which ``workload_bytes`` leaves out of a step's bytes.
CALIBRATE = "calibrate"


def workload_bytes(record: CommRecord) -> int:
    """The bytes ``record``'s call sent for its own work: ``bytes_sent`` less the one-time link measurement
    (phase ``CALIBRATE``)."""
    return record.bytes_sent - record.phase_bytes.get(CALIBRATE, 0)


@dataclass
class CommRecord:
    """One collective call, as seen by one rank."""

    op: str  # "sparse_allreduce", "sparse_allgather", ...
    algorithm: str  # the algorithm that ran (after "auto" resolved)
    rank: int
    world_size: int
    dim: int
    nnz_in: int  # stored entries of this rank's input
    nnz_out: int  # stored entries of the result (dim when dense)
    bytes_sent: int  # payload + headers this rank put on the wire
    bytes_recv: int
    messages: int
    seconds: float  # wall time of the whole call on this rank, metadata exchange included
    phases: dict[str, float] = field(default_factory=dict)  # named timing scopes, seconds
    decision: Decision | None = None  # set when algorithm="auto"
    phase_bytes: dict[str, int] = field(default_factory=dict)  # bytes sent per named phase ("meta", ...)
    row: int = 1  # values per index of the stream (1: element stream; b: embedding rows of b values)
    partition: str = ""  # split algorithms: "stride" or "range" (collectives/partition.py)
    # Split algorithms: bytes this rank sent to each partition's owner (sum over ranks: each owner's load).
    partition_bytes: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "decision"}
        if self.decision is not None:
            d["predictions"] = dict(self.decision.predictions)
            d["lower_bound"] = self.decision.lower_bound
        return d


class ScalarWriter(Protocol):
    """What ``CommLog.to_tensorboard`` writes to: ``torch.utils.tensorboard.SummaryWriter`` is one; so is any
    object with this method (no tensorboard dependency here)."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


class CommLog:
    """A list of CommRecords the caller passes to collectives (``log=``) to collect what they did."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def append(self, record: CommRecord) -> None:
        self.records.append(record)

    @property
    def last(self) -> CommRecord:
        if not self.records:
            raise IndexError("no collective has been recorded in this CommLog")
        return self.records[-1]

    def total_bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def to_tensorboard(self, writer: ScalarWriter, step: int, *, since: int = 0, prefix: str = "sparsync") -> None:
        """Write the records from index ``since`` on (one step's calls: ``since = len(log)`` taken before the step)
        as scalars at ``step``: ``<prefix>/bytes_sent``, ``bytes_recv``, ``seconds`` (their sums), ``calls``,
        ``predicted_seconds`` (auto's prediction of what it chose, summed over the calls auto decided; with
        ``seconds_auto``, the measured time of those calls) and ``algorithm/<name>`` (calls per algorithm,
        every algorithm seen in the log, zeros included, so a switch shows as one curve falling to 0)."""
        if since < 0:
            raise ValueError(f"since must be >= 0, got {since}")
        records = self.records[since:]
        sums = {
            "bytes_sent": sum(r.bytes_sent for r in records),
            "bytes_recv": sum(r.bytes_recv for r in records),
            "seconds": sum(r.seconds for r in records),
            "calls": len(records),
        }
        decided = [r for r in records if r.decision is not None]
        if decided:
            sums["predicted_seconds"] = sum(r.decision.predictions[r.algorithm] for r in decided if r.decision)
            sums["seconds_auto"] = sum(r.seconds for r in decided)
        for tag, value in sums.items():
            writer.add_scalar(f"{prefix}/{tag}", value, step)
        counts = Counter(r.algorithm for r in records)
        for alg in sorted({r.algorithm for r in self.records}):
            writer.add_scalar(f"{prefix}/algorithm/{alg}", counts.get(alg, 0), step)

    def clear(self) -> None:
        self.records.clear()

    def __len__(self) -> int:
        return len(self.records)
