"""The house's shape (issue 15): no import cycle between modules, no private name imported across
stage packages, and the runtime never imports torch, transformers or onnx at module level.

Read from the source with ``ast`` (module-level imports only: an import inside a function runs
when it is called, which is how the CLI keeps heavy stages lazy)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"medusa_export": ROOT / "medusa_export", "medusa_runtime": ROOT / "runtime"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every module-level import of ``module``."""
    tree = ast.parse(path.read_text())
    out = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            names = [a.name for a in node.names]
            # "from .pkg import module" imports a module, not a name
            subs = [n for n in names if f"{target}.{n}" in MODULES]
            out += [(f"{target}.{n}", []) for n in subs]
            out.append((target, [n for n in names if n not in subs]))
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        deps = set()
        for target, _ in _imports(module, path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                deps.add(target)
        graph[module] = deps
    return graph


def _stage(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "medusa_export" and len(parts) > 1 else parts[0]


def test_module_level_imports_have_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, stack: list[str]) -> bool:
        state[m] = 1
        for d in sorted(graph[m]):
            # a package's __init__ importing its own submodules is not a cycle of the design
            if d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                cycle.extend(stack[stack.index(d):] + [m, d] if d in stack else [m, d])
                return True
            if not state.get(d) and visit(d, stack + [m]):
                return True
        state[m] = 2
        return False

    for m in sorted(graph):
        if not state.get(m) and visit(m, []):
            break
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_private_name_imported_across_stage_packages():
    found = []
    for module, path in MODULES.items():
        for target, names in _imports(module, path):
            if target.split(".")[0] not in PACKAGES or _stage(target) == _stage(module):
                continue
            found += [f"{module} imports {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("heavy", ["torch", "transformers", "onnx"])
def test_runtime_never_imports_heavy_packages(heavy):
    found = [m for m, p in MODULES.items() if m.startswith("medusa_runtime")
             for target, _ in _imports(m, p) if target == heavy or target.startswith(heavy + ".")]
    assert not found, f"medusa_runtime modules importing {heavy}: {found}"


@pytest.mark.parametrize("ci, outcome", [("1", "1 failed"), ("", "1 skipped")])
def test_missing_serving_tools_fail_under_ci(tmp_path, ci, outcome):
    """.ci/run sets MEDUSA_EXPORT_CI=1: a test that would skip for want of tritonserver or g++ fails there."""
    import os
    import shutil
    import subprocess
    import sys

    tests = Path(__file__).resolve().parent
    shutil.copy(tests / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_tool.py").write_text("from conftest import skip_or_fail_in_ci\n\n\n"
                                           "def test_needs_a_tool():\n    skip_or_fail_in_ci('no such tool')\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_tool.py")],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "MEDUSA_EXPORT_CI": ci})
    assert outcome in run.stdout, run.stdout + run.stderr
    assert ("MEDUSA_EXPORT_CI=1" in run.stdout) == bool(ci)
