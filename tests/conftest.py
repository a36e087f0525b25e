"""Test tiers (README, "The two commands"): a test that starts parameter-server processes is marked
``servers``, so that ``make test-fast`` (no process groups, no servers) can leave it out; a test marked
``cuda`` is skipped where no GPU is (CI), and runs wherever one is (scripts/gpu_check.sh)."""

from __future__ import annotations

import inspect

import pytest

# A rank that a fatal signal killed: one more run of its test, listed in the summary (``make test`` passes
# ``-rfER``). torch's DDP with sparse gradients, a row beside ours in many tests, corrupts the heap about once in
# 3,000-18,000 rank-steps on a 2-core host, with torch alone too (a core dump: malloc's tcache in gloo's
# AsyncSparseAllreduceWork on its worker thread; docs/results_tests.md). A crash that comes back fails the test.
_FATAL_SIGNAL = r"died with signal (6|11) \((SIGABRT|SIGSEGV)\) without reporting"
_STARTS = ("start_servers(", "start_pairs(", "ServerProcess(", "node_servers(")
_SERVER_FIXTURES = {"two", "server", "raw"}  # test_ps.py's and test_ps_hostile.py's running servers


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    once_more = pytest.mark.flaky(reruns=1, only_rerun=[_FATAL_SIGNAL])
    for item in items:
        item.add_marker(once_more)
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        fn = getattr(item, "function", None)
        src = inspect.getsource(fn) if fn is not None else ""
        if _SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or any(s in src for s in _STARTS):
            item.add_marker(pytest.mark.servers)
