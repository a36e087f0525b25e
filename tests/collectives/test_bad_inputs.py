"""The target for the collectives: every bad input raises a clear error on every rank within 2 s (not the
timeout), no silent wrong answer, and the group keeps working.

The table of cases is ``_bad_input_workers.CASES`` (sparse_allreduce with every algorithm, sparse_allgather,
allreduce of dense and COO tensors, grouped_allreduce, reduce with compressors, the ReplicaContext primitives);
all of them run in one launch of 3 gloo ranks (a module-scoped fixture), each on a fresh group, and each case's
assertions are one parametrized test over the recorded results. Cases the code does not handle today are
an expected failure (``pytest.xfail``) with the defect as the reason (docs/reliability.md lists them
with a reproduction) only while they fail exactly as ``KNOWN`` records: a crash, a hang or a fix fails the test,
and a fix says to remove the case from ``DEFECTS``.

Run ``python tests/collectives/test_bad_inputs.py`` to print the report table of docs/reliability.md.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import _bad_input_workers as bw
import numpy as np
import pytest

from sparsync import LaunchError, launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

Records = dict[str, list[dict[str, Any]]]

_EARLY = "raises on the bad rank only, before the metadata round; the others wait for the timeout"
_SEQ = (
    "calls of one signature are told apart only by name= (sar_*_named_* cases); unnamed, a skipped or "
    "reordered call pairs up with another of the same signature silently"
)
DEFECTS = {
    "sar_skipped_call_same_shape": (
        f"silent wrong + hang: {_SEQ}; the skipping rank gets a wrong sum, the others "
        "time out on their second call"
    ),
    "sar_reordered_calls_same_shape": f"silent wrong: {_SEQ}; both calls give wrong sums on every rank",
    "rep_skipped_call_same_shape": f"silent wrong + hang: {_SEQ} (the primitives share the counter)",
}


def probe(out_dir: Path) -> Records:
    """Every case's record on every rank. A case that kills a rank is recorded as a crash on the ranks that did
    not finish it, and the cases after it run in a new launch."""
    todo = [c.name for c in bw.CASES]
    records: Records = {}
    for attempt in range(len(todo)):
        if not todo:
            break
        run_dir = out_dir / f"launch{attempt}"
        run_dir.mkdir()
        error: LaunchError | None = None
        try:
            launch(bw.probe_worker, nprocs=bw.WORLD, args=(todo, str(run_dir)), timeout=60)
        except LaunchError as e:
            error = e
        started: list[str] = []
        for rank in range(bw.WORLD):
            path = run_dir / f"rank{rank}.jsonl"
            for line in path.read_text().splitlines() if path.exists() else []:
                rec = json.loads(line)
                if rec.get("started"):
                    started += [] if rec["case"] in started else [rec["case"]]
                else:
                    records.setdefault(rec["case"], [{} for _ in range(bw.WORLD)])[rank] = rec
        if error is None:
            break
        if not started:
            raise error  # the launch failed before any case: not a case's doing
        crashed = max(started, key=todo.index)
        first_line = str(error).splitlines()[0]
        recs = records.setdefault(crashed, [{} for _ in range(bw.WORLD)])
        for rank in range(bw.WORLD):
            recs[rank] = recs[rank] or {"case": crashed, "kind": "crash", "message": first_line, "seconds": None}
        todo = todo[todo.index(crashed) + 1 :]
    return records


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Records:
    return probe(tmp_path_factory.mktemp("bad_inputs"))


def problems(case: bw.Case, recs: list[dict[str, Any]]) -> list[str]:
    """What keeps ``case`` from meeting the target (empty: handled)."""
    out: list[str] = []
    kinds = [r.get("kind", "missing") for r in recs]
    if any(k in ("crash", "missing") for k in kinds):
        return [f"ranks died: {kinds}: {next(r['message'] for r in recs if r.get('kind') == 'crash')}"]
    clear_error = (
        case.match is not None
        and len(set(kinds)) == 1
        and kinds[0] in ("ValueError", "TypeError")
        and all(re.search(case.match, r["message"]) for r in recs)
    )
    right_answer = case.want is not None and all(
        k == "ok" and same(r["value"], case.want()) for k, r in zip(kinds, recs, strict=True)
    )
    if not (clear_error or right_answer):
        got = [f"rank {i}: {r['kind']}: {r.get('message', r.get('value'))}"[:300] for i, r in enumerate(recs)]
        wanted = " or ".join(
            ([f"ValueError/TypeError matching {case.match!r} on every rank"] if case.match else [])
            + ([f"result {np.asarray(case.want()).tolist()}"] if case.want else [])
        )
        out.append(f"want {wanted}; got {got}")
    slowest = max(r["seconds"] for r in recs)
    if slowest > bw.LIMIT:
        out.append(f"a rank took {slowest:.2f} s (limit {bw.LIMIT} s)")
    afters = [r.get("after") for r in recs]
    if not all(a == [bw.WORLD * (bw.WORLD + 1) / 2] * 3 for a in afters):
        out.append(f"the group does not work afterwards: follow-up allreduce gave {afters}")
    return out


def same(got: Any, want: Any) -> bool:
    a, b = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


# Each defect as it shows today, per rank: the wrong sum it returns, or PEER (a PeerError naming rank 1, the rank
# that skipped, within the 2 s timeout). Only this exact outcome counts as the expected failure: a crash, a hang,
# another wrong value or a fix fails the test.
PEER = "PeerError naming rank 1"
_WRONG = [[0.0, 4.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
KNOWN: dict[str, list[Any]] = {
    "sar_skipped_call_same_shape": [PEER, _WRONG, PEER],
    "sar_reordered_calls_same_shape": [[*_WRONG, [0.0, 5.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0]]] * 3,
    "rep_skipped_call_same_shape": [PEER, [[4.0, 4.0]], PEER],
}


def unlike_the_known_defect(name: str, recs: list[dict[str, Any]]) -> list[str]:
    """How ``recs`` differ from ``KNOWN[name]`` (empty: the defect exactly as documented)."""
    out = []
    for rank, (rec, want) in enumerate(zip(recs, KNOWN[name], strict=True)):
        if want == PEER:
            ok = rec.get("kind") == "PeerError" and "from peer rank 1" in rec.get("message", "")
        else:
            ok = rec.get("kind") == "ok" and same(rec["value"], want)
        if not ok or rec.get("seconds", float("inf")) > bw.LIMIT + 1.0:
            out.append(f"rank {rank}: want {want} within {bw.LIMIT + 1.0} s, got {rec}"[:400])
    return out


def test_the_table_is_large_enough_and_defects_name_cases() -> None:
    assert len(bw.CASES) >= 70
    assert set(DEFECTS) <= set(bw.BY_NAME) and set(KNOWN) == set(DEFECTS)
    for c in bw.CASES:
        assert c.match is not None or c.want is not None, c.name
        assert c.collective and c.note, c.name


@pytest.mark.parametrize("name", [c.name for c in bw.CASES])
def test_bad_input(records: Records, name: str) -> None:
    """Every rank raises ValueError/TypeError naming the bad value or rank (or a documented valid input gives the
    exact result), within 2 s, and the group still works afterwards. A case in ``DEFECTS`` is an expected
    failure only while it fails exactly as ``KNOWN`` records."""
    found = problems(bw.BY_NAME[name], records[name])
    if name in DEFECTS:
        assert found, f"{name} is handled now: remove it from DEFECTS and KNOWN"
        drift = unlike_the_known_defect(name, records[name])
        assert not drift, f"{name} no longer fails as documented:\n" + "\n".join(drift)
        pytest.xfail(DEFECTS[name])
    assert not found, "\n".join(found)


# --- the report (docs/reliability.md) -----------------------------------------------------------
def outcome(case: bw.Case, recs: list[dict[str, Any]]) -> tuple[str, str]:
    """(error on every rank, verdict) for the report."""
    kinds = [r.get("kind", "missing") for r in recs]
    found = problems(case, recs)
    if len(set(kinds)) == 1 and kinds[0] in ("ValueError", "TypeError"):
        every = f"yes ({kinds[0]})"
    elif all(k == "ok" for k in kinds):
        every = "no error, exact result" if not found else "no error, **wrong result**"
    else:
        every = "no: " + ", ".join(kinds)
    if not found:
        return every, "handled"
    if "crash" in kinds:
        return every, "**crash** (gloo SIGABRT)"
    if "PeerError" in kinds:
        return every, "**hang** until the timeout" + (", **wrong result** on a rank" if "ok" in kinds else "")
    if all(k == "ok" for k in kinds):
        return every, "**silent wrong**"
    return every, "message names neither the value nor the rank"


def report(records: Records) -> str:
    rows = [
        "| case | collective | bad input | ranks with bad input | error on every rank | max s | verdict |",
        "|---|---|---|---|---|---:|---|",
    ]
    for c in bw.CASES:
        recs = records[c.name]
        every, verdict = outcome(c, recs)
        secs = [r["seconds"] for r in recs if r.get("seconds") is not None]
        slowest = f"{max(secs):.2f}" if secs else "—"
        rows.append(f"| `{c.name}` | {c.collective} | {c.note} | {c.bad} | {every} | {slowest} | {verdict} |")
    handled = sum(not problems(c, records[c.name]) for c in bw.CASES)
    return f"{handled} of {len(bw.CASES)} handled\n\n" + "\n".join(rows)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print(report(probe(Path(d))))
