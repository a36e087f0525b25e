#!/usr/bin/env bash
# Make .venv with everything sparsync needs, the `sparsync` command's bench extra and the dev tools
# (pip install -e '.[dev]', which includes '.[bench]'); idempotent, quick when already done.
# torch: the CPU build 2.13.0 (a bare `torch` requirement would pull a multi-GB CUDA build), only when no torch
# is importable in the venv already.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build)"
  .venv/bin/pip install -q torch==2.13.0
fi
# what `pip install -e` builds from: the project files and the C kernels' sources
stale=$(find pyproject.toml setup.py src/sparsync/compress/*.c src/sparsync/sharding/*.c -newer .venv/.sparsync-installed 2>/dev/null || true)
if ! .venv/bin/python -c "import sparsync, sparsync_bench, rich, matplotlib, pytest, hypothesis, ruff, mypy, lightning, accelerate" 2>/dev/null \
   || [ ! -e .venv/.sparsync-installed ] || [ -n "$stale" ]; then
  echo "setup: installing sparsync, its bench tools and its dev tools into .venv"
  .venv/bin/pip install -q -e '.[dev]'
  touch .venv/.sparsync-installed
fi
if ! .venv/bin/python -c "import sparsync.compress._qsgd_c, sparsync.compress._sketch_c, sparsync.compress._threshold_c, \
sparsync.sharding._group_c" 2>/dev/null; then
  echo "setup: the C kernels were not built (no C compiler?): QSGD, the sketch, Threshold and the sharded tables use \
their torch kernels"
fi
