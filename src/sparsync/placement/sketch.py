"""The ``sketch`` placement (S2 Reducer §3.1, Alg. 1): each gradient through ``compressed_allreduce`` with a
``SparseSketch``: a bitmap of the non-zero rows and an r x c count sketch, summed by one dense allreduce and
queried by the median.

Call t hashes with seed ``sketch.seed + t``, the same on every rank: S2 Thm. 1's unbiasedness is over the
random choice of hash functions, and one fixed set would repeat the same collision error every step (for a
recurring gradient the errors then add up linearly instead of averaging out).
Lossy; with ``error_feedback`` every worker keeps its residual ``x - decompress(compress(x))`` and adds it to
the next step's gradient (DCT Alg. 1 lines 2 and 11, with the local decode of the worker's own sketch as
"sent"). The query of the summed sketch is not the sum of the local queries (the median is not linear), so
with P > 1 the residual corrects a worker's own collision error but not collisions between workers' entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sparsync.compress.memory import ErrorFeedback
from sparsync.compress.reduce import compressed_allreduce
from sparsync.compress.sketch import SparseSketch
from sparsync.placement.base import NamedParam, Placement, ReduceEnv, load_optional_state


class Sketch(Placement):
    """S2's sketch for every parameter given to it; one fresh set of hashes per ``aggregate`` call (step).
    Mutable (the call counter, the residuals): one object per trainer, shared by its sketch parameters."""

    kind = "sketch"

    def __init__(self, sketch: SparseSketch | None = None, *, error_feedback: bool = False) -> None:
        self.sketch = sketch if sketch is not None else SparseSketch(ratio=0.05)
        self.memory = ErrorFeedback() if error_feedback else None
        self.calls = 0

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        sketch = dataclasses.replace(self.sketch, seed=self.sketch.seed + self.calls)
        self.calls += 1
        for p in params:
            g = p.param.grad
            assert g is not None
            p.param.grad = compressed_allreduce(
                g.detach(), sketch, memory=self.memory, name=p.name, group=env.group, average=False,
                log=env.log, timeout=env.timeout,
            )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The call counter (the hashes' seed) and the error-feedback residuals (per worker: one per rank)."""
        return {"calls": self.calls, "memory": None if self.memory is None else self.memory.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_optional_state(
            self.memory, state.get("memory"), "sketch error-feedback residuals", "sketch_error_feedback"
        )
        self.calls = int(state.get("calls", 0))
