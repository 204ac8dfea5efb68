"""Frozen and shared parameters whose flags change after build, against the plain member loop.

A backbone module shared by every member (one nn.Module object) is allowed frozen: unfrozen later on the batched module
it is refused as at build (the loop trains one tensor, the batched module would train a copy per member). Members that
freeze apart are refused until the stacked flag is set otherwise for every member on the batched module. A shared
frozen BatchNorm backbone kept in eval by the class's train() override trains in training mode as the loop does.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.executor.optim import StackedSGD
from stagewise.planner.errors import ExecutionError
from test_review_modes import Two  # (members that freeze different parameters)

N = 3
TOL = dict(rtol=1e-5, atol=1e-6)


def build(members, inputs):
    return executor.build(planner.propose(planner.trace(members[0], inputs), n_members=N, input_mode="shared"), members)


class Headed(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.backbone(x))


def shared_backbone_members():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
    backbone.requires_grad_(False)
    return backbone, [Headed(backbone) for _ in range(N)]


def test_shared_frozen_backbone_trains_heads_as_the_loop_then_unfreezing_it_on_ens_is_refused():
    backbone, members = shared_backbone_members()
    x, y = torch.randn(4, 6), torch.randint(0, 5, (4,))
    ens = build(members, (x,))
    opt = StackedSGD(ens.parameters(), N, lr=0.1)
    topt = torch.optim.SGD(list({id(p): p for m in members for p in m.parameters() if p.requires_grad}.values()), lr=0.1)
    for _ in range(3):  # frozen, as built: the heads train as the loop's (no refusal)
        opt.zero_grad()
        out = ens(x)
        sum(F.cross_entropy(out[i], y) for i in range(N)).backward()
        opt.step()
        topt.zero_grad()
        sum(F.cross_entropy(m(x), y) for m in members).backward()
        topt.step()
    with torch.no_grad():
        got = ens(x)
        for i, m in enumerate(members):
            torch.testing.assert_close(got[i], m(x), **TOL)
            torch.testing.assert_close(ens.stacked.head.weight[i], m.head.weight, **TOL)
    ens.stacked.backbone.requires_grad_(True)  # gradual unfreezing: the loop trains one backbone, ens a copy each
    with pytest.raises(ExecutionError, match=r"members share the trainable parameter.*made trainable on this module after build"):
        ens(x)
    with torch.no_grad():  # inference is unaffected
        ens(x)
    ens.stacked.backbone.requires_grad_(False)  # frozen again: trains as before
    ens(x).sum().backward()


@pytest.mark.parametrize("member0_trains", [True, False])
def test_frozen_apart_then_one_flag_on_ens_trains_as_the_loop(member0_trains):
    torch.manual_seed(0)
    members = [Two() for _ in range(N)]
    odd = 2 if member0_trains else 0  # member 2 freezes fc1 (member 0 trains it), or member 0 freezes it alone
    members[odd].fc1.requires_grad_(False)
    x = torch.randn(5, 6)
    ens = build(members, (x,))
    with pytest.raises(ExecutionError, match=r"one requires_grad for all members") as refused:
        ens(x)  # the stacked flag is member 0's: refused
    now = not member0_trains  # set otherwise on ens, for every member
    ens.stacked.fc1.requires_grad_(now)
    for m in members:  # the loop the batched module now matches
        m.fc1.requires_grad_(now)
    ens(x).pow(2).sum().backward()
    for m in members:
        m(x).pow(2).sum().backward()
    for name, p in ens.named_stacked_parameters():
        for i, m in enumerate(members):
            q = m.get_parameter(name)
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad[i], q.grad, **TOL)
    assert ens.stacked.fc2.weight.grad is not None
    assert f"ens.stacked.fc1.weight.requires_grad_({now})" in str(refused.value)  # the refusal said how


class BNHeaded(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(8, 5)

    def train(self, mode=True):  # standard fine-tuning: the frozen backbone's BatchNorm stays in eval
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x):
        return self.head(self.backbone(x))


def test_shared_frozen_bn_backbone_kept_in_eval_by_train_override_trains_as_the_loop():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    backbone.requires_grad_(False)
    with torch.no_grad():  # statistics off their defaults, so that an update would show
        backbone[1].running_mean.uniform_(-1, 1)
        backbone[1].running_var.uniform_(0.5, 2)
    members = [BNHeaded(backbone) for _ in range(N)]
    for m in members:
        m.train()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    ens = build(members, (x,))
    ens.train()  # was refused: the shared running statistics are never updated (the override keeps the layer in eval)
    rm, rv = backbone[1].running_mean.clone(), backbone[1].running_var.clone()
    opt = StackedSGD(ens.parameters(), N, lr=0.1)
    topts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in members]
    for _ in range(2):
        opt.zero_grad()
        out = ens(x)
        sum(F.cross_entropy(out[i], y) for i in range(N)).backward()
        for i, (m, o) in enumerate(zip(members, topts)):
            o.zero_grad()
            ref = m(x)
            F.cross_entropy(ref, y).backward()
            torch.testing.assert_close(out[i].detach(), ref.detach(), **TOL)
            torch.testing.assert_close(ens.stacked.head.weight.grad[i], m.head.weight.grad, **TOL)
            torch.testing.assert_close(ens.stacked.head.bias.grad[i], m.head.bias.grad, **TOL)
        opt.step()
        for o in topts:
            o.step()
    assert torch.equal(backbone[1].running_mean, rm) and torch.equal(backbone[1].running_var, rv)  # the loop's: untouched
    for i in range(N):
        torch.testing.assert_close(ens.stacked.get_buffer("backbone.1.running_mean")[i], rm, rtol=0, atol=0)
        torch.testing.assert_close(ens.stacked.get_buffer("backbone.1.running_var")[i], rv, rtol=0, atol=0)
