"""Training the way users train N copies, against N separate models with N torch optimizers.

K steps of the batched module + a stacked optimizer must leave every member's parameters and
optimizer state where K steps of its own model + torch optimizer leave them; what cannot match
is refused with an OptimizerError naming the problem and the fix.
"""
from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.optim import StackedAdam, StackedAdamW, StackedSGD, clip_grad_norm_per_member_
from stagewise.planner.errors import OptimizerError
from stagewise.planner.plan import Strategy

N = 3
LRS = [0.1, 0.05, 0.02]
S = torch.optim.lr_scheduler


# --- stacked tensors against N torch optimizers -------------------------------------------------

def stacked_pair(make_opt, make_torch, seed=0):
    """Stacked params [N, 4, 3] and [N, 3] with their optimizer, and each member's slices with its torch optimizer."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(N, 4, 3, generator=g).requires_grad_(), torch.randn(N, 3, generator=g).requires_grad_()]
    members = [[p.detach()[i].clone().requires_grad_() for p in ps] for i in range(N)]
    return ps, make_opt(ps), members, [make_torch(m, i) for i, m in enumerate(members)]


def step_both(ps, opt, members, opts, seed):
    g = torch.Generator().manual_seed(100 + seed)
    grads = [torch.randn(p.shape, generator=g) for p in ps]
    for p, gr in zip(ps, grads):
        p.grad = gr.clone()
    opt.step()
    for i, (m, o) in enumerate(zip(members, opts)):
        for q, gr in zip(m, grads):
            q.grad = gr[i].clone()
        o.step()


def max_err(ps, members) -> float:
    return max(((p[i] - q).abs().max() / q.abs().max()).item() for i, m in enumerate(members) for p, q in zip(ps, m))


SGD_M = (lambda ps: StackedSGD(ps, N, lr=0.1, momentum=0.9), lambda m, i: torch.optim.SGD(m, lr=0.1, momentum=0.9))
ADAM = (lambda ps: StackedAdam(ps, N, lr=0.1), lambda m, i: torch.optim.Adam(m, lr=0.1))


@pytest.mark.parametrize("opt_kind, make_sched, lr", [
    ("sgd", lambda o: S.OneCycleLR(o, max_lr=0.2, total_steps=10), 0.1),            # cycles SGD momentum (floats)
    ("adam", lambda o: S.OneCycleLR(o, max_lr=0.2, total_steps=10), 0.1),           # cycles Adam beta1 (a float in betas)
    ("sgd", lambda o: S.CyclicLR(o, 0.01, 0.2, step_size_up=3), 0.1),
    ("sgd", lambda o: S.CosineAnnealingLR(o, 5, eta_min=0.01), [0.1] * N),         # equal per-member lrs = one lr
    ("sgd", lambda o: S.CosineAnnealingWarmRestarts(o, 3, eta_min=0.001), [0.1] * N),
    ("sgd", lambda o: S.ReduceLROnPlateau(o, patience=1, factor=0.5, min_lr=0.03), [0.1] * N),
])
def test_torch_schedulers_with_one_lr_match_n_torch_schedulers(opt_kind, make_sched, lr):
    """Raised AttributeError ('float' has no .any/.to) or gave every member lr * schedule(1.0) before."""
    stacked_cls, torch_cls, kw = ((StackedSGD, torch.optim.SGD, {"momentum": 0.9}) if opt_kind == "sgd"
                                  else (StackedAdam, torch.optim.Adam, {}))
    ps, opt, members, opts = stacked_pair(lambda ps: stacked_cls(ps, N, lr=lr, **kw),
                                          lambda m, i: torch_cls(m, lr=lr[i] if isinstance(lr, list) else lr, **kw))
    scheds = [make_sched(o) for o in [opt] + opts]
    plateau = isinstance(scheds[0], S.ReduceLROnPlateau)
    for k in range(8):
        step_both(ps, opt, members, opts, k)
        for s in scheds:
            s.step(1.0) if plateau else s.step()
        want = torch.tensor([o.param_groups[0]["lr"] for o in opts], dtype=torch.float64)
        torch.testing.assert_close(opt.get_hyperparameter("lr"), want, rtol=1e-12, atol=0)
        assert max_err(ps, members) < 1e-6, f"step {k}"


@pytest.mark.parametrize("make_sched, fix", [
    (lambda o: S.CosineAnnealingLR(o, 5, eta_min=0.01), "StackedCosineLR"),
    (lambda o: S.CosineAnnealingWarmRestarts(o, 3, eta_min=0.001), "StackedCosineLR"),
    (lambda o: S.OneCycleLR(o, max_lr=0.2, total_steps=10), "LambdaLR"),
    (lambda o: S.CyclicLR(o, 0.01, 0.2), "LambdaLR"),
    (lambda o: torch.optim.swa_utils.SWALR(o, swa_lr=0.05), "LambdaLR"),
])
def test_non_proportional_schedulers_with_per_member_lrs_are_refused(make_sched, fix):
    """On the shared scale these gave member i lr_i * schedule (CosineAnnealingLR(eta_min=0.01): 98% off)."""
    opt = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=LRS, momentum=0.9)
    with pytest.raises(OptimizerError, match=rf"per-member lrs.*{fix}"):
        make_sched(opt)


def test_a_tensor_scale_does_not_slip_past_the_scheduler_check():
    """torch's schedulers fill_() a tensor lr in place, past __setitem__: the scale is kept a float, so they cannot."""
    opt = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=LRS, momentum=0.9)
    opt.param_groups[0]["lr"] = torch.tensor(1.0)
    assert type(opt.param_groups[0]["lr"]) is float
    with pytest.raises(OptimizerError, match=r"per-member lrs.*LambdaLR"):
        S.OneCycleLR(opt, max_lr=0.2, total_steps=10)
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = torch.tensor(1.0)  # a state dict saved with a tensor scale
    opt.load_state_dict(sd)
    assert type(opt.param_groups[0]["lr"]) is float
    with pytest.raises(OptimizerError, match=r"per-member lrs.*StackedCosineLR"):
        S.CosineAnnealingLR(opt, 5, eta_min=0.01)


def test_reduce_lr_on_plateau_with_per_member_lrs_matches_or_is_refused():
    ps, opt, members, opts = stacked_pair(lambda ps: StackedSGD(ps, N, lr=LRS), lambda m, i: torch.optim.SGD(m, lr=LRS[i]))
    scheds = [S.ReduceLROnPlateau(o, patience=0, factor=0.5) for o in [opt] + opts]
    for k in range(4):
        step_both(ps, opt, members, opts, k)
        for s in scheds:
            s.step(1.0)
        torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor([o.param_groups[0]["lr"] for o in opts],
                                                                           dtype=torch.float64), rtol=1e-12, atol=0)
    assert max_err(ps, members) < 1e-6
    opt = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=LRS)
    floor = S.ReduceLROnPlateau(opt, patience=0, factor=0.5, min_lr=0.03)
    floor.step(1.0)
    with pytest.raises(OptimizerError, match=r"ReduceLROnPlateau\(min_lr=0.03.*member 1.*min_lr=0"):
        floor.step(1.0)


def test_proportional_schedule_written_as_a_lambda_gives_each_member_its_own_peak():
    """The fix the refusal names: a one-cycle shape as a LambdaLR factor of each member's own lr."""
    shape = lambda t: 0.1 + 0.9 * math.sin(math.pi * min(t, 10) / 10)  # noqa: E731
    ps, opt, members, opts = stacked_pair(lambda ps: StackedAdamW(ps, N, lr=LRS), lambda m, i: torch.optim.AdamW(m, lr=LRS[i]))
    scheds = [S.LambdaLR(o, shape) for o in [opt] + opts]
    for k in range(5):
        step_both(ps, opt, members, opts, k)
        for s in scheds:
            s.step()
    assert max_err(ps, members) < 1e-6


def test_a_per_member_lr_written_into_the_group_is_refused_with_the_fix():
    opt = StackedSGD([torch.zeros(N, 2, requires_grad=True)], N, lr=0.1)
    with pytest.raises(OptimizerError, match="shared by all members.*set_hyperparameter"):
        opt.param_groups[0]["lr"] = LRS


@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_momentum_turned_on_for_a_member_starts_like_a_fresh_torch_buffer(dampening):
    """Member 0 trains with momentum 0, then 0.5: torch's first momentum step is buf = grad (it kept no buffer);
    the stacked buffer held the last grads and stepped along 0.5 * old grad + grad (7.5e-2 off) before."""
    ps, opt, members, opts = stacked_pair(
        lambda ps: StackedSGD(ps, N, lr=0.1, momentum=[0.0, 0.9, 0.8], dampening=[dampening, 0.0, 0.1]),
        lambda m, i: torch.optim.SGD(m, lr=0.1, momentum=[0.0, 0.9, 0.8][i], dampening=[dampening, 0.0, 0.1][i]))
    for k in range(5):
        if k == 2:
            opt.set_hyperparameter("momentum", [0.5, 0.9, 0.8])
            opts[0].param_groups[0]["momentum"] = 0.5
        step_both(ps, opt, members, opts, k)
        assert max_err(ps, members) < 1e-6, f"step {k}"


def test_clip_error_if_nonfinite_names_the_member_and_changes_nothing():
    ps = [torch.zeros(N, 4, requires_grad=True), torch.zeros(N, 2, requires_grad=True)]
    for p in ps:
        p.grad = torch.randn(p.shape)
    ps[0].grad[1, 2] = float("inf")
    before = [p.grad.clone() for p in ps]
    with pytest.raises(OptimizerError, match=r"member\(s\) \[1\].*error_if_nonfinite=False"):
        clip_grad_norm_per_member_(ps, 0.1, N, error_if_nonfinite=True, foreach=True)
    assert all(torch.equal(p.grad, b) for p, b in zip(ps, before))
    for norm_type in (2.0, math.inf, 1.0):  # without the flag: torch's clip of each member, nan/inf members included
        for p, b in zip(ps, before):
            p.grad = b.clone()
        norms = clip_grad_norm_per_member_(ps, [0.5, 1.0, 2.0], N, norm_type=norm_type)
        for i in range(N):
            mine = [b[i].clone().requires_grad_() for b in before]
            for q, b in zip(mine, before):
                q.grad = b[i].clone()
            want = torch.nn.utils.clip_grad_norm_(mine, [0.5, 1.0, 2.0][i], norm_type=norm_type)
            torch.testing.assert_close(norms[i], want, equal_nan=True)
            for p, q in zip(ps, mine):
                torch.testing.assert_close(p.grad[i], q.grad, equal_nan=True)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_steps_like_the_original(how):
    """torch's Optimizer.__getstate__ kept no n_members: a deepcopy/unpickled stacked optimizer raised AttributeError."""
    ps, opt, members, opts = stacked_pair(
        lambda ps: StackedAdam(ps, N, lr=LRS, amsgrad=True, weight_decay=0.1),
        lambda m, i: torch.optim.Adam(m, lr=LRS[i], amsgrad=True, weight_decay=0.1))
    step_both(ps, opt, members, opts, 0)
    copied = copy.deepcopy({"opt": opt, "ps": ps}) if how == "deepcopy" else pickle.loads(pickle.dumps({"opt": opt, "ps": ps}))
    for k in range(1, 4):
        step_both(copied["ps"], copied["opt"], members, opts, k)
    assert max_err(copied["ps"], members) < 1e-6
    with pytest.raises(OptimizerError, match="StackedCosineLR"):  # the copy's groups still check schedulers
        S.CosineAnnealingLR(copied["opt"], 5, eta_min=0.01)


# --- a model trained through plans of every strategy --------------------------------------------

class Net(nn.Module):
    """BatchNorm with momentum None, a weight used twice (emb.weight), a frozen bias, a parameter forward never uses."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(6, 8, bias=False)
        self.bn = nn.BatchNorm1d(8, momentum=None)
        self.fc = nn.Linear(8, 8)
        self.fc.bias.requires_grad_(False)
        self.unused = nn.Linear(2, 2)
        self.head = nn.Linear(8, 6, bias=False)
        self.head.weight = nn.Parameter(0.1 * torch.randn(6, 8))

    def forward(self, x):
        h = torch.tanh(self.bn(self.emb(x)))
        h = torch.relu(self.fc(h))
        return nn.functional.linear(h, self.emb.weight.t()) + self.head(h)


def _plan_with(strategy):
    members = []
    for i in range(N):
        torch.manual_seed(i)
        members.append(Net().train())
    graph = planner.trace(members[0], (torch.randn(5, 6),))
    plan = planner.propose(graph, n_members=N, input_mode="per_member")
    for s in plan.stages:
        if strategy == "chunked":
            plan = planner.set_options(plan, graph, s.id, chunk_size=2)
        elif s.mode.value == "batched" and strategy != "vmap":
            plan = planner.set_options(plan, graph, s.id, strategy=Strategy(strategy))
    if strategy == "loop":  # a stage excluded by an edit, beside the model's own excluded one
        plan = planner.exclude(plan, graph, plan.stages[-1].id) if plan.stages[-1].mode.value == "batched" else plan
    return plan, members


OPTIMIZERS = {
    "sgd": (lambda ps: StackedSGD(ps, N, lr=LRS, momentum=[0.9, 0.5, 0.0], dampening=[0.1, 0.0, 0.3],
                                  weight_decay=[1e-2, 0.0, 1e-1], maximize=True),
            lambda ps, i: torch.optim.SGD(ps, lr=LRS[i], momentum=[0.9, 0.5, 0.0][i], dampening=[0.1, 0.0, 0.3][i],
                                          weight_decay=[1e-2, 0.0, 1e-1][i], maximize=True)),
    "adam": (lambda ps: StackedAdam(ps, N, lr=[1e-2, 3e-3, 1e-3], betas=([0.9, 0.8, 0.5], 0.99), amsgrad=True,
                                    weight_decay=0.1),
             lambda ps, i: torch.optim.Adam(ps, lr=[1e-2, 3e-3, 1e-3][i], betas=([0.9, 0.8, 0.5][i], 0.99), amsgrad=True,
                                            weight_decay=0.1)),
    "adamw": (lambda ps: StackedAdamW(ps, N, lr=[1e-2, 3e-3, 1e-3], eps=[1e-8, 1e-3, 1e-6], weight_decay=[0.1, 0.0, 0.5]),
              lambda ps, i: torch.optim.AdamW(ps, lr=[1e-2, 3e-3, 1e-3][i], eps=[1e-8, 1e-3, 1e-6][i],
                                              weight_decay=[0.1, 0.0, 0.5][i])),
}


@pytest.mark.parametrize("strategy, opt_name", [("vmap", "adam"), ("wide", "sgd"), ("loop", "adamw"), ("chunked", "sgd")])
def test_training_through_any_strategy_equals_n_torch_runs(strategy, opt_name):
    """Two accumulated backward calls per step (two batch shapes), zero_grad(set_to_none=False), an eval under
    no_grad between steps, per-member clipping; parameters, BatchNorm state and optimizer state after each step."""
    plan, members = _plan_with(strategy)
    loop = copy.deepcopy(members)
    ens = executor.build(plan, members).train()
    make, make_torch = OPTIMIZERS[opt_name]
    opt = make(list(ens.parameters()))
    opts = [make_torch(list(m.parameters()), i) for i, m in enumerate(loop)]
    stacked = dict(ens.named_stacked_parameters())
    g = torch.Generator().manual_seed(7)
    for k in range(3):
        opt.zero_grad(set_to_none=False)
        for o in opts:
            o.zero_grad(set_to_none=False)
        for b in (5 + k, 3):
            x, y = torch.randn(N, b, 6, generator=g), torch.randn(N, b, 6, generator=g)
            ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
            for i, m in enumerate(loop):
                ((m(x[i]) - y[i]) ** 2).mean().backward()
        clip_grad_norm_per_member_(list(ens.parameters()), [0.5, 100.0, 1.0], N)
        for i, m in enumerate(loop):
            torch.nn.utils.clip_grad_norm_(m.parameters(), [0.5, 100.0, 1.0][i])
        opt.step()
        for o in opts:
            o.step()
        ens.eval()
        for m in loop:
            m.eval()
        with torch.no_grad():
            xe = torch.randn(N, 4, 6, generator=g)
            torch.testing.assert_close(ens(xe), torch.stack([m(xe[i]) for i, m in enumerate(loop)]), rtol=1e-5, atol=1e-6)
        ens.train()
        for m in loop:
            m.train()
        states = ens.member_state_dicts()
        for i, m in enumerate(loop):
            for key, want in m.state_dict().items():  # normwise over each tensor; integer buffers exactly
                if not want.is_floating_point():
                    assert torch.equal(states[i][key], want), f"step {k} member {i} {key}"
                    continue
                err = (states[i][key].double() - want.double()).abs().max().item()
                assert err <= 2e-5 * want.abs().max().item() + 1e-9, f"step {k} member {i} {key}: {err:.2e}"
            params = dict(m.named_parameters())
            for name, p in stacked.items():
                for sk, sv in opt.state.get(p, {}).items():
                    theirs = opts[i].state.get(params[name], {}).get(sk)
                    if theirs is not None:  # normwise: float32 sums in another order move the smallest entries most
                        err = (sv[i].reshape(theirs.shape).double() - theirs.double()).abs().max().item()
                        assert err <= 1e-5 * theirs.abs().max().item() + 1e-9, f"step {k} member {i} {name} {sk}: {err:.2e}"
    assert torch.equal(ens.member_state_dicts()[0]["unused.weight"], members[0].unused.weight.detach())
    assert not opt.state.get(stacked["unused.weight"]) and not opt.state.get(stacked["fc.bias"])


class NormThenReLUInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.act, self.out = nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.act(self.bn(self.fc(x))))


@pytest.mark.parametrize("strategies", [["loop"], ["vmap"], ["wide"], None])
def test_training_autotune_checks_an_in_place_activation_after_a_loop_stage(strategies):
    # Was: the check ran the stage's loop reference on rows of one [N, ...] tensor, so ReLU(inplace=True) saved a row
    # the next member's write changed, and autotune(train=True) raised torch's "modified by an inplace operation".
    members = []
    for i in range(3):
        torch.manual_seed(i)
        members.append(NormThenReLUInPlace())
    x = torch.randn(3, 8, 6)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x[0],)), n_members=3, input_mode="per_member")
    assert any(s.mode.value == "excluded" for s in plan.stages)  # BatchNorm in training runs as a loop
    tuned = executor.autotune(plan, members, (x,), train=True, budget="quick", strategies=strategies)
    ens = executor.build(tuned, copy.deepcopy(members))
    ens.train()
    ens(x).square().sum().backward()
    for i, m in enumerate(members):
        m.train()
        m(x[i]).square().sum().backward()
    stacked = dict(ens.named_stacked_parameters())
    for name in ("fc.weight", "out.weight"):
        torch.testing.assert_close(stacked[name].grad, torch.stack([dict(m.named_parameters())[name].grad for m in members]),
                                   rtol=1e-4, atol=1e-5)
