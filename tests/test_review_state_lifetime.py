"""Review: the batched module's state over its lifetime, found by training it the way people do.

Each was a silent wrong answer or a crash: a loop stage's per-member views made under torch.no_grad() (a build or
`.to()` inside it) or from a frozen parameter carried no gradient back, so an optimizer skipped those weights; a
tensor replaced in the state tree (`load_state_dict(assign=True)`, `ens.stacked.fc.bias = nn.Parameter(...)`,
`torch.func.functional_call`) was not read, so the module went on with the old one; members that differ in weight
tying trained a tied member's two names apart; `copy.deepcopy` of the module failed; a build under
torch.inference_mode() failed with torch's own message.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import ExecutionError

N = 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def members_of(cls=MLP, n=N):
    out = []
    for i in range(n):
        torch.manual_seed(i)
        out.append(cls())
    return out


def plan_for(member, strategy):
    graph = planner.trace(copy.deepcopy(member), (torch.randn(5, 8),))
    plan = planner.propose(graph, N, input_mode="per_member")
    for s in list(plan.stages):
        plan = planner.set_options(plan, graph, s.id, strategy=strategy)
    return plan


def train_both(ens, loop, steps=3, lr=0.1):
    """`steps` SGD steps of the batched module and of each member alone on the same data; the largest weight difference."""
    torch.manual_seed(7)
    x, y = torch.randn(N, 5, 8), torch.randn(N, 5, 4)
    opt = executor.StackedSGD([p for p in ens.parameters() if p.requires_grad], N, lr=lr)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr) for m in loop]
    for _ in range(steps):
        opt.zero_grad()
        ((ens(x) - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        for i, m in enumerate(loop):
            opts[i].zero_grad()
            ((m(x[i]) - y[i]) ** 2).mean().backward()
            opts[i].step()
    got = ens.member_state_dicts()
    return max((got[i][k] - v).abs().max().item() for i, m in enumerate(loop) for k, v in m.state_dict().items())


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
@pytest.mark.parametrize("how", ["build under no_grad", "to() under no_grad", "new storage, then a no_grad call"])
def test_stages_built_under_no_grad_still_train(strategy, how):
    members = members_of()
    loop = copy.deepcopy(members)
    plan = plan_for(members[0], strategy)
    if how == "build under no_grad":
        with torch.no_grad():
            ens = executor.build(plan, members)
    else:
        ens = executor.build(plan, members)
        with torch.no_grad():
            if how == "to() under no_grad":
                ens.to("cpu", torch.float32)
            else:
                params = list(ens.parameters())
                torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(params).detach(), params)
                ens(torch.randn(N, 5, 8))
    ens.train()
    assert train_both(ens, loop) < 1e-5
    assert all(p.grad is not None for p in ens.parameters())


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_a_parameter_unfrozen_after_build_trains(strategy):
    members = members_of()
    for m in members:
        m.fc1.requires_grad_(False)
    loop = copy.deepcopy(members)
    ens = executor.build(plan_for(members[0], strategy), members).train()
    assert train_both(ens, loop, steps=1) < 1e-5  # frozen: fc1 stays
    ens.stacked.fc1.requires_grad_(True)
    for m in loop:
        m.fc1.requires_grad_(True)
    assert train_both(ens, loop) < 1e-5
    assert ens.stacked.fc1.weight.grad is not None


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_replaced_state_is_read(strategy):
    members = members_of()
    ens = executor.build(plan_for(members[0], strategy), members)
    x = torch.randn(N, 5, 8)
    ens.stacked.fc2.bias = nn.Parameter(torch.full((N, 4), 100.0))
    assert abs(ens(x).mean().item() - 100.0) < 1.0
    assert ens.member_state_dicts()[1]["fc2.bias"][0].item() == 100.0
    # load_state_dict(assign=True) hands in new Parameters: they are what trains
    loop = members_of()
    fresh = executor.build(plan_for(loop[0], strategy), members_of())
    ens.load_state_dict(fresh.state_dict(), assign=True)
    ens.train()
    assert train_both(ens, loop) < 1e-5


def test_functional_call_reads_the_given_weights():
    members = members_of()
    ens = executor.build(plan_for(members[0], "vmap"), members)
    x = torch.randn(N, 5, 8)
    zeros = {k: torch.zeros_like(v) for k, v in ens.state_dict().items()}
    assert torch.func.functional_call(ens, zeros, (x,)).abs().max().item() == 0.0
    params = {k: v.detach() for k, v in ens.named_parameters()}
    grads = torch.func.grad(lambda p: torch.func.functional_call(ens, p, (x,)).square().sum())(params)
    for i, m in enumerate(members):
        m.zero_grad()
        m(x[i]).square().sum().backward()
        torch.testing.assert_close(grads["stacked.fc2.weight"][i], m.fc2.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(members)]), rtol=1e-5, atol=1e-6)


class Tied(nn.Module):
    def __init__(self, tie=True):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 6), nn.Linear(6, 10, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_members_that_differ_in_tying_infer_but_refuse_training():
    members = [Tied(True), Tied(False), Tied(False)]
    ids = torch.randint(0, 10, (4,))
    graph = planner.trace(copy.deepcopy(members[0]), (ids,))
    ens = executor.build(planner.propose(graph, N), members)
    with torch.no_grad():
        torch.testing.assert_close(ens(ids), torch.stack([m(ids) for m in members]))
    ens.train()
    with pytest.raises(ExecutionError, match="weight tying"):
        ens(ids).sum().backward()


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_a_deepcopy_is_an_independent_module(strategy):
    members = members_of()
    ens = executor.build(plan_for(members[0], strategy), members)
    twin = copy.deepcopy(ens)
    x = torch.randn(N, 5, 8)
    torch.testing.assert_close(twin(x), ens(x))
    with torch.no_grad():
        twin.stacked.fc2.bias.add_(1.0)
    assert not torch.allclose(twin(x), ens(x))
    loop = copy.deepcopy(members)
    assert train_both(copy.deepcopy(ens).train(), loop) < 1e-5


def test_a_build_inside_inference_mode_works_and_trains_later():
    members = members_of()
    loop = copy.deepcopy(members)
    plan = plan_for(members[0], "loop")
    with torch.inference_mode():
        ens = executor.build(plan, members)
        x = torch.randn(N, 5, 8)
        torch.testing.assert_close(ens(x), torch.stack([m(x[i]) for i, m in enumerate(members)]))
    assert train_both(ens.train(), loop) < 1e-5


class RingBuffer(nn.Module):
    """Roll a buffer in place, then write its first slot through a view of the in-place op's result."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("mem", torch.randn(4, 6))

    def forward(self, x):
        y = self.lin(x)
        self.mem.copy_(torch.roll(self.mem, 1, 0))
        self.mem[0].copy_(y.mean(0))
        return y @ self.mem.t()


def test_a_write_through_a_view_of_an_in_place_result_reaches_the_state():
    members = [(torch.manual_seed(i), RingBuffer().eval())[1] for i in range(N)]
    reference = copy.deepcopy(members)
    x = torch.randn(2, 6)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N), members)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in reference]), rtol=1e-5, atol=1e-5)
    for i, m in enumerate(reference):
        torch.testing.assert_close(ens.member_state_dicts()[i]["mem"], m.mem)


class EmaInNoGrad(nn.Module):
    """An EMA buffer updated in place inside torch.no_grad(): fx changed the buffer, then gave up (no_grad)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("ema", torch.randn(6))

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * y.mean(0))
        return y - self.ema


class ScaleThenWrite(RingBuffer):
    """An in-place update, then an indexed write (fx fails at the setitem, after the update ran)."""

    def forward(self, x):
        y = self.lin(x)
        self.mem.mul_(0.5)
        self.mem[0] = y.mean(0)
        return y @ self.mem.t()


@pytest.mark.parametrize("cls", [EmaInNoGrad, ScaleThenWrite])
def test_in_place_updates_fx_ran_before_giving_up_are_traced_with_export(cls):
    members = [(torch.manual_seed(i), cls().eval())[1] for i in range(N)]
    reference = copy.deepcopy(members)
    x = torch.randn(4, 6)
    graph = planner.trace(members[0], (x,))
    assert graph.tracer == "export"
    for m, r in zip(members, reference):  # tracing left the member as it was
        for (k, a), b in zip(m.state_dict().items(), r.state_dict().values()):
            assert torch.equal(a, b), k
    ens = executor.build(planner.propose(graph, N), members)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in reference]), rtol=1e-5, atol=1e-5)


class MomentumTeacher(nn.Module):
    """BYOL / MoCo: a frozen teacher moved towards the student inside forward(), under no_grad."""

    def __init__(self):
        super().__init__()
        self.student, self.teacher = nn.Linear(8, 8), nn.Linear(8, 8)
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for ps, pt in zip(self.student.parameters(), self.teacher.parameters()):
                pt.mul_(0.9).add_(ps.detach(), alpha=0.1)
        return self.student(x) - self.teacher(x)


def test_tracing_leaves_parameters_forward_updates_as_they_were_and_verify_agrees():
    members = [(torch.manual_seed(i), MomentumTeacher().eval())[1] for i in range(N)]
    before = [copy.deepcopy(m.state_dict()) for m in members]
    x = torch.randn(4, 8)
    graph = planner.trace(members[0], (x,))  # on the member itself, as the README's recipe does
    for k, v in members[0].state_dict().items():
        assert torch.equal(v, before[0][k]), k
    plan = planner.propose(graph, N)
    assert executor.verify(plan, members, (x,), calls=3).ok
    reference = copy.deepcopy(members)
    ens = executor.build(plan, members)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in reference]), rtol=1e-5, atol=1e-6)


def test_one_members_state_loads_into_its_row():
    """Review: no way to put a member changed after build back (the module kept the build's copy, 1.92 off)."""
    from stagewise.planner.errors import MemberError

    members = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).eval()
               for _ in range(3)]
    x = torch.randn(5, 4)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), 3), members)
    with torch.no_grad():
        members[1][0].weight.mul_(2)
        members[1][1].running_var.fill_(3.0)
    ens.load_member_state_dict(1, members[1].state_dict())
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    with pytest.raises(MemberError, match=r"missing key\(s\) \['0.bias'"):
        ens.load_member_state_dict(0, {"0.weight": torch.zeros(8, 4)})
    with pytest.raises(MemberError, match=r"0.weight has shape \[4, 8\], one member's is \[8, 4\]"):
        ens.load_member_state_dict(0, {"0.weight": torch.zeros(4, 8)}, strict=False)
