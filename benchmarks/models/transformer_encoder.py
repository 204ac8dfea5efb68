"""nn.TransformerEncoderLayer d=64, 4 heads, FFN 256, batch_first, eval (post-norm, ReLU), between Linears.

A benchmark model (not a sample): the encoder layer is one leaf call_module (torch's fused
fast path per member in the loop); vmap only reaches it through its slow per-member fallback,
so its stage is excluded and `wide` runs it batched (executor/strategies/wide_attention.py).
"""
import torch
import torch.nn as nn


class EncoderModel(nn.Module):
    def __init__(self, d=64, n_heads=4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layer = nn.TransformerEncoderLayer(d, n_heads, 4 * d, batch_first=True)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.layer(self.inp(x)))


def build_model() -> nn.Module:
    return EncoderModel().eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 16, 64, generator=g),)
