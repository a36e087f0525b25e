"""The sharded exchange's CPU (``plan.cluster.ExchangeCPU``): its least-squares fit against exact constants, and
``ShardedKind`` pricing it (per step once, per table and per distinct key in each table's estimate) only when the
cluster has one."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from sparsync.compress.sketch import SparseSketch
from sparsync.plan import Cluster, ExchangeCPU, ParamStats, make_plan
from sparsync.plan.backend import all_to_all_latency
from sparsync.plan.kinds import ROUNDS, ShardedKind
from sparsync_bench.cli import main

CPU = ExchangeCPU(per_step=1.5e-3, per_table=4e-5, per_key=4e-7)
GRID = [(26.0, 2411.0), (26.0, 8553.0), (26.0, 29054.0), (8.0, 863.0), (8.0, 2901.0), (8.0, 8528.0)]


def test_fit_recovers_exact_constants() -> None:
    samples = [(t, k, CPU.seconds(t, k)) for t, k in GRID]
    got = ExchangeCPU.fit(samples)
    for name in ("per_step", "per_table", "per_key"):
        assert getattr(got, name) == pytest.approx(getattr(CPU, name), rel=1e-9), name


def test_fit_drops_a_term_fitted_below_zero_and_refits_the_rest() -> None:
    # seconds = 2e-3 + 5e-7·K - 1e-5·T: the per-table term would come out negative; without it, the least
    # squares of the other two (a reference solved here by the normal equations)
    samples = [(t, k, 2e-3 + 5e-7 * k - 1e-5 * t) for t, k in GRID]
    got = ExchangeCPU.fit(samples)
    n = len(samples)
    sk = sum(k for _, k, _ in samples)
    skk = sum(k * k for _, k, _ in samples)
    sy = sum(y for _, _, y in samples)
    sky = sum(k * y for _, k, y in samples)
    slope = (n * sky - sk * sy) / (n * skk - sk * sk)
    assert got.per_table == 0.0
    assert got.per_key == pytest.approx(slope, rel=1e-9)
    assert got.per_step == pytest.approx((sy - slope * sk) / n, rel=1e-9)


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"finite and >= 0, got \(-1.0, 0.0, 0.0\)"):
        ExchangeCPU(-1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r">= 3 samples at 3 distinct \(tables, keys\), got 3"):
        ExchangeCPU.fit([(1.0, 2.0, 0.1)] * 3)
    with pytest.raises(ValueError, match=r"samples must be finite and >= 0.*nan"):
        ExchangeCPU.fit([(1.0, 2.0, float("nan")), (2.0, 2.0, 0.1), (3.0, 1.0, 0.1)])
    with pytest.raises(ValueError, match=r"factor must be finite and > 0, got 0"):
        CPU.scaled(0)


def test_scaled_multiplies_every_term() -> None:
    assert CPU.scaled(4.0).seconds(26, 8000) == pytest.approx(4 * CPU.seconds(26, 8000), rel=1e-12)


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_sharded_kind_prices_the_cpu_only_with_a_model(world: int) -> None:
    s = ParamStats("t.weight", (10_000, 16), 0.05, True)
    u = 0.05 * 10_000
    plain = Cluster(world, bandwidth=1.25e9, latency=50e-6)
    with_cpu = Cluster(world, bandwidth=1.25e9, latency=50e-6, exchange_cpu=CPU)
    kind = ShardedKind()
    bare = kind.estimate(s, plain, sketch=SparseSketch(ratio=0.1))
    priced = kind.estimate(s, with_cpu, sketch=SparseSketch(ratio=0.1))
    assert bare is not None and priced is not None
    assert priced.nbytes == bare.nbytes
    assert priced.seconds == pytest.approx(bare.seconds + CPU.per_table + CPU.per_key * u, rel=1e-12)
    assert kind.shared_seconds(plain) == pytest.approx(ROUNDS * all_to_all_latency(plain), rel=1e-12)
    assert kind.shared_seconds(with_cpu) == pytest.approx(kind.shared_seconds(plain) + CPU.per_step, rel=1e-12)


def test_the_plans_sharded_part_is_the_network_price_plus_the_cpu_of_every_table() -> None:
    sizes = [(1000, 0.3), (50_000, 0.01)]
    tables = [ParamStats(f"t{j}.weight", (n, 16), f, True) for j, (n, f) in enumerate(sizes)]
    pin = {t.name: "sharded" for t in tables}

    def part(c: Cluster) -> float:
        plan = make_plan(tables, c, overrides=pin, swap_modules=True)
        (p,) = [p for p in plan.step.parts if p.kind == "sharded"]
        return float(p.seconds)

    c = Cluster(4, bandwidth=1.25e9, latency=50e-6)
    keys = 0.3 * 1000 + 0.01 * 50_000
    got = part(Cluster(4, bandwidth=1.25e9, latency=50e-6, exchange_cpu=CPU))
    assert got == pytest.approx(part(c) + CPU.seconds(len(tables), keys), rel=1e-12)


def test_sparsync_plan_prices_the_exchange_cpu_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sparsync plan --exchange-cpu``: from a JSON of the three terms or a plan_check run's JSON (its fit), the
    pinned sharded part costs what it costs without, plus the CPU of its 26 tables' distinct keys."""
    terms = tmp_path / "cpu.json"
    terms.write_text(json.dumps(asdict(CPU)))
    check = tmp_path / "check.json"
    check.write_text(json.dumps([{"exchange_cpu": asdict(CPU), "setting": {}}]))
    argv = ["plan", "--model", "dlrm", "--world", "4", "--link", "25gbit", "--latency", "50us"]
    pin = [x for j in range(26) for x in ("--override", f"tables.{j}.weight=sharded")]
    parts = {}
    for name, extra in (("none", []), ("terms", ["--exchange-cpu", str(terms)]),
                        ("check", ["--exchange-cpu", str(check)])):  # fmt: skip
        out = tmp_path / f"{name}.json"
        assert main([*argv, *pin, *extra, "--json", str(out)]) == 0
        (plan,) = json.loads(out.read_text())
        (part,) = [p for p in plan["step"] if p["kind"] == "sharded"]
        parts[name] = part["seconds"]
        keys = sum(e["row_fraction"] * e["shape"][0] for e in plan["entries"] if e["placement"] == "sharded")
    assert parts["terms"] == parts["check"] == pytest.approx(parts["none"] + CPU.seconds(26, keys), rel=1e-9)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"per_step": 1.0}))
    assert main([*argv, "--exchange-cpu", str(bad)]) == 2
    said = " ".join("".join(capsys.readouterr()).split())
    assert "bad.json: want a JSON object {per_step, per_table, per_key}" in said
