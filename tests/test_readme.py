"""Every Python block of the README runs unchanged (each in its own interpreter, from a scratch directory)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i: int, tmp_path: Path) -> None:
    script = tmp_path / f"block{i}.py"
    script.write_text(BLOCKS[i])
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=280, check=False
    )
    assert done.returncode == 0, f"README block {i} failed:\n{BLOCKS[i]}\n--- stderr ---\n{done.stderr[-3000:]}"
