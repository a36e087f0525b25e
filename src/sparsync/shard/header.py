"""The sizes round of a sharded lookup: one small all-to-all before any payload moves, whose row from each rank to
each peer says how many ids follow and whether the ranks may go on.

The row is a schema (``HEADER``, a ``collectives.row.Schema`` as the metadata rounds' rows are): each column
named once, with how the ranks must agree on it and what it holds. ``status`` and ``tables`` are the same in
every row a rank sends, so every rank learns every rank's verdict and makes the same decision: go on, or raise.
Only in that second case does a slower round run (``agree``): the ranks gather each one's reason in words, and
every rank raises the same ``ValueError``, naming the rank and its reason, instead of some ranks raising while
the others wait in the next all-to-all (the same contract as ``sparsync.collectives.allreduce.refuse``, on this
exchange's own round).
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
        Column("count", Agree.OWN, doc="int64 elements this rank sends that peer in the ids round (per peer)"),
    )
)
COLUMNS = HEADER.columns
OK, REFUSED = 0, 1


def tables_key(descriptions: Sequence[str]) -> int:
    """The ``tables`` column: a key of the tables' descriptions (name, kind, rows, dim, dtype), in order."""
    return text_key("\n".join(descriptions))


def rows_to_peers(status: int, key: int, counts: Sequence[int]) -> torch.Tensor:
    """This rank's rows of the sizes round, one per peer: ``[P, len(COLUMNS)]`` int64."""
    out = torch.empty(len(counts), len(COLUMNS), dtype=torch.int64)
    out[:, HEADER.index("status")] = status
    out[:, HEADER.index("tables")] = key
    out[:, HEADER.index("count")] = torch.tensor(list(counts), dtype=torch.int64)
    return out


def agree(
    received: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    refusal: str | None,
    descriptions: Sequence[str],
) -> list[int]:
    """The counts each peer will send, from the rows received (``[P, len(COLUMNS)]``, one per sender), once
    every sender is OK and carries this rank's tables. Otherwise every rank raises the same ValueError: the
    first refusing rank and its ``refusal``, or, when none refused, the first rank whose tables differ from
    rank 0's, with both lists. Collective (only the error path communicates again)."""
    rows: list[list[int]] = received.tolist()
    if HEADER.all_clear(rows):
        return HEADER.get(rows, "count")
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
