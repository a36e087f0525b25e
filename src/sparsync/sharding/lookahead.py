"""``Lookahead``: a data iterator over which a sharded model's ids round runs one batch ahead (the issue's
"exact lookahead"; torchrec's ``TrainPipelineSparseDist`` moves its input dist ahead the same way).

    from sparsync.sharding import Lookahead

    batches = Lookahead(loader, model, ids=lambda b: {"tables.0": b.cats[:, 0], ...})
    for b in batches:                     # yields loader's batches, unchanged
        loss = loss_fn(model(b.dense, b.cats), b.label) ...

When it hands out batch i it has already read batch i + 1 from ``loader`` and started that batch's ids stage in
the background (``Exchanger.send_ahead``: each distinct id to its owner, the header in front), so the round runs
while step i computes. The forward of batch i + 1 then runs only the rows round, which reads the owners' rows
as they are after step i's update: the values are those of the run without lookahead, bit for bit, and no row
needs refreshing.

The choice, where the issue is open: it asks for batch i + 1's rows to be pulled early too, and the rows step i
updated to be refreshed after. Under Zipf skew every table's hot rows are updated every step, so that refresh
is a round after step i's update and before batch i + 1's forward in any case: pulling early would save bytes
but no round. Moving only the ids round keeps one exposed round per forward (rows), against two without
lookahead, with nothing to refresh.

``ids(batch)`` gives, per sharded table (its module name in the model), the ids the model's forward will look
it up with on that batch: all its calls' ids, in call order (for ``nn.EmbeddingBag(input, offsets)``, the
input). They are checked as the forward checks them (range, dtype), and a bad one makes every rank raise the
same ValueError at the next ``next()``. A forward whose lookups differ from what went ahead (other ids, other
tables, or its tables in two exchanges) makes every rank raise the same ValueError, after the rows round.

Collective: every rank iterates in step, over as many batches; a rank that stops early leaves the others'
background round waiting until the group's timeout, which names the missing rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from torch import nn

from sparsync.sharding.exchange import Ahead, Exchanger, Sent
from sparsync.sharding.ids import IdsRound
from sparsync.sharding.modules import ShardedTable

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
        """The next batch, its ids round finished (collective); the following batch's round started."""
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
