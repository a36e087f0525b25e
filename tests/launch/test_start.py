"""How ``launch`` starts its ranks (``start_method``): forked from a forkserver that imported torch once, or
spawned. A forked rank must see what a spawned one sees: the launcher's environment and stdout at the call (not
those of the moment the forkserver started), and a numpy generator of its own."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import _start_workers as sw
import pytest

from sparsync import launch
from sparsync.launch import START_METHODS


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_ranks_see_the_launchers_environment_and_stdout_at_the_call(start_method: str) -> None:
    if start_method == "forkserver":  # the server runs now (spawn has none: each rank is a fresh interpreter)
        launch(sw.report, nprocs=1, args=("SPARSYNC_TEST_START",), start_method=start_method)
    var = "SPARSYNC_TEST_START"
    os.environ[var] = f"set after the first launch ({start_method})"
    saved = os.dup(1)
    try:
        with tempfile.TemporaryFile() as f:
            os.dup2(f.fileno(), 1)  # this process's stdout, redirected after the forkserver started
            try:
                got = launch(sw.report, nprocs=3, args=(var,), start_method=start_method)
            finally:
                os.dup2(saved, 1)
            f.seek(0)
            printed = f.read().decode()
    finally:
        os.close(saved)
        del os.environ[var]
    assert [g["var"] for g in got] == [f"set after the first launch ({start_method})"] * 3
    assert sorted(printed.splitlines()) == ["rank 0 was here", "rank 1 was here", "rank 2 was here"]
    assert len({g["draw"] for g in got}) == 3  # numpy's global generator: not the forkserver's, shared
    assert len({g["pid"] for g in got}) == 3 and os.getpid() not in {g["pid"] for g in got}
    parents = {g["ppid"] for g in got}
    if start_method == "spawn":
        assert parents == {os.getpid()}
    else:  # one forkserver, this process's child, forked every rank
        (server,) = parents
        assert server != os.getpid() and b"forkserver" in Path(f"/proc/{server}/cmdline").read_bytes()


def test_unknown_start_method_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'fork'"):
        launch(sw.report, nprocs=1, args=("X",), start_method="fork")


def test_adopting_reseeds_an_inherited_numpy_generator() -> None:
    """A generator the forkserver imported would be every forked rank's: ``adopt`` reseeds it from entropy."""
    import numpy as np

    from sparsync.rank_start import adopt

    np.random.seed(7)
    inherited = np.random.randint(1 << 62)
    np.random.seed(7)
    adopt(dict(os.environ), (1, 2))  # this process's own environment and stdout/stderr: nothing else changes
    assert np.random.randint(1 << 62) != inherited


def test_adopting_freezes_the_inherited_objects_out_of_collections() -> None:
    """A forked rank's collections do not walk what the forkserver imported: ``adopt`` freezes it."""
    import gc

    from sparsync.rank_start import adopt

    before = gc.get_freeze_count()
    try:
        adopt(dict(os.environ), (1, 2))  # this process's own environment and stdout/stderr: nothing else changes
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
