"""``sparsync reproduce``: each paper's headline experiment at laptop scale, in one report.

One section per paper, each a module of this package with its ``section(ctx)`` (what they share: ``common``),
each run by the benchmark that already measures it, at a scale chosen by ``Scale``
(``QUICK`` for ``--quick``, ``FULL`` otherwise), each table with torch's own path (gloo's sparse COO allreduce /
DDP with sparse gradients) and a dense allreduce as baselines:

- ``sparcml``: SparCML Fig. 4, time vs density per algorithm (``bench allreduce``), and the dense switch;
- ``s2``: the S2 sketch against an OmniReduce-style block-sparse allreduce and allgather on embedding gradients
  (``bench embedding``), bytes, time and the aggregate's error;
- ``dct``: DCT-DP and uncompressed sparsync against DDP on DLRM (``bench dlrm``), DCT-DP's life-span L (Fig. 7a)
  and DCT-MP's bytes at a model-parallel split (``examples/dlrm_hybrid.py``);
- ``parallax``: Table 3's bytes per machine (the plan's formulas vs measured) and Table 4's ordering on a
  language model trained on a real word-level corpus (GCIDE, ``bench hybrid``);
- ``replicator``: one TF-Replicator script on 1, 2 and 4 replicas and under torchrun, loss curves compared.

Each section writes its benchmark's own files (``<out>/<section>*.{json,md,png}``) and a part of
``<out>/report.md``; the report is rewritten after every section, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from sparsync_bench.corpus import GCIDE
from sparsync_bench.reproduce import dct, parallax, replicator, s2, sparcml
from sparsync_bench.reproduce.common import FULL, QUICK, ROOT, Ctx, Scale
from sparsync_bench.reproduce.dct import dlrm_markdown, lifespan_rows
from sparsync_bench.reproduce.parallax import lm_alpha, parallax_dlrm_markdown, parallax_markdown, table3_bytes
from sparsync_bench.reproduce.replicator import replicator_curves, replicator_markdown
from sparsync_bench.reproduce.s2 import s2_markdown, sketch_bias
from sparsync_bench.reproduce.sparcml import sparcml_markdown

SECTIONS = ("sparcml", "s2", "dct", "parallax", "replicator")
SECTION_RUNNERS: dict[str, Callable[[Ctx], str]] = {
    "sparcml": sparcml.section_sparcml, "s2": s2.section_s2, "dct": dct.section_dct,
    "parallax": parallax.section_parallax, "replicator": replicator.section_replicator,
}  # fmt: skip


def run_reproduce(
    out: Path,
    *,
    scale: Scale = QUICK,
    net: str | None = None,
    sections: tuple[str, ...] = SECTIONS,
    corpus: Path | None = None,
    console: Console | None = None,
) -> Path:
    """Run the sections, writing ``out/report.md`` after each; returns its path."""
    bad = [x for x in sections if x not in SECTION_RUNNERS]
    if bad or not sections:
        raise ValueError(f"unknown sections {bad or sections}; valid: {', '.join(SECTIONS)}")
    ctx = Ctx(out, scale, net, corpus or GCIDE, console or Console())
    out.mkdir(parents=True, exist_ok=True)
    if "parallax" in sections and not ctx.corpus.is_file():
        raise FileNotFoundError(
            f"the Parallax section needs a text corpus: {ctx.corpus} not found (apt-get install dict-gcide, "
            "or --corpus FILE)"
        )
    report = out / "report.md"
    parts: list[str] = []
    t_all = time.perf_counter()
    for name in sections:
        ctx.console.rule(f"[bold]reproduce: {name}[/]")
        t0 = time.perf_counter()
        try:
            text = SECTION_RUNNERS[name](ctx)
        except Exception as e:
            text = f"## {name}\n\n**This section failed**: {type(e).__name__}: {e}\n"
            ctx.console.print(f"[red]{name} failed:[/] {e}")
        parts.append(text + f"\n_Section took {time.perf_counter() - t0:.0f} s._\n")
        report.write_text(_header(ctx, time.perf_counter() - t_all) + "\n".join(parts))
    ctx.console.print(f"wrote {report} ({time.perf_counter() - t_all:.0f} s)")
    return report


def _header(ctx: Ctx, seconds: float) -> str:
    return (
        f"# sparsync reproduce ({ctx.scale.name})\n\n"
        f"Each paper's headline experiment at laptop scale, {ctx.where}, on this machine ({os.cpu_count()} "
        f"cores). Every table has torch's own path (gloo's sparse COO allreduce or DDP with sparse gradients) "
        f"and a dense allreduce as baselines. Time so far: {seconds:.0f} s.\n\n"
        f"Command: `sparsync reproduce{' --quick' if ctx.scale.name == 'quick' else ''}"
        f"{f' --net {ctx.net}' if ctx.net else ''} --out {ctx.out}`\n\n"
    )


__all__ = [
    "FULL", "QUICK", "ROOT", "SECTIONS", "Ctx", "Scale", "dlrm_markdown", "lifespan_rows", "lm_alpha",
    "parallax_dlrm_markdown", "parallax_markdown", "replicator_curves", "replicator_markdown", "run_reproduce",
    "s2_markdown", "sketch_bias", "sparcml_markdown", "table3_bytes",
]  # fmt: skip
