"""Import direction: app -> executor -> planner, never back; only app/ imports streamlit.

Every import statement is read with `ast` (including imports inside functions),
so a lazy `import app...` inside a planner function is caught too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGES = ("planner", "executor", "app")
FORBIDDEN = {  # package -> top-level modules it must never import
    "planner": {"executor", "app", "streamlit"},
    "executor": {"app", "streamlit"},
}
CORE_TYPES = {  # modules that import nothing of ours but the listed ones
    "planner/errors.py": set(),
    "planner/plan.py": {"planner.errors", "planner.files"},
    "planner/files.py": set(),
}


def python_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in the file; relative imports are resolved against the package.

    Our modules are named as the repository lays them out (`planner.graph`): the installed
    `stagewise.` prefix is dropped, so `from stagewise.executor import build` reads `executor`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            if node.module is None or node.level or node.module == "stagewise":  # `from . import x`: x may be a module
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return [(line, _ours(m)) for line, m in found]


def _ours(module: str) -> str:
    if module == "stagewise":
        return ""
    return module.removeprefix("stagewise.")


def test_the_packages_exist():
    for package in PACKAGES:
        assert python_files(package), f"{package}/ has no Python files"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(package):
    bad = []
    for path in python_files(package):
        for line, module in imported_modules(path):
            if module.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "layering violated (app -> executor -> planner, streamlit only in app/):\n" + "\n".join(bad)


def test_streamlit_only_in_app():
    outside = [p for p in ROOT.rglob("*.py")
               if p.relative_to(ROOT).parts[0] not in ("app", "tests", ".venv", "build", "dist")
               and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    assert any(p.relative_to(ROOT).parts[0] == "planner" for p in outside)
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in outside for line, m in imported_modules(p) if m.split(".")[0] == "streamlit"]
    assert not bad, f"streamlit imported outside app/: {bad}"


@pytest.mark.parametrize("rel", sorted(CORE_TYPES))
def test_core_types_import_nothing_of_ours(rel):
    ours = {m for _, m in imported_modules(ROOT / rel) if m.split(".")[0] in PACKAGES}
    assert ours <= CORE_TYPES[rel], f"{rel} imports {sorted(ours - CORE_TYPES[rel])}"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The parser must catch the imports the layering test relies on."""
    pkg = tmp_path / "planner"
    pkg.mkdir()
    f = pkg / "x.py"
    f.write_text("def f():\n    import app.cli\n    from executor import build\n    from . import graph\n    from .plan import Plan\n"
                 "    from stagewise import app\n    from stagewise.executor.build import build\n")
    mods = {m for _, m in imported_modules(f, root=tmp_path)}
    assert {"app.cli", "executor", "planner", "planner.graph", "planner.plan"} <= mods
