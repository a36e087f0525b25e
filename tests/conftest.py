"""Test tiers (README, "Tests"): a test that starts parameter-server processes is marked ``servers``, so that
``make test-fast`` (no process groups, no servers) can leave it out."""

from __future__ import annotations

import inspect

import pytest

_STARTS = ("start_servers(", "ServerProcess(", "node_servers(")
_SERVER_FIXTURES = {"two", "server", "raw"}  # test_ps.py's and test_ps_hostile.py's running servers


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fn = getattr(item, "function", None)
        src = inspect.getsource(fn) if fn is not None else ""
        if _SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or any(s in src for s in _STARTS):
            item.add_marker(pytest.mark.servers)
