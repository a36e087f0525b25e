"""An allreduce algorithm and a placement kind added from outside the package, each in this one file: the
algorithm is one ``AlgorithmEntry`` (time and bytes models, runner) registered for a scope, which ``auto`` then
chooses and runs on real gloo groups; the kind is one ``PlacementKind`` (its estimate) that ``make_plan`` loops
over with the built-in ones (``tests/plan/test_toy_kind.py`` registers one)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sparsync import REFERENCE_LINK, CommLog, SparseStream, choose_robust, launch, predict, sparse_allreduce
from sparsync.collectives.comm import Comm
from sparsync.collectives.meta import Meta
from sparsync.compress.sketch import SparseSketch
from sparsync.costmodel import REGISTRY, AlgorithmEntry, LinkModel, Problem
from sparsync.placement import Placement
from sparsync.plan import KINDS, Cluster, Estimate, MakeOptions, ParamStats, PlacementKind, make_plan

DIM = 40
TIMEOUT = 30.0  # seconds per collective: a desynchronised group fails, never hangs


# --- a toy allreduce algorithm ------------------------------------------------------------------------------
def gather_sum(comm: Comm, stream: SparseStream, meta: Meta, partition: str) -> SparseStream:
    """Gather every rank's vector dense, then add them in rank order: the same bits on every rank."""
    mine = stream.to_dense()
    parts = [torch.empty_like(mine) for _ in range(comm.size)]
    nb = mine.numel() * mine.element_size() * (comm.size - 1)
    with comm.phase("toy_gather"):
        comm.all_gather_equal("toy allgather", parts, mine)
        comm.count_collective(nb, nb, comm.size - 1)  # what it put on the wire, in its phase
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return SparseStream(None, total, stream.dim, row=stream.row, validate=False)


def toy_time(p: Problem, link: LinkModel) -> float:
    return 0.0  # free: auto, which adds the metadata round every algorithm pays, always picks it


def toy_bytes(p: Problem) -> float:
    return 2.0 * (p.world_size - 1) * p.dim * p.value_bytes


# code 99: any unused code; simplicity -1: first among ties (at P = 1 every prediction is 0)
TOY = AlgorithmEntry("toy_gather_sum", code=99, simplicity=-1, time=toy_time, nbytes=toy_bytes, runner=gather_sum)


def rank_stream(rank: int) -> SparseStream:
    """Rank ``rank``'s input: small integer values, so every sum is exact in float32."""
    idx = torch.arange(rank % 3, DIM, 3 + rank)
    return SparseStream(idx, (idx % 7 + rank + 1).to(torch.float32), DIM)


def toy_worker(rank: int) -> dict[str, Any]:
    """One rank: the toy through ``auto`` (a given link, the default policy) and by name."""
    with REGISTRY.registered(TOY):
        log = CommLog()
        s = rank_stream(rank)
        auto = sparse_allreduce(s, link=REFERENCE_LINK, log=log, timeout=TIMEOUT)
        named = sparse_allreduce(s, algorithm="toy_gather_sum", log=log, timeout=TIMEOUT)
        recs = log.records
        out = {
            "auto": auto.to_dense().tolist(),
            "named": named.to_dense().tolist(),
            "algorithms": [r.algorithm for r in recs],
            "decision": recs[0].decision.algorithm if recs[0].decision else None,
            "partitions": [r.partition for r in recs],
            "toy_bytes": [r.phase_bytes.get("toy_gather", 0) for r in recs],
        }
    out["registered_after"] = "toy_gather_sum" in REGISTRY
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 3])
def test_toy_algorithm_runs_through_auto(world: int) -> None:
    results = launch(toy_worker, nprocs=world, timeout=120)
    want = sum(rank_stream(r).to_dense() for r in range(world)).tolist()
    for r, res in enumerate(results):
        assert res["auto"] == want and res["named"] == want, r
        assert res["algorithms"] == ["toy_gather_sum"] * 2 and res["decision"] == "toy_gather_sum"
        assert res["partitions"] == ["", ""]  # no partition: the record names none
        assert res["toy_bytes"] == [DIM * 4 * (world - 1)] * 2  # the bytes it counted, in its own phase
        assert not res["registered_after"]


def test_toy_registration_is_scoped_and_checked() -> None:
    p = Problem(4, 1000, (10,) * 4, 4, 4)
    assert "toy_gather_sum" not in REGISTRY
    with REGISTRY.registered(TOY):
        assert choose_robust(p, REFERENCE_LINK).algorithm == "toy_gather_sum"
        assert predict("toy_gather_sum", p, REFERENCE_LINK) < predict("allgather", p, REFERENCE_LINK)
        with pytest.raises(ValueError, match="taken"):
            REGISTRY.register(TOY)
    assert "toy_gather_sum" not in REGISTRY and choose_robust(p, REFERENCE_LINK).algorithm != "toy_gather_sum"
    with pytest.raises(ValueError, match="code 4"):  # allgather's
        REGISTRY.register(AlgorithmEntry("other", 4, 0, toy_time, toy_bytes, gather_sum))
    with pytest.raises(KeyError, match="unknown algorithm 'toy_gather_sum'; valid: ssar_recursive_double"):
        predict("toy_gather_sum", p, REFERENCE_LINK)
    copy = REGISTRY.copy()
    copy.register(TOY)  # a copy extends without touching the process's registry
    assert "toy_gather_sum" in copy and "toy_gather_sum" not in REGISTRY


# --- a toy placement kind -----------------------------------------------------------------------------------
class PigeonKind(PlacementKind):
    """Carrier pigeons: any sparse parameter, one byte, no time."""

    name = "pigeon"

    def estimate(self, s: ParamStats, c: Cluster, *, sketch: SparseSketch) -> Estimate | None:
        return Estimate(1.0, 0.0, "by air") if s.sparse else None

    def make(self, options: MakeOptions) -> Placement | None:
        return None  # priced only: tests/plan/test_toy_kind.py makes and registers a kind


def test_toy_placement_kind_runs_through_the_planner() -> None:
    stats = [ParamStats("emb", (10_000, 16), 0.01, True), ParamStats("fc", (64, 64), 1.0, False)]
    cluster = Cluster(4, 1, 1.25e8, 1e-4)
    kinds = (*KINDS, PigeonKind())
    plan = make_plan(stats, cluster, kinds=kinds)
    assert plan.kinds == {"emb": "pigeon", "fc": "dense_allreduce"}
    emb = plan.entries[0]
    assert emb.detail == "by air" and emb.candidates["pigeon"] == (1.0, 0.0)
    assert set(emb.candidates) == {"dense_allreduce", "sparse_allreduce", "ps", "pigeon", "sketch"}
    assert "pigeon" not in plan.entries[1].candidates  # it does not fit a dense parameter
    # Overrides may name it; without it in kinds= the planner never does.
    forced = make_plan(stats, cluster, kinds=kinds, overrides={"emb": "ps"})
    assert forced.placement("emb") == "ps"
    with pytest.raises(ValueError, match="is dense"):
        make_plan(stats, cluster, kinds=kinds, overrides={"fc": "pigeon"})
    with pytest.raises(KeyError, match="unknown placement 'pigeon'"):
        make_plan(stats, cluster, overrides={"emb": "pigeon"})
    assert "pigeon" not in make_plan(stats, cluster).kinds.values()
