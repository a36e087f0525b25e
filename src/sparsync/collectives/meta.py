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

from sparsync.collectives import _hll, row
from sparsync.collectives._gather import allgather_var
from sparsync.collectives.comm import Comm
from sparsync.collectives.failure import RefusalError
from sparsync.collectives.group import EAGER_BYTES, group_state
from sparsync.collectives.ops import op_code, text_key
from sparsync.collectives.row import Agree, Column, Describe, Disagreement, Facts, mismatch_text
from sparsync.collectives.site import CallSite
from sparsync.collectives.wire import payload_nbytes, payload_parts
from sparsync.costmodel import REGISTRY
from sparsync.stream import FLOAT_DTYPES, SparseStream

PARTITION_CODES = ("-", "stride", "range")  # the resolved partition of a call (collectives/partition.py)
# The algorithm column: 0 auto, each registry entry its own code (costmodel.AlgorithmEntry.code), NO_ALGORITHM
# for calls with none ("-": sparse_allgather, the hierarchical call's first round, calibration's rows).
NO_ALGORITHM = -1
_NONFINITE = ("", "NaN", "+Inf", "-Inf")
DEVICE_CODES = ("cpu", "cuda")  # the device column; any other device type is len(DEVICE_CODES)
# The HyperLogLog registers of the row ids follow the row's columns (collectives/_hll.py; zero when not sent).
_HLL = row.WIDTH
ROW_BYTES = 8 * (row.WIDTH + _hll.WORDS)
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
    inline = int(buf[:ROW_BYTES].view(torch.int64)[row.INLINE])
    return ROW_BYTES + _pad8(max(inline, 0)) if inline <= EAGER_MAX else -1


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def allgather_rows(
    comm: Comm, words: torch.Tensor, eager: list[torch.Tensor] | None = None, hll: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allgather every rank's metadata row ``words`` (int64, at most ``row.WIDTH``: a ``row.meta_row``
    layout's ``pack``, zero-padded) plus the bytes of ``eager`` (uint8 pieces, written one after the other:
    ``payload_parts`` of a stream); the row's ``inline`` column is set here.

    Every metadata round on a group goes through here, whatever the operation (the replicator's primitives
    included). ``hll``: HyperLogLog registers of the row ids. Returns the [P, ROW_BYTES / 8] table and
    each rank's inline payload (empty when it sent none).
    """
    if words.dtype != torch.int64 or words.dim() != 1 or words.numel() > row.WIDTH:
        raise ValueError(f"a metadata row is at most {row.WIDTH} int64, got {words.numel()} {words.dtype}")
    n = -1 if eager is None else sum(int(p.numel()) for p in eager)
    if n > EAGER_MAX:
        raise ValueError(f"eager payload of {n} bytes exceeds EAGER_MAX = {EAGER_MAX}")
    buf = torch.zeros(ROW_BYTES + _pad8(max(n, 0)), dtype=torch.uint8)
    out = buf[:ROW_BYTES].view(torch.int64)
    out[: words.numel()] = words
    out[row.INLINE] = n
    if hll is not None:
        out[_HLL:] = _hll.words(hll)
    off = ROW_BYTES
    for piece in eager or ():  # one copy of the payload, into the message
        buf[off : off + piece.numel()] = piece
        off += piece.numel()
    if comm.flight is not None:  # the fingerprint the ranks compare, for the flight recorder
        comm.flight.fingerprint = tuple(out[: row.WIDTH].tolist())
    with comm.phase("meta"):
        blocks = allgather_var(comm.meta, buf, ROW_BYTES + EAGER_MAX, _block_length)
    # Each block is a slice at a multiple of 8 bytes (blocks are padded to 8): int64-aligned.
    table = torch.stack([b[:ROW_BYTES].view(torch.int64) for b in blocks])
    inline = table[:, row.INLINE].tolist()
    payloads = [b[ROW_BYTES : ROW_BYTES + max(k, 0)] for b, k in zip(blocks, inline, strict=True)]
    return table, payloads


def exchange_meta(
    comm: Comm,
    op: str,
    stream: SparseStream,
    algorithm: str,
    seq: int,
    check_nan: bool,
    *,
    bad: BadIndex | None = None,
    shape: tuple[str, tuple[int, ...]] | None = None,
    auto_key: int = 0,
    partition: int = 0,
    name: str | None = None,
    quantize: int = 0,
    site: CallSite | None = None,
) -> Meta:
    """The metadata round of a sparse collective ``op`` on ``stream`` (``SPARSE_ROW``): every rank raises the
    same error unless all agree on the call, then every rank's sizes, payload (when all inlined) and unions.

    ``bad``: an out-of-range index this rank found in its input; every rank then raises the same
    ValueError naming it (the stream passed is a placeholder). ``shape``: (layout, full shape) of the tensor
    the caller was given, so tensors of one size but different shapes are refused ((5, 2) and (2, 5)
    were summed). ``auto_key``: ``auto_fingerprint`` of the link model and policy auto will use. ``site``:
    where an unnamed call was issued (compared like a name)."""
    if bad is None and shape is None:  # a bare stream; a tensor's rows were range-checked when it was converted
        bad = out_of_range(stream)
    words = SPARSE_ROW.pack(
        seq=seq, op=op_code(op), algorithm=algorithm_code(algorithm), dim=stream.dim, row=stream.row,
        dtype=FLOAT_DTYPES.index(stream.dtype), check_nan=int(check_nan), partition=partition,
        quantize=quantize, device=device_code(stream.device), auto_key=auto_key, name_key=name_key(name, site),
        nnz=stream.nrows, dense=int(stream.is_dense),
        **_shape_columns(shape), **_bad_columns(bad), **_nonfinite_columns(stream, check_nan),
    )  # fmt: skip
    sig = signature(stream)
    mine = payload_nbytes(stream.is_dense, stream.nrows, stream.dim, stream.dtype, stream.row)
    limit = group_state(comm.group).eager_limits.get(sig, EAGER_BYTES)
    # A device payload small enough to ride along is copied to the host with the row (at most EAGER_MAX bytes:
    # the row's own round trip dominates such a call anyway; transport.py).
    inline = [p.cpu() for p in payload_parts(stream)] if mine <= limit else None
    idx = stream.indices
    hll = _hll.registers(idx) if idx is not None and _reads_unions(comm, stream, algorithm) else None
    table, blocks = allgather_rows(comm, words, inline, hll)
    rows = SPARSE_ROW.check(table, Facts(comm.rank, name=name, site=site, blocks=blocks))
    return _meta_of(rows, table, blocks, stream, algorithm)


def _reads_unions(comm: Comm, stream: SparseStream, algorithm: str) -> bool:
    """Whether this call sends (and reads) HyperLogLog registers of its row ids. Only "auto" reads them (every
    rank agrees on the algorithm, checked in the round): forced calls skip them. At P = 2 the union cannot change
    the choice: allgather sends k rows, a split at least (k + U)/2 >= k."""
    return algorithm == "auto" and stream.row > 1 and comm.size > 2


def _meta_of(
    rows: list[list[int]], table: torch.Tensor, blocks: list[torch.Tensor], stream: SparseStream, algorithm: str
) -> Meta:
    """The ``Meta`` of a checked round: every rank's sizes, its payloads when every rank inlined, the unions."""
    nnz = tuple(SPARSE_ROW.get(rows, "nnz"))
    dense = tuple(bool(x) for x in SPARSE_ROW.get(rows, "dense"))
    sizes = tuple(
        payload_nbytes(d, k, stream.dim, stream.dtype, stream.row) for d, k in zip(dense, nnz, strict=True)
    )
    eager = None
    if all(x >= 0 for x in SPARSE_ROW.get(rows, "inline")):
        for r, (blk, n) in enumerate(zip(blocks, sizes, strict=True)):
            if blk.numel() != n:
                raise ValueError(f"rank {r} inlined {blk.numel()} payload bytes for a stream of {n} (corrupt row)")
        eager = tuple(blocks)
    unions: tuple[tuple[float, float], ...] = ()
    if algorithm == "auto" and stream.row > 1 and not any(dense) and len(rows) > 2:
        unions = _hll.union_curve([_hll.unpack(t[_HLL:]) for t in table], nnz)
    return Meta(nnz=nnz, dense=dense, eager=eager, sizes=sizes, signature=signature(stream), unions=unions)


def _shape_columns(shape: tuple[str, tuple[int, ...]] | None) -> dict[str, int]:
    """The shape columns of a call given a tensor of ``shape`` (layout, full shape); none for a bare stream."""
    if shape is None:
        return {}
    layout, dims = shape
    first = (list(dims[:4]) + [0] * 4)[:4]
    dims_of = {f"s{i}": first[i] for i in range(4)}
    return {"shape_key": shape_fingerprint(layout, dims), "ndim": len(dims), **dims_of}


def _bad_columns(bad: BadIndex | None) -> dict[str, int]:
    if bad is None:
        return {}
    return {"bad": bad.position, "bad_value": bad.value, "bad_tensor": bad.tensor, "bad_rows": bad.rows}


def _nonfinite_columns(stream: SparseStream, check_nan: bool) -> dict[str, int]:
    """The position (in the stream's vector) and kind of its first NaN or ±Inf; none when it has none, or
    unchecked. ±Inf is refused like NaN, since +Inf on one rank and -Inf on another would silently sum to NaN."""
    pos = first_nonfinite(stream.values) if check_nan else -1
    if pos < 0:
        return {}
    v = float(stream.values[pos])
    b = stream.row
    at = pos if stream.indices is None else int(stream.indices[pos // b]) * b + pos % b
    return {"nan": at, "nonfinite": 1 if v != v else (2 if v > 0 else 3)}


def first_rank(mask: torch.Tensor) -> int | None:
    """The first rank (row of the metadata table) where ``mask`` holds, or None."""
    hits = torch.nonzero(mask, as_tuple=True)[0]
    return int(hits[0]) if hits.numel() else None


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


def name_mismatch(d: Disagreement) -> BaseException:
    """The ``name_key`` column differs: calls of one signature are told apart only by their names (or, unnamed,
    their call sites), so a call skipped or swapped on one rank would otherwise be summed with another."""
    who, r, me, name, site = d.facts.who, d.rank, d.facts.me, d.facts.name, d.facts.site
    if not name and site is not None and site.known:
        return ValueError(
            f"call site mismatch across {who}s: {who} {r}'s call was issued from another line than {who} 0's "
            f"(this {who}, {me}, called from {site.where}): a call skipped or issued in another order on some "
            f"{who}. If the {who}s issue this call from different lines on purpose, pass the same name= on every "
            f"{who}"
        )
    shown = repr(name) if name is None or len(name) <= 200 else repr(name[:200]) + "..."  # a bucket's names
    return ValueError(
        f"call name mismatch across {who}s: {who} {r}'s call is not {who} 0's (this {who}, {me}, called "
        f"name={shown}): a call skipped or issued in another order on some {who}"
    )


def check_nan_mismatch(d: Disagreement) -> BaseException:
    """The ``check_nan`` column differs: a rank that skipped the check could send NaN to one that asked for it."""
    who, r = d.facts.who, d.rank
    return ValueError(
        f"check_nan mismatch across {who}s: {who} 0 has check_nan={bool(d.value(rank=0))}, {who} {r} has "
        f"check_nan={bool(d.value())} (seen on {who} {d.facts.me}); every {who} must pass the same check_nan"
    )


class NonFiniteError(RefusalError):
    """A reduction refused NaN or ±Inf that some rank contributed (``check_nan``). Raised the same on every rank,
    at the same call, before any payload moved: ``DistributedOptimizer`` catches it to defer the error to
    ``step()``, which a ``GradScaler`` skips on an overflow (docs/optimizer.md)."""


def nonfinite_at(where: str, hint: str) -> Describe:
    """The description of an ``Agree.UNSET`` column holding each rank's first non-finite position (-1: none):
    ``where``: what the position counts ("at index", "in leaf"), ``hint``: how to let non-finite values
    through."""

    def describe(d: Disagreement) -> BaseException:
        who = d.facts.who
        return NonFiniteError(
            f"{d.facts.op}: {who} {d.rank} holds NaN or ±Inf {where} {d.value()} (seen on {who} {d.facts.me}); "
            f"refusing to reduce it ({hint})"
        )

    return describe


# The columns every agreement round names alike: the call's name (or call site), and check_nan where a differing
# check_nan is described on its own (the sparse collectives' row lists it with their other options).
NAME_KEY = Column("name_key", Agree.SAME, describe=name_mismatch, doc="name_key(name=, call site); 0: unnamed")
CHECK_NAN = Column("check_nan", Agree.SAME, describe=check_nan_mismatch, doc="1: the call refuses NaN and ±Inf")


def report_refusal(comm: Comm, op: str, seq: int, error: Exception) -> None:
    """This rank refused its input before its call (wrong type, dtype, option...): send a row saying so, with
    the message as its payload, into the metadata round the other ranks are in, so that they raise it too at
    once instead of waiting for the timeout (the ``refused`` column of ``row.FRAME``, which every operation's
    row starts with). The caller raises ``error`` afterwards."""
    words = row.HEAD.pack(seq=seq, op=op_code(op), refused=1)
    text = f"{type(error).__name__}: {error}".encode()[:4096]
    table, _ = allgather_rows(comm, words, [torch.frombuffer(bytearray(text), dtype=torch.uint8)])
    refused = row.HEAD.column(table, "refused").tolist()
    others = [r for r in range(comm.size) if r != comm.rank and refused[r]]
    if others:  # several ranks refused: each raises its own error, naming the others
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"{error}; also refused on rank(s) {others}") from error


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


def _shape(d: Disagreement, r: int) -> str:
    n = d.value("ndim", r)
    dims = [str(d.value(f"s{i}", r)) for i in range(min(n, 4))] + (["..."] if n > 4 else [])
    return f"({', '.join(dims)}{',' if n == 1 else ''})"


def _shape_mismatch(d: Disagreement) -> BaseException:
    r, me = d.rank, d.facts.me
    what = (
        f"rank 0 passed shape {_shape(d, 0)}, rank {r} shape {_shape(d, r)}"
        if _shape(d, 0) != _shape(d, r)
        else f"rank 0 and rank {r} passed the same shape with another layout (dense vs COO), or another list "
        "of shapes and layouts (grouped_allreduce)"
    )
    return ValueError(
        f"shape mismatch across ranks: {what} (seen on rank {me}); every rank must pass tensors of the same "
        "shape and layout"
    )


def _auto_mismatch(d: Disagreement) -> BaseException:
    return ValueError(
        f"auto's inputs differ across ranks: rank {d.rank} uses another link model or policy than rank 0 (seen on "
        f"rank {d.facts.me}); ranks would choose different algorithms. Pass the same link=/policy= on every rank, "
        "or call sparsync.set_link on every rank"
    )


def _bad_index(d: Disagreement) -> BaseException:
    t = d.value("bad_tensor")
    where = f" of tensor {t}" if t >= 0 else ""
    return ValueError(
        f"rank {d.rank} passed index {d.value('bad_value')} at position {d.value()}{where}, out of range "
        f"[0, {d.value('bad_rows')}) (seen on rank {d.facts.me})"
    )


def _nonfinite_value(d: Disagreement) -> BaseException:
    what = _NONFINITE[d.value("nonfinite")] or "NaN"
    return NonFiniteError(
        f"rank {d.rank} contributed {what} (at vector index {d.value()}); refusing to reduce a non-finite "
        "value (pass check_nan=False to sum NaN and ±Inf as IEEE 754 does)"
    )


def _sparse_mismatch(d: Disagreement) -> BaseException:
    return ValueError(
        f"{mismatch_text(d)}; every rank must issue the same collectives in the same order on streams of the same "
        "dimension and dtype"
    )


def _device_name(code: int) -> str:
    return DEVICE_CODES[code] if code < len(DEVICE_CODES) else "other"


_SAME, _OWN, _UNSET = Agree.SAME, Agree.OWN, Agree.UNSET
# The sparse collectives' row, checked in this order (after the frame's refusal, op and call number). OWN
# columns: nnz: stored rows (indices); dense: 1 for a dense stream; ndim and s0-s3: the caller's tensor's rank
# and first four dims (0: a bare stream), for shape_key's message; bad_value, bad_tensor, bad_rows: the value of
# bad's index, its tensor (-1: the call's only tensor; grouped_allreduce numbers its tensors) and its valid
# range [0, rows); nonfinite: the kind (1 NaN, 2 +Inf, 3 -Inf) of the value at nan.
SPARSE_ROW = row.meta_row(
    Column("algorithm", _SAME, show=algorithm_name, doc="algorithm_code: 0 auto, NO_ALGORITHM none"),
    Column("dim", _SAME, doc="the stream's dimension"),
    Column("row", _SAME, "row width", doc="values per stored index"),
    Column("dtype", _SAME, show=lambda v: str(FLOAT_DTYPES[v]), doc="index in stream.FLOAT_DTYPES"),
    Column("check_nan", _SAME, show=lambda v: str(bool(v)), doc="1: the call refuses NaN and ±Inf"),
    Column("partition", _SAME, show=PARTITION_CODES.__getitem__, doc="index in PARTITION_CODES"),
    Column("quantize", _SAME, "quantize= setting", doc="a hash of DSAR's quantize= settings (0: none)"),
    Column("device", _SAME, show=_device_name, doc="device_code: a CPU rank cannot meet a CUDA rank in NCCL"),
    Column("shape_key", _SAME, describe=_shape_mismatch, doc="shape_fingerprint(layout, shape); 0: a bare stream"),
    *(Column(c, _OWN) for c in ("ndim", "s0", "s1", "s2", "s3")),
    Column("auto_key", _SAME, describe=_auto_mismatch, doc="auto_fingerprint (0: forced, or not measured yet)"),
    Column("bad", _UNSET, describe=_bad_index, default=-1, doc="position of an out-of-range index (-1: none)"),
    *(Column(c, _OWN, default=-1) for c in ("bad_value", "bad_tensor", "bad_rows")),
    Column("nan", _UNSET, describe=_nonfinite_value, default=-1, doc="vector index of the first NaN or ±Inf"),
    Column("nonfinite", _OWN),
    NAME_KEY,
    Column("nnz", _OWN),
    Column("dense", _OWN),
    mismatch=_sparse_mismatch,
)
SPARSE_ALLREDUCE = row.register_row("sparse_allreduce", SPARSE_ROW)
SPARSE_ALLGATHER = row.register_row("sparse_allgather", SPARSE_ROW)
