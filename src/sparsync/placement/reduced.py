"""The placements a trainer reduces by collectives among its workers and then applies with a local optimizer
(issue 5, "a plan assigns each parameter one placement"): ``sparse_allreduce`` (SparCML, Table 3's sparse
allreduce row of Parallax) and ``sketch`` (S2 Reducer §3.1). ``dense_allreduce`` stays the trainer's one flat
dense allreduce and ``ps`` its parameter-server path; this module also resolves which parameter takes which.

- ``sparse_allreduce``: the gradient as it comes (sparse COO for ``nn.Embedding(sparse=True)``) through
  ``sparsync.allreduce`` with ``algorithm="auto"``, so the SparCML algorithm is chosen per call.
- ``sketch``: the gradient through ``sparsync.compress.reduce`` with a ``SparseSketch``: a bitmap of the
  non-zero rows and an r x c count sketch, summed by one dense allreduce and queried by the median (S2 Alg. 1).
  Step t hashes with seed ``sketch.seed + t``, the same on every rank: S2 Thm. 1's unbiasedness is over the
  random choice of hash functions, and one fixed set would repeat the same collision error every step (for a
  recurring gradient the errors then add up linearly instead of averaging out).
  Lossy; with ``error_feedback`` every worker keeps its residual ``x - decompress(compress(x))`` and adds it to
  the next step's gradient (DCT Alg. 1 lines 2 and 11, with the local decode of the worker's own sketch as
  "sent"). The query of the summed sketch is not the sum of the local queries (the median is not linear), so
  with P > 1 the residual corrects a worker's own collision error but not collisions between workers' entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsync.collectives.tensor import allreduce
from sparsync.compress.memory import ErrorFeedback
from sparsync.compress.reduce import compressed_allreduce
from sparsync.compress.sketch import SparseSketch
from sparsync.placement.feedback import load_optional_state
from sparsync.placement.plan import PLACEMENTS, Plan
from sparsync.record import CommLog

REDUCED = ("sparse_allreduce", "sketch")  # the placements ``Reduced`` handles


def resolve_placements(
    params: Sequence[str],
    default: Mapping[str, str],
    placements: Plan | Mapping[str, str] | None,
) -> dict[str, str]:
    """Every parameter's placement: ``default`` (the trainer's own choice) overridden by ``placements`` (a
    ``Plan`` from ``make_plan``, or a dict name -> placement naming any subset of the parameters).

    Raises KeyError naming unknown parameters or unknown placements."""
    given = {e.name: e.placement for e in placements.entries} if isinstance(placements, Plan) else placements
    out = {n: default[n] for n in params}
    if not given:
        return out
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise KeyError(f"placements name unknown parameters {unknown}; the model has {list(params)}")
    bad = {n: pl for n, pl in given.items() if pl not in PLACEMENTS}
    if bad:
        raise KeyError(f"unknown placements {bad}; valid: {', '.join(PLACEMENTS)}")
    out.update(given)
    return out


class Reduced:
    """The ``sparse_allreduce`` and ``sketch`` parameters of one worker.

    ``placements``: name -> one of ``REDUCED``; ``mean``: name -> divide the sum by the world size (Parallax
    sums sparse gradients and averages dense ones: the trainer passes its ``sparse_reduce``/``dense_reduce``).
    ``sparse_grads``: names whose gradients come sparse COO (what a worker that did not use one sends).
    ``sketch``: the compressor of every ``sketch`` parameter (same settings on every rank).
    """

    def __init__(
        self,
        placements: Mapping[str, str],
        mean: Mapping[str, bool],
        *,
        sparse_grads: Collection[str] = (),
        sketch: SparseSketch,
        error_feedback: bool = False,
        group: dist.ProcessGroup | None = None,
        log: CommLog | None = None,
    ) -> None:
        bad = {n: pl for n, pl in placements.items() if pl not in REDUCED}
        if bad:
            raise KeyError(f"Reduced handles {', '.join(REDUCED)}, got {bad}")
        self.placements = dict(placements)
        self.names = list(placements)  # every rank reduces in the same (model) order
        self.mean = {n: mean[n] for n in self.names}
        self.sparse_grads = set(sparse_grads)
        self.sketch = sketch
        self.memory = ErrorFeedback() if error_feedback else None
        self.group, self.log = group, log
        self.world = dist.get_world_size(group)
        self.calls = 0  # sketch hash seed offset: one fresh set of hashes per step

    def reduce(self, params: Mapping[str, nn.Parameter]) -> None:
        """Replace every handled parameter's ``.grad`` by the sum (or mean) over the group of the workers'
        gradients, sent by its placement; a sparse COO gradient stays sparse COO.

        Mutates: ``p.grad`` of the handled parameters, and the error-feedback residuals. Collective: every rank
        calls it once per step."""
        sketch = dataclasses.replace(self.sketch, seed=self.sketch.seed + self.calls)
        self.calls += 1
        for n in self.names:
            p = params[n]
            g = p.grad if p.grad is not None else _zero_grad(p, n in self.sparse_grads)
            if self.placements[n] == "sparse_allreduce":
                out = allreduce(g.coalesce() if g.is_sparse else g, group=self.group, log=self.log)
                assert isinstance(out, torch.Tensor)
                p.grad = out / self.world if self.mean[n] else out
            else:
                p.grad = compressed_allreduce(
                    g.detach(), sketch, memory=self.memory, name=n, group=self.group,
                    average=self.mean[n], log=self.log,
                )  # fmt: skip

    def params(self, named: Mapping[str, nn.Parameter]) -> list[nn.Parameter]:
        return [named[n] for n in self.names]

    def state_dict(self) -> dict[str, Any]:
        """The step counter (the sketch's seed) and the error-feedback residuals (per worker: one per rank)."""
        return {"calls": self.calls, "memory": None if self.memory is None else self.memory.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_optional_state(
            self.memory, state.get("memory"), "sketch error-feedback residuals", "sketch_error_feedback"
        )
        self.calls = int(state.get("calls", 0))


def _zero_grad(p: nn.Parameter, sparse: bool) -> torch.Tensor:
    """What a worker that did not use ``p`` contributes: an empty COO gradient of the layout
    ``nn.Embedding(sparse=True)`` gives (one sparse dim), else dense zeros."""
    if sparse and p.dim() >= 2:
        idx = torch.empty(1, 0, dtype=torch.int64)
        return torch.sparse_coo_tensor(idx, torch.empty(0, *p.shape[1:], dtype=p.dtype), p.shape)
    return torch.zeros_like(p)
