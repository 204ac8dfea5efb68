"""Dense mixture of experts: 4 expert MLPs (64->128->64) + softmax gate.

Every expert runs on every token and the outputs are summed with the gate
weights (no top-k routing, so no data-dependent indexing). Exercises a wide,
parallel graph: four independent branches that fan out from the input and fan
back in, giving the planner several ways to group stages.
"""
import torch
import torch.nn as nn


class Expert(nn.Module):
    def __init__(self, d=64, d_hidden=128):
        super().__init__()
        self.fc1 = nn.Linear(d, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class DenseMoE(nn.Module):
    def __init__(self, d=64, n_experts=4):
        super().__init__()
        self.gate = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList([Expert(d) for _ in range(n_experts)])

    def forward(self, x):
        w = torch.softmax(self.gate(x), dim=-1)                  # [b, E]
        ys = torch.stack([e(x) for e in self.experts], dim=-1)   # [b, d, E]
        return (ys * w.unsqueeze(-2)).sum(dim=-1)                # [b, d]


def build_model() -> nn.Module:
    return DenseMoE().eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(32, 64, generator=g),)
