"""Criteo's click-log text format (Kaggle Display Advertising Challenge and Terabyte), read and generated
: one sample per line, tab-separated: the label (0/1), 13 integer features, 26 categorical
features as 8-digit hex hashes; any feature may be empty.

The data sets cannot be downloaded here, so ``write_criteo`` writes files in that format whose categorical
columns have Criteo Kaggle's per-feature cardinalities (``KAGGLE_CARDINALITIES``, the table sizes DLRM's
reference script reports for Kaggle) and power-law (Zipf) category frequencies, and whose labels depend on a
few features, so that a model can learn. ``read_criteo`` reads a real file the same way: the integer features
as DLRM preprocesses them (log(1 + x), negatives and empties as 0), each category hashed to a row of its table
(``hex % rows``, with ``max_rows`` capping every table as DLRM's ``--max-ind-range`` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DENSE_FEATURES, SPARSE_FEATURES = 13, 26
# Rows per categorical feature in Criteo Kaggle (C1..C26), as DLRM's reference script counts them.
KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10,
    5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
_MIX = 0x9E3779B1  # odd: multiplying by it mod 2^32 is a bijection (rank -> category hash)


@dataclass(frozen=True)
class CriteoBatch:
    dense: torch.Tensor  # (n, 13) float32, log(1 + x)
    sparse: torch.Tensor  # (n, 26) int64, row of each feature's table
    label: torch.Tensor  # (n,) float32, 0 or 1


def table_rows(max_rows: int | None, cardinalities: Sequence[int] = KAGGLE_CARDINALITIES) -> list[int]:
    """Rows of each embedding table: the cardinality, capped at ``max_rows``."""
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return [min(c, max_rows) if max_rows else c for c in cardinalities]


def _zipf_ranks(rng: np.random.Generator, n: int, size: int, s: float) -> np.ndarray:
    """``size`` draws of ranks in [1, n] with P(r) ∝ r^-s (inverse CDF of the continuous bounded power law,
    floored; s = 1: log-uniform)."""
    u = rng.random(size)
    if abs(s - 1.0) < 1e-9:
        r = np.exp(u * math.log(n + 1))
    else:
        a = 1.0 - s
        r = ((n + 1) ** a - 1.0) * u + 1.0
        r = r ** (1.0 / a)
    return np.clip(np.floor(r), 1, n).astype(np.int64)


def write_criteo(
    path: str | Path,
    samples: int,
    *,
    seed: int = 0,
    zipf: float = 1.05,
    cardinalities: Sequence[int] = KAGGLE_CARDINALITIES,
    missing: float = 0.05,
) -> Path:
    """Write ``samples`` lines of Criteo-format data to ``path``; returns the path. Category ranks follow
    Zipf(``zipf``) over each feature's cardinality, hashed to 8 hex digits; ``missing`` of the fields are
    empty. The label is drawn from a logistic model of the first dense feature and the parity of three
    categorical features' ranks."""
    if samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples}")
    if len(cardinalities) != SPARSE_FEATURES or min(cardinalities) < 1:
        raise ValueError(f"need {SPARSE_FEATURES} cardinalities >= 1, got {list(cardinalities)}")
    rng = np.random.default_rng(seed)
    path = Path(path)
    with path.open("w") as f:
        for start in range(0, samples, 65536):
            n = min(65536, samples - start)
            ints = np.floor(np.exp(rng.normal(1.0, 1.5, (n, DENSE_FEATURES)))).astype(np.int64)
            ranks = np.stack([_zipf_ranks(rng, c, n, zipf) for c in cardinalities], 1)
            logit = 1.5 * (np.log1p(ints[:, 0]) - 1.2) + 0.9 * ((ranks[:, [0, 2, 5]] % 2).sum(1) - 1.5) - 0.8
            label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
            hashes = (ranks * _MIX) % (1 << 32)
            gone_i = rng.random((n, DENSE_FEATURES)) < missing
            gone_c = rng.random((n, SPARSE_FEATURES)) < missing
            for i in range(n):
                dense = ["" if gone_i[i, j] else str(ints[i, j]) for j in range(DENSE_FEATURES)]
                cats = ["" if gone_c[i, j] else f"{hashes[i, j]:08x}" for j in range(SPARSE_FEATURES)]
                f.write("\t".join([str(label[i]), *dense, *cats]) + "\n")
    return path


def read_criteo(
    path: str | Path,
    *,
    max_rows: int | None = None,
    cardinalities: Sequence[int] = KAGGLE_CARDINALITIES,
    limit: int | None = None,
) -> CriteoBatch:
    """Every sample of a Criteo-format file (at most ``limit``), each category a row of its table: a hex hash
    modulo the table's rows (``table_rows(max_rows, cardinalities)``); an empty category is row 0. A line
    with the wrong number of fields or a field that is not a number raises ValueError naming the line."""
    rows = np.array(table_rows(max_rows, cardinalities), dtype=np.int64)
    labels: list[int] = []
    dense: list[list[float]] = []
    sparse: list[list[int]] = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(labels) >= limit:
                break
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 1 + DENSE_FEATURES + SPARSE_FEATURES:
                raise ValueError(
                    f"{path}:{lineno}: {len(fields)} fields, want {1 + DENSE_FEATURES + SPARSE_FEATURES} "
                    "(label, 13 integers, 26 categories)"
                )
            try:
                labels.append(int(fields[0]))
                dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1 : 1 + DENSE_FEATURES]])
                sparse.append([int(x, 16) if x else 0 for x in fields[1 + DENSE_FEATURES :]])
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    lab = np.array(labels, dtype=np.int64)
    bad = np.flatnonzero((lab != 0) & (lab != 1))
    if bad.size:
        raise ValueError(f"{path}: label {lab[bad[0]]} on sample {bad[0] + 1}, want 0 or 1")
    cats = np.array(sparse, dtype=np.int64).reshape(-1, SPARSE_FEATURES) % rows
    return CriteoBatch(
        torch.tensor(dense, dtype=torch.float32).reshape(-1, DENSE_FEATURES),
        torch.from_numpy(cats),
        torch.from_numpy(lab.astype(np.float32)),
    )
