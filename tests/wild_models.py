"""Models written the way people outside this project write them (tests/test_review_wild.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

D = 8


class GPT2Attention(nn.Module):
    """nanoGPT's CausalSelfAttention: a causal-mask buffer sliced to T, masked_fill with -inf."""

    def __init__(self, d=D, heads=2, block=16):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class CausalSDPA(nn.Module):
    def __init__(self, d=D, heads=2):
        super().__init__()
        self.qkv, self.o, self.h = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class Rotary(nn.Module):
    """cos/sin caches built lazily in forward, keyed by the sequence length (a Python attribute)."""

    def __init__(self, d=D):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)
        self.seq_len_cached, self.cos_cached, self.sin_cached = None, None, None

    def forward(self, x):
        T = x.shape[1]
        if T != self.seq_len_cached:
            self.seq_len_cached = T
            freqs = torch.einsum("i,j->ij", torch.arange(T, device=x.device).type_as(self.inv_freq), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos_cached, self.sin_cached = emb.cos()[None], emb.sin()[None]
        x = self.fc(x)
        x1, x2 = x.chunk(2, -1)
        return x * self.cos_cached + torch.cat((-x2, x1), -1) * self.sin_cached


class TiedLM(nn.Module):
    def __init__(self, vocab=11, d=D):
        super().__init__()
        self.emb, self.ln, self.head = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.ln(self.emb(idx)))


class Normed(nn.Module):
    """A Linear under weight_norm / spectral_norm (parametrizations or the old hook-based ones)."""

    def __init__(self, kind):
        super().__init__()
        wrap = {"weight_norm": nn.utils.parametrizations.weight_norm, "spectral_norm": nn.utils.parametrizations.spectral_norm,
                "old_weight_norm": nn.utils.weight_norm, "old_spectral_norm": nn.utils.spectral_norm}[kind]
        self.fc, self.fc2 = wrap(nn.Linear(4, 5)), nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class InplaceOnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.r = nn.Linear(4, 4), nn.ReLU(inplace=True)

    def forward(self, x):
        x += 1.0
        h = self.r(self.fc(x))
        h.mul_(2)
        return h + x


class NoGrad(nn.Module):
    """A frozen branch under torch.no_grad() and a .detach(): fc gets no gradient at all."""

    def __init__(self, how="no_grad"):
        super().__init__()
        self.fc, self.fc2, self.how = nn.Linear(4, 4), nn.Linear(4, 4), how

    def forward(self, x):
        if self.how == "no_grad":
            with torch.no_grad():
                t = self.fc(x)
        else:
            torch.set_grad_enabled(False)
            t = self.fc(x)
            torch.set_grad_enabled(True)
        return self.fc2(x) * t + self.fc(x).detach()


class NonPersistent(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), float(i + 1)), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.scale


class Temperature(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.fc, self.temperature, self.scale, self.k = nn.Linear(4, 4), 0.5 + i, 2 ** i, i + 1

    def forward(self, x):
        h = F.softmax(self.fc(x) / self.temperature, -1) * self.scale
        return torch.clamp(h, min=-self.k * 0.1, max=self.k * 0.1) + x.pow(self.k)


class Params(nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(4, 4)) for _ in range(2)])
        self.d = nn.ParameterDict({"a": nn.Parameter(torch.randn(4)), "b": nn.Parameter(torch.randn(4))})

    def forward(self, x):
        for w in self.ws:
            x = torch.tanh(x @ w)
        return x * self.d["a"] + self.d["b"]


class Route(nn.Module):
    def __init__(self, key):
        super().__init__()
        self.key, self.heads = key, nn.ModuleDict({"a": nn.Linear(4, 3), "b": nn.Linear(4, 3)})

    def forward(self, x):
        return self.heads[self.key](x)


@dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        h = self.fc(x)
        return {"h": h, "pair": (h.sum(-1), h.argmax(-1)), "c": torch.cumsum(h, 0), "top": h.topk(2, dim=-1).indices}


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return Out(logits=h.relu(), hidden=h)


class KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, *, mask=None, scale=1.0):
        h = self.fc(x)
        if mask is not None:
            h = h * mask
        return h * scale


class IntBool(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 4), nn.Linear(4, 4)

    def forward(self, idx, keep):
        return self.fc(self.emb(idx)) * keep.unsqueeze(-1).float()


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(cp.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False))


class Norms(nn.Module):
    def __init__(self, momentum=0.1, group=True):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=momentum)
        self.gn = nn.GroupNorm(2, 6) if group else nn.Identity()

    def forward(self, x):
        return self.gn(self.bn(self.fc(x)).unsqueeze(-1)).squeeze(-1)


class Embeddings(nn.Module):
    """padding_idx, and max_norm: F.embedding renormalises the weight rows it reads, in place, in forward."""

    def __init__(self, max_norm=None, padding_idx=None):
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 4, max_norm=max_norm, padding_idx=padding_idx), nn.Linear(4, 3)
        with torch.no_grad():
            self.emb.weight.mul_(3)

    def forward(self, idx):
        return self.fc(self.emb(idx))


class Scripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU())), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(self.a(x))


class StochasticDepth(nn.Module):
    """Layer drop written with a Python branch on a fresh draw (torchvision-style `torch.rand(1).item() < p`)."""

    def __init__(self, p=0.5):
        super().__init__()
        self.fc, self.p = nn.Linear(4, 4), p

    def forward(self, x):
        if self.training and torch.rand(1).item() < self.p:
            return x
        return x + self.fc(x)


class StochasticDepthTensor(nn.Module):
    """The same without .item(): a keep flag drawn from no input (fx ran it once and baked the draw in)."""

    def __init__(self, p=0.5):
        super().__init__()
        self.fc, self.p = nn.Linear(4, 4), p

    def forward(self, x):
        keep = (torch.rand(1) >= self.p).float()
        return x + self.fc(x) * keep


class RowDrop(nn.Module):
    """A per-row keep mask drawn with the input's batch size (sizes traced, no tensor input to the draw)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        keep = (torch.rand(x.shape[0], 1) > 0.5).float()
        return self.fc(x) * keep


class InputNoise(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(4, 4), nn.Dropout(0.5)

    def forward(self, x):
        return self.fc(self.drop(x + torch.randn_like(x)))


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.d = nn.Linear(4, 64), nn.Dropout(0.5)

    def forward(self, x):
        return self.d(self.fc(x))


class TiedFrozenBN(nn.Module):
    """Tied embedding/head, a frozen Linear (requires_grad False), BatchNorm on batch statistics: trained with optimizers."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.bn, self.head = nn.Embedding(10, 8), nn.Linear(8, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, idx):
        return self.head(torch.tanh(self.frozen(self.bn(torch.tanh(self.fc(self.emb(idx)))))))


class BatchNormHead(nn.Module):
    """A readout after BatchNorm (a loss on the normalised values alone has no gradient to speak of); no bias before
    BatchNorm, as usual (its true gradient is 0, what both runs compute there is rounding noise)."""

    def __init__(self, momentum=0.1):
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(4, 6, bias=False), nn.BatchNorm1d(6, momentum=momentum), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.fc(x))))
