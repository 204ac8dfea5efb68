"""GRU sequence model: nn.GRU(64 -> 64, batch_first) over 32 steps + Linear head.

nn.GRU is one opaque call_module backed by a fused RNN kernel (flat weights).
Exercises a module whose vmap support is doubtful: the capability check has
to decide whether it can be batched or must be excluded (looped per member).
"""
import torch
import torch.nn as nn


class GRUModel(nn.Module):
    def __init__(self, d_in=64, d_hidden=64, d_out=10):
        super().__init__()
        self.gru = nn.GRU(d_in, d_hidden, batch_first=True)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        out, _ = self.gru(x)          # [b, t, hidden]
        return self.head(out[:, -1])  # last step


def build_model() -> nn.Module:
    return GRUModel().eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 32, 64, generator=g),)
