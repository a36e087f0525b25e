"""The tables' CPU per step by placement, for ``plan="auto"`` (``sharding/auto.py``).

The tables' CPU (``TableCpu``), unless the user set the link or ``cpu`` is given: a table's CPU differs by
placement (replicated: one lookup, one backward and one sparse gradient per table, coalesced, divided by P and
applied by the optimizer; sharded: one pass per group of one width and dtype, and, with the optimizer fused
into backward, no gradient per table; replicated with the optimizer fused (``fused``): one pass per group too,
as ``sharding.replicated`` runs it, a group of one part), and where a host's ranks share its cores the step
pays a rank's CPU times ``contention``, the busiest host's ranks over its cores (at least 1). ``table_cpu``
times stand-ins of each placement's kernels on this rank's lookups in the sample (the ids the pre-hooks
recorded, renumbered onto one zero row per distinct id: no row of a table is read or written): each table
replicated; each table alone in a sharded group and each group whole (the keys deduplicated, ordered by owner,
their rows gathered, one pooling and its backward, then the rows updated in place, or, not ``fused``, one
sparse gradient per table coalesced, divided by P and applied), a group's fixed part being what its tables
alone pay again; with ``fused``, each table alone in a replicated group and each such group whole (the same
pass over one part: no owner order), split the same way. Each is the median process CPU of ``CPU_TRIALS``
runs, averaged over the ranks. A placement then adds ``contention`` x (its tables' CPU less the replicated
lookups, which the measured forward and backward already hold) to the step.
Not timed: the Python around the kernels and the collectives' own copies (the link's γ terms price the sparse
reduction's merges).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TableCpu:
    """One rank's CPU per step for the tables, by placement, in seconds (module doc, the tables' CPU).
    ``replicated``: per table module, its lookup and backward with a sparse gradient, that gradient coalesced and
    divided by P, and its rows updated. ``sharded``: per table module, what its ids and rows add to its group's
    pass; ``group``: per table module, its group (width and dtype) and the group's fixed seconds, paid once per
    group holding a sharded table. ``lookup``: the tables' lookups and backwards as the sample's forward and
    backward ran them, already inside ``AutoPlan.forward_seconds`` and ``backward_seconds``. ``contention``: the
    busiest host's ranks over its cores, at least 1: what a second of one rank's CPU costs the step. ``fused``:
    the sharded groups priced with their optimizer in backward (no sparse gradient per table), and the replicated
    tables as ``sharding.replicated``'s groups: ``replicated`` per table module what it adds to its replicated
    group's pass, ``replicated_group`` its group and the group's fixed seconds, paid once per group holding a
    replicated table (empty without ``fused``: each replicated table pays its own step)."""

    replicated: Mapping[str, float]
    sharded: Mapping[str, float]
    group: Mapping[str, tuple[str, float]]
    lookup: float = 0.0
    contention: float = 1.0
    fused: bool = False
    replicated_group: Mapping[str, tuple[str, float]] = field(default_factory=dict)

    def seconds(self, placed: Mapping[str, str]) -> float:
        """What the tables' CPU adds to the sample's forward and backward when placed as ``placed`` (module name
        -> ``"sharded"`` or ``"replicated"``): ``contention`` x (their CPU less ``lookup``)."""
        own = sum(self.sharded[n] if p == "sharded" else self.replicated[n] for n, p in placed.items())
        groups = {self.group[n] for n, p in placed.items() if p == "sharded"}
        grouped = self.replicated_group
        together = {grouped[n] for n, p in placed.items() if p != "sharded" and n in grouped}
        fixed = sum(t for _, t in groups) + sum(t for _, t in together)
        return self.contention * (own + fixed - self.lookup)


CPU_TRIALS = 3  # timings of each stand-in, the median kept (``table_cpu``)
Bags = tuple[torch.Tensor, torch.Tensor]  # one table's lookups in the sample: (ids, offsets) as embedding_bag


def table_cpu(
    tables: Mapping[str, nn.Embedding | nn.EmbeddingBag],
    calls: Mapping[str, Sequence[Bags]],
    group: dist.ProcessGroup,
    *,
    fused: bool = False,
    contention: float = 1.0,
) -> TableCpu:
    """Time the tables' stand-ins on this rank's lookups (``calls``; module doc), each the median process CPU of
    ``CPU_TRIALS`` runs, averaged over the ranks (the same ``TableCpu`` on every rank): each table replicated,
    each alone in its sharded group and each group whole; a group's fixed seconds are what its tables alone pay
    again, (Σ alone - whole) / (k - 1) for k tables. Nothing of the tables is read or written: the stand-ins
    hold one zero row per distinct id. Collective over ``group``."""
    P = dist.get_world_size(group)
    parts = {n: _stand_in(calls.get(n, ())) for n in tables}
    shapes = {n: (int(m.embedding_dim), m.weight.dtype) for n, m in tables.items()}
    members: dict[str, list[str]] = {}
    for n, (dim, dtype) in shapes.items():
        members.setdefault(f"D={dim} {dtype}", []).append(n)
    timed = []
    for n, m in tables.items():
        lookup, whole = _median(functools.partial(_replicated_cpu, parts[n], shapes[n], P))
        timed += [0.0 if m.weight.device.type == "meta" else lookup, whole]
        timed += _median(functools.partial(_group_cpu, [parts[n]], shapes[n], P, fused))
    for names in members.values():
        timed += _median(functools.partial(_group_cpu, [parts[n] for n in names], shapes[names[0]], P, fused))
    if fused:  # the replicated groups: one part, every row local, summed over the P ranks (``replicated``)
        runs = [functools.partial(_group_cpu, [parts[n]], shapes[n], 1, True, P) for n in tables]
        runs += [
            functools.partial(_group_cpu, [parts[n] for n in ns], shapes[ns[0]], 1, True, P)
            for ns in members.values()
        ]
        timed += [_median(run)[0] for run in runs]
    mean = torch.tensor(timed, dtype=torch.float64)
    dist.all_reduce(mean, group=group)
    values = (mean / P).tolist()
    T = len(tables)
    look = {n: values[3 * j] for j, n in enumerate(tables)}
    replicated = {n: values[3 * j + 1] for j, n in enumerate(tables)}
    wholes = values[3 * T : 3 * T + len(members)]
    sharded, group_of = _per_table(members, {n: values[3 * j + 2] for j, n in enumerate(tables)}, wholes)
    together: dict[str, tuple[str, float]] = {}
    if fused:
        rest = values[3 * T + len(members) :]
        replicated, together = _per_table(members, dict(zip(tables, rest[:T], strict=True)), rest[T:])
    return TableCpu(replicated, sharded, group_of, sum(look.values()), contention, fused, together)


def _per_table(
    members: Mapping[str, Sequence[str]], alone: Mapping[str, float], wholes: Sequence[float]
) -> tuple[dict[str, float], dict[str, tuple[str, float]]]:
    """Each table's share of its group's pass and each table's (group, the group's fixed seconds), from each
    table's pass alone in its group and each group's pass whole: the fixed part is what the tables alone pay
    again, (Σ alone - whole) / (k - 1) for k tables."""
    fixed = {
        key: max(0.0, (sum(alone[n] for n in names) - whole) / (len(names) - 1)) if len(names) > 1 else 0.0
        for (key, names), whole in zip(members.items(), wholes, strict=True)
    }
    group_of = {n: (key, fixed[key]) for key, names in members.items() for n in names}
    return {n: max(0.0, alone[n] - group_of[n][1]) for n in alone}, group_of


def _stand_in(calls: Sequence[Bags]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One table's lookups joined as one ``embedding_bag`` call on stand-in rows: (ids renumbered 0..u-1 by the
    distinct id they read, offsets, u)."""
    if not calls:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, 0
    starts = torch.tensor([0] + [int(ids.numel()) for ids, _ in calls[:-1]], dtype=torch.int64).cumsum(0)
    ids = torch.cat([ids for ids, _ in calls])
    offsets = torch.cat([o + int(s) for (_, o), s in zip(calls, starts, strict=True)])
    keys, inverse = torch.unique(ids, return_inverse=True)
    return inverse, offsets, int(keys.numel())


def _median(run: Callable[[], tuple[float, ...] | float]) -> list[float]:
    """Each field's median over ``CPU_TRIALS`` runs of ``run`` (one field where it returns a float)."""
    trials = [run() for _ in range(CPU_TRIALS)]
    rows = [t if isinstance(t, tuple) else (t,) for t in trials]
    return [sorted(r[i] for r in rows)[len(rows) // 2] for i in range(len(rows[0]))]


def _replicated_cpu(
    part: tuple[torch.Tensor, torch.Tensor, int], shape: tuple[int, torch.dtype], P: int
) -> tuple[float, float]:
    """The process CPU of one replicated table's step on stand-in rows: (its lookup and backward with a sparse
    gradient; that plus the gradient coalesced, divided by P and added to its rows)."""
    ids, offsets, u = part
    w = torch.zeros(max(u, 1), shape[0], dtype=shape[1], requires_grad=True)
    t0 = time.process_time()
    out = nn.functional.embedding_bag(ids, w, offsets, mode="sum", sparse=True)
    torch.autograd.backward([out], [torch.ones_like(out)])
    t1 = time.process_time()
    if w.grad is not None:
        g = w.grad.coalesce() / P
        with torch.no_grad():
            w.index_add_(0, g.indices()[0], g.values(), alpha=-1.0)
    return t1 - t0, time.process_time() - t0


def _group_cpu(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
    shape: tuple[int, torch.dtype],
    P: int,
    fused: bool,
    summed_over: int = 1,
) -> float:
    """The process CPU of one sharded group's pass over ``parts`` (its tables' stand-ins, rows one after
    another): the group's keys deduplicated, ordered by owner, their rows gathered, one pooling and its backward,
    then the rows updated in place (``fused``) or one sparse gradient per table, coalesced, divided by P and
    added. ``summed_over`` > 1: a replicated group's (``sharding.replicated``), whose gradient rows are summed
    over that many ranks by an allgather before the update: that many ranks' rows (this rank's, again) merged by
    one coalesce. The rounds are the link's, priced apart."""
    row0 = [0]
    for _, _, u in parts:
        row0.append(row0[-1] + u)
    ids = torch.cat([p[0] + r for p, r in zip(parts, row0, strict=False)])
    _, offsets, _ = _stand_in([(p[0], p[1]) for p in parts])
    w = torch.zeros(max(row0[-1], 1), shape[0], dtype=shape[1])
    t0 = time.process_time()
    keys, inverse = torch.unique(ids, return_inverse=True)
    by_owner = keys[torch.argsort(keys % P, stable=True)]
    rows = w.index_select(0, by_owner).requires_grad_()
    out = nn.functional.embedding_bag(inverse, rows, offsets, mode="sum")
    torch.autograd.backward([out], [torch.ones_like(out)])
    grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
    with torch.no_grad():
        if fused and summed_over > 1:
            at = by_owner.repeat(summed_over).unsqueeze(0)
            total = torch.sparse_coo_tensor(
                at, grad.repeat(summed_over, 1), tuple(w.shape), check_invariants=False
            )
            total = total.coalesce()
            w.index_add_(0, total.indices()[0], total.values(), alpha=-1.0)
        elif fused:
            w.index_add_(0, by_owner, grad, alpha=-1.0)
        else:
            bounds = torch.searchsorted(keys, torch.tensor(row0)).tolist()
            for t, (a, b) in enumerate(itertools.pairwise(bounds)):
                at = (keys[a:b] - row0[t]).unsqueeze(0)  # in range by construction: no invariant check
                g = torch.sparse_coo_tensor(at, grad[a:b], (parts[t][2], shape[0]), check_invariants=False)
                g = g.coalesce() / P
                w.index_add_(0, g.indices()[0] + row0[t], g.values(), alpha=-1.0)
    return time.process_time() - t0
