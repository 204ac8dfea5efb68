"""Per-member constants: what tracing baked into the graph that members hold differently.

A trace of member 0 turns its Python numbers into graph constants: `x / self.temp`
becomes `truediv(x, 1.0)`, `nn.LeakyReLU(0.1)` keeps its slope in the module that
a `call_module` node runs, and a plain tensor attribute (not a buffer) becomes a
`get_attr` constant. Members of a hyper-parameter sweep differ exactly there, and
running all of them with member 0's values would be a quiet wrong answer.

`lift_member_constants` compares every member with member 0 and, where they
differ, lifts the value into per-member state (a stacked `[N]` tensor read
through a new `get_attr` node) when the op takes a tensor there. A whole number the op
takes as a Python number (a slice bound in `h[:, :self.k]`, a size, a pad width, a dim) is
lifted the same way and marked (MEMBER_NUMBERS): build runs the stages taking it as the
member loop, each member with its own, and refuses by name where the members' results then
differ in shape at a stage boundary (MEMBER_SHAPES). Otherwise it refuses with a MemberError
naming the node, the attribute and the members.
Members whose module attributes all equal member 0's are not traced again.
"""
from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from stagewise.executor.modes import around_first_difference
from stagewise.executor.subgraphs import region_calls
from stagewise.executor.values import leaf_paths
from stagewise.planner.errors import MemberError
from stagewise.planner.graph import (PLAIN_TYPES, ModelGraph, hook_configs, hooks_refusal,
                                     plain_attributes, retrace)
from stagewise.planner.snapshot import deepcopy_module, held_values
from stagewise.planner.module_refusals import closure_values

LIFTED_PREFIX = "_stagewise_const_"  # buffers this module adds to the traced graph; StageProgram inlines their get_attr

# ops that accept a 0-d tensor wherever they accept a Python number (the number is one operand of arithmetic)
_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, operator.floordiv, operator.mod,
               operator.gt, operator.lt, operator.ge, operator.le, operator.eq, operator.ne,
               torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.pow, torch.clamp,
               torch.minimum, torch.maximum, torch.gt, torch.lt, torch.ge, torch.le, torch.eq, torch.ne, torch.remainder,
               torch.fmod}
_ARITHMETIC_METHODS = {"add", "sub", "mul", "div", "pow", "clamp", "__add__", "__sub__", "__mul__", "__truediv__",
                       "__radd__", "__rsub__", "__rmul__", "__rtruediv__", "__pow__", "__rpow__", "__floordiv__",
                       "__mod__", "gt", "lt", "ge", "le", "eq", "ne", "__gt__", "__lt__", "__ge__", "__le__", "__eq__",
                       "__ne__", "remainder", "fmod"}
_ATEN_SCALAR_TO_TENSOR = {  # export graphs: the overload that takes a tensor operand
    "add": torch.ops.aten.add.Tensor, "sub": torch.ops.aten.sub.Tensor, "mul": torch.ops.aten.mul.Tensor,
    "div": torch.ops.aten.div.Tensor, "rsub": torch.ops.aten.rsub.Tensor, "pow": torch.ops.aten.pow.Tensor_Tensor,
    "gt": torch.ops.aten.gt.Tensor, "lt": torch.ops.aten.lt.Tensor, "ge": torch.ops.aten.ge.Tensor, "le": torch.ops.aten.le.Tensor,
    "eq": torch.ops.aten.eq.Tensor, "ne": torch.ops.aten.ne.Tensor,
    "remainder": torch.ops.aten.remainder.Tensor, "fmod": torch.ops.aten.fmod.Tensor,
}
_ATEN_SCALAR_TO_TENSOR.update({  # in place (`h.div_(self.t)`) and the clamp family (PPO's per-member clip range)
    "add_": torch.ops.aten.add_.Tensor, "sub_": torch.ops.aten.sub_.Tensor, "mul_": torch.ops.aten.mul_.Tensor,
    "div_": torch.ops.aten.div_.Tensor, "clamp_min": torch.ops.aten.clamp_min.Tensor,
    "clamp_max": torch.ops.aten.clamp_max.Tensor})
_LEAKY = {F.leaky_relu, torch.ops.aten.leaky_relu.default, torch.ops.aten.leaky_relu_.default}


def clamp_per_member(x: torch.Tensor, min: Any = None, max: Any = None, inplace: bool = False) -> torch.Tensor:
    """torch.clamp where either bound may be a per-member 0-d tensor and the other a Python number (aten's clamp
    takes both as numbers or both as tensors): min(max(x, min), max), as torch.clamp computes it; into x with
    `inplace` (`h.clamp_(min=-self.t, max=1.0)`)."""
    if inplace:
        if min is not None:
            x.clamp_min_(min)
        return x if max is None else x.clamp_max_(max)
    if min is not None:
        x = torch.clamp_min(x, min)
    return x if max is None else torch.clamp_max(x, max)


_FX_CLAMPS = {torch.clamp: False, torch.clip: False, torch.clamp_: True, torch.clip_: True,
              torch.Tensor.clamp: False, torch.Tensor.clip: False, torch.Tensor.clamp_: True, torch.Tensor.clip_: True}


def _fx_clamp(node: torch.fx.Node) -> bool | None:
    """For a torch.fx clamp / clip node: whether it writes in place; None for any other node."""
    if node.op == "call_method" and node.target in ("clamp", "clip", "clamp_", "clip_"):
        return node.target.endswith("_")
    return _FX_CLAMPS.get(node.target) if node.op == "call_function" else None
_IGNORED_IN_EVAL = (nn.modules.dropout._DropoutNd,)  # their config has no effect outside training
# settings a module's forward() never reads (only its constructor: the initial values of its parameters)
_CONSTRUCTION_ONLY = {nn.PReLU: {"init"}}


def leaky_relu_per_member(x: torch.Tensor, negative_slope: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """leaky_relu with a tensor slope (F.leaky_relu takes only a Python number): x where x > 0, else slope * x
    (at 0 the gradient is the slope's, as torch's), written into x with `inplace`."""
    out = torch.where(x > 0, x, x * negative_slope)
    return x.copy_(out) if inplace else out


def _inplace_flag(node: torch.fx.Node, module: nn.Module | None = None) -> dict:
    """{"inplace": True} for a leaky_relu node that writes its input (`nn.LeakyReLU(s, inplace=True)`,
    `F.leaky_relu(h, s, True)`, `aten.leaky_relu_`), else {}."""
    flag = getattr(module, "inplace", False) if module is not None else \
        node.kwargs.get("inplace", node.args[2] if len(node.args) > 2 else False) if node.target is F.leaky_relu else \
        node.target is torch.ops.aten.leaky_relu_.default
    return {"inplace": True} if flag is True else {}



@dataclass
class _Difference:
    node: str
    where: Any  # position in the flattened (args, kwargs), or "module.attr"
    values: list  # one per member


def callable_identity(f: Any) -> str:
    """A callable attribute as a trace sees it: its name, plus the plain values it closes over or has as defaults
    (`lambda x: x * scale` with a scale per member is one name but another graph per member)."""
    name = (getattr(f, "__module__", None) or "") + "." + getattr(f, "__qualname__", repr(f))  # a bound builtin: None
    func = getattr(f, "__func__", f)
    captured = closure_values(func)
    captured += list(getattr(func, "__defaults__", None) or ()) + list((getattr(func, "__kwdefaults__", None) or {}).values())
    plain = [repr(v) for v in captured if isinstance(v, PLAIN_TYPES) or isinstance(v, (tuple, list))]
    return f"{name}({', '.join(plain)})" if plain else name


def config_signature(member: nn.Module) -> tuple:
    """What a trace can bake in, per member: plain attributes, module classes, training flags, attribute callables."""
    callables = {}
    for path, mod in member.named_modules():
        for k, v in vars(mod).items():
            if not k.startswith("_") and callable(v) and not isinstance(v, nn.Module):
                callables[f"{path}.{k}"] = callable_identity(v)
    modules = tuple((p, type(m).__qualname__, m.training) for p, m in member.named_modules())
    return tuple(sorted(plain_attributes(member).items(), key=str)), modules, tuple(sorted(callables.items()))


def _leaves(node: torch.fx.Node) -> list:
    return torch.utils._pytree.tree_flatten((node.args, node.kwargs))[0]


def _defaults_given(node: torch.fx.Node) -> None:
    """An aten op's positional arguments left out for their defaults written out (the same op, the same values)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return
    positional = [a for a in node.target._schema.arguments if not a.kwarg_only]
    args = list(node.args)
    for a in positional[len(args):]:
        if not a.has_default_value() or a.name in node.kwargs:
            break
        args.append(a.default_value)
    node.args = tuple(args)


def _structure(node: torch.fx.Node) -> Any:
    return leaf_paths((node.args, node.kwargs))  # keys and positions: a tuple and a list of one config are alike


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and a.name == b.name
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _equal_tensors(a, b)
    if type(a) is float and type(b) is float:  # -0.0 is not 0.0 (copysign, atan2, 1 / x tell them apart); NaN is NaN
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b) or (a != a and b != b)
    return type(a) is type(b) and a == b


def _equal_tensors(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype, layout and values (torch.equal, which has no kernel for sparse tensors: a sparse COO
    tensor by its coalesced indices and values, the compressed layouts by their dense values)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
        return False
    if a.layout == torch.sparse_coo:
        a, b = a.detach().coalesce(), b.detach().coalesce()
        return _equal_tensors(a.indices(), b.indices()) and _equal_tensors(a.values(), b.values())
    if a.layout != torch.strided:
        return _equal_tensors(a.detach().to_dense(), b.detach().to_dense())
    return bool(torch.equal(a, b)) if a.device == b.device else bool(torch.equal(a.detach().cpu(), b.detach().cpu()))


MODULES_KEY = "<submodules>"  # a leaf's config entry naming its submodules' classes
HELD_KEY = "<held values>"  # a leaf's config entry: everything it holds besides its state (planner.snapshot.held_values)


def _module_config(mod: nn.Module) -> dict:
    """Everything a leaf module's forward can read that tracing cannot see inside it: the plain attributes of
    the leaf and of every submodule ("self_attn.num_heads", "norm1.eps"), callables held as attributes
    ("activation": F.gelu), and the classes of its submodules (an activation module swapped for another)."""
    config: dict = dict(plain_attributes(mod))
    for path, sub in mod.named_modules():
        for k, v in vars(sub).items():
            if not k.startswith("_") and callable(v) and not isinstance(v, nn.Module):
                config[f"{path}.{k}" if path else k] = callable_identity(v)
    config[MODULES_KEY] = tuple((p, type(m).__qualname__) for p, m in mod.named_modules() if p)
    # the rest it runs with (tensor attributes, private numbers, ...), those above left out (a LeakyReLU slope is lifted)
    config[HELD_KEY] = tuple(sorted((k, v) for k, v in held_values(mod).items() if k not in config))
    return config


def _config_owner(mod: nn.Module, key: str) -> tuple[nn.Module, str]:
    """The (sub)module a config key of `mod` belongs to, and the attribute name ("norm1.eps" -> (mod.norm1, "eps"))."""
    if key == MODULES_KEY:
        return mod, key
    path, _, attr = key.rpartition(".")
    try:
        return (mod.get_submodule(path) if path else mod), attr
    except AttributeError:
        return mod, key


def _differences(graph: ModelGraph, others: dict[int, ModelGraph], n: int) -> list[_Difference]:
    """Constants of member 0's graph that some other member's graph holds differently."""
    diffs = []
    for node in graph.gm.graph.nodes:
        found: dict[Any, dict[int, Any]] = {}
        base = _leaves(node)
        for i, g in others.items():
            other = g.fx_node(node.name)
            for pos, (a, b) in enumerate(zip(base, _leaves(other))):
                if not _same(a, b):
                    found.setdefault(pos, {})[i] = b
            if node.op == "call_module":
                mine, theirs = _module_config(graph.gm.get_submodule(node.target)), _module_config(g.gm.get_submodule(other.target))
                for k in mine.keys() | theirs.keys():
                    if mine.get(k) != theirs.get(k):
                        found.setdefault(f"{node.target}.{k}", {})[i] = theirs.get(k)
        for where, by_member in found.items():
            first = base[where] if isinstance(where, int) else \
                _module_config(graph.gm.get_submodule(node.target)).get(where[len(str(node.target)) + 1:])
            diffs.append(_Difference(node.name, where, [by_member.get(i, first) for i in range(n)]))
    return diffs


def _refuse(diff: _Difference, attrs: dict[str, list], why: str) -> MemberError:
    differing = [i for i, v in enumerate(diff.values) if not _same(v, diff.values[0])]
    shown = ", ".join(f"member {i}: {diff.values[i]!r}" for i in [0, *differing[:2]])
    named = [k for k, vals in attrs.items()] or ["?"]
    what = diff.where if isinstance(diff.where, str) else f"argument {diff.where}"
    return MemberError(
        f"members differ in a constant the traced graph bakes in: node {diff.node!r} {what} ({shown}); "
        f"differing attribute(s): {', '.join(named[:4])}. {why} All members would run with member 0's value, "
        "so build refuses: make the value a tensor buffer of the module (per-member state is batched), "
        "or plan members that differ here separately"
    )


def lift_member_constants(graph: ModelGraph, members: Sequence[nn.Module], tracer: str, example_inputs: tuple | None,
                          input_names: Sequence[str] | None, state_keys: set[str], *,
                          opened: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Make constants that members hold differently per-member state of `graph.gm` (changed in place).

    Args:
        graph: member 0's retraced graph (its GraphModule is edited: new buffers and get_attr nodes).
        members: all members, member 0 first.
        state_keys: the stacked state's names (parameters and buffers).
        opened: the plan's opened_modules (each member is traced with them open, like member 0).
    Returns:
        {name: [N, ...] tensor} to add to the stacked state: lifted numbers ([N]) and plain tensor
        attributes the graph reads as constants ([N, *shape]) when members hold different ones.
    Raises:
        MemberError naming the node, the attribute and the members, when a differing constant
        sits where the op needs a Python value other than a whole number (a flag, a float setting
        such as alpha=; whole numbers there run as the member loop, see _member_number), when members differ in
        structure or training mode, or in a module's config the op cannot take as a tensor.
    """
    n = len(members)
    for i, m in enumerate(members):
        refusal = hooks_refusal(m, f"member {i}")
        if refusal:
            raise MemberError(refusal)
        if i and hook_configs(m) != hook_configs(members[0]):
            raise MemberError(f"member {i}'s weight_norm / spectral_norm hooks differ from member 0's ({hook_configs(m)[:1]} vs "
                              f"{hook_configs(members[0])[:1]}); apply them with the same settings to every member")
    lifted: dict[str, torch.Tensor] = {}
    lifted.update(_tensor_constants(graph, members, state_keys))
    signatures = [config_signature(m) for m in members]
    suspects = [i for i in range(1, n) if signatures[i] != signatures[0]]
    # what the trace computed from anything else member 0 holds (a private number, a numpy scalar, a config object,
    # a tensor outside its state), baked as a tensor (`self.scale.exp()`) or a number (`float(self._t)`): members
    # holding other values anywhere are traced and compared too
    baked = [t for t in _get_attr_targets(graph.gm) if t not in state_keys and _attr(members[0], t) is None]
    held = held_values(members[0])
    suspects += [i for i in range(1, n) if i not in suspects and held_values(members[i]) != held]
    suspects.sort()
    if not suspects:
        return lifted
    _check_training(members, suspects)
    attrs0 = plain_attributes(members[0])
    attr_diffs: dict[str, list] = {}
    for i in suspects:
        for k, v in plain_attributes(members[i]).items():
            if attrs0.get(k) != v:
                attr_diffs.setdefault(k, []).append(i)
    others = {}
    for i in suspects:
        g = retrace(deepcopy_module(members[i]), tracer, example_inputs, input_names, opened)
        if g.fingerprint != graph.fingerprint:
            named = ", ".join(sorted(attr_diffs)[:4])
            raise MemberError(
                f"member {i} traces to another graph than member 0 ({_code_difference(graph.gm, g.gm)}"
                f"{'; differing attribute(s): ' + named if named else ''}): a per-member choice of layer or function "
                "(an activation held as an attribute, a submodule swapped in, a different number of layers) is a "
                "different program, which one batched module cannot run; give every member the same choice (a "
                "number that differs is fine: it is lifted per member), or plan the members that differ separately")
        others[i] = g
        for node in graph.gm.graph.nodes:  # the same leaves in another structure: `{self.name: y}`, keys per member
            if _structure(node) != _structure(g.fx_node(node.name)):
                # torch.export leaves out an argument equal to its default (leaky_relu's slope 0.01 in member 0)
                _defaults_given(node)
                _defaults_given(g.fx_node(node.name))
            if _structure(node) != _structure(g.fx_node(node.name)):
                named = ", ".join(sorted(attr_diffs)[:4]) or "?"
                raise MemberError(
                    f"member {i} traces node {node.name!r} with its values in another structure than member 0's (dict "
                    f"keys or container types made from a per-member attribute; differing attribute(s): {named}): the "
                    "batched module would give every member member 0's structure. Make the structure the same for "
                    "every member (the same keys), or plan members that differ here separately")
    nested = _region_differences(graph.gm, {i: g.gm for i, g in others.items()}, n, attr_diffs)
    for diff in _differences(graph, others, n):
        _lift(graph, diff, attr_diffs, lifted)
    for call, name, sub, diff in nested:
        _lift_into_region(graph.gm, call, name, sub, diff, attr_diffs, lifted)
    lifted.update(_baked_differences(graph, others, baked, n))
    if graph.gm.meta.get(MEMBER_NUMBERS):  # a size per member: where the members' shapes differ, build refuses by name
        graph.gm.meta[MEMBER_SHAPES] = member_shapes(graph, others, n, example_inputs)
    graph.gm.recompile()
    return lifted


def _code_difference(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> str:
    """The first line two graphs' code differs at, around its first differing character."""
    lines_a, lines_b = a.code.strip().splitlines(), b.code.strip().splitlines()
    for x, y in zip(lines_a + ["<end>"], lines_b + ["<end>"]):
        x, y = x.strip(), y.strip()
        if x != y:
            x, y = around_first_difference(x, y, 50)
            return f"member 0's `{x}` is its `{y}`"
    return "the same code, other parameter shapes or module types"


def _region_differences(gm: torch.fx.GraphModule, others: dict[int, torch.fx.GraphModule], n: int,
                        attr_diffs: dict, nested: bool = False) -> list[tuple[torch.fx.Node, str, torch.fx.GraphModule, _Difference]]:
    """(the region call in `gm`, its sub-graph's attribute name, the sub-graph, a constant some member's sub-graph holds
    otherwise) for each number that differs inside a higher-order op's graph (a `with torch.no_grad():` block torch.export keeps as a graph of
    its own, a DINO teacher's temperature): _lift_into_region hands it to the sub-graph as a per-member operand.
    MemberError where a member's sub-graph is another program (not only other numbers), or where the region is nested
    in another one or takes its operands as one tuple (torch.cond), which stagewise does not thread a value into."""
    out = []
    for node in gm.graph.nodes:
        for name, sub, _ in region_calls(gm, node):
            theirs = {i: _attr(o, name) for i, o in others.items()}
            for i, t in theirs.items():
                if not isinstance(t, torch.fx.GraphModule) or _shape_of(t) != _shape_of(sub):
                    raise _region_refusal(name, i, attr_diffs, "its block is another program (other ops, not only "
                                          "other numbers)", "give every member the same code there")
            for sub_node in sub.graph.nodes:
                found: dict[int, dict[int, Any]] = {}
                base = _leaves(sub_node)
                for i, t in theirs.items():
                    for pos, (a, b) in enumerate(zip(base, _leaves(_node_named(t, sub_node.name)))):
                        if not _same(a, b):
                            found.setdefault(pos, {})[i] = b
                for pos, by_member in found.items():
                    values = [by_member.get(i, base[pos]) for i in range(n)]
                    diff = _Difference(sub_node.name, pos, values)
                    if nested or isinstance(node.args[-1], (tuple, list)):
                        raise _region_refusal(name, next(iter(by_member)), attr_diffs, f"its number at {sub_node.name!r} "
                                              f"({_shown(values)}) sits in a region nested in another or one taking its "
                                              "operands as a tuple (torch.cond)", _REGION_FIX)
                    out.append((node, name, sub, diff))
            _region_differences(sub, theirs, n, attr_diffs, nested=True)  # a block in the block: refused where it differs
    return out


_REGION_FIX = ("compute what depends on the differing value outside the block (before `with torch.no_grad():`, or "
               "hold it as a tensor buffer of the module, which is per-member state), or plan members that differ "
               "here separately")


def _shape_of(gm: torch.fx.GraphModule) -> list[tuple]:
    """A graph's nodes without their constants: (name, op, target, which arguments are graph values)."""
    return [(n.name, n.op, str(n.target), tuple(x.name if isinstance(x, torch.fx.Node) else type(x).__name__
                                              for x in _leaves(n))) for n in gm.graph.nodes]


def _node_named(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _shown(values: list) -> str:
    return ", ".join(f"member {i}: {v!r}" for i, v in enumerate(values) if i == 0 or not _same(v, values[0]))


def _region_refusal(name: str, i: int, attr_diffs: dict, what: str, fix: str) -> MemberError:
    named = ", ".join(sorted(attr_diffs)[:4]) or "?"
    return MemberError(
        f"member {i} differs from member 0 inside {name}, a `with torch.no_grad():` (or autocast) block or torch.cond "
        f"branch torch.export keeps as a graph of its own (differing attribute(s): {named}): {what}, which cannot be "
        f"given per member there, so every member would run member 0's; {fix}")


def _lift_into_region(gm: torch.fx.GraphModule, call: torch.fx.Node, name: str, sub: torch.fx.GraphModule,
                      diff: _Difference, attr_diffs: dict, lifted: dict[str, torch.Tensor]) -> None:
    """Give a region's sub-graph its per-member number as one more operand: the [N] buffer read by a get_attr in `gm`
    before the call, handed to the call last and taken by a new last placeholder of `sub`, where the op reads it as
    a tensor (as _lift rewrites a top-level op). MemberError where the op needs a Python number there."""
    node = _node_named(sub, diff.node)
    if _dropout_off(node):  # a rate with training off: no effect, as at the top level
        return
    calls = [n for n in gm.graph.nodes if any(s is sub for _, s, _ in region_calls(gm, n))]
    if len(calls) > 1 or not _numbers(diff.values) or not _liftable(node, diff.where):
        why = ("the block's graph is run by more than one call" if len(calls) > 1 else _kind_of(diff.values)
               if not _numbers(diff.values) else
               f"{_op_name(node)} takes a plain Python value there (a size, a dim, a flag, a setting)")
        raise _region_refusal(name, next(i for i, v in enumerate(diff.values) if not _same(v, diff.values[0])), attr_diffs,
                              f"its number at {diff.node!r} ({_shown(diff.values)}): {why}", _REGION_FIX)
    outer = _constant_node(gm, call, _Difference(f"{call.name}_{diff.node}", diff.where, diff.values), lifted)
    call.args = (*call.args, outer)
    places = [p for p in sub.graph.nodes if p.op == "placeholder"]
    with sub.graph.inserting_after(places[-1]) if places else sub.graph.inserting_before(node):
        value = sub.graph.placeholder(str(outer.target))
    _set_leaf(node, diff.where, value)
    _retarget(node, diff, value)
    sub.graph.lint()
    sub.recompile()


def _check_training(members: Sequence[nn.Module], suspects: list[int]) -> None:
    for i in suspects:
        for (path, m0), (_, mi) in zip(members[0].named_modules(), members[i].named_modules()):
            if m0.training != mi.training:
                where = path or type(members[0]).__name__
                raise MemberError(f"member {i}'s {where} is in {'training' if mi.training else 'eval'} mode and member 0's is not; "
                                  "call .eval() (or .train()) on every member before building")


def _tensor_constants(graph: ModelGraph, members: Sequence[nn.Module], state_keys: set[str]) -> dict[str, torch.Tensor]:
    """Plain tensor attributes read by get_attr nodes (not parameters or buffers), stacked when members differ."""
    out = {}
    for node in graph.gm.graph.nodes:
        if node.op != "get_attr" or str(node.target) in state_keys:
            continue
        values = [_attr(m, str(node.target)) for m in members]
        if not all(isinstance(v, torch.Tensor) for v in values):
            continue  # a constant the tracer made (not a member attribute): same for every member by construction
        if any(v.shape != values[0].shape or v.dtype != values[0].dtype or v.layout != values[0].layout for v in values):
            raise MemberError(f"tensor attribute {node.target!r} has different shapes, dtypes or layouts across members; "
                              "all members must share one architecture")
        if all(_equal_tensors(v, values[0]) for v in values[1:]):
            continue
        if values[0].layout != torch.strided:
            raise MemberError(
                f"members hold different {values[0].layout} tensors as the plain attribute {node.target!r} (not a "
                "parameter or buffer), which the traced graph reads as one constant: every member would run with member "
                "0's, and stagewise lifts only dense plain tensors per member: register it as a buffer "
                "(self.register_buffer(name, t): buffers are per-member state, sparse ones too), hold it as a dense "
                "tensor (.to_dense()), or plan members that differ here separately")
        with torch.no_grad():
            out[str(node.target)] = torch.stack([v.detach() for v in values])
    return out


def _get_attr_targets(gm: torch.fx.GraphModule) -> list[str]:
    """The tensors a graph reads by get_attr (each once), lifted per-member numbers left out."""
    out = dict.fromkeys(str(n.target) for n in gm.graph.nodes if n.op == "get_attr")
    return [t for t in out if not t.startswith(LIFTED_PREFIX) and isinstance(_attr(gm, t), torch.Tensor)]


def _baked_differences(graph: ModelGraph, others: dict[int, ModelGraph], baked: list[str], n: int) -> dict[str, torch.Tensor]:
    """Tensors the graph reads that are no member's state or attribute (what the trace computed and baked in) and
    that other members' traces computed differently, stacked [N, ...] (members not traced again hold member 0's)."""
    out = {}
    for target in baked:
        first = _attr(graph.gm, target)
        values = [_attr(others[i].gm, target) if i in others else first for i in range(n)]
        if any(not isinstance(v, torch.Tensor) for v in values):
            raise MemberError(f"member {next(i for i, v in enumerate(values) if not isinstance(v, torch.Tensor))} traces to a "
                              f"graph without the constant {target!r} member 0's has; all members must share one architecture")
        if any(v.shape != first.shape or v.dtype != first.dtype for v in values):
            raise MemberError(f"forward() computes a tensor from what the modules hold outside their parameters and buffers "
                              f"(the traced graph keeps it as the constant {target!r}), and members compute it with different "
                              "shapes or dtypes; all members must share one architecture (register such tensors as buffers)")
        if all(_equal_tensors(v, first) for v in values[1:]):
            continue
        if first.layout != torch.strided:
            raise MemberError(f"forward() computes a {first.layout} tensor from what the modules hold outside their "
                              f"parameters and buffers (the traced graph keeps it as the constant {target!r}), and members "
                              "compute different ones; stagewise stacks per-member dense tensors only: hold what it is "
                              "computed from as a dense tensor buffer, or plan members that differ here separately")
        with torch.no_grad():
            out[target] = torch.stack([v.detach() for v in values])
    return out


def _attr(obj: Any, target: str) -> Any:
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _lift(graph: ModelGraph, diff: _Difference, attr_diffs: dict[str, list], lifted: dict[str, torch.Tensor]) -> None:
    """Rewrite one node so that its differing constant is read from per-member state, or refuse."""
    gm = graph.gm
    node = graph.fx_node(diff.node)
    if isinstance(diff.where, str):  # a call_module's config (its own attributes or a submodule's)
        leaf = gm.get_submodule(node.target)
        key = diff.where[len(str(node.target)) + 1:]
        mod, attr = _config_owner(leaf, key)
        if not mod.training and attr != MODULES_KEY and (isinstance(mod, _IGNORED_IN_EVAL) or
                                                          (isinstance(mod, nn.MultiheadAttention) and attr == "dropout")):
            # no effect in eval mode; in training every member would drop at member 0's rate: .train() refuses
            eval_only = gm.meta.setdefault("stagewise_eval_only_differences", [])
            shown = ", ".join(f"member {i}: {v!r}" for i, v in enumerate(diff.values) if i == 0 or not _same(v, diff.values[0]))
            eval_only.append(f"{diff.where} ({shown})")
            gm.meta.setdefault("stagewise_eval_only_layers", []).append(f"{node.target}.{key}".rpartition(".")[0])
            return
        if attr in _CONSTRUCTION_ONLY.get(type(mod), ()):
            return
        if key == MODULES_KEY:
            raise _refuse(diff, attr_diffs, f"{type(leaf).__name__} holds submodules of other classes in some members.")
        if key == HELD_KEY:
            mine = dict(diff.values[0])
            i, other = next((i, dict(v)) for i, v in enumerate(diff.values) if v != diff.values[0])
            where = sorted(k for k in mine.keys() | other.keys() if mine.get(k) != other.get(k))
            raise MemberError(
                f"members differ in what the leaf module {type(leaf).__name__} at {node.target} holds besides its parameters "
                f"and buffers: member {i} differs from member 0 at {', '.join(repr(w) for w in where[:3])} (a tensor attribute, "
                "a private setting). A leaf runs with member 0's copy of those for every member, so build refuses: make "
                "tensors buffers (per-member state is batched), or open the module (planner.trace(..., open_modules=[...])) "
                "so the trace sees what it computes")
        if mod is leaf and isinstance(mod, nn.LeakyReLU) and attr == "negative_slope" and _numbers(diff.values):
            slope = _constant_node(gm, node, diff, lifted)
            node.op, node.target = "call_function", leaky_relu_per_member
            node.args, node.kwargs = (node.args[0], slope), _inplace_flag(node, mod)
            return
        raise _refuse(diff, attr_diffs, f"{type(mod).__name__}.{attr} cannot be given per member"
                      + (f" (a setting inside the leaf module {type(leaf).__name__} at {node.target})." if mod is not leaf else "."))
    if _dropout_off(node):  # F.dropout(x, p, training=False), aten.dropout(x, p, False): p has no effect
        return
    if node.op in ("call_function", "call_method") and _slice_numbers(diff.values):  # `h[:, :self.k]`
        parts = []
        for part in ("start", "stop", "step"):
            values = [getattr(v, part) for v in diff.values]
            if any(v != values[0] for v in values):
                value = _constant_node(gm, node, _Difference(diff.node, f"{diff.where}.{part}", values), lifted)
                parts.append((part, value))
        first = diff.values[0]
        bounds = {"start": first.start, "stop": first.stop, "step": first.step, **dict(parts)}
        _set_leaf(node, diff.where, slice(bounds["start"], bounds["stop"], bounds["step"]))
        for _, value in parts:
            _member_number(gm, value, attr_diffs)
        return
    if not _numbers(diff.values):
        raise _refuse(diff, attr_diffs, f"It is {_kind_of(diff.values)}, which cannot be given per member.")
    if node.op == "output":
        raise _refuse(diff, attr_diffs, "forward() returns it as a Python number, which one batched output cannot hold "
                      "per member; return it as a tensor (torch.tensor(self.t)) to get an [N] output.")
    if not _liftable(node, diff.where):
        if node.op in ("call_function", "call_method") and all(isinstance(v, int) for v in diff.values):
            # a size, a count, a dim, a pad width (`x.view(-1, self.k, 8 // self.k)`, F.pad's (0, 8 - self.k)): each
            # member's own, in the member loop its stage runs as (build reads the mark _member_number leaves)
            value = _constant_node(gm, node, diff, lifted)
            _set_leaf(node, diff.where, value)
            _member_number(gm, value, attr_diffs)
            return
        raise _refuse(diff, attr_diffs, f"{_op_name(node)} takes a plain Python value there (a size, a dim, a flag, a "
                      "setting such as alpha= or beta=), which cannot be given per member.")
    value = _constant_node(gm, node, diff, lifted)
    _set_leaf(node, diff.where, value)
    _retarget(node, diff, value)


def _retarget(node: torch.fx.Node, diff: _Difference, value: torch.fx.Node) -> None:
    """The op of `node`, whose number at diff.where is now the tensor `value`, as the overload taking a tensor there."""
    if node.target in _LEAKY:
        x = node.args[0]
        node.target, node.args, node.kwargs = leaky_relu_per_member, (x, value), _inplace_flag(node)
    elif _fx_clamp(node) is not None:  # `h.clamp(min=-self.t, max=1.0)`: a tensor bound beside a number
        inplace = _fx_clamp(node)
        bounds = dict(zip(("min", "max"), node.args[1:]), **node.kwargs)
        node.op, node.target = "call_function", clamp_per_member
        node.args, node.kwargs = (node.args[0],), dict(bounds, **({"inplace": True} if inplace else {}))
    elif isinstance(node.target, torch._ops.OpOverload):
        base = node.target._schema.name.split("::")[-1]
        if base == "clamp":
            node.target = clamp_per_member  # (a second lifted bound finds it so and keeps it)
        elif base == "pow" and diff.where == 0:  # `self.t ** h`: the number is the base
            node.target = torch.ops.aten.pow.Tensor_Tensor
        elif node.target._overloadname.endswith("_mode"):  # div.Scalar_mode(h, n, rounding_mode=): keep the mode
            node.target = getattr(getattr(torch.ops.aten, base), "Tensor_mode")
        else:
            node.target = _ATEN_SCALAR_TO_TENSOR[base]


MEMBER_NUMBERS = "stagewise_member_numbers"  # gm.meta: {lifted buffer: the attribute(s) it comes from}, for the loop
MEMBER_SHAPES = "stagewise_member_shapes"  # gm.meta: {node: [its tensors' shapes, per member]} where members' differ


def _set_leaf(node: torch.fx.Node, position: int, value: Any) -> None:
    """Put `value` at flattened position `position` of the node's (args, kwargs)."""
    leaves, spec = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    leaves[position] = value
    node.args, node.kwargs = torch.utils._pytree.tree_unflatten(leaves, spec)


def _member_number(gm: torch.fx.GraphModule, value: torch.fx.Node, attr_diffs: dict[str, list]) -> None:
    """Mark the lifted number `value` reads as one an op must get as a Python number (a size, a slice bound): build
    runs the stages taking it as the member loop, each member with its own (BatchedModule._find_number_loops), as
    it does for a per_member number input. Named by the attribute(s) the members differ in."""
    named = sorted(attr_diffs)
    label = ("self." + named[0] if len(named) == 1 else "one of " + ", ".join("self." + k for k in named[:3]) if named
             else "a number the members hold differently")
    gm.meta.setdefault(MEMBER_NUMBERS, {})[str(value.target)] = label


def _slice_numbers(values: list) -> bool:
    """Whether `values` are slices that differ only in whole numbers (`slice(None, k)` with its own k per member)."""
    if not all(isinstance(v, slice) for v in values):
        return False
    for part in ("start", "stop", "step"):
        column = [getattr(v, part) for v in values]
        if any(x != column[0] for x in column) and not all(isinstance(x, int) and not isinstance(x, bool) for x in column):
            return False
    return True


def _kind_of(values: list) -> str:
    """What the members' differing values are, in words, for a refusal."""
    kinds = {type(v) for v in values}
    if kinds <= {slice}:
        return "a slice whose bounds differ in something other than whole numbers (None in some members)"
    if kinds == {bool}:
        return "a flag (True/False)"
    return "not a number (" + ", ".join(sorted(t.__name__ for t in kinds)) + ")"


def member_shapes(graph: ModelGraph, others: dict, n: int, example_inputs: tuple | None) -> dict[str, list] | None:
    """{node name: [the shapes of its tensors, per member]} for the nodes whose shapes differ between members, from
    one run of member 0's graph (its lifted numbers member 0's) and of each other member's own graph on the example
    inputs, without gradients, from one random state, which is the caller's again afterwards. None where there are no
    example inputs or a graph does not run on them (the call then names the shapes, at the stage boundary)."""
    if example_inputs is None:
        return None

    def shapes_of(gm: torch.fx.GraphModule) -> dict[str, tuple]:
        seen: dict[str, tuple] = {}

        class Record(torch.fx.Interpreter):
            def run_node(self, node: torch.fx.Node) -> Any:
                out = super().run_node(node)
                seen[node.name] = tuple(tuple(t.shape) for t in torch.utils._pytree.tree_flatten(out)[0]
                                        if isinstance(t, torch.Tensor))
                return out

        inputs = torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tuple(example_inputs))
        Record(gm).run(*inputs)
        return seen

    devices = [t.device for t in graph.gm.parameters() if t.is_cuda][:1]
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            first = shapes_of(copy.deepcopy(graph.gm))  # (a copy: a norm layer in training updates what it runs)
            theirs = {i: shapes_of(g.gm) for i, g in others.items()}
    except Exception:
        return None
    out = {}
    for name, shape in first.items():
        column = [theirs[i].get(name, shape) if i in theirs else shape for i in range(n)]
        if any(s != shape for s in column):
            out[name] = column
    return out


_DROPOUTS = {"dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"}


def _dropout_off(node: torch.fx.Node) -> bool:
    """Whether `node` is a functional dropout called with training off (its rate then changes nothing)."""
    if node.op != "call_function" or _op_name(node).split(".")[0] not in _DROPOUTS:
        return False
    if isinstance(node.target, torch._ops.OpOverload):  # aten: dropout(input, p, train)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    else:  # F.dropout(input, p=0.5, training=True, inplace=False)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    return train is False


def _numbers(values: list) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _op_name(node: torch.fx.Node) -> str:
    return str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


def _liftable(node: torch.fx.Node, position: int) -> bool:
    """Whether the number at flattened position `position` may be a 0-d tensor: one operand of arithmetic
    whose other operand is a graph value, or the slope of leaky_relu."""
    leaves = _leaves(node)
    has_value = any(isinstance(x, torch.fx.Node) for x in leaves)
    if node.target in _LEAKY:
        return position == 1 or (len(node.args) < 2 and position == len(node.args))  # the slope, positional or keyword
    if node.target is clamp_per_member or _fx_clamp(node) is not None:  # (one of whose bounds may be lifted already)
        return has_value and _is_operand(node, position)
    operand = _is_operand(node, position)
    if node.op == "call_function" and node.target in _ARITHMETIC:
        return has_value and operand
    if node.op == "call_method" and node.target in _ARITHMETIC_METHODS:
        return has_value and operand and position > 0
    if isinstance(node.target, torch._ops.OpOverload):
        base = node.target._schema.name.split("::")[-1]
        if base == "pow" and position == 0:  # aten.pow.Scalar(number, exponent tensor)
            return has_value
        return (base in _ATEN_SCALAR_TO_TENSOR or base == "clamp") and has_value and operand and position > 0
    return False


_OPERAND_KEYWORDS = {"input", "other", "min", "max", "exponent", "self"}


def _is_operand(node: torch.fx.Node, position: int) -> bool:
    """Whether flattened position `position` of (args, kwargs) is an operand of the op: one of its first two
    positional arguments (three for clamp's min and max) or an operand keyword (other=, min=, max=), not a
    setting such as alpha= or rounding_mode=."""
    clamp = node.target is clamp_per_member or _fx_clamp(node) is not None \
        or getattr(node.target, "__name__", "").startswith("clamp")
    seen = 0
    for i, a in enumerate(node.args):
        count = len(torch.utils._pytree.tree_flatten(a)[0])
        if position < seen + count:
            return i < (3 if clamp else 2)
        seen += count
    for k, v in node.kwargs.items():
        count = len(torch.utils._pytree.tree_flatten(v)[0])
        if position < seen + count:
            return k in _OPERAND_KEYWORDS
        seen += count
    return False


def _constant_node(gm: torch.fx.GraphModule, node: torch.fx.Node, diff: _Difference, lifted: dict[str, torch.Tensor]) -> torch.fx.Node:
    """A get_attr node, placed before `node`, reading a new buffer that holds member 0's value; [N] values into `lifted`."""
    name = f"{LIFTED_PREFIX}{diff.node}_{str(diff.where).replace('.', '_')}"
    floating = any(isinstance(v, float) for v in diff.values)
    # a float becomes the default dtype, as a Python float meets an integer tensor; float32 tensors see the same value.
    # In a float64 model, float64: a float32 number would round 0.1 and overflow 1e40, which the loop's doubles keep
    state = next((t.dtype for t in [*gm.parameters(), *gm.buffers()] if t.is_floating_point()), None)
    dtype = (torch.float64 if state == torch.float64 else torch.get_default_dtype()) if floating else torch.int64
    values = torch.tensor(diff.values, dtype=dtype)
    gm.register_buffer(name, values[0].clone())
    lifted[name] = values
    with gm.graph.inserting_before(node):
        return gm.graph.get_attr(name)
