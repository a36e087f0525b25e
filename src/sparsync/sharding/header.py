"""The header of a sharded lookup's ids round: a row from each rank to each peer, in front of the ids it sends
that peer, saying how many ids it sends, whether the ranks may go on, and the most it sends any peer.

The row is a schema (``HEADER``, a ``collectives.row.Schema`` as the metadata rounds' rows are): each column
named once, with how the ranks must agree on it and what it holds. ``status`` and ``tables`` are the same in
every row a rank sends, so every rank learns every rank's verdict and makes the same decision: go on, or raise.
Only in that second case does a slower round run (``agree``): the ranks gather each one's reason in words, and
every rank raises the same ``ValueError``, naming the rank and its reason, instead of some ranks raising while
the others wait in the next all-to-all (the same contract as ``sparsync.collectives.allreduce.refuse``, on this
exchange's own round).

Why the header rides with the ids (one round, not a sizes round and then an ids round): an all-to-all's receiver
must know each sender's length before the round, and on a host where the ranks share cores each round is a
point where every rank waits for the slowest (docs/sharding.md, the breakdown). So each rank sends every peer a
block of a fixed length, ``len(HEADER) + capacity`` words: its header row, then up to ``capacity`` ids,
zero-padded.
``capacity`` is agreed without a word: every rank sees every sender's ``widest`` column, so every rank computes
the same ``capacity_after`` for the next exchange. Ids beyond the capacity (the first exchange, capacity 0, or a
batch wider than the last) follow in a second round whose lengths the headers gave (``overflow``). Padding costs
at most ``capacity`` - count words per peer: with ``capacity_after``'s 25% margin, a few percent of a lookup's
bytes, the ids being 8 bytes against a row's 4·D each way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from sparsync.collectives.ops import text_key
from sparsync.collectives.row import Agree, Column, Schema
from sparsync.collectives.transport import meta_group

HEADER = Schema(
    (
        Column("status", Agree.ZERO, doc="0 on every rank; a rank that refused its own input sends 1 (all raise)"),
        Column("tables", Agree.SAME, doc="the key of the tables this exchange carries, in order (else all raise)"),
        Column("count", Agree.OWN, doc="int64 elements of ids this rank sends that peer (per peer)"),
        Column("widest", Agree.OWN, doc="the largest count this rank sends any peer (the next capacity)"),
    )
)
COLUMNS = HEADER.columns
OK, REFUSED = 0, 1
MARGIN, ALIGN = 1.25, 8  # capacity_after: the widest count seen, grown by a quarter, in whole 8-word steps


def tables_key(descriptions: Sequence[str]) -> int:
    """The ``tables`` column: a key of the tables' descriptions (name, kind, rows, dim, dtype), in order."""
    return text_key("\n".join(descriptions))


def capacity_after(widest: int) -> int:
    """The ids each block carries in the next exchange, after one whose widest count over every pair of ranks was
    ``widest`` (the same on every rank: every rank saw every sender's ``widest``)."""
    return -(-int(widest * MARGIN) // ALIGN) * ALIGN


def blocks_to_peers(
    status: int, key: int, payload: torch.Tensor, counts: Sequence[int], capacity: int
) -> torch.Tensor:
    """This rank's blocks of the ids round, one per peer (``[P, len(HEADER) + capacity]`` int64): the header row,
    then the first ``capacity`` of the ``counts[j]`` ids that ``payload`` (every peer's ids, in peer order)
    holds for peer j, zero-padded."""
    W = len(COLUMNS)
    out = torch.zeros(len(counts), W + capacity, dtype=torch.int64)
    out[:, HEADER.index("status")] = status
    out[:, HEADER.index("tables")] = key
    out[:, HEADER.index("count")] = torch.tensor(list(counts), dtype=torch.int64)
    out[:, HEADER.index("widest")] = max(counts, default=0)
    for j, ids in enumerate(torch.split(payload, list(counts))):
        n = min(ids.numel(), capacity)
        out[j, W : W + n] = ids[:n]
    return out


def overflow(payload: torch.Tensor, counts: Sequence[int], capacity: int) -> tuple[torch.Tensor, list[int]]:
    """What the blocks could not carry: each peer's ids past the first ``capacity``, in peer order, and how many
    per peer (the second round's split sizes; its receivers know them from the headers' counts)."""
    rest = [ids[capacity:] for ids in torch.split(payload, list(counts))]
    return (torch.cat(rest) if rest else payload[:0]), [int(r.numel()) for r in rest]


def raise_refused(statuses: Sequence[int], group: dist.ProcessGroup, refusal: str | None) -> None:
    """Nothing when every rank's status (``statuses[r]``, the same list on every rank) is OK; else every rank
    raises the same ValueError, naming the first refusing rank and its ``refusal`` (gathered on the meta group).
    Collective on that path only."""
    if not any(statuses):
        return
    reasons: list[str | None] = [None] * len(statuses)
    dist.all_gather_object(reasons, refusal, group=meta_group(group))
    rank = next(r for r, s in enumerate(statuses) if s)
    raise ValueError(f"sharded lookup refused on rank {rank}: {reasons[rank]}")


def agree(
    received: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    refusal: str | None,
    descriptions: Sequence[str],
) -> tuple[list[int], int]:
    """The counts each peer sends and the widest count over all pairs of ranks, from the header rows received
    (``[P, >= len(COLUMNS)]``, one per sender), once every sender is OK and carries this rank's tables. Otherwise
    every rank raises the same ValueError: the first refusing rank and its ``refusal``, or, when none refused,
    the first rank whose tables differ from rank 0's, with both lists. Collective (only the error path
    communicates again)."""
    rows: list[list[int]] = received[:, : len(COLUMNS)].tolist()
    if HEADER.all_clear(rows):
        return HEADER.get(rows, "count"), max(HEADER.get(rows, "widest"), default=0)
    keys = HEADER.get(rows, "tables")
    reasons: list[tuple[str | None, list[str]] | None] = [None] * int(received.shape[0])
    dist.all_gather_object(reasons, (refusal, list(descriptions)), group=meta_group(group))
    for rank, reason in enumerate(reasons):
        assert reason is not None  # all_gather_object filled every slot
        if reason[0] is not None:
            raise ValueError(f"sharded lookup refused on rank {rank}: {reason[0]}")
    first = next(r for r in range(len(reasons)) if keys[r] != keys[0])
    ours, theirs = (reasons[r] for r in (0, first))
    assert ours is not None and theirs is not None
    raise ValueError(
        "the ranks look up different sharded tables in one exchange: rank 0 looks up "
        f"[{'; '.join(ours[1])}], rank {first} [{'; '.join(theirs[1])}]. Every rank must build the same "
        "model (sparsync.shard with the same plan) and call the same sharded tables in the same order in each "
        "forward"
    )
