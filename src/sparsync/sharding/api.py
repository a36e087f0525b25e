"""``sparsync.shard(model, plan=...)``: swap a model's embedding tables for sharded ones, in place, every rank at
once, or mark them for the parameter server; ``plan_of(model)``: the placement of each parameter the plan
placed, for ``DistributedOptimizer(plan=...)`` or ``HybridTrainer``.

    model = sparsync.shard(model)                              # every Embedding / EmbeddingBag sharded
    opt = sparsync.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model,
                                        plan=plan_of(model), sync_parameters=False)

    model = sparsync.shard(model, plan={"users": "server", "items": "sharded", "tags": "replicated"})
    trainer = HybridTrainer(model, addresses, cfg, dense_optimizer=...)   # reads the plan off the model

A table placed ``"server"`` stays the model's own ``nn.Embedding`` / ``nn.EmbeddingBag``; its weight is marked
``OnServer`` (``placement.server``), and ``HybridTrainer`` keeps its rows on the servers (pulled before the
forward, pushed after backward); ``DistributedOptimizer`` refuses such a model, as nothing else runs the servers.

How the tables of one model travel together: one ``Exchanger`` per call, shared by the model's sharded tables;
a table's forward registers its ids and returns a stand-in (``exchange.LazyLookup``), the first use of any
stand-in runs one exchange for all tables registered so far, and a forward hook on the model resolves what is
left when its forward returns. Tables a model calls one after another before using their outputs (DLRM's
``[emb(x) for emb in tables]``, then an interaction) therefore share one exchange, and ``model(x)`` is
unchanged for its caller. The alternative, a collection module that looks every table up at once (torchrec's
``EmbeddingBagCollection``), would have asked the user to rewrite the model's forward.

``Lookahead``: a data iterator over which a sharded model's ids round runs one batch ahead (torchrec's
``TrainPipelineSparseDist`` moves its input dist ahead the same way).

    from sparsync.sharding import Lookahead

    batches = Lookahead(loader, model, ids=lambda b: {"tables.0": b.cats[:, 0], ...})
    for b in batches:                     # yields loader's batches, unchanged
        loss = loss_fn(model(b.dense, b.cats), b.label) ...

When it hands out batch i it has already read batch i + 1 and prepared that batch's ids round
(``Exchanger.send_ahead``: each distinct id to its owner, the header in front), without starting it: its blocks
go to their owners inside step i's gradient rows round (``kernels.Link.carry``), which goes the same way
(requester to owner), one ``all_to_all_single`` whose block to each peer holds both. The forward of batch
i + 1 then runs only the rows round, which reads the owners' rows as they are after step i's update: the values
are those of the run without lookahead, bit for bit, and no row needs refreshing. A training step thus runs two
rounds of the tables (rows, gradient rows) where it would run three.

Whether a step's gradient rows round carries the ids is agreed in its forward: the rows round's blocks open with
each rank's verdict word, which says so too (``rows.with_verdicts``), and ranks that disagree (a forward under
``torch.no_grad`` on some ranks only) all raise the same ValueError there, before any round's lengths could
differ. When no gradient rows round took them before the next ``next()`` (a forward under ``torch.no_grad``, a
forward without backward), that ``next()`` sends them in a round of their own, as an ids round without
lookahead.

Why only the ids: pulling batch i + 1's rows early too would need the rows step i updates refreshed after it.
Under Zipf skew every table's hot rows are updated every step, so that refresh is a round after step i's update
and before batch i + 1's forward in any case: pulling early would save bytes but no round. Moving only the ids
keeps one round per forward (rows), against two without lookahead, with nothing to refresh; and the ids, known
a step early, need no round of their own.

``ids(batch)`` gives, per sharded table (its module name in the model), the ids the model's forward will look
it up with on that batch: all its calls' ids, in call order (for ``nn.EmbeddingBag(input, offsets)``, the
input). They are checked as the forward checks them (range, dtype), and a bad one makes every rank raise the
same ValueError at the next ``next()``. A forward whose lookups differ from what went ahead (other ids, other
tables, or its tables in two exchanges) makes every rank raise the same ValueError, after the rows round. A
forward that calls each table once, in the order ``ids(batch)`` named them, with those ids (compared by value,
one ``torch.equal`` per group: ``exchange.Exchanger._checked``), is not laid out or range-checked again.

Collective: every rank iterates in step, over as many batches, and runs the same forwards and backwards; a rank
that stops early leaves the others waiting in their next round until the group's timeout, which names the
missing rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch.distributed as dist
from torch import nn

from sparsync.collectives.group import resolve_group
from sparsync.collectives.transport import meta_group
from sparsync.placement import OnServer, Sharded, mark_updated_in_backward
from sparsync.placement.sharded import mark
from sparsync.record import CommLog
from sparsync.sharding.auto import auto_plan
from sparsync.sharding.ddp import leave_to_sparsync
from sparsync.sharding.exchange import Ahead, Exchanger, Sent
from sparsync.sharding.group import OPTIMIZERS, Fused, Slot, TableGroup, group_key
from sparsync.sharding.ids import IdsRound
from sparsync.sharding.kernels import WIRE
from sparsync.sharding.modules import GroupedTable, ShardedEmbedding, ShardedEmbeddingBag, ShardedTable
from sparsync.sharding.replicated import (
    ReplicatedEmbedding,
    ReplicatedEmbeddingBag,
    ReplicatedExchanger,
    broadcast,
    sum_over,
)

BUILT = ("sharded", "replicated", "server")  # what a dict plan may name for a table


def shard(
    model: nn.Module,
    plan: Mapping[str, str] | str | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    log: CommLog | None = None,
    state_dict: str = "full",
    sample: Sequence[Any] | None = None,
    rows: str | None = None,
    seed: int = 0,
    optimizer: Fused | None = None,
) -> nn.Module:
    """Swap the embedding modules of ``model`` for sharded ones, per ``plan``, and return the model (the new
    module when ``model`` is itself an embedding).

    ``plan``: module name -> ``"sharded"``, ``"replicated"`` (left as it is: ``DistributedOptimizer``'s default
    path, or ``HybridTrainer``'s collective one, reduces it; with ``optimizer``, grouped whole on every rank and
    updated in backward, ``replicated``) or ``"server"`` (left as it is, its weight marked
    ``OnServer``: ``HybridTrainer`` keeps its rows on the parameter server; module doc); modules it does not name
    are sharded; None shards every ``nn.Embedding`` and ``nn.EmbeddingBag``; ``"auto"`` places each table where
    the cost model predicts the faster step, from one forward of ``model(*sample)`` on every rank and the
    group's link (``auto``; ``auto_plan`` gives what it measured and chose; it never chooses ``"server"``,
    which needs servers started beside the ranks: name it in a dict). ``group``: the ranks that own the rows
    (default: the world). ``log``: a ``CommLog`` that receives a record per exchange and direction.
    ``state_dict``: ``"full"`` (each table whole, on rank 0), ``"local"`` (each rank its rows) or ``"sharded"``
    (DTensors of contiguous row blocks, for ``torch.distributed.checkpoint``: ``dcp``; ``sharding.modules``).
    ``rows``: ``"fp16"`` or ``"bf16"`` sends the rows and the gradient rows in that
    precision, half of fp32's bytes, each value rounded once on the way (lossy: the tables, the pooling and the
    owners' sums stay in the tables' dtype); None sends them as they are. ``optimizer``: one of ``group``'s
    optimizers (``SGD``, ``Adagrad``, ``RowwiseAdagrad``, ``Adam``), applied to the sharded tables' rows, and to
    the replicated tables' (grouped: ``replicated``), at the end of backward, in place, with the mean of the
    ranks' gradients; the tables then get no ``.grad``: give the
    rest of the model's optimizer ``dense_parameters(model)``; ``DistributedDataParallel`` over the returned
    model leaves them alone (``sharding.ddp``). None: the tables get a sparse gradient, the sum over
    the ranks, for any torch optimizer that takes sparse gradients (``DistributedOptimizer`` divides it by P).

    Every shard starts from group rank 0's table, so training starts where the replicated path would; a table
    on the meta device (``device="meta"``: too large for one rank) is never built whole: each rank draws its own
    rows from ``seed`` (``group.init_rows``: N(0, 1), the same table at any P; ``plan="auto"`` shards it,
    its ids counted by a stand-in). Collective over ``group``: every rank calls it on the same model; ranks
    whose tables to shard or to put on the server differ all raise the same ValueError. Raises ValueError for
    ``plan="server"`` (a string: name the tables in a dict), ``"auto"`` without ``sample``, a table on the meta
    device placed ``"server"``, or a module option the sharded modules cannot honour (``mode="max"``,
    ``max_norm``, ``scale_grad_by_freq``, a subclass with its own forward, a weight tied to another module, a
    table off the CPU), naming the module; KeyError for a plan that names no embedding module of the model.
    Mutates ``model`` (its embedding modules are replaced, the server tables' weights marked, with ``optimizer``
    the tables named in DDP's list of parameters to leave alone)."""
    g = resolve_group(group)
    if rows is not None and rows not in WIRE:
        raise ValueError(f"rows={rows!r}: the rows travel as they are (None) or in one of {sorted(WIRE)}")
    chosen, whole = _placed(model, _plan_dict(model, plan, sample, g, fused=optimizer is not None), g,
                            grouped=optimizer is not None)  # fmt: skip
    exchanger = Exchanger.on(g, log, None if rows is None else WIRE[rows])
    swapped: dict[int, GroupedTable] = dict(_sharded_modules(exchanger, chosen, state_dict, seed))
    replicas = ReplicatedExchanger(g, log)
    swapped.update(_replicated_modules(replicas, whole, seed))
    for ex in (exchanger, replicas):
        _bind(ex, optimizer)
    return _swapped_in(model, swapped, exchanger, replicas)


def _swapped_in(
    model: nn.Module, swapped: Mapping[int, nn.Module], exchanger: Exchanger, replicas: ReplicatedExchanger
) -> nn.Module:
    """``model`` with ``swapped`` in place (``_swap``), its forward hooked to finish each exchange (the
    replicated groups' only when there are some), the tables updated in backward left out of DDP (``ddp``); the
    new root."""
    root = _swap(model, swapped)
    root.register_forward_hook(exchanger.finish_forward)
    if replicas.groups:
        root.register_forward_hook(replicas.finish_forward)
    leave_to_sparsync(root)
    return root


Tables = dict[str, nn.Embedding | nn.EmbeddingBag]


def _placed(model: nn.Module, names: dict[str, str], g: dist.ProcessGroup, grouped: bool) -> tuple[Tables, Tables]:
    """The tables ``names`` places ``"sharded"``, each checked, and, when ``grouped`` (a fused optimizer), those
    it places ``"replicated"`` that a grouped module can compute (``replicated``; the others stay as they are);
    the ``"server"`` ones checked and marked. The ranks' choices agree (else every rank raises). Collective over
    ``g``."""
    tables = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)}
    chosen = _chosen(tables, names, "sharded")
    for name in chosen:
        _check_shardable(model, name, tables[name])
    whole = [n for n in _chosen(tables, names, "replicated") if grouped and not _refusals(model, tables[n])]
    on_server = _chosen(tables, names, "server")
    for name in on_server:
        _check_for_server(name, tables[name])
    _agree(chosen, on_server, tables, g, whole)
    _mark_on_server([tables[n] for n in on_server])
    return {n: tables[n] for n in chosen}, {n: tables[n] for n in whole}


def _sharded_modules(
    exchanger: Exchanger, tables: Mapping[str, nn.Embedding | nn.EmbeddingBag], state_dict: str, seed: int
) -> dict[int, ShardedTable]:
    """The sharded module of each of ``tables`` (by the id of the module it replaces), in their groups."""
    placement = Sharded()  # one object: DistributedOptimizer keeps every shard in one group of its plan
    slots = _grouped(exchanger, list(tables.values()))
    swapped: dict[int, ShardedTable] = {}
    for (name, m), at in zip(tables.items(), slots, strict=True):
        kind = ShardedEmbeddingBag if isinstance(m, nn.EmbeddingBag) else ShardedEmbedding
        swapped[id(m)] = kind(name, m, exchanger, at, placement, state_dict, seed)
    return swapped


def _replicated_modules(
    replicas: ReplicatedExchanger, tables: Mapping[str, nn.Embedding | nn.EmbeddingBag], seed: int
) -> dict[int, GroupedTable]:
    """The grouped replicated module of each of ``tables`` (by the id of the module it replaces), in their groups
    (``replicated``): each group summed over the ranks in backward and started from rank 0's tables.
    Collective."""
    slots = _grouped(replicas, list(tables.values()))
    swapped: dict[int, GroupedTable] = {}
    for (name, m), at in zip(tables.items(), slots, strict=True):
        kind = ReplicatedEmbeddingBag if isinstance(m, nn.EmbeddingBag) else ReplicatedEmbedding
        swapped[id(m)] = kind(name, m, replicas, at, None, "full", seed)
    for i, group in enumerate(replicas.groups):
        group.ranks = dist.get_world_size(replicas.replicas)
        name = f"sparsync.shard: replicated group {i} (width {group.dim}, {group.dtype})"
        group.across = sum_over(replicas, group, name)
    broadcast(replicas.groups, replicas.replicas)
    return swapped


def _bind(exchanger: Exchanger, optimizer: Fused | None) -> None:
    """Give each of ``exchanger``'s groups its copy of ``optimizer`` (``group.Fused``); TypeError for anything
    else."""
    if optimizer is None:
        return
    if not isinstance(optimizer, Fused):
        names = [o.__name__ for o in OPTIMIZERS]
        raise TypeError(
            f"optimizer must be one of sparsync.sharding's {names}, got {type(optimizer).__name__} (for "
            "a torch optimizer over the tables' sparse gradients, leave optimizer None)"
        )
    for table_group in exchanger.groups:
        table_group.fused = optimizer.bind(table_group)
        for param in table_group.params:
            mark_updated_in_backward(param)  # HybridTrainer refuses to step them


def _grouped(exchanger: Exchanger, tables: Sequence[nn.Embedding | nn.EmbeddingBag]) -> list[tuple[int, Slot]]:
    """The tables' groups (``group``: one per width and dtype, in the order of their first table), made on
    ``exchanger``; each table's (group, slot), in ``tables``' order."""
    members: dict[tuple[int, str], list[int]] = {}
    for i, m in enumerate(tables):
        members.setdefault(group_key(int(m.embedding_dim), m.weight.dtype), []).append(i)
    at: dict[int, tuple[int, Slot]] = {}
    link = exchanger.link
    for gi, idx in enumerate(members.values()):
        first = tables[idx[0]]
        group = TableGroup([int(tables[i].num_embeddings) for i in idx], int(first.embedding_dim),
                           first.weight.dtype, link.size, link.rank)  # fmt: skip
        exchanger.groups.append(group)
        at.update({i: (gi, group.slots[t]) for t, i in enumerate(idx)})
    return [at[i] for i in range(len(tables))]


def _mark_on_server(tables: Sequence[nn.Module]) -> None:
    """Mark each table's weight ``OnServer``: one object for all, as the shards share one ``Sharded``."""
    server = OnServer()
    for m in tables:
        mark(m.weight, server)  # type: ignore[arg-type]


def _swap(model: nn.Module, swapped: Mapping[int, nn.Module]) -> nn.Module:
    """Put each module of ``swapped`` (by the id of the module it replaces) in every place ``model`` holds the
    old one, a module held twice included; the new root (``model``, unless it was swapped itself)."""
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in swapped:
                setattr(parent, child_name, swapped[id(child)])
    return swapped.get(id(model), model)


def _plan_dict(
    model: nn.Module,
    plan: Mapping[str, str] | str | None,
    sample: Sequence[Any] | None,
    group: dist.ProcessGroup,
    fused: bool = False,
) -> dict[str, str]:
    """``shard``'s ``plan`` as module name -> placement: ``"auto"`` measured and priced (collective; ``fused``:
    the sharded tables get an optimizer in backward), a dict as given; ValueError for any other string."""
    if plan == "auto":
        if sample is None:
            raise ValueError("plan='auto' measures the tables on a sample batch: pass sample=(args of model(...))")
        return auto_plan(model, sample, group, fused=fused).tables
    if isinstance(plan, str):
        if plan == "server":
            raise ValueError(
                "plan='server' would put every table on the parameter server, which HybridTrainer does without "
                "sparsync.shard (its default keeps every sparse embedding there); to place some tables there, "
                "pass a dict of module name -> one of "
                f"{BUILT}, e.g. {{'emb': 'server'}}"
            )
        raise ValueError(f"plan must be 'auto', a dict of module name -> one of {BUILT}, or None; got {plan!r}")
    return dict(plan or {})


def _chosen(tables: Mapping[str, nn.Module], plan: dict[str, str], kind: str) -> list[str]:
    """The tables ``plan`` places ``kind`` (``"sharded"``: those it does not name too), in the model's order.
    KeyError for a name that is no embedding module, ValueError for an unknown placement."""
    unknown = sorted(set(plan) - set(tables))
    if unknown:
        raise KeyError(
            f"plan names {unknown}, which are no nn.Embedding or nn.EmbeddingBag modules of the model; "
            f"its embedding modules: {sorted(tables)}"
        )
    for name, given in plan.items():
        if given not in BUILT:
            raise ValueError(f"plan[{name!r}] = {given!r}: unknown placement; choose one of {BUILT}")
    return [n for n in tables if plan.get(n, "sharded") == kind]


def _check_for_server(name: str, m: nn.Embedding | nn.EmbeddingBag) -> None:
    """ValueError naming the module when rank 0 could not write ``m``'s rows to the servers."""
    if m.weight.device.type == "meta":
        raise ValueError(
            f"sparsync.shard cannot place {name!r} on the server: its table is on the meta device, and "
            "HybridTrainer writes rank 0's table to the servers; build it on the CPU, or place it 'sharded' "
            "(each rank then draws its own rows)"
        )


def _check_shardable(model: nn.Module, name: str, m: nn.Embedding | nn.EmbeddingBag) -> None:
    """ValueError naming the module and option when a sharded module could not compute what ``m`` does."""
    refused = _refusals(model, m)
    if refused:
        raise ValueError(
            f"sparsync.shard cannot shard {name!r} ({type(m).__name__}): {'; '.join(refused)} not supported "
            "(sharded: sum and mean pooling, per_sample_weights, offsets, padding_idx, include_last_offset); "
            f"place it 'replicated' (plan={{{name!r}: 'replicated'}}) to keep it whole"
        )


def _refusals(model: nn.Module, m: nn.Embedding | nn.EmbeddingBag) -> list[str]:
    """The options of ``m`` a sharded (or grouped replicated) module cannot compute, in words."""
    refused = []
    if type(m) not in (nn.Embedding, nn.EmbeddingBag):
        refused.append(f"its class {type(m).__name__} (a subclass, whose forward sparsync cannot know)")
    if m.max_norm is not None:
        refused.append(f"max_norm={m.max_norm}")
    if m.scale_grad_by_freq:
        refused.append("scale_grad_by_freq=True")
    if isinstance(m, nn.EmbeddingBag) and m.mode not in ("sum", "mean"):
        refused.append(f"mode={m.mode!r}")
    if m.weight.device.type not in ("cpu", "meta"):
        refused.append(f"a table on {m.weight.device} (sharded tables live on the CPU for now)")
    holders = [
        n
        for n, mod in model.named_modules()
        if mod is not m and any(p is m.weight for p in mod.parameters(recurse=False))
    ]
    if holders:
        refused.append(f"its weight, tied to {holders}")
    return refused


def _agree(
    chosen: list[str],
    on_server: list[str],
    tables: Mapping[str, nn.Module],
    group: dist.ProcessGroup,
    whole: Sequence[str] = (),
) -> None:
    """Every rank shards the same tables, groups the same replicated ones (``whole``) and places the same ones
    on the server (names, classes, shapes, options): else the same ValueError on every rank, naming the first
    rank that differs from rank 0. Collective."""
    mine = [f"{n}: {tables[n]!r} {tables[n].weight.dtype}" for n in chosen]
    mine += [f"{n} (replicated): {tables[n]!r} {tables[n].weight.dtype}" for n in whole]
    mine += [f"{n} (server): {tables[n]!r} {tables[n].weight.dtype}" for n in on_server]
    everyone: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=meta_group(group))  # host objects: never on the payload group
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise ValueError(
                f"sparsync.shard: the ranks' models differ in the tables to shard: rank 0 has {everyone[0]}, "
                f"rank {rank} has {theirs}; every rank must build the same model and pass the same plan"
            )


B = TypeVar("B")


class Lookahead(Generic[B]):
    """Iterate ``batches`` with each batch's ids round run one batch ahead for ``model``'s sharded tables (module
    doc). ``ids(batch)``: sharded table name -> the ids the forward looks it up with on ``batch``."""

    def __init__(self, batches: Iterable[B], model: nn.Module, ids: Callable[[B], Mapping[str, Any]]) -> None:
        self._tables = {name: m for name, m in model.named_modules() if isinstance(m, ShardedTable)}
        if not self._tables:
            raise ValueError(
                f"Lookahead: {type(model).__name__} has no sharded tables (sparsync.shard placed none "
                "'sharded'), so there is no ids round to run ahead"
            )
        exchangers = {id(m.exchanger): m.exchanger for m in self._tables.values()}
        if len(exchangers) > 1:
            raise ValueError(
                "Lookahead: the model's sharded tables come from several sparsync.shard calls, each with its own "
                "exchange; shard the model once"
            )
        self._exchanger: Exchanger = next(iter(exchangers.values()))
        self._batches = iter(batches)
        self._ids = ids
        self._ahead: tuple[B, Sent, IdsRound] | None = None
        self._started = False

    def __iter__(self) -> Iterator[B]:
        return self

    def __next__(self) -> B:
        """The next batch, its ids read (sent in the last gradient rows round, or now in a round of their own);
        the following batch's ids prepared, to go in the next one. Collective."""
        if not self._started:
            self._started = True
            self._ahead = self._send(next(self._batches))
        if self._ahead is None:
            raise StopIteration
        batch, sent, flight = self._ahead
        self._ahead = None
        self._exchanger.settle(sent, flight)
        following = next(self._batches, _END)
        if following is not _END:
            self._ahead = self._send(following)  # type: ignore[arg-type]
        return batch

    def _send(self, batch: B) -> tuple[B, Sent, IdsRound]:
        given = dict(self._ids(batch))
        unknown = sorted(set(given) - set(self._tables))
        if unknown:
            raise KeyError(
                f"Lookahead: ids names {unknown}, which are no sharded tables of the model; its sharded tables: "
                f"{sorted(self._tables)}"
            )
        ahead, refusal = [], None
        for name, x in given.items():
            t = self._tables[name]
            keys, why = t.checked_ids(x)
            refusal = refusal or why
            ahead.append(Ahead(t.group_index, t.slot, t.describe(), keys))
        return (batch, *self._exchanger.send_ahead(ahead, refusal))


_END = object()
