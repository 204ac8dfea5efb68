"""What the Plan page draws: plain graph data, module collapse, search, and the Plotly figure.

No streamlit here. `graph_data` is the only function that reads a ModelGraph
(its networkx DAG); everything after it works on frozen plain data that can be
cached, pickled and unit-tested with small fakes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import plotly.graph_objects as go

from app.layout import layered_layout
from planner.plan import Plan, StageMode

# Twenty colours that stay apart from each other and from the excluded grey
# (Tableau 10 + its light half, reordered so neighbours in the list contrast).
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
    "#17becf", "#393b79", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
    "#dbdb8d", "#9edae5", "#637939", "#aec7e8",
)
EXCLUDED_FILL = "#d9d9d9"
IO_COLOR = "#4d4d4d"  # placeholders and the output, which no stage holds
MODULE_PREFIX = "module:"  # view ids of collapsed modules; fx node names never contain ':'
LABEL_LIMIT = 300  # draw (fitted) node names next to markers up to this many view nodes


@dataclass(frozen=True)
class NodeInfo:
    """One fx node as plain data (what hover and tables show)."""

    name: str
    op: str
    target: str
    module_path: str  # dotted, "" for nodes outside any submodule
    shape: str
    dtype: str
    params: int
    flops: int
    batchable: bool
    reason: str  # why not batchable ("" when batchable)


@dataclass(frozen=True)
class GraphData:
    """A traced graph as plain data: nodes in topological order and edges by name."""

    fingerprint: str
    tracer: str
    nodes: tuple[NodeInfo, ...]
    edges: tuple[tuple[str, str], ...]

    def node(self, name: str) -> NodeInfo:
        return self._index()[name]

    def _index(self) -> dict[str, NodeInfo]:
        idx = self.__dict__.get("_idx")
        if idx is None:
            idx = {n.name: n for n in self.nodes}
            object.__setattr__(self, "_idx", idx)
        return idx

    def module_paths(self) -> list[str]:
        """Every module path and each of its prefixes ("layers", "layers.0", "layers.0.attn"), sorted."""
        out: set[str] = set()
        for n in self.nodes:
            parts = n.module_path.split(".") if n.module_path else []
            out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
        return sorted(out, key=lambda p: (p.count("."), p))


def graph_data(graph: Any) -> GraphData:
    """Copy what the UI needs out of a planner ModelGraph (networkx DAG with node attributes)."""
    dag = graph.dag
    nodes = []
    for name in graph.node_names:
        a = dag.nodes[name]
        nodes.append(
            NodeInfo(
                name=name,
                op=str(a.get("op", "")),
                target=str(a.get("target", "")),
                module_path=str(a.get("module_path", "") or ""),
                shape=str(a.get("shape", "")),
                dtype=str(a.get("dtype", "")),
                params=int(a.get("params", 0) or 0),
                flops=int(a.get("flops", 0) or 0),
                batchable=bool(a.get("batchable", True)),
                reason=str(a.get("reason", "") or ""),
            )
        )
    edges = tuple((str(u), str(v)) for u, v in dag.edges)
    return GraphData(str(graph.fingerprint), str(getattr(graph, "tracer", "")), tuple(nodes), edges)


# -- collapsed view ---------------------------------------------------------------


@dataclass(frozen=True)
class ViewGraph:
    """The graph as drawn: fx nodes, or one box per collapsed module."""

    ids: tuple[str, ...]  # view node ids, topological order of their first member
    members: Mapping[str, tuple[str, ...]]  # view id -> fx node names it stands for
    edges: tuple[tuple[str, str], ...]

    def expand(self, view_ids: Iterable[str]) -> list[str]:
        """fx node names behind these view ids (unknown ids are dropped)."""
        out: list[str] = []
        for v in view_ids:
            out.extend(self.members.get(v, ()))
        return out


def _owner(module_path: str, collapsed: Sequence[str]) -> str | None:
    """The outermost collapsed module that contains `module_path`, if any."""
    for prefix in collapsed:  # sorted shortest first, so the outermost wins
        if module_path == prefix or module_path.startswith(prefix + "."):
            return prefix
    return None


def collapse(data: GraphData, modules: Iterable[str] = ()) -> ViewGraph:
    """Contract every node under one of `modules` into a box `module:<path>`; nested choices fold into the outer one."""
    collapsed = sorted(set(modules), key=lambda p: (p.count("."), p))
    view_of: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    ids: list[str] = []
    for n in data.nodes:
        owner = _owner(n.module_path, collapsed) if collapsed and n.module_path else None
        vid = MODULE_PREFIX + owner if owner else n.name
        view_of[n.name] = vid
        if vid not in members:
            members[vid] = []
            ids.append(vid)
        members[vid].append(n.name)
    edges = []
    seen = set()
    for u, v in data.edges:
        e = (view_of[u], view_of[v])
        if e[0] != e[1] and e not in seen:
            seen.add(e)
            edges.append(e)
    return ViewGraph(tuple(ids), {k: tuple(v) for k, v in members.items()}, tuple(edges))


AUTO_COLLAPSE_NODES = 300  # graphs larger than this open with modules collapsed
MAX_VIEW_NODES = 250  # auto-collapse aims at a drawn graph no larger than this


def modules_at_depth(data: GraphData, depth: int) -> list[str]:
    """Module paths with `depth` dots-plus-one parts (depth 1: "layers", depth 2: "layers.0", ...)."""
    return [p for p in data.module_paths() if p.count(".") == depth - 1]


def auto_collapse(data: GraphData, max_view: int = MAX_VIEW_NODES) -> int:
    """The deepest module depth whose collapse draws at most `max_view` boxes and nodes (0: none fits)."""
    best = 0
    for depth in sorted({p.count(".") + 1 for p in data.module_paths()}):
        if len(collapse(data, modules_at_depth(data, depth)).ids) > max_view:
            break
        best = depth
    return best


def view_layout(view: ViewGraph) -> dict[str, tuple[float, float]]:
    """Layered positions for a view (inputs on top)."""
    return layered_layout(view.ids, view.edges)


def search(data: GraphData, query: str) -> list[str]:
    """Node names whose name, target or module path contains `query` (case-insensitive); [] for a blank query."""
    q = query.strip().lower()
    if not q:
        return []
    return [n.name for n in data.nodes if q in n.name.lower() or q in n.target.lower() or q in n.module_path.lower()]


# -- colours and hover ------------------------------------------------------------------


def stage_colors(plan: Plan) -> dict[str, str]:
    """One palette colour per stage id, by position in the plan (neighbouring stages differ)."""
    return {s.id: PALETTE[i % len(PALETTE)] for i, s in enumerate(plan.stages)}


def _human(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def hover_text(info: NodeInfo, stage_label: str) -> str:
    """Hover box of one fx node: name, op, shape, params, FLOPs, stage, and why it is not batchable."""
    lines = [
        f"<b>{info.name}</b>",
        f"op: {info.op} {info.target}",
        f"module: {info.module_path or '-'}",
        f"shape: {info.shape} {info.dtype}",
        f"params: {_human(info.params)} · FLOPs: {_human(info.flops)}",
        f"stage: {stage_label}",
    ]
    if not info.batchable:
        lines.append(f"<b>not batchable</b>: {info.reason or 'no reason given'}")
    return "<br>".join(lines)


def _module_hover(vid: str, names: Sequence[str], data: GraphData, stage_ids: Sequence[str]) -> str:
    infos = [data.node(n) for n in names]
    bad = [i.name for i in infos if not i.batchable]
    lines = [
        f"<b>{vid[len(MODULE_PREFIX):]}</b> (collapsed, {len(names)} nodes)",
        f"params: {_human(sum(i.params for i in infos))} · FLOPs: {_human(sum(i.flops for i in infos))}",
        f"stages: {', '.join(stage_ids)}",
    ]
    if bad:
        lines.append(f"<b>not batchable</b>: {', '.join(bad[:5])}{' …' if len(bad) > 5 else ''}")
    return "<br>".join(lines)


PLOT_WIDTH_PX = 700  # typical width of the graph column; label fitting assumes it
CHAR_PX = 6.6  # average width of one 11px label character


def fit_labels(view: ViewGraph, pos: Mapping[str, tuple[float, float]]) -> dict[str, str]:
    """Node labels shortened to the gap before their right-hand neighbour, so labels never overlap.

    Labels sit right of the marker; the gap in plot units is turned into characters
    with the x range the figure will use. Names cut short end in '…' (hover has the full name).
    """
    if not pos:
        return {}
    names = {v: v[len(MODULE_PREFIX):] if v.startswith(MODULE_PREFIX) else v for v in view.ids}
    xs = [p[0] for p in pos.values()]
    longest = max(len(n) for n in names.values())
    span = max(xs) - min(xs) + 1.6 + 0.12 * longest
    px_per_unit = PLOT_WIDTH_PX / span
    rows: dict[float, list[str]] = {}
    for v in view.ids:
        rows.setdefault(round(pos[v][1], 6), []).append(v)
    out = {}
    for row in rows.values():
        row.sort(key=lambda v: pos[v][0])
        for i, v in enumerate(row):
            gap_units = (pos[row[i + 1]][0] - pos[v][0]) if i + 1 < len(row) else float("inf")
            room = 10**6 if gap_units == float("inf") else int((gap_units * px_per_unit - 14) / CHAR_PX)  # 14 px: marker + padding
            name = names[v]
            out[v] = name if len(name) <= room else (name[: room - 1] + "…" if room >= 4 else "")
    return out


# -- figure ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FigureOptions:
    selected: frozenset[str] = frozenset()  # fx node names drawn with a thick outline
    highlighted: frozenset[str] = frozenset()  # search hits, drawn with a yellow halo
    stage_times: Mapping[str, float] | None = None  # stage id -> ms; colours by time instead of stage
    height: int | None = None  # pixels; None picks one from the number of layers


def _stage_of_map(plan: Plan) -> dict[str, str]:
    return {n: s.id for s in plan.stages for n in s.nodes}


def build_figure(data: GraphData, view: ViewGraph, pos: Mapping[str, tuple[float, float]], plan: Plan,
                 opts: FigureOptions = FigureOptions()) -> go.Figure:
    """The stage-coloured graph: one marker trace per stage (so the legend lists stages), edges in grey.

    Every marker carries its view id in `customdata`, which is what a Plotly selection returns.
    """
    stage_of = _stage_of_map(plan)
    modes = {s.id: s.mode for s in plan.stages}
    colors = stage_colors(plan)
    order = {s.id: i for i, s in enumerate(plan.stages)}
    show_labels = len(view.ids) <= LABEL_LIMIT

    ex, ey = [], []
    for u, v in view.edges:
        (x0, y0), (x1, y1) = pos[u], pos[v]
        ex += [x0, x1, None]
        ey += [y0, y1, None]
    traces: list[go.BaseTraceType] = [
        go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#9a9a9a", width=1), hoverinfo="skip",
                   showlegend=False, name="edges")
    ]

    groups: dict[str, list[str]] = {}  # stage id -> view ids drawn in its colour
    for vid in view.ids:
        names = view.members[vid]
        first_stage = stage_of.get(names[0], "?")
        groups.setdefault(first_stage, []).append(vid)

    labels = fit_labels(view, pos) if show_labels else {}
    dense_rows = len({round(p[1], 6) for p in pos.values()})  # layers; many layers draw smaller boxes
    times = opts.stage_times
    for sid in sorted(groups, key=lambda s: order.get(s, 1 << 30)):
        vids = groups[sid]
        excluded = modes.get(sid) == StageMode.EXCLUDED
        hovers, texts, line_w, line_c, sizes = [], [], [], [], []
        for vid in vids:
            names = view.members[vid]
            is_module = vid.startswith(MODULE_PREFIX)
            sids = sorted({stage_of.get(n, "?") for n in names}, key=lambda s: order.get(s, 1 << 30))
            if is_module:
                hovers.append(_module_hover(vid, names, data, sids))
                texts.append("\u2002" + labels[vid] if labels.get(vid) else "")  # en space: clear of the selection ring
            else:
                info = data.node(vid)
                label = f"{sid} ({modes[sid].value})" if sid in modes else "none (input/output)"
                hovers.append(hover_text(info, label))
                texts.append("\u2002" + labels[vid] if labels.get(vid) else "")  # en space: clear of the selection ring
            bad = any(not data.node(n).batchable for n in names)
            line_w.append(2.5 if bad or excluded else 1)
            line_c.append("#b30000" if bad else (colors.get(sid, "#555") if excluded else "#ffffff"))
            sizes.append((22 if dense_rows < 30 else 15) if is_module else 14)
        xs = [pos[v][0] for v in vids]
        ys = [pos[v][1] for v in vids]
        if sid not in modes:  # placeholders and the output belong to no stage
            marker = dict(color=IO_COLOR)
            name = "inputs / outputs"
        elif times is not None:
            t = times.get(sid)
            fill: Any = [t if t is not None else 0.0] * len(vids)
            marker = dict(color=fill, colorscale="YlOrRd", cmin=0, cmax=max(list(times.values()) + [1e-9]),
                          showscale=sid == next(iter(sorted(groups, key=lambda s: order.get(s, 1 << 30)))),
                          colorbar=dict(title="stage ms", thickness=14, len=0.6, x=1.0, xanchor="left"))
            name = f"{sid}: {t:.3g} ms" if t is not None else f"{sid}: not measured"
        else:
            marker = dict(color=EXCLUDED_FILL if excluded else colors[sid])
            name = f"{sid} · {'excluded' if excluded else 'batched'} · {len(plan.stage(sid).nodes)} nodes"
        symbols = ["square-x" if excluded else ("square" if v.startswith(MODULE_PREFIX) else "circle") for v in vids]
        if sid not in modes:
            symbols = ["diamond"] * len(vids)
        marker.update(size=sizes, symbol=symbols, line=dict(width=line_w, color=line_c))
        traces.append(go.Scatter(
            x=xs, y=ys, mode="markers+text" if show_labels else "markers", name=name, legendgroup=sid,
            customdata=vids, hovertext=hovers, hoverinfo="text", text=texts if show_labels else None,
            textposition="middle right", textfont=dict(size=11, color="#333333"), marker=marker,
        ))

    sel = [v for v in view.ids if any(n in opts.selected for n in view.members[v])]
    if sel:  # a ring around selected nodes, so the node keeps its stage look (and the legend stays right)
        traces.append(go.Scatter(
            x=[pos[v][0] for v in sel], y=[pos[v][1] for v in sel], mode="markers", name="selected",
            customdata=sel, hoverinfo="skip", showlegend=False,
            marker=dict(size=21, symbol="circle-open", color="#000000", line=dict(width=2.5)),
        ))
    hl = [v for v in view.ids if any(n in opts.highlighted for n in view.members[v])]
    if hl:
        traces.append(go.Scatter(
            x=[pos[v][0] for v in hl], y=[pos[v][1] for v in hl], mode="markers", name="search hits",
            customdata=hl, hoverinfo="skip",
            marker=dict(size=30, color="rgba(255,215,0,0.35)", line=dict(width=2, color="#e6b800")),
        ))

    n_layers = len({round(p[1], 6) for p in pos.values()}) or 1
    xs_all = [p[0] for p in pos.values()] or [0.0]
    longest = max((len(t) for t in view.ids), default=4) if show_labels else 0
    # ~44 px per layer for small graphs; long chains get a tall figure (the page scrolls) at >= 24 px per layer
    per_layer = 44 if n_layers <= 30 else 24
    height = opts.height or max(420, min(9000, per_layer * n_layers + 80))
    fig = go.Figure(traces)
    fig.update_layout(
        height=height, margin=dict(l=10, r=40, t=40, b=10),
        hovermode="closest", plot_bgcolor="#ffffff", uirevision=data.fingerprint,
        modebar=dict(orientation="v"),  # on the right edge, clear of the legend on top
        hoverlabel=dict(bgcolor="#ffffff", bordercolor="#444444", font=dict(color="#111111", size=12)),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0.0, itemclick=False, itemdoubleclick=False),
        xaxis=dict(visible=False, range=[min(xs_all) - 0.8, max(xs_all) + 0.8 + 0.12 * longest]),
        yaxis=dict(visible=False, range=[min(p[1] for p in pos.values()) - 0.6 if pos else -1, 0.6]),
    )
    return fig


def selection_from_event(event: Any, view: ViewGraph) -> list[str]:
    """fx node names picked in a Plotly selection event (points carry view ids in customdata)."""
    try:
        points = event["selection"]["points"]
    except (KeyError, TypeError):
        return []
    vids = []
    for p in points:
        cd = p.get("customdata") if isinstance(p, Mapping) else None
        if isinstance(cd, (list, tuple)):
            cd = cd[0] if cd else None
        if isinstance(cd, str):
            vids.append(cd)
    return list(dict.fromkeys(view.expand(vids)))
