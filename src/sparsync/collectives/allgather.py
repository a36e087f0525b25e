"""The ``allgather`` algorithm, the Horovod/DDP way (SparCML §4's baseline): gather every rank's stream, then
sum locally. Its payloads may ride in the metadata round (collectives/meta.py's eager protocol), which makes
it one round on latency-bound, very sparse calls."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparsync.collectives._gather import allgather_blocks
from sparsync.collectives.comm import Comm
from sparsync.collectives.wire import payload_of
from sparsync.collectives.wire import stream_from_payload as _decode
from sparsync.costmodel import (
    AlgorithmEntry,
    LinkModel,
    Problem,
    gather_latency,
    mean_bytes,
    payload_inline,
    sum_cost,
    terms,
)
from sparsync.stream import SparseStream, sum_streams

if TYPE_CHECKING:
    from sparsync.collectives.meta import Meta


def gather_streams(comm: Comm, stream: SparseStream, meta: Meta) -> list[SparseStream]:
    """Every rank's stream in rank order: from the metadata round when it carried every payload, else one
    allgather of the payloads (their sizes from ``meta``)."""
    if meta.eager is not None:  # every payload already came with the metadata (see meta.py's eager protocol)
        blocks = [b.to(comm.device) for b in meta.eager]
    else:
        with comm.phase("allgather_payload"):
            blocks = allgather_blocks(comm, payload_of(stream), list(meta.sizes))
    return [
        _decode(b, meta.dense[r], meta.nnz[r], stream.dim, stream.dtype, stream.row) for r, b in enumerate(blocks)
    ]


def allgather_sum(comm: Comm, stream: SparseStream, meta: Meta, partition: str = "-") -> SparseStream:
    """The registry's runner: gather every rank's stream, then sum locally (no partition)."""
    streams = gather_streams(comm, stream, meta)
    with comm.phase("sum"):
        return sum_streams(streams)


def predict_time(p: Problem, link: LinkModel) -> float:
    """One gather of every other rank's input, then the local sum of all P."""
    P, N, _, _, b = terms(p, link)
    if p.eager:  # the gather already happened in the metadata round: only the local sum is left
        return sum_cost(p, link, sum(p.nnz), N)
    received = sum(p.input_bytes(r) for r in range(P)) - min(p.input_bytes(r) for r in range(P))
    latency = gather_latency(P, link)
    if payload_inline(p):
        # Priced in steady state: in a run of calls like this one, choosing allgather makes the next
        # call's payloads ride in the metadata round every algorithm pays for, so its own rounds vanish.
        latency = 0.0
    return latency + b * received + sum_cost(p, link, sum(p.nnz), N)


def predict_bytes(p: Problem) -> float:
    return 2 * mean_bytes(p) * (p.world_size - 1)


ENTRY = AlgorithmEntry("allgather", code=4, simplicity=0, time=predict_time, nbytes=predict_bytes,
                       runner=allgather_sum, rides_metadata=True)  # fmt: skip
