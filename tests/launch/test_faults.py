"""Fault injection: a killed launcher leaves no rank behind, a killed or stopped rank is
named in the error the user sees, the rendezvous store listens on loopback only, and sparsync's DDP hook runs
on a group of its own so a model with collectives in its backward neither hangs nor mismatches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import _fault_workers as fw
import numpy as np
import pytest
import torch
import torch.distributed as dist
from _pids import read_pids, running
from torch.distributed import HashStore  # type: ignore[attr-defined]  # re-exported from C++

from sparsync import LaunchError, launch
from sparsync.collectives.background import background_group
from sparsync.compress import Identity
from sparsync.compress.hooks import compression_hook
from sparsync.launch import _host_store

TESTS = Path(__file__).resolve().parent
WORLD = 3


def _wait_for_pids(pid_dir: Path, n: int, proc: subprocess.Popen[str], limit: float = 90.0) -> list[int]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if (pids := read_pids(pid_dir, n)) is not None:
            return pids
        if proc.poll() is not None:
            pytest.fail(f"launcher exited early ({proc.returncode}): {proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"ranks did not start within {limit} s")


_LAUNCHERS = {
    "launch": "launch(_pids.sleep_forever, nprocs={n}, args=({d!r},), timeout=60)",
    "replicator": "Replicator(num_replicas={n}, timeout=60).start(_pids.replica_sleep_forever, {d!r})",
}


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("how", "sig"),
    [("launch", signal.SIGTERM), ("launch", signal.SIGKILL), ("replicator", signal.SIGKILL)],
    ids=["launch-SIGTERM", "launch-SIGKILL", "replicator-SIGKILL"],
)
def test_killed_launcher_leaves_no_rank_running(tmp_path: Path, how: str, sig: signal.Signals) -> None:
    """Before the reliability work every rank kept running after either signal (3 of 3 runs)."""
    script = (
        f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]\n"
        "import _pids\n"
        "from sparsync import launch\n"
        "from sparsync.replicator import Replicator\n"
        "if __name__ == '__main__':\n"
        f"    {_LAUNCHERS[how].format(n=WORLD, d=str(tmp_path))}\n"
    )
    (tmp_path / "main.py").write_text(script)
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "main.py")], stderr=subprocess.PIPE, text=True, env=env
    )
    pids = _wait_for_pids(tmp_path, WORLD, proc)
    proc.send_signal(sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if running(p)]
    for p in left:  # don't leave them to the next test
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks still running 5 s after {sig.name} to the launcher: {left}"
    if sig == signal.SIGTERM:  # it ended as the signal asks, after terminating its ranks
        assert proc.returncode == -signal.SIGTERM, proc.stderr.read() if proc.stderr else ""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_killed_rank_is_named_with_its_signal(tmp_path: Path) -> None:
    """Rank 2 kills itself with SIGKILL mid-loop; whichever survivor's PeerError arrives first, the error names
    rank 2 and the signal (before: the dead rank was named in 12 of 32 messages)."""
    with pytest.raises(LaunchError) as ei:
        launch(
            fw.signal_self_in_loop,
            nprocs=WORLD,
            args=(2, signal.SIGKILL, "ssar_recursive_double", str(tmp_path)),
            timeout=20,
        )
    e = ei.value
    assert e.rank == 2 and e.exitcode == -signal.SIGKILL, str(e)
    assert str(e).startswith("rank 2 died with signal 9 (SIGKILL)"), str(e)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_killed_in_native_code_shows_its_python_stack() -> None:
    """Rank 1 dies of SIGSEGV inside C (ctypes reads address 0): the error names rank 1 and the signal, and
    carries the Python stack faulthandler wrote at the signal, down to the frame that called into C."""
    with pytest.raises(LaunchError) as ei:
        launch(fw.crash_in_native_code, nprocs=WORLD, args=(1,), timeout=20)
    e = ei.value
    assert e.rank == 1 and e.exitcode == -signal.SIGSEGV, str(e)
    assert str(e).startswith("rank 1 died with signal 11 (SIGSEGV)"), str(e)
    stacks = str(e).split("--- rank 1's Python stacks at the signal (faulthandler) ---\n", 1)[1]
    assert "Fatal Python error: Segmentation fault" in stacks, stacks
    assert "in _read_address_zero" in stacks and "in crash_in_native_code" in stacks, stacks


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_stopped_rank_is_named_within_the_timeout(tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP) mid-loop; the others wait in a dense allreduce bounded by launch's
    timeout only. The error names rank 1 as stopped, about the timeout after it stopped."""
    timeout = 4.0
    with pytest.raises(LaunchError) as ei:
        launch(
            fw.signal_self_in_loop, nprocs=WORLD, args=(1, signal.SIGSTOP, "dense", str(tmp_path)), timeout=timeout
        )
    waited = time.time() - float((tmp_path / "signalled").read_text())
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(WORLD)]
    assert ei.value.rank == 1 and "is stopped" in str(ei.value), str(ei.value)
    assert "then rank" in str(ei.value)  # a survivor's timeout is what ended the wait
    # The survivors' timeout, then reading the last reports and reaping (slack for a loaded host).
    assert timeout - 0.5 < waited < timeout + 5, waited
    assert not [p for p in pids if running(p)]


def test_store_listens_on_loopback_only() -> None:
    """torch's own TCPStore server listens on every interface; ours on the address it is given."""
    store = _host_store("127.0.0.1", 0, 1, 10.0)
    try:
        mine = [(a, p) for a, p in fw.listening_sockets(os.getpid()) if p == store.port]
        assert mine == [("127.0.0.1", store.port)]
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_launch_listens_on_loopback_only() -> None:
    """While ranks run, every socket the launcher (the store) and the ranks (gloo) listen on is bound to
    127.0.0.1."""
    for got in launch(fw.listeners, nprocs=2, args=(os.getpid(),), timeout=30):
        assert got["launcher"], "the launcher hosts the store: it should listen on a socket"
        for who in ("launcher", "rank"):
            assert {a for a, _ in got[who]} <= {"127.0.0.1"}, got


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_hook_beside_a_model_alltoall_matches_ddp() -> None:
    """A model whose backward runs an alltoall on the user's group, trained with sparsync's DDP hook (async and
    blocking): finishes, and equals DDP's own allreduce. With the hook's reductions on the user's group it hung
    (gloo timeout) in 3 of 3 runs."""
    res = launch(fw.alltoall_training, nprocs=WORLD, args=(("ddp", "hook", "hook|sync"), 4), timeout=60)
    for r in range(WORLD):
        for mode in ("hook", "hook|sync"):
            for a, b in zip(res[r]["ddp"], res[r][mode], strict=True):
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        for a, b in zip(res[0]["hook"], res[r]["hook"], strict=True):
            assert np.array_equal(a, b)  # every replica holds the same weights


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stall_step", [0, 2], ids=["checked", "fast"])
def test_hook_reports_a_stalled_peer_instead_of_waiting(stall_step: int) -> None:
    """Rank 1 stops answering in its DDP hook: the others' backward() raises, naming the bucket and the
    timeout, within the group's timeout; on the first step (the layout check's path, whose future was never
    completed when its reduction failed: DDP waited forever) and later (DDP's allreduce, issued in the hook)."""
    timeout = 3.0
    t0 = time.monotonic()
    res = launch(fw.hook_with_a_stalled_peer, nprocs=WORLD, args=(stall_step, timeout + 2), timeout=timeout)
    assert "stalled on purpose" in res[1]
    for r in (0, 2):
        assert "(timed out or" in res[r] and "rank " in res[r], res[r]
        if stall_step:
            assert "DDP hook: allreduce of bucket" in res[r], res[r]
    assert time.monotonic() - t0 < 60


def test_hook_uses_one_background_group_per_user_group() -> None:
    """Several hooks on one group share sparsync's group (one dist.new_group, made when the first is built)."""
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=7))
    try:
        world = dist.group.WORLD
        assert isinstance(world, dist.ProcessGroup)
        compression_hook(Identity())
        own = background_group(world)
        assert own is not world
        compression_hook(Identity())
        assert background_group(None) is own
        assert own._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=7)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_launch_runs_a_generic_per_host_setup_in_each_rank() -> None:
    """``launch(setup=...)``: any picklable RankSetup (here an environment variable per emulated host) runs in
    each rank before its group starts; a setup for another number of hosts is refused before any rank starts."""
    out = launch(fw.host_tag, nprocs=4, procs_per_host=2, setup=fw.HostTag(("a", "b")))
    assert out == [("a", "0", 10), ("a", "0", 10), ("b", "1", 10), ("b", "1", 10)]
    with pytest.raises(ValueError, match="setup has 3 hosts for 2 hosts"):
        launch(fw.host_tag, nprocs=4, procs_per_host=2, setup=fw.HostTag(("a", "b", "c")))
