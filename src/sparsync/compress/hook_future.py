"""The future a DDP comm hook returns (``hooks.py``, ``bucket_allreduce.py``), and what the hook's compressing
bucket routes share (``BucketRoute``: ``bucket_sparse.py``, ``bucket_powersgd.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


class BucketRoute:
    """What a route sending one compressed bucket in one exchange holds: ``group``, sparsync's own group
    (``background_group(user)``), where the hook's reductions run, and its size and this rank; ``memory``, the
    error-feedback residuals per parameter name (None: no error feedback); ``average``: divide the sum by the
    world size; ``async_op``: queue the exchange and return at once (False: reduce before returning);
    ``log``: one CommRecord per bucket; ``timeout`` and ``check_nan``: those of the bucket's metadata round."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        memory: Memory | None,
        average: bool,
        async_op: bool,
        log: CommLog | None,
        timeout: float | None = None,
        check_nan: bool = True,
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.memory = memory
        self.average = average
        self.async_op = async_op
        self.log = log
        self.timeout = timeout
        self.check_nan = check_nan

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
