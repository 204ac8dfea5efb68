"""Two-layer MLP: Linear(64->128) -> ReLU -> Linear(128->64).

The smallest sample. Every op has a vmap batching rule, so the planner should
propose a single batched stage covering the whole graph (the happy path).
"""
import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, d_in=64, d_hidden=128, d_out=64):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def build_model() -> nn.Module:
    return MLP().eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(32, 64, generator=g),)
