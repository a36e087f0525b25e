"""Every function under src/ (sparsync and sparsync_bench; methods and nested functions included) is shorter than
``MAX_LINES`` lines, counted from its ``def`` line (decorators left out) to its last line, except those that
``ALLOWED`` names; and ``ALLOWED`` names only functions that are still that long."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 60
# "<path under src>:<qualified name>" of the functions allowed MAX_LINES lines or more, each with its reason
ALLOWED: frozenset[str] = frozenset()


def long_functions(source: str, path: str) -> dict[str, int]:
    """``"<path>:<qualified name>"`` -> lines of every function of ``source`` of ``MAX_LINES`` lines or more."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None  # set by ast.parse
                    lines = child.end_lineno - child.lineno + 1
                    if lines >= MAX_LINES:
                        found[f"{path}:{name}"] = lines
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def src_long_functions() -> dict[str, int]:
    found: dict[str, int] = {}
    for file in sorted(SRC.rglob("*.py")):
        found |= long_functions(file.read_text(), file.relative_to(SRC).as_posix())
    return found


def test_every_function_under_src_is_shorter_than_max_lines() -> None:
    long = {f: n for f, n in src_long_functions().items() if f not in ALLOWED}
    assert not long, f"functions of {MAX_LINES} lines or more (split them): {long}"


def test_the_allow_list_names_only_long_functions() -> None:
    stale = ALLOWED - src_long_functions().keys()
    assert not stale, f"no longer {MAX_LINES} lines or more (or gone): remove {sorted(stale)} from ALLOWED"


def _function(name: str, lines: int, indent: str = "") -> str:
    """A function of exactly ``lines`` lines (``def`` line included)."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 2))
    return f"{indent}def {name}() -> int:\n{body}{indent}    return 0\n"


def test_the_check_finds_long_functions_methods_and_nested_ones_by_qualified_name() -> None:
    source = (
        "import functools\n\n"
        + "@functools.cache\n"
        + _function("short", MAX_LINES - 1)
        + _function("long", MAX_LINES)
        + "class C:\n"
        + _function("method", MAX_LINES + 5, "    ")
        + "    async def outer(self) -> None:\n"
        + _function("inner", MAX_LINES, "        ")
    )
    assert long_functions(source, "pkg/m.py") == {
        "pkg/m.py:long": MAX_LINES,
        "pkg/m.py:C.method": MAX_LINES + 5,
        "pkg/m.py:C.outer": MAX_LINES + 1,  # its def line and the inner function
        "pkg/m.py:C.outer.inner": MAX_LINES,
    }
