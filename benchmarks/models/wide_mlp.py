"""Wide MLP: Linear(1024 -> 4096) -> GELU -> Linear(4096 -> 1024), batch 128.

A GPU benchmark model (benchmarks/gpu.py): matmul-bound, about 2.1 GFLOP per member per
forward, so N=16 members keep a GPU busy and the achieved TFLOP/s means something.
STAGEWISE_BENCH_SMOKE=1 makes it tiny (32 -> 64 -> 32, batch 4) for the CPU smoke test.
"""
import os

import torch
import torch.nn as nn


def _smoke() -> bool:
    return os.environ.get("STAGEWISE_BENCH_SMOKE") == "1"


class WideMLP(nn.Module):
    def __init__(self, d=1024, d_hidden=4096):
        super().__init__()
        self.fc1 = nn.Linear(d, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def build_model() -> nn.Module:
    return (WideMLP(32, 64) if _smoke() else WideMLP()).eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 32, generator=g) if _smoke() else torch.randn(128, 1024, generator=g),)
