"""The link sanity check every shaped benchmark run prints first: what the emulated links deliver.

On ``--net RATE`` links: one TCP stream's goodput (rank 0 -> 1), P parallel streams' (rank i -> i + 1, all at
once: every link carries one stream each way) against the configured rate, and gloo's dense allreduce of
``ALLREDUCE_VALUES`` float32 against the ring bound 2(P - 1)/P · n / B. A comparison between two traffic
patterns is only fair when both patterns get the rate: a link that delivers much less to one of them (a deep
queue, CPU starvation of the receiving ranks) shows here before it shows as an "x faster".
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sparsync_bench.allreduce import _timed as timed

STREAM_BYTES = 8 << 20  # per stream: 67 ms at 1 Gbit/s
ALLREDUCE_VALUES = 4 << 20  # float32: 16 MB
REPEATS = 3
LOW = 0.8  # below this share of the configured rate (or above 1/LOW of the ring bound): a warning


def link_worker(rank: int, stream_bytes: int = STREAM_BYTES, values: int = ALLREDUCE_VALUES) -> dict[str, Any]:
    """Median seconds (slowest rank, ``REPEATS`` runs after a warm-up) of one stream, P parallel streams and a
    dense allreduce, on the group ``launch`` made."""
    P = dist.get_world_size()
    send = torch.zeros(stream_bytes, dtype=torch.uint8)
    recv = torch.empty_like(send)
    x = torch.zeros(values)

    def one() -> None:
        if rank == 0:
            dist.send(send, 1)
        elif rank == 1:
            dist.recv(recv, 0)

    def ring() -> None:
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % P), dist.P2POp(dist.irecv, recv, (rank - 1) % P)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def allreduce() -> None:
        dist.all_reduce(x)

    return {"P": P, "stream_bytes": stream_bytes, "values": values,
            "one_s": _timed(one), "ring_s": _timed(ring), "allreduce_s": _timed(allreduce)}  # fmt: skip


def _timed(fn: Callable[[], None]) -> float:
    """Median of ``REPEATS`` runs after a warm-up (connections, buffers), each the slowest rank's."""
    return statistics.median([timed(fn) for _ in range(REPEATS + 1)][1:])


def summarize(res: dict[str, Any], rate_bits: int) -> dict[str, float]:
    """Goodputs (bytes/s), their shares of the rate, the ring bound and the allreduce's ratio to it."""
    rate = rate_bits / 8
    P, n = res["P"], res["values"] * 4
    bound = 2 * (P - 1) / P * n / rate
    one, ring = res["stream_bytes"] / res["one_s"], res["stream_bytes"] / res["ring_s"]
    return {
        "rate_Bps": rate,
        "allreduce_bytes": n,
        "one_Bps": one,
        "one_share": one / rate,
        "ring_Bps": ring,
        "ring_share": ring / rate,
        "allreduce_s": res["allreduce_s"],
        "ring_bound_s": bound,
        "allreduce_x_bound": res["allreduce_s"] / bound,
    }


def render(s: dict[str, float], P: int, rate: str) -> str:
    """One line (two with a warning) for the console."""
    line = (
        f"  link check ({rate} = {s['rate_Bps'] / 1e6:.0f} MB/s): 1 stream {s['one_Bps'] / 1e6:.0f} MB/s "
        f"({s['one_share']:.0%}), {P} parallel streams {s['ring_Bps'] / 1e6:.0f} MB/s each "
        f"({s['ring_share']:.0%}), "
        f"gloo allreduce of {s['allreduce_bytes'] / 1e6:.0f} MB {s['allreduce_s'] * 1e3:.0f} ms = "
        f"{s['allreduce_x_bound']:.2f}x the ring bound {s['ring_bound_s'] * 1e3:.0f} ms"
    )
    if min(s["one_share"], s["ring_share"]) < LOW or s["allreduce_x_bound"] > 1 / LOW:
        line += "\n  [yellow]the links deliver less than their rate: compare this run's figures with care[/]"
    return line
