"""The flight recorder (collectives/flight.py) and the naming of a dead peer (collectives/peers.py): a rank
killed mid-call is named in every survivor's error, under ``launch`` and under torchrun, and every failing rank
writes its last calls to the file its error names; a mismatch dumps too."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import _flight_workers as fw
import pytest

from sparsync import LaunchError, launch
from sparsync.collectives.flight import FlightRecorder, calls_from_env
from sparsync.collectives.traffic import Traffic

TESTS = Path(__file__).resolve().parent
DUMP = re.compile(r"flight recorder: the last calls of rank (\d+) are in (\S+)")


def _dump_of(message: str, rank: int) -> dict[str, object]:
    m = DUMP.search(message)
    assert m is not None and int(m.group(1)) == rank, message
    return json.loads(Path(m.group(2)).read_text())


def _check_dead_named(message: str, dead: int, rank: int) -> None:
    assert re.search(rf"rank {dead} \(pid \d+\) died", message), message
    body = _dump_of(message, rank)
    calls = body["calls"]
    assert isinstance(calls, list) and calls, body
    last = calls[-1]
    # the call it was in: the reduction that failed, with its fingerprint; the ones before it done
    assert last["status"] == "failed" and "sparse_allreduce" in last["op"], last
    assert last["fingerprint"]["dim"] == 64 and last["fingerprint"]["row"] == 4, last
    assert all(c["status"] == "done" for c in calls[:-1]), calls
    assert len(calls) >= fw.KILL_AT, calls


def test_ring_is_bounded_and_holds_no_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = FlightRecorder(calls=4)
    for i in range(10):
        e = rec.begin("0", f"op{i}", Traffic())
        assert e is not None
    assert [c["op"] for c in rec.snapshot()] == ["op6", "op7", "op8", "op9"]
    assert all(not hasattr(v, "shape") for c in rec.snapshot() for v in c.values())
    assert FlightRecorder(calls=0).begin("0", "op", Traffic()) is None
    monkeypatch.setenv("SPARSYNC_FLIGHT_CALLS", "lots")
    with pytest.raises(ValueError, match=r"SPARSYNC_FLIGHT_CALLS must be a whole number >= 0.*'lots'"):
        calls_from_env()
    monkeypatch.setenv("SPARSYNC_FLIGHT_CALLS", "7")
    assert calls_from_env() == 7


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_killed_rank_is_named_by_every_survivor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """P = 3 under ``launch``: rank 2 dies by SIGKILL mid-loop; ranks 0 and 1 each name it and dump their ring."""
    monkeypatch.setenv("SPARSYNC_FLIGHT_DIR", str(tmp_path / "flight"))
    with pytest.raises(LaunchError) as ei:
        launch(fw.die_in_loop, nprocs=3, args=(2, str(tmp_path)), timeout=20)
    assert ei.value.rank == 2 and ei.value.exitcode == -signal.SIGKILL, str(ei.value)
    for r in (0, 1):
        _check_dead_named((tmp_path / f"rank{r}.err").read_text(), dead=2, rank=r)
    assert sorted(p.name for p in (tmp_path / "flight").iterdir()) == ["rank0.json", "rank1.json"]


@pytest.mark.multiprocess
@pytest.mark.large  # by hand (CI time): the same naming as under launch, through torchrun's own agent
@pytest.mark.timeout(180)
def test_killed_rank_is_named_under_torchrun(tmp_path: Path) -> None:
    """Plain torchrun, 3 processes: the last rank kills itself; both survivors' errors name it (before: none
    did, torchrun's agent owns the processes and no launcher looks at them)."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "SPARSYNC_FLIGHT_DIR": str(tmp_path / "flight")}
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "3", str(TESTS / "_flight_workers.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=170, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout
    for r in (0, 1):
        err = tmp_path / f"rank{r}.err"
        assert err.exists(), proc.stderr[-3000:]
        _check_dead_named(err.read_text(), dead=2, rank=r)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_mismatch_dumps_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARSYNC_FLIGHT_DIR", str(tmp_path))
    messages = launch(fw.mismatch, nprocs=2, timeout=20)
    for r, message in enumerate(messages):
        assert "dim" in message or "dimension" in message, message
        calls = _dump_of(message, r)["calls"]
        assert isinstance(calls, list)
        assert [c["status"] for c in calls] == ["done", "done", "failed"], calls
        assert calls[-1]["fingerprint"]["dim"] == (16 if r == 1 else 8), calls[-1]
