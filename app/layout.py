"""Layered top-to-bottom layout of a DAG, computed server-side (no streamlit here).

Sugiyama in miniature: longest-path layers (networkx topological generations),
a few barycenter sweeps to order each layer, then x positions pulled towards
the parents' mean and pushed apart to a minimum spacing. Good enough for
model graphs, which are mostly chains with skip connections; linear in edges
per sweep, so a 1,000-node graph lays out in well under a second.
"""
from __future__ import annotations

from typing import Hashable, Iterable, Mapping

import networkx as nx

Pos = dict[Hashable, tuple[float, float]]

_SWEEPS = 4  # more sweeps rarely remove further crossings on model graphs


def layers_of(nodes: Iterable[Hashable], edges: Iterable[tuple[Hashable, Hashable]]) -> list[list[Hashable]]:
    """Nodes grouped by longest-path depth from the inputs; cycles are layered by their strongly connected component."""
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    if nx.is_directed_acyclic_graph(g):
        layer = {n: i for i, gen in enumerate(nx.topological_generations(g)) for n in gen}
        # Sources (parameters, constants, inputs) sit just above their first consumer instead of all
        # in the top row: export graphs lift every weight to an input, and long edges would cross everything.
        for n in g.nodes:
            if g.in_degree(n) == 0 and g.out_degree(n) > 0:
                layer[n] = min(layer[s] for s in g.successors(n)) - 1
        out: dict[int, list[Hashable]] = {}
        for n in g.nodes:
            out.setdefault(layer[n], []).append(n)
        return [out[k] for k in sorted(out)]
    # A collapsed module view can contain cycles (a module called twice with
    # other work in between); layer the condensation and keep members together.
    cond = nx.condensation(g)
    members = cond.graph["mapping"]  # node -> component id
    comp_layers = {c: i for i, layer in enumerate(nx.topological_generations(cond)) for c in layer}
    out: list[list[Hashable]] = [[] for _ in range(max(comp_layers.values(), default=-1) + 1)]
    for n in g.nodes:
        out[comp_layers[members[n]]].append(n)
    return out


def _order_layers(layers: list[list[Hashable]], preds: Mapping, succs: Mapping) -> list[list[Hashable]]:
    """Reorder each layer by the barycenter of its neighbours' indices (down and up sweeps)."""
    index = {n: i for layer in layers for i, n in enumerate(layer)}

    def bary(n: Hashable, nbrs: Mapping) -> float:
        ns = [index[m] for m in nbrs[n] if m in index]
        return sum(ns) / len(ns) if ns else index[n]

    for sweep in range(_SWEEPS):
        rng = range(1, len(layers)) if sweep % 2 == 0 else range(len(layers) - 2, -1, -1)
        nbrs = preds if sweep % 2 == 0 else succs
        for li in rng:
            layer = sorted(layers[li], key=lambda n: (bary(n, nbrs), index[n]))
            layers[li] = layer
            index.update({n: i for i, n in enumerate(layer)})
    return layers


def _spread(xs: list[float], spacing: float) -> list[float]:
    """Push sorted wishes apart to `spacing`, keeping their mean where it was."""
    if not xs:
        return xs
    out = list(xs)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1] + spacing)
    shift = (sum(xs) - sum(out)) / len(out)
    return [x + shift for x in out]


def layered_layout(
    nodes: Iterable[Hashable],
    edges: Iterable[tuple[Hashable, Hashable]],
    *,
    x_spacing: float = 1.0,
    y_spacing: float = 1.0,
) -> Pos:
    """Positions {node: (x, y)}, inputs at the top (y = 0) and later layers below (negative y).

    Args:
        nodes: node ids (hashable); order is used as the tie-break, pass them topologically.
        edges: (src, dst) pairs between those ids.
    Returns:
        a dict with one (x, y) per node; nodes of one layer share y and are at least `x_spacing` apart.
    """
    nodes = list(nodes)
    edges = [(u, v) for u, v in edges if u != v]
    order = {n: i for i, n in enumerate(nodes)}
    layers = [sorted(layer, key=order.__getitem__) for layer in layers_of(nodes, edges)]
    preds: dict[Hashable, list[Hashable]] = {n: [] for n in nodes}
    succs: dict[Hashable, list[Hashable]] = {n: [] for n in nodes}
    for u, v in edges:
        preds[v].append(u)
        succs[u].append(v)
    layers = _order_layers(layers, preds, succs)

    x: dict[Hashable, float] = {}
    for layer in layers:
        wishes = []
        for i, n in enumerate(layer):
            placed = [x[p] for p in preds[n] if p in x]
            wishes.append(sum(placed) / len(placed) if placed else (i - (len(layer) - 1) / 2) * x_spacing)
        # the layer order (from the sweeps) wins over the wishes: hand out sorted wishes left to right
        xs = _spread(sorted(wishes), x_spacing)
        x.update(zip(layer, xs))
    return {n: (x[n], -li * y_spacing) for li, layer in enumerate(layers) for n in layer}
