"""DLRM and Criteo's text format: the generator writes the format with Kaggle's cardinalities and
power-law frequencies, the reader parses it (and a hand-written file) exactly and names bad lines; the model
has the reference architecture's shapes and learns; the benchmark's methods train to the same loss."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sparsync_bench.criteo import KAGGLE_CARDINALITIES, read_criteo, table_rows, write_criteo
from sparsync_bench.dlrm import DLRM


def test_the_generator_writes_criteo_lines_with_kaggle_cardinalities_and_skewed_categories(tmp_path: Path) -> None:
    path = write_criteo(tmp_path / "c.txt", 4000, seed=3)
    lines = path.read_text().splitlines()
    assert len(lines) == 4000 and all(len(line.split("\t")) == 40 for line in lines)
    b = read_criteo(path)
    assert b.dense.shape == (4000, 13) and b.sparse.shape == (4000, 26) and b.label.shape == (4000,)
    assert set(b.label.unique().tolist()) <= {0.0, 1.0} and 0.05 < float(b.label.mean()) < 0.95
    assert len(KAGGLE_CARDINALITIES) == 26 and sum(KAGGLE_CARDINALITIES) > 33_000_000
    assert bool((b.sparse < torch.tensor(KAGGLE_CARDINALITIES)).all())
    # power law: on the 10M-row feature the most frequent row takes a large share of 4000 draws
    _, counts = np.unique(b.sparse[:, 2].numpy(), return_counts=True)
    assert counts.max() > 100, counts.max()
    assert write_criteo(tmp_path / "d.txt", 4000, seed=3).read_text() == path.read_text()  # seeded


def test_the_reader_parses_by_hand_and_names_bad_lines(tmp_path: Path) -> None:
    cats = ["0000000a", ""] + ["ff"] * 24
    good = "\t".join(["1", "3", "", "-2", *["0"] * 10, *cats])
    (tmp_path / "ok.txt").write_text(good + "\n")
    b = read_criteo(tmp_path / "ok.txt", max_rows=7)
    np.testing.assert_allclose(b.dense[0, :3].numpy(), [np.log1p(3), 0.0, 0.0])  # empty and negative: 0
    assert b.sparse[0, 0] == 10 % min(1460, 7) and b.sparse[0, 1] == 0 and b.sparse[0, 2] == 255 % 7
    assert table_rows(7)[:3] == [7, 7, 7] and table_rows(None)[8] == 3
    (tmp_path / "short.txt").write_text(good + "\n" + "1\t2\n")
    with pytest.raises(ValueError, match=r"short\.txt:2: 2 fields, want 40"):
        read_criteo(tmp_path / "short.txt")
    (tmp_path / "nan.txt").write_text(good.replace("\t3\t", "\tx\t", 1) + "\n")
    with pytest.raises(ValueError, match=r"nan\.txt:1: .*'x'"):
        read_criteo(tmp_path / "nan.txt")
    (tmp_path / "label.txt").write_text("2" + good[1:] + "\n")
    with pytest.raises(ValueError, match="label 2 on sample 1"):
        read_criteo(tmp_path / "label.txt")
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        table_rows(0)


def test_tensorboard_is_checked_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench dlrm --tensorboard`` without tensorboard refuses before it writes anything (the generated
    Criteo file is megabytes at the default size). tensorboard is made unimportable, installed or not."""
    from sparsync_bench.cli import main
    from sparsync_bench.tensorboard import MISSING

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.chdir(tmp_path)  # the data file would be results/criteo_synthetic.txt
    argv = ["bench", "dlrm", "--tensorboard", "tb", "--procs", "1", "--steps", "1", "--batch", "4", "--out", "d"]
    assert main(argv) == 2
    assert MISSING in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_dlrm_shapes_and_learning(tmp_path: Path) -> None:
    rows = table_rows(1000)
    torch.manual_seed(0)  # the model's initialisation too: not whatever earlier tests left in the global RNG
    m = DLRM(rows, 8, bottom=(13, 16, 8), top=(32, 1))
    assert len(m.tables) == 26 and m.top[0].in_features == 8 + 27 * 26 // 2
    assert all(t.sparse for t in m.tables)
    b = read_criteo(write_criteo(tmp_path / "c.txt", 6000, seed=1), max_rows=1000)
    opt = torch.optim.SGD(m.parameters(), lr=0.2)
    loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
    with torch.no_grad():
        first = float(loss_fn(m(b.dense[5000:], b.sparse[5000:]), b.label[5000:]))
    for i in range(0, 5000, 100):  # one epoch (more overfits the rare categories' rows)
        opt.zero_grad()
        loss_fn(m(b.dense[i : i + 100], b.sparse[i : i + 100]), b.label[i : i + 100]).backward()
        opt.step()
        grads = [t.weight.grad for t in m.tables]
        assert all(g is not None and g.is_sparse for g in grads)
    with torch.no_grad():
        held_out = float(loss_fn(m(b.dense[5000:], b.sparse[5000:]), b.label[5000:]))
    assert held_out < first - 0.05, (first, held_out)
    with pytest.raises(ValueError, match="must end at the embedding width 8"):
        DLRM(rows, 8, bottom=(13, 16))


@pytest.mark.multiprocess
def test_bench_methods_train_to_the_same_loss_and_sparsync_sends_less(tmp_path: Path) -> None:
    from _optim_workers import dlrm_worker_nominal_link

    from sparsync import launch
    from sparsync_bench.dlrm_train import DlrmBenchConfig, load, summarize

    cfg = DlrmBenchConfig(str(write_criteo(tmp_path / "c.txt", 2 * 6 * 32)), steps=6, batch=32, max_rows=2000,
                          dim=8, warmup=1, tail=3)  # fmt: skip
    res = launch(dlrm_worker_nominal_link, nprocs=2, args=(cfg, load(cfg, 2)))
    rows = {r["method"]: r for r in summarize(res[0])}
    assert set(rows) == {"torch_ddp_dense", "torch_ddp_sparse", "sparsync", "sparsync_dct"}
    base = rows["torch_ddp_sparse"]
    for m in ("torch_ddp_dense", "sparsync"):  # the same SGD steps on the same means: rounding apart
        assert rows[m]["loss"] == pytest.approx(base["loss"], rel=1e-5), (m, rows[m]["loss"], base["loss"])
        assert rows[m]["param_abs_sum"] == pytest.approx(base["param_abs_sum"], rel=1e-5), m
    for m in ("torch_ddp_dense", "sparsync"):
        assert rows[m]["tables_moved"] == pytest.approx(base["tables_moved"], rel=1e-6), (m, rows[m], base)
    assert base["tables_moved"] > 0
    assert rows["sparsync"]["bytes_per_step"] < rows["torch_ddp_dense"]["bytes_per_step"] / 5
    assert all(r["bytes_per_step"] > 0 and r["step_s"] > 0 for r in rows.values())
    assert rows["sparsync_dct"]["bytes_per_step"] < rows["sparsync"]["bytes_per_step"]


@pytest.mark.multiprocess
def test_omnireduce_and_sketch_methods_on_the_large_tables(tmp_path: Path) -> None:
    """S2's comparison on DLRM (sparsync reproduce): the OmniReduce-style allreduce is exact, so it trains to
    sparsync's loss; the sketch is lossy but trains, and sends bytes."""
    from sparsync import launch
    from sparsync_bench.dlrm_train import DlrmBenchConfig, load, summarize, worker

    cfg = DlrmBenchConfig(str(write_criteo(tmp_path / "c.txt", 3 * 6 * 32)), steps=6, batch=32, max_rows=2000,
                          dim=8, warmup=1, tail=3, large_table_rows=500,
                          methods=("sparsync", "sparsync_omnireduce", "sparsync_sketch"))  # fmt: skip
    rows = {r["method"]: r for r in summarize(launch(worker, nprocs=3, args=(cfg, load(cfg, 3)))[0])}
    base, omni, sk = rows["sparsync"], rows["sparsync_omnireduce"], rows["sparsync_sketch"]
    assert omni["loss"] == pytest.approx(base["loss"], rel=1e-5)
    assert omni["param_abs_sum"] == pytest.approx(base["param_abs_sum"], rel=1e-5)
    assert omni["tables_moved"] == pytest.approx(base["tables_moved"], rel=1e-6) and base["tables_moved"] > 0
    assert omni["bytes_per_step"] != base["bytes_per_step"]  # the large tables went another way
    assert sk["bytes_per_step"] > 0 and math.isfinite(sk["loss"]) and sk["param_abs_sum"] != base["param_abs_sum"]
    with pytest.raises(KeyError, match="unknown methods"):
        DlrmBenchConfig("x", methods=("sparsync_nope",))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_parameter_server_methods_train_to_the_same_loss(tmp_path: Path) -> None:
    """Parallax's PS, OptPS and HYB placements on DLRM (servers started by run_dlrm_bench, server-side SGD at
    the same lr, sync, mean): the same SGD steps as sparsync's allreduce, so the same loss to rounding."""
    from sparsync_bench.bench.dlrm import run_dlrm_bench
    from sparsync_bench.dlrm_train import DlrmBenchConfig

    cfg = DlrmBenchConfig(str(write_criteo(tmp_path / "c.txt", 3 * 6 * 32)), steps=6, batch=32, max_rows=2000,
                          dim=8, warmup=1, tail=3,
                          methods=("sparsync", "sparsync_ps", "sparsync_ps_split", "sparsync_hybrid"))  # fmt: skip
    rows = {r["method"]: r for r in run_dlrm_bench(cfg, (3,), out=tmp_path / "d")}
    base = rows["sparsync"]
    for m in ("sparsync_ps", "sparsync_ps_split", "sparsync_hybrid"):
        assert rows[m]["loss"] == pytest.approx(base["loss"], rel=1e-5), m
        assert rows[m]["param_abs_sum"] == pytest.approx(base["param_abs_sum"], rel=1e-5), m
        assert rows[m]["bytes_per_step"] > 0 and rows[m]["step_s"] > 0, m
    assert base["tables_moved"] > 0
    for m in ("sparsync_ps", "sparsync_ps_split", "sparsync_hybrid"):  # the servers' tables, read at the end
        assert rows[m]["tables_moved"] == pytest.approx(base["tables_moved"], rel=1e-6), (m, rows[m], base)


def _shard_exchange_bytes(cfg: Any, data: Any, P: int) -> float:
    """What rank 0 sends per step in the exchanges of every table sharded (docs/sharding.md's rounds), from the
    samples alone: its blocks of ids to the other owners (a 4-word header, a count per table group, one here: the
    26 tables share a width, the distinct ids that owner owns, zero-padded to the capacity that the last step's
    widest count set: ``sharding.ids``), the rows it serves the other ranks, and one gradient row per distinct id
    owned elsewhere."""
    from sparsync.sharding.ids import capacity_after
    from sparsync_bench.dlrm_train import rank_samples

    batches = [rank_samples(data, i, P, cfg).sparse for i in range(P)]
    tables, row = batches[0].shape[1], 4 * cfg.dim
    total, capacity = 0, 0
    for s in range(cfg.steps):
        ids = [b[s * cfg.batch : (s + 1) * cfg.batch] for b in batches]
        distinct = [[torch.unique(x[:, t]) for t in range(tables)] for x in ids]
        counts = [[1 + sum(int((d % P == j).sum()) for d in mine) for j in range(P)] for mine in distinct]
        total += 8 * 4 * (P - 1) + sum(8 * max(capacity, counts[0][j]) for j in range(1, P))
        for t in range(tables):
            elsewhere = int((distinct[0][t] % P != 0).sum())
            served = sum(int((distinct[i][t] % P == 0).sum()) for i in range(1, P))
            total += row * elsewhere + row * served
        capacity = capacity_after(max(max(c) for c in counts))
    return total / cfg.steps


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sharded_methods_train_to_sparsyncs_loss_and_count_the_exchanges(tmp_path: Path) -> None:
    """``sparsync_sharded`` (every table's rows owned by the ranks) and ``sparsync_auto`` (the plan's tables) take
    the same SGD steps as ``sparsync``'s allreduce: the owner sums the ranks' gradient rows, DistributedOptimizer
    divides by P, so only the summation order separates them. At P = 3 the 4-row table's shards are uneven and
    the 3-row table's are one row each. Their bytes per step are the shards' exchanges, counted from the samples,
    plus the MLPs' allreduce."""
    from _optim_workers import dlrm_worker_nominal_link

    from sparsync import launch
    from sparsync_bench.ddp_baseline import ring_allreduce_bytes
    from sparsync_bench.dlrm_train import DlrmBenchConfig, dlrm_model, load, summarize

    P = 3
    cfg = DlrmBenchConfig(str(write_criteo(tmp_path / "c.txt", P * 6 * 32)), steps=6, batch=32, max_rows=2000,
                          dim=8, warmup=1, tail=3,
                          methods=("sparsync", "sparsync_sharded", "sparsync_auto", "sparsync_sharded_bf16",
                                   "sparsync_sharded_lookahead", "sparsync_sharded_fused",
                                   "sparsync_replicated_fused", "sparsync_sharded_fused_lookahead",
                                   "sparsync_sharded_fused_ddp", "sparsync_auto_fused_ddp",
                                   "sparsync_sharded_fused_lookahead_ddp"))  # fmt: skip
    data = load(cfg, P)
    rows = {r["method"]: r for r in summarize(launch(dlrm_worker_nominal_link, nprocs=P, args=(cfg, data))[0])}
    base = rows["sparsync"]
    assert base["tables_moved"] > 0 and base["tables_sharded"] == 0 and base["shard_bytes_per_step"] == 0
    for m in (
        "sparsync_sharded",
        "sparsync_auto",
        "sparsync_sharded_fused",
        "sparsync_replicated_fused",
        "sparsync_sharded_fused_ddp",
        "sparsync_auto_fused_ddp",
    ):
        assert rows[m]["loss"] == pytest.approx(base["loss"], rel=1e-5), (m, rows[m]["loss"], base["loss"])
        assert rows[m]["param_abs_sum"] == pytest.approx(base["param_abs_sum"], rel=1e-5), m
        assert rows[m]["tables_moved"] == pytest.approx(base["tables_moved"], rel=1e-6), (m, rows[m], base)
        assert rows[m]["step_s"] > 0 and rows[m]["bytes_per_step"] > rows[m]["shard_bytes_per_step"], m
    assert rows["sparsync_replicated_fused"]["tables_sharded"] == 0  # every table whole, in replicated groups
    sharded = rows["sparsync_sharded"]
    assert sharded["tables_sharded"] == 26
    exchanges = _shard_exchange_bytes(cfg, data, P)
    assert sharded["shard_bytes_per_step"] == pytest.approx(exchanges, rel=1e-12)
    # SGD fused into the tables' backward: the same exchanges, nothing more on the wire
    assert rows["sparsync_sharded_fused"]["shard_bytes_per_step"] == sharded["shard_bytes_per_step"]
    # the rest is the MLPs' gradients by a ring allreduce (within 1%: a few hundred bytes of agreement rounds)
    mlps = sum(p.numel() * 4 for n, p in dlrm_model(cfg, True).named_parameters() if not n.startswith("tables."))
    mlp_bytes = ring_allreduce_bytes(mlps, P).sent
    assert sharded["bytes_per_step"] - exchanges == pytest.approx(mlp_bytes, rel=0.01), (sharded, mlp_bytes)
    # the table's columns: the MLPs' ring allreduce, every method alike, and the rest
    assert all(r["dense_bytes_per_step"] == mlp_bytes for r in rows.values())
    assert sharded["table_bytes_per_step"] == pytest.approx(exchanges, rel=0.05)
    # the predicted step: the sample's measured forward and backward, plus the communication it waits for
    for m in ("sparsync_sharded", "sparsync_auto", "sparsync_sharded_bf16"):
        assert rows[m]["predicted_step_s"] > 0 and rows[m]["predicted_comm_s"] > 0, (m, rows[m])
    # the cost model's bytes, priced on the first batch's distinct rows, against the six steps' exchanges
    assert sharded["predicted_shard_bytes_per_step"] == pytest.approx(exchanges, rel=0.1), (sharded, exchanges)
    # bf16 rows: the same ids, half the rows' and gradient rows' bytes; lossy, near fp32's loss
    low = rows["sparsync_sharded_bf16"]
    assert low["tables_sharded"] == 26 and low["loss"] == pytest.approx(sharded["loss"], rel=1e-3)
    assert low["param_abs_sum"] != sharded["param_abs_sum"]
    assert exchanges / 2 < low["shard_bytes_per_step"] < exchanges
    # the lookahead: the same training, bit for bit; the same exchanges, each rows round's blocks opening with one
    # fp32 verdict word
    ahead = rows["sparsync_sharded_lookahead"]
    for key in ("loss", "first_loss", "param_abs_sum", "tables_moved"):
        assert ahead[key] == sharded[key], (key, ahead[key], sharded[key])
    assert ahead["shard_bytes_per_step"] == pytest.approx(exchanges + 4 * (P - 1), rel=1e-12)
    fused, fused_ahead = rows["sparsync_sharded_fused"], rows["sparsync_sharded_fused_lookahead"]
    for key in ("loss", "first_loss", "param_abs_sum", "tables_moved"):  # with the SGD in backward too
        assert fused_ahead[key] == fused[key], (key, fused_ahead[key], fused[key])
    # the MLPs in torch's DDP beside the tables trained in backward: the same exchanges, and with Lookahead the
    # same training bit for bit
    ddp, ddp_ahead = rows["sparsync_sharded_fused_ddp"], rows["sparsync_sharded_fused_lookahead_ddp"]
    assert ddp["tables_sharded"] == 26 and ddp["shard_bytes_per_step"] == fused["shard_bytes_per_step"]
    # nothing in the log but the exchanges: the MLPs went by DDP (its ring allreduce, counted from their size)
    assert ddp["bytes_per_step"] - ddp["shard_bytes_per_step"] == pytest.approx(mlp_bytes, rel=1e-9), ddp
    for key in ("loss", "first_loss", "param_abs_sum", "tables_moved"):
        assert ddp_ahead[key] == ddp[key], (key, ddp_ahead[key], ddp[key])
    assert all(r["cpu_s"] > 0 for r in rows.values())
    assert low["predicted_shard_bytes_per_step"] == pytest.approx(low["shard_bytes_per_step"], rel=0.1), low


@pytest.mark.multiprocess
def test_the_floor_sends_the_mlps_alone_and_keeps_each_ranks_tables_its_own(tmp_path: Path) -> None:
    """``floor_tables_unsent``: on one rank it is DDP's step (nothing to send; DDP's sparse path sums a table's
    duplicate rows in another order, a rounding apart); on three its bytes are
    the MLPs' ring allreduce alone and its tables are not the averaged ones (each rank's own batch moved them)."""
    from sparsync import launch
    from sparsync_bench.ddp_baseline import ring_allreduce_bytes
    from sparsync_bench.dlrm_train import FLOOR, DlrmBenchConfig, _mlp_bytes, load, summarize, worker

    cfg = DlrmBenchConfig(str(write_criteo(tmp_path / "c.txt", 3 * 5 * 32)), steps=5, batch=32, max_rows=2000,
                          dim=8, warmup=1, tail=2, methods=("torch_ddp_sparse", FLOOR))  # fmt: skip
    for P in (1, 3):
        rows = {r["method"]: r for r in summarize(launch(worker, nprocs=P, args=(cfg, load(cfg, P)))[0])}
        base, floor = rows["torch_ddp_sparse"], rows[FLOOR]
        assert floor["bytes_per_step"] == ring_allreduce_bytes(_mlp_bytes(cfg), P).sent
        assert math.isfinite(floor["loss"]) and floor["step_s"] > 0
        if P == 1:
            assert floor["loss"] == pytest.approx(base["loss"], rel=1e-6)
            assert floor["param_abs_sum"] == pytest.approx(base["param_abs_sum"], rel=1e-6)
        else:
            assert floor["bytes_per_step"] < base["bytes_per_step"]
            assert floor["tables_moved"] != pytest.approx(base["tables_moved"], rel=1e-3)
