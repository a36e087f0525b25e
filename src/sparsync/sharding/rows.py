"""The rows stage of a sharded step and its backward, the gradient rows stage (``exchange``'s module doc):
``RowExchange``, the autograd node whose forward reads the rows each requester asked for out of the owner's flat
tensors (one ``index_select`` per group) and sends them (one all-to-all round), and whose backward sends each
owner one gradient row per distinct key (one round) and sums them per row (one ``coalesce`` per group); then the
pooling of the calls on the gathered rows (``pool``): one ``index_select`` for the calls whose outputs are rows as
they are (embeddings, bags of one id each) and one ``embedding_bag`` per group and bag signature, however many
tables.

The owner's sum becomes each table's gradient (a sparse COO tensor per table called, cut out of the group's sum
without another sort), or, when the tables were sharded with an optimizer (``group.Fused``), the rows' update,
applied in place, with no gradient left behind.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsync.collectives.traffic import Traffic
from sparsync.collectives.transport import meta_group
from sparsync.sharding import kernels
from sparsync.sharding.group import Slot, TableGroup
from sparsync.sharding.ids import OK, Ids
from sparsync.sharding.kernels import Link, Rider


@dataclass
class Call:
    """One call of a sharded table, as its forward registered it: what to pool, how, and where the output goes."""

    group: int  # the table's group, in the exchanger's order
    slot: Slot
    table: str  # the table's description (errors, the header's key)
    refusal: str | None  # why this rank refuses the call (every rank then raises it), None when valid
    keys: torch.Tensor  # flat int64: the call's ids (the exchange adds the table's base); empty when refused
    shape: torch.Size  # the input's shape
    bag: bool  # nn.EmbeddingBag (else nn.Embedding)
    mode: str  # the bag's mode
    offsets: torch.Tensor | None  # int64, as the call gave them
    last: bool  # include_last_offset
    weights: torch.Tensor | None  # per_sample_weights
    padding: int | None  # padding_idx's key, or None
    single: bool = False  # every bag holds one id (a bag's pooled row is that id's row, as an embedding's is)
    version: int = 0  # ``keys._version`` at the call (the ids are read when the exchange runs)


@dataclass(frozen=True)
class Route:
    """What both directions of the rows stage need, per group: the stage ids' answer, the groups, the
    looked-ahead verdict word (``status``: None without lookahead; else OK, or REFUSED with ``refusal``), and the
    next batch's ids blocks its gradient rows round carries (``rider``: only with a verdict word, saying so)."""

    ids: Ids
    groups: tuple[TableGroup, ...]
    inputs: tuple[tuple[int, Slot], ...]  # (group, slot) of each table parameter handed to the node
    status: int | None = None
    refusal: str | None = None
    rider: Rider | None = None

    def rows_from(self, j: int) -> int:
        """Values this rank receives from owner j (forward) and sends it (backward)."""
        return sum(a.per_owner[j] * g.dim for a, g in zip(self.ids.asked, self.groups, strict=True))

    def rows_to(self, i: int) -> int:
        """Values this rank sends requester i (forward) and receives from it (backward)."""
        return sum(c[i] * g.dim for c, g in zip(self.ids.served.counts, self.groups, strict=True))


def peer_major(
    rows: Sequence[torch.Tensor],
    counts: Sequence[Sequence[int]],
    dtype: torch.dtype,
    lead: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per group ``[n_g, D_g]`` rows, peer after peer (``counts[g][j]`` of them for peer j), as one flat payload
    peer after peer, group after group within (what an all-to-all sends), each peer's part opening with ``lead``
    when given (in the same copy)."""
    P = len(counts[0]) if counts else 0
    if len(rows) == 1 and lead is None:
        return rows[0].reshape(-1)
    per_peer = [torch.split(r, list(c)) for r, c in zip(rows, counts, strict=True)]
    opening = [] if lead is None else [lead]
    parts = [x for j in range(P) for x in [*opening, *(per_peer[g][j].reshape(-1) for g in range(len(rows)))]]
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


def group_major(
    flat: torch.Tensor, counts: Sequence[Sequence[int]], dims: Sequence[int], lead: int = 0
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``peer_major``'s inverse: a flat payload received peer after peer, group after group within
    (``counts[g][j]`` rows of group g from peer j), each peer's part opening with ``lead`` values: per group
    ``[n_g, D_g]`` rows, peer after peer, and the peers' ``lead`` values, peer after peer."""
    G, P = len(dims), len(counts[0]) if counts else 0
    if G == 1 and not lead:
        return (flat.view(-1, dims[0]),), flat[:0]
    if G == 1:  # one split and two copies (the leads, the rows), not a split per peer
        parts = torch.split(flat, [n for j in range(P) for n in (lead, counts[0][j] * dims[0])])
        return (torch.cat(parts[1::2]).view(-1, dims[0]),), torch.cat(parts[0::2])
    by_group: list[list[torch.Tensor]] = [[] for _ in range(G)]
    leads = []
    widths = [lead + sum(counts[g][j] * dims[g] for g in range(G)) for j in range(P)]
    for j, block in enumerate(torch.split(flat, widths)):
        opening, *segs = torch.split(block, [lead, *(counts[g][j] * dims[g] for g in range(G))])
        leads.append(opening)
        for g, seg in enumerate(segs):
            by_group[g].append(seg)
    out = tuple(torch.cat(by_group[g]).view(-1, dims[g]) for g in range(G))
    return out, (torch.cat(leads) if leads else flat[:0])


class RowExchange(torch.autograd.Function):
    """The rows stage and its backward (module doc): inputs the called tables' parameters (autograd's edges;
    the rows are read from the groups' flat tensors they view), outputs each group's gathered rows."""

    @staticmethod
    def forward(
        ctx: Any, route: Route, link: Link, tally: Traffic, *params: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        del params
        ctx.route, ctx.link = route, link
        served = route.ids.served
        rows = [kernels.gather(g.flat, r) for g, r in zip(route.groups, served.rows, strict=True)]
        if route.status is not None:
            return with_verdicts(link, route, rows, tally)
        reply = peer_major(rows, served.counts, route.groups[0].dtype)
        sizes = ([route.rows_to(i) for i in range(link.size)], [route.rows_from(j) for j in range(link.size)])
        got = link.rows(reply, sizes, "rows", tally)
        return group_major(got, [a.per_owner for a in route.ids.asked], [g.dim for g in route.groups])[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        route: Route = ctx.route
        link: Link = ctx.link
        t0 = time.perf_counter()
        tally = Traffic()
        P, asked = link.size, route.ids.asked
        dense = [
            gr if gr is not None else g.flat.new_zeros(a.distinct.numel(), g.dim)
            for gr, g, a in zip(grads, route.groups, asked, strict=True)
        ]
        send = peer_major(dense, [a.per_owner for a in asked], route.groups[0].dtype)
        sizes = ([route.rows_from(j) for j in range(P)], [route.rows_to(i) for i in range(P)])
        got = link.rows(send, sizes, "grads", tally, rider=route.rider)
        by_group, _ = group_major(got, route.ids.served.counts, [g.dim for g in route.groups])
        served = route.ids.served.rows
        sums = [_owner_sum(g, r, v, P) for g, r, v in zip(route.groups, served, by_group, strict=True)]
        out: list[torch.Tensor | None] = [None] * (3 + len(route.inputs))  # route, link, tally, the tables
        for gi, (group, (rows, values)) in enumerate(zip(route.groups, sums, strict=True)):
            mine = [(k, slot) for k, (g, slot) in enumerate(route.inputs) if g == gi]
            if group.fused is not None:
                if group.across is not None:  # a replicated group: its rows summed over the ranks first
                    rows, values = group.across(rows, values)
                group.fused.apply(group, rows, values, [slot for _, slot in mine])
                continue
            wanted = [(k, slot) for k, slot in mine if ctx.needs_input_grad[3 + k]]
            for (k, _), grad in zip(wanted, _cut(rows, values, [slot for _, slot in wanted]), strict=True):
                out[3 + k] = grad
        if link.log is not None:
            link.record("shard_grad", tally, t0, nnz_in=sum(d.shape[0] for d in dense),
                        nnz_out=sum(int(r.numel()) for r in route.ids.served.rows))  # fmt: skip
        return tuple(out)


def _owner_sum(
    group: TableGroup, rows: torch.Tensor, values: torch.Tensor, requesters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient rows received for ``group`` summed per row (one sort; ``kernels.sum_rows``, coalesce's bits):
    (rows ascending, their sums), the tables' padding rows left out (torch's embedding backward leaves
    padding_idx out). From one requester the rows are distinct and ascending already (its distinct keys,
    sorted): nothing to sum."""
    if group.padding_rows.numel():
        keep = ~torch.isin(rows, group.padding_rows)
        rows, values = rows[keep], values[keep]
    if requesters == 1:
        return rows, values
    return kernels.sum_rows(rows, values, group.flat.shape[0])


def _cut(rows: torch.Tensor, values: torch.Tensor, slots: list[Slot]) -> list[torch.Tensor]:
    """Each table's gradient, a coalesced sparse COO tensor of its shard's shape, cut out of its group's sum
    (``rows`` ascending) where its rows begin and end: one search for all the tables."""
    ends = torch.tensor([e for s in slots for e in (s.first, s.first + s.owned)], dtype=rows.dtype)
    cuts = torch.searchsorted(rows, ends).tolist()
    out = []
    for t, slot in enumerate(slots):
        lo, hi = cuts[2 * t], cuts[2 * t + 1]
        index = (rows[lo:hi] - slot.first).unsqueeze(0)
        shape = (slot.owned, values.shape[1])
        out.append(torch.sparse_coo_tensor(index, values[lo:hi], shape, is_coalesced=True, check_invariants=False))
    return out


RIDES = 2  # added to the verdict word by a rank whose gradient rows round will carry the next batch's ids


def with_verdicts(
    link: Link, route: Route, rows: Sequence[torch.Tensor], tally: Traffic
) -> tuple[torch.Tensor, ...]:
    """The rows round of a looked-ahead exchange: each block opens with one value, this rank's verdict on its
    forward's calls (``Route.status``), plus ``RIDES`` when its gradient rows round will carry the next batch's ids
    (``Route.rider``), so after the round every rank knows every rank's: when any refused, or when some would
    carry the ids and others not, every rank raises the same error (``raise_refused``, ``agree_riders``); else
    each group's rows received (``rows``: the rows this rank serves, gathered). The verdicts go in and come out
    in the copies that interleave the groups (``peer_major``, ``group_major``)."""
    word = float((OK if route.status is None else route.status) + RIDES * (route.rider is not None))
    P = link.size
    reply = peer_major(rows, route.ids.served.counts, route.groups[0].dtype, lead=rows[0].new_full((1,), word))
    sizes = ([route.rows_to(i) + 1 for i in range(P)], [route.rows_from(j) + 1 for j in range(P)])
    got = link.rows(reply, sizes, "rows", tally, verdicts=True)
    out, words = group_major(got, [a.per_owner for a in route.ids.asked], [g.dim for g in route.groups], lead=1)
    said = [int(w) for w in words.tolist()]
    raise_refused([w % RIDES for w in said], link.group, route.refusal)
    agree_riders([w // RIDES for w in said])
    return out


def agree_riders(rides: Sequence[int]) -> None:
    """Nothing when every rank's flag (``rides[r]``: 1 when rank r's gradient rows round of this exchange will
    carry the next batch's ids; the same list on every rank) is the same; else the same ValueError on every rank,
    naming the ranks on each side (their rounds' lengths would differ). Not collective."""
    if len(set(rides)) <= 1:
        return
    carry = [r for r, f in enumerate(rides) if f]
    not_ = [r for r, f in enumerate(rides) if not f]
    raise ValueError(
        f"Lookahead: ranks {carry} would send the next batch's ids in this step's gradient rows round, ranks "
        f"{not_} would not (a forward under torch.no_grad, or of tables that need no gradient, on some ranks "
        "only); every rank must run the same forwards, with gradients or without, and the same backwards"
    )


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


# --- the pooling -------------------------------------------------------------------------------------------------
def lookup(
    route: Route,
    link: Link,
    tally: Traffic,
    params: Sequence[torch.Tensor],
    pooling: Sequence[tuple[Sequence[Call], torch.Tensor, dict[int, int]]],
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The rows stage of a forward, then the pooling: each group's rows gathered (``RowExchange``, whose inputs
    are the called tables' ``params``), and each group's calls pooled (``pool``, with that group's ``pooling``:
    its calls, their positions, its padding rows). The gathered rows and the calls' outputs, per group.
    Collective."""
    gathered: list[torch.Tensor] = list(RowExchange.apply(route, link, tally, *params))  # type: ignore[no-untyped-call]
    t0 = time.perf_counter()
    outputs = [pool(rows, *p) for rows, p in zip(gathered, pooling, strict=True)]
    tally.phases["pool"] = time.perf_counter() - t0
    return gathered, outputs


def pool(
    gathered: torch.Tensor, calls: Sequence[Call], positions: torch.Tensor, padding_at: dict[int, int]
) -> list[torch.Tensor]:
    """The output of each of one group's ``calls``, in their order, computed by torch's own functional on the
    group's ``gathered`` rows, the positions of its keys among them (``positions``: every call's, in call order)
    standing for its ids: the calls that share a signature in one ``embedding_bag`` (or ``embedding``), their
    outputs split apart; a call with a padding row alone (``padding_at``: padding key -> its row among
    ``gathered``)."""
    sizes = [c.keys.numel() for c in calls]
    if calls and all(c.padding is None and _as_rows(c) for c in calls):  # one pick of every call's rows, in order
        got = torch.split(kernels.pick_rows(gathered, positions), sizes)
        return [
            part if c.bag else part.view(*c.shape, gathered.shape[1]) for c, part in zip(calls, got, strict=True)
        ]
    per_call = torch.split(positions, sizes)
    out: list[torch.Tensor] = [positions] * len(calls)  # each place filled below
    fused: dict[tuple[Any, ...], list[tuple[int, Call, torch.Tensor]]] = {}
    for i, (call, pos) in enumerate(zip(calls, per_call, strict=True)):
        if call.padding is not None:
            out[i] = _pool_one(gathered, call, pos, padding_at.get(call.padding))
        elif _as_rows(call):
            fused.setdefault(("rows",), []).append((i, call, pos))
        else:
            fused.setdefault((call.mode, call.weights is not None), []).append((i, call, pos))
    for signature, members in fused.items():
        if signature == ("rows",):
            _pool_rows(gathered, members, out)
        else:
            _pool_bags(gathered, members, out, *signature)
    return out


def _as_rows(call: Call) -> bool:
    """Whether the call's output is its ids' rows as they are (an embedding, bags of one id each, unweighted)."""
    return not call.bag or (call.single and call.weights is None)


def _pool_one(gathered: torch.Tensor, call: Call, pos: torch.Tensor, padding: int | None) -> torch.Tensor:
    if not call.bag:
        return nn.functional.embedding(pos.view(call.shape), gathered, padding)
    return nn.functional.embedding_bag(
        pos.view(call.shape), gathered, call.offsets, mode=call.mode, per_sample_weights=call.weights,
        include_last_offset=call.last, padding_idx=padding,
    )  # fmt: skip


def _pool_rows(
    gathered: torch.Tensor, members: Sequence[tuple[int, Call, torch.Tensor]], out: list[torch.Tensor]
) -> None:
    """Calls whose outputs are rows as they are (embeddings, bags of one id each): one ``index_select``; each
    member's output at its index of ``out``."""
    got = kernels.pick_rows(gathered, torch.cat([p for _, _, p in members]) if len(members) > 1 else members[0][2])
    for (i, call, _), part in zip(members, torch.split(got, [p.numel() for _, _, p in members]), strict=True):
        out[i] = part.view(*call.shape, gathered.shape[1]) if not call.bag else part


def _pool_bags(
    gathered: torch.Tensor,
    members: Sequence[tuple[int, Call, torch.Tensor]],
    out: list[torch.Tensor],
    mode: str,
    weighted: bool,
) -> None:
    """One ``embedding_bag`` over the members' bags, each call's bags one after another (offsets shifted); each
    member's output at its index of ``out``."""
    positions, offsets, bags = [], [], []
    weights: list[torch.Tensor] = []
    at = 0
    for _, call, pos in members:
        flat, offs, w = _as_bags(call, pos)
        positions.append(flat)
        offsets.append(offs + at)
        if w is not None:
            weights.append(w)
        bags.append(offs.numel())
        at += flat.numel()
    pooled = nn.functional.embedding_bag(
        torch.cat(positions), gathered, torch.cat(offsets), mode=mode,
        per_sample_weights=torch.cat(weights) if weighted else None,
    )  # fmt: skip
    for (i, _, _), part in zip(members, torch.split(pooled, bags), strict=True):
        out[i] = part


def _as_bags(call: Call, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A bag call as (positions, offsets without a last one, per-sample weights), flat: a 2-D input's rows are its
    bags; with ``include_last_offset`` the ids past the last offset are left out, as torch leaves them out."""
    w = call.weights.reshape(-1) if call.weights is not None else None
    if len(call.shape) == 2:
        B, L = call.shape
        return pos, torch.arange(B, dtype=torch.int64) * L, w
    assert call.offsets is not None
    if not call.last:
        return pos, call.offsets, w
    end = int(call.offsets[-1]) if call.offsets.numel() else 0
    return pos[:end], call.offsets[:-1], (w[:end] if w is not None else None)
