"""Opening leaf modules: trace inside modules torch.fx keeps as single `call_module` nodes.

fx's default tracer keeps every torch.nn module (Linear, LayerNorm, MultiheadAttention,
TransformerEncoderLayer, GRU, ...) as one opaque node. `trace(..., open_modules=[...])`
names modules to trace inside instead; their ops become nodes of their own, with the
opened module's path as `module_path`, that can be planned like any other.

What a name may be (`resolve_open_modules`):
- a dotted module path, "encoder.layers.0";
- a glob over paths, "*" standing for one path component and "**" for any number,
  "encoder.layers.*", "**.self_attn";
- a class name, "TransformerEncoderLayer": every module of that class.
Opening a module inside a leaf opens the leaves around it too ("enc.layers.0" opens "enc").
A name that only matches modules fx already traces inside (a user module) opens nothing
and is not recorded; a name that matches no module is a TraceError listing what can be opened.

fx traces the opened module's forward() with PyTorch's MHA fast path switched off
(`no_mha_fastpath`): TransformerEncoderLayer checks the fast path's conditions on the
input (`src.dim() != 3`) before its ordinary path, which a symbolic trace cannot
evaluate; with the fast path off those checks are skipped and the ordinary path (the
one vmap can batch) is traced. Modules whose forward() still branches on their input
(MultiheadAttention, TransformerEncoder, GRU/LSTM) make fx fail; planner.graph then
falls back to torch.export, whose graph opens every module, and says so in the tracer note.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx
from torch import nn
from torch.fx.immutable_collections import immutable_dict

from stagewise.planner.errors import TraceError
from stagewise.planner.trace_watch import _bound_state_reads_refused


@dataclass(frozen=True)
class LeafModule:
    """One `call_module` node of a traced graph: a module the planner cannot see inside (plain data for the UI)."""

    path: str  # dotted module path, what open_modules takes
    type_name: str  # the module's class name, "MultiheadAttention"
    node: str  # the fx node that calls it
    batchable: bool  # the capability probe's verdict on the whole module
    reason: str = ""  # why it cannot run under vmap ("" when batchable)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)  # never called: fx reaches what they hold


def default_leaf(module: nn.Module, path: str) -> bool:
    """Whether torch.fx's default tracer keeps `module` as one call_module node (containers are never called)."""
    return not isinstance(module, _CONTAINERS) and torch.fx.Tracer().is_leaf_module(module, path)


def openable_modules(model: nn.Module) -> list[tuple[str, str]]:
    """(path, class name) of every module a default fx trace cannot see inside: leaves and what they hold."""
    inside_leaf: list[str] = []
    out = []
    for path, mod in model.named_modules():
        if not path:
            continue
        if any(path.startswith(p + ".") for p in inside_leaf) or default_leaf(mod, path):
            out.append((path, type(mod).__name__))
            inside_leaf.append(path)
    return out


def resolve_open_modules(model: nn.Module, names: Iterable[str]) -> tuple[str, ...]:
    """The module paths `names` (paths, globs or class names) open, in the model's module order.

    Returns only modules fx would not trace inside by default (leaves and modules inside
    leaves); a name that matches only other modules adds nothing.
    Raises:
        TraceError naming the first name that matches no module, with the leaf modules that can be opened.
    """
    names = [str(n) for n in names]
    if not names:
        return ()
    modules = [(path, type(mod).__name__) for path, mod in model.named_modules() if path]
    openable = {path for path, _ in openable_modules(model)}
    chosen: set[str] = set()
    for name in names:
        matched = [path for path, cls in modules if _matches(name, path, cls)]
        if not matched:
            raise TraceError(f"open_modules: {type(model).__name__} has no module {name!r}; "
                             f"{_openable_hint(model)}")
        chosen.update(p for p in matched if p in openable)
    opened = tuple(path for path, _ in modules if path in chosen)
    for path in opened:
        why = cumulative_batchnorm(model.get_submodule(path), path)
        if why:
            raise TraceError(
                f"open_modules: {why}. Leave {path} closed (the default: it runs as one module for each member and "
                "updates its running statistics as the member loop does), or give it a momentum (momentum=0.1 is "
                "BatchNorm's default); traced in eval mode it opens, for a batched module kept in eval mode")
    return opened


def cumulative_batchnorm(module: nn.Module, path: str) -> str:
    """Why `module` (at `path`) cannot be traced inside as it is now ("" when it can).

    A BatchNorm layer with momentum=None keeps a cumulative moving average: in training its forward() takes
    `1.0 / float(self.num_batches_tracked)` as the update factor, a buffer's value read into Python on every call.
    torch.fx cannot follow it, and torch.export stops on the data-dependent number (GuardOnDataDependentSymNode, which
    named neither the layer nor the fix). Closed, the layer runs as one module per member and updates its statistics
    as the member loop does."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None and module.training \
            and module.track_running_stats:
        return (f"{path} ({type(module).__name__}) has momentum=None (a cumulative moving average), so in training its "
                "forward() reads the value of its num_batches_tracked buffer into Python on every call (the update "
                "factor 1 / num_batches_tracked), which neither torch.fx nor torch.export can trace")
    return ""


def _matches(name: str, path: str, cls: str) -> bool:
    """Whether `name` (a path, a glob or a class name) names the module at `path` of class `cls`."""
    if name in (path, cls):
        return True
    if "*" not in name and "?" not in name:
        return False
    return re.fullmatch(_glob_regex(name), path) is not None


def _glob_regex(pattern: str) -> str:
    """A path glob as a regex: "**" any number of components, "*" within one, "?" one character."""
    out = []
    for part in re.split(r"(\*\*|\*|\?)", pattern):
        out.append({"**": ".*", "*": r"[^.]*", "?": r"[^.]"}.get(part, re.escape(part)))
    return "".join(out)


def _openable_hint(model: nn.Module) -> str:
    """The top-level leaf modules, for an error message."""
    openable = openable_modules(model)
    tops = [(p, c) for p, c in openable if not any(p.startswith(q + ".") for q, _ in openable)]
    if not tops:
        return "it has no leaf modules: fx already traces inside all of it"
    shown = ", ".join(f"{p} ({c})" for p, c in tops[:12]) + (f", ... ({len(tops)} in all)" if len(tops) > 12 else "")
    return f"leaf modules that can be opened: {shown} (or a module inside one, e.g. {tops[0][0]}.<child>, or a class name)"


def with_ancestors(paths: Iterable[str]) -> frozenset[str]:
    """`paths` and every module around them ("a.b.c" -> a, a.b, a.b.c): fx must trace through those to reach them."""
    out: set[str] = set()
    for p in paths:
        parts = p.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(out)


class ContainerTracer(torch.fx.Tracer):
    """torch.fx's tracer, keeping a dict of its own type (an OrderedDict, a Hugging Face ModelOutput) as that type:
    fx itself records every dict as a plain one, so a graph returned `{'logits': ...}` where forward() returns an
    object with `.logits` and `[0]`, and a layer handed such an object got a dict. Such a dict is built by a node
    of its type instead, as fx builds a dataclass."""

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, dict) and type(a) is not dict and not isinstance(a, (immutable_dict, torch.fx.Proxy)):
            if dataclasses.is_dataclass(a):  # ModelOutput: its fields (those left None drop out as in forward())
                kwargs = {f.name: self.create_arg(getattr(a, f.name)) for f in dataclasses.fields(a)}
                return self.create_node("call_function", type(a), (), kwargs)
            if type(a) is collections.OrderedDict:
                pairs = [(self.create_arg(k), self.create_arg(v)) for k, v in a.items()]
                return self.create_node("call_function", collections.OrderedDict, (pairs,), {})
        return super().create_arg(a)


class OpeningTracer(ContainerTracer):
    """torch.fx's tracer with the given module paths (and the modules around them) no longer leaves.

    `proxy_buffers`: buffers read in forward() become graph values (fx's `proxy_buffer_attributes`),
    so what forward() computes from them (`self.B.t()`, `self.pe[:16]`) is recorded as ops on them
    instead of run once at trace time on member 0's buffer and stored as a constant."""

    def __init__(self, opened: Iterable[str] = (), proxy_buffers: bool = False,
                 real_buffers: Iterable[str] = ()):  # no arguments: unpickling a GraphModule
        super().__init__()
        self.opened = with_ancestors(opened)
        self.proxy_buffer_attributes = proxy_buffers
        self.real_buffers = frozenset(real_buffers)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opened:
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        # `real_buffers` (names) stay the tensors they are while the other buffers are graph values: forward() reads
        # their values into Python (`int(self.act_id)`), which no graph value can give, beside a buffer sliced by a
        # traced size (`self.pe[:, :x.size(1)]`), which no real tensor can take (buffers_read_in_python)
        if self.real_buffers and isinstance(attr_val, torch.Tensor) and not isinstance(attr_val, nn.Parameter):
            names = self.__dict__.get("_buffer_names")
            if names is None:  # once per trace (a scan per attribute read cost 128 layers seconds)
                names = self.__dict__["_buffer_names"] = {id(b): name for name, b in self.root.named_buffers()}
            if names.get(id(attr_val)) in self.real_buffers:
                return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)


class _ReadFailure(TypeError):
    """A traced value forward() turns into Python that no state alone makes (an input's, a module call's)."""

    def __init__(self, what: str):
        super().__init__(f"{what}() of a traced value")


class _ReadProxy(torch.fx.Proxy):
    """A proxy that, turned into a Python number, bool, index or length, tells its tracer which buffers its value
    came from and, where the value comes from the model's state alone, gives the state's value instead of failing
    (see _ReadRecordingTracer)."""

    def _read(self, what: str, convert: Callable[[Any], Any]) -> Any:
        return convert(self.tracer.value_of(self.node, what))

    def __int__(self):
        return self._read("int", int)

    def __float__(self):
        return self._read("float", float)

    def __complex__(self):
        return self._read("complex", complex)

    def __index__(self):
        return self._read("index", operator.index)

    def __len__(self):
        return self._read("len", len)


_SHAPE_READS = frozenset({"size", "dim", "numel", "shape", "ndim", "ndimension", "dtype", "device"})


def _shape_read(node: torch.fx.Node) -> bool:
    """`t.size(1)`, `t.shape`, `t.dim()`: what it reads of `t` is no value (a buffer's shape is the same per member)."""
    if node.op == "call_method":
        return node.target in _SHAPE_READS
    return node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in _SHAPE_READS


class _ReadRecordingTracer(OpeningTracer):
    """OpeningTracer with every buffer a graph value, recording the buffers (get_attr names) whose values forward()
    turns into Python (a number, bool, index, length or iterator of a value derived from them, not through a shape
    read). A value made of the model's state alone is worked out on the real state (copies: nothing is written) and
    given to forward(), so one trace finds every such read; one that derives from an input, or through a module call,
    fails as any proxy does (a _ReadFailure)."""

    def __init__(self, opened: Iterable[str]):
        super().__init__(opened, True)
        self.read: set[str] = set()
        self._values: dict[torch.fx.Node, Any] = {}

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _ReadProxy(node, self)

    def _ancestry(self, node: torch.fx.Node) -> tuple[set[str], bool]:
        """(the buffers `node`'s value derives from, not through shape reads; whether it derives from state alone)"""
        buffers = self.__dict__.get("_buffer_set")
        if buffers is None:
            buffers = self.__dict__["_buffer_set"] = {name for name, _ in self.root.named_buffers()}
        found, alone = set(), True
        seen, todo = set(), [(node, False)]
        while todo:  # (node, reached through a shape read: its buffers' values are not read)
            n, shaped = todo.pop()
            if (n, shaped) in seen:
                continue
            seen.add((n, shaped))
            if n.op in ("placeholder", "call_module"):
                alone = False
            if n.op == "get_attr" and str(n.target) in buffers and not shaped:
                found.add(str(n.target))
            todo.extend((m, shaped or _shape_read(n)) for m in n.all_input_nodes)
        return found, alone

    def value_of(self, node: torch.fx.Node, what: str) -> Any:
        found, alone = self._ancestry(node)
        if not alone:  # (not recorded: torch's argument parsing tries __index__ and goes on where it fails)
            raise _ReadFailure(what)
        try:
            value = self._evaluate(node)
        except Exception as e:  # noqa: BLE001 - named as the read it is
            raise _ReadFailure(what) from e
        self.read |= found
        return value

    def _evaluate(self, node: torch.fx.Node) -> Any:
        """`node`'s value on copies of the real state (get_attr, call_function and call_method nodes only)."""
        if node in self._values:
            return self._values[node]
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self._evaluate)
        if node.op == "get_attr":
            # (not getattr: while fx traces, a module's attribute access gives the proxy of a parameter or buffer)
            path, _, name = str(node.target).rpartition(".")
            owner = self.root.get_submodule(path)
            value = owner._buffers[name] if name in owner._buffers else owner._parameters[name] \
                if name in owner._parameters else vars(owner)[name]
            value = value.detach().clone() if isinstance(value, torch.Tensor) else value
        elif node.op == "call_function":
            value = node.target(*args, **kwargs)
        elif node.op == "call_method":
            value = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            raise _ReadFailure("evaluate")
        self._values[node] = value
        return value

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        return bool(self.value_of(obj.node, "bool"))

    def iter(self, obj: torch.fx.Proxy) -> Iterator:
        return iter(self.value_of(obj.node, "iter"))


def symbolic_trace_opening(model: nn.Module, opened: Iterable[str], concrete_args: dict[str, Any] | None,
                           proxy_buffers: bool = False, real_buffers: Iterable[str] = ()) -> torch.fx.GraphModule:
    """torch.fx.symbolic_trace with `opened` traced inside (the same GraphModule when nothing is opened);
    `proxy_buffers` and `real_buffers` as OpeningTracer says (`real_buffers` given makes every other buffer a graph
    value). The constants fx stores on `model` while tracing (`_tensor_constant0`, ...) are taken off it again: the
    GraphModule holds its own. A buffer's values read through a callable attribute holding the tensor
    (`self.eq = self.mode.equal`) are refused (`_bound_state_reads_refused`): no trace could swap each member's buffer
    in there."""
    real_buffers = frozenset(real_buffers)
    tracer = OpeningTracer(opened, proxy_buffers or bool(real_buffers), real_buffers)
    return _traced(model, tracer, concrete_args)


def _traced(model: nn.Module, tracer: OpeningTracer, concrete_args: dict[str, Any] | None) -> torch.fx.GraphModule:
    with no_mha_fastpath(), tracer_attributes_removed(model), _bound_state_reads_refused(model):
        graph = tracer.trace(model, concrete_args=concrete_args)
        return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


def buffers_read_in_python(model: nn.Module, opened: Iterable[str], concrete_args: dict[str, Any] | None
                           ) -> frozenset[str] | None:
    """The buffers (dotted names) whose values forward() turns into Python (`int(self.act_id)`, Glow ActNorm's
    `self.initialized.item()`, `if self.flag.any():`), found by a trace with every buffer a graph value where each
    such read of a value made of the state alone is worked out on the real state (nothing is written to `model`).
    None where that trace fails all the same (a read of a value an input makes, a Python loop over a buffer's rows
    through a module): what is read is then not known.

    Keeping those buffers real tensors and making every other buffer a graph value traces a forward() that neither
    plain trace takes: one buffer sliced by a traced size (the tutorial PositionalEncoding's `self.pe[:, :x.size(1)]`,
    a causal mask's `self.bias[:, :, :T, :T]`), which only a graph value can take, beside a buffer read into Python,
    which only a real tensor can give (planner.graph._fx_trace)."""
    tracer = _ReadRecordingTracer(opened)
    try:
        _traced(model, tracer, concrete_args)
    except Exception:  # noqa: BLE001 - whatever stops fx stops the reads' search too
        return None
    return frozenset(tracer.read)


@contextlib.contextmanager
def tracer_attributes_removed(model: nn.Module) -> Iterator[None]:
    """Attributes added to `model` itself inside the block (fx stores the tensors it bakes into a graph there)
    are deleted at its end, so tracing leaves the model as it was and a second trace names them alike."""
    before = set(vars(model))
    try:
        yield
    finally:
        for k in set(vars(model)) - before:
            delattr(model, k)


@contextlib.contextmanager
def no_mha_fastpath() -> Iterator[None]:
    """PyTorch's fused MHA/Transformer fast path switched off (process-wide) while tracing, then restored."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
