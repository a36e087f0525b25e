"""``sparsync bench embedding`` (issue 13, item 4): the Zipf sampler, the targets, and a tiny run end to end."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparsync.bench.embedding import METHODS, TORCH_METHODS, EmbeddingBenchConfig, zipf_tokens
from sparsync.bench.embedding_report import check_targets
from sparsync.cli import main


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
    with out.with_suffix(".csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows) == len(METHODS)
    by = {r["method"]: r for r in rows}
    assert set(by) == set(METHODS)
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
    assert "## Targets (issue 13)" in md and "torch_coo" in md
