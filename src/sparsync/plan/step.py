"""The step as ``DistributedOptimizer`` sends a plan (``Plan.step``): the dense-allreduce parameters in its
buckets, the replicated sparse ones in one grouped call per row width and item size, the sharded tables in one
exchange, the parameter-server tables in one push and apply round to every server, each priced by the algorithm
the backend runs for that call at that size and P (``plan.backend``).

The buckets are DDP's, cut by the rule ``DistributedOptimizer`` uses (``placement.bucketing``): the parameters
in reverse registration order (backward meets the last layers first), a new bucket at each change of dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from sparsync.costmodel import LinkModel, Problem, algorithm, choose_robust, predict
from sparsync.placement.bucketing import DenseRuns
from sparsync.plan.backend import dense_allreduce
from sparsync.plan.cluster import Cluster
from sparsync.stream import index_dtype_for

# The kinds the step model prices as calls of their own (the rest: their shared time plus their entries')
CALLS = ("dense_allreduce", "sparse_allreduce")
# The kinds whose reduction runs beside backward (``DistributedOptimizer``'s reduction during backward); the
# others run on the step's path (the sharded exchange on the caller's thread, the servers' pulls in forward)
HIDDEN = ("dense_allreduce", "sparse_allreduce", "sketch")


class Priced(Protocol):
    """What the step reads of a plan entry (``planner.Entry``)."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def placement(self) -> str: ...
    @property
    def bytes_per_machine(self) -> float: ...
    @property
    def seconds(self) -> float: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def row_fraction_machine(self) -> float: ...


@dataclass(frozen=True)
class Part:
    """One call (or round) of the step."""

    label: str  # e.g. "dense bucket 1 of 2", "sparse_allreduce group (row 16)", "sharded"
    kind: str  # the placement kind whose parameters it carries
    members: tuple[str, ...]  # their names
    nbytes: float  # per machine, sent + received
    seconds: float  # predicted
    algorithm: str = ""  # what runs it (ring, tree, a SparCML algorithm); "" for a kind's own rounds
    hidden: bool = True  # runs beside backward (``HIDDEN``), else on the step's path


@dataclass(frozen=True)
class Step:
    parts: tuple[Part, ...]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.parts)

    def exposed(self, overlap: float) -> float:
        """The step's communication less what hides behind ``overlap`` seconds of backward (not below zero)."""
        hidden = sum(p.seconds for p in self.parts if p.hidden)
        return max(0.0, hidden - overlap) + self.seconds - hidden


def bucket_layout(sizes: Sequence[tuple[int, int]]) -> list[list[int]]:
    """The dense buckets of parameters of (bytes, item size) ``sizes`` in registration order: each bucket's
    indices, in launch order (module doc)."""
    runs = DenseRuns()
    for i in reversed(range(len(sizes))):
        nbytes, itemsize = sizes[i]
        runs.add(i, itemsize, nbytes)
    return runs.runs


def price_step(entries: Sequence[Priced], cluster: Cluster, shared: Mapping[str, float]) -> Step:
    """The step of ``entries`` as the trainer sends them (module doc). ``shared``: each kind's time per step
    that its parameters share (``PlacementKind.shared_seconds``), paid where the kind has an entry. On a
    two-level cluster the replicated sparse parameters are priced one call each (their entries' seconds)."""
    parts = _dense_parts([e for e in entries if e.placement == "dense_allreduce"], cluster)
    sparse = [e for e in entries if e.placement == "sparse_allreduce"]
    if cluster.two_level:
        parts += [Part(e.name, e.placement, (e.name,), e.bytes_per_machine, e.seconds) for e in sparse]
    else:
        parts += _sparse_parts(sparse, cluster)
    kinds = dict.fromkeys(e.placement for e in entries if e.placement not in CALLS)
    for kind in kinds:
        members = [e for e in entries if e.placement == kind]
        seconds = shared.get(kind, 0.0) + sum(e.seconds for e in members)
        parts.append(Part(kind, kind, tuple(e.name for e in members), sum(e.bytes_per_machine for e in members),
                          seconds, hidden=kind in HIDDEN))  # fmt: skip
    return Step(tuple(parts))


def _dense_parts(dense: Sequence[Priced], cluster: Cluster) -> list[Part]:
    sizes = [(math.prod(e.shape) * e.itemsize, e.itemsize) for e in dense]
    share = 4 * (cluster.machines - 1) / cluster.machines  # Table 3's ring bytes, sent + received
    out = []
    layout = bucket_layout(sizes)
    for j, members in enumerate(layout):
        nbytes = sum(sizes[i][0] for i in members)
        alg, seconds = dense_allreduce(nbytes, cluster, sizes[members[0]][1])
        out.append(Part(f"dense bucket {j + 1} of {len(layout)}", "dense_allreduce",
                        tuple(dense[i].name for i in members), share * nbytes, seconds, alg))  # fmt: skip
    return out


def _sparse_parts(sparse: Sequence[Priced], cluster: Cluster) -> list[Part]:
    """One ``grouped_allreduce`` per (row width, item size), priced as ``auto`` would run its stream."""
    groups: dict[tuple[int, int], list[Priced]] = {}
    for e in sparse:
        groups.setdefault((math.prod(e.shape[1:]), e.itemsize), []).append(e)
    out = []
    for (width, size), members in groups.items():
        alg, seconds, nbytes = grouped_call(members, 0, width, size, cluster.machines, cluster.link)
        out.append(Part(f"sparse_allreduce group (row {width})", "sparse_allreduce",
                        tuple(e.name for e in members), nbytes, seconds, alg))  # fmt: skip
    return out


def grouped_call(
    members: Sequence[Priced],
    extra: int,
    width: int,
    itemsize: int,
    machines: int,
    link: LinkModel,
    use: str | None = None,
) -> tuple[str, float, float]:
    """(algorithm, seconds, bytes per machine) of one ``grouped_allreduce`` of ``members``' rows (each machine
    holding α_m of them) and ``extra`` rows every rank holds (dense gradients packed behind them): by the
    algorithm ``auto`` would pick, or by ``use``."""
    rows = sum(e.shape[0] for e in members) + extra
    k = sum(max(1, round(e.row_fraction_machine * e.shape[0])) for e in members) + extra
    p = Problem(machines, rows, (min(k, rows),) * machines, itemsize * width, index_dtype_for(rows).itemsize,
                row=width)  # fmt: skip
    if use is not None:
        return use, predict(use, p, link), algorithm(use).nbytes(p)
    d = choose_robust(p, link)
    return d.algorithm, d.predictions[d.algorithm], algorithm(d.algorithm).nbytes(p)


def without_latency(link: LinkModel) -> LinkModel:
    """``link`` with its per-message terms off: what one more row adds to a call that is made anyway."""
    return dataclasses.replace(link, alpha=0.0, alpha_a2a=0.0, fixed=())
