"""The α-β(-γ) cost model of SparCML §4 and the policy that picks an allreduce algorithm from it.

Data (``LinkModel``, ``Problem``) is kept apart from the selection policy (``choose_fastest``), so a user can
set a measured or assumed link, or replace the policy.

Where the paper is vague we chose:
- The paper gives each algorithm's time as a range between full overlap and no overlap of the index sets. To
  pick one algorithm per call we need a point estimate, so we predict the size of partial sums by the expected
  union of independent uniformly random index sets with the ranks' actual densities:
  U(m) = N·(1 - q^m), q = geometric mean of (1 - nnz_i/N). Identical index sets make this pessimistic for
  recursive doubling (it then over-predicts its bandwidth term), which only biases the choice toward the
  split algorithms that are safe in that case.
- Reduction work is not free on CPUs (§4 notes the lower bound ignores it), so the model adds γ terms: seconds
  per sparse pair merged and per dense element added, measured with the link.
- Every prediction includes the metadata round all algorithms share (``metadata_time``). When that round
  already carried every payload (the eager protocol, ``collectives/meta.py``), "allgather" adds only its
  local sum.
- Latency terms follow the message pattern we actually run: two messages (header, payload) per recursive
  doubling round of ``ssar_recursive_double``, one per round of framed blocks (the split algorithms' all-to-all
  and allgather), P-1 per all_to_all, and the MPICH fold adds 2 exchanges when P is not a power of two.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparsync.stream import SparseStream

# The ``dense`` algorithm on a sparse-stored input of at least DENSE_PIPELINE_MIN elements densifies and reduces
# it in DENSE_CHUNKS pieces, each piece's allreduce started as soon as it is filled (collectives/allreduce.py).
# (Chosen, not tuned: 4M elements. Measured to help at 16M, where the chunks' extra ring latencies hid under the
# transfer; at small N those latencies could outweigh the densify they hide.)
DENSE_PIPELINE_MIN = 1 << 22
DENSE_CHUNKS = 4
# Allgathers of sparsync's own blocks (the metadata round, allgather's payloads, the split's second phase) on
# up to this many ranks send each block to every peer in one round (collectives/_fold.py), beyond it by
# recursive doubling: on few shared cores each round costs milliseconds of scheduling (docs/results_design.md).
# (Chosen, not tuned: P - 1 concurrent messages per rank stay cheap at this size.)
DIRECT_GATHER_MAX = 16


@dataclass(frozen=True)
class LinkModel:
    alpha: float  # seconds per message (one-way latency incl. software overhead)
    beta: float  # seconds per byte on one link (1 / bandwidth)
    gamma_sparse: float = 2e-8  # seconds per (index, value) pair merged in a sparse sum
    gamma_dense: float = 5e-10  # seconds per element in a dense add
    gamma_scatter: float = 5e-9  # seconds per (index, value) pair scatter-added into a dense buffer
    alpha_a2a: float | None = None  # seconds of one all-to-all round of tiny messages; None: (P-1)·alpha
    # Seconds per byte of sparsync's own point-to-point exchange phases (recursive doubling rounds, the split's
    # all-to-all), measured on such a phase; None: beta. Behind shaped links these phases move a byte
    # slower than gloo's pipelined ring (beta) does (docs/results_design.md).
    beta_exchange: float | None = None
    # Seconds per element written into freshly allocated memory (page faults included); None: gamma_dense.
    # Page faults make it an order of magnitude above a dense add (docs/results_design.md).
    gamma_fresh: float | None = None
    # Measured seconds of a call that moves next to nothing, per algorithm
    # (``collectives.calibrate._fixed_costs``): its rounds, their software overhead and, on a shared host, the
    # scheduling of every rank. Given for an algorithm, it replaces that algorithm's α terms, which alone
    # under-predict few-ms calls (Python per call) and, on a shared host, every round's scheduling
    # (docs/results_design.md).
    fixed: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixed", tuple((str(a), float(t)) for a, t in self.fixed))  # JSON lists too
        for alg, t in self.fixed:
            if alg not in ALGORITHMS or not (math.isfinite(t) and t >= 0):
                raise ValueError(f"LinkModel.fixed: want (algorithm, seconds >= 0) pairs, got ({alg!r}, {t!r})")
        for name in (
            "alpha",
            "beta",
            "gamma_sparse",
            "gamma_dense",
            "gamma_scatter",
            "alpha_a2a",
            "beta_exchange",
            "gamma_fresh",
        ):
            v = getattr(self, name)
            if v is None and name in ("alpha_a2a", "beta_exchange", "gamma_fresh"):
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"LinkModel.{name} must be a finite number >= 0, got {v!r}")


# The link "auto" assumes under ``sparsync.set_deterministic`` instead of measuring one: a small cluster's
# 1 Gbit/s Ethernet, 50 µs per message (the demo's assumed link), the γ defaults above. A measured
# link differs run to run, so auto could pick another algorithm, and a different summation order, per run.
REFERENCE_LINK = LinkModel(alpha=50e-6, beta=8e-9)


@dataclass(frozen=True)
class Problem:
    world_size: int  # P
    dim: int  # N
    nnz: tuple[int, ...]  # stored entries per rank (dim for a rank whose stream is dense)
    value_bytes: int  # isize
    index_bytes: int  # c
    eager: bool = False  # every rank's payload already arrived with the metadata (collectives/meta.py)
    # Payloads up to this many bytes ride in the metadata round from the next call on, once this call has run
    # allgather (the adaptive eager region, collectives/meta.py); 0: no such region.
    eager_limit: int = 0
    # Values per entry: a row-sparse stream is priced as R entries of ``value_bytes`` = b·isize each;
    # the γ terms charge a row as one index plus b - 1 more values moved (``per_row``).
    row: int = 1
    # (m, rows in the union of m ranks' inputs) estimated from the ranks' sketches (collectives/_hll.py), in
    # increasing m from 1 to P; empty: independent uniform index sets (module doc).
    unions: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.world_size < 1 or len(self.nnz) != self.world_size:
            raise ValueError(f"Problem needs one nnz per rank: P={self.world_size}, nnz={self.nnz}")
        if self.dim < 1:
            raise ValueError(f"Problem.dim must be >= 1, got {self.dim}")

    @property
    def delta(self) -> int:
        """SparCML §3: the nnz at which the dense format becomes smaller."""
        return self.dim * self.value_bytes // (self.index_bytes + self.value_bytes)

    def per_row(self, gamma: float, link: LinkModel) -> float:
        """γ cost of one entry: ``gamma`` for its index, plus one dense add for each further value of a row."""
        return gamma + (self.row - 1) * link.gamma_dense

    @property
    def k(self) -> int:
        return max(self.nnz)

    @functools.cached_property
    def _log_q(self) -> float:
        """log of the geometric mean of (1 - nnz_i/N): computed once, union() is called per round."""
        N = self.dim
        return sum(math.log1p(-min(n, N - 1e-9) / N) if n < N else -1e9 for n in self.nnz) / self.world_size

    def union(self, m: float) -> float:
        """Expected nnz of a sum of m ranks' streams: interpolated from ``unions`` when the ranks sent sketches
        of their index sets, else that of independent uniform index sets."""
        if not self.unions:
            return self.dim * (1.0 - math.exp(self._log_q * m))
        pts = self.unions
        if m <= pts[0][0]:
            return pts[0][1] * m / pts[0][0]
        for (m0, u0), (m1, u1) in itertools.pairwise(pts):
            if m <= m1:
                return min(float(self.dim), u0 + (u1 - u0) * (m - m0) / (m1 - m0))
        return min(float(self.dim), pts[-1][1])

    def stream_bytes(self, entries: float) -> float:
        """Wire bytes of a stream with ``entries`` pairs: sparse below delta, dense above (§3)."""
        if entries >= self.delta:
            return float(self.dim * self.value_bytes)
        return entries * (self.index_bytes + self.value_bytes)

    def input_bytes(self, rank: int) -> float:
        return self.stream_bytes(self.nnz[rank])


@dataclass(frozen=True)
class Decision:
    """What "auto" chose, and why: inspectable for logs and the benchmark."""

    algorithm: str
    predictions: dict[str, float] = field(default_factory=dict)  # seconds, per candidate algorithm
    lower_bound: float = 0.0
    problem: Problem | None = None
    link: LinkModel | None = None


def _sum_cost(p: Problem, link: LinkModel, entries: float, dim: float) -> float:
    """Reduction work for ``entries`` incoming pairs on a vector of ``dim``: a sort-merge while the sum stays
    below that vector's delta (§3), else a dense buffer plus one scatter-add per pair."""
    if entries >= dim * p.value_bytes / (p.index_bytes + p.value_bytes):
        return link.gamma_dense * dim * p.row + p.per_row(link.gamma_scatter, link) * entries
    return p.per_row(link.gamma_sparse, link) * entries


def _fresh(link: LinkModel) -> float:
    return link.gamma_fresh if link.gamma_fresh is not None else link.gamma_dense


def predict(algorithm: str, p: Problem, link: LinkModel) -> float:
    """Predicted seconds of one sparse allreduce with ``algorithm`` (SparCML §4 bounds, see module doc),
    the metadata round every algorithm starts with included. With a measured fixed cost for the algorithm
    (``LinkModel.fixed``), that plus the β and γ terms."""
    fixed = dict(link.fixed).get(algorithm)
    if fixed is None or p.world_size == 1:
        return metadata_time(p, link) + _algorithm_time(algorithm, p, link)
    flat = _without_latency(link)
    t = fixed + metadata_time(p, flat) + _algorithm_time(algorithm, p, flat)
    if algorithm == "allgather" and not _allgather_inline(p):
        t += gather_latency(
            p.world_size, link
        )  # the tiny call's payload rode in its metadata round; this one's not
    return t


@functools.lru_cache(maxsize=16)
def _without_latency(link: LinkModel) -> LinkModel:
    return dataclasses.replace(link, alpha=0.0, alpha_a2a=0.0, fixed=())


def _allgather_inline(p: Problem) -> bool:
    """Whether allgather's payloads ride in the metadata round (now, or in steady state: ``eager_limit``)."""
    return p.eager or bool(p.eager_limit and max(p.input_bytes(r) for r in range(p.world_size)) <= p.eager_limit)


def metadata_time(p: Problem, link: LinkModel) -> float:
    """The metadata round (collectives/meta.py): an allgather (``gather_latency``) of one row per rank, carrying
    every rank's payload when ``p.eager``. The same for every algorithm, so it never changes a choice; it is
    counted so that predictions compare with measured call times (leaving it out under-predicted
    small calls 2-15x)."""
    P = p.world_size
    if P == 1:
        return 0.0
    b = link.beta_exchange if link.beta_exchange is not None else link.beta
    payload = 0.0
    if p.eager:
        payload = sum(p.input_bytes(r) for r in range(P)) - min(p.input_bytes(r) for r in range(P))
    return gather_latency(P, link) + b * payload


def gather_latency(P: int, link: LinkModel) -> float:
    """Latency of one allgather of sparsync's blocks: one all-to-all round up to ``DIRECT_GATHER_MAX`` ranks,
    else ``gather_steps`` exchange steps."""
    if P <= DIRECT_GATHER_MAX:
        return link.alpha_a2a if link.alpha_a2a is not None else (P - 1) * link.alpha
    return gather_steps(P) * link.alpha


def gather_steps(P: int) -> int:
    """Exchange steps of a recursive-doubling allgather on P ranks: log2 of the largest power of two <= P,
    plus the MPICH fold's 2 when P is not a power of two (collectives/_fold.py)."""
    pof2 = 1 << (P.bit_length() - 1)
    return pof2.bit_length() - 1 + (2 if pof2 != P else 0)


def _common(p: Problem, link: LinkModel) -> tuple[int, float, float, float, float]:
    """(P, N, α, β of gloo's collectives, β of our exchanges) of a prediction."""
    b = link.beta_exchange if link.beta_exchange is not None else link.beta
    return p.world_size, p.dim, link.alpha, link.beta, b


def _mean_bytes(p: Problem) -> float:
    return sum(p.input_bytes(r) for r in range(p.world_size)) / p.world_size


def _time_recursive_double(p: Problem, link: LinkModel) -> float:
    P, N, a, _, b = _common(p, link)
    pof2 = 1 << (P.bit_length() - 1)  # the MPICH fold takes P - pof2 ranks out first
    t = 0.0
    m = P / pof2
    if pof2 != P:
        t += 2 * (2 * a) + b * (p.stream_bytes(p.union(1)) + p.stream_bytes(p.union(P)))
    for _ in range(pof2.bit_length() - 1):
        t += 2 * a + b * p.stream_bytes(p.union(m)) + _sum_cost(p, link, 2 * p.union(m), N)
        m *= 2
    return t


def _split_time(p: Problem, link: LinkModel) -> float:
    """The split phase both split algorithms start with: one all-to-all round of framed blocks
    (collectives/split_allgather.py); each owner merges the P blocks of its partition, about sum(nnz)/P pairs
    on N/P entries."""
    P, N, a, _, b = _common(p, link)
    a2a = link.alpha_a2a if link.alpha_a2a is not None else (P - 1) * a
    return a2a + b * _mean_bytes(p) * (P - 1) / P + _sum_cost(p, link, sum(p.nnz) / P, N / P)


def _time_ssar_split(p: Problem, link: LinkModel) -> float:
    P, N, _, _, b = _common(p, link)
    result = p.stream_bytes(p.union(P))
    if p.union(P) >= p.delta:
        concat = link.gamma_dense * N * p.row
    else:
        concat = p.per_row(link.gamma_scatter, link) * p.union(P)
    return _split_time(p, link) + gather_latency(P, link) + b * result * (P - 1) / P + concat


def _time_dsar_split(p: Problem, link: LinkModel) -> float:
    P, N, a, b_ring, _ = _common(p, link)
    # The gathered vector is fresh memory, and a row stream's stride partition (collectives/partition.py)
    # reorders it into a second fresh vector.
    fresh = (2 if p.row > 1 else 1) * _fresh(link) * N * p.row
    return _split_time(p, link) + (P - 1) * a + b_ring * N * p.value_bytes * (P - 1) / P + fresh


def _time_allgather(p: Problem, link: LinkModel) -> float:
    P, N, _, _, b = _common(p, link)
    if p.eager:  # the gather already happened in the metadata round: only the local sum is left
        return _sum_cost(p, link, sum(p.nnz), N)
    received = sum(p.input_bytes(r) for r in range(P)) - min(p.input_bytes(r) for r in range(P))
    latency = gather_latency(P, link)
    if _allgather_inline(p):
        # Priced in steady state: in a run of calls like this one, choosing allgather makes the next
        # call's payloads ride in the metadata round every algorithm pays for, so its own rounds vanish.
        latency = 0.0
    return latency + b * received + _sum_cost(p, link, sum(p.nnz), N)


def _time_dense(p: Problem, link: LinkModel) -> float:
    P, N, a, b_ring, _ = _common(p, link)
    # A rank whose input is stored sparse (nnz below delta) densifies it first: one scatter per pair, the
    # slowest rank setting the pace (the scatter term predicts the measured difference to gloo's allreduce of
    # an already dense buffer: docs/results_design.md). From
    # DENSE_PIPELINE_MIN elements the densify runs chunk by chunk under the transfers: the first chunk's shows.
    exposed = 1 / DENSE_CHUNKS if N >= DENSE_PIPELINE_MIN else 1.0
    densify = exposed * max((p.per_row(link.gamma_scatter, link) * n for n in p.nnz if n < p.delta), default=0.0)
    return (
        2 * (P - 1) * a
        + b_ring * 2 * (P - 1) / P * N * p.value_bytes
        + (link.gamma_dense + _fresh(link)) * N * p.row  # a fresh buffer (densified or copied), one pass
        + densify
    )


def _bytes_recursive_double(p: Problem) -> float:
    rounds, m, total = int(math.log2(p.world_size)) if p.world_size > 1 else 0, 1.0, 0.0
    for _ in range(rounds):
        total += 2 * p.stream_bytes(p.union(m))
        m *= 2
    return total


def _share(p: Problem) -> float:
    return (p.world_size - 1) / p.world_size


def _bytes_ssar_split(p: Problem) -> float:
    return 2 * _share(p) * (_mean_bytes(p) + p.stream_bytes(p.union(p.world_size)))


def _bytes_dsar_split(p: Problem) -> float:
    return 2 * _share(p) * (_mean_bytes(p) + p.dim * p.value_bytes)


def _bytes_allgather(p: Problem) -> float:
    return 2 * _mean_bytes(p) * (p.world_size - 1)


def _bytes_dense(p: Problem) -> float:
    return 4 * _share(p) * p.dim * p.value_bytes


@dataclass(frozen=True)
class Algorithm:
    """One SparCML sparse allreduce algorithm, everything sparsync knows of it in one object: auto
    (``predict`` and the policies), the plan (``nbytes``), the metadata round (``code``), calibration and the
    collectives (``run``) all iterate over ``REGISTRY``. Adding an algorithm is one more entry there, its
    ``time`` and ``nbytes`` here and its runner in its own module.

    ``time``: α-β-γ seconds of its own phases (``predict`` adds the metadata round); ``nbytes``: sent +
    received bytes per rank (expected sizes); ``code``: its value in the metadata row (0 is auto);
    ``simplicity``: ``choose_robust``'s order among near-ties, fewer dependent phases first; ``runner``:
    "module:function" of ``(comm, stream, meta, partition) -> summed stream``, imported at first use (the
    collectives sit above this model)."""

    name: str
    code: int
    simplicity: int
    time: Callable[[Problem, LinkModel], float]
    nbytes: Callable[[Problem], float]
    runner: str

    def run(self) -> Callable[..., SparseStream]:
        module, fn = self.runner.split(":")
        return getattr(importlib.import_module(module), fn)  # type: ignore[no-any-return]


_C = "sparsync.collectives."
REGISTRY = (  # SparCML §4.1's three cases, Horovod/DDP's allgather, and the dense switch (§3)
    Algorithm("ssar_recursive_double", 1, 2, _time_recursive_double, _bytes_recursive_double,
              _C + "recursive_double:run"),
    Algorithm("ssar_split_allgather", 2, 3, _time_ssar_split, _bytes_ssar_split, _C + "split_allgather:run_ssar"),
    Algorithm("dsar_split_allgather", 3, 4, _time_dsar_split, _bytes_dsar_split, _C + "split_allgather:run_dsar"),
    Algorithm("allgather", 4, 0, _time_allgather, _bytes_allgather, _C + "allreduce:allgather_sum"),
    Algorithm("dense", 5, 1, _time_dense, _bytes_dense, _C + "dense:run"),
)  # fmt: skip
ALGORITHMS = tuple(a.name for a in REGISTRY)
_BY_NAME = {a.name: a for a in REGISTRY}


def algorithm(name: str) -> Algorithm:
    """The registry's entry for ``name``; ``KeyError`` listing the valid names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; valid: {', '.join(ALGORITHMS)}") from None


def _algorithm_time(name: str, p: Problem, link: LinkModel) -> float:
    a = algorithm(name)
    return 0.0 if p.world_size == 1 else a.time(p, link)


def lower_bound(p: Problem, link: LinkModel) -> float:
    """α-β lower bound of any sparse allreduce (SparCML Lemma 4.1 and Theorem 4.2).

    log2(P)·α plus the larger of the two valid bandwidth bounds 2(P-1)/P·k·βd (dense allreduce on the
    k-subspace) and (K-k)·βd (each rank must receive the K-k result entries it lacks); at K = kP and K = k this
    is exactly Lemma 4.1's two cases, and for dense inputs (k = N) it is the dense allreduce bound.
    A dense expected result (K >= delta) does not raise the bound to N·βd: with sparse inputs a rank only has
    to learn the K-k entries it lacks (e.g. P=2, 30% density each: one exchange of 0.3·N pairs suffices).
    """
    P = p.world_size
    if P == 1:
        return 0.0
    beta_d = link.beta * p.value_bytes
    K = p.union(P)
    lat = math.log2(P) * link.alpha
    return lat + max(2 * (P - 1) / P * p.k * beta_d, (K - p.k) * beta_d)


Policy = Callable[[Problem, LinkModel], Decision]


def choose_fastest(p: Problem, link: LinkModel, candidates: tuple[str, ...] = ALGORITHMS) -> Decision:
    """Default policy: the candidate with the smallest predicted time (ties: the earlier in ``candidates``)."""
    preds = {alg: predict(alg, p, link) for alg in candidates}
    best = min(candidates, key=lambda alg: preds[alg])
    return Decision(best, preds, lower_bound(p, link), p, link)


# Fewest dependent phases first: one gather, gloo's ring, log2 P exchanges, then the two-phase split algorithms.
SIMPLICITY = tuple(a.name for a in sorted(REGISTRY, key=lambda a: a.simplicity))
# Predictions within this fraction of the fastest count as a tie (chosen, not tuned; see choose_robust).
TIE_MARGIN = 0.10


def choose_robust(
    p: Problem, link: LinkModel, candidates: tuple[str, ...] = ALGORITHMS, margin: float = TIE_MARGIN
) -> Decision:
    """The default policy of ``sparse_allreduce``: the simplest candidate (``SIMPLICITY`` order) whose
    predicted time is within ``margin`` of the fastest prediction.

    Why: on this 2-core VM behind tc-shaped links the model's predictions miss measured times by
    1.5-2x, mostly by the same factor for every algorithm, so clear wins are reliable but near-ties are not.
    In near-ties the algorithm with more dependent phases lost in every measured case: the split algorithms
    (an all-to-all, then an allgather) against allgather on embedding gradients, and against sparsync's dense
    at density 0.3 (figures: docs/results_design.md).
    """
    preds = {alg: predict(alg, p, link) for alg in candidates}
    fastest = min(preds.values())
    near = [alg for alg in candidates if preds[alg] <= fastest * (1 + margin)]
    best = min(near, key=lambda alg: SIMPLICITY.index(alg) if alg in SIMPLICITY else len(SIMPLICITY))
    return Decision(best, preds, lower_bound(p, link), p, link)
