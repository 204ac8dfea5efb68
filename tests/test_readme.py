"""The README's code is run, so the docs cannot drift from the code."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_reuse_example_runs_and_matches(tmp_path):
    """The 'Reusing an exported plan in code' block works on a plan made by the CLI."""
    block = next(b for b in python_blocks() if "Plan.load" in b and "executor.build" in b)
    subprocess.run([sys.executable, "-m", "app.cli", "plan", str(ROOT / "sample_models/mlp.py"), "-n", "4", "-o", str(tmp_path / "plan.json")],
                   check=True, cwd=ROOT, capture_output=True)
    code = block.replace('"sample_models/mlp.py"', repr(str(ROOT / "sample_models/mlp.py")))
    code += "\nassert y.shape == (4, 32, 64), y.shape\nassert executor.verify(plan, members, (x,)).ok\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=_env())
    assert result.returncode == 0, result.stderr
    assert "MATCH" in result.stdout


def test_readme_names_the_two_commands_and_every_cli_command():
    assert "make run" in README and "make test" in README
    for command in ("plan", "run", "show", "profile", "ui"):
        assert f"stagewise {command}" in README


def _env():
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
