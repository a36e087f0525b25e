"""The α-β-γ cost model: predictions, lower bound, the default policy, and input validation."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from sparsync import (
    ALGORITHMS,
    Decision,
    LinkModel,
    Problem,
    choose_fastest,
    dense_threshold,
    lower_bound,
    predict,
)
from sparsync.costmodel import DENSE_CHUNKS, DENSE_PIPELINE_MIN

BANDWIDTH_BOUND = LinkModel(alpha=1e-5, beta=1e-8)
LINKS = (
    BANDWIDTH_BOUND,
    LinkModel(alpha=1e-6, beta=1e-10),
    LinkModel(alpha=5e-5, beta=1e-9, gamma_sparse=0.0, gamma_dense=0.0),
    LinkModel(alpha=2e-4, beta=1e-11, gamma_sparse=1e-7, gamma_dense=1e-9),
)
WORLD_SIZES = (2, 3, 4, 5, 6, 7, 8, 16, 64)
DIMS = (1, 3, 100, 1001, 10**5, 10**7)
DENSITIES = (0.0, 1e-4, 1e-2, 0.1, 0.29, 0.3, 0.5, 0.7, 1.0)
SIZES = ((4, 4), (8, 4), (2, 4), (4, 8))  # (value bytes, index bytes)


def _problem(P: int, N: int, density: float, isize: int = 4, c: int = 4) -> Problem:
    return Problem(P, N, (round(density * N),) * P, isize, c)


def _grid() -> itertools.product[tuple[int, int, float, tuple[int, int], LinkModel]]:
    return itertools.product(WORLD_SIZES, DIMS, DENSITIES, SIZES, LINKS)


def test_predictions_are_positive_and_finite() -> None:
    for P, N, d, (i, c), link in _grid():
        p = _problem(P, N, d, i, c)
        for alg in ALGORITHMS:
            t = predict(alg, p, link)
            assert math.isfinite(t) and t > 0, (alg, P, N, d, i, c, link, t)


def test_single_rank_costs_nothing() -> None:
    p = Problem(1, 1000, (10,), 4, 4)
    assert all(predict(alg, p, BANDWIDTH_BOUND) == 0.0 for alg in ALGORITHMS)
    assert lower_bound(p, BANDWIDTH_BOUND) == 0.0
    assert choose_fastest(p, BANDWIDTH_BOUND).algorithm == ALGORITHMS[0]  # ties go to the first candidate


@pytest.mark.parametrize("P", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("N", [10**4, 10**6])
def test_tiny_density_prefers_latency_optimal_sparse_algorithms(P: int, N: int) -> None:
    p = Problem(P, N, (max(1, N // 10**4),) * P, 4, 4)
    for link in LINKS:
        dense = predict("dense", p, link)
        assert predict("allgather", p, link) < dense
        # The split algorithm's framed blocks make it log2 P rounds too (one all-to-all round + the allgather):
        # at P = 3 its fold costs less latency than recursive doubling's.
        assert choose_fastest(p, link).algorithm in ("ssar_recursive_double", "allgather", "ssar_split_allgather")
        # Recursive doubling too, unless folding a non-power-of-two P costs more latency (6α at P=3) than a
        # small dense vector's bandwidth on a latency-bound link.
        if link.alpha * 6 < N * 4 * link.beta or P & (P - 1) == 0:
            assert predict("ssar_recursive_double", p, link) < dense


@pytest.mark.parametrize("N", [10**4, 10**6])
@pytest.mark.parametrize("isize", [4, 8])
def test_full_density_prefers_dense_or_dsar_on_a_bandwidth_bound_link(N: int, isize: int) -> None:
    p = Problem(8, N, (N,) * 8, isize, 4)
    rd = predict("ssar_recursive_double", p, BANDWIDTH_BOUND)
    assert predict("dense", p, BANDWIDTH_BOUND) < rd
    assert predict("dsar_split_allgather", p, BANDWIDTH_BOUND) < rd
    assert predict("allgather", p, BANDWIDTH_BOUND) > rd  # P-1 full streams received
    assert choose_fastest(p, BANDWIDTH_BOUND).algorithm in (
        "dense",
        "dsar_split_allgather",
        "ssar_split_allgather",
    )


def test_lower_bound_is_below_every_prediction() -> None:
    """Over P, N, densities (every rank holding the same number of entries, Lemma 4.1's setting), value/index
    sizes and links, no algorithm is predicted to beat the bound."""
    checked = 0
    for P, N, d, (i, c), link in _grid():
        p = _problem(P, N, d, i, c)
        lb = lower_bound(p, link)
        assert lb >= math.log2(P) * link.alpha
        for alg in ALGORITHMS:
            assert lb <= predict(alg, p, link) * (1 + 1e-12), (alg, P, N, d, i, c, link)
            checked += 1
    assert checked > 10_000


def test_lower_bound_with_sparse_inputs_and_a_dense_result() -> None:
    """Regression: with P=2 and 30% density per rank the expected result is dense (K >= delta), yet one
    exchange of 0.3·N pairs (2.4·N bytes) is all recursive doubling needs, less than N·βd = 4·N bytes. The
    bound used to claim N·βd there, above both the prediction and what the algorithm really sends."""
    N = 1000
    p = Problem(2, N, (300, 300), 4, 4)
    link = LinkModel(alpha=0.0, beta=1e-9, gamma_sparse=0.0, gamma_dense=0.0, gamma_scatter=0.0)
    assert p.union(2) >= p.delta
    rd = predict("ssar_recursive_double", p, link)
    assert rd == pytest.approx(300 * 8 * 1e-9)
    assert lower_bound(p, link) <= rd < N * 4 * link.beta
    assert lower_bound(p, link) == pytest.approx(300 * 4 * 1e-9)  # max(2(P-1)/P·k, K-k)·βd with k = 300


def test_lower_bound_for_dense_inputs_is_the_dense_allreduce_bound() -> None:
    for P in (2, 4, 8):
        p = Problem(P, 1000, (1000,) * P, 4, 4)
        link = LinkModel(alpha=1e-6, beta=1e-9)
        assert lower_bound(p, link) == pytest.approx(math.log2(P) * 1e-6 + 2 * (P - 1) / P * 1000 * 4e-9)
        assert lower_bound(p, link) <= predict("dense", p, link)


def test_choose_fastest_picks_the_argmin() -> None:
    for P, N, d, (i, c), link in itertools.islice(_grid(), 0, None, 7):
        p = _problem(P, N, d, i, c)
        dec = choose_fastest(p, link)
        assert isinstance(dec, Decision)
        preds = {alg: predict(alg, p, link) for alg in ALGORITHMS}
        assert dec.predictions == preds
        assert dec.algorithm == min(ALGORITHMS, key=preds.__getitem__)
        assert preds[dec.algorithm] == min(preds.values())
        assert dec.lower_bound == lower_bound(p, link)
        assert dec.problem == p and dec.link == link


def test_choose_fastest_respects_candidates() -> None:
    p = _problem(8, 10**6, 1e-4)
    full = choose_fastest(p, BANDWIDTH_BOUND)
    rest = tuple(a for a in ALGORITHMS if a != full.algorithm)
    dec = choose_fastest(p, BANDWIDTH_BOUND, candidates=rest)
    assert dec.algorithm in rest and set(dec.predictions) == set(rest)
    assert dec.predictions[dec.algorithm] == min(dec.predictions.values())
    assert choose_fastest(p, BANDWIDTH_BOUND, candidates=("dense",)).algorithm == "dense"


def test_dense_prediction_prices_only_densifying_sparse_inputs_and_grows_with_the_link_costs() -> None:
    link = BANDWIDTH_BOUND
    slow = LinkModel(alpha=2e-5, beta=2e-8)
    no_scatter = replace(link, gamma_scatter=0.0)
    for P in (2, 5, 8):
        assert len({predict("dense", _problem(P, 10**5, d), no_scatter) for d in DENSITIES}) == 1
        # With a scatter cost: the most pairs of any rank stored sparse (below delta), times gamma_scatter.
        for d in DENSITIES:
            p = _problem(P, 10**5, d)
            sparse = [n for n in p.nnz if n < p.delta]
            extra = predict("dense", p, link) - predict("dense", p, no_scatter)
            assert extra == pytest.approx(link.gamma_scatter * max(sparse, default=0))
        # From DENSE_PIPELINE_MIN elements the densify is chunked under the transfers: one chunk's cost shows.
        big = Problem(P, 2 * DENSE_PIPELINE_MIN, (DENSE_PIPELINE_MIN // 2,) * P, 4, 4)
        extra = predict("dense", big, link) - predict("dense", big, no_scatter)
        assert extra == pytest.approx(link.gamma_scatter * DENSE_PIPELINE_MIN / 2 / DENSE_CHUNKS)
        for d in DENSITIES:
            p = _problem(P, 10**5, d)
            for alg in ALGORITHMS:
                assert predict(alg, p, slow) >= predict(alg, p, link)


def test_unknown_algorithm() -> None:
    with pytest.raises(KeyError, match="bogus"):
        predict("bogus", _problem(4, 100, 0.1), BANDWIDTH_BOUND)


# --- Problem ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "isize"), [(torch.float32, 4), (torch.float64, 8), (torch.float16, 2)])
@pytest.mark.parametrize("N", [1, 3, 1001, 20011])
def test_problem_delta_matches_the_stream_threshold(dtype: torch.dtype, isize: int, N: int) -> None:
    assert Problem(2, N, (0, 0), isize, 4).delta == dense_threshold(N, dtype)


def test_problem_union_and_stream_bytes() -> None:
    p = Problem(4, 1000, (100,) * 4, 4, 4)
    assert p.union(1) == pytest.approx(100)
    u = [p.union(m) for m in (1, 2, 3, 4)]
    assert u == sorted(u) and u[-1] <= min(1000, 400)
    assert p.union(4) == pytest.approx(1000 * (1 - 0.9**4))
    assert Problem(2, 10, (10, 0), 4, 4).union(2) == pytest.approx(10)  # a full rank fills the result
    assert Problem(2, 10, (0, 0), 4, 4).union(2) == 0
    assert p.k == 100
    assert p.stream_bytes(p.delta - 1) == (p.delta - 1) * 8
    assert p.stream_bytes(p.delta) == 1000 * 4
    assert p.input_bytes(0) == 800


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((2, 10, (1,), 4, 4), "one nnz per rank"),
        ((0, 10, (), 4, 4), "P=0"),
        ((3, 10, (1, 2), 4, 4), "P=3"),
        ((2, 0, (0, 0), 4, 4), "dim must be >= 1, got 0"),
    ],
)
def test_problem_validation(args: tuple[int, int, tuple[int, ...], int, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Problem(*args)


# --- LinkModel ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"alpha": -1e-6, "beta": 1e-9}, "alpha"),
        ({"alpha": float("nan"), "beta": 1e-9}, "alpha"),
        ({"alpha": 1e-6, "beta": float("inf")}, "beta"),
        ({"alpha": 1e-6, "beta": -1.0}, "beta"),
        ({"alpha": 1e-6, "beta": 1e-9, "gamma_sparse": -1.0}, "gamma_sparse"),
        ({"alpha": 1e-6, "beta": 1e-9, "gamma_dense": float("nan")}, "gamma_dense"),
        ({"alpha": "1e-6", "beta": 1e-9}, "alpha"),
    ],
)
def test_link_model_validation(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"LinkModel.{field} must be a finite number >= 0"):
        LinkModel(**kwargs)  # type: ignore[arg-type]


def test_link_model_accepts_zero_and_ints_and_is_hashable() -> None:
    lm = LinkModel(alpha=0, beta=0, gamma_sparse=0, gamma_dense=0)
    assert lm == LinkModel(0.0, 0.0, 0.0, 0.0)
    assert hash(lm) == hash(LinkModel(0.0, 0.0, 0.0, 0.0))
    with pytest.raises(AttributeError):
        lm.alpha = 1.0  # type: ignore[misc]


def test_allgather_priced_in_steady_state_when_its_payloads_fit_the_eager_region() -> None:
    link = LinkModel(alpha=1e-4, beta=1e-9)
    fits = Problem(4, 1 << 24, (10_000,) * 4, 4, 4, eager_limit=80_000 + 1)
    too_big = Problem(4, 1 << 24, (10_000,) * 4, 4, 4, eager_limit=80_000 - 1)
    plain = Problem(4, 1 << 24, (10_000,) * 4, 4, 4)
    # 10k pairs of 8 bytes: 80 kB per rank. One all-to-all round of latency saved (P - 1 = 3 messages at α each
    # when the link has no measured alpha_a2a); with one measured, that.
    assert predict("allgather", plain, link) == predict("allgather", too_big, link)
    assert predict("allgather", plain, link) - predict("allgather", fits, link) == pytest.approx(3 * link.alpha)
    a2a = LinkModel(alpha=1e-4, beta=1e-9, alpha_a2a=2.5e-4)
    assert predict("allgather", plain, a2a) - predict("allgather", fits, a2a) == pytest.approx(2.5e-4)
    for alg in ("ssar_recursive_double", "ssar_split_allgather", "dense"):  # the others are unaffected
        assert predict(alg, plain, link) == predict(alg, fits, link)


def test_hyperloglog_sketch_estimates_unions_of_zipf_rows() -> None:
    """The metadata round's row-id sketches (collectives/_hll.py) size unions within HLL's error (9% for 128
    registers; we allow 25%), where the independence assumption is off by far more on Zipf-overlapping rows."""
    from sparsync.collectives import _hll

    assert _hll.estimate(_hll.registers(torch.empty(0, dtype=torch.int64))) == 0.0
    assert _hll.estimate(_hll.registers(torch.tensor([5, 5, 5]))) == pytest.approx(1.0, abs=0.01)
    R = 1 << 20
    p = 1.0 / np.arange(1, R + 1) ** 1.3
    cdf = np.cumsum(p) / p.sum()
    sets = [np.unique(np.searchsorted(cdf, np.random.default_rng(r).random(20_000))) for r in range(8)]
    regs = [_hll.registers(torch.from_numpy(s)) for s in sets]
    assert torch.equal(_hll.unpack(_hll.words(regs[0])), regs[0])
    curve = dict(_hll.union_curve(regs, tuple(len(s) for s in sets)))
    for m in (2, 4, 8):
        exact = np.mean([len(np.unique(np.concatenate(sets[i : i + m]))) for i in range(0, 8, m)])
        assert curve[m] == pytest.approx(exact, rel=0.25), (m, curve[m], exact)
    k = int(np.mean([len(s) for s in sets]))
    independent = Problem(8, R, (k,) * 8, 4, 4)
    sketched = Problem(8, R, (k,) * 8, 4, 4, unions=tuple(sorted(curve.items())))
    exact8 = len(np.unique(np.concatenate(sets)))
    assert abs(sketched.union(8) - exact8) < 0.25 * exact8 < abs(independent.union(8) - exact8)
    assert sketched.union(1) == pytest.approx(curve[1]) and curve[1] < sketched.union(3) < curve[4]


def test_choose_robust_takes_the_simplest_algorithm_in_a_near_tie() -> None:
    from sparsync import choose_robust
    from sparsync.costmodel import SIMPLICITY, TIE_MARGIN

    for P, N, k in ((4, 1 << 20, 3000), (8, 1 << 24, 1 << 21), (2, 1000, 10), (1, 50, 5)):
        for link in LINKS:
            p = Problem(P, N, (k,) * P, 4, 4)
            fast, robust = choose_fastest(p, link), choose_robust(p, link)
            preds = robust.predictions
            assert preds == fast.predictions
            assert preds[robust.algorithm] <= preds[fast.algorithm] * (1 + TIE_MARGIN)
            assert SIMPLICITY.index(robust.algorithm) <= SIMPLICITY.index(fast.algorithm)  # only simpler wins
    tie = Problem(4, 1 << 20, (3000,) * 4, 4, 4)
    assert choose_robust(tie, LINKS[1], margin=0.0).algorithm == choose_fastest(tie, LINKS[1]).algorithm
    # With sketched unions of heavily overlapping rows, allgather (every rank's rows to every rank) is far behind
    # at P = 8: a clear loser is never chosen for being simple.
    p = Problem(8, 1 << 20, (6000,) * 8, 256, 4, row=64, unions=((1, 6000), (2, 9000), (4, 14000), (8, 25000)))
    link = LinkModel(alpha=1e-4, beta=8e-9)
    assert choose_fastest(p, link).algorithm == "ssar_split_allgather"
    assert choose_robust(p, link).algorithm in ("ssar_recursive_double", "ssar_split_allgather")


def test_fixed_costs_replace_the_latency_terms() -> None:
    link = LinkModel(alpha=1e-4, beta=1e-9, alpha_a2a=3e-4)
    flat = replace(link, alpha=0.0, alpha_a2a=0.0)
    fixed = replace(link, fixed=tuple((a, 0.01 * (i + 1)) for i, a in enumerate(ALGORITHMS)))
    big = Problem(4, 1 << 24, (300_000,) * 4, 4, 4)  # 2.4 MB per rank: above the eager region
    small = Problem(4, 1 << 24, (10,) * 4, 4, 4, eager_limit=1 << 16)
    for i, alg in enumerate(ALGORITHMS):
        for p in (big, small):
            want = 0.01 * (i + 1) + predict(alg, p, flat)
            if alg == "allgather" and p is big:  # the tiny call rode in its metadata round; big does not
                want += 3e-4
            assert predict(alg, p, fixed) == pytest.approx(want, rel=1e-12), (alg, p.nnz)
    # an algorithm without a measured cost keeps its α terms; P = 1 costs nothing
    part = replace(link, fixed=(("allgather", 0.5),))
    assert predict("dense", big, part) == predict("dense", big, link)
    assert predict("allgather", Problem(1, 100, (5,), 4, 4), fixed) == 0.0


def test_fixed_costs_are_validated_and_normalized() -> None:
    lm = LinkModel(alpha=1e-4, beta=1e-9, fixed=[["allgather", 1]])  # type: ignore[arg-type]  # as JSON gives it
    assert lm.fixed == (("allgather", 1.0),) and hash(lm) == hash(replace(lm))
    for bad in ((("nope", 1.0),), (("dense", -1.0),), (("dense", math.nan),)):
        with pytest.raises(ValueError, match=r"LinkModel\.fixed"):
            LinkModel(alpha=1e-4, beta=1e-9, fixed=bad)


def test_registry_is_the_one_list_of_algorithms() -> None:
    """Names, wire codes, tie order, runners and byte counts all come from ``costmodel.REGISTRY``."""
    from sparsync.collectives.meta import ALGORITHM_CODES
    from sparsync.costmodel import REGISTRY, SIMPLICITY, algorithm

    assert tuple(a.name for a in REGISTRY) == ALGORITHMS
    assert sorted(SIMPLICITY) == sorted(ALGORITHMS) and SIMPLICITY[0] == "allgather"
    p = Problem(4, 1 << 16, (100, 200, 300, 400), 4, 4)
    for a in REGISTRY:
        assert algorithm(a.name) is a and ALGORITHM_CODES[a.code] == a.name
        assert callable(a.runner) and a.nbytes(p) > 0
    with pytest.raises(KeyError, match="unknown algorithm 'bogus'"):
        algorithm("bogus")


def test_the_cost_model_imports_no_collective() -> None:
    """The model sits below the collectives: its module-level imports name none of them (the registry's runners
    are imported at first use), so the collectives can import it without a cycle. Its one import of sparsync is
    the registries' base, a leaf that imports nothing of sparsync (tests/test_layers.py's level 0)."""
    import ast
    from pathlib import Path

    import sparsync.costmodel as cm

    tree = ast.parse(Path(cm.__file__).read_text())
    names = [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    leaves = {"sparsync.registry"}
    assert names and not [m for m in names if m.startswith("sparsync.") and m not in leaves], names
