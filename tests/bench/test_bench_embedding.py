"""``sparsync bench embedding``: the Zipf sampler, the targets, and a tiny run end to end."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sparsync_bench import embedding_sketch as es
from sparsync_bench.bench.embedding import check_targets
from sparsync_bench.cli import main
from sparsync_bench.embedding import METHODS, TORCH_METHODS, EmbeddingBenchConfig, zipf_tokens


@pytest.mark.parametrize("s", [0.9, 1.1, 1.3])
def test_zipf_sampler_low_puts_the_hottest_id_at_zero_and_permuted_spreads_it(s: float) -> None:
    rows, n = 5000, 50_000
    low = zipf_tokens(rows, s, n, "low", seed=3, rank=1)
    perm = zipf_tokens(rows, s, n, "permuted", seed=3, rank=1)
    for ids in (low, perm):
        assert ids.dtype == np.int64 and ids.shape == (n,) and ids.min() >= 0 and ids.max() < rows
    c_low, c_perm = np.bincount(low, minlength=rows), np.bincount(perm, minlength=rows)
    assert c_low.argmax() == 0
    assert c_low[0] > c_low[1] > c_low[9] > 0  # p(i) ∝ 1/(i+1)^s: rank 1 is 2^s times rank 2
    assert c_perm.argmax() != 0
    # the same draws through a permutation: the same frequency profile, on other ids
    np.testing.assert_array_equal(np.sort(c_low), np.sort(c_perm))
    np.testing.assert_array_equal(low, zipf_tokens(rows, s, n, "low", seed=3, rank=1))  # deterministic
    assert not np.array_equal(low, zipf_tokens(rows, s, n, "low", seed=3, rank=2))  # rank-dependent
    # the permutation depends on the seed only: every rank's hot rows are the same rows
    hot_0 = np.bincount(zipf_tokens(rows, s, n, "permuted", seed=3, rank=0), minlength=rows).argmax()
    assert hot_0 == c_perm.argmax()


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown methods"):
        EmbeddingBenchConfig(methods=("nope",))
    with pytest.raises(ValueError, match="unknown hot"):
        EmbeddingBenchConfig(hot=("middle",))
    with pytest.raises(ValueError, match="repeats"):
        EmbeddingBenchConfig(repeats=0)
    with pytest.raises(ValueError, match="zipf"):
        EmbeddingBenchConfig(zipf=(-1.0,))
    with pytest.raises(ValueError, match="sketch lambdas"):
        EmbeddingBenchConfig(sketch_lambdas=(1.0, 0.0))


def test_check_targets() -> None:
    def row(m: str, t: float, b: float, **kw: Any) -> dict[str, Any]:
        r = {"world_size": 4, "dim": 64, "zipf": 1.1, "hot": "low", "tokens": 8192, "method": m, "median_s": t,
             "bytes_sent_per_rank": b, "allgather_bytes": 300.0, "rsag_bytes": 200.0, "vs_coo": t / 0.02,
             "partition": "", "partition_imbalance": None}  # fmt: skip
        return {**r, **kw}

    rows = [
        row("torch_coo", 0.02, 300.0),
        row("auto", 0.021, 230.0),
        row("ssar_split_allgather", 0.05, 210.0, partition="stride", partition_imbalance=1.5),
    ]
    got = {name: (ok, val) for name, ok, val in check_targets(rows, loopback=True)}
    assert got["P=4 dim=64 zipf=1.1 low: auto <= 1.0x torch_coo"] == (False, "1.05x")
    assert got["P=4 dim=64 zipf=1.1 low: auto <= 1.2x torch_coo"] == (True, "1.05x")
    assert got["P=4 dim=64 zipf=1.1 low: auto bytes <= 1.2x min(allgather, RS+AG)"] == (True, "1.15x")
    assert got["P=4 dim=64 zipf=1.1 low: ssar_split_allgather partition (stride) max/mean <= 1.2"] == (
        False,
        "1.50",
    )
    assert not any("1.2x torch_coo" in c[0] for c in check_targets(rows, loopback=False))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_cli_tiny_run_writes_every_method(tmp_path: Path) -> None:
    out = tmp_path / "emb"
    argv = ["bench", "embedding", "--procs", "2", "--rows", "2000", "--dims", "8", "--tokens", "256", "--zipf",
            "1.1", "--hot", "permuted", "--repeats", "2", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    for ext in (".csv", ".json", ".md"):
        assert out.with_suffix(ext).stat().st_size > 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    names = EmbeddingBenchConfig().method_names  # "sketch" runs as sketch@1
    with out.with_suffix(".csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows) == len(names) == len(METHODS)
    by = {r["method"]: r for r in rows}
    assert set(by) == set(names) and "sketch@1" in by
    P, dim, k = 2, 8, by["auto"]["k_mean"]
    assert 0 < k <= 256 and k <= by["auto"]["union"] <= 2 * k
    coo = by["torch_coo"]
    assert coo["bytes_sent_per_rank"] == pytest.approx((P - 1) / P * 2 * k * (8 + dim * 4) + (P - 1) * 72)
    assert by["torch_dense"]["bytes_sent_per_rank"] == pytest.approx(2 * (P - 1) / P * 2000 * dim * 4)
    assert by["torch_ddp"]["ddp_step_s"] > 0
    for m, r in by.items():
        if r["note"].startswith("skipped: sparse_allreduce has no partition="):
            continue  # the /range variants before partition= exists
        if m in TORCH_METHODS and m != "torch_coo":
            continue  # torch_ddp's median is a difference of two timings: may be <= 0 on a tiny batch
        assert r["median_s"] > 0 and not math.isnan(r["p75_s"]), r
        assert r["bytes_sent_per_rank"] > 0, r
        assert "differ" not in r["note"], r  # every sparsync method's sum equals torch's
    assert by["auto"]["chosen"] and by["auto"]["vs_coo"] > 0
    md = out.with_suffix(".md").read_text()
    assert "## Targets (row-sparse embedding gradients)" in md and "torch_coo" in md


# --- the S2 sketch on this workload -------------------------------------------------------
def test_sketch_methods_expand_per_lambda() -> None:
    cfg = EmbeddingBenchConfig(methods=("auto", "sketch", "allgather"), sketch_lambdas=(0.5, 1.0, 4.0))
    assert cfg.method_names == ("auto", "sketch@0.5", "sketch@1", "sketch@4", "allgather")
    assert [es.lambda_of(m) for m in cfg.method_names if es.is_sketch(m)] == [0.5, 1.0, 4.0]
    sk = es.make_sketch("sketch@4", 0.01, seed=0)
    assert sk.ratio == pytest.approx(0.04) and sk.rows == es.SKETCH_ROWS


def test_expected_density_is_the_mean_of_the_sampled_density() -> None:
    """α, from the workload's parameters alone, against the rows the sampler actually touches."""
    rows, s, n = 20_000, 1.1, 2000
    seen = [len(np.unique(zipf_tokens(rows, s, n, "low", seed=7, rank=r))) / rows for r in range(40)]
    alpha = es.expected_density(rows, s, n)
    assert abs(np.mean(seen) - alpha) < 4 * np.std(seen) / math.sqrt(len(seen)) + 1e-9
    assert es.expected_density(rows, s, 4 * n) > alpha  # more tokens, more rows


def test_sketch_accuracy_measures_error_and_bitmap() -> None:
    def coo(rows: list[int], vals: list[list[float]]) -> torch.Tensor:
        return torch.sparse_coo_tensor(torch.tensor([rows]), torch.tensor(vals), (6, 2), check_invariants=True)

    exact = coo([1, 4], [[3.0, 4.0], [0.0, 0.0]])
    assert es.accuracy(coo([1, 4], [[3.0, 4.0], [0.0, 0.5]]), exact) == pytest.approx((0.1, 1.0))
    extra = coo([1, 2, 4], [[0.0, 0.0]] * 3)  # a row the union lacks
    assert es.accuracy(extra, exact) == pytest.approx((1.0, 2 / 3))


def test_sketch_targets() -> None:
    def row(m: str, t: float, b: float, **kw: Any) -> dict[str, Any]:
        r = {"world_size": 8, "dim": 64, "zipf": 1.1, "hot": "low", "tokens": 8192, "method": m, "median_s": t,
             "bytes_sent_per_rank": b, "allgather_bytes": 1000.0, "rsag_bytes": 600.0, "vs_coo": None,
             "partition": "", "partition_imbalance": None, "rows": 1000, "k_mean": 10.0}  # fmt: skip
        return {**r, **kw}

    sk = {"sketch_compress_s": 0.002, "sketch_decompress_s": 0.003}
    rows = [
        row("torch_dense", 0.1, 5000.0),
        row("auto", 0.02, 700.0),
        row("sketch@1", 0.019, 250.0, **sk),
        row("sketch@4", 0.03, 400.0, **{**sk, "sketch_decompress_s": 0.009}),
    ]
    got = {name: (ok, val) for name, ok, val in check_targets(rows, loopback=False)}
    head = "P=8 dim=64 zipf=1.1 low: "
    assert got[head + "sketch@1 compress+decompress <= 10% of torch_dense"] == (
        True,
        "5.0% (5.00 vs 100.00 ms; density 1.00%)",
    )
    assert got[head + "sketch@4 compress+decompress <= 10% of torch_dense"][0] is False  # 11%
    assert got[head + "sketch@1 bytes <= 0.3x allgather's"] == (
        True,
        "0.25x (0.000 vs 0.001 MB, counted (P-1)·k rows)",
    )
    assert got[head + "sketch@4 bytes <= 0.3x allgather's"][0] is False
    assert got[head + "sketch@1 time <= auto's (row-sparse allreduce)"] == (True, "0.95x (19.00 vs 20.00 ms)")
    assert got[head + "sketch@4 time <= auto's (row-sparse allreduce)"][0] is False
    # a baseline that did not run: the target is there, not met
    no_dense = {n: ok for n, ok, _ in check_targets(rows[1:], loopback=False)}
    assert no_dense[head + "sketch@1 compress+decompress <= 10% of torch_dense"] is False


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_cli_sketch_sweep_at_p1_and_p3(tmp_path: Path) -> None:
    out = tmp_path / "sk"
    lams = (0.5, 256.0)
    argv = ["bench", "embedding", "--procs", "1,3", "--rows", "2000", "--dims", "8", "--tokens", "256", "--zipf",
            "1.1", "--hot", "low", "--repeats", "1", "--methods", "torch_dense,allgather,auto,sketch",
            "--sketch-lambda", ",".join(map(str, lams)), "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    alpha = es.expected_density(2000, 1.1, 256)
    for P in (1, 3):
        by = {r["method"]: r for r in rows if r["world_size"] == P}
        assert set(by) == {"torch_dense", "allgather", "auto", "sketch@0.5", "sketch@256"}
        for lam in lams:
            r = by[es.method_name(lam)]
            assert r["sketch_lambda"] == lam and r["sketch_alpha"] == pytest.approx(alpha)
            cells = 3 * 8 * math.ceil(math.ceil(lam * alpha * 2000 * 8 / 3) / 8)  # whole 8-wide buckets
            assert r["sketch_cells"] == cells
            # ring allreduces of the bitmap (one bit per row, in int32 words) and the float32 table, per rank
            assert r["bytes_sent_per_rank"] == pytest.approx(2 * (P - 1) * (-(-2000 // 32) * 4 + cells * 4) // P)
            assert math.isfinite(r["sketch_rel_error"]) and r["sketch_bitmap_match"] == 1.0
            assert r["median_s"] > 0 and r["sketch_compress_s"] > 0 and r["sketch_decompress_s"] > 0
        # λ = 256: buckets for 256x one rank's values, fewer than 1% collide; λ = 0.5: far fewer buckets
        assert by["sketch@256"]["sketch_rel_error"] < 0.05 < by["sketch@0.5"]["sketch_rel_error"]
    md = out.with_suffix(".md").read_text()
    assert "## Sketch targets (stated at P = 8)" in md
    assert "P=3 dim=8 zipf=1.1 low: sketch@256 bytes <= 0.3x allgather's" in md
    assert "P=1 dim=8 zipf=1.1 low: sketch" not in md  # P = 1 sends nothing: no targets
