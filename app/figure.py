"""The Plotly figure of the stage graph, drawn from a Graphviz `dot` layout. No streamlit here.

What is drawn, back to front: stage regions (shaded boxes around each stage's nodes, from dot's
clusters; member-loop stages hatched grey), frames of expanded modules with a "▾ path" tag that
collapses them, routed edges with arrowheads, labelled node boxes (name, op, shape; collapsed
modules and folds of repeated blocks in bold), red outlines on nodes that cannot be batched, the
selection and search overlays, and invisible hit points that carry each box's view id in
`customdata` (what a Plotly click or box selection returns). Coordinates are dot's points, kept
1:1 on screen where the graph fits the column, so labels stay the size of their boxes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go
from plotly.colors import sample_colorscale

from stagewise.app import dot_layout
from stagewise.app.dot_view import tint
from stagewise.app.graph_view import (CANNOT_BATCH, EXCLUDED_FILL, IO_COLOR, MODULE_PREFIX, OPEN_PREFIX, UNMEASURED_FILL, GraphData,
                                      ViewGraph, module_hover, hover_text, stage_colors)
from stagewise.planner.plan import Plan, Stage, StageMode
from stagewise.planner.table import plural

LOOP_OUTLINE = "#555555"  # dashed outline of a member-loop stage (hatched grey, never a stage colour)
TIME_SCALE = "Viridis"  # time overlay; not red-yellow: red means "cannot be batched" in this graph
EDGE_COLOR = "#8a8a8a"
CHANGED_COLOR = "#ff7f0e"  # plan diff: outline of a box whose stage changed
FRAME_COLOR = "#7a7a7a"
NO_STAGE = "?"  # group of placeholders and the output, which no stage holds
PLOT_WIDTH_PX = 700  # typical width of the graph column: the scale that keeps the drawing 1:1 assumes it
MAX_HEIGHT_PX = 30000  # taller drawings are scaled down to this
MIN_LABEL_PX = 6.0  # below this font size labels are left out (hover still has everything)
NAME_CHARS = 34  # node names longer than this are cut with "…" in the box (hover has the full name)
MAX_FRAMES = 300  # module frames drawn at most (the biggest graphs draw the outermost ones)
LABEL_ROOM = 130  # points right of the drawing kept for stage labels
MAX_LEGEND = 12  # more stages than this: no legend (each region is labelled beside it)


@dataclass(frozen=True)
class FigureOptions:
    selected: frozenset[str] = frozenset()  # fx node names, drawn with a black outline
    highlighted: frozenset[str] = frozenset()  # search hits, drawn with a yellow halo
    stage_times: Mapping[str, float] | None = None  # stage id -> ms of stages measured as they are; colours by time
    # (stages missing from it are drawn open, "not measured"; see profile_view.measured_stage_times)
    height: int | None = None  # pixels; None: the drawing's own height at the column's scale
    changed: frozenset[str] = frozenset()  # fx node names drawn with an orange outline (plan diff)
    width_px: int = 0  # width of the column the figure goes in; 0: PLOT_WIDTH_PX


# -- what is laid out ----------------------------------------------------------------------------


def _cut(text: str, n: int = NAME_CHARS) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def op_label(info: Any) -> str:
    """Short op text for a box: the module class, the function, `.method`, input/output."""
    if info.op == "call_module":
        return info.target.rpartition("(")[2].rstrip(")") or info.target
    if info.op == "call_method":
        return "." + info.target
    return {"placeholder": "input", "output": "output", "get_attr": "attribute"}.get(info.op, info.target.rpartition(".")[2])


def box_label(data: GraphData, view: ViewGraph, vid: str) -> tuple[str, ...]:
    """The text lines of one box: name and "op · shape" for a node; path and size for module boxes and folds.
    Nothing here depends on the plan, so the layout survives every edit (hover tells the stages)."""
    kind = view.kind(vid)
    names = view.members[vid]
    if kind == "node":
        info = data.node(vid)
        return (_cut(vid), _cut(f"{op_label(info)} · {info.shape}", NAME_CHARS + 6))
    if kind == "fold":
        paths = view.folds[vid]
        return (_cut(f"▸ {vid[len('fold:'):]}  ×{len(paths)}", NAME_CHARS + 4),
                f"{len(paths)} identical blocks · {plural(len(names), 'node')}")
    return (_cut(f"▸ {vid[len(MODULE_PREFIX):]}", NAME_CHARS + 2), plural(len(names), "node"))


def spec_of(data: GraphData, view: ViewGraph) -> dot_layout.Spec:
    """What dot lays out: the view's boxes with their labels, and its edges."""
    return dot_layout.Spec(tuple((vid, box_label(data, view, vid)) for vid in view.ids), tuple(view.edges))


def stages_of_boxes(view: ViewGraph, plan: Plan) -> dict[str, list[str]]:
    """Each box's stages in plan order (NO_STAGE for inputs and the output)."""
    stage_of = {n: s.id for s in plan.stages for n in s.nodes}
    order = {s.id: i for i, s in enumerate(plan.stages)}
    return {vid: sorted({stage_of.get(n, NO_STAGE) for n in view.members[vid]}, key=lambda s: order.get(s, 1 << 30))
            for vid in view.ids}


def drawing_of(data: GraphData, view: ViewGraph) -> dot_layout.Drawing:
    """The (cached) dot layout of this view."""
    return dot_layout.layout(spec_of(data, view))


# -- traces -------------------------------------------------------------------------------------


def _polys(polys: Sequence[Sequence[tuple[float, float]]]) -> tuple[list, list]:
    xs: list[float | None] = []
    ys: list[float | None] = []
    for poly in polys:
        xs += [p[0] for p in poly] + [None]
        ys += [p[1] for p in poly] + [None]
    return xs, ys


def _fill_trace(polys, fill: str, line: str, width: float, name: str, dash: str = "solid", pattern: dict | None = None,
                legend: bool = False, group: str | None = None) -> go.Scatter:
    xs, ys = _polys(polys)
    return go.Scatter(x=xs, y=ys, mode="lines", fill="toself", fillcolor=fill, line=dict(color=line, width=width, dash=dash),
                      fillpattern=pattern, hoverinfo="skip", name=name, showlegend=legend, legendgroup=group)


def _line_trace(polys, color: str, width: float, name: str, dash: str = "solid") -> go.Scatter:
    xs, ys = _polys(polys)
    return go.Scatter(x=xs, y=ys, mode="lines", line=dict(color=color, width=width, dash=dash), hoverinfo="skip",
                      name=name, showlegend=False)


def _how(stage: Stage) -> str:
    """'batched (vmap)', 'batched (wide), excluded from vmap (...)', 'member loop, excluded (<reason>)'."""
    text = stage.runs_as()
    if stage.mode is StageMode.EXCLUDED:
        text += f", excluded from vmap ({stage.reason})" if stage.runs_batched else f", excluded ({stage.reason})"
    return text


@dataclass
class _Look:
    """How one stage's region and boxes are painted."""

    region_fill: str
    region_line: str
    box_fill: str
    box_line: str
    dash: str = "solid"
    pattern: dict | None = None
    name: str = ""


def _looks(plan: Plan, times: Mapping[str, float] | None) -> dict[str, _Look]:
    colors = stage_colors(plan)
    top = max(list((times or {}).values()) + [1e-9])
    out = {}
    for s in plan.stages:
        loop = not s.runs_batched
        if times is not None and times.get(s.id) is not None:
            c = sample_colorscale(TIME_SCALE, [min(1.0, times[s.id] / top)])[0]
            out[s.id] = _Look(_alpha(c, 0.22), c, _alpha(c, 0.55), c, name=f"{s.id}: {times[s.id]:.3g} ms")
        elif times is not None:  # open: no colour on the time scale, so it cannot read as fast
            out[s.id] = _Look("rgba(255,255,255,0)", "#888888", UNMEASURED_FILL, "#888888", dash="dot",
                              name=f"{s.id}: not measured")
        elif loop:
            out[s.id] = _Look("rgba(217,217,217,0.35)", LOOP_OUTLINE, EXCLUDED_FILL, LOOP_OUTLINE, dash="dash",
                              pattern=dict(shape="/", fgcolor="#b0b0b0", size=8, solidity=0.15),
                              name=f"{s.id} · {s.runs_as()} · {plural(len(s.nodes), 'node')}")
        else:
            c = colors[s.id]
            out[s.id] = _Look(tint(c, 0.86), c, tint(c, 0.55), c,
                              name=f"{s.id} · {s.runs_as()} · {plural(len(s.nodes), 'node')}")
    return out


def _alpha(color: str, a: float) -> str:
    """'rgb(r, g, b)' or '#rrggbb' with alpha `a`."""
    if color.startswith("#"):
        r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    else:
        r, g, b = (int(float(v)) for v in color[color.index("(") + 1:color.index(")")].split(",")[:3])
    return f"rgba({r},{g},{b},{a})"


def _frames(data: GraphData, view: ViewGraph, boxes: Mapping[str, dot_layout.Box]) -> list[tuple[str, tuple]]:
    """(module path, (x0, y0, x1, y1)) of every expanded module holding two or more drawn boxes, outer frames larger."""
    inside: dict[str, list[str]] = {}
    for vid in view.ids:
        kind = view.kind(vid)
        if kind == "node":
            path = data.node(vid).module_path
            parts = path.split(".") if path else []
        elif kind == "module":
            parts = vid[len(MODULE_PREFIX):].split(".")[:-1]
        else:
            parts = view.folds[vid][0].split(".")[:-1]
        for i in range(len(parts)):
            inside.setdefault(".".join(parts[: i + 1]), []).append(vid)
    paths = [p for p, vids in inside.items() if len(vids) >= 2]
    paths.sort(key=lambda p: (p.count("."), p))
    paths = paths[:MAX_FRAMES]
    deepest = {p: max((q.count(".") for q in paths if q == p or q.startswith(p + ".")), default=p.count(".")) for p in paths}
    out = []
    for p in paths:
        bs = [boxes[v] for v in inside[p]]
        pad = 4 + 10 * (deepest[p] - p.count("."))  # nested frames 10 pt apart: room for each tag
        out.append((p, (min(b.x - b.w / 2 for b in bs) - pad, min(b.y - b.h / 2 for b in bs) - pad,
                        max(b.x + b.w / 2 for b in bs) + pad, max(b.y + b.h / 2 for b in bs) + pad)))
    return out


def _rect(r: tuple[float, float, float, float]) -> list[tuple[float, float]]:
    x0, y0, x1, y1 = r
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)]


def _hit_points(box: dot_layout.Box) -> list[tuple[float, float]]:
    """Where a box answers clicks: its centre, and more points along a wide box (Plotly picks the nearest point)."""
    k = max(1, min(5, int(box.w // 40)))
    if k == 1:
        return [(box.x, box.y)]
    return [(box.x - box.w / 2 + box.w * (i + 0.5) / k, box.y) for i in range(k)]


def build_figure(data: GraphData, view: ViewGraph, plan: Plan, opts: FigureOptions = FigureOptions(),
                 drawing: dot_layout.Drawing | None = None) -> go.Figure:
    """The graph top to bottom: stage regions, module frames, routed edges, labelled boxes, overlays."""
    spec = spec_of(data, view)
    stages_of = stages_of_boxes(view, plan)
    d = drawing or dot_layout.layout(spec)
    stages = {s.id: s for s in plan.stages}
    looks = _looks(plan, opts.stage_times)
    colors = stage_colors(plan)
    order = {s.id: i for i, s in enumerate(plan.stages)}
    traces: list[go.Scatter] = []

    # stage regions around the boxes wholly in one stage (one trace each: it holds the stage's legend entry)
    inside: dict[str, list[str]] = {}
    for vid in view.ids:
        if len(stages_of[vid]) == 1 and stages_of[vid][0] in stages:
            inside.setdefault(stages_of[vid][0], []).append(vid)
    shapes = dot_layout.regions(d.boxes, inside)
    legend = len(plan.stages) <= MAX_LEGEND
    for s in plan.stages:
        if shapes.get(s.id):
            lk = looks[s.id]
            traces.append(_fill_trace(shapes[s.id], lk.region_fill, lk.region_line, 1.5, lk.name, lk.dash,
                                      lk.pattern, legend=legend, group=s.id))
    # frames of expanded modules, and their tags (clicking a tag collapses the module)
    frames = _frames(data, view, d.boxes)
    if frames:
        traces.append(_line_trace([_rect(r) for _, r in frames], FRAME_COLOR, 1, "modules", dash="dot"))
    # edges and arrowheads
    traces.append(_line_trace([e.path for e in d.edges], EDGE_COLOR, 1, "edges"))
    traces.append(_fill_trace([e.arrow for e in d.edges if e.arrow], EDGE_COLOR, EDGE_COLOR, 1, "arrows"))
    # boxes: one trace per stage and kind (plain nodes / module and fold boxes)
    groups: dict[tuple[str, bool], list[str]] = {}
    for vid in view.ids:
        sid = stages_of[vid][0]
        groups.setdefault((sid, view.kind(vid) != "node"), []).append(vid)
    for (sid, boxy), vids in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 1 << 30), kv[0][1])):
        lk = looks.get(sid)
        fill, line = (lk.box_fill, lk.box_line) if lk else ("#f0f0f0", IO_COLOR)
        if boxy and lk and opts.stage_times is None and stages[sid].runs_batched:
            fill = tint(colors[sid], 0.35)
        traces.append(_fill_trace([d.boxes[v].polygon() for v in vids], fill, line, 2.2 if boxy else 1,
                                  f"{sid} boxes", dash=lk.dash if lk else "solid"))
    bad = [v for v in view.ids if any(not data.node(n).batchable for n in view.members[v])]
    if bad:
        traces.append(_line_trace([d.boxes[v].polygon(1.5) for v in bad], CANNOT_BATCH, 2.5, "cannot batch"))
    # overlays
    sel = [v for v in view.ids if any(n in opts.selected for n in view.members[v])]
    hits = [v for v in view.ids if any(n in opts.highlighted for n in view.members[v])]
    if hits:
        traces.append(_fill_trace([d.boxes[v].polygon(5) for v in hits], "rgba(255,215,0,0.35)", "#e6b800", 2,
                                  "search hits", legend=True))
    changed = [v for v in view.ids if any(n in opts.changed for n in view.members[v])]
    if changed:
        traces.append(_line_trace([d.boxes[v].polygon(2.5) for v in changed], CHANGED_COLOR, 3, "changed"))
    if sel:
        traces.append(_line_trace([d.boxes[v].polygon(3) for v in sel], "#000000", 2.5, "selected"))
    # labels, scaled with the drawing
    scale, height = _scale(d, opts.height, opts.width_px or PLOT_WIDTH_PX)
    font = 10.0 * scale
    if font >= MIN_LABEL_PX:
        label_of = dict(spec.nodes)
        traces.append(go.Scatter(
            x=[d.boxes[v].x for v in view.ids], y=[d.boxes[v].y for v in view.ids], mode="text",
            text=[_label_html(label_of[v]) for v in view.ids], textposition="middle center",
            textfont=dict(size=font, color="#1a1a1a"), hoverinfo="skip", showlegend=False, name="labels"))
        region_font = max(MIN_LABEL_PX, 9.0 * scale)
        tags = [(sid, polys[0][0], polys[0][1]) for sid, polys in shapes.items() if polys]  # right edge of the top band
        traces.append(go.Scatter(
            x=[a[0] + 4 for _, a, _ in tags], y=[(a[1] + b[1]) / 2 for _, a, b in tags], mode="text",
            text=[f"<b>{sid}</b> · {_how_short(stages[sid])}" for sid, _, _ in tags], textposition="middle right",
            textfont=dict(size=region_font, color="#333333"), hoverinfo="skip", showlegend=False, name="stage labels"))
    # hit points: what clicks and box selections return (customdata = view id)
    for (sid, boxy), vids in groups.items():
        traces.append(_hit_trace(data, view, d, vids, sid, stages.get(sid), stages_of))
    if frames:
        tags = [(p, r) for p, r in frames]
        traces.append(go.Scatter(
            x=[r[0] + 4 for _, r in tags], y=[r[3] - 4 for _, r in tags], mode="markers+text" if font >= MIN_LABEL_PX else "markers",
            text=[f"{p}" for p, _ in tags], textposition="middle right", textfont=dict(size=max(MIN_LABEL_PX, 8.5 * scale), color="#555555"),
            marker=dict(size=9, symbol="triangle-down", color=FRAME_COLOR), customdata=[OPEN_PREFIX + p for p, _ in tags],
            hovertext=[f"<b>{p}</b> (expanded): click to collapse it into one box" for p, _ in tags], hoverinfo="text",
            showlegend=False, name="module tags"))
    if opts.stage_times:  # the colour bar of the time overlay (on invisible points at the measured boxes)
        timed = [(v, opts.stage_times[stages_of[v][0]]) for v in view.ids if opts.stage_times.get(stages_of[v][0]) is not None]
        if timed:
            traces.append(go.Scatter(
                x=[d.boxes[v].x for v, _ in timed], y=[d.boxes[v].y for v, _ in timed], mode="markers", hoverinfo="skip",
                marker=dict(size=1, opacity=0, color=[t for _, t in timed], colorscale=TIME_SCALE, cmin=0,
                            cmax=max(opts.stage_times.values()), showscale=True,
                            colorbar=dict(title="stage ms", thickness=14, len=0.6, x=1.0, xanchor="left")),
                showlegend=False, name="time scale"))
    fig = go.Figure(traces)
    _layout(fig, data, d, height)
    return fig


def _how_short(stage: Stage) -> str:
    return stage.runs_as() + (", excluded from vmap" if stage.mode is StageMode.EXCLUDED and stage.runs_batched else "")


def _label_html(lines: Sequence[str]) -> str:
    """Name in bold, the second line in grey (Plotly text takes a little HTML)."""
    first, *rest = (line.replace("<", "&lt;") for line in lines)
    return "<br>".join([f"<b>{first}</b>"] + [f"<span style='color:#555'>{r}</span>" for r in rest])


def _hit_trace(data: GraphData, view: ViewGraph, d: dot_layout.Drawing, vids: Sequence[str], sid: str,
               stage: Stage | None, stages_of: Mapping[str, list[str]]) -> go.Scatter:
    xs, ys, cds, hovers = [], [], [], []
    for vid in vids:
        names = view.members[vid]
        if view.kind(vid) == "node":
            label = f"{sid}, {_how(stage)}" if stage is not None else "none (input/output)"
            hover = hover_text(data.node(vid), label)
        else:
            hover = module_hover(vid, names, data, stages_of[vid])
            hover += "<br><i>click to expand</i>" if view.kind(vid) == "module" else "<br><i>click to unfold</i>"
        for x, y in _hit_points(d.boxes[vid]):
            xs.append(x)
            ys.append(y)
            cds.append(vid)
            hovers.append(hover)
    return go.Scatter(x=xs, y=ys, mode="markers", customdata=cds, hovertext=hovers, hoverinfo="text",
                      marker=dict(size=14, color="rgba(0,0,0,0)", opacity=0), name=f"{sid} nodes", showlegend=False,
                      selected=dict(marker=dict(opacity=0)), unselected=dict(marker=dict(opacity=0)))


def _scale(d: dot_layout.Drawing, height: int | None, width_px: int) -> tuple[float, int]:
    """Pixels per dot point and the figure height: 1:1 where the drawing fits the column, smaller where it is wider."""
    margin = 60
    scale = min(1.0, width_px / max(d.width + 10 + LABEL_ROOM, 1.0))
    if d.height * scale > MAX_HEIGHT_PX:
        scale = MAX_HEIGHT_PX / d.height
    if height is not None:  # a fixed height (the Profile page's small graph): fit the drawing into it
        scale = min(scale, (height - margin) / max(d.height + 20, 1.0))
        return scale, height
    return scale, int(max(240, d.height * scale + margin))


def _layout(fig: go.Figure, data: GraphData, d: dot_layout.Drawing, height: int) -> None:
    fig.update_layout(
        height=height, margin=dict(l=10, r=10, t=40, b=10),
        hovermode="closest", hoverdistance=30, plot_bgcolor="#ffffff", uirevision=data.fingerprint,
        modebar=dict(orientation="v"),
        hoverlabel=dict(bgcolor="#ffffff", bordercolor="#444444", font=dict(color="#111111", size=12)),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0.0, itemclick=False, itemdoubleclick=False),
        xaxis=dict(visible=False, range=[-10, d.width + LABEL_ROOM], constrain="domain"),
        yaxis=dict(visible=False, range=[-10, d.height + 10], scaleanchor="x", scaleratio=1, constrain="domain"),
    )
