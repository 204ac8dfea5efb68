"""What tracing bakes in from a module and what it changed on it: plain attributes and state snapshots.

`plain_attributes`: the Python-number/string/enum attributes of every submodule and of the config dicts and
objects they hold (a trace keeps them as constants; the executor compares them per member).
`StateSnapshot`: parameters, buffers and plain attributes copied before tracing, to see (`StateChange`)
and undo what forward() changed while it was traced.
"""
from __future__ import annotations

import collections
import copy
import enum
import functools
import hashlib
import itertools
import numbers
import re
import types
import weakref
from functools import partial as functools_partial
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten


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
    return isinstance(v, PLAIN_TYPES) or (isinstance(v, (tuple, list, collections.deque))
                                          and all(isinstance(x, PLAIN_TYPES) for x in v))


def _collect_plain(key: str, v: Any, out: dict[str, Any], depth: int, seen: set[int]) -> None:
    """Plain `v` as out[key]; a config dict's or plain object's plain entries as out[key['k']] / out[key.k], `depth` levels down."""
    if _is_plain(v):
        out[key] = list(v) if isinstance(v, collections.deque) else v  # (compared as a list: a deque is no list)
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


_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}  # torch's own fields of every module (hooks, ...)
_HOOK_TABLES = tuple(k for k in sorted(_MODULE_INTERNALS) if k.startswith(("_forward_", "_backward_")) and "hook" in k)
_HELD_DEPTH, _HELD_LEAVES = 8, 20_000
# past _HELD_LEAVES leaves the rest is folded into one hash (still compared, without a leaf each); past this many more
# the walk stops, and the digest holds a value equal to no other's: such members are always traced again
_HELD_HASHED = 500_000
_TABLE_ITEMS = 64  # a list, tuple or dict of more plain scalars (or tuples of them) is digested at once (a tokenizer table)
_SCALARS = frozenset({bool, int, float, str, type(None)})
_VALUES = (bool, int, float, complex, str, bytes, type(None), enum.Enum, torch.dtype, torch.device, torch.layout,
           torch.memory_format)
_LONG_TEXT = 256  # a longer str or bytes is digested by its hash


class _Unequal:
    """A digest equal to nothing but itself: what held_values holds where it could not walk to the end."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return other is self

    def __ne__(self, other: object) -> bool:
        return other is not self

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return "<too many values to compare>"


def held_values(model: nn.Module) -> dict[str, Any]:
    """Everything the modules of `model` hold besides their parameters, buffers and submodules, as comparable
    digests by path: attributes private or not, numbers of any kind (numpy, complex, Decimal; -0.0 is not 0.0), dtypes,
    tensors (dense or sparse) and numpy arrays (shape, dtype and a hash of the values), what lists, tuples, deques,
    sets (item by item, in any order), dicts (any keys), ranges, slices and plain objects (their __dict__ and the
    __slots__ of every class in their MRO) hold, other objects by what they pickle to (else their repr), functions
    (name, code, closure and defaults), bound methods (their function and object), and each module's class (its
    name, plain class attributes and, for a class a factory makes, its functions with their code and closures),
    `_HELD_DEPTH` levels down.

    A trace bakes what forward() computes from any of these into the graph, so members whose `held_values`
    differ from member 0's are traced again and compared (executor.constants). Unequal digests cost a trace, never a
    wrong answer: past `_HELD_LEAVES` leaves the rest is digested as one hash, and past `_HELD_HASHED` more the digest
    holds a value equal to no other's (the members are then always traced again)."""
    out: dict[str, Any] = {}
    tree = {id(m) for m in model.modules()}
    state = {id(t): k for k, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
    seen: dict[int, str] = {}
    alive: list = []
    walked: set[int] = set()  # the classes whose functions are walked (class_functions)
    more: list[tuple[str, Any]] = []  # the leaves past _HELD_LEAVES, hashed at the end
    rest = [0, False]  # how many, and whether one was _Unequal

    def leaf(key: str, v: Any) -> None:
        if len(out) < _HELD_LEAVES:
            out[key] = v
        else:
            more.append((key, v))
            rest[0] += 1
            rest[1] = rest[1] or isinstance(v, _Unequal)

    def walk(key: str, v: Any, depth: int) -> None:
        if rest[0] >= _HELD_HASHED:
            return
        if isinstance(v, _VALUES):
            if isinstance(v, (str, bytes)) and len(v) > _LONG_TEXT:
                leaf(key, ("v", type(v).__name__, len(v), _text_digest(v)))
            else:  # (repr: -0.0 is not 0.0)
                leaf(key, ("v", type(v).__name__, repr(v)))
            return
        if isinstance(v, torch.Tensor):
            # the module's own parameters and buffers held again (an RNN's _flat_weights) are state, batched anyway
            leaf(key, ("state", state[id(v)]) if id(v) in state else _tensor_digest(v))
            return
        if isinstance(v, weakref.ref):
            walk(f"{key}()", v(), depth)
            return
        if type(v).__module__ == "numpy":  # numpy scalars and arrays, without importing numpy here
            leaf(key, ("np", repr(getattr(v, "dtype", "")), repr(getattr(v, "shape", "")), _bytes_digest(v)))
            return
        if isinstance(v, numbers.Number):  # Decimal, Fraction: their value (Decimal('1.0') is not Decimal('1.00'))
            leaf(key, ("v", type(v).__qualname__, repr(v)))
            return
        if isinstance(v, type):
            leaf(key, _class_digest(v))
            class_functions(key, v, depth)
            return
        if isinstance(v, (range, slice)):  # `self.active = range(n)`, `h[:, self.keep]`
            leaf(key, (type(v).__name__,))
            for part in ("start", "stop", "step"):
                walk(f"{key}.{part}", getattr(v, part), depth)
            return
        if isinstance(v, nn.Module) and id(v) in tree:
            return  # walked as a module of its own
        if id(v) in seen:
            leaf(key, ("same as", seen[id(v)]))
            return
        seen[id(v)] = key
        alive.append(v)  # (a value made for the walk, `(f.__defaults__, ...)`, keeps its id while `seen` holds it)
        if depth == 0:
            leaf(key, ("deep", type(v).__qualname__))
            return
        if isinstance(v, (list, tuple, collections.deque)):
            if len(v) > _TABLE_ITEMS and all(map(_plain_data, v)):
                leaf(key, (type(v).__qualname__, len(v), _text_digest(repr(list(v)))))
                return
            leaf(key, (type(v).__qualname__, len(v), getattr(v, "maxlen", None)))
            for i, x in enumerate(v):
                walk(f"{key}[{i}]", x, depth - 1)
        elif isinstance(v, (set, frozenset)):  # item by item (a tuple's numbers too), in any order
            if all(map(_plain_data, v)):
                items = sorted(map(repr, v))
            else:
                digests = [item_digest(x, depth - 1) for x in v]
                if any(d is _TOO_LARGE for d in digests):
                    leaf(key, _Unequal())
                    return
                items = sorted(repr(d) for d in digests)
            leaf(key, (type(v).__qualname__, len(v), _text_digest(repr(items))) if len(items) > _TABLE_ITEMS else
                 (type(v).__qualname__, items))
        elif isinstance(v, dict):
            if isinstance(v, collections.defaultdict):  # what a missing key reads
                walk(f"{key}<default>", v.default_factory, depth - 1)
            if len(v) > _TABLE_ITEMS and all(map(_plain_data, v)) and all(map(_plain_data, v.values())):
                leaf(key, (type(v).__qualname__, len(v), _text_digest(repr(v))))
                return
            leaf(key, (type(v).__qualname__, len(v)))
            for k, x in v.items():
                walk(f"{key}[{k!r}]", x, depth - 1)
        elif isinstance(v, types.MethodType):
            leaf(key, ("method", getattr(v.__func__, "__qualname__", repr(v.__func__))))
            walk(f"{key}.__func__", v.__func__, depth - 1)
            walk(f"{key}.__self__", v.__self__, depth - 1)
        elif isinstance(v, types.FunctionType):
            # its code too: every lambda is named `<lambda>`, and the functions a factory defines share a qualname
            leaf(key, ("function", v.__module__, v.__qualname__, _code_digest(v.__code__)))
            for i, cell in enumerate(v.__closure__ or ()):
                try:
                    walk(f"{key}<closure {i}>", cell.cell_contents, depth - 1)
                except ValueError:  # an empty cell
                    pass
            walk(f"{key}<defaults>", (v.__defaults__ or (), v.__kwdefaults__ or {}), depth - 1)
        elif callable(v) and not hasattr(v, "__dict__"):  # builtins (torch.relu); functools.partial is walked below
            qualname = getattr(v, "__qualname__", None)
            leaf(key, ("callable", type(v).__qualname__, getattr(v, "__module__", None), qualname))
            if qualname is None:  # a callable object held in C (operator.itemgetter(1)): what it pickles to
                walk(f"{key}<value>", _reduced(v), depth - 1)
        else:  # digests hold no addresses: a leaf module's differ only where members do (see executor.constants)
            leaf(key, ("object", _class_digest(type(v))))
            class_functions(key, type(v), depth)
            if isinstance(v, functools_partial):
                walk(f"{key}<partial>", (v.func, v.args, v.keywords), depth - 1)
            fields = dict(vars(v)) if hasattr(v, "__dict__") else {}
            for slot in _slot_names(type(v)):  # every class's in the MRO (a slots dataclass's base holds fields too)
                if slot not in fields:
                    try:
                        fields[slot] = getattr(v, slot)
                    except Exception:  # noqa: BLE001 - a slot not set
                        pass
            if not hasattr(v, "__dict__") and not _slot_names(type(v)):
                # an object holding its value in C (an array.array, an extension type): what it pickles to, else its repr
                walk(f"{key}<value>", _reduced(v), depth - 1)
            for k, x in fields.items():
                walk(f"{key}.{k}", x, depth - 1)

    def item_digest(x: Any, depth: int) -> Any:
        """A set item's digest, walked apart from the rest (its leaves under keys of its own)."""
        nonlocal out
        saved, count = out, rest[0]
        out = {}
        try:
            walk("", x, depth)
            too_large = rest[0] != count or any(isinstance(d, _Unequal) for d in out.values())
            return _TOO_LARGE if too_large else sorted(out.items(), key=str)
        finally:
            out = saved

    def class_functions(key: str, cls: type, depth: int) -> None:
        """The functions (with their code and what they close over) and class attributes of a class a factory makes
        (and of such bases): `make_block(scale)`'s `class Block` has one name and one code in every member, and
        forward() reads `scale`."""
        for base in cls.__mro__:
            if "<locals>" not in base.__qualname__ or depth <= 0 or id(base) in walked:
                continue
            walked.add(id(base))
            for name, f in vars(base).items():
                if name == "__init__":  # what it makes of its closure, the object holds (walked as its attributes)
                    continue
                if isinstance(f, (staticmethod, classmethod)):
                    f = f.__func__
                elif isinstance(f, property):
                    f = tuple(g for g in (f.fget, f.fset, f.fdel) if g is not None)
                if isinstance(f, types.FunctionType) or (isinstance(f, tuple) and f) or not name.startswith("__"):
                    walk(f"{key}<{base.__qualname__}.{name}>", f, depth - 1)  # (and its other class attributes)

    for path, mod in model.named_modules():
        leaf(f"{path}<class>", _class_digest(type(mod)))
        class_functions(f"{path}<class>", type(mod), _HELD_DEPTH)
        # the old weight_norm / spectral_norm recompute `weight` in a pre-hook on every call (their config is compared
        # by hook_configs): a tensor attribute derived from the member's state, not something it holds
        recomputed = {getattr(h, "name", None) for h in mod._forward_pre_hooks.values()}
        if isinstance(mod, nn.RNNBase):  # its own weights again (parametrized ones computed per call: weight_norm)
            recomputed |= {"_flat_weights", "_flat_weight_refs"}
        for k, v in vars(mod).items():
            if k not in _MODULE_INTERNALS and k not in recomputed:
                walk(f"{path}.{k}" if path else k, v, _HELD_DEPTH)
    if rest[0]:  # the rest, in one hash: still compared, without a leaf each
        out["<the rest>"] = _Unequal() if rest[0] >= _HELD_HASHED or rest[1] else (rest[0], _text_digest(repr(more)))
    return out


_TOO_LARGE = object()  # a set item with more leaves than _HELD_LEAVES


def _plain_data(x: Any) -> bool:
    """A plain scalar (not a subclass: an enum's repr is not its value's), or a tuple or list of them: what a table
    holds, which its repr tells apart completely (1 from 1.0 from True, -0.0 from 0.0, a tuple from a list)."""
    return type(x) in _SCALARS or (type(x) in (tuple, list) and all(type(y) in _SCALARS for y in x))


def _text_digest(v: str | bytes) -> str:
    return hashlib.sha1(v if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass")).hexdigest()


@functools.lru_cache(maxsize=4096)
def _code_digest(code: types.CodeType) -> str:
    """A function's code by what it runs: bytecode, constants (nested code too), names; not its line numbers."""
    def parts(c: types.CodeType) -> tuple:
        consts = tuple(parts(x) if isinstance(x, types.CodeType) else (type(x).__name__, repr(x)) for x in c.co_consts)
        return (c.co_name, c.co_code, consts, c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars,
                c.co_argcount, c.co_kwonlyargcount, c.co_flags)
    return _text_digest(repr(parts(code)))


@functools.lru_cache(maxsize=4096)
def _slot_names(cls: type) -> tuple[str, ...]:
    """The slots of `cls` and of every class in its MRO (`__slots__` one name or several), as attribute names
    (a private `__x` as Python mangles it)."""
    names: list[str] = []
    for base in cls.__mro__:
        slots = vars(base).get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots if isinstance(slots, (tuple, list, dict)) else ():
            if not isinstance(slot, str) or slot in ("__dict__", "__weakref__"):
                continue
            if slot.startswith("__") and not slot.endswith("__"):
                slot = f"_{base.__name__.lstrip('_')}{slot}"
            if slot not in names:
                names.append(slot)
    return tuple(names)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _reduced(v: Any) -> Any:
    """An object that holds its value in C as what it pickles to (`operator.itemgetter(1)` -> (itemgetter, (1,))),
    else its repr without memory addresses."""
    try:
        reduced = v.__reduce_ex__(4)
    except Exception:  # noqa: BLE001 - it does not pickle (a lock, an extension type)
        reduced = None
    if isinstance(reduced, tuple) and reduced:
        parts: list = [reduced[0], *reduced[1:3]]
        for items in reduced[3:5]:  # list items and dict items, as iterators
            parts.append(None if items is None else list(itertools.islice(items, _HELD_LEAVES)))
        return ("reduced", *parts)
    try:
        return ("repr", _ADDRESS.sub("", repr(v)))
    except Exception:  # noqa: BLE001
        return ("repr", None)


def _class_digest(cls: type) -> tuple:
    """A class by name and by the plain values it holds as class attributes: classes a factory makes share a name
    and differ there (torch's parametrize makes a class per module, alike in all members); held_values walks such a
    class's functions too."""
    plain = tuple(sorted((k, repr(v)) for k, v in vars(cls).items()
                         if not k.startswith("__") and isinstance(v, (bool, int, float, complex, str, type(None), enum.Enum))))
    return ("class", cls.__module__, cls.__qualname__, plain)


def _tensor_digest(t: torch.Tensor) -> tuple:
    t = t.detach()
    if t.is_meta:
        return ("tensor", tuple(t.shape), str(t.dtype), str(t.layout))
    if t.layout == torch.sparse_coo:  # (a graph's adjacency): its coalesced entries
        t = t.coalesce()
        return ("tensor", tuple(t.shape), str(t.dtype), str(t.layout), _tensor_digest(t.indices())[3],
                _tensor_digest(t.values())[3])
    if t.layout != torch.strided:  # CSR and the other compressed layouts: their values, dense
        return ("tensor", tuple(t.shape), str(t.dtype), str(t.layout), _tensor_digest(t.to_dense())[3])
    raw = t.cpu().contiguous().flatten()
    raw = raw.view(torch.uint8) if raw.numel() else raw
    return ("tensor", tuple(t.shape), str(t.dtype), hashlib.sha1(raw.numpy().tobytes()).hexdigest())


def _bytes_digest(v: Any) -> str:
    try:
        return hashlib.sha1(v.tobytes()).hexdigest()
    except Exception:  # noqa: BLE001 - an object array: its repr
        return repr(v)


def state_refusal(module: nn.Module) -> str | None:
    """Why stagewise cannot stack `module`'s state, with the fix, or None: a lazy module's parameter not made yet
    (nn.LazyLinear before its first call), a quantized module's packed weights."""
    lazy = next((name for name, t in itertools.chain(module.named_parameters(), module.named_buffers())
                 if isinstance(t, nn.parameter.UninitializedTensorMixin)), None)
    if lazy is not None:
        return (f"{type(module).__name__} holds {lazy}, a lazy module's parameter not made yet (nn.LazyLinear & co): "
                "run the model once on an example input first, which gives it its shapes")
    quantized = next((name for name, m in module.named_modules()
                      if type(m).__module__.startswith(("torch.ao.nn.quantized", "torch.nn.quantized"))), None)
    if quantized is not None:
        return (f"{type(module).__name__} holds a quantized module ({quantized or '(the model)'}: "
                f"{type(module.get_submodule(quantized)).__name__}), whose packed weights stagewise cannot stack; "
                "batch the float model (quantize the members apart, after training)")
    return None


def deepcopy_module(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """copy.deepcopy(module), with plain tensor attributes kept plain: a GraphModule's deepcopy (a torch.export
    archive's module) registers them as buffers, and a buffer is traced as a graph value where a plain attribute
    is not, so the copy would trace to another graph than the module the plan was made from."""
    twin = copy.deepcopy(module, memo)
    # a Parameter's deepcopy clones it: two that view one memory (a torch.export archive loads a tie as two
    # Parameters on one storage) would come out on two; the copy's are two on one memory again, as the module's
    held: dict[tuple, torch.Tensor] = {}
    held_source: dict[tuple, torch.Tensor] = {}  # (one object held twice is one object in the copy too)
    for mod, other in zip(module.modules(), twin.modules()):
        for table in ("_parameters", "_buffers"):
            mine, theirs = getattr(mod, table), getattr(other, table)
            for k, t in mine.items():
                if t is None or k not in theirs or not t.numel() or t.device.type == "meta" or t.layout != torch.strided:
                    continue
                key = (table, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
                first, source = held.setdefault(key, theirs[k]), held_source.setdefault(key, t)
                if first is not theirs[k] and t is not source:
                    view = first.detach()
                    theirs[k] = nn.Parameter(view, requires_grad=t.requires_grad) if table == "_parameters" else view
    for mod, other in zip(module.modules(), twin.modules()):
        # a GraphModule's deepcopy (rebuilt from its graph) forgets which buffers are non-persistent: the copy's
        # state_dict would then hold them, and weight files without them would not fit it
        other._non_persistent_buffers_set |= {k for k in mod._non_persistent_buffers_set if k in other._buffers}
        for k, v in vars(mod).items():
            if isinstance(v, torch.Tensor) and k in other._buffers and k not in mod._buffers:
                other.__dict__[k] = other._buffers.pop(k)
                other._non_persistent_buffers_set.discard(k)
    return twin


@dataclass
class StateChange:
    """What tracing changed on the real module."""

    tensors: list[str]
    attributes: list[str]
    # attributes forward() set to a value computed from its inputs (a recurrent state as a plain attribute), in
    # `attributes` too: state the graph cannot carry to the next call, whichever tracer traces it
    carried: list[str] = field(default_factory=list)

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
    # tensors held as plain module attributes (`self.count = torch.zeros(1)`, not a buffer): (module, name, the tensor,
    # a copy, its version). No per-member copy of them is kept (they are constants), so a change is refused
    held: dict[str, tuple[nn.Module, str, torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)
    # every parameter and buffer slot: (module, table, key, the tensor), to put back one replaced while tracing
    # (`self.step += 1` on a buffer proxied by fx leaves an fx Proxy in the module)
    slots: list[tuple[str, nn.Module, str, str, Any]] = field(default_factory=list)
    # every module's attributes as they were (shallow), to take back fx Proxies a trace left in them
    # (`if self.cache is None: self.cache = self.fc.weight.sum(0)` ran on graph values)
    attrs_before: list[tuple[nn.Module, dict]] = field(default_factory=list)
    # the lists and dicts those attributes hold, with their contents as they were (one level: `self.maps.append(h)`
    # in forward() leaves an fx Proxy in the list) and their names ("Net.mem"), for restore_all
    contents: list[tuple[Any, Any, str]] = field(default_factory=list)
    # every module's hook tables with the hooks they held: a forward() that registers hooks on its first call (Hugging
    # Face's output capturing, marked by a plain attribute the restore takes back) would otherwise have each traced or
    # checked run add another set, and the model left with them
    hooks: list[tuple[dict, dict]] = field(default_factory=list)

    @staticmethod
    def take(model: nn.Module) -> "StateSnapshot":
        live = dict([*model.named_parameters(), *model.named_buffers()])
        with torch.no_grad():
            tensors = {k: t.detach().clone() for k, t in live.items()}
            held = {f"{path}.{k}" if path else k: (mod, k, v, v.detach().clone(), v._version)
                    for path, mod in model.named_modules() for k, v in vars(mod).items() if isinstance(v, torch.Tensor)}
        slots = [(f"{path}.{k}" if path else k, mod, table, k, t) for path, mod in model.named_modules(remove_duplicate=False)
                 for table in ("_parameters", "_buffers") for k, t in getattr(mod, table).items()]
        contents = [(v, _contents_of(v), f"{type(mod).__name__}.{k}") for mod in model.modules()
                    for k, v in vars(mod).items() if _is_container(v) and k not in _MODULE_INTERNALS]
        hooks = [(table, dict(table)) for mod in model.modules() for name in _HOOK_TABLES
                 for table in [mod.__dict__.get(name)] if isinstance(table, dict)]
        return StateSnapshot(tensors, {k: t._version for k, t in live.items()}, copy_plain(plain_attributes(model)), held,
                             slots, [(mod, dict(vars(mod))) for mod in model.modules()], contents, hooks)

    def restore_if_changed(self, model: nn.Module) -> StateChange:
        """Compare with `model` now; put changed tensors back, and attributes a trace left holding fx Proxies (a cache
        forward() fills lazily, set while traced: the graph computes it, the model keeps what it held). Returns what
        had changed (not the Proxies: what fills a cache is in the graph)."""
        carried = []
        for mod, before in self.attrs_before:
            for k, v in list(vars(mod).items()):
                if before.get(k) is not v and _holds_proxy(v):
                    # a value computed from the inputs' values and kept for the next call (`self.h = cell(x, self.h)`:
                    # a recurrent state held as a plain attribute) is state the graph cannot carry, not a cache
                    if isinstance(before.get(k), torch.Tensor) or _reads_inputs(v):
                        carried.append(f"{type(mod).__name__}.{k}")
                    if k in before:
                        mod.__dict__[k] = before[k]
                    else:
                        del mod.__dict__[k]
        replaced = set()
        for name, mod, table, k, t in self.slots:
            if getattr(mod, table).get(k) is not t:
                getattr(mod, table)[k] = t
                replaced.add(name)
        now = dict([*model.named_parameters(), *model.named_buffers()])
        changed = [k for k, t in self.tensors.items()
                   if k in now and (now[k]._version != self.versions[k] or not _same_tensor(now[k], t))]
        changed += sorted(k for k in replaced & self.tensors.keys() if k not in changed)
        with torch.no_grad():
            for k in changed:
                if now[k].grad_fn is not None:  # a buffer written with a value recording gradients (a run under grad)
                    try:  # takes back the graph it joined: it was a leaf (a later deepcopy needs one)
                        now[k].detach_()
                    except RuntimeError:  # a view cannot be detached in place: its values are put back all the same
                        pass
                if now[k].shape != self.tensors[k].shape:  # resized in place (an observer's first call sizes its min_val)
                    now[k].resize_(self.tensors[k].shape)
                now[k].copy_(self.tensors[k])
                self.versions[k] = now[k]._version  # the copy back is not a change of the next step
        attrs = plain_attributes(model)
        moved = [k for k in self.attributes.keys() | attrs.keys() if self.attributes.get(k) != attrs.get(k)]
        for key, (mod, k, tensor, saved, version) in self.held.items():
            if mod.__dict__.get(k) is not tensor:  # replaced (`self.cache = ...`): the original put back
                mod.__dict__[k] = tensor
                moved.append(key)
            elif tensor._version != version or not _same_tensor(tensor, saved):  # written in place (`self.count.add_(1)`)
                with torch.no_grad():
                    tensor.copy_(saved)
                self.held[key] = (mod, k, tensor, saved, tensor._version)
                moved.append(key)
        for table, was in self.hooks:  # capturing hooks forward() registered: the model as it was
            drop_added_capturing_hooks(table, was)
        for container, was, name in self.contents:  # (after `moved`: a count in a dict, `stats["calls"] += 1`, is news)
            stored = _put_back_contents(container, was)
            # `self.mem["h"] = cell(x, self.mem.get("h"))`: a state kept inside a dict or list attribute
            if stored and _reads_inputs([x for x in tree_flatten(stored)[0] if isinstance(x, torch.fx.Proxy)]):
                carried.append(name)
        return StateChange(changed, sorted(set(moved) | set(carried)), sorted(carried))


# calls that read a tensor's size, not its values: a cache sized by the input (a rotary table for x.shape[1]) is
# still a cache
_SIZE_READS = frozenset({"size", "dim", "numel", "shape", "ndim", "dtype", "device", "sym_size", "nelement", "ndimension"})


def drop_added_capturing_hooks(table: dict, was: dict) -> None:
    """Take out of a module's hook table the hooks added since it held `was` that only record outputs (Hugging Face's
    output capturing, installed on a model's first call with output_hidden_states / output_attentions and marked by
    a plain attribute a restore takes back: kept, each traced run would add another set). Any other hook forward()
    registers stays, for build to refuse as a hook of the member's."""
    for key in [k for k in table if k not in was]:
        hook = table[key]
        if "output_capturing" in str(getattr(getattr(hook, "__func__", hook), "__module__", "") or ""):
            del table[key]


def _reads_inputs(v: Any) -> bool:
    """Whether a Proxy (or a container of them) is computed from the values of the traced forward()'s inputs."""
    proxies = [v] if isinstance(v, torch.fx.Proxy) else list(v.values()) if isinstance(v, dict) else \
        list(v) if isinstance(v, (list, tuple)) else []
    seen: set = set()
    stack = [p.node for p in proxies if isinstance(p, torch.fx.Proxy)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            return True
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if name in _SIZE_READS or (name == "getattr" and len(node.args) > 1 and node.args[1] in _SIZE_READS):
            continue
        stack.extend(node.all_input_nodes)
    return False


def restore_all(snapshot: StateSnapshot, model: nn.Module) -> None:
    """Put `model` back as `snapshot` saw it: its tensors, and every module's attributes (one level: a value
    replaced or added is undone; one changed inside a container it held is not)."""
    snapshot.restore_if_changed(model)
    for container, was, _ in snapshot.contents:
        _put_back_contents(container, was)
    for mod, before in snapshot.attrs_before:
        for k in [k for k in vars(mod) if k not in before]:
            del mod.__dict__[k]
        for k, v in before.items():
            if mod.__dict__.get(k, _MISSING) is not v:
                mod.__dict__[k] = v


def _is_container(v: Any) -> bool:
    """A mutable container a module may keep values in between calls: a list, a deque, a dict (a defaultdict, an
    OrderedDict), a set, a SimpleNamespace."""
    return isinstance(v, (list, collections.deque, dict, set)) or type(v) is types.SimpleNamespace


def _contents_of(v: Any) -> Any:
    """A shallow copy of what the container `v` holds (a dict of a SimpleNamespace's fields)."""
    if isinstance(v, (list, collections.deque)):
        return list(v)
    if isinstance(v, set):
        return set(v)
    return dict(v) if isinstance(v, dict) else dict(vars(v))


def _put_back_contents(container: Any, was: Any) -> list:
    """Put `container` (a list, deque, dict, set or SimpleNamespace) back to the contents `was`; the values it held
    instead that hold fx Proxies (a trace stored them), or [] where it was as it is (or changed without Proxies: put
    back all the same)."""
    if isinstance(container, (list, collections.deque)):
        if len(container) != len(was) or any(a is not b for a, b in zip(container, was)):
            stored = [x for x in container if _holds_proxy(x)]
            container.clear()
            container.extend(was)
            return stored
        return []
    if isinstance(container, set):
        if container != was:
            stored = [x for x in container if _holds_proxy(x)]
            container.clear()
            container.update(was)
            return stored
        return []
    fields = container if isinstance(container, dict) else vars(container)
    if fields.keys() != was.keys() or any(fields[k] is not was[k] for k in was):
        stored = [x for x in fields.values() if _holds_proxy(x)]
        fields.clear()
        fields.update(was)
        return stored
    return []


_MISSING = object()
_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})  # put back slot by slot (StateSnapshot.slots)


def _holds_proxy(v: Any) -> bool:
    """Whether `v` is an fx Proxy, or a list, tuple or dict holding one (one level down)."""
    if isinstance(v, torch.fx.Proxy):
        return True
    if isinstance(v, (list, tuple, collections.deque, set)):
        return any(isinstance(x, torch.fx.Proxy) for x in v)
    if isinstance(v, dict):
        return any(isinstance(x, torch.fx.Proxy) for x in v.values())
    return False


def config_fields(model: nn.Module, attributes: list[str]) -> dict[str, Any]:
    """Of `attributes` (plain_attributes keys), those held in a config object rather than on a module
    ("config.problem_type", "bert.config.problem_type"), each with its value on `model` now."""
    out = {}
    for key in attributes:
        if "[" in key:  # an entry of a config dict; its value is not looked up
            continue
        *path, last = key.split(".")
        obj: Any = model
        for part in path:
            obj = getattr(obj, part, None)
        if path and obj is not None and not isinstance(obj, nn.Module) and hasattr(obj, last):
            out[key] = getattr(obj, last)
    return out


def copy_plain(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, (list, collections.deque)) else v for k, v in attrs.items()}


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN equal to NaN: an untouched NaN buffer is not a change)."""
    a = a.detach()
    if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
        return False
    if a.layout is torch.sparse_coo:  # (a graph's adjacency held as a sparse buffer): its coalesced entries
        a, b = a.coalesce(), b.coalesce()
        return torch.equal(a.indices(), b.indices()) and _same_tensor(a.values(), b.values())
    if a.layout is not torch.strided:  # CSR and the other compressed layouts: their dense values
        return _same_tensor(a.to_dense(), b.to_dense())
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    return bool(torch.equal(a, b))
