"""Sparse streams: a vector of dimension N held as sorted (index, value) pairs or as a dense array.

SparCML §3. A stream starts sparse and switches to the dense format once its number of stored pairs reaches
``delta = N * isize / (c + isize)`` (c = index bytes, isize = value bytes): beyond that point the sparse
encoding would put more bytes on the wire than the dense one.

Example::

    >>> s = SparseStream(torch.tensor([1, 5]), torch.tensor([1.0, 2.0]), dim=8)
    >>> t = SparseStream.from_dense(torch.tensor([0, 3.0, 0, 0, 0, 1.0, 0, 0]))
    >>> add(s, t).to_dense()
    tensor([0., 4., 0., 0., 0., 3., 0., 0.])
"""

from __future__ import annotations

import torch

_INT32_LIMIT = 2**31

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def index_dtype_for(dim: int) -> torch.dtype:
    """int32 indices when every index fits (dim < 2^31), else int64: c = 4 or 8 bytes."""
    return torch.int32 if dim < _INT32_LIMIT else torch.int64


def dense_threshold(dim: int, value_dtype: torch.dtype) -> int:
    """SparCML §3: delta = N * isize / (c + isize); a stream with nnz >= delta is cheaper dense."""
    isize = torch.empty((), dtype=value_dtype).element_size()
    c = torch.empty((), dtype=index_dtype_for(dim)).element_size()
    return (dim * isize) // (c + isize)


class SparseStream:
    """A vector of dimension ``dim``: sorted unique ``indices`` with ``values``, or dense ``values`` only.

    The constructor promises sorted, unique, in-range indices and checks it (``ValueError`` naming the first
    offending position); use :meth:`coalesce` for unsorted input or input with duplicates. ``values`` may be any
    floating dtype. Indices are stored as int32 when ``dim < 2**31``, else int64.
    """

    __slots__ = ("_dense", "_dim", "_indices", "_values")

    def __init__(
        self,
        indices: torch.Tensor | None,
        values: torch.Tensor,
        dim: int,
        *,
        validate: bool = True,
    ) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(values, torch.Tensor) or values.dim() != 1:
            raise ValueError(f"values must be a 1-D tensor, got {type(values).__name__} {_shape(values)}")
        if values.dtype not in FLOAT_DTYPES:
            raise ValueError(f"values must have a floating dtype {FLOAT_DTYPES}, got {values.dtype}")
        self._dim = dim
        self._values = values
        if indices is None:
            if values.numel() != dim:
                raise ValueError(f"a dense stream needs {dim} values, got {values.numel()}")
            self._indices: torch.Tensor | None = None
            self._dense = True
            return
        _check_pairs(indices, values)
        if validate:
            _check_indices(indices, dim, sorted_unique=True)
        self._indices = indices.to(index_dtype_for(dim))
        self._dense = False

    # --- constructors -------------------------------------------------------------------------------------
    @classmethod
    def coalesce(cls, indices: torch.Tensor, values: torch.Tensor, dim: int) -> SparseStream:
        """Build a stream from unsorted indices, summing the values of duplicate indices."""
        _check_pairs(indices, values)
        _check_indices(indices, dim, sorted_unique=False)
        idx, vals = _merge(indices.to(torch.int64), values)
        return cls(idx, vals, dim, validate=False)

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
    def empty(cls, dim: int, dtype: torch.dtype = torch.float32) -> SparseStream:
        return cls(torch.empty(0, dtype=index_dtype_for(dim)), torch.empty(0, dtype=dtype), dim)

    # --- properties -----------------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self._dim

    @property
    def indices(self) -> torch.Tensor | None:
        """Sorted unique indices, or None for a dense stream."""
        return self._indices

    @property
    def values(self) -> torch.Tensor:
        return self._values

    @property
    def dtype(self) -> torch.dtype:
        return self._values.dtype

    @property
    def is_dense(self) -> bool:
        return self._dense

    @property
    def nnz(self) -> int:
        """Stored entries: the number of pairs when sparse, ``dim`` when dense."""
        return int(self._values.numel())

    @property
    def delta(self) -> int:
        return dense_threshold(self._dim, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes this stream puts on the wire (payload; the 16-byte format header is counted by the sender)."""
        if self._indices is None:
            return self._values.numel() * self._values.element_size()
        return self._values.numel() * (self._values.element_size() + self._indices.element_size())

    # --- conversions ----------------------------------------------------------------------------------------
    def to_dense(self) -> torch.Tensor:
        if self._indices is None:
            return self._values
        out = torch.zeros(self._dim, dtype=self.dtype)
        out[self._indices.to(torch.int64)] = self._values
        return out

    def densified(self) -> SparseStream:
        """The same vector in the dense format (self when already dense)."""
        return self if self._dense else SparseStream(None, self.to_dense(), self._dim)

    def slice(self, start: int, stop: int) -> SparseStream:
        """The sub-vector [start, stop) as a stream of dimension stop - start (indices rebased)."""
        if not 0 <= start < stop <= self._dim:
            raise ValueError(f"bad slice [{start}, {stop}) of a stream of dimension {self._dim}")
        if self._indices is None:
            return SparseStream(None, self._values[start:stop], stop - start)
        lo, hi = torch.searchsorted(self._indices, torch.tensor([start, stop], dtype=self._indices.dtype))
        idx = self._indices[int(lo) : int(hi)] - start
        return SparseStream(idx, self._values[int(lo) : int(hi)], stop - start, validate=False)

    def __repr__(self) -> str:
        fmt = "dense" if self._dense else f"nnz={self.nnz}"
        return f"SparseStream(dim={self._dim}, {fmt}, dtype={self.dtype})"


def add(a: SparseStream, b: SparseStream, *, inplace: bool = False) -> SparseStream:
    """Sum of two streams of the same dimension and dtype (SparCML §3, "Efficient Summation").

    - sparse + sparse: if ``a.nnz + b.nnz >= delta`` the result is built dense, else the sorted pair lists are
      merged and duplicate indices summed. |H1 ∪ H2| is bounded by ``n1 + n2`` as in the paper: computing the
      exact union costs as much as the merge itself, and the bound is only loose when the sets overlap.
    - sparse + dense, dense + dense: scatter/vector add into a dense buffer.

    With ``inplace=True`` and a dense ``a``, ``a.values`` is updated in place and ``a`` returned (the paper's
    "do not allocate a new stream"); otherwise neither input is modified.
    """
    if a.dim != b.dim:
        raise ValueError(f"cannot add streams of dimensions {a.dim} and {b.dim}")
    if a.dtype != b.dtype:
        raise ValueError(f"cannot add streams of dtypes {a.dtype} and {b.dtype}")
    if a.is_dense or b.is_dense:
        dense, other = (a, b) if a.is_dense else (b, a)
        out = dense.values if (inplace and dense is a) else dense.values.clone()
        _accumulate(out, other)
        return a if out is a.values else SparseStream(None, out, a.dim)
    if a.nnz + b.nnz >= a.delta:
        out = a.to_dense()  # a fresh buffer: a is sparse here
        _accumulate(out, b)
        return SparseStream(None, out, a.dim)
    if a.nnz == 0:
        return b
    if b.nnz == 0:
        return a
    idx, vals = _merge(torch.cat([_i64(a), _i64(b)]), torch.cat([a.values, b.values]))
    return SparseStream(idx.to(index_dtype_for(a.dim)), vals, a.dim, validate=False)


def sum_streams(streams: list[SparseStream]) -> SparseStream:
    """Sum of many streams at once: one merge instead of a chain of pairwise merges."""
    if not streams:
        raise ValueError("sum_streams needs at least one stream")
    dim, dtype = streams[0].dim, streams[0].dtype
    for s in streams:
        if s.dim != dim or s.dtype != dtype:
            raise ValueError(f"cannot sum streams of dimension/dtype {s.dim}/{s.dtype} and {dim}/{dtype}")
    total = sum(s.nnz for s in streams)
    if any(s.is_dense for s in streams) or total >= dense_threshold(dim, dtype):
        out = torch.zeros(dim, dtype=dtype)
        for s in streams:
            _accumulate(out, s)
        return SparseStream(None, out, dim)
    nonempty = [s for s in streams if s.nnz]
    if not nonempty:
        return SparseStream.empty(dim, dtype)
    if len(nonempty) == 1:
        return nonempty[0]
    idx, vals = _merge(torch.cat([_i64(s) for s in nonempty]), torch.cat([s.values for s in nonempty]))
    return SparseStream(idx.to(index_dtype_for(dim)), vals, dim, validate=False)


def concat_disjoint(parts: list[SparseStream], offsets: list[int], dim: int) -> SparseStream:
    """Vector of dimension ``dim`` from streams covering disjoint ranges starting at ``offsets``.

    SparCML §3: when the index sets are disjoint (a problem partitioned by dimension) summation is concatenation.
    """
    if len(parts) != len(offsets):
        raise ValueError(f"{len(parts)} parts but {len(offsets)} offsets")
    dtype = parts[0].dtype
    if any(p.is_dense for p in parts) or sum(p.nnz for p in parts) >= dense_threshold(dim, dtype):
        out = torch.zeros(dim, dtype=dtype)
        for p, off in zip(parts, offsets, strict=True):
            _accumulate(out[off : off + p.dim], p)  # disjoint ranges of a zero buffer: adding is placing
        return SparseStream(None, out, dim)
    itype = index_dtype_for(dim)
    idx = torch.cat(
        [p.indices.to(itype) + off for p, off in zip(parts, offsets, strict=True) if p.indices is not None]
    )
    return SparseStream(idx, torch.cat([p.values for p in parts]), dim, validate=False)


# --- helpers --------------------------------------------------------------------------------------------------
def _accumulate(out: torch.Tensor, s: SparseStream) -> None:
    """``out += s`` in place, for a dense buffer ``out`` of ``s.dim`` elements (the one dense-sum loop body)."""
    if s.indices is None:
        out.add_(s.values)
    else:
        out.index_add_(0, s.indices.to(torch.int64), s.values)


def _check_pairs(indices: object, values: torch.Tensor) -> None:
    """Shape and dtype checks shared by the constructor and ``coalesce``."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D tensor, got {type(indices).__name__} {_shape(indices)}")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise ValueError(f"indices must have an integer dtype, got {indices.dtype}")
    if indices.numel() != values.numel():
        raise ValueError(
            f"indices and values differ in length: {indices.numel()} indices, {values.numel()} values"
        )


def _i64(s: SparseStream) -> torch.Tensor:
    assert s.indices is not None  # callers check is_dense first
    return s.indices.to(torch.int64)


def _merge(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (index, value) pairs and sum duplicates."""
    uniq, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    out = torch.zeros(uniq.numel(), dtype=values.dtype)
    out.index_add_(0, inverse, values)
    return uniq, out


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
