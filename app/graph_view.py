"""What the Plan page draws: plain graph data, module collapse, search, and the Plotly figure.

No streamlit here. `graph_data` is the only function that reads a ModelGraph
(its networkx DAG); everything after it works on frozen plain data that can be
cached, pickled and unit-tested with small fakes.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from stagewise.app.layout import layered_layout
from stagewise.planner.plan import Plan
from stagewise.planner.table import human, plural

# Stage colours: Tableau 20 without its reds and greys. Red means "cannot be batched" and grey
# "member loop" everywhere in the app, so no stage ever gets either.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
    "#393b79", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
    "#637939", "#aec7e8",
)
EXCLUDED_FILL = "#d9d9d9"  # a stage run as a member loop: grey, crossed square (never a stage colour)
CANNOT_BATCH = "#b30000"  # outline of a node that cannot be batched (the only red in the graph)
UNMEASURED_FILL = "#ffffff"  # time overlay: a stage the shown profile did not measure (open marker)
IO_COLOR = "#4d4d4d"  # placeholders and the output, which no stage holds
# One colour per way of running, the same in every Profile chart: the loop is always grey, vmap always blue.
STRATEGY_COLORS = {
    "stagewise": "#2ca02c", "plan": "#2ca02c", "loop": "#7f7f7f", "member loop": "#7f7f7f", "vmap": "#1f77b4",
    "wide": "#ff7f0e", "compile": "#9467bd", "vmap+compile": "#9467bd", "cuda_graph": "#17becf",
    "floor": "#bcbd22", "torch.func": "#8c564b",
}
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

    def has(self, name: str) -> bool:
        return name in self._index()

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


def stage_color(first_node: str) -> str:
    """The palette colour of a stage whose first node is `first_node` (a stable hash, not its position)."""
    return PALETTE[zlib.crc32(first_node.encode()) % len(PALETTE)]


def stage_colors(plan: Plan) -> dict[str, str]:
    """{stage id: colour}, derived from each stage's first node: an edit elsewhere never recolours a stage,
    a merge keeps the colour of the stage that comes first, a split keeps it on the first part."""
    return {s.id: stage_color(s.nodes[0]) for s in plan.stages}


def hover_text(info: NodeInfo, stage_label: str) -> str:
    """Hover box of one fx node: name, op, shape, params, FLOPs, stage, and why it is not batchable."""
    lines = [
        f"<b>{info.name}</b>",
        f"op: {info.op} {info.target}",
        f"module: {info.module_path or '-'}",
        f"shape: {info.shape} {info.dtype}",
        f"params: {human(info.params)} · FLOPs: {human(info.flops)}",
        f"stage: {stage_label}",
    ]
    if not info.batchable:
        lines.append(f"<b>not batchable</b>: {info.reason or 'no reason given'}")
    return "<br>".join(lines)


def module_hover(vid: str, names: Sequence[str], data: GraphData, stage_ids: Sequence[str]) -> str:
    infos = [data.node(n) for n in names]
    bad = [i.name for i in infos if not i.batchable]
    lines = [
        f"<b>{vid[len(MODULE_PREFIX):]}</b> (collapsed, {plural(len(names), 'node')})",
        f"params: {human(sum(i.params for i in infos))} · FLOPs: {human(sum(i.flops for i in infos))}",
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
