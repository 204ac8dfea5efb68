"""Pre-LN transformer encoder block: d=64, 4 heads, FFN 4x with GELU.

Attention is written out with explicit q/k/v Linears and
F.scaled_dot_product_attention (not nn.MultiheadAttention) so that
torch.fx.symbolic_trace sees every op. Exercises SDPA under vmap, reshapes whose
sizes come from x.shape (fx size proxies), LayerNorm and two residual branches.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d=64, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def attn(self, x):
        b, s, d = x.shape
        h = self.n_heads
        q = self.q(x).view(b, s, h, d // h).transpose(1, 2)  # [b, h, s, dh]
        k = self.k(x).view(b, s, h, d // h).transpose(1, 2)
        v = self.v(x).view(b, s, h, d // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, d)
        return self.proj(y)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.ffn(self.ln2(x))
        return x


def build_model() -> nn.Module:
    return Block().eval()


def example_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 16, 64, generator=g),)
