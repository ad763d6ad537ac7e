"""The house's shape (issues 15 and 23): no import cycle between modules, no stage package importing
a stage above it, no private name imported across stage packages, and the runtime never imports
torch, transformers or onnx at module level.

Read from the source with ``ast``. The cycle and layering checks read imports at every level: an
import inside a function (how the CLI keeps heavy stages lazy) still ties two modules together, and
four such hidden circles once stood where a module-level check could not see them (issue 23).

The runtime's folders are layers too (issue 38), from the bottom: ``errors`` / ``stops`` -> ``trees`` ->
``contract`` -> ``engines`` -> ``decode`` -> ``tuning`` -> ``front`` -> the package's public API."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"medusa_export": ROOT / "medusa_export", "medusa_runtime": ROOT / "runtime"}


def _modules(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg, folder in packages.items():
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


def _imports(module: str, path: Path, every_level: bool = False,
             modules: dict[str, Path] = MODULES) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every module-level import of ``module``; with ``every_level``
    also the imports inside functions, classes and ``if`` blocks."""
    tree = ast.parse(path.read_text())
    out = []
    for node in (ast.walk(tree) if every_level else tree.body):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            names = [a.name for a in node.names]
            # "from .pkg import module" imports a module, not a name
            subs = [n for n in names if f"{target}.{n}" in modules]
            out += [(f"{target}.{n}", []) for n in subs]
            out.append((target, [n for n in names if n not in subs]))
    return out


def _graph(every_level: bool = True, modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    graph = {}
    for module, path in modules.items():
        deps = set()
        for target, _ in _imports(module, path, every_level, modules):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                deps.add(target)
        graph[module] = deps
    return graph


def _stage(module: str) -> str:
    """A module's stage: ``medusa_export.<stage>`` or ``medusa_runtime.<folder>`` (a root module is its own
    stage; the package itself, ``medusa_runtime``, is the public API above every runtime folder)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


# The stages from the bottom up: a module imports its own stage or stages below it, never one above
# (DESIGN.md's one-way data flow: load -> export -> validate -> engines -> orchestration -> front ends).
# medusa_runtime is the floor: it must run without the exporter installed.
# The runtime's folders follow one decode step: trees and the artifact contract are read, an engine runs the
# step, decode/ proposes, verifies and accepts, tuning/ picks which tree runs, front/ is what a user holds.
LAYERS = {
    "medusa_runtime.errors": 0, "medusa_runtime.stops": 0,
    "medusa_runtime.trees": 1,
    "medusa_runtime.contract": 2,
    "medusa_runtime.engines": 3,
    "medusa_runtime.decode": 4,
    "medusa_runtime.tuning": 5,
    "medusa_runtime.front": 6,
    "medusa_runtime": 7, "medusa_runtime.__main__": 7,
    "medusa_export": 11, "medusa_export.errors": 11, "medusa_export.files": 11, "medusa_export.chat": 11,
    "medusa_export.model": 12,
    "medusa_export.loading": 13,
    "medusa_export.export": 14, "medusa_export.training": 14,
    "medusa_export.validation": 15,
    "medusa_export.trt": 16, "medusa_export.triton": 16,
    "medusa_export.pipeline": 17,
    "medusa_export.cli": 18,
}


def test_every_stage_has_a_layer():
    missing = sorted({_stage(m) for m in MODULES} - set(LAYERS))
    assert not missing, f"stages without a layer in LAYERS (add them where they belong): {missing}"


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import of a stage at the importer's layer or above it."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if _stage(d) != _stage(m) and LAYERS[_stage(d)] >= LAYERS[_stage(m)]
                  and not m.startswith(d + "."))


def test_no_stage_imports_a_stage_above_it():
    found = _upward_imports(_graph(every_level=True))
    assert not found, "upward or sideways imports between stages:\n" + "\n".join(found)


@pytest.mark.parametrize("folder, line", [
    ("trees/tree.py", "from ..decode import loop"),                       # a pure tree helper reaching the loop
    ("engines/ort.py", "    from ..front.session import MedusaSession"),  # inside a function, one floor per level up
    ("contract/manifest.py", "from ..tuning.autotree import auto_tree"),
])
def test_an_upward_import_between_runtime_folders_fails(tmp_path, folder, line):
    """A deliberate upward import, planted in a copy of the runtime, is found (issue 38): the check reads the
    source, not a list of today's imports."""
    import shutil

    copy = tmp_path / "runtime"
    shutil.copytree(PACKAGES["medusa_runtime"], copy)
    assert not _upward_imports(_graph(modules=(clean := _modules({"medusa_runtime": copy}))))
    target = copy / folder
    body = target.read_text()
    if line.startswith(" "):  # plant it inside the module's first function
        head, sep, rest = body.partition("\ndef ")
        name, colon, fn = rest.partition(":\n")
        body = head + sep + name + colon + line + "\n" + fn
    else:
        body += "\n" + line + "\n"
    target.write_text(body)
    found = _upward_imports(_graph(modules=clean))
    importer = "medusa_runtime." + folder[:-3].replace("/", ".")
    assert found and all(f.startswith(importer + " -> ") for f in found), found


def test_imports_at_every_level_have_no_cycle():
    graph = _graph(every_level=True)
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
