"""The S2 sketch as a method of ``sparsync bench embedding`` (the sketch on its workload).

``sketch`` in the benchmark's methods runs one method ``sketch@λ`` per λ of ``--sketch-lambda`` (a sweep of S2's
λ = m/(α·d), as its sensitivity study, App. B.3 of the extended version, does):
``sparsync.compressed_allreduce(grad, SparseSketch(rows=3, ratio=λ·α), average=False)`` on the COO gradient, i.e.
compress (bitmap of the touched rows + 3 x c count sketch), one dense gloo allreduce of both, and the median
query of the rows set in the summed bitmap, back to a COO tensor.

α, the gradient's row density, must give the same ratio (the same c) on every rank before the one allreduce.
It is the workload's *expected* density of one rank's gradient, E[k]/rows with E[k] = Σ_i 1 - (1 - p_i)^T for
T tokens drawn from the point's Zipf law p_i, computed from (rows, s, T) alone: no exchange, the same on every
rank, and S2's α (the density of a worker's gradient; S2 Table 1); the sketch table lists it next to the
measured k/rows. So the sketch has r·c = λ·E[k]·dim cells: λ times the values one rank sends. The summed
gradient holds U rows, k ≤ U ≤ P·k, so its own λ is λ·k/U (also listed). Sizing by U instead would be
``expected_density(rows, s, P·T)`` (the P ranks' tokens are P·T draws of one law), equally exchange-free.

Per sketch method, besides the time of the whole ``reduce`` and its bytes (its CommRecord: the ring
allreduces of the packed bitmap and the table, 2(P-1)/P·(rows/8 + r·c·4) bytes): the relative error of the
aggregate against the exact sum, ‖est - exact‖₂ / ‖exact‖₂ over the union's rows; the Jaccard index of the
rows the summed bitmap set and the union of the ranks' rows (1 when the bitmap is exact, as it must be); and
the compress and decompress time per call (slowest rank, every rank at once, median over the point's repeats).
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import sparsync
from sparsync.compress import SketchPayload, SparseSketch, TensorSpec
from sparsync.record import CommLog
from sparsync_bench.allreduce import _timed

SKETCH = "sketch"  # the method name in --methods; it runs as one method per λ
SKETCH_ROWS = 3  # r: hash rows of the count sketch (S2's and SparseSketch's default)


def method_name(lam: float) -> str:
    """``sketch@λ``, e.g. ``sketch@0.5``, ``sketch@4``."""
    return f"{SKETCH}@{lam:g}"


def is_sketch(method: str) -> bool:
    return method.startswith(SKETCH + "@")


def lambda_of(method: str) -> float:
    return float(method.partition("@")[2])


def expand(methods: tuple[str, ...], lambdas: tuple[float, ...]) -> tuple[str, ...]:
    """``methods`` with ``sketch`` replaced by one ``sketch@λ`` per λ (in place, in the order given)."""
    out: list[str] = []
    for m in methods:
        out += [method_name(lam) for lam in lambdas] if m == SKETCH else [m]
    return tuple(dict.fromkeys(out))


@functools.lru_cache(maxsize=16)
def expected_density(rows: int, s: float, tokens: int) -> float:
    """E[rows touched] / rows for ``tokens`` ids drawn from p(i) ∝ 1/(i+1)^s over ``rows`` ids: the same for
    hot rows at low ids and permuted (a permutation keeps the probabilities)."""
    p = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** s
    p /= p.sum()
    return float(-np.expm1(tokens * np.log1p(-p)).sum() / rows)


def make_sketch(method: str, alpha: float, seed: int) -> SparseSketch:
    """The compressor of ``sketch@λ`` at a point of expected density ``alpha``: ratio = λ·α."""
    return SparseSketch(rows=SKETCH_ROWS, ratio=lambda_of(method) * alpha, seed=seed)


def reduce_sum(
    grad: torch.Tensor, sk: SparseSketch, group: dist.ProcessGroup, log: CommLog | None
) -> torch.Tensor:
    """The sum over ``group`` of ``grad`` through the sketch (what the method times)."""
    out: torch.Tensor = sparsync.compressed_allreduce(grad, sk, group=group, log=log, average=False)
    return out


@dataclass(frozen=True)
class SketchStats:
    """What a sketch method's row reports besides time and bytes (``embedding.Row``'s ``sketch_*`` fields)."""

    lam: float  # S2's λ
    alpha: float  # the expected row density the ratio was set from
    cells: int  # r·c: table entries (the bitmap has one bit per row)
    rel_error: float  # ‖est - exact‖₂ / ‖exact‖₂ over the union's rows
    bitmap_match: float  # |rows set ∩ union| / |rows set ∪ union|: 1 when the bitmap is exact
    compress_s: float  # median per call, slowest rank
    decompress_s: float  # median per call of the summed payload's query, slowest rank

    def row_fields(self) -> dict[str, Any]:
        out = {f"sketch_{k}": v for k, v in asdict(self).items() if k != "lam"}
        out["sketch_lambda"] = self.lam
        if self.bitmap_match != 1.0:
            out["note"] = "the summed bitmap's rows differ from the union of the ranks' rows"
        return out


def measure(
    sketches: dict[str, SparseSketch],
    alpha: float,
    grad: torch.Tensor,
    exact: torch.Tensor,
    groups: dict[str, dist.ProcessGroup],
    repeats: int,
) -> dict[str, SketchStats]:
    """Per sketch method: one untimed ``reduce`` (its warm-up) checked against the ``exact`` sum, then the
    compress and decompress times; collective (every rank, the same methods in the same order)."""
    out: dict[str, SketchStats] = {}
    for m, sk in sketches.items():
        err, match = accuracy(reduce_sum(grad, sk, groups[m], None), exact)
        c, d = codec_times(sk, grad, groups[m], repeats)
        cells = sk.rows * sk.table_cols(grad.shape)
        out[m] = SketchStats(lambda_of(m), alpha, cells, err, match, c, d)
    return out


def accuracy(est: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(relative error, bitmap match) of a sketch's aggregate ``est`` against the exact sum, both COO."""
    est, exact = est.coalesce(), exact.coalesce()
    got, want = est.indices()[0].numpy(), exact.indices()[0].numpy()
    union = np.union1d(got, want).size
    match = np.intersect1d(got, want).size / union if union else 1.0
    norm = float(exact.values().norm())
    diff = float((est - exact).coalesce().values().norm())
    return (diff / norm if norm > 0 else diff), match


def codec_times(
    sk: SparseSketch, grad: torch.Tensor, group: dist.ProcessGroup, repeats: int
) -> tuple[float, float]:
    """Median compress and decompress seconds per call (slowest rank; every rank at once, as in training),
    decompress on the payload summed over ``group``; collective."""
    spec = TensorSpec.of(grad)
    local = sk.compress(grad)
    buf = local.to_buffer()
    dist.all_reduce(buf, group=group)
    total: SketchPayload = local.from_buffer(buf)
    sk.decompress(total, spec)  # warm-up
    comp, dec = [], []
    for _ in range(repeats):
        comp.append(_timed(lambda: sk.compress(grad)))
        dec.append(_timed(lambda: sk.decompress(total, spec)))
    return statistics.median(comp), statistics.median(dec)
