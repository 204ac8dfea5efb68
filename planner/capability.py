"""Capability: can a node run batched across members under torch.func.vmap?

Each check is a predicate `check(graph, node) -> reason | None`; `chain` composes
them and the first reason wins. The decisive check runs the node under vmap with
its real example shapes (two stacked copies of its inputs and parameters) and
watches for errors and for vmap's slow-fallback performance warning, so the
verdict comes from PyTorch itself, not from a hand-written allow-list.
"""
from __future__ import annotations

import contextlib

import operator
import types
import warnings
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch import nn
import torch.nn.functional as F
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_map

from stagewise.planner.errors import first_line

Check = Callable[["ModelGraph", torch.fx.Node], Optional[str]]  # noqa: F821 (ModelGraph from planner.graph)

PROBE_MEMBERS = 2  # members stacked for the probe: enough to exercise the batching rules

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.setitem}  # `h[i] = v` writes h


def chain(*checks: Check) -> Check:
    """Compose checks: the first one that gives a reason decides."""

    def combined(graph, node):
        for check in checks:
            reason = check(graph, node)
            if reason:
                return reason
        return None

    return combined


def base_name(node: torch.fx.Node) -> str:
    """The op's name without namespace or overload: 'add_', 'view', '__getitem__' ('' for non-calls)."""
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name.split("::")[-1]
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


# the same writes called as methods: `h.__setitem__(i, v)`, `h.__iadd__(y)`
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def _is_inplace_target(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return True
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and _written_arguments(node)[:1] == [0]:
        return True  # a custom op declaring a write of its first argument (torch.library.custom_op(mutates_args=...))
    if node.op == "call_function" and node.target in _OPERATOR_NOT_INPLACE:
        return False  # `a & b`, `a | b`: operator.and_ / or_ make a new value (their name ends in "_")
    name = base_name(node)
    if node.op == "call_method" and name in _INPLACE_DUNDERS:
        return True
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _written_arguments(node: torch.fx.Node) -> list[int]:
    """Positions of the arguments an op's schema says it writes (`Tensor(a!)`): an aten in-place op's first, a custom
    op's `mutates_args`."""
    try:
        arguments = node.target._schema.arguments
    except AttributeError:
        return []
    return [k for k, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]


def written_later_arguments(node: torch.fx.Node) -> list[str]:
    """Names of the arguments past the first that an op of `node` writes in place by its schema (a custom op's
    `mutates_args={"buf"}` on its second argument): the plan follows writes into an op's first argument only."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    arguments = node.target._schema.arguments
    return [arguments[k].name for k in _written_arguments(node) if k > 0 and not arguments[k].kwarg_only
            or k > 0 and arguments[k].name in node.kwargs]


# Python's operators named with a trailing underscore, which is no in-place mark (operator.iand / ior are the writes)
_OPERATOR_NOT_INPLACE = frozenset({operator.and_, operator.or_, operator.not_, operator.is_, operator.is_not,
                                   operator.contains})


_VIEW_ATTRIBUTES = ("data", "T", "mT", "H", "mH", "real", "imag")  # `h.data` is h's storage: a write into it writes h

# calls whose result is always a view of their first argument (or views, for the splits), besides VIEW_NAMES: a write
# into the result writes it. Not those that copy where they must (contiguous(), .to(), F.unfold): a write into such a
# copy is not one into an input (the ordering edges still count them: trace_watch._MAY_ALIAS)
ALWAYS_VIEWS = frozenset({
    "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal", "chunk", "split", "unbind", "tensor_split",
    "split_with_sizes", "hsplit", "vsplit", "dsplit", "expand_as", "view_as_real", "view_as_complex", "real", "imag",
    "adjoint", "broadcast_to"})

VIEW_NAMES = ("view", "reshape", "__getitem__", "getitem", "select", "narrow", "detach", "flatten", "squeeze", "unsqueeze",
               "slice", "expand", "as_strided", "alias", "t", "transpose", "permute", "unflatten", "view_as")


def alias_chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node` and the values it is a view of, following view-like calls and in-place ops (which return their
    first argument) back, at most 16 steps."""
    chain = [node]
    while len(chain) <= 16:
        if node.op in ("call_method", "call_function", "call_module") and node.args and isinstance(node.args[0], torch.fx.Node):
            name = base_name(node) if node.op != "call_module" else ""
            if (name in VIEW_NAMES or name in ALWAYS_VIEWS or (name == "unfold" and node.op == "call_method")
                    or is_inplace(node) or _view_attribute(node)):
                node = node.args[0]
                chain.append(node)
                continue
        break
    return chain


def _view_attribute(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is getattr and len(node.args) > 1
            and node.args[1] in _VIEW_ATTRIBUTES)


# functions with an `inplace` flag, and its position when passed positionally
_INPLACE_FLAG_AT = {F.relu: 1, F.relu6: 1, F.selu: 1, F.silu: 1, F.mish: 1, F.hardswish: 1, F.hardsigmoid: 1,
                    F.elu: 2, F.celu: 2, F.leaky_relu: 2, F.hardtanh: 3, F.threshold: 3, F.dropout: 3,
                    F.alpha_dropout: 3, F.feature_alpha_dropout: 3, F.dropout1d: 3, F.dropout2d: 3, F.dropout3d: 3,
                    F.rrelu: 4}


def is_inplace_op(node: torch.fx.Node) -> bool:
    """An in-place op by its name alone (`x.add_(y)`, `operator.iadd`, `aten.add_`), not an `inplace` flag."""
    return (node.op in ("call_function", "call_method") and _is_inplace_target(node)
            and bool(node.args) and isinstance(node.args[0], torch.fx.Node))


def is_inplace(node: torch.fx.Node) -> bool:
    """An fx op that writes into its first argument: `x.add_(y)`, `operator.iadd`, `aten.add_`, and an `inplace`
    flag set: `F.relu(x, inplace=True)`, `nn.ReLU(inplace=True)(x)`."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.op in ("call_function", "call_method"):
        if _is_inplace_target(node) or node.kwargs.get("inplace") is True:
            return True
        at = _INPLACE_FLAG_AT.get(node.target) if node.op == "call_function" else None
        return at is not None and len(node.args) > at and node.args[at] is True
    if node.op == "call_module":
        owner = node.graph.owning_module
        try:
            module = owner.get_submodule(str(node.target)) if owner is not None else None
        except AttributeError:
            return False
        return getattr(module, "inplace", False) is True
    return False


def _root_attr(node: torch.fx.Node) -> Optional[str]:
    """The get_attr target a value is (a view of), following view-like calls back."""
    root = alias_chain(node)[-1]
    return str(root.target) if root.op == "get_attr" else None


def inplace_buffer_check(graph, node: torch.fx.Node) -> Optional[str]:
    """An in-place op writing into a module attribute (buffer or parameter)."""
    if node.op not in ("call_function", "call_method") or not _is_inplace_target(node):
        return None
    if node.args and isinstance(node.args[0], torch.fx.Node):
        attr = _root_attr(node.args[0])
        if attr is not None:
            return f"in-place update of buffer '{attr}' ({_op_name(node)}); members' state would be shared"
    return None


BAKED_PREFIXES = ("_tensor_constant",)  # names torch.fx gives the tensors it bakes into a graph
TRACER_CONSTANTS = BAKED_PREFIXES + ("lifted_tensor_",)  # and torch.export's: made by the tracer, alike for every member
_SIZE_QUERIES = {"size", "dim", "numel", "shape", "ndim", "dtype", "device", "sym_size", "sym_numel", "sym_stride",
                 "stride", "nelement", "ndimension"}


def _carries_member_axis(graph) -> set[str]:
    """Names of the nodes whose value has a member axis in a stage that writes in place (which gets its inputs as
    [N, ...] tensors): what flows as tensor data from module state or a model input. Sizes read from a tensor carry
    none, so `torch.zeros(x.shape[0], d)` has none. Computed once per graph."""
    cached = getattr(graph, "_member_axis_cache", None)
    if cached is not None:
        return cached
    gm = graph.gm
    state = {k for k, _ in gm.named_parameters()} | {k for k, _ in gm.named_buffers()}
    out: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            hit = True
        elif n.op == "get_attr":
            # a tensor torch.fx baked from constants (`torch.arange(6.)`; a GraphModule holds it as a buffer) is one
            # for every member, as a fresh `torch.zeros(n)` is: `torch.arange(6.).repeat(B, 1)` written per member
            # (torch.export's lifted constants, `mask[r, a:b] = True`'s True, are the tracer's own too: alike for every
            # member, whether the graph holds them as attributes or, at build, as buffers)
            hit = str(n.target) in state and not str(n.target).startswith(TRACER_CONSTANTS)
        elif n.op != "call_module" and (str(_op_name(n)).split(".")[0] in _SIZE_QUERIES or (
                n.target is getattr and len(n.args) > 1 and n.args[1] in _SIZE_QUERIES)):
            hit = False
        elif n.op == "call_module":
            sub = gm.get_submodule(n.target)
            hit = any(True for _ in sub.parameters()) or any(True for _ in sub.buffers()) \
                or any(a.name in out for a in n.all_input_nodes)
        else:
            hit = any(a.name in out for a in n.all_input_nodes)
        if hit:
            out.add(n.name)
    graph._member_axis_cache = out
    return out


def _written_unowned(graph) -> set[str]:
    """Tensors made from sizes alone (`torch.zeros(n, d)`) that forward() then writes per-member values into, in place
    or through a view (`out[t] = h`, `.index_add_`), also inside a torch.export region. Computed once per graph."""
    cached = getattr(graph, "_written_unowned_cache", None)
    if cached is not None:
        return cached
    carries = _carries_member_axis(graph)
    roots: set[str] = set()
    for n in graph.gm.graph.nodes:
        if not is_inplace(n):
            continue
        root = alias_chain(n.args[0])[-1]
        if root.name not in carries and root.op != "get_attr" and any(
                a.name in carries for a in n.all_input_nodes if a is not n.args[0]):
            roots.add(root.name)
    from stagewise.planner.tracers import region_written_operands  # noqa: PLC0415 - tracers imports this module
    for n in graph.gm.graph.nodes:  # written inside a torch.export region (`with torch.no_grad(): c.add_(h.mean(0))`)
        for w in region_written_operands(graph.gm, n):
            root = alias_chain(w)[-1]
            if root.name not in carries and root.op != "get_attr" and any(
                    a.name in carries for a in n.all_input_nodes if a is not w):
                roots.add(root.name)
    graph._written_unowned_cache = roots
    return roots


def unowned_write_check(graph, node: torch.fx.Node) -> Optional[str]:
    """A tensor made from sizes alone that forward() writes per-member values into: under vmap it would be one tensor
    for all members. Made once per member instead (a loop stage of its own), it reaches the stage that writes into it
    as an [N, ...] tensor, and the writes, through views too, land in each member's rows."""
    if node.name in _written_unowned(graph):
        return (f"{_op_name(node)} makes a tensor from sizes alone that forward() writes per-member values into, which "
                "vmap would hold once for all members: made once per member")
    return None


def stateful_module_check(graph, node: torch.fx.Node) -> Optional[str]:
    """A module that updates its own buffers in forward (batch norm in training mode)."""
    if node.op != "call_module":
        return None
    mod = graph.gm.get_submodule(node.target)
    if isinstance(mod, nn.modules.batchnorm._NormBase) and mod.training and mod.track_running_stats:
        return f"in-place update of buffers running_mean/running_var ({type(mod).__name__} in training mode); call .eval() or exclude"
    return None


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


class _TracerConstant:
    """A probe argument: a tensor the tracer made (a constant of the graph), one for every member: not stacked."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _PerMemberNumber:
    """A probe argument: a Python number read from tensors, which the batched module hands a stage per member."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def vmap_probe_check(graph, node: torch.fx.Node) -> Optional[str]:
    """Run the node under vmap on stacked copies of its example inputs and parameters."""
    if node.op not in ("call_module", "call_function", "call_method"):
        return None
    values, data = graph.example_values, _data_numbers(graph)

    def value(a):  # a slice's bounds are nodes too (h[:T - 1]); the pytree does not enter slices
        if isinstance(a, slice):
            return slice(value(a.start), value(a.stop), value(a.step))
        if isinstance(a, torch.fx.Node) and a.name in data:  # read from tensors: arrives per member ([N]) at run time
            return _PerMemberNumber(values[a.name])
        if isinstance(a, torch.fx.Node) and a.op == "get_attr" and str(a.target).startswith(TRACER_CONSTANTS):
            return _TracerConstant(values[a.name])  # one for every member: not stacked
        return values[a.name] if isinstance(a, torch.fx.Node) else a

    args, kwargs = tree_map(value, node.args), tree_map(value, node.kwargs)
    # detached: a recorded view whose base a later op wrote in place (an Embedding(max_norm)'s weight read before the
    # lookup that renormalises it) is refused by autograd, and the probe only asks whether the op batches
    stack = lambda v: (torch.stack([v.detach()] * PROBE_MEMBERS) if isinstance(v, torch.Tensor)  # noqa: E731
                       else torch.tensor([v.value] * PROBE_MEMBERS) if isinstance(v, _PerMemberNumber) else v)
    batched = tree_map(lambda v: v.value if isinstance(v, _TracerConstant) else stack(v), (args, kwargs))
    in_dims = tree_map(lambda v: 0 if isinstance(v, (torch.Tensor, _PerMemberNumber)) else None, (args, kwargs))
    if node.op != "call_module" and not any(d == 0 for d in tree_flatten(in_dims)[0]):
        if _draws_random(node):  # torch.randn(x.shape): no tensor input, yet the loop draws anew for each member
            return f"randomness in {_op_name(node)} (each member would need its own random stream)"
        return None  # no tensor input: plain Python on sizes or scalars, runs the same for every member

    if node.op == "call_module":
        module = graph.gm.get_submodule(node.target)
        state = {k: stack(v.detach()) for k, v in {**dict(module.named_parameters()), **dict(module.named_buffers())}.items()}
        run = lambda st, a, kw: functional_call(module, st, a, kw)  # noqa: E731
    else:
        state = {}
        fn = node.target if node.op == "call_function" else (lambda self_, *a, **kw: getattr(self_, node.target)(*a, **kw))
        run = lambda st, a, kw: fn(*a, **kw)  # noqa: E731

    def probe(st, inputs):
        a, kw = inputs
        out = run(st, a, kw)
        leaves = [leaf for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
        return tuple(leaves) if leaves else torch.zeros(())

    # the probe's stacked copies keep a tensor's layout (a channels_last activation stacks to channels_last strides
    # per member), which the batched module's inputs need not have (a loop stage's rows stacked anew are contiguous,
    # and .to(memory_format=torch.channels_last) under vmap fails on those): such an op is probed both ways
    strided = lambda v: isinstance(v, torch.Tensor) and v.layout is torch.strided  # noqa: E731 - (a sparse one has no layout to vary)
    laid_out = any(strided(v) and not v.is_contiguous() for v in tree_flatten((args, kwargs))[0])
    tries = [batched, tree_map(lambda v: v.contiguous() if strided(v) else v, batched)] if laid_out else [batched]
    with warnings.catch_warnings(record=True) as caught, _vmap_fallback_off(), _cond_calls() as conds:
        warnings.simplefilter("always")
        outs = []
        for inputs in tries:
            try:
                with torch.no_grad():
                    outs.append(vmap(probe, in_dims=(0, in_dims), randomness="error")(state, inputs))
            except Exception as e:  # vmap and the ops raise many types; the message is the verdict
                return classify_vmap_error(node, e)
    if any(isinstance(pred, torch.Tensor) for pred in conds):  # a torch.cond inside a function of the model's
        return cond_check(graph, node, inside=True)
    promoted = _dtype_apart(outs[0], values.get(node.name))
    if promoted:
        return (f"vmap computes {_op_name(node)} in {promoted[0]} where each member computes it in {promoted[1]} (a 0-d "
                "tensor of another dtype beside its values, a buffer or a per-member number, takes part in type "
                "promotion under vmap as a tensor with a dim): each member runs it")
    for w in caught:
        text = str(w.message)
        if "performance drop" in text or "batching rule" in text:
            return f"no batching rule for {_op_name(node)} (vmap would fall back to a slow per-member loop)"
    if node.op == "call_function" and getattr(node.target, "__qualname__", "") == "apply_autograd_function":
        return _function_backward_check(node, probe, in_dims, state, batched)
    return None


@contextlib.contextmanager
def _cond_calls():
    """Inside: torch.cond records the predicates it is called with (the list yielded): a function of the model's that
    calls it under the vmap probe hands it a per-member tensor there."""
    seen: list = []
    original = torch.cond

    def watched(pred, *args, **kwargs):
        seen.append(pred)
        return original(pred, *args, **kwargs)

    torch.cond = watched
    try:
        yield seen
    finally:
        torch.cond = original


def _dtype_apart(got: Any, value: Any) -> tuple[str, str] | None:
    """(the probe's dtype, the member's) of the first tensor output whose dtype vmap changed, else None."""
    want = [v.dtype for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]
    have = [v.dtype for v in tree_flatten(got)[0] if isinstance(v, torch.Tensor)]
    if len(want) != len(have):
        return None  # (the probe's output is its own tuple of leaves; a count apart says nothing of dtypes)
    for g, w in zip(have, want):
        if g != w:
            return str(g).removeprefix("torch."), str(w).removeprefix("torch.")
    return None


def _function_backward_check(node: torch.fx.Node, probe: Callable, in_dims: Any, state: dict, batched: Any) -> Optional[str]:
    """A custom autograd.Function with a vmap rule runs its backward under vmap too, where some backwards cannot run
    (one calling torch.autograd.grad or requires_grad_): run it forward under vmap and backward, as training would.
    A backward marked @once_differentiable is not batched: under vmap a gradient taken through it with
    create_graph=True (a gradient penalty) loses the Function's second-order term without an error, where each
    member's own backward raises."""
    from stagewise.planner.trace_watch import _function_of  # trace_watch imports this module

    try:
        cls = _function_of(str(node.args[0]))
    except Exception:  # noqa: BLE001 - a Function this process cannot find is the trace's to report
        cls = None
    code = getattr(getattr(cls, "backward", None), "__code__", None)  # functools.wraps copied the name: the code is torch's
    if code is not None and ("once_differentiable" in getattr(code, "co_qualname", "") or (  # (co_qualname: Python 3.11+)
            code.co_name == "wrapper" and code.co_filename.replace("\\", "/").endswith("torch/autograd/function.py"))):
        return (f"the autograd.Function {node.args[0]}'s backward is @once_differentiable, whose second derivative "
                "vmap drops without an error where each member's raises (a gradient penalty through it): each member "
                "runs it, with its own backward")
    inputs = tree_map(lambda v: v.detach().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v,
                      batched)
    leaves = [v for v in tree_flatten(inputs)[0] if isinstance(v, torch.Tensor) and v.requires_grad]
    if not leaves:
        return None
    try:
        with torch.enable_grad(), _vmap_fallback_off():
            outs = vmap(probe, in_dims=(0, in_dims), randomness="error")(state, inputs)
            total = sum(o.float().sum() for o in outs if o.requires_grad)
            if isinstance(total, torch.Tensor):
                torch.autograd.grad(total, leaves, allow_unused=True)
    except Exception as e:  # noqa: BLE001 - the message is the verdict
        return (f"the autograd.Function {node.args[0]}'s backward fails under vmap ({type(e).__name__}: "
                f"{first_line(e)[:120]}): each member runs it, with its own backward")
    return None


_RANDOM_NAMES = frozenset({"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
                           "rand_like", "randn_like", "randint_like", "uniform", "uniform_", "normal_", "random_",
                           "exponential_", "geometric_", "cauchy_", "log_normal_", "bernoulli_"})


def region_graphs(node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """The graphs a torch.export region node runs (a `torch.no_grad()` / autocast block kept as a higher-order op
    holding its own graph module), or []."""
    owner = node.graph.owning_module
    if owner is None or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    subs = [getattr(owner, str(a.target), None) for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    return [sub for sub in subs if isinstance(sub, torch.fx.GraphModule)]


def _draws_random(node: torch.fx.Node) -> bool:
    """Whether `node` draws random numbers (torch.randn, aten.randn.default, x.normal_, ...)."""
    target = node.target
    if node.op == "call_method":
        return str(target) in _RANDOM_NAMES
    name = target.name().split("::")[-1].split(".")[0] if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", "")
    return name in _RANDOM_NAMES


@contextlib.contextmanager
def _vmap_fallback_off():
    """vmap raises where an op has no batching rule, instead of running it member by member with a warning: the
    warning is the only other sign, and it does not always reach Python (an aten op's, such as torch.export's
    _scaled_dot_product_flash_attention_for_cpu, went to stderr and the op counted as batchable)."""
    functorch = torch._C._functorch
    was = functorch._is_vmap_fallback_enabled()
    functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        functorch._set_vmap_fallback_enabled(was)


def classify_vmap_error(node: torch.fx.Node, e: BaseException) -> str:
    """A one-line reason from a vmap failure."""
    text = first_line(e)
    low = text.lower()
    if "hit the vmap fallback" in low:
        return f"no batching rule for {_op_name(node)} (vmap would fall back to a slow per-member loop)"
    if "autograd.function with functorch transforms" in low:
        return (f"the autograd.Function {node.args[0] if node.args else _op_name(node)} says no vmap rule (a "
                "setup_context staticmethod with a vmap staticmethod or generate_vmap_rule = True would batch it): "
                "each member runs it, with its own backward")
    if ".item()" in low or "item()" in low or "data-dependent" in low or "data dependent" in low:
        return f"data-dependent value (.item() / Python control flow on a tensor) in {_op_name(node)}"
    if "random" in low:
        return f"randomness in {_op_name(node)} (each member would need its own random stream)"
    if "batching rule" in low or "not implemented" in low:
        return f"no batching rule for {_op_name(node)}: {text[:160]}"
    if "inplace" in low or "in-place" in low:
        return f"in-place update not possible under vmap in {_op_name(node)}: {text[:160]}"
    return f"fails under vmap: {type(e).__name__}: {text[:200]}"


def _autocast_targets() -> tuple:
    hop = getattr(getattr(torch.ops, "higher_order", None), "wrap_with_autocast", None)
    amp = getattr(torch.amp, "autocast_mode", None)
    return tuple(t for t in (hop, getattr(amp, "_enter_autocast", None), getattr(amp, "_exit_autocast", None)) if t is not None)


_AUTOCAST_TARGETS = _autocast_targets()


def autocast_region_check(graph, node: torch.fx.Node) -> Optional[str]:
    """A `torch.autocast` block inside forward() (torch.export keeps it as a region op): torch.func.vmap does not
    apply autocast, so batched its ops would compute in the state's dtype where each member's run in the autocast one
    (and return that dtype)."""
    if node.op == "call_function" and any(node.target is t for t in _AUTOCAST_TARGETS):
        return ("an autocast region inside forward() (with torch.autocast(...)), which torch.func.vmap does not apply: "
                "each member runs it, in the autocast dtype")
    return None


_COND = getattr(getattr(torch.ops, "higher_order", None), "cond", None)


def cond_check(graph, node: torch.fx.Node, inside: bool = False) -> Optional[str]:
    """torch.cond on a predicate computed from the values (`torch.cond(h.min() > 0, f, g, (h,))`): torch.func.vmap runs
    both branches for every member and keeps each member's with torch.where, so the branch a member did not take
    enters its backward (0 * NaN where that branch is NaN there: a sqrt of negatives made every gradient of such a
    member NaN while the loop's were finite). Each member runs it, its own branch alone. `inside`: the vmap probe saw
    such a call inside the node (a torch.fx.wrap'd function, a leaf module)."""
    if inside or (node.op == "call_function" and _COND is not None and node.target is _COND and node.args
                  and isinstance(node.args[0], torch.fx.Node)):
        return ("torch.cond on a predicate computed from the values: vmap runs both branches for every member and "
                "selects, so the branch a member did not take enters its gradients (NaN from a branch NaN there); each "
                "member runs its own branch")
    return None


_VALUE_SHAPED_NAMES = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique2",
                                  "unique_dim", "bincount", "nonzero_static"})


# ops taking sizes (a length, a count, split points): given one computed from the values (`k = (h > 0).sum()`,
# `.item()`), each member's output has its own shape. The first argument of the data-first ones is the data.
_SIZED_FACTORIES = frozenset({"arange", "range", "zeros", "ones", "empty", "full", "rand", "randn", "randint",
                              "randperm", "linspace", "logspace", "eye", "tril_indices", "triu_indices"})
_SIZED_DATA_FIRST = frozenset({"narrow", "topk", "split", "tensor_split", "split_with_sizes", "view", "reshape",
                               "expand", "repeat", "tile", "unflatten", "new_zeros", "new_ones", "new_empty",
                               "new_full", "resize_", "slice", "as_strided", "kthvalue", "hsplit", "vsplit", "dsplit",
                               "chunk", "view_as", "broadcast_to", "pad", "constant_pad_nd", "interpolate",
                               "upsample", "unfold", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                               "adaptive_max_pool1d", "adaptive_max_pool2d"})
# ops that take a number as an operand of elementwise arithmetic, a comparison or a fill value: it sets no shape
_NUMBER_OPERAND_OPS = frozenset({
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "truediv", "floordiv", "remainder", "fmod", "mod", "pow",
    "rsub", "neg", "eq", "ne", "lt", "le", "gt", "ge", "where", "clamp", "clip", "clamp_min", "clamp_max", "lerp",
    "masked_fill", "fill", "fill_", "full_like", "maximum", "minimum", "fmax", "fmin", "addcmul", "addcdiv",
    "bitwise_and", "bitwise_or", "bitwise_xor", "and_", "or_", "xor", "lshift", "rshift", "atan2", "copysign",
    "hypot", "xlogy", "scalar_tensor", "tensor", "as_tensor", "_assert_scalar", "sym_constrain_range_for_size",
    "__add__", "__sub__", "__mul__", "__truediv__", "__floordiv__", "__mod__", "__pow__", "__radd__", "__rsub__",
    "__rmul__", "__rtruediv__", "__rpow__", "add_", "sub_", "mul_", "div_", "pow_", "clamp_", "masked_fill_",
})
_NUMBER_OF_VALUES = frozenset({"item", "tolist", "_local_scalar_dense", "int", "__int__", "__index__", "long"})


def _is_value_number(arg, values: dict, numbers: set) -> bool:
    """`arg` (an argument in a size position) is computed from tensor values: an integer tensor, or a Python number
    from .item()/.tolist()/int() (or arithmetic on one)."""
    if not isinstance(arg, torch.fx.Node):
        return False
    if arg.name in numbers:
        return True
    value = values.get(arg.name)
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()


def _size_from_values(node: torch.fx.Node, name: str, values: dict, numbers: set) -> bool:
    """A size-taking op (a factory, a split, a slice `h[:k]`) given a size computed from the values."""
    if name in ("getitem", "__getitem__") and len(node.args) > 1:  # h[:k]: a computed bound of a slice
        index = node.args[1]
        leaves = index if isinstance(index, (tuple, list)) else [index]
        return any(isinstance(i, slice) and any(_is_value_number(b, values, numbers) for b in (i.start, i.stop, i.step))
                   for i in leaves)
    if name in _SIZED_FACTORIES:
        sizes = list(node.args) + list(node.kwargs.get(k) for k in ("size", "end", "start", "steps", "high"))
    elif name in _SIZED_DATA_FIRST:
        sizes = list(node.args[1:]) + list(node.kwargs.values())
    else:
        # any other op given a whole number read from the values, outside arithmetic (F.one_hot(idx, k + 1), a
        # diagonal's offset, a pool's kernel size, flatten's start_dim): such a number may set the output's shape,
        # which then differs per member (a per-member number an op only computes with keeps its shape)
        out = values.get(node.name)
        if name in _NUMBER_OPERAND_OPS or not isinstance(out, torch.Tensor):
            return False
        leaves = tree_flatten((node.args, node.kwargs))[0]
        if any(isinstance(values.get(a.name), torch.Tensor) and values[a.name].shape == out.shape
               for a in leaves if isinstance(a, torch.fx.Node)):
            return False  # the shape of an input (roll, tril, nan_to_num, threshold): the number sets no shape
        return any(isinstance(a, torch.fx.Node) and a.name in numbers and type(values.get(a.name)) is int
                   for a in leaves)
    flat = []
    for a in sizes:
        flat.extend(a if isinstance(a, (tuple, list)) else [a])
    return any(_is_value_number(a, values, numbers) for a in flat)


def _value_shaped_op(node: torch.fx.Node, values: dict, numbers: set = frozenset()) -> bool:
    """An op whose output shape depends on its input's values: torch.where(cond) with one argument, nonzero,
    masked_select, unique, bincount, repeat_interleave by a tensor, indexing with a bool mask, a size computed from
    the values (`h[:k]`, `torch.arange(k)`, `tensor_split(h, idx)`)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = base_name(node)
    if name in _VALUE_SHAPED_NAMES:
        return True
    if _size_from_values(node, name, values, numbers):
        return True
    if name == "where" and len(node.args) == 1 and not node.kwargs:
        return True
    if name == "repeat_interleave" and ((len(node.args) > 1 and isinstance(node.args[1], torch.fx.Node))
                                        or (len(node.args) == 1 and "repeats" not in node.kwargs)):
        return True  # (one argument: the counts themselves, torch.repeat_interleave(counts))
    if name == "one_hot" and (node.args[1] if len(node.args) > 1 else node.kwargs.get("num_classes", -1)) == -1:
        return True  # as many classes as the largest value + 1
    if name == "multinomial" and (len(node.args) > 1 and isinstance(node.args[1], torch.fx.Node)
                                  or isinstance(node.kwargs.get("num_samples"), torch.fx.Node)):
        return True  # a count of draws computed from the values
    if name in ("getitem", "__getitem__", "index") and len(node.args) > 1:  # x[mask]: a bool tensor among the indices
        index = node.args[1]
        leaves = index if isinstance(index, (tuple, list)) else [index]
        return any(isinstance(i, torch.fx.Node) and isinstance(values.get(i.name), torch.Tensor)
                   and values[i.name].dtype == torch.bool for i in leaves)
    return False


def _value_shaped(graph) -> dict[str, str]:
    """Nodes that cannot run batched because a shape on their way depends on the values (each member's differs):
    the value-shaped ops themselves and every node reading what they (or such nodes) give, name -> the op it comes
    from. A node's output is fixed-shape again where it writes in place into a value that is not (index_add_ into
    zeros_like(x): a top-k MoE's dispatch) or reduces to a number; its readers batch."""
    cached = graph.gm.meta.get("stagewise_value_shaped")
    if cached is not None:
        return cached
    values = graph.example_values
    shaped: dict[str, str] = {}  # node -> where its shape comes from (its output varies per member)
    reads: dict[str, str] = {}  # node -> the value-shaped op it reads (it must run per member)
    # (also a shape computed from the inputs alone: a per_member input, a random draw, a buffer or a per-member number
    # makes it differ per member, which the trace cannot tell from a shared input's; per member is right for both)
    numbers: set = set()  # Python numbers computed from tensor values (.item(), int(t), and arithmetic on them)
    for node in graph.gm.graph.nodes:
        if node.op in ("call_function", "call_method") and not isinstance(values.get(node.name), torch.Tensor) and (
                base_name(node) in _NUMBER_OF_VALUES or any(a.name in numbers for a in node.all_input_nodes)):
            numbers.add(node.name)
        source = next((shaped[a.name] for a in node.all_input_nodes if a.name in shaped), None)
        if _value_shaped_op(node, values, numbers):
            source = source or node.name
            reads[node.name] = source
            shaped[node.name] = source
            continue
        if source is None:
            continue
        reads[node.name] = source
        first = node.args[0] if node.args else None
        writes_into_fixed = (is_inplace(node) or base_name(node) in _INTO_FIRST) and isinstance(first, torch.fx.Node) \
            and first.name not in shaped  # index_add_(0, tok, y) / index_put((idx,), y) into a fixed-size value
        fixed = writes_into_fixed or (isinstance(values.get(node.name), torch.Tensor) and values[node.name].dim() == 0)
        if not fixed and node.op != "output":
            shaped[node.name] = source
    graph.gm.meta["stagewise_value_shaped"] = reads
    return reads


_INTO_FIRST = frozenset({"index_put", "index_add", "index_copy", "index_fill", "scatter", "scatter_add", "scatter_reduce",
                         "masked_scatter", "put"})  # out-of-place forms giving the first argument's shape


def value_shape_check(graph, node: torch.fx.Node) -> Optional[str]:
    """Each member runs a node whose inputs' shapes depend on the values (see _value_shaped)."""
    source = _value_shaped(graph).get(node.name)
    if source is None:
        return None
    return (f"a shape that depends on the values ({source}: torch.where(cond), nonzero, a boolean mask): each member's "
            "differs, so each member runs it, up to where a fixed-shape value comes out (index_add_ into a buffer of "
            "fixed size)")


_NORM_STATS: dict[Any, tuple[int, int, int | None]] = {
    nn.functional.batch_norm: (1, 2, 5), nn.functional.instance_norm: (1, 2, 5),
    torch.batch_norm: (3, 4, 5), torch.instance_norm: (3, 4, 5),
    torch.ops.aten.batch_norm.default: (3, 4, 5), torch.ops.aten.instance_norm.default: (3, 4, 5),
    torch.ops.aten.native_batch_norm.default: (3, 4, 5), torch.ops.aten._native_batch_norm_legit.default: (3, 4, 5),
    torch.ops.aten._batch_norm_impl_index.default: (3, 4, 5), torch.ops.aten.cudnn_batch_norm.default: (3, 4, 5),
    torch.ops.aten.miopen_batch_norm.default: (3, 4, 5), torch.ops.aten._batch_norm_with_update.default: (3, 4, None),
}
_NORM_KEYWORDS = (("running_mean",), ("running_var",), ("training", "use_input_stats"))


def norm_stats_updated(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The running statistics (graph values) a functional batch or instance norm node updates in place: those it is
    handed when its training / use_input_stats flag is True, or a value the graph computes (it may be True)."""
    where = _NORM_STATS.get(node.target) if node.op == "call_function" else None
    if where is None:
        return []

    def arg(pos: int | None, keys: tuple[str, ...]) -> Any:
        if pos is not None and pos < len(node.args):
            return node.args[pos]
        return next((node.kwargs[k] for k in keys if k in node.kwargs), None if pos is not None else True)

    mean_at, var_at, flag_at = where
    flag = arg(flag_at, _NORM_KEYWORDS[2])
    if flag is None and node.target is nn.functional.batch_norm:
        flag = False  # F.batch_norm's default (F.instance_norm's use_input_stats defaults to True)
    if flag is False:
        return []  # normalises with the statistics, updates nothing
    stats = (arg(mean_at, _NORM_KEYWORDS[0]), arg(var_at, _NORM_KEYWORDS[1]))
    return [s for s in stats if isinstance(s, torch.fx.Node)]


def norm_stats_view_check(graph, node: torch.fx.Node) -> Optional[str]:
    """A functional batch or instance norm updating running statistics handed as a view of a buffer
    (`F.batch_norm(x, self.stats[0], self.stats[1], training=True)`): under vmap the update of such a strided view of
    the stacked buffer is dropped without a word (each member's statistics would stay as they were), so the node runs
    as the member loop. Whole buffers (BatchNorm's own) batch."""
    for stat in norm_stats_updated(node):
        root = alias_chain(stat)[-1]
        if stat.op != "get_attr" and root.op == "get_attr":
            return (f"{_op_name(node)} updates running statistics held as a view of buffer '{root.target}' "
                    "(vmap drops the update of a view of a stacked buffer)")
    return None


_TO_NUMBER = {"item", "tolist", "_local_scalar_dense"}  # a tensor's value read into Python


def _data_numbers(graph) -> set[str]:
    """Names of the nodes whose value is a Python number read from a tensor's values (`h.mean().item()`, `float(t)`)
    or computed from one (`m2 - m * m`): each member's differs, so a later stage gets them per member, as an [N]
    tensor (vmap_probe_check probes them so). Sizes (`x.shape[0] * 2`) are the same for every member and are not
    among them. Computed once per graph."""
    cached = getattr(graph, "_data_numbers_cache", None)
    if cached is not None:
        return cached
    values = getattr(graph, "example_values", None) or {}
    out: set[str] = set()
    for n in graph.gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or type(values.get(n.name)) not in (bool, int, float):
            continue
        first = n.args[0] if n.args else None
        read = base_name(n) in _TO_NUMBER or ((n.target in (float, int, bool) or getattr(n.target, "__module__", None) == "math")
                                            and isinstance(first, torch.fx.Node)
                                            and isinstance(values.get(first.name), torch.Tensor)) or (
            # a function of the model's own (torch.fx.wrap) that turns tensors into a number (`scale_of(h)` returning
            # h.abs().mean().item()): each member's differs too
            _own_function(n) and any(isinstance(values.get(a.name), torch.Tensor) for a in n.all_input_nodes))
        if read or any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    graph._data_numbers_cache = out
    return out


def _own_function(node: torch.fx.Node) -> bool:
    """`node` calls a function of the model's own that the trace kept closed (torch.fx.wrap): not torch's."""
    return node.op == "call_function" and isinstance(node.target, types.FunctionType) and not (
        node.target.__module__ or "").startswith("torch")


def _holds_numbers(v: Any) -> bool:
    """`v` is a Python number, or a tuple / list of them."""
    if isinstance(v, (tuple, list)):
        return bool(v) and all(type(x) in (bool, int, float) for x in v)
    return type(v) in (bool, int, float)


def _has_float(v: Any) -> bool:
    """`v` is a Python float, or a tuple / list holding one."""
    return type(v) is float or (isinstance(v, (tuple, list)) and any(type(x) is float for x in v))


_ON_RETURNED_NUMBERS = frozenset({operator.neg, operator.pos, operator.abs, operator.add, operator.sub, operator.mul,
                                operator.truediv, operator.floordiv, operator.mod, operator.pow, operator.lt, operator.le,
                                operator.gt, operator.ge, operator.eq, operator.ne, operator.getitem, float, int, bool,
                                round, abs, min, max})


def _returned_numbers(graph) -> set[str]:
    """Names of the nodes whose value is Python numbers a function of the model's own (torch.fx.wrap) returned from
    tensors (`m, m2 = stats(h)` with `.item()`s inside it), or computed from such by Python arithmetic. Build runs the
    arithmetic on numbers forward() itself reads (`.item()`) in double, as the loop does (executor.exact_numbers), but
    cannot see what such a function returns: its numbers would arrive as float32 tensors. Computed once per graph."""
    cached = getattr(graph, "_returned_numbers_cache", None)
    if cached is not None:
        return cached
    values = getattr(graph, "example_values", None) or {}
    out: set[str] = set()
    for n in graph.gm.graph.nodes:
        if n.op != "call_function" or not _holds_numbers(values.get(n.name)):
            continue
        inputs = n.all_input_nodes
        if _own_function(n) and any(isinstance(values.get(a.name), torch.Tensor) for a in inputs):
            out.add(n.name)
        elif (n.target in _ON_RETURNED_NUMBERS or getattr(n.target, "__module__", None) == "math") \
                and any(a.name in out for a in inputs):
            out.add(n.name)
    graph._returned_numbers_cache = out
    return out


def own_function_numbers_check(graph, node: torch.fx.Node) -> Optional[str]:
    """Python arithmetic on numbers a function of the model's own returned, and such a function given a number read
    from tensors: in the loop these are Python doubles; batched they would be float32 tensors (a variance from two
    moments near 100, `m2 - m * m`, 3e-3 off). Each member runs them, on its Python numbers."""
    if node.op != "call_function":
        return None
    values = graph.example_values
    if node.name in _returned_numbers(graph) and not _own_function(node) and any(
            _has_float(values.get(a)) for a in [node.name, *(x.name for x in node.all_input_nodes)]):
        # (whole numbers alone stay exact as int64: a size a helper returns, `n // 2`, batches)
        return (f"Python arithmetic ({_op_name(node)}) on numbers a function of the model's own returned (torch.fx.wrap): "
                "the member loop computes it on Python doubles, a batched run would on float32 tensors: each member runs it")
    if _own_function(node):
        data = _data_numbers(graph) | _returned_numbers(graph)
        given = [a.name for a in node.all_input_nodes if a.name in data]
        if given and any(_has_float(values.get(a)) for a in given):
            return (f"{_op_name(node)}, a function of the model's own (torch.fx.wrap), is given a number read from tensors "
                    f"({given[0]}): the member loop hands it a Python double, a batched run would a float32 tensor, on "
                    "which its arithmetic rounds otherwise: each member runs it")
    return None


_FULL_REDUCTIONS_SPLIT_AT_TIES = frozenset({"max", "min", "median", "nanmedian"})


def tied_reduction_check(graph, node: torch.fx.Node) -> Optional[str]:
    """Each member runs a full max / min / median (no dim): its gradient is split evenly among tied elements, and
    vmap's batched rule hands all of it to one of them, so a gradient where values tie (integer-valued features, a
    quantised tensor's largest magnitude) would differ from the member loop's."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = _op_name(node).rsplit(".", 1)[-1]
    if isinstance(node.target, torch._ops.OpOverload):
        name = node.target._schema.name.split("::")[-1] if node.target._overloadname == "default" else ""
    if name not in _FULL_REDUCTIONS_SPLIT_AT_TIES or len(node.args) != 1 or node.kwargs:
        return None
    if node.users and all(_op_name(u) in _TO_NUMBER or u.target in (float, int) for u in node.users):
        return None  # read into a Python number (`.item()`): no gradient goes through it
    return (f"a {name}() over the whole tensor: torch splits its gradient among tied elements, vmap's batched rule "
            "gives it to one of them, so each member runs it (the values are the same either way)")


DEFAULT_CHECK = chain(own_function_numbers_check, autocast_region_check, cond_check, value_shape_check, stateful_module_check, inplace_buffer_check,
                      norm_stats_view_check, unowned_write_check, tied_reduction_check, vmap_probe_check)


def annotate_capability(graph, check: Check = DEFAULT_CHECK) -> None:
    """Set `batchable` and `reason` on every node of `graph.dag` (in place)."""
    for node in graph.gm.graph.nodes:
        reason = check(graph, node) if node.op in ("call_module", "call_function", "call_method") else None
        graph.dag.nodes[node.name]["batchable"] = reason is None
        graph.dag.nodes[node.name]["reason"] = reason or ""


def unbatchable(graph) -> dict[str, str]:
    """Node name -> reason, for every node that cannot run batched."""
    return {n: d["reason"] for n, d in graph.dag.nodes(data=True) if not d.get("batchable", True)}
