"""Workers of test_import_time.py: nothing of sparsync imported here, so a rank has what its forkserver gave it."""

from __future__ import annotations

import sys


def has_module(rank: int, name: str) -> bool:
    del rank
    return name in sys.modules
