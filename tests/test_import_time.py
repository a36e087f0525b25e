"""``import sparsync`` leaves the sharded tables' modules (and the ``torch._dynamo`` they import, about 1 s) out
until ``sparsync.shard`` or ``sparsync.sharding`` is first used; a launcher that has used them has its forkserver
import them for its ranks, one that has not does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False, cwd=TESTS
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_import_sparsync_leaves_the_sharded_tables_and_dynamo_out_until_used() -> None:
    out = _run(
        "import sys, sparsync\n"
        "print('before', 'sparsync.sharding' in sys.modules, 'torch._dynamo' in sys.modules)\n"
        "from sparsync import shard\n"
        "import sparsync.sharding as sh\n"
        "same = shard is sh.shard is sparsync.shard, sparsync.sharding is sh\n"
        "print('after', *same, 'torch._dynamo' in sys.modules)\n"
        "print('missing', hasattr(sparsync, 'no_such_name'))\n"
    )
    assert "before False False" in out, out
    assert "after True True True" in out, out
    assert "missing False" in out, out


@pytest.mark.multiprocess
def test_the_forkserver_imports_the_sharded_tables_only_for_a_launcher_that_used_them() -> None:
    code = (
        "import sparsync, _import_workers as w\n"
        "{use}"
        "if __name__ == '__main__':\n"
        "    print('ranks', sparsync.launch(w.has_module, nprocs=2, args=('sparsync.sharding',)))\n"
    )
    assert "ranks [False, False]" in _run(code.format(use=""))
    assert "ranks [True, True]" in _run(code.format(use="sparsync.sharding\n"))
