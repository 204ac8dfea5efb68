"""AppTest of the "Compare plans" expander (app/diff_view.py) on transformer_block, and its figure and table.

The script opens the sample, proposes a plan and merges s1+s2 (history: proposed, merge), then draws diff_ui.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from streamlit.testing.v1 import AppTest

from stagewise import planner
from stagewise.app import diff_view
from stagewise.app import graph_view as gv
from app_fakes import APP_TIMEOUT, residual_graph, residual_plan


def _script() -> None:
    import streamlit as st

    from stagewise import planner
    from stagewise.app import state
    from stagewise.app.diff_view import diff_ui
    from stagewise.app.history import History

    loaded = state.loaded(state.ModelRef(str(state.SAMPLES_DIR / "transformer_block.py")))
    if "h" not in st.session_state:
        proposed = planner.propose(loaded.graph, 4)
        st.session_state.h = History.start(proposed)
        st.session_state.h.push("merge s1+s2", planner.merge(proposed, loaded.graph, "s1", "s2"))
    diff_ui(st.session_state.h, loaded.data, [])


@pytest.fixture
def at(tmp_path, monkeypatch) -> AppTest:
    monkeypatch.chdir(tmp_path)
    app = AppTest.from_function(_script, default_timeout=APP_TIMEOUT)
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    return app


def test_compares_with_the_proposed_plan_by_default(at):
    assert at.expander[0].label == "Compare plans"
    assert at.selectbox(key="diff_baseline").value == 0
    text = "\n".join(m.value for m in at.markdown)
    assert "**step 0: proposed → current plan:**" in text
    assert "s1 and s2 merged into s1; 9 nodes now excluded from vmap (were batched); 1 stage unchanged." in text
    table = at.dataframe[0].value
    assert list(table["change"]) == ["same", "merged"] and list(table["before"]) == ["s0", "s1, s2"]
    charts = at.get("plotly_chart")
    assert len(charts) == 2
    before, after = (json.loads(c.proto.spec) for c in charts)
    names = {t.get("name") for t in after["data"]}
    assert "changed" in names and "s1 · member loop · 10 nodes" in names  # the merged stage, outlined as changed
    assert "s2 · batched (vmap) · 9 nodes" in {t.get("name") for t in before["data"]} and "s2" not in str(names)


def test_an_edit_since_adds_a_step_to_compare_with(at):
    h = at.session_state["h"]
    p = h.present
    h.push("wide s0", p.with_stages([replace(p.stages[0], options=planner.StageOptions(strategy=planner.Strategy.WIDE)),
                                     *p.stages[1:]]))
    at.run()
    assert not at.exception
    box = at.selectbox(key="diff_baseline")
    assert box.options == ["step 0: proposed", "step 1: merge s1+s2", "a plan file…"] and box.value == 0
    assert "s0 now runs wide (was vmap); s1 and s2 merged into s1;" in "\n".join(m.value for m in at.markdown)
    box.set_value(1).run()
    assert "**step 1: merge s1+s2 → current plan:** s0 now runs wide (was vmap); 1 stage unchanged." in \
        "\n".join(m.value for m in at.markdown)


def test_an_uploaded_plan_file_is_compared_and_one_of_another_model_refused(at, sample):
    at.selectbox(key="diff_baseline").set_value("upload").run()
    assert not any("→ current plan" in m.value for m in at.markdown)  # nothing to compare until a file comes
    _, mlp = sample("mlp")
    at.file_uploader(key="diff_upload").upload("mlp.json", planner.propose(mlp, 4).dumps().encode(), "application/json").run()
    assert not at.exception
    assert "mlp.json: cannot diff plans of different models" in at.error[0].value and "same model" in at.error[0].value
    _, tb = sample("transformer_block")
    wide = planner.set_options(planner.propose(tb, 4), tb, "s0", strategy="wide")
    at.file_uploader(key="diff_upload").upload("wide.json", wide.dumps().encode(), "application/json").run()
    assert not at.exception and not at.error
    text = "\n".join(m.value for m in at.markdown)
    assert "**wide.json → current plan:** s0 now runs vmap (was wide); s1 and s2 merged into s1;" in text


def test_figure_outlines_changed_nodes_on_the_shared_layout():
    data = gv.graph_data(residual_graph())
    plan = residual_plan()
    merged = plan.with_stages([plan.stages[0], planner.Stage("s1", plan.stages[1].nodes + plan.stages[2].nodes,
                                                             planner.StageMode.EXCLUDED, reason="r")])
    diff = planner.diff_plans(plan, merged)
    view = gv.collapse(data)
    assert diff_view.changed_nodes(diff) == frozenset(merged.stages[1].nodes)
    before, after = diff_view.diff_figure(data, view, diff, plan), diff_view.diff_figure(data, view, diff, merged)
    by_name = {t.name: t for t in after.data}
    changed = by_name["changed"]
    assert sum(1 for v in changed.x if v is None) == len(merged.stages[1].nodes)  # one outline per changed box
    assert "s1 · member loop · 2 nodes" in by_name and "s2 · batched (vmap) · 1 node" in {t.name for t in before.data}
    # the same layout on both sides: every label sits in the same place
    lb, la = (next(t for t in f.data if t.name == "labels") for f in (before, after))
    assert list(lb.x) == list(la.x) and list(lb.y) == list(la.y)
    table = diff_view.diff_table(diff)
    assert list(table["change"]) == ["same", "merged"] and list(table["after ms"]) == ["", ""]
