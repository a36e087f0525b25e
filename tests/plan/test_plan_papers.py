"""The planner against the papers' figures (``sparsync_bench.plan_papers``): the published per-iteration time
derived as the module says, the prediction the ring's α-β price written out here, and the Parallax rows' parts
summing to the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsync_bench.plan_papers import (
    LM_WORDS,
    PARALLAX_FIG9_HYB,
    PARALLAX_TABLE4,
    SPARCML_TABLE2,
    DenseRow,
    compare,
    main,
    parallax_lm,
)


def test_a_sparcml_row_is_its_epoch_over_its_iterations_and_the_ring_priced_by_hand() -> None:
    row = DenseRow("Greina (GigE)", "URL", "LR", 8, 100.46)
    iterations = 2_396_130 / 8000
    assert row.published == pytest.approx(100.46 / iterations, rel=1e-12)
    n, P, beta, alpha = 3_231_961 * 8, 8, 8 / 1e9, 50e-6
    ring = 2 * (P - 1) * alpha + 2 * (P - 1) / P * n * beta
    assert row.predicted() == ("ring", pytest.approx(ring, rel=1e-12))


def test_every_table2_row_is_compared_once() -> None:
    res = compare()
    rows = res["sparcml_table2"]
    assert len(rows) == len(SPARCML_TABLE2) == 12
    for r in rows:
        assert r["ratio"] == pytest.approx(r["predicted"] / r["published"], rel=1e-12)


def test_parallax_rows_price_each_architecture_from_table4() -> None:
    res = compare()["parallax_lm"]
    assert [r["architecture"] for r in res] == ["AR", "HYB"]
    one_gpu = LM_WORDS / (PARALLAX_TABLE4["HYB"] / PARALLAX_FIG9_HYB)
    for r in res:
        assert r["published"] == pytest.approx(48 * LM_WORDS / PARALLAX_TABLE4[r["architecture"]] - one_gpu)
        assert r["predicted"] == pytest.approx(sum(r["parts"].values()), rel=1e-12)
    ar, hyb = res
    assert hyb["predicted"] < ar["predicted"]  # the hybrid is the cheaper step, as Table 4 measured
    assert {s.name for s in parallax_lm() if s.sparse} == {"emb.weight", "softmax.weight"}


def test_main_writes_both_files(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path / "papers")]) == 0
    assert json.loads((tmp_path / "papers.json").read_text()) == json.loads(json.dumps(compare()))
    assert "| Greina (GigE) | URL LR | 8 | 335.4 |" in (tmp_path / "papers.md").read_text()
