"""Compare plans: the current plan against the proposed one, an earlier edit, or an uploaded plan file.

`diff_ui` draws an expander with the choice, planner.diff_plans' summary and stage table, and the
graph twice (before | after) coloured by what changed. `diff_figure` and `diff_table` are the
compute side (no streamlit); the UI holds only plans, the diff and plain graph data.
"""
from __future__ import annotations

import functools
from typing import Mapping, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from stagewise.app import graph_view as gv
from stagewise.app.history import History
from stagewise.app.layout import layered_layout
from stagewise.planner.diff import ChangeKind, PlanDiff, diff_plans
from stagewise.planner.errors import StagewiseError
from stagewise.planner.plan import Plan

UNCHANGED = "#b0b0b0"  # grey: the node's stage is the same in both plans
CHANGED = "#ff7f0e"  # orange: its stage was merged, split, regrouped or runs another way
UPLOAD = "upload"  # the choice "a plan file" in the baseline select box

Pos = Mapping[str, tuple[float, float]]


def diff_table(diff: PlanDiff) -> pd.DataFrame:
    """diff.rows() with times as text ("" when neither plan measured a group, "not measured" for one side)."""
    rows = diff.rows()
    for r in rows:
        for key in ("before ms", "after ms"):
            ms = r[key]
            r[key] = f"{ms:.3g}" if ms is not None else ("not measured" if diff.measured else "")
    return pd.DataFrame(rows, columns=["change", "before", "after", "nodes", "runs as before", "runs as after",
                                       "before ms", "after ms", "details"])


def _node_class(diff: PlanDiff, names: tuple[str, ...], starts: set[str]) -> str:
    """'changed start', 'changed', 'unchanged' or 'io' for one drawn node (a collapsed module: any of its nodes)."""
    found = [diff.nodes[n] for n in names if n in diff.nodes]
    if not found:
        return "io"
    if not any(c.changed for c in found):
        return "unchanged"
    return "changed start" if any(n in starts for n in names) else "changed"


CLASSES = {  # class -> (legend name, marker)
    "unchanged": ("unchanged", dict(color=UNCHANGED, symbol="circle")),
    "changed": ("changed", dict(color=CHANGED, symbol="circle")),
    "changed start": ("first node of a changed stage",
                      dict(color=CHANGED, symbol="diamond", line=dict(width=2, color="#000000"))),
    "io": ("inputs / outputs", dict(color=gv.IO_COLOR, symbol="circle")),
}


def diff_figure(data: gv.GraphData, view: gv.ViewGraph, pos: Pos, diff: PlanDiff, plan: Plan, side: str) -> go.Figure:
    """The graph with nodes grey (unchanged) or orange (changed), the first node of each changed stage of
    `plan` (the diff's "before" or "after" side, named by `side`) a black-ringed diamond; hover names both stages."""
    changed_stages = {sid for c in diff.stages if c.kind is not ChangeKind.SAME
                      for sid in (c.before if side == "before" else c.after)}
    starts = {s.nodes[0] for s in plan.stages if s.id in changed_stages}
    runs = {s.id: s.runs_as() for s in plan.stages}
    groups: dict[str, list[str]] = {}
    for vid in view.ids:
        groups.setdefault(_node_class(diff, view.members[vid], starts), []).append(vid)
    ex: list[Optional[float]] = []
    ey: list[Optional[float]] = []
    for u, v in view.edges:
        ex += [pos[u][0], pos[v][0], None]
        ey += [pos[u][1], pos[v][1], None]
    traces = [go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#cccccc", width=1), hoverinfo="skip", showlegend=False)]
    for cls, (name, marker) in CLASSES.items():
        vids = groups.get(cls, [])
        if vids:
            traces.append(go.Scatter(
                x=[pos[v][0] for v in vids], y=[pos[v][1] for v in vids], mode="markers", name=name,
                customdata=vids, hovertext=[_hover(diff, view.members[v], v, runs, side) for v in vids], hoverinfo="text",
                marker={"size": 12, "line": dict(width=1, color="#ffffff"), **marker},
            ))
    fig = go.Figure(traces)
    n_layers = len({round(p[1], 6) for p in pos.values()}) or 1
    fig.update_layout(height=max(360, min(4000, 30 * n_layers + 80)), margin=dict(l=10, r=10, t=30, b=10),
                      plot_bgcolor="#ffffff", hovermode="closest", xaxis=dict(visible=False), yaxis=dict(visible=False),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0.0), uirevision=data.fingerprint)
    return fig


def _hover(diff: PlanDiff, names: tuple[str, ...], vid: str, runs: Mapping[str, str], side: str) -> str:
    """'name: before s1 → after s0 (batched (vmap))' for one drawn node."""
    c = next((diff.nodes[n] for n in names if n in diff.nodes), None)
    if c is None:
        return f"{vid}: input / output"
    here = c.before if side == "before" else c.after
    return f"{vid}: before {c.before or '-'} → after {c.after or '-'}" + (f" ({runs[here]})" if here in runs else "")


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


@functools.lru_cache(maxsize=16)
def _positions(ids: tuple[str, ...], edges: tuple[tuple[str, str], ...]) -> Pos:
    """Layered positions of a drawn graph (inputs on top), computed once per view."""
    return layered_layout(ids, edges)


def diff_ui(h: History, data: gv.GraphData, collapsed: Sequence[str] = ()) -> None:
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
        view = gv.collapse(data, collapsed)
        pos = _positions(view.ids, view.edges)
        left, right = st.columns(2)
        for col, side, plan in ((left, "before", before), (right, "after", h.present)):
            with col:
                st.caption(f"{side}: {name if side == 'before' else 'current plan'}")
                st.plotly_chart(diff_figure(data, view, pos, diff, plan, side), key=f"diff_graph_{side}",
                                config={"displaylogo": False})
        st.caption("Grey = the node's stage is the same in both plans; orange = its stage was merged, split, regrouped "
                   "or runs another way; black-ringed diamond = where a changed stage begins on that side.")
