"""``sparsync bench compress`` end to end on a tiny configuration, and its argument errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from rich.console import Console

from sparsync_bench.bench.compress import run_compress_bench
from sparsync_bench.cli import main
from sparsync_bench.compress import TARGET, CompressBenchConfig, check_targets


def test_config_rejects_bad_values() -> None:
    with pytest.raises(KeyError, match=r"valid: .*topk"):
        CompressBenchConfig(compressors=("bogus",))
    with pytest.raises(ValueError, match="ratio"):
        CompressBenchConfig(compressors=("topk:ratio=2",))
    with pytest.raises(ValueError, match="repeats"):
        CompressBenchConfig(repeats=0)


def test_cli_unknown_compressor_exits_with_the_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "compress", "--compressor", "nope", "--sizes", "1k", "--out", "/tmp/never"])
    out = capsys.readouterr().out
    assert rc == 2 and "nope" in out and "threshold" in out


@pytest.mark.multiprocess
def test_bench_compress_tiny(tmp_path: Path) -> None:
    specs = ("identity", "topk:ratio=0.01", "threshold:ratio=0.01,lifespan=1", TARGET, "qsgd:bits=4")
    cfg = CompressBenchConfig(sizes=(20_000,), compressors=specs, repeats=1)
    rows = run_compress_bench(cfg, procs=2, out=tmp_path / "c", console=Console(file=None), progress=False)
    assert [r["compressor"] for r in rows] == list(specs)
    by = {r["compressor"]: r for r in rows}
    assert by["identity"]["rel_error"] == 0.0 and by["identity"]["bytes_ratio"] == 1.0
    assert by["topk:ratio=0.01"]["payload_bytes"] == 200 * 8  # 200 (int32 index, float32 value) pairs
    # 4 bits per value and one float32 scale per bucket of 512 (40 buckets)
    assert by["qsgd:bits=4"]["bytes_ratio"] == pytest.approx((10_000 + 40 * 4) / 80_000)
    assert all(r["dense_allreduce_s"] > 0 and r["reduce_s"] > 0 for r in rows)
    assert all(r["hook_tiny_s"] > 0 and r["ddp_hook_tiny_s"] > 0 for r in rows)  # each hook's fixed cost
    checks = check_targets(rows)
    assert (
        len(checks) == 3 and "10%" in checks[0][0] and "every compressor" in checks[2][0]
    )  # compression, then compressors
    for ext in (".json", ".csv", ".png", ".md"):
        assert (tmp_path / "c").with_suffix(ext).stat().st_size > 0
    meta = json.loads((tmp_path / "c.json").read_text())["meta"]
    assert meta["procs"] == 2 and len(meta["targets"]) == 3
    with (tmp_path / "c.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(specs)
