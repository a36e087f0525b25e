"""Hierarchical sparse allreduce for hosts of several ranks (issue 18; Horovod's hierarchical allreduce, Zen's
hierarchical centralization), on sparsync's own collectives at each level.

With H hosts of k ranks each, the k ranks of a host share one network link; a flat allreduce sends every rank's
stream across it. Three stages instead:

1. **inside each host**, ``sparse_allreduce`` on the host's group (loopback or shared memory, the fast path):
   every rank of the host holds the host's sum;
2. **between hosts**, local rank j takes its partition of the host's sum (``Partition``: stride of the row id
   for row streams, contiguous ranges for element streams, in the partition's own compact row space so that a
   full partition goes dense, SparCML §3) and allreduces it with local rank j of every other host: k groups
   of H ranks at once, each host's sum crossing its link once instead of once per rank;
3. **inside each host**, a ``sparse_allgather`` of the k partitions, which are disjoint: assembled.

Each level runs "auto" on its own group, so each level is priced with its own measured link (the two-level link
model: loopback inside a host, the shaped link between hosts). ``mode="auto"`` chooses between the flat and the
hierarchical allreduce per call (``choose_level``): one tiny round of every rank's nnz over the world group,
then both predicted from the cost model (costmodel.predict at each level, the levels' links). The result is the
same sum on every rank; its summation order differs from the flat one (floating-point sums may differ in the
last bits between the modes, never between ranks).

The topology comes from torchrun (``GROUP_RANK``: the node; ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), from
``sparsync.launch(..., procs_per_host=k)``, or from ``procs_per_host`` (ranks [h·k, (h+1)·k) on host h).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsync.calibrate import measure_link
from sparsync.collectives._comm import PeerError
from sparsync.collectives.partition import Partition, resolve_partition
from sparsync.costmodel import ALGORITHMS, LinkModel, Problem, predict
from sparsync.group import group_state, resolve_group
from sparsync.record import CommLog, CommRecord
from sparsync.stream import SparseStream, index_dtype_for

MODES = ("auto", "flat", "hierarchical")
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

    @property
    def size(self) -> int:
        return self.hosts * self.local_size


def detect_topology(procs_per_host: int | None = None) -> Topology:
    """The hosts of the world group and their subgroups. Collective: every rank calls it, in the same order
    relative to other group creations (it creates 2 groups per host and per local rank).

    The host of a rank: ``procs_per_host`` given, rank // procs_per_host; else torchrun's ``GROUP_RANK`` (its
    node rank; ``sparsync.launch`` sets it with ``procs_per_host``); else one host. Every host must hold the same
    number of ranks (ValueError naming the sizes)."""
    world = resolve_group(None)
    rank, size = dist.get_rank(), dist.get_world_size()
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
        raise ValueError(f"hosts hold different numbers of ranks {counts}: hierarchical collectives need equal hosts")
    k = sizes[0]
    local, _ = dist.new_subgroups_by_enumeration(members)
    cross, _ = dist.new_subgroups_by_enumeration([[m[j] for m in members] for j in range(k)])
    host = hosts.index(mine)
    assert local is not None and cross is not None  # every rank is in one of each
    return Topology(host, len(hosts), members[host].index(rank), k, local, cross, world)


def _link(group: dist.ProcessGroup) -> LinkModel:
    state = group_state(group)
    if state.link is None:
        state.link = measure_link(group)
    return state.link


def _best(p: Problem, link: LinkModel) -> float:
    return min(predict(a, p, link) for a in ALGORITHMS)


def predict_levels(p: Problem, topo: Topology) -> dict[str, float]:
    """Predicted seconds of the flat and the hierarchical allreduce of the call ``p`` (the world's Problem).

    Flat: the world's measured link, with β raised to what the cross-host link gives one rank when its host's k
    ranks all send: a rank's (P - 1) peers are P - k remote ones, so the host link carries k(P - k)/(P - 1)
    times one rank's share. Hierarchical: stage 1 on the local link (the slowest host's inputs), stage 2 with H
    ranks of U_k / k rows on the cross link, β times k (the k cross groups share each host's link), stage 3 an
    allgather of U_P / k rows on the local link. U_m: the model's union of m ranks' rows (Problem.union)."""
    H, k, P = topo.hosts, topo.local_size, topo.size
    world, intra, inter = _link(topo.world), _link(topo.local), _link(topo.cross)
    s = k * (P - k) / max(P - 1, 1)
    beta_x = inter.beta_exchange if inter.beta_exchange is not None else inter.beta
    flat_link = dataclasses.replace(
        world,
        beta=max(world.beta, inter.beta * s),
        beta_exchange=max(world.beta_exchange or world.beta, beta_x * s),
    )
    flat = _best(p, flat_link)
    hosts_nnz = [p.nnz[h * k : (h + 1) * k] for h in range(H)]
    local = max(_best(dataclasses.replace(p, world_size=k, nnz=tuple(n), unions=()), intra) for n in hosts_nnz)
    part_dim = max(1, -(-p.dim // k))
    per_part = round(p.union(k) / k)
    shared = dataclasses.replace(inter, beta=inter.beta * k, beta_exchange=beta_x * k)
    cross = _best(dataclasses.replace(p, world_size=H, dim=part_dim, nnz=(per_part,) * H, unions=()), shared)
    out_part = round(p.union(P) / k)
    gather = predict("allgather", dataclasses.replace(p, world_size=k, dim=part_dim, nnz=(out_part,) * k, unions=()),
                     intra)  # fmt: skip
    return {"flat": flat, "hierarchical": local + cross + gather}


def hierarchical_allreduce(
    stream: SparseStream,
    topology: Topology,
    *,
    mode: str = "auto",
    log: CommLog | None = None,
    timeout: float | None = None,
    partition: str = "auto",
) -> SparseStream:
    """Sum of every rank's ``stream`` over the world, on every rank (bitwise identical everywhere), by the
    three stages of the module doc (``mode="hierarchical"``), by one flat ``sparse_allreduce``
    (``"flat"``), or by whichever the two-level model predicts faster (``"auto"``). ``log`` receives one
    CommRecord for the whole call (algorithm ``hierarchical`` or ``flat``, bytes summed over the stages,
    stage times as phases, the predictions in ``decision``). Collective over the world group: every rank
    calls it with the same ``mode``."""
    from sparsync.collectives.allreduce import sparse_allgather, sparse_allreduce

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    t0 = time.perf_counter()
    inner = CommLog()
    chosen, preds = mode, {}
    if mode == "auto" and topology.hosts > 1 and topology.local_size > 1:
        chosen, preds = _choose(stream, topology, timeout)
    if chosen == "flat" or topology.hosts == 1 or topology.local_size == 1:
        result = sparse_allreduce(stream, log=inner, timeout=timeout, partition=partition)
        chosen = "flat"
    else:
        node = sparse_allreduce(stream, group=topology.local, log=inner, timeout=timeout, partition=partition)
        part = Partition(resolve_partition(partition, stream.row), stream.num_rows, topology.local_size)
        counts, b = part.counts(), stream.row
        # Every partition travels in the largest partition's row space, so that the ranks of a host, whose
        # partitions differ by a row, exchange streams of one dimension (the metadata round checks it).
        width = max(counts) * b
        mine = _resized(part.split(node)[topology.local_rank], width, stream)
        total = sparse_allreduce(mine, group=topology.cross, log=inner, timeout=timeout)
        parts = sparse_allgather(total, group=topology.local, log=inner, timeout=timeout)
        result = part.assemble(
            [_resized(p, counts[j] * b, stream) if counts[j] else None for j, p in enumerate(parts)],
            stream.dim, b, stream.dtype,
        )  # fmt: skip
    if log is not None:
        from sparsync.costmodel import Decision

        recs = inner.records
        phases = {f"{i}:{r.op}@{r.algorithm}": r.seconds for i, r in enumerate(recs)}
        log.append(
            CommRecord(
                "sparse_allreduce", chosen, dist.get_rank(), topology.size, stream.dim, stream.nnz, result.nnz,
                sum(r.bytes_sent for r in recs), sum(r.bytes_recv for r in recs), sum(r.messages for r in recs),
                time.perf_counter() - t0, phases, Decision(chosen, preds) if preds else None, row=stream.row,
            )
        )  # fmt: skip
    return result


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


def _choose(stream: SparseStream, topo: Topology, timeout: float | None) -> tuple[str, dict[str, float]]:
    """Every rank's nnz in one tiny world round, then the level with the smaller prediction (same everywhere)."""
    del timeout
    nnz = torch.zeros(topo.size, dtype=torch.int64)
    try:
        _ALLGATHER(nnz, torch.tensor([stream.nnz], dtype=torch.int64), group=topo.world)
    except RuntimeError as e:
        raise PeerError(f"hierarchical_allreduce: the nnz exchange failed: {e}") from e
    isz = stream.values.element_size()
    c = torch.empty((), dtype=index_dtype_for(stream.num_rows)).element_size()
    p = Problem(topo.size, stream.num_rows, tuple(int(x) for x in nnz), isz * stream.row, c, row=stream.row)
    preds = predict_levels(p, topo)
    return min(preds, key=lambda m: preds[m]), preds
