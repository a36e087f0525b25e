"""``sparsync bench compress``: what each compressor costs next to the dense allreduce it replaces.

For every tensor size N and compressor, on P ranks at once (every rank compresses its own Gaussian tensor, as
in training, so the compressors compete for the cores as the allreduce does): compress and decompress time
(slowest rank, median of ``repeats`` after one warm-up), payload bytes, relative error
‖x - D(C(x))‖ / ‖x‖, the end-to-end ``sparsync.compressed_allreduce`` time, and a dense gloo allreduce of the
same tensor in the same run. Threshold runs with lifespan 1 and 1000 (DCT Fig. 7a: recomputing τ every step costs
more than it saves); the warm-up call computes τ, so the timed L=1000 calls reuse it, as 999 of 1000 training
steps do.
Target: Threshold(L=1000) compress + decompress ≤ 10% of the dense allreduce. The compressors' targets
(``check_compressors``): every compressor's reduce faster than the dense allreduce, QSGD 4-bit ≥ 3x and
8-bit ≥ 1.8x faster, and a 16-bit cast's reduce at most half the dense allreduce (half the bytes, less than
half the time).
The ``ns/el`` column is compress + decompress per tensor element. ``hook µs``: each compressor's DDP hook on a
bucket of 256 values, the fixed cost every bucket pays, beside DDP's own allreduce hook (``hook_cost.py``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from sparsync.compress import Compressor, Context, Encoding, TensorSpec, compressed_allreduce, from_spec
from sparsync_bench import hook_cost
from sparsync_bench.allreduce import _timed
from sparsync_bench.fmt import markdown_table, ms
from sparsync_bench.report import Check, progress, pyplot, save_figure, targets_markdown
from sparsync_bench.tables import show_table

DEFAULT_COMPRESSORS = (
    "identity",
    "fp16",
    "bf16",
    "topk:ratio=0.01",
    "topk:ratio=0.01,bucket=512",
    "threshold:ratio=0.01,lifespan=1",
    "threshold:ratio=0.01,lifespan=1000",
    "randomk:ratio=0.01",
    "qsgd:bits=4,bucket=512",
    "qsgd:bits=4,bucket=512,aggregation=allgather",
    "qsgd:bits=8,bucket=512",
    "blocktopk:ratio=0.01,block=64",
    "sketch:rows=3,ratio=0.01",
    "sketch:rows=3,ratio=0.01,hash=element",
)
TARGET = "threshold:ratio=0.01,lifespan=1000"
TARGET_FRACTION = 0.10
QSGD_SPEEDUP = {"qsgd:bits=4,bucket=512": 3.0, "qsgd:bits=8,bucket=512": 1.8}  # dense / reduce
CASTS = ("fp16", "bf16")


@dataclass(frozen=True)
class CompressBenchConfig:
    sizes: tuple[int, ...] = (1_000_000, 25_000_000)  # N, float32 entries per rank
    compressors: tuple[str, ...] = DEFAULT_COMPRESSORS  # registry specs, see sparsync.compress.from_spec
    repeats: int = 3  # timed runs per measurement, after one warm-up
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or any(n < 1 for n in self.sizes):
            raise ValueError(f"sizes must be positive, got {self.sizes}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        for spec in self.compressors:
            from_spec(spec)  # KeyError/ValueError naming a bad spec, before any process starts


def _median(run: Any, repeats: int) -> float:
    run()  # warm-up (for Threshold L=1000: computes τ)
    return statistics.median(_timed(run) for _ in range(repeats))


def _measure(rank: int, P: int, n: int, spec: str, x: torch.Tensor, repeats: int) -> dict[str, Any]:
    comp = from_spec(spec)
    ctx = Context("x", rank, P)
    xs = TensorSpec.of(x)
    payload = comp.compress(x, ctx)
    t_c = _median(lambda: comp.compress(x, ctx), repeats)
    t_d = _median(lambda: comp.decompress(payload, xs), repeats)
    y = comp.decompress(payload, xs)
    err = torch.tensor([float((x - y).norm() / x.norm()), float(payload.nbytes)], dtype=torch.float64)
    dist.all_reduce(err)
    rcomp = from_spec(spec)
    t_r = _median(lambda: compressed_allreduce(x, rcomp, name="x"), repeats)
    return {
        "n": n,
        "world_size": P,
        "compressor": spec,
        "aggregation": _aggregation(comp, x, ctx),
        "compress_s": t_c,
        "decompress_s": t_d,
        "cd_s": t_c + t_d,
        "cd_ns_per_el": (t_c + t_d) / n * 1e9,
        "payload_bytes": float(err[1]) / P,
        "bytes_ratio": float(err[1]) / P / (n * 4),
        "rel_error": float(err[0]) / P,
        "reduce_s": t_r,
    }


def _aggregation(comp: Compressor, x: torch.Tensor, ctx: Context) -> str:
    """The name of the aggregator ``compressed_allreduce`` runs for ``x`` (no memory, synchronous)."""
    return comp.aggregator(Encoding(comp, x, x, TensorSpec.of(x), ctx)).name


def worker(rank: int, cfg: CompressBenchConfig, show_progress: bool) -> list[dict[str, Any]]:
    """Runs on every rank; rank 0 returns the rows."""
    P = dist.get_world_size()
    rows: list[dict[str, Any]] = []
    total = (len(cfg.sizes) + 1) * (len(cfg.compressors) + 1)
    with progress(show_progress and rank == 0, f"P={P}", total) as update:
        # each compressor's DDP hook on a tiny bucket: the fixed cost every bucket pays (hook_cost.py)
        ddp_hook = hook_cost.ddp_hook_s(rank, cfg.repeats)
        update(None, 1)
        hooks = {}
        for spec in cfg.compressors:
            hooks[spec] = hook_cost.hook_s(rank, spec, cfg.repeats)
            update(None, 1)
        for n in cfg.sizes:
            x = torch.randn(n, generator=torch.Generator().manual_seed(cfg.seed * 1009 + rank))
            dense = _median(lambda x=x: dist.all_reduce(x.clone()), cfg.repeats)
            update(None, 1)
            for spec in cfg.compressors:
                row = _measure(rank, P, n, spec, x, cfg.repeats)
                row["dense_allreduce_s"] = dense
                row["cd_over_dense"] = row["cd_s"] / dense
                row["reduce_over_dense"] = row["reduce_s"] / dense
                row["hook_tiny_s"] = hooks[spec]
                row["ddp_hook_tiny_s"] = ddp_hook
                rows.append(row)
                update(None, 1)
    return rows if rank == 0 else []


# --- output -------------------------------------------------------------------------------------------------
def print_table(rows: list[dict[str, Any]], console: Console, title: str) -> None:
    table = Table(title=title)
    cols = ("N", "compressor", "agg", "comp ms", "dec ms", "ns/el", "c+d/ar", "bytes", "rel err", "reduce ms",
            "hook µs")  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c in ("compressor", "agg") else "right")
    last_n = None
    for r in rows:
        if r["n"] != last_n:
            table.add_row(
                f"{r['n']:,}",
                "[b]dense allreduce (gloo)[/]",
                "",
                "",
                "",
                "",
                "",
                "",
                "",
                f"{r['dense_allreduce_s'] * 1e3:.1f}",
                f"{r['ddp_hook_tiny_s'] * 1e6:.0f} (DDP's)",
            )
            last_n = r["n"]
        table.add_row(
            "",
            _short(r["compressor"]),
            _AGG[r["aggregation"]],
            f"{r['compress_s'] * 1e3:.2f}",
            f"{r['decompress_s'] * 1e3:.2f}",
            f"{r['cd_ns_per_el']:.2f}",
            f"{r['cd_over_dense']:.3f}",
            f"{r['bytes_ratio']:.3f}",
            f"{r['rel_error']:.3f}",
            f"{r['reduce_s'] * 1e3:.1f}",
            f"{r['hook_tiny_s'] * 1e6:.0f}",
        )
    show_table(console, table)
    console.print(
        "ns/el: (compress + decompress) per element; c+d/ar: (compress + decompress) / dense allreduce; bytes: "
        "payload per rank / dense float32 bytes; rel err: ‖x - D(C(x))‖/‖x‖ (mean over ranks); agg: ar = dense "
        "allreduce, ag = allgather, rs = quantized reduce-scatter + allgather; hook µs: a bucket of "
        f"{hook_cost.TINY} float32 through the compressor's DDP hook, no error feedback (the fixed cost per "
        "bucket; DDP's own allreduce hook in the dense row)"
    )


_AGG = {"allreduce": "ar", "sparse_allreduce": "sparse", "allgather": "ag", "reduce_scatter": "rs"}


def check_targets(rows: list[dict[str, Any]]) -> list[Check]:
    """The compression targets (Threshold(L=1000) compress + decompress ≤ 10% of the dense allreduce; L=1000
    cheaper than L=1) where Threshold(L=1000) ran, then the compressors' (``check_compressors``)."""
    return _check_threshold(rows) + check_compressors(rows)


def _check_threshold(rows: list[dict[str, Any]]) -> list[Check]:
    out: list[Check] = []
    by_n: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by_n[r["n"]][r["compressor"]] = r
    for n, by in sorted(by_n.items()):
        t = by.get(TARGET)
        if t is None:
            continue
        out.append(
            (
                f"N={n:,}: Threshold(L=1000) compress+decompress <= {TARGET_FRACTION:.0%} of dense allreduce",
                t["cd_over_dense"] <= TARGET_FRACTION,
                f"{t['cd_over_dense']:.1%} ({t['cd_s'] * 1e3:.1f} ms vs {t['dense_allreduce_s'] * 1e3:.1f} ms)",
            )
        )
        l1 = by.get(TARGET.replace("lifespan=1000", "lifespan=1"))
        if l1 is not None:
            out.append(
                (
                    f"N={n:,}: Threshold L=1000 cheaper than L=1 (DCT Fig. 7a)",
                    t["cd_s"] < l1["cd_s"],
                    f"{l1['cd_s'] / t['cd_s']:.1f}x",
                )
            )
    return out


def check_compressors(rows: list[dict[str, Any]]) -> list[Check]:
    """The targets, per N: every compressor's (identity aside) reduce faster than the dense allreduce; QSGD
    4-bit (8-bit) ≥ 3x (1.8x) faster; a 16-bit cast's reduce ≤ half the dense allreduce (item 4: half the
    bytes must cost less than half the time)."""
    out: list[Check] = []
    by_n: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_n[r["n"]].append(r)
    for n, rs in sorted(by_n.items()):
        slow = [
            f"{_short(r['compressor'])} {r['reduce_over_dense']:.2f}x"
            for r in rs
            if r["reduce_over_dense"] >= 1 and r["compressor"] != "identity"  # identity is the dense allreduce
        ]
        out.append(
            (
                f"N={n:,}: every compressor's reduce (identity aside) faster than the dense allreduce",
                not slow,
                "all faster" if not slow else "slower: " + ", ".join(slow),
            )
        )
        for r in rs:
            want = QSGD_SPEEDUP.get(r["compressor"])
            if want is not None:
                got = 1 / r["reduce_over_dense"]
                out.append(
                    (
                        f"N={n:,}: {_short(r['compressor'])} reduce >= {want}x faster than dense",
                        got >= want,
                        f"{got:.2f}x",
                    )
                )
            if r["compressor"] in CASTS:
                out.append(
                    (
                        f"N={n:,}: {r['compressor']} reduce <= 50% of the dense allreduce (half the bytes)",
                        r["reduce_over_dense"] <= 0.5,
                        f"{r['reduce_over_dense']:.0%} (compress+decompress {r['cd_over_dense']:.1%})",
                    )
                )
    return out


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    plt = pyplot()
    sizes = sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(2, len(sizes), figsize=(6.5 * len(sizes), 9), squeeze=False)
    for j, n in enumerate(sizes):
        pts = [r for r in rows if r["n"] == n]
        markers = "osD^v<>phX*P"
        for i, r in enumerate(pts):
            style = {"s": 30, "marker": markers[i % len(markers)], "label": _short(r["compressor"])}
            axes[0][j].scatter(r["payload_bytes"], max(r["rel_error"], 1e-6), **style)
            axes[1][j].scatter(r["payload_bytes"], r["cd_s"], **style)
            axes[1][j].scatter(r["payload_bytes"], r["reduce_s"], s=14, marker="x", color="gray")
        dense = pts[0]["dense_allreduce_s"]
        axes[1][j].axhline(dense, color="black", lw=1, label="dense allreduce")
        axes[1][j].axhline(dense * TARGET_FRACTION, color="black", lw=1, ls=":", label="10% of dense allreduce")
        axes[0][j].set(xscale="log", yscale="log", xlabel="payload bytes per rank", ylabel="relative error")
        axes[1][j].set(xscale="log", yscale="log", xlabel="payload bytes per rank", ylabel="seconds")
        axes[0][j].set_title(f"N = {n:,}: error vs bytes")
        axes[1][j].set_title(f"N = {n:,}: compress+decompress (marker), reduce (gray x) vs bytes")
        axes[0][j].legend(fontsize=6, ncol=2)
        axes[1][j].legend(fontsize=6, ncol=2)
        for ax in axes[:, j]:
            ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    return save_figure(fig, out.with_suffix(".png"), dpi=110)


def _short(spec: str) -> str:
    return (
        spec.replace("ratio=", "")
        .replace("lifespan=", "L=")
        .replace("bucket=", "b=")
        .replace("bits=", "")
        .replace("rows=", "r=")
        .replace("block=", "blk=")
        .replace(",", " ")
        .replace(":", " ")
    )


def markdown(rows: list[dict[str, Any]], checks: list[Check], title: str) -> str:
    head = ["N", "compressor", "aggregation", "compress ms", "decompress ms", "c+d ns/el", "(c+d)/dense",
            "bytes ratio", "rel. error", "reduce ms", "dense allreduce ms", f"hook µs ({hook_cost.TINY} values)",
            "DDP's hook µs"]  # fmt: skip
    body = [
        [f"{r['n']:,}", r["compressor"], r["aggregation"], ms(r["compress_s"]), ms(r["decompress_s"]),
         f"{r['cd_ns_per_el']:.2f}", f"{r['cd_over_dense']:.3f}", f"{r['bytes_ratio']:.4f}",
         f"{r['rel_error']:.3f}",
         ms(r["reduce_s"], ".1f"), ms(r["dense_allreduce_s"], ".1f"), f"{r['hook_tiny_s'] * 1e6:.0f}",
         f"{r['ddp_hook_tiny_s'] * 1e6:.0f}"]
        for r in rows
    ]  # fmt: skip
    lines = [f"### {title}", "", *markdown_table(head, body)]
    return "\n".join(lines + targets_markdown(checks)) + "\n"
