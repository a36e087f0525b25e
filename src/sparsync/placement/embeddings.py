"""Which modules read rows sparsely, and which rows a forward reads: what the planner measures
(``sparsync.plan.detect``) and what the parameter server pulls (``sparsync.ps.placement``), kept here so that
neither of those two packages imports the other.

Parallax tells sparse from dense variables by the type of their gradient (TensorFlow's IndexedSlices); the
PyTorch equivalent is a sparse COO gradient, which ``nn.Embedding(sparse=True)`` and
``nn.EmbeddingBag(sparse=True)`` produce. An ``nn.EmbeddingBag`` without ``sparse=True`` has a dense gradient
but touches only the rows of its input, so it counts as sparse as well (its rows are known from the input).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def embedding_modules(model: nn.Module) -> Iterator[tuple[str, nn.Embedding | nn.EmbeddingBag]]:
    """(parameter name of the weight, module) for every embedding whose rows are read sparsely."""
    for mname, m in model.named_modules():
        if isinstance(m, nn.EmbeddingBag) or (isinstance(m, nn.Embedding) and m.sparse):
            yield (f"{mname}.weight" if mname else "weight"), m


def rows_of_input(m: nn.Module, args: tuple[object, ...]) -> torch.Tensor:
    """Unique rows an embedding's forward reads, from its positional input."""
    x = args[0]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"embedding input must be a tensor, got {type(x).__name__}")
    out: torch.Tensor = torch.unique(x.reshape(-1))
    return out
