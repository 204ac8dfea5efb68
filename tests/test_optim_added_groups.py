"""A param group added to a stacked optimizer after its scheduler was built (progressive unfreezing:
`opt.add_param_group` when the backbone is unfrozen) is scheduled as N torch schedulers schedule it on N torch
optimizers: StepLR and the cosine recursion go on from the lr the new group has, ReduceLROnPlateau cuts it down to its
default min_lr. Once the schedules only ran over the groups there at construction (the new group kept its lr: weights
4.8e-3 / 6.8e-3 off after 6 steps) and the plateau scheduler failed with a raw IndexError. Where torch's own scheduler
raises (the cosine's rise after T_max, a SequentialLR milestone's closed form, min_lr given per group), an
OptimizerError says so and how to build the scheduler instead.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import OptimizerError

N = 3
LRS = [1e-3, 3e-2, 1e-1]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _schedulers(kind, opt, opts, **kw):
    if kind == "cosine":
        return (executor.StackedCosineLR(opt, T_max=kw.get("t_max", 8)),
                [torch.optim.lr_scheduler.CosineAnnealingLR(o, kw.get("t_max", 8)) for o in opts])
    if kind == "step":
        return executor.StackedStepLR(opt, 2, 0.5), [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in opts]
    min_lr = kw.get("min_lr", 0.0)  # one value, or one per member
    return (executor.StackedReduceLROnPlateau(opt, patience=0, factor=0.5, min_lr=min_lr),
            [torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5,
                                                        min_lr=min_lr[i] if isinstance(min_lr, list) else min_lr)
             for i, o in enumerate(opts)])


def _unfreeze_run(kind, steps=7, **kw):
    """Members train fc2 alone, fc1 unfrozen and added as a group at step 2; batched and loop, step by step."""
    members = []
    for i in range(N):
        torch.manual_seed(i)
        m = Net()
        m.fc1.requires_grad_(False)
        members.append(m)
    plan = planner.propose(planner.trace(members[0], (torch.randn(5, 8),)), n_members=N, input_mode="per_member")
    ens = executor.build(plan, [copy.deepcopy(m) for m in members])
    named = dict(ens.named_stacked_parameters())
    opt = executor.StackedSGD([named["fc2.weight"], named["fc2.bias"]], N, lr=LRS, momentum=0.9)
    opts = [torch.optim.SGD(m.fc2.parameters(), lr=LRS[i], momentum=0.9) for i, m in enumerate(members)]
    sched, scheds = _schedulers(kind, opt, opts, **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(N, 5, 8, generator=g), torch.randn(N, 5, 4, generator=g)
        if step == 2:
            ens.stacked.fc1.requires_grad_(True)
            opt.add_param_group({"params": [named["fc1.weight"], named["fc1.bias"]], "lr": [lr * 0.1 for lr in LRS]})
            for i, m in enumerate(members):
                m.fc1.requires_grad_(True)
                opts[i].add_param_group({"params": list(m.fc1.parameters()), "lr": LRS[i] * 0.1})
        opt.zero_grad()
        ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        for i, m in enumerate(members):
            opts[i].zero_grad()
            ((m(x[i]) - y[i]) ** 2).mean().backward()
            opts[i].step()
        if kind == "plateau":
            sched.step(torch.ones(N))
            for s in scheds:
                s.step(1.0)
        else:
            sched.step()
            for s in scheds:
                s.step()
        for k in range(len(opts[0].param_groups)):
            torch.testing.assert_close(sched.get_last_lr()[k].double(),
                                       torch.tensor([o.param_groups[k]["lr"] for o in opts], dtype=torch.float64),
                                       rtol=1e-12, atol=0)
    for i, m in enumerate(members):
        for name, p in m.state_dict().items():
            torch.testing.assert_close(ens.member_state_dicts()[i][name], p, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["cosine", "step", "plateau"])
def test_a_group_added_later_is_scheduled_as_torch_schedules_it(kind):
    _unfreeze_run(kind)


def test_plateau_min_lr_per_member_reaches_an_added_group():
    _unfreeze_run("plateau", steps=9, min_lr=[1e-5, 2e-4, 5e-4])


def test_where_torch_raises_the_stacked_scheduler_says_why():
    # past T_max the cosine rises from each group's base lr, which an added group lacks (torch: strict zip raises)
    with pytest.raises(OptimizerError, match=r"added to the optimizer after this scheduler was built.*add_param_group"):
        _unfreeze_run("cosine", steps=7, t_max=3)
    p = nn.Parameter(torch.zeros(N, 2))
    opt = executor.StackedSGD([p], N, lr=0.1)
    plateau = executor.StackedReduceLROnPlateau(opt, patience=0, min_lr=[[0.0] * N])  # min_lr per group
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(N, 2))], "lr": 0.01})
    plateau.step(torch.ones(N))
    with pytest.raises(OptimizerError, match="min_lr was given per group"):
        plateau.step(torch.ones(N))
