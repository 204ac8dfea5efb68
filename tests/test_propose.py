"""Proposal: maximal convex batched stages, excluded stages with reasons, golden plans.

Golden files: tests/golden/<sample>.json hold `plan.dumps()` of
`planner.propose(graph, n_members=8)`. They are compared exactly and rewritten
only when STAGEWISE_REGEN_GOLDEN=1 is set (then review the diff before committing).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from stagewise import planner
from stagewise.planner import InputMode, PlanMismatchError, StageMode, Strategy
from conftest import SAMPLE_NAMES, check_plan_invariants

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
REGEN = os.environ.get("STAGEWISE_REGEN_GOLDEN") == "1"


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_golden_plan(sample, name):
    _, graph = sample(name)
    text = planner.propose(graph, n_members=8).dumps()
    path = GOLDEN_DIR / f"{name}.json"
    if REGEN:
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing; run with STAGEWISE_REGEN_GOLDEN=1 to write it, then review it"
    assert text == path.read_text(), (
        f"the proposed plan for {name} differs from {path}; if the change is intended, "
        "regenerate with STAGEWISE_REGEN_GOLDEN=1 and review the diff"
    )


def test_golden_files_match_samples():
    assert sorted(p.stem for p in GOLDEN_DIR.glob("*.json")) == SAMPLE_NAMES


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_proposal_invariants(sample, name):
    _, graph = sample(name)
    plan = planner.propose(graph, n_members=8)
    check_plan_invariants(plan, graph)
    assert planner.validate(plan, graph) is plan
    assert plan.fingerprint == graph.fingerprint and plan.tracer == graph.tracer and plan.n_members == 8
    assert [i.name for i in plan.inputs] == graph.input_names


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_excluded_stages_are_single_unbatchable_nodes(sample, name):
    _, graph = sample(name)
    plan = planner.propose(graph, n_members=2)
    unbatchable = planner.unbatchable(graph)
    excluded = {s.nodes[0]: s.reason for s in plan.stages if s.mode is StageMode.EXCLUDED and len(s.nodes) == 1}
    assert all(s.mode is StageMode.BATCHED or len(s.nodes) == 1 for s in plan.stages)
    assert excluded == unbatchable


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_batched_stages_are_maximal(sample, name):
    """No two batched stages of a proposal can be merged (something unbatchable lies between)."""
    _, graph = sample(name)
    plan = planner.propose(graph, n_members=2)
    batched = [s.id for s in plan.stages if s.mode is StageMode.BATCHED]
    for i, a in enumerate(batched):
        for b in batched[i + 1:]:
            with pytest.raises(planner.EditError):
                planner.merge(plan, graph, a, b)


EXPECTED_SHAPE = {  # sample -> modes of the proposed stages
    "mlp": ["batched"],
    "deep_mlp": ["batched"],
    "resblock": ["batched"],
    "moe": ["batched"],
    "cnn": ["batched"],
    "shape_loop": ["batched"],
    "gru": ["excluded", "batched"],
    "transformer_block": ["batched", "excluded", "batched"],
    "data_dependent": ["batched", "excluded", "batched", "excluded", "batched"],
}


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_stage_modes(sample, name):
    _, graph = sample(name)
    assert [s.mode.value for s in planner.propose(graph, 8).stages] == EXPECTED_SHAPE[name]


def test_data_dependent_stages(sample):
    _, graph = sample("data_dependent")
    plan = planner.propose(graph, 8)
    assert [s.nodes for s in plan.stages] == [
        ("fc1", "relu", "abs_1", "max_1"), ("item",), ("add", "truediv", "fc2"), ("sign_branch",), ("fc3",)]


def test_parameter_fetches_join_their_consumers(sample):
    _, graph = sample("shape_loop")
    plan = planner.propose(graph, 2)
    assert len(plan.stages) == 1
    assert {"cell_weight", "cell_bias", "rec_weight"} <= set(plan.stages[0].nodes)


def test_proposal_is_deterministic(sample):
    src, graph = sample("transformer_block")
    again = planner.trace(src.model, src.example_inputs)
    assert planner.propose(graph, 4).dumps() == planner.propose(again, 4).dumps()


def test_input_modes(sample):
    _, graph = sample("mlp")
    assert planner.propose(graph, 2).inputs[0].mode is InputMode.SHARED
    assert planner.propose(graph, 2, input_mode="per_member").inputs[0].mode is InputMode.PER_MEMBER
    assert planner.propose(graph, 2, input_mode=InputMode.PER_MEMBER).inputs[0].mode is InputMode.PER_MEMBER
    assert planner.propose(graph, 2, input_mode={"x": "per_member"}).inputs[0].mode is InputMode.PER_MEMBER
    assert planner.propose(graph, 2, input_mode={}).inputs[0].mode is InputMode.SHARED
    with pytest.raises(PlanMismatchError, match=r"unknown inputs \['y'\].*\['x'\]"):
        planner.propose(graph, 2, input_mode={"y": "shared"})
    with pytest.raises(PlanMismatchError, match="'sometimes' for 'x' is not one of"):
        planner.propose(graph, 2, input_mode="sometimes")


def test_model_label_and_member_count(sample):
    _, graph = sample("mlp")
    plan = planner.propose(graph, 5, model="sample_models/mlp.py")
    assert plan.model == "sample_models/mlp.py" and plan.n_members == 5
    with pytest.raises(planner.StagewiseError, match="n_members"):
        planner.propose(graph, 0)


def test_stage_rows_and_table(sample):
    src, graph = sample("data_dependent")
    plan = planner.propose(graph, 8)
    rows = planner.stage_rows(plan, graph)
    assert [(r["id"], r["mode"], r["strategy"], r["n_nodes"]) for r in rows] == [
        ("s0", "batched", "vmap", 4), ("s1", "excluded", "loop", 1), ("s2", "batched", "vmap", 3),
        ("s3", "excluded", "loop", 1), ("s4", "batched", "vmap", 1)]
    assert sum(r["params"] for r in rows) == sum(p.numel() for p in src.model.parameters())
    assert sum(r["flops"] for r in rows) == sum(graph.dag.nodes[n]["flops"] for n in graph.compute_nodes)
    assert "params" not in planner.stage_rows(plan)[0]  # without a graph: plan data only
    text = planner.format_stage_table(plan, graph)
    lines = text.splitlines()
    assert lines[0] == "5 stages (3 batched, 2 member loops; 2 excluded from vmap), N=8, tracer=fx, inputs: x=shared"
    assert len(lines) == 2 + len(rows)
    assert lines[3].startswith("s1     excluded  member loop") and lines[3].endswith(rows[1]["reason"])
    one = planner.format_stage_table(planner.propose(sample("mlp")[1], 1))
    assert one.startswith("1 stage (1 batched, 0 member loops; 0 excluded from vmap), N=1")


def test_table_shows_an_excluded_stage_that_autotune_runs_wide_as_batched(sample):
    """Excluded from vmap is not the same as a member loop: the table says how the stage runs."""
    _, graph = sample("data_dependent")
    plan = planner.propose(graph, 8)
    merged = plan.with_stages([planner.Stage("s0", tuple(n for s in plan.stages for n in s.nodes), StageMode.EXCLUDED,
                                             reason="data-dependent value", options=planner.StageOptions(strategy=Strategy.WIDE))])
    row = planner.stage_rows(merged)[0]
    assert (row["mode"], row["strategy"], row["runs_as"]) == ("excluded", "wide", "batched (wide)")
    text = planner.format_stage_table(merged)
    assert text.startswith("1 stage (1 batched, 0 member loops; 1 excluded from vmap)")
    assert text.splitlines()[2].startswith("s0     excluded  batched (wide)")


@pytest.mark.parametrize("n, text", [(0, "0"), (999, "999"), (1000, "1.0k"), (16576, "16.6k"), (2_500_000, "2.5M"), (3e9, "3.0G")])
def test_human_numbers(n, text):
    from stagewise.planner.table import human

    assert human(n) == text
