"""Replace functions of ``torch.distributed`` by wrappers for the duration of a ``with`` block (the NCCL-rules
checker, ``_nccl_rules.py``, and the byte counter of ``_commlog_workers.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch.distributed as dist


class DistPatch:
    """A subclass gives ``_wrap(name, fn)``; ``_patch(names)`` installs the wrappers of the names torch has, and
    leaving the ``with`` block restores the originals."""

    def __init__(self) -> None:
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        raise NotImplementedError

    def _patch(self, names: Iterable[str]) -> None:
        for name in names:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
