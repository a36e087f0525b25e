"""The ids stage of a sharded step, the first of three (``exchange``'s module doc): each rank's distinct keys per
table group (``group``), ordered by owner, sent once to their owner in one all-to-all round, each block headed by
a row that carries the rank's verdict; on the owner, the rows of its flat tensors each requester asked for.

The ids payload a rank sends owner j carries every group of the exchange:

    [ c_0, ..., c_{G-1} | keys of group 0 owned by j | ... | keys of group G-1 owned by j ]

(c_g: how many keys of group g follow). Keys travel as int64 (8 bytes), so the owner maps them to its rows itself
(``key div P``).

The header (``HEADER``, a ``collectives.row.Schema`` as the metadata rounds' rows are): a row from each rank to
each peer in front of the keys it sends that peer: how many keys, whether the ranks may go on, the tables the
exchange carries, and the most it sends any peer. ``status`` and ``tables`` are the same in every row a rank
sends, so every rank learns every rank's verdict and makes the same decision: go on, or raise. Only in that
second case does a slower round run (``agree``): the ranks gather each one's reason in words, and every rank
raises the same ``ValueError``, naming the rank and its reason, instead of some ranks raising while the others
wait in the next round (the contract of ``sparsync.collectives.allreduce.refuse``).

Why the header rides with the keys (one round, not a sizes round and then a keys round): an all-to-all's receiver
must know each sender's length before the round, and each round is a point where every rank waits for the
slowest. So each rank sends every peer a block of a fixed length, ``len(HEADER) + capacity`` words: its header
row, then up to ``capacity`` keys, zero-padded. ``capacity`` is agreed without a word: every rank sees every
sender's ``widest`` column, so every rank computes the same ``capacity_after`` for the next exchange. Keys beyond
the capacity (the first exchange, capacity 0, or a batch wider than the last) follow in a second round whose
lengths the headers gave (``overflow``). Padding costs at most ``capacity`` - count words per peer.

The blocks of a round are built apart from its start (``prepare``): a batch's ids known a step ahead
(``Lookahead``) travel inside that step's gradient rows round (``kernels.Rider``), from requester to owner as
the ids do, or in a round of their own (``launch``) when no gradient rows round took them; ``finish`` reads
them either way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.ops import text_key
from sparsync.collectives.row import Agree, Column, Schema
from sparsync.collectives.traffic import Traffic
from sparsync.collectives.transport import meta_group
from sparsync.sharding.kernels import Link, Rider, unique


@dataclass(frozen=True)
class Asked:
    """One group's lookups on the requesting rank, deduplicated: what it asks each owner for."""

    distinct: torch.Tensor  # the distinct keys, by owner then key
    positions: torch.Tensor  # for each key looked up (all lookups of the group, in order): its row in distinct
    per_owner: tuple[int, ...]  # distinct ids asked of each owner


def dedupe_groups(ids: Sequence[torch.Tensor], parts: int, kernels: str = "auto") -> list[Asked]:
    """Each group's keys (int64, flat) as its distinct keys in owner order (an owner is the key mod ``parts``),
    and where each key finds its row among them: every key of every group mapped to (group, owner, key) in one
    int64, so one ``unique`` (one sort) orders them all (``tests/sharding/test_units.py`` holds the one-group
    reference it equals); ``kernels``: ``sharding.kernels.unique``'s setting."""
    T = len(ids)
    lens = [int(x.numel()) for x in ids]
    if T == 0:
        return []
    if T == 1 and parts == 1:  # one group, one owner: the sorted distinct keys are all there is
        keys, inverse = unique(ids[0], kernels)
        return [Asked(keys, inverse, (int(keys.numel()),))]
    flat = torch.cat(list(ids)) if T > 1 else ids[0]
    span = int(flat.max()) + 1 if flat.numel() else 1  # (group, owner) · span + key never collide
    group = None if T == 1 else torch.repeat_interleave(torch.arange(T), torch.tensor(lens, dtype=torch.int64))
    spread = flat if group is None else group * parts * span + flat  # one group: no group term (it is 0)
    if parts > 1:
        spread = spread + flat % parts * span
    keys, inverse = unique(spread, kernels)
    edges = torch.searchsorted(keys, torch.arange(T * parts + 1, dtype=torch.int64) * span)  # keys are sorted
    counts = edges.diff().view(T, parts)
    per_group = counts.sum(1)
    distinct: Sequence[torch.Tensor]
    if group is None:  # every key in group 0: its rows are the positions themselves
        where, distinct = inverse, ((keys % span) if parts > 1 else keys,)
    else:
        starts = torch.cumsum(per_group, 0) - per_group  # each group's first distinct key
        where = inverse - starts[group]  # each key's row among its own group's distinct keys
        distinct = torch.split(keys % span, per_group.tolist())
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
    """What this rank serves as an owner in one exchange, per group: the rows of its flat tensor each requester
    asked for (requesters in rank order), and how many per requester."""

    rows: tuple[torch.Tensor, ...]  # per group: rows of this rank's flat tensor, int64
    counts: tuple[tuple[int, ...], ...]  # per group, per requester


def parse_requests(payload: torch.Tensor, sizes: Sequence[int], groups: int, parts: int) -> Served:
    """The ids payloads received from every requester (``sizes``: their lengths, in rank order) as the rows of
    this rank's flat tensors they ask for: every payload's counts read at once, every key mapped to its row by one
    division, the rows grouped by group by one stable sort. RuntimeError for a payload whose counts do not add up
    to its length."""
    T, n = groups, len(sizes)
    size = torch.tensor(list(sizes), dtype=torch.int64)
    short = [int(k) for k in sizes if k < T]
    if short:
        raise RuntimeError(f"an ids payload of {short[0]} elements cannot hold the counts of {T} groups")
    if T == 0:
        return Served((), ())
    heads = (torch.cumsum(size, 0) - size).unsqueeze(1) + torch.arange(T)  # each payload's count words
    counts = payload[heads.reshape(-1)].view(n, T)
    if not torch.equal(counts.sum(1), size - T) or bool((counts < 0).any()):
        raise RuntimeError(f"ids payloads of {list(sizes)} elements carry counts {counts.tolist()}")
    keep = torch.ones(payload.numel(), dtype=torch.bool)
    keep[heads.reshape(-1)] = False
    keys = payload[keep]
    if T > 1:  # by group, requesters in rank order within each
        table = torch.repeat_interleave(torch.arange(T).repeat(n), counts.reshape(-1))
        keys = keys[torch.sort(table, stable=True).indices]
    local = keys // parts  # each key's row in this rank's flat tensor (``group``)
    rows = torch.split(local, counts.sum(0).tolist())
    return Served(tuple(rows), tuple(tuple(c) for c in counts.t().tolist()))


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


@dataclass
class IdsRound:
    """One ids round, prepared (``prepare``) and on its way (``launch``) or carried by a gradient rows round
    (``rider``): what was sent, and the blocks being received."""

    keys: tuple[torch.Tensor, ...]  # per group, the flat keys sent (checked)
    asked: list[Asked]
    payload: torch.Tensor
    counts: list[int]  # keys sent each peer
    capacity: int  # keys per block, as sent
    got: torch.Tensor  # the blocks received, [P·(len(HEADER) + capacity)]
    work: Any  # the round's work, None once waited (or with no peer)
    tally: Traffic
    refusal: str | None
    descriptions: tuple[str, ...]  # the tables' descriptions (the errors)
    rider: Rider | None = None  # the blocks to send (None: sent, or no round to run: ``_alone``)

    def wait(self) -> None:
        if self.work is not None:
            t0 = time.perf_counter()
            self.work.wait()
            self.work = None
            self.tally.phases["ids"] = self.tally.phases.get("ids", 0.0) + time.perf_counter() - t0
        if self.rider is not None and self.rider.got is not None:  # carried by a gradient rows round
            self.got, self.rider = self.rider.got, None


@dataclass(frozen=True)
class Ids:
    """The ids stage, finished: what this rank asks each owner (per group) and serves each requester, and the
    capacity of the next ids round."""

    keys: tuple[torch.Tensor, ...]  # per group, the keys sent
    asked: list[Asked]
    served: Served
    capacity: int
    tally: Traffic  # the round's bytes and time, counted in the exchange's record


@dataclass(frozen=True)
class Request:
    """What one ids stage sends: the groups' flat ``keys``, the ``tables`` column (``key``: ``tables_key`` of the
    tables' ``descriptions``), this rank's ``refusal`` (why it cannot go on, or None), and the agreed
    ``capacity`` of a block."""

    keys: Sequence[torch.Tensor]
    key: int
    descriptions: Sequence[str]
    refusal: str | None
    capacity: int


def start(link: Link, request: Request, tally: Traffic, wait: bool) -> IdsRound:
    """Start the ids round of ``request`` (module doc): ``prepare`` then ``launch``. Collective."""
    if link.size == 1 and request.refusal is None:
        return _alone(request, tally, wait)
    return launch(link, prepare(link, request, tally), wait)


def prepare(link: Link, request: Request, tally: Traffic) -> IdsRound:
    """The ids round of ``request``, not started: each peer's block, the header row and up to its ``capacity``
    keys, in the round's ``rider``, to send in a round of its own (``launch``) or in a gradient rows round
    (``kernels.Link.rows``)."""
    keys, refusal = request.keys, request.refusal
    if link.size == 1 and refusal is None:
        return _alone(request, tally, wait=False)
    asked: list[Asked] = []
    payload, counts = torch.empty(0, dtype=torch.int64), [0] * link.size
    if refusal is None:
        asked = dedupe_groups(keys, link.size)
        payload, counts = ids_payload(asked, link.size)
    status = OK if refusal is None else REFUSED
    P, W, C = link.size, len(COLUMNS), request.capacity
    blocks = blocks_to_peers(status, request.key, payload, counts, C)
    carried = sum(min(n, C) for j, n in enumerate(counts) if j != link.rank)  # keys sent in the blocks
    split = {"header": 8 * W * (P - 1), "ids": 8 * carried, "padding": 8 * (C * (P - 1) - carried)}
    rider = Rider(blocks.view(-1), W + C, split)
    nothing = torch.empty(0, dtype=torch.int64)
    return IdsRound(tuple(keys), asked, payload, counts, C, nothing, None, tally, refusal,
                    tuple(request.descriptions), rider)  # fmt: skip


def launch(link: Link, flight: IdsRound, wait: bool) -> IdsRound:
    """``flight``'s blocks sent in a round of their own, at once (``wait``) or in the background, unless they
    went already (no rider left). Mutates ``flight``. Collective."""
    rider = flight.rider
    if rider is None or rider.taken:
        return flight
    n = [rider.width] * link.size
    flight.got, flight.work = link.start(rider.take(), n, n, "ids", flight.tally, rider.split, wait)
    flight.rider = None
    return flight


def _alone(request: Request, tally: Traffic, wait: bool) -> IdsRound:
    """``start`` on a group of one rank that refuses nothing: the keys deduplicated, no block built and no round
    (the rank's one owner is itself, its key k its row k, ``group``), what a round would count (no byte, no
    message) counted as one."""
    asked = dedupe_groups(request.keys, 1)
    count = len(asked) + sum(int(a.distinct.numel()) for a in asked)  # the payload's length: counts, then keys
    t0 = time.perf_counter()
    tally.add(0, 0, 0)
    for phase in ("header", "ids", "padding"):
        tally.phase_bytes[phase] = tally.phase_bytes.get(phase, 0)
    if wait:
        tally.phases["ids"] = tally.phases.get("ids", 0.0) + time.perf_counter() - t0
    nothing = torch.empty(0, dtype=torch.int64)
    return IdsRound(tuple(request.keys), asked, nothing, [count], request.capacity, nothing, None, tally, None,
                    tuple(request.descriptions))  # fmt: skip


def finish(link: Link, flight: IdsRound) -> Ids:
    """``flight`` read, once every rank's header says go on; else every rank raises the same ValueError
    (``agree``). The keys past the capacity in a second round, which every rank runs when any pair overflowed
    (every rank saw every sender's widest). Collective."""
    flight.wait()
    if link.size == 1 and flight.refusal is None:  # ``_alone``: this rank asks itself for its distinct keys
        rows = tuple(a.distinct for a in flight.asked)
        served = Served(rows, tuple((int(r.numel()),) for r in rows))
        return Ids(flight.keys, flight.asked, served, capacity_after(flight.counts[0]), flight.tally)
    P, W, C = link.size, len(COLUMNS), flight.capacity
    got = flight.got.view(P, W + C)
    recv, widest = agree(got, link.group, refusal=flight.refusal, descriptions=flight.descriptions)
    parts = [got[i, W : W + min(n, C)] for i, n in enumerate(recv)]
    if widest > C:
        rest, rest_sizes = overflow(flight.payload, flight.counts, C)
        beyond = [max(n - C, 0) for n in recv]
        more_keys, _ = link.start(rest, rest_sizes, beyond, "ids", flight.tally, wait=True)
        more = torch.split(more_keys, beyond)
        parts = [t for pair in zip(parts, more, strict=True) for t in pair]
    served = parse_requests(torch.cat(parts), recv, len(flight.keys), link.size)
    return Ids(flight.keys, flight.asked, served, capacity_after(widest), flight.tally)


def run(link: Link, request: Request, tally: Traffic) -> Ids:
    """The ids stage of a forward, waited for: ``start`` then ``finish``. Collective."""
    return finish(link, start(link, request, tally, wait=True))
