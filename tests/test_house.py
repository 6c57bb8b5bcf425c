"""The house (ARCHITECTURE.md): who may import whom, read from the code's own imports.

The product (proto, slicer, launcher, dispatcher: the wheel) never imports the test doubles
(stubs), the demo, the benchmarks or the tests, never under the bare top-level names that
collide with PyPI's `slicer` and `proto-plus`, and only its declared dependencies at import
time. No package cycle, no module cycle.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("proto", "slicer", "launcher", "dispatcher")
ROOMS = (*PRODUCT, "stubs", "demo", "bench", "tests", "vllm_tier")
# Which product package may import which: the protocol at the bottom, the daemon's package
# (its client) above it, the launcher and the dispatcher on top.
MAY_IMPORT = {
    "proto": set(),
    "slicer": {"proto"},
    "launcher": {"proto", "slicer"},
    "dispatcher": {"proto", "slicer"},
}
# What the product may import when a module is loaded (pyproject's `dependencies`); optional
# extras (torch, matplotlib, vllm) only inside the function that needs them.
DEPENDENCIES = {
    "trio",
    "psutil",
    "click",
    "pynvml",
    "httpx",
    "starlette",
    "prometheus_client",
    "sniffio",
    "coredis",
}


def _modules(room: str) -> Iterator[tuple[str, Path]]:
    base = ROOT / room
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _room_of(dotted: str) -> str | None:
    """The room a dotted import names (`gpu_slicer.slicer.x` -> slicer), or None (3rd party)."""
    parts = dotted.split(".")
    if parts[0] == "gpu_slicer":
        return parts[1] if len(parts) > 1 and parts[1] in PRODUCT else "gpu_slicer"
    return parts[0] if parts[0] in ROOMS else None


def _imports(path: Path, module: str) -> Iterator[tuple[str, bool]]:
    """(imported module, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top_level = {id(n) for n in tree.body}
    guarded = set()  # `if TYPE_CHECKING:` blocks run no import at run time
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.Try | ast.If):
            top_level.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        level = id(node) in top_level and id(node) not in guarded
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, level
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            yield name, level
            for alias in node.names:  # `from gpu_slicer import proto` names a package
                yield f"{name}.{alias.name}", level


def _canonical(dotted: str) -> str:
    return dotted.removeprefix("gpu_slicer.")


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    known = {m for room in ROOMS for m, _ in _modules(room)}
    edges: dict[str, set[str]] = {}
    for room in ROOMS:
        for module, path in _modules(room):
            out = edges.setdefault(module, set())
            for name, _ in _imports(path, module):
                target = _canonical(name)
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    out.add(target)
    return {m: frozenset(t) for m, t in edges.items()}


def _cycles(edges: dict[str, set[str]] | dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative enough)."""
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("room", PRODUCT)
def test_the_product_imports_only_the_rooms_below_it(room: str) -> None:
    bad = []
    for module, path in _modules(room):
        for name, _ in _imports(path, module):
            target = _room_of(name)
            if name.split(".")[0] in PRODUCT:
                bad.append(f"{module}: `{name}` (bare name: import it as gpu_slicer.{name})")
            elif target not in (None, "gpu_slicer", room) and target not in MAY_IMPORT[room]:
                bad.append(f"{module} imports {name} ({target} is not below {room})")
    assert bad == []


@pytest.mark.parametrize("room", PRODUCT)
def test_the_product_loads_only_its_declared_dependencies(room: str) -> None:
    stdlib = sys.stdlib_module_names
    bad = []
    for module, path in _modules(room):
        for name, level in _imports(path, module):
            top = name.split(".")[0]
            if level and _room_of(name) is None and top not in stdlib | DEPENDENCIES:
                bad.append(f"{module} imports {name} when loaded")
    assert bad == []


def test_no_package_cycle() -> None:
    rooms: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        src = module.split(".")[0]
        rooms.setdefault(src, set()).update(t.split(".")[0] for t in targets)
    for src in rooms:
        rooms[src].discard(src)
    assert _cycles(rooms) == []


def test_no_module_cycle() -> None:
    # A package's __init__ re-exporting its modules is not a cycle of concepts.
    edges = {
        m: {t for t in targets if not m.startswith(t + ".")}
        for m, targets in _graph().items()
        if not m.startswith("tests")
    }
    assert _cycles(edges) == []


def test_the_checker_sees_a_bad_edge(tmp_path: Path) -> None:
    """The checks above would catch a product module importing the stubs or a bare name."""
    f = tmp_path / "x.py"
    f.write_text("from stubs.fakegpu import Ledger\nimport slicer.state\nimport torch\n")
    names = [(n, lvl) for n, lvl in _imports(f, "slicer.x")]
    assert ("stubs.fakegpu", True) in names and ("slicer.state", True) in names
    assert _room_of("stubs.fakegpu") == "stubs" and _room_of("gpu_slicer.proto.codec") == "proto"
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
