"""Tracing: a model becomes a ModelGraph (an fx GraphModule plus a networkx DAG
with shapes, dtypes, parameter counts, FLOPs and a capability verdict per node).

torch.fx.symbolic_trace is tried first (standard layers stay single call_module
nodes); when it fails, torch.export is used and nodes carry their module path
from `nn_module_stack`. The tracer used and why the first one failed are kept.

Beside it: planner.tracers (how each tracer is called), planner.trace_watch (what
watches the trace and refuses), planner.module_refusals (hooks and overrides a trace
cannot repeat per member), planner.snapshot (plain attributes, state before/after).
"""
from __future__ import annotations

import contextlib
import collections
import copy
import dataclasses
import hashlib
import operator
import re
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import networkx as nx
import torch
import torch.fx
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from stagewise.planner.capability import (BAKED_PREFIXES, alias_chain, annotate_capability, base_name, is_inplace,
                                          norm_stats_updated, written_later_arguments)
from stagewise.planner.errors import TraceError
from stagewise.planner.errors import first_line as _first_line
from stagewise.planner.inputs import traced_specs
from stagewise.planner.opening import LeafModule, buffers_read_in_python, resolve_open_modules, symbolic_trace_opening
from stagewise.planner.plan import InputSpec
# names the executor imports from here stay importable from here (noqa: F401); tests patch
# _grad_mode_watch and _host_state_refused on this module, where _fx_trace, trace and retrace look them up
from stagewise.planner.module_refusals import (  # noqa: F401
    global_hooks_present, global_hooks_refusal, hook_computed_weights, hook_configs, hooks_refusal, registration_hooks_off)
from stagewise.planner.snapshot import _HOOK_TABLES, PLAIN_TYPES, drop_added_capturing_hooks, StateChange, StateSnapshot, _same_tensor, config_fields, copy_plain, plain_attributes, restore_all, state_refusal  # noqa: F401
from stagewise.planner.trace_watch import (  # noqa: F401
    RANDOM_OPS, _autograd_functions_kept, _autograd_hooks_refused, _grad_mode_watch, _grad_state_proxied, _host_state_refused, _inference_mode_as_no_grad, _input_writes_recorded, _RandomWatch,
    _tensor_values_read,
    storage_root, storage_sharers)
from stagewise.planner.tracers import (LIFTED_CONSTANT, _defaults_not_given, _drop_concrete_placeholders, _export, check_small_sizes,
                                      data_assignment, data_assignment_refusal, detach_out_of_place, out_as_copies, region_written_operands,
                                      views_as_reshapes)

COMPUTE_OPS = ("call_module", "call_function", "call_method", "get_attr")  # nodes that belong to stages


@dataclass
class NodeInfo:
    """What the planner knows about one fx node (also stored as networkx node attributes)."""

    name: str
    op: str  # fx op: placeholder, get_attr, call_module, call_function, call_method, output
    target: str  # readable target: module path + class, function or method name
    module_path: str  # dotted path of the owning nn.Module ("" at top level)
    shape: str  # "[32, 64]", "([8, 32, 64], [1, 8, 64])", or a Python type name
    dtype: str
    params: int  # parameters owned by this node (call_module: the module's; get_attr: the tensor's)
    flops: int  # FLOPs measured with FlopCounterMode on the example inputs (member 0)
    batchable: bool = True
    reason: str = ""  # why the node cannot run under vmap ("" when batchable)


@dataclass
class ModelGraph:
    """A traced model. The planner's only view of the model; the UI never sees it."""

    gm: torch.fx.GraphModule
    dag: nx.DiGraph  # node id = fx node name; attributes = NodeInfo fields
    tracer: str  # "fx" or "export"
    tracer_note: str  # why fx failed when tracer == "export"
    input_names: list[str]
    node_names: list[str]  # all nodes in graph (topological) order
    fingerprint: str
    example_values: dict[str, Any] = field(repr=False, default_factory=dict)  # node -> value on example inputs
    out_spec: Any = None  # pytree spec of the output for export graphs (flat outputs otherwise)
    input_specs: dict[str, InputSpec] = field(default_factory=dict)  # traced shape/dtype/dynamic dims per input (planner.inputs)
    input_guard: Any = field(repr=False, default=None)  # export's input-guard function (one member's inputs), None for fx
    opened_modules: tuple[str, ...] = ()  # module paths traced inside instead of kept as leaves (planner.opening)

    @property
    def compute_nodes(self) -> list[str]:
        """Nodes that belong to stages (everything but placeholders and the output)."""
        return [n for n in self.node_names if self.dag.nodes[n]["op"] in COMPUTE_OPS]

    def info(self, name: str) -> NodeInfo:
        return NodeInfo(**{k: v for k, v in self.dag.nodes[name].items() if k in NodeInfo.__dataclass_fields__})

    def fx_node(self, name: str) -> torch.fx.Node:
        return self._nodes_by_name[name]

    def __post_init__(self) -> None:
        self._nodes_by_name = {n.name: n for n in self.gm.graph.nodes}
        self._topo_index = {n: i for i, n in enumerate(self.node_names)}

    def topo_index(self, name: str) -> int:
        return self._topo_index[name]

    def leaf_modules(self) -> list[LeafModule]:
        """The modules the graph calls as single nodes (what `trace(..., open_modules=[path])` can open), in graph order.

        Export graphs have none: torch.export traces inside every module.
        """
        out = []
        for name in self.node_names:
            d = self.dag.nodes[name]
            if d["op"] == "call_module":
                path = str(self.fx_node(name).target)
                out.append(LeafModule(path, type(self.gm.get_submodule(path)).__name__, name,
                                      bool(d.get("batchable", True)), str(d.get("reason", ""))))
        return out


# --- tracing -------------------------------------------------------------------

# fx's error for int(t) / float(t) / bool(t) of a traced tensor
_NUMBER_OF_TENSOR = re.compile(r"TypeError: (int|float|complex)\(\) argument must be .* not 'Proxy'")


def fx_or_export(model: nn.Module, example_inputs: tuple, opened: Sequence[str] = (),
                 before: StateSnapshot | None = None) -> tuple[torch.fx.GraphModule, str, str]:
    """Trace with torch.fx, falling back to torch.export. Returns (gm, tracer, note).

    The graph takes exactly the inputs `example_inputs` gives: forward() parameters
    after them keep their defaults (see `_fx_trace`). `opened`: module paths fx traces
    inside (planner.opening); export traces inside every module anyway.
    """
    nones = [i for i, x in enumerate(example_inputs) if x is None]
    if nones:
        # fx makes every given input a graph value, so `if mask is not None:` would take the tensor branch for a None
        fx_error = f"example input(s) {nones} are None, which torch.fx traces as values (`is not None` holds)"
    else:
        before = before or StateSnapshot.take(model)  # the caller's, taken just before (no second copy of the state)
        try:
            gm = _fx_trace(model, len(example_inputs), opened)
            return gm, "fx", ""
        except Exception as e:  # fx raises many types for untraceable Python
            fx_error = f"{type(e).__name__}: {_first_line(e)}"
            # fx ran part of forward() on the real module before it gave up: an in-place update done, a buffer
            # replaced by a proxy (`self.mean += ...` under torch.no_grad()); export starts from the model as it was
            change = before.restore_if_changed(model)
            if change.carried and _attributes_carried(model, example_inputs, before):
                # torch.export puts such an attribute back and would bake its first value in
                raise TraceError(_changed_refusal(model, change)) from None
    try:
        gm = _export(model, example_inputs)
    except Exception as e:
        cache = _CACHE_OUTPUT.search(str(e))
        if cache:  # e.g. GPT-2's DynamicCache: a generation cache, not a result to batch
            raise TraceError(
                f"{type(model).__name__} returns a {cache.group(1).rpartition('.')[2]} (a key/value cache for generation) "
                "that neither tracer can carry; build the model with use_cache=False (config.use_cache = False)"
            ) from None
        returned = _DISTRIBUTION_OUTPUT.search(str(e))
        if returned:
            raise TraceError(
                f"{type(model).__name__}.forward() returns a {returned.group(1).rpartition('.')[2]} (a torch.distributions "
                "object), which neither tracer can carry out of a graph; return its parameters (logits, or loc and scale) "
                "and make the distribution from the batched outputs, outside the model") from None
        where = data_assignment(model, example_inputs) if LIFTED_CONSTANT in str(e) else None
        if where:  # `p.data = ...` (MoCo's momentum update): export's own text blames an op it cannot trace
            raise TraceError(data_assignment_refusal(model, where)) from None
        if _packs_sequences(model, example_inputs):
            raise TraceError(
                f"{type(model).__name__}.forward() packs sequences (pack_padded_sequence / pack_sequence): a "
                "PackedSequence's batch sizes come from the lengths' values, which neither torch.fx nor torch.export can "
                "follow. Run the RNN on the padded batch and mask the padding instead (e.g. gather each sequence's "
                "last valid step by its length), or keep the packing outside the model") from None
        number = _NUMBER_OF_TENSOR.search(fx_error)
        fix = (f"{number.group(1)}() of a tensor makes a Python number neither tracer can follow: write t.item() "
               "instead (stagewise runs what a value-dependent number shapes per member), or keep the tensor"
               if number else
               "Remove data-dependent Python control flow from forward() or wrap it with torch.fx.wrap / torch.cond")
        raise TraceError(
            f"{type(model).__name__} cannot be traced. torch.fx failed: {fx_error}. "
            f"torch.export failed: {type(e).__name__}: {_first_line(e)}. {fix}"
        ) from None
    if opened:
        return gm, "export", (f"torch.fx could not trace inside the opened modules {', '.join(opened)} ({fx_error}); "
                              "traced with torch.export, which opens every module")
    return gm, "export", f"torch.fx failed ({fx_error}); traced with torch.export"


def _cuda_devices(model: nn.Module) -> list[int]:
    """The CUDA device indices the model's state lives on (whose random generators a fork must keep)."""
    return sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()] if t.is_cuda})


def _input_copies(example_inputs: tuple) -> tuple:
    """The example inputs with each tensor a copy (forward() may write its inputs in place)."""
    return tuple(tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tuple(example_inputs)))


def _buffers_reassigned(model: nn.Module, example_inputs: tuple, snapshot: StateSnapshot) -> list[str]:
    """Names of the buffers one eager call of forward() replaces by other tensors (`self.count = tot`, not written in
    place); the model is put back as `snapshot` holds it, the random streams are the caller's."""
    copies = _input_copies(example_inputs)
    out = []
    with torch.random.fork_rng(devices=_cuda_devices(model)), torch.no_grad():
        try:
            model(*copies)
            out = [name for name, mod, table, k, t in snapshot.slots if table == "_buffers" and mod._buffers.get(k) is not t]
        except Exception:  # noqa: BLE001 - forward() fails on its own: the caller's message stands
            return []
        finally:
            snapshot.restore_if_changed(model)
            restore_all(snapshot, model)
    return out


def _state_written_in_functions(gm: torch.fx.GraphModule, values: dict) -> tuple[str, str] | None:
    """(the Function, the state) for the first autograd.Function a graph applies to a state tensor (a buffer or
    parameter, or a view of one) that its forward writes in place (`buf.copy_(...)` inside Function.forward, which no
    node shows): seen by its version counter on a copy of the example values. None where none does."""
    from stagewise.planner.trace_watch import _function_of  # (the Function a graph node names)
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "__qualname__", "") != "apply_autograd_function":
            continue
        state = {k: str(alias_chain(a)[-1].target) for k, a in enumerate(node.args[1:])
                 if isinstance(a, torch.fx.Node) and alias_chain(a)[-1].op == "get_attr"}
        if not state:
            continue
        args = [values.get(a.name) if isinstance(a, torch.fx.Node) else a for a in node.args[1:]]
        copies = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in args]
        versions = {k: copies[k]._version for k in state if isinstance(copies[k], torch.Tensor)}
        try:
            with torch.no_grad():
                _function_of(node.args[0]).apply(*copies)
        except Exception:  # noqa: BLE001 - it fails on copies (a check of its own): nothing said here
            continue
        for k, version in versions.items():
            if copies[k]._version != version:
                return node.args[0].split("#")[0], state[k]
    return None


def _numbers_counted(model: nn.Module, gm: torch.fx.GraphModule, example_inputs: tuple,
                     snapshot: StateSnapshot) -> list[tuple[str, Any, Any]]:
    """(name, value after a first call, after a second) for each Python value of the model (plain_attributes: a
    number, a string, a list of them, a config dict's entry) that two eager calls of forward() on the example inputs
    leave apart, where forward()'s outputs then differ from the graph's: a counter the computation reads,
    `self.frames += x.size(0)` annealing a temperature, which a trace bakes at its value then (fx puts a Proxy
    computed from a size back, torch.export restores the attribute itself) where each member of the loop counts on.
    A value set from the inputs alone (`self.last_batch = x.shape[0]`) is the same after both, and a count nothing
    reads (a log of calls) leaves the outputs alone. The model is put back as `snapshot` holds it; the random
    streams are the caller's."""
    copies = lambda: _input_copies(example_inputs)  # noqa: E731
    if not plain_attributes(model):
        return []

    def tensors_back() -> None:  # the state as it was, the Python values as the calls left them
        live = dict([*model.named_parameters(), *model.named_buffers()])
        for k, t in snapshot.tensors.items():
            if k in live and live[k].shape == t.shape:
                live[k].copy_(t)

    with torch.random.fork_rng(devices=_cuda_devices(model)), torch.no_grad():
        try:
            model(*copies())
            first = copy_plain(plain_attributes(model))
            model(*copies())
            second = copy_plain(plain_attributes(model))
            same = lambda a, b: a == b or (a != a and b != b)  # noqa: E731 - (NaN is NaN's)
            counted = [(k, first.get(k), second.get(k)) for k in sorted(first.keys() | second.keys())
                       if not same(first.get(k), second.get(k))]
            if not counted:
                return []
            tensors_back()
            torch.manual_seed(0)
            now = model(*copies())
            tensors_back()
            torch.manual_seed(0)
            traced = gm(*copies())
            return [] if _same_output(now, traced) else counted
        except Exception:  # noqa: BLE001 - forward() or the graph fails on its own: the trace's checks report that
            return []
        finally:
            snapshot.restore_if_changed(model)
            restore_all(snapshot, model)


def _counted_refusal(model: nn.Module, counted: list[tuple[str, Any, Any]]) -> str:
    shown = "; ".join(f"{k}: {a!r}, then {b!r}" for k, a, b in counted[:3]) + ("; ..." if len(counted) > 3 else "")
    return (f"{type(model).__name__}.forward() changes Python value(s) of the model on every call ({shown} after two "
            "calls on the example inputs): a counter such as `self.frames += x.size(0)`. The traced graph holds the "
            "value it had when traced, where each member of the loop counts on. Keep the count in a buffer updated in "
            "place (`self.register_buffer('frames', torch.zeros((), dtype=torch.long))`, then `self.frames += "
            "x.size(0)`: recorded per member), or keep it outside the model")


def _fx_disagrees(model: nn.Module, gm: torch.fx.GraphModule, example_inputs: tuple, snapshot: StateSnapshot) -> str | None:
    """Why torch.fx's graph of `model` is not its forward() on the example inputs, or None when they agree: fx takes
    Python branches on proxies one way whatever the value (`isinstance(mask, torch.Tensor)` is false for a proxy,
    `if isinstance(out, tuple):` after an RNN), so the graph can drop what forward() does, or fail where it runs.
    Both run in the caller's grad mode (the trace's: a forward() reading torch.is_grad_enabled() takes the traced
    side) from one random state, which is the caller's again afterwards; the model is put back as `snapshot` (taken
    before the trace) holds it. Where forward() itself fails on the inputs, or outputs cannot be compared (a sparse
    tensor), None: the trace reports what it finds."""
    copies = lambda: _input_copies(example_inputs)  # noqa: E731
    devices = _cuda_devices(model)
    with torch.random.fork_rng(devices=devices):
        states = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices])

        def same_draws() -> None:  # both runs draw what the first would (dropout in training mode)
            torch.set_rng_state(states[0])
            for d, state in zip(devices, states[1]):
                torch.cuda.set_rng_state(state, d)

        weigh = not gm.meta.get("stagewise_lost_backwards")  # (a custom backward fx traced through is named elsewhere)
        try:
            same_draws()
            want_inputs = copies()
            want = model(*want_inputs)
            want_state = _state_written(model, snapshot)
            want_grads = _parameter_grads(model, want) if weigh else None  # before the state is put back under it
        except Exception:
            return None
        finally:
            restore_all(snapshot, model)
        try:
            same_draws()
            got_inputs = copies()
            got = gm(*got_inputs)
            got_state = _state_written(model, snapshot)  # gm holds the model's own submodules and tensors
            got_grads = _parameter_grads(gm, got) if want_grads else None
        except Exception as e:
            return f"its graph fails on the example inputs where forward() runs ({type(e).__name__}: {_first_line(e)[:200]})"
        finally:
            restore_all(snapshot, model)
    for name in sorted(want_state.keys() | got_state.keys()):  # a running statistic, a counter, a cache written in place
        try:
            same = _same_output(got_state.get(name, snapshot.tensors.get(name)), want_state.get(name, snapshot.tensors.get(name)))
        except Exception:
            continue
        if not same:
            return (f"its graph leaves other values in {name!r} than forward() does on the example inputs "
                    "(an input changed before a layer that updates state, such as a BatchNorm's running statistics)")
    for i, (a, b) in enumerate(zip(tree_flatten(got_inputs)[0], tree_flatten(want_inputs)[0])):
        if isinstance(b, torch.Tensor) and (a._version != 0 or b._version != 0):  # written in place by one of them
            try:
                same = _same_output(a, b)
            except Exception:
                continue
            if not same:
                return f"its graph writes other values into input leaf {i} than forward() does on the example inputs"
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    if len(got_leaves) != len(want_leaves) or [type(v) for v in got_leaves] != [type(v) for v in want_leaves]:
        return f"its graph returns other outputs than forward() on the example inputs ({got_spec} where forward() gives {want_spec})"
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves)):
        try:
            same = _same_output(a, b)
        except Exception:  # a layout or type torch cannot compare (sparse): nothing to say
            continue
        if not same:
            return f"its graph computes other values than forward() on the example inputs (output leaf {i})"
    if want_grads and got_grads is not None:
        differ = _grads_differ(got_grads, want_grads, _lowest_precision(gm, model))
        if differ is not None:
            return differ
    return _input_grads_disagree(model, gm, example_inputs, snapshot) if weigh else None


GRADS_DIFFER = "its graph gives other parameter gradients"  # the start of _fx_disagrees' answer for gradients
INPUT_GRADS_DIFFER = "its graph gives other input gradients"  # (with its floating inputs requiring grad)
_WITH_INPUT_GRADS = " with its floating inputs requiring grad"
_GRAD_RTOL = 1e-3  # eager and graph run the same ops (export: decomposed), a few ulps apart; a hook changes far more
_autograd_grad = torch.autograd.grad  # torch's own: the trace watches calls of torch.autograd.grad made from forward()


def _grads_disagreement(disagreement: str | None) -> bool:
    """Whether `disagreement` (an _fx_disagrees answer) is about gradients alone (the outputs agree)."""
    return disagreement is not None and disagreement.startswith((GRADS_DIFFER, INPUT_GRADS_DIFFER))


def _input_names(gm: torch.fx.GraphModule, example_inputs: tuple) -> list[str]:
    """A name for each leaf of `example_inputs` (tree_flatten's order): its graph input's name (the plan's), with the
    key inside a dict, list or tuple input (`batch['x']`)."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    names = []
    for path, _ in tree_flatten_with_path(tuple(example_inputs))[0]:
        i = path[0].idx
        arg = placeholders[i] if len(placeholders) == len(example_inputs) else f"input {i}"
        names.append(arg + keystr(path[1:]))
    return names


def _input_grads_disagree(model: nn.Module, gm: torch.fx.GraphModule, example_inputs: tuple,
                          snapshot: StateSnapshot) -> str | None:
    """Why `gm`'s gradients differ from forward()'s when the floating example inputs require grad, or None.

    A training step that needs x.grad (an adversarial step, a gradient penalty) calls the batched module with x
    requiring grad, whatever the example was traced with; forward() may then set a hook on an autograd node that only
    such a call sets (`if xs.requires_grad: xs.grad_fn.register_hook(...)`, damping the input's gradient), which no
    graph records and a parameter's gradient need not show. So both run once more, in the caller's grad mode, on
    copies whose floating tensors are fresh leaves requiring grad (passed as a non-leaf copy of each: forward() may
    write its input in place, x.add_(1), which a leaf requiring grad refuses; integer inputs as given), from one
    random state (dropout draws alike), and the parameters' and the inputs' gradients of one fixed weighting of the
    outputs are compared (the same bound as the parameters'). Outputs that differ on this run (forward() branching
    on x.requires_grad to compute something else), or a run that fails, say nothing here: the values are compared on
    the inputs as given, and a gradient is only compared where the outputs agree. The model is put back as
    `snapshot` holds it; the random streams are the caller's."""
    flat, spec = tree_flatten(tuple(example_inputs))
    floating = [k for k, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not floating or not torch.is_grad_enabled():
        return None
    names = _input_names(gm, example_inputs)
    devices = _cuda_devices(model)

    def run(fn: Any) -> tuple[Any, tuple | None]:
        leaves = {names[k]: flat[k].detach().clone().requires_grad_(True) for k in floating}
        given = [leaves[names[k]].clone() if k in floating else (x.clone() if isinstance(x, torch.Tensor) else x)
                 for k, x in enumerate(flat)]
        try:
            out = fn(*tree_unflatten(given, spec))
            return out, _backward(fn, out, leaves)
        finally:
            restore_all(snapshot, model)

    with torch.random.fork_rng(devices=devices):
        states = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices])

        def same_draws() -> None:
            torch.set_rng_state(states[0])
            for d, state in zip(devices, states[1]):
                torch.cuda.set_rng_state(state, d)

        try:
            same_draws()
            want, want_grads = run(model)
            if want_grads is None:
                return None
            same_draws()
            got, got_grads = run(gm)
        except Exception:  # noqa: BLE001 - a failure with gradients on inputs is named where it happens
            return None
    got_leaves, want_leaves = tree_flatten(got)[0], tree_flatten(want)[0]
    if len(got_leaves) != len(want_leaves):
        return None
    for a, b in zip(got_leaves, want_leaves):
        try:
            if not _same_output(a, b):
                return None
        except Exception:  # noqa: BLE001 - a layout torch cannot compare
            continue
    if got_grads is None:
        return None
    low = _lowest_precision(gm, model)
    differ = _grads_differ(got_grads[0], want_grads[0], low)
    if differ is not None:
        at = " than forward() on the example inputs"
        return differ.replace(at, at + _WITH_INPUT_GRADS)
    return _grads_differ(got_grads[1], want_grads[1], low, INPUT_GRADS_DIFFER, missing_is_zero=True)


def _grads_refusal(disagreement: str, model: nn.Module | None = None) -> str:
    """The refusal for a traced graph whose parameter or input gradients are not forward()'s (`disagreement`)."""
    weights = [f"{path}.{name}" if path else name for path, _, name in hook_computed_weights(model)] if model else []
    hooked = [w for w in weights if any(f"{w}{end}" in disagreement for end in ("_orig", "_g", "_v"))]
    if hooked:
        return (f"The traced graph's outputs are forward()'s, but {disagreement.removeprefix('its graph gives ')}. "
                f"The model uses torch's hook-based spectral_norm / weight_norm ({', '.join(hooked[:3])}): that weight "
                "is a plain attribute the hook recomputes each time its module runs, so read anywhere else (a tied "
                "weight: F.linear(h, self.enc.weight.t())) it holds what the last call left, without gradients when "
                "that call ran under torch.no_grad(). Use torch.nn.utils.parametrizations.spectral_norm / weight_norm "
                "(the weight is computed where it is read), or read the weight only inside its module")
    if disagreement.startswith(INPUT_GRADS_DIFFER):
        return (f"The traced graph's outputs are forward()'s, but {disagreement.removeprefix('its graph gives ')}: "
                "called with an input requiring grad (a training step that reads x.grad: an adversarial step, a "
                "gradient penalty), forward() changes that input's gradient in a way no graph records, so the batched "
                "module would give x.grad other than each member's own backward, with no error. The usual cause: a "
                "hook on an autograd node, often set only where the input records gradients (`if xs.requires_grad: "
                "xs.grad_fn.register_hook(...)` scaling grad_input). Fix: write the gradient change as an "
                "autograd.Function (stagewise keeps its backward: forward(ctx, x, s) returns x.view_as(x), "
                "backward(ctx, g) returns s * g, None), or drop the hook. Inference does not run it: to batch a model "
                "for inference alone, trace it under torch.no_grad()")
    return (f"The traced graph's outputs are forward()'s, but {disagreement.removeprefix('its graph gives ')}: forward() "
            "changes its gradients in a way no graph records, so the batched module would train with other gradients "
            "than each member's own backward. The usual causes: a hook on an autograd node (h.grad_fn.register_hook / "
            "register_prehook: a gradient reversal or scale), saved-tensor hooks whose pack/unpack change values "
            "(torch.autograd.graph.saved_tensors_hooks rounding or compressing what backward reads), or a backward "
            "that depends on state forward() does not show. Fix: write the gradient change as an autograd.Function "
            "(stagewise keeps its backward: forward(ctx, x, lam) returns x.view_as(x), backward(ctx, g) returns "
            "-lam * g, None), or drop the hooks. Inference does not run them: to batch a model for inference alone, "
            "trace it under torch.no_grad()")


def gradients_refusal(model: nn.Module, gm: torch.fx.GraphModule, example_inputs: tuple) -> str | None:
    """For a plan traced without gradients (built for inference, then trained): why a call with gradients on is
    refused, where `model`'s own backward (member 0, with gradients on) is not `gm`'s, or None. The model is put
    back as it was; the random streams are the caller's."""
    snapshot = StateSnapshot.take(model)
    try:
        with torch.enable_grad():
            disagreement = _fx_disagrees(model, gm, example_inputs, snapshot)
            # a hook gives the same difference each time; stand-in inputs a kernel reads as invalid (zero offsets of an
            # EmbeddingBag with include_last_offset) give uninitialised memory, another each time: no verdict then
            if _grads_disagreement(disagreement) and _fx_disagrees(model, gm, example_inputs, snapshot) != disagreement:
                return None
            # (or the same garbage twice: a difference of more than a million times the gradient's norm is memory no
            # hook wrote)
            off = re.search(r"(\S+) of its norm off", disagreement or "")
            if off is not None and not float(off.group(1)) < 1e6:
                return None
    finally:
        restore_all(snapshot, model)
    if not _grads_disagreement(disagreement):
        return None
    return (_grads_refusal(disagreement).replace("trace it under torch.no_grad()", "call it under torch.no_grad()")
            + " (this plan was traced without gradients, which set no such hook)")


def _parameter_grads(module: nn.Module, out: Any) -> dict[str, torch.Tensor] | None:
    """The gradients of `module`'s parameters that require grad, by name, of one fixed random weighting of its
    floating outputs `out` (every output reaches the loss: a hook on any path shows); None where nothing records a
    gradient (traced under torch.no_grad(), no parameter) or the backward fails (its trouble is named elsewhere)."""
    grads = _backward(module, out, {})
    return grads[0] if grads is not None and grads[0] else None


def _backward(module: nn.Module, out: Any, inputs: dict[str, torch.Tensor]) -> tuple[dict, dict] | None:
    """(the parameters' gradients by name, the gradients of the leaves `inputs` by name) of one fixed random
    weighting of `module`'s floating outputs `out`, a gradient torch leaves None left out; None where no output records
    a gradient, nothing asks for one, or the backward fails."""
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    params = [(k, p) for k, p in module.named_parameters() if p.requires_grad]
    targets = params + list(inputs.items())
    if not leaves or not targets:
        return None
    g = torch.Generator().manual_seed(0)  # the same weights for forward() and for the graph, whatever the random state
    loss = sum((t * torch.randn(t.shape, generator=g).to(t.device, t.dtype)).sum() for t in leaves)
    try:
        grads = _autograd_grad(loss, [p for _, p in targets], allow_unused=True)
    except Exception:  # noqa: BLE001 - a backward that fails (double backward, an op without a derivative)
        return None
    # (a sparse gradient, nn.Embedding(sparse=True)'s, compared as the dense tensor it stands for)
    found = {k: (gr.to_dense() if gr.layout != torch.strided else gr).detach().clone()
             for (k, _), gr in zip(targets, grads) if gr is not None}
    return {k: found[k] for k, _ in params if k in found}, {k: found[k] for k in inputs if k in found}


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _lowest_precision(gm: torch.fx.GraphModule, model: nn.Module) -> torch.dtype | None:
    """bfloat16 or float16 where `model`'s state, or a cast or autocast region in its graph `gm`, computes in it
    (the coarser of the two where both), else None."""
    found = {t.dtype for t in [*model.parameters(), *model.buffers()] if t.dtype in _LOW_PRECISION}
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in ("half", "bfloat16"):
            found.add(torch.float16 if node.target == "half" else torch.bfloat16)
        found.update(v for v in tree_flatten((node.args, node.kwargs))[0] if isinstance(v, torch.dtype) and v in _LOW_PRECISION)
        if "autocast" in str(node.target):
            found.add(torch.bfloat16)  # its dtype may be implicit (CPU autocast: bfloat16)
    return torch.bfloat16 if torch.bfloat16 in found else next(iter(found), None)


def _grads_differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  low: torch.dtype | None = None, differ: str = GRADS_DIFFER, missing_is_zero: bool = False) -> str | None:
    """Why the graph's parameter gradients `got` are not forward()'s `want` (a parameter both reach off by more than
    rounding: _GRAD_RTOL of its norm, 8 eps of `low` where a low precision computes on the way, and a floor for one
    whose gradient is ~0), or None when they agree. `differ` starts the answer; `missing_is_zero`: a gradient one side
    gives and the other leaves None is compared with zeros (inputs: a hook returning None for one, a float mask only
    compared, which neither reaches)."""
    if missing_is_zero:
        got = {**{k: torch.zeros_like(v) for k, v in want.items()}, **got}
        want = {**{k: torch.zeros_like(v) for k, v in got.items()}, **want}
    names = [k for k in want if k in got]
    if not names:
        return None
    scale = max(float(want[k].abs().max()) if want[k].numel() else 0.0 for k in names)
    for k in names:
        # bfloat16 / float16 on the way (members, or a cast in forward()): a re-ordered or decomposed op rounds at
        # that precision (a few eps of the norm)
        rtol = max(_GRAD_RTOL, 8 * torch.finfo(low).eps) if low is not None else _GRAD_RTOL
        a, b = (got[k].to(torch.complex128), want[k].to(torch.complex128)) if want[k].is_complex() else \
            (got[k].double(), want[k].double())
        if a.shape != b.shape or not torch.isfinite(b).all():
            continue
        off = float((a - b).norm())
        if off > rtol * float(b.norm()) + 1e-6 * scale * b.numel() ** 0.5:
            rel = off / max(float(b.norm()), 1e-30)
            of_input = differ == INPUT_GRADS_DIFFER
            return (f"{differ} than forward() on the example inputs{_WITH_INPUT_GRADS if of_input else ''} "
                    f"({'input ' if of_input else ''}{k}: {rel:.3g} of its norm off)")
    return None


def _attributes_carried(model: nn.Module, example_inputs: tuple, snapshot: StateSnapshot) -> list[str]:
    """Plain attributes (not buffers) that carry state from one call of forward() to the next: set to a tensor in a
    call (`self.h = cell(x, self.h)`, a recurrent state) and read by the next, so that a second call answers otherwise
    after a first call on other values. An attribute only stored (an attention map kept to look at) or a cache sized
    by the inputs (a rotary table) does not. The model is put back as `snapshot` holds it; the random streams are the
    caller's."""
    def tensors_in(v: Any) -> bool:  # (a deque: a frame stack `self.frames.append(obs)`)
        if isinstance(v, collections.deque):
            v = list(v)
        return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list, dict)) and any(
            isinstance(t, torch.Tensor) for t in tree_flatten(v)[0]))

    def held() -> dict[tuple[int, str], Any]:  # (an LSTM's (h, c) as a tuple too)
        return {(id(m), k): v for m in model.modules() for k, v in vars(m).items()
                if k not in ("_parameters", "_buffers", "_modules") and (v is None or tensors_in(v))}

    def leaves(v: Any) -> list[int] | None:  # what a dict or list attribute holds (`self.mem["h"] = h`: the same dict)
        if isinstance(v, collections.deque):
            v = list(v)
        return [id(t) for t in tree_flatten(v)[0]] if isinstance(v, (tuple, list, dict)) else None

    def copies(inputs: tuple) -> tuple:
        return tuple(tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tuple(inputs)))

    def otherwise(x: Any) -> Any:  # other values of the same shapes: floats moved, integers (token ids) reordered
        if not isinstance(x, torch.Tensor) or x.numel() < 2:
            return x
        if x.is_floating_point():
            return x + torch.randn_like(x) * (x.abs().mean() + 1)
        return x.flatten().roll(1).view_as(x)

    def state() -> dict[str, torch.Tensor]:
        return {k: t for k, t in [*model.named_parameters(), *model.named_buffers()]}

    other = tree_map(otherwise, tuple(example_inputs))
    names = {(id(m), k): f"{type(m).__name__}.{k}" for m in model.modules() for k in vars(m)}
    with torch.random.fork_rng(devices=_cuda_devices(model)), torch.no_grad():
        try:
            start = {key: (v, leaves(v)) for key, v in held().items()}
            torch.manual_seed(0)
            model(*copies(example_inputs))
            replaced = [key for key, v in held().items() if tensors_in(v)
                        and (v is not start.get(key, (_NOT_HELD,))[0] or leaves(v) != start[key][1])]
            if not replaced:
                return []
            outs, after_first = [], {}
            for first in (example_inputs, other):  # a first call on these values, then one on the example inputs
                restore_all(snapshot, model)
                torch.manual_seed(0)
                model(*copies(first))
                if not after_first:
                    after_first = {k: t.detach().clone() for k, t in state().items()}
                else:  # the buffers as the first sequence left them (a running mean, a codebook): only the plain
                    for k, t in state().items():  # attributes may tell the two second calls apart
                        if k in after_first and t.shape == after_first[k].shape:
                            t.copy_(after_first[k])
                torch.manual_seed(1)
                outs.append(model(*copies(example_inputs)))
        except Exception:  # noqa: BLE001 - the trace reports what forward() does on its inputs
            return []
        finally:
            restore_all(snapshot, model)
    try:
        same = _same_output(outs[1], outs[0])
    except Exception:  # noqa: BLE001 - outputs torch cannot compare: nothing to say
        return []
    return [] if same else sorted(names.get(key, str(key)) for key in replaced)


_NOT_HELD = object()


def _attributes_stored(model: nn.Module, example_inputs: tuple, snapshot: StateSnapshot) -> dict[str, list[str]]:
    """Plain attributes (not buffers) that forward() sets to a tensor it computes on every call (a VAE encoder's
    `self.kl`, a Bayesian layer's `self.log_prior`, an attention map kept to look at), as {"Class.attr": [module
    paths]}: a traced graph computes such a value and drops it, so the batched module sets it nowhere. Seen as
    replaced by a first call and again by a second (a cache filled once, a rotary table, is not set again); the
    `weight` the old weight_norm's pre-hook recomputes is left out. Run eagerly under torch.no_grad(); the model is put
    back as `snapshot` holds it, and the random streams are the caller's."""
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}

    def held() -> dict[tuple[int, str], tuple[torch.Tensor, ...]]:
        # the tensors each attribute holds, looked into: a dict or a namespace filled in place (`self.losses["kl"] =`,
        # `self.aux.kl =`) is the same object after the call, its tensors are not
        out = {}
        for m in model.modules():
            recomputed = {getattr(h, "name", None) for h in m._forward_pre_hooks.values()}
            out.update({(id(m), k): _tensors_held(v) for k, v in vars(m).items()
                        if k not in ("_parameters", "_buffers", "_modules") and k not in recomputed})
        return out

    def renewed(now: tuple, before: tuple | None) -> bool:
        return bool(now) and (before is None or len(now) != len(before) or any(a is not b for a, b in zip(now, before)))

    def call() -> None:
        model(*_input_copies(example_inputs))

    classes = {id(m): type(m).__name__ for m in model.modules()}
    with torch.random.fork_rng(devices=_cuda_devices(model)), torch.no_grad():
        try:
            start = held()
            call()
            first = held()
            replaced = [key for key, v in first.items() if renewed(v, start.get(key))]
            if not replaced:
                return {}
            call()
            again = held()
            stored = [key for key in replaced if renewed(again.get(key, ()), first[key])]
            carried = _reads_its_own(model, stored, example_inputs, snapshot) if stored else []
        except Exception:  # noqa: BLE001 - the trace reports what forward() does on its inputs
            return {}
        finally:
            restore_all(snapshot, model)
    if carried:
        names = ", ".join(f"model.{paths.get(m_id) + '.' if paths.get(m_id) else ''}{k}" for m_id, k in carried[:3])
        raise TraceError(
            f"forward() replaces the plain attribute {names} with a tensor computed from its own previous value on "
            "every call (a call counter `self.calls = self.calls + 1`, a temperature annealed in forward()): state "
            "carried from call to call, which the traced graph reads as the value it had at trace time, so from the "
            "second call on every member would compute with that old value. Register it as a buffer and update it in "
            "place (self.register_buffer('calls', torch.zeros(())); self.calls.add_(1)), or pass it as an input")
    out: dict[str, list[str]] = {}
    for m_id, k in stored:
        path = paths.get(m_id, "")
        out.setdefault(f"{classes.get(m_id, '?')}.{k}", []).append(f"{path}.{k}" if path else k)
    return out


def _reads_its_own(model: nn.Module, stored: list[tuple[int, str]], example_inputs: tuple,
                   snapshot: StateSnapshot) -> list[tuple[int, str]]:
    """Which of the attributes `stored` (forward() replaces them with a tensor on every call) forward() computes from
    their own previous value: from the model as `snapshot` holds it, one call gives each attribute a value; from the
    same model, with the attributes alone set to those values, on the same inputs and random draws, a call that gives
    another value read them (`self.calls + 1`). A value computed from the inputs (a VAE's `self.kl`) comes out the same."""
    modules = {id(m): m for m in model.modules()}
    state = torch.random.get_rng_state()

    def run() -> dict[tuple[int, str], Any]:
        torch.random.set_rng_state(state)
        model(*_input_copies(example_inputs))
        return {key: modules[key[0]].__dict__.get(key[1], _NOT_HELD) for key in stored}

    restore_all(snapshot, model)
    once = run()
    restore_all(snapshot, model)
    for (m_id, k), v in once.items():
        if v is not _NOT_HELD:
            modules[m_id].__dict__[k] = v
    twice = run()
    out = []
    for key in stored:
        a, b = _tensors_held(once[key]), _tensors_held(twice[key])
        if len(a) != len(b) or any(x.shape != y.shape or not torch.equal(x, y) for x, y in zip(a, b)):
            out.append(key)
    return out


def _new_leaves_returned(model: nn.Module, example_inputs: tuple, snapshot: StateSnapshot) -> list[int]:
    """The output leaves (pytree order) that are autograd leaves forward() made itself (SIREN's
    `coords = coords.clone().detach().requires_grad_(True)`, returned so that the caller differentiates the output
    with respect to it): a tensor recording gradients with no grad_fn that is none of the model's parameters or
    inputs. Run eagerly with gradients on when the caller has them on (else []); the model is put back as `snapshot`
    holds it, and the random streams are the caller's."""
    if not torch.is_grad_enabled():
        return []
    inputs = _input_copies(example_inputs)
    held = [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]  # (plain attributes)
    own = {id(t) for t in [*model.parameters(), *model.buffers(), *held, *tree_flatten(inputs)[0]] if isinstance(t, torch.Tensor)}
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        try:
            out = model(*inputs)
        except Exception:  # noqa: BLE001 - the trace reports what forward() does on its inputs
            return []
        finally:
            restore_all(snapshot, model)
    return [i for i, t in enumerate(tree_flatten(out)[0]) if isinstance(t, torch.Tensor) and t.requires_grad
            and t.grad_fn is None and id(t) not in own]


def _tensors_held(v: Any, depth: int = 0) -> tuple[torch.Tensor, ...]:
    """The tensors attribute value `v` holds: itself, or inside tuples, lists, dicts, a types.SimpleNamespace or a
    dataclass instance (a few levels deep; modules are not looked into: their own attributes are listed apart)."""
    if isinstance(v, torch.Tensor):
        return (v,)
    if depth > 3 or isinstance(v, nn.Module):
        return ()
    if isinstance(v, (tuple, list)):
        items = v
    elif isinstance(v, dict):
        items = list(v.values())
    elif isinstance(v, types.SimpleNamespace) or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
        items = list(vars(v).values())
    else:
        return ()
    return tuple(t for item in items for t in _tensors_held(item, depth + 1))


def _warn_stored(model: nn.Module, stored: dict[str, list[str]]) -> None:
    """One UserWarning per attribute _attributes_stored found (per class and name: one for every layer's)."""
    for name, where in sorted(stored.items()):
        shown = ", ".join(f"model.{p}" for p in where[:3]) + (", ..." if len(where) > 3 else "")
        warnings.warn(
            f"forward() stores a tensor it computes as the plain attribute {name} ({shown}) on every call: the traced "
            "graph computes it and drops it, so the batched module sets it neither on itself nor on the members, and "
            "code reading it after a call (a VAE's KL term, a Bayesian layer's log prior in the loss) reads a stale "
            f"value. Return it from forward() instead (out, {name.rpartition('.')[2]} = model(x)); an activation kept "
            "only to look at can be ignored", UserWarning, stacklevel=3)


def _state_written(model: nn.Module, snapshot: StateSnapshot) -> dict[str, torch.Tensor]:
    """Copies of the model's parameters and buffers that a run changed since `snapshot` (written in place, replaced;
    by value too: a BatchNorm's kernel writes its running statistics without a version bump)."""
    live = dict([*model.named_parameters(), *model.named_buffers()])
    with torch.no_grad():
        return {k: t.detach().clone() for k, t in live.items()
                if k not in snapshot.tensors or t._version != snapshot.versions[k] or not _same_tensor(t, snapshot.tensors[k])}


def _same_output(a: Any, b: Any) -> bool:
    """`a` (the graph's) as `b` (forward()'s): tensors up to rounding, dataclasses and containers field by field."""
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and (torch.equal(a, b) or _close(a, b))
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(b):
        return all(_same_output(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(b))
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_output(x, y) for x, y in zip(a, b))
    if isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_output(a[k], b[k]) for k in b)
    try:
        return bool(a == b) or (a != a and b != b)  # NaN numbers alike
    except Exception:  # an object without a plain ==
        return a is b


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Floating `a` as `b` up to rounding: NaN and inf where `b` has them, the rest within 1e-5 of b's scale."""
    if not (b.is_floating_point() or b.is_complex()):
        return False
    a, b = a.detach(), b.detach()
    if not torch.equal(a.isnan(), b.isnan()) or not torch.equal(a.isinf(), b.isinf()):
        return False
    finite = b.isfinite()
    if not torch.equal(a[b.isinf()], b[b.isinf()]):
        return False
    if not finite.any():
        return True
    # (complex: both parts; .double() of a complex tensor keeps the real part alone)
    x, y = (a[finite].to(torch.complex128), b[finite].to(torch.complex128)) if b.is_complex() else \
        (a[finite].double(), b[finite].double())
    return bool((x - y).abs().max() <= 1e-5 * y.abs().max() + 1e-12)


class _PackingSeen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("_pack_padded_sequence", "pack_sequence", "pack_padded_sequence"):
            self.seen = True
        return func(*args, **(kwargs or {}))


def _packs_sequences(model: nn.Module, example_inputs: tuple) -> bool:
    """Whether forward() on the example inputs packs sequences (why neither tracer could follow it). The model's
    state and the random streams are as they were afterwards."""
    watch, before = _PackingSeen(), StateSnapshot.take(model)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), watch:
            model(*example_inputs)
    except Exception:  # only a diagnosis: a forward() that fails says nothing either way
        pass
    finally:
        before.restore_if_changed(model)
    return watch.seen


_DISTRIBUTION_OUTPUT = re.compile(r"Found <class '(torch\.distributions\.[\w.]+)'> in output")
_CACHE_OUTPUT = re.compile(r"Found <class '([\w.]*Cache)'> in output")


def _fx_trace(model: nn.Module, given: int | Sequence[str], opened: Sequence[str] = ()) -> torch.fx.GraphModule:
    """torch.fx's graph of `model` taking only the `given` inputs (a count of leading parameters, or names),
    with the `opened` module paths traced inside (planner.opening).

    Without this, a forward(x, mask=None, flag=False) called with x alone traces
    to a graph with three required placeholders. The other parameters that have
    defaults are traced as constants (fx `concrete_args`), so `if mask is not None`
    takes the branch the default takes, and their placeholders are removed.
    """
    fixed = _defaults_not_given(model, given)
    with _grad_mode_watch() as turned_off, _inference_mode_as_no_grad(), _RandomWatch() as random_drawn, \
            _input_writes_recorded() as writes, _autograd_functions_kept() as inlined_functions, _grad_state_proxied() as grad_state:

        real: frozenset[str] = frozenset()  # buffers kept real tensors where the others are graph values (below)

        def fx(proxy_buffers: bool = False) -> torch.fx.GraphModule:
            gm = symbolic_trace_opening(model, opened, fixed or None, proxy_buffers, () if proxy_buffers else real)
            observed = writes.observed(gm)
            if observed:  # `a = h[:, :2]; h += y; return a`: traced again with those writes recorded in place
                writes.in_place_sites |= observed
                gm = symbolic_trace_opening(model, opened, fixed or None, proxy_buffers, () if proxy_buffers else real)
            return gm

        versions = {id(b): b._version for b in model.buffers()}  # a write on a real buffer leaves no node: seen here
        first_values = {id(b): b.detach().clone() for b in model.buffers()}  # (what the first trace may write)
        with _tensor_values_read() as values_read:
            try:
                gm = fx()
            except Exception as plain_failed:  # noqa: BLE001 - fx raises many types for untraceable Python
                # `self.pe[:, :x.size(1)]` beside `int(self.act_id)`: neither all buffers real nor all graph values
                # trace; the ones read into Python are kept real, the rest made graph values (the "plain" trace below)
                seen = (list(turned_off), copy.copy(random_drawn.calls))
                real = buffers_read_in_python(model, opened, fixed or None) or frozenset()
                turned_off[:] = seen[0]
                random_drawn.calls = seen[1]
                if not real:
                    raise
                del values_read[:]
                try:
                    gm = fx()
                except Exception as e:  # noqa: BLE001 - named with what was tried
                    raise TraceError(
                        f"{type(plain_failed).__name__}: {_first_line(plain_failed)}; traced again with the buffers "
                        f"forward() reads into Python ({', '.join(sorted(real)[:3])}) real tensors and every other a "
                        f"graph value, {type(e).__name__}: {_first_line(e)} (a buffer both read into Python and sliced "
                        "or shaped by a traced size is neither; keep the read on tensors, torch.where, or make the "
                        "read from another buffer)") from None
                gm.meta[REAL_BUFFERS] = tuple(sorted(real))
        written_eagerly = any(b._version != versions.get(id(b)) for b in model.buffers())
        baked = bool(baked_constants(gm))
        # (the probes trace branches member 0 does not take, a data-dependent init's `with torch.no_grad():`: what
        # the watches see there is no part of member 0's graph)
        seen = (list(turned_off), copy.copy(random_drawn.calls))
        varies = not baked and _reads_buffer_values(gm, model, opened, fixed, real)
        turned_off[:] = seen[0]
        random_drawn.calls = seen[1]
        if baked or values_read or varies:
            # fx ran part of forward() on real buffers: a tensor it stored as a constant (`x @ self.B.t()`) or a
            # number it wrote into the graph (`x / self.temp.item()`) holds member 0's value for every member and
            # goes stale when the buffer changes. Traced again with buffers as graph values, such a computation is
            # recorded (`.item()` then keeps its stage out of vmap); what stays constant comes from no buffer
            # (plain tensor attributes: executor.constants compares them per member)
            try:
                gm = fx(proxy_buffers=True)
            except Exception as e:
                plain, clash, read = None, [], None
                if values_read:
                    seen = (list(turned_off), copy.copy(random_drawn.calls))
                    read = real or buffers_read_in_python(model, opened, fixed or None)
                    turned_off[:] = seen[0]
                    random_drawn.calls = seen[1]
                if read:
                    # traced again with only the buffers read into Python real tensors, every other a graph value: no
                    # other buffer's value baked in (`x @ self.B.t()`), no other buffer written at trace time (a
                    # running mean beside the flag). A read buffer written at trace time is one forward() writes
                    real = read
                    # what the first trace wrote is put back: a buffer now a graph value records its writes as nodes;
                    # one read into Python that forward() writes (`self.initialized.fill_(1)`) is refused below
                    undone = [(name, b) for name, b in model.named_buffers()
                              if b._version != versions.get(id(b)) and id(b) in first_values]
                    for _, b in undone:  # (not torch.no_grad(): the watches would count it as forward()'s)
                        b.detach().copy_(first_values[id(b)])
                    clash = sorted(name for name, _ in undone if name in read)
                    if not clash:
                        again = {id(b): b._version for b in model.buffers()}
                        plain = fx()
                        clash = sorted(name for name, b in model.named_buffers()
                                       if name in read and b._version != again.get(id(b)))
                        plain.meta[TRACE_WRITES_UNDONE] = tuple(name for name, _ in undone)
                elif values_read and not (varies and written_eagerly):
                    plain = fx()  # (what is read is not known: every buffer a real tensor, as the first trace)
                derived: list[str] = []
                if plain is not None and baked_constants(plain) and _baked_from_buffers(plain, model, opened, fixed, real):
                    # (`x * (self.act_id + 1)` beside the read: member 0's value baked in for every member)
                    derived, plain = baked_constants(plain), None
                if plain is not None and not clash:
                    clash = _read_buffers_written(plain, model, read)
                if plain is not None and not clash:
                    # a value read into Python that no other value tried changes the graph of: a NaN guard, a log
                    # line, or a branch only some values take (`if int(self.act_id) == 2:` with member 0's 0). Or one
                    # that other values change: members loaded from a checkpoint (Glow's ActNorm,
                    # `if self.initialized.item() == 0`, with every member initialised). Member 0's graph writes none
                    # of the buffers read, so its side of the branch stays taken from call to call. The plain graph
                    # stands; executor.build traces every member with its own buffers and refuses where one gives
                    # another graph (a graph read with gm.meta, so a plan needs no field for it), and the batched
                    # module traces again a member whose buffers change after build
                    gm = plain
                    gm.meta[BUFFER_VALUE_READS] = tuple(dict.fromkeys(values_read))
                    if read is not None:
                        gm.meta[READ_BUFFERS] = tuple(sorted(read))
                    if real:
                        gm.meta[REAL_BUFFERS] = tuple(sorted(real))
                elif clash:
                    raise TraceError(
                        f"forward() turns a buffer's values into Python ({', '.join(clash[:3])}: a branch or a number "
                        "made of them), and forward() itself writes "
                        f"{'them' if len(clash) > 1 else 'it'} (an in-place update, or a layer updating its statistics "
                        "in training: BatchNorm's num_batches_tracked): the graph keeps the side member 0's value takes "
                        "now, and the loop's members would take the other once their values cross (a warm-up "
                        "switch after k steps). Keep the choice on tensors (torch.where(...)), or count the steps "
                        "outside the model and pass the switch in as an input; for a flag guarding a data-dependent "
                        "init (Glow ActNorm's `if self.initialized.item() == 0`), run the init on each member before "
                        "planning (members all initialised trace and run as the loop)") from None
                elif derived and read:
                    raise TraceError(
                        f"forward() turns a buffer's values into Python ({', '.join(sorted(read)[:3])}: a branch or a "
                        "number made of them) and also computes a tensor from such a buffer alone (`self.act_id.float() "
                        "+ 1`), which torch.fx then runs once at trace time and keeps as member 0's for every member "
                        f"({', '.join(derived[:3])}). Keep the choice on tensors instead of the Python branch "
                        "(torch.where(self.act_id == 2, torch.tanh(h), torch.relu(h))): the buffer is then a graph value "
                        "and both computations are recorded per member") from None
                else:
                    raise TraceError(
                        f"forward() turns a buffer's values into Python (float(), int(), .tolist(), a branch on them: "
                        f"{type(e).__name__}: {_first_line(e)}), which a trace would keep as member 0's for every member; keep "
                        "the computation on tensors (x * self.scale, torch.where), write `self.t.item()` for float(self.t) "
                        "(recorded per member), or hold a per-member number as a plain attribute (stagewise gives each "
                        "member its own); for a flag guarding a data-dependent init (Glow ActNorm's "
                        "`if self.initialized.item() == 0`), run the init on each member before planning and take the "
                        "branch out of forward()") from None
    if random_drawn.calls:
        # `torch.rand(1) < p` (stochastic depth, layer drop) has no traced input: fx runs it once and bakes the
        # draw into the graph as a constant, so every call of every member would reuse it (export records the op)
        raise TraceError(f"forward() draws random numbers from no traced input ({', '.join(sorted(random_drawn.calls))}), "
                         "which torch.fx freezes into one constant draw")
    if turned_off:
        # `with torch.no_grad():` / `torch.set_grad_enabled(False)` in forward() ran at trace time and left
        # no node: the graph would record gradients the model never makes (torch.export records the region)
        raise TraceError("forward() turns gradients off (torch.no_grad() / set_grad_enabled(False) / torch.inference_mode()), "
                         "which torch.fx cannot record")
    # written in place, or through `out=` (`torch.add(c, v, out=c)`: out_as_copies below makes that a copy_)
    targets = [t for n in gm.graph.nodes for t in ([n.args[0]] if is_inplace(n) else [])
               + [o for o in tree_flatten(n.kwargs.get("out"))[0] if isinstance(o, torch.fx.Node)]]
    written = sorted({str(root.target) for t in targets for root in [alias_chain(t)[-1]]
                      if root.op == "get_attr" and str(root.target).startswith(BAKED_PREFIXES)})
    if written:
        # `torch.zeros(3, d).index_add_(...)`: fx made the fresh tensor once, so every member and call would write into it
        raise TraceError(f"forward() writes in place into a tensor it makes with fixed sizes ({', '.join(written)}), which "
                         "torch.fx keeps as one constant for every call")
    if grad_state:
        # `if h.grad_fn is not None:` holds for every proxy, so fx keeps one side whatever the tensor is (an input has
        # no grad_fn; under torch.no_grad() nothing has): torch.export evaluates the read on the traced values
        raise TraceError(f"forward() reads {' and '.join(sorted(grad_state))}, which torch.fx traces as a value (`is not None` "
                         "holds for it)")
    state_derived = _state_derived_constants(gm, model, opened, fixed)  # outside the watches: it swaps state and traces
    if state_derived:
        # reached without attribute access (`for p in self.parameters()`): torch.export records it
        raise TraceError(f"forward() computes {state_derived} from parameters or buffers it reaches without attribute "
                         "access (self.parameters(), self.buffers(), state_dict()), which torch.fx runs once at trace "
                         "time and keeps as a constant")
    if fixed:
        _drop_concrete_placeholders(gm, fixed)
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and str(n.target).startswith("**")]:
        # forward(x, **kwargs): positional example inputs pass no keywords, yet fx made the dict a graph input
        if node.users:  # read (`kwargs.get("scale", 1.0)`): torch.export traces it as the empty dict it is
            raise TraceError(f"forward() reads its {node.target} (torch.fx would take the dict as an input)")
        gm.graph.erase_node(node)
        gm.recompile()
    out_as_copies(gm)
    detach_out_of_place(gm)
    # custom autograd.Functions fx had to trace through (an argument no graph holds): their backward is not in the graph
    gm.meta["stagewise_lost_backwards"] = tuple(sorted(inlined_functions))
    return gm


def plain_fx_code(model: nn.Module, input_names: Sequence[str], opened: Sequence[str] = (),
                  real: Sequence[str] = ()) -> str:
    """The code of torch.fx's plain trace of `model` (buffers as the tensors they are, no probes): what _fx_trace's
    first trace gives, for comparing members whose buffers differ (BUFFER_VALUE_READS). `real`: the graph's
    REAL_BUFFERS, where only those are real tensors and every other buffer a graph value."""
    fixed = _defaults_not_given(model, list(input_names))
    with registration_hooks_off(), _distribution_checks_off():
        return symbolic_trace_opening(model, resolve_open_modules(model, opened), fixed or None, real_buffers=real).code


BUFFER_VALUE_READS = "stagewise_buffer_value_reads"  # gm.meta key: what forward() read of buffer values (_fx_trace)
# gm.meta key: the buffers forward() reads the values of into Python (opening.buffers_read_in_python), where known
READ_BUFFERS = "stagewise_read_buffers"
# gm.meta key: buffers the first plain trace wrote at trace time that the graph kept records as nodes (put back)
TRACE_WRITES_UNDONE = "stagewise_trace_writes_undone"
# gm.meta key: the buffers a trace kept real tensors where every other was a graph value (opening.buffers_read_in_python)
REAL_BUFFERS = "stagewise_real_buffers"


def _foreach_writes(gm: torch.fx.GraphModule) -> list[str]:
    """The in-place foreach ops of `gm` (`torch._foreach_lerp_(ks, qs, w)`, `aten._foreach_mul_.Scalar`), by name."""
    # also inside the sub-graphs torch.export keeps (a `with torch.no_grad():` block is one)
    names = {base_name(n) for g in gm.modules() if isinstance(g, torch.fx.GraphModule) for n in g.graph.nodes
             if n.op in ("call_function", "call_method")}
    return sorted(f"torch.{x}" for x in names if x.startswith("_foreach_") and x.endswith("_"))


_CONTAINER_WRITES = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault",
                               "popitem", "__setitem__", "__delitem__", "__iadd__", "sort", "reverse"})


def _containers_changed(gm: torch.fx.GraphModule, example_inputs: tuple) -> list[str]:
    """Calls of `gm` that change a list or dict input in place (`xs.append(h)`, `batch.pop("x")`, `batch["y"] = h`), as
    `name.method`: what the input holds there (the example inputs', followed through constant keys) is a list or a
    dict, not a tensor (a tensor written in place is ordered like any other write)."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reached: dict[torch.fx.Node, tuple[str, Any]] = {n: (n.name, v) for n, v in zip(places, example_inputs)}
    out = []
    for node in gm.graph.nodes:
        first = node.args[0] if node.args else None
        if not isinstance(first, torch.fx.Node) or first not in reached:
            continue
        label, value = reached[first]
        if node.op == "call_function" and node.target is operator.getitem:
            key = node.args[1]
            try:
                reached[node] = (f"{label}[{key!r}]", value[key] if isinstance(value, (list, tuple, dict)) else None)
            except (KeyError, IndexError, TypeError):
                pass
            continue
        if not isinstance(value, (list, dict)):
            continue
        if node.op == "call_method" and node.target in _CONTAINER_WRITES:
            key = node.args[1] if len(node.args) > 1 else None
            if isinstance(value, dict) and not isinstance(key, torch.fx.Node) and (
                    (node.target == "setdefault" and key in value)
                    or (node.target == "pop" and len(node.args) > 2 and key not in value)):
                continue  # a key it holds, a default for one it lacks: the container stays as it was
            out.append(f"{label}.{node.target}(...)")
        elif node.op == "call_function" and node.target in (operator.setitem, operator.delitem):
            out.append(f"{label}[{node.args[1]!r}] = ..." if node.target is operator.setitem else f"del {label}[{node.args[1]!r}]")
    return out


def baked_constants(gm: torch.fx.GraphModule) -> list[str]:
    """The get_attr targets of `gm` that torch.fx made for tensors computed at trace time (not model state)."""
    return [str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).startswith(BAKED_PREFIXES)]


def _read_buffers_written(gm: torch.fx.GraphModule, model: nn.Module, read: frozenset[str] | None) -> list[str]:
    """The buffers of `read` (buffers forward() reads the values of into Python) that `gm` writes when it runs (in
    place, or as a leaf module's statistics in training); with `read` unknown (None), every buffer `gm` writes."""
    written = _buffers_written(gm, model)
    return sorted(written if read is None else written & read)


def _buffers_written(gm: torch.fx.GraphModule, model: nn.Module) -> set[str]:
    """The buffers (dotted names) `gm` may write when it runs: the root of an in-place op's target (a view of one:
    `self.initialized.fill_(1)`, `self.loc.data.copy_(...)`), a functional norm's running statistics, and the buffers
    of a leaf module called in training mode (BatchNorm's statistics and num_batches_tracked)."""
    buffers = {name for name, _ in model.named_buffers()}
    out: set[str] = set()
    for node in gm.graph.nodes:
        roots = set()
        if is_inplace(node) and isinstance(node.args[0], torch.fx.Node):
            roots |= {alias_chain(node.args[0])[-1], storage_root(node.args[0], every_module=False)}
        roots |= {storage_root(stat, every_module=False) for stat in norm_stats_updated(node)}
        for root in roots:  # (a root made of a get_attr otherwise, `self.loc.data`, counts as that buffer)
            for n in [root] if root.op == "get_attr" else [] if root.op == "placeholder" else root.all_input_nodes:
                if n.op == "get_attr" and str(n.target) in buffers:
                    out.add(str(n.target))
        if node.op == "call_module":
            mod = model.get_submodule(str(node.target))
            if mod.training:
                out.update(f"{node.target}.{k}" for k, b in mod.named_buffers() if b is not None)
    return out


def _baked_from_buffers(gm: torch.fx.GraphModule, model: nn.Module, opened: Sequence[str], fixed: dict,
                        real: frozenset[str]) -> bool:
    """Whether a tensor fx baked into `gm` (a plain trace, or one with only `real` buffers real) comes from buffers:
    traced again with every buffer holding other values (swapped, not written), the program or a baked tensor's
    value changes. One that does not is a constant forward() makes (`torch.tensor([1., -1.])`)."""
    owners = [(mod, k, b) for mod in model.modules() for k, b in mod._buffers.items() if b is not None]
    for variant in (0, 1):
        try:
            for mod, k, b in owners:
                mod._buffers[k] = _other_values(b, variant)
            again = symbolic_trace_opening(model, opened, fixed or None, real_buffers=real)
        except Exception:  # noqa: BLE001 - other values break the trace: it depends on them
            return True
        finally:
            for mod, k, b in owners:
                mod._buffers[k] = b
        if again.code != gm.code or any(not _same_tensor(getattr(gm, t), getattr(again, t, None))
                                        for t in baked_constants(gm)):
            return True
    return False


def _reads_buffer_values(gm: torch.fx.GraphModule, model: nn.Module, opened: Sequence[str], fixed: dict,
                         real: frozenset[str] = frozenset()) -> bool:
    """Whether fx's plain trace of `model` (`gm`, buffers not graph values, or only the `real` ones not) changes when
    every buffer holds other values: then a number or a branch in it came from a buffer's values. Buffers are
    swapped, not written."""
    owners = [(mod, k, b) for mod in model.modules() for k, b in mod._buffers.items() if b is not None]
    if not owners:
        return False
    # small, large and shrinking changes, zero and the sign flipped: a threshold one leaves on the same side, another
    # not (`if self.initialized.item() == 0:`, Glow's data-dependent init, only sees zero; `if self.s > 0` with a small s
    # only the flip)
    for variant in range(_VARIANTS):
        try:
            for mod, k, b in owners:
                mod._buffers[k] = _other_values(b, variant)
            again = symbolic_trace_opening(model, opened, fixed or None, real_buffers=real)
        except Exception:
            return True  # other values break the trace: it depends on them
        finally:
            for mod, k, b in owners:
                mod._buffers[k] = b
        if again.code != gm.code:
            return True
    return False


_VARIANTS = 5  # how many _other_values variants there are


def _other_values(t: torch.Tensor, variant: int = 0) -> torch.Tensor:
    """A tensor like `t` holding other values: variants 0-2 change every element (0 maps floats by -1.37x + 0.29 and
    ints by + 1, 1 floats by 37x + 1000 and ints by + 1000, 2 floats by 0.001x + 1e-4 and ints by -x - 1), 3 is all
    zeros, 4 flips the sign (uint8: 255 - x); bools are flipped in every variant."""
    t = t.detach()  # not torch.no_grad(): inside the trace's watches that would count as forward() turning gradients off
    if t.dtype == torch.bool:
        return ~t
    if variant == 3:
        return torch.zeros_like(t)
    if t.is_floating_point() or t.is_complex():
        return (t * -1.37 + 0.29, t * 37.0 + 1000.0, t * 0.001 + 1e-4, None, -t)[variant]
    if t.dtype == torch.uint8:
        return t + (1, 100, 50)[variant] if variant < 3 else 255 - t
    return (t + 1, t + 1000, -t - 1, None, -t)[variant]


def held_generators(gm: torch.fx.GraphModule) -> str:
    """The torch.Generator objects `gm`'s ops draw from (a generator= argument, or a get_attr of one), named; "" if none."""
    found = []
    for node in gm.graph.nodes:
        values = tree_flatten((node.args, node.kwargs))[0]
        if node.op == "get_attr":
            values.append(getattr(gm, str(node.target), None))
        if any(isinstance(v, torch.Generator) for v in values):
            found.append(node.name)
    return ", ".join(found[:3])


def _state_derived_constants(gm: torch.fx.GraphModule, model: nn.Module, opened: Sequence[str], fixed: dict) -> str:
    """The baked constants of a buffer-proxied trace that depend on parameters or buffers, named ("" when none).

    One that requires grad was computed from parameters. For the others, `model` is traced again with every
    parameter and buffer swapped for one holding other values (then swapped back): a constant that changes with
    them came from them."""
    baked = baked_constants(gm)
    if not baked:
        return ""
    grads = [t for t in baked if getattr(gm, t).requires_grad]
    if grads:
        return ", ".join(grads)
    # a graph kept with buffers read into Python real tensors (_fx_trace's fallback, BUFFER_VALUE_READS) is traced again
    # as it was, its buffers as they are: their other values would take another branch, and _baked_from_buffers has
    # shown its baked tensors come from no buffer
    kept = BUFFER_VALUE_READS in gm.meta
    real = gm.meta.get(REAL_BUFFERS, ())
    swapped = []
    try:
        for mod in model.modules():
            for table in (mod._parameters,) if kept else (mod._parameters, mod._buffers):
                for k, t in table.items():
                    if t is not None:
                        swapped.append((table, k, t))
                        other = _other_values(t)
                        table[k] = nn.Parameter(other, t.requires_grad) if isinstance(t, nn.Parameter) else other
        again = symbolic_trace_opening(model, opened, fixed or None, proxy_buffers=not kept, real_buffers=real)
    except Exception:  # noqa: BLE001 - other values break the trace: it depends on them
        return ", ".join(baked)
    finally:
        for table, k, t in swapped:
            table[k] = t
    if again.code != gm.code:
        return ", ".join(baked)
    return ", ".join(t for t in baked if not _same_tensor(getattr(gm, t), getattr(again, t)))


def _same_tensor(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype \
        and bool(torch.equal(a, b))


def trace(model: nn.Module, example_inputs: tuple, *, probe: bool = True, open_modules: Sequence[str] = ()) -> ModelGraph:
    """Trace `model` on `example_inputs` and annotate every node.

    Args:
        model: the architecture (one member); it is not modified.
        example_inputs: positional inputs of one member (no member axis).
        probe: run the vmap capability probe on every node (planner.capability).
        open_modules: leaf modules to trace inside: paths ("enc.layers.0"), globs ("enc.layers.*")
            or class names ("TransformerEncoderLayer"); see planner.opening. The graph's
            `opened_modules` holds the paths they resolved to; `leaf_modules()` what is still closed.
    Returns:
        ModelGraph with shapes, dtypes, params, FLOPs and batchability per node.
    Raises:
        TraceError when both tracers fail (both reasons in the message), the
        traced graph does not run on the example inputs, or an open_modules name matches no module.
    """
    # copies: the graph runs on them below, and a forward() that writes its inputs in place would write the caller's
    example_inputs = _input_copies(example_inputs)
    if any(isinstance(x, torch.nn.utils.rnn.PackedSequence) for x in tree_flatten(
            tuple(example_inputs), is_leaf=lambda v: isinstance(v, torch.nn.utils.rnn.PackedSequence))[0]):
        raise TraceError(
            "an input is a PackedSequence: its data holds the sequences' steps packed by length, which differ per call "
            "and cannot carry a member axis. Pass the padded batch and the lengths as inputs (and mask the padded steps "
            "in forward(): a mask from the lengths, or the last valid step gathered by length)")
    if any(isinstance(leaf, torch.Generator) for leaf in tree_flatten(tuple(example_inputs))[0]):
        raise TraceError(
            "an input is a torch.Generator (each member's own noise drawn inside forward()): neither tracer can take a "
            "generator as an input, and the batched module could not hand each member its own. Draw the noise outside "
            "forward() and pass it as an input planned per_member (member i's noise in row i), as the member loop "
            "would draw it with member i's generator")
    refusal = hooks_refusal(model, type(model).__name__) or global_hooks_refusal("the batched module") \
        or state_refusal(model) or quantized_state_refusal(model)
    if refusal:
        raise TraceError(refusal)
    opened = resolve_open_modules(model, open_modules)
    before = StateSnapshot.take(model)
    with registration_hooks_off(), _host_state_refused(model), _restored_on_failure(model, before), \
            _distribution_checks_off(), _checkpoints_seen() as checkpointed, _autograd_calls_named() as derivative_in, \
            _autograd_hooks_refused() as hooks_in:
        gm, tracer, note = fx_or_export(model, example_inputs, opened, before)
        derivative_in(gm)
        hooks_in(gm)
        changed = before.restore_if_changed(model)
        undone = set(gm.meta.get(TRACE_WRITES_UNDONE, ())) if tracer == "fx" else set()
        if undone:  # written by fx's first trace, which _fx_trace put back: the graph records those writes as nodes
            changed = StateChange([t for t in changed.tensors if t not in undone], changed.attributes, changed.carried)
        if changed.carried and not _attributes_carried(model, example_inputs, before):
            # set from the inputs but not read back by a later call (an activation kept to look at): as before
            kept = set(changed.carried)
            changed = StateChange(changed.tensors, [a for a in changed.attributes if a not in kept])
        if changed and tracer == "fx" and not changed.attributes:
            # fx ran forward() on the real module: an in-place update of real state happened
            # at trace time and is missing from the graph. export records such updates as nodes.
            try:
                gm = _export(model, example_inputs)
            except Exception as e:
                raise TraceError(
                    f"forward() updates {changed.describe()} in place, which torch.fx cannot record, and torch.export "
                    f"failed ({type(e).__name__}: {_first_line(e)}); move the update out of forward() or make it exportable"
                ) from None
            tracer, note = "export", f"forward() updates {changed.describe()} in place, which torch.fx cannot record; traced with torch.export"
            changed = before.restore_if_changed(model)
        elif changed and tracer == "export" and not changed.attributes:
            # fx ran part of forward() on the real module (an in-place update) before it gave up; export traced from
            # there: once more from the restored state (export records such updates as nodes and changes nothing)
            gm = _export(model, example_inputs)
            changed = before.restore_if_changed(model)
        if tracer == "fx" and not changed:
            disagreement = _fx_disagrees(model, gm, example_inputs, before)
            before.restore_if_changed(model)  # the check's own runs write state (BatchNorm statistics): put back, not news
            if _grads_disagreement(disagreement):
                raise TraceError(_grads_refusal(disagreement, model))  # torch.export records no such change either
            if disagreement is not None:
                try:
                    gm = _export(model, example_inputs)
                except Exception as e:
                    raise TraceError(
                        f"torch.fx's trace is not forward(): {disagreement}; it takes a Python branch on a traced value one "
                        f"way whatever the value (isinstance(x, torch.Tensor), a tuple check), and torch.export failed "
                        f"({type(e).__name__}: {_first_line(e)}); move such branches out of forward() or make it exportable"
                    ) from None
                tracer, note = "export", f"torch.fx's graph is not forward(): {disagreement}; traced with torch.export"
                changed = before.restore_if_changed(model)
    # every module's attributes as they were: torch.export leaves equal copies in some (LayerNorm's normalized_shape
    # tuple, which nn.TransformerEncoder's layers share), and members compared later would then differ from member 0
    restore_all(before, model)
    containers = [i for i, x in enumerate(example_inputs) if isinstance(x, (dict, list, tuple))]
    if tracer == "export" and containers:
        # the plan's inputs would be the containers' flattened tensors, which neither build's trace nor a call can
        # give back to forward() as the dict or list it takes
        raise TraceError(
            f"forward() takes a {type(example_inputs[containers[0]]).__name__} as input {containers[0]}, and this model "
            f"needs torch.export ({note or 'torch.fx could not trace it'}): a torch.export plan takes tensors as its "
            "inputs. Pass the container's tensors as separate arguments of forward(), or make forward() traceable by "
            "torch.fx (which keeps the container)")
    if changed:
        raise TraceError(_changed_refusal(model, changed))
    counted = _numbers_counted(model, gm, example_inputs, before)
    if counted:
        raise TraceError(_counted_refusal(model, counted))
    if any(n.op in ("call_method", "call_function") and isinstance(n.target, (str, torch._ops.OpOverload))
           and base_name(n) == "set_" for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes):
        raise TraceError(
            "forward() calls Tensor.set_(), which swaps a tensor's storage for another: a member's state and values "
            "are rows of stacked tensors in the batched module, which set_ would part from them, so the write would "
            "not reach the stacked state. Write the values in place instead (`self.buf.copy_(new)`)")
    later = [(n, written_later_arguments(n)) for n in gm.graph.nodes if written_later_arguments(n)]
    if later:
        node, names = later[0]
        raise TraceError(
            f"{node.target} writes its argument(s) {names} in place (a custom op's mutates_args), past its first: the "
            "plan follows an op's writes into its first argument only, so a later read of that tensor could run "
            "before the write. Declare the written tensor as the op's first argument, or return the new value and "
            "write it in forward() (`self.buf.copy_(new)`)")
    held = held_generators(gm)
    if held:
        raise TraceError(f"forward() draws random numbers from a torch.Generator the model holds ({held}): the traced graph "
                         "keeps member 0's generator, so every member would draw from it where the member loop draws from "
                         "each member's own. Draw from torch's default generator instead (each member draws from it in "
                         "turn), or pass the noise in as an input")
    if tracer == "export":
        carried = _attributes_carried(model, example_inputs, before)
        if carried:  # torch.export put such an attribute back and baked its first value into the graph
            raise TraceError(_changed_refusal(model, StateChange([], carried, carried)))
        # export's graph checked as fx's is (after the refusals above): forward() may read that it is traced
        # (torch.compiler.is_compiling(), is_exporting(), torch.fx's is_fx_tracing() all hold under export) and take
        # a branch eager calls never take
        disagreement = _fx_disagrees(model, gm, example_inputs, before)
        before.restore_if_changed(model)
        if _grads_disagreement(disagreement):
            raise TraceError(_grads_refusal(disagreement, model))
        if disagreement is not None and not disagreement.startswith("its graph fails"):  # (that is named below)
            reassigned = _buffers_reassigned(model, example_inputs, before)
            if reassigned:
                raise TraceError(
                    f"forward() assigns new tensors to buffer(s) {reassigned[:3]} (`self.count = tot`, rl_games' "
                    "RunningMeanStd): torch.export does not record a buffer re-assignment, so its graph leaves the "
                    f"buffer as it was ({disagreement}), and torch.fx cannot trace it either. Write it in place instead "
                    f"(`self.{reassigned[0].rpartition('.')[2]}.copy_(new)`)")
            raise TraceError(
                f"torch.export's graph is not forward(): {disagreement}. forward() runs otherwise when traced: a "
                "branch on torch.compiler.is_compiling() / is_exporting(), torch.fx's is_fx_tracing() or "
                "torch.jit.is_tracing() (true under torch.export) takes a path eager calls never take. Make both "
                "paths compute the same, or drop the branch"
                + (f" ({note})" if note else ""))
    if tracer == "export":
        check_small_sizes(model, gm, example_inputs)
    foreach = _foreach_writes(gm)
    if foreach:
        raise TraceError(
            f"forward() writes lists of tensors in place with {', '.join(foreach)} (an EMA of one encoder's weights "
            "into another's, MoCo / BYOL style): the planner orders the reads of a tensor after the in-place op that "
            "writes it, and a foreach op writes a whole list at once, which it cannot follow, so a stage could read the "
            "weights before the update. Write each tensor with its own in-place op: "
            "`for k, q in zip(self.key.parameters(), self.query.parameters()): k.lerp_(q, 0.01)`")
    if any(n.op == "call_function" and getattr(n.target, "__name__", "") == "_enter_autocast" for n in gm.graph.nodes):
        # torch.export keeps a `with torch.autocast(...)` block as one region op, except around a torch.cond: then as
        # bare enter / exit calls, which no value connects to the ops between them, so stages would run those ops
        # outside the block (in float32 where each member computes in the autocast dtype, or a dtype mismatch)
        raise TraceError(
            "forward() runs a torch.cond inside a `with torch.autocast(...)` block, which torch.export keeps as bare "
            "enter / exit calls the planner cannot keep the block's ops between: move the torch.cond out of the "
            "autocast block, or the autocast block into each branch")
    changed = _containers_changed(gm, tuple(example_inputs))
    if changed:
        raise TraceError(
            f"forward() changes a container it is given in place ({changed[0]}): the batched module runs forward() "
            "once for all members, so the caller's list or dict would get one batched value (a tensor that cannot be "
            "used outside the call), or nothing, where the member loop adds each member's. Return the values from "
            "forward() instead, and add them to the container outside the model")
    leaves = _new_leaves_returned(model, example_inputs, before)
    if leaves:  # a warning, not a refusal: the outputs' values and the parameters' gradients are the loop's
        warnings.warn(
            f"forward() returns a tensor it makes a new autograd leaf (output leaf {leaves[0]}: `x = "
            "x.detach().requires_grad_(True)`, SIREN's way to differentiate the output with respect to its input "
            "coordinates): the batched module makes it inside one call for all members and returns it recording no "
            "gradient, so torch.autograd.grad(out, coords) on its outputs fails (the outputs' values and the "
            "parameters' gradients are the member loop's). To differentiate with respect to the input, drop that line "
            "and make the input require grad outside the model: coords = coords.requires_grad_(); out = ens(coords) "
            "with coords per_member ([N, ...], each member's own derivative), then torch.autograd.grad(out.sum(), "
            "coords, create_graph=True)", UserWarning, stacklevel=2)
    _warn_stored(model, _attributes_stored(model, example_inputs, before))
    tensor_attributes = [(mod, k, v) for mod in model.modules() for k, v in vars(mod).items() if isinstance(v, torch.Tensor)]
    # the graph run and the probe draw random numbers (dropout in training): the caller's random state stays its own
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        values, flops = _run_and_record(gm, example_inputs)
        written = _state_written_in_functions(gm, values)
        if written:
            raise TraceError(
                f"the autograd.Function {written[0]} writes {written[1]!r} in place inside its forward: the plan "
                "cannot see a write inside a Function, so a later read of that state could run before it (and "
                "members sharing it would each write a copy). Write the state in forward() itself "
                f"(`self.{written[1].rpartition('.')[2]}.copy_(new)`, the Function returning what it computed)")
        quantized = [name for name, v in values.items() if not _constant_quantizer(gm, name)
                     and any(isinstance(t, torch.Tensor) and t.is_quantized for t in tree_flatten(v)[0])]
        if quantized:
            raise TraceError(QUANTIZED.format(what=f"makes quantized tensors (node {quantized[0]!r})"))
        graph = graph_of(gm, tracer, note, values, flops, opened=opened)
        if probe:
            annotate_capability(graph)
    # the probe ran the model's own modules under vmap: a hook that stores a tensor on its module (the old
    # weight_norm's `weight`) left a vmap-internal tensor there, which no later use of the model can read
    for mod, k, v in tensor_attributes:
        mod.__dict__[k] = v
    restore_all(before, model)  # and what else it left (an RNN's _flat_weights list of vmap tensors)
    if checkpointed and updating_norms(model) and norms_in_checkpoints(model, example_inputs) is None:
        warnings.warn(CHECKPOINTED_NORMS_UNKNOWN.format(model=type(model).__name__), stacklevel=2)
    return graph


QUANTIZED = (
    "forward() {what}: the batched module holds the members' values stacked, one tensor per value, and a quantized "
    "tensor has one scale and zero point (torch's stack puts every member on member 0's, clipping the others), so "
    "members would compute on member 0's grid. Keep quantized values out of forward() (quantize and dequantize in "
    "one place outside it), or use fake quantization (torch.fake_quantize_per_tensor_affine / per_channel_affine, "
    "torch.ao.quantization.FakeQuantize), which computes in float and runs per member with each member's scales")


def _constant_quantizer(gm: torch.fx.GraphModule, name: str) -> bool:
    """Whether node `name` is torch.quantize_per_tensor with a scale and zero point written as numbers: the same for
    every member, so the members' quantized values stack exactly (a dequantize next is the usual use)."""
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    if node is None or node.target not in (torch.quantize_per_tensor, torch.ops.aten.quantize_per_tensor.default):
        return False
    qparams = list(node.args[1:3]) + [node.kwargs.get(k) for k in ("scale", "zero_point") if k in node.kwargs]
    return not any(isinstance(a, torch.fx.Node) for a in qparams)


def quantized_state_refusal(model: nn.Module) -> str | None:
    """QUANTIZED where `model` holds a quantized parameter or buffer (`qint8` weights with a scale of their own)."""
    held = [k for k, t in [*model.named_parameters(), *model.named_buffers()] if t.is_quantized]
    return QUANTIZED.format(what=f"reads quantized state ({', '.join(held[:3])})") if held else None


CHECKPOINTED_NORMS_UNKNOWN = (
    "forward() runs part of itself through torch.utils.checkpoint, and {model} holds layers that update running "
    "statistics in training, but a training-mode call of a copy failed, so which of them run inside a checkpointed "
    "region is not known. Eager torch recomputes such a region in backward: a BatchNorm inside it updates its "
    "statistics a second time per backward in the member loop, which the batched module repeats only for the layers "
    "it knows. Trace and build with inputs forward() takes in training mode, or keep BatchNorm layers out of "
    "checkpointed regions")


@contextlib.contextmanager
def _autograd_calls_named():
    """A TraceError raised where forward() called torch.autograd.grad / backward while traced names that call and the
    fix: neither tracer can record a derivative taken inside the model (a PINN residual, forces as -dE/dx)."""
    seen: list[str] = []
    grad, backward = torch.autograd.grad, torch.autograd.backward

    def from_user() -> bool:  # not torch's own use while tracing
        return "/torch/" not in sys._getframe(2).f_code.co_filename.replace("\\", "/")

    def grad_watched(*args, **kwargs):
        if from_user():
            seen.append("torch.autograd.grad")
        return grad(*args, **kwargs)

    def backward_watched(*args, **kwargs):
        if from_user():
            seen.append("torch.autograd.backward")
        return backward(*args, **kwargs)

    def in_graph(gm: torch.fx.GraphModule) -> None:  # fx records the call as a node (it then fails when run)
        if any(n.op == "call_function" and n.target in (grad_watched, backward_watched, grad, backward) for n in gm.graph.nodes):
            raise TraceError("the traced graph calls torch.autograd.grad")

    torch.autograd.grad, torch.autograd.backward = grad_watched, backward_watched
    try:
        yield in_graph
    except TraceError as e:
        if not seen:
            raise
        raise TraceError(
            f"forward() calls {seen[0]} (a derivative inside the model: a PINN residual, forces as -dE/dx), which "
            "neither torch.fx nor torch.export can record in a graph. Take the derivative outside the batched module: "
            "make forward() return what is differentiated, and call torch.autograd.grad(ens(x).sum(), x, "
            "create_graph=True) on the batched module's output (with x per_member, [N, ...], each member's own "
            f"derivative). ({_first_line(e)[:300]})") from None
    finally:
        torch.autograd.grad, torch.autograd.backward = grad, backward


@contextlib.contextmanager
def _checkpoints_seen(depth: list[int] | None = None):
    """Yields a list that gets an entry each time torch.utils.checkpoint runs a region while inside (non-reentrant:
    its generator; reentrant: CheckpointFunction, also seen by export's Function watch). `depth`, where given, counts
    the regions running now in its first item (above 0 while a module runs inside one) and, where it has a second,
    numbers the outermost regions there (one more at each)."""
    import torch.utils.checkpoint as ckpt

    seen: list[bool] = []
    depth = [0] if depth is None else depth
    generator = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    function = getattr(ckpt, "CheckpointFunction", None)
    if generator is not None:
        def watched(*args, **kwargs):
            seen.append(True)
            inner = generator(*args, **kwargs)

            def counted():  # checkpoint() steps it once before the region and once after
                depth[0] += 1
                if len(depth) > 1 and depth[0] == 1:  # (an outermost region's number)
                    depth[1] += 1
                try:
                    return (yield from inner)
                finally:
                    depth[0] -= 1
            return counted()
        ckpt._checkpoint_without_reentrant_generator = watched
    forward = function.__dict__.get("forward") if function is not None else None
    if forward is not None:
        plain = forward.__func__ if isinstance(forward, staticmethod) else forward

        def forward_watched(*args, **kwargs):
            seen.append(True)
            depth[0] += 1
            if len(depth) > 1 and depth[0] == 1:
                depth[1] += 1
            try:
                return plain(*args, **kwargs)
            finally:
                depth[0] -= 1
        function.forward = staticmethod(forward_watched)
    try:
        yield seen
    finally:
        if generator is not None:
            ckpt._checkpoint_without_reentrant_generator = generator
        if forward is not None:
            function.forward = forward


def updating_norms(model: nn.Module) -> list[str]:
    """Paths of the layers that update running statistics in training (BatchNorm, InstanceNorm tracking them)."""
    return [path for path, m in model.named_modules() if isinstance(m, _NORMS_WITH_STATISTICS) and m.track_running_stats]


def norms_in_checkpoints(model: nn.Module, example_inputs: tuple) -> dict[str, tuple[bool, tuple[str, ...]]] | None:
    """{path: (whether its calls are more than one, the other modules its region runs)} for the layers updating
    running statistics that run inside a torch.utils.checkpoint region when `model` runs in training mode with
    gradients on: eager torch recomputes such a region in backward, so the member loop updates their statistics a
    second time per backward, which the batched module repeats (executor.build.BatchedModule, `_checkpointed_norms`)
    for a layer called once per call; a layer called more than once, or inside a region and outside it too, is
    refused in training (`True`). One eager call of
    a training-mode copy sharing nothing with `model` (a batch of one, which BatchNorm refuses in training, is taken
    twice); None where that call fails (the caller cannot tell, and says so)."""
    updating = updating_norms(model)
    if not updating:
        return {}
    try:
        probe = copy.deepcopy(model)
        probe.train()  # (a train() override may return None)
    except Exception:  # noqa: BLE001 - a module that does not copy: cannot tell
        return None
    depth, calls = [0, 0], collections.defaultdict(list)  # (regions open, the outermost one's number)
    handles = [module.register_forward_pre_hook(lambda _m, _a, path=path: calls[path].append(depth[1] if depth[0] else 0))
               for path, module in probe.named_modules() if path]
    cuda = sorted({t.device.index or 0 for t in [*probe.parameters(), *probe.buffers()] if t.is_cuda})
    doubled = tree_map(lambda t: torch.cat([t, t]) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == 1 else t,
                       tuple(example_inputs))
    try:
        for inputs in (example_inputs, doubled):
            calls.clear()
            try:
                with _checkpoints_seen(depth), torch.enable_grad(), warnings.catch_warnings(), \
                        torch.random.fork_rng(devices=cuda):  # dropout's draws: the caller's random stream as it was
                    warnings.simplefilter("ignore")
                    probe(*_input_copies(inputs))
                break
            except Exception:  # noqa: BLE001 - forward() in training mode needs other inputs (labels): cannot tell
                if inputs is doubled:
                    return None
    finally:
        for h in handles:
            h.remove()
    return {path: (len(calls[path]) > 1, tuple(sorted(p for p, regions in calls.items() if p != path
                                                      and set(regions) & set(calls[path]) - {0})))
            for path in updating if any(calls[path])}


@contextlib.contextmanager
def _distribution_checks_off():
    """torch.distributions' argument checks off while tracing (`validate_args`, on by default): they only raise for
    invalid parameters, with a branch on tensor values that neither tracer can follow (a Categorical policy was
    untraceable). The batched module then answers NaN where a member's own call would raise for NaN logits."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)


@contextlib.contextmanager
def _restored_on_failure(model: nn.Module, before: StateSnapshot):
    """The model's state and attributes as `before` holds them when the block raises (a trace that failed half way
    must not leave the user's model changed)."""
    try:
        yield
    except BaseException:
        try:
            restore_all(before, model)
        except Exception:  # the trace's own error is the one to see
            pass
        raise


def _changed_refusal(model: nn.Module, changed: StateChange) -> str:
    """Why a forward() that changed `changed` while traced is refused, and the likely fix."""
    fields = config_fields(model, changed.attributes)
    if fields and len(fields) == len(changed.attributes) and not changed.tensors:
        # config fields forward() fills in on its first call (Hugging Face sets config.problem_type from the labels);
        # a config shared by many modules shows up under each: name each field once, by its shortest path
        shortest: dict[str, str] = {}
        for key in sorted(fields, key=len):
            shortest.setdefault(key.rpartition(".")[2], key)
        sets = "; ".join(f"model.{k} = {fields[k]!r}" for k in list(shortest.values())[:3])
        return (f"forward() sets the config field(s) {', '.join(repr(k) for k in list(shortest.values())[:3])} on its first "
                f"call, while it is traced, and the traced graph cannot repeat that per member; set them before tracing ({sets})")
    if changed.carried:
        return (f"forward() sets attribute(s) {', '.join(repr(a) for a in changed.carried[:3])} to a value computed from "
                "its inputs and reads it at the next call (a recurrent state kept as a plain attribute): the traced graph "
                "would read the first value on every call. Keep it in a buffer (register_buffer) written in place "
                "(self.h.copy_(h.detach())), or pass the state in as an input and return the new one")
    return (f"forward() changes {changed.describe()} while it is traced, and the traced graph cannot repeat that per member; "
            "keep counters and caches out of forward(), or hold them in a tensor buffer updated in place")


def retrace(model: nn.Module, tracer: str, example_inputs: tuple | None, input_names: Sequence[str] | None = None,
            opened: Sequence[str] = ()) -> ModelGraph:
    """Trace `model` again with the tracer a plan records, structure only (no shapes, no probe).

    `input_names` (the plan's inputs) tells fx which forward() parameters the plan
    takes; without it, the first len(example_inputs) (or all without defaults).
    `opened`: the plan's opened_modules, traced inside again (and part of the fingerprint).
    """
    opened = resolve_open_modules(model, opened)
    with registration_hooks_off(), _host_state_refused(model), _distribution_checks_off(), \
            _autograd_hooks_refused() as hooks_in, _attributes_kept(model):
        graph = _retrace(model, tracer, example_inputs, input_names, opened)
        hooks_in(graph.gm)
        return graph


@contextlib.contextmanager
def _attributes_kept(model: nn.Module):
    """Every module's attributes and hook tables put back as they were (one level) after a trace: what forward()
    caches on its first call (a rotary table as a plain tensor attribute, Hugging Face's output-capturing hooks) is
    left by torch.export as a fake tensor, by fx as a Proxy, which a later eager call of the model would read."""
    before = [(mod, dict(vars(mod))) for mod in model.modules()]
    tables = [(table, dict(table)) for mod, attrs in before for name in _HOOK_TABLES
              for table in [attrs.get(name)] if isinstance(table, dict)]
    try:
        yield
    finally:
        for mod, attrs in before:
            for k in [k for k in vars(mod) if k not in attrs]:
                del mod.__dict__[k]
            for k, v in attrs.items():
                if mod.__dict__.get(k, _KEPT_MISSING) is not v:
                    mod.__dict__[k] = v
        for table, was in tables:
            drop_added_capturing_hooks(table, was)


_KEPT_MISSING = object()


def _retrace(model: nn.Module, tracer: str, example_inputs: tuple | None, input_names: Sequence[str] | None,
             opened: Sequence[str]) -> ModelGraph:
    if tracer == "fx":
        given = input_names if input_names is not None else len(example_inputs or ())
        try:
            gm = _fx_trace(model, given, opened)
        except Exception as e:
            raise TraceError(f"torch.fx cannot trace this member ({type(e).__name__}: {_first_line(e)}), but the plan was made with fx; re-plan this model") from None
        return graph_of(gm, "fx", "", opened=opened)
    if tracer == "export":
        if example_inputs is None:
            raise TraceError("this plan was traced with torch.export, which needs example inputs; pass example_inputs= to executor.build")
        try:
            gm = _export(model, example_inputs)
        except Exception as e:
            raise TraceError(f"torch.export cannot trace this member ({type(e).__name__}: {_first_line(e)}); check the member and the example inputs") from None
        return graph_of(gm, "export", "", opened=opened)
    raise TraceError(f"unknown tracer {tracer!r} in the plan; expected 'fx' or 'export'")


def graph_of(gm: torch.fx.GraphModule, tracer: str, note: str, values: dict | None = None, flops: dict | None = None,
             *, opened: Sequence[str] = ()) -> ModelGraph:
    """Build the networkx view of `gm`; shapes and FLOPs come from `values`/`flops` when given; `opened` as traced.

    An aten-level graph's views become reshapes (tracers.views_as_reshapes) after the fingerprint is taken."""
    values, flops = values or {}, flops or {}
    traced_fingerprint = fingerprint(gm, opened)
    views_as_reshapes(gm)
    dag = nx.DiGraph()
    names = []
    for node in gm.graph.nodes:
        names.append(node.name)
        value = values.get(node.name)
        info = NodeInfo(
            name=node.name,
            op=node.op,
            target=_readable_target(gm, node),
            module_path=_module_path(node),
            shape=describe_shape(value) if node.name in values else "?",
            dtype=_dtype_of(value),
            params=_params_of(gm, node),
            flops=int(flops.get(node.name, 0)),
        )
        dag.add_node(node.name, **info.__dict__)
    add_edges(dag, gm)
    return ModelGraph(
        gm=gm,
        dag=dag,
        tracer=tracer,
        tracer_note=note,
        input_names=[n.name for n in gm.graph.nodes if n.op == "placeholder"],
        node_names=names,
        fingerprint=traced_fingerprint,
        example_values=values,
        out_spec=getattr(gm, "_out_spec", None) if tracer == "export" else None,
        input_specs=traced_specs(gm, tracer, values),
        input_guard=getattr(gm, "_guards_fn", None) if tracer == "export" else None,
        opened_modules=tuple(opened),
    )


def add_edges(dag: nx.DiGraph, gm: torch.fx.GraphModule) -> None:
    """The edges of `gm`'s nodes into `dag`: where a node reads another's value, and inplace_order_edges."""
    for node in gm.graph.nodes:
        for dep in node.all_input_nodes:
            dag.add_edge(dep.name, node.name)
    for u, v in inplace_order_edges(gm):
        if not dag.has_edge(u, v):
            dag.add_edge(u, v, order=True)


def inplace_order_edges(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """Edges that keep in-place updates in program order.

    fx records `buf.add_(v)` with no edge to later reads of `buf`, so a stage
    reading it could run before the update. Each in-place node gets an edge from
    every earlier and to every later reader of the value it writes: every value that
    may share its storage (views of its storage root, forward and back, through
    movedim, chunk, .data, ...; for module state, every get_attr of the same target).
    A region op whose sub-graph writes (a view of) an operand in place counts as a write of
    that operand (region_written_operands).
    Edges follow graph order, so the DAG stays acyclic and node order stays topological.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    edges = []
    # a region op (torch.export's `with torch.no_grad():` block) writes what its sub-graph writes in place of the
    # operands it is handed, through views too (`self.m[:2].lerp_(...)` hands nothing back: later reads of m read the
    # get_attr, with no data edge from the region)
    writes = [(node, node.args[0]) for node in nodes if is_inplace(node)]
    writes += [(node, value) for node in nodes for value in region_written_operands(gm, node)]
    for node, value in writes:
        roots = {alias_chain(value)[-1], storage_root(value, every_module=False)}
        for root in [r for r in roots if r.op == "get_attr"]:
            roots |= {n for n in nodes if n.op == "get_attr" and n.target == root.target}
        aliases = set(alias_chain(value)) | {a for r in roots for a in storage_sharers(r, every_module=False)}
        touched = aliases | {u for a in aliases for u in a.users}
        for other in sorted(touched - {node}, key=pos.__getitem__):
            edges.append((other.name, node.name) if pos[other] < pos[node] else (node.name, other.name))
    writers = _state_writers(gm)
    for node, targets in writers:
        # a leaf module (or call) writing its own state: every read of that state, and every other call writing it,
        # stays on its side of the write (a BatchNorm's running_var read after it; an Embedding(max_norm)'s weight)
        roots = [n for n in nodes if n.op == "get_attr" and str(n.target) in targets]
        aliases = {a for r in roots for a in storage_sharers(r, every_module=False)}
        touched = aliases | {u for a in aliases for u in a.users}
        touched |= {other for other, theirs in writers if theirs & targets}
        for other in sorted(touched - {node}, key=pos.__getitem__):
            edges.append((other.name, node.name) if pos[other] < pos[node] else (node.name, other.name))
    return edges


_NORMS_WITH_STATISTICS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def _state_writers(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, set[str]]]:
    """Nodes that write state of the model the graph does not show as an in-place op, with the get_attr targets
    they write: a BatchNorm/InstanceNorm keeping running statistics (in either mode: train() may come later), an
    Embedding/EmbeddingBag with max_norm (it renormalises the rows it looks up in place), F.embedding /
    F.embedding_bag called with max_norm on a weight of the model."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            try:
                mod = gm.get_submodule(str(n.target))
            except AttributeError:
                continue
            if isinstance(mod, _NORMS_WITH_STATISTICS) and mod.track_running_stats:
                names = {f"{n.target}.{k}" for k, b in mod.named_buffers() if b is not None}
            elif isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.max_norm is not None:
                names = {f"{n.target}.weight"}
            else:
                continue
            if names:
                out.append((n, names))
        else:
            weight = renormalised_weight(n)
            root = alias_chain(weight)[-1] if weight is not None else None
            if root is not None and root.op == "get_attr":
                out.append((n, {str(root.target)}))
    return out


def renormalised_weight(n: torch.fx.Node) -> torch.fx.Node | None:
    """The weight an `F.embedding` / `F.embedding_bag` call with max_norm renormalises in place (the rows it looks
    up), else None."""
    if n.op != "call_function" or n.target not in (torch.nn.functional.embedding, torch.nn.functional.embedding_bag):
        return None
    at = 3 if n.target is torch.nn.functional.embedding else 4
    max_norm = n.kwargs.get("max_norm", n.args[at] if len(n.args) > at else None)
    weight = n.kwargs.get("weight", n.args[1] if len(n.args) > 1 else None)
    return weight if max_norm is not None and isinstance(weight, torch.fx.Node) else None


class _WholeGraphOnly:
    """Stands in for FlopCounterMode's module tracker, which the planner needs no per-module split from: the tracker
    hangs a multi-grad hook on every module input that requires grad, and a view of a parameter made under
    torch.no_grad() (Perceiver latents `self.latents.expand(B, -1, -1)` into a LayerNorm or attention, DETR queries)
    requires grad without a grad_fn, where torch asserts ("Expected gradient function to be set")."""

    parents = ("Global",)  # what FlopCounterMode books every count under

    def __enter__(self) -> "_WholeGraphOnly":
        return self

    def __exit__(self, *exc) -> None:
        return None


def _flop_counter() -> FlopCounterMode:
    """A FlopCounterMode counting the total only (get_total_flops), without its module tracker (_WholeGraphOnly)."""
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _WholeGraphOnly()
    return counter


class _Recorder(torch.fx.Interpreter):
    """Runs the graph once, keeping every node's value and FLOPs."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, Any] = {}
        self.flops: dict[str, int] = {}
        self.written: list[tuple[torch.fx.Node, torch.fx.Node]] = []  # (opaque node, input whose version it moved)
        self.aliased: list[tuple[torch.fx.Node, torch.fx.Node]] = []  # (opaque node, input its output shares memory with)

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("call_module", "call_function", "call_method"):
            opaque = _opaque(n)
            if opaque:  # a user's function or a leaf module: what it writes and hands back, the graph cannot show
                before = [(a, self.values.get(a.name)) for a in n.all_input_nodes]
                versions = [(a, v._version) for a, v in before if isinstance(v, torch.Tensor) and not v.is_inference()]
            if isinstance(n.target, torch._ops.HigherOrderOperator) or (opaque and n.op == "call_function"):
                # not counted: torch's FlopCounterMode cannot run torch.while_loop, and a torch.cond run under it
                # (in the graph, or inside a torch.fx.wrap'd function) breaks every later eager torch.cond of the
                # process, the user's own members' too ("torch.* op returned non-Tensor")
                out = super().run_node(n)
                self.flops[n.name] = 0
            else:
                counter = _flop_counter()
                with counter:
                    out = super().run_node(n)
                self.flops[n.name] = counter.get_total_flops()
            if opaque:
                self.written += [(n, a) for a, version in versions if self.values[a.name]._version != version]
                outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                self.aliased += [(n, a) for a, v in before if isinstance(v, torch.Tensor)
                                 and any(_same_storage(t, v) for t in outs)]
        else:
            out = super().run_node(n)
        self.values[n.name] = out
        return out


def _opaque(n: torch.fx.Node) -> bool:
    """A node whose body the graph does not show: a torch.fx.wrap'd function of the user's, or a leaf module (not
    one whose `inplace` flag already says it writes)."""
    if n.op == "call_module":
        return not is_inplace(n)
    if n.op != "call_function" or is_inplace(n):
        return False
    module = getattr(n.target, "__module__", None) or ""
    return not (module.startswith(("torch", "_operator", "operator", "builtins", "math", "stagewise"))
                or isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.numel() > 0
    except (RuntimeError, NotImplementedError):
        return False


def _hidden_writes_refusal(gm: torch.fx.GraphModule, rec: "_Recorder") -> str:
    """Why the graph cannot be planned: a user's function or a leaf module writes a tensor it is given in place, or
    hands back one it is given (or a view of it) that the graph then writes: the planner cannot keep the other reads
    of that memory in order with the write it does not see. "" when neither."""
    # a model input written so is found by running member 0 at build (executor.input_writes), with its own message
    written = [(node, arg) for node, arg in rec.written if storage_root(arg, every_module=False).op != "placeholder"]
    if written:
        node, arg = written[0]
        return (f"forward() calls {_readable_target(gm, node)}, which writes the tensor it is given as {arg.name!r} in "
                "place, where the traced graph cannot see it: the plan could not keep the other reads of that tensor "
                f"after the write. Return a new tensor from it (h = h * s, not h.mul_(s)) and use that, or do the write "
                "in forward() itself, outside the wrapped function")
    written_roots = {storage_root(n.args[0]) for n in gm.graph.nodes if is_inplace(n)}
    for node, arg in rec.aliased:
        # leaf modules handing back their input (nn.Identity, Dropout in eval, Flatten) the storage analysis knows;
        # a model input written is found at build (executor.input_writes)
        if node.op == "call_module" or storage_root(arg, every_module=False).op == "placeholder":
            continue
        if storage_root(node) in written_roots or storage_root(arg) in written_roots:
            return (f"forward() calls {_readable_target(gm, node)}, which hands back the tensor it is given as "
                    f"{arg.name!r} (or a view of it), and the graph then writes into that memory in place: the planner "
                    "cannot see that the two share it, and could not keep their reads and writes in order. Return a copy "
                    "from it (x.clone() where it returns its input unchanged), or write a new tensor (h = h * 2)")
    return ""


def _run_and_record(gm: torch.fx.GraphModule, inputs: tuple) -> tuple[dict, dict]:
    rec = _Recorder(gm)
    # gm shares state with the model: every buffer, and the parameters the graph writes in place (an EMA teacher
    # updated in forward()), are put back afterwards, since tracing must not change the model
    written = {str(alias_chain(n.args[0])[-1].target) for n in gm.graph.nodes
               if is_inplace(n) and alias_chain(n.args[0])[-1].op == "get_attr"}
    # and what a region's subgraph may write (export keeps a torch.no_grad() block as a higher-order op)
    written |= {str(a.target) for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)
                for a in n.all_input_nodes if a.op == "get_attr"}
    state = {**{name: p for name, p in gm.named_parameters() if name in written}, **dict(gm.named_buffers())}
    saved = {name: t.detach().clone() for name, t in state.items()}
    try:
        with torch.no_grad():
            rec.run(*inputs)
    except Exception as e:
        if any("flex_attention" in str(n.target) for n in gm.graph.nodes if n.op == "call_function"):
            raise TraceError(
                f"forward() calls flex_attention, whose eager implementation (CPU, outside torch.compile) runs "
                f"torch.vmap inside, which the traced graph cannot run again ({type(e).__name__}: "
                f"{_first_line(e)[:160]}); use F.scaled_dot_product_attention with an attn_mask built from the same "
                "mask function, or run the members as they are") from None
        if "vmapped" in str(e) or any("_functorch" in str(getattr(n.target, "__module__", "")) or "batch_dim" in str(n.target)
                                      for n in gm.graph.nodes if n.op == "call_function"):
            raise TraceError(
                f"forward() calls torch.vmap (or another torch.func transform) itself, which the traced graph keeps as "
                f"calls it cannot run again outside that transform ({type(e).__name__}: {_first_line(e)[:160]}); write "
                "that part with batched tensor ops (a batched matmul, einsum over the extra axis) or keep the transform "
                "outside the model") from None
        raise TraceError(
            f"the traced graph failed on the example inputs: {type(e).__name__}: {_first_line(e)}; "
            "check that example_inputs() matches what forward() expects"
        ) from None
    finally:
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(saved[name])
    hidden = _hidden_writes_refusal(gm, rec)
    if hidden:
        raise TraceError(hidden)
    return rec.values, rec.flops


# --- node descriptions ------------------------------------------------------------

def describe_shape(value: Any) -> str:
    """A short readable shape: tensors as [a, b], containers recursively, scalars by type."""
    if isinstance(value, torch.Tensor):
        return str(list(value.shape))
    if isinstance(value, torch.Size):  # before tuple: Size is a tuple subclass
        return f"Size{list(value)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe_shape(v) for v in value[:6])
        more = ", ..." if len(value) > 6 else ""
        return f"({inner}{more})"
    if value is None:
        return "None"
    return type(value).__name__


def _dtype_of(value: Any) -> str:
    leaves, _ = tree_flatten(value)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return str(leaf.dtype).replace("torch.", "")
    return ""


def _readable_target(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return f"{node.target} ({type(mod).__name__})"
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return str(t)
        return getattr(t, "__name__", str(t))
    return str(node.target)


_EXPORT_PREFIX = re.compile(r"^(L\['self'\]\.?|L__self___?|self\.?)")


def _normalise_module_path(path: str) -> str:
    """'L['self'].layers[0].attn' or 'L__self___layers_0' -> 'layers.0.attn'."""
    path = _EXPORT_PREFIX.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def _module_path(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _normalise_module_path(str(path))


def _params_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    if node.op == "call_module":
        return sum(p.numel() for p in gm.get_submodule(node.target).parameters())
    if node.op == "get_attr":
        value = _attr(gm, node.target)
        if isinstance(value, nn.Parameter):
            return value.numel()
    return 0


def _attr(gm: torch.nn.Module, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _node_signature(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    if node.op == "call_module":
        target = f"{node.target}:{type(gm.get_submodule(node.target)).__name__}"
    else:
        target = node.target if isinstance(node.target, str) else _readable_target(gm, node)
    return f"{node.name} = {node.op} {target}({', '.join(a.name for a in node.all_input_nodes)})"


def fingerprint_lines(gm: torch.fx.GraphModule, opened: Sequence[str] = ()) -> list[str]:
    """What `fingerprint` hashes, one line per node, per state tensor, then per opened module (to show the first difference).

    No line for opened modules when there are none: graphs traced without opening keep their fingerprints.
    """
    lines = [_node_signature(gm, node) for node in gm.graph.nodes]
    lines += [f"state {name}: {list(t.shape)} {t.dtype}" for name, t in sorted(gm.state_dict().items())]
    lines += [f"opened {path}" for path in opened]  # an export graph is the same opened or not; the plan is not
    return lines


def fingerprint(gm: torch.fx.GraphModule, opened: Sequence[str] = ()) -> str:
    """Hash of the graph structure, parameter/buffer shapes (not their values) and the opened module paths."""
    return _hashed(fingerprint_lines(gm, opened))


def _hashed(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def persistence_only(gm: torch.fx.GraphModule, opened: Sequence[str], planned: str) -> str | None:
    """The buffer whose line alone parts `gm`'s fingerprint from `planned`: held in the state_dict here where the
    plan's model kept it out of it (a non-persistent buffer, which copy.deepcopy of a torch.export module registers as
    persistent). The graph and every shape are the same; None where something else differs."""
    lines = fingerprint_lines(gm, opened)
    buffers = {name for name, _ in gm.named_buffers()}
    for i, line in enumerate(lines):
        name = line.removeprefix("state ").rpartition(":")[0] if line.startswith("state ") else None
        if name in buffers and _hashed(lines[:i] + lines[i + 1:]) == planned:
            return name
    return None
