"""The package's layers (docs/architecture.md): every import of every module under src/sparsync, function-level
and ``TYPE_CHECKING`` ones included, goes to its own layer or a lower one; inside ``sparsync.collectives`` to its
own sublayer or a lower one; outside ``sparsync.collectives`` nobody imports its private modules or names; no
module of sparsync imports a module of src/ inside a function; no modules of src/ (sparsync and
sparsync_bench) import each other, directly or round a loop; and every module imports."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import sparsync

# (layer, level, module prefixes), low to high. A module may import modules of its own layer and of any layer
# of a lower level; two layers of one level are siblings and may not import each other. A module matches its
# longest prefix; a module no prefix matches (the package's ``__init__``) may import anything. The benchmarks,
# the CLI and the network namespaces are another package, ``sparsync_bench``, which sparsync never imports.
LAYERS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    # Leaves that import nothing of sparsync: result buffers on huge pages, the registries' one shape.
    ("base", 0, ("sparsync.buffers", "sparsync.registry")),
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
    # Sharded tables: their placement is placement's ``Sharded``; above plan, whose kind prices them and whose
    # planner their ``plan="auto"`` asks; a sibling of HybridTrainer.
    ("sharding", 5, ("sparsync.sharding",)),
    ("hybrid", 5, ("sparsync.hybrid",)),
    ("api", 6, ("sparsync.replicator", "sparsync.optim")),
)
TOOLS = ("tools", 7)
PRIVATE_CORE = "sparsync.collectives"  # its private modules and names stay inside it

# Inside the core's collectives, low to high (docs/architecture.md): a module imports modules of its own
# sublayer or of a lower one, so the core reads bottom to top (the flight recorder's ring once imported the
# metadata exchange and the peers inside functions, for its failure policy: a circle behind a late import).
# The package's ``__init__`` sits above them all; a module of the package missing here fails the test.
SUBLAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("leaves", ("ops", "trace", "site", "traffic", "_hll", "partition", "row")),
    ("flight ring", ("flight",)),
    ("group state", ("group", "timeline", "background")),
    ("peers", ("peers",)),
    ("failure", ("failure",)),
    ("queue", ("fifo",)),
    ("transport", ("transport",)),
    ("comm", ("wire", "comm")),
    ("gather", ("_gather",)),
    ("meta", ("meta",)),
    (
        "algorithms",
        (
            "dense",
            "allgather",
            "recursive_double",
            "split_allgather",
            "algorithms",
            "calibrate",
            "allreduce",
            "grouped",
            "tensor",
            "hierarchical",
        ),
    ),
)
FIRST_PARTY = ("sparsync", "sparsync_bench")  # the packages under src/

SRC = Path(sparsync.__file__).parent


@functools.cache
def module_files(package: str = "sparsync") -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a package by its ``__init__.py``)."""
    spec = importlib.util.find_spec(package)  # found, not imported: sparsync_bench needs the bench extra
    assert spec is not None and spec.submodule_search_locations, package
    root = Path(next(iter(spec.submodule_search_locations)))
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def src_files() -> dict[str, Path]:
    """Every module of every package under src/."""
    return {m: p for package in FIRST_PARTY for m, p in module_files(package).items()}


def layer_of(module: str) -> tuple[str, int]:
    best: tuple[str, int] = TOOLS
    best_len = -1
    for name, level, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = (name, level), len(p)
    return best


def imports_of(
    module: str, source: str, known: set[str], *, type_checking: bool = True
) -> list[tuple[int, str, str]]:
    """(line, imported module, imported name or "") of every import of src/'s packages in ``source``, at any
    depth of the tree (``type_checking=False``: but those under ``if TYPE_CHECKING:``, which never run).
    ``from a.b import c`` imports module ``a.b.c`` when that is a module, else name ``c`` of ``a.b``."""
    package = module if module in known and _is_package(module) else module.rpartition(".")[0]
    tree = ast.parse(source)
    skip = set() if type_checking else {id(n) for n in _type_checking_nodes(tree)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names if a.name.split(".")[0] in FIRST_PARTY]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            if base.split(".")[0] not in FIRST_PARTY:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub, "") if sub in known else (node.lineno, base, a.name))
    return out


def _is_package(module: str) -> bool:
    return src_files()[module].name == "__init__.py"


def _type_checking_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node under an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    out: list[ast.AST] = []
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
        if isinstance(node, ast.If) and name == "TYPE_CHECKING":
            out += [n for child in node.body for n in ast.walk(child)]
    return out


def sublayer_of(module: str) -> tuple[int, str]:
    """(level, name) of a module of ``sparsync.collectives`` in SUBLAYERS; the package's ``__init__`` and any
    module SUBLAYERS does not name sit above them all."""
    short = module.removeprefix(PRIVATE_CORE + ".")
    for i, (name, modules) in enumerate(SUBLAYERS):
        if short in modules:
            return i, name
    return len(SUBLAYERS), "the package" if module == PRIVATE_CORE else f"unplaced {module}"


def sublayer_violations(module: str, source: str, known: set[str]) -> list[str]:
    """What a module of ``sparsync.collectives`` imports from a higher sublayer of it."""
    if not module.startswith(PRIVATE_CORE + "."):
        return []
    level, name = sublayer_of(module)
    out = []
    for line, target, attr in imports_of(module, source, known):
        if target != PRIVATE_CORE and not target.startswith(PRIVATE_CORE + "."):
            continue
        tlevel, tname = sublayer_of(target)
        if tlevel > level:
            out.append(f"{module}:{line} imports {target}{'.' + attr if attr else ''}: sublayer {name} -> {tname}")
    return out


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
    """Every module imports; ``sparsync.integrations``' modules need their extra (lightning), where absent."""
    failed = []
    for info in pkgutil.walk_packages(sparsync.__path__, "sparsync."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if not (info.name.startswith("sparsync.integrations.") and e.name in ("lightning", "accelerate")):
                failed.append(f"{info.name}: {type(e).__name__}: {e}")
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


def test_sublayers_place_every_collectives_module() -> None:
    """SUBLAYERS names every module of ``sparsync.collectives`` once, and only its modules."""
    real = {m.removeprefix(PRIVATE_CORE + ".") for m in module_files() if m.startswith(PRIVATE_CORE + ".")}
    named = [m for _, modules in SUBLAYERS for m in modules]
    assert len(named) == len(set(named)), f"named twice: {sorted(m for m in named if named.count(m) > 1)}"
    assert set(named) == real, f"unplaced: {sorted(real - set(named))}; not modules: {sorted(set(named) - real)}"


def test_collectives_import_down_their_sublayers() -> None:
    files = module_files()
    known = set(files)
    found = [v for m, path in files.items() for v in sublayer_violations(m, path.read_text(), known)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("module", "source", "expect"),
    [
        ("sparsync.collectives.flight", "def f():\n    from sparsync.collectives import meta\n", "ring -> meta"),
        ("sparsync.collectives.group", "from sparsync.collectives.fifo import submit\n", "state -> queue"),
        ("sparsync.collectives.peers", "from sparsync.collectives.failure import guard\n", "peers -> failure"),
        ("sparsync.collectives.comm", "from sparsync.collectives import _gather\n", "comm -> gather"),
        ("sparsync.collectives.meta", "from sparsync.collectives import allreduce\n", "meta -> algorithms"),
        ("sparsync.collectives.trace", "from sparsync.collectives import tensor\n", "leaves -> algorithms"),
        ("sparsync.collectives.dense", "from sparsync.collectives import sparse_allreduce\n", "-> the package"),
    ],
)
def test_the_sublayer_check_catches_an_upward_import(module: str, source: str, expect: str) -> None:
    found = sublayer_violations(module, source, set(module_files()))
    assert any(expect in v for v in found), found


def test_the_sublayer_check_allows_its_own_and_lower_ones() -> None:
    known = set(module_files())
    assert not sublayer_violations("sparsync.collectives.comm", "from sparsync.collectives import wire\n", known)
    assert not sublayer_violations("sparsync.collectives.meta", "from sparsync.collectives import ops\n", known)
    assert not sublayer_violations("sparsync.collectives", "from sparsync.collectives import tensor\n", known)


# the late imports allowed, each with its reason; the circle check below still counts them as edges
LAZY = {
    ("sparsync", "sparsync.sharding"): "the package's __getattr__ (PEP 562): `import sparsync` leaves the sharded "
    "tables' modules and the torch._dynamo they import (1 s) out until sparsync.shard is used",
}


def test_sparsync_has_no_late_imports_of_its_own_modules() -> None:
    """No module of sparsync, in any of its packages, imports a module of src/ inside a function (but ``LAZY``'s):
    a late import hides a circle, it does not remove one (a third-party import there, numpy in the planner, is
    only lazy). sparsync_bench's commands load their modules lazily; the circle check below covers those
    imports."""
    files = module_files()
    known = set(src_files())
    late = []
    for m, path in files.items():
        source = path.read_text()
        lines = set(_function_level_imports(source))
        late += [
            f"{m}:{line} imports {t}"
            for line, t, _ in imports_of(m, source, known)
            if line in lines and (m, t) not in LAZY
        ]
    assert not late, f"function-level imports: {late}"


def import_edges(sources: dict[str, str], known: set[str]) -> dict[str, set[str]]:
    """Module -> the modules of ``known`` it imports when it runs: at import time or inside a function, not under
    ``if TYPE_CHECKING:``. A package's ``__init__`` re-exports its own modules: no edge back into it."""
    edges = {}
    for m, source in sources.items():
        out = set()
        for _, target, _ in imports_of(m, source, known, type_checking=False):
            while target and target not in known:  # a name of a module, or a module that is no file (.so)
                target = target.rpartition(".")[0]
            if target and target != m and not (_is_package(m) and target.startswith(m + ".")):
                out.add(target)
        edges[m] = out
    return edges


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One loop of ``edges`` (its modules in order, the first one again at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done, no loop through it

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                here = [*path, m]
                return [*here[here.index(t) :], t]
            if t not in state and (c := visit(t, [*path, m])) is not None:
                return c
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (c := visit(m, [])) is not None:
            return c
    return None


def test_no_import_circle_under_src() -> None:
    """No modules of sparsync or sparsync_bench import each other, directly or round a loop, at import time or
    in a function (train_demo <-> demo_report and dlrm_train <-> torchrec_baseline once did, behind late
    imports; the collectives' flight recorder -> meta -> comm -> flight and flight -> peers -> group -> flight
    too)."""
    files = src_files()
    c = find_circle(import_edges({m: p.read_text() for m, p in files.items()}, set(files)))
    assert c is None, " -> ".join(c or [])


def test_the_circle_check_catches_one() -> None:
    """A circle closed by a late import is found; the same imports without it, or under TYPE_CHECKING, are not."""
    known = {"sparsync.collectives.flight", "sparsync.collectives.meta", "sparsync.collectives.comm"}
    sources = {
        "sparsync.collectives.flight": "def label():\n    from sparsync.collectives import meta\n",
        "sparsync.collectives.meta": "from sparsync.collectives.comm import Comm\n",
        "sparsync.collectives.comm": "from sparsync.collectives.flight import FlightEntry\n",
    }
    c = find_circle(import_edges(sources, known))
    assert c is not None and c[0] == c[-1] and len(c) == 4, c
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sparsync.collectives import meta\n"
    assert find_circle(import_edges({**sources, "sparsync.collectives.flight": typed}, known)) is None
    assert find_circle(import_edges({**sources, "sparsync.collectives.flight": ""}, known)) is None


def test_the_circle_check_covers_the_tools_late_imports() -> None:
    """sparsync_bench's function-level imports count: one late import planted in the real sources (the runner
    naming a benchmark's module inside a function, which imports the runner) closes a circle the check finds."""
    files = src_files()
    sources = {m: p.read_text() for m, p in files.items()}
    sources["sparsync_bench.runner"] += "\n\ndef _late():\n    from sparsync_bench.bench import allreduce\n"
    c = find_circle(import_edges(sources, set(files)))
    assert c is not None and "sparsync_bench.runner" in c and "sparsync_bench.bench.allreduce" in c, c


def test_the_late_import_check_catches_one() -> None:
    assert _function_level_imports("import os\ndef f():\n    from sparsync import x\n") == [3]
    assert _function_level_imports("try:\n    import a\nexcept ImportError:\n    a = None\n") == []
