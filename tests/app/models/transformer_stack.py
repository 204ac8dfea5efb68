"""A 24-layer pre-LN transformer (the sample block, d=32) for the graph view: ~1,000 nodes, 24 identical blocks."""
import importlib.util
from pathlib import Path

import torch
import torch.nn as nn

_spec = importlib.util.spec_from_file_location(
    "_stagewise_sample_block", Path(__file__).resolve().parents[3] / "sample_models" / "transformer_block.py")
_block = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_block)

LAYERS = 24


class Stack(nn.Module):
    def __init__(self, d=32, layers=LAYERS):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.layers = nn.ModuleList(_block.Block(d, n_heads=4) for _ in range(layers))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Stack().eval()


def example_inputs() -> tuple:
    return (torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)),)
