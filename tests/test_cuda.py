"""CUDA tensors through every collective, against the CPU path bit for bit (``cuda``: skipped without a GPU).

NCCL at P = 1 (NCCL refuses two ranks on one GPU; the machines we get lend one), and P = 2 and 4 ranks sharing
the one GPU on gloo, whose CUDA path sparsync stages through host memory for p2p transfers and gathers
(collectives/transport.py). ``scripts/gpu_check.sh`` runs this file on a GPU machine.
"""

from __future__ import annotations

from typing import Any

import _cuda_workers as cw
import pytest
import torch

from sparsync import launch

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess, pytest.mark.timeout(300)]

RUNS = [("nccl", 1), ("gloo", 2), ("gloo", 4)]


@pytest.fixture(scope="module", params=RUNS, ids=lambda r: f"{r[0]}-P{r[1]}")
def run(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    backend, world = request.param
    return backend, launch(cw.collectives_worker, nprocs=world, backend=backend, timeout=240)


def test_every_algorithm_on_cuda_equals_the_cpu_path(run: tuple[str, list[dict[str, Any]]]) -> None:
    """Bit for bit: the CPU path is deterministic (set_deterministic), and sums of P streams on the device add
    duplicates in input order (stream._add_in_order)."""
    _, results = run
    for rank, r in enumerate(results):
        bad = {
            k: v
            for k, v in r["cases"].items()
            if v["device"] != "cuda"
            or not (v["equal"] or (not v.get("same_algorithm", True) and v["max_diff"] < 1e-4))
        }
        assert not bad, f"rank {rank}: {len(bad)} cases differ: {dict(list(bad.items())[:5])}"
        assert all(v["values_device"] == "cuda" for k, v in r["cases"].items() if "values_device" in v)
        assert all(v["is_sparse"] and v["rows_equal"] for k, v in r["cases"].items() if k.startswith("coo/"))
        for what in ("allgather", "grouped"):
            assert all(x["equal"] and x["device"] == "cuda" for x in r[what]), (what, r[what])
        assert r["dense"]["equal"] and r["dense"]["device"] == "cuda"


def test_nccl_group_carries_metadata_on_its_cpu_side(run: tuple[str, list[dict[str, Any]]]) -> None:
    backend, results = run
    if backend == "nccl":
        assert results[0]["backend"] == "cpu:gloo,cuda:nccl"


def test_mismatched_device_across_ranks_is_a_value_error_on_every_rank() -> None:
    msgs = launch(cw.mismatched_device_worker, nprocs=2, timeout=60)
    assert all("device mismatch across ranks" in m for m in msgs), msgs


@pytest.mark.parametrize(("backend", "world"), [("nccl", 1), ("gloo", 2)])
def test_distributed_optimizer_trains_a_cuda_model_as_on_the_cpu(backend: str, world: int) -> None:
    for r in launch(cw.optimizer_worker, nprocs=world, backend=backend, timeout=240):
        assert r["devices"] == ["cuda"] * len(r["devices"])
        assert r["max_diff"] < 1e-5, r  # float32 kernels of two devices (matmul), 5 steps


def test_cuda_is_present_where_this_runs() -> None:
    """Guards the marker: where these tests run, a GPU is (conftest skips them elsewhere)."""
    assert torch.cuda.is_available()
