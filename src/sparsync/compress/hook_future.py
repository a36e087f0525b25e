"""The future a DDP comm hook returns (``hooks.py``, ``bucket_allreduce.py``), and what the hook's compressing
bucket routes share (``BucketRoute``: ``bucket_sparse.py``, ``bucket_powersgd.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from sparsync.compress.memory import Memory
from sparsync.handle import Work
from sparsync.record import CommLog

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


def bucket_name(names: Sequence[str]) -> str:
    """A bucket's call name, compared across ranks: the bucket's members in the bucket's order."""
    return "bucket[" + ",".join(names) + "]"


@dataclass(eq=False)
class BucketRoute:
    """What a route sending one compressed bucket in one exchange holds (``bucket_sparse.py``,
    ``bucket_powersgd.py``)."""

    group: dist.ProcessGroup  # sparsync's own group (``background_group(user)``), where the reductions run
    memory: Memory | None  # the error-feedback residuals, per parameter name (None: no error feedback)
    average: bool  # divide the sum by the world size
    async_op: bool  # queue the exchange and return at once (False: reduce before returning)
    log: CommLog | None  # receives one CommRecord per bucket
    algorithm: str = "auto"  # ``sparse_allreduce``'s, for a sparse payload
    timeout: float | None = None  # the bucket's metadata round's
    check_nan: bool = True  # the bucket's metadata round refuses NaN and ±Inf
    size: int = field(init=False)  # the group's
    rank: int = field(init=False)  # this rank's in the group

    def __post_init__(self) -> None:
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    @staticmethod
    def future(
        buffer: torch.Tensor, res: Any, assemble: Callable[[Any], torch.Tensor]
    ) -> torch.futures.Future[torch.Tensor]:
        """The future of ``buffer``, set to ``assemble(result)`` when ``res`` (a ``Work``, or a result already
        there) completes."""
        work = res if isinstance(res, Work) else Work.done(res)
        fut: torch.futures.Future[torch.Tensor] = bucket_future(buffer)
        complete_when_done(work, fut, lambda: assemble(work.wait()))
        return fut
