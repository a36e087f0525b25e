"""The α-β(-γ) cost model of SparCML §4 and the policy that picks an allreduce algorithm from it.

Data (``LinkModel``, ``Problem``) is kept apart from the selection policy (``choose_fastest``), so a user can
set a measured or assumed link, or replace the policy. Each algorithm's own time and bytes models sit beside
its runner, in the ``AlgorithmEntry`` its module declares (``collectives/recursive_double.py``, ...);
``REGISTRY`` collects the entries, and this module holds the terms they share (the metadata round, gathers,
reduction work).

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
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sparsync.registry import Registry  # a leaf (level 0): the model imports no collective

if TYPE_CHECKING:  # the stream type for the checker only: at run time the model imports no more of sparsync
    from sparsync.stream import SparseStream

# The ``dense`` algorithm on a sparse-stored input of at least DENSE_PIPELINE_MIN elements densifies and reduces
# it in DENSE_CHUNKS pieces, each piece's allreduce started as soon as it is filled (collectives/allreduce.py).
# (Chosen, not tuned: 4M elements. Measured to help at 16M, where the chunks' extra ring latencies hid under the
# transfer; at small N those latencies could outweigh the densify they hide.)
DENSE_PIPELINE_MIN = 1 << 22
DENSE_CHUNKS = 4
# Allgathers of sparsync's own blocks (the metadata round, allgather's payloads, the split's second phase) on
# up to this many ranks send each block to every peer in one round (collectives/_gather.py), beyond it by
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
            if alg not in REGISTRY or not (math.isfinite(t) and t >= 0):
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
    # (m, rows in the union of m ranks' inputs) from the ranks' HyperLogLog registers (collectives/_hll.py), in
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
        """Expected nnz of a sum of m ranks' streams: interpolated from ``unions`` when the ranks sent HyperLogLog
        registers of their index sets, else that of independent uniform index sets."""
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


def sum_cost(p: Problem, link: LinkModel, entries: float, dim: float) -> float:
    """Reduction work for ``entries`` incoming pairs on a vector of ``dim``: a sort-merge while the sum stays
    below that vector's delta (§3), else a dense buffer plus one scatter-add per pair."""
    if entries >= dim * p.value_bytes / (p.index_bytes + p.value_bytes):
        return link.gamma_dense * dim * p.row + p.per_row(link.gamma_scatter, link) * entries
    return p.per_row(link.gamma_sparse, link) * entries


def fresh_cost(link: LinkModel) -> float:
    """Seconds per element written into freshly allocated memory (``LinkModel.gamma_fresh``)."""
    return link.gamma_fresh if link.gamma_fresh is not None else link.gamma_dense


def predict(algorithm: str, p: Problem, link: LinkModel) -> float:
    """Predicted seconds of one sparse allreduce with ``algorithm`` (SparCML §4 bounds, see module doc),
    the metadata round every algorithm starts with included. With a measured fixed cost for the algorithm
    (``LinkModel.fixed``), that plus the β and γ terms."""
    entry = REGISTRY.entry(algorithm)
    fixed = dict(link.fixed).get(algorithm)
    if fixed is None or p.world_size == 1:
        return metadata_time(p, link) + _own_time(entry, p, link)
    flat = _without_latency(link)
    t = fixed + metadata_time(p, flat) + _own_time(entry, p, flat)
    if entry.rides_metadata and not payload_inline(p):
        t += gather_latency(
            p.world_size, link
        )  # the tiny call's payload rode in its metadata round; this one's not
    return t


@functools.lru_cache(maxsize=16)
def _without_latency(link: LinkModel) -> LinkModel:
    return dataclasses.replace(link, alpha=0.0, alpha_a2a=0.0, fixed=())


def payload_inline(p: Problem) -> bool:
    """Whether every payload rides in the metadata round (now, or in steady state: ``eager_limit``), as an
    algorithm whose entry says ``rides_metadata`` (allgather) gets them."""
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
    plus the MPICH fold's 2 when P is not a power of two (collectives/_gather.py)."""
    pof2 = 1 << (P.bit_length() - 1)
    return pof2.bit_length() - 1 + (2 if pof2 != P else 0)


def terms(p: Problem, link: LinkModel) -> tuple[int, float, float, float, float]:
    """(P, N, α, β of gloo's collectives, β of our exchanges) of a prediction."""
    b = link.beta_exchange if link.beta_exchange is not None else link.beta
    return p.world_size, p.dim, link.alpha, link.beta, b


def mean_bytes(p: Problem) -> float:
    """The ranks' mean input bytes."""
    return sum(p.input_bytes(r) for r in range(p.world_size)) / p.world_size


def share(p: Problem) -> float:
    """(P - 1) / P: the part of a vector a ring or an all-to-all moves off each rank."""
    return (p.world_size - 1) / p.world_size


# What a registry entry runs: the communicator (``collectives.comm.Comm``), this rank's stream, the metadata
# round's result (``collectives.meta.Meta``) and the resolved partition kind (``collectives/partition.py``; "-"
# for an algorithm without one) -> the sum. The arguments are left untyped here: the collectives import this
# module, so naming their types would make an import circle.
Runner = Callable[..., "SparseStream"]


@dataclass(frozen=True)
class AlgorithmEntry:
    """One sparse allreduce algorithm, everything sparsync knows of it in one object, declared in the module
    that implements it (SSAR/DSAR of SparCML §4.1, the allgather, the dense switch of §3) and collected by
    ``REGISTRY``: auto (``predict`` and the policies), the plan (``nbytes``), the metadata round (``code``,
    ``rides_metadata``), the call's record (``uses_partition``), calibration and the collectives (``runner``)
    all read it."""

    name: str
    code: int  # its value in the metadata row's algorithm column: unique, >= 1 (0 is auto)
    simplicity: int  # ``choose_robust``'s order among near-ties: fewer dependent phases first
    time: Callable[[Problem, LinkModel], float]  # α-β-γ seconds of its own phases (``predict`` adds metadata)
    nbytes: Callable[[Problem], float]  # sent + received bytes per rank (expected sizes)
    runner: Runner  # ``(comm, stream, meta, partition) -> summed stream``, bitwise identical on every rank
    uses_partition: bool = False  # assigns rows to owners (``partition=``): the call's record names the kind
    # Its payloads ride in the metadata round (the eager protocol, collectives/meta.py): after a call of it, calls
    # of the same signature inline payloads up to its size, and a measured fixed cost includes no data round.
    rides_metadata: bool = False


class AlgorithmRegistry(Registry[AlgorithmEntry]):
    """The sparse allreduce algorithms ``auto`` chooses among, by name, in code order. The collectives
    register the built-in ones (``collectives/algorithms.py``); an algorithm from outside the package is one
    ``register`` (or, for a scope such as a test, ``with REGISTRY.registered(entry):``)."""

    noun = "algorithm"

    def __init__(self, entries: Iterable[AlgorithmEntry] = ()) -> None:
        self._names: tuple[str, ...] = ()
        self._simplicity: tuple[str, ...] = ()
        super().__init__(entries)

    def check(self, entry: AlgorithmEntry) -> None:
        """ValueError when ``entry``'s name or code is taken (or reserved: ``auto``, ``-``, code 0)."""
        if not entry.name or entry.name in ("auto", "-") or entry.name in self._by_name:
            raise ValueError(f"algorithm name {entry.name!r} is reserved or taken; taken: {', '.join(self.names)}")
        taken = {e.code: e.name for e in self._by_name.values()}
        if entry.code < 1 or entry.code in taken:
            raise ValueError(
                f"algorithm {entry.name!r}: code {entry.code} must be >= 1 and unused (the metadata row's column; "
                f"taken: {sorted(taken.items())})"
            )

    def copy(self) -> AlgorithmRegistry:
        return AlgorithmRegistry(self)

    def _changed(self) -> None:
        ordered = sorted(self._by_name.values(), key=lambda e: e.code)
        self._names = tuple(e.name for e in ordered)
        self._simplicity = tuple(e.name for e in sorted(ordered, key=lambda e: e.simplicity))

    def by_code(self, code: int) -> AlgorithmEntry:
        """The entry whose metadata code is ``code``; ``KeyError`` when none is."""
        for e in self._by_name.values():
            if e.code == code:
                return e
        raise KeyError(f"no algorithm has code {code}; codes: {sorted(e.code for e in self._by_name.values())}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every algorithm's name, in code order (``choose_fastest``'s order among exact ties)."""
        return self._names

    @property
    def simplicity(self) -> tuple[str, ...]:
        """The names in ``choose_robust``'s tie order: by ``simplicity``, then code."""
        return self._simplicity


# Every algorithm of this process: SparCML §4.1's three cases, Horovod/DDP's allgather, and the dense switch
# (§3), registered by ``sparsync.collectives`` at import, plus any a user registers.
REGISTRY = AlgorithmRegistry()


def algorithm(name: str) -> AlgorithmEntry:
    """The registry's entry for ``name``; ``KeyError`` listing the valid names."""
    return REGISTRY.entry(name)


def _own_time(entry: AlgorithmEntry, p: Problem, link: LinkModel) -> float:
    return 0.0 if p.world_size == 1 else entry.time(p, link)


def __getattr__(name: str) -> tuple[str, ...]:
    """``ALGORITHMS`` and ``SIMPLICITY``: the registry's names (code order, tie order) when read. Computed on
    access, since the collectives register the algorithms after this module is imported."""
    if name == "ALGORITHMS":
        return REGISTRY.names
    if name == "SIMPLICITY":
        return REGISTRY.simplicity
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def choose_fastest(p: Problem, link: LinkModel, candidates: tuple[str, ...] | None = None) -> Decision:
    """Default policy: the candidate (default: every registered algorithm, ``ALGORITHMS``) with the smallest
    predicted time (ties: the earlier in ``candidates``)."""
    candidates = REGISTRY.names if candidates is None else candidates
    preds = {alg: predict(alg, p, link) for alg in candidates}
    best = min(candidates, key=lambda alg: preds[alg])
    return Decision(best, preds, lower_bound(p, link), p, link)


# Predictions within this fraction of the fastest count as a tie (chosen, not tuned; see choose_robust).
TIE_MARGIN = 0.10


def choose_robust(
    p: Problem, link: LinkModel, candidates: tuple[str, ...] | None = None, margin: float = TIE_MARGIN
) -> Decision:
    """The default policy of ``sparse_allreduce``: the simplest candidate (default: every registered
    algorithm) in ``SIMPLICITY`` order (fewest dependent phases first: one gather, gloo's ring, log2 P
    exchanges, then the two-phase split algorithms) whose predicted time is within ``margin`` of the fastest
    prediction.

    Why: the model's predictions can miss measured times by a factor that is mostly the same for every
    algorithm, so clear wins are reliable but near-ties are not, and in near-ties the algorithm with more
    dependent phases lost in every measured case (the measurements: docs/results_design.md).
    """
    candidates = REGISTRY.names if candidates is None else candidates
    preds = {alg: predict(alg, p, link) for alg in candidates}
    fastest = min(preds.values())
    near = [alg for alg in candidates if preds[alg] <= fastest * (1 + margin)]
    order = REGISTRY.simplicity
    best = min(near, key=lambda alg: order.index(alg) if alg in order else len(order))
    return Decision(best, preds, lower_bound(p, link), p, link)
