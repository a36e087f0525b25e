"""The benchmarks behind ``sparsync bench NAME``, one module each (its options, its run, its report; the worker
its ranks run is the module of that name one level up, which the ranks import), and their one table,
``BENCHMARKS``, from which the command adds its subcommands (in this order)."""

from __future__ import annotations

from sparsync_bench.bench import allreduce, compress, dlrm, embedding, hybrid, tta
from sparsync_bench.benchmark import Benchmark

BENCHMARKS: tuple[Benchmark, ...] = (
    allreduce.BENCHMARK,
    compress.BENCHMARK,
    hybrid.BENCHMARK,
    embedding.BENCHMARK,
    dlrm.BENCHMARK,
    tta.BENCHMARK,
)


def benchmark(name: str) -> Benchmark:
    """The entry named ``name``; ``KeyError`` listing the valid names."""
    for b in BENCHMARKS:
        if b.name == name:
            return b
    raise KeyError(f"no benchmark {name!r}; valid: {', '.join(b.name for b in BENCHMARKS)}")
