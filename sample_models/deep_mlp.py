"""Deep MLP: 8 x (Linear(64->64) + GELU).

A long chain of identical, cheap, fully batchable layers. Exercises stage
proposal over many nodes (one big stage vs. per-layer stages) and merge/split
edits on a linear graph.
"""
import torch
import torch.nn as nn


class DeepMLP(nn.Module):
    def __init__(self, d=64, n_layers=8):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n_layers)])

    def forward(self, x):
        return self.layers(x)


def build_model() -> nn.Module:
    return DeepMLP().eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(32, 64, generator=g),)
