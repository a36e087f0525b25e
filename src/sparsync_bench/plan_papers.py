"""The planner against the scaling figures of the papers sparsync implements:
``python -m sparsync_bench.plan_papers [--out PATH]``.

- SparCML (Renggli, Alistarh, Hoefler), Table 2: the dense MPI allreduce baseline's communication time per
  epoch (the bracketed figure) of MPI-OPT's SGD on URL and Webspam (Table 1's sizes) at 8, 32 and 128 nodes of
  Piz Daint, Greina InfiniBand and Greina Gigabit Ethernet (§6's measured ping-pong rates: 50, 40, 1 Gbit/s).
  An epoch is samples / (1000·P) iterations (§6: batches of 1,000·P); each iteration one allreduce of the model
  (``dim`` values). The planner prices that allreduce (a ring: the bytes of the reduce-scatter and allgather
  MPI runs for large messages) with 8-byte values; the sparse rows of the table are not priced (the paper gives
  no per-node non-zero count).
- Parallax (Kim et al.), Table 4 and Figure 9: LM's throughput at 48 GPUs (8 machines of 6, 100 Gbit/s
  InfiniBand) with AllReduce for every variable (``AR``: the sparse ones by AllGatherv) and with the hybrid
  (``HYB``: AllReduce for dense, the optimized parameter server, local aggregation, for sparse). The exposed
  communication per step is the 48-GPU step less the 1-GPU step: 48·W / throughput − W / T₁, with T₁ = HYB's
  throughput / its normalized throughput 9.4 (Figure 9) and W words per GPU per step, batch 128 (§6.1) times an
  unroll of 20 (assumed: the One Billion Word LM's). The planner prices LM's step (``parallax_lm``) on that
  cluster with the placements pinned to each architecture.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sparsync.plan import Cluster, ParamStats, make_plan, zipf_row_fraction
from sparsync.plan.backend import dense_allreduce
from sparsync_bench.report import write_json_md

SAMPLES = {"URL": 2_396_130, "Webspam": 350_000}  # SparCML Table 1
DIM = {"URL": 3_231_961, "Webspam": 16_609_143}
SYSTEMS = {  # bytes/s (§6's ping-pong rates), seconds per message (assumed: 5 µs on Aries and IB, 50 µs on GigE)
    "Piz Daint": (50e9 / 8, 5e-6),
    "Greina (IB)": (40e9 / 8, 5e-6),
    "Greina (GigE)": (1e9 / 8, 50e-6),
}
VALUE_BYTES = 8  # MPI-OPT's model values, assumed doubles (module doc)


@dataclass(frozen=True)
class DenseRow:
    """One dense baseline of SparCML's Table 2: communication seconds per epoch."""

    system: str
    dataset: str
    model: str
    nodes: int
    epoch_comm: float

    @property
    def iterations(self) -> float:
        return SAMPLES[self.dataset] / (1000 * self.nodes)

    @property
    def published(self) -> float:
        """Seconds per iteration."""
        return self.epoch_comm / self.iterations

    def predicted(self) -> tuple[str, float]:
        bandwidth, latency = SYSTEMS[self.system]
        return dense_allreduce(float(DIM[self.dataset] * VALUE_BYTES), Cluster(self.nodes, 1, bandwidth, latency),
                               VALUE_BYTES)  # fmt: skip


SPARCML_TABLE2 = (
    DenseRow("Piz Daint", "Webspam", "LR", 32, 2.16),
    DenseRow("Piz Daint", "Webspam", "LR", 128, 0.58),
    DenseRow("Piz Daint", "Webspam", "SVM", 32, 1.42),
    DenseRow("Piz Daint", "URL", "LR", 32, 2.58),
    DenseRow("Piz Daint", "URL", "LR", 128, 0.56),
    DenseRow("Piz Daint", "URL", "SVM", 32, 1.93),
    DenseRow("Piz Daint", "Webspam", "LR", 8, 3.79),
    DenseRow("Piz Daint", "URL", "LR", 8, 3.53),
    DenseRow("Greina (IB)", "Webspam", "LR", 8, 4.67),
    DenseRow("Greina (IB)", "URL", "LR", 8, 4.47),
    DenseRow("Greina (GigE)", "Webspam", "LR", 8, 75.95),
    DenseRow("Greina (GigE)", "URL", "LR", 8, 100.46),
)


# --- Parallax's LM -----------------------------------------------------------------------------------------------
LM_VOCAB = 793_471  # One Billion Word's vocabulary (Parallax §6.1: 800K; §2.2: a 406M-element embedding at 512)
LM_DIM, LM_HIDDEN = 512, 2048  # §6.1: one LSTM layer of 2048, projected to 512
LM_WORDS = 128 * 20  # words per GPU per step: batch 128 (§6.1) x an unroll of 20 (assumed)
LM_SAMPLED = 8192  # sampled softmax's candidates per step (assumed: the One Billion Word LM's)
PARALLAX_NODES, PARALLAX_GPUS = 8, 6
PARALLAX_LINK = (100e9 / 8, 5e-6)  # 100 Gbit/s InfiniBand a machine (§6.1); 5 µs a message (assumed)
PARALLAX_INTRA = (16e9, 5e-6)  # the GPUs of a machine over PCIe 3.0 x16 (assumed)
# Table 4 (words/s at 48 GPUs) and Figure 9 (HYB's normalized throughput at 48 GPUs, i.e. Parallax's)
PARALLAX_TABLE4 = {"AR": 45.5e3, "HYB": 274e3}
PARALLAX_FIG9_HYB = 9.4


def parallax_lm() -> list[ParamStats]:
    """Parallax's LM as the planner sees it: the embedding and the sampled softmax's weights (each vocabulary x
    512, sparse: the step's distinct Zipf words, the softmax also its ``LM_SAMPLED`` candidates), the LSTM and
    its projection dense."""
    a = zipf_row_fraction(LM_VOCAB, LM_WORDS)
    am = zipf_row_fraction(LM_VOCAB, LM_WORDS * PARALLAX_GPUS)
    extra = LM_SAMPLED / LM_VOCAB
    return [
        ParamStats("emb.weight", (LM_VOCAB, LM_DIM), a, True, am),
        ParamStats("softmax.weight", (LM_VOCAB, LM_DIM), min(1.0, a + extra), True, min(1.0, am + extra)),
        ParamStats("lstm.weight_ih", (4 * LM_HIDDEN, LM_DIM), 1.0, False),
        ParamStats("lstm.weight_hh", (4 * LM_HIDDEN, LM_DIM), 1.0, False),
        ParamStats("lstm.bias", (4 * LM_HIDDEN,), 1.0, False),
        ParamStats("lstm.proj", (LM_DIM, LM_HIDDEN), 1.0, False),
        ParamStats("softmax.bias", (LM_VOCAB,), 1.0, False),
    ]


def parallax_rows() -> list[dict[str, Any]]:
    """Per architecture of Table 4: the exposed communication per step the figures imply (module doc) and the
    planner's step with the sparse variables pinned to it."""
    cluster = Cluster(PARALLAX_NODES, PARALLAX_GPUS, *PARALLAX_LINK, intra_bandwidth=PARALLAX_INTRA[0],
                      intra_latency=PARALLAX_INTRA[1], backend="nccl")  # fmt: skip
    stats = parallax_lm()
    gpus = PARALLAX_NODES * PARALLAX_GPUS
    one_gpu = LM_WORDS / (PARALLAX_TABLE4["HYB"] / PARALLAX_FIG9_HYB)
    out = []
    for arch, kind in (("AR", "sparse_allreduce"), ("HYB", "ps")):
        plan = make_plan(stats, cluster, overrides={s.name: kind for s in stats if s.sparse})
        published = gpus * LM_WORDS / PARALLAX_TABLE4[arch] - one_gpu
        out.append({"architecture": arch, "published": published, "predicted": plan.step_seconds,
                    "ratio": plan.step_seconds / published,
                    "parts": {p.label: p.seconds for p in plan.step.parts}})  # fmt: skip
    return out


def compare() -> dict[str, Any]:
    rows = []
    for r in SPARCML_TABLE2:
        alg, t = r.predicted()
        rows.append({**asdict(r), "iterations": r.iterations, "published": r.published, "predicted": t,
                     "algorithm": alg, "ratio": t / r.published})  # fmt: skip
    return {"sparcml_table2": rows, "parallax_lm": parallax_rows()}


def table(res: dict[str, Any]) -> str:
    lines = ["SparCML Table 2, dense MPI allreduce (communication per iteration):", "",
             "| system | dataset, model | nodes | published ms | predicted ms | predicted / published |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in res["sparcml_table2"]:
        lines.append(f"| {r['system']} | {r['dataset']} {r['model']} | {r['nodes']} | "
                     f"{r['published'] * 1e3:.1f} | {r['predicted'] * 1e3:.1f} | {r['ratio']:.2f} |")  # fmt: skip
    lines += ["", "Parallax Table 4 and Figure 9, LM at 48 GPUs (exposed communication per step):", "",
              "| architecture | published ms | predicted ms | predicted / published |",
              "|---|---:|---:|---:|"]  # fmt: skip
    for r in res["parallax_lm"]:
        lines.append(f"| {r['architecture']} | {r['published'] * 1e3:.0f} | {r['predicted'] * 1e3:.1f} | "
                     f"{r['ratio']:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsync_bench.plan_papers", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    a = ap.parse_args(argv)
    res = compare()
    text = table(res)
    print(text)
    if a.out is not None:
        write_json_md(a.out, res, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
