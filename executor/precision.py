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

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from stagewise.executor.constants import _ATEN_SCALAR_TO_TENSOR, _LEAKY, LIFTED_PREFIX, _attr, leaky_relu_per_member
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


def _lifted(node: Any) -> bool:
    """A get_attr of a per-member constant lift_member_constants put where the trace had a number."""
    return isinstance(node, torch.fx.Node) and node.op == "get_attr" and str(node.target).startswith(LIFTED_PREFIX)


def _same_op(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether `a` (first trace) runs `b`'s op: the same target, or the tensor form lift_member_constants gave it for
    a number members hold differently (`pow.Tensor_Scalar` -> `pow.Tensor_Tensor`, leaky_relu -> its per-member form)."""
    if a.target == b.target:
        return True
    if not any(_lifted(x) for x in a.all_input_nodes):
        return False
    if a.target is leaky_relu_per_member:
        return b.target in _LEAKY
    return (isinstance(b.target, torch._ops.OpOverload)
            and a.target is _ATEN_SCALAR_TO_TENSOR.get(b.target._schema.name.split("::")[-1]))


def _differs(a: Any, b: Any, pair: dict[torch.fx.Node, torch.fx.Node]) -> bool:
    """Whether argument `a` of the first trace and `b` of the second are not one program apart from dtypes; `pair`
    maps the second trace's nodes to the first's."""
    if _lifted(a) and isinstance(b, (int, float)):  # a number members hold differently, one per member now
        return False
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)) or pair.get(_source(b)) is not _source(a)
    if isinstance(a, torch.dtype) or isinstance(b, torch.dtype):
        return not (isinstance(a, torch.dtype) and isinstance(b, torch.dtype))
    if type(a) is float and type(b) is float:  # torch.finfo(x.dtype).min for a mask, an eps: taken from the second
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y, pair) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(_differs(a[k], b[k], pair) for k in a)
    return type(a) is not type(b) or not (a == b or (a != a and b != b))  # NaN equals NaN here


def _as_in(a: Any, b: Any, pair: dict[torch.fx.Node, torch.fx.Node]) -> Any:
    """Argument `b` of the second trace (its counterpart `a` in the first, _differs) in the first: its nodes their
    counterparts, its dtypes and floats as they are; a per-member constant of the first stays."""
    if _lifted(a):
        return a
    if isinstance(b, torch.fx.Node):
        return pair[b]
    if isinstance(b, (list, tuple)) and not hasattr(b, "_fields"):
        return type(b)(_as_in(x, y, pair) for x, y in zip(a, b))
    if isinstance(b, dict):
        return type(b)({k: _as_in(a[k], b[k], pair) for k in b})
    return b


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


@dataclass
class Rewrites:
    """What makes a float32 trace the program of a trace in a low-precision dtype (dtype_rewrites)."""

    nodes: list[tuple[torch.fx.Node, tuple, dict]] = field(default_factory=list)  # (node, args, kwargs as there)
    # (graph module, attribute, the other trace's tensor): a constant whose value depends on the dtype
    # (`torch.tensor(torch.finfo(dtype).min, dtype=dtype)`), or made in float32 whatever the weights' dtype
    constants: list[tuple[torch.nn.Module, str, torch.Tensor]] = field(default_factory=list)


def dtype_rewrites(gm: torch.fx.GraphModule, low: torch.fx.GraphModule, state: set[str] = frozenset()) -> tuple[Rewrites, str]:
    """(what to change in `gm` to run it as `low` runs, "") where the two traces are one program apart from dtypes,
    float constants (torch.finfo(dtype).min), the values of tensor constants that are not member state (`state`), and
    casts that were no-ops in one of them and not in the other (a node reading `h` in one reads `h.to(torch.float32)`
    in the other); (nothing, the first difference) where they are not. Nodes pair by position, each with the same op
    and target (names may differ); per-member constants lift_member_constants added to `gm` stay. The graphs of
    higher-order ops (a `torch.no_grad()` region) are compared and rewritten as well."""
    ours = [n for n in gm.graph.nodes if not _lifted(n)]
    theirs = list(low.graph.nodes)
    pair: dict[torch.fx.Node, torch.fx.Node] = {}
    out = Rewrites()
    for k in range(max(len(ours), len(theirs))):
        a = ours[k] if k < len(ours) else None
        b = theirs[k] if k < len(theirs) else None
        if a is None or b is None or a.op != b.op or (a.op != "get_attr" and not _same_op(a, b)):
            return Rewrites(), f"at node {k} the float32 trace has {_describe(a)} where it has {_describe(b)}"
        pair[b] = a
        if a.op != "get_attr":
            continue
        inner, other = _attr(gm, str(a.target)), _attr(low, str(b.target))
        if isinstance(inner, torch.fx.GraphModule) and isinstance(other, torch.fx.GraphModule):
            nested, why = dtype_rewrites(inner, other)
            if why:
                return Rewrites(), f"in {a.name}: {why}"
            out.nodes += nested.nodes
            out.constants += nested.constants
        elif isinstance(inner, torch.Tensor) and isinstance(other, torch.Tensor) and str(a.target) not in state:
            if inner.shape != other.shape:
                return Rewrites(), f"constant {a.target} has shape {list(inner.shape)} there, {list(other.shape)} here"
            out.constants.append((gm, str(a.target), other))
        elif str(a.target) != str(b.target):
            return Rewrites(), f"{a.name} reads {a.target} where it reads {b.target}"
    for a, b in zip(ours, theirs):
        if _differs(a.args, b.args, pair) or _differs(dict(a.kwargs), dict(b.kwargs), pair):
            return Rewrites(), f"{a.name} takes other arguments ({a.args}, {dict(a.kwargs)} against {b.args}, {dict(b.kwargs)})"
    for a, b in zip(ours, theirs):
        args, kwargs = _as_in(tuple(a.args), tuple(b.args), pair), _as_in(dict(a.kwargs), dict(b.kwargs), pair)
        if a.op != "output" and (args != tuple(a.args) or kwargs != dict(a.kwargs)):
            out.nodes.append((a, args, kwargs))
    return out, ""


def _cast(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def take_dtypes_of_a_trace_in(graph: ModelGraph, plan: Plan, member: nn.Module, dtype: torch.dtype,
                              example: Sequence[Any] | None) -> tuple[str, dict[str, torch.dtype]]:
    """Make `graph` (a torch.export trace of `member` in float32, which `plan` is for, its per-member constants
    lifted) the program of a trace of `member` cast to `dtype` (its floating example inputs too), where the two differ
    only as dtype_rewrites allows. Returns ("", {constant: dtype}) when done (or nothing to do): the graph's tensor
    constants that keep another dtype than `dtype` in that trace (`torch.tensor(d, dtype=torch.float)` made in
    forward(), which `member.to(dtype)` does not cast); else (why it could not be, {}), `graph` then as it was."""
    if example is None:
        return "there are no example inputs to trace it with", {}
    gm = graph.gm
    state = {k for k, _ in member.named_parameters(remove_duplicate=False)} | {k for k, _ in member.named_buffers(remove_duplicate=False)}
    # traced even where the graph holds no dtype or float: an int can depend on the dtype too (`x.element_size()`)
    low = deepcopy_module(member).to(dtype)
    try:
        traced = retrace(low, "export", tuple(tree_map(lambda x: _cast(x, dtype), tuple(example))),
                         [i.name for i in plan.inputs], plan.opened_modules)
    except StagewiseError as e:
        return f"it could not be traced in {dtype} ({str(e).splitlines()[0][:300]})", {}
    rewrites, why = dtype_rewrites(gm, traced.gm, state)
    if why:
        return f"its trace in {dtype} is another program: {why[:400]}", {}
    before = [(node, node.args, node.kwargs) for node, _, _ in rewrites.nodes]
    edges = list(graph.dag.edges(data=True))
    known = set(graph.dag.nodes)

    def apply(change: list[tuple[torch.fx.Node, tuple, dict]]) -> None:
        for node, args, kwargs in change:
            node.args, node.kwargs = args, kwargs
        graph.dag.remove_edges_from(list(graph.dag.edges))

    apply(rewrites.nodes)
    add_edges(graph.dag, gm)
    graph.dag.remove_nodes_from([n for n in list(graph.dag.nodes) if n not in known])  # per-member constants' get_attr
    try:
        validate(plan, graph)  # a stage now reading a cast another stage makes may break the plan's invariants
    except PlanMismatchError as e:
        apply(before)
        graph.dag.add_edges_from(edges)
        return f"the plan's stages do not fit its trace in {dtype} ({str(e).splitlines()[0][:300]})", {}
    kept = {}
    for module, target, value in rewrites.constants:
        owner, _, name = target.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        ours = getattr(holder, name)
        theirs = value.detach().clone().to(ours.device)
        if isinstance(ours, nn.Parameter):
            theirs = nn.Parameter(theirs, requires_grad=ours.requires_grad)
        if name in holder._buffers:
            holder._buffers[name] = theirs
        else:
            setattr(holder, name, theirs)
        if module is gm and theirs.is_floating_point() and theirs.dtype != dtype:
            kept[target] = theirs.dtype
    for graph_module in {id(node.graph.owning_module): node.graph.owning_module for node, _, _ in rewrites.nodes}.values():
        graph_module.recompile()
    return "", kept
