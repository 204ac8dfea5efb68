"""The `loop` strategy without per-call re-parametrisation.

The spine's LoopRunner calls `functional_call(stage, member_state)` once per
member per call, which swaps every parameter in and out each time (measured
27-140 us per member on the sample models: a third of an MLP loop's time).
BoundLoopRunner builds, once, one shallow copy of the stage module per member
whose parameters and buffers *are* that member's state (views into the stacked
tensors, so in-place updates of BatchedModule.stacked_state are still seen),
and then just calls them. LoopRunner stays the trusted reference that profile
and autotune check every strategy against.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from stagewise.executor.stages import LoopRunner
from stagewise.executor.values import PerMember, member_value


def _shell(module: nn.Module, state: dict[str, torch.Tensor], prefix: str) -> nn.Module:
    """A shallow copy of `module` (and its children) reading parameters/buffers from `state`."""
    shell = copy.copy(module)
    shell._parameters = dict(module._parameters)
    shell._buffers = dict(module._buffers)
    shell._modules = {name: (_shell(child, state, f"{prefix}{name}.") if child is not None else None)
                      for name, child in module._modules.items()}
    for table in (shell._parameters, shell._buffers):
        for name in table:
            key = prefix + name
            if key in state:
                table[name] = state[key]
    if isinstance(shell, nn.RNNBase):
        shell._init_flat_weights()  # RNNs run from a cached list of their weights
    return shell


def bind(module: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """`module` with its state replaced by `state` (full dotted names), sharing everything else."""
    return _shell(module, state, "")


class BoundLoopRunner(LoopRunner):
    """The member loop over per-member bound copies of the stage (see module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._bound = [bind(self.program.module, st) for st in self.member_states]

    def run(self, args: list) -> list:
        results = [gm(*(member_value(a, i) for a in args)) for i, gm in enumerate(self._bound)]
        return [PerMember([r[k] for r in results]) for k in range(len(self.program.output_names))]
