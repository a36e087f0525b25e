"""The grouped exchange of a model's sharded tables: every lookup registered since the last exchange travels in
one all-to-all per direction, whatever the number of tables.

Forward, three stages (torchrec's input dist, lookup, output dist), then the pooling:

1. input dist (``header``, ``route``): each rank's distinct ids per table, each sent once, to its owner, in
   one all-to-all whose block to each peer opens with a header row: this rank's verdict on its own input, the
   key of the tables it carries, how many ids follow. Any refusal or mismatch: every rank raises the same error
   here, before any row moves. The blocks have a length every rank knows without a sizes round (the capacity
   agreed from the last exchange); ids beyond it follow in a second round, run only when some pair overflowed.
2. lookup and output dist: each owner reads the asked rows of its shards and sends each requester its rows:
   one all-to-all (``rows.RowExchange.forward``). Each rank now holds one row per distinct id it looked up.
3. pooling, locally: each lookup's own function (``nn.functional.embedding`` or ``embedding_bag`` on the
   gathered rows, the positions of its ids among them standing for the ids), so the pooled values are what
   torch's module computes on the whole table, bit for bit.

Backward, one all-to-all (``RowExchange.backward``): autograd has summed each rank's gradient per gathered
row (the pooling's backward on the rows); each rank sends one gradient row per distinct id to its owner, which
sums the rows it receives from all ranks into a sparse COO gradient of its shard. The owner's gradient is then
the sum over the ranks, as a replicated table's would be after a sum-allreduce (Parallax's push to the
servers, §3.1, with the servers being the ranks themselves).

Bytes per rank and step (``sparsync.plan.kinds.ShardedKind``): f·Σ_t u_t·(8 + 2·w·D_t) requested (ids out,
rows in, gradient rows out; f = (P-1)/P of the ids go to another rank, u_t distinct ids of table t, w bytes per
value), plus as much served; the headers add 32·(P-1) bytes each way, and the blocks' padding the capacity less the
count per peer (``header``: a few percent when the ranks' batches are alike).

The exchange runs on the caller's group in the caller's thread, as a model's own collective (DLRM's
all-to-all): sparsync's background work (``DistributedOptimizer``'s reductions during backward) runs on its
own group and never interleaves with it. Every rank must resolve its lookups at the same points and run
backward through every exchange (a rank whose loss does not depend on them would leave the others waiting).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from sparsync.collectives.timeline import tracer
from sparsync.collectives.trace import scope
from sparsync.collectives.traffic import Traffic
from sparsync.record import CommLog, CommRecord
from sparsync.sharding import header
from sparsync.sharding.lazy import LazyLookup, resolve_all
from sparsync.sharding.ownership import Ownership
from sparsync.sharding.route import Asked, Served, dedupe_tables, ids_payload, parse_requests
from sparsync.sharding.rows import RowExchange

# ``sparsync.shard(rows=...)``: the lower precisions rows and gradient rows may travel in
WIRE: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}

# (rows gathered for the table [u, D], positions of the call's ids among them (flat), the row of padding_idx
# among them or None) -> the call's output
Pool = Callable[[torch.Tensor, torch.Tensor, int | None], torch.Tensor]


class Table(Protocol):
    """What the exchanger needs of a sharded table (``shard.modules.ShardedTable``)."""

    @property
    def table_name(self) -> str: ...

    @property
    def shard(self) -> torch.nn.Parameter: ...

    @property
    def ownership(self) -> Ownership: ...

    @property
    def padding_row(self) -> int | None: ...

    def describe(self) -> str: ...

    def checked_ids(self, input: Any) -> tuple[torch.Tensor, str | None]: ...


@dataclass
class Lookup:
    """One call of a sharded table, waiting for the exchange."""

    table: Table
    ids: torch.Tensor  # flat int64, validated (empty when refused)
    pool: Pool
    refusal: str | None  # why this rank refuses the call (every rank then raises it), None when valid
    out: LazyLookup


@dataclass(frozen=True)
class Route:
    """What both directions of one exchange need: the requests (per table, distinct ids asked of each owner), what
    this rank serves, and the shapes."""

    exchanger: Exchanger
    dims: tuple[int, ...]
    asked: tuple[tuple[int, ...], ...]  # per table, per owner
    served: Served
    shard_rows: tuple[int, ...]
    padding_local: tuple[int | None, ...]  # per table: padding_idx's row in this rank's shard, if it owns it
    # a looked-ahead exchange (``Prefetched``): the rows round carries each rank's verdict on its forward's calls
    # (one word per block: 0, or 1 when ``refusal`` says why this rank cannot go on); None: no such word
    status: int | None = None
    refusal: str | None = None

    def rows_from(self, j: int) -> int:
        """Values this rank receives from owner j (forward) and sends it (backward)."""
        return sum(self.asked[t][j] * d for t, d in enumerate(self.dims))

    def rows_to(self, i: int) -> int:
        """Values this rank sends requester i (forward) and receives from it (backward)."""
        return sum(self.served.counts[t][i] * d for t, d in enumerate(self.dims))


@dataclass
class IdsRound:
    """One ids round on its way (``Exchanger._ids``): what was sent, and the blocks being received."""

    exchanger: Exchanger
    tables: tuple[Table, ...]
    ids: tuple[torch.Tensor, ...]  # per table, the flat ids sent (checked)
    descriptions: tuple[str, ...]  # per table, ``Table.describe()`` (the header's key, the errors)
    asked: list[Asked]
    payload: torch.Tensor
    counts: list[int]  # ids sent each peer
    capacity: int  # ids per block, as sent
    got: torch.Tensor  # the blocks received, [P·(len(HEADER) + capacity)]
    work: Any  # the all-to-all's work, None once waited (or with no peer)
    tally: Traffic
    refusal: str | None

    def wait(self) -> None:
        if self.work is not None:
            t0 = time.perf_counter()
            self.work.wait()
            self.work = None
            self.tally.phases["ids"] = self.tally.phases.get("ids", 0.0) + time.perf_counter() - t0

    def finish(self) -> tuple[list[Asked], list[int], torch.Tensor]:
        """(what this rank asks each owner per table, the counts each peer sent, every peer's ids in rank order:
        ``route.parse_requests``' payload) once every rank's header says go on; else every rank raises the same
        ValueError (``header.agree``). The ids past the capacity in a second round, which every rank runs when
        any pair overflowed (every rank saw every sender's widest). Collective."""
        self.wait()
        ex, C = self.exchanger, self.capacity
        P, W = ex.size, len(header.COLUMNS)
        got = self.got.view(P, W + C)
        recv, widest = header.agree(got, ex.group, refusal=self.refusal, descriptions=self.descriptions)
        parts = [got[i, W : W + min(n, C)] for i, n in enumerate(recv)]
        if widest > C:
            rest, rest_sizes = header.overflow(self.payload, self.counts, C)
            beyond = [max(n - C, 0) for n in recv]
            got, _ = ex.all_to_all_start(rest, rest_sizes, beyond, "ids", self.tally, wait=True)
            more = torch.split(got, beyond)
            parts = [t for pair in zip(parts, more, strict=True) for t in pair]
        ex.capacity = header.capacity_after(widest)
        return self.asked, recv, torch.cat(parts)


@dataclass(frozen=True)
class Prefetched:
    """A batch's ids round, run ahead and read (``Exchanger.settle``): all the forward's exchange still needs but
    its rows round."""

    tables: tuple[Table, ...]
    ids: tuple[torch.Tensor, ...]  # per table, the ids sent ahead
    asked: list[Asked]
    route: Route
    tally: Traffic  # the ids round's bytes, counted in the exchange's record

    def differs(self, calls: dict[Table, list[Lookup]]) -> str | None:
        """Why the forward's calls are not the ones whose ids went ahead, or None when they are."""
        hint = (
            "; the lookahead's ids function must give, per sharded table, the ids the model's forward looks it "
            "up with on that batch (all its calls', in call order), and the forward must look them up in one "
            "exchange"
        )
        if set(calls) != set(self.tables):
            called = sorted(t.table_name for t in calls)
            sent = sorted(t.table_name for t in self.tables)
            return f"the forward looked up the tables {called}, but the lookahead sent ids for {sent}{hint}"
        for t, sent_ids in zip(self.tables, self.ids, strict=True):
            looked = torch.cat([lk.ids for lk in calls[t]])
            if not torch.equal(looked, sent_ids):
                return (
                    f"the forward looked up {looked.numel()} ids of {t.describe()}, not the {sent_ids.numel()} "
                    f"the lookahead sent for this batch{hint}"
                )
        return None


class Exchanger:
    """The sharded tables of one model: their pending lookups and the grouped exchange (module doc). One per
    ``sparsync.shard`` call; ``group``: the ranks that own the rows. ``log`` receives a ``CommRecord`` per
    exchange and direction (``shard_lookup``, ``shard_grad``). ``wire``: a lower precision (``WIRE``) the rows
    and gradient rows travel in, each rounded once on the way (lossy); the tables, the pooling and the owners'
    sums keep the tables' dtype."""

    def __init__(
        self, group: dist.ProcessGroup, log: CommLog | None = None, wire: torch.dtype | None = None
    ) -> None:
        self.group = group
        self.wire = wire  # the dtype rows and gradient rows travel in (``WIRE``); None: the tables' own
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.log = log
        self.pending: list[Lookup] = []
        self.capacity = 0  # ids per block of the next ids round (``header``), the same on every rank
        self.ready: Prefetched | None = None  # the next exchange's ids round, run ahead (``shard.lookahead``)

    def register(self, table: Table, ids: torch.Tensor, pool: Pool, refusal: str | None) -> LazyLookup:
        """Queue one call of ``table``; its output is the returned stand-in (``lazy``)."""
        out = LazyLookup(self.flush, table.describe())
        self.pending.append(Lookup(table, ids, pool, refusal, out))
        return out

    def finish_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        """A model's forward hook: run what is pending, and return the output with every stand-in resolved."""
        del module, args
        self.flush()
        return resolve_all(output)

    def send_ahead(self, tables: Sequence[Table], ids: Sequence[Any]) -> IdsRound:
        """Start the ids round of a batch the model has not seen yet, in the background (``shard.lookahead``):
        ``ids[t]``, what ``tables[t]`` will be called with (all its calls' ids, in call order), checked as its
        forward checks them (a refusal travels in the header: every rank raises it at ``settle``). Collective:
        every rank sends ahead the same tables at the same point."""
        checked = [t.checked_ids(x) for t, x in zip(tables, ids, strict=True)]
        refusal = next((r for _, r in checked if r is not None), None)
        return self._ids(tables, [i for i, _ in checked], refusal, Traffic(), wait=False)

    def settle(self, flight: IdsRound) -> None:
        """Wait for ``flight`` (``send_ahead``) and read it: the next exchange then runs only its rows round, with
        these ids (``_exchange_prefetched``). Collective (a second round when a pair of ranks overflowed)."""
        asked, recv, ids_in = flight.finish()
        served = parse_requests(ids_in, recv, [t.ownership for t in flight.tables])
        self.ready = Prefetched(flight.tables, flight.ids, asked, self._route(flight.tables, asked, served),
                                flight.tally)  # fmt: skip

    def flush(self) -> None:
        """One grouped exchange of every pending lookup; each stand-in gets its tensor (or, when the exchange
        failed, its error). Collective over the group."""
        lookups, self.pending = self.pending, []
        if not lookups:
            return
        try:
            self._exchange(lookups)
        except BaseException as e:
            for lk in lookups:
                if not lk.out.done:
                    lk.out.fail(e)
            raise

    # --- the stages ---------------------------------------------------------------------------------------------
    def _exchange(self, lookups: list[Lookup]) -> None:
        t0 = time.perf_counter()
        calls = _by_table(lookups)
        ready, self.ready = self.ready, None
        if ready is not None:  # the ids went ahead (``shard.lookahead``): only the rows round is left
            self._exchange_prefetched(calls, lookups, ready, t0)
            return
        tally = Traffic()
        tables = list(calls)
        ids = [torch.cat([lk.ids for lk in calls[t]]) for t in tables]
        refusal = next((lk.refusal for lk in lookups if lk.refusal is not None), None)
        asked, recv_sizes, ids_in = self._ids(tables, ids, refusal, tally, wait=True).finish()
        route = self._route(tables, asked, parse_requests(ids_in, recv_sizes, [t.ownership for t in tables]))
        self._rows_and_pool(route, tables, calls, asked, tally, t0)

    def _exchange_prefetched(
        self, calls: dict[Table, list[Lookup]], lookups: list[Lookup], ready: Prefetched, t0: float
    ) -> None:
        """The forward's exchange after a lookahead sent its ids: the rows round, headed by each rank's verdict
        (``Route.status``): a call refused here, or calls that differ from the ids sent ahead, make every rank
        raise after the round, where the ranks are together."""
        refusal = next((lk.refusal for lk in lookups if lk.refusal is not None), None) or ready.differs(calls)
        route = replace(ready.route, status=header.OK if refusal is None else header.REFUSED, refusal=refusal)
        self._rows_and_pool(route, list(ready.tables), calls, ready.asked, ready.tally, t0)

    def _rows_and_pool(
        self,
        route: Route,
        tables: list[Table],
        calls: dict[Table, list[Lookup]],
        asked: Sequence[Asked],
        tally: Traffic,
        t0: float,
    ) -> None:
        """Stages 2 and 3 (module doc): the rows round (autograd's node: its backward sends the gradient rows),
        then each call pooled on its table's gathered rows."""
        gathered: tuple[torch.Tensor, ...] = RowExchange.apply(  # type: ignore[no-untyped-call]
            route, tally, *(t.shard for t in tables)
        )
        t_pool = time.perf_counter()
        for t, (table, a) in enumerate(zip(tables, asked, strict=True)):
            mine = calls[table]
            pad = _padding_position(a, table.padding_row)
            for lk, pos in zip(mine, torch.split(a.positions, [lk.ids.numel() for lk in mine]), strict=True):
                lk.out.resolve(lk.pool(gathered[t], pos, pad))
        tally.phases["pool"] = time.perf_counter() - t_pool
        self.record(
            "shard_lookup", tally, t0,
            nnz_in=sum(a.distinct.numel() for a in asked), nnz_out=sum(int(g.shape[0]) for g in gathered),
        )  # fmt: skip

    def _route(self, tables: Sequence[Table], asked: Sequence[Asked], served: Served) -> Route:
        return Route(
            self,
            tuple(t.shard.shape[1] for t in tables),
            tuple(a.per_owner for a in asked),
            served,
            tuple(t.shard.shape[0] for t in tables),
            tuple(_local_padding(t, self.rank) for t in tables),
        )

    def _ids(
        self, tables: Sequence[Table], ids: Sequence[torch.Tensor], refusal: str | None, tally: Traffic, wait: bool
    ) -> IdsRound:
        """Start the ids round (``header``'s module doc) of ``tables``' flat ids: each peer's block, the header
        row and up to ``capacity`` ids, sent at once (``wait``) or in the background; ``IdsRound.finish`` reads
        the blocks and runs the second round when any pair of ranks sends more. Collective."""
        descriptions = [t.describe() for t in tables]
        dtypes = {t.shard.dtype for t in tables}
        if refusal is None and len(dtypes) > 1:
            refusal = f"the tables of one exchange must share a dtype, these have {sorted(map(str, dtypes))}"
        asked: list[Asked] = []
        payload, counts = torch.empty(0, dtype=torch.int64), [0] * self.size
        if refusal is None:
            asked = dedupe_tables(ids, self.size)
            payload, counts = ids_payload(asked, self.size)
        status = header.OK if refusal is None else header.REFUSED
        P, W, C = self.size, len(header.COLUMNS), self.capacity
        blocks = header.blocks_to_peers(status, header.tables_key(descriptions), payload, counts, C)
        carried = sum(min(n, C) for j, n in enumerate(counts) if j != self.rank)  # ids sent in the blocks
        split = {"header": 8 * W * (P - 1), "ids": 8 * carried, "padding": 8 * (C * (P - 1) - carried)}
        got, work = self.all_to_all_start(blocks.view(-1), [W + C] * P, [W + C] * P, "ids", tally, split, wait)
        sent = (tuple(tables), tuple(ids), tuple(descriptions))
        return IdsRound(self, *sent, asked, payload, counts, C, got, work, tally, refusal)

    def rows_all_to_all(
        self,
        send: torch.Tensor,
        send_sizes: list[int],
        recv_sizes: list[int],
        phase: str,
        tally: Traffic,
        verdicts: bool = False,
    ) -> torch.Tensor:
        """An all-to-all of row values (``all_to_all_start``, waited for), in ``wire`` precision when set, back in
        ``send``'s dtype. ``verdicts``: each block opens with one word that is no row
        (``rows.rows_with_verdicts``), counted as ``header``."""
        wire = send.dtype if self.wire is None else self.wire
        split = None
        if verdicts:
            header_bytes = wire.itemsize * (self.size - 1)
            rows_bytes = wire.itemsize * (sum(send_sizes) - send_sizes[self.rank]) - header_bytes
            split = {phase: rows_bytes, "header": header_bytes}
        got, _ = self.all_to_all_start(send.to(wire), send_sizes, recv_sizes, phase, tally, split, wait=True)
        return got.to(send.dtype)

    def all_to_all_start(
        self,
        send: torch.Tensor,
        send_sizes: list[int],
        recv_sizes: list[int],
        phase: str,
        tally: Traffic,
        split: dict[str, int] | None = None,
        wait: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """``dist.all_to_all_single`` with split sizes (elements), started: the tensor it fills and the work to
        wait for (None once waited, with ``wait``, or with no peer). Counts what crossed to other ranks, under
        ``phase`` or, given ``split``, under its phases (bytes sent each; they add up to the round's), and with
        ``wait`` the time under ``phase`` (else the waiter's). Each round is a ``trace.scope`` (a profiler range,
        and an event on the rank's timeline): ``shard:<phase>``, or ``shard:<phase> start`` for a round not waited
        for here."""
        w = send.element_size()
        sent = w * (sum(send_sizes) - send_sizes[self.rank])
        t0 = time.perf_counter()
        work = None
        with scope(tracer(), "shard", f"shard:{phase}" if wait else f"shard:{phase} start", bytes=sent):
            if self.size == 1:
                out = send
            else:
                out = send.new_empty(sum(recv_sizes))
                work = dist.all_to_all_single(
                    out, send.contiguous(), recv_sizes, send_sizes, group=self.group, async_op=True
                )
                if wait:
                    work.wait()
                    work = None
        tally.add(sent, w * (sum(recv_sizes) - recv_sizes[self.rank]), self.size - 1)
        for name, n in (split or {phase: sent}).items():
            tally.phase_bytes[name] = tally.phase_bytes.get(name, 0) + n
        if wait:
            tally.phases[phase] = tally.phases.get(phase, 0.0) + time.perf_counter() - t0
        return out, work

    def record(self, op: str, tally: Traffic, t0: float, *, nnz_in: int, nnz_out: int) -> None:
        if self.log is None:
            return
        self.log.append(
            CommRecord(
                op, "alltoall", self.rank, self.size, 0, nnz_in, nnz_out, tally.bytes_sent, tally.bytes_recv,
                tally.messages, time.perf_counter() - t0, dict(tally.phases), None, dict(tally.phase_bytes),
            )
        )  # fmt: skip


def _by_table(lookups: Sequence[Lookup]) -> dict[Table, list[Lookup]]:
    """Each table's lookups, tables and calls in registration order."""
    calls: dict[Table, list[Lookup]] = {}
    for lk in lookups:
        calls.setdefault(lk.table, []).append(lk)
    return calls


def _local_padding(table: Table, rank: int) -> int | None:
    pad = table.padding_row
    if pad is None or int(table.ownership.owner(torch.tensor(pad))) != rank:
        return None
    return int(table.ownership.local(torch.tensor(pad)))


def _padding_position(asked: Asked, padding: int | None) -> int | None:
    """Where ``padding_idx`` sits among the gathered rows, if this rank looked it up."""
    if padding is None:
        return None
    hit = torch.nonzero(asked.distinct == padding)
    return int(hit[0, 0]) if hit.numel() else None
