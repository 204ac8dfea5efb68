"""Review: inputs, outputs and calls. Each was a silent wrong answer, now matching the member loop or refused:
a torch.export plan called at size 1 where forward() takes another path there (export traces a dynamic dim for
sizes of 2 and more); `wide` expanding a per-member tensor to new leading dims (with as many rows as members,
every member got every member's rows); outputs no member changes sharing one row of memory across members.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.planner.errors import InputError

N = 3


def members_of(cls, n=N):
    out = []
    for i in range(n):
        torch.manual_seed(i)
        out.append(cls().eval())
    return out


class SizeOneBranch(nn.Module):
    """A decode-step style branch on a size: fx cannot trace it, torch.export keeps the size >= 2 path."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] == 1:
            return self.fc(x) * 10
        return self.fc(x)


class SameAtEverySize(SizeOneBranch):
    """Also traced by torch.export (the branch is on a dim that is never 1), and right at batch 1."""

    def forward(self, x):
        if x.shape[1] == 3:
            return self.fc(x).squeeze(1)
        return self.fc(x)


def test_an_export_plan_refuses_a_size_its_graph_does_not_hold_for():
    members = members_of(SizeOneBranch)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(4, 4),))
    assert graph.tracer == "export"
    ens = executor.build(planner.propose(graph, N), members)
    for b in (4, 2, 6):
        x = torch.randn(b, 4)
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match="sizes of 2 and more"):
        ens(torch.randn(1, 4))


def test_an_export_plan_takes_size_one_where_its_graph_holds_there():
    members = members_of(SameAtEverySize)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(4, 1, 4),))
    assert graph.tracer == "export"
    assert graph.input_specs["x"].dynamic_dim(0).min <= 1
    ens = executor.build(planner.propose(graph, N), members)
    for b in (1, 5):
        x = torch.randn(b, 1, 4)
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


class ExpandedRow(nn.Module):
    """A learned row broadcast over the batch with expand (new leading dims)."""

    def __init__(self):
        super().__init__()
        self.fc, self.b = nn.Linear(4, 4), nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.fc(x) + self.b.expand(x.shape[0], -1) + self.b.expand(2, x.shape[0], 4).sum(0)


@pytest.mark.parametrize("batch", [N, 5])
def test_wide_expands_a_per_member_tensor_to_new_leading_dims_per_member(batch):
    members = members_of(ExpandedRow)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(batch, 4),))
    plan = planner.propose(graph, N)
    for s in list(plan.stages):
        plan = planner.set_options(plan, graph, s.id, strategy="wide")
    ens = executor.build(plan, members)
    for b in (batch, 7):
        x = torch.randn(b, 4)
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)


class MemberFreeOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x), torch.zeros(2), x * 2


@pytest.mark.parametrize("strategy", ["vmap", "wide", "loop"])
def test_every_members_output_has_its_own_memory(strategy):
    members = members_of(MemberFreeOutputs)
    x = torch.randn(2, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, N)
    for s in list(plan.stages):
        plan = planner.set_options(plan, graph, s.id, strategy=strategy)
    with torch.no_grad():
        out = executor.build(plan, members)(x)
    for k in (1, 2):
        before = out[k][1].clone()
        out[k][0] += 1.0  # the caller edits member 0's output
        torch.testing.assert_close(out[k][1], before)
        out[k].add_(1.0)  # and all of them at once


class FreshScalarTensor(nn.Module):
    """torch.tensor(<a size>) in forward(): export records a fresh copy detached in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            scale = torch.tensor(float(x.shape[0]))
        return self.fc(x) / scale


class SumAll(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            pass
        y = self.fc(x)
        return y * y.sum() + y.mean()


class PermutedShared(nn.Module):
    """A shared input indexed by a per-member permutation."""

    def __init__(self):
        super().__init__()
        self.fc, self.b = nn.Linear(4, 4), nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.fc(x[:, self.b.argsort()])


class NoiseOfInputShape(nn.Module):
    """torch.randn(x.shape) in eval: a draw with no tensor input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + 0.1 * torch.randn(x.shape)


@pytest.mark.parametrize("cls, strategy", [(FreshScalarTensor, None), (SumAll, "wide"), (PermutedShared, "wide"),
                                           (NoiseOfInputShape, None)])
def test_export_constants_wide_reductions_and_draws_match_the_loop(cls, strategy):
    members = members_of(cls)
    x = torch.randn(4, 4)
    graph = planner.trace(copy.deepcopy(members[0]), (x,))
    plan = planner.propose(graph, N)
    if strategy:
        for s in list(plan.stages):
            if s.mode.value == "batched":
                plan = planner.set_options(plan, graph, s.id, strategy=strategy)
    ens = executor.build(plan, members, example_inputs=(x,))
    with torch.no_grad():
        torch.manual_seed(3)
        got = ens(x)
        torch.manual_seed(3)
        want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class Ragged(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y[y > 0]


def test_outputs_whose_shape_depends_on_the_values_are_refused_by_name():
    members = members_of(Ragged)
    x = torch.randn(5, 4)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N)
    with pytest.raises(planner.errors.ExecutionError, match="different shapes"):
        executor.build(plan, members)(x)


def test_a_keyword_call_takes_the_plans_inputs_by_name():
    """`ens(**batch)`, as Hugging Face code calls a model: refused before, naming the positional form."""
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, mask):
            return self.fc(x) * mask

    torch.manual_seed(0)
    members = [TwoInputs() for _ in range(N)]
    x, mask = torch.randn(5, 4), torch.rand(5, 3)
    ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x, mask)), N), members)
    with torch.no_grad():
        want = torch.stack([m(x, mask) for m in members])
        torch.testing.assert_close(ens(mask=mask, x=x), want)
        torch.testing.assert_close(ens(x, mask=mask), want)
        with pytest.raises(InputError, match=r"\['y'\] are not inputs of the plan"):
            ens(x, y=mask)
        with pytest.raises(InputError, match=r"\['mask'\] not given"):
            ens(x=x)
        with pytest.raises(InputError, match=r"\['x'\] given both by position and by name"):
            ens(x, x=x, mask=mask)


class SignAtSizeOne(nn.Module):
    """At size 1 forward() takes another path, which changes only negative values."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] == 1:
            x = x.abs()
        return self.fc(x)


def test_the_size_one_check_does_not_rely_on_the_example_values():
    members = members_of(SignAtSizeOne)
    graph = planner.trace(copy.deepcopy(members[0]), (torch.rand(4, 4),))  # non-negative example: abs() is a no-op
    ens = executor.build(planner.propose(graph, N), members)
    with pytest.raises(InputError, match="sizes of 2 and more"):
        ens(torch.randn(1, 4))


class StepBranch(nn.Module):
    """A branch on an int buffer's value that a small change leaves on the same side."""

    def __init__(self, step=0):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("step", torch.tensor(step))

    def forward(self, x):
        y = self.fc(x)
        if self.step.item() < 10:
            y = y * 0.1
        return y


def test_a_branch_on_a_buffer_value_is_never_member_0s():
    members = [StepBranch(0), StepBranch(20), StepBranch(5)]
    x = torch.randn(4, 4)
    try:
        ens = executor.build(planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), N), members)
    except planner.errors.StagewiseError as e:
        assert "buffer" in str(e)
        return
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]), rtol=1e-5, atol=1e-6)



class _OneRowAgainstMany(torch.nn.Module):
    """At one row of x against several of y forward() takes another path; export gives x's and y's rows symbols of
    their own, and x cut to one row alone is where the graph and forward() differ."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        if x.shape[0] == 1 and y.shape[0] > 1:
            x = x * 0.5
        return self.l(x).mean(0) + self.l(y).mean(0)


def test_a_size_below_two_checked_only_together_with_another_dim_is_accepted_only_together():
    """Was (for a few commits): x at one row was accepted with y at any size, because the check had passed with
    both at one row; x[1], y[4] answered off by 0.52 without a word. Now: both at one size, or an InputError."""
    import copy
    import warnings

    from stagewise import executor, planner

    torch.manual_seed(0)
    members = [_OneRowAgainstMany() for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = planner.trace(copy.deepcopy(members[0]), (torch.randn(4, 8), torch.randn(4, 8)))
    plan = planner.propose(graph, 3)
    assert graph.tracer == "export"
    assert planner.Plan.from_json(plan.to_json()).inputs == plan.inputs  # small_with survives the plan file
    ens = executor.build(plan, copy.deepcopy(members))
    with torch.no_grad():
        for a, b in [(4, 4), (1, 1), (4, 1)]:
            x, y = torch.randn(a, 8), torch.randn(b, 8)
            torch.testing.assert_close(ens(x, y), torch.stack([m(x, y) for m in members]), rtol=1e-5, atol=1e-6)
        for a, b in [(1, 4), (1, 3)]:
            with pytest.raises(planner.InputError, match="checked against forward\\(\\) only with both at one size"):
                ens(torch.randn(a, 8), torch.randn(b, 8))
