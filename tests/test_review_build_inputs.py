"""Inputs and members as users hand them to the batched module, checked against plain torch (the member loop): a
per_member Python number on a torch.export plan is checked for every member, a shared input on the memory of a
per_member input forward() writes is refused, hooks on the stacked state's modules are refused (they never fire),
a per_member number reaching an op that takes a Python number runs as a loop; and the errors for a plan of another
model, a dict of members, a list for a per_member tensor, a None inside a dict input and str / bool arguments name
the problem and the fix."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor, planner
from stagewise.planner import ExecutionError, InputError, MemberError, PlanMismatchError, TraceError

torch.set_num_threads(1)
N = 3


def members_of(make, n=N):
    torch.manual_seed(0)
    return [make() for _ in range(n)]


def plan_of(members, example, mode="shared"):
    return planner.propose(planner.trace(copy.deepcopy(members[0]), example), n_members=N, input_mode=mode)


# --- 1. a per_member Python number on a torch.export plan ---------------------------------------------------------

class Policy(nn.Module):
    """A call counter updated in forward() sends the trace to torch.export, which fixes a Python number input."""

    def __init__(self):
        super().__init__()
        self.pi = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, obs, temperature):
        with torch.no_grad():
            self.calls += 1
        return F.softmax(self.pi(obs) / temperature, -1)


def _export_policy(mode):
    members = members_of(Policy)
    plan = plan_of(members, (torch.randn(2, 4), 1.0), {"obs": "shared", "temperature": mode})
    assert plan.tracer == "export"
    return members, plan


def test_a_per_member_number_on_an_export_plan_is_checked_for_every_member():
    members, plan = _export_policy("per_member")
    ens = executor.build(plan, members)
    ref = copy.deepcopy(members)
    obs = torch.randn(2, 4)
    with torch.no_grad():  # every member at the traced value: the graph's constant is right for all
        torch.testing.assert_close(ens(obs, torch.tensor([1.0, 1.0, 1.0])), torch.stack([m(obs, 1.0) for m in ref]),
                                   rtol=1e-6, atol=1e-7)
        # a sweep: members 1 and 2 would run member 0's (the traced) temperature, 0.36 and 0.48 off
        with pytest.raises(InputError, match=r"'temperature' is per_member.*member 1's 0.25.*\[N\] tensor"):
            ens(obs, torch.tensor([1.0, 0.25, 4.0]))
        with pytest.raises(InputError, match=r"'temperature' is per_member.*member 0's 0.25"):
            ens(obs, torch.tensor([0.25, 1.0, 1.0]))


def test_a_tensor_for_a_shared_export_number_is_an_input_error_naming_it():
    members, plan = _export_policy("shared")
    ens = executor.build(plan, members)
    # the guard compares `temperature == 1.0` and torch raises on a [3] tensor (was a raw RuntimeError)
    with torch.no_grad(), pytest.raises(InputError, match=r"'temperature' was traced as a Python float.*shape \[3\]"):
        ens(torch.randn(2, 4), torch.tensor([1.0, 2.0, 3.0]))


# --- 2. a shared input on the memory of a per_member input forward() writes ------------------------------------------

class WritesY(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        y.mul_(2)  # per_member y written in place; x read after it
        return self.fc(x) + y


def test_a_shared_view_of_a_written_per_member_input_is_refused():
    members = members_of(WritesY)
    plan = plan_of(members, (torch.randn(2, 4), torch.randn(2, 4)), {"x": "shared", "y": "per_member"})
    ens = executor.build(plan, members)
    ref = copy.deepcopy(members)
    y = torch.randn(N, 2, 4)
    before = y.clone()
    with torch.no_grad():
        with pytest.raises(InputError, match=r"shared input 'x' shares memory with the per_member input 'y'.*y\[0\]\.clone\(\)"):
            ens(y[0], y)  # the loop's write into y[0] reaches x: 0.25 off, before
        assert torch.equal(y, before)  # refused before anything ran
        x = y[0].clone()  # the fix the message names
        yb = y.clone()
        got = ens(x, y)
        want = torch.stack([m(x, yb[i]) for i, m in enumerate(ref)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, yb, rtol=0, atol=0)  # the caller's rows written as the loop writes them


# --- 3. hooks on the stacked state's modules --------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("register", ["register_forward_hook", "register_forward_pre_hook",
                                      "register_full_backward_hook", "register_full_backward_pre_hook"])
def test_hooks_on_the_stacked_state_modules_are_warned_about(register):
    members = members_of(MLP)
    ens = executor.build(plan_of(members, (torch.randn(5, 8),)), members)
    with pytest.warns(UserWarning, match=rf"{register} on a module of the batched module's stacked state.*never fire"
                                             r".*ens.register_forward_hook"):
        getattr(ens.stacked.fc1, register)(lambda *a: None)
    # the fix the message names: a hook on the batched module itself fires, on the N-first outputs
    ens.register_forward_hook(lambda m, i, o: o * 2)
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), 2 * torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)


# --- 4. the plan-mismatch message ------------------------------------------------------------------------------------

class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        if self.training:
            h = h.clamp(-1, 1)  # a training-only op (deterministic, so the loop can be compared)
        return self.fc2(torch.relu(h))


def test_a_plan_made_in_another_training_mode_is_named_so():
    x = torch.randn(5, 8)
    plan = planner.propose(planner.trace(Noisy().train(), (x,)), N)
    members = [m.eval() for m in members_of(Noisy)]
    with pytest.raises(PlanMismatchError, match=r"first plan node the model lacks: 'clamp', in graph order: after "
                                                r"'fc1'.*these members in training mode match the plan.*Call .train\(\)"):
        executor.build(plan, members)
    ens = executor.build(plan, [m.train() for m in members])  # the fix: the members in the plan's mode
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)


def test_a_plan_of_renamed_inputs_names_them():
    class Renamed(MLP):
        def forward(self, inp):
            return self.fc2(torch.relu(self.fc1(inp)))

    plan = planner.propose(planner.trace(MLP(), (torch.randn(5, 8),)), N)
    with pytest.raises(PlanMismatchError, match=r"the plan's model takes inputs \['x'\], these members' forward\(\) takes \['inp'\]"):
        executor.build(plan, members_of(Renamed))


# --- 5. a dict of members --------------------------------------------------------------------------------------------

def test_a_dict_of_members_names_the_dict_and_the_fix():
    members = members_of(MLP)
    plan = plan_of(members, (torch.randn(5, 8),))
    by_seed = {f"seed{i}": m for i, m in enumerate(members)}
    with pytest.raises(MemberError, match=r"list or tuple of modules, got a dict \(keys \['seed0', 'seed1', 'seed2'\]\): "
                                          r"pass list\(d.values\(\)\)"):
        executor.build(plan, by_seed)
    with pytest.raises(MemberError, match=r"got one state dict"):
        executor.build(plan, members[0].state_dict())
    ens = executor.build(plan, list(by_seed.values()))
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-6, atol=1e-6)


# --- 6. a per_member number where an op takes a Python number ---------------------------------------------------------

class Slopes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x, slope, alpha):
        return F.elu(self.fc2(F.leaky_relu(self.fc1(x), slope)), alpha)


def test_a_per_member_number_into_a_python_number_argument_runs_as_the_loop():
    members = members_of(Slopes)
    x = torch.randn(2, 4)
    plan = plan_of(members, (x, 0.1, 1.0), {"x": "shared", "slope": "per_member", "alpha": "per_member"})
    ens = executor.build(plan, members)
    slopes, alphas = [0.01, 0.1, 0.3], [0.5, 1.0, 2.0]
    for call in range(3):  # the first call finds it out (and warns), later ones run the loop straight away
        x = torch.randn(2 + call, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                got = ens(x, torch.tensor(slopes), torch.tensor(alphas))
        assert any("takes a Python number" in str(w.message) and "planner.exclude" in str(w.message) for w in caught) == (call == 0)
        want = torch.stack([m(x, s, a) for m, s, a in zip(members, slopes, alphas)])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # and it trains as the loop: gradients of each member's loss
    ref = copy.deepcopy(members)
    ens(x, torch.tensor(slopes), torch.tensor(alphas)).square().sum().backward()
    for m, s, a in zip(ref, slopes, alphas):
        m(x, s, a).square().sum().backward()
    for name, p in ens.named_stacked_parameters():
        want = torch.stack([dict(m.named_parameters())[name].grad for m in ref])
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6, msg=name)


# --- 7. smaller messages ---------------------------------------------------------------------------------------------

class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def test_a_per_member_list_of_tensors_is_told_to_stack():
    members = members_of(Lin)
    ens = executor.build(plan_of(members, (torch.randn(3, 4),), "per_member"), members)
    xs = [torch.randn(3, 4) for _ in range(N)]  # batch size 3 == N: the axis check alone lets it by
    with torch.no_grad():
        with pytest.raises(InputError, match=r"'x' is per_member and was traced as one tensor, got a list of 3: stack.*torch.stack\(x\)"):
            ens(xs)
        torch.testing.assert_close(ens(torch.stack(xs)), torch.stack([m(x) for m, x in zip(members, xs)]), rtol=1e-6, atol=1e-6)


class MaskedBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, batch):
        h = self.fc(batch["x"])
        m = batch.get("mask")
        return h * m.unsqueeze(-1) if m is not None else h


def test_a_none_inside_a_dict_input_traced_with_a_tensor_is_named():
    members = members_of(MaskedBatch)
    ens = executor.build(plan_of(members, ({"x": torch.randn(2, 4), "mask": torch.ones(2)},)), members)
    x = torch.randn(2, 4)
    with torch.no_grad():
        with pytest.raises(InputError, match=r"'batch' holds None at \['mask'\].*Pass a tensor there, or re-plan with None"):
            ens({"x": x, "mask": None})
        mask = torch.tensor([1.0, 0.0])
        torch.testing.assert_close(ens({"x": x, "mask": mask}), torch.stack([m({"x": x, "mask": mask}) for m in members]),
                                   rtol=1e-6, atol=1e-6)


class Heads(nn.Module):
    """A str head selector and a bool flag, with a buffer update sending the trace to torch.export."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, head, double):
        with torch.no_grad():
            self.calls += 1
        y = self.a(x) if head == "a" else self.b(x)
        return y * 2 if double else y


def test_str_and_bool_arguments_of_an_export_plan_are_named():
    members = members_of(Heads)
    x = torch.randn(2, 4)
    plan = plan_of(members, (x, "a", False))
    assert plan.tracer == "export"
    with pytest.raises(TraceError, match=r"fixed its input 'head' \(a Python str\).*example_inputs="):
        executor.build(plan, members)
    ens = executor.build(plan, members, example_inputs=(x, "a", False))
    ref = copy.deepcopy(members)
    with torch.no_grad():
        torch.testing.assert_close(ens(x, "a", False), torch.stack([m(x, "a", False) for m in ref]), rtol=1e-6, atol=1e-6)
        with pytest.raises(InputError, match=r"'head' is a Python str.*\('b'\).*a module for each value of 'head'"):
            ens(x, "b", False)
        with pytest.raises(InputError, match=r"'double' is a Python bool.*\(True\).*a module for each value of 'double'"):
            ens(x, "a", True)
