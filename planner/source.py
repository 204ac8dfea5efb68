"""Model sources: a `.py` model file or a `torch.export` archive, plus member weights.

A model file defines `build_model() -> nn.Module` and `example_inputs() -> tuple`,
and optionally `build_members(n) -> list[nn.Module]`. Without it, members are
`n` copies from `build_model()`, the RNG re-seeded per member so their weights differ.
"""
from __future__ import annotations

import copy
import importlib.util
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from planner.errors import MemberError, ModelLoadError

MEMBER_SEED_BASE = 1234  # member i is built after torch.manual_seed(MEMBER_SEED_BASE + i)


@dataclass
class ModelSource:
    """A loaded model: the module to trace, example inputs, and a way to make members."""

    name: str  # file stem, e.g. "mlp"
    path: Path | None
    model: nn.Module
    example_inputs: tuple
    _build_members: Callable[[int], list[nn.Module]] = field(repr=False, default=None)

    def members(self, n: int) -> list[nn.Module]:
        """`n` members of this architecture (eval mode, own weights)."""
        if not isinstance(n, int) or n < 1:
            raise MemberError(f"the number of members must be an integer >= 1, got {n!r}; ask for 1 or more members")
        members = self._build_members(n)
        if len(members) != n:
            raise MemberError(f"{self.name}: build_members({n}) returned {len(members)} modules; it must return exactly {n}")
        return members


def load_source(path: str | Path, weights: Sequence[str | Path] | None = None) -> ModelSource:
    """Load a `.py` model file or a `.pt2` export archive, by suffix."""
    p = Path(path)
    if p.suffix == ".pt2":
        return load_export(p, weights)
    if p.suffix == ".py":
        return load_model_file(p, weights)
    raise ModelLoadError(f"{p.name}: unknown model format {p.suffix!r}; pass a .py model file or a .pt2 torch.export archive")


def _import_file(p: Path):
    module_name = f"_stagewise_model_{p.stem}_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{p}: cannot be imported as a Python module; check the file name ends in .py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(module_name, None)
        raise ModelLoadError(f"{p.name} has a syntax error at line {e.lineno}: {e.msg}; fix the file and load it again") from None
    except Exception as e:  # any failure of user code at import time
        sys.modules.pop(module_name, None)
        last = traceback.extract_tb(e.__traceback__)[-1]
        raise ModelLoadError(
            f"{p.name} failed to import: {type(e).__name__}: {e} (line {last.lineno}); fix the file and load it again"
        ) from None
    return module


def _call_user(p: Path, fn_name: str, fn: Callable, *args):
    try:
        return fn(*args)
    except Exception as e:  # user code: report which function failed
        raise ModelLoadError(f"{p.name}: {fn_name}() raised {type(e).__name__}: {e}; fix {fn_name}() in the model file") from None


def load_model_file(path: str | Path, weights: Sequence[str | Path] | None = None) -> ModelSource:
    """Import a model file and check its contract.

    Args:
        path: a `.py` file defining build_model() and example_inputs().
        weights: optional, one weight file per member (.safetensors or a torch.save'd
            state_dict); when given, members(n) needs n == len(weights).
    Raises:
        ModelLoadError naming the file and what is missing or broken.
    """
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"model file {p} does not exist; check the path")
    module = _import_file(p)
    for required in ("build_model", "example_inputs"):
        if not callable(getattr(module, required, None)):
            raise ModelLoadError(f"{p.name} defines no {required}(); a model file needs build_model() and example_inputs()")
    model = _call_user(p, "build_model", module.build_model)
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"{p.name}: build_model() returned {type(model).__name__}, not an nn.Module; return the model instance")
    inputs = _call_user(p, "example_inputs", module.example_inputs)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise ModelLoadError(f"{p.name}: example_inputs() must return a tuple of inputs, got {type(inputs).__name__}")
    inputs = tuple(inputs)

    if weights:
        build = _members_from_weights(p.name, lambda: _call_user(p, "build_model", module.build_model), weights)
    elif callable(getattr(module, "build_members", None)):
        def build(n: int) -> list[nn.Module]:
            members = _call_user(p, "build_members", module.build_members, n)
            if not isinstance(members, (list, tuple)) or not all(isinstance(m, nn.Module) for m in members):
                raise ModelLoadError(f"{p.name}: build_members({n}) must return a list of nn.Module; fix build_members() in the model file")
            return list(members)
    else:
        def build(n: int) -> list[nn.Module]:
            state = torch.random.get_rng_state()
            try:
                out = []
                for i in range(n):
                    torch.manual_seed(MEMBER_SEED_BASE + i)
                    out.append(_call_user(p, "build_model", module.build_model))
                return out
            finally:
                torch.random.set_rng_state(state)
    return ModelSource(name=p.stem, path=p, model=model, example_inputs=inputs, _build_members=build)


def load_export(path: str | Path, weights: Sequence[str | Path] | None = None) -> ModelSource:
    """Load a `.pt2` archive written by `torch.export.save`.

    Members are copies of the exported module, each loaded with one weight file
    when `weights` is given (otherwise all members share the archive's weights,
    which is only useful for checking a plan).
    """
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"export archive {p} does not exist; check the path")
    try:
        ep = torch.export.load(str(p))
    except Exception as e:  # torch raises many types for a bad archive
        raise ModelLoadError(f"{p.name} is not a torch.export archive ({type(e).__name__}: {e}); write it with torch.export.save") from None
    example = getattr(ep, "example_inputs", None)
    if not example:
        raise ModelLoadError(f"{p.name} stores no example inputs; export with torch.export.export(model, args) on torch >= 2.4")
    args, kwargs = example
    if kwargs:
        raise ModelLoadError(f"{p.name}: keyword example inputs {sorted(kwargs)} are not supported; export with positional args")
    model = ep.module()
    base = lambda: copy.deepcopy(model)  # noqa: E731
    if weights:
        build = _members_from_weights(p.name, base, weights)
    else:
        build = lambda n: [base() for _ in range(n)]  # noqa: E731
    return ModelSource(name=p.stem, path=p, model=model, example_inputs=tuple(args), _build_members=build)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read one member's weights: `.safetensors`, or a state_dict saved with torch.save."""
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"weight file {p} does not exist; check the path")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(p))
        else:
            state = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt files raise many types
        raise ModelLoadError(f"weight file {p.name} could not be read ({type(e).__name__}: {e}); pass a .safetensors file or a torch.save'd state_dict") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"weight file {p.name} does not hold a state_dict (a dict of tensors); save model.state_dict()")
    return state


def _members_from_weights(name: str, build_one: Callable[[], nn.Module], weights: Sequence[str | Path]):
    states = [read_state_dict(w) for w in weights]

    def build(n: int) -> list[nn.Module]:
        if n != len(states):
            raise MemberError(f"{name}: {len(states)} weight files given but {n} members asked for; pass one weight file per member")
        members = []
        for w, state in zip(weights, states):
            m = build_one()
            load_member_state(m, state, Path(w).name)
            members.append(m)
        return members

    return build


def load_member_state(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Load `state` into `module`, raising MemberError that lists missing/unexpected/mis-shaped keys."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append("shape mismatch " + "; ".join(shapes[:3]))
        raise MemberError(f"{what} does not fit the architecture: {', '.join(parts)}; save the weights of this exact model")
    module.load_state_dict(state)
