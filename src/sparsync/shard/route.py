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

from sparsync.shard.ownership import Ownership


@dataclass(frozen=True)
class Asked:
    """One table's lookups on the requesting rank, deduplicated: what it asks each owner for."""

    distinct: torch.Tensor  # the distinct ids, by owner then id
    positions: torch.Tensor  # for each id looked up (all lookups of the table, concatenated): its row in distinct
    per_owner: tuple[int, ...]  # distinct ids asked of each owner


def dedupe(ids: torch.Tensor, ownership: Ownership) -> Asked:
    """``ids`` (int64, flat) as distinct ids in owner order, and where each id finds its row among them."""
    distinct, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    owner = ownership.owner(distinct)
    order = torch.sort(owner, stable=True).indices  # distinct ids are sorted, so each owner's stay sorted
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel(), dtype=order.dtype)
    per_owner = torch.bincount(owner, minlength=ownership.parts).tolist()
    return Asked(distinct[order], place[inverse], tuple(per_owner))


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
    this rank's shards they ask for."""
    T = len(ownerships)
    per_table: list[list[torch.Tensor]] = [[] for _ in range(T)]
    counts: list[list[int]] = [[] for _ in range(T)]
    for part in torch.split(payload, list(sizes)):
        if part.numel() < T:
            raise RuntimeError(f"an ids payload of {part.numel()} elements cannot hold the counts of {T} tables")
        c = part[:T].tolist()
        for t, ids in enumerate(torch.split(part[T:], c)):
            per_table[t].append(ownerships[t].local(ids))
            counts[t].append(c[t])
    rows = tuple(torch.cat(p) if p else torch.empty(0, dtype=torch.int64) for p in per_table)
    return Served(rows, tuple(tuple(c) for c in counts))
