"""The placement plan: per parameter one of the registered placement kinds (``plan.registry.KINDS``: dense
allreduce, sparse allreduce (SparCML), sketch (S2), parameter server, rows sharded over the ranks, and any
registered from outside), chosen by predicted communication time (Parallax §3.1, Table 3, with the α-β model of
``sparsync.costmodel``).

Bytes per machine per step (w: the parameter's bytes, N: machines, α_m: fraction of rows the machine's
workers touch together, i.e. after local aggregation):

- dense allreduce: 4w(N-1)/N (Table 3, ring; bytes alike for NCCL's tree, priced apart in ``plan.backend``);
- parameter server: 4·α_m·w(N-1)/N (Table 3, partitions spread evenly over the N colocated servers): a machine
  pulls and pushes α_m·w(N-1)/N to remote servers, and its server serves the same to the others;
- sparse allreduce: the SparCML algorithm ``auto`` would pick for N ranks each holding α_m of the rows, on the
  row-sparse stream ``sparsync.allreduce(coo)`` sends: one index per touched row (4 bytes below 2^31
  rows, ``index_dtype_for``) and the row's values; allgather gives Table 3's 2·α_m·w(N-1) times
  (1 + index bytes / row bytes).
- sharded: 2·f·u·(8 + 2·w_row) for u distinct rows per worker of w_row bytes each, f = (P-1)/P (an id out, a row
  in and a gradient row out per distinct row, and as much served to the others; ``kinds.ShardedKind``);
- sketch: ring dense allreduces of the S2 payload, 4·``SparseSketch.payload_nbytes``·(N-1)/N: the bitmap (one
  bit per row or block, packed) plus the r x c table, c = ceil(``sketch_ratio``·numel / r) (lossy, so only on
  request). (Counting only ``sketch_ratio``·w left out the bitmap.)

Time: the α-β model with the cluster's latency and bandwidth, one direction of a full-duplex link. A
parameter-server step costs four latencies (pull and push, request and reply) plus two for the chief's
update, or, with ``Cluster(server=ServerModel)``, what the running servers were measured to cost. An entry's
time is what it adds to its kind's call (``kinds``); the step's communication time, ``Plan.step_seconds``, prices
the calls as ``DistributedOptimizer`` makes them (``plan.step``: DDP's buckets, one grouped call, one exchange)
with the algorithm the backend runs for each (``plan.backend``), and ``make_plan`` chooses by it;
``Plan.fused_seconds`` prices the dense-allreduce parameters as one fused call per item size
(``ParamStats.itemsize``), as ``HybridTrainer`` sends them;
``Plan.grouped_seconds`` the allreduce parameters as ``wrap_optimizer``'s default plan sends them (one grouped
call).
``Cluster(measured=LinkModel)`` prices with a measured link instead of the nominal bandwidth and latency, its
γ terms included: a measured link comes from real ranks, whose sparse merges and densifies cost time too
(validated against runs at P = 2..8 on 1 Gbit/s: mean |error| of the sparse allreduce's time 48% without γ,
22% with; docs/results_hybrid.md). The nominal link has γ off (network cost only).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sparsync.compress.sketch import SparseSketch
from sparsync.costmodel import LinkModel, Problem, predict
from sparsync.placement.base import Placement
from sparsync.placement.collective import Grouped
from sparsync.plan.cluster import Cluster
from sparsync.plan.detect import ParamStats
from sparsync.plan.kinds import Estimate, PlacementKind, machine_row_fraction
from sparsync.plan.registry import KINDS, objects
from sparsync.plan.step import Step, grouped_call, price_step


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    row_fraction: float  # α per worker
    row_fraction_machine: float  # per machine, after local aggregation
    placement: str
    bytes_per_machine: float  # per step, sent + received
    seconds: float  # predicted communication time per step
    candidates: dict[str, tuple[float, float]] = field(default_factory=dict)  # placement -> (bytes, seconds)
    overridden: bool = False
    detail: str = ""  # e.g. the SparCML algorithm behind sparse_allreduce
    itemsize: int = 4  # bytes per element (``ParamStats.itemsize``), for the fused and grouped prices
    details: dict[str, str] = field(default_factory=dict)  # placement -> its detail, as ``detail`` for the chosen

    def moved(self, placement: str) -> Entry:
        """This entry placed ``placement`` (one of its candidates), priced as its candidate there."""
        nbytes, seconds = self.candidates[placement]
        return dataclasses.replace(self, placement=placement, bytes_per_machine=nbytes, seconds=seconds,
                                   detail=self.details.get(placement, ""))  # fmt: skip


@dataclass(frozen=True)
class Plan:
    cluster: Cluster
    entries: tuple[Entry, ...]
    sketch: SparseSketch | None = None  # the sketch the ``sketch`` entries were priced with
    # kind -> the time its entries share per step (``PlacementKind.shared_seconds``: one grouped exchange), for
    # the kinds the plan uses; the entries' own seconds leave it out
    shared: Mapping[str, float] = field(default_factory=dict)
    # compute time per step during which the replicated kinds' reduction runs beside backward
    # (``DistributedOptimizer``'s reduction during backward); the kinds with a shared time (the sharded tables'
    # exchange, on the caller's thread) run on the step's path and hide behind nothing
    overlap: float = 0.0
    # every kind's shared time per step (``PlacementKind.shared_seconds``), used or not: what a move into it pays
    kind_shared: Mapping[str, float] = field(default_factory=dict)

    @functools.cached_property
    def step(self) -> Step:
        """The step as the trainer sends the plan (``plan.step``): the dense parameters in their buckets, the
        replicated sparse ones in their grouped calls, each other kind's entries and its shared time; each part
        with the algorithm the backend runs for it."""
        return price_step(self.entries, self.cluster, self.shared)

    @property
    def step_seconds(self) -> float:
        """Predicted communication per step: ``step``'s parts together."""
        return self.step.seconds

    @property
    def step_exposed_seconds(self) -> float:
        """``step_seconds`` less what of the replicated reduction hides behind ``overlap``: what ``make_plan``
        minimises."""
        return self.step.exposed(self.overlap)

    def moved(self, changes: Mapping[str, str]) -> Plan:
        """The plan with the entries named in ``changes`` moved to the kind given (one of their candidates),
        ``shared`` again the shared time of the kinds left in use."""
        entries = tuple(e.moved(changes[e.name]) if e.name in changes else e for e in self.entries)
        used = {e.placement for e in entries}
        shared = {k: t for k, t in self.kind_shared.items() if k in used and t > 0}
        return dataclasses.replace(self, entries=entries, shared=shared)

    def with_kind(self, kind: str = "dense_allreduce") -> Plan:
        """Every parameter that ``kind`` fits placed there (the rest as planned): e.g. the all-dense baseline."""
        return self.moved({e.name: kind for e in self.entries if kind in e.candidates})

    @property
    def bytes_per_machine(self) -> float:
        return sum(e.bytes_per_machine for e in self.entries)

    @property
    def kinds(self) -> dict[str, str]:
        """Per parameter name its placement's kind (a name in ``plan.registry.KINDS``)."""
        return {e.name: e.placement for e in self.entries}

    def placements(
        self, *, servers: Placement | None = None, sketch: SparseSketch | None = None
    ) -> dict[str, Placement]:
        """The plan as ``sparsync.placement`` objects, for ``DistributedOptimizer(plan=...)``,
        ``wrap_optimizer`` or ``HybridTrainer(placements=...)``. ``sketch``: the compressor of the ``sketch``
        entries (default: the one the plan was priced with when given to ``make_plan``, else
        ``SparseSketch(ratio=0.05)``). ``servers``: the ``ParameterServer`` placement for ``ps`` entries
        (required when the plan has any: the servers must exist first).

        Raises ValueError when an entry is ``ps`` and ``servers`` is None."""
        on_ps = [e.name for e in self.entries if e.placement == "ps"]
        if on_ps and servers is None:
            raise ValueError(
                f"the plan places {on_ps} on the parameter server: pass servers= (a ParameterServer "
                "placement) or use HybridTrainer(placements=plan), which starts the tables"
            )
        return objects(self.kinds, sketch=sketch if sketch is not None else self.sketch, servers=servers)

    @property
    def seconds(self) -> float:
        """The entries' own prices (each what it adds to its kind's call) plus the kinds' shared times: the step
        without the calls' latency. The step: ``step_seconds``."""
        return sum(e.seconds for e in self.entries) + self.shared_total

    @property
    def shared_total(self) -> float:
        return sum(self.shared.values())

    @property
    def exposed_seconds(self) -> float:
        """``grouped_seconds`` as the step sees it: the replicated part less the ``overlap`` it hides behind (not
        below zero), plus the exchange's part (the kinds in ``shared``: their entries and their shared time)
        whole. Equals ``grouped_seconds`` with no overlap."""
        own = self.shared_total + sum(e.seconds for e in self.entries if e.placement in self.shared)
        return max(0.0, self.grouped_seconds - own - self.overlap) + own

    @property
    def fused_seconds(self) -> float:
        """Step communication time with the dense-allreduce parameters of one item size in one fused allreduce
        (one flat buffer per dtype, as ``HybridTrainer``'s ``DenseAllreduce`` reduces them); the other
        placements as in ``seconds``."""
        dense = [e for e in self.entries if e.placement == "dense_allreduce"]
        rest = sum(e.seconds for e in self.entries if e.placement != "dense_allreduce") + self.shared_total
        N, link = self.cluster.machines, self.cluster.link
        return rest + sum(_fused_dense(n, size, N, link) for size, n in _numel_by_itemsize(dense).items())

    @property
    def grouped_seconds(self) -> float:
        """Step communication time as ``wrap_optimizer`` sends the plan (``ByLayout`` -> ``Grouped``): the
        sparse-allreduce parameters of one row width and item size in one ``grouped_allreduce``, the
        dense-allreduce ones of that item size packed behind the first such group as rows of its width while
        they total at most ``Grouped.max_dense`` elements (rows every rank holds), priced as ``auto`` would run
        that stream; the dense ones left over in one fused dense allreduce per item size; the other placements
        as in ``seconds``. On a two-level cluster: ``seconds``."""
        sparse = [e for e in self.entries if e.placement == "sparse_allreduce"]
        dense = [e for e in self.entries if e.placement == "dense_allreduce"]
        if not sparse or self.cluster.two_level:
            return self.fused_seconds
        groups: dict[tuple[int, int], list[Entry]] = {}  # (row width, item size): Grouped's (width, dtype)
        for e in sparse:
            groups.setdefault((math.prod(e.shape[1:]), e.itemsize), []).append(e)
        n_dense = _numel_by_itemsize(dense)
        sizes = {size for _, size in groups}
        packed = {size: n for size, n in n_dense.items() if size in sizes and n <= Grouped.max_dense}
        N, link = self.cluster.machines, self.cluster.link
        total = self.shared_total
        total += sum(e.seconds for e in self.entries if e.placement not in ("sparse_allreduce", "dense_allreduce"))
        first: set[int] = set()
        for (b, size), members in groups.items():
            extra = 0 if size in first else -(-packed.get(size, 0) // b)  # the dense rows, the last zero-padded
            first.add(size)
            total += grouped_call(members, extra, b, size, N, link)[1]
        for size, n in n_dense.items():
            left = n - packed.get(size, 0)
            if left:
                total += _fused_dense(left, size, N, link)
        return total

    def placement(self, name: str) -> str:
        for e in self.entries:
            if e.name == name:
                return e.placement
        raise KeyError(f"no parameter {name!r} in the plan; have {[e.name for e in self.entries]}")

    def baseline_seconds(self, placement: str = "dense_allreduce") -> float:
        return sum(e.candidates[placement][1] for e in self.entries if placement in e.candidates)

    def as_dict(self) -> dict[str, Any]:
        m = self.cluster.measured
        return {
            "cluster": {
                **self.cluster.__dict__,
                "measured": m and asdict(m),
                "server": self.cluster.server and asdict(self.cluster.server),
                "exchange_cpu": self.cluster.exchange_cpu and asdict(self.cluster.exchange_cpu),
            },
            "bytes_per_machine": self.bytes_per_machine,
            "seconds": self.seconds,
            "step_seconds": self.step_seconds,
            "step": [asdict(p) for p in self.step.parts],
            "shared": dict(self.shared),
            "overlap": self.overlap,
            "entries": [
                {**e.__dict__, "candidates": {k: list(v) for k, v in e.candidates.items()}} for e in self.entries
            ],
        }


def _numel_by_itemsize(entries: Iterable[Entry]) -> dict[int, int]:
    out: dict[int, int] = {}
    for e in entries:
        out[e.itemsize] = out.get(e.itemsize, 0) + math.prod(e.shape)
    return out


def _fused_dense(n: int, itemsize: int, machines: int, link: LinkModel) -> float:
    """One ring dense allreduce of ``n`` elements of ``itemsize`` bytes."""
    return predict("dense", Problem(machines, n, (n,) * machines, itemsize, 4), link)


def estimates(
    s: ParamStats,
    c: Cluster,
    *,
    sketch_ratio: float = 0.05,
    sketch: SparseSketch | None = None,
    kinds: Iterable[PlacementKind] = KINDS,
) -> dict[str, Estimate]:
    """Every kind's estimate of the parameter, by kind name in ``kinds`` order, leaving out kinds that do not
    fit it. ``sketch``: the compressor of the sketch placement (``HybridConfig.sketch``); default
    ``SparseSketch(ratio=sketch_ratio)``."""
    sk = sketch or SparseSketch(ratio=sketch_ratio)
    out = {}
    for kind in kinds:
        e = kind.estimate(s, c, sketch=sk)
        if e is not None:
            out[kind.name] = e
    return out


def make_plan(
    stats: Sequence[ParamStats],
    cluster: Cluster,
    *,
    overrides: Mapping[str, str] | None = None,
    allow_lossy: bool = False,
    sketch_ratio: float = 0.05,
    sketch: SparseSketch | None = None,
    kinds: Iterable[PlacementKind] = KINDS,
    swap_modules: bool = False,
    overlap_seconds: float = 0.0,
) -> Plan:
    """Choose each parameter's placement among ``kinds`` (default: the registered ones) by what it adds to the
    step (lossless kinds unless ``allow_lossy``; kinds that swap their module, ``sharded``, only with
    ``swap_modules``: the caller then swaps them, as ``sparsync.shard`` does); ``overrides`` maps parameter names
    to a kind and wins over the model. ``overlap_seconds``: backward's compute per step, behind which the
    replicated kinds' reduction runs and the sharded exchange does not (``Plan.overlap``).

    Each parameter first takes the kind whose estimate (its marginal cost inside its kind's call) is least; then
    the step is priced whole (``Plan.step_exposed_seconds``: the buckets, grouped calls, exchange and servers as
    the trainer sends them) and kept where it is faster: each kind with a shared time kept only where its
    parameters save more than it (``_pay_once``), then one parameter at a time moved to another of its kinds
    while that makes the step faster (``_settle``)."""
    kinds = tuple(kinds)
    overrides = dict(overrides or {})
    _check_overrides(stats, kinds, overrides)
    swapping = {k.name for k in kinds if k.swaps_module}
    unswapped = tuple(k for k in kinds if not k.swaps_module)
    lossy = {k.name for k in kinds if k.lossy}

    def allowed(k: str) -> bool:
        return allow_lossy or k not in lossy

    entries = []
    for s in stats:
        use = kinds if swap_modules or overrides.get(s.name) in swapping else unswapped
        est = estimates(s, cluster, sketch_ratio=sketch_ratio, sketch=sketch, kinds=use)
        cand = {k: (e.nbytes, e.seconds) for k, e in est.items()}
        if s.name in overrides and overrides[s.name] not in cand:
            raise ValueError(f"{s.name!r} is dense: placement {overrides[s.name]!r} needs a sparse parameter")
        pl = overrides[s.name] if s.name in overrides else _fastest(cand, allowed)
        am = machine_row_fraction(s, cluster.procs_per_machine) if s.sparse else 1.0
        entries.append(
            Entry(s.name, s.shape, s.row_fraction, am, pl, cand[pl][0], cand[pl][1], cand, s.name in overrides,
                  est[pl].detail, s.itemsize, {k: e.detail for k, e in est.items()})
        )  # fmt: skip
    sk = sketch if sketch is not None else SparseSketch(ratio=sketch_ratio)
    fixed = {k.name: k.shared_seconds(cluster) for k in kinds}
    plan = Plan(cluster, tuple(entries), sk, overlap=overlap_seconds, kind_shared=fixed).moved({})
    for kind, t in fixed.items():
        if t > 0:
            plan = _pay_once(plan, kind, allowed)
    return _settle(plan, allowed)


def _check_overrides(
    stats: Sequence[ParamStats], kinds: Sequence[PlacementKind], overrides: Mapping[str, str]
) -> None:
    names = {s.name for s in stats}
    valid = [k.name for k in kinds]
    for n, pl in overrides.items():
        if n not in names:
            raise KeyError(f"override for unknown parameter {n!r}; parameters: {sorted(names)}")
        if pl not in valid:
            raise KeyError(f"unknown placement {pl!r} for {n!r}; valid: {', '.join(valid)}")


def _fastest(cand: Mapping[str, tuple[float, float]], allowed: Callable[[str], bool]) -> str:
    """The allowed candidate of least (seconds, bytes); the first listed on a tie."""
    return min((k for k in cand if allowed(k)), key=lambda k: (cand[k][1], cand[k][0]))


def _pay_once(plan: Plan, kind: str, allowed: Callable[[str], bool]) -> Plan:
    """The entries chosen for ``kind`` (each by its own time there, which leaves out the time they share) kept
    there only where the whole step is faster so (``Plan.step_exposed_seconds``). First all of them or none; then,
    one at a time from the one that saves least, each moved to its best other candidate if that makes the step
    faster (a small table read whole costs fewer bytes in the replicated group). A greedy pass, not a search over
    every subset. Overridden entries stay, and pay the shared time anyway."""
    chosen = [e for e in plan.entries if e.placement == kind]
    if not chosen:
        return plan
    alternative = {
        e.name: _fastest(e.candidates, lambda k: k != kind and allowed(k))
        for e in chosen
        if not e.overridden and any(k != kind and allowed(k) for k in e.candidates)
    }
    best = plan
    for name in sorted(alternative, key=lambda n: _saving(plan, n, alternative[n])):
        trial = best.moved({name: alternative[name]})
        if trial.step_exposed_seconds < best.step_exposed_seconds:
            best = trial
    without = plan.moved(alternative)
    return without if without.step_exposed_seconds <= best.step_exposed_seconds else best


def _settle(plan: Plan, allowed: Callable[[str], bool], passes: int = 4) -> Plan:
    """Move one parameter at a time to the allowed kind that makes the whole step fastest, until no move helps
    (at most ``passes`` rounds over the parameters): a parameter's placement is then what it costs inside its
    kind's call, priced with the others as they are, and not what a call of its own would cost."""
    for _ in range(passes):
        changed = False
        for e in plan.entries:
            if e.overridden:
                continue
            here = next(x for x in plan.entries if x.name == e.name).placement
            for kind in (k for k in e.candidates if k != here and allowed(k)):
                trial = plan.moved({e.name: kind})
                if trial.step_exposed_seconds < plan.step_exposed_seconds * (1 - 1e-9):
                    plan, changed = trial, True
        if not changed:
            break
    return plan


def _saving(plan: Plan, name: str, alternative: str) -> float:
    e = next(e for e in plan.entries if e.name == name)
    return e.candidates[alternative][1] - e.seconds


# --- model descriptions -------------------------------------------------------------------------------------
def zipf_row_fraction(vocab: int, draws: int, s: float = 1.0) -> float:
    """Expected fraction of a vocabulary touched by ``draws`` Zipf(s) tokens: Σ 1-(1-p_i)^draws / V."""
    if vocab < 1 or draws < 0:
        raise ValueError(f"vocab must be >= 1 and draws >= 0, got {vocab}, {draws}")
    import numpy as np

    p = 1.0 / np.arange(1, vocab + 1, dtype=float) ** s
    p /= p.sum()
    return float(np.sum(-np.expm1(draws * np.log1p(-p))) / vocab)


def stats_from_json(obj: Any) -> list[ParamStats]:
    """Recorded statistics: a JSON list of {name, shape, row_fraction, sparse[, row_fraction_machine,
    itemsize]}."""
    if not isinstance(obj, list):
        raise ValueError("stats must be a JSON list of parameter records")
    out = []
    for i, d in enumerate(obj):
        if not isinstance(d, dict) or not {"name", "shape", "row_fraction", "sparse"} <= set(d):
            raise ValueError(f"stats record {i} needs name, shape, row_fraction, sparse; got {d!r}")
        shape = tuple(int(x) for x in d["shape"])
        am = d.get("row_fraction_machine")
        rf, sparse, size = float(d["row_fraction"]), bool(d["sparse"]), int(d.get("itemsize", 4))
        out.append(ParamStats(str(d["name"]), shape, rf, sparse, am, size))
    return out


def levels_from_json(obj: Any) -> tuple[LinkModel, LinkModel, LinkModel]:
    """The measured (world, intra, inter) links from a ``bench allreduce --hosts`` JSON (the first row that
    carries ``levels``) or from a {"world", "intra", "inter"} mapping of LinkModel fields."""
    rows = obj.get("rows", [obj]) if isinstance(obj, dict) else obj
    if not isinstance(rows, list):
        raise ValueError("levels: expected a benchmark JSON ({meta, rows}) or a {world, intra, inter} mapping")
    for r in rows:
        if not isinstance(r, dict):
            continue
        lv = r.get("levels", r if {"world", "intra", "inter"} <= set(r) else None)
        if isinstance(lv, dict):
            try:
                return LinkModel(**lv["world"]), LinkModel(**lv["intra"]), LinkModel(**lv["inter"])
            except (KeyError, TypeError) as e:
                raise ValueError(f"levels: not LinkModel fields: {e}") from None
    raise ValueError(
        "levels: no row with measured levels (run `sparsync bench allreduce --hosts H --procs-per-host k`)"
    )
