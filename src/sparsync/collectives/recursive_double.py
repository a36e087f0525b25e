"""SSAR_Recursive_Double: SparCML §4.1, "The Latency Dominated Case".

In round t every rank exchanges its partial sum with the rank 2^(t-1) away and adds the two sparse streams,
switching to the dense format when the sum fills up (§3). log2(P) rounds: latency-optimal, and the bandwidth
term ranges from log2(P)·k·βs (identical index sets) to (P-1)·k·βs (disjoint ones).

Non-power-of-two P: MPICH fold (see ``_gather.Fold``). Every rank ends with a bitwise identical result: each round
adds the same two operands on both partners, and float addition of two operands commutes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from sparsync.collectives._gather import Fold
from sparsync.collectives.comm import Comm, exchange_stream
from sparsync.costmodel import AlgorithmEntry, LinkModel, Problem, sum_cost, terms
from sparsync.stream import SparseStream, add

if TYPE_CHECKING:
    from sparsync.collectives.meta import Meta


def ssar_recursive_double(comm: Comm, stream: SparseStream) -> SparseStream:
    P, rank = comm.size, comm.rank
    if P == 1:
        return stream
    dim, dtype, row = stream.dim, stream.dtype, stream.row
    fold = Fold(P)
    if fold.is_folded_away(rank):
        with comm.phase("fold"):
            exchange_stream(comm, rank + 1, stream, expect=False, dim=dim, dtype=dtype, row=row)
            result = exchange_stream(comm, rank + 1, None, expect=True, dim=dim, dtype=dtype, row=row)
        assert result is not None
        return result
    acc = stream
    if rank < 2 * fold.rem:
        with comm.phase("fold"):
            got = exchange_stream(comm, rank - 1, None, expect=True, dim=dim, dtype=dtype, row=row)
            assert got is not None
            acc = add(got, acc)
    v = fold.virtual(rank)
    mask = 1
    with comm.phase("rounds"):
        while mask < fold.pof2:
            peer = fold.real(v ^ mask)
            got = exchange_stream(comm, peer, acc, expect=True, dim=dim, dtype=dtype, row=row)
            assert got is not None
            # Each element receives at most one addition of two operands, which commutes, so both partners
            # get the same bits. A dense accumulator we own is reused in place (SparCML §3).
            acc = add(acc, got, inplace=acc is not stream)
            mask <<= 1
    if rank < 2 * fold.rem:
        with comm.phase("fold"):
            exchange_stream(comm, rank - 1, acc, expect=False, dim=dim, dtype=dtype, row=row)
    return acc


def run(comm: Comm, stream: SparseStream, meta: Meta, partition: str) -> SparseStream:
    """The registry's runner: the metadata and partition are not needed."""
    return ssar_recursive_double(comm, stream)


def predict_time(p: Problem, link: LinkModel) -> float:
    """§4.1's log2 P rounds, each moving the expected union of the partners' partial sums (two messages:
    header, payload), after the MPICH fold's two exchanges when P is not a power of two."""
    P, N, a, _, b = terms(p, link)
    pof2 = 1 << (P.bit_length() - 1)  # the MPICH fold takes P - pof2 ranks out first
    t = 0.0
    m = P / pof2
    if pof2 != P:
        t += 2 * (2 * a) + b * (p.stream_bytes(p.union(1)) + p.stream_bytes(p.union(P)))
    for _ in range(pof2.bit_length() - 1):
        t += 2 * a + b * p.stream_bytes(p.union(m)) + sum_cost(p, link, 2 * p.union(m), N)
        m *= 2
    return t


def predict_bytes(p: Problem) -> float:
    rounds, m, total = int(math.log2(p.world_size)) if p.world_size > 1 else 0, 1.0, 0.0
    for _ in range(rounds):
        total += 2 * p.stream_bytes(p.union(m))
        m *= 2
    return total


ENTRY = AlgorithmEntry("ssar_recursive_double", code=1, simplicity=2, time=predict_time, nbytes=predict_bytes,
                       runner=run)  # fmt: skip
