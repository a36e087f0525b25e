"""Partition search (Parallax §3.2) on synthetic iteration-time functions with noise."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from sparsync.plan.partition_search import fit_iteration_time, search_partitions


def _noisy_iteration_time(
    g: np.random.Generator, calls: list[int]
) -> tuple[float, float, Callable[[int], list[float]]]:
    """t(P) = θ0 + θ1/P + θ2·P with random θ, 5 slow startup iterations (dropped) and 1% noise; returns θ1, θ2
    and the sampler, which records each sampled P in ``calls``."""
    t0, t1, t2 = g.uniform(0.5, 2), g.uniform(2, 50), g.uniform(0.005, 0.2)

    def measure(P: int) -> list[float]:
        calls.append(P)
        base = t0 + t1 / P + t2 * P
        return [10 * base] * 5 + list(base * (1 + 0.01 * g.standard_normal(20)))

    return t1, t2, measure


@pytest.mark.parametrize("seed", range(8))
def test_search_finds_the_optimum_within_one_step(seed: int) -> None:
    g = np.random.default_rng(seed)
    calls: list[int] = []  # the sampled P
    t1, t2, measure = _noisy_iteration_time(g, calls)
    machines = int(g.choice([2, 4, 8]))

    res = search_partitions(measure, machines, max_partitions=4096, warmup=5)
    true = math.sqrt(t1 / t2)
    best_int = min((math.floor(true), math.ceil(true)), key=lambda P: t1 / P + t2 * P)
    assert abs(res.best - best_int) <= 1, (res, true)
    assert len(calls) == len(set(calls)) <= 12  # each P sampled once, a handful of runs
    assert min(res.samples) <= res.best <= max(res.samples)  # no extrapolation


@pytest.mark.parametrize("seed", range(8))
def test_search_with_servers_samples_only_multiples_or_divisors(seed: int) -> None:
    g = np.random.default_rng(100 + seed)
    calls: list[int] = []  # the sampled P
    t1, t2, measure = _noisy_iteration_time(g, calls)
    servers = int(g.choice([3, 4, 6]))

    res = search_partitions(measure, servers, max_partitions=4096, warmup=5, servers=servers)
    ok = sorted({d for d in range(1, servers + 1) if servers % d == 0} | set(range(servers, 4097, servers)))
    assert all(P in ok for P in calls) and res.best in ok, (calls, res.best)
    assert len(calls) == len(set(calls)) <= 12
    best_ok = min(ok, key=lambda P: t1 / P + t2 * P)  # the true optimum among balanced counts
    assert abs(ok.index(res.best) - ok.index(best_ok)) <= 1, (res, best_ok)
    assert min(res.samples) <= res.best <= max(res.samples)


def test_sampling_order_doubles_then_halves() -> None:
    seen: list[int] = []

    def measure(P: int) -> list[float]:
        seen.append(P)
        return [1 + 16 / P + 0.25 * P]  # optimum at 8

    res = search_partitions(measure, 4, max_partitions=64)
    assert seen == [4, 8, 16, 2]
    assert res.best == 8


def test_fit_recovers_exact_parameters() -> None:
    ps = [1, 2, 4, 8, 16]
    theta = fit_iteration_time(ps, [3 + 5 / p + 0.5 * p for p in ps])
    assert np.allclose(theta, (3, 5, 0.5), atol=1e-8)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="machines"):
        search_partitions(lambda P: [1.0], 8, max_partitions=4)
    with pytest.raises(ValueError, match="warmup"):
        search_partitions(lambda P: [1.0], 2, max_partitions=4, warmup=1)
    with pytest.raises(ValueError, match="servers must be"):
        search_partitions(lambda P: [1.0], 2, max_partitions=4, servers=0)
    with pytest.raises(ValueError, match=">= 3"):
        fit_iteration_time([1, 2], [1.0, 2.0])
