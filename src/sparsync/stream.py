"""Sparse streams: a vector of dimension N held as sorted (index, value) pairs or as a dense array.

SparCML §3. A stream starts sparse and switches to the dense format once its stored pairs reach
``delta = N * isize / (c + isize)`` (c = index bytes, isize = value bytes): beyond that point the sparse
encoding would put more bytes on the wire than the dense one.

Row-sparse streams (SparCML is element-granular, this is our extension): with ``row=b`` the vector
is R = N / b rows of b contiguous values, and each index addresses a whole row (an embedding row, the
gradient of ``nn.Embedding(sparse=True)``). A row costs one index for b values, so the switch to dense comes
at ``delta = R * b * isize / (c + b * isize)`` stored rows, and merges sum whole rows at once. ``row=1`` is
SparCML's element stream.

Half-precision values are summed in float32 and rounded once per sum (a sum of P fp16 streams rounds once,
not P - 1 times).

Example::

    >>> s = SparseStream(torch.tensor([1, 5]), torch.tensor([1.0, 2.0]), dim=8)
    >>> t = SparseStream.from_dense(torch.tensor([0, 3.0, 0, 0, 0, 1.0, 0, 0]))
    >>> add(s, t).to_dense()
    tensor([0., 4., 0., 0., 0., 3., 0., 0.])
    >>> r = SparseStream(torch.tensor([2]), torch.tensor([1.0, 2.0]), dim=8, row=2)   # row 2 = entries 4, 5
    >>> r.to_dense()
    tensor([0., 0., 0., 0., 1., 2., 0., 0.])
"""

from __future__ import annotations

import torch

from sparsync.buffers import fresh

_INT32_LIMIT = 2**31

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)


def index_dtype_for(dim: int) -> torch.dtype:
    """int32 indices when every index fits (dim < 2^31), else int64: c = 4 or 8 bytes. ``dim`` counts what
    an index addresses: elements, or rows of a row-sparse stream."""
    return torch.int32 if dim < _INT32_LIMIT else torch.int64


def dense_threshold(dim: int, value_dtype: torch.dtype, row: int = 1) -> int:
    """SparCML §3: delta = N * isize / (c + isize); a stream with nnz >= delta is cheaper dense. For a
    row-sparse stream (``row`` = b values per index) delta counts rows: R * b * isize / (c + b * isize)."""
    isize = torch.empty((), dtype=value_dtype).element_size()
    rows = dim // row
    c = torch.empty((), dtype=index_dtype_for(rows)).element_size()
    return (rows * row * isize) // (c + row * isize)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of fp16/bf16 are accumulated in float32 and rounded once."""
    return torch.float32 if dtype in _HALF else dtype


class SparseStream:
    """A vector of dimension ``dim``: sorted unique ``indices`` with ``values``, or dense ``values`` only.

    ``row`` (default 1) is the number of contiguous values each index addresses; ``dim`` must be a multiple
    of it, indices lie in ``[0, dim // row)`` and a sparse stream holds ``row`` values per index (``values``
    is always 1-D, row after row; :attr:`rows2d` views it as ``[nrows, row]``).

    The constructor promises sorted, unique, in-range indices and checks it (``ValueError`` naming the first
    offending position); use :meth:`coalesce` for unsorted input or input with duplicates. ``values`` may be any
    floating dtype. Indices are stored as int32 when ``dim // row < 2**31``, else int64.
    """

    __slots__ = ("_dense", "_dim", "_indices", "_row", "_values")

    def __init__(
        self,
        indices: torch.Tensor | None,
        values: torch.Tensor,
        dim: int,
        *,
        row: int = 1,
        validate: bool = True,
    ) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if isinstance(row, bool) or not isinstance(row, int) or row < 1 or dim % row:
            raise ValueError(f"row must be a positive int dividing dim={dim}, got {row!r}")
        if not isinstance(values, torch.Tensor) or values.dim() != 1:
            raise ValueError(f"values must be a 1-D tensor, got {type(values).__name__} {_shape(values)}")
        if values.dtype not in FLOAT_DTYPES:
            raise ValueError(f"values must have a floating dtype {FLOAT_DTYPES}, got {values.dtype}")
        self._dim = dim
        self._row = row
        self._values = values
        if indices is None:
            if values.numel() != dim:
                raise ValueError(f"a dense stream needs {dim} values, got {values.numel()}")
            self._indices: torch.Tensor | None = None
            self._dense = True
            return
        _check_pairs(indices, values, row)
        if indices.device != values.device:
            raise ValueError(f"indices on {indices.device} but values on {values.device}: put both on one device")
        if validate:
            _check_indices(indices, dim // row, sorted_unique=True)
        self._indices = indices.to(index_dtype_for(dim // row))
        self._dense = False

    # --- constructors -------------------------------------------------------------------------------------
    @classmethod
    def coalesce(cls, indices: torch.Tensor, values: torch.Tensor, dim: int, *, row: int = 1) -> SparseStream:
        """Build a stream from unsorted indices, summing the values of duplicate indices (rows)."""
        if isinstance(row, bool) or not isinstance(row, int) or row < 1 or dim % row:
            raise ValueError(f"row must be a positive int dividing dim={dim}, got {row!r}")
        _check_pairs(indices, values, row)
        _check_indices(indices, dim // row, sorted_unique=False)
        idx, vals = merge_rows(indices.to(torch.int64), values.reshape(-1, row))
        return cls(idx, vals.reshape(-1), dim, row=row, validate=False)

    @classmethod
    def from_dense(cls, tensor: torch.Tensor, *, auto_dense: bool = True) -> SparseStream:
        """Sparse stream of the non-zeros of a 1-D (or flattened) tensor; dense if nnz >= delta."""
        flat = tensor.reshape(-1)
        if flat.dtype not in FLOAT_DTYPES:
            raise ValueError(f"tensor must have a floating dtype {FLOAT_DTYPES}, got {flat.dtype}")
        dim = flat.numel()
        if dim == 0:
            raise ValueError("cannot build a stream of dimension 0")
        nz = torch.nonzero(flat, as_tuple=True)[0]
        if auto_dense and nz.numel() >= dense_threshold(dim, flat.dtype):
            return cls(None, flat.clone(), dim)
        return cls(nz.to(index_dtype_for(dim)), flat[nz], dim, validate=False)

    @classmethod
    def empty(
        cls, dim: int, dtype: torch.dtype = torch.float32, *, row: int = 1, device: torch.device | None = None
    ) -> SparseStream:
        idx = torch.empty(0, dtype=index_dtype_for(dim // row), device=device)
        return cls(idx, torch.empty(0, dtype=dtype, device=device), dim, row=row)

    # --- properties -----------------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self._dim

    @property
    def row(self) -> int:
        """Values per index (1: an element stream)."""
        return self._row

    @property
    def num_rows(self) -> int:
        """R = dim / row: the index space."""
        return self._dim // self._row

    @property
    def indices(self) -> torch.Tensor | None:
        """Sorted unique indices (row ids when ``row > 1``), or None for a dense stream."""
        return self._indices

    @property
    def values(self) -> torch.Tensor:
        return self._values

    @property
    def rows2d(self) -> torch.Tensor:
        """``values`` as ``[nrows, row]`` (a view)."""
        return self._values.view(-1, self._row)

    @property
    def dtype(self) -> torch.dtype:
        return self._values.dtype

    @property
    def device(self) -> torch.device:
        """Where the values (and indices) live; every collective returns its result there."""
        return self._values.device

    @property
    def is_dense(self) -> bool:
        return self._dense

    @property
    def nnz(self) -> int:
        """Stored values: ``nrows * row`` when sparse, ``dim`` when dense."""
        return int(self._values.numel())

    @property
    def nrows(self) -> int:
        """Stored indices (rows): what the sparse-to-dense switch counts; ``num_rows`` when dense."""
        return self.num_rows if self._indices is None else int(self._indices.numel())

    @property
    def delta(self) -> int:
        """The stored rows (``nrows``) at which this stream is cheaper dense (SparCML §3)."""
        return dense_threshold(self._dim, self.dtype, self._row)

    @property
    def nbytes(self) -> int:
        """Bytes this stream puts on the wire (payload; the 16-byte format header is counted by the sender)."""
        if self._indices is None:
            return self._values.numel() * self._values.element_size()
        return (
            self._values.numel() * self._values.element_size()
            + self._indices.numel() * self._indices.element_size()
        )

    # --- conversions ----------------------------------------------------------------------------------------
    def to_dense(self) -> torch.Tensor:
        if self._indices is None:
            return self._values
        if self.device.type == "cpu":
            out = fresh(self._dim, self.dtype, zeros=True)  # large: huge pages, cheaper to fault in
        else:
            out = torch.zeros(self._dim, dtype=self.dtype, device=self.device)
        out.view(-1, self._row)[self._indices.to(torch.int64)] = self.rows2d
        return out

    def densified(self) -> SparseStream:
        """The same vector in the dense format (self when already dense)."""
        return self if self._dense else SparseStream(None, self.to_dense(), self._dim, row=self._row)

    def elements(self) -> SparseStream:
        """The same vector as an element stream (row 1): one index per stored value."""
        if self._row == 1:
            return self
        if self._indices is None:
            return SparseStream(None, self._values, self._dim)
        cols = torch.arange(self._row, device=self.device)
        lin = (self._indices.to(torch.int64)[:, None] * self._row + cols).reshape(-1)
        return SparseStream(lin.to(index_dtype_for(self._dim)), self._values, self._dim, validate=False)

    def slice(self, start: int, stop: int) -> SparseStream:
        """Rows [start, stop) as a stream of ``(stop - start) * row`` values (indices rebased)."""
        if not 0 <= start < stop <= self.num_rows:
            raise ValueError(f"bad slice [{start}, {stop}) of a stream of {self.num_rows} rows")
        b = self._row
        if self._indices is None:
            return SparseStream(None, self._values[start * b : stop * b], (stop - start) * b, row=b)
        cut = torch.tensor([start, stop], dtype=self._indices.dtype, device=self.device)
        lo, hi = torch.searchsorted(self._indices, cut).tolist()
        idx = self._indices[lo:hi] - start
        return SparseStream(idx, self._values[lo * b : hi * b], (stop - start) * b, row=b, validate=False)

    def __repr__(self) -> str:
        fmt = "dense" if self._dense else f"nnz={self.nnz}"
        rows = f", row={self._row}" if self._row != 1 else ""
        return f"SparseStream(dim={self._dim}{rows}, {fmt}, dtype={self.dtype})"


def _same_kind(a: SparseStream, b: SparseStream, what: str) -> None:
    if a.dim != b.dim:
        raise ValueError(f"cannot {what} streams of dimensions {a.dim} and {b.dim}")
    if a.row != b.row:
        raise ValueError(f"cannot {what} streams of row widths {a.row} and {b.row}")
    if a.dtype != b.dtype:
        raise ValueError(f"cannot {what} streams of dtypes {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"cannot {what} streams on devices {a.device} and {b.device}")


def add(a: SparseStream, b: SparseStream, *, inplace: bool = False) -> SparseStream:
    """Sum of two streams of the same dimension, row width and dtype (SparCML §3, "Efficient Summation").

    - sparse + sparse: if ``a.nrows + b.nrows >= delta`` the result is built dense, else the sorted index lists
      are merged and duplicate rows summed. |H1 ∪ H2| is bounded by ``n1 + n2`` as in the paper: computing the
      exact union costs as much as the merge itself, and the bound is only loose when the sets overlap.
    - sparse + dense, dense + dense: scatter/vector add into a dense buffer.

    With ``inplace=True`` and a dense ``a``, ``a.values`` is updated in place and ``a`` returned (the paper's
    "do not allocate a new stream"); otherwise neither input is modified.
    """
    _same_kind(a, b, "add")
    if inplace and a.is_dense:
        if accumulation_dtype(a.dtype) == a.dtype:
            accumulate(a.values, b)
        else:  # half precision: summed in float32, rounded once, written back
            a.values.copy_(sum_streams([a, b]).values)
        return a
    return sum_streams([a, b])


def sum_streams(streams: list[SparseStream]) -> SparseStream:
    """Sum of many streams at once: one merge instead of a chain of pairwise merges.

    Dense when any input is dense or the stored rows reach delta, else a sorted merge of whole rows (one
    ``unique`` over the concatenated indices and one ``index_add_`` of the rows: no loop over rows).
    """
    if not streams:
        raise ValueError("sum_streams needs at least one stream")
    first = streams[0]
    for s in streams[1:]:
        _same_kind(first, s, "sum")
    dim, dtype, row = first.dim, first.dtype, first.row
    acc = accumulation_dtype(dtype)
    total = sum(s.nrows for s in streams)
    if any(s.is_dense for s in streams) or total >= dense_threshold(dim, dtype, row):
        buf = torch.zeros(dim, dtype=acc, device=first.device)
        for s in streams:
            accumulate(buf, s)
        return SparseStream(None, buf.to(dtype), dim, row=row)
    nonempty = [s for s in streams if s.nrows]
    if not nonempty:
        return SparseStream.empty(dim, dtype, row=row, device=first.device)
    if len(nonempty) == 1:
        return nonempty[0]
    idx = torch.cat([_i64(s) for s in nonempty])
    vals = torch.cat([s.rows2d for s in nonempty])
    uidx, uvals = merge_rows(idx, vals)
    return SparseStream(uidx.to(index_dtype_for(dim // row)), uvals.reshape(-1), dim, row=row, validate=False)


def concat_disjoint(parts: list[SparseStream], offsets: list[int], dim: int) -> SparseStream:
    """Vector of dimension ``dim`` from streams covering disjoint row ranges starting at row ``offsets``.

    SparCML §3: when the index sets are disjoint (a problem partitioned by dimension) summation is concatenation.
    """
    if len(parts) != len(offsets):
        raise ValueError(f"{len(parts)} parts but {len(offsets)} offsets")
    dtype, row = parts[0].dtype, parts[0].row
    if any(p.is_dense for p in parts) or sum(p.nrows for p in parts) >= dense_threshold(dim, dtype, row):
        out = torch.zeros(dim, dtype=dtype, device=parts[0].device)
        for p, off in zip(parts, offsets, strict=True):
            accumulate(
                out[off * row : off * row + p.dim], p
            )  # disjoint ranges of a zero buffer: adding is placing
        return SparseStream(None, out, dim, row=row)
    itype = index_dtype_for(dim // row)
    idx = torch.cat(
        [p.indices.to(itype) + off for p, off in zip(parts, offsets, strict=True) if p.indices is not None]
    )
    return SparseStream(idx, torch.cat([p.values for p in parts]), dim, row=row, validate=False)


# --- helpers --------------------------------------------------------------------------------------------------
def accumulate(out: torch.Tensor, s: SparseStream) -> None:
    """``out += s`` in place, for a dense buffer ``out`` of ``s.dim`` elements (any float dtype)."""
    if s.indices is None:
        out.add_(s.values.to(out.dtype))
    else:
        out.view(-1, s.row).index_add_(0, s.indices.to(torch.int64), s.rows2d.to(out.dtype))


def _check_pairs(indices: object, values: torch.Tensor, row: int = 1) -> None:
    """Shape and dtype checks shared by the constructor and ``coalesce``."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D tensor, got {type(indices).__name__} {_shape(indices)}")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise ValueError(f"indices must have an integer dtype, got {indices.dtype}")
    if indices.numel() * row != values.numel():
        per = "" if row == 1 else f" of {row} values each"
        raise ValueError(
            f"indices and values differ in length: {indices.numel()} indices{per}, {values.numel()} values"
        )


def _i64(s: SparseStream) -> torch.Tensor:
    assert s.indices is not None  # callers check is_dense first
    return s.indices.to(torch.int64)


def merge_rows(indices: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (index, row) pairs and sum the rows of duplicate indices (in float32 for half types).
    ``rows`` is ``[n, b]``; returns ``(unique indices, [u, b] sums)``."""
    uniq, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    if uniq.numel() == indices.numel():  # no duplicates: a permutation suffices (no rounding either)
        order = torch.empty_like(inverse)
        order[inverse] = torch.arange(inverse.numel(), device=inverse.device)
        return uniq, rows[order]
    acc = accumulation_dtype(rows.dtype)
    out = torch.zeros(uniq.numel(), rows.shape[1], dtype=acc, device=rows.device)
    if rows.device.type == "cpu":
        out.index_add_(0, inverse, rows.to(acc))  # sequential: each row's duplicates added in input order
    else:
        _add_in_order(out, inverse, rows.to(acc))
    return uniq, out.to(rows.dtype)


ORDERED_MAX = 256  # duplicates of one index up to which a device merge adds them in input order (below)


def _add_in_order(out: torch.Tensor, inverse: torch.Tensor, rows: torch.Tensor) -> None:
    """``out.index_add_(0, inverse, rows)`` with each target's rows added in input order, as the CPU kernel
    does, on a device whose ``index_add_`` adds duplicates by atomics in an unspecified order: the k-th
    occurrences of every index are added in pass k, each pass with unique targets. So a sum of P streams
    (at most P duplicates) has the same bits on every rank and as on the CPU. Beyond ``ORDERED_MAX``
    duplicates (a local COO gradient of a very hot row) the atomic kernel is used: the sum is exact up to
    rounding, but its last bits may vary run to run."""
    order = torch.argsort(inverse, stable=True)
    srt = inverse[order]
    n = srt.numel()
    pos = torch.arange(n, device=srt.device)
    first = torch.ones(n, dtype=torch.bool, device=srt.device)
    first[1:] = srt[1:] != srt[:-1]
    start = torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), 0).values  # segment start per element
    occurrence = pos - start
    passes = int(occurrence.max()) + 1 if n else 0
    if passes > ORDERED_MAX:
        out.index_add_(0, inverse, rows)
        return
    for k in range(passes):
        sel = order[occurrence == k]
        out.index_add_(0, inverse[sel], rows[sel])


def _check_indices(indices: torch.Tensor, dim: int, *, sorted_unique: bool) -> None:
    if indices.numel() == 0:
        return
    idx = indices.to(torch.int64)
    bad = torch.nonzero((idx < 0) | (idx >= dim), as_tuple=True)[0]
    if bad.numel():
        pos = int(bad[0])
        raise ValueError(f"index {int(idx[pos])} at position {pos} is out of range [0, {dim})")
    if sorted_unique and idx.numel() > 1:
        bad = torch.nonzero(idx[1:] <= idx[:-1], as_tuple=True)[0]
        if bad.numel():
            pos = int(bad[0]) + 1
            raise ValueError(
                f"indices must be sorted and unique: index {int(idx[pos])} at position {pos} follows "
                f"{int(idx[pos - 1])} (use SparseStream.coalesce for unsorted input)"
            )


def _shape(x: object) -> str:
    return f"of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else ""
