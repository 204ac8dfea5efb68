"""Elman-style RNN written as a Python loop over the sequence length.

`for t in range(x.shape[1])` needs a real int, so torch.fx.symbolic_trace fails
(a Proxy cannot be used as range()'s argument), while torch.export.export
succeeds by unrolling the loop at the example shape (12 steps). Exercises the
planner's fallback from fx tracing to torch.export.
"""
import torch
import torch.nn as nn


class ShapeLoopRNN(nn.Module):
    def __init__(self, d_in=32, d_hidden=32):
        super().__init__()
        self.d_hidden = d_hidden
        self.cell = nn.Linear(d_in, d_hidden)
        self.rec = nn.Linear(d_hidden, d_hidden, bias=False)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.d_hidden)
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(x[:, t]) + self.rec(h))
        return h


def build_model() -> nn.Module:
    return ShapeLoopRNN().eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 12, 32, generator=g),)
