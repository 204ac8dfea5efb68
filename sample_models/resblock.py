"""ResNet basic block: conv3x3-BN-ReLU-conv3x3-BN + skip, ReLU (64 channels).

Exercises per-member buffers: BatchNorm in eval mode reads running_mean /
running_var, which must be stacked per member like the parameters. The running
stats are randomised (global RNG) so that members really differ and a plan that
shares or drops buffers gives wrong numbers. Also has a fan-out/fan-in (skip).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ResBlock(nn.Module):
    def __init__(self, c=64):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + x)


def build_model() -> nn.Module:
    m = ResBlock()
    with torch.no_grad():
        for bn in (m.bn1, m.bn2):
            bn.running_mean.normal_(0.0, 0.1)
            bn.running_var.uniform_(0.5, 1.5)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_(0.0, 0.1)
    return m.eval()


def build_members(n: int) -> list:
    """n members with distinct, reproducible weights and BN stats (seed i per member)."""
    members = []
    for i in range(n):
        with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
            torch.manual_seed(i)
            members.append(build_model())
    return members


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 64, 16, 16, generator=g),)
