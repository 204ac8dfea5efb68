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
from torch.nn.utils import parametrize

from stagewise.executor.stages import LoopRunner
from stagewise.executor.values import PerMember, member_rows, member_value


def _shell(module: nn.Module, state: dict[str, torch.Tensor], prefix: str) -> nn.Module:
    """A shallow copy of `module` (and its children) reading parameters/buffers from `state`."""
    if parametrize.is_parametrized(module):  # its class refuses copy.copy (no pickling of parametrized modules)
        shell = module.__class__.__new__(module.__class__)
        shell.__dict__.update(module.__dict__)
    else:
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
        # each copy's generated forward, called directly (a stage module has no hooks of its own)
        self._forwards = [gm.forward for gm in self._bound]

    def run(self, args: list) -> list:
        n = self.n_members
        if args and self.program.writes_in_place:
            # each member's rows taken just before its call: a row taken before another member's write turned the
            # tensor into one that records gradients is refused by autograd (and an unbind row always is)
            results = [forward(*(member_value(a, i) for a in args)) for i, forward in enumerate(self._forwards)]
        elif args:  # each argument's N member values at once (one unbind per batched tensor), then one call per member
            rows = zip(*(member_rows(a, n) for a in args))
            results = [forward(*row) for forward, row in zip(self._forwards, rows)]
        else:
            results = [forward() for forward in self._forwards]
        return [PerMember(list(column)) for column in zip(*results)]  # the stage module returns a flat tuple
