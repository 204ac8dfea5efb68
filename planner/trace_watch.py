"""What watches a trace and refuses what it cannot record (planner.graph runs fx and torch.export inside these).

fx and torch.export run forward()'s Python once, on the real module. Watched while they do:
grad mode turned off (`_grad_mode_watch`: torch.no_grad / set_grad_enabled(False) leave no fx node),
torch random ops on concrete values (`RANDOM_OPS`, `_RandomWatch`: fx bakes the draw in as a constant),
Python-level random draws and clock reads (`_HostStateWatch`, `_host_state_refused`: random, numpy.random,
generators the model holds, time; refused with HostStateError), torch.inference_mode(), traced as a
no_grad region (`_inference_mode_as_no_grad`), and augmented assignments to a model input (`x += 1`, which fx
records as an out-of-place `x + 1`; `_input_writes_recorded` records the write), and autograd hooks set in forward()
(`h.register_hook`, saved_tensors_hooks: no graph holds them; `_autograd_hooks_refused`).
"""
from __future__ import annotations

import contextlib
import functools
import operator
import pickle
import sys
import sysconfig
import threading
import types
from typing import Any, Callable

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten

from stagewise.planner.capability import ALWAYS_VIEWS, VIEW_NAMES, alias_chain, base_name, is_inplace
from stagewise.planner.errors import TraceError


# The watches here replace process-wide functions (torch._C._set_grad_enabled, torch._C._InferenceMode, torch.fx.Proxy's
# augmented assignments, the functions of random / numpy.random / time) and put them back on the way out. Two threads
# tracing at once (the UI runs each session in a thread) would put them back out of order and leave one watch installed
# for good: one trace at a time holds this lock (re-entrant: the watches nest), and each records its own thread only.
_PATCHING = threading.RLock()


@contextlib.contextmanager
def _grad_mode_watch():
    """Yields a list that gets an entry each time grad mode is turned off while inside (torch.no_grad,
    set_grad_enabled(False): both go through torch._C._set_grad_enabled)."""
    calls: list[bool] = []
    owner = threading.get_ident()
    with _PATCHING:
        original = torch._C._set_grad_enabled

        def watched(mode: bool) -> None:
            if not mode and threading.get_ident() == owner:  # another thread's no_grad is not forward()'s
                calls.append(mode)
            original(mode)

        try:
            torch._C._set_grad_enabled = watched
            yield calls
        finally:
            torch._C._set_grad_enabled = original


# a tensor's autograd state, which fx gives as a proxy (`h.grad_fn is not None` holds whatever h is)
GRAD_STATE = {"requires_grad": "a tensor's requires_grad", "grad_fn": "a tensor's grad_fn", "is_leaf": "a tensor's is_leaf",
              "grad": "a tensor's .grad", "is_inference": "a tensor's is_inference()"}


@contextlib.contextmanager
def _grad_state_proxied():
    """Yields a set that gets GRAD_STATE's label of each such attribute the model's code reads from a torch.fx proxy
    while inside (the read records no node until the proxy is used, and a branch on it never fails)."""
    reads: set[str] = set()
    owner = threading.get_ident()
    with _PATCHING:
        original = torch.fx.Proxy.__getattr__

        def watched(self, name: str):
            if name in GRAD_STATE and threading.get_ident() == owner and _from_model_code(sys._getframe(1)):
                reads.add(GRAD_STATE[name])
            return original(self, name)

        try:
            torch.fx.Proxy.__getattr__ = watched
            yield reads
        finally:
            torch.fx.Proxy.__getattr__ = original


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


_SEEDING = ("manual_seed", "seed", "set_rng_state", "manual_seed_all", "set_rng_state_all")


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
    for owner, prefix in ((torch, "torch"), (torch.random, "torch.random"), (torch.cuda, "torch.cuda")):
        for name in _SEEDING:  # a reseed in forward() runs once while traced: the graph's draws go on unseeded
            if callable(getattr(owner, name, None)):
                found.setdefault(id(getattr(owner, name)), (getattr(owner, name), f"{prefix}.{name}"))
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
    if isinstance(rng, torch.Generator):  # drawn from at trace time (a static shape): fx bakes the draw in
        return bytes(rng.get_state().tolist())
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
        _PATCHING.acquire()
        self.patched = []
        try:
            self._enter()
        except BaseException:  # a failure or Ctrl-C half way: nothing stays patched, the lock is let go
            self._restore()
            raise
        return self

    def _enter(self) -> None:
        import random
        import time
        watched = _watched_functions()
        owners = [vars(random), vars(time), vars(torch), vars(torch.random), vars(torch.cuda)]
        np_random = getattr(sys.modules.get("numpy"), "random", None)
        if np_random is not None:
            owners.append(vars(np_random))
        namespaces = self._namespaces()
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

    def _restore(self) -> None:
        """Put the wrapped functions back and let the lock go."""
        try:
            for space, name, value in reversed(self.patched):
                space[name] = value
        finally:
            _PATCHING.release()

    def __exit__(self, *exc) -> None:
        self._restore()
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
        seeds = [c for c in self.calls if c.startswith("torch.")]
        if seeds:
            shown = ", ".join(sorted(seeds)[:4])
            return HostStateError(
                f"{type(self.model).__name__}.forward() seeds torch's random number generator ({shown}): torch.fx and "
                "torch.export run that Python once while tracing and record no reseed, so the batched module's draws "
                "would go on unseeded where each member's call in the loop starts from its seed. Fix: seed outside "
                "forward() (before the call), or draw the noise outside and pass it in as an input")
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
    owner = threading.get_ident()
    with _PATCHING:
        original = torch._C._InferenceMode

        def stand_in(mode: bool) -> Any:  # other threads keep torch's inference mode
            return _InferenceModeAsNoGrad(mode) if threading.get_ident() == owner else original(mode)

        try:
            torch._C._InferenceMode = stand_in
            yield
        finally:
            torch._C._InferenceMode = original


# the augmented assignments torch.fx.Proxy has no method for: Python falls back to `x = x + y`, which the graph
# records. Each maps to its in-place operator and the out-of-place one Python falls back to.
_AUGMENTED = {"__iadd__": (operator.iadd, operator.add), "__isub__": (operator.isub, operator.sub),
              "__imul__": (operator.imul, operator.mul), "__itruediv__": (operator.itruediv, operator.truediv),
              "__ifloordiv__": (operator.ifloordiv, operator.floordiv), "__imod__": (operator.imod, operator.mod),
              "__ipow__": (operator.ipow, operator.pow), "__iand__": (operator.iand, operator.and_),
              "__ior__": (operator.ior, operator.or_), "__ixor__": (operator.ixor, operator.xor)}

# ops whose result may share storage with their first argument (views, in-place ops, modules such as nn.Identity,
# dtype/device moves that may return the tensor itself). Broad on purpose: a value wrongly counted as an alias
# only makes a write be recorded in place, which is what eager does anyway
_MAY_ALIAS = set(VIEW_NAMES) | ALWAYS_VIEWS | {
    "chunk", "split", "unbind", "tensor_split", "split_with_sizes", "hsplit", "vsplit", "dsplit", "movedim", "moveaxis",
    "swapaxes", "swapdims", "diagonal", "unfold", "view_as_real", "view_as_complex", "real", "imag", "contiguous", "to",
    "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "cpu", "cuda", "expand_as", "reshape_as",
    "broadcast_to", "ravel", "atleast_1d", "atleast_2d", "atleast_3d", "adjoint", "requires_grad_", "getattr",
    "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "positive",
    "broadcast_tensors", "identity", "clone_if_needed", "as_tensor", "resolve_conj", "resolve_neg", "align_as"}
_NOT_TENSORS = ("shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout")


class AugmentedWrites:
    """The augmented assignments (`h += y`) fx traced inside `_input_writes_recorded`.

    On a model input or a state tensor (a view of a placeholder or get_attr) they are recorded in place
    (operator.iadd). On an intermediate they are recorded as Python's fallback `h = h + y` (what fx records
    without this watch), which is the same only while nothing else sees the old `h`: `a = h[:, :2]; h += y;
    return a`, `outs.append(h); h += y`, or an explicit `h.__iadd__(y)` whose result is dropped read the
    written tensor in eager. `observed(gm)` finds such sites; added to `in_place_sites`, the next trace records
    them in place too. Sites are source lines (filename, line), the same in every trace of the model."""

    def __init__(self) -> None:
        # (site, old value, the out-of-place result, the cast back to the old value's dtype or None)
        self.out_of_place: list[tuple[tuple[str, int], torch.fx.Node, torch.fx.Node, torch.fx.Node | None]] = []
        self.in_place_sites: set[tuple[str, int]] = set()

    def observed(self, gm: torch.fx.GraphModule) -> set[tuple[str, int]]:
        """The sites in `gm` recorded out of place whose old value, or a value that may share its storage, is read
        after the write; fx's out-of-place record then hands that reader the unwritten tensor."""
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        found = set()
        for site, old, new, cast in self.out_of_place:
            if site in self.in_place_sites or old not in order or new not in order:
                continue
            own = (new, cast)  # the write itself reads the old value, and so does its cast back to the old dtype
            sharers = storage_sharers(storage_root(old), skip=own)
            if any(order[u] > order[new] for a in sharers for u in a.users if u not in own):
                found.add(site)
        return found


# modules that may hand back the tensor they are given (Dropout in eval or at p=0, Flatten's view); storage_root
# with every_module=False treats only these so, and every other module's result as new memory
_PASSING_MODULES = (torch.nn.Identity, torch.nn.modules.dropout._DropoutNd, torch.nn.Flatten, torch.nn.Unflatten)


def _may_alias(node: torch.fx.Node, every_module: bool = True) -> bool:
    """Whether `node`'s result may share storage with its first argument (see _MAY_ALIAS)."""
    name = base_name(node)
    if name == "getattr" and len(node.args) > 1 and node.args[1] in _NOT_TENSORS:
        return False
    if node.op == "call_module":
        if every_module or is_inplace(node):  # nn.ReLU(inplace=True) hands back the tensor it wrote
            return True
        owner = node.graph.owning_module
        try:
            return isinstance(owner.get_submodule(str(node.target)), _PASSING_MODULES) if owner is not None else True
        except AttributeError:
            return True
    return name in _MAY_ALIAS or is_inplace(node)


def storage_root(node: torch.fx.Node, every_module: bool = True) -> torch.fx.Node:
    """The value `node` may share storage with furthest back: through views, dtype and device moves that may return
    the tensor itself (`.float()` of a float), and modules (nn.Identity, Dropout in eval; with every_module=False
    only those of _PASSING_MODULES), up to 64 steps."""
    for _ in range(64):
        first = node.args[0] if node.op in ("call_function", "call_method", "call_module") and node.args else None
        if not isinstance(first, torch.fx.Node) or not _may_alias(node, every_module):
            return node
        node = first
    return node


def storage_sharers(root: torch.fx.Node, every_module: bool = True, skip: tuple = ()) -> list[torch.fx.Node]:
    """`root` and every value that may share its storage (see _MAY_ALIAS; modules as in storage_root), following
    users forward; not through the nodes in `skip`."""
    seen, todo = {root}, [root]
    while todo:
        for u in todo.pop().users:
            if u not in seen and u not in skip and _may_alias(u, every_module):
                seen.add(u)
                todo.append(u)
    return list(seen)


def _augmented(ops: tuple[Any, Any], owner: int, writes: AugmentedWrites) -> Any:
    in_place, plain = ops

    def augmented(self: torch.fx.Proxy, other: Any) -> Any:
        if threading.get_ident() != owner:
            return NotImplemented  # another thread's trace: Python's fallback, as without the watch
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        if alias_chain(self.node)[-1].op in ("placeholder", "get_attr") or site in writes.in_place_sites:
            return self.tracer.create_proxy("call_function", in_place, (self, other), {})
        result = plain(self, other)  # `h += y` on an intermediate: `h + y`, as fx records it without this watch
        if not isinstance(result, torch.fx.Proxy):
            return result
        cast = None
        if isinstance(other, torch.fx.Proxy) and not _number_like(self.node) and not _number_like(other.node):
            # a tensor on the right may promote (bf16 `h += p` with a float32 p): `h + y` is float32 where the
            # in-place write keeps h's dtype, rounding the sum to it. type_as(h) is that rounding, and nothing
            # where the dtypes agree (the graph is the same whatever dtypes a later run has)
            cast = result.type_as(self)
        writes.out_of_place.append((site, self.node, result.node, cast.node if cast is not None else None))
        return cast if cast is not None else result
    return augmented


# values that are numbers, not tensors, in a traced graph: sizes and their arithmetic (`n = x.shape[0]; n += k`)
_NUMBER_METHODS = {"size", "dim", "numel", "nelement", "item", "tolist", "stride", "storage_offset", "element_size",
                   "__len__", "ndimension", "get_device"}
_NUMBER_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
                      operator.pow, operator.neg, operator.pos, operator.getitem, max, min, int, float, abs, round}


def _number_like(node: torch.fx.Node, depth: int = 0) -> bool:
    """Whether `node` surely holds a number or a size (x.shape[0], x.size(1) * 2, len(x)) rather than a tensor."""
    if depth > 32:
        return False
    if node.op == "call_method":
        return node.target in _NUMBER_METHODS
    if node.op != "call_function":
        return False
    if node.target is len or (node.target is getattr and len(node.args) > 1 and node.args[1] in _NOT_TENSORS):
        return True
    if node.target in _NUMBER_ARITHMETIC:
        proxied = [a for a in node.args if isinstance(a, torch.fx.Node)]
        return bool(proxied) and all(_number_like(a, depth + 1) for a in proxied)
    return False


@contextlib.contextmanager
def _input_writes_recorded():
    """While inside, fx records `x += y` on a model input or state tensor (or a view of one) as operator.iadd, an
    in-place node: at run time forward() writes the caller's tensor there, which the default out-of-place
    `x + y` hides. Yields the AugmentedWrites that says which writes to intermediates must be recorded in place."""
    owner = threading.get_ident()
    writes = AugmentedWrites()
    with _PATCHING:
        saved = {name: vars(torch.fx.Proxy).get(name) for name in _AUGMENTED}
        try:
            for name, ops in _AUGMENTED.items():
                setattr(torch.fx.Proxy, name, _augmented(ops, owner, writes))
            yield writes
        finally:
            for name, method in saved.items():
                if method is None:
                    if name in vars(torch.fx.Proxy):
                        delattr(torch.fx.Proxy, name)
                else:
                    setattr(torch.fx.Proxy, name, method)


# --- custom autograd.Functions ----------------------------------------------------------------------------------
# fx runs `MyFn.apply(x)` on proxies: the C apply calls MyFn.forward with them, and the graph records the forward's
# ops alone. The backward the Function defines (a straight-through estimator, a gradient reversal) is lost, and
# every strategy would train with the gradient of the forward's ops instead, without a word. While fx traces, a call
# of a Function's apply on proxies is recorded as one node, `apply_autograd_function("module.Qualname#k", *args)`,
# which calls the Function itself: vmap batches it where the Function says how (setup_context with a vmap
# staticmethod or generate_vmap_rule), else its stage runs member by member, each member through its own backward.

_FUNCTIONS: dict[str, type] = {}  # key -> the Function class, for the graphs of this process (see function_key)
_FUNCTION_KEYS: dict[type, str] = {}


def function_key(cls: type) -> str:
    """The name a graph calls the autograd.Function `cls` by: "module.Qualname", with "#k" when another class of
    this process has that name (two model files defining `class RoundSTE` each)."""
    if cls in _FUNCTION_KEYS:
        return _FUNCTION_KEYS[cls]
    key = f"{cls.__module__}.{cls.__qualname__}"
    if key in _FUNCTIONS:
        key = f"{key}#{sum(k.split('#')[0] == key for k in _FUNCTIONS)}"
    _FUNCTIONS[key] = cls
    _FUNCTION_KEYS[cls] = key
    return key


def _function_of(key: str) -> type:
    cls = _FUNCTIONS.get(key)
    if cls is not None:
        return cls
    import importlib

    parts = key.partition("#")[0].split(".")  # another process (a pickled plan): import it
    found: Any = None
    for split in range(len(parts) - 1, 0, -1):  # the longest importable module prefix, then attributes
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for name in parts[split:]:
                found = getattr(found, name)
        except AttributeError:
            found = None
        break
    if not (isinstance(found, type) and issubclass(found, torch.autograd.Function)) and parts[0].startswith("_stagewise_model_"):
        # a model file's module is named per load (planner.source): the same file loaded in this process holds it
        stem = parts[0].rsplit("_", 2)[0] + "_"
        for name, module in list(sys.modules.items()):
            if name.startswith(stem) and name.count("_") == parts[0].count("_"):
                candidate: Any = module
                for attr in parts[1:]:
                    candidate = getattr(candidate, attr, None)
                if isinstance(candidate, type) and issubclass(candidate, torch.autograd.Function):
                    found = candidate
                    break
    if not (isinstance(found, type) and issubclass(found, torch.autograd.Function)):
        where = ("in a model file this process has not loaded: load it first (planner.load_model_file)"
                 if parts[0].startswith("_stagewise_model") else
                 "inside a function or in a script run as __main__: define it at the top level of an importable module")
        raise TraceError(f"the graph calls the autograd.Function {key.split('#')[0]}, which this process cannot find "
                         f"(it was defined {where}), or trace the model again in this process")
    _FUNCTIONS[key] = found
    return found


def apply_autograd_function(key: str, *args: Any, **kwargs: Any) -> Any:
    """`Function.apply(*args, **kwargs)` of the autograd.Function a graph names by `key` (see function_key)."""
    return _function_of(key).apply(*args, **kwargs)


# arguments a graph node can hold besides other nodes
_GRAPH_CONSTANTS = (int, float, bool, complex, str, type(None), type(Ellipsis), slice, torch.dtype, torch.device,
                    torch.layout, torch.memory_format, torch.Size)


def own_backward(cls: type) -> bool:
    """Whether the autograd.Function `cls` is a user's, whose backward may differ from its forward's derivative
    (torch's own, such as reentrant checkpointing's, recompute or restate it)."""
    return not (cls.__module__ == "torch" or cls.__module__.startswith("torch."))


@contextlib.contextmanager
def _autograd_functions_kept():
    """While inside, `SomeFunction.apply(...)` with an fx proxy among its arguments is recorded as one graph node
    calling the Function (apply_autograd_function), not as the ops of its forward. Yields the set of the Functions
    that could not be (an argument a graph cannot hold, such as a callable): those are traced through, and their
    backward is lost (build refuses training on such a graph)."""
    owner = threading.get_ident()
    inlined: set[str] = set()

    def make(plain: Callable) -> Callable:
        def apply(cls, *args, **kwargs):
            leaves = tree_flatten((args, kwargs))[0]
            proxies = [a for a in leaves if isinstance(a, torch.fx.Proxy)]
            if not proxies or threading.get_ident() != owner or not own_backward(cls):
                return plain(cls, *args, **kwargs)
            if _marks_dirty(cls) or not all(isinstance(a, (torch.fx.Proxy, torch.Tensor, *_GRAPH_CONSTANTS)) for a in leaves):
                # an argument no graph holds; or a Function writing its inputs (ctx.mark_dirty), whose write one
                # opaque node would hide from the ordering of later reads: traced through, its ops recorded
                inlined.add(f"{cls.__module__}.{cls.__qualname__}")
                return plain(cls, *args, **kwargs)
            return proxies[0].tracer.create_proxy("call_function", apply_autograd_function, (function_key(cls), *args),
                                                  kwargs, name=_node_name(cls))
        return apply

    with _function_apply_replaced(make):
        yield inlined


@contextlib.contextmanager
def _function_apply_replaced(make: Callable[[Callable], Callable]):
    """While inside, torch.autograd.Function.apply is `make(apply)`: a function of (cls, *args, **kwargs) given
    torch's own apply to call."""
    with _PATCHING:
        original = vars(torch.autograd.Function)["apply"]
        try:
            torch.autograd.Function.apply = classmethod(make(original.__func__))
            yield
        finally:
            torch.autograd.Function.apply = original


def _marks_dirty(cls: type) -> bool:
    """Whether the Function's forward or setup_context calls ctx.mark_dirty (it writes an input in place)."""
    todo = [getattr(getattr(cls, name, None), "__code__", None) for name in ("forward", "setup_context")]
    while todo:
        code = todo.pop()
        if code is None:
            continue
        if "mark_dirty" in code.co_names:
            return True
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return False


def _node_name(cls: type) -> str:
    """A graph node name for a call of `cls` (RoundSTE -> round_ste)."""
    import re

    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", cls.__name__).lower() or "autograd_function"


@contextlib.contextmanager
def _autograd_functions_seen():
    """Yields a set that gets the name of each autograd.Function whose apply runs while inside (this thread):
    torch.export records the ops of such a Function's forward, and its own backward is lost."""
    owner = threading.get_ident()
    seen: set[str] = set()

    def make(plain: Callable) -> Callable:
        def apply(cls, *args, **kwargs):
            # reentrant checkpointing runs its region under no_grad and recomputes it in its backward: export keeps
            # the region with gradients off
            if threading.get_ident() == owner and (own_backward(cls) or cls.__qualname__ == "CheckpointFunction"):
                seen.add(f"{cls.__module__}.{cls.__qualname__}")
            return plain(cls, *args, **kwargs)
        return apply

    with _function_apply_replaced(make):
        yield seen


_ABSENT = object()


def _tensor_grad_state(reads: set[str], owner: int, force: dict[str, bool]) -> dict[str, Any]:
    """Attributes for torch.Tensor (shadowing torch._C.TensorBase's own while a trace runs) that record when the
    model's code reads a tensor's `requires_grad`, `grad_fn`, `is_leaf` or `is_inference()`: a branch on them takes
    the side of the mode traced in. Under `force` saying gradients are off, they answer as in such a call: a tensor
    an op made records no gradient (grad_fn None, a leaf, requires_grad False); a leaf keeps its own flag; and under
    inference mode the op's result is an inference tensor."""
    base = vars(torch._C.TensorBase)
    requires_grad, grad_fn, is_leaf, is_inference = (base[k] for k in ("requires_grad", "grad_fn", "is_leaf", "is_inference"))
    off = force.get("torch.is_grad_enabled") is False
    inference = bool(force.get("torch.is_inference_mode_enabled"))

    def seen(label: str) -> bool:
        """Whether a read by the model's code is to answer as `force` says (recorded either way)."""
        if threading.get_ident() != owner or not _from_model_code(sys._getframe(2)):
            return False
        reads.add(label)
        return off

    def made_by_an_op(t: torch.Tensor) -> bool:
        return grad_fn.__get__(t) is not None

    def get_requires_grad(t):
        if seen("a tensor's requires_grad") and made_by_an_op(t):
            return False
        return requires_grad.__get__(t)

    def get_grad_fn(t):
        return None if seen("a tensor's grad_fn") else grad_fn.__get__(t)

    def get_is_leaf(t):
        return True if seen("a tensor's is_leaf") else is_leaf.__get__(t)

    def ask_is_inference(t):
        if seen("a tensor's is_inference()") and inference and made_by_an_op(t):
            return True
        return is_inference(t)

    return {"requires_grad": property(get_requires_grad, requires_grad.__set__, doc=requires_grad.__doc__),
            "grad_fn": property(get_grad_fn, doc=grad_fn.__doc__), "is_leaf": property(get_is_leaf, doc=is_leaf.__doc__),
            "is_inference": ask_is_inference}


@contextlib.contextmanager
def _grad_mode_reads(model: nn.Module, force: dict[str, bool] | None = None):
    """Yields a set that gets "torch.is_grad_enabled" / "torch.is_inference_mode_enabled" when the model's code calls
    them inside: a trace keeps the branch the mode at trace time takes, which a call in another mode would run where
    the member loop takes the other. Watched where the model's code can reach them: the torch module and torch._C,
    the names any loaded module outside torch imported (`from torch import is_grad_enabled`), and the model classes'
    own attributes (a staticmethod of one). `force` ({label: value}): what such a call from the model's code returns
    instead (the grad mode a call would have, traced without changing the mode torch runs the trace in)."""
    reads: set[str] = set()
    owner = threading.get_ident()
    force = force or {}
    watched = {id(f): (f, f"torch.{f.__name__}") for f in (torch.is_grad_enabled, torch.is_inference_mode_enabled)}

    def wrap(f: Any, label: str) -> Any:
        def read(*args, **kwargs):
            if threading.get_ident() == owner and _from_model_code(sys._getframe(1)):
                reads.add(label)
                if label in force:
                    return force[label]
            return f(*args, **kwargs)
        return read

    spaces = [vars(torch), vars(torch._C)] + [vars(m) for name, m in list(sys.modules.items())
                                             if m is not None and not name.startswith(("torch", "stagewise", "functorch"))
                                             and getattr(m, "__file__", None) and not str(m.__file__).startswith(_STDLIB)]
    classes = {c for m in model.modules() for c in type(m).__mro__ if not c.__module__.startswith("torch")}
    patched: list[tuple[Any, str, Any]] = []
    with _PATCHING:
        try:
            for name, attribute in _tensor_grad_state(reads, owner, force).items():
                patched.append((torch.Tensor, name, _ABSENT))
                setattr(torch.Tensor, name, attribute)
            for space in spaces:
                for name, value in list(space.items()):
                    hit = watched.get(id(value))
                    if hit is not None and hit[0] is value:
                        patched.append((space, name, value))
                        space[name] = wrap(value, hit[1])
            for cls in classes:
                for name, value in list(vars(cls).items()):
                    hit = watched.get(id(getattr(value, "__func__", value)))
                    if hit is not None:
                        patched.append((cls, name, value))
                        setattr(cls, name, staticmethod(wrap(hit[0], hit[1])))
            yield reads
        finally:
            for space, name, value in reversed(patched):
                if isinstance(space, dict):
                    space[name] = value
                elif value is _ABSENT:
                    delattr(space, name)
                else:
                    setattr(space, name, value)


# --- autograd hooks set inside forward() --------------------------------------------------------------------------
# `h.register_hook(lambda g: -lam * g)` (a gradient reversal, DANN; a gradient scale) and
# `with torch.autograd.graph.saved_tensors_hooks(pack, unpack):` (activation compression) change only the backward.
# Neither tracer records them: fx cannot hold the hook function (it fails and torch.export takes over), and both run
# the registration once on the trace's own tensors and keep no trace of it in the graph. The batched module would
# then train with the plain gradient (10x too large, the sign lost, the lossy unpack not applied) without a word.
# They are watched in every trace, whatever the grad mode: a plan traced under torch.no_grad() may be built and trained
# later (a hook guarded by `if h.requires_grad:` is then seen by build's trace, which runs with gradients on).

_TENSOR_HOOKS = ("register_hook", "register_post_accumulate_grad_hook")


def _torch_own(f: Any) -> bool:
    """Whether the callable `f` is torch's own (save_on_cpu's pack and unpack, checkpointing's), not a user's."""
    module = getattr(f, "__module__", None) or getattr(type(f), "__module__", "") or ""
    return module == "torch" or module.startswith("torch.")


class _AutogradHooksWatch:
    """While inside (this thread): the model's code calling Tensor.register_hook / register_post_accumulate_grad_hook,
    torch.autograd.graph.register_multi_grad_hook, or pushing saved-tensor hooks of its own (saved_tensors_hooks;
    torch's own, save_on_cpu and checkpointing, change no value and pass). `seen`: what was called, labelled.
    `in_graph(gm)` adds a hook registration fx recorded as a node (a hook it could hold)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def _note(self, label: str) -> None:
        if label not in self.seen:
            self.seen.append(label)

    def __enter__(self) -> "_AutogradHooksWatch":
        owner = threading.get_ident()
        _PATCHING.acquire()
        self.patched: list[tuple[Any, str, Any]] = []

        def watched(label: str, f: Callable) -> Callable:
            def call(*args, **kwargs):
                if threading.get_ident() == owner and _from_model_code(sys._getframe(1)):
                    self._note(label)
                return f(*args, **kwargs)
            return call

        def push(pack: Any, unpack: Any) -> Any:
            # called from saved_tensors_hooks.__enter__ (torch's frame): whose hooks they are tells a user's apart
            if threading.get_ident() == owner and not (_torch_own(pack) and _torch_own(unpack)):
                self._note("torch.autograd.graph.saved_tensors_hooks")
            return self._push(pack, unpack)

        try:
            for name in _TENSOR_HOOKS:
                self.patched.append((torch.Tensor, name, vars(torch.Tensor)[name]))
                setattr(torch.Tensor, name, watched(f"Tensor.{name}", vars(torch.Tensor)[name]))
            multi = torch.autograd.graph.register_multi_grad_hook
            self.patched.append((torch.autograd.graph, "register_multi_grad_hook", multi))
            torch.autograd.graph.register_multi_grad_hook = watched("torch.autograd.graph.register_multi_grad_hook", multi)
            self._push = torch._C._autograd._push_saved_tensors_default_hooks
            self.patched.append((torch._C._autograd, "_push_saved_tensors_default_hooks", self._push))
            torch._C._autograd._push_saved_tensors_default_hooks = push
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        try:
            for owner, name, value in reversed(self.patched):
                setattr(owner, name, value)
        finally:
            _PATCHING.release()

    def __exit__(self, *exc) -> None:
        self._restore()

    def in_graph(self, gm: torch.fx.GraphModule) -> None:
        for n in gm.graph.nodes:
            if n.op == "call_method" and n.target in _TENSOR_HOOKS:
                self._note(f"Tensor.{n.target}")

    def refusal(self) -> TraceError | None:
        """The error naming the hooks forward() set and the fix, or None when it set none."""
        if not self.seen:
            return None
        saved = "torch.autograd.graph.saved_tensors_hooks" in self.seen
        fixes = []
        if any(s != "torch.autograd.graph.saved_tensors_hooks" for s in self.seen):
            fixes.append("for a gradient hook on an activation (a gradient reversal or scale), an autograd.Function doing "
                         "the same, which stagewise keeps with its backward: class GradReverse(torch.autograd.Function) "
                         "with forward(ctx, x, lam): ctx.save_for_backward(lam); return x.view_as(x) and backward(ctx, "
                         "g): return -ctx.saved_tensors[0] * g, None, called as GradReverse.apply(h, self.lam) with lam "
                         "a tensor buffer (register_buffer), which may differ per member")
        if saved:
            fixes.append("for saved-tensor hooks, drop them (torch.autograd.graph.save_on_cpu, which only moves memory, "
                         "is allowed) or do the packing in an autograd.Function's forward/backward")
        return TraceError(
            f"forward() sets autograd hooks ({', '.join(self.seen)}), which neither torch.fx nor torch.export records in "
            f"a graph: the batched module would train with the plain gradient where each member's own backward runs "
            f"the hook{' (the pack/unpack of saved tensors)' if saved else ''}. Fix: {'; '.join(fixes)}. Inference "
            "does not run the hooks: to batch a model for inference alone, build its members without them")


@contextlib.contextmanager
def _autograd_hooks_refused():
    """Raise the watch's TraceError after the block when forward() set autograd hooks inside it (that refusal wins
    over an error the block raised: fx fails on a hook it cannot hold). Yields `in_graph(gm)`."""
    watch = _AutogradHooksWatch()
    try:
        with watch:
            yield watch.in_graph
    finally:
        error = watch.refusal()
        if error is not None:
            raise error from None


_VALUE_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__")
_VALUE_COMPARES = ("equal", "allclose", "is_nonzero")  # Tensor methods and torch functions answering a Python bool


def _caller_outside_stagewise(frame: Any) -> bool:
    """Whether the code that made a call is not stagewise's own: `frame` is the first frame above the watch, passed
    over while it is torch's __torch_function__ dispatch (torch.overrides) or a Tensor method written in Python."""
    while frame is not None and frame.f_globals.get("__name__") in ("torch.overrides", "torch._tensor"):
        frame = frame.f_back
    return frame is None or not str(frame.f_globals.get("__name__", "")).startswith("stagewise.")


def _real(args: tuple) -> bool:
    """Whether `args` hold a real tensor (a buffer, a constant): under a plain fx trace the rest are proxies."""
    return any(type(a) in (torch.Tensor, nn.Parameter) for a in args)


class _ValueReadMode(torch.overrides.TorchFunctionMode):
    """Sees the value reads `_tensor_values_read` watches however forward() reaches them: torch.equal / allclose /
    is_nonzero and Tensor.item / __bool__ / tolist / ... all dispatch __torch_function__ to an active mode from C, so a
    reference bound before the trace (`self.fn = torch.equal`, functools.partial(torch.allclose, ...),
    `self.eq = self.mode.equal`, `torch.Tensor.item` kept in a variable) is seen as well as a name looked up in torch's
    namespace. Calls torch's own Python code makes inside another op (where the mode is off) are left to the replaced
    Tensor methods."""

    def __init__(self, owner: int, seen: list[str], functions: dict[int, tuple[Any, str]]) -> None:
        super().__init__()
        self.owner, self.seen, self.functions = owner, seen, functions

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if (name in _VALUE_READS or name in _VALUE_COMPARES) and threading.get_ident() == self.owner and _real(args) \
                and _caller_outside_stagewise(sys._getframe(1)):
            hit = self.functions.get(id(func))
            self.seen.append(hit[1] if hit is not None and hit[0] is func
                             else f"Tensor.{name}" if name in _VALUE_COMPARES else name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _tensor_values_read():
    """Yields a list that gets the method's name each time code other than stagewise's turns a real tensor's values
    into Python while inside (this thread): `int(self.act_id)`, `if self.flag:`, `self.t.item()`,
    `torch.equal(self.mode, ...)`. Under a plain fx trace only buffers and constants are real tensors (the rest are
    proxies), so a read there is a buffer's value taken into the graph as member 0's, whichever way the branch on it
    goes for other values. Two watches, each seeing what the other cannot (a call both see is listed twice, under one
    name): `_ValueReadMode`, which sees a call however the model's code reached the function (a reference bound before
    the trace, `self.fn = torch.equal`, escapes a replaced name: member 0's branch was baked in for every member), and
    the Tensor methods and torch functions replaced for the block, which also see the reads torch's own Python code
    makes inside an op the mode passes through (its nested calls do not reach the mode)."""
    owner = threading.get_ident()
    seen: list[str] = []

    # functools.wraps: torch hands the mode the function it finds on torch.Tensor, which is then one of these
    def watched(name: str, f: Callable) -> Callable:
        @functools.wraps(f)
        def call(self, *args, **kwargs):
            if threading.get_ident() == owner and not str(sys._getframe(1).f_globals.get("__name__", "")).startswith("stagewise."):
                seen.append(name)
            return f(self, *args, **kwargs)
        return call

    def compared(name: str, f: Callable) -> Callable:  # torch.equal(self.mode, ...): a Python bool made in C
        @functools.wraps(f)
        def call(*args, **kwargs):
            if threading.get_ident() == owner and _real(args) \
                    and not str(sys._getframe(1).f_globals.get("__name__", "")).startswith("stagewise."):
                seen.append(name)
            return f(*args, **kwargs)
        return call

    with _PATCHING:
        own = {name: vars(torch.Tensor)[name] for name in _VALUE_READS + _VALUE_COMPARES if name in vars(torch.Tensor)}
        functions = {name: getattr(torch, name) for name in _VALUE_COMPARES}
        patched: list[str] = []
        try:
            for name in _VALUE_READS:
                if hasattr(torch.Tensor, name):
                    patched.append(name)
                    setattr(torch.Tensor, name, watched(name, getattr(torch.Tensor, name)))
            for name in _VALUE_COMPARES:
                patched.append(name)
                setattr(torch.Tensor, name, compared(f"Tensor.{name}", getattr(torch.Tensor, name)))
            labels = {id(f): (f, f"torch.{name}") for name, f in functions.items()}
            for name, f in functions.items():
                setattr(torch, name, compared(f"torch.{name}", f))
                labels[id(getattr(torch, name))] = (getattr(torch, name), f"torch.{name}")
            with _ValueReadMode(owner, seen, labels):
                yield seen
        finally:
            for name, f in functions.items():
                setattr(torch, name, f)
            for name in patched:
                if name in own:
                    setattr(torch.Tensor, name, own[name])
                else:
                    delattr(torch.Tensor, name)


def _state_held(value: Any, state: dict[int, str]) -> torch.Tensor | None:
    """The tensor the callable `value` holds a reference to, bound when it was made, that a trace cannot give each
    member its own of (None if none): the tensor of a bound tensor method (`self.mode.equal`, whichever tensor: a
    deep copy of the model keeps a bound builtin method as it is, bound to the original's buffer), or one of the
    model's parameters and buffers (`state`, by id) among a functools.partial's arguments (a shared constant there,
    torch.ones(1), is no member's). A function closing over a tensor is refused before any trace
    (planner.snapshot.state_refusal)."""
    if isinstance(value, (types.MethodType, types.BuiltinMethodType, types.MethodWrapperType)):
        return value.__self__ if isinstance(getattr(value, "__self__", None), torch.Tensor) else None
    if not isinstance(value, functools.partial):
        return None
    for h in [value.func, *value.args, *value.keywords.values()]:
        if isinstance(h, (types.MethodType, types.BuiltinMethodType, types.MethodWrapperType)):
            h = getattr(h, "__self__", None)  # functools.partial(self.mode.equal)
        if isinstance(h, torch.Tensor) and id(h) in state:
            return h
    return None


class _BoundStateReadMode(torch.overrides.TorchFunctionMode):
    """Refuses a value read (`_VALUE_READS`, `_VALUE_COMPARES`) of a tensor a callable attribute holds, made while that
    attribute runs (`inside`: the ids of the tensors the attributes running now hold; `names`: id -> (attribute,
    parameter or buffer name))."""

    def __init__(self, names: dict[int, tuple[str, str]]) -> None:
        super().__init__()
        self.names, self.inside = names, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.inside and getattr(func, "__name__", None) in _VALUE_READS + _VALUE_COMPARES:
            for a in list(args) + list((kwargs or {}).values()):
                if isinstance(a, torch.Tensor) and id(a) in self.inside:
                    attribute, buffer = self.names[id(a)]
                    raise TraceError(
                        f"forward() reads the values of {buffer} ({getattr(func, '__name__', func)}) through "
                        f"{attribute}, a callable made before the trace that holds the tensor itself (a bound "
                        f"`self.mode.equal`, functools.partial(torch.equal, self.mode), a closure over it): the traces "
                        f"that give each member its own buffers swap them in by attribute, which that reference "
                        f"escapes, so member 0's value (and the branch it takes) would be kept for every member. Reach "
                        f"the tensor through its attribute when called: self.fn = torch.equal with "
                        f"self.fn(self.mode, ...), or self.mode.equal(...) in forward()")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _bound_state_reads_refused(model: nn.Module) -> Any:
    """TraceError where forward() reads a parameter's or buffer's values through a callable attribute that holds the
    tensor itself (`_state_held`). The value-read watch sees such a read, but the traces that tell members apart
    (buffers as graph values, each member's buffers swapped in by attribute) cannot reach the tensor the reference
    holds: every one of them reads member 0's and agrees, and the batched module took member 0's branch for every
    member, 0.8 off, without a word. Such attributes are wrapped for the block (put back after); a model without
    them (nearly every one) pays a scan of its modules' attributes."""
    state = {id(t): name for name, t in list(model.named_buffers(remove_duplicate=False))
             + list(model.named_parameters(remove_duplicate=False))}
    found: list[tuple[dict, str, Any, torch.Tensor]] = []
    names: dict[int, tuple[str, str]] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        for k, v in list(vars(mod).items()):
            if k.startswith("__") or isinstance(v, (torch.Tensor, nn.Module, dict)) or not callable(v):
                continue
            t = _state_held(v, state)
            if t is not None:
                found.append((vars(mod), k, v, t))
                names.setdefault(id(t), (f"{path}.{k}" if path else f"self.{k}",
                                         state.get(id(t), "the tensor it is bound to (a deep copy of a model keeps the original's)")))
    if not found:
        yield
        return
    mode = _BoundStateReadMode(names)

    def wrapped(f: Callable, t: torch.Tensor) -> Callable:
        def call(*args, **kwargs):
            mode.inside.append(id(t))
            try:
                return f(*args, **kwargs)
            finally:
                mode.inside.pop()
        return call

    try:
        for space, k, v, t in found:
            space[k] = wrapped(v, t)
        with mode:
            yield
    finally:
        for space, k, v, _ in found:
            space[k] = v
