"""A torch.export graph run at a low-precision plan dtype (bfloat16, float16) with the dtypes the model asks for.

torch.export writes the dtypes forward() computed at trace time into the graph as constants: a cast back to the
input's dtype (`h.to(input_dtype)` in an RMSNorm), `torch.zeros(..., dtype=x.dtype)`, the dtype checks it adds
(`_assert_tensor_metadata`). Traced in float32, they all say float32, so a bfloat16 plan of that graph would feed
float32 values to bfloat16 weights. Casting every float32 to the plan's dtype would be wrong too: a model's own
upcasts (rotary positions, a norm's variance) are there to keep float32 precision.

So the member is traced once more, in the plan's dtype, and each dtype constant of the float32 graph is replaced
by the one at the same place in that trace: the graph then casts where eager forward() in that dtype would. The
two traces must be the same program apart from dtypes (same nodes, same targets, same arguments); where they are
not (forward() branches on the dtype), nothing is replaced and the reason is kept for the error message.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from stagewise.planner.errors import PlanMismatchError, StagewiseError
from stagewise.planner.graph import ModelGraph, add_edges, retrace
from stagewise.planner.plan import Plan
from stagewise.planner.validate import validate
from stagewise.planner.snapshot import deepcopy_module

aten = torch.ops.aten
# ops that only change a value's dtype (or device): the two traces may read a value through one where the other
# reads it directly (a float32 trace's `mul(to(h, float32), r)` is the bfloat16 trace's `mul(h, r)` with `h` cast)
_CONVERSIONS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default,
                aten.alias.default}


def _source(node: torch.fx.Node) -> torch.fx.Node:
    while node.op == "call_function" and node.target in _CONVERSIONS and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _differs(a: Any, b: Any) -> bool:
    """Whether argument `a` of the first trace and `b` of the second are not the same program apart from dtypes."""
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)) or _source(a).name != _source(b).name
    if isinstance(a, torch.dtype) or isinstance(b, torch.dtype):
        return not (isinstance(a, torch.dtype) and isinstance(b, torch.dtype))
    if type(a) is float and type(b) is float:  # torch.finfo(x.dtype).min for a mask, an eps: taken from the second
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(_differs(a[k], b[k]) for k in a)
    return type(a) is not type(b) or not (a == b or (a != a and b != b))  # NaN equals NaN here


def _as_in(b: Any, nodes: dict[str, torch.fx.Node]) -> Any:
    """Argument `b` of the second trace in the first: its nodes by name, its constants as they are."""
    return torch.fx.node.map_arg(b, lambda n: nodes[n.name])


def _has_dtype(a: Any) -> bool:
    """Whether argument `a` holds a constant that may depend on the trace's dtype (a dtype, a float)."""
    if isinstance(a, torch.dtype) or type(a) is float:
        return True
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.fx.Node):
        return any(_has_dtype(x) for x in a)
    if isinstance(a, dict):
        return any(_has_dtype(x) for x in a.values())
    return False


def _describe(node: torch.fx.Node | None) -> str:
    return "nothing" if node is None else f"{node.name} ({node.op} {getattr(node.target, '__name__', node.target)})"


def dtype_rewrites(gm: torch.fx.GraphModule, low: torch.fx.GraphModule) -> tuple[list[tuple[torch.fx.Node, tuple, dict]], str]:
    """([(node of `gm` or of a graph it nests, args, kwargs as `low` has them, its nodes by name)], "") where `gm` and
    `low` are one program apart from dtypes, float constants (torch.finfo(dtype).min) and casts that were no-ops in
    one of them and not in the other (a node reading `h` in one reads `h.to(torch.float32)` in the other); ([], the
    first difference) where they are not. The graphs of higher-order ops (a `torch.no_grad()` region) are compared
    and rewritten as well."""
    ours, theirs = list(gm.graph.nodes), list(low.graph.nodes)
    for k in range(max(len(ours), len(theirs))):
        a = ours[k] if k < len(ours) else None
        b = theirs[k] if k < len(theirs) else None
        if a is None or b is None or (a.op, a.name, a.target) != (b.op, b.name, b.target):
            return [], f"at node {k} the float32 trace has {_describe(a)} where it has {_describe(b)}"
        if _differs(a.args, b.args) or _differs(dict(a.kwargs), dict(b.kwargs)):
            return [], f"{a.name} takes other arguments ({a.args}, {dict(a.kwargs)} against {b.args}, {dict(b.kwargs)})"
    nodes = {n.name: n for n in ours}
    rewrites = []
    for a, b in zip(ours, theirs):
        if a.op == "get_attr":
            inner, other = _attr(gm, str(a.target)), _attr(low, str(b.target))
            if isinstance(inner, torch.fx.GraphModule) or isinstance(other, torch.fx.GraphModule):
                if not (isinstance(inner, torch.fx.GraphModule) and isinstance(other, torch.fx.GraphModule)):
                    return [], f"{a.name} is a graph in one trace only"
                nested, why = dtype_rewrites(inner, other)
                if why:
                    return [], f"in {a.name}: {why}"
                rewrites += nested
            continue
        args, kwargs = _as_in(tuple(b.args), nodes), _as_in(dict(b.kwargs), nodes)
        if a.op != "output" and (args != tuple(a.args) or kwargs != dict(a.kwargs)):
            rewrites.append((a, args, kwargs))
    return rewrites, ""


def _attr(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part, None)
    return module


def _cast(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def take_dtypes_of_a_trace_in(graph: ModelGraph, plan: Plan, member: nn.Module, dtype: torch.dtype,
                              example: Sequence[Any] | None) -> tuple[str, dict[str, torch.dtype]]:
    """Make `graph` (a torch.export trace of `member` in float32, which `plan` is for) the program of a trace of
    `member` cast to `dtype` (its floating example inputs too), where the two differ only as dtype_rewrites allows.
    Returns ("", {constant: dtype}) when done (or nothing to do): the graph's tensor constants that are not member
    state and keep another dtype than `dtype` in that trace (`torch.tensor(d, dtype=torch.float)` made in forward(),
    which `member.to(dtype)` does not cast); else (why it could not be, {}), `graph` then as it was."""
    refused, kept = _take_dtypes(graph, plan, member, dtype, example)
    return refused, ({} if refused else kept)


def _take_dtypes(graph: ModelGraph, plan: Plan, member: nn.Module, dtype: torch.dtype,
                 example: Sequence[Any] | None) -> tuple[str, dict[str, torch.dtype]]:
    if example is None:
        return "there are no example inputs to trace it with", {}
    gm = graph.gm
    if not any(_has_dtype(n.args) or _has_dtype(dict(n.kwargs))
               for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes):
        return "", {}  # nothing a trace in another dtype could change
    low = deepcopy_module(member).to(dtype)
    try:
        traced = retrace(low, "export", tuple(tree_map(lambda x: _cast(x, dtype), tuple(example))),
                         [i.name for i in plan.inputs], plan.opened_modules)
    except StagewiseError as e:
        return f"it could not be traced in {dtype} ({str(e).splitlines()[0][:300]})", {}
    rewrites, why = dtype_rewrites(gm, traced.gm)
    if why:
        return f"its trace in {dtype} is another program: {why[:400]}", {}
    before = [(node, node.args, node.kwargs) for node, _, _ in rewrites]
    edges = list(graph.dag.edges(data=True))

    def apply(change: list[tuple[torch.fx.Node, tuple, dict]]) -> None:
        for node, args, kwargs in change:
            node.args, node.kwargs = args, kwargs
        graph.dag.remove_edges_from(list(graph.dag.edges))

    apply(rewrites)
    add_edges(graph.dag, gm)
    try:
        validate(plan, graph)  # a stage now reading a cast another stage makes may break the plan's invariants
    except PlanMismatchError as e:
        apply(before)
        graph.dag.add_edges_from(edges)
        return f"the plan's stages do not fit its trace in {dtype} ({str(e).splitlines()[0][:300]})", {}
    for graph_module in {id(node.graph.owning_module): node.graph.owning_module for node, _, _ in rewrites}.values():
        graph_module.recompile()
    state = {k for k, _ in member.named_parameters(remove_duplicate=False)} | {k for k, _ in member.named_buffers(remove_duplicate=False)}
    kept = {}
    for node in gm.graph.nodes:
        theirs = _attr(traced.gm, str(node.target)) if node.op == "get_attr" and str(node.target) not in state else None
        if isinstance(theirs, torch.Tensor) and theirs.is_floating_point() and theirs.dtype != dtype:
            kept[str(node.target)] = theirs.dtype
    return "", kept
