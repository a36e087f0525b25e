"""The placement kinds a plan chooses among (Parallax §3.1, Table 3), one record each: its name, whether it is
lossy, its cost estimate (bytes per machine per step, and the α-β time one more parameter adds to the step's
call of its kind: its marginal cost; the call's latency, paid once, is the kind's ``shared_seconds`` or the
step model's, ``plan.step``; ``planner``'s module doc gives the formulas) and how to make its ``Placement``.
``plan.registry`` collects them; a kind from outside the package is one more ``PlacementKind``, registered
there."""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from sparsync.collectives.hierarchical import HIER_MARGIN, flat_link, price_levels
from sparsync.compress.sketch import SparseSketch
from sparsync.costmodel import Problem, algorithm, choose_robust, predict
from sparsync.placement.base import Placement
from sparsync.placement.bucketing import CAP_BYTES
from sparsync.placement.collective import DenseAllreduce, SparseAllreduce
from sparsync.placement.sharded import Sharded
from sparsync.placement.sketch import Sketch
from sparsync.plan.backend import all_to_all_latency, allreduce_candidates, dense_allreduce
from sparsync.plan.cluster import Cluster
from sparsync.plan.detect import ParamStats
from sparsync.plan.step import without_latency
from sparsync.stream import index_dtype_for


@dataclass(frozen=True)
class Estimate:
    """What one parameter costs per step under one placement kind."""

    nbytes: float  # per machine, sent + received
    seconds: float  # predicted communication time
    detail: str = ""  # how (e.g. the SparCML algorithm behind sparse_allreduce), for the plan's entry


@dataclass(frozen=True)
class MakeOptions:
    """What a trainer gives the kinds to make their placement objects (``registry.objects``)."""

    sketch: SparseSketch | None = None  # the sketch kind's compressor; None: ``Sketch``'s default
    sketch_error_feedback: bool = False  # the sketch kind keeps each worker's residual
    # the parameter server's placement: its servers must be started first, so the trainer makes it, not the kind
    servers: Placement | None = None


class PlacementKind(ABC):
    """One placement kind, everything sparsync knows of it in one object: its name (the string a plan names,
    the ``Placement.kind`` of the objects it makes), whether it is lossy (chosen only with
    ``make_plan(allow_lossy=True)``), its estimate, and how to make its placement. ``registry.KINDS`` collects
    them."""

    name: str = "placement"
    lossy: bool = False
    # Its placement runs only on a module swapped for it first (``sparsync.shard``): ``make_plan`` chooses it only
    # when told that the caller swaps modules (``swap_modules=True``) or when an override names it, since
    # HybridTrainer and DistributedOptimizer alone cannot run it.
    swaps_module: bool = False

    @abstractmethod
    def estimate(self, s: ParamStats, c: Cluster, *, sketch: SparseSketch) -> Estimate | None:
        """The cost of ``s`` placed this way on ``c``; None when the kind does not fit the parameter (a
        sparse placement for a dense one). ``sketch``: the sketch compressor the plan prices. A kind whose
        parameters travel together (``shared_seconds``) gives here only what one more parameter adds."""

    def shared_seconds(self, c: Cluster) -> float:
        """Time per step that all parameters of this kind share, paid once however many there are: the
        latency of one grouped exchange (``sharded``). ``make_plan`` uses the kind only where what its
        parameters save together exceeds it. Default 0: each parameter pays its own."""
        del c
        return 0.0

    @abstractmethod
    def make(self, options: MakeOptions) -> Placement | None:
        """The one placement object every parameter of this kind shares (a sketch keeps one hash counter and
        one residual store for all its parameters); None when ``options`` cannot make it (those parameters are
        left out)."""


def machine_row_fraction(s: ParamStats, procs: int) -> float:
    """α of a machine's workers together: recorded, else independent uniform rows 1-(1-α)^procs (an upper
    bound for skewed inputs such as Zipf tokens, whose workers overlap more)."""
    if s.row_fraction_machine is not None:
        return s.row_fraction_machine
    return 1.0 - (1.0 - s.row_fraction) ** procs


def _share(c: Cluster) -> float:
    return (c.machines - 1) / c.machines


class DenseAllreduceKind(PlacementKind):
    """Dense allreduce in ``DistributedOptimizer``'s buckets: 4w(N-1)/N bytes (Table 3). One more parameter adds
    its bytes to a bucket sent anyway (``plan.step``), at the bandwidth of the algorithm the backend runs for a
    full bucket (``plan.backend``): its estimate. The buckets' latency is the step's (``Plan.step``), however
    many parameters they carry."""

    name = "dense_allreduce"

    def estimate(self, s: ParamStats, c: Cluster, *, sketch: SparseSketch) -> Estimate:
        alg, _ = dense_allreduce(CAP_BYTES, c, s.itemsize)
        cand = allreduce_candidates(float(s.nbytes), c, s.itemsize)
        empty = allreduce_candidates(0.0, c, s.itemsize)
        return Estimate(4 * float(s.nbytes) * _share(c), cand[alg] - empty[alg], f"{alg} bucket")

    def make(self, options: MakeOptions) -> Placement:
        return DenseAllreduce()


class SketchKind(PlacementKind):
    """S2's sketch: ring dense allreduces of the sketch's payload (bitmap and table); lossy."""

    name = "sketch"
    lossy = True

    def estimate(self, s: ParamStats, c: Cluster, *, sketch: SparseSketch) -> Estimate:
        N = c.machines
        skb = sketch.payload_nbytes(s.shape, s.itemsize)
        sk = -(-skb // s.itemsize)  # entries, as one dense allreduce of the same bytes
        return Estimate(4 * skb * _share(c), predict("dense", Problem(N, sk, (sk,) * N, s.itemsize, 4), c.link))

    def make(self, options: MakeOptions) -> Placement:
        return Sketch(options.sketch, error_feedback=options.sketch_error_feedback)


class SparseAllreduceKind(PlacementKind):
    """SparCML: the algorithm ``auto`` would pick for N ranks each holding α_m of the rows (flat or, on two
    levels, hierarchical). On one level the replicated sparse parameters of one row width travel in one
    ``grouped_allreduce`` (``plan.step``): a parameter's estimate is what its rows add to it (the call priced
    without its per-message terms). On two levels, its own call."""

    name = "sparse_allreduce"

    def estimate(self, s: ParamStats, c: Cluster, *, sketch: SparseSketch) -> Estimate | None:
        N = c.machines
        if not s.sparse or N == 1:
            return None
        am = machine_row_fraction(s, c.procs_per_machine)
        rows, per_row = s.shape[0], s.numel // s.shape[0]
        k = max(1, round(am * rows))  # touched rows: one index per row of per_row values (coo_to_stream)
        itype = index_dtype_for(rows).itemsize
        p = Problem(N, rows, (k,) * N, s.itemsize * per_row, itype, row=per_row)
        if c.two_level:
            (nbytes, seconds), how = _two_level(s, c, p)
            return Estimate(nbytes, seconds, how)
        d = choose_robust(p, c.link)  # what auto would run (its default policy)
        # what its rows add to the grouped call the step makes anyway (``plan.step``): their bytes and merges
        added = predict(d.algorithm, p, without_latency(c.link))
        return Estimate(algorithm(d.algorithm).nbytes(p), added, d.algorithm)

    def make(self, options: MakeOptions) -> Placement:
        return SparseAllreduce()


class ParameterServerKind(PlacementKind):
    """Parallax's servers: 4·α_m·w(N-1)/N bytes (Table 3). A sync step costs a table one pull (request and
    reply: its forward hook waits for it) and the step one push and one apply, every table's to every server at
    once (``ps.placement.ParameterServer.aggregate`` waits for them together): four latencies shared by the
    kind (``shared_seconds``), two more per table. With the cluster's measured ``ServerModel``: one round trip
    per table, two shared."""

    name = "ps"

    def estimate(self, s: ParamStats, c: Cluster, *, sketch: SparseSketch) -> Estimate | None:
        if not s.sparse or c.machines == 1:
            return None
        am = machine_row_fraction(s, c.procs_per_machine)
        ps_bytes = 4 * am * float(s.nbytes) * _share(c)
        if c.server is not None:  # measured: the request path and the servers' CPU included
            pull = am * float(s.nbytes)
            return Estimate(ps_bytes, c.server.round_trip + 2 * c.server.per_byte * pull, "measured server")
        return Estimate(ps_bytes, 2 * c.link.alpha + c.link.beta * ps_bytes / 2)

    def shared_seconds(self, c: Cluster) -> float:
        if c.server is not None:
            return 2 * c.server.round_trip
        return 4 * c.link.alpha

    def make(self, options: MakeOptions) -> Placement | None:
        return options.servers


ROUNDS = 3  # all-to-all rounds of a sharded step (``shard.exchange``): ids, rows; gradient rows
# i, an id's bytes on the wire: an int64 in a block padded to 1.25x the widest count (``shard.header.MARGIN``)
ID_WIRE_BYTES = 10.0


class ShardedKind(PlacementKind):
    """Rows owned by the ranks (``sparsync.shard``): each rank sends each of its u distinct ids once to the
    owner, receives each row once and pushes one gradient row per distinct id back, all in the training group.

    Per rank and step the requests cost f·u·(i + 2·w·D) bytes one way (an int64 id, a row in, a gradient row
    out; f = (P-1)/P of them cross to another rank: the issue's f·Σ_t u_t(B)·(8 + 8D) at w = 4 and i = 8), and
    serving the others' requests as much again, so sent + received per machine of m workers is
    2·m·f_m·u·(i + 2·w·D), f_m =
    (P-m)/P the share owned off the machine. u = ``row_fraction``·rows: α is exactly the distinct rows one
    worker reads per step over the rows, u(B)/R (``RowFractionMeter``). Time: three all-to-all rounds (ids headed
    by their counts, rows; gradient rows in backward: ``shard.exchange``), each (P-1)·α unless the link has a
    measured ``alpha_a2a`` (on two levels ``plan.backend.all_to_all_latency``), plus one direction's bytes at
    the exchange's β. All sharded tables of a model travel in one exchange (``sparsync.shard``),
    so the rounds' latency is the kind's ``shared_seconds``, paid once per step, and a table's estimate is only
    its bytes' time. With the cluster's ``exchange_cpu`` the exchange's CPU is priced too: its ``per_step`` in
    ``shared_seconds``, ``per_table + per_key·u`` in a table's estimate. The owners' apply is not priced, as the
    parameter server's is not."""

    name = "sharded"
    swaps_module = True

    def estimate(self, s: ParamStats, c: Cluster, *, sketch: SparseSketch) -> Estimate | None:
        m = c.procs_per_machine
        P = c.machines * m
        if not s.sparse:
            return None
        if P == 1:  # the whole table on the one rank: nothing crosses (chosen only when pinned: a tie goes to the
            return Estimate(0.0, 0.0)  # kind listed first)
        rows, D = s.shape[0], s.numel // s.shape[0]
        u = s.row_fraction * rows
        nbytes = 2 * m * u * (P - m) / P * (ID_WIRE_BYTES + 2 * s.itemsize * D)
        beta = c.link.beta_exchange if c.link.beta_exchange is not None else c.link.beta
        cpu = 0.0 if c.exchange_cpu is None else c.exchange_cpu.seconds(1, u) - c.exchange_cpu.per_step
        return Estimate(nbytes, beta * nbytes / 2 + cpu)

    def shared_seconds(self, c: Cluster) -> float:
        cpu = 0.0 if c.exchange_cpu is None else c.exchange_cpu.per_step
        return ROUNDS * all_to_all_latency(c) + cpu

    def make(self, options: MakeOptions) -> Placement:
        return Sharded()


def _two_level(s: ParamStats, c: Cluster, machines: Problem) -> tuple[tuple[float, float], str]:
    """Sparse allreduce over N machines of k ranks: flat over all N·k ranks (each with the worker's
    α) or hierarchical (``collectives.hierarchical.price_levels``: reduce-scatter inside the machine, allreduce
    of the machine sums' partitions across machines, allgather inside), whichever is predicted faster, as
    ``hierarchical_allreduce(mode="auto")`` runs it. Bytes per machine: what crosses the machine's NIC."""
    N, m = c.machines, c.procs_per_machine
    P, rows = N * m, machines.dim
    worker = max(1, round(s.row_fraction * rows))
    # Unions for the model: one machine's m ranks touch its α_machine (recorded, or the uniform bound); j
    # machines, independent of each other as in the one-level plan, 1 - (1 - α_machine)^j of the rows.
    am = min(1.0, machines.nnz[0] / rows)
    unions = [(1.0, float(worker))]
    unions += [(float(j * m), max(float(worker), rows * -math.expm1(j * math.log1p(-min(am, 1 - 1e-12)))))
               for j in range(1, N + 1)]  # fmt: skip
    p = dataclasses.replace(machines, world_size=P, nnz=(worker,) * P, unions=tuple(unions))
    world, intra, inter = c.level_links()
    preds = price_levels(p, [list(range(h * m, (h + 1) * m)) for h in range(N)], world, intra, inter)
    share = (P - m) / max(P - 1, 1)  # of a rank's bytes, the part that leaves the machine
    flat_alg = choose_robust(p, flat_link(world, inter, P, m)).algorithm
    both = f"flat {preds['flat'] * 1e3:.3g} ms, hierarchical {preds['hierarchical'] * 1e3:.3g} ms"
    if preds["hierarchical"] * (1 + HIER_MARGIN) < preds["flat"]:  # auto's rule (hierarchical_allreduce)
        part = dataclasses.replace(
            machines, dim=max(1, -(-rows // m)), nnz=(round(p.union(m) / m),) * N, unions=()
        )
        cross = choose_robust(part, inter).algorithm
        return (m * algorithm(cross).nbytes(part), preds["hierarchical"]), f"hierarchical: {cross} across; {both}"
    return (m * share * algorithm(flat_alg).nbytes(p), preds["flat"]), f"flat: {flat_alg}; {both}"
