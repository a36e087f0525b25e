"""No import circle among the modules of src/sparsync: the graph of every import statement of every module, read
from its AST (those at the top, those under ``if TYPE_CHECKING:`` and those inside functions alike, as each is a
dependency a reader has to follow), has no cycle. A package's ``__init__`` counts as the package's module; an
import of a submodule (``import a.b.c``, ``from a.b import c``) is an edge to that submodule, not to its parents
(Python runs the parents first, but they are no dependency of the importer's code). And every module of a
package imports as ``import sparsync.<package>.<module> as x`` but those ``SHADOWED`` names, each with its
reason."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def bound_names(source: str) -> set[str]:
    """The names a module binds at its top level (imports, definitions, assignments)."""
    out: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out |= {(a.asname or a.name).partition(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def imports_of(source: str, name: str, is_package: bool, known: Mapping[str, set[str]]) -> set[str]:
    """The modules of ``known`` (module -> the names it binds) that module ``name``'s ``source`` imports anywhere
    (top level, under ``TYPE_CHECKING``, in functions), relative imports resolved. ``from pkg import x`` is an
    edge to ``pkg`` only where ``pkg`` binds ``x`` (else ``x`` is a submodule: a compiled one is no edge)."""
    modules = known
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    out.add(f"{base}.{a.name}")
                elif base in modules and (a.name in modules[base] or not _is_package(base, modules)):
                    out.add(base)
    out.discard(name)
    return out


def _is_package(name: str, modules: Mapping[str, set[str]]) -> bool:
    return any(m.startswith(name + ".") for m in modules)


def import_graph(root: Path = SRC, top: str = "sparsync") -> dict[str, set[str]]:
    """Module -> the modules of ``top`` it imports, for every module under ``root / top``."""
    files = {module_name(p, root): p for p in sorted((root / top).rglob("*.py"))}
    bound = {name: bound_names(path.read_text()) for name, path in files.items()}
    return {
        name: imports_of(path.read_text(), name, path.name == "__init__.py", bound) for name, path in files.items()
    }


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan), each sorted: every
    import circle lies in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_src_sparsync_has_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 100  # every module read (a wrong root would find none and pass)
    assert "sparsync.sharding.ids" in graph["sparsync.sharding.exchange"]
    assert not cycles(graph), f"import circles (each a set of modules that import each other): {cycles(graph)}"


def test_the_check_finds_a_circle_hidden_under_type_checking_and_in_a_function(tmp_path: Path) -> None:
    pkg = tmp_path / "p" / "q"
    pkg.mkdir(parents=True)
    (tmp_path / "p" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from p.q.a import A\n")
    (pkg / "a.py").write_text("from p.q import b\nclass A: ...\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    (pkg / "c.py").write_text("def f():\n    from p.q.a import A\n    return A\n")
    (pkg / "d.py").write_text("import p.q.c\nfrom p.q import a\nfrom p.q import _compiled\nfrom p.q import A\n")
    graph = import_graph(tmp_path, "p")
    assert graph["p.q.b"] == {"p.q.c"}  # the relative import under TYPE_CHECKING
    assert graph["p.q.d"] == {"p.q.c", "p.q.a", "p.q"}  # A: the package's name; _compiled: no edge
    assert cycles(graph) == [["p.q.a", "p.q.b", "p.q.c"]]
    (pkg / "c.py").write_text("def f():\n    return 0\n")
    assert cycles(import_graph(tmp_path, "p")) == []


# modules of a package that ``import sparsync.<package>.<module> as x`` does not give, each with its reason
SHADOWED = {
    "sparsync.collectives.allreduce": "the function sparsync.collectives.allreduce (collectives/tensor.py), "
    "exported by the package, shadows the module",
}


def shadowed_modules() -> set[str]:
    """The modules of a package below ``sparsync`` (``sparsync.<package>.<module>``, at any depth) that
    ``import <name> as x`` does not give (a package attribute of the module's name, as a function, shadows it).
    Top-level modules are left out: ``sparsync.launch`` and ``sparsync.shard`` are the functions by design."""
    import importlib
    import sys

    out = set()
    for name in sorted(import_graph()):
        if name.count(".") < 2:
            continue
        importlib.import_module(name)
        space: dict[str, object] = {}
        try:
            exec(f"import {name} as imported", space)
        except ImportError:
            out.add(name)
            continue
        if space["imported"] is not sys.modules[name]:
            out.add(name)
    return out


def test_every_module_of_a_package_imports_as_import_dotted_name_as_x() -> None:
    assert shadowed_modules() == set(SHADOWED), f"shadowed modules (reasons: {SHADOWED})"
