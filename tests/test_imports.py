"""The import graph: no cycles anywhere, and DESIGN.md's one-way rule.

`trainer -> gateway, envs, sandbox`; `envs` and `sandbox` import nothing of `trainer`;
`gateway` imports nothing of `trainer`, `envs` or `sandbox`. The graph is read from the source
with `ast`: every import statement, also inside functions (they run later, but a module that
imports its own dependents in a function is still a cycle in the code). A registry's lazy
`"module:attr"` entry points count for the one-way rule (a gateway registry must not name a
trainer module) but not as cycles: pointing from a part's registry to the kinds that import the
part's Protocol is what a registry is for, resolved when a kind is built, after both are loaded.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "envs", "sandbox", "trainer")
FORBIDDEN = {
    "gateway": {"trainer", "envs", "sandbox"},
    "envs": {"trainer"},
    "sandbox": {"trainer"},
    "trainer": set(),
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _target(name: str) -> str | None:
    """The module of ours that importing `name` loads last (a.b.c -> a.b.c, or a.b if c is an
    attribute), or None for third-party modules."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, *, runtime_only: bool, entry_points: bool = True) -> set[str]:
    """Modules of ours that `module` imports (`runtime_only`: not under `if TYPE_CHECKING`;
    `entry_points`: with the modules its registry entry points name)."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    base = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and runtime_only and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                origin = f"{anchor}.{origin}" if origin else anchor
            names = [f"{origin}.{alias.name}" for alias in node.names] or [origin]
        elif (
            entry_points
            and isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "register"
        ):
            # Registry entry points: "module:attr" strings are imports made later.
            names = [
                a.value.partition(":")[0]
                for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and ":" in a.value
            ]
        else:
            names = []
        for name in names:
            target = _target(name)
            if target is not None and target != module:
                found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def test_there_are_modules_to_check():
    assert {"gateway.registry", "trainer.controller", "sandbox.base", "envs.eval"} <= set(MODULES)


def test_no_import_cycles():
    graph = {m: imports(m, runtime_only=True, entry_points=False) for m in MODULES}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []
    cycles: list[list[str]] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_go_one_way():
    leaks = []
    for module in MODULES:
        package = module.partition(".")[0]
        for target in imports(module, runtime_only=False):
            if target.partition(".")[0] in FORBIDDEN[package]:
                leaks.append(f"{module} -> {target}")
    assert not leaks, "DESIGN.md: imports go one way; these go back: " + ", ".join(leaks)


def test_the_checks_see_lazy_imports_and_entry_points():
    """The graph has the edges a regression would add: function-level imports and the
    registries' string entry points."""
    assert "gateway.engines.local" in imports("gateway.engines", runtime_only=True)
    assert "sandbox.docker_backend" in imports("sandbox.base", runtime_only=True)
    assert "trainer.actors" in imports("trainer.weights", runtime_only=True)
    assert "trainer.actors" not in imports("trainer.weights", runtime_only=True, entry_points=False)
    assert "trainer.config" not in imports("trainer.agents", runtime_only=True)
    assert "trainer.config" in imports("trainer.agents", runtime_only=False)


IMPORT_EACH_FIRST = """
import importlib, sys, traceback
ours = {packages!r}
failed = []
for name in {modules!r}:
    for loaded in [m for m in sys.modules if m.partition(".")[0] in ours]:
        del sys.modules[loaded]  # our modules load again, this one first; libraries stay
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ":\\n" + traceback.format_exc(limit=-3))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module imported before any other of ours, as a fresh interpreter would: a cycle that
    breaks only when entered from one side fails here."""
    code = IMPORT_EACH_FIRST.format(packages=PACKAGES, modules=sorted(MODULES))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
