"""Compare plans: the current plan against the proposed one, an earlier edit, or an uploaded plan file.

`diff_ui` draws an expander with the choice, planner.diff_plans' summary and stage table, and the
graph twice (before | after) coloured by what changed. `diff_figure` and `diff_table` are the
compute side (no streamlit); the UI holds only plans, the diff and plain graph data.
"""
from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from stagewise.app import graph_view as gv
from stagewise.app.history import History
from stagewise.app.figure import FigureOptions, build_figure
from stagewise.planner.diff import PlanDiff, diff_plans
from stagewise.planner.errors import StagewiseError
from stagewise.planner.plan import Plan

DIFF_WIDTH_PX = 480  # each side gets half the page
UPLOAD = "upload"  # the choice "a plan file" in the baseline select box

def diff_table(diff: PlanDiff) -> pd.DataFrame:
    """diff.rows() with times as text ("" when neither plan measured a group, "not measured" for one side)."""
    rows = diff.rows()
    for r in rows:
        for key in ("before ms", "after ms"):
            ms = r[key]
            r[key] = f"{ms:.3g}" if ms is not None else ("not measured" if diff.measured else "")
    return pd.DataFrame(rows, columns=["change", "before", "after", "nodes", "runs as before", "runs as after",
                                       "before ms", "after ms", "details"])


def changed_nodes(diff: PlanDiff) -> frozenset[str]:
    """fx nodes whose stage was merged, split, regrouped or runs another way."""
    return frozenset(n for n, c in diff.nodes.items() if c.changed)


def diff_figure(data: gv.GraphData, view: gv.ViewGraph, diff: PlanDiff, plan: Plan) -> go.Figure:
    """The Plan page's drawing of `plan` (stage regions and colours of that side), changed nodes outlined in
    orange. Both sides share one layout (it never depends on the plan), so a node sits in the same place twice."""
    return build_figure(data, view, plan, FigureOptions(changed=changed_nodes(diff), width_px=DIFF_WIDTH_PX))


def _baseline_ui(h: History) -> tuple[Optional[Plan], str]:
    """The plan to compare the current one with, and its name; (None, "") when none is chosen yet."""
    labels = h.labels()
    options: list = [i for i in range(len(labels)) if i != h.cursor] + [UPLOAD]
    names = {UPLOAD: "a plan file…"}
    names.update({i: f"step {i}: {labels[i]}" for i in range(len(labels))})  # step 0 is the proposed plan
    choice = st.selectbox("Compare the current plan with", options, format_func=names.get, key="diff_baseline")
    if choice != UPLOAD:
        return h.entries[choice][1], names[choice]
    upload = st.file_uploader("Plan JSON (from `stagewise plan -o` or the Export page)", type=["json"], key="diff_upload")
    if upload is None:
        return None, ""
    try:
        return Plan.loads(upload.getvalue(), source=upload.name), upload.name
    except StagewiseError as e:
        st.error(str(e))
        return None, ""


def diff_ui(h: History, data: gv.GraphData, collapsed: Sequence[str] = (), unfolded: Sequence[str] = ()) -> None:
    """The "Compare plans" expander: the other plan is "before", the current plan "after".

    `collapsed`: module paths to draw as one box each (the Plan page's choice, so big graphs stay small).
    """
    with st.expander("Compare plans"):
        before, name = _baseline_ui(h)
        if before is None:
            return
        try:
            diff = diff_plans(before, h.present)
        except StagewiseError as e:
            st.error(f"{name}: {e}")
            return
        st.markdown(f"**{name} → current plan:** {diff.summary()}")
        st.dataframe(diff_table(diff), hide_index=True, width="stretch", key="diff_table")
        view = gv.collapse(data, collapsed, unfolded)
        left, right = st.columns(2)
        for col, side, plan in ((left, "before", before), (right, "after", h.present)):
            with col:
                st.caption(f"{side}: {name if side == 'before' else 'current plan'}")
                st.plotly_chart(diff_figure(data, view, diff, plan), key=f"diff_graph_{side}",
                                config={"displaylogo": False, "scrollZoom": False})
        st.caption("Each side is drawn as the Plan page draws it (stage regions and colours of that plan); "
                   "an orange outline = the node's stage was merged, split, regrouped or runs another way.")
