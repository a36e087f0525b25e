"""Hierarchical sparse allreduce for hosts of several ranks (Horovod's hierarchical allreduce, Zen's
hierarchical centralization), on sparsync's own collectives at each level.

With H hosts of k ranks each, the k ranks of a host share one network link; a flat allreduce sends every rank's
stream across it. One metadata round over the world (``meta.exchange_meta``: every rank's input checked on
every rank, every rank's rows known), then three stages:

1. **inside each host, a reduce-scatter**: the rows are partitioned over the host's k ranks (``Partition``:
   the stride of the row id for row streams, balanced on Zipf rows; contiguous ranges for element streams) and
   each rank receives and sums its partition of the host's ranks' streams (the split phase of SparCML §4.1,
   ``split_reduce``, one all-to-all round over loopback or shared memory);
2. **between hosts**, local rank j allreduces its partition of the host's sum with local rank j of every
   other host (``sparse_allreduce`` on the cross group, auto on the inter-host link; each partition in its own
   compact row space so that a full partition goes dense, SparCML §3): k groups of H ranks at once, each
   host's sum crossing its link once instead of once per rank;
3. **inside each host, an allgather** of the k result partitions, which are disjoint: one round of framed
   blocks (as the split algorithms' allgather), assembled by one copy each.

This is Horovod's hierarchical allreduce (reduce-scatter in the node, allreduce across, allgather in the node)
on sparse streams. The two-level link model: the intra-host link is measured on the host groups, the
inter-host link on the cross groups, all at once so that the measurement sees k ranks sharing each link, and
both are averaged over the world (``level_links``) so that every rank prices the levels alike.
``mode="auto"`` predicts both ways per call (``predict_levels``) and runs the hierarchical one when it is
predicted ``HIER_MARGIN`` faster. The result is the same sum on every rank, bit for bit; its summation order
differs from a flat call's (floating-point sums may differ in the last bits between the modes, never between
ranks).

The topology comes from torchrun (``GROUP_RANK``: the node; ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), from
``sparsync.launch(..., procs_per_host=k)``, or from ``procs_per_host`` (ranks [h·k, (h+1)·k) on host h).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsync.collectives.allreduce import log_allreduce, problem_of, sparse_allreduce
from sparsync.collectives.calibrate import measure_link
from sparsync.collectives.comm import Comm
from sparsync.collectives.group import group_state, next_call, resolve_group
from sparsync.collectives.meta import Meta, exchange_meta, update_eager
from sparsync.collectives.partition import Partition, resolve_partition
from sparsync.collectives.split_allgather import frame_cap, gather_frames, split_reduce
from sparsync.collectives.traffic import Traffic
from sparsync.collectives.wire import FRAME_BYTES, framed, max_framed_payload, payload_nbytes, unframe
from sparsync.costmodel import (
    REGISTRY,
    Decision,
    LinkModel,
    Policy,
    Problem,
    choose_robust,
    gather_latency,
    metadata_time,
    predict,
)
from sparsync.record import CommLog
from sparsync.stream import SparseStream, index_dtype_for

MODES = ("auto", "flat", "hierarchical")
# mode="auto" runs the hierarchical allreduce only when predicted this much faster than the flat one (chosen, as
# choose_robust's margin: three dependent stages are a bigger bet than one algorithm; predictions against
# measured times: docs/results_design.md).
HIER_MARGIN = 0.3
# torch 2.13 renamed all_gather_into_tensor; keep working on older releases.
_ALLGATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(frozen=True)
class Topology:
    """This rank's place in ``hosts`` hosts of ``local_size`` ranks: its host's group (``local``) and the group
    of the ranks with its local rank on every host (``cross``)."""

    host: int
    hosts: int
    local_rank: int
    local_size: int
    local: dist.ProcessGroup
    cross: dist.ProcessGroup
    world: dist.ProcessGroup
    members: tuple[tuple[int, ...], ...]  # the world ranks of each host, in rank order

    @property
    def size(self) -> int:
        return self.hosts * self.local_size


def detect_topology(procs_per_host: int | None = None, *, group: dist.ProcessGroup | None = None) -> Topology:
    """The hosts of the world group and their subgroups. Collective: every rank calls it, in the same order
    relative to other group creations (it creates 2 groups per host and per local rank).

    The host of a rank: ``procs_per_host`` given, rank // procs_per_host; else torchrun's ``GROUP_RANK`` (its
    node rank; ``sparsync.launch`` sets it with ``procs_per_host``); else one host. Every host must hold the same
    number of ranks (ValueError naming the sizes). ``group``: a group over every rank to use as the world
    (the metadata round's and the flat algorithms'; default the default group)."""
    world = resolve_group(group)
    rank, size = dist.get_rank(), dist.get_world_size()
    if dist.get_world_size(world) != size:
        raise ValueError(
            f"detect_topology needs a group of every rank ({size}), got one of {dist.get_world_size(world)}"
        )
    if procs_per_host is not None:
        if procs_per_host < 1 or size % procs_per_host:
            raise ValueError(f"procs_per_host={procs_per_host} does not divide the world size {size}")
        mine = rank // procs_per_host
    else:
        mine = int(os.environ.get("GROUP_RANK", "0"))
    keys = torch.zeros(size, dtype=torch.int64)
    _ALLGATHER(keys, torch.tensor([mine], dtype=torch.int64), group=world)
    hosts = sorted(set(keys.tolist()))
    members = [[r for r in range(size) if int(keys[r]) == h] for h in hosts]
    sizes = sorted({len(m) for m in members})
    if len(sizes) != 1:
        counts = {h: len(m) for h, m in zip(hosts, members, strict=True)}
        raise ValueError(
            f"hosts hold different numbers of ranks {counts}: hierarchical collectives need equal hosts"
        )
    k = sizes[0]
    local, _ = dist.new_subgroups_by_enumeration(members)  # type: ignore[no-untyped-call]
    cross, _ = dist.new_subgroups_by_enumeration([[m[j] for m in members] for j in range(k)])  # type: ignore[no-untyped-call]
    host = hosts.index(mine)
    assert local is not None and cross is not None  # every rank is in one of each
    return Topology(host, len(hosts), members[host].index(rank), k, local, cross, world,
                    tuple(tuple(m) for m in members))  # fmt: skip


def _link(group: dist.ProcessGroup) -> LinkModel:
    state = group_state(group)
    if state.link is None:
        state.link = measure_link(group)
    return state.link


_OPTIONAL = ("alpha_a2a", "beta_exchange", "gamma_fresh")
_REQUIRED = ("alpha", "beta", "gamma_sparse", "gamma_dense", "gamma_scatter")


def _agree(link: LinkModel, world: dist.ProcessGroup) -> LinkModel:
    """The mean over every rank of the world of each rank's ``link`` (its own host's or cross group's model):
    ranks of different hosts measured different links, and would otherwise price the levels differently and
    choose differently (a hang: some ranks in the flat algorithm, the others in the hierarchical one)."""
    fixed = dict(link.fixed)
    names = REGISTRY.names
    vals = [float(getattr(link, f)) for f in _REQUIRED]
    vals += [-1.0 if getattr(link, f) is None else float(getattr(link, f)) for f in _OPTIONAL]
    vals += [fixed.get(a, -1.0) for a in names]
    t = torch.tensor(vals, dtype=torch.float64)
    dist.all_reduce(t, group=world)
    t /= dist.get_world_size(world)
    out = dict(zip(_REQUIRED, t[: len(_REQUIRED)].tolist(), strict=True))
    opt = t[len(_REQUIRED) : len(_REQUIRED) + len(_OPTIONAL)].tolist()
    out.update({f: (v if v >= 0 else None) for f, v in zip(_OPTIONAL, opt, strict=True)})
    times = t[len(_REQUIRED) + len(_OPTIONAL) :].tolist()
    return LinkModel(**out, fixed=tuple((a, v) for a, v in zip(names, times, strict=True) if v >= 0))


def level_links(topo: Topology) -> tuple[LinkModel, LinkModel]:
    """(intra-host, inter-host) link models, measured on the host groups and the cross groups at first use and
    averaged over the world (``_agree``): the same on every rank. Collective over the world."""
    state = group_state(topo.local)
    if state.levels is None:
        state.levels = (_agree(_link(topo.local), topo.world), _agree(_link(topo.cross), topo.world))
    return state.levels


def _best(p: Problem, link: LinkModel) -> float:
    return min(predict(a, p, link) for a in REGISTRY.names)


def predict_levels(p: Problem, topo: Topology) -> dict[str, float]:
    """Predicted seconds of the flat and the hierarchical allreduce of the call ``p`` (the world's Problem) on
    this job's measured links (``level_links``; collective at first use). See ``price_levels``."""
    return price_levels(p, topo.members, *measured_levels(topo))


def measured_levels(topo: Topology) -> tuple[LinkModel, LinkModel, LinkModel]:
    """(world, intra-host, inter-host) link models as ``predict_levels`` prices with them (collective at first
    use); ``sparsync plan --levels`` reads them back from a benchmark's JSON."""
    return (_link(topo.world), *level_links(topo))


def flat_link(world: LinkModel, inter: LinkModel, P: int, k: int) -> LinkModel:
    """The link a flat call over P ranks in hosts of k sees: ``world``'s, with β raised to the share of a
    rank's bytes that crosses hosts ((P - k) of its P - 1 peers are remote) at the inter-host β."""
    s = (P - k) / max(P - 1, 1)
    beta_x = inter.beta_exchange if inter.beta_exchange is not None else inter.beta
    return dataclasses.replace(
        world,
        beta=max(world.beta, inter.beta * s),
        beta_exchange=max(world.beta_exchange or world.beta, beta_x * s),
    )


def price_levels(
    p: Problem, members: Sequence[Sequence[int]], world: LinkModel, intra: LinkModel, inter: LinkModel
) -> dict[str, float]:
    """Predicted seconds of the flat and the hierarchical allreduce of ``p`` (the world's Problem) over hosts
    of ranks ``members`` (equal sizes), per stage too (``"hierarchical:<stage>"``). Pure: ``sparsync plan``
    prices clusters it never ran on with it.

    ``inter`` is the inter-host link as one rank sees it while its host's k ranks all send (measured on the
    cross groups, all k at once; nominally k / bandwidth per byte). Flat: ``world``'s model, with β raised to
    the share of a rank's bytes that crosses hosts ((P - k) of its P - 1 peers are remote) at that β.
    Hierarchical: stage 1 on the intra-host link (the slowest host's inputs), stage 2 with H ranks of U_k / k
    rows each on the inter-host link, stage 3 an allgather of U_P / k rows per rank on the intra-host link,
    plus the world's metadata round. U_m: the model's union of m ranks' rows (Problem.union)."""
    H, k, P = len(members), len(members[0]), p.world_size
    if H * k != P or any(len(m) != k for m in members):
        raise ValueError(f"members {[len(m) for m in members]} are not equal hosts of the world's {P} ranks")
    flat = _best(p, flat_link(world, inter, P, k))
    # Stage 1, a reduce-scatter inside each host (the slowest host): one all-to-all round of (k - 1)/k of the
    # input, then each rank merges k blocks of its partition.
    bx_intra = intra.beta_exchange if intra.beta_exchange is not None else intra.beta
    a2a = intra.alpha_a2a if intra.alpha_a2a is not None else (k - 1) * intra.alpha
    # Where the intra-host link was calibrated (``LinkModel.fixed``), a stage's fixed cost is measured, not
    # counted in α's: the host's split algorithm less its allgather for the reduce-scatter, the allgather for
    # stage 3 (on a host whose cores its ranks share, these exceed the α terms several times).
    fixed = dict(intra.fixed)
    if "ssar_split_allgather" in fixed and "allgather" in fixed:
        a2a = max(a2a, fixed["ssar_split_allgather"] - fixed["allgather"])
    local = max(
        a2a + bx_intra * (k - 1) / k * max(p.input_bytes(r) for r in m)
        + p.per_row(intra.gamma_sparse, intra) * sum(p.nnz[r] for r in m) / k
        for m in members
    )  # fmt: skip
    # Stage 2, a flat allreduce of H ranks' partitions on the inter-host link (auto's best).
    part_dim = max(1, -(-p.dim // k))
    per_part = round(p.union(k) / k)
    cross = _best(dataclasses.replace(p, world_size=H, dim=part_dim, nnz=(per_part,) * H, unions=()), inter)
    # Stage 3, an allgather of the disjoint result partitions inside the host, assembled by one copy each.
    out_part = round(p.union(P) / k)
    piece = dataclasses.replace(p, world_size=k, dim=part_dim, nnz=(out_part,) * k, unions=())
    fresh = intra.gamma_fresh if intra.gamma_fresh is not None else intra.gamma_dense
    start = fixed.get("allgather", metadata_time(piece, intra) + gather_latency(k, intra))
    gather = start + bx_intra * (k - 1) * piece.input_bytes(0) + fresh * out_part * k * p.row
    parts = {"meta": metadata_time(p, world), "host_reduce_scatter": local, "cross_allreduce": cross,
             "host_allgather": gather}  # fmt: skip
    return {
        "flat": flat,
        "hierarchical": sum(parts.values()),
        **{f"hierarchical:{k}": v for k, v in parts.items()},
    }


def hierarchical_allreduce(
    stream: SparseStream,
    topology: Topology,
    *,
    mode: str = "auto",
    log: CommLog | None = None,
    timeout: float | None = None,
    partition: str = "auto",
    check_nan: bool = True,
    policy: Policy = choose_robust,
) -> SparseStream:
    """Sum of every rank's ``stream`` over the world, on every rank (bitwise identical everywhere), by the
    three stages of the module doc (``mode="hierarchical"``), by a flat sparse allreduce (``"flat"``: the
    algorithm ``policy`` picks from the world's link), or by whichever the two-level model predicts faster
    (``"auto"``, by ``HIER_MARGIN``). One metadata round over the world starts every call: it checks the input
    on every rank (shapes, dtypes, NaN/Inf: the same ValueError everywhere) and gives the model every rank's
    rows. ``log``
    receives one CommRecord for the whole call (algorithm ``hierarchical`` or the flat algorithm, bytes summed
    over the stages, each stage's time as a phase, the two predictions in ``decision``). Collective over the
    world: every rank calls it with the same ``mode``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    t0 = time.perf_counter()
    part_kind = resolve_partition(partition, stream.row)
    comm = Comm(topology.world, timeout, stream.device)
    comm.op = f"hierarchical_allreduce(mode={mode!r})"
    meta = exchange_meta(comm, "sparse_allreduce", stream, "auto", next_call(topology.world), check_nan)
    problem = problem_of(stream, meta, topology.size)
    chosen, preds = _choose_level(mode, problem, topology)
    if chosen == "flat":
        chosen = policy(problem, _link(topology.world)).algorithm
        update_eager(comm, meta, chosen)
        with comm.phase(chosen):
            result = REGISTRY.entry(chosen).runner(comm, stream, meta, part_kind)
    else:
        update_eager(comm, meta, "-")
        result = _three_stages(comm, stream, meta, topology, part_kind, timeout)
    log_allreduce(log, comm, chosen, t0, stream, result, Decision(chosen, preds) if preds else None, part_kind)
    return result


def _choose_level(mode: str, problem: Problem, topology: Topology) -> tuple[str, dict[str, float]]:
    """``"hierarchical"`` or ``"flat"`` for ``mode``, with the two-level model's predictions when ``auto``
    priced both (empty otherwise). One host, or hosts of one rank, leave no level to save: flat."""
    two_level = topology.hosts > 1 and topology.local_size > 1
    preds = predict_levels(problem, topology) if mode == "auto" and two_level else {}
    chosen = "hierarchical" if two_level and mode != "flat" else "flat"
    if preds:
        chosen = "hierarchical" if preds["hierarchical"] * (1 + HIER_MARGIN) < preds["flat"] else "flat"
    return chosen, preds


def _three_stages(
    comm: Comm, stream: SparseStream, meta: Meta, topology: Topology, part_kind: str, timeout: float | None
) -> SparseStream:
    """The module doc's three stages (and the assembly), each a phase of ``comm``'s record, which counts every
    stage's bytes."""
    host_nnz = tuple(meta.nnz[r] for r in topology.members[topology.host])
    part = Partition(part_kind, stream.num_rows, topology.local_size)
    counts, b = part.counts(), stream.row
    local = Comm(topology.local, timeout, stream.device)
    local.op = comm.op
    with comm.phase("host_reduce_scatter"):
        mine = split_reduce(local, stream, part, host_nnz) if counts[topology.local_rank] else None
        _absorb(comm, local)
    # Every partition travels in the largest partition's row space, so that the ranks of a host, whose
    # partitions differ by a row, exchange streams of one dimension (the metadata rounds check it).
    width = max(counts) * b
    with comm.phase("cross_allreduce"):
        total = _cross_allreduce(comm, _resized(mine, width, stream), topology.cross, timeout)
    with comm.phase("host_allgather"):
        # One round: framed blocks into receives posted for the largest partition result there can be (the
        # split algorithms' allgather, split_allgather.py), instead of a sizes round and a data round.
        cap = _gather_cap(min(sum(meta.nnz), max(counts)), width, stream)
        blocks = gather_frames(local, framed(total), cap)
        _absorb(comm, local)
    with comm.phase("assemble"):
        parts = [unframe(blk, width, stream.dtype, b) for blk in blocks]
        return part.assemble(
            [_resized(p, counts[j] * b, stream) if counts[j] else None for j, p in enumerate(parts)],
            stream.dim, b, stream.dtype, stream.device,
        )  # fmt: skip


def _cross_allreduce(
    comm: Comm, mine: SparseStream, cross: dist.ProcessGroup, timeout: float | None
) -> SparseStream:
    """Stage 2: ``sparse_allreduce`` of this rank's partition over the ``cross`` group (auto, on the inter-host
    link), its bytes counted as ``comm``'s traffic in the current phase."""
    inner = CommLog()
    total = sparse_allreduce(mine, group=cross, log=inner, timeout=timeout, check_nan=False)
    recs = inner.records
    comm.count_collective(sum(r.bytes_sent for r in recs), sum(r.bytes_recv for r in recs),
                          sum(r.messages for r in recs))  # fmt: skip
    return total


def _gather_cap(rows: int, width: int, like: SparseStream) -> int:
    """The bytes to post for one partition result of at most ``rows`` stored rows in a space of ``width``
    values. The cross allreduce may return its result dense whatever its rows (its algorithm's choice), so
    never less than a dense frame."""
    dense = FRAME_BYTES + max_framed_payload(payload_nbytes(True, 0, width, like.dtype))
    return max(frame_cap(rows, width, like.dtype, like.row), dense)


def _absorb(comm: Comm, stage: Comm) -> None:
    """Count what ``stage`` (a Comm of a host's group) moved since the last call as ``comm``'s traffic, in
    ``comm``'s current phase, so that the call's record holds every stage's bytes."""
    tr = stage.traffic
    comm.count_collective(tr.bytes_sent, tr.bytes_recv, tr.messages)
    stage.traffic = Traffic()


def _resized(s: SparseStream | None, dim: int, like: SparseStream) -> SparseStream:
    """``s`` (a partition, None: empty) as a stream of ``dim`` values: padded with zero rows, or cut back to
    its partition's own rows (which hold every stored row)."""
    b = like.row
    if s is None:
        return SparseStream.empty(dim, like.dtype, row=b)
    if s.indices is None:
        vals = s.values[:dim] if s.dim >= dim else torch.cat([s.values, s.values.new_zeros(dim - s.dim)])
        return SparseStream(None, vals, dim, row=b, validate=False)
    return SparseStream(s.indices.to(index_dtype_for(dim // b)), s.values, dim, row=b, validate=False)
