"""Sparse-variable detection, α measurement, the placement plan (Parallax Table 3) and ``sparsync plan``."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from sparsync.plan import Cluster, ServerModel
from sparsync.plan.detect import ParamStats, RowFractionMeter, sparse_param_names
from sparsync.plan.planner import estimates, make_plan, zipf_row_fraction
from sparsync_bench.cli import main
from sparsync_bench.lm import lm_stats


def candidates(s: ParamStats, c: Cluster) -> tuple[dict[str, tuple[float, float]], str]:
    """(bytes per machine, seconds) of every built-in kind that fits ``s``, and the SparCML algorithm."""
    est = estimates(s, c)
    sparse = est.get("sparse_allreduce")
    return {k: (e.nbytes, e.seconds) for k, e in est.items()}, sparse.detail if sparse else ""


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 4, sparse=True)
        self.dense_emb = nn.Embedding(10, 4)  # dense gradient: not sparse
        self.bag = nn.EmbeddingBag(50, 4, mode="sum")
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(x).sum(1) + self.bag(x % 50) + self.dense_emb(x % 10).sum(1))


def test_detects_sparse_parameters_and_measures_alpha() -> None:
    m = Model()
    assert sparse_param_names(m) == ["emb.weight", "bag.weight"]
    meter = RowFractionMeter(m)
    xs = [torch.tensor([[0, 1, 1, 2]]), torch.tensor([[3, 3, 3, 3]])]
    for x in xs:
        m(x).sum().backward()
        meter.end_step()
    meter.close()
    st = {s.name: s for s in meter.stats()}
    assert st["emb.weight"].sparse and st["emb.weight"].row_fraction == pytest.approx((3 / 100 + 1 / 100) / 2)
    assert st["bag.weight"].row_fraction == pytest.approx((3 / 50 + 1 / 50) / 2)
    assert not st["fc.weight"].sparse and st["fc.weight"].row_fraction == 1.0
    assert not st["dense_emb.weight"].sparse


def test_table3_transfer_formulas() -> None:
    w_rows, dim, a, N = 10_000, 64, 0.01, 8
    s = ParamStats("e", (w_rows, dim), a, True, row_fraction_machine=a)
    c, alg = candidates(s, Cluster(N, 1, 1e9, 1e-5))
    w = w_rows * dim * 4
    assert c["dense_allreduce"][0] == pytest.approx(4 * w * (N - 1) / N)
    assert c["ps"][0] == pytest.approx(4 * a * w * (N - 1) / N)
    assert alg in ("ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather", "allgather", "dense")
    # Table 3 sparse AR (allgatherv): 2αw(N-1), times (1 + c/(dim·isize)) for the one int32 index per row that
    # sparsync.allreduce(coo) sends (coo_to_stream's row stream), which the model picks here (few rows, 8 ranks).
    assert alg == "allgather"
    assert c["sparse_allreduce"][0] == pytest.approx(2 * a * w * (N - 1) * (1 + 4 / (4 * dim)))
    ag = candidates(s, Cluster(N, 1, 1e9, 1e-5))[0]
    assert ag["ps"][0] < ag["dense_allreduce"][0]


def test_lm_stats_describe_the_benchmark_model() -> None:
    """``sparsync plan --model lm`` plans the benchmark's SampledLM: the same parameter names and shapes."""
    from sparsync_bench.lm import SampledLM

    model = {n: tuple(p.shape) for n, p in SampledLM(1000, 8, 16).named_parameters()}
    assert {s.name: s.shape for s in lm_stats(1000, 8, 16, 64)} == model


def test_plan_picks_ps_for_sparse_and_allreduce_for_dense_and_honours_overrides() -> None:
    stats = lm_stats(100_000, 128, 256, 1280)
    plan = make_plan(stats, Cluster(16, 1, 1.25e8, 1e-4))
    assert plan.placement("emb.weight") == "ps"
    assert all(e.placement == "dense_allreduce" for e in plan.entries if e.name != "emb.weight")
    assert plan.seconds < plan.baseline_seconds()
    o = make_plan(stats, Cluster(16, 1, 1.25e8, 1e-4), overrides={"emb.weight": "dense_allreduce"})
    assert o.placement("emb.weight") == "dense_allreduce" and o.entries[0].overridden
    assert o.seconds == pytest.approx(o.baseline_seconds())
    # alpha = 1: PS and allreduce move the same bytes (Table 3, "m variables" column)
    full = make_plan([ParamStats("e", (1000, 64), 1.0, True)], Cluster(8, 1, 1.25e8, 1e-4))
    cand = full.entries[0].candidates
    assert cand["ps"][0] == pytest.approx(cand["dense_allreduce"][0])
    with pytest.raises(KeyError, match="unknown placement 'nope'"):
        make_plan(stats, Cluster(4), overrides={"emb.weight": "nope"})
    with pytest.raises(KeyError, match="unknown parameter 'x'"):
        make_plan(stats, Cluster(4), overrides={"x": "ps"})
    with pytest.raises(ValueError, match="is dense"):
        make_plan(stats, Cluster(4), overrides={"proj.weight": "ps"})
    lossy = make_plan(stats, Cluster(64, 1, 1.25e8, 1e-4), allow_lossy=True)
    # A sketch is a call per parameter (126 latencies at 64 machines); in the dense bucket a parameter costs its
    # bytes: only the largest LSTM weight (1 MB) saves more by the sketch than its call's latency costs.
    assert {e.name: e.placement for e in lossy.entries} == {
        "emb.weight": "ps",
        "lstm.weight_ih_l0": "dense_allreduce",
        "lstm.weight_hh_l0": "sketch",
        "lstm.bias_ih_l0": "dense_allreduce",
        "lstm.bias_hh_l0": "dense_allreduce",
        "proj.weight": "dense_allreduce",
        "proj.bias": "dense_allreduce",
    }
    for e in lossy.entries:  # no single move makes the step, priced whole, faster (the sketch allowed)
        for k in e.candidates:
            assert lossy.moved({e.name: k}).step_seconds >= lossy.step_seconds * (1 - 1e-9), (e.name, k)


def test_a_measured_server_prices_the_ps_placement() -> None:
    """With ``Cluster(server=ServerModel)`` the ps candidate costs three round trips plus the rows both ways at
    the measured rate, not the α-β model's latencies: a slow server loses the table to sparse allreduce."""
    stats = lm_stats(100_000, 128, 256, 1280)
    nominal = Cluster(16, 1, 1.25e8, 1e-4)
    assert make_plan(stats, nominal).placement("emb.weight") == "ps"
    emb = next(s for s in stats if s.name == "emb.weight")
    am = 1.0 - (1.0 - emb.row_fraction) ** 1
    fast = ServerModel(round_trip=1e-5, per_byte=1e-10)
    plan = make_plan(stats, replace(nominal, server=fast))
    entry = next(e for e in plan.entries if e.name == "emb.weight")
    # a table's pull, one round trip, and its rows both ways; the push and the chief's apply shared by the kind
    assert entry.candidates["ps"][1] == pytest.approx(1e-5 + 2e-10 * am * emb.nbytes)
    assert plan.placement("emb.weight") == "ps" and plan.shared["ps"] == pytest.approx(2e-5)
    (servers,) = [p for p in plan.step.parts if p.kind == "ps"]
    assert servers.seconds == pytest.approx(fast.step_seconds(am * emb.nbytes))  # three round trips in all
    slow = make_plan(stats, replace(nominal, server=ServerModel(round_trip=0.02, per_byte=1e-8)))
    assert slow.placement("emb.weight") == "sparse_allreduce"
    assert slow.as_dict()["cluster"]["server"] == {"round_trip": 0.02, "per_byte": 1e-8}
    with pytest.raises(ValueError, match="round_trip and per_byte must be finite and >= 0, got -1"):
        ServerModel(round_trip=-1, per_byte=0)


def test_zipf_row_fraction_matches_sampling() -> None:
    V, draws = 5000, 400
    g = np.random.default_rng(0)
    p = 1 / np.arange(1, V + 1)
    p /= p.sum()
    sampled = np.mean([np.unique(g.choice(V, draws, p=p)).size / V for _ in range(50)])
    assert zipf_row_fraction(V, draws) == pytest.approx(sampled, rel=0.03)
    assert zipf_row_fraction(V, 0) == 0.0


def test_cluster_validation() -> None:
    with pytest.raises(ValueError, match="machines"):
        Cluster(0)
    with pytest.raises(ValueError, match="bandwidth"):
        Cluster(4, bandwidth=0)
    with pytest.raises(ValueError, match="row_fraction"):
        ParamStats("x", (3,), 1.5, True)


def test_plan_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plans.json"
    assert (
        main(["plan", "--machines", "8,4096", "--bandwidth", "1gbit", "--latency", "100us", "--json", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "4096" in text and "emb.weight" in text
    plans = json.loads(out.read_text())
    assert [p["cluster"]["machines"] for p in plans] == [8, 4096]
    assert all(math.isfinite(p["seconds"]) for p in plans)
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps([{"name": "t", "shape": [50000, 32], "row_fraction": 0.001, "sparse": True}]))
    assert main(["plan", "--stats", str(stats), "--machines", "16", "--override", "t=sparse_allreduce"]) == 0
    assert "override" in capsys.readouterr().out
    stats.write_text("[{}]")
    assert main(["plan", "--stats", str(stats)]) == 2
    assert "needs name" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--override", "t=bogus"])


def test_sparse_allreduce_cost_counts_the_stream_allreduce_coo_sends() -> None:
    """The plan's per-rank input of a sparse allreduce is the COO gradient's row stream: an index per row."""
    from sparsync.collectives.tensor import coo_to_stream

    rows, dim, k = 5000, 16, 50
    emb = torch.nn.Embedding(rows, dim, sparse=True)
    emb(torch.arange(k) * 7).sum().backward()
    grad = emb.weight.grad
    assert grad is not None
    stream = coo_to_stream(grad)
    assert stream.indices is not None
    assert stream.row == dim and stream.nrows == k
    sent = stream.nbytes  # k int32 row indices and k·dim values
    s = ParamStats("e", (rows, dim), k / rows, True, row_fraction_machine=k / rows)
    c, alg = candidates(s, Cluster(2, 1, 1e9, 1e-5))
    assert alg == "allgather"  # 2 ranks, 1% of the rows: each sends its stream once and receives the other's
    assert c["sparse_allreduce"][0] == pytest.approx(2 * sent)


def test_measured_link_and_fused_dense_allreduce_pricing() -> None:
    from sparsync.costmodel import LinkModel, Problem, predict

    stats = lm_stats(100_000, 128, 256, 640)
    nominal = make_plan(stats, Cluster(4, 1, 1.25e8, 1e-4))
    no_gamma = LinkModel(alpha=1e-4, beta=1 / 1.25e8, gamma_sparse=0, gamma_dense=0, gamma_scatter=0)
    same = make_plan(stats, Cluster(4, measured=no_gamma))
    assert same.step_seconds == pytest.approx(nominal.step_seconds)  # a measured link equal to the nominal one
    # A measured link keeps its γ terms: the dense allreduce's reduction work is priced (one add per element in
    # the bucket's ring).
    dense_n = math.prod(nominal.entries[1].shape)
    worked = make_plan(stats, Cluster(4, measured=replace(no_gamma, gamma_dense=1e-9)))
    assert worked.entries[1].seconds - same.entries[1].seconds == pytest.approx(1e-9 * dense_n)
    slow = LinkModel(alpha=2e-3, beta=2 / 1.25e8, gamma_dense=1e-9)
    sp = make_plan(stats, Cluster(4, 1, 1.25e8, 1e-4, measured=slow), overrides={"emb.weight": "ps"})
    emb = sp.entries[0]
    # a table's pull (two latencies) and its bytes; the push and apply rounds (four) shared by the kind; no γ
    assert emb.seconds == pytest.approx(2 * 2e-3 + slow.beta * emb.bytes_per_machine / 2)
    assert sp.shared == {"ps": pytest.approx(4 * 2e-3)}
    # Fused: the six dense parameters as one allreduce of their total size, plus the PS entry.
    n = sum(math.prod(e.shape) for e in sp.entries[1:])
    want = emb.seconds + sp.shared["ps"] + predict("dense", Problem(4, n, (n,) * 4, 4, 4), slow)
    assert sp.fused_seconds == pytest.approx(want)
    # The step: DDP's buckets, last layer first: the first closes at 1 MiB (with the 1 MB LSTM weight in it),
    # the second holds the rest; each a ring of 2(P-1) latencies without sparsync's metadata round; the servers'
    # part as in the fused price.
    buckets = [p for p in sp.step.parts if p.kind == "dense_allreduce"]
    assert [len(b.members) for b in buckets] == [5, 1] and {b.algorithm for b in buckets} == {"ring"}
    assert buckets[1].members == ("lstm.weight_ih_l0",)
    sizes = [n - 1024 * 128, 1024 * 128]
    rings = [6 * 2e-3 + 1.5 * 4 * k * slow.beta + 1e-9 * k for k in sizes]
    assert [b.seconds for b in buckets] == pytest.approx(rings)
    assert sp.step_seconds == pytest.approx(sum(rings) + emb.seconds + sp.shared["ps"])
    assert json.dumps(sp.as_dict())  # the measured link serialises


def test_grouped_pricing_is_one_grouped_call_as_wrap_optimizer_sends_it() -> None:
    """The embedding's rows and the MLP's dense gradients (packed as rows of the embedding's width, rows every
    rank holds) in one problem, priced as auto would run it: one metadata round and one set of latencies."""
    from sparsync.costmodel import LinkModel, Problem, choose_robust, predict

    link = LinkModel(alpha=1e-3, beta=1 / 8e8)
    stats = [ParamStats("emb", (65536, 32), 0.0072, True), ParamStats("w", (64, 32), 1.0, False),
             ParamStats("b", (64,), 1.0, False)]  # fmt: skip
    plan = make_plan(stats, Cluster(4, measured=link), overrides={"emb": "sparse_allreduce"})
    dense_rows = -(-(64 * 32 + 64) // 32)
    k = round(0.0072 * 65536) + dense_rows
    p = Problem(4, 65536 + dense_rows, (k,) * 4, 4 * 32, 4, row=32)
    d = choose_robust(p, link)
    assert plan.grouped_seconds == pytest.approx(d.predictions[d.algorithm])
    assert plan.grouped_seconds < plan.step_seconds  # one call instead of a bucket and a grouped call
    # No sparse-allreduce parameter: the fused dense allreduce. Dense gradients above Grouped.max_dense go to
    # one fused dense allreduce beside the grouped call.
    dense_only = make_plan(stats[1:], Cluster(4, measured=link))
    assert dense_only.grouped_seconds == pytest.approx(dense_only.fused_seconds)
    big = [stats[0], ParamStats("w", (1024, 1024), 1.0, False)]
    bp = make_plan(big, Cluster(4, measured=link), overrides={"emb": "sparse_allreduce"})
    n = 1024 * 1024
    alone = make_plan(big[:1], Cluster(4, measured=link), overrides={"emb": "sparse_allreduce"}).grouped_seconds
    assert bp.grouped_seconds == pytest.approx(alone + predict("dense", Problem(4, n, (n,) * 4, 4, 4), link))


def test_fused_and_grouped_pricing_read_the_item_size() -> None:
    """float64 parameters put twice the bytes of float32 ones on the wire: the fused dense allreduce of a
    (64, 64) float64 weight costs what a (128, 64) float32 one costs. One fused call per item size (one flat
    buffer per dtype, ``DenseAllreduce``), and dense gradients pack only behind a sparse group of their item
    size (``Grouped`` groups by dtype)."""
    from sparsync.costmodel import LinkModel, Problem, choose_robust, predict

    link = LinkModel(alpha=1e-3, beta=1 / 8e8, gamma_sparse=0, gamma_dense=0, gamma_scatter=0)  # latencies + bytes
    cluster = Cluster(4, measured=link)
    f64 = make_plan([ParamStats("w", (64, 64), 1.0, False, itemsize=8)], cluster)
    f32 = make_plan([ParamStats("w", (64, 64), 1.0, False)], cluster)
    twice = make_plan([ParamStats("w", (128, 64), 1.0, False)], cluster)
    assert f64.entries[0].itemsize == 8
    assert f64.entries[0].bytes_per_machine == 2 * f32.entries[0].bytes_per_machine
    assert f64.fused_seconds == pytest.approx(twice.fused_seconds) and f64.fused_seconds > f32.fused_seconds
    mixed = make_plan([ParamStats("w", (64, 64), 1.0, False, itemsize=8), ParamStats("b", (64,), 1.0, False)],
                      cluster)  # fmt: skip
    w, bias = Problem(4, 4096, (4096,) * 4, 8, 4), Problem(4, 64, (64,) * 4, 4, 4)
    assert mixed.fused_seconds == pytest.approx(predict("dense", w, link) + predict("dense", bias, link))
    # Grouped: the float64 embedding's rows weigh 8 bytes per value, and the float64 dense weight packs behind it.
    emb = ParamStats("emb", (65536, 32), 0.0072, True, itemsize=8)
    plan = make_plan([emb, ParamStats("w", (64, 32), 1.0, False, itemsize=8)], cluster,
                     overrides={"emb": "sparse_allreduce"})  # fmt: skip
    k = round(0.0072 * 65536) + 64
    d = choose_robust(Problem(4, 65536 + 64, (k,) * 4, 8 * 32, 4, row=32), link)
    assert plan.grouped_seconds == pytest.approx(d.predictions[d.algorithm])
    # A float32 dense weight does not join the float64 rows: its own fused dense allreduce.
    apart = make_plan([emb, ParamStats("w", (64, 32), 1.0, False)], cluster, overrides={"emb": "sparse_allreduce"})
    k = round(0.0072 * 65536)
    d = choose_robust(Problem(4, 65536, (k,) * 4, 8 * 32, 4, row=32), link)
    dense = predict("dense", Problem(4, 2048, (2048,) * 4, 4, 4), link)
    assert apart.grouped_seconds == pytest.approx(d.predictions[d.algorithm] + dense)


# --- two levels -------------------------------------------------------------------------------------
def _two_level_plan(intra_bw: float, density: float = 1e-2, **kw: object) -> tuple[str, float, float]:
    stats = [ParamStats("v", (1_000_000, 16), density, True)]
    c = Cluster(2, 4, 1.25e8, 1e-4, intra_bandwidth=intra_bw, **kw)  # type: ignore[arg-type]
    e = make_plan(stats, c, overrides={"v": "sparse_allreduce"}).entries[0]
    return e.detail, e.seconds, e.bytes_per_machine


def test_two_level_plan_prices_the_hierarchical_call_with_price_levels() -> None:
    from sparsync.collectives.hierarchical import HIER_MARGIN, price_levels
    from sparsync.costmodel import Problem

    detail, seconds, nbytes = _two_level_plan(2.5e9)
    assert detail.startswith("hierarchical:") and "flat" in detail, detail
    # The same numbers as the function hierarchical_allreduce(mode="auto") decides with, on the nominal links.
    c = Cluster(2, 4, 1.25e8, 1e-4, intra_bandwidth=2.5e9)
    world, intra, inter = c.level_links()
    assert inter.beta == pytest.approx(4 / 1.25e8) and intra.beta == pytest.approx(1 / 2.5e9)
    am = 1 - (1 - 1e-2) ** 4
    worker, machine = round(1e-2 * 1_000_000), round(am * 1_000_000)
    two = 1_000_000 * (1 - (1 - machine / 1_000_000) ** 2)  # two machines' rows, independent of each other
    p = Problem(8, 1_000_000, (worker,) * 8, 64, 4, row=16, unions=((1.0, worker), (4.0, machine), (8.0, two)))
    preds = price_levels(p, [[0, 1, 2, 3], [4, 5, 6, 7]], world, intra, inter)
    assert (
        seconds == pytest.approx(preds["hierarchical"])
        and preds["hierarchical"] * (1 + HIER_MARGIN) < preds["flat"]
    )
    assert 0 < nbytes < 4 * 1e-2 * 64e6 * 4  # less than every rank's rows sent over the NIC both ways
    # An intra-machine link slower than the network: the flat call wins.
    detail, _, _ = _two_level_plan(1e6)
    assert detail.startswith("flat:"), detail
    # One rank per machine or no intra link: one level, as before.
    single = Cluster(2, 1, 1.25e8, 1e-4, intra_bandwidth=2.5e9)
    one = make_plan([ParamStats("v", (1_000_000, 16), 1e-2, True)], single, overrides={"v": "sparse_allreduce"})
    assert not one.entries[0].detail.startswith(("hierarchical", "flat"))


def test_price_levels_refuses_unequal_hosts() -> None:
    from sparsync.collectives.hierarchical import price_levels
    from sparsync.costmodel import LinkModel, Problem

    link = LinkModel(alpha=1e-4, beta=1e-8, gamma_sparse=0, gamma_dense=0, gamma_scatter=0)
    with pytest.raises(ValueError, match=r"members \[2, 1\] are not equal hosts of the world's 3 ranks"):
        price_levels(Problem(3, 100, (5, 5, 5), 4, 4), [[0, 1], [2]], link, link, link)


def test_levels_from_benchmark_json_and_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import asdict

    from sparsync.costmodel import LinkModel
    from sparsync.plan.planner import levels_from_json

    links = [LinkModel(alpha=a, beta=b, gamma_sparse=1e-8, gamma_dense=1e-9, gamma_scatter=1e-9)
             for a, b in ((1e-4, 1e-9), (2e-5, 5e-10), (3e-4, 3.2e-8))]  # fmt: skip
    measured = dict(zip(("world", "intra", "inter"), map(asdict, links), strict=True))
    bench = {
        "meta": {},
        "rows": [{"method": "auto", "levels": None}, {"method": "hierarchical", "levels": measured}],
    }
    assert levels_from_json(json.loads(json.dumps(bench))) == tuple(links)
    for bad, msg in (({"rows": [{"method": "auto"}]}, "no row with measured levels"),
                     ({"rows": [{"levels": {"world": {"alpha": 1}, "intra": {}, "inter": {}}}]}, "not LinkModel"),
                     (3, "expected a benchmark JSON")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            levels_from_json(bad)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps([{"name": "v", "shape": [1_000_000, 16], "row_fraction": 0.01, "sparse": True}]))
    argv = ["plan", "--stats", str(stats), "--machines", "2", "--procs-per-machine", "4", "--levels", str(path)]
    assert main([*argv, "--override", "v=sparse_allreduce"]) == 0
    out = capsys.readouterr().out
    assert "hierarchical" in out and "flat" in out, out


def test_plan_cli_prices_dlrm_at_any_world_and_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``sparsync plan --model dlrm --world W --link L``: DLRM's 26 tables and MLPs (``dlrm_stats``), the sharded
    kind among the choices with its one exchange's latency shown once, at a scale this machine cannot run."""
    from sparsync_bench.criteo import table_rows
    from sparsync_bench.dlrm import dlrm_stats

    out = tmp_path / "plans.json"
    assert main(["plan", "--model", "dlrm", "--world", "4,256", "--link", "25gbit", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tables.25.weight" in text and "top.4.bias" in text and "0.45 ms shared + each its own" in text
    plans = json.loads(out.read_text())
    assert [p["cluster"]["machines"] for p in plans] == [4, 256]
    assert plans[0]["cluster"]["bandwidth"] == pytest.approx(25e9 / 8)
    stats = dlrm_stats(table_rows(100_000), 16, 512)
    assert [e["name"] for e in plans[0]["entries"]] == [s.name for s in stats]
    assert [e["row_fraction"] for e in plans[0]["entries"]] == [s.row_fraction for s in stats]
    kinds = [{e["placement"] for e in p["entries"] if e["name"].startswith("tables.")} for p in plans]
    assert "sharded" in kinds[0] and plans[0]["shared"]["sharded"] > 0  # priced once, in the plan's seconds
    entries = plans[0]["entries"]
    assert plans[0]["seconds"] == pytest.approx(sum(e["seconds"] for e in entries) + plans[0]["shared"]["sharded"])
    assert all("sharded" in e["candidates"] for e in entries if e["name"].startswith("tables.1."))
