"""The package's import graph has no cycles, counting imports inside functions and
under ``if TYPE_CHECKING:``, and the launcher never imports the training engine.

Every ``import`` / ``from ... import`` in src/torchgpu is read with ``ast`` (module
level, inside functions and classes, and under ``if TYPE_CHECKING:`` alike: an import
only the type checker runs still ties the two modules' concepts together, and a cycle
there is one a refactor can turn into a run-time cycle). ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``).
Imports that hide count too: ``importlib.import_module("torchgpu....")`` /
``__import__`` with a literal name, and names of a package that exports lazily
(:mod:`torchgpu._lazy`: its ``TYPE_CHECKING`` block is resolved at run time): ``from pkg
import name`` is an edge to the module that defines ``name``, and ``import pkg`` an edge
to every module it exports from. A strongly connected component of more than one module
is a cycle: it fails the test with the modules and the edges that close it.

The same holds one level up, for the training engine's layout: each sub-package of
``torchgpu.train`` (``loop/``, ``strategies/``, ``checkpoints/``...) taken as one node and
each of its top-level modules as another, the graph has no cycle either, so the
packages are layers a reader can take in order; and ``train/config.py`` (the settings)
imports nothing of the engine.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import torchgpu

PACKAGE = Path(torchgpu.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is_package)}`` for every module of torchgpu."""
    found: dict[str, tuple[Path, bool]] = {}
    for file in PACKAGE.rglob("*.py"):
        parts = list(file.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (file, is_package)
    return found


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``: at module level, in functions and classes,
    and under ``if TYPE_CHECKING:``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _string_imports(tree: ast.Module) -> Iterator[str]:
    """Module names given as string literals to ``import_module`` / ``__import__``."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__")):
            yield node.args[0].value


def _lazy_tables(modules: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, str]]:
    """``{package: {name: defining module}}`` for the packages exporting through
    torchgpu._lazy."""
    from torchgpu._lazy import export_table

    tables = {}
    for name, (file, is_package) in modules.items():
        if is_package and "exports(__name__, __file__" in file.read_text():
            tables[name] = export_table(str(file))
    return tables


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of torchgpu it imports}`` (a copy of its own for each caller:
    the sources are read once per test process)."""
    return {name: set(targets) for name, targets in _import_graph().items()}


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    lazy = _lazy_tables(modules)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (file, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(file.read_text(), str(file))
        targets = list(_string_imports(tree))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                targets += [module for alias in node.names
                            for module in lazy.get(alias.name, {}).values()]
            else:
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules
                            else lazy.get(base, {}).get(a.name, base) for a in node.names]
        for target in targets:
            module = known(target) if target.startswith("torchgpu") else None
            if module is not None and module != name:
                graph[name].add(module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                on_stack.add(step)
                work.append((step, iter(sorted(graph[step]))))
            elif step in on_stack:
                low[node] = min(low[node], index[step])
    return found


def test_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_imports_inside_functions() -> None:
    graph = import_graph()
    assert graph  # the walk found the package
    # parallel/pipeline.py imports chunks at module level; train modules import inside
    # functions too: both kinds are edges.
    assert "torchgpu.parallel.chunks" in graph["torchgpu.parallel.pipeline"]
    assert all(target.startswith("torchgpu") for targets in graph.values()
               for target in targets)


def test_imports_under_type_checking_are_read() -> None:
    source = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from torchgpu.train.state import TrainState\n"
        "def f():\n"
        "    import torchgpu.errors\n")
    found = [ast.unparse(node) for node in _imports(source)]
    assert "from torchgpu.train.state import TrainState" in found
    assert "import torchgpu.errors" in found


def test_graph_sees_imports_hidden_in_strings() -> None:
    graph = import_graph()
    # a name from a lazy package is an edge to its defining module; doctor's
    # placement check's import_module("torchgpu.placement") is an edge too
    assert "torchgpu.devices.spec" in graph["torchgpu.train.strategies.placing"]  # get_device
    assert "torchgpu.placement" in graph["torchgpu.cli.doctor_placement"]


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    detail = [
        f"{' , '.join(component)} (edges: "
        + "; ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a])
                    if b in component) + ")"
        for component in found
    ]
    assert not found, "import cycles:\n" + "\n".join(detail)


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """``{module: the module that imports it}`` for every module ``start`` reaches."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        module = todo.pop()
        for target in sorted(graph[module]):
            if target not in via and target != start:
                via[target] = module
                todo.append(target)
    return via


def _chain(via: dict[str, str], start: str, end: str) -> str:
    path = [end]
    while path[-1] != start:
        path.append(via[path[-1]])
    return " -> ".join(reversed(path))


def test_launch_never_imports_train() -> None:
    """torchgpu.launch starts and keeps the processes the engine runs in: the engine
    imports it (heartbeats, the stop flag), never the other way round, directly or
    through another module."""
    graph = import_graph()
    launch = sorted(name for name in graph if name.split(".")[:2] == ["torchgpu", "launch"])
    assert "torchgpu.launch.run" in launch
    found = []
    for start in launch:
        via = _reachable(graph, start)
        found += [_chain(via, start, target) for target in sorted(via)
                  if target.split(".")[:2] == ["torchgpu", "train"]]
    assert not found, "torchgpu.launch imports torchgpu.train:\n" + "\n".join(found)


TRAIN = "torchgpu.train"


def train_layout(graph: dict[str, set[str]]) -> tuple[dict[str, set[str]],
                                                       dict[tuple[str, str], list[str]]]:
    """The engine's graph one level up: ``{node: nodes it imports}``, a node being a
    sub-package of torchgpu.train (``torchgpu.train.loop``) or one of its top-level
    modules (``torchgpu.train.runner``), and for each edge the module imports behind it."""

    def node(module: str) -> str | None:
        parts = module.split(".")
        if parts[:2] != TRAIN.split(".") or len(parts) < 3:
            return None
        return ".".join(parts[:3])

    layout: dict[str, set[str]] = {}
    behind: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        source = node(module)
        if source is None:
            continue
        layout.setdefault(source, set())
        for target in targets:
            into = node(target)
            if into is not None and into != source:
                layout[source].add(into)
                behind.setdefault((source, into), []).append(f"{module} -> {target}")
    return layout, behind


def test_layout_finder_sees_a_package_cycle() -> None:
    graph = {"torchgpu.train.loop.epoch": {"torchgpu.train.guards.agreement"},
             "torchgpu.train.guards.agreement": {"torchgpu.train.loop.tail"},
             "torchgpu.train.loop.tail": set(), "torchgpu.train.config": set()}
    layout, behind = train_layout(graph)
    assert cycles(layout) == [["torchgpu.train.guards", "torchgpu.train.loop"]]
    assert behind[("torchgpu.train.guards", "torchgpu.train.loop")] == [
        "torchgpu.train.guards.agreement -> torchgpu.train.loop.tail"]


def test_train_packages_are_layers() -> None:
    """No two of train's sub-packages (or top-level modules) import each other, through
    any path: e.g. the loop never imports a strategy, a checkpoint or an observer; they
    hook into it."""
    layout, behind = train_layout(import_graph())
    assert {"torchgpu.train.loop", "torchgpu.train.strategies", "torchgpu.train.runner"
            } <= set(layout)
    found = cycles(layout)
    detail = [
        f"{' , '.join(component)} (imports: "
        + "; ".join(edge for a in component for b in sorted(layout[a]) if b in component
                    for edge in behind[(a, b)])
        + ")"
        for component in found
    ]
    assert not found, "sub-packages of torchgpu.train import each other:\n" + "\n".join(detail)


def test_train_config_is_a_leaf() -> None:
    """The settings (``TrainConfig``) import nothing of the engine: every part of it can
    read them."""
    imported = import_graph()["torchgpu.train.config"]
    assert not {name for name in imported if name.startswith(TRAIN)}, imported
