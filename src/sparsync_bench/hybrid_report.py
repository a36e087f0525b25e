"""What ``sparsync bench hybrid`` shows (run by ``runner.run_hybrid_bench``): the table, the targets of the
hybrid issue, the speeds relative to the baselines, and the plan's predictions next to the measurements
(``sparsync plan`` validation): bytes per machine per step, and communication time per step priced with the link
each run measured (``Cluster(measured=...)``, the dense allreduce fused as the trainers send it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sparsync.costmodel import LinkModel
from sparsync.plan.cluster import Cluster
from sparsync.plan.detect import ParamStats
from sparsync.plan.planner import Plan, make_plan
from sparsync_bench.hybrid import HybridBenchConfig
from sparsync_bench.lm import SampledLM
from sparsync_bench.report import Check, pyplot, save_figure
from sparsync_bench.tables import show_table

# method -> the plan placement of the embedding that describes it (dense parameters: dense allreduce)
PLAN_OF = {
    "allreduce": "dense_allreduce",
    "sparse_ar": "sparse_allreduce",
    "hybrid": "ps",
    "hybrid_sketch": "sketch",
}


def method_plan(
    cfg: HybridBenchConfig, P: int, alpha: float, method: str, link: LinkModel | None = None
) -> Plan | None:
    """The plan describing ``method`` at P machines with the measured α (and the measured ``link`` when given);
    None where no plan placement matches."""
    if method not in PLAN_OF or P < 2:
        return None
    model = SampledLM(cfg.vocab, cfg.dim, cfg.hidden)
    stats = [
        ParamStats(n, tuple(p.shape), alpha if n == "emb.weight" else 1.0, n == "emb.weight", alpha)
        for n, p in model.named_parameters()
    ]
    return make_plan(stats, Cluster(P, measured=link), overrides={"emb.weight": PLAN_OF[method]},
                     sketch_ratio=cfg.sketch_ratio)  # fmt: skip


def _error(pred: float | None, measured: float) -> float | None:
    return None if pred is None or measured <= 0 else (pred - measured) / measured


def add_predictions(rows: list[dict[str, Any]], cfg: HybridBenchConfig, P: int, net: str | None) -> None:
    """Give each row of one run (P ranks) its plan's bytes and communication time, priced with the link the
    run measured, and their errors against the measurements (changes ``rows``)."""
    for r in rows:
        plan = method_plan(cfg, P, r["alpha"], r["method"], LinkModel(**r["link"]))
        r["net"] = net or "loopback"
        r["predicted_bytes"] = None if plan is None else plan.bytes_per_machine
        r["bytes_error"] = _error(r["predicted_bytes"], r["bytes_per_step_per_machine"])
        r["predicted_comm_ms"] = None if plan is None else 1e3 * plan.fused_seconds
        r["comm_error"] = _error(r["predicted_comm_ms"], r["comm_ms"])


def print_table(rows: list[dict[str, Any]], console: Console, title: str) -> None:
    t = Table(title=title)
    cols = ("P", "seq", "α", "method", "words/s", "ms/step", "MB/step/machine", "plan MB", "plan err", "comm ms",
            "plan ms", "loss")  # fmt: skip
    for col in cols:
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        pred, err = r["predicted_bytes"], r["bytes_error"]
        t.add_row(
            str(r["P"]), str(r["seq"]), f"{r['alpha']:.4f}", r["method"], f"{r['words_per_s']:,.0f}",
            f"{r['step_s'] * 1e3:.1f}", f"{r['bytes_per_step_per_machine'] / 1e6:.3f}",
            "-" if pred is None else f"{pred / 1e6:.3f}", "-" if err is None else f"{err * 100:+.1f}%",
            f"{r['comm_ms']:.1f}", "-" if r.get("predicted_comm_ms") is None else f"{r['predicted_comm_ms']:.1f}",
            f"{r['loss']:.4f}",
        )  # fmt: skip
    show_table(console, t)


BASELINES = {"allreduce": "dense allreduce", "ddp_sparse": "DDP (sparse grads)"}


def relative_speed(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per "P=.. seq=..": every method's words/s over each baseline's (``BASELINES``) that ran there."""
    groups: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["P"], r["seq"]), {})[r["method"]] = r["words_per_s"]
    return {
        f"P={P} seq={seq}": {b: {m: x / w[b] for m, x in w.items() if m != b} for b in BASELINES if b in w}
        for (P, seq), w in groups.items()
    }


def compare_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (P, seq) and baseline: each method's speed (words/s) as a multiple of the baseline's."""
    out = []
    for where, per in relative_speed(rows).items():
        for b, rel in per.items():
            ms = ", ".join(f"{m} {x:.2f}x" for m, x in rel.items())
            out.append(f"{where}, words/s relative to {BASELINES[b]}: {ms}")
    return out


def check_targets(rows: list[dict[str, Any]]) -> list[Check]:
    """Per (P, seq): hybrid >= 3x all-dense allreduce, >= 1.5x allgather and >= 1.5x DDP with sparse
    gradients (torch's own allgather way) in words/s; AR < PS < hybrid."""
    out = []
    groups: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["P"], r["seq"]), {})[r["method"]] = r["words_per_s"]
    for (P, seq), w in groups.items():
        if "hybrid" not in w:
            continue
        if "allreduce" in w:
            x = w["hybrid"] / w["allreduce"]
            out.append((f"P={P} seq={seq}: hybrid >= 3x all-dense allreduce", x >= 3, f"{x:.2f}x"))
        if "allgather" in w:
            x = w["hybrid"] / w["allgather"]
            out.append((f"P={P} seq={seq}: hybrid >= 1.5x allgather", x >= 1.5, f"{x:.2f}x"))
        if "ddp_sparse" in w:
            x = w["hybrid"] / w["ddp_sparse"]
            out.append((f"P={P} seq={seq}: hybrid >= 1.5x DDP (sparse grads)", x >= 1.5, f"{x:.2f}x"))
        if "allreduce" in w and "ps" in w:
            ok = w["allreduce"] < w["ps"] < w["hybrid"]
            out.append((f"P={P} seq={seq}: AR < PS < hybrid (Parallax Table 4)", ok,
                        f"{w['allreduce']:,.0f} / {w['ps']:,.0f} / {w['hybrid']:,.0f} words/s"))  # fmt: skip
    return out


def plan_time_errors(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean |predicted - measured| / measured communication time per step, per method with a plan."""
    errs: dict[str, list[float]] = {}
    for r in rows:
        if r.get("comm_error") is not None:
            errs.setdefault(r["method"], []).append(abs(r["comm_error"]))
    return {m: sum(e) / len(e) for m, e in errs.items()}


def plot_plan_time(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    """Predicted (dashed) and measured (solid) communication ms per step against P, one colour per method."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    planned = [r for r in rows if r.get("predicted_comm_ms") is not None]
    for k, m in enumerate(dict.fromkeys(r["method"] for r in planned)):
        for seq in dict.fromkeys(r["seq"] for r in planned):
            rs = sorted((r for r in planned if r["method"] == m and r["seq"] == seq), key=lambda r: r["P"])
            label = m if len(rs) == len([r for r in planned if r["method"] == m]) else f"{m} seq={seq}"
            ps = [r["P"] for r in rs]
            ax.plot(ps, [r["comm_ms"] for r in rs], "o-", color=f"C{k}", label=f"{label} measured")
            ax.plot(ps, [r["predicted_comm_ms"] for r in rs], "x--", color=f"C{k}", label=f"{label} plan")
    ax.set_xlabel("P (machines)")
    ax.set_ylabel("communication ms per step")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("sparsync plan vs measured: " + title, fontsize=8)
    return save_figure(fig, out.with_name(out.name + "_plan_time.png"), dpi=120)


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    groups = list(dict.fromkeys((r["P"], r["seq"]) for r in rows))
    width = 0.8 / max(1, len(methods))
    for k, m in enumerate(methods):
        for ax, key, scale in ((axes[0], "words_per_s", 1.0), (axes[1], "bytes_per_step_per_machine", 1e-6)):
            ys = [next((r[key] * scale for r in rows if r["method"] == m and (r["P"], r["seq"]) == g), 0.0)
                  for g in groups]  # fmt: skip
            ax.bar([i + k * width for i in range(len(groups))], ys, width, label=m)
    for ax, label in ((axes[0], "words/s"), (axes[1], "MB per step per machine")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"P={P}\nseq={s}" for P, s in groups])
        ax.set_ylabel(label)
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, out.with_suffix(".png"), dpi=120)
