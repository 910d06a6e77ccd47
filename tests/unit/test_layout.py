"""The repository's layout holds: no import cycle between the engine's folders (or between the
components), the gateway reaches into the engine only through `kvfleet.engine.protocol`, that
contract is torch-free, and no source file outgrows 400 lines (Triton kernel modules aside).

Imports are read with `ast` from every module, function-level and TYPE_CHECKING ones included:
a lazy import is still a dependency."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

COMPONENTS = {
    "cli": "kvfleet.cli",
    "engine": "kvfleet.engine",
    "gateway": "kvfleet.gateway",
    "operator": "kvfleet.operator",
    "bench": "kvfleet.bench",
}
MAX_LINES = 400


def _modules(root: Path) -> dict[str, Path]:
    modules = {}
    for folder, package in COMPONENTS.items():
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _imports(module: str, path: Path) -> Iterator[str]:
    """Every kvfleet module name `module` imports (and each `from X import name` as X.name,
    which is a module when `name` is one)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            yield source
            yield from (f"{source}.{alias.name}" for alias in node.names)


def _room(module: str) -> str:
    """The unit the no-cycle rule is about: an engine folder (kvfleet.engine.core), an engine
    front-door module (kvfleet.engine.llm), or a whole other component."""
    parts = module.split(".")
    if parts[1] != "engine" or len(parts) == 2:
        return ".".join(parts[:2])
    return ".".join(parts[:3])


def _edges(root: Path) -> dict[str, dict[str, list[str]]]:
    """room -> room it imports -> the imports that make that edge ("a imports b")."""
    modules = _modules(root)
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, path in modules.items():
        for name in _imports(module, path):
            if name in modules:
                a, b = _room(module), _room(name)
                if a != b:
                    edges[a][b].append(f"{module} imports {name}")
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_engine_folders_or_components(repo_root: Path) -> None:
    edges = _edges(repo_root)
    cycles = _cycles({a: set(targets) for a, targets in edges.items()})
    report = [
        f"{a} -> {b}: {why}"
        for cycle in cycles
        for a in cycle
        for b, reasons in sorted(edges[a].items())
        if b in cycle
        for why in reasons
    ]
    assert cycles == [], "import cycles:\n" + "\n".join(report)


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    # (the check itself: a loop between two engine folders through a lazy import)
    for folder in COMPONENTS:
        (tmp_path / folder).mkdir()
    for name, text in {
        "engine/core/a.py": "from kvfleet.engine.worker import b\n",
        "engine/worker/b.py": "def f():\n    from kvfleet.engine.core.a import x\n",
        "engine/llm.py": "from kvfleet.engine.core import a\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = {a: set(targets) for a, targets in _edges(tmp_path).items()}
    assert _cycles(graph) == [["kvfleet.engine.core", "kvfleet.engine.worker"]]


def test_the_gateway_imports_only_the_engines_protocol(repo_root: Path) -> None:
    edges = _edges(repo_root)
    outside = [
        why
        for target, reasons in edges["kvfleet.gateway"].items()
        if target.startswith("kvfleet.engine") and target != "kvfleet.engine.protocol"
        for why in reasons
    ]
    assert outside == []


def test_the_protocol_imports_no_torch(heavy_imports_of: Callable[..., list[str]]) -> None:
    assert heavy_imports_of("kvfleet.engine.protocol") == []


def _is_triton_kernel_module(path: Path) -> bool:
    return "@triton.jit" in path.read_text()


@pytest.mark.parametrize("folder", sorted(COMPONENTS))
def test_no_source_file_past_400_lines(repo_root: Path, folder: str) -> None:
    long = {
        str(path.relative_to(repo_root)): length
        for path in sorted((repo_root / folder).rglob("*.py"))
        if (length := len(path.read_text().splitlines())) > MAX_LINES
        and not _is_triton_kernel_module(path)
    }
    assert long == {}, f"split these (at most {MAX_LINES} lines): {long}"


def test_every_package_folder_is_in_the_distribution(repo_root: Path) -> None:
    """pyproject lists packages by hand (one distribution, mapped folders): a new folder left
    out installs without its modules (the packaging test finds that too, minutes later)."""
    import tomllib

    config = tomllib.loads((repo_root / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = set()
    for folder, package in COMPONENTS.items():
        for init in (repo_root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(repo_root / folder).parts
            found.add(".".join((package, *parts)))
    assert found - listed == set()
