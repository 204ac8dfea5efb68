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
