"""The rows stage of a sharded lookup (``shard.exchange``'s stage 2, torchrec's lookup and output dist) and its
backward: ``RowExchange``, the autograd node whose forward sends each requester the rows it asked for and whose
backward sends each owner one gradient row per distinct id, summed into a sparse COO gradient of its shard; and
the regrouping of rows between table-major (what the tables hold) and peer-major (what an all-to-all sends),
one stable sort when the tables share a width.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from sparsync.collectives.traffic import Traffic
from sparsync.sharding import header

if TYPE_CHECKING:
    from sparsync.sharding.exchange import Route


def _flat(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in parts]) if parts else torch.empty(0, dtype=dtype)


def peer_major(rows: Sequence[torch.Tensor], counts: Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
    """Per table ``[n_t, D_t]`` rows, peer after peer (``counts[t][j]`` of them for peer j), as one flat payload
    peer after peer, table after table within (what an all-to-all sends). Tables of one width: one stable sort
    by peer over all rows instead of a split and a copy per table and peer."""
    P = len(counts[0]) if counts else 0
    if len({r.shape[1] for r in rows}) == 1 and P:
        peer = torch.repeat_interleave(torch.arange(P).repeat(len(rows)), torch.tensor(counts).reshape(-1))
        return torch.cat(list(rows)).index_select(0, torch.sort(peer, stable=True).indices).reshape(-1)
    per_peer = [torch.split(r, list(c)) for r, c in zip(rows, counts, strict=True)]
    return _flat([per_peer[t][j] for j in range(P) for t in range(len(rows))], dtype)


def table_major(
    flat: torch.Tensor, counts: Sequence[Sequence[int]], dims: Sequence[int]
) -> tuple[torch.Tensor, ...]:
    """``peer_major``'s inverse: a flat payload received peer after peer, table after table within
    (``counts[t][j]`` rows of table t from peer j), as per table ``[n_t, D_t]`` rows, peer after peer."""
    T, P = len(dims), len(counts[0]) if counts else 0
    totals = [sum(c) for c in counts]
    if len(set(dims)) == 1 and P:
        table = torch.repeat_interleave(torch.arange(T).repeat(P), torch.tensor(counts).t().reshape(-1))
        rows = flat.view(-1, dims[0]).index_select(0, torch.sort(table, stable=True).indices)
        return torch.split(rows, totals)
    by_table: list[list[torch.Tensor]] = [[] for _ in range(T)]
    widths = [sum(counts[t][j] * dims[t] for t in range(T)) for j in range(P)]
    for j, block in enumerate(torch.split(flat, widths)):
        for t, seg in enumerate(torch.split(block, [counts[t][j] * dims[t] for t in range(T)])):
            by_table[t].append(seg)
    return tuple(_flat(by_table[t], flat.dtype).view(-1, dims[t]) for t in range(T))


class RowExchange(torch.autograd.Function):
    """Stage 2 and its backward (module doc): inputs the tables' shards, outputs each table's gathered rows."""

    @staticmethod
    def forward(ctx: Any, route: Route, tally: Traffic, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ex = route.exchanger
        P, dtype = ex.size, shards[0].dtype
        # lookup: each requester's rows, table after table
        rows = [s.detach().index_select(0, r) for s, r in zip(shards, route.served.rows, strict=True)]
        reply = peer_major(rows, route.served.counts, dtype)
        to_req, from_owner = [route.rows_to(i) for i in range(P)], [route.rows_from(j) for j in range(P)]
        if route.status is None:
            got = ex.rows_all_to_all(reply, to_req, from_owner, "rows", tally)
        else:
            got = rows_with_verdicts(route, reply, to_req, from_owner, tally)
        # output dist: owner after owner, table after table -> per table, owner after owner
        gathered = table_major(got, route.asked, route.dims)
        ctx.route = route
        return tuple(gathered)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        route: Route = ctx.route
        ex = route.exchanger
        P, T = ex.size, len(grads)
        dtype = grads[0].dtype
        t0 = time.perf_counter()
        tally = Traffic()
        # grad dist: one gradient row per distinct id, to its owner (the forward's row splits, reversed)
        send = peer_major(grads, route.asked, dtype)
        to_owner, from_req = [route.rows_from(j) for j in range(P)], [route.rows_to(i) for i in range(P)]
        got = ex.rows_all_to_all(send, to_owner, from_req, "grads", tally)
        by_table = table_major(got, route.served.counts, route.dims)
        out: list[torch.Tensor | None] = [None, None]
        for t in range(T):
            if not ctx.needs_input_grad[2 + t]:
                out.append(None)
                continue
            rows = route.served.rows[t]
            values = by_table[t]
            pad = route.padding_local[t]
            if pad is not None:  # torch's embedding backward leaves padding_idx out
                keep = rows != pad
                rows, values = rows[keep], values[keep]
            shape = (route.shard_rows[t], route.dims[t])
            coo = torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, check_invariants=False)  # rows < shape
            out.append(coo.coalesce())  # one row per id: the sum over the requesters
        ex.record("shard_grad", tally, t0, nnz_in=sum(int(g.shape[0]) for g in grads),
                  nnz_out=sum(int(r.numel()) for r in route.served.rows))  # fmt: skip
        return tuple(out)


def rows_with_verdicts(
    route: Route, reply: torch.Tensor, to_req: list[int], from_owner: list[int], tally: Traffic
) -> torch.Tensor:
    """The rows round of a looked-ahead exchange: each block opens with this rank's verdict on its forward's calls
    (``Route.status``), so after the round every rank knows every rank's and, when any refused, every rank raises
    the same error (``header.raise_refused``); else the rows, as ``rows_all_to_all`` gives them."""
    ex = route.exchanger
    assert route.status is not None
    verdict = reply.new_full((1,), float(route.status))
    send = torch.cat([x for part in torch.split(reply, to_req) for x in (verdict, part)])
    sizes_out, sizes_in = [n + 1 for n in to_req], [n + 1 for n in from_owner]
    got = ex.rows_all_to_all(send, sizes_out, sizes_in, "rows", tally, verdicts=True)
    blocks = torch.split(got, sizes_in)
    header.raise_refused([int(b[0]) for b in blocks], ex.group, route.refusal)
    return torch.cat([b[1:] for b in blocks])
