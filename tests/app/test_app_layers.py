"""Layering: only the app's page modules import streamlit; the session holds plain data only."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UI_MODULES = {"main.py", "state.py", "plan_page.py", "model_page.py", "profile_page.py", "export_page.py",
              "open_view.py", "diff_view.py"}  # open_view: the leaf-module picker the plan page draws; diff_view: its "Compare plans"
# launch.py starts the streamlit server; it asks streamlit's config which guard options this version
# knows (inside command(), so importing launch, as app.jobs does, still imports no streamlit)
LAUNCHER = {"launch.py"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_compute_modules_do_not_import_streamlit():
    offenders = [p.relative_to(ROOT) for p in sorted((ROOT / "app").glob("*.py"))
                 if p.name not in UI_MODULES | LAUNCHER and "streamlit" in _imports(p)]
    assert offenders == [], "compute modules must stay testable without streamlit"


def test_importing_the_launcher_and_jobs_imports_no_streamlit():
    import subprocess
    import sys

    code = "import sys, app.launch, app.jobs; assert 'streamlit' not in sys.modules, 'streamlit was imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_library_does_not_import_the_app_or_streamlit():
    for pkg in ("planner", "executor"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            bad = _imports(p) & {"streamlit", "app"}
            assert not bad, f"{p.relative_to(ROOT)} imports {bad}: layers go app -> executor -> planner"


def test_session_state_holds_plain_data_only(tmp_path, monkeypatch):
    import networkx as nx
    import torch
    from app_fakes import app_test

    at = app_test(monkeypatch, tmp_path, ROOT / "sample_models" / "transformer_block.py").run()
    at.multiselect(key="selection").set_value(["s1", "s2"]).run()
    next(b for b in at.button if b.label == "Merge").click().run()
    forbidden = (nx.Graph, torch.fx.Node, torch.fx.Graph, torch.nn.Module, torch.Tensor)

    def walk(value, where, depth=0):
        assert not isinstance(value, forbidden), f"session state {where} holds a {type(value).__name__}"
        if depth > 6:
            return
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{where}[{k!r}]", depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]", depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for k, v in vars(value).items():
                walk(v, f"{where}.{k}", depth + 1)

    state = at.session_state.to_dict()
    assert {"history", "model_ref", "selection"} <= set(state)
    for key, value in state.items():
        walk(value, key)
