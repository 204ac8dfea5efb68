"""Review: models written the way real code is, each of whose proposed plans failed on every call or backward.

GNN message passing into a fresh `torch.zeros(...)` with index_add_ was proposed as a vmap stage (the written
tensor is one for all members under vmap), and its loop stage then failed under autograd (rows taken before another
member's write); attention with a learned bias as attn_mask (T5's relative positions) failed on backward (under vmap
SDPA took the CPU flash kernel, which has no gradient for the mask); a batch_first nn.MultiheadAttention failed on
backward in eval mode (under vmap torch took its inference-only fast path). Each now matches the member loop.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner

N = 3


class MessagePassing(nn.Module):
    def __init__(self, d=8, scatter=False):
        super().__init__()
        self.msg, self.upd, self.scatter = nn.Linear(2 * d, d), nn.Linear(2 * d, d), scatter

    def forward(self, x, edge_index):
        src, dst = edge_index[0], edge_index[1]
        m = torch.relu(self.msg(torch.cat([x[src], x[dst]], -1)))
        if self.scatter:
            agg = torch.zeros(x.shape[0], x.shape[1]).scatter_add_(0, dst[:, None].expand(-1, x.shape[1]), m)
        else:
            agg = torch.zeros(x.shape[0], x.shape[1]).index_add_(0, dst, m)
        return torch.relu(self.upd(torch.cat([x, agg], -1)))


class LearnedBiasAttention(nn.Module):
    def __init__(self, d=16, h=2, t=6):
        super().__init__()
        self.h, self.qkv = h, nn.Linear(d, 3 * d)
        self.rel = nn.Parameter(torch.randn(h, t, t) * 0.1)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.rel[None, :, :t, :t])
        return out.transpose(1, 2).reshape(b, t, c)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


def seeded(make):
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(make())
    return out


def assert_trains_like_the_loop(members, inputs, input_mode="shared", train=True):
    reference = copy.deepcopy(members)
    for m in [*members, *reference]:
        m.train(train)
    one = tuple(t[0] if input_mode == "per_member" else t for t in inputs)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), one), N, input_mode=input_mode)
    ens = executor.build(plan, members).train(train)
    got = ens(*inputs)
    want = torch.stack([m(*(tuple(t[i] for t in inputs) if input_mode == "per_member" else inputs))
                        for i, m in enumerate(reference)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    for name, p in ens.named_stacked_parameters():
        for i, m in enumerate(reference):
            torch.testing.assert_close(p.grad[i], dict(m.named_parameters())[name].grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scatter", [False, True])
def test_message_passing_into_a_fresh_tensor(scatter):
    members = seeded(lambda: MessagePassing(scatter=scatter))
    x, edges = torch.randn(N, 10, 8), torch.randint(0, 10, (N, 2, 30))
    assert_trains_like_the_loop(members, (x, edges), input_mode="per_member", train=False)


def test_attention_with_a_learned_bias_as_mask_trains():
    assert_trains_like_the_loop(seeded(LearnedBiasAttention), (torch.randn(2, 6, 16),))


def test_multihead_attention_backward_in_eval_mode():
    members = seeded(Attention)
    x = torch.randn(2, 5, 16, requires_grad=True)
    assert_trains_like_the_loop(members, (x,), train=False)


class HandWrittenRNN(nn.Module):
    """Outputs collected by writing into a tensor made from sizes (`outputs[t] = h`), and a fixed-size one written in
    place (torch.fx made that one a single constant for every call)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(8, 4)

    def forward(self, x):
        t, b, _ = x.shape
        outputs = torch.zeros(t, b, 4)
        h = torch.zeros(b, 4)
        for i in range(t):
            h = torch.tanh(self.cell(torch.cat([x[i], h], -1)))
            outputs[i] = h
        counts = torch.zeros(3, 4).index_add_(0, torch.tensor([0, 2]), h[:2])
        return outputs * 2, counts


def test_writes_through_views_into_tensors_made_in_forward():
    members = seeded(HandWrittenRNN)
    reference = copy.deepcopy(members)
    x = torch.randn(5, 2, 4)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N), members)
    for _ in range(2):  # the second call must not add to the first call's counts
        got, want = ens(x), [torch.stack(t) for t in zip(*[m(x) for m in reference])]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    sum(g.square().sum() for g in got).backward()
    sum(w.square().sum() for w in want).backward()
    for name, p in ens.named_stacked_parameters():
        for i, m in enumerate(reference):
            torch.testing.assert_close(p.grad[i], dict(m.named_parameters())[name].grad, rtol=1e-4, atol=1e-5)
