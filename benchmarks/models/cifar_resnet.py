"""CIFAR-size ResNet: 3x3 stem, 3 stages of 2 basic blocks (16, 32, 64 channels; stride 2 between
stages, 1x1 projection shortcuts), global average pool, Linear(64 -> 10); input [128, 3, 32, 32].

A GPU benchmark model (benchmarks/gpu.py): ResNet-14 in the CIFAR layout of He et al. (ResNet-20 has
3 blocks per stage; 2 keep trace and compile times inside the benchmark's device budget), about
6 GFLOP per member per forward at batch 128. BatchNorm runs in eval mode on randomised running
statistics, so members really differ (as in sample_models/resblock.py).
STAGEWISE_BENCH_SMOKE=1 makes it tiny (4/8/8 channels, 1 block per stage, [2, 3, 8, 8]) for the CPU smoke test.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def _smoke() -> bool:
    return os.environ.get("STAGEWISE_BENCH_SMOKE") == "1"


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, widths=(16, 32, 64), blocks=2, n_classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        layers, c = [], widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks):
                layers.append(BasicBlock(c, w, 2 if i > 0 and j == 0 else 1))
                c = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x):
        h = self.layers(F.relu(self.bn(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


def build_model() -> nn.Module:
    m = CifarResNet((4, 8, 8), blocks=1) if _smoke() else CifarResNet()
    with torch.no_grad():
        for bn in (x for x in m.modules() if isinstance(x, nn.BatchNorm2d)):
            bn.running_mean.normal_(0.0, 0.1)
            bn.running_var.uniform_(0.5, 1.5)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_(0.0, 0.1)
    return m.eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, 8, 8, generator=g) if _smoke() else torch.randn(128, 3, 32, 32, generator=g),)
