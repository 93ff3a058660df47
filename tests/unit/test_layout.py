"""The shape of the code: no import cycle between modules, `engine/` imports nothing
outside itself but protocol types, and no source file over 400 lines.

Every import counts: at the top, inside a function, and under TYPE_CHECKING (a cycle of
type-only imports is still two modules that cannot be read apart). The import packages
live in folders named otherwise: daemon/ is `lmd`, clients/ is `lmd_client`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGES = {"lmd": ROOT / "daemon", "lmd_client": ROOT / "clients"}
MAX_LINES = 400
# What engine/ may import of lmd besides itself: the types that cross process boundaries.
ENGINE_MAY_IMPORT = ("lmd.engine", "lmd.protocol", "lmd.wire", "lmd.names")


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[str]:
    """The lmd modules `name` imports (a name imported from a package that is itself a
    module counts as that module)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                full = f"{module}.{alias.name}"
                yield full if full in MODULES else module


def _graph() -> dict[str, set[str]]:
    return {
        name: {m for m in _imports(name, path) if m in MODULES and m != name}
        for name, path in MODULES.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def test_the_walk_sees_imports_of_every_kind() -> None:
    graph = _graph()
    assert "lmd.protocol" in graph["lmd.worker"]  # from lmd import protocol
    assert "lmd.engine.config" in graph["lmd.config"]  # from lmd.engine.config import X
    assert len(MODULES) > 100


def test_no_module_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_a_cycle_is_found_when_there_is_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_engine_imports_only_itself_and_protocol_types() -> None:
    outside = {
        f"{name} -> {m}"
        for name, deps in _graph().items()
        if name.startswith("lmd.engine")
        for m in deps
        if not m.startswith(ENGINE_MAY_IMPORT)
    }
    assert not outside, "engine/ reaches out:\n" + "\n".join(sorted(outside))


def test_no_source_file_over_400_lines() -> None:
    sources = [
        *MODULES.values(),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "scripts").rglob("*.py"),
    ]
    sources += list((ROOT / "native").rglob("*.[ch]*"))
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize(
    "module", ["lmd.config", "lmd.supervisor.supervisor", "lmd.api.worker", "lmd_client.lmdctl"]
)
def test_processes_without_a_model_import_no_torch(module: str) -> None:
    """The supervisor, the api and lmdctl never load torch (~2 s and ~300 MB a process;
    a config constant once pulled it into every one of them)."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
