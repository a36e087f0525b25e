"""``LazyLookup``: what a sharded table's forward returns, a stand-in for its output until the grouped exchange
that computes it has run.

Why: all sharded tables of a model travel in one exchange (``exchange``), but a model calls its tables one by
one (``[emb(x[:, i]) for i, emb in enumerate(self.tables)]``), so the first table cannot know the others' ids
when it is called. Each call therefore only registers its ids and returns a ``LazyLookup``; the first time any
of them is *used* (by any torch function, operator or tensor attribute: ``torch.cat(outs)``, ``out @ w``,
``out.shape``), the exchanger runs one exchange for every lookup registered so far and each stand-in becomes its
tensor. torchrec's ``LazyAwaitable`` does the same for the same reason (its pooled embeddings are awaited by
``__torch_function__``). ``sparsync.shard`` also resolves every lookup when the model's forward returns, so
``model(x)`` hands back plain tensors, and a stand-in never outlives the forward that made it.

What a stand-in is not: a ``torch.Tensor`` (``isinstance`` says False). Code inside the model that needs one
calls ``wait()``, which also ends the batching at that point (later lookups go in a second exchange).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

# why torch.compile leaves a sharded lookup out of its graph: ``fullgraph=True`` raises with this reason
EAGER = (
    "sparsync.shard: a sharded lookup runs its exchange (all-to-alls between the ranks) eagerly, outside the "
    "compiled graph"
)


class LazyLookup:
    """The output of one sharded lookup, computed at the first use (module doc)."""

    def __init__(self, flush: Callable[[], None], what: str) -> None:
        self._flush = flush  # runs the exchange of every pending lookup, this one included
        self._what = what  # the table and module, for errors
        self._value: torch.Tensor | None = None
        self._error: BaseException | None = None

    @torch.compiler.disable(reason=EAGER)  # type: ignore[no-untyped-call, untyped-decorator]
    def wait(self) -> torch.Tensor:
        """The looked-up tensor, running the pending exchange first if it has not run. Collective the first
        time (the exchange): every rank resolves its lookups at the same point of the same model."""
        if self._value is None and self._error is None:
            self._flush()
        if self._error is not None:
            raise ValueError(f"the lookup of {self._what} failed: {self._error}") from self._error
        if self._value is None:
            raise RuntimeError(f"the exchange ran without resolving the lookup of {self._what}")
        return self._value

    def resolve(self, value: torch.Tensor) -> None:
        self._value = value

    def fail(self, error: BaseException) -> None:
        self._error = error

    @property
    def done(self) -> bool:
        return self._value is not None or self._error is not None

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        args, kwargs = pytree.tree_map_only(LazyLookup, LazyLookup.wait, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # our own slots before __init__ set them (copy, pickle): never the tensor's
            raise AttributeError(name)
        return getattr(self.wait(), name)

    def __repr__(self) -> str:
        state = "resolved" if self._value is not None else "failed" if self._error is not None else "pending"
        return f"LazyLookup({self._what}, {state})"

    def __len__(self) -> int:
        return len(self.wait())

    def __iter__(self) -> Any:
        return iter(self.wait())

    def __bool__(self) -> bool:
        return bool(self.wait())

    def __float__(self) -> float:
        return float(self.wait())


def resolve_all(tree: Any) -> Any:
    """``tree`` (a model's output: a tensor, or tuples, lists and dicts of them) with every ``LazyLookup``
    replaced by its tensor."""
    return pytree.tree_map_only(LazyLookup, LazyLookup.wait, tree)


def _binary(name: str) -> Callable[[LazyLookup, Any], Any]:
    def op(self: LazyLookup, other: Any) -> Any:
        return getattr(self.wait(), name)(other.wait() if isinstance(other, LazyLookup) else other)

    op.__name__ = name
    return op


def _unary(name: str) -> Callable[[LazyLookup], Any]:
    def op(self: LazyLookup) -> Any:
        return getattr(self.wait(), name)()

    op.__name__ = name
    return op


# Python looks operators up on the type, never through __getattr__: each is forwarded to the tensor.
for _name in (
    "add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "rfloordiv", "mod", "rmod",
    "pow", "rpow", "matmul", "rmatmul", "and", "rand", "or", "ror", "xor", "rxor", "eq", "ne", "lt", "le", "gt",
    "ge", "getitem",
):  # fmt: skip
    setattr(LazyLookup, f"__{_name}__", _binary(f"__{_name}__"))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(LazyLookup, f"__{_name}__", _unary(f"__{_name}__"))
