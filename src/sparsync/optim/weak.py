"""Hooks that hold their owner weakly. A hook registered on a tensor lives in C++ (autograd's hook lists), where
Python's garbage collector sees no reference cycle: a hook holding the optimizer that holds the tensor keeps the
optimizer, and the process groups it holds, alive until the interpreter's exit, past the user's ``del`` and
``dist.destroy_process_group()``, and gloo can abort the process when a group is freed that late
(docs/sharding.md, "Ending a torchrun script"). These hooks do nothing once their owner is gone."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def indexed_hook(
    owner: T, method: Callable[[T, int, torch.Tensor], None], i: int
) -> Callable[[torch.Tensor], None]:
    """A hook calling ``method(owner, i, tensor)`` while ``owner`` lives."""
    ref = weakref.ref(owner)

    def hook(tensor: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            method(live, i, tensor)

    return hook


def method_hook(bound: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A hook calling the bound method ``bound`` while its object lives."""
    ref = weakref.WeakMethod(bound)

    def hook(tensor: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live(tensor)

    return hook
