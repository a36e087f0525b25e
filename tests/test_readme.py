"""Every Python block of the README and of the guide pages in docs/ (``DOC_FILES``: the examples moved there from
the README) runs unchanged (each in its own interpreter, from a scratch directory) and prints what its comments say
it prints.

The convention, in those blocks: a comment ``# -> TEXT`` on a ``print(...)`` line, or on the comment lines
directly below it, documents one line of the block's standard output, exactly; ``...`` in TEXT stands for any
text (a measured time, auto's choice on this machine). A block with such comments must print exactly those lines,
in that order, and nothing else; a block without them is checked for its exit status only.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The files whose ```python blocks are promises to a user: the README and the guides it links to.
GUIDES = ("collectives", "optimizer", "compression", "hybrid", "replicator", "gpu", "cluster", "profiling")
DOC_FILES = ("README.md", *(f"docs/{name}.md" for name in GUIDES))


def python_blocks(path: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), re.S)


# (file, index in that file, block) for every block of every file in DOC_FILES
BLOCKS = [(path, i, block) for path in DOC_FILES for i, block in enumerate(python_blocks(path))]

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


def documented_output(block: str) -> list[str]:
    """The ``# -> TEXT`` lines of ``block`` in order: on a ``print(`` line, or on comment lines right below it."""
    want: list[str] = []
    after_print = False
    for line in block.splitlines():
        code, sep, comment = line.partition("#")
        stripped = code.strip()
        if stripped:
            after_print = "print(" in stripped
        elif not sep:
            after_print = False
        if sep and comment.startswith(" -> "):
            if not after_print:
                raise ValueError(f"'# -> ' comment not on or below a print(...) line: {line!r}")
            want.append(comment[len(" -> ") :].rstrip())
    return want


def matches(want: str, got: str) -> bool:
    return re.fullmatch(".*?".join(re.escape(part) for part in want.split("...")), got) is not None


def test_the_readme_has_python_blocks_and_documented_outputs() -> None:
    assert len(python_blocks("README.md")) >= 3
    assert len(BLOCKS) >= 4
    documented = [(path, i) for path, i, b in BLOCKS if documented_output(b)]
    assert len(documented) >= 4, f"only blocks {documented} document their output with '# -> '"
    assert any(path == "README.md" for path, _ in documented), "no README block documents its output"


def test_the_convention_is_parsed() -> None:
    block = "def f():\n    print(1)   # -> 1\nprint(f())\n# -> None\n# a plain comment\n# -> [(1, '...')]\n"
    assert documented_output(block) == ["1", "None", "[(1, '...')]"]
    assert matches("[(1, '...')]", "[(1, 'allgather')]") and not matches("[(1, '...')]", "[(2, 'allgather')]")
    assert matches("tensor([6., 6.])", "tensor([6., 6.])") and not matches("tensor([6., 6.])", "tensor([6., 7.])")
    with pytest.raises(ValueError, match="not on or below"):
        documented_output("x = 1  # -> 1\n")


@pytest.mark.parametrize(("path", "i", "block"), BLOCKS, ids=[f"{path}:{i}" for path, i, _ in BLOCKS])
def test_readme_block_runs_and_prints_what_it_documents(path: str, i: int, block: str, tmp_path: Path) -> None:
    script = tmp_path / f"block{i}.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=280, check=False
    )
    assert done.returncode == 0, f"{path} block {i} failed:\n{block}\n--- stderr ---\n{done.stderr[-3000:]}"
    want = documented_output(block)
    if not want:
        return
    got = done.stdout.splitlines()
    ok = len(got) == len(want) and all(matches(w, g) for w, g in zip(want, got, strict=True))
    assert ok, f"{path} block {i} documents:\n" + "\n".join(want) + "\n--- but printed ---\n" + done.stdout
