"""DLRM, the reference architecture (Naumov et al. 2019; facebookresearch/dlrm ``dlrm_s_pytorch.py``), the
model DCT and S2 train: a bottom MLP over the 13 dense features, one embedding table per
categorical feature (``nn.EmbeddingBag(sparse=True)``, sum pooling, one index per sample as in Criteo), the
dot interaction (the pairwise dot products of the bottom MLP's output and the 26 embeddings, lower triangle
without the diagonal, concatenated with the bottom output), and a top MLP to one logit.

Data-parallel throughout (every rank holds every table), which is the setting of DCT-DP, S2 and of DDP with
sparse gradients; the reference script's model-parallel tables are another placement.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from sparsync.plan import ParamStats, zipf_row_fraction

# MLP widths (bottom without its last layer, which is the embedding width; top without its input width):
# "small" keeps a step's dense part to a few hundred kB; "kaggle" is dlrm_s_pytorch.py's Criteo Kaggle
# configuration (--arch-mlp-bot 13-512-256-64-16 --arch-mlp-top 512-256-1), 1.9 MB of dense gradients.
# dlrm_s_pytorch.py's configurations (the bottom MLP ends at the embedding width, appended from --dim):
# kaggle (bench/dlrm_s_criteo_kaggle.sh, dim 16), terabyte (bench/dlrm_s_criteo_terabyte.sh, dim 64) and
# mlperf (bench/run_and_time.sh, dim 128)
MLPS = {
    "small": ((13, 64), (64, 1)),
    "kaggle": ((13, 512, 256, 64), (512, 256, 1)),
    "terabyte": ((13, 512, 256), (512, 512, 256, 1)),
    "mlperf": ((13, 512, 256), (1024, 1024, 512, 256, 1)),
}


def mlp(sizes: Sequence[int], *, last_sigmoid: bool = False) -> nn.Sequential:
    """Linear layers between consecutive ``sizes``, ReLU after each but the last."""
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"an MLP needs >= 2 layer sizes >= 1, got {list(sizes)}")
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    if last_sigmoid:
        layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """``DLRM(table_rows, dim, bottom=(13, 64, dim), top=(256, 64, 1))``: ``bottom[-1]`` must equal ``dim``;
    the top MLP's input width is prepended (dim + pairs of the 27 vectors). ``forward(dense, sparse)`` with
    ``dense`` (n, 13) float and ``sparse`` (n, tables) int64 rows returns (n,) logits."""

    def __init__(
        self,
        table_rows: Sequence[int],
        dim: int = 16,
        *,
        bottom: Sequence[int] = (13, 64, 16),
        top: Sequence[int] = (64, 1),
        sparse: bool = True,
    ) -> None:
        super().__init__()
        if bottom[-1] != dim:
            raise ValueError(f"the bottom MLP must end at the embedding width {dim}, got {list(bottom)}")
        self.bottom = mlp(bottom)
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=sparse) for n in table_rows)
        vectors = len(table_rows) + 1
        self.pairs = torch.tril_indices(vectors, vectors, offset=-1)
        self.top = mlp((dim + vectors * (vectors - 1) // 2, *top))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        n = sparse.shape[0]
        offsets = torch.arange(n, dtype=torch.int64)
        embs = [t(sparse[:, j].contiguous(), offsets) for j, t in enumerate(self.tables)]
        z = torch.stack([x, *embs], 1)  # (n, 27, dim)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        out: torch.Tensor = self.top(torch.cat([x, dots], 1))
        return out.squeeze(1)


def dlrm_stats(
    table_rows: Sequence[int],
    dim: int,
    batch: int,
    mlps: str = "kaggle",
    *,
    procs_per_machine: int = 1,
    zipf: float = 1.05,
) -> list[ParamStats]:
    """DLRM's parameters as the planner sees them (``sparsync plan --model dlrm``): per table the expected
    distinct rows of ``batch`` Zipf(``zipf``) lookups (one per sample, as ``criteo.write_criteo`` draws them; a
    machine's ``procs_per_machine`` ranks together for α machine), and the MLPs (``MLPS[mlps]``) dense."""
    tables = [
        ParamStats(f"tables.{j}.weight", (n, dim), zipf_row_fraction(n, batch, zipf), True,
                   zipf_row_fraction(n, batch * procs_per_machine, zipf))
        for j, n in enumerate(table_rows)
    ]  # fmt: skip
    return tables + [ParamStats(name, shape, 1.0, False) for name, shape in mlp_shapes(len(table_rows), dim, mlps)]


def mlp_shapes(tables: int, dim: int, mlps: str = "kaggle") -> list[tuple[str, tuple[int, ...]]]:
    """(parameter name, shape) of ``DLRM``'s two MLPs (``MLPS[mlps]``) over ``tables`` tables of width ``dim``."""
    bottom, top = MLPS[mlps]
    vectors = tables + 1
    widths = [(*bottom, dim), (dim + vectors * (vectors - 1) // 2, *top)]
    out: list[tuple[str, tuple[int, ...]]] = []
    for name, sizes in zip(("bottom", "top"), widths, strict=True):
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            out += [(f"{name}.{2 * i}.weight", (b, a)), (f"{name}.{2 * i}.bias", (b,))]
    return out
