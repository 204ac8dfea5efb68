"""A checkpoint format migrated by a versioned _load_from_state_dict (a review case: the version metadata must survive a wrapper prefix taken off)."""
import torch
from torch import nn

class VLinear(nn.Module):
    """Version 2 stores weight as (out, in); version 1 files stored it as (in, out)."""
    _version = 2
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5)
    def _load_from_state_dict(self, sd, prefix, local_metadata, strict, missing, unexpected, errors):
        version = local_metadata.get("version", None)
        if version is None or version < 2:
            k = prefix + "weight"
            if k in sd:
                sd[k] = sd[k].t()
        super()._load_from_state_dict(sd, prefix, local_metadata, strict, missing, unexpected, errors)
    def forward(self, x):
        return x @ self.weight.t()

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = VLinear(8)
        self.b = nn.Linear(8, 3)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

def build_model():
    return Net()

def example_inputs():
    return (torch.randn(4, 8),)
