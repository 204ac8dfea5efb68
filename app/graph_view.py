"""What the Plan page draws: plain graph data, module collapse, search, and the Plotly figure.

No streamlit here. `graph_data` is the only function that reads a ModelGraph
(its networkx DAG); everything after it works on frozen plain data that can be
cached, pickled and unit-tested with small fakes.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
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
FOLD_PREFIX = "fold:"  # view ids of folded runs of identical modules
OPEN_PREFIX = "open:"  # the "▾" tag of an expanded module: clicking it collapses the module
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
    """The graph as drawn: fx nodes, one box per collapsed module, one box per fold of repeated modules."""

    ids: tuple[str, ...]  # view node ids, topological order of their first member
    members: Mapping[str, tuple[str, ...]]  # view id -> fx node names it stands for
    edges: tuple[tuple[str, str], ...]
    folds: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # fold view id -> the module paths it folds

    def expand(self, view_ids: Iterable[str]) -> list[str]:
        """fx node names behind these view ids (unknown ids are dropped)."""
        out: list[str] = []
        for v in view_ids:
            out.extend(self.members.get(v, ()))
        return out

    def kind(self, vid: str) -> str:
        """"node", "module" (a collapsed module) or "fold" (repeated modules drawn as one box)."""
        return "fold" if vid.startswith(FOLD_PREFIX) else "module" if vid.startswith(MODULE_PREFIX) else "node"


def _owner(module_path: str, collapsed: Sequence[str]) -> str | None:
    """The outermost collapsed module that contains `module_path`, if any."""
    for prefix in collapsed:  # sorted shortest first, so the outermost wins
        if module_path == prefix or module_path.startswith(prefix + "."):
            return prefix
    return None


MIN_FOLD = 3  # this many identical sibling modules in a chain are drawn as one box "×k"


def module_signature(data: GraphData, path: str) -> tuple:
    """What makes two modules the same block: their nodes' ops, targets and shapes, relative to the module."""
    sig = []
    for n in data.nodes:
        if n.module_path == path or n.module_path.startswith(path + "."):
            rel = n.target[len(path) + 1:] if n.op == "call_module" and n.target.startswith(path + ".") else n.target
            sig.append((n.op, rel, n.module_path[len(path):], n.shape, n.dtype))
    return tuple(sig)


def _edges_between(view_of: Mapping[str, str], edges: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    out: dict[tuple[str, str], None] = {}
    for u, v in edges:
        e = (view_of[u], view_of[v])
        if e[0] != e[1]:
            out[e] = None
    return tuple(out)


def _fold_runs(data: GraphData, boxes: Sequence[str], edges: set[tuple[str, str]], unfolded: set[str]) -> list[list[str]]:
    """Runs of >= MIN_FOLD collapsed siblings p.i, p.i+1, ... that are the same block and feed each other in a chain."""
    by_parent: dict[str, dict[int, str]] = {}
    for path in boxes:
        parent, _, last = path.rpartition(".")
        if last.isdigit():
            by_parent.setdefault(parent, {})[int(last)] = path
    runs = []
    for parent, kids in by_parent.items():
        run: list[str] = []
        sig = None
        for i in sorted(kids):
            path = kids[i]
            here = module_signature(data, path)
            chained = run and int(run[-1].rpartition(".")[2]) == i - 1 and here == sig \
                and (MODULE_PREFIX + run[-1], MODULE_PREFIX + path) in edges
            if chained:
                run.append(path)
                continue
            if len(run) >= MIN_FOLD:
                runs.append(run)
            run, sig = [path], here
        if len(run) >= MIN_FOLD:
            runs.append(run)
    return [r for r in runs if r[0].rpartition(".")[0] not in unfolded]


def fold_id(paths: Sequence[str]) -> str:
    """"fold:layers.0-23" for the modules layers.0 ... layers.23."""
    parent, _, first = paths[0].rpartition(".")
    return f"{FOLD_PREFIX}{parent + '.' if parent else ''}{first}-{paths[-1].rpartition('.')[2]}"


def collapse(data: GraphData, modules: Iterable[str] = (), unfolded: Iterable[str] = ()) -> ViewGraph:
    """Contract every node under one of `modules` into a box `module:<path>`; nested choices fold into the outer one.

    A collapsed module holding a single node is drawn as that node. Runs of identical collapsed sibling
    modules (layers.0 ... layers.23, each feeding the next) are drawn as one box `fold:layers.0-23`
    unless their parent ("layers") is in `unfolded`.
    """
    collapsed = sorted(set(modules), key=lambda p: (p.count("."), p))
    owner_of: dict[str, str | None] = {}
    sizes: dict[str, int] = {}
    for n in data.nodes:
        owner = _owner(n.module_path, collapsed) if collapsed and n.module_path else None
        owner_of[n.name] = owner
        if owner:
            sizes[owner] = sizes.get(owner, 0) + 1
    view_of = {name: MODULE_PREFIX + o if o and sizes[o] > 1 else name for name, o in owner_of.items()}
    boxes = list(dict.fromkeys(v[len(MODULE_PREFIX):] for v in view_of.values() if v.startswith(MODULE_PREFIX)))
    folds: dict[str, tuple[str, ...]] = {}
    if len(boxes) >= MIN_FOLD:
        for run in _fold_runs(data, boxes, set(_edges_between(view_of, data.edges)), set(unfolded)):
            fid = fold_id(run)
            folds[fid] = tuple(run)
            inside = {MODULE_PREFIX + p for p in run}
            view_of = {name: fid if vid in inside else vid for name, vid in view_of.items()}
    members: dict[str, list[str]] = {}
    for n in data.nodes:
        members.setdefault(view_of[n.name], []).append(n.name)
    return ViewGraph(tuple(members), {k: tuple(v) for k, v in members.items()}, _edges_between(view_of, data.edges), folds)


AUTO_COLLAPSE_NODES = 300  # graphs larger than this open with modules collapsed
MAX_VIEW_NODES = 250  # auto-collapse aims at a drawn graph no larger than this


def modules_at_depth(data: GraphData, depth: int) -> list[str]:
    """Module paths with `depth` dots-plus-one parts (depth 1: "layers", depth 2: "layers.0", ...)."""
    return [p for p in data.module_paths() if p.count(".") == depth - 1]


def boxes_at_depth(data: GraphData, depth: int) -> list[str]:
    """Modules at `depth` holding more than one node: what "collapse all at depth" collapses (a one-node module
    is drawn as its node anyway)."""
    counts: dict[str, int] = {}
    for n in data.nodes:
        parts = n.module_path.split(".") if n.module_path else []
        if len(parts) >= depth:
            key = ".".join(parts[:depth])
            counts[key] = counts.get(key, 0) + 1
    return sorted(p for p, k in counts.items() if k > 1)


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


def clicked_view_id(event: Any) -> str | None:
    """The view id of a plain click (one point, no box or lasso drawn), or None for anything else."""
    try:
        sel = event["selection"]
        points = sel["points"]
    except (KeyError, TypeError):
        return None
    if sel.get("box") or sel.get("lasso") or not points:
        return None
    ids = {_point_id(p) for p in points} - {None}
    return ids.pop() if len(ids) == 1 else None


def _point_id(p: Any) -> str | None:
    cd = p.get("customdata") if isinstance(p, Mapping) else None
    if isinstance(cd, (list, tuple)):
        cd = cd[0] if cd else None
    return cd if isinstance(cd, str) else None


@dataclass(frozen=True)
class ViewChange:
    collapsed: tuple[str, ...]
    unfolded: tuple[str, ...]
    message: str


def child_modules(data: GraphData, path: str) -> list[str]:
    """Direct child modules of `path` that hold more than one node (one-node modules draw as their node anyway)."""
    depth = path.count(".") + 1
    counts: dict[str, int] = {}
    for n in data.nodes:
        if n.module_path.startswith(path + "."):
            child = ".".join(n.module_path.split(".")[: depth + 1])
            counts[child] = counts.get(child, 0) + 1
    return [c for c, k in counts.items() if k > 1]


def toggle(data: GraphData, view: ViewGraph, vid: str, collapsed: Iterable[str], unfolded: Iterable[str]) -> ViewChange:
    """What a click on a module box, a fold or an expanded module's tag does to the view.

    - a collapsed module box opens one level: its child modules become boxes (so a big block opens
      into its parts, not into hundreds of nodes);
    - a fold of k identical blocks shows the k blocks (each still collapsed);
    - an expanded module's tag collapses it into one box again (and forgets what was open inside).
    """
    col, unf = set(collapsed), set(unfolded)
    if vid.startswith(OPEN_PREFIX):
        path = vid[len(OPEN_PREFIX):]
        col = {c for c in col if not c.startswith(path + ".")} | {path}
        unf = {u for u in unf if u != path and not u.startswith(path + ".")}
        msg = f"collapsed {path}"
    elif view.kind(vid) == "fold":
        unf.add(view.folds[vid][0].rpartition(".")[0])  # the parent: its blocks stay unfolded while others open
        msg = f"unfolded {len(view.folds[vid])} identical blocks {vid[len(FOLD_PREFIX):]}"
    elif view.kind(vid) == "module":
        path = vid[len(MODULE_PREFIX):]
        kids = child_modules(data, path)
        col = (col - {path}) | set(kids)
        msg = f"expanded {path}" + (f" into {plural(len(kids), 'module box', 'module boxes')}" if kids else "")
    else:
        return ViewChange(tuple(sorted(col)), tuple(sorted(unf)), "")
    return ViewChange(tuple(sorted(col)), tuple(sorted(unf)), msg)


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
