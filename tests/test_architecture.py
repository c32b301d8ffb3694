"""The layering of the code (``docs/architecture.md``): no import circles, each package importing
only what lies below it, and every module importable first in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cache", "vision", "speculative", "mmkv")
# The one circle allowed: eviction policies name the radix tree's node in annotations only.
TYPE_ONLY_CIRCLES = [{"cache.eviction", "cache.radix_tree"}]
# What each lower package may import of the others (``mmkv`` may import everything).
MAY_IMPORT = {
    "cache": set(),
    "vision": set(),
    "speculative": {"cache", "mmkv.step_context", "mmkv.attention.metadata", "mmkv.host_arrays",
                    "mmkv.sampler", "mmkv.structured", "mmkv.penalties", "mmkv.models.packed_linear", "mmkv.models",
                    "mmkv.sequence"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere in it: at the top, under ``TYPE_CHECKING``
    and inside functions (``from a import b`` names module ``a.b`` when it is one, else ``a``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                out.add(target if target in known else node.module)
    return out & known


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_circles_finds_a_planted_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert [c for c in circles(graph()) if c not in TYPE_ONLY_CIRCLES] == []


def test_lower_packages_import_only_what_lies_below_them():
    wrong = []
    for module, targets in graph().items():
        allowed = MAY_IMPORT.get(module.split(".")[0])
        if allowed is None:
            continue
        for target in targets:
            top = target.split(".")[0]
            if top != module.split(".")[0] and target not in allowed and top not in allowed:
                wrong.append(f"{module} imports {target}")
    assert wrong == []


LOADED_ON_FIRST_USE = ("open_clip", "timm")  # about 50 MB resident: only an open_clip encoder loads them


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module imported with none of the project's modules loaded before it (torch and the
    other libraries stay loaded between them): a package whose ``__init__`` pulls in a module
    that imports back into a half-initialised one fails here. Two interpreters, half the
    modules each, side by side (one per core). Having imported every module, neither has loaded
    a library of ``LOADED_ON_FIRST_USE``: a process that runs no open_clip encoder never does."""
    names = [n for n in modules() if not n.endswith("__main__")]
    halves = [names[0::2], names[1::2]]
    running = [subprocess.Popen([sys.executable, "-c", _import_each(half)], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for half in halves]
    results = [(process, *process.communicate(timeout=600)) for process in running]
    assert [out + err[-2000:] for process, out, err in results if process.returncode] == []


def _import_each(names: list[str]) -> str:
    """A script importing each of ``names`` with the project's modules unloaded before it."""
    return f"""
import importlib, sys
PACKAGES = {PACKAGES!r}
failed = []
for name in {names!r}:
    for loaded in [m for m in sys.modules if m.split(".")[0] in PACKAGES]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as err:
        failed.append(f"{{name}}: {{type(err).__name__}}: {{err}}")
failed += [f"{{library}} loaded by importing the project" for library in {LOADED_ON_FIRST_USE!r}
           if library in sys.modules]
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""

