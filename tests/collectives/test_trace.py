"""Profiling and debugging (docs/profiling.md): torch.profiler ranges of every call, the
per-rank timeline and its merge, TensorBoard scalars.

The trace-event checks below are this test's own reading of the format (Chrome's "Trace Event Format"
document, which Perfetto imports), not the code's: a timeline that breaks it fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import _trace_workers as tw
import pytest

from sparsync import CommLog, CommRecord, launch
from sparsync.costmodel import Decision

SRC = Path(__file__).resolve().parents[2] / "src"

# Event phases of the trace-event format and the fields each needs beyond name/ph/pid/tid/ts.
PHASE_FIELDS: dict[str, tuple[str, ...]] = {
    "X": ("dur",),  # complete event
    "B": (),
    "E": (),
    "i": (),
    "I": (),
    "b": ("id", "cat"),  # nestable async begin / end
    "e": ("id", "cat"),
    "s": ("id",),  # flow start / finish
    "f": ("id",),
    "M": ("args",),  # metadata: process_name, thread_name
}


def trace_event_errors(doc: Any) -> list[str]:
    """What keeps ``doc`` from being a valid trace-event JSON object (JSON Object Format); [] when valid."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["not an object with a traceEvents list"]
    errors = []
    if doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        errors.append(f"displayTimeUnit {doc['displayTimeUnit']!r}")
    open_async: dict[tuple[Any, Any, Any], int] = {}
    slices: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for i, e in enumerate(doc["traceEvents"]):
        ph = e.get("ph")
        if ph not in PHASE_FIELDS:
            errors.append(f"event {i}: unknown ph {ph!r}")
            continue
        if not isinstance(e.get("name"), str) or not all(isinstance(e.get(k), int) for k in ("pid", "tid")):
            errors.append(f"event {i}: name must be a string, pid and tid integers: {e}")
        if ph != "M" and not (isinstance(e.get("ts"), int | float) and e["ts"] >= 0):
            errors.append(f"event {i}: ts must be a number >= 0: {e}")
        missing = [k for k in PHASE_FIELDS[ph] if k not in e]
        if missing:
            errors.append(f"event {i}: {ph} event without {missing}")
        if "args" in e and not isinstance(e["args"], dict):
            errors.append(f"event {i}: args must be an object")
        if ph == "X":
            if not (isinstance(e.get("dur"), int | float) and e["dur"] >= 0):
                errors.append(f"event {i}: dur must be >= 0")
                continue
            slices.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        if ph in ("b", "e") and not missing:
            key = (e["pid"], e["cat"], e["id"])
            open_async[key] = open_async.get(key, 0) + (1 if ph == "b" else -1)
        json.dumps(e, allow_nan=False)  # NaN/Infinity are not JSON
    errors += [f"async span {k} never ended" for k, n in open_async.items() if n]
    # "X" events of one thread must nest (Perfetto drops or misplaces overlapping ones); 1 µs slack for the
    # rounding of ts and dur.
    for (pid, tid), spans in slices.items():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start + 1.0:
                stack.pop()
            if stack and end > stack[-1] + 1.0:
                errors.append(f"pid {pid} tid {tid}: slice [{start}, {end}] overlaps its parent's end {stack[-1]}")
            stack.append(end)
    return errors


def test_validator_rejects_broken_timelines() -> None:
    """The checker above finds what it must (else the tests below prove nothing)."""
    ok = {"traceEvents": [{"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": 10},
                          {"name": "b", "ph": "X", "pid": 0, "tid": 1, "ts": 2, "dur": 3}]}  # fmt: skip
    assert trace_event_errors(ok) == []
    overlap = {"traceEvents": [{"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": 10},
                               {"name": "b", "ph": "X", "pid": 0, "tid": 1, "ts": 5, "dur": 10}]}  # fmt: skip
    assert trace_event_errors(overlap)
    assert trace_event_errors({"traceEvents": [{"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 0}]})
    assert trace_event_errors({"traceEvents": [{"name": "a", "ph": "b", "pid": 0, "tid": 1, "ts": 0,
                                                "id": 1, "cat": "ps"}]})  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_profiler_names_every_call_with_its_bytes(tmp_path: Path) -> None:
    """A torch.profiler trace of a 3-rank run holds a range ``sparsync:<op>:<algorithm> bytes=... P=3`` per call
    (the async one, which runs on the queue thread, included), auto's choice, the phases and the compressor's
    steps."""
    for rank in launch(tw.profiler_worker, nprocs=3, args=(str(tmp_path),), timeout=240):
        names, records = rank[0]["names"], rank[0]["records"]
        calls = [n for n in names if " bytes=" in n]
        assert [n.split(" ")[0] for n in calls] == [
            "sparsync:sparse_allreduce:auto",
            "sparsync:sparse_allreduce:ssar_split_allgather",
            "sparsync:sparse_allreduce:auto",
            "sparsync:sparse_allgather:recursive_double",
            "sparsync:sparse_allreduce:auto",  # the compressed reduction's sparse_allreduce
        ]
        assert all(" P=3" in n and " bytes=" in n and " rows=" in n for n in calls)
        assert "bytes=1800 " in calls[0]  # 50 rows of 8 float32 values + 50 int32 indices
        # auto's choice: a nested range per auto call, named by the algorithm the CommLog recorded
        chosen = [n.split(" ")[0].split(":")[2] for n in names if "auto_choice=" in n]
        assert chosen == [records[i][1] for i in (0, 2, 4)]
        assert names.count("sparsync:sparse_allreduce:meta") == 4
        assert "sparsync:sparse_allreduce:split_payload" in names
        assert any(n.startswith("sparsync:reduce:compress compressor=TopK") for n in names)
        assert any(n.startswith("sparsync:reduce:decompress") for n in names)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_timeline_per_rank_and_merged_validate(tmp_path: Path) -> None:
    """``sparsync.trace`` writes one valid trace-event file per rank with every call (algorithm, bytes equal to
    the CommLog's, predicted and measured time), its phases, the async call on the queue thread with an arrow
    from the caller and the caller's wait; ``sparsync trace merge`` writes a valid merged file and a PNG."""
    from sparsync_bench.trace_merge import call_waits, merge_and_draw, slowest_step

    results = launch(tw.timeline_worker, nprocs=3, args=(str(tmp_path),), timeout=240)
    for rank, records in enumerate(results):
        doc = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert trace_event_errors(doc) == []
        assert doc["otherData"]["clock"] == "barrier" and doc["otherData"]["sparsync_rank"] == rank
        events = doc["traceEvents"]
        calls = [e for e in events if e.get("cat") == "call"]
        assert [(e["args"]["algorithm"], e["args"]["bytes_sent"]) for e in calls] == [
            (r["algorithm"], r["bytes_sent"]) for r in records
        ]
        assert all(e["pid"] == rank for e in events)
        auto = [e for e in calls if "auto_choice" in e["args"]]
        assert auto and all(e["args"]["predicted_ms"] > 0 and e["args"]["measured_ms"] > 0 for e in auto)
        threads = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
        queue = [e for e in calls if e["tid"] != threads["MainThread"]]
        assert len(queue) == 2 and all(e["tid"] == threads["sparsync_0"] for e in queue)  # one per step
        assert sum(e["ph"] == "s" for e in events) == sum(e["ph"] == "f" for e in events) == 2
        assert sum(e.get("cat") == "wait" for e in events) == 2
        assert {e["name"] for e in events if e.get("cat") == "phase"} >= {"meta", "split_payload", "sum"}
        assert sorted(e["args"]["step"] for e in events if e.get("cat") == "step") == [0, 1]
    merged_path, png = merge_and_draw(tmp_path)
    merged = json.loads(merged_path.read_text())
    assert trace_event_errors(merged) == []
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1, 2}
    assert slowest_step(merged).label in ("slowest step (0)", "slowest step (1)")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    waits = call_waits(merged)
    assert len(waits) == 3 * 2 * 5 and all(w >= 0 for w in waits.values())
    # each call has a rank that started it last and waited for nobody
    assert sum(w == 0 for w in waits.values()) >= 2 * 5


def test_merge_aligns_wall_clocks(tmp_path: Path) -> None:
    """Timelines started alone (SPARSYNC_TRACE: "wall" clock) are shifted by the wall times of their zeros."""
    from sparsync_bench.trace_merge import merge

    for rank, wall in ((0, 100.0), (1, 100.5)):
        doc = {"traceEvents": [{"name": "x", "cat": "call", "ph": "X", "pid": rank, "tid": 1, "ts": 10.0,
                                "dur": 5.0, "args": {"group": "0"}}],
               "otherData": {"sparsync_rank": rank, "world_size": 2, "clock": "wall",
                             "wall_time_at_zero": wall}}  # fmt: skip
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))
    merged = merge(tmp_path)
    assert [e["ts"] for e in merged["traceEvents"]] == [10.0, 500_010.0]
    assert trace_event_errors(merged) == []


def test_merge_names_a_missing_directory(tmp_path: Path) -> None:
    from sparsync_bench.trace_merge import merge

    with pytest.raises(ValueError, match=r"no rank\*\.json timelines"):
        merge(tmp_path)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sparsync_trace_env_writes_timelines(tmp_path: Path) -> None:
    """``SPARSYNC_TRACE=DIR`` traces a run without code: every rank's file, written when ``launch`` ends."""
    env = {
        **os.environ,
        "SPARSYNC_TRACE": str(tmp_path),
        "PYTHONPATH": f"{SRC}{os.pathsep}{Path(__file__).parent}",
    }
    code = "import _trace_workers as tw, sparsync\nsparsync.launch(tw.env_worker, nprocs=2)"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=240)
    for rank in range(2):
        doc = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert trace_event_errors(doc) == []
        assert doc["otherData"]["clock"] == "wall"
        assert [e["name"] for e in doc["traceEvents"] if e.get("cat") == "call"] == ["sparse_allreduce:dense"]


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: dict[tuple[str, int], float] = {}

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> None:
        assert global_step is not None
        self.scalars[(tag, global_step)] = scalar_value


def _record(alg: str, sent: int, seconds: float, predicted: float | None = None) -> CommRecord:
    decision = None if predicted is None else Decision(alg, {alg: predicted, "dense": 1.0}, 0.0)
    return CommRecord("sparse_allreduce", alg, 0, 4, 100, 10, 10, sent, sent // 2, 3, seconds, decision=decision)


def test_to_tensorboard_writes_one_steps_scalars() -> None:
    """Bytes, time, calls, auto's predicted against measured time and calls per algorithm, for the records of
    one step (``since``), every algorithm of the log written (0 when unused this step)."""
    log = CommLog()
    log.append(_record("dense", 1000, 0.5))
    before = len(log)
    log.append(_record("allgather", 300, 0.25, predicted=0.125))
    log.append(_record("allgather", 100, 0.25))
    w = FakeWriter()
    log.to_tensorboard(w, 7, since=before)
    assert w.scalars == {
        ("sparsync/bytes_sent", 7): 400,
        ("sparsync/bytes_recv", 7): 200,
        ("sparsync/seconds", 7): 0.5,
        ("sparsync/calls", 7): 2,
        ("sparsync/predicted_seconds", 7): 0.125,
        ("sparsync/seconds_auto", 7): 0.25,
        ("sparsync/algorithm/allgather", 7): 2,
        ("sparsync/algorithm/dense", 7): 0,
    }
    with pytest.raises(ValueError, match="since must be >= 0, got -1"):
        log.to_tensorboard(w, 0, since=-1)


def test_tensorboard_option_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the tensorboard package, --tensorboard stops before any process starts, naming the package."""
    import importlib.util

    from sparsync_bench import tensorboard

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a))
    with pytest.raises(RuntimeError, match="tensorboard package"):
        tensorboard.summary_writer("unused")


def test_ps_requests_are_async_spans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter-server request is on the issuing thread's row from issue to reply (a "b"/"e" pair: requests
    in flight overlap), with its bytes; a failed one names its error."""
    from concurrent.futures import Future

    from sparsync.collectives.trace import Tracer
    from sparsync.ps import client

    t = Tracer(tmp_path, 0, 1)
    monkeypatch.setattr(client, "tracer", lambda: t)
    ok: Future[Any] = Future()
    bad: Future[Any] = Future()
    client._trace_request(ok, "ps:PULL", 1, 100)
    client._trace_request(bad, "ps:PUSH", 0, 50)
    bad.set_exception(client.PSTimeoutError("no reply"))
    ok.set_result((None, b"x" * 30))
    doc = json.loads(t.write().read_text())
    assert trace_event_errors(doc) == []
    spans = {e["name"]: e["args"] for e in doc["traceEvents"] if e.get("ph") == "b"}
    assert spans == {
        "ps:PULL": {"server": 1, "bytes_sent": 100, "bytes_recv": 30},
        "ps:PUSH": {"server": 0, "bytes_sent": 50, "bytes_recv": 0, "error": "PSTimeoutError"},
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_demo_trace_writes_a_timeline_the_merge_draws(tmp_path: Path) -> None:
    """``sparsync demo --trace DIR``: every rank's timeline, with the timed steps of sparsync's plans and the
    parameter-server requests (the automatic plan's server probe, or its hybrid run); the merge validates and
    draws. The automatic plan is priced with what the demo measured."""
    from sparsync_bench.trace_merge import merge_and_draw
    from sparsync_bench.train_demo import DemoConfig, run_demo

    cfg = DemoConfig(steps=4, warmup=2)
    _, _, plan = run_demo(cfg, show_progress=False, trace_dir=str(tmp_path))
    # the automatic plan priced with the demo's measured link and servers: each entry its cheapest lossless one
    assert plan.cluster.measured is not None and plan.cluster.server is not None
    for e in plan.entries:
        lossless = {k: v for k, v in e.candidates.items() if k != "sketch"}  # lossy: not without allow_lossy
        assert e.placement == min(lossless, key=lambda k: lossless[k][1]), (e.name, e.candidates)
    merged_path, png = merge_and_draw(tmp_path)
    merged = json.loads(merged_path.read_text())
    assert trace_event_errors(merged) == []
    events = merged["traceEvents"]
    assert {e["pid"] for e in events} == set(range(cfg.replicas))
    steps = {e["args"]["step"] for e in events if e.get("cat") == "step"}
    assert steps == {2, 3, 6, 7}  # the dense and sparsync plans' timed steps, numbered across the runs
    assert any(e.get("cat") == "ps" and e["name"].startswith("ps:") for e in events)
    assert png.stat().st_size > 10_000


def test_slowest_step_and_its_filters() -> None:
    """The picture's step: the longest from the first rank's start to the last rank's end (not the longest on
    one rank), ``first`` leaves out earlier steps, an unknown step is named."""
    from sparsync_bench.trace_merge import slowest_step

    def step(n: int, pid: int, ts: float, dur: float) -> dict[str, Any]:
        return {"name": f"step {n}", "cat": "step", "ph": "X", "pid": pid, "tid": 1, "ts": ts, "dur": dur,
                "args": {"step": n}}  # fmt: skip

    # step 0: 100 µs on each rank, but rank 1 starts 60 later (160 overall); step 1: 150 on rank 0 alone
    merged = {"traceEvents": [step(0, 0, 0, 100), step(0, 1, 60, 100), step(1, 0, 200, 150), step(1, 1, 200, 10),
                              step(2, 0, 400, 20), step(2, 1, 400, 20)]}  # fmt: skip
    w = slowest_step(merged)
    assert (w.label, w.start, w.end) == ("slowest step (0)", 0, 160)
    assert slowest_step(merged, first=1).label == "slowest step (1)"
    assert slowest_step(merged, step=2).label == "step 2"
    with pytest.raises(ValueError, match="step 7 is not on the timeline; marked steps: \\[0, 1, 2\\]"):
        slowest_step(merged, step=7)
    with pytest.raises(ValueError, match="no step numbered 5 or more"):
        slowest_step(merged, first=5)
