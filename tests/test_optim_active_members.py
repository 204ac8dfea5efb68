"""A step of some members only (PBT, bootstrap, a finished RL episode), against N torch optimizers.

The pattern: each member's loss, and backward of the sum of the active members' only
(`per_member_loss[active].sum().backward()`). N torch optimizers after `zero_grad()` (set_to_none) see grad None for the
members left out and skip them: no parameter change, no state change, no step count. A stacked optimizer sees zero
gradient rows, and a zero gradient is still a step (momentum, weight decay, Adam's count), so those members drifted
(0.11 and 0.12 off N torch AdamWs after 2 steps out). `opt.step(active=...)` leaves them as torch does, and a step
without it where some members' whole gradient is exactly zero warns once (MemberLeftOutWarning).

Reference: N models with their own torch.optim optimizers, backward only for the active members. The stacked side's
gradient is the batched loss of the active members, so the rows of the others are zero, as in the real pattern.
Error: max |stacked[i] - reference| / max |reference| per member and tensor, float32, at most 1e-5 (as tests/test_optim.py).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from stagewise import executor, planner
from stagewise.planner.errors import OptimizerError
from stagewise.executor.optim import MemberLeftOutWarning, StackedAdam, StackedAdamW, StackedSGD

TOL = 1e-5
N = 4
# who steps at each step: members switch in and out; member 3 sits out the first step (its state is created while
# out), member 2 the second (while member 3 has no momentum buffer yet: SGD takes its per-member buffer rules)
SCHEDULE = [[0, 1, 2], [0, 1, 3], [0], [1, 3], [0, 1, 2, 3], [2], [0, 2, 3], [0, 1, 2, 3]]

OPTIMIZERS = {
    "sgd_momentum_wd": (StackedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.05)),
    "sgd_nesterov_per_member_lr": (StackedSGD, torch.optim.SGD,
                                   dict(lr=[0.1, 0.05, 0.2, 0.02], momentum=0.8, weight_decay=[0.0, 0.1, 0.01, 0.05],
                                        nesterov=True)),
    "sgd_dampening": (StackedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3)),
    "adam": (StackedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    "adam_amsgrad_per_member": (StackedAdam, torch.optim.Adam,
                                dict(lr=[1e-2, 2e-2, 5e-3, 1e-2], betas=([0.9, 0.8, 0.9, 0.95], 0.999), amsgrad=True)),
    "adamw": (StackedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw_per_member": (StackedAdamW, torch.optim.AdamW, dict(lr=[1e-2, 3e-2, 1e-2, 2e-2], weight_decay=[0.1, 0.0, 0.3, 0.1])),
}


def member_params(i: int, complex_: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + i)
    p = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}
    if complex_:
        p["z"] = torch.randn(3, dtype=torch.complex64, generator=g)
    return p


def member_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ p["w"] + p["b"])
    loss = (h - 0.3).square().mean()
    if "z" in p:
        loss = loss + (h[:, :3] * (p["z"] * (1 + 0.5j)).abs()).mean()
    return loss


def one_value(v, i):
    return v[i] if isinstance(v, list) else v


def torch_kwargs(kw: dict, i: int) -> dict:
    out = {k: one_value(v, i) for k, v in kw.items() if k != "betas"}
    if "betas" in kw:
        out["betas"] = tuple(one_value(b, i) for b in kw["betas"])
    return out


def run(kind: str, complex_: bool, schedule, mask: bool):
    stacked_cls, torch_cls, kw = OPTIMIZERS[kind]
    refs = [{k: v.clone().requires_grad_() for k, v in member_params(i, complex_).items()} for i in range(N)]
    stacked = {k: torch.stack([r[k].detach() for r in refs]).requires_grad_() for k in refs[0]}
    opt = stacked_cls(list(stacked.values()), N, **kw)
    torch_opts = [torch_cls(list(r.values()), **torch_kwargs(kw, i)) for i, r in enumerate(refs)]
    for step, active in enumerate(schedule):
        x = torch.randn(N, 6, 5, generator=torch.Generator().manual_seed(100 + step))
        opt.zero_grad()
        losses = torch.stack([member_loss({k: v[i] for k, v in stacked.items()}, x[i]) for i in range(N)])
        losses[active].sum().backward()
        if mask:
            opt.step(active=torch.tensor([i in active for i in range(N)]) if step % 2 else active)
        else:
            opt.step()
        for i, (r, o) in enumerate(zip(refs, torch_opts)):
            o.zero_grad()  # set_to_none: a member left out has grad None, which torch skips
            if i in active:
                member_loss(r, x[i]).backward()
            o.step()
    return stacked, refs, opt, torch_opts


def worst(stacked, refs) -> list[float]:
    out = []
    for i, r in enumerate(refs):
        e = 0.0
        for k, v in r.items():
            ref = v.detach()
            e = max(e, float((stacked[k][i].detach() - ref).abs().max() / ref.abs().max()))
        out.append(e)
    return out


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_active_members_step_as_n_torch_optimizers(kind):
    complex_ = kind.startswith("adam")  # torch's Adam views complex parameters as real; SGD too, tested on real ones
    stacked, refs, opt, torch_opts = run(kind, complex_, SCHEDULE, mask=True)
    errs = worst(stacked, refs)
    assert max(errs) <= TOL, f"{kind}: per-member max rel err {errs}"
    if kind.startswith("adam"):  # each member's step count is its own, as torch's per parameter
        counts = [sum(i in a for a in SCHEDULE) for i in range(N)]
        for p in opt.state.values():
            assert p["step"].tolist() == counts
        for i, o in enumerate(torch_opts):
            for s in o.state.values():
                assert float(s["step"]) == counts[i]


def test_without_active_the_members_left_out_move():
    """What the mask is for: the same schedule without it drifts (a zero gradient is a step), and warns once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stacked, refs, _, _ = run("adamw", False, SCHEDULE, mask=False)
    errs = worst(stacked, refs)
    assert max(errs) > 1e-2
    left = [w for w in caught if issubclass(w.category, MemberLeftOutWarning)]
    assert len(left) == 1, [str(w.message)[:80] for w in caught]
    assert "member(s) [3] of 4" in str(left[0].message) and "active=" in str(left[0].message)
    assert left[0].filename == __file__


def test_no_warning_where_every_member_steps_or_the_mask_is_given():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run("adam", True, [[0, 1, 2, 3]] * 3, mask=False)
        run("sgd_momentum_wd", False, SCHEDULE, mask=True)
    assert not [w for w in caught if issubclass(w.category, MemberLeftOutWarning)]


def test_batched_module_pbt_step():
    """The reviewer's pattern through a built plan: members 1 and 2 sit out steps 2 and 3."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    members = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)) for _ in range(3)]
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (torch.randn(4, 8),)), n_members=3,
                           input_mode="per_member")
    refs = [copy.deepcopy(m) for m in members]
    ens = executor.build(plan, members)
    opt = executor.StackedAdamW(ens.parameters(), 3, lr=1e-2, weight_decay=0.1)
    torch_opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in refs]
    for step in range(4):
        x = torch.randn(3, 4, 8)
        active = [0, 1, 2] if step < 2 else [0]
        opt.zero_grad()
        ens(x).square().mean((1, 2))[active].sum().backward()
        opt.step(active=active)
        for i, (m, o) in enumerate(zip(refs, torch_opts)):
            o.zero_grad()
            if i in active:
                m(x[i]).square().mean().backward()
            o.step()
    sd = ens.member_state_dicts()
    for i, m in enumerate(refs):
        e = max(float((sd[i][k] - v).abs().max() / v.abs().max()) for k, v in m.state_dict().items())
        assert e <= TOL, f"member {i}: {e:.3e}"


@pytest.mark.parametrize("active, match", [
    ([True, False], "bool mask of 2 for 4"),
    ([0, 4], "no member 4"),
    ([-1], "no member -1"),
    (torch.tensor([0.0, 1.0]), "float32"),
    (torch.ones(2, 2, dtype=torch.bool), "shape"),
])
def test_bad_active_refused_before_any_change(active, match):
    p = torch.randn(N, 3, requires_grad=True)
    opt = StackedSGD([p], N, lr=0.1)
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    with pytest.raises(OptimizerError, match=match):
        opt.step(active=active)
    assert torch.equal(p.detach(), before)


def test_no_member_active_changes_nothing():
    p = torch.randn(N, 3, requires_grad=True)
    opt = StackedAdam([p], N, lr=0.1, weight_decay=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    opt.step(active=[])
    opt.step(active=torch.zeros(N, dtype=torch.bool))
    assert torch.equal(p.detach(), before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())


def test_warning_needs_the_whole_gradient_zero_and_reads_bfloat16():
    """A member with a zero row in some parameters only (the smallest, read first) is no member left out; bfloat16
    gradients are read too (as their bits: -0.0 is zero)."""
    w = torch.randn(N, 5, 3, requires_grad=True)
    b = torch.randn(N, 3, requires_grad=True)
    opt = StackedSGD([w, b], N, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
        b.grad[1] = 0
        opt.step()
        assert not caught
        wb = torch.randn(N, 4, dtype=torch.bfloat16, requires_grad=True)
        opt_b = StackedAdam([wb], N, lr=0.1)
        wb.grad = torch.randn_like(wb)
        wb.grad[2] = -0.0
        opt_b.step()
    assert [str(c.message).split(":")[1] for c in caught] == [" member(s) [2] of 4 have a gradient of exactly zero in every parameter while the others' are not"]


@pytest.mark.gpu
def test_left_out_warning_on_cuda_reads_nothing_synchronously():
    """On CUDA the flags come back through pinned memory: the warning arrives a step or two later, once."""
    p = torch.randn(N, 64, device="cuda", requires_grad=True)
    q = torch.randn(N, 8, device="cuda", requires_grad=True)
    opt = StackedAdam([p, q], N, lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            opt.zero_grad()
            ((p[:2] ** 2).sum() + (q[:2] ** 2).sum()).backward()
            opt.step()
            torch.cuda.synchronize()
    left = [c for c in caught if issubclass(c.category, MemberLeftOutWarning)]
    assert len(left) == 1 and "member(s) [2, 3] of 4" in str(left[0].message)
