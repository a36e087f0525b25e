"""The planner's dense allreduce (``sparsync.plan.backend``, NCCL's choice of ring or tree on two levels) against
allreduce figures published for real clusters (nccl-tests' ``all_reduce_perf``, as posted in NVIDIA's issue
trackers): ``python -m sparsync_bench.plan_published [--out PATH]``.

Each figure is a cluster (nodes, GPUs a node, the network per node, the intra-node link), a message size and
the time ``all_reduce_perf`` printed (or its bus bandwidth, busbw = 2(P-1)/P · bytes / time); the planner is
given the cluster's nominal link rates and an α per message (``Figure.alpha``: 5 µs on InfiniBand, where NCCL's
own tuning model puts a network hop's latency at a few µs; 2 µs on NVLink) and prices the same call.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from sparsync.plan import Cluster
from sparsync.plan.backend import dense_allreduce
from sparsync_bench.report import write_json_md


@dataclass(frozen=True)
class Figure:
    """One published ``all_reduce_perf`` figure and the cluster it was measured on."""

    source: str  # where it was published
    what: str  # the cluster, in words
    nodes: int
    per_node: int  # GPUs a node
    network: float  # bytes/s per node (all its NICs)
    intra: float  # bytes/s of the intra-node link a ring or tree edge crosses
    nbytes: int  # the message
    seconds: float  # the published time (from busbw where only that was given)
    alpha: float = 5e-6  # seconds per network message assumed (module doc)
    intra_alpha: float = 2e-6

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    def predicted(self) -> tuple[str, float]:
        c = Cluster(self.nodes, self.per_node, bandwidth=self.network, latency=self.alpha,
                    intra_bandwidth=self.intra, intra_latency=self.intra_alpha, backend="nccl")  # fmt: skip
        return dense_allreduce(float(self.nbytes), c)


def _from_busbw(nbytes: int, ranks: int, busbw: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / busbw


FIGURES = (
    Figure("https://github.com/NVIDIA/nccl/issues/412 (sjeaugey, NCCL maintainer: what to expect)",
           "12 nodes x 8 A800, one 200 Gbit/s HDR NIC a node; 8 GB: ~24 GB/s busbw inter-node",
           12, 8, 25e9, 160e9, 8 << 30, _from_busbw(8 << 30, 96, 24e9)),
    Figure("https://github.com/NVIDIA/nccl-tests/issues/78 (a user's 8-node run)",
           "8 nodes x 8 V100, 100 Gbit/s InfiniBand; 256 MiB: 122,131 us (busbw 4.33 GB/s)",
           8, 8, 12.5e9, 150e9, 268435456, 122131e-6),
    Figure("https://github.com/NVIDIA/nccl/issues/1244 (NVLSTree, NCCL 2.21.5)",
           "2 nodes x 8 H20, 8 NDR 400 Gbit/s NICs a node; 4 B: 47.54 us",
           2, 8, 400e9, 450e9, 4, 47.54e-6),
    Figure("https://github.com/NVIDIA/nccl/issues/318 (p3dn.24xlarge, one node)",
           "1 node x 8 V100 (NVLink); 8 B: 59.98 us",
           1, 8, 12.5e9, 150e9, 8, 59.98e-6),
)  # fmt: skip


def compare(figures: Sequence[Figure] = FIGURES) -> list[dict[str, object]]:
    """Per figure: the published and predicted seconds, the algorithm the planner chose, their ratio."""
    out: list[dict[str, object]] = []
    for f in figures:
        alg, t = f.predicted()
        out.append({**asdict(f), "ranks": f.ranks, "predicted": t, "algorithm": alg, "ratio": t / f.seconds})
    return out


def table(rows: Sequence[dict[str, object]]) -> str:
    lines = ["| figure | ranks | published | predicted (algorithm) | predicted / published |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        pub, pred = float(r["seconds"]), float(r["predicted"])  # type: ignore[arg-type]
        lines.append(f"| {r['what']} ([source]({str(r['source']).split(' ')[0]})) | {r['ranks']} | "
                     f"{_ms(pub)} | {_ms(pred)} ({r['algorithm']}) | {pred / pub:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m sparsync_bench.plan_published"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    a = ap.parse_args(argv)
    rows = compare()
    text = table(rows)
    print(text)
    if a.out is not None:
        write_json_md(a.out, rows, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
