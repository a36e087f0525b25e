"""The metadata exchange every sparse collective starts with, and the cross-rank checks it makes possible.

One tiny allgather of a row of int64 per rank (one round of direct sends up to ``DIRECT_GATHER_MAX`` ranks,
recursive doubling beyond: ``_gather.allgather_var``) gives every rank every rank's nnz and format (the sizes
"allgather" needs, the inputs "auto" needs) and lets all ranks raise the *same* ValueError for bad input on
any rank, instead of the good ranks hanging on the bad one.

Eager protocol (our addition; SparCML has no metadata round to piggyback on): each rank's row may also carry
its whole payload. When every rank's payload came along, the metadata allgather *is* the data allgather and
the call needs no second round, which is what decides the latency-bound, very sparse case.

Blocks are self-delimiting (the row says how many payload bytes follow), and every receive is posted for the
largest block a rank may send (``ROW_BYTES + EAGER_MAX``; gloo takes a shorter message into a longer posted
receive). So each rank sends only its own row and payload: a small call never pays for an earlier large one
(a 19-element reduction after an embedding-sized allgather sent 102,464 bytes, now 2,112 at most),
and ranks that disagree about a call still exchange well-formed messages and raise the same ValueError.

How much payload a rank inlines: up to EAGER_BYTES by default. After a call that ran ``allgather`` (chosen by
auto, forced, or ``sparse_allgather``; an algorithm whose registry entry says ``rides_metadata``), calls of the
same signature (dimension, row width, dtype) may inline up to that call's largest payload plus 25%, rounded up
to 1 KiB, at most EAGER_MAX; after any other algorithm the signature falls back to EAGER_BYTES. Training issues
calls of similar nnz step after step, so from the second call on, a reduction that the model sends through
allgather needs one round instead of two. Every rank keeps the same table (same calls), but correctness does
not depend on it: the data round runs unless every rank inlined its payload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsync.collectives import _hll
from sparsync.collectives._gather import allgather_var
from sparsync.collectives.comm import Comm
from sparsync.collectives.failure import RefusalError
from sparsync.collectives.group import EAGER_BYTES, group_state
from sparsync.collectives.ops import op_code, op_name, register_op, text_key
from sparsync.collectives.site import CallSite
from sparsync.collectives.wire import payload_nbytes, payload_parts
from sparsync.costmodel import REGISTRY
from sparsync.stream import FLOAT_DTYPES, SparseStream

PARTITION_CODES = ("-", "stride", "range")  # the resolved partition of a call (collectives/partition.py)
# The algorithm column: 0 auto, each registry entry its own code (costmodel.AlgorithmEntry.code), NO_ALGORITHM
# for calls with none ("-": sparse_allgather, the hierarchical call's first round, calibration's rows).
NO_ALGORITHM = -1
# nnz: stored rows (indices); bad/bad_value: position and value of an out-of-range index (-1: none), in tensor
# bad_tensor (-1: the call's only tensor; grouped_allreduce numbers its tensors) of bad_rows rows;
# inline: payload bytes that follow the row (-1: not inlined). Callers may pass fewer columns (zero-padded).
# Then the HyperLogLog registers of the row ids (collectives/_hll.py; zero for element or dense streams).
# shape_key: a hash of the caller's tensor layout and full shape (0: a bare stream), with ndim and the first
# four dims for the message; auto_key: a hash of auto's link model and policy (0: forced, or not measured yet);
# nan/nonfinite: position and kind (1 NaN, 2 +Inf, 3 -Inf) of the first non-finite value (-1/0: none);
# check_nan and partition: the call's options, which every rank must share; refused: 1 when this rank's input
# was refused before its call (the row then carries the error message as its payload, ``report_refusal``);
# name_key: a hash of the call's ``name=`` (0: unnamed), which tells apart calls of one signature; quantize: a
# hash of DSAR's ``quantize=`` settings (0: none); device: where the payload lives (DEVICE_CODES), which every
# rank must share (a CPU rank and a CUDA rank cannot meet in one NCCL call).
_F = (
    "seq", "op", "dim", "dtype", "nnz", "dense", "nan", "algorithm", "row", "bad", "bad_value", "bad_tensor",
    "bad_rows", "shape_key", "ndim", "s0", "s1", "s2", "s3", "auto_key", "nonfinite", "check_nan", "partition",
    "refused", "name_key", "quantize", "device", "inline",
)  # fmt: skip
# The "op" column: the sparse collectives' own ops (collectives/ops.py; the layers above register theirs).
SPARSE_ALLREDUCE = register_op("sparse_allreduce", columns=_F)
SPARSE_ALLGATHER = register_op("sparse_allgather", columns=_F)
_COL = {name: i for i, name in enumerate(_F)}
_NONFINITE = ("", "NaN", "+Inf", "-Inf")
DEVICE_CODES = ("cpu", "cuda")  # the device column; any other device type is len(DEVICE_CODES)
_INLINE = _F.index("inline")
_WORDS = len(_F) + _hll.WORDS
ROW_BYTES = 8 * _WORDS
EAGER_MAX = 1 << 20  # the most payload bytes a row carries inline (EAGER_BYTES: the default; module doc)
_MAX_SIGNATURES = 64  # eager limits remembered per group (the oldest forgotten first)


@dataclass(frozen=True)
class BadIndex:
    """An out-of-range index found on this rank, reported to every rank by the metadata round."""

    position: int  # in the tensor's stored indices
    value: int
    rows: int  # the valid range is [0, rows)
    tensor: int = -1  # which of a grouped call's tensors (-1: the call has one)


@dataclass(frozen=True)
class Meta:
    nnz: tuple[int, ...]  # stored rows (indices) per rank; num_rows for a dense stream
    dense: tuple[bool, ...]
    # Every rank's payload (the wire bytes of its stream), when all of them fitted in the metadata round.
    eager: tuple[torch.Tensor, ...] | None = None
    sizes: tuple[int, ...] = ()  # every rank's payload bytes
    signature: tuple[int, int, int] = (0, 1, 0)  # (dim, row, dtype code) of the call
    # (m, estimated rows in the union of m ranks' inputs) from the ranks' HyperLogLog registers, when every
    # rank sent a sparse row stream (collectives/_hll.py); empty otherwise.
    unions: tuple[tuple[float, float], ...] = ()


# The largest payload next_eager_bytes can still make room for (for the cost model's Problem.eager_limit).
EAGER_LIMIT = EAGER_MAX * 4 // 5

Signature = tuple[int, int, int]  # (dim, row, dtype code): calls that share an eager limit


def algorithm_code(name: str) -> int:
    """The algorithm column's value of ``name`` ("auto", "-" or a registered algorithm)."""
    if name == "auto":
        return 0
    return NO_ALGORITHM if name == "-" else REGISTRY.entry(name).code


def algorithm_name(code: int) -> str:
    """The name behind an algorithm column's value (``algorithm_code``'s inverse; "code N" for one that no
    algorithm registered in this process has)."""
    if code == 0:
        return "auto"
    if code == NO_ALGORITHM:
        return "-"
    try:
        return REGISTRY.by_code(code).name
    except KeyError:
        return f"code {code}"


def __getattr__(name: str) -> dict[int, str]:
    """``ALGORITHM_CODES``: code -> name of every value the algorithm column can hold now (registered
    algorithms change it, so it is computed when read)."""
    if name == "ALGORITHM_CODES":
        return {0: "auto", **{e.code: e.name for e in REGISTRY}, NO_ALGORITHM: "-"}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def next_eager_bytes(sizes: tuple[int, ...], algorithm: str) -> int:
    """A signature's inline limit for its next call, from this call's payload sizes and algorithm (module
    doc). Every rank holds the same sizes and algorithm, so every rank computes the same value."""
    want = -(-(max(sizes, default=0) * 5 // 4) // 1024) * 1024
    rides = algorithm in REGISTRY and REGISTRY.entry(algorithm).rides_metadata
    if not rides or want > EAGER_MAX:
        return EAGER_BYTES
    return max(EAGER_BYTES, want)


def signature(stream: SparseStream) -> Signature:
    return (stream.dim, stream.row, FLOAT_DTYPES.index(stream.dtype))


def update_eager(comm: Comm, meta: Meta, algorithm: str) -> None:
    limits = group_state(comm.group).eager_limits
    n = next_eager_bytes(meta.sizes, algorithm)
    limits.pop(meta.signature, None)
    if n != EAGER_BYTES:
        limits[meta.signature] = n
        while len(limits) > _MAX_SIGNATURES:
            limits.pop(next(iter(limits)))


def _block_length(buf: torch.Tensor) -> int:
    if buf.numel() < ROW_BYTES or buf.storage_offset() % 8:
        return -1
    inline = int(buf[:ROW_BYTES].view(torch.int64)[_INLINE])
    return ROW_BYTES + _pad8(max(inline, 0)) if inline <= EAGER_MAX else -1


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def allgather_rows(
    comm: Comm, row: torch.Tensor, eager: list[torch.Tensor] | None = None, hll: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allgather every rank's int64 ``row`` (at most ``len(_F)`` columns, zero-padded) plus the bytes of
    ``eager`` (uint8 pieces, written one after the other: ``payload_parts`` of a stream).

    Every metadata round on a group goes through here, whatever the operation (the replicator's primitives
    included). ``hll``: HyperLogLog registers of the row ids. Returns the [P, ROW_BYTES / 8] table and
    each rank's inline payload (empty when it sent none).
    """
    if row.dtype != torch.int64 or row.dim() != 1 or row.numel() > _INLINE:
        raise ValueError(f"a metadata row is at most {_INLINE} int64, got {row.numel()} {row.dtype}")
    n = -1 if eager is None else sum(int(p.numel()) for p in eager)
    if n > EAGER_MAX:
        raise ValueError(f"eager payload of {n} bytes exceeds EAGER_MAX = {EAGER_MAX}")
    buf = torch.zeros(ROW_BYTES + _pad8(max(n, 0)), dtype=torch.uint8)
    words = buf[:ROW_BYTES].view(torch.int64)
    words[: row.numel()] = row
    words[_INLINE] = n
    if hll is not None:
        words[len(_F) :] = _hll.words(hll)
    off = ROW_BYTES
    for piece in eager or ():  # one copy of the payload, into the message
        buf[off : off + piece.numel()] = piece
        off += piece.numel()
    if comm.flight is not None:  # the fingerprint the ranks compare, for the flight recorder
        comm.flight.fingerprint = tuple(words[: len(_F)].tolist())
    with comm.phase("meta"):
        blocks = allgather_var(comm.meta, buf, ROW_BYTES + EAGER_MAX, _block_length)
    # Each block is a slice at a multiple of 8 bytes (blocks are padded to 8): int64-aligned.
    table = torch.stack([b[:ROW_BYTES].view(torch.int64) for b in blocks])
    payloads = [b[ROW_BYTES : ROW_BYTES + max(int(t[_INLINE]), 0)] for b, t in zip(blocks, table, strict=True)]
    return table, payloads


def exchange_meta(
    comm: Comm,
    op: str,
    stream: SparseStream,
    algorithm: str,
    seq: int,
    check_nan: bool,
    bad: BadIndex | None = None,
    shape: tuple[str, tuple[int, ...]] | None = None,
    auto_key: int = 0,
    partition: int = 0,
    name: str | None = None,
    quantize: int = 0,
    site: CallSite | None = None,
) -> Meta:
    """``bad``: an out-of-range index this rank found in its input; every rank then raises the same
    ValueError naming it (the stream passed is a placeholder). ``shape``: (layout, full shape) of the tensor
    the caller was given, so tensors of one size but different shapes are refused ((5, 2) and (2, 5)
    were summed). ``auto_key``: ``auto_fingerprint`` of the link model and policy auto will use. ``site``:
    where an unnamed call was issued (compared like a name)."""
    if bad is None and shape is None:  # a bare stream; a tensor's rows were range-checked when it was converted
        bad = out_of_range(stream)
    nan_pos, kind = -1, 0
    # ±Inf is refused like NaN, since +Inf on one rank and -Inf on another would silently sum to NaN.
    pos = first_nonfinite(stream.values) if check_nan else -1
    if pos >= 0:
        v = float(stream.values[pos])
        kind = 1 if v != v else (2 if v > 0 else 3)
        b = stream.row
        nan_pos = pos if stream.indices is None else int(stream.indices[pos // b]) * b + pos % b
    dims = [0, 0, 0, 0, 0, 0]
    if shape is not None:
        dims = [shape_fingerprint(*shape), len(shape[1]), *(list(shape[1][:4]) + [0] * 4)[:4]]
    sig = signature(stream)
    row = torch.tensor(
        [
            seq,
            op_code(op),
            stream.dim,
            sig[2],
            stream.nrows,
            int(stream.is_dense),
            nan_pos,
            algorithm_code(algorithm),
            stream.row,
            -1 if bad is None else bad.position,
            -1 if bad is None else bad.value,
            -1 if bad is None else bad.tensor,
            -1 if bad is None else bad.rows,
            *dims,
            auto_key,
            kind,
            int(check_nan),
            partition,
            0,
            name_key(name, site),
            quantize,
            device_code(stream.device),
        ],
        dtype=torch.int64,
    )
    mine = payload_nbytes(stream.is_dense, stream.nrows, stream.dim, stream.dtype, stream.row)
    limit = group_state(comm.group).eager_limits.get(sig, EAGER_BYTES)
    # Only "auto" reads the registers (every rank agrees on the algorithm, checked below): forced calls skip them.
    # At P = 2 the union cannot change the choice: allgather sends k rows, a split at least (k + U)/2 >= k.
    hll = None
    if algorithm == "auto" and stream.row > 1 and stream.indices is not None and comm.size > 2:
        hll = _hll.registers(stream.indices)
    # A device payload small enough to ride along is copied to the host with the row (at most EAGER_MAX bytes:
    # the row's own round trip dominates such a call anyway; transport.py).
    inline = [p.cpu() for p in payload_parts(stream)] if mine <= limit else None
    table, blocks = allgather_rows(comm, row, inline, hll)
    if not _all_clear(table):  # one vectorized test; the detailed checks name what went wrong
        raise_refusals(table, blocks, comm.rank)
        _check(table, comm.rank)
    raise_name_mismatch(table[:, _COL["name_key"]], comm.rank, name, site=site)
    nnz = tuple(int(x) for x in table[:, 4])
    dense = tuple(bool(x) for x in table[:, 5])
    sizes = [payload_nbytes(dense[r], nnz[r], stream.dim, stream.dtype, stream.row) for r in range(comm.size)]
    eager = None
    if all(int(x) >= 0 for x in table[:, _INLINE]):
        for r, (blk, n) in enumerate(zip(blocks, sizes, strict=True)):
            if blk.numel() != n:
                raise ValueError(f"rank {r} inlined {blk.numel()} payload bytes for a stream of {n} (corrupt row)")
        eager = tuple(blocks)
    unions: tuple[tuple[float, float], ...] = ()
    if algorithm == "auto" and stream.row > 1 and not any(dense) and comm.size > 2:
        regs = [_hll.unpack(t[len(_F) :]) for t in table]
        unions = _hll.union_curve(regs, nnz)
    return Meta(nnz=nnz, dense=dense, eager=eager, sizes=tuple(sizes), signature=sig, unions=unions)


# Columns every rank must hold the same value in, and columns that flag a problem when >= 0 (or != 0).
_AGREE = tuple(_COL[c] for c in ("op", "seq", "algorithm", "dim", "row", "dtype", "check_nan", "partition",
                                  "shape_key", "auto_key", "quantize", "device"))  # fmt: skip
_FLAGS = (_COL["bad"], _COL["nan"])


def _all_clear(table: torch.Tensor) -> bool:
    """Whether ``_check`` and ``raise_refusals`` would pass: every agreed column equal, no flag raised.
    On Python lists: for a table of P x 60 numbers that is several times faster than torch's small ops."""
    rows = table.tolist()
    first = rows[0]
    return all(
        all(r[c] == first[c] for c in _AGREE) and all(r[c] < 0 for c in _FLAGS) and r[_COL["refused"]] == 0
        for r in rows
    )


def first_rank(mask: torch.Tensor) -> int | None:
    """The first rank (row of the metadata table) where ``mask`` holds, or None."""
    hits = torch.nonzero(mask, as_tuple=True)[0]
    return int(hits[0]) if hits.numel() else None


def first_differing(table: torch.Tensor, col: int) -> int | None:
    """The first rank whose column ``col`` differs from rank 0's, or None."""
    return first_rank(table[:, col] != table[0, col])


def first_nonfinite(values: torch.Tensor) -> int:
    """Flat position of the first NaN or ±Inf in ``values``, or -1. NaN and ±Inf propagate through a sum, so one
    cheap reduction (10x cheaper than isfinite().all() on 16M floats) clears the common case; only a non-finite
    sum pays for the search (a finite half-precision input whose sum overflows finds none)."""
    if not values.is_floating_point() or values.numel() == 0 or bool(torch.isfinite(values.sum())):
        return -1
    pos = first_rank(~torch.isfinite(values.reshape(-1)))
    return -1 if pos is None else pos


def name_key(name: str | None, site: CallSite | None = None) -> int:
    """The metadata column that tells apart calls of one signature: the call's ``name=``, else where it was
    issued (``site.call_site``; 0: unnamed and no site known)."""
    if name:
        return text_key(name)
    return 0 if site is None else site.key


def raise_name_mismatch(
    keys: torch.Tensor, me: int, name: str | None, who: str = "rank", site: CallSite | None = None
) -> None:
    """Raise the same ValueError on every rank of a metadata round whose ``keys`` column (each rank's
    ``name_key``) differs: calls of one signature are told apart only by their names (or, unnamed, their call
    sites), so a call skipped or swapped on one rank would otherwise be summed with another."""
    r = first_rank(keys != keys[0])
    if r is None:
        return
    if not name and site is not None and site.known:
        raise ValueError(
            f"call site mismatch across {who}s: {who} {r}'s call was issued from another line than {who} 0's "
            f"(this {who}, {me}, called from {site.where}): a call skipped or issued in another order on some "
            f"{who}. If the {who}s issue this call from different lines on purpose, pass the same name= on every "
            f"{who}"
        )
    shown = repr(name) if name is None or len(name) <= 200 else repr(name[:200]) + "..."  # a bucket's names
    raise ValueError(
        f"call name mismatch across {who}s: {who} {r}'s call is not {who} 0's (this {who}, {me}, called "
        f"name={shown}): a call skipped or issued in another order on some {who}"
    )


def raise_check_nan_mismatch(flags: torch.Tensor, me: int, who: str = "rank") -> None:
    """Raise the same ValueError on every rank of a metadata round whose ``flags`` column (each rank's
    ``check_nan``) differs: a rank that skipped the check could send NaN to one that asked for it."""
    r = first_rank(flags != flags[0])
    if r is not None:
        raise ValueError(
            f"check_nan mismatch across {who}s: {who} 0 has check_nan={bool(flags[0])}, {who} {r} has "
            f"check_nan={bool(flags[r])} (seen on {who} {me}); every {who} must pass the same check_nan"
        )


class NonFiniteError(RefusalError):
    """A reduction refused NaN or ±Inf that some rank contributed (``check_nan``). Raised the same on every rank,
    at the same call, before any payload moved: ``DistributedOptimizer`` catches it to defer the error to
    ``step()``, which a ``GradScaler`` skips on an overflow (docs/optimizer.md)."""


def raise_nonfinite(op: str, positions: torch.Tensor, seen_on: int, *, who: str, where: str, hint: str) -> None:
    """Raise the same ValueError on every rank of a metadata round whose ``positions`` column (each rank's first
    non-finite position, -1: none) shows NaN or ±Inf anywhere; ``who``: "rank" or "replica", ``where``: what the
    position counts ("at index", "in leaf"), ``hint``: how to let non-finite values through."""
    r = first_rank(positions >= 0)
    if r is not None:
        raise NonFiniteError(
            f"{op}: {who} {r} holds NaN or ±Inf {where} {int(positions[r])} (seen on {who} {seen_on}); refusing "
            f"to reduce it ({hint})"
        )


def report_refusal(comm: Comm, op: str, seq: int, error: Exception) -> None:
    """This rank refused its input before its call (wrong type, dtype, option...): send a row saying so, with
    the message as its payload, into the metadata round the other ranks are in, so that they raise it too at
    once instead of waiting for the timeout. The caller raises ``error`` afterwards."""
    row = torch.zeros(_COL["refused"] + 1, dtype=torch.int64)
    row[0], row[1], row[_COL["refused"]] = seq, op_code(op), 1
    text = f"{type(error).__name__}: {error}".encode()[:4096]
    table, _ = allgather_rows(comm, row, [torch.frombuffer(bytearray(text), dtype=torch.uint8)])
    others = [r for r in range(comm.size) if r != comm.rank and int(table[r, _COL["refused"]])]
    if others:  # several ranks refused: each raises its own error, naming the others
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"{error}; also refused on rank(s) {others}") from error


def raise_refusals(table: torch.Tensor, blocks: list[torch.Tensor], me: int) -> None:
    """Raise the first refusal another rank reported in this metadata round (``report_refusal``)."""
    r = first_rank(table[:, _COL["refused"]] != 0)
    if r is not None:
        text = bytes(blocks[r].numpy()).decode(errors="replace")
        kind = TypeError if text.startswith("TypeError:") else ValueError  # the type the refusing rank raises
        raise kind(f"rank {r} refused its input: {text} (seen on rank {me})")


def out_of_range(stream: SparseStream) -> BadIndex | None:
    """The first index of ``stream`` outside [0, num_rows), or None. A stream built with ``validate=False`` is
    not checked by its constructor; one pass of ``aminmax`` over its indices here (the bad position only
    searched for when there is one) turns what would fail inside an algorithm into the same ValueError on
    every rank."""
    idx = stream.indices
    if idx is None or idx.numel() == 0:
        return None
    lo, hi = (int(x) for x in torch.aminmax(idx))
    if lo >= 0 and hi < stream.num_rows:
        return None
    pos = first_rank((idx < 0) | (idx >= stream.num_rows))
    assert pos is not None
    return BadIndex(pos, int(idx[pos]), stream.num_rows)


def device_code(device: torch.device) -> int:
    """The device column's code of ``device`` (its type: every rank's own GPU is "cuda")."""
    return DEVICE_CODES.index(device.type) if device.type in DEVICE_CODES else len(DEVICE_CODES)


def shape_fingerprint(layout: str, shape: tuple[int, ...]) -> int:
    """A 62-bit key of (layout, shape)."""
    return text_key(repr((layout, tuple(int(d) for d in shape))))


def auto_fingerprint(link: object, policy: object) -> int:
    """A 62-bit key of auto's link model (None: not measured yet) and policy (by qualified name), so ranks
    about to choose differently raise instead of running different algorithms (gloo aborted)."""
    name = f"{getattr(policy, '__module__', '')}.{getattr(policy, '__qualname__', repr(policy))}"
    return text_key(repr((link, name)))


def _check(table: torch.Tensor, me: int) -> None:
    def names(col: int, r: int) -> str:
        v = int(table[r, col])
        if _F[col] == "op":
            return op_name(v)
        if _F[col] == "dtype":
            return str(FLOAT_DTYPES[v])
        if _F[col] == "algorithm":
            return algorithm_name(v)
        if _F[col] == "partition":
            return PARTITION_CODES[v]
        if _F[col] == "check_nan":
            return str(bool(v))
        if _F[col] == "device":
            return DEVICE_CODES[v] if v < len(DEVICE_CODES) else "other"
        return str(v)

    def shape(r: int) -> str:
        n = int(table[r, _COL["ndim"]])
        dims = [str(int(table[r, _COL[f"s{i}"]])) for i in range(min(n, 4))] + (["..."] if n > 4 else [])
        return f"({', '.join(dims)}{',' if n == 1 else ''})"

    for col, what in (
        (1, "collective"),
        (0, "call number"),
        (7, "algorithm"),
        (2, "dim"),
        (8, "row width"),
        (3, "dtype"),
        (_COL["check_nan"], "check_nan"),
        (_COL["partition"], "partition"),
        (_COL["quantize"], "quantize= setting"),
        (_COL["device"], "device"),
    ):
        r = first_differing(table, col)
        if r is not None:
            raise ValueError(
                f"{what} mismatch across ranks: rank 0 has {_F[col]}={names(col, 0)}, "
                f"rank {r} has {_F[col]}={names(col, r)} (seen on rank {me}); every rank must issue the same "
                "collectives in the same order on streams of the same dimension and dtype"
            )
    r = first_differing(table, _COL["shape_key"])
    if r is not None:
        what = (
            f"rank 0 passed shape {shape(0)}, rank {r} shape {shape(r)}"
            if shape(0) != shape(r)
            else f"rank 0 and rank {r} passed the same shape with another layout (dense vs COO), or another list "
            "of shapes and layouts (grouped_allreduce)"
        )
        raise ValueError(
            f"shape mismatch across ranks: {what} (seen on rank {me}); every rank must pass tensors of the same "
            "shape and layout"
        )
    r = first_differing(table, _COL["auto_key"])
    if r is not None:
        raise ValueError(
            f"auto's inputs differ across ranks: rank {r} uses another link model or policy than rank 0 (seen on "
            f"rank {me}); ranks would choose different algorithms. Pass the same link=/policy= on every rank, "
            "or call sparsync.set_link on every rank"
        )
    r = first_rank(table[:, 9] >= 0)
    if r is not None:
        t = int(table[r, 11])
        where = f" of tensor {t}" if t >= 0 else ""
        raise ValueError(
            f"rank {r} passed index {int(table[r, 10])} at position {int(table[r, 9])}{where}, out of range "
            f"[0, {int(table[r, 12])}) (seen on rank {me})"
        )
    r = first_rank(table[:, 6] >= 0)
    if r is not None:
        what = _NONFINITE[int(table[r, _COL["nonfinite"]])] or "NaN"
        raise NonFiniteError(
            f"rank {r} contributed {what} (at vector index {int(table[r, 6])}); refusing to reduce a non-finite "
            "value (pass check_nan=False to sum NaN and ±Inf as IEEE 754 does)"
        )
