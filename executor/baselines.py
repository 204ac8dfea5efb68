"""Whole-model baselines, timed in the same run as the plan: what a user would write instead.

- loop: each member on its own inputs, one after another (eager);
- vmap: `torch.func.vmap(functional_call(member0, stacked_state, inputs))` of the whole model;
- vmap+compile: `torch.compile` of that;
- floor: one member on all members' inputs concatenated along dim 0 (same FLOPs,
  shared weights): the practical lower bound; assumes dim 0 is the batch axis.

Each builder returns a zero-argument callable producing N-first outputs (the
floor's outputs are not comparable and are not checked).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call, vmap

from stagewise.planner.plan import InputMode, Plan
from stagewise.executor.build import stack_member_state
from stagewise.executor.strategies import compiled
from stagewise.executor.values import PerMember, n_first
from stagewise.executor.verify import member_inputs


def stack_outputs(outputs: list) -> Any:
    """N per-member output trees in the layout the batched module returns (values.n_first):
    N-first tensors, per-member Python numbers as an [N] tensor, equal non-tensors kept."""
    return n_first(PerMember(list(outputs)), len(outputs), float_dtype=torch.float64)  # Python floats: doubles


def loop(plan: Plan, members: Sequence[nn.Module], inputs: tuple) -> Callable[[], Any]:
    per_member = [member_inputs(plan, inputs, i) for i in range(len(members))]

    def run():
        return [m(*x) for m, x in zip(members, per_member)]

    return run


def _vmapped_model(plan: Plan, members: Sequence[nn.Module], device: torch.device) -> tuple[Callable, dict[str, torch.Tensor]]:
    """(vmap of member 0's functional_call over stacked state and the plan's input modes, that stacked state)."""
    base = members[0]
    dims = tuple(0 if spec.mode is InputMode.PER_MEMBER else None for spec in plan.inputs)
    fn = vmap(lambda state, *xs: functional_call(base, state, xs, tie_weights=False), in_dims=(0, *dims), randomness="error")
    return fn, stack_member_state(members, device)


def whole_vmap(plan: Plan, members: Sequence[nn.Module], inputs: tuple, device: torch.device) -> Callable[[], Any]:
    fn, stacked = _vmapped_model(plan, members, device)
    return lambda: fn(stacked, *inputs)


def whole_vmap_compiled(plan: Plan, members: Sequence[nn.Module], inputs: tuple, device: torch.device) -> Callable[[], Any]:
    fn, stacked = _vmapped_model(plan, members, device)
    fn = compiled.compile_fresh(fn, "whole_model")
    return lambda: fn(stacked, *inputs)


def floor(plan: Plan, members: Sequence[nn.Module], inputs: tuple) -> Callable[[], Any]:
    n = plan.n_members
    big = []
    for spec, x in zip(plan.inputs, inputs):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            big.append(x)
        elif spec.mode is InputMode.PER_MEMBER:
            big.append(x.reshape(n * x.shape[1], *x.shape[2:]) if x.dim() > 1 else x)
        else:
            big.append(torch.cat([x] * n, dim=0))
    model = members[0]
    return lambda: model(*big)
