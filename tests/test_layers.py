"""The package's layers (docs/architecture.md): every import of every module under src/sparsync, function-level
and ``TYPE_CHECKING`` ones included, goes to its own layer or a lower one; outside ``sparsync.collectives``
nobody imports its private modules or names; and every module imports."""

from __future__ import annotations

import ast
import functools
import importlib
import pkgutil
from pathlib import Path

import pytest

import sparsync

# (layer, level, module prefixes), low to high. A module may import modules of its own layer and of any layer
# of a lower level; two layers of one level are siblings and may not import each other. A module matches its
# longest prefix; a module no prefix matches (the package's ``__init__``) may import anything. The benchmarks,
# the CLI and the network namespaces are another package, ``sparsync_bench``, which sparsync never imports.
LAYERS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    # A leaf that imports nothing of sparsync: result buffers on huge pages.
    ("base", 0, ("sparsync.buffers",)),
    # The public core: streams, the cost model, the communicator, the metadata exchange, the per-group queue,
    # the collectives, calibration, records and handles, and the process launcher.
    (
        "core",
        1,
        (
            "sparsync.stream",
            "sparsync.costmodel",
            "sparsync.collectives",
            "sparsync.record",
            "sparsync.handle",
            "sparsync.launch",
            "sparsync.rank_start",
        ),
    ),
    ("compress", 2, ("sparsync.compress",)),
    # Placement: the interface and its collective implementations, then planning, the parameter server and the
    # sharded tables (siblings: none imports another), then HybridTrainer, which joins them.
    ("placement", 3, ("sparsync.placement",)),
    ("plan", 4, ("sparsync.plan",)),
    ("ps", 4, ("sparsync.ps",)),
    # Sharded tables: their placement is placement's ``Sharded``; a sibling of plan (whose kind makes it) and ps.
    ("shard", 4, ("sparsync.shard",)),
    ("hybrid", 5, ("sparsync.hybrid",)),
    ("api", 6, ("sparsync.replicator", "sparsync.optim")),
)
TOOLS = ("tools", 7)
PRIVATE_CORE = "sparsync.collectives"  # its private modules and names stay inside it

SRC = Path(sparsync.__file__).parent


@functools.cache
def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def layer_of(module: str) -> tuple[str, int]:
    best: tuple[str, int] = TOOLS
    best_len = -1
    for name, level, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = (name, level), len(p)
    return best


def imports_of(module: str, source: str, known: set[str]) -> list[tuple[int, str, str]]:
    """(line, imported module, imported name or "") of every sparsync import in ``source``, at any depth of
    the tree. ``from a.b import c`` imports module ``a.b.c`` when that is a module, else name ``c`` of ``a.b``."""
    package = module if module in known and _is_package(module) else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names if a.name.split(".")[0] == "sparsync"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            if base.split(".")[0] != "sparsync":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub, "") if sub in known else (node.lineno, base, a.name))
    return out


def _is_package(module: str) -> bool:
    return module_files()[module].name == "__init__.py"


def violations(module: str, source: str, known: set[str]) -> list[str]:
    """What ``module`` (of source ``source``) imports against the layering and the core's privacy."""
    name, level = layer_of(module)
    out = []
    for line, target, attr in imports_of(module, source, known):
        tname, tlevel = layer_of(target)
        what = f"{module}:{line} imports {target}{'.' + attr if attr else ''}"
        if name != TOOLS[0] and tname != name and tlevel >= level:
            out.append(f"{what}: layer {name} (level {level}) -> {tname} (level {tlevel})")
        inside = module == PRIVATE_CORE or module.startswith(PRIVATE_CORE + ".")
        if not inside and (target == PRIVATE_CORE or target.startswith(PRIVATE_CORE + ".")):
            private = [p for p in (*target.split("."), attr) if p.startswith("_")]
            if private:
                out.append(f"{what}: private {'.'.join(private)} of {PRIVATE_CORE}")
    return out


def test_layer_table_names_real_modules() -> None:
    """Every prefix of LAYERS names a module, so the table cannot drift from the package silently."""
    known = set(module_files())
    for _name, _level, prefixes in LAYERS:
        for p in prefixes:
            assert p in known, f"LAYERS names {p}, which is no module of sparsync"


def test_no_import_goes_up_a_layer_or_into_the_core_privately() -> None:
    files = module_files()
    known = set(files)
    found = [v for m, path in files.items() for v in violations(m, path.read_text(), known)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("module", "source", "expect"),
    [
        ("sparsync.stream", "from sparsync.replicator import Replicator\n", "layer core (level 1) -> api"),
        ("sparsync.collectives.allreduce", "def f():\n    from sparsync.compress import QSGD\n", "-> compress"),
        ("sparsync.ps.placement", "from sparsync.plan.detect import ParamStats\n", "layer ps (level 4) -> plan"),
        ("sparsync.compress.reduce", "from sparsync.collectives import _gather\n", "private _gather"),
        ("sparsync.compress.reduce", "from sparsync.collectives.comm import _view\n", "private _view"),
        ("sparsync.replicator.primitives", "import sparsync.collectives._hll\n", "private _hll"),
    ],
)
def test_the_check_catches_a_back_edge(module: str, source: str, expect: str) -> None:
    """The checker itself: an upward import, a sibling import and a private import each give a violation."""
    found = violations(module, source, set(module_files()))
    assert any(expect in v for v in found), found


def test_allowed_imports_pass() -> None:
    known = set(module_files())
    assert not violations("sparsync.replicator.context", "from sparsync.collectives.comm import Comm\n", known)
    assert not violations("sparsync.collectives.meta", "from sparsync.collectives import _hll\n", known)
    assert not violations("sparsync", "from sparsync.replicator import Replicator\n", known)  # a tool


def test_tools_keep_out_of_the_core_too() -> None:
    found = violations("sparsync", "from sparsync.collectives._gather import Fold\n", set(module_files()))
    assert any("private _gather" in v for v in found), found


def test_every_module_imports() -> None:
    failed = []
    for info in pkgutil.walk_packages(sparsync.__path__, "sparsync."):
        try:
            importlib.import_module(info.name)
        except Exception as e:  # report every module that fails, not only the first
            failed.append(f"{info.name}: {type(e).__name__}: {e}")
    assert not failed, "\n".join(failed)


def test_the_library_needs_no_bench_extra() -> None:
    """sparsync imports neither its benchmarks (``sparsync_bench``) nor the ``[bench]`` extra's packages."""
    tools = ("sparsync_bench", "rich", "matplotlib", "scipy")
    found = []
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            found += [f"{name} imports {t}" for t in targets if t.split(".")[0] in tools]
    assert not found, found


def _function_level_imports(source: str) -> list[int]:
    """Lines of the imports inside a function or class body (late imports that hide an import circle)."""
    found: list[int] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom) and nested:
                found.append(child.lineno)
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def test_compress_has_no_late_imports_and_no_import_circle() -> None:
    """sparsync.compress imports at module level only, and its modules import each other without a circle (the
    quantizer, its reduce-scatter and DSAR's quantized phase once needed a late import)."""
    files = module_files()
    known = set(files)
    mods = {m: p for m, p in files.items() if m == "sparsync.compress" or m.startswith("sparsync.compress.")}
    late = [f"{m}:{line}" for m, p in mods.items() for line in _function_level_imports(p.read_text())]
    assert not late, f"function-level imports: {late}"
    edges = {
        m: {t for _, t, _ in imports_of(m, p.read_text(), known) if t in mods and t != m} for m, p in mods.items()
    }
    edges["sparsync.compress"] = set()  # the package's __init__ re-exports its modules: not an edge back
    state: dict[str, int] = {}

    def cycle_from(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return [*path, m, t]
            if t not in state and (c := cycle_from(t, [*path, m])) is not None:
                return c
        state[m] = 2
        return None

    for m in sorted(mods):
        c = None if m in state else cycle_from(m, [])
        assert c is None, " -> ".join(c or [])


def test_the_late_import_check_catches_one() -> None:
    assert _function_level_imports("import os\ndef f():\n    from sparsync import x\n") == [3]
    assert _function_level_imports("try:\n    import a\nexcept ImportError:\n    a = None\n") == []
