"""``Registry``: the one shape of sparsync's registries (compressors, allreduce algorithms, placement kinds):
entries by their ``name``, ``register``, ``unregister``, ``with registered(entry):`` for a scope such as a test,
and a look-up whose ``KeyError`` lists the valid names. Each registry checks an entry before adding it and says
what its entries are called. A leaf: it imports nothing of sparsync, so every layer may build on it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import ClassVar, Generic, Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    """Entries of type ``T`` by their ``name``, in registration order. A subclass sets ``noun`` and overrides
    ``check`` (raise when an entry may not be added), and where it needs to, ``_changed`` (after every
    ``register`` and ``unregister``), ``names`` (the order of iteration) or ``_listed`` (the valid names as a
    ``KeyError`` lists them)."""

    noun: ClassVar[str] = "entry"  # what an entry is called: "unknown <noun> 'x'; valid: ..."

    def __init__(self, entries: Iterable[T] = ()) -> None:
        self._by_name: dict[str, T] = {}
        for e in entries:
            self.register(e)

    def check(self, entry: T) -> None:
        """Raise when ``entry`` may not be added (its name empty or taken, ...)."""
        if not entry.name or entry.name in self._by_name:
            raise ValueError(f"{self.noun} name {entry.name!r} is empty or taken; taken: {', '.join(self.names)}")

    def register(self, entry: T) -> T:
        """Add ``entry`` under its name, after ``check``."""
        self.check(entry)
        self._by_name[entry.name] = entry
        self._changed()
        return entry

    def unregister(self, name: str) -> T:
        """Remove and return the entry ``name``; ``KeyError`` listing the valid names."""
        entry = self.entry(name)
        del self._by_name[name]
        self._changed()
        return entry

    @contextmanager
    def registered(self, entry: T) -> Iterator[T]:
        """``entry`` registered for the ``with`` block only."""
        self.register(entry)
        try:
            yield entry
        finally:
            self.unregister(entry.name)

    def entry(self, name: str) -> T:
        """The entry ``name``; ``KeyError`` listing the valid names."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"unknown {self.noun} {name!r}; valid: {', '.join(self._listed())}") from None

    def _changed(self) -> None:
        """After every ``register`` and ``unregister``: a subclass's derived indexes."""

    def _listed(self) -> Iterable[str]:
        return self.names

    @property
    def names(self) -> tuple[str, ...]:
        """Every entry's name, in registration order."""
        return tuple(self._by_name)

    def __iter__(self) -> Iterator[T]:
        return iter([self._by_name[n] for n in self.names])

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name
