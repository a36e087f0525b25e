"""``sparsync reproduce``'s TF-Replicator section: one script (``examples/replicator_digits_cnn.py``) on 1, 2 and 4
local replicas and under torchrun, beside torch DDP, loss curves compared."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from sparsync_bench.report import pyplot, save_figure
from sparsync_bench.reproduce.common import ROOT, Ctx, img, table


def _curve(cmd: list[str], path: Path, env: dict[str, str] | None = None) -> list[float]:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    log = path.with_suffix(".log")
    log.write_text(res.stdout + res.stderr)
    if res.returncode:
        errors = [ln for ln in res.stderr.splitlines() if "Error" in ln or "error:" in ln][:8]
        raise RuntimeError(f"{' '.join(cmd)} exited with status {res.returncode} (output in {log}): "
                           + " | ".join(errors))  # fmt: skip
    return [float(x) for x in json.loads(path.read_text())]


def replicator_curves(ctx: Ctx) -> dict[str, list[float]]:
    """The loss curve of examples/replicator_digits_cnn.py per way of running it."""
    script = ROOT / "examples" / "replicator_digits_cnn.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: run from a checkout")
    curves: dict[str, list[float]] = {}
    d = ctx.out / "replicator"
    d.mkdir(parents=True, exist_ok=True)
    for n in ctx.scale.replicas:
        path = d / f"replicas{n}.json"
        curves[f"{n} local replica{'s' if n > 1 else ''}"] = _curve(
            [sys.executable, str(script), "--replicas", str(n), "--curve", str(path)], path
        )
    n = ctx.scale.torchrun_procs
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
    ]
    for label, stem, extra in ((f"torchrun --nproc-per-node {n}", "torchrun", []),
                               (f"torch DDP, torchrun --nproc-per-node {n}", "ddp", ["--ddp"])):  # fmt: skip
        path = d / f"{stem}.json"
        curves[label] = _curve([*torchrun, str(script), *extra, "--curve", str(path)], path, env)
    return curves


def replicator_markdown(curves: dict[str, list[float]]) -> str:
    ref_name, ref = next(iter(curves.items()))
    body = []
    for name, c in curves.items():
        same = len(c) == len(ref)
        diff = max(abs(a - b) for a, b in zip(c, ref, strict=True)) if same else math.nan
        body.append([name, str(len(c)), f"{c[0]:.4f}", f"{c[-1]:.4f}", "-" if not same else f"{diff:.2e}"])
    return table(["run", "steps", "first loss", "last loss", f"max abs diff vs {ref_name}"], body)


def plot_curves(curves: dict[str, list[float]], png: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, c), style in zip(curves.items(), ("-", "--", ":", "-."), strict=False):
        ax.plot(c, style, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over replicas)")
    ax.set_title(f"one TF-Replicator script, {len(curves)} ways of running it")
    ax.legend()
    return save_figure(fig, png, dpi=110)


def section_replicator(ctx: Ctx) -> str:
    curves = replicator_curves(ctx)
    (ctx.out / "replicator" / "curves.json").write_text(json.dumps(curves))
    png = plot_curves(curves, ctx.out / "replicator" / "curves.png")
    return (
        "## TF-Replicator (Buchlovsky et al.): one script, any number of replicas\n\n"
        "**Paper**: the same replica code (input_fn + step_fn) runs on one device, many local devices or many "
        "machines, sync or async; §5 shows throughput scaling.\n\n"
        "**Here**: `examples/replicator_digits_cnn.py` (a CNN on scikit-learn's digits, global batch 96 split "
        "over the replicas, Adam, 8 epochs), unchanged, on "
        f"{', '.join(map(str, ctx.scale.replicas))} local replicas and under torchrun, and the same training by "
        "torch DDP under torchrun (the baseline; the model has no sparse part, so DDP's path is its dense "
        "allreduce):\n\n"
        + replicator_markdown(curves)
        + "\n"
        + img(ctx, png, "loss curves")
        + "\n**Why they differ**: splitting a batch over replicas changes the order of floating-point sums "
        "(per-replica means, then an allreduce), so curves agree to rounding, not bit for bit, across replica "
        "counts; the same replica count is bit-identical run to run (tests/test_determinism.py).\n"
    )
