"""``sparsync.shard(model, plan="auto", sample=...)``: each table placed where the cost model says the step is
fastest, from statistics measured on a sample batch and the link measured on the group (Parallax §3.1's
placement by measured sparsity, with the sharded kind beside its two allreduce kinds).

What is measured, per ``nn.Embedding`` / ``nn.EmbeddingBag`` of the model, by one forward of ``model(*sample)``
on every rank: u_t(B), the distinct rows the rank's batch reads, and u_t(P·B), the distinct rows of all ranks'
batches together (the union the replicated tables' sparse allreduce carries); and the time of one backward
from the sum of the outputs (the gradients it leaves are put back as they were), the slowest rank's: the compute
behind which ``DistributedOptimizer`` reduces the replicated tables while the sharded tables' exchange, on the
caller's thread, hides behind nothing (``make_plan(overlap_seconds=...)``). That reduction runs on a background
thread: it hides behind backward only where that thread has a core to itself. Where the ranks compute on the CPU
and a host's ranks use all its cores (more ranks than cores), its merges and copies (loopback's too) take the
cores backward computes on, and the plan prices it whole; with some cores spare, the spare share of backward
(``_hidden_share``, from every rank's host and cores; ``AutoPlan.overlap``; docs/sharding.md has the demo's
measured case). The link: the
group's link model when one is set (``set_link``, ``set_deterministic``), else ``measure_link`` on the group,
kept as the group's model so that "auto" in the optimizer's reductions does not measure it again.

The rounds, unless the user set the link: the sharded tables' exchange puts three all-to-all rounds on the
step's path, and each waits for the slowest rank; where ranks share cores, that wait, not the link's latency,
is what a round costs (docs/sharding.md, the breakdown, where it is many times ``measure_link``'s
``alpha_a2a``, a round of tiny messages between idle ranks). So
"auto" times what it prices: the sample's forward, then one all-to-all round of a header's size, three times;
a round costs each rank the wait for the slowest plus the latency, and the step pays, on average over the
ranks, that mean (``_round_seconds``: the ranks' mean of their medians). The plan prices every all-to-all round
at the larger of that and the link's ``alpha_a2a`` (the replicated kinds' split algorithms too, whose rounds
run beside backward, where the overlap hides them), unless the tables' CPU is priced on ranks that share
cores (below): the wait for the slowest rank is then the others' CPU on those cores, which the CPU term
counts, and the rounds are priced at the link's ``alpha_a2a`` alone. It is kept with the group's link model
(``GroupState.exchange_round``), so a later "auto" on the group prices the same rounds; with a link the user
set there is no such measurement, and the choice depends on the data alone (``set_deterministic``).

The tables' CPU (``TableCpu``, ``sharding/table_cpu.py``), unless the user set the link or ``cpu`` is given: each
table's CPU per placement, timed on stand-ins of its lookups in the sample, which a placement adds to the step
(that module's doc says what is timed and how).

What is chosen, per table, among the kinds that run inside the training group without loss (``AUTO_KINDS``):
dense allreduce and sparse allreduce (``"replicated"``: the table stays whole and ``DistributedOptimizer``
reduces it) and ``sharded``, by ``make_plan(swap_modules=True)``, which prices the sharded tables' one exchange
and the replicated tables' one grouped call as they run (``planner._pay_once``). The parameter server
(``"server"``) is not among them: a dict plan may place a table there (trained by ``HybridTrainer``), but it
needs server processes beside the ranks, which "auto" neither starts nor prices here. With the tables' CPU
priced, the planner's plan (by communication alone), every table sharded and every table on its best replicated
kind are priced whole with it (``_cheapest``: the step's exposed communication plus the CPU), and from the
cheapest one table at a time is moved to another of its kinds while that makes the step faster. With
``fused`` the tables kept whole go in replicated groups, priced as those run (``grouped_price``: a sparse
allreduce only, their sum on the step's path, one header allreduce per forward; ``step_cost``), and so is the
predicted step (``AutoPlan.step_seconds``).

The choice is the same on every rank: the statistics are averaged over the ranks (``all_reduce``) and the link
model is agreed, so every rank prices the same numbers.

A table on the meta device (``nn.EmbeddingBag(rows, D, device="meta")``: too large for one rank, its shards
drawn by ``group.init_rows``) has no rows to look up, so for the sample forward only its forward is stood in
for, on the module itself (an instance attribute, deleted when the forward returns or raises; its pre-hooks, which
record the ids, run as for any table): the stand-in returns zeros on the CPU of the shape and dtype the table's
own forward gives (that forward run on meta copies of the arguments: the shape without the rows), needing a
gradient when the weight does. Nothing of the table is ever made: neither its rows nor a gradient of its shape.
Its ids are counted as any table's, and it is priced by its real shape and dtype (rows, D, bytes per value).
The backward timed from those zeros runs through every layer above the table, the compute that hides the
replicated tables' reduction (its time does not depend on the values, zeros here instead of rows), and stops at
the stand-in: it leaves out the table's own backward, which, sharded,
is the pooling's backward on the gathered rows (u·D adds) and the exchange the planner prices by itself; a real
table's backward here would also build its gradient (``[rows, D]`` dense for an ``EmbeddingBag`` without
``sparse=True``), work that no sharded step does. A meta table is always placed ``sharded`` (an override of
the planner's choice; it is still measured and priced): replicated, it would have to exist whole on every rank.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsync.collectives.calibrate import measure_link
from sparsync.collectives.group import link_state
from sparsync.collectives.transport import meta_group
from sparsync.costmodel import LinkModel
from sparsync.placement.embeddings import rows_of_input
from sparsync.plan import KINDS, Cluster, ParamStats, Plan, make_plan
from sparsync.sharding.grouped_price import GROUPED_KIND, grouped_exposed
from sparsync.sharding.table_cpu import Bags, TableCpu, table_cpu

AUTO_KINDS = ("dense_allreduce", "sparse_allreduce", "sharded")  # lossless, and no process beside the ranks


@dataclass(frozen=True)
class AutoPlan:
    """What ``plan="auto"`` measured and chose: the plan over the model's parameters (tables and the rest, which
    are priced as dense allreduce), and per table module the mean distinct rows a rank read (u(B)) and the
    distinct rows of all ranks' batches (u(P·B))."""

    plan: Plan
    distinct: Mapping[str, tuple[float, int]]  # module name -> (u(B) mean over the ranks, u(P·B))
    stats: tuple[ParamStats, ...]  # what the plan priced, to price another plan on the same cluster
    backward_seconds: float  # the sample's backward, the slowest rank's
    forward_seconds: float = 0.0  # the sample's forward, the slowest rank's
    # an all-to-all round after compute, as measured (module doc); None: not measured (the user set the link)
    round_seconds: float | None = None
    # the part of backward the replicated tables' reduction hides behind (module doc); None: all of it
    overlap_seconds: float | None = None
    # the tables' CPU by placement (module doc), which the choice priced; None: not priced (the user set the link)
    cpu: TableCpu | None = None

    @property
    def overlap(self) -> float:
        return self.backward_seconds if self.overlap_seconds is None else self.overlap_seconds

    def step_seconds(self, plan: Plan | None = None) -> float:
        """The predicted step of ``plan`` (default: the chosen one): the sample's forward and backward as
        measured, plus the communication the step waits for (``Plan.exposed_seconds``: the replicated tables'
        reduction less what hides behind backward, the sharded exchange whole), plus what the tables' CPU adds
        where it was priced (``TableCpu.seconds``). With the tables' optimizer in backward (``TableCpu.fused``),
        the communication and the CPU as the choice priced them (``step_cost``: the tables kept whole in
        replicated groups, ``grouped_price``)."""
        plan = plan or self.plan
        if self.cpu is not None and self.cpu.fused:
            return self.forward_seconds + self.backward_seconds + step_cost(plan, self.cpu)
        cpu = 0.0 if self.cpu is None else self.cpu.seconds(self.placed(plan))
        return self.forward_seconds + self.backward_seconds + plan.exposed_seconds + cpu

    @property
    def tables(self) -> dict[str, str]:
        """Module name -> ``"sharded"`` or ``"replicated"``: the plan as ``sparsync.shard`` takes it."""
        return self.placed(self.plan)

    def placed(self, plan: Plan) -> dict[str, str]:
        """Module name -> ``"sharded"`` or ``"replicated"``, as ``plan`` places each table."""
        return _placed(plan, self.distinct)

    def every_table(self, placement: str, *, itemsize: int | None = None) -> Plan:
        """The plan with every table ``"sharded"``, or ``"replicated"`` (each on its best replicated kind), priced
        on the same statistics, cluster and overlap, for comparing with ``plan``. ``itemsize``: the tables'
        bytes per value on the wire instead of their own (2 for ``rows="bf16"``)."""
        stats = [dataclasses.replace(s, itemsize=itemsize) if itemsize and s.sparse else s for s in self.stats]
        kinds = [KINDS.entry(k) for k in AUTO_KINDS]
        if placement == "sharded":
            pinned = {s.name: "sharded" for s in stats if s.sparse}
            return make_plan(stats, self.plan.cluster, overrides=pinned, kinds=kinds,
                             overlap_seconds=self.overlap)  # fmt: skip
        if placement == "replicated":
            return make_plan(stats, self.plan.cluster, kinds=[k for k in kinds if k.name != "sharded"],
                             overlap_seconds=self.overlap)  # fmt: skip
        raise ValueError(f"placement must be 'sharded' or 'replicated', got {placement!r}")


def auto_plan(
    model: nn.Module,
    sample: Sequence[Any],
    group: dist.ProcessGroup,
    *,
    link: LinkModel | None = None,
    backward_seconds: float | None = None,
    round_seconds: float | None = None,
    cpu: TableCpu | None = None,
    fused: bool = False,
) -> AutoPlan:
    """Measure and plan (module doc). ``sample``: positional arguments of one ``model(*sample)`` call, this rank's
    batch (it runs once, and one backward from it, and, unless the user set the link, the first time on the
    group three more forwards without gradients, each before a timed round; the model is left as it was: its
    gradients put back, a meta table's forward restored). ``link``: price with this model instead of the
    group's (and no measured round, no measured CPU). ``backward_seconds``: the overlap to price with instead of
    the measured backward. ``round_seconds``: the all-to-all round to price with instead of the measured one.
    ``cpu``: the tables' CPU to price with instead of the measured one (``TableCpu``); measured (``table_cpu``)
    unless the link is given or set by the user. ``fused``: the sharded tables get their optimizer in backward
    (``sparsync.shard(optimizer=...)``), priced without a sparse gradient per table. Tables on the meta device
    are placed ``sharded`` (module doc). Collective over ``group``. Raises ValueError when the model has no
    embedding table."""
    tables = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)}
    if not tables:
        raise ValueError("plan='auto': the model has no nn.Embedding or nn.EmbeddingBag to place")
    seen, calls, forward, backward = _distinct_ids(model, tables, sample)
    P = dist.get_world_size(group)
    slowest = torch.tensor(
        [backward if backward_seconds is None else backward_seconds, forward], dtype=torch.float64
    )
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    mine = torch.tensor([float(seen[n].numel()) for n in tables], dtype=torch.float64)
    dist.all_reduce(mine, group=group)
    dense = [p for p in model.parameters() if not any(p is m.weight for m in tables.values())]
    on_cpu = all(p.device.type in ("cpu", "meta") for p in dense)
    unions, share, contention = _union_sizes([seen[n] for n in tables], on_cpu, group)
    overlap = float(slowest[0]) * share if backward_seconds is None else backward_seconds
    distinct = {n: (float(mine[j]) / P, unions[j]) for j, n in enumerate(tables)}
    stats = _stats(model, tables, distinct)
    measure_cpu = cpu is None and link is None and not link_state(group).link_set
    link, round_s = _link_and_round(model, tables, sample, group, link, round_seconds)
    if measure_cpu:
        cpu = table_cpu(tables, calls, group, fused=fused, contention=contention)
    on_meta = {_weight_name(n): "sharded" for n, m in tables.items() if m.weight.device.type == "meta"}
    # ranks sharing cores: the measured round's wait is the others' CPU, which the CPU term prices (module doc)
    waits = round_s if cpu is None or cpu.contention <= 1 else None
    plan = make_plan(stats, Cluster(P, measured=_priced(link, waits, P)), swap_modules=True,
                     overlap_seconds=overlap, kinds=[KINDS.entry(k) for k in AUTO_KINDS],
                     overrides=on_meta)  # fmt: skip
    if cpu is not None:
        plan = _cheapest(plan, cpu, set(on_meta))
    return AutoPlan(plan, distinct, tuple(stats), float(slowest[0]), float(slowest[1]), round_s, overlap, cpu)


def _stats(
    model: nn.Module, tables: Mapping[str, nn.Module], distinct: Mapping[str, tuple[float, int]]
) -> list[ParamStats]:
    """What the planner prices: each table's weight by the distinct rows a rank reads, the rest dense."""
    weights = {_weight_name(n): m for n, m in tables.items()}
    stats = []
    for pname, p in model.named_parameters():
        if pname not in weights:
            stats.append(ParamStats(pname, tuple(p.shape), 1.0, False, itemsize=p.element_size()))
            continue
        name, rows = pname.removesuffix(".weight"), p.shape[0]
        # u(P·B) is reported, not priced: the kinds model a rank's union from its own fraction
        u_b, _ = distinct[name if name != "weight" else ""]
        stats.append(ParamStats(pname, tuple(p.shape), min(1.0, u_b / rows), True, min(1.0, u_b / rows),
                                p.element_size()))  # fmt: skip
    return stats


def _placed(plan: Plan, tables: Iterable[str]) -> dict[str, str]:
    """Module name -> ``"sharded"`` or ``"replicated"``, as ``plan`` places each of ``tables``."""
    return {n: "sharded" if plan.placement(_weight_name(n)) == "sharded" else "replicated" for n in tables}


SETTLE_PASSES = 4  # rounds over the tables in ``_cheapest``


def _cheapest(plan: Plan, cpu: TableCpu, pinned: set[str]) -> Plan:
    """The placement of least step, the exchange and reductions the step waits for
    (``Plan.step_exposed_seconds``; with ``cpu.fused``, the replicated groups' as they run: ``grouped_price``)
    plus the tables' CPU (``TableCpu.seconds``): from the cheapest of ``plan`` (the planner's, by communication
    alone), every table sharded and every table on its best replicated kind, one table at a time moved to
    another of its kinds while that makes the step faster (at most ``SETTLE_PASSES`` rounds). ``pinned``:
    weights that stay where ``plan`` put them (meta tables)."""
    tables = {e.name: _kinds(e.candidates, cpu.fused) for e in plan.entries
              if "sharded" in e.candidates and e.name not in pinned}  # fmt: skip

    def cost(p: Plan) -> float:
        return step_cost(p, cpu)

    replicated = {n: min((k for k in kinds if k != "sharded"), key=lambda k: kinds[k])
                  for n, kinds in tables.items() if len(kinds) > 1}  # fmt: skip
    kept = {n: k for n, k in replicated.items() if plan.placement(n) not in tables[n]}  # not a groups' kind
    starts = [plan.moved(kept), plan.moved({n: "sharded" for n in tables}), plan.moved(replicated)]
    best = min(starts, key=cost)
    low = cost(best)
    for _ in range(SETTLE_PASSES):
        changed = False
        for name, kinds in tables.items():
            for kind in (k for k in kinds if k != best.placement(name)):
                trial = best.moved({name: kind})
                if cost(trial) < low * (1 - 1e-9):
                    best, low, changed = trial, cost(trial), True
        if not changed:
            break
    return best


def _kinds(candidates: Mapping[str, tuple[float, float]], fused: bool) -> dict[str, float]:
    """A table's kinds ``_cheapest`` moves it among, with their seconds: all its candidates, or, ``fused``,
    ``sharded`` and the replicated groups' kind (``grouped_price.GROUPED_KIND``)."""
    return {k: t for k, (_, t) in candidates.items() if not fused or k in ("sharded", GROUPED_KIND)}


def step_cost(plan: Plan, cpu: TableCpu) -> float:
    """What ``_cheapest`` minimises: the communication the step waits for and the tables' CPU, the replicated
    tables priced in groups when their optimizer runs in backward (``cpu.fused``; ``grouped_price``)."""
    placed = _placed(plan, cpu.replicated)
    whole = [_weight_name(n) for n, p in placed.items() if p != "sharded"] if cpu.fused else []
    return grouped_exposed(plan, whole) + cpu.seconds(placed)


def _link_and_round(
    model: nn.Module,
    tables: Mapping[str, nn.Module],
    sample: Sequence[Any],
    group: dist.ProcessGroup,
    link: LinkModel | None,
    round_seconds: float | None,
) -> tuple[LinkModel, float | None]:
    """The link model to price with and the measured round (module doc): ``link`` as given; else the group's
    (``measure_link`` when it has none) with the round measured (``_round_seconds`` the first time, then kept on
    the group); a link the user set comes with no round. ``round_seconds`` wins."""
    if link is not None:
        return link, round_seconds
    state = link_state(group)
    if state.link is None:
        state.link = measure_link(group)
    if round_seconds is None and not state.link_set:
        if state.exchange_round is None:
            state.exchange_round = _round_seconds(model, tables, sample, group)
        round_seconds = state.exchange_round
    return state.link, round_seconds


def _priced(link: LinkModel, round_s: float | None, P: int) -> LinkModel:
    """``link`` with every all-to-all round priced at least ``round_s`` (module doc)."""
    if round_s is None:
        return link
    a2a = link.alpha_a2a if link.alpha_a2a is not None else (P - 1) * link.alpha
    return dataclasses.replace(link, alpha_a2a=max(a2a, round_s))


ROUND_TRIALS = 3  # forwards, each followed by a timed round (``_round_seconds``)


def _round_seconds(
    model: nn.Module, tables: Mapping[str, nn.Module], sample: Sequence[Any], group: dist.ProcessGroup
) -> float:
    """What an all-to-all round costs right after compute (module doc): the sample's forward without gradients,
    then one round of a header's size (4 int64 to each peer), ``ROUND_TRIALS`` times; this rank's median round,
    averaged over the ranks (the same number on every rank). Collective."""
    P = dist.get_world_size(group)
    if P == 1:
        return 0.0  # no peer to wait for
    send = torch.zeros(4 * P, dtype=torch.int64)
    got = torch.empty_like(send)
    times = []
    for _ in range(ROUND_TRIALS):
        with torch.no_grad(), _meta_tables_stood_in(tables.values()):
            model(*sample)
        t0 = time.perf_counter()
        dist.all_to_all_single(got, send, group=group)
        times.append(time.perf_counter() - t0)
    mean = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
    dist.all_reduce(mean, group=group)
    return float(mean) / P


def _weight_name(module: str) -> str:
    return f"{module}.weight" if module else "weight"


def _distinct_ids(
    model: nn.Module, tables: Mapping[str, nn.Module], sample: Sequence[Any]
) -> tuple[dict[str, torch.Tensor], dict[str, list[Bags]], float, float]:
    """Per table module, the distinct ids its calls read in one ``model(*sample)`` and the calls as ``Bags``;
    the seconds of that forward; and the seconds of one backward from the sum of the outputs (0 when no output
    needs a gradient), the parameters' ``.grad`` put back as they were."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in tables}
    calls: dict[str, list[Bags]] = {n: [] for n in tables}

    def hook(name: str) -> Any:
        def record(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if args and isinstance(args[0], torch.Tensor):
                seen[name].append(rows_of_input(m, args))
                calls[name].append(_bags(m, args, kwargs))

        return record

    handles = [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in tables.items()]
    try:
        with _meta_tables_stood_in(tables.values()):
            t0 = time.perf_counter()
            out = model(*sample)
            forward = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    ids = {n: torch.unique(torch.cat(v)) if v else torch.empty(0, dtype=torch.int64) for n, v in seen.items()}
    return ids, calls, forward, _backward_seconds(model, out)


def _bags(m: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bags:
    """One call of a table as ``embedding_bag``'s (ids, offsets): an ``EmbeddingBag``'s bags as it pools them (its
    offsets, ``include_last_offset``'s last dropped, or a 2-D input's rows), an ``Embedding``'s ids one a bag."""
    x = args[0].detach()
    ids = x.reshape(-1).to(torch.int64)
    if isinstance(m, nn.EmbeddingBag) and x.dim() == 1:
        offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
        if isinstance(offsets, torch.Tensor):
            offsets = offsets.detach().to(torch.int64)
            return ids, offsets[:-1] if m.include_last_offset else offsets
    width = int(x.shape[-1]) if isinstance(m, nn.EmbeddingBag) and x.dim() == 2 else 1
    return ids, torch.arange(0, ids.numel(), max(width, 1), dtype=torch.int64)


@contextmanager
def _meta_tables_stood_in(tables: Iterable[nn.Module]) -> Iterator[None]:
    """Each table on the meta device answers its calls with ``_zeros_like_output`` (module doc) until the block
    ends. Mutates the tables for the block's duration (an instance ``forward``), not after it."""
    meta = [m for m in tables if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.weight.device.type == "meta"]
    own = [vars(m).get("forward") for m in meta]  # a forward set on the instance before: put back, not deleted
    for m in meta:
        m.forward = _zeros_like_output(m.forward, m.weight.requires_grad)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m, forward in zip(meta, own, strict=True):
            if forward is None:
                del m.forward
            else:
                m.forward = forward  # type: ignore[method-assign]


def _zeros_like_output(forward: Callable[..., torch.Tensor], requires_grad: bool) -> Callable[..., torch.Tensor]:
    """A stand-in for a meta table's ``forward`` (bound): zeros on the CPU of the shape and dtype of its output,
    which ``forward`` gives on meta copies of the arguments, without any rows."""

    def stand_in(*args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.no_grad():
            shaped = forward(*map(_on_meta, args), **{k: _on_meta(v) for k, v in kwargs.items()})
        return torch.zeros(shaped.shape, dtype=shaped.dtype, requires_grad=requires_grad)

    return stand_in


def _on_meta(arg: Any) -> Any:
    return arg.to("meta") if isinstance(arg, torch.Tensor) else arg


def _backward_seconds(model: nn.Module, out: Any) -> float:
    leaves = [t for t in _tensors(out) if t.requires_grad]
    if not leaves:
        return 0.0
    params = [p for p in model.parameters() if p.requires_grad]
    kept = [p.grad for p in params]
    t0 = time.perf_counter()
    torch.autograd.backward([t.sum() for t in leaves])
    seconds = time.perf_counter() - t0
    for p, g in zip(params, kept, strict=True):
        p.grad = g
    return seconds


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, list | tuple):
        return [t for v in out for t in _tensors(v)]
    return []


def _union_sizes(
    ids: Sequence[torch.Tensor], on_cpu: bool, group: dist.ProcessGroup
) -> tuple[list[int], float, float]:
    """Per table, the distinct ids of every rank's sample together; the share of backward a replicated
    reduction hides behind (``_hidden_share``) and the ranks' contention for cores (``_contention``), from every
    rank's host, cores and whether it computes on the CPU (``on_cpu``). Collective (one gather)."""
    mine = (socket.gethostname(), _cores(), on_cpu, [t.to(torch.int64) for t in ids])
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=meta_group(group))  # host objects
    unions = [int(torch.unique(torch.cat([theirs[3][j] for theirs in everyone])).numel()) for j in range(len(ids))]
    ranks = [(h, c, cpu) for h, c, cpu, _ in everyone]
    return unions, _hidden_share(ranks), _contention(ranks)


def _contention(ranks: Sequence[tuple[str, int, bool]]) -> float:
    """What a second of one rank's CPU costs the step: the most ranks on one host over that host's cores (the
    fewest its ranks may run on), at least 1. ``ranks``: (host, cores, computes on the CPU) per rank."""
    hosts: dict[str, list[int]] = {}
    for host, cores, _ in ranks:
        hosts.setdefault(host, []).append(cores)
    return max(1.0, *(len(c) / max(1, min(c)) for c in hosts.values()))


def _cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _hidden_share(ranks: Sequence[tuple[str, int, bool]]) -> float:
    """How much of the measured backward the replicated tables' reduction, run by a background thread beside it,
    hides behind: 1 where the ranks compute elsewhere (a GPU) or each has a spare core for that thread; 0 where
    the ranks of a host compute on the CPU and use all its cores (the reduction's merges and copies, loopback's
    too, then take the cores backward computes on: nothing hides); in between, the spare cores over the ranks.
    ``ranks``: (host, cores, computes on the CPU) per rank."""
    if not any(cpu for _, _, cpu in ranks):
        return 1.0
    per_host = collections.Counter(h for h, _, _ in ranks)
    m, cores = max(per_host.values()), min(c for _, c, _ in ranks)
    return min(1.0, max(0.0, (cores - m) / m))
