"""`stagewise profile`: the table, the tuned plan written with its report inside, and its errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagewise import executor
from stagewise import planner
from stagewise.app.cli import main

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "sample_models/mlp.py")


@pytest.fixture
def mlp_plan(tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", MLP, "-n", "4", "-o", str(path)]) == 0
    return path


def test_profile_prints_stages_and_baselines(mlp_plan, capsys):
    assert main(["profile", str(mlp_plan), MLP, "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "s0" in out and "loop (eager)" in out and "whole vmap" in out


def test_profile_autotune_writes_the_tuned_plan_with_the_report_inside(mlp_plan, tmp_path, capsys):
    tuned = tmp_path / "tuned.json"
    assert main(["profile", str(mlp_plan), MLP, "--autotune", "--repeats", "3", "-o", str(tuned)]) == 0
    plan = planner.Plan.load(tuned)
    assert plan.profile is not None and "plan" not in plan.profile  # the report, not the plan nested in itself
    assert plan.profile["n_members"] == 4
    chosen = plan.stage("s0").options
    assert chosen.note  # the measured times behind the choice
    src = planner.load_source(MLP)
    members = src.members(4)
    assert executor.verify(plan, members, src.example_inputs).ok  # the tuned plan still matches the loop
    assert json.loads(tuned.read_text())["schema_version"] == planner.SCHEMA_VERSION


def test_profile_on_cuda_without_cuda_is_one_line_exit_2(mlp_plan, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["profile", str(mlp_plan), MLP, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


def test_profile_train_prints_a_training_profile(mlp_plan, capsys):
    assert main(["profile", str(mlp_plan), MLP, "--train", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("training profile (adam step)")
    assert "loop: N torch.optim" in out and "torch.func + foreach opt" in out and "stagewise + stacked opt" in out


@pytest.mark.parametrize("budget", ["quick", "thorough"])
def test_profile_autotune_budget_is_passed_on(mlp_plan, tmp_path, budget):
    tuned = tmp_path / "tuned.json"
    assert main(["profile", str(mlp_plan), MLP, "--autotune", "--budget", budget, "--repeats", "3", "-o", str(tuned)]) == 0
    cands = [c for s in planner.Plan.load(tuned).profile["stages"] for c in s.get("candidates", [])]
    compiled = [c for c in cands if c["strategy"] == "compile"]
    assert cands and compiled
    skipped = all("budget skips torch.compile" in (c.get("error") or "") for c in compiled)
    assert skipped == (budget == "quick")  # quick skips torch.compile, thorough times it


def test_profile_budget_must_be_a_known_one(mlp_plan, capsys):
    with pytest.raises(SystemExit):
        main(["profile", str(mlp_plan), MLP, "--autotune", "--budget", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
