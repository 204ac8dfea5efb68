"""A load_state_dict pre-hook migrating an old key in place (a review case: each load gets its own tensors)."""
import torch
from torch import nn

class ScaledLinear(nn.Linear):
    """Old checkpoints stored the weight divided by sqrt(fan_in) ('weight_scaled'); the hook migrates them."""
    def __init__(self, i, o):
        super().__init__(i, o)
        self._register_load_state_dict_pre_hook(self._migrate)
    def _migrate(self, sd, prefix, *args):
        k = prefix + "weight_scaled"
        if k in sd:
            w = sd.pop(k)
            w.mul_(self.in_features ** 0.5)   # in place, as the conversion script did
            sd[prefix + "weight"] = w

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = ScaledLinear(8, 8)
        self.b = nn.Linear(8, 3)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

def build_model():
    return Net()

def example_inputs():
    return (torch.randn(4, 8),)
