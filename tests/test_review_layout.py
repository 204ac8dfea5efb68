"""`ens.to(memory_format=torch.channels_last)`, as timm and torchvision training scripts call on a model: the batched
module's stacked conv weights are 5-D (the member axis), which torch's channels_last refuses. Before: a raw
RuntimeError ("required rank 4 tensor to use channels_last format") from nn.Module._apply. Now the format is not
applied (a warning says so), a device or dtype given with it is, and the module runs as the loop."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner

torch.set_num_threads(1)
N = 3


def _members():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3)) for _ in range(N)]


def test_channels_last_is_not_applied_and_the_module_runs_as_the_loop():
    members, x = _members(), torch.randn(2, 3, 6, 6)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N), members)
    with pytest.warns(UserWarning, match="keeps its own memory layout"):
        assert ens.to(memory_format=torch.channels_last) is ens
    for m in members:
        m.to(memory_format=torch.channels_last)
    xl = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(ens(xl), torch.stack([m(xl) for m in members]), rtol=1e-5, atol=1e-6)


def test_a_dtype_given_with_a_memory_format_is_applied():
    members, x = _members(), torch.randn(2, 3, 6, 6)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=N), members)
    with pytest.warns(UserWarning, match="keeps its own memory layout"):
        ens.to(torch.float64, memory_format=torch.channels_last)
    assert all(t.dtype == torch.float64 for t in ens.stacked_state.values())
    with torch.no_grad():
        want = torch.stack([m.double()(x.double()) for m in members])
        torch.testing.assert_close(ens(x.double()), want, rtol=1e-10, atol=1e-12)
