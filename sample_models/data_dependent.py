"""MLP with data-dependent steps that cannot run under vmap.

- `h.abs().max().item()` turns a tensor into a Python float (vmap refuses
  .item()); it shows up as a call_method node in the fx graph.
- `sign_branch` branches in Python on a tensor value. It is wrapped with
  torch.fx.wrap so symbolic_trace records it as one opaque call_function node
  instead of failing on the branch.
Exercises capability detection: the planner must exclude these nodes (loop over
members) and still batch the Linears around them.
"""
import torch
import torch.nn as nn


@torch.fx.wrap
def sign_branch(x):
    if x.mean().item() > 0:
        return torch.relu(x)
    else:
        return -torch.relu(-x)


class DataDependentMLP(nn.Module):
    def __init__(self, d=64, d_hidden=128):
        super().__init__()
        self.fc1 = nn.Linear(d, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        scale = h.abs().max().item()   # data-dependent: Python float
        h = h / (scale + 1.0)
        h = sign_branch(self.fc2(h))   # Python branch on a tensor value
        return self.fc3(h)


def build_model() -> nn.Module:
    return DataDependentMLP().eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(32, 64, generator=g),)
