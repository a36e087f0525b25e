"""``sparsync bench tta`` at its smallest setting (tiny models, 2 ranks, loopback): every method's row for every
model, every method from the same initial weights and samples (bit for bit: the same first-step loss too),
finite losses, the report's files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from sparsync_bench.cli import main
from sparsync_bench.tta import METHODS, TTAConfig
from sparsync_bench.tta_report import analyse, check_targets, smoothed

MODELS = ("tiny-transformer", "tiny-lm", "tiny-mlp")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_method_from_the_same_weights_and_samples(tmp_path: Path) -> None:
    out = tmp_path / "tta"
    argv = ["bench", "tta", "--models", ",".join(MODELS), "--steps", "4", "--procs", "2", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    for model in MODELS:
        mine = {r["method"]: r for r in rows if r["model"] == model}
        assert list(mine) == list(METHODS), model
        assert len({r["weights"] for r in mine.values()}) == 1, model
        assert len({r["samples"] for r in mine.values()}) == 1, model
        assert len({r["loss"][0] for r in mine.values()}) == 1, model  # step 0: the same weights and batches
        for r in mine.values():
            assert len(r["loss"]) == len(r["times_s"]) == 4 and all(math.isfinite(v) for v in r["loss"]), r
            assert r["ms_per_step"] > 0 and r["bytes_per_step"] >= 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| tiny-mlp | dgc |" in out.with_suffix(".md").read_text()


def test_target_and_time_to_target() -> None:
    """The target is dense's smoothed loss at 3/4 of its steps; a method reaching it is timed at that step."""
    dense: dict[str, Any] = {"model": "m", "method": "ddp", "steps": 8, "loss": [8.0, 7, 6, 5, 4, 3, 2, 1],
             "times_s": [1.0, 2, 3, 4, 5, 6, 7, 8], "bytes_per_step": 1.0}  # fmt: skip
    fast = {**dense, "method": "powersgd-r2", "loss": [8.0, 6, 4, 2, 1, 1, 1, 1], "times_s": [0.5 * t for t in
            dense["times_s"]]}  # fmt: skip
    slow = {**dense, "method": "topk-ef", "loss": [8.0] * 8}
    rows = {r["method"]: r for r in analyse([dense, fast, slow])}
    assert rows["ddp"]["target"] == smoothed(dense["loss"])[5] == 5.0
    assert rows["ddp"]["time_to_target_s"] == 6.0 and rows["powersgd-r2"]["time_to_target_s"] == 2.0
    assert rows["topk-ef"]["time_to_target_s"] is None
    checks = {name: ok for name, ok, _ in check_targets(list(rows.values()))}
    assert checks["m: sparsync's best to target ≤ 0.8x ddp"]
    assert checks["m: powersgd-r2 step ≤ dense DDP's"] and checks["m: topk-ef step ≤ dense DDP's"]


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="nope"):
        TTAConfig(model="nope")
    with pytest.raises(ValueError, match="bogus"):
        TTAConfig(methods=("ddp", "bogus"))
    with pytest.raises(ValueError, match="steps"):
        TTAConfig(steps=2)
