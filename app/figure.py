"""The Plotly figure of the stage-coloured graph. No streamlit here.

One marker trace per stage (so the legend lists stages), edges as one grey line
trace, and overlay traces for the selection ring and search hits. Every marker
carries its view id in `customdata`: that is what a Plotly selection returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go

from stagewise.app.graph_view import (CANNOT_BATCH, EXCLUDED_FILL, IO_COLOR, LABEL_LIMIT, MODULE_PREFIX, UNMEASURED_FILL, GraphData,
                                      ViewGraph, module_hover, fit_labels, hover_text, stage_colors)
from stagewise.planner.plan import Plan, StageMode
from stagewise.planner.table import plural

LOOP_OUTLINE = "#555555"  # the crossed grey square of a member-loop stage
TIME_SCALE = "Viridis"  # time overlay; not red-yellow: red means "cannot be batched" in this graph

Pos = Mapping[str, tuple[float, float]]
NO_STAGE = "?"  # group of placeholders and the output, which no stage holds


@dataclass(frozen=True)
class FigureOptions:
    selected: frozenset[str] = frozenset()  # fx node names, drawn with a black ring
    highlighted: frozenset[str] = frozenset()  # search hits, drawn with a yellow halo
    stage_times: Mapping[str, float] | None = None  # stage id -> ms of stages measured as they are; colours by time
    # (stages missing from it are drawn open, "not measured"; see profile_view.measured_stage_times)
    height: int | None = None  # pixels; None picks one from the number of layers


@dataclass(frozen=True)
class _Ctx:
    """What every stage trace needs to know about the plan and the view."""

    data: GraphData
    view: ViewGraph
    pos: Pos
    plan: Plan
    stage_of: Mapping[str, str]
    colors: Mapping[str, str]
    labels: Mapping[str, str]  # fitted node labels; empty when labels are off
    dense: bool  # many layers: smaller module boxes

    def order(self, sid: str) -> int:
        return next((i for i, s in enumerate(self.plan.stages) if s.id == sid), 1 << 30)


def _edge_trace(view: ViewGraph, pos: Pos) -> go.Scatter:
    ex: list[float | None] = []
    ey: list[float | None] = []
    for u, v in view.edges:
        (x0, y0), (x1, y1) = pos[u], pos[v]
        ex += [x0, x1, None]
        ey += [y0, y1, None]
    return go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#9a9a9a", width=1), hoverinfo="skip",
                      showlegend=False, name="edges")


def _points(ctx: _Ctx, sid: str, vids: Sequence[str], loop: bool) -> dict[str, list]:
    """Per-marker hover text, label, outline and size; `loop`: the stage runs as a member loop."""
    modes = {s.id: s for s in ctx.plan.stages}
    out: dict[str, list] = {"hover": [], "text": [], "line_w": [], "line_c": [], "size": [], "symbol": []}
    for vid in vids:
        names = ctx.view.members[vid]
        is_module = vid.startswith(MODULE_PREFIX)
        if is_module:
            sids = sorted({ctx.stage_of.get(n, NO_STAGE) for n in names}, key=ctx.order)
            out["hover"].append(module_hover(vid, names, ctx.data, sids))
        else:
            label = f"{sid}, {_how(modes[sid])}" if sid in modes else "none (input/output)"
            out["hover"].append(hover_text(ctx.data.node(vid), label))
        out["text"].append("\u2002" + ctx.labels[vid] if ctx.labels.get(vid) else "")  # en space: clear of the ring
        bad = any(not ctx.data.node(n).batchable for n in names)
        out["line_w"].append(2.5 if bad else 1.5 if loop else 1)
        out["line_c"].append(CANNOT_BATCH if bad else LOOP_OUTLINE if loop else "#ffffff")
        out["size"].append((15 if ctx.dense else 22) if is_module else 14)
        out["symbol"].append("diamond" if sid not in modes else
                             "square-x" if loop else "square" if is_module else "circle")
    return out


def _how(stage) -> str:
    """'batched (vmap)', 'batched (wide), excluded from vmap', 'member loop, excluded: <reason>'."""
    text = stage.runs_as()
    if stage.mode is StageMode.EXCLUDED:
        text += f", excluded from vmap ({stage.reason})" if stage.runs_batched else f", excluded ({stage.reason})"
    return text


def _stage_trace(ctx: _Ctx, sid: str, vids: Sequence[str], times: Mapping[str, float] | None,
                 show_scale: bool) -> go.Scatter:
    stage = next((s for s in ctx.plan.stages if s.id == sid), None)
    loop = stage is not None and not stage.runs_batched
    pts = _points(ctx, sid, vids, loop)
    if stage is None:
        marker: dict[str, Any] = dict(color=IO_COLOR)
        name = "inputs / outputs"
    elif times is not None and times.get(sid) is not None:
        t = times[sid]
        marker = dict(color=[t] * len(vids), colorscale=TIME_SCALE, cmin=0,
                      cmax=max(list(times.values()) + [1e-9]), showscale=show_scale,
                      colorbar=dict(title="stage ms", thickness=14, len=0.6, x=1.0, xanchor="left"))
        name = f"{sid}: {t:.3g} ms"
    elif times is not None:  # open grey marker: no colour on the time scale, so it cannot read as fast
        marker = dict(color=UNMEASURED_FILL)
        pts["line_c"] = [CANNOT_BATCH if c == CANNOT_BATCH else "#888888" for c in pts["line_c"]]
        pts["line_w"] = [max(w, 1.5) for w in pts["line_w"]]
        name = f"{sid}: not measured"
    else:
        marker = dict(color=EXCLUDED_FILL if loop else ctx.colors[sid])
        name = f"{sid} · {stage.runs_as()} · {plural(len(stage.nodes), 'node')}"
    marker.update(size=pts["size"], symbol=pts["symbol"], line=dict(width=pts["line_w"], color=pts["line_c"]))
    return go.Scatter(
        x=[ctx.pos[v][0] for v in vids], y=[ctx.pos[v][1] for v in vids],
        mode="markers+text" if ctx.labels else "markers", name=name, legendgroup=sid,
        customdata=list(vids), hovertext=pts["hover"], hoverinfo="text", text=pts["text"] if ctx.labels else None,
        textposition="middle right", textfont=dict(size=11, color="#333333"), marker=marker,
    )


def _overlay(view: ViewGraph, pos: Pos, nodes: frozenset[str], name: str, marker: dict) -> go.Scatter | None:
    vids = [v for v in view.ids if any(n in nodes for n in view.members[v])]
    if not vids:
        return None
    return go.Scatter(x=[pos[v][0] for v in vids], y=[pos[v][1] for v in vids], mode="markers", name=name,
                      customdata=vids, hoverinfo="skip", showlegend=name != "selected", marker=marker)


def _layout(fig: go.Figure, data: GraphData, view: ViewGraph, pos: Pos, labels: bool, height: int | None) -> None:
    n_layers = len({round(p[1], 6) for p in pos.values()}) or 1
    xs = [p[0] for p in pos.values()] or [0.0]
    ys = [p[1] for p in pos.values()] or [0.0]
    longest = max((len(t) for t in view.ids), default=4) if labels else 0
    # ~44 px per layer for small graphs; long chains get a tall figure (the page scrolls) at 24 px per layer
    per_layer = 44 if n_layers <= 30 else 24
    fig.update_layout(
        height=height or max(420, min(9000, per_layer * n_layers + 80)), margin=dict(l=10, r=40, t=40, b=10),
        hovermode="closest", plot_bgcolor="#ffffff", uirevision=data.fingerprint,
        modebar=dict(orientation="v"),  # on the right edge, clear of the legend on top
        hoverlabel=dict(bgcolor="#ffffff", bordercolor="#444444", font=dict(color="#111111", size=12)),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0.0, itemclick=False, itemdoubleclick=False),
        # labels sit right of the markers: leave room for the longest one
        xaxis=dict(visible=False, range=[min(xs) - 0.8, max(xs) + 0.8 + 0.12 * longest]),
        yaxis=dict(visible=False, range=[min(ys) - 0.6, 0.6]),
    )


def build_figure(data: GraphData, view: ViewGraph, pos: Pos, plan: Plan,
                 opts: FigureOptions = FigureOptions()) -> go.Figure:
    """The graph top to bottom, coloured by stage (or by measured stage time), with selection and search overlays."""
    stage_of = {n: s.id for s in plan.stages for n in s.nodes}
    labels = fit_labels(view, pos) if len(view.ids) <= LABEL_LIMIT else {}
    ctx = _Ctx(data, view, pos, plan, stage_of, stage_colors(plan), labels,
               dense=len({round(p[1], 6) for p in pos.values()}) >= 30)
    groups: dict[str, list[str]] = {}  # stage id -> view ids drawn in its colour (a module box: its first node's)
    for vid in view.ids:
        groups.setdefault(stage_of.get(view.members[vid][0], NO_STAGE), []).append(vid)
    order = sorted(groups, key=ctx.order)
    traces = [_edge_trace(view, pos)]
    first_timed = next((sid for sid in order if (opts.stage_times or {}).get(sid) is not None), None)
    traces += [_stage_trace(ctx, sid, groups[sid], opts.stage_times, show_scale=sid == first_timed) for sid in order]
    ring = dict(size=21, symbol="circle-open", color="#000000", line=dict(width=2.5))
    halo = dict(size=30, color="rgba(255,215,0,0.35)", line=dict(width=2, color="#e6b800"))
    for overlay in (_overlay(view, pos, opts.selected, "selected", ring),
                    _overlay(view, pos, opts.highlighted, "search hits", halo)):
        if overlay is not None:
            traces.append(overlay)
    fig = go.Figure(traces)
    _layout(fig, data, view, pos, bool(labels), opts.height)
    return fig
