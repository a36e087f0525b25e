"""Bad input and failing ranks: every rank raises (no hang), and launch reports the failure without orphans."""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from pathlib import Path
from typing import Any

import _workers as w
import numpy as np
import pytest
import torch
from _pids import running

import sparsync
from sparsync import ALGORITHMS, LaunchError, SparseStream, launch, sparse_allgather, sparse_allreduce

WORLD = 3


# --- single process -----------------------------------------------------------------------------------------
def test_unknown_algorithm_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="bogus") as ei:
        sparse_allreduce(SparseStream.empty(4), algorithm="bogus")
    for name in ("auto", *ALGORITHMS):
        assert name in str(ei.value)


def test_collectives_reject_non_streams() -> None:
    with pytest.raises(TypeError, match="SparseStream"):
        sparse_allreduce(torch.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SparseStream"):
        sparse_allgather([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Tensor"):
        sparsync.allreduce(np.zeros(3))  # type: ignore[arg-type]


def test_collective_without_process_group_says_how_to_start_one() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        sparse_allreduce(SparseStream.empty(4))
    with pytest.raises(RuntimeError, match="launch"):
        sparse_allgather(SparseStream.empty(4))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_allreduce_rejects_empty_and_unsupported_layouts() -> None:
    with pytest.raises(ValueError, match="empty"):
        sparsync.allreduce(torch.zeros(0))
    csr = torch.eye(3).to_sparse_csr()
    with pytest.raises(ValueError, match="layout"):
        sparsync.allreduce(csr)


def test_launch_rejects_bad_nprocs() -> None:
    with pytest.raises(ValueError, match="nprocs"):
        launch(w.raise_on_rank, nprocs=0)


# --- bad input on some ranks of a 3-rank group --------------------------------------------------------------
@pytest.fixture(scope="module")
def errors() -> list[dict[str, Any]]:
    return launch(w.errors_worker, nprocs=WORLD, timeout=60)


def _all_raise(errors: list[dict[str, Any]], key: str, kind: str = "ValueError") -> list[str]:
    got = [e[key] for e in errors]
    assert [k for k, _ in got] == [kind] * WORLD, got
    return [msg for _, msg in got]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_dim_mismatch_raises_on_every_rank(errors: list[dict[str, Any]]) -> None:
    for key, bad_rank in (("dim", 1), ("dim_allgather", 2)):
        for rank, msg in enumerate(_all_raise(errors, key)):
            assert "dim" in msg
            assert f"rank {bad_rank} has dim=11" in msg and "rank 0 has dim=10" in msg
            assert f"seen on rank {rank}" in msg


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_dtype_mismatch_raises_on_every_rank(errors: list[dict[str, Any]]) -> None:
    for msg in _all_raise(errors, "dtype"):
        assert "dtype" in msg and "torch.float64" in msg and "rank 2" in msg


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_algorithm_mismatch_raises_on_every_rank(errors: list[dict[str, Any]]) -> None:
    for msg in _all_raise(errors, "algorithm"):
        assert "algorithm" in msg and "dense" in msg and "allgather" in msg


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_different_collectives_raise_on_every_rank(errors: list[dict[str, Any]]) -> None:
    for msg in _all_raise(errors, "collective"):
        assert "sparse_allgather" in msg and "sparse_allreduce" in msg


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_nan_on_one_rank_raises_on_every_rank_naming_it(errors: list[dict[str, Any]]) -> None:
    # sparsync.NonFiniteError, a ValueError
    for msg in _all_raise(errors, "nan", "NonFiniteError"):
        assert "rank 1" in msg and "NaN" in msg and "index 7" in msg
    for msg in _all_raise(errors, "nan_sparse", "NonFiniteError"):
        assert "rank 2" in msg and "NaN" in msg and "index 8" in msg  # the vector index, not the position


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_nan_passes_through_when_unchecked(errors: list[dict[str, Any]]) -> None:
    for e in errors:
        got = e["nan_unchecked"]
        assert np.isnan(got[7])
        assert np.array_equal(np.delete(got, 7), np.full(9, float(WORLD)))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_group_still_usable_after_errors(errors: list[dict[str, Any]]) -> None:
    want = np.zeros(10, dtype=np.float32)
    want[[1, 4]] = [WORLD * 1.0, WORLD * 2.0]
    for e in errors:
        np.testing.assert_array_equal(e["after"], want)


# --- launch: failing and dead ranks -------------------------------------------------------------------------
def _assert_no_children_left(pid_dir: Path, nprocs: int) -> None:
    """Every rank process that was started is gone (not merely orphaned) and none is still tracked."""
    assert multiprocessing.active_children() == []
    pids = [int((pid_dir / f"rank{r}.pid").read_text()) for r in range(nprocs)]
    assert len(set(pids)) == nprocs and os.getpid() not in pids
    alive = [pid for pid in pids if running(pid)]
    assert not alive, f"rank processes still running: {alive}"
    # multiprocessing's helpers stay by design: the resource tracker, and the forkserver the ranks were forked
    # from (launch's default start method), which must have no child left either.
    helpers = [
        p for p in _children(os.getpid()) if "resource_tracker" in _cmdline(p) or "forkserver" in _cmdline(p)
    ]
    own_children = [p.name for p in _children(os.getpid()) if p not in helpers]
    own_children += [p.name for h in helpers for p in _children(int(h.name)) if running(int(p.name))]
    assert not own_children, f"child processes left: {own_children}"


def _children(pid: int) -> list[Path]:
    return [p for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == pid]


def _ppid(p: Path) -> int:
    try:
        m = re.search(r"^PPid:\s+(\d+)", (p / "status").read_text(), re.M)
    except OSError:
        return -1
    return int(m.group(1)) if m else -1


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_raising_rank_gives_launch_error_with_its_traceback(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as ei:
        launch(w.raise_on_rank, nprocs=WORLD, args=(1, "boom from the test", str(tmp_path)), timeout=30)
    assert time.monotonic() - t0 < 30
    e = ei.value
    assert e.rank == 1
    assert str(e).startswith("rank 1 ")
    assert "RuntimeError: boom from the test" in str(e)
    assert "raise_on_rank" in e.traceback  # the rank's own traceback, not the parent's
    _assert_no_children_left(tmp_path, WORLD)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("exit_code", [1, 0], ids=["exit1", "silent_exit0"])
def test_dead_peer_fails_the_collective_instead_of_hanging(tmp_path: Path, exit_code: int) -> None:
    """Rank 1 dies (os._exit) before the collective; the others call it with timeout=5. With exit code 0 the
    parent cannot see the death itself: the survivors' errors must end the run."""
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as ei:
        launch(w.die_before_collective, nprocs=WORLD, args=(1, exit_code, str(tmp_path)), timeout=10)
    assert time.monotonic() - t0 < 30
    msg = str(ei.value)
    assert re.search(r"\brank 1\b", msg), msg  # names the dead rank, as the failure or as the lost peer
    if ei.value.rank != 1:
        assert "PeerError" in msg and "peer rank 1" in msg
    _assert_no_children_left(tmp_path, WORLD)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_stuck_peer_times_out_by_the_launch_timeout(tmp_path: Path) -> None:
    """Rank 1 is alive but never joins, and the others pass no per-call timeout: the process group's timeout
    (launch's ``timeout=5``) must end their wait, well before the stuck rank's 300 s sleep."""
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as ei:
        launch(w.stall_before_collective, nprocs=WORLD, args=(1, str(tmp_path)), timeout=5)
    elapsed = time.monotonic() - t0
    assert 4 < elapsed < 30, elapsed
    assert ei.value.rank in (0, 2)
    assert "PeerError" in str(ei.value) and "peer rank 1" in str(ei.value)
    _assert_no_children_left(tmp_path, WORLD)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_successful_launch_returns_in_rank_order_and_leaves_nothing(tmp_path: Path) -> None:
    out = launch(w.raise_on_rank, nprocs=2, args=(-1, "unused", str(tmp_path)), timeout=30)
    assert out == [0, 1]
    _assert_no_children_left(tmp_path, 2)
