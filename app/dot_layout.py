"""Graphviz `dot` layout of the drawn graph: labelled node boxes and routed spline edges; stage regions.

No streamlit here. `layout(spec)` runs `dot -Tjson0` once per distinct spec (cached), and
returns plain geometry in dot's units (points, y up): the figure draws it with Plotly.
Without the `dot` binary (apt-get install graphviz) the in-house layered layout stands in:
same boxes, straight edges.

The layout does not depend on the plan: an edit recolours and reshapes the stage regions
(`regions`, drawn around the boxes of each stage) but never moves a node. The graph's spine
(the nodes every path from the inputs to the outputs passes through: a residual stream) is one
dot `group`, so it runs straight down and the blocks hang beside it, as readers of model graphs expect.
"""
from __future__ import annotations

import functools
import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import networkx as nx

from stagewise.app.layout import layered_layout

POINTS_PER_INCH = 72.0
FONT_PT = 10.0  # node label size in dot; the figure scales its text with the drawing
CHAR_PT = 5.6  # average width of one 10 pt Helvetica character (the fallback sizes boxes with it)
DOT_TIMEOUT_S = 60.0  # a pathological graph falls back to the layered layout instead of hanging the page
BEZIER_STEPS = 6  # points per cubic segment of a routed edge


@dataclass(frozen=True)
class Spec:
    """What is laid out: nodes (view id, label lines) and edges between view ids."""

    nodes: tuple[tuple[str, tuple[str, ...]], ...]
    edges: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Box:
    x: float  # centre, points
    y: float
    w: float
    h: float

    def polygon(self, pad: float = 0.0) -> list[tuple[float, float]]:
        x0, x1 = self.x - self.w / 2 - pad, self.x + self.w / 2 + pad
        y0, y1 = self.y - self.h / 2 - pad, self.y + self.h / 2 + pad
        return [(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)]


@dataclass(frozen=True)
class Edge:
    tail: str
    head: str
    path: tuple[tuple[float, float], ...]  # polyline sampled from dot's spline (or a straight segment)
    arrow: tuple[tuple[float, float], ...]  # closed triangle at the head


@dataclass(frozen=True)
class Drawing:
    boxes: Mapping[str, Box]
    edges: tuple[Edge, ...]
    width: float
    height: float
    engine: str  # "dot" or "layered" (no dot binary, or dot failed)
    seconds: float  # time the layout took


def has_dot() -> bool:
    return shutil.which("dot") is not None


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def spine(spec: Spec) -> set[str]:
    """Nodes on every path from the inputs to an output (dominators of the sinks from a root above all sources)."""
    g = nx.DiGraph()
    g.add_nodes_from(vid for vid, _ in spec.nodes)
    g.add_edges_from((u, v) for u, v in spec.edges if u != v)
    if not nx.is_directed_acyclic_graph(g):
        return set()
    root = object()
    g.add_edges_from((root, n) for n in list(g.nodes) if g.in_degree(n) == 0)
    idom = nx.immediate_dominators(g, root)
    out: set[str] = set()
    for sink in (n for n in g.nodes if g.out_degree(n) == 0):
        n = sink
        while n is not root and n not in out:
            out.add(n)
            n = idom[n]
    return out


def dot_source(spec: Spec) -> str:
    """DOT text for `spec`: nodes named n0, n1, ... (view ids can hold any character); the spine is one group."""
    ids = {vid: f"n{i}" for i, (vid, _) in enumerate(spec.nodes)}
    straight = spine(spec)
    lines = ["digraph g {", "graph [rankdir=TB, newrank=true, ranksep=0.22, nodesep=0.18];",
             f'node [shape=box, fontname="Helvetica", fontsize={FONT_PT:g}, height=0.3, margin="0.06,0.02"];',
             "edge [arrowsize=0.5];"]
    for vid, label in spec.nodes:
        text = "\\n".join(_escape(line) for line in label)  # dot's line break is the two characters \n
        group = ", group=spine" if vid in straight else ""
        lines.append(f'{ids[vid]} [label="{text}"{group}];')
    lines += [f"{ids[u]} -> {ids[v]};" for u, v in spec.edges if u in ids and v in ids and u != v]
    lines.append("}")
    return "\n".join(lines)


def _points(text: str) -> tuple[float, float]:
    x, y = text.split(",")[:2]
    return float(x), float(y)


def _bezier(ctrl: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sample a piecewise cubic Bezier (p0, c1, c2, p1, c1, c2, p2, ...) as a polyline."""
    out = [ctrl[0]]
    for k in range(0, len(ctrl) - 3, 3):
        p0, c1, c2, p1 = ctrl[k:k + 4]
        for s in range(1, BEZIER_STEPS + 1):
            t = s / BEZIER_STEPS
            a, b, c, d = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t ** 2, t ** 3
            out.append((a * p0[0] + b * c1[0] + c * c2[0] + d * p1[0], a * p0[1] + b * c1[1] + c * c2[1] + d * p1[1]))
    return out


def _arrow(tip: tuple[float, float], back: tuple[float, float], size: float = 6.0) -> tuple[tuple[float, float], ...]:
    dx, dy = tip[0] - back[0], tip[1] - back[1]
    norm = (dx * dx + dy * dy) ** 0.5 or 1.0
    ux, uy = dx / norm, dy / norm
    bx, by = tip[0] - ux * size, tip[1] - uy * size
    half = size * 0.45
    return (tip, (bx - uy * half, by + ux * half), (bx + uy * half, by - ux * half), tip)


def _parse(spec: Spec, out: Mapping) -> tuple[dict, list, float, float]:
    vids = [vid for vid, _ in spec.nodes]
    boxes: dict[str, Box] = {}
    by_gvid: dict[int, str] = {}
    for obj in out.get("objects", []):
        name = obj.get("name", "")
        if name.startswith("n") and "pos" in obj:
            vid = vids[int(name[1:])]
            x, y = _points(obj["pos"])
            boxes[vid] = Box(x, y, float(obj["width"]) * POINTS_PER_INCH, float(obj["height"]) * POINTS_PER_INCH)
            by_gvid[int(obj["_gvid"])] = vid
    edges = []
    for e in out.get("edges", []):
        tail, head = by_gvid.get(e.get("tail")), by_gvid.get(e.get("head"))
        if tail is None or head is None or "pos" not in e:
            continue
        end = None
        ctrl = []
        for tok in e["pos"].split():
            if tok.startswith("e,"):
                end = _points(tok[2:])
            elif not tok.startswith("s,"):
                ctrl.append(_points(tok))
        path = _bezier(ctrl) if len(ctrl) >= 4 else ctrl
        if end is not None:
            arrow = _arrow(end, path[-1])
        else:
            arrow = _arrow(path[-1], path[-2]) if len(path) >= 2 else ()
        edges.append(Edge(tail, head, tuple(path), arrow))
    x0, y0, x1, y1 = (float(v) for v in out["bb"].split(","))
    return boxes, edges, x1 - x0, y1 - y0


def _dot(spec: Spec) -> Drawing:
    t0 = time.perf_counter()
    proc = subprocess.run(["dot", "-Tjson0"], input=dot_source(spec).encode(), capture_output=True,
                          timeout=DOT_TIMEOUT_S, check=True)
    boxes, edges, w, h = _parse(spec, json.loads(proc.stdout))
    if len(boxes) != len(spec.nodes):
        raise ValueError(f"dot placed {len(boxes)} of {len(spec.nodes)} nodes")
    return Drawing(boxes, tuple(edges), w, h, "dot", time.perf_counter() - t0)


def _layered(spec: Spec) -> Drawing:
    """The fallback: layered positions, boxes sized from their labels, straight edges."""
    t0 = time.perf_counter()
    sizes = {vid: (max(len(line) for line in label) * CHAR_PT + 12, 12.0 * len(label) + 6) for vid, label in spec.nodes}
    widest = max((w for w, _ in sizes.values()), default=60.0)
    pos = layered_layout([vid for vid, _ in spec.nodes], spec.edges, x_spacing=widest + 14, y_spacing=1.0)
    step = max((h for _, h in sizes.values()), default=22.0) + 16
    left = min((p[0] for p in pos.values()), default=0.0) - widest / 2 - 10
    bottom = min((p[1] for p in pos.values()), default=0.0) * step - step
    boxes = {vid: Box(pos[vid][0] - left, pos[vid][1] * step - bottom, *sizes[vid]) for vid, _ in spec.nodes}
    edges = []
    for u, v in spec.edges:
        if u in boxes and v in boxes and u != v:
            a, b = boxes[u], boxes[v]
            start, end = (a.x, a.y - a.h / 2), (b.x, b.y + b.h / 2)
            edges.append(Edge(u, v, (start, end), _arrow(end, start)))
    width = max((b.x + b.w / 2 for b in boxes.values()), default=0.0) + 10
    height = max((b.y + b.h / 2 for b in boxes.values()), default=0.0) + 10
    return Drawing(boxes, tuple(edges), width, height, "layered", time.perf_counter() - t0)


def regions(boxes: Mapping[str, Box], groups: Mapping[str, Sequence[str]], pad: float = 5.0) -> dict[str, list[list[tuple[float, float]]]]:
    """A shaded region per group (a stage) hugging its boxes: {group: [polygon, ...]}.

    The drawing's rows (boxes sharing a y) are walked top to bottom; a group's boxes in one row
    make one band (leftmost to rightmost box, padded), and bands of consecutive rows join into
    one staircase polygon reaching halfway across the gap between the rows. A group whose rows
    are interrupted by another group's row gets one polygon per unbroken run.
    """
    row_of = sorted({round(b.y, 1) for b in boxes.values()}, reverse=True)  # top (largest y) first
    row_index = {y: i for i, y in enumerate(row_of)}
    half = {}
    for b in boxes.values():
        half[round(b.y, 1)] = max(half.get(round(b.y, 1), 0.0), b.h / 2)
    out: dict[str, list[list[tuple[float, float]]]] = {}
    for gid, vids in groups.items():
        bands: dict[int, list[float]] = {}
        for vid in vids:
            b = boxes.get(vid)
            if b is None:
                continue
            i = row_index[round(b.y, 1)]
            x0, x1 = b.x - b.w / 2 - pad, b.x + b.w / 2 + pad
            band = bands.setdefault(i, [x0, x1])
            band[0], band[1] = min(band[0], x0), max(band[1], x1)
        runs: list[list[int]] = []
        for i in sorted(bands):
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        polys = []
        for run in runs:
            tops, bottoms = [], []
            for k, i in enumerate(run):
                y = row_of[i]
                top = y + half[y] + pad
                bottom = y - half[y] - pad
                if k > 0:  # meet the band above halfway across the gap
                    above = row_of[run[k - 1]]
                    top = ((above - half[above]) + (y + half[y])) / 2
                if k + 1 < len(run):
                    below = row_of[run[k + 1]]
                    bottom = ((y - half[y]) + (below + half[below])) / 2
                tops.append(top)
                bottoms.append(bottom)
            right = [pt for k, i in enumerate(run) for pt in ((bands[i][1], tops[k]), (bands[i][1], bottoms[k]))]
            left = [pt for k, i in reversed(list(enumerate(run))) for pt in ((bands[i][0], bottoms[k]), (bands[i][0], tops[k]))]
            polys.append(right + left + [right[0]])
        out[gid] = polys
    return out


@functools.lru_cache(maxsize=64)
def layout(spec: Spec) -> Drawing:
    """The drawing of `spec`: dot when its binary is installed, else the layered fallback. Cached per spec."""
    if has_dot() and spec.nodes:
        try:
            return _dot(spec)
        except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError):
            pass  # a dot failure must not cost the user the page: the layered layout draws the same graph
    return _layered(spec)
