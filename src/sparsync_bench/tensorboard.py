"""``--tensorboard DIR`` of ``sparsync demo`` and ``sparsync bench dlrm``: torch's ``SummaryWriter``, only when
the tensorboard package is installed (``CommLog.to_tensorboard`` itself takes any object with ``add_scalar``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

MISSING = "--tensorboard needs the tensorboard package, which is not installed: pip install tensorboard"


def require_tensorboard() -> None:
    """Raise RuntimeError naming the missing package, before any process starts."""
    if importlib.util.find_spec("tensorboard") is None:
        raise RuntimeError(MISSING)


def summary_writer(directory: str | Path) -> Any:
    """``torch.utils.tensorboard.SummaryWriter`` writing to ``directory``."""
    require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(directory))
