"""The package layering: ``common`` below everything, ``shards`` and ``filters`` below ``capture``, and no
import circle between any two modules of the repo (issue 30, part 5)."""

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGES = ("common", "capture", "shards", "filters", "provenance", "drafter")


def repo_modules() -> dict[str, Path]:
    """Dotted name → file for every module of the repo's packages and ``cli``."""
    found = {"cli": REPO / "cli.py"}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The repo modules ``name`` imports anywhere in its file (module level and inside functions: a lazy
    import closes a circle as soon as it runs). ``from a import b`` counts as ``a.b`` where that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a non-module attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_the_module_graph_has_no_circle():
    modules = repo_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert {"common.errors", "common.hashing", "common.records", "capture.driver", "shards.format"} <= set(graph)
    assert graph["common.records"] == {"common.hashing"} and graph["common.errors"] == set()
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import circle: {' -> '.join(e.args[1])}") from None
    assert len(order) == len(modules)


def test_common_imports_no_other_package_and_shards_and_filters_no_capture():
    modules = repo_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}

    def reaches(name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    for name in modules:
        top = name.split(".")[0]
        below = {m.split(".")[0] for m in reaches(name)}
        if top == "common":
            assert below <= {"common"}, f"{name} imports {sorted(below - {'common'})}"
        if top in ("shards", "filters"):
            assert "capture" not in below, f"{name} reaches capture: {sorted(m for m in reaches(name) if m.startswith('capture'))}"


def test_importing_shards_and_filters_loads_no_capture_module():
    """What Python actually loads (the graph above sees only the repo's own import statements)."""
    names = sorted(n for n in repo_modules() if n.split(".")[0] in ("common", "shards", "filters"))
    code = (f"import importlib, sys\nfor n in {names!r}:\n    importlib.import_module(n)\n"
            "print(sorted(m for m in sys.modules if m == 'capture' or m.startswith('capture.')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
