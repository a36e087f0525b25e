"""One benchmark, one record: what ``sparsync bench NAME`` is. Each benchmark's module in ``sparsync_bench.bench``
declares its ``Benchmark`` beside what it names (its options, the command that turns them into a config and runs
the sweep, the worker every rank runs, its report); ``bench.BENCHMARKS`` collects them, and the command
(``cli.build_parser``) adds one subcommand per entry. A new benchmark is one module with one entry, named in
that tuple."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

SHARED = ("net", "hosts", "progress")  # the option groups a benchmark may take (options.shared_options)


@dataclass(frozen=True)
class Benchmark:
    name: str  # the subcommand: sparsync bench NAME
    help: str  # its line in ``sparsync bench --help`` (and its --help's description)
    add_options: Callable[[argparse.ArgumentParser], None]  # its own options, beside the shared ones
    command: Callable[[argparse.Namespace, Console], int]  # the options -> a config -> the sweep -> the report
    worker: Callable[..., Any]  # what every rank runs at each point (module-level: ``launch`` pickles it)
    shared: tuple[str, ...] = ()  # the shared option groups it takes, of SHARED
    grid: Callable[[argparse.ArgumentParser], str] | None = None  # --help's sentence on its default grid

    def __post_init__(self) -> None:
        bad = [s for s in self.shared if s not in SHARED]
        if bad:
            raise ValueError(f"benchmark {self.name!r}: unknown shared options {bad}; valid: {', '.join(SHARED)}")
