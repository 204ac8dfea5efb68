"""executor.members: the members' state as one stacked state.

Each member's parameters and buffers by dotted name (tied names kept), stacked into [N, ...] tensors, the
checks that members can be stacked (same architecture, same frozen parameters, no trainable tensor shared
between members), and the module tree that holds the stacked tensors under one member's names (which refuses
torch's utilities that would reparametrize a stacked tensor as one tensor of all members: prune, spectral_norm).
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import sys
import warnings
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from stagewise.executor.constants import _attr
from stagewise.executor.subgraphs import root_outside, walk
from stagewise.planner.errors import MemberError
from stagewise.planner.snapshot import deepcopy_module, state_refusal


def copy_member(member: nn.Module, i: int, why: str) -> nn.Module:
    """deepcopy_module(member); MemberError naming member `i`, `why` stagewise copies it, and the usual fix."""
    try:
        return deepcopy_module(member)
    except Exception as e:  # a module torch cannot copy (the old nn.utils.weight_norm's derived weight, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise MemberError(f"member {i} cannot be copied ({type(e).__name__}: {first}); {why}. Models using "
                          "torch.nn.utils.weight_norm can use torch.nn.utils.parametrizations.weight_norm instead; "
                          "otherwise make the module deep-copyable") from e


def member_list(members: Any, where: str) -> list[nn.Module]:
    """`members` as a list of modules; MemberError naming what was given instead and the way to modules: state dicts
    or file paths (load them), a method not called (`src.members`), one module, a torch.compile / DDP wrapper (its
    model), a lazy module not yet run, a quantized one."""
    if isinstance(members, (nn.ModuleList, nn.Sequential)):
        members = list(members)  # a container of the members: its modules are they
    if isinstance(members, (dict, nn.ModuleDict)):  # iterating would hand on its keys: "member 0 is a str"
        values = list(members.values())
        if values and all(isinstance(v, torch.Tensor) for v in values):
            raise MemberError(f"{where} takes the N members as a list or tuple of modules, got one state dict (a dict of "
                              f"{len(values)} tensors): load each member's state dict into a model "
                              "(model.load_state_dict(sd)) and pass [model_0, model_1, ...]")
        raise MemberError(f"{where} takes the N members as a list or tuple of modules, got a {type(members).__name__} "
                          f"(keys {list(members)[:3]}{', ...' if len(members) > 3 else ''}): pass list(d.values()), in the "
                          "order the members' outputs should come out")
    if isinstance(members, nn.Module):
        raise MemberError(f"{where} takes the N members as a list of modules, got one {type(members).__name__}: pass "
                          "[member_0, member_1, ...] (or src.members(n))")
    if callable(members) and not isinstance(members, (list, tuple)):
        raise MemberError(f"{where} takes the N members as a list of modules, got {getattr(members, '__qualname__', type(members).__name__)!r}, "
                          "a function: call it (src.members(n))")
    try:
        members = list(members)
    except TypeError:
        raise MemberError(f"{where} takes the N members as a list of modules, got a {type(members).__name__}") from None
    for i, m in enumerate(members):
        if isinstance(m, nn.Module):
            inner = getattr(m, "_orig_mod", None) if type(m).__name__ == "OptimizedModule" else \
                getattr(m, "module", None) if type(m).__name__ in ("DistributedDataParallel", "DataParallel") else None
            if isinstance(inner, nn.Module):
                attr = "_orig_mod" if type(m).__name__ == "OptimizedModule" else "module"
                raise MemberError(f"member {i} is a {type(m).__name__} wrapper: pass the model it wraps (m.{attr}); "
                                  "stagewise batches the members' own modules (to compile, set strategy='compile' on stages, or let executor.autotune choose it)"
                                  if attr == "_orig_mod" else
                                  f"member {i} is a {type(m).__name__} wrapper: pass the model it wraps (m.{attr})")
            refusal = state_refusal(m)
            if refusal:
                raise MemberError(f"member {i}: {refusal}")
            continue
        if isinstance(m, dict):
            fix = "load each into a model first (model.load_state_dict(sd)), or planner.load_source(path, weights=files)"
        elif isinstance(m, (str, bytes, os.PathLike)):
            fix = "load the weight files with planner.load_source(model_file, weights=files).members(n)"
        else:
            fix = "pass nn.Module instances"
        raise MemberError(f"member {i} is a {type(m).__name__}, not an nn.Module: {where} takes the N members as "
                          f"modules; {fix}")
    return members  # (how many: the plan's count check names it, with the fix)


def state_device(module: nn.Module) -> torch.device | None:
    """The device of `module`'s first parameter or buffer; None for a module without state."""
    t = next(itertools.chain(module.parameters(), module.buffers()), None)
    return t.device if t is not None else None


def check_one_device(members: Sequence[nn.Module]) -> None:
    """MemberError naming the first parameter or buffer that is on another device than member 0's first one (on the
    meta device: no values, a model made under torch.device("meta") whose weights were never loaded)."""
    first = state_device(members[0])
    for i, m in enumerate(members):
        for k, t in itertools.chain(m.named_parameters(), m.named_buffers()):
            if t.device == first:
                continue  # (every member on meta is a module of shapes alone, as torch would make it)
            if t.is_meta:
                raise MemberError(f"member {i}'s {k} is on the meta device, which holds no values (a model made under "
                                  "torch.device('meta') whose weights were never loaded): load its weights "
                                  "(load_state_dict(..., assign=True) or to_empty() and then load) before building")
            if t.device != first:
                raise MemberError(f"member {i}'s {k} is on {t.device}, member 0's state on {first}: move every member to "
                                  "one device (member.to(device)) before building; executor.build(..., device=...) "
                                  "chooses where the batched module runs")


def member_state(member: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of one member by dotted name, every name of a tied tensor included.

    A tensor reachable under several names (an embedding tied to the output head)
    appears once per name, as the same object: a stage reading `head.weight` must
    receive this member's tensor even when `emb.weight` is read by another stage.
    """
    named = list(member.named_parameters(remove_duplicate=False)) + list(member.named_buffers(remove_duplicate=False))
    return dict(named)


def tied_names(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Alias name -> first name, for tensors of `state` reachable under several names."""
    first: dict[int, str] = {}
    alias = {}
    for k, t in state.items():
        owner = first.setdefault(id(t), k)
        if owner != k:
            alias[k] = owner
    return alias


def stack_member_state(members: Sequence[nn.Module], device: torch.device) -> dict[str, torch.Tensor]:
    """Stack member state into [N, ...] tensors; MemberError names the first mismatching member and key.

    Names tied to one tensor in every member share one stacked tensor (the aliasing
    is kept, so an in-place update reaches every stage that reads it).
    """
    states = [member_state(m) for m in members]
    ref = states[0]
    for i, st in enumerate(states[1:], start=1):
        if st.keys() != ref.keys():
            missing = sorted(ref.keys() - st.keys())
            extra = sorted(st.keys() - ref.keys())
            raise MemberError(f"member {i} does not match member 0: missing {missing[:3]}, unexpected {extra[:3]}; all members must share one architecture")
        for k, t in st.items():
            if t.shape != ref[k].shape or t.dtype != ref[k].dtype:
                raise MemberError(
                    f"member {i} has {k} of shape {list(t.shape)} {t.dtype}, member 0 has {list(ref[k].shape)} {ref[k].dtype}; "
                    "all members must share one architecture"
                )
    ties = [tied_names(st) for st in states]
    shared_ties = {k: v for k, v in ties[0].items() if all(t.get(k) == v for t in ties[1:])}
    stacked: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for k in ref:
            if k in shared_ties:
                stacked[k] = stacked[shared_ties[k]]
            else:
                stacked[k] = torch.stack([st[k].detach() for st in states]).to(device)
    return stacked


def check_same_requires_grad(members: Sequence[nn.Module]) -> None:
    """MemberError naming the first member that freezes other parameters than member 0 (see frozen_apart)."""
    why = frozen_apart(members)
    if why:
        raise MemberError(why)


def frozen_apart(members: Sequence[nn.Module]) -> str:
    """Why the members cannot train as one module where one freezes other parameters than member 0 ("" when they
    freeze alike): a stacked parameter has one requires_grad for all members (member 0's would be trained, or frozen,
    for every member). Inference is unaffected."""
    ref = {k: p.requires_grad for k, p in members[0].named_parameters(remove_duplicate=False)}
    for i, m in enumerate(members[1:], start=1):
        differ = [(k, p.requires_grad) for k, p in m.named_parameters(remove_duplicate=False) if k in ref and ref[k] != p.requires_grad]
        if differ:
            frozen = [k for k, rg in differ if not rg]
            trained = [k for k, rg in differ if rg]
            what = "; ".join(part for part in (
                f"member {i} freezes {frozen[:3]}{' ...' if len(frozen) > 3 else ''} (requires_grad=False), which member 0 trains" if frozen else "",
                f"member {i} trains {trained[:3]}{' ...' if len(trained) > 3 else ''}, which member 0 freezes (requires_grad=False)" if trained else "",
            ) if part)
            return (f"{what}: a stacked parameter has one requires_grad for all members, so it would be trained or frozen "
                    "for every member alike. Freeze the same parameters in every member (p.requires_grad_(False) on each), "
                    "or build the members that differ here as separate modules")
    return ""


def frozen_apart_flags(members: Sequence[nn.Module]) -> dict[str, bool]:
    """Parameter names some member freezes otherwise than member 0 (see frozen_apart) -> member 0's requires_grad, the
    flag the stacked parameter is built with. Training stays refused while a stacked parameter keeps that flag; once
    set otherwise on the batched module (`ens.stacked.fc1.requires_grad_(False)` where member 0 trained it), it is
    one flag for every member, as in a member loop whose members all hold it so."""
    ref = {k: p.requires_grad for k, p in members[0].named_parameters(remove_duplicate=False)}
    return {k: ref[k] for m in members[1:] for k, p in m.named_parameters(remove_duplicate=False)
            if k in ref and ref[k] != p.requires_grad}


def ties_apart(members: Sequence[nn.Module]) -> dict[str, list[int]]:
    """Parameter names tied to another name in some members but not in all (a sweep over `tie_word_embeddings`)
    -> the members that tie them. Stacked apart (stack_member_state keeps only ties every member has), a tied
    member's two names are two tensors: forward is the same, training would update them apart."""
    ties = [tied_names(dict(m.named_parameters(remove_duplicate=False))) for m in members]
    out: dict[str, list[int]] = {}
    for i, t in enumerate(ties):
        for alias, first in t.items():
            if not all(other.get(alias) == first for other in ties):
                out.setdefault(f"{alias} = {first}", []).append(i)
    return out


def gradient_hooks(members: Sequence[nn.Module]) -> list[str]:
    """Names of parameters some member holds with gradient hooks (Tensor.register_hook,
    register_post_accumulate_grad_hook). The stacked copies carry none, so training would leave out what they do."""
    out = []
    for m in members:
        for name, p in m.named_parameters(remove_duplicate=False):
            if (getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)) and name not in out:
                out.append(name)
    return out


# all N members while one rank's slice of them is built alone (executor.distributed.build_sharded)
_WHOLE_SET: contextvars.ContextVar[tuple[list[nn.Module], range] | None] = contextvars.ContextVar("stagewise_whole_set",
                                                                                                  default=None)


@contextlib.contextmanager
def slice_of(everyone: Sequence[nn.Module], indices: range) -> Iterator[None]:
    """Inside: the checks for state members share (shared_across_members, aliasing_of's buffers), given the members
    `indices` of `everyone`, look over all of them and name them by their place there, as for one process holding all:
    a rank builds its slice alone, and a tensor its members share with another rank's is one tensor in the member loop."""
    token = _WHOLE_SET.set((list(everyone), indices))
    try:
        yield
    finally:
        _WHOLE_SET.reset(token)


def _whole_set(members: Sequence[nn.Module]) -> Sequence[nn.Module]:
    """All the members `members` is the slice of (inside slice_of, for exactly those modules), else `members`."""
    whole = _WHOLE_SET.get()
    if whole is None:
        return members
    everyone, indices = whole
    if len(members) == len(indices) and indices.stop <= len(everyone) and all(m is everyone[i] for m, i in zip(members, indices)):
        return everyone
    return members


def shared_across_members(members: Sequence[nn.Module]) -> dict[str, bool]:
    """Names of parameters that two members hold as one tensor, or as tensors on one memory (members made with
    `load_state_dict(..., assign=True)` from one state dict) -> whether a member holding it trains it now. Stacked,
    each member gets its own copy: forward is the same, but training would update the copies apart where the loop
    updates one memory. Frozen ones are kept too: the batched module refuses training once one is made trainable on
    it (gradual unfreezing of a shared backbone, `ens.stacked.backbone.requires_grad_(True)`), as it refuses a shared
    parameter trainable at build; frozen, the copies stay alike. A rank's slice (slice_of): over all the members."""
    by_name: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for i, m in enumerate(_whole_set(members)):
        for name, p in m.named_parameters():
            by_name.setdefault(name, []).append((i, p))
    return {name: any(p.requires_grad for _, p in held) for name, held in by_name.items()
            if len(held) > 1 and _overlapping(held, one_object_too=True)}


class _Watched(dict):
    """A module's `_parameters` / `_buffers` dict that raises a shared flag when a tensor is put in or taken out."""

    def __init__(self, changed: list[bool], *args):
        super().__init__(*args)
        self.changed = changed

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.changed[0] = True

    def __delitem__(self, key):
        refusal = _reparametrization_refusal(key)
        if refusal:
            if self.get(f"{key}_orig") is self.get(key):  # prune registered `weight_orig` first: left as it was
                dict.pop(self, f"{key}_orig", None)
            raise MemberError(refusal)
        super().__delitem__(key)
        self.changed[0] = True

    def __reduce__(self):
        """Pickled as the flag and the items (unpickling fills a dict subclass item by item before its attributes)."""
        return _Watched, (self.changed, dict(self))


# torch's utilities that reparametrize a module's tensor, by their file: each first takes the tensor out of the module
# (`del module._parameters[name]`, `delattr(module, name)`), which is where a state tree refuses them (_Watched)
_REPARAMETRIZING = {
    "prune.py": ("torch.nn.utils.prune",
                 "would rank all N members' values together (one threshold over the stacked tensor, where pruning "
                 "each member ranks its own)", "prune.l1_unstructured(member.fc1, 'weight', amount=...), then "
                 "prune.remove(member.fc1, 'weight'), which planning needs"),
    "spectral_norm.py": ("torch.nn.utils.spectral_norm",
                         "would take one spectral norm of the stacked tensor, all members as one matrix",
                         "torch.nn.utils.parametrizations.spectral_norm(member.fc1)"),
    "weight_norm.py": ("torch.nn.utils.weight_norm",
                       "would take its norm over the stacked tensor's dim 0, the member axis",
                       "torch.nn.utils.parametrizations.weight_norm(member.fc1)"),
    "parametrize.py": ("torch.nn.utils.parametrize (parametrizations.spectral_norm, weight_norm, orthogonal, ...)",
                       "would treat the stacked tensor as one tensor (a norm or a decomposition over all members "
                       "together)", "torch.nn.utils.parametrizations.spectral_norm(member.fc1), or "
                       "parametrize.register_parametrization(member.fc1, 'weight', ...)"),
}
_UTILS_DIR = os.sep + os.path.join("torch", "nn", "utils") + os.sep
_MODULE_FILE = os.sep + os.path.join("torch", "nn", "modules", "module.py")
_PARAMETRIZE_FILE = _UTILS_DIR + "parametrize.py"


def _reparametrization_refusal(key: str) -> str | None:
    """Why one of torch's reparametrizing utilities (prune, spectral_norm, weight_norm, parametrize) may not take the
    state tree's tensor `key` out, where it is what calls (through Module.__delattr__ or not); None otherwise."""
    frame = sys._getframe(2)  # past this function and _Watched.__delitem__
    for _ in range(3):
        if frame is None or not frame.f_code.co_filename.endswith(_MODULE_FILE):
            break
        frame = frame.f_back
    filename = frame.f_code.co_filename if frame is not None else ""
    what = _REPARAMETRIZING.get(os.path.basename(filename)) if _UTILS_DIR in filename else None
    if what is None:
        return None
    return _refusal(what, repr(key))


def _registering_parametrization() -> str | None:
    """The tensor name torch's parametrize.register_parametrization is registering, where it is among the few callers
    (through is_parametrized); None otherwise."""
    frame = sys._getframe(2)  # past this function and StateNode.__getattr__
    for _ in range(3):
        if frame is None:
            return None
        if frame.f_code.co_name == "register_parametrization" and frame.f_code.co_filename.endswith(_PARAMETRIZE_FILE):
            return str(frame.f_locals.get("tensor_name", "?"))
        frame = frame.f_back
    return None


def _refusal(what: tuple[str, str, str], tensor: str) -> str:
    """The refusal of a reparametrizing utility `what` (see _REPARAMETRIZING) on the state tree's `tensor`."""
    util, mixes, fix = what
    return (f"{util} on the batched module's stacked state (ens.stacked..., tensor {tensor}, [N, ...]): it {mixes}, and "
            "the batched module never runs ens.stacked's modules nor their hooks, reading its stacked tensors "
            "directly; refused, the state is left as it was. Apply it to each member before planning and building "
            f"({fix}); after training, load ens.member_state_dicts() into the members, apply it there and build again")


class StateNode(nn.Module):
    """A module of the stacked state tree. Replacing one of its tensors (`tree.fc.bias = nn.Parameter(...)`,
    `load_state_dict(..., assign=True)`, `torch.func.functional_call`) raises `changed[0]`, shared by the
    whole tree, so the batched module reads the new tensor instead of the one it was built with. torch's prune,
    spectral_norm, weight_norm and parametrize are refused before they change it (see _REPARAMETRIZING)."""

    def __init__(self, changed: list[bool], path: str = "", modes: list | None = None):
        super().__init__()
        self.__dict__.update(_parameters=_Watched(changed), _buffers=_Watched(changed), changed=changed,
                             _path=path, _modes=modes if modes is not None else [None], _mirrors=None)

    # The layer class of the members' module at this path (torch.nn's: nn.BatchNorm2d, nn.Dropout), which the node
    # reports as its class, so that `isinstance(m, nn.Dropout)` over `ens.modules()` finds it, and its train() /
    # eval() reach the layers the stages run (MC dropout, BatchNorm frozen for fine-tuning: see __setattr__)
    @property
    def __class__(self) -> type:
        return self.__dict__.get("_mirrors") or type(self)

    def __reduce_ex__(self, protocol: int) -> Any:
        return (_new_state_node, (type(self),), self.__getstate__())

    def __setattr__(self, name: str, value: Any) -> None:
        mirrors = self.__dict__.get("_mirrors")
        if mirrors is not None and name != "training" and not name.startswith("_") \
                and not isinstance(value, (torch.Tensor, nn.Module)) and name not in self.__dict__:
            # `m.p = 0.0` on a Dropout found by class, `m.momentum = 0.01` on a BatchNorm: the stages' layers are the
            # members', which this node is not (it would hold the number and nothing would read it)
            raise AttributeError(
                f"{self.__dict__['_path']!r} of the batched module is the members' {mirrors.__name__} as stacked state, "
                f"not the layer the stages run: setting {name!r} here would change nothing. Set it on the members "
                "before executor.build (train() / eval() here do reach the layers)")
        modes = self.__dict__.get("_modes")
        if isinstance(value, nn.Module) and modes and modes[0] is not None:
            # `ens.stacked.head = saved_head`, a LoRA wrapper put in a layer's place, `ens.stacked.fc2 = ens.stacked.fc1`:
            # the stages run the layers build made, not this tree's modules, so the module would change nothing
            where = f"{self.__dict__['_path']}.{name}" if self.__dict__.get("_path") else name
            raise AttributeError(
                f"assigning a module to {where!r} of the batched module's state tree changes nothing the stages run "
                "(they run the layers build made, reading this tree's tensors). To change weights, load them in place "
                "(ens.load_member_state_dict(i, state), ens.load_state_dict(...), or copy_ into ens.stacked_state under "
                "torch.no_grad()); to change the architecture (an adapter, another head, a tie), change the members and "
                "build again")
        super().__setattr__(name, value)
        if name == "training":  # (train()/eval() set it here too) the layers at this path follow
            modes = self.__dict__.get("_modes")
            owner = modes[0] if modes else None
            if owner is not None:
                owner._layer_mode(self.__dict__["_path"], bool(value))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """torch's load_state_dict (`ens.load_state_dict(checkpoint)`, `ens.stacked.load_state_dict(...)`) reaches each
        node here, the root first: refused before any tensor is copied where the members load their state with
        code of their own, which the stacked rows would skip (a derived buffer left as the members built it)."""
        modes = self.__dict__.get("_modes")
        owner = modes[0] if modes else None
        if owner is not None:
            from stagewise.executor.build import load_aliased_refusal, load_hooks_refusal  # build imports this module
            path = self.__dict__["_path"]
            how = f"load_state_dict on {path!r} of the batched module" if path else "load_state_dict of the batched module"
            # (torch hands a node below the root only its own keys: a name aliased outside it is checked at the root,
            # or where load_state_dict was called on the node itself)
            why = load_hooks_refusal(owner, how, under=path) or (
                load_aliased_refusal(owner, how, state_dict, prefix, path) if not path else "")
            if why:
                raise MemberError(why)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def load_state_dict(self, state_dict, *args, **kwargs):
        """nn.Module's, on a node of the state tree (`ens.stacked.fc.load_state_dict(...)`): a load into names the
        members alias with names outside the node is refused as a load from the root refuses it."""
        modes = self.__dict__.get("_modes")
        owner = modes[0] if modes else None
        path = self.__dict__.get("_path")
        if owner is not None and path:
            from stagewise.executor.build import load_aliased_refusal  # build imports this module
            full = {f"{path}.{k}": v for k, v in state_dict.items()}  # the names as the members hold them
            why = load_aliased_refusal(owner, f"load_state_dict on {path!r} of the batched module", full, "", "")
            if why:
                raise MemberError(why)
        return super().load_state_dict(state_dict, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """nn.Module's lookup of parameters, buffers and submodules; parametrize.register_parametrization is refused
        at its first look (`module.parametrizations`), before a right_inverse (orthogonal's) writes the tensor."""
        registering = _registering_parametrization() if name == "parametrizations" else None
        if registering is not None:
            raise MemberError(_refusal(_REPARAMETRIZING["parametrize.py"], repr(registering)))
        try:
            return super().__getattr__(name)
        except AttributeError:
            mirrors = self.__dict__.get("_mirrors")
            if mirrors is None or name.startswith("__"):
                raise
            raise AttributeError(
                f"{self.__dict__['_path']!r} of the batched module is the members' {mirrors.__name__} as stacked state "
                f"([N, ...] tensors; its train() / eval() reach the layer the stages run), not the layer itself: it has "
                f"no {name!r}. Set layer settings on the members before executor.build (a BatchNorm's statistics: "
                "executor.update_bn)") from None

    def _never_fires(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        """A module hook registered here, with a warning: this module holds state and is never called, so the hook
        never fires. A warning, not a refusal: tools that hook every submodule (a model summary) still run."""
        warnings.warn(
            f"{kind} on a module of the batched module's stacked state (ens.stacked...): it holds the members' stacked "
            "parameters and buffers ([N, ...]) and is never called (the plan's stages run the members' ops), so the hook "
            "never fires. Put the hook's work into forward() before planning (return the feature it would take), "
            "or run it on the batched module's outputs (ens.register_forward_hook(...) fires on every call, with N-first "
            "outputs); hooks on the members themselves are refused at planning", UserWarning, stacklevel=3)
        return getattr(super(), kind)(*args, **kwargs)

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._never_fires("register_forward_hook", *args, **kwargs)

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._never_fires("register_forward_pre_hook", *args, **kwargs)

    def register_full_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._never_fires("register_full_backward_hook", *args, **kwargs)

    def register_full_backward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._never_fires("register_full_backward_pre_hook", *args, **kwargs)

    def register_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._never_fires("register_backward_hook", *args, **kwargs)


def mirror_layer_classes(tree: StateNode, member: nn.Module) -> None:
    """Give `tree` a node for each module of `member` (a Dropout or ReLU holds no state, so stacking made none), and
    have each report the class of the member's module at its path as its own where that is a layer of torch.nn's:
    `isinstance(m, nn.Dropout)` over `ens.modules()` then finds it, and its train() / eval() reach the layer the
    stages run (see StateNode)."""
    changed, modes = tree.__dict__["changed"], tree.__dict__["_modes"]
    for path, layer in member.named_modules():
        if not path:
            continue
        owner, parts = tree, path.split(".")
        for k, part in enumerate(parts):
            if part not in owner._modules:
                owner._modules[part] = StateNode(changed, ".".join(parts[:k + 1]), modes)
            owner = owner._modules[part]
            if owner is None or not isinstance(owner, StateNode):
                break
        else:
            cls = type(layer)
            if (cls.__module__ or "").startswith("torch.nn.") and cls is not nn.Module:
                owner.__dict__["_mirrors"] = cls
    for path, layer in member.named_modules():  # in the member's order (`print(ens)` reads as the model does)
        try:
            node = tree.get_submodule(path) if path else tree
        except AttributeError:
            continue
        if isinstance(node, StateNode):
            order = [k for k in layer._modules if k in node._modules] + [k for k in node._modules if k not in layer._modules]
            node.__dict__["_modules"] = {k: node._modules[k] for k in order}


def _new_state_node(cls: type) -> StateNode:
    """An empty StateNode for unpickling (its state, __dict__, follows): a node reports a layer class as its own."""
    return cls.__new__(cls)


def state_tree(stacked: dict[str, torch.Tensor], params: dict[str, bool], persistent: set[str]) -> StateNode:
    """Stacked member state as a module tree mirroring one member's: `tree.fc1.weight` is [N, *fc1.weight.shape].

    Names in `params` become nn.Parameters (requires_grad as given; a tied tensor is one Parameter
    under each of its names); the rest are buffers, in the state_dict when in `persistent`.
    `tree.changed[0]` is set when a tensor of the tree is replaced (see StateNode); it starts False.
    """
    changed, modes = [False], [None]
    root = StateNode(changed, "", modes)
    as_param: dict[int, nn.Parameter] = {}
    for name, t in stacked.items():
        owner = root
        *path, leaf = name.split(".")
        for k, part in enumerate(path):
            if part not in owner._modules:
                owner.add_module(part, StateNode(changed, ".".join(path[:k + 1]), modes))
            owner = owner._modules[part]
        if name in params:
            p = as_param.get(id(t))
            if p is None:
                p = as_param[id(t)] = nn.Parameter(t, requires_grad=params[name])
            owner.register_parameter(leaf, p)
        else:
            owner.register_buffer(leaf, t, persistent=name in persistent)
    changed[0] = False
    return root


def tree_tensor(tree: nn.Module, name: str) -> torch.Tensor:
    """The tensor `state_tree` registered under dotted `name`; MemberError where it was taken out after build."""
    path, _, leaf = name.rpartition(".")
    try:
        owner = tree.get_submodule(path) if path else tree
        return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]
    except (AttributeError, KeyError):
        raise MemberError(f"the batched module's stacked state has no tensor {name!r} any more (taken out of "
                          f"ens.stacked after build: `del`, a module replaced, a utility moving it elsewhere), and its "
                          f"stages read it: put back a stacked [N, ...] tensor under that name "
                          f"(ens.stacked.{name} = nn.Parameter(...)), or build again from the members") from None


def _extent(t: torch.Tensor) -> tuple[torch.device, int, int, int] | None:
    """(device, storage address, first byte, byte past the last) a tensor's elements may occupy; None without storage."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass or meta tensor with no storage of its own
        return None
    if t.numel() == 0 or storage.data_ptr() == 0:
        return None
    size = t.element_size()
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return t.device, storage.data_ptr(), t.storage_offset() * size, (t.storage_offset() + span) * size


def _overlap(a: tuple | None, b: tuple | None) -> bool:
    return a is not None and b is not None and a[:2] == b[:2] and a[2] < b[3] and b[2] < a[3]


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` may share memory (one storage, overlapping first-to-last byte ranges); never for a tensor
    without storage of its own or with no elements."""
    return _overlap(_extent(a), _extent(b))


def written_state(gm: torch.fx.GraphModule) -> tuple[set[str], dict[str, str]]:
    """(state and constants forward() writes in place in any mode: what an in-place node's value may share storage
    with, a get_attr, and the running statistics F.batch_norm is handed with training=True, inside torch.export's
    `with torch.no_grad():` blocks too (a sub-graph's placeholder followed to the operand its call passes:
    executor.subgraphs); {buffer: the leaf module holding it} for the buffers of leaf modules the graph calls, which
    may update them in training mode: BatchNorm's running statistics)."""
    from stagewise.planner.capability import is_inplace, norm_stats_updated  # (capability's table of norm ops)
    from stagewise.planner.graph import renormalised_weight
    from stagewise.planner.trace_watch import storage_root

    def root(value: torch.fx.Node) -> torch.fx.Node:
        return storage_root(value, every_module=False)

    always, training = set(), {}
    for scope, node in walk(gm):
        written = ([node.args[0]] if is_inplace(node) else []) + norm_stats_updated(node)  # norms: where they update
        # F.embedding(max_norm=) renormalises its weight's rows in place; `torch.add(a, b, out=self.ema)` writes `out`
        written += [w for w in (renormalised_weight(node),) if w is not None]
        written += [t for t in tree_flatten(node.kwargs.get("out"))[0] if isinstance(t, torch.fx.Node)]
        for value in written:
            where, base = root_outside(scope, value, root)
            if where.parent is None and base.op == "get_attr":
                always.add(str(base.target))
        if node.op == "call_module" and scope.parent is None:
            layer = gm.get_submodule(str(node.target))
            training.update({f"{node.target}.{k}": str(node.target) for k, _ in layer.named_buffers()})
            if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.max_norm is not None:
                always.add(f"{node.target}.weight")  # the leaf's lookup renormalises the rows it reads, in place
    return always, training


def _tensors_of(member: nn.Module, attributes: bool) -> dict[str, tuple[torch.Tensor, str]]:
    """Every state tensor of `member` by name (each name a tied tensor has) with what it is, and, where `attributes`
    (the graph reads tensors that are no state: a constant, or what fx computed from one, `self.w_ref.t()`), its plain
    tensor attributes (`self.w_ref = self.fc.weight.data`), also one level inside a list, tuple or dict attribute:
    training a parameter they alias would leave the graph's copy behind."""
    out = {k: (p, "parameter") for k, p in member.named_parameters(remove_duplicate=False)}
    out.update({k: (b, "buffer") for k, b in member.named_buffers(remove_duplicate=False)})
    if not attributes:
        return out
    for prefix, module in member.named_modules(remove_duplicate=False):
        # torch's old weight_norm / spectral_norm: the attribute their pre-hook sets anew before every forward()
        remade = {getattr(h, "name", None) for h in module._forward_pre_hooks.values()
                  if type(h).__module__.startswith("torch.nn.utils.")}
        for attr, value in vars(module).items():
            name = f"{prefix}.{attr}" if prefix else attr
            if attr in remade or name in out:
                continue
            items = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple))
                     else [(None, value)])
            for key, item in items:
                if isinstance(item, torch.Tensor):
                    out[name if key is None else f"{name}[{key!r}]"] = (item, "tensor attribute")
    return out


def _overlapping(items: Sequence[tuple[object, torch.Tensor]], one_object_too: bool = False) -> list[tuple[object, object]]:
    """Pairs of keys whose tensors are on overlapping memory (grouped by storage first): different tensor objects,
    or also one object under two keys where `one_object_too`."""
    by_storage: dict[tuple, list[tuple[object, torch.Tensor, tuple]]] = {}
    for key, t in items:
        extent = _extent(t)
        if extent is not None:
            by_storage.setdefault(extent[:2], []).append((key, t, extent))
    return [(a, b) for group in by_storage.values() if len(group) > 1
            for (a, ta, ea), (b, tb, eb) in itertools.combinations(group, 2) if (one_object_too or ta is not tb) and _overlap(ea, eb)]


class Aliasing:
    """Names whose tensors stacking would part (aliasing_of): one member's two names for one memory that are not one
    tensor object (a buffer registered as `fc.weight.data` or a view of it, a plain attribute the graph reads; one
    object stays tied), and one buffer (or parameter) several members hold. Stacking copies each apart, so a write the member loop
    makes through one name (forward() in place, an optimizer step, BatchNorm's running statistics) would not reach
    the others."""

    def __init__(self, within: list[tuple[str, str, str, str]], across: dict[str, list[int]],
                 member: nn.Module | None = None):
        self.within = within  # (name, its kind, other name, its kind) in member 0 (or the first member with any)
        self.across = across  # buffer or parameter name -> the members holding it as one memory
        self.parameter_names = {k for k, _ in member.named_parameters(remove_duplicate=False)} if member is not None else set()
        self.member = member  # member 0: what its own train() does to the layers (_train_override_fix)

    _FIX = ("give each name its own tensor (a copy), or read one name in forward() (register the Parameter itself under "
            "both names to tie them)")

    def build_refusal(self, always: set[str]) -> str:
        """Why no batched module can be built: forward() writes such a name in place in every mode."""
        return self._refusal(always, "forward() writes it in place")

    def training_mode_refusal(self, in_training: set[str]) -> str:
        """Why the batched module cannot run in training mode: a layer updates such a buffer there (BatchNorm)."""
        return self._refusal(in_training, "a layer updates it in training mode (BatchNorm's running statistics)",
                             training=True)

    def _train_override_fix(self, name: str) -> str:
        """For a buffer several members share that a layer updates in training mode now: the fix where the members'
        own train() would put that layer in eval (mmcv's norm_eval: a frozen shared backbone's BatchNorm). A module is
        built in training mode, and its train() override runs only once .train() is called, so fresh members hold the
        shared layer in training mode; after member.train() it is in eval, and they build (the loop runs them so)."""
        member = self.member
        if member is None or all(type(m).train is nn.Module.train for m in member.modules()):
            return ""
        from stagewise.executor.modes import train_on_copy  # modes imports more of the executor; kept local
        owner = name.rpartition(".")[0]
        try:
            if train_on_copy(member, True).get_submodule(owner).training:
                return ""
        except Exception:  # noqa: BLE001 - a train() that fails on a copy: no fix to name
            return ""
        cls = next((type(m).__name__ for path, m in sorted(member.named_modules(), key=lambda pm: -len(pm[0]))
                    if (not path or owner == path or owner.startswith(path + ".")) and type(m).train is not nn.Module.train),
                   type(member).__name__)
        return (f"; or, since {cls}.train() keeps that layer in eval (a frozen shared backbone), call .train() on "
                "each member before build (`for m in members: m.train()`): a module starts in training mode, its "
                "train() override not yet run, so the shared layer is in training mode now")

    def _refusal(self, written: set[str], how: str, training: bool = False) -> str:
        for a, ka, b, kb in self.within:
            if a in written or b in written:
                return (f"member 0's {ka} `{a}` and {kb} `{b}` are two tensors on one memory, and {how}: the batched "
                        "module stacks each name apart, so the write would not reach the other name as it does in the "
                        f"member loop; {self._FIX}")
        for name, owners in self.across.items():
            if name in written:
                kind = "parameter" if name in self.parameter_names else "buffer"
                return (f"members {owners} hold one tensor as {kind} `{name}`, and {how}: the member loop updates that "
                        "one tensor member after member, the batched module would update a copy per member; give each "
                        "member its own (copy.deepcopy the module for each member)"
                        + (self._train_override_fix(name) if training else ""))
        return ""

    def load_refusals(self, stacked: dict[str, torch.Tensor]) -> dict[str, tuple[str, Any]]:
        """{name: (why loading it into one member's row alone differs from the member's own load, what it is aliased
        with)}: a tensor several members hold (the member's own load writes it for all of them: a list of members),
        and one member's two names on one memory that the batched module stacks apart (the other name)."""
        out: dict[str, tuple[str, Any]] = {}
        for name, owners in self.across.items():
            out[name] = (f"members {owners} hold `{name}` as one tensor (a shared module), which a member's own "
                         "load_state_dict writes for all of them and the batched module holds a copy of per member",
                         owners)
        for a, ka, b, kb in self.within:
            if stacked.get(a) is not stacked.get(b):
                out.setdefault(a, (f"the members' {ka} `{a}` and {kb} `{b}` are on one memory, which a member's own "
                                   "load_state_dict writes through either name and the batched module stacks apart", b))
                out.setdefault(b, (f"the members' {kb} `{b}` and {ka} `{a}` are on one memory, which a member's own "
                                   "load_state_dict writes through either name and the batched module stacks apart", a))
        return out

    def parameters(self) -> list[tuple[str, str]]:
        """(parameter, the other name on its memory, in words): an optimizer step on the stacked parameter would leave
        the other name's copy behind."""
        return [(a, f"{kb} `{b}`") if ka == "parameter" else (b, f"{ka} `{a}`")
                for a, ka, b, kb in self.within if "parameter" in (ka, kb)]


def aliasing_of(members: Sequence[nn.Module], gm: torch.fx.GraphModule) -> Aliasing:
    state = {k for k, _ in members[0].named_parameters(remove_duplicate=False)} | {k for k, _ in members[0].named_buffers(remove_duplicate=False)}
    reads_constants = any(n.op == "get_attr" and str(n.target) not in state and isinstance(_attr(scope.gm, str(n.target)), torch.Tensor)
                          for scope, n in walk(gm))
    within: list[tuple[str, str, str, str]] = []
    for member in members:
        named = _tensors_of(member, reads_constants)
        within = [(a, named[a][1], b, named[b][1]) for a, b in _overlapping([(k, t) for k, (t, _) in named.items()])]
        if within:
            break  # one member's names are enough to say it
    across: dict[str, list[int]] = {}
    everyone = _whole_set(members)  # a rank's slice: a buffer its members share with another rank's is one tensor too
    # buffers, and parameters: a frozen one shared by members that forward() writes (an nn.Embedding(max_norm=)'s
    # renormalised rows, an EMA codebook updated under torch.no_grad())
    shared = [(name, "get_buffer") for name, _ in members[0].named_buffers(remove_duplicate=False)]
    shared += [(name, "get_parameter") for name, _ in members[0].named_parameters(remove_duplicate=False)]
    for name, getter in shared:
        held = []
        for i, m in enumerate(everyone):
            try:
                buffer = getattr(m, getter)(name)
            except AttributeError:
                continue
            if isinstance(buffer, torch.Tensor):  # (a buffer registered as None in some members: the state check refuses)
                held.append((i, buffer))
        owners = sorted({i for pair in _overlapping(held, one_object_too=True) for i in pair})
        if owners:
            across[name] = owners
    return Aliasing(within, across, members[0])
