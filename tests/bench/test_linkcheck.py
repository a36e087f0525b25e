"""The link sanity check shaped benchmark runs print first (``sparsync_bench.linkcheck``)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from test_netem import CAN_NETNS

from sparsync.launch import launch
from sparsync_bench import linkcheck
from sparsync_bench.runner import Run


def _small(rank: int) -> dict[str, object]:
    return linkcheck.link_worker(rank, stream_bytes=1 << 16, values=1 << 12)


@pytest.mark.multiprocess
def test_the_check_times_streams_and_an_allreduce_on_every_rank() -> None:
    P = 3
    res = launch(_small, nprocs=P, timeout=120)
    assert res[0] == res[-1]  # the slowest rank's times, agreed
    r = res[0]
    assert r["P"] == P and all(float(r[k]) > 0 for k in ("one_s", "ring_s", "allreduce_s"))  # type: ignore[arg-type]


def test_summary_and_warning() -> None:
    """Shares of a 1 Gbit/s rate and the ring bound, from given times; a warning below 80% of the rate only."""
    res = {
        "P": 4,
        "stream_bytes": 125_000_000,
        "values": 25_000_000,
        "one_s": 1.0,
        "ring_s": 2.0,
        "allreduce_s": 1.2,  # the ring bound of 100 MB at P = 4: 2·3/4·100/125 s
    }
    s = linkcheck.summarize(res, 10**9)
    assert s["one_share"] == pytest.approx(1.0) and s["ring_share"] == pytest.approx(0.5)
    assert s["ring_bound_s"] == pytest.approx(1.2) and s["allreduce_x_bound"] == pytest.approx(1.0)
    line = linkcheck.render(s, 4, "1gbit")
    assert "1 stream 125 MB/s (100%), 4 parallel streams 62 MB/s each (50%)" in line and "less than" in line
    fine = linkcheck.render(linkcheck.summarize({**res, "ring_s": 1.1}, 10**9), 4, "1gbit")
    assert "less than" not in fine and "= 1.00x the ring bound 1200 ms" in fine


@pytest.mark.netns
@pytest.mark.multiprocess
@pytest.mark.skipif(not CAN_NETNS, reason="needs root and ip/tc to create network namespaces")
def test_a_shaped_run_prints_and_keeps_the_check(tmp_path: Path) -> None:
    buf = io.StringIO()
    meta: dict[str, object] = {}
    Run.start(tmp_path / "x", meta, net="1gbit", latency=None, console=Console(file=buf, width=200), link_procs=2)
    assert "link check (1gbit = 125 MB/s): 1 stream" in buf.getvalue()
    check = meta["link_check"]
    assert isinstance(check, dict) and check["P"] == 2 and check["rate_Bps"] == 125e6
