"""Compressed pushes of dense parameters to the servers, with per-worker error feedback (DCT §3.3).

DCT-DP compresses the gradients of the dense layers "while they are sent across the wire to the parameter
server" and feeds the compression error back into the next iteration's gradient (§3.2 Table 2, §3.3, where it
works with asynchronous hogwild workers although the convergence proofs cover synchronous SGD only). Each
worker keeps its own residual per parameter (Remark 2 shares one buffer between the threads of a worker; our
workers are processes, so one buffer each).

The push carries rows (``PSTable``): a row whose compressed gradient is all zero is not sent, the others go
with their zeros, so the wire saves whole rows only; the error-feedback invariant holds on the decompressed
tensor, whatever goes over the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sparsync.compress.aggregate import LOCAL_SUM, encode
from sparsync.compress.base import Compressor, Context
from sparsync.compress.memory import ErrorFeedback
from sparsync.placement.base import load_optional_state


class PushFeedback:
    """``compressor`` applied to every dense push of one worker; ``error_feedback``: keep the residuals."""

    def __init__(
        self, compressor: Compressor, *, error_feedback: bool = True, rank: int = 0, world: int = 1
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"push_compressor must be a sparsync Compressor, got {type(compressor).__name__}")
        self.compressor = compressor
        self.memory = ErrorFeedback() if error_feedback else None
        self.rank, self.world = rank, world

    def rows(self, name: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, values) to push for the [rows, dim] gradient ``grad`` of table ``name``: the decompressed
        ``compress(grad + e)``, zero rows dropped (DCT Alg. 1 lines 2-11 on the worker).

        Mutates: the residual of ``name`` (``e = grad + e_old - sent``) and the compressor's state of ``name``
        (e.g. DCT's threshold); not ``grad``."""
        # compressed_allreduce's local half (compensate -> compress -> memory update); no collective: the push
        # sends the decompressed rows itself
        e = encode(self.compressor, grad.detach(), Context(name, self.rank, self.world), self.memory,
                   aggregator=LOCAL_SUM)  # fmt: skip
        sent = e.local if e.local is not None else self.compressor.decompress(e.payload, e.enc.spec)
        sent = sent.to_dense() if sent.is_sparse else sent
        keep = torch.nonzero(sent.ne(0).any(1), as_tuple=True)[0]
        return keep, sent[keep]

    def state_dict(self) -> dict[str, Any]:
        """Residuals and compressor state (per worker: save one per rank)."""
        return {
            "memory": None if self.memory is None else self.memory.state_dict(),
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_optional_state(
            self.memory, state.get("memory"), "push error-feedback residuals", "push_error_feedback"
        )
        self.compressor.load_state_dict(dict(state.get("compressor", {})))
