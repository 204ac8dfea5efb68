"""Input gradients no graph holds: a hook on an autograd node that forward() sets only where its input records
gradients (`if xs.requires_grad: xs.grad_fn.register_hook(...)` damping grad_input) changes x.grad alone, so neither
the parameters' gradients nor the outputs show it. The trace (and build, for a plan traced under torch.no_grad())
compares the inputs' gradients too, with the floating inputs requiring grad; verify(grads=True) compares each
member's x.grad with the batched x.grad[i]. Ordinary models whose input gradients agree must still pass."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner import ExecutionError, TraceError

torch.set_num_threads(1)
N = 3


def _damp(gi, go):
    return (gi[0] * 0.1 if gi[0] is not None else None,) + tuple(gi[1:])


class InputHook(nn.Module):
    """The reported model: the input's gradient scaled by 0.1 where the input records gradients."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        xs = x * 1.0
        if xs.requires_grad:  # damp the input gradient (an adversarial step)
            xs.grad_fn.register_hook(_damp)
        return self.fc2(torch.tanh(self.fc1(xs)))


class DictInputHook(InputHook):
    """A dict input (torch.fx keeps it; the hook set where fx does not look)."""

    def forward(self, batch):
        xs = batch["x"] * 1.0
        if not torch.fx._symbolic_trace.is_fx_tracing() and xs.grad_fn is not None:
            xs.grad_fn.register_hook(_damp)
        return self.fc2(torch.tanh(self.fc1(xs))) * batch["scale"]


class MLP(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(4, 16), nn.Linear(16, 2), nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


class Gather(nn.Module):
    """An integer index input (rows picked) beside a float input, and a float mask only compared."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, idx, mask):
        h = self.fc(x)[idx]
        return torch.where(mask > 0.5, h, -h)


class GradBranch(nn.Module):
    """Branches on x.requires_grad for a harmless reason (a copy it may then write)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if x.requires_grad:
            x = x.clone()
        return self.fc(x * 2.0)


class WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x.mul_(2.0)
        return self.fc(torch.tanh(x))


def _members(cls, *args):
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(cls(*args))
    return out


def _input_grads(ens, members, x, *extra):
    """(batched x.grad [N, ...], the loop's x_i.grad stacked) of sum(out * w), w fixed."""
    w = torch.randn(N, *members[0](x[0], *(e[0] for e in extra)).shape, generator=torch.Generator().manual_seed(1))
    xb = x.clone().requires_grad_(True)
    (ens(xb, *extra) * w).sum().backward()
    want = []
    for i, m in enumerate(members):
        xi = x[i].clone().requires_grad_(True)
        (m(xi, *(e[i] for e in extra)) * w[i]).sum().backward()
        want.append(xi.grad)
    return xb.grad, torch.stack(want)


@pytest.mark.parametrize("example_requires_grad", [False, True])
def test_input_gradient_hook_is_refused_at_trace_naming_the_input(example_requires_grad):
    """Before: traced (export), and the batched x.grad was 10x the loop's (9 of its norm off), no error."""
    ms = _members(InputHook)
    x = torch.randn(N, 5, 4)
    with pytest.raises(TraceError, match=r"other input gradients.*\(input x: 9 of its norm off\).*autograd\.Function"):
        planner.trace(copy.deepcopy(ms[0]), (x[0].clone().requires_grad_(example_requires_grad),))


def test_input_gradient_hook_of_frozen_members_is_refused():
    """No parameter requires grad (an attack on frozen members needs x.grad alone): refused all the same."""
    m = _members(InputHook)[0].requires_grad_(False)
    with pytest.raises(TraceError, match=r"input x: 9 of its norm off"):
        planner.trace(m, (torch.randn(5, 4),))


def test_input_gradient_hook_inside_a_dict_input_is_named_by_its_key():
    m = _members(DictInputHook)[0]
    batch = {"x": torch.randn(5, 4), "scale": torch.tensor(2.0)}
    with torch.no_grad():
        assert planner.trace(copy.deepcopy(m), (batch,)).tracer == "fx"
    with pytest.raises(TraceError, match=r"input batch\['x'\]: 9 of its norm off"):
        planner.trace(m, (batch,))


def test_plan_traced_under_no_grad_refuses_calls_with_gradients_naming_the_input():
    """Traced under torch.no_grad() (inference), the plan builds; a call with gradients on is refused, naming x (before:
    it ran and gave x.grad 10x the loop's); inference still runs and matches the loop."""
    ms = _members(InputHook)
    x = torch.randn(N, 5, 4)
    with torch.no_grad():
        plan = planner.propose(planner.trace(copy.deepcopy(ms[0]), (x[0].clone(),)), n_members=N,
                               input_mode="per_member")
    ens = executor.build(plan, ms)
    with torch.no_grad():
        got = ens(x)
        want = torch.stack([m(x[i]) for i, m in enumerate(ms)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ExecutionError, match=r"gradients on is refused.*input x: 9 of its norm off.*autograd\.Function"):
        ens(x.clone().requires_grad_(True)).sum().backward()


def test_verify_with_grads_reports_the_input_gradient_mismatch(monkeypatch):
    """The plan made without the refusal (the comparison of input gradients switched off, as before this check):
    verify(grads=True) said MATCH (it compared parameter gradients alone); now its `input x` row is 9 off."""
    import stagewise.planner.graph as graph_module
    monkeypatch.setattr(graph_module, "_input_grads_disagree", lambda *a: None, raising=False)
    ms = _members(InputHook)
    x = torch.randn(N, 5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(ms[0]), (x[0].clone().requires_grad_(True),)), n_members=N,
                           input_mode="per_member")
    ens = executor.build(plan, ms)
    got, want = _input_grads(ens, ms, x)
    assert float((got - want).norm() / want.norm()) == pytest.approx(9.0, rel=1e-4)  # the silent wrong answer
    report = executor.verify(plan, ms, (x.clone().requires_grad_(True),), grads=True)
    assert not report.ok
    row = next(r for r in report.gradients if r.name == "input x")
    assert not row.ok and row.max_rel == pytest.approx(9.0, rel=1e-4)
    assert all(r.ok for r in report.gradients if r.name != "input x")  # the parameters' gradients agree


@pytest.mark.parametrize("mode", ["per_member", "shared"])
def test_mlp_input_gradients_match_the_loop(mode):
    ms = _members(MLP)
    x = torch.randn(N, 5, 4) if mode == "per_member" else torch.randn(5, 4)
    example = (x[0] if mode == "per_member" else x).clone().requires_grad_(True)
    plan = planner.propose(planner.trace(copy.deepcopy(ms[0]), (example,)), n_members=N, input_mode=mode)
    ens = executor.build(plan, ms)
    if mode == "per_member":
        got, want = _input_grads(ens, ms, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    report = executor.verify(plan, ms, (x.clone().requires_grad_(True),), grads=True)
    assert report.ok, report.to_text()
    name = "input x" if mode == "per_member" else "input x (shared: the members' summed)"
    row = next(r for r in report.gradients if r.name == name)
    assert row.max_rel < 1e-5


def test_dropout_in_training_is_not_refused_and_its_input_gradients_match():
    """Both runs of the comparison draw the same dropout masks: no false refusal. Batched x.grad = the loop's where the
    members draw alike (one dropout stage, verify's seeded draws)."""
    ms = [m.train() for m in _members(MLP, 0.5)]
    x = torch.randn(N, 5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(ms[0]), (x[0].clone(),)), n_members=N, input_mode="per_member")
    executor.build(plan, ms)
    report = executor.verify(plan, ms, (x.clone().requires_grad_(True),), grads=True)
    row = next(r for r in report.gradients if r.name == "input x")
    assert report.ok and row.max_rel < 1e-5, report.to_text()


def test_integer_index_and_compared_float_inputs_are_not_refused():
    """idx (int64) is skipped, mask (float, only compared) has no gradient on either side: nothing to refuse; x.grad
    matches the loop."""
    ms = _members(Gather)
    x, idx, mask = torch.randn(N, 6, 4), torch.tensor([[0, 2, 5]] * N), torch.rand(N, 3, 3)
    plan = planner.propose(planner.trace(copy.deepcopy(ms[0]), (x[0].clone(), idx[0].clone(), mask[0].clone())),
                           n_members=N, input_mode="per_member")
    ens = executor.build(plan, ms)
    got, want = _input_grads(ens, ms, x, idx, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    report = executor.verify(plan, ms, (x.clone().requires_grad_(True), idx, mask), grads=True)
    assert report.ok, report.to_text()


@pytest.mark.parametrize("example_requires_grad", [False, True])
def test_harmless_branch_on_requires_grad_is_not_refused(example_requires_grad):
    """forward() copying its input where it requires grad: eager and graph gradients agree, whichever example (a plan
    traced with one that does not require grad refuses calls with one that does, naming the branch, as before)."""
    ms = _members(GradBranch)
    x = torch.randn(N, 5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(ms[0]), (x[0].clone().requires_grad_(example_requires_grad),)),
                           n_members=N, input_mode="per_member")
    if not example_requires_grad:
        executor.build(plan, ms)


def test_an_input_written_in_place_is_not_refused_and_its_gradient_matches():
    """forward() writing its input in place, which a leaf requiring grad refuses: the comparison gives it a non-leaf
    copy, no crash and no refusal; x.grad matches the loop."""
    ms = _members(WritesInput)
    x = torch.randn(N, 5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(ms[0]), (x[0].clone(),)), n_members=N, input_mode="per_member")
    ens = executor.build(plan, ms)
    xb = x.clone().requires_grad_(True)
    ens(xb.clone()).pow(2).sum().backward()
    want = []
    for i, m in enumerate(ms):
        xi = x[i].clone().requires_grad_(True)
        m(xi.clone()).pow(2).sum().backward()
        want.append(xi.grad)
    torch.testing.assert_close(xb.grad, torch.stack(want), rtol=1e-5, atol=1e-7)
    report = executor.verify(plan, ms, (x.clone().requires_grad_(True),), grads=True)
    assert report.ok and any(r.name == "input x" for r in report.gradients), report.to_text()
