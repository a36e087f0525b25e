"""Partition search (Parallax §3.2): how many partitions P to split the sparse variables into.

Iteration time is modelled as t(P) = θ0 + θ1/P + θ2·P (Eq. 1: a fixed cost, work that partitions share, and
a per-partition overhead). Samples: start at P = number of machines, double while the time falls (the first
slower sample included), then halve from the start the same way; the first ``warmup`` iterations of every
sample are dropped (Parallax drops 50 of 100). θ is fitted by least squares with θ1, θ2 >= 0 (so the fit is
convex, as the paper assumes) and the best integer P inside the sampled range is chosen: no extrapolation.

With ``servers=S`` only partition counts that are multiples or divisors of S are sampled and chosen, so every
server holds the same number of partitions (doubling rounds to the nearest multiple, halving to the largest
divisor not above it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class PartitionSearch:
    samples: dict[int, float] = field(default_factory=dict)  # P -> mean iteration time (s) after warm-up
    theta: tuple[float, float, float] = (0.0, 0.0, 0.0)  # θ0, θ1, θ2 of Eq. 1
    best: int = 1  # argmin of the fit over the integers of the sampled range

    def predict(self, P: float) -> float:
        t0, t1, t2 = self.theta
        return t0 + t1 / P + t2 * P


def fit_iteration_time(ps: Sequence[float], times: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares θ of t(P) = θ0 + θ1/P + θ2·P with θ1, θ2 >= 0.

    Two bounds give four active sets: the optimum of this convex problem is the unconstrained least-squares fit
    over the free columns of one of them ({θ1, θ2}, {θ1}, {θ2}, neither, the rest at 0), so the best feasible
    fit of the four is it (exact, no iterative solver)."""
    if len(ps) != len(times) or len(ps) < 3:
        raise ValueError(f"need >= 3 (P, time) samples of equal count, got {len(ps)} and {len(times)}")
    p = np.asarray(ps, dtype=float)
    t = np.asarray(times, dtype=float)
    A = np.stack([np.ones_like(p), 1.0 / p, p], axis=1)
    fits: list[tuple[float, npt.NDArray[np.float64]]] = []
    for free in ((), (1,), (2,), (1, 2)):  # the first is always feasible
        cols = [0, *free]
        x = np.zeros(3)
        x[cols] = np.linalg.lstsq(A[:, cols], t, rcond=None)[0]
        if x[1] >= 0 and x[2] >= 0:
            fits.append((float(np.sum((A @ x - t) ** 2)), x))
    best = min(fits, key=lambda f: f[0])
    t0, t1, t2 = (float(v) for v in best[1])
    return t0, t1, t2


def _time(measure: Callable[[int], Sequence[float]], P: int, warmup: int) -> float:
    ts = list(measure(P))
    if len(ts) <= warmup:
        raise ValueError(f"measure({P}) returned {len(ts)} iteration times; need more than warmup={warmup}")
    return float(np.mean(ts[warmup:]))


def search_partitions(
    measure: Callable[[int], Sequence[float]],
    machines: int,
    *,
    max_partitions: int,
    min_partitions: int = 1,
    warmup: int = 0,
    servers: int | None = None,
) -> PartitionSearch:
    """Sample ``measure(P)`` (iteration times of a short run with P partitions) as Parallax §3.2 does, fit
    Eq. 1, return the samples, θ and the chosen P."""
    if not 1 <= min_partitions <= machines <= max_partitions:
        raise ValueError(
            f"need 1 <= min_partitions ({min_partitions}) <= machines ({machines}) "
            f"<= max_partitions ({max_partitions})"
        )
    if servers is not None and servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    snap = (lambda q: q) if servers is None else (lambda q: _balanced(q, servers))
    start = snap(machines)
    samples = {start: _time(measure, start, warmup)}
    for step in (2.0, 0.5):
        P, prev = start, samples[start]
        while True:
            nxt = snap(max(1, int(P * step)))
            if nxt == P:
                break
            P = nxt
            if max_partitions < P or min_partitions > P:
                break
            t = _time(measure, P, warmup)
            samples[P] = t
            if t > prev:
                break
            prev = t
    ps = sorted(samples)
    if len(ps) < 3:  # too few points for three parameters: take the best sample
        best = min(ps, key=lambda q: samples[q])
        return PartitionSearch(samples, (samples[best], 0.0, 0.0), best)
    theta = fit_iteration_time(ps, [samples[q] for q in ps])
    fit = PartitionSearch(samples, theta, 1)
    cands = [q for q in range(ps[0], ps[-1] + 1) if servers is None or _balanced(q, servers) == q]
    best = min(cands, key=fit.predict)
    return PartitionSearch(samples, theta, best)


def _balanced(P: int, servers: int) -> int:
    """The partition count nearest P that is a multiple (P >= servers) or a divisor (P < servers) of servers."""
    if servers <= P:
        return max(1, round(P / servers)) * servers
    return max(d for d in range(1, P + 1) if servers % d == 0)
