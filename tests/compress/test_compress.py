"""Compressors on one process: the properties the papers state, checked exactly or within a stated bound."""

from __future__ import annotations

import copy
import itertools
import math
import mmap
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import HashStore  # type: ignore[attr-defined]  # re-exported from C++

from sparsync import buffers
from sparsync.compress import (
    BF16,
    COMPRESSORS,
    FP16,
    QSGD,
    BlockTopK,
    Context,
    ErrorFeedback,
    Identity,
    RandomK,
    SketchPayload,
    SparsePayload,
    SparseSketch,
    TensorSpec,
    Threshold,
    TopK,
    compressed_allreduce,
    from_spec,
    make,
    sketch_hash,
)
from sparsync.compress import qsgd as qsgd_mod
from sparsync.compress import qsgd_kernels as qk
from sparsync.compress import sketch as sk_mod
from sparsync.compress import threshold as threshold_mod
from sparsync.compress import topk as topk_mod
from sparsync.compress.qsgd_allreduce import concat_payloads, encode_remote, partitions, simulate, slice_payload

ALL = {
    "identity": Identity(),
    "fp16": FP16(),
    "bf16": BF16(),
    "topk": TopK(0.05),
    "topk_bucket": TopK(0.05, bucket=64),
    "threshold": Threshold(0.05, lifespan=3),
    "randomk": RandomK(0.05),
    "qsgd": QSGD(bits=4, bucket=64),
    "sketch": SparseSketch(rows=3, cols=200),
    "blocktopk": BlockTopK(0.1, block=16),
}
SPARSIFIERS = ("topk", "topk_bucket", "threshold", "randomk", "blocktopk")


W = Context("w")


def roundtrip(c: object, x: torch.Tensor, ctx: Context = W) -> torch.Tensor:
    p = c.compress(x, ctx)  # type: ignore[attr-defined]
    return c.decompress(p, TensorSpec.of(x))  # type: ignore[attr-defined, no-any-return]


# --- registry and validation --------------------------------------------------------------------------------
def test_registry_has_every_compressor_and_rejects_unknown_names() -> None:
    assert set(COMPRESSORS) == {
        "identity",
        "fp16",
        "bf16",
        "topk",
        "threshold",
        "randomk",
        "qsgd",
        "sketch",
        "blocktopk",
        "powersgd",
    }
    with pytest.raises(KeyError, match="bogus") as ei:
        make("bogus")
    for name in COMPRESSORS:
        assert name in str(ei.value)
    assert make("topk", ratio=0.1).ratio == 0.1  # type: ignore[attr-defined]
    c = from_spec("threshold:ratio=0.01,lifespan=1000")
    assert isinstance(c, Threshold) and c.ratio == 0.01 and c.lifespan == 1000
    assert isinstance(from_spec("qsgd:bits=8,scale=l2"), QSGD)
    with pytest.raises(TypeError, match="topk"):
        make("topk", ratio=0.1, bogus=3)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: TopK(0.0), "ratio"),
        (lambda: TopK(1.5), "ratio"),
        (lambda: TopK(0.1, bucket=0), "bucket"),
        (lambda: Threshold(0.1, lifespan=0), "lifespan"),
        (lambda: RandomK(-1), "ratio"),
        (lambda: QSGD(bits=3), "bits"),
        (lambda: QSGD(scale="l1"), "scale"),  # type: ignore[arg-type]
        (lambda: QSGD(kernels="asm"), "kernels"),  # type: ignore[arg-type]
        (lambda: SparseSketch(), "cols"),
        (lambda: SparseSketch(cols=10, ratio=0.1), "cols"),
        (lambda: SparseSketch(rows=0, cols=10), "rows"),
        (lambda: SparseSketch(cols=10, kernels="asm"), "kernels"),
        (lambda: Threshold(0.1, kernels="asm"), "kernels"),
        (lambda: BlockTopK(0.1, block=0), "block"),
        (lambda: ErrorFeedback(decay=2.0), "decay"),
    ],
)
def test_bad_settings_raise_value_errors_naming_them(factory: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory()  # type: ignore[operator]


# --- S2 sketch ----------------------------------------------------------------------------------------------
MODES = pytest.mark.parametrize("mode", sk_mod.HASHES)


def _int_grad(seed: int, n: int = 4000, density: float = 0.05) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-50, 51, (n,), generator=g).to(torch.float32)
    return x * (torch.rand(n, generator=g) < density)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@MODES
def test_sketch_is_linear_exactly(dtype: torch.dtype, mode: str) -> None:
    """S2 §3.1: sketch(g1) + sketch(g2) == sketch(g1 + g2) (integer values: every sum is exact)."""
    c = SparseSketch(rows=3, cols=97, block=8, seed=5, hash=mode)
    gs = [_int_grad(s).to(dtype) for s in range(4)]
    parts = [c.compress(g) for g in gs]
    whole = c.compress(sum(gs))  # type: ignore[arg-type]
    assert torch.equal(sum(p.table for p in parts), whole.table)  # type: ignore[misc]
    # The bitmap adds as counts: its support is the union of the supports.
    support = sum(p.bitmap for p in parts) > 0  # type: ignore[operator]
    union = torch.stack([(g.reshape(-1, 8) != 0).any(1) for g in gs]).any(0)
    assert torch.equal(support, union)


@MODES
def test_sketch_of_coo_rows_equals_sketch_of_dense(mode: str) -> None:
    emb = torch.zeros(50, 6)
    emb[[3, 7, 9]] = torch.arange(18, dtype=torch.float32).reshape(3, 6) - 8
    c = SparseSketch(rows=3, cols=40, hash=mode)
    a, b = c.compress(emb), c.compress(emb.to_sparse(1))
    assert torch.equal(a.table, b.table) and torch.equal(a.bitmap, b.bitmap)
    out = c.decompress(b, TensorSpec.of(emb.to_sparse(1)))
    assert out.is_sparse and set(out.coalesce().indices()[0].tolist()) == {3, 7, 9}


@MODES
def test_sketch_without_collisions_is_exact(mode: str) -> None:
    g = torch.zeros(1000)
    g[[5, 400, 999]] = torch.tensor([1.5, -2.0, 3.25])
    out = roundtrip(SparseSketch(rows=3, cols=100_000, block=1, hash=mode), g)
    assert torch.equal(out, g)


@pytest.mark.parametrize("rows", [1, 3, 4])
@MODES
def test_sketch_query_is_unbiased(rows: int, mode: str) -> None:
    """S2 Thm. 1: E[ĝ] = g over the random hashes. Mean of the error over 400 seeds, per coordinate, within 5
    standard errors (with the per-coordinate spread measured from the same runs)."""
    g = torch.zeros(256)
    gen = torch.Generator().manual_seed(1)
    nz = torch.randperm(256, generator=gen)[:64]
    g[nz] = torch.randn(64, generator=gen) * 3
    runs = torch.stack(
        [roundtrip(SparseSketch(rows=rows, cols=24, block=1, seed=s, hash=mode), g)[nz] for s in range(400)]
    ).double()
    err = runs - g[nz].double()
    se = err.std(0) / math.sqrt(runs.shape[0])
    z = err.mean(0) / se.clamp_min(1e-12)
    assert float(err.abs().max()) > 0.1  # there are collisions: the check below is not trivial
    assert float(z.abs().max()) < 5.0, f"max |z| = {float(z.abs().max()):.2f}"
    # and the whole error averages to zero (a single z-test on the mean over coordinates)
    assert abs(float(z.mean())) * math.sqrt(z.numel()) < 5.0


def test_sketch_ratio_sets_width() -> None:
    assert SparseSketch(rows=2, ratio=0.01).width(10_000) == 50
    assert SparseSketch(rows=3, cols=7).width(10**9) == 7


def test_sketch_block_hash_rounds_the_table_to_whole_blocks() -> None:
    assert SparseSketch(rows=2, ratio=0.01).table_cols((10_000,)) == 64  # width 50, one bucket of 64
    assert SparseSketch(rows=2, ratio=0.01, hash="element").table_cols((10_000,)) == 50
    assert SparseSketch(rows=3, cols=100).table_cols((500, 48)) == 144  # three buckets of one 48-wide row
    sk = SparseSketch(rows=3, cols=100)
    assert sk.compress(torch.randn(500, 48)).table.shape == (3, 144)
    with pytest.raises(ValueError, match=r"hash must be one of .* got 'row'"):
        SparseSketch(cols=10, hash="row")
    with pytest.raises(ValueError, match="150 columns are not whole blocks of 48"):
        sk.decompress(SketchPayload(torch.ones(500), torch.zeros(3, 150)), TensorSpec.of(torch.zeros(500, 48)))


@MODES
@pytest.mark.parametrize("n", [1000, 64 * 5, 1])  # a short last block, whole blocks, a tensor shorter than one
def test_sketch_short_last_block_and_element_coo_are_exact_without_collisions(mode: str, n: int) -> None:
    g = torch.zeros(n)
    g[torch.randperm(n, generator=torch.Generator().manual_seed(n))[: max(1, n // 7)]] = 1.5
    g[-1] = -2.0  # the short last block is set
    big = SparseSketch(rows=3, cols=1 << 22, seed=3, hash=mode)
    assert torch.equal(roundtrip(big, g), g)
    assert torch.equal(roundtrip(big, g.to_sparse()).to_dense(), g)  # element COO: blocks regrouped
    m = torch.zeros(40, 6)
    m[[1, 7, 39], [0, 5, 2]] = torch.tensor([1.0, -3.0, 4.5])
    out = roundtrip(big, m.to_sparse())  # a 2-D COO of elements (sparse_dim 2), blocks of one row
    assert out.is_sparse and torch.equal(out.to_dense(), m)


@MODES
def test_sketch_dense_and_index_paths_agree_across_chunks(mode: str) -> None:
    """The hashes of a run of positions (a dense tensor with every block set) and of an index list (COO, or
    a bitmap with gaps) are the same function: equal tables, and equal queries where both are queried."""
    n = 2 * sk_mod.CHUNK + 1234
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    c = SparseSketch(rows=3, cols=5000, seed=9, hash=mode)
    dense, coo = c.compress(x), c.compress(x.to_sparse())
    assert torch.equal(dense.table, coo.table) and torch.equal(dense.bitmap, coo.bitmap)
    spec = TensorSpec.of(x)
    full = c.decompress(dense, spec)
    gap = SketchPayload(dense.bitmap.clone(), dense.table)
    gap.bitmap[5] = 0  # one block missing: the index path
    part = c.decompress(gap, spec)
    keep = torch.ones(n, dtype=torch.bool)
    keep[5 * sk_mod.FLAT_BLOCK : 6 * sk_mod.FLAT_BLOCK] = False
    assert torch.equal(part[keep], full[keep]) and not part[~keep].any()


def test_sketch_hash_signs_and_buckets_are_pairwise_independent() -> None:
    """Over 2000 seeds: for pairs of indices (neighbours, far apart, equal low bits) the signs are
    uncorrelated and collide in a bucket with probability 1/c, each within 5 standard errors."""
    c, seeds = 50, 2000
    idx = torch.tensor([0, 1, 2, 3, 1 << 20, (1 << 20) + 1, 1 << 31, 12345], dtype=torch.int64)
    signs, buckets = [], []
    for seed in range(seeds):
        h = sketch_hash.Hasher(1, seed, c, torch.float32)
        b, sign = h.row(idx, idx.numel(), 0)
        buckets.append(b.clone())
        signs.append(torch.where(sign < 0, -1.0, 1.0))
    s, bk = torch.stack(signs), torch.stack(buckets)
    assert int(bk.min()) >= 0 and int(bk.max()) < c
    se = 1 / math.sqrt(seeds)
    assert float(s.mean(0).abs().max()) < 5 * se  # each sign is fair
    for i in range(idx.numel()):
        for j in range(i + 1, idx.numel()):
            assert abs(float((s[:, i] * s[:, j]).mean())) < 5 * se, (i, j)
            p = float((bk[:, i] == bk[:, j]).double().mean())
            assert abs(p - 1 / c) < 5 * math.sqrt(1 / c / seeds), (i, j, p)


# An embedding gradient (uncoalesced COO, one block per row) is compressed from its rows and
# decompressed into rows, never through a dense table or a per-element regrouping.
def _embedding_grad(rows: int, dim: int, tokens: int, seed: int) -> torch.Tensor:
    """An nn.Embedding(sparse=True) gradient: uncoalesced, repeated ids."""
    emb = torch.nn.Embedding(rows, dim, sparse=True)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows // 4, (tokens,), generator=g) * 3  # every third row of the first quarter
    (emb(ids) * torch.randn(tokens, dim, generator=g)).sum().backward()
    grad = emb.weight.grad
    assert grad is not None and grad.is_sparse and not grad.is_coalesced()
    return grad


def test_sketch_row_runs_hash_like_element_indices() -> None:
    """A run of whole blocks (block·w + t) and the same positions as an index list get the same hashes."""
    blocks = torch.tensor([0, 3, 7, 1000, (1 << 25) + 5], dtype=torch.int64)
    w = 96
    idx = (blocks[:, None] * w + torch.arange(w)).reshape(-1)
    h = sketch_hash.Hasher(4, 3, 777, torch.float32)
    for j in range(4):
        b1, s1 = (t.clone() for t in h.row(sketch_hash.RowRun(blocks, w), idx.numel(), j))
        b2, s2 = h.row(idx, idx.numel(), j)
        assert torch.equal(b1, b2) and torch.equal(s1, s2)


@pytest.mark.parametrize("dim", [64, 20])  # 64: CHUNK // dim rows per run; 20: runs that do not divide CHUNK
@MODES
def test_sketch_of_embedding_gradient_matches_dense_across_chunks(dim: int, mode: str) -> None:
    grad = _embedding_grad(3000, dim, 5000, seed=dim)  # ~750 rows x dim > one CHUNK of indices
    dense = grad.to_dense()
    c = SparseSketch(rows=3, cols=4000, seed=1, hash=mode)
    a, b = c.compress(dense), c.compress(grad)
    assert torch.equal(a.bitmap, b.bitmap)
    torch.testing.assert_close(a.table, b.table, rtol=1e-5, atol=1e-5)  # summation order of repeated ids
    out = c.decompress(b, TensorSpec.of(grad))
    assert out.is_sparse and out.is_coalesced()
    rows = torch.unique(grad.coalesce().indices()[0])
    assert torch.equal(out.indices()[0], rows)  # exactly the set rows, in order
    torch.testing.assert_close(out.to_dense(), c.decompress(b, TensorSpec.of(dense)))
    # and no collisions: exact
    big = SparseSketch(rows=3, cols=1 << 22, seed=1, hash=mode)
    torch.testing.assert_close(roundtrip(big, grad).to_dense(), dense, rtol=1e-5, atol=1e-5)


@MODES
def test_sketch_dense_gap_path_uses_row_runs(mode: str) -> None:
    """A dense tensor of whole blocks with a gap: the row-run path queries the same values as the full path."""
    n = 2 * sk_mod.CHUNK + 20 * sk_mod.FLAT_BLOCK
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    x[7 * sk_mod.FLAT_BLOCK : 8 * sk_mod.FLAT_BLOCK] = 0
    c = SparseSketch(rows=3, cols=5000, seed=2, hash=mode)
    p = c.compress(x)
    assert int(p.bitmap.sum()) == n // sk_mod.FLAT_BLOCK - 1
    full = c.decompress(SketchPayload(torch.ones_like(p.bitmap), p.table), TensorSpec.of(x))
    part = c.decompress(p, TensorSpec.of(x))
    keep = x != 0
    assert torch.equal(part[keep], full[keep]) and not part[~keep].any()


@MODES
def test_sketch_query_of_embedding_rows_is_unbiased(mode: str) -> None:
    """S2 Thm. 1 on the COO path: E[ĝ] = g over the hashes, for the rows of an embedding gradient."""
    grad = _embedding_grad(64, 4, 40, seed=0)
    want = grad.coalesce().values().double()
    runs = torch.stack(
        [roundtrip(SparseSketch(rows=3, cols=16, seed=s, hash=mode), grad).values() for s in range(400)]
    )
    err = runs.double() - want
    se = err.std(0) / math.sqrt(runs.shape[0])
    z = err.mean(0) / se.clamp_min(1e-12)
    assert float(err.abs().max()) > 0.1  # collisions: not trivially exact
    assert float(z.abs().max()) < 5.0, f"max |z| = {float(z.abs().max()):.2f}"
    assert abs(float(z.mean())) * math.sqrt(z.numel()) < 5.0


def test_sketch_c_kernels_are_built() -> None:
    assert sketch_hash.native_available(), "sparsync.compress._sketch_c is not built: run `make setup` (needs gcc)"


@MODES
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_sketch_c_and_torch_kernels_agree(mode: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same table (bitwise: the same sums in the same order) and the same estimates from the C kernels as
    from the torch ones, on every path: dense (every block set, gaps, a short last block), COO rows of an
    embedding gradient, COO elements (rows wider than a block), float64; odd and even row counts (median).
    A spy checks that the C kernels did run."""
    used = _spy(monkeypatch, sketch_hash)
    g = torch.Generator().manual_seed(rows)
    gap = torch.randn(3 * sk_mod.CHUNK + 77, generator=g)
    gap[1000:90_000] = 0
    inputs = [
        torch.randn(2 * sk_mod.CHUNK + 5, generator=g),
        gap,
        torch.randn(300, 20, generator=g).double(),
        _embedding_grad(3000, 64, 5000, seed=rows),
        _embedding_grad(3000, 20, 2000, seed=rows + 1),
    ]
    for x in inputs:
        for kw in ({"ratio": 0.05}, {"ratio": 0.05, "block": 7}):
            c = SparseSketch(rows=rows, seed=3, hash=mode, kernels="c", **kw)  # type: ignore[arg-type]
            t = SparseSketch(rows=rows, seed=3, hash=mode, kernels="torch", **kw)  # type: ignore[arg-type]
            pc, pt = c.compress(x), t.compress(x)
            assert torch.equal(pc.bitmap, pt.bitmap) and torch.equal(pc.table, pt.table), (x.shape, kw)
            yc, yt = c.decompress(pc, TensorSpec.of(x)), t.decompress(pc, TensorSpec.of(x))
            if x.is_sparse:
                assert torch.equal(yc.indices(), yt.indices())
                yc, yt = yc.values(), yt.values()
            assert torch.equal(yc, yt), (x.shape, kw)
    want = {"insert_blocks", "query_blocks"} if mode == "block" else {"insert", "query"}
    assert want <= used


def _spy(monkeypatch: pytest.MonkeyPatch, module: object) -> set[str]:
    """Replace ``module._native`` (a C extension) by a proxy recording which of its functions were called."""
    real, used = module._native, set()  # type: ignore[attr-defined]

    class Spy:
        def __getattr__(self, name: str) -> object:
            used.add(name)
            return getattr(real, name)

    monkeypatch.setattr(module, "_native", Spy())
    return used


@pytest.mark.parametrize("r", range(1, 11))
def test_median_of_rows(r: int) -> None:
    est = torch.randn(r, 1001, generator=torch.Generator().manual_seed(r))
    srt = est.sort(0).values
    want = srt[r // 2] if r % 2 else (srt[r // 2 - 1] + srt[r // 2]) / 2
    out = torch.empty(1001)
    sketch_hash.median_rows(est.clone(), out)
    assert torch.allclose(out, want, rtol=0, atol=1e-6)


# --- QSGD ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_packs_bits(bits: int) -> None:
    x = torch.randn(1000)
    p = QSGD(bits=bits, bucket=100).compress(x)
    assert p.codes.dtype == torch.uint8 and p.codes.numel() == math.ceil(1000 * bits / 8)
    assert p.nbytes == math.ceil(1000 * bits / 8) + 10 * 4
    odd = QSGD(bits=bits, bucket=100).compress(torch.randn(1001))  # 11 buckets, the last one of 1 value
    assert odd.nbytes == math.ceil(1001 * bits / 8) + 11 * 4
    y = roundtrip(QSGD(bits=bits, bucket=100), x)
    s = 2 ** (bits - 1) - 1
    levels = (y.reshape(10, 100) / p.scales[:, None] * s).round()
    assert torch.allclose(y.reshape(10, 100), levels * p.scales[:, None] / s, atol=1e-6)


@pytest.mark.parametrize("scale", ["max", "l2"])
def test_qsgd_is_unbiased_and_within_its_variance_bound(scale: str) -> None:
    torch.manual_seed(0)
    n, B, T = 512, 128, 2000
    x = torch.randn(n) * torch.linspace(0.1, 3, n)
    c = QSGD(bits=4, bucket=B, scale=scale)  # type: ignore[arg-type]
    ys = torch.stack([roundtrip(c, x) for _ in range(T)]).double()
    err = ys - x.double()
    # variance: exact expectation sum (S/s)^2 p(1-p) per bucket, and the closed-form bounds
    s = 7
    xb = x.double().reshape(-1, B)
    S = xb.abs().amax(1) if scale == "max" else xb.norm(dim=1)
    lev = xb.abs() * s / S[:, None]
    p = lev - lev.floor()
    var = ((S[:, None] / s) ** 2 * p * (1 - p)).reshape(-1)
    exact = float(var.sum())
    # unbiased: every coordinate's mean error within 5 standard errors of the exact variance (plus float
    # rounding for coordinates on a grid point, such as the bucket maximum with scale="max")
    z = err.mean(0) / ((var / T).sqrt() + 1e-6)
    assert float(z.abs().max()) < 5.0
    measured = float((err**2).sum(1).mean())
    assert abs(measured - exact) < 0.1 * exact
    if scale == "l2":  # QSGD Lemma 3.1, per bucket
        bound = float((min(B / s**2, math.sqrt(B) / s) * xb.norm(dim=1) ** 2).sum())
    else:
        bound = float((B * S**2 / (4 * s**2)).sum())
    assert measured <= bound


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("bucket", [100, 512, 7])
def test_qsgd_chunked_kernels_round_to_the_grid(bits: int, bucket: int) -> None:
    """Across kernel chunks and a short last bucket: every decoded value is one of the two grid points around
    its input, and the decode of a sum of payloads is the sum of the decodes."""
    n = 2 * qsgd_mod.CHUNK + 3 * bucket + 5
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    q = QSGD(bits=bits, bucket=bucket)
    p = q.compress(x)
    assert p.codes.numel() == math.ceil(n * bits / 8) and p.scales.numel() == math.ceil(n / bucket)
    y = q.decompress(p, TensorSpec.of(x))
    step = (p.scales / q.levels).repeat_interleave(bucket)[:n]
    lev, got = x / step, y / step
    assert bool(((got - got.round()).abs() < 1e-3).all())
    assert bool((got.round() >= lev.floor() - 1e-3).all() and (got.round() <= lev.ceil() + 1e-3).all())
    p2 = q.compress(x.flip(0))
    both = q.decompress_gathered([p, p2], TensorSpec.of(x))
    assert torch.allclose(both, y + q.decompress(p2, TensorSpec.of(x)), atol=1e-5)


@pytest.mark.parametrize("mode", ["block", "element"])
def test_sketch_passes_of_a_gpus_size_give_the_same_sketch(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Off the host the sketch's kernels take DEVICE_CHUNK keys per pass (``chunk_for``); forced on the host
    (torch kernels), the tables and estimates equal those of cache-sized passes: dense with gaps and a short
    last block, COO rows."""
    g = torch.Generator().manual_seed(4)
    gap = torch.randn(3 * sk_mod.CHUNK + 77, generator=g)
    gap[1000:90_000] = 0
    inputs = [torch.randn(2 * sk_mod.CHUNK + 5, generator=g), gap, _embedding_grad(3000, 64, 5000, seed=4)]

    def run() -> list[torch.Tensor]:
        out = []
        for x in inputs:
            for kw in ({"ratio": 0.05}, {"ratio": 0.05, "block": 7}):
                c = SparseSketch(rows=3, seed=3, hash=mode, kernels="torch", **kw)  # type: ignore[arg-type]
                p = c.compress(x)
                y = c.decompress(p, TensorSpec.of(x))
                out += [p.bitmap, p.table, y.to_dense() if y.is_sparse else y]
        return out

    small = run()
    monkeypatch.setattr(sk_mod, "chunk_for", lambda device, host=0: 4 * sk_mod.CHUNK + 3)
    assert all(torch.equal(a, b) for a, b in zip(run(), small, strict=True))


@pytest.mark.parametrize("n", [1, 1000, 300_001])
def test_gpu_selection_paths_equal_the_host_ones(n: int) -> None:
    """The selections a GPU runs (the smallest of ``topk`` for ``kthvalue``; the threshold's one-pass mask),
    forced on the host, equal the host's: ties, zeros and τ = 0 included."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-50, 50, (n,), generator=g).to(torch.float32)  # many ties and zeros
    mag = x.abs()
    for r in {1, max(1, n // 3), n}:
        assert float(topk_mod.kth_smallest(mag, r, by_topk=True)) == float(mag.kthvalue(r).values)
    for k in {1, max(1, n // 100), n}:
        want = threshold_mod.kth_largest(mag, k, by_topk=False)
        assert threshold_mod.kth_largest(mag, k, by_topk=True) == want
        for tau in (want, 0.0):
            chunked = threshold_mod._mask_positions(x, tau, native=False, one_pass=False)
            assert torch.equal(threshold_mod._mask_positions(x, tau, native=False, one_pass=True), chunked)


@pytest.mark.parametrize(("bits", "bucket"), [(4, 512), (4, 101), (2, 7)])
def test_qsgd_passes_of_several_noise_chunks_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, bits: int, bucket: int
) -> None:
    """A GPU's torch kernels cover several noise chunks per pass (``chunks_per_pass``); the bits (encode, the
    sum of decodes, re-quantization) equal those of one chunk per pass. Bucket 101 at 4 bits: chunks that
    start inside a noise word (the chunk-by-chunk noise)."""
    n = 2 * qsgd_mod.CHUNK + 3 * bucket + 5
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    q = QSGD(bits=bits, bucket=bucket, kernels="torch")
    if bucket == 101:
        assert q.chunk_step() % 4 != 0

    def run() -> tuple[torch.Tensor, ...]:
        p, p2 = q.compress(x, Context("a", 0, 1)), q.compress(x.flip(0), Context("b", 0, 1))
        s = q.sum_requantize([p, p2], n, torch.Generator().manual_seed(3))
        return p.codes, p.scales, q.decompress_gathered([p, p2], TensorSpec.of(x)), s.codes, s.scales

    one = run()
    monkeypatch.setattr(qk, "chunks_per_pass", lambda device: 2)
    q = QSGD(bits=bits, bucket=bucket, kernels="torch")
    assert qk.Workspace(q, n).pass_values == 2 * q.chunk_step()
    two = run()
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


@pytest.mark.parametrize(
    ("bits", "bucket", "n", "P"), [(4, 512, 10_000, 3), (2, 7, 1001, 5), (4, 3, 50, 8), (8, 64, 64, 4)]
)
def test_qsgd_partitions_are_whole_byte_aligned_buckets(bits: int, bucket: int, n: int, P: int) -> None:
    q = QSGD(bits=bits, bucket=bucket)
    parts = partitions(q, n, P)
    assert len(parts) == P and parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    for lo, _ in parts:
        assert lo == n or (lo % bucket == 0 and lo * bits % 8 == 0)
    sizes = [hi - lo for lo, hi in parts]
    assert sizes == sorted(sizes, reverse=True)  # equal partitions, the last ones clipped to n
    assert sizes[0] < (math.ceil(math.ceil(n / bucket) / P) + q.unit()) * bucket  # within one unit of 1/P
    p = q.compress(torch.randn(n))
    pieces = [slice_payload(q, p, lo, hi) for lo, hi in parts]
    whole = concat_payloads(pieces)
    assert torch.equal(whole.codes, p.codes) and torch.equal(whole.scales, p.scales)


def test_qsgd_requantized_sum_is_unbiased_within_its_variance_bound() -> None:
    """qsgd_allreduce's variance bound, single-process (``simulate``, 4 virtual ranks, 400 seeds): the mean
    is within 5 standard errors of the exact sum per value, and the measured variance lies between the
    first stage's exact variance (every rank's rounding but the owner's: its own partition travels exactly)
    and the bound (first stage + (Σ_r M_rb)²/(4s²))."""
    P, B, n, T, s = 4, 32, 200, 400, 7
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(P)]
    ys = []
    for seed in range(T):
        q = QSGD(bits=4, bucket=B, seed=seed)
        ctxs = [Context("w", r, P) for r in range(P)]
        sent = [encode_remote(q, x, n, c, P) for x, c in zip(xs, ctxs, strict=True)]
        ys.append(simulate(q, sent, xs, ctxs).double())
    y = torch.stack(ys)
    exact = sum(x.double() for x in xs)
    owner = torch.cat([torch.full((hi - lo,), j) for j, (lo, hi) in enumerate(partitions(QSGD(bucket=B), n, P))])
    first, maxsum = _qsgd_variance_terms(xs, B, s, owner)
    bound = first + maxsum**2 / (4 * s**2)
    z = (y.mean(0) - exact) / ((bound / T).sqrt() + 1e-6)  # type: ignore[operator]
    assert float(z.abs().max()) < 5.0
    measured = float(y.var(0).sum())
    assert float(first.sum()) < measured <= 1.1 * float(bound.sum())


def _qsgd_variance_terms(
    xs: list[torch.Tensor], B: int, s: int, owner: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value: Σ_r of the exact variance of one rounding (scale="max"), leaving out rank ``owner[i]`` (the
    rank that does not round value i), and Σ_r of the bucket maxima."""
    first = torch.zeros(xs[0].numel(), dtype=torch.float64)
    maxsum = torch.zeros_like(first)
    for r, x in enumerate(xs):
        xd = x.double()
        pad = torch.nn.functional.pad(xd.abs(), (0, -xd.numel() % B)).reshape(-1, B)
        M = pad.amax(1).repeat_interleave(B)[: xd.numel()]
        lev = xd.abs() * s / M
        p = lev - lev.floor()
        var = (M / s) ** 2 * p * (1 - p)
        first += var if owner is None else var * (owner != r)
        maxsum += M
    return first, maxsum


def test_qsgd_rounding_differs_between_ranks() -> None:
    x = torch.randn(4096)
    c = QSGD()
    a = c.decompress(c.compress(x, Context("w", 0, 2)), TensorSpec.of(x))
    b = c.decompress(c.compress(x, Context("w", 1, 2)), TensorSpec.of(x))
    assert not torch.equal(a, b)


def test_qsgd_c_kernels_are_built() -> None:
    """`pip install -e .` (make setup) compiles them; without them QSGD falls back to the torch kernels, and the
    tests below would compare torch with itself."""
    assert qk.native_available(), "sparsync.compress._qsgd_c is not built: run `make setup` (needs gcc)"


def test_without_the_c_kernels_auto_falls_back_and_c_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine where `pip install` found no compiler: `kernels="auto"` gives what the C kernels give,
    `kernels="c"` raises naming the extension."""
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(2))
    runs = [  # fresh compressors each time: the same generator state and threshold schedule
        lambda: QSGD(bits=4).compress(x, Context("w", 0, 2)).codes,
        lambda: SparseSketch(ratio=0.1).compress(x).table,
        lambda: Threshold(0.01).compress(x, Context("w")).stream.indices,
    ]
    with_c = [run() for run in runs]
    for module in (qk, sketch_hash, threshold_mod):
        monkeypatch.setattr(module, "_native", None)
    for run, want in zip(runs, with_c, strict=True):
        assert torch.equal(run(), want)
    for build, ext in (
        (lambda: QSGD(kernels="c"), "_qsgd_c"),
        (lambda: SparseSketch(ratio=0.1, kernels="c"), "_sketch_c"),
        (lambda: Threshold(0.01, kernels="c"), "_threshold_c"),
    ):
        with pytest.raises(RuntimeError, match=ext):
            build()


def test_qsgd_noise_words_are_splitmix64_of_the_counter() -> None:
    """The torch stream (int64 arithmetic, arithmetic shifts masked) against splitmix64 in Python integers."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    for seed in (0, 1, 2**63 + 12345, mask):
        got = [w & mask for w in qk.noise_words(seed, 9).tolist()]
        assert got == [mix((seed + (w + 1) * 0x9E3779B97F4A7C15) & mask) for w in range(9)]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(
    ("bucket", "n"), [(512, 2 * qsgd_mod.CHUNK + 777), (100, 1001), (7, 12345), (1, 33), (3, 1)]
)
def test_qsgd_c_and_torch_kernels_give_the_same_bits(
    bits: int, bucket: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encode, decode-sum of three payloads, and the re-quantization of an exact term plus two payloads: the C
    kernels give bit for bit the torch kernels' result (zero buckets, a short last bucket, buckets that do not
    start on a byte, several chunks, a bf16 and a strided input)."""
    used = _spy(monkeypatch, qk)
    g = torch.Generator().manual_seed(bits * 1000 + bucket)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 1e3
    x[: 2 * bucket] = 0.0
    qc = QSGD(bits=bits, bucket=bucket, kernels="c")
    qt = QSGD(bits=bits, bucket=bucket, kernels="torch")
    strided = torch.randn(2 * n, generator=g)[::2]
    for inp in (x, x.to(torch.bfloat16), strided):
        pc, pt = qc.compress(inp, Context("w", 1, 3)), qt.compress(inp, Context("w", 1, 3))
        assert torch.equal(pc.codes, pt.codes) and torch.equal(pc.scales, pt.scales)
    p2 = qc.compress(x.flip(0), Context("v", 0, 3))
    for q in (qc, qt):  # each decodes what the other encoded: both sums the same bits
        assert torch.equal(q.decode_sum([pc, pt, p2], n), qt.decode_sum([pc, pt, p2], n))
    exact = torch.randn(n, generator=g)
    rc = qc.sum_requantize([pc, p2], n, qc.generator(Context("w", 0, 3), 1), exact)
    rt = qt.sum_requantize([pc, p2], n, qt.generator(Context("w", 0, 3), 1), exact)
    assert torch.equal(rc.codes, rt.codes) and torch.equal(rc.scales, rt.scales)
    assert used == {"encode", "decode_sum"}  # the C kernels ran


@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_qsgd_non_finite_values_give_a_non_finite_scale(kernels: str) -> None:
    """NaN and inf reach the result through their bucket's scale (the codes of such a bucket are not defined);
    the other buckets are untouched."""
    q = QSGD(bits=4, bucket=8, kernels=kernels)  # type: ignore[arg-type]
    x = torch.linspace(-1, 1, 32)
    x[3], x[20] = float("nan"), float("inf")
    p = q.compress(x)
    assert math.isnan(float(p.scales[0])) and math.isinf(float(p.scales[2]))
    assert torch.equal(p.scales[[1, 3]], x.view(4, 8)[[1, 3]].abs().amax(1))


# --- sparsifiers --------------------------------------------------------------------------------------------
def test_topk_keeps_the_largest() -> None:
    x = torch.tensor([0.1, -5.0, 2.0, 0.0, 3.0, -0.5])
    p = TopK(0.5).compress(x)
    assert isinstance(p, SparsePayload) and p.stream.indices is not None
    assert p.stream.indices.tolist() == [1, 2, 4]
    assert p.nbytes == 3 * (4 + 4)


def test_bucketed_topk_takes_k_per_bucket() -> None:
    x = torch.randn(1000)
    p = TopK(0.02, bucket=100).compress(x)  # 2 of each of 10 buckets
    assert p.stream.indices is not None
    idx = p.stream.indices.long()
    assert torch.equal(torch.bincount(idx // 100, minlength=10), torch.full((10,), 2))
    for b in range(10):
        seg = x[b * 100 : (b + 1) * 100].abs()
        assert set((idx[idx // 100 == b] - b * 100).tolist()) == set(seg.topk(2).indices.tolist())


def test_randomk_is_unbiased() -> None:
    x = torch.randn(200)
    c = RandomK(0.1, seed=3)
    ys = torch.stack([roundtrip(c, x) for _ in range(3000)]).double()  # fresh coordinates every call
    se = ys.std(0) / math.sqrt(ys.shape[0])
    assert float(((ys.mean(0) - x.double()) / se).abs().max()) < 5.0


def test_randomk_picks_the_same_coordinates_on_every_rank_when_shared() -> None:
    x = torch.randn(500)
    a = RandomK(0.1).compress(x, Context("w", 0, 3))
    b = RandomK(0.1).compress(x, Context("w", 2, 3))
    assert a.stream.indices is not None and b.stream.indices is not None
    assert torch.equal(a.stream.indices, b.stream.indices)
    c = RandomK(0.1, shared=False).compress(x, Context("w", 2, 3))
    assert c.stream.indices is not None and not torch.equal(a.stream.indices, c.stream.indices)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 600), st.floats(0.001, 1.0), st.integers(0, 2**31 - 1))
def test_sparsifiers_are_contractions(n: int, ratio: float, seed: int) -> None:
    """Stich et al. 2018 Def. 2.1 (used by DCT §2.1): ‖x - C(x)‖² ≤ (1 - δ)‖x‖²."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    nx = float(x.norm() ** 2)
    k = max(1, math.ceil(ratio * n))
    assert float((x - roundtrip(TopK(ratio), x)).norm() ** 2) <= (1 - k / n) * nx + 1e-9
    kb = max(1, math.ceil(ratio * 32))
    y = roundtrip(TopK(ratio, bucket=32), x)
    assert float((x - y).norm() ** 2) <= (1 - min(kb, 32) / 32) * nx + 1e-9 or n <= 32
    th = Threshold(ratio, lifespan=1)
    y = roundtrip(th, x)
    kept = int((y != 0).sum())
    assert kept >= k and float((x - y).norm() ** 2) <= (1 - kept / n) * nx + 1e-9
    nb = -(-n // 16)
    y = roundtrip(BlockTopK(ratio, block=16), x)
    assert float((x - y).norm() ** 2) <= (1 - max(1, math.ceil(ratio * nb)) / nb) * nx + 1e-9


def test_threshold_is_recomputed_every_lifespan_calls() -> None:
    """DCT Alg. 1 lines 3-8 (``slack=None``): τ from |g| when L divides the call number, reused in between."""
    th = Threshold(0.1, lifespan=3, slack=None)
    taus = []
    for i in range(7):
        x = torch.randn(1000) * (i + 1)  # a growing scale: a recomputed τ differs
        th.compress(x, Context("layer"))
        taus.append(th.threshold("layer"))
    assert taus[0] == taus[1] == taus[2] != taus[3]
    assert taus[3] == taus[4] == taus[5] != taus[6]
    assert th.threshold("other") is None
    fresh = Threshold(0.1, lifespan=3, slack=None)
    fresh.load_state_dict(th.state_dict())
    assert fresh.state_dict() == th.state_dict()
    # with a reused τ, everything at least τ is sent
    x = torch.randn(1000) * 7
    y = roundtrip(th, x, Context("layer"))
    tau = th.threshold("layer")
    assert tau is not None and torch.equal(y != 0, x.abs() >= tau)


def test_threshold_recomputes_a_reused_tau_that_keeps_too_many_or_too_few() -> None:
    """With ``slack`` s, a reused τ keeping more than s·k or fewer than k/s entries is recomputed on that call
    (error feedback grows g + e after τ is set: the reused τ would keep ever more); within the band it is
    reused."""
    k, n = 100, 10_000
    th = Threshold(k / n, lifespan=1000, slack=2.0)
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(n, generator=gen)
    kept = []
    for scale in (1.0, 1.05, 3.0, 3.0, 0.2, 0.2):  # 1.05: within the band; 3.0 keeps > 2k; 0.2 keeps < k/2
        x = base * scale
        kept.append(int(th.compress(x, Context("w")).stream.nnz))
    assert kept[0] == k and k < kept[1] <= 2 * k  # reused: more than k, within the band
    assert kept[2:] == [k, k, k, k] and th.recomputations("w") == 3  # call 0, the first 3.0, the first 0.2
    paper = Threshold(k / n, lifespan=1000, slack=None)
    paper.compress(base, Context("w"))
    assert int(paper.compress(base * 3.0, Context("w")).stream.nnz) > 10 * k  # Alg. 1 alone: kept grows
    assert paper.recomputations("w") == 1
    with pytest.raises(ValueError, match="slack"):
        Threshold(0.1, slack=0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_threshold_c_and_torch_mask_passes_give_the_same_positions(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across chunks, at τ > 0 and τ = 0, with NaN, ±inf, signed zeros and values equal to τ (bf16: torch's pass
    only)."""
    n = 2 * threshold_mod.CHUNK + 12_345
    g = torch.Generator().manual_seed(5)
    v = (torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.3)).to(dtype)
    v[[3, 77, n - 1]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    v[[10, 11]] = torch.tensor([-0.0, 0.0], dtype=dtype)
    tau = float(v[100:200].abs().max())
    v[[5, threshold_mod.CHUNK + 1]] = torch.tensor([tau, -tau], dtype=dtype)
    used = _spy(monkeypatch, threshold_mod)
    for t in (tau, 0.0):
        want = threshold_mod._mask_positions(v, t, native=False)
        got = threshold_mod._mask_positions(v, t, native=True)
        assert torch.equal(got, want) and bool((want[1:] > want[:-1]).all())
    c, t = Threshold(0.01, kernels="c"), Threshold(0.01, kernels="torch")
    pc, pt = c.compress(v, Context("w")), t.compress(v, Context("w"))
    assert isinstance(pc, SparsePayload) and isinstance(pt, SparsePayload)
    assert torch.equal(pc.stream.indices, pt.stream.indices) and torch.equal(pc.stream.values, pt.stream.values)
    assert used == (set() if dtype == torch.bfloat16 else {"select"})  # the C pass ran (not for bf16)


def test_threshold_of_zeros_sends_nothing() -> None:
    y = roundtrip(Threshold(0.1), torch.zeros(100))
    assert torch.equal(y, torch.zeros(100))


# --- error feedback -----------------------------------------------------------------------------------------
@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone (no process spawned): ``compressed_allreduce`` at P = 1, whose result
    is this rank's decompressed payload."""
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("key", list(ALL))
def test_error_feedback_invariant(key: str, one_rank_group: None) -> None:
    """g + e_old == decompress(compress(g + e_old)) + e_new, over several steps (exact for the sparsifiers and
    the identity; within one rounding step of the sum for the lossy encodings). The residual is also held to
    one the test keeps itself, e_ref = (g + e_ref) - sent, with ``sent`` what ``compressed_allreduce`` returned
    at P = 1 (its own compressor copy and memory, through the residual path each aggregator has): a memory
    that stores anything else, there or here, fails."""
    c, twin = copy.deepcopy(ALL[key]), copy.deepcopy(ALL[key])  # the same state, apart from other tests'
    mem, reduced = ErrorFeedback(), ErrorFeedback()
    e_ref = torch.zeros(3000)
    gen = torch.Generator().manual_seed(4)
    for step in range(5):
        g = torch.randn(3000, generator=gen)
        e_old = mem.error("p")
        e_old = torch.zeros_like(g) if e_old is None else e_old.clone()
        x = mem.compensate("p", g)
        sent = roundtrip(c, x, Context("p"))
        mem.update("p", x, sent)
        e_new = mem.error("p")
        assert e_new is not None
        # the independent reference: what the one-rank group got back, and the test's own running residual
        out = compressed_allreduce(g, twin, memory=reduced, name="p")
        assert torch.equal(out, sent), (step, (out - sent).abs().max())
        e_ref = (g + e_ref) - out
        e_reduced = reduced.error("p")
        assert e_reduced is not None
        assert torch.equal(e_new, e_ref), (step, (e_new - e_ref).abs().max())
        assert torch.equal(e_reduced, e_ref), (step, (e_reduced - e_ref).abs().max())
        if key != "identity":  # something is held back, so a residual scaled or dropped shows
            assert bool(e_ref.abs().max() > 0), step
        if (key in SPARSIFIERS and key != "randomk") or key == "identity":
            # they send exact copies of what they keep: the residual is zero there, x elsewhere
            assert torch.equal(g + e_old, sent + e_new)
            assert torch.equal(e_new[sent != 0], torch.zeros(int((sent != 0).sum())))
        else:  # scaled or re-encoded values: x - sent and the check's own sum each round once
            ulp = torch.finfo(torch.float32).eps
            slack = 2 * ulp * (sent.abs() + x.abs() + e_new.abs())
            assert bool(((g + e_old) - (sent + e_new)).abs().le(slack).all())
            # the residual is x less what was sent, bit for bit, and what was sent is the encoding's own
            assert torch.equal(e_new, x - sent)
            if key in ("fp16", "bf16"):
                assert torch.equal(sent, x.to(torch.float16 if key == "fp16" else torch.bfloat16).float())
            else:
                assert not torch.equal(sent, x) and bool(sent.isfinite().all())


@pytest.mark.parametrize("key", sorted(SPARSIFIERS))
@pytest.mark.parametrize("owned", [True, False])
def test_error_feedback_update_selected_is_update_bit_for_bit(key: str, owned: bool) -> None:
    """The sparsifiers' residual from the payload's entries equals update(x, decompress(payload)) bit for bit
    (signed zeros included), and leaves a tensor it does not own alone."""
    c = ALL[key]
    gen = torch.Generator().manual_seed(7)
    dense, selected = ErrorFeedback(), ErrorFeedback()
    for step in range(4):
        g = torch.randn(3000, generator=gen)
        g[::97] = -0.0
        xa, xb = dense.compensate("p", g), selected.compensate("p", g)
        assert torch.equal(xa, xb)
        p = c.compress(xb, Context("p"))
        assert isinstance(p, SparsePayload) and p.stream.indices is not None
        dense.update("p", xa, c.decompress(p, TensorSpec.of(xa)))
        before = xb.clone()
        selected.update_selected("p", xb, p.stream.indices, p.stream.values, owned=owned)
        ea, eb = dense.error("p"), selected.error("p")
        assert ea is not None and eb is not None
        assert torch.equal(ea, eb) and torch.equal(ea.signbit(), eb.signbit()), step
        if not owned:
            assert torch.equal(xb, before) and eb.data_ptr() != xb.data_ptr()
    # a non-contiguous compensated tensor (a transposed gradient) is copied, even when owned
    t = torch.randn(60, 50, generator=gen).t()
    p = c.compress(t, Context("t"))
    dense.update("t", t, c.decompress(p, TensorSpec.of(t)))
    selected.update_selected("t", t, p.stream.indices, p.stream.values, owned=owned)
    assert torch.equal(dense.error("t"), selected.error("t"))  # type: ignore[arg-type]


def test_error_feedback_state_dict_round_trip() -> None:
    mem = ErrorFeedback()
    mem.update("a", torch.ones(3), torch.zeros(3))
    mem.update("b", torch.ones(2), torch.ones(2))
    state = mem.state_dict()
    other = ErrorFeedback()
    other.load_state_dict(state)
    assert other.names() == ["a", "b"]
    assert torch.equal(other.error("a"), torch.ones(3))  # type: ignore[arg-type]
    mem.update("a", torch.zeros(3), torch.zeros(3))  # the copy does not alias
    assert torch.equal(other.error("a"), torch.ones(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shape"):
        other.compensate("a", torch.ones(4))
    with pytest.raises(ValueError, match="errors"):
        other.load_state_dict({"decay": 1.0})


# --- sparse COO inputs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("c", [Identity(), FP16(), BF16(), TopK(0.5), Threshold(0.5), SparseSketch(cols=64)])
def test_sparse_coo_inputs_keep_their_layout(c: object) -> None:
    emb = torch.nn.Embedding(40, 5, sparse=True)
    weights = torch.arange(1, 21.0).square().reshape(1, 4, 5)  # distinct entries after row 4's two are summed
    (emb(torch.tensor([[1, 4, 4, 30]])) * weights).sum().backward()
    g = emb.weight.grad
    assert g is not None and g.is_sparse
    y = roundtrip(c, g)
    assert y.is_sparse and y.shape == g.shape and y.dtype == g.dtype
    rows = set(y.coalesce().indices()[0].tolist())
    assert rows <= {1, 4, 30}
    got, exact = y.to_dense(), g.to_dense()
    if isinstance(c, Identity | FP16 | BF16):  # the values each cast gives, bit for bit
        cast = {"identity": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[c.name]
        assert torch.equal(got, exact.to(cast).float())
    elif isinstance(c, TopK | Threshold):  # exact copies of the largest of the 15 entries, zeros elsewhere
        kept = got != 0
        assert bool(kept.any()), got  # something was sent: the comparisons below are not over nothing
        assert torch.equal(got[kept], exact[kept])
        assert bool(exact[kept].min() > exact[~kept].max()), got
        if isinstance(c, TopK):
            assert int(kept.sum()) == 8  # ceil(0.5 * 15)
    else:  # 3 rows of 5 in a 64-column sketch: the query gives them back (the median of exact copies)
        assert torch.allclose(got, exact, rtol=1e-6, atol=1e-6), (got - exact).abs().max()


# --- argument errors of reduce and the DDP hook (raised before any communication) ---------------------------
@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((torch.ones(3), TopK(0.5)), {"memory": ErrorFeedback()}, ValueError, "name"),
        ((torch.ones(3).to_sparse(), Identity()), {"inplace": True}, ValueError, "inplace"),
        ((torch.ones(0), Identity()), {}, ValueError, "empty"),
        ((torch.ones(3, dtype=torch.int64), Identity()), {}, ValueError, "floating"),
        ((torch.ones(3), "topk"), {}, TypeError, "Compressor"),
        (([1.0, 2.0], Identity()), {}, TypeError, "Tensor"),
    ],
)
def test_reduce_rejects_bad_arguments(
    args: tuple[object, ...], kwargs: dict[str, object], exc: type, match: str
) -> None:
    import sparsync

    with pytest.raises(exc, match=match):
        sparsync.compressed_allreduce(*args, **kwargs)  # type: ignore[call-overload]


def test_hook_needs_a_module_for_memory() -> None:
    from sparsync.compress.hooks import compression_hook

    with pytest.raises(ValueError, match="module"):
        compression_hook(TopK(0.1), ErrorFeedback())
    with pytest.raises(TypeError, match="Compressor"):
        compression_hook("topk")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [5, buffers.HUGE_MIN // 4 + 3])
def test_fresh_buffers_are_plain_writable_tensors(n: int) -> None:
    """Small: torch.empty; from HUGE_MIN bytes: a huge-page mapping. Either way a contiguous float32 tensor that
    keeps its values, lives as long as a view of it does, and can be shared."""
    assert bool((buffers.fresh(n, torch.float64, zeros=True) == 0).all())
    t = buffers.fresh(n)
    assert t.shape == (n,) and t.dtype == torch.float32 and t.is_contiguous()
    t.copy_(torch.arange(n, dtype=torch.float32))
    assert float(t[-1]) == n - 1 and torch.equal(t * 2, torch.arange(n, dtype=torch.float32) * 2)
    assert torch.equal(t.clone().share_memory_(), t)
    view = t[1:].view(-1, 1)
    del t
    assert float(view[0, 0]) == 1.0  # the mapping lives as long as a view of it


def test_fresh_mappings_are_reused_only_once_no_tensor_holds_them() -> None:
    """The pool of huge-page mappings: a mapping comes back from ``fresh`` only after every tensor, view and
    numpy array of it is gone; reused memory is zeroed on request; free ones beyond the limit are unmapped."""
    n = buffers.HUGE_MIN // 4 + 3
    x = buffers.fresh(n)
    ptr = x.data_ptr()
    x.fill_(7.0)
    view = x[10:20]
    del x
    held = buffers.fresh(n)
    assert held.data_ptr() != ptr and float(view[0]) == 7.0  # a view alive: not reused
    del view
    again = buffers.fresh(n)
    assert again.data_ptr() == ptr  # free: reused, uninitialized
    arr = again.numpy()
    del again
    assert buffers.fresh(n).data_ptr() != ptr  # a numpy array of it alive: not reused
    del arr
    zeroed = buffers.fresh(n, zeros=True)
    assert zeroed.data_ptr() == ptr and not zeroed.any()
    del zeroed, held
    pool = buffers._Pool(limit=0)  # nothing free is kept
    m = mmap.mmap(-1, buffers.HUGE_PAGE)
    pool.hand_out(m, torch.frombuffer(m, dtype=torch.uint8))  # the tensor dies at once: free
    pool.hand_out(mmap.mmap(-1, buffers.HUGE_PAGE), keep := torch.zeros(1))
    assert len(pool.maps) == 1 and pool.maps[0][1].expired() is False and keep.numel() == 1


def _same_topk(mag: torch.Tensor, k: int) -> None:
    got = topk_mod.largest(mag, k)
    want = torch.topk(mag, k, sorted=False).indices
    assert got.numel() == k and got.unique().numel() == k
    # the same multiset of values (ties at the k-th value may pick other positions, as topk itself may)
    assert torch.equal(mag[got].sort().values, mag[want].sort().values)


@pytest.mark.parametrize("k", [1, 100, 10_000, 100_000])
def test_largest_is_exact_top_k(k: int) -> None:
    """The candidate path (threshold from a strided sample) returns exactly torch.topk's values, on Gaussian
    magnitudes, on heavy ties, on data whose large values the strided sample misses (fallback), with NaN
    (fallback: topk ranks NaN first), on all zeros, and on mostly zeros with fewer or more than k others
    (τ = 0: the non-zero values are the candidates)."""
    n = 1 << 20
    g = torch.Generator().manual_seed(k)
    _same_topk(torch.randn(n, generator=g).abs(), k)
    _same_topk(torch.randint(0, 50, (n,), generator=g).float(), k)  # ~21K copies of each value
    hidden = torch.zeros(n)
    hidden[1 :: n // topk_mod.SAMPLE] = torch.rand(topk_mod.SAMPLE, generator=g) + 1  # off the sample's stride
    _same_topk(hidden, min(k, topk_mod.SAMPLE))
    nan = torch.randn(n, generator=g).abs()
    nan[[5, n // 2]] = float("nan")
    got = topk_mod.largest(nan, k)
    assert len({5, n // 2} & set(got.tolist())) == min(k, 2)
    _same_topk(torch.zeros(n), k)
    for nnz in (k // 2, 2 * k):  # mostly zeros (a dense embedding gradient): τ = 0, fewer or more than k others
        few = torch.zeros(n)
        few[torch.randperm(n, generator=g)[:nnz]] = torch.rand(nnz, generator=g) + 0.5
        _same_topk(few, k)
