"""Tracing: a model becomes a ModelGraph (an fx GraphModule plus a networkx DAG
with shapes, dtypes, parameter counts, FLOPs and a capability verdict per node).

torch.fx.symbolic_trace is tried first (standard layers stay single call_module
nodes); when it fails, torch.export is used and nodes carry their module path
from `nn_module_stack`. The tracer used and why the first one failed are kept.
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import inspect
import io
import logging
import pickle
import re
import sys
import sysconfig
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Sequence

import networkx as nx
import torch
import torch.fx
import torch.nn.modules.module as torch_module
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from stagewise.planner.capability import alias_chain, annotate_capability, is_inplace
from stagewise.planner.errors import TraceError
from stagewise.planner.inputs import traced_specs
from stagewise.planner.opening import LeafModule, resolve_open_modules, symbolic_trace_opening
from stagewise.planner.plan import InputSpec

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

def fx_or_export(model: nn.Module, example_inputs: tuple, opened: Sequence[str] = ()) -> tuple[torch.fx.GraphModule, str, str]:
    """Trace with torch.fx, falling back to torch.export. Returns (gm, tracer, note).

    The graph takes exactly the inputs `example_inputs` gives: forward() parameters
    after them keep their defaults (see `_fx_trace`). `opened`: module paths fx traces
    inside (planner.opening); export traces inside every module anyway.
    """
    try:
        gm = _fx_trace(model, len(example_inputs), opened)
        return gm, "fx", ""
    except Exception as e:  # fx raises many types for untraceable Python
        fx_error = f"{type(e).__name__}: {_first_line(e)}"
    try:
        gm = _export(model, example_inputs)
    except Exception as e:
        cache = _CACHE_OUTPUT.search(str(e))
        if cache:  # e.g. GPT-2's DynamicCache: a generation cache, not a result to batch
            raise TraceError(
                f"{type(model).__name__} returns a {cache.group(1).rpartition('.')[2]} (a key/value cache for generation) "
                "that neither tracer can carry; build the model with use_cache=False (config.use_cache = False)"
            ) from None
        raise TraceError(
            f"{type(model).__name__} cannot be traced. torch.fx failed: {fx_error}. "
            f"torch.export failed: {type(e).__name__}: {_first_line(e)}. "
            "Remove data-dependent Python control flow from forward() or wrap it with torch.fx.wrap / torch.cond"
        ) from None
    if opened:
        return gm, "export", (f"torch.fx could not trace inside the opened modules {', '.join(opened)} ({fx_error}); "
                              "traced with torch.export, which opens every module")
    return gm, "export", f"torch.fx failed ({fx_error}); traced with torch.export"


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
    with _grad_mode_watch() as turned_off, _inference_mode_as_no_grad(), _RandomWatch() as random_drawn:
        if opened:
            gm = symbolic_trace_opening(model, opened, fixed or None)
        else:
            gm = torch.fx.symbolic_trace(model, concrete_args=fixed or None)
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
    if fixed:
        _drop_concrete_placeholders(gm, fixed)
    return gm


@contextlib.contextmanager
def _grad_mode_watch():
    """Yields a list that gets an entry each time grad mode is turned off while inside (torch.no_grad,
    set_grad_enabled(False): both go through torch._C._set_grad_enabled)."""
    calls: list[bool] = []
    original = torch._C._set_grad_enabled

    def watched(mode: bool) -> None:
        if not mode:
            calls.append(mode)
        original(mode)

    torch._C._set_grad_enabled = watched
    try:
        yield calls
    finally:
        torch._C._set_grad_enabled = original


RANDOM_OPS = frozenset({
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.bernoulli, torch.normal, torch.multinomial, torch.poisson,
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.bernoulli, torch.Tensor.random_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_,
    torch.Tensor.multinomial, torch.nn.functional.dropout, torch.dropout,
})


class _RandomWatch(torch.overrides.TorchFunctionMode):
    """Records random ops that run on concrete values while fx traces (`calls`: their names); ops on fx proxies
    are recorded in the graph and are not listed."""

    def __init__(self):
        super().__init__()
        self.calls: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RANDOM_OPS and not any(isinstance(a, torch.fx.Proxy) for a in tree_flatten((args, kwargs))[0]):
            self.calls.add(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


# --- state the trace cannot see: Python-level random draws and clocks ---------------------------------------
# fx and torch.export run forward()'s Python once: `random.random()`, `np.random.rand()`, `time.time()` are
# evaluated at trace time and their value is baked into the graph, while the member loop draws (reads) anew
# on every call. Such reads are watched while tracing and refused (HostStateError), never traced.

_NOT_DRAWS = frozenset({"seed", "getstate", "setstate", "get_state", "set_state", "default_rng", "get_bit_generator",
                        "set_bit_generator"})
_CLOCKS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
           "process_time", "process_time_ns", "thread_time", "thread_time_ns")
_STDLIB = sysconfig.get_paths()["stdlib"]


class HostStateError(TraceError):
    """forward() reads Python-level random numbers or a clock, which a trace freezes into one constant."""


def _watched_functions() -> dict[int, tuple[Any, str]]:
    """id(function) -> (function, label) for the draws of `random` and `numpy.random` and the clocks of `time`."""
    import random
    import time
    found = {}
    for name in random.__all__:
        f = getattr(random, name, None)
        if callable(f) and not isinstance(f, type) and name not in _NOT_DRAWS:
            found[id(f)] = (f, f"random.{name}")
    for name in _CLOCKS:
        if hasattr(time, name):
            found[id(getattr(time, name))] = (getattr(time, name), f"time.{name}")
    np_random = getattr(sys.modules.get("numpy"), "random", None)  # only when the model's code imported numpy
    if np_random is not None:
        legacy = np_random.mtrand._rand  # the global RandomState behind np.random.rand, np.random.normal, ...
        for name in dir(np_random):
            f = getattr(np_random, name, None)
            if getattr(f, "__self__", None) is legacy and name not in _NOT_DRAWS and not name.startswith("_"):
                found[id(f)] = (f, f"numpy.random.{name}")
    return found


def _rng_state(rng: Any) -> Any:
    """A comparable snapshot of a random generator's state, or None when `rng` is not one."""
    import random
    if isinstance(rng, random.Random):
        return rng.getstate()
    np_random = getattr(sys.modules.get("numpy"), "random", None)
    if np_random is not None and isinstance(rng, (np_random.Generator, np_random.RandomState, np_random.BitGenerator)):
        bits = rng if isinstance(rng, np_random.BitGenerator) else getattr(rng, "bit_generator", None) or rng._bit_generator
        return pickle.dumps(bits.state)
    return None


def _from_model_code(frame: Any) -> bool:
    """Whether `frame` runs the model's code: not torch's, not stagewise's and not the standard library's
    (torch.export times itself with time.perf_counter; logging stamps its records)."""
    module = str(frame.f_globals.get("__name__", ""))
    if module == "torch" or module.startswith(("torch.", "stagewise.", "functorch.")):
        return False
    filename = frame.f_code.co_filename
    return not (filename.startswith(_STDLIB) and "-packages" not in filename)


class _HostStateWatch:
    """While inside: the watched functions (module attributes, and names the model's modules imported with
    `from random import random`) record calls made by the model's code on this thread; random generators held by
    the model's modules or their Python modules, and the global ones, are compared before and after.
    `reads`: sorted labels of what was read."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.calls: set[str] = set()

    def _wrap(self, f: Any, label: str) -> Any:
        owner = threading.get_ident()
        calls = self.calls

        def watched(*args, **kwargs):
            if threading.get_ident() == owner and _from_model_code(sys._getframe(1)):
                calls.add(label)
            return f(*args, **kwargs)
        return watched

    def _namespaces(self) -> list[dict]:
        """The globals of the Python modules defining the model's classes (where `from random import random` lands)."""
        names = {type(m).__module__ for m in self.model.modules()}
        return [vars(sys.modules[n]) for n in sorted(names) if n in sys.modules and not n.startswith("torch.")]

    def __enter__(self) -> "_HostStateWatch":
        import random
        import time
        watched = _watched_functions()
        owners = [vars(random), vars(time)]
        np_random = getattr(sys.modules.get("numpy"), "random", None)
        if np_random is not None:
            owners.append(vars(np_random))
        namespaces = self._namespaces()
        self.patched = []
        for space in owners + namespaces:
            for name, value in list(space.items()):
                hit = watched.get(id(value))
                if hit is not None and hit[0] is value:
                    self.patched.append((space, name, value))
                    space[name] = self._wrap(value, hit[1])
        # generators the watch cannot wrap (a random.Random or numpy Generator held by a module, the global
        # states reached through a helper module's `from random import ...`): compared before and after
        rngs = {"random": random._inst}
        if np_random is not None:
            rngs["numpy.random"] = np_random.mtrand._rand
        for path, mod in self.model.named_modules():
            for k, v in vars(mod).items():
                rngs.setdefault(f"{path + '.' if path else ''}{k}", v)
        for space in namespaces:
            for k, v in space.items():
                rngs.setdefault(f"{space.get('__name__', '?')}.{k}", v)
        self.states = {}
        for label, rng in rngs.items():
            state = _rng_state(rng)
            if state is not None:
                self.states[label] = (rng, state)
        return self

    def __exit__(self, *exc) -> None:
        for space, name, value in reversed(self.patched):
            space[name] = value
        for label, (rng, state) in self.states.items():
            named = any(c.startswith(f"{label}.") for c in self.calls)  # a wrapped call already names it
            if _rng_state(rng) != state and not named:
                self.calls.add(f"{label} (a {type(rng).__module__}.{type(rng).__qualname__}: its state moved)")

    def refusal(self) -> HostStateError | None:
        """The error naming what forward() read, or None when it read nothing watched."""
        if not self.calls:
            return None
        shown = ", ".join(sorted(self.calls)[:4])
        clocks = all(c.startswith("time.") for c in self.calls)
        what = "reads the clock" if clocks else "draws Python-level random numbers"
        fix = ("read the clock outside forward() and pass the value in as an input" if clocks else
               "draw with torch on a tensor instead (torch.rand((), device=x.device) < self.p, "
               "x * torch.empty((), device=x.device).uniform_(0.5, 1.5)), which the trace records and each member draws itself")
        return HostStateError(
            f"{type(self.model).__name__}.forward() {what} ({shown}): torch.fx and torch.export run that Python once "
            f"while tracing and bake its value into the graph as a constant, so every call of every member would reuse "
            f"it where the member loop reads a new one each call. Fix: {fix}")


@contextlib.contextmanager
def _host_state_refused(model: nn.Module):
    """Raise HostStateError after the block when the model's code read a watched random draw or clock inside it
    (that refusal wins over an error the block raised: it is the reason the model cannot be traced faithfully)."""
    watch = _HostStateWatch(model)
    try:
        with watch:
            yield
    finally:
        error = watch.refusal()
        if error is not None:
            raise error from None


class _InferenceModeAsNoGrad:
    """Stands in for torch._C._InferenceMode while tracing: neither fx nor torch.export records
    `torch.inference_mode()` (the batched module would compute gradients the members never make), but both
    see torch.no_grad(), whose region gives the same values and no gradients (fx then falls back to export)."""

    def __init__(self, mode: bool):
        self.inner = torch.no_grad() if mode else contextlib.nullcontext()

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


@contextlib.contextmanager
def _inference_mode_as_no_grad():
    original = torch._C._InferenceMode
    torch._C._InferenceMode = _InferenceModeAsNoGrad
    try:
        yield
    finally:
        torch._C._InferenceMode = original


# --- global module hooks ---------------------------------------------------------------------------------------

_GLOBAL_CALL_HOOKS = {  # torch.nn.modules.module's tables -> the function that fills them
    "_global_forward_pre_hooks": "register_module_forward_pre_hook",
    "_global_forward_hooks": "register_module_forward_hook",
    "_global_backward_pre_hooks": "register_module_full_backward_pre_hook",
    "_global_backward_hooks": "register_module_full_backward_hook",
}
_GLOBAL_REGISTRATION_HOOKS = ("_global_buffer_registration_hooks", "_global_module_registration_hooks",
                              "_global_parameter_registration_hooks")


def _torch_owned(hook: Any) -> bool:
    """torch's own global hooks (FlopCounterMode's module tracker): they only watch."""
    f = getattr(hook, "func", hook)
    return str(getattr(f, "__module__", "")).startswith("torch.")


def global_hooks() -> dict[str, str]:
    """Hooks registered for every module's call ("register_module_forward_hook" -> the hook's name), torch's own left out."""
    found = {}
    for table, api in _GLOBAL_CALL_HOOKS.items():
        for hook in getattr(torch_module, table, {}).values():
            if not _torch_owned(hook):
                found.setdefault(api, getattr(hook, "__qualname__", type(hook).__name__))
    return found


def global_hooks_refusal(who: str) -> str | None:
    """The message refusing global module hooks for `who` (what would run without them), or None when there are none."""
    hooks = global_hooks()
    if not hooks:
        return None
    shown = ", ".join(f"torch.nn.modules.module.{api}: {name}" for api, name in hooks.items())
    return (f"global module hooks are registered ({shown}): the member loop fires them on every call of every module of "
            f"every member, but {who} never calls the members' modules (it would fire them on itself once with N-first "
            "values, and inside stages on vmap-internal values). Remove them (handle.remove()) while planning and running "
            "the batched module, or register a hook on the batched module itself for its N-first outputs")


def global_hooks_present() -> bool:
    """The per-call check: any global call hook at all (four dict truthiness tests); global_hooks() says whose."""
    m = torch_module
    return bool(m._global_forward_pre_hooks or m._global_forward_hooks or m._global_backward_pre_hooks
                or m._global_backward_hooks)


@contextlib.contextmanager
def registration_hooks_off():
    """Global buffer / module / parameter registration hooks held back inside. The members went through them when
    they were made; the modules stagewise makes from them (traced graphs, stacked state) must not go through them
    again (a hook that returns a changed tensor would change the stacked state; one that records would record ours)."""
    held = {}
    for table in _GLOBAL_REGISTRATION_HOOKS:
        hooks = getattr(torch_module, table, None)
        if hooks:
            held[table] = dict(hooks)
            hooks.clear()
    try:
        yield
    finally:
        for table, hooks in held.items():
            getattr(torch_module, table).update(hooks)


def _closes_over_state(f: Any) -> str:
    """What a plain function closes over that a deepcopy of its module would not follow ("a module (Net)", "a tensor"), or ""."""
    for cell in getattr(f, "__closure__", None) or () if isinstance(f, types.FunctionType) else ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, nn.Module):
            return f"a module ({type(v).__name__})"
        if isinstance(v, torch.Tensor):
            return "a tensor"
    return ""


def call_override_refusal(model: nn.Module, who: str) -> str | None:
    """The message refusing a forward replaced on a module instance, a user class overriding __call__, or a function
    attribute closing over a module or tensor (a deepcopy keeps reading the original's), or None.

    fx traces type(root).forward (an instance's forward is ignored) and neither tracer runs a root's __call__; a
    replaced forward that closes over a member's own modules would read member 0's weights for every member."""
    for path, mod in model.named_modules():
        where = f"{who}'s submodule {path} ({type(mod).__name__})" if path else \
            (who if who == type(mod).__name__ else f"{who} ({type(mod).__name__})")
        replaced = [k for k in ("forward", "__call__") if k in vars(mod)]
        if replaced:
            return (f"{where} has {replaced[0]} replaced on the instance (m.{replaced[0]} = ...; a wrapper such as "
                    "accelerate's or torch.compile's): torch.fx traces the class's forward() and ignores it, and a "
                    "replacement that closes over the member's own modules would run member 0's weights for every member. "
                    "Put the code in a subclass's forward() and build the members from it, or remove the replacement "
                    f"(del m.{replaced[0]}; for torch.compile pass the module before compiling)")
        for k, f in vars(mod).items():
            held = _closes_over_state(f)
            if held:
                return (f"{where}'s attribute {k!r} is a function that closes over {held}: stagewise traces and runs "
                        "copies of the members, and a copied module keeps the same function, which goes on reading the "
                        "original's weights (every member would read member 0's, and no gradient reaches the copy). "
                        "Make it a method (def f(self, x): ...) and keep `self.f = self.f_method` if needed, or an nn.Module")
        call = type(mod).__call__
        if call is not nn.Module.__call__ and not str(getattr(call, "__module__", "")).startswith("torch."):
            return (f"{where} overrides __call__ ({type(mod).__qualname__}.__call__): the traced graph "
                    "runs forward() only, so what __call__ adds around it would be dropped or run twice. "
                    "Move that code into forward()")
    return None


def _defaults_not_given(model: nn.Module, given: int | Sequence[str]) -> dict[str, Any]:
    """forward() parameters with a default that `given` (a count or names) does not supply -> their defaults."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a readable signature: trace it as it is
        return {}
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if isinstance(given, int):
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            return {}  # forward(x, *rest, ...): extra positionals go to *rest, nothing to fix
        names = {p.name for p in named[:given]}
    else:
        names = set(given)
    return {p.name: p.default for p in named if p.name not in names and p.default is not p.empty}


def _drop_concrete_placeholders(gm: torch.fx.GraphModule, fixed: dict[str, Any]) -> None:
    """Remove fx's placeholders for `concrete_args` (`mask_1`) and the value checks that are their only users."""
    prefixes = tuple(f"{name}_" for name in fixed)
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and str(n.target).startswith(prefixes)]:
        users = _all_users(node)
        if all(u.op == "call_function" for u in users):  # only fx's `eq`/`_assert` specialisation checks
            for u in reversed(users):
                gm.graph.erase_node(u)
            gm.graph.erase_node(node)
    gm.recompile()


def _all_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Every node that depends on `node`, in graph order."""
    seen: dict[torch.fx.Node, None] = {}
    todo = list(node.users)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen[n] = None
            todo.extend(n.users)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _export(model: nn.Module, example_inputs: tuple) -> torch.fx.GraphModule:
    """torch.export's graph of `model` (non-strict, quiet unless it succeeds), without the input-guard node.

    Every dim of every tensor input is offered to export as dynamic (Dim.AUTO):
    dims the model does not specialise stay symbolic, so the plan accepts other
    batch sizes and sequence lengths; dims it does specialise (a loop over
    x.shape[1]) stay fixed. A model that fails that way is exported static.
    The symbol ranges go to gm.meta["stagewise_ranges"], the guard function stays
    as gm._guards_fn (planner.inputs records and checks what they say).
    """
    args = tuple(example_inputs)
    auto = tree_map(lambda v: {d: torch.export.Dim.AUTO for d in range(v.dim())} if isinstance(v, torch.Tensor) else None, args)
    try:
        with _quiet_on_failure(), _inference_mode_as_no_grad():
            ep = torch.export.export(model, args, dynamic_shapes=auto, strict=False)
    except Exception:  # export raises many types; the static export below reports its own failure
        with _quiet_on_failure(), _inference_mode_as_no_grad():
            ep = torch.export.export(model, args, strict=False)
    gm = ep.module()
    gm.meta["stagewise_ranges"] = {str(sym): _range_of(vr) for sym, vr in ep.range_constraints.items()}
    _drop_guard_nodes(gm)
    _sizes_as_methods(gm)
    return gm


_SYM_QUERIES = {"aten::sym_size.int": "size", "aten::sym_numel": "numel", "aten::sym_stride.int": "stride"}


def _sizes_as_methods(gm: torch.fx.GraphModule) -> None:
    """`aten.sym_size.int(x, 0)` -> `x.size(0)` (same value): vmap has no rule for the aten op, but a
    batched tensor's size() is one member's size. Dynamic dims put these reads in the graph."""
    changed = False
    for node in gm.graph.nodes:
        method = _SYM_QUERIES.get(getattr(node.target, "name", lambda: "")()) if node.op == "call_function" else None
        if method:
            node.op, node.target, changed = "call_method", method, True
    if changed:
        gm.recompile()


def _range_of(vr) -> tuple[int, int | None]:
    """A sympy value range as (min, max or None for unbounded)."""
    lo, hi = _finite_int(vr.lower), _finite_int(vr.upper)
    return max(lo or 0, 0), hi


def _finite_int(v) -> int | None:
    """int(v) for a finite sympy bound, None for +-infinity (torch's int_oo)."""
    try:
        return int(v)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


@contextlib.contextmanager
def _quiet_on_failure():
    """Hold back what torch.export prints; show it only if export succeeds.

    A failed export prints its partial graph to stderr and logs warnings; our
    TraceError already says why, and a CLI user should see one line, not a dump.
    """
    held = io.StringIO()
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        logging.disable(previous)
    sys.stderr.write(held.getvalue())  # reached only on success


def _drop_guard_nodes(gm: torch.fx.GraphModule) -> None:
    """Remove export's input-guard call (it re-checks shapes we check ourselves, and is not batchable)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards") and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


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
    example_inputs = tuple(example_inputs)
    refusal = hooks_refusal(model, type(model).__name__) or global_hooks_refusal("the batched module")
    if refusal:
        raise TraceError(refusal)
    opened = resolve_open_modules(model, open_modules)
    before = StateSnapshot.take(model)
    with registration_hooks_off(), _host_state_refused(model):
        gm, tracer, note = fx_or_export(model, example_inputs, opened)
        changed = before.restore_if_changed(model)
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
    if changed:
        raise TraceError(
            f"forward() changes {changed.describe()} while it is traced, and the traced graph cannot repeat that per member; "
            "keep counters and caches out of forward(), or hold them in a tensor buffer updated in place"
        )
    tensor_attributes = [(mod, k, v) for mod in model.modules() for k, v in vars(mod).items() if isinstance(v, torch.Tensor)]
    values, flops = _run_and_record(gm, example_inputs)
    graph = graph_of(gm, tracer, note, values, flops, opened=opened)
    if probe:
        annotate_capability(graph)
    # the probe ran the model's own modules under vmap: a hook that stores a tensor on its module (the old
    # weight_norm's `weight`) left a vmap-internal tensor there, which no later use of the model can read
    for mod, k, v in tensor_attributes:
        mod.__dict__[k] = v
    return graph


def retrace(model: nn.Module, tracer: str, example_inputs: tuple | None, input_names: Sequence[str] | None = None,
            opened: Sequence[str] = ()) -> ModelGraph:
    """Trace `model` again with the tracer a plan records, structure only (no shapes, no probe).

    `input_names` (the plan's inputs) tells fx which forward() parameters the plan
    takes; without it, the first len(example_inputs) (or all without defaults).
    `opened`: the plan's opened_modules, traced inside again (and part of the fingerprint).
    """
    opened = resolve_open_modules(model, opened)
    with registration_hooks_off(), _host_state_refused(model):
        return _retrace(model, tracer, example_inputs, input_names, opened)


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
    """Build the networkx view of `gm`; shapes and FLOPs come from `values`/`flops` when given; `opened` as traced."""
    values, flops = values or {}, flops or {}
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
        for dep in node.all_input_nodes:
            dag.add_edge(dep.name, node.name)
    for u, v in inplace_order_edges(gm):
        if not dag.has_edge(u, v):
            dag.add_edge(u, v, order=True)
    return ModelGraph(
        gm=gm,
        dag=dag,
        tracer=tracer,
        tracer_note=note,
        input_names=[n.name for n in gm.graph.nodes if n.op == "placeholder"],
        node_names=names,
        fingerprint=fingerprint(gm, opened),
        example_values=values,
        out_spec=getattr(gm, "_out_spec", None) if tracer == "export" else None,
        input_specs=traced_specs(gm, tracer, values),
        input_guard=getattr(gm, "_guards_fn", None) if tracer == "export" else None,
        opened_modules=tuple(opened),
    )


def inplace_order_edges(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """Edges that keep in-place updates in program order.

    fx records `buf.add_(v)` with no edge to later reads of `buf`, so a stage
    reading it could run before the update. Each in-place node gets an edge from
    every earlier and to every later reader of the value it writes (its view
    chain; for module state, every get_attr of the same target). Edges follow
    graph order, so the DAG stays acyclic and node order stays topological.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    edges = []
    for node in nodes:
        if not is_inplace(node):
            continue
        aliases = set(alias_chain(node.args[0]))
        for root in [a for a in aliases if a.op == "get_attr"]:
            aliases |= {n for n in nodes if n.op == "get_attr" and n.target == root.target}
        touched = aliases | {u for a in aliases for u in a.users}
        for other in sorted(touched - {node}, key=pos.__getitem__):
            edges.append((other.name, node.name) if pos[other] < pos[node] else (node.name, other.name))
    return edges


PLAIN_TYPES = (bool, int, float, str, type(None), enum.Enum)
_CONFIG_DEPTH, _CONFIG_ITEMS = 3, 256  # how deep and how wide config dicts and objects are read


def plain_attributes(model: nn.Module) -> dict[str, Any]:
    """Python-number/string/enum attributes of every submodule ("act.negative_slope": 0.1), private ones and `training`
    left out, and those inside config dicts and plain objects the modules hold ("cfg['act']": "gelu", "config.scale": 2.0).

    These are what tracing bakes into the graph as constants. Tuples and lists of
    plain values count as plain.
    """
    out: dict[str, Any] = {}
    for path, mod in model.named_modules():
        for k, v in vars(mod).items():
            if not k.startswith("_") and k != "training":
                _collect_plain(f"{path}.{k}" if path else k, v, out, _CONFIG_DEPTH, set())
    return out


def _is_plain(v: Any) -> bool:
    return isinstance(v, PLAIN_TYPES) or (isinstance(v, (tuple, list)) and all(isinstance(x, PLAIN_TYPES) for x in v))


def _collect_plain(key: str, v: Any, out: dict[str, Any], depth: int, seen: set[int]) -> None:
    """Plain `v` as out[key]; a config dict's or plain object's plain entries as out[key['k']] / out[key.k], `depth` levels down."""
    if _is_plain(v):
        out[key] = v
        return
    if depth == 0 or id(v) in seen or isinstance(v, (nn.Module, torch.Tensor, type, types.ModuleType)) or callable(v):
        return
    if isinstance(v, dict):
        items = [(f"{key}[{k!r}]", x) for k, x in v.items() if isinstance(k, (str, int)) and not str(k).startswith("_")]
    elif hasattr(v, "__dict__"):  # a config object: a dataclass, a Namespace, a transformers config
        items = [(f"{key}.{k}", x) for k, x in vars(v).items() if not k.startswith("_")]
    else:
        return
    if len(items) > _CONFIG_ITEMS:
        return
    seen = seen | {id(v)}
    for k, x in items:
        _collect_plain(k, x, out, depth - 1, seen)


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _state_driven_hook_types() -> tuple[type, ...]:
    """torch's own hooks that compute from the module's state alone (the old weight_norm / spectral_norm):
    a leaf module's hooks run with the module in every strategy that calls it, so these give each member its own."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    return SpectralNorm, WeightNorm


def module_hooks(model: nn.Module) -> dict[str, str]:
    """Hooks the batched module cannot repeat per member: "path (kind)" -> what the hook is.

    A hook on the root module never reaches a traced graph (fx traces forward(), not the call); a hook
    on a submodule runs member 0's function (its closure, its captures) for every member, or is traced into
    the graph with member 0's values. torch's own state-driven weight_norm / spectral_norm hooks are left
    out below the root (their config is compared like any other attribute, see hook_configs)."""
    state_driven = _state_driven_hook_types()
    found = {}
    for path, mod in model.named_modules():
        for table in _HOOK_TABLES:
            for hook in getattr(mod, table, {}).values():
                if path and isinstance(hook, state_driven):
                    continue
                if not path and str(getattr(hook, "__module__", "")).startswith("torch.export."):
                    continue  # a loaded torch.export archive's own input check and state sync (the trace keeps the check)
                kind = table.strip("_").replace("_hooks", " hook").replace("_", " ")
                found[f"{path or type(model).__name__} ({kind})"] = getattr(hook, "__qualname__", type(hook).__name__)
    return found


def hook_configs(model: nn.Module) -> tuple:
    """The state-driven hooks module_hooks leaves out, with their settings (members must agree on them)."""
    state_driven = _state_driven_hook_types()
    return tuple((path, table, type(h).__name__, tuple(sorted((k, repr(v)) for k, v in vars(h).items())))
                 for path, mod in model.named_modules() for table in _HOOK_TABLES
                 for h in getattr(mod, table, {}).values() if isinstance(h, state_driven))


def hooks_refusal(model: nn.Module, who: str) -> str | None:
    """The message refusing `model`'s hooks (module_hooks), torch.jit-scripted submodules, or a forward / __call__
    the trace cannot see (call_override_refusal), or None when it has none of them."""
    scripted = [path for path, mod in model.named_modules() if path and isinstance(mod, torch.jit.ScriptModule)]
    if scripted:
        return (f"{who} holds torch.jit-scripted submodule(s) {', '.join(repr(p) for p in scripted[:3])}: a scripted module "
                "runs its own compiled copy of the weights, so each member's weights cannot be put in for it "
                "(every member would run member 0's); build the members from the plain nn.Modules, without torch.jit.script")
    overridden = call_override_refusal(model, who)
    if overridden:
        return overridden
    hooks = module_hooks(model)
    if not hooks:
        return None
    shown = ", ".join(f"{k}: {v}" for k, v in list(hooks.items())[:3])
    return (f"{who} has module hooks ({shown}{', ...' if len(hooks) > 3 else ''}) that a traced graph cannot run per member: "
            "a hook on the model itself is never traced, and one on a submodule would run member 0's hook for every member. "
            "Remove the hooks before planning (handle.remove()) and put what they do into forward(), or run the hooks' "
            "work on the batched module's outputs")


@dataclass
class StateChange:
    """What tracing changed on the real module."""

    tensors: list[str]
    attributes: list[str]

    def __bool__(self) -> bool:
        return bool(self.tensors or self.attributes)

    def describe(self) -> str:
        parts = [f"state {', '.join(repr(t) for t in self.tensors[:3])}" if self.tensors else "",
                 f"attribute(s) {', '.join(repr(a) for a in self.attributes[:3])}" if self.attributes else ""]
        return " and ".join(p for p in parts if p)


@dataclass
class StateSnapshot:
    """A copy of a module's parameters, buffers and plain attributes, to see (and undo) what tracing changed."""

    tensors: dict[str, torch.Tensor]
    versions: dict[str, int]  # autograd version counters: an in-place op that leaves the values alone still counts
    attributes: dict[str, Any]

    @staticmethod
    def take(model: nn.Module) -> "StateSnapshot":
        live = dict([*model.named_parameters(), *model.named_buffers()])
        with torch.no_grad():
            tensors = {k: t.detach().clone() for k, t in live.items()}
        return StateSnapshot(tensors, {k: t._version for k, t in live.items()}, copy_plain(plain_attributes(model)))

    def restore_if_changed(self, model: nn.Module) -> StateChange:
        """Compare with `model` now; put changed tensors back. Returns what had changed."""
        now = dict([*model.named_parameters(), *model.named_buffers()])
        changed = [k for k, t in self.tensors.items()
                   if k in now and (now[k]._version != self.versions[k] or not _same_tensor(now[k], t))]
        with torch.no_grad():
            for k in changed:
                now[k].copy_(self.tensors[k])
                self.versions[k] = now[k]._version  # the copy back is not a change of the next step
        attrs = plain_attributes(model)
        moved = [k for k in self.attributes.keys() | attrs.keys() if self.attributes.get(k) != attrs.get(k)]
        return StateChange(changed, sorted(moved))


def copy_plain(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, list) else v for k, v in attrs.items()}


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN equal to NaN: an untouched NaN buffer is not a change)."""
    a = a.detach()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    return bool(torch.equal(a, b))


class _Recorder(torch.fx.Interpreter):
    """Runs the graph once, keeping every node's value and FLOPs."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, Any] = {}
        self.flops: dict[str, int] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("call_module", "call_function", "call_method"):
            counter = FlopCounterMode(display=False)
            with counter:
                out = super().run_node(n)
            self.flops[n.name] = counter.get_total_flops()
        else:
            out = super().run_node(n)
        self.values[n.name] = out
        return out


def _run_and_record(gm: torch.fx.GraphModule, inputs: tuple) -> tuple[dict, dict]:
    rec = _Recorder(gm)
    buffers = {name: b.clone() for name, b in gm.named_buffers()}  # gm shares state with the model
    try:
        with torch.no_grad():
            rec.run(*inputs)
    except Exception as e:
        raise TraceError(
            f"the traced graph failed on the example inputs: {type(e).__name__}: {_first_line(e)}; "
            "check that example_inputs() matches what forward() expects"
        ) from None
    finally:
        with torch.no_grad():  # undo in-place buffer updates: tracing must not change the model
            for name, b in gm.named_buffers():
                b.copy_(buffers[name])
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
    return hashlib.sha256("\n".join(fingerprint_lines(gm, opened)).encode()).hexdigest()[:16]
