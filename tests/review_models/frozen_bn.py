"""A frozen BatchNorm whose _load_from_state_dict drops num_batches_tracked (a review case: keys as torch reads them)."""
import torch
from torch import nn
class FrozenBatchNorm2d(nn.Module):       # as DETR / torchvision.ops write it
    def __init__(self, n):
        super().__init__()
        self.register_buffer("weight", torch.ones(n)); self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n)); self.register_buffer("running_var", torch.ones(n))
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        num_batches_tracked_key = prefix + "num_batches_tracked"
        if num_batches_tracked_key in state_dict:
            del state_dict[num_batches_tracked_key]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    def forward(self, x):
        scale = self.weight.reshape(1, -1, 1, 1) * (self.running_var.reshape(1, -1, 1, 1) + 1e-5).rsqrt()
        return x * scale + (self.bias.reshape(1, -1, 1, 1) - self.running_mean.reshape(1, -1, 1, 1) * scale)
class Backbone(nn.Module):
    def __init__(self, norm):
        super().__init__(); self.conv = nn.Conv2d(3, 8, 3, padding=1); self.bn = norm(8)
    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))
def build_model():
    return Backbone(FrozenBatchNorm2d).eval()
def example_inputs():
    return (torch.randn(2, 3, 6, 6),)
