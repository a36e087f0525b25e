"""The input-dist stage of a sharded lookup (torchrec's names: input dist, lookup, output dist): each rank's
distinct ids per table, ordered by owner, packed into one ids payload per owner; and, on the owner, the rows
each requester asked for.

The ids payload a rank sends owner j carries every table of the exchange:

    [ c_0, ..., c_{T-1} | ids of table 0 owned by j | ... | ids of table T-1 owned by j ]

(c_t: how many ids of table t follow). The header in front of it (``header``) tells j how long it is; the T
counts tell j where each table's ids start. Ids travel as global row ids (int64, 8 bytes, the issue's bytes
formula), so the owner maps them to its rows itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsync.sharding.ownership import Ownership


@dataclass(frozen=True)
class Asked:
    """One table's lookups on the requesting rank, deduplicated: what it asks each owner for."""

    distinct: torch.Tensor  # the distinct ids, by owner then id
    positions: torch.Tensor  # for each id looked up (all lookups of the table, concatenated): its row in distinct
    per_owner: tuple[int, ...]  # distinct ids asked of each owner


def dedupe_tables(ids: Sequence[torch.Tensor], parts: int) -> list[Asked]:
    """Each table's ids (int64, flat) as its distinct ids in owner order (the stride ownership over ``parts``
    ranks: an id's owner is its value mod ``parts``, whatever the table), and where each id finds its row among
    them: the tables' ids offset into one key space, one ``unique`` and one sort for all of them instead of
    several small ops per table (``tests/sharding/test_units.py`` holds the one-table reference it equals),
    which on a host whose ranks share cores cost more than the ids' bytes."""
    T = len(ids)
    lens = [int(x.numel()) for x in ids]
    if T == 0:
        return []
    span = max((int(x.max()) + 1 for x in ids if x.numel()), default=1)  # keys t·span + id never collide
    table = torch.repeat_interleave(torch.arange(T, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64))
    keys, inverse = torch.unique(torch.cat(list(ids)) + table * span, sorted=True, return_inverse=True)
    t_of, value = keys // span, keys % span
    owner = value % parts
    order = torch.sort(t_of * parts + owner, stable=True).indices  # by table, then owner, then id
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel(), dtype=order.dtype)
    counts = torch.bincount(t_of * parts + owner, minlength=T * parts).view(T, parts)
    starts = torch.cumsum(counts.sum(1), 0) - counts.sum(1)  # each table's first slot in ``order``
    where = (place - starts[t_of])[inverse]  # each id's row among its own table's distinct ids
    distinct = torch.split(value[order], counts.sum(1).tolist())
    per_owner = counts.tolist()
    return [
        Asked(d, pos, tuple(c)) for d, pos, c in zip(distinct, torch.split(where, lens), per_owner, strict=True)
    ]


def ids_payload(asked: Sequence[Asked], parts: int) -> tuple[torch.Tensor, list[int]]:
    """The ids payload to every owner, concatenated in owner order (module doc), and its length per owner."""
    T = len(asked)
    chunks = [torch.split(a.distinct, list(a.per_owner)) for a in asked]
    pieces: list[torch.Tensor] = []
    sizes = []
    for j in range(parts):
        pieces.append(torch.tensor([a.per_owner[j] for a in asked], dtype=torch.int64))
        pieces += [c[j] for c in chunks]
        sizes.append(T + sum(a.per_owner[j] for a in asked))
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64), sizes


@dataclass(frozen=True)
class Served:
    """What this rank serves as an owner in one exchange, per table: the rows of its shard each requester asked
    for (requesters in rank order), and how many per requester."""

    rows: tuple[torch.Tensor, ...]  # per table: local rows of the shard, int64
    counts: tuple[tuple[int, ...], ...]  # per table, per requester


def parse_requests(payload: torch.Tensor, sizes: Sequence[int], ownerships: Sequence[Ownership]) -> Served:
    """The ids payloads received from every requester (``sizes``: their lengths, in rank order) as the rows of
    this rank's shards they ask for: every payload's T counts read at once, every id mapped to its row by one
    op (the tables share the stride ownership's ``parts``), the rows grouped by table by one stable sort.
    RuntimeError for a payload whose counts do not add up to its length."""
    T, n = len(ownerships), len(sizes)
    size = torch.tensor(list(sizes), dtype=torch.int64)
    short = [int(k) for k in sizes if k < T]
    if short:
        raise RuntimeError(f"an ids payload of {short[0]} elements cannot hold the counts of {T} tables")
    if T == 0:
        return Served((), ())
    heads = (torch.cumsum(size, 0) - size).unsqueeze(1) + torch.arange(T)  # each payload's count words
    counts = payload[heads.reshape(-1)].view(n, T)
    if not torch.equal(counts.sum(1), size - T) or bool((counts < 0).any()):
        raise RuntimeError(f"ids payloads of {list(sizes)} elements carry counts {counts.tolist()}")
    keep = torch.ones(payload.numel(), dtype=torch.bool)
    keep[heads.reshape(-1)] = False
    table = torch.repeat_interleave(torch.arange(T).repeat(n), counts.reshape(-1))
    order = torch.sort(table, stable=True).indices  # by table, requesters in rank order within each
    local = ownerships[0].local(payload[keep][order])
    rows = torch.split(local, counts.sum(0).tolist())
    return Served(tuple(rows), tuple(tuple(c) for c in counts.t().tolist()))
