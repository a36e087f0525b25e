"""Compressors by name, for configs and the CLI: ``make("topk", ratio=0.01)`` or
``from_spec("topk:ratio=0.01,bucket=512")``. An unknown name raises ``KeyError`` listing the valid ones."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from sparsync.compress.base import Compressor
from sparsync.compress.blocktopk import BlockTopK
from sparsync.compress.cast import BF16, FP16
from sparsync.compress.identity import Identity
from sparsync.compress.qsgd import QSGD
from sparsync.compress.randomk import RandomK
from sparsync.compress.sketch import SparseSketch
from sparsync.compress.threshold import Threshold
from sparsync.compress.topk import TopK

COMPRESSORS: Mapping[str, type[Compressor]] = MappingProxyType(
    {c.name: c for c in (Identity, FP16, BF16, TopK, Threshold, RandomK, QSGD, SparseSketch, BlockTopK)}
)


def compressor_class(name: str) -> type[Compressor]:
    try:
        return COMPRESSORS[name]
    except KeyError:
        raise KeyError(f"unknown compressor {name!r}; valid: {', '.join(sorted(COMPRESSORS))}") from None


def make(name: str, **kwargs: Any) -> Compressor:
    """A compressor by registered name, with its keyword arguments (``TypeError`` names a bad keyword)."""
    cls = compressor_class(name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"bad arguments for compressor {name!r}: {e}") from None


def from_spec(spec: str) -> Compressor:
    """``"name"`` or ``"name:key=value,key=value"`` (values are Python literals), e.g. ``"qsgd:bits=4"``.

    Example::

        >>> from_spec("threshold:ratio=0.01,lifespan=1000")
        Threshold(ratio=0.01, lifespan=1000)
    """
    name, _, rest = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"bad compressor option {item!r} in {spec!r}: expected key=value")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = value.strip()
    return make(name.strip(), **kwargs)
