"""Stacked optimizers against the trusted reference: N separate models, each with its own torch.optim optimizer.

Every member has its own hyper-parameters. The stacked side holds the members' parameters as
[N, ...] leaf tensors; its gradient is each member's loss on its own batch, computed through
`torch.func.functional_call` on the member's slices (so the stacked grad is exactly the stack of
the per-member grads, and any difference is the optimizer's), plus one test through `vmap`.

Error measure: for each member and parameter, max |stacked[i] - reference| / max |reference|
(an elementwise ratio is meaningless at entries that cross zero); the worst over all must be
<= 1e-5 in float32. No tolerance had to differ, Adam's eps included: the bias corrections are
computed in float64 like torch's Python floats.
"""
from __future__ import annotations

import copy
import io
import math

import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from stagewise import executor, planner
from stagewise.planner.errors import OptimizerError
from stagewise.executor.optim import (
    StackedAdam, StackedAdamW, StackedCosineLR, StackedSGD, StackedStepLR, clip_grad_norm_per_member_,
)

TOL = 1e-5
NS = (1, 3, 8)
KINDS = ("mlp", "conv")


# --- members, batches and the two sides --------------------------------------------------------

def make_member(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2), nn.Flatten(),
                         nn.Linear(4 * 2 * 2, 3))


def member_batch(kind: str, n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [N, B, ...] and class targets [N, B]: each member its own batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 5, 6, generator=g) if kind == "mlp" else torch.randn(n, 5, 2, 6, 6, generator=g)
    return x, torch.randint(0, 3, (n, 5), generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


class Pair:
    """N reference models with their torch optimizers, and the same members stacked with one stacked optimizer."""

    def __init__(self, kind, n, torch_opt, torch_kw, stacked_opt, stacked_kw):
        self.kind, self.n = kind, n
        self.models = [make_member(kind, seed) for seed in range(n)]
        self.base = copy.deepcopy(self.models[0])
        self.names = [name for name, _ in self.base.named_parameters()]
        self.stacked = [torch.stack([dict(m.named_parameters())[name].detach() for m in self.models]).requires_grad_()
                        for name in self.names]
        self.torch_opts = [torch_opt(m.parameters(), **torch_kw(i)) for i, m in enumerate(self.models)]
        self.opt = stacked_opt(self.stacked, n, **stacked_kw)
        self.steps = 0

    def member_params(self, i):
        return {name: s[i] for name, s in zip(self.names, self.stacked)}

    def backward(self, x, y):
        """Stacked grads: the sum of member losses, each through the member's own slices."""
        self.opt.zero_grad()
        total = sum(loss_fn(torch.func.functional_call(self.base, self.member_params(i), (x[i],)), y[i])
                    for i in range(self.n))
        total.backward()

    def step(self, clip=None, hooks=()):
        x, y = member_batch(self.kind, self.n, self.steps)
        for i, (m, opt) in enumerate(zip(self.models, self.torch_opts)):
            opt.zero_grad()
            loss_fn(m(x[i]), y[i]).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip[i])
            opt.step()
        self.backward(x, y)
        if clip is not None:
            clip_grad_norm_per_member_(self.stacked, clip, self.n)
        self.opt.step()
        self.steps += 1

    def error(self) -> float:
        return max_rel_error(self.stacked, self.models, self.names)


def max_rel_error(stacked, models, names) -> float:
    worst = 0.0
    for i, m in enumerate(models):
        ref = dict(m.named_parameters())
        for name, s in zip(names, stacked):
            r = ref[name].detach()
            worst = max(worst, ((s[i].detach() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
    return worst


# per-member hyper-parameters, different for every member
def lrs(n, base=0.05):
    return [base * (1 + 0.5 * i) for i in range(n)]


def sgd_setup(n, variant):
    lr, wd, mom = lrs(n), [0.01 * i for i in range(n)], [0.9 - 0.1 * (i % 4) for i in range(n)]
    damp = [0.0] * n if variant != "dampening" else [0.1 + 0.1 * (i % 3) for i in range(n)]
    if variant == "dampening":  # a member without momentum ignores its dampening, as in torch
        mom = [0.0 if i % 3 == 1 else m for i, m in enumerate(mom)]
    nesterov, maximize = variant == "nesterov", variant == "maximize"
    torch_kw = lambda i: dict(lr=lr[i], momentum=mom[i], dampening=damp[i], weight_decay=wd[i],  # noqa: E731
                              nesterov=nesterov, maximize=maximize)
    return torch_kw, dict(lr=lr, momentum=mom, dampening=damp, weight_decay=wd, nesterov=nesterov, maximize=maximize)


def adam_setup(n, amsgrad=False, wd_base=0.01):
    lr = lrs(n, 0.01)
    b1 = [0.9 - 0.1 * (i % 3) for i in range(n)]
    b2 = [0.999 - 0.01 * (i % 2) for i in range(n)]
    eps = [1e-8 * 10 ** (i % 3) for i in range(n)]
    wd = [wd_base * (i + 1) for i in range(n)]
    torch_kw = lambda i: dict(lr=lr[i], betas=(b1[i], b2[i]), eps=eps[i], weight_decay=wd[i], amsgrad=amsgrad)  # noqa: E731
    return torch_kw, dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad)


# --- updates equal N torch optimizers ----------------------------------------------------------

@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", ["nesterov", "dampening", "maximize"])
def test_sgd_matches_torch_per_member(n, kind, variant):
    torch_kw, kw = sgd_setup(n, variant)
    pair = Pair(kind, n, torch.optim.SGD, torch_kw, StackedSGD, kw)
    for _ in range(3):
        pair.step()
        assert pair.error() <= TOL


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_matches_torch_per_member(n, kind, amsgrad):
    torch_kw, kw = adam_setup(n, amsgrad)
    pair = Pair(kind, n, torch.optim.Adam, torch_kw, StackedAdam, kw)
    for _ in range(3):
        pair.step()
        assert pair.error() <= TOL


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("kind", KINDS)
def test_adamw_matches_torch_per_member(n, kind):
    torch_kw, kw = adam_setup(n, wd_base=0.05)
    pair = Pair(kind, n, torch.optim.AdamW, torch_kw, StackedAdamW, kw)
    for _ in range(3):
        pair.step()
        assert pair.error() <= TOL


@pytest.mark.parametrize("schedule", ["all pause", "some pause", "one starts late"])
def test_momentum_switched_off_and_on_keeps_torch_buffer_rules(schedule):
    """torch keeps a member's buffer through steps at momentum 0 and carries it on after; a member that never had
    momentum starts with buf = grad. Momenta per step (rows) and member (columns), dampening on member 1."""
    n = 3
    plans = {"all pause": [[0.9] * 3, [0.9] * 3, [0.0] * 3, [0.0] * 3, [0.9] * 3, [0.5] * 3],
             "some pause": [[0.9, 0.8, 0.7], [0.9, 0.0, 0.7], [0.0, 0.0, 0.7], [0.9, 0.8, 0.0], [0.9, 0.8, 0.7]],
             "one starts late": [[0.0, 0.8, 0.0], [0.0, 0.8, 0.0], [0.9, 0.8, 0.0], [0.9, 0.0, 0.6], [0.9, 0.8, 0.6]]}
    damp = [0.0, 0.2, 0.0]
    pair = Pair("mlp", n, torch.optim.SGD, lambda i: dict(lr=0.05, momentum=0.5, dampening=damp[i]), StackedSGD,
                dict(lr=0.05, momentum=0.5, dampening=damp))
    for row in plans[schedule]:
        pair.opt.set_hyperparameter("momentum", row)
        for opt, mom in zip(pair.torch_opts, row):
            opt.param_groups[0]["momentum"] = mom
        pair.step()
        assert pair.error() <= TOL, f"momenta {row}"


def test_scalar_hyperparameters_match_torch_defaults():
    pair = Pair("mlp", 3, torch.optim.AdamW, lambda i: dict(lr=3e-3), StackedAdamW, dict(lr=3e-3))
    for _ in range(3):
        pair.step()
    assert pair.error() <= TOL
    assert pair.opt.param_groups[0]["lr"] == 3e-3  # a scalar lr stays the torch-visible group["lr"]


@pytest.mark.parametrize("opt_name", ["adam", "adamw", "amsgrad", "maximize"])
@pytest.mark.parametrize("equal_lists", [False, True])
def test_members_alike_step_as_torch_call_for_call(opt_name, equal_lists):
    """Every member with the same hyper-parameters and step count: the step is torch's own foreach
    Adam on Python scalars (no [N] coefficient tensors), so each member moves as its torch.optim run
    does, to the last bit or within an ulp of it (vectorised and tail lanes may round differently)."""
    n = 3
    torch_cls = torch.optim.AdamW if opt_name == "adamw" else torch.optim.Adam
    stacked_cls = StackedAdamW if opt_name == "adamw" else StackedAdam
    kw = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, amsgrad=opt_name == "amsgrad",
              maximize=opt_name == "maximize")
    stacked_kw = dict(kw, lr=[3e-3] * n, betas=([0.8] * n, [0.99] * n), eps=[1e-6] * n) if equal_lists else kw
    pair = Pair("mlp", n, torch_cls, lambda i: kw, stacked_cls, stacked_kw)
    for _ in range(4):
        pair.step()
        assert pair.error() <= 1e-6
    counted = OpCounter()
    pair.backward(*member_batch("mlp", n, 9))
    with counted:
        pair.opt.step()
    assert "_local_scalar_dense" not in counted.ops, "the alike path reads nothing from the device per step"
    assert not any(op in counted.ops for op in ("eq", "all", "stack", "pow")), counted.ops  # no [N] coefficient math


def test_member_counts_apart_take_the_per_member_path_without_reading_each_step():
    """After reset_member the step counts differ: the per-member formulas, and still no device read per step."""
    n = 3
    pair = Pair("mlp", n, torch.optim.Adam, lambda i: dict(lr=1e-2), StackedAdam, dict(lr=1e-2))
    pair.step()
    pair.opt.reset_member(2)
    pair.torch_opts[2] = torch.optim.Adam(pair.models[2].parameters(), lr=1e-2)
    reads = []
    for _ in range(3):
        x, y = member_batch("mlp", n, pair.steps)
        for i, (m, opt) in enumerate(zip(pair.models, pair.torch_opts)):
            opt.zero_grad()
            loss_fn(m(x[i]), y[i]).backward()
            opt.step()
        pair.backward(x, y)
        with OpCounter() as counted:
            pair.opt.step()
        pair.steps += 1
        reads.append(counted.ops.count("_local_scalar_dense"))
        assert pair.error() <= TOL
    assert reads[1:] == [0, 0], reads  # the counts are read once after the reset, then followed
    assert "stack" in counted.ops  # the per-member bias corrections


@pytest.mark.parametrize("n", NS)
def test_lr_sweep_of_identical_members(n):
    """A sweep: the same initial weights, only lr differs; each member follows its own torch run."""
    sweep = [10.0 ** -(1 + i * 3 / max(n - 1, 1)) for i in range(n)]
    pair = Pair("mlp", n, torch.optim.Adam, lambda i: dict(lr=sweep[i]), StackedAdam, dict(lr=sweep))
    for m in pair.models[1:]:
        m.load_state_dict(pair.models[0].state_dict())
    with torch.no_grad():
        for s in pair.stacked:
            s.copy_(s[0].expand_as(s))
    for _ in range(3):
        pair.step()
    assert pair.error() <= TOL
    if n > 1:  # the members did move apart
        assert not torch.allclose(pair.stacked[0][0], pair.stacked[0][-1])


def test_gradients_through_vmap_match_torch():
    """The realistic path: one vmap(functional_call) over the stacked params, loss = sum of member losses."""
    n = 4
    torch_kw, kw = adam_setup(n)
    pair = Pair("conv", n, torch.optim.Adam, torch_kw, StackedAdam, kw)

    def member_loss(params, x, y):
        return loss_fn(torch.func.functional_call(pair.base, params, (x,)), y)

    for step in range(3):
        x, y = member_batch("conv", n, step)
        for i, (m, opt) in enumerate(zip(pair.models, pair.torch_opts)):
            opt.zero_grad()
            loss_fn(m(x[i]), y[i]).backward()
            opt.step()
        pair.opt.zero_grad()
        params = dict(zip(pair.names, pair.stacked))
        torch.func.vmap(member_loss)(params, x, y).sum().backward()
        pair.opt.step()
    assert pair.error() <= TOL


def test_the_comparison_detects_a_wrong_member():
    """The check has teeth: giving two members each other's lr is far outside the tolerance."""
    torch_kw, kw = adam_setup(3)
    kw["lr"] = [kw["lr"][1], kw["lr"][0], kw["lr"][2]]
    pair = Pair("mlp", 3, torch.optim.Adam, torch_kw, StackedAdam, kw)
    for _ in range(2):
        pair.step()
    assert pair.error() > 1e-3


def test_set_hyperparameter_midway_takes_effect():
    n = 3
    torch_kw, kw = adam_setup(n)
    pair = Pair("mlp", n, torch.optim.Adam, torch_kw, StackedAdam, kw)
    pair.step()
    new_lr, new_b1, new_wd = [0.02, 0.001, 0.005], [0.5, 0.6, 0.7], 0.0
    pair.opt.set_hyperparameter("lr", new_lr)
    pair.opt.set_hyperparameter("betas", (new_b1, kw["betas"][1]))
    pair.opt.set_hyperparameter("weight_decay", new_wd)
    for i, opt in enumerate(pair.torch_opts):
        g = opt.param_groups[0]
        g["lr"], g["betas"], g["weight_decay"] = new_lr[i], (new_b1[i], g["betas"][1]), new_wd
    pair.step()
    pair.step()
    assert pair.error() <= TOL
    torch.testing.assert_close(pair.opt.get_hyperparameter("lr"), torch.tensor(new_lr, dtype=torch.float64))
    torch.testing.assert_close(pair.opt.get_hyperparameter("betas")[0], torch.tensor(new_b1, dtype=torch.float64))


def test_reset_member_restarts_it_like_a_fresh_torch_adam():
    n = 3
    torch_kw, kw = adam_setup(n)
    pair = Pair("mlp", n, torch.optim.Adam, torch_kw, StackedAdam, kw)
    pair.step()
    pair.step()
    pair.opt.reset_member(1)
    pair.torch_opts[1] = torch.optim.Adam(pair.models[1].parameters(), **torch_kw(1))
    pair.step()
    pair.step()
    assert pair.error() <= TOL
    assert pair.opt.state[pair.stacked[0]]["step"].tolist() == [4.0, 2.0, 4.0]


def test_zero_grad_and_params_without_grad():
    pair = Pair("mlp", 2, torch.optim.SGD, lambda i: dict(lr=0.1), StackedSGD, dict(lr=0.1))
    pair.step()
    pair.opt.zero_grad()
    assert all(s.grad is None for s in pair.stacked)
    before = [s.detach().clone() for s in pair.stacked]
    pair.opt.step()  # nothing has a grad: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(before, pair.stacked))


# --- per-member gradient clipping --------------------------------------------------------------

def stacked_with_grads(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(n, 4, 3), (n, 4), (n, 2, 3, 3, 3)]
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    for k, p in enumerate(params):
        scale = torch.tensor([0.01 * 10 ** (i % 3) for i in range(n)]).view((n,) + (1,) * (p.dim() - 1))
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("per_member_limit", [False, True])
def test_clip_grad_norm_per_member_matches_torch(n, norm_type, per_member_limit):
    params = stacked_with_grads(n)
    limits = [0.5 + i for i in range(n)] if per_member_limit else 1.0
    expected_norms, expected_grads = [], []
    for i in range(n):
        members = [p[i].detach().clone().requires_grad_() for p in params]
        for m, p in zip(members, params):
            m.grad = p.grad[i].clone()
        limit = limits[i] if per_member_limit else limits
        expected_norms.append(torch.nn.utils.clip_grad_norm_(members, limit, norm_type=norm_type))
        expected_grads.append([m.grad for m in members])
    norms = clip_grad_norm_per_member_(params, limits, n, norm_type=norm_type)
    torch.testing.assert_close(norms, torch.stack(expected_norms), rtol=TOL, atol=0)
    for i in range(n):
        for p, ref in zip(params, expected_grads[i]):
            torch.testing.assert_close(p.grad[i], ref, rtol=TOL, atol=1e-7)
    if n == 8 and norm_type == 2.0 and not per_member_limit:  # some members were clipped, some were not
        assert (norms > 1.0).any() and (norms < 1.0).any()


@pytest.mark.parametrize("n", NS)
def test_training_with_per_member_clipping(n):
    torch_kw, kw = sgd_setup(n, "nesterov")
    pair = Pair("conv", n, torch.optim.SGD, torch_kw, StackedSGD, kw)
    clip = [0.05 * (i + 1) for i in range(n)]
    for _ in range(3):
        pair.step(clip=clip)
        assert pair.error() <= TOL


# --- per-member LR schedules -------------------------------------------------------------------

def run_schedule(n, epochs, make_stacked, make_torch):
    """Both sides for `epochs` epochs of one step each; returns (pair, stacked lrs, torch lrs) per epoch."""
    torch_kw, kw = sgd_setup(n, "nesterov")
    pair = Pair("mlp", n, torch.optim.SGD, torch_kw, StackedSGD, kw)
    sched = make_stacked(pair.opt)
    torch_scheds = [make_torch(opt, i) for i, opt in enumerate(pair.torch_opts)]
    ours, theirs = [], []
    for _ in range(epochs):
        ours.append(pair.opt.get_hyperparameter("lr").clone())
        theirs.append(torch.tensor([opt.param_groups[0]["lr"] for opt in pair.torch_opts], dtype=torch.float64))
        pair.step()
        sched.step()
        for s in torch_scheds:
            s.step()
    return pair, torch.stack(ours), torch.stack(theirs)


@pytest.mark.parametrize("n", NS)
def test_step_lr_per_member_matches_torch(n):
    gamma = [0.5 + 0.1 * i for i in range(n)]
    step_size = [2 + i % 3 for i in range(n)]
    pair, ours, theirs = run_schedule(
        n, 10, lambda opt: StackedStepLR(opt, step_size=step_size, gamma=gamma),
        lambda opt, i: torch.optim.lr_scheduler.StepLR(opt, step_size=step_size[i], gamma=gamma[i]))
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    assert pair.error() <= TOL
    assert not torch.equal(ours[0], ours[-1])


@pytest.mark.parametrize("n", NS)
def test_cosine_lr_per_member_matches_torch(n):
    eta_min = [0.001 * i for i in range(n)]
    t_max = [4 + i for i in range(n)]
    pair, ours, theirs = run_schedule(
        n, 14, lambda opt: StackedCosineLR(opt, T_max=t_max, eta_min=eta_min),  # past T_max: both rise again
        lambda opt, i: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max[i], eta_min=eta_min[i]))
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-15)
    assert pair.error() <= TOL


@pytest.mark.parametrize("lr", [0.05, [0.05, 0.05, 0.05], [0.05, 0.1, 0.2]])
def test_cosine_lr_floor_is_eta_min_whether_members_share_one_lr_or_not(lr):
    # Was: members given one lr keep it as the shared scale, and eta_min was taken as a multiplier of it:
    # they annealed to 0.05 * 0.001 instead of 0.001.
    p = torch.nn.Parameter(torch.zeros(3, 2))
    opt = StackedSGD([p], 3, lr=lr)
    sched = StackedCosineLR(opt, T_max=10, eta_min=0.001)
    lrs = lr if isinstance(lr, list) else [lr] * 3
    refs = []
    for member_lr in lrs:
        q = torch.nn.Parameter(torch.zeros(2))
        ref = torch.optim.SGD([q], lr=member_lr)
        refs.append((ref, torch.optim.lr_scheduler.CosineAnnealingLR(ref, T_max=10, eta_min=0.001)))
    for _ in range(13):
        want = torch.tensor([ref.param_groups[0]["lr"] for ref, _ in refs], dtype=torch.float64)
        torch.testing.assert_close(opt.get_hyperparameter("lr").double(), want, rtol=1e-9, atol=1e-12)
        opt.step()
        sched.step()
        for ref, ref_sched in refs:
            ref.step()
            ref_sched.step()


@pytest.mark.parametrize("torch_sched", ["step", "exponential", "cosine"])
def test_torch_schedulers_scale_every_member(torch_sched):
    """torch.optim.lr_scheduler drives the shared scale group["lr"]: each member gets base_lr_i * f(t)."""
    n = 3
    make = {"step": lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
            "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.8),
            "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 5)}[torch_sched]
    pair, ours, theirs = run_schedule(n, 7, make, lambda opt, i: make(opt))
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-18)
    assert pair.error() <= TOL


# --- state dict round trip ---------------------------------------------------------------------

@pytest.mark.parametrize("opt_name", ["sgd", "sgd_one_without_momentum", "adam", "adamw"])
def test_state_dict_round_trip_continues_like_uninterrupted(opt_name):
    # sgd_one_without_momentum: was, the members-with-a-buffer mask came back as floats and step() raised TypeError
    n, kind = 3, "conv"
    cls, kw = {"sgd": (StackedSGD, sgd_setup(n, "nesterov")[1]), "adam": (StackedAdam, adam_setup(n, amsgrad=True)[1]),
               "sgd_one_without_momentum": (StackedSGD, dict(lr=[0.05, 0.1, 0.02], momentum=[0.9, 0.0, 0.5])),
               "adamw": (StackedAdamW, adam_setup(n)[1])}[opt_name]
    base = make_member(kind, 0)
    names = [name for name, _ in base.named_parameters()]

    def fresh_params():
        members = [make_member(kind, seed) for seed in range(n)]
        return [torch.stack([dict(m.named_parameters())[k].detach() for m in members]).requires_grad_() for k in names]

    def train(params, opt, sched, steps):
        for step in steps:
            x, y = member_batch(kind, n, step)
            opt.zero_grad()
            sum(loss_fn(torch.func.functional_call(base, {k: p[i] for k, p in zip(names, params)}, (x[i],)), y[i])
                for i in range(n)).backward()
            opt.step()
            sched.step()

    straight = fresh_params()
    opt = cls(straight, n, **kw)
    train(straight, opt, StackedCosineLR(opt, T_max=6, eta_min=[0.0, 1e-4, 1e-3]), range(4))

    first = fresh_params()
    opt = cls(first, n, **kw)
    sched = StackedCosineLR(opt, T_max=6, eta_min=[0.0, 1e-4, 1e-3])
    train(first, opt, sched, range(2))
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    resumed = [p.clone().requires_grad_() for p in saved["params"]]
    opt2 = cls(resumed, n, lr=0.5)  # other hyper-parameters: loading must bring the saved ones back
    sched2 = StackedCosineLR(opt2, T_max=99)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    train(resumed, opt2, sched2, range(2, 4))
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_dict_does_not_alias_the_live_learning_rates():
    p = [torch.zeros(2, 3, requires_grad=True)]
    opt = StackedSGD(p, 2, lr=[0.1, 0.2])
    sd = opt.state_dict()
    StackedStepLR(opt, 1, gamma=0.5).step()
    assert sd["param_groups"][0]["member_lr"].tolist() == [0.1, 0.2]


# --- kernel count independent of N -------------------------------------------------------------

class OpCounter(TorchDispatchMode):
    """Counts aten calls; a `_foreach_*` call over all params counts once, whatever N is."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


VIEW_OPS = {"view", "unbind", "expand", "alias", "detach", "_unsafe_view", "as_strided", "t"}


def count_step_ops(n, make_opt, clip):
    params = [torch.randn(n, 128, 64, requires_grad=True), torch.randn(n, 128, requires_grad=True),
              torch.randn(n, 64, 128, requires_grad=True), torch.randn(n, 64, requires_grad=True)]
    opt = make_opt(params, n)
    for _ in range(2):  # the first step creates state; count the second
        for p in params:
            p.grad = torch.randn_like(p)
        with OpCounter() as counter:
            if clip:
                clip_grad_norm_per_member_(params, [1.0] * n, n)
            opt.step()
    return counter.ops


@pytest.mark.parametrize("name,make_opt,clip", [
    ("sgd", lambda ps, n: StackedSGD(ps, n, lr=[0.1] * n, momentum=[0.9] * n, weight_decay=[1e-4] * n, nesterov=True), False),
    ("adam", lambda ps, n: StackedAdam(ps, n, lr=[1e-3] * n, betas=([0.9] * n, 0.99), weight_decay=1e-4, amsgrad=True), True),
    ("adamw", lambda ps, n: StackedAdamW(ps, n, lr=[1e-3] * n, eps=[1e-8] * n), False),
])
def test_kernel_count_does_not_grow_with_n(name, make_opt, clip):
    small, large = count_step_ops(4, make_opt, clip), count_step_ops(64, make_opt, clip)
    assert small == large
    compute = [op for op in small if op not in VIEW_OPS]
    foreach = [op for op in compute if op.startswith("_foreach")]
    assert foreach and len(compute) <= 64, f"{name}: {len(compute)} compute ops: {compute}"


# --- validation: one clear line, naming the hyper-parameter and the fix ------------------------

def params3():
    return [torch.zeros(3, 4, requires_grad=True), torch.zeros(3, requires_grad=True)]


@pytest.mark.parametrize("call,pattern", [
    (lambda: StackedAdam(params3(), 3, lr=[1e-3, 1e-3]), r"lr has 2 values .*n_members=3.*one per member"),
    (lambda: StackedSGD(params3(), 3, lr=-0.1), r"lr of member 0 is -0.1.*pass values in"),
    (lambda: StackedSGD(params3(), 3, lr=[0.1, -0.1, 0.1]), r"lr of member 1 is -0.1"),
    (lambda: StackedAdam(params3(), 3, betas=(1.0, 0.999)), r"betas\[0\] of member 0 is 1.*\[0.0, 1.0\)"),
    (lambda: StackedAdam(params3(), 3, betas=(0.9, [0.9, 0.99, 1.2])), r"betas\[1\] of member 2 is 1.2"),
    (lambda: StackedAdam(params3(), 3, betas=0.9), r"betas=0.9 is not a pair"),
    (lambda: StackedAdamW(params3(), 3, eps=-1e-8), r"eps of member 0"),
    (lambda: StackedAdamW(params3(), 3, weight_decay=[0.1, 0.1, -0.1]), r"weight_decay of member 2"),
    (lambda: StackedSGD(params3(), 3, lr=0.1, momentum=-0.5), r"momentum of member 0"),
    (lambda: StackedSGD(params3(), 3, lr="fast"), r"lr='fast' is not a number"),
    (lambda: StackedSGD(params3(), 3, lr=[[0.1, 0.1, 0.1]]), r"lr has 3 values \(shape \(1, 3\)\)"),
    (lambda: StackedSGD(params3(), 3, lr=float("nan")), r"lr=\[nan, nan, nan\] is not finite"),
    (lambda: StackedSGD(params3(), 4, lr=0.1), r"shape \(3, 4\) has no member axis of size n_members=4"),
    (lambda: StackedSGD(params3(), 0, lr=0.1), r"n_members=0; pass a positive int"),
    (lambda: StackedSGD(params3(), 3, lr=0.1, momentum=[0.9, 0.0, 0.9], nesterov=True), r"nesterov=True needs momentum > 0"),
    (lambda: StackedAdam(params3(), 3).set_hyperparameter("lr", [0.1] * 4), r"lr has 4 values .*n_members=3"),
    (lambda: StackedAdam(params3(), 3).set_hyperparameter("betas", (0.9, -0.1)), r"betas\[1\] of member 0 is -0.1"),
    (lambda: StackedAdam(params3(), 3).set_hyperparameter("momentum", 0.9), r"'momentum' is not a per-member .*use one of"),
    (lambda: StackedAdam(params3(), 3).reset_member(3), r"reset_member\(3\): no such member"),
    (lambda: StackedSGD(params3(), 3, lr=0.1, momentum=0.9, dampening=0.1).reset_member(0), r"dampening 0.1"),
    (lambda: clip_grad_norm_per_member_(stacked_with_grads(3), [1.0, 2.0], 3), r"max_norm has 2 values"),
    (lambda: clip_grad_norm_per_member_(stacked_with_grads(3), -1.0, 3), r"max_norm of member 0 is -1"),
    (lambda: clip_grad_norm_per_member_(stacked_with_grads(3), 1.0, 4), r"no member axis of size n_members=4"),
    (lambda: StackedStepLR(StackedSGD(params3(), 3, lr=0.1), 2, gamma=[0.5, 0.5]), r"gamma has 2 values"),
    (lambda: StackedStepLR(StackedSGD(params3(), 3, lr=0.1), 1.5), r"step_size=.*non-integer"),
    (lambda: StackedCosineLR(StackedSGD(params3(), 3, lr=0.1), T_max=0), r"T_max of member 0 is 0"),
    (lambda: StackedCosineLR(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1), T_max=5),
     r"SGD is not a stacked optimizer"),
])
def test_validation_errors(call, pattern):
    with pytest.raises(planner.OptimizerError, match=pattern) as info:
        call()
    assert isinstance(info.value, planner.StagewiseError)
    assert "\n" not in str(info.value)


def test_a_refused_setting_changes_nothing():
    opt = StackedAdam(params3(), 3, lr=[1e-3, 2e-3, 3e-3])
    with pytest.raises(planner.OptimizerError):
        opt.set_hyperparameter("lr", [0.1, -0.1, 0.1])
    assert opt.get_hyperparameter("lr").tolist() == [1e-3, 2e-3, 3e-3]


def test_loading_a_state_dict_for_another_n_is_refused():
    opt = StackedAdam(params3(), 3, lr=[1e-3, 2e-3, 3e-3])
    other = StackedAdam([torch.zeros(2, 4, requires_grad=True), torch.zeros(2, requires_grad=True)], 2)
    with pytest.raises(planner.OptimizerError, match=r"lr has 3 values .*n_members=2"):
        other.load_state_dict(opt.state_dict())


# --- torch optimizers that would mix the members -----------------------------------------------

@pytest.mark.parametrize("kind", [k for k in ("LBFGS", "Adafactor", "Muon") if hasattr(torch.optim, k)])
def test_a_torch_optimizer_that_would_mix_members_is_refused_at_its_first_step(kind):
    # Was: LBFGS (one line search over all members) and Adafactor (an [N, d] bias factored as one matrix) trained
    # the batched module's members off their own runs (3.5e-1 and 5.2e-2) without a word.
    from stagewise import executor

    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)) for _ in range(3)]
    x = torch.randn(6, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), n_members=3)
    for ens in (executor.build(plan, members), copy.deepcopy(executor.build(plan, members))):
        # Muon itself refuses the 3-D stacked weights; the stacked [N, d] biases it would take as matrices
        opt = getattr(torch.optim, kind)([p for p in ens.parameters() if kind != "Muon" or p.dim() == 2], lr=0.01)
        before = [p.detach().clone() for p in ens.parameters()]

        def closure():
            opt.zero_grad()
            loss = ens(x).square().sum()
            loss.backward()
            return loss

        closure()
        with pytest.raises(planner.OptimizerError, match=rf"torch.optim.{kind} on a batched module's parameters.*StackedAdam"):
            opt.step(closure)
        assert all(torch.equal(a, b) for a, b in zip(before, ens.parameters()))  # refused before it changed anything
    plain = nn.Linear(4, 2)  # the same optimizer on a model of its own steps as ever
    opt = getattr(torch.optim, kind)([plain.weight], lr=0.01)
    plain(x).square().sum().backward()
    opt.step(lambda: plain(x).square().sum())


def _normed_ensemble(n=3):
    from stagewise import executor

    members = []
    for i in range(n):
        torch.manual_seed(i)
        members.append(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)))
    x = torch.randn(4, 8)
    return executor.build(planner.propose(planner.trace(members[0], (x,)), n), members), x


def test_grouping_weight_decay_by_dim_warns_naming_the_member_axis():
    """Was: nanoGPT's `p.dim() < 2` put every bias and norm weight under decay (0.15 off after 20 AdamW steps)."""
    ens, _ = _normed_ensemble()
    params = dict(ens.named_stacked_parameters())
    by_dim = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    with pytest.warns(UserWarning, match=r"StackedAdamW: a param group has no weight decay .*counts the member axis"):
        StackedAdamW(by_dim, 3, lr=1e-3)
    by_name = [{"params": [p for k, p in params.items() if p.dim() - 1 >= 2], "weight_decay": 0.1},
               {"params": [p for k, p in params.items() if p.dim() - 1 < 2], "weight_decay": 0.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = StackedAdamW(by_name, 3, lr=1e-3)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4]


@pytest.mark.parametrize("kind", ["stacked", "torch"])
def test_a_grad_scaler_stepping_the_batched_module_is_refused(kind):
    """Was: one member's inf skipped every member's step and halved every member's scale (0.33-0.63 off)."""
    ens, x = _normed_ensemble()
    opt = StackedAdam(list(ens.parameters()), 3, lr=1e-3) if kind == "stacked" else torch.optim.Adam(ens.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in ens.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(ens(x).sum()).backward()
    with pytest.raises(OptimizerError, match="stepped by a torch.amp.GradScaler, which checks all members' gradients together"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, ens.parameters()))  # refused before any change
    opt.step()  # without the scaler it steps
    assert not all(torch.equal(a, b) for a, b in zip(before, ens.parameters()))
    off = torch.amp.GradScaler("cpu", enabled=False)  # GradScaler(enabled=(dtype == "float16")): off, step() alone
    off.scale(ens(x).sum()).backward()
    off.step(opt)
    off.update()


@pytest.mark.parametrize("write", ["dict_setitem", "dict_update"])
def test_an_lr_written_past_the_groups_checks_is_refused_at_the_next_step(write):
    """Was silent: dict.__setitem__(g, "lr", v) / dict.update(g, lr=v) skipped the check of what an absolute lr means
    while the members' lrs differ (here it would have scaled them: members at 5e-3 * [1, 2, 3] / 1e-3)."""
    ens, x = _normed_ensemble()
    opt = StackedAdam(list(ens.parameters()), 3, lr=[1e-3, 2e-3, 3e-3])
    ens(x).sum().backward()
    opt.step()
    for g in opt.param_groups:
        dict.__setitem__(g, "lr", 5e-3) if write == "dict_setitem" else dict.update(g, lr=5e-3)
    with pytest.raises(OptimizerError, match=r"written past the group's checks \(dict.__setitem__ or dict.update"):
        opt.step()
    alike = StackedAdam(list(ens.parameters()), 3, lr=1e-3)  # one lr for all members: the write sets it
    for g in alike.param_groups:
        dict.__setitem__(g, "lr", 5e-3)
    alike.step()
    assert alike.get_hyperparameter("lr").tolist() == pytest.approx([5e-3] * 3)


def test_stacked_optimizers_take_torchs_foreach_and_fused_flags():
    """Was: TypeError for nanoGPT's `AdamW(groups, lr=..., betas=..., fused=True)`."""
    for cls in (StackedSGD, StackedAdam, StackedAdamW):
        p = torch.nn.Parameter(torch.ones(3, 2))
        opt = cls([p], 3, lr=0.1, foreach=False, fused=True)
        p.grad = torch.ones(3, 2)
        opt.step()
        assert (p < 1).all()


def test_grouping_weight_decay_by_dim_warns_for_torch_optimizers_and_when_names_caught_the_biases():
    """Was: silent with torch.optim.AdamW on ens.named_parameters() (nanoGPT verbatim, 1e-2 off after 10 steps), and with
    timm's `ndim <= 1 or name.endswith('.bias')`, which left the norms' weights decayed (0.28 off after 5 SGD steps)."""
    ens, x = _normed_ensemble()
    params = dict(ens.named_stacked_parameters())
    by_dim = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(by_dim, lr=1e-3)
    ens(x).sum().backward()
    with pytest.warns(UserWarning, match=r"torch.optim.AdamW: a param group has no weight decay .*counts the member axis"):
        opt.step()
    with warnings.catch_warnings():  # said once per optimizer
        warnings.simplefilter("error")
        opt.step()
        torch.optim.AdamW(list(ens.parameters()), lr=1e-3, weight_decay=0.1).step()  # one group: decay for all, as a member's
    timm = [{"params": [p for k, p in params.items() if p.dim() > 1 and not k.endswith("bias")], "weight_decay": 0.1},
            {"params": [p for k, p in params.items() if p.dim() <= 1 or k.endswith("bias")], "weight_decay": 0.0}]
    with pytest.warns(UserWarning, match=r"decays parameters of shape \[3, 8\]"):
        StackedSGD(timm, 3, lr=0.1, weight_decay=0.1)


# --- per-member ReduceLROnPlateau ---------------------------------------------------------------

@pytest.mark.parametrize("mode,threshold_mode", [("min", "rel"), ("max", "abs")])
def test_stacked_reduce_on_plateau_is_n_torch_schedulers(mode, threshold_mode):
    n = 4
    torch.manual_seed(0)
    stacked = [torch.nn.Parameter(torch.randn(n, 3))]
    lrs, factors, patience, cooldown = [1e-2, 3e-3, 1e-3, 5e-2], [0.5, 0.1, 0.5, 0.3], [0, 2, 1, 3], [0, 1, 2, 0]
    opt = executor.StackedAdam(stacked, n, lr=lrs)
    sched = executor.StackedReduceLROnPlateau(opt, mode=mode, factor=factors, patience=patience, cooldown=cooldown,
                                              threshold_mode=threshold_mode, min_lr=[0.0, 1e-4, 0.0, 2e-3])
    refs = []
    for i in range(n):
        o = torch.optim.Adam([torch.nn.Parameter(torch.randn(3))], lr=lrs[i])
        refs.append((o, torch.optim.lr_scheduler.ReduceLROnPlateau(
            o, mode=mode, factor=factors[i], patience=patience[i], cooldown=cooldown[i], threshold_mode=threshold_mode,
            min_lr=[0.0, 1e-4, 0.0, 2e-3][i])))
    g = torch.Generator().manual_seed(1)
    for epoch in range(30):
        # plateaus of different lengths per member, some improving steps, a NaN
        metrics = torch.where(torch.rand(n, generator=g) < 0.3, torch.rand(n, generator=g), torch.ones(n))
        if epoch == 7:
            metrics[2] = float("nan")
        sched.step(metrics)
        for i, (o, s) in enumerate(refs):
            s.step(metrics[i].item())
        want = torch.tensor([o.param_groups[0]["lr"] for o, _ in refs], dtype=torch.float64)
        torch.testing.assert_close(opt.get_hyperparameter("lr"), want, rtol=1e-12, atol=0)
    assert len({float(x) for x in opt.get_hyperparameter("lr")}) > 1
    state = sched.state_dict()
    again = executor.StackedReduceLROnPlateau(opt, mode=mode)
    again.load_state_dict(state)
    torch.testing.assert_close(again.best, sched.best)


def test_stacked_reduce_on_plateau_refuses_one_metric_for_all_members():
    opt = executor.StackedSGD([torch.nn.Parameter(torch.randn(3, 2))], 3, lr=0.1)
    sched = executor.StackedReduceLROnPlateau(opt)
    with pytest.raises(planner.OptimizerError, match="one per member"):
        sched.step(torch.tensor(1.0))
    with pytest.raises(planner.OptimizerError, match="factor"):
        executor.StackedReduceLROnPlateau(opt, factor=1.5)


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_stacked_plateau_cuts_survive_a_stacked_step_schedule_and_min_lr_is_per_group():
    n = 3
    stacked = [torch.nn.Parameter(torch.randn(n, 3))]
    opt = executor.StackedSGD(stacked, n, lr=[1e-2, 2e-2, 4e-2])
    step = executor.StackedStepLR(opt, step_size=[2, 3, 4], gamma=0.5)
    plateau = executor.StackedReduceLROnPlateau(opt, factor=0.1, patience=0)
    refs = []
    for lr, size in zip([1e-2, 2e-2, 4e-2], [2, 3, 4]):
        o = torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=lr)
        refs.append((o, torch.optim.lr_scheduler.StepLR(o, size, 0.5), torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.1, patience=0)))
    for epoch in range(6):
        metric = [1.0 - 0.1 * epoch if epoch < 2 else 1.0] * n  # improving, then a plateau
        plateau.step(torch.tensor(metric))
        step.step()
        for (o, s, p), m in zip(refs, metric):
            p.step(m)
            s.step()
        torch.testing.assert_close(opt.get_hyperparameter("lr"), torch.tensor([o.param_groups[0]["lr"] for o, _, _ in refs],
                                                                              dtype=torch.float64), rtol=1e-9, atol=0)
    two = executor.StackedSGD([{"params": [torch.nn.Parameter(torch.randn(n, 2))]},
                               {"params": [torch.nn.Parameter(torch.randn(n, 2))]}], n, lr=1.0)
    sched = executor.StackedReduceLROnPlateau(two, factor=1e-4, patience=0, min_lr=[1e-3, 1e-2])  # torch's: per group
    for _ in range(2):
        sched.step(torch.ones(n))
    assert two.get_hyperparameter("lr", 0).tolist() == [1e-3] * n and two.get_hyperparameter("lr", 1).tolist() == [1e-2] * n
    with pytest.raises(planner.OptimizerError, match="could mean"):
        executor.StackedReduceLROnPlateau(executor.StackedSGD([{"params": [torch.nn.Parameter(torch.randn(2, 2))]},
                                                               {"params": [torch.nn.Parameter(torch.randn(2, 2))]}], 2),
                                          min_lr=[1e-3, 1e-2])


def test_a_cosine_schedule_above_zero_beside_a_plateau_scheduler_is_refused():
    opt = executor.StackedSGD([torch.nn.Parameter(torch.randn(3, 2))], 3, lr=[1.0, 0.5, 0.2])
    cosine = executor.StackedCosineLR(opt, T_max=10, eta_min=0.05)
    plateau = executor.StackedReduceLROnPlateau(opt, factor=0.1, patience=0)  # noqa: F841 - held, as a training loop holds it
    before = opt.get_hyperparameter("lr")
    with pytest.raises(planner.OptimizerError, match="Use one of the two"):
        cosine.step()
    torch.testing.assert_close(opt.get_hyperparameter("lr"), before)
