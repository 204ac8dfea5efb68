"""LSTM sequence model: nn.LSTM(64 -> 64, batch_first) over 32 steps + Linear head.

A benchmark model (not a sample): nn.LSTM is one opaque call_module with no vmap
batching rule, so its stage is excluded; `wide` runs it batched (executor/strategies/wide_layers.py).
"""
import torch
import torch.nn as nn


class LSTMModel(nn.Module):
    def __init__(self, d_in=64, d_hidden=64, d_out=10):
        super().__init__()
        self.lstm = nn.LSTM(d_in, d_hidden, batch_first=True)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        out, _ = self.lstm(x)         # [b, t, hidden]
        return self.head(out[:, -1])  # last step


def build_model() -> nn.Module:
    return LSTMModel().eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 32, 64, generator=g),)
