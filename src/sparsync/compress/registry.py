"""Compressors by name, for configs and the CLI: ``make("topk", ratio=0.01)`` or
``from_spec("topk:ratio=0.01,bucket=512")``. An unknown name raises ``KeyError`` listing the valid ones.

A compressor from outside the package is one ``register(cls)`` (or, for a scope such as a test,
``with REGISTRY.registered(cls):``): it names its own aggregation (``Compressor.aggregator``), so
``compressed_allreduce`` needs nothing else."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from sparsync.compress.base import Compressor
from sparsync.compress.blocktopk import BlockTopK
from sparsync.compress.cast import BF16, FP16
from sparsync.compress.identity import Identity
from sparsync.compress.powersgd import PowerSGD
from sparsync.compress.qsgd import QSGD
from sparsync.compress.randomk import RandomK
from sparsync.compress.sketch import SparseSketch
from sparsync.compress.threshold import Threshold
from sparsync.compress.topk import TopK
from sparsync.registry import Registry

C = TypeVar("C", bound=type[Compressor])


class CompressorRegistry(Registry[type[Compressor]]):
    """Compressor classes by their ``name``; ``KeyError`` lists the valid names sorted."""

    noun = "compressor"

    def check(self, cls: type[Compressor]) -> None:
        """TypeError unless ``cls`` is a Compressor subclass; ValueError when it has no name or it is taken."""
        if not (isinstance(cls, type) and issubclass(cls, Compressor)):
            raise TypeError(f"register takes a Compressor subclass, got {cls!r}")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{cls.__name__} has no name: set the class attribute name (a non-empty str)")
        if name in self._by_name:
            raise ValueError(f"compressor name {name!r} is taken by {self._by_name[name].__name__}")

    def register(self, cls: C) -> C:
        """Add ``cls`` under ``cls.name`` (usable as a class decorator). ValueError if the name is taken.
        Returns ``cls`` typed as itself, so a decorated class keeps its own type (the base's is the entry type)."""
        super().register(cls)
        return cls

    def get(self, name: str) -> type[Compressor]:
        return self.entry(name)

    def _listed(self) -> list[str]:
        return sorted(self._by_name)

    def view(self) -> Mapping[str, type[Compressor]]:
        """A read-only live view: name -> class."""
        return MappingProxyType(self._by_name)


REGISTRY = CompressorRegistry(
    (Identity, FP16, BF16, TopK, Threshold, RandomK, QSGD, SparseSketch, BlockTopK, PowerSGD)
)
COMPRESSORS: Mapping[str, type[Compressor]] = REGISTRY.view()
register = REGISTRY.register


def compressor_class(name: str) -> type[Compressor]:
    return REGISTRY.get(name)


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
