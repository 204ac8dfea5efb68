"""What tracing bakes in from a module and what it changed on it: plain attributes and state snapshots.

`plain_attributes`: the Python-number/string/enum attributes of every submodule and of the config dicts and
objects they hold (a trace keeps them as constants; the executor compares them per member).
`StateSnapshot`: parameters, buffers and plain attributes copied before tracing, to see (`StateChange`)
and undo what forward() changed while it was traced.
"""
from __future__ import annotations

import enum
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


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


_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules"})  # state the trace reads as graph values


def held_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors the modules hold outside their parameters and buffers: plain tensor attributes and tensors in
    the lists, tuples and dicts they hold, two levels down ("rff.scale", "tables[1]", "cfg['w']").

    A trace runs what forward() computes from them once, on member 0's, and keeps the result as a constant;
    members holding other values need their own (executor.constants compares these per member)."""
    out: dict[str, torch.Tensor] = {}

    def walk(key: str, v: Any, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif depth and isinstance(v, (list, tuple)) and len(v) <= _CONFIG_ITEMS:
            for i, x in enumerate(v):
                walk(f"{key}[{i}]", x, depth - 1)
        elif depth and isinstance(v, dict) and len(v) <= _CONFIG_ITEMS:
            for k, x in v.items():
                walk(f"{key}[{k!r}]", x, depth - 1)

    for path, mod in model.named_modules():
        for k, v in vars(mod).items():
            if k not in _MODULE_INTERNALS:
                walk(f"{path}.{k}" if path else k, v, 2)
    return out


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two `held_tensors` results hold the same names, shapes, dtypes and values."""
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            return False
        with torch.no_grad():
            if not torch.equal(x, y):
                return False
    return True


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
    return {k: list(v) if isinstance(v, list) else v for k, v in attrs.items()}


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN equal to NaN: an untouched NaN buffer is not a change)."""
    a = a.detach()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    return bool(torch.equal(a, b))
