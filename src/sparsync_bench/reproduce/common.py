"""What every section of ``sparsync reproduce`` shares: the scales (``Scale``: ``QUICK`` for ``--quick``, ``FULL``
otherwise), a section's context (``Ctx``: where it writes, at what scale, on which links), where the checkout is
(``ROOT``: examples/ lives there), and the report's tables and pictures."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from sparsync_bench.fmt import markdown_table

ROOT = Path(__file__).resolve().parents[3]  # the checkout (src layout); examples/ lives there
SKETCH_LAMBDA = 2.0  # S2's λ of the sketch placements in the DLRM and LM runs (ratio = λ·α)


@dataclass(frozen=True)
class Scale:
    """Sizes of every section. QUICK finishes in minutes on 2 cores; FULL is closer to the papers."""

    name: str
    ar_procs: int = 4
    ar_n: int = 2**20
    ar_densities: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 0.1, 1.0)
    ar_repeats: int = 3
    emb_procs: int = 4
    emb_rows: int = 2**18
    emb_tokens: int = 8192
    emb_lambdas: tuple[float, ...] = (1.0, 4.0)
    emb_repeats: int = 3
    bias_seeds: int = 200
    dlrm_procs: int = 4
    dlrm_steps: int = 30
    dlrm_mlp: str = "kaggle"
    dlrm_batch: int = 128
    dlrm_rows: int = 100_000
    # DCT's wall clock on a communication-bound DLRM (dlrm_s_pytorch.py's MLPerf MLPs, dim 128), per world size
    dct_wall_procs: tuple[int, ...] = (4,)
    dct_wall_mlp: str = "mlperf"
    dct_wall_dim: int = 128
    lifespan_n: int = 2**20
    lifespan_calls: int = 50
    dctmp: bool = True
    lm_procs: int = 4
    lm_vocab: int = 65_536
    lm_seq: int = 20
    lm_steps: int = 10
    lm_warmup: int = 2
    lm_rounds: int = 2
    lm_dim: int = 128
    lm_hidden: int = 256
    lm_batch: int = 32
    replicas: tuple[int, ...] = (1, 2, 4)
    torchrun_procs: int = 2


QUICK = Scale("quick")
FULL = Scale(
    "full", ar_procs=8, ar_n=16 * 2**20, ar_densities=(1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.3, 1.0), ar_repeats=5,
    emb_procs=8, emb_rows=2**20, emb_tokens=32768, emb_lambdas=(0.5, 1.0, 2.0, 4.0), emb_repeats=5,
    dlrm_procs=8, dlrm_steps=50, dct_wall_procs=(4, 8), lifespan_n=16 * 2**20, lifespan_calls=200, lm_steps=20,
    lm_rounds=3,
)  # fmt: skip


@dataclass
class Ctx:
    out: Path
    scale: Scale
    net: str | None
    corpus: Path
    console: Console
    dlrm_rows: list[dict[str, Any]] = field(default_factory=list)  # the DCT section's, for Parallax's Table 4

    @property
    def where(self) -> str:
        return f"{self.net} links (netns + tc)" if self.net else "loopback (no shaping)"


MS = ",.1f"  # the report's milliseconds (fmt.ms): one decimal, thousands separated


def table(head: list[str], body: list[list[str]]) -> str:
    """A markdown table (``| --- |`` rules) as the report's text, ending in a newline."""
    return "\n".join(markdown_table(head, body, rule=" --- ")) + "\n"


def img(ctx: Ctx, png: Path, alt: str) -> str:
    return f"![{alt}]({png.relative_to(ctx.out)})\n" if png.exists() else ""
