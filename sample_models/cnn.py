"""Small image classifier: conv(3->16)-ReLU-maxpool-conv(16->32)-ReLU-avgpool-Linear(32->10).

A typical CNN mixing convolutions, pooling, flatten and a linear head.
Exercises batched conv (grouped-conv style rewrites), pooling and a reshape
between the conv and linear parts.
"""
import torch
import torch.nn as nn


class CNN(nn.Module):
    def __init__(self, n_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, n_classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        x = torch.flatten(self.gap(x), 1)
        return self.fc(x)


def build_model() -> nn.Module:
    return CNN().eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 3, 32, 32, generator=g),)
