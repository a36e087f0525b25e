"""A stand-in for ``dist.GradBucket`` (torch builds those in C++ only), for calling a DDP comm hook outside DDP:
one flat buffer holding the gradients, the parameters, and each gradient as a view of the buffer."""

from __future__ import annotations

import torch


class GradBucket:
    """What a DDP comm hook reads of a ``dist.GradBucket``: ``buffer()``, ``index()``, ``is_last()``,
    ``parameters()`` and ``gradients()`` (views of the buffer, in ``params``' order)."""

    def __init__(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._params = params
        self._grads, offset = [], 0
        for g in grads:
            self._grads.append(self._buffer[offset : offset + g.numel()].view(g.shape))
            offset += g.numel()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads
