"""The future a DDP comm hook returns (``hooks.py``, ``bucket_allreduce.py``, ``bucket_sparse.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from sparsync.handle import Work

T = TypeVar("T")


def bucket_future(buffer: torch.Tensor) -> torch.futures.Future[Any]:
    """An empty future for a result on ``buffer``'s device: one holding CUDA tensors must name their device
    (torch refuses such a result otherwise)."""
    devices: list[int | str | torch.device] | None = None if buffer.device.type == "cpu" else [buffer.device]
    return torch.futures.Future(devices=devices)


def complete_when_done(work: Work[Any], fut: torch.futures.Future[T], result: Callable[[], T]) -> None:
    """Set ``fut`` to ``result()`` once ``work`` finished, or to the error either raised. Done, not succeeded:
    a failed reduction must reach DDP as the future's error (DDP re-raises it in backward()), or backward()
    would wait on it forever."""

    def assemble() -> None:
        try:
            fut.set_result(result())
        except BaseException as e:
            fut.set_exception(e)  # type: ignore[arg-type]  # the stub asks for a T

    work.when_done(assemble)
