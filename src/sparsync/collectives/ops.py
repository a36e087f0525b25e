"""Codes of the operations that run a metadata round (the row's "op" column, ``collectives/meta.py``), and the
62-bit text keys of the row's hashed columns.

Every operation that runs a metadata round on a group shares the row's frame (``row.FRAME``: refusal, op,
call number, inline bytes) and the group's call counter (``group.next_call``), so an operation issued on one
rank while another rank issues a different one is reported as a collective mismatch on every rank, instead of
one rank misreading the other's row. ``meta`` registers the sparse collectives' own ops; the layers above
register theirs when they are imported (``compressed_allreduce``: "reduce"; the replicator's primitives:
"all_reduce", "all_gather", ...), so this layer names none of theirs.

A code is a 62-bit hash of the op's name, not its position in a list: the same on every rank whatever modules
that rank imported, in whatever order, so ranks compare codes without knowing each other's registrations. The
table of names (``_OP_NAMES``) only turns codes back into names for error messages; it is filled at import and
only grows. An op may register the names of its row's columns (``register_op(columns=...)``; ``row.register_row``
registers a layout's): the flight recorder labels the rows it dumps with them (``row.label``).
"""

from __future__ import annotations

import hashlib

_OP_NAMES: dict[int, str] = {}
_OP_COLUMNS: dict[int, tuple[str, ...]] = {}  # an op's row columns, in order, where it registered them


def text_key(text: str) -> int:
    """A 62-bit key of ``text``, the same on every rank and run (no Python hash seed), never 0."""
    return (int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2) | 1


def register_op(name: str, columns: tuple[str, ...] = ()) -> int:
    """Register an operation that runs a metadata round (``meta.allgather_rows``) and return its code for the
    row's "op" column (``text_key(name)``). ``columns``: the names of its row's columns, in order (for the flight
    recorder's dump). Idempotent; call it at import, once per name.

    Example::

        >>> ALL_REDUCE = register_op("all_reduce")   # at the top of the module that issues it
        >>> op_name(ALL_REDUCE)
        'all_reduce'
    """
    code = text_key(name)
    known = _OP_NAMES.setdefault(code, name)
    if known != name:
        raise ValueError(f"op {name!r} has the code of op {known!r}; rename one of them")
    if columns:
        _OP_COLUMNS[code] = columns
    return code


def op_code(name: str) -> int:
    """The code of a registered op; a KeyError listing the registered ops for any other name."""
    code = text_key(name)
    if code not in _OP_NAMES:
        raise KeyError(f"unregistered op {name!r}; registered: {', '.join(sorted(_OP_NAMES.values()))}")
    return code


def op_name(code: int) -> str:
    """The name of the op with ``code``, for messages; another rank's op may be unknown on this one (its module
    not imported here)."""
    return _OP_NAMES.get(code, f"an op unknown on this rank (code {code})")


def op_columns(code: int) -> tuple[str, ...]:
    """The names of the row columns the op with ``code`` registered (empty when it registered none)."""
    return _OP_COLUMNS.get(code, ())
