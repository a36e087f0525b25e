"""The step as the trainer sends a plan (``plan.step``) and the collective algorithms that price it
(``plan.backend``): DistributedOptimizer's buckets, ring or tree by size and P, placements by marginal cost."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sparsync.optim import buckets
from sparsync.placement import DenseAllreduce, NamedParam
from sparsync.plan import Cluster, ParamStats, make_plan
from sparsync.plan.backend import TREE_BUS_SHARE, all_to_all_latency, dense_allreduce
from sparsync.plan.step import bucket_layout
from sparsync.replicator.optimizer import DENSE
from sparsync_bench.cli import main
from sparsync_bench.criteo import table_rows
from sparsync_bench.dlrm import dlrm_stats

DTYPES = {2: torch.float16, 4: torch.float32, 8: torch.float64}
LINK = (25e9 / 8, 50e-6)  # 25 Gbit/s, 50 µs a message


def dlrm() -> list[ParamStats]:
    return dlrm_stats(table_rows(100_000), 16, 512)


def real_buckets(stats: list[ParamStats]) -> list[list[int]]:
    """DistributedOptimizer's dense buckets of ``stats`` (``optim.buckets.lay_out`` on meta tensors, every
    gradient dense under one DenseAllreduce, DDP's initial order): each bucket's indices into ``stats``."""
    params = [NamedParam(s.name, torch.nn.Parameter(torch.empty(s.shape, dtype=DTYPES[s.itemsize], device="meta")))
              for s in stats]  # fmt: skip
    plan = dict.fromkeys((s.name for s in stats), DenseAllreduce())
    order = buckets.default_order([], len(stats))
    return [list(b.members) for b in buckets.lay_out(params, plan, [DENSE] * len(stats), order)]


def test_bucket_layout_is_distributed_optimizers() -> None:
    mlps = [s for s in dlrm() if not s.sparse]
    g = torch.Generator().manual_seed(0)
    models = [mlps, dlrm()]
    for _ in range(20):  # shapes from 1 element to 16 MB, two item sizes mixed
        n = int(torch.randint(1, 30, (1,), generator=g))
        sizes = torch.randint(0, 23, (n,), generator=g).tolist()
        wide = torch.randint(0, 4, (n,), generator=g).tolist()
        models.append([ParamStats(f"p{i}", (1 << k,), 1.0, False, itemsize=8 if w == 0 else 4)
                       for i, (k, w) in enumerate(zip(sizes, wide, strict=True))])  # fmt: skip
    for stats in models:
        sizes = [(math.prod(s.shape) * s.itemsize, s.itemsize) for s in stats]
        assert bucket_layout(sizes) == real_buckets(stats)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_dense_price_is_the_sum_over_the_optimizers_buckets(backend: str) -> None:
    """DLRM at 256 machines: the dense parameters (MLPs and the tables placed dense) cost what their buckets,
    as ``lay_out`` makes them, cost by the backend's algorithm: two calls, not one per tensor."""
    c = Cluster(256, 1, *LINK, backend=backend)
    plan = make_plan(dlrm(), c, swap_modules=True)
    dense = [ParamStats(e.name, e.shape, 1.0, False, itemsize=e.itemsize) for e in plan.entries
             if e.placement == "dense_allreduce"]  # fmt: skip
    layout = real_buckets(dense)
    want = [dense_allreduce(sum(math.prod(dense[i].shape) * 4 for i in b), c) for b in layout]
    parts = [p for p in plan.step.parts if p.kind == "dense_allreduce"]
    assert [p.members for p in parts] == [tuple(dense[i].name for i in b) for b in layout]
    assert [(p.algorithm, p.seconds) for p in parts] == [(a, pytest.approx(t)) for a, t in want]
    assert len(parts) == 2 and plan.step_seconds == pytest.approx(sum(p.seconds for p in plan.step.parts))
    # the issue's figure: 14 MLP tensors at 2(P-1)·α each came to ~364 ms; two buckets' latency now
    assert plan.step_seconds < 2 * (2 * 255 * 50e-6) + 0.01


def test_one_more_small_dense_tensor_adds_its_bytes_not_a_call() -> None:
    c = Cluster(256, 1, *LINK)
    base = dlrm()
    before = make_plan(base, c, swap_modules=True)
    for extra in (1, 10):
        more = base + [ParamStats(f"extra{i}.bias", (16,), 1.0, False) for i in range(extra)]
        after = make_plan(more, c, swap_modules=True)
        assert after.kinds == {**before.kinds, **{f"extra{i}.bias": "dense_allreduce" for i in range(extra)}}
        added = after.step_seconds - before.step_seconds
        # its bytes on the ring, 2(P-1)/P·64·β each: no latency term (one 2(P-1)·α would be 25.5 ms)
        assert added == pytest.approx(extra * 2 * 255 / 256 * 64 / LINK[0], rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_tiny_tables_at_256_ride_in_the_dense_bucket_and_no_move_makes_the_step_faster(backend: str) -> None:
    plan = make_plan(dlrm(), Cluster(256, 1, *LINK, backend=backend), swap_modules=True)
    tables = [e for e in plan.entries if e.name.startswith("tables.")]
    tiny = [e for e in tables if e.shape[0] <= 100]
    assert len(tiny) == 7 and {e.placement for e in tiny} == {"dense_allreduce"}
    assert {e.placement for e in tables if e.shape[0] >= 90_000} == {"ps"}  # 300 rows read of 100,000
    for e in tables:  # priced inside its kind's group, no table would rather be elsewhere
        for kind in e.candidates:
            assert plan.moved({e.name: kind}).step_seconds >= plan.step_seconds * (1 - 1e-9), (e.name, kind)


def test_ring_or_tree_by_message_size_and_p() -> None:
    """gloo: a ring at every size. NCCL: the tree while its fewer latencies outweigh its bandwidth (half the
    bus's, times 0.9), i.e. below n* = (2(P-1) - 2·log2 P)·α / (β·(1/0.45 - 2(P-1)/P)); the ring above."""
    assert TREE_BUS_SHARE == 0.5 * 0.9  # tuning.cc: a tree at half its bus bandwidth, the bus at 0.9
    for P in (4, 64, 256, 1024):
        gloo, nccl = Cluster(P, 1, *LINK), Cluster(P, 1, *LINK, backend="nccl")
        beta, alpha = 1 / LINK[0], LINK[1]
        cross = (2 * (P - 1) - 2 * math.log2(P)) * alpha / (beta * (1 / TREE_BUS_SHARE - 2 * (P - 1) / P))
        for n in (cross / 1.01, cross * 1.01, 1e3, 1e9):
            assert dense_allreduce(n, gloo)[0] == "ring"
            assert dense_allreduce(n, nccl)[0] == ("tree" if n < cross else "ring"), (P, n, cross)
        ring = dense_allreduce(1e9, gloo)[1]
        assert ring == pytest.approx(2 * (P - 1) * alpha + 2 * (P - 1) / P * 1e9 * beta)
        assert all_to_all_latency(gloo) == pytest.approx((P - 1) * alpha)
    # Two levels, 8 ranks a node on a 5 µs link: 2(P-nodes) intra steps and 2(nodes-1) network ones for the
    # ring; 2·(7 intra + log2(nodes) network) hops for the tree; the all-to-all 7 intra and P-8 network messages
    c = Cluster(32, 8, *LINK, intra_bandwidth=200e9, intra_latency=5e-6, backend="nccl")
    lat = {"ring": 2 * (256 - 32) * 5e-6 + 2 * 31 * 50e-6, "tree": 2 * (7 * 5e-6 + 5 * 50e-6)}
    assert dense_allreduce(1.0, c) == ("tree", pytest.approx(lat["tree"] + 1 / LINK[0] / TREE_BUS_SHARE))
    assert all_to_all_latency(c) == pytest.approx(7 * 5e-6 + 248 * 50e-6)
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        Cluster(4, backend="mpi")


def test_the_cli_prints_the_steps_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plans.json"
    argv = ["plan", "--model", "dlrm", "--world", "256", "--link", "25gbit", "--json", str(out)]
    assert main([*argv, "--backend", "nccl"]) == 0
    text = capsys.readouterr().out
    for part in ("the step: 256 machines (nccl)", "dense bucket 1 of 2", "dense bucket 2 of 2", "tree", "| ps"):
        assert part in text, part
    (plan,) = json.loads(out.read_text())
    assert plan["step_seconds"] == pytest.approx(sum(p["seconds"] for p in plan["step"]))
    assert [p["label"] for p in plan["step"]] == ["dense bucket 1 of 2", "dense bucket 2 of 2", "ps"]
    step_ms = f"{plan['step_seconds'] * 1e3:.2f}"
    assert f" {step_ms} |" in text.split("predicted communication per step")[1]  # the summary's step ms


def test_two_levels_at_256_ranks_buckets_the_mlps_and_no_table_would_move() -> None:
    """The issue's second target on the cluster the docs price (32 nodes of 8 ranks, 25 Gbit/s a node, NCCL): the
    MLPs cost their buckets (more dense tensors add bytes, not calls), and no table's placement changes when it
    is priced inside its kind's group (moving any one table to another of its kinds makes the step no faster)."""
    c = Cluster(32, 8, *LINK, intra_bandwidth=200e9, intra_latency=2e-6, backend="nccl")
    stats = dlrm_stats(table_rows(100_000), 16, 512, procs_per_machine=8)
    plan = make_plan(stats, c, swap_modules=True)
    dense = [ParamStats(e.name, e.shape, 1.0, False, itemsize=e.itemsize) for e in plan.entries
             if e.placement == "dense_allreduce"]  # fmt: skip
    parts = [p for p in plan.step.parts if p.kind == "dense_allreduce"]
    assert [p.members for p in parts] == [tuple(dense[i].name for i in b) for b in real_buckets(dense)]
    more = make_plan([*stats, *(ParamStats(f"extra{i}.bias", (16,), 1.0, False) for i in range(10))], c,
                     swap_modules=True)  # fmt: skip
    assert len([p for p in more.step.parts if p.kind == "dense_allreduce"]) == len(parts)
    assert {p.algorithm for p in parts} == {"tree"}  # their bytes at the tree's bandwidth, no 2·log2(32)·α more
    assert more.step_seconds - plan.step_seconds == pytest.approx(10 * 64 / LINK[0] / TREE_BUS_SHARE, rel=1e-6)
    tables = [e for e in plan.entries if e.name.startswith("tables.")]
    assert len({e.placement for e in tables}) > 1  # a choice was made, not one kind for all
    for e in tables:
        for kind in e.candidates:
            assert plan.moved({e.name: kind}).step_seconds >= plan.step_seconds * (1 - 1e-9), (e.name, kind)
