"""Rows of named int64 columns that ranks exchange, and how the ranks must agree on each column: the one schema
of every metadata round (``meta.allgather_rows``) and of the sharded lookup's header rows (``sharding/ids.py``).

A ``Schema`` is a tuple of ``Column``s. Each column says how the ranks must agree on it (``Agree``) and how a
disagreement on it is described (its ``describe``, else its schema's ``mismatch``). ``Schema.check`` finds the
first column, in column order, on which some rank disagrees with rank 0 or reports a problem, and raises its
description: every rank sees the same table, so every rank raises the same error, instead of the good ranks
hanging on the bad one.

A metadata row (``meta_row``) starts with ``FRAME``: the columns every operation's row shares at the same
positions (refusal, op, call number, inline payload bytes), so that a rank reads another operation's row well
enough to report the mismatch. Each operation lays out the rest of its row as its own columns and registers the
layout with its op (``register_row``); the flight recorder labels the rows it dumps by it (``label``). Every
metadata row travels as ``WIDTH`` words whatever its layout (shorter rows zero-padded): the sparse collectives'
row, the widest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from operator import itemgetter

import torch

from sparsync.collectives.ops import op_columns, op_name, register_op
from sparsync.collectives.site import CallSite

WIDTH = 28  # words of every metadata row on the wire (the sparse collectives' layout fills them all)


class Agree(Enum):
    """How the ranks must agree on a column."""

    SAME = "every rank holds rank 0's value"
    UNSET = "-1 on every rank; a rank holding a position >= 0 there reports a problem"
    ZERO = "0 on every rank; a rank holding another value reports a problem"
    OWN = "each rank's own value (a size, a detail of another column): never compared"


@dataclass(frozen=True)
class Facts:
    """What this rank knows of its own call that a description quotes (the table holds numbers only)."""

    me: int  # this rank's index in the round
    who: str = "rank"  # what messages call a member of the round ("replica" for the replicator's primitives)
    op: str = ""  # the operation, as messages name it
    name: str | None = None  # the call's ``name=``
    site: CallSite | None = None  # where an unnamed call was issued
    blocks: Sequence[torch.Tensor] = ()  # each rank's payload in the round (a refusal's message)
    # this rank's own words for its input: built only for a message, and may communicate (every rank sees the
    # same table, so every rank that builds it takes part)
    detail: Callable[[], str] = field(default=lambda: "")


@dataclass(frozen=True)
class Disagreement:
    """The first column of a round's table on which the ranks disagree, and the first rank that does."""

    schema: Schema
    column: Column
    rows: list[list[int]]  # the round's table, one row per rank
    rank: int  # the first rank that differs from rank 0 (or reports a problem)
    facts: Facts

    def value(self, name: str = "", rank: int | None = None) -> int:
        """Column ``name``'s value (default: the disagreeing column's) on ``rank`` (default: the disagreeing
        rank)."""
        return self.rows[self.rank if rank is None else rank][self.schema.index(name or self.column.name)]

    def shown(self, rank: int) -> str:
        """The disagreeing column's value on ``rank``, as messages show it."""
        return self.column.show(self.value(rank=rank))

    def error(self) -> BaseException:
        describe = self.column.describe or self.schema.mismatch
        return describe(self)


Describe = Callable[[Disagreement], BaseException]


@dataclass(frozen=True)
class Column:
    """A named column of a row: how the ranks must agree on it, and how a disagreement on it is described."""

    name: str
    agree: Agree
    what: str = ""  # how a mismatch message names it ("row width"); empty: its name
    show: Callable[[int], str] = str  # a value as a message shows it
    describe: Describe | None = None  # the error of a disagreement on it; None: its schema's ``mismatch``
    default: int = 0  # its value in a row packed without it
    doc: str = ""  # what it holds

    def __post_init__(self) -> None:
        if not self.what:
            object.__setattr__(self, "what", self.name)

    def flagged(self, rows: list[list[int]], i: int) -> int | None:
        """The first rank whose value in position ``i`` breaks this column's agreement, or None."""
        if self.agree is Agree.SAME:
            first = rows[0][i]
            return next((r for r, row in enumerate(rows) if row[i] != first), None)
        if self.agree is Agree.UNSET:
            return next((r for r, row in enumerate(rows) if row[i] >= 0), None)
        if self.agree is Agree.ZERO:
            return next((r for r, row in enumerate(rows) if row[i] != 0), None)
        return None


def mismatch_text(d: Disagreement) -> str:
    """A disagreement in words: the column's values on rank 0 and on the first rank that differs."""
    c, who, r = d.column, d.facts.who, d.rank
    return (
        f"{c.what} mismatch across {who}s: {who} 0 has {c.name}={d.shown(0)}, {who} {r} has {c.name}={d.shown(r)} "
        f"(seen on {who} {d.facts.me})"
    )


def plain_mismatch(d: Disagreement) -> BaseException:
    return ValueError(mismatch_text(d))


class Schema:
    """Named int64 columns, in order; ``mismatch`` describes a disagreement on a column that has no ``describe``.

    Example::

        >>> s = Schema((Column("dim", Agree.SAME), Column("nnz", Agree.OWN)))
        >>> s.pack(dim=8, nnz=3).tolist()
        [8, 3]
        >>> s.check(torch.tensor([[8, 3], [9, 1]]), Facts(me=0))
        Traceback (most recent call last):
        ...
        ValueError: dim mismatch across ranks: rank 0 has dim=8, rank 1 has dim=9 (seen on rank 0)
    """

    def __init__(self, columns: Sequence[Column], mismatch: Describe = plain_mismatch) -> None:
        self.columns = tuple(columns)
        self.names = tuple(c.name for c in self.columns)
        self.mismatch = mismatch
        self._index = {name: i for i, name in enumerate(self.names)}
        if len(self._index) != len(self.names):
            raise ValueError(f"a row names a column twice: {self.names}")
        self._defaults = [c.default for c in self.columns]
        self._same = _getter([i for i, c in enumerate(self.columns) if c.agree is Agree.SAME])
        self._unset = _getter([i for i, c in enumerate(self.columns) if c.agree is Agree.UNSET])
        self._zero = _getter([i for i, c in enumerate(self.columns) if c.agree is Agree.ZERO])

    def __len__(self) -> int:
        return len(self.columns)

    def index(self, name: str) -> int:
        """The position of column ``name``; a KeyError listing the columns for any other name."""
        i = self._index.get(name)
        if i is None:
            raise self._unknown(repr(name))
        return i

    def _unknown(self, what: str) -> KeyError:
        return KeyError(f"no column {what} in this row; its columns: {', '.join(self.names)}")

    def pack(self, **values: int) -> torch.Tensor:
        """A row: ``values`` by column name, every other column its ``default``."""
        words = self._defaults.copy()
        try:
            for name, v in values.items():
                words[self._index[name]] = v
        except KeyError:
            raise self._unknown(str(sorted(values.keys() - self._index.keys()))) from None
        return torch.tensor(words, dtype=torch.int64)

    def column(self, table: torch.Tensor, name: str) -> torch.Tensor:
        """Column ``name`` of a table (one row per rank)."""
        return table[:, self.index(name)]

    def get(self, rows: list[list[int]], name: str) -> list[int]:
        """Column ``name`` of a table as lists (``check``'s result)."""
        i = self.index(name)
        return [row[i] for row in rows]

    def all_clear(self, rows: list[list[int]]) -> bool:
        """Whether every rank agrees on every column (one pass on Python lists: for a table of P x 60 numbers
        several times faster than torch's small ops)."""
        same, unset, zero = self._same, self._unset, self._zero
        first = same(rows[0])
        return all(same(r) == first and all(v < 0 for v in unset(r)) and not any(zero(r)) for r in rows)

    def disagreement(self, rows: list[list[int]], facts: Facts) -> Disagreement | None:
        """The first column, in column order, on which some rank breaks its agreement, or None."""
        for i, col in enumerate(self.columns):
            r = col.flagged(rows, i)
            if r is not None:
                return Disagreement(self, col, rows, r, facts)
        return None

    def check(self, table: torch.Tensor, facts: Facts) -> list[list[int]]:
        """Raise the same error on every rank of a round whose ``table`` (one row per rank, at least this schema's
        columns) breaks a column's agreement: the first such column's description. Returns the table as lists."""
        rows: list[list[int]] = table[:, : len(self.columns)].tolist()
        if not self.all_clear(rows):
            d = self.disagreement(rows, facts)
            if d is not None:
                raise d.error()
        return rows


def _getter(positions: list[int]) -> Callable[[list[int]], tuple[int, ...]]:
    """The values at ``positions`` of a row, as a tuple (``itemgetter``: no Python loop per column)."""
    if not positions:
        return lambda r: ()
    return itemgetter(*positions, positions[0])  # the first again: a tuple even for one position


def _refusal(d: Disagreement) -> BaseException:
    """A rank refused its input before its call and sent the message as its payload (``meta.report_refusal``)."""
    text = bytes(d.facts.blocks[d.rank].numpy()).decode(errors="replace")
    kind = TypeError if text.startswith("TypeError:") else ValueError  # the type the refusing rank raises
    return kind(f"rank {d.rank} refused its input: {text} (seen on rank {d.facts.me})")


# Checked in this order: a refusal explains everything after it, and another op explains another call number.
FRAME = (
    Column("refused", Agree.ZERO, describe=_refusal, doc="1: this rank refused its input; the payload says why"),
    Column("op", Agree.SAME, "collective", show=op_name, doc="the operation's code (collectives/ops.py)"),
    Column("seq", Agree.SAME, "call number", doc="the group's call counter (group.next_call)"),
    Column("inline", Agree.OWN, default=-1, doc="payload bytes that follow the row (-1: not inlined)"),
)
HEAD = Schema(FRAME)  # the columns every metadata row starts with
OP, INLINE = HEAD.index("op"), HEAD.index("inline")


def meta_row(*own: Column, mismatch: Describe = plain_mismatch) -> Schema:
    """The layout of an operation's metadata row: ``FRAME``, then ``own``."""
    schema = Schema((*FRAME, *own), mismatch)
    if len(schema) > WIDTH:
        raise ValueError(f"a metadata row has at most {WIDTH} columns, this one {len(schema)}: {schema.names}")
    return schema


def register_row(name: str, schema: Schema) -> int:
    """Register op ``name`` with its row's layout (``ops.register_op``) and return its code for the op column."""
    return register_op(name, columns=schema.names)


def label(words: Sequence[int]) -> dict[str, int] | list[int]:
    """A metadata row as the flight recorder dumps it: by its op's column names where the op registered them
    (``register_row``), else the bare words."""
    names = op_columns(words[OP]) if len(words) > OP else ()
    return dict(zip(names, words, strict=False)) if names else list(words)
