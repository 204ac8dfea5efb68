"""A 2-layer nn.TransformerEncoder, d=256, 8 heads, FFN 1024, batch_first, eval (post-norm, ReLU), between
Linears; input [16, 128, 256] (batch 16, sequence 128).

A GPU benchmark model (benchmarks/gpu.py), the larger sibling of transformer_encoder.py (one layer,
d=64): about 7 GFLOP per member per forward. The encoder is one leaf call_module (torch's fused fast
path per member in the loop); `wide` runs it batched.
STAGEWISE_BENCH_SMOKE=1 makes it tiny (d=16, 2 heads, [2, 8, 16]) for the CPU smoke test.
"""
import os

import torch
import torch.nn as nn


def _smoke() -> bool:
    return os.environ.get("STAGEWISE_BENCH_SMOKE") == "1"


class Encoder2L(nn.Module):
    def __init__(self, d=256, n_heads=8, n_layers=2):
        super().__init__()
        self.inp = nn.Linear(d, d)
        layer = nn.TransformerEncoderLayer(d, n_heads, 4 * d, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.encoder(self.inp(x)))


def build_model() -> nn.Module:
    return (Encoder2L(16, 2) if _smoke() else Encoder2L()).eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 8, 16, generator=g) if _smoke() else torch.randn(16, 128, 256, generator=g),)
