"""Stacked lr schedulers composed with torch's own, against N torch optimizers each with its own torch schedulers.

Each test drives one StackedSGD over an [N, 3] parameter and N torch.optim.SGD over [3] parameters with the same
per-member lrs, momentum and gradients (a quadratic pull, so an lr off by a little moves the parameters off), and
compares every member's lr (rtol 1e-6) and parameters (rtol 1e-5) at every step, in float32, well past T_max.
"""
from __future__ import annotations

import pytest
import torch

from stagewise import executor
from stagewise.planner.errors import OptimizerError

torch.set_num_threads(1)
S = torch.optim.lr_scheduler
N = 3
LRS = [0.1, 0.03, 0.01]
ETA = [1e-3, 1e-4, 0.0]


class Both:
    """One stacked SGD and N torch SGDs over the same start, stepped on the same per-member gradients."""

    def __init__(self, lrs=LRS, momentum=0.9):
        torch.manual_seed(0)
        start = torch.randn(N, 3)
        self.target = torch.randn(N, 3)
        self.p = torch.nn.Parameter(start.clone())
        self.opt = executor.StackedSGD([self.p], N, lr=lrs, momentum=momentum)
        self.qs = [torch.nn.Parameter(start[i].clone()) for i in range(N)]
        self.opts = [torch.optim.SGD([q], lr=lrs[i], momentum=momentum) for i, q in enumerate(self.qs)]

    def step(self, sched, scheds):
        self.p.grad = (self.p.detach() - self.target) * 2
        self.opt.step()
        for q, o, t in zip(self.qs, self.opts, self.target):
            q.grad = (q.detach() - t) * 2
            o.step()
        sched.step()
        for s in scheds:
            s.step()

    def check(self, where):
        got = self.opt.get_hyperparameter("lr").double()
        want = torch.tensor([o.param_groups[0]["lr"] for o in self.opts], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12, msg=lambda m: f"lr at {where}: {m}")
        torch.testing.assert_close(self.p.detach(), torch.stack([q.detach() for q in self.qs]), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"params at {where}: {m}")


def run(make_stacked, make_torch, steps, lrs=LRS):
    both = Both(lrs)
    sched = make_stacked(both.opt)
    scheds = [make_torch(o, i) for i, o in enumerate(both.opts)]
    both.check("construction")
    lrs_seen = []
    for k in range(steps):
        both.step(sched, scheds)
        both.check(f"step {k + 1}")
        lrs_seen.append(both.opt.get_hyperparameter("lr").clone())
    return both, torch.stack(lrs_seen)


# --- 1. StackedCosineLR(eta_min > 0) composed with torch factor schedulers -----------------------------------------

CHAINS = {
    # warmup while annealing: the LinearLR factor on the shared scale must not scale eta_min (was: 7e-4 off in lr)
    "linear_warmup+cosine": (
        lambda o: S.ChainedScheduler([S.LinearLR(o, 0.1, 1.0, total_iters=3), executor.StackedCosineLR(o, 6, eta_min=ETA)]),
        lambda o, i: S.ChainedScheduler([S.LinearLR(o, 0.1, 1.0, total_iters=3), S.CosineAnnealingLR(o, 6, eta_min=ETA[i])])),
    # a decay on top: past T_max torch's cosine adds (base - eta_min) * ..., not a scaled one (was: 0.47 off in lr)
    "cosine*exponential": (
        lambda o: S.ChainedScheduler([executor.StackedCosineLR(o, 6, eta_min=ETA), S.ExponentialLR(o, 0.9)]),
        lambda o, i: S.ChainedScheduler([S.CosineAnnealingLR(o, 6, eta_min=ETA[i]), S.ExponentialLR(o, 0.9)])),
    # per-member T_max too, a step decay on the scale
    "cosine_per_member_t_max*step": (
        lambda o: S.ChainedScheduler([executor.StackedCosineLR(o, [4, 5, 6], eta_min=ETA), S.StepLR(o, 3, 0.5)]),
        lambda o, i: S.ChainedScheduler([S.CosineAnnealingLR(o, [4, 5, 6][i], eta_min=ETA[i]), S.StepLR(o, 3, 0.5)])),
    # eta_min = 0 past T_max under a decay: the rise after the trough is from the base lr, as torch's
    "cosine_eta0*exponential": (
        lambda o: S.ChainedScheduler([executor.StackedCosineLR(o, 5), S.ExponentialLR(o, 0.8)]),
        lambda o, i: S.ChainedScheduler([S.CosineAnnealingLR(o, 5), S.ExponentialLR(o, 0.8)])),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_stacked_cosine_composed_with_torch_factor_schedulers_matches_torch(name):
    make_stacked, make_torch = CHAINS[name]
    run(make_stacked, make_torch, steps=6 + 16)


def test_stacked_cosine_stepped_beside_a_torch_warmup_matches_torch():
    """The same composition stepped as two schedulers in the training loop (not chained)."""
    both = Both()
    warm, cos = S.LinearLR(both.opt, 0.25, 1.0, total_iters=4), executor.StackedCosineLR(both.opt, 5, eta_min=ETA)
    refs = [(S.LinearLR(o, 0.25, 1.0, total_iters=4), S.CosineAnnealingLR(o, 5, eta_min=ETA[i]))
            for i, o in enumerate(both.opts)]
    for k in range(5 + 16):
        both.step(warm, [w for w, _ in refs])
        cos.step()
        for _, c in refs:
            c.step()
        both.check(f"step {k + 1}")


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_stacked_cosine_refuses_a_zero_shared_scale_where_torch_gives_an_lr():
    """A factor of 0 on the shared scale leaves no member lr that gives member i torch's eta_min * (1 - ratio)."""
    both = Both()
    sched = S.ChainedScheduler([S.MultiplicativeLR(both.opt, lambda e: 0.0), executor.StackedCosineLR(both.opt, 6, eta_min=ETA)])
    with pytest.raises(OptimizerError, match=r"shared scale group\['lr'\] is 0.*SequentialLR"):
        sched.step()


# --- 2. SequentialLR([torch warmup, stacked schedule]) ---------------------------------------------------------------

SEQUENCES = {
    "linear_warmup->stacked_cosine": (
        lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.1, 1.0, total_iters=3), executor.StackedCosineLR(o, 6, eta_min=ETA)],
                                 milestones=[3]),
        lambda o, i: S.SequentialLR(o, [S.LinearLR(o, 0.1, 1.0, total_iters=3), S.CosineAnnealingLR(o, 6, eta_min=ETA[i])],
                                    milestones=[3])),
    "constant_warmup->stacked_cosine_per_member_t_max": (
        lambda o: S.SequentialLR(o, [S.ConstantLR(o, 0.2, total_iters=2),
                                     executor.StackedCosineLR(o, [4, 6, 8], eta_min=ETA)], milestones=[2]),
        lambda o, i: S.SequentialLR(o, [S.ConstantLR(o, 0.2, total_iters=2),
                                        S.CosineAnnealingLR(o, [4, 6, 8][i], eta_min=ETA[i])], milestones=[2])),
    "linear_warmup->stacked_step": (
        lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.1, 1.0, total_iters=3),
                                     executor.StackedStepLR(o, [2, 3, 4], gamma=[0.5, 0.7, 0.9])], milestones=[3]),
        lambda o, i: S.SequentialLR(o, [S.LinearLR(o, 0.1, 1.0, total_iters=3),
                                        S.StepLR(o, [2, 3, 4][i], [0.5, 0.7, 0.9][i])], milestones=[3])),
    "lambda_warmup->stacked_cosine": (  # the fix the refusal of LambdaLR chained with StackedCosineLR names
        lambda o: S.SequentialLR(o, [S.LambdaLR(o, lambda e: (e + 1) / 4), executor.StackedCosineLR(o, 6, eta_min=ETA)],
                                 milestones=[3]),
        lambda o, i: S.SequentialLR(o, [S.LambdaLR(o, lambda e: (e + 1) / 4), S.CosineAnnealingLR(o, 6, eta_min=ETA[i])],
                                    milestones=[3])),
    "stacked_step->stacked_cosine": (
        lambda o: S.SequentialLR(o, [executor.StackedStepLR(o, 2, gamma=[0.5, 0.7, 0.9]),
                                     executor.StackedCosineLR(o, 6, eta_min=ETA)], milestones=[4]),
        lambda o, i: S.SequentialLR(o, [S.StepLR(o, 2, [0.5, 0.7, 0.9][i]), S.CosineAnnealingLR(o, 6, eta_min=ETA[i])],
                                    milestones=[4])),
}


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_sequential_lr_ending_in_a_stacked_schedule_matches_torch(name):
    """Was: AttributeError '_update_lr' from inside torch at the milestone (and '_initial_step' where it came first)."""
    make_stacked, make_torch = SEQUENCES[name]
    _, lrs = run(make_stacked, make_torch, steps=4 + 8 + 16)
    assert not torch.equal(lrs[0], lrs[-1])


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_sequential_lr_with_a_torch_scheduler_after_a_stacked_one_is_refused():
    """At that milestone torch's scheduler restarts the shared scale but not the member lrs the stacked one wrote."""
    opt = Both().opt
    with pytest.raises(OptimizerError, match=r"followed by ExponentialLR.*Put the stacked scheduler last"):
        S.SequentialLR(opt, [executor.StackedCosineLR(opt, 6, eta_min=ETA), S.ExponentialLR(opt, 0.9)], milestones=[3])
    opt = Both().opt
    seq = S.SequentialLR(opt, [S.LinearLR(opt, 0.1, total_iters=2), executor.StackedStepLR(opt, 2, 0.5),
                               S.ExponentialLR(opt, 0.9)], milestones=[2, 5])
    seq.step()
    with pytest.raises(OptimizerError, match=r"StackedStepLR is scheduler 1 of 3.*followed by ExponentialLR"):
        seq.step()


# --- 3. OneCycleLR with per-member max_lr ----------------------------------------------------------------------------

@pytest.mark.parametrize("max_lr", [LRS, tuple(LRS), torch.tensor(LRS)], ids=["list", "tuple", "tensor"])
def test_onecycle_with_per_member_max_lr_names_onecycle_and_the_fix(max_lr):
    """Was: torch's 'max_lr must have the same length as optimizer.param_groups' (a list), or 'group['initial_lr'] is
    the scale shared by all members' (a tensor): neither named OneCycleLR's one max_lr per group nor the fix."""
    opt = Both().opt
    with pytest.raises(OptimizerError, match=r"OneCycleLR\(max_lr=.*one value per member.*one max_lr per param group"
                                             r".*lr=max_lrs.*LambdaLR"):
        S.OneCycleLR(opt, max_lr=max_lr, total_steps=10)


def test_onecycle_fix_named_in_the_message_matches_n_torch_onecycles():
    """The fix the message gives: per-member lrs on the optimizer, OneCycleLR(max_lr=1.0)'s lrs as a LambdaLR factor."""
    steps = 20
    probe = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    one = S.OneCycleLR(probe, max_lr=1.0, total_steps=steps + 1, cycle_momentum=False)
    factor = []
    for _ in range(steps + 1):
        factor.append(probe.param_groups[0]["lr"])
        probe.step()
        one.step()
    run(lambda o: S.LambdaLR(o, lambda step: factor[step]),
        lambda o, i: S.OneCycleLR(o, max_lr=LRS[i], total_steps=steps + 1, cycle_momentum=False), steps=steps)


def test_cyclic_and_onecycle_momentum_per_member_name_the_scheduler():
    opt = Both().opt
    with pytest.raises(OptimizerError, match=r"CyclicLR\(base_lr=.*CyclicLR takes one base_lr per param group"):
        S.CyclicLR(opt, base_lr=[1e-3, 2e-3, 3e-3], max_lr=0.1)
    with pytest.raises(OptimizerError, match=r"OneCycleLR (cycles one base_momentum per param group|is not known to scale each member.s base lr.*refused before it wrote anything)"):
        S.OneCycleLR(opt, max_lr=0.1, total_steps=10, base_momentum=[0.8, 0.85, 0.9])


def test_per_group_lists_still_go_to_torch():
    """A list of one value per param group (torch's reading) is torch's business, whatever N is."""
    p1, p2 = torch.nn.Parameter(torch.zeros(N, 2)), torch.nn.Parameter(torch.zeros(N, 2))
    opt = executor.StackedSGD([{"params": [p1]}, {"params": [p2]}], N, lr=0.1, momentum=0.9)
    S.OneCycleLR(opt, max_lr=[0.1, 0.2], total_steps=10)
    with pytest.raises(ValueError, match="same length as optimizer.param_groups"):
        S.OneCycleLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), max_lr=[0.1, 0.2], total_steps=10)


# --- 4. LambdaLR returning per-member values -------------------------------------------------------------------------

def test_lambda_returning_per_member_values_says_factors_are_shared_and_the_fix():
    """Was: "group['lr'] = tensor(...): group['lr'] is the scale shared by all members", naming neither LambdaLR, the
    factor's being one for all members, nor the per-member schedules."""
    decays = [0.5, 0.8, 0.9]
    opt = Both().opt
    with pytest.raises(OptimizerError, match=r"written by LambdaLR.*factor \(LambdaLR, MultiplicativeLR\) is one number "
                                             r"for all members.*StackedStepLR\(opt, step_size=1, gamma=d\)"):
        S.LambdaLR(opt, lambda e: torch.tensor(decays) ** e)
    # the fix it names gives each member its own decay, as N torch LambdaLRs
    run(lambda o: executor.StackedStepLR(o, step_size=1, gamma=decays),
        lambda o, i: S.LambdaLR(o, lambda e, d=decays[i]: d ** e), steps=16)


@pytest.mark.parametrize("chained", [True, False], ids=["chained", "side_by_side"])
def test_two_stacked_schedules_stepped_together_are_refused_before_either_writes(chained):
    # before: the last one stepped wrote every member's lr from its own closed form, dropping the other (the cosine's
    # trough 5e10 off in lr, params 1.14 off after 30 steps), silently
    both = Both()
    cos = executor.StackedCosineLR(both.opt, T_max=[5, 7, 9])
    step = executor.StackedStepLR(both.opt, step_size=3, gamma=[0.5, 0.6, 0.7])
    both.p.grad = torch.ones_like(both.p)
    both.opt.step()
    before = [g["member_lr"].clone() for g in both.opt.param_groups]
    with pytest.raises(OptimizerError, match="two stacked schedules at once"):
        if chained:
            S.ChainedScheduler([cos, step]).step()
        else:
            cos.step()
            step.step()
    if chained:  # refused at the second one's step: the first one's write stands, the second's was never made
        assert not torch.equal(both.opt.param_groups[0]["member_lr"], before[0])


def test_stacked_schedules_one_after_the_other_at_other_steps_are_fine():
    both = Both()
    cos = executor.StackedCosineLR(both.opt, T_max=5)
    for _ in range(3):
        both.p.grad = torch.ones_like(both.p)
        both.opt.step()
        cos.step()
    step = executor.StackedStepLR(both.opt, step_size=2, gamma=0.5)  # a second phase, the first scheduler kept alive
    for _ in range(3):
        both.p.grad = torch.ones_like(both.p)
        both.opt.step()
        step.step()


@pytest.mark.parametrize("chained", [True, False], ids=["chained", "side_by_side"])
def test_a_lambda_lr_stepped_with_a_stacked_schedule_is_refused(chained):
    # before: LambdaLR's outright initial_lr * f left each member's cosine in its member lr, where on N torch
    # optimizers it throws the cosine away (lrs 0.97 off over 12 steps, params 2.17 off after 30), silently
    both = Both()
    lam = S.LambdaLR(both.opt, lambda e: min(1.0, (e + 1) / 4))
    cos = executor.StackedCosineLR(both.opt, T_max=6, eta_min=ETA)
    both.p.grad = torch.ones_like(both.p)
    both.opt.step()
    with pytest.raises(OptimizerError, match=r"LambdaLR set the lr outright.*SequentialLR"):
        if chained:
            S.ChainedScheduler([lam, cos]).step()
        else:
            lam.step()
            cos.step()
