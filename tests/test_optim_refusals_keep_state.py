"""A refused optimizer or scheduler call leaves the stacked optimizer as it was.

Each of these once changed state before it raised: a refused OneCycleLR / CyclicLR / SWALR had written initial_lr (and
the lr of groups before the refused one), which the LambdaLR its message recommends then scaled (every member 2500x
too slow); a refused `reset_member(i)` had zeroed member i's momentum in the groups before the refusing one; a refused
`set_hyperparameter(..., group=None)` had written the groups before the refusing one; a refused `load_state_dict` (a
checkpoint of another n_members) had installed the saved groups and state (the next step failed with a raw size
error); a refused `add_param_group` had left its group (the next step failed with a raw AttributeError).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor
from stagewise.planner.errors import OptimizerError

N = 3
LRS = [1e-3, 2e-3, 3e-3]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(N, 4, 3, generator=g)), nn.Parameter(torch.randn(N, 3, generator=g))]


def _snapshot(opt):
    groups = [{k: (v.clone() if isinstance(v, torch.Tensor) else tuple(t.clone() for t in v) if isinstance(v, tuple)
                   else v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {id(p): {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)} for p, s in opt.state.items()}
    return groups, state


def _same(a, b):
    (ga, sa), (gb, sb) = a, b
    assert [sorted(g) for g in ga] == [sorted(g) for g in gb]
    for x, y in zip(ga, gb):
        for k in x:
            vx, vy = x[k], y[k]
            if isinstance(vx, tuple):
                assert all(torch.equal(p, q) for p, q in zip(vx, vy)), k
            elif isinstance(vx, torch.Tensor):
                assert torch.equal(vx, vy), k
            else:
                assert vx == vy, k
    assert sa.keys() == sb.keys()
    for p in sa:
        assert sa[p].keys() == sb[p].keys()
        for k in sa[p]:
            assert torch.equal(sa[p][k], sb[p][k]), k


def _stepped(opt, params, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        sum((p ** 2).sum() for p in params).backward()
        opt.step()


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.01, total_steps=100),
    lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=1e-4, max_lr=1e-2, cycle_momentum=False),
    lambda o: torch.optim.swa_utils.SWALR(o, swa_lr=0.05),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=1e-5),
], ids=["onecycle", "cyclic", "swalr", "cosine-eta-min"])
def test_a_refused_absolute_scheduler_writes_nothing(make):
    w, b = _params()
    # group 0: one lr for all members (any scheduler is fine there), group 1: per-member lrs
    opt = executor.StackedAdam([{"params": [w], "lr": 1e-3}, {"params": [b], "lr": LRS}], N)
    _stepped(opt, [w, b])
    before = _snapshot(opt)
    with pytest.raises(OptimizerError, match="refused before it wrote anything"):
        make(opt)
    _same(_snapshot(opt), before)
    # the fix the message gives: a LambdaLR factor scales each member's own lr
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    torch.testing.assert_close(opt.get_hyperparameter("lr", 1), torch.tensor(LRS, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(opt.get_hyperparameter("lr", 0), torch.full((N,), 1e-3, dtype=torch.float64), rtol=1e-12, atol=0)


def test_a_refused_reset_member_resets_nothing():
    w, b = _params()
    opt = executor.StackedSGD([{"params": [w]}, {"params": [b], "dampening": 0.5}], N, lr=0.1, momentum=0.9)
    _stepped(opt, [w, b])
    before = _snapshot(opt)
    with pytest.raises(OptimizerError, match="dampening"):
        opt.reset_member(1)
    _same(_snapshot(opt), before)


def test_a_refused_set_hyperparameter_sets_no_group():
    w, b = _params()
    opt = executor.StackedSGD([{"params": [w]}, {"params": [b], "nesterov": True}], N, lr=0.1, momentum=0.9)
    _stepped(opt, [w, b])
    before = _snapshot(opt)
    with pytest.raises(OptimizerError, match="nesterov"):
        opt.set_hyperparameter("momentum", [0.9, 0.0, 0.9])
    _same(_snapshot(opt), before)


def test_a_refused_load_state_dict_keeps_the_optimizer():
    w, b = _params()
    opt = executor.StackedAdam([w, b], N, lr=LRS)
    _stepped(opt, [w, b])
    other = [nn.Parameter(torch.zeros(N + 1, 4, 3)), nn.Parameter(torch.zeros(N + 1, 3))]
    saved = executor.StackedAdam(other, N + 1, lr=1.0)
    _stepped(saved, other, 1)
    before = _snapshot(opt)
    with pytest.raises(OptimizerError, match="n_members=3"):
        opt.load_state_dict(saved.state_dict())
    _same(_snapshot(opt), before)
    # and it steps on as a twin that never saw the refused load
    twin_params = [nn.Parameter(p.detach().clone()) for p in (w, b)]
    twin = executor.StackedAdam(twin_params, N, lr=LRS)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # (torch hands the state tensors over, not copies)
    _stepped(opt, [w, b], 1)
    _stepped(twin, twin_params, 1)
    for p, q in zip((w, b), twin_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("group", [{"params": [nn.Parameter(torch.ones(5))]}, {"params": _params(1)[:1], "lr": -1.0}],
                         ids=["no-member-axis", "negative-lr"])
def test_a_refused_add_param_group_leaves_no_group(group):
    w, b = _params()
    opt = executor.StackedAdam([w, b], N, lr=LRS)
    _stepped(opt, [w, b])
    before = _snapshot(opt)
    with pytest.raises(OptimizerError):
        opt.add_param_group(group)
    assert len(opt.param_groups) == 1
    _same(_snapshot(opt), before)
    _stepped(opt, [w, b], 1)
