"""A regular (not editable) install puts one import package, `stagewise`, into site-packages.

A user project with its own `app` (or `planner`) package must neither shadow ours nor be
shadowed by it: the wheel's names are `stagewise.app`, `stagewise.planner`, ...
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`pip install . --target` (no dependencies: this python already has them) -> the target folder."""
    import importlib.util

    # --no-build-isolation builds with this python's setuptools, which needs its own bdist_wheel (setuptools
    # >= 70.1) or the `wheel` package; a CUDA machine's python as it is (make test-gpu) may have neither offline
    if importlib.util.find_spec("setuptools") is None or (importlib.util.find_spec("setuptools.command.bdist_wheel") is None
                                                          and importlib.util.find_spec("wheel") is None):
        pytest.skip("this python cannot build a wheel offline (no setuptools >= 70.1 and no `wheel` package); "
                    "make test installs them in its venv")
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(build)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return target


def test_the_wheel_installs_one_top_level_package(installed):
    top = sorted(p.name for p in installed.iterdir() if not p.name.endswith((".dist-info", ".egg-info")) and p.name != "bin")
    assert top == ["stagewise"]
    for sub in ("planner", "executor", "executor/strategies", "app", "app/views", "sample_models"):
        assert (installed / "stagewise" / sub / "__init__.py").exists() or any((installed / "stagewise" / sub).glob("*.py")), sub
    assert (installed / "stagewise" / "app" / ".streamlit" / "config.toml").exists()


def test_a_project_with_its_own_app_package_keeps_it_and_ours(installed, tmp_path):
    project = tmp_path / "project"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text("WHOSE = 'the user project'\n")
    (project / "planner").mkdir()
    (project / "planner" / "__init__.py").write_text("WHOSE = 'the user project'\n")
    script = textwrap.dedent(f"""
        import app, planner as user_planner
        assert app.WHOSE == user_planner.WHOSE == 'the user project', app.__file__
        from stagewise import planner, executor
        from stagewise.app import cli
        assert planner.__file__.startswith({str(installed)!r}), planner.__file__
        src = planner.load_model_file({str(ROOT / 'sample_models' / 'mlp.py')!r})
        plan = planner.propose(planner.trace(src.model, src.example_inputs), n_members=2)
        report = executor.verify(plan, src.members(2), executor.batched_inputs(plan, src.example_inputs))
        assert report.ok, report.to_text()
        print('ok')
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(project), str(installed)])  # the project first, as running from it would
    done = subprocess.run([sys.executable, "-c", script], cwd=project, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    cli_run = subprocess.run([sys.executable, "-m", "stagewise.app.cli", "plan", str(ROOT / "sample_models" / "mlp.py"), "-n", "2"],
                             cwd=project, capture_output=True, text=True, timeout=300, env=env)
    assert cli_run.returncode == 0, cli_run.stderr[-3000:]
    assert "s0" in cli_run.stdout
