"""HyperLogLog registers of each rank's row ids, carried in the metadata round.

The cost model needs the size of sums of several ranks' streams (the union of their index sets) before any
data moves. SparCML §4 gives each algorithm's time as a range between identical and disjoint index sets; our
default point estimate assumes independent uniform index sets (``costmodel.Problem.union``). Embedding
gradients break that assumption: Zipf-hot rows are touched by every rank, so the union is far smaller than
independence predicts and the split algorithms were priced too high (figures: docs/results_embedding.md).

So every rank with a row-sparse stream adds 128 HyperLogLog registers (Flajolet et al. 2007; one byte each,
16 int64 in the metadata row) of its row ids; the register-wise max over a group of ranks are the registers of
their union, whose estimate has a standard error of 1.04 / sqrt(128) ≈ 9%. Element streams (row 1) skip it:
hashing millions of indices would cost more than it saves, and SparCML's uniform data is what the default
estimate assumes.
"""

from __future__ import annotations

import math

import torch

REGISTERS = 128
WORDS = REGISTERS // 8  # int64 words in the metadata row
_BUCKET_BITS = 7
_REST_BITS = 64 - _BUCKET_BITS
_ALPHA = 0.7213 / (1 + 1.079 / REGISTERS)
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64 (splitmix64's finalizer constants)
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as int64


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    z = x.to(torch.int64) + _GOLDEN  # wraps like uint64
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def registers(ids: torch.Tensor) -> torch.Tensor:
    """The 128 uint8 registers of a set of ids (duplicates do not matter), on the host (computed where the ids
    are: one copy of 128 bytes)."""
    out = torch.zeros(REGISTERS, dtype=torch.int64, device=ids.device)
    if ids.numel() == 0:
        return out.to(torch.uint8).cpu()
    h = _mix(ids)
    bucket = _shr(h, _REST_BITS)
    rest = h & ((1 << _REST_BITS) - 1)
    # rho: position of the leftmost 1 in the REST_BITS-bit remainder (1-based); 0 remainder -> REST_BITS + 1.
    lz = torch.where(rest > 0, torch.floor(torch.log2(rest.to(torch.float64).clamp(min=1))), -1.0)
    rho = (_REST_BITS - lz).to(torch.int64)
    out.scatter_reduce_(0, bucket, rho, reduce="amax")
    return out.to(torch.uint8).cpu()


def words(regs: torch.Tensor) -> torch.Tensor:
    """Registers packed into WORDS int64 for the metadata row."""
    return regs.contiguous().view(torch.int64)


def unpack(row_words: torch.Tensor) -> torch.Tensor:
    return row_words.contiguous().view(torch.uint8)


def estimate(regs: torch.Tensor) -> float:
    """Cardinality estimate of a register vector, with the small-range (linear counting) correction."""
    r = regs.to(torch.float64)
    e = _ALPHA * REGISTERS**2 / float(torch.pow(2.0, -r).sum())
    zeros = int((regs == 0).sum())
    if e <= 2.5 * REGISTERS and zeros:
        return REGISTERS * math.log(REGISTERS / zeros)
    return e


def union_curve(regs: list[torch.Tensor], nrows: tuple[int, ...]) -> tuple[tuple[float, float], ...]:
    """(m, expected union of m ranks' rows) for m = 1, 2, 4, ... and P: the mean over consecutive groups of m
    ranks (the groups recursive doubling and the split allgather sum), exact counts at m = 1."""
    P = len(regs)
    pts = [(1.0, sum(nrows) / P)]
    m = 2
    while m < P:
        groups = [torch.stack(regs[i : i + m]).amax(0) for i in range(0, P - m + 1, m)]
        pts.append((float(m), sum(estimate(g) for g in groups) / len(groups)))
        m *= 2
    if P > 1:
        pts.append((float(P), estimate(torch.stack(regs).amax(0))))
    return tuple(pts)
