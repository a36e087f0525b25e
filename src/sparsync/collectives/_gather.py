"""Allgathers of sparsync's blocks (fixed and variable sizes), and the fold that runs recursive doubling on any
world size as MPICH does.

SparCML §4 assumes P is a power of two. For other P we use MPICH's scheme (Thakur & Gropp 2003): with
P' = 2^floor(log2 P) and r = P - P', each even rank below 2r hands its data to the odd rank above it and sits
out; the P' remaining ranks run recursive doubling on "virtual" ranks 0..P'-1; at the end each odd rank below 2r
hands the result back to its even neighbour. The extra step costs 2α and one extra transfer, on r ranks only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparsync.collectives.comm import Comm
from sparsync.costmodel import DIRECT_GATHER_MAX


@dataclass(frozen=True)
class Fold:
    size: int

    @property
    def pof2(self) -> int:
        return 1 << (self.size.bit_length() - 1)

    @property
    def rem(self) -> int:
        return self.size - self.pof2

    def is_folded_away(self, rank: int) -> bool:
        """Even ranks below 2r give their data away and wait for the result."""
        return rank < 2 * self.rem and rank % 2 == 0

    def virtual(self, rank: int) -> int:
        return rank // 2 if rank < 2 * self.rem else rank - self.rem

    def real(self, vrank: int) -> int:
        return 2 * vrank + 1 if vrank < self.rem else vrank + self.rem

    def covered(self, vrank: int) -> list[int]:
        """Real ranks whose input the active rank ``vrank`` holds after the fold-in step."""
        return [2 * vrank, 2 * vrank + 1] if vrank < self.rem else [vrank + self.rem]

    def covered_range(self, vstart: int, count: int) -> list[int]:
        out: list[int] = []
        for v in range(vstart, vstart + count):
            out.extend(self.covered(v))
        return out


def allgather_blocks(
    comm: Comm, block: torch.Tensor, sizes: list[int], *, doubling: bool | None = None
) -> list[torch.Tensor]:
    """Every rank's uint8 ``block`` on every rank, given all block sizes in advance (no headers needed).

    Up to ``DIRECT_GATHER_MAX`` ranks (``doubling=None``), one round: each rank sends its block to every peer at
    once. Beyond it, or with ``doubling=True``, recursive doubling (SparCML §4, "we use the same algorithm for
    solving a sparse AllGather"): in round t each rank exchanges all blocks gathered so far with the rank
    2^(t-1) away: log2(P) rounds of latency. Both move (P-1) blocks in and out of every rank.
    """
    if block.numel() != sizes[comm.rank]:
        raise ValueError(f"block of {block.numel()} bytes but sizes[{comm.rank}] = {sizes[comm.rank]}")
    P, rank = comm.size, comm.rank
    held: dict[int, torch.Tensor] = {rank: block}
    if P == 1:
        return [block]
    if not doubling and (doubling is not None or P <= DIRECT_GATHER_MAX):
        return comm.alltoallv([block] * P, sizes, torch.uint8)
    fold = Fold(P)
    if fold.is_folded_away(rank):
        comm.send(rank + 1, block)
        others = [r for r in range(P) if r != rank]
        buf = comm.empty(sum(sizes[r] for r in others))
        comm.recv(rank + 1, buf)
        held.update(_split(buf, others, sizes))
        return [held[r] for r in range(P)]
    if rank < 2 * fold.rem:
        buf = comm.empty(sizes[rank - 1])
        comm.recv(rank - 1, buf)
        held[rank - 1] = buf
    v = fold.virtual(rank)
    mask = 1
    while mask < fold.pof2:
        pv = v ^ mask
        theirs = fold.covered_range(pv & ~(mask - 1), mask)
        mine = sorted(held)
        buf = comm.empty(sum(sizes[r] for r in theirs))
        comm.exchange(fold.real(pv), torch.cat([held[r] for r in mine]), buf)
        held.update(_split(buf, theirs, sizes))
        mask <<= 1
    if rank < 2 * fold.rem:
        rest = [r for r in range(P) if r != rank - 1]
        comm.send(rank - 1, torch.cat([held[r] for r in rest]))
    return [held[r] for r in range(P)]


def allgather_var(
    comm: Comm, block: torch.Tensor, max_block: int, length_of: Callable[[torch.Tensor], int]
) -> list[torch.Tensor]:
    """Like ``allgather_blocks``, for blocks whose sizes nobody knows in advance: each block starts with its own
    length (read by ``length_of`` from the block's first bytes) and is at most ``max_block`` bytes.

    One round up to ``DIRECT_GATHER_MAX`` ranks, recursive doubling beyond (as ``allgather_blocks``).
    Receives are posted for the most a peer may send (gloo accepts a shorter message into a longer posted
    receive, never a longer one), and each rank sends only what it holds, so ranks that disagree about a call
    exchange well-formed messages and can report the disagreement instead of aborting inside gloo.
    """
    if comm.exact:  # receives longer than the message: gloo's semantics only (transport.py)
        raise RuntimeError(f"{comm.op}: allgather_var needs a group that accepts short messages (gloo)")
    if block.numel() > max_block:
        raise ValueError(f"block of {block.numel()} bytes exceeds the {max_block}-byte limit")
    P, rank = comm.size, comm.rank
    if P == 1:
        return [block]

    def receive(peer: int, ranks: list[int], send: torch.Tensor | None) -> None:
        buf = comm.empty(len(ranks) * max_block)
        comm.exchange(peer, send, buf)
        off = 0
        for r in ranks:
            n = length_of(buf[off:]) if off < buf.numel() else -1
            if not 0 < n <= max_block or off + n > buf.numel():
                raise ValueError(f"{comm.op}: malformed metadata block from peer rank {peer} (length {n})")
            held[r] = buf[off : off + n]
            off += n
        comm.traffic.bytes_recv -= buf.numel() - off  # counted as posted; only ``off`` bytes arrived

    held: dict[int, torch.Tensor] = {rank: block}
    if P <= DIRECT_GATHER_MAX:
        return _direct_var(comm, block, max_block, length_of)
    fold = Fold(P)
    if fold.is_folded_away(rank):
        comm.send(rank + 1, block)
        receive(rank + 1, [r for r in range(P) if r != rank], None)
        return [held[r] for r in range(P)]
    if rank < 2 * fold.rem:
        receive(rank - 1, [rank - 1], None)
    v = fold.virtual(rank)
    mask = 1
    while mask < fold.pof2:
        pv = v ^ mask
        theirs = fold.covered_range(pv & ~(mask - 1), mask)
        mine = torch.cat([held[r] for r in sorted(held)])
        receive(fold.real(pv), theirs, mine)
        mask <<= 1
    if rank < 2 * fold.rem:
        comm.send(rank - 1, torch.cat([held[r] for r in range(P) if r != rank - 1]))
    return [held[r] for r in range(P)]


def _direct_var(
    comm: Comm, block: torch.Tensor, max_block: int, length_of: Callable[[torch.Tensor], int]
) -> list[torch.Tensor]:
    """``allgather_var`` in one round: ``block`` sent to every peer at once, a receive of ``max_block`` bytes
    posted for each."""
    got = comm.alltoallv([block] * comm.size, [max_block] * comm.size, torch.uint8)
    out = []
    for r, buf in enumerate(got):
        if r == comm.rank:
            out.append(block)
            continue
        n = length_of(buf)
        if not 0 < n <= max_block:
            raise ValueError(f"{comm.op}: malformed metadata block from peer rank {r} (length {n})")
        comm.traffic.bytes_recv -= buf.numel() - n  # counted as posted; only ``n`` bytes arrived
        out.append(buf[:n])
    return out


def allgather_fixed(comm: Comm, row: torch.Tensor, *, doubling: bool | None = None) -> torch.Tensor:
    """Stack every rank's int64 ``row`` (same length everywhere) into a [P, len] tensor."""
    nbytes = row.numel() * row.element_size()
    blocks = allgather_blocks(comm, row.contiguous().view(torch.uint8), [nbytes] * comm.size, doubling=doubling)
    return torch.stack([b.view(row.dtype) for b in blocks])


def _split(buf: torch.Tensor, ranks: list[int], sizes: list[int]) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    off = 0
    for r in ranks:
        out[r] = buf[off : off + sizes[r]]
        off += sizes[r]
    return out
