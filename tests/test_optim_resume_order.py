"""Resuming stacked schedules in either order, against N torch optimizers resumed the same way.

torch's schedulers start from each group's ``initial_lr`` (their base_lrs) and SequentialLR's construction sets every
lr back to it; a scheduler built after ``opt.load_state_dict(saved)`` therefore keeps the original bases, and one
inside a SequentialLR restarts the lrs the load gave. A stacked optimizer keeps each member's part of the lr in
``member_lr``: its part of initial_lr is ``initial_member_lr``, and the stacked schedules take their bases from it
and step recursively from the lr each member has, as torch's do. Before, a scheduler built after the load took the
loaded (scheduled) member lrs as its bases and SequentialLR's reset left them: other lrs than torch's (0.92 relative
off, params 0.05 off after 8 steps) and StackedStepLR wrote its closed form over an lr torch goes on from.
"""
import warnings

import pytest
import torch

from stagewise import executor
from stagewise.planner.errors import OptimizerError

torch.set_num_threads(1)
S = torch.optim.lr_scheduler
N, LRS = 3, [0.1, 0.03, 0.01]
T_MAX, ETA = [5, 7, 9], [0.0, 1e-3, 2e-3]
STEP, GAMMA = [2, 3, 4], [0.5, 0.7, 0.9]
TARGET = torch.randn(N, 3, generator=torch.Generator().manual_seed(0))


def _schedule(kind, opt, i=None):
    """The schedule `kind` on the stacked `opt` (i None) or on member i's torch optimizer."""
    stacked = i is None
    cos = lambda: (executor.StackedCosineLR(opt, T_MAX, eta_min=ETA) if stacked  # noqa: E731
                   else S.CosineAnnealingLR(opt, T_MAX[i], eta_min=ETA[i]))
    step = lambda: executor.StackedStepLR(opt, STEP, GAMMA) if stacked else S.StepLR(opt, STEP[i], GAMMA[i])  # noqa: E731
    warm = lambda: S.LinearLR(opt, 0.01, 1.0, total_iters=4)  # noqa: E731
    return {"seq_cos": lambda: S.SequentialLR(opt, [warm(), cos()], [4]),
            "seq_step": lambda: S.SequentialLR(opt, [warm(), step()], [4]),
            "seq_stacked_first": lambda: S.SequentialLR(opt, [step(), cos()], [3]),
            "seq3": lambda: S.SequentialLR(opt, [warm(), step(), cos()], [3, 7]),
            "chain_cos": lambda: S.ChainedScheduler([warm(), cos()]),
            "cos": cos, "step": step}[kind]()


class Pair:
    """A stacked optimizer on [N, 3] and N torch optimizers on the members' [3], stepped on the same losses."""

    def __init__(self, opt_name="SGD", lrs=LRS, params=None):
        self.name, self.lrs = opt_name, lrs
        p = params.clone() if params is not None else torch.zeros(N, 3)
        self.p = torch.nn.Parameter(p)
        self.qs = [torch.nn.Parameter(p[i].clone()) for i in range(N)]
        kw = {"momentum": 0.9} if opt_name == "SGD" else {}
        self.opt = getattr(executor, "Stacked" + opt_name)([self.p], N, lr=lrs, **kw)
        self.opts = [getattr(torch.optim, opt_name)([q], lr=lrs[i], **kw) for i, q in enumerate(self.qs)]

    def schedules(self, kind):
        self.sch = _schedule(kind, self.opt)
        self.refs = [_schedule(kind, o, i) for i, o in enumerate(self.opts)]

    def step(self, schedule=True):
        self.opt.zero_grad()
        ((self.p - TARGET) ** 2).sum().backward()
        self.opt.step()
        for q, o, t in zip(self.qs, self.opts, TARGET):
            o.zero_grad()
            ((q - t) ** 2).sum().backward()
            o.step()
        if schedule:
            self.sch.step()
            for r in self.refs:
                r.step()

    def check(self):
        got = self.opt.get_hyperparameter("lr")
        want = torch.tensor([o.param_groups[0]["lr"] for o in self.opts], dtype=got.dtype)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0.0)
        torch.testing.assert_close(self.p.detach(), torch.stack([q.detach() for q in self.qs]), rtol=1e-6, atol=1e-6)

    def resumed(self, kind, order):
        """A new pair with this one's state: `usual` builds the schedules, then loads optimizers and schedules;
        `opt_first` loads the optimizers, then builds the schedules and loads them (the order torch's docs warn of)."""
        new = Pair(self.name, self.lrs, self.p.detach())
        for q, old in zip(new.qs, self.qs):
            q.data.copy_(old.detach())
        if order == "usual":
            new.schedules(kind)
        new.opt.load_state_dict(self.opt.state_dict())
        for o, old in zip(new.opts, self.opts):
            o.load_state_dict(old.state_dict())
        if order == "opt_first":
            new.schedules(kind)
        new.sch.load_state_dict(self.sch.state_dict())
        for r, old in zip(new.refs, self.refs):
            r.load_state_dict(old.state_dict())
        return new


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "lr_scheduler.step() before optimizer.step()" on resumed pairs
        yield


@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
@pytest.mark.parametrize("order", ["usual", "opt_first"])
@pytest.mark.parametrize("at", [2, 5, 12])  # mid-warmup, just past the milestone, well past it
@pytest.mark.parametrize("kind", ["seq_cos", "seq_step", "seq_stacked_first", "seq3", "chain_cos", "cos", "step"])
def test_resumed_schedule_matches_n_torch_optimizers_in_either_order(kind, at, order, opt_name):
    """Was (opt_first, seq_cos at 12): lrs 0.92 relative off torch's, params 0.05 off after 8 steps; seq_step at 12
    0.94 and 0.06; seq_stacked_first at 2 0.50 and 0.43 (usual order and a schedule alone matched)."""
    pair = Pair(opt_name)
    pair.schedules(kind)
    for _ in range(at):
        pair.step()
    pair.check()
    pair = pair.resumed(kind, order)
    pair.check()
    for _ in range(8):
        pair.step()
        pair.check()


@pytest.mark.parametrize("kind", ["seq_cos", "seq_step", "seq_stacked_first"])
def test_resume_with_one_lr_for_all_members_matches(kind):
    """Members given one lr (member_lr all 1, the lr the shared scale): was lrs 1.97 relative off (seq_cos at 12)."""
    pair = Pair(lrs=[0.05] * N)
    pair.schedules(kind)
    for _ in range(12):
        pair.step()
    pair = pair.resumed(kind, "opt_first")
    for _ in range(8):
        pair.step()
        pair.check()


@pytest.mark.parametrize("second", ["cos", "step"])
def test_a_schedule_built_later_takes_the_initial_lrs_as_bases(second):
    """A second schedule built on a trained optimizer (a phase 2, or one built after opt.load_state_dict without
    loading a scheduler state) has torch's base_lrs, the initial lrs, and goes on from the lrs the members have.
    Was (cos -> cos): lrs 0.95 relative off, params 1.07 off (the rise past T_max used the scheduled lr as base)."""
    pair = Pair()
    pair.schedules("cos")
    for _ in range(6):
        pair.step()
    if second == "cos":
        pair.sch = executor.StackedCosineLR(pair.opt, [3, 4, 6], [0.0, 1e-3, 0.0])
        pair.refs = [S.CosineAnnealingLR(o, [3, 4, 6][i], [0.0, 1e-3, 0.0][i]) for i, o in enumerate(pair.opts)]
    else:
        pair.sch = executor.StackedStepLR(pair.opt, STEP, GAMMA)
        pair.refs = [S.StepLR(o, STEP[i], GAMMA[i]) for i, o in enumerate(pair.opts)]
    pair.check()
    for _ in range(14):
        pair.step()
        pair.check()
    assert pair.sch.base_lrs[0].tolist() == LRS


def test_step_lr_goes_on_from_an_lr_set_midway():
    """torch's StepLR multiplies the lr it finds; StackedStepLR did write its closed form over an lr set with
    set_hyperparameter (lrs 0.80 relative off, params 0.77 off)."""
    pair = Pair()
    pair.schedules("step")
    for k in range(10):
        pair.step()
        if k == 2:
            new = [0.07, 0.02, 0.05]
            pair.opt.set_hyperparameter("lr", new)
            for o, v in zip(pair.opts, new):
                o.param_groups[0]["lr"] = v
        pair.check()


@pytest.mark.parametrize("order", ["usual", "opt_first"])
def test_step_lr_with_plateau_cuts_resumes_as_torch(order):
    """StackedStepLR stepping recursively keeps a StackedReduceLROnPlateau's cuts in the lr, as on N torch optimizers."""
    pair = Pair()
    mk = lambda opt: (executor.StackedStepLR(opt, STEP, GAMMA), executor.StackedReduceLROnPlateau(opt, factor=0.5, patience=1))  # noqa: E731
    mkr = lambda o, i: (S.StepLR(o, STEP[i], GAMMA[i]), S.ReduceLROnPlateau(o, factor=0.5, patience=1))  # noqa: E731
    metric = lambda k: torch.tensor([1.0, 1.0 - 0.1 * k, 1.0 + (k % 3)])  # noqa: E731

    def epoch(pair, k, s, pl, refs):
        pair.step(schedule=False)
        s.step()
        pl.step(metric(k))
        for i, (a, b) in enumerate(refs):
            a.step()
            b.step(float(metric(k)[i]))
        pair.check()

    s, pl = mk(pair.opt)
    refs = [mkr(o, i) for i, o in enumerate(pair.opts)]
    for k in range(7):
        epoch(pair, k, s, pl, refs)
    new = Pair(params=pair.p.detach())
    for q, old in zip(new.qs, pair.qs):
        q.data.copy_(old.detach())
    if order == "opt_first":
        new.opt.load_state_dict(pair.opt.state_dict())
        [o.load_state_dict(old.state_dict()) for o, old in zip(new.opts, pair.opts)]
    s2, pl2 = mk(new.opt)
    refs2 = [mkr(o, i) for i, o in enumerate(new.opts)]
    if order == "usual":
        new.opt.load_state_dict(pair.opt.state_dict())
        [o.load_state_dict(old.state_dict()) for o, old in zip(new.opts, pair.opts)]
    s2.load_state_dict(s.state_dict())
    pl2.load_state_dict(pl.state_dict())
    for (a2, b2), (a, b) in zip(refs2, refs):
        a2.load_state_dict(a.state_dict())
        b2.load_state_dict(b.state_dict())
    for k in range(7, 17):
        epoch(new, k, s2, pl2, refs2)


def test_initial_member_lrs_are_saved_checked_and_optional():
    """The member part of initial_lr travels in the optimizer's state dict, is checked on load, and a state dict
    saved without it (before it existed) still loads: a schedule then takes the member lrs as they are as bases."""
    pair = Pair()
    pair.schedules("seq_cos")
    for _ in range(6):
        pair.step()
    sd = pair.opt.state_dict()
    assert sd["param_groups"][0]["initial_member_lr"].tolist() == LRS
    bad = pair.opt.state_dict()
    bad["param_groups"][0]["initial_member_lr"] = torch.tensor([0.1, 0.2])
    with pytest.raises(OptimizerError, match="initial_member_lr has 2 values .*n_members=3"):
        Pair().opt.load_state_dict(bad)
    old = pair.opt.state_dict()
    del old["param_groups"][0]["initial_member_lr"]
    fresh = Pair()
    fresh.opt.load_state_dict(old)
    sch = executor.StackedCosineLR(fresh.opt, T_MAX)
    assert torch.equal(sch.base_lrs[0], pair.opt.param_groups[0]["member_lr"])
