"""Stacked optimizers: train N members whose parameters are stacked ``[N, ...]``, with per-member hyper-parameters.

Layout. Every parameter handed to these optimizers is one *stacked* tensor whose dim 0 is the
member axis: shape ``[N, *member_shape]``, slice ``p[i]`` is member ``i``'s tensor (what
``torch.func.stack_module_state`` or a batched module's ``nn.Parameter`` holds). Its gradient has
the same layout. A per-member hyper-parameter is a length-N vector, broadcast over a parameter as a
view of shape ``[N, 1, 1, ...]``.

What it computes. ``StackedSGD``, ``StackedAdam`` and ``StackedAdamW`` update member ``i`` exactly
as ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` would update a separate model holding the slices ``p[i]``
with member ``i``'s hyper-parameters (same formulas; float32 results agree to a few ulps, as
tests/test_optim.py checks against N real torch optimizers). Each hyper-parameter (``lr``,
``momentum``, ``dampening``, ``weight_decay``, each of ``betas``, ``eps``) may be a Python scalar or a
length-N sequence / tensor. Complex parameters (an FNO's spectral weights) are stepped as torch steps them:
Adam/AdamW view a complex parameter, its grad and its state as real (``torch.view_as_real``), SGD's update is
real-linear. There is *no* parameter group per member: a step is a fixed handful of
``torch._foreach_*`` calls over the list of stacked parameters, whatever N is (the per-member
values enter as ``[N, 1, ...]`` tensor operands), so the number of kernels does not grow with N.

Where the hyper-parameters live (``opt.param_groups[g]``):

- ``"member_lr"``: float64 tensor ``[N]``; ``"lr"``: a Python float, a *shared scale*. The
  effective learning rate of member ``i`` is ``group["lr"] * group["member_lr"][i]``. A scalar
  ``lr=0.1`` is stored as ``lr=0.1, member_lr=ones(N)``; a per-member ``lr=[...]`` as ``lr=1.0,
  member_lr=[...]``. The split lets every ``torch.optim.lr_scheduler`` scheduler work unchanged: it
  writes the scalar ``group["lr"]``, so a schedule that is proportional to the base lr (StepLR,
  MultiStepLR, ExponentialLR, LambdaLR, LinearLR, CosineAnnealingLR with ``eta_min=0``, ...)
  gives every member exactly ``base_lr_i * f(t)``, as if each member had its own torch scheduler.
  Equal per-member values are stored as the scalar (``member_lr`` all 1), and then *every* torch
  scheduler acts as on one torch optimizer. Where the members' lrs differ, a torch scheduler that
  is not proportional (CosineAnnealingLR / CosineAnnealingWarmRestarts with ``eta_min != 0``,
  OneCycleLR, CyclicLR, SWALR, ReduceLROnPlateau whose min_lr floor or eps would act on a member
  differently, a scheduler class we do not know) is refused with an OptimizerError when it writes
  the lr (see ``_MemberGroup``); momentum/betas these schedulers write as floats become [N] vectors.
- ``"momentum"``, ``"dampening"``, ``"weight_decay"``, ``"eps"``: float64 tensors ``[N]``;
  ``"betas"``: a tuple of two float64 tensors ``[N]`` (given as ``(beta1_per_member, beta2_per_member)``;
  a list of one (beta1, beta2) pair per member is refused, at N=2 it would read transposed). Flags
  (``nesterov``, ``maximize``, ``amsgrad``) are one bool shared by all members: a per-member list is
  refused (a non-empty list is truthy, it would run the flag for every member).

The [N] vectors are float64 (float32 on MPS) so that ``1 - beta2 ** step`` and ``1 - lr * wd`` are
computed in double precision like torch's Python floats; each step casts the few derived [N]
coefficients to the parameter dtype once, so the big tensors are updated in float32.

Read and write them with ``opt.get_hyperparameter(name)`` / ``opt.set_hyperparameter(name, value)``
(validated; an ``lr`` written here is the effective lr). A bad value raises
``planner.OptimizerError`` naming the hyper-parameter, the problem and the fix.

Step count. Adam keeps ``state[p]["step"]`` as a float32 tensor ``[N]`` per parameter (torch keeps a
scalar tensor per parameter): all members share the same count unless ``opt.reset_member(i)``
restarts member ``i`` (its moments and step go back to zero, so its bias correction restarts too,
exactly like a fresh ``torch.optim.Adam``), or ``step(active=...)`` leaves it out.

A step of some members. ``opt.step(active=mask)`` (a bool mask of N, or the indices of the members that step) updates
those members only; every other one is left as N torch optimizers leave a model whose loss was not backpropagated
(grads None after ``zero_grad()``: torch skips such a parameter): parameters, moments, momentum buffer and step count
unchanged, whatever its gradient rows hold; state created at that step starts fresh for it. It is for the pattern
``per_member_loss[active].sum().backward()`` (PBT, bootstrap, a finished RL episode), where the members left out have
zero gradient rows, and a zero gradient is still a step here as in torch (momentum, weight decay, Adam's count: 0.11
off N torch AdamWs after two steps out). The members left out are put back after the step (their rows saved, then
copied back: the cost grows with the number left out, nothing without ``active``). A step without ``active`` where
some members' whole gradient is exactly zero while others' is not warns once (``MemberLeftOutWarning``), read
without a device sync (see ``_watch_left_out``).

Also here:

- ``clip_grad_norm_per_member_(params, max_norm, n_members, norm_type=2.0, error_if_nonfinite=False)``: each member's grads
  clipped by its own total norm (over all its slices of all params), like
  ``torch.nn.utils.clip_grad_norm_`` run on each member separately; returns the ``[N]`` norms.
- ``StackedStepLR`` / ``StackedCosineLR``: per-member schedules (every schedule parameter may be a
  scalar or length N). They compute torch's ``StepLR`` / ``CosineAnnealingLR`` in closed form per
  member and write ``group["member_lr"]`` in place; torch schedulers write the shared scale
  ``group["lr"]``, so one of each composes by multiplication with a proportional torch scheduler.
- ``StackedReduceLROnPlateau``: torch's ``ReduceLROnPlateau`` per member, stepped with one metric per member.

Members alike. Where every member of a group has the same lr, betas, eps and weight_decay and every
parameter's members are at the same step (the usual case: scalar hyper-parameters, no reset_member),
StackedAdam/AdamW take torch's own foreach Adam path call for call, on Python scalars: no [N]
coefficient tensors, the same number of passes over the stacked tensors as one foreach
torch.optim.Adam (on the 2-core CPU, an MLP of 1.7 M stacked parameters: 3.5 ms a step, as torch's
3.6 ms; the per-member formulas took 4.6 ms). Whether members are alike is read from the device once
per change of a hyper-parameter or a count, not per step.

Cost. A step is a fixed sequence of calls whatever N is (measured by tests/test_optim.py with a
TorchDispatchMode, 4 parameters: SGD with nesterov 16 non-view aten calls, Adam 32, AdamW 34, for
N=4 and N=64 alike; N torch optimizers make N times theirs). On CUDA a ``_foreach_*`` call whose
operands differ in shape (a [N, 1, ...] coefficient against an [N, ...] parameter) takes torch's
per-tensor path: one kernel per parameter and call, still independent of N. On CPU each call streams
the whole stacked tensor, so for members of a few KB a Python loop of torch optimizers can keep
more in cache; the win there is in the Python and dispatch overhead of N optimizers.

Third-party optimizers. A ``torch.optim.Optimizer`` subclass stepping a batched module's stacked parameters that is
not known to update each element alone (torch's SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam,
ASGD, Rprop, SparseAdam and the stacked optimizers here are) gets an ``executor.JointNormWarning`` at its first step,
naming it: a norm it takes over a whole parameter (SAM's gradient norm, LAMB's trust ratio) is one over all members.
Also one whose method steps such an optimizer (SAM's second_step stepping its base SGD). A class that takes no such
reduction says so with ``stagewise_per_member = True``. A SAM written as a plain class wrapping a torch optimizer
(SamsungLabs' ASAM: ``SAM(optimizer, model, rho)``) is no Optimizer: the norm itself is watched instead. While batched
modules exist, ``torch.linalg.vector_norm`` (which ``torch.norm`` and ``Tensor.norm`` call), ``torch.linalg.norm`` and
``torch._foreach_norm`` warn (``JointNormWarning``, once per call site) where they reduce over the member axis of a
stacked parameter's ``.grad`` (itself, ``.data`` or ``.detach()`` of it), outside torch's clip_grad_norm_ (warned by
executor.habits), an Optimizer's methods and a class saying ``stagewise_per_member = True``. A norm of another tensor
costs one dict lookup; compiled and traced code sees torch's functions; a function bound by name
(``from torch.linalg import vector_norm``) before the first build is not watched.

Imports nothing of ours except planner.errors (executor.habits, for the warning's category, where it warns).
"""
from __future__ import annotations

import ast
import functools
import linecache
import math
import os
import inspect
import sys
import textwrap
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from stagewise.planner.errors import OptimizerError

__all__ = [
    "StackedSGD", "StackedAdam", "StackedAdamW", "clip_grad_norm_per_member_", "MemberLeftOutWarning",
    "StackedLRScheduler", "StackedStepLR", "StackedCosineLR", "StackedReduceLROnPlateau",
]


# --- per-member values -------------------------------------------------------------------------

def _hp_dtype(device: torch.device) -> torch.dtype:
    """float64 for the [N] hyper-parameter vectors, except where the device has none (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _member_vector(owner: str, name: str, value: Any, n: int, device: torch.device,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """``value`` (scalar or length-n sequence/tensor) as a finite [n] tensor; OptimizerError otherwise."""
    dtype = dtype or _hp_dtype(device)
    try:
        t = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value, dtype=dtype)
    except (TypeError, ValueError, RuntimeError):
        raise OptimizerError(f"{owner}: {name}={value!r} is not a number or a sequence of numbers; "
                             f"pass a scalar or one number per member") from None
    if t.dim() == 0:
        t = t.expand(n)
    elif t.dim() != 1 or t.shape[0] != n:
        raise OptimizerError(f"{owner}: {name} has {t.numel()} values (shape {tuple(t.shape)}) but n_members={n}; "
                             f"pass a scalar or exactly {n} values, one per member")
    if not bool(torch.isfinite(t).all()):
        raise OptimizerError(f"{owner}: {name}={t.tolist()} is not finite; pass finite values")
    return t.to(device).clone()


def _check_range(owner: str, name: str, t: torch.Tensor, low: float, high: float | None = None,
                 high_open: bool = True) -> torch.Tensor:
    """Refuse a member whose value is outside [low, high) (or [low, high]); names the member."""
    bad = t < low
    if high is not None:
        bad = bad | ((t >= high) if high_open else (t > high))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        span = f"[{low}, {high})" if high is not None and high_open else (
            f"[{low}, {high}]" if high is not None else f">= {low}")
        raise OptimizerError(f"{owner}: {name} of member {i} is {t[i].item():g}, outside {span}; "
                             f"pass values in {span}")
    return t


def _views(coef: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """[N] coefficient as one [N, 1, ...] view per parameter (views share the storage, no kernel)."""
    by_dim: dict[int, torch.Tensor] = {}
    for p in params:
        if p.dim() not in by_dim:
            by_dim[p.dim()] = coef.view((coef.shape[0],) + (1,) * (p.dim() - 1))
    return [by_dim[p.dim()] for p in params]


def _rows(coef: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """[P, N] per-parameter coefficients as row ``i`` viewed [N, 1, ...] for parameter ``i``."""
    return [row.view((row.shape[0],) + (1,) * (p.dim() - 1)) for row, p in zip(coef.unbind(0), params)]


# --- the shared optimizer machinery ------------------------------------------------------------

class _StackedOptimizer(torch.optim.Optimizer):
    """Base: per-member hyper-parameters as [N] tensors in each param group; subclasses implement _step_group."""

    # hyper-parameter name -> (low, high or None, high_open); "lr" and "betas" handled specially
    _RANGES: dict[str, tuple[float, float | None, bool]] = {}

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], n_members: int, defaults: dict):
        if not isinstance(n_members, int) or isinstance(n_members, bool) or n_members < 1:
            raise OptimizerError(f"{type(self).__name__}: n_members={n_members!r}; pass a positive int, "
                                 f"the size of dim 0 of every stacked parameter")
        self.n_members = n_members
        self._versioned = _TensorCache()  # see _cached
        super().__init__(params, defaults)
        self._warn_grouping_by_dim()

    # torch.amp.GradScaler then hands every step to step() with its found_inf and grad_scale set (also a step it would
    # skip): step() refuses them (GRAD_SCALER_REFUSAL)
    _step_supports_amp_scaling = True

    def _warn_grouping_by_dim(self) -> None:
        warning = grouping_by_dim_warning(self.param_groups, type(self).__name__)
        if warning:
            warnings.warn(warning, stacklevel=3)

    # group normalisation: user values -> [N] tensors ------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Add a group as torch does, then check its params' member axis and turn its hyper-parameters into [N] tensors."""
        super().add_param_group(param_group)
        try:
            self.param_groups[-1] = self._watched(self.param_groups[-1])
            self._normalise(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()  # refused: the optimizer stays as it was (a left group broke every later step)
            raise

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, param_groups) and n_members: a deepcopy or pickle steps like the original."""
        return {**super().__getstate__(), "n_members": self.n_members}

    def __setstate__(self, state: dict) -> None:
        """torch's load_state_dict, deepcopy and unpickling install new group dicts: watch them too."""
        super().__setstate__(state)
        self.__dict__.setdefault("_versioned", _TensorCache())
        self.param_groups = [self._watched(g) for g in self.param_groups]

    def _watched(self, group: dict) -> "_MemberGroup":
        """``group`` as a _MemberGroup: values torch's lr schedulers write into it are checked (see _MemberGroup)."""
        ranges = dict(self._RANGES)
        if "betas" in self.defaults:
            ranges["betas"] = (0.0, 1.0, True)
        return _MemberGroup(group, owner=type(self).__name__, n=self.n_members, ranges=ranges)

    def _normalise(self, group: dict) -> None:
        """Validate the stacked params and hyper-parameters of ``group`` in place."""
        owner, n = type(self).__name__, self.n_members
        for p in group["params"]:
            if p.dim() == 0 or p.shape[0] != n:
                raise OptimizerError(f"{owner}: a parameter of shape {tuple(p.shape)} has no member axis of size "
                                     f"n_members={n} in dim 0; stack member tensors as [N, ...] "
                                     f"(torch.func.stack_module_state) or fix n_members")
            if p.is_sparse:
                raise OptimizerError(f"{owner}: sparse parameters are not supported; pass dense stacked tensors")
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        if "member_lr" not in group:  # fresh from the user: split lr into shared scale x member vector
            lr = _member_vector(owner, "lr", group["lr"], n, device)
            # equal values are one lr: stored as the scalar, every torch scheduler then acts as on one optimizer
            per_member = bool((lr != lr[0]).any())
            group["member_lr"] = lr if per_member else torch.ones_like(lr)
            group["lr"] = 1.0 if per_member else float(lr[0])
        _check_range(owner, "lr", _member_vector(owner, "lr", group["lr"], n, device), 0.0)
        if isinstance(group["lr"], torch.Tensor):  # a loaded tensor scale: a float, so every write is checked
            dict.__setitem__(group, "lr", float(group["lr"]))
        if isinstance(group, _MemberGroup):
            group.remember()
        group["member_lr"] = _check_range(owner, "lr", _member_vector(owner, "lr", group["member_lr"], n, device), 0.0)
        if "initial_member_lr" in group:  # recorded with initial_lr (see _MemberGroup.__setitem__), loaded or moved
            dict.__setitem__(group, "initial_member_lr", _check_range(
                owner, "initial_member_lr", _member_vector(owner, "initial_member_lr", group["initial_member_lr"], n,
                                                           device), 0.0))
        for name, bounds in self._RANGES.items():
            dict.__setitem__(group, name, _hyper_vector(owner, name, group[name], n, device, bounds))
        for name in _FLAGS:
            if name in group:
                dict.__setitem__(group, name, _flag(owner, name, group[name]))
        if "betas" in group:
            dict.__setitem__(group, "betas", _hyper_vector(owner, "betas", group["betas"], n, device, (0.0, 1.0, True)))
        self._check_group(group)

    def _check_group(self, group: dict) -> None:
        """Cross-field checks of a subclass (e.g. nesterov needs momentum)."""

    # hyper-parameters after construction -------------------------------------------------------
    def get_hyperparameter(self, name: str, group: int = 0) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Per-member values of ``name`` in param group ``group``: an [N] tensor (a pair for "betas"), a copy.

        ``"lr"`` is the effective learning rate ``group["lr"] * group["member_lr"]``.
        """
        g = self._group(name, group)
        if name == "lr":
            return g["lr"] * g["member_lr"]
        value = g[name]
        return tuple(b.clone() for b in value) if isinstance(value, tuple) else value.clone()

    def set_hyperparameter(self, name: str, value: Any, group: int | None = None) -> None:
        """Set ``name`` to ``value`` (scalar or length N; for "betas" a pair of those) in one or all groups.

        Validated like the constructor; raises OptimizerError naming the hyper-parameter. For ``"lr"``
        the effective lr becomes ``value``: ``member_lr = value / group["lr"]`` (the shared scale a torch
        scheduler may own is kept; a zero scale is reset to 1.0).
        """
        groups = [self._group(name, group)] if group is not None else [self._group(name, i) for i in range(len(self.param_groups))]
        trials = []
        for g in groups:
            trial = dict(g)
            if name == "lr":
                lr = _check_range(type(self).__name__, "lr", _member_vector(type(self).__name__, "lr", value, self.n_members,
                                                                          g["member_lr"].device), 0.0)
                if g["lr"] == 0:
                    trial["lr"] = 1.0
                trial["member_lr"] = lr / trial["lr"]
            else:
                trial[name] = value
            self._normalise(trial)
            trials.append(trial)
        for g, trial in zip(groups, trials):  # every group validated before any changes
            g.update({k: v for k, v in trial.items() if k != "params"})

    def _group(self, name: str, group: int) -> dict:
        """Param group ``group`` after checking that ``name`` is one of its hyper-parameters."""
        if not 0 <= group < len(self.param_groups):
            raise OptimizerError(f"{type(self).__name__}: no param group {group}; there are {len(self.param_groups)}")
        names = ["lr", *self._RANGES, *(["betas"] if "betas" in self.defaults else [])]
        if name not in names:
            raise OptimizerError(f"{type(self).__name__}: {name!r} is not a per-member hyper-parameter; "
                                 f"use one of {names}")
        return self.param_groups[group]

    # state dict: hyper-parameter tensors are copied so later in-place schedule writes don't alias ---
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["param_groups"] = [{k: _clone_value(v) for k, v in g.items()} for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then the groups re-validated; refused (an OptimizerError, a saved state of another n_members),
        the optimizer is left as it was: torch installs the saved groups and state before the checks can run."""
        before = (self.param_groups, self.state)  # torch's load installs new ones and leaves these as they are
        try:
            self._load_state_dict(state_dict)
        except Exception:
            self.param_groups, self.state = before
            self._versioned.clear()
            raise

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._versioned.clear()
        for g in self.param_groups:
            self._normalise(g)  # back onto the params' device, re-validated (n_members must match)
        for p, s in self.state.items():
            if isinstance(s.get("step"), torch.Tensor):  # torch leaves "step" where it was saved
                s["step"] = s["step"].to(device=p.device, dtype=torch.float32)
            if isinstance(s.get("momentum_members"), torch.Tensor):  # torch casts state to the params' dtype
                s["momentum_members"] = s["momentum_members"].to(device=p.device, dtype=torch.bool)
            for k, v in s.items():
                if isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] != self.n_members):
                    raise OptimizerError(f"{type(self).__name__}: saved state {k!r} has shape {tuple(v.shape)}, "
                                         f"not [{self.n_members}, ...]; load a state dict saved with the same n_members")

    # step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, active=None):
        """One update of every member; ``closure`` re-evaluates the loss as in torch.optim.

        ``active``: the members this step updates (a bool mask of N, or member indices; a tensor on the GPU is read, one
        sync); None = all. A member not
        active is left exactly as N torch optimizers leave a model whose loss was not backpropagated (every grad None
        after ``zero_grad()``): its parameters, its state (moments, momentum buffer) and its step count do not change,
        whatever its gradient rows hold. That is what a step of a subset needs (PBT, bootstrap, a finished RL episode:
        ``per_member_loss[active].sum().backward()``): without it the members left out have zero gradient rows, and a
        zero gradient is still a step (momentum, weight decay, Adam's step count), as torch steps a zero grad. Without
        ``active``, a step where some members' whole gradient is exactly zero while others' is not warns once
        (MemberLeftOutWarning)."""
        if getattr(self, "found_inf", None) is not None or getattr(self, "grad_scale", None) is not None:
            _forget_grad_scaler(self)
            raise OptimizerError(f"{type(self).__name__}: {GRAD_SCALER_REFUSAL}")
        for group in self.param_groups:
            if isinstance(group, _MemberGroup):
                group.check_unseen_writes()
        left_out = self._left_out(active)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if active is None:
            try:
                self._watch_left_out()
            except Warning:  # (warnings made errors: the caller's choice)
                raise
            except Exception:  # noqa: BLE001 - a warning's check must never stop a step (its CUDA path unmeasured)
                self.__dict__["_left_out_warned"] = True
        kept = self._keep_members(left_out) if left_out is not None else None
        for group in self.param_groups:
            for params, grads in self._buckets(group):
                self._step_group(group, params, grads)
        if kept is not None:
            self._put_back_members(left_out, kept)
        return loss

    def _left_out(self, active: Any) -> torch.Tensor | None:
        """The members `active` leaves out of this step as an int64 index tensor (None where every member is in);
        OptimizerError for a value that is neither a bool mask of N nor member indices."""
        if active is None:
            return None
        owner, n = type(self).__name__, self.n_members
        try:
            t = torch.as_tensor(active.detach() if isinstance(active, torch.Tensor) else
                                (list(active) if not isinstance(active, (list, tuple)) else active))
        except (TypeError, ValueError, RuntimeError):
            raise OptimizerError(f"{owner}.step(active={active!r}): not a mask or a list of members; pass a bool mask "
                                 f"of {n} (True: the member steps) or the indices of the members that step") from None
        t = t.cpu().reshape(-1) if t.dim() <= 1 else t
        if t.dim() != 1:
            raise OptimizerError(f"{owner}.step(active=...): shape {tuple(t.shape)}; pass a bool mask of {n} or a 1-d "
                                 f"list of member indices")
        if t.dtype == torch.bool:
            if t.numel() != n:
                raise OptimizerError(f"{owner}.step(active=...): a bool mask of {t.numel()} for {n} members; pass one "
                                     f"value per member (True: the member steps); on a sharded module (build_sharded), "
                                     f"ens.local_active(mask_of_all_N or global indices) gives this rank's")
            mask = t
        elif t.numel() == 0 or not (t.dtype.is_floating_point or t.dtype.is_complex):
            idx = t.long()
            if t.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise OptimizerError(f"{owner}.step(active={idx.tolist()}): no member {int(idx.min()) if int(idx.min()) < 0 else int(idx.max())}; "
                                     f"member indices are 0..{n - 1} (or pass a bool mask of {n})")
            mask = torch.zeros(n, dtype=torch.bool)
            mask[idx] = True
        else:
            raise OptimizerError(f"{owner}.step(active=...): {t.dtype} values; pass a bool mask of {n} (True: the "
                                 f"member steps) or integer member indices")
        out = (~mask).nonzero().flatten()
        return out if out.numel() else None

    def _keep_members(self, left_out: torch.Tensor) -> list[tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]]:
        """The rows `left_out` of every parameter this step updates (those with a grad) and of its [N, ...] state
        tensors by key, to put back after the step (_put_back_members)."""
        kept = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue  # not stepped: nothing of it changes
                idx = left_out.to(p.device)
                state = {key: value.index_select(0, idx) for key, value in self.state.get(p, {}).items()
                         if self._member_rows(value)}
                kept.append((p, state, p.index_select(0, idx)))
        return kept

    def _member_rows(self, value: Any) -> bool:
        """Whether a state value holds one row per member ([N, ...]: moments, buffers, Adam's step, momentum_members)."""
        return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == self.n_members

    def _put_back_members(self, left_out: torch.Tensor, kept: list) -> None:
        """Undo the step for the members left out: their rows of the parameters and of each state entry as they were,
        written into the tensor the entry holds now (the step may replace one: SGD's momentum_members); the rows of an
        entry the step created (a first step: Adam's moments and count, SGD's momentum buffer) as a fresh torch
        optimizer's, zero (momentum_members False: no buffer yet, its first step with momentum starts buf = grad)."""
        for p, state, rows in kept:
            idx = left_out.to(p.device)
            p.index_copy_(0, idx, rows)
            for key, value in self.state.get(p, {}).items():
                if not self._member_rows(value):
                    continue
                if key in state:
                    value.index_copy_(0, idx.to(value.device), state[key])
                else:
                    value.index_fill_(0, idx.to(value.device), 0)

    def _watch_left_out(self) -> None:
        """Warn once (MemberLeftOutWarning) at a step where some members' gradient is exactly zero in every parameter
        while others' is not: what a member left out of the loss looks like (`per_member_loss[active].sum().backward()`),
        which N torch optimizers would leave alone (grad None) and this step moves as a zero gradient.

        Cheap, and no device read per step (the step's own rule, see "Members alike"): the smallest gradient is looked
        at first (a member whose whole gradient is zero has a zero row there too), every gradient only where some
        member's row of it is zero. On CPU the rows are read as host memory (numpy: no aten op, nothing to wait for);
        on CUDA the [N] flags are computed on the device and copied to pinned memory without waiting, and looked at
        from a later step once the copy is done (the whole check then one step later). Gradients on several devices,
        or in a dtype numpy cannot read, are not checked."""
        if self.__dict__.get("_left_out_warned") or self.n_members < 2:
            return
        grads = [p.grad for group in self.param_groups for p in group["params"]
                 if p.grad is not None and not p.grad.is_sparse and p.grad.numel() > 0]
        if not grads or any(g.device != grads[0].device for g in grads):
            return
        n = self.n_members
        probe = min(grads, key=torch.Tensor.numel)
        if grads[0].is_cuda:
            pending = self.__dict__.get("_left_out_pending")
            if pending is not None:
                host, done, whole = pending
                if not done.query():
                    return  # the copy of an earlier step's flags is still on its way
                self.__dict__["_left_out_pending"] = None
                has = host.tolist()
                if whole:
                    self._judge_left_out(has)
                    return
                if all(has):
                    return
                self.__dict__["_left_out_pending"] = _flags_on_host(grads, n) + (True,)  # suspicious: all of them
                return
            self.__dict__["_left_out_pending"] = _flags_on_host([probe], n) + (False,)
            return
        if grads[0].device.type != "cpu":
            return
        has = _host_members_with_gradient([probe], n)
        if has is None or all(has):
            return
        has = _host_members_with_gradient(grads, n)
        if has is not None:
            self._judge_left_out(has)

    def _judge_left_out(self, has: list[bool]) -> None:
        """Warn where `has` (member i has a non-zero gradient element somewhere) is False for some, True for others."""
        if all(has) or not any(has):
            return
        self.__dict__["_left_out_warned"] = True
        out = [i for i, h in enumerate(has) if not h]
        warnings.warn(left_out_warning(type(self).__name__, out, self.n_members), MemberLeftOutWarning,
                      stacklevel=_callers_level())

    def _buckets(self, group: dict):
        """(params, grads) lists of the params with a grad, one pair per (device, dtype)."""
        out: dict[tuple, tuple[list, list]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise OptimizerError(f"{type(self).__name__}: sparse gradients are not supported; use dense ones")
            ps, gs = out.setdefault((p.device, p.dtype), ([], []))
            ps.append(p)
            gs.append(p.grad)
        return out.values()

    def _step_group(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _known(self, kind: str, t: torch.Tensor) -> Any:
        """What was remembered of `kind` for tensor `t` at its current version, or _UNREAD."""
        return self._versioned.known(kind, t)

    def _remember(self, kind: str, t: torch.Tensor, value: Any) -> Any:
        return self._versioned.remember(kind, t, value)

    def _cached(self, kind: str, t: torch.Tensor, compute: Callable[[torch.Tensor], Any]) -> Any:
        """compute(t), remembered per tensor and version: no device sync per step while `t` is unchanged."""
        known = self._known(kind, t)
        return self._remember(kind, t, compute(t)) if known is _UNREAD else known

    def _nonzero(self, t: torch.Tensor) -> bool:
        """Whether any member's value is non-zero (cached per tensor version)."""
        return self._cached("nonzero", t, lambda t: bool(t.any()))

    def _shared(self, t: torch.Tensor) -> float | None:
        """The value every member has in the [N] tensor ``t`` as a Python float, or None where members differ
        (cached per tensor version)."""
        return self._cached("shared", t, lambda t: float(t[0]) if bool((t == t[0]).all()) else None)

    @staticmethod
    def _coef(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """An [N] hyper-parameter expression cast once to the parameters' device and dtype."""
        return t.to(device=like.device, dtype=like.dtype)


_UNREAD = object()  # _counted: a step count not seen since it last changed


class MemberLeftOutWarning(UserWarning):
    """A stacked optimizer stepped members whose whole gradient is exactly zero while others' is not: members left out of
    the loss, which N torch optimizers would not move (their grads None) and this step does; see step(active=...)."""


def _flags_on_host(grads: Sequence[torch.Tensor], n: int) -> tuple[torch.Tensor, Any]:
    """CUDA grads: whether member i has a non-zero (or nan) gradient element in some of `grads`, as an [N] bool tensor in
    pinned host memory the device fills without the host waiting, and the event after which it is filled."""
    host = torch.empty(n, dtype=torch.bool, pin_memory=True)
    host.copy_(torch.stack([g.reshape(n, -1).ne(0).any(1) for g in grads]).any(0), non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def _host_members_with_gradient(grads: Sequence[torch.Tensor], n: int) -> list[bool] | None:
    """CPU grads: whether member i has a non-zero (or nan) gradient element in some of `grads`, read as host memory
    through numpy (no aten op: the step's op count and its no-read rule hold); None where numpy cannot read one."""
    import numpy as np

    has = np.zeros(n, dtype=bool)
    for g in grads:
        g = g.detach() if g.requires_grad else g
        try:
            if g.dtype == torch.bfloat16:  # no numpy dtype: its bits, without the sign (-0.0 is zero)
                rows = (g.view(torch.int16).numpy().reshape(n, -1) & 0x7FFF) != 0
            else:
                rows = g.numpy().reshape(n, -1) != 0
        except (TypeError, RuntimeError, ValueError):  # a float8 grad, a conjugate view: not checked
            return None
        has |= rows.any(1)
    return has.tolist()


def left_out_warning(owner: str, members: list[int], n: int) -> str:
    """The warning for members `members` of `n` whose whole gradient is exactly zero at a step of optimizer `owner`."""
    return (
        f"{owner}.step(): member(s) {members} of {n} have a gradient of exactly zero in every parameter while the others' "
        "are not: what members left out of the loss look like (per_member_loss[active].sum().backward(): PBT, bootstrap, "
        "a finished RL episode). N torch optimizers after zero_grad() would see their grads None and leave them alone; "
        "this step moves them as torch steps a zero gradient (momentum, weight decay, Adam's step count and bias "
        "correction). Fix: opt.step(active=mask), a bool mask of N (or the indices of the members that step): the others "
        "are left exactly as they are (parameters, state, step count). If a zero gradient is what you mean (a member whose "
        "loss is 0 still decaying), silence this with warnings.filterwarnings('ignore', "
        "category=stagewise.executor.MemberLeftOutWarning). Warned once per optimizer")


class _TensorCache(dict):
    """What was read of a tensor (a hyper-parameter vector, a step count) at one version: (kind, id) -> (weak reference,
    version, value). The tensor is held weakly and its entries go when it dies: a scheduler cycling momentum or betas
    (OneCycleLR) or a set_hyperparameter per step makes new [N] tensors every step, and strong references here kept
    every one of them (the cache grew by two entries a step, without bound)."""

    def known(self, kind: str, t: torch.Tensor) -> Any:
        hit = self.get((kind, id(t)))
        return hit[2] if hit is not None and hit[0]() is t and hit[1] == t._version else _UNREAD

    def remember(self, kind: str, t: torch.Tensor, value: Any) -> Any:
        key = (kind, id(t))
        hit = self.get(key)
        ref = hit[0] if hit is not None and hit[0]() is t else weakref.ref(t, functools.partial(_forget, weakref.ref(self), key))
        self[key] = (ref, t._version, value)
        return value

    def __reduce__(self):
        """A copy (deepcopy, pickle) starts empty: weak references neither copy nor pickle, and a copy reads afresh."""
        return _TensorCache, ()


def _forget(cache_ref: "weakref.ref[_TensorCache]", key: tuple, dead: "weakref.ref") -> None:
    """Weak-reference callback: drop `key` from the cache, unless it now belongs to a newer tensor of the same id."""
    cache = cache_ref()
    if cache is not None:
        hit = cache.get(key)
        if hit is not None and hit[0] is dead:
            del cache[key]


_FLAGS = ("nesterov", "maximize", "amsgrad")  # choose which update runs: one value for every member of a group


def _flag(owner: str, name: str, value: Any) -> bool:
    """A flag as one Python bool; OptimizerError for a per-member list (it was taken as True for every member, since a
    non-empty list is truthy: amsgrad=[True, False, False] ran amsgrad for all three) or any other non-bool."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.bool:
        return bool(value)
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool") and type(value).__module__ == "numpy":
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise OptimizerError(
        f"{owner}: {name}={value!r} is not one bool. {name} chooses which update every member's step runs, so it is one "
        f"flag for all members (of a param group): pass {name}=True or {name}=False. Where members differ in it, build "
        f"one optimizer per value: train the members with {name}=True and those with {name}=False as separate batched "
        f"modules, each with its own stacked optimizer")


def _hyper_vector(owner: str, name: str, value: Any, n: int, device: torch.device,
                  bounds: tuple[float, float | None, bool]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A hyper-parameter as validated [n] tensor(s): ``betas`` a pair of them, the others one."""
    low, high, high_open = bounds
    if name != "betas":
        return _check_range(owner, name, _member_vector(owner, name, value, n, device), low, high, high_open)
    pairs = isinstance(value, (tuple, list)) and len(value) > 0 and all(
        isinstance(b, (tuple, list)) and len(b) == 2 for b in value)
    # at N=2 a tuple of two pairs reads both ways: as (beta1s, beta2s) where every member's beta1 < beta2 (as Adam's
    # are), else as one (beta1, beta2) per member, which is refused below
    crossed = pairs and n == 2 and len(value) == 2 and all(isinstance(x, (int, float)) for b in value for x in b) \
        and any(float(value[0][i]) >= float(value[1][i]) for i in range(2))
    if pairs and (len(value) != 2 or (n == 2 and isinstance(value, list)) or crossed):
        # one (beta1, beta2) per member, as a sweep config lists them: at N=2 it read as (beta1s, beta2s), transposed
        raise OptimizerError(
            f"{owner}: betas={value!r} reads as one (beta1, beta2) pair per member; betas is one pair of per-member "
            f"values: pass betas=(beta1_per_member, beta2_per_member), a tuple (from pairs: betas=tuple(zip(*pairs))), "
            f"each a scalar or {n} values")
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise OptimizerError(f"{owner}: betas={value!r} is not a pair; pass (beta1, beta2), "
                             f"each a scalar or one value per member")
    return tuple(_check_range(owner, f"betas[{k}]", _member_vector(owner, f"betas[{k}]", b, n, device), low, high, high_open)
                 for k, b in enumerate(value))


# --- torch's lr schedulers on a stacked optimizer ----------------------------------------------

_LRS = torch.optim.lr_scheduler
# torch schedulers whose lr is the base lr times a factor of the epoch alone (or restores it): on the shared
# scale group["lr"] they give member i base_i * f(t), what member i's own scheduler gives it
_PROPORTIONAL = (_LRS.StepLR, _LRS.MultiStepLR, _LRS.ConstantLR, _LRS.LinearLR, _LRS.ExponentialLR, _LRS.PolynomialLR,
                 _LRS.LambdaLR, _LRS.MultiplicativeLR, _LRS.SequentialLR, _LRS.ChainedScheduler)
_PROPORTIONAL_AT_ETA_MIN_0 = (_LRS.CosineAnnealingLR, _LRS.CosineAnnealingWarmRestarts)
# the group keys torch's schedulers write (OneCycleLR writes initial_lr, max_lr and min_lr first, momentum when cycling)
_SCHEDULED_KEYS = frozenset({"lr", "initial_lr", "max_lr", "min_lr", "momentum", "betas", "base_momentum",
                             "max_momentum", "swa_lr"})


def _writing_scheduler(depth: int = 3) -> Any:
    """The torch lr scheduler whose code is writing a param group's "lr" right now, or None (our own code, the user)."""
    frame = sys._getframe(depth)  # past this function, _MemberGroup._check_lr and __setitem__
    for _ in range(4):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _LRS.LRScheduler):
            return owner
        if isinstance(owner, _StackedOptimizer):
            return None
        frame = frame.f_back
    return None


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_CODE = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
             *(os.path.join(_PACKAGE, part) + os.sep for part in ("executor", "planner", "app")))


def _written_by_user() -> str | None:
    """How the user's code writing a param group's "lr" right now writes it, where that is not as N torch optimizers
    would: "absolute" (an lr of its own), "derived" (computed from the group's lr otherwise than by a factor: a floor,
    an offset), "unread" (the statement's source could not be read: exec, python -c); None where it is torch's
    (load_state_dict, a scheduler) or stagewise's code, judged by the file of the first frame past _MemberGroup, or a
    pure scaling of the group's own lr (`_scales_own_lr`: `g["lr"] *= 0.1`, `g["lr"] = g["initial_lr"] * f`: each
    member's lr scaled, as N torch optimizers would scale it)."""
    frame = sys._getframe(3)  # past this function, _MemberGroup._check_lr and __setitem__
    while frame is not None and frame.f_code.co_name in ("__setitem__", "update", "setdefault", "__ior__"):
        frame = frame.f_back
    if frame is None or os.path.abspath(frame.f_code.co_filename).startswith(_OWN_CODE):
        return None
    stmt = _statement_at(frame.f_code.co_filename, frame.f_lineno)
    if stmt is None:  # no source to read (exec, python -c, a plain REPL): whether it scales by a factor is unknown
        return "unread"
    if _scales_own_lr(stmt):
        return None
    return "derived" if _reads_own_lr(stmt) else "absolute"


@functools.lru_cache(maxsize=256)  # a hand-written schedule writes from one line every step: parsed once
def _statement_at(filename: str, lineno: int) -> ast.AST | None:
    """The statement starting at `lineno` of `filename` (up to 12 lines long; those of one line, `a; b`, together),
    parsed; None if it cannot be."""
    lines = [linecache.getline(filename, lineno + k) for k in range(12)]
    if not lines[0].strip():  # no source (exec, python -c: linecache has no lines; "" parses as an empty module)
        return None
    for k in range(1, len(lines) + 1):
        text = textwrap.dedent("".join(lines[:k]))
        try:
            body = ast.parse(text).body
        except SyntaxError:
            continue
        return body[0] if len(body) == 1 else ast.Module(body=body, type_ignores=[])  # `a; b` on one line: both
    return None


_LR_KEYS = ("lr", "initial_lr")


def _lr_of(node: ast.AST) -> str | None:
    """The ast dump of the group `node` reads an lr of (`g["lr"]`, `g["initial_lr"]`, `g.get("lr")`), or None."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in _LR_KEYS:
        return ast.dump(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args \
            and isinstance(node.args[0], ast.Constant) and node.args[0].value in _LR_KEYS:
        return ast.dump(node.func.value)
    return None


def _lr_read(node: ast.AST, group: str) -> bool:
    """Whether `node` reads `<group>`'s lr or initial_lr (`group`: the ast dump of the written group)."""
    return _lr_of(node) == group


def _reads_an_lr(node: ast.AST) -> bool:
    return any(_lr_of(n) is not None for n in ast.walk(node))


def _proportional(node: ast.AST, group: str) -> bool:
    """Whether `node` is the group's own lr times or divided by factors that read no lr (`g["lr"] * 0.5`,
    `g["initial_lr"] * f(step) / 2`): the same expression on N torch optimizers scales each member's lr by one
    factor. A floor, an offset or a condition (`max(g["lr"] * 0.5, 1e-3)`, `g["lr"] + 1e-4`) does not."""
    if _lr_read(node, group):
        return True
    if isinstance(node, ast.NamedExpr):  # `(v := g["lr"] * 0.5)`
        return _proportional(node.value, group)
    if isinstance(node, ast.IfExp):  # `g["lr"] * 0.5 if cond else g["lr"]`: a factor either way
        return not _reads_an_lr(node.test) and _proportional(node.body, group) and _proportional(node.orelse, group)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return (_proportional(node.left, group) and not _reads_an_lr(node.right)) or \
               (_proportional(node.right, group) and not _reads_an_lr(node.left))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _proportional(node.left, group) and not _reads_an_lr(node.right)
    return False


def _lr_writes(stmt: ast.stmt | None) -> list[tuple[str, ast.AST | None, bool]]:
    """The writes of a group's "lr" in `stmt` (and in statements and comprehensions inside it: a one-line `for`):
    (the written group's ast dump, the value written, whether it is an augmented `*=` / `/=` by a factor) for
    `g["lr"] = v`, `g["lr"] op= v` (the value None), `g.__setitem__("lr", v)`, `operator.setitem(g, "lr", v)`,
    `g.update(lr=v)`, `g.update({"lr": v})` and `g |= {"lr": v}`."""
    def lr_key(target: ast.AST) -> bool:
        return isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant) and target.slice.value in _LR_KEYS

    def from_dict(group: str, d: ast.AST) -> list[tuple[str, ast.AST | None, bool]]:  # `g |= {...}`, g.update({...})
        return [(group, v, False) for k, v in zip(d.keys, d.values) if isinstance(k, ast.Constant) and k.value in _LR_KEYS] \
            if isinstance(d, ast.Dict) else []

    found: list[tuple[str, ast.AST | None, bool]] = []
    for node in ast.walk(stmt) if stmt is not None else ():
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.BitOr):
            found += from_dict(ast.dump(node.target).replace("Store()", "Load()"), node.value)  # as read on the right
        elif isinstance(node, ast.AugAssign) and lr_key(node.target):
            factor = isinstance(node.op, (ast.Mult, ast.Div)) and not _reads_an_lr(node.value)
            found.append((ast.dump(node.target.value), None, factor))
        elif isinstance(node, ast.Assign):
            found += [(ast.dump(t.value), node.value, False) for t in node.targets if lr_key(t)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            group = ast.dump(node.func.value)
            if node.func.attr == "__setitem__" and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value == "lr":
                found.append((group, node.args[1], False))
            elif node.func.attr == "update":
                found += [(group, k.value, False) for k in node.keywords if k.arg in _LR_KEYS]
                found += from_dict(group, node.args[0]) if len(node.args) == 1 else []
        if isinstance(node, ast.Call) and len(node.args) == 3 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in _LR_KEYS and getattr(node.func, "attr", getattr(node.func, "id", "")) == "setitem":
            found.append((ast.dump(node.args[0]), node.args[2], False))  # operator.setitem(g, "lr", v)
    return found


def _scales_own_lr(stmt: ast.stmt | None) -> bool:
    """Whether the statement writing a group's "lr" scales that group's own lr by a factor (see _proportional):
    `g["lr"] *= f`, `g["lr"] /= f`, `g["lr"] = g["lr"] * f`, `g.__setitem__("lr", g["initial_lr"] * f)`,
    `g.update(lr=g["lr"] * f)`."""
    writes = _lr_writes(stmt)
    return bool(writes) and all(factor or (value is not None and _proportional(value, group))
                                for group, value, factor in writes)


def _reads_own_lr(stmt: ast.stmt | None) -> bool:
    """Whether a write in `stmt` computes the value from the written group's own lr (or writes it by `+=`, `**=`)."""
    for group, value, _ in _lr_writes(stmt):
        if value is None or any(_lr_read(n, group) for n in ast.walk(value)):
            return True
    return False


def _scheduler_problem(scheduler: Any, group: dict, old: float, new: float) -> str | None:
    """Why ``scheduler`` writing the shared scale ``old -> new`` does not give each member what its own scheduler
    would (member lrs differ), or None."""
    kind = type(scheduler)
    if kind in _PROPORTIONAL:
        return None
    if kind in _PROPORTIONAL_AT_ETA_MIN_0:
        if scheduler.eta_min == 0:
            return None
        return (f"{kind.__name__}(eta_min={scheduler.eta_min:g}) anneals towards an absolute lr, so on the shared scale it "
                f"gives member i lr_i * (eta_min + ...) instead of eta_min + (lr_i - eta_min) * ...; "
                f"use executor.StackedCosineLR(opt, T_max, eta_min=...) for per-member cosine annealing, or eta_min=0")
    if kind is _LRS.ReduceLROnPlateau:
        idx = next(i for i, g in enumerate(scheduler.optimizer.param_groups) if g is group)
        floor = scheduler.min_lrs[idx] if idx < len(scheduler.min_lrs) else 0.0
        member = [old * float(m) for m in group["member_lr"]]
        for i, lr in enumerate(member):
            cut = max(lr * scheduler.factor, floor)
            own = cut if lr - cut > scheduler.eps else lr  # what member i's own scheduler leaves (an lr of 0 stays 0)
            given = new * float(group["member_lr"][i])
            if not math.isclose(given, own, rel_tol=1e-9):
                return (f"ReduceLROnPlateau(min_lr={floor:g}, eps={scheduler.eps:g}) would {'set' if own != lr else 'leave'} "
                        f"member {i}'s lr {'to' if own != lr else 'at'} {own:g} where the shared scale gives it {given:g} "
                        f"(its min_lr floor and eps apply to each member's own lr); "
                        f"use min_lr=0 with lrs well above eps, or give every member the same lr")
        return None
    return (f"{kind.__name__} is not known to scale each member's base lr by one factor (OneCycleLR, CyclicLR and "
            f"SWALR write absolute lrs: N separate ones would give every member the same lr, whatever its own); "
            f"express the schedule as a factor with torch.optim.lr_scheduler.LambdaLR (it multiplies each member's "
            f"own lr), or give every member the same lr")


# what a per-member value given where an lr scale goes (a LambdaLR returning [N] values, a tensor max_lr) is told
_FACTOR_FIX = (
    "A torch scheduler's factor (LambdaLR, MultiplicativeLR) is one number for all members: it then scales each "
    "member's own lr, as N torch optimizers with that schedule would. Per-member schedules: executor.StackedStepLR / "
    "executor.StackedCosineLR (a per-member decay d_i ** epoch is StackedStepLR(opt, step_size=1, gamma=d)), or the "
    "per-member lrs given to the optimizer (lr=[...]) times one LambdaLR factor; per-member lrs now: "
    "opt.set_hyperparameter('lr', values)")
_ABSOLUTE_CYCLES = (_LRS.OneCycleLR, _LRS.CyclicLR)


def _cycle_fix(kind: str, name: str) -> str:
    """The fix for per-member values given to OneCycleLR / CyclicLR (`name`: its argument or the group key)."""
    if "momentum" in name:
        return (f"{kind} cycles one {name} per param group; it writes that momentum to every member. Pass one value "
                f"(cycle_momentum=False keeps the optimizer's per-member momentum)")
    if kind == "OneCycleLR":
        return ("OneCycleLR takes one max_lr per param group and writes absolute lrs, so it cannot peak each member at "
                "its own lr. Its lr is max_lr times a factor of the step alone, so per-member peaks are the members' "
                "own lrs times that factor: give the optimizer lr=max_lrs (one per member) and "
                "torch.optim.lr_scheduler.LambdaLR(opt, lambda step: f[step]), f[step] the lr OneCycleLR(max_lr=1.0, "
                "the same other arguments) gives a throwaway torch.optim.SGD([torch.zeros(1)], lr=1.0) at that step "
                "(momentum is then not cycled); or one max_lr for all members")
    return (f"{kind} takes one {name} per param group and writes absolute lrs, so it cannot give each member its own. "
            "Where every member's max_lr / base_lr ratio is the same, give the optimizer the per-member base lrs and "
            "the cycle as a factor: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: f(step)); or one value for all "
            "members")


def _refuse_per_member_values(name: str, optimizer: Any, param: Any) -> None:
    """OptimizerError for one value per member given where torch's OneCycleLR / CyclicLR take one per param group
    (max_lr=[...] of N values: torch's own error spoke of param_groups alone; a tensor of N values failed later, on
    group['initial_lr'], naming neither the scheduler nor the fix)."""
    n, groups = optimizer.n_members, len(optimizer.param_groups)
    per_member = (isinstance(param, (list, tuple)) and len(param) == n != groups) or \
        (isinstance(param, torch.Tensor) and param.numel() > 1)
    if not per_member:
        return
    caller = sys._getframe(2).f_locals.get("self")
    kind = type(caller).__name__ if isinstance(caller, _LRS.LRScheduler) else "this scheduler"
    shown = param.tolist() if isinstance(param, torch.Tensor) else list(param)
    shown = [round(x, 8) if isinstance(x, float) else x for x in shown]
    raise OptimizerError(f"{type(optimizer).__name__}: {kind}({name}={shown}) gives one value per member "
                         f"({n} members, {groups} param group{'s' if groups != 1 else ''}). " + _cycle_fix(kind, name))


def _format_param_for_stacked(original: Callable) -> Callable:
    """torch's lr_scheduler._format_param (how OneCycleLR and CyclicLR read max_lr, base_lr and momenta: one per
    param group), first refusing per-member values on a stacked optimizer with the fix; for any other optimizer it
    is torch's own call."""
    @functools.wraps(original)
    def format_param(name, optimizer, param):
        if isinstance(optimizer, _StackedOptimizer):
            _refuse_per_member_values(name, optimizer, param)
        return original(name, optimizer, param)
    format_param.stagewise_wrapped = True
    return format_param


if callable(getattr(_LRS, "_format_param", None)) and not getattr(_LRS._format_param, "stagewise_wrapped", False):
    _LRS._format_param = _format_param_for_stacked(_LRS._format_param)


# the fix the refusal of a derived lr write names: per param group, each group's member lrs from its own (a get
# without group= reads group 0, a set without it writes every group: a head at 10x lr would get the body's lrs)
DERIVED_LR_FIX = ("for k in range(len(opt.param_groups)): opt.set_hyperparameter('lr', "
                  "(opt.get_hyperparameter('lr', k) * 0.5).clamp(min=1e-3), group=k)")


class _MemberGroup(dict):
    """A param group of a stacked optimizer (a dict, as torch's schedulers and state_dict expect).

    torch's lr schedulers write plain values into it. A momentum or betas written as a Python float
    (OneCycleLR, CyclicLR cycling momentum) becomes an [N] vector, validated: every member's own
    scheduler would write that same value. An ``"lr"`` written by a scheduler is the shared scale;
    where the members' lrs differ (``member_lr`` not all 1) a scheduler that is not proportional to
    each member's base lr is refused with an OptimizerError naming it and the fix: on the shared
    scale it would give member i ``lr_i * f`` where its own scheduler gives it something else.
    """

    def __init__(self, group: dict, *, owner: str, n: int, ranges: dict):
        super().__init__(group)
        self.owner, self.n, self.ranges = owner, n, ranges
        self.remember()

    def remember(self) -> None:
        """Note the lr values as they are now: a later value that is not one of these objects was written past
        __setitem__ (check_unseen_writes)."""
        self.seen = {k: dict.get(self, k) for k in ("lr", "initial_lr")}

    def check_unseen_writes(self) -> None:
        """OptimizerError for an lr written past __setitem__ (`dict.__setitem__(g, "lr", v)`, `dict.update(g, ...)`)
        while the members' lrs differ: the check of what it means to N torch optimizers never ran. One identity test
        per key on each step."""
        for key, before in self.seen.items():
            now = dict.get(self, key)
            if now is before:
                continue
            if ("member_lr" in self and now is not None and (before is None or float(now) != float(before))
                    and bool((dict.__getitem__(self, "member_lr") != 1).any())):
                raise OptimizerError(
                    f"{self.owner}: param_groups[...]['{key}'] was written past the group's checks (dict.__setitem__ or "
                    f"dict.update called on the group) while the members' lrs differ: group['lr'] is a scale shared by "
                    "all members here, and what the write means to N torch optimizers could not be checked. Write it "
                    f"as g['{key}'] = ... (a factor of the group's own lr scales every member's), or set the members' "
                    "lrs with opt.set_hyperparameter('lr', values)")
            self.seen[key] = now

    def __reduce__(self):
        """Pickle and deepcopy rebuild it whole (item by item, __setitem__ would run before owner/n/ranges exist)."""
        return _rebuild_member_group, (dict(self), self.owner, self.n, self.ranges)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """dict.update past __setitem__ (`group.update(lr=0.5)`) would skip the checks: each key goes through it."""
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if "member_lr" in self and key in _SCHEDULED_KEYS:
            self._refuse_absolute_scheduler()
        if key in self.ranges and "member_lr" in self:
            value = _hyper_vector(self.owner, key, value, self.n, self["member_lr"].device, self.ranges[key])
        elif key in _FLAGS and "member_lr" in self:
            value = _flag(self.owner, key, value)
        elif key in ("lr", "initial_lr") and "member_lr" in self:
            self._check_lr(value, key)
            # kept a Python float: torch's schedulers fill_() a tensor lr in place, past this check
            value = float(value)
            if key == "initial_lr" and "initial_member_lr" not in self:
                # a torch scheduler's initial_lr is each member's lr where scheduling began (its base_lrs, what
                # SequentialLR restarts from): here the shared scale, so the member part is recorded beside it
                super().__setitem__("initial_member_lr", self["member_lr"].clone())
            elif key == "lr" and "initial_member_lr" in self and _sequence_resetting():
                # SequentialLR's construction sets every lr back to initial_lr: on N torch optimizers each member's
                # own, here the shared scale and each member lr (a member lr loaded before it was built included)
                self["member_lr"].copy_(self["initial_member_lr"])
        super().__setitem__(key, value)
        if key in ("lr", "initial_lr"):
            self.seen[key] = value

    def __ior__(self, other: Any) -> "_MemberGroup":
        """`group |= {...}` (dict.__ior__ would skip the checks): each key goes through __setitem__."""
        self.update(other)
        return self

    def _refuse_absolute_scheduler(self) -> None:
        """OptimizerError, before it writes anything, where a torch scheduler that sets absolute lrs (OneCycleLR,
        CyclicLR, SWALR, a cosine with eta_min > 0) writes a group of an optimizer whose members' lrs differ in some
        group. Its lr write would be refused anyway, but its constructor writes initial_lr (and max_lr, momentum, the
        groups before the refused one) first, which a LambdaLR built next, the fix the refusal gives, would scale."""
        scheduler = _writing_scheduler(3)  # past this method and __setitem__ (setdefault's frame is walked past)
        if scheduler is None or isinstance(scheduler, _LRS.ReduceLROnPlateau) or type(scheduler) in _PROPORTIONAL:
            return
        optimizer = getattr(scheduler, "optimizer", None)
        frame = sys._getframe(2)
        for _ in range(4):  # SWALR writes swa_lr before torch's __init__ sets .optimizer: its argument then
            if optimizer is not None or frame is None:
                break
            held = frame.f_locals.get("optimizer")
            optimizer = held if isinstance(held, _StackedOptimizer) else None
            frame = frame.f_back
        groups = getattr(optimizer, "param_groups", None) or [self]
        lrs = next(((dict.get(g, "lr", 1.0) * g["member_lr"]).tolist() for g in groups
                    if "member_lr" in g and bool((g["member_lr"] != 1).any())), None)
        if lrs is None:
            return
        problem = _scheduler_problem(scheduler, self, 0.0, 0.0)
        if problem is not None:
            raise OptimizerError(f"{self.owner} with per-member lrs {lrs}: {problem} (refused before it wrote anything)")

    def _check_lr(self, value: Any, key: str = "lr") -> None:
        """Refuse an lr (or initial_lr, the base torch's schedulers and hand-written schedules scale) that is not one
        number, or one a non-proportional scheduler or the user's code writes while member lrs differ. A torch
        LambdaLR writing the lr outright is noted for the stacked schedules (StackedLRScheduler._refuse_outright)."""
        if key == "lr" and isinstance(_writing_scheduler(), _LRS.LambdaLR):
            self.__dict__["outright_by"] = "LambdaLR"
        if not isinstance(value, (int, float)) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
            scheduler = _writing_scheduler()
            by = f" (written by {type(scheduler).__name__})" if scheduler is not None else ""
            raise OptimizerError(f"{self.owner}: param_groups[...]['{key}'] = {value!r}{by}: group['{key}'] is one scale "
                                 "shared by all members (member i runs at group['lr'] * group['member_lr'][i]), so it "
                                 "takes one number. " + (_cycle_fix(type(scheduler).__name__, key)
                                                         if isinstance(scheduler, _ABSOLUTE_CYCLES) else _FACTOR_FIX))
        if not bool((self["member_lr"] != 1).any()):
            return  # every member has lr = the scale itself: any scheduler acts as on one torch optimizer
        scheduler = _writing_scheduler()
        if scheduler is None:
            how = _written_by_user()
            changed = how is not None and (key not in self or float(value) != float(self[key]))
            if how == "derived" and changed:
                # `g["lr"] = max(g["lr"] * 0.5, 1e-3)`: on N torch optimizers the floor acts on each member's own lr
                lrs = (self["lr"] * self["member_lr"]).tolist()
                raise OptimizerError(
                    f"{self.owner}: param_groups[...]['{key}'] = {float(value):g} computed from the group's lr otherwise than "
                    f"by a factor (a floor, an offset, a condition) while the members' lrs differ "
                    f"({[round(x, 8) for x in lrs[:4]]}{', ...' if len(lrs) > 4 else ''}): group['lr'] is a scale shared by "
                    "all members here, and N torch optimizers would apply that computation to each member's own lr. "
                    "Compute each group's member lrs and set them, for `max(g['lr'] * 0.5, 1e-3)`: "
                    f"{DERIVED_LR_FIX}; a pure factor (g['lr'] *= f, "
                    "g['lr'] = g['initial_lr'] * f) or torch.optim.lr_scheduler.LambdaLR also works")
            if how == "unread" and changed:
                lrs = (self["lr"] * self["member_lr"]).tolist()
                raise OptimizerError(
                    f"{self.owner}: param_groups[...]['{key}'] = {float(value):g} written while the members' lrs differ "
                    f"({[round(x, 8) for x in lrs[:4]]}{', ...' if len(lrs) > 4 else ''}) by code whose source could not "
                    "be read (exec, python -c, a plain REPL), so whether the statement scales the group's own lr by a "
                    "factor (g['lr'] *= f, which scales every member's lr as on N torch optimizers) or writes an lr of "
                    "its own (which group['lr'], a scale shared by all members here, would not set) could not be "
                    "checked. Run it from a file, or set the members' lrs: opt.set_hyperparameter('lr', values, "
                    "group=k), or torch.optim.lr_scheduler.LambdaLR(opt, lambda step: ...) for a factor")
            if how == "absolute" and changed:
                # `for g in opt.param_groups: g["lr"] = get_lr(it)`: N torch optimizers would all run at that lr; here
                # it would scale each member's own lr (member i at lr * member_lr[i]), silently another schedule
                lrs = (self["lr"] * self["member_lr"]).tolist()
                raise OptimizerError(
                    f"{self.owner}: param_groups[...]['{key}'] = {float(value):g} written while the members' lrs differ "
                    f"({[round(x, 8) for x in lrs[:4]]}{', ...' if len(lrs) > 4 else ''}): group['lr'] is a scale shared "
                    "by all members here (member i runs at group['lr'] * group['member_lr'][i]), so this would not set "
                    f"the lr it does on a torch optimizer. To give every member this lr: opt.set_hyperparameter('lr', "
                    f"{float(value):g}) (group=k for param group k alone); per member: opt.set_hyperparameter('lr', "
                    "[...]); a schedule as a factor of "
                    "each member's own lr: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: ...)")
            return
        if key != "lr":
            return  # a scheduler recording the base it scales (setdefault("initial_lr", group["lr"]))
        problem = _scheduler_problem(scheduler, self, float(self["lr"]), float(value))
        if problem is not None:
            raise OptimizerError(f"{self.owner} with per-member lrs {(self['lr'] * self['member_lr']).tolist()}: {problem}")


def _sequence_resetting() -> bool:
    """Whether torch's SequentialLR.__init__ is writing a group's "lr" right now (directly or through
    _update_param_group_val): its reset of every lr to group["initial_lr"], not a scheduler's step it starts."""
    frame = sys._getframe(2)  # past this function and _MemberGroup.__setitem__
    for _ in range(2):
        if frame is None:
            return False
        if frame.f_code is _LRS.SequentialLR.__init__.__code__:
            return True
        frame = frame.f_back
    return False


def _rebuild_member_group(items: dict, owner: str, n: int, ranges: dict) -> _MemberGroup:
    return _MemberGroup(items, owner=owner, n=n, ranges=ranges)


def _clone_value(v: Any) -> Any:
    """A copy of a param-group value that is a tensor or a tuple of tensors; other values as they are."""
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, tuple):
        return tuple(_clone_value(x) for x in v)
    return v


# --- SGD ---------------------------------------------------------------------------------------

class StackedSGD(_StackedOptimizer):
    """``torch.optim.SGD`` for N stacked members; lr, momentum, dampening, weight_decay scalar or length N.

    Args: params (stacked ``[N, ...]`` tensors or param-group dicts), n_members, lr, momentum,
    dampening, weight_decay, nesterov, maximize (flags shared by all members); foreach and fused are taken as
    torch.optim's are (nanoGPT passes fused=True) and change nothing: each step is already a few whole-tensor ops per
    stacked parameter, for all members at once.
    Raises: OptimizerError for a bad value, or nesterov with a member whose momentum is 0 or
    dampening is not 0 (torch refuses that too).
    A member whose momentum is 0 gets plain SGD (its dampening is ignored, as in torch) and keeps its
    momentum buffer as it is; when its momentum becomes non-zero again it carries that buffer on, or,
    if it never had one (or after reset_member), starts with ``buf = grad`` as torch's fresh buffer.
    """

    _RANGES = {"momentum": (0.0, None, True), "dampening": (-math.inf, None, True), "weight_decay": (0.0, None, True)}

    def __init__(self, params, n_members: int, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov: bool = False, maximize: bool = False, foreach: bool | None = None, fused: bool | None = None):
        super().__init__(params, n_members, dict(lr=lr, momentum=momentum, dampening=dampening,
                                                 weight_decay=weight_decay, nesterov=nesterov, maximize=maximize))

    def _check_group(self, group: dict) -> None:
        if group["nesterov"] and (bool((group["momentum"] <= 0).any()) or bool((group["dampening"] != 0).any())):
            raise OptimizerError("StackedSGD: nesterov=True needs momentum > 0 and dampening = 0 for every member; "
                                 "set those or nesterov=False")

    def reset_member(self, i: int) -> None:
        """Restart member ``i``'s momentum as a fresh torch.optim.SGD would (needs dampening 0 for it)."""
        for group in self.param_groups:  # every group checked before any is reset
            if float(group["dampening"][i]) != 0 and float(group["momentum"][i]) != 0:
                raise OptimizerError(f"StackedSGD.reset_member({i}): member {i} has dampening "
                                     f"{float(group['dampening'][i]):g}; a fresh SGD's first momentum step skips "
                                     f"dampening, which a zeroed buffer cannot reproduce; set its dampening to 0 first")
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    buf[i].zero_()
                    _has_buffer(self.state[p])[i] = False  # its next step with momentum starts buf = grad

    def _idle_members(self, momentum: torch.Tensor) -> torch.Tensor | None:
        """[N] bool: the members whose momentum is 0 (None where there are none); cached per tensor version."""
        def idle(m: torch.Tensor) -> torch.Tensor | None:
            at_zero = m == 0
            return at_zero if bool(at_zero.any()) else None
        return self._cached("idle", momentum, idle)

    def _step_group(self, group, params, grads):
        lr = self._coef(-group["lr"] * group["member_lr"], params[0])
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        wd = group["weight_decay"]
        if self._nonzero(wd):
            grads = torch._foreach_addcmul(grads, params, _views(self._coef(wd, params[0]), params))
        momentum = group["momentum"]
        if self._nonzero(momentum):
            grads = self._momentum(group, params, grads, momentum)
        torch._foreach_addcmul_(params, grads, _views(lr, params))

    def _momentum(self, group, params, grads, momentum):
        """Update the momentum buffers as N torch SGDs would; returns the direction to step along.

        torch's rules per member: no buffer until its first step with momentum != 0 (then buf = grad, no
        dampening); on a step where its momentum is 0 its buffer is left as it is and it steps along the
        gradient; with a buffer, buf = momentum * buf + (1 - dampening) * grad. ``state["momentum_members"]``
        ([N] bool) says which members have a buffer. Members alike (every one with momentum and a buffer, the
        usual case) take two foreach calls; whether they are is read once per change, not per step."""
        like = params[0]
        m = self._coef(momentum, like)
        one_minus_d = self._coef(1 - group["dampening"], like)
        idle = self._idle_members(momentum)
        bufs, old = [], []
        for p, g in zip(params, grads):
            state = self.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.clone(g).detach()  # first step: buf = grad, as torch
                state["momentum_members"] = ~idle if idle is not None else torch.ones_like(momentum, dtype=torch.bool)
            else:
                old.append((state, g))
            bufs.append(state["momentum_buffer"])
        if old:
            alike = idle is None and all(self._shared(_has_buffer(st)) == 1.0 for st, _ in old)
            old_bufs, old_grads = [st["momentum_buffer"] for st, _ in old], [g for _, g in old]
            if alike:
                torch._foreach_mul_(old_bufs, _views(m, old_bufs))
                torch._foreach_addcmul_(old_bufs, old_grads, _views(one_minus_d, old_bufs))
            else:
                stepping = ~idle if idle is not None else torch.ones_like(momentum, dtype=torch.bool)
                for (state, g), buf in zip(old, old_bufs):
                    shape = (-1,) + (1,) * (buf.dim() - 1)
                    has = _has_buffer(state)
                    new = torch.where((stepping & ~has).view(shape), g, buf * m.view(shape) + g * one_minus_d.view(shape))
                    buf.copy_(torch.where(stepping.view(shape), new, buf))  # a member at momentum 0 keeps its buffer
                    state["momentum_members"] = has | stepping
        if group["nesterov"]:  # every member has momentum > 0 (checked)
            return torch._foreach_addcmul(grads, bufs, _views(m, bufs))
        if idle is not None:  # members at momentum 0 step along the gradient
            return [torch.where(idle.view((-1,) + (1,) * (b.dim() - 1)), g, b) for b, g in zip(bufs, grads)]
        return bufs


def _has_buffer(state: dict) -> torch.Tensor:
    """[N] bool: the members with a momentum buffer (a state saved before this was kept: all of them)."""
    has = state.get("momentum_members")
    if has is None:
        has = state["momentum_members"] = torch.ones(state["momentum_buffer"].shape[0], dtype=torch.bool,
                                                     device=state["momentum_buffer"].device)
    return has


# --- Adam / AdamW ------------------------------------------------------------------------------

class StackedAdam(_StackedOptimizer):
    """``torch.optim.Adam`` for N stacked members; lr, each of betas, eps, weight_decay scalar or length N.

    Args: params (stacked ``[N, ...]`` tensors or param-group dicts), n_members, lr, betas (pair),
    eps, weight_decay (L2, added to the gradient), amsgrad, maximize (flags shared by all members); foreach and
    fused as in StackedSGD (taken, changing nothing).
    State per parameter: ``step`` float32 [N], ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``)
    shaped like the parameter.
    Raises: OptimizerError for a bad value (betas outside [0, 1), negative lr/eps/weight_decay, wrong length).
    """

    _RANGES = {"eps": (0.0, None, True), "weight_decay": (0.0, None, True)}
    _decoupled = False

    def __init__(self, params, n_members: int, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad: bool = False, maximize: bool = False, foreach: bool | None = None, fused: bool | None = None):
        super().__init__(params, n_members, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                                 amsgrad=amsgrad, maximize=maximize))

    def reset_member(self, i: int) -> None:
        """Restart member ``i`` as a fresh torch.optim.Adam would: zero moments and step count."""
        if not 0 <= i < self.n_members:
            raise OptimizerError(f"{type(self).__name__}.reset_member({i}): no such member; pass 0..{self.n_members - 1}")
        for state in self.state.values():
            for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in state:
                    state[key][i].zero_()

    def _state(self, p: torch.Tensor, amsgrad: bool) -> dict:
        """The Adam state of ``p``, created on first use (step [N] float32, moments like p)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros(self.n_members, dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _counted(self, steps: list[torch.Tensor]) -> list[float] | None:
        """Add 1 to each [N] step count; return each count's one value where every member is at the same step, else None.

        Known without a device sync while the counts only move by these increments: the value (or None) seen
        after the last increment is remembered with the tensor's version; a count changed since (reset_member,
        a loaded or edited state) is read once."""
        before = [self._known("shared", t) for t in steps]
        torch._foreach_add_(steps, 1.0)
        counts = []
        for t, old in zip(steps, before):
            now = self._shared(t) if old is _UNREAD else None if old is None else old + 1.0
            counts.append(self._remember("shared", t, now))
        return None if any(c is None for c in counts) else counts

    def _shared_values(self, group: dict) -> tuple[float, float, float, float, float] | None:
        """(lr, beta1, beta2, eps, weight_decay) as Python floats where every member has the same, else None."""
        lr = self._shared(group["member_lr"]) if isinstance(group["lr"], (int, float)) else None  # a tensor lr: general path
        values = (self._shared(group["betas"][0]), self._shared(group["betas"][1]), self._shared(group["eps"]),
                  self._shared(group["weight_decay"]))
        if lr is None or None in values:
            return None
        return (group["lr"] * lr, *values)

    @staticmethod
    def _root_of_second_moment(max_sqs: list[torch.Tensor] | None, exp_avg_sqs: list[torch.Tensor]) -> list[torch.Tensor]:
        """sqrt of the second moments, new tensors (amsgrad, `max_sqs` given: of their running maximum, updated here)."""
        if max_sqs is not None:
            torch._foreach_maximum_(max_sqs, exp_avg_sqs)
            return torch._foreach_sqrt(max_sqs)
        return torch._foreach_sqrt(exp_avg_sqs)

    def _step_alike(self, params, grads, exp_avgs, exp_avg_sqs, max_sqs, counts, lr, beta1, beta2, eps, wd) -> None:
        """The step when every member has the same hyper-parameters and step count: torch's foreach Adam
        (non-capturable) call for call, so the members are updated exactly as N torch.optim.Adam would."""
        if wd != 0:
            if self._decoupled:
                torch._foreach_mul_(params, 1 - lr * wd)
            else:
                grads = torch._foreach_add(grads, params, alpha=wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        step_size = [(lr / (1 - beta1 ** c)) * -1 for c in counts]
        bias_correction2_sqrt = [(1 - beta2 ** c) ** 0.5 for c in counts]
        denom = self._root_of_second_moment(max_sqs, exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)

    def _step_group(self, group, params, grads):
        like = params[0]
        states = [self._state(p, group["amsgrad"]) for p in params]
        steps = [s["step"] for s in states]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        max_sqs = [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else None
        if like.is_complex():  # one bucket is one dtype: all complex
            # torch's Adam views a complex parameter, its grad and its state as real [..., 2] (torch.view_as_real), so
            # the real and imaginary parts are moments of their own; the complex arithmetic gave 0.39 off in 3 steps.
            # The member axis stays dim 0, so the [N, 1, ...] coefficients broadcast over the extra dim as over others.
            real = lambda ts: [torch.view_as_real(t) for t in ts]  # noqa: E731
            params, grads, exp_avgs, exp_avg_sqs = real(params), real(grads), real(exp_avgs), real(exp_avg_sqs)
            max_sqs = real(max_sqs) if max_sqs is not None else None
            like = params[0]
        beta1, beta2 = (b.to(like.device) for b in group["betas"])
        lr = (group["lr"] * group["member_lr"]).to(like.device)
        wd = group["weight_decay"]

        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        counts = self._counted(steps)
        shared = self._shared_values(group)
        if shared is not None and counts is not None:  # every member alike: torch's own foreach Adam, Python scalars
            return self._step_alike(params, grads, exp_avgs, exp_avg_sqs, max_sqs, counts, *shared)
        if self._nonzero(wd):
            if self._decoupled:  # AdamW: p *= 1 - lr * wd, the product taken in float64 like torch's floats
                torch._foreach_mul_(params, _views(self._coef(1 - lr * wd.to(like.device), like), params))
            else:                # Adam: L2 folded into the gradient
                grads = torch._foreach_addcmul(grads, params, _views(self._coef(wd, like), params))

        torch._foreach_lerp_(exp_avgs, grads, _views(self._coef(1 - beta1, like), params))
        torch._foreach_mul_(exp_avg_sqs, _views(self._coef(beta2, like), params))
        # addcmul's `value` must be one Python number, so scale one factor by the per-member (1 - beta2) first
        torch._foreach_addcmul_(exp_avg_sqs, torch._foreach_mul(grads, _views(self._coef(1 - beta2, like), params)), grads)

        # bias corrections for every (param, member) at once: [P, N] in float64, then cast once
        step = torch.stack(steps).to(lr.dtype)
        neg_step_size = self._coef(-lr / (1 - beta1 ** step), like)
        bias_correction2_sqrt = self._coef((1 - beta2 ** step).sqrt(), like)

        denom = self._root_of_second_moment(max_sqs, exp_avg_sqs)
        torch._foreach_div_(denom, _rows(bias_correction2_sqrt, params))
        torch._foreach_add_(denom, _views(self._coef(group["eps"], like), params))
        # p += exp_avg / (denom / -step_size): torch's capturable path; no extra param-sized temporary
        torch._foreach_div_(denom, _rows(neg_step_size, params))
        torch._foreach_addcdiv_(params, exp_avgs, denom)


class StackedAdamW(StackedAdam):
    """``torch.optim.AdamW`` for N stacked members: decoupled weight decay ``p *= 1 - lr * weight_decay``.

    Same arguments as StackedAdam; weight_decay defaults to 1e-2 as in torch.
    """

    _decoupled = True

    def __init__(self, params, n_members: int, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad: bool = False, maximize: bool = False, foreach: bool | None = None, fused: bool | None = None):
        super().__init__(params, n_members, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize)


# --- per-member gradient clipping --------------------------------------------------------------

@torch.no_grad()
def clip_grad_norm_per_member_(params: Iterable[torch.Tensor] | torch.Tensor, max_norm, n_members: int,
                               norm_type: float = 2.0, error_if_nonfinite: bool = False,
                               foreach: bool | None = None) -> torch.Tensor:
    """Clip each member's gradients by that member's total norm, in place.

    Args: params: stacked ``[N, ...]`` tensors (those without a grad are skipped); max_norm: scalar
    or length N; n_members: N; norm_type: p of the p-norm (``inf`` for max-abs).
    Returns: float32 tensor [N], each member's total gradient norm before clipping (over all its
    slices of all params), as ``torch.nn.utils.clip_grad_norm_`` returns for one model.
    Member ``i``'s grads are multiplied by ``min(1, max_norm[i] / (norm[i] + 1e-6))``, exactly torch's rule.
    error_if_nonfinite: as torch's, per member: raise (before any grad is changed) where some member's
    norm is nan or inf; foreach: accepted for torch's signature (the clip is always a few foreach calls).
    Raises: OptimizerError for a bad max_norm, a grad without the member axis, or (error_if_nonfinite)
    a member whose norm is not finite.
    """
    if isinstance(n_members, bool) or not isinstance(n_members, int) or n_members < 1:
        raise OptimizerError(f"clip_grad_norm_per_member_: n_members must be a positive int (the member count), got "
                             f"{n_members!r}; the arguments are (params, max_norm, n_members)")
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    # complex grads (an FNO's spectral weights): their norms are real, as torch's clip_grad_norm_ returns them
    dtype = grads[0].dtype.to_real() if grads else torch.float32
    limit = _check_range("clip_grad_norm_per_member_", "max_norm",
                         _member_vector("clip_grad_norm_per_member_", "max_norm", max_norm, n_members, device, dtype), 0.0)
    if not grads:
        return torch.zeros(n_members, dtype=dtype, device=device)
    for g in grads:
        if g.dim() == 0 or g.shape[0] != n_members:
            raise OptimizerError(f"clip_grad_norm_per_member_: a grad of shape {tuple(g.shape)} has no member axis of "
                                 f"size n_members={n_members} in dim 0; pass stacked [N, ...] params")
    norm_type = float(norm_type)
    per_param = [torch.linalg.vector_norm(g.reshape(n_members, -1), norm_type, dim=1) for g in grads]  # P x [N]
    norms = torch.linalg.vector_norm(torch.stack(per_param), norm_type, dim=0)                          # [N]
    if error_if_nonfinite and not bool(torch.isfinite(norms).all()):
        bad = (~torch.isfinite(norms)).nonzero().flatten().tolist()
        raise OptimizerError(f"clip_grad_norm_per_member_: the total norm of order {norm_type:g} of member(s) {bad}'s "
                             f"gradients is {[norms[i].item() for i in bad]}, so they cannot be clipped; find where the "
                             f"nan/inf comes from, or pass error_if_nonfinite=False to scale them by it anyway "
                             f"(torch's behaviour: those members' grads become nan, the others are clipped as usual)")
    coef = torch.clamp(limit / (norms + 1e-6), max=1.0)
    # a complex grad is multiplied by the coefficient as a complex number, as torch's _foreach_mul_ of it by a real
    # scalar tensor does (the same numbers for finite grads; for an inf it gives what torch gives)
    casts: dict[tuple[torch.dtype, int], torch.Tensor] = {}
    factors = [casts.setdefault((g.dtype, g.dim()), coef.to(g.dtype if g.is_complex() else dtype)
                                .view((n_members,) + (1,) * (g.dim() - 1))) for g in grads]
    torch._foreach_mul_(grads, factors)
    return norms


# --- per-member LR schedules -------------------------------------------------------------------

def _count_step(optimizer, args, kwargs) -> None:
    """An optimizer step post hook: counts the steps, which tells stacked schedules stepped together apart."""
    optimizer.__dict__["_stagewise_steps"][0] += 1


class StackedLRScheduler:
    """Base of the per-member schedules: writes ``group["member_lr"]`` from each member's base lr.

    Like a torch scheduler it applies epoch 0 at construction, keeping the lrs the optimizer holds, and ``step()``
    advances one epoch; ``base_lrs`` (one [N] tensor per group) are, as torch's base_lrs are each group's
    ``initial_lr``, the member lrs where scheduling began: ``group["initial_member_lr"]``, recorded beside
    ``group["initial_lr"]`` by the first scheduler built on the optimizer (torch's or this) and saved with the
    optimizer. So one built after ``opt.load_state_dict(saved)`` starts from the loaded lrs and the original bases,
    as torch's does, not from the loaded lrs taken as bases. Subclasses give ``_member_lr(base, epoch)`` in closed
    form (a milestone of SequentialLR, torch's ``_get_closed_form_lr``) and ``_next_member_lr`` as torch's
    ``get_lr`` recursion. It leaves the shared scale ``group["lr"]`` to torch's schedulers. Both go on from an lr set
    with ``set_hyperparameter`` as torch's StepLR and CosineAnnealingLR go on from a written lr.

    Inside ``torch.optim.lr_scheduler.SequentialLR``: torch calls ``_initial_step()`` on the first scheduler and
    ``_update_lr(0)`` on the one a milestone starts; as torch's own, this one then restarts from the base lrs (the
    shared scale back to ``group["initial_lr"]``, undoing a warmup's), so ``SequentialLR(opt, [LinearLR(...),
    StackedCosineLR(...)], milestones=[k])`` gives member i what its own SequentialLR of LinearLR and
    CosineAnnealingLR gives it. It must come after every torch scheduler of the sequence (see _check_place_in_sequence).
    """

    def __init__(self, optimizer: _StackedOptimizer):
        self._device_of(optimizer)
        self.optimizer = optimizer
        self.n_members = optimizer.n_members
        for g in optimizer.param_groups:
            # as torch's schedulers record it: the scale the schedules start from (SequentialLR resets to it), and
            # with it (_MemberGroup.__setitem__) the member lrs; a group loaded from a state dict saved before
            # initial_member_lr existed has an initial_lr and no member part: its member lrs now, as before
            g.setdefault("initial_lr", g["lr"])
            if "initial_member_lr" not in g:
                dict.__setitem__(g, "initial_member_lr", g["member_lr"].clone())
        self.base_lrs = [g["initial_member_lr"].clone() for g in optimizer.param_groups]
        self.last_epoch = -1
        if "_stagewise_steps" not in optimizer.__dict__:  # counts optimizer steps: see _refuse_another_schedule
            optimizer.__dict__["_stagewise_steps"] = [0]
            optimizer.register_step_post_hook(_count_step)
        self.step()

    def _refuse_outright(self) -> None:
        """OptimizerError where a torch LambdaLR set the shared lr since this schedule's last step (a ChainedScheduler
        of LambdaLR and StackedCosineLR, or both stepped each epoch): on N torch optimizers LambdaLR's initial_lr * f
        throws away the lr this schedule made, and this schedule then steps from that; here each member's schedule
        lives in its member lr and would go on from its own (lrs 0.97 off, params 2.17 off after 30 steps). Run them
        one after the other in a SequentialLR, or give the schedule as factors of torch's (MultiplicativeLR, LinearLR)."""
        if any(group.__dict__.get("outright_by") for group in self.optimizer.param_groups):
            raise OptimizerError(
                f"a torch LambdaLR set the lr outright (initial_lr * f) on the optimizer {type(self).__name__} steps on: "
                "on N torch optimizers that throws away the lr this schedule made, which here lives in each member's "
                "own lr, so the two would give other lrs than N torch optimizers. Run them one after the other "
                "(SequentialLR(opt, [LambdaLR(opt, warmup), executor.StackedCosineLR(opt, ...)], milestones=[k])), or "
                "write the other schedule as a factor of the lr (MultiplicativeLR, LinearLR, ExponentialLR), which "
                "composes with it")

    def _refuse_another_schedule(self) -> None:
        """OptimizerError where another stacked schedule stepped on this optimizer since its last step (a
        ChainedScheduler of StackedCosineLR and StackedStepLR, or both stepped side by side): each writes every
        member's lr outright from its own closed form or recursion, so the last one stepped would undo the other
        (the cosine was dropped: lrs 5e10 off at its trough, params 1.14 off after 30 steps). One after the other, in a
        SequentialLR or a scheduler replaced later, is fine: they step at different optimizer steps."""
        steps = self.optimizer.__dict__.get("_stagewise_steps", [0])[0]
        last = self.optimizer.__dict__.get("_stagewise_last_schedule")
        other = last[0]() if last is not None else None
        if other is not None and other is not self and last[1] == steps:
            raise OptimizerError(
                f"{type(self).__name__} steps on an optimizer that {type(other).__name__} has stepped on since the last "
                "optimizer step: two stacked schedules at once (a ChainedScheduler of them, or both stepped each "
                "epoch) each set every member's lr outright, so the last one would undo the other. Give one stacked "
                "schedule the whole shape (StackedCosineLR's T_max and eta_min per member; a step decay "
                "d ** epoch is StackedStepLR(step_size=1, gamma=d)) and compose it with torch's factor schedulers, or "
                "run them one after the other in a SequentialLR")
        self.optimizer.__dict__["_stagewise_last_schedule"] = (weakref.ref(self), steps)

    def _device_of(self, optimizer) -> torch.device:
        """The device of ``optimizer``'s [N] hyper-parameters, after checking it is a stacked optimizer."""
        if not isinstance(optimizer, _StackedOptimizer):
            raise OptimizerError(f"{type(self).__name__}: {type(optimizer).__name__} is not a stacked optimizer; "
                                 f"pass a StackedSGD/StackedAdam/StackedAdamW (use torch.optim.lr_scheduler for others)")
        return optimizer.param_groups[0]["member_lr"].device

    def _vector(self, optimizer, name: str, value, low: float) -> torch.Tensor:
        """A schedule parameter (scalar or length N) as a validated [N] tensor, each value >= low."""
        owner, device = type(self).__name__, self._device_of(optimizer)
        return _check_range(owner, name, _member_vector(owner, name, value, optimizer.n_members, device), low)

    def _member_lr(self, base: torch.Tensor, epoch: int, scale: float) -> torch.Tensor:
        """The members' lr multipliers at `epoch`; `scale` is the group's shared lr (the effective lr is scale x this)."""
        raise NotImplementedError

    def _next_member_lr(self, group: dict, base: torch.Tensor, epoch: int) -> torch.Tensor:
        """The members' lr multipliers one epoch on, at `epoch` >= 1 (before any plateau cuts): the closed form here."""
        return self._member_lr(base, epoch, float(group["lr"]))

    def _refuse_plateau_cuts(self) -> list[torch.Tensor] | None:
        """The cuts of StackedReduceLROnPlateau schedulers on the same optimizer (a StepLR's closed form is multiplied
        by them, which it alone would undo), or None; OptimizerError for StackedCosineLR beside one."""
        cuts = _plateau_cuts(self.optimizer)
        if cuts is not None and isinstance(self, StackedCosineLR):
            raise OptimizerError(
                "StackedCosineLR and a StackedReduceLROnPlateau on one optimizer: torch's recursive cosine scales a cut "
                "lr's distance to eta_min, and past T_max adds to the lr; that pair is not supported. "
                "Use one of the two (StackedStepLR composes with the plateau scheduler)")
        return cuts

    def step(self) -> None:
        """Advance one epoch and write every member's lr in place, recursively from the lr it has (so the cuts of a
        StackedReduceLROnPlateau on the same optimizer stay, as they stay in each lr on N torch optimizers)."""
        self._refuse_plateau_cuts()
        if self.last_epoch >= 0:  # (not the initial step, construction's)
            self._refuse_another_schedule()
            self._refuse_outright()
        for group in self.optimizer.param_groups:
            group.__dict__.pop("outright_by", None)
        self.last_epoch += 1
        if self.last_epoch <= 0:
            # the initial step (construction, SequentialLR's _initial_step): torch's keep the lr the group holds (a
            # loaded one, or initial_lr that SequentialLR has just reset it to, the member lrs with it)
            return
        groups = self.optimizer.param_groups
        # a group added after this scheduler was built (opt.add_param_group: progressive unfreezing) has no base lr,
        # as torch's base_lrs have none for it; torch's recursion schedules it from the lr it has all the same
        self.base_lrs.extend([None] * (len(groups) - len(self.base_lrs)))
        for group, base in zip(groups, self.base_lrs):
            group["member_lr"].copy_(self._next_member_lr(group, base, self.last_epoch))

    def _initial_step(self) -> None:
        """What torch's SequentialLR calls on its first scheduler at construction (after moving it back an epoch):
        epoch 0 again, from the shared scale SequentialLR has just reset to group["initial_lr"]."""
        self._check_place_in_sequence()
        self.step()

    def _update_lr(self, epoch: int | None = None) -> None:
        """What torch's SequentialLR calls at the milestone starting this scheduler, `epoch`=0: as torch's scheduler
        writes its closed form from its base lrs (the lr a warmup before it left is dropped), the shared scale goes
        back to group["initial_lr"] and each member's lr to the schedule at `epoch` from its base; None: a step."""
        self._check_place_in_sequence()
        if epoch is None:
            self.step()
            return
        cuts = self._refuse_plateau_cuts()
        self._refuse_added_groups("restart it at a milestone of SequentialLR (its closed form)")
        self.last_epoch = int(epoch)
        for g, (group, base) in enumerate(zip(self.optimizer.param_groups, self.base_lrs)):
            group.__dict__.pop("outright_by", None)  # (a warmup LambdaLR before the milestone: its lr is dropped here)
            group["lr"] = float(group.get("initial_lr", group["lr"]))
            lr = self._member_lr(base, self.last_epoch, float(group["lr"]))
            group["member_lr"].copy_(lr * cuts[g] if cuts is not None else lr)

    def _refuse_added_groups(self, what: str) -> None:
        """OptimizerError where a param group was added after this scheduler was built and `what` needs its base lr:
        torch's own scheduler has none for it either and raises there (a strict zip of its base_lrs and the groups)."""
        added = len(self.optimizer.param_groups) - sum(b is not None for b in self.base_lrs)
        if added > 0:
            raise OptimizerError(
                f"{type(self).__name__}: {added} param group(s) were added to the optimizer after this scheduler was "
                f"built (opt.add_param_group), which have no base lr to {what}; torch's scheduler has none for them "
                "either and raises there. Build the scheduler after adding the groups (a new scheduler over the "
                "optimizer as it stands goes on from the lrs the groups have)")

    def _check_place_in_sequence(self) -> None:
        """OptimizerError where a torch SequentialLR (the caller of _initial_step / _update_lr) has a torch scheduler
        after this one: at its milestone that scheduler writes the shared scale group["lr"] from its base, but the
        member lrs this one wrote (group["member_lr"]) would stay, where N torch optimizers would each restart from
        their own base lr. A stacked scheduler after it restarts the member lrs itself."""
        frame = sys._getframe(1)
        for _ in range(4):
            if frame is None:
                return
            owner = frame.f_locals.get("self")
            if isinstance(owner, _LRS.SequentialLR):
                scheds = list(getattr(owner, "_schedulers", ()))
                at = next((k for k, s in enumerate(scheds) if s is self), None)
                later = [type(s).__name__ for s in scheds[at + 1:] if not isinstance(s, StackedLRScheduler)] \
                    if at is not None else []
                if later:
                    raise OptimizerError(
                        f"{type(self).__name__} is scheduler {at} of {len(scheds)} in a torch SequentialLR, followed by "
                        f"{', '.join(later)}: at its milestone a torch scheduler restarts the shared scale group['lr'] "
                        "from its base, but the per-member lrs this one wrote (group['member_lr']) would stay, so the "
                        "members would not restart from their own lrs as on N torch optimizers. Put the stacked "
                        "scheduler last: SequentialLR(opt, [LinearLR(opt, 0.1, total_iters=k), "
                        "executor.StackedCosineLR(opt, T_max)], milestones=[k])")
                return
            frame = frame.f_back

    def get_last_lr(self) -> list[torch.Tensor]:
        """Effective per-member lr of each group (shared scale x member lr), [N] each."""
        return [g["lr"] * g["member_lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {k: _clone_value(v) if not isinstance(v, list) else [_clone_value(x) for x in v]
                for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "optimizer"})


class StackedStepLR(StackedLRScheduler):
    """Per-member ``torch.optim.lr_scheduler.StepLR``: ``lr_i = base_i * gamma_i ** (epoch // step_size_i)``.

    step_size (positive) and gamma (>= 0) may each be a scalar or length N. As torch's, each step multiplies member
    i's lr by gamma_i at every step_size_i-th epoch and keeps it otherwise (``StepLR.get_lr``), so it goes on from
    the lr the member has: a resumed one (also where the optimizer was loaded before it was built), one set with
    set_hyperparameter, a StackedReduceLROnPlateau's cut. A milestone of SequentialLR restarts it at its closed form
    (``StepLR._get_closed_form_lr``). A factor a torch scheduler puts on the shared scale multiplies it, as it
    multiplies each member's lr on N torch optimizers.
    """

    def __init__(self, optimizer, step_size, gamma=0.1):
        self.step_size = self._vector(optimizer, "step_size", step_size, 1.0)
        if bool((self.step_size != self.step_size.round()).any()):
            raise OptimizerError(f"StackedStepLR: step_size={self.step_size.tolist()} has a non-integer; pass whole epochs")
        self.gamma = self._vector(optimizer, "gamma", gamma, 0.0)
        super().__init__(optimizer)

    def _member_lr(self, base, epoch, scale):
        return base * self.gamma ** torch.floor(epoch / self.step_size)

    def _next_member_lr(self, group, base, epoch):
        """torch's StepLR.get_lr per member: times gamma where `epoch` is a multiple of step_size, else as it is."""
        member = group["member_lr"].to(self.gamma.dtype)
        return torch.where(torch.remainder(epoch, self.step_size) == 0, member * self.gamma, member)


class StackedCosineLR(StackedLRScheduler):
    """Per-member ``torch.optim.lr_scheduler.CosineAnnealingLR`` (no restarts), computed as torch computes it.

    T_max (positive) and eta_min (>= 0) may each be a scalar or length N. Each step applies torch's recursion
    (``CosineAnnealingLR.get_lr``) to each member's effective lr (shared scale x member lr), with member i's T_max,
    eta_min and base lr, and writes the member lr that gives it under the scale as it stands. So a torch scheduler
    composed with it (ChainedScheduler([LinearLR, StackedCosineLR]), [StackedCosineLR, ExponentialLR], a warmup in
    SequentialLR), whose factor on the shared scale is the factor it puts on each member's lr on N torch optimizers,
    gives each member what torch's recursion on its own lr gives it, eta_min > 0 included (a closed form times the
    scale would scale eta_min too). Alone it is torch's documented closed form
    ``eta_min_i + (base_i - eta_min_i) * (1 + cos(pi * epoch / T_max_i)) / 2`` up to float64 rounding, also past
    T_max, where both rise again.
    """

    def __init__(self, optimizer, T_max, eta_min=0.0):
        self.T_max = self._vector(optimizer, "T_max", T_max, 1.0)
        self.eta_min = self._vector(optimizer, "eta_min", eta_min, 0.0)
        super().__init__(optimizer)

    def _member_lr(self, base, epoch, scale):
        # eta_min is an lr, the members' values multipliers of the group's shared lr: members given one lr keep it
        # there (the scale), so their floor in multiplier units is eta_min / scale
        eta = self.eta_min / scale if scale > 0 else self.eta_min
        return eta + (base - eta) * (1 + torch.cos(math.pi * epoch / self.T_max)) / 2

    def _next_member_lr(self, group, base, epoch):
        """torch's CosineAnnealingLR.get_lr, per member, on the effective lr: at the epoch after each trough (where the
        ratio below would be 0/0) the lr rises by (base - eta_min) * (1 - cos(pi / T_max)) / 2, else the distance to
        eta_min is scaled by (1 + cos(pi * t / T_max)) / (1 + cos(pi * (t - 1) / T_max)). base is the member's lr
        where scheduling began (group["initial_lr"] x its member lr at construction), as torch's base_lrs."""
        scale, member = float(group["lr"]), group["member_lr"].to(self.eta_min.dtype)
        lr, eta, t_max = scale * member, self.eta_min, self.T_max
        turn = torch.remainder(epoch - 1 - t_max, 2 * t_max) == 0
        if base is None:  # a group added after this scheduler: its recursion needs no base but at a turn
            if bool(turn.any()):
                self._refuse_added_groups("rise from after T_max")
            base = torch.zeros_like(member)
        start = float(group.get("initial_lr", scale)) * base
        ratio = (1 + torch.cos(math.pi * epoch / t_max)) / (1 + torch.cos(math.pi * (epoch - 1) / t_max))
        rise = lr + (start - eta) * (1 - torch.cos(math.pi / t_max)) / 2
        new = torch.where(turn, rise, ratio * (lr - eta) + eta)
        if scale != 0:
            return new / scale
        if not bool(turn.any()) and not bool((eta != 0).any()):
            return ratio * member  # every lr is 0 and stays 0, as on N torch optimizers
        raise OptimizerError(
            f"StackedCosineLR: the shared scale group['lr'] is 0 (a torch scheduler composed with it wrote 0), where "
            f"torch's cosine would give member i an lr of its own ({[round(x, 8) for x in new.tolist()[:4]]}"
            f"{', ...' if new.numel() > 4 else ''}: eta_min, or the rise past T_max), which no member lr can give under "
            "a scale of 0. Start a warmup above 0 (LinearLR's start_factor > 0), or put it before the cosine in a "
            "SequentialLR(opt, [warmup, StackedCosineLR(...)], milestones=[k])")


def _plateau_cuts(optimizer) -> list[torch.Tensor] | None:
    """Per group, the product of the cuts the optimizer's StackedReduceLROnPlateau schedulers made, or None."""
    plateaus = list(optimizer.__dict__.get("_stagewise_plateaus") or ())
    if not plateaus:
        return None
    cuts = [torch.ones_like(g["member_lr"]) for g in optimizer.param_groups]
    for p in plateaus:  # (a group added after that scheduler was built: it has made no cut there yet)
        cuts = [c * k.to(c) for c, k in zip(cuts, p.cuts)] + cuts[len(p.cuts):]
    return cuts


class StackedReduceLROnPlateau:
    """Per-member ``torch.optim.lr_scheduler.ReduceLROnPlateau``: ``step(metrics)`` takes one metric per member
    (an ``[N]`` tensor or sequence, each member's validation loss) and reduces member ``i``'s lr when member ``i``'s
    metric has stopped improving, exactly as N torch schedulers on N optimizers would (torch's rules: mode, threshold
    mode, patience, cooldown, min_lr floor and eps, per member; float64 like torch's Python floats).

    factor, patience, threshold, cooldown and eps may each be a scalar or length N; min_lr too, or, as torch reads a
    list, one entry per param group (each a scalar or length N). It writes ``group["member_lr"]`` in place (the shared
    scale ``group["lr"]`` stays a torch scheduler's), in every param group. Its cuts compose with a StackedStepLR on
    the same optimizer (its closed form is multiplied by them) and with torch schedulers that
    scale the shared lr by a factor (a StackedCosineLR is refused beside it); a torch scheduler that
    sets the shared lr outright each epoch (LambdaLR) leaves the cuts in place, where on N torch optimizers its next
    step would undo them.
    """

    def __init__(self, optimizer, mode: str = "min", factor=0.1, patience=10, threshold=1e-4, threshold_mode: str = "rel",
                 cooldown=0, min_lr=0.0, eps=1e-8):
        owner = type(self).__name__
        if not isinstance(optimizer, _StackedOptimizer):
            raise OptimizerError(f"{owner}: {type(optimizer).__name__} is not a stacked optimizer; pass a "
                                 "StackedSGD/StackedAdam/StackedAdamW (torch.optim.lr_scheduler.ReduceLROnPlateau for others)")
        if mode not in ("min", "max") or threshold_mode not in ("rel", "abs"):
            raise OptimizerError(f"{owner}: mode={mode!r}, threshold_mode={threshold_mode!r}; mode is 'min' or 'max' and "
                                 "threshold_mode 'rel' or 'abs', as torch's")
        self.optimizer, self.n_members = optimizer, optimizer.n_members
        device = optimizer.param_groups[0]["member_lr"].device
        vec = lambda name, v, low: _check_range(owner, name, _member_vector(owner, name, v, self.n_members, device), low)  # noqa: E731
        self.factor = vec("factor", factor, 0.0)
        if bool((self.factor >= 1.0).any()):
            raise OptimizerError(f"{owner}: factor={self.factor.tolist()} has a value >= 1.0; a reduction multiplies the lr "
                                 "by a factor below 1")
        self.patience, self.threshold = vec("patience", patience, 0.0), vec("threshold", threshold, 0.0)
        self.cooldown, self.eps = vec("cooldown", cooldown, 0.0), vec("eps", eps, 0.0)
        groups = len(optimizer.param_groups)
        if isinstance(min_lr, (list, tuple)) and len(min_lr) == groups and (groups > 1 or self.n_members != 1):
            if groups == self.n_members and all(isinstance(v, (int, float)) for v in min_lr):
                raise OptimizerError(
                    f"{owner}: min_lr={list(min_lr)} could mean one value per param group (torch's reading of a "
                    f"list) or one per member: there are {groups} of each. Pass each group's entry as a list of N "
                    "([[a] * N, [b] * N] for a per group), or a tensor of N values for one value per member in every "
                    "group")
            per_group = list(min_lr)
            self._default_min_lr = None
        else:
            per_group = [min_lr] * groups
            self._default_min_lr = vec("min_lr", min_lr, 0.0)  # also a group's added later, as torch's default_min_lr
        self.min_lrs = [vec("min_lr", v, 0.0) for v in per_group]
        self.cuts = [torch.ones(self.n_members, dtype=self.factor.dtype, device=device) for _ in range(groups)]
        optimizer.__dict__.setdefault("_stagewise_plateaus", weakref.WeakSet()).add(self)
        self.mode, self.threshold_mode = mode, threshold_mode
        self.best = torch.full((self.n_members,), math.inf if mode == "min" else -math.inf, dtype=self.factor.dtype, device=device)
        self.num_bad_epochs = torch.zeros(self.n_members, dtype=torch.long, device=device)
        self.cooldown_counter = torch.zeros(self.n_members, dtype=self.factor.dtype, device=device)
        self.last_epoch = 0

    def _better(self, current: torch.Tensor) -> torch.Tensor:
        if self.mode == "min":
            bound = self.best * (1.0 - self.threshold) if self.threshold_mode == "rel" else self.best - self.threshold
            return current < bound
        bound = self.best * (self.threshold + 1.0) if self.threshold_mode == "rel" else self.best + self.threshold
        return current > bound

    def step(self, metrics) -> None:
        """One epoch with member i's metric `metrics[i]`; reduces the lr of the members past their patience."""
        owner = type(self).__name__
        try:
            current = torch.as_tensor(metrics.detach() if isinstance(metrics, torch.Tensor) else metrics,
                                      dtype=self.best.dtype).to(self.best.device).flatten()
        except (TypeError, ValueError, RuntimeError):
            raise OptimizerError(f"{owner}.step: metrics={metrics!r} is not numbers; pass one metric per member") from None
        if current.numel() != self.n_members:
            raise OptimizerError(f"{owner}.step: {current.numel()} metric(s) for {self.n_members} members; pass one per member "
                                 "(each member's own validation loss, an [N] tensor)")
        self.last_epoch += 1
        better = self._better(current)
        self.best = torch.where(better, current, self.best)
        self.num_bad_epochs = torch.where(better, torch.zeros_like(self.num_bad_epochs), self.num_bad_epochs + 1)
        cooling = self.cooldown_counter > 0
        self.cooldown_counter = torch.where(cooling, self.cooldown_counter - 1, self.cooldown_counter)
        self.num_bad_epochs = torch.where(cooling, torch.zeros_like(self.num_bad_epochs), self.num_bad_epochs)
        reduce = self.num_bad_epochs > self.patience
        if bool(reduce.any()):
            self._take_added_groups()
            for k, g in enumerate(self.optimizer.param_groups):
                scale = float(g["lr"])
                if scale <= 0:
                    continue
                old = scale * g["member_lr"]
                new = torch.maximum(old * self.factor, self.min_lrs[k])
                cut = reduce & (old - new > self.eps)
                g["member_lr"].copy_(torch.where(cut, new / scale, g["member_lr"]))
                self.cuts[k] = torch.where(cut, self.cuts[k] * new / old.clamp_min(torch.finfo(old.dtype).tiny), self.cuts[k])
            self.cooldown_counter = torch.where(reduce, self.cooldown, self.cooldown_counter)
            self.num_bad_epochs = torch.where(reduce, torch.zeros_like(self.num_bad_epochs), self.num_bad_epochs)

    def _take_added_groups(self) -> None:
        """Before a cut: a min_lr and no cut for each param group added after this scheduler was built
        (opt.add_param_group), as torch's scheduler takes its default min_lr for every group then, or an
        OptimizerError where min_lr was given per group (torch raises there too)."""
        groups = self.optimizer.param_groups
        added = len(groups) - len(self.min_lrs)
        if added <= 0:
            return
        if self._default_min_lr is None:
            raise OptimizerError(
                f"{type(self).__name__}: {added} param group(s) were added to the optimizer after this scheduler was "
                f"built (opt.add_param_group), and min_lr was given per group ({len(self.min_lrs)} of them): no min_lr "
                "for the new ones, where torch's scheduler raises too. Extend `scheduler.min_lrs` with an [N] tensor "
                "per new group, or give min_lr as one value (or N) for every group")
        self.min_lrs += [self._default_min_lr.clone() for _ in range(added)]
        self.cuts += [torch.ones_like(self.cuts[0]) for _ in range(added)]

    def get_last_lr(self) -> list[torch.Tensor]:
        """Effective per-member lr of each group, [N] each."""
        return [g["lr"] * g["member_lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {k: _clone_value(v) for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "optimizer"})


# --- torch optimizers that would mix members -------------------------------------------------

# torch.optim classes whose update of a tensor is not elementwise: on a batched module's stacked [N, ...] parameters
# they would mix the members, without a word. What each does, and the fix.
_MIXING = [(getattr(torch.optim, name, None), why) for name, why in (
    ("LBFGS", "takes its dot products, curvature history and line search over all its parameters together, so "
              "every member would get one step size and one curvature from all members' gradients"),
    ("Adafactor", "factors its second moment over the last two dims of each tensor and scales each update by the "
                  "tensor's RMS, so a stacked [N, d] parameter (a bias) is one matrix of all members"),
    ("Muon", "orthogonalizes each 2-D parameter as one matrix, so a stacked [N, d] parameter (a bias) is one matrix "
             "of all members"),
) if getattr(torch.optim, name, None) is not None]
_BATCHED_MODULES: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_WATCH: list = []  # the global optimizer hook's handle, once registered

# Optimizer classes whose step updates every element of a tensor from that element's own gradient and state alone
# (scalars per tensor, a step count, come from hyper-parameters): on stacked [N, ...] parameters they update each
# member as its own copy would. Whatever else steps the stacked parameters, a third-party Optimizer subclass (SAM's
# gradient norm, LAMB's and LARS's trust ratio, a quantized optimizer's blocks) or one wrapping another, may reduce
# over a whole stacked parameter and mix the members: it is warned about (MIXING_WARNING) at its first step.
_PER_ELEMENT = tuple(kind for kind in (getattr(torch.optim, name, None) for name in (
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "SparseAdam"))
    if kind is not None)
# Optimizers that only hand the step to the optimizer they wrap (each on whole parameters): judged by what they wrap.
_DELEGATING = frozenset({"accelerate.optimizer.AcceleratedOptimizer",
                         "torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer",
                         "torch.distributed.optim.post_localSGD_optimizer.PostLocalSGDOptimizer"})
_KINDS_CHECKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers whose kind was judged


def watch_stacked_parameters(module: torch.nn.Module) -> None:
    """Refuse, at its first step, a torch optimizer of `_MIXING` stepping `module`'s stacked parameters; warn about one
    not known to update each element alone (`mixing_warning`)."""
    from stagewise.executor import habits  # torch's gradient-norm functions and update_bn (imports this module's users)

    _BATCHED_MODULES.add(module)
    habits.watch(module)
    _watch_gradient_norms(module)  # a norm over its members' gradients outside an optimizer's step (ASAM's)
    if not _WATCH:
        _WATCH.append(register_optimizer_step_pre_hook(_refuse_mixing))


GRAD_SCALER_REFUSAL = (
    "stepped by a torch.amp.GradScaler, which checks all members' gradients together: one member's inf or NaN (a "
    "diverging member of an lr sweep, an fp16 overflow) skips the step of every member and halves every member's "
    "scale, where N training runs would skip that member alone. Train the batched module without a scaler: in "
    "bfloat16 (planner.set_dtype(plan, 'bfloat16'), which needs none) or float32; the same holds for a skip of the "
    "whole step on a non-finite summed loss")


def _forget_grad_scaler(optimizer: torch.optim.Optimizer) -> None:
    """Drop what a GradScaler set on `optimizer` for its step (it deletes them after a step that returns): a refused
    step leaves the optimizer as it was, to step without the scaler."""
    for name in ("found_inf", "grad_scale"):
        optimizer.__dict__.pop(name, None)


def _grad_scaler_codes() -> frozenset:
    """The code objects of torch.amp.GradScaler's methods that call an optimizer's step()."""
    scaler = getattr(torch.amp, "GradScaler", None)
    return frozenset(getattr(scaler, name).__code__ for name in ("step", "_maybe_opt_step") if hasattr(scaler, name))


_SCALER_CODES = _grad_scaler_codes()


def _stepped_by_grad_scaler(depth: int = 8) -> bool:
    """Whether a torch.amp.GradScaler's step() is among the callers of a torch optimizer's step pre-hook (code
    objects compared: a few pointer tests per step of any optimizer while a batched module exists)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in _SCALER_CODES:  # an enabled one: a disabled scaler only calls step()
            return bool(getattr(frame.f_locals.get("self"), "_enabled", True))
        frame = frame.f_back
    return False


def grouping_by_dim_warning(groups: list[dict], who: str, stacked: set[int] | None = None) -> str | None:
    """The warning where single-model code may have chosen the parameters without weight decay by `p.dim() < 2` or
    `p.ndim <= 1` (biases, norms): every stacked parameter has the member axis in front, so a bias or a norm's weight
    lands in a decayed group. Said where a group without weight decay exists (empty, or holding what a name test
    caught: timm's `ndim <= 1 or name.endswith('.bias')` leaves the norms' weights decayed) and a decayed group holds a
    vector per member. `stacked`: ids of the parameters to consider (a torch optimizer's: the batched module's)."""
    def decays(g: dict) -> bool:
        return "weight_decay" in g and bool(torch.as_tensor(g["weight_decay"]).any())

    considered = lambda p: stacked is None or id(p) in stacked
    without = [g for g in groups if "weight_decay" in g and not decays(g) and all(considered(p) for p in g["params"])]
    decayed = [p for g in groups if decays(g) for p in g["params"] if considered(p) and p.dim() <= 2]
    if not (without and decayed):  # a warning, not a refusal: a grouping by name may mean it (RMSNorm weights decayed)
        return None
    return (f"{who}: a param group has no weight decay while another decays parameters of shape {list(decayed[0].shape)} "
            "(one vector per member: a bias or a norm's weight). If the groups were chosen by `p.dim() < 2` (or p.ndim), "
            "that counts the member axis every stacked parameter has in front, so biases and norm weights may be decayed "
            "where each member's own model would not decay them (a grouping by name that means it is fine); group by "
            "name (for name, p in "
            "ens.named_stacked_parameters()) or by `p.dim() - 1 < 2`")


_GROUPS_CHECKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _per_element(optimizer: Any) -> bool:
    """Whether `optimizer`'s step is known to update each element alone: the step that runs is one of _PER_ELEMENT's or
    a stacked optimizer's (a subclass that only changes __init__ inherits it), its class is a known delegating
    wrapper, or the class says so (`stagewise_per_member = True`)."""
    kind = type(optimizer)
    if getattr(kind, "stagewise_per_member", False) is True or f"{kind.__module__}.{kind.__qualname__}" in _DELEGATING:
        return True
    # the class whose step runs: torch's Optimizer.__init__ writes a profiling wrapper of the inherited step into the
    # class of the first instance made (a subclass made before any plain Adam holds a wrapped Adam.step of its own),
    # so the step is unwrapped and its owner is the last class in the MRO holding that same function
    step = inspect.unwrap(getattr(kind, "step", None)) if getattr(kind, "step", None) is not None else None
    owners = [c for c in kind.__mro__ if "step" in c.__dict__ and inspect.unwrap(c.__dict__["step"]) is step]
    owner = owners[-1] if owners else None
    return owner in _PER_ELEMENT or owner in (StackedSGD, StackedAdam, StackedAdamW, _StackedOptimizer)


def _stepping_optimizers(optimizer: torch.optim.Optimizer, depth: int = 8) -> list[Any]:
    """`optimizer` and the optimizers whose methods called its step (SAM's second_step calling its base optimizer's,
    a Lookahead's step calling the inner one's): the `self` of the caller frames that is an Optimizer."""
    found, frame = [optimizer], sys._getframe(3)  # past this function, _warn_unknown_optimizers and _refuse_mixing
    for _ in range(depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(owner, torch.optim.Optimizer) and all(owner is not f for f in found):
            found.append(owner)
        frame = frame.f_back
    return found


def _callers_level() -> int:
    """The warnings stacklevel of the first frame outside torch and this module (the call of step, or of the method
    stepping an optimizer: SAM's second_step)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or "/torch/" in frame.f_code.co_filename.replace("\\", "/")):
        frame, level = frame.f_back, level + 1
    return level


def _holds_stacked(optimizer: Any, stacked: set[int]) -> bool:
    return any(id(p) in stacked for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ()))


def mixing_warning(name: str) -> str:
    """The warning for an optimizer `name` not known to update each element alone, stepping stacked parameters."""
    return (
        f"{name} steps a batched module's stacked parameters and is not known to update each element alone: a norm, "
        "sum or mean it takes over a whole parameter (SAM's gradient norm, LAMB's or LARS's trust ratio, an optimizer "
        "quantizing blocks) is one over all N members of a stacked [N, ...] parameter, so every member's step would "
        "depend on the others' gradients and weights, where N separate training runs keep them apart. Fix: take such "
        "a reduction per member (over p.grad.reshape(N, -1) along dim 1, summed over parameters per member; "
        "executor.clip_grad_norm_per_member_ returns the [N] gradient norms), scale by it viewed [N, 1, ...], and "
        "step with a torch per-element optimizer or executor.StackedSGD / StackedAdam / StackedAdamW; or run this "
        "optimizer on each member's own copy (ens.member_state_dicts()). If its update takes no reduction over a "
        f"whole parameter, say so with {name.rsplit('.', 1)[-1]}.stagewise_per_member = True, or silence this with "
        "warnings.filterwarnings('ignore', category=executor.JointNormWarning)")


def _warn_unknown_optimizers(optimizer: torch.optim.Optimizer) -> None:
    """At an optimizer's first step while batched modules exist: warn where it, or an optimizer calling its step,
    holds stacked parameters and is not known to update each element alone (`mixing_warning`). A warning, not a
    refusal: an optimizer written for them (SAM with per-member norms, a Lookahead) trains each member as its own."""
    from stagewise.executor.habits import JointNormWarning  # the category users filter for norms over all members

    candidates = [o for o in _stepping_optimizers(optimizer) if o not in _KINDS_CHECKED]
    if not candidates:
        return
    for o in candidates:
        _KINDS_CHECKED.add(o)
    stacked = {id(p) for module in list(_BATCHED_MODULES) for p in module.parameters()}
    for o in candidates:
        if not _per_element(o) and _holds_stacked(o, stacked):
            kind = type(o)
            warnings.warn(mixing_warning(f"{kind.__module__}.{kind.__qualname__}"), JointNormWarning,
                          stacklevel=_callers_level())
            return


def _refuse_mixing(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    why = next((why for kind, why in _MIXING if isinstance(optimizer, kind)), None)
    if not _BATCHED_MODULES:
        return None
    if why is None and optimizer not in _KINDS_CHECKED and not torch.compiler.is_compiling():
        _warn_unknown_optimizers(optimizer)  # (dynamo cannot trace the frame walk nor warnings.warn)
    if why is None and optimizer not in _GROUPS_CHECKED and not isinstance(optimizer, _StackedOptimizer):
        _GROUPS_CHECKED.add(optimizer)  # a torch optimizer on the stacked parameters, at its first step
        stacked = {id(p) for module in list(_BATCHED_MODULES) for p in module.parameters()}
        warning = grouping_by_dim_warning(optimizer.param_groups, f"torch.optim.{type(optimizer).__name__}", stacked)
        if warning:
            warnings.warn(warning, stacklevel=3)
    if why is None and not _stepped_by_grad_scaler():
        return None
    stacked = {id(p) for module in list(_BATCHED_MODULES) for p in module.parameters()}
    if why is None and any(id(p) in stacked for group in optimizer.param_groups for p in group["params"]):
        name = type(optimizer).__name__ if isinstance(optimizer, _StackedOptimizer) else f"torch.optim.{type(optimizer).__name__}"
        _forget_grad_scaler(optimizer)
        raise OptimizerError(f"{name} on a batched module's parameters, {GRAD_SCALER_REFUSAL}")
    if why is not None and any(id(p) in stacked for group in optimizer.param_groups for p in group["params"]):
        raise OptimizerError(
            f"torch.optim.{type(optimizer).__name__} on a batched module's parameters: it {why}. Use a stacked "
            "optimizer (executor.StackedSGD / StackedAdam / StackedAdamW) on ens.parameters(), or run this optimizer "
            "on each member's own copy (ens.member_state_dicts())")
    return None


# --- norms over all members of a stacked gradient, taken outside an optimizer's step ----------

# A class wrapping a torch optimizer without being one (SamsungLabs' ASAM / SAM: `SAM(optimizer, model, rho)` whose
# ascent_step scales the gradients by one norm over all parameters), a custom clip or a gradient-norm schedule takes a
# norm over each stacked gradient before a per-element optimizer steps: the step hook above sees only that optimizer.
# So torch's norm functions are watched while batched modules exist: a norm over the member axis of a stacked
# parameter's `.grad` (the tensor itself, or `.data` / `.detach()` of it) warns once per call site and module.
# torch.norm and Tensor.norm reach torch.linalg.vector_norm (strided CPU/CUDA tensors); clip_grad_norm_ and
# get_total_norm are left to executor.habits (warned there), an Optimizer's own methods to its first step's warning.
_NORM_FUNCTIONS = (("vector_norm", "torch.linalg.vector_norm (or torch.norm, Tensor.norm)", "aten::linalg_vector_norm"),
                   ("norm", "torch.linalg.norm", "aten::linalg_norm"),
                   ("_foreach_norm", "torch._foreach_norm", "aten::_foreach_norm"))
_NORM_ORIGINALS: dict[str, Callable] = {}
# the shapes of the watched modules' stacked parameters -> those modules: a norm of a tensor of another shape (every
# norm in a forward, nearly) costs one dict lookup
_STACKED_SHAPES: "dict[tuple[int, ...], weakref.WeakSet[torch.nn.Module]]" = {}
_NORM_SITES_WARNED: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()
_PACKAGE_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), part) + os.sep
                      for part in ("executor", "planner", "app"))
_CLIP_GRAD_FILE = os.sep + os.path.join("torch", "nn", "utils", "clip_grad.py")


def _watch_gradient_norms(module: torch.nn.Module) -> None:
    """Index `module`'s stacked parameter shapes, and wrap torch's norm functions once (see _NORM_FUNCTIONS)."""
    for p in module.parameters():
        _STACKED_SHAPES.setdefault(tuple(p.shape), weakref.WeakSet()).add(module)
    if _NORM_ORIGINALS:
        return
    import torch.jit._builtins as jit_builtins  # TorchScript maps torch functions to aten ops by identity

    for name, public, aten in _NORM_FUNCTIONS:
        owner = torch if name == "_foreach_norm" else torch.linalg
        original = _NORM_ORIGINALS[public] = getattr(owner, name)
        wrapped = _norm_watched(original, public, foreach=name == "_foreach_norm")
        setattr(owner, name, wrapped)
        jit_builtins._register_builtin(wrapped, aten)


def _norm_watched(original: Callable, public: str, foreach: bool) -> Callable:
    """`original` (a torch norm function) warning where it reduces over the member axis of a stacked gradient."""
    @functools.wraps(original)
    def watched(*args, **kwargs):
        # (is_compiling first: dynamo cannot trace the frame walk nor warnings.warn, and would guard on the index)
        if not torch.compiler.is_compiling() and _STACKED_SHAPES:
            first = args[0] if args else kwargs.get("x", kwargs.get("A", kwargs.get("input")))
            if not foreach:
                module = _stacked_grad_of(first, args[2] if len(args) > 2 else kwargs.get("dim"))
            elif isinstance(first, (list, tuple)):
                module = next((m for m in map(_stacked_grad_of, first, [None] * len(first)) if m is not None), None)
            else:
                module = None
            if module is not None:
                _warn_gradient_norm(public, module)
        return original(*args, **kwargs)
    return watched


def _stacked_grad_of(t: Any, dim: Any) -> "torch.nn.Module | None":
    """The batched module of several members whose stacked parameter's gradient `t` is (itself, or a tensor on its
    memory with its layout), where a norm over `dim` (None: all dims) spans its member axis; None otherwise."""
    modules = _STACKED_SHAPES.get(t.shape) if isinstance(t, torch.Tensor) else None
    if not modules or t.dim() == 0:
        return None
    if dim is not None:
        dims = (dim,) if isinstance(dim, int) else tuple(dim) if isinstance(dim, (list, tuple)) else None
        if dims is None or (dims and all(isinstance(d, int) and d % t.dim() != 0 for d in dims)):
            return None  # a norm per member (over dims 1, ...), or a dim torch will judge
    for module in list(modules):
        if getattr(module, "n_members", 0) < 2:
            continue
        for p in module.parameters():
            g = p.grad
            if g is t or (g is not None and g.shape == t.shape and _same_memory(g, t)):
                return module
    return None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `b` is `a` under another tensor object (`a.data`, `a.detach()`): same memory, offset and strides."""
    try:
        return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
                and a.dtype == b.dtype)
    except (RuntimeError, NotImplementedError):  # no storage: a vmap BatchedTensor, a fake tensor (not a gradient)
        return False


def _norm_taker() -> "tuple[Any, int] | None":
    """The frame calling torch's norm function (the first outside torch and this module) and its warnings stacklevel
    for _warn_gradient_norm's warnings.warn; None where the norm is no user's to warn about: taken by stagewise, by
    torch's clip_grad_norm_ / get_total_norm (executor.habits warns there), by a torch Optimizer's method (its first
    step warns unless it is known per element), or by a class saying `stagewise_per_member = True`."""
    frame, level, site, site_depth = sys._getframe(3), 3, None, 0  # past this, _warn_gradient_norm and the wrapper
    for depth in range(16):
        if frame is None:
            break
        filename = frame.f_code.co_filename
        if filename.endswith(_CLIP_GRAD_FILE):
            return None
        outside = filename != __file__ and "/torch/" not in filename.replace("\\", "/")
        if site is None and outside:
            if filename.startswith(_PACKAGE_DIRS):
                return None
            site, site_depth = (frame, level), depth
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if owner is not None and outside and (isinstance(owner, torch.optim.Optimizer)
                                              or getattr(type(owner), "stagewise_per_member", False) is True):
            return None
        if site is not None and depth >= site_depth + 4:  # the method taking it, and what called that
            break
        frame, level = frame.f_back, level + 1
    return site


def gradient_norm_warning(what: str, n: int) -> str:
    """The warning for a norm taken with `what` over all `n` members of a batched module's stacked gradient."""
    return (
        f"{what} over a batched module's stacked gradient (p.grad of shape [N, ...]) takes one norm over all {n} "
        "members together: a SAM / ASAM step (a class wrapping a torch optimizer, SamsungLabs' ASAM), a custom clip or "
        "any update scaled by it makes every member's step depend on the others' gradients, where N separate training "
        "runs keep them apart. Fix: take it per member, torch.linalg.vector_norm(p.grad.reshape(N, -1), dim=1) for one "
        "parameter's [N] norms (executor.clip_grad_norm_per_member_ returns the [N] total norms of all parameters), "
        "and scale by it viewed [N, 1, ...]. If the members train as one model on a joint loss, the joint norm is "
        "what you want: set stagewise_per_member = True on the class taking it, or silence this with "
        "warnings.filterwarnings('ignore', category=executor.JointNormWarning)")


def _warn_gradient_norm(what: str, module: torch.nn.Module) -> None:
    """Warn (once per call site and module) about a norm over all members of `module`'s stacked gradient."""
    from stagewise.executor.habits import JointNormWarning  # the category users filter for norms over all members

    taker = _norm_taker()
    if taker is None:
        return
    frame, level = taker
    sites = _NORM_SITES_WARNED.setdefault(module, set())
    site = (frame.f_code, frame.f_lineno)
    if site in sites:
        return
    sites.add(site)
    warnings.warn(gradient_norm_warning(what, module.n_members), JointNormWarning, stacklevel=level)
