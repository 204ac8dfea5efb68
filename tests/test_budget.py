"""The memory budget: N members that cannot fit are refused with the numbers and a fix, before any is built.

Available memory is faked (planner.budget.AVAILABLE), so a moderate N shows what
N=100,000 does on a real machine, in milliseconds.
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from stagewise import executor
from stagewise import planner
from stagewise.app import cli
from stagewise.planner import budget
from stagewise.planner.errors import MemoryBudgetError

from conftest import ROOT

MLP = ROOT / "sample_models" / "mlp.py"


@pytest.fixture
def small_machine(monkeypatch):
    """Every device has `free[device type]` bytes available (default: 1 MiB); returns that dict to adjust."""
    free = {"cpu": 1 << 20, "cuda": 1 << 20}
    monkeypatch.setattr(budget, "AVAILABLE", lambda device: free.get(torch.device(device).type))
    monkeypatch.delenv(budget.SKIP_ENV, raising=False)
    return free


def counting_builds(src: planner.ModelSource) -> list[int]:
    """Record every call of the source's member builder (the refusal must come before any)."""
    calls: list[int] = []
    build = src._build_members
    src._build_members = lambda n: calls.append(n) or build(n)
    return calls


def test_state_bytes_counts_parameters_and_buffers_once():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    expected = (4 * 8 + 8) * 4 + (8 + 8) * 4 + (8 + 8) * 4 + 8  # linear; bn weight, bias; running mean, var; num_batches (int64)
    assert budget.state_bytes(model) == expected
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert budget.state_bytes(tied) == 10 * 4 * 4


def test_members_refused_before_building_any(small_machine):
    src = planner.load_model_file(MLP)
    one = budget.state_bytes(src.model)
    calls = counting_builds(src)
    n = (1 << 20) // one + 50  # just over what fits in 1 MiB
    with pytest.raises(MemoryBudgetError) as info:
        src.members(n)
    msg = str(info.value)
    assert calls == []
    assert "\n" not in msg
    assert f"building {n} members of mlp" in msg and budget.format_bytes(n * one) in msg
    assert "1.0 MiB is available" in msg
    assert f"use at most {int((1 << 20) * budget.USABLE_FRACTION) // one} members" in msg
    assert budget.SKIP_ENV in msg


def test_members_that_fit_are_built(small_machine):
    src = planner.load_model_file(MLP)
    small_machine["cpu"] = 100 * budget.state_bytes(src.model)
    assert len(src.members(80)) == 80  # 80 of the 90 usable
    with pytest.raises(MemoryBudgetError):
        src.members(95)


def test_the_check_can_be_skipped(small_machine, monkeypatch):
    src = planner.load_model_file(MLP)
    n = (1 << 20) // budget.state_bytes(src.model) + 5
    assert len(src.members(n, check_memory=False)) == n
    monkeypatch.setenv(budget.SKIP_ENV, "1")
    assert len(src.members(n)) == n


def test_build_refuses_before_stacking(small_machine, sample, monkeypatch):
    src, graph = sample("mlp")
    one = budget.state_bytes(src.model)
    n = 40
    members = src.members(n, check_memory=False)
    plan = planner.propose(graph, n)
    small_machine["cpu"] = 20 * one
    monkeypatch.setattr(sys.modules["stagewise.executor.build"], "stack_member_state", lambda *a: pytest.fail("stacked despite the refusal"))
    with pytest.raises(MemoryBudgetError, match=r"stacking the state of 40 members .* on cpu .*use at most 18 members.*chunk_size.*another device"):
        executor.build(plan, members)


def test_build_checks_the_target_device(small_machine, sample):
    src, graph = sample("mlp")
    members = src.members(4, check_memory=False)
    small_machine["cpu"] = None  # unknown: not checked
    module = executor.build(planner.propose(graph, 4), members)
    with torch.no_grad():
        assert module(*src.example_inputs).shape[0] == 4
    small_machine["cpu"] = 1
    with pytest.raises(MemoryBudgetError, match="not even one member fits"):
        executor.build(planner.propose(graph, 4), members)
    module = executor.build(planner.propose(graph, 4), members, check_memory=False)
    assert module.n_members == 4


def test_available_memory_of_this_machine():
    cpu = budget.available_bytes("cpu")
    assert cpu is None or cpu > 0
    assert budget.available_bytes("meta") is None


def test_format_bytes():
    assert budget.format_bytes(512) == "512 B"
    assert budget.format_bytes(1536) == "1.5 KiB"
    assert budget.format_bytes(3 * 2**30) == "3.0 GiB"


def test_cli_run_refuses_members_plus_stacked_state_before_building(small_machine, tmp_path, capsys, monkeypatch):
    """On the CPU a run holds the members and their stacked copy at once: N members that fit alone still fail."""
    n = 5000
    one = budget.state_bytes(planner.load_model_file(MLP).model)
    small_machine["cpu"] = int(1.5 * n * one / budget.USABLE_FRACTION)  # room for 1.5 x N x state
    plan_path = tmp_path / "plan.json"
    assert cli.main(["plan", str(MLP), "-n", str(n), "-o", str(plan_path)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(planner.ModelSource, "members", lambda *a, **k: pytest.fail("members built despite the refusal"))
    code = cli.main(["run", str(plan_path), str(MLP)])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"stagewise run: error: building {n} members of mlp and stacking their state needs about "
                               f"{budget.format_bytes(2 * n * one)} on cpu (2 x {n} x "), lines[0]
    assert f"is available; use at most {int(small_machine['cpu'] * budget.USABLE_FRACTION) // (2 * one)} members" in lines[0]


def test_run_on_another_device_checks_both_sides(small_machine):
    one = 1000
    small_machine["cpu"], small_machine["cuda"] = 10**9, 10**5
    budget.check_run(90, one, "cpu", "m")  # 2 x 90 x 1000 fits in 0.9 GB
    with pytest.raises(MemoryBudgetError, match=r"stacking the state of 200 members of m needs about 195.3 KiB on cuda .*use at most 90 members"):
        budget.check_run(200, one, "cuda", "m")
    small_machine["cpu"] = 10**5
    with pytest.raises(MemoryBudgetError, match=r"building 200 members of m needs about .* on cpu"):
        budget.check_run(200, one, "cuda", "m")
