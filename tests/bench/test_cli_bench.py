"""The CLI and the allreduce benchmark, end to end on a tiny configuration."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from sparsync.collectives.meta import EAGER_BYTES, ROW_BYTES
from sparsync_bench.allreduce import METHODS, BenchConfig, coo_too_big
from sparsync_bench.bench.allreduce import check_targets, run_allreduce_bench
from sparsync_bench.cli import main, parse_size


def test_parse_size() -> None:
    assert parse_size("16M") == 16 * 2**20
    assert parse_size("500k") == 500 * 2**10
    assert parse_size("1000") == 1000
    with pytest.raises(Exception, match="bad size '16 MB'"):
        parse_size("16 MB")


def test_gloo_coo_skipped_where_all_ranks_would_exhaust_memory() -> None:
    gb = 1 << 30
    n = 16 * 2**20
    # 8 ranks at density 0.3 of 16M (killed by the OOM killer on 24 GB): 0.48 GB gathered per rank, x4 x8 ranks.
    assert coo_too_big([int(0.3 * n)] * 8, 23 * gb)
    assert not coo_too_big([int(0.1 * n)] * 8, 23 * gb)
    assert not coo_too_big([n] * 2, 23 * gb)
    assert coo_too_big([n] * 8, 1024 * gb)  # over the per-rank cap whatever the machine
    assert not coo_too_big([0] * 5, 1)


def test_bench_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="densities must lie in"):
        BenchConfig(densities=(1.5,))
    with pytest.raises(ValueError, match="unknown methods"):
        BenchConfig(methods=("nope",))
    with pytest.raises(ValueError, match="repeats"):
        BenchConfig(repeats=0)
    with pytest.raises(ValueError, match="fast_repeats"):
        BenchConfig(fast_repeats=0)


def test_net_without_root_exits_with_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    rc = main(["bench", "allreduce", "--net", "1gbit", "--procs", "2", "--n", "1k", "--out", "/tmp/never"])
    assert rc == 2
    out = capsys.readouterr().out
    assert "needs root" in out


def test_latency_needs_net(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "allreduce", "--latency", "1ms", "--n", "1k"]) == 2
    assert "--latency needs --net" in capsys.readouterr().out


def test_demo_steps_names_its_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--steps`` at or under the demo's 5 warm-up steps is refused before any process starts, naming the
    option and the bound."""
    assert main(["demo", "--steps", "5", "--out", str(tmp_path / "demo")]) == 2
    out = capsys.readouterr().out
    assert "error: --steps must exceed the demo's 5 warm-up steps" in out and "got --steps 5" in out, out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_runs_and_writes_outputs(tmp_path: Path) -> None:
    cfg = BenchConfig(dim=4099, densities=(0.0, 1e-2, 1.0), repeats=2, fast_repeats=3, batch_s=0.002)
    out = tmp_path / "ar"
    with (tmp_path / "log.txt").open("w") as log:
        rows = run_allreduce_bench(cfg, (3,), out=out, console=Console(file=log), progress=False)
    assert {r["method"] for r in rows} == set(METHODS)
    assert len(rows) == len(METHODS) * 3
    for r in rows:
        assert r["world_size"] == 3
        assert math.isnan(r["median_s"]) or r["median_s"] > 0
        assert r["lower_bound_s"] >= 0
        assert r["calls_per_repeat"] >= 1  # batches only for fast calls, never empty
        if r["method"] == "auto":
            assert r["chosen"], "auto must report which algorithm it ran"
            assert r["predicted_s"] is not None
        ring = 2 * 2 / 3 * 4099 * 4  # ring allreduce traffic: 2 (P-1)/P N values
        if r["method"] == "gloo_dense":
            assert r["bytes_sent_per_rank"] == pytest.approx(ring, rel=0.01)
        if r["method"] == "dense":  # plus sparsync's metadata round: at most 2 (P-1) rows at P = 3 (fold)
            assert ring <= r["bytes_sent_per_rank"] <= ring + 4 * (ROW_BYTES + EAGER_BYTES)
    data = json.loads(out.with_suffix(".json").read_text())
    assert len(data["rows"]) == len(rows)
    with out.with_suffix(".csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_targets_ratios() -> None:
    def row(P: int, d: float, m: str, t: float) -> dict[str, object]:
        return {"world_size": P, "density": d, "method": m, "median_s": t}

    rows = [
        row(8, 0.1, "gloo_dense", 1.0),
        row(8, 0.1, "gloo_sparse_coo", 30.0),
        row(8, 0.1, "allgather", 2.0),
        row(8, 0.1, "auto", 1.15),
        row(8, 1e-3, "gloo_dense", 1.0),
        row(8, 1e-3, "allgather", 0.05),
        row(8, 1e-3, "auto", 0.05),
    ]
    checks = {name: (ok, val) for name, ok, val in check_targets(rows)}  # type: ignore[arg-type]
    assert checks["P=8 d=0.1: auto within 1.2x of gloo dense"] == (True, "1.15x")
    assert checks["P=8 d=0.1: auto <= 1.1x fastest baseline (gloo_dense)"] == (False, "1.15x")
    assert checks["P=8 d=0.001: auto >= 10x faster than gloo dense"] == (True, "20.0x faster")
