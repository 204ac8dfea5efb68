"""Selection-driven edits (app.actions) on a real traced sample: random sequences keep the plan valid."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from stagewise import planner
from stagewise.app import actions
from stagewise.app.history import History
from stagewise.planner.errors import EditError, StagewiseError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def traced():
    src = planner.load_source(ROOT / "sample_models" / "transformer_block.py")
    graph = planner.trace(src.model, src.example_inputs)
    return graph, planner.propose(graph, 4)


def test_merge_folds_several_stages_in_order(traced):
    graph, plan = traced
    label, new = actions.merge_selected(plan, graph, ["s2", "ln1", "s1"])
    assert label == "merge s0+s1+s2" and len(new.stages) == 1


def test_merge_needs_two_stages_and_split_one_stage(traced):
    graph, plan = traced
    with pytest.raises(EditError, match="two or more stages"):
        actions.merge_selected(plan, graph, ["q", "k", "x"])  # one stage; the input x is in none
    with pytest.raises(EditError, match="inside one stage"):
        actions.split_selected(plan, graph, ["q", "proj"])
    with pytest.raises(EditError, match="needs a node"):
        actions.split_selected(plan, graph, ["s0"])


def test_split_carves_out_several_nodes(traced):
    graph, plan = traced
    label, new = actions.split_selected(plan, graph, ["transpose_3", "reshape"])
    assert "carving out 2 nodes" in label
    assert new.stage_of("reshape").nodes == ("transpose_3", "reshape") and len(new.stages) == 4


EDITS = ["merge", "split", "exclude", "exclude_nodes", "include", "strategy"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(EDITS), st.lists(st.integers(0, 40), min_size=1, max_size=3)),
                min_size=1, max_size=8))
def test_random_edit_sequences_keep_plans_valid_and_undoable(traced, steps):
    graph, plan = traced
    nodes = graph.compute_nodes
    history = History.start(plan)
    for kind, picks in steps:
        current = history.present
        ids = [s.id for s in current.stages]
        selection = [(ids + nodes)[i % (len(ids) + len(nodes))] for i in picks]
        try:
            if kind == "merge":
                label, new = actions.merge_selected(current, graph, selection)
            elif kind == "split":
                label, new = actions.split_selected(current, graph, selection)
            elif kind in ("exclude", "exclude_nodes"):
                label, new = actions.exclude_selected(current, graph, selection, whole_stages=kind == "exclude")
            elif kind == "include":
                label, new = actions.include_selected(current, graph, selection)
            else:
                label, new = actions.set_options_selected(current, graph, selection, "vmap", 2)
        except StagewiseError:
            assert history.present is current  # a refused edit changes nothing
            continue
        planner.validate(new, graph)
        history.push(label, new)
    while history.can_undo:
        history.undo()
    assert history.present == plan


def test_excluding_several_nodes_of_a_stage_carves_them_out_together(traced):
    graph, plan = traced
    label, new = actions.exclude_selected(plan, graph, ["transpose_3", "reshape"], whole_stages=False)
    assert new.stage_of("reshape").nodes == ("transpose_3", "reshape")
    assert new.stage_of("reshape").mode.value == "excluded" and len(new.stages) == 4
    assert actions.edit_warnings("exclude", plan, new) == []


def test_merging_a_batched_stage_with_an_excluded_one_warns_with_the_count(traced):
    graph, plan = traced
    _, new = actions.merge_selected(plan, graph, ["s0", "s1"])
    (warning,) = actions.edit_warnings("merge", plan, new)
    # s1, the attention, starts as wide (batched, not under vmap): its node is one of those the merge makes a loop
    assert plan.stage("s1").runs_batched
    assert f"turns {len(plan.stage('s0').nodes) + 1} batched nodes into a member loop" in warning
    assert actions.alternative("merge", plan, graph, ["s0", "s1"]) is None  # one batched stage: nothing gentler
    # s0 + s2 without s1 between them would be a cycle: no gentler merge to offer
    assert actions.alternative("merge", plan, graph, ["s0", "s1", "s2"]) is None


def test_fragmenting_edit_warns_and_offers_whole_stages(traced):
    graph, plan = traced
    nodes = [n for n in plan.stage("s0").nodes[1::2]]  # every other node: no convex group, carved one by one
    _, new = actions.exclude_selected(plan, graph, nodes, whole_stages=False)
    warnings = actions.edit_warnings("exclude", plan, new)
    assert len(new.stages) - len(plan.stages) > actions.FRAGMENT_LIMIT
    assert any(f"turns 3 stages into {len(new.stages)}" in w for w in warnings)
    label, (_, alt) = actions.alternative("exclude", plan, graph, nodes)
    assert label == "Exclude the whole stages instead" and len(alt.stages) == 3
