"""SparseStream, add, sum_streams: validation, conversions, the dense switch at delta, and properties vs numpy."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsync import SparseStream, add, dense_threshold, sum_streams

F32, F64 = torch.float32, torch.float64


# --- constructor validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("indices", "values", "dim", "needle"),
    [
        (torch.tensor([1, 10]), torch.ones(2), 10, "index 10 at position 1 is out of range [0, 10)"),
        (torch.tensor([0, 123]), torch.ones(2), 5, "index 123 at position 1"),
        (torch.tensor([-3, 2]), torch.ones(2), 10, "index -3 at position 0"),
        (torch.tensor([1, 5, 3]), torch.ones(3), 10, "index 3 at position 2 follows 5"),
        (torch.tensor([2, 2]), torch.ones(2), 10, "index 2 at position 1 follows 2"),
        (torch.tensor([0, 1, 2]), torch.ones(2), 10, "3 indices, 2 values"),
        (torch.tensor([0, 1]), torch.ones(3), 10, "2 indices, 3 values"),
        (torch.tensor([0, 1]), torch.tensor([1, 2]), 10, "torch.int64"),
        (torch.tensor([0, 1]), torch.tensor([True, False]), 10, "torch.bool"),
        (torch.tensor([0.0, 1.0]), torch.ones(2), 10, "torch.float32"),
        (torch.tensor([0, 1], dtype=torch.float64), torch.ones(2), 10, "torch.float64"),
        (torch.tensor([True]), torch.ones(1), 10, "torch.bool"),
        (torch.tensor([[0, 1]]), torch.ones(2), 10, "(1, 2)"),
        (torch.tensor([0, 1]), torch.ones(1, 2), 10, "(1, 2)"),
        ([0, 1], torch.ones(2), 10, "list"),
        (torch.tensor([0]), torch.ones(1), 0, "got 0"),
        (torch.tensor([0]), torch.ones(1), -4, "got -4"),
        (torch.tensor([0]), torch.ones(1), True, "got True"),
        (torch.tensor([0]), torch.ones(1), 2.0, "got 2.0"),
        (None, torch.ones(9), 10, "needs 10 values, got 9"),
    ],
)
def test_constructor_rejects_bad_input_naming_it(
    indices: object, values: object, dim: object, needle: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        SparseStream(indices, values, dim)  # type: ignore[arg-type]


def test_constructor_accepts_valid_input_and_normalizes_index_dtype() -> None:
    s = SparseStream(torch.tensor([0, 3, 9], dtype=torch.int64), torch.tensor([1.0, 2.0, 3.0]), 10)
    assert s.indices is not None and s.indices.dtype == torch.int32
    assert s.indices.tolist() == [0, 3, 9] and s.values.tolist() == [1.0, 2.0, 3.0]
    assert (s.dim, s.nnz, s.dtype, s.is_dense) == (10, 3, F32, False)
    for dt in (torch.int8, torch.int16, torch.uint8):
        assert SparseStream(torch.tensor([1, 2], dtype=dt), torch.ones(2), 3).indices.dtype == torch.int32
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        assert SparseStream(torch.tensor([1]), torch.ones(1, dtype=dt), 3).dtype == dt


def test_validate_false_skips_the_order_check() -> None:
    s = SparseStream(torch.tensor([3, 1]), torch.ones(2), 5, validate=False)
    assert s.nnz == 2


def test_huge_dim_uses_int64_indices() -> None:
    dim = 2**31 + 10
    s = SparseStream(torch.tensor([0, 2**31 + 5]), torch.ones(2), dim)
    assert s.indices is not None and s.indices.dtype == torch.int64
    assert s.indices.tolist() == [0, 2**31 + 5]
    assert s.nbytes == 2 * (8 + 4)
    assert dense_threshold(dim, F32) == dim * 4 // 12


# --- coalesce -----------------------------------------------------------------------------------------------
def test_coalesce_sorts_and_sums_duplicates() -> None:
    s = SparseStream.coalesce(torch.tensor([5, 1, 5, 3, 1]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), 6)
    assert s.indices is not None
    assert s.indices.tolist() == [1, 3, 5]
    assert s.values.tolist() == [7.0, 4.0, 4.0]
    assert s.to_dense().tolist() == [0.0, 7.0, 0.0, 4.0, 0.0, 4.0]


def test_coalesce_keeps_dtype_and_handles_empty() -> None:
    s = SparseStream.coalesce(torch.tensor([2, 2]), torch.tensor([0.25, 0.5], dtype=F64), 4)
    assert s.dtype == F64 and s.values.tolist() == [0.75]
    e = SparseStream.coalesce(torch.empty(0, dtype=torch.int64), torch.empty(0), 4)
    assert e.nnz == 0 and not e.is_dense and e.to_dense().tolist() == [0.0] * 4


@pytest.mark.parametrize(
    ("indices", "values", "needle"),
    [
        (torch.tensor([1, 7]), torch.ones(2), "index 7 at position 1 is out of range"),
        (torch.tensor([-1]), torch.ones(1), "index -1"),
        (torch.tensor([1, 2]), torch.ones(3), "2 indices, 3 values"),
        (torch.tensor([1.0]), torch.ones(1), "torch.float32"),
    ],
)
def test_coalesce_validates(indices: torch.Tensor, values: torch.Tensor, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        SparseStream.coalesce(indices, values, 5)


# --- dense conversions and the switch at delta --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, F32, F64])
@pytest.mark.parametrize("shape", [(1,), (7,), (4, 5), (2, 3, 4)])
def test_from_dense_to_dense_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    for keep in (0.0, 0.1, 0.5, 1.0):
        t = torch.randn(shape, generator=g).to(dtype) * (torch.rand(shape, generator=g) < keep)
        s = SparseStream.from_dense(t)
        assert s.dim == t.numel() and s.dtype == dtype
        assert torch.equal(s.to_dense(), t.reshape(-1))
        nz = int(torch.count_nonzero(t))
        assert s.is_dense == (nz >= s.delta)
        if not s.is_dense:
            assert s.nnz == nz
            assert s.indices is not None
            assert s.indices.tolist() == torch.nonzero(t.reshape(-1)).reshape(-1).tolist()


def test_from_dense_does_not_alias_its_input() -> None:
    t = torch.ones(4)
    s = SparseStream.from_dense(t)
    assert s.is_dense
    t[0] = 5.0
    assert s.values[0] == 1.0


def test_from_dense_switches_exactly_at_delta() -> None:
    n = 100
    delta = dense_threshold(n, F32)
    assert delta == 50
    below = torch.zeros(n)
    below[: delta - 1] = 1.0
    at = torch.zeros(n)
    at[:delta] = 1.0
    assert not SparseStream.from_dense(below).is_dense
    assert SparseStream.from_dense(at).is_dense
    forced = SparseStream.from_dense(at, auto_dense=False)
    assert not forced.is_dense and forced.nnz == delta


def test_from_dense_rejects_bad_tensors() -> None:
    with pytest.raises(ValueError, match=re.escape("torch.int64")):
        SparseStream.from_dense(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="dimension 0"):
        SparseStream.from_dense(torch.zeros(0))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1001, 20011, 10**6])
def test_dense_threshold_formula(n: int) -> None:
    """delta = N·isize/(c + isize): int32 indices with float32 -> N/2, float64 -> 2N/3, float16 -> N/3."""
    assert dense_threshold(n, F32) == n // 2
    assert dense_threshold(n, F64) == (2 * n) // 3
    assert dense_threshold(n, torch.float16) == n // 3
    assert dense_threshold(n, torch.bfloat16) == n // 3
    assert SparseStream.empty(n, F64).delta == (2 * n) // 3


def test_nbytes() -> None:
    assert SparseStream(torch.tensor([1, 4, 8]), torch.ones(3), 10).nbytes == 3 * (4 + 4)
    assert SparseStream(torch.tensor([1, 4, 8]), torch.ones(3, dtype=F64), 10).nbytes == 3 * (4 + 8)
    assert SparseStream(torch.tensor([1]), torch.ones(1, dtype=torch.float16), 10).nbytes == 4 + 2
    assert SparseStream(None, torch.ones(10), 10).nbytes == 40
    assert SparseStream(None, torch.ones(10, dtype=F64), 10).nbytes == 80
    assert SparseStream.empty(10).nbytes == 0
    # Below delta the sparse format is strictly smaller. delta is floor(N·isize/(c+isize)), so at delta the dense
    # format is at most one pair's bytes larger (equal when c + isize divides N·isize).
    for n, dt in ((1000, F32), (999, F64), (1001, F64), (1001, F32), (7, torch.float16)):
        s = SparseStream.empty(n, dt)
        isize = torch.empty((), dtype=dt).element_size()
        assert (s.delta - 1) * (4 + isize) < n * isize <= s.delta * (4 + isize) + (4 + isize)
        if n * isize % (4 + isize) == 0:
            assert s.delta * (4 + isize) == n * isize


def test_empty_and_densified_and_repr() -> None:
    e = SparseStream.empty(5, F64)
    assert (e.nnz, e.dim, e.dtype, e.is_dense) == (0, 5, F64, False)
    d = e.densified()
    assert d.is_dense and d.nnz == 5 and d.values.tolist() == [0.0] * 5
    assert d.densified() is d
    s = SparseStream(torch.tensor([2]), torch.tensor([3.0]), 4)
    assert s.densified().values.tolist() == [0.0, 0.0, 3.0, 0.0]
    assert "nnz=1" in repr(s) and "dense" in repr(d) and "dim=4" in repr(s)


# --- slice --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dense", [False, True])
def test_slice_rebases_indices(dense: bool) -> None:
    t = torch.tensor([0.0, 1.0, 0.0, 3.0, 4.0, 0.0, 0.0, 7.0, 0.0, 9.0])
    s = SparseStream(None, t.clone(), 10) if dense else SparseStream.from_dense(t, auto_dense=False)
    assert s.is_dense == dense
    for start, stop in ((0, 10), (0, 1), (3, 5), (2, 3), (5, 7), (4, 10), (9, 10)):
        part = s.slice(start, stop)
        assert part.dim == stop - start and part.is_dense == dense
        assert torch.equal(part.to_dense(), t[start:stop])
        if not dense:
            assert part.indices is not None
            idx = part.indices.tolist()
            assert idx == sorted(set(idx)) and all(0 <= i < stop - start for i in idx)


@pytest.mark.parametrize(("start", "stop"), [(-1, 3), (3, 3), (4, 2), (0, 11), (10, 11)])
def test_slice_rejects_bad_bounds(start: int, stop: int) -> None:
    s = SparseStream.empty(10)
    with pytest.raises(ValueError, match=re.escape(f"[{start}, {stop})")):
        s.slice(start, stop)


# --- add / sum_streams: fixed cases -------------------------------------------------------------------------
def test_add_example_from_docstring() -> None:
    s = SparseStream(torch.tensor([1, 5]), torch.tensor([1.0, 2.0]), dim=8)
    t = SparseStream.from_dense(torch.tensor([0, 3.0, 0, 0, 0, 1.0, 0, 0]))
    assert add(s, t).to_dense().tolist() == [0.0, 4.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0]


def test_add_and_sum_reject_mismatches() -> None:
    a = SparseStream.empty(4)
    with pytest.raises(ValueError, match="dimensions 4 and 5"):
        add(a, SparseStream.empty(5))
    with pytest.raises(ValueError, match=re.escape("torch.float64")):
        add(a, SparseStream.empty(4, F64))
    with pytest.raises(ValueError, match="at least one"):
        sum_streams([])
    with pytest.raises(ValueError, match="5"):
        sum_streams([a, SparseStream.empty(5)])
    with pytest.raises(ValueError, match=re.escape("torch.float64")):
        sum_streams([a, SparseStream.empty(4, F64)])


def test_add_inplace_reuses_a_dense_buffer() -> None:
    a = SparseStream(None, torch.ones(4), 4)
    buf = a.values
    b = SparseStream(torch.tensor([2]), torch.tensor([5.0]), 4)
    r = add(a, b, inplace=True)
    assert r is a and r.values is buf
    assert buf.tolist() == [1.0, 1.0, 6.0, 1.0]
    assert b.values.tolist() == [5.0]


# --- properties vs numpy ------------------------------------------------------------------------------------
KINDS = ("sparse", "from_dense", "dense")


@st.composite
def stream_specs(
    draw: st.DrawFn, dim: int | None = None, dtype: str | None = None
) -> tuple[SparseStream, np.ndarray]:
    """A random stream and its exact numpy vector. Densities include 0 and full; formats include explicit
    sparse streams above delta, ``from_dense`` ones (dense from delta on) and dense ones."""
    dim = dim if dim is not None else draw(st.integers(1, 300))
    dtype = dtype if dtype is not None else draw(st.sampled_from(["float32", "float64"]))
    density = draw(st.sampled_from([0.0, 1.0, 0.01, 0.3, 0.5, 0.7]) | st.floats(0.0, 1.0))
    kind = draw(st.sampled_from(KINDS))
    seed = draw(st.integers(0, 2**32 - 1))
    g = np.random.default_rng(seed)
    mask = g.random(dim) < density
    vals = g.uniform(-10, 10, dim).astype(dtype)
    vals[g.random(dim) < 0.05] = 0.0  # explicit zeros stored in sparse streams
    vec = np.where(mask, vals, 0).astype(dtype)
    if kind == "dense":
        return SparseStream(None, torch.from_numpy(vec.copy()), dim), vec
    if kind == "from_dense":
        return SparseStream.from_dense(torch.from_numpy(vec.copy())), vec
    idx = np.nonzero(mask)[0]
    return SparseStream(torch.from_numpy(idx), torch.from_numpy(vals[idx].copy()), dim), vec


@st.composite
def stream_pairs(draw: st.DrawFn) -> tuple[tuple[SparseStream, np.ndarray], tuple[SparseStream, np.ndarray]]:
    dim = draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    return draw(stream_specs(dim, dtype)), draw(stream_specs(dim, dtype))


def _snapshot(s: SparseStream) -> tuple[bytes | None, bytes]:
    return (None if s.indices is None else s.indices.numpy().tobytes()), s.values.numpy().tobytes()


def _check_well_formed(s: SparseStream) -> None:
    if s.is_dense:
        assert s.indices is None and s.values.shape == (s.dim,)
    else:
        assert s.indices is not None and s.indices.shape == s.values.shape
        SparseStream(s.indices, s.values, s.dim)  # revalidates: sorted, unique, in range


PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(stream_pairs(), st.booleans())
def test_add_matches_numpy(pair: tuple[tuple[SparseStream, np.ndarray], ...], inplace: bool) -> None:
    (a, va), (b, vb) = pair
    before_a, before_b = _snapshot(a), _snapshot(b)
    was = (a.is_dense, b.is_dense, a.nnz, b.nnz, a.delta)
    r = add(a, b, inplace=inplace)
    # One float add per element is exactly rounded: torch and numpy agree to the bit.
    np.testing.assert_array_equal(r.to_dense().numpy(), va + vb)
    assert r.dtype == a.dtype and r.dim == a.dim
    _check_well_formed(r)
    a_dense, b_dense, na, nb, delta = was
    assert r.is_dense == (a_dense or b_dense or na + nb >= delta)
    if not r.is_dense:
        assert a.indices is not None and b.indices is not None and r.indices is not None
        union = set(a.indices.tolist()) | set(b.indices.tolist())
        assert r.indices.tolist() == sorted(union)
    assert _snapshot(b) == before_b
    if inplace and a_dense:
        assert r is a
        np.testing.assert_array_equal(a.values.numpy(), va + vb)
    else:
        assert _snapshot(a) == before_a


@PROPS
@given(stream_pairs())
def test_add_is_bitwise_commutative(pair: tuple[tuple[SparseStream, np.ndarray], ...]) -> None:
    """The collectives rely on this for bitwise identical results on every rank."""
    (a, _), (b, _) = pair
    ab, ba = add(a, b), add(b, a)
    assert ab.is_dense == ba.is_dense
    assert _snapshot(ab) == _snapshot(ba)


@PROPS
@given(st.integers(1, 300), st.sampled_from(["float32", "float64"]), st.integers(1, 6), st.data())
def test_sum_streams_matches_numpy(dim: int, dtype: str, k: int, data: st.DataObject) -> None:
    specs = [data.draw(stream_specs(dim, dtype)) for _ in range(k)]
    streams = [s for s, _ in specs]
    before = [_snapshot(s) for s in streams]
    r = sum_streams(streams)
    want = np.sum([v.astype(np.float64) for _, v in specs], axis=0)
    eps = float(np.finfo(dtype).eps)
    np.testing.assert_allclose(r.to_dense().numpy(), want, rtol=0, atol=k * 10 * k * eps)
    assert r.dtype == streams[0].dtype and r.dim == dim
    _check_well_formed(r)
    total = sum(s.nnz for s in streams)
    assert r.is_dense == (any(s.is_dense for s in streams) or total >= dense_threshold(dim, streams[0].dtype))
    assert [_snapshot(s) for s in streams] == before
    # Summing pairwise gives the same vector (up to rounding) and the same sparsity structure when sparse.
    chained = streams[0]
    for s in streams[1:]:
        chained = add(chained, s)
    np.testing.assert_allclose(chained.to_dense().numpy(), r.to_dense().numpy(), rtol=0, atol=k * 10 * k * eps)


@PROPS
@given(stream_specs())
def test_round_trips(spec: tuple[SparseStream, np.ndarray]) -> None:
    s, v = spec
    np.testing.assert_array_equal(s.to_dense().numpy(), v)
    back = SparseStream.from_dense(s.to_dense())
    np.testing.assert_array_equal(back.to_dense().numpy(), v)
    assert back.is_dense == (np.count_nonzero(v) >= s.delta)
    assert s.nbytes == (s.dim * s.values.element_size() if s.is_dense else s.nnz * (4 + s.values.element_size()))
    if s.dim > 1:
        mid = s.dim // 2
        left, right = s.slice(0, mid), s.slice(mid, s.dim)
        np.testing.assert_array_equal(np.concatenate([left.to_dense().numpy(), right.to_dense().numpy()]), v)


@pytest.mark.parametrize("n", [0, 1, 10, 1000])
def test_device_merge_adds_duplicates_in_input_order(n: int) -> None:
    """The device path of ``merge_rows`` (``_add_in_order``: unique targets per pass) gives the CPU kernel's
    bits, so a sum of P streams on a GPU has the same bits on every rank and as on the CPU."""
    from sparsync.stream import _add_in_order

    g = torch.Generator().manual_seed(n)
    inverse = torch.randint(0, 7, (n,), generator=g)
    rows = torch.randn(n, 3, generator=g)
    want = torch.zeros(7, 3).index_add_(0, inverse, rows)
    got = torch.zeros(7, 3)
    _add_in_order(got, inverse, rows)
    assert torch.equal(got, want)
