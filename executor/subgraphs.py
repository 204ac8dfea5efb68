"""executor.subgraphs: a graph's nodes, those inside its regions' sub-graphs too.

torch.export keeps a `with torch.no_grad():` (or `torch.enable_grad()`, autocast) block of forward() as a graph of its
own: the parent graph calls a higher-order op, `wrap_with_set_grad_enabled(False, submod_1, x, fc_weight, ...)`, whose
sub-graph (a GraphModule attribute of the parent) takes the operands as placeholders. A check that walks only
`gm.graph.nodes` misses what happens in the block (a buffer written in place, a BatchNorm updating its statistics, a
Dropout): `walk` visits every node, and `Scope.outer` follows a sub-graph's placeholder to the operand the call passes
it, so a write inside the block can be said as a write of the parent's value (a get_attr of a buffer, an input).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

_MAX_DEPTH = 8  # regions nested in regions; deeper ones are not looked into (no model nests that far)


@dataclass(frozen=True)
class Scope:
    """One graph of the nest: `gm`, and where it is called from (`parent` None for the graph walked)."""
    gm: torch.fx.GraphModule
    parent: Optional["Scope"] = None  # the graph holding the call of this one
    call: Optional[torch.fx.Node] = None  # the higher-order op node in parent.gm that runs this graph
    operands: tuple = ()  # the call's operands, one per placeholder of gm, in order

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    @property
    def entry(self) -> torch.fx.Node | None:
        """The region call in the walked graph this scope is reached through (None for the walked graph)."""
        if self.parent is None:
            return None
        return self.call if self.parent.parent is None else self.parent.entry

    def outer(self, value: torch.fx.Node) -> tuple["Scope", torch.fx.Node] | None:
        """For a placeholder of this sub-graph, (the parent scope, the operand the call passes it); None for any other
        value, the walked graph's own placeholders and an operand that is no graph value (a number)."""
        if self.parent is None or value.op != "placeholder":
            return None
        places = [p for p in self.gm.graph.nodes if p.op == "placeholder"]
        at = places.index(value) if value in places else -1
        if 0 <= at < len(self.operands) and isinstance(self.operands[at], torch.fx.Node):
            return self.parent, self.operands[at]
        return None


def _sub_of(gm: torch.fx.GraphModule, a: object) -> torch.fx.GraphModule | None:
    """The GraphModule a get_attr argument `a` of a call names in `gm`, else None."""
    if not (isinstance(a, torch.fx.Node) and a.op == "get_attr"):
        return None
    obj: object = gm
    for part in str(a.target).split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.fx.GraphModule) else None


def region_calls(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[tuple[str, torch.fx.GraphModule, tuple]]:
    """(its attribute name in `gm`, the sub-graph, the operands its placeholders take) for each sub-graph a
    higher-order op node of `gm` runs: the operands are the call's arguments after its last sub-graph
    (`wrap_with_set_grad_enabled(False, sub, *operands)`, `wrap_with_autocast(..., sub, *operands)`), or the one tuple
    there (`cond(pred, true_gm, false_gm, (operands,))`); [] for any other node."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    subs = [(k, s) for k, s in ((k, _sub_of(gm, a)) for k, a in enumerate(node.args)) if s is not None]
    if not subs:
        return []
    names = [str(node.args[k].target) for k, _ in subs]
    operands = tuple(node.args[subs[-1][0] + 1:])
    if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
        operands = tuple(operands[0])
    return [(name, s, operands) for name, (_, s) in zip(names, subs)]


def walk(gm: torch.fx.GraphModule, scope: Scope | None = None) -> Iterator[tuple[Scope, torch.fx.Node]]:
    """(scope, node) for every node of `gm` in order, each region call followed by the nodes of its sub-graph(s),
    recursively (up to _MAX_DEPTH levels)."""
    scope = scope or Scope(gm)
    for node in gm.graph.nodes:
        yield scope, node
        if scope.depth >= _MAX_DEPTH:
            continue
        for _, sub, operands in region_calls(gm, node):
            yield from walk(sub, Scope(sub, scope, node, operands))


def root_outside(scope: Scope, value: torch.fx.Node,
                 root: Callable[[torch.fx.Node], torch.fx.Node]) -> tuple[Scope, torch.fx.Node]:
    """What `value` (of scope.gm) is furthest back by `root` (a view's base: alias_chain(v)[-1], storage_root), followed
    out of sub-graphs through the operands their calls pass: a buffer a no_grad block writes is the parent's get_attr.
    Returns the scope the search ended in and the value there (the walked graph's scope where it got that far)."""
    node = root(value)
    while True:
        up = scope.outer(node)
        if up is None:
            return scope, node
        scope, node = up
        node = root(node)


def subgraph_codes(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """(attribute path, sub-graph) of every region sub-graph `gm` calls, recursively, in the order the calls come."""
    out, seen = [], set()
    paths = {id(gm): ""}
    for scope, node in walk(gm):
        for name, sub, _ in region_calls(scope.gm, node):
            if id(sub) not in seen:
                seen.add(id(sub))
                paths[id(sub)] = f"{paths[id(scope.gm)]}.{name}" if paths.get(id(scope.gm)) else name
                out.append((paths[id(sub)], sub))
    return out
