"""The Replicator API against single-process references on real gloo groups."""

from __future__ import annotations

from typing import Any

import _replicator_workers as rw
import pytest
import torch
from _nccl_rules import check_clean

from sparsync.costmodel import ALGORITHMS
from sparsync.replicator import DCTMP, Replicator, split_batch
from sparsync.replicator import dctmp as dct


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"{k}: {m}")


# --- data parallel ---------------------------------------------------------------------------------------------
DP_RUNS = {n: [("per_worker", "default"), ("per_replica", "default")] for n in (1, 2, 3, 4)}
DP_RUNS[3] += [("per_worker", "explicit"), ("per_worker", "dense_sum"), ("per_worker", "compressed")]


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def dp(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, Any]]]]:
    n = request.param
    return n, Replicator(num_replicas=n, record=True).start(rw.dp_program, DP_RUNS[n])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sync_dp_equals_single_process_on_concatenated_batches(dp: tuple[int, list[list[dict[str, Any]]]]) -> None:
    """N = 1, 2, 3, 4; PER_WORKER and PER_REPLICA; the default plan, and at N = 3 an explicit plan (SparCML
    split-allgather for the embedding, a CustomReduce for fc1) and an all-dense sum plan."""
    n, per_rank = dp
    for i, (mode, plan) in enumerate(DP_RUNS[n]):
        ref = rw.train_reference(mode, n)
        outs = [runs[i] for runs in per_rank]
        for o in outs:
            _close(o["state"], ref)
            assert o["sizes"] == [[rw.GLOBAL_BATCH // n] * n] * rw.STEPS  # every replica got its share
        assert all(o["losses"] == outs[0]["losses"] for o in outs)  # gathered outputs agree everywhere
        algs = outs[0]["algorithms"]
        assert "gloo" in algs  # the primitives' own collectives (the gathered losses)
        if plan == "explicit":
            assert "ssar_split_allgather" in algs  # the CustomReduce callable logs nothing itself
        elif plan == "default":
            # the dense bucket ("dense") and whatever auto chose for the embedding gradient (the dense switch
            # included): SparCML's algorithms only
            assert set(algs) - {"gloo"} and set(algs) - {"gloo"} <= set(ALGORITHMS), algs
        elif plan == "dense_sum":
            assert sorted(set(algs)) == ["dense", "gloo"]  # the dense bucket is the "dense" algorithm


# --- primitives --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[1, 3, "3-nccl"])
def prims(request: pytest.FixtureRequest) -> tuple[int, list[Any]]:
    """Every replica's results; "-nccl": under NCCL's rules on gloo (tests/_nccl_rules.py), checked clean here."""
    n = int(str(request.param).split("-")[0])
    if "nccl" not in str(request.param):
        return n, Replicator(num_replicas=n).start(rw.prims_and_errors)
    per_rank = Replicator(num_replicas=n).start(rw.prims_and_errors_under_nccl_rules)
    check_clean([p.pop("nccl_rules") for p, _ in per_rank])
    return n, per_rank


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_primitives_match_their_single_process_meaning(prims: tuple[int, list[Any]]) -> None:
    R, per_rank = prims
    outs = [p for p, _ in per_rank]
    vals = [rw.value_of(r) for r in range(R)]
    a = torch.stack([v["a"] for v in vals])
    b = torch.stack([v["b"][0] for v in vals])
    for r, o in enumerate(outs):
        torch.testing.assert_close(o["sum"]["a"], a.sum(0))
        assert torch.equal(o["sum"]["b"][0], b.sum(0))
        torch.testing.assert_close(o["mean"]["a"], a.mean(0))
        assert torch.equal(o["max"]["a"], a.max(0).values) and torch.equal(o["max"]["b"][0], b.max(0).values)
        assert torch.equal(o["min"]["a"], a.min(0).values) and torch.equal(o["min"]["b"][0], b.min(0).values)
        assert torch.equal(o["gather"]["a"], a) and torch.equal(o["gather"]["b"][0], b)
        assert torch.equal(o["broadcast"]["a"], a[R - 1]) and torch.equal(o["broadcast"]["b"][0], b[R - 1])
        torch.testing.assert_close(o["map_reduce"]["sq"], (a**2).sum(0))
        torch.testing.assert_close(o["map_gather"], a.sum(1))
        twice = torch.arange(R, dtype=torch.float32) * 2
        assert o["run_local"]["v"].tolist() == [2.0 * r]
        assert o["run_sum"]["v"].tolist() == [twice.sum().item()]
        assert o["run_mean"]["v"].tolist() == [twice.mean().item()]
        assert o["run_gather"]["v"].tolist() == twice.view(R, 1).tolist()
        # a custom input_split_fn (time-major: split dim 1), PER_WORKER
        seq = rw.sequence_input(0)
        assert [t.tolist() for t in o["sequences"]] == [torch.chunk(s, R, dim=1)[r].tolist() for s in seq]
        # gradients: the single-process autograd of the total objective Σ_q y_q w.r.t. replica r's input
        xs = [v["a"].clone().requires_grad_(True) for v in vals]
        total = sum(
            (
                (sum(xs) * (torch.arange(6, dtype=torch.float64).view(3, 2) + q)).sum()
                + (xs[0] * (torch.arange(6, dtype=torch.float64).view(3, 2) + q)).sum()
                + (xs[R - 1] ** 2 * (torch.arange(6, dtype=torch.float64).view(3, 2) + q)).sum()
            )
            for q in range(R)
        )
        total.backward()  # type: ignore[union-attr]
        torch.testing.assert_close(o["grad"], xs[r].grad)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_cross_replica_batch_norm_equals_full_batch(prims: tuple[int, list[Any]]) -> None:
    R, per_rank = prims
    outs = [p for p, _ in per_rank]
    hs = [rw.bn_input(r).requires_grad_(True) for r in range(R)]
    full = torch.cat(hs)
    z = torch.nn.functional.batch_norm(full, None, None, training=True, eps=1e-5)
    w = torch.arange(12, dtype=torch.float64).view(4, 3).repeat(R, 1)
    (z * w).sum().backward()
    for r, o in enumerate(outs):
        torch.testing.assert_close(o["bn"], z.detach()[4 * r : 4 * r + 4])
        torch.testing.assert_close(o["bn_grad"], hs[r].grad)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bad_input_is_reported_on_every_replica(prims: tuple[int, list[Any]]) -> None:
    R, per_rank = prims
    if R != 3:
        pytest.skip("errors are checked on 3 replicas")
    outs = [e for _, e in per_rank]
    for r, o in enumerate(outs):
        for key, words in (
            ("shape", ["replica 1", "(4,)", "(3,)"]),
            ("dtype", ["replica 1", "float64"]),
            ("structure", ["replica 1"]),
            ("order", ["collective mismatch", "all_gather", "all_reduce"]),
            ("vs_sparse", ["collective mismatch", "sparse_allreduce"]),
            ("source", ["unknown replica id 7"]),
            ("batch_size", ["13", "not divisible", "num_replicas=3"]),
            ("split", ["7", "not divisible"]),
            ("device", ["unknown logical device 2"]),
            ("op", ["prod"]),
            ("outputs", ["median"]),
        ):
            kind, msg = o[key]
            assert kind == "ValueError", (r, key, o[key])
            for w in words:
                assert w in msg, (r, key, msg)
        assert o["after"] == ("ok", 3.0)


def test_replicator_config_errors() -> None:
    with pytest.raises(ValueError, match="num_replicas"):
        Replicator(num_replicas=0)
    with pytest.raises(ValueError, match="devices_per_replica"):
        Replicator(devices_per_replica=0)
    with pytest.raises(ValueError, match="eta"):
        DCTMP(1.0)
    with pytest.raises(ValueError, match="not divisible"):
        Replicator(num_replicas=4).per_replica_batch_size(10)
    assert Replicator(num_replicas=4).per_replica_batch_size(12) == 3
    with pytest.raises(ValueError, match="not divisible"):
        split_batch({"x": torch.zeros(5, 2)}, 2)


def test_single_process_runs_inline_and_sum_plan_needs_op() -> None:
    def prog(ctx: Any) -> Any:
        m = torch.nn.Linear(2, 1)
        with pytest.raises(ValueError, match="explicit mean or sum"):
            ctx.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=1.0), op="avg")
        with pytest.raises(KeyError, match="valid names"):
            ctx.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=1.0), op="sum", model=m, plan={"nope": None})
        return ctx.all_sum(torch.ones(2)).tolist(), ctx.replica_id, ctx.num_replicas

    assert Replicator().start(prog) == [([1.0, 1.0], 0, 1)]  # a local function: no spawn for one process


# --- model parallelism and DCT-MP --------------------------------------------------------------------------------
def _mp_params(outs: list[dict[str, Any]], replica: int = 0) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for o in outs:
        if o["replica"] == replica:
            got.update(o["params"])
    return got


ETAS: list[float | None] = [None, 0.0, 0.9]


@pytest.fixture(scope="module", params=[2, 3])
def split(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, Any]]]]:
    """One replica over k logical devices; one training run per DCT-MP setting in ETAS."""
    k = request.param
    return k, Replicator(num_replicas=1, devices_per_replica=k, record=True).start(rw.mp_program, ETAS, 2)


def _run(per_rank: list[list[dict[str, Any]]], eta: float | None) -> list[dict[str, Any]]:
    return [runs[ETAS.index(eta)] for runs in per_rank]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("eta", [None, 0.0])
def test_split_model_equals_unsplit(split: tuple[int, list[list[dict[str, Any]]]], eta: float | None) -> None:
    _k, per_rank = split
    outs = _run(per_rank, eta)
    _close(_mp_params(outs), rw.mp_reference(1, 2))
    assert len({o["loss"] for o in outs}) == 1  # fetched to every device
    if eta is None:  # devices whose step_fn diverged: the receiver names both transfer numbers
        kind, msg = next(o for o in outs if o["device"] == 1)["diverged"]
        assert kind == "ValueError" and "expected activation transfer #" in msg and "ran their step_fn" in msg


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dctmp_cuts_split_bytes_about_tenfold(split: tuple[int, list[list[dict[str, Any]]]]) -> None:
    k, per_rank = split

    def per_split(outs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, int]]:
        tot: dict[tuple[str, str], dict[str, int]] = {}
        for o in outs:
            for rec in o["records"]:
                t = tot.setdefault((rec["name"], rec["direction"]), {"values": 0, "mask": 0, "header": 0})
                t["values"] += rec["value_bytes"]
                t["mask"] += rec["mask_bytes"]
                t["header"] += rec["header_bytes"]
        return tot

    dense, comp = per_split(_run(per_rank, None)), per_split(_run(per_rank, 0.9))
    for runs in per_rank:  # the always-on totals agree with the detailed records
        from_records: dict[str, dict[str, int]] = {}
        for run in runs:
            for rec in run["records"]:
                d = from_records.setdefault(rec["name"], {"forward": 0, "backward": 0})
                d[rec["direction"]] += rec["value_bytes"] + rec["mask_bytes"] + rec["header_bytes"]
        assert runs[-1]["split_bytes"] == from_records
    assert sorted(dense) == sorted(comp) and len(dense) == 2 * (k - 1)  # forward + backward per split
    kept = DCTMP(0.9).kept(rw.MP_W)  # 26 of 256 per row
    for key in dense:
        d, c = dense[key], comp[key]
        assert c["values"] * rw.MP_W == d["values"] * kept  # values fall exactly by k/d (9.8x)
        if key[1] == "backward":
            assert c["mask"] == 0  # the sender still holds the mask
        total = sum(d.values()) / sum(c.values())
        assert total > (9.0 if key[1] == "backward" else 6.5), (key, d, c)
    both = sum(sum(v.values()) for v in dense.values()) / sum(sum(v.values()) for v in comp.values())
    assert both > 7.5, both  # forward + backward, masks and headers included


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dctmp_gradient_is_exactly_zero_outside_the_mask(split: tuple[int, list[list[dict[str, Any]]]]) -> None:
    k, per_rank = split
    if k != 3:
        pytest.skip("stage 0's output crosses a split only with 3 devices")
    outs = _run(per_rank, 0.9)
    src = next(o for o in outs if o["device"] == 0)
    dst = next(o for o in outs if o["device"] == 1)
    act, grad = src["act0"], src["act0_grad"]
    mask = rw.kept_mask(act, 0.9)
    assert grad is not None
    assert torch.count_nonzero(grad[~mask]) == 0
    assert torch.count_nonzero(grad[mask]) > 0.9 * int(mask.sum())
    # the receiver got exactly X ⊙ M (DCT Alg. 2 lines 10-11)
    assert torch.equal(dst["inputs"]["in1"], torch.where(mask, act, torch.zeros_like(act)))
    dense_src = next(o for o in _run(per_rank, None) if o["device"] == 0)
    torch.testing.assert_close(act, dense_src["act0"])  # the same forward up to the split


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hybrid_data_x_model_parallel_equals_single_process() -> None:
    outs = [runs[0] for runs in Replicator(num_replicas=2, devices_per_replica=2).start(rw.mp_program, [None], 2)]
    ref = rw.mp_reference(2, 2)
    for r in range(2):
        _close(_mp_params(outs, r), ref)


def test_dctmp_mask_round_trips() -> None:
    g = torch.Generator().manual_seed(0)
    for rows, d, eta in ((5, 7, 0.5), (3, 300, 0.9), (4, 40000, 0.99), (2, 64, 0.0), (1, 1, 0.9)):
        x = torch.randn(rows, d, generator=g)
        k = DCTMP(eta).kept(d)
        idx = dct.select(x, k)
        kind = dct.mask_kind(rows, d, k)
        buf = dct.encode_mask(idx, d, kind)
        assert buf.numel() == dct.mask_nbytes(rows, d, k, kind)
        assert torch.equal(
            dct.decode_mask(buf, rows, d, k, kind), idx if kind != "none" else torch.arange(d).expand(rows, d)
        )
        top = x.abs().topk(k, dim=1).values.min(1).values
        kept = dct.scatter_rows(dct.gather_rows(x, idx), idx, d)
        assert torch.all((kept != 0).sum(1) == k)
        assert torch.all(kept.abs().masked_fill(kept == 0, float("inf")).min(1).values >= top)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_demo_trains_every_plan_to_the_same_model() -> None:
    import json
    import re
    import statistics
    import tempfile
    from pathlib import Path

    from rich.console import Console

    from sparsync_bench.demo_plan import RUNS
    from sparsync_bench.train_demo import DemoConfig, plan_summary, print_demo, run_demo

    # the hybrid run, deterministically; the runs take turns in blocks of 2 steps (5 timed blocks)
    cfg = DemoConfig(steps=12, warmup=2, plan_pricing="assumed", block=2)
    runs, diff, plan = run_demo(cfg, show_progress=False)
    dense, ddp, sparse, auto = runs
    assert [r["run"] for r in runs] == ["dense", "ddp_sparse", "sparse", "auto"]
    assert diff < 1e-4  # the same SGD updates, all four runs
    # torch DDP with sparse gradients (DDP divides by P, then sums) trains the model the dense run trains.
    assert ddp["max_param_diff"] < 1e-5 and ddp["step_ms"] > 0
    for r in (ddp, sparse, auto):
        assert dense["final_loss"] == pytest.approx(r["final_loss"], abs=1e-4)
    # DDP's bytes (gloo's ring allreduce of the MLP, sparse allgather of the embedding's rows): far below dense.
    assert 0 < ddp["bytes_per_step"] < dense["bytes_per_step"] / 10
    assert sparse["final_loss"] < sparse["first_loss"]
    assert dense["bytes_per_step"] > 10 * sparse["bytes_per_step"]  # the embedding gradient travels sparse
    assert dense["algorithms"] == ["dense"]  # one dense allreduce (gloo's ring) of the flat bucket
    # The default plan sends the embedding and the MLP in one grouped sparse allreduce: no dense call.
    assert sparse["algorithms"] and "dense" not in sparse["algorithms"]
    # The automatic plan: the embedding (measured α < 1%) on the parameter server, the MLP by dense allreduce.
    emb = next(e for e in plan.entries if e.name == "emb.weight")
    assert 0 < emb.row_fraction < 0.05 and emb.placement == "ps"
    assert all(e.placement == "dense_allreduce" for e in plan.entries if e.name != "emb.weight")
    assert plan_summary(plan).startswith("plan chose: parameter server for emb.weight;")
    assert plan_summary(plan).endswith("(hybrid)")
    assert auto["plan"].startswith("auto plan: hybrid") and "ps" in auto["algorithms"]
    assert 0 < auto["bytes_per_step"] < sparse["bytes_per_step"]
    console = Console(record=True, width=200)
    with tempfile.TemporaryDirectory() as d:
        print_demo(runs, diff, cfg, console, Path(d) / "demo", None, plan)
        md = (Path(d) / "demo.md").read_text()
        meta = json.loads((Path(d) / "demo.json").read_text())
    assert "plan chose: parameter server for emb.weight" in md
    assert "| DDP (sparse grads) |" in md
    assert re.search(r"sparsync plan: step time [\d.]+x dense allreduce, [\d.]+x DDP \(sparse grads\)", md)
    fastest = min(runs, key=lambda r: r["step_ms"])
    assert f"fastest on loopback: {fastest['plan']} ({fastest['step_ms']:.1f} ms a step)" in md
    q = ddp["step_ms"] / sparse["step_ms"]
    assert f"{sparse['plan']} is {q:.2f}x faster than" in md if q >= 1 else f"{1 / q:.2f}x slower than" in md
    assert "target" not in md and " met" not in md  # a user's report: no internal targets
    assert "plan chose: parameter server for emb.weight" in console.export_text()
    # Each priced run's predicted step: the measured local compute plus the plan's communication as it sends it.
    from sparsync_bench.demo_plan import predicted_steps

    pred = predicted_steps(plan, {r["run"]: r["compute_ms"] / 1e3 for r in runs})
    assert all(r["compute_ms"] > 0 for r in runs)  # measured times: no comparison with the steps' (load)
    # the dense run's local work adds the densified embedding gradient, the bucket and the dense update; the
    # others' is the forward and backward pass (the hybrid's servers update the embedding)
    assert dense["compute_ms"] > sparse["compute_ms"] == ddp["compute_ms"] == auto["compute_ms"]
    assert auto["predicted_ms"] == pytest.approx(1e3 * pred["auto"]) and "predicted_ms" not in ddp
    assert pred["auto"] == pytest.approx(auto["compute_ms"] / 1e3 + plan.fused_seconds)  # the hybrid's
    agree = 2 * (plan.cluster.machines - 1) * plan.cluster.link.alpha  # wrap_optimizer's agreement round
    assert pred["sparse"] > agree + sparse["compute_ms"] / 1e3 and pred["dense"] > pred["sparse"]
    assert re.search(r"the cost model's predicted steps are [\d.]+x-[\d.]+x the measured ones", md)
    # Interleaved: the warm-up turn, then 5 blocks of 2 steps, every run in turn each time.
    inter = meta["interleaving"]
    assert inter["sizes"] == [2] * 5
    assert inter["order"] == ["dense", "ddp_sparse", "sparse", "auto"] * 6
    for r in meta["runs"]:
        assert r["turns"] == [RUNS.index(r["run"]) + 4 * t for t in range(6)]
        steps = r["steps_ms"]
        assert len(steps) == cfg.steps
        assert r["block_ms"] == [statistics.median(steps[2 + 2 * b : 4 + 2 * b]) for b in range(5)]
        assert r["step_ms"] == pytest.approx(statistics.median(steps[2:]))
    by = {r["run"]: r for r in meta["runs"]}
    assert set(inter["ratios"]) == {"dense/ddp_sparse", "sparse/ddp_sparse", "auto/ddp_sparse", "sparse/dense",
                                    "auto/sparse"}  # fmt: skip
    for pair, q in inter["ratios"].items():
        a, b = pair.split("/")
        assert q["per_block"] == pytest.approx(
            [x / y for x, y in zip(by[a]["block_ms"], by[b]["block_ms"], strict=True)]
        )
        assert q["min"] <= q["median"] <= q["max"] and q["median"] == statistics.median(q["per_block"])
    assert re.search(
        r"sparsync plan: [\d.]+x DDP \(min-max [\d.]+-[\d.]+ over 5 interleaved blocks of 2 steps\)", md
    )
    assert re.search(r"auto plan: [\d.]+x sparsync plan \(min-max [\d.]+-[\d.]+ over 5 interleaved blocks", md)
    # Why each plan won or lost: a verdict and a reason, for every plan against DDP and the sparse pairs.
    for pair in ("dense allreduce vs DDP", "sparsync plan vs DDP", "auto plan vs DDP",
                 "sparsync plan vs dense allreduce", "auto plan vs sparsync plan"):  # fmt: skip
        assert re.search(rf"^{pair}: (won|lost|tie) \([\d.]+x, [\d.]+-[\d.]+\): \S", md, re.M), pair
    assert re.search(
        r"^auto chose parameter server for emb.weight: [\d.]+ ms and [\d.]+ MB per step priced, "
        r"against [\d.]+ ms and [\d.]+ MB by sparse allreduce, the best alternative$",
        md,
        re.M,
    )
    parts = by["sparse"]["parts"]
    assert parts["latency_ms"] > 0 and by["ddp_sparse"]["parts"]["latency_ms"] is None
    assert parts["bandwidth_ms"] == pytest.approx(1e3 * plan.cluster.link.beta * sparse["bytes_per_step"])


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_same_script_under_torchrun() -> None:
    import re
    from pathlib import Path

    from _torchrun import run_torchrun

    stdout = run_torchrun(Path(__file__).with_name("_replicator_torchrun.py"))
    got = re.findall(r"replica (\d)/(\d) sum=(\d+) w=(-?\d+\.\d{6})", stdout)  # lines may interleave
    assert sorted(g[:3] for g in got) == [("0", "3", "3"), ("1", "3", "3"), ("2", "3", "3")], stdout
    assert len({g[3] for g in got}) == 1  # the same parameters on every replica after the step
