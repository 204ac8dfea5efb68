"""Graphviz rendering of the stage-coloured graph (DOT text always, SVG when the `dot` binary exists).

The `graphviz` Python package only writes DOT text; rendering to SVG needs the
Graphviz binaries. Streamlit's st.graphviz_chart renders DOT in the browser,
so the static view works without them.
"""
from __future__ import annotations

import shutil

import graphviz

from stagewise.app.graph_view import CANNOT_BATCH, EXCLUDED_FILL, MODULE_PREFIX, GraphData, ViewGraph, stage_colors
from stagewise.planner.plan import Plan

LOOP_EDGE = "#555555"  # outline of member-loop stages: grey and dashed, never a stage colour


def tint(color: str, amount: float = 0.6) -> str:
    """`color` (#rrggbb) mixed with white: light fills keep black labels readable."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    mix = lambda c: round(c + (255 - c) * amount)  # noqa: E731
    return f"#{mix(r):02x}{mix(g):02x}{mix(b):02x}"


def _quote_free(s: str) -> str:
    return s.replace('"', "'")


def plan_dot(data: GraphData, view: ViewGraph, plan: Plan) -> str:
    """DOT text, top to bottom, one cluster per stage whose nodes are all in one stage; member-loop stages dashed grey.

    A stage excluded from vmap that runs batched (autotune's wide/compile) is drawn as batched, its label says both.
    """
    colors = stage_colors(plan)
    stage_of = {n: s.id for s in plan.stages for n in s.nodes}
    loops = {s.id for s in plan.stages if not s.runs_batched}
    g = graphviz.Digraph("stagewise", graph_attr={"rankdir": "TB", "fontname": "Helvetica", "fontsize": "11"},
                         node_attr={"fontname": "Helvetica", "fontsize": "10", "shape": "box", "style": "rounded,filled"},
                         edge_attr={"color": "#8a8a8a", "arrowsize": "0.6"})
    by_stage: dict[str, list[str]] = {}
    for vid in view.ids:
        sids = {stage_of.get(n, "?") for n in view.members[vid]}
        by_stage.setdefault(sids.pop() if len(sids) == 1 else "", []).append(vid)
    for s in plan.stages:
        vids = by_stage.get(s.id, [])
        if not vids:
            continue
        loop = s.id in loops
        label = f"{s.id} ({s.runs_as()}{', excluded from vmap' if s.mode.value == 'excluded' and not loop else ''})"
        with g.subgraph(name=f"cluster_{s.id}") as c:
            c.attr(label=label, color=LOOP_EDGE if loop else colors[s.id], style="dashed" if loop else "solid", penwidth="2")
            for vid in vids:
                c.node(_quote_free(vid), **_node_attrs(vid, data, colors[s.id], loop))
    for vid in by_stage.get("", []):  # a collapsed module spanning several stages
        first = stage_of.get(view.members[vid][0], "")
        g.node(_quote_free(vid), **_node_attrs(vid, data, colors.get(first, "#888888"), first in loops))
    for vid in by_stage.get("?", []):
        g.node(_quote_free(vid), label=vid)
    for u, v in view.edges:
        g.edge(_quote_free(u), _quote_free(v))
    return g.source


def _node_attrs(vid: str, data: GraphData, color: str, loop: bool) -> dict[str, str]:
    if vid.startswith(MODULE_PREFIX):
        label = f"{vid[len(MODULE_PREFIX):]}\\n(collapsed)"
        bad = False
    else:
        info = data.node(vid)
        label = f"{vid}\\n{info.shape}"
        bad = not info.batchable
    attrs = {"label": _quote_free(label), "fillcolor": EXCLUDED_FILL if loop else tint(color),
             "color": CANNOT_BATCH if bad else LOOP_EDGE if loop else color}
    if loop:
        attrs["style"] = "rounded,filled,dashed"
    if bad:
        attrs["penwidth"] = "2"
    return attrs


def has_dot_binary() -> bool:
    return shutil.which("dot") is not None


def dot_to_svg(dot_text: str) -> bytes | None:
    """SVG bytes, or None when the Graphviz `dot` binary is not installed (apt-get install graphviz)."""
    if not has_dot_binary():
        return None
    return graphviz.Source(dot_text).pipe(format="svg")
