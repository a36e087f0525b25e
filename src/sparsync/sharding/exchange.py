"""One sharded step of a model's tables, in the order it runs: a table's forward registers its call and returns a
stand-in (``LazyLookup``); every call registered since the last exchange travels in one exchange, whatever the
number of tables, in three stages over the tables' groups (``group``):

1. ids (``ids``): each rank's distinct keys per group, each sent once to its owner, in one all-to-all round whose
   block to each peer opens with a header row (this rank's verdict on its own calls, the key of the tables it
   looks up, how many keys follow). Any refusal or mismatch: every rank raises the same error there. Keys beyond
   the blocks' agreed capacity follow in a second round, run only when some pair of ranks overflowed.
2. rows (``rows``): each owner reads the asked rows of its flat tensors (one ``index_select`` per group) and sends
   each requester its rows, one round; each rank then pools its calls on the rows gathered for them (one
   ``embedding_bag`` per group and call signature), as torch's module computes them on the whole table.
3. gradient rows (``rows.RowExchange.backward``): each rank sends one gradient row per distinct key to its owner,
   one round; the owner sums them per row, one sort per group, into each table's gradient (the sum over the
   ranks, as a replicated table's after a sum-allreduce: Parallax's push to the servers, §3.1, with the servers
   being the ranks themselves), or applies the tables' optimizer to them in place (``group.Fused``).

So a forward runs two rounds (three when the blocks overflow), and with ``Lookahead`` only the rows round: the
next batch's ids blocks travel inside the step before's gradient rows round (``send_ahead``, ``Route.rider``),
and the forward takes them read (``settle``).
torchrec's names (input dist, lookup, output dist) describe a push of ids and a pull of pooled values; here the
owner pools nothing (the requester does, so the pooled values are torch's bit for bit) and the stages are named
for what travels. The driver (``Exchanger``) calls each stage's module once, in that order; a stage calls the
primitives it runs on (``kernels``: the C kernels, and ``Link`` once per round it runs) and never the driver or
an earlier stage (``tests/sharding/test_stage_order.py``).

Bytes per rank and step (``sparsync.plan.kinds.ShardedKind``): f·Σ_t u_t·(8 + 2·w·D_t) requested (keys out, rows
in, gradient rows out; f = (P-1)/P of the keys go to another rank, u_t distinct ids of table t, w bytes per
value), plus as much served; the headers add 32·(P-1) bytes each way, the group counts 8·G·(P-1), and the blocks'
padding the capacity less the count per peer.

Every rank must resolve its lookups at the same points and run backward through every exchange (a rank whose
loss does not depend on them would leave the others waiting).

The stand-ins (``LazyLookup``). Why: all sharded tables of a model travel in one exchange, but a model calls its
tables one by one (``[emb(x[:, i]) for i, emb in enumerate(self.tables)]``), so the first table cannot know the
others' ids when it is called. Each call therefore only registers its ids and returns a ``LazyLookup``; the first
time any of them is *used* (by any torch function, operator or tensor attribute: ``torch.cat(outs)``,
``out @ w``, ``out.shape``), the exchanger runs one exchange for every lookup registered so far and each stand-in
becomes its tensor. torchrec's ``LazyAwaitable`` does the same for the same reason (its pooled embeddings are
awaited by ``__torch_function__``). ``sparsync.shard`` also resolves every lookup when the model's forward
returns (``Exchanger.finish_forward``), so ``model(x)`` hands back plain tensors, and a stand-in never outlives
the forward that made it.

What a stand-in is not: a ``torch.Tensor`` (``isinstance`` says False). Code inside the model that needs one
calls ``wait()``, which also ends the batching at that point (later lookups go in a second exchange).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from sparsync.collectives.traffic import Traffic
from sparsync.record import CommLog
from sparsync.sharding import ids as ids_stage
from sparsync.sharding.group import Slot, TableGroup
from sparsync.sharding.kernels import Link, Rider
from sparsync.sharding.rows import Call, Route, lookup

# why torch.compile leaves a sharded lookup out of its graph: ``fullgraph=True`` raises with this reason
EAGER = (
    "sparsync.shard: a sharded lookup runs its exchange (all-to-alls between the ranks) eagerly, outside the "
    "compiled graph"
)


class LazyLookup:
    """The output of one sharded lookup, computed at the first use (module doc)."""

    def __init__(self, flush: Callable[[], None], what: str) -> None:
        self._flush = flush  # runs the exchange of every pending lookup, this one included
        self._what = what  # the table and module, for errors
        self._value: torch.Tensor | None = None
        self._error: BaseException | None = None

    @torch.compiler.disable(reason=EAGER)  # type: ignore[no-untyped-call, untyped-decorator]
    def wait(self) -> torch.Tensor:
        """The looked-up tensor, running the pending exchange first if it has not run. Collective the first
        time (the exchange): every rank resolves its lookups at the same point of the same model."""
        if self._value is None and self._error is None:
            self._flush()
        if self._error is not None:
            raise ValueError(f"the lookup of {self._what} failed: {self._error}") from self._error
        if self._value is None:
            raise RuntimeError(f"the exchange ran without resolving the lookup of {self._what}")
        return self._value

    def resolve(self, value: torch.Tensor) -> None:
        self._value = value

    def fail(self, error: BaseException) -> None:
        self._error = error

    @property
    def done(self) -> bool:
        return self._value is not None or self._error is not None

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        args, kwargs = pytree.tree_map_only(LazyLookup, LazyLookup.wait, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # our own slots before __init__ set them (copy, pickle): never the tensor's
            raise AttributeError(name)
        return getattr(self.wait(), name)

    def __repr__(self) -> str:
        state = "resolved" if self._value is not None else "failed" if self._error is not None else "pending"
        return f"LazyLookup({self._what}, {state})"

    def __len__(self) -> int:
        return len(self.wait())

    def __iter__(self) -> Any:
        return iter(self.wait())

    def __bool__(self) -> bool:
        return bool(self.wait())

    def __float__(self) -> float:
        return float(self.wait())


def resolve_all(tree: Any) -> Any:
    """``tree`` (a model's output: a tensor, or tuples, lists and dicts of them) with every ``LazyLookup``
    replaced by its tensor."""
    return pytree.tree_map_only(LazyLookup, LazyLookup.wait, tree)


def _binary(name: str) -> Callable[[LazyLookup, Any], Any]:
    def op(self: LazyLookup, other: Any) -> Any:
        return getattr(self.wait(), name)(other.wait() if isinstance(other, LazyLookup) else other)

    op.__name__ = name
    return op


def _unary(name: str) -> Callable[[LazyLookup], Any]:
    def op(self: LazyLookup) -> Any:
        return getattr(self.wait(), name)()

    op.__name__ = name
    return op


# Python looks operators up on the type, never through __getattr__: each is forwarded to the tensor.
for _name in (
    "add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "rfloordiv", "mod", "rmod",
    "pow", "rpow", "matmul", "rmatmul", "and", "rand", "or", "ror", "xor", "rxor", "eq", "ne", "lt", "le", "gt",
    "ge", "getitem",
):  # fmt: skip
    setattr(LazyLookup, f"__{_name}__", _binary(f"__{_name}__"))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(LazyLookup, f"__{_name}__", _unary(f"__{_name}__"))


@dataclass(frozen=True)
class Sent:
    """The keys of one exchange, per group and table: the layout the ids stage sent them in."""

    order: tuple[int, ...]  # the groups, in the exchanger's order
    tables: tuple[tuple[int, ...], ...]  # per group, its tables (slot indices) in the order their keys went
    keys: tuple[tuple[torch.Tensor, ...], ...]  # per group, per table: the keys of all its calls, in call order
    names: tuple[tuple[str, ...], ...]  # per group, per table: its description
    joined: tuple[torch.Tensor, ...]  # per group, its tables' keys one after another
    raw: tuple[torch.Tensor, ...] = ()  # per group, its calls' ids one after another, no base (``_same_ids``)

    def descriptions(self) -> list[str]:
        return [n for names in self.names for n in names]


@dataclass(frozen=True)
class Ahead:
    """What a table will be called with on a batch not yet seen (``Lookahead``): all its calls' ids."""

    group: int
    slot: Slot
    table: str
    keys: torch.Tensor  # flat int64 ids, as ``Call.keys`` (the layout adds the table's base)


@dataclass(frozen=True)
class Ready:
    """An ids stage run ahead (``Exchanger.settle``): the forward's exchange then runs only its rows round."""

    sent: Sent
    ids: ids_stage.Ids


class Offsets:
    """The verdict on a bag call's ``offsets`` (``verdict``), kept for the last tensor checked while it lives
    unchanged: a model that passes one offsets tensor to every table (DLRM) has it checked once a step."""

    def __init__(self) -> None:
        self._last: tuple[weakref.ref[torch.Tensor], int, int, bool, tuple[str | None, bool]] | None = None

    def verdict(self, offsets: object, n: int, last: bool) -> tuple[str | None, bool]:
        """(what torch's ``embedding_bag`` would refuse of ``offsets`` for a 1-D input of ``n`` ids, or None;
        whether every bag holds one id)."""
        if isinstance(offsets, torch.Tensor) and self._last is not None:
            ref, version, m, was_last, kept = self._last
            if ref() is offsets and offsets._version == version and (m, was_last) == (n, last):
                return kept
        out = _offsets_verdict(offsets, n, last)
        if isinstance(offsets, torch.Tensor):
            self._last = (weakref.ref(offsets), offsets._version, n, last, out)
        return out


class Bases:
    """Each id's table base in its group (``Exchanger._joined`` adds it to all of a group's ids in one op), kept
    per group for the last calls' tables and sizes while they repeat (a model that looks its tables up with
    batches of one size)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[tuple[tuple[int, int], ...], torch.Tensor]] = {}

    def of(self, group: int, sizes: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """(base, ids) per call of ``group``, in order, as the base of each id, int64."""
        kept = self._last.get(group)
        if kept is not None and kept[0] == sizes:
            return kept[1]
        bases = torch.tensor([b for b, _ in sizes], dtype=torch.int64)
        out = torch.repeat_interleave(bases, torch.tensor([n for _, n in sizes], dtype=torch.int64))
        self._last[group] = (sizes, out)
        return out


class Bounds:
    """Per group, the first key and the key past the last of each table looked up (``out_of_range``), int64,
    kept for the last tables looked up while they repeat."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = {}

    def of(self, index: int, group: TableGroup, tables: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(first keys, keys past the last) of ``tables`` (slot indices) of ``group``, the exchanger's
        ``index``-th."""
        kept = self._last.get(index)
        if kept is None or kept[0] != tables:
            slots = [group.slots[t] for t in tables]
            first = torch.tensor([s.base for s in slots], dtype=torch.int64)
            kept = (tables, first, first + torch.tensor([s.rows for s in slots], dtype=torch.int64))
            self._last[index] = kept
        return kept[1], kept[2]


def _offsets_verdict(offsets: object, n: int, last: bool) -> tuple[str | None, bool]:
    if (
        not isinstance(offsets, torch.Tensor)
        or offsets.dim() != 1
        or offsets.dtype not in (torch.int64, torch.int32)
    ):
        what = (
            f"a {offsets.dim()}-D {offsets.dtype} tensor" if isinstance(offsets, torch.Tensor) else type(offsets)
        )
        return f"offsets has to be a 1D tensor of int64 or int32, got {what}", False
    if last and offsets.numel() < 1:
        return "include_last_offset: number of offset should be at least 1", False
    if not offsets.numel():
        return None, n == 0
    step = offsets.diff()
    first, end, decreasing, ones = torch.stack(
        [offsets[0], offsets[-1], (step < 0).any().long(), (step == 1).all().long()]
    ).tolist()
    if first != 0:
        return f"offsets[0] has to be 0, got {first}", False
    if end > n:
        return f"offsets[-1] can not be greater than input's length {n}, got {end}", False
    if decreasing:
        return "offsets must not decrease", False
    bags = offsets.numel() - (1 if last else 0)
    return None, bool(ones) and bags == n and (not last or end == n)


class Exchanger:
    """The sharded tables of one ``sparsync.shard`` call: their groups, the calls pending, the agreed capacity of
    the next ids round, and the ids stage run ahead (module doc). ``link``: the rounds' transport
    (``kernels.Link``)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.groups: list[TableGroup] = []
        self.pending: list[tuple[Call, LazyLookup]] = []  # the calls registered since the last exchange
        self.capacity = 0  # keys per block of the next ids round (``ids``), the same on every rank
        self.ready: Ready | None = None
        self.rider: Rider | None = None  # the ids looked ahead (``send_ahead``), until a round sends them
        self._keys: dict[tuple[str, ...], int] = {}  # the header's key of each list of tables seen
        self.offsets = Offsets()
        self.bases = Bases()
        self.bounds = Bounds()

    @property
    def rank(self) -> int:
        return self.link.rank

    @property
    def size(self) -> int:
        return self.link.size

    @property
    def group(self) -> dist.ProcessGroup:
        return self.link.group

    @classmethod
    def on(
        cls, group: dist.ProcessGroup, log: CommLog | None = None, wire: torch.dtype | None = None
    ) -> Exchanger:
        return cls(Link(group, log, wire))

    def register(self, call: Call) -> LazyLookup:
        """Queue one call; its output: the call's stand-in (module doc)."""
        out = LazyLookup(self.flush, call.table)
        self.pending.append((call, out))
        return out

    def finish_forward(self, module: torch.nn.Module, args: object, output: object) -> object:
        """A model's forward hook: run what is pending, and return the output with every stand-in resolved."""
        del module, args
        self.flush()
        return resolve_all(output)

    def flush(self) -> None:
        """One exchange of every pending call; each stand-in gets its tensor (or, when the exchange failed, its
        error). Collective over the group."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        try:
            self._exchange(pending)
        except BaseException as e:
            for _, out in pending:
                if not out.done:
                    out.fail(e)
            raise

    # --- the ids stage run ahead (``Lookahead``) ----------------------------------------------------------------
    def send_ahead(self, calls: Sequence[Ahead], refusal: str | None) -> tuple[Sent, ids_stage.IdsRound]:
        """Prepare the ids stage of a batch the model has not seen yet (``ids.prepare``), its blocks left for the
        next gradient rows round of a forward whose exchange agreed to carry them (``self.rider``; ``_rider``):
        ``calls`` stand for what each table will be called with (all its calls' ids, in call order);
        ``refusal`` travels in the header, and every rank raises it at ``settle``. Not collective: the round
        that sends the blocks is."""
        sent = self._layout(calls)
        refusal = refusal or self._aliased(sent) or out_of_range(sent, self.groups, self.bounds)
        flight = ids_stage.prepare(self.link, self._request(sent, refusal), Traffic())
        self.rider = flight.rider
        return sent, flight

    def settle(self, sent: Sent, flight: ids_stage.IdsRound) -> None:
        """Read ``flight``, sent in a gradient rows round or else now in a round of its own (``ids.launch``): the
        next exchange then runs only its rows round. Collective."""
        if self.rider is flight.rider:
            self.rider = None
        done = ids_stage.finish(self.link, ids_stage.launch(self.link, flight, wait=False))
        self.capacity = done.capacity
        self.ready = Ready(sent, done)

    # --- the stages ---------------------------------------------------------------------------------------------
    def _exchange(self, pending: list[tuple[Call, LazyLookup]]) -> None:
        t0 = time.perf_counter()
        calls = [c for c, _ in pending]
        by_call = {id(c): out for c, out in pending}
        ready, self.ready = self.ready, None
        sent, refusal = self._checked(calls, None if ready is None else ready.sent)
        if ready is None:
            self.agreed(sent, refusal)
            tally = Traffic()
            done = ids_stage.run(self.link, self._request(sent, refusal), tally)
            self.capacity = done.capacity
            status = None
        else:
            done, tally, sent = ready.ids, ready.ids.tally, ready.sent
            status = ids_stage.OK if refusal is None else ids_stage.REFUSED
        groups = tuple(self.groups[g] for g in sent.order)
        inputs = tuple((k, groups[k].slots[t]) for k, tables in enumerate(sent.tables) for t in tables)
        params = [groups[k].params[slot.index] for k, slot in inputs]
        route = Route(done, groups, inputs, status, refusal, self._rider(status, params))
        # refused: the rows round raises on every rank before any pooling (and the calls may not match ``sent``)
        pooling = _pooling(calls, sent, done) if refusal is None else [([], torch.empty(0), {})] * len(groups)
        gathered, outputs = lookup(route, self.link, tally, params, pooling)
        for (mine, _, _), outs in zip(pooling, outputs, strict=True):
            for c, value in zip(mine, outs, strict=True):
                by_call[id(c)].resolve(value)
        if self.link.log is not None:
            self.link.record("shard_lookup", tally, t0, nnz_in=sum(a.distinct.numel() for a in done.asked),
                             nnz_out=sum(int(g.shape[0]) for g in gathered))  # fmt: skip

    def _checked(self, calls: Sequence[Call], ahead: Sent | None) -> tuple[Sent, str | None]:
        """The calls' layout (``ahead`` itself when their ids went ahead) and why this rank refuses them, or None:
        a call's own refusal, ids modified since the call, a replaced table parameter, an id out of its table's
        range, or, with ``ahead``, calls that differ from those whose ids went ahead (``_differs``). Calls that
        are one per table of ``ahead``, in the order their ids went, with equal ids (``_same_ids``: one cat and
        one ``torch.equal`` per group) passed the range check ahead and need no layout of their own."""
        refusal = next((c.refusal for c in calls if c.refusal is not None), None) or _mutated(calls)
        if ahead is not None and refusal is None and _same_ids(calls, ahead):
            return ahead, self._aliased(ahead)
        sent = self._layout(calls)
        refusal = refusal or self._aliased(sent) or out_of_range(sent, self.groups, self.bounds)
        if ahead is not None:
            refusal = refusal or _differs(sent, ahead)
        return sent, refusal

    def _rider(self, status: int | None, params: Sequence[torch.Tensor]) -> Rider | None:
        """The ids looked ahead, for this exchange's gradient rows round to carry, when it has a backward and a
        verdict word to say so in (``status``: a looked-ahead exchange; ``rows.with_verdicts`` checks that every
        rank says the same); else None."""
        rider = self.rider
        if status is None or rider is None or rider.taken or not torch.is_grad_enabled():
            return None
        return rider if any(p.requires_grad for p in params) else None

    def _layout(self, calls: Sequence[Call | Ahead]) -> Sent:
        """The calls' keys per group (in the exchanger's order) and table (in first-call order)."""
        per: dict[int, dict[int, list[Call | Ahead]]] = {}
        for c in calls:
            per.setdefault(c.group, {}).setdefault(c.slot.index, []).append(c)
        order = tuple(sorted(per))
        laid = [self._joined(g, per[g]) for g in order]
        return Sent(
            order,
            tuple(tuple(per[g]) for g in order),
            tuple(keys for keys, _, _ in laid),
            tuple(tuple(per[g][t][0].table for t in per[g]) for g in order),
            tuple(joined for _, joined, _ in laid),
            tuple(raw for _, _, raw in laid),
        )

    def _joined(
        self, group: int, tables: dict[int, list[Call | Ahead]]
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """Group ``group``'s keys, its calls' ids plus their tables' bases: per table (its calls' in call order,
        views of the whole) and all of them, table after table: one cat of the ids, one add of the bases; and the
        ids as they were, table after table (a copy: never a view of a call's input)."""
        calls = [c for cs in tables.values() for c in cs]
        sizes = tuple((c.slot.base, int(c.keys.numel())) for c in calls)
        ids = torch.cat([c.keys for c in calls]) if len(calls) > 1 else calls[0].keys.clone()
        first = sizes[0][0]
        if all(base == first for base, _ in sizes):
            joined = ids + first if first else ids
        else:
            joined = ids + self.bases.of(group, sizes)
        if len(tables) == 1:
            return (joined,), joined, ids
        if len(calls) == len(tables):  # one call per table
            per_table = [n for _, n in sizes]
        else:
            per_table = [sum(int(c.keys.numel()) for c in cs) for cs in tables.values()]
        return tuple(torch.split(joined, per_table)), joined, ids

    def _request(self, sent: Sent, refusal: str | None) -> ids_stage.Request:
        return ids_stage.Request(sent.joined, self._key(sent), sent.descriptions(), refusal, self.capacity)

    def _key(self, sent: Sent) -> int:
        names = tuple(sent.descriptions())
        if names not in self._keys:
            self._keys[names] = ids_stage.tables_key(names)
        return self._keys[names]

    def agreed(self, sent: Sent, refusal: str | None) -> None:
        """Nothing: the ids round carries each rank's verdict on its calls (``ids.agree``). An exchanger whose
        rows are all local runs no ids round, and agrees here instead (``replicated``)."""
        del sent, refusal

    def _aliased(self, sent: Sent) -> str | None:
        return next((r for g in sent.order if (r := self.groups[g].aliased()) is not None), None)


def out_of_range(sent: Sent, groups: Sequence[TableGroup], bounds: Bounds | None = None) -> str | None:
    """Why a call's ids do not lie in its table (a negative id, or one past its rows), for the first such table,
    or None: per group each table's least and greatest key against its bounds (``bounds``: the exchanger's, kept
    from the last exchange), in one ``aminmax`` when the tables' keys are as many (a model that looks each table
    up once a sample), and one host sync."""
    for k, g in enumerate(sent.order):
        keys = sent.joined[k]
        if not keys.numel():
            continue
        slots = [groups[g].slots[t] for t in sent.tables[k]]
        parts = sent.keys[k]
        n = int(parts[0].numel())
        if all(int(x.numel()) == n for x in parts):
            low, high, looked = *torch.aminmax(keys.view(len(parts), n), dim=1), sent.tables[k]
        else:
            low, high = torch.stack([torch.stack(torch.aminmax(x)) for x in parts if x.numel()]).unbind(1)
            looked = tuple(t for t, x in zip(sent.tables[k], parts, strict=True) if x.numel())
        first, end = (bounds or Bounds()).of(g, groups[g], looked)
        if bool(((low < first) | (high >= end)).any()):
            for slot, x, name in zip(slots, parts, sent.names[k], strict=True):
                if x.numel() and (why := _range_words(x - slot.base, slot.rows)) is not None:
                    return f"{name}: {why}"
    return None


def _mutated(calls: Sequence[Call]) -> str | None:
    """Why a call's ids are not the ones it was called with (modified in place since), for the first such call,
    or None."""
    for c in calls:
        if c.keys._version != c.version:
            return (
                f"{c.table}: its ids were modified in place after the call, before its lookup ran (the exchange "
                "reads every pending call's ids when a lookup is first used); pass ids left as they are, or a copy"
            )
    return None


def _range_words(ids: torch.Tensor, rows: int) -> str | None:
    low, high = torch.stack(torch.aminmax(ids)).tolist()
    if low < 0:
        return f"id {low} is negative; ids must lie in [0, {rows})"
    if high >= rows:
        return f"id {high} is out of range; ids must lie in [0, {rows})"
    return None


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _same_ids(calls: Sequence[Call], ahead: Sent) -> bool:
    """Whether ``calls`` are one call per table of ``ahead``, group by group in the order its tables' ids went,
    with the ids that went (``Sent.raw``: compared by value, one ``torch.equal`` per group)."""
    if len(ahead.raw) != len(ahead.order) or len(calls) != sum(len(t) for t in ahead.tables):
        return False
    by_group = sorted(calls, key=lambda c: c.group)  # stable: each group's calls in call order
    at = 0
    for k, (g, tables) in enumerate(zip(ahead.order, ahead.tables, strict=True)):
        mine, at = by_group[at : at + len(tables)], at + len(tables)
        if any(c.group != g or c.slot.index != t for c, t in zip(mine, tables, strict=True)):
            return False
        if not torch.equal(_cat([c.keys for c in mine]), ahead.raw[k]):
            return False
    return True


def _differs(calls: Sent, sent: Sent) -> str | None:
    """Why the forward's calls are not the ones whose ids went ahead, or None when they are."""
    hint = (
        "; the lookahead's ids function must give, per sharded table, the ids the model's forward looks it up "
        "with on that batch (all its calls', in call order), and the forward must look them up in one exchange"
    )
    looked = {
        n: k for names, keys in zip(calls.names, calls.keys, strict=True) for n, k in zip(names, keys, strict=True)
    }
    went = {
        n: k for names, keys in zip(sent.names, sent.keys, strict=True) for n, k in zip(names, keys, strict=True)
    }
    if set(looked) != set(went):
        called, ahead = sorted(looked), sorted(went)
        return f"the forward looked up the tables {called}, but the lookahead sent ids for {ahead}{hint}"
    for name, keys in looked.items():
        if not torch.equal(keys, went[name]):
            return (
                f"the forward looked up {keys.numel()} ids of {name}, not the {went[name].numel()} the lookahead "
                f"sent for this batch{hint}"
            )
    return None


def _pooling(
    calls: Sequence[Call], sent: Sent, done: ids_stage.Ids
) -> list[tuple[list[Call], torch.Tensor, dict[int, int]]]:
    """Per group of ``sent``: its calls (in call order), their keys' positions among the gathered rows, and the
    padding rows (``rows.lookup``'s ``pooling``)."""
    out = []
    for k, g in enumerate(sent.order):
        mine = [c for c in calls if c.group == g]
        positions = _call_positions(done.asked[k].positions, sent, k, mine)
        out.append((mine, positions, _padding_at(done.asked[k].distinct, mine)))
    return out


def _call_positions(positions: torch.Tensor, sent: Sent, k: int, calls: Sequence[Call]) -> torch.Tensor:
    """Group ``k``'s positions (in ``sent``'s layout: table after table) reordered into ``calls``' order."""
    tables = sent.tables[k]
    if len(tables) == 1 or [c.slot.index for c in calls] == list(tables):
        return positions
    by_table = dict(zip(tables, torch.split(positions, [int(x.numel()) for x in sent.keys[k]]), strict=True))
    at = dict.fromkeys(tables, 0)
    out = []
    for c in calls:
        n = c.keys.numel()
        out.append(by_table[c.slot.index][at[c.slot.index] : at[c.slot.index] + n])
        at[c.slot.index] += n
    return torch.cat(out)


def _padding_at(distinct: torch.Tensor, calls: Sequence[Call]) -> dict[int, int]:
    """Padding key -> its row among the gathered rows, for the calls' padding keys this rank looked up."""
    out = {}
    for key in {c.padding for c in calls if c.padding is not None}:
        hit = torch.nonzero(distinct == key)
        if hit.numel():
            out[key] = int(hit[0, 0])
    return out
