"""Every Python block of the README and of the guide pages in docs/ (``DOC_FILES``: the examples moved there from
the README) runs unchanged (each in its own interpreter, from a scratch directory) and prints what its comments say
it prints.

The convention, in those blocks: a comment ``# -> TEXT`` on a ``print(...)`` line, or on the comment lines
directly below it, documents one line of the block's standard output, exactly; ``...`` in TEXT stands for the text
of one value that differs by machine (auto's choice, the device type): any characters but quotes, commas,
brackets and parentheses, so it never stands for whole items of a list. A block with such comments must print
exactly those lines, in that order, and nothing else; a block without them is checked for its exit status only.
Comments are read with ``tokenize`` (a ``#`` inside a string is no comment), and an arrow comment not in the
``# -> TEXT`` form is an error rather than a line that goes unchecked.
"""

from __future__ import annotations

import importlib.util
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The files whose ```python blocks are promises to a user: the README and the guides it links to.
GUIDES = (
    "collectives",
    "optimizer",
    "compression",
    "hybrid",
    "replicator",
    "gpu",
    "cluster",
    "profiling",
    "sharding",
    "integrations",
)
DOC_FILES = ("README.md", *(f"docs/{name}.md" for name in GUIDES))
OPTIONAL_EXTRAS = ("lightning", "accelerate")  # a block importing one is skipped where it is not installed


def python_blocks(path: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), re.S)


# (file, index in that file, block) for every block of every file in DOC_FILES
BLOCKS = [(path, i, block) for path in DOC_FILES for i, block in enumerate(python_blocks(path))]

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


def documented_output(block: str) -> list[str]:
    """The ``# -> TEXT`` lines of ``block`` in order: on a ``print(`` line, or on comment lines right below it."""
    tokens = tokenize.generate_tokens(io.StringIO(block).readline)
    comments = {t.start[0]: (t.start[1], t.string) for t in tokens if t.type == tokenize.COMMENT}
    want: list[str] = []
    after_print = False
    for n, line in enumerate(block.splitlines(), 1):
        col, comment = comments.get(n, (len(line), ""))
        code = line[:col].strip()
        if code:
            after_print = "print(" in code
        elif not comment:
            after_print = False
        if not re.match(r"#\s*->", comment):
            continue
        if not comment.startswith("# -> ") or not comment[len("# -> ") :].strip():
            raise ValueError(f"an output comment must read '# -> TEXT': {line!r}")
        if not after_print:
            raise ValueError(f"'# -> ' comment not on or below a print(...) line: {line!r}")
        want.append(comment[len("# -> ") :].rstrip())
    return want


def matches(want: str, got: str) -> bool:
    """Whether the printed line ``got`` is ``want``, each ``...`` standing for one value's text."""
    return re.fullmatch(r"[^'\"(),\[\]]*".join(re.escape(part) for part in want.split("...")), got) is not None


def test_the_readme_has_python_blocks_and_documented_outputs() -> None:
    assert len(python_blocks("README.md")) >= 3
    assert len(BLOCKS) >= 4
    documented = [(path, i) for path, i, b in BLOCKS if documented_output(b)]
    assert len(documented) >= 4, f"only blocks {documented} document their output with '# -> '"
    assert any(path == "README.md" for path, _ in documented), "no README block documents its output"


def test_the_convention_is_parsed() -> None:
    block = "def f():\n    print(1)   # -> 1\nprint(f())\n# -> None\n# a plain comment\n# -> [(1, '...')]\n"
    assert documented_output(block) == ["1", "None", "[(1, '...')]"]
    assert documented_output("print('# -> 2')  # -> # -> 2\n") == ["# -> 2"]  # the first '#' opens a string
    assert matches("[(1, '...')]", "[(1, 'allgather')]") and not matches("[(1, '...')]", "[(2, 'allgather')]")
    assert matches("tensor([6., 6.])", "tensor([6., 6.])") and not matches("tensor([6., 6.])", "tensor([6., 7.])")
    # '...' is one value: it cannot swallow a wrong item, nor extra ones
    assert not matches("[('...', True), ('...', True)]", "[('cpu', False), ('cpu', True), ('cpu', True)]")
    assert not matches("[('...', True)]", "[('cpu', True), ('cpu', True)]")
    assert matches("took ... ms", "took 12.5 ms")
    with pytest.raises(ValueError, match="not on or below"):
        documented_output("x = 1  # -> 1\n")
    for malformed in ("print(1)  #-> 1\n", "print(1)  # ->1\n", "print(1)  # ->\n"):
        with pytest.raises(ValueError, match="must read"):
            documented_output(malformed)


@pytest.mark.parametrize(("path", "i", "block"), BLOCKS, ids=[f"{path}:{i}" for path, i, _ in BLOCKS])
def test_readme_block_runs_and_prints_what_it_documents(path: str, i: int, block: str, tmp_path: Path) -> None:
    for extra in OPTIONAL_EXTRAS:  # docs/integrations.md's blocks import them
        if re.search(rf"^(import|from) {extra}\b", block, re.M) and importlib.util.find_spec(extra) is None:
            pytest.skip(f"needs the {extra} extra: pip install -e '.[{extra}]'")
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
